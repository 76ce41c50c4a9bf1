"""Helpers for the executor tests: tiny ONNX models, plans made by applying proven rules, local gloo
process launches and single-process reference training.

A launch costs a process start and a gloo rendezvous (about a second per rank), so tests group many
cases into one launch: :func:`run_cases` trains every case on every rank and returns rank 0's losses
and final weights per case.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np

_MODEL_DIR = None


def model_dir() -> str:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="unity-exec-models-")
    return _MODEL_DIR


def export(module, example: tuple, name: str, input_names: Sequence[str]) -> str:
    """Export a torch module (eval mode, fixed seed weights) to ONNX with the legacy exporter."""
    import torch
    path = os.path.join(model_dir(), f"{name}.onnx")
    if os.path.exists(path):
        return path
    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, example, path, input_names=list(input_names), output_names=["out"],
                          dynamo=False, opset_version=17, do_constant_folding=False)
    return path


# --- plans ------------------------------------------------------------------------------------------------

def load(path: str):
    from unity_pcg.onnx_import import load_onnx
    return load_onnx(path)


def rules():
    from unity_pcg.substitutions import cache
    return cache.load().by_name()


def apply_rule(g, name: str, pick: Callable | None = None, degree: int = 2, index: int = 0):
    """Apply proven rule ``name`` at its ``index``-th valid match (optionally filtered by ``pick``)."""
    from unity_pcg.substitutions.apply import try_apply
    from unity_pcg.substitutions.match import find_matches
    rule = rules()[name]
    k = 0
    for m in find_matches(rule, g, degrees=(degree,)):
        if pick is not None and not pick(g, m):
            continue
        out = try_apply(g, m)
        if out is None:
            continue
        if k == index:
            return out
        k += 1
    raise AssertionError(f"rule {name} has no valid match")


def make_plan(g, model_path: str, world: int, views=None, strict: bool = True):
    """A plan for ``world`` local processes; views from the machine mapper unless given (None when
    no mapping is feasible and not ``strict``)."""
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.machine import local
    from unity_pcg.plan import Plan, file_sha256
    machine = local(1, world)
    if views is None:
        res = MachineMapper(CostModel(machine)).optimize(g)
        if not strict and not res.feasible:
            return None
        assert res.feasible, res.reason
        views = res.views
    return Plan(model_path, file_sha256(model_path), machine, g, dict(views), {"iteration_s": 0.0})


def logical_plan(g, model_path: str):
    from unity_pcg.machine import local
    from unity_pcg.plan import Plan, file_sha256
    return Plan(model_path, file_sha256(model_path), local(1, 1), g, {}, {})


# --- training ---------------------------------------------------------------------------------------------

def train(plan, model_path: str, steps: int, rank: int = 0, world: int = 1, feeds=None, targets=None,
          optimizer: str = "sgd", lr: float = 0.05, seed: int = 0, sync_batchnorm: bool = True, **kw):
    from unity_pcg.executor.train import Trainer
    t = Trainer(plan, model_path, rank=rank, world=world, optimizer=optimizer, lr=lr, seed=seed,
                sync_batchnorm=sync_batchnorm, **kw)
    losses = []
    for i in range(steps):
        f = feeds[i] if feeds is not None else None
        tg = targets[i] if targets is not None else None
        losses.append(t.step(f, tg))
    state = {k: v.numpy().copy() for k, v in t.model_state().items()}
    return losses, state


def reference(model_path: str, steps: int, **kw):
    """Single-process training of the unparallelized model."""
    g = load(model_path)
    return train(logical_plan(g, model_path), model_path, steps, **kw)


def _cases_worker(rank: int, world: int, cases: list) -> list:
    from unity_pcg import plan as plan_mod
    out = []
    for c in cases:
        c = dict(c)
        p = plan_mod.from_json(c.pop("plan"))
        losses, state = train(p, c.pop("model"), c.pop("steps"), rank=rank, world=world, **c)
        out.append((losses, state if rank == 0 else None))
    return out


def case(plan, model: str, steps: int = 5, **kw) -> dict:
    return dict(plan=plan.to_json(), model=model, steps=steps, **kw)


def run_cases(world: int, cases: list, timeout: float = 180.0) -> list:
    """Train every case on ``world`` gloo processes; rank 0's (losses, final state) per case."""
    res = run_dist(world, _cases_worker, cases, timeout=timeout)
    return res[0]


