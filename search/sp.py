"""Series-parallel decomposition of a PCG for the machine-mapping DP (Unity section 5.2).

Units.  Sources (Input, Weight) take no machine view and are dropped.  A placement chain (parallel
operators hanging off a source) has no data dependence of its own, so it is merged into the *unit* of
its first consumer in topological order; every other node is a unit of its own.  Units are the
leaves of the decomposition; the DP chooses the views of a unit's nodes together.

Decomposition of a set S of units (always *convex*: every path between two members stays inside):

1. one unit -> ``Leaf``;
2. several weakly connected components -> ``Parallel`` (binary, first component vs the rest);
3. a *bottleneck* unit v (every other unit of S is an ancestor or a descendant of v: a post-dominator
   of the part before it) -> ``Series(ancestors + v, descendants)``; the bottleneck nearest the middle
   of S's topological order is used, so chains decompose in balanced halves;
4. otherwise S is not series-parallel (Inception's and DenseNet's cross edges, a "N" shape): it is
   cut into a topological prefix and suffix -- a sequence split at the cut with the fewest units whose
   outputs cross it (ties: nearest the middle).  This is flexflow-train's series-parallelization in
   effect: it adds ordering between the two sides, so the DP can no longer run units of the prefix side
   by side with units of the suffix; every dependence is still honoured because the DP enumerates the
   views of all units whose outputs cross a series split.

Series children are flattened (n-ary) for the DP's left-to-right pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from unity_pcg.pcg import PCG


@dataclass(frozen=True)
class Leaf:
    unit: int                       # index into Decomposition.units


@dataclass(frozen=True)
class Series:
    children: tuple


@dataclass(frozen=True)
class Parallel:
    left: object
    right: object


Tree = Union[Leaf, Series, Parallel]


@dataclass
class Decomposition:
    tree: Tree
    units: list                      # unit index -> tuple of node ids (main node last)
    unit_of: dict                    # node id -> unit index
    main: list                       # unit index -> main node id
    is_sp: bool                      # False if step 4 was needed anywhere


def build_units(g: PCG, roles: dict) -> tuple[list, dict, list]:
    """Group nodes into units (see module docstring).  ``roles`` from :class:`search.cost.GraphCost`."""
    order = g.topo_order()
    unit_of: dict[int, int] = {}
    units: list[list[int]] = []
    main: list[int] = []
    placement = {n for n, r in roles.items() if r.endswith("-placement")}
    for nid in order:
        if roles[nid] in ("input", "weight") or nid in placement:
            continue
        unit_of[nid] = len(units)
        units.append([nid])
        main.append(nid)
    # attach placement nodes to their first non-placement consumer (transitively through the chain)
    pos = {nid: i for i, nid in enumerate(order)}
    for nid in reversed(order):
        if nid not in placement:
            continue
        best = None
        for k in range(len(g.shapes(nid))):
            for c, _ in g.consumers((nid, k)):
                u = unit_of.get(c)
                if u is not None and (best is None or pos[main[u]] < pos[main[best]]):
                    best = u
        if best is None:               # a placement nothing reads (or a graph output): its own unit
            unit_of[nid] = len(units)
            units.append([nid])
            main.append(nid)
        else:
            unit_of[nid] = best
            units[best].insert(0, nid)
    for u in units:
        u.sort(key=lambda n: pos[n])
    return [tuple(u) for u in units], unit_of, main


def decompose(g: PCG, roles: dict) -> Decomposition:
    units, unit_of, main = build_units(g, roles)
    n = len(units)
    order = g.topo_order()
    pos = {nid: i for i, nid in enumerate(order)}
    # unit order: by position of the unit's main node
    uorder = sorted(range(n), key=lambda u: pos[main[u]])
    rank = {u: i for i, u in enumerate(uorder)}
    succ: list[set] = [set() for _ in range(n)]
    pred: list[set] = [set() for _ in range(n)]
    for u in range(n):
        for nid in units[u]:
            for r in g.node(nid).inputs:
                v = unit_of.get(r[0])
                if v is not None and v != u:
                    succ[v].add(u)
                    pred[u].add(v)
    # unit graph must be acyclic in rank order; merging placements into their first consumer keeps it so
    for u in range(n):
        for v in succ[u]:
            if rank[v] <= rank[u]:
                raise AssertionError("unit graph is not ordered")  # pragma: no cover
    # reachability bitsets over ranks
    anc = [0] * n
    desc = [0] * n
    for u in uorder:
        a = 0
        for p in pred[u]:
            a |= anc[p] | (1 << rank[p])
        anc[u] = a
    for u in reversed(uorder):
        d = 0
        for s in succ[u]:
            d |= desc[s] | (1 << rank[s])
        desc[u] = d
    state = {"sp": True}

    def members(mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(uorder[low.bit_length() - 1])
            mask ^= low
        return out

    def rec(mask: int) -> Tree:
        ms = members(mask)                      # in rank order
        if len(ms) == 1:
            return Leaf(ms[0])
        # components
        comp = _component(ms[0], mask)
        if comp != mask:
            return Parallel(rec(comp), rec(mask & ~comp))
        # bottleneck nearest the middle
        total = len(ms)
        mid = (total - 1) / 2
        best = None
        for i, u in enumerate(ms):
            if ((anc[u] | desc[u]) & mask).bit_count() == total - 1:
                if best is None or abs(i - mid) < abs(best[0] - mid):
                    best = (i, u)
        if best is not None:
            i, u = best
            if i == total - 1:
                left = mask & ~(1 << rank[u])
                right = 1 << rank[u]
            else:
                left = (anc[u] & mask) | (1 << rank[u])
                right = mask & ~left
            return _series(rec(left), rec(right))
        # not series-parallel: topological cut with the fewest crossing producers
        state["sp"] = False
        best_cut = None
        prefix = 0
        remaining = {}                          # prefix unit -> successors in S not yet in the prefix
        crossing = 0
        for i, u in enumerate(ms[:-1]):
            prefix |= 1 << rank[u]
            for p in pred[u]:
                if p in remaining:
                    remaining[p] -= 1
                    if remaining[p] == 0:
                        crossing -= 1
            remaining[u] = sum(1 for s_ in succ[u] if (1 << rank[s_]) & mask)
            if remaining[u]:
                crossing += 1
            score = (crossing, abs(i - mid))
            if best_cut is None or score < best_cut[0]:
                best_cut = (score, prefix)
        left = best_cut[1]
        return _series(rec(left), rec(mask & ~left))

    def _component(start: int, mask: int) -> int:
        seen = 1 << rank[start]
        stack = [start]
        while stack:
            u = stack.pop()
            for v in succ[u] | pred[u]:
                b = 1 << rank[v]
                if (b & mask) and not (b & seen):
                    seen |= b
                    stack.append(v)
        return seen

    full = (1 << n) - 1
    tree = rec(full) if n else Series(())
    return Decomposition(tree, units, unit_of, main, state["sp"])


def _series(a: Tree, b: Tree) -> Series:
    ch = []
    for t in (a, b):
        ch.extend(t.children if isinstance(t, Series) else (t,))
    return Series(tuple(ch))


def tree_units(t: Tree) -> list[int]:
    if isinstance(t, Leaf):
        return [t.unit]
    if isinstance(t, Series):
        return [u for c in t.children for u in tree_units(c)]
    return tree_units(t.left) + tree_units(t.right)


def describe(t: Tree, units: list | None = None) -> str:
    if isinstance(t, Leaf):
        return str(units[t.unit][-1] if units else t.unit)
    if isinstance(t, Series):
        return "S(" + " ".join(describe(c, units) for c in t.children) + ")"
    return "P(" + describe(t.left, units) + " | " + describe(t.right, units) + ")"


__all__ = ["Leaf", "Series", "Parallel", "Decomposition", "decompose", "build_units", "tree_units", "describe"]
