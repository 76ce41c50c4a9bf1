"""Constant folding: numpy evaluation of ONNX ops whose inputs are all constant.

``fold(ctx, ins)`` returns a list of :class:`Const` (one per node output).  Layout-only ops on a big
(lazy) constant stay lazy so that, e.g., a transposed Gemm weight is read only when needed; so do element-wise
ops on one, or broadcasting small constants into a big one (a causal mask): computed once when read whole,
a slice at a time where a slice is read, the same along a dim where every operand is.

``fold_any`` defers a fold whose result exceeds the fold guard (:data:`MAX_FOLD`; a causal mask
[B, 1, S, S] built from constants at a large batch): a lazy constant of the shape ONNX shape inference
gives, computed when evaluation or execution reads it, so planning never builds it.  A fold that must
produce its values during the import (a small result read from a huge constant, a deferred constant read
as a shape or an index) is still refused with the guard's one line.
"""
from __future__ import annotations

from math import prod
import numpy as np

from .consts import MAX_FOLD, SMALL, Const, as_ints, as_scalar, broadcast_part, broadcast_shape, deferred_of, derive, lazy
from .consts import reshape_axis
from .consts import guard as _guard
from .errors import FoldTooLarge, InvalidModel, UnsupportedOperator
from .loader import np_dtype, tensor_attr_const


def _axis(ax: int, rank: int, what: str) -> int:
    if not -rank <= ax < max(rank, 1):
        raise InvalidModel(f"{what}: axis {ax} out of range for rank {rank}")
    return ax % max(rank, 1)


def _opt(ins, i):
    return ins[i] if len(ins) > i and ins[i] is not None else None


# --- shape helpers shared with the converter -------------------------------------------------------

def reshape_target(x_shape, target, allowzero: bool, what: str) -> tuple[int, ...]:
    out = list(target)
    if not allowzero:
        for i, t in enumerate(out):
            if t == 0:
                if i >= len(x_shape):
                    raise InvalidModel(f"{what}: target dim {i} is 0 but the input has rank {len(x_shape)}")
                out[i] = x_shape[i]
    neg = [i for i, t in enumerate(out) if t == -1]
    if len(neg) > 1 or any(t < -1 for t in out):
        raise InvalidModel(f"{what}: bad reshape target {list(target)}")
    n = prod(x_shape)
    if neg:
        rest = prod(t for t in out if t != -1)
        if rest == 0 or n % rest:
            raise InvalidModel(f"{what}: cannot reshape {list(x_shape)} to {list(target)}")
        out[neg[0]] = n // rest
    if prod(out) != n:
        raise InvalidModel(f"{what}: cannot reshape {list(x_shape)} to {list(target)}")
    return tuple(out)


def unsqueeze_shape(shape, axes, what) -> tuple[int, ...]:
    r = len(shape) + len(axes)
    axs = sorted(_axis(a, r, what) for a in axes)
    if len(set(axs)) != len(axs):
        raise InvalidModel(f"{what}: repeated axes {list(axes)}")
    out = list(shape)
    for a in axs:
        out.insert(a, 1)
    return tuple(out)


def squeeze_shape(shape, axes, what) -> tuple[int, ...]:
    if axes is None or len(axes) == 0:
        return tuple(s for s in shape if s != 1)
    axs = {_axis(a, len(shape), what) for a in axes}
    for a in axs:
        if shape[a] != 1:
            raise InvalidModel(f"{what}: cannot squeeze dim {a} of size {shape[a]}")
    return tuple(s for i, s in enumerate(shape) if i not in axs)


