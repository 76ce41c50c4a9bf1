"""ONNX operators -> registry operators (nodes with at least one activation input).

Each converter gets the importer, the node context and the input values (``Const``, a PCG ref, or
None for an omitted optional input) and returns one value per ONNX output (None where an output
is not produced; the importer refuses a graph that reads it).
"""
from __future__ import annotations

from math import prod

import numpy as np

from .consts import SMALL, Const, as_ints, as_scalar, derive
from .errors import InvalidModel, UnsupportedOperator
from .fold import FOLDABLE, fold, fold_any, layout_shape, reduce_axes, reshape_target, slice_params, slice_shape, split_sizes
from .loader import PCG_DTYPES, np_dtype

CONVERTERS: dict = {}


def _conv(*names):
    def deco(fn):
        for n in names:
            CONVERTERS[n] = fn
        return fn
    return deco


def _unsupported(ctx, why: str = ""):
    raise UnsupportedOperator(f"unsupported operator {ctx.op}{' (' + why + ')' if why else ''} "
                              f"(node {ctx.name!r})")


def convert_node(imp, ctx, ins) -> list:
    op = ctx.op
    all_const = all(v is None or isinstance(v, Const) for v in ins)
    if op == "Constant":
        return fold(ctx, ins)
    if op in GENERATORS:      # random: never folded, even on a constant input (a *Like reads only its shape)
        return _generator(imp, ctx, ins)
    if all_const and any(v is not None for v in ins) and not _keep_lookup(imp, ctx, ins):
        return fold_any(ctx, ins)
    if op == "ConstantOfShape":
        _unsupported(ctx, "shape computed from activation values")
    fn = CONVERTERS.get(op)
    if fn is None:
        _unsupported(ctx)
    return fn(imp, ctx, ins)


def _keep_lookup(imp, ctx, ins) -> bool:
    """A Gather of constant indices from a parameter table (a float initializer, e.g. BERT's position
    embedding indexed by its position_ids buffer) or from a big constant stays an Embedding/Gather op."""
    if ctx.op != "Gather" or not isinstance(ins[0], Const):
        return False
    d = ins[0]
    return d.numel > SMALL or (d.dtype.kind == "f" and d.origin in imp.init_names and len(d.shape) >= 1)


# --- helpers ---------------------------------------------------------------------------------------

def _in(ctx, ins, i, required=True):
    v = ins[i] if len(ins) > i else None
    if v is None and required:
        raise InvalidModel(f"{ctx.what}: missing input {i}")
    return v


def _hint(ctx, i) -> str:
    return ctx.node.input[i] if len(ctx.node.input) > i and ctx.node.input[i] else f"{ctx.name}/in{i}"


def _R(imp, ctx, ins, i):
    return imp.ref(_in(ctx, ins, i), _hint(ctx, i))


def _axis(ctx, ax, rank) -> int:
    if not -rank <= ax < rank:
        raise InvalidModel(f"{ctx.what}: axis {ax} out of range for rank {rank}")
    return ax % rank


def _rebatch(imp, target):
    """A literal shape that baked in the exported batch size, rewritten for the new one (or None).  Only a
    fallback: with a fixed exported batch the importer rewrites targets exactly before converting
    (``Importer._rebatch_inputs``), so this applies when that reference is unavailable."""
    if getattr(imp, "old_shapes", None) is not None:
        return None
    if imp.batch_changed and imp.old_batch and target and target[0] > 0 and target[0] % imp.old_batch == 0:
        t = list(target)
        t[0] = target[0] // imp.old_batch * imp.batch
        return t
    return None


def _name(ctx, suffix: str = "") -> str:
    return ctx.name + (f"/{suffix}" if suffix else "")


def _reshape(imp, ctx, x, shape, suffix="reshape"):
    if tuple(shape) == imp.sizes(x):
        return x
    return imp.add("Reshape", {"shape": tuple(int(s) for s in shape)}, [x], _name(ctx, suffix))


def _is_float(imp, v) -> bool:
    return np.dtype(imp.dtype(v)).kind == "f"


# --- element-wise ----------------------------------------------------------------------------------

@_conv("Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Sqrt", "Reciprocal", "Neg")
def _unary(imp, ctx, ins):
    return [imp.add(ctx.op, {}, [_R(imp, ctx, ins, 0)], ctx.name)]


@_conv("Identity")
def _identity(imp, ctx, ins):
    return [_in(ctx, ins, 0)]


