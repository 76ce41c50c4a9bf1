"""Memory techniques in the plan space (issue 19 points 2-3): zoo GPT and Llama decoders at paper size, exported
weight-free (`zoo.export_structure`), priced on H100 machines (bf16, Adam) under data parallelism and Megatron-LM's
layout, each mapped by the machine-mapping DP without and with the memory techniques and overlap
(search/memtech.py: the cheapest feasible ZeRO stage, offload and recomputation per region).  Also ZeRO-3 data
parallelism (FSDP-style: `zero=(3,)`) as a fixed configuration.  Writes benchmarks/results/memtech.json and .md.

    nice .venv/bin/python benchmarks/memtech.py [--models gpt_1_3b:32,gpt_6_7b:32,llama_7b:8]
        [--machines h100:1x8,h100:4x8]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, ".cache", "memtech")


def _model(name: str, batch: int) -> str:
    from unity_pcg import zoo
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{name}-b{batch}.onnx")
    if not os.path.exists(path):
        zoo.export_structure(name, path, size="paper", batch=batch, exporter="auto")
    return path


def _row(r, g_bytes=2**30) -> dict:
    t = r.techniques
    mp = r.memory_plan
    return {"feasible": bool(r.feasible), "iteration_s": r.cost if math.isfinite(r.cost) else None,
            "max_memory_gib": r.memory.max_bytes / g_bytes if r.memory else None,
            "reason": r.reason[:200],
            "memory_plan": mp.to_json() if mp is not None else None,
            "recompute_regions": len(mp.recompute) if mp is not None else 0,
            **({k: v for k, v in t.to_json().items()} if t is not None else {})}


def run(models, machines) -> list:
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search import memtech
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.mapping import MachineMapper
    import dataclasses
    rows = []
    for name, batch in models:
        g = load_onnx(_model(name, batch), load_weights=False)
        for spec in machines:
            m = parse_machine(spec)
            for strat in ("dp", "megatron"):
                t0 = time.monotonic()
                try:
                    pg = build_strategy(g, strat, m.num_devices, devices_per_node=m.devices_per_node)
                except Exception as e:          # a refusal (one line)
                    rows.append({"model": name, "batch": batch, "machine": spec, "strategy": strat,
                                 "error": str(e)[:200]})
                    continue
                cm = CostModel(m, optimizer="adam", precision="bf16")
                mp = MachineMapper(cm)
                plain = mp.optimize(pg, techniques=False)
                tech = mp.optimize(pg, techniques=True)
                row = {"model": name, "batch": batch, "machine": spec, "strategy": strat,
                       "plain": _row(plain), "techniques": _row(tech)}
                if strat == "dp" and tech.views:       # FSDP-style: ZeRO-3 (recompute where it must)
                    mem, p = memtech.choose(GraphCost(pg, cm), tech.views, zero=(3,), offload=(False,))
                    row["zero3"] = {"feasible": p.feasible, "iteration_s": p.iteration_s if p.feasible else None,
                                    "max_memory_gib": p.max_bytes / 2**30, "memory_plan": mem.to_json()}
                if tech.views:                         # techniques priced without overlap: what overlap is worth
                    no = dataclasses.replace(m, overlap_grad_sync=False)
                    cmn = CostModel(no, optimizer="adam", precision="bf16")
                    q = memtech.price(GraphCost(pg, cmn), tech.views, tech.memory_plan,
                                      base=tech.techniques.base_s)
                    row["techniques_without_overlap_s"] = q.iteration_s if q.feasible else None
                row["solve_s"] = time.monotonic() - t0
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("model", "machine", "strategy")}),
                      row["plain"]["iteration_s"], row["techniques"]["iteration_s"], flush=True)
    return rows


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _plan(mp) -> str:
    if not mp:
        return "none"
    parts = []
    if mp["zero"]:
        parts.append(f"ZeRO-{mp['zero']}")
    if mp["offload"]:
        parts.append("offload")
    if mp["recompute"]:
        modes = sorted({r["mode"] for r in mp["recompute"]})
        parts.append(f"recompute {len(mp['recompute'])} ({'/'.join(modes)})")
    return ", ".join(parts) or "none"


def render(rows, meta) -> str:
    out = ["# Memory techniques in the plan space (issue 19)", "",
           "Predicted iteration (ms) and busiest device (GiB) of each fixed layout mapped by the DP, without memory",
           "techniques (the cost model before issue 19: gradient sync after the backward) and with the cheapest",
           "feasible ZeRO stage / offload / recomputation per region and the machine's overlap of the gradient sync",
           "(search/memtech.py).  bf16, Adam, H100 preset (fitted device; links and host link assumed).",
           "`-` = infeasible (out of memory).  Written by `benchmarks/memtech.py`.", "",
           f"host: {meta['host']}, {meta['date']}", "",
           "| model | batch | machine | layout | without: ms | GiB | with: ms | GiB | chosen | techniques, no overlap: ms "
           "| exposed sync ms | ZeRO-3 dp: ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['batch']} | {r['machine']} | {r['strategy']} | refused: {r['error']} "
                       "| | | | | | | |")
            continue
        p, t = r["plain"], r["techniques"]
        z3 = r.get("zero3") or {}
        gib = (lambda x: "-" if x is None else f"{x:.1f}")
        out.append(f"| {r['model']} | {r['batch']} | {r['machine']} | {r['strategy']} | {_ms(p['iteration_s'])} | "
                   f"{gib(p['max_memory_gib'])} | {_ms(t['iteration_s'])} | {gib(t['max_memory_gib'])} | "
                   f"{_plan(t['memory_plan']) if t['feasible'] else 'nothing fits'} | "
                   f"{_ms(r.get('techniques_without_overlap_s'))} | {_ms(t.get('exposed_sync_s'))} | "
                   f"{_ms(z3.get('iteration_s'))} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt_1_3b:32,gpt_6_7b:32,llama_7b:8")
    ap.add_argument("--machines", default="h100:1x8,h100:4x8")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memtech"))
    a = ap.parse_args(argv)
    models = [(x.split(":")[0], int(x.split(":")[1])) for x in a.models.split(",")]
    machines = a.machines.split(",")
    t0 = time.monotonic()
    rows = run(models, machines)
    meta = {"host": platform.node() or "?", "date": time.strftime("%Y-%m-%d"), "wall_s": time.monotonic() - t0,
            "models": a.models, "machines": a.machines}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(render(rows, meta))
    print(f"wrote {a.out}.json and .md in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
