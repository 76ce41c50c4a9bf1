"""ONNX converters for the spatial operators of :mod:`unity_pcg.ops.spatial` (registered into
:data:`unity_pcg.onnx_import.convert.CONVERTERS`).

Conv, MaxPool/AveragePool and the global pools are registered again here (this module is imported after
:mod:`.convert`, so its entries win): 2-D cases and 1-D convolutions go to :mod:`.convert`'s converters
unchanged (``Conv2d`` / ``Pool2d``, the rule vocabulary); 3-D convolution becomes ``Conv3d``, 1-D and 3-D
pooling ``Pool1d`` / ``Pool3d`` (dilated 2-D pooling is a ``Pool3d`` over an added depth of 1).  New:
ConvTranspose, InstanceNormalization, GroupNormalization (opset 18's per-group and opset 21's per-channel
scale and bias), Resize (opsets 10 to 19), Upsample and Pad.  An attribute value outside what the
operators implement is refused with an :class:`UnsupportedOperator` that names the attribute.
"""
from __future__ import annotations

import math

import numpy as np

from ..ops.spatial import COORDINATE_MODES, NEAREST_MODES, PAD_MODES
from .consts import Const, as_ints, as_scalar, derive
from .convert import _auto_pads, _conv, _conv2d, _gpool, _hint, _in, _name, _pool, _R, _reshape, _spatial, \
    _unsupported
from .errors import InvalidModel


def _attr(ctx, name: str, value, why: str = "") -> None:
    """Refuse an attribute value the operators do not implement, naming the attribute."""
    _unsupported(ctx, f"attribute {name}={value!r} is not supported{'; ' + why if why else ''}")


# --- convolution and pooling ---------------------------------------------------------------------------

@_conv("Conv")
def _conv_nd(imp, ctx, ins):
    x, w = _in(ctx, ins, 0), _in(ctx, ins, 1)
    xs, ws = imp.sizes(x), imp.sizes(w)
    if not (len(xs) == 5 and len(ws) == 5):
        return _conv2d(imp, ctx, ins)      # 1-D (as Conv2d with height 1) and 2-D
    b = _in(ctx, ins, 2, required=False)
    kernel = list(ws[2:])
    ks = ctx.ints("kernel_shape", None)
    if ks is not None and list(ks) != kernel:
        raise InvalidModel(f"{ctx.what}: kernel_shape {ks} does not match the weight {list(ws)}")
    strides = _spatial(ctx, "strides", [1, 1, 1], 3)
    dil = _spatial(ctx, "dilations", [1, 1, 1], 3)
    pads = _auto_pads(ctx, xs[2:], kernel, strides, dil, ctx.ints("pads", [0] * 6))
    refs = [imp.ref(x, _hint(ctx, 0)), imp.ref(w, _hint(ctx, 1))]
    if b is not None:
        refs.append(imp.ref(b, _hint(ctx, 2)))
    return [imp.add("Conv3d", {"stride": tuple(strides), "dilation": tuple(dil), "padding": tuple(pads),
                               "groups": ctx.i("group", 1)}, refs, ctx.name)]


