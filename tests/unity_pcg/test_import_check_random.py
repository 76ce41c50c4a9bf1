"""`import --check` on models with random operators (issue 20, point 4): the randomness is switched off on both
sides (Dropout in training mode runs as in inference, random generators give a deterministic stand-in), the output
says so in one line, and any other difference still reads DIFFERENT."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.cli import main
from unity_pcg.evaluate import random_ops
from unity_pcg.onnx_import import load_onnx
from unity_pcg.onnx_import.check import check_model, derandomize, run_onnxruntime

pytest.importorskip("onnxruntime")

N = helper.make_node
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=18):
    m = helper.make_model(helper.make_graph(nodes, "t", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


@pytest.fixture(scope="module")
def dropout_onnx(tmp_path_factory):
    """A torch MLP with two Dropouts exported in training mode (training_mode inputs constant true)."""
    torch = pytest.importorskip("torch")
    path = str(tmp_path_factory.mktemp("rand") / "dropout_train.onnx")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                            torch.nn.Linear(16, 4), torch.nn.Dropout(0.5)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(3, 8),), path, training=torch.onnx.TrainingMode.TRAINING, dynamo=False,
                          input_names=["x"], output_names=["y"])
    model = onnx.load(path)
    assert sum(n.op_type == "Dropout" and len(n.input) == 3 for n in model.graph.node) == 2
    return path


def _cli(capsys, *args):
    capsys.readouterr()
    rc = main(["import", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_dropout_in_training_mode_checks_equal_with_the_note(dropout_onnx, capsys):
    r = check_model(dropout_onnx)
    assert r.ok and r.max_abs == 0.0
    assert r.derandomized == {"Dropout (training mode)": 2} and r.pcg_random == {"Dropout": 2}
    assert r.randomness.startswith("randomness switched off on both sides: onnxruntime runs 2 Dropout "
                                   "(training mode) as identity")
    rc, out, _ = _cli(capsys, dropout_onnx, "--check")
    assert rc == 0 and "check: equal" in out
    notes = [ln for ln in out.splitlines() if "randomness switched off" in ln]
    assert len(notes) == 1 and "2 Dropout (training mode) as identity" in notes[0]
    rc, out, _ = _cli(capsys, dropout_onnx, "--check", "--json")
    chk = json.loads(out)["check"]
    assert rc == 0 and chk["ok"] and chk["derandomized"] == {"Dropout (training mode)": 2}
    assert chk["pcg_random"] == {"Dropout": 2} and chk["randomness"] == notes[0].strip()


def test_onnxruntime_really_drops_on_the_file_as_it_is(dropout_onnx):
    """What the rewrite is for: the file itself gives random outputs under onnxruntime (so comparing with it
    would say DIFFERENT on a correct import), the rewritten copy gives the inference values."""
    x = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    model = onnx.load(dropout_onnx)
    raw = run_onnxruntime(model, x)[0]
    fixed, counts = derandomize(model)
    assert counts == {"Dropout (training mode)": 2}
    assert fixed is not model and sum(len(n.input) == 3 for n in model.graph.node if n.op_type == "Dropout") == 2
    a, b = run_onnxruntime(fixed, x)[0], run_onnxruntime(fixed, x)[0]
    assert np.array_equal(a, b) and not np.allclose(raw, a)


def test_a_wrong_weight_still_reads_different_with_dropout_in_training_mode(dropout_onnx):
    g = load_onnx(dropout_onnx)
    name = next(k for k, v in g.weights.items() if np.asarray(v() if callable(v) else v).ndim == 2)
    w = np.array(g.weights[name]() if callable(g.weights[name]) else g.weights[name], copy=True)
    w.flat[0] += 0.5
    g.weights[name] = w
    r = check_model(dropout_onnx, graph=g)
    assert not r.ok and r.max_abs > 1e-3 and r.randomness


def test_no_note_without_random_operators(tmp_path, capsys):
    """Dropout whose training_mode is constant false, and Dropout before opset 12, are not random."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    off = numpy_helper.from_array(np.array(False), "off")
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    x = helper.make_tensor_value_info("x", F, [2, 4])
    y = helper.make_tensor_value_info("y", F, None)
    cases = {
        "off.onnx": _model([N("MatMul", ["x", "W"], ["h"]), N("Dropout", ["h", "ratio", "off"], ["y"])],
                           [x], [y], [w, off, ratio]),
        "op10.onnx": _model([N("MatMul", ["x", "W"], ["h"]), N("Dropout", ["h"], ["y"], ratio=0.5)],
                            [x], [y], [w], opset=10),
        "plain.onnx": _model([N("MatMul", ["x", "W"], ["h"]), N("Relu", ["h"], ["y"])], [x], [y], [w]),
    }
    for fname, m in cases.items():
        p = tmp_path / fname
        onnx.save(m, str(p))
        assert derandomize(m) == (m, {})
        r = check_model(str(p))
        assert r.ok and r.randomness == "" and r.derandomized == {} and r.pcg_random == {}, fname
        rc, out, _ = _cli(capsys, p, "--check")
        assert rc == 0 and "randomness" not in out, (fname, out)


