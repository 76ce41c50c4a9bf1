"""The time budget of one ``optimize`` call: named phases, their deadlines, and the checks solvers make.

    b = Budget(60.0)                          # --budget 60, the clock starts now
    b.deadline("segments")                    # a Deadline: when the segment search must stop
    with within(b.deadline("pricing")):       # every solver below checks it at its loop heads
        mapper.optimize(g)                    # raises Expired once the deadline has passed

One table, :data:`PHASES`, gives every phase its share of the budget.  The phases run in that order and
each ends at a fixed mark, the start plus the budget times the shares up to and including it, so time a
phase leaves unused flows to the phases after it.  A phase that does not run (the pipeline phases when
pipeline is off) gives its share to the phase its row names.  Work a phase must finish (data parallelism
by rules, the search's own result) may run past its mark, but nothing runs past the hard end, the end
plus its :func:`grace` (:meth:`Budget.hard_end`), except linear
work: assembling the plan, a mapping without the DP (``Evaluator.cheap``).  One Budget serves one
``optimize`` call (its clock starts when it is made).  Nothing waits
for a signal: a solver checks the deadline it was given (or the one of the innermost :func:`within`
scope of its thread) at its loop heads, so a budget works in any thread.

Deadlines are read on the budget's clock (``time.monotonic`` unless one is injected: the tests give a
clock that advances on every reading, so which phase stops where does not depend on the host's speed).
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

INF = math.inf


@dataclass(frozen=True)
class Phase:
    name: str
    share: float            # of the budget
    does: str               # what runs in it
    spare_to: str | None = None     # where its share goes when it does not run (None: the next phase)


#: The phases of the joint search, in order, and their shares of ``--budget`` (they sum to 1).  A phase
#: ends at the start plus the budget times the shares up to it (the marks: 35%, 60%, 68%, 72%, 97%, 100%
#: with pipelines; 35%, 60%, 93%, 97%, 97%, 100% without).  The segments (data parallelism by rules, the
#: floor, and the search's own result) run before the pipeline stage search, so that on a loaded machine
#: the floor by rules and the search's own candidate exist; their work stops early enough to leave the
#: stage search PIPELINE_MIN_SHARE of the budget before the hard end (optimize._unity_candidates).
PHASES: tuple[Phase, ...] = (
    Phase("floors", 0.35, "import; data parallelism's mapping; the fixed strategies' floors: every floor's "
                          "plain point first, then the tuned grids (ZeRO-3 and Megatron-LM as tuned) sharing "
                          "the rest of the phase"),
    Phase("layouts", 0.25, "the tuned floors' grid walks go on where the floors phase cut them (FLOOR_RESUME_SHARE; FLOOR_RESUME_NOFIT_SHARE while nothing fits); gradient accumulation (one stage, M micro-batches, with the layouts and the memory "
                           "techniques) where the full batch does not fit; the ILP's layout of every logical "
                           "mesh (search/layouts.py), reached by rules where the rules reach it, and priced"),
    Phase("segments", 0.08, "the segments' seeds (data parallelism, their layouts reached by rules) and their "
                            "best-first search (the sequential strategy's two searches)"),
    Phase("pricing", 0.04, "the whole-graph pricing of the search's result"),
    Phase("pipeline", 0.25, "the 1F1B stage search (its rule sequence is built at the end, where it wins)",
          spare_to="segments"),
    Phase("final", 0.03, "floors whose solve was cut resume; the final mapping of the chosen plan; the "
                         "pipeline's rule sequence where it is chosen"),
)

#: the layouts phase's proposals (optimize._layout_candidates): a mesh starts within PROPOSALS_START_SHARE of
#: the time left to the phase's mark and its ILP may solve until PROPOSALS_SOLVE_SHARE of it (the rest prices the
#: proposals by the DP and reaches them by rules)
PROPOSALS_START_SHARE = 0.5
PROPOSALS_SOLVE_SHARE = 0.75
#: the share of the time left to the layouts phase's mark that gradient accumulation gets where nothing priced
#: fits at the full batch (it then runs before the proposals, which are at the full batch: unlikely to fit)
ACCUMULATION_EARLY_SHARE = 0.9
#: the share of the time left to the layouts phase's mark in which the tuned floors' grid walks that the floors
#: phase cut walk on, at the phase's start (optimize._resume_cut_grids)
FLOOR_RESUME_SHARE = 0.5
#: the same share while nothing priced so far fits (no floor, not data parallelism): a grid walk seeking a
#: feasible point first is then the likeliest source of a plan that runs
FLOOR_RESUME_NOFIT_SHARE = 0.8
#: past the end of the budget, the work that completes a plan may run this share of the budget more, at
#: least GRACE_MIN_S seconds but never more than GRACE_MAX of the budget (the hard end: with the result's
#: reserve after it, a call ends within 1.1 x its budget on a small budget too; a 5 s budget gets 0.3 s),
#: and at least GRACE_FLOOR_S (data parallelism by rules on a small model completes under a budget too small
#: to search, issue 7; below about 2.5 s a process's start-up alone is more than 10% of the budget)
GRACE = 0.05
GRACE_MIN_S = 2.0
GRACE_MAX = 0.06
GRACE_FLOOR_S = 0.25
#: the share of an ``optimize`` call's budget kept after the search for the result (the executor's checks of
#: the plan, loading it as ``run`` will, and writing it: linear in the plan's graph, but seconds on a large model
#: on a loaded host); with the grace and the process's start-up counted, a call ends within 1.1 x its budget
RESULT_RESERVE = 0.05
#: one limited DP solve of a candidate: this share of the budget, at least SOLVE_MIN_S seconds
SOLVE_SHARE = 1 / 30
SOLVE_MIN_S = 1.0
#: the search's own result is priced for at least min(RESULT_SHARE x budget, RESULT_MAX_S) seconds, even
#: when the search ran to the end of its phase (it is what the search found)
RESULT_SHARE = 0.03
RESULT_MAX_S = 3.0
#: a whole-graph solve of the pricing phase may use min(max(PRICING_SOLVE_S, PRICING_SOLVE_SHARE x budget), the
#: time to the phase's mark), and at least PRICING_MIN_SHARE of the budget (the wall at the mark still cuts it,
#: but for the search's own result)
PRICING_SOLVE_S = 10.0
PRICING_SOLVE_SHARE = 1 / 3
PRICING_MIN_SHARE = 0.10
#: the pipeline stage search gets this share of the time left to its phase's mark when it starts (it
#: finishes the number of micro-batches it is pricing, then stops) and is cut at the mark plus
#: PIPELINE_OVER of the budget (at least PIPELINE_MIN_SHARE of the budget: a phase that starts late)
PIPELINE_SEARCH_SHARE = 0.6
PIPELINE_MIN_SHARE = 0.05
PIPELINE_OVER = 0.03
#: a pipeline search with further stage layouts (``search_pipeline(layouts=...)``): their pass may use this share
#: of the time left to the hard deadline; the rest is kept for the exact prices
PIPELINE_LAYOUTS_SHARE = 0.6
#: Alpa's planner (``--strategy alpa``, search/alpa/inter.py) runs to the budget's end and its hard end; the
#: profiling of its stage costs at one micro-batch count stops at ALPA_PROFILE_SHARE of the time left when the
#: planner starts, and at ALPA_FIRST_PROFILE_SHARE of it while no plan that fits is known (the later counts'
#: whole-cluster stage, the plan that keeps the answer feasible without the anchor, then starts before the
#: deadline); the anchor (Alpa's stages data parallel, before the profiling) starts micro-batch counts within
#: ALPA_ANCHOR_SHARE of it
ALPA_PROFILE_SHARE = 0.85
ALPA_FIRST_PROFILE_SHARE = 0.5
ALPA_ANCHOR_SHARE = 0.3
#: the pipeline's rule sequence (pipeline.by_rules) gets the time to the end, at least this share (stages
#: data parallel inside, built by segments: the larger one); both bounded by the hard end
BY_RULES_MIN_SHARE = 0.03
BY_RULES_DP_MIN_SHARE = 0.10


class Expired(Exception):
    """A deadline passed: the solver that checked it stops (the caller keeps what it had)."""


@dataclass(frozen=True, order=True)
class Deadline:
    """An instant on ``clock`` (``time.monotonic`` by default) past which a solver stops."""
    at: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @staticmethod
    def never(clock: Callable[[], float] = time.monotonic) -> "Deadline":
        return Deadline(INF, clock)

    @staticmethod
    def after(seconds: float | None, clock: Callable[[], float] = time.monotonic) -> "Deadline":
        """``seconds`` from now (None: never)."""
        return Deadline(INF if seconds is None else clock() + seconds, clock)

    def left(self) -> float:
        return self.at - self.clock()

    def passed(self) -> bool:
        return self.clock() > self.at

    def check(self) -> None:
        """Raise :class:`Expired` once the deadline has passed."""
        if self.clock() > self.at:
            raise Expired()

    def sooner(self, other: "Deadline | None") -> "Deadline":
        return self if other is None or self.at <= other.at else other

    def plus(self, seconds: float) -> "Deadline":
        return Deadline(self.at + seconds, self.clock)


# --- the deadline of a thread's innermost scope (what the DP, the rules and the stage search check) ------

_local = threading.local()


def current() -> Deadline | None:
    """The innermost :func:`within` deadline of this thread (None: none)."""
    return getattr(_local, "deadline", None)


@contextmanager
def within(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run the block under ``deadline`` (and every enclosing one: the sooner wins); None: no new bound."""
    old = getattr(_local, "deadline", None)
    new = old if deadline is None else deadline.sooner(old)
    _local.deadline = new
    try:
        yield new
    finally:
        _local.deadline = old


