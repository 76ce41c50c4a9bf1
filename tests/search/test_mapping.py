import math

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper, exhaustive_mapping
from unity_pcg.search.sp import decompose
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG

from .graphs import diamond, mlp, n_shape, shared_weight, two_branches


def _hand_mixed():
    """A hand-parallelized graph with degree-1 and degree-2 operators and a transfer between them."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 8)})
    w = b.add("Weight", {"name": "w", "shape": (8, 8)})
    xp = b.add("Partition", {"dim": 0, "degree": 2}, [x])
    wr = b.add("Replicate", {"degree": 2}, [w])
    y = b.add("Linear", {}, [xp, wr], name="fc")
    y = b.add("Relu", {}, [y], name="relu")
    y = b.add("Combine", {"dim": 0, "degree": 2}, [y], name="comb")
    z = b.add("Tanh", {}, [y], name="tanh")
    b.set_outputs([z])
    return b.finish()


CASES = [
    ("mlp-none", lambda: mlp(layers=2), "local:1x3"),
    ("mlp-dp2", lambda: data_parallel(mlp(layers=2), 2), "local:1x4"),
    ("diamond-none", diamond, "local:1x3"),
    ("diamond-dp2", lambda: data_parallel(diamond(), 2), "local:1x4"),
    ("nshape-none", n_shape, "local:1x3"),
    ("nshape-dp2", lambda: data_parallel(n_shape(), 2), "local:1x2"),
    ("branches-none", lambda: two_branches(), "local:1x2"),
    ("branches-2nodes", lambda: two_branches(batch=64, h=256), "summit:2x1"),
    ("mixed", _hand_mixed, "summit:1x3"),
    ("shared-weight-dp2", lambda: data_parallel(shared_weight(), 2), "summit:1x3"),
]


@pytest.mark.parametrize("name,make,machine", CASES, ids=[c[0] for c in CASES])
def test_dp_equals_exhaustive(name, make, machine):
    g = make()
    model = CostModel(parse_machine(machine))
    r = MachineMapper(model).optimize(g)
    best, views = exhaustive_mapping(g, model)
    assert math.isfinite(best)
    assert r.cost == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_non_sp_graph_is_detected_and_mapped():
    g = n_shape()
    gc = GraphCost(g, CostModel(parse_machine("local:1x2")))
    assert decompose(g, gc.role).is_sp is False
    assert decompose(diamond(), GraphCost(diamond(), gc.model).role).is_sp is True
    r = MachineMapper(gc.model).optimize(g)
    assert r.feasible and set(r.views) == set(gc.nodes())


def test_side_by_side_is_chosen_when_it_pays():
    # two heavy independent branches, one device each on two nodes: side by side halves the time
    g = two_branches(batch=256, h=1024)
    model = CostModel(parse_machine("summit:2x1"))
    r = MachineMapper(model).optimize(g)
    seq = MachineMapper(model).evaluate(g, {n: v for n, v in r.views.items()})
    devs = {r.views[g.node(n).id].devices() for n in r.views}
    assert len({d for ds in devs for d in ds}) == 2          # both devices used
    assert r.cost < seq.breakdown.time                        # cheaper than running everything in turn


def test_dp_cost_equals_sum_of_leaves_without_side_by_side():
    g = data_parallel(mlp(batch=12, h=32, layers=3), 6)
    mm = MachineMapper(CostModel(parse_machine("summit:1x6")))
    r = mm.optimize(g)
    ev = mm.evaluate(g, r.views)
    assert r.cost == pytest.approx(ev.cost, rel=1e-12)
    assert r.cost == pytest.approx(r.breakdown.time, rel=1e-12)


def test_cache_reused_across_calls_and_graphs():
    mm = MachineMapper(CostModel(parse_machine("summit:1x6")))
    g = data_parallel(mlp(batch=12, h=32, layers=4), 6)
    r1 = mm.optimize(g)
    r2 = mm.optimize(g)
    assert r2.stats["cache_misses"] == 0 and r2.cost == r1.cost
    # a graph that differs only at its end reuses the subproblems upstream of the change
    e = g.edit()
    out = g.outputs[0]
    t = e.add("Tanh", {}, [out], name="extra")
    e.set_outputs([t])
    g2 = e.finish()
    r3 = mm.optimize(g2)
    assert r3.stats["cache_hits"] > 0
    fresh = MachineMapper(CostModel(parse_machine("summit:1x6"))).optimize(g2)
    assert r3.cost == pytest.approx(fresh.cost, rel=1e-12)
    assert r3.stats["cache_misses"] < fresh.stats["cache_misses"]


def test_memory_infeasible_plan_is_infeasible_not_slow():
    g = mlp(batch=8, h=4096, layers=2)   # 2 x 64 MiB weights, x4 with Adam = 512 MiB
    m = parse_machine("summit:1x1")
    import dataclasses
    small = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=256 * 2**20))
    r = MachineMapper(CostModel(small)).optimize(g)
    assert not r.feasible and r.cost == math.inf and "out of memory" in r.reason
    r_ok = MachineMapper(CostModel(m)).optimize(g)
    assert r_ok.feasible and r_ok.memory.max_bytes > 256 * 2**20


def test_exhaustive_comparison_catches_a_dp_without_resource_splits(monkeypatch):
    # the agreement test has teeth: a DP that never runs branches side by side misses the optimum
    from unity_pcg.machine import Resource
    g = two_branches(batch=64, h=256)
    model = CostModel(parse_machine("summit:2x1"))
    best, _ = exhaustive_mapping(g, model)
    monkeypatch.setattr(Resource, "splits", lambda self, m: iter(()))
    assert MachineMapper(model).optimize(g).cost > best * 1.01


def test_imported_densenet_maps_data_parallel():
    import os

    import onnx

    from unity_pcg.onnx_import import load_onnx
    dn = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_densenet121.onnx")
    if not os.path.exists(dn):
        pytest.skip("the onnx wheel ships no light_densenet121 test model")
    g = data_parallel(load_onnx(dn, batch=6, load_weights=False), 6)
    r = MachineMapper(CostModel(parse_machine("summit:1x6"))).optimize(g)
    assert r.feasible and r.stats["devices_used"] == 6
    assert r.cost == pytest.approx(r.breakdown.time, rel=1e-9)
    assert r.breakdown.sync > 0 and r.breakdown.compute > 0


def test_a_cut_techniques_choice_returns_the_plain_mapping_it_priced():
    """``first_views(plain_when_cut=True)`` under a deadline that has passed: the memory techniques' choice is
    cut and the mapping priced without them is returned (marked), equal to ``techniques=False``'s, instead of
    raising (the caller does not price the same mapping twice); without the flag the cut raises."""
    from unity_pcg.search.budget import Deadline, Expired, within
    g = data_parallel(mlp(batch=64, h=256, layers=4), 4)
    mp = MachineMapper(CostModel(parse_machine("summit:1x4"), optimizer="adam"))
    mp.default_techniques = True
    plain = mp.first_views(g, techniques=False)
    with within(Deadline(-1.0)):
        cut = mp.first_views(g, plain_when_cut=True)
        with pytest.raises(Expired):
            mp.first_views(g)
    assert cut.stats.get("techniques_cut") and "techniques_cut" not in plain.stats
    assert cut.cost == plain.cost and cut.views == plain.views and cut.feasible == plain.feasible