def test_training_mode_from_a_constant_node_and_an_initializer(tmp_path):
    """The exporter's Constant node and an initializer both count as training mode when true."""
    x = helper.make_tensor_value_info("x", F, [2, 5])
    y = helper.make_tensor_value_info("y", F, None)
    z = helper.make_tensor_value_info("z", F, None)
    on = numpy_helper.from_array(np.array(True), "on")
    m = _model([N("Constant", [], ["t"], value=numpy_helper.from_array(np.array(True), "t")),
                N("Dropout", ["x", "", "t"], ["a"]), N("Relu", ["a"], ["y"]),
                N("Dropout", ["x", "", "on"], ["b", "mask"]), N("Sigmoid", ["b"], ["z"])], [x], [y, z], [on])
    p = tmp_path / "two.onnx"
    onnx.save(m, str(p))
    r = check_model(str(p))
    assert r.ok and r.derandomized == {"Dropout (training mode)": 2} and r.pcg_random == {"Dropout": 2}


# --- random generators: the stand-ins under onnxruntime ----------------------------------------------------

def _run_rewritten(nodes, inputs, outputs, feeds, opset=18):
    m = _model(nodes, inputs, outputs, opset=opset)
    fixed, counts = derandomize(m)
    return run_onnxruntime(fixed, feeds), counts


def test_random_generators_give_their_stand_ins_under_onnxruntime():
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    xd = x.astype(np.float64)
    outs, counts = _run_rewritten(
        [N("RandomNormal", [], ["rn"], shape=[2, 3], mean=1.5, scale=4.0),
         N("RandomNormalLike", ["x"], ["rnl"], mean=-0.25, scale=2.0),
         N("RandomUniform", [], ["ru"], shape=[5], low=2.0, high=3.0, dtype=TensorProto.DOUBLE),
         N("RandomUniformLike", ["xd"], ["rul"]),
         N("Add", ["x", "rnl"], ["y"]),
         N("Cast", ["x"], ["xc"], to=TensorProto.DOUBLE),             # an activation's type: by inference
         N("RandomNormalLike", ["xc"], ["rc"], mean=3.0)],
        [helper.make_tensor_value_info("x", F, [3, 4]),
         helper.make_tensor_value_info("xd", TensorProto.DOUBLE, [3, 4])],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("rn", F), ("rnl", F), ("ru", TensorProto.DOUBLE), ("rul", TensorProto.DOUBLE), ("y", F),
          ("rc", TensorProto.DOUBLE))],
        {"x": x, "xd": xd})
    rn, rnl, ru, rul, y, rc = outs
    assert counts == {"RandomNormal": 1, "RandomNormalLike": 2, "RandomUniform": 1, "RandomUniformLike": 1}
    assert rc.dtype == np.float64 and rc.shape == (3, 4) and (rc == 3.0).all()
    assert rn.dtype == np.float32 and rn.shape == (2, 3) and (rn == 1.5).all()
    assert rnl.dtype == np.float32 and rnl.shape == (3, 4) and (rnl == -0.25).all()
    assert ru.dtype == np.float64 and ru.shape == (5,) and (ru == 2.5).all()
    assert rul.dtype == np.float64 and rul.shape == (3, 4) and (rul == 0.5).all()
    np.testing.assert_array_equal(y, x + np.float32(-0.25))


