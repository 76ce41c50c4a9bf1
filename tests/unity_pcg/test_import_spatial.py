"""ONNX import of the spatial operators (issue 10 point 2): 1-D/3-D convolution and pooling, ConvTranspose,
InstanceNormalization, GroupNormalization, Resize/Upsample and Pad.

Each is imported from a small ONNX model and the imported PCG, evaluated with the numpy reference, is compared
with onnxruntime (and, for the onnx wheel's PyTorch-converted test models, with the outputs stored beside
them).  Unsupported attribute values and malformed models give one typed, one-line error naming the
attribute (the CLI exits 2); a seeded mutation fuzz of these models never raises anything else.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.errors import UnityError
from unity_pcg.evaluate import evaluate, random_feeds
from unity_pcg.onnx_import import load_onnx

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import onnxruntime as ort

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ort(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1     # the machine is shared: no spinning thread pool
    so.inter_op_num_threads = 1
    src = model if isinstance(model, (str, os.PathLike)) else model.SerializeToString()
    s = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    return s.run(None, {k: v for k, v in feeds.items() if k in names})


def assert_close(ours, ref, what=""):
    assert len(ours) == len(ref), what
    for k, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what} output {k}: shape {a.shape} != {b.shape}"
        atol = 1e-5 * max(1.0, float(np.max(np.abs(b)))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol, err_msg=f"{what} output {k}")


def import_and_compare(model, ops_expected=(), seed=0):
    g = load_onnx(model)
    g.check()
    got_ops = {n.op for n in g.nodes()}
    for op in ops_expected:
        assert op in got_ops, f"expected a {op} node, got {sorted(got_ops)}"
    feeds = random_feeds(g, seed)
    assert_close(evaluate(g, feeds), run_ort(model, feeds), model.graph.name)
    return g


def model(node_or_nodes, x_shape, inits=(), opset=13, extra_inputs=(), name="m"):
    nodes = node_or_nodes if isinstance(node_or_nodes, list) else [node_or_nodes]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))] + list(extra_inputs)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, name, inputs, [out], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 10)
    return m


def W(name, shape, seed=0, positive=False):
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, shape) if positive else rng.standard_normal(shape)
    return numpy_helper.from_array(v.astype(np.float32), name)


def I64(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def F32(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


N = helper.make_node


# --- the onnx wheel's PyTorch-converted test models (inputs and expected outputs stored as .pb) -------------

PT_MODELS = [
    "pytorch-converted/test_AvgPool1d", "pytorch-converted/test_AvgPool1d_stride",
    "pytorch-converted/test_AvgPool3d", "pytorch-converted/test_AvgPool3d_stride",
    "pytorch-converted/test_AvgPool3d_stride1_pad0_gpu_input",
    "pytorch-converted/test_Conv1d", "pytorch-converted/test_Conv1d_dilated", "pytorch-converted/test_Conv1d_groups",
    "pytorch-converted/test_Conv1d_pad2", "pytorch-converted/test_Conv1d_stride",
    "pytorch-converted/test_Conv3d", "pytorch-converted/test_Conv3d_dilated",
    "pytorch-converted/test_Conv3d_dilated_strided", "pytorch-converted/test_Conv3d_groups",
    "pytorch-converted/test_Conv3d_no_bias", "pytorch-converted/test_Conv3d_stride",
    "pytorch-converted/test_Conv3d_stride_padding",
    "pytorch-converted/test_ConvTranspose2d", "pytorch-converted/test_ConvTranspose2d_no_bias",
    "pytorch-converted/test_MaxPool1d", "pytorch-converted/test_MaxPool1d_stride",
    "pytorch-converted/test_MaxPool1d_stride_padding_dilation",
    "pytorch-converted/test_MaxPool3d", "pytorch-converted/test_MaxPool3d_stride",
    "pytorch-converted/test_MaxPool3d_stride_padding",
    "pytorch-converted/test_ConstantPad2d", "pytorch-converted/test_ReflectionPad2d",
    "pytorch-converted/test_ReplicationPad2d", "pytorch-converted/test_ZeroPad2d",
    "pytorch-operator/test_operator_pad", "pytorch-operator/test_operator_convtranspose",
]


def _pb(path):
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


@pytest.mark.parametrize("name", PT_MODELS, ids=[p.split("/")[1] for p in PT_MODELS])
def test_pytorch_converted_model_matches_stored_outputs(name):
    d = os.path.join(DATA, name)
    if not os.path.isdir(d):
        pytest.skip(f"{name} not in this onnx wheel")
    m = onnx.load(os.path.join(d, "model.onnx"))
    inits = {t.name for t in m.graph.initializer}
    real = [i.name for i in m.graph.input if i.name not in inits]
    ds = os.path.join(d, "test_data_set_0")
    feeds = {k: _pb(os.path.join(ds, f"input_{j}.pb")) for j, k in enumerate(real)}
    want = [_pb(os.path.join(ds, f"output_{j}.pb")) for j in range(len(m.graph.output))]
    g = load_onnx(m)
    g.check()
    assert_close(evaluate(g, feeds), want, name)


# --- hand-built models against onnxruntime ------------------------------------------------------------------

def _conv3d_cases():
    yield "plain", dict(), (2, 4, 5, 6, 4), (3, 4, 3, 3, 2), True
    yield "pads_strides_dil", dict(pads=[1, 0, 1, 0, 1, 1], strides=[2, 1, 2], dilations=[1, 2, 1]), \
        (1, 2, 6, 6, 5), (4, 2, 3, 2, 3), False
    yield "groups", dict(group=2), (1, 4, 4, 4, 4), (6, 2, 1, 3, 3), True
    yield "same_upper", dict(auto_pad="SAME_UPPER", strides=[2, 2, 1]), (1, 2, 5, 4, 3), (2, 2, 3, 3, 3), False


@pytest.mark.parametrize("label,attrs,xs,ws,bias", list(_conv3d_cases()), ids=[c[0] for c in _conv3d_cases()])
def test_conv3d(label, attrs, xs, ws, bias):
    ins = ["x", "w"] + (["b"] if bias else [])
    inits = [W("w", ws)] + ([W("b", (ws[0],), 1)] if bias else [])
    import_and_compare(model(N("Conv", ins, ["y"], **attrs), xs, inits, name=f"conv3d_{label}"), ["Conv3d"])


POOLS = [
    ("max1d", "MaxPool", (2, 3, 9), dict(kernel_shape=[3], strides=[2], pads=[1, 1]), 12, "Pool1d"),
    ("avg1d_ceil", "AveragePool", (2, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 0], ceil_mode=1), 12,
     "Pool1d"),
    ("avg1d_incl", "AveragePool", (1, 2, 7), dict(kernel_shape=[2], strides=[3], pads=[1, 1], ceil_mode=1,
                                                  count_include_pad=1), 12, "Pool1d"),
    ("max1d_dil", "MaxPool", (1, 2, 11), dict(kernel_shape=[3], dilations=[2], pads=[2, 1]), 12, "Pool1d"),
    ("max3d", "MaxPool", (1, 2, 5, 6, 4), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 1], pads=[0, 1, 1, 1, 1, 0]),
     12, "Pool3d"),
    ("max3d_ceil_dil", "MaxPool", (1, 2, 7, 6, 5), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2],
                                                        dilations=[2, 1, 2], ceil_mode=1), 12, "Pool3d"),
    ("avg3d", "AveragePool", (2, 2, 4, 5, 6), dict(kernel_shape=[3, 3, 3], strides=[1, 2, 2],
                                                   pads=[1, 1, 1, 1, 1, 1], count_include_pad=1), 13, "Pool3d"),
    ("avg3d_same", "AveragePool", (1, 2, 5, 5, 5), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 2],
                                                        auto_pad="SAME_UPPER"), 13, "Pool3d"),
    ("max2d_dil", "MaxPool", (1, 2, 7, 8), dict(kernel_shape=[2, 3], dilations=[2, 2], pads=[1, 1, 1, 0]), 12,
     "Pool3d"),
    ("avg2d_dil_19", "AveragePool", (1, 2, 7, 8), dict(kernel_shape=[2, 2], dilations=[2, 1], strides=[1, 2]), 19,
     "Pool3d"),
]


@pytest.mark.parametrize("label,op,xs,attrs,opset,want", POOLS, ids=[p[0] for p in POOLS])
def test_pooling(label, op, xs, attrs, opset, want):
    import_and_compare(model(N(op, ["x"], ["y"], **attrs), xs, opset=opset, name=f"pool_{label}"), [want])


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("xs,want", [((2, 3, 7), "Pool1d"), ((2, 3, 3, 4, 5), "Pool3d")])
def test_global_pooling_1d_3d(op, xs, want):
    import_and_compare(model(N(op, ["x"], ["y"]), xs, name=f"{op}_{len(xs)}"), [want])


CONVT = [
    ("1d", (2, 3, 5), (3, 2, 3), dict(strides=[2]), True, 13),
    ("1d_pads_outpad", (1, 2, 6), (2, 3, 4), dict(strides=[3], pads=[1, 2], output_padding=[2]), False, 13),
    ("2d_groups_dil", (1, 4, 4, 3), (4, 3, 3, 2), dict(group=2, dilations=[2, 1], strides=[1, 2], pads=[1, 0, 0, 1]),
     True, 13),
    ("2d_patch", (2, 3, 4, 4), (3, 2, 2, 2), dict(strides=[2, 2]), True, 13),
    ("2d_same_upper", (1, 2, 3, 4), (2, 2, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER"), False, 13),
    ("2d_same_lower", (1, 2, 3, 4), (2, 2, 4, 3), dict(strides=[2, 3], auto_pad="SAME_LOWER"), False, 13),
    ("2d_output_shape", (1, 2, 3, 3), (2, 1, 3, 3), dict(strides=[2, 2], output_shape=[6, 5]), True, 13),
    ("3d", (1, 2, 2, 3, 2), (2, 2, 2, 3, 2), dict(strides=[2, 1, 2], pads=[0, 1, 0, 0, 1, 1],
                                                  output_padding=[1, 0, 1]), True, 13),
]


@pytest.mark.parametrize("label,xs,ws,attrs,bias,opset", CONVT, ids=[c[0] for c in CONVT])
def test_conv_transpose(label, xs, ws, attrs, bias, opset):
    ins = ["x", "w"] + (["b"] if bias else [])
    g = attrs.get("group", 1)
    inits = [W("w", ws)] + ([W("b", (ws[1] * g,), 1)] if bias else [])
    import_and_compare(model(N("ConvTranspose", ins, ["y"], **attrs), xs, inits, opset=opset,
                             name=f"convt_{label}"), ["ConvTranspose"])


@pytest.mark.parametrize("xs", [(2, 3, 5), (1, 4, 3, 4), (2, 2, 2, 3, 2)])
def test_instance_norm(xs):
    c = xs[1]
    m = model(N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-3), xs,
              [W("s", (c,), 1), W("b", (c,), 2)], name="instnorm")
    import_and_compare(m, ["InstanceNorm"])


@pytest.mark.parametrize("opset,xs,groups", [(18, (2, 6, 4, 3), 3), (18, (2, 4, 5), 4), (21, (2, 6, 3, 2), 2),
                                             (21, (1, 8, 2, 2, 2), 4)])
def test_group_norm(opset, xs, groups):
    shape = (xs[1],) if opset >= 21 else (groups,)
    m = model(N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=groups, epsilon=1e-4), xs,
              [W("s", shape, 1), W("b", shape, 2)], opset=opset, name=f"groupnorm{opset}")
    import_and_compare(m, ["GroupNorm"])


def test_group_norm_opset18_scale_computed_from_an_activation():
    """Opset 18's per-group scale that is not a constant is spread over the channels by Reshape/Expand."""
    nodes = [N("ReduceMean", ["x", "ax023"], ["m"], keepdims=0),
             N("Reshape", ["m", "gshape"], ["mg"]),           # 6 channel means -> (3, 2)
             N("ReduceMean", ["mg", "ax1"], ["s"], keepdims=0),
             N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=3)]
    m = model(nodes, (2, 6, 3, 3), [I64("ax023", [0, 2, 3]), I64("ax1", [1]), I64("gshape", [3, 2]),
                                    W("b", (3,), 2)], opset=18, name="gn_dyn")
    g = load_onnx(m)
    feeds = random_feeds(g, 0)
    assert_close(evaluate(g, feeds), run_ort(m, feeds), "gn_dyn")


