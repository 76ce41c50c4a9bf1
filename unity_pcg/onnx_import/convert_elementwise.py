"""ONNX converters for the element-wise, logical and reduction operators of :mod:`unity_pcg.ops.elementwise`
(registered into :data:`unity_pcg.onnx_import.convert.CONVERTERS`).

Every converter checks the node's attributes against the ONNX spec of its operator: an attribute the spec does
not define, or a value the PCG operator cannot represent, is an :class:`InvalidModel` / :class:`UnsupportedOperator`
error that names the attribute (one line; the CLI exits 2)."""
from __future__ import annotations

from math import prod

import numpy as np

from ..ops.elementwise import SELU_ALPHA, SELU_GAMMA
from .consts import Const, derive
from .convert import _R, _axis, _conv, _in, _hint, _name, _unsupported
from .errors import InvalidModel
from .fold import reduce_axes

# ONNX attributes of each operator converted here (name -> default), per the ONNX operator spec
_ATTRS = {
    "LeakyRelu": {"alpha": 0.01}, "Elu": {"alpha": 1.0}, "Celu": {"alpha": 1.0},
    "Selu": {"alpha": SELU_ALPHA, "gamma": SELU_GAMMA}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5},
    "Softplus": {}, "Softsign": {}, "Mish": {}, "HardSwish": {}, "Abs": {}, "Log": {}, "Swish": {"alpha": 1.0},
}


def _only_known_attrs(ctx, known) -> None:
    for key in ctx.attrs:
        if key == "consumed_inputs" and ctx.opset < 6:   # an in-place hint of opsets 1-5, without meaning here
            continue
        if key not in known:
            _unsupported(ctx, f"attribute {key!r}")


def _float_input(imp, ctx, x) -> None:
    if np.dtype(imp.dtype(x)).kind != "f":
        raise InvalidModel(f"{ctx.what}: input must be a float tensor, got {imp.dtype(x)}")


def _finite(ctx, key, v: float) -> float:
    if not np.isfinite(v):
        raise InvalidModel(f"{ctx.what}: attribute {key!r} must be finite, got {v}")
    return v


# --- unary activations -------------------------------------------------------------------------------

