"""Memory and overlap you can trust, on a GPU (issue 19 points 3 and 7): the cost model's predictions for
recomputation, a plan filling 90% of a device, and the gradient sync's overlap, against one GPU.

Part ``recompute``.  The zoo's transformers (GPT, BERT, Llama) at their paper width and a reduced depth, on
one device (``h100:1x1``, the fitted H100), each with no recomputation, full and selective recomputation of
every region (``search.memtech.regions``), Adam, mse loss against zeros.  *Predicted*: the bytes of
``search.memtech.price(...).per_device[0]`` and its ``iteration_s``.  *Measured*: two warm-up steps, then
``torch.cuda.max_memory_allocated`` over one step (peak statistics reset before it) and the median time of
``--iters`` steps between CUDA events (feeds already on the device).  Targets: memory within 10%, time
within 15%; the recomputation's extra time (full/selective minus none) is reported beside, with the
checkpointed runs and the host seconds the backward spends re-running their steps (one more step,
instrumented): where these exceed the GPU work they hide behind, the step waits on the host.

Part ``fill``.  The device of ``h100:1x1`` shrunk until the plain plan does not fit (its usable memory --
``DeviceSpec.usable_bytes``, the capacity less the runtime's reserve -- 70% of the plain plan's predicted
peak); ``optimize`` picks memory techniques; then the device whose usable memory the chosen plan fills to
90% is planned again (``optimize`` may fill up to all of its usable memory), and both plans run for
``--fill-steps`` steps with the CUDA caching allocator capped at that device's raw capacity
(``torch.cuda.set_per_process_memory_fraction``): both must run without running out of memory.

Part ``overlap``.  Two ranks on the one GPU (gloo: NCCL refuses two ranks on one device), the data-parallel
plan of a small transformer on ``h100:1x2``; per step the backward window [start, end] on the compute
stream (CUDA events, synchronized), the CPU time each gradient bucket's all-reduce is launched (from the
gradient hooks) and finishes (its future), with overlap on (buckets launched from the hooks during the
backward, as the cost model's ``overlap_grad_sync`` assumes) and off (launched after the backward);
reported: median step times, the communication finished inside the backward window, and the model's
trigger points (the fraction of the backward done when each bucket becomes ready) beside the measured
launch points.  Gloo moves the buckets through host memory, so the communication's speed is not NVLink's:
what is checked is the schedule (when the executor starts and finishes each bucket relative to the
backward), not the link.

    python benchmarks/gpu_memory_check.py [--parts recompute,fill,overlap] [--out DIR] [--device cuda]
                                          # parts run in the order given
    python benchmarks/gpu_memory_check.py --report DIR      # markdown from the JSON of a run (no GPU;
                                                            # DIR/gpu_memory_check_before.json: a column)

``--device cpu`` runs the same code on CPU processes with a tiny configuration (a test of the script, not
a measurement).  Writes DIR/gpu_memory_check.json after every case (a cut-short run keeps what it measured).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

#: name -> (zoo entry, config overrides at paper width, batch) on a GPU; the CPU smoke test uses the tiny sizes
GPU_MODELS = {
    "gpt_350m_l4": ("gpt_350m", dict(layers=4), 8),
    "bert_large_l4": ("bert_large", dict(layers=4), 16),
    "llama_1b_l2": ("llama_1b", dict(layers=2, vocab=32000, seq=2048), 4),
}
CPU_MODELS = {
    "gpt_tiny": ("gpt_350m", None, 4),
    "gpt_l1": ("gpt_350m", dict(layers=1, hidden=64, heads=4, vocab=128, seq=32), 2),
    "llama_tiny": ("llama_1b", None, 4),
}
TECHNIQUES = ("none", "full", "selective")


# --- models and plans ------------------------------------------------------------------------------------
def export(name: str, spec: tuple, workdir: str) -> str:
    """The model's ONNX file with its weights (legacy exporter, seed 0), cached in ``workdir``."""
    import torch

    from unity_pcg import zoo
    from unity_pcg.zoo import configs, models
    entry, over, batch = spec
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"{name}-b{batch}.onnx")
    if os.path.exists(path):
        return path
    if over is None:
        return zoo.export(entry, path, size="tiny", batch=batch)
    cfg = dataclasses.replace(configs.CONFIGS[entry]["paper"], **over)
    torch.manual_seed(0)
    module, inputs, ins, outs = models.build(entry, cfg, batch)
    with torch.no_grad():
        torch.onnx.export(module, inputs, path, dynamo=False, opset_version=17, input_names=ins, output_names=outs,
                          do_constant_folding=True, training=torch.onnx.TrainingMode.EVAL,
                          external_data=True)
    return path


