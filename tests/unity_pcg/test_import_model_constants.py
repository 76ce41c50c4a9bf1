"""ONNX import: a float tensor computed from Constant nodes alone (a legacy export's causal mask or rotary
tables, made in ``forward`` rather than held as a parameter) becomes a Weight with ``trainable=False``:
torch trains only the exporter's initializers, and the executor keeps such values fixed
(``executor.train.model_constants``), so the cost and memory models must not give them gradients or
optimizer states either.  A weight derived from an initializer (transposed) stays trained."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.onnx_import import load_onnx

F = TensorProto.FLOAT


def _model(path):
    rng = np.random.default_rng(0)
    c = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "c0")
    nodes = [helper.make_node("Constant", [], ["c"], value=c),
             helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.float32(2.0), "two")),
             helper.make_node("Mul", ["c", "two"], ["table"]),              # folded from constants only
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),     # derived from a parameter
             helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Add", ["h", "table"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, 4])],
                          [helper.make_tensor_value_info("y", F, None)],
                          initializer=[numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    import onnx
    onnx.save(m, path)
    return path


def test_constants_computed_from_constant_nodes_are_not_trained(tmp_path):
    from unity_pcg.executor.train import model_constants
    from unity_pcg.machine import local
    from unity_pcg.search.cost import CostModel, GraphCost
    path = _model(str(tmp_path / "m.onnx"))
    g = load_onnx(path)
    ws = {n.a["name"]: n.id for n in g.sources("Weight")}
    const = [n for n in ws if n != "w"]
    assert const, ws                             # the folded table became a Weight
    assert "w" in ws and g.is_trainable(ws["w"])
    assert not any(g.is_trainable(ws[n]) for n in const)
    assert g.param_count() == 16                 # only w's 4x4
    assert set(model_constants(g, path)) == set(const)   # the executor's rule agrees
    gc = GraphCost(g, CostModel(local(1, 1), "adam"))
    assert gc.trainable(ws["w"]) and not any(gc.trainable(ws[n]) for n in const)
