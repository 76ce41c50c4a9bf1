"""The budget of `optimize` (issue 18 point 4): one table of named phases, deadlines the solvers check (no
SIGALRM: it works in any thread), and no call past 1.1 x the budget (plus a small constant).  The default
tests read a fake clock that advances on every reading, so where each phase stops does not depend on the
host's speed; the real-time check is marked slow."""
import math
import threading
import time

import pytest

from unity_pcg.search import budget as B
from unity_pcg.search.budget import Budget, Deadline, Expired, PHASES, check, within
from unity_pcg.search.optimize import optimize


class Tick:
    """A clock that advances ``dt`` seconds on every reading (and never otherwise)."""

    def __init__(self, dt: float = 1e-3):
        self.t, self.dt, self.reads = 0.0, dt, 0

    def __call__(self) -> float:
        self.t += self.dt
        self.reads += 1
        return self.t


def test_the_phase_table_sums_to_one_and_gives_each_phase_a_mark():
    assert math.isclose(sum(p.share for p in PHASES), 1.0)
    assert len({p.name for p in PHASES}) == len(PHASES)
    b = Budget(100.0, clock=lambda: 0.0)
    marks = [b.deadline(p.name).at for p in PHASES]
    assert marks == sorted(marks) and marks[-1] == pytest.approx(100.0)
    assert [round(b.marks[p.name], 4) for p in PHASES] == [0.35, 0.6, 0.68, 0.72, 0.97, 1.0]
    assert b.deadline().at == 100.0 and b.hard_end().at == pytest.approx(100.0 + max(5.0, B.GRACE_MIN_S))


def test_a_skipped_phase_gives_its_share_to_the_phase_its_row_names():
    b = Budget(100.0, clock=lambda: 0.0).skip("pipeline")
    assert [round(b.marks[p.name], 4) for p in PHASES] == [0.35, 0.6, 0.93, 0.97, 0.97, 1.0]
    assert b.shares["pipeline"] == 0.0 and b.deadline("final").at == pytest.approx(100.0)
    with pytest.raises(ValueError):
        b.skip("no such phase")
    with pytest.raises(ValueError):
        Budget(0)


def test_unused_time_flows_to_the_next_phase():
    """A phase ends at a fixed mark: one that starts early (the previous ended early) has more time."""
    clock = Tick(0.0)
    b = Budget(10.0, clock=clock)
    clock.t = 1.0                                       # the floors took 1 s of their 3.5
    assert b.left("layouts") == pytest.approx(5.0)
    clock.t = 7.0                                       # past the segments' mark (6.8 s)
    assert b.expired("segments") and not b.expired("pricing") and b.left() == pytest.approx(3.0)


def test_deadlines_nest_and_are_checked_per_thread():
    clock = Tick(0.0)
    outer, inner = Deadline(5.0, clock), Deadline(3.0, clock)
    with within(outer):
        with within(Deadline(9.0, clock)) as d:
            assert d is outer                           # the sooner wins
        with within(inner):
            clock.t = 4.0
            with pytest.raises(Expired):
                check()
        check()                                         # outer not passed yet
        seen = []
        th = threading.Thread(target=lambda: seen.append(B.current()))
        th.start()
        th.join()
        assert seen == [None]                           # another thread has no scope
    check()                                             # no scope: no limit


