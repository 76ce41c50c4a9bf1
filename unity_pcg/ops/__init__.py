"""The operator registry: one entry per operator (DESIGN "Operator spec").

``infer(op, attrs, in_shapes)`` gives the output parallel shapes (or raises
InvalidParallelization saying why); ``run_logical`` / ``run_pieces`` evaluate the numpy reference
on logical values or on piece values.  FLOPs: ``flops(op, attrs, in_shapes, out_shapes)`` on logical
shapes, ``task_flops`` for one task (one piece of work on one device).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import pieces as P
from ..shape import ParallelTensorShape
from . import compute, parallel  # noqa: F401  (registration)
from . import fused  # noqa: F401  (AllReduce, a fused parallel operator)
from . import elementwise, indexing, spatial  # noqa: F401  (registration: the import-coverage operators)
from . import random_gen  # noqa: F401  (registration: RandomNormal, RandomUniform)
from .base import (ALL, AUTOCAST_MODES, NOTHING, REGISTRY, REQUIRED, Inference, Labels, OpSpec, PieceMap, Saves,
                   TensorMap, get_op, logical_shapes, piece_shapes)
from .parallel import PARALLEL_OPS

COMPUTE_OPS = tuple(n for n, s in REGISTRY.items() if s.kind == "compute")
SOURCE_OPS = tuple(n for n, s in REGISTRY.items() if s.kind == "source")


# --- operator knowledge of the cost and memory models (OpSpec.cost_class, autocast, saves, nondiff_inputs) --

def _stated(spec: OpSpec, field: str):
    v = getattr(spec, field)
    if v is None and spec.kind == "compute":
        raise AssertionError(f"operator {spec.name}: its registry entry states no {field} (DESIGN \"Operator spec\")")
    return v


def cost_class(op: str, in_shapes: Sequence[ParallelTensorShape] | None = None) -> str:
    """The cost model's class of ``op`` on these input shapes (None: any), from its registry entry;
    ``"default"`` for sources and parallel operators, which no class prices."""
    c = _stated(get_op(op), "cost_class")
    if c is None:
        return "default"
    return c(in_shapes) if callable(c) else c


def autocast(op: str) -> str:
    """What torch.autocast does with ``op`` under bf16 (one of :data:`AUTOCAST_MODES`); parallel operators
    and sources pass their input's dtype on (``"follow"``)."""
    return _stated(get_op(op), "autocast") or "follow"


def saves(op: str) -> Saves:
    """What ``op`` keeps from its forward pass for its backward (:class:`Saves`)."""
    return _stated(get_op(op), "saves") or NOTHING


# (operator, input position) pairs that get no gradient although they may be float (running statistics)
NON_DIFFERENTIABLE = frozenset((n, p) for n, s in REGISTRY.items() for p in s.nondiff_inputs)


#: memo of :func:`infer`: (op, frozen attributes, input shapes, strict) -> Inference (frozen values, so the
#: same object serves every caller); cleared when it reaches INFER_CACHE_MAX entries
_INFER_CACHE: dict = {}
INFER_CACHE_MAX = 1 << 18


def _frozen(v):
    """A hashable key for an attribute value that tells apart what ``==`` does not (1, 1.0 and True; a list
    and a tuple); raises TypeError on a value that cannot be a key (an array)."""
    t = type(v)
    if t is int or t is str or t is float or t is bool or v is None:
        return (t, v)
    if t is list or t is tuple:
        return (t, tuple(_frozen(x) for x in v))
    if t is dict:
        return (t, tuple(sorted((k, _frozen(x)) for k, x in v.items())))
    raise TypeError(f"no key for {t.__name__}")


def infer(op: str, attrs: Mapping[str, Any], in_shapes: Sequence[ParallelTensorShape],
          strict: bool = True) -> Inference:
    """The output shapes and piece map of ``op`` on ``in_shapes`` (or InvalidParallelization saying why).

    Shape inference is a pure function of its arguments and its result is frozen, so it is memoized: a
    model's repeated blocks (and every rebuilt copy of a graph) infer each distinct (operator, attributes,
    input shapes) once.  Attribute values that cannot be keys (arrays) skip the memo; refusals are not
    memoized (they raise afresh)."""
    ins = tuple(in_shapes)
    try:
        key = (op, tuple(sorted((k, _frozen(v)) for k, v in attrs.items())), ins, strict)
        hit = _INFER_CACHE.get(key)
    except TypeError:
        key = hit = None
    if hit is not None:
        return hit
    spec = get_op(op)
    spec.check_arity(len(ins))
    r = spec.infer(dict(attrs), ins, strict=strict)
    if key is not None:
        if len(_INFER_CACHE) >= INFER_CACHE_MAX:
            _INFER_CACHE.clear()
        _INFER_CACHE[key] = r
    return r


