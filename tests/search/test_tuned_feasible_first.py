"""The tuned grid seeks a feasible point first (DESIGN "Baselines": the walk), and the optimizer's fallback runs
no mapping of a strategy over the machine past the budget's hard end (DESIGN "optimize() policy" point 3).

Both on fake clocks: the grid's advances one unit per mapping solve, the budget's is set by the test."""
import dataclasses
import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.budget import Deadline
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import _Tuner, techniques, tune

from .test_tuned import _CountingMapper

needs_memtech = pytest.mark.skipif(not techniques().available, reason="search.memtech is not in this tree")


def _tight():
    """A decoder on 8 devices of 170 MiB: no pp = 1 point fits, and of the pipelines only tp4 pp2 does (the
    time-first order prices tp2 pp2, tp1 pp2, tp2 pp4, tp1 pp4 and tp1 pp8 before it: its bound is no lower).
    No host memory: optimizer offload, which would make pp = 1 points fit, is not offered."""
    g = synthetic_transformer(4, batch=32, seq=64, hidden=1024, heads=8)
    m = parse_machine("h100:2x4")
    return g, dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=170 * 2**20),
                                  host_memory_bytes=0)


def _time_first(self, live, est, order):
    """The walk's order before feasibility came first: by the bound alone, whether anything fits or not."""
    return min(live, key=lambda w: (est[id(w)], w["pp"], w["n"], order[id(w)])), ""


@needs_memtech
def test_a_cut_walk_finds_a_feasible_point_where_the_time_first_order_does_not(monkeypatch):
    """Cut after 10 solves, the feasible-first walk has priced a point that fits (the leanest walk first);
    the time-first order spends the same solves on points that do not fit.  Uncut, both return the same
    best point (only the order changed)."""
    g, m = _tight()
    cm = _CountingMapper(MachineMapper(CostModel(m, optimizer="adam")))
    r = tune(g, cm, "megatron", Deadline(10.0, cm.clock))
    assert r.stats.get("cut") and r.stats.get("feasible_first_steps", 0) >= 1
    assert r.feasible and math.isfinite(r.cost) and r.max_bytes <= m.device.usable_bytes
    full = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")

    monkeypatch.setattr(_Tuner, "_feasible_first", _time_first)
    cm = _CountingMapper(MachineMapper(CostModel(m, optimizer="adam")))
    old = tune(g, cm, "megatron", Deadline(10.0, cm.clock))
    assert old.stats.get("cut") and not old.feasible
    old_full = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    assert full.feasible and full.cost == pytest.approx(old_full.cost, rel=1e-9)
    assert r.cost >= full.cost * (1 - 1e-9)


@needs_memtech
def test_the_memory_estimate_orders_walks_by_what_they_hold():
    """Before a walk is priced, its estimate scales the priced layouts' (weights over tp x pp devices): a pair
    of more devices per copy is estimated leaner; once priced, the walk's own points decide."""
    g, m = _tight()
    t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron", None, techniques())
    t._start()
    by = {(w["tp"], w["pp"]): w for w in t.walks}
    live = [w for w in t.walks if not w["done"]]
    est = {id(w): t._memory_estimate(w) for w in live}
    assert all(v > 0 for v in est.values())
    if (4, 2) in by and (1, 2) in by and not by[(4, 2)]["done"] and not by[(1, 2)]["done"]:
        assert est[id(by[(4, 2)])] < est[id(by[(1, 2)])]
    w = min(live, key=lambda w: est[id(w)])
    t._step(w, t.plain)
    own = [p for p in t.points if p.layout.tp == w["tp"] and p.layout.pp == w["pp"] and p.max_bytes]
    if not w["done"] and own:
        lean = min(own, key=lambda p: p.max_bytes)
        nxt = w["ms"][w["i"]]
        assert t._memory_estimate(w) == pytest.approx(lean.split[0] + lean.split[1] * nxt / lean.config.micro_batch)


def test_the_fallback_past_the_hard_end_maps_no_strategy_over_the_machine(monkeypatch):
    """Nothing fits (a 1 kB device) and the search ran past the hard end: the fallback builds and maps no
    strategy over the machine (those not mapped before are skipped, recorded), only the imported graph on one
    device, without the DP; the floors mapped before the end are not mapped again."""
    from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec, Resource
    from unity_pcg.search import optimize as O
    from unity_pcg.search.budget import Budget
    from .graphs import mlp
    dev = DeviceSpec(100e12, 1e12, 1_000, {"default": 0.5}, 5e-6)
    links = {"group": LinkSpec(100e9, 2e-6), "node": LinkSpec(100e9, 2e-6), "network": LinkSpec(10e9, 5e-6)}
    m = MachineSpec("tiny-memory", 1, 4, 4, dev, links)
    g = mlp(batch=8, h=16, layers=3)
    now = [0.0]
    bud = Budget(10.0, clock=lambda: now[0])
    calls = []
    full, cheap = O.Evaluator.full, O.Evaluator.cheap

    def counting_full(self, pg, resource=None, deadline=None):
        calls.append(("full", now[0], resource))
        return full(self, pg, resource, deadline)

    def counting_cheap(self, pg, resource=None):
        calls.append(("cheap", now[0], resource))
        return cheap(self, pg, resource)

    def overran(run):                   # the search ran past the hard end, no floor built, nothing fits
        now[0] = bud.hard_end().at + 1.0

    monkeypatch.setattr(O.Evaluator, "full", counting_full)
    monkeypatch.setattr(O.Evaluator, "cheap", counting_cheap)
    monkeypatch.setattr(O, "_unity_candidates", overran)
    res = O.optimize(g, m, budget_s=bud, strategy="unity", pipeline=False)
    assert not res.feasible and res.stats["chosen"] == "imported graph (nothing fits)"
    late = [c for c in calls if c[1] > bud.hard_end().at]
    one = Resource(0, 1, 1)
    assert late and all(kind == "cheap" and r == one for kind, _, r in late)
    assert {"megatron", "zero3"} <= set(res.stats.get("fallback_skipped", []))


@needs_memtech
@pytest.mark.parametrize("mib", [200, 320])
def test_once_a_point_fits_the_walk_nearest_to_fitting_goes_first(monkeypatch, mib):
    """After the first point that fits, each step walks a pair predicted to fit, else the one predicted nearest
    to fitting (the estimate over the capacity), whatever the bounds say (on a large model the points predicted
    far over the memory are mapped for nothing); uncut, the walk ends on the same best point as every order."""
    g, m = _tight()
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=mib * 2**20))
    cap = m.device.usable_bytes
    picks = []
    step = _Tuner._step

    def recording(self, w, plain):
        if any(p.feasible for p in self.points) and w["n"] > 0:
            live = [x for x in self.walks if not x["done"]]
            ratio = {id(x): max(self._memory_estimate(x) / cap, 1.0) for x in live}
            picks.append((ratio[id(w)], min(ratio.values())))
        return step(self, w, plain)

    monkeypatch.setattr(_Tuner, "_step", recording)
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    assert picks and all(mine == pytest.approx(least) for mine, least in picks)
    monkeypatch.setattr(_Tuner, "_step", step)
    monkeypatch.setattr(_Tuner, "_feasible_first", _time_first)
    assert r.feasible and r.cost == pytest.approx(tune(g, MachineMapper(CostModel(m, optimizer="adam")),
                                                       "megatron").cost, rel=1e-9)
