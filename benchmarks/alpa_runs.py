"""Alpa's plans run (issue 18 points 3 and 7): ``optimize --strategy alpa`` over the import-coverage corpus, and
``run`` trains each plan as one process does.

For every transformers model of the corpus (``benchmarks/export_models.py``, small configs, legacy and dynamo
exports, plus BLOOM as in ``every_plan_runs.py``) on each machine, through the CLI as a user runs it, each step
in its own process::

    unity-pcg optimize FILE --machine local:1x4 --strategy alpa --budget 15 -o plan.json --json
    unity-pcg run plan.json --model FILE --steps 3 --loss mean --optimizer sgd --json
    unity-pcg simulate FILE --machine local:1x1 --strategy none -o one.json     # the reference, one process
    unity-pcg run one.json --model FILE --steps 3 --loss mean --optimizer sgd --json

``ok`` when every step's loss is within rtol 1e-4 (atol 1e-6) of the reference (``every_plan_runs.compare``).
A row that does not run says why in one line (``optimize: ...`` or ``run: ...``).  ``chosen`` is the plan's
``info.search.chosen`` (``alpa``, or what ``optimize`` returned instead when the executor refuses Alpa's plan).

    nice .venv/bin/python benchmarks/alpa_runs.py [--models gpt2,llama] [--exporters legacy] [--machines local:1x4]
                                                  [--budget 15] [--render]

Writes benchmarks/results/alpa_runs.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from every_plan_runs import (RESULTS, RTOL, STEPS, cli, compare, err_over_tol, last_line,  # noqa: E402
                             losses_of, models, plan_kind)

NAME = "alpa_runs"
RUN = ["--steps", STEPS, "--loss", "mean", "--optimizer", "sgd", "--json"]


def case(rec: dict, machines: list, budget: float, work: str) -> list[dict]:
    base = {k: rec[k] for k in ("model", "exporter")}
    if rec["error"]:
        return [dict(base, machine=m, ok=False, reason=f"export: {rec['error']}") for m in machines]
    tag = f"{rec['model']}-{rec['exporter']}"
    one = os.path.join(work, f"{tag}-one.json")
    rc, _, err = cli(["simulate", rec["path"], "--machine", "local:1x1", "--strategy", "none", "-o", one], 600)
    ref, why_ref = None, f"reference plan: {last_line(err)}" if rc else None
    if not rc:
        rc, out, err = cli(["run", one, "--model", rec["path"], *RUN], 900)
        ref = losses_of(out) if not rc else None
        why_ref = None if ref else f"one-process run: {last_line(err)}"
    rows = []
    for m in machines:
        row = dict(base, machine=m, kind="-", chosen="-", ok=False, max_rel=None, reason="")
        plan = os.path.join(work, f"{tag}-{m.replace(':', '_')}.json")
        t = time.perf_counter()
        rc, _, err = cli(["optimize", rec["path"], "--machine", m, "--strategy", "alpa", "--budget", budget,
                          "-o", plan, "--json"], budget + 200)
        row["optimize_s"] = round(time.perf_counter() - t, 1)
        if rc:
            rows.append(dict(row, reason=f"optimize: {last_line(err)}"))
            continue
        with open(plan) as f:
            pj = json.load(f)
        row["kind"] = plan_kind(pj)
        row["chosen"] = ((pj.get("info") or {}).get("search") or {}).get("chosen", "-")
        t = time.perf_counter()
        rc, out, err = cli(["run", plan, "--model", rec["path"], *RUN], 900)
        row["run_s"] = round(time.perf_counter() - t, 1)
        got = losses_of(out) if not rc else None
        if got is None:
            rows.append(dict(row, reason=f"run: {last_line(err)}"))
            continue
        if ref is None:
            rows.append(dict(row, reason=why_ref))
            continue
        rel, ok = compare(got, ref)
        rows.append(dict(row, max_rel=rel, ok=ok,
                         reason="" if ok else f"losses differ (err/tol {err_over_tol(got, ref):.2f})"))
    return rows


def render(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    n_ok = sum(r["ok"] for r in rows)
    L = [f"# `optimize --strategy alpa` plans run: {n_ok} of {len(rows)} train as one process does", "",
         f"Measured {meta['measured']} at commit {meta.get('commit') or '?'}; budget {meta['budget_s']:g} s, "
         f"{STEPS} steps, rtol {RTOL:g} against `simulate --strategy none` run in one process "
         f"(benchmarks/alpa_runs.py).", "",
         "| model | exporter | machine | plan | chosen | ok | max rel | optimize s | reason |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = "-" if r.get("max_rel") is None else f"{r['max_rel']:.1e}"
        L.append(f"| {r['model']} | {r['exporter']} | {r['machine']} | {r.get('kind', '-')} | {r.get('chosen', '-')} "
                 f"| {'yes' if r['ok'] else 'no'} | {rel} | {r.get('optimize_s', '-')} | {r['reason']} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="")
    ap.add_argument("--exporters", default="legacy,dynamo")
    ap.add_argument("--machines", default="local:1x4")
    ap.add_argument("--budget", type=float, default=15.0)
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    a = ap.parse_args(argv)
    js, md = os.path.join(RESULTS, f"{NAME}.json"), os.path.join(RESULTS, f"{NAME}.md")
    if a.render:
        with open(js) as f:
            data = json.load(f)
    else:
        names = [x for x in a.models.split(",") if x] or None
        exps = set(a.exporters.split(","))
        machines = a.machines.split(",")
        rows = []
        with tempfile.TemporaryDirectory() as work:
            for rec in models(names, False, 0.0):
                if rec["exporter"] not in exps:
                    continue
                for r in case(rec, machines, a.budget, work):
                    print(f"{r['model']:16s} {r['exporter']:7s} {r['machine']:10s} {'ok' if r['ok'] else 'NO':3s} "
                          f"{r.get('kind', '-')}  {r['reason']}", flush=True)
                    rows.append(r)
        from every_plan_runs import _commit
        data = {"meta": {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit(),
                         "budget_s": a.budget, "machines": machines, "steps": STEPS, "rtol": RTOL},
                "rows": rows}
        os.makedirs(RESULTS, exist_ok=True)
        with open(js, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    with open(md, "w") as f:
        f.write(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
