"""Parallel operators move pieces and never change the logical value; inverse pairs restore the piece
array exactly; invalid degrees are typed errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from unity_pcg import ops
from unity_pcg import pieces as P
from unity_pcg.errors import InvalidParallelization, UnityError
from unity_pcg.shape import ParallelTensorShape

PARALLEL = sorted(n for n, s in ops.REGISTRY.items() if s.kind == "parallel")


def test_the_six_parallel_operators_exist():
    assert set(ops.PARALLEL_OPS) == {"Partition", "Combine", "Replicate", "Reduce", "Pipeline", "Batch"}
    assert set(ops.PARALLEL_OPS) <= set(PARALLEL)


@st.composite
def shapes(draw):
    rank = draw(st.integers(1, 3))
    sizes, degrees = [], []
    for _ in range(rank):
        deg = draw(st.sampled_from([1, 1, 2, 3, 4]))
        sizes.append(deg * draw(st.sampled_from([1, 2, 3, 4])))
        degrees.append(deg)
    return ParallelTensorShape.of(sizes, degrees, draw(st.sampled_from([1, 2, 4, 6])),
                                  draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from(["float64", "int64"])))


@st.composite
def attrs_for(draw, op, s):
    spec = ops.get_op(op)
    a = {}
    if "dim" in spec.attrs:
        a["dim"] = draw(st.integers(-s.rank, s.rank - 1))
    if "degree" in spec.attrs:
        a["degree"] = draw(st.sampled_from([2, 3, 4, 6]))
    return a


def _values(s: ParallelTensorShape, seed: int):
    rng = np.random.default_rng(seed)
    if s.dtype == "int64":
        x = rng.integers(-50, 50, size=s.sizes)
    else:
        x = rng.standard_normal(s.sizes)
    return x, P.split(x, s, rng)


@pytest.mark.parametrize("op", PARALLEL)
@given(data=st.data())
def test_parallel_ops_keep_the_logical_value(op, data):
    s = data.draw(shapes())
    a = data.draw(attrs_for(op, s))
    try:
        (out,) = ops.infer(op, a, [s]).outputs
    except InvalidParallelization:
        assume(False)
    x, p = _values(s, data.draw(st.integers(0, 1000)))
    (y,), (out2,) = ops.run_pieces(op, a, [p], [s])
    assert out2 == out and out.sizes == s.sizes and out.dtype == s.dtype
    assert y.shape == out.grid + out.piece_shape
    assert P.copies_agree(y)
    got = P.join(y, out)
    if s.dtype == "int64":
        np.testing.assert_array_equal(got, x)
    else:
        np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)
    # logical evaluation is the identity
    (z,) = ops.run_logical(op, a, [x])
    np.testing.assert_array_equal(z, x)
    # the degree bookkeeping
    if op in ("Partition", "Pipeline"):
        assert out.degrees[a["dim"]] == s.degrees[a["dim"]] * a["degree"]
    if op in ("Combine", "Batch"):
        assert out.degrees[a["dim"]] * a["degree"] == s.degrees[a["dim"]]
    if op == "Replicate":
        assert out.copy_degree == s.copy_degree * a["degree"] and out.sum_degree == s.sum_degree
    if op == "Reduce":
        assert out.sum_degree * a["degree"] == s.sum_degree and out.copy_degree == s.copy_degree
    if op in ops.PARALLEL_OPS:
        assert out.piece_count * (a["degree"] if op in ("Combine", "Batch", "Reduce") else 1) == \
            s.piece_count * (a["degree"] if op in ("Partition", "Pipeline", "Replicate") else 1)


@pytest.mark.parametrize("there,back", [("Partition", "Combine"), ("Pipeline", "Batch"), ("Combine", "Partition"),
                                        ("Batch", "Pipeline"), ("Partition", "Batch")])
@given(data=st.data())
def test_inverse_pairs_restore_the_pieces_exactly(there, back, data):
    s = data.draw(shapes())
    a = data.draw(attrs_for(there, s))
    try:
        (mid,) = ops.infer(there, a, [s]).outputs
    except InvalidParallelization:
        assume(False)
    _, p = _values(s, 0)
    (q,), _ = ops.run_pieces(there, a, [p], [s])
    (r,), (end,) = ops.run_pieces(back, a, [q], [mid])
    assert end == s
    np.testing.assert_array_equal(r, p)


@given(data=st.data())
def test_replicate_copies_every_piece_and_reduce_sums_neighbours(data):
    s = data.draw(shapes())
    d = data.draw(st.sampled_from([2, 3]))
    _, p = _values(s, 1)
    (q,), (out,) = ops.run_pieces("Replicate", {"degree": d}, [p], [s])
    for c in range(out.copy_degree):
        np.testing.assert_array_equal(q[c], p[c // d])
    assume(s.sum_degree % 2 == 0)
    (r,), _ = ops.run_pieces("Reduce", {"degree": 2}, [p], [s])
    np.testing.assert_array_equal(r[:, 0], p[:, 0] + p[:, 1])


def test_partition_splits_each_piece_into_contiguous_blocks():
    s = ParallelTensorShape.of([8], [2])
    x = np.arange(8.0)
    (q,), (out,) = ops.run_pieces("Partition", {"dim": 0, "degree": 2}, [P.split(x, s)], [s])
    assert out.degrees == (4,)
    np.testing.assert_array_equal(q[0, 0], [[0, 1], [2, 3], [4, 5], [6, 7]])


S = ParallelTensorShape.of


@pytest.mark.parametrize("op,attrs,shape,words", [
    ("Partition", {"dim": 0, "degree": 3}, S([4, 6]), "does not divide"),
    ("Partition", {"dim": 1, "degree": 4}, S([4, 6], [1, 2]), "does not divide"),
    ("Partition", {"dim": 0, "degree": 1}, S([4, 6]), "degree must be an int >= 2"),
    ("Partition", {"dim": 0, "degree": 0}, S([4, 6]), "degree must be"),
    ("Partition", {"dim": 0, "degree": -2}, S([4, 6]), "degree must be"),
    ("Partition", {"dim": 0, "degree": 2.0}, S([4, 6]), "degree must be"),
    ("Partition", {"dim": 0, "degree": "2"}, S([4, 6]), "degree must be"),
    ("Partition", {"dim": 0, "degree": True}, S([4, 6]), "degree must be"),
    ("Partition", {"dim": 2, "degree": 2}, S([4, 6]), "out of range"),
    ("Partition", {"dim": "0", "degree": 2}, S([4, 6]), "dim must be an int"),
    ("Partition", {"degree": 2}, S([4, 6]), "missing required attribute 'dim'"),
    ("Pipeline", {"dim": 0, "degree": 8}, S([4, 6]), "does not divide"),
    ("Combine", {"dim": 0, "degree": 2}, S([4, 6]), "not a multiple of 2"),
    ("Combine", {"dim": 0, "degree": 2}, S([6, 6], [3, 1]), "not a multiple of 2"),
    ("Combine", {"dim": -3, "degree": 2}, S([4, 6], [2, 1]), "out of range"),
    ("Batch", {"dim": 1, "degree": 3}, S([4, 6], [1, 2]), "not a multiple of 3"),
    ("Replicate", {"degree": 1}, S([4]), "degree must be"),
    ("Replicate", {}, S([4]), "missing required attribute 'degree'"),
    ("Reduce", {"degree": 2}, S([4]), "not a multiple of 2"),
    ("Reduce", {"degree": 2}, S([4], sum_degree=3), "not a multiple of 2"),
    ("Reduce", {"degree": 4}, S([4], sum_degree=2), "not a multiple of 4"),
])
def test_invalid_parallel_ops_are_refused(op, attrs, shape, words):
    with pytest.raises(InvalidParallelization) as e:
        ops.infer(op, attrs, [shape])
    msg = str(e.value)
    assert isinstance(e.value, UnityError) and msg.startswith(op) and words in msg and "\n" not in msg


def test_parallel_ops_take_exactly_one_input():
    for op in ops.PARALLEL_OPS:
        with pytest.raises(InvalidParallelization, match="takes 1"):
            ops.infer(op, {"dim": 0, "degree": 2} if "dim" in ops.get_op(op).attrs else {"degree": 2},
                      [S([4]), S([4])])
