"""Layout -> rule sequence (search/realize.py), by outcome: the layouts reached, the replayed sequence, the price."""
from __future__ import annotations

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search import baselines
from unity_pcg.search.budget import Deadline
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.realize import NodeLayout, layout_of, realize
from unity_pcg.search.split import synthetic_chain, synthetic_transformer
from unity_pcg.search.substitution import RuleBook, data_parallel_steps, replay, trimmed

BOOK = RuleBook()


def _layouts(r, g):
    return {gid: NodeLayout.of(r.pcg, r.ids[gid]) for gid in r.ids}


def _check_replay(g, r):
    assert replay(g, r.steps, BOOK).structural_hash() == r.pcg.structural_hash()


def _price(machine, g):
    return MachineMapper(CostModel(parse_machine(machine))).optimize(g).cost


@pytest.mark.parametrize("make,d", [(lambda: synthetic_chain(6), 4), (lambda: synthetic_transformer(2), 4),
                                    (lambda: synthetic_transformer(1, batch=8), 8)])
def test_data_parallel_reached_and_equal_to_rules(make, d):
    g = make()
    target = baselines.data_parallel(g, d)
    r = realize(g, target, BOOK)
    assert r.complete, r.missing
    assert _layouts(r, g) == layout_of(target, g)
    _check_replay(g, r)
    # the same layouts as data parallelism by its fixed rule sequence (whose compute nodes pair by structure)
    ref, _ = data_parallel_steps(g, d, BOOK)
    assert _layouts(r, g) == layout_of(ref, g)
    assert _price("h100:1x8", trimmed(r.pcg)) <= _price("h100:1x8", target) * (1 + 1e-9)


def test_dict_target_and_untargeted_nodes_stay():
    g = synthetic_chain(4)
    t = layout_of(baselines.data_parallel(g, 2), g)
    first = min(t)
    r = realize(g, {first: t[first]}, BOOK)
    assert r.complete
    assert NodeLayout.of(r.pcg, r.ids[first]) == t[first]
    _check_replay(g, r)


def test_missing_names_the_nodes_no_rule_reaches():
    # Megatron on the synthetic Transformer: the baseline keeps the last LayerNorm's output (a graph output)
    # on copies, which no rule reaches, so the residual stream feeding it cannot run on copies either; exactly
    # the nodes left are named, and the tensor-parallel part (Linears, the heads' Reshape/Transpose, the
    # attention between them) is reached
    g = synthetic_transformer(1)
    target = baselines.megatron(g, 2)
    r = realize(g, target, BOOK)
    assert not r.complete
    names = {line.split(" ")[0] for line in r.missing}
    want = layout_of(target, g)
    left = {g.node(gid).label() for gid in want if NodeLayout.of(r.pcg, r.ids[gid]) != want[gid]}
    assert names == left
    assert any("graph output, on copies" in line for line in r.missing if line.startswith("LayerNorm"))
    _check_replay(g, r)
    split = {"Linear", "Reshape", "Transpose", "BatchMatMul", "Softmax"}
    assert all(NodeLayout.of(r.pcg, r.ids[gid]) == want[gid] for gid in want if g.node(gid).op in split)


def test_ilp_plan_on_a_2x2_mesh():
    from unity_pcg.search.alpa.intra import solve_intra
    g = synthetic_chain(6)
    plan = solve_intra(g, parse_machine("h100:1x4"), (2, 2), time_limit_s=20)
    r = realize(g, plan.pcg, BOOK)
    _check_replay(g, r)
    want = layout_of(plan.pcg, g)
    left = {g.node(gid).label() for gid in want if NodeLayout.of(r.pcg, r.ids[gid]) != want[gid]}
    assert left == {line.split(" ")[0] for line in r.missing}
    # complete: never slower than the ILP's plan; where the rules cannot reach it (the ILP's reduce-scatter
    # with copies over the other mesh axis), a plan all the same, within 5%
    slack = 1e-9 if r.complete else 0.05
    assert _price("h100:1x4", trimmed(r.pcg)) <= _price("h100:1x4", plan.pcg) * (1 + slack)


def test_deadline_returns_what_it_has():
    g = synthetic_transformer(2)
    r = realize(g, baselines.data_parallel(g, 4), BOOK, deadline=Deadline(-1.0))
    assert not r.complete and all("deadline" in line for line in r.missing)
    _check_replay(g, r)


# --- zoo models (exported with torch) ----------------------------------------------------------------------

_CACHE: dict = {}


def _zoo(name, tmp_path_factory, batch=8):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    if name not in _CACHE:
        p = tmp_path_factory.mktemp("zoo") / f"{name}.onnx"
        zoo.export(name, str(p), size="tiny")
        _CACHE[name] = load_onnx(str(p), batch=batch)
    return _CACHE[name]


@pytest.mark.parametrize("name", ["gpt_350m", "bert_large", "llama_1b"])
def test_zoo_data_parallel_complete(name, tmp_path_factory):
    g = _zoo(name, tmp_path_factory)
    target = baselines.data_parallel(g, 4)
    r = realize(g, target, BOOK)
    assert r.complete, r.missing[:3]
    _check_replay(g, r)
    assert _price("h100:1x4", trimmed(r.pcg)) <= _price("h100:1x4", target) * (1 + 1e-9)


