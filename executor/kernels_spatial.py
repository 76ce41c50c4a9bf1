"""Torch kernels for :mod:`unity_pcg.ops.spatial` (registered into :data:`unity_pcg.executor.kernels.KERNELS`).

They follow the numpy reference; Resize and Pad take their index tables from the same functions
(:func:`unity_pcg.ops.spatial.resize_taps`, :func:`~unity_pcg.ops.spatial.pad_index`), so both sides
interpolate and pad identically.  Instance and group normalization use the piece's own statistics: their
normalized dims are never partitioned (the labels refuse it), so a piece holds whole instances / groups.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from unity_pcg.ops import spatial as S

from .kernels import KERNELS


def _spatial_pad(x: torch.Tensor, pad, value: float) -> torch.Tensor:
    """ONNX-order padding (all begins, then all ends) of dims 2.. as torch's last-dim-first list."""
    n = x.dim() - 2
    if not any(pad):
        return x
    tp = []
    for j in reversed(range(n)):
        tp += [int(pad[j]), int(pad[j + n])]
    return F.pad(x, tp, value=value)


def _windows(x: torch.Tensor, kernel, stride, dil) -> torch.Tensor:
    """(N, C, *S) -> (N, C, *O, *k) with dilated windows, as unfold views."""
    n = len(kernel)
    for j in range(n):
        span = (kernel[j] - 1) * dil[j] + 1
        x = x.unfold(2 + j, span, stride[j])       # appends the window dim last
        if dil[j] > 1:
            x = x[..., ::dil[j]]
    return x


def _conv3d(a, xs, ctx):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) == 3 else None
    stride, dil, pad = tuple(a["stride"]), tuple(a["dilation"]), tuple(a["padding"])
    return [F.conv3d(_spatial_pad(x, pad, 0.0), w, b, stride, 0, dil, int(a["groups"]))]


def _pool(n):
    def k(a, xs, ctx):
        x = xs[0]
        axes = tuple(range(2, 2 + n))
        if a["global_pool"]:
            return [x.amax(dim=axes, keepdim=True) if a["kind"] == "max" else x.mean(dim=axes, keepdim=True)]
        kernel, stride, dil, pad = S.pool_geometry("Pool", a, n)
        ends = list(pad[n:])
        if a["ceil_mode"]:
            for j in range(n):
                ends[j] += S.ceil_extra(x.shape[2 + j], (kernel[j] - 1) * dil[j] + 1, stride[j], pad[j], pad[j + n])
        full = tuple(pad[:n]) + tuple(ends)
        dims = tuple(range(-n, 0))
        if a["kind"] == "max":
            return [_windows(_spatial_pad(x, full, -math.inf), kernel, stride, dil).amax(dim=dims)]
        s = _windows(_spatial_pad(x, full, 0.0), kernel, stride, dil).sum(dim=dims)
        ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        if a["count_include_pad"]:
            ones = _spatial_pad(ones, pad, 1.0)
            ones = _spatial_pad(ones, (0,) * n + tuple(e - p for e, p in zip(ends, pad[n:])), 0.0)
        else:
            ones = _spatial_pad(ones, full, 0.0)
        cnt = _windows(ones, kernel, stride, dil).sum(dim=dims)
        return [s / torch.clamp(cnt, min=1.0)]
    return k


_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv_transpose(a, xs, ctx):
    x, w = xs[0], xs[1]
    n = x.dim() - 2
    stride, dil, pad, opad = S.convtranspose_geometry(a, n)
    y = _CONVT[n](x, w, None, stride, 0, 0, int(a["groups"]), dil)
    if any(opad):   # output_padding appends zeros (bias only) at the end of each dim, before cropping
        y = _spatial_pad(y, (0,) * n + tuple(opad), 0.0)
    for j in range(n):
        if pad[j] or pad[j + n]:
            y = y.narrow(2 + j, pad[j], y.shape[2 + j] - pad[j] - pad[j + n])
    if len(xs) == 3:
        y = y + xs[2].reshape((1, -1) + (1,) * n)
    return [y]


def _instance_norm(a, xs, ctx):
    x, scale, bias = xs
    dims = tuple(range(2, x.dim()))
    sh = (1, -1) + (1,) * (x.dim() - 2)
    mu = x.mean(dim=dims, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=dims, keepdim=True)
    return [(x - mu) / torch.sqrt(var + float(a["eps"])) * scale.reshape(sh) + bias.reshape(sh)]


def _group_norm(a, xs, ctx):
    x, scale, bias = xs
    return [F.group_norm(x, int(a["groups"]), scale, bias, float(a["eps"]))]


def _resize(a, xs, ctx):
    x = xs[0]
    y = x
    for j in range(x.dim()):
        if x.shape[j] == a["sizes"][j] and a["scales"][j] == 1.0:
            continue
        idx, wts = S.resize_taps(x.shape[j], a["sizes"][j], a["scales"][j], a["mode"], a["coordinate_mode"],
                                 a["nearest_mode"])
        sh = [1] * x.dim()
        sh[j] = -1
        acc = None
        for i, w in zip(idx, wts):
            t = y.index_select(j, torch.as_tensor(i, device=x.device))
            t = t * torch.as_tensor(w, dtype=x.dtype, device=x.device).reshape(sh)
            acc = t if acc is None else acc + t
        y = acc
    return [y]


def _pad(a, xs, ctx):
    x = xs[0]
    r = x.dim()
    pads = a["pads"]
    if a["mode"] == "constant":
        tp = []
        for j in reversed(range(r)):
            tp += [int(pads[j]), int(pads[j + r])]
        return [F.pad(x, tp, value=float(a["value"]))]
    y = x
    for j in range(r):
        if pads[j] or pads[j + r]:
            idx = S.pad_index(x.shape[j], pads[j], pads[j + r], a["mode"])
            y = y.index_select(j, torch.as_tensor(idx, device=x.device))
    return [y]


KERNELS.update({
    "Conv3d": _conv3d,
    "Pool1d": _pool(1),
    "Pool3d": _pool(3),
    "ConvTranspose": _conv_transpose,
    "InstanceNorm": _instance_norm,
    "GroupNorm": _group_norm,
    "Resize": _resize,
    "Pad": _pad,
})
