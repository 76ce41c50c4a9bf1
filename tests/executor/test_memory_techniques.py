"""The plan's memory techniques run by the executor (executor/memory.py): recomputation (full and selective),
ZeRO stages 1-3, optimizer offload and a combination train equal to one process (3 steps, rtol 1e-4) on
data-parallel and Megatron tensor-parallel plans, and the memory they should save is saved: with ZeRO-3 a
rank holds 1/copies of the parameters, ZeRO-1 shards the optimizer states, offload moves them to the host,
recomputation keeps fewer activation bytes for the backward.  A ZeRO-3 run checkpointed and resumed by
`unity-pcg run` continues with the uninterrupted run's losses.  Sequence parallelism (a layout) lowers to
reduce-scatter / all-gather and trains equal to one process."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search.baselines import build_strategy, data_parallel

from . import dist_helpers as H
from . import models

STEPS = 3


def _compute(g) -> tuple:
    return tuple(n.id for n in g.nodes() if n.kind == "compute")


def _with(plan, **kw):
    return dataclasses.replace(plan, memory=MemoryPlan(**kw))


def _worker(rank: int, world: int, cases: list) -> list:
    """Train every case; per case (losses, final state on rank 0, memory_bytes, saved activation bytes)."""
    import torch

    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.train import Trainer
    out = []
    for c in cases:
        p = plan_mod.from_json(c["plan"])
        t = Trainer(p, c["model"], rank=rank, world=world, optimizer=c.get("optimizer", "sgd"), lr=c.get("lr", 0.05))
        saved = [0]

        def pack(x):
            saved[0] += x.numel() * x.element_size()
            return x
        losses = []
        for i in range(c["steps"]):
            tg = c["targets"][i] if c.get("targets") is not None else None
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                losses.append(t.step(None, tg))
        state = {k: v.numpy().copy() for k, v in t.model_state().items()}
        out.append((losses, state if rank == 0 else None, t.memory_bytes(), saved[0]))
    return out


def _case(plan, model, **kw) -> dict:
    return dict(plan=plan.to_json(), model=model, steps=STEPS, **kw)


def _check(ref, got, what):
    H.assert_same(ref, got[:2], what=what)


def _megatron(world: int):
    att = models.attention()
    return build_strategy(H.load(att), "megatron", world), att


def seqpar_model() -> str:
    """Two Megatron MLP pairs with a LayerNorm between them (hidden 8, sequence 4)."""
    import torch

    class SP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16, bias=False)
            self.b = torch.nn.Linear(16, 8, bias=False)
            self.ln = torch.nn.LayerNorm(8)
            self.c = torch.nn.Linear(8, 16, bias=False)
            self.d = torch.nn.Linear(16, 8, bias=False)

        def forward(self, x):
            return self.d(torch.relu(self.c(self.ln(self.b(torch.relu(self.a(x)))))))
    torch.manual_seed(6)
    return H.export(SP(), (torch.randn(2, 4, 8),), "seqpar", ["x"])


def seqpar_plan(world: int):
    """Megatron-LM's sequence parallelism as a layout on ``world`` devices: the row-parallel Linear's
    partial sums Reduce then Partition on the sequence dim (a reduce-scatter), the LayerNorm runs on
    sequence shards with its weights copied, Combine then Replicate (an all-gather) feeds the next
    column-parallel Linear."""
    path = seqpar_model()
    g = H.load(path)
    by_op = {}
    for n in g.nodes():
        by_op.setdefault(n.op, []).append(n.id)
    row, ln = by_op["Linear"][1], by_op["LayerNorm"][0]
    k = world
    sp = H.rebuild(g, {"x": [("Replicate", k)], "a.weight": [("Partition", 1, k)], "b.weight": [("Partition", 0, k)],
                       "ln.weight": [("Replicate", k)], "ln.bias": [("Replicate", k)],
                       "c.weight": [("Partition", 1, k)], "d.weight": [("Partition", 0, k)]},
                   after={row: [("Reduce", k), ("Partition", 1, k)], ln: [("Combine", 1, k), ("Replicate", k)]})
    return H.make_plan(sp, path, world), path


def _cases(world: int):
    """(name, plan, model, optimizer kwargs) of every technique on a data-parallel and a Megatron plan."""
    mlp, drop = models.mlp(), models.dropout_mlp()
    gm, gd = H.load(mlp), H.load(drop)
    dp = H.make_plan(data_parallel(gm, world), mlp, world)
    dpd = H.make_plan(data_parallel(gd, world), drop, world)
    gt, att = _megatron(world)
    tp = H.make_plan(gt, att, world)
    adam = dict(optimizer="adam", lr=0.01)
    sp, spm = seqpar_plan(world)
    half = _compute(dpd.pcg)[: len(_compute(dpd.pcg)) // 2 + 1]
    spc = _compute(sp.pcg)
    after_norm = spc[spc.index(next(n.id for n in sp.pcg.nodes() if n.op == "LayerNorm")) + 1:]
    extra = []
    if world == 4:      # ZeRO-3 over the copies of a tensor-parallel plan: Megatron x2 times batch x2
        nb = models.mlp_nobias()
        hybrid = {"x": [("Partition", 0, 2), ("Replicate", 2)], "a.weight": [("Partition", 1, 2), ("Replicate", 2)],
                  "b.weight": [("Partition", 0, 2), ("Replicate", 2)], "c.weight": [("Replicate", 4)]}
        hyb = H.make_plan(H.rebuild(H.load(nb), hybrid, after={5: [("AllReduce", 2)]}), nb, world)
        extra = [("hybrid plain", hyb, nb, adam), ("hybrid zero 3", _with(hyb, zero=3), nb, adam),
                 ("hybrid zero 1 + offload + recompute", _with(hyb, zero=1, offload=True, recompute=(
                     RecomputeRegion(_compute(hyb.pcg), "full"),)), nb, adam)]
    return extra + [
        ("dp recompute full (dropout)", _with(dpd, recompute=(RecomputeRegion(_compute(dpd.pcg), "full"),)), drop, {}),
        ("dp recompute selective (dropout)", _with(dpd, recompute=(RecomputeRegion(_compute(dpd.pcg), "selective"),)),
         drop, {}),
        ("tp recompute full (communication inside)", _with(tp, recompute=(RecomputeRegion(_compute(tp.pcg), "full"),)),
         att, {}),
        ("tp recompute selective", _with(tp, recompute=(RecomputeRegion(_compute(tp.pcg), "selective"),)), att, {}),
        ("dp zero 1", _with(dp, zero=1), mlp, adam),
        ("dp zero 2", _with(dp, zero=2), mlp, adam),
        ("dp zero 3", _with(dp, zero=3), mlp, adam),
        ("tp zero 3 (shards and copies)", _with(tp, zero=3), att, dict(optimizer="momentum", lr=0.05)),
        ("dp offload", _with(dp, offload=True), mlp, adam),
        ("dp zero 3 + offload + recompute of half the graph",
         _with(dpd, zero=3, offload=True, recompute=(RecomputeRegion(half, "full"),)), drop, adam),
        ("tp zero 2 + selective recompute", _with(tp, zero=2, recompute=(RecomputeRegion(_compute(tp.pcg), "selective"),)),
         att, adam),
        ("sequence parallel", sp, spm, adam),
        ("sequence parallel + recompute fed by the all-gather (the shard kept, gathered again)",
         _with(sp, recompute=(RecomputeRegion(after_norm, "full"),)), spm, adam),
        ("sequence parallel + zero 3 + selective recompute",
         _with(sp, zero=3, recompute=(RecomputeRegion(_compute(sp.pcg), "selective"),)), spm, adam),
        ("dp plain (adam)", dp, mlp, adam),
        ("dp plain (dropout)", dpd, drop, {}),
        ("tp plain", tp, att, {}),
    ]


def _run_all(world: int):
    cases = _cases(world)
    got = H.run_dist(world, _worker, [_case(p, m, **kw) for _, p, m, kw in cases], timeout=300)
    refs = {}
    for (name, p, m, kw), r0 in zip(cases, got[0]):
        key = (m, tuple(sorted(kw.items())))
        if key not in refs:
            refs[key] = H.reference(m, STEPS, **kw)
        _check(refs[key], r0, name)
    return {name: [g[i] for g in got] for i, (name, *_rest) in enumerate(cases)}


def _assert_memory(res: dict, world: int):
    par = lambda name: [r[2]["parameters"] for r in res[name]]      # noqa: E731
    opt = lambda name: [r[2]["optimizer"] for r in res[name]]       # noqa: E731
    plain = par("dp plain (adam)")
    # ZeRO-3: each rank holds 1/world of the (data-parallel) parameters, padding aside
    for full, shard in zip(plain, par("dp zero 3")):
        assert full / world <= shard <= full / world + 4 * world * 4, (full, shard)
    # Megatron's shards have no data-parallel copies on 2 devices (nothing more to shard); on 4 the 2 heads
    # give tensor parallelism x2 times data parallelism x2: halved again
    for full, z in zip(par("tp plain"), par("tp zero 3 (shards and copies)")):
        assert z == full if world == 2 else full / 2 <= z <= full / 2 + 64, (full, z)
    if "hybrid zero 3" in res:     # Megatron's shards halved again over their 2 copies, the last weight by 4
        for full, z in zip(par("hybrid plain"), par("hybrid zero 3")):
            assert full / 4 < z < full / 2, (full, z)
    # ZeRO-1/2: Adam's two states and the updated copy of 1/world of the values, not two full states
    for full, z1, z2 in zip(opt("dp plain (adam)"), opt("dp zero 1"), opt("dp zero 2")):
        assert z1 == z2 and z1 <= 3 * full / 2 / world + 64 * world, (full, z1)
    assert par("dp zero 1") == plain
    # offload: nothing of the update on the device, the states on the host
    for r in res["dp offload"]:
        assert r[2]["optimizer"] == 0 and r[2]["optimizer_host"] > 0
    # recomputation: fewer activation bytes saved for the backward
    for name, base in (("dp recompute full (dropout)", "dp plain (dropout)"), ("tp recompute full (communication inside)",
                                                                            "tp plain")):
        for r, b in zip(res[name], res[base]):
            assert r[3] < b[3] / 2, (name, r[3], b[3])
    for r, b in zip(res["dp recompute selective (dropout)"], res["dp plain (dropout)"]):
        assert r[3] < b[3], (r[3], b[3])


def test_memory_techniques_two_processes_equal_one():
    _assert_memory(_run_all(2), 2)


@pytest.mark.slow
def test_memory_techniques_four_processes_equal_one():
    _assert_memory(_run_all(4), 4)


def _run_cli(capfd, *args):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", *map(str, args), "--json", "--loss", "mean"])
    out, err = capfd.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_zero3_checkpoint_resume_continues_like_the_uninterrupted_run(tmp_path, capfd):
    """`unity-pcg run` of a ZeRO-3 + recompute plan (the plan says it, no flag): 5 steps checkpointed after
    3; resumed from step 3, the same losses; the checkpoint holds the full tensors by ONNX name, equal
    to a run without memory techniques; resuming under a plan with other memory techniques is refused in
    one line."""
    import shutil

    import torch

    from unity_pcg import plan as P
    from unity_pcg.executor import checkpoint as C

    from .runtime_plans import dp_plan, tiny_mlp_onnx
    model = tiny_mlp_onnx(str(tmp_path / "mlp.onnx"))
    plain = dp_plan(model, str(tmp_path / "dp2.json"), 2)
    p = P.load(plain)
    z3 = str(tmp_path / "dp2_zero3.json")
    _with(p, zero=3, recompute=(RecomputeRegion(_compute(p.pcg)[:3], "full"),)).save(z3)
    common = ["--model", model, "--optimizer", "adam", "--lr", "0.02"]
    ck, ck2, ck0 = tmp_path / "ck", tmp_path / "ck2", tmp_path / "ck0"
    rc, full, err = _run_cli(capfd, z3, *common, "--steps", 5, "--checkpoint", ck, "--checkpoint-every", 3)
    assert rc == 0, err
    rc, base, err = _run_cli(capfd, plain, *common, "--steps", 5, "--checkpoint", ck0)
    assert rc == 0, err
    np.testing.assert_allclose(full["losses"], base["losses"], rtol=1e-4)
    ck2.mkdir()
    shutil.copytree(ck / "step-00000003", ck2 / "step-00000003")
    (ck2 / "latest").write_text("step-00000003\n")
    rc, resumed, err = _run_cli(capfd, z3, *common, "--steps", 2, "--checkpoint", ck2, "--resume")
    assert rc == 0, err
    assert resumed["first_step"] == 3 and resumed["losses"] == full["losses"][3:]
    m1, o1, meta1 = C.load(str(ck))
    m2, o2, _ = C.load(str(ck2))
    m0, o0, _ = C.load(str(ck0))
    assert meta1["memory"]["zero"] == 3 and sorted(m1) == sorted(m0)
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
        assert torch.equal(o1["state"][k]["exp_avg"], o2["state"][k]["exp_avg"]), k
        np.testing.assert_allclose(m1[k].numpy(), m0[k].numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(o1["state"][k]["exp_avg_sq"].numpy(), o0["state"][k]["exp_avg_sq"].numpy(),
                                   rtol=1e-3, atol=1e-9)
    # the plan's memory field must match the checkpoint's
    rc, _, err = _run_cli(capfd, plain, *common, "--steps", 1, "--checkpoint", ck2, "--resume")
    assert rc == 2 and "memory techniques" in err and len(err.strip().splitlines()) == 1, err


def test_sequence_parallelism_lowers_to_reduce_scatter_and_all_gather():
    """The layout of sequence parallelism is one reduce-scatter (Partial -> Shard(seq)) before the norm
    and one all-gather (Shard(seq) -> Replicate) after it, on every rank (it trains equal to one process
    in the tests above)."""
    from unity_pcg.executor.lower import lower
    plan, _ = seqpar_plan(2)
    for rank in range(2):
        low = lower(plan.pcg, plan.views, rank, 2, plan.machine)
        kinds = [(rd.kind, rd.src, rd.dst) for _, rd in low.redistributions()]
        assert kinds == [("reduce_scatter", (("P",),), (("S", 1),)), ("all_gather", (("S", 1),), (("R",),))], kinds


def test_refusals_are_one_line():
    """A region a path leaves and re-enters cannot run as one sub-program; ZeRO-3 on a plan of several
    pipeline stages is not run: both refused in one line before any step (ZeRO-1 there runs:
    tests/executor/test_pipeline_memory.py)."""
    from unity_pcg import plan as P
    from unity_pcg.errors import UnityError
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.executor.train import Trainer

    from .runtime_plans import pipeline_plan, tiny_mlp_onnx
    drop = models.dropout_mlp()
    g = H.load(drop)
    ids = {n.op: n.id for n in g.nodes()}
    bad = _with(H.logical_plan(g, drop), recompute=(RecomputeRegion((ids["Add"], ids["Dropout"]), "full"),))
    with pytest.raises(UnityError, match="comes back") as e:
        Trainer(bad, drop)
    assert "\n" not in str(e.value)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        model = tiny_mlp_onnx(f"{d}/mlp.onnx")
        pp = P.load(pipeline_plan(model, f"{d}/pp.json"))
        with pytest.raises(UnityError, match="pipeline stages"):
            check_pipeline(_with(pp, zero=3))
