"""Indexing, comparison and masking operators added for ONNX import coverage (issue 10): Where and the
comparisons on activations, GatherElements, GatherND, Tile, Einsum, Trilu, ScatterND, ScatterElements, CumSum.

Each is a compute operator in the one registry (DESIGN "Operator spec"): logical shape rule, labels,
numpy reference, FLOPs.  How they parallelize, in labels:

* Where, the comparisons (Equal, Less, Greater, LessOrEqual, GreaterOrEqual) and the boolean ops (Not,
  And, Or, Xor) are element-wise with ONNX broadcasting: every dim of the output is shardable, a
  broadcast (size-1) dim gets its own label.  None of them commutes with partial sums (a comparison of a
  sum is not a sum of comparisons; Where(c, x, y) with only x partial would add y once per piece).
* GatherElements gathers along ``axis``: the data's axis is unshardable (an index may point anywhere),
  the indices' axis is a task axis (each task looks up its block of indices in the whole data axis);
  the other dims are shared when data and indices have the same size there.  Linear in the data.
* GatherND: the data dims the index tuples address are unshardable, the index rows are task axes (each
  task looks up its block of tuples), batch dims and trailing slice dims are shared; linear in the data.
* Tile: tiled dims are unshardable (a block of the output is not the tile of a block of the input),
  the others shared; linear.
* Einsum: the equation *is* the label model.  Every subscript is a label, a subscript missing from the
  output is contracted (sharding it gives partial sums, valid since einsum sums over it), and einsum is
  multilinear in each operand.  Ellipsis dims broadcast like element-wise ops.
* Trilu: the triangle depends on the global row and column, so the last two dims are unshardable; the
  batch dims are free; linear (masking with zeros).
* ScatterND: the dims the index tuples address and the update rows are unshardable (an update may land
  anywhere); the trailing slice dims the updates share with the data are shardable.
* ScatterElements: the scatter axis is unshardable in data and updates; the other dims are shared where
  data and indices have the same size.
* CumSum: the scanned axis is unshardable, the others free; linear.
"""
from __future__ import annotations

import re
from math import prod

import numpy as np

from .base import ALL, NOTHING, REQUIRED, Labels, Saves
from .compute import ATTR_KINDS, _axis, _bad, _broadcast, _broadcast_labels, _dims, compute_op

ATTR_KINDS.update({
    "GatherElements": {"axis": "int"}, "GatherND": {"batch_dims": "int"}, "Tile": {"repeats": "ints"}, "Einsum": {"equation": "str"},
    "Trilu": {"upper": "bool", "k": "int"}, "ScatterND": {"reduction": "str"},
    "ScatterElements": {"axis": "int", "reduction": "str"},
    "CumSum": {"axis": "int", "exclusive": "bool", "reverse": "bool"},
})


def _is_int_dtype(dt: str) -> bool:
    return dt.startswith("int")


def _numeric(op: str, dt: str, what: str = "inputs") -> None:
    if dt == "bool":
        _bad(op, f"{what} must be numbers, got bool")


# --- Where ------------------------------------------------------------------------------------------

def _where_logical(a, ins):
    c, x, y = ins
    if c.dtype != "bool":
        _bad("Where", f"the condition must be bool, got {c.dtype}")
    if x.dtype != y.dtype:
        _bad("Where", f"inputs 1 and 2 differ in dtype: {x.dtype} and {y.dtype}")
    return [(_broadcast("Where", [c.sizes, x.sizes, y.sizes]), x.dtype)]


def _elementwise_labels(a, ins, outs):
    li, lo = _broadcast_labels(ins, outs[0])
    return Labels(li, (lo,))


compute_op("Where", attrs={}, num_inputs=3, logical=_where_logical, labels=_elementwise_labels,
           forward=lambda a, xs: [np.where(xs[0], xs[1], xs[2]).astype(xs[1].dtype, copy=False)],
           flops=lambda a, i, o: float(o[0].numel), cost_class="elementwise", autocast="follow", saves=Saves({0}),
           doc="out = x where cond else y, ONNX broadcasting of all three; cond is bool (attention masks).")


