"""Pattern fusion at import: exporters' decompositions of common layers become one registry operator, so that
the search's rules see the same operators whatever the exporter wrote.

* ``x * 0.5 * (1 + erf(x / sqrt 2))`` (any grouping; ``x * (1/sqrt 2)`` too) -> ``Gelu``;
* ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (``Pow(x, 3)`` or ``x*x*x``) -> ``GeluTanh``;
* ``ReduceMean``/``Sub``/``Pow 2`` (or ``d*d``)/``ReduceMean``/``Add eps``/``Sqrt``/``Div``, then optionally
  ``Mul gamma`` and ``Add beta`` (LayerNorm of opsets before 17) -> ``LayerNorm``;
* ``x * Sigmoid(x)`` -> ``Silu``;
* ``Pow(x, 2)`` (or ``x*x``)/``ReduceMean``/``Add eps``/``Sqrt``, then ``Reciprocal`` + ``Mul x``, ``Div(1, .)`` +
  ``Mul x`` or ``Div(x, .)``, then optionally ``Mul gamma`` (T5's and Llama's RMSNorm, both exporters) -> ``RMSNorm``.
Attention (MatMul, Softmax, MatMul) is left alone: it imports as BatchMatMul + Softmax.

Matching runs on the ONNX graph before the import walk (:func:`find`), and only where every intermediate
value is read by the pattern alone (not by another node, not a graph output).  The walk then defers the
pattern's inner nodes and converts the pattern at its last node (:func:`convert`), where shapes and constant
values are known; if a check fails there (reduction axes that are not the trailing dims, a gamma that would
broadcast x), the deferred nodes are converted one by one as usual, so fusion never changes what imports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import pi, sqrt

import numpy as np

from .consts import Const

SQRT2 = sqrt(2.0)
K_TANH = sqrt(2.0 / pi)


@dataclass
class Fusion:
    """One matched pattern: ``kind`` (Gelu, GeluTanh, LayerNorm, Silu, RMSNorm), the activation it reads (ONNX
    tensor name ``x``), the ONNX node indices it replaces (``nodes``, its last node ``final`` included) and the
    parameters (``eps``, ``axes``, ``gamma``/``beta`` tensor names)."""
    kind: str
    x: str
    final: int
    nodes: list[int]
    params: dict = field(default_factory=dict)


class _Graph:
    def __init__(self, nodes, inits: dict, outputs):
        self.nodes = nodes
        self.inits = inits
        self.outs = set(outputs)
        self.prod: dict[str, int] = {}
        self.cons: dict[str, list[int]] = {}
        for j, n in enumerate(nodes):
            for o in n.output:
                if o:
                    self.prod[o] = j
            for i in set(x for x in n.input if x):
                self.cons.setdefault(i, []).append(j)

    def node(self, name):
        j = self.prod.get(name)
        return (j, self.nodes[j]) if j is not None else (None, None)

    def only_use(self, name):
        """The node index of the one reader of ``name`` (None if several, none, or a graph output)."""
        c = self.cons.get(name, [])
        return c[0] if len(c) == 1 and name not in self.outs else None

    def const(self, name):
        """The value of a constant tensor (initializer, Constant node, through Cast/Identity), else None (also
        for a malformed one: the import walk reports those)."""
        try:
            return self._const(name)
        except Exception:
            return None

    def _const(self, name):
        from onnx import numpy_helper
        for _ in range(4):
            if name in self.inits:
                t = self.inits[name]
                if t.data_location == 1 or np.prod(t.dims) > 1 << 20:
                    return None
                return numpy_helper.to_array(t)
            j, n = self.node(name)
            if n is None:
                return None
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        return numpy_helper.to_array(a.t)
                    if a.name == "value_float":
                        return np.float32(a.f)
                    if a.name == "value_int":
                        return np.int64(a.i)
                return None
            if n.op_type in ("Cast", "Identity") and n.input:
                name = n.input[0]
                continue
            return None
        return None

    def is_const(self, name) -> bool:
        return name in self.inits or self.const(name) is not None

    def scalar(self, name):
        t = self.inits.get(name)
        if t is not None and int(np.prod(t.dims)) != 1:
            return None  # not a scalar: do not decode a weight to find out
        v = self.const(name)
        if v is None or np.size(v) != 1 or np.asarray(v).dtype.kind not in "fiu":
            return None
        return float(np.asarray(v).reshape(-1)[0])

    def op(self, j, *ops):
        return j is not None and self.nodes[j].op_type in ops

    def other(self, j, name):
        """The other input of binary node ``j`` (None unless ``name`` is exactly one of its two inputs)."""
        ins = list(self.nodes[j].input)
        if len(ins) != 2 or ins.count(name) != 1:
            return None
        return ins[1] if ins[0] == name else ins[0]

    def attr(self, j, key, default=None):
        for a in self.nodes[j].attribute:
            if a.name == key:
                from onnx import helper
                return helper.get_attribute_value(a)
        return default


def _near(v, want, rel=1e-4) -> bool:
    return v is not None and abs(v - want) <= rel * abs(want)


def _scaled_by(g: _Graph, j, x_of=None):
    """``(x, k)`` when node ``j`` is ``Mul(x, k)`` / ``Mul(k, x)`` / ``Div(x, 1/k)`` with a scalar constant."""
    n = g.nodes[j]
    if n.op_type == "Mul" and len(n.input) == 2:
        for a, b in ((n.input[0], n.input[1]), (n.input[1], n.input[0])):
            k = g.scalar(b)
            if k is not None and not g.is_const(a) and (x_of is None or a == x_of):
                return a, k
    if n.op_type == "Div" and len(n.input) == 2:
        k = g.scalar(n.input[1])
        if k and not g.is_const(n.input[0]) and (x_of is None or n.input[0] == x_of):
            return n.input[0], 1.0 / k
    return None


def _plus_one(g: _Graph, core: str):
    """The ``Add(core, 1)`` node reading ``core`` alone."""
    a = g.only_use(core)
    if g.op(a, "Add") and _near(g.scalar(g.other(a, core) or ""), 1.0):
        return a
    return None


def _outer(g: _Graph, a: int, x: str):
    """``x * 0.5 * p`` in any grouping, where ``p`` is node ``a``'s output: (final, inner nodes) or None."""
    p = g.nodes[a].output[0]
    m = g.only_use(p)
    if not g.op(m, "Mul"):
        return None
    o = g.other(m, p)
    if o is None:
        return None
    if o == x:  # (x * p) * 0.5
        m2 = g.only_use(g.nodes[m].output[0])
        if m2 is not None and _scaled_by(g, m2, g.nodes[m].output[0]) and \
                _near(_scaled_by(g, m2, g.nodes[m].output[0])[1], 0.5):
            return m2, [m, m2]
        return None
    jo = g.prod.get(o)
    if jo is not None and g.only_use(o) == m and _scaled_by(g, jo, x) and _near(_scaled_by(g, jo, x)[1], 0.5):
        return m, [jo, m]  # (x * 0.5) * p
    if _near(g.scalar(o), 0.5):  # x * (p * 0.5)
        m2 = g.only_use(g.nodes[m].output[0])
        if g.op(m2, "Mul") and g.other(m2, g.nodes[m].output[0]) == x:
            return m2, [m, m2]
    return None


