"""Layouts and redistributions on DTensor / DeviceMesh (executor/dtensor.py): which movements of a
plan the lowering turns into one DTensor redistribution (kind, mesh, placements), and training through
them on 2 and 4 gloo processes equals single-process training, with torch's ``DTensor.redistribute``
counted in the ranks (the path is DTensor's, not a hand-written collective)."""
from __future__ import annotations

from collections import Counter

import pytest

from unity_pcg.executor.dtensor import MeshSpec, plan_redistribution
from unity_pcg.executor.lower import lower
from unity_pcg.shape import ParallelTensorShape
from unity_pcg.search.baselines import build_strategy

from . import dist_helpers as H
from . import models

R2 = [("Replicate", 2)]


def _plans():
    """name -> (PCG, model, world): chains of parallel operators between compute operators."""
    mlp = models.mlp_nobias()
    gm = H.load(mlp)
    megatron_pair = {"x": R2, "a.weight": [("Partition", 1, 2)], "b.weight": [("Partition", 0, 2)]}
    return {
        # Megatron pair whose partial sums are all-reduced (the fused AllReduce)
        "all_reduce": (H.rebuild(gm, {**megatron_pair, "c.weight": R2}, after={5: [("AllReduce", 2)]}), mlp, 2),
        # Reduce then Replicate of the partial sums: one all-reduce too
        "reduce+replicate": (H.rebuild(gm, {**megatron_pair, "c.weight": R2}, after={5: [("Reduce", 2), ("Replicate", 2)]}),
                             mlp, 2),
        # data-parallel layer, then Combine + Replicate of its batch pieces: an all-gather
        "combine+replicate": (H.rebuild(gm, {"x": [("Partition", 0, 2)], "a.weight": R2, "b.weight": R2, "c.weight": R2},
                                        after={2: [("Combine", 0, 2), ("Replicate", 2)]}), mlp, 2),
        # partial sums reduced into batch shards: a reduce-scatter
        "reduce+partition": (H.rebuild(gm, {**megatron_pair, "c.weight": R2}, after={5: [("Reduce", 2), ("Partition", 0, 2)]}),
                             mlp, 2),
        # the same at the model's output (the loss is computed on the batch shards)
        "reduce+partition at the output": (H.rebuild(gm, {"x": R2, "a.weight": R2, "b.weight": [("Partition", 1, 2)],
                                                          "c.weight": [("Partition", 0, 2)]},
                                                     after={7: [("Reduce", 2), ("Partition", 0, 2)]}), mlp, 2),
        # column-split activations re-split on the batch: an all-to-all
        "combine+partition": (H.rebuild(gm, {"x": R2, "a.weight": [("Partition", 1, 2)], "b.weight": R2, "c.weight": R2},
                                        after={2: [("Combine", 1, 2), ("Partition", 0, 2)]}), mlp, 2),
        # a Combine undone by a Partition on the same devices: nothing moves
        "combine+partition back": (H.rebuild(gm, {"x": R2, "a.weight": [("Partition", 1, 2)], "b.weight": [("Partition", 0, 2)],
                                                  "c.weight": R2}, after={2: [("Combine", 1, 2), ("Partition", 1, 2)]}),
                                   mlp, 2),
        # 2-D mesh: batch x2 times Megatron x2, partial sums reduced into finer batch shards
        "2d reduce+partition": (H.rebuild(gm, {"x": [("Partition", 0, 2), ("Replicate", 2)],
                                               "a.weight": [("Partition", 1, 2), ("Replicate", 2)],
                                               "b.weight": [("Partition", 0, 2), ("Replicate", 2)],
                                               "c.weight": [("Replicate", 4)]},
                                           after={5: [("Reduce", 2), ("Partition", 0, 2)]}), mlp, 4),
        # 2-D mesh hybrid ending in an AllReduce over the tensor-parallel pairs
        "2d all_reduce": (H.rebuild(gm, {"x": [("Partition", 0, 2), ("Replicate", 2)],
                                         "a.weight": [("Partition", 1, 2), ("Replicate", 2)],
                                         "b.weight": [("Partition", 0, 2), ("Replicate", 2)],
                                         "c.weight": [("Replicate", 4)]}, after={5: [("AllReduce", 2)]}), mlp, 4),
    }


