"""What the executor recomputes is what the plan prices (issue 19 point 7): under full and selective
recomputation, in fp32 and under bf16 autocast, the operators the backward runs again are exactly the
nodes of the cost model's checkpointed runs (``search.memtech.Techniques._runs``, whose forward times make
``recompute_s``), each running the same kernels as in its forward (no cast or matmul more), and the
backward of a recomputing step runs nothing beyond those kernels and the recomputation's machinery (one
zero scalar per checkpointed run, one for the tie to the loss), with one checkpoint per run the model
prices: counted with a TorchDispatchMode on the zoo's tiny GPT, one CPU process."""
from __future__ import annotations

import collections
import dataclasses
import os

import pytest

from unity_pcg.plan import MemoryPlan

from . import dist_helpers as H

#: aten operators that launch no kernel (views, aliases, the checkpoint's detaches of saved tensors)
_NO_KERNEL = frozenset({"detach", "view", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze",
                        "squeeze", "slice", "select", "alias", "as_strided", "split", "split_with_sizes",
                        "unbind", "reshape", "_reshape_alias", "empty", "lift_fresh"})


def _gpt() -> str:
    from unity_pcg import zoo
    path = os.path.join(H.model_dir(), "zoo_gpt_tiny_b4.onnx")
    if not os.path.exists(path):
        zoo.export("gpt_350m", path, size="tiny", batch=4)
    return path


class _Log:
    """Aten operators run during a step: per (node, recomputation?) while a step of the plan runs, and
    every operator run during the backward."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        log = self
        self.cur = None
        self.in_backward = False
        self.by_step = collections.defaultdict(list)
        self.backward = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name in _NO_KERNEL:
                    return out
                o = out[0] if isinstance(out, (tuple, list)) and out else out
                shape = tuple(o.shape) if isinstance(o, torch.Tensor) else ()
                if log.cur is not None:
                    log.by_step[log.cur].append((name, shape))
                if log.in_backward:
                    log.backward[(name, shape)] += 1
                return out
        self.mode = Mode()


def _measure(plan, path):
    import torch

    from unity_pcg.evaluate import random_feeds
    from unity_pcg.executor.train import Trainer
    tr = Trainer(plan, path, rank=0, world=1, optimizer="sgd", lr=1e-3, loss="mse", device="cpu")
    feeds = {k: torch.as_tensor(v) for k, v in random_feeds(plan.pcg, seed=0).items()}
    tgt = torch.zeros(tuple(plan.pcg.shape(tuple(plan.pcg.outputs[0])).sizes))
    tr.step(feeds, tgt)
    log = _Log()
    orig = tr._run_step

    def run_step(st, vals, fv, anchor, sinks, bn_done, split):
        prev, log.cur = log.cur, (st.node, bn_done is None)
        log.by_step[log.cur] += []
        try:
            return orig(st, vals, fv, anchor, sinks, bn_done, split)
        finally:
            log.cur = prev
    tr._run_step = run_step
    real_backward = torch.autograd.backward

    def backward(*a, **k):
        log.in_backward = True
        try:
            return real_backward(*a, **k)
        finally:
            log.in_backward = False
    torch.autograd.backward = backward
    real_tensor_backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: backward(self, *a, **k)
    import torch.utils.checkpoint as ckpt
    real_checkpoint = ckpt.checkpoint
    log.checkpoints = 0

    def checkpoint(*a, **k):
        log.checkpoints += 1
        return real_checkpoint(*a, **k)
    ckpt.checkpoint = checkpoint
    try:
        with log.mode:
            tr.step(feeds, tgt)
    finally:
        torch.autograd.backward = real_backward
        torch.Tensor.backward = real_tensor_backward
        ckpt.checkpoint = real_checkpoint
    return log


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputed_ops_are_the_plans(precision):
    from unity_pcg.search import memtech
    from unity_pcg.search.cost import CostModel, GraphCost
    path = _gpt()
    plain = dataclasses.replace(H.make_plan(H.load(path), path, 1), precision=precision)
    regs = memtech.regions(plain.pcg)
    none = _measure(plain, path)
    for mode in ("full", "selective"):
        plan = dataclasses.replace(plain, memory=MemoryPlan(recompute=memtech.recompute_all(regs, mode)))
        st = memtech.Techniques(GraphCost(plan.pcg, CostModel(plan.machine, "sgd", precision=precision)), plan.views)
        runs = st._runs({n: (i, r.mode) for i, r in enumerate(plan.memory.recompute) for n in r.nodes})
        assert runs, mode
        log = _measure(plan, path)
        again = {n for (n, rec) in log.by_step if rec}
        assert again == set(runs), (mode, sorted(again ^ set(runs)))
        for n in again:           # each recomputed node runs the kernels of its forward, no cast more
            assert log.by_step[(n, True)] == log.by_step[(n, False)], (mode, n, plan.pcg.node(n).op)
        # the backward runs: the plain backward, the recomputed nodes' forward kernels, and one zero
        # scalar per checkpointed run plus one for the tie (the recomputation's trigger and the loss's tie)
        recomputed = collections.Counter(op for n in again for op in log.by_step[(n, True)])
        extra = log.backward - none.backward - recomputed
        missing = none.backward + recomputed - log.backward
        n_runs = len(set(runs.values()))
        assert log.checkpoints == n_runs, (mode, log.checkpoints, n_runs)      # one checkpoint per priced run
        assert not missing, (mode, missing)
        assert sum(extra.values()) <= n_runs + 1, (mode, n_runs, extra)
        assert all(shape == () for _, shape in extra), (mode, extra)