def test_bernoulli_and_multinomial_give_their_most_likely_values():
    p = np.array([[0.1, 0.5, 0.9], [0.49, 0.51, 0.0]], np.float32)
    logits = np.array([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0]], np.float32)
    outs, counts = _run_rewritten(
        [N("Bernoulli", ["p"], ["b"]), N("Bernoulli", ["p"], ["bb"], dtype=TensorProto.BOOL),
         N("Multinomial", ["logits"], ["m"], sample_size=4)],
        [helper.make_tensor_value_info("p", F, [2, 3]), helper.make_tensor_value_info("logits", F, [2, 3])],
        [helper.make_tensor_value_info("b", F, None), helper.make_tensor_value_info("bb", TensorProto.BOOL, None),
         helper.make_tensor_value_info("m", TensorProto.INT32, None)],
        {"p": p, "logits": logits})
    b, bb, m = outs
    assert counts == {"Bernoulli": 2, "Multinomial": 1}
    np.testing.assert_array_equal(b, (p >= 0.5).astype(np.float32))
    assert bb.dtype == np.bool_ and (bb == (p >= 0.5)).all()
    assert m.dtype == np.int32 and m.tolist() == [[1] * 4, [0] * 4]


# --- random generators in the PCG: imported, checked with their stand-ins ------------------------------------

def _noisy(path, extra_nodes=(), out="y"):
    """y = (x @ W + RandomNormalLike(h)) * RandomUniform[2, 4]: a learnable path and two generators."""
    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32), "W")
    m = _model([N("MatMul", ["x", "W"], ["h"]), N("RandomNormalLike", ["h"], ["noise"], mean=0.25, scale=3.0),
                N("Add", ["h", "noise"], ["hn"]),
                N("RandomUniform", [], ["u"], shape=[2, 4], low=1.0, high=2.0, seed=5.0),
                N("Mul", ["hn", "u"], ["y"]), *extra_nodes],
               [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_tensor_value_info(out, F, None)], [w])
    onnx.save(m, str(path))
    return str(path)


def test_generators_import_and_check_equal_with_the_note(tmp_path, capsys):
    p = _noisy(tmp_path / "noisy.onnx")
    g = load_onnx(p)
    assert random_ops(g) == {"RandomNormal": 1, "RandomUniform": 1}
    gen = {n.op: n.a for n in g.nodes() if n.op.startswith("Random")}
    assert gen["RandomNormal"]["shape"] == (2, 4) and gen["RandomNormal"]["mean"] == 0.25
    assert gen["RandomNormal"]["seed"] == -1 and gen["RandomUniform"]["seed"] == 5
    assert gen["RandomUniform"]["low"] == 1.0 and gen["RandomUniform"]["high"] == 2.0
    r = check_model(p)
    assert r.ok and r.derandomized == {"RandomNormalLike": 1, "RandomUniform": 1}
    assert r.pcg_random == {"RandomNormal": 1, "RandomUniform": 1}
    assert r.randomness == ("randomness switched off on both sides: onnxruntime runs 1 RandomNormalLike as its "
                            "mean, 1 RandomUniform as (low + high) / 2; the PCG (1 RandomNormal, 1 RandomUniform) "
                            "is evaluated with the same stand-ins")
    rc, out, _ = _cli(capsys, p, "--check")
    assert rc == 0 and "check: equal" in out
    notes = [ln.strip() for ln in out.splitlines() if "randomness switched off" in ln]
    assert notes == [r.randomness]
    rc, out, _ = _cli(capsys, p, "--check", "--json")
    chk = json.loads(out)["check"]
    assert rc == 0 and chk["ok"] and chk["pcg_random"] == {"RandomNormal": 1, "RandomUniform": 1}


