"""ONNX import: a module's buffers (rotary tables, causal masks, running statistics) and the exporter's own
constants are not trained.  torch's dynamo exporter writes each initializer's torch.export kind
(``PARAMETER``, ``BUFFER``, ...) on its ``value_info`` entry; the importer gives every initializer that is not a
parameter a Weight with ``trainable=False`` (``loader.untrained_initializers``), so the cost, memory and
pipeline models and the executor treat it as torch does.  A file without that signature (legacy exporter,
other tools) imports as before.  On the zoo's weight-free Llama the rotary tables and the mask read by every
block then no longer block the pipeline cuts between blocks."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.onnx_import import load_onnx
from unity_pcg.onnx_import.loader import INPUT_KIND_KEY, untrained_initializers

torch = pytest.importorskip("torch")


class _Mixed(torch.nn.Module):
    """A parameter, a persistent and a non-persistent buffer, a lifted constant and a small transposed
    parameter (onnxscript's optimizer folds the transpose into a new initializer named after it)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.small = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 8), persistent=False)

    def forward(self, x):
        y = self.lin(x) * self.scale + self.shift + torch.tensor([0.25] * 8)
        return y @ self.small.t()


def _dynamo_export(module, args, path):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, path, dynamo=True, verbose=False, external_data=False)
    return path


def _weights(g):
    return {n.a["name"]: n.id for n in g.sources("Weight")}


def test_dynamo_export_buffers_import_untrained_and_parameters_trained(tmp_path):
    pytest.importorskip("onnxscript")
    import onnx
    path = _dynamo_export(_Mixed(), (torch.randn(4, 8),), str(tmp_path / "m.onnx"))
    g = load_onnx(path)
    ws = _weights(g)
    assert {"lin.weight", "lin.bias", "scale", "shift"} <= set(ws), ws
    assert g.is_trainable(ws["lin.weight"]) and g.is_trainable(ws["lin.bias"])
    assert not g.is_trainable(ws["scale"]) and not g.is_trainable(ws["shift"])
    # the lifted constant and the folded transpose: kindless initializers; the transpose of a parameter
    # stays trained (its folded_from names the parameter), the constant does not
    others = [n for n in ws if n not in ("lin.weight", "lin.bias", "scale", "shift")]
    small = [n for n in others if g.node(ws[n]).a["shape"] == (8, 8)]
    assert small and all(g.is_trainable(ws[n]) for n in small), others
    assert all(not g.is_trainable(ws[n]) for n in others if n not in small), others
    assert g.param_count() == 8 * 8 + 8 + 8 * 8
    # the executor's rule for a PCG read back agrees with the importer
    from unity_pcg.executor.train import model_constants
    frozen = model_constants(g, path)
    assert {"scale", "shift"} <= set(frozen) and not {"lin.weight", "lin.bias"} & set(frozen)
    assert not set(small) & set(frozen)
    m = onnx.load(path)
    assert untrained_initializers(m.graph) >= {"scale", "shift"}


def test_lowered_executor_trains_no_buffer(tmp_path):
    """The executor's trained weights (``Lowered.trainable_weights``, which the optimizer and gradient
    synchronization use) are the parameters only."""
    pytest.importorskip("onnxscript")
    from unity_pcg.executor.lower import lower
    from unity_pcg.machine import local
    path = _dynamo_export(_Mixed(), (torch.randn(4, 8),), str(tmp_path / "m.onnx"))
    g = load_onnx(path)
    low = lower(g, {}, 0, 1, local(1, 1))          # one device; no frozen names from the file
    trained = {g.node(w).a["name"] for w in low.trainable_weights()}
    assert {"lin.weight", "lin.bias"} <= trained and not {"scale", "shift"} & trained


