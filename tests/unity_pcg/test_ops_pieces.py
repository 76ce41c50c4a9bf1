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

from .op_cases import GENERATORS, HypDrawer, RandDrawer, accepts, draw_parallel

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
@settings(max_examples=40)
def test_piecewise_equals_logical(op, data):
    d = HypDrawer(data)
    case = GENERATORS[op](d)
    par = draw_parallel(d, case)
    assume(accepts(case, par.shapes))
    pc = max(s.piece_count for s in par.shapes)
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
