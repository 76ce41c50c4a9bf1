"""ONNX import of the element-wise, LogSoftmax and reduction operators (issue 10 point 2): each operator imported
from a one-node model and evaluated with the numpy reference, compared with onnxruntime; bad attribute values,
rank mismatches and zero-size dims give a one-line typed error (and exit 2 on the CLI), never a traceback."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.errors import UnityError
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx

ort = pytest.importorskip("onnxruntime")

F = TensorProto.FLOAT


def _model(op, attrs=None, shape=(2, 3, 4), inputs=("x",), inits=(), opset=13, dtype=F, extra_inputs=()):
    node = helper.make_node(op, list(inputs), ["y"], name="n", **(attrs or {}))
    vis = [helper.make_tensor_value_info("x", dtype, list(shape))]
    vis += [helper.make_tensor_value_info(n, dtype, list(s)) for n, s in extra_inputs]
    g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", dtype, None)],
                          [numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 8
    return m


def _ort(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _feeds(model, fill, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if fill == "positive":
            v = rng.uniform(0.1, 3.0, shape)
        elif fill == "wide":
            v = rng.uniform(-5.0, 5.0, shape)
        else:
            v = rng.standard_normal(shape)
        out[vi.name] = v.astype(np.float32)
    return out


def _compare(model, fill="normal"):
    g = load_onnx(model)
    g.check()
    feeds = _feeds(model, fill)
    (ours,) = evaluate(g, feeds)
    (ref,) = _ort(model, feeds)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    return sorted({n.op for n in g.nodes()} - {"Input", "Weight"})


SLOPE_C11 = np.array([0.1, -0.3, 2.0], np.float32).reshape(3, 1, 1)
# (ONNX op, attributes, opset, input shape, extra initializers, fill, the PCG operators it becomes)
CASES = [
    ("LeakyRelu", {}, 13, (2, 3, 4), (), "normal", ["LeakyRelu"]),
    ("LeakyRelu", {"alpha": 0.3}, 6, (5,), (), "normal", ["LeakyRelu"]),
    ("Elu", {"alpha": 0.7}, 13, (2, 3, 4), (), "wide", ["Elu"]),
    ("Selu", {}, 13, (2, 3, 4), (), "wide", ["Selu"]),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}, 6, (4, 4), (), "wide", ["Selu"]),
    ("Celu", {"alpha": 0.5}, 12, (2, 3, 4), (), "wide", ["Celu"]),
    ("Softplus", {}, 13, (2, 3, 4), (), "wide", ["Softplus"]),
    ("Softsign", {}, 13, (2, 3, 4), (), "wide", ["Softsign"]),
    ("Mish", {}, 18, (2, 3, 4), (), "wide", ["Mish"]),
    ("HardSigmoid", {}, 13, (2, 3, 4), (), "wide", ["HardSigmoid"]),
    ("HardSigmoid", {"alpha": 0.5, "beta": 0.1}, 6, (2, 3, 4), (), "wide", ["HardSigmoid"]),
    ("HardSwish", {}, 14, (2, 3, 4), (), "wide", ["HardSwish"]),
    ("Abs", {}, 13, (2, 3, 4), (), "normal", ["Abs"]),
    ("Log", {}, 13, (2, 3, 4), (), "positive", ["Log"]),
    ("Swish", {}, 24, (2, 3, 4), (), "wide", ["Silu"]),
    ("Gelu", {"approximate": "tanh"}, 20, (2, 3, 4), (), "wide", ["GeluTanh"]),
    ("Swish", {"alpha": 1.702}, 24, (2, 3, 4), (), "wide", ["Mul", "Scale", "Sigmoid"]),
    ("PRelu", {}, 13, (2, 3, 4, 5), [("s", SLOPE_C11)], "normal", ["PRelu"]),
    ("PRelu", {}, 9, (2, 3, 4), [("s", np.array([0.25], np.float32))], "normal", ["PRelu"]),
    ("PRelu", {}, 16, (2, 4), [("s", np.array([0.1, 0.2, -0.5, 1.0], np.float32))], "normal", ["PRelu"]),
    ("LogSoftmax", {}, 13, (2, 3, 4), (), "normal", ["LogSoftmax"]),
    ("LogSoftmax", {"axis": 1}, 13, (2, 3, 4), (), "normal", ["LogSoftmax"]),
    ("LogSoftmax", {}, 11, (2, 3, 4), (), "normal", ["LogSoftmax", "Reshape"]),   # opset < 13: 2-D coercion
    ("LogSoftmax", {"axis": -1}, 11, (2, 3, 4), (), "normal", ["LogSoftmax"]),
    # the existing converters, on activations
    ("Neg", {}, 13, (2, 3, 4), (), "normal", ["Neg"]),
    ("Exp", {}, 13, (2, 3, 4), (), "normal", ["Exp"]),
    ("Sqrt", {}, 13, (2, 3, 4), (), "positive", ["Sqrt"]),
    ("Reciprocal", {}, 13, (2, 3, 4), (), "positive", ["Reciprocal"]),
    ("Erf", {}, 13, (2, 3, 4), (), "normal", ["Erf"]),
    ("Clip", {"min": -0.5, "max": 0.5}, 6, (2, 3, 4), (), "normal", ["Clip"]),
]
# reductions: (op, attributes, opset, axes input or None)
REDUCE_CASES = [
    (op, attrs, opset, axes)
    for op in ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceL1", "ReduceSumSquare")
    for attrs, opset, axes in [({"axes": [1]}, 13, None), ({"axes": [0, -1], "keepdims": 0}, 13, None),
                               ({}, 13, None), ({"keepdims": 0}, 18, [2]), ({"noop_with_empty_axes": 1}, 18, [])]
]


@pytest.mark.parametrize("op,attrs,opset,shape,inits,fill,pcg_ops", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_activation_matches_onnxruntime(op, attrs, opset, shape, inits, fill, pcg_ops):
    inputs = ("x",) + tuple(n for n, _ in inits)
    assert _compare(_model(op, attrs, shape, inputs, inits, opset), fill) == pcg_ops


@pytest.mark.parametrize("op,attrs,opset,axes", REDUCE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(REDUCE_CASES)])
def test_reduction_matches_onnxruntime(op, attrs, opset, axes):
    inputs, inits = ("x",), ()
    if axes is not None:
        inputs, inits = ("x", "axes"), [("axes", np.array(axes, np.int64))]
    got = _compare(_model(op, attrs, (2, 3, 4), inputs, inits, opset), "positive" if op == "ReduceProd" else "normal")
    noop = attrs.get("noop_with_empty_axes")
    if op == "ReduceL1":
        assert got == (["Abs"] if noop else ["Abs", "ReduceSum"])   # sums stay sums: shardable into partial sums
    elif op == "ReduceSumSquare":
        assert got == (["Mul"] if noop else ["Mul", "ReduceSum"])
    elif noop:
        assert got == (["Abs"] if op == "ReduceL2" else [])
    else:
        assert got == [op]


def test_opset1_in_place_hint_is_ignored():
    """Opsets 1-5 carry ``consumed_inputs`` (onnxruntime runs no Elu before opset 6: compare with the formula)."""
    m = _model("Elu", {"alpha": 0.5, "consumed_inputs": [0]}, (2, 3), opset=1)
    g = load_onnx(m)
    x = np.linspace(-3, 3, 6, dtype=np.float32).reshape(2, 3)
    (y,) = evaluate(g, {"x": x})
    np.testing.assert_allclose(y, np.where(x > 0, x, 0.5 * (np.exp(x) - 1)), rtol=1e-6)


def test_clip_bounds_as_inputs_and_pow_div_sub_on_activations():
    """Clip's min/max inputs (opset 11+), Pow/Div/Sub with a computed second operand."""
    m = _model("Clip", {}, (2, 3, 4), ("x", "lo", "hi"), [("lo", np.float32(-0.3)), ("hi", np.float32(0.8))], 13)
    assert _compare(m) == ["Clip"]
    m = _model("Clip", {}, (2, 3, 4), ("x", "", "hi"), [("hi", np.float32(0.8))], 13)
    assert _compare(m) == ["Clip"]
    for op in ("Pow", "Div", "Sub"):
        m = _model(op, {}, (2, 3, 4), ("x", "x2"), (), 13, extra_inputs=[("x2", (3, 4))])
        assert _compare(m, "positive") == [op]


