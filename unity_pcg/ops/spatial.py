"""Spatial operators added for ONNX import coverage (issue 10): N-d convolution and pooling, ConvTranspose,
instance/group normalization, Resize, Pad; registered with :func:`unity_pcg.ops.compute.compute_op`.

The 2-D ``Conv2d`` / ``Pool2d`` of :mod:`.compute` are in the rule vocabulary and stay as they are (1-D
convolutions import as ``Conv2d`` with height 1); the operators here are new:

* ``Conv3d`` (NCDHW, weight OIDHW), ``Pool1d`` and ``Pool3d`` (max/avg, global, dilated windows): the same
  label structure as ``Conv2d``/``Pool2d`` -- a spatial dim stays shardable only where windows never cross a
  piece boundary (:func:`window_labels`).
* ``ConvTranspose`` (1-D, 2-D, 3-D; ONNX weight layout (C_in, C_out/groups, k...)), ``InstanceNorm``,
  ``GroupNorm`` (per-channel scale and bias), ``Resize`` (nearest / linear, ONNX coordinate transforms; a
  fixed linear map, so partial sums pass through) and ``Pad`` (constant / reflect / edge / wrap).

Padding lists are ONNX's: all begins, then all ends.  The index arithmetic of Resize and Pad
(:func:`resize_taps`, :func:`pad_index`) is shared with the torch kernels, so both follow one definition.
"""
from __future__ import annotations

import itertools
import math
from math import prod

import numpy as np

from .base import NOTHING, REQUIRED, Labels, Saves
from .compute import ATTR_KINDS, _bad, _dims, _is_int, compute_op, conv_class

_WIN = {"stride": "int|ints", "padding": "int|ints", "dilation": "int|ints"}
ATTR_KINDS.update({
    "Conv3d": {**_WIN, "groups": "int"},
    "Pool1d": {**_WIN, "kind": "str", "kernel": "int|ints", "global_pool": "bool", "count_include_pad": "bool",
               "ceil_mode": "bool"},
    "Pool3d": {**_WIN, "kind": "str", "kernel": "int|ints", "global_pool": "bool", "count_include_pad": "bool",
               "ceil_mode": "bool"},
    "ConvTranspose": {"stride": "ints", "padding": "ints", "dilation": "ints", "output_padding": "ints",
                      "groups": "int"},
    "InstanceNorm": {"eps": "num"},
    "GroupNorm": {"groups": "int", "eps": "num"},
    "Resize": {"sizes": "ints", "mode": "str", "coordinate_mode": "str", "nearest_mode": "str"},
    "Pad": {"pads": "ints", "mode": "str", "value": "num"},
})


def _nints(op: str, name: str, v, n: int, lo: int, default: int | None = None) -> tuple[int, ...]:
    """``n`` ints >= ``lo`` from an int or a tuple; an empty tuple means ``default`` everywhere."""
    if default is not None and isinstance(v, (tuple, list)) and len(v) == 0:
        return (default,) * n
    t = tuple(v) if isinstance(v, (tuple, list)) else (v,) * n
    if len(t) != n or not all(_is_int(x) and x >= lo for x in t):
        _bad(op, f"{name} must be {n} ints >= {lo}, got {v!r}")
    return t


def _span(k: int, d: int) -> int:
    return (k - 1) * d + 1


# --- sliding windows ---------------------------------------------------------------------------------

def window_labels(x, kernel, stride, dilation, padding, what: str):
    """Spatial labels (input, output) of a sliding-window operator over x's dims 2.., and the reasons for
    the unshardable ones: the N-d form of ``compute._window_labels``.  A spatial dim stays shardable when no
    padding touches it, windows do not overlap (span <= stride) and every piece starts a window."""
    n = len(kernel)
    sp_in, sp_out, reason = [], [], {}
    for j in range(n):
        size, deg = x.sizes[2 + j], x.degrees[2 + j]
        span = _span(kernel[j], dilation[j])
        piece = size // deg if deg else size
        name = f"s{j}"
        if padding[j] == 0 and padding[j + n] == 0 and span <= stride[j] and piece % stride[j] == 0:
            sp_in.append(name)
            sp_out.append(name)
            continue
        sp_in.append(name + "i")
        sp_out.append(name + "o")
        if padding[j] or padding[j + n]:
            reason[name + "i"] = f"{what} window reads padding at piece boundaries (no halo exchange)"
        elif span > stride[j]:
            reason[name + "i"] = f"{what} windows overlap neighbouring pieces (no halo exchange)"
        else:
            reason[name + "i"] = f"its piece size {piece} is not a multiple of the stride {stride[j]}"
    return tuple(sp_in), tuple(sp_out), reason


