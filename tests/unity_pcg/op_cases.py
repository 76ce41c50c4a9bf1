"""Generators of operator test cases, shared by the operator property tests.

A generator draws a valid *logical* configuration of one compute operator (attributes, input
shapes and dtypes, how to fill the inputs); :func:`draw_parallel` then draws a parallelization of
its inputs from the operator's labels (a degree per label, partial sums where the operator is
linear, the copy degrees the labels imply, replicas).

Generators take a :class:`Drawer`, so the same code runs under hypothesis (shrinking, the ``ci``
profile) and under a seeded ``random.Random`` (acceptance-rate checks).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from math import gcd, prod
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization
from unity_pcg.shape import ParallelTensorShape


# --- drawers ----------------------------------------------------------------------------------------

class Drawer:
    def int(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq):
        seq = list(seq)
        return seq[self.int(0, len(seq) - 1)]

    def bool(self, p: float = 0.5) -> bool:
        return self.int(0, 999) < int(p * 1000)

    def subset(self, seq):
        return [x for x in seq if self.bool()]

    def perm(self, n: int) -> list[int]:
        items = list(range(n))
        out = []
        while items:
            out.append(items.pop(self.int(0, len(items) - 1)))
        return out


class HypDrawer(Drawer):
    def __init__(self, data):
        self.data = data

    def int(self, lo, hi):
        return self.data.draw(st.integers(lo, hi))


class RandDrawer(Drawer):
    def __init__(self, seed):
        self.r = random.Random(seed)

    def int(self, lo, hi):
        return self.r.randint(lo, hi)


# --- cases --------------------------------------------------------------------------------------------

@dataclass
class Case:
    op: str
    attrs: dict
    sizes: list                      # logical sizes per input
    dtypes: list                     # dtype per input
    fill: list                       # per input: "normal", "positive", "nonzero", ("index", n), ("signed_index", n)
    note: str = ""

    def shapes(self) -> list[ParallelTensorShape]:
        return [ParallelTensorShape.of(s, dtype=d) for s, d in zip(self.sizes, self.dtypes)]

    def values(self, rng: np.random.Generator) -> list[np.ndarray]:
        out = []
        for sz, dt, f in zip(self.sizes, self.dtypes, self.fill):
            if isinstance(f, tuple):
                kind, n = f
                lo = -n if kind == "signed_index" else 0
                out.append(rng.integers(lo, n, size=sz).astype(dt))
            elif f == "positive":
                out.append(rng.uniform(0.5, 2.0, size=sz).astype(dt))
            elif f == "nonzero":
                out.append((rng.uniform(0.5, 2.0, size=sz) * rng.choice([-1, 1], size=sz)).astype(dt))
            elif f == "int":
                out.append(rng.integers(-5, 6, size=sz).astype(dt))
            else:
                out.append(rng.standard_normal(sz).astype(dt))
        return out


SIZES = (1, 2, 3, 4, 6, 8)


def _shape(d: Drawer, lo=1, hi=4, sizes=SIZES, max_numel=256) -> list[int]:
    r = d.int(lo, hi)
    s = [d.choice(sizes) for _ in range(r)]
    while prod(s) > max_numel:
        s[s.index(max(s))] //= 2
    return s


def _bcast_partner(d: Drawer, out: list[int]) -> list[int]:
    """A shape that broadcasts to ``out`` (shorter rank, some dims 1)."""
    r = d.int(0 if out else 0, len(out))
    tail = out[len(out) - r:]
    return [1 if d.bool(0.3) else s for s in tail]


UNARY = {"Relu": "normal", "Gelu": "normal", "Sigmoid": "normal", "Tanh": "normal", "Erf": "normal",
         "Exp": "normal", "Sqrt": "positive", "Reciprocal": "nonzero", "Neg": "normal", "Identity": "normal",
         "Dropout": "normal"}


def gen_unary(op):
    def g(d: Drawer) -> Case:
        s = _shape(d, 0, 4)
        return Case(op, {}, [s], ["float64"], [UNARY[op]])
    return g


def gen_scale(d):
    return Case("Scale", {"factor": d.choice([0.5, -2.0, 3.0])}, [_shape(d, 0, 4)], ["float64"], ["normal"])


def gen_clip(d):
    kind = d.int(0, 2)
    attrs = [{"min": -0.5, "max": 0.7}, {"min": 0.0}, {}][kind]
    return Case("Clip", attrs, [_shape(d, 0, 4)], ["float64"], ["normal"])


def gen_cast(d):
    src = d.choice(["float64", "float32", "int64", "int32"])
    to = d.choice(["float64", "float32", "int64", "int32"])
    fill = "int" if src.startswith("int") else "normal"
    return Case("Cast", {"to": to}, [_shape(d, 0, 4)], [src], [fill])


BINARY_FILL = {"Add": ("normal", "normal"), "Sub": ("normal", "normal"), "Mul": ("normal", "normal"),
               "Div": ("normal", "nonzero"), "Pow": ("positive", "normal"), "Max": ("normal", "normal"),
               "Min": ("normal", "normal")}


def gen_binary(op):
    def g(d: Drawer) -> Case:
        out = _shape(d, 1, 4)
        a, b = _bcast_partner(d, out), _bcast_partner(d, out)
        if d.bool():
            a = out
        else:
            b = out
        if d.bool():
            a, b = b, a
        if op in ("Add", "Sub", "Mul", "Max", "Min") and d.bool(0.25):   # integer arithmetic is exact
            return Case(op, {}, [a, b], ["int64", "int64"], ["int", "int"])
        return Case(op, {}, [a, b], ["float64", "float64"], list(BINARY_FILL[op]))
    return g


def gen_linear(d):
    x = _shape(d, 1, 3, max_numel=64)
    k, n = d.choice([1, 2, 4, 6]), d.choice([1, 2, 3, 4, 8])
    x[-1] = k
    bias = d.bool()
    act = d.choice(["none"] * 4 + ["relu", "gelu", "sigmoid", "tanh"])
    sizes = [x, [k, n]] + ([[n]] if bias else [])
    return Case("Linear", {"activation": act}, sizes, ["float64"] * len(sizes), ["normal"] * len(sizes))


def gen_matmul(op):
    def g(d: Drawer) -> Case:
        m, k, n = d.choice([1, 2, 4, 6]), d.choice([1, 2, 4, 6]), d.choice([1, 2, 3, 4])
        if op == "BatchMatMul":
            b = _shape(d, 1, 2, max_numel=12)
            bx = by = b
        else:
            b = _shape(d, 0, 2, max_numel=12)
            bx, by = _bcast_partner(d, b), _bcast_partner(d, b)
            if d.bool():
                bx = b
            else:
                by = b
        return Case(op, {}, [bx + [m, k], by + [k, n]], ["float64"] * 2, ["normal"] * 2)
    return g


def gen_conv(d):
    n = d.choice([1, 2, 4])
    g = d.choice([1, 1, 2, 3])
    cig, cog = d.choice([1, 2]), d.choice([1, 2, 4])
    c, co = g * cig, g * cog
    style = d.int(0, 3)
    if style == 0:      # pointwise: spatially partitionable
        kh = kw = 1
        stride, dil, pad = (1, 1), (1, 1), (0, 0, 0, 0)
    elif style == 1:    # non-overlapping windows (patchify, strided 1x1)
        kh, kw = d.choice([1, 2]), d.choice([1, 2])
        stride = (d.choice([kh, 2]), d.choice([kw, 2]))
        dil, pad = (1, 1), (0, 0, 0, 0)
    else:
        kh, kw = d.choice([1, 2, 3]), d.choice([1, 2, 3])
        stride = (d.choice([1, 2]), d.choice([1, 2]))
        dil = (d.choice([1, 2]), d.choice([1, 2]))
        pad = tuple(d.int(0, 1) for _ in range(4))
    h, w = d.choice([2, 4, 6, 8]), d.choice([2, 4, 6, 8])
    h = max(h, (kh - 1) * dil[0] + 1)
    w = max(w, (kw - 1) * dil[1] + 1)
    bias = d.bool(0.4)
    sizes = [[n, c, h, w], [co, cig, kh, kw]] + ([[co]] if bias else [])
    return Case("Conv2d", {"groups": g, "stride": stride, "padding": pad, "dilation": dil}, sizes,
                ["float64"] * len(sizes), ["normal"] * len(sizes))


def gen_pool(d):
    n, c = d.choice([1, 2, 4]), d.choice([1, 2, 3, 4])
    h, w = d.choice([2, 3, 4, 6, 8]), d.choice([2, 3, 4, 6, 8])
    kind = d.choice(["max", "avg"])
    if d.bool(0.2):
        return Case("Pool2d", {"kind": kind, "global_pool": True}, [[n, c, h, w]], ["float64"], ["normal"])
    kh, kw = d.int(1, min(3, h)), d.int(1, min(3, w))
    sh, sw = d.int(1, 3), d.int(1, 3)
    if d.bool(0.4):
        pad = (0, 0, 0, 0)
    else:
        pad = (d.int(0, kh // 2), d.int(0, kw // 2), d.int(0, kh // 2), d.int(0, kw // 2))
    attrs = {"kind": kind, "kernel": (kh, kw), "stride": (sh, sw), "padding": pad,
             "ceil_mode": d.bool(), "count_include_pad": d.bool()}
    return Case("Pool2d", attrs, [[n, c, h, w]], ["float64"], ["normal"])


def gen_lrn(d):
    s = [d.choice([1, 2, 4]), d.choice([1, 2, 3, 4, 6]), d.choice([1, 2, 4]), d.choice([1, 2, 3])]
    return Case("LRN", {"size": d.choice([1, 2, 3, 5]), "alpha": 0.1, "beta": 0.75, "bias": 1.0}, [s],
                ["float64"], ["normal"])


def gen_softmax(d):
    s = _shape(d, 1, 4)
    return Case("Softmax", {"axis": d.int(-len(s), len(s) - 1)}, [s], ["float64"], ["normal"])


def gen_layernorm(d):
    s = _shape(d, 1, 4)
    ax = d.int(-len(s), len(s) - 1)
    k = d.int(0, 2)
    if prod(s[ax % len(s):]) == 1:   # normalizing a single element gives 0 whatever the input: degenerate
        s[-1] = 2
    norm = s[ax % len(s):]
    return Case("LayerNorm", {"axis": ax, "eps": 1e-5}, [s] + [norm] * k, ["float64"] * (1 + k),
                ["normal"] * (1 + k))


def gen_batchnorm(d):
    s = _shape(d, 2, 4)
    c = s[1]
    return Case("BatchNorm", {"eps": 1e-5}, [s] + [[c]] * 4, ["float64"] * 5,
                ["normal", "normal", "normal", "normal", "positive"])


def gen_embedding(d):
    idx = _shape(d, 1, 2, max_numel=32)
    v, e = d.choice([2, 4, 6, 8]), d.choice([1, 2, 3, 4, 6])
    return Case("Embedding", {}, [idx, [v, e]], [d.choice(["int64", "int32"]), "float64"],
                [("index", v), "normal"])


def gen_gather(d):
    data = _shape(d, 1, 3, max_numel=64)
    ax = d.int(-len(data), len(data) - 1)
    idx = _shape(d, 0, 2, max_numel=16)
    n = data[ax % len(data)]
    return Case("Gather", {"axis": ax}, [data, idx], ["float64", "int64"], ["normal", ("signed_index", n)])


def gen_concat(d):
    base = _shape(d, 1, 3, max_numel=64)
    ax = d.int(-len(base), len(base) - 1)
    k = d.int(1, 3)
    sizes = []
    for _ in range(k):
        s = list(base)
        s[ax % len(base)] = d.choice([1, 2, 3, 4])
        sizes.append(s)
    return Case("Concat", {"axis": ax}, sizes, ["float64"] * k, ["normal"] * k)


def gen_split(d):
    s = _shape(d, 1, 3)
    ax = d.int(-len(s), len(s) - 1)
    n = s[ax % len(s)]
    cuts = sorted(set(d.subset(range(1, n))))
    parts = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    return Case("Split", {"axis": ax, "sizes": tuple(parts)}, [s], ["float64"], ["normal"])


def gen_slice(d):
    s = _shape(d, 1, 3)
    axes = d.subset(range(len(s))) or [0]
    starts, ends, steps = [], [], []
    for ax in axes:
        n = s[ax]
        step = d.choice([1, 1, 2, -1])
        if step > 0:
            st_, en = d.int(-n, n - 1), d.choice([n, n + 5, -1, d.int(0, n)])
        else:
            st_, en = d.choice([n - 1, -1, n + 3]), d.choice([-n - 1, 0, -(1 << 40)])
        starts.append(st_)
        ends.append(en)
        steps.append(step)
    axes = [ax - len(s) if d.bool(0.3) else ax for ax in axes]
    attrs = {"axes": tuple(axes), "starts": tuple(starts), "ends": tuple(ends), "steps": tuple(steps)}
    case = Case("Slice", attrs, [s], ["float64"], ["normal"])
    out = ops.infer("Slice", attrs, case.shapes()).outputs[0]
    if 0 in out.sizes:   # empty slices are valid but uninteresting; take the whole dim instead
        return Case("Slice", {"axes": (0,), "starts": (0,), "ends": (s[0],), "steps": (1,)}, [s], ["float64"],
                    ["normal"])
    return case


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def gen_reshape(op="Reshape"):
    def g(d: Drawer) -> Case:
        src = _shape(d, 1, 4)
        if op == "Flatten":
            return Case("Flatten", {"axis": d.int(-len(src), len(src))}, [src], ["float64"], ["normal"])
        # regroup: merge runs of dims and split dims into factors, sprinkle size-1 dims
        dst: list[int] = []
        i = 0
        while i < len(src):
            if d.bool(0.3) and i + 1 < len(src):
                dst.append(src[i] * src[i + 1])
                i += 2
                continue
            f = _factors(src[i])
            if len(f) > 1 and d.bool(0.4):
                cut = d.int(1, len(f) - 1)
                dst += [prod(f[:cut]), prod(f[cut:])]
            else:
                dst.append(src[i])
            i += 1
        if d.bool(0.3):
            dst.insert(d.int(0, len(dst)), 1)
        if d.bool(0.2):
            dst = [prod(src)]
        return Case("Reshape", {"shape": tuple(dst)}, [src], ["float64"], ["normal"])
    return g


def gen_transpose(d):
    s = _shape(d, 1, 4)
    return Case("Transpose", {"perm": tuple(d.perm(len(s)))}, [s], ["float64"], ["normal"])


def gen_expand(d):
    x = _shape(d, 1, 3, sizes=(1, 1, 2, 3, 4), max_numel=32)
    tgt = [d.choice([2, 3]) if s == 1 and d.bool(0.7) else (1 if d.bool(0.2) else s) for s in x]
    lead = [d.choice([1, 2, 3]) for _ in range(d.int(0, 1))]
    return Case("Expand", {"shape": tuple(lead + tgt)}, [x], ["float64"], ["normal"])


def gen_reduce(op):
    def g(d: Drawer) -> Case:
        s = _shape(d, 1, 4)
        axes = d.subset(range(len(s)))
        axes = [a - len(s) if d.bool(0.3) else a for a in axes]
        if axes and d.bool(0.2):   # ONNX allows naming an axis twice (r-1 and -1)
            axes.append(axes[0] - len(s) if axes[0] >= 0 else axes[0] + len(s))
        dt = "int64" if op == "ReduceSum" and d.bool(0.25) else "float64"
        return Case(op, {"axes": tuple(axes), "keepdims": d.bool()}, [s], [dt], ["int" if dt == "int64" else "normal"])
    return g


GENERATORS: dict[str, Callable[[Drawer], Case]] = {
    **{op: gen_unary(op) for op in UNARY},
    "Scale": gen_scale, "Clip": gen_clip, "Cast": gen_cast,
    **{op: gen_binary(op) for op in BINARY_FILL},
    "Linear": gen_linear, "MatMul": gen_matmul("MatMul"), "BatchMatMul": gen_matmul("BatchMatMul"),
    "Conv2d": gen_conv, "Pool2d": gen_pool, "LRN": gen_lrn, "Softmax": gen_softmax, "LayerNorm": gen_layernorm,
    "BatchNorm": gen_batchnorm, "Embedding": gen_embedding, "Gather": gen_gather, "Concat": gen_concat,
    "Split": gen_split, "Slice": gen_slice, "Reshape": gen_reshape(), "Flatten": gen_reshape("Flatten"),
    "Transpose": gen_transpose, "Expand": gen_expand, "ReduceSum": gen_reduce("ReduceSum"),
    "ReduceMean": gen_reduce("ReduceMean"),
}


def _more_generators() -> None:
    """The import-coverage operators' generators live beside this file, one module per family."""
    from . import op_cases_elementwise, op_cases_indexing, op_cases_random, op_cases_spatial
    for m in (op_cases_elementwise, op_cases_indexing, op_cases_spatial, op_cases_random):
        GENERATORS.update(m.GENERATORS)


