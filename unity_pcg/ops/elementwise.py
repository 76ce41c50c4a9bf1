"""Element-wise, logical, comparison and reduction operators added for ONNX import coverage (issue 10): registered
with :func:`unity_pcg.ops.compute.compute_op` like the core set.

Every operator here states its parallel behaviour with labels, as the core set does:

* unary activations (Silu, GeluTanh, LeakyRelu, Elu, ...) label every dim of the input and the output alike,
  so any dim may be sharded; none of them is additive, so partial sums are refused (an activation of a partial
  sum is not the sum of the activations);
* PRelu is a binary operator whose slope broadcasts onto the input (ONNX's unidirectional broadcast): labels as
  :func:`~unity_pcg.ops.compute._binary` gives them, no partial sums on either input;
* LogSoftmax normalizes along its axis, which is unshardable (as Softmax's);
* ReduceMax / ReduceMin / ReduceProd / ReduceL2 / ReduceLogSumExp leave their reduced dims unshardable: the
  max (min, product, norm) of the pieces is not their sum, so sharding a reduced dim cannot be expressed as
  partial sums. (ReduceL1 and ReduceSumSquare are sums of a function of the elements: the importer writes them
  as Abs or Mul followed by ReduceSum, whose reduced dims may be sharded into partial sums.)
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import kernels as K
from .base import ALL, Labels, Saves
from .compute import ATTR_KINDS, _axis, _bad, _broadcast, _broadcast_labels, _dims, _reduce_axes, \
    _reduce_logical, _same, compute_op

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _unary(name: str, fn: Callable, flops_per: float, attrs: dict | None = None,
           kinds: dict | None = None, doc: str = "", autocast: str = "follow") -> None:
    """An element-wise operator of one input: every dim shardable, no partial sums; saves its input for
    the backward pass."""
    if kinds:
        ATTR_KINDS[name] = kinds

    def labels(a, ins, outs):
        lab = _dims("d", ins[0].rank)
        return Labels((lab,), (lab,))

    def forward(a, xs):
        x = xs[0]
        with np.errstate(over="ignore"):
            y = fn(a, x)
        return [np.asarray(y).astype(x.dtype, copy=False)]

    compute_op(name, attrs=attrs or {}, num_inputs=1, logical=_same, labels=labels, forward=forward,
               flops=lambda a, i, o: flops_per * o[0].numel, doc=doc,
               cost_class="elementwise", autocast=autocast, saves=Saves(ALL))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) without overflow."""
    return np.logaddexp(np.zeros((), x.dtype), x)


# --- activations ------------------------------------------------------------------------------------

_unary("Silu", lambda a, x: x * K.sigmoid(x), 5, doc="x * sigmoid(x) (SiLU, Swish with beta 1).")
_unary("GeluTanh", lambda a, x: gelu_tanh(x), 9, doc="GELU's tanh approximation (ONNX Gelu approximate='tanh').")


def _leaky_relu(a, x):
    return np.where(x >= 0, x, x * np.asarray(a["alpha"], x.dtype))


def _elu(a, x):
    alpha = np.asarray(a["alpha"], x.dtype)
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))


def _selu(a, x):
    alpha, gamma = np.asarray(a["alpha"], x.dtype), np.asarray(a["gamma"], x.dtype)
    return gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))


def _celu(a, x):
    alpha = np.asarray(a["alpha"], x.dtype)
    return np.maximum(x, 0) + np.minimum(0, alpha * np.expm1(np.minimum(x, 0) / alpha))


def _hard_sigmoid(a, x):
    return np.clip(x * np.asarray(a["alpha"], x.dtype) + np.asarray(a["beta"], x.dtype), 0, 1)


def _hard_swish(a, x):
    return x * np.clip(x / np.asarray(6, x.dtype) + np.asarray(0.5, x.dtype), 0, 1)


# ONNX's SELU constants (float32 values, as the ONNX spec states them)
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102710723876953125

_unary("LeakyRelu", _leaky_relu, 2, {"alpha": 0.01}, {"alpha": "num"}, doc="x if x >= 0 else alpha * x.")
_unary("Elu", _elu, 4, {"alpha": 1.0}, {"alpha": "num"}, doc="x if x > 0 else alpha * (exp(x) - 1).")
_unary("Selu", _selu, 5, {"alpha": SELU_ALPHA, "gamma": SELU_GAMMA}, {"alpha": "num", "gamma": "num"},
       doc="gamma * (x if x > 0 else alpha * (exp(x) - 1)).")
_unary("Celu", _celu, 6, {"alpha": 1.0}, {"alpha": "num"},
       doc="max(0, x) + min(0, alpha * (exp(x / alpha) - 1)); alpha must not be 0 (the converter checks).")
