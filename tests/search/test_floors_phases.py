"""The floors and the pipeline under a short budget (issue 18 point 3): every floor's plain point is priced
before any tuned grid, a plain solve the deadline cut finishes from the mapper's memo, no grid starves the
pipeline stage search, and the nearest-holder index prices edges exactly as the pass over the holders did.
All on a clock that advances on every reading (no wall-clock asserts)."""
import math
import random
from types import SimpleNamespace

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search import budget as B
from unity_pcg.search import optimize as O
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.budget import Budget, Deadline
from unity_pcg.search.cost import GraphCost
from unity_pcg.search.optimize import Evaluator, optimize
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import _NoTechniques, floor, tune

from .test_budget import Tick


def _run(g, machine: str, clock):
    m = parse_machine(machine)
    ev = Evaluator(m, "adam", clock=clock, techniques=False)
    return SimpleNamespace(g=g, ev=ev, m=m, n_dev=m.num_devices)


def _plain_cost(g, machine: str) -> float:
    m = parse_machine(machine)
    pg = build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node)
    return Evaluator(m, "adam", techniques=False).full(pg).cost


def test_the_first_point_only_is_the_plain_baseline():
    """``grid=False`` prices the plain Megatron point and nothing else; the full grid holds it (never slower)."""
    g = synthetic_transformer(2, batch=16, seq=64, hidden=256, heads=8)
    m = parse_machine("summit:2x4")
    run = _run(g, "summit:2x4", None)
    first = tune(g, run.ev.mapper, "megatron", tech=_NoTechniques(), grid=False)
    assert first.stats["layout_points"] == 1 and first.feasible
    assert first.cost == pytest.approx(_plain_cost(g, "summit:2x4"), rel=1e-12)
    full = tune(g, run.ev.mapper, "megatron", tech=_NoTechniques())
    assert full.stats["layout_points"] > 1 and full.cost <= first.cost * (1 + 1e-12)
    assert m.num_devices == first.config.tp * first.config.dp


def test_a_plain_point_cut_by_a_tiny_deadline_is_still_priced_and_finishes_from_the_memo():
    """With a deadline that passes at once, the plain point is still priced (its mapping without the DP);
    the same floor asked again with time left (the grid pass, the final phase) finishes the cut solve from
    the mapper's memo and prices it exactly as a fresh solve does."""
    g = synthetic_transformer(2, batch=16, seq=64, hidden=256, heads=8)
    clock = Tick(1e-3)
    run = _run(g, "summit:2x4", clock)
    pg, c, note, r, pipe = floor(run, "megatron", Deadline(clock() + 2e-3, clock), grid=False)
    assert pg is not None and math.isfinite(c) and r is not None
    assert O._plain_cut(r)                                   # priced without the DP
    pg2, c2, _, r2, _ = floor(run, "megatron", Deadline.never(clock), grid=False, cheap=False)
    assert not O._plain_cut(r2)
    assert c2 == pytest.approx(_plain_cost(g, "summit:2x4"), rel=1e-12)
    assert c2 <= c * (1 + 1e-12)
    # a grid pass that is cut before its plain point is solved prices nothing (the caller keeps the first price)
    pg3, c3, note3, _, _ = floor(_run(g, "summit:2x4", clock), "megatron", Deadline(clock() + 2e-3, clock),
                                 cheap=False)
    assert pg3 is None and not math.isfinite(c3)


@pytest.mark.parametrize("budget_s", [0.3, 1.0])
def test_every_floor_is_priced_under_a_short_budget(budget_s):
    """On a fake clock, a short budget: Megatron's floor (whose tuned grid alone could take the whole floors
    phase) is priced, and the plan is never slower than it or data parallelism."""
    g = synthetic_transformer(2, batch=16, seq=64, hidden=256, heads=8)
    clock = Tick(2e-4)
    r = optimize(g, "summit:2x4", budget_s=Budget(budget_s, clock=clock), optimizer="adam",
                 memory_techniques=False, max_candidates=2)
    meg = r.stats["baselines_s"]["megatron"]
    assert isinstance(meg, float) and math.isfinite(meg)
    assert r.feasible and r.predicted_iteration_s <= meg * (1 + 1e-9)
    assert r.predicted_iteration_s <= r.dp.cost * (1 + 1e-9)
    tl = r.stats["budget"]["phases"]
    assert tl["floors"]["end"] <= tl["floors"]["deadline"] + 400 * 2e-4


