"""Memory you can trust (issue 19 point 7, CPU variant): the memory model's prediction per rank against what
the executor really holds, on gloo CPU processes.

Part 1, predicted vs measured.  Small zoo transformers (GPT, BERT, Llama; exported with the legacy
exporter as the executor tests do) under data parallelism on 2 processes and Megatron-LM's tensor
parallelism on 2, each with no technique, full and selective recomputation of every region
(``search.memtech.regions``), ZeRO 1-3 and offload (Adam), plus the plan ``optimize`` returns for a
device too small for the plain plan.  *Predicted*: ``search.memtech.price(...).per_device[rank]`` on the
plan's machine (``local``: fp32, with a host link so that offload is priced).  *Measured*
(tests/executor/memory_probe.py): the most bytes of tensor storages the rank holds at any moment of the
second training step -- parameters, gradients and optimizer states on the device, the tensors the
autograd graph saved for the backward (recomputation's included), and forward values still referenced --
each storage once; the process's peak RSS as a sanity number.  Ratio = predicted / measured.

Part 2, a plan predicted to fill 90% of a device.  The device memory of a ``local:1x2`` machine is set so
that the plain data-parallel plan does not fit, ``optimize`` picks techniques, then the plan is scaled to
fill 90% (capacity = predicted peak / 0.9) and run by ``unity-pcg run``.  The cap checked is the measured
peak of tensor bytes <= capacity: a process-wide limit (RLIMIT_AS) counts torch's and gloo's address-space
reservations (GBs of virtual memory for a few MB of tensors), and RSS includes the interpreter and
libraries (hundreds of MB), so neither says what the device would have to hold; the RSS peak above an
empty torch process is reported beside it.

    nice .venv/bin/python benchmarks/memory_check.py [--quick]

Writes benchmarks/results/memory_check.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CACHE = os.path.join(ROOT, "benchmarks", ".cache", "memory_check")

#: model name -> (zoo entry, config override or None for its tiny size, batch)
MODELS = {
    "gpt_tiny": ("gpt_350m", None, 4),
    "gpt_small": ("gpt_350m", dict(layers=2, hidden=128, heads=4, vocab=512, seq=64), 4),
    "bert_tiny": ("bert_large", None, 4),
    "llama_tiny": ("llama_1b", None, 4),
    "llama_small": ("llama_1b", "small", 2),
}
TECHNIQUES = ("none", "full", "selective", "zero1", "zero2", "zero3", "offload")


def machine(world: int = 2, capacity: int | None = None):
    """``local:1xworld`` (fp32) with a host link and host bandwidth, so that offload is priced."""
    from unity_pcg.machine import LinkSpec, local
    m = local(1, world)
    m = dataclasses.replace(m, links={**m.links, "host": LinkSpec(10e9, 10e-6)}, host_mem_bandwidth=20e9)
    if capacity is not None:
        m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(capacity)))
    return m


def export(name: str) -> str:
    """The model's ONNX file (legacy exporter, fixed seed), cached."""
    import torch

    from unity_pcg import zoo
    from unity_pcg.zoo import configs, models
    entry, cfg, batch = MODELS[name]
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{name}-b{batch}.onnx")
    if os.path.exists(path):
        return path
    if cfg is None or isinstance(cfg, str):
        return zoo.export(entry, path, size=cfg or "tiny", batch=batch)
    c = dataclasses.replace(configs.CONFIGS[entry]["tiny"], **cfg)
    torch.manual_seed(0)
    module, inputs, ins, outs = models.build(entry, c, batch)
    with torch.no_grad():
        torch.onnx.export(module, inputs, path, dynamo=False, opset_version=17, input_names=ins, output_names=outs,
                          do_constant_folding=True, training=torch.onnx.TrainingMode.EVAL)
    return path


def base_plan(path: str, layout: str, world: int = 2):
    """The data-parallel (``dp``) or Megatron (``tp``) plan of ``path`` on ``machine(world)``."""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.plan import Plan, file_sha256
    from unity_pcg.search.baselines import build_strategy, data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    g = load_onnx(path)
    pg = data_parallel(g, world) if layout == "dp" else build_strategy(g, "megatron", world)
    m = machine(world)
    res = MachineMapper(CostModel(m, "adam")).optimize(pg)
    return Plan(path, file_sha256(path), m, pg, dict(res.views), {"iteration_s": res.cost})