# --- comparisons and boolean logic ---------------------------------------------------------------------

COMPARISONS = {"Equal": np.equal, "Less": np.less, "Greater": np.greater, "LessOrEqual": np.less_equal,
               "GreaterOrEqual": np.greater_equal}
LOGIC = {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}


def _compare_logical(name):
    def logical(a, ins):
        x, y = ins
        if x.dtype != y.dtype:
            _bad(name, f"inputs differ in dtype: {x.dtype} and {y.dtype}")
        if name != "Equal":
            _numeric(name, x.dtype)
        return [(_broadcast(name, [x.sizes, y.sizes]), "bool")]
    return logical


def _logic_logical(name):
    def logical(a, ins):
        for i, s in enumerate(ins):
            if s.dtype != "bool":
                _bad(name, f"input {i} must be bool, got {s.dtype}")
        return [(_broadcast(name, [s.sizes for s in ins]), "bool")]
    return logical


for _n, _f in COMPARISONS.items():
    compute_op(_n, attrs={}, num_inputs=2, logical=_compare_logical(_n), labels=_elementwise_labels,
               forward=(lambda f: lambda a, xs: [np.asarray(f(xs[0], xs[1]), dtype=bool)])(_f),
               flops=lambda a, i, o: float(o[0].numel), doc="Element-wise comparison with broadcasting; bool output.",
               cost_class="elementwise", autocast="follow", saves=NOTHING)
for _n, _f in LOGIC.items():
    compute_op(_n, attrs={}, num_inputs=2, logical=_logic_logical(_n), labels=_elementwise_labels,
               forward=(lambda f: lambda a, xs: [np.asarray(f(xs[0], xs[1]), dtype=bool)])(_f),
               flops=lambda a, i, o: float(o[0].numel), doc="Element-wise boolean logic with broadcasting.",
               cost_class="elementwise", autocast="follow", saves=NOTHING)
compute_op("Not", attrs={}, num_inputs=1, logical=_logic_logical("Not"),
           labels=lambda a, ins, outs: Labels((_dims("d", ins[0].rank),), (_dims("d", ins[0].rank),)),
           forward=lambda a, xs: [np.asarray(np.logical_not(xs[0]), dtype=bool)],
           flops=lambda a, i, o: float(o[0].numel),
           cost_class="elementwise", autocast="follow", saves=NOTHING)


# --- GatherElements ------------------------------------------------------------------------------------

def _gather_elements_logical(a, ins):
    data, idx = ins
    if not _is_int_dtype(idx.dtype):
        _bad("GatherElements", f"indices must be integers, got {idx.dtype}")
    if data.rank < 1 or idx.rank != data.rank:
        _bad("GatherElements", f"data {list(data.sizes)} and indices {list(idx.sizes)} must have the same rank >= 1")
    ax = _axis("GatherElements", a["axis"], data.rank)
    for j in range(data.rank):
        if j != ax and idx.sizes[j] > data.sizes[j]:
            _bad("GatherElements", f"indices {list(idx.sizes)} exceed data {list(data.sizes)} in dim {j}")
    if data.sizes[ax] == 0 and idx.numel:
        _bad("GatherElements", f"gathers from an empty axis {ax} of data {list(data.sizes)}")
    return [(idx.sizes, data.dtype)]


def _gather_elements_labels(a, ins, outs):
    data, idx = ins
    ax = a["axis"] % data.rank
    ld, li, un, why = [], [], set(), {}
    for j in range(data.rank):
        if j == ax:
            ld.append("a"), li.append(f"i{j}")
            un.add("a")
            why["a"] = "the elements are gathered along it (an index may point into any piece)"
        elif idx.sizes[j] == data.sizes[j]:
            ld.append(f"d{j}"), li.append(f"d{j}")
        else:
            ld.append(f"x{j}"), li.append(f"i{j}")
            un |= {f"x{j}", f"i{j}"}
            why[f"x{j}"] = why[f"i{j}"] = "the indices cover only part of the data along it"
    return Labels((tuple(ld), tuple(li)), (tuple(li),), frozenset(un), (True, False), why)