def test_the_pipeline_search_is_not_starved_by_work_that_runs_late(monkeypatch):
    """The segments (data parallelism by rules, the search's result) run before the stage search: when their
    work runs late (as data parallelism by rules may on a loaded machine) it stops PIPELINE_MIN_SHARE of the
    budget before the hard end, so the pipeline is still searched with that share, and its plan competes."""
    from .test_pipeline import _chain
    g = _chain(64, [256, 256, 256, 256])
    clock = Tick(2e-4)
    bud = Budget(2.0, clock=clock)
    seen = {}

    def late_segments(run):
        seen["pipe_before_segments"] = run.pipe_searched
        # late: past the end of the segments' scope (PIPELINE_MIN_SHARE before the hard end)
        clock.t = max(clock.t, run.budget.hard_end().at - run.budget.share(B.PIPELINE_MIN_SHARE) + 1e-3)
        from unity_pcg.search.budget import check
        check()                                  # the segments' scope ended before: Expired
        return None
    monkeypatch.setattr(O, "_search_segments", late_segments)
    r = optimize(g, "summit:2x2", budget_s=bud, optimizer="adam", memory_techniques=False, max_candidates=1)
    assert seen["pipe_before_segments"] is False and r.stats.get("segments_cut")
    tl = r.stats["budget"]["phases"]
    assert tl["segments"]["end"] <= tl["pipeline"]["start"]
    # the stage search ran within its least share, before the hard end, was not cut, and found a plan
    assert tl["pipeline"]["end"] <= 2.0 + max(B.GRACE * 2.0, B.GRACE_MIN_S)
    assert not r.stats.get("pipeline_cut") and r.stats.get("pipeline_iteration_s") is not None
    assert r.feasible
    if r.plan.pipeline is not None:
        assert r.predicted_iteration_s == pytest.approx(r.stats["pipeline_iteration_s"], rel=1e-12)


def test_the_floor_by_rules_and_the_search_result_exist_when_the_stage_search_runs_late(monkeypatch):
    """The segments run before the stage search: when the stage search runs to the hard end (a loaded
    machine), data parallelism by rules (the floor) and the search's own result were already built and priced
    (before the reorder, a stage search that ran late left the segments cut at the hard end: a fallback),
    so the plan is not a fallback and the search's own best candidate is known (issue 18 point 2)."""
    g = synthetic_transformer(2, batch=16, seq=64, hidden=256, heads=8)
    clock = Tick(2e-4)
    seen = {}

    def late_pipeline(run, until=None):
        seen["floor_before_pipeline"] = any(c.mechanism == "data parallel by rules" for c in run.floor)
        clock.t = max(clock.t, run.budget.hard_end().at - 1e-3)      # everything after this is late
        run.pipe, run.pipe_searched = None, True
    monkeypatch.setattr(O, "_pipeline_search", late_pipeline)
    r = optimize(g, "summit:2x4", budget_s=Budget(2.0, clock=clock), optimizer="adam", memory_techniques=False,
                 max_candidates=2)
    assert seen["floor_before_pipeline"] is True
    assert "dp_by_rules" in r.stats and "search_result_s" in r.stats      # the pricing phase ran
    assert r.stats.get("best_own_s") is not None
    assert "fallback" not in r.stats["chosen"] and r.feasible


@pytest.mark.parametrize("machine", ["summit:4x6", "h100:16x8", "local:1x4"])
def test_the_nearest_holder_is_the_one_the_levels_order(machine):
    """The holder a device reads from: itself, else the nearest level (group, node, network), then the lowest
    device -- the index agrees with the pass over the holders on random sets."""
    m = parse_machine(machine)
    gc = GraphCost.__new__(GraphCost)
    gc.machine, gc._near_cache = m, {}
    rank = {"local": 0, "group": 1, "node": 2, "network": 3}
    rng = random.Random(0)
    n = m.num_devices
    for _ in range(200):
        hs = set(rng.sample(range(n), rng.randint(1, n)))
        for dev in rng.sample(range(n), min(n, 16)):
            assert gc._nearest(hs, dev) == min(hs, key=lambda h: (rank[m.level(h, dev)], h))


