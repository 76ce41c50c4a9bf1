"""Does `unity-pcg optimize` keep its `--budget` (issue 18 point 4)?  Wall time of the whole command (a fresh
process: start-up, import, search, plan written) against the budget, for a few paper-size models on Summit
and on 1,024 simulated GPUs.  Targets: <= 60 s at 192 GPUs, <= 120 s at 1,024, never more than 10% past the
budget.  The first row is the case of the issue: BERT-Large at its paper batch 4 (global) on summit:32x6
ran past 15 minutes (the unlimited DP solve of data parallelism at degree 4 on 192 devices).

    nice .venv/bin/python benchmarks/budget_check.py                 # every row (~8 minutes)
    nice .venv/bin/python benchmarks/budget_check.py --rows bert_large-b4
    .venv/bin/python benchmarks/budget_check.py --report             # budget_check.md from budget_check.json

The ``dp floor s`` column is ``optimize``'s data-parallel floor (``data_parallel_iteration_s``): data
parallelism priced, as every candidate is, with its cheapest memory techniques and overlap; ``dp techniques``
names them (``data_parallel_memory_plan``).  It is `simulate --strategy dp`'s price (plain DDP) only where
that column says ``plain``: DLRM at 1,024 GPUs takes ZeRO-3, whose one collective per unit beats DDP's ring
latency per 25 MiB gradient bucket (0.160 against 2.72 s).

Writes benchmarks/results/budget_check.json and .md.  Models are written once to benchmarks/.cache/ (as
fig14.py does: weight-free where the zoo can).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
RESULTS = os.path.join(HERE, "results")
JSON_OUT = os.path.join(RESULTS, "budget_check.json")
MD_OUT = os.path.join(RESULTS, "budget_check.md")

#: (row name, zoo model, global batch (None: per-GPU paper batch x devices), machine, budget s)
ROWS = (
    ("bert_large-b4", "bert_large", 4, "summit:32x6", 60.0),
    ("bert_large-192", "bert_large", None, "summit:32x6", 60.0),
    ("dlrm-192", "dlrm", None, "summit:32x6", 60.0),
    ("candle_uno-192", "candle_uno", None, "summit:32x6", 60.0),
    ("dlrm-1024", "dlrm", None, "h100:128x8", 100.0),
    ("bert_large-1024", "bert_large", None, "h100:128x8", 100.0),
)


def _devices(machine: str) -> int:
    from unity_pcg.machine import parse_machine
    return parse_machine(machine).num_devices


def run_row(row) -> dict:
    name, model, batch, machine, budget = row
    from fig14 import model_path, optimizer_of, per_gpu_batch
    D = _devices(machine)
    b = batch if batch is not None else per_gpu_batch(model) * D
    path = model_path(model)
    exe = os.path.join(os.path.dirname(sys.executable), "unity-pcg")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [exe, "optimize", path, "--machine", machine, "--budget", f"{budget:g}", "--batch", str(b),
               "--optimizer", optimizer_of(model), "--json", "-o", os.path.join(tmp, "plan.json")]
        t = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t
    out = {"row": name, "model": model, "batch": b, "machine": machine, "devices": D, "budget_s": budget,
           "wall_s": round(wall, 2), "wall_over_budget": round(wall / budget, 3), "rc": p.returncode,
           "command": "unity-pcg " + " ".join(cmd[1:-2]), "load_1min": round(os.getloadavg()[0], 2)}
    if p.returncode == 0:
        j = json.loads(p.stdout)
        s = j.get("search", {})
        out.update(search_s=round(j["search_s"], 2), predicted_iteration_s=j["predicted_iteration_s"],
                   data_parallel_iteration_s=j["data_parallel_iteration_s"],
                   data_parallel_memory_plan=j.get("data_parallel_memory_plan"), chosen=s.get("chosen"),
                   rule_steps=j["rule_steps"], phases=s.get("budget", {}).get("phases"),
                   dp_mapping=s.get("dp_mapping"))
    else:
        out["error"] = p.stderr[-2000:]
    return out


def techniques(mp: dict | None) -> str:
    """A memory plan summary (``data_parallel_memory_plan``) in words: ``ZeRO-3``, ``ZeRO-1, offload``,
    ``plain`` (none); ``-`` when the row does not record it."""
    if not mp:
        return "-"
    parts = ([f"ZeRO-{mp['zero']}"] if mp.get("zero") else []) + (["offload"] if mp.get("offload") else []) \
        + ([f"{mp['recompute_regions']} recomputed regions"] if mp.get("recompute_regions") else [])
    return ", ".join(parts) or "plain"


def report(rows: list[dict], meta: dict) -> str:
    o = ["# `optimize` against its budget (issue 18 point 4)", "",
         f"{meta.get('when', '?')}, commit {meta.get('commit', '?')}, {meta.get('host', '?')}; each row one "
         "`unity-pcg optimize` process, wall time from launch to exit (start-up and import included), run with "
         "`nice` on the shared 2-core box (load: the 1-minute load average after the row).", "",
         "`dp floor s`: optimize's data-parallel floor, priced with its cheapest memory techniques and overlap as "
         "every candidate is; `dp techniques` names them (`plain`: none, the price `simulate --strategy dp` gives)"
         + (f" ({meta['dp_techniques_backfilled']})" if meta.get("dp_techniques_backfilled") else "") + ".",
         "",
         "| row | machine | batch | budget s | wall s | wall / budget | search s | predicted s | dp floor s | "
         "dp techniques | chosen | load |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(x, d=3):
            return "-" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))
        o.append(f"| {r['row']} | {r['machine']} | {r['batch']} | {r['budget_s']:g} | {r['wall_s']:.1f} | "
                 f"{r['wall_over_budget']:.3f} | {f(r.get('search_s'), 1)} | {f(r.get('predicted_iteration_s'))} | "
                 f"{f(r.get('data_parallel_iteration_s'))} | {techniques(r.get('data_parallel_memory_plan'))} | "
                 f"{r.get('chosen') or r.get('error', '')[:80]} | "
                 f"{r.get('load_1min')} |")
    worst = max((r["wall_over_budget"] for r in rows), default=None)
    o += ["", f"Largest wall / budget: {worst}; rows more than 10% past the budget: "
              f"{sum(r['wall_over_budget'] > 1.1 for r in rows)} of {len(rows)}.", "",
          "Phases (seconds from the start: start / deadline / end) of each row:", ""]
    for r in rows:
        ph = r.get("phases") or {}
        o.append(f"- {r['row']}: " + "; ".join(f"{k} {v.get('start')}/{v.get('deadline')}/{v.get('end')}"
                                               for k, v in ph.items())
                 + (f" (data parallelism: {r['dp_mapping']})" if r.get("dp_mapping") else ""))
    return "\n".join(o) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all): "
                    + ", ".join(r[0] for r in ROWS))
    ap.add_argument("--report", action="store_true", help="write the markdown from the JSON only")
    a = ap.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    sys.path.insert(0, HERE)
    if a.report:
        with open(JSON_OUT) as f:
            d = json.load(f)
        with open(MD_OUT, "w") as f:
            f.write(report(d["rows"], d["meta"]))
        return 0
    want = set(a.rows.split(",")) if a.rows else None
    rows = [r for r in ROWS if want is None or r[0] in want]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "host": f"{platform.machine()}, {os.cpu_count()} cores", "command": "benchmarks/budget_check.py "
            + " ".join(argv if argv is not None else sys.argv[1:])}
    out = []
    for row in rows:
        print(f"{row[0]} ...", file=sys.stderr, flush=True)
        r = run_row(row)
        print(f"  wall {r['wall_s']} s for {r['budget_s']:g} s ({r['wall_over_budget']}x)"
              f"{'' if r['rc'] == 0 else ' FAILED'}", file=sys.stderr, flush=True)
        out.append(r)
        with open(JSON_OUT, "w") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=1)
    with open(MD_OUT, "w") as f:
        f.write(report(out, meta))
    return 0 if all(r["rc"] == 0 for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
