"""Before/after table for the DP's join handling, from dp_bench.py result files.

Usage: .venv/bin/python benchmarks/dp_join_report.py BEFORE_FULL AFTER_FULL BEFORE_DEG6 AFTER_DEG6
(JSON files written by ``benchmarks/dp_bench.py --out ...``; "before" runs use the mapper of the
parent commit of the change, same host, same load conditions, run back to back).
Writes benchmarks/results/dp_join.json and prints the markdown tables.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(path):
    with open(path) as f:
        d = json.load(f)
    return {(r["model"], r["devices"], r["dp_degree"]): r for r in d["rows"]}, d.get("command", "")


def main() -> int:
    bf, af, bd, ad = sys.argv[1:5]
    out = {}
    lines = []
    for title, b, a in (("Full data parallel (degree = devices)", bf, af), ("Degree 6 on more devices", bd, ad)):
        rb, cb = _rows(b)
        ra, ca = _rows(a)
        lines.append(f"### {title}\n\nbefore: `{cb}`; after: `{ca}`\n")
        lines.append("| model | devices | dp degree | before solve (s, median) | after solve (s, median) | speed-up |"
                     " subproblems before | after | predicted before | after |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for k in sorted(ra, key=lambda k: (k[0], k[1])):
            x, y = rb.get(k), ra[k]
            pa = y["predicted_iteration_s"]
            pb = x["predicted_iteration_s"] if x else None
            fmt = lambda p: "infeasible" if p is None else f"{p * 1e3:.2f} ms"
            sb = f"{x['solve_s_median']:.3f}" if x else "not run"
            sp = f"{x['solve_s_median'] / y['solve_s_median']:.1f}x" if x else ""
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {sb} | {y['solve_s_median']:.3f} | {sp} | "
                         f"{x['subproblems'] if x else ''} | {y['subproblems']} | {fmt(pb) if x else ''} | {fmt(pa)} |")
            out[f"{title}|{k[0]}|{k[1]}|{k[2]}"] = {
                "before_solve_s_median": x["solve_s_median"] if x else None,
                "before_solve_s_runs": x["solve_s_runs"] if x else None,
                "after_solve_s_median": y["solve_s_median"], "after_solve_s_runs": y["solve_s_runs"],
                "before_subproblems": x["subproblems"] if x else None, "after_subproblems": y["subproblems"],
                "before_predicted_s": pb, "after_predicted_s": pa}
        lines.append("")
    with open(os.path.join(ROOT, "benchmarks", "results", "dp_join.json"), "w") as f:
        json.dump({"rows": out, "sources": sys.argv[1:5]}, f, indent=2)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