def _resize_model(opset, mode, coord, nearest, scales=None, sizes=None, xs=(1, 2, 4, 5), axes=None):
    attrs = {"mode": mode}
    if opset >= 11:
        attrs.update(coordinate_transformation_mode=coord, nearest_mode=nearest)
    if axes is not None:
        attrs["axes"] = axes
    inits, ins = [], ["x"]
    if opset < 11:
        inits.append(F32("scales", scales))
        ins.append("scales")
    else:
        ins += ["roi" if opset < 13 else "", "scales" if scales is not None else "",
                "sizes" if sizes is not None else ""]
        if opset < 13:   # Resize-11's roi is not optional
            inits.append(F32("roi", np.zeros(0)))
        if scales is not None:
            inits.append(F32("scales", scales))
        if sizes is not None:
            inits.append(I64("sizes", sizes))
        while ins[-1] == "":
            ins.pop()
    return model(N("Resize", ins, ["y"], **attrs), xs, inits, opset=opset,
                 name=f"resize{opset}_{mode}_{coord}_{nearest}")


RESIZE = []
for _coord in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"):
    for _mode in ("nearest", "linear"):
        RESIZE.append((13, _mode, _coord, "round_prefer_floor", [1, 1, 2.0, 1.5], None))
        RESIZE.append((13, _mode, _coord, "round_prefer_ceil", None, [1, 2, 3, 7]))
