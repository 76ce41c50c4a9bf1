"""ONNX import, issue 10 point 1: any node whose inputs are all constant is folded (numpy kernels where they
exist, ``onnx.reference`` for every other operator), Gathers from parameter tables stay Embeddings, huge folds
are refused with one line, and Dropout imports in every form.

Every folded value is compared with onnxruntime running the same graph."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.errors import ModelImportError, UnsupportedOperator
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import InvalidModel, load_onnx

ort = pytest.importorskip("onnxruntime")

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _c(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inits, outputs, opset=18, inputs=None):
    inputs = inputs if inputs is not None else [helper.make_tensor_value_info("x", F, [2, 3])]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, F, None) for o in outputs],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _ort(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _check_equal(m, feeds):
    g = load_onnx(m)
    g.check()
    ours = evaluate(g, feeds)
    ref = _ort(m, feeds)
    for a, b in zip(ours, ref):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-6, atol=1e-6)
    return g


X = np.arange(6, dtype=np.float32).reshape(2, 3) / 7


# one node per case, all inputs constant; the folded value feeds Add(x, Cast(value)) of shape [2, 3]:
# operators the numpy kernels do not know (onnx.reference folds them) and forms they refuse
CASES = {
    "GatherElements": (helper.make_node("GatherElements", ["d", "i"], ["v"], axis=1),
                       [_c("d", np.arange(6, dtype=np.int64).reshape(2, 3)), _c("i", np.array([[2, 0, 1], [1, 1, 0]]))]),
    # BERT's token_type_ids: a [1, max_pos] buffer, indices [1, seq] (onnx.reference's kernel fails on this)
    "GatherElements_bert_buffer": (helper.make_node("GatherElements", ["d", "i"], ["v"], axis=1),
                                   [_c("d", np.arange(6, dtype=np.int64).reshape(1, 6) * 3),
                                    _c("i", np.array([[4, 0, 5]]))]),
    "CumSum_exclusive_reverse": (helper.make_node("CumSum", ["d", "a"], ["v"], exclusive=1, reverse=1),
                                 [_c("d", np.arange(6, dtype=np.int64).reshape(2, 3)), _c("a", np.array(1))]),
    "OneHot": (helper.make_node("OneHot", ["i", "depth", "vals"], ["v"], axis=-1),
               [_c("i", np.array([0, 2])), _c("depth", np.array(3)), _c("vals", np.array([0, 5], dtype=np.int64))]),
    "EyeLike": (helper.make_node("EyeLike", ["d"], ["v"], k=1), [_c("d", np.zeros((2, 3), np.float32))]),
    "ScatterND": (helper.make_node("ScatterND", ["d", "i", "u"], ["v"]),
                  [_c("d", np.zeros((2, 3), np.float32)), _c("i", np.array([[1, 2], [0, 0]])),
                   _c("u", np.array([4.0, 9.0], np.float32))]),
    "ArgMax": (helper.make_node("ArgMax", ["d"], ["v"], axis=0, keepdims=1),
               [_c("d", np.array([[1, 5, 2], [3, 0, 7]], np.float32))]),
    "Einsum": (helper.make_node("Einsum", ["a", "b"], ["v"], equation="i,j->ij"),
               [_c("a", np.array([1.0, 2.0], np.float32)), _c("b", np.array([1.0, 0.5, 3.0], np.float32))]),
    "Softmax": (helper.make_node("Softmax", ["d"], ["v"], axis=-1), [_c("d", X.copy())]),
    "IsNaN_Not": (helper.make_node("IsInf", ["d"], ["v"]),
                  [_c("d", np.array([[np.inf, 0, 1], [2, -np.inf, 3]], np.float32))]),
    "Trilu_lower_k": (helper.make_node("Trilu", ["d", "k"], ["v"], upper=0),
                      [_c("d", np.ones((2, 3), np.float32)), _c("k", np.array(-1))]),
    "Range_then_Less": (helper.make_node("Less", ["a", "b"], ["v"]),
                        [_c("a", np.array([[0, 1, 2], [2, 1, 0]])), _c("b", np.array([1, 1, 1]))]),
    "Where": (helper.make_node("Where", ["c", "a", "b"], ["v"]),
              [_c("c", np.array([[True, False, True], [False, False, True]])), _c("a", np.float32(-3.0)),
               _c("b", np.ones((2, 3), np.float32))]),
    "Pad_reflect": (helper.make_node("Pad", ["d", "p"], ["v"], mode="reflect"),
                    [_c("d", np.array([[1, 2]], np.float32)), _c("p", np.array([0, 1, 0, 0]))]),
    "LeakyRelu": (helper.make_node("LeakyRelu", ["d"], ["v"], alpha=0.25), [_c("d", X - 0.5)]),
    # numpy kernels: GatherND (batch_dims 0; negative indices; a prefix of the data's dims), Cos, Sin
    "GatherND_prefix": (helper.make_node("GatherND", ["d", "i"], ["v"]),
                        [_c("d", np.arange(12, dtype=np.int64).reshape(4, 3)), _c("i", np.array([[1], [-1]]))]),
    "GatherND_full": (helper.make_node("GatherND", ["d", "i"], ["v"]),
                      [_c("d", np.arange(6, dtype=np.int64).reshape(2, 3)),
                       _c("i", np.array([[[1, 2], [0, -3], [-1, 1]], [[0, 0], [1, 0], [0, 1]]]))]),
    "GatherND_batch_dims": (helper.make_node("GatherND", ["d", "i"], ["v"], batch_dims=1),
                            [_c("d", np.arange(24, dtype=np.int64).reshape(2, 4, 3)), _c("i", np.array([[3], [0]]))]),
    "Cos": (helper.make_node("Cos", ["d"], ["v"]), [_c("d", X * 3)]),
    "Sin": (helper.make_node("Sin", ["d"], ["v"]), [_c("d", X * 3)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_constant_node_of_any_type_is_folded_and_matches_onnxruntime(case):
    node, inits = CASES[case]
    nodes = [node, helper.make_node("Cast", ["v"], ["vf"], to=F), helper.make_node("Add", ["x", "vf"], ["y"])]
    m = _model(nodes, inits, ["y"])
    g = _check_equal(m, {"x": X})
    ops = g.op_counts()
    assert set(ops) <= {"Input", "Weight", "Add"}, ops  # the whole constant chain became one Weight


def test_exporter_mask_arithmetic_chain_folds():
    """A causal/padding mask chain as exporters write it (Range, Unsqueeze, Less, Not, Where, Expand, Tile,
    ConstantOfShape, Equal) between constants: folded to one Weight, added to the scores."""
    nodes = [
        helper.make_node("Range", ["zero", "three", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax1"], ["rc"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["rr"]),
        helper.make_node("Less", ["rc", "rr"], ["upper"]),   # [3, 3] strictly upper
        helper.make_node("Not", ["upper"], ["keep"]),
        helper.make_node("ConstantOfShape", ["shp"], ["neg"], value=helper.make_tensor("v", F, [1], [-1e4])),
        helper.make_node("Where", ["keep", "zf", "neg"], ["m3"]),
        helper.make_node("Slice", ["m3", "s0", "s1", "ax0"], ["m23"]),
        helper.make_node("Tile", ["m23", "reps"], ["mt"]),
        helper.make_node("Equal", ["mt", "zf"], ["isz"]),
        helper.make_node("Cast", ["isz"], ["iszf"], to=F),
        helper.make_node("Expand", ["iszf", "eshape"], ["me"]),
        helper.make_node("Add", ["x", "me"], ["y"]),
    ]
    inits = [_c("zero", np.array(0)), _c("three", np.array(3)), _c("one", np.array(1)), _c("ax0", np.array([0])),
             _c("ax1", np.array([1])), _c("shp", np.array([3, 3])), _c("zf", np.float32(0)),
             _c("s0", np.array([1])), _c("s1", np.array([3])), _c("reps", np.array([1, 1])),
             _c("eshape", np.array([2, 3]))]
    g = _check_equal(_model(nodes, inits, ["y"]), {"x": X})
    assert set(g.op_counts()) == {"Input", "Weight", "Add"}


def test_gather_from_parameter_table_stays_embedding():
    """Constant ids into a float initializer (BERT's position embedding): an Embedding, not a fold."""
    table = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Add", ["x", "e"], ["y"])]
    m = _model(nodes, [_c("table", table), _c("ids", np.array([[4, 1, 0], [2, 2, 3]]))], ["y"],
               inputs=[helper.make_tensor_value_info("x", F, [2, 3, 3])])
    g = load_onnx(m)
    assert g.op_counts()["Embedding"] == 1
    feeds = {"x": np.ones((2, 3, 3), np.float32)}
    np.testing.assert_allclose(evaluate(g, feeds)[0], _ort(m, feeds)[0], rtol=1e-6)


def test_huge_fold_is_refused_in_one_line():
    """A reference fold whose output shape inference knows to be beyond the limit: refused before evaluating."""
    nodes = [helper.make_node("Pad", ["d", "p"], ["v"]), helper.make_node("ReduceSum", ["v"], ["s"], keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"])]
    m = _model(nodes, [_c("d", np.ones((1, 1), np.float32)), _c("p", np.array([0, 0, 1 << 13, 1 << 13]))], ["y"])
    with pytest.raises(InvalidModel) as ei:
        load_onnx(m)
    msg = str(ei.value)
    assert "elements" in msg and "limit" in msg and "\n" not in msg


def test_random_operator_on_constants_is_not_folded():
    """A generator of a constant's shape stays a generator (the importer's RandomUniform), never a constant;
    a random operator without a PCG operator (Multinomial) on constants is refused."""
    nodes = [helper.make_node("RandomUniformLike", ["d"], ["v"]), helper.make_node("Add", ["x", "v"], ["y"])]
    g = load_onnx(_model(nodes, [_c("d", np.zeros((2, 3), np.float32))], ["y"]))
    assert [n.a["shape"] for n in g.nodes() if n.op == "RandomUniform"] == [(2, 3)]
    nodes = [helper.make_node("Multinomial", ["d"], ["v"], sample_size=3),
             helper.make_node("Cast", ["v"], ["vf"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "vf"], ["y"])]
    with pytest.raises(UnsupportedOperator, match="random"):
        load_onnx(_model(nodes, [_c("d", np.zeros((2, 3), np.float32))], ["y"]))


# --- Dropout in every form ----------------------------------------------------------------------------

def _dropout_model(opset, extra_inputs, inits, mask_used=False, **attrs):
    outs = ["d", "mask"]
    nodes = [helper.make_node("Dropout", ["x"] + extra_inputs, outs, **attrs),
             helper.make_node("Relu", ["d"], ["y"])]
    gouts = ["y"]
    if mask_used:
        nodes.append(helper.make_node("Cast", ["mask"], ["mf"], to=F))
        nodes.append(helper.make_node("Add", ["y", "mf"], ["y2"]))
        gouts = ["y2"]
    return _model(nodes, inits, gouts, opset=opset)


@pytest.mark.parametrize("form", ["opset10_attr", "opset13_ratio", "opset13_ratio_training_false",
                                  "opset13_ratio_training_true", "opset13_no_inputs", "opset13_training_only"])
def test_dropout_every_form_imports_as_dropout(form):
    if form == "opset10_attr":
        m, ratio = _dropout_model(10, [], [], ratio=0.3), 0.3
    elif form == "opset13_no_inputs":
        m, ratio = _dropout_model(13, [], []), 0.5
    elif form == "opset13_training_only":
        m, ratio = _dropout_model(13, ["", "t"], [_c("t", np.array(False))]), 0.5
    else:
        inits = [_c("r", np.float32(0.1))]
        extra = ["r"]
        if "training" in form:
            inits.append(_c("t", np.array(form.endswith("true"))))
            extra.append("t")
        m, ratio = _dropout_model(13, extra, inits), 0.1
    g = load_onnx(m)
    c = g.op_counts()
    assert c["Dropout"] == 1 and c["Relu"] == 1 and set(c) == {"Input", "Dropout", "Relu"}, c
    (d,) = [n for n in g.nodes() if n.op == "Dropout"]
    assert d.a["ratio"] == pytest.approx(ratio)
    if "true" not in form:  # inference-mode graph: equal to onnxruntime (our reference Dropout is the identity)
        np.testing.assert_allclose(evaluate(g, {"x": X - 0.3})[0], _ort(m, {"x": X - 0.3})[0], rtol=1e-6)


def test_dropout_mask_read_is_a_clear_error():
    m = _dropout_model(13, ["r"], [_c("r", np.float32(0.1))], mask_used=True)
    with pytest.raises(UnsupportedOperator) as ei:
        load_onnx(m)
    msg = str(ei.value)
    assert "mask" in msg and "'mask'" in msg and "\n" not in msg


def test_dropout_with_computed_training_mode_is_refused():
    m = _model([helper.make_node("Dropout", ["x", "r", "t"], ["y"])], [_c("r", np.float32(0.1))], ["y"],
               opset=13, inputs=[helper.make_tensor_value_info("x", F, [2, 3]),
                                 helper.make_tensor_value_info("t", B, [])])
    with pytest.raises(ModelImportError, match="training_mode"):
        load_onnx(m)


def test_a_mask_broadcast_from_small_constants_stays_lazy_and_is_known_uniform_along_its_batch():
    """An element-wise fold of small constants into a big one (a causal mask [B, 1, S, S] from [B, 1, S, 1] and
    [B, 1, 1, S], as transformers' exports build it) is not built whole by the import: it stays lazy with its
    operands as sources, :func:`uniform_along` answers from them (the same along B when they are), and its value,
    when read, is the eager fold's."""
    from types import SimpleNamespace

    from unity_pcg.onnx_import import consts
    from unity_pcg.onnx_import.consts import Const, uniform_along
    from unity_pcg.onnx_import.fold import fold_any
    B, S = 4, 512
    col = Const(np.broadcast_to(np.arange(S).reshape(1, 1, S, 1), (B, 1, S, 1)).copy())
    row = Const(np.broadcast_to(np.arange(S).reshape(1, 1, 1, S), (B, 1, 1, S)).copy())
    ctx = SimpleNamespace(op="LessOrEqual", what="node 'le'", n_outputs=1)
    out = fold_any(ctx, [row, col])[0]
    assert out.lazy and out.shape == (B, 1, S, S) and out.sources is not None
    calls = []
    part = out.part
    out.part = lambda a, i: calls.append((a, i)) or part(a, i)
    assert uniform_along(out, 0) and not calls            # from the operands, no slice built
    assert not uniform_along(out, 2) and calls            # not the same along the rows: compared slice by slice
    want = np.broadcast_to(np.arange(S)[None, :] <= np.arange(S)[:, None], (B, 1, S, S))
    np.testing.assert_array_equal(out.materialize(), want)
    varied = Const(np.arange(B * S).reshape(B, 1, S, 1))   # an operand that differs along B
    assert not uniform_along(fold_any(ctx, [row, varied])[0], 0)
    assert consts.SMALL < B * S * S