def _graph_with_kinds(kinds: dict):
    """y = x * a + b with initializers a (4,) and b (4,), each initializer's kind as given (None: no entry)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), n) for n in ("a", "b")]
    nodes = [helper.make_node("Mul", ["x", "a"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    F = TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 4])],
                          [helper.make_tensor_value_info("y", F, None)], initializer=inits)
    for name, kind in kinds.items():
        if kind is None:
            continue
        v = helper.make_tensor_value_info(name, F, [4])
        e = v.metadata_props.add()
        e.key, e.value = INPUT_KIND_KEY, kind
        g.value_info.append(v)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("kinds,untrained", [
    ({"a": None, "b": None}, set()),                      # no signature (legacy exporter): as before
    ({"a": "PARAMETER", "b": "BUFFER"}, {"b"}),
    ({"a": "PARAMETER", "b": "CONSTANT_TENSOR"}, {"b"}),
    ({"a": "PARAMETER", "b": None}, {"b"}),               # an exporter-made constant
    ({"a": "BUFFER", "b": "BUFFER"}, {"a", "b"}),
])
def test_signature_rule_and_its_import(kinds, untrained, tmp_path):
    import onnx
    m = _graph_with_kinds(kinds)
    assert untrained_initializers(m.graph) == untrained
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    g = load_onnx(path)
    ws = _weights(g)
    assert {n for n in ("a", "b") if not g.is_trainable(ws[n])} == untrained
    assert g.param_count() == 4 * (2 - len(untrained))


def test_weight_free_llama_cuts_between_blocks_are_valid(tmp_path):
    """The zoo's tiny Llama with 3 blocks, exported weight-free (depth twin: block 2 copied from block 1):
    its rotary tables and causal mask are read by every block; as constants they leave the cuts between
    blocks valid, so the layer clustering finds at least one layer per block (before: one layer)."""
    pytest.importorskip("onnxscript")
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.stages import analyze, cluster
    from unity_pcg.zoo import configs, models
    from unity_pcg.zoo.structure import export_structure

    from ..search.test_pipeline import machine
    cfg = dataclasses.replace(configs.CONFIGS["llama_70b"]["tiny"], layers=3)
    said = []
    res = export_structure(lambda: models.make_module("llama_70b", cfg), tmp_path / "wf.onnx",
                           inputs=[("input_ids", (2, cfg.seq), "int64")], progress=said.append)
    assert any("2 of its 3" in m for m in said) and not any("cannot be copied" in m for m in said)
    g = load_onnx(res.path, load_weights=False)
    ws = _weights(g)
    assert {"cos", "sin", "mask"} & set(ws)
    assert not any(g.is_trainable(ws[n]) for n in ("cos", "sin", "mask") if n in ws)
    # every block's parameters (the copied block's included) are trained
    assert all(g.is_trainable(ws[n]) for n in ws if n.startswith("blocks."))
    assert g.param_count() == res.parameters
    roles = GraphCost(g, CostModel(machine(1, 4))).role
    info = analyze(g, roles)
    valid = [c for c in range(1, len(info.units)) if info.valid[c]]
    assert len(valid) >= 3 * 2, len(valid)        # at least the attention / MLP boundaries of each block
    layers, _ = cluster(g, roles, 3, cuts="fewest", inputs=False, delta=None, balance="cuts")
    assert len(layers) == 3
    # the blocks' projections spread over the layers: each layer holds one block's q_proj
    layer_of = {n: x for x, (a, b) in enumerate(layers) for u in range(a, b) for n in info.units[u]}
    q = sorted(layer_of[c] for n, w in ws.items() if n.endswith("q_proj.weight") for c, _ in g.consumers((w, 0))
               if c in layer_of)
    assert q == [0, 1, 2], q


class _Folds(torch.nn.Module):
    """Folds onnxscript's optimizer makes: a transposed parameter named like an exporter constant (``val_0``), a
    reshaped-and-transposed parameter (a chain: its fold lists intermediates too), a buffer's scaled sum, a
    lifted constant."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.val_0 = torch.nn.Parameter(torch.randn(8, 8))
        self.w2 = torch.nn.Parameter(torch.randn(4, 2, 8))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        y = self.lin(x) * self.scale + torch.tensor([0.25] * 8)
        y = y @ self.val_0.t()
        return y @ self.w2.reshape(8, 8).t() + (self.scale * 2).sum()


def _strip(m, keys):
    """The file as an exporter without ``keys`` metadata (older onnxscript / torch) writes it."""
    for v in list(m.graph.value_info) + list(m.graph.initializer):
        kept = [p for p in v.metadata_props if p.key not in keys]
        del v.metadata_props[:]
        v.metadata_props.extend(kept)
    kept = [p for p in m.graph.metadata_props if p.key not in keys]
    del m.graph.metadata_props[:]
    m.graph.metadata_props.extend(kept)
    return m


def _folded(m):
    """(trained folds: the kindless initializers a MatMul reads; untrained folds: the other kindless ones)."""
    kinds = {v.name for v in m.graph.value_info if any(p.key == INPUT_KIND_KEY for p in v.metadata_props)}
    kindless = {t.name for t in m.graph.initializer} - kinds
    matmul = {i for n in m.graph.node if n.op_type == "MatMul" for i in n.input}
    return kindless & matmul, kindless - matmul


@pytest.mark.parametrize("strip", ["none", "folded_from", "folded_from+signature"])
def test_folded_parameters_stay_trained_by_recorded_facts(strip, tmp_path):
    """With ``folded_from``: decided by the fold's recorded sources and the signature's kinds (a parameter named
    ``val_0`` is a parameter); without it (older onnxscript): the kindless initializers a MatMul reads (the folded
    weights) stay trained, the lifted constant and the buffer's fold do not."""
    pytest.importorskip("onnxscript")
    import onnx
    from unity_pcg.onnx_import.loader import FOLDED_FROM_KEY, SIGNATURE_KEY
    path = _dynamo_export(_Folds(), (torch.randn(4, 8),), str(tmp_path / "m.onnx"))
    m = onnx.load(path)
    trained_folds, const_folds = _folded(m)
    assert len(trained_folds) == 2 and len(const_folds) == 2, (trained_folds, const_folds)
    keys = {"none": set(), "folded_from": {FOLDED_FROM_KEY},
            "folded_from+signature": {FOLDED_FROM_KEY, SIGNATURE_KEY}}[strip]
    m = _strip(m, keys)
    untrained = untrained_initializers(m.graph)
    assert untrained == const_folds | {"scale"}, untrained
    onnx.save(m, str(tmp_path / "s.onnx"))
    g = load_onnx(str(tmp_path / "s.onnx"))
    assert g.param_count() == 8 * 8 + 8 + 8 * 8 + 8 * 8


def test_no_folded_parameter_in_the_signature_freezes_every_exporter_constant(tmp_path):
    """Without ``folded_from`` but with the signature: no parameter is missing from the initializers, so no
    kindless initializer is a folded parameter, whichever operator reads it."""
    pytest.importorskip("onnxscript")
    import onnx
    from unity_pcg.onnx_import.loader import FOLDED_FROM_KEY

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) @ torch.eye(8).t() + 1.0

    m = onnx.load(_dynamo_export(M(), (torch.randn(4, 8),), str(tmp_path / "m.onnx")))
    read_by_matmul, _ = _folded(m)
    assert read_by_matmul            # the identity's fold: a MatMul reads it, yet it is no parameter
    kindless = {t.name for t in m.graph.initializer} - {"lin.weight", "lin.bias"}
    m = _strip(m, {FOLDED_FROM_KEY})
    assert untrained_initializers(m.graph) == kindless and kindless, kindless