def _gather_elements_fwd(a, xs):
    data, idx = xs
    ax = a["axis"] % data.ndim
    n = data.shape[ax]
    idx = idx.astype(np.int64)
    if n:
        idx = idx % n      # ONNX allows negative indices; out-of-range ones are a data error (they wrap here)
    data = data[tuple(slice(None) if j == ax else slice(0, idx.shape[j]) for j in range(data.ndim))]
    return [np.take_along_axis(data, idx, axis=ax)]


compute_op("GatherElements", attrs={"axis": 0}, num_inputs=2, logical=_gather_elements_logical,
           labels=_gather_elements_labels, forward=_gather_elements_fwd, flops=lambda a, i, o: 0.0,
           cost_class="default", autocast="follow", saves=Saves({1}),
           doc="out[i][j][k] = data[idx[i][j][k]][j][k] (axis 0); the output has the indices' shape.")


# --- GatherND -----------------------------------------------------------------------------------------

def _gather_nd_logical(a, ins):
    data, idx = ins
    b = a["batch_dims"]
    if not _is_int_dtype(idx.dtype):
        _bad("GatherND", f"indices must be integers, got {idx.dtype}")
    if idx.rank < 1 or b < 0 or b >= min(data.rank, idx.rank):
        _bad("GatherND", f"batch_dims {b} does not fit data {list(data.sizes)} and indices {list(idx.sizes)}")
    k = idx.sizes[-1]
    if not 1 <= k <= data.rank - b:
        _bad("GatherND", f"index tuples of length {k} do not fit data {list(data.sizes)} after {b} batch dims")
    if data.sizes[:b] != idx.sizes[:b]:
        _bad("GatherND", f"the {b} batch dims of data {list(data.sizes)} and indices {list(idx.sizes)} differ")
    if 0 in data.sizes[b:b + k] and idx.numel:
        _bad("GatherND", f"gathers from an empty dim of data {list(data.sizes)}")
    return [(idx.sizes[:-1] + data.sizes[b + k:], data.dtype)]


def _gather_nd_labels(a, ins, outs):
    data, idx = ins
    b, k, q = a["batch_dims"], idx.sizes[-1], idx.rank
    batch = tuple(f"B{j}" for j in range(b))
    addr = tuple(f"a{j}" for j in range(b, b + k))
    tail = tuple(f"s{j}" for j in range(b + k, data.rank))
    rows = tuple(f"r{j}" for j in range(b, q - 1))
    un = frozenset(addr + ("q",))
    why = {**{l: "the index tuples address it (an index may point into any piece)" for l in addr},
           "q": "it holds the index tuples"}
    return Labels((batch + addr + tail, batch + rows + ("q",)), (batch + rows + tail,), un, (True, False), why)


def _gather_nd_fwd(a, xs):
    data, idx = xs
    b, k = a["batch_dims"], idx.shape[-1]
    idx = idx.astype(np.int64)
    sizes = np.asarray(data.shape[b:b + k], dtype=np.int64)
    if idx.size and sizes.all():
        idx = idx % sizes                    # negative indices count from the end (out-of-range ones wrap)
    rows = idx.shape[:-1]
    grids = [np.arange(data.shape[j]).reshape([-1 if t == j else 1 for t in range(len(rows))]) for j in range(b)]
    out = data[tuple(grids + [idx[..., j] for j in range(k)])]
    return [np.ascontiguousarray(out).reshape(rows + data.shape[b + k:])]


compute_op("GatherND", attrs={"batch_dims": 0}, num_inputs=2, logical=_gather_nd_logical, labels=_gather_nd_labels,
           forward=_gather_nd_fwd, flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=Saves(ALL),
           doc="out[i..., :] = data[batch..., idx[i..., :], :] (ONNX GatherND): the index rows are task axes, "
               "the addressed data dims whole.")


# --- Tile ----------------------------------------------------------------------------------------------

def _tile_logical(a, ins):
    x = ins[0]
    reps = tuple(a["repeats"])
    if len(reps) != x.rank:
        _bad("Tile", f"repeats {list(reps)} must have one entry per dim of {list(x.sizes)}")
    if any(r < 0 for r in reps):
        _bad("Tile", f"repeats {list(reps)} must be non-negative")
    return [(tuple(s * r for s, r in zip(x.sizes, reps)), x.dtype)]