def _scaled_input(g: _Graph, j: int, k: float):
    """(producer node, x) when node ``j``'s first input is ``x * k`` read only by ``j``, else None."""
    u = g.nodes[j].input[0]
    ju = g.prod.get(u)
    if ju is None or g.only_use(u) != j:
        return None
    s = _scaled_by(g, ju)
    if s is None or not _near(s[1], k):
        return None
    return ju, s[0]


def _gelu_erf(g: _Graph, e: int):
    got = _scaled_input(g, e, 1.0 / SQRT2)
    if got is None:
        return None
    ju, x = got
    a = _plus_one(g, g.nodes[e].output[0])
    if a is None:
        return None
    out = _outer(g, a, x)
    if out is None:
        return None
    final, inner = out
    return Fusion("Gelu", x, final, [ju, e, a] + inner)


def _cube(g: _Graph, c: str, x: str):
    """The nodes computing ``x**3`` as ``c`` (Pow(x, 3), or x*x*x in either grouping), or None."""
    j = g.prod.get(c)
    if j is None:
        return None
    n = g.nodes[j]
    if n.op_type == "Pow" and n.input[0] == x and _near(g.scalar(n.input[1]), 3.0):
        return [j]
    if n.op_type == "Mul" and len(n.input) == 2 and x in n.input:
        sq = g.other(j, x)
        js = g.prod.get(sq) if sq is not None else None
        if js is not None and g.only_use(sq) == j and g.op(js, "Mul") and list(g.nodes[js].input) == [x, x]:
            return [js, j]
    return None