RESIZE += [
    (13, "nearest", "asymmetric", "floor", [1, 1, 3.0, 0.6], None),
    (13, "nearest", "half_pixel", "ceil", None, [1, 2, 9, 2]),
    (13, "nearest", "tf_half_pixel_for_nn", "round_prefer_floor", [1, 1, 2.0, 2.0], None),
    (19, "linear", "half_pixel_symmetric", "round_prefer_floor", [1, 1, 1.7, 0.8], None),
    (11, "linear", "half_pixel", "round_prefer_floor", [1, 1, 0.5, 2.5], None),
    (10, "nearest", "asymmetric", "floor", [1, 1, 2.0, 3.0], None),
    (10, "linear", "asymmetric", "floor", [1, 1, 2.0, 0.5], None),
]


@pytest.mark.parametrize("opset,mode,coord,nearest,scales,sizes", RESIZE,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{r[3]}-{'scales' if r[4] else 'sizes'}" for r in RESIZE])
def test_resize(opset, mode, coord, nearest, scales, sizes):
    import_and_compare(_resize_model(opset, mode, coord, nearest, scales, sizes), ["Resize"])


def test_resize_axes_opset18_and_3d():
    m = _resize_model(18, "linear", "align_corners", "round_prefer_floor", sizes=[7, 3], xs=(1, 2, 3, 4, 5),
                      axes=[2, 4])
    g = import_and_compare(m, ["Resize"])
    assert next(n for n in g.nodes() if n.op == "Resize").a["sizes"] == (1, 2, 7, 4, 3)
    m = _resize_model(18, "nearest", "half_pixel", "round_prefer_floor", scales=[2.0, 2.0, 2.0], xs=(1, 1, 2, 3, 2),
                      axes=[-3, -2, -1])
    import_and_compare(m, ["Resize"])


@pytest.mark.parametrize("opset,mode", [(9, "nearest"), (9, "linear"), (7, "nearest")])
def test_upsample(opset, mode):
    if opset >= 9:
        m = model(N("Upsample", ["x", "scales"], ["y"], mode=mode), (1, 2, 3, 4), [F32("scales", [1, 1, 2, 3])],
                  opset=opset, name="upsample")
    else:
        m = model(N("Upsample", ["x"], ["y"], mode=mode, scales=[1.0, 1.0, 3.0, 2.0]), (1, 2, 3, 4), opset=opset,
                  name="upsample7")
    import_and_compare(m, ["Resize"])


PADS = [
    (13, "constant", [0, 0, 1, 2, 0, 0, 3, 0], 1.5, None),
    (13, "reflect", [0, 1, 2, 1, 0, 0, 1, 3], None, None),
    (13, "edge", [1, 0, 0, 2, 0, 2, 3, 0], None, None),
    (13, "constant", [0, 0, -1, 2, 0, 0, 1, -2], None, None),    # negative pads crop
    (18, "reflect", [2, 1, 1, 2], None, [2, -1]),                # axes input
    (19, "wrap", [0, 0, 1, 2, 0, 0, 2, 1], None, None),
    (11, "edge", [0, 0, 0, 0, 0, 0, 0, 0], None, None),           # nothing to pad: identity
]


@pytest.mark.parametrize("opset,mode,pads,value,axes", PADS, ids=[f"{p[0]}-{p[1]}-{i}" for i, p in enumerate(PADS)])
def test_pad(opset, mode, pads, value, axes):
    ins = ["x", "pads"]
    inits = [I64("pads", pads)]
    if value is not None or axes is not None:
        ins.append("value" if value is not None else "")
        if value is not None:
            inits.append(F32("value", value))
    if axes is not None:
        ins.append("axes")
        inits.append(I64("axes", axes))
    m = model(N("Pad", ins, ["y"], mode=mode), (2, 3, 4, 5), inits, opset=opset, name=f"pad_{mode}")
    g = import_and_compare(m, ["Pad"] if any(p > 0 for p in pads) else [])
    if not any(pads):
        assert not any(n.op == "Pad" for n in g.nodes())


def test_pad_opset2_attributes():
    m = model(N("Pad", ["x"], ["y"], mode="constant", pads=[0, 1, 2, 0, 1, 0], value=-2.0), (2, 3, 4), opset=2,
              name="pad2")
    m.ir_version = 3
    g = load_onnx(m)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    (y,) = evaluate(g, {"x": x})
    np.testing.assert_array_equal(y, np.pad(x, ((0, 0), (1, 1), (2, 0)), constant_values=-2.0))


def test_spatial_model_runs_data_parallel_piecewise():
    """A small 3-D U-Net-like chain imports, goes data parallel over 2 devices, and evaluates piecewise to the
    same values as the logical graph (the operators' labels are sound end to end)."""
    from unity_pcg.search.baselines import data_parallel
    nodes = [N("Conv", ["x", "w1"], ["c1"], pads=[1] * 6),
             N("InstanceNormalization", ["c1", "s", "b"], ["n1"]),
             N("MaxPool", ["n1"], ["p1"], kernel_shape=[2, 2, 2], strides=[2, 2, 2]),
             N("ConvTranspose", ["p1", "w2"], ["u1"], strides=[2, 2, 2]),
             N("Pad", ["u1", "pads"], ["pd"], mode="edge"),
             N("Resize", ["pd", "", "scales"], ["y"], mode="linear")]
    inits = [W("w1", (4, 2, 3, 3, 3)), W("s", (4,), 1), W("b", (4,), 2), W("w2", (4, 3, 2, 2, 2), 3),
             I64("pads", [0, 0, 1, 0, 0, 0, 0, 1, 0, 0]), F32("scales", [1, 1, 1, 2, 0.5])]
    m = model(nodes, (4, 2, 4, 4, 4), inits, name="unet3d")
    g = import_and_compare(m, ["Conv3d", "InstanceNorm", "Pool3d", "ConvTranspose", "Pad", "Resize"])
    dp = data_parallel(g, 2)
    feeds = random_feeds(g, 1)
    want = evaluate(g, feeds)
    got = evaluate(dp, feeds, mode="pieces", rng=np.random.default_rng(0))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


# --- refusals: typed, one line, naming the attribute --------------------------------------------------------

BAD = [
    ("resize cubic", _resize_model(13, "cubic", "half_pixel", "round_prefer_floor", [1, 1, 2, 2]), "mode"),
    ("resize crop", _resize_model(13, "linear", "tf_crop_and_resize", "round_prefer_floor", [1, 1, 2, 2]),
     "coordinate_transformation_mode"),
    ("resize nearest_mode", _resize_model(13, "nearest", "asymmetric", "round_half_even", [1, 1, 2, 2]),
     "nearest_mode"),
    ("resize antialias", model(N("Resize", ["x", "", "scales"], ["y"], mode="linear", antialias=1), (1, 1, 4, 4),
                               [F32("scales", [1, 1, 0.5, 0.5])], opset=18), "antialias"),
    ("resize aspect", model(N("Resize", ["x", "", "", "sizes"], ["y"], keep_aspect_ratio_policy="not_larger"),
                            (1, 1, 4, 4), [I64("sizes", [1, 1, 2, 3])], opset=18), "keep_aspect_ratio_policy"),
    ("resize both", model(N("Resize", ["x", "", "scales", "sizes"], ["y"]), (1, 1, 4, 4),
                          [F32("scales", [1, 1, 2, 2]), I64("sizes", [1, 1, 8, 8])]), "exactly one"),
    ("resize zero scale", _resize_model(13, "nearest", "asymmetric", "floor", [1, 1, 0.0, 2]), "scales"),
    ("resize rank", _resize_model(13, "nearest", "asymmetric", "floor", [1, 2, 2]), "scales"),
    ("pad mode", model(N("Pad", ["x", "pads"], ["y"], mode="symmetric"), (1, 2, 3), [I64("pads", [0, 0, 1, 0, 0, 1])]),
     "mode"),
    ("pad reflect too wide", model(N("Pad", ["x", "pads"], ["y"], mode="reflect"), (1, 2, 3),
                                   [I64("pads", [0, 0, 3, 0, 0, 0])]), "reflect"),
    ("pad count", model(N("Pad", ["x", "pads"], ["y"]), (1, 2, 3), [I64("pads", [1, 1])]), "pads"),
    ("pad computed pads", model(N("Pad", ["x", "p"], ["y"]), (1, 2, 3), (),
                                extra_inputs=[helper.make_tensor_value_info("p", TensorProto.INT64, [6])]),
     "non-constant"),
    ("convT output_shape", model(N("ConvTranspose", ["x", "w"], ["y"], output_shape=[20, 20]), (1, 2, 3, 3),
                                 [W("w", (2, 2, 3, 3))]), "output_shape"),
    ("convT rank", model(N("ConvTranspose", ["x", "w"], ["y"]), (1, 2, 3, 3), [W("w", (2, 2, 3))]), "do not fit"),
    ("convT 4-D", model(N("ConvTranspose", ["x", "w"], ["y"]), (1, 2, 2, 2, 2, 2), [W("w", (2, 2, 1, 1, 1, 1))]),
     "4-D"),
    ("conv3d rank", model(N("Conv", ["x", "w"], ["y"]), (1, 2, 3, 3, 3), [W("w", (2, 2, 3, 3))]), "do not fit"),
    ("conv3d groups", model(N("Conv", ["x", "w"], ["y"], group=3), (1, 4, 3, 3, 3), [W("w", (3, 2, 1, 1, 1))]),
     "groups"),
    ("pool 4-D", model(N("MaxPool", ["x"], ["y"], kernel_shape=[1, 1, 1, 1]), (1, 1, 2, 2, 2, 2)), "4-D pooling"),
    ("pool window", model(N("MaxPool", ["x"], ["y"], kernel_shape=[5]), (1, 1, 3)), "larger"),
    ("pool pads", model(N("AveragePool", ["x"], ["y"], kernel_shape=[2, 2, 2], pads=[2, 0, 0, 0, 0, 0]),
                        (1, 1, 4, 4, 4)), "padding"),
    ("pool kernel", model(N("MaxPool", ["x"], ["y"], kernel_shape=[2, 2]), (1, 1, 4)), "kernel_shape"),
    ("groupnorm groups", model(N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=4), (1, 6, 2),
                               [W("s", (4,)), W("b", (4,))], opset=18), "num_groups"),
    ("groupnorm shape", model(N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2), (1, 6, 2),
                              [W("s", (6,)), W("b", (6,))], opset=18), "expected [2]"),
    ("instnorm scale", model(N("InstanceNormalization", ["x", "s", "b"], ["y"]), (1, 3, 4),
                             [W("s", (2,)), W("b", (3,))]), "input 1"),
    ("instnorm rank", model(N("InstanceNormalization", ["x", "s", "b"], ["y"]), (2, 3),
                            [W("s", (3,)), W("b", (3,))]), "rank"),
    ("zero-size resize", model(N("Resize", ["x", "", "", "sizes"], ["y"]), (1, 1, 0, 4),
                               [I64("sizes", [1, 1, 2, 8])]), ""),
    ("zero-size conv3d", model(N("Conv", ["x", "w"], ["y"]), (1, 2, 0, 3, 3), [W("w", (2, 2, 1, 1, 1))]), ""),
]