def machine(device: str, world: int = 1, capacity: int | None = None):
    from unity_pcg.machine import h100, local
    m = h100(1, world) if device == "cuda" else local(1, world)
    if capacity is not None:
        m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(capacity)))
    return m


def plain_plan(path: str, m, precision: str, layout: str = "dp"):
    """The data-parallel plan of ``path`` on ``m`` (one device: the whole model there)."""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.plan import Plan, file_sha256
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    g = load_onnx(path)
    pg = data_parallel(g, m.num_devices) if m.num_devices > 1 else g
    res = MachineMapper(CostModel(m, "adam", precision=precision)).optimize(pg)
    return Plan(path, file_sha256(path), m, pg, dict(res.views), {"iteration_s": res.cost}, precision=precision)


def with_technique(plan, tech: str):
    from unity_pcg.plan import MemoryPlan
    from unity_pcg.search import memtech
    regs = memtech.regions(plan.pcg)
    mem = MemoryPlan() if tech == "none" else MemoryPlan(recompute=memtech.recompute_all(regs, tech))
    return dataclasses.replace(plan, memory=mem)


def predict(plan) -> dict:
    """The cost model's bytes on device 0 and iteration seconds for ``plan`` (its memory techniques)."""
    from unity_pcg.search import memtech
    from unity_pcg.search.cost import CostModel, GraphCost
    gc = GraphCost(plan.pcg, CostModel(plan.machine, "adam", precision=plan.precision))
    p = memtech.price(gc, plan.views, plan.memory)
    r = p.report
    d0 = min(r.per_device)
    return {"bytes": int(r.per_device[d0]), "weights": int(r.weights.get(d0, 0)),
            "activations": int(r.activations.get(d0, 0)), "iteration_s": p.iteration_s,
            "recompute_s": p.recompute_s, "regions": len(plan.memory.recompute) if plan.memory else 0,
            "capacity": int(plan.machine.device.memory_bytes)}


# --- measuring on one device -------------------------------------------------------------------------------
def _device_feeds(trainer, dev):
    import torch

    from unity_pcg.evaluate import random_feeds
    g = getattr(trainer, "g", None) or trainer.full_plan.pcg
    return {k: torch.as_tensor(v).to(dev) for k, v in random_feeds(g, seed=0).items()}


def _target(plan, dev):
    import torch
    shape = plan.pcg.shape(tuple(plan.pcg.outputs[0])).sizes
    return torch.zeros(tuple(shape), device=dev)


