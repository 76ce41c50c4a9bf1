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
    """zu = (relu(x @ W1 + RandomNormalLike) @ W2) * RandomUniform[batch, 8]; y = zu * Bernoulli(sigmoid(zu)) + b."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.3 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in (("W1", (16, 32)), ("W2", (32, 8)), ("b", (8,)))]
    nodes = [N("MatMul", ["x", "W1"], ["h"]), N("RandomNormalLike", ["h"], ["noise"], mean=0.1, scale=0.5),
             N("Add", ["h", "noise"], ["hn"]), N("Relu", ["hn"], ["a"]), N("MatMul", ["a", "W2"], ["z"]),
             N("RandomUniform", [], ["u"], shape=[batch, 8], low=0.5, high=1.5),
             N("Mul", ["z", "u"], ["zu"]), N("Sigmoid", ["zu"], ["pz"]), N("Bernoulli", ["pz"], ["keep"]),
             N("Mul", ["zu", "keep"], ["zk"]), N("Add", ["zk", "b"], ["y"])]
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
        assert {"RandomNormal", "RandomUniform", "LessOrEqual"} <= ops_, k
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


def test_each_rank_draws_the_blocks_it_reads_without_communication(work):
    """The lowering treats a generator like a source: every device draws the block of the logical tensor its
    tasks read (rows 0-3 on rank 0, 4-7 on rank 1) and nothing is sent for it."""
    from unity_pcg.executor.lower import lower
    pl = P.load(work["dp2"])
    gens = {n.id for n in pl.pcg.nodes() if n.op in ("RandomNormal", "RandomUniform")}
    for rank in (0, 1):
        low = lower(pl.pcg, pl.views, rank, 2)
        assert all(low.origin.get(e.ref[0]) not in gens for st in low.steps for e in st.exchanges)
        drawn = [s for st in low.steps for s in st.inputs if s is not None and s.kind == "generate"]
        assert len(drawn) == 3 and {low.origin[s.ref[0]] for s in drawn} == gens
        assert all(s.slices[0] == (4 * rank, 4 * rank + 4) for s in drawn)


def test_a_block_equals_the_numpy_reference_at_its_place():
    """executor.kernels.generate_block (torch) draws the numpy reference's values (unity_pcg.ops.random_gen)
    at every block, at any step; different steps, seeds and keys draw different tensors."""
    import torch
    from unity_pcg.executor.kernels import generate_block
    from unity_pcg.ops.random_gen import draw
    for op, a in (("RandomNormal", {"shape": (6, 4, 5), "dtype": "float64", "mean": 0.5, "scale": 2.0,
                                    "seed": -1, "key": 12345}),
                  ("RandomUniform", {"shape": (6, 4, 5), "dtype": "float32", "low": -1.0, "high": 3.0,
                                     "seed": 9, "key": 7})):
        whole = draw(op, a, seed=3, step=2)
        for off, piece in (((0, 0, 0), (6, 4, 5)), ((3, 0, 0), (3, 4, 5)), ((2, 2, 1), (2, 2, 3))):
            t = generate_block(op, a, 3, 2, a["shape"], off, piece, "cpu").numpy()
            sl = tuple(slice(o, o + p) for o, p in zip(off, piece))
            np.testing.assert_allclose(t, whole[sl], rtol=1e-12 if a["dtype"] == "float64" else 1e-6)
            np.testing.assert_array_equal(draw(op, a, seed=3, step=2, offset=off, piece=piece), whole[sl])
        assert not np.allclose(draw(op, a, seed=3, step=3), whole)
        assert not np.allclose(draw(op, {**a, "key": a["key"] + 1}, seed=3, step=2), whole)
        if op == "RandomUniform":    # no transcendental function on the way: bit for bit
            assert torch.equal(torch.as_tensor(whole),
                               generate_block(op, a, 3, 2, a["shape"], (0, 0, 0), a["shape"], "cpu"))
    a = {"shape": (6, 4, 5), "dtype": "float64", "mean": 0.0, "scale": 1.0, "seed": -1, "key": 1}
    assert not np.allclose(draw("RandomNormal", a, seed=0), draw("RandomNormal", a, seed=1))
    assert np.allclose(draw("RandomNormal", {**a, "seed": 5}, seed=0), draw("RandomNormal", {**a, "seed": 5}, seed=1))


def test_pipelines_refuse_generators_and_the_pipeline_searches_too(work):
    from unity_pcg.executor.pipeline import PipelineError, check_pipeline
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import search_pipeline
    from tests.executor.runtime_plans import pipeline_plan
    pl = P.load(pipeline_plan(work["model"], str(work["dir"] / "pipe.json")))
    with pytest.raises(PipelineError, match="RandomNormalLike_1.*not supported") as e:
        check_pipeline(pl)
    assert "\n" not in str(e.value)
    from unity_pcg.errors import UnityError
    from unity_pcg.search.alpa.inter import alpa_plan
    g = load_onnx(work["model"], load_weights=False)
    m = parse_machine("local:1x2")
    for search in (lambda: search_pipeline(g, CostModel(m), min_stages=2, max_stages=2), lambda: alpa_plan(g, m)):
        with pytest.raises(UnityError, match="draws random numbers") as e:
            search()
        assert "\n" not in str(e.value)