def np_windows(x: np.ndarray, kernel, stride, dilation) -> np.ndarray:
    """(N, C, *S) -> (N, C, *O, *k): strided view of the (dilated) sliding windows over dims 2.."""
    n = len(kernel)
    spans = tuple(_span(k, d) for k, d in zip(kernel, dilation))
    v = np.lib.stride_tricks.sliding_window_view(x, spans, axis=tuple(range(2, 2 + n)))
    idx = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride) + \
        tuple(slice(None, None, d) for d in dilation)
    return v[idx]


def _pad_spatial(x: np.ndarray, padding, value: float) -> np.ndarray:
    n = x.ndim - 2
    if not any(padding):
        return x
    return np.pad(x, ((0, 0), (0, 0)) + tuple((padding[j], padding[j + n]) for j in range(n)),
                  constant_values=value)


# --- N-d convolution ----------------------------------------------------------------------------------

def _conv_nd(op: str, n: int):
    def attrs_of(a):
        return (_nints(op, "stride", a["stride"], n, 1), _nints(op, "dilation", a["dilation"], n, 1),
                _nints(op, "padding", a["padding"], 2 * n, 0))

    def logical(a, ins):
        x, w = ins[0], ins[1]
        if x.rank != n + 2 or w.rank != n + 2:
            _bad(op, f"expects a rank-{n + 2} input and weight, got {list(x.sizes)} and {list(w.sizes)}")
        g = a["groups"]
        c, co, cig = x.sizes[1], w.sizes[0], w.sizes[1]
        if g < 1 or c % g or co % g or cig * g != c:
            _bad(op, f"groups={g} does not fit {c} input channels and weight {list(w.sizes)}")
        if len(ins) == 3 and ins[2].sizes != (co,):
            _bad(op, f"bias {list(ins[2].sizes)} does not match {co} output channels")
        stride, dil, pad = attrs_of(a)
        out = []
        for j in range(n):
            o = (x.sizes[2 + j] + pad[j] + pad[j + n] - _span(w.sizes[2 + j], dil[j])) // stride[j] + 1
            if o < 1 or w.sizes[2 + j] < 1:
                _bad(op, f"kernel {list(w.sizes[2:])} larger than padded input {list(x.sizes[2:])}")
            out.append(o)
        return [((x.sizes[0], co) + tuple(out), x.dtype)]

    def labels(a, ins, outs):
        x, w = ins[0], ins[1]
        g = a["groups"]
        stride, dil, pad = attrs_of(a)
        sp_in, sp_out, reason = window_labels(x, w.sizes[2:], stride, dil, pad, "a convolution")
        ks = _dims("k", n)
        un = set(ks) | {l for l in sp_in if l.endswith("i")} | {"cg"}
        if g == 1:
            li = [("n", "ci") + sp_in, ("co", "ci") + ks]
            lo = ("n", "co") + sp_out
            if len(ins) == 3:
                un.add("ci")
                reason["ci"] = "it is contracted and the bias would be added to every partial sum"
        else:
            d = x.degrees[1]
            if g % d:
                _bad(op, f"input channel degree {d} does not divide groups={g} (pieces must hold whole groups)")
            li = [("n", "c") + sp_in, ("c", "cg") + ks]
            lo = ("n", "c") + sp_out
            reason["cg"] = "channels within a group cannot be split"
        if len(ins) == 3:
            li.append((lo[1],))
        return Labels(tuple(li), (lo,), frozenset(un), (True, True) if len(ins) == 2 else (), reason)

    def forward(a, xs):
        x, w = xs[0], xs[1]
        stride, dil, pad = attrs_of(a)
        g = a["groups"]
        win = np_windows(_pad_spatial(x, pad, 0.0), w.shape[2:], stride, dil)   # N, C, *O, *k
        cig, cog = w.shape[1], w.shape[0] // g
        letters = "defghijklm"[:n]
        ks = "pqrstuvwxy"[:n]
        spec = f"nc{letters}{ks},oc{ks}->no{letters}"
        outs = [np.einsum(spec, win[:, k * cig:(k + 1) * cig], w[k * cog:(k + 1) * cog], optimize=True)
                for k in range(g)]
        y = np.concatenate(outs, axis=1) if g > 1 else outs[0]
        if len(xs) == 3:
            y = y + xs[2].reshape((1, -1) + (1,) * n)
        return [y.astype(np.result_type(x, w), copy=False)]

    def piece_attrs(a, ins, outs):
        g = a["groups"]
        d = ins[0].degrees[1]
        if g > 1:
            if g % d:
                _bad(op, f"channel degree {d} does not divide groups={g}")
            return {**a, "groups": g // d}
        return a

    compute_op(op, attrs={"stride": (1,) * n, "padding": (0,) * (2 * n), "dilation": (1,) * n, "groups": 1},
               num_inputs=(2, 3), logical=logical, labels=labels, forward=forward,
               flops=lambda a, i, o: 2.0 * o[0].numel * prod(i[1].sizes[1:]) + (o[0].numel if len(i) == 3 else 0),
               piece_attrs=piece_attrs, cost_class=conv_class, autocast="low", saves=Saves({0}),
               doc=f"{n}-D convolution, weight (C_out, C_in/groups, k...); padding is all begins then all ends.")


_conv_nd("Conv3d", 3)


# --- N-d pooling --------------------------------------------------------------------------------------

def pool_out(size: int, span: int, s: int, p0: int, p1: int, ceil_mode: bool) -> int:
    """Output length of a window of extent ``span`` (kernel with dilation) over a padded dim."""
    if ceil_mode:
        out = -(-(size + p0 + p1 - span) // s) + 1
        if (out - 1) * s >= size + p0:   # the last window must start inside the input or the left padding
            out -= 1
        return out
    return (size + p0 + p1 - span) // s + 1


def pool_geometry(op: str, a: dict, n: int):
    kernel = _nints(op, "kernel", a["kernel"], n, 1)
    stride = _nints(op, "stride", a["stride"], n, 1)
    dil = _nints(op, "dilation", a["dilation"], n, 1)
    pad = _nints(op, "padding", a["padding"], 2 * n, 0)
    return kernel, stride, dil, pad


def _pool_nd(op: str, n: int):
    def logical(a, ins):
        x = ins[0]
        if x.rank != n + 2:
            _bad(op, f"expects a rank-{n + 2} (N, C, ...) input, got {list(x.sizes)}")
        if a["kind"] not in ("max", "avg"):
            _bad(op, f"kind must be max or avg, got {a['kind']!r}")
        if a["global_pool"]:
            if prod(x.sizes[2:]) == 0:
                _bad(op, f"global pooling of an empty {list(x.sizes[2:])} input")
            return [(x.sizes[:2] + (1,) * n, x.dtype)]
        kernel, stride, dil, pad = pool_geometry(op, a, n)
        out = []
        for j in range(n):
            span = _span(kernel[j], dil[j])
            if pad[j] >= span or pad[j + n] >= span:
                _bad(op, f"padding {list(pad)} must be smaller than the window {list(kernel)} "
                         f"(a window would hold only padding)")
            o = pool_out(x.sizes[2 + j], span, stride[j], pad[j], pad[j + n], bool(a["ceil_mode"]))
            if o < 1:
                _bad(op, f"window {list(kernel)} larger than padded input {list(x.sizes[2:])}")
            out.append(o)
        return [(x.sizes[:2] + tuple(out), x.dtype)]

    def labels(a, ins, outs):
        x = ins[0]
        if a["global_pool"]:
            single = prod(x.sizes[2:]) == 1
        else:
            single = prod(_nints(op, "kernel", a["kernel"], n, 1)) == 1
        lin = "additive" if a["kind"] == "avg" or single else ()
        if a["global_pool"]:
            why = "the global pool reduces over it"
            li = tuple(f"s{j}i" for j in range(n))
            return Labels((("n", "c") + li,), (("n", "c") + tuple(f"s{j}o" for j in range(n)),), frozenset(li),
                          lin, {l: why for l in li})
        kernel, stride, dil, pad = pool_geometry(op, a, n)
        sp_in, sp_out, reason = window_labels(x, kernel, stride, dil, pad, "a pooling")
        return Labels((("n", "c") + sp_in,), (("n", "c") + sp_out,),
                      frozenset(l for l in sp_in if l.endswith("i")), lin, reason)

    def forward(a, xs):
        x = xs[0]
        axes = tuple(range(2, 2 + n))
        if a["global_pool"]:
            f = np.max if a["kind"] == "max" else np.mean
            return [f(x, axis=axes, keepdims=True).astype(x.dtype, copy=False)]
        return [pool_nd(x, a["kind"], *pool_geometry(op, a, n), bool(a["count_include_pad"]),
                        bool(a["ceil_mode"]))]

    def flops(a, i, o):
        if a["global_pool"]:
            return float(i[0].numel)
        return float(o[0].numel * prod(_nints(op, "kernel", a["kernel"], n, 1)))

    compute_op(op, attrs={"kind": "max", "kernel": (1,) * n, "stride": (1,) * n, "padding": (0,) * (2 * n),
                          "dilation": (1,) * n, "global_pool": False, "count_include_pad": False,
                          "ceil_mode": False},
               num_inputs=1, logical=logical, labels=labels, forward=forward, flops=flops,
               cost_class="pool", autocast="follow", saves=Saves({0}),
               doc=f"{n}-D max/average pooling (dilated windows, ceil_mode, count_include_pad) or global pooling.")


def ceil_extra(size: int, span: int, s: int, p0: int, p1: int) -> int:
    """Padding added at the end so ceil_mode's last partial window exists (it never counts as padding)."""
    out = pool_out(size, span, s, p0, p1, True)
    return max(0, (out - 1) * s + span - (size + p0 + p1))


def pool_nd(x: np.ndarray, kind: str, kernel, stride, dil, pad, count_include_pad: bool, ceil_mode: bool
            ) -> np.ndarray:
    n = len(kernel)
    sizes = x.shape[2:]
    ends = list(pad[n:])
    if ceil_mode:
        for j in range(n):
            ends[j] += ceil_extra(sizes[j], _span(kernel[j], dil[j]), stride[j], pad[j], pad[j + n])
    full = tuple(pad[:n]) + tuple(ends)
    axes = tuple(range(-n, 0))
    if kind == "max":
        w = np_windows(_pad_spatial(x, full, -np.inf), kernel, stride, dil)
        return w.max(axis=axes).astype(x.dtype, copy=False)
    s = np_windows(_pad_spatial(x, full, 0.0), kernel, stride, dil).sum(axis=axes)
    ones = np.ones((1, 1) + sizes, x.dtype)
    if count_include_pad:   # the declared padding counts, ceil_mode's extra does not
        ones = _pad_spatial(ones, pad, 1.0)
        ones = _pad_spatial(ones, (0,) * n + tuple(e - p for e, p in zip(ends, pad[n:])), 0.0)
    else:
        ones = _pad_spatial(ones, full, 0.0)
    cnt = np_windows(ones, kernel, stride, dil).sum(axis=axes)
    return (s / np.maximum(cnt, 1)).astype(x.dtype, copy=False)


_pool_nd("Pool1d", 1)
_pool_nd("Pool3d", 3)


# --- ConvTranspose ------------------------------------------------------------------------------------

def convtranspose_geometry(a: dict, n: int):
    op = "ConvTranspose"
    return (_nints(op, "stride", a["stride"], n, 1, 1), _nints(op, "dilation", a["dilation"], n, 1, 1),
            _nints(op, "padding", a["padding"], 2 * n, 0, 0),
            _nints(op, "output_padding", a["output_padding"], n, 0, 0))


def _ct_logical(a, ins):
    x, w = ins[0], ins[1]
    if x.rank not in (3, 4, 5) or w.rank != x.rank:
        _bad("ConvTranspose", f"expects an (N, C, 1 to 3 spatial dims) input and a weight of the same rank, "
                              f"got {list(x.sizes)} and {list(w.sizes)}")
    n = x.rank - 2
    g = a["groups"]
    c, cog = x.sizes[1], w.sizes[1]
    if not _is_int(g) or g < 1 or c % g or w.sizes[0] != c:
        _bad("ConvTranspose", f"groups={g} does not fit {c} input channels and weight {list(w.sizes)}")
    co = cog * g
    if len(ins) == 3 and ins[2].sizes != (co,):
        _bad("ConvTranspose", f"bias {list(ins[2].sizes)} does not match {co} output channels")
    stride, dil, pad, opad = convtranspose_geometry(a, n)
    out = []
    for j in range(n):
        if x.sizes[2 + j] < 1 or w.sizes[2 + j] < 1:
            _bad("ConvTranspose", f"empty input {list(x.sizes)} or kernel {list(w.sizes)}")
        o = (x.sizes[2 + j] - 1) * stride[j] + _span(w.sizes[2 + j], dil[j]) + opad[j] - pad[j] - pad[j + n]
        if o < 1:
            _bad("ConvTranspose", f"padding {list(pad)} leaves no output for input {list(x.sizes[2:])}")
        out.append(o)
    return [((x.sizes[0], co) + tuple(out), x.dtype)]


def _ct_labels(a, ins, outs):
    x, w = ins[0], ins[1]
    n = x.rank - 2
    g = a["groups"]
    stride, dil, pad, opad = convtranspose_geometry(a, n)
    sp_in, sp_out, reason = [], [], {}
    for j in range(n):
        # input element i writes output [i*s, i*s + span): pieces map to pieces when the spans tile the
        # output exactly (span == stride) and nothing is cropped or appended
        if _span(w.sizes[2 + j], dil[j]) == stride[j] and pad[j] == pad[j + n] == opad[j] == 0:
            sp_in.append(f"s{j}")
            sp_out.append(f"s{j}")
        else:
            sp_in.append(f"s{j}i")
            sp_out.append(f"s{j}o")
            reason[f"s{j}i"] = "transposed-convolution windows overlap, leave gaps or are cropped at piece " \
                               "boundaries (no halo exchange)"
    ks = _dims("k", n)
    un = set(ks) | {l for l in sp_in if l.endswith("i")} | {"cg"}
    if g == 1:
        li = [("n", "ci") + tuple(sp_in), ("ci", "co") + ks]
        lo = ("n", "co") + tuple(sp_out)
        if len(ins) == 3:
            un.add("ci")
            reason["ci"] = "it is contracted and the bias would be added to every partial sum"
    else:
        d = x.degrees[1]
        if g % d:
            _bad("ConvTranspose", f"input channel degree {d} does not divide groups={g} "
                                  f"(pieces must hold whole groups)")
        li = [("n", "c") + tuple(sp_in), ("c", "cg") + ks]
        lo = ("n", "c") + tuple(sp_out)
        reason["cg"] = "channels within a group cannot be split"
    if len(ins) == 3:
        li.append((lo[1],))
    return Labels(tuple(li), (lo,), frozenset(un), (True, True) if len(ins) == 2 else (), reason)


def _ct_fwd(a, xs):
    x, w = xs[0], xs[1]
    n = x.ndim - 2
    stride, dil, pad, opad = convtranspose_geometry(a, n)
    g = a["groups"]
    cig, cog = x.shape[1] // g, w.shape[1]
    ins = x.shape[2:]
    full = tuple((ins[j] - 1) * stride[j] + _span(w.shape[2 + j], dil[j]) + opad[j] for j in range(n))
    dt = np.result_type(x, w)
    y = np.zeros((x.shape[0], cog * g) + full, dt)
    letters = "defghijklm"[:n]
    for k in range(g):
        xg, wg = x[:, k * cig:(k + 1) * cig], w[k * cig:(k + 1) * cig]
        for off in itertools.product(*(range(s) for s in w.shape[2:])):
            contrib = np.einsum(f"nc{letters},co->no{letters}", xg, wg[(slice(None), slice(None)) + off])
            sl = tuple(slice(off[j] * dil[j], off[j] * dil[j] + (ins[j] - 1) * stride[j] + 1, stride[j])
                       for j in range(n))
            y[(slice(None), slice(k * cog, (k + 1) * cog)) + sl] += contrib
    crop = tuple(slice(pad[j], full[j] - pad[j + n]) for j in range(n))
    y = y[(slice(None), slice(None)) + crop]
    if len(xs) == 3:
        y = y + xs[2].reshape((1, -1) + (1,) * n)
    return [np.ascontiguousarray(y).astype(dt, copy=False)]


def _ct_piece_attrs(a, ins, outs):
    g = a["groups"]
    if g > 1:
        d = ins[0].degrees[1]
        if g % d:
            _bad("ConvTranspose", f"channel degree {d} does not divide groups={g}")
        return {**a, "groups": g // d}
    return a


compute_op("ConvTranspose", attrs={"stride": (), "padding": (), "dilation": (), "output_padding": (), "groups": 1},
           num_inputs=(2, 3), logical=_ct_logical, labels=_ct_labels, forward=_ct_fwd,
           flops=lambda a, i, o: 2.0 * i[0].numel * prod(i[1].sizes[1:]) + (o[0].numel if len(i) == 3 else 0),
           piece_attrs=_ct_piece_attrs, cost_class=conv_class, autocast="low", saves=Saves({0}),
           doc="Transposed convolution over 1 to 3 spatial dims, ONNX semantics: weight (C_in, C_out/groups, "
               "k...); output (in-1)*stride + (k-1)*dilation + 1 + output_padding - pad_begin - pad_end; "
               "empty tuples mean the defaults (stride/dilation 1, no padding).")


# --- instance and group normalization ------------------------------------------------------------------

def _norm_logical(op, min_rank):
    def logical(a, ins):
        x = ins[0]
        if x.rank < min_rank:
            _bad(op, f"expects an (N, C, ...) input of rank >= {min_rank}, got {list(x.sizes)}")
        for i, p in enumerate(ins[1:], 1):
            if p.sizes != (x.sizes[1],):
                _bad(op, f"input {i} has shape {list(p.sizes)}, expected [{x.sizes[1]}]")
        per = prod(x.sizes[2:])
        if op == "GroupNorm":
            g = a["groups"]
            if g < 1 or x.sizes[1] % g:
                _bad(op, f"groups={g} does not divide {x.sizes[1]} channels")
            per *= x.sizes[1] // g
        if per == 0:
            _bad(op, f"normalizes over empty sets: input {list(x.sizes)}")
        if not (isinstance(a["eps"], (int, float)) and a["eps"] >= 0):
            _bad(op, f"eps must be a number >= 0, got {a['eps']!r}")
        return [(x.sizes, x.dtype)]
    return logical


def _in_labels(a, ins, outs):
    sp = _dims("s", ins[0].rank - 2)
    lab = ("n", "c") + sp
    return Labels((lab, ("c",), ("c",)), (lab,), frozenset(sp), (),
                  {l: "instance norm normalizes over it" for l in sp})


def _in_fwd(a, xs):
    x, scale, bias = xs
    axes = tuple(range(2, x.ndim))
    sh = (1, -1) + (1,) * (x.ndim - 2)
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + a["eps"]) * scale.reshape(sh) + bias.reshape(sh)
    return [y.astype(x.dtype, copy=False)]


compute_op("InstanceNorm", attrs={"eps": 1e-5}, num_inputs=3, logical=_norm_logical("InstanceNorm", 3),
           labels=_in_labels, forward=_in_fwd, flops=lambda a, i, o: 8.0 * o[0].numel,
           cost_class="norm", autocast="follow", saves=Saves({0}),
           doc="Inputs x (N, C, ...), scale (C), bias (C): each (sample, channel) normalized over the spatial dims.")


def _gn_labels(a, ins, outs):
    x = ins[0]
    d = x.degrees[1]
    if a["groups"] % d:
        _bad("GroupNorm", f"channel degree {d} does not divide groups={a['groups']} (pieces must hold whole groups)")
    sp = _dims("s", x.rank - 2)
    lab = ("n", "c") + sp
    return Labels((lab, ("c",), ("c",)), (lab,), frozenset(sp), (),
                  {l: "group norm normalizes over it" for l in sp})


def _gn_fwd(a, xs):
    x, scale, bias = xs
    g = a["groups"]
    n, c = x.shape[:2]
    xr = x.reshape((n, g, (c // g) * prod(x.shape[2:])))   # explicit: an empty batch has no -1 to infer
    mu = xr.mean(axis=2, keepdims=True)
    var = ((xr - mu) ** 2).mean(axis=2, keepdims=True)
    y = ((xr - mu) / np.sqrt(var + a["eps"])).reshape(x.shape)
    sh = (1, -1) + (1,) * (x.ndim - 2)
    return [(y * scale.reshape(sh) + bias.reshape(sh)).astype(x.dtype, copy=False)]


compute_op("GroupNorm", attrs={"groups": REQUIRED, "eps": 1e-5}, num_inputs=3, logical=_norm_logical("GroupNorm", 2),
           labels=_gn_labels, forward=_gn_fwd, flops=lambda a, i, o: 8.0 * o[0].numel,
           cost_class="norm", autocast="fp32", saves=Saves({0}),
           piece_attrs=lambda a, ins, outs: {**a, "groups": a["groups"] // ins[0].degrees[1]},
           doc="Inputs x (N, C, ...), scale (C), bias (C) (per channel, ONNX opset 21's form): channels in "
               "`groups` groups, each (sample, group) normalized over its channels and the spatial dims.")


# --- Resize ---------------------------------------------------------------------------------------------

RESIZE_MODES = ("nearest", "linear")
COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
                    "half_pixel_symmetric")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coords(in_len: int, out_len: int, scale: float, mode: str) -> np.ndarray:
    """ONNX Resize's coordinate transformation: output index -> (fractional) input coordinate."""
    x = np.arange(out_len, dtype=np.float64)
    if mode == "asymmetric":
        return x / scale
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len)
    if mode == "align_corners":
        return x * (in_len - 1) / (out_len - 1) if out_len > 1 else np.zeros(out_len)
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if mode == "half_pixel_symmetric":
        adj = out_len / (scale * in_len)
        offset = in_len / 2 * (1 - adj)
        return offset + (x + 0.5) / scale - 0.5
    raise ValueError(mode)


def resize_taps(in_len: int, out_len: int, scale: float, mode: str, coordinate_mode: str, nearest_mode: str):
    """Per output index along one dim: (indices, weights), each a list of arrays (1 tap for nearest,
    2 for linear) such that out[i] = sum_t in[indices[t][i]] * weights[t][i].  Indices are clamped to the
    input (ONNX pads with edge values)."""
    c = source_coords(in_len, out_len, scale, coordinate_mode)
    if mode == "nearest":
        fl = np.floor(c)
        frac = c - fl
        if nearest_mode == "round_prefer_floor":
            idx = np.where(frac > 0.5, fl + 1, fl)
        elif nearest_mode == "round_prefer_ceil":
            idx = np.where(frac >= 0.5, fl + 1, fl)
        elif nearest_mode == "floor":
            idx = fl
        else:
            idx = np.ceil(c)
        idx = np.clip(idx, 0, in_len - 1).astype(np.int64)
        return [idx], [np.ones(out_len)]
    fl = np.floor(c)
    w1 = c - fl
    i0 = np.clip(fl, 0, in_len - 1).astype(np.int64)
    i1 = np.clip(fl + 1, 0, in_len - 1).astype(np.int64)
    return [i0, i1], [1.0 - w1, w1]


def _resize_scales(a, rank):
    sc = a["scales"]
    if not isinstance(sc, (tuple, list)) or len(sc) != rank or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in sc):
        _bad("Resize", f"scales must be {rank} positive numbers, got {sc!r}")
    return tuple(float(s) for s in sc)


def _resize_logical(a, ins):
    x = ins[0]
    sizes = tuple(a["sizes"])
    if len(sizes) != x.rank or any(s < 1 for s in sizes):
        _bad("Resize", f"sizes must be {x.rank} ints >= 1, got {list(sizes)}")
    _resize_scales(a, x.rank)
    if a["mode"] not in RESIZE_MODES:
        _bad("Resize", f"mode must be one of {', '.join(RESIZE_MODES)}, got {a['mode']!r}")
    if a["coordinate_mode"] not in COORDINATE_MODES:
        _bad("Resize", f"coordinate_mode {a['coordinate_mode']!r} is not one of {', '.join(COORDINATE_MODES)}")
    if a["nearest_mode"] not in NEAREST_MODES:
        _bad("Resize", f"nearest_mode {a['nearest_mode']!r} is not one of {', '.join(NEAREST_MODES)}")
    for j in _resized(a, x.sizes):
        if x.sizes[j] < 1:
            _bad("Resize", f"dim {j} of the input {list(x.sizes)} is empty; nothing to interpolate from")
    if x.dtype not in ("float32", "float64", "float16", "bfloat16"):
        _bad("Resize", f"expects a float input, got {x.dtype}")
    return [(sizes, x.dtype)]


def _resized(a, sizes) -> list[int]:
    return [j for j, (s, o, f) in enumerate(zip(sizes, a["sizes"], a["scales"])) if s != o or f != 1.0]


def _resize_labels(a, ins, outs):
    x = ins[0]
    res = set(_resized(a, x.sizes))
    li = tuple(f"r{j}i" if j in res else f"d{j}" for j in range(x.rank))
    lo = tuple(f"r{j}o" if j in res else f"d{j}" for j in range(x.rank))
    un = frozenset(f"r{j}i" for j in res)
    return Labels((li,), (lo,), un, "additive", {l: "resize interpolates along it" for l in un})


def _resize_fwd(a, xs):
    x = xs[0]
    y = x
    for j in _resized(a, x.shape):
        idx, wts = resize_taps(x.shape[j], a["sizes"][j], a["scales"][j], a["mode"], a["coordinate_mode"],
                               a["nearest_mode"])
        sh = [1] * x.ndim
        sh[j] = -1
        acc = None
        for i, w in zip(idx, wts):
            t = np.take(y, i, axis=j) * w.reshape(sh).astype(x.dtype)
            acc = t if acc is None else acc + t
        y = acc
    return [np.asarray(y).astype(x.dtype, copy=False)]


compute_op("Resize", attrs={"sizes": REQUIRED, "scales": REQUIRED, "mode": "nearest", "coordinate_mode": "half_pixel",
                            "nearest_mode": "round_prefer_floor"},
           num_inputs=1, logical=_resize_logical, labels=_resize_labels, forward=_resize_fwd,
           piece_attrs=lambda a, ins, outs: {**a, "sizes": outs[0].piece_shape},
           cost_class="default", autocast="follow", saves=NOTHING,
           flops=lambda a, i, o: (1.0 if a["mode"] == "nearest" else 3.0 * max(1, len(_resized(a, i[0].sizes))))
           * o[0].numel,
           doc="ONNX Resize / Upsample, nearest or (n-)linear, separable per resized dim. `sizes` is the full "
               "output shape, `scales` the per-dim factors the coordinate transform divides by (out/in when the "
               "model gave sizes). A fixed linear map of the input: partial sums pass through.")


# --- Pad ------------------------------------------------------------------------------------------------

PAD_MODES = ("constant", "reflect", "edge", "wrap")


def pad_index(n: int, before: int, after: int, mode: str) -> np.ndarray:
    """Source index of every output position of a reflect/edge/wrap-padded dim of length n."""
    return np.pad(np.arange(n), (before, after), mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


def _pad_logical(a, ins):
    x = ins[0]
    r = x.rank
    pads = a["pads"]
    if not isinstance(pads, (tuple, list)) or len(pads) != 2 * r or not all(_is_int(p) and p >= 0 for p in pads):
        _bad("Pad", f"pads must be {2 * r} ints >= 0 (all begins, then all ends), got {pads!r}")
    if a["mode"] not in PAD_MODES:
        _bad("Pad", f"mode must be one of {', '.join(PAD_MODES)}, got {a['mode']!r}")
    if not isinstance(a["value"], (int, float)) or isinstance(a["value"], bool):
        _bad("Pad", f"value must be a number, got {a['value']!r}")
    for j in range(r):
        b, e = pads[j], pads[j + r]
        if a["mode"] == "reflect" and (b or e) and (b >= x.sizes[j] or e >= x.sizes[j]):
            _bad("Pad", f"reflect padding {b}, {e} of dim {j} must be smaller than its size {x.sizes[j]}")
        if a["mode"] in ("edge", "wrap") and (b or e) and x.sizes[j] == 0:
            _bad("Pad", f"{a['mode']} padding of the empty dim {j}")
    return [(tuple(s + pads[j] + pads[j + r] for j, s in enumerate(x.sizes)), x.dtype)]


def _pad_labels(a, ins, outs):
    r = ins[0].rank
    padded = {j for j in range(r) if a["pads"][j] or a["pads"][j + r]}
    li = tuple(f"p{j}i" if j in padded else f"d{j}" for j in range(r))
    lo = tuple(f"p{j}o" if j in padded else f"d{j}" for j in range(r))
    un = frozenset(f"p{j}i" for j in padded)
    linear = a["mode"] != "constant" or a["value"] == 0
    return Labels((li,), (lo,), un, "additive" if linear else (), {l: "it is padded at its ends" for l in un})


def _pad_fwd(a, xs):
    x = xs[0]
    r = x.ndim
    widths = tuple((a["pads"][j], a["pads"][j + r]) for j in range(r))
    if a["mode"] == "constant":
        return [np.pad(x, widths, constant_values=np.asarray(a["value"]).astype(x.dtype))]
    y = x
    for j, (b, e) in enumerate(widths):
        if b or e:
            y = np.take(y, pad_index(x.shape[j], b, e, a["mode"]), axis=j)
    return [np.ascontiguousarray(y)]


compute_op("Pad", attrs={"pads": REQUIRED, "mode": "constant", "value": 0.0}, num_inputs=1, logical=_pad_logical,
           labels=_pad_labels, forward=_pad_fwd, flops=lambda a, i, o: 0.0,
           cost_class="default", autocast="follow", saves=NOTHING,
           doc="ONNX Pad: pads are all begins then all ends (>= 0; the importer turns negative pads into a "
               "Slice); constant (value), reflect, edge or wrap.")
