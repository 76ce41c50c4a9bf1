"""Torch kernels for :mod:`unity_pcg.ops.indexing` (registered into :data:`unity_pcg.executor.kernels.KERNELS`).

They follow the numpy reference exactly, including its choices where ONNX leaves a result undefined:
GatherElements and ScatterND wrap indices modulo the dim size (negative ones count from the end), and a
ScatterND index written twice keeps the last update.
"""
from __future__ import annotations

import torch

from unity_pcg.ops.indexing import parse_einsum

from .kernels import KERNELS


def _where(a, xs, c):
    cond, x, y = xs
    return [torch.where(cond.bool(), x, y)]


def _gather_elements(a, xs, c):
    data, idx = xs
    ax = a["axis"] % data.dim()
    n = data.shape[ax]
    idx = idx.long()
    if n:
        idx = torch.remainder(idx, n)
    # torch.gather reads data only where the indices reach; the other dims may be longer in data
    return [torch.gather(data, ax, idx)]


def _gather_nd(a, xs, c):
    data, idx = xs
    b, k = a["batch_dims"], idx.shape[-1]
    idx = idx.long()
    sizes = torch.tensor(data.shape[b:b + k], dtype=torch.long, device=idx.device)
    if idx.numel() and bool((sizes > 0).all()):
        idx = torch.remainder(idx, sizes)
    rows = tuple(idx.shape[:-1])
    grids = [torch.arange(data.shape[j], device=idx.device).reshape([-1 if t == j else 1 for t in range(len(rows))])
             for j in range(b)]
    out = data[tuple(grids + [idx[..., j] for j in range(k)])]
    return [out.reshape(rows + tuple(data.shape[b + k:]))]


def _tile(a, xs, c):
    x = xs[0]
    return [x.repeat(tuple(int(r) for r in a["repeats"])) if x.dim() else x.clone()]


def _einsum(a, xs, c):
    _, _, explicit = parse_einsum(a["equation"], [x.dim() for x in xs])
    return [torch.einsum(explicit, *xs)]


def _trilu(a, xs, c):
    x, k = xs[0], int(a["k"])
    return [torch.triu(x, k) if a["upper"] else torch.tril(x, k)]


def _put_last(data, ii, u):
    """data with data[ii[m]] = u[m] for every index tuple ii[m] (in range); a repeated tuple keeps its last
    update, as numpy's sequential assignment does, so the result is deterministic."""
    k = ii.shape[1]
    sizes = torch.tensor(data.shape[:k], dtype=torch.long, device=ii.device)
    # keep the last write of every repeated index tuple (numpy's order), so the result is deterministic
    strides = torch.ones(k, dtype=torch.long, device=ii.device)
    for j in range(k - 2, -1, -1):
        strides[j] = strides[j + 1] * sizes[j + 1]
    lin = (ii * strides).sum(-1)
    pos = torch.arange(lin.shape[0], device=ii.device)
    uniq, inv = torch.unique(lin, return_inverse=True)
    last = torch.full((uniq.shape[0],), -1, dtype=torch.long, device=ii.device)
    last = last.scatter_reduce(0, inv, pos, reduce="amax")
    keep = last[inv] == pos
    return data.index_put(tuple(ii[keep].unbind(-1)), u[keep])


def _scatter_nd(a, xs, c):
    data, idx, upd = xs
    k = idx.shape[-1]
    ii = idx.reshape(-1, k).long()
    if ii.shape[0] == 0:
        return [data.clone()]
    ii = torch.remainder(ii, torch.tensor(data.shape[:k], dtype=torch.long, device=ii.device))
    return [_put_last(data, ii, upd.reshape((-1,) + tuple(data.shape[k:])))]


def _scatter_elements(a, xs, c):
    data, idx, upd = xs
    ax = a["axis"] % data.dim()
    if idx.numel() == 0:
        return [data.clone()]
    grids = list(torch.meshgrid(*(torch.arange(n, device=idx.device) for n in idx.shape), indexing="ij"))
    grids[ax] = torch.remainder(idx.long(), data.shape[ax])
    ii = torch.stack([gr.reshape(-1) for gr in grids], 1)
    return [_put_last(data, ii, upd.reshape(-1))]


def _cumsum(a, xs, c):
    x = xs[0]
    ax = a["axis"] % x.dim()
    y = torch.flip(x, (ax,)) if a["reverse"] else x
    s = torch.cumsum(y, ax, dtype=x.dtype)
    if a["exclusive"]:
        n = s.shape[ax]
        s = torch.cat([torch.zeros_like(s.narrow(ax, 0, min(n, 1))), s.narrow(ax, 0, max(n - 1, 0))], ax)
    if a["reverse"]:
        s = torch.flip(s, (ax,))
    return [s]


KERNELS.update({
    "Where": _where,
    "Equal": lambda a, xs, c: [torch.eq(xs[0], xs[1])],
    "Less": lambda a, xs, c: [torch.lt(xs[0], xs[1])],
    "Greater": lambda a, xs, c: [torch.gt(xs[0], xs[1])],
    "LessOrEqual": lambda a, xs, c: [torch.le(xs[0], xs[1])],
    "GreaterOrEqual": lambda a, xs, c: [torch.ge(xs[0], xs[1])],
    "Not": lambda a, xs, c: [torch.logical_not(xs[0])],
    "And": lambda a, xs, c: [torch.logical_and(xs[0], xs[1])],
    "Or": lambda a, xs, c: [torch.logical_or(xs[0], xs[1])],
    "Xor": lambda a, xs, c: [torch.logical_xor(xs[0], xs[1])],
    "GatherElements": _gather_elements,
    "GatherND": _gather_nd,
    "Tile": _tile,
    "Einsum": _einsum,
    "Trilu": _trilu,
    "ScatterND": _scatter_nd,
    "ScatterElements": _scatter_elements,
    "CumSum": _cumsum,
})