def measure_one(plan, path: str, device: str, iters: int, warmup: int = 2) -> dict:
    """Peak allocated bytes over one step and the median step seconds of ``plan`` trained on one device."""
    import torch

    from unity_pcg.executor.train import Trainer
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tr = Trainer(plan, path, rank=0, world=1, optimizer="adam", lr=1e-5, loss="mse", device=device)
    feeds, tgt = _device_feeds(tr, dev), _target(plan, dev)
    for _ in range(warmup):
        tr.step(feeds, tgt)
    out = {}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tr.step(feeds, tgt)
    if cuda:
        torch.cuda.synchronize()
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
        out["reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        # the loss's target is the caller's data (allocated before the Trainer's step, held throughout):
        # not the model's; the feeds are read by the program and stay counted
        out["target_bytes"] = int(tgt.numel() * tgt.element_size())
        out["peak_bytes"] -= out["target_bytes"]
    times = []
    for _ in range(iters):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            tr.step(feeds, tgt)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            tr.step(feeds, tgt)
            times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["steps_s"] = times
    out.update(recompute_host(tr, feeds, tgt))
    del tr, feeds, tgt
    if cuda:
        torch.cuda.empty_cache()
    return out


def recompute_host(tr, feeds, tgt) -> dict:
    """One more step, instrumented: the checkpointed runs of the plan, and the host (CPU) seconds the
    backward spends re-running their steps (the executor's Python and the kernels' launches; the GPU runs
    them asynchronously -- where this exceeds the GPU work the recomputation hides behind, the step waits on
    the host)."""
    from unity_pcg.executor.memory import Region
    runs = sum(sum(1 for r in it.runs if r.checkpointed) for it in tr._items if isinstance(it, Region))
    if not runs:
        return {"checkpointed_runs": 0, "host_recompute_s": 0.0}
    spent = [0.0]
    orig = tr._run_step

    def run_step(st, vals, fv, anchor, sinks, bn_done, split):
        if bn_done is not None:
            return orig(st, vals, fv, anchor, sinks, bn_done, split)
        t0 = time.perf_counter()
        try:
            return orig(st, vals, fv, anchor, sinks, bn_done, split)
        finally:
            spent[0] += time.perf_counter() - t0
    tr._run_step = run_step
    try:
        tr.step(feeds, tgt)
    finally:
        del tr._run_step
    return {"checkpointed_runs": runs, "host_recompute_s": spent[0]}


def part_recompute(models: dict, device: str, precisions: list, iters: int, workdir: str, sink) -> None:
    for name, spec in models.items():
        try:
            path = export(name, spec, workdir)
        except Exception as e:  # noqa: BLE001 - reported, the next model runs
            sink({"part": "recompute", "model": name, "error": f"export: {type(e).__name__}: {e}"[:300]})
            continue
        for prec in precisions:
            try:
                base = plain_plan(path, machine(device), prec)
            except Exception as e:  # noqa: BLE001
                sink({"part": "recompute", "model": name, "precision": prec, "error": f"plan: {e}"[:300]})
                continue
            for tech in TECHNIQUES:
                plan = with_technique(base, tech)
                row = {"part": "recompute", "model": name, "precision": prec, "technique": tech,
                       "batch": spec[2], "predicted": predict(plan)}
                try:
                    row["measured"] = measure_one(plan, path, device, iters)
                except Exception as e:  # noqa: BLE001 - an out-of-memory or a refusal is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                sink(row)


def raw_for_usable(m, usable: float) -> int:
    """The raw capacity (``memory_bytes``) of a device of machine ``m`` whose usable memory -- what a plan may
    fill: ``DeviceSpec.usable_bytes``, the capacity less the runtime's reserve -- is ``usable`` bytes."""
    import math
    d = m.device
    return int(math.ceil((usable + d.reserved_bytes) / d.usable_fraction))


def part_fill(name: str, spec: tuple, device: str, precision: str, steps: int, budget_s: float, workdir: str,
              sink, fill: float = 0.9) -> None:
    from unity_pcg.search.optimize import optimize
    row: dict = {"part": "fill", "model": name, "precision": precision, "fill": fill}
    try:
        path = export(name, spec, workdir)
        plain = predict(plain_plan(path, machine(device), precision))["bytes"]
        base = machine(device)
        row["usable_fraction"], row["reserved_bytes"] = base.device.usable_fraction, base.device.reserved_bytes
        cap0 = raw_for_usable(base, 0.7 * plain)
        r0 = optimize(path, machine(device, 1, cap0), budget_s=budget_s, optimizer="adam", precision=precision)
        first = predict(r0.plan)["bytes"]
        cap = raw_for_usable(base, first / fill)          # the first plan fills `fill` of this device's usable memory
        m = machine(device, 1, cap)
        r = optimize(path, m, budget_s=budget_s, optimizer="adam", precision=precision)
        plan = r.plan
        pred = predict(plan) if plan.pipeline is None else None
        row.update(plain_predicted_bytes=plain, first_capacity=cap0, first_predicted_bytes=first, capacity=cap,
                   usable=m.device.usable_bytes,
                   chosen=(r.stats or {}).get("chosen") if isinstance(r.stats, dict) else None,
                   memory=plan.memory.to_json() if plan.memory is not None else None,
                   pipeline=bool(plan.pipeline), predicted=pred,
                   predicted_peak_bytes=int(plan.predicted.get("peak_memory_bytes") or 0) or None,
                   plan_predicted=dict((k, v) for k, v in plan.predicted.items() if isinstance(v, (int, float))))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"plan: {type(e).__name__}: {e}"[:300]
        sink(row)
        return
    row["runs"] = [run_capped(r0.plan, path, device, cap, steps, f"the first plan at {fill:.0%} of the usable memory"),
                   run_capped(plan, path, device, cap, steps, "optimize's plan for that device")]
    for x in row["runs"]:
        x["usable"] = m.device.usable_bytes
    sink(row)


def run_capped(plan, path: str, device: str, cap: int, steps: int, what: str) -> dict:
    """Train ``plan`` ``steps`` steps on one device with the CUDA caching allocator capped at ``cap`` bytes
    (beyond what the process held before), as ``unity-pcg run`` sets the allocator up."""
    import torch

    from unity_pcg.executor.__main__ import make_trainer
    row = {"what": what, "capacity": cap}
    if plan.pipeline is None:
        row["predicted_bytes"] = predict(plan)["bytes"]
    import gc

    from unity_pcg.evaluate import random_feeds
    gc.collect()
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    # the data first: the loss's target (an output's size) is the caller's, outside the device's capacity
    feeds = {k: torch.as_tensor(v).to(dev) for k, v in random_feeds(plan.pcg, seed=0).items()}
    tgt = _target(plan, dev)
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        base = torch.cuda.memory_allocated()
        # the allocator's cap: the device's capacity in the plan plus what this process holds already
        torch.cuda.set_per_process_memory_fraction(min(1.0, (cap + base) / total), 0)
        torch.cuda.reset_peak_memory_stats()
        row["cap_fraction"] = (cap + base) / total
    args = argparse.Namespace(optimizer="adam", lr=1e-5, seed=0, per_device_bn=False, loss="mse", model=path)
    losses = []
    try:
        tr = make_trainer(plan, args, 0, 1, device)
        for _ in range(steps):
            losses.append(tr.step(feeds, tgt))
        row["ran"] = True
    except torch.cuda.OutOfMemoryError as e:
        row["ran"] = False
        row["error"] = f"out of memory: {e}"[:300]
    except Exception as e:  # noqa: BLE001
        row["ran"] = False
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["losses"] = losses
    if cuda:
        row["measured_peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
        row["measured_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    return row


# --- overlap: two ranks, one GPU -----------------------------------------------------------------------------
def _overlap_worker(rank: int, world: int, plan_json: dict, path: str, device: str, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.train import Trainer
    plan = plan_mod.from_json(plan_json)
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    res = {}
    for overlap in (True, False):
        tr = Trainer(plan, path, rank=rank, world=world, optimizer="adam", lr=1e-5, loss="mse", device=device,
                     overlap=overlap)
        feeds, tgt = _device_feeds(tr, dev), _target(plan, dev)
        marks: dict = {}
        orig_start, orig_finish, orig_ar = tr._start_step_sync, tr._finish_sync, dist.all_reduce

        def wait_compute():
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
                ev.synchronize()

        def event():
            if not cuda:
                return None
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def start(part, marks=marks):
            wait_compute()                     # the forward done: the backward starts now
            marks["t0"] = time.perf_counter()
            marks["launch"], marks["done"], marks["ev"] = [], [], []
            marks["ev0"] = event()
            orig_start(part)

        def finish(marks=marks):
            marks["ev1"] = event()
            wait_compute()                     # the backward's kernels done
            marks["t1"] = time.perf_counter()
            orig_finish()
            marks["t2"] = time.perf_counter()

        def all_reduce(t, *a, marks=marks, **k):
            i = len(marks["launch"])
            marks["launch"].append(time.perf_counter())
            marks["done"].append(None)
            marks["ev"].append(event())      # where the compute stream is when the bucket is launched
            w = orig_ar(t, *a, **k)
            if k.get("async_op"):
                def _done(f, i=i):
                    marks["done"][i] = time.perf_counter()
                    return None
                w.get_future().then(_done)
            else:
                marks["done"][i] = time.perf_counter()
            return w

        tr._start_step_sync, tr._finish_sync = start, finish
        dist.all_reduce = all_reduce
        try:
            for _ in range(2):
                tr.step(feeds, tgt)
            steps = []
            for _ in range(iters):
                dist.barrier()
                t = time.perf_counter()
                tr.step(feeds, tgt)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
                t0, t1 = marks["t0"], marks["t1"]
                done = [x for x in marks["done"] if x is not None]
                comm_in_bwd = sum(1 for x in done if x <= t1)
                ready = []
                if cuda and marks["ev0"] is not None:
                    whole = marks["ev0"].elapsed_time(marks["ev1"])
                    ready = [marks["ev0"].elapsed_time(e) / max(whole, 1e-9) for e in marks["ev"]]
                steps.append({"step_s": dt, "backward_s": t1 - t0, "sync_wait_s": marks["t2"] - t1,
                              "launch_frac": [(x - t0) / max(t1 - t0, 1e-9) for x in marks["launch"]],
                              "done_frac": [(x - t0) / max(t1 - t0, 1e-9) for x in done],
                              "buckets": len(marks["launch"]), "buckets_done_in_backward": comm_in_bwd,
                              "ready_frac_gpu": ready})
        finally:
            dist.all_reduce = orig_ar
        res["on" if overlap else "off"] = {
            "step_s": statistics.median(s["step_s"] for s in steps),
            "backward_s": statistics.median(s["backward_s"] for s in steps),
            "sync_wait_s": statistics.median(s["sync_wait_s"] for s in steps),
            "steps": steps[-3:], "overlap": tr.overlap}
        del tr
        if cuda:
            torch.cuda.empty_cache()
    return res


def model_triggers(plan) -> list:
    """The cost model's buckets on device 0: the fraction of the backward's compute done when each becomes
    ready (its last gradient's backward task ends), in the order they are launched."""
    from unity_pcg.search import memtech
    from unity_pcg.search.cost import CostModel, GraphCost
    gc = GraphCost(plan.pcg, CostModel(plan.machine, "adam", precision=plan.precision))
    st = memtech.Techniques(gc, plan.views)
    nf = len(st.order)
    bwd = [st.bwd[n] for n in reversed(st.order)]
    total = sum(bwd) or 1.0
    done, acc = [], 0.0
    for d in bwd:
        acc += d
        done.append(acc / total)
    cap = gc.model.grad_bucket_bytes
    limit = min(cap, gc.model.first_bucket_bytes)
    bidx = {n: 2 * nf - 1 - st.pos[n] for n in st.order}
    out, accb, trig = [], 0.0, []
    for x in sorted(st.weights, key=lambda x: bidx.get(x.first, 0)):
        if x.copies <= 1:
            continue
        trig.append(bidx[x.first])
        accb += x.nbytes
        if accb >= limit:
            out.append(done[max(trig) - nf])
            trig, accb, limit = [], 0.0, cap
    if trig:
        out.append(done[max(trig) - nf])
    return out


def part_overlap(name: str, spec: tuple, device: str, precision: str, iters: int, workdir: str, sink) -> None:
    from tests.executor import dist_helpers as H
    row: dict = {"part": "overlap", "model": name, "precision": precision}
    try:
        path = export(name, spec, workdir)
        plan = plain_plan(path, machine(device, 2), precision)
        row["predicted"] = predict(plan)
        try:
            row["model_trigger_frac"] = model_triggers(plan)
        except Exception as e:  # noqa: BLE001
            row["model_trigger_error"] = str(e)[:200]
        got = H.run_dist(2, _overlap_worker, plan.to_json(), path, device, iters, timeout=900)
        row["ranks"] = got
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:600]
    sink(row)


# --- report -------------------------------------------------------------------------------------------------
def _mib(b) -> str:
    return f"{b / 2**20:,.0f}" if b is not None else "-"


FINDINGS = """## What the GPU showed, and what changed

The first run (`gpu_memory_check_before.json`, column *before*) predicted 0.37-0.91 of the measured peak: the
memory model held the forward's activations at the forward's end and nothing of the backward.  The peak of
a step is in the backward: at the loss's step the output's gradient (in float32 first under bf16) and the
loss's float32 copies of the output (mse's difference and its backward's temporary; a language model's
logits make these GBs), at each recomputed region's step what the recomputation brings back while the
gradients of its activations are alive, and at a softmax's step its backward's temporary (the attention
scores' size).  `search/memtech.py` now walks the backward step by step (`Techniques.backward_peak`;
operator temporaries are registry knowledge, `Saves.temps`).  Left: the time of selective recomputation in
bf16 (the executor's is slower than the model's), and the bf16 step times of the GPT (0.84x).  A plan the
model fitted to 99.9% of the device (with the models of the measurement) ran out of memory by about 50 MB on
its second step: the allocator needs headroom the memory model does not reserve; the plan at 90% ran.  The
gradient buckets become ready on the GPU where the model's overlap schedule puts them."""


def report(data: dict, before: dict | None = None) -> str:
    meta = data["meta"]
    rows = data["rows"]
    old = {}
    for r in (before or {}).get("rows", []):
        if r.get("part") == "recompute" and "measured" in r and r["measured"].get("peak_bytes"):
            old[(r["model"], r["precision"], r["technique"])] = r["predicted"]["bytes"] / r["measured"]["peak_bytes"]
    out = [f"# Memory and overlap on one GPU ({meta.get('device_name', meta['device'])})", "",
           f"`benchmarks/gpu_memory_check.py` (issue 19 points 3 and 7). Command: `{meta['command']}`; "
           f"torch {meta.get('torch')}, CUDA {meta.get('cuda')}; measured {meta['date']}"
           + (f"; the recompute rows' predictions re-priced with the current models on {meta['repredicted']} "
              "(`--report DIR --repredict`; the fill and overlap parts ran with the models of the measurement)"
              if meta.get("repredicted") else "") + ".", ""]
    rec = [r for r in rows if r["part"] == "recompute"]
    if rec:
        out += ["## Recomputation: predicted against measured (one device, Adam)", "",
                "Predicted: `search.memtech.price` on `h100:1x1`; measured: `torch.cuda.max_memory_allocated` over "
                "one step (above what was allocated before the Trainer), median step time between CUDA events. "
                "Targets: memory within 10%, time within 15%.", "",
                "| model | batch | precision | recompute | regions | predicted MiB | measured MiB | mem pred/meas | "
                "before | predicted ms | measured ms | time pred/meas | extra time pred / meas ms | "
                "checkpointed runs | host recompute ms |",
                "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        base = {}
        for r in rec:
            if "measured" in r and r.get("technique") == "none":
                base[(r["model"], r["precision"])] = (r["predicted"]["iteration_s"], r["measured"]["step_s"])
        mem_ok = time_ok = n = 0
        for r in rec:
            if "error" in r and "measured" not in r:
                out.append(f"| {r['model']} | {r.get('batch', '')} | {r.get('precision', '')} | "
                           f"{r.get('technique', '')} | | | | error: {r['error'][:120]} | | | | | | |")
                continue
            p, m = r["predicted"], r["measured"]
            mr = p["bytes"] / m["peak_bytes"] if m.get("peak_bytes") else float("nan")
            tr_ = p["iteration_s"] / m["step_s"]
            n += 1
            mem_ok += abs(mr - 1) <= 0.10
            time_ok += abs(tr_ - 1) <= 0.15
            b = base.get((r["model"], r["precision"]))
            extra = (f"{(p['iteration_s'] - b[0]) * 1e3:.1f} / {(m['step_s'] - b[1]) * 1e3:.1f}"
                     if b and r["technique"] != "none" else "")
            out.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {r['technique']} | {p['regions']} | "
                       f"{_mib(p['bytes'])} | {_mib(m.get('peak_bytes'))} | {mr:.3f} | "
                       f"{old.get((r['model'], r['precision'], r['technique']), float('nan')):.3f} | "
                       f"{p['iteration_s'] * 1e3:.1f} | "
                       f"{m['step_s'] * 1e3:.1f} | {tr_:.3f} | {extra} | {m.get('checkpointed_runs', '')} | "
                       + (f"{m['host_recompute_s'] * 1e3:.1f}" if m.get("host_recompute_s") else "") + " |")
        out += ["", f"Memory within 10%: {mem_ok} of {n}; time within 15%: {time_ok} of {n}.", ""]
    for r in (x for x in rows if x["part"] == "fill"):
        out += ["## A plan predicted to fill 90% of the device", ""]
        if "capacity" not in r:
            out += [f"error: {r.get('error')}", ""]
            continue
        pb = (r.get("predicted") or {}).get("bytes") or r.get("predicted_peak_bytes")
        runs = r.get("runs") or []
        usable = r.get("usable")          # absent in runs from before the usable-memory reserve
        of = usable or r["capacity"]
        out += [f"Model {r['model']} ({r['precision']}): the plain plan needs {_mib(r['plain_predicted_bytes'])} MiB "
                f"(predicted); `optimize` on a device of {_mib(r['first_capacity'])} MiB chose a plan of "
                f"{_mib(r['first_predicted_bytes'])} MiB; on a device of {_mib(r['capacity'])} MiB"
                + (f" ({_mib(usable)} MiB usable: {r.get('usable_fraction', 1.0):.0%} of it less "
                   f"{_mib(r.get('reserved_bytes', 0))} MiB; the first plan fills {r['fill']:.0%} of it)"
                   if usable else " (that / 0.9)")
                + f" it chose `{r.get('chosen')}`, memory `{json.dumps(r.get('memory'))}`"
                + (f", predicted {_mib(pb)} MiB ({pb / of * 100:.1f}% of the {'usable memory' if usable else 'device'})"
                   if pb else "") + ".", "",
                "Each run with the CUDA caching allocator capped at the device's raw capacity "
                "(`set_per_process_memory_fraction`, the target of the loss allocated before, outside it; "
                "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` as `unity-pcg run` sets it):", "",
                "| plan | device MiB | usable MiB | predicted MiB | predicted / usable | predicted / device | ran | "
                "measured peak allocated MiB | peak reserved MiB | losses |",
                "|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
        for x in runs:
            pbx = x.get("predicted_bytes")
            ux = x.get("usable") or x["capacity"]
            out.append(f"| {x['what']} | {_mib(x['capacity'])} | {_mib(x.get('usable'))} | {_mib(pbx)} | "
                       f"{(pbx / ux * 100) if pbx else float('nan'):.1f}% | "
                       f"{(pbx / x['capacity'] * 100) if pbx else float('nan'):.1f}% | "
                       + ("yes" if x.get("ran") else f"no: {x.get('error', '')[:100]}")
                       + f" | {_mib(x.get('measured_peak_bytes'))} | {_mib(x.get('measured_reserved_bytes'))} | "
                       f"{[round(v, 6) for v in x['losses']]} |")
        out.append("")
    for r in (x for x in rows if x["part"] == "overlap"):
        out += ["## Gradient sync overlap: two ranks on the GPU (gloo)", ""]
        if "ranks" not in r:
            out += [f"error: {r.get('error')}", ""]
            continue
        g0 = r["ranks"][0]
        on, off = g0["on"], g0["off"]
        last = on["steps"][-1]
        out += [f"Model {r['model']} ({r['precision']}), data parallel on 2 ranks sharing the GPU, rank 0 shown "
                "(medians of the timed steps).", "",
                "| overlap | step ms | backward ms | wait after backward ms |", "|---|---:|---:|---:|",
                f"| on (hooks) | {on['step_s'] * 1e3:.1f} | {on['backward_s'] * 1e3:.1f} | {on['sync_wait_s'] * 1e3:.1f} |",
                f"| off (after backward) | {off['step_s'] * 1e3:.1f} | {off['backward_s'] * 1e3:.1f} | "
                f"{off['sync_wait_s'] * 1e3:.1f} |", "",
                f"Last step with overlap: {last['buckets']} buckets, {last['buckets_done_in_backward']} finished "
                "inside the backward window. Launch points as fractions of the backward (measured, CPU time of the "
                "hook): " + ", ".join(f"{x:.2f}" for x in last["launch_frac"]) + "; finish points: "
                + ", ".join(f"{x:.2f}" for x in last["done_frac"]) + ".",
                "Ready points on the GPU (the compute stream's progress through the backward when each bucket "
                "is launched, CUDA events): " + ", ".join(f"{x:.2f}" for x in last.get("ready_frac_gpu", [])) + ".",
                "Model's trigger points (fraction of the backward's predicted compute done when each bucket is "
                "ready): " + ", ".join(f"{x:.2f}" for x in r.get("model_trigger_frac", [])) + ".", ""]
    if before is not None:
        out += [FINDINGS, ""]
    return "\n".join(out) + "\n"


def repredict(path: str, workdir: str) -> None:
    """Price every measured recompute row of ``path`` again with the current cost and memory models."""
    with open(path) as f:
        data = json.load(f)
    plans: dict = {}
    for r in data["rows"]:
        if r.get("part") != "recompute" or "measured" not in r or r["model"] not in GPU_MODELS:
            continue
        key = (r["model"], r["precision"])
        if key not in plans:
            plans[key] = plain_plan(export(r["model"], GPU_MODELS[r["model"]], workdir), machine("cuda"),
                                    r["precision"])
        r.setdefault("predicted_at_measurement", r["predicted"])
        r["predicted"] = predict(with_technique(plans[key], r["technique"]))
    data["meta"]["repredicted"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="recompute,fill,overlap")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default=None, help="comma-separated names of GPU_MODELS (CPU_MODELS on cpu)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--fill-model", default=None)
    ap.add_argument("--fill-steps", type=int, default=3)
    ap.add_argument("--fill-budget", type=float, default=20.0)
    ap.add_argument("--fill-precision", default=None, help="the fill part's precision (default: the first of "
                                                              "--precisions)")
    ap.add_argument("--overlap-model", default=None)
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_memory_check"))
    ap.add_argument("--workdir", default="/tmp/unity-pcg-gpu-memory")
    ap.add_argument("--report", default=None, metavar="DIR", help="write DIR's markdown from its JSON and stop")
    ap.add_argument("--repredict", action="store_true",
                    help="with --report: price the recompute rows again with the current model (no GPU needed; "
                         "the prediction made at the measurement is kept as predicted_at_measurement)")
    a = ap.parse_args(argv)
    if a.report and a.repredict:
        repredict(os.path.join(a.report, "gpu_memory_check.json"), a.workdir)
    if a.report:
        with open(os.path.join(a.report, "gpu_memory_check.json")) as f:
            data = json.load(f)
        bp = os.path.join(a.report, "gpu_memory_check_before.json")
        before = json.load(open(bp)) if os.path.exists(bp) else None
        with open(os.path.join(a.report, "gpu_memory_check.md"), "w") as f:
            f.write(report(data, before))
        return 0
    from unity_pcg.executor.__main__ import CUDA_ALLOC_CONF
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)      # as `unity-pcg run`'s ranks
    import torch
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_memory_check: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    catalog = GPU_MODELS if cuda else CPU_MODELS
    names = a.models.split(",") if a.models else list(catalog)
    models = {n: catalog[n] for n in names}
    os.makedirs(a.out, exist_ok=True)
    meta = {"device": a.device, "command": " ".join(["python", "benchmarks/gpu_memory_check.py"] + (argv or sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "models": {n: [s[0], s[1], s[2]] for n, s in models.items()}}
    data = {"meta": meta, "rows": []}
    jpath = os.path.join(a.out, "gpu_memory_check.json")

    def sink(row):
        data["rows"].append(row)
        with open(jpath, "w") as f:
            json.dump(data, f, indent=1)
        brief = {k: row[k] for k in ("part", "model", "precision", "technique", "error", "ran") if k in row}
        print(json.dumps(brief), flush=True)

    precisions = a.precisions.split(",")
    parts = a.parts.split(",")
    first = names[0]
    unknown = set(parts) - {"recompute", "fill", "overlap"}
    if unknown:
        print(f"gpu_memory_check: unknown part(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    for part in parts:                      # in the order given (a run cut short keeps the first ones)
        if part == "recompute":
            part_recompute(models, a.device, precisions, a.iters, a.workdir, sink)
        elif part == "fill":
            n = a.fill_model or first
            part_fill(n, catalog[n], a.device, a.fill_precision or precisions[0], a.fill_steps, a.fill_budget,
                      a.workdir, sink)
        elif part == "overlap":
            n = a.overlap_model or first
            part_overlap(n, catalog[n], a.device, precisions[0], a.iters, a.workdir, sink)
    with open(os.path.join(a.out, "gpu_memory_check.md"), "w") as f:
        f.write(report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