def _gelu_tanh(g: _Graph, t: int):
    got = _scaled_input(g, t, K_TANH)
    if got is None:
        return None
    ju, inner = got
    ji = g.prod.get(inner)
    if not g.op(ji, "Add") or g.only_use(inner) != ju or len(g.nodes[ji].input) != 2:
        return None
    for x, m3 in (tuple(g.nodes[ji].input), tuple(g.nodes[ji].input)[::-1]):
        jm = g.prod.get(m3)
        if jm is None or g.only_use(m3) != ji:
            continue
        n = g.nodes[jm]
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        for c, k in ((n.input[0], n.input[1]), (n.input[1], n.input[0])):
            if not _near(g.scalar(k), 0.044715) or g.only_use(c) != jm:
                continue
            cube = _cube(g, c, x)
            if cube is None:
                continue
            a = _plus_one(g, g.nodes[t].output[0])
            if a is None:
                return None
            out = _outer(g, a, x)
            if out is None:
                return None
            final, outer = out
            return Fusion("GeluTanh", x, final, cube + [jm, ji, ju, t, a] + outer)
    return None


def _silu(g: _Graph, s: int):
    x = g.nodes[s].input[0]
    m = g.only_use(g.nodes[s].output[0])
    if g.op(m, "Mul") and g.other(m, g.nodes[s].output[0]) == x:
        return Fusion("Silu", x, m, [s, m])
    return None


def _axes(g: _Graph, j):
    n = g.nodes[j]
    if g.attr(j, "keepdims", 1) != 1:
        return None
    ax = g.attr(j, "axes")
    if ax is None and len(n.input) > 1 and n.input[1]:
        v = g.const(n.input[1])
        ax = None if v is None else [int(a) for a in np.asarray(v).reshape(-1)]
    return tuple(ax) if ax else None


def _layernorm(g: _Graph, r1: int):
    x = g.nodes[r1].input[0]
    axes = _axes(g, r1)
    if axes is None:
        return None
    sub = g.only_use(g.nodes[r1].output[0])
    if not g.op(sub, "Sub") or list(g.nodes[sub].input) != [x, g.nodes[r1].output[0]]:
        return None
    d = g.nodes[sub].output[0]
    users = g.cons.get(d, [])
    if d in g.outs or len(users) != 2:
        return None
    sq = next((j for j in users if (g.op(j, "Pow") and g.nodes[j].input[0] == d and
                                    _near(g.scalar(g.nodes[j].input[1]), 2.0)) or
               (g.op(j, "Mul") and list(g.nodes[j].input) == [d, d])), None)
    div = next((j for j in users if j != sq and g.op(j, "Div") and g.nodes[j].input[0] == d), None)
    if sq is None or div is None:
        return None
    r2 = g.only_use(g.nodes[sq].output[0])
    if not g.op(r2, "ReduceMean") or _axes(g, r2) != axes:
        return None
    ad = g.only_use(g.nodes[r2].output[0])
    if not g.op(ad, "Add"):
        return None
    eps = g.scalar(g.other(ad, g.nodes[r2].output[0]) or "")
    if eps is None or eps < 0:
        return None
    sqrt_ = g.only_use(g.nodes[ad].output[0])
    if not g.op(sqrt_, "Sqrt") or g.only_use(g.nodes[sqrt_].output[0]) != div or \
            g.nodes[div].input[1] != g.nodes[sqrt_].output[0]:
        return None
    nodes = [r1, sub, sq, r2, ad, sqrt_, div]
    params = {"eps": eps, "axes": axes, "gamma": None, "beta": None}
    last = div
    m = g.only_use(g.nodes[div].output[0])
    if g.op(m, "Mul"):
        gamma = g.other(m, g.nodes[div].output[0])
        if gamma is not None and g.is_const(gamma):
            params["gamma"] = gamma
            nodes.append(m)
            last = m
            b = g.only_use(g.nodes[m].output[0])
            if g.op(b, "Add"):
                beta = g.other(b, g.nodes[m].output[0])
                if beta is not None and g.is_const(beta):
                    params["beta"] = beta
                    nodes.append(b)
                    last = b
    return Fusion("LayerNorm", x, last, nodes, params)