# --- parallelizations ---------------------------------------------------------------------------------

def _divisors(n: int, cap: int = 4) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0] if n > 0 else [1]


def label_sizes(labels, in_sizes, out_sizes) -> dict[str, list[int]]:
    sizes: dict[str, list[int]] = {}
    for lab, ss in list(zip(labels.inputs, in_sizes)) + list(zip(labels.outputs, out_sizes)):
        for l, n in zip(lab, ss):
            sizes.setdefault(l, []).append(n)
    return sizes


def copy_degrees(labels, deg: dict[str, int], sums: list[int], rep: int) -> list[int]:
    """The copy degree each input needs: the degrees of the task-grid labels it lacks, the other
    inputs' partial sums when the operator is multilinear, times the replicas."""
    n = len(labels.inputs)
    multilinear = labels.linearity != "additive"
    out = []
    for i, lab in enumerate(labels.inputs):
        missing = prod(dg for l, dg in deg.items() if dg > 1 and l not in lab and
                       any(l in li for li in labels.inputs))
        other = prod(sums[k] for k in range(n) if k != i) if multilinear else 1
        out.append(missing * other * rep)
    return out


@dataclass
class Parallel:
    shapes: list[ParallelTensorShape]
    deg: dict = field(default_factory=dict)
    sums: list = field(default_factory=list)
    rep: int = 1


