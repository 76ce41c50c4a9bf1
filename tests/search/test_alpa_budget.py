"""Alpa's planner under a deadline (issue 18 point 4: never more than 10% past ``--budget``, with a plan).

On a fake clock that advances on every reading, the deadline is put inside each phase of the planner (the
data-parallel anchor, the ILP profiling, the stage DP, the pricing of the chosen stages): the planner returns a
plan that fits, and no intra-operator solve starts past the deadline.  No wall-clock asserts."""
import math

import pytest

from unity_pcg.search import stages as S
from unity_pcg.search.alpa import inter
from unity_pcg.search.alpa.inter import alpa_plan, mapping_standin
from unity_pcg.search.budget import Budget, Deadline
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper

from .test_budget import Tick
from .test_pipeline import _chain, machine

GiB = 2**30
#: fake seconds one intra-operator solve takes (the ILP is the slow part of the planner)
SOLVE_S = 0.05


def _setting():
    g = _chain(32, [256, 1024, 1024, 1024, 1024, 1024, 256])
    # the weights with their optimizer states do not fit one device: the plans need stages
    m = machine(2, 4, network_bw=5e9, memory=int(0.0625 * GiB))
    return g, m


class _Recorder:
    """The intra pass (the stand-in, as the ILP's interface) on a fake clock: each solve advances it by
    SOLVE_S; the clock when each started is recorded."""

    def __init__(self, clock, mapper):
        self.clock, self.inner, self.starts = clock, mapping_standin(mapper), []

    def __call__(self, g, m, mesh, **kw):
        self.starts.append(self.clock())
        self.clock.t += SOLVE_S
        kw.pop("deadline", None)            # a time.monotonic() value (the ILP's): not this fake clock's
        return self.inner(g, m, mesh, **kw)


def _plan(clock, deadline_at=None, hard_after=0.05, monkeypatch=None, marks=None):
    g, m = _setting()
    mapper = MachineMapper(CostModel(m, "adam"))
    rec = _Recorder(clock, mapper)
    if marks is not None:                       # the clock where each phase starts (one run, no deadline)
        real_dp, real_price, real_anchor = S.stage_dp, inter._price_plan, inter._anchor

        def dp(*a, **kw):               # (the anchor's own stage DP and pricing are its phase's)
            outer = "profile" in marks
            if outer:
                marks.setdefault("stage_dp", clock.t)
            out = real_dp(*a, **kw)
            if outer:
                marks.setdefault("stage_dp_end", clock.t)
            return out

        def price(*a, **kw):
            outer = "profile" in marks
            if outer:
                marks.setdefault("price", clock.t)
            out = real_price(*a, **kw)
            if outer:
                marks.setdefault("price_end", clock.t)
            return out

        def anchor(*a, **kw):
            marks.setdefault("anchor", clock.t)
            out = real_anchor(*a, **kw)
            marks.setdefault("profile", clock.t)
            return out
        monkeypatch.setattr(S, "stage_dp", dp)
        monkeypatch.setattr(inter, "_price_plan", price)
        monkeypatch.setattr(inter, "_anchor", anchor)
    dl = Deadline(deadline_at if deadline_at is not None else 1e9, clock)
    res = alpa_plan(g, m, layers=3, mapper=mapper, solve=rec, micro_batches=[1, 2, 4], deadline=dl,
                    hard=dl.plus(hard_after))
    if marks is not None:
        marks["end"] = clock.t
    return res, rec, dl


def test_the_plan_without_a_binding_deadline_fits(monkeypatch):
    marks: dict = {}
    res, rec, _ = _plan(Tick(1e-4), monkeypatch=monkeypatch, marks=marks)
    assert res.feasible and res.pipeline.pcg is not None
    assert res.stats["anchor"]["micro_batches"] is not None        # the data-parallel stages fit
    assert marks["anchor"] < marks["profile"] < marks["stage_dp"] < marks["price"]


@pytest.mark.parametrize("phase", ["anchor", "profile", "stage_dp", "price", "after"])
def test_a_deadline_in_each_phase_still_gives_a_plan_that_fits(phase, monkeypatch):
    marks: dict = {}
    with monkeypatch.context() as mp:
        free, _, _ = _plan(Tick(1e-4), monkeypatch=mp, marks=marks)
    ends = {"anchor": marks["profile"], "profile": marks["stage_dp"], "stage_dp": marks["stage_dp_end"],
            "price": marks["price_end"]}
    if phase == "after":
        at = 4 * marks["end"]               # its profiling shares end past the unbounded run's end
    else:
        at = (marks[phase] + ends[phase]) / 2            # the middle of the phase, on the unbounded run's clock
    res, rec, dl = _plan(Tick(1e-4), deadline_at=at)
    assert res.feasible and res.pipeline.pcg is not None, (phase, res.pipeline.reason)
    assert math.isfinite(res.cost)
    # no intra-operator solve (the slow ILP) starts past the deadline: past it only the stand-ins run
    assert all(t <= dl.at for t in rec.starts), (phase, [t for t in rec.starts if t > dl.at])
    # a deadline past everything the planner does changes nothing
    if phase == "after":
        assert res.cost == pytest.approx(free.cost, rel=1e-9), res.stats


def test_optimize_strategy_alpa_keeps_its_budget_on_a_fake_clock():
    """``optimize --strategy alpa`` gives the planner the budget's own deadlines (its clock): the call ends
    within 1.1 x the budget plus the grace, with a plan that fits."""
    from unity_pcg.search import budget as B
    from unity_pcg.search.optimize import optimize
    g, m = _setting()
    for seconds in (0.2, 1.0):
        clock = Tick(2e-4)
        bud = Budget(seconds, clock=clock)
        r = optimize(g, m, budget_s=bud, strategy="alpa", optimizer="adam")
        assert r.feasible, r.stats.get("chosen")
        assert bud.elapsed() <= 1.1 * seconds + B.GRACE_MIN_S, (seconds, bud.elapsed())
