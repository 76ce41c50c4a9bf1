"""Memory techniques inside plans of several pipeline stages (executor/pipeline.py PipelineTrainer: each
stage's Trainer runs its recompute regions, cut to the stage, and ZeRO-1/2 over the stage's data-parallel copies)
train equal to one process (3 steps, rtol 1e-4), Dropout inside a recomputed region too; ZeRO-3 and offload are
refused in one line before any process starts."""
from __future__ import annotations

import dataclasses

import pytest

from unity_pcg import plan as P
from unity_pcg.errors import UnityError
from unity_pcg.plan import MemoryPlan, RecomputeRegion

from . import dist_helpers as H
from . import models
from .runtime_plans import pipeline_plan
from .test_accumulation_memory import STEPS, _feeds

ADAM = dict(optimizer="adam", lr=0.01)


def _compute(g) -> tuple:
    return tuple(n.id for n in g.nodes() if n.kind == "compute")


def _with(plan, **mem):
    return dataclasses.replace(plan, memory=MemoryPlan(**mem))


def _worker(rank: int, world: int, cases: list) -> list:
    from unity_pcg.executor.pipeline import PipelineTrainer
    out = []
    for c in cases:
        p = P.from_json(c["plan"])
        t = PipelineTrainer(p, c["model"], rank=rank, world=world, optimizer=c.get("optimizer", "sgd"),
                            lr=c.get("lr", 0.05))
        losses = [t.step(c["feeds"][i], None) for i in range(STEPS)]
        own = set(t.tr.params)            # a stage's Trainer holds its own weights (the others untouched)
        shards = max((grp.k for grp in t.tr._zrt.groups), default=1) if t.tr._zrt is not None else 1
        out.append((losses, {k: v.numpy().copy() for k, v in t.model_state().items() if k in own}, shards))
    return out


def _run(world: int, cases: list) -> list:
    cases = [(name, p, m, dict(kw, feeds=_feeds(m))) for name, p, m, kw in cases]
    got = H.run_dist(world, _worker, [dict(plan=p.to_json(), model=m, **kw) for _, p, m, kw in cases], timeout=300)
    for i, (name, p, m, kw) in enumerate(cases):
        losses = got[0][i][0]
        state: dict = {}
        for r in got:                     # every stage's weights
            state.update(r[i][1])
        ref = H.reference(m, STEPS, **kw)
        H.assert_same(ref, (losses, state), what=name)
    return [max(r[i][2] for r in got) for i in range(len(cases))]     # ZeRO's shards per group, per case


def _regions(plan, mode: str) -> tuple:
    """One recompute region per pipeline stage: its compute nodes."""
    comp = set(_compute(plan.pcg))
    return tuple(RecomputeRegion(tuple(n for n in st["nodes"] if n in comp), mode) for st in plan.pipeline["stages"])


def _cases(plan, model):
    return [
        ("full recompute of every stage", _with(plan, recompute=_regions(plan, "full")), model, {}),
        ("selective recompute + zero 1", _with(plan, zero=1, recompute=_regions(plan, "selective")), model, ADAM),
        ("zero 2", _with(plan, zero=2), model, ADAM),
    ]


def test_two_stages_with_recompute_and_zero_equal_one_process(tmp_path):
    """Also Dropout recomputed in 1F1B: stage 0 runs micro-batch 1's forward before micro-batch 0's backward,
    whose recomputation must draw micro-batch 0's masks."""
    mlp, drop = models.mlp(), models.dropout_mlp()
    plan = P.load(pipeline_plan(mlp, str(tmp_path / "pp.json"), stages=2, micro_batches=2))
    pd = _dropout_first(P.load(pipeline_plan(drop, str(tmp_path / "pd.json"), stages=2, micro_batches=2)))
    _run(2, _cases(plan, mlp) + [("dropout, full recompute", _with(pd, recompute=_regions(pd, "full")), drop, {})])


def _dropout_first(plan):
    """``plan`` with its Dropout moved to the end of stage 0 (device 0)."""
    from unity_pcg.machine import MachineView
    d = next(n.id for n in plan.pcg.nodes() if n.op == "Dropout")
    st = [dict(x, nodes=[n for n in x["nodes"] if n != d]) for x in plan.pipeline["stages"]]
    st[0]["nodes"].append(d)
    views = {**plan.views, d: MachineView(0, plan.views[d].dims)}
    return dataclasses.replace(plan, views=views, pipeline=dict(plan.pipeline, stages=st))


@pytest.mark.slow
def test_data_parallel_stages_with_zero_equal_one_process(tmp_path):
    """2 stages of 2 data-parallel devices: ZeRO shards each stage's update over its 2 copies."""
    shards = _run(4, _cases(_dp_stages(models.mlp()), models.mlp()))
    assert shards == [1, 2, 2]          # ZeRO-1/2 shard over each stage's 2 copies


def _dp_stages(model: str):
    """The data-parallel plan on devices 0-1 cut after its middle compute node: stage 0 on devices 0-1, stage 1
    (views moved by 2) on devices 2-3."""
    from unity_pcg.machine import MachineView, local
    from unity_pcg.search.baselines import data_parallel
    dp = H.make_plan(data_parallel(H.load(model), 2), model, 2)
    g = dp.pcg
    order = [nid for nid in g.topo_order() if g.node(nid).kind != "source"]
    comp = [nid for nid in order if g.node(nid).kind == "compute"]
    cut = order.index(comp[len(comp) // 2 - 1]) + 1
    first, second = order[:cut], order[cut:]
    views = {nid: (v if nid in first else MachineView(v.start + 2, v.dims)) for nid, v in dp.views.items()}
    field = {"schedule": "1F1B", "micro_batches": 2,
             "stages": [{"nodes": first, "devices": [0, 1]}, {"nodes": second, "devices": [2, 3]}]}
    return dataclasses.replace(dp, machine=local(1, 4), views=views, pipeline=field)


def test_refusals_before_start(tmp_path):
    from unity_pcg.executor.pipeline import check_pipeline
    mlp = models.mlp()
    plan = P.load(pipeline_plan(mlp, str(tmp_path / "pp.json"), stages=2, micro_batches=2))
    check_pipeline(_with(plan, zero=1, recompute=_regions(plan, "full")))
    for mem in (dict(zero=3), dict(offload=True)):
        with pytest.raises(UnityError, match="ZeRO-3 and offload with several pipeline stages"):
            check_pipeline(_with(plan, **mem))
