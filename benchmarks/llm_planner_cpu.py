"""CPU seconds of a fixed piece of planner work at a model's full depth (issue 19: the planner at 70B on 64 GPUs):
the import, Megatron-LM's tuned grid's first points (the plain point, then the first ``--steps`` steps of the
walk), and the zero3 grid's first steps, each timed by ``time.process_time`` (CPU seconds of this process, so a
shared, loaded host changes them little, unlike the wall clock a ``--budget`` reads).  The work is fixed (no
deadline), so two trees compare on the same points: the prices must be the same floats.  ``memtech_cpu_s``: the
part spent pricing memory techniques (search/memtech.py through the grid's pricer).

    .venv/bin/python benchmarks/llm_planner_cpu.py benchmarks/.cache/llm/llama_7b-L32-s2048.onnx h100:1x8
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/llm_planner_cpu.py --other-tree ...   # another checkout
    .venv/bin/python benchmarks/llm_planner_cpu.py MODEL MACHINE --per-region [--no-trim-skip]   # as Unity's floor

Prints one JSON object (no results file: the numbers are quoted where they are used, with the command)."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("machine")
    ap.add_argument("--steps", type=int, default=3, help="walk steps after the plain point (default 3)")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--per-region", action="store_true",
                    help="price per-region recomputation too (as Unity's floor does: tuned.floor)")
    ap.add_argument("--no-trim-skip", action="store_true",
                    help="the greedy's trim prices every step down (memtech.TRIM_PREDICT off: the reference)")
    ap.add_argument("--other-tree", action="store_true",
                    help="import unity_pcg from PYTHONPATH, not from this checkout's editable install")
    a = ap.parse_args(argv)
    if a.other_tree:
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search import tuned
    from unity_pcg.search.tuned import _Tuner, techniques
    from unity_pcg.search import memtech
    if a.no_trim_skip:
        memtech.TRIM_PREDICT = False
    out: dict = {"model": a.model, "machine": a.machine, "per_region": a.per_region,
                 "trim_skip": memtech.TRIM_PREDICT}
    # the memory techniques' share (search/memtech.py, through the grid's pricer): CPU seconds inside it
    tech_s = [0.0]
    price = tuned._Memtech.price

    def timed(self, *args, **kw):
        c = time.process_time()
        try:
            return price(self, *args, **kw)
        finally:
            tech_s[0] += time.process_time() - c
    tuned._Memtech.price = timed
    c0 = time.process_time()
    g = load_onnx(a.model, batch=a.batch, load_weights=False)
    out["import_cpu_s"] = round(time.process_time() - c0, 2)
    m = parse_machine(a.machine)
    for strategy in ("megatron", "zero3"):
        tech_s[0] = 0.0
        c0 = time.process_time()
        t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam", precision="bf16")), strategy, None, techniques(),
                   per_region=a.per_region)
        t._start()
        steps = 0
        for _ in range(a.steps):
            live = [w for w in t.walks if not w["done"]]
            if not live:
                break
            t._step(live[0], t.plain)
            steps += 1
        r = t.result()
        out[strategy] = {"cpu_s": round(time.process_time() - c0, 2), "memtech_cpu_s": round(tech_s[0], 2),
                         "steps": steps,
                         "points_priced": len(t.priced), "layout_points": t.stats.get("layout_points"),
                         "pairs_skipped_by_weights": t.stats.get("pairs_skipped_by_weights", 0),
                         "best_s": r.cost, "best": r.config.to_json() if r.config else None,
                         "prices": [p["cost"] for p in t.priced]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