def test_prelu_slope_is_a_weight_that_can_be_sharded_with_the_channels():
    from unity_pcg import ops
    from unity_pcg.shape import ParallelTensorShape as S
    g = load_onnx(_model("PRelu", {}, (2, 3, 4, 5), ("x", "s"), [("s", SLOPE_C11)], 13))
    assert [n.a["shape"] for n in g.sources("Weight")] == [(3, 1, 1)]
    # channels split 3 ways: the slope is split the same way, no copies
    out = ops.infer("PRelu", {}, [S.of((2, 3, 4, 5), (1, 3, 1, 1)), S.of((3, 1, 1), (3, 1, 1))]).outputs[0]
    assert out.degrees == (1, 3, 1, 1) and out.copy_degree == 1


# --- bad input ------------------------------------------------------------------------------------------

def _refused(model) -> str:
    with pytest.raises(UnityError) as e:
        load_onnx(model)
    s = str(e.value)
    assert s and "\n" not in s and "Traceback" not in s
    return s


BAD = [
    # (ONNX op, attributes, opset, input shape, initializers, words the error must contain)
    ("LeakyRelu", {"alpha": "x"}, 13, (2, 3), (), "'alpha'"),
    ("LeakyRelu", {"alpha": [1.0, 2.0]}, 13, (2, 3), (), "'alpha'"),
    ("Elu", {"alpha": float("nan")}, 13, (2, 3), (), "'alpha'"),
    ("Selu", {"gamma": float("inf")}, 13, (2, 3), (), "'gamma'"),
    ("Celu", {"alpha": 0.0}, 12, (2, 3), (), "'alpha'"),
    ("HardSigmoid", {"beta": 3}, 13, (2, 3), (), "'beta'"),
    ("Softplus", {"beta": 2.0}, 13, (2, 3), (), "'beta'"),
    ("HardSwish", {"alpha": 0.2}, 14, (2, 3), (), "'alpha'"),
    ("Elu", {"consumed_inputs": [0]}, 6, (2, 3), (), "'consumed_inputs'"),
    ("Gelu", {"approximate": "fast"}, 20, (2, 3), (), "'approximate'"),
    ("LogSoftmax", {"axis": 3}, 13, (2, 3), (), "axis 3"),
    ("LogSoftmax", {"axis": -4}, 11, (2, 3, 4), (), "axis -4"),
    ("LogSoftmax", {"axis": 1.5}, 13, (2, 3), (), "'axis'"),
    ("LogSoftmax", {}, 13, (), (), "scalar"),
    ("ReduceMax", {"keepdims": 2}, 13, (2, 3), (), "'keepdims'"),
    ("ReduceL2", {"axes": [2]}, 13, (2, 3), (), "axis"),
    ("ReduceMin", {"axes": [0, 7]}, 13, (2, 3), (), "axis"),
    ("ReduceProd", {"axes": "0"}, 13, (2, 3), (), "'axes'"),
    ("ReduceLogSumExp", {"noop_with_empty_axes": 1}, 13, (2, 3), (), "'noop_with_empty_axes'"),
    ("ReduceMax", {"noop_with_empty_axes": 5}, 18, (2, 3), (), "'noop_with_empty_axes'"),
    ("ReduceMax", {"select_last_index": 1}, 18, (2, 3), (), "'select_last_index'"),
    ("ReduceMax", {"axes": [0]}, 18, (2, 3), (), "'axes'"),          # an input from opset 18 on
    ("PRelu", {}, 13, (2, 3), [("s", np.ones((4, 2, 3), np.float32))], "does not broadcast"),   # rank mismatch
    ("PRelu", {}, 13, (2, 3), [("s", np.ones((2,), np.float32))], "does not broadcast"),
    ("PRelu", {}, 13, (2, 3), [("s", np.ones((0,), np.float32))], "does not broadcast"),       # zero-size slope
    ("Abs", {}, 13, (0, 3), (), "zero-size"),
    ("ReduceMax", {"axes": [0]}, 13, (0, 3), (), "zero-size"),
    ("Log", {}, 13, (2, 0), (), "zero-size"),
]


