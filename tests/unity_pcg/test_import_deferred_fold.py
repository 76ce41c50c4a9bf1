"""ONNX import, issue 18 point 2: an all-constant subgraph whose result exceeds the fold guard (Llama's causal
mask [B, 1, S, S] built by comparisons of constant positions, 134 M elements at a global batch of 32) is
deferred: a lazy constant of the shape shape inference gives, computed only when its values are read.  Import
and planning never build it; evaluation does, and gets the values onnx.reference gets.  A fold that needs its
values during the import (a small result of the huge constant) is still refused in one line.

The guard is lowered in each test so that the graphs stay tiny."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import InvalidModel, load_onnx
from unity_pcg.onnx_import import consts as C
from unity_pcg.onnx_import import fold as Fo

F, I64 = TensorProto.FLOAT, TensorProto.INT64
BATCH, SEQ, LIMIT = 2, 4, 16      # the mask [2, 1, 4, 4] has 32 elements, twice the lowered guard


@pytest.fixture
def low_guard(monkeypatch):
    """The fold guard lowered to LIMIT elements; counts the deferred folds' evaluations (unbounded folds)."""
    monkeypatch.setattr(C, "MAX_FOLD", LIMIT)
    monkeypatch.setattr(Fo, "MAX_FOLD", LIMIT)
    calls = []
    real = Fo._fold_now

    def counting(ctx, ins, unbounded=False):
        if unbounded:
            calls.append(ctx.op)
        return real(ctx, ins, unbounded)
    monkeypatch.setattr(Fo, "_fold_now", counting)
    return calls


def _c(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _mask_model(reduce: bool = False) -> onnx.ModelProto:
    """x + mask, the mask a causal one built from constants only: LessOrEqual of position grids (numpy fold),
    And/Where on it (element-wise), a Slice of it, and, beside it, an outer product by Einsum (an
    onnx.reference fold whose output shape inference knows): y2 = x2 + outer.  ``reduce``: the sum of
    the mask is added instead (a small result of the huge constant)."""
    nodes = [
        helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "ax_rows"], ["rows"]),          # [1, 1, S, 1]
        helper.make_node("Unsqueeze", ["pos", "ax_cols"], ["cols"]),          # [1, 1, 1, S]
        helper.make_node("Expand", ["cols", "bshape"], ["cols_b"]),           # [B, 1, 1, S]
        helper.make_node("LessOrEqual", ["cols_b", "rows"], ["le"], name="node_le"),   # [B, 1, S, S]
        helper.make_node("ConstantOfShape", ["mshape"], ["ones"],
                         value=helper.make_tensor("v", TensorProto.BOOL, [1], [True])),
        helper.make_node("And", ["ones", "le"], ["keep"]),
        helper.make_node("Where", ["keep", "zerof", "neg"], ["where"]),
        helper.make_node("Slice", ["where", "s0", "sS", "ax3"], ["mask"]),
        helper.make_node("Einsum", ["va", "vb"], ["outer"], equation="i,j->ij"),
        helper.make_node("Add", ["x2", "outer"], ["y2"]),
    ]
    if reduce:
        nodes += [helper.make_node("ReduceSum", ["mask"], ["total"], keepdims=0),
                  helper.make_node("Add", ["x", "total"], ["y"])]
    else:
        nodes.append(helper.make_node("Add", ["x", "mask"], ["y"]))
    inits = [_c("zero", np.int64(0)), _c("seq", np.int64(SEQ)), _c("one", np.int64(1)),
             _c("ax_rows", np.array([0, 1, 3])), _c("ax_cols", np.array([0, 1, 2])),
             _c("bshape", np.array([BATCH, 1, 1, SEQ])), _c("mshape", np.array([BATCH, 1, SEQ, SEQ])),
             _c("zerof", np.float32(0)), _c("neg", np.float32(-1e9)),
             _c("s0", np.array([0])), _c("sS", np.array([SEQ])), _c("ax3", np.array([3])),
             _c("va", np.arange(1, 3, dtype=np.float32)), _c("vb", np.arange(10, dtype=np.float32) / 4)]
    g = helper.make_graph(nodes, "mask",
                          [helper.make_tensor_value_info("x", F, [BATCH, 1, SEQ, SEQ]),
                           helper.make_tensor_value_info("x2", F, [2, 10])],
                          [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("y2", F, None)],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((BATCH, 1, SEQ, SEQ)).astype(np.float32),
            "x2": rng.standard_normal((2, 10)).astype(np.float32)}


def test_large_constant_subgraph_imports_without_being_built_and_evaluates_right(low_guard):
    m = _mask_model()
    g = load_onnx(m)
    g.check()
    assert low_guard == []          # imported: nothing beyond the guard was computed
    shapes = sorted(tuple(n.a["shape"]) for n in g.nodes() if n.op == "Weight")
    assert (BATCH, 1, SEQ, SEQ) in shapes and (2, 10) in shapes
    feeds = _feeds()
    ours = evaluate(g, feeds)
    assert low_guard                # evaluation read the deferred constants: computed then
    ref = ReferenceEvaluator(m).run(None, feeds)
    for a, b in zip(ours, ref):
        assert np.asarray(a).shape == b.shape
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_large_constant_subgraph_plans_without_being_built(low_guard, tmp_path):
    import unity_pcg as up
    path = tmp_path / "mask.onnx"
    onnx.save(_mask_model(), str(path))
    res = up.optimize(path, machine="local:1x2", budget=2, strategy="dp", progress=False)
    assert res.predicted_iteration_s > 0
    assert low_guard == []


def test_import_that_needs_the_large_values_is_refused_in_one_line(low_guard):
    """The sum of the deferred mask is a small constant the import would have to compute now: refused, naming
    the fold beyond the guard."""
    with pytest.raises(InvalidModel) as ei:
        load_onnx(_mask_model(reduce=True))
    msg = str(ei.value)
    assert "too large to fold" in msg and f"limit {LIMIT}" in msg and "\n" not in msg
    assert low_guard == []


def test_guard_at_its_default_folds_eagerly():
    """Below the (default) guard the same graph folds eagerly, as before: no lazy constant is deferred."""
    g = load_onnx(_mask_model())
    feeds = _feeds()
    ref = ReferenceEvaluator(_mask_model()).run(None, feeds)
    for a, b in zip(evaluate(g, feeds), ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)