@_conv("Dropout")
def _dropout(imp, ctx, ins):
    """Dropout in every form: ``ratio`` attribute (opset < 12) or constant input, constant ``training_mode``
    input (either value: the PCG describes training, where Dropout is active; its numpy reference is the
    identity), a mask output that nothing reads (dropped).  A mask that is read is refused."""
    x = _in(ctx, ins, 0)
    if ctx.opset >= 12:
        r = _in(ctx, ins, 1, required=False)
        if r is not None and not isinstance(r, Const):
            _unsupported(ctx, "a ratio computed from activations")
        ratio = float(as_scalar(r, ctx.what)) if r is not None else 0.5
        t = _in(ctx, ins, 2, required=False)
        if t is not None and not isinstance(t, Const):
            _unsupported(ctx, "a training_mode computed from activations")
    else:
        ratio = ctx.f("ratio", 0.5)
    if not 0.0 <= ratio < 1.0:
        raise InvalidModel(f"{ctx.what}: ratio {ratio} is not in [0, 1)")
    mask = ctx.node.output[1] if ctx.n_outputs > 1 else ""
    if mask and imp.is_read(mask):
        raise UnsupportedOperator(f"Dropout's mask output {mask!r} is read by another node or is a graph output; "
                                  f"only the data output is supported (node {ctx.name!r})")
    return [imp.add("Dropout", {"ratio": ratio}, [imp.ref(x, _hint(ctx, 0))], ctx.name), None]


# --- random generators ------------------------------------------------------------------------------

#: ONNX random generators -> the PCG operator (unity_pcg/ops/random_gen.py); the *Like forms take their input's
#: shape (static in a PCG) and, without a dtype attribute, its type
GENERATORS = {"RandomNormal": "RandomNormal", "RandomNormalLike": "RandomNormal",
              "RandomUniform": "RandomUniform", "RandomUniformLike": "RandomUniform"}
_GEN_DTYPES = {"float32", "float16", "float64"}


def _generator(imp, ctx, ins):
    import zlib
    op = GENERATORS[ctx.op]
    like = ctx.op.endswith("Like")
    if like:
        x = _in(ctx, ins, 0)
        shape = tuple(int(s) for s in imp.sizes(x))
        dt = np_dtype(ctx.i("dtype"), ctx.what).name if ctx.has("dtype") else imp.dtype(x)
    else:
        if ins:
            raise InvalidModel(f"{ctx.what}: takes no inputs, got {len(ins)}")
        shape = tuple(int(s) for s in ctx.ints("shape"))
        dt = np_dtype(ctx.i("dtype", 1), ctx.what).name
        if any(s < 0 for s in shape):
            raise InvalidModel(f"{ctx.what}: attribute 'shape' has a negative size: {list(shape)}")
        if imp.batch_changed and imp.old_batch and shape and shape[0] == imp.old_batch:
            shape = (int(imp.batch),) + shape[1:]     # a batch override: a shape that leads with the batch
    if dt not in _GEN_DTYPES:
        raise UnsupportedOperator(f"{ctx.op} of element type {dt} (node {ctx.name!r}); float16, float32 and "
                                  f"float64 are supported")
    a = {"shape": shape, "dtype": dt,
         "seed": int(ctx.f("seed", 0.0)) & 0x7FFFFFFF if ctx.has("seed") else -1,
         "key": zlib.crc32(ctx.node.output[0].encode())}
    if op == "RandomNormal":
        a.update(mean=ctx.f("mean", 0.0), scale=ctx.f("scale", 1.0))
    else:
        a.update(low=ctx.f("low", 0.0), high=ctx.f("high", 1.0))
    return [imp.add(op, a, [], ctx.name)]


@_conv("Bernoulli")
def _bernoulli(imp, ctx, ins):
    """Bernoulli(p) = Cast(LessOrEqual(U, p)) with U = RandomUniform(0, 1) of p's shape and type: 1 with
    probability p (U is never 0 or 1); no gradient reaches p (a comparison).  Under the check's stand-ins U is
    1/2, which gives Bernoulli's own, 1 where p >= 0.5.  A constant p is refused (random: never folded)."""
    import zlib
    p = _R(imp, ctx, ins, 0)
    pt = imp.dtype(p)
    if pt not in _GEN_DTYPES:
        raise UnsupportedOperator(f"Bernoulli of element type {pt} (node {ctx.name!r}); float16, float32 and "
                                  f"float64 are supported")
    dt = np_dtype(ctx.i("dtype"), ctx.what).name if ctx.has("dtype") else pt
    if dt not in PCG_DTYPES:
        raise UnsupportedOperator(f"Bernoulli with output type {dt} (node {ctx.name!r})")
    a = {"shape": tuple(int(s) for s in imp.sizes(p)), "dtype": pt, "low": 0.0, "high": 1.0,
         "seed": int(ctx.f("seed", 0.0)) & 0x7FFFFFFF if ctx.has("seed") else -1,
         "key": zlib.crc32(ctx.node.output[0].encode())}
    u = imp.add("RandomUniform", a, [], _name(ctx, "uniform"))
    b = imp.add("LessOrEqual", {}, [u, p], _name(ctx, "le"))
    return [b if dt == "bool" else imp.add("Cast", {"to": dt}, [b], ctx.name)]