@pytest.mark.parametrize("op,attrs,opset,shape,inits,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_nodes_are_one_line_errors_naming_the_culprit(op, attrs, opset, shape, inits, words):
    inputs = ("x",) + tuple(n for n, _ in inits)
    msg = _refused(_model(op, attrs, shape, inputs, inits, opset))
    assert words in msg, msg


def test_clip_bounds_computed_from_activations_are_refused():
    m = _model("Clip", {}, (2, 3), ("x", "lo"), (), 13, extra_inputs=[("lo", ())])
    assert "computed" in _refused(m)


def test_integer_input_to_a_float_operator_is_refused():
    for op in ("Log", "Softplus", "LogSoftmax", "ReduceL2"):
        assert "float" in _refused(_model(op, {}, (2, 3), dtype=TensorProto.INT64))


def _mutations(rng, op):
    """One mutated node of ``op``: an attribute changed in value or type, an unknown one, or the input's rank /
    a dim set to 0."""
    attrs = {"LeakyRelu": {"alpha": 0.1}, "Elu": {"alpha": 1.0}, "Selu": {"alpha": 1.5, "gamma": 1.1},
             "Celu": {"alpha": 1.0}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5}, "LogSoftmax": {"axis": -1},
             "ReduceMax": {"axes": [1], "keepdims": 1}, "ReduceProd": {"axes": [0], "keepdims": 0},
             "ReduceL1": {"keepdims": 1}, "ReduceLogSumExp": {"axes": [-1]}, "Softplus": {}, "PRelu": {},
             "Mish": {}, "HardSwish": {}, "Swish": {"alpha": 1.0}, "Abs": {}, "Log": {}, "Softsign": {},
             "ReduceMin": {"axes": [0, 1]}, "ReduceL2": {"keepdims": 0}, "ReduceSumSquare": {"axes": [2]},
             "Gelu": {"approximate": "tanh"}}[op]
    attrs = dict(attrs)
    shape = [2, 3, 4]
    k = rng.integers(0, 6)
    if k == 0 and attrs:
        key = sorted(attrs)[rng.integers(0, len(attrs))]
        attrs[key] = [float("nan"), -7, 100, "s", [1, 2, 3], 0.0, 2][rng.integers(0, 7)]
    elif k == 1:
        attrs["bogus"] = 1
    elif k == 2:
        shape = shape[: rng.integers(0, 3)]
    elif k == 3:
        shape[rng.integers(0, 3)] = 0
    elif k == 4 and "axes" in attrs:
        axes = [int(rng.integers(-5, 5)) for _ in range(rng.integers(0, 4))]
        if axes:
            attrs["axes"] = axes
        else:
            del attrs["axes"]
    else:
        shape = shape + [1]
    inputs, inits = ("x",), ()
    if op == "PRelu":
        s = [3, 1] if rng.integers(0, 2) else [int(rng.integers(0, 4))] * int(rng.integers(1, 4))
        inputs, inits = ("x", "s"), [("s", np.full(s, 0.2, np.float32))]
    return _model(op, attrs, tuple(shape), inputs, inits, {"HardSwish": 14, "Mish": 18, "Swish": 24, "Gelu": 20}.get(op, 13))


