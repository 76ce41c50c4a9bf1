"""Compute operators: logical shape rules, labels (parallel behaviour), numpy kernels, FLOPs."""
from __future__ import annotations

from math import prod
from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidParallelization
from ..shape import DTYPES, ParallelTensorShape, numpy_dtype
from . import kernels as K
from .base import ALL, NOTHING, REQUIRED, Inference, Labels, OpSpec, Saves, Shapes, label_inference, register


def _bad(op: str, msg: str):
    raise InvalidParallelization(f"{op}: {msg}")


def _axis(op: str, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        _bad(op, f"axis {axis} out of range for rank {rank}")
    return axis % rank


def _dims(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_CHECKS = {
    "int": _is_int,
    "ints": lambda v: isinstance(v, (tuple, list)) and all(_is_int(x) for x in v),
    "int|ints": lambda v: _is_int(v) or (isinstance(v, (tuple, list)) and all(_is_int(x) for x in v)),
    "num": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool) or v in (0, 1),
    "str": lambda v: isinstance(v, str),
}
_KIND_NAMES = {"int": "an int", "ints": "a list of ints", "int|ints": "an int or a list of ints",
               "num": "a number", "bool": "a boolean", "str": "a string"}
_WINDOW = {"stride": "int|ints", "padding": "int|ints"}
# attribute types, checked before any shape rule reads them (malformed models give typed errors)
ATTR_KINDS: dict[str, dict[str, str]] = {
    "Scale": {"factor": "num"}, "Clip": {"min": "num", "max": "num"}, "Cast": {"to": "str"},
    "Dropout": {"ratio": "num"}, "Linear": {"activation": "str"},
    "Conv2d": {**_WINDOW, "dilation": "int|ints", "groups": "int"},
    "Pool2d": {**_WINDOW, "kind": "str", "kernel": "int|ints", "global_pool": "bool", "count_include_pad": "bool",
               "ceil_mode": "bool"},
    "LRN": {"size": "int", "alpha": "num", "beta": "num", "bias": "num"},
    "Softmax": {"axis": "int"}, "LayerNorm": {"axis": "int", "eps": "num"},
    "BatchNorm": {"eps": "num", "momentum": "num"}, "Gather": {"axis": "int"}, "Concat": {"axis": "int"},
    "Split": {"axis": "int", "sizes": "ints"},
    "Slice": {"axes": "ints", "starts": "ints", "ends": "ints", "steps": "ints"},
    "Reshape": {"shape": "ints"}, "Transpose": {"perm": "ints"}, "Flatten": {"axis": "int"},
    "Expand": {"shape": "ints"}, "ReduceSum": {"axes": "ints", "keepdims": "bool"},
    "ReduceMean": {"axes": "ints", "keepdims": "bool"},
}


def compute_op(name: str, *, attrs: dict, num_inputs, logical: Callable, labels: Callable,
               forward: Callable, flops: Callable | None = None, piece_attrs: Callable | None = None,
               doc: str = "", cost_class=None, autocast: str | None = None, saves: Saves | None = None,
               nondiff_inputs: tuple[int, ...] = ()) -> OpSpec:
    """Register a compute operator.

    ``logical(attrs, in_shapes) -> [(sizes, dtype), ...]`` checks the logical inputs and gives the
    outputs; ``labels(attrs, in_shapes, out_sizes) -> Labels`` describes the parallel behaviour.
    ``cost_class``, ``autocast``, ``saves``, ``nondiff_inputs``: what the cost and memory models know
    of it (:class:`unity_pcg.ops.base.OpSpec`); every compute operator states the first three.
    """
    defaults = {k: v for k, v in attrs.items() if v is not REQUIRED}
    kinds = ATTR_KINDS.get(name, {})

    def full(a: dict) -> dict:
        """Callers may leave out attributes that have defaults."""
        if all(k in a for k in attrs):
            return a
        for k, v in attrs.items():
            if v is REQUIRED and k not in a:
                _bad(name, f"missing required attribute {k!r}")
        return {**defaults, **a}

    def infer(a: dict, in_shapes: Shapes, strict: bool = True) -> Inference:
        a = full(a)
        for k, kind in kinds.items():
            if not _KIND_CHECKS[kind](a[k]):
                _bad(name, f"attribute {k} must be {_KIND_NAMES[kind]}, got {a[k]!r}")
        outs = logical(a, in_shapes)
        lab = labels(a, in_shapes, [o[0] for o in outs])
        shapes, pm = label_inference(name, lab, in_shapes, [o[0] for o in outs], [o[1] for o in outs],
                                     strict=strict)
        return Inference(shapes, pm)

    fl = flops or (lambda a, i, o: float(sum(s.numel for s in o)))
    return register(OpSpec(name=name, kind="compute", attrs=attrs, infer=infer,
                           forward=lambda a, xs: forward(full(a), xs),
                           flops=lambda a, i, o: fl(full(a), i, o),
                           piece_attrs=(lambda a, i, o: piece_attrs(full(a), i, o)) if piece_attrs else None,
                           num_inputs=num_inputs, doc=doc,
                           labels=lambda a, i, o: labels(full(a), i, o),
                           cost_class=cost_class, autocast=autocast, saves=saves,
                           nondiff_inputs=tuple(nondiff_inputs)))


# --- sources ----------------------------------------------------------------------------------------

def _source(name: str, doc: str, extra: dict | None = None) -> OpSpec:
    def infer(a: dict, in_shapes: Shapes, strict: bool = True) -> Inference:
        if a["dtype"] not in DTYPES:
            _bad(name, f"unknown dtype {a['dtype']!r}")
        if any((not isinstance(s, int)) or s < 0 for s in a["shape"]):
            _bad(name, f"{a['name']!r} has an invalid shape {a['shape']}")
        return Inference((ParallelTensorShape.of(a["shape"], dtype=a["dtype"]),), None)

    def forward(a, xs):
        raise AssertionError(f"{name} nodes are fed by the evaluator")

    return register(OpSpec(name=name, kind="source", attrs={"name": REQUIRED, "shape": REQUIRED,
                                                            "dtype": "float32", **(extra or {})},
                           infer=infer, forward=forward, num_inputs=0, doc=doc, saves=NOTHING))


_source("Input", "A model input (activations or indices).")
_source("Weight", "A parameter of the model; its value comes from the model's weight store.  ``trainable``: False "
                  "on a constant of the model (a mask the exporter folded): no gradient, no optimizer state, no "
                  "synchronization (``PCG.is_trainable``).", {"trainable": True})


# --- element-wise -----------------------------------------------------------------------------------

def _same(a, ins):
    return [(ins[0].sizes, ins[0].dtype)]


def _ident_labels(a, ins, outs):
    lab = _dims("d", ins[0].rank)
    return Labels((lab,), (lab,))


def _unary(name: str, fn: Callable, linear: bool = False, flops_per: float = 1.0, attrs=None, doc="",
           autocast: str = "follow", saves: Saves = Saves({0})):
    def labels(a, ins, outs):
        lab = _dims("d", ins[0].rank)
        return Labels((lab,), (lab,), linearity="additive" if linear else ())
    compute_op(name, attrs=attrs or {}, num_inputs=1, logical=_same, labels=labels,
               forward=lambda a, xs: [fn(a, xs[0])],
               flops=lambda a, i, o: flops_per * o[0].numel, doc=doc,
               cost_class="elementwise", autocast=autocast, saves=saves)


SAVES_OUTPUT = Saves(output=True)      # the gradient is a function of the output (relu, exp, ...)
_unary("Relu", lambda a, x: np.maximum(x, 0).astype(x.dtype, copy=False), saves=SAVES_OUTPUT)
_unary("Gelu", lambda a, x: K.gelu(x), flops_per=8)
_unary("Sigmoid", lambda a, x: K.sigmoid(x), flops_per=4, saves=SAVES_OUTPUT)
_unary("Tanh", lambda a, x: np.tanh(x), flops_per=4, saves=SAVES_OUTPUT)
_unary("Erf", lambda a, x: K.erf(x), flops_per=4)
_unary("Exp", lambda a, x: np.exp(x), flops_per=2, autocast="fp32", saves=SAVES_OUTPUT)
_unary("Sqrt", lambda a, x: np.sqrt(x), flops_per=2, saves=SAVES_OUTPUT)
_unary("Reciprocal", lambda a, x: 1.0 / x, autocast="fp32", saves=SAVES_OUTPUT)
_unary("Neg", lambda a, x: -x, linear=True, saves=NOTHING)
_unary("Identity", lambda a, x: x, linear=True, flops_per=0, saves=NOTHING)
_unary("Dropout", lambda a, x: x, linear=True, attrs={"ratio": 0.5}, saves=Saves(mask=True),
       doc="Identity in the numpy reference (inference semantics); the executor drops in training.")
_unary("Scale", lambda a, x: x * np.asarray(a["factor"], dtype=x.dtype), linear=True, saves=NOTHING,
       attrs={"factor": REQUIRED}, doc="Multiply by a constant scalar.")
def _clip_labels(a, ins, outs):
    lab = _dims("d", ins[0].rank)
    unbounded = a["min"] == -np.inf and a["max"] == np.inf   # the identity, hence linear
    return Labels((lab,), (lab,), linearity="additive" if unbounded else ())


compute_op("Clip", attrs={"min": -np.inf, "max": np.inf}, num_inputs=1, logical=_same, labels=_clip_labels,
           forward=lambda a, xs: [np.clip(xs[0], a["min"], a["max"]).astype(xs[0].dtype, copy=False)],
           flops=lambda a, i, o: float(o[0].numel), cost_class="elementwise", autocast="follow", saves=Saves({0}))


def _cast_logical(a, ins):
    if a["to"] not in DTYPES:
        _bad("Cast", f"unknown dtype {a['to']!r}")
    return [(ins[0].sizes, a["to"])]


def _cast_labels(a, ins, outs):
    # a cast into a float type, or from an int type into an int type, commutes with sums (up to
    # rounding); float -> int truncates and bool saturates, so those are not linear
    src, dst = np.dtype(_np_dtype(ins[0].dtype)).kind, np.dtype(_np_dtype(a["to"])).kind
    linear = (src in "fiu" and dst == "f") or (src in "iu" and dst in "iu")
    lab = _dims("d", ins[0].rank)
    return Labels((lab,), (lab,), linearity="additive" if linear else ())


def _np_dtype(dt: str):
    return np.float32 if dt == "bfloat16" else dt   # numpy has no bfloat16; only the kind matters here


compute_op("Cast", attrs={"to": REQUIRED}, num_inputs=1, logical=_cast_logical, labels=_cast_labels,
           forward=lambda a, xs: [xs[0].astype(numpy_dtype(a["to"]))], flops=lambda a, i, o: 0.0,
           cost_class="elementwise", autocast="declared", saves=NOTHING)


def _broadcast(op: str, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for j in range(rank):
        sizes = {s[len(s) - rank + j] for s in shapes if len(s) - rank + j >= 0}
        big = sizes - {1}
        if len(big) > 1:
            _bad(op, f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(big.pop() if big else 1)
    return tuple(out)


def _broadcast_labels(ins, out_sizes, prefix="d"):
    rank = len(out_sizes)
    lab_in = []
    for i, s in enumerate(ins):
        off = rank - s.rank
        lab_in.append(tuple(f"{prefix}{off + j}" if s.sizes[j] == out_sizes[off + j] else f"b{i}_{j}"
                            for j in range(s.rank)))
    return tuple(lab_in), _dims(prefix, rank)


def _binary(name: str, fn: Callable, linearity, flops_per=1.0, autocast: str = "follow",
            saves: Saves = Saves({0, 1})):
    def logical(a, ins):
        dt = ins[0].dtype
        return [(_broadcast(name, [s.sizes for s in ins]), dt)]

    def labels(a, ins, outs):
        li, lo = _broadcast_labels(ins, outs[0])
        return Labels(li, (lo,), linearity=linearity)
    compute_op(name, attrs={}, num_inputs=2, logical=logical, labels=labels,
               forward=lambda a, xs: [fn(xs[0], xs[1])],
               flops=lambda a, i, o: flops_per * o[0].numel,
               cost_class="elementwise", autocast=autocast, saves=saves)


_binary("Add", np.add, "additive", saves=NOTHING)
_binary("Sub", np.subtract, "additive", saves=NOTHING)
_binary("Mul", np.multiply, (True, True))
_binary("Div", lambda x, y: (x / y).astype(np.result_type(x, y), copy=False), (True, False),
        saves=Saves({0, 1}, output=True))
_binary("Pow", np.power, (), autocast="fp32")
_binary("Max", np.maximum, ())
_binary("Min", np.minimum, ())


# --- dense ------------------------------------------------------------------------------------------

def _linear_logical(a, ins):
    x, w = ins[0], ins[1]
    if w.rank != 2:
        _bad("Linear", f"weight must be 2-D (in_features, out_features), got {list(w.sizes)}")
    if x.rank < 1 or x.sizes[-1] != w.sizes[0]:
        _bad("Linear", f"input {list(x.sizes)} does not match weight {list(w.sizes)}")
    if len(ins) == 3 and ins[2].sizes != (w.sizes[1],):
        _bad("Linear", f"bias {list(ins[2].sizes)} does not match {w.sizes[1]} output features")
    if a["activation"] not in K.ACTIVATIONS:
        _bad("Linear", f"unknown activation {a['activation']!r}")
    return [(x.sizes[:-1] + (w.sizes[1],), x.dtype)]


def _linear_labels(a, ins, outs):
    b = _dims("b", ins[0].rank - 1)
    li = [b + ("k",), ("k", "n")]
    if len(ins) == 3:
        li.append(("n",))
    linear = len(ins) == 2 and a["activation"] == "none"
    lin = (True, True) if linear else ()
    # splitting k gives partial sums of x @ W; a bias (added once per piece) or an activation (not
    # linear) applied to each partial sum would be wrong
    un = frozenset() if linear else frozenset({"k"})
    why = "the bias would be added to every partial sum" if len(ins) == 3 else \
        f"the {a['activation']} activation does not commute with the sum"
    return Labels(tuple(li), (b + ("n",),), un, lin, {"k": f"it is contracted and {why}"})


def _linear_fwd(a, xs):
    y = xs[0] @ xs[1]
    if len(xs) == 3:
        y = y + xs[2]
    return [K.ACTIVATIONS[a["activation"]](y).astype(y.dtype, copy=False)]


compute_op("Linear", attrs={"activation": "none"}, num_inputs=(2, 3), logical=_linear_logical,
           labels=_linear_labels, forward=_linear_fwd,
           flops=lambda a, i, o: 2.0 * i[0].numel * i[1].sizes[1] + (o[0].numel if len(i) == 3 else 0),
           doc="y = act(x @ W + b); W is (in_features, out_features).",
           cost_class="matmul", autocast="low", saves=Saves({0}))


def _matmul_logical(name, batch_equal):
    def logical(a, ins):
        x, y = ins
        if x.rank < 2 or y.rank < 2:
            _bad(name, f"inputs must have rank >= 2, got {list(x.sizes)} and {list(y.sizes)}")
        if x.sizes[-1] != y.sizes[-2]:
            _bad(name, f"contraction sizes differ: {list(x.sizes)} @ {list(y.sizes)}")
        if batch_equal and (x.rank != y.rank or x.sizes[:-2] != y.sizes[:-2] or x.rank < 3):
            _bad(name, f"needs equal batch dims, got {list(x.sizes)} and {list(y.sizes)}")
        batch = _broadcast(name, [x.sizes[:-2], y.sizes[:-2]])
        return [(batch + (x.sizes[-2], y.sizes[-1]), x.dtype)]
    return logical


def _matmul_labels(a, ins, outs):
    batch = outs[0][:-2]
    bx, by = ins[0].sizes[:-2], ins[1].sizes[:-2]
    fake = [ParallelTensorShape.of(bx), ParallelTensorShape.of(by)]
    (lx, ly), lb = _broadcast_labels(fake, batch, prefix="b")
    return Labels((lx + ("m", "k"), ly + ("k", "n")), (lb + ("m", "n"),), linearity=(True, True))


def matmul_class(ins: Shapes | None) -> str:
    """A MatMul of two operands of rank >= 3 runs as a batched matmul (class ``bmm``)."""
    if ins is not None and len(ins) > 1 and ins[0].rank >= 3 and ins[1].rank >= 3:
        return "bmm"
    return "matmul"


for _n, _eq in (("MatMul", False), ("BatchMatMul", True)):
    compute_op(_n, attrs={}, num_inputs=2, logical=_matmul_logical(_n, _eq), labels=_matmul_labels,
               forward=lambda a, xs: [np.matmul(xs[0], xs[1])],
               flops=lambda a, i, o: 2.0 * o[0].numel * i[0].sizes[-1],
               cost_class=matmul_class if _n == "MatMul" else "bmm", autocast="low", saves=Saves({0, 1}))


# --- convolution and pooling -------------------------------------------------------------------------

def _pair(v, n=2):
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,) * n
    return v


def _ints(op: str, name: str, v, n: int, lo: int) -> tuple[int, ...]:
    """An int or a tuple of ``n`` ints, each at least ``lo`` (strides, kernels, paddings...)."""
    t = _pair(v, n)
    if len(t) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x >= lo for x in t):
        _bad(op, f"{name} must be {n} ints >= {lo}, got {v!r}")
    return t


def _conv_logical(a, ins):
    x, w = ins[0], ins[1]
    if x.rank != 4 or w.rank != 4:
        _bad("Conv2d", f"expects NCHW input and OIHW weight, got {list(x.sizes)} and {list(w.sizes)}")
    g = a["groups"]
    n, c, h, wd = x.sizes
    co, cig, kh, kw = w.sizes
    if g < 1 or c % g or co % g or cig * g != c:
        _bad("Conv2d", f"groups={g} does not fit {c} input channels and weight {list(w.sizes)}")
    if len(ins) == 3 and ins[2].sizes != (co,):
        _bad("Conv2d", f"bias {list(ins[2].sizes)} does not match {co} output channels")
    _ints("Conv2d", "stride", a["stride"], 2, 1)
    _ints("Conv2d", "dilation", a["dilation"], 2, 1)
    _ints("Conv2d", "padding", a["padding"], 4, 0)
    (sh, sw), (dh, dw) = _pair(a["stride"]), _pair(a["dilation"])
    t, l, b, r = _pair(a["padding"], 4)
    ho = (h + t + b - (kh - 1) * dh - 1) // sh + 1
    wo = (wd + l + r - (kw - 1) * dw - 1) // sw + 1
    if ho < 1 or wo < 1:
        _bad("Conv2d", f"kernel {kh}x{kw} larger than padded input {h}x{wd}")
    return [((n, co, ho, wo), x.dtype)]


def _window_labels(x: ParallelTensorShape, kernel, stride, dilation, padding, what: str
                   ) -> tuple[tuple[str, str], tuple[str, str], dict]:
    """Spatial labels of a sliding-window operator (input H, W; output H, W) and the reasons for
    the unshardable ones.

    A spatial dim may stay partitioned when windows never cross a piece boundary: no padding on
    that dim, the window span is at most the stride (windows do not overlap), and every piece's
    size is a multiple of the stride (each piece starts a window).  Then output piece i is the
    operator applied to input piece i (e.g. 1x1 convolutions, patchify convolutions, 2x2/2 pooling).
    """
    sp_in, sp_out, reason = [], [], {}
    pads = _pair(padding, 4)
    for j, (name, k, s, dl) in enumerate(zip("hw", kernel, stride, dilation)):
        size, deg = x.sizes[2 + j], x.degrees[2 + j]
        span = (k - 1) * dl + 1
        piece = size // deg
        if pads[j] == 0 and pads[j + 2] == 0 and span <= s and piece % s == 0:
            sp_in.append(name)
            sp_out.append(name)
            continue
        sp_in.append(name + "i")
        sp_out.append(name + "o")
        if pads[j] or pads[j + 2]:
            reason[name + "i"] = f"{what} window reads padding at piece boundaries (no halo exchange)"
        elif span > s:
            reason[name + "i"] = f"{what} windows overlap neighbouring pieces (no halo exchange)"
        else:
            reason[name + "i"] = f"its piece size {piece} is not a multiple of the stride {s}"
    return tuple(sp_in), tuple(sp_out), reason


def _conv_labels(a, ins, outs):
    x, w = ins[0], ins[1]
    g = a["groups"]
    sp_in, sp_out, reason = _window_labels(x, w.sizes[2:], _pair(a["stride"]), _pair(a["dilation"]),
                                           a["padding"], "a convolution")
    un = {"hi", "wi", "kh", "kw", "cg"}
    if g == 1:
        li = [("n", "ci") + sp_in, ("co", "ci", "kh", "kw")]
        lo = ("n", "co") + sp_out
        if len(ins) == 3:
            un.add("ci")
            reason["ci"] = "it is contracted and the bias would be added to every partial sum"
    else:  # grouped: channels split by whole groups
        d = x.degrees[1]
        if g % d:
            _bad("Conv2d", f"input channel degree {d} does not divide groups={g} (pieces must hold whole groups)")
        li = [("n", "c") + sp_in, ("c", "cg", "kh", "kw")]
        lo = ("n", "c") + sp_out
        reason["cg"] = "channels within a group cannot be split"
    if len(ins) == 3:
        li.append((lo[1],))
    lin = (True, True) if len(ins) == 2 else ()
    return Labels(tuple(li), (lo,), frozenset(un), lin, reason)


def _conv_piece_attrs(a, ins, outs):
    g = a["groups"]
    if g > 1:
        d = ins[0].degrees[1]
        if g % d:
            _bad("Conv2d", f"channel degree {d} does not divide groups={g}")
        return {**a, "groups": g // d}
    return a


def conv_class(ins: Shapes | None) -> str:
    """Cost class of a convolution from its input shapes (data, weight, ...): ``conv1x1`` for a 1x1
    kernel (CPU libraries run pointwise convolutions through a much cheaper path than spatial ones),
    ``conv_grouped`` when the weight has fewer input channels than the data (groups > 1: ResNeXt's 3x3),
    else ``conv``."""
    if ins is not None and len(ins) > 1:
        if prod(ins[1].sizes[2:]) == 1:
            return "conv1x1"
        if ins[0].rank >= 2 and ins[1].sizes[1] < ins[0].sizes[1]:
            return "conv_grouped"
    return "conv"


compute_op("Conv2d", attrs={"stride": (1, 1), "padding": (0, 0, 0, 0), "dilation": (1, 1), "groups": 1},
           num_inputs=(2, 3), logical=_conv_logical, labels=_conv_labels,
           forward=lambda a, xs: [K.conv2d(xs[0], xs[1], xs[2] if len(xs) == 3 else None, _pair(a["stride"]),
                                           _pair(a["padding"], 4), _pair(a["dilation"]), a["groups"])],
           flops=lambda a, i, o: 2.0 * o[0].numel * prod(i[1].sizes[1:]) + (o[0].numel if len(i) == 3 else 0),
           piece_attrs=_conv_piece_attrs, cost_class=conv_class, autocast="low", saves=Saves({0}),
           doc="2-D convolution, NCHW, weight OIHW; padding is (top, left, bottom, right).")


def _pool_logical(a, ins):
    x = ins[0]
    if x.rank != 4:
        _bad("Pool2d", f"expects an NCHW input, got {list(x.sizes)}")
    if a["kind"] not in ("max", "avg"):
        _bad("Pool2d", f"kind must be max or avg, got {a['kind']!r}")
    n, c, h, w = x.sizes
    if a["global_pool"]:
        if h * w == 0:
            _bad("Pool2d", f"global pooling of an empty {h}x{w} image")
        return [((n, c, 1, 1), x.dtype)]
    kernel = _ints("Pool2d", "kernel", a["kernel"], 2, 1)
    _ints("Pool2d", "stride", a["stride"], 2, 1)
    pads = _ints("Pool2d", "padding", a["padding"], 4, 0)
    if any(p >= kernel[j % 2] for j, p in enumerate(pads)):
        _bad("Pool2d", f"padding {list(pads)} must be smaller than the kernel {list(kernel)} "
                       f"(a window would hold only padding)")
    (kh, kw), (sh, sw) = _pair(a["kernel"]), _pair(a["stride"])
    t, l, b, r = _pair(a["padding"], 4)
    ho = K.pool_out(h, kh, sh, t, b, a["ceil_mode"])
    wo = K.pool_out(w, kw, sw, l, r, a["ceil_mode"])
    if ho < 1 or wo < 1:
        _bad("Pool2d", f"window {kh}x{kw} larger than padded input {h}x{w}")
    return [((n, c, ho, wo), x.dtype)]


def _pool_labels(a, ins, outs):
    x = ins[0]
    # average pooling is linear; so is max pooling when every window holds one element (a strided pick)
    single = x.sizes[2:] == (1, 1) if a["global_pool"] else _pair(a["kernel"]) == (1, 1)
    lin = "additive" if a["kind"] == "avg" or single else ()
    if a["global_pool"]:
        why = "the global pool reduces over it"
        return Labels((("n", "c", "hi", "wi"),), (("n", "c", "ho", "wo"),), frozenset({"hi", "wi"}), lin,
                      {"hi": why, "wi": why})
    sp_in, sp_out, reason = _window_labels(ins[0], _pair(a["kernel"]), _pair(a["stride"]), (1, 1),
                                           a["padding"], "a pooling")
    return Labels((("n", "c") + sp_in,), (("n", "c") + sp_out,), frozenset({"hi", "wi"}), lin, reason)


def _pool_fwd(a, xs):
    x = xs[0]
    if a["global_pool"]:
        f = np.max if a["kind"] == "max" else np.mean
        return [f(x, axis=(2, 3), keepdims=True).astype(x.dtype, copy=False)]
    return [K.pool2d(x, a["kind"], _pair(a["kernel"]), _pair(a["stride"]), _pair(a["padding"], 4),
                     a["count_include_pad"], a["ceil_mode"])]


compute_op("Pool2d", attrs={"kind": "max", "kernel": (1, 1), "stride": (1, 1), "padding": (0, 0, 0, 0),
                            "global_pool": False, "count_include_pad": False, "ceil_mode": False},
           num_inputs=1, logical=_pool_logical, labels=_pool_labels, forward=_pool_fwd,
           flops=lambda a, i, o: float(i[0].numel if a["global_pool"] else o[0].numel * prod(_pair(a["kernel"]))),
           cost_class="pool", autocast="follow", saves=Saves({0}))


def _lrn_fwd(a, xs):
    x = xs[0]
    size = a["size"]
    sq = np.pad(x * x, ((0, 0), ((size - 1) // 2, size // 2), (0, 0), (0, 0)))
    s = sum(sq[:, i:i + x.shape[1]] for i in range(size))
    return [(x / (a["bias"] + a["alpha"] / size * s) ** a["beta"]).astype(x.dtype, copy=False)]


def _lrn_logical(a, ins):
    if ins[0].rank != 4:
        _bad("LRN", "expects an NCHW input")
    _ints("LRN", "size", a["size"], 1, 1)
    return _same(a, ins)


compute_op("LRN", attrs={"size": REQUIRED, "alpha": 1e-4, "beta": 0.75, "bias": 1.0}, num_inputs=1,
           logical=_lrn_logical,
           labels=lambda a, ins, outs: Labels((("n", "c", "h", "w"),), (("n", "c", "h", "w"),),
                                              frozenset({"c"}) if a["size"] > 1 else frozenset(),
                                              (), {"c": "the normalization window spans neighbouring channels"}),
           forward=_lrn_fwd, flops=lambda a, i, o: float(o[0].numel * (a["size"] + 4)),
           cost_class="norm", autocast="follow", saves=Saves({0}, output=True))


# --- normalization and softmax -----------------------------------------------------------------------

def _softmax_fwd(a, xs):
    x = xs[0]
    ax = a["axis"]
    if x.size == 0:
        return [x.copy()]
    e = np.exp(x - x.max(axis=ax, keepdims=True))
    return [(e / e.sum(axis=ax, keepdims=True)).astype(x.dtype, copy=False)]


def _softmax_labels(a, ins, outs):
    ax = _axis("Softmax", a["axis"], ins[0].rank)
    lab = _dims("d", ins[0].rank)
    return Labels((lab,), (lab,), frozenset({lab[ax]}), (), {lab[ax]: "softmax normalizes along it"})


compute_op("Softmax", attrs={"axis": -1}, num_inputs=1,
           logical=lambda a, ins: (_axis("Softmax", a["axis"], ins[0].rank), _same(a, ins))[1],
           labels=_softmax_labels, forward=_softmax_fwd, flops=lambda a, i, o: 5.0 * o[0].numel,
           cost_class="softmax", autocast="fp32_direct",
           saves=Saves(output=True, temps=1))     # its backward: (g - sum(g * y)) * y


def _ln_logical(a, ins):
    x = ins[0]
    ax = _axis("LayerNorm", a["axis"], x.rank)
    norm = x.sizes[ax:]
    for i, p in enumerate(ins[1:], 1):
        if p.sizes != norm:
            _bad("LayerNorm", f"input {i} has shape {list(p.sizes)}, expected {list(norm)}")
    return [(x.sizes, x.dtype)]


def _ln_labels(a, ins, outs):
    x = ins[0]
    ax = a["axis"] % x.rank
    lab = _dims("d", x.rank)
    norm = lab[ax:]
    # with a scale and no bias the output is linear in the scale (partial sums may pass through it)
    lin = (False, True) if len(ins) == 2 else ()
    return Labels((lab,) + tuple(norm for _ in ins[1:]), (lab,), frozenset(norm), lin,
                  {l: "layer norm normalizes along it" for l in norm})


def _ln_fwd(a, xs):
    x = xs[0]
    axes = tuple(range(a["axis"] % x.ndim, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + a["eps"])
    if len(xs) > 1:
        y = y * xs[1]
    if len(xs) > 2:
        y = y + xs[2]
    return [y.astype(x.dtype, copy=False)]


compute_op("LayerNorm", attrs={"axis": -1, "eps": 1e-5}, num_inputs=(1, 3), logical=_ln_logical,
           labels=_ln_labels, forward=_ln_fwd, flops=lambda a, i, o: 8.0 * o[0].numel,
           cost_class="norm", autocast="fp32", saves=Saves({0}),
           doc="Normalizes over dims axis..end; optional scale and bias of those dims.")


def _bn_logical(a, ins):
    x = ins[0]
    if x.rank < 2:
        _bad("BatchNorm", f"expects (N, C, ...), got {list(x.sizes)}")
    for i, p in enumerate(ins[1:], 1):
        if p.sizes != (x.sizes[1],):
            _bad("BatchNorm", f"input {i} has shape {list(p.sizes)}, expected [{x.sizes[1]}]")
    return [(x.sizes, x.dtype)]


def _bn_fwd(a, xs):
    x, scale, bias, mean, var = xs
    sh = (1, -1) + (1,) * (x.ndim - 2)
    y = (x - mean.reshape(sh)) / np.sqrt(var.reshape(sh) + a["eps"]) * scale.reshape(sh) + bias.reshape(sh)
    return [y.astype(x.dtype, copy=False)]


compute_op("BatchNorm", attrs={"eps": 1e-5, "momentum": 0.9}, num_inputs=5, logical=_bn_logical,
           labels=lambda a, ins, outs: Labels((_dims("d", ins[0].rank),) + (("d1",),) * 4,
                                               (_dims("d", ins[0].rank),)),
           forward=_bn_fwd, flops=lambda a, i, o: 4.0 * o[0].numel,
           cost_class="batchnorm", autocast="follow_first", saves=Saves({0}), nondiff_inputs=(3, 4),
           doc="Inputs x, scale, bias, running mean, running var. The numpy reference uses the running "
               "statistics (ONNX inference semantics). Training uses batch statistics: when the batch or a "
               "spatial dim is partitioned they need all-reduces of per-channel sums (SyncBatchNorm; see "
               "TRAINING_STAT_SYNC), which the executor runs and the cost model prices.")

# operators whose training statistics are sums over partitioned dims (an all-reduce of per-channel
# sums across the tasks that split the batch or spatial dims: SyncBatchNorm semantics)
TRAINING_STAT_SYNC = frozenset({"BatchNorm"})


# --- lookups ------------------------------------------------------------------------------------------

def _emb_logical(a, ins):
    idx, table = ins
    if table.rank != 2:
        _bad("Embedding", f"table must be 2-D (rows, dim), got {list(table.sizes)}")
    if not idx.dtype.startswith("int"):
        _bad("Embedding", f"indices must be integers, got {idx.dtype}")
    return [(idx.sizes + (table.sizes[1],), table.dtype)]


compute_op("Embedding", attrs={}, num_inputs=2, logical=_emb_logical,
           labels=lambda a, ins, outs: Labels((_dims("b", ins[0].rank), ("v", "e")),
                                              (_dims("b", ins[0].rank) + ("e",),), frozenset({"v"}),
                                              (False, True), {"v": "vocabulary-sharded lookup is not supported"}),
           forward=lambda a, xs: [np.take(xs[1], xs[0], axis=0)],
           flops=lambda a, i, o: 0.0, doc="out[..., :] = table[indices[...], :]",
           cost_class="embedding", autocast="follow", saves=Saves({0}))


def _gather_logical(a, ins):
    data, idx = ins
    ax = _axis("Gather", a["axis"], data.rank)
    if not idx.dtype.startswith("int"):
        _bad("Gather", f"indices must be integers, got {idx.dtype}")
    return [(data.sizes[:ax] + idx.sizes + data.sizes[ax + 1:], data.dtype)]


def _gather_labels(a, ins, outs):
    data, idx = ins
    ax = a["axis"] % data.rank
    ld = _dims("d", data.rank)
    li = _dims("i", idx.rank)
    return Labels((ld, li), (ld[:ax] + li + ld[ax + 1:],), frozenset({ld[ax]}), (True, False),
                  {ld[ax]: "gathered along it"})


compute_op("Gather", attrs={"axis": 0}, num_inputs=2, logical=_gather_logical, labels=_gather_labels,
           forward=lambda a, xs: [np.take(xs[0], xs[1], axis=a["axis"])], flops=lambda a, i, o: 0.0,
           cost_class="default", autocast="follow", saves=Saves({1}))


# --- shape manipulation --------------------------------------------------------------------------------

def _concat_logical(a, ins):
    r = ins[0].rank
    ax = _axis("Concat", a["axis"], r)
    for i, s in enumerate(ins):
        if s.rank != r or s.sizes[:ax] + s.sizes[ax + 1:] != ins[0].sizes[:ax] + ins[0].sizes[ax + 1:]:
            _bad("Concat", f"input {i} shape {list(s.sizes)} does not match input 0 {list(ins[0].sizes)}")
    sizes = list(ins[0].sizes)
    sizes[ax] = sum(s.sizes[ax] for s in ins)
    return [(tuple(sizes), ins[0].dtype)]


def _concat_labels(a, ins, outs):
    r = ins[0].rank
    ax = a["axis"] % r
    base = _dims("d", r)
    li = tuple(base[:ax] + (f"c{i}",) + base[ax + 1:] for i in range(len(ins)))
    lo = base[:ax] + ("c",) + base[ax + 1:]
    un = frozenset(f"c{i}" for i in range(len(ins)))
    return Labels(li, (lo,), un, "additive", {l: "concatenation runs along it" for l in un})


compute_op("Concat", attrs={"axis": REQUIRED}, num_inputs=(1, 1 << 16), logical=_concat_logical,
           labels=_concat_labels, forward=lambda a, xs: [np.concatenate(xs, axis=a["axis"])],
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def _split_logical(a, ins):
    x = ins[0]
    ax = _axis("Split", a["axis"], x.rank)
    if not isinstance(a["sizes"], (tuple, list)) or not a["sizes"]:
        _bad("Split", f"sizes must be a non-empty list of ints, got {a['sizes']!r}")
    if sum(a["sizes"]) != x.sizes[ax] or any(s < 1 for s in a["sizes"]):
        _bad("Split", f"sizes {list(a['sizes'])} do not add up to {x.sizes[ax]}")
    out = []
    for s in a["sizes"]:
        sizes = list(x.sizes)
        sizes[ax] = s
        out.append((tuple(sizes), x.dtype))
    return out


def _split_labels(a, ins, outs):
    x = ins[0]
    ax = a["axis"] % x.rank
    base = _dims("d", x.rank)
    lin = base[:ax] + ("s",) + base[ax + 1:]
    lo = tuple(base[:ax] + (f"s{i}",) + base[ax + 1:] for i in range(len(outs)))
    return Labels((lin,), lo, frozenset({"s"}), "additive", {"s": "the split runs along it"})


def _split_fwd(a, xs):
    cuts = np.cumsum(a["sizes"])[:-1]
    return list(np.split(xs[0], cuts, axis=a["axis"]))


compute_op("Split", attrs={"axis": REQUIRED, "sizes": REQUIRED}, num_inputs=1, logical=_split_logical,
           labels=_split_labels, forward=_split_fwd, flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def _slice_logical(a, ins):
    x = ins[0]
    sizes = list(x.sizes)
    if not len(a["axes"]) == len(a["starts"]) == len(a["ends"]) == len(a["steps"]):
        _bad("Slice", f"axes, starts, ends and steps differ in length: {len(a['axes'])}, {len(a['starts'])}, "
                      f"{len(a['ends'])}, {len(a['steps'])}")
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        ax = _axis("Slice", ax, x.rank)
        if sp == 0:
            _bad("Slice", "step 0")
        sizes[ax] = len(range(*slice(st, en, sp).indices(x.sizes[ax])))
    if len({ax % x.rank for ax in a["axes"]}) != len(a["axes"]):
        _bad("Slice", f"axes {list(a['axes'])} name an axis twice")
    return [(tuple(sizes), x.dtype)]


def _slice_labels(a, ins, outs):
    x = ins[0]
    axes = {ax % x.rank for ax in a["axes"]}
    li = tuple(f"s{j}" if j in axes else f"d{j}" for j in range(x.rank))
    lo = tuple(f"t{j}" if j in axes else f"d{j}" for j in range(x.rank))
    return Labels((li,), (lo,), frozenset(f"s{j}" for j in axes), "additive",
                  {f"s{j}": "it is sliced" for j in axes})


def _slice_fwd(a, xs):
    idx = [slice(None)] * xs[0].ndim
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        idx[ax % xs[0].ndim] = slice(st, en, sp)
    return [xs[0][tuple(idx)]]


compute_op("Slice", attrs={"axes": REQUIRED, "starts": REQUIRED, "ends": REQUIRED, "steps": REQUIRED},
           num_inputs=1, logical=_slice_logical, labels=_slice_labels, forward=_slice_fwd,
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of dims with equal products: [(src dims, dst dims), ...]; None if impossible."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if i < len(src) and (pi < pj or (pi == pj and not gi) or j >= len(dst)):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                break
            if pi == pj and gi and gj:
                # absorb trailing size-1 dims into this group
                while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
                    gi.append(i); i += 1
                while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
                    gj.append(j); j += 1
                break
        if pi != pj:
            return None
        groups.append((gi, gj))
    return groups


def _reshape_logical(a, ins):
    x = ins[0]
    shape = tuple(a["shape"])
    if any(s < 0 for s in shape) or prod(shape) != x.numel:
        _bad("Reshape", f"cannot reshape {list(x.sizes)} to {list(shape)}")
    return [(shape, x.dtype)]


def _reshape_labels(a, ins, outs):
    src, dst = ins[0].sizes, outs[0]
    groups = reshape_groups(src, dst) or [(list(range(len(src))), list(range(len(dst))))]
    li = [f"x{j}" for j in range(len(src))]
    lo = [f"y{j}" for j in range(len(dst))]
    un = set()
    for g, (gi, gj) in enumerate(groups):
        # only the outermost non-trivial dim of a group may be partitioned; it maps to the outermost
        # dim of the other side (contiguous blocks stay contiguous)
        gi_nt = [i for i in gi if src[i] != 1] or gi[:1]
        gj_nt = [j for j in gj if dst[j] != 1] or gj[:1]
        if gi_nt and gj_nt:
            li[gi_nt[0]] = lo[gj_nt[0]] = f"g{g}"
        for i in gi:
            if li[i] != f"g{g}":
                un.add(li[i])
    return Labels((tuple(li),), (tuple(lo),), frozenset(un), "additive",
                  {l: "only the outermost dim of a merged or split group can stay partitioned" for l in un})


compute_op("Reshape", attrs={"shape": REQUIRED}, num_inputs=1, logical=_reshape_logical,
           labels=_reshape_labels, forward=lambda a, xs: [xs[0].reshape(a["shape"])],
           piece_attrs=lambda a, ins, outs: {**a, "shape": outs[0].piece_shape},
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def _transpose_logical(a, ins):
    x = ins[0]
    perm = tuple(a["perm"])
    if sorted(perm) != list(range(x.rank)):
        _bad("Transpose", f"perm {list(perm)} is not a permutation of {x.rank} dims")
    return [(tuple(x.sizes[p] for p in perm), x.dtype)]


compute_op("Transpose", attrs={"perm": REQUIRED}, num_inputs=1, logical=_transpose_logical,
           labels=lambda a, ins, outs: Labels((_dims("d", ins[0].rank),),
                                              (tuple(f"d{p}" for p in a["perm"]),), linearity="additive"),
           forward=lambda a, xs: [np.transpose(xs[0], a["perm"])], flops=lambda a, i, o: 0.0,
           cost_class="default", autocast="follow", saves=NOTHING)


def _flatten_shape(axis: int, sizes: Sequence[int]) -> tuple[int, int]:
    ax = axis if axis >= 0 else axis + len(sizes)
    if not 0 <= ax <= len(sizes):
        _bad("Flatten", f"axis {axis} out of range for rank {len(sizes)}")
    return (prod(sizes[:ax]), prod(sizes[ax:]))


def _flatten_logical(a, ins):
    x = ins[0]
    return [(_flatten_shape(a["axis"], x.sizes), x.dtype)]


compute_op("Flatten", attrs={"axis": 1}, num_inputs=1, logical=_flatten_logical,
           labels=lambda a, ins, outs: _reshape_labels(a, ins, outs),
           forward=lambda a, xs: [xs[0].reshape(a.get("_piece_shape") or _flatten_shape(a["axis"], xs[0].shape))],
           piece_attrs=lambda a, ins, outs: {**a, "_piece_shape": outs[0].piece_shape},
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def _expand_logical(a, ins):
    x = ins[0]
    if any(s < 0 for s in a["shape"]):
        _bad("Expand", f"shape {list(a['shape'])} has a negative size")
    out = _broadcast("Expand", [x.sizes, tuple(a["shape"])])
    return [(out, x.dtype)]


def _expand_labels(a, ins, outs):
    (li,), lo = _broadcast_labels(ins, outs[0])
    return Labels((li,), (lo,), linearity="additive")


compute_op("Expand", attrs={"shape": REQUIRED}, num_inputs=1, logical=_expand_logical, labels=_expand_labels,
           forward=lambda a, xs: [np.broadcast_to(xs[0], a.get("_piece_shape") or
                                                  np.broadcast_shapes(xs[0].shape, tuple(a["shape"]))).copy()],
           piece_attrs=lambda a, ins, outs: {**a, "_piece_shape": outs[0].piece_shape},
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=NOTHING)


def _reduce_logical(name):
    def logical(a, ins):
        x = ins[0]
        axes = {_axis(name, ax, x.rank) for ax in a["axes"]} if a["axes"] else set(range(x.rank))
        sizes = tuple((1 if j in axes else s) for j, s in enumerate(x.sizes) if a["keepdims"] or j not in axes)
        return [(sizes, x.dtype)]
    return logical


def _reduce_labels(name):
    def labels(a, ins, outs):
        x = ins[0]
        axes = {ax % x.rank for ax in a["axes"]} if a["axes"] else set(range(x.rank))
        li = tuple(f"r{j}" if j in axes else f"d{j}" for j in range(x.rank))
        lo = tuple(f"k{j}" if j in axes else f"d{j}" for j in range(x.rank) if a["keepdims"] or j not in axes)
        un = frozenset(f"r{j}" for j in axes) if name == "ReduceMean" else frozenset()
        return Labels((li,), (lo,), un, "additive", {l: "a mean over pieces is not their sum" for l in un})
    return labels


def _reduce_axes(a, ndim: int):
    """Axes as numpy wants them: normalized and without duplicates (ONNX allows -1 and r-1 both)."""
    return tuple(sorted({ax % ndim for ax in a["axes"]})) if a["axes"] else None


for _n, _f in (("ReduceSum", np.sum), ("ReduceMean", np.mean)):
    compute_op(_n, attrs={"axes": (), "keepdims": True}, num_inputs=1, logical=_reduce_logical(_n),
               labels=_reduce_labels(_n),
               forward=(lambda f: lambda a, xs: [np.asarray(f(xs[0], axis=_reduce_axes(a, xs[0].ndim),
                                                             keepdims=bool(a["keepdims"]))).astype(xs[0].dtype)])(_f),
               flops=lambda a, i, o: float(i[0].numel),
               cost_class="reduce", autocast="fp32_direct" if _n == "ReduceSum" else "follow", saves=NOTHING,
               doc="Empty axes reduce over all dims. ReduceSum over a partitioned axis gives partial sums.")
