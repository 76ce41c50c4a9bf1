"""Every plan runs (issue 18 point 7): the plans ``optimize`` returns for the import-coverage corpus train as one
process does, for the joint search (``--strategy unity``, the default) or any strategy ``optimize --strategy``
accepts (``alpa``, ``megatron``, ``dp``, ...).

For every model of the corpus that this venv can export (``benchmarks/export_models.py``: the transformers
architectures at their small configs, both exporters, plus BLOOM, the decoder with ALiBi position biases whose
two-stage pipeline ``run`` used to refuse) and the onnx wheel's light models, on ``local:1x2`` and ``local:1x4``,
each step through the CLI as a user runs it, in its own process::

    unity-pcg optimize FILE --machine local:1xD --strategy S --budget 15 -o plan.json --json
    unity-pcg simulate FILE --strategy none -o one.json              # the reference: one device,
    unity-pcg run one.json --model FILE --steps 3 --lr LR --json     # one process
    unity-pcg run plan.json --model FILE --steps 3 --lr LR --json    # D ranks (the plan's device count)

and compares the per-step losses (mean of the model's first output, on the same seeded random feeds; SGD,
lr 0.01 unless the reference diverges, see below): ``ok`` when every step's |loss - reference| <= 1e-4 |reference| + 1e-6 (the absolute term only
matters for outputs whose mean is ~0 by construction: a LayerNorm's with zero bias gives ~1e-9 at step 1; from
step 2 the losses are >= 1e-4).  The exports are in eval mode (dropout off) and fp32, so no looser rule is
needed.  A light model whose input has batch 1 is optimized and simulated with ``--batch 4`` (data parallelism
needs a batch the devices divide); those of more than ``--light-max-gflop`` forward GFLOP per sample are rows
saying so.  The default, 10, runs the real-size CNNs up to ResNet-50 (8.2; minutes each at batch 4 on a shared
2-CPU host) and leaves out VGG-19 (39.3: 3 steps on 1 + 2 + 4 ranks would take about half an hour).  torchvision's
exports need their own venv (``export_models.py``) and are left out.  ``--rerun-failed`` measures the failed
cases (and those of ``--models``) again; ``--render`` rewrites the report from the JSON.

**Learning rate.**  The check is that a plan trains as one process does, not that SGD at lr 0.01 converges on a
model's real weights: where the one-process reference's loss is not finite at lr 0.01 (a model whose loss has
gradients far larger than its weights, e.g. the mean of a softmax output, which is flat but whose numerical
gradient is not), one probe step at lr 1 (``run --steps 1 --save-model``) measures the gradient as the change of the
trained initializers, and the reference reruns at ``choose_lr``: the lr whose first update is ``REL_UPDATE`` of the
weights' norm (further divided by 100 while still not finite, ``LR_TRIES`` in all).  The plan's runs use the same
lr; rows and table say which.

    .venv/bin/python benchmarks/every_plan_runs.py [--strategy alpa] [--models bert,bloom] [--machines local:1x2]
                                                   [--budget 15] [--no-light] [--light-max-gflop 10]
                                                   [--rerun-failed] [--render] [--note TEXT]

Writes benchmarks/results/every_plan_runs.json and .md for ``unity``, ``every_plan_runs_<strategy>`` for another
strategy (``--out NAME`` for another name).  (``--strategy alpa --no-light --machines local:1x4`` is what the
former ``benchmarks/alpa_runs.py`` measured.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
CACHE = os.path.join(HERE, ".cache", "coverage")
RESULTS = os.path.join(HERE, "results")
RTOL, ATOL = 1e-4, 1e-6
STEPS = 3
LR = 0.01                    # SGD's learning rate unless the one-process reference diverges at it
REL_UPDATE = 1e-3            # the chosen lr's first update, relative to the weights' norm
LR_TRIES = 4                 # reference runs past the first (the first at choose_lr, then each lr / 100)
EXTRA_HF = ["bloom"]         # beside the import-coverage corpus: the ALiBi decoder of the issue


def cli(args: list, timeout: float) -> tuple[int, str, str]:
    exe = os.path.join(os.path.dirname(sys.executable), "unity-pcg")
    try:
        p = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s"
    return p.returncode, p.stdout, p.stderr


def last_line(err: str) -> str:
    lines = [ln.strip() for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("[")]
    return (lines[-1] if lines else "")[:300]


def losses_of(out: str) -> list | None:
    try:
        return json.loads(out)["losses"]
    except (ValueError, KeyError, TypeError):
        return None


def compare(got: list, ref: list) -> tuple[float | None, bool]:
    """(the largest relative difference over the steps whose reference loss is at least 1e-4 in magnitude --
    a LayerNorm output's mean is ~1e-9 at step 1, where a relative difference says nothing --, ok)."""
    big = [abs(a - b) / abs(b) for a, b in zip(got, ref) if abs(b) >= 1e-4]
    ok = len(got) == len(ref) and all(abs(a - b) <= RTOL * abs(b) + ATOL for a, b in zip(got, ref))
    return (max(big) if big else None), ok


def err_over_tol(got: list, ref: list) -> float:
    """max over steps of |loss - reference| / (RTOL |reference| + ATOL): ok when <= 1."""
    return max(abs(a - b) / (RTOL * abs(b) + ATOL) for a, b in zip(got, ref))


def plan_kind(plan: dict) -> str:
    s = (plan.get("info") or {}).get("search") or {}
    pf = plan.get("pipeline")
    if pf:
        sizes = "+".join(str(len(st["devices"])) for st in pf["stages"])
        return f"pipeline {len(pf['stages'])} stages ({sizes} devices), M={pf['micro_batches']}"
    devs = {d for v in (plan.get("views") or {}).values() for d in _view_devices(v)}
    return f"{s.get('chosen', plan.get('info', {}).get('strategy'))} ({len(devs)} devices)"


def _view_devices(v: dict) -> list:
    from unity_pcg.machine import MachineView
    return list(MachineView.from_json(v).devices())


def models(names: list | None, light: bool, light_max_gflop: float) -> list[dict]:
    from export_models import HF_MODELS, export_one
    from import_coverage import light_models
    out = []
    os.makedirs(CACHE, exist_ok=True)
    for n in HF_MODELS + EXTRA_HF:
        if names and n not in names:
            continue
        for e in ("legacy", "dynamo"):
            rec = export_one("transformers", n, e)
            path = os.path.join(HERE, rec["file"])
            out.append({"model": n, "family": "transformers", "exporter": e, "path": path,
                        "error": None if rec["status"] in ("ok", "cached") else rec.get("error", "export failed")})
    if light:
        for p in light_models():
            n = os.path.basename(p)[:-5]
            if names and n not in names:
                continue
            from unity_pcg.onnx_import import load_onnx
            rec = {"model": n, "family": "onnx-light", "exporter": "shipped", "path": p, "error": None}
            g = load_onnx(p, load_weights=False)
            gf = g.flops() / 1e9
            if gf > light_max_gflop:
                rec["error"] = (f"left out: {gf:.1f} GFLOP per sample at real size (> --light-max-gflop "
                                f"{light_max_gflop:g}), too slow to train on this shared 2-CPU host")
            else:
                if any(n.a["shape"][:1] == (1,) for n in g.sources("Input")):
                    rec["batch"] = 4
            out.append(rec)
    return out


def nonfinite(rc: int, err: str, losses: list | None) -> bool:
    """Whether a ``run`` stopped on a non-finite loss (exit 4, DESIGN "Launch and failure codes") or returned one."""
    if losses is not None:
        return not all(math.isfinite(x) for x in losses)
    return rc == 4 or re.search(r"loss is -?(nan|inf)", err) is not None


def choose_lr(lr: float, grad_norm: float, weight_norm: float, rel: float = REL_UPDATE) -> float | None:
    """The learning rate whose first SGD update (lr x gradient) has norm ``rel`` x the weights' norm, at most
    ``lr``; None when either norm is not a finite positive number (no lr makes such a step)."""
    if not all(math.isfinite(x) and x > 0 for x in (grad_norm, weight_norm)):
        return None
    return min(lr, rel * weight_norm / grad_norm)


def update_norms(before: str, after: str, lr: float = 1.0) -> tuple[float, float] | None:
    """(norm of the gradient, norm of the weights) from a model file and the one ``run --save-model`` wrote after
    one SGD step at ``lr``: over the float initializers of both files that the step changed, the gradient is
    (before - after) / lr.  None when no initializer changed."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    def floats(path):
        m = onnx.load(path)
        return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer
                if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                   onnx.TensorProto.BFLOAT16)}
    w0, w1 = floats(before), floats(after)
    g2 = w2 = 0.0
    moved = False
    for name, a in w0.items():
        b = w1.get(name)
        if b is None or b.shape != a.shape or np.array_equal(a, b):
            continue
        moved = True
        g2 += float(np.sum(((a - b) / lr) ** 2))
        w2 += float(np.sum(a ** 2))
    return (math.sqrt(g2), math.sqrt(w2)) if moved else None


def reference_losses(run_at, probe) -> tuple[list | None, float, str | None]:
    """The one-process reference: (losses or None, the lr they were measured at, why there are none).

    ``run_at(lr) -> (rc, losses or None, stderr)`` runs the one-device plan; ``probe() -> (gradient norm, weight
    norm) or None`` measures the first step.  At ``LR`` first; where that loss is not finite, at
    ``choose_lr`` of the probe, then each lr / 100 while still not finite (``LR_TRIES`` runs in all).  A run that
    fails otherwise ends the search with its reason."""
    rc, got, err = run_at(LR)
    if not nonfinite(rc, err, got):
        return (got, LR, None) if got is not None else (None, LR, f"one-process run: {last_line(err)}")
    measured = probe()
    lr = choose_lr(LR, *measured) if measured else None
    if lr is None:
        return None, LR, (f"one-process run: {last_line(err)} (lr {LR:g}; the probe step measured no finite "
                          "gradient)")
    for i in range(LR_TRIES):
        rc, got, err = run_at(lr)
        if not nonfinite(rc, err, got):
            return (got, lr, None) if got is not None else (None, lr, f"one-process run: {last_line(err)}")
        if i + 1 < LR_TRIES:
            lr /= 100
    return None, lr, f"one-process run: {last_line(err)} (also at lr {lr:.3g})"


def _run_args(lr: float) -> list:
    return ["--steps", STEPS, "--loss", "mean", "--optimizer", "sgd", "--lr", repr(lr), "--json"]


def run_case(rec: dict, machines: list, budget: float, work: str, strategy: str = "unity") -> list[dict]:
    rows = []
    base = {k: rec[k] for k in ("model", "family", "exporter")}
    base["strategy"] = strategy
    bflag = ["--batch", rec["batch"]] if rec.get("batch") else []
    if rec["error"]:
        return [dict(base, machine=m, kind="-", steps=0, max_rel=None, ok=False, reason=rec["error"]) for m in machines]
    tag = f"{rec['model']}-{rec['exporter']}"
    one = os.path.join(work, f"{tag}-one.json")
    t = time.perf_counter()
    rc, out, err = cli(["simulate", rec["path"], "--machine", "local:1x1", "--strategy", "none", "-o", one, *bflag], 600)
    ref, lr = None, LR
    why_ref = f"reference plan: {last_line(err)}" if rc else None
    if not rc:
        def run_at(x):
            rc, out, err = cli(["run", one, "--model", rec["path"], *_run_args(x)], 900)
            return rc, (losses_of(out) if not rc else None), err

        def probe():
            saved = os.path.join(work, f"{tag}-probe.onnx")
            rc, _, _ = cli(["run", one, "--model", rec["path"], "--steps", 1, "--loss", "mean", "--optimizer",
                            "sgd", "--lr", "1.0", "--save-model", saved, "--json"], 900)
            return None if rc else update_norms(rec["path"], saved, 1.0)
        ref, lr, why_ref = reference_losses(run_at, probe)
    ref_s = time.perf_counter() - t
    for m in machines:
        row = dict(base, machine=m, kind="-", steps=0, max_rel=None, ok=False, reason="", reference=ref,
                   reference_s=round(ref_s, 1), lr=lr)
        plan = os.path.join(work, f"{tag}-{m.replace(':', '_')}.json")
        t = time.perf_counter()
        rc, out, err = cli(["optimize", rec["path"], "--machine", m, "--strategy", strategy, "--budget", budget,
                            "-o", plan, "--json", *bflag], budget + 200)
        row["optimize_s"] = round(time.perf_counter() - t, 1)
        if rc:
            rows.append(dict(row, reason=f"optimize: {last_line(err)}"))
            continue
        with open(plan) as f:
            pj = json.load(f)
        row["kind"] = plan_kind(pj)
        row["chosen"] = ((pj.get("info") or {}).get("search") or {}).get("chosen")
        row["executor_check"] = ((pj.get("info") or {}).get("search") or {}).get("executor_check")
        row["predicted_iteration_s"] = (pj.get("predicted") or {}).get("predicted_iteration_s")
        t = time.perf_counter()
        rc, out, err = cli(["run", plan, "--model", rec["path"], *_run_args(lr)], 900)
        row["run_s"] = round(time.perf_counter() - t, 1)
        got = losses_of(out) if not rc else None
        if got is None:
            rows.append(dict(row, reason=f"run: {last_line(err)}"))
            continue
        row.update(steps=len(got), losses=got)
        if ref is None:
            rows.append(dict(row, reason=why_ref))
            continue
        rel, ok = compare(got, ref)
        rows.append(dict(row, max_rel=rel, err_over_tol=err_over_tol(got, ref), ok=ok,
                         reason="" if ok else f"losses differ (err/tol {err_over_tol(got, ref):.2f})"))
    return rows


def write(rows: list, args, started: str, name: str, old_meta: dict | None = None) -> None:
    """Write ``name``.json (meta and rows) and ``name``.md (``render``); ``old_meta``: a rerun's or --render's
    (host, versions and the command kept from the measurement)."""
    import torch
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = "not installed"
    meta = dict(old_meta) if old_meta else {
        "measured": started, "host": f"{platform.platform()} ({os.cpu_count()} CPUs, shared)",
        "torch": torch.__version__, "transformers": tv, "budget_s": args.budget, "steps": STEPS,
        "rtol": RTOL, "atol": ATOL, "machines": args.machines.split(","), "strategy": args.strategy,
        "command": f"benchmarks/every_plan_runs.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}",
        "commit": _commit()}
    meta.setdefault("strategy", "unity")
    if args.note:
        meta["note"] = args.note
    meta.update(ok=sum(r["ok"] for r in rows), rows=len(rows))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(render(meta, rows))


def render(meta: dict, rows: list) -> str:
    """The report of a results file: header (strategy, how measured) and one table row per (case, machine)."""
    strategy = meta.get("strategy", "unity")
    n_ok = sum(r["ok"] for r in rows)
    n_left = sum(r["reason"].startswith("left out") for r in rows)
    n_run = len(rows) - n_left
    machines = " and ".join(meta.get("machines") or [])
    at = f" at commit {meta['commit']}" if meta.get("commit") else ""
    host = f" on {meta['host']}; torch {meta['torch']}, transformers {meta['transformers']}" if meta.get("host") else ""
    cmd = f" Command: `.venv/bin/python {meta['command']}`." if meta.get("command") else ""
    lines = [f"# Every plan runs: `optimize --strategy {strategy}`'s plans on {machines} train as one process does", "",
             f"Measured {meta['measured']}{at}{host}.{cmd}", "",
             f"Per model and machine: `unity-pcg optimize --strategy {strategy} --budget {meta['budget_s']:g}`, then "
             f"`unity-pcg run --steps {meta.get('steps', STEPS)}` (SGD at the row's lr: {LR:g} unless the one-process "
             "reference diverges there, see `every_plan_runs.py`; seeded random feeds, loss = mean of the first "
             f"output), against `simulate --strategy none` run on one process at the same lr. ok: every step within "
             f"|d| <= {RTOL:g} |ref| + {ATOL:g} (err/tol: the largest |d| / ({RTOL:g} |ref| + {ATOL:g}), <= 1; max "
             "rel loss diff: over the steps with |ref| >= 1e-4, as the first step's loss of a model ending in a "
             "LayerNorm is ~1e-9). Exports in eval mode (dropout off), fp32. Transformers: 2 layers, hidden 64, "
             "batch 2, sequence 16 (export_models.py); bloom is the ALiBi decoder of issue 18 (not in the "
             "import-coverage corpus). onnx-light: the onnx wheel's models, batch-1 inputs optimized at --batch 4. "
             "torchvision's exports need their own venv: left out. Rows marked rerun were measured again at the "
             "commit named.", "",
             *([meta["note"], ""] if meta.get("note") else []),
             f"**{n_ok} of {n_run} plans train to the one-process losses**"
             + (f" ({n_left} cases left out, named below)." if n_left else "."), "",
             "| model | exporter | machine | plan kind (chosen) | lr | steps | max rel loss diff | err/tol | optimize s "
             "| run s | ok / reason |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        got, ref = r.get("losses"), r.get("reference")
        rel = "-" if r.get("max_rel") is None else f"{r['max_rel']:.1e}"
        eot = "-"
        if got and ref:
            big, _ = compare(got, ref)
            rel = f"{big:.1e}" if big is not None else "-"
            eot = f"{err_over_tol(got, ref):.3f}"
        kind = r["kind"]
        if r.get("chosen") and r["chosen"] not in kind:
            kind = f"{kind} [{r['chosen']}]"
        mark = f" (rerun at {r['commit']})" if r.get("rerun") and not r["reason"].startswith("left out") else ""
        lines.append(f"| {r['model']} | {r['exporter']} | {r['machine']} | {kind} | {r.get('lr', LR):.3g} | "
                     f"{r['steps']} | {rel} | {eot} | {r.get('optimize_s', '-')} | {r.get('run_s', '-')} | "
                     f"{'ok' if r['ok'] else r['reason']}{mark} |")
    refused = [r for r in rows if isinstance(r.get("executor_check"), dict)]
    if refused:
        lines += ["", "Plans the search chose and the executor's pre-launch check refused (optimize returned the "
                  "alternative named):", ""]
        for r in refused:
            c = r["executor_check"]
            lines.append(f"- {r['model']} {r['exporter']} {r['machine']}: {c.get('chosen_before')}: "
                         f"{c.get('refused')} -> {c.get('returned')}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="unity",
                    help="optimize's --strategy (default unity; alpa, megatron, dp, zero3, ...)")
    ap.add_argument("--models", default="", help="comma-separated subset (model names)")
    ap.add_argument("--machines", default="local:1x2,local:1x4")
    ap.add_argument("--budget", type=float, default=15.0)
    ap.add_argument("--no-light", action="store_true", help="leave out the onnx wheel's light models")
    ap.add_argument("--light-max-gflop", type=float, default=10.0,
                    help="light models of more forward GFLOP per sample are left out (default 10)")
    ap.add_argument("--out", default=None,
                    help="results name (default every_plan_runs, every_plan_runs_<strategy> for another strategy)")
    ap.add_argument("--note", default="", help="a paragraph added to the report's header")
    ap.add_argument("--rerun-failed", action="store_true",
                    help="rerun the (model, exporter) cases of the existing results that have a row not ok (but an "
                         "optimize timeout), and those of the --models named, replacing their rows (marked rerun, "
                         "with the commit)")
    ap.add_argument("--render", action="store_true", help="only write the report again from the JSON results")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = "every_plan_runs" if a.strategy == "unity" else f"every_plan_runs_{a.strategy}"
    if a.render:
        with open(os.path.join(RESULTS, f"{a.out}.json")) as f:
            old = json.load(f)
        write(old["rows"], a, old["meta"]["measured"], a.out, old_meta=old["meta"])
        return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    names = [n for n in a.models.split(",") if n] or None
    rows: list = []
    again = None
    if a.rerun_failed:
        with open(os.path.join(RESULTS, f"{a.out}.json")) as f:
            old = json.load(f)
        rows, started = old["rows"], old["meta"]["measured"]
        if old["meta"].get("strategy", "unity") != a.strategy:
            ap.error(f"{a.out}.json holds --strategy {old['meta'].get('strategy', 'unity')} results, not {a.strategy}")
        # the failed cases (but those whose optimize ran out of time: minutes each, see the report), and every
        # case of the models named by --models
        again = {(r["model"], r["exporter"]) for r in rows
                 if (not r["ok"] and not r["reason"].startswith("optimize: timed out")) or (names and r["model"] in names)}
        names = sorted({m for m, _ in again})
    with tempfile.TemporaryDirectory(prefix="every-plan-") as work:
        for rec in models(names, not a.no_light, a.light_max_gflop):
            if again is not None and (rec["model"], rec["exporter"]) not in again:
                continue
            new = run_case(rec, a.machines.split(","), a.budget, work, a.strategy)
            for row in new:
                if again is not None:
                    row.update(rerun=True, commit=_commit())
                print(f"{row['model']:20s} {row['exporter']:7s} {row['machine']:10s} {row['kind'][:48]:48s} "
                      f"{'ok' if row['ok'] else row['reason'][:120]}", flush=True)
            if again is not None:
                at = [k for k, r in enumerate(rows) if (r["model"], r["exporter"]) == (rec["model"], rec["exporter"])]
                rows = rows[:at[0]] + new + rows[at[-1] + 1:] if at else rows + new
            else:
                rows.extend(new)
            write(rows, a, started, a.out, old_meta=old["meta"] if again is not None else None)
    return 0 if all(r["ok"] for r in rows) else 1


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