FUZZ_OPS = ["LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "LogSoftmax", "ReduceMax", "ReduceProd", "ReduceL1",
            "ReduceLogSumExp", "Softplus", "PRelu", "Mish", "HardSwish", "Swish", "Abs", "Log", "Softsign", "ReduceMin",
            "ReduceL2", "ReduceSumSquare", "Gelu"]


def test_fuzzed_nodes_import_and_match_or_fail_in_one_line():
    """Mutated nodes either import to a PCG that onnxruntime agrees with, or fail with a one-line typed error."""
    rng = np.random.default_rng(20261123)
    outcomes = {"ok": 0, "refused": 0}
    for i in range(220):
        op = FUZZ_OPS[i % len(FUZZ_OPS)]
        m = _mutations(rng, op)
        try:
            g = load_onnx(m)
        except UnityError as e:
            assert str(e) and "\n" not in str(e), (op, str(e))
            outcomes["refused"] += 1
            continue
        g.check()
        feeds = _feeds(m, "positive" if op in ("ReduceProd", "Log") else "normal", i)
        ref = _ort(m, feeds)   # what we accept, onnxruntime accepts too
        with np.errstate(all="ignore"):
            (ours,) = evaluate(g, feeds)
        np.testing.assert_allclose(ours, ref[0], rtol=1e-5, atol=1e-6, err_msg=str(m.graph.node[0]))
        outcomes["ok"] += 1
    assert outcomes["ok"] >= 30 and outcomes["refused"] >= 30, outcomes