_unary("Softplus", lambda a, x: softplus(x), 4, doc="log(1 + exp(x)).", autocast="fp32")
_unary("Softsign", lambda a, x: x / (1 + np.abs(x)), 3, doc="x / (1 + |x|).")
_unary("Mish", lambda a, x: x * np.tanh(softplus(x)), 9, doc="x * tanh(softplus(x)).")
_unary("HardSigmoid", _hard_sigmoid, 4, {"alpha": 0.2, "beta": 0.5}, {"alpha": "num", "beta": "num"},
       doc="max(0, min(1, alpha * x + beta)).")
_unary("HardSwish", _hard_swish, 5, doc="x * max(0, min(1, x / 6 + 1/2)).")
_unary("Abs", lambda a, x: np.abs(x), 1)
_unary("Log", lambda a, x: np.log(x), 2, doc="Natural logarithm (NaN below 0, -inf at 0, as ONNX).",
       autocast="fp32")


# --- PRelu: a slope tensor broadcast onto the input --------------------------------------------------

def _prelu_logical(a, ins):
    x, slope = ins
    out = _broadcast("PRelu", [x.sizes, slope.sizes])
    if out != x.sizes:
        _bad("PRelu", f"slope {list(slope.sizes)} does not broadcast onto the input {list(x.sizes)}")
    if slope.dtype != x.dtype:
        _bad("PRelu", f"slope dtype {slope.dtype} differs from the input's {x.dtype}")
    return [(x.sizes, x.dtype)]


def _prelu_labels(a, ins, outs):
    li, lo = _broadcast_labels(ins, outs[0])
    return Labels(li, (lo,))


compute_op("PRelu", attrs={}, num_inputs=2, logical=_prelu_logical, labels=_prelu_labels,
           forward=lambda a, xs: [np.where(xs[0] >= 0, xs[0], xs[0] * xs[1]).astype(xs[0].dtype, copy=False)],
           flops=lambda a, i, o: 2.0 * o[0].numel, cost_class="elementwise", autocast="low", saves=Saves(ALL),
           doc="x if x >= 0 else slope * x; the slope (usually a weight of shape [C] or [C, 1, 1]) broadcasts "
               "onto x. Shards of x are matched by shards of the slope along the dims it does not broadcast; "
               "neither input may carry partial sums.")


# --- LogSoftmax --------------------------------------------------------------------------------------

ATTR_KINDS["LogSoftmax"] = {"axis": "int"}


def _log_softmax_fwd(a, xs):
    x = xs[0]
    if x.size == 0:
        return [x.copy()]
    ax = a["axis"] % x.ndim
    m = np.max(x, axis=ax, keepdims=True)
    z = x - m
    return [(z - np.log(np.sum(np.exp(z), axis=ax, keepdims=True))).astype(x.dtype, copy=False)]


def _log_softmax_labels(a, ins, outs):
    ax = a["axis"] % ins[0].rank
    lab = _dims("d", ins[0].rank)
    # along an axis of size 1 the result is the constant 0, a linear map: partial sums may pass
    lin = "additive" if ins[0].sizes[ax] == 1 else ()
    return Labels((lab,), (lab,), frozenset({lab[ax]}), lin, {lab[ax]: "log-softmax normalizes along it"})


compute_op("LogSoftmax", attrs={"axis": -1}, num_inputs=1,
           logical=lambda a, ins: (_axis("LogSoftmax", a["axis"], ins[0].rank), _same(a, ins))[1],
           labels=_log_softmax_labels, forward=_log_softmax_fwd, flops=lambda a, i, o: 5.0 * o[0].numel,
           cost_class="softmax", autocast="fp32_direct", saves=Saves(ALL),
           doc="x - log(sum(exp(x))) along axis (computed stably); the axis is unshardable.")


# --- reductions that are not sums ---------------------------------------------------------------------

def _reduce_labels(name: str, why: str):
    def labels(a, ins, outs):
        x = ins[0]
        axes = {ax % x.rank for ax in a["axes"]} if a["axes"] else set(range(x.rank))
        li = tuple(f"r{j}" if j in axes else f"d{j}" for j in range(x.rank))
        lo = tuple(f"k{j}" if j in axes else f"d{j}" for j in range(x.rank) if a["keepdims"] or j not in axes)
        un = frozenset(f"r{j}" for j in axes)
        # reducing only dims of size 1 is the identity for max, min, product and log-sum-exp: linear
        identity = name != "ReduceL2" and all(x.sizes[j] == 1 for j in axes)
        return Labels((li,), (lo,), un, "additive" if identity else (), {l: why for l in un})
    return labels


def _reduce_fwd(fn):
    def forward(a, xs):
        x = xs[0]
        with np.errstate(over="ignore"):
            y = fn(x, _reduce_axes(a, x.ndim), bool(a["keepdims"]))
        return [np.asarray(y).astype(x.dtype, copy=False)]
    return forward


