"""Memory-aware machine mapping: what the fallback costs when the time-optimal mapping does not fit.

For each case (zoo model at paper size, data parallel of degree ``deg`` on a Summit machine -- degree
1: the logical graph, every operator on one device, which the mapping may spread -- device memory set
to ``frac`` x the peak of the time-optimal mapping), a fresh :class:`MachineMapper`
maps the PCG twice: on the real device (time DP only) and on the shrunken one (time DP, then the
memory-aware Pareto DP).  Reports the predicted time of both mappings, the peak memory, and wall and
CPU seconds of each solve (CPU time is the load-robust figure on a shared machine).

Usage:  .venv/bin/python benchmarks/memory_dp_bench.py [--cases mlp:2x6:6:0.75,...] [--out FILE]
(the models are exported once into benchmarks/.cache/ as dp_bench.py does)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

DEFAULT = "dlrm:1x6:1:0.25,mlp:2x6:6:0.75,mlp:4x6:6:0.5,inception_v3:2x6:6:0.75"


def run_case(name: str, shape: str, deg: int, frac: float) -> dict:
    from dp_bench import model_path
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    g = load_onnx(model_path(name), batch=zoo.MODELS[name].paper_batch * deg, load_weights=False)
    pg = data_parallel(g, deg)
    m = parse_machine(f"summit:{shape}")
    opt = zoo.MODELS[name].paper_optimizer
    w, c = time.perf_counter(), time.process_time()
    r0 = MachineMapper(CostModel(m, opt)).optimize(pg)
    w0, c0 = time.perf_counter() - w, time.process_time() - c
    cap = int(r0.memory.max_bytes * frac)
    small = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=cap))
    w, c = time.perf_counter(), time.process_time()
    r = MachineMapper(CostModel(small, opt)).optimize(pg)
    w1, c1 = time.perf_counter() - w, time.process_time() - c
    return {"model": name, "machine": f"summit:{shape}", "dp_degree": deg, "capacity_fraction": frac,
            "time_optimal_s": r0.cost, "time_optimal_peak_bytes": r0.memory.max_bytes,
            "time_dp_wall_s": w0, "time_dp_cpu_s": c0,
            "capacity_bytes": cap, "feasible": r.feasible, "fitting_s": r.cost if r.feasible else None,
            "fitting_peak_bytes": r.memory.max_bytes if r.memory else None, "reason": r.reason,
            "memory_aware_wall_s": w1, "memory_aware_cpu_s": c1,
            "stats": {k: v for k, v in r.stats.items() if k.startswith("memory")}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT, help="model:NODESxDEVICES:degree:capacity_fraction, comma separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for spec in a.cases.split(","):
        name, shape, deg, frac = spec.split(":")
        r = run_case(name, shape, int(deg), float(frac))
        rows.append(r)
        print(f"{name:13s} summit:{shape:5s} dp={deg:>3s} cap={float(frac):.2f}x  time-optimal "
              f"{r['time_optimal_s'] * 1e3:8.2f} ms ({r['time_dp_cpu_s']:.2f} s cpu)  ->  "
              + (f"fits at {r['fitting_s'] * 1e3:8.2f} ms" if r["feasible"] else "nothing fits")
              + f"  ({r['memory_aware_cpu_s']:.2f} s cpu, {r['memory_aware_wall_s']:.2f} s wall)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