def test_cli_prints_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.onnx"
    path.write_bytes(_model("ReduceMax", {"keepdims": 3}, (2, 3)).SerializeToString())
    r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "'keepdims'" in err, err


# --- parallel behaviour: hand-picked layouts the importer's models use, and refusals that name the reason --------

def _S(sizes, degrees=None, s=1, c=1, dtype="float64"):
    from unity_pcg.shape import ParallelTensorShape
    return ParallelTensorShape.of(sizes, degrees, s, c, dtype)


def _case(op, attrs, shapes, fill):
    from .op_cases import Case
    return Case(op, attrs, [list(s.sizes) for s in shapes], [s.dtype for s in shapes], fill)


ACCEPTED = [
    # data and channel parallel PRelu: the [C, 1, 1] slope split with the channels, copied across the batch
    ("PRelu", {}, [_S([4, 6, 2, 2], [2, 3, 1, 1]), _S([6, 1, 1], [3, 1, 1], c=2)], ["normal"] * 2),
    ("PRelu", {}, [_S([4, 6], [1, 2], c=2), _S([6], [2], c=2)], ["normal"] * 2),
    ("LogSoftmax", {"axis": -1}, [_S([4, 6], [2, 1], c=2)], ["normal"]),
    ("LogSoftmax", {"axis": 0}, [_S([1, 6], s=2)], ["normal"]),           # a size-1 axis: the constant 0
    ("ReduceMax", {"axes": (1,), "keepdims": False}, [_S([4, 6, 2], [2, 1, 2], c=2)], ["normal"]),
    ("ReduceProd", {"axes": (1,), "keepdims": True}, [_S([4, 1, 3], [2, 1, 1], s=2)], ["normal"]),  # identity
    ("Silu", {}, [_S([4, 6], [2, 3], c=2)], ["normal"]),
    ("HardSwish", {}, [_S([4, 6], [4, 1])], ["int"]),
]


@pytest.mark.parametrize("op,attrs,shapes,fill", ACCEPTED, ids=[f"{a[0]}-{i}" for i, a in enumerate(ACCEPTED)])
def test_hand_picked_parallelizations(op, attrs, shapes, fill):
    from .test_ops_pieces import check_piecewise
    check_piecewise(_case(op, attrs, shapes, fill), shapes, 0)


REFUSED = [
    ("Silu", {}, [_S([4, 6], s=2)], ["normal"], "partial sums"),
    ("GeluTanh", {}, [_S([8], [2], s=2)], ["normal"], "partial sums"),
    ("LeakyRelu", {"alpha": 0.1}, [_S([8], s=2)], ["normal"], "partial sums"),
    ("PRelu", {}, [_S([4, 6], s=2), _S([6], c=2)], ["normal"] * 2, "partial sums"),
    ("PRelu", {}, [_S([4, 6], c=2), _S([6], s=2)], ["normal"] * 2, "partial sums"),
    ("LogSoftmax", {"axis": -1}, [_S([4, 6], [1, 2])], ["normal"], "log-softmax normalizes"),
    ("LogSoftmax", {"axis": -1}, [_S([4, 6], s=2)], ["normal"], "partial sums"),
    ("ReduceMax", {"axes": (1,)}, [_S([4, 6], [1, 2])], ["normal"], "max of pieces"),
    ("ReduceMin", {"axes": ()}, [_S([4, 6], [2, 1])], ["normal"], "min of pieces"),
    ("ReduceProd", {"axes": (0,)}, [_S([4, 6], [2, 1])], ["nonzero"], "product of pieces"),
    ("ReduceL2", {"axes": (1,), "keepdims": False}, [_S([4, 6], [1, 3])], ["normal"], "norm of pieces"),
    ("ReduceL2", {"axes": (0,)}, [_S([1, 6], s=2)], ["normal"], "partial sums"),     # |x| is not linear
    ("ReduceLogSumExp", {"axes": (1,)}, [_S([4, 6], s=2)], ["normal"], "partial sums"),
]


