"""The plan's precision at run time (executor/precision.py): bf16 runs the forward under autocast with float32
parameters, gradients and optimizer states; a data-parallel bf16 plan, and one of two pipeline stages, train as one
bf16 process does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H
from . import models


def _with_precision(plan, precision):
    return dataclasses.replace(plan, precision=precision)


def test_bf16_plan_runs_matmuls_in_bf16_and_keeps_float32_state():
    from unity_pcg.executor.train import Trainer
    path = models.mlp()
    g = H.load(path)
    base = H.logical_plan(g, path)
    t32 = Trainer(base, path, lr=0.05)
    t16 = Trainer(_with_precision(base, "bf16"), path, lr=0.05)
    t16.keep_values = t32.keep_values = True
    l32 = [t32.step() for _ in range(3)]
    l16 = [t16.step() for _ in range(3)]
    dtypes = {v.dtype for v in t16.last_values.values()}
    assert torch.bfloat16 in dtypes                     # autocast ran the matmuls in bf16
    assert torch.bfloat16 not in {v.dtype for v in t32.last_values.values()}
    assert all(p.dtype == torch.float32 for p in t16.params.values())
    assert all(v.dtype == np.float32 for v in (x.numpy() for x in t16.model_state().values()))
    assert l16 != l32                                   # not the fp32 computation ...
    np.testing.assert_allclose(l16, l32, rtol=3e-2)     # ... but the same training, to bf16 accuracy


def test_bf16_data_parallel_two_processes_trains_as_one_bf16_process():
    path = models.mlp()
    g = H.load(path)
    ref = H.reference(path, 5)
    from unity_pcg.executor.train import Trainer
    t = Trainer(_with_precision(H.logical_plan(g, path), "bf16"), path, lr=0.05)
    ref16 = [t.step() for _ in range(5)]
    plan = _with_precision(H.make_plan(data_parallel(g, 2), path, 2), "bf16")
    (losses, state), = H.run_cases(2, [H.case(plan, path)])
    np.testing.assert_allclose(losses, ref16, rtol=1e-2)
    assert losses != ref[0]                            # it did run in bf16
    for k, v in t.model_state().items():
        np.testing.assert_allclose(state[k], v.numpy(), rtol=2e-2, atol=1e-3)


STEPS = 3


def _pipeline_worker(rank: int, world: int, plan_json: dict, model: str, feeds: list, targets: list) -> list:
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.pipeline import PipelineTrainer
    t = PipelineTrainer(plan_mod.from_json(plan_json), model, rank=rank, world=world, optimizer="adam", lr=0.02)
    sent = []
    if t.st.index == 0:                     # what the first stage computes for the next one, under autocast
        t.tr.keep_values = True
    losses = [t.step(feeds[i], targets[i]) for i in range(STEPS)]
    if t.st.index == 0:
        sent = sorted({str(v.dtype) for v in t.tr.last_values.values()})
    return [losses, sent]


def _bf16_pipeline(tmp_path, model: str, micro_batches: int):
    """``model`` (an ONNX file) as a bf16 plan of 2 single-device pipeline stages."""
    from unity_pcg import plan as P
    from .runtime_plans import pipeline_plan, searched_pipeline_plan, tiny_mlp_onnx
    if model == "mlp":
        path = tiny_mlp_onnx(str(tmp_path / "mlp.onnx"))
        pp = pipeline_plan(path, str(tmp_path / "pp.json"), stages=2, micro_batches=micro_batches)
    else:                                       # the zoo's tiny GPT, cut by the pipeline search
        from unity_pcg import zoo
        path = str(tmp_path / "gpt.onnx")
        zoo.export("gpt_350m", path, size="tiny", batch=4)
        pp = searched_pipeline_plan(path, str(tmp_path / "pp.json"), stages=2, micro_batches=micro_batches)
    return path, _with_precision(P.load(pp), "bf16")


def _steps_and_references(path: str, model: str):
    """Feeds and targets of STEPS steps (the MLP: MSE against targets; the GPT: the mean of its output) and the
    losses one process trains to on them in fp32 and bf16."""
    from unity_pcg.evaluate import random_feeds
    from unity_pcg.executor.train import Trainer
    g = H.load(path)
    feeds = [random_feeds(g, seed=50 + i) for i in range(STEPS)]
    if model == "mlp":
        rng = np.random.default_rng(5)
        targets = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(STEPS)]
    else:
        targets = [None] * STEPS
    ref = {}
    for prec in ("fp32", "bf16"):
        t = Trainer(_with_precision(H.logical_plan(g, path), prec), path, optimizer="adam", lr=0.02)
        ref[prec] = [t.step(feeds[i], targets[i]) for i in range(STEPS)]
    return feeds, targets, ref


@pytest.mark.parametrize("model,micro_batches", [("mlp", 2), ("mlp", 4), ("gpt", 2)])
def test_bf16_two_stage_pipeline_trains_as_one_bf16_process(tmp_path, model, micro_batches):
    """A bf16 plan of 2 pipeline stages passes the pre-launch checks and trains on 2 gloo processes as one bf16
    process does (the stages compute in bf16 and exchange float32 tensors and gradients): 3 steps of Adam."""
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.search.runnable import executor_refusal
    path, plan = _bf16_pipeline(tmp_path, model, micro_batches)
    assert len(plan.pipeline["stages"]) == 2
    check_pipeline(plan)
    assert executor_refusal(plan) is None
    feeds, targets, ref = _steps_and_references(path, model)
    (losses, sent), (losses1, _) = H.run_dist(2, _pipeline_worker, plan.to_json(), path, feeds, targets)
    assert losses == losses1
    assert "torch.bfloat16" in sent                    # the first stage ran its matmuls in bf16
    np.testing.assert_allclose(losses, ref["bf16"], rtol=2e-2)
    assert not np.allclose(losses, ref["fp32"], rtol=1e-6, atol=0)   # not the fp32 computation


def _recompute_worker(rank: int, world: int, plan_json: dict, model: str, feeds: list, targets: list) -> list:
    """``_pipeline_worker``'s training, also counting the stage's checkpointed runs (torch.utils.checkpoint)."""
    import torch.utils.checkpoint as ck
    calls = [0]
    real = ck.checkpoint

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    ck.checkpoint = counted
    try:
        losses, _ = _pipeline_worker(rank, world, plan_json, model, feeds, targets)
    finally:
        ck.checkpoint = real
    return [losses, calls[0]]


@pytest.mark.parametrize("model,mode", [("mlp", "full"), ("mlp", "selective"), ("gpt", "full"), ("gpt", "selective")])
def test_bf16_pipeline_with_recompute_in_its_stages_trains_as_one_bf16_process(tmp_path, model, mode):
    """A bf16 plan of 2 pipeline stages, each stage's compute nodes one recompute region (full: the whole
    forward again in the backward; selective: Megatron-LM's attention-only form), trains 3 steps of Adam on 2 gloo
    processes as one bf16 process without recomputation does: the recomputed forward runs under the same
    autocast as the first one."""
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.plan import MemoryPlan, RecomputeRegion
    path, plan = _bf16_pipeline(tmp_path, model, 2)
    comp = {n.id for n in plan.pcg.nodes() if n.kind == "compute"}
    regions = tuple(RecomputeRegion(tuple(n for n in st["nodes"] if n in comp), mode) for st in plan.pipeline["stages"])
    plan = dataclasses.replace(plan, memory=MemoryPlan(recompute=regions))
    check_pipeline(plan)
    feeds, targets, ref = _steps_and_references(path, model)
    (losses, n0), (losses1, n1) = H.run_dist(2, _recompute_worker, plan.to_json(), path, feeds, targets)
    assert losses == losses1
    assert n0 > 0 and n1 > 0                           # both stages ran checkpointed (recomputed) runs
    np.testing.assert_allclose(losses, ref["bf16"], rtol=2e-2)
    # the stages computed in bf16 (a recomputed region keeps only its boundary tensors, which may be float32)
    assert not np.allclose(losses, ref["fp32"], rtol=1e-6, atol=0)


def test_bf16_zero3_trains_as_bf16_data_parallelism():
    """ZeRO-3 under bf16 converts the gathered weights a bf16 operator reads itself (and again in the
    backward: executor/memory.py ``ZeroRuntime.cast``), as autocast would: the same training as bf16 data
    parallelism without ZeRO (Adam; an MLP, attention, the zoo's tiny GPT), with and without recomputing
    every region (recomputed in the backward, autocast converts them as usual)."""
    import os

    from unity_pcg import zoo
    from unity_pcg.plan import MemoryPlan
    from unity_pcg.search import memtech
    gpt = os.path.join(H.model_dir(), "zoo_gpt_tiny_b4.onnx")
    if not os.path.exists(gpt):
        zoo.export("gpt_350m", gpt, size="tiny", batch=4)
    cases = []
    for path in (models.wide_mlp(), models.attention(), gpt):
        dp = _with_precision(H.make_plan(data_parallel(H.load(path), 2), path, 2), "bf16")
        z3 = dataclasses.replace(dp, memory=MemoryPlan(zero=3))
        full = memtech.recompute_all(memtech.regions(dp.pcg), "full")
        z3r = dataclasses.replace(dp, memory=MemoryPlan(zero=3, recompute=tuple(full)))
        cases += [H.case(p, path, steps=STEPS, optimizer="adam", lr=0.01) for p in (dp, z3, z3r)]
    got = H.run_cases(2, cases, timeout=300)
    for k in range(0, len(got), 3):
        l_dp, s_dp = got[k]
        for l_z3, s_z3 in got[k + 1:k + 3]:
            np.testing.assert_allclose(l_z3, l_dp, rtol=1e-5, atol=1e-7)
            for name, v in s_dp.items():
                np.testing.assert_allclose(s_z3[name], v, rtol=1e-5, atol=1e-7, err_msg=name)