def slice_params(ctx, ins, shape):
    """(axes, starts, ends, steps) normalized to ints within [-(n+1), n+1], one entry per sliced axis."""
    what = ctx.what
    if ctx.opset < 10:
        starts, ends = ctx.ints("starts"), ctx.ints("ends")
        axes = ctx.ints("axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = as_ints(ctx.const_in(ins, 1), what), as_ints(ctx.const_in(ins, 2), what)
        a, s = _opt(ins, 3), _opt(ins, 4)
        axes = as_ints(ctx.const_in(ins, 3), what) if a is not None else list(range(len(starts)))
        steps = as_ints(ctx.const_in(ins, 4), what) if s is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise InvalidModel(f"{what}: starts/ends/axes/steps differ in length")
    rank = len(shape)
    out = []
    seen = set()
    for ax, st, en, sp in zip(axes, starts, ends, steps):
        ax = _axis(ax, rank, what)
        if ax in seen:
            raise InvalidModel(f"{what}: axis {ax} sliced twice")
        seen.add(ax)
        if sp == 0:
            raise InvalidModel(f"{what}: slice step 0")
        n = shape[ax]
        # ONNX semantics: add n to negative indices, then clamp (start to [0, n] for a positive step and
        # [0, n-1] for a negative one; end to [0, n] or [-1, n-1]); then write them for Python's slice, where
        # an end before index 0 must be -(n+1) (-1 would mean the last element)
        st = st + n if st < 0 else st
        en = en + n if en < 0 else en
        if sp > 0:
            st, en = min(max(st, 0), n), min(max(en, 0), n)
        else:
            st, en = min(max(st, 0), n - 1), min(max(en, -1), n - 1)
            if en < 0:
                en = -(n + 1)
        out.append((ax, st, en, sp))
    return out


def slice_shape(shape, params):
    sizes = list(shape)
    for ax, st, en, sp in params:
        sizes[ax] = len(range(*slice(st, en, sp).indices(shape[ax])))
    return tuple(sizes)


def split_sizes(ctx, ins, shape):
    what = ctx.what
    axis = _axis(ctx.i("axis", 0), len(shape), what)
    n = shape[axis]
    if ctx.opset >= 13 and _opt(ins, 1) is not None:
        sizes = as_ints(ctx.const_in(ins, 1), what)
    elif ctx.opset < 13 and ctx.has("split"):
        sizes = ctx.ints("split")
    else:
        k = ctx.i("num_outputs", 0) if ctx.opset >= 18 else 0
        k = k or ctx.n_outputs
        if k < 1:
            raise InvalidModel(f"{what}: no outputs")
        chunk = -(-n // k)
        sizes = [min(chunk, n - i * chunk) for i in range(k)]
        if ctx.opset < 18 and n % k:
            raise InvalidModel(f"{what}: {n} does not split evenly into {k} outputs")
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise InvalidModel(f"{what}: split sizes {sizes} do not add up to {n}")
    return axis, sizes


def reduce_axes(ctx, ins, rank, attr_until: int):
    """Axes of a Reduce* node (attribute before opset ``attr_until``, input after); None = all."""
    if ctx.opset < attr_until:
        axes = ctx.ints("axes", None)
    else:
        axes = as_ints(ctx.const_in(ins, 1), ctx.what) if _opt(ins, 1) is not None else None
    if axes is not None and len(axes) == 0:
        axes = None
    if axes is None:
        if ctx.opset >= attr_until and ctx.i("noop_with_empty_axes", 0):
            return ()
        return None
    axs = sorted({_axis(a, rank, ctx.what) for a in axes})
    return tuple(axs)


# --- folding kernels -------------------------------------------------------------------------------

def _idiv(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        if np.any(b == 0):
            raise InvalidModel("integer division by zero in a constant")
        q = np.abs(a) // np.abs(b)
        return (q * np.sign(a) * np.sign(b)).astype(np.result_type(a, b))
    with np.errstate(all="ignore"):
        return (a / b).astype(np.result_type(a, b), copy=False)


def _mod(ctx, a, b):
    if np.any(b == 0) and a.dtype.kind in "iu":
        raise InvalidModel(f"{ctx.what}: modulo by zero")
    with np.errstate(all="ignore"):
        return np.fmod(a, b) if ctx.i("fmod", 0) else np.mod(a, b)


_BIN = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _idiv,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor,
    "BitShift": None,
}
_UN = {
    "Neg": np.negative, "Abs": np.abs, "Floor": np.floor, "Ceil": np.ceil, "Sqrt": np.sqrt, "Exp": np.exp,
    "Log": np.log, "Reciprocal": lambda x: 1.0 / x, "Relu": lambda x: np.maximum(x, 0), "Not": np.logical_not,
    "Cos": np.cos, "Sin": np.sin, "Tanh": np.tanh, "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "Sign": np.sign, "Round": np.round,
    "Identity": lambda x: x,
}


_BOOL_OUT = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not"}


def fold(ctx, ins: list, unbounded: bool = False) -> list[Const]:
    op = ctx.op
    what = ctx.what
    if not unbounded and op in ELEMWISE and _stays_lazy(ins, what):
        # element-wise on a big lazy constant (e.g. a weight scaled by a constant), or broadcasting small ones
        # into a big one (a causal mask [B, 1, S, S] from [B, 1, S, 1] and [B, 1, 1, S]): stays lazy, computed
        # once when read whole, slice by slice where a slice is read (the importer keeps a mask's first)
        shape = broadcast_shape([c.shape for c in ins if c is not None], what)
        dtype = bool if op in _BOOL_OUT else (ins[1].dtype if op == "Where" else ins[0].dtype)
        srcs = list(ins)
        held: list = []

        def compute():
            if not held:
                vals = [None if c is None else Const(c.materialize()) for c in srcs]
                held.append(fold(ctx, vals, unbounded=True)[0].value)
            return held[0]
        deferred = deferred_of(ins)
        if deferred is None and prod(shape) > MAX_FOLD:     # beyond the guard: the import may not read it whole
            try:
                _guard(prod(shape), what)
            except FoldTooLarge as e:
                deferred = str(e)
        out = lazy(compute, shape, dtype, deferred=deferred, part=_elementwise_part(ctx, srcs, shape))
        out.sources = tuple(srcs)
        return [out]

    def guard(numel, what):
        if not unbounded:
            _guard(numel, what)

    if op == "Constant":
        return [_constant(ctx)]
    if op == "ConstantOfShape":
        shape = as_ints(ctx.const_in(ins, 0), what)
        if any(s < 0 for s in shape):
            raise InvalidModel(f"{what}: negative shape {shape}")
        if ctx.has("value"):
            v = tensor_attr_const(ctx.t("value"), what)
            if v.numel != 1:
                raise InvalidModel(f"{what}: value must hold one element")
            fill, dt = v.value.reshape(-1)[0], v.dtype
        else:
            fill, dt = 0.0, np.dtype(np.float32)
        if prod(shape) <= SMALL:
            return [Const(np.full(shape, fill, dtype=dt))]
        return [lazy(lambda: np.full(shape, fill, dtype=dt), shape, dt)]
    x = ins[0] if ins else None
    if x is None and op not in ("Range", "Concat", "Sum", "Max", "Min", "Mean"):
        raise InvalidModel(f"{what}: missing input 0")

    # layout-only ops: stay lazy on big constants
    if op in ("Identity", "Dropout"):
        return [x] + ([Const(np.ones(x.shape, bool))] if ctx.n_outputs > 1 else [])
    if op == "Transpose":
        perm = ctx.ints("perm", list(range(len(x.shape)))[::-1])
        if sorted(perm) != list(range(len(x.shape))):
            raise InvalidModel(f"{what}: perm {perm} does not fit rank {len(x.shape)}")
        return [derive(x, lambda v: np.transpose(v, perm), tuple(x.shape[p] for p in perm),
                       part=lambda a, i: np.transpose(x.take(perm[a], i), perm))]
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        shape = layout_shape(ctx, ins, x.shape)

        def part(a, i, shape=shape):
            j = reshape_axis(x.shape, shape, a)
            v = x.materialize() if j is None else x.take(j, i)   # a merged/split dim: from the whole
            return v.reshape([1 if k == a else s for k, s in enumerate(shape)]) if j is not None else \
                np.take(v.reshape(shape), [i], axis=a)
        return [derive(x, lambda v: v.reshape(shape), shape, part=part)]
    if op == "Cast":
        to = np_dtype(ctx.i("to"), what)
        return [derive(x, lambda v: v.astype(to), x.shape, dtype=to, part=lambda a, i: x.take(a, i).astype(to))]

    def val(i):
        c = ins[i] if i < len(ins) else None
        if c is None:
            raise InvalidModel(f"{what}: missing input {i}")
        guard(c.numel, what)
        return c.value

    if op == "Shape":
        return [Const(np.asarray(shape_slice(ctx, x.shape), dtype=np.int64))]
    if op == "Size":
        return [Const(np.asarray(x.numel, dtype=np.int64))]
    if op in _BIN and _BIN[op] is not None:
        if len(ins) != 2 or ins[1] is None:
            raise InvalidModel(f"{what}: needs two inputs")
        guard(prod(broadcast_shape([x.shape, ins[1].shape], what)), what)
        with np.errstate(all="ignore"):
            return [Const(np.asarray(_BIN[op](val(0), val(1))))]
    if op == "Pow":
        with np.errstate(all="ignore"):
            a, b = val(0), val(1)
            guard(prod(broadcast_shape([a.shape, b.shape], what)), what)
            return [Const(np.power(a, b).astype(a.dtype, copy=False))]
    if op == "Mod":
        return [Const(_mod(ctx, val(0), val(1)))]
    if op in _UN:
        with np.errstate(all="ignore"):
            return [Const(np.asarray(_UN[op](val(0))).astype(x.dtype if op != "Not" else bool, copy=False))]
    if op in ("Sum", "Max", "Min", "Mean"):
        vs = [val(i) for i in range(len(ins)) if ins[i] is not None]
        if not vs:
            raise InvalidModel(f"{what}: no inputs")
        guard(prod(broadcast_shape([v.shape for v in vs], what)), what)
        f = {"Sum": np.add, "Max": np.maximum, "Min": np.minimum, "Mean": np.add}[op]
        acc = vs[0]
        for v in vs[1:]:
            acc = f(acc, v)
        if op == "Mean":
            acc = acc / len(vs)
        return [Const(np.asarray(acc).astype(vs[0].dtype, copy=False))]
    if op == "Where":
        c, a, b = val(0), val(1), val(2)
        guard(prod(broadcast_shape([c.shape, a.shape, b.shape], what)), what)
        return [Const(np.where(c.astype(bool), a, b))]
    if op == "Expand":
        shape = as_ints(ctx.const_in(ins, 1), what)
        out = broadcast_shape([x.shape, shape], what)
        guard(prod(out), what)
        return [Const(np.broadcast_to(val(0), out).copy())]
    if op == "Gather":
        idx = as_ints(ctx.const_in(ins, 1), what)
        ishape = ins[1].shape
        ax = _axis(ctx.i("axis", 0), len(x.shape), what)
        n = x.shape[ax]
        if any(not -n <= i < n for i in idx):
            raise InvalidModel(f"{what}: index out of range for size {n}")
        guard(x.numel // max(n, 1) * len(idx), what)
        return [Const(np.take(val(0), np.asarray(idx, dtype=np.int64).reshape(ishape), axis=ax))]
    if op == "GatherElements":  # onnx.reference's kernel fails when indices are smaller than data off the axis
        d, iv = val(0), np.asarray(as_ints(ctx.const_in(ins, 1), what), dtype=np.int64).reshape(ins[1].shape)
        if d.ndim != iv.ndim or d.ndim == 0:
            raise InvalidModel(f"{what}: indices of rank {iv.ndim} for data of rank {d.ndim}")
        ax = _axis(ctx.i("axis", 0), d.ndim, what)
        n = d.shape[ax]
        if iv.size and (iv.min() < -n or iv.max() >= n):
            raise InvalidModel(f"{what}: index out of range for size {n}")
        if any(iv.shape[k] > d.shape[k] for k in range(d.ndim) if k != ax):
            raise InvalidModel(f"{what}: indices {list(iv.shape)} exceed data {list(d.shape)} off the axis")
        part = d[tuple(slice(None) if k == ax else slice(0, iv.shape[k]) for k in range(d.ndim))]
        return [Const(np.take_along_axis(part, np.where(iv < 0, iv + n, iv), axis=ax))]
    if op == "GatherND" and ctx.i("batch_dims", 0) == 0:      # (batch_dims > 0: onnx.reference's kernel)
        d = val(0)
        iv = np.asarray(as_ints(ctx.const_in(ins, 1), what), dtype=np.int64).reshape(ins[1].shape)
        k = iv.shape[-1] if iv.ndim else 0
        if iv.ndim < 1 or not 1 <= k <= d.ndim:
            raise InvalidModel(f"{what}: indices {list(iv.shape)} for data of rank {d.ndim}")
        lim = np.asarray(d.shape[:k], dtype=np.int64)
        if iv.size and ((iv < -lim).any() or (iv >= lim).any()):
            raise InvalidModel(f"{what}: index out of range for data {list(d.shape)}")
        guard(prod(iv.shape[:-1]) * prod(d.shape[k:]), what)
        return [Const(d[tuple(np.moveaxis(iv, -1, 0))])]
    if op == "Concat":
        vs = [val(i) for i in range(len(ins)) if ins[i] is not None]
        if not vs:
            raise InvalidModel(f"{what}: no inputs")
        ax = _axis(ctx.i("axis"), vs[0].ndim, what)
        try:
            return [Const(np.concatenate(vs, axis=ax))]
        except ValueError as e:
            raise InvalidModel(f"{what}: {e}") from None
    if op == "Slice":
        params = slice_params(ctx, ins, x.shape)
        idx = [slice(None)] * len(x.shape)
        for ax, st, en, sp in params:
            idx[ax] = slice(st, en, sp)
        return [Const(val(0)[tuple(idx)].copy())]
    if op == "Split":
        axis, sizes = split_sizes(ctx, ins, x.shape)
        cuts = np.cumsum(sizes)[:-1]
        return [Const(p.copy()) for p in np.split(val(0), cuts, axis=axis)]
    if op == "Range":
        start, limit, delta = (as_scalar(ctx.const_in(ins, i), what) for i in range(3))
        if delta == 0:
            raise InvalidModel(f"{what}: Range with delta 0")
        n = max(int(np.ceil((limit - start) / delta)), 0)
        guard(n, what)
        dt = ins[0].dtype
        return [Const((start + np.arange(n) * delta).astype(dt))]
    if op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd"):
        until = 13 if op == "ReduceSum" else 18
        axes = reduce_axes(ctx, ins, len(x.shape), until)
        if axes == ():
            return [x]
        f = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max, "ReduceMin": np.min,
             "ReduceProd": np.prod}[op]
        v = val(0)
        if v.size == 0 and op in ("ReduceMax", "ReduceMin"):
            raise InvalidModel(f"{what}: reduction of an empty tensor")
        return [Const(np.asarray(f(v, axis=axes, keepdims=bool(ctx.i("keepdims", 1)))).astype(v.dtype))]
    if op == "Tile":
        reps = as_ints(ctx.const_in(ins, 1), what)
        if len(reps) != len(x.shape) or any(r < 0 for r in reps):
            raise InvalidModel(f"{what}: repeats {reps} do not fit rank {len(x.shape)}")
        guard(x.numel * prod(reps), what)
        return [Const(np.tile(val(0), reps))]
    if op == "MatMul":
        a, b = val(0), val(1)
        try:
            return [Const(np.matmul(a, b))]
        except ValueError as e:
            raise InvalidModel(f"{what}: {e}") from None
    if op == "Clip":
        v = val(0)
        lo = ctx.f("min", -np.inf) if ctx.opset < 11 else (as_scalar(ins[1], what) if _opt(ins, 1) else -np.inf)
        hi = ctx.f("max", np.inf) if ctx.opset < 11 else (as_scalar(ins[2], what) if _opt(ins, 2) else np.inf)
        return [Const(np.clip(v, lo, hi).astype(v.dtype, copy=False))]
    if op == "NonZero":
        return [Const(np.array(np.nonzero(val(0)), dtype=np.int64))]
    if op == "Trilu":
        v = val(0)
        if v.ndim < 2:
            raise InvalidModel(f"{what}: needs rank >= 2")
        k = int(as_scalar(ins[1], what)) if _opt(ins, 1) is not None else 0
        return [Const(np.triu(v, k) if ctx.i("upper", 1) else np.tril(v, k))]
    if op == "CumSum":
        v = val(0)
        ax = _axis(int(as_scalar(ins[1], what)), v.ndim, what)
        if ctx.i("exclusive", 0) or ctx.i("reverse", 0):
            raise UnsupportedOperator(f"CumSum with exclusive/reverse (node {ctx.name!r})")
        return [Const(np.cumsum(v, axis=ax).astype(v.dtype))]
    raise UnsupportedOperator(f"unsupported operator {op} on constant inputs (node {ctx.name!r})")


ELEMWISE = (set(_BIN) - {"BitShift"}) | (set(_UN) - {"Identity"}) | {"Pow", "Mod", "Where", "Sum", "Max", "Min", "Mean", "Clip"}
FOLDABLE = {"Constant", "ConstantOfShape", "Identity", "Dropout", "Transpose", "Reshape", "Flatten", "Squeeze",
            "Unsqueeze", "Cast", "Shape", "Size", "Pow", "Mod", "Sum", "Max", "Min", "Mean", "Where", "Expand",
            "Gather", "GatherElements", "Concat", "Slice", "Split", "Range", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
            "ReduceProd", "Tile", "MatMul", "Clip", "NonZero", "Trilu", "CumSum", "GatherND"} | set(_BIN) - {"BitShift"} | set(_UN)


def shape_slice(ctx, shape):
    s = list(shape)
    if ctx.opset >= 15:
        r = len(s)
        st = ctx.i("start", 0)
        en = ctx.i("end", r) if ctx.has("end") else r
        st = min(max(st + r if st < 0 else st, 0), r)
        en = min(max(en + r if en < 0 else en, 0), r)
        s = s[st:en]
    return s


def layout_shape(ctx, ins, shape) -> tuple[int, ...]:
    """Output shape of Reshape/Flatten/Squeeze/Unsqueeze on a tensor of ``shape``."""
    op, what = ctx.op, ctx.what
    if op == "Reshape":
        if ctx.opset < 5:
            target = ctx.ints("shape")
        else:
            target = as_ints(ctx.const_in(ins, 1), what)
        return reshape_target(shape, target, bool(ctx.i("allowzero", 0)), what)
    if op == "Flatten":
        r = len(shape)
        ax = ctx.i("axis", 1)
        if not -r <= ax <= r:
            raise InvalidModel(f"{what}: axis {ax} out of range for rank {r}")
        ax = ax + r if ax < 0 else ax
        return (prod(shape[:ax]), prod(shape[ax:]))
    if ctx.opset >= 13:
        axes = as_ints(ctx.const_in(ins, 1), what) if _opt(ins, 1) is not None else None
    else:
        axes = ctx.ints("axes", None)
    if op == "Squeeze":
        return squeeze_shape(shape, axes, what)
    if axes is None:
        raise InvalidModel(f"{what}: Unsqueeze needs axes")
    return unsqueeze_shape(shape, axes, what)


def _constant(ctx) -> Const:
    what = ctx.what
    if ctx.has("value"):
        return tensor_attr_const(ctx.t("value"), what)
    if ctx.has("value_float"):
        return Const(np.asarray(ctx.f("value_float"), dtype=np.float32))
    if ctx.has("value_floats"):
        return Const(np.asarray(ctx.floats("value_floats"), dtype=np.float32))
    if ctx.has("value_int"):
        return Const(np.asarray(ctx.i("value_int"), dtype=np.int64))
    if ctx.has("value_ints"):
        return Const(np.asarray(ctx.ints("value_ints"), dtype=np.int64))
    if ctx.has("sparse_value"):
        raise UnsupportedOperator(f"Constant with a sparse value (node {ctx.name!r})")
    raise InvalidModel(f"{what}: Constant without a value")



# --- any other operator: onnx.reference on a one-node model ---------------------------------------

#: operators whose value is not a function of their inputs: never folded
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli"}


def _one_node_model(ctx, ins, with_values: bool):
    """A model holding only ``ctx.node``; constant inputs are graph inputs (or initializers when
    ``with_values``, so shape inference can propagate small shape tensors)."""
    import onnx
    from onnx import helper, numpy_helper

    node = onnx.NodeProto()
    node.CopyFrom(ctx.node)
    inputs, inits, seen = [], [], set()
    for name, c in zip(node.input, ins):
        if not name or c is None or name in seen:
            continue
        seen.add(name)
        etype = helper.np_dtype_to_tensor_dtype(np.dtype(c.dtype))
        if with_values and (not c.lazy or c.numel <= SMALL) and c.deferred is None:
            inits.append(numpy_helper.from_array(np.asarray(c.value), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, etype, list(c.shape)))
    outs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o]
    g = helper.make_graph([node], "fold", inputs, outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", ctx.opset)])


#: operators whose output can be much larger than their inputs: their output size is checked with ONNX shape
#: inference before evaluating (only these: shape inference of a malformed node can crash the process, e.g.
#: GatherND with a negative batch_dims in onnx 1.23, so it is not run on every folded node)
GROWING = {"Pad", "Resize", "Upsample", "OneHot", "Einsum", "ConvTranspose", "Col2Im", "CenterCropPad",
           "MaxUnpool", "Gemm", "MatMulInteger", "QLinearMatMul", "GridSample", "AffineGrid", "DFT", "STFT",
           "MelWeightMatrix", "BlackmanWindow", "HannWindow", "HammingWindow"}


def _inferred_numel(ctx, ins) -> list:
    """Element counts of the node's outputs where ONNX shape inference (with data propagation) knows them
    (:data:`GROWING` operators only)."""
    import onnx
    if ctx.op not in GROWING:
        return []
    try:
        m = onnx.shape_inference.infer_shapes(_one_node_model(ctx, ins, True), strict_mode=False, data_prop=True)
    except Exception:
        return []
    out = []
    for vi in m.graph.output:
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
            continue
        out.append((vi.name, prod(int(d.dim_value) for d in tt.shape.dim)))
    return out


def reference_fold(ctx, ins: list, unbounded: bool = False) -> list[Const]:
    """Fold a node whose inputs are all constant with ``onnx.reference`` (any default-domain operator).

    Refused with one line: random operators, control flow (subgraph attributes), inputs or outputs
    beyond :data:`MAX_FOLD` elements (the output size is checked before evaluating where shape
    inference knows it; not with ``unbounded``, a deferred fold's evaluation), and element types a PCG
    constant cannot hold."""
    import onnx
    what = ctx.what
    if ctx.op in NONDETERMINISTIC:
        raise UnsupportedOperator(f"{ctx.op} is random; it cannot be folded to a constant (node {ctx.name!r})")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in ctx.node.attribute):
        raise UnsupportedOperator(f"control flow ({ctx.op} with a subgraph) on constants is not folded "
                                  f"(node {ctx.name!r})")
    for c in ins:
        if not unbounded and c is not None and c.numel > MAX_FOLD:
            raise FoldTooLarge(f"{what}: folding it would read a constant of {c.numel} elements "
                               f"(limit {MAX_FOLD})")
    _check_gathernd(ctx)
    for name, n in ([] if unbounded else _inferred_numel(ctx, ins)):
        if n > MAX_FOLD:
            raise FoldTooLarge(f"{what}: folding it would make a constant {name!r} of {n} elements "
                               f"(limit {MAX_FOLD}); a model input is probably too large")
    from onnx.reference import ReferenceEvaluator
    model = _one_node_model(ctx, ins, False)
    feeds = {name: np.asarray(c.materialize()) for name, c in zip(ctx.node.input, ins) if name and c is not None}
    try:
        with np.errstate(all="ignore"):
            res = ReferenceEvaluator(model).run(None, feeds)
    except (NotImplementedError, KeyError) as e:
        raise UnsupportedOperator(f"unsupported operator {ctx.op} on constant inputs: onnx.reference cannot "
                                  f"evaluate it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                                  f" (node {ctx.name!r})") from None
    except MemoryError:
        raise InvalidModel(f"{what}: out of memory while folding a constant") from None
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise InvalidModel(f"{what}: cannot fold its constant inputs ({type(e).__name__}: {msg[:200]})") from None
    out: list = []
    k = 0
    for o in ctx.node.output:
        if not o:
            out.append(None)
            continue
        v = res[k]
        k += 1
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (list, tuple, dict)):
            raise UnsupportedOperator(f"{what}: folds to a sequence or map, which a PCG cannot hold")
        v = np.asarray(v)
        if v.dtype.kind in "OUS":
            raise UnsupportedOperator(f"{what}: folds to a {v.dtype} tensor, which a PCG cannot hold")
        if v.size > MAX_FOLD and not unbounded:
            raise InvalidModel(f"{what}: folding it makes a constant of {v.size} elements (limit {MAX_FOLD})")
        out.append(Const(v))
    return out


def _check_gathernd(ctx) -> None:
    if ctx.op == "GatherND" and ctx.i("batch_dims", 0) < 0:   # onnx 1.23's shape inference segfaults on it
        raise InvalidModel(f"{ctx.what}: attribute 'batch_dims' must be >= 0, got {ctx.i('batch_dims', 0)}")


def _stays_lazy(ins: list, what: str) -> bool:
    """Whether an element-wise fold of ``ins`` stays lazy: an operand is a big (or deferred) lazy constant, or
    the result is big and bigger than every operand (a broadcast)."""
    cs = [c for c in ins if c is not None]
    if any(c.lazy and (c.numel > SMALL or c.deferred) for c in cs):
        return True
    if not cs:
        return False
    n = prod(broadcast_shape([c.shape for c in cs], what))
    return n > SMALL and n > max(c.numel for c in cs)


def _fold_now(ctx, ins: list, unbounded: bool = False) -> list[Const]:
    if ctx.op in FOLDABLE:
        try:
            return fold(ctx, ins, unbounded=unbounded)
        except UnsupportedOperator:
            pass
    return reference_fold(ctx, ins, unbounded=unbounded)


def fold_any(ctx, ins: list) -> list[Const]:
    """Fold a node whose inputs are all constant: the numpy kernels above where they exist (fast, lazy on
    big weights), ``onnx.reference`` for every other operator and for forms the kernels do not cover.

    A fold beyond the guard whose result is the large one is deferred (:func:`deferred_fold`); any other
    raises the guard's :class:`FoldTooLarge`."""
    try:
        return _fold_now(ctx, ins)
    except FoldTooLarge as e:
        out = deferred_fold(ctx, ins, str(e))
        if out is None:   # name the deferred fold this one reads, where there is one: the root cause
            raise FoldTooLarge(deferred_of(ins) or str(e)) from None
        return out


def _inferred_outputs(ctx, ins) -> list | None:
    """(shape, dtype) of each output of the node (None for an omitted one) by ONNX shape inference with data
    propagation, or None where an output's shape or element type is not known."""
    import onnx
    from onnx import helper
    try:
        m = onnx.shape_inference.infer_shapes(_one_node_model(ctx, ins, True), strict_mode=False, data_prop=True)
    except Exception:
        return None
    known = {}
    for vi in m.graph.output:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or tt.elem_type in (
                onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
            continue
        if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in tt.shape.dim):
            continue
        try:
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except Exception:
            continue
        known[vi.name] = (tuple(int(d.dim_value) for d in tt.shape.dim), dt)
    out = []
    for o in ctx.node.output:
        if not o:
            out.append(None)
        elif o not in known:
            return None
        else:
            out.append(known[o])
    return out


def deferred_fold(ctx, ins: list, refusal: str) -> list | None:
    """The outputs of a fold refused by the guard as lazy constants (shapes and element types by ONNX shape
    inference), computed without the guard when their values are read; None (the refusal stands) for a
    random or control-flow node, where shape inference does not know every output, or where no output
    exceeds the guard (a small result of a huge constant must be computed now to be a constant at all).
    Each output keeps ``refusal`` as its :attr:`Const.deferred`."""
    import onnx
    if ctx.op in NONDETERMINISTIC or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                         for a in ctx.node.attribute):
        return None
    _check_gathernd(ctx)
    outs = _inferred_outputs(ctx, ins)
    if outs is None or not any(o is not None and prod(o[0]) > MAX_FOLD for o in outs):
        return None
    srcs = list(ins)

    def compute(k):
        vals = [None if c is None else Const(c.materialize()) for c in srcs]
        res = _fold_now(ctx, vals, unbounded=True)
        return res[k].materialize()
    # an element-wise result (a causal mask compared, combined and selected at [B, 1, S, S]) or an Expand of a
    # smaller constant also computes one slice at a time, from its operands' slices
    part = _elementwise_part(ctx, srcs, outs[0][0]) if (ctx.op in ELEMWISE or ctx.op == "Expand") \
        and len(outs) == 1 and outs[0] is not None else None
    return [None if o is None else lazy(lambda k=k: compute(k), o[0], o[1], deferred=refusal, part=part)
            for k, o in enumerate(outs)]


def _elementwise_part(ctx, srcs: list, shape) -> "Callable[[int, int], np.ndarray]":
    """:attr:`Const.part` of an element-wise (broadcasting) fold, or of Expand, with output ``shape``: the fold
    of the operands' slices (an operand that broadcasts along that dim is read whole), memory of one slice."""
    shape = tuple(shape)

    def part(axis: int, i: int) -> np.ndarray:
        if ctx.op == "Expand":
            want = tuple(1 if k == axis else s for k, s in enumerate(shape))
            return np.broadcast_to(broadcast_part(srcs[0], shape, axis, i), want)
        vals = [None if c is None else Const(np.asarray(broadcast_part(c, shape, axis, i))) for c in srcs]
        return _fold_now(ctx, vals, unbounded=True)[0].materialize()
    return part
