"""Every compute operator, many valid parallelizations: the piecewise result's logical value equals the
logical result (DESIGN "Piece semantics"), and all copies agree."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from unity_pcg import ops
from unity_pcg import pieces as P
from unity_pcg.shape import ParallelTensorShape

from unity_pcg.errors import InvalidParallelization

from .op_cases import GENERATORS, Case, HypDrawer, RandDrawer, accepts, draw_parallel, gen_conv

OPS = sorted(GENERATORS)


def test_every_compute_op_has_a_generator():
    missing = sorted(set(ops.COMPUTE_OPS) - set(GENERATORS))
    assert not missing, f"compute operators without a test-case generator: {missing}"


def _tol(*dtypes):
    """Tight for float64 (and exact ints); float32 anywhere on the way loosens it."""
    low = any(np.dtype(dt).kind == "f" and np.dtype(dt).itemsize < 8 for dt in dtypes)
    return (1e-5, 1e-5) if low else (1e-9, 1e-9)


def check_piecewise(case, shapes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = case.values(rng)
    want = ops.run_logical(case.op, case.attrs, xs)
    inf = ops.infer(case.op, case.attrs, shapes)
    assert len(want) == len(inf.outputs)
    for y, s in zip(want, inf.outputs):
        assert tuple(y.shape) == s.sizes, f"{case.op}: logical kernel gives {y.shape}, inference says {s}"
        assert np.dtype(y.dtype) == np.dtype(s.dtype if s.dtype != "bfloat16" else "float32")
    pieces = [P.split(x, s, rng) for x, s in zip(xs, shapes)]
    outs, out_shapes = ops.run_pieces(case.op, case.attrs, pieces, shapes)
    assert tuple(out_shapes) == tuple(inf.outputs)
    for k, (p, s, y) in enumerate(zip(outs, out_shapes, want)):
        assert p.shape == s.grid + s.piece_shape, f"output {k}: pieces {p.shape} vs {s}"
        rtol, atol = _tol(y.dtype, *(x.dtype for x in xs))
        assert P.copies_agree(p, rtol=rtol, atol=atol), f"output {k}: copies disagree"
        got = P.join(p, s)
        if y.dtype.kind in "iub":
            np.testing.assert_array_equal(got, y)
        else:
            np.testing.assert_allclose(got, y, rtol=rtol, atol=atol, err_msg=f"{case.op} output {k} on {shapes}")


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_piecewise_equals_logical(op, data):
    d = HypDrawer(data)
    case = GENERATORS[op](d)
    par = draw_parallel(d, case)
    assume(accepts(case, par.shapes))
    pc = max((s.piece_count for s in par.shapes), default=1)
    event(f"max pieces {'1' if pc == 1 else '2-4' if pc <= 4 else '>4'}")
    event(f"partial sums: {any(s.sum_degree > 1 for s in par.shapes)}")
    check_piecewise(case, par.shapes, data.draw(st.integers(0, 2 ** 32 - 1)))


@pytest.mark.parametrize("op", OPS)
def test_accepted_parallelizations_are_plentiful(op):
    """The label-driven drawer mostly yields parallelizations the operator accepts, and many of them
    split work (more than one piece), use partial sums where the op is linear, and replicas."""
    n, accepted, split, summed, copied = 120, 0, 0, 0, 0
    for seed in range(n):
        d = RandDrawer(seed)
        case = GENERATORS[op](d)
        par = draw_parallel(d, case)
        if not accepts(case, par.shapes):
            continue
        accepted += 1
        split += any(s.shard_degree > 1 for s in par.shapes)
        summed += any(s.sum_degree > 1 for s in par.shapes)
        copied += any(s.copy_degree > 1 for s in par.shapes)
        if seed < 30:   # and the first ones really evaluate correctly
            check_piecewise(case, par.shapes, seed)
    assert accepted >= 0.8 * n, f"{op}: only {accepted}/{n} drawn parallelizations accepted"
    if not case.sizes:
        # no input (the random generators): one task draws the whole output, never split or copied here; a
        # plan splits it with parallel operators after it (test_random_generators.py: its blocks)
        assert accepted == n and split == 0 and copied == 0 and summed == 0
        assert ops.infer(op, case.attrs, []).piece_map.degree == 1
        return
    assert split >= 0.15 * n, f"{op}: only {split}/{n} accepted cases shard a dim"
    assert copied >= 0.2 * n
    spec = ops.get_op(op)
    # every operator that is linear in some input must see partial sums
    d = RandDrawer(0)
    case = GENERATORS[op](d)
    lab = spec.labels(spec.normalize_attrs(case.attrs), tuple(case.shapes()),
                      [o.sizes for o in ops.infer(op, case.attrs, case.shapes()).outputs])
    if lab.linearity == "additive" or any(lab.linearity or ()):
        assert summed >= 0.1 * n, f"{op}: only {summed}/{n} accepted cases carry partial sums"


# --- hand-picked cases the brief names -------------------------------------------------------------------

def S(sizes, degrees=None, s=1, c=1, dtype="float64"):
    return ParallelTensorShape.of(sizes, degrees, s, c, dtype)


HAND = [
    # tensor-parallel Linear: column-parallel (W split on n), row-parallel (x and W split on k -> sum)
    ("Linear", {}, [S([4, 6], c=2), S([6, 8], [1, 2])], ["normal", "normal"]),
    ("Linear", {}, [S([4, 6], [1, 2]), S([6, 8], [2, 1])], ["normal", "normal"]),
    ("Linear", {"activation": "relu"}, [S([4, 6], [2, 1], c=2), S([6, 8], [1, 2], c=2)], ["normal", "normal"]),
    ("Linear", {}, [S([4, 6], s=2), S([6, 8], c=2)], ["normal", "normal"]),
    ("Linear", {}, [S([4, 6], [1, 3], s=2, c=2), S([6, 8], [3, 1], s=2, c=2)], ["normal", "normal"]),
    ("Linear", {"activation": "gelu"}, [S([4, 6], [2, 1]), S([6, 8], c=2), S([8], c=2)], ["normal"] * 3),
    # MatMul: contraction split on both -> sum degree; broadcasting batch
    ("MatMul", {}, [S([2, 4, 6], [1, 1, 2]), S([6, 3], [2, 1], c=1)], ["normal"] * 2),
    ("MatMul", {}, [S([2, 1, 4, 6], [2, 1, 1, 1]), S([3, 6, 5], c=2)], ["normal"] * 2),
    ("BatchMatMul", {}, [S([4, 2, 6], [2, 1, 3]), S([4, 6, 2], [2, 3, 1])], ["normal"] * 2),
    # Conv2d: data parallel, channel (contraction) split, groups, pointwise spatial split
    ("Conv2d", {"padding": (1, 1, 1, 1)}, [S([4, 2, 5, 5], [2, 1, 1, 1]), S([3, 2, 3, 3], c=2)], ["normal"] * 2),
    ("Conv2d", {}, [S([2, 4, 4, 4], [1, 2, 1, 1]), S([3, 4, 2, 2], [1, 2, 1, 1])], ["normal"] * 2),
    ("Conv2d", {"groups": 4}, [S([2, 8, 4, 4], [1, 2, 1, 1]), S([8, 2, 3, 3], [2, 1, 1, 1])], ["normal"] * 2),
    ("Conv2d", {}, [S([2, 4, 8, 6], [1, 1, 2, 3]), S([5, 4, 1, 1], c=6)], ["normal"] * 2),
    ("Conv2d", {"stride": (2, 2)}, [S([1, 2, 8, 4], [1, 1, 2, 2]), S([3, 2, 2, 2], c=4), S([3], c=4)],
     ["normal"] * 3),
    ("Pool2d", {"kind": "max", "kernel": (2, 2), "stride": (2, 2)}, [S([1, 2, 8, 4], [1, 2, 2, 1])], ["normal"]),
    ("Pool2d", {"kind": "avg", "kernel": (3, 3), "stride": (2, 2), "padding": (1, 1, 1, 1), "ceil_mode": True,
                "count_include_pad": True}, [S([4, 2, 5, 5], [2, 1, 1, 1], s=2)], ["normal"]),
    ("Pool2d", {"kind": "avg", "global_pool": True}, [S([4, 2, 5, 5], [2, 2, 1, 1], s=2)], ["normal"]),
    ("Pool2d", {"kind": "max", "kernel": (2, 2), "stride": (2, 2), "ceil_mode": True},
     [S([1, 2, 8, 6], [1, 1, 2, 3])], ["normal"]),
    ("Pool2d", {"kind": "avg", "kernel": (1, 2), "stride": (3, 3), "ceil_mode": True, "count_include_pad": True},
     [S([1, 2, 12, 6], [1, 1, 2, 2], s=2)], ["normal"]),
    ("Pool2d", {"kind": "max", "kernel": (1, 1), "stride": (2, 1)}, [S([2, 2, 4, 3], [1, 1, 2, 3], s=2)], ["normal"]),
    ("Embedding", {}, [S([4, 3], [2, 1], c=6, dtype="int64"), S([10, 6], [1, 3], s=2, c=2)], [("index", 10), "normal"]),
    ("Reshape", {"shape": (4, 2, 3)}, [S([8, 3], [2, 1], s=2)], ["normal"]),
    ("Reshape", {"shape": (1, 24, 1)}, [S([1, 4, 6], [1, 2, 1], c=2)], ["normal"]),
    ("Reshape", {"shape": (2, 1, 12)}, [S([2, 3, 4], [2, 1, 1])], ["normal"]),
    ("Flatten", {"axis": -1}, [S([4, 2, 3], [2, 1, 1])], ["normal"]),
    ("ReduceSum", {"axes": (1,), "keepdims": False}, [S([4, 6], [2, 3])], ["normal"]),
    ("ReduceMean", {"axes": (1,), "keepdims": True}, [S([4, 6], [2, 1], s=3)], ["normal"]),
    ("Softmax", {"axis": -1}, [S([4, 6], [2, 1], c=2)], ["normal"]),
    ("LayerNorm", {"axis": -1}, [S([4, 6], [2, 1]), S([6], c=2), S([6], c=2)], ["normal"] * 3),
    ("Mul", {}, [S([4, 6], [2, 1], s=2, c=2), S([6], s=2, c=4)], ["normal"] * 2),
    ("Add", {}, [S([4, 6], [2, 3], s=2), S([1, 6], [1, 3], s=2, c=2)], ["normal"] * 2),
    ("Cast", {"to": "float32"}, [S([4, 6], [2, 1], s=2)], ["normal"]),
    ("LRN", {"size": 1}, [S([2, 4, 2, 2], [1, 4, 1, 1])], ["normal"]),
]


@pytest.mark.parametrize("op,attrs,shapes,fill", HAND, ids=[f"{h[0]}-{i}" for i, h in enumerate(HAND)])
def test_hand_picked_parallelizations(op, attrs, shapes, fill):
    from .op_cases import Case
    case = Case(op, attrs, [list(s.sizes) for s in shapes], [s.dtype for s in shapes], fill)
    check_piecewise(case, shapes, 0)


def test_matmul_contraction_split_gives_sum_degree():
    out = ops.infer("MatMul", {}, [S([4, 6], [1, 2]), S([6, 8], [2, 1])]).outputs[0]
    assert out.sum_degree == 2 and out.degrees == (1, 1)
    out = ops.infer("Linear", {}, [S([4, 6], [2, 3]), S([6, 8], [3, 1], c=2)]).outputs[0]
    assert (out.degrees, out.sum_degree, out.copy_degree) == ((2, 1), 3, 1)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
@settings(max_examples=400)
def test_piecewise_equals_logical_thorough(op, data):
    test_piecewise_equals_logical.hypothesis.inner_test(op, data)


# --- regressions (each failed before its fix) -------------------------------------------------------------

def test_flatten_negative_axis_kernel_matches_inference():
    x = np.arange(24.0).reshape(2, 3, 4)
    for axis in range(-3, 4):
        (y,) = ops.run_logical("Flatten", {"axis": axis}, [x])
        (s,) = ops.infer("Flatten", {"axis": axis}, [S([2, 3, 4])]).outputs
        assert y.shape == s.sizes, axis
    assert ops.run_logical("Flatten", {"axis": -1}, [x])[0].shape == (6, 4)


def test_erf_and_gelu_on_zero_dim_arrays():
    for op in ("Erf", "Gelu"):
        (y,) = ops.run_logical(op, {}, [np.array(0.5)])
        assert np.shape(y) == () and np.asarray(y).dtype == np.float64


def test_omitted_attributes_take_their_defaults():
    x, w = np.ones((2, 3)), np.ones((3, 4))
    (y,) = ops.run_logical("Linear", {}, [x, w])
    np.testing.assert_array_equal(y, np.full((2, 4), 3.0))
    assert ops.infer("Conv2d", {}, [S([1, 2, 4, 4]), S([3, 2, 3, 3])]).outputs[0].sizes == (1, 3, 2, 2)
    with pytest.raises(InvalidParallelization, match="missing required attribute 'factor'"):
        ops.infer("Scale", {}, [S([2])])


def test_conv_channel_degree_must_divide_groups():
    # 4 channels in 2 groups of 2: 4 pieces of one channel would cut groups apart
    with pytest.raises(InvalidParallelization, match="groups=2"):
        ops.infer("Conv2d", {"groups": 2}, [S([1, 4, 3, 3], [1, 4, 1, 1]), S([4, 2, 1, 1], [4, 1, 1, 1])])
    ops.infer("Conv2d", {"groups": 2}, [S([1, 4, 3, 3], [1, 2, 1, 1]), S([4, 2, 1, 1], [2, 1, 1, 1])])


def test_split_contraction_with_bias_or_activation_is_refused():
    x, w = S([4, 6], [1, 2]), S([6, 8], [2, 1])
    assert ops.infer("Linear", {}, [x, w]).outputs[0].sum_degree == 2
    with pytest.raises(InvalidParallelization, match="bias"):
        ops.infer("Linear", {}, [x, w, S([8], c=2)])
    with pytest.raises(InvalidParallelization, match="gelu"):
        ops.infer("Linear", {"activation": "gelu"}, [x, w])
    with pytest.raises(InvalidParallelization, match="bias"):
        ops.infer("Conv2d", {}, [S([1, 4, 3, 3], [1, 2, 1, 1]), S([2, 4, 1, 1], [1, 2, 1, 1]), S([2], c=2)])


# --- kernels against PyTorch (the semantics ONNX exporters and onnxruntime follow) -------------------------

@given(data=st.data())
@settings(max_examples=60)
def test_pool2d_kernel_matches_torch(data):
    torch = pytest.importorskip("torch")
    d = HypDrawer(data)
    h, w = d.int(1, 9), d.int(1, 9)
    kh, kw = d.int(1, min(h, 4)), d.int(1, min(w, 4))
    sh, sw = d.int(1, 3), d.int(1, 3)
    ph, pw = d.int(0, kh // 2), d.int(0, kw // 2)
    ceil, cip, kind = d.bool(), d.bool(), d.choice(["max", "avg"])
    attrs = {"kind": kind, "kernel": (kh, kw), "stride": (sh, sw), "padding": (ph, pw, ph, pw),
             "ceil_mode": ceil, "count_include_pad": cip}
    x = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal((2, 3, h, w))
    (s,) = ops.infer("Pool2d", attrs, [S([2, 3, h, w])]).outputs
    (y,) = ops.run_logical("Pool2d", attrs, [x])
    t = torch.from_numpy(x)
    if kind == "max":
        ref = torch.nn.functional.max_pool2d(t, (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil)
    else:
        ref = torch.nn.functional.avg_pool2d(t, (kh, kw), (sh, sw), (ph, pw), ceil_mode=ceil,
                                             count_include_pad=cip)
    assert s.sizes == tuple(ref.shape) == y.shape
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-12, atol=1e-12)


@given(data=st.data())
@settings(max_examples=40)
def test_conv2d_kernel_matches_torch(data):
    torch = pytest.importorskip("torch")
    case = gen_conv(HypDrawer(data))
    case.attrs["padding"] = (1, 0, 1, 0) if case.attrs["padding"] != (0, 0, 0, 0) else (0, 0, 0, 0)
    xs = case.values(np.random.default_rng(0))
    (y,) = ops.run_logical("Conv2d", case.attrs, xs)
    a = case.attrs
    ref = torch.nn.functional.conv2d(torch.from_numpy(xs[0]), torch.from_numpy(xs[1]),
                                     torch.from_numpy(xs[2]) if len(xs) == 3 else None,
                                     a["stride"], (a["padding"][0], a["padding"][1]), a["dilation"], a["groups"])
    assert ops.infer("Conv2d", a, case.shapes()).outputs[0].sizes == tuple(ref.shape)
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-10, atol=1e-10)


def test_reduce_with_an_axis_named_twice():
    x = np.arange(6.0).reshape(2, 3)
    for op, f in (("ReduceSum", np.sum), ("ReduceMean", np.mean)):
        (y,) = ops.run_logical(op, {"axes": (0, -2), "keepdims": False}, [x])
        np.testing.assert_array_equal(y, f(x, axis=0))
        assert ops.infer(op, {"axes": (0, -2), "keepdims": False}, [S([2, 3])]).outputs[0].sizes == (3,)


def test_numpy_array_attributes_are_frozen_to_tuples():
    from unity_pcg.pcg import PCG
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": np.array([2, 3, 4])})
    r = b.add("Reshape", {"shape": np.array([6, 4])}, [x])
    t = b.add("Transpose", {"perm": np.array([1, 0])}, [r])
    g = b.finish()
    assert g.node(r[0]).a["shape"] == (6, 4) and g.node(t[0]).a["perm"] == (1, 0)
    assert g.shape(t).sizes == (4, 6)


def test_bfloat16_values_are_held_in_float32():
    (y,) = ops.run_logical("Cast", {"to": "bfloat16"}, [np.ones(3)])
    assert y.dtype == np.float32
    assert ops.infer("Cast", {"to": "bfloat16"}, [S([3])]).outputs[0].dtype == "bfloat16"


@st.composite
def _regroupings(draw):
    atoms = draw(st.lists(st.sampled_from([1, 1, 2, 3, 5]), min_size=0, max_size=7))

    def group(xs):
        out, i = [], 0
        while i < len(xs):
            k = draw(st.integers(1, max(1, len(xs) - i)))
            out.append(int(np.prod(xs[i:i + k])))
            i += k
        return out
    src, dst = group(atoms), group(atoms)
    if draw(st.booleans()):
        dst.insert(draw(st.integers(0, len(dst))), 1)
    return src, dst


@given(_regroupings())
def test_reshape_groups_pair_up_runs_of_equal_products(sd):
    from unity_pcg.ops.compute import reshape_groups
    src, dst = sd
    groups = reshape_groups(src, dst)
    assert groups is not None
    assert [i for gi, _ in groups for i in gi] == list(range(len(src)))
    assert [j for _, gj in groups for j in gj] == list(range(len(dst)))
    for gi, gj in groups:
        assert int(np.prod([src[i] for i in gi])) == int(np.prod([dst[j] for j in gj]))
    # and the Reshape labels built on them are valid for every drawn partition of the outer dims
    case = Case("Reshape", {"shape": tuple(dst)}, [src], ["float64"], ["normal"])
    for seed in range(3):
        par = draw_parallel(RandDrawer(seed), case)
        if accepts(case, par.shapes):
            check_piecewise(case, par.shapes, seed)


def test_pool2d_kernel_matches_onnxruntime():
    """Max/average pooling with ceil_mode and count_include_pad as onnxruntime computes them (ONNX's
    own shape inference disagrees with onnxruntime on some ceil_mode shapes; we follow the runtime)."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    import itertools
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    n = 0
    for h, k, s, p, ceil, cip, kind in itertools.product([3, 4, 5, 7], [1, 2, 3], [1, 2, 3], [0, 1], [0, 1], [0, 1],
                                                         ["max", "avg"]):
        if p > k // 2 or k > h or (kind == "max" and cip):
            continue
        attrs = dict(kernel_shape=[k, k + (h > 4)], strides=[s, s], pads=[p, 0, p, 0], ceil_mode=ceil)
        if kind == "avg":
            attrs["count_include_pad"] = cip
        node = helper.make_node("MaxPool" if kind == "max" else "AveragePool", ["x"], ["y"], **attrs)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, h, h])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
        m.ir_version = 9
        x = np.random.default_rng(n).standard_normal((1, 2, h, h)).astype(np.float32)
        ref = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        a = {"kind": kind, "kernel": (k, k + (h > 4)), "stride": (s, s), "padding": (p, 0, p, 0),
             "ceil_mode": bool(ceil), "count_include_pad": bool(cip)}
        (y,) = ops.run_logical("Pool2d", a, [x])
        assert ops.infer("Pool2d", a, [S([1, 2, h, h], dtype="float32")]).outputs[0].sizes == ref.shape, a
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6, err_msg=str(a))
        n += 1
    assert n > 200