def _tile_labels(a, ins, outs):
    li, lo, un = [], [], set()
    for j, r in enumerate(a["repeats"]):
        if r == 1:
            li.append(f"d{j}"), lo.append(f"d{j}")
        else:
            li.append(f"x{j}"), lo.append(f"t{j}")
            un.add(f"x{j}")
    return Labels((tuple(li),), (tuple(lo),), frozenset(un), "additive",
                  {l: "it is tiled (a block of the output is not the tile of a block)" for l in un})


compute_op("Tile", attrs={"repeats": REQUIRED}, num_inputs=1, logical=_tile_logical, labels=_tile_labels,
           forward=lambda a, xs: [np.tile(xs[0], tuple(a["repeats"])) if xs[0].ndim else xs[0].copy()],
           flops=lambda a, i, o: 0.0, doc="Repeats the input along every dim (ONNX Tile); one repeat per dim.",
           cost_class="elementwise", autocast="follow", saves=NOTHING)


# --- Einsum --------------------------------------------------------------------------------------------

_TERM = re.compile(r"^[A-Za-z]*(\.\.\.)?[A-Za-z]*$")


def parse_einsum(equation, ranks) -> tuple[list[list[str]], list[str], str]:
    """Per operand and for the output, one label per dim; plus the explicit equation numpy runs.

    Subscripts are their own labels; ellipsis dims get labels ``_e<p>`` (position p from the left of
    the broadcast ellipsis dims), or ``_b<i>_<p>`` where operand i has size 1 and broadcasts.  The
    implicit form (no ``->``) gets its output spelled out (ellipsis dims, then the subscripts that
    appear once, in alphabetical order), as ONNX and numpy define it.  Raises with a message naming
    the equation for anything else.
    """
    if not isinstance(equation, str):
        _bad("Einsum", f"equation must be a string, got {equation!r}")
    eq = equation.replace(" ", "")
    if eq.count("->") > 1:
        _bad("Einsum", f"equation {equation!r} has more than one '->'")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        _bad("Einsum", f"equation {equation!r} has {len(terms)} operands, got {len(ranks)} inputs")
    for t in terms + ([rhs] if arrow else []):
        if not _TERM.match(t):
            _bad("Einsum", f"equation {equation!r}: term {t!r} is not letters with at most one '...'")
    ell = []
    for i, (t, r) in enumerate(zip(terms, ranks)):
        n_letters = len(t.replace("...", ""))
        e = r - n_letters
        if e < 0 or (e > 0 and "..." not in t):
            _bad("Einsum", f"equation {equation!r}: term {t!r} does not fit the rank-{r} input {i}")
        ell.append(e)
    n_ell = max(ell) if ell else 0
    ell_labels = [f"_e{p}" for p in range(n_ell)]
    ins = []
    for t, e in zip(terms, ell):
        pre, _, post = t.partition("...")
        ins.append(list(pre) + ell_labels[n_ell - e:] + list(post))
    letters = [c for t in terms for c in t.replace("...", "")]
    if arrow:
        if len(set(rhs.replace("...", ""))) != len(rhs.replace("...", "")):
            _bad("Einsum", f"equation {equation!r}: the output names a subscript twice")
        for c in rhs.replace("...", ""):
            if c not in letters:
                _bad("Einsum", f"equation {equation!r}: output subscript {c!r} is in no operand")
        if n_ell and "..." not in rhs:
            _bad("Einsum", f"equation {equation!r}: summing over the ellipsis dims is not supported "
                           f"(keep '...' in the output)")
        pre, _, post = rhs.partition("...")
        out = list(pre) + (ell_labels if "..." in rhs else []) + list(post)
        out_term = rhs
    else:
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        out = ell_labels + once
        out_term = ("..." if n_ell else "") + "".join(once)
    explicit = ",".join(terms) + "->" + out_term
    return ins, out, explicit