def test_the_mapping_dp_stops_at_the_deadline():
    """The DP checks the deadline of its caller's scope at every subproblem it solves, and its memo stays
    consistent: solved again without a deadline it gives the mapping an undisturbed solve gives."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.split import synthetic_transformer
    m = parse_machine("summit:2x6")
    g = build_strategy(synthetic_transformer(2, batch=12), "dp", 6)
    clock = Tick(1.0)
    mp = MachineMapper(CostModel(m, "adam"))
    with pytest.raises(Expired):
        with within(Deadline(20.0, clock)):
            mp.optimize(g)
    assert 20 <= clock.reads <= 22                      # stopped at the first check past the deadline
    cut = mp.optimize(g)
    fresh = MachineMapper(CostModel(m, "adam")).optimize(g)
    assert cut.cost == pytest.approx(fresh.cost, rel=1e-12)


def _chain(n=40, batch=96, base=512):
    from .test_optimize_floors import _chain as c
    return c(n, batch, base)


def _inputs():
    from unity_pcg.search.split import synthetic_transformer
    from .test_optimize import _tables_model, mlp
    return [("mlp", mlp(batch=48, h=256, layers=6), "summit:2x6"),
            ("chain", _chain(), "summit:4x6"),
            ("transformer", synthetic_transformer(2, batch=12), "summit:2x6"),
            ("tables", _tables_model(n=2, batch=384, rows=50_000, h=256, layers=2), "summit:1x4")]


#: the budgets (seconds on the fake clock) and the clock's step: each phase's solves are cut, so every
#: mechanism's deadline is exercised
FAKE_BUDGETS = (0.5, 1.0)
STEP = 2e-4
#: phases that stop at their own mark; the others may continue with work that is never cut before the
#: hard end (data parallelism by rules, the search's own result, the pipeline's rule sequence)
STRICT = ("floors", "layouts", "final")


@pytest.mark.parametrize("budget_s", FAKE_BUDGETS)
@pytest.mark.parametrize("pipeline", [False, True])
def test_every_phase_stops_at_its_deadline(budget_s, pipeline):
    """On a clock that advances on every reading, each strict phase ends by its mark (at once when it
    starts past it) and every phase by the hard end (a few readings later: the check that finds the deadline passed), and the call by
    1.1 x the budget; the plan is feasible and never slower than data parallelism."""
    for name, g, machine in _inputs():
        clock = Tick(STEP)
        bud = Budget(budget_s, clock=clock)
        r = optimize(g, machine, budget_s=bud, optimizer="adam", pipeline=pipeline)
        slack = 200 * STEP              # readings between the check that stops a phase and its record
        hard = bud.hard_end().at - bud.start
        tl = bud.timeline()
        assert "floors" in tl and "segments" in tl, (name, tl)
        for phase, rec in tl.items():
            assert rec["end"] <= hard + slack, (name, phase, rec)
            if phase in STRICT:         # by its mark; one that starts past it does nothing but check
                assert rec["end"] <= max(rec["deadline"], rec["start"]) + slack, (name, phase, rec)
        # (1.1 x the budget; a budget this small has the least grace, B.GRACE_FLOOR_S, past its end)
        assert bud.elapsed() <= max(1.1 * budget_s, hard) + slack, (name, bud.elapsed(), tl)
        assert r.stats["budget"]["phases"] == tl
        assert r.feasible and (r.dp is None or not r.dp.feasible or r.predicted_iteration_s <= r.dp.cost * (1 + 1e-9))


def test_optimize_runs_in_a_thread():
    """SIGALRM works in the main thread only; the deadlines work anywhere: a search in a worker thread is
    cut at its phases' deadlines (the fake clock) and returns a plan."""
    from .test_optimize import mlp
    out, err = [], []
    clock = Tick(STEP)
    bud = Budget(0.5, clock=clock)

    def work():
        try:
            out.append(optimize(_chain(), "summit:4x6", budget_s=bud, optimizer="adam"))
        except BaseException as e:              # noqa: BLE001 (reported below)
            err.append(e)
    th = threading.Thread(target=work)
    th.start()
    th.join(600)
    assert not th.is_alive() and not err, err
    r = out[0]
    assert r.feasible and r.predicted_iteration_s <= r.dp.cost * (1 + 1e-9)
    assert bud.elapsed() <= max(1.1 * 0.5, bud.hard_end().at - bud.start) + 200 * STEP
    # the deadlines did cut the work in the thread: the floors' solves at their mark, every segment's search
    assert bud.timeline()["floors"]["end"] == pytest.approx(bud.timeline()["floors"]["deadline"], abs=200 * STEP)
    # (or, the segments' seeds built past their mark reaching the stage search's least share, the phase cut)
    assert set(r.stats.get("stopped", ())) <= {"seconds"} and (r.stats.get("stopped") or r.stats.get("segments_cut"))
    # and with the real clock too
    real: list = []
    th = threading.Thread(target=lambda: real.append(optimize(mlp(batch=48, h=64, layers=4), "summit:1x2",
                                                              budget_s=5, pipeline=False)))
    th.start()
    th.join(600)
    assert real and real[0].feasible


@pytest.mark.slow
@pytest.mark.parametrize("budget_s", [3.0, 10.0])
def test_real_time_stays_within_the_budget(budget_s):
    """Wall-clock: the call returns within 1.1 x the budget plus a constant for process noise (and the
    grace of small budgets)."""
    for name, g, machine in _inputs():
        t = time.monotonic()
        r = optimize(g, machine, budget_s=budget_s, optimizer="adam")
        wall = time.monotonic() - t
        assert wall <= 1.1 * budget_s + B.GRACE_MIN_S + 1.0, (name, wall, r.stats.get("timeline_s"))
        assert r.feasible


def test_a_call_keeps_a_reserve_for_its_result():
    """optimize's budget (search.budget.for_call) ends its phases RESULT_RESERVE early and its hard end the
    grace after that, so what follows the search (the executor's checks, the plan file) fits in the budget;
    a plain Budget keeps no reserve."""
    from unity_pcg.search import budget as Bm
    t = [0.0]
    b = Bm.for_call(100.0, clock=lambda: t[0])
    last = PHASES[-1].name
    assert b.deadline(last).at == pytest.approx(100.0 * (1 - Bm.RESULT_RESERVE))
    assert b.deadline(None).at == b.deadline(last).at
    assert b.hard_end().at == pytest.approx(b.deadline(last).at + max(Bm.GRACE * 100.0, Bm.GRACE_MIN_S))
    assert b.hard_end().at <= 100.0 + 1e-9
    marks = [b.deadline(p.name).at for p in PHASES]
    assert marks == sorted(marks)
    plain = Bm.Budget(100.0, clock=lambda: t[0])
    assert plain.deadline(last).at == pytest.approx(100.0)
    with pytest.raises(ValueError):
        Bm.Budget(10.0, reserve=10.0)


def test_the_process_start_is_before_now():
    import time

    from unity_pcg.search.budget import process_start
    s = process_start()
    if s is None:
        pytest.skip("no /proc here")
    assert s <= time.monotonic() and time.monotonic() - s < 3600


def test_linear_work_runs_with_no_deadline_in_scope_and_restores_it():
    """Assembling a plan (linear work) runs past the hard end: inside ``linear()`` check() never raises,
    and the enclosing scope is back afterwards."""
    from unity_pcg.search.budget import linear
    passed = Deadline(-1.0, lambda: 0.0)
    with within(passed):
        with pytest.raises(Expired):
            check()
        with linear():
            check()                      # no deadline in scope
        with pytest.raises(Expired):
            check()