def _reduce_empty_check(name: str):
    logical = _reduce_logical(name)

    def check(a, ins):
        x = ins[0]
        axes = {_axis(name, ax, x.rank) for ax in a["axes"]} if a["axes"] else set(range(x.rank))
        if name in ("ReduceMax", "ReduceMin") and any(x.sizes[j] == 0 for j in axes):
            _bad(name, f"reduces an empty dim of {list(x.sizes)} (no identity element)")
        return logical(a, ins)
    return check


_REDUCTIONS = {
    "ReduceMax": (lambda x, ax, k: np.max(x, axis=ax, keepdims=k), 1.0, "the max of pieces is not their sum"),
    "ReduceMin": (lambda x, ax, k: np.min(x, axis=ax, keepdims=k), 1.0, "the min of pieces is not their sum"),
    "ReduceProd": (lambda x, ax, k: np.prod(x, axis=ax, keepdims=k), 1.0,
                   "the product of pieces is not their sum"),
    "ReduceL2": (lambda x, ax, k: np.sqrt(np.sum(x * x, axis=ax, keepdims=k)), 2.0,
                 "the norm of pieces is not their sum"),
    "ReduceLogSumExp": (lambda x, ax, k: _logsumexp(x, ax, k), 3.0,
                        "log-sum-exp of pieces is not their sum"),
}


def _logsumexp(x, axes, keepdims):
    if x.size == 0:
        return np.log(np.sum(np.exp(x), axis=axes, keepdims=keepdims))
    m = np.max(x, axis=axes, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    y = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return y if keepdims else np.squeeze(y, axis=axes if axes is not None else tuple(range(x.ndim)))


# torch.autocast runs these in fp32 (a product reads a bf16 input directly, through its dtype argument)
_AUTOCAST = {"ReduceProd": "fp32_direct", "ReduceL2": "fp32", "ReduceLogSumExp": "fp32"}
for _n, (_f, _per, _why) in _REDUCTIONS.items():
    ATTR_KINDS[_n] = {"axes": "ints", "keepdims": "bool"}
    compute_op(_n, attrs={"axes": (), "keepdims": True}, num_inputs=1, logical=_reduce_empty_check(_n),
               labels=_reduce_labels(_n, _why), forward=_reduce_fwd(_f),
               flops=(lambda per: lambda a, i, o: per * float(i[0].numel))(_per), cost_class="reduce",
               autocast=_AUTOCAST.get(_n, "follow"), saves=Saves(ALL),
               doc="Empty axes reduce over all dims. The reduced dims are unshardable and the input may not "
                   "carry partial sums.")


# --- RMSNorm ----------------------------------------------------------------------------------------------
# x / sqrt(mean(x^2 over dims axis..end) + eps), times an optional scale of those dims (T5, Llama): LayerNorm's
# label structure (the normalized dims are unshardable, the others free; linear in the scale only)

ATTR_KINDS["RMSNorm"] = {"axis": "int", "eps": "num"}


def _rms_logical(a, ins):
    x = ins[0]
    if np.dtype(x.dtype if x.dtype != "bfloat16" else "float32").kind != "f":
        _bad("RMSNorm", f"input must be a float tensor, got {x.dtype}")
    ax = _axis("RMSNorm", a["axis"], x.rank)
    norm = x.sizes[ax:]
    for i, p in enumerate(ins[1:], 1):
        if p.sizes != norm:
            _bad("RMSNorm", f"input {i} has shape {list(p.sizes)}, expected {list(norm)}")
        if p.dtype != x.dtype:
            _bad("RMSNorm", f"input {i} has dtype {p.dtype}, expected {x.dtype}")
    if not math.isfinite(float(a["eps"])) or float(a["eps"]) < 0:
        _bad("RMSNorm", f"eps must be finite and >= 0, got {a['eps']}")
    return [(x.sizes, x.dtype)]


def _rms_labels(a, ins, outs):
    x = ins[0]
    lab = _dims("d", x.rank)
    norm = lab[a["axis"] % x.rank:]
    lin = (False, True) if len(ins) == 2 else ()
    return Labels((lab,) + tuple(norm for _ in ins[1:]), (lab,), frozenset(norm), lin,
                  {l: "RMS norm normalizes along it" for l in norm})


def _rms_fwd(a, xs):
    x = xs[0]
    axes = tuple(range(a["axis"] % x.ndim, x.ndim))
    y = x * (1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + a["eps"]))
    if len(xs) > 1:
        y = y * xs[1]
    return [y.astype(x.dtype, copy=False)]


compute_op("RMSNorm", attrs={"axis": -1, "eps": 1e-6}, num_inputs=(1, 2), logical=_rms_logical,
           labels=_rms_labels, forward=_rms_fwd, flops=lambda a, i, o: 5.0 * o[0].numel,
           cost_class="norm", autocast="follow", saves=Saves(ALL),
           doc="x / sqrt(mean(x^2 over dims axis..end) + eps), optionally times a scale of those dims (T5, Llama). "
               "The normalized dims are unshardable.")