@pytest.mark.parametrize("label,m,words", BAD, ids=[b[0] for b in BAD])
def test_unsupported_or_bad_attributes_give_one_typed_line(label, m, words):
    with pytest.raises(UnityError) as e:
        load_onnx(m)
    msg = str(e.value)
    assert "\n" not in msg and words in msg, msg


def test_cli_exits_2_naming_the_attribute(tmp_path):
    p = tmp_path / "cubic.onnx"
    onnx.save(_resize_model(13, "cubic", "half_pixel", "round_prefer_floor", [1, 1, 2, 2]), str(p))
    r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", str(p)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "mode='cubic'" in (r.stdout + r.stderr)


# --- fuzz: mutated spatial models import or fail typed, never anything else ---------------------------------

def _fuzz_bases():
    return [m for _, m, _ in BAD[:3]] + [
        model(N("Conv", ["x", "w", "b"], ["y"], pads=[1] * 6, strides=[1, 2, 1]), (1, 2, 4, 4, 4),
              [W("w", (3, 2, 3, 3, 3)), W("b", (3,))]),
        model(N("MaxPool", ["x"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1], dilations=[1]), (1, 2, 8),
              opset=12),
        model(N("AveragePool", ["x"], ["y"], kernel_shape=[2, 2, 2], ceil_mode=1, count_include_pad=1),
              (1, 2, 5, 4, 3)),
        model(N("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 0],
                group=1), (1, 2, 3, 3), [W("w", (2, 3, 3, 2))]),
        model(N("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5), (1, 3, 4, 2),
              [W("s", (3,)), W("b", (3,))]),
        model(N("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2, epsilon=1e-5), (1, 4, 3),
              [W("s", (2,)), W("b", (2,))], opset=18),
        _resize_model(13, "linear", "half_pixel", "round_prefer_floor", [1, 1, 2.0, 1.5]),
        _resize_model(13, "nearest", "align_corners", "floor", None, [1, 2, 3, 7]),
        model(N("Pad", ["x", "pads", "v"], ["y"], mode="constant"), (1, 2, 3),
              [I64("pads", [0, 1, 1, 0, 0, 2]), F32("v", 2.0)]),
    ]


_ATTR_VALUES = [-3, -1, 0, 1, 2, 7, 1000, 0.5, b"", b"SAME_UPPER", b"bogus", [0], [-1, 2], [1, 1, 1, 1, 1, 1, 1],
                [0, 0, 0, 0, 0, 0], [2, 2, 2]]


def _mutate(m: onnx.ModelProto, r: random.Random) -> onnx.ModelProto:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    node = m.graph.node[0]
    for _ in range(r.randint(1, 3)):
        pick = r.randint(0, 5)
        if pick <= 2 and node.attribute:            # change an attribute's value (maybe its type)
            a = node.attribute[r.randrange(len(node.attribute))]
            name = a.name
            node.attribute.remove(a)
            node.attribute.append(helper.make_attribute(name, r.choice(_ATTR_VALUES)))
        elif pick == 3:                              # add a known attribute of these operators
            name = r.choice(["auto_pad", "output_shape", "dilations", "ceil_mode", "group", "axes", "antialias",
                             "coordinate_transformation_mode", "mode", "storage_order", "output_padding"])
            if all(a.name != name for a in node.attribute):
                node.attribute.append(helper.make_attribute(name, r.choice(_ATTR_VALUES)))
        elif pick == 4:                              # change the input's shape (rank, zero-size dims)
            dims = m.graph.input[0].type.tensor_type.shape.dim
            if dims and r.random() < 0.5:
                dims[r.randrange(len(dims))].dim_value = r.choice([0, 1, 2, 5])
            elif r.random() < 0.5 and len(dims) > 1:
                del dims[len(dims) - 1]
            else:
                dims.add().dim_value = r.choice([1, 2])
        elif m.graph.initializer:                    # change an initializer's shape or values
            t = m.graph.initializer[r.randrange(len(m.graph.initializer))]
            v = numpy_helper.to_array(t)
            if r.random() < 0.5 and v.size:
                v = v.reshape(-1)[: r.randint(0, v.size)]
            else:
                v = v * r.choice([0, -1, 1e9])
            t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(v), t.name))
    return m


