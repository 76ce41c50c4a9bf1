"""Layout proposals (search/layouts.py) and the joint search built on them, tested by outcome: the plan is
never slower than data parallelism nor than the ILP's best mesh, ``info.search.chosen`` names the mechanism,
and a plan reached by rules replays from the imported graph."""
from __future__ import annotations

import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.layouts import mesh_shapes, propose, proposals
from unity_pcg.search.optimize import Evaluator, optimize
from unity_pcg.search.substitution import RuleStep, replay

from .graphs import mlp
from .test_tp_seed import _chain

MECHANISMS = ("layout mesh ", "search", "data parallel by rules", "pipeline", "dp baseline", "megatron baseline",
              "expert baseline", "data parallel baseline")


@pytest.mark.parametrize("machine", ["summit:1x6", "summit:4x6", "h100:2x8", "local:1x4", "summit:1x1"])
def test_meshes_cover_the_machine_once_one_axis_first_then_node_split(machine):
    m = parse_machine(machine)
    got = mesh_shapes(m)
    n = m.num_devices
    assert all(a * b == n for a, b in got) and len(set(got)) == len(got)
    if n == 1:
        assert got == []
        return
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    assert len(got) == len(divisors) - 1                 # (1, N) and (N, 1) are one mesh
    assert got[0] == (1, n) and (n, 1) not in got        # the cheapest ILP first
    if m.nodes > 1:
        assert got[1] == (m.nodes, m.devices_per_node)


def test_a_mesh_starts_before_the_start_mark_and_solves_until_the_later_one(monkeypatch):
    """``proposals(deadline=start, run_until=end)``: no mesh starts past ``start``; one started solves under
    ``end`` (a large mesh's ILP begun late in the phase is not cut at the start mark)."""
    from unity_pcg.search import layouts
    from unity_pcg.search.budget import Deadline
    now = [0.0]
    start, end = Deadline(10.0, lambda: now[0]), Deadline(20.0, lambda: now[0])
    seen = []

    def fake(g, machine, mesh, *, deadline=None, **kw):
        seen.append((mesh, deadline))
        now[0] += 6.0                       # each solve takes 6 s of the fake clock
        return layouts.Proposal(tuple(mesh), None, status="fake")

    monkeypatch.setattr(layouts, "propose", fake)
    m = parse_machine("summit:2x6")
    list(proposals(None, m, deadline=start, run_until=end))
    assert [d for _, d in seen] == [end, end]          # started at 0 and 6; the third would start at 12
    assert [x for x, _ in seen] == mesh_shapes(m)[:2]
    seen.clear()
    now[0] = 0.0
    list(proposals(None, m, deadline=start))
    assert [d for _, d in seen] == [start, start]      # without run_until a solve is cut at the start mark


def test_a_proposal_is_a_plan_of_the_same_model_priced_on_its_views():
    g = _chain(pairs=2, batch=16, h=64)
    m = parse_machine("summit:1x4")
    ev = Evaluator(m, "adam")
    for p in proposals(g, m, mapper=ev.mapper):
        assert p.pcg is not None and p.status.startswith("optimal"), p.status
        assert sorted(n.op for n in p.pcg.nodes() if n.kind == "compute") == \
            sorted(n.op for n in g.nodes() if n.kind == "compute")
        assert math.isfinite(p.time_s) and p.mapping.feasible
        assert p.time_s == pytest.approx(ev.mapper.evaluate(p.pcg, p.views).cost)


def test_a_proposal_past_its_deadline_says_so():
    from unity_pcg.search.budget import Deadline
    g = _chain()
    m = parse_machine("summit:1x2")
    p = propose(g, m, (1, 2), deadline=Deadline(-1.0))
    assert p.pcg is None and "deadline" in p.status


def _best_mesh(g, machine: str, optimizer: str = "adam") -> float:
    m = parse_machine(machine)
    ev = Evaluator(m, optimizer)
    return min(p.time_s for p in proposals(g, m, optimizer=optimizer, mapper=ev.mapper))


@pytest.mark.parametrize("name,g,machine", [
    ("wide chain", _chain(pairs=2, batch=8, h=1024), "summit:1x4"),
    ("mlp", mlp(batch=48, h=256, layers=4), "summit:2x2"),
    ("narrow chain", _chain(pairs=3, batch=64, h=32), "summit:1x6"),
])
def test_unity_is_never_slower_than_dp_nor_the_best_mesh(name, g, machine):
    r = optimize(g, machine, budget_s=60, max_candidates=4, pipeline=False)
    assert r.feasible
    assert r.predicted_iteration_s <= r.dp.cost * (1 + 1e-9), name
    assert r.predicted_iteration_s <= _best_mesh(g, machine) * (1 + 1e-9), name
    chosen = r.stats["chosen"]
    assert chosen.startswith(MECHANISMS), chosen
    if chosen.startswith("layout mesh "):
        assert chosen.endswith("by rules") == (r.plan.rules is not None)
    # every mesh of the machine was proposed (small graphs: well within the budget)
    assert set(r.stats["layouts"]) == {f"{a}x{b}" for a, b in mesh_shapes(parse_machine(machine))}


def test_a_plan_reached_by_rules_replays():
    """Where the rules reach a layout, the plan records the sequence and it rebuilds the plan's PCG."""
    g = _chain(pairs=2, batch=8, h=1024)
    r = optimize(g, "summit:1x4", budget_s=60, max_candidates=4, pipeline=False)
    reached = [k for k, v in r.stats["layouts"].items() if v.get("by_rules")]
    assert reached, r.stats["layouts"]
    assert r.plan.rules is not None or "not by rules" in r.stats["chosen"] or " baseline" in r.stats["chosen"]
    if r.plan.rules is not None:
        steps = [RuleStep.from_json(s) for s in r.plan.rules]
        assert replay(g, steps, trim_outputs=True).structural_hash() == r.plan.pcg.structural_hash()


def test_idle_axes_only_add_choices():
    """With idle mesh axes the ILP's space is a superset of Alpa's: its optimum is never worse, and a layer
    too narrow for every device may run on a subset of them instead of on copies."""
    from unity_pcg.search.alpa.intra import solve_intra
    g = mlp(batch=12, h=512, layers=3)
    m = parse_machine("summit:2x6")
    for mesh in [(2, 6), (1, 12), (3, 4)]:
        alpa = solve_intra(g, m, mesh, price=False)
        ours = solve_intra(g, m, mesh, price=False, idle=True)
        assert ours.objective <= alpa.objective * (1 + 1e-6), mesh
