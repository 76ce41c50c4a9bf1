"""ParallelTensorShape: piece shape and count, grid, JSON round trip, typed errors."""
from __future__ import annotations

import json
from math import prod

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unity_pcg import pieces as P
from unity_pcg.errors import ShapeError, UnityError
from unity_pcg.shape import DTYPES, ParallelTensorShape, ShardDim


@st.composite
def parallel_shapes(draw, max_rank=4):
    rank = draw(st.integers(0, max_rank))
    dims = []
    for _ in range(rank):
        degree = draw(st.integers(1, 4))
        dims.append(ShardDim(degree * draw(st.integers(0, 4)), degree))
    return ParallelTensorShape(tuple(dims), draw(st.integers(1, 4)), draw(st.integers(1, 4)),
                               draw(st.sampled_from(DTYPES)))


@given(parallel_shapes())
def test_piece_shape_and_count(s):
    assert s.piece_shape == tuple(d.size // d.degree for d in s.dims)
    assert s.piece_count == prod(s.degrees) * s.sum_degree * s.copy_degree
    assert s.grid == (s.copy_degree, s.sum_degree) + s.degrees
    assert prod(s.grid) == s.piece_count
    assert s.numel == prod(s.sizes) and s.piece_numel * s.shard_degree == s.numel
    assert s.nbytes == s.numel * s.itemsize and s.piece_nbytes * s.shard_degree == s.nbytes
    assert s.logical().sizes == s.sizes and s.logical().piece_count == 1
    assert s.is_unpartitioned() == (s.piece_count == 1)


@given(parallel_shapes())
def test_json_round_trip(s):
    obj = json.loads(json.dumps(s.to_json()))
    t = ParallelTensorShape.from_json(obj)
    assert t == s and hash(t) == hash(s)
    assert ParallelTensorShape.of(s.sizes, s.degrees, s.sum_degree, s.copy_degree, s.dtype) == s


@given(parallel_shapes(max_rank=3))
def test_split_join_round_trip(s):
    """The value layout a shape describes: split then join gives the logical value back."""
    if s.dtype in ("bfloat16", "bool"):
        s = s.with_dtype("float64")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(s.sizes) * 8).astype(s.dtype)
    p = P.split(x, s, rng)
    assert p.shape == s.grid + s.piece_shape
    assert P.copies_agree(p)
    y = P.join(p, s)
    if x.dtype.kind == "f":
        np.testing.assert_allclose(y, x, rtol=1e-2 if s.dtype == "float16" else 1e-5, atol=1e-2)
    else:
        np.testing.assert_array_equal(y, x)


def test_shard_blocks_are_contiguous():
    s = ParallelTensorShape.of([4, 6], [2, 3])
    x = np.arange(24).reshape(4, 6)
    p = P.split(x, s)
    assert p.shape == (1, 1, 2, 3, 2, 2)
    np.testing.assert_array_equal(p[0, 0, 1, 2], x[2:4, 4:6])


@pytest.mark.parametrize("size,degree", [(6, 4), (5, 2), (1, 2), (3, 6)])
def test_degree_must_divide_size(size, degree):
    with pytest.raises(ShapeError, match=f"degree {degree} does not divide dimension size {size}"):
        ParallelTensorShape.of([8, size], [1, degree])
    with pytest.raises(ShapeError):
        ParallelTensorShape.of([size]).with_degree(0, degree)
    with pytest.raises(ShapeError):
        ParallelTensorShape.from_json({"dims": [[size, degree]]})


@pytest.mark.parametrize("bad", [
    lambda: ShardDim(-1, 1), lambda: ShardDim(4, 0), lambda: ShardDim(4, 1.5), lambda: ShardDim(4.0, 1),
    lambda: ParallelTensorShape.of([4], sum_degree=0), lambda: ParallelTensorShape.of([4], copy_degree=-2),
    lambda: ParallelTensorShape.of([4], dtype="complex7"), lambda: ParallelTensorShape.of([4], [1, 1]),
    lambda: ParallelTensorShape.of([4]).with_degree(1, 2), lambda: ParallelTensorShape((4,)),
    lambda: ParallelTensorShape.from_json({"dims": "x"}), lambda: ParallelTensorShape.from_json({}),
    lambda: ParallelTensorShape.from_json({"dims": [[4, 1]], "sum_degree": "two"}),
    lambda: ParallelTensorShape.from_json({"dims": [[4, 1, 7]]}),
    lambda: ParallelTensorShape.from_json(None),
])
def test_malformed_shapes_are_typed_errors(bad):
    with pytest.raises(ShapeError) as e:
        bad()
    assert isinstance(e.value, UnityError) and "\n" not in str(e.value)


def test_edits_return_new_shapes_and_shapes_are_frozen():
    s = ParallelTensorShape.of([4, 6])
    t = s.with_degree(-1, 3).with_sum(2).with_copy(4).with_dtype("float16")
    assert s == ParallelTensorShape.of([4, 6])
    assert (t.degrees, t.sum_degree, t.copy_degree, t.dtype) == ((1, 3), 2, 4, "float16")
    assert str(t) == "[4, 6/3] sum=2 copy=4 float16"
    with pytest.raises(Exception):
        s.sum_degree = 3  # type: ignore[misc]
    assert len({s, ParallelTensorShape.of([4, 6]), t}) == 2


def test_bool_is_not_a_degree():
    with pytest.raises(ShapeError):
        ShardDim(4, True)
    with pytest.raises(ShapeError):
        ParallelTensorShape.of([4], sum_degree=True)
