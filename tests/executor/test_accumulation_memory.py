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


def _accumulate(plan, M: int, world: int, **mem):
    """``plan`` with a pipeline field of one stage (every node, every device) and ``M`` micro-batches, and
    the memory techniques ``mem``."""
    nodes = [n.id for n in plan.pcg.nodes() if n.kind != "source"]
    st = [{"nodes": nodes, "devices": list(range(world))}]
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
        tg = c.get("targets") or [None] * STEPS
        losses = [t.step(c["feeds"][i], tg[i]) for i in range(STEPS)]
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
        # the dropout model's batch of 4 splits into 2 micro-batches of one row on each of 2 devices
        rp, rm, rkw = (dpd, drop, dict(targets=tg)) if M * world == 4 else (dp, mlp, {})
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


def test_check_accepts_one_stage_with_memory_and_refuses_several(tmp_path):
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
    from unity_pcg import plan as P

    from .runtime_plans import pipeline_plan
    two = P.load(pipeline_plan(mlp, str(tmp_path / "pp.json"), stages=2, micro_batches=2))
    with pytest.raises(UnityError, match="several pipeline stages"):
        check_pipeline(dataclasses.replace(two, memory=MemoryPlan(zero=3)))


def _decoder_onnx(path: str) -> str:
    """Two pre-norm MLP blocks (LayerNorm, Linear 64->256, GELU, Linear 256->64, residual) and a head, batch 16
    of 32 positions."""
    import torch
    from torch import nn

    class Dec(nn.Module):
        def __init__(self, h: int = 64, layers: int = 2):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([nn.ModuleDict(dict(ln=nn.LayerNorm(h), a=nn.Linear(h, 4 * h),
                                                            b=nn.Linear(4 * h, h))) for _ in range(layers)])
            self.head = nn.Linear(h, h)

        def forward(self, x):
            for b in self.blocks:
                x = x + b["b"](torch.nn.functional.gelu(b["a"](b["ln"](x))))
            return self.head(x)
    with torch.no_grad():
        torch.onnx.export(Dec(), (torch.randn(16, 32, 64),), path, input_names=["x"], output_names=["out"],
                          dynamo=False)
    return path


def test_optimize_with_little_memory_returns_accumulation_that_run_trains(tmp_path, capfd):
    """1 MiB per device: neither the full batch nor its data-parallel halves fit; ``optimize`` returns gradient
    accumulation with memory techniques, which ``unity-pcg run`` starts and trains as one device does; a run
    resumed from its checkpoint continues with the uninterrupted run's loss."""
    import json
    import shutil

    from tests.executor.runtime_plans import one_device_plan
    from unity_pcg.cli import main
    from unity_pcg.machine import local
    from unity_pcg.search.optimize import optimize
    model = _decoder_onnx(str(tmp_path / "dec.onnx"))
    m = local(1, 2)
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=1 << 20))
    # pipeline=False: the stage search (stages on separate devices, which now also fit here) is another test's
    res = optimize(model, m, budget_s=20, pipeline=False)   # generous: deadline-bound phases on a loaded host
    p = res.plan
    assert res.feasible and p.pipeline is not None and len(p.pipeline["stages"]) == 1, res.stats["chosen"]
    assert p.pipeline["micro_batches"] > 1 and p.memory is not None and not p.memory.empty
    assert res.stats["executor_check"] == "ok"
    acc = str(tmp_path / "acc.json")
    p.save(acc)
    one = one_device_plan(model, str(tmp_path / "one.json"))
    common = ["--model", model, "--json", "--loss", "mean", "--optimizer", "adam", "--lr", "0.01"]

    def run(*args):
        capfd.readouterr()
        rc = main(["run", *map(str, args), *common])
        out, err = capfd.readouterr()
        assert rc == 0, err
        return json.loads(out)
    ck, ck2 = tmp_path / "ck", tmp_path / "ck2"
    got = run(acc, "--steps", 3, "--checkpoint", ck, "--checkpoint-every", 2)
    ref = run(one, "--steps", 3)
    assert len(got["losses"]) == 3
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-4, atol=1e-6)
    # resumed from the checkpoint after 2 steps: the uninterrupted run's last loss
    ck2.mkdir()
    shutil.copytree(ck / "step-00000002", ck2 / "step-00000002")
    (ck2 / "latest").write_text("step-00000002\n")
    resumed = run(acc, "--steps", 1, "--checkpoint", ck2, "--resume")
    assert resumed["first_step"] == 2 and resumed["losses"] == got["losses"][2:]


