"""Piece values: the numpy embodiment of DESIGN's piece semantics.

A piece value is one dense array of shape ``grid + piece_shape`` where ``grid`` is
``(copy_degree, sum_degree, *shard degrees)``.  Shard index ``i`` of a dim holds the ``i``-th
contiguous block of that dim.
"""
from __future__ import annotations

import itertools
from math import prod
from typing import Sequence

import numpy as np

from .ops.base import PieceMap, TensorMap
from .shape import ParallelTensorShape


def unravel(flat: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Row-major flat index -> grid index (the last axis fastest)."""
    out = []
    for g in reversed(grid):
        out.append(flat % g)
        flat //= g
    return tuple(reversed(out))


def ravel(idx: Sequence[int], grid: Sequence[int]) -> int:
    """Grid index -> row-major flat index (the inverse of :func:`unravel`)."""
    f = 0
    for i, g in zip(idx, grid):
        f = f * g + i
    return f


def split(x: np.ndarray, shape: ParallelTensorShape, rng: np.random.Generator | None = None) -> np.ndarray:
    """Logical value -> pieces.  Partial sums are a random split when ``rng`` is given (else the
    whole value sits in sum piece 0); copies are identical."""
    x = np.asarray(x)
    if x.shape != shape.sizes:
        raise ValueError(f"value of shape {x.shape} does not match {shape}")
    r = shape.rank
    inter = []
    for d in shape.dims:
        inter += [d.degree, d.piece]
    y = x.reshape(inter).transpose(list(range(0, 2 * r, 2)) + list(range(1, 2 * r, 2)))
    s = shape.sum_degree
    if s > 1:
        if rng is not None:
            if x.dtype.kind in "iu":
                parts = [rng.integers(-4, 5, size=y.shape).astype(x.dtype) for _ in range(s - 1)]
            else:
                parts = [rng.standard_normal(y.shape).astype(x.dtype) for _ in range(s - 1)]
            last = y - sum(parts)
            y = np.stack(parts + [last])
        else:
            y = np.stack([y] + [np.zeros_like(y)] * (s - 1))
    else:
        y = y[None]
    y = np.broadcast_to(y[None], (shape.copy_degree,) + y.shape).copy()
    return y


def copies_agree(pieces: np.ndarray, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return all(np.allclose(pieces[0], pieces[c], rtol=rtol, atol=atol) for c in range(1, pieces.shape[0]))


def join(pieces: np.ndarray, shape: ParallelTensorShape) -> np.ndarray:
    """Pieces -> logical value: take copy 0, sum over the sum axis, concatenate shard blocks."""
    expect = shape.grid + shape.piece_shape
    if pieces.shape != expect:
        raise ValueError(f"pieces of shape {pieces.shape} do not match {shape} (expected {expect})")
    r = shape.rank
    y = pieces[0].sum(axis=0) if shape.sum_degree > 1 else pieces[0, 0]
    y = y.astype(pieces.dtype, copy=False)
    order = []
    for i in range(r):
        order += [i, r + i]
    return y.transpose(order).reshape(shape.sizes)


def _index(axes: tuple[str, ...], task: dict[str, int], deg: dict[str, int]) -> int:
    i = 0
    for a in axes:
        i = i * deg[a] + task[a]
    return i


def grid_index(tm: TensorMap, task: dict[str, int], deg: dict[str, int]) -> tuple[int, ...]:
    return (_index(tm.copy, task, deg), _index(tm.sum, task, deg)) + tuple(_index(d, task, deg) for d in tm.dims)


def run_piecewise(kernel, attrs: dict, piece_attrs: dict, pm: PieceMap, ins: Sequence[np.ndarray],
                  in_shapes: Sequence[ParallelTensorShape], out_shapes: Sequence[ParallelTensorShape]
                  ) -> list[np.ndarray]:
    """Run a compute operator's kernel once per task of its piece map."""
    deg = dict(pm.axes)
    names = [a for a, _ in pm.axes]
    outs: list[np.ndarray | None] = [None] * len(out_shapes)
    for idx in itertools.product(*(range(deg[a]) for a in names)):
        task = dict(zip(names, idx))
        pieces = [x[grid_index(tm, task, deg)] for x, tm in zip(ins, pm.inputs)]
        res = kernel(piece_attrs, pieces)
        if len(res) != len(out_shapes):
            raise ValueError(f"kernel gave {len(res)} outputs, expected {len(out_shapes)}")
        for k, (y, tm, s) in enumerate(zip(res, pm.outputs, out_shapes)):
            y = np.asarray(y)
            if tuple(y.shape) != s.piece_shape:   # never broadcast a wrong piece into its slot
                raise ValueError(f"output {k}: the kernel gave a piece of shape {list(y.shape)}, "
                                 f"expected {list(s.piece_shape)} for {s}")
            if outs[k] is None:
                outs[k] = np.zeros(s.grid + tuple(y.shape), dtype=y.dtype)
            outs[k][grid_index(tm, task, deg)] = y
    return outs  # type: ignore[return-value]


# --- parallel operators on pieces ------------------------------------------------------------------

def partition(p: np.ndarray, rank: int, dim: int, d: int) -> np.ndarray:
    sa, pa = 2 + dim, 2 + rank + dim
    sh = list(p.shape)
    y = p.reshape(sh[:pa] + [d, sh[pa] // d] + sh[pa + 1:])
    y = np.moveaxis(y, pa, sa + 1)
    sh2 = list(y.shape)
    return y.reshape(sh2[:sa] + [sh2[sa] * d] + sh2[sa + 2:])


def combine(p: np.ndarray, rank: int, dim: int, d: int) -> np.ndarray:
    sa, pa = 2 + dim, 2 + rank + dim
    sh = list(p.shape)
    y = p.reshape(sh[:sa] + [sh[sa] // d, d] + sh[sa + 1:])
    y = np.moveaxis(y, sa + 1, pa)
    sh2 = list(y.shape)
    return y.reshape(sh2[:pa] + [d * sh2[pa + 1]] + sh2[pa + 2:])


def replicate(p: np.ndarray, d: int) -> np.ndarray:
    return np.repeat(p, d, axis=0)


def reduce(p: np.ndarray, d: int) -> np.ndarray:
    sh = list(p.shape)
    return p.reshape([sh[0], sh[1] // d, d] + sh[2:]).sum(axis=2).astype(p.dtype, copy=False)


def total_degree(pm: PieceMap) -> int:
    return prod(d for _, d in pm.axes)
