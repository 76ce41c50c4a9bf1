"""Render benchmarks/results/machine_mapping.md from dp_bench.json (DDP results: ddp_predict.md).

Usage: .venv/bin/python benchmarks/mapping_report.py
"""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "benchmarks", "results")


def main() -> None:
    out = ["# Machine model, cost model and machine-mapping DP: measurements", ""]
    p = os.path.join(RES, "dp_bench.json")
    if os.path.exists(p):
        d = json.load(open(p))
        out += ["## DP solve time, data-parallel PCGs of the paper-size zoo on Summit", "",
                f"Command: `{d['command']}` (median of {d['args']['runs']} cold solves, each on a fresh mapper; "
                "warm = the same PCG again on the same mapper). Per-device batch as in the paper; Adam; fp32.", "",
                "| model | devices | PCG nodes | units | SP | solve (s, median) | warm (s) | predicted iteration | "
                "max memory / device | comm elements / iter |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            pit = f"{r['predicted_iteration_s'] * 1e3:.1f} ms" if r["feasible"] else "infeasible (out of memory)"
            mem = f"{r['max_memory_bytes'] / 2**30:.2f} GiB" if r["max_memory_bytes"] else "-"
            out.append(f"| {r['model']} | {r['devices']} | {r['pcg_nodes']} | {r['units']} | "
                       f"{'yes' if r['series_parallel'] else 'no'} | {r['solve_s_median']:.3f} | {r['warm_solve_s']:.3f} | "
                       f"{pit} | {mem} | {r['comm_elements']:.3g} |")
        a = d["agreement"]
        out += ["", "### DP optimum vs exhaustive enumeration (same cost model)", "",
                "| case | machine | DP (s) | exhaustive (s) | equal |", "|---|---|---|---|---|"]
        for c in a["cases"]:
            out.append(f"| {c['case']} | {c['machine']} | {c['dp']:.6e} | {c['exhaustive']:.6e} | "
                       f"{'yes' if c['equal'] else 'NO'} |")
        out.append("")
        out.append(f"All equal: {'yes' if a['all_equal'] else 'NO'}.")
        out.append("")
    p = os.path.join(RES, "dp_bench_degree6.json")
    if os.path.exists(p):
        d = json.load(open(p))
        out += ["## The DP's hard regime: data parallel of degree 6 on more devices", "",
                f"Command: `{d['command']}` (one cold solve). Every operator now has several views and branches "
                "may run side by side on a split of the devices.", "",
                "| model | devices | solve (s) | warm (s) | subproblems | predicted iteration |",
                "|---|---|---|---|---|---|"]
        for r in d["rows"]:
            pit = f"{r['predicted_iteration_s'] * 1e3:.1f} ms" if r["feasible"] else "infeasible (out of memory)"
            out.append(f"| {r['model']} | {r['devices']} | {r['solve_s_median']:.2f} | {r['warm_solve_s']:.3f} | "
                       f"{r['subproblems']} | {pit} |")
        out += ["", "Joins after a parallel split (Inception's 4-branch modules) are solved together with the join "
                "node by Pareto fronts instead of enumerating V^k branch-end views: `dp_join.md` has before/after.", ""]
    out += ["## Predicted vs measured torch DDP (gloo, CPU) on the tiny zoo models", "",
            "See `ddp_predict.md` (written by `benchmarks/ddp_predict.py`).", ""]
    notes = os.path.join(RES, "machine_mapping_notes.md")
    if os.path.exists(notes):
        out += ["", open(notes).read()]
    with open(os.path.join(RES, "machine_mapping.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