EXPECT = {
    "all_reduce": ("all_reduce", (2,), (("P",),), (("R",),), 0),
    "reduce+replicate": ("all_reduce", (2,), (("P",),), (("R",),), 1),
    "combine+replicate": ("all_gather", (2,), (("S", 0),), (("R",),), 1),
    "reduce+partition": ("reduce_scatter", (2,), (("P",),), (("S", 0),), 1),
    "combine+partition": ("all_to_all", (2,), (("S", 1),), (("S", 0),), 1),
    "reduce+partition at the output": ("reduce_scatter", (2,), (("P",),), (("S", 0),), 1),
    "combine+partition back": ("none", (2,), (("S", 1),), (("S", 1),), 1),
    # the mapper puts the partial-sum pairs on neighbouring devices (the reduce-scatter's groups): mesh (batch, sum)
    "2d reduce+partition": ("reduce_scatter", (2, 2), (("S", 0), ("P",)), (("S", 0), ("S", 0)), 1),
    "2d all_reduce": ("all_reduce", (2, 2), (("P",), ("S", 0)), (("R",), ("S", 0)), 0),
}


@pytest.fixture(scope="module")
def plans():
    out = {}
    for name, (g, path, world) in _plans().items():
        out[name] = (H.make_plan(g, path, world), path, world)
    return out


def test_combine_undone_by_partition_moves_nothing(plans):
    plan, _, world = plans["combine+partition back"]
    for r in range(world):
        low = lower(plan.pcg, plan.views, r, world, plan.machine)
        assert not low.redistributions() and len(low.fused) == 1
        part = next(s for s in low.steps if s.op == "Partition" and s.kind == "parallel")
        comb = next(s for s in low.steps if s.op == "Combine" and s.node in low.fused)
        assert part.combine == ("one",) and part.inputs[0].kind == "local" and not part.exchanges
        assert tuple(part.inputs[0].ref) == tuple(plan.pcg.node(comb.node).inputs[0])   # the Combine's input piece
    old = lower(plan.pcg, plan.views, 0, world, plan.machine, dtensor=False)
    assert {s.combine[0] for s in old.steps if s.kind == "parallel"} >= {"gather", "scatter"}


@pytest.mark.parametrize("name", sorted(k for k in EXPECT if EXPECT[k][0] != "none"))
def test_chain_of_parallel_operators_lowers_to_one_redistribution(plans, name):
    plan, _, world = plans[name]
    kind, mesh_shape, src, dst, fused = EXPECT[name]
    lows = [lower(plan.pcg, plan.views, r, world, plan.machine) for r in range(world)]
    rds = lows[0].redistributions()
    assert len(rds) == 1, rds
    end, rd = rds[0]
    assert (rd.kind, rd.mesh.shape, rd.src, rd.dst) == (kind, mesh_shape, src, dst)
    assert sorted(rd.mesh.devices) == list(range(world))
    assert len(lows[0].fused) == fused                   # the chain's other operators run nowhere
    for r, low in enumerate(lows):
        assert [(i, x.mesh, x.src, x.dst) for i, x in low.redistributions()] == \
            [(end, rd.mesh, rd.src, rd.dst)]               # every rank plans the same meshes and groups
        assert low.groups == lows[0].groups and set(rd.mesh.slices()) <= low.groups
        st = next(s for s in low.steps if s.node == end)
        assert st.combine[0] == "dtensor" and not st.exchanges
        assert st.inputs[0].kind == "local" and st.outputs == [(end, 0)]   # every member holds its piece
        for s in low.steps:
            if s.node in low.fused:
                assert not s.inputs and not s.outputs and not s.exchanges
    # without DTensor the same plan moves the pieces with torch.distributed collectives / messages
    old = lower(plan.pcg, plan.views, 0, world, plan.machine, dtensor=False)
    assert not old.redistributions() and not old.fused


