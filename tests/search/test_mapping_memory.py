"""Memory-aware machine mapping: ``MachineMapper.optimize`` returns the fastest mapping that fits the
devices' memory, checked against exhaustive enumeration (``exhaustive_mapping(memory=True)``) on small
graphs whose capacity is set just below what the time-optimal mapping needs."""
import dataclasses
import math

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper, exhaustive_mapping
from unity_pcg.machine import parse_machine

from .graphs import mlp, n_shape, shared_weight, two_branches
from .test_mapping_join import k_branches


def capped(machine: str, capacity: int):
    """The machine with devices of ``capacity`` bytes, all of it usable (no runtime reserve)."""
    m = parse_machine(machine)
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(capacity), usable_fraction=1.0,
                                                             reserved_bytes=0))


def time_optimal_peak(g, machine: str, optimizer="adam") -> tuple[float, int]:
    """(time, peak memory per device) of the time-optimal mapping on an unbounded device."""
    r = MachineMapper(CostModel(capped(machine, 2**60), optimizer)).optimize(g)
    assert r.feasible
    return r.cost, r.memory.max_bytes


CASES = [
    ("mlp2-1x2", lambda: mlp(batch=8, h=64, layers=2), "local:1x2"),
    ("mlp3-1x3", lambda: mlp(batch=8, h=64, layers=3), "summit:1x3"),
    ("mlp2-dp2-1x4", lambda: data_parallel(mlp(batch=8, h=64, layers=2), 2), "local:1x4"),
    ("branches-2x1", lambda: two_branches(batch=64, h=256), "summit:2x1"),
    ("branches-1x3", lambda: two_branches(batch=16, h=128), "summit:1x3"),
    ("join4-1x2", lambda: k_branches(4, batch=8, h=64), "local:1x2"),
    ("join3-uneven-1x3", lambda: k_branches(3, batch=16, h=64, widths=(64, 16, 128)), "summit:1x3"),
    ("nshape-1x3", lambda: n_shape(batch=64, h=64), "local:1x3"),
    ("shared-weight-1x2", lambda: shared_weight(batch=8, h=64), "summit:1x2"),
]


