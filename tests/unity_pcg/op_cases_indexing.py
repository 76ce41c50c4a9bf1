"""Case generators for the operators of :mod:`unity_pcg.ops.indexing` (merged into op_cases.GENERATORS)."""
from __future__ import annotations

from math import prod

from .op_cases import Case, Drawer, _bcast_partner, _shape

BOOL = ("index", 2)        # fill: random booleans (0/1 cast to bool)


def _bcast_pair(d: Drawer, lo=1, hi=4, min_numel=6):
    """Two shapes that broadcast to one output of at least ``min_numel`` elements (small tensors could
    agree with a wrong piecewise result by chance, e.g. a comparison of a partial sum)."""
    out = _shape(d, lo, hi)
    while prod(out) < min_numel:
        out = out + [d.choice([2, 3, 4])] if len(out) < hi else [s * 2 for s in out]
    a, b = _bcast_partner(d, out), _bcast_partner(d, out)
    if d.bool():
        a = out
    else:
        b = out
    return (a, b) if d.bool() else (b, a)


def gen_where(d: Drawer) -> Case:
    out = _shape(d, 1, 4)
    while prod(out) < 6:
        out = out + [2] if len(out) < 4 else [s * 2 for s in out]
    parts = [_bcast_partner(d, out) for _ in range(3)]
    parts[d.int(0, 2)] = out
    dt = d.choice(["float64", "float64", "int64"])
    fill = "int" if dt == "int64" else "normal"
    return Case("Where", {}, parts, ["bool", dt, dt], [BOOL, fill, fill])


def gen_compare(op):
    def g(d: Drawer) -> Case:
        a, b = _bcast_pair(d)
        # values in {0, 1, 2} (also as floats) so that equal values are common
        dt = d.choice(["int64", "float64", "int32"] + (["bool"] if op == "Equal" else []))
        fill = BOOL if dt == "bool" else ("index", 3)
        return Case(op, {}, [a, b], [dt, dt], [fill, fill])
    return g


def gen_logic(op):
    def g(d: Drawer) -> Case:
        if op == "Not":
            s = _shape(d, 0, 4)
            while prod(s) < 6:
                s = s + [2]
            return Case("Not", {}, [s], ["bool"], [BOOL])
        a, b = _bcast_pair(d)
        return Case(op, {}, [a, b], ["bool", "bool"], [BOOL, BOOL])
    return g


def gen_gather_elements(d: Drawer) -> Case:
    data = _shape(d, 1, 3, max_numel=64)
    ax = d.int(-len(data), len(data) - 1)
    idx = [s if j == ax % len(data) or d.bool(0.7) else d.int(1, s) for j, s in enumerate(data)]
    idx[ax % len(data)] = d.choice([1, 2, 3, 4, 6])
    return Case("GatherElements", {"axis": ax}, [data, idx], ["float64", d.choice(["int64", "int32"])],
                ["normal", ("signed_index", data[ax % len(data)])])


def gen_gather_nd(d: Drawer) -> Case:
    data = _shape(d, 1, 3, max_numel=48)
    b = d.int(0, 1) if len(data) > 1 else 0
    k = d.int(1, len(data) - b)
    rows = _shape(d, 0, 2, sizes=(1, 2, 3, 4), max_numel=8)
    idx = data[:b] + rows + [k]
    n = min(data[b:b + k])
    return Case("GatherND", {"batch_dims": b}, [data, idx], ["float64", d.choice(["int64", "int32"])],
                ["normal", ("signed_index", n)])


def gen_tile(d: Drawer) -> Case:
    x = _shape(d, 1, 3, max_numel=24)
    reps = tuple(d.choice([1, 1, 2, 3]) for _ in x)
    return Case("Tile", {"repeats": reps}, [x], ["float64"], ["normal"])


