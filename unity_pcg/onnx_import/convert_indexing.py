"""ONNX converters for the operators of :mod:`unity_pcg.ops.indexing` (registered into
:data:`unity_pcg.onnx_import.convert.CONVERTERS`).

They run for nodes with at least one activation input (all-constant nodes are folded before).  Each
checks what the ONNX spec lets a file get wrong (dtypes, attribute values, constant index ranges) and
raises a typed one-line error naming the node and the attribute; an attribute value the registry
operator does not implement (ScatterND's ``reduction``, an Einsum summing over ellipsis dims, a computed
Trilu ``k`` or CumSum ``axis``) is an :class:`UnsupportedOperator` naming it.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidParallelization
from ..ops.indexing import COMPARISONS, LOGIC, parse_einsum
from .consts import Const, as_ints, broadcast_shape, derive
from .convert import _axis, _conv, _hint, _in, _name, _R, _unsupported
from .errors import InvalidModel, UnsupportedOperator


def _nonempty(imp, ctx, y):
    """Empty tensors are refused (as the core converters refuse empty slices, splits and expands)."""
    if 0 in imp.sizes(y):
        _unsupported(ctx, f"an empty output of shape {list(imp.sizes(y))}")
    return y


def _add(imp, ctx, op, attrs, refs, name):
    return _nonempty(imp, ctx, imp.add(op, attrs, refs, name))


def _refs(imp, ctx, ins, n):
    return [imp.ref(_in(ctx, ins, i), _hint(ctx, i)) for i in range(n)]


def _flag(ctx, key: str, default: int = 0) -> bool:
    v = ctx.i(key, default)
    if v not in (0, 1):
        raise InvalidModel(f"{ctx.what}: attribute {key!r} must be 0 or 1, got {v}")
    return bool(v)


def _const(imp, ctx, ins, i, name) -> Const:
    v = _in(ctx, ins, i)
    if not isinstance(v, Const):
        _unsupported(ctx, f"input {name!r} computed from activations; it must be a constant")
    return v


def _same_dtype(imp, ctx, vals, what="inputs"):
    dts = [imp.dtype(v) for v in vals]
    if len(set(dts)) > 1:
        raise InvalidModel(f"{ctx.what}: {what} differ in element type ({', '.join(dts)})")
    return dts[0]


# --- Where, comparisons, boolean logic ------------------------------------------------------------------

@_conv("Where")
def _where(imp, ctx, ins):
    c, x, y = (_in(ctx, ins, i) for i in range(3))
    if imp.dtype(c) != "bool":
        raise InvalidModel(f"{ctx.what}: the condition must be bool, got {imp.dtype(c)}")
    _same_dtype(imp, ctx, [x, y], "inputs 1 and 2")
    broadcast_shape([imp.sizes(v) for v in (c, x, y)], ctx.what)
    return [_add(imp, ctx, "Where", {}, _refs(imp, ctx, ins, 3), ctx.name)]


@_conv(*COMPARISONS)
def _compare(imp, ctx, ins):
    a, b = _in(ctx, ins, 0), _in(ctx, ins, 1)
    dt = _same_dtype(imp, ctx, [a, b])
    if dt == "bool" and ctx.op != "Equal":
        raise InvalidModel(f"{ctx.what}: {ctx.op} of bool inputs")
    broadcast_shape([imp.sizes(a), imp.sizes(b)], ctx.what)
    return [_add(imp, ctx, ctx.op, {}, _refs(imp, ctx, ins, 2), ctx.name)]


@_conv("Not", *LOGIC)
def _logic(imp, ctx, ins):
    n = 1 if ctx.op == "Not" else 2
    vals = [_in(ctx, ins, i) for i in range(n)]
    for i, v in enumerate(vals):
        if imp.dtype(v) != "bool":
            raise InvalidModel(f"{ctx.what}: input {i} must be bool, got {imp.dtype(v)}")
    broadcast_shape([imp.sizes(v) for v in vals], ctx.what)
    return [_add(imp, ctx, ctx.op, {}, _refs(imp, ctx, ins, n), ctx.name)]


# --- IsNaN / IsInf: exact rewrites onto the comparisons --------------------------------------------------
# transformers' sdpa attention, exported by the dynamo exporter, guards the softmax of a fully masked row with
# Where(IsNaN(p), 0, p).  IsNaN(x) is Not(Equal(x, x)) (NaN is the one value unequal to itself) and IsInf(x) is
# Equal(|x|, inf) (or Equal(x, +-inf) for one sign), in numpy, torch and IEEE alike; so both import onto operators
# the search already knows, with their labels (every dim shards, no partial sums: isnan(a + b) is not a function
# of isnan(a) and isnan(b) when a = inf, b = -inf).

_FLOATS = ("float16", "float32", "float64")


def _float_only(imp, ctx, x) -> str:
    dt = imp.dtype(x)
    if dt == "bfloat16":
        _unsupported(ctx, "a bfloat16 input")
    if dt not in _FLOATS:
        raise InvalidModel(f"{ctx.what}: input must be a float tensor, got {dt}")
    return dt


def _known_attrs(ctx, known) -> None:
    for key in ctx.attrs:
        if key not in known:
            _unsupported(ctx, f"attribute {key!r}")


@_conv("IsNaN")
def _isnan(imp, ctx, ins):
    _known_attrs(ctx, ())
    x = _in(ctx, ins, 0)
    _float_only(imp, ctx, x)
    r = imp.ref(x, _hint(ctx, 0))
    same = _add(imp, ctx, "Equal", {}, [r, r], _name(ctx, "self_equal"))
    return [_add(imp, ctx, "Not", {}, [same], ctx.name)]


@_conv("IsInf")
def _isinf(imp, ctx, ins):
    _known_attrs(ctx, ("detect_negative", "detect_positive"))
    x = _in(ctx, ins, 0)
    dt = _float_only(imp, ctx, x)
    neg, pos = _flag(ctx, "detect_negative", 1), _flag(ctx, "detect_positive", 1)
    r = imp.ref(x, _hint(ctx, 0))
    if neg and pos:
        r = _add(imp, ctx, "Abs", {}, [r], _name(ctx, "abs"))
    # neither sign: nothing is detected, and x == NaN is False everywhere (still an exact, shaped result)
    target = np.inf if pos else (-np.inf if neg else np.nan)
    c = imp.ref(Const(np.asarray(target, dtype=dt)), _name(ctx, "target"))
    return [_add(imp, ctx, "Equal", {}, [r, c], ctx.name)]


# --- GatherElements ----------------------------------------------------------------------------------

def _axis_indices(imp, ctx, idx, n: int, ax: int):
    """Element indices along axis ``ax`` (size ``n``) of GatherElements/ScatterElements: integers; constant
    ones range-checked and made non-negative (the kernels then need no wrap-around)."""
    if np.dtype(imp.dtype(idx)).kind not in "iu":
        raise InvalidModel(f"{ctx.what}: indices must be integers, got {imp.dtype(idx)}")
    if isinstance(idx, Const):
        iv = np.asarray(idx.value, dtype=np.int64)
        if iv.size and (iv.min() < -n or iv.max() >= n):
            raise InvalidModel(f"{ctx.what}: index out of range for axis {ax} of size {n}")
        idx = Const(np.where(iv < 0, iv + n, iv), origin=None)
    return idx


@_conv("GatherElements")
def _gather_elements(imp, ctx, ins):
    data, idx = _in(ctx, ins, 0), _in(ctx, ins, 1)
    ds, isz = imp.sizes(data), imp.sizes(idx)
    if not ds or len(isz) != len(ds):
        raise InvalidModel(f"{ctx.what}: data {list(ds)} and indices {list(isz)} must have the same rank >= 1")
    ax = _axis(ctx, ctx.i("axis", 0), len(ds))
    idx = _axis_indices(imp, ctx, idx, ds[ax], ax)
    refs = [imp.ref(data, _hint(ctx, 0)), imp.ref(idx, _hint(ctx, 1))]
    return [_add(imp, ctx, "GatherElements", {"axis": ax}, refs, ctx.name)]


# --- GatherND ----------------------------------------------------------------------------------------

@_conv("GatherND")
def _gather_nd(imp, ctx, ins):
    data, idx = _in(ctx, ins, 0), _in(ctx, ins, 1)
    b = ctx.i("batch_dims", 0) if ctx.opset >= 12 else 0
    ds, isz = imp.sizes(data), imp.sizes(idx)
    if np.dtype(imp.dtype(idx)).kind not in "iu":
        raise InvalidModel(f"{ctx.what}: indices must be integers, got {imp.dtype(idx)}")
    if not isz or b < 0 or b >= min(len(ds), len(isz)):
        raise InvalidModel(f"{ctx.what}: attribute 'batch_dims' {b} does not fit data {list(ds)} and "
                           f"indices {list(isz)}")
    k = isz[-1]
    if not 1 <= k <= len(ds) - b:
        raise InvalidModel(f"{ctx.what}: index tuples of length {k} do not fit data {list(ds)}")
    if isinstance(idx, Const):
        iv = np.asarray(idx.value, dtype=np.int64)
        lim = np.asarray(ds[b:b + k], dtype=np.int64)
        if iv.size and (np.any(iv < -lim) or np.any(iv >= lim)):
            raise InvalidModel(f"{ctx.what}: index out of range for data {list(ds)}")
        iv = np.where(iv < 0, iv + lim, iv)
        view = _gather_nd_view(imp, ctx, data, iv) if b == 0 else None
        if view is not None:
            return [_nonempty(imp, ctx, view)]
        idx = Const(iv, origin=None)
    refs = [imp.ref(data, _hint(ctx, 0)), imp.ref(idx, _hint(ctx, 1))]
    return [_add(imp, ctx, "GatherND", {"batch_dims": b}, refs, ctx.name)]


def _gather_nd_view(imp, ctx, data, iv):
    """Constant index tuples that only broadcast the data (index component j runs over all of data dim j
    along one index dim, in order) are a Reshape + Expand: what the dynamo exporter emits for the vmapped
    attention-mask functions of transformers.  The view follows the data's size, so a changed batch (whose
    indices the exporter baked in) stays exact.  None when the indices are anything else."""
    ds = imp.sizes(data)
    rows, k = iv.shape[:-1], iv.shape[-1]
    if not rows:
        return None
    out = list(rows)
    pairs, last = [], -1                         # (data dim, index dim it runs along)
    for j in range(k):
        comp = iv[..., j]
        vary = [p for p in range(len(rows)) if rows[p] > 1 and not np.all(comp == np.take(comp, [0], axis=p))]
        if not vary:                              # one value everywhere: fine only for a size-1 data dim
            if ds[j] != 1 or np.any(comp != 0):
                return None
            continue
        if len(vary) != 1 or vary[0] <= last:
            return None
        p = vary[0]
        line = comp[tuple(slice(None) if t == p else 0 for t in range(len(rows)))]
        n = line.shape[0]
        rebatched = j == 0 and imp.batch_changed and imp.old_batch == n and ds[0] == imp.batch
        if not np.array_equal(line, np.arange(n)) or (n != ds[j] and not rebatched):
            return None
        out[p] = ds[j]
        pairs.append((j, p))
        last = p
    shape = [1] * len(rows)
    for j, p in pairs:
        shape[p] = ds[j]
    target = tuple(shape) + tuple(ds[k:])
    full = tuple(out) + tuple(ds[k:])
    y = imp.ref(data, _hint(ctx, 0))
    if target != tuple(ds):
        y = imp.add("Reshape", {"shape": target}, [y], ctx.name if target == full else _name(ctx, "view"))
    if target != full:
        y = imp.add("Expand", {"shape": full}, [y], ctx.name)
    return y


# --- Tile --------------------------------------------------------------------------------------------

@_conv("Tile")
def _tile(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    if ctx.opset < 6:
        _unsupported(ctx, "opset < 6 (tiles/axis inputs)")
    reps = as_ints(ctx.const_in(ins, 1), ctx.what)
    if len(reps) != len(xs) or any(r < 0 for r in reps):
        raise InvalidModel(f"{ctx.what}: input 'repeats' {reps} must hold one non-negative count per dim "
                           f"of {list(xs)}")
    if all(r == 1 for r in reps):
        return [x]
    if 0 in reps:
        _unsupported(ctx, f"repeats {reps} give an empty tensor")
    return [_add(imp, ctx, "Tile", {"repeats": tuple(reps)}, [x], ctx.name)]


# --- Einsum ------------------------------------------------------------------------------------------

@_conv("Einsum")
def _einsum(imp, ctx, ins):
    vals = [v for v in ins if v is not None]
    if not vals or len(vals) != len(ins):
        raise InvalidModel(f"{ctx.what}: needs at least one input and no omitted ones")
    eq = ctx.s("equation")
    try:
        parse_einsum(eq, [len(imp.sizes(v)) for v in vals])
    except InvalidParallelization as e:
        why = str(e).removeprefix("Einsum: ")
        cls = UnsupportedOperator if "not supported" in why else InvalidModel
        raise cls(f"{ctx.what}: attribute 'equation': {why}") from None
    _same_dtype(imp, ctx, vals)
    return [_add(imp, ctx, "Einsum", {"equation": eq}, _refs(imp, ctx, ins, len(vals)), ctx.name)]


# --- Trilu -------------------------------------------------------------------------------------------

@_conv("Trilu")
def _trilu(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    if len(xs) < 2:
        raise InvalidModel(f"{ctx.what}: needs a rank >= 2 input, got {list(xs)}")
    upper = _flag(ctx, "upper", 1)
    k = 0
    if _in(ctx, ins, 1, required=False) is not None:
        kc = _const(imp, ctx, ins, 1, "k")
        kv = as_ints(kc, ctx.what)
        if len(kv) != 1:
            raise InvalidModel(f"{ctx.what}: input 'k' must be a scalar, got shape {list(kc.shape)}")
        k = kv[0]
    return [_add(imp, ctx, "Trilu", {"upper": upper, "k": int(k)}, [x], ctx.name)]


# --- ScatterND ---------------------------------------------------------------------------------------

@_conv("ScatterND")
def _scatter_nd(imp, ctx, ins):
    data, idx, upd = (_in(ctx, ins, i) for i in range(3))
    red = ctx.s("reduction", "none")
    if red != "none":
        _unsupported(ctx, f"attribute reduction={red!r}; only 'none' is supported")
    if np.dtype(imp.dtype(idx)).kind not in "iu":
        raise InvalidModel(f"{ctx.what}: indices must be integers, got {imp.dtype(idx)}")
    ds, isz = imp.sizes(data), imp.sizes(idx)
    if not isz or not 1 <= isz[-1] <= len(ds):
        raise InvalidModel(f"{ctx.what}: indices {list(isz)} do not fit data {list(ds)}")
    if isinstance(idx, Const):
        k = isz[-1]
        iv = np.asarray(idx.value, dtype=np.int64).reshape(-1, k)
        lim = np.asarray(ds[:k], dtype=np.int64)
        if iv.size and (np.any(iv < -lim) or np.any(iv >= lim)):
            raise InvalidModel(f"{ctx.what}: index out of range for data {list(ds)}")
        idx = derive(idx, lambda v: np.where(v < 0, v + lim, v).astype(np.int64), isz, dtype=np.int64,
                     keep_origin=False)
    refs = [imp.ref(data, _hint(ctx, 0)), imp.ref(idx, _hint(ctx, 1)), imp.ref(upd, _hint(ctx, 2))]
    return [_add(imp, ctx, "ScatterND", {}, refs, ctx.name)]


# --- ScatterElements (the dynamo exporter's select_scatter / index assignment) -----------------------------

@_conv("ScatterElements", "Scatter")
def _scatter_elements(imp, ctx, ins):
    data, idx, upd = (_in(ctx, ins, i) for i in range(3))
    red = ctx.s("reduction", "none")
    if red != "none":
        _unsupported(ctx, f"attribute reduction={red!r}; only 'none' is supported")
    ds, isz = imp.sizes(data), imp.sizes(idx)
    if not ds or len(isz) != len(ds) or imp.sizes(upd) != isz:
        raise InvalidModel(f"{ctx.what}: data {list(ds)}, indices {list(isz)} and updates {list(imp.sizes(upd))} "
                           f"must have one rank >= 1, indices and updates one shape")
    ax = _axis(ctx, ctx.i("axis", 0), len(ds))
    idx = _axis_indices(imp, ctx, idx, ds[ax], ax)
    refs = [imp.ref(data, _hint(ctx, 0)), imp.ref(idx, _hint(ctx, 1)), imp.ref(upd, _hint(ctx, 2))]
    return [_add(imp, ctx, "ScatterElements", {"axis": ax}, refs, ctx.name)]


# --- CumSum ------------------------------------------------------------------------------------------

@_conv("CumSum")
def _cumsum(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    if not xs:
        raise InvalidModel(f"{ctx.what}: running sum of a scalar")
    axc = _const(imp, ctx, ins, 1, "axis")
    av = as_ints(axc, ctx.what)
    if len(av) != 1:
        raise InvalidModel(f"{ctx.what}: input 'axis' must be a scalar, got shape {list(axc.shape)}")
    ax = _axis(ctx, av[0], len(xs))
    attrs = {"axis": ax, "exclusive": _flag(ctx, "exclusive"), "reverse": _flag(ctx, "reverse")}
    return [_add(imp, ctx, "CumSum", attrs, [x], ctx.name)]