@pytest.mark.parametrize("name,make,machine", CASES, ids=[c[0] for c in CASES])
def test_fastest_mapping_that_fits_equals_exhaustive(name, make, machine):
    g = make()
    t_opt, peak = time_optimal_peak(g, machine)
    for cap in (peak - 1, (peak * 3) // 4):
        model = CostModel(capped(machine, cap))
        best, views = exhaustive_mapping(g, model, limit=500_000, memory=True)
        r = MachineMapper(model).optimize(g)
        if math.isfinite(best):
            assert r.feasible, (cap, r.reason)
            assert r.cost == pytest.approx(best, rel=1e-12, abs=1e-15)
            assert r.memory.max_bytes <= cap
            assert best >= t_opt * (1 - 1e-12)   # never faster than the unconstrained optimum
        else:
            assert not r.feasible and r.cost == math.inf and "out of memory" in r.reason


def test_cases_include_a_slower_mapping_that_fits():
    # the agreement test above has teeth: in most cases the time-optimal mapping does not fit the
    # capacity just below its peak while a strictly slower mapping of the same PCG does
    found = 0
    for _, make, machine in CASES:
        g = make()
        t_opt, peak = time_optimal_peak(g, machine)
        best, _ = exhaustive_mapping(g, CostModel(capped(machine, peak - 1)), limit=500_000, memory=True)
        found += math.isfinite(best) and best > t_opt * (1 + 1e-9)
    assert found >= 6


def test_exhaustive_reference_respects_capacity():
    g = mlp(batch=8, h=64, layers=2)
    t_opt, peak = time_optimal_peak(g, "local:1x2")
    best, _ = exhaustive_mapping(g, CostModel(capped("local:1x2", peak)), memory=True)
    assert best == pytest.approx(t_opt, rel=1e-12)           # fits exactly at its own peak
    best, views = exhaustive_mapping(g, CostModel(capped("local:1x2", peak - 1)), memory=True)
    assert math.isfinite(best) and best > t_opt
    devs = {v.devices() for v in views.values()}
    assert len({d for ds in devs for d in ds}) == 2          # the layers are spread over both devices


def test_layers_too_large_for_one_device_are_spread_over_devices():
    # 4 Linear layers of 64 MiB (256 MiB each with Adam's states) on 4 devices of 300 MiB: the
    # time-optimal mapping keeps them on one device (no transfers) and does not fit; the memory-aware
    # mapping puts one layer per device -- a model-parallel plan of the same PCG
    g = mlp(batch=8, h=4096, layers=4)
    t_opt, peak = time_optimal_peak(g, "summit:1x4")
    assert peak > 300 * 2**20
    r = MachineMapper(CostModel(capped("summit:1x4", 300 * 2**20))).optimize(g)
    assert r.feasible and r.memory.max_bytes <= 300 * 2**20
    assert r.stats["devices_used"] == 4 and r.cost > t_opt
    assert r.breakdown.comm > 0                                # activations now cross devices
    ev = MachineMapper(CostModel(capped("summit:1x4", 300 * 2**20))).evaluate(g, r.views)
    assert ev.feasible and ev.cost == pytest.approx(r.cost, rel=1e-12)


def test_time_optimal_mapping_that_fits_skips_the_memory_dp():
    g = mlp(batch=8, h=64, layers=3)
    mm = MachineMapper(CostModel(parse_machine("summit:1x3")))
    r = mm.optimize(g)
    assert r.feasible and "memory_dp_s" not in r.stats and not mm.mcache


def test_no_mapping_fits_names_the_device_and_the_excess():
    # each layer alone needs 256 MiB: the lower bound says at once that nothing fits 200 MiB
    g = mlp(batch=8, h=4096, layers=2)
    r = MachineMapper(CostModel(capped("summit:1x2", 200 * 2**20))).optimize(g)
    assert not r.feasible and r.cost == math.inf
    assert r.stats["memory_dp_s"] == 0.0 and r.stats["memory_lower_bound"] > 200 * 2**20
    assert "every mapping" in r.reason and "device 0 needs" in r.reason and "over capacity" in r.reason
    # 3 layers of 256 MiB on 2 devices of 500 MiB: the bound (384 MiB) allows it, but any device
    # holding two layers is over: the Pareto DP finds nothing
    g = mlp(batch=8, h=4096, layers=3)
    r = MachineMapper(CostModel(capped("summit:1x2", 500 * 2**20))).optimize(g)
    assert not r.feasible and r.stats["memory_lower_bound"] <= 500 * 2**20
    assert r.stats["memory_front"] == 0
    assert r.reason.startswith("out of memory: no mapping of this graph fits") and "over capacity" in r.reason
    # with room for two layers on a device it fits
    assert MachineMapper(CostModel(capped("summit:1x2", 530 * 2**20))).optimize(g).feasible


def test_memory_lower_bound_is_a_lower_bound():
    from unity_pcg.search.cost import GraphCost
    from unity_pcg.search.memory import memory_lower_bound
    for make, machine in [(lambda: mlp(batch=8, h=64, layers=3), "summit:1x3"),
                          (lambda: data_parallel(mlp(batch=8, h=64, layers=2), 2), "local:1x4"),
                          (lambda: data_parallel(mlp(batch=8, h=64, layers=2), 4), "local:1x4")]:
        g = make()
        model = CostModel(capped(machine, 2**60))
        lb = memory_lower_bound(GraphCost(g, model))
        _, peak = time_optimal_peak(g, machine)
        assert 0 < lb <= peak
        # no mapping at all fits a byte below the bound (exhaustive enumeration)
        best, _ = exhaustive_mapping(g, CostModel(capped(machine, lb - 1)), memory=True)
        assert best == math.inf
    # data parallel over every device: the bound is exact (every device holds the same)
    g = data_parallel(mlp(batch=8, h=64, layers=2), 4)
    lb = memory_lower_bound(GraphCost(g, CostModel(parse_machine("local:1x4"))))
    assert lb == time_optimal_peak(g, "local:1x4")[1]


def test_memory_aware_results_are_cached_across_calls():
    g = mlp(batch=8, h=4096, layers=4)
    mm = MachineMapper(CostModel(capped("summit:1x4", 300 * 2**20)))
    r1 = mm.optimize(g)
    n = len(mm.mcache)
    r2 = mm.optimize(g)
    assert len(mm.mcache) == n and r2.cost == r1.cost and r2.views == r1.views


def test_simulate_reports_out_of_memory_with_its_reason(tmp_path, capsys):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    from unity_pcg.cli import main
    model = tmp_path / "mlp.onnx"
    zoo.export("mlp", str(model), size="tiny", batch=12)
    m = tmp_path / "m.json"
    capped("summit:1x2", 2**20).save(str(m))       # 1 MiB devices
    for strategy in ("none", "dp"):
        assert main(["simulate", str(model), "--machine", f"{m}:1x2", "--strategy", strategy]) == 1
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("feasible"))
        assert "NO: out of memory" in line and "device " in line and "over capacity" in line


@pytest.mark.parametrize("seed", range(8))
def test_random_joins_fastest_fit_equals_exhaustive(seed):
    # random k-way splits joined by a Concat (the DP's joint join pricing), sometimes data parallel
    import random

    from .test_mapping_join import _random_join_graph
    rng = random.Random(seed)
    g = _random_join_graph(rng)
    machine = rng.choice(["summit:2x1", "summit:1x2", "summit:1x3", "local:1x2"])
    if rng.random() < 0.4:
        g = data_parallel(g, 2)
    _, peak = time_optimal_peak(g, machine)
    for cap in (peak - 1, (peak * 4) // 5):
        model = CostModel(capped(machine, cap))
        best, _ = exhaustive_mapping(g, model, limit=300_000, memory=True)
        r = MachineMapper(model).optimize(g)
        assert r.feasible == math.isfinite(best)
        if r.feasible:
            assert r.cost == pytest.approx(best, rel=1e-12, abs=1e-15) and r.memory.max_bytes <= cap


def test_pinned_views_are_kept_by_the_memory_aware_mapping():
    from unity_pcg.machine import MachineView
    g = mlp(batch=8, h=4096, layers=4)
    fc = [n.id for n in g.nodes() if n.op == "Linear"]
    mm = MachineMapper(CostModel(capped("summit:1x4", 300 * 2**20)))
    r = mm.optimize(g, fixed={fc[0]: MachineView(3, ())})
    assert r.feasible and r.views[fc[0]] == MachineView(3, ()) and r.memory.max_bytes <= 300 * 2**20
    # two layers pinned to one device cannot fit: nothing does
    r = mm.optimize(g, fixed={fc[0]: MachineView(3, ()), fc[1]: MachineView(3, ())})
    assert not r.feasible and "no mapping of this graph fits" in r.reason and "device 3" in r.reason