@_conv("Gelu")
def _gelu(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    approx = ctx.s("approximate", "none")
    if approx == "none":
        return [imp.add("Gelu", {}, [x], ctx.name)]
    if approx != "tanh":
        raise InvalidModel(f"{ctx.what}: unknown value of attribute 'approximate': {approx!r}")
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): one operator (unity_pcg/ops/elementwise.py)
    return [imp.add("GeluTanh", {}, [x], ctx.name)]


def _scalar_const(imp, v, other) -> float | None:
    """The value of a one-element float constant that does not widen ``other``'s rank, else None."""
    if isinstance(v, Const) and v.numel == 1 and len(v.shape) <= len(imp.sizes(other)) \
            and np.dtype(v.dtype).kind == "f" and _is_float(imp, other):
        return float(v.value.reshape(-1)[0])
    return None


@_conv("Add", "Sub", "Mul", "Div", "Pow")
def _binary(imp, ctx, ins):
    a, b = _in(ctx, ins, 0), _in(ctx, ins, 1)
    op = ctx.op
    if op == "Mul":
        for x, c in ((a, b), (b, a)):
            k = _scalar_const(imp, c, x) if not isinstance(x, Const) else None
            if k is not None:
                return [imp.add("Scale", {"factor": k}, [x], ctx.name)]
    if op == "Div" and not isinstance(a, Const):
        k = _scalar_const(imp, b, a)
        if k is not None and k != 0:
            return [imp.add("Scale", {"factor": 1.0 / k}, [a], ctx.name)]
    if op == "Pow" and not isinstance(a, Const):
        k = _scalar_const(imp, b, a)
        if k == 1.0:
            return [a]
        if k == 2.0:
            return [imp.add("Mul", {}, [a, a], ctx.name)]
        if k == 0.5:
            return [imp.add("Sqrt", {}, [a], ctx.name)]
        if k == -1.0:
            return [imp.add("Reciprocal", {}, [a], ctx.name)]
        if isinstance(b, Const) and b.dtype != np.dtype(imp.dtype(a)):
            b = derive(b, lambda v: v.astype(imp.dtype(a)), b.shape, dtype=imp.dtype(a))
    return [imp.add(op, {}, [imp.ref(a, _hint(ctx, 0)), imp.ref(b, _hint(ctx, 1))], ctx.name)]


@_conv("Sum", "Max", "Min", "Mean")
def _variadic(imp, ctx, ins):
    vals = [v for v in ins if v is not None]
    if not vals:
        raise InvalidModel(f"{ctx.what}: no inputs")
    op = {"Sum": "Add", "Mean": "Add"}.get(ctx.op, ctx.op)
    acc = imp.ref(vals[0], _hint(ctx, 0))
    for k, v in enumerate(vals[1:], 1):
        acc = imp.add(op, {}, [acc, imp.ref(v, _hint(ctx, k))],
                      ctx.name if k == len(vals) - 1 and ctx.op != "Mean" else _name(ctx, f"{op.lower()}{k}"))
    if ctx.op == "Mean" and len(vals) > 1:
        acc = imp.add("Scale", {"factor": 1.0 / len(vals)}, [acc], ctx.name)
    return [acc]


