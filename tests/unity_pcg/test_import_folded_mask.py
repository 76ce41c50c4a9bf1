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


# --- a transformers Llama-style decoder, dynamo export (slow: exports) ----------------------------------------

def _export_llama(path: str, batch: int, seq: int = 16) -> str:
    """A tiny ``LlamaModel`` (2 layers, grouped-query attention, SwiGLU, RMSNorm, rotary) taking only
    ``input_ids``: its causal mask is computed from constants, which the dynamo exporter folds into an
    initializer [B, 1, S, S]."""
    import contextlib
    import io
    import warnings

    import torch
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                        attn_implementation="eager")
    m = T.LlamaModel(cfg).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x, return_dict=True)[0]
    x = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrap().eval(), (x,), path, input_names=["input_ids"], opset_version=18, dynamo=True,
                          external_data=False, optimize=True)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    d = tmp_path_factory.mktemp("llama")
    return {"dir": d, 4: _export_llama(str(d / "llama_b4.onnx"), 4), 2: _export_llama(str(d / "llama_b2.onnx"), 2)}


def _masks(g) -> list:
    """Weights of rank 4 read by an Add (the causal masks)."""
    return [n for n in g.sources("Weight") if len(n.a["shape"]) == 4
            and any(g.node(u).op == "Add" for u, _ in g.consumers((n.id, 0)))]


@pytest.mark.slow
def test_llama_export_imports_with_its_mask_reduced(llama):
    ort = pytest.importorskip("onnxruntime")
    from unity_pcg.search.pipeline import micro_graph, rebatch
    g = load_onnx(llama[4])
    masks = _masks(g)
    assert masks and all(n.a["shape"][:2] == (1, 1) and not g.is_trainable(n.id) for n in masks)
    ids = np.random.default_rng(3).integers(0, 64, (4, 16))
    want = ort.InferenceSession(llama[4], providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(evaluate(g, {"input_ids": ids})[0], want, rtol=1e-4, atol=1e-5)
    # re-batched: the export at batch 2, imported as is, has the same operators and shapes
    g2, want2 = load_onnx(llama[4], batch=2), load_onnx(llama[2])
    assert sorted(g2.shape((n.id, 0)).sizes for n in g2.nodes()) == sorted(want2.shape((n.id, 0)).sizes
                                                                           for n in want2.nodes())
    ids2 = ids[:2]
    np.testing.assert_allclose(evaluate(g2, {"input_ids": ids2})[0], evaluate(want2, {"input_ids": ids2})[0],
                               rtol=1e-5, atol=1e-6)
    micro_graph(load_onnx(llama[4], load_weights=False), 2)       # refused before: the mask held the batch
    rebatch(g, 4, 2)


@pytest.mark.slow
def test_llama_two_stage_pipeline_trains_like_one_process(llama, capfd):
    """The search's 2-stage pipeline (2 micro-batches) of the decoder on local:1x2 under ``run`` (gloo, 2
    processes): 3 SGD steps, the losses of the one-device plan on one process (rtol 1e-4)."""
    import json

    from tests.executor.runtime_plans import one_device_plan, searched_pipeline_plan
    from unity_pcg.cli import main
    d = llama["dir"]
    pp = searched_pipeline_plan(llama[4], str(d / "pp.json"), stages=2, micro_batches=2)
    one = one_device_plan(llama[4], str(d / "one.json"))
    losses = {}
    for name, plan in (("one", one), ("pp", pp)):
        capfd.readouterr()
        rc = main(["run", plan, "--model", llama[4], "--steps", "3", "--loss", "mean", "--optimizer", "sgd",
                   "--json"])
        out, err = capfd.readouterr()
        assert rc == 0, err[-2000:]
        res = json.loads(out[out.index("{"):])
        losses[name] = res["losses"]
        if name == "pp":
            assert res["pipeline"] and res["nproc"] == 2
    assert len(losses["pp"]) == 3
    np.testing.assert_allclose(losses["pp"], losses["one"], rtol=1e-4, atol=1e-6)