def test_evaluate_draws_unless_asked_for_the_stand_ins(tmp_path):
    """Without the switch the numpy reference draws (noise of scale 3 moves the output far from the stand-in's),
    deterministically for a run seed; the stand-ins are what onnxruntime's rewritten copy computes."""
    from unity_pcg.evaluate import evaluate
    g = load_onnx(_noisy(tmp_path / "noisy.onnx"))
    x = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
    standin = evaluate(g, x, random="standin")[0]
    drawn = evaluate(g, x)[0]
    assert np.array_equal(drawn, evaluate(g, x, seed=0)[0]) and not np.allclose(drawn, evaluate(g, x, seed=1)[0])
    assert np.abs(drawn - standin).max() > 0.5
    w = np.asarray(g.weights["W"]() if callable(g.weights["W"]) else g.weights["W"])
    np.testing.assert_allclose(standin, (x["x"] @ w + 0.25) * 1.5, rtol=1e-6)
    with pytest.raises(ValueError, match="random must be"):
        evaluate(g, x, random="off")


def _replace_generator(g, op, **attrs):
    b = g.edit()
    old = next(n for n in g.nodes() if n.op == op)
    new = b.add(op, {**old.a, **attrs}, [], "altered")
    b.replace_uses((old.id, 0), new)
    b.remove(old.id)
    out = b.finish()
    out.weights = g.weights
    return out


def test_a_wrong_weight_or_a_wrong_generator_still_reads_different(tmp_path, capsys):
    p = _noisy(tmp_path / "noisy.onnx")
    g = load_onnx(p)
    w = np.array(g.weights["W"]() if callable(g.weights["W"]) else g.weights["W"], copy=True)
    w.flat[0] += 0.5
    g.weights["W"] = w
    r = check_model(p, graph=g)
    assert not r.ok and r.max_abs > 1e-3 and r.randomness
    for op, change in (("RandomNormal", {"mean": 0.5}), ("RandomUniform", {"high": 2.5})):
        r = check_model(p, graph=_replace_generator(load_onnx(p), op, **change))
        assert not r.ok and r.randomness and r.pcg_random == {"RandomNormal": 1, "RandomUniform": 1}, op
    # a changed scale or seed is not compared (the stand-in is the mean): still equal
    assert check_model(p, graph=_replace_generator(load_onnx(p), "RandomNormal", scale=9.0, seed=3)).ok


def test_generator_forms_types_and_a_constant_input(tmp_path):
    """RandomUniformLike of a float64 input (its type), RandomNormalLike with a dtype attribute, of a constant
    (never folded: random), and a generator alone as the output."""
    c = numpy_helper.from_array(np.zeros((2, 5), np.float32), "c")
    xd = helper.make_tensor_value_info("xd", TensorProto.DOUBLE, [2, 5])
    m = _model([N("RandomUniformLike", ["xd"], ["u"], low=-1.0, high=0.0), N("Add", ["xd", "u"], ["y"]),
                N("RandomNormalLike", ["c"], ["z"], dtype=TensorProto.DOUBLE, mean=2.0)],
               [xd], [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None),
                      helper.make_tensor_value_info("z", TensorProto.DOUBLE, None)], [c])
    p = tmp_path / "forms.onnx"
    onnx.save(m, str(p))
    g = load_onnx(str(p))
    gens = sorted((n.op, n.a["dtype"], n.a["shape"]) for n in g.nodes() if n.op.startswith("Random"))
    assert gens == [("RandomNormal", "float64", (2, 5)), ("RandomUniform", "float64", (2, 5))]
    r = check_model(str(p))
    assert r.ok and r.derandomized == {"RandomUniformLike": 1, "RandomNormalLike": 1}