@_conv("LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "Softplus", "Softsign", "Mish", "HardSwish", "Log")
def _activation(imp, ctx, ins):
    spec = _ATTRS[ctx.op]
    _only_known_attrs(ctx, spec)
    x = _R(imp, ctx, ins, 0)
    _float_input(imp, ctx, x)
    attrs = {k: _finite(ctx, k, ctx.f(k, d)) for k, d in spec.items()}
    if ctx.op == "Celu" and attrs["alpha"] == 0.0:
        raise InvalidModel(f"{ctx.what}: attribute 'alpha' must not be 0 (Celu divides by it)")
    return [imp.add(ctx.op, attrs, [x], ctx.name)]


@_conv("Abs")
def _abs(imp, ctx, ins):
    _only_known_attrs(ctx, ())
    x = _R(imp, ctx, ins, 0)
    if imp.dtype(x) == "bool":
        raise InvalidModel(f"{ctx.what}: Abs of a bool tensor")
    return [imp.add("Abs", {}, [x], ctx.name)]


@_conv("Swish")
def _swish(imp, ctx, ins):
    """x * sigmoid(alpha * x): Silu when alpha is 1 (the default), else written out."""
    _only_known_attrs(ctx, _ATTRS["Swish"])
    x = _R(imp, ctx, ins, 0)
    _float_input(imp, ctx, x)
    alpha = _finite(ctx, "alpha", ctx.f("alpha", 1.0))
    if alpha == 1.0:
        return [imp.add("Silu", {}, [x], ctx.name)]
    s = imp.add("Sigmoid", {}, [imp.add("Scale", {"factor": alpha}, [x], _name(ctx, "alpha"))], _name(ctx, "sigmoid"))
    return [imp.add("Mul", {}, [x, s], ctx.name)]


@_conv("PRelu")
def _prelu(imp, ctx, ins):
    _only_known_attrs(ctx, ())
    x, slope = _in(ctx, ins, 0), _in(ctx, ins, 1)
    xs, ss = imp.sizes(x), imp.sizes(slope)
    _float_input(imp, ctx, x)
    if ctx.opset < 7 and len(ss) == 1 and len(xs) >= 2 and ss[0] == xs[1] != 1:
        # opset 6 (before numpy broadcasting): a slope of C values is one per channel, dim 1
        c11 = (ss[0],) + (1,) * (len(xs) - 2)
        slope = derive(slope, lambda v: v.reshape(c11), c11) if isinstance(slope, Const) else \
            imp.add("Reshape", {"shape": c11}, [slope], _name(ctx, "slope"))
        ss = c11
    if len(ss) > len(xs) or any(b not in (1, a) for a, b in zip(xs[len(xs) - len(ss):], ss)):
        raise InvalidModel(f"{ctx.what}: slope {list(ss)} does not broadcast onto the input {list(xs)}")
    if imp.dtype(slope) != imp.dtype(x):
        if not isinstance(slope, Const):
            raise InvalidModel(f"{ctx.what}: slope dtype {imp.dtype(slope)} differs from the input's {imp.dtype(x)}")
        dt = imp.dtype(x)
        slope = derive(slope, lambda v: v.astype(dt), slope.shape, dtype=dt)
    # a slope of one element stays a PRelu weight: PyTorch trains it (nn.PReLU() has one parameter)
    return [imp.add("PRelu", {}, [imp.ref(x, _hint(ctx, 0)), imp.ref(slope, _hint(ctx, 1))], ctx.name)]


# --- LogSoftmax ----------------------------------------------------------------------------------------

@_conv("LogSoftmax")
def _log_softmax(imp, ctx, ins):
    _only_known_attrs(ctx, ("axis",))
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    r = len(xs)
    if r == 0:
        raise InvalidModel(f"{ctx.what}: log-softmax of a scalar")
    _float_input(imp, ctx, x)
    if ctx.opset >= 13:
        ax = _axis(ctx, ctx.i("axis", -1), r)
        return [imp.add("LogSoftmax", {"axis": ax - r}, [x], ctx.name)]
    # opset < 13: the input is coerced to 2-D [prod(:axis), prod(axis:)] and the second dim normalized
    ax = _axis(ctx, ctx.i("axis", 1), r)
    if ax == r - 1:
        return [imp.add("LogSoftmax", {"axis": -1}, [x], ctx.name)]
    flat = imp.add("Reshape", {"shape": (prod(xs[:ax]), prod(xs[ax:]))}, [x], _name(ctx, "to2d"))
    y = imp.add("LogSoftmax", {"axis": -1}, [flat], _name(ctx, "logsoftmax"))
    return [imp.add("Reshape", {"shape": tuple(xs)}, [y], ctx.name)]


# --- reductions ----------------------------------------------------------------------------------------

@_conv("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceL1", "ReduceSumSquare")
def _reduce(imp, ctx, ins):
    # axes: an attribute before opset 18, an input from 18 on (where noop_with_empty_axes appears)
    _only_known_attrs(ctx, ("keepdims", "noop_with_empty_axes") if ctx.opset >= 18 else ("axes", "keepdims"))
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    r = len(xs)
    for key in ("keepdims", "noop_with_empty_axes"):
        if ctx.has(key) and ctx.i(key) not in (0, 1):
            raise InvalidModel(f"{ctx.what}: attribute {key!r} must be 0 or 1, got {ctx.i(key)}")
    if imp.dtype(x) == "bool":
        raise InvalidModel(f"{ctx.what}: reduction of a bool tensor")
    if ctx.op in ("ReduceL2", "ReduceLogSumExp"):
        _float_input(imp, ctx, x)
    axes = reduce_axes(ctx, ins, r, 18)
    if axes == ():           # noop_with_empty_axes: no reduction, the element-wise part still applies
        if ctx.op in ("ReduceL1", "ReduceL2"):
            return [imp.add("Abs", {}, [x], ctx.name)]
        if ctx.op == "ReduceSumSquare":
            return [imp.add("Mul", {}, [x, x], ctx.name)]
        return [x]
    axes = tuple(axes) if axes is not None else tuple(range(r))
    if ctx.op in ("ReduceMax", "ReduceMin") and any(xs[a] == 0 for a in axes):
        _unsupported(ctx, f"{ctx.op} over an empty dim of {list(xs)}")
    keep = bool(ctx.i("keepdims", 1))
    attrs = {"axes": axes, "keepdims": keep}
    if ctx.op == "ReduceL1":      # a sum of |x|: ReduceSum may shard the reduced dims into partial sums
        return [imp.add("ReduceSum", attrs, [imp.add("Abs", {}, [x], _name(ctx, "abs"))], ctx.name)]
    if ctx.op == "ReduceSumSquare":
        return [imp.add("ReduceSum", attrs, [imp.add("Mul", {}, [x, x], _name(ctx, "square"))], ctx.name)]
    return [imp.add(ctx.op, attrs, [x], ctx.name)]