def draw_parallel(d: Drawer, case: Case, violate: bool = False, max_tasks: int = 48) -> Parallel:
    """Draw a parallelization of ``case``'s inputs from its labels.

    ``violate=False`` keeps unshardable labels at degree 1 and puts partial sums only where the
    labels allow them; ``violate=True`` draws degrees for every label and partial sums anywhere
    (refusal tests).  Copy degrees always follow the labels' rule, so only the property under
    test decides acceptance.
    """
    logical = case.shapes()
    spec = ops.get_op(case.op)
    outs = ops.infer(case.op, case.attrs, logical).outputs
    labels = spec.labels(spec.normalize_attrs(case.attrs), tuple(logical), [o.sizes for o in outs])
    sizes = label_sizes(labels, case.sizes, [o.sizes for o in outs])
    in_labels = [l for lab in labels.inputs for l in lab]
    deg: dict[str, int] = {}
    budget = max_tasks
    order = sorted(set(in_labels))
    # visit labels in a drawn order so that no label is always starved by the task budget
    order = [order[i] for i in d.perm(len(order))]
    for l in order:
        if (l in labels.unshardable and not (violate and d.bool(0.6))) or budget < 2:
            deg[l] = 1
            continue
        g = 0
        for n in sizes[l]:
            g = gcd(g, n)
        choices = [k for k in _divisors(g) if k <= budget]
        k = d.choice(choices) if d.bool(0.75) else 1
        deg[l] = k
        budget //= k
    n = len(labels.inputs)
    sums = [1] * n
    lin = labels.linearity
    if lin == "additive":
        if d.bool(0.5) and budget >= 2:
            s = d.choice([2, 3] if budget >= 3 else [2])
            sums = [s] * n
    else:
        flags = tuple(lin) if lin else (False,) * n
        for i in range(n):
            if (flags[i] or (violate and d.bool(0.5))) and budget >= 2 and d.bool(0.5):
                sums[i] = 2
                budget //= 2
    rep = d.choice([1, 2]) if budget >= 2 else 1
    copies = copy_degrees(labels, deg, sums, rep)
    degs = [[deg[l] for l in lab] for lab in labels.inputs]
    if violate and n and d.bool(0.3):
        # inconsistent layouts: one input's copy degree or one dim's degree off
        i = d.int(0, n - 1)
        if d.bool() or not logical[i].rank:
            copies[i] = copies[i] * 2 if d.bool() or copies[i] == 1 else copies[i] // 2
        else:
            j = d.int(0, logical[i].rank - 1)
            choices = [k for k in _divisors(logical[i].sizes[j]) if k != degs[i][j]]
            if choices:
                degs[i][j] = d.choice(choices)
    shapes = []
    for dg, s, sm, cp in zip(degs, logical, sums, copies):
        shapes.append(ParallelTensorShape.of(s.sizes, dg, sm, cp, s.dtype))
    return Parallel(shapes, deg, sums, rep)


def accepts(case: Case, shapes) -> bool:
    try:
        ops.infer(case.op, case.attrs, shapes)
        return True
    except InvalidParallelization:
        return False


_more_generators()
