"""The planner's build-once memos and on-demand work give the reference's results exactly: layouts kept per
graph (``search.baselines.GraphMemo``: Megatron, data parallelism, rebatched graphs, stage sub-PCGs, the stage
hooks and stage prices), the Megatron rebuild's memoized weight targets, node copies by ``add_like``, the
mapping's subtree keys computed when the DP asks, and the boundary cancellations' disjoint rounds: the same
graphs, the same keys up to renaming, the same floats."""
from __future__ import annotations

import hashlib

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search import baselines, mapping, pipeline
from unity_pcg.search.baselines import GraphMemo, StrategyError, data_parallel, megatron
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import LOCAL_LIMIT, MachineMapper, _Ctx
from unity_pcg.search.sp import Leaf, Series, decompose
from unity_pcg.search.split import synthetic_chain, synthetic_transformer
from unity_pcg.search.tuned import tune


def _no_memos(monkeypatch):
    """Every memo of this change off: each layout, stage and price built afresh, weight targets derived anew."""
    monkeypatch.setattr(GraphMemo, "get", lambda self, g, key, build: build())

    class _Never(dict):
        def __setitem__(self, k, v):
            pass
    monkeypatch.setattr(baselines, "_TARGETS", _Never())


def _graph_facts(g: PCG) -> list:
    return sorted((n, g.node(n).op, g.node(n).attrs, g.node(n).inputs, g.node(n).name, g.shapes(n))
                  for n in g.node_ids())


def _tuned(g, m):
    mp = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"))
    r = tune(g, mp, "megatron")
    return [(p["config"], p["cost"], p["max_bytes"], p["reason"]) for p in r.priced], r.cost, r.config


