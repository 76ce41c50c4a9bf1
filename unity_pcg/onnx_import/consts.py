"""Constants met while importing an ONNX graph, and numpy folding of ops whose inputs are all constant.

A :class:`Const` knows its shape and dtype without holding its value: initializers, external data and
``ConstantOfShape`` results are materialized only when asked for (import of big models stays fast,
and the PCG's weight store gets zero-arg callables).  Layout-only ops on a big constant (Transpose,
Reshape, Cast, ...) and element-wise ones that make or read a big constant stay lazy too; everything else is
folded eagerly with numpy, under a size guard.
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

import numpy as np

from .errors import FoldTooLarge, InvalidModel

# constants at most this big are materialized eagerly when an op needs their value
SMALL = 1 << 16
# refuse to fold a constant bigger than this many elements (a corrupt shape, not a model)
MAX_FOLD = 1 << 25


class Const:
    """A constant tensor: eager (``value``) or lazy (``fn`` + known ``shape``/``dtype``).

    ``origin``: the initializer it was derived from by layout-only ops (used to name the Weight).
    ``deferred``: set on a fold deferred past the fold guard (and on constants computed from one): the
    refusal to raise where the import itself would read its values (``value``); ``materialize``/``loader``
    (evaluation, execution) still compute them.
    ``part``: on a lazy constant, optionally ``part(axis, i)`` -> the one slice ``i`` along ``axis`` (keepdims),
    computed from how the constant is made (element-wise folds slice their inputs) without building the whole;
    :meth:`take` uses it (the batch override checks a mask [B, 1, S, S] slice by slice).
    ``frozen``: a constant of the model, not a parameter (its Weight is made with ``trainable=False``): set on
    the exporter's folds the importer recognizes (:meth:`Importer._reduce_consts`).
    ``sources``: on a lazy element-wise fold, its operands (None entries allowed): the fold is the same along
    a dim wherever every operand is (:func:`uniform_along` asks them first, without building the slices).
    """

    __slots__ = ("shape", "dtype", "_value", "_fn", "origin", "wref", "deferred", "part", "frozen", "sources")

    def __init__(self, value: Any = None, *, shape: Sequence[int] | None = None, dtype: Any = None,
                 fn: Callable[[], np.ndarray] | None = None, origin: str | None = None):
        if fn is None:
            value = np.asarray(value)
            self.shape = tuple(int(s) for s in value.shape)
            self.dtype = value.dtype
        else:
            self.shape = tuple(int(s) for s in shape)
            self.dtype = np.dtype(dtype)
        self._value = value if fn is None else None
        self._fn = fn
        self.origin = origin
        self.wref = None  # the PCG ref of its Weight node, once made
        self.deferred: str | None = None
        self.part: Callable[[int, int], np.ndarray] | None = None
        self.frozen = False
        self.sources: tuple | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def lazy(self) -> bool:
        return self._value is None

    @property
    def value(self) -> np.ndarray:
        if self._value is not None:
            return self._value
        if self.deferred is not None:   # the import needs the values of a fold beyond the guard
            raise FoldTooLarge(self.deferred)
        v = self.materialize()
        if v.size <= SMALL:
            self._value = v
        return v

    def materialize(self) -> np.ndarray:
        if self._value is not None:
            return self._value
        v = np.asarray(self._fn())
        if tuple(v.shape) != self.shape:
            v = v.reshape(self.shape)
        return v.astype(self.dtype, copy=False)

    def take(self, axis: int, i: int) -> np.ndarray:
        """Slice ``i`` along ``axis`` (that dim kept, of size 1): from the value when it is held, else from
        :attr:`part` where the constant has one (memory of one slice, not of the whole), else by
        materializing.  Allowed on a deferred constant (a bounded computation, not the refused fold)."""
        if self._value is not None:
            return np.take(self._value, [i], axis=axis)
        if self.part is not None:
            want = tuple(1 if k == axis else s for k, s in enumerate(self.shape))
            v = np.asarray(self.part(axis, i))
            v = v.reshape(want) if v.size == prod(want) else np.broadcast_to(v, want)
            return v.astype(self.dtype, copy=False)
        return np.take(self.materialize(), [i], axis=axis)

    def loader(self) -> Callable[[], np.ndarray]:
        """A zero-arg callable giving the value (for ``PCG.weights``)."""
        if self._value is not None:
            v = self._value
            return lambda: v
        return self.materialize

    def __repr__(self) -> str:
        return f"Const({list(self.shape)}, {self.dtype}{', lazy' if self.lazy else ''})"


def lazy(fn: Callable[[], np.ndarray], shape, dtype, origin=None, deferred: str | None = None,
         part: Callable[[int, int], np.ndarray] | None = None) -> Const:
    c = Const(fn=fn, shape=shape, dtype=dtype, origin=origin)
    c.deferred = deferred
    c.part = part
    return c


def uniform_along(c: Const, axis: int) -> bool:
    """Whether every slice of ``c`` along ``axis`` equals the first (exactly; NaN equals NaN): known from how it
    is made where :func:`_known_uniform` can tell, else compared one slice at a time (:meth:`Const.take`),
    stopping at the first that differs."""
    if _known_uniform(c, axis):
        return True
    first = c.take(axis, 0)
    nan = np.dtype(c.dtype).kind in "fc"
    for i in range(1, c.shape[axis]):
        if not np.array_equal(c.take(axis, i), first, equal_nan=nan):
            return False
    return True


def _known_uniform(c: Const, axis: int) -> bool:
    """Whether ``c`` is the same along ``axis`` by what is cheap to read: the dim has size 1; ``c`` is a small
    held value (compared); or ``c`` is an element-wise fold (:attr:`Const.sources`) each of whose operands is
    absent along that dim, of size 1 there, or known the same along its own dim.  False means unknown."""
    if c.shape[axis] <= 1:
        return True
    if c.sources is not None:
        rank = len(c.shape)
        for o in c.sources:
            j = None if o is None else axis - (rank - len(o.shape))
            if o is not None and j >= 0 and o.shape[j] != 1 and not _known_uniform(o, j):
                return False
        return True
    if c.lazy or c.numel > SMALL:
        return False
    v = c.value
    return np.array_equal(v, np.broadcast_to(np.take(v, [0], axis=axis), v.shape),
                          equal_nan=np.dtype(c.dtype).kind in "fc")


def first_slices(c: Const, dims: Sequence[int]) -> Const:
    """``c`` restricted to its first slice along each of ``dims`` (those dims kept, of size 1): eager when small
    or when ``c`` holds its value, else lazy with its own :attr:`Const.part` (never built whole).  Keeps
    ``origin``, ``deferred`` and ``frozen``."""
    dims = tuple(sorted(set(dims)))
    shape = tuple(1 if k in dims else s for k, s in enumerate(c.shape))

    def firsts(v: np.ndarray, skip: int | None = None) -> np.ndarray:
        for d in dims:
            if d != skip and v.shape[d] != 1:
                v = np.take(v, [0], axis=d)
        return v

    def whole() -> np.ndarray:
        return np.array(firsts(c.take(dims[0], 0), dims[0]))      # an owned, writable copy

    def part(a: int, i: int) -> np.ndarray:
        return whole() if a in dims else np.array(firsts(c.take(a, i)))
    if not c.lazy or prod(shape) <= SMALL:
        out = Const(whole(), origin=c.origin)
        out.deferred = None
    else:
        out = lazy(whole, shape, c.dtype, c.origin, c.deferred, part=part)
    out.frozen = c.frozen
    return out


def deferred_of(consts) -> str | None:
    """The refusal of the first deferred constant among ``consts`` (None entries allowed), or None."""
    return next((c.deferred for c in consts if c is not None and c.deferred is not None), None)


def guard(numel: int, what: str) -> None:
    if numel > MAX_FOLD:
        raise FoldTooLarge(f"{what}: constant of {numel} elements is too large to fold "
                           f"(limit {MAX_FOLD})")


def derive(c: Const, fn: Callable[[np.ndarray], np.ndarray], shape, dtype=None, keep_origin=True,
           part: Callable[[int, int], np.ndarray] | None = None) -> Const:
    """A constant computed from ``c`` by ``fn``: eager when ``c`` is small, lazy otherwise (with ``part``,
    its slice computer, see :attr:`Const.part`)."""
    dtype = c.dtype if dtype is None else np.dtype(dtype)
    origin = c.origin if keep_origin else None
    if not c.lazy or (c.numel <= SMALL and c.deferred is None):
        return Const(np.asarray(fn(c.value)).astype(dtype, copy=False), origin=origin)
    return lazy(lambda: fn(c.materialize()), shape, dtype, origin, c.deferred, part=part)


def broadcast_part(c: Const, shape, axis: int, i: int):
    """The operand of a broadcasting operator whose output has ``shape``, restricted to the output's slice ``i``
    along ``axis``: ``c`` itself where it broadcasts along that dim (absent or of size 1), else its slice."""
    j = axis - (len(shape) - len(c.shape))
    if j < 0 or c.shape[j] == 1:
        return c.materialize()
    return c.take(j, i)


def reshape_axis(src_shape, dst_shape, axis: int) -> int | None:
    """The dim of ``src_shape`` that a reshape to ``dst_shape`` leaves as dim ``axis`` (same size, same number
    of elements before it), or None where that dim is merged or split."""
    before = prod(dst_shape[:axis])
    for j, s in enumerate(src_shape):
        if s == dst_shape[axis] and prod(src_shape[:j]) == before:
            return j
    return None


def broadcast_shape(shapes: Sequence[Sequence[int]], what: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise InvalidModel(f"{what}: shapes {[list(s) for s in shapes]} do not broadcast") from None


def as_ints(c: Const, what: str) -> list[int]:
    """A small integer constant (shape, axes, pads, ...) as a list of Python ints."""
    if c.numel > SMALL:
        raise InvalidModel(f"{what}: expected a small integer tensor, got shape {list(c.shape)}")
    v = c.value
    if v.dtype.kind not in "iub":
        if v.dtype.kind == "f" and np.all(np.isfinite(v)) and np.all(v == np.round(v)):
            v = v.astype(np.int64)
        else:
            raise InvalidModel(f"{what}: expected integers, got {v.dtype}")
    return [int(x) for x in v.reshape(-1)]


def as_scalar(c: Const, what: str) -> float:
    if c.numel != 1:
        raise InvalidModel(f"{what}: expected a scalar, got shape {list(c.shape)}")
    return c.value.reshape(-1)[0].item()
