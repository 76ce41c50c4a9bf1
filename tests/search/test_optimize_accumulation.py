"""Micro-batching in the joint search and the tuned floors (DESIGN "optimize() policy"): where nothing fits
memory at the full batch, unity still returns a feasible plan -- gradient accumulation with the memory
techniques (search.tuned.accumulate) or a tuned baseline's -- never predicted slower than the tuned Megatron-LM
and ZeRO-3 floors it priced."""
import dataclasses
import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.optimize import optimize
from unity_pcg.search.pipeline import default_intra, micro_graph
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import accumulate, techniques, tune

needs_memtech = pytest.mark.skipif(not techniques().available, reason="search.memtech is not in this tree")


def _small(mib: float):
    """A 4-device H100 node with ``mib`` MiB per device: the decoder's data parallelism does not fit at the
    full batch (70-75 MiB), or only tensor parallelism with pipelining does (60 MiB)."""
    m = parse_machine("h100:1x4")
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(mib * 2**20)))


def _decoder():
    return synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)


@needs_memtech
def test_accumulation_fits_where_the_full_batch_does_not():
    g, m = _decoder(), _small(75)        # ZeRO-3's unit gradient, whole twice at its reduce-scatter, fits
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    assert not mp.optimize(build_strategy(g, "dp", 4)).feasible
    r = accumulate(g, mp, [("data parallel", default_intra)])
    assert r.feasible and math.isfinite(r.cost) and r.pipeline is not None
    M = r.config.micro_batches
    assert M > 1 and r.config.micro_batch * r.config.dp * M == 32
    assert r.pipeline.num_stages == 1 and r.pipeline.micro_batches == M
    micro_graph(g, M)                              # the one test of micro-batching accepts it
    assert max(r.memory.values()) <= m.device.memory_bytes


@needs_memtech
@pytest.mark.parametrize("mib", [70, 60])
def test_unity_is_feasible_and_never_slower_than_the_tuned_floors(mib):
    g, m = _decoder(), _small(mib)
    res = optimize(g, m, budget_s=20)             # the floors' grids finish well inside it on a loaded host
    assert res.feasible and math.isfinite(res.predicted_iteration_s)
    floors = res.stats["baselines_s"]
    priced = {k: v for k, v in floors.items() if isinstance(v, float)}
    assert "zero3" in floors and "megatron" in floors
    assert priced, floors
    for name, c in priced.items():
        assert res.predicted_iteration_s <= c * (1 + 1e-9), (name, c, res.stats["chosen"])
    if res.plan.pipeline is not None:              # accumulation or a pipelined floor: a valid field
        M = res.plan.pipeline["micro_batches"]
        assert 32 % M == 0 and res.plan.pipeline["stages"]


@pytest.mark.slow
@needs_memtech
def test_unity_at_least_the_standalone_tuned_baselines_with_time_to_finish():
    """With a budget the grids finish in, unity is at least as fast as ``--strategy megatron`` and ``zero3``."""
    g, m = _decoder(), _small(70)
    res = optimize(g, m, budget_s=60)
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    for name in ("megatron", "zero3"):
        t = tune(g, mp, name)
        if t.feasible:
            assert res.predicted_iteration_s <= t.cost * (1 + 1e-6), (name, t.config.label(), res.stats["chosen"])


def test_accumulation_without_memory_techniques_prices_micro_batching_alone():
    """optimize(memory_techniques=False) still searches gradient accumulation: each point is priced with no
    technique (it mapped the layouts and priced nothing before)."""
    from unity_pcg.search.tuned import _NoTechniques
    g, m = _decoder(), _small(330)
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    assert not mp.optimize(build_strategy(g, "dp", 4)).feasible
    r = accumulate(g, mp, [("data parallel", default_intra)], tech=_NoTechniques())
    assert r.feasible and math.isfinite(r.cost) and r.priced
    assert r.config.recompute == "none" and r.config.zero == 0 and r.config.micro_batches > 1
    assert all(p["config"]["recompute"] == "none" for p in r.priced)


def test_accumulation_leaves_its_data_parallel_walk_to_the_floor_grids_only_where_they_cover_it():
    """Megatron-LM's (tp 1, pp 1) walk is accumulation's data-parallel layout at ZeRO 0 / 1, ZeRO-3's walk the
    same at ZeRO 3: only where both walk (ZeRO-3 only where techniques are priced) does accumulation skip it."""
    from types import SimpleNamespace as NS
    from unity_pcg.search.optimize import _floor_grids_cover_data_parallel as covers

    def tuner(pairs, tech=True):
        return NS(walks=None if pairs is None else [{"tp": t, "pp": p} for t, p in pairs], tech=NS(available=tech))

    assert covers(NS(tuners={"megatron": tuner([(2, 1), (1, 1)]), "zero3": tuner([(1, 1)])}))
    assert not covers(NS(tuners={"megatron": tuner([(2, 1), (1, 1)])}))                  # no ZeRO-3 walk
    assert not covers(NS(tuners={"megatron": tuner([(1, 1)]), "zero3": tuner(None)}))   # ZeRO-3 not started
    assert not covers(NS(tuners={"megatron": tuner([(2, 1), (2, 2)]), "zero3": tuner([(1, 1)])}))
    assert not covers(NS(tuners={"megatron": tuner(None), "zero3": tuner([(1, 1)])}))   # not started
    assert not covers(NS(tuners={}))                                                     # Megatron does not apply
    assert covers(NS(tuners={"megatron": tuner([(1, 1)], tech=False)}))                  # no techniques: ZeRO 0 only


@needs_memtech
def test_a_rising_walk_starts_at_the_smallest_micro_batch_and_climbs():
    """A layout entry marked "rising" (the leaner layouts of the ILP's time / memory front, which pay where
    the weights fill the device) is walked from the most micro-batches to fewer, each size once, and ends
    at the same best point as the falling walk of the same layout here."""
    g, m = _decoder(), _small(75)
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    falling = accumulate(g, mp, [("data parallel", default_intra)])
    rising = accumulate(g, mp, [("data parallel", default_intra, "rising")])
    sizes = [p["config"]["micro_batch"] for p in rising.priced]
    firsts = list(dict.fromkeys(sizes))
    assert firsts[0] == 1 and firsts == sorted(firsts) and len(firsts) >= 2
    assert [p["config"]["micro_batch"] for p in falling.priced][0] > 1
    assert rising.feasible and rising.cost == pytest.approx(falling.cost, rel=1e-9)