@contextmanager
def linear() -> Iterator[None]:
    """Run the block with no deadline in scope: only for linear work that completes a plan (assembling the
    segments' choices into the whole graph), which the module allows past the hard end."""
    old = getattr(_local, "deadline", None)
    _local.deadline = None
    try:
        yield
    finally:
        _local.deadline = old


def scope_passed() -> bool:
    """Whether the deadline of this thread's innermost :func:`within` scope has passed (False without one)."""
    d = getattr(_local, "deadline", None)
    return d is not None and d.clock() > d.at


def check() -> None:
    """The check solvers make at their loop heads: raise :class:`Expired` when the deadline of this
    thread's innermost scope has passed (nothing without a scope)."""
    d = getattr(_local, "deadline", None)
    if d is not None and d.clock() > d.at:
        raise Expired()


def run_within(deadline: Deadline | None, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``deadline``; (value, True), or (None, False) when it expired."""
    try:
        with within(deadline):
            return fn(*args, **kwargs), True
    except Expired:
        return None, False


# --- the budget -----------------------------------------------------------------------------------------

def grace(seconds: float) -> float:
    """The time past the end of a budget of ``seconds`` in which the work that completes a plan may run:
    :data:`GRACE` of it, at least :data:`GRACE_MIN_S`, at most :data:`GRACE_MAX` of it but never less than
    :data:`GRACE_FLOOR_S`."""
    return min(max(GRACE * seconds, GRACE_MIN_S), max(GRACE_MAX * seconds, GRACE_FLOOR_S))


class Budget:
    """``seconds`` of wall time from now, split by :data:`PHASES` (those named in ``skip`` do not run:
    their share goes to their ``spare_to`` phase, else the next one).  Every phase has a deadline;
    :meth:`phase` records when each ran (:meth:`timeline`)."""

    def __init__(self, seconds: float, *, phases: tuple[Phase, ...] = PHASES, skip=(),
                 clock: Callable[[], float] | None = None, start: float | None = None, reserve: float = 0.0):
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"budget must be a positive number of seconds, got {seconds!r}")
        if not 0 <= reserve < seconds:
            raise ValueError(f"reserve must be in [0, {seconds}), got {reserve!r}")
        self.seconds = float(seconds)
        self.clock = clock or time.monotonic
        self.start = self.clock() if start is None else start
        #: the last ``reserve`` seconds are kept for what follows the search (the plan's executor check, its
        #: file): the phases span the rest, and the hard end is the end of that span plus the grace
        self.reserve = float(reserve)
        self.span = self.seconds - self.reserve
        self.end = self.start + self.span
        self.phases = tuple(phases)
        self.records: dict[str, dict] = {}
        self.skipped: frozenset = frozenset()
        self.skip(*skip)

    def skip(self, *names: str) -> "Budget":
        """Phases that will not run: their shares go to their ``spare_to`` phase (else the next one that
        runs, else the previous one).  Before any phase has started."""
        phases = self.phases
        known = [p.name for p in phases]
        unknown = set(names) - set(known)
        if unknown:
            raise ValueError(f"unknown phase(s) {sorted(unknown)}")
        self.skipped = self.skipped | frozenset(names)
        shares = {p.name: p.share for p in phases}
        for i, p in enumerate(phases):
            if p.name in self.skipped:
                to = p.spare_to if p.spare_to not in self.skipped else None
                to = to or next((q.name for q in phases[i + 1:] if q.name not in self.skipped), None)
                to = to or next((q.name for q in reversed(phases[:i]) if q.name not in self.skipped), None)
                if to is not None:
                    shares[to] += shares[p.name]
                shares[p.name] = 0.0
        total = sum(shares.values()) or 1.0
        self.marks: dict[str, float] = {}
        acc = 0.0
        for name in known:
            acc += shares[name] / total
            self.marks[name] = min(acc, 1.0) if name != known[-1] else 1.0
        self.shares = {n: shares[n] / total for n in known}
        return self

    @classmethod
    def of(cls, budget: "Budget | float", **kw) -> "Budget":
        return budget if isinstance(budget, Budget) else cls(budget, **kw)

    # --- reading ---
    def now(self) -> float:
        return self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def deadline(self, phase: str | None = None) -> Deadline:
        """The end of ``phase`` (None: the end of the budget)."""
        if phase is None:
            return Deadline(self.end, self.clock)
        if phase not in self.marks:
            raise KeyError(f"unknown phase {phase!r} (known: {', '.join(self.marks)})")
        return Deadline(self.start + self.span * self.marks[phase], self.clock)

    def hard_end(self) -> Deadline:
        """The end plus :func:`grace`: no solve, rule sequence or search runs past it."""
        return Deadline(self.end + grace(self.seconds), self.clock)

    def share(self, fraction: float) -> float:
        """``fraction`` of the budget, in seconds."""
        return self.seconds * fraction

    def left(self, phase: str | None = None) -> float:
        """Seconds to the end of ``phase`` (None: of the budget); negative once past."""
        return self.deadline(phase).left()

    def expired(self, phase: str | None = None) -> bool:
        return self.deadline(phase).passed()

    def solve_limit(self) -> float:
        """Seconds one limited DP solve of a candidate may take."""
        return max(SOLVE_MIN_S, self.seconds * SOLVE_SHARE)

    # --- recording ---
    @contextmanager
    def phase(self, name: str):
        """Record the start and end of phase ``name`` (on the budget's clock, seconds from the start)."""
        d = self.deadline(name)
        rec = self.records.setdefault(name, {"start": round(self.elapsed(), 3),
                                             "deadline": round(d.at - self.start, 3)})
        try:
            yield d
        finally:
            rec["end"] = round(self.elapsed(), 3)

    def timeline(self) -> dict:
        """{phase: {"start", "end", "deadline"}} of the phases that ran (seconds from the start)."""
        return {k: dict(v) for k, v in self.records.items()}

    def table(self) -> list[dict]:
        """The phases with their shares and marks (for reports)."""
        return [{"phase": n, "share": round(self.shares[n], 4), "ends_at": round(self.marks[n], 4),
                 "skipped": n in self.skipped} for n in self.marks]


def for_call(seconds: float, start: float | None = None, **kw) -> "Budget":
    """The budget of one ``optimize`` call: ``seconds`` from ``start`` (default now; the CLI gives its process's
    start, so the interpreter's start-up counts), :data:`RESULT_RESERVE` of it kept for the result."""
    return Budget(seconds, start=start, reserve=RESULT_RESERVE * seconds, **kw)


def process_start(clock: Callable[[], float] = time.monotonic) -> float | None:
    """When this process started, on ``clock`` (``time.monotonic``: Linux's boot-time clock less the process's
    age from /proc); None where that cannot be read."""
    import os
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")          # field 22: start time after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return clock() - age if 0 <= age < 3600 else None


__all__ = ["Budget", "for_call", "process_start", "Deadline", "Expired", "Phase", "PHASES", "GRACE", "grace", "within", "current", "check",
           "run_within"]
