"""ONNX import: a constant the exporter folded at the batch (a decoder's causal mask [B, 1, S, S], which the dynamo
exporter stores as an initializer) and an element-wise operator reads beside an activation is reduced to its first
slice along every dim where it repeats ([1, 1, S, S]), exactly by broadcasting, and is a constant of the model
(Weight ``trainable=False``: no gradient, optimizer state or synchronization).  So the graph holds no constant that
grows with the batch: it re-batches, and micro-batching (``micro_graph``) and the pipeline search accept it.
Parameters are never reduced (a parameter never holds the batch)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.unity_pcg.test_batch_override_masks import _causal
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx

F = TensorProto.FLOAT
S, D = 6, 4


def _attention(batch: int, per_sample: bool = False, zero_bias: bool = False):
    """y = Softmax(x Wq x^T + mask) x with the causal mask [B, 1, S, S] an initializer named ``where`` (as the
    dynamo exporter folds transformers' mask); ``per_sample``: row b's mask shifted by b (data, not a fold);
    ``zero_bias``: a zero parameter [S, D] added to x (uniform values that must stay a parameter)."""
    rng = np.random.default_rng(0)
    tri = np.tril(np.ones((S, S), bool))
    low = np.finfo(np.float32).min
    mask = np.where(tri, 0.0, low).astype(np.float32)[None, None].repeat(batch, 0)
    if per_sample:
        for b in range(batch):
            mask[b, 0, :, :b] = low
            mask[b, 0, :, 0] = 0.0
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"]) if zero_bias else helper.make_node("Identity", ["x"], ["xb"]),
             helper.make_node("MatMul", ["xb", "wq"], ["q"]),
             helper.make_node("Transpose", ["xb"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Unsqueeze", ["s", "ax1"], ["s4"]),
             helper.make_node("Add", ["s4", "where"], ["m"], name="add_mask"),
             helper.make_node("Softmax", ["m"], ["p4"], axis=-1),
             helper.make_node("Squeeze", ["p4", "ax1"], ["p"]),
             helper.make_node("MatMul", ["p", "xb"], ["y"])]
    inits = {"wq": rng.standard_normal((D, D)).astype(np.float32), "where": mask, "ax1": np.array([1], np.int64)}
    if zero_bias:
        inits["bias"] = np.zeros((S, D), np.float32)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [batch, S, D])],
                          [helper.make_tensor_value_info("y", F, None)],
                          initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _weights(g) -> dict:
    return {n.a["name"]: n for n in g.sources("Weight")}


def _check_against_onnxruntime(model, g, batch: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(1).standard_normal((batch, S, D)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(evaluate(g, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_folded_mask_initializer_is_reduced_and_not_trained():
    model = _attention(4)
    g = load_onnx(model)
    w = _weights(g)
    assert w["where"].a["shape"] == (1, 1, S, S) and w["where"].a["trainable"] is False
    assert not g.is_trainable(w["where"].id)
    assert g.is_trainable(w["wq"].id) and w["wq"].a["trainable"] is True
    assert g.param_count() == D * D
    _check_against_onnxruntime(model, g, 4)
    # the reduced value is the mask's first slice
    np.testing.assert_array_equal(np.asarray(g.weights["where"]()), numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "where"))[:1])


def test_the_reduced_graph_is_the_same_at_every_batch():
    g = load_onnx(_attention(4), batch=6)
    want = load_onnx(_attention(6))
    assert g.structural_hash() == want.structural_hash()
    assert _weights(g)["where"].a["shape"] == (1, 1, S, S)
    _check_against_onnxruntime(_attention(6), g, 6)


def test_per_sample_mask_and_parameters_are_left_as_they_are():
    g = load_onnx(_attention(4, per_sample=True))
    w = _weights(g)
    assert w["where"].a["shape"] == (4, 1, S, S)        # differs along the batch: data, not reduced
    _check_against_onnxruntime(_attention(4, per_sample=True), g, 4)
    g = load_onnx(_attention(4, zero_bias=True))
    w = _weights(g)
    assert w["bias"].a["shape"] == (S, D) and g.is_trainable(w["bias"].id)   # uniform, but a parameter
    assert w["where"].a["shape"] == (1, 1, S, S)


@pytest.mark.parametrize("src,dst", [(3, 5), (4, 2)])
def test_mask_folded_from_small_constants_is_reduced(src, dst):
    """transformers' vmapped mask as the exporter writes it unfolded (GatherND of positions, comparisons, Where):
    folded at import, then reduced; re-batched it is the same graph as the export at the new batch."""
    g = load_onnx(_causal(src, 8), batch=dst)
    want = load_onnx(_causal(dst, 8))
    assert g.structural_hash() == want.structural_hash()
    (mask,) = [n for n in g.sources("Weight") if len(n.a["shape"]) == 4]
    assert mask.a["shape"] == (1, 1, 8, 8) and not g.is_trainable(mask.id)


def test_micro_batches_and_pipeline_search_accept_the_reduced_mask():
    """The micro-batch check that refused the [B, 1, S, S] mask ('do not broadcast' / a degree mismatch) passes;
    the pipeline search on local:1x2 returns a feasible 2-stage plan with 2 micro-batches; the cost model does
    not train the mask."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.pipeline import micro_graph, rebatch, search_pipeline
    g = load_onnx(_attention(4), load_weights=False)
    micro_graph(g, 2)
    micro_graph(g, 4)
    rebatch(g, 4, 2)
    m = parse_machine("local:1x2")
    mapper = MachineMapper(CostModel(m, "adam"))
    r = search_pipeline(g, mapper, min_stages=2, max_stages=2, micro_batches=2)
    assert r is not None and r.feasible and r.num_stages == 2 and r.micro_batches == 2
    from unity_pcg.search.cost import GraphCost
    gc = GraphCost(g, CostModel(m, "adam"))
    w = _weights(g)
    assert not gc.trainable(w["where"].id) and gc.trainable(w["wq"].id)
