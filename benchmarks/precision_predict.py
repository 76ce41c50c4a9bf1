"""Predicted effect of the precision (issue 9 point 1) on the zoo models at paper size: one training step
on one GPU (``unity-pcg simulate MODEL --machine M:1x1 --strategy none --precision P``, the paper's
per-device batch) and data parallel over 8 GPUs (``--strategy dp``, batch x 8), fp32 / tf32 / bf16, on
the dgx-a100 preset (datasheet) and the h100 preset (fitted from measurements on an H100).  Predictions
only: no GPU measured here (benchmarks/gpu_cost.py compares with measurements).

Writes benchmarks/results/precision_predict.json and .md.

Usage: .venv/bin/python benchmarks/precision_predict.py [--models a,b] [--machines h100,dgx-a100]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PRECISIONS = ("fp32", "tf32", "bf16")


def main(argv=None) -> int:
    from benchmarks.gpu_cost import model_path
    from unity_pcg import zoo
    from unity_pcg.commands.simulate_cmd import simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    ap.add_argument("--machines", default="h100,dgx-a100")
    ap.add_argument("--optimizer", default="adam")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        b = zoo.MODELS[name].paper_batch
        path = model_path(name, "paper", b)
        for mach in args.machines.split(","):
            for strat, size, batch in (("none", "1x1", b), ("dp", "1x8", 8 * b)):
                for prec in PRECISIONS:
                    t0 = time.perf_counter()
                    out = simulate(path, f"{mach}:{size}", strategy=strat, batch=batch, optimizer=args.optimizer,
                                   precision=prec)
                    bd = out["breakdown"]
                    rows.append({"model": name, "machine": f"{mach}:{size}", "strategy": strat, "batch": batch,
                                 "precision": prec, "time_s": out["predicted_iteration_s"],
                                 "compute_s": bd["compute_s"], "comm_s": bd["comm_s"],
                                 "grad_sync_s": bd["grad_sync_s"], "update_s": bd["update_s"],
                                 "comm_elements": out["comm_elements"], "max_memory_bytes": out["max_memory_bytes"],
                                 "feasible": out["feasible"], "solve_s": time.perf_counter() - t0})
                    print(f"{name:12s} {mach}:{size} {strat:4s} {prec}: {rows[-1]['time_s']}", file=sys.stderr,
                          flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    meta = {"command": "benchmarks/precision_predict.py " + " ".join(argv or sys.argv[1:]),
            "optimizer": args.optimizer}
    with open(os.path.join(RESULTS, "precision_predict.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    by = {(r["model"], r["machine"], r["precision"]): r for r in rows}
    md = ["# Predicted effect of the precision (no measurement)", "",
          "`unity-pcg simulate` on the presets (dgx-a100: datasheet; h100: fitted from measurements on an H100, "
          "`benchmarks/fit_h100.py`; measured steps against these predictions: `gpu_cost.md`), Adam, paper-size "
          "zoo models; one GPU at the paper's "
          "per-device batch (`none`) and 8 GPUs data parallel (`dp`, 8x the batch). Time in ms; memory of the "
          "busiest device in GiB; grad sync (fp32 in every precision) and activation transfer time in ms.", "",
          "| model | machine | fp32 ms | tf32 ms | bf16 ms | fp32 / bf16 | memory fp32 GiB | memory bf16 GiB | "
          "comm fp32 ms | comm bf16 ms | grad sync fp32 ms | grad sync bf16 ms |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    seen = []
    for r in rows:
        k = (r["model"], r["machine"])
        if k in seen:
            continue
        seen.append(k)
        a, t, c = (by[k + (p,)] for p in PRECISIONS)

        def ms(x):
            return "-" if x is None else f"{x * 1e3:.2f}"

        def gib(x):
            return "-" if x is None else f"{x / 2**30:.2f}"
        ratio = f"{a['time_s'] / c['time_s']:.2f}" if a["time_s"] and c["time_s"] else "-"
        md.append(f"| {k[0]} | {k[1]} | {ms(a['time_s'])} | {ms(t['time_s'])} | {ms(c['time_s'])} | {ratio} | "
                  f"{gib(a['max_memory_bytes'])} | {gib(c['max_memory_bytes'])} | {ms(a['comm_s'])} | "
                  f"{ms(c['comm_s'])} | {ms(a['grad_sync_s'])} | {ms(c['grad_sync_s'])} |")
    with open(os.path.join(RESULTS, "precision_predict.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