@pytest.mark.parametrize("op", OPS)
def test_task_flops_add_up_to_the_logical_flops(op):
    """One task's FLOPs times the number of tasks is the logical FLOPs when the work is only sharded;
    replicas and partial sums (each task works on a whole piece) can only add redundant work."""
    for seed in range(60):
        d = RandDrawer(1000 + seed)
        case = GENERATORS[op](d)
        par = draw_parallel(d, case)
        if not accepts(case, par.shapes):
            continue
        inf = ops.infer(op, case.attrs, par.shapes)
        total = ops.flops(op, case.attrs, par.shapes, inf.outputs)
        per_task = ops.task_flops(op, case.attrs, par.shapes, inf.outputs)
        tasks = inf.piece_map.degree
        assert total >= 0 and per_task >= 0
        if par.rep == 1 and all(s == 1 for s in par.sums):
            assert per_task * tasks == pytest.approx(total, rel=1e-9), (case.attrs, [str(s) for s in par.shapes])
        else:
            assert per_task * tasks >= total * (1 - 1e-9)
        moved = ops.bytes_moved(op, par.shapes, inf.outputs, per_task=True)
        assert 0 < moved <= ops.bytes_moved(op, par.shapes, inf.outputs) or 0 in case.sizes


def test_a_kernel_piece_of_the_wrong_shape_is_an_error_not_a_broadcast():
    from unity_pcg.ops.base import PieceMap, TensorMap
    s_in = S([4, 3], [2, 1])
    s_out = S([4, 3], [2, 1])
    pm = PieceMap((("d0", 2),), (TensorMap((), (), (("d0",), ())),), (TensorMap((), (), (("d0",), ())),))
    x = P.split(np.ones((4, 3)), s_in)
    bad = lambda a, xs: [xs[0][:1]]   # (1, 3) would broadcast into a (2, 3) slot
    with pytest.raises(ValueError, match="expected \\[2, 3\\]"):
        P.run_piecewise(bad, {}, {}, pm, [x], [s_in], [s_out])