def test_fuzzed_spatial_models_fail_typed_or_import():
    r = random.Random(20261123)
    bases = _fuzz_bases()
    outcomes = {"imported": 0, "refused": 0}
    for k in range(240):
        m = _mutate(bases[k % len(bases)], r)
        try:
            g = load_onnx(m)
        except UnityError as e:
            assert "\n" not in str(e), str(e)
            outcomes["refused"] += 1
            continue
        g.check()
        outcomes["imported"] += 1
        if sum(s.numel for n in g.nodes() for s in g.shapes(n.id)) > 1 << 20:
            continue    # a legal but huge model (a mutated stride of 1000): the import is what is tested
        feeds = random_feeds(g, 0)
        with np.errstate(all="ignore"):
            out = evaluate(g, feeds)
        assert [o.shape for o in out] == [g.shape(r_).sizes for r_ in g.outputs]
    assert outcomes["refused"] >= 24 and outcomes["imported"] >= 24, outcomes


# --- the search prices them ----------------------------------------------------------------------------------

def test_spatial_model_is_priced_data_parallel(tmp_path):
    """The cost model knows the new operators' classes and what they save for backward, and data parallelism
    of a spatial model is built without fallbacks: its only communication is the ring all-reduce of the
    weights, 2 (p - 1) N elements."""
    from unity_pcg.commands.simulate_cmd import simulate
    from unity_pcg.search.cost import op_class
    from unity_pcg.search.memory import SAVES_INPUTS
    from unity_pcg.ops import spatial  # noqa: F401
    assert [op_class(o) for o in ("Conv3d", "ConvTranspose", "Pool1d", "Pool3d", "InstanceNorm", "GroupNorm")] == \
        ["conv", "conv", "pool", "pool", "norm", "norm"]
    assert {"Conv3d", "ConvTranspose", "Pool1d", "Pool3d", "InstanceNorm", "GroupNorm", "Resize", "Pad"} \
        <= set(SAVES_INPUTS)
    nodes = [N("Conv", ["x", "w1"], ["c1"], pads=[1] * 6),
             N("GroupNormalization", ["c1", "s", "b"], ["n1"], num_groups=2),
             N("AveragePool", ["n1"], ["p1"], kernel_shape=[2, 2, 2], strides=[2, 2, 2]),
             N("ConvTranspose", ["p1", "w2"], ["y"], strides=[2, 2, 2])]
    inits = [W("w1", (4, 2, 3, 3, 3)), W("s", (4,), 1), W("b", (4,), 2), W("w2", (4, 3, 2, 2, 2), 3)]
    p = tmp_path / "m.onnx"
    onnx.save(model(nodes, (8, 2, 4, 4, 4), inits, opset=21), str(p))
    r = simulate(str(p), "summit:1x4", "dp")
    n_params = 4 * 2 * 27 + 4 + 4 + 4 * 3 * 8
    assert r["feasible"] and not r["fallbacks"]
    assert r["comm_elements"] == 2 * 3 * n_params