def infer_uncached(op: str, attrs: Mapping[str, Any], in_shapes: Sequence[ParallelTensorShape],
                   strict: bool = True) -> Inference:
    """:func:`infer` without its memo (the reference the memo is tested against)."""
    spec = get_op(op)
    spec.check_arity(len(in_shapes))
    return spec.infer(dict(attrs), tuple(in_shapes), strict=strict)


def run_logical(op: str, attrs: Mapping[str, Any], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return get_op(op).forward(dict(attrs), list(xs))


def run_pieces(op: str, attrs: Mapping[str, Any], xs: Sequence[np.ndarray],
               in_shapes: Sequence[ParallelTensorShape], strict: bool = True
               ) -> tuple[list[np.ndarray], tuple[ParallelTensorShape, ...]]:
    """Evaluate on piece values (see :mod:`unity_pcg.pieces`); returns output pieces and shapes."""
    spec = get_op(op)
    a = dict(attrs)
    inf = infer(op, a, in_shapes, strict=strict)
    if spec.kind == "parallel":
        s = in_shapes[0]
        x = xs[0]
        if op in ("Partition", "Pipeline"):
            y = P.partition(x, s.rank, a["dim"] % s.rank, a["degree"])
        elif op in ("Combine", "Batch"):
            y = P.combine(x, s.rank, a["dim"] % s.rank, a["degree"])
        elif op == "Replicate":
            y = P.replicate(x, a["degree"])
        elif op == "Reduce":
            y = P.reduce(x, a["degree"])
        else:
            y = fused.PIECE_KERNELS[op](x, s, a)
        return [y], inf.outputs
    if spec.kind != "compute":
        raise ValueError(f"{op} nodes have no piecewise kernel")
    pa = spec.piece_attrs(a, tuple(in_shapes), inf.outputs) if spec.piece_attrs else a
    return P.run_piecewise(spec.forward, a, pa, inf.piece_map, xs, in_shapes, inf.outputs), inf.outputs


def flops(op: str, attrs: Mapping[str, Any], in_shapes: Sequence[ParallelTensorShape],
          out_shapes: Sequence[ParallelTensorShape]) -> float:
    return float(get_op(op).flops(dict(attrs), logical_shapes(in_shapes), logical_shapes(out_shapes)))


def task_flops(op: str, attrs: Mapping[str, Any], in_shapes: Sequence[ParallelTensorShape],
               out_shapes: Sequence[ParallelTensorShape]) -> float:
    """FLOPs of one task: the kernel run on one piece of every tensor."""
    spec = get_op(op)
    a = dict(attrs)
    pa = spec.piece_attrs(a, tuple(in_shapes), tuple(out_shapes)) if spec.piece_attrs else a
    return float(spec.flops(pa, piece_shapes(in_shapes), piece_shapes(out_shapes)))


def bytes_moved(op: str, in_shapes: Sequence[ParallelTensorShape], out_shapes: Sequence[ParallelTensorShape],
                per_task: bool = False) -> int:
    spec = get_op(op)
    f = piece_shapes if per_task else logical_shapes
    return spec.bytes_moved(f(in_shapes), f(out_shapes))


__all__ = ["REGISTRY", "REQUIRED", "COMPUTE_OPS", "SOURCE_OPS", "PARALLEL_OPS", "Inference", "Labels",
           "OpSpec", "PieceMap", "TensorMap", "get_op", "infer", "run_logical", "run_pieces", "flops",
           "task_flops", "bytes_moved", "ALL", "AUTOCAST_MODES", "NOTHING", "Saves", "cost_class", "autocast",
           "saves", "NON_DIFFERENTIABLE"]