def _rmsnorm(g: _Graph, p: int):
    n = g.nodes[p]
    if n.op_type == "Pow" and len(n.input) == 2 and _near(g.scalar(n.input[1]), 2.0):
        x = n.input[0]
    elif n.op_type == "Mul" and len(n.input) == 2 and n.input[0] == n.input[1]:
        x = n.input[0]
    else:
        return None
    if g.is_const(x):
        return None
    r = g.only_use(n.output[0])
    if not g.op(r, "ReduceMean"):
        return None
    axes = _axes(g, r)
    if axes is None:
        return None
    ad = g.only_use(g.nodes[r].output[0])
    if not g.op(ad, "Add"):
        return None
    eps = g.scalar(g.other(ad, g.nodes[r].output[0]) or "")
    if eps is None or eps < 0:
        return None
    sq = g.only_use(g.nodes[ad].output[0])
    if not g.op(sq, "Sqrt"):
        return None
    s_out = g.nodes[sq].output[0]
    nxt = g.only_use(s_out)
    nodes = [p, r, ad, sq]
    if g.op(nxt, "Div") and list(g.nodes[nxt].input) == [x, s_out]:          # x / sqrt(.)
        last = nxt
        nodes.append(nxt)
    else:
        if g.op(nxt, "Reciprocal"):                                           # x * (1 / sqrt(.))
            pass
        elif g.op(nxt, "Div") and g.nodes[nxt].input[1] == s_out and _near(g.scalar(g.nodes[nxt].input[0]), 1.0):
            pass
        else:
            return None
        inv = g.nodes[nxt].output[0]
        m = g.only_use(inv)
        if not g.op(m, "Mul") or g.other(m, inv) != x:
            return None
        nodes += [nxt, m]
        last = m
    params = {"eps": eps, "axes": axes, "gamma": None, "beta": None}
    m2 = g.only_use(g.nodes[last].output[0])
    if g.op(m2, "Mul"):
        gamma = g.other(m2, g.nodes[last].output[0])
        if gamma is not None and g.is_const(gamma):
            params["gamma"] = gamma
            nodes.append(m2)
            last = m2
    return Fusion("RMSNorm", x, last, nodes, params)


_STARTS = {"Erf": _gelu_erf, "Tanh": _gelu_tanh, "Sigmoid": _silu, "ReduceMean": _layernorm, "Pow": _rmsnorm,
           "Mul": _rmsnorm}


def find(nodes, inits: dict, outputs) -> dict[int, Fusion]:
    """Matched patterns keyed by their last node; no node belongs to two patterns, and every value a pattern
    computes inside is read only inside it."""
    g = _Graph(nodes, inits, outputs)
    found: dict[int, Fusion] = {}
    taken: set[int] = set()
    for j, n in enumerate(nodes):
        fn = _STARTS.get(n.op_type)
        if fn is None or n.domain not in ("", "ai.onnx") or j in taken or not n.input:
            continue
        try:
            f = fn(g, j)
        except Exception:  # a malformed node: no fusion here; the import walk reports it in one line
            f = None
        if f is None or taken & set(f.nodes) or len(set(f.nodes)) != len(f.nodes):
            continue
        inner = set(f.nodes)
        closed = all(c in inner for k in inner if k != f.final for o in nodes[k].output if o
                     for c in g.cons.get(o, [])) and \
            not any(o in g.outs for k in inner if k != f.final for o in nodes[k].output)
        if not closed or len(nodes[f.final].output) != 1:
            continue
        found[f.final] = f
        taken |= inner
    return found


def convert(imp, f: Fusion, name: str):
    """The PCG value of the pattern's output, or None when a check needs the shapes and fails (the caller
    then converts the pattern's nodes one by one)."""
    x = imp.vals.get(f.x)
    if x is None or isinstance(x, Const) or np.dtype(imp.dtype(x)).kind != "f":
        return None
    if f.kind not in ("LayerNorm", "RMSNorm"):
        return imp.add(f.kind, {}, [x], name)
    xs = imp.sizes(x)
    r = len(xs)
    try:
        axes = sorted(a % r for a in f.params["axes"] if -r <= a < r)
    except ZeroDivisionError:
        return None
    if len(axes) != len(f.params["axes"]) or not axes or axes != list(range(axes[0], r)):
        return None
    ax = axes[0]
    norm = tuple(xs[ax:])
    refs = [x]
    for key in ("gamma", "beta"):
        pname = f.params[key]
        if pname is None:
            break
        p = imp.vals.get(pname)
        if not isinstance(p, Const) or np.dtype(p.dtype).kind != "f" or \
                (f.kind == "RMSNorm" and np.dtype(p.dtype).name != imp.dtype(x)):
            return None
        try:
            if tuple(np.broadcast_shapes(xs, p.shape)) != tuple(xs) or len(p.shape) > r:
                return None
        except ValueError:
            return None
        if tuple(p.shape) != norm:
            if any(s != 1 for s in p.shape[:max(len(p.shape) - len(norm), 0)]):
                return None  # varies along a dim that is not normalized: not a LayerNorm scale
            from .consts import derive
            tail = p.shape[-len(norm):] if len(p.shape) >= len(norm) else p.shape
            p = derive(p, lambda v, tail=tail: np.broadcast_to(v.reshape(tail), norm).copy(), norm,
                       keep_origin=False)
        refs.append(imp.ref(p, pname))
    if f.params["gamma"] is None and f.params["beta"] is None:
        refs = [x]
    return imp.add(f.kind, {"axis": ax, "eps": float(f.params["eps"])}, refs, name)