def test_the_segments_assembly_stops_at_the_hard_end(monkeypatch):
    """Assembling the segments' choices runs past the segments' scope but not past the budget's hard end (on a
    graph of thousands of operators its boundary cancellations take minutes): when the hard end passes during
    the cancellation rounds, the segments phase is cut and optimize still returns a feasible plan."""
    from unity_pcg.search import split as S
    g = synthetic_transformer(2, batch=16, seq=64, hidden=256, heads=8)
    clock = Tick(2e-4)
    rounds = {"n": 0}
    real = S.cancel_rounds

    def slow_rounds(*a, **kw):          # the hard end passes while the boundaries are cancelled
        rounds["n"] += 1
        clock.t = max(clock.t, budget.hard_end().at + 1.0)
        return real(*a, **kw)
    monkeypatch.setattr(S, "cancel_rounds", slow_rounds)
    budget = Budget(2.0, clock=clock)
    r = optimize(g, "summit:2x4", budget_s=budget, optimizer="adam", memory_techniques=False, max_candidates=2)
    assert rounds["n"] >= 1
    assert r.stats.get("segments_cut") is True
    assert r.feasible


@pytest.mark.parametrize("linear_s", [0.0, 1e9])
def test_nothing_fits_maps_no_strategy_nearer_the_hard_end_than_data_parallelism_took(monkeypatch, linear_s):
    """When nothing fits, the fallback builds and maps the fixed strategies not priced before with the DP, but
    not where the time to the hard end is shorter than data parallelism took to build and map (``linear_s``,
    measured in the floors phase): those are skipped and the imported graph is mapped without the DP."""
    from .graphs import mlp
    g = mlp(batch=8, h=100_000, layers=2)          # 40 GB of weights per layer: nothing fits a device
    m = parse_machine("summit:1x4")
    budget = Budget(60.0)
    ev = Evaluator(m, "adam", techniques=False)
    ev.hard = budget.hard_end()
    run = O._Run(g, m, "unity", budget, ev, alpha=1.05, pipeline=False, progress=None, max_candidates=2, k=10,
                 rules=None, optimizer="adam")
    O._price_data_parallel(run)
    assert run.dp_res is not None and not run.dp_res.feasible and run.linear_s > 0
    run.linear_s = linear_s
    solves = []
    real_full = Evaluator.full
    monkeypatch.setattr(Evaluator, "full", lambda self, *a, **kw: solves.append(a) or real_full(self, *a, **kw))
    chosen = O._fallback(run)
    assert chosen.mechanism == "imported graph (nothing fits)" and not chosen.mapping.feasible
    if linear_s:
        assert not solves and set(run.stats["fallback_skipped"]) >= {"megatron", "zero3"}
    else:
        assert solves and not run.stats.get("fallback_skipped")


@pytest.mark.parametrize("linear_s", [0.0, 1e9])
def test_nothing_fits_starts_no_whole_graph_step_with_less_time_than_data_parallelism_took(monkeypatch, linear_s):
    """While nothing fits, a step that builds and maps a whole graph (gradient accumulation, the tuned grids'
    resumed walks, the segments phase, whose only product with no time to search would be data parallelism by
    rules: not chosen when data parallelism does not fit) does not start where its deadline is nearer than the
    linear part of data parallelism's build and mapping (``linear_s``); with time for one, each runs."""
    from .graphs import mlp
    g = mlp(batch=8, h=100_000, layers=2)          # 40 GB of weights per layer: nothing fits a device
    real = O._price_data_parallel

    def priced(run):
        real(run)
        assert run.dp_res is not None and not run.dp_res.feasible and run.linear_s > 0
        run.linear_s = linear_s
    monkeypatch.setattr(O, "_price_data_parallel", priced)
    r = optimize(g, "summit:1x4", budget_s=30.0, pipeline=False, max_candidates=2)
    assert not r.feasible and r.stats["chosen"] == "imported graph (nothing fits)"
    acc = r.stats.get("accumulation") or {}
    if linear_s:
        assert r.stats["segments_skipped"] and "dp_by_rules" not in r.stats
        assert acc.get("none", "").startswith("too little time") and "floor_resumed" not in r.stats
    else:
        assert "segments_skipped" not in r.stats and r.stats["dp_by_rules"]["equal_to_baseline"]
        assert "seconds" in acc or "none" in acc and not acc["none"].startswith("too little time")


