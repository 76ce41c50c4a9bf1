"""Random generators (RandomNormal/RandomUniform, imported from ONNX's and their *Like forms) in training: the
executor draws every piece from the counter-based hash of (seed, step, node key, logical index), so two
data-parallel processes train exactly as one process, and step 0 of one process is the numpy reference's draw."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.executor.runtime_plans import dp_plan, one_device_plan
from unity_pcg import plan as P
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx

pytest.importorskip("torch")
N = helper.make_node


def noisy_mlp_onnx(path: str, batch: int = 8) -> str:
    """y = (relu(x @ W1 + RandomNormalLike) @ W2) * RandomUniform[batch, 8] + b."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.3 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("W1", (16, 32)), ("W2", (32, 8)), ("b", (8,)))]
    nodes = [N("MatMul", ["x", "W1"], ["h"]), N("RandomNormalLike", ["h"], ["noise"], mean=0.1, scale=0.5),
             N("Add", ["h", "noise"], ["hn"]), N("Relu", ["hn"], ["a"]), N("MatMul", ["a", "W2"], ["z"]),
             N("RandomUniform", [], ["u"], shape=[batch, 8], low=0.5, high=1.5),
             N("Mul", ["z", "u"], ["zu"]), N("Add", ["zu", "b"], ["y"])]
    g = helper.make_graph(nodes, "noisy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    onnx.save(m, path)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("randexec")
    model = noisy_mlp_onnx(str(d / "noisy.onnx"))
    return {"dir": d, "model": model, "one": one_device_plan(model, str(d / "one.json")),
            "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


def _run(capfd, plan, model, out, *extra):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", str(plan), "--model", str(model), "--steps", "2", "--loss", "mean", "--lr", "0.5",
               "--json", "--save-model", str(out), *map(str, extra)])
    o, e = capfd.readouterr()
    assert rc == 0, e
    return json.loads(o)


def test_the_generators_are_in_the_plans(work):
    for k in ("one", "dp2"):
        ops_ = {n.op for n in P.load(work[k]).pcg.nodes()}
        assert {"RandomNormal", "RandomUniform"} <= ops_, k
    assert P.load(work["dp2"]).pcg is not None


def test_two_data_parallel_processes_train_as_one(work, capfd):
    d = work["dir"]
    one = _run(capfd, work["one"], work["model"], d / "one_out.onnx")
    two = _run(capfd, work["dp2"], work["model"], d / "two_out.onnx")
    assert one["nproc"] == 1 and two["nproc"] == 2
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-4)
    w1 = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(d / "one_out.onnx")).graph.initializer}
    w2 = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(d / "two_out.onnx")).graph.initializer}
    assert set(w1) == {"W1", "W2", "b"}
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # trained: the weights moved
    w0 = {t.name: numpy_helper.to_array(t) for t in onnx.load(work["model"]).graph.initializer}
    assert not np.allclose(w1["W1"], w0["W1"])

    # step 0's loss is the numpy reference's draw (run seed 0, step 0) on the executor's feeds; the stand-ins
    # (no randomness) give another loss, and so does another run seed
    from unity_pcg.executor.data import open_data
    g = load_onnx(work["model"])
    feeds, _ = open_data(g, None, seed=0).feeds(0)
    drawn = float(np.mean(evaluate(g, feeds)[0]))
    assert one["losses"][0] == pytest.approx(drawn, rel=1e-5)
    assert abs(float(np.mean(evaluate(g, feeds, random="standin")[0])) - drawn) > 1e-3
    assert abs(float(np.mean(evaluate(g, feeds, seed=1)[0])) - drawn) > 1e-3