# --- hand-picked parallelizations: what must stay shardable, and named refusals -----------------------------

def _S(sizes, degrees=None, s=1, c=1):
    from unity_pcg.shape import ParallelTensorShape
    return ParallelTensorShape.of(sizes, degrees, s, c, "float64")


ACCEPTED = [
    # patchify 3-D convolution: spatial pieces map to pieces; channel (contraction) split gives partial sums
    ("Conv3d", {"stride": (2, 2, 2)}, [_S([1, 2, 4, 4, 4], [1, 1, 2, 2, 1]), _S([3, 2, 2, 2, 2], c=4)]),
    ("Conv3d", {}, [_S([2, 4, 3, 3, 3], [1, 2, 1, 1, 1]), _S([5, 4, 1, 1, 1], [1, 2, 1, 1, 1])]),
    ("Conv3d", {"groups": 2}, [_S([2, 4, 3, 3, 3], [2, 2, 1, 1, 1]), _S([6, 2, 1, 1, 1], [2, 1, 1, 1, 1], c=2)]),
    ("Pool3d", {"kind": "max", "kernel": (2, 2, 2), "stride": (2, 2, 2)}, [_S([1, 2, 4, 4, 6], [1, 2, 2, 1, 3])]),
    ("Pool1d", {"kind": "avg", "kernel": (3,), "stride": (3,)}, [_S([2, 2, 12], [1, 1, 2], s=2)]),
    ("Pool1d", {"kind": "avg", "global_pool": True}, [_S([4, 2, 5], [2, 2, 1], s=2)]),
    # transposed convolution whose spans tile the output: spatial split; C_in split: partial sums
    ("ConvTranspose", {"stride": (2, 2)}, [_S([1, 2, 4, 6], [1, 1, 2, 3]), _S([2, 3, 2, 2], c=6)]),
    ("ConvTranspose", {"stride": (2,), "padding": (1, 0)}, [_S([2, 4, 5], [1, 2, 1]), _S([4, 3, 3], [2, 1, 1])]),
    ("ConvTranspose", {"groups": 2}, [_S([1, 4, 3], [1, 2, 1]), _S([4, 3, 2], [2, 1, 1]), _S([6], [2])]),
    ("InstanceNorm", {}, [_S([4, 6, 3, 2], [2, 3, 1, 1]), _S([6], [3], c=2), _S([6], [3], c=2)]),
    ("GroupNorm", {"groups": 4}, [_S([2, 8, 3], [2, 2, 1]), _S([8], [2], c=2), _S([8], [2], c=2)]),
    # Resize is a fixed linear map: partial sums pass, unresized dims shard
    ("Resize", {"sizes": (4, 2, 6), "scales": (1.0, 1.0, 2.0), "mode": "linear"}, [_S([4, 2, 3], [2, 2, 1], s=2)]),
    ("Pad", {"pads": (0, 1, 0, 2), "mode": "reflect"}, [_S([4, 3], [4, 1], s=2)]),
    ("Pad", {"pads": (0, 0, 1, 0, 0, 1), "value": 0.0}, [_S([2, 4, 3], [2, 2, 1], s=3)]),
]


