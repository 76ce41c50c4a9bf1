"""Unity's micro-batching (search.tuned.accumulate) prices per-region recomputation -- memtech's choice of only
the regions that must go -- beside none / selective / full on every region, at each ZeRO stage that shards
the states: its plan is never slower than the best uniform-mode point it priced."""
from __future__ import annotations

import dataclasses
import math

from unity_pcg.machine import parse_machine
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import default_intra
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import PER_REGION, accumulate


def test_accumulation_prices_per_region_recompute_and_keeps_the_fastest():
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = parse_machine("h100:1x4")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(75 * 2**20)))
    r = accumulate(g, MachineMapper(CostModel(m, optimizer="adam")), [("data parallel", default_intra)])
    assert r.feasible and math.isfinite(r.cost)
    pts = [p for p in r.priced if p["cost"] is not None]
    per = [p for p in r.priced if p["config"]["recompute"] == PER_REGION]
    assert per and {p["config"]["zero"] for p in per} <= {1, 3}
    assert r.cost <= min(p["cost"] for p in pts) * (1 + 1e-12)
