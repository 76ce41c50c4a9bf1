"""The layout ILP inside micro-batching (gradient accumulation, pipeline stages): its objective weighs a
micro-batch's gradient sync and optimizer update at 1/M (they run once per iteration), and where the memory
techniques are priced it keeps no memory rows -- its layout is the fastest, and recomputation, ZeRO and the
micro-batch walk make it fit (DESIGN "optimize() policy")."""
import dataclasses
import math

import pytest

from unity_pcg.errors import UnityError
from unity_pcg.machine import parse_machine
from unity_pcg.search.alpa.intra import solve_intra
from unity_pcg.search.cost import CostModel
from unity_pcg.search.layouts import propose
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.optimize import optimize
from unity_pcg.search.pipeline import rebatch
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import _Tuner, accumulate, techniques

needs_memtech = pytest.mark.skipif(not techniques().available, reason="search.memtech is not in this tree")


def test_the_ilp_layout_of_a_micro_batch_is_the_fastest_over_the_iteration():
    """A wide decoder's micro-batch of 8 (of a batch of 64) on 8 devices: laid out for one micro-batch per
    iteration, and for eight; each layout is the faster at its own count, priced by the mapper as an
    iteration of M micro-batches (M x compute and transfers, one gradient sync and update)."""
    g = synthetic_transformer(2, batch=64, seq=128, hidden=2048, heads=8)
    m = parse_machine("h100:1x8")
    stage = rebatch(g, 64, 8)
    mp = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"), techniques=False)

    def iteration(pg, M):
        b = mp.optimize(pg).breakdown
        return M * (b.compute + b.comm) + b.sync + b.update

    lay = {M: solve_intra(stage, m, (1, 8), precision="bf16", price=False, memory_budget=math.inf,
                          micro_batches=M, idle=True).pcg for M in (1, 8)}
    assert iteration(lay[8], 8) < iteration(lay[1], 8) * (1 - 1e-3)
    assert iteration(lay[1], 1) < iteration(lay[8], 1) * (1 - 1e-3)


def _node(mib: float):
    m = parse_machine("h100:1x4")
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(mib * 2**20)))


def _ilp(m, budget):
    def hook(stage, resource):
        p = propose(stage, m, (1, 4), memory_budget=budget)
        if p.pcg is None:
            raise UnityError(p.status)
        return p.pcg
    return hook


@needs_memtech
def test_accumulation_with_the_ilp_without_memory_rows_fits_where_the_rows_find_no_layout():
    """75 MiB per device: no layout of the ILP's own memory model (no recomputation, no ZeRO) fits at any
    micro-batch; its fastest layout does, with the techniques; where both fit (120 MiB), no slower."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    for mib, rows_fit in ((75, False), (120, True)):
        m = _node(mib)
        mp = MachineMapper(CostModel(m, optimizer="adam"))
        rows = accumulate(g, mp, [("rows", _ilp(m, None))])
        free = accumulate(g, mp, [("fastest", _ilp(m, math.inf))])
        assert rows.feasible == rows_fit, rows.reason
        assert free.feasible and max(free.memory.values()) <= m.device.memory_bytes
        if rows_fit:
            assert free.cost <= rows.cost * (1 + 1e-9)
    # a caller that found data parallelism to fit at a micro-batch of 2 starts every walk there
    r = accumulate(g, mp, [("fastest", _ilp(m, math.inf))], fitted=2)
    assert r.priced and all(p["config"]["micro_batch"] <= 2 for p in r.priced)


@needs_memtech
def test_optimize_accumulates_on_ilp_layouts_priced_with_the_techniques():
    """The joint search's accumulation (data parallelism left to the tuned floors' grids) lays each
    micro-batch out by the ILP of every mesh without memory rows: at 75 MiB no mesh is refused by the ILP's own
    memory model (as before: "no parallel plan ... fits the memory budget"), each layout is priced with the
    techniques, and the plan returned is never slower than a floor."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    res = optimize(g, _node(75), budget_s=20)
    acc = res.stats["accumulation"]
    assert acc["points"] > 0 and "fits the memory budget" not in acc.get("reason", ""), acc
    assert res.feasible
    for name, c in res.stats["baselines_s"].items():
        if isinstance(c, float):
            assert res.predicted_iteration_s <= c * (1 + 1e-9), (name, c)


@needs_memtech
def test_accumulation_starts_where_data_parallelism_fits_without_recomputing():
    """The micro-batch every accumulation walk starts at (optimize passes it as ``fitted``): the largest at
    which the tuned grid found data parallelism to fit without recomputing -- not a larger one that fits only
    by recomputing, where a walk would start at its likely loser; by recomputing only where nothing else fit."""
    g = synthetic_transformer(4, batch=64, seq=128, hidden=512, heads=8)
    for mib in (250, 150):
        m = _node(mib)
        t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron", None, techniques())
        t.run()
        dp = [p.config for p in t.points if p.feasible and p.config.tp == 1 and p.config.pp == 1]
        plain = [c.micro_batch for c in dp if c.recompute == "none"]
        assert dp
        if mib == 250:      # recomputing fits a larger micro-batch than the plain point does
            assert plain and max(c.micro_batch for c in dp) > max(plain)
            assert t.data_parallel_fit() == max(plain)
        else:               # only recomputation fits
            assert not plain and t.data_parallel_fit() == max(c.micro_batch for c in dp)