# --- launching ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, q) -> None:
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            q.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "err", traceback.format_exc()))


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "onnx", "unity_pcg.executor.train", "unity_pcg.onnx_import.importer",
            "unity_pcg.plan", "tests.executor.dist_helpers"]


def _context():
    """A forkserver that imported torch and the executor once: later ranks start in milliseconds, and
    never inherit a parent's OpenMP threads (fork after torch ran is unsafe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_dist(world: int, fn, *args, timeout: float = 180.0) -> list:
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    import queue
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, val = q.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    errors.append(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f} s")
                continue
            if status == "ok":
                results[rank] = val
            else:
                errors.append(f"rank {rank}:\n{val}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("distributed run failed: " + "\n".join(errors))
    return [results[r] for r in range(world)]


def assert_same(ref, got, rtol: float = 1e-4, atol: float = 1e-6, what: str = "") -> None:
    (l0, s0), (l1, s1) = ref, got
    np.testing.assert_allclose(l1, l0, rtol=rtol, atol=atol, err_msg=f"{what}: losses differ")
    assert set(s0) == set(s1), f"{what}: different parameter names"
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], rtol=rtol, atol=atol, err_msg=f"{what}: weight {k} differs")


def rebuild(g, src_ops: dict, after: dict | None = None):
    """The PCG ``g`` with parallel operators put on its sources (``src_ops``: source name -> list of
    ("Partition", dim, degree) / ("Replicate", degree) / ("Combine", dim, degree)) and after nodes
    (``after``: node id -> list of the same); shape inference propagates the rest and every graph output
    is brought back to one piece (Reduce, then Combine)."""
    from unity_pcg.pcg import PCG
    after = after or {}
    b = PCG.builder(g.weights)

    def put(ref, steps):
        for st in steps:
            if st[0] in ("Partition", "Combine"):
                ref = b.add(st[0], {"dim": st[1], "degree": st[2]}, [ref])
            else:
                ref = b.add(st[0], {"degree": st[1]}, [ref])
        return ref

    m = {}
    for n in g.nodes():
        if n.kind == "source":
            ref = b.add(n.op, n.a, [], name=n.name)
            m[(n.id, 0)] = put(ref, src_ops.get(n.a["name"], []))
            continue
        nid = b.add_node(n.op, n.a, [m[tuple(r)] for r in n.inputs], name=n.name)
        for k in range(len(g.shapes(n.id))):
            m[(n.id, k)] = put((nid, k), after.get(n.id, []) if k == 0 else [])
    outs = []
    for r in g.outputs:
        ref = m[tuple(r)]
        s = b.shape(ref)
        if s.sum_degree > 1:
            ref = b.add("Reduce", {"degree": s.sum_degree}, [ref])
        for dim, deg in enumerate(b.shape(ref).degrees):
            if deg > 1:
                ref = b.add("Combine", {"dim": dim, "degree": deg}, [ref])
        outs.append(ref)
    b.set_outputs(outs)
    return b.finish()


def with_views(plan_views: dict, g, device_of) -> dict:
    """Views putting every single-task node on ``device_of(node)`` (for model-parallel placements)."""
    from unity_pcg.machine import MachineView
    out = dict(plan_views)
    for n in g.nodes():
        if n.kind != "source" and n.id in out and out[n.id].degree == 1:
            out[n.id] = MachineView(device_of(n), out[n.id].dims)
    return out


def _resume_worker(rank: int, world: int, plan_json: dict, model: str, first: int, then: int, optimizer: str,
                   lr: float):
    """Train ``first`` steps, hand the model and optimizer state to a fresh Trainer, train ``then`` more."""
    from unity_pcg.executor.train import Trainer
    from unity_pcg import plan as plan_mod
    p = plan_mod.from_json(plan_json)
    a = Trainer(p, model, rank=rank, world=world, optimizer=optimizer, lr=lr)
    losses = [a.step() for _ in range(first)]
    ms, os_ = a.model_state(), a.optimizer_state()
    b = Trainer(p, model, rank=rank, world=world, optimizer=optimizer, lr=lr)
    b.load_model_state(ms)
    b.load_optimizer_state(os_)
    losses += [b.step() for _ in range(then)]
    state = {k: v.numpy().copy() for k, v in b.model_state().items()}
    return losses, state if rank == 0 else None