@pytest.mark.parametrize("op,attrs,shapes", ACCEPTED, ids=[f"{a[0]}-{i}" for i, a in enumerate(ACCEPTED)])
def test_hand_picked_parallelizations_are_accepted_and_exact(op, attrs, shapes):
    from .op_cases import Case
    from .test_ops_pieces import check_piecewise
    case = Case(op, attrs, [list(s.sizes) for s in shapes], ["float64"] * len(shapes), ["normal"] * len(shapes))
    check_piecewise(case, shapes, 0)


REFUSED = [
    ("Conv3d", {"padding": (1,) * 6}, [_S([1, 2, 4, 4, 4], [1, 1, 2, 1, 1]), _S([3, 2, 3, 3, 3], c=2)], "window",
     "cannot-run"),
    ("Conv3d", {}, [_S([2, 4, 3, 3, 3], [1, 2, 1, 1, 1]), _S([5, 4, 1, 1, 1], [1, 2, 1, 1, 1]), _S([5], c=2)],
     "bias", "differs"),
    ("Pool3d", {"kind": "avg", "kernel": (3, 1, 1), "stride": (1, 1, 1)}, [_S([1, 1, 4, 2, 2], [1, 1, 2, 1, 1])],
     "overlap", "cannot-run"),
    ("Pool1d", {"kind": "max", "kernel": (2,), "stride": (2,)}, [_S([1, 2, 4], s=2)], "partial sums", "differs"),
    ("ConvTranspose", {"stride": (1,)}, [_S([1, 2, 4], [1, 1, 2]), _S([2, 3, 2], c=2)], "transposed", "cannot-run"),
    ("InstanceNorm", {}, [_S([2, 2, 6], [1, 1, 2]), _S([2], c=2), _S([2], c=2)], "instance norm", "differs"),
    ("GroupNorm", {"groups": 2}, [_S([2, 4, 3], [1, 4, 1]), _S([4], [4]), _S([4], [4])], "groups=2",
     "cannot-infer"),
    ("GroupNorm", {"groups": 2}, [_S([2, 4, 6], [1, 1, 2]), _S([4], c=2), _S([4], c=2)], "group norm", "differs"),
    ("Resize", {"sizes": (2, 8), "scales": (1.0, 2.0)}, [_S([2, 4], [1, 2])], "interpolates", "differs"),
    ("Pad", {"pads": (1, 0, 0, 0), "mode": "edge"}, [_S([4, 3], [2, 1])], "padded", "cannot-run"),
    ("Pad", {"pads": (0, 1, 0, 1), "value": 1.5}, [_S([4, 3], s=2)], "partial sums", "differs"),
]


@pytest.mark.parametrize("op,attrs,shapes,words,expect", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_named_refusals_are_justified(op, attrs, shapes, words, expect):
    from unity_pcg import ops
    from unity_pcg.errors import InvalidParallelization
    from .op_cases import Case
    from .test_ops_refusals import justified
    with pytest.raises(InvalidParallelization) as e:
        ops.infer(op, attrs, shapes)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(op) and words in msg, msg
    case = Case(op, attrs, [list(s.sizes) for s in shapes], ["float64"] * len(shapes), ["normal"] * len(shapes))
    assert justified(case, shapes) == expect


# --- PyTorch exports (both exporters) -----------------------------------------------------------------------

def _torch_modules():
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional

    class Spatial2d(nn.Module):
        """GroupNorm, InstanceNorm, ConvTranspose, reflect/replicate/constant pads, nearest/bilinear resizes."""

        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 8, 3, padding=1)
            self.gn = nn.GroupNorm(4, 8)
            self.inn = nn.InstanceNorm2d(8, affine=True)
            self.up = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
            self.pad = nn.ReflectionPad2d((1, 2, 0, 1))
            self.rep = nn.ReplicationPad2d(1)

        def forward(self, x):
            y = self.up(F.relu(self.inn(self.gn(self.c(x)))))
            y = self.rep(self.pad(y))
            a = F.interpolate(y, scale_factor=2, mode="nearest")
            b = F.interpolate(y, size=(7, 9), mode="bilinear", align_corners=False)
            c = F.interpolate(y, scale_factor=1.5, mode="bilinear", align_corners=True)
            d = F.pad(y, (1, 1, 2, 0), value=0.5)
            return a.mean(dim=(2, 3)) + b.mean(dim=(2, 3)) + c.mean(dim=(2, 3)) + d.mean(dim=(2, 3)), b

    class Spatial13(nn.Module):
        """1-D and 3-D convolutions, pools (ceil_mode, padding), transposed convolutions, instance norm,
        trilinear and linear upsampling, adaptive pools."""

        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv1d(2, 4, 3, padding=1)
            self.p1 = nn.MaxPool1d(3, stride=2, padding=1)
            self.a1 = nn.AvgPool1d(2, ceil_mode=True)
            self.c3 = nn.Conv3d(2, 4, 3, padding=(1, 0, 1), stride=(1, 2, 1))
            self.p3 = nn.MaxPool3d(2, ceil_mode=True)
            self.a3 = nn.AvgPool3d((1, 2, 2), count_include_pad=False, padding=(0, 1, 1))
            self.t3 = nn.ConvTranspose3d(4, 2, 2, stride=2)
            self.t1 = nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1)
            self.in3 = nn.InstanceNorm3d(2, affine=True)

        def forward(self, x1, x3):
            y1 = self.t1(self.a1(self.p1(self.c1(x1))))
            y3 = self.in3(self.t3(self.a3(self.p3(self.c3(x3)))))
            z = F.interpolate(y3, scale_factor=2, mode="trilinear")
            g = F.adaptive_avg_pool3d(z, 1).flatten(1) + F.adaptive_max_pool1d(y1, 1).flatten(1)[:, :2]
            return g, y1, F.interpolate(y1, scale_factor=2, mode="linear")

    torch.manual_seed(0)
    return {"spatial2d": (Spatial2d(), (torch.randn(2, 3, 6, 5),), {"ConvTranspose", "InstanceNorm", "Pad", "Resize"}),
            "spatial1d3d": (Spatial13(), (torch.randn(2, 2, 9), torch.randn(2, 2, 5, 8, 6)),
                            {"Conv3d", "Pool1d", "Pool3d", "ConvTranspose", "InstanceNorm", "Resize"})}


