"""Predicted single-device training memory of the zoo's embedding-heavy models at paper size, against a
V100's 16 GB (Unity §6.1: "DLRM and CANDLE-Uno both exceed the memory capacity of a single GPU,
preventing data parallel training").

Each model is written by ``zoo.export_structure`` (the real graph and weight shapes, weights a sparse
zero file: nothing is allocated), imported with ``load_onnx(load_weights=False)`` at the paper's
per-device batch, left unparallelized (``none``) and mapped by the machine-mapping DP on
``summit:1x1`` with SGD (the paper's optimizer for these models): ``search.memory`` counts weights,
gradients and the activations the backward pass keeps.  The earlier ``small`` configurations are
listed for comparison.

Usage: .venv/bin/python benchmarks/zoo_memory.py        (about 30 s; writes benchmarks/results/zoo_memory.{json,md})
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = [("dlrm", "paper6"), ("dlrm", "paper"), ("candle_uno", "paper"), ("dlrm", "small"),
         ("candle_uno", "small")]
MACHINE = "summit:1x1"
OPTIMIZER = "sgd"


def measure(name: str, size: str, tmp: str) -> dict:
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    batch = zoo.MODELS[name].paper_batch
    path = os.path.join(tmp, f"{name}_{size}.onnx")
    t0 = time.perf_counter()
    if size == "small":   # small enough to export for real (weights loaded lazily, never read)
        zoo.export(name, path, size=size, batch=batch)
    else:
        zoo.export_structure(name, path, size=size, batch=batch)
    g = load_onnx(path, batch=batch, load_weights=False)
    m = parse_machine(MACHINE)
    r = MachineMapper(CostModel(m, optimizer=OPTIMIZER)).optimize(build_strategy(g, "none"))
    mem = r.memory
    cap = m.device.usable_bytes
    other = {opt: MachineMapper(CostModel(m, optimizer=opt)).optimize(build_strategy(g, "none")).memory.max_bytes
             for opt in ("momentum", "adam")}
    return {"model": name, "size": size, "batch": batch, "params": g.param_count(),
            "weight_bytes": 4 * g.param_count(),
            "memory_bytes": mem.max_bytes, "weights_grads_bytes": mem.weights.get(0, 0),
            "activation_bytes": mem.activations.get(0, 0), "capacity_bytes": cap,
            "fits": mem.max_bytes <= cap, "memory_bytes_momentum": other["momentum"],
            "memory_bytes_adam": other["adam"], "predicted_iteration_s": r.to_json()["predicted_iteration_s"],
            "seconds": time.perf_counter() - t0}


def markdown(rows: list, meta: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"
    out = ["# Zoo memory at paper size on one V100 (16 GiB)", "",
           f"Command: `{meta['command']}`; machine `{MACHINE}` (V100, {gb(meta['capacity_bytes'])}), "
           f"optimizer {OPTIMIZER}, per-device batch of the paper, no parallelism (`none`), memory from "
           "`search.memory` (weights + gradients, activations kept for backward).", "",
           "| model | size | batch | parameters | weights | weights + grads | activations | total (SGD) | fits | "
           "total with momentum | with Adam |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['size']} | {r['batch']} | {r['params'] / 1e6:,.1f} M | {gb(r['weight_bytes'])} "
                   f"| {gb(r['weights_grads_bytes'])} | {gb(r['activation_bytes'])} | {gb(r['memory_bytes'])} "
                   f"| {'yes' if r['fits'] else 'no'} | {gb(r['memory_bytes_momentum'])} | {gb(r['memory_bytes_adam'])} |")
    by = {(r["model"], r["size"]): r for r in rows}
    out += ["", "## Reading", ""]
    d6, d24, c = by.get(("dlrm", "paper6")), by.get(("dlrm", "paper")), by.get(("candle_uno", "paper"))
    if d6 and d24:
        out.append(f"- DLRM with FlexFlow's 6 tables needs {gb(d6['memory_bytes'])}: it "
                   f"{'fits' if d6['fits'] else 'does not fit'} one V100, so the zoo's paper size is the 24-table "
                   f"variant ({gb(d24['memory_bytes'])}, {'fits' if d24['fits'] else 'does not fit'}).")
    if c:
        out.append(f"- CANDLE-Uno (two drugs, 8 x 4192 towers) needs {gb(c['memory_bytes'])}: it "
                   f"{'fits' if c['fits'] else 'does not fit'} one V100 in this memory model.")
    if any(r["fits"] for r in (d24, c) if r):
        out.append("- The paper says neither model fits one GPU. With plain SGD our count (weights, gradients, "
                   "the activations backward keeps; no optimizer state, no framework overheads such as the CUDA "
                   "context, workspaces or allocator fragmentation) stays under 16 GB; with momentum SGD "
                   + (f"DLRM needs {gb(d24['memory_bytes_momentum'])}" if d24 else "")
                   + (f" and CANDLE-Uno {gb(c['memory_bytes_momentum'])}" if c else "")
                   + " (FlexFlow's DLRM example even keeps its tables in half precision). The gap to the paper "
                   "is in what is counted, not in the models' sizes.")
    return "\n".join(out) + "\n"


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-memory-") as tmp:
        for name, size in CASES:
            r = measure(name, size, tmp)
            print(f"{name:<11} {size:<7} {r['params'] / 1e6:9.1f} M params  {r['memory_bytes'] / 1e9:7.2f} GB  "
                  f"fits: {r['fits']}  ({r['seconds']:.1f} s)", flush=True)
            rows.append(r)
    meta = {"command": "python benchmarks/zoo_memory.py", "machine": MACHINE, "optimizer": OPTIMIZER,
            "capacity_bytes": rows[0]["capacity_bytes"]}
    res = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(res, exist_ok=True)
    with open(os.path.join(res, "zoo_memory.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")
    with open(os.path.join(res, "zoo_memory.md"), "w") as f:
        f.write(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