@pytest.mark.parametrize("op,attrs,shapes,fill,words", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_refusals_name_the_reason_and_are_justified(op, attrs, shapes, fill, words):
    from unity_pcg import ops
    from unity_pcg.errors import InvalidParallelization
    from .test_ops_refusals import justified
    with pytest.raises(InvalidParallelization) as e:
        ops.infer(op, attrs, shapes)
    msg = str(e.value)
    assert msg.startswith(op) and words in msg and "\n" not in msg, msg
    assert justified(_case(op, attrs, shapes, fill), shapes) == "differs"


def test_reduce_l1_imports_as_a_sum_that_shards_into_partial_sums():
    """ReduceL1 = ReduceSum(Abs(x)): the reduced dim may be split (partial sums), unlike ReduceL2's."""
    from unity_pcg import ops
    g = load_onnx(_model("ReduceL1", {"axes": [1], "keepdims": 0}, (4, 6)))
    node = next(n for n in g.nodes() if n.op == "ReduceSum")
    out = ops.infer("ReduceSum", node.a, [_S([4, 6], [1, 3], dtype="float32")]).outputs[0]
    assert out.sum_degree == 3 and out.sizes == (4,)


def test_gelu_tanh_and_silu_kernels_match_torch():
    torch = pytest.importorskip("torch")
    from unity_pcg import ops
    x = np.linspace(-6, 6, 101)
    t = torch.from_numpy(x)
    np.testing.assert_allclose(ops.run_logical("GeluTanh", {}, [x])[0],
                               torch.nn.functional.gelu(t, approximate="tanh").numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ops.run_logical("Silu", {}, [x])[0], torch.nn.functional.silu(t).numpy(),
                               rtol=1e-12, atol=1e-12)


# --- the onnx wheel's PyTorch-converted test models (inputs and expected outputs stored as .pb) ------------------

PT_MODELS = [f"pytorch-converted/test_{n}" for n in (
    "ELU", "LeakyReLU", "LeakyReLU_with_negval", "LogSoftmax", "log_softmax_dim3", "log_softmax_lastdim", "SELU",
    "Softplus", "Softsign", "PReLU_1d", "PReLU_1d_multiparam", "PReLU_2d", "PReLU_2d_multiparam", "PReLU_3d",
    "PReLU_3d_multiparam")] + [f"pytorch-operator/test_operator_{n}" for n in ("selu", "clip", "pow", "sqrt", "exp")]


def _onnx_data_dir():
    import os
    import onnx
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


@pytest.mark.parametrize("name", PT_MODELS)
def test_onnx_wheel_pytorch_models_match_their_stored_outputs(name):
    """Opset-6 PRelu included: its slope of C values is one per channel (dim 1), reshaped to [C, 1, ...]."""
    import glob
    import os
    import onnx
    d = os.path.join(_onnx_data_dir(), name)
    if not os.path.isdir(d):
        pytest.skip(f"{name} is not shipped with this onnx wheel")
    m = onnx.load(os.path.join(d, "model.onnx"))
    g = load_onnx(os.path.join(d, "model.onnx"))
    g.check()
    inits = {t.name for t in m.graph.initializer}
    real = [i.name for i in m.graph.input if i.name not in inits]
    sets = sorted(glob.glob(os.path.join(d, "test_data_set_*")))
    assert sets
    for ds in sets:
        load = lambda pat: [numpy_helper.to_array(onnx.load_tensor(f))   # noqa: E731
                            for f in sorted(glob.glob(os.path.join(ds, pat)))]
        with np.errstate(invalid="ignore"):
            ours = evaluate(g, dict(zip(real, load("input_*.pb"))))
        for a, b in zip(ours, load("output_*.pb")):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=name)


# --- the ONNX specification's own node test cases ------------------------------------------------------------

SPEC_OPS = ("LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "HardSigmoid", "HardSwish",
            "Abs", "Log", "LogSoftmax", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
            "ReduceLogSumExp", "ReduceSumSquare", "Swish", "Gelu", "Neg", "Exp", "Sqrt", "Pow", "Div", "Sub",
            "Reciprocal", "Clip", "Erf")
