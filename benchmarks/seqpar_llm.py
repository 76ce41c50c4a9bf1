"""Sequence parallelism in the tuned Megatron-LM grid (issue 19.2 / 19.5): the zoo's Llama 7B at reduced depth
(benchmarks/llm.py's setting: seq 2,048, global batch 1,024, bf16, Adam) on `h100:1x8` and `h100:2x8`, the tuned
Megatron (search/tuned.py) without the sp axis and with it, under the same deadline; and, from the run with it,
every grid point priced both ways (same tp, pp, micro-batch and techniques): predicted iteration time and the
busiest device's memory.  All numbers are predictions of our cost model.

    .venv/bin/python benchmarks/seqpar_llm.py --layers 8 --deadline 60
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")


def run(layers: int, deadline_s: float, nodes) -> dict:
    sys.path.insert(0, HERE)
    import llm
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.budget import Deadline
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.tuned import tune
    path, k = llm.model_path("llama_7b", layers)
    g = load_onnx(path, batch=llm.BATCH, load_weights=False)
    rows = []
    for n in nodes:
        m = parse_machine(f"h100:{n}x8")
        row = {"machine": m.name if hasattr(m, "name") else f"h100:{n}x8", "gpus": 8 * n, "layers": k}
        for sp in (False, True):
            mapper = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"), techniques=True)
            t0 = time.monotonic()
            r = tune(g, mapper, "megatron", Deadline.after(deadline_s), sequence_parallel=sp)
            row["with_sp" if sp else "without_sp"] = {
                "config": r.config.to_json() if r.config else None, "label": r.config.label() if r.config else None,
                "iteration_s": r.cost, "max_bytes": r.max_bytes, "feasible": r.feasible, "points": len(r.priced),
                "cut": bool(r.stats.get("cut")), "wall_s": time.monotonic() - t0}
            if sp:
                pairs: dict = {}
                for q in r.priced:
                    c = q["config"]
                    if c["tp"] > 1:
                        key = (c["tp"], c["pp"], c["micro_batch"], c["recompute"], c["distributed_optimizer"])
                        pairs.setdefault(key, {})["sp" if c["sp"] else "plain"] = (q["cost"], q["max_bytes"])
                row["pairs"] = [{"tp": a, "pp": b, "micro_batch": c, "recompute": d, "distributed_optimizer": e, **v}
                                for (a, b, c, d, e), v in sorted(pairs.items()) if len(v) == 2]
            print(json.dumps(row.get("with_sp" if sp else "without_sp")), file=sys.stderr, flush=True)
        rows.append(row)
    return {"model": "llama_7b", "layers": k, "seq": llm.LLAMA_SEQ, "batch": llm.BATCH, "deadline_s": deadline_s,
            "rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": platform.platform()}


def _t(x):
    return "infeasible" if x is None or x == float("inf") else f"{x * 1e3:.1f} ms"


def _gib(b):
    return f"{b / 2**30:.1f} GiB" if b else "-"


def report(data: dict) -> str:
    out = ["# Sequence parallelism in the tuned Megatron-LM grid (predicted)", "",
           f"`benchmarks/seqpar_llm.py`: zoo `llama_7b`, {data['layers']} blocks at full width, seq {data['seq']}, "
           f"global batch {data['batch']}, bf16, Adam; each tuned grid under a {data['deadline_s']:.0f} s deadline "
           "(`points`: technique points priced; `cut`: the deadline stopped the grid).  Memory: the busiest device.", "",
           "| GPUs | tuned Megatron without sp | with the sp axis | speedup |", "|---:|---|---|---:|"]
    for r in data["rows"]:
        a, b = r["without_sp"], r["with_sp"]

        def cell(x):
            return (f"{_t(x['iteration_s'])}, {_gib(x['max_bytes'])}: {x['label']} ({x['points']} points"
                    f"{', cut' if x['cut'] else ''})")
        sp = a["iteration_s"] / b["iteration_s"] if b["iteration_s"] and a["iteration_s"] not in (None, float("inf")) else None
        out.append(f"| {r['gpus']} | {cell(a)} | {cell(b)} | {f'{sp:.3f}x' if sp else '-'} |")
    out += ["", "The same grid point without and with sequence parallelism (from the run with the sp axis; per tensor and "
            "pipeline degree and recomputation, the micro-batch size fastest without sp, distributed optimizer on; every "
            "pair is in `seqpar_llm.json`):", "",
            "| GPUs | tp | pp | mbs | recompute | distopt | time | time sp | memory | memory sp |",
            "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    inf = float("inf")
    for r in data["rows"]:
        best: dict = {}
        for p in r["pairs"]:
            t = p["plain"][0] if p["plain"][0] is not None else inf
            k = (p["tp"], p["pp"], p["recompute"])
            if p["distributed_optimizer"] and t < inf and (k not in best or t < best[k][0]):
                best[k] = (t, p)
        for _, (_, p) in sorted(best.items()):
            (t0, m0), (t1, m1) = p["plain"], p["sp"]
            out.append(f"| {r['gpus']} | {p['tp']} | {p['pp']} | {p['micro_batch']} | {p['recompute']} | "
                       f"{'yes' if p['distributed_optimizer'] else 'no'} | {_t(t0)} | {_t(t1)} | {_gib(m0)} | {_gib(m1)} |")
    out += ["", f"Measured {data['when']} on {data['host']} (planner wall time only; the times are predictions)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--nodes", default="1,2")
    ap.add_argument("--report", action="store_true", help="rewrite the markdown from the JSON")
    a = ap.parse_args(argv)
    js, md = os.path.join(RESULTS, "seqpar_llm.json"), os.path.join(RESULTS, "seqpar_llm.md")
    if a.report:
        data = json.load(open(js))
    else:
        data = run(a.layers, a.deadline, [int(x) for x in a.nodes.split(",")])
        with open(js, "w") as f:
            json.dump(data, f, indent=1, default=lambda x: None)
    with open(md, "w") as f:
        f.write(report(data))
    print(report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
