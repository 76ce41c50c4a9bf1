"""Gradient accumulation (executor/accumulate.py): a plan with one pipeline stage and M micro-batches combined
with memory techniques (ZeRO 1/3, full and selective recompute) trains equal to one process (3 steps, rtol
1e-4) on data-parallel and Megatron tensor-parallel plans; the executor's pre-launch check accepts these plans
and still refuses memory techniques with several stages."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search.baselines import build_strategy, data_parallel

from . import dist_helpers as H
from . import models

STEPS = 3


def _compute(g) -> tuple:
    return tuple(n.id for n in g.nodes() if n.kind == "compute")


def _accumulate(plan, M: int, world: int, stages: int = 1, **mem):
    """``plan`` with a pipeline field of one stage (every node, every device) and ``M`` micro-batches, and
    the memory techniques ``mem``."""
    nodes = [n.id for n in plan.pcg.nodes() if n.kind != "source"]
    if stages == 1:
        st = [{"nodes": nodes, "devices": list(range(world))}]
    else:                           # two stages of one device (the refusal test only)
        st = [{"nodes": nodes[:len(nodes) // 2], "devices": [0]}, {"nodes": nodes[len(nodes) // 2:], "devices": [1]}]
    return dataclasses.replace(plan, pipeline={"schedule": "1F1B", "micro_batches": M, "stages": st},
                               memory=MemoryPlan(**mem) if mem else None)


def _worker(rank: int, world: int, cases: list) -> list:
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.pipeline import PipelineTrainer
    out = []
    for c in cases:
        p = plan_mod.from_json(c["plan"])
        t = PipelineTrainer(p, c["model"], rank=rank, world=world, optimizer=c.get("optimizer", "sgd"),
                            lr=c.get("lr", 0.05))
        losses = [t.step(c["feeds"][i], c["targets"][i] if c.get("targets") is not None else None) for i in range(STEPS)]
        state = {k: v.numpy().copy() for k, v in t.model_state().items()}
        out.append((type(t).__name__, losses, state if rank == 0 else None))
    return out


def _cases(world: int, Ms=(2, 4)):
    mlp, drop = models.mlp(), models.dropout_mlp()
    dp = H.make_plan(data_parallel(H.load(mlp), world), mlp, world)
    dpd = H.make_plan(data_parallel(H.load(drop), world), drop, world)
    adam = dict(optimizer="adam", lr=0.01)
    rng = np.random.default_rng(3)
    tg = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(STEPS)]
    out = []
    for M in Ms:
        # the dropout model's batch of 4 splits into 2 micro-batches of one row per device
        rp, rm, rkw = (dpd, drop, dict(targets=tg)) if M == 2 else (dp, mlp, {})
        full = (RecomputeRegion(_compute(rp.pcg), "full"),)
        sel = (RecomputeRegion(_compute(rp.pcg), "selective"),)
        out += [
            (f"dp M={M} no technique", _accumulate(dp, M, world), mlp, adam),
            (f"dp M={M} zero 1", _accumulate(dp, M, world, zero=1), mlp, adam),
            (f"dp M={M} zero 3", _accumulate(dp, M, world, zero=3), mlp, dict(optimizer="momentum", lr=0.05)),
            (f"dp M={M} full recompute", _accumulate(rp, M, world, recompute=full), rm, rkw),
            (f"dp M={M} selective recompute", _accumulate(rp, M, world, recompute=sel), rm, rkw),
        ]
    return out


def _feeds(model: str) -> list:
    from unity_pcg.evaluate import random_feeds
    g = H.load(model)
    return [random_feeds(g, seed=100 + i) for i in range(STEPS)]


def _run(world: int, cases: list):
    cases = [(name, p, m, dict(kw, feeds=_feeds(m))) for name, p, m, kw in cases]
    got = H.run_dist(world, _worker, [dict(plan=p.to_json(), model=m, **kw) for _, p, m, kw in cases], timeout=300)
    refs = {}
    for (name, p, m, kw), (kind, losses, state) in zip(cases, got[0]):
        with_memory = p.memory is not None and not p.memory.empty
        if with_memory:
            assert kind == "AccumulationTrainer", (name, kind)
        key = (m, tuple(sorted((k, v) for k, v in kw.items() if k not in ("targets", "feeds"))), "targets" in kw)
        if key not in refs:
            refs[key] = H.reference(m, STEPS, **kw)
        H.assert_same(refs[key], (losses, state), what=name)
        for r in got[1:]:          # the same loss on every rank
            assert [x[1] for x in r] == [x[1] for x in got[0]]


def test_accumulation_with_memory_techniques_two_processes_equal_one():
    _run(2, _cases(2))


def test_megatron_one_stage_accumulation_with_zero1_equals_one_process():
    att = models.attention()
    tp = H.make_plan(build_strategy(H.load(att), "megatron", 2), att, 2)
    _run(2, [("tp2 M=2 zero 1", _accumulate(tp, 2, 2, zero=1), att, dict(optimizer="adam", lr=0.01)),
             ("tp2 M=2 selective recompute", _accumulate(tp, 2, 2, recompute=(
                 RecomputeRegion(_compute(tp.pcg), "selective"),)), att, {})])


@pytest.mark.slow
def test_accumulation_with_memory_techniques_four_processes_equal_one():
    _run(4, _cases(4, Ms=(2,)))


def test_check_accepts_one_stage_with_memory_and_refuses_several():
    from unity_pcg.errors import UnityError
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.search.runnable import executor_refusal
    mlp = models.mlp()
    dp = H.make_plan(data_parallel(H.load(mlp), 2), mlp, 2)
    p = _accumulate(dp, 2, 2, zero=1)
    check_pipeline(p)
    assert executor_refusal(p) is None
    assert executor_refusal(dataclasses.replace(p, precision="bf16")) is None
    with pytest.raises(UnityError, match="does not divide"):
        check_pipeline(_accumulate(dp, 3, 2, zero=1))
    one = H.make_plan(H.load(mlp), mlp, 1)
    two = dataclasses.replace(_accumulate(one, 2, 2, stages=2), views={})
    with pytest.raises(UnityError, match="several pipeline stages"):
        check_pipeline(dataclasses.replace(two, memory=MemoryPlan(zero=1)))
