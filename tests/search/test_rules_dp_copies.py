"""Data parallelism by proven rules where the hand-built baseline computes on copies or reads a bias (issue 7
point 1): BERT's position / token-type Embeddings over a constant [1, S] index have no batch dim to partition, so
data parallelism runs them on every device (``replicate_lift_Embedding``, proven from ``Embedding_replicate``);
a Conv2d with a bias input (DenseNet-121's 1x1 classifier) gets ``dp_Conv2d_bias``.  Both models reach exactly
the hand-built dp PCG by rules, and the sequence replays on a fresh copy to the same structural hash."""
import numpy as np
import pytest

from unity_pcg.pcg import PCG
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.substitution import (RuleBook, data_parallel_steps, dp_rule_missing, normalized_hash, replay,
                                           trimmed)
from unity_pcg.substitutions import cache

from .graphs import same_function


@pytest.fixture(scope="module")
def shipped():
    return cache.load()


@pytest.fixture(scope="module")
def book(shipped):
    return RuleBook(shipped, (2,))


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("bert") / "bert.onnx"
    zoo.export("bert_large", str(p), size="tiny")
    return str(p)


def conv_bias(batch=4, seed=0):
    """Conv2d 3x3 with bias -> Relu -> Conv2d 1x1 with bias (a classifier as DenseNet-121 ends)."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (8, 3, 3, 3), "b1": (8,), "w2": (5, 8, 1, 1), "b2": (5,)}
    w = {k: rng.standard_normal(s).astype("float32") for k, s in shapes.items()}
    b = PCG.builder(w)
    x = b.add("Input", {"name": "x", "shape": (batch, 3, 6, 6)})
    ws = {k: b.add("Weight", {"name": k, "shape": s}) for k, s in shapes.items()}
    y = b.add("Conv2d", {"padding": (1, 1, 1, 1)}, [x, ws["w1"], ws["b1"]], name="conv1")
    y = b.add("Relu", {}, [y], name="relu")
    y = b.add("Conv2d", {}, [y, ws["w2"], ws["b2"]], name="classifier")
    b.set_outputs([y])
    return b.finish()


def _whole(g):
    """Compute operators of ``g`` left in one piece."""
    return sorted(n.op for n in g.nodes() if n.kind == "compute" and all(s.piece_count == 1 for s in g.shapes(n.id)))


def test_new_rules_are_shipped_and_proven(shipped):
    by = shipped.by_name()
    for name, axiom in (("replicate_lift_Embedding", "Embedding_replicate"),
                        ("dp_Conv2d_bias", "Conv2d_bias_partition_sample")):
        r = by[name]
        proof = dict(r.proof)
        assert r.origin == "template" and proof.get("status") == "proven", name
        assert axiom in proof["axioms"], (name, proof["axioms"])
    assert not shipped.stale


def test_bert_position_embeddings_run_on_copies_by_rules(book, bert_path):
    from unity_pcg.onnx_import import load_onnx
    g = load_onnx(bert_path, load_weights=False)
    # the model this is about: Embeddings whose index is a constant of batch dim 1
    consts = [n for n in g.nodes() if n.op == "Embedding" and g.node(n.inputs[0][0]).op == "Weight"]
    assert len(consts) == 2 and all(g.shape(n.inputs[0]).sizes[0] == 1 for n in consts)
    pg, steps = data_parallel_steps(g, 2, book)
    used = [s.rule for s in steps]
    assert used.count("replicate_lift_Embedding") == 2
    t = trimmed(pg)
    assert _whole(t) == []                      # before: the two lookups stayed whole on one device
    assert normalized_hash(t) == normalized_hash(data_parallel(g, 2))
    fresh = load_onnx(bert_path, load_weights=False)
    assert replay(fresh, steps, book).structural_hash() == pg.structural_hash()
    # without the rule the lookups stay whole and the rules' dp is not the baseline (what the rule adds)
    less = RuleBook([r for r in book.rules if not r.name.startswith("replicate_lift_")], (2,))
    pg2, _ = data_parallel_steps(g, 2, less)
    assert _whole(trimmed(pg2)) == ["Embedding", "Embedding"]
    assert normalized_hash(trimmed(pg2)) != normalized_hash(data_parallel(g, 2))


def test_lift_leaves_operators_on_activations_alone(book):
    """Only operators over constants are computed on copies: an Embedding whose (activation) index cannot be
    partitioned (batch 1) stays whole, as the hand-built baseline gathers it."""
    b = PCG.builder()
    i = b.add("Input", {"name": "ids", "shape": (1, 4), "dtype": "int64"})
    x = b.add("Input", {"name": "x", "shape": (2, 4, 3)})
    t = b.add("Weight", {"name": "t", "shape": (10, 3)})
    e = b.add("Embedding", {}, [i, t], name="lookup")
    b.set_outputs([b.add("Add", {}, [x, e], name="add")])
    g = b.finish()
    pg, steps = data_parallel_steps(g, 2, book)
    assert "replicate_lift_Embedding" not in {s.rule for s in steps}
    assert "Embedding" in _whole(trimmed(pg))


def test_conv_with_bias_reaches_data_parallelism_by_rules(book):
    g = conv_bias()
    assert dp_rule_missing(g, book) == []
    pg, steps = data_parallel_steps(g, 2, book)
    assert [s.rule for s in steps].count("dp_Conv2d_bias") == 2
    t = trimmed(pg)
    assert _whole(t) == []
    assert normalized_hash(t) == normalized_hash(data_parallel(g, 2))
    assert replay(conv_bias(), steps, book).structural_hash() == pg.structural_hash()
    assert same_function(conv_bias(), t)


def test_optimize_returns_a_rule_plan_for_bert_and_conv_bias(book, bert_path):
    """The joint search's plan is reached by rules (before: the hand-built dp baseline with no rule sequence
    whenever nothing beat it) and replays on a fresh import to the plan's structural hash."""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.optimize import optimize
    for model, fresh in ((bert_path, lambda: load_onnx(bert_path, load_weights=False)), (conv_bias(), conv_bias)):
        res = optimize(model, "summit:1x2", budget_s=60, max_candidates=2, pipeline=False)
        assert res.feasible
        assert "baseline" not in str(res.stats.get("chosen", "")), res.stats.get("chosen")
        assert res.stats["dp_by_rules"]["equal_to_baseline"], res.stats["dp_by_rules"]
        assert res.plan.rules is not None and len(res.plan.rules) == len(res.steps)
        assert replay(fresh(), res.steps, book, trim_outputs=True).structural_hash() == res.plan.pcg.structural_hash()
