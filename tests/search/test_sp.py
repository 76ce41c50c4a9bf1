from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.sp import Leaf, Parallel, Series, decompose, tree_units
from unity_pcg.machine import parse_machine

from .graphs import diamond, mlp, n_shape, two_branches

MODEL = CostModel(parse_machine("local:1x2"))


def _dec(g):
    return decompose(g, GraphCost(g, MODEL).role)


def _names(g, dec, t):
    return [g.node(dec.main[u]).name for u in tree_units(t)]


def test_chain_is_one_series_in_order():
    g = mlp(layers=3)
    d = _dec(g)
    assert isinstance(d.tree, Series) and all(isinstance(c, Leaf) for c in d.tree.children)
    assert _names(g, d, d.tree) == ["fc0", "relu0", "fc1", "relu1", "fc2", "relu2"]
    assert d.is_sp


def test_diamond_has_a_parallel_split_between_bottlenecks():
    g = diamond()
    d = _dec(g)
    assert isinstance(d.tree, Series)
    par = [c for c in d.tree.children if isinstance(c, Parallel)]
    assert len(par) == 1
    assert sorted(_names(g, d, par[0])) == ["fc_a", "fc_b", "relu_a"]
    assert _names(g, d, d.tree)[-1] == "add"


def test_every_unit_appears_once_and_dependencies_respect_series_order():
    for g in (mlp(), diamond(), n_shape(), two_branches(), data_parallel(diamond(), 2), data_parallel(n_shape(), 2)):
        d = _dec(g)
        units = tree_units(d.tree)
        assert sorted(units) == list(range(len(d.units)))
        covered = sorted(n for u in d.units for n in u)
        gc = GraphCost(g, MODEL)
        assert covered == sorted(gc.nodes())
        _check_order(g, d, d.tree)


def _check_order(g, d, t):
    if isinstance(t, Series):
        seen = set()
        for c in t.children:
            here = {n for u in tree_units(c) for n in d.units[u]}
            for n in here:                         # nothing in an earlier child reads a later one
                for r in g.node(n).inputs:
                    assert r[0] not in set().union(*[{m for u in tree_units(c2) for m in d.units[u]}
                                                     for c2 in t.children[t.children.index(c) + 1:]] or [set()])
            seen |= here
            _check_order(g, d, c)
    elif isinstance(t, Parallel):
        a = {n for u in tree_units(t.left) for n in d.units[u]}
        b = {n for u in tree_units(t.right) for n in d.units[u]}
        for n in a:
            assert not any(r[0] in b for r in g.node(n).inputs)
        for n in b:
            assert not any(r[0] in a for r in g.node(n).inputs)
        _check_order(g, d, t.left)
        _check_order(g, d, t.right)


def test_placements_join_their_first_consumer():
    g = data_parallel(mlp(layers=2), 2)
    d = _dec(g)
    for u in d.units:
        ops = [g.node(n).op for n in u]
        if "Replicate" in ops:
            assert ops[-1] == "Linear"


def test_n_shape_is_not_sp_but_decomposes():
    g = n_shape()
    d = _dec(g)
    assert not d.is_sp
    assert sorted(tree_units(d.tree)) == list(range(len(d.units)))
