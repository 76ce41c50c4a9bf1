"""The tuned grid prices a layout's per-region recomputation only where it can beat the best point that fits
(search.tuned._Tuner._recompute_bounded): recomputing only adds time, so the same layout recomputing nothing
bounds it.  The walk's best point is the same as with every per-region point priced."""
from __future__ import annotations

import dataclasses
import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import PER_REGION, _Tuner, accumulate, techniques
from unity_pcg.search.pipeline import default_intra

pytestmark = pytest.mark.skipif(not techniques().available, reason="search.memtech is not in this tree")


def _walk(mib: int, bounded: bool, monkeypatch):
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = parse_machine("h100:1x4")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(mib * 2**20)))
    if not bounded:
        monkeypatch.setattr(_Tuner, "_recompute_bounded", lambda self, out, z, off=False: False)
    t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron", None, techniques(), per_region=True)
    t.run()
    monkeypatch.undo()
    return t


@pytest.mark.parametrize("mib", [60, 75])
def test_bounded_per_region_points_keep_the_walks_best(mib, monkeypatch):
    full = _walk(mib, False, monkeypatch)
    cut = _walk(mib, True, monkeypatch)
    a, b = full.result(), cut.result()
    assert a.feasible and b.feasible
    assert math.isclose(a.cost, b.cost, rel_tol=1e-12), (a.config.label(), b.config.label())
    skipped = cut.stats.get("recompute_bounded", 0)
    n_full = sum(p["config"]["recompute"] == PER_REGION for p in full.priced)
    n_cut = sum(p["config"]["recompute"] == PER_REGION for p in cut.priced)
    assert n_cut <= n_full
    if skipped:
        assert n_cut < n_full
    # every per-region point left out could not have won: its layout's plain point is no faster than the best
    priced = {(p["config"]["tp"], p["config"]["pp"], p["config"]["micro_batch"], p["config"]["sp"], p["config"]["zero"])
              for p in cut.priced if p["config"]["recompute"] == PER_REGION}
    for p in full.priced:
        c = p["config"]
        key = (c["tp"], c["pp"], c["micro_batch"], c["sp"], c["zero"])
        if c["recompute"] == PER_REGION and key not in priced and p["cost"] is not None:
            assert p["cost"] >= b.cost * (1 - 1e-12)


def test_some_per_region_point_is_bounded_where_memory_binds(monkeypatch):
    cut = _walk(60, True, monkeypatch)
    assert cut.stats.get("recompute_bounded", 0) > 0, cut.stats


def test_accumulation_prices_no_recomputing_point_that_cannot_beat_the_callers_plan():
    """``accumulate(beat=)``: a point that recomputes is priced only where its layout, at its ZeRO stage without
    recomputing, is faster than the plan the caller has; the best below ``beat`` is the same."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = parse_machine("h100:1x4")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(75 * 2**20)))
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    full = accumulate(g, mp, [("data parallel", default_intra)])
    assert full.feasible
    plain = {(p["config"]["micro_batch"], p["config"]["zero"]): p for p in full.priced
             if p["config"]["recompute"] == "none"}
    for beat in (full.cost * 1.5, full.cost):
        cut = accumulate(g, mp, [("data parallel", default_intra)], beat=beat)
        if beat > full.cost:
            assert math.isclose(cut.cost, full.cost, rel_tol=1e-12)
        assert len(cut.priced) <= len(full.priced)
        for p in cut.priced:
            c = p["config"]
            if c["recompute"] != "none":     # priced: its plain point is faster than beat
                q = plain[(c["micro_batch"], c["zero"])]
                assert q["cost"] is None or q["cost"] < beat
    assert cut.stats.get("recompute_bounded", 0) > 0, cut.stats
