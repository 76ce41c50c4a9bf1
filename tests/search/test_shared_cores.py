"""The cost model on machines whose devices share cores (local processes): nodes placed on fewer
devices get the idle devices' cores, side-by-side branches add, and the backward skips gradients that
no operand needs.  Machines without shared cores (GPU presets) are priced as before."""
import dataclasses
import math

import pytest

from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper, exhaustive_mapping
from unity_pcg.machine import parse_machine

from .graphs import mlp, two_branches


def _local(p: int, cores: int = 2, **meta):
    m = dataclasses.replace(parse_machine("local:1x2"), shared_cores=cores).resized(1, p)
    return dataclasses.replace(m, meta={**dict(m.meta), **meta}) if meta else m


def test_concurrency_factor_from_cores_and_from_calibration():
    m4 = _local(4)                                    # 4 processes on 2 cores: one alone runs 2x faster
    assert m4.solo_speedup() == pytest.approx(2.0)
    assert [m4.concurrency_factor(b) for b in (1, 2, 3, 4)] == pytest.approx([0.5, 0.5, 0.75, 1.0])
    m2 = _local(2)                                    # a core per process: nothing to gain
    assert m2.concurrency_factor(1) == 1.0
    cal = _local(2, solo_speedup=1.6)                 # calibrated: measured speedup wins (clamped to P)
    assert cal.concurrency_factor(1) == pytest.approx(1 / 1.6)
    assert _local(2, solo_speedup=9.0).concurrency_factor(1) == pytest.approx(0.5)
    assert parse_machine("summit:1x6").concurrency_factor(1) == 1.0


def test_calibrated_worlds_carry_their_solo_speedup():
    base = _local(2)
    dev = dataclasses.asdict(base.device)
    worlds = {"2": {"device": dev, "link": {"bandwidth": 1e9, "latency": 1e-4}, "solo_speedup": 1.8},
              "4": {"device": dev, "link": {"bandwidth": 1e9, "latency": 1e-4}}}
    m = dataclasses.replace(base, meta={"worlds": worlds, "device_world": 2})
    assert m.resized(1, 2).solo_speedup() == pytest.approx(1.8)
    assert "solo_speedup" not in m.resized(1, 2).resized(1, 4).meta      # not measured for 4: from cores
    assert m.resized(1, 4).solo_speedup() == pytest.approx(2.0)


def test_node_on_fewer_devices_is_cheaper_only_on_shared_cores():
    g = mlp(batch=8, h=64, layers=1)
    fc = next(n.id for n in g.nodes() if n.op == "Linear")
    one = GraphCost(g, CostModel(_local(4))).views(fc)[0]
    for machine, factor in ((_local(4), 0.5), (parse_machine("summit:1x4"), 1.0)):
        gc = GraphCost(g, CostModel(machine))
        f, b = gc.model.op_time("Linear", {}, g.input_shapes(fc), g.shapes(fc), gc.backward_scale(fc))
        assert gc.own_cost(fc, one).compute == pytest.approx((f + b) * factor)
        assert gc.compute_time(fc) <= gc.own_cost(fc, one).compute * (1 + 1e-12)   # a lower bound


def test_backward_skips_gradients_no_operand_needs():
    g = mlp(batch=8, h=64, layers=2)
    by_op = {}
    for i in g.topo_order():
        by_op.setdefault(g.node(i).op, []).append(i)
    fc0, fc1 = by_op["Linear"]
    relu0 = by_op["Relu"][0]
    shared = GraphCost(g, CostModel(_local(2)))
    assert shared.backward_scale(fc0) == 0.5          # the input needs no gradient: dW only
    assert shared.backward_scale(fc1) == 1.0          # its input comes from a trained weight
    assert shared.backward_scale(relu0) == 1.0
    gpu = GraphCost(g, CostModel(parse_machine("summit:1x2")))
    assert gpu.backward_scale(fc0) == 1.0             # GPU presets: uniform backward_factor
    f, b = shared.model.op_time("Linear", {}, g.input_shapes(fc0), g.shapes(fc0), 0.5)
    f1, b1 = shared.model.op_time("Linear", {}, g.input_shapes(fc0), g.shapes(fc0))
    assert f == f1 and b < b1


def test_no_gradient_at_all_means_no_backward():
    from unity_pcg.pcg import PCG
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 16)})
    y = b.add("Relu", {}, [x], name="r")
    b.set_outputs([y])
    g = b.finish()
    gc = GraphCost(g, CostModel(_local(2)))
    assert gc.backward_scale(y[0]) == 0.0
    f, bwd = gc.model.op_time("Relu", {}, g.input_shapes(y[0]), g.shapes(y[0]), 0.0)
    assert bwd == 0.0 and f > 0


@pytest.mark.parametrize("machine", ["local:1x2", "summit:1x2"])
def test_side_by_side_adds_on_shared_cores_and_dp_matches_exhaustive(machine):
    m = parse_machine(machine)
    if m.shared_cores == 0:
        assert CostModel(m).side_by_side(1.0, 2.0) == 2.0
    else:
        assert CostModel(m).side_by_side(1.0, 2.0) == 3.0
    g = two_branches(batch=64, h=256)
    model = CostModel(m)
    r = MachineMapper(model).optimize(g)
    best, _ = exhaustive_mapping(g, model)
    assert math.isfinite(best) and r.cost == pytest.approx(best, rel=1e-12)