def _einsum_sizes(a, ins):
    in_labels, out_labels, _ = parse_einsum(a["equation"], [s.rank for s in ins])
    size: dict[str, int] = {}
    ell_sizes: list[list[int]] = []
    for i, (lab, s) in enumerate(zip(in_labels, ins)):
        ell = []
        for l, n in zip(lab, s.sizes):
            if l.startswith("_e"):
                ell.append(n)
                continue
            if l in size and size[l] != n:
                _bad("Einsum", f"subscript {l!r} has size {n} in input {i} but {size[l]} elsewhere")
            size[l] = n
        ell_sizes.append(ell)
    ell_out = _broadcast("Einsum", ell_sizes) if any(ell_sizes) else ()
    for p, n in enumerate(ell_out):
        size[f"_e{p}"] = n
    return in_labels, out_labels, size


def _einsum_logical(a, ins):
    dts = {s.dtype for s in ins}
    if len(dts) > 1:
        _bad("Einsum", f"inputs differ in dtype: {sorted(dts)}")
    _numeric("Einsum", ins[0].dtype)
    _, out_labels, size = _einsum_sizes(a, ins)
    return [(tuple(size[l] for l in out_labels), ins[0].dtype)]


def _einsum_labels(a, ins, outs):
    in_labels, out_labels, size = _einsum_sizes(a, ins)
    li, un, why = [], set(), {}
    for i, (lab, s) in enumerate(zip(in_labels, ins)):
        t = []
        for l, n in zip(lab, s.sizes):
            if l.startswith("_e") and n != size[l]:
                l = f"_b{i}_{l[2:]}"           # a broadcast (size-1) ellipsis dim
            t.append(l)
        for l in set(t):
            if t.count(l) > 1:
                un.add(l)
                why[l] = "it is a diagonal (the subscript repeats within one operand)"
        li.append(tuple(t))
    return Labels(tuple(li), (tuple(out_labels),), frozenset(un), tuple(True for _ in ins), why)


def _einsum_fwd(a, xs):
    _, _, explicit = parse_einsum(a["equation"], [x.ndim for x in xs])
    y = np.einsum(explicit, *xs)
    return [np.asarray(y).astype(xs[0].dtype, copy=False)]


def _einsum_flops(a, i, o):
    _, _, size = _einsum_sizes(a, i)
    return float(max(1, len(i)) * prod(size.values()))


compute_op("Einsum", attrs={"equation": REQUIRED}, num_inputs=(1, 8), logical=_einsum_logical,
           labels=_einsum_labels, forward=_einsum_fwd, flops=_einsum_flops,
           cost_class="matmul", autocast="low", saves=Saves(ALL),
           doc="numpy/ONNX einsum; subscripts are the labels, contracted ones give partial sums.")


# --- Trilu ---------------------------------------------------------------------------------------------

def _trilu_logical(a, ins):
    x = ins[0]
    if x.rank < 2:
        _bad("Trilu", f"needs a rank >= 2 input, got {list(x.sizes)}")
    return [(x.sizes, x.dtype)]


def _trilu_trivial(a, rows: int, cols: int) -> bool:
    """The triangle keeps every element or none (then the op acts on each element alone)."""
    k = int(a["k"])
    lo, hi = -(rows - 1), cols - 1          # the range of column - row
    if a["upper"]:                           # keeps column - row >= k
        return k <= lo or k > hi
    return k >= hi or k < lo                 # keeps column - row <= k


def _trilu_labels(a, ins, outs):
    lab = _dims("d", ins[0].rank)
    un = frozenset() if _trilu_trivial(a, *ins[0].sizes[-2:]) else frozenset(lab[-2:])
    return Labels((lab,), (lab,), un, "additive",
                  {l: "the triangle depends on the global row and column" for l in un})


def _trilu_fwd(a, xs):
    x, k = xs[0], int(a["k"])
    y = np.triu(x, k) if a["upper"] else np.tril(x, k)
    return [y.astype(x.dtype, copy=False)]


compute_op("Trilu", attrs={"upper": True, "k": 0}, num_inputs=1, logical=_trilu_logical, labels=_trilu_labels,
           forward=_trilu_fwd, flops=lambda a, i, o: 0.0, cost_class="elementwise", autocast="follow", saves=NOTHING,
           doc="Keeps the upper (or lower) triangle of the last two dims from diagonal k; zeros elsewhere.")


