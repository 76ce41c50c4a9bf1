"""The Megatron-style templates on real exports (issue 7 points 1 and 8): ``megatron_attention_block`` (and its
BERT bias variant) splits the heads of an exported attention layer, ``megatron_embedding_bag_column`` /
``megatron_embedding_column`` split DLRM's tables by columns; the rewritten graphs evaluate piecewise equal to the
imported ones with the exported weights, and the sequences replay.  Sizes are small (Megatron by rules at paper
sizes is ``search.realize``, tests/search/test_rules_pipeline_megatron.py)."""
import numpy as np
import pytest

from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx
from unity_pcg.search.substitution import RuleBook, _apply_everywhere, data_parallel_steps, replay
from unity_pcg.substitutions import cache

torch = pytest.importorskip("torch")

QKVO = ("wq", "wk", "wv", "wo")


@pytest.fixture(scope="module")
def book():
    return RuleBook(cache.load(), (2, 4))


def _layer_onnx(tmp_path, hidden=32, heads=4, batch=2, seq=4):
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "search"))
    from test_paper_checks import Layer
    torch.manual_seed(0)
    p = tmp_path / "layer.onnx"
    torch.onnx.export(Layer(hidden, heads), (torch.zeros(batch, seq, hidden),), str(p), dynamo=False,
                      input_names=["x"])
    return str(p)


def _close(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-4, atol=1e-5)


def _weight_degrees(g, op_names=("Linear",)):
    """Weight name -> the degrees of the tensor its consumer reads (through the parallel operators)."""
    out = {}
    for n in g.nodes():
        if n.kind == "compute" and n.op in op_names:
            for r in n.inputs[1:2]:
                src = g.node(r[0])
                while src.kind == "parallel":
                    src = g.node(src.inputs[0][0])
                if src.op == "Weight":
                    out[src.a["name"]] = g.shape(r)
    return out


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_attention_block_splits_the_heads_of_an_exported_layer(tmp_path, book, dp, tp):
    path = _layer_onnx(tmp_path)
    g0 = load_onnx(path)
    g, steps = data_parallel_steps(g0, dp, book) if dp > 1 else (g0, [])
    steps = list(steps)
    g = _apply_everywhere(g, book.by_name["megatron_attention_block"], tp, steps, fresh=QKVO)
    assert [s.rule for s in steps].count("megatron_attention_block") == 1
    # Q/K/V split by columns, O by rows, tp ways; the attention's BatchMatMuls run on the heads split tp ways
    shapes = _weight_degrees(g)
    split = sorted(s.degrees for s in shapes.values() if max(s.degrees) > 1)
    assert split == sorted([(1, tp)] * 3 + [(tp, 1)])
    for n in g.nodes():
        if n.op == "BatchMatMul":
            assert g.shape(n.inputs[0]).degrees[-3] == tp
    x = np.random.default_rng(1).standard_normal((2, 4, 32)).astype(np.float32)
    _close(evaluate(g0, {"x": x}, "logical"), evaluate(g, {"x": x}, "pieces"))
    assert replay(load_onnx(path), steps, book).structural_hash() == g.structural_hash()


def test_attention_block_and_mlp_reach_the_figure10_layout(tmp_path, book):
    """Tensor degree 4 on one layer: every projection and both MLP matrices split, two Reduces."""
    path = _layer_onnx(tmp_path)
    g0 = load_onnx(path)
    steps: list = []
    g = _apply_everywhere(g0, book.by_name["megatron_attention_block"], 4, steps, fresh=QKVO)
    for r in book.rules:                # the MLP's column -> row templates on its unsplit weights
        if r.name.startswith("megatron_mlp_column_") and "~" not in r.name:
            g = _apply_everywhere(g, r, 4, steps, fresh=True)
    shapes = _weight_degrees(g)
    assert len(shapes) == 6 and all(max(s.degrees) == 4 and s.copy_degree == 1 for s in shapes.values()), shapes
    assert sum(1 for n in g.nodes() if n.op in ("Reduce", "AllReduce")) <= 4
    x = np.random.default_rng(2).standard_normal((2, 4, 32)).astype(np.float32)
    _close(evaluate(g0, {"x": x}, "logical"), evaluate(g, {"x": x}, "pieces"))


def test_bias_variants_split_an_exported_bert_layer(tmp_path, book):
    from unity_pcg import zoo
    p = tmp_path / "bert.onnx"
    zoo.export("bert_large", str(p), size="tiny")
    g0 = load_onnx(str(p))
    steps: list = []
    g = _apply_everywhere(g0, book.by_name["megatron_attention_block_bias"], 2, steps, fresh=True)
    g = _apply_everywhere(g, book.by_name["megatron_mlp_column_gelu_row_bias"], 2, steps, fresh=True)
    used = [s.rule for s in steps]
    layers = sum(1 for n in g0.nodes() if n.op == "Softmax")
    assert used.count("megatron_attention_block_bias") == layers and used.count("megatron_mlp_column_gelu_row_bias") == layers
    feeds = {}
    rng = np.random.default_rng(3)
    for n in g0.nodes():
        if n.op == "Input":
            feeds[n.a["name"]] = rng.integers(0, 2, size=n.a["shape"]).astype(np.int64)
    _close(evaluate(g0, feeds, "logical"), evaluate(g, feeds, "pieces"))
    assert replay(load_onnx(str(p)), steps, book).structural_hash() == g.structural_hash()


def test_embedding_columns_split_dlrm_tables(tmp_path, book):
    """DLRM (tiny): data parallel at 2, every table split 2 ways by columns with its bag sum, the rest data
    parallel at 2 on top (Alpa's layout for DLRM at 48 GPUs)."""
    from unity_pcg import zoo
    p = tmp_path / "dlrm.onnx"
    zoo.export("dlrm", str(p), size="tiny")
    g0 = load_onnx(str(p))
    g, steps = data_parallel_steps(g0, 2, book)
    steps = list(steps)
    for name in ("megatron_embedding_bag_column", "megatron_embedding_column"):
        g = _apply_everywhere(g, book.by_name[name], 2, steps, fresh=("t",))
    tables = sum(1 for n in g0.nodes() if n.op == "Embedding")
    assert [s.rule for s in steps].count("megatron_embedding_bag_column") == tables
    assert "megatron_embedding_column" not in [s.rule for s in steps]      # every table has a bag sum
    g, more = data_parallel_steps(g, 2, book, keep_whole=lambda gg, n: n.op in ("Embedding", "ReduceSum"))
    steps += more
    for n in g.nodes():
        if n.op == "Embedding":
            t = g.shape(n.inputs[1])
            assert t.degrees == (1, 2), t
    rng = np.random.default_rng(4)
    feeds = {}
    for n in g0.nodes():
        if n.op == "Input":
            s = n.a["shape"]
            feeds[n.a["name"]] = (rng.integers(0, 50, size=s).astype(np.int64) if n.a["dtype"].startswith("int")
                                  else rng.standard_normal(s).astype(np.float32))
    _close(evaluate(g0, feeds, "logical"), evaluate(g, feeds, "pieces"))
    assert replay(load_onnx(str(p)), steps, book).structural_hash() == g.structural_hash()
