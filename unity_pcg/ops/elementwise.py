"""Element-wise, logical, comparison and reduction operators added for ONNX import coverage (issue 10): registered
with :func:`unity_pcg.ops.compute.compute_op` like the core set.

Every operator here states its parallel behaviour with labels, as the core set does:

* unary activations (Silu, GeluTanh, LeakyRelu, Elu, ...) label every dim of the input and the output alike,
  so any dim may be sharded; none of them is additive, so partial sums are refused (an activation of a partial
  sum is not the sum of the activations);
* PRelu is a binary operator whose slope broadcasts onto the input (ONNX's unidirectional broadcast): labels as
  :func:`~unity_pcg.ops.compute._binary` gives them, no partial sums on either input;
* LogSoftmax normalizes along its axis, which is unshardable (as Softmax's);
* ReduceMax / ReduceMin / ReduceProd / ReduceL2 leave their reduced dims unshardable: the max (min, product,
  norm) of the pieces is not their sum, so sharding a reduced dim cannot be expressed as partial sums.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import kernels as K
from .base import Labels
from .compute import ATTR_KINDS, _axis, _bad, _broadcast, _broadcast_labels, _dims, _reduce_axes, \
    _reduce_logical, _same, compute_op

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _unary(name: str, fn: Callable, flops_per: float, attrs: dict | None = None,
           kinds: dict | None = None, doc: str = "") -> None:
    """An element-wise operator of one input: every dim shardable, no partial sums."""
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
               flops=lambda a, i, o: flops_per * o[0].numel, doc=doc)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) without overflow."""
    return np.logaddexp(np.zeros((), x.dtype), x)


# --- activations ------------------------------------------------------------------------------------

_unary("Silu", lambda a, x: x * K.sigmoid(x), 5, doc="x * sigmoid(x) (SiLU, Swish with beta 1).")
_unary("GeluTanh", lambda a, x: gelu_tanh(x), 9, doc="GELU's tanh approximation (ONNX Gelu approximate='tanh').")