# --- ScatterND -----------------------------------------------------------------------------------------

SCATTER_REDUCTIONS = ("none",)


def _scatter_logical(a, ins):
    data, idx, upd = ins
    if a["reduction"] not in SCATTER_REDUCTIONS:
        _bad("ScatterND", f"reduction {a['reduction']!r} is not supported (only 'none')")
    if not _is_int_dtype(idx.dtype):
        _bad("ScatterND", f"indices must be integers, got {idx.dtype}")
    if data.rank < 1 or idx.rank < 1:
        _bad("ScatterND", f"data {list(data.sizes)} and indices {list(idx.sizes)} must have rank >= 1")
    k = idx.sizes[-1]
    if not 1 <= k <= data.rank:
        _bad("ScatterND", f"index tuples of length {k} do not fit rank-{data.rank} data")
    want = idx.sizes[:-1] + data.sizes[k:]
    if upd.sizes != want:
        _bad("ScatterND", f"updates {list(upd.sizes)} must have shape {list(want)}")
    if upd.dtype != data.dtype:
        _bad("ScatterND", f"updates are {upd.dtype} but data is {data.dtype}")
    if 0 in data.sizes[:k] and idx.numel:
        _bad("ScatterND", f"scatters into an empty dim of data {list(data.sizes)}")
    return [(data.sizes, data.dtype)]


def _scatter_labels(a, ins, outs):
    data, idx, upd = ins
    k, q = idx.sizes[-1], idx.rank
    addr = tuple(f"a{j}" for j in range(k))
    tail = tuple(f"s{j}" for j in range(k, data.rank))
    rows = tuple(f"u{j}" for j in range(q - 1))
    un = frozenset(addr + rows + ("q",))
    why = {**{l: "the index tuples address it (an update may land in any piece)" for l in addr},
           **{l: "each update row may land anywhere in the output" for l in rows}, "q": "it holds the index tuples"}
    return Labels((addr + tail, rows + ("q",), rows + tail), (addr + tail,), un, (), why)


def _scatter_fwd(a, xs):
    data, idx, upd = xs
    k = idx.shape[-1]
    out = data.copy()
    ii = idx.astype(np.int64).reshape(-1, k)
    if ii.size:
        ii = ii % np.asarray(data.shape[:k], dtype=np.int64)     # negative indices count from the end
        # numpy assigns repeated indices in order, so the last update wins (ONNX leaves it undefined)
        out[tuple(ii.T)] = upd.reshape((-1,) + data.shape[k:])
    return [out]


compute_op("ScatterND", attrs={"reduction": "none"}, num_inputs=3, logical=_scatter_logical,
           labels=_scatter_labels, forward=_scatter_fwd, flops=lambda a, i, o: 0.0,
           cost_class="default", autocast="follow", saves=Saves({1}),
           doc="out = data with out[indices[..., :]] = updates[...] (ONNX ScatterND, reduction none).")


# --- ScatterElements -----------------------------------------------------------------------------------

def _scatter_elements_logical(a, ins):
    data, idx, upd = ins
    if a["reduction"] not in SCATTER_REDUCTIONS:
        _bad("ScatterElements", f"reduction {a['reduction']!r} is not supported (only 'none')")
    if not _is_int_dtype(idx.dtype):
        _bad("ScatterElements", f"indices must be integers, got {idx.dtype}")
    if data.rank < 1 or idx.rank != data.rank or upd.sizes != idx.sizes:
        _bad("ScatterElements", f"data {list(data.sizes)}, indices {list(idx.sizes)} and updates "
                                f"{list(upd.sizes)} must have one rank >= 1, indices and updates one shape")
    ax = _axis("ScatterElements", a["axis"], data.rank)
    for j in range(data.rank):
        if j != ax and idx.sizes[j] > data.sizes[j]:
            _bad("ScatterElements", f"indices {list(idx.sizes)} exceed data {list(data.sizes)} in dim {j}")
    if upd.dtype != data.dtype:
        _bad("ScatterElements", f"updates are {upd.dtype} but data is {data.dtype}")
    if data.sizes[ax] == 0 and idx.numel:
        _bad("ScatterElements", f"scatters into an empty axis {ax} of data {list(data.sizes)}")
    return [(data.sizes, data.dtype)]


