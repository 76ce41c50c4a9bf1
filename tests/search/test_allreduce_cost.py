"""The fused AllReduce parallel operator (Reduce then Replicate as one collective) is priced as one
ring all-reduce: 2(p-1)N elements, and no slower than the Reduce + Replicate pair it replaces."""
from __future__ import annotations

from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG


def _graph(fused: bool) -> PCG:
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (64, 256)})
    w = b.add("Weight", {"name": "w", "shape": (256, 256)})
    xp = b.add("Partition", {"dim": 1, "degree": 2}, [x])
    wp = b.add("Partition", {"dim": 0, "degree": 2}, [w])
    y = b.add("MatMul", {}, [xp, wp])                      # partial sums, sum degree 2
    if fused:
        y = b.add("AllReduce", {"degree": 2}, [y])
    else:
        y = b.add("Replicate", {"degree": 2}, [b.add("Reduce", {"degree": 2}, [y])])
    w2 = b.add("Weight", {"name": "w2", "shape": (256, 256)})
    z = b.add("Relu", {}, [b.add("Linear", {}, [y, b.add("Replicate", {"degree": 2}, [w2])])])
    b.set_outputs([z])
    return b.finish()


def test_allreduce_priced_as_one_ring_all_reduce():
    m = parse_machine("summit:1x2")
    fused = MachineMapper(CostModel(m)).optimize(_graph(True))
    pair = MachineMapper(CostModel(m)).optimize(_graph(False))
    assert fused.feasible and pair.feasible
    assert fused.cost < pair.cost
    # all-reduce of the 64x256 partial sums over 2 devices, 2(p-1)N elements, in forward and in
    # backward; plus the gradient all-reduce of the replicated 256x256 weight w2
    assert fused.breakdown.comm_elements == 2 * (2 * 64 * 256) + 2 * 256 * 256
    assert 0 < fused.breakdown.comm < pair.breakdown.comm