# why the importer may refuse a spec case: element types a PCG cannot hold, bool reductions, empty tensors
SPEC_REFUSALS = ("cannot hold", "unsupported element type", "reduction of a bool tensor", "zero-size")


@pytest.mark.slow
def test_onnx_spec_node_cases_match_their_expected_outputs():
    """Every one-node test case the onnx package ships for these operators (its reference outputs): imported
    with their axes / clip bounds as initializers (a model's constants), evaluated, compared."""
    import copy
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases
        cases = collect_testcases(None)
    checked, refused = 0, 0
    for tc in cases:
        if tc.model is None or "expanded" in tc.name:
            continue
        kinds = {n.op_type for n in tc.model.graph.node}
        if len(kinds) != 1 or not kinds <= set(SPEC_OPS):
            continue
        model, n_feed = tc.model, len(tc.model.graph.input)
        if next(iter(kinds)).startswith("Reduce") or "Clip" in kinds:
            model, n_feed = copy.deepcopy(model), 1
            for vi, v in zip(list(model.graph.input)[1:], tc.data_sets[0][0][1:]):
                model.graph.initializer.append(numpy_helper.from_array(np.asarray(v), vi.name))
            del model.graph.input[1:]
        try:
            g = load_onnx(model)
        except UnityError as e:
            assert any(w in str(e) for w in SPEC_REFUSALS), (tc.name, str(e))
            refused += 1
            continue
        for inputs, outputs in tc.data_sets:
            feeds = {vi.name: v for vi, v in zip(model.graph.input, inputs[:n_feed])}
            with np.errstate(all="ignore"):
                ours = evaluate(g, feeds)
            for a, b in zip(ours, outputs):
                assert np.shape(a) == np.shape(b), tc.name
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=tc.name)
            checked += 1
    assert checked >= 120 and refused <= 40, (checked, refused)


# --- the executor trains them: parallel plans on 2 gloo processes equal one process --------------------------

@pytest.mark.slow   # two gloo processes: about 20 s on the shared machine
def test_executor_trains_elementwise_plans_like_one_process(tmp_path):
    """A chain of the family's operators behind a Linear (PRelu's slope and the Linear's weight trained): data
    parallel, and channels split with PRelu's slope sharded alongside; 5 SGD steps on 2 processes give the
    losses and weights of one process."""
    pytest.importorskip("torch")
    import onnx
    from unity_pcg.search.baselines import data_parallel
    from ..executor import dist_helpers as H
    rng = np.random.default_rng(0)
    N = helper.make_node
    nodes = [N("MatMul", ["x", "w"], ["l"]), N("PRelu", ["l", "s"], ["p"]), N("Elu", ["p"], ["e"], alpha=0.7),
             N("HardSwish", ["e"], ["h"]), N("Softplus", ["h"], ["sp"]), N("Mish", ["sp"], ["mi"]),
             N("ReduceMax", ["mi", "ax"], ["mx"], keepdims=1), N("Sub", ["mi", "mx"], ["a"]),
             N("LogSoftmax", ["a"], ["ls"], axis=-1), N("LeakyRelu", ["ls"], ["y"], alpha=0.2)]
    inits = [numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (6, 1)).astype(np.float32), "s"),
             numpy_helper.from_array(np.array([2], np.int64), "ax")]
    g = helper.make_graph(nodes, "ew", [helper.make_tensor_value_info("x", F, [4, 6, 5])],
                          [helper.make_tensor_value_info("y", F, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    path = str(tmp_path / "ew.onnx")
    onnx.save(m, path)
    pcg = H.load(path)
    plans = [("data parallel", data_parallel(pcg, 2)),
             ("channels split, slope sharded",
              H.rebuild(pcg, {"x": [("Partition", 1, 2)], "s": [("Partition", 0, 2)], "w": [("Replicate", 2)]}))]
    prelu = next(n for n in plans[1][1].nodes() if n.op == "PRelu")
    assert plans[1][1].shapes(prelu.id)[0].degrees == (1, 2, 1)
    got = H.run_cases(2, [H.case(H.make_plan(p, path, 2), path) for _, p in plans])
    ref = H.reference(path, 5)
    assert ref[0][0] != ref[0][-1]
    for (name, _), o in zip(plans, got):
        H.assert_same(ref, o, what=name)
