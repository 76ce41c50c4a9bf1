"""How fast the memory techniques are priced (search/memtech.py), before and after a change, on one box.

Three workloads, each timed with the current ``search/memtech.py`` and with the one of git revision ``--before``
(loaded from ``git show`` as a sibling module), medians of ``--repeat`` runs:

* ``choose`` on zoo BERT-Large (paper, batch 4) and on a Llama decoder (``llama_7b``, 8 layers, seq 2048,
  benchmarks/llm.py's export at batch 8) under Megatron-LM's layout on h100:4x8, mapped once by the machine-mapping DP;
* the tuned Megatron-LM grid (search/tuned.py) of ``llama_70b``, 8 layers, on h100:8x8 as benchmarks/llm.py
  builds it (``optimize --strategy megatron``): the technique prices the grid asks for within ``--budget``
  seconds are recorded once, then replayed (a Techniques per mapping, every recorded plan priced).

Each workload also checks that both versions price every plan identically.  Writes
benchmarks/results/memtech_speed.json and .md.

    nice .venv/bin/python benchmarks/memtech_speed.py [--before main] [--repeat 5] [--budget 60]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _before(rev: str):
    """search/memtech.py at git revision ``rev`` as module unity_pcg.search._memtech_before."""
    src = subprocess.run(["git", "show", f"{rev}:search/memtech.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    d = tempfile.mkdtemp(prefix="memtech-before-")
    p = os.path.join(d, "_memtech_before.py")
    with open(p, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("unity_pcg.search._memtech_before", p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _mapped(path: str, spec: str, batch: int | None = None):
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.optimize import _batch_of
    from unity_pcg.search.pipeline import rebatch
    g = load_onnx(path, load_weights=False)
    if batch:
        g = rebatch(g, _batch_of(g), batch)
    m = parse_machine(spec)
    pg = build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node)
    cm = CostModel(m, optimizer="adam", precision="bf16")
    r = MachineMapper(cm).optimize(pg, techniques=False)
    return GraphCost(pg, cm), r, len(list(pg.nodes()))


def _median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_choose(label: str, path: str, spec: str, mods: dict, repeat: int, batch: int | None = None) -> dict:
    gc, r, nodes = _mapped(path, spec, batch)
    out = {"workload": f"choose: {label} on {spec} (megatron layout)", "nodes": nodes}
    got = {}
    for name, mod in mods.items():
        out[f"{name}_s"] = _median_time(lambda: mod.choose(gc, r.views, base=r.cost), repeat)
        out[f"{name}_build_s"] = _median_time(lambda: mod.Techniques(gc, r.views, r.cost), repeat)
        got[name] = mod.choose(gc, r.views, base=r.cost)
    a, b = (got[k] for k in mods)
    out["identical"] = a[0] == b[0] and dataclasses.asdict(a[1]) == dataclasses.asdict(b[1])
    out["plan"] = a[0].to_json()
    return out


def _record_grid(path: str, spec: str, budget: float) -> list:
    """(gc, views, base, MemoryPlan) of every technique price the tuned grid asks for within ``budget``."""
    from unity_pcg import cli
    from unity_pcg.search import tuned
    calls: list = []
    orig = tuned._Memtech.price

    def rec(self, gc, views, recompute, zero, base):
        calls.append((gc, views, base, recompute, zero))
        return orig(self, gc, views, recompute, zero, base)
    tuned._Memtech.price = rec
    try:
        out = os.path.join(tempfile.mkdtemp(prefix="memtech-speed-"), "plan.json")
        with open(os.devnull, "w") as devnull:
            so = sys.stdout
            sys.stdout = devnull
            try:
                cli.main(["optimize", path, "--machine", spec, "--strategy", "megatron", "--budget", str(budget),
                          "--batch", "1024", "--precision", "bf16", "--optimizer", "adam", "--json", "-o", out])
            finally:
                sys.stdout = so
    finally:
        tuned._Memtech.price = orig
    from unity_pcg.search import memtech
    plans = []
    for gc, views, base, recompute, zero in calls:
        plans.append((gc, views, base, tuned._Memtech(memtech).plan(gc.g, recompute, zero)))
    return plans


def bench_grid(path: str, spec: str, budget: float, mods: dict, repeat: int) -> dict:
    plans = _record_grid(path, spec, budget)
    mappings: dict = {}
    for gc, views, base, mem in plans:
        mappings.setdefault((id(gc), id(views)), (gc, views, base, []))[3].append(mem)
    out = {"workload": f"tuned megatron grid: llama_70b 8 layers on {spec}, the technique prices of a "
                       f"{budget:g} s grid replayed", "mappings": len(mappings), "prices": len(plans)}
    got = {}
    for name, mod in mods.items():
        def replay(mod=mod):
            res = []
            for gc, views, base, mems in mappings.values():
                t = mod.Techniques(gc, views, base)
                res.extend(t.price(m) for m in mems)
            return res
        out[f"{name}_s"] = _median_time(replay, repeat)
        out[f"{name}_build_s"] = _median_time(
            lambda: [mod.Techniques(gc, views, base) for gc, views, base, _ in mappings.values()], repeat)
        got[name] = replay()
    a, b = (got[k] for k in mods)
    out["identical"] = all(dataclasses.asdict(x) == dataclasses.asdict(y) for x, y in zip(a, b))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the 'before' search/memtech.py")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--budget", type=float, default=60.0, help="the tuned grid's budget when recording")
    args = ap.parse_args(argv)
    from unity_pcg import zoo
    from unity_pcg.search import memtech
    import llm
    mods = {"before": _before(args.before), "after": memtech}
    cache = os.path.join(HERE, ".cache", "memtech_speed")
    os.makedirs(cache, exist_ok=True)
    bert = os.path.join(cache, "bert_large-b4.onnx")
    if not os.path.exists(bert):
        zoo.export_structure("bert_large", bert, size="paper", batch=4, exporter="auto")
    rows = [bench_choose("BERT-Large (paper, batch 4)", bert, "h100:4x8", mods, args.repeat)]
    p7, _ = llm.model_path("llama_7b", 8)
    rows.append(bench_choose("llama_7b, 8 layers, seq 2048, batch 8", p7, "h100:4x8", mods, args.repeat, batch=8))
    p70, _ = llm.model_path("llama_70b", 8)
    rows.append(bench_grid(p70, "h100:8x8", args.budget, mods, args.repeat))
    for r in rows:
        r["speedup"] = r["before_s"] / r["after_s"]
        for k in ("before", "after"):           # the pricing alone: the total less building the Techniques
            r[f"{k}_pricing_s"] = r[f"{k}_s"] - r[f"{k}_build_s"]
        r["pricing_speedup"] = r["before_pricing_s"] / max(r["after_pricing_s"], 1e-9)
    res = {"host": platform.node(), "python": platform.python_version(), "before": args.before,
           "repeat": args.repeat, "rows": rows}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "memtech_speed.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["# Memory-technique pricing speed (search/memtech.py)", "",
             f"Before: `search/memtech.py` at `{args.before}`; after: this checkout; one box ({platform.node()}, "
             f"2 cores shared), median of {args.repeat} runs each.  `identical`: both price every plan the same.  "
             "Pricing: the total less building the Techniques (per mapping, unchanged by this work; medians "
             "of separate runs, so approximate).",
             "", "| workload | before (s) | after (s) | speedup | pricing before (s) | pricing after (s) | "
             "pricing speedup | identical |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['before_s']:.3f} | {r['after_s']:.3f} | {r['speedup']:.1f}x | "
                     f"{r['before_pricing_s']:.3f} | {r['after_pricing_s']:.3f} | {r['pricing_speedup']:.1f}x | "
                     f"{r['identical']} |")
    with open(os.path.join(HERE, "results", "memtech_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
