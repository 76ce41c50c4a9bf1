"""LiveGraph (substitutions/live.py): in-place application has try_apply's result, step by step."""
from __future__ import annotations

import random

import pytest

from unity_pcg.search import baselines
from unity_pcg.search.split import synthetic_chain, synthetic_transformer
from unity_pcg.search.substitution import RuleBook
from unity_pcg.substitutions import GraphIndex, iter_matches, try_apply
from unity_pcg.substitutions.live import LiveGraph

BOOK = RuleBook()


def _same(a, b):
    """Equal as graphs a caller can see: ids, nodes, shapes, outputs, consumer lists, topological order."""
    assert sorted(a.node_ids()) == sorted(b.node_ids())
    for nid in a.node_ids():
        assert a.node(nid) == b.node(nid)
        assert a.shapes(nid) == b.shapes(nid)
        assert a.input_shapes(nid) == b.input_shapes(nid)
        for k in range(len(a.shapes(nid))):
            assert a.consumers((nid, k)) == b.consumers((nid, k))
    assert a.outputs == b.outputs
    assert a.topo_order() == b.topo_order()
    assert a.structural_hash() == b.structural_hash()


def _walk(g, rules, steps, seed):
    """Random walk of rule applications, in place and by try_apply side by side; every match tried."""
    rng = random.Random(seed)
    live = LiveGraph(g)
    tried = applied = 0
    for _ in range(steps):
        ms = [m for r in rules for m in iter_matches(r, g, GraphIndex(g), 20, (2,))]
        if not ms:
            break
        rng.shuffle(ms)
        for m in ms[:12]:
            ref = try_apply(g, m)
            got = live.apply(m)
            tried += 1
            assert (got is None) == (ref is None), m.rule.name
            if ref is None:
                continue
            applied += 1
            assert got == sorted(set(ref.node_ids()) - set(g.node_ids()))
            _same(live, ref)
            if rng.random() < 0.3:           # undo, then apply again
                live.undo()
                _same(live, g)
                assert live.apply(m) == got
            g = ref
            break
    _same(live.freeze(), g)
    return tried, applied


@pytest.mark.parametrize("make,seed", [(lambda: synthetic_chain(5), 0), (lambda: synthetic_transformer(1), 1),
                                       (lambda: baselines.data_parallel(synthetic_transformer(1), 2), 2)])
def test_live_apply_equals_try_apply(make, seed):
    tried, applied = _walk(make(), BOOK.parallel, 25, seed)
    assert applied >= 10 and tried > applied         # both outcomes exercised


def test_live_apply_equals_try_apply_algebraic():
    tried, applied = _walk(synthetic_chain(5), BOOK.algebraic, 10, 3)
    assert applied >= 3


def test_live_apply_with_full_renumbering(monkeypatch):
    # where the topological numbering leaves no room the whole graph is sorted again: same results
    monkeypatch.setattr(LiveGraph, "MIN_GAP", 1e9)
    tried, applied = _walk(synthetic_transformer(1), BOOK.parallel, 15, 4)
    assert applied >= 10


def test_live_apply_refuses_a_cycle_as_try_apply_does():
    # a match (built by hand: matching never binds an input downstream of the match) whose rewrite would
    # read its own output: both refuse, and the live graph is unchanged
    from unity_pcg.substitutions import Match
    g = synthetic_chain(4)                       # Linear, Relu, Linear, Relu
    relus = [n for n in g.topo_order() if g.node(n).op == "Relu"]
    rule = BOOK.get("dp_Relu")
    m = Match(rule, (relus[0],), (("x", (relus[1], 0)),), (("k", 2),))
    assert try_apply(g, m) is None
    live = LiveGraph(g)
    assert live.apply(m) is None
    _same(live, g)
    ok = next(iter_matches(rule, g, GraphIndex(g), 1, (2,)))
    assert live.apply(ok) is not None
    _same(live, try_apply(g, ok))
