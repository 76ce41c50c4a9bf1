"""Machine-mapping DP solve time on the zoo's paper-size models, data parallel on Summit, and the DP's
agreement with exhaustive enumeration on small graphs (tests/search/test_mapping.py and
test_mapping_join.py).

For each model and D in (6, 48, 192) devices (summit:1x6, 8x6, 32x6): the model is exported once
(``zoo.export_structure(name, size="paper")`` -- no weights allocated -- where the zoo supports it,
else ``zoo.export``; cached in benchmarks/.cache/), imported with ``load_onnx`` at the
paper's per-device batch times D, parallelized with ``search.baselines.data_parallel(D)`` and mapped
by a fresh :class:`MachineMapper` (cold cache) ``--runs`` times (median), then once more on the
same mapper (warm cache: the reuse the substitution search gets).

Usage:  .venv/bin/python benchmarks/dp_bench.py [--models a,b] [--devices 6,48,192] [--runs 3]
        .venv/bin/python benchmarks/dp_bench.py --models inception_v3 --degree 6 --devices 12,24
        (``--degree D``: data parallel of degree D on more devices -- many views per operator and
        side-by-side splits possible: the DP's hard regime)
Writes benchmarks/results/dp_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CACHE = os.path.join(ROOT, "benchmarks", ".cache")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def model_path(name: str) -> str:
    from unity_pcg import zoo
    os.makedirs(CACHE, exist_ok=True)
    p = os.path.join(CACHE, f"{name}-paper.onnx")
    if not os.path.exists(p):
        print(f"exporting {name} (paper size) ...", file=sys.stderr, flush=True)
        try:
            zoo.export_structure(name, p, size="paper")   # graph and weight shapes only: nothing allocated
        except zoo.ZooError:
            zoo.export(name, p, size="paper")             # models with width-dependent constants
    return p


def bench_model(name: str, devices: list, runs: int, degree: int | None = None) -> list:
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    path = model_path(name)
    per_dev = zoo.MODELS[name].paper_batch
    optimizer = zoo.MODELS[name].paper_optimizer   # Unity §6.1: Adam for BERT-Large, SGD otherwise
    rows = []
    for D in devices:
        m = parse_machine(f"summit:{max(1, D // 6)}x{min(6, D)}")
        deg = degree or D
        t = time.perf_counter()
        g = load_onnx(path, batch=per_dev * deg, load_weights=False)
        pg = data_parallel(g, deg)
        t_build = time.perf_counter() - t
        times, r = [], None
        for _ in range(runs):
            mm = MachineMapper(CostModel(m, optimizer=optimizer))
            t = time.perf_counter()
            r = mm.optimize(pg)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        r2 = mm.optimize(pg)
        warm = time.perf_counter() - t
        assert r2.cost == r.cost or (math.isinf(r.cost) and math.isinf(r2.cost))
        row = {"model": name, "devices": D, "dp_degree": deg, "machine": f"summit:{m.nodes}x{m.devices_per_node}",
               "global_batch": per_dev * deg, "optimizer": optimizer, "pcg_nodes": len(pg), "units": r.stats["units"],
               "series_parallel": r.stats["series_parallel"], "fallbacks": len(pg.meta.get("fallbacks", [])),
               "solve_s_median": statistics.median(times), "solve_s_runs": times, "warm_solve_s": warm,
               "subproblems": r.stats["cache_misses"], "predicted_iteration_s": r.cost if r.feasible else None,
               "feasible": r.feasible, "reason": r.reason, "comm_elements": r.breakdown.comm_elements,
               "max_memory_bytes": r.memory.max_bytes if r.memory else None, "build_s": t_build,
               "breakdown": r.to_json()["breakdown"]}
        rows.append(row)
        pit = f"{r.cost * 1e3:9.2f} ms" if r.feasible else "infeasible"
        print(f"{name:13s} D={D:4d} dp={deg:4d} nodes={len(pg):5d} solve {row['solve_s_median']:7.3f} s (warm {warm:.4f} s)  "
              f"predicted {pit}  mem {row['max_memory_bytes'] / 2**30 if row['max_memory_bytes'] else 0:.2f} GiB",
              flush=True)
    return rows


def agreement() -> dict:
    """DP optimum vs exhaustive enumeration on the small graphs of tests/search (same cost model)."""
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper, exhaustive_mapping
    from tests.search.test_mapping import CASES as C1
    from tests.search.test_mapping_join import CASES as C2
    from unity_pcg.machine import parse_machine
    out = []
    for name, make, machine in list(C1) + list(C2):
        g = make()
        model = CostModel(parse_machine(machine))
        t = time.perf_counter()
        dp = MachineMapper(model).optimize(g).cost
        t_dp = time.perf_counter() - t
        t = time.perf_counter()
        ex, _ = exhaustive_mapping(g, model)
        t_ex = time.perf_counter() - t
        out.append({"case": name, "machine": machine, "dp": dp, "exhaustive": ex, "equal": math.isclose(dp, ex, rel_tol=1e-12),
                    "dp_s": t_dp, "exhaustive_s": t_ex})
        print(f"agreement {name:16s} dp {dp:.6e} exhaustive {ex:.6e} {'OK' if out[-1]['equal'] else 'MISMATCH'}",
              flush=True)
    return {"cases": out, "all_equal": all(c["equal"] for c in out)}


def main() -> int:
    from unity_pcg import zoo
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    ap.add_argument("--devices", default="6,48,192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--degree", type=int, default=None,
                    help="data-parallel degree (default: all devices); smaller degrees give every operator many "
                         "views and make side-by-side resource splits possible -- the DP's hard regime")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "dp_bench.json"))
    a = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    devices = [int(x) for x in a.devices.split(",")]
    rows = []
    for name in a.models.split(","):
        rows.extend(bench_model(name, devices, a.runs, a.degree))
    agr = agreement() if not a.no_agreement else {"cases": [], "all_equal": True}
    with open(a.out, "w") as f:
        json.dump({"rows": rows, "agreement": agr, "args": vars(a),
                   "command": "python benchmarks/dp_bench.py " + " ".join(sys.argv[1:])}, f, indent=2)
    return 0 if agr["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