@pytest.mark.parametrize("node, x_type, words", [
    (N("Multinomial", ["x"], ["r"], sample_size=2), F, "unsupported operator Multinomial"),
    (N("Bernoulli", ["x"], ["r"]), TensorProto.INT64, "Bernoulli of element type int64"),
    (N("RandomNormalLike", ["x"], ["r"]), TensorProto.INT64, "RandomNormalLike of element type int64"),
    (N("RandomUniform", [], ["r"], shape=[2, 3], dtype=TensorProto.INT32), F, "RandomUniform of element type"),
])
def test_unsupported_random_operators_are_refused_with_one_line(tmp_path, capsys, node, x_type, words):
    m = _model([node], [helper.make_tensor_value_info("x", x_type, [2, 3])],
               [helper.make_tensor_value_info("r", TensorProto.UNDEFINED, None)])
    p = tmp_path / "r.onnx"
    onnx.save(m, str(p))
    rc, out, err = _cli(capsys, p, "--check")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_bernoulli_imports_as_a_uniform_compared_with_p(tmp_path, capsys):
    """Bernoulli(p) = Cast(LessOrEqual(RandomUniform(0, 1), p)): 1 with probability p when drawn; under the
    stand-ins (U = 1/2) exactly Bernoulli's most likely value, p >= 0.5, at p = 0.5 too."""
    from unity_pcg.evaluate import evaluate
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32), "W")
    m = _model([N("MatMul", ["x", "W"], ["h"]), N("Sigmoid", ["h"], ["p"]), N("Bernoulli", ["p"], ["b"]),
                N("Mul", ["h", "b"], ["y"]), N("Bernoulli", ["q"], ["c"], dtype=TensorProto.BOOL, seed=2.0)],
               [helper.make_tensor_value_info("x", F, [2, 3]), helper.make_tensor_value_info("q", F, [400, 50])],
               [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("c", TensorProto.BOOL,
                                                                                           None)], [w])
    p = tmp_path / "bern.onnx"
    onnx.save(m, str(p))
    g = load_onnx(str(p))
    assert random_ops(g) == {"RandomUniform": 2}
    r = check_model(str(p))
    assert r.ok and r.derandomized == {"Bernoulli": 2} and "2 Bernoulli as 1 where p >= 0.5 else 0" in r.randomness
    q = np.full((400, 50), 0.3, np.float32)
    q[0, :3] = [0.5, 0.4999, 0.0]
    x = {"x": np.zeros((2, 3), np.float32), "q": q}
    c = evaluate(g, x, random="standin")[1]
    assert c.dtype == np.bool_ and c[0, :3].tolist() == [True, False, False] and not c[1:].any()
    drawn = evaluate(g, x)[1]
    assert abs(drawn.mean() - 0.3) < 0.01 and not drawn[0, 2]
    # a wrong p still reads DIFFERENT
    g2 = load_onnx(str(p))
    g2.weights["W"] = -np.asarray(g2.weights["W"]() if callable(g2.weights["W"]) else g2.weights["W"])
    assert not check_model(str(p), graph=g2).ok


@pytest.fixture(scope="module")
def randn_like_onnx(tmp_path_factory):
    """A torch module adding ``torch.randn_like`` noise and ``torch.rand`` scales, exported with the legacy
    (TorchScript) exporter."""
    torch = pytest.importorskip("torch")

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)

        def forward(self, x):
            h = self.lin(x)
            return torch.relu(h + 0.5 * torch.randn_like(h)) * torch.rand(3, 4)

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("randn") / "randn_like.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Noisy(), (torch.randn(3, 6),), path, dynamo=False, input_names=["x"],
                          output_names=["y"])
    return path


def test_torch_randn_like_exported_legacy_imports_and_checks_equal(randn_like_onnx):
    ops_ = [n.op_type for n in onnx.load(randn_like_onnx).graph.node]
    assert "RandomNormalLike" in ops_ and "RandomUniform" in ops_, ops_
    g = load_onnx(randn_like_onnx)
    assert random_ops(g) == {"RandomNormal": 1, "RandomUniform": 1}
    r = check_model(randn_like_onnx)
    assert r.ok and r.randomness and r.derandomized == {"RandomNormalLike": 1, "RandomUniform": 1}


def test_pcg_random_ops_count_dropout(dropout_onnx):
    assert random_ops(load_onnx(dropout_onnx)) == {"Dropout": 2}


def test_a_batch_override_rewrites_a_generator_shape_that_leads_with_the_batch(randn_like_onnx):
    """torch.rand(3, 4) exported at batch 3 holds the batch in RandomUniform's shape: at --batch 5 it draws
    [5, 4] (what an export at 5 holds) and the check is equal."""
    g = load_onnx(randn_like_onnx, batch=5)
    assert sorted(n.a["shape"] for n in g.nodes() if n.op.startswith("Random")) == [(5, 4), (5, 4)]
    r = check_model(randn_like_onnx, batch=5)
    assert r.ok and r.randomness and r.outputs[0].shape == (5, 4)