@pytest.mark.parametrize("model,h", [("mlp", 64), ("mlp", 100_000), ("diamond", 64), ("two_branches", 64)])
def test_the_imported_graph_on_one_device_maps_as_the_dp_would(model, h):
    """The fallback maps the imported graph on one device without the DP, and ``Evaluator.cost`` prices a graph on
    one device so (the sequential strategy's algebraic search): there every operator has one view, so the DP's
    mapping (and its memory techniques' choice) is that one, fitting or not."""
    from unity_pcg.machine import Resource

    from . import graphs
    g = getattr(graphs, model)(batch=8, h=h)
    ev = Evaluator(parse_machine("summit:1x4"), "adam")
    one = Resource(0, 1, 1)
    a, b = ev.full(g, one), ev.cheap(g, one)
    assert (a.views, a.feasible, a.memory) == (b.views, b.feasible, b.memory)
    assert a.cost == pytest.approx(b.cost, rel=1e-12) and a.feasible == (h < 1000)   # (sums in another order)
    c = Evaluator(parse_machine("summit:1x4"), "adam").cost(g, one)
    assert c == pytest.approx(a.cost, rel=1e-12) if a.feasible else c == math.inf


@pytest.mark.parametrize("share", [0.0, 0.6, math.inf])
def test_the_sequential_search_is_skipped_as_the_segments_are(monkeypatch, share):
    """The sequential strategy's searches (algebraic on one device, then parallel) run in the segments phase: with
    less time to its mark than two whole-graph passes (``linear_s`` each: its start priced on one device, data
    parallelism by rules built before its search gets any time) while data parallelism does not fit, they are
    skipped too (``share``: ``linear_s`` as a share of the time to the mark, once the floors are priced)."""
    from .graphs import mlp
    g = mlp(batch=8, h=100_000, layers=2)          # nothing fits a device
    real = O._price_data_parallel

    def priced(run):
        real(run)
        run.linear_s = share * run.budget.deadline("segments").left() if share else 0.0
    monkeypatch.setattr(O, "_price_data_parallel", priced)
    r = optimize(g, "summit:1x4", budget_s=30.0, strategy="sequential", max_candidates=2)
    assert not r.feasible and r.stats["chosen"] == "imported graph (nothing fits)"
    assert bool(r.stats.get("segments_skipped")) == bool(share) and ("algebraic" in r.stats) == (not share)


def test_the_fallback_keeps_the_last_resorts_mapping_before_the_hard_end(monkeypatch):
    """Nothing fits (the sequential strategy: no floor but dp mapped): the fallback builds and solves a fixed
    strategy not mapped before only where the hard end leaves its build and mapping (``linear_s``) and then the
    imported graph's mapping on one device, the last resort (another ``linear_s``); with less, it is skipped."""
    from .graphs import mlp
    g = mlp(batch=8, h=100_000, layers=2)          # nothing fits a device
    real = O._fallback
    seen = {}

    def fallback(run):
        left = run.budget.hard_end().left()
        run.linear_s = 0.6 * left               # one pass fits before the hard end, two do not
        seen["left"] = left
        return real(run)
    monkeypatch.setattr(O, "_fallback", fallback)
    r = optimize(g, "summit:1x4", budget_s=30.0, strategy="sequential", max_candidates=2, pipeline=False)
    assert seen and not r.feasible and r.stats["chosen"] == "imported graph (nothing fits)"
    assert "megatron" in r.stats.get("fallback_skipped", []), r.stats.get("fallback_skipped")


def test_the_stage_search_starts_at_the_micro_batches_of_the_fastest_micro_batched_plan():
    pipe = lambda m: SimpleNamespace(micro_batches=m)   # noqa: E731
    run = SimpleNamespace(others={"megatron": (None, 2.0, "", None), "zero3": (None, 1.5, "", None),
                                  "dp": (None, math.inf, "", None)},
                          floor_pipes={"megatron": pipe(128), "zero3": pipe(16), "dp": pipe(4)},
                          cands=[SimpleNamespace(cost=1.8, pipeline=pipe(64)), SimpleNamespace(cost=1.0, pipeline=None)])
    assert O._fast_micro_batches(run) == 16          # zero3's: the fastest plan that micro-batches
    run.others["zero3"] = (None, math.inf, "", None)
    assert O._fast_micro_batches(run) == 64          # the accumulation candidate's, faster than megatron's
    run.cands = []
    run.floor_pipes = {}
    assert O._fast_micro_batches(run) is None