@pytest.mark.parametrize("exporter", ["legacy", pytest.param("dynamo", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["spatial2d", "spatial1d3d"])
def test_torch_export_matches_onnxruntime_and_torch(tmp_path, name, exporter):
    torch = pytest.importorskip("torch")
    mod, args, want_ops = _torch_modules()[name]
    mod.eval()
    path = str(tmp_path / f"{name}.onnx")
    names = [f"in{i}" for i in range(len(args))]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(mod, args, path, dynamo=False, opset_version=17, input_names=names)
        else:
            torch.onnx.export(mod, args, path, dynamo=True, input_names=names, external_data=False)
    g = load_onnx(path)
    g.check()
    assert want_ops <= {n.op for n in g.nodes()}, sorted({n.op for n in g.nodes()})
    feeds = random_feeds(g, 0)
    ours = evaluate(g, feeds)
    assert_close(ours, run_ort(path, feeds), f"{name} {exporter}")
    with torch.no_grad():
        ref = mod(*[torch.as_tensor(feeds[n]) for n in names])
    assert_close(ours, [r.numpy() for r in ref], f"{name} {exporter} vs torch")
    # --batch: the exporters bake the batch into Resize's sizes (dynamo: a literal); the override keeps it exact
    g5 = load_onnx(path, batch=5)
    feeds = random_feeds(g5, 1)
    with torch.no_grad():
        ref = mod(*[torch.as_tensor(feeds[n]) for n in names])
    assert_close(evaluate(g5, feeds), [r.numpy() for r in ref], f"{name} {exporter} at batch 5 vs torch")


# --- the executor trains them: parallel plans on 2 gloo processes equal one process -------------------------

def _save(tmp_path, name, m):
    p = str(tmp_path / f"{name}.onnx")
    onnx.save(m, p)
    return p


def test_executor_trains_spatial_plans_like_one_process(tmp_path):
    """Spatially split plans (the depth dim partitioned through a pointwise Conv3d, a 2x2x2 Pool3d, a patch
    ConvTranspose, a Pad and a Resize of other dims), a channel split ConvTranspose that leaves partial sums,
    and data parallelism over the normalizations and 1-D pools: 5 SGD steps on 2 processes give the losses and
    weights of one process."""
    pytest.importorskip("torch")
    from unity_pcg.search.baselines import data_parallel
    from ..executor import dist_helpers as H
    spatial = _save(tmp_path, "spatial", model(
        [N("Conv", ["x", "w1", "b1"], ["c"]),
         N("MaxPool", ["c"], ["p"], kernel_shape=[2, 2, 2], strides=[2, 2, 2]),
         N("ConvTranspose", ["p", "w2"], ["t"], strides=[2, 2, 2]),
         N("Pad", ["t", "pads"], ["pd"], mode="reflect"),
         N("Resize", ["pd", "", "scales"], ["y"], mode="linear")],
        (2, 2, 4, 4, 4), [W("w1", (3, 2, 1, 1, 1)), W("b1", (3,), 1), W("w2", (3, 2, 2, 2, 2), 2),
                          I64("pads", [0, 0, 0, 1, 0, 0, 0, 0, 2, 0]), F32("scales", [1, 1, 1, 1, 1.5])]))
    channels = _save(tmp_path, "channels", model(
        [N("ConvTranspose", ["x", "w"], ["t"], strides=[2, 1], pads=[1, 0, 0, 1]),
         N("Relu", ["t"], ["y"])], (2, 4, 3, 3), [W("w", (4, 3, 3, 2), 3)]))
    norms = _save(tmp_path, "norms", model(
        [N("Conv", ["x", "w"], ["c"], pads=[1, 1]),
         N("GroupNormalization", ["c", "gs", "gb"], ["g"], num_groups=2),
         N("InstanceNormalization", ["g", "s", "b"], ["n"]),
         N("AveragePool", ["n"], ["a"], kernel_shape=[3], strides=[2], pads=[1, 1], count_include_pad=1),
         N("Upsample", ["a", "us"], ["y"], mode="nearest")],
        (4, 2, 6), [W("w", (4, 2, 3)), W("gs", (4,), 4, positive=True), W("gb", (4,), 5),
                    W("s", (4,), 6, positive=True), W("b", (4,), 7), F32("us", [1, 1, 2])], opset=21))
    gs, gc, gn = H.load(spatial), H.load(channels), H.load(norms)
    weights = lambda g: {n.a["name"]: [("Replicate", 2)] for n in g.sources("Weight")}   # noqa: E731
    plans = [
        ("depth split", H.rebuild(gs, {"x": [("Partition", 2, 2)], **weights(gs)}), spatial),
        ("input-channel split, partial sums", H.rebuild(gc, {"x": [("Partition", 1, 2)], "w": [("Partition", 0, 2)]},
                                                        after={2: [("Reduce", 2)]}), channels),
        ("data parallel over norms and 1-D pools", data_parallel(gn, 2), norms),
    ]
    for name, g, _ in plans:
        assert any(n.op in ("Partition", "Reduce") for n in g.nodes()), name
    got = H.run_cases(2, [H.case(H.make_plan(g, p, 2), p) for _, g, p in plans])
    for (name, _, p), o in zip(plans, got):
        ref = H.reference(p, 5)
        assert ref[0][0] != ref[0][-1]
        H.assert_same(ref, o, what=name)
