"""The Evaluator remembers prices by structural hash (blind to node ids); the mapping it keeps for a candidate
must name that candidate's nodes, never those of a structurally equal graph with other ids (issue 18: BERT-base
on h100:1x8 chose data parallelism by rules with the views of a layout realized by another rule order, and the
executor refused the plan: "view for node 586, which is not in the PCG")."""
from __future__ import annotations

from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search.optimize import Evaluator

from .graphs import mlp


def _renumbered(g: PCG, shift: int) -> PCG:
    j = g.to_json()
    for n in j["nodes"]:
        n["id"] += shift
        n["inputs"] = [[r[0] + shift, r[1]] for r in n["inputs"]]
    j["outputs"] = [[r[0] + shift, r[1]] for r in j["outputs"]]
    return PCG.from_json(j)


def test_kept_mapping_names_the_graphs_own_nodes():
    g = mlp(batch=8, h=16, layers=3)
    g2 = _renumbered(g, 100)
    assert g.structural_hash() == g2.structural_hash() and set(g.node_ids()).isdisjoint(g2.node_ids())
    ev = Evaluator(parse_machine("local:1x2"), "adam")
    c = ev.cost(g, keep=True)
    assert ev.cost(g2, keep=True) == c                  # the price is shared (memo by structure)
    r = ev.kept(g)
    assert r is not None and set(r.views) <= set(g.node_ids())
    r2 = ev.kept(g2)                                    # not g's mapping under g2's name
    assert r2 is None or set(r2.views) <= set(g2.node_ids())
    full = ev.full(g2)                                  # what the policy solves instead: g2's own nodes
    assert set(full.views) <= set(g2.node_ids()) and full.cost == c


def test_kept_mapping_of_the_cheap_mapping_is_guarded_too():
    g = mlp(batch=8, h=16, layers=2)
    g2 = _renumbered(g, 50)
    ev = Evaluator(parse_machine("local:1x2"), "adam")
    ev.cost_without_dp(g)
    assert ev.kept(g) is not None
    r2 = ev.kept(g2)
    assert r2 is None or set(r2.views) <= set(g2.node_ids())