# the equations transformers emit, then random ones
EINSUM_FORMS = [
    ("bhqd,bhkd->bhqk", "bhqd", "bhkd"),
    ("bhqk,bhkd->bhqd", "bhqk", "bhkd"),
    ("bij,bjk->bik", "bij", "bjk"),
    ("...ij,...jk->...ik", "...ij", "...jk"),
    ("bsh,hd->bsd", "bsh", "hd"),
    ("ij,jk", "ij", "jk"),                 # implicit output
    ("bi,bi->b", "bi", "bi"),
    ("ij->ji", "ij", None),
    ("bij->bj", "bij", None),
]


def gen_einsum(d: Drawer) -> Case:
    eq, ta, tb = d.choice(EINSUM_FORMS)
    size = {c: d.choice([1, 2, 3, 4]) for c in "bhqdkijs"}
    ell = [d.choice([1, 2, 3]) for _ in range(d.int(0, 2))]

    def shape(t, first):
        pre, dots, post = t.partition("...")
        e = []
        if dots:   # the first operand has every ellipsis dim, the second a suffix, some broadcast (size 1)
            e = ell if first else [1 if d.bool(0.2) else s for s in ell[len(ell) - d.int(0, len(ell)):]]
        return [size[c] for c in pre] + e + [size[c] for c in post]
    sizes = [shape(t, k == 0) for k, t in enumerate(t for t in (ta, tb) if t is not None)]
    return Case("Einsum", {"equation": eq}, sizes, ["float64"] * len(sizes), ["normal"] * len(sizes))


def gen_trilu(d: Drawer) -> Case:
    s = _shape(d, 2, 4, max_numel=128)
    k = d.choice([0, 0, 1, -1, 2, -3])
    return Case("Trilu", {"upper": d.bool(), "k": k}, [s], ["float64"], ["normal"])


def gen_scatter_nd(d: Drawer) -> Case:
    data = _shape(d, 1, 3, max_numel=64)
    # mostly index tuples shorter than the rank (row scatters, as causal-mask exports): the slice dims shard
    k = d.int(1, len(data)) if len(data) == 1 or d.bool(0.2) else d.int(1, len(data) - 1)
    if len(data) == 1 and d.bool(0.7):
        data = data + [d.choice([2, 4, 6])]
    rows = _shape(d, 0, 2, sizes=(1, 2, 3), max_numel=6)
    if prod(data[:k]) <= prod(rows):     # leave some data unwritten (a write of everything is a special case)
        rows = [1]
        data[0] = max(data[0], 2)
    idx = rows + [k]
    upd = rows + data[k:]
    n = min(data[:k])
    return Case("ScatterND", {}, [data, idx, upd], ["float64", "int64", "float64"],
                ["normal", ("signed_index", n), "normal"])


def gen_scatter_elements(d: Drawer) -> Case:
    data = _shape(d, 1, 3, max_numel=64)
    r = len(data)
    ax = d.int(-r, r - 1)
    idx = [s if j == ax % r or d.bool(0.7) else d.int(1, s) for j, s in enumerate(data)]
    idx[ax % r] = d.int(1, max(1, data[ax % r] - 1))    # leave some data unwritten (a full overwrite is special)
    if data[ax % r] == 1:
        data[ax % r] = 2
    return Case("ScatterElements", {"axis": ax}, [data, idx, list(idx)], ["float64", "int64", "float64"],
                ["normal", ("signed_index", data[ax % r]), "normal"])


def gen_cumsum(d: Drawer) -> Case:
    s = _shape(d, 1, 3)
    dt = d.choice(["float64", "float64", "int64"])
    attrs = {"axis": d.int(-len(s), len(s) - 1), "exclusive": d.bool(), "reverse": d.bool()}
    return Case("CumSum", attrs, [s], [dt], ["int" if dt == "int64" else "normal"])


GENERATORS: dict = {
    "Where": gen_where,
    **{op: gen_compare(op) for op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")},
    **{op: gen_logic(op) for op in ("Not", "And", "Or", "Xor")},
    "GatherElements": gen_gather_elements, "GatherND": gen_gather_nd, "Tile": gen_tile, "Einsum": gen_einsum, "Trilu": gen_trilu,
    "ScatterND": gen_scatter_nd, "ScatterElements": gen_scatter_elements, "CumSum": gen_cumsum,
}
