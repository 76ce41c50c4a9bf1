"""The joint search is never predicted slower than a fixed strategy it prices (dp, Megatron, expert), and
its budget is a wall (issue 7 points 5 and 10: Figure 14 had Unity below Megatron on BERT-Large)."""
import pytest

from unity_pcg.search.optimize import optimize
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.substitution import RuleStep, replay


def _check_replays(g, r):
    if r.plan.rules is not None and r.plan.pipeline is None:
        steps = [RuleStep.from_json(s) for s in r.plan.rules]
        assert replay(g, steps, trim_outputs=True).structural_hash() == r.plan.pcg.structural_hash()


def test_never_slower_than_megatron_where_the_rules_do_not_reach_it(monkeypatch):
    """One wide Transformer layer at a small batch on one 4-GPU node: Megatron (tensor parallelism inside
    the node) beats data parallelism by 27%, and the plans the rules reach within the search stay slower
    than it (0.00364 s against 0.00305 s when the search does not price the fixed strategies: Megatron
    runs the residual Adds and LayerNorms on its tensor-parallel copies with one AllReduce per group).
    The search returns a plan at least as fast as the plain Megatron baseline it prices as a floor
    (`--strategy megatron` is now Megatron-LM as its users tune it, search/tuned.py: tests/search/test_tuned.py)."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.optimize import Evaluator
    g = synthetic_transformer(1, batch=8, seq=128, hidden=1024, heads=16)
    m = parse_machine("summit:1x4")
    mg = Evaluator(m, "adam").full(build_strategy(g, "megatron", 4, devices_per_node=4)).cost
    dp = optimize(g, "summit:1x4", strategy="dp", optimizer="adam")
    assert mg < dp.predicted_iteration_s        # (by 27% before memory techniques; ZeRO makes dp cheaper)
    for pipeline in (False, True):
        r = optimize(g, "summit:1x4", budget_s=60, optimizer="adam", pipeline=pipeline, max_candidates=4)
        assert r.feasible and r.predicted_iteration_s <= mg * (1 + 1e-9)
        # the floor is Megatron-LM as tuned (search/tuned.py), whose grid holds the plain baseline
        assert r.stats["baselines_s"]["megatron"] <= mg * (1 + 1e-9)
        _check_replays(g, r)
        if r.stats["chosen"].startswith("megatron"):
            assert r.plan.rules is None


def _tables_model(n=4, batch=768, rows=200_000, dim=64, bag=20, h=512, layers=2):
    from .test_optimize import _tables_model as tm
    return tm(n=n, batch=batch, rows=rows, dim=dim, bag=bag, h=h, layers=layers)


@pytest.mark.parametrize("machine", ["summit:1x4"])
def test_never_slower_than_the_expert_strategy(machine):
    """A small DLRM-like model (a dense tower and embedding bags of large tables): the expert strategy
    (tables whole on disjoint devices, the rest data parallel) beats data parallelism; the search, with
    and without pipelines, is never predicted slower than it, and a plan with a rule sequence replays."""
    g = _tables_model()
    ex = optimize(g, machine, strategy="expert", optimizer="sgd")
    dp = optimize(g, machine, strategy="dp", optimizer="sgd")
    assert ex.predicted_iteration_s < dp.predicted_iteration_s
    for pipeline in (False, True):
        r = optimize(g, machine, budget_s=30, optimizer="sgd", pipeline=pipeline, max_candidates=4)
        assert r.feasible and r.predicted_iteration_s <= ex.predicted_iteration_s * (1 + 1e-9)
        _check_replays(g, r)


def _chain(n=40, batch=96, base=512):
    """Linear + Relu pairs of varying widths: every segment of the split search is distinct."""
    from unity_pcg.pcg import PCG
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, base)})
    h = base
    for i in range(n):
        h2 = base + 64 * ((i * 7) % 13)
        w = b.add("Weight", {"name": f"w{i}", "shape": (h, h2)})
        x = b.add("Relu", {}, [b.add("Linear", {}, [x, w])])
        h = h2
    b.set_outputs([x])
    return b.finish()


def test_the_budget_is_a_wall():
    """80 operators in 8 distinct segments on four 6-GPU nodes with a 3 s budget: the segments' seeds,
    the expert baseline and the whole-graph pricing used to run past the budget (4.6 s, 1.55x, on an
    idle host); now no time-limited DP solve runs past the substitution phase's wall (each is cut there
    and none starts after it), and nothing at all past the hard end (search.budget).  Read on a clock that
    advances on every reading (tests/search/test_budget.py; the wall-clock version is its slow test), so
    the bounds do not depend on the host's load.  With or without pipelines, still no slower than dp."""
    from unity_pcg.search.budget import Budget

    from .test_budget import STEP, Tick
    g = _chain()
    for pipeline in (False, True):
        bud = Budget(3.0, clock=Tick(STEP))
        r = optimize(g, "summit:4x6", budget_s=bud, optimizer="adam", pipeline=pipeline)
        w = r.stats["wall_s"]
        assert w["wall"] <= 3.0 * bud.marks["pricing"] + 1e-9 and w["last_walled_solve_end"] <= w["wall"] + 200 * STEP, w
        assert bud.elapsed() <= bud.hard_end().at - bud.start + 200 * STEP, (pipeline, r.stats.get("timeline_s"))
        assert r.feasible and r.predicted_iteration_s <= r.dp.cost * (1 + 1e-9)
        _check_replays(g, r)