@_conv("Clip")
def _clip(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    if ctx.opset < 11:
        lo, hi = ctx.f("min", -np.inf), ctx.f("max", np.inf)
    else:
        lo = float(as_scalar(ctx.const_in(ins, 1), ctx.what)) if _in(ctx, ins, 1, False) is not None else -np.inf
        hi = float(as_scalar(ctx.const_in(ins, 2), ctx.what)) if _in(ctx, ins, 2, False) is not None else np.inf
    if lo == 0.0 and hi == np.inf:
        return [imp.add("Relu", {}, [x], ctx.name)]
    return [imp.add("Clip", {"min": float(lo), "max": float(hi)}, [x], ctx.name)]


@_conv("Cast")
def _cast(imp, ctx, ins):
    x = _in(ctx, ins, 0)
    to = np_dtype(ctx.i("to"), ctx.what).name
    if to == imp.dtype(x):
        return [x]
    if to not in PCG_DTYPES:
        raise InvalidModel(f"{ctx.what}: cast to {to}, which a PCG cannot hold")
    return [imp.add("Cast", {"to": to}, [imp.ref(x, _hint(ctx, 0))], ctx.name)]


# --- shapes of activations are known: Shape/Size fold ---------------------------------------------

@_conv("Shape", "Size")
def _shape(imp, ctx, ins):
    x = _in(ctx, ins, 0)
    return fold(ctx, [_ShapeOnly(imp.sizes(x))])


class _ShapeOnly(Const):
    """Stands for an activation in Shape/Size folding: only its shape is known."""

    def __init__(self, shape):
        super().__init__(fn=lambda: (_ for _ in ()).throw(AssertionError("no value")), shape=shape,
                         dtype=np.float32)


# --- dense -----------------------------------------------------------------------------------------

def _linear(imp, ctx, x, w: Const, bias, hint_w, suffix=""):
    """Linear(x, W[in, out], [b]) where W is a constant."""
    ins = [x, imp.ref(w, hint_w)]
    if bias is not None:
        ins.append(bias)
    return imp.add("Linear", {}, ins, _name(ctx, suffix))


@_conv("MatMul")
def _matmul(imp, ctx, ins):
    a, b = _in(ctx, ins, 0), _in(ctx, ins, 1)
    if isinstance(b, Const) and not isinstance(a, Const):
        if len(b.shape) == 2:
            return [_linear(imp, ctx, a, b, None, _hint(ctx, 1))]
        if len(b.shape) == 1:
            w = derive(b, lambda v: v.reshape(-1, 1), (b.shape[0], 1))
            y = _linear(imp, ctx, a, w, None, _hint(ctx, 1), "linear")
            return [_reshape(imp, ctx, y, imp.sizes(y)[:-1])]
    return [_matmul2(imp, ctx, imp.ref(a, _hint(ctx, 0)), imp.ref(b, _hint(ctx, 1)), ctx.name)]


def _matmul2(imp, ctx, a, b, name):
    sa, sb = imp.sizes(a), imp.sizes(b)
    if not sa or not sb:
        raise InvalidModel(f"{ctx.what}: MatMul of a scalar")
    out_drop = []
    if len(sa) == 1:
        a = _reshape(imp, ctx, a, (1,) + sa, "lhs2d")
        out_drop.append(-2)
    if len(sb) == 1:
        b = _reshape(imp, ctx, b, sb + (1,), "rhs2d")
        out_drop.append(-1)
    sa, sb = imp.sizes(a), imp.sizes(b)
    op = "BatchMatMul" if len(sa) >= 3 and sa[:-2] == sb[:-2] else "MatMul"
    y = imp.add(op, {}, [a, b], name if not out_drop else _name(ctx, "matmul"))
    if out_drop:
        s = list(imp.sizes(y))
        for d in sorted(out_drop):
            s.pop(d if d == -1 else len(s) + d)
        y = imp.add("Reshape", {"shape": tuple(s)}, [y], name)
    return y


@_conv("Gemm")
def _gemm(imp, ctx, ins):
    a, b, c = _in(ctx, ins, 0), _in(ctx, ins, 1), _in(ctx, ins, 2, required=False)
    alpha, beta = ctx.f("alpha", 1.0), ctx.f("beta", 1.0)
    ta, tb = ctx.i("transA", 0), ctx.i("transB", 0)
    sa, sb = imp.sizes(a), imp.sizes(b)
    if len(sa) != 2 or len(sb) != 2:
        raise InvalidModel(f"{ctx.what}: Gemm needs 2-D inputs, got {list(sa)} and {list(sb)}")
    if ta:
        a = fold(_T(ctx), [a])[0] if isinstance(a, Const) else \
            imp.add("Transpose", {"perm": (1, 0)}, [a], _name(ctx, "transA"))
    n = sb[0] if tb else sb[1]
    if isinstance(b, Const) and not isinstance(a, Const):
        w = derive(b, lambda v: v.T, (sb[1], sb[0])) if tb else b
        if alpha != 1.0:
            w = derive(w, lambda v: (v * np.asarray(alpha, v.dtype)), w.shape, keep_origin=True)
        bias, extra = None, None
        if c is not None:
            if isinstance(c, Const) and len(c.shape) <= 2 and prod(c.shape[:-1] or (1,)) == 1 \
                    and (c.shape[-1:] or (1,))[0] in (1, n):
                cs = c.shape
                bias = derive(c, lambda v: (np.broadcast_to(v.reshape(-1), (n,)) * np.asarray(beta, v.dtype)),
                              (n,), keep_origin=(beta == 1.0 and cs[-1:] == (n,)))
            else:
                extra = c
        hint = _hint(ctx, 1)
        if bias is not None:
            bias = imp.ref(bias, _hint(ctx, 2))
        y = _linear(imp, ctx, a, w, bias, hint, "linear" if extra is not None else "")
        if extra is not None:
            y = _add_scaled(imp, ctx, y, extra, beta)
        return [y]
    # both operands computed (or a constant lhs): MatMul, Scale, Add
    bref = imp.ref(b, _hint(ctx, 1))
    if tb:
        bref = imp.add("Transpose", {"perm": (1, 0)}, [bref], _name(ctx, "transB"))
    y = imp.add("MatMul", {}, [imp.ref(a, _hint(ctx, 0)), bref], _name(ctx, "matmul") if c is not None or
                alpha != 1.0 else ctx.name)
    if alpha != 1.0:
        y = imp.add("Scale", {"factor": alpha}, [y], _name(ctx, "alpha") if c is not None else ctx.name)
    if c is not None:
        y = _add_scaled(imp, ctx, y, c, beta)
    return [y]


def _add_scaled(imp, ctx, y, c, beta):
    if beta != 1.0:
        if isinstance(c, Const):
            c = derive(c, lambda v: v * np.asarray(beta, v.dtype), c.shape, keep_origin=False)
        else:
            c = imp.add("Scale", {"factor": beta}, [c], _name(ctx, "beta"))
    return imp.add("Add", {}, [y, imp.ref(c, _hint(ctx, 2))], ctx.name)


class _T:
    """A fake node context for folding a 2-D transpose."""

    def __init__(self, ctx):
        self.op, self.what, self.name, self.opset, self.n_outputs = "Transpose", ctx.what, ctx.name, ctx.opset, 1

    def ints(self, key, default=None):
        return [1, 0]


# --- convolution and pooling -----------------------------------------------------------------------

def _auto_pads(ctx, in_hw, kernel, strides, dilations, pads):
    mode = ctx.s("auto_pad", "NOTSET")
    if mode in ("NOTSET", ""):
        if len(pads) != 2 * len(in_hw) or any(p < 0 for p in pads):
            raise InvalidModel(f"{ctx.what}: bad pads {pads}")
        return pads
    if mode == "VALID":
        return [0] * (2 * len(in_hw))
    if mode not in ("SAME_UPPER", "SAME_LOWER"):
        raise InvalidModel(f"{ctx.what}: unknown auto_pad {mode!r}")
    begin, end = [], []
    for size, k, s, d in zip(in_hw, kernel, strides, dilations):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        lo = total // 2 if mode == "SAME_UPPER" else total - total // 2
        begin.append(lo)
        end.append(total - lo)
    return begin + end


def _spatial(ctx, name, default, n=2):
    v = ctx.ints(name, default)
    if v is None or len(v) != n or any(x < 1 for x in v):
        raise InvalidModel(f"{ctx.what}: bad {name} {v}")
    return v


@_conv("Conv")
def _conv2d(imp, ctx, ins):
    x, w, b = _in(ctx, ins, 0), _in(ctx, ins, 1), _in(ctx, ins, 2, required=False)
    xs, ws = imp.sizes(x), imp.sizes(w)
    if len(xs) == 3 and len(ws) == 3:  # 1-D convolution: run as 2-D with height 1
        return [_conv1d(imp, ctx, x, w, b)]
    if len(xs) != len(ws) or len(xs) < 3:
        raise InvalidModel(f"{ctx.what}: input {list(xs)} and weight {list(ws)} do not fit a convolution")
    if len(xs) != 4:
        _unsupported(ctx, f"{len(xs) - 2}-D convolution; only 1-D and 2-D are supported")
    kernel = list(ws[2:])
    ks = ctx.ints("kernel_shape", None)
    if ks is not None and list(ks) != kernel:
        raise InvalidModel(f"{ctx.what}: kernel_shape {ks} does not match the weight {list(ws)}")
    strides = _spatial(ctx, "strides", [1, 1])
    dil = _spatial(ctx, "dilations", [1, 1])
    pads = _auto_pads(ctx, xs[2:], kernel, strides, dil, ctx.ints("pads", [0, 0, 0, 0]))
    groups = ctx.i("group", 1)
    attrs = {"stride": tuple(strides), "dilation": tuple(dil), "padding": (pads[0], pads[1], pads[2], pads[3]),
             "groups": groups}
    refs = [imp.ref(x, _hint(ctx, 0)), imp.ref(w, _hint(ctx, 1))]
    if b is not None:
        refs.append(imp.ref(b, _hint(ctx, 2)))
    return [imp.add("Conv2d", attrs, refs, ctx.name)]


def _conv1d(imp, ctx, x, w, b):
    xs, ws = imp.sizes(x), imp.sizes(w)
    k = ws[2]
    ks = ctx.ints("kernel_shape", None)
    if ks is not None and list(ks) != [k]:
        raise InvalidModel(f"{ctx.what}: kernel_shape {ks} does not match the weight {list(ws)}")
    (s,), (d,) = _spatial(ctx, "strides", [1], 1), _spatial(ctx, "dilations", [1], 1)
    p = _auto_pads(ctx, xs[2:], [k], [s], [d], ctx.ints("pads", [0, 0]))
    x4 = _reshape(imp, ctx, imp.ref(x, _hint(ctx, 0)), xs[:2] + (1, xs[2]), "as2d")
    if isinstance(w, Const):
        w4 = imp.ref(derive(w, lambda v: v.reshape(ws[0], ws[1], 1, k), (ws[0], ws[1], 1, k)), _hint(ctx, 1))
    else:
        w4 = _reshape(imp, ctx, w, (ws[0], ws[1], 1, k), "w2d")
    refs = [x4, w4] + ([imp.ref(b, _hint(ctx, 2))] if b is not None else [])
    y = imp.add("Conv2d", {"stride": (1, s), "dilation": (1, d), "padding": (0, p[0], 0, p[1]),
                           "groups": ctx.i("group", 1)}, refs, _name(ctx, "conv2d"))
    ys = imp.sizes(y)
    return imp.add("Reshape", {"shape": (ys[0], ys[1], ys[3])}, [y], ctx.name)


@_conv("MaxPool", "AveragePool")
def _pool(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    if len(xs) < 3:
        raise InvalidModel(f"{ctx.what}: needs an (N, C, ...) input, got {list(xs)}")
    if len(xs) != 4:
        _unsupported(ctx, f"{len(xs) - 2}-D pooling; only 2-D is supported")
    kernel = _spatial(ctx, "kernel_shape", None)
    strides = _spatial(ctx, "strides", [1, 1])
    dil = ctx.ints("dilations", [1, 1])
    if list(dil) != [1, 1]:
        _unsupported(ctx, "dilated pooling")
    pads = _auto_pads(ctx, xs[2:], kernel, strides, [1, 1], ctx.ints("pads", [0, 0, 0, 0]))
    ceil = bool(ctx.i("ceil_mode", 0)) if ctx.opset >= 10 else False
    kind = "max" if ctx.op == "MaxPool" else "avg"
    attrs = {"kind": kind, "kernel": tuple(kernel), "stride": tuple(strides), "padding": tuple(pads),
             "ceil_mode": ceil, "count_include_pad": bool(ctx.i("count_include_pad", 0)) if kind == "avg" else False}
    return [imp.add("Pool2d", attrs, [x], ctx.name), None]


@_conv("GlobalAveragePool", "GlobalMaxPool")
def _gpool(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    kind = "avg" if ctx.op == "GlobalAveragePool" else "max"
    if len(xs) == 4:
        return [imp.add("Pool2d", {"kind": kind, "global_pool": True}, [x], ctx.name)]
    if len(xs) < 3:
        raise InvalidModel(f"{ctx.what}: needs an (N, C, ...) input, got {list(xs)}")
    op = "ReduceMean" if kind == "avg" else None
    if op is None:
        _unsupported(ctx, f"{len(xs) - 2}-D global max pooling")
    return [imp.add(op, {"axes": tuple(range(2, len(xs))), "keepdims": True}, [x], ctx.name)]


@_conv("LRN")
def _lrn(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    size = ctx.i("size")
    if size < 1:
        raise InvalidModel(f"{ctx.what}: size {size} < 1")
    return [imp.add("LRN", {"size": size, "alpha": ctx.f("alpha", 1e-4), "beta": ctx.f("beta", 0.75),
                            "bias": ctx.f("bias", 1.0)}, [x], ctx.name)]


# --- normalization and softmax ---------------------------------------------------------------------

@_conv("BatchNormalization")
def _bn(imp, ctx, ins):
    if ctx.i("training_mode", 0):
        _unsupported(ctx, "training_mode=1")
    if ctx.opset < 9 and not ctx.i("spatial", 1):
        _unsupported(ctx, "spatial=0")
    refs = [_R(imp, ctx, ins, i) for i in range(5)]
    y = imp.add("BatchNorm", {"eps": ctx.f("epsilon", 1e-5), "momentum": ctx.f("momentum", 0.9)}, refs, ctx.name)
    return [y] + [None] * (ctx.n_outputs - 1)


@_conv("LayerNormalization")
def _ln(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    ax = _axis(ctx, ctx.i("axis", -1), len(xs))
    norm = xs[ax:]
    refs = [x]
    for i in (1, 2):
        p = _in(ctx, ins, i, required=(i == 1))
        if p is None:
            break
        ps = imp.sizes(p)
        if ps != norm:
            if isinstance(p, Const):
                try:
                    np.broadcast_shapes(ps, norm)
                except ValueError:
                    raise InvalidModel(f"{ctx.what}: input {i} {list(ps)} does not broadcast to {list(norm)}") from None
                p = derive(p, lambda v: np.broadcast_to(v.reshape(v.shape[-len(norm):] if v.ndim > len(norm)
                                                                   else v.shape), norm).copy(), norm,
                           keep_origin=False)
            else:
                p = imp.add("Expand", {"shape": tuple(norm)}, [p], _name(ctx, f"expand{i}"))
        refs.append(imp.ref(p, _hint(ctx, i)))
    y = imp.add("LayerNorm", {"axis": ax, "eps": ctx.f("epsilon", 1e-5)}, refs, ctx.name)
    return [y, None, None]


@_conv("Softmax")
def _softmax(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    r = len(xs)
    if r == 0:
        raise InvalidModel(f"{ctx.what}: softmax of a scalar")
    if ctx.opset >= 13:
        ax = _axis(ctx, ctx.i("axis", -1), r)
        return [imp.add("Softmax", {"axis": ax - r}, [x], ctx.name)]
    # opset < 13: coerce to 2-D [prod(:axis), prod(axis:)] and normalize the second dim
    ax = ctx.i("axis", 1)
    if not -r <= ax < r:
        raise InvalidModel(f"{ctx.what}: axis {ax} out of range for rank {r}")
    ax %= r
    if ax == r - 1:
        return [imp.add("Softmax", {"axis": -1}, [x], ctx.name)]
    flat = imp.add("Reshape", {"shape": (prod(xs[:ax]), prod(xs[ax:]))}, [x], _name(ctx, "to2d"))
    y = imp.add("Softmax", {"axis": -1}, [flat], _name(ctx, "softmax"))
    return [imp.add("Reshape", {"shape": tuple(xs)}, [y], ctx.name)]


# --- lookups ---------------------------------------------------------------------------------------

@_conv("Gather")
def _gather(imp, ctx, ins):
    data, idx = _in(ctx, ins, 0), _in(ctx, ins, 1)
    ds = imp.sizes(data)
    if not ds:
        raise InvalidModel(f"{ctx.what}: gather from a scalar")
    ax = _axis(ctx, ctx.i("axis", 0), len(ds))
    if np.dtype(imp.dtype(idx)).kind not in "iu":
        raise InvalidModel(f"{ctx.what}: indices must be integers, got {imp.dtype(idx)}")
    if isinstance(idx, Const) and idx.numel > SMALL:
        # a large constant index tensor (T5's relative-position buckets at sequence 512: [512, 512]): kept a
        # constant input of the lookup, negative indices made positive when its values are read
        n = ds[ax]
        idx = derive(idx, lambda v: np.where(v < 0, v + n, v).astype(np.int64), idx.shape, np.int64,
                     keep_origin=False)
        idx_ref = imp.ref(idx, _hint(ctx, 1))
    elif isinstance(idx, Const):
        n = ds[ax]
        iv = np.asarray(as_ints(idx, ctx.what), dtype=np.int64).reshape(idx.shape)
        if iv.size and (iv.min() < -n or iv.max() >= n):
            raise InvalidModel(f"{ctx.what}: index out of range for size {n}")
        iv = np.where(iv < 0, iv + n, iv)
        if not isinstance(data, Const):
            # constant indices on an activation: a slice when they are a contiguous range
            flat = iv.reshape(-1)
            if flat.size and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)) and iv.ndim <= 1:
                st = int(flat[0])
                y = imp.add("Slice", {"axes": (ax,), "starts": (st,), "ends": (st + flat.size,), "steps": (1,)},
                            [data], _name(ctx, "slice") if iv.ndim == 0 else ctx.name)
                if iv.ndim == 0:
                    y = _reshape(imp, ctx, y, ds[:ax] + ds[ax + 1:])
                return [y]
        idx = Const(iv, origin=None)
        idx_ref = imp.ref(idx, _hint(ctx, 1))
    else:
        idx_ref = idx
    if isinstance(data, Const) and ax == 0 and len(ds) == 2:
        return [imp.add("Embedding", {}, [idx_ref, imp.ref(data, _hint(ctx, 0))], ctx.name)]
    return [imp.add("Gather", {"axis": ax}, [imp.ref(data, _hint(ctx, 0)), idx_ref], ctx.name)]


# --- shape manipulation ----------------------------------------------------------------------------

@_conv("Reshape")
def _reshape_op(imp, ctx, ins):
    x = _in(ctx, ins, 0)
    xs = imp.sizes(x)
    target = ctx.ints("shape") if ctx.opset < 5 else as_ints(ctx.const_in(ins, 1), ctx.what)
    allowzero = bool(ctx.i("allowzero", 0))
    try:
        shape = reshape_target(xs, target, allowzero, ctx.what)
    except InvalidModel:
        t2 = _rebatch(imp, target)
        if t2 is None:
            raise
        shape = reshape_target(xs, t2, allowzero, ctx.what)
    return [_reshape_named(imp, ctx, imp.ref(x, _hint(ctx, 0)), shape)]


def _reshape_named(imp, ctx, x, shape):
    if tuple(shape) == imp.sizes(x):
        return x
    if any(s == 0 for s in shape):
        raise InvalidModel(f"{ctx.what}: empty tensor of shape {list(shape)}")
    return imp.add("Reshape", {"shape": tuple(int(s) for s in shape)}, [x], ctx.name)


@_conv("Squeeze", "Unsqueeze")
def _squeeze(imp, ctx, ins):
    x = _in(ctx, ins, 0)
    shape = layout_shape(ctx, ins, imp.sizes(x))
    return [_reshape_named(imp, ctx, imp.ref(x, _hint(ctx, 0)), shape)]


@_conv("Flatten")
def _flatten(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    shape = layout_shape(ctx, ins, xs)
    if shape == xs:
        return [x]
    ax = ctx.i("axis", 1)
    return [imp.add("Flatten", {"axis": ax + len(xs) if ax < 0 else ax}, [x], ctx.name)]


@_conv("Transpose")
def _transpose(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    r = len(imp.sizes(x))
    perm = ctx.ints("perm", list(range(r))[::-1])
    if sorted(perm) != list(range(r)):
        raise InvalidModel(f"{ctx.what}: perm {perm} does not fit rank {r}")
    if perm == list(range(r)):
        return [x]
    return [imp.add("Transpose", {"perm": tuple(perm)}, [x], ctx.name)]


@_conv("Concat")
def _concat(imp, ctx, ins):
    vals = [(i, v) for i, v in enumerate(ins) if v is not None]
    if not vals:
        raise InvalidModel(f"{ctx.what}: no inputs")
    r = len(imp.sizes(vals[0][1]))
    ax = _axis(ctx, ctx.i("axis"), r)
    vals = [(i, v) for i, v in vals if len(imp.sizes(v)) != r or imp.sizes(v)[ax] != 0] or vals[:1]
    if len(vals) == 1:
        return [vals[0][1]]
    return [imp.add("Concat", {"axis": ax}, [imp.ref(v, _hint(ctx, i)) for i, v in vals], ctx.name)]


@_conv("Split")
def _split(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    axis, sizes = split_sizes(ctx, ins, imp.sizes(x))
    if len(sizes) != ctx.n_outputs:
        raise InvalidModel(f"{ctx.what}: {len(sizes)} split sizes for {ctx.n_outputs} outputs")
    if len(sizes) == 1:
        return [x]
    if any(s == 0 for s in sizes):
        _unsupported(ctx, "empty split outputs")
    nid = imp.b.add_node("Split", {"axis": axis, "sizes": tuple(sizes)}, [x], ctx.name)
    return [(nid, k) for k in range(len(sizes))]


@_conv("Slice")
def _slice(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    params = slice_params(ctx, ins, xs)
    out = slice_shape(xs, params)
    if any(s == 0 for s in out):
        _unsupported(ctx, f"empty slice of {list(xs)}")
    params = [p for p in params if not (p[3] == 1 and out[p[0]] == xs[p[0]])]
    if not params:
        return [x]
    return [imp.add("Slice", {"axes": tuple(p[0] for p in params), "starts": tuple(p[1] for p in params),
                              "ends": tuple(p[2] for p in params), "steps": tuple(p[3] for p in params)},
                    [x], ctx.name)]


@_conv("Expand")
def _expand(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    xs = imp.sizes(x)
    shape = as_ints(ctx.const_in(ins, 1), ctx.what)
    try:
        out = tuple(np.broadcast_shapes(xs, tuple(shape)))
    except ValueError:
        t2 = _rebatch(imp, shape)
        try:
            if t2 is None:
                raise ValueError
            out = tuple(np.broadcast_shapes(xs, tuple(t2)))
            shape = t2
        except ValueError:
            raise InvalidModel(f"{ctx.what}: cannot expand {list(xs)} to {shape}") from None
    if out == xs:
        return [x]
    if any(s == 0 for s in out):
        _unsupported(ctx, "expand to an empty tensor")
    # the attribute is the broadcast result (one PCG whatever 1s or batch sizes the exporter wrote)
    return [imp.add("Expand", {"shape": tuple(int(s) for s in out)}, [x], ctx.name)]


@_conv("ReduceSum", "ReduceMean")
def _reduce(imp, ctx, ins):
    x = _R(imp, ctx, ins, 0)
    r = len(imp.sizes(x))
    axes = reduce_axes(ctx, ins, r, 13 if ctx.op == "ReduceSum" else 18)
    if axes == ():
        return [x]
    keep = bool(ctx.i("keepdims", 1))
    return [imp.add(ctx.op, {"axes": tuple(axes) if axes is not None else tuple(range(r)), "keepdims": keep},
                    [x], ctx.name)]


# registration of the import-coverage converters (they use this module's helpers)
from . import convert_elementwise, convert_indexing, convert_spatial  # noqa: E402,F401