def with_technique(plan, tech: str):
    from unity_pcg.plan import MemoryPlan
    from unity_pcg.search import memtech
    regs = memtech.regions(plan.pcg)
    mem = {"none": MemoryPlan(), "full": MemoryPlan(recompute=memtech.recompute_all(regs, "full")),
           "selective": MemoryPlan(recompute=memtech.recompute_all(regs, "selective")),
           "zero1": MemoryPlan(zero=1), "zero2": MemoryPlan(zero=2), "zero3": MemoryPlan(zero=3),
           "offload": MemoryPlan(offload=True)}[tech]
    return dataclasses.replace(plan, memory=mem)


def predict(plan, optimizer: str = "adam") -> dict:
    """Predicted bytes per device (``search.memtech.price`` on the plan's machine): total, weights, activations."""
    from unity_pcg.search import memtech
    from unity_pcg.search.cost import CostModel, GraphCost
    gc = GraphCost(plan.pcg, CostModel(plan.machine, optimizer))
    p = memtech.price(gc, plan.views, plan.memory)
    r = p.report
    return {d: {"total": int(r.per_device[d]), "weights": int(r.weights.get(d, 0)),
                "activations": int(r.activations.get(d, 0))} for d in r.per_device}


def _worker(rank: int, world: int, cases: list) -> list:
    """Per case: two steps (Adam states exist from the first), the second measured."""
    import torch

    from tests.executor.memory_probe import Probe
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.train import Trainer
    out = []
    for c in cases:
        p = plan_mod.from_json(c["plan"])
        tr = Trainer(p, c["model"], rank=rank, world=world, optimizer=c.get("optimizer", "adam"), lr=1e-3,
                     loss="mse")
        shape = p.pcg.shape(tuple(p.pcg.outputs[0])).sizes
        tgt = torch.zeros(tuple(shape))         # mse: the loss keeps (output - target), one output's bytes
        tr.step(None, tgt)
        with Probe(tr) as probe:
            tr.step(None, tgt)
        out.append(probe.result().to_json())
        del tr
        torch.distributed.barrier()
    return out


def run_cases(cases: list, world: int = 2) -> list:
    """Measure every case on ``world`` gloo processes; per case the measurement of every rank."""
    from tests.executor import dist_helpers as H
    got = H.run_dist(world, _worker, [dict(plan=pl.to_json(), model=m) for pl, m in cases], timeout=1200)
    return [[got[r][i] for r in range(world)] for i in range(len(cases))]


def part1(names, layouts, techniques) -> list:
    rows, cases = [], []
    for name in names:
        path = export(name)
        for layout in layouts:
            try:
                plan = base_plan(path, layout)
            except Exception as e:  # noqa: BLE001 - a layout the model does not take is reported
                rows.append({"model": name, "layout": layout, "technique": "-", "error": str(e)[:200]})
                continue
            for tech in techniques:
                pl = with_technique(plan, tech)
                rows.append({"model": name, "layout": layout, "technique": tech, "predicted": predict(pl)})
                cases.append((pl, path))
    t0 = time.time()
    meas = run_cases(cases) if cases else []
    wall = time.time() - t0
    it = iter(meas)
    for r in rows:
        if "predicted" not in r:
            continue
        m = next(it)
        r["measured"] = m
        r["ratio"] = [r["predicted"][d]["total"] / max(m[d]["peak_bytes"], 1) for d in range(len(m))]
    return rows, wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layouts", default="dp,tp")
    ap.add_argument("--techniques", default=",".join(TECHNIQUES))
    ap.add_argument("--out", default=os.path.join(RESULTS, "memory_check"))
    ap.add_argument("--print", action="store_true")
    a = ap.parse_args()
    rows, wall = part1(a.models.split(","), a.layouts.split(","), a.techniques.split(","))
    for r in rows:
        if "error" in r:
            print(r["model"], r["layout"], "error", r["error"])
            continue
        for d, m in enumerate(r["measured"]):
            p = r["predicted"][d]
            print(f"{r['model']:12s} {r['layout']} {r['technique']:9s} r{d} pred {p['total']:>10d} "
                  f"(w {p['weights']:>9d} a {p['activations']:>9d})  meas {m['peak_bytes']:>10d} "
                  f"(state {m['state_bytes']:>9d} saved {m['saved_bytes']:>9d} held {m['held_bytes']:>8d}) "
                  f"at {m['peak_at'][:22]:22s} ratio {r['ratio'][d]:.3f}")
    print(f"wall {wall:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