def test_zoo_gpt_megatron_only_the_head_differs(tmp_path_factory):
    # Megatron-LM's layout (tp 2 in a node, dp 2 across): every node reached but the LM head, whose output
    # (a graph output) the baseline keeps on copies, which no rule can: it is laid out column-parallel
    g = _zoo("gpt_350m", tmp_path_factory)
    target = baselines.megatron(g, 4, devices_per_node=2)
    r = realize(g, target, BOOK)
    _check_replay(g, r)
    assert len(r.missing) == 1 and "graph output, on copies" in r.missing[0]
    assert _price("h100:2x2", trimmed(r.pcg)) <= _price("h100:2x2", target) * 1.02


# --- settle: never priced above the fallback --------------------------------------------------------------

def _pricer(machine):
    mapper = MachineMapper(CostModel(parse_machine(machine)))
    return lambda p: mapper.optimize(p).cost


def test_settle_never_slower_than_partial_or_fallback():
    # the rules miss the attention's Reshape/Transpose under Megatron: what settle returns is priced no
    # higher than the partial realization and than data parallelism by rules, and replays
    from unity_pcg.search.realize import settle
    g = synthetic_transformer(1)
    target = baselines.megatron(g, 2)
    price = _pricer("h100:1x2")
    r = settle(g, target, price, BOOK)
    assert not r.complete and r.missing
    partial = realize(g, target, BOOK)
    dp = realize(g, baselines.data_parallel(g, 2), BOOK)
    assert dp.complete
    assert r.price == pytest.approx(price(trimmed(r.pcg)))
    assert r.price <= price(trimmed(partial.pcg)) * (1 + 1e-9)
    assert r.price <= price(trimmed(dp.pcg)) * (1 + 1e-9)
    assert r.chosen == "target" or "fallback" in r.chosen
    _check_replay(g, r)


def test_settle_complete_is_the_target():
    from unity_pcg.search.realize import settle
    g = synthetic_chain(4)
    target = baselines.data_parallel(g, 2)
    r = settle(g, target, _pricer("h100:1x2"), BOOK, fallback=baselines.data_parallel(g, 1))
    assert r.complete and r.chosen == "target"
    assert _layouts(r, g) == layout_of(target, g)


def test_settle_takes_a_cheaper_fallback():
    # a price counting the compute nodes away from the fallback's layouts: where the target is not reached,
    # the fallback (price 0) is what settle returns, reached by rules
    from unity_pcg.search.realize import settle
    g = synthetic_transformer(1)
    fb = layout_of(baselines.data_parallel(g, 2), g)
    target = baselines.megatron(g, 2)

    def price(p):
        got = layout_of(p, g)
        return sum(1 for gid, t in fb.items() if got[gid] != t)
    r = settle(g, target, price, BOOK, fallback=fb)
    assert not r.complete and r.missing
    assert r.chosen == "fallback" and r.price == 0
    assert _layouts(r, g) == fb
    assert price(trimmed(realize(g, target, BOOK).pcg)) > 0
    _check_replay(g, r)


def test_fallback_regions_border_reshards_nothing_new():
    # a target with Megatron's layouts in the first layer and data parallelism in the second: the region
    # of a node missed in the first layer is (part of) the first layer; at every tensor between a node in
    # the region and one outside, the two layouts agree or the outside node's layouts are the same in both
    from unity_pcg.search.realize import fallback_regions
    g = synthetic_transformer(2)
    mg = layout_of(baselines.megatron(g, 2), g)
    fb = layout_of(baselines.data_parallel(g, 2), g)
    order = [n for n in g.topo_order() if n in mg]
    first = set(order[:len(order) // 2])
    t = {n: mg[n] if n in first else fb[n] for n in order}
    seed = [n for n in order if n in first and g.node(n).op == "Reshape"][:1]
    region = fallback_regions(g, t, fb, seed)
    assert set(seed) <= region <= first and len(region) > 5
    for v in t:
        for pos, r in enumerate(g.node(v).inputs):
            u = r[0]
            if u not in t or (u in region) == (v in region):
                continue
            outside = v if u in region else u
            assert t[v].inputs[pos] == fb[v].inputs[pos] or t[outside] == fb[outside]


def _book_with_templates():
    """The shipped rules and the tensor-parallel templates the cache does not ship yet."""
    from unity_pcg.substitutions.templates import tensor_parallel_rules
    have = set(BOOK.by_name)
    extra = [r for r in tensor_parallel_rules() if r.name not in have]
    return RuleBook(BOOK.rules + extra) if extra else BOOK


def test_zoo_llama_megatron_only_the_head_differs(tmp_path_factory):
    # grouped-query attention, rotary embeddings, RMSNorm, SwiGLU: with the single-operator tensor-parallel
    # rules every node takes Megatron-LM's layout but the LM head (a graph output the baseline keeps on copies)
    g = _zoo("llama_1b", tmp_path_factory)
    book = _book_with_templates()
    target = baselines.megatron(g, 4, devices_per_node=2)
    r = realize(g, target, book)
    assert replay(g, r.steps, book).structural_hash() == r.pcg.structural_hash()
    assert len(r.missing) == 1 and "graph output, on copies" in r.missing[0]
    assert _price("h100:2x2", trimmed(r.pcg)) <= _price("h100:2x2", target) * 1.02