def _scatter_elements_labels(a, ins, outs):
    data, idx, upd = ins
    ax = a["axis"] % data.rank
    ld, li, un, why = [], [], set(), {}
    for j in range(data.rank):
        if j == ax:
            ld.append("a"), li.append(f"i{j}")
            un |= {"a", f"i{j}"}
            why["a"] = why[f"i{j}"] = "the updates are scattered along it (one may land in any piece)"
        elif idx.sizes[j] == data.sizes[j]:
            ld.append(f"d{j}"), li.append(f"d{j}")
        else:
            ld.append(f"x{j}"), li.append(f"i{j}")
            un |= {f"x{j}", f"i{j}"}
            why[f"x{j}"] = why[f"i{j}"] = "the indices cover only part of the data along it"
    return Labels((tuple(ld), tuple(li), tuple(li)), (tuple(ld),), frozenset(un), (), why)


def scatter_elements_coords(idx: np.ndarray, axis: int, n: int) -> tuple[np.ndarray, ...]:
    """The full index tuple of every update, in C order of the indices (the axis coordinate from idx)."""
    grids = list(np.indices(idx.shape, dtype=np.int64)) if idx.ndim else []
    grids[axis] = idx.astype(np.int64) % n if n else idx.astype(np.int64)
    return tuple(gr.reshape(-1) for gr in grids)


def _scatter_elements_fwd(a, xs):
    data, idx, upd = xs
    ax = a["axis"] % data.ndim
    out = data.copy()
    if idx.size:
        # numpy assigns repeated positions in order: the last update wins (ONNX leaves it undefined)
        out[scatter_elements_coords(idx, ax, data.shape[ax])] = upd.reshape(-1)
    return [out]


compute_op("ScatterElements", attrs={"axis": 0, "reduction": "none"}, num_inputs=3,
           logical=_scatter_elements_logical, labels=_scatter_elements_labels, forward=_scatter_elements_fwd,
           flops=lambda a, i, o: 0.0, cost_class="default", autocast="follow", saves=Saves(ALL),
           doc="out = data with out[..., idx[p], ...] = updates[p] along axis (ONNX ScatterElements, the "
               "dynamo exporter's select_scatter / index assignment).")


# --- CumSum --------------------------------------------------------------------------------------------

def _cumsum_logical(a, ins):
    x = ins[0]
    if x.rank < 1:
        _bad("CumSum", "needs an input of rank >= 1")
    _axis("CumSum", a["axis"], x.rank)
    _numeric("CumSum", x.dtype, "the input")
    return [(x.sizes, x.dtype)]


def _cumsum_labels(a, ins, outs):
    lab = _dims("d", ins[0].rank)
    ax = lab[a["axis"] % ins[0].rank]
    return Labels((lab,), (lab,), frozenset({ax}), "additive", {ax: "the running sum runs along it"})


def _cumsum_fwd(a, xs):
    x = xs[0]
    ax = a["axis"] % x.ndim
    y = np.flip(x, ax) if a["reverse"] else x
    c = np.cumsum(y, axis=ax, dtype=x.dtype)
    if a["exclusive"]:
        n = c.shape[ax]
        c = np.concatenate([np.zeros_like(np.take(c, range(min(n, 1)), axis=ax)),
                            np.take(c, range(max(n - 1, 0)), axis=ax)], axis=ax)
    if a["reverse"]:
        c = np.flip(c, ax)
    return [np.ascontiguousarray(c)]


compute_op("CumSum", attrs={"axis": REQUIRED, "exclusive": False, "reverse": False}, num_inputs=1,
           logical=_cumsum_logical, labels=_cumsum_labels, forward=_cumsum_fwd,
           flops=lambda a, i, o: float(o[0].numel), doc="Running sum along axis (ONNX CumSum).",
           cost_class="elementwise", autocast="fp32_direct", saves=NOTHING)
