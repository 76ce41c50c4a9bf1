"""The Megatron seed of the joint search (tensor parallelism across nodes on data parallelism inside
them, Alpa's CANDLE-Uno layout) and seeds priced before the neighbours of the best start
(benchmarks/unity_vs_alpa_diag.py)."""
from __future__ import annotations

from unity_pcg.pcg import PCG
from unity_pcg.search.substitution import (Candidate, RuleBook, best_first, data_parallel_steps, replay,
                                           tensor_parallel_steps)


def _chain(pairs: int = 2, batch: int = 8, h: int = 8) -> PCG:
    b = PCG.builder()
    t = (b.add_node("Input", {"name": "x", "shape": (batch, h), "dtype": "float32"}), 0)
    for i in range(2 * pairs):
        w = b.add_node("Weight", {"name": f"w{i}", "shape": (h, h), "dtype": "float32"})
        t = (b.add_node("Linear", {"activation": "none"}, [t, (w, 0)]), 0)
        t = (b.add_node("Relu", {}, [t]), 0)
    b.set_outputs([t])
    return b.finish()


def test_tensor_parallel_seed_splits_every_pair_once_fuses_and_replays():
    book = RuleBook(None, (2,))
    g = _chain()
    x, st = data_parallel_steps(g, 2, book)
    y, st2 = tensor_parallel_steps(x, 2, book)
    ops = [n.op for n in y.nodes()]
    lin = [n for n in y.nodes() if n.op == "Linear"]
    # 4 Linears, each weight split exactly 2 ways (column then row), never nested
    splits = sorted(max(d.degree for d in y.shape(tuple(n.inputs[1])).dims) for n in lin)
    assert splits == [2, 2, 2, 2]
    assert sum(1 for n in st2 if n.rule.startswith("megatron_mlp_column_")) == 2
    # the Reduce between the pairs is fused with the next pair's Replicate
    assert ops.count("AllReduce") >= 1
    z = replay(g, list(st) + list(st2), book)
    assert z.structural_hash() == y.structural_hash()


def test_tensor_parallel_seed_is_empty_without_a_template_match():
    book = RuleBook(None, (2,))
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (8, 8), "dtype": "float32"})
    r = b.add_node("Relu", {}, [(x, 0)])
    b.set_outputs([(r, 0)])
    g = b.finish()
    y, st = tensor_parallel_steps(g, 2, book)
    assert st == [] and y.structural_hash() == g.structural_hash()


def test_seeds_are_priced_before_the_neighbours_of_the_best_start():
    # the best start's neighbours have a smaller estimate than the seed; with lazy pricing ordered by
    # estimate alone they were priced first and, in a budget, the seed never was
    g = _chain(1)
    book = RuleBook(None, (2,))
    seed, _ = data_parallel_steps(g, 2, book)
    others = [data_parallel_steps(_chain(1, h=8 + 2 * i), 2, book)[0] for i in range(1, 6)]
    priced = []

    def evaluate(x):
        priced.append(x.structural_hash())
        return (0.5 if x.structural_hash() == seed.structural_hash() else 2.0), None

    def expand(c):
        for o in others:
            yield o, ()

    est = {seed.structural_hash(): 10.0}
    res = best_first([Candidate(1.0, g, ()), Candidate(None, seed, ())], expand, evaluate, alpha=1.05,
                     max_candidates=2, estimate=lambda x: est.get(x.structural_hash(), 0.0))
    assert priced[0] == seed.structural_hash()
    assert res.best.cost == 0.5


def _tables(n: int = 2, batch: int = 8, rows: int = 16, dim: int = 8) -> PCG:
    """n embedding bags (lookups pooled by ReduceSum) concatenated into a Linear."""
    b = PCG.builder()
    outs = []
    for i in range(n):
        ix = b.add_node("Input", {"name": f"i{i}", "shape": (batch, 3), "dtype": "int64"})
        t = b.add_node("Weight", {"name": f"t{i}", "shape": (rows, dim), "dtype": "float32"})
        e = b.add_node("Embedding", {}, [(ix, 0), (t, 0)])
        outs.append((b.add_node("ReduceSum", {"axes": (1,), "keepdims": False}, [(e, 0)]), 0))
    c = (b.add_node("Concat", {"axis": 1}, outs), 0) if n > 1 else outs[0]
    w = b.add_node("Weight", {"name": "w", "shape": (n * dim, 4), "dtype": "float32"})
    y = b.add_node("Linear", {"activation": "none"}, [c, (w, 0)])
    b.set_outputs([(y, 0)])
    return b.finish()


def test_tensor_parallel_seed_splits_embedding_tables_by_columns():
    """The Megatron seed applies the column-split embedding templates (megatron_embedding_column /
    _bag_column) too, once per table, and the result replays."""
    book = RuleBook(None, (2,))
    assert any(r.name.startswith(("megatron_embedding_column", "megatron_embedding_bag_column")) for r in book.rules)
    g = _tables(2)
    x, st = data_parallel_steps(g, 2, book)
    y, st2 = tensor_parallel_steps(x, 2, book)
    assert sum(1 for s in st2 if s.rule.startswith("megatron_embedding")) == 2
    for n in y.nodes():
        if n.op == "Embedding":
            assert [d.degree for d in y.shape(tuple(n.inputs[1])).dims] == [1, 2]   # columns, not nested
    z = replay(g, list(st) + list(st2), book)
    assert z.structural_hash() == y.structural_hash()
