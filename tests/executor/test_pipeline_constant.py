"""A constant of the model (an untrained Weight, e.g. a rotary table computed from Constant nodes) read on both
sides of a pipeline cut: the search's cuts allow it (search.stages: only a *trained* weight may not cross),
and the executor loads it in every stage that reads it -- the 2-stage pipeline trains as one process does."""
from __future__ import annotations

import json
import os

import numpy as np

from unity_pcg import plan as P


def _const_mlp(path: str) -> str:
    """relu((x @ w1) * c) -> relu(@ w2) -> (* c) @ w3, ``c`` a Constant node's output read by the first and
    the last layer."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(11)
    w = lambda n, *s: numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n)  # noqa: E731
    c = helper.make_tensor("cval", TensorProto.FLOAT, [8], np.cos(np.arange(8) * 0.3).astype(np.float32).tolist())
    nodes = [helper.make_node("Constant", [], ["c"], value=c),
             helper.make_node("MatMul", ["x", "w1"], ["a0"]), helper.make_node("Mul", ["a0", "c"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["a2"]),
             helper.make_node("MatMul", ["a2", "w2"], ["b0"]), helper.make_node("Relu", ["b0"], ["b1"]),
             helper.make_node("Mul", ["b1", "c"], ["b2"]), helper.make_node("MatMul", ["b2", "w3"], ["out"])]
    graph = helper.make_graph(nodes, "const_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [8, 4])],
                              [w("w1", 8, 8), w("w2", 8, 8), w("w3", 8, 4)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_constant_read_in_two_stages_trains_like_one_process(tmp_path, capfd):
    from tests.executor.runtime_plans import one_device_plan, searched_pipeline_plan
    from unity_pcg.cli import main
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.pipeline import resolve
    from unity_pcg.executor.train import Trainer
    model = _const_mlp(str(tmp_path / "const_mlp.onnx"))
    pp = searched_pipeline_plan(model, str(tmp_path / "pp.json"), stages=2, micro_batches=2)
    pl = P.load(pp)
    g = pl.pcg
    consts = {n.id for n in g.sources("Weight") if not g.is_trainable(n.id)}
    assert consts, "the importer keeps c as an untrained Weight"
    stages = resolve(pl)[1]
    readers = [{i for i, st in enumerate(stages) for nid in st.nodes
                if g.node(nid).kind != "source" and any(r[0] in consts for r in g.node(nid).inputs)}]
    assert readers == [{0, 1}], readers            # the constant is read on both sides of the cut
    capfd.readouterr()
    rc = main(["run", pp, "--model", model, "--steps", "3", "--seed", "5", "--optimizer", "adam", "--lr", "0.05",
               "--json", "--loss", "mean"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert json.loads(out)["nproc"] == 2
    one = P.load(one_device_plan(model, str(tmp_path / "one.json")))
    t = Trainer(one, model, rank=0, world=1, seed=5, optimizer="adam", lr=0.05)
    src = open_data(one.pcg, None, seed=5)
    ref = [t.step(src.feeds(s)[0]) for s in range(3)]
    np.testing.assert_allclose(json.loads(out)["losses"], ref, rtol=1e-4, atol=1e-7)
