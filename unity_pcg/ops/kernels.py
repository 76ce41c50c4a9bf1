"""Numpy reference kernels shared by several operators (convolution, pooling, erf)."""
from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    y = np.asarray(_erf(x.astype(np.float64)), dtype=np.float64)   # frompyfunc gives a bare float for 0-d input
    return y.astype(x.dtype if x.dtype.kind == "f" else np.float64)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


ACTIVATIONS = {
    "none": lambda x: x,
    "relu": lambda x: np.maximum(x, 0),
    "gelu": gelu,
    "sigmoid": sigmoid,
    "tanh": np.tanh,
}


def pad_nchw(x: np.ndarray, pads: tuple[int, int, int, int], value: float = 0.0) -> np.ndarray:
    top, left, bottom, right = pads
    if not any(pads):
        return x
    return np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=value)


def windows(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
            ) -> np.ndarray:
    """(N, C, H, W) -> (N, C, Ho, Wo, kh, kw) strided view of the sliding windows."""
    kh, kw = kernel
    sh, sw = stride
    dh, dw = dilation
    span_h, span_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    v = np.lib.stride_tricks.sliding_window_view(x, (span_h, span_w), axis=(2, 3))
    v = v[:, :, ::sh, ::sw, ::dh, ::dw]
    return v


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride, padding, dilation, groups: int
           ) -> np.ndarray:
    x = pad_nchw(x, tuple(padding))
    n, c = x.shape[:2]
    co, cig, kh, kw = w.shape
    win = windows(x, (kh, kw), tuple(stride), tuple(dilation))  # N, C, Ho, Wo, kh, kw
    ho, wo = win.shape[2], win.shape[3]
    cog = co // groups
    outs = []
    for g in range(groups):
        wg = w[g * cog:(g + 1) * cog]                                 # cog, cig, kh, kw
        xg = win[:, g * cig:(g + 1) * cig]                            # N, cig, Ho, Wo, kh, kw
        outs.append(np.einsum("nchwij,ocij->nohw", xg, wg, optimize=True))
    y = np.concatenate(outs, axis=1) if groups > 1 else outs[0]
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y.astype(np.result_type(x, w), copy=False)


def pool2d(x: np.ndarray, kind: str, kernel, stride, padding, count_include_pad: bool, ceil_mode: bool
           ) -> np.ndarray:
    kh, kw = kernel
    sh, sw = stride
    top, left, bottom, right = padding
    h, w = x.shape[2], x.shape[3]
    if ceil_mode:  # extra padding at the end so the last partial window counts
        def extra(size, k, s, p0, p1):
            out = -(-(size + p0 + p1 - k) // s) + 1
            if (out - 1) * s >= size + p0:  # a window must start inside the input or left padding
                out -= 1
            return max(0, (out - 1) * s + k - (size + p0 + p1))
        bottom += extra(h, kh, sh, top, bottom)
        right += extra(w, kw, sw, left, right)
    if kind == "max":
        xp = pad_nchw(x, (top, left, bottom, right), -np.inf)
        return windows(xp, (kh, kw), (sh, sw), (1, 1)).max(axis=(-1, -2)).astype(x.dtype, copy=False)
    xp = pad_nchw(x, (top, left, bottom, right), 0.0)
    s = windows(xp, (kh, kw), (sh, sw), (1, 1)).sum(axis=(-1, -2))
    if count_include_pad:
        # padding added for ceil_mode never counts
        ones = pad_nchw(np.ones((1, 1, h, w), x.dtype), tuple(padding), 1.0)
        ones = pad_nchw(ones, (0, 0, bottom - padding[2], right - padding[3]), 0.0)
    else:
        ones = pad_nchw(np.ones((1, 1, h, w), x.dtype), (top, left, bottom, right), 0.0)
    cnt = windows(ones, (kh, kw), (sh, sw), (1, 1)).sum(axis=(-1, -2))
    return (s / np.maximum(cnt, 1)).astype(x.dtype, copy=False)


def pool_out(size: int, k: int, s: int, p0: int, p1: int, ceil_mode: bool) -> int:
    if ceil_mode:
        out = -(-(size + p0 + p1 - k) // s) + 1
        if (out - 1) * s >= size + p0:
            out -= 1
        return out
    return (size + p0 + p1 - k) // s + 1