@_conv("MaxPool", "AveragePool")
def _pool_nd(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    n = len(xs) - 2
    dil = ctx.ints("dilations", [1] * max(n, 0))
    if n == 2 and list(dil) == [1, 1]:
        return _pool(imp, ctx, ins)        # Pool2d
    if n not in (1, 2, 3):
        if n < 1:
            raise InvalidModel(f"{ctx.what}: needs an (N, C, ...) input, got {list(xs)}")
        _unsupported(ctx, f"{n}-D pooling; 1-D, 2-D and 3-D are supported")
    kernel = _spatial(ctx, "kernel_shape", None, n)
    strides = _spatial(ctx, "strides", [1] * n, n)
    dil = _spatial(ctx, "dilations", [1] * n, n)
    pads = _auto_pads(ctx, xs[2:], kernel, strides, dil, ctx.ints("pads", [0] * (2 * n)))
    if ctx.op == "MaxPool" and ctx.i("storage_order", 0) not in (0, 1):
        raise InvalidModel(f"{ctx.what}: storage_order must be 0 or 1")
    kind = "max" if ctx.op == "MaxPool" else "avg"
    attrs = {"kind": kind, "kernel": tuple(kernel), "stride": tuple(strides), "dilation": tuple(dil),
             "padding": tuple(pads), "ceil_mode": bool(ctx.i("ceil_mode", 0)) if ctx.opset >= 10 else False,
             "count_include_pad": bool(ctx.i("count_include_pad", 0)) if kind == "avg" else False}
    if n == 2:   # dilated 2-D pooling: a 3-D pool over an added depth of 1
        attrs = {**attrs, "kernel": (1,) + attrs["kernel"], "stride": (1,) + attrs["stride"],
                 "dilation": (1,) + attrs["dilation"], "padding": (0,) + tuple(pads[:2]) + (0,) + tuple(pads[2:])}
        x5 = _reshape(imp, ctx, x, xs[:2] + (1,) + xs[2:], "as3d")
        y = imp.add("Pool3d", attrs, [x5], _name(ctx, "pool3d"))
        ys = imp.sizes(y)
        return [imp.add("Reshape", {"shape": ys[:2] + ys[3:]}, [y], ctx.name), None]
    return [imp.add("Pool1d" if n == 1 else "Pool3d", attrs, [x], ctx.name), None]


@_conv("GlobalAveragePool", "GlobalMaxPool")
def _gpool_nd(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    n = len(imp.sizes(x)) - 2
    if n not in (1, 3):
        return _gpool(imp, ctx, ins)
    kind = "avg" if ctx.op == "GlobalAveragePool" else "max"
    return [imp.add("Pool1d" if n == 1 else "Pool3d", {"kind": kind, "global_pool": True}, [x], ctx.name)]


@_conv("ConvTranspose")
def _conv_transpose(imp, ctx, ins):
    x, w, b = _in(ctx, ins, 0), _in(ctx, ins, 1), _in(ctx, ins, 2, required=False)
    xs, ws = imp.sizes(x), imp.sizes(w)
    if len(xs) != len(ws) or len(xs) < 3:
        raise InvalidModel(f"{ctx.what}: input {list(xs)} and weight {list(ws)} do not fit a transposed convolution")
    n = len(xs) - 2
    if n > 3:
        _unsupported(ctx, f"{n}-D transposed convolution; 1-D, 2-D and 3-D are supported")
    kernel = list(ws[2:])
    ks = ctx.ints("kernel_shape", None)
    if ks is not None and list(ks) != kernel:
        raise InvalidModel(f"{ctx.what}: kernel_shape {ks} does not match the weight {list(ws)}")
    strides = _spatial(ctx, "strides", [1] * n, n)
    dil = _spatial(ctx, "dilations", [1] * n, n)
    opad = ctx.ints("output_padding", [0] * n)
    if len(opad) != n or any(p < 0 for p in opad):
        raise InvalidModel(f"{ctx.what}: bad output_padding {opad}")
    groups = ctx.i("group", 1)
    mode = ctx.s("auto_pad", "NOTSET")
    out_shape = ctx.ints("output_shape", None)
    if mode not in ("NOTSET", "", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise InvalidModel(f"{ctx.what}: unknown auto_pad {mode!r}")
    if out_shape is not None or mode in ("SAME_UPPER", "SAME_LOWER"):
        if out_shape is None:
            out_shape = [s * st for s, st in zip(xs[2:], strides)]
        out_shape = list(out_shape)[-n:] if len(out_shape) >= n else out_shape
        if len(out_shape) != n:
            raise InvalidModel(f"{ctx.what}: output_shape {out_shape} does not give {n} spatial sizes")
        begin, end = [], []
        for j in range(n):
            total = strides[j] * (xs[2 + j] - 1) + opad[j] + (kernel[j] - 1) * dil[j] + 1 - out_shape[j]
            if total < 0:
                _attr(ctx, "output_shape", out_shape, "it is larger than the full transposed convolution")
            # onnxruntime (and the spec): SAME_UPPER puts the odd element at the end, else at the beginning
            lo = total // 2 if mode == "SAME_UPPER" else total - total // 2
            begin.append(lo)
            end.append(total - lo)
        pads = begin + end
    elif mode == "VALID":
        pads = [0] * (2 * n)
    else:
        pads = ctx.ints("pads", [0] * (2 * n))
        if len(pads) != 2 * n or any(p < 0 for p in pads):
            raise InvalidModel(f"{ctx.what}: bad pads {pads}")
    refs = [imp.ref(x, _hint(ctx, 0)), imp.ref(w, _hint(ctx, 1))]
    if b is not None:
        refs.append(imp.ref(b, _hint(ctx, 2)))
    return [imp.add("ConvTranspose", {"stride": tuple(strides), "dilation": tuple(dil), "padding": tuple(pads),
                                      "output_padding": tuple(opad), "groups": groups}, refs, ctx.name)]


# --- normalization -------------------------------------------------------------------------------------

@_conv("InstanceNormalization")
def _instance_norm(imp, ctx, ins):
    refs = [_R(imp, ctx, ins, i) for i in range(3)]
    return [imp.add("InstanceNorm", {"eps": ctx.f("epsilon", 1e-5)}, refs, ctx.name)]


@_conv("GroupNormalization")
def _group_norm(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    if len(xs) < 2:
        raise InvalidModel(f"{ctx.what}: needs an (N, C, ...) input, got {list(xs)}")
    g = ctx.i("num_groups")
    c = xs[1]
    if g < 1 or c % g:
        raise InvalidModel(f"{ctx.what}: num_groups={g} does not divide {c} channels")
    per_channel = ctx.opset >= 21
    want = (c,) if per_channel else (g,)
    refs = [x]
    for i in (1, 2):
        p = _in(ctx, ins, i)
        if imp.sizes(p) != want:
            raise InvalidModel(f"{ctx.what}: input {i} has shape {list(imp.sizes(p))}, expected {list(want)} "
                               f"(opset {ctx.opset}: per {'channel' if per_channel else 'group'})")
        if not per_channel and g != c:   # opset 18: one value per group, repeated over its channels
            if isinstance(p, Const):
                p = derive(p, lambda v: np.repeat(v, c // g), (c,), keep_origin=False)
                p = imp.ref(p, _hint(ctx, i))
            else:
                col = _reshape(imp, ctx, p, (g, 1), f"group{i}")
                p = imp.add("Expand", {"shape": (g, c // g)}, [col], _name(ctx, f"expand{i}"))
                p = _reshape(imp, ctx, p, (c,), f"channel{i}")
        else:
            p = imp.ref(p, _hint(ctx, i))
        refs.append(p)
    return [imp.add("GroupNorm", {"groups": g, "eps": ctx.f("epsilon", 1e-5)}, refs, ctx.name)]


# --- Resize / Upsample ---------------------------------------------------------------------------------

def _f32(v: float) -> float:
    return float(np.float32(v))


def _resize_common(imp, ctx, x, scales, sizes, mode, coord, nearest):
    """Resize ``x`` given per-dim float scales or int sizes (one of them None), as onnxruntime does: the
    output size is floor(in * scale) in float32, and with sizes the transform's scale is out / in."""
    xs = imp.sizes(x)
    r = len(xs)
    if mode not in ("nearest", "linear"):
        _attr(ctx, "mode", mode, "supported: nearest, linear")
    if coord not in COORDINATE_MODES:
        _attr(ctx, "coordinate_transformation_mode", coord, f"supported: {', '.join(COORDINATE_MODES)}")
    if nearest not in NEAREST_MODES:
        _attr(ctx, "nearest_mode", nearest, f"supported: {', '.join(NEAREST_MODES)}")
    if np.dtype(imp.dtype(x)).kind != "f":
        _unsupported(ctx, f"resizing a {imp.dtype(x)} tensor")
    if scales is not None:
        if len(scales) != r or not all(math.isfinite(s) and s > 0 for s in scales):
            raise InvalidModel(f"{ctx.what}: scales {scales} must be {r} positive numbers")
        scales = [_f32(s) for s in scales]
        sizes = [int(np.float32(s) * np.float32(n)) for s, n in zip(scales, xs)]
    else:
        if len(sizes) != r or any(s < 1 for s in sizes):
            raise InvalidModel(f"{ctx.what}: sizes {sizes} must be {r} ints >= 1")
        scales = [_f32(o / n) if n else 1.0 for o, n in zip(sizes, xs)]
    if any(s < 1 for s in sizes):
        raise InvalidModel(f"{ctx.what}: scales give an empty output {sizes} for input {list(xs)}")
    if tuple(sizes) == xs and all(s == 1.0 for s in scales):
        return x
    return imp.add("Resize", {"sizes": tuple(sizes), "scales": tuple(scales), "mode": mode,
                              "coordinate_mode": coord, "nearest_mode": nearest}, [x], ctx.name)


def _floats(ctx, c: Const) -> list[float]:
    v = np.asarray(c.value)
    if v.dtype.kind not in "fiu":
        raise InvalidModel(f"{ctx.what}: scales must be numbers, got {v.dtype}")
    return [float(s) for s in v.reshape(-1)]


@_conv("Resize")
def _resize(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    r = len(imp.sizes(x))
    mode = ctx.s("mode", "nearest")
    if ctx.opset < 11:     # Resize-10: (X, scales), asymmetric coordinates, nearest rounds down
        scales = _floats(ctx, ctx.const_in(ins, 1))
        return [_resize_common(imp, ctx, x, scales, None, mode, "asymmetric", "floor")]
    coord = ctx.s("coordinate_transformation_mode", "half_pixel")
    nearest = ctx.s("nearest_mode", "round_prefer_floor")
    if ctx.opset >= 18:
        if ctx.i("antialias", 0) and mode != "nearest":
            _attr(ctx, "antialias", 1)
        policy = ctx.s("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            _attr(ctx, "keep_aspect_ratio_policy", policy, "supported: stretch")
    if mode == "cubic":
        _attr(ctx, "mode", mode, "supported: nearest, linear")
    if coord == "tf_crop_and_resize":
        _attr(ctx, "coordinate_transformation_mode", coord, f"supported: {', '.join(COORDINATE_MODES)}")
    axes = ctx.ints("axes", None) if ctx.opset >= 18 else None
    if axes is not None:
        if any(not -r <= a < r for a in axes) or len({a % r for a in axes}) != len(axes):
            raise InvalidModel(f"{ctx.what}: bad axes {axes} for rank {r}")
        axes = [a % r for a in axes]
    sc = _in(ctx, ins, 2, required=False)
    sz = _in(ctx, ins, 3, required=False)
    scales = _floats(ctx, ctx.const_in(ins, 2)) if sc is not None and imp.sizes(sc) != (0,) else None
    sizes = as_ints(ctx.const_in(ins, 3), ctx.what) if sz is not None and imp.sizes(sz) != (0,) else None
    if (scales is None) == (sizes is None):
        raise InvalidModel(f"{ctx.what}: exactly one of scales and sizes must be given")
    if axes is not None:
        given = scales if scales is not None else sizes
        if len(given) != len(axes):
            raise InvalidModel(f"{ctx.what}: {len(given)} values for axes {axes}")
        full = [1.0] * r if scales is not None else list(imp.sizes(x))
        for a, v in zip(axes, given):
            full[a] = v
        scales, sizes = (full, None) if scales is not None else (None, full)
    if sizes is not None:
        sizes = _rebatch_sizes(imp, ctx, x, sizes)
    return [_resize_common(imp, ctx, x, scales, sizes, mode, coord, nearest)]


def _rebatch_sizes(imp, ctx, x, sizes: list[int]) -> list[int]:
    """Under a batch override, a literal ``sizes`` that kept a dim the override changed (an exporter's
    constant output shape holding the exported batch) keeps the new size instead."""
    if getattr(imp, "old_shapes", None) is None or not hasattr(imp, "_changed_dims") or len(sizes) != len(imp.sizes(x)):
        return sizes
    sizes = list(sizes)
    for p, old, new in imp._changed_dims(ctx.node.input[0], x):
        if sizes[p] == old:
            sizes[p] = new
    return sizes


@_conv("Upsample")
def _upsample(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    mode = ctx.s("mode", "nearest")
    if mode == "bilinear":   # Upsample-7's older spelling
        mode = "linear"
    if ctx.opset >= 9:
        scales = _floats(ctx, ctx.const_in(ins, 1))
    else:
        scales = ctx.floats("scales")
    return [_resize_common(imp, ctx, x, scales, None, mode, "asymmetric", "floor")]


# --- Pad ------------------------------------------------------------------------------------------------

@_conv("Pad")
def _pad(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    r = len(xs)
    mode = ctx.s("mode", "constant")
    if ctx.opset < 11:
        pads = ctx.ints("pads" if ctx.opset >= 2 else "paddings")
        value = ctx.f("value", 0.0)
    else:
        pads = as_ints(ctx.const_in(ins, 1), ctx.what)
        cv = _in(ctx, ins, 2, required=False)
        value = as_scalar(ctx.const_in(ins, 2), ctx.what) if cv is not None and imp.sizes(cv) != (0,) else 0.0
        ax = _in(ctx, ins, 3, required=False)
        if ax is not None:
            axes = as_ints(ctx.const_in(ins, 3), ctx.what)
            if any(not -r <= a < r for a in axes) or len({a % r for a in axes}) != len(axes):
                raise InvalidModel(f"{ctx.what}: bad axes {axes} for rank {r}")
            if len(pads) != 2 * len(axes):
                raise InvalidModel(f"{ctx.what}: {len(pads)} pads for {len(axes)} axes")
            full = [0] * (2 * r)
            for k, a in enumerate(axes):
                full[a % r], full[a % r + r] = pads[k], pads[k + len(axes)]
            pads = full
    if mode not in PAD_MODES:
        _attr(ctx, "mode", mode, f"supported: {', '.join(PAD_MODES)}")
    if len(pads) != 2 * r:
        raise InvalidModel(f"{ctx.what}: {len(pads)} pads for a rank-{r} input (2 per dim)")
    if any(p < 0 for p in pads):   # negative pads crop: a Slice first
        axes = [j for j in range(r) if pads[j] < 0 or pads[j + r] < 0]
        starts = [max(0, -pads[j]) for j in axes]
        ends = [xs[j] + min(0, pads[j + r]) for j in axes]
        if any(e <= s for s, e in zip(starts, ends)):
            raise InvalidModel(f"{ctx.what}: negative pads {pads} crop {list(xs)} to nothing")
        x = imp.add("Slice", {"axes": tuple(axes), "starts": tuple(starts), "ends": tuple(ends),
                              "steps": (1,) * len(axes)}, [x], _name(ctx, "crop"))
        pads = [max(0, p) for p in pads]
    if not any(pads):
        return [x]
    if np.dtype(imp.dtype(x)).kind in "iub":
        value = int(value) if math.isfinite(float(value)) else 0
    else:
        value = float(value)
    return [imp.add("Pad", {"pads": tuple(pads), "mode": mode, "value": value}, [x], ctx.name)]