def _random_weights(g) -> dict:
    rng = np.random.default_rng(0)
    return {n.a["name"]: (rng.standard_normal(n.a["shape"]) * 0.1).astype(np.float32) for n in g.sources("Weight")}


def _tuned_worker(rank: int, world: int, plan_json: dict, steps: int):
    from unity_pcg import plan as P
    from unity_pcg.executor.pipeline import PipelineTrainer
    from unity_pcg.executor.train import Trainer
    p = P.from_json(plan_json)
    kw = dict(rank=rank, world=world, optimizer="adam", lr=0.01, weights=_random_weights(p.pcg))
    t = PipelineTrainer(p, None, **kw) if p.pipeline else Trainer(p, None, **kw)
    return type(t).__name__, [t.step() for _ in range(steps)]


def test_tuned_megatron_accumulation_plan_trains_as_one_process():
    """The tuned Megatron-LM baseline where little memory is left (tp2, micro-batches, full recompute; a
    feasible plan) is run by the executor as gradient accumulation, equal to one process."""
    from unity_pcg import plan as P
    from unity_pcg.machine import local, parse_machine
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.split import synthetic_transformer
    # activations large against the weights, a device that holds the weights and one recomputed micro-batch
    g = synthetic_transformer(2, batch=8, seq=128, hidden=64, heads=4)
    m = parse_machine("h100:1x2")
    # (no host memory: offload, faster here than recomputing, is another test's)
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(1.5 * 2**20)), host_memory_bytes=0)
    res = optimize(g, m, budget_s=20, strategy="megatron")   # generous: the grid is deadline-bound
    p = res.plan
    assert res.feasible, res.stats.get("chosen")
    assert p.pipeline is not None and len(p.pipeline["stages"]) == 1 and p.pipeline["micro_batches"] > 1, \
        res.stats.get("chosen")
    assert p.memory is not None and p.memory.recompute and res.stats["executor_check"] == "ok"
    p = dataclasses.replace(p, model_path="weights-in-memory", model_sha256="0" * 64)
    got = H.run_dist(2, _tuned_worker, p.to_json(), STEPS, timeout=200)
    assert got[0][0] == "AccumulationTrainer"
    one = P.Plan("weights-in-memory", "0" * 64, local(1, 1), g, {}, {})
    ref = _tuned_worker(0, 1, one.to_json(), STEPS)
    np.testing.assert_allclose(got[0][1], ref[1], rtol=1e-4, atol=1e-6)
    assert got[1][1] == got[0][1]


def test_a_tuned_plan_that_offloads_trains_as_one_process():
    """Where only offload fits (12 MiB devices: search/tuned.py prices it), the tuned Megatron-LM plan keeps its
    optimizer states on the host, and the executor trains it equal to one process."""
    from unity_pcg import plan as P
    from unity_pcg.machine import local, parse_machine
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.split import synthetic_transformer
    g = synthetic_transformer(2, batch=8, seq=16, hidden=256, heads=4)
    m = parse_machine("h100:1x2")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=12 * 2**20))
    res = optimize(g, m, budget_s=20, strategy="megatron")
    p = res.plan
    assert res.feasible and p.memory is not None and p.memory.offload, res.stats.get("chosen")
    assert res.stats["executor_check"] == "ok"
    p = dataclasses.replace(p, model_path="weights-in-memory", model_sha256="0" * 64)
    got = H.run_dist(2, _tuned_worker, p.to_json(), STEPS, timeout=200)
    one = P.Plan("weights-in-memory", "0" * 64, local(1, 1), g, {}, {})
    ref = _tuned_worker(0, 1, one.to_json(), STEPS)
    np.testing.assert_allclose(got[0][1], ref[1], rtol=1e-4, atol=1e-6)
    assert got[1][1] == got[0][1]