def test_mesh_follows_the_piece_to_device_assignment():
    """The mesh is read from the piece -> device maps (flat grid order: copy, sum, shard dims)."""
    S = ParallelTensorShape.of
    part = S((8, 4), sum_degree=2)                      # partial sums on 2 devices
    rep = S((8, 4), copy_degree=2)
    rd = plan_redistribution(part, [0, 1], rep, [1, 0])  # copies (and partial sums) in any order
    assert rd is not None and rd.kind == "all_reduce"
    assert rd.mesh == MeshSpec((2,), (0, 1))
    rows = S((8, 4), (2, 1))
    # shard 0 on device 1 and shard 1 on device 0: a process group numbers its members 0, 1 -> no mesh
    assert plan_redistribution(rows, [1, 0], rep, [0, 1]) is None
    assert plan_redistribution(rows, [0, 1], rep, [0, 1]).kind == "all_gather"
    # the two sides on different devices, a device holding two pieces, one device: not a redistribution
    assert plan_redistribution(rows, [0, 1], rep, [1, 2]) is None
    assert plan_redistribution(rows, [0, 0], rep, [0, 0]) is None
    assert plan_redistribution(S((8, 4)), [0], S((8, 4)), [0]) is None
    # Replicate -> Shard: DTensor's backward would all-gather the shards' gradients into every copy
    assert plan_redistribution(rep, [0, 1], rows, [0, 1]) is None
    # 2 x 2: batch shards x partial sums -> 4 batch shards (the sum axis is the major mesh dim here)
    a = S((8, 4), (2, 1), sum_degree=2)                 # grid (copy 1, sum 2, rows 2): devices 0 1 | 2 3
    b = S((8, 4), (4, 1))
    rd = plan_redistribution(a, [0, 1, 2, 3], b, [0, 1, 2, 3])
    assert (rd.mesh.shape, rd.src, rd.dst, rd.kind) == ((2, 2), (("P",), ("S", 0)), (("S", 0), ("S", 0)),
                                                        "reduce_scatter")
    # sum index minor: row shard i on devices 2i, 2i+1 (partial sums side by side)
    rd = plan_redistribution(a, [0, 2, 1, 3], S((8, 4), (2, 1), copy_degree=2), [0, 2, 1, 3])
    assert rd is not None and rd.kind == "all_reduce" and rd.mesh.shape == (2, 2)
    sums = [sl for sl in rd.mesh.slices() if rd.src[rd.mesh.slices().index(sl) // 2] == ("P",)]
    assert sorted(sums) == [(0, 1), (2, 3)]               # the partial sums of a row shard add up
    # merged mesh dims: 4 batch shards gathered into 4 copies is one all-gather over a 1-D mesh of 4
    rd = plan_redistribution(b, [0, 1, 2, 3], S((8, 4), copy_degree=4), [0, 1, 2, 3])
    assert rd.mesh == MeshSpec((4,), (0, 1, 2, 3)) and rd.kind == "all_gather"


def test_megatron_transformer_block_all_reduces_through_dtensor():
    g = H.load(models.attention())
    plan = H.make_plan(build_strategy(g, "megatron", 2), models.attention(), 2)
    low = lower(plan.pcg, plan.views, 0, 2, plan.machine)
    kinds = [rd.kind for _, rd in low.redistributions()]
    assert kinds and set(kinds) == {"all_reduce"}
    assert not any(s.combine and s.combine[0] == "allreduce" for s in low.steps)


# --- training through the redistributions -------------------------------------------------------------------

FUNCOL = {"all_reduce": "all_reduce", "all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single",
          "all_to_all": "shard_dim_alltoall"}


def _count_worker(rank: int, world: int, cases: list) -> list:
    """Train every case; per case (losses, state on rank 0, calls): the collectives DTensor's placements
    issued (torch's functional collectives, by name), DTensor's ``redistribute_local_tensor`` calls of
    the lowering's redistributions and ``DTensor.redistribute`` calls (the ``api`` mode)."""
    import os
    from collections import Counter

    import torch.distributed._functional_collectives as funcol
    import torch.distributed.tensor.placement_types as pt
    from torch.distributed.tensor import DTensor

    from unity_pcg import plan as plan_mod
    from unity_pcg.executor import dtensor as dt
    calls: Counter = Counter()
    patched = []

    def wrap(mod, name, label):
        orig = getattr(mod, name)

        def counting(*a, **kw):
            calls[label] += 1
            return orig(*a, **kw)
        setattr(mod, name, counting)
        patched.append((mod, name, orig))
    for fn in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        wrap(funcol, fn, fn)
    wrap(pt, "shard_dim_alltoall", "shard_dim_alltoall")
    wrap(dt, "_redistribute_local", "redistribute_local_tensor")
    wrap(DTensor, "redistribute", "DTensor.redistribute")
    out = []
    try:
        for c in cases:
            c = dict(c)
            calls.clear()
            os.environ["UNITY_PCG_DTENSOR"] = c.pop("mode", "1")
            p = plan_mod.from_json(c.pop("plan"))
            losses, state = H.train(p, c.pop("model"), c.pop("steps"), rank=rank, world=world, **c)
            out.append((losses, state if rank == 0 else None, dict(calls)))
    finally:
        os.environ.pop("UNITY_PCG_DTENSOR", None)
        for mod, name, orig in reversed(patched):
            setattr(mod, name, orig)
    return out


def _check(plans, names, world, targets=None, mode="1"):
    cases, refs = [], {}
    for name in names:
        plan, path, _ = plans[name]
        cases.append(dict(H.case(plan, path, targets=targets), mode=mode))
        if path not in refs:
            refs[path] = H.reference(path, 5, targets=targets)
    got = H.run_dist(world, _count_worker, cases)
    for i, name in enumerate(names):
        plan, path, _ = plans[name]
        losses, state, _ = got[0][i]
        H.assert_same(refs[path], (losses, state), what=name)
        kind = EXPECT[name][0]
        for r in range(world):
            calls = got[r][i][2]
            if kind == "none":           # nothing moves
                assert not calls, (name, r, calls)
                continue
            # 5 steps, one redistribution each, forward and backward: DTensor's collectives ran (an
            # all-reduce's backward is an all-reduce, an all-gather's a reduce-scatter, ...)
            back = {"all_reduce": "all_reduce", "all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
                    "all_to_all": "all_to_all"}[kind]
            want = Counter({FUNCOL[kind]: 5})
            want[FUNCOL[back]] += 5
            got_coll = Counter({k: v for k, v in calls.items() if k in FUNCOL.values()})
            if kind == "all_to_all":     # gloo has no all-to-all: torch runs it as an all-gather + chunk
                got_coll.pop("all_gather_single", None)
            if len(EXPECT[name][1]) == 1:
                assert got_coll == want, (name, r, calls)
            else:                        # 2-D: DTensor may add steps (e.g. to change the shard order)
                assert all(got_coll[k] >= n for k, n in want.items()), (name, r, calls)
            if mode == "api":
                assert calls["DTensor.redistribute"] == 5, (name, r, calls)
            else:                        # one node: forward and backward through redistribute_local_tensor
                assert calls["redistribute_local_tensor"] == 10 and "DTensor.redistribute" not in calls, (name, calls)


def test_two_processes_train_through_dtensor_redistributions(plans):
    _check(plans, ["all_reduce", "reduce+replicate", "combine+replicate", "reduce+partition", "combine+partition",
                   "combine+partition back"], 2)


def test_two_processes_through_the_public_dtensor_api(plans):
    """UNITY_PCG_DTENSOR=api: DTensor.from_local(...).redistribute(...).to_local(...) per movement."""
    _check(plans, ["all_reduce", "combine+replicate", "reduce+partition", "combine+partition"], 2, mode="api")


def test_nonlinear_loss_on_redistributed_outputs(plans):
    """Mean-square loss on an AllReduce's copies (each copy adds 1/k; the gradient scaled by k) and on
    the batch shards a reduce-scatter leaves at the output."""
    import numpy as np
    rng = np.random.default_rng(3)
    mse = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(5)]
    g = H.load(models.mlp_nobias())
    pair = H.rebuild(g, {"x": R2, "a.weight": R2, "b.weight": [("Partition", 1, 2)], "c.weight": [("Partition", 0, 2)]},
                     after={7: [("AllReduce", 2)]})
    plan = H.make_plan(pair, models.mlp_nobias(), 2)
    low = lower(plan.pcg, plan.views, 0, 2, plan.machine)
    assert [rd.kind for _, rd in low.redistributions()] == ["all_reduce"]
    ref = H.reference(models.mlp_nobias(), 5, targets=mse)
    rs, _, _ = plans["reduce+partition at the output"]
    got = H.run_dist(2, _count_worker, [H.case(plan, models.mlp_nobias(), targets=mse),
                                        H.case(rs, models.mlp_nobias(), targets=mse)])
    H.assert_same(ref, got[0][0][:2], what="AllReduce at the output, mse")
    H.assert_same(ref, got[0][1][:2], what="reduce-scatter at the output, mse")
    # the AllReduce whose copies the loss reads: 5 all-reduces forward, none backward (scaled by k)
    assert {k: v for k, v in got[0][0][2].items() if k in FUNCOL.values()} == {"all_reduce": 5}
    assert got[0][1][2]["reduce_scatter_single"] == 5 and got[0][1][2]["all_gather_single"] == 5


@pytest.mark.slow
def test_four_processes_train_through_2d_mesh_redistributions(plans):
    _check(plans, ["2d reduce+partition", "2d all_reduce"], 4)
