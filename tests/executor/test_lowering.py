"""Unit tests of the lowering (no processes): torch kernels against the numpy reference, the
counter-based dropout mask, what a lowered plan communicates and synchronizes, and the cost model's
price of synchronized BatchNorm statistics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from unity_pcg.executor.dropout import dropout_keep, logical_index
from unity_pcg.executor.kernels import KERNELS, TaskContext
from unity_pcg.executor.lower import lower
from unity_pcg.search.baselines import data_parallel
from unity_pcg import ops

from ..unity_pcg.op_cases import GENERATORS, RandDrawer
from . import dist_helpers as H
from . import models


@pytest.mark.parametrize("op", sorted(GENERATORS))
def test_torch_kernel_equals_numpy_reference(op):
    """Inference semantics (BatchNorm with running statistics, Dropout the identity) on random cases."""
    assert op in KERNELS
    for seed in range(6):
        case = GENERATORS[op](RandDrawer(seed * 7919 + len(op)))
        rng = np.random.default_rng(seed)
        xs = case.values(rng)
        want = ops.run_logical(case.op, case.attrs, xs)
        spec = ops.get_op(case.op)
        a = spec.normalize_attrs(case.attrs)
        got = KERNELS[case.op](a, [torch.as_tensor(x) for x in xs], TaskContext(training=False))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.detach().numpy(), w, rtol=2e-4, atol=2e-5, err_msg=f"{op} {case}")


def test_dropout_mask_is_the_same_under_any_partitioning():
    sizes = (6, 8, 4)
    full = dropout_keep(3, 7, 11, logical_index(sizes, (0, 0, 0), sizes, "cpu"), 0.3)
    assert 0.6 < full.float().mean().item() < 0.8
    piece = dropout_keep(3, 7, 11, logical_index(sizes, (2, 4, 0), (2, 4, 4), "cpu"), 0.3)
    assert torch.equal(piece, full[2:4, 4:8, :])
    other_step = dropout_keep(3, 8, 11, logical_index(sizes, (0, 0, 0), sizes, "cpu"), 0.3)
    assert not torch.equal(full, other_step)


def test_data_parallel_lowering_is_local_and_syncs_every_weight_over_all_devices():
    path = models.mlp()
    g = data_parallel(H.load(path), 2)
    plan = H.make_plan(g, path, 2)
    for rank in range(2):
        low = lower(plan.pcg, plan.views, rank, 2, plan.machine)
        computes = [s for s in low.steps if s.kind == "compute"]
        assert computes and all(not s.exchanges for s in computes)          # forward without messages
        assert all(src.kind == "source" for s in computes for src in s.inputs if src.ref[0] in
                   {n.id for n in g.nodes() if low.role[n.id] == "weight-placement"})
        for name, uses in low.weight_uses.items():
            assert sorted({d for _, d in uses}) == [0, 1]


def test_megatron_lowering_shards_weights_and_reduces_partial_sums():
    path = models.mlp_nobias()
    g = H.apply_rule(H.load(path), "megatron_mlp_column_row")
    plan = H.make_plan(g, path, 2)
    from unity_pcg.executor.train import _atoms
    low = lower(plan.pcg, plan.views, 0, 2, plan.machine)
    # the column- and row-split weights are read on one device per region: no gradient all-reduce
    split = [g.node(n.inputs[0][0]).a["name"] for n in g.nodes() if n.op == "Partition"
             and g.node(n.inputs[0][0]).op == "Weight"]
    assert len(split) == 2
    for name in split:
        shape = next(n.a["shape"] for n in g.sources("Weight") if n.a["name"] == name)
        atoms = _atoms(tuple(shape), low.weight_uses[name])
        assert len(atoms) == 2 and all(len(devs) == 1 for _, devs in atoms)
    reduce = [s for s in low.steps if s.op == "Reduce"]
    assert len(reduce) == 1
    dst = plan.views[reduce[0].node].devices()[0]
    assert reduce[0].combine == ("reduce", (0, 1), dst) and not reduce[0].exchanges   # one torch reduce


def test_allreduce_lowers_to_one_collective_when_copies_sit_with_partial_sums():
    path = models.mlp_nobias()
    g0 = H.load(path)
    g = H.rebuild(g0, {"x": [("Replicate", 2)], "a.weight": [("Partition", 1, 2)], "b.weight": [("Partition", 0, 2)],
                       "c.weight": [("Replicate", 2)]}, after={5: [("AllReduce", 2)]})
    plan = H.make_plan(g, path, 2)
    ar_node = next(n.id for n in g.nodes() if n.op == "AllReduce")
    assert set(plan.views[ar_node].devices()) == {0, 1}
    # a DTensor redistribution Partial -> Replicate on the mesh of devices 0, 1 (one all-reduce)
    low = lower(plan.pcg, plan.views, 1, 2, plan.machine)
    ar = next(s for s in low.steps if s.node == ar_node)
    assert ar.combine[0] == "dtensor" and not ar.exchanges
    rd = ar.combine[1]
    assert (rd.kind, rd.mesh.devices, rd.src, rd.dst) == ("all_reduce", (0, 1), (("P",),), (("R",),))
    # without DTensor: one torch.distributed all_reduce
    low = lower(plan.pcg, plan.views, 1, 2, plan.machine, dtensor=False)
    ar = next(s for s in low.steps if s.node == ar_node)
    assert ar.combine == ("allreduce", (0, 1)) and not ar.exchanges


def test_cost_model_prices_synchronized_batchnorm_statistics():
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.machine import MachineView, local
    path = models.convnet()
    g1 = H.load(path)
    g2 = data_parallel(g1, 2)
    m = local(1, 2)
    bn1 = next(n.id for n in g1.nodes() if n.op == "BatchNorm")
    bn2 = next(n.id for n in g2.nodes() if n.op == "BatchNorm")
    c1 = GraphCost(g1, CostModel(m)).own_cost(bn1, MachineView(0, ()))
    c2 = GraphCost(g2, CostModel(m)).own_cost(bn2, MachineView(0, ((2, 1),)))
    assert c1.comm == 0.0 and c2.comm > 0.0


def test_gradient_atoms_of_a_weight_read_in_two_layouts():
    """A weight read row-split on devices 0 and 1 and whole on device 2: each half's gradient is summed
    over the devices that read it (0 and 2, 1 and 2); a weight read once per region is not synchronized."""
    from unity_pcg.executor.train import _atoms
    uses = [(((0, 4), (0, 8)), 0), (((4, 8), (0, 8)), 1), (((0, 8), (0, 8)), 2)]
    assert _atoms((8, 8), uses) == [(((0, 4), (0, 8)), (0, 2)), (((4, 8), (0, 8)), (1, 2))]
    cols = [(((0, 8), (0, 4)), 0), (((0, 8), (4, 8)), 1)]
    assert [devs for _, devs in _atoms((8, 8), cols)] == [(0,), (1,)]
    assert _atoms((), [((), 0), ((), 1)]) == [((), (0, 1))]