@pytest.mark.parametrize("preset", ["h100:2x4", "h100:1x4"])
def test_tuned_grid_prices_equal_without_the_memos(monkeypatch, preset):
    """The Megatron grid (whole-graph and pipeline points, with and without sequence parallelism) prices
    every point to the same float with the memos cold, warm (a second grid: layouts, stages and prices
    are hits) and off."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=256, heads=8)
    m = parse_machine(preset)
    baselines.LAYOUT_MEMO.clear()
    pipeline.STAGE_MEMO.clear()
    cold = _tuned(g, m)
    hits = baselines.LAYOUT_MEMO.hits + pipeline.STAGE_MEMO.hits
    warm = _tuned(g, m)
    assert baselines.LAYOUT_MEMO.hits + pipeline.STAGE_MEMO.hits > hits      # the second grid reused them
    _no_memos(monkeypatch)
    off = _tuned(g, m)
    assert any(c["pp"] > 1 for c, *_ in off[0]) and any(c["sp"] for c, *_ in off[0])
    assert cold == warm == off


@pytest.mark.parametrize("sp", [False, True])
def test_memoized_layouts_equal_fresh_builds(monkeypatch, sp):
    g = synthetic_transformer(3, batch=16, seq=64, hidden=128, heads=4)
    baselines.LAYOUT_MEMO.clear()
    a = megatron(g, 8, devices_per_node=4, sequence_parallel=sp)
    assert megatron(g, 8, devices_per_node=4, sequence_parallel=sp) is a              # built once
    assert megatron(g, 8, devices_per_node=4, sequence_parallel=not sp) is not a      # sp is in the key
    d = data_parallel(g, 8)
    _no_memos(monkeypatch)
    assert _graph_facts(megatron(g, 8, devices_per_node=4, sequence_parallel=sp)) == _graph_facts(a)
    assert _graph_facts(data_parallel(g, 8)) == _graph_facts(d)
    assert a.meta == megatron(g, 8, devices_per_node=4, sequence_parallel=sp).meta


def test_a_refusal_is_raised_again_from_the_memo():
    g = synthetic_chain(6, batch=16)
    baselines.LAYOUT_MEMO.clear()
    msgs = []
    for _ in range(2):
        with pytest.raises(StrategyError) as e:
            megatron(g, 4)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "Transformers" in msgs[0]


def test_add_like_copies_as_add_node_does():
    g = megatron(synthetic_transformer(2, batch=8, seq=32, hidden=64, heads=4), 4, devices_per_node=4)
    a, b = PCG.builder(g.weights), PCG.builder(g.weights)
    for n in g.nodes():
        a.add_node(n.op, n.a, n.inputs, n.name, nid=n.id)
        b.add_like(n, n.inputs, nid=n.id, outputs=g.shapes(n.id) if n.id % 2 else None)
    a.set_outputs(g.outputs)
    b.set_outputs(g.outputs)
    assert _graph_facts(a.finish()) == _graph_facts(b.finish()) == _graph_facts(g)


# --- the mapping's keys on demand ---------------------------------------------------------------------------

def _subtrees(t):
    yield t
    if isinstance(t, Leaf):
        return
    for c in (t.children if isinstance(t, Series) else (t.left, t.right)):
        yield from _subtrees(c)


def _reference_key(ctx: _Ctx, t) -> str:
    """The local key as first written (eager, nested tree shape), for subtrees up to LOCAL_LIMIT."""
    g, gc = ctx.g, ctx.gc
    ns = set()
    for x in _subtrees(t):
        if isinstance(x, Leaf):
            ns |= set(ctx.dec.units[x.unit])
    rel = set(ns)
    for n in ns:
        rel |= {p for _, p in gc.priced_inputs(n)}
    order = sorted(rel)
    pos = {n: i for i, n in enumerate(order)}
    desc = tuple(((("own", gc.leaf_facts(n)), tuple((pos.get(r[0], -1), r[1]) for r in g.node(n).inputs),
                   tuple(pos[p] for _, p in gc.priced_inputs(n))) if n in ns else ("ext", gc.producer_facts(n)))
                 for n in order)

    def shape(x):
        if isinstance(x, Leaf):
            return tuple(pos[n] for n in ctx.dec.units[x.unit])
        if isinstance(x, Series):
            return ("S",) + tuple(shape(c) for c in x.children)
        return ("P", shape(x.left), shape(x.right))
    return hashlib.blake2b(repr((ctx._salt, desc, shape(t))).encode()).hexdigest()


def test_on_demand_keys_equal_the_eager_reference():
    """Every subtree's local key (forced), lower bound and series boundaries equal an eager recomputation;
    two subtrees share a local key iff they share the reference key (repeated blocks do)."""
    m = parse_machine("h100:1x4")
    cm = CostModel(m, optimizer="adam", precision="bf16")
    pg = megatron(synthetic_transformer(3, batch=16, seq=64, hidden=128, heads=4), 4, devices_per_node=4)
    gc = GraphCost(pg, cm)
    dec = decompose(pg, gc.role)
    ctx = _Ctx(pg, gc, dec, {})
    assert not ctx.lkey and not ctx.lb              # nothing keyed before the DP asks
    pairs = {}
    for t in _subtrees(dec.tree):
        lk = ctx.local_key(t)
        assert (lk is None) == (len(ctx.relevant[id(t)]) > LOCAL_LIMIT)
        if lk is not None:
            pairs.setdefault(lk, set()).add(_reference_key(ctx, t))
        assert ctx.lb[id(t)] == sum(gc.compute_time(n) for n in ctx.nodes[id(t)])
        if isinstance(t, Series):
            kids = t.children
            info = ctx.boundary[id(t)]
            for i, c in enumerate(kids):
                later = set().union(*(ctx.reads[n] for k in kids[i + 1:] for n in ctx.nodes[id(k)]))
                assert info[i][0] == sorted(n for n in ctx.nodes[id(c)] if n in later)
                done = set().union(*(ctx.nodes[id(k)] for k in kids[:i + 1]))
                assert info[i][1] == frozenset(n for n in done if n in later)
    assert all(len(v) == 1 for v in pairs.values())                     # same local key: same reference key
    refs = [next(iter(v)) for v in pairs.values()]
    assert len(refs) == len(set(refs))                                   # and the other way round
    assert len(pairs) < sum(1 for t in _subtrees(dec.tree) if ctx.local_key(t))   # repeated blocks share keys


def test_a_solve_keys_only_what_it_visits_and_prices_as_the_reference(monkeypatch):
    m = parse_machine("h100:1x4")
    pg = megatron(synthetic_transformer(6, batch=16, seq=64, hidden=128, heads=4), 4, devices_per_node=4)
    seen = []
    real = _Ctx.local_key

    def spy(self, t):
        seen.append(id(t))
        return real(self, t)
    monkeypatch.setattr(_Ctx, "local_key", spy)
    r = MachineMapper(CostModel(m, optimizer="adam", precision="bf16")).optimize(pg, techniques=False)
    dec = decompose(pg, GraphCost(pg, CostModel(m, optimizer="adam", precision="bf16")).role)
    assert len(set(seen)) < sum(1 for _ in _subtrees(dec.tree))        # blocks inside hits are never keyed
    monkeypatch.setattr(mapping, "LOCAL_KEYS", False)
    ref = MachineMapper(CostModel(m, optimizer="adam", precision="bf16")).optimize(pg, techniques=False)
    assert r.cost == ref.cost and r.views == ref.views


# --- the boundary cancellations -----------------------------------------------------------------------------

def test_cancel_rounds_equal_one_match_at_a_time():
    """``cancel_rounds`` (a match binding a node a chosen one binds or reads: not built; one replacement pass per
    round) against the reference: every match enumerated and checked, then applied one by one (``apply_match``)."""
    from unity_pcg.substitutions import iter_matches
    from unity_pcg.substitutions.apply import apply_match
    from unity_pcg.search.split import (SegmentChoice, assemble, blocking_pairs, boundary_keys,
                                        canonical_segments, cancel_rounds)
    from unity_pcg.search.substitution import CANCEL_RULES, RuleBook, RuleStep, _window_index, data_parallel_steps
    g = synthetic_transformer(4, batch=16, seq=64, hidden=128, heads=4)
    book = RuleBook(None, (2, 4))
    segs, _ = canonical_segments(g, 6, blocking_pairs(book))
    memo = {}
    for s in segs:
        if s.key not in memo:
            x, st = data_parallel_steps(s.canon, 4, book, final_cancel=False)
            memo[s.key] = SegmentChoice(0.0, 0.0, tuple(st), boundary_keys(s, x))
    # the stitched graph before its cancellations: assemble with the rounds cut to none
    import unity_pcg.search.split as split
    real = split.cancel_rounds
    got = {}

    def capture(gr, bk, window=None, max_rounds=64):
        got["g"], got["w"] = gr, set(window) if window is not None else None
        return real(gr, bk, window, max_rounds)
    split.cancel_rounds = capture
    try:
        out, steps = assemble(g, segs, [memo[s.key] for s in segs], book)
    finally:
        split.cancel_rounds = real
    ref, rsteps, window = got["g"], [], got["w"]
    rules = [book.by_name[n] for n in CANCEL_RULES if n in book.by_name]
    for _ in range(64):
        idx = _window_index(ref, window)
        chosen = []
        for r in rules:
            bound, read = set(), set()      # a match binds no node another binds or reads
            for mm in iter_matches(r, ref, idx, None, (2,)):
                ins = {x[0] for _, x in mm.inputs}
                if bound.isdisjoint(mm.nodes) and read.isdisjoint(mm.nodes) and bound.isdisjoint(ins):
                    chosen.append(mm)
                    bound |= set(mm.nodes)
                    read |= ins
            if chosen:
                break
        if not chosen:
            break
        before = set(ref.node_ids())
        for mm in chosen:
            ref = apply_match(ref, mm)
        if window is not None:
            window = window | (set(ref.node_ids()) - before)
        rsteps.extend(RuleStep.of(mm) for mm in chosen)
    assert len(rsteps) > 0
    n_before = len(steps) - len(rsteps)
    assert [s.to_json() for s in steps[n_before:]] == [s.to_json() for s in rsteps]
    assert _graph_facts(out) == _graph_facts(ref)
