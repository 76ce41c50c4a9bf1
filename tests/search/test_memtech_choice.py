"""memtech's choice of what to recompute where memory binds (issue 19 item 2): only the regions it must, the
cheapest per byte saved, each full or selective -- the greedy choice (many regions) against exhaustive
enumeration of none / selective / full per region on a decoder small enough to enumerate."""
from __future__ import annotations

import dataclasses

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.plan import MemoryPlan
from unity_pcg.search import memtech
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer


def _setup():
    """A data-parallel 2-block decoder (attention and MLP regions of unequal cost per byte) on 4 H100s."""
    g = build_strategy(synthetic_transformer(2, batch=16, seq=256, hidden=256, heads=4), "dp", 4)
    m = parse_machine("h100:1x4")
    cm = CostModel(m, optimizer="adam", precision="bf16")
    r = MachineMapper(cm).optimize(g, techniques=False)
    t0 = memtech.Techniques(GraphCost(g, cm), r.views, r.cost)
    lo = t0.price(MemoryPlan(recompute=memtech.recompute_all(t0.regions, "full"))).max_bytes
    hi = t0.price(MemoryPlan()).max_bytes
    return g, m, r, t0, lo, hi


def _at(g, m, r, cap):
    mc = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(cap)))
    return memtech.Techniques(GraphCost(g, CostModel(mc, optimizer="adam", precision="bf16")), r.views, r.cost)


def test_greedy_recompute_is_near_the_exhaustive_optimum_across_capacities():
    """Between "nothing recomputed" and "every region full", the greedy choice fits wherever some assignment
    does and is within a few percent of the cheapest assignment (exhaustive, ZeRO-0): the last step of a fit
    may be a small region, not the best ratio's large one."""
    g, m, r, t0, lo, hi = _setup()
    assert 4 <= len(t0.regions) <= 6 and len({len(x) for x in t0.regions}) > 1
    ratios = []
    for k in range(1, 20):
        t = _at(g, m, r, lo + (hi - lo) * k // 20)
        gr = t.choose(zero=(0,), offload=(False,), exact_limit=0)
        ex = t.choose(zero=(0,), offload=(False,), exact_limit=len(t0.regions))
        if ex.feasible:
            assert gr.feasible, k
            assert gr.iteration_s >= ex.iteration_s * (1 - 1e-12)
            ratios.append(gr.iteration_s / ex.iteration_s)
    assert ratios
    assert max(ratios) < 1.05, ratios
    assert sum(ratios) / len(ratios) < 1.01, ratios


def test_greedy_recomputes_only_what_it_must():
    """Every region the greedy plan recomputes is needed: one mode less on any of them (full -> selective,
    selective -> none) no longer fits or is not faster; and fewer regions than all are recomputed."""
    g, m, r, t0, lo, hi = _setup()
    for k in (5, 11, 17):
        t = _at(g, m, r, lo + (hi - lo) * k // 20)
        p = t.choose(zero=(0,), offload=(False,), exact_limit=0)
        assert p.feasible and p.memory.recompute
        regs = list(p.memory.recompute)
        assert len(regs) < len(t0.regions) or any(x.mode == "selective" for x in regs)
        for j, x in enumerate(regs):
            lower = memtech.MODES[memtech.MODES.index(x.mode) - 1]
            trial = regs[:j] + ([dataclasses.replace(x, mode=lower)] if lower != "none" else []) + regs[j + 1:]
            q = t.price(MemoryPlan(0, False, tuple(trial)))
            assert not q.feasible or q.iteration_s >= p.iteration_s * (1 - 1e-12), (k, j, x.mode)