X4 = S([1, 2, 6, 6])


@pytest.mark.parametrize("op,attrs,shapes,words", [
    ("Conv2d", {"stride": (0, 1)}, [X4, S([3, 2, 3, 3])], "stride"),
    ("Conv2d", {"stride": (1, 1, 1)}, [X4, S([3, 2, 3, 3])], "stride"),
    ("Conv2d", {"dilation": 0}, [X4, S([3, 2, 3, 3])], "dilation"),
    ("Conv2d", {"padding": (-1, 0, 0, 0)}, [X4, S([3, 2, 3, 3])], "padding"),
    ("Conv2d", {"groups": 0}, [X4, S([3, 2, 3, 3])], "groups"),
    ("Conv2d", {}, [X4, S([3, 2, 7, 7])], "larger than"),
    ("Pool2d", {"kernel": (0, 2)}, [X4], "kernel"),
    ("Pool2d", {"stride": 0}, [X4], "stride"),
    ("Pool2d", {"padding": (1, 1)}, [X4], "padding"),
    ("Pool2d", {"kernel": (1, 1), "padding": (0, 0, 3, 0), "ceil_mode": True}, [X4], "smaller than the kernel"),
    ("Pool2d", {"kind": "median"}, [X4], "kind"),
    ("LRN", {"size": 0}, [X4], "size"),
    ("Slice", {"axes": (0, 1), "starts": (0,), "ends": (1, 1), "steps": (1, 1)}, [S([4, 4])], "length"),
    ("Slice", {"axes": (1, -1), "starts": (0, 0), "ends": (1, 1), "steps": (1, 1)}, [S([4, 4])], "twice"),
    ("Slice", {"axes": (2,), "starts": (0,), "ends": (1,), "steps": (1,)}, [S([4, 4])], "out of range"),
    ("Slice", {"axes": (0,), "starts": (0,), "ends": (1,), "steps": (0,)}, [S([4, 4])], "step 0"),
    ("Split", {"axis": 0, "sizes": 4}, [S([4, 4])], "sizes"),
    ("Split", {"axis": 0, "sizes": (1, 2)}, [S([4, 4])], "add up"),
    ("Reshape", {"shape": (-1, 4)}, [S([4, 4])], "cannot reshape"),
    ("Transpose", {"perm": (0, 0)}, [S([4, 4])], "permutation"),
    ("Softmax", {"axis": 2}, [S([4, 4])], "out of range"),
    ("Linear", {}, [S([4, 3]), S([4, 5])], "does not match"),
    ("Linear", {"activation": "swish"}, [S([4, 3]), S([3, 5])], "activation"),
    ("MatMul", {}, [S([4, 3]), S([4, 5])], "contraction"),
    ("BatchMatMul", {}, [S([2, 4, 3]), S([3, 3, 5])], "batch"),
    ("Embedding", {}, [S([4]), S([10, 3])], "integers"),
    ("Add", {}, [S([4, 3]), S([2, 3])], "broadcast"),
    ("Cast", {"to": "complex64"}, [S([4])], "dtype"),
    ("Concat", {"axis": 0}, [S([4, 3]), S([4, 2])], "does not match"),
    ("Flatten", {"axis": 3}, [S([4, 3])], "out of range"),
    ("LayerNorm", {"axis": 0}, [S([4, 3]), S([3])], "expected"),
    ("BatchNorm", {}, [S([4, 3])] + [S([4])] * 4, "expected"),
])
def test_malformed_operators_are_typed_errors(op, attrs, shapes, words):
    with pytest.raises(InvalidParallelization) as e:
        ops.infer(op, attrs, shapes)
    msg = str(e.value)
    assert msg.startswith(op) and words in msg and "\n" not in msg, msg


def test_list_attributes_work_like_tuples():
    x = np.arange(24.0).reshape(1, 2, 3, 4)
    for op, attrs in [("Reshape", {"shape": [2, 12]}), ("Transpose", {"perm": [0, 2, 1, 3]}),
                      ("Slice", {"axes": [3], "starts": [1], "ends": [3], "steps": [1]}),
                      ("Split", {"axis": 3, "sizes": [1, 3]}), ("ReduceSum", {"axes": [1, 2]}),
                      ("Pool2d", {"kind": "avg", "kernel": [1, 2], "stride": [1, 2], "padding": [0, 0, 0, 0]})]:
        want = ops.run_logical(op, {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}, [x])
        got = ops.run_logical(op, attrs, [x])
        assert [s.sizes for s in ops.infer(op, attrs, [S(x.shape)]).outputs] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
