"""Find every match of a rule's source pattern in a PCG, with attribute bindings.

A match maps each source pattern node to a distinct graph node (same op, attributes unify with the
pattern's literals and variables, inputs consistent) and each named input to a graph tensor.  Interior
pattern tensors (not pattern outputs) must have no consumer outside the match and must not be graph
outputs, so applying the rule can remove them.  Dimension attributes are compared counted from the end
(-1 = last dim of the operator's first input), so one rule serves every rank.

Speed: graph nodes are indexed by op type once per graph (:class:`GraphIndex`; a windowed index holds only
the window's nodes, consumer counts come from the PCG's own consumer index), matching starts at the
pattern's last output node and walks backwards along inputs, so most attempts fail at the first node; a
later output node of a multi-output pattern (``partition_cse``: two Partitions of one tensor) is tried only
among the readers of a tensor already bound (the same matches in the same order; on a whole graph the
merging rules were quadratic in its Partitions).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
import itertools
import weakref
from typing import Any, Iterable, Iterator, Mapping, Sequence

from unity_pcg import ops
from unity_pcg.ops.base import REQUIRED
from unity_pcg.pcg import PCG

from .rule import DIM_ATTRS, Pattern, Rule, is_var

Ref = tuple
#: a later sink of a multi-sink pattern is tried only among the readers of a tensor the earlier sinks bound
#: (off: every node of its op, the reference the tests compare with)
PRUNE_SINKS = True


@dataclass(frozen=True)
class Match:
    rule: Rule
    nodes: tuple[int, ...]                       # graph node id per source pattern node
    inputs: tuple[tuple[str, Ref], ...]          # input name -> graph ref
    bindings: tuple[tuple[str, Any], ...]        # variable name -> value

    @property
    def input_map(self) -> dict[str, Ref]:
        return dict(self.inputs)

    @property
    def binding(self) -> dict[str, Any]:
        return dict(self.bindings)


class _Users:
    """Consumer counts of a graph's tensors, from the PCG's own consumer index (built once per graph)."""

    __slots__ = ("g",)

    def __init__(self, g: PCG):
        self.g = g

    def get(self, ref: Ref, default: int = 0) -> int:
        return len(self.g.consumers(ref)) or default

    def __getitem__(self, ref: Ref) -> int:
        return len(self.g.consumers(ref))


class GraphIndex:
    """Per-graph lookups used by matching (op -> node ids, consumers, output set).  ``window``: index
    only those nodes as places a match may end (``by_op``; consumer counts and outputs stay the whole
    graph's) -- what a windowed search asks for, without a pass over the whole graph in Python."""

    def __init__(self, g: PCG, window: Iterable[int] | None = None):
        self.g = g
        self.by_op: dict[str, list[int]] = defaultdict(list)
        if window is None:
            ids: Iterable[int] = g.topo_order()
        else:
            w = window if isinstance(window, (set, frozenset)) else set(window)
            ids = [n for n in g.topo_order() if n in w]
        for nid in ids:
            self.by_op[g.node(nid).op].append(nid)
        self.users = _Users(g)
        self.graph_outputs = {tuple(r) for r in g.outputs}
        self._attrs: dict[int, tuple[dict, int]] = {}

    def attrs(self, nid: int) -> tuple[dict, int]:
        """(attributes, rank of the first input) of a node."""
        a = self._attrs.get(nid)
        if a is None:
            n = self.g.node(nid)
            rank = self.g.shape(n.inputs[0]).rank if n.inputs else 0
            a = (n.a, rank)
            self._attrs[nid] = a
        return a


def _dim_val(v: Any, rank: int, kind: str) -> Any:
    """A graph dim normalized for a variable of ``kind`` (front- or back-counted)."""
    if not isinstance(v, int) or isinstance(v, bool) or rank <= 0:
        return v
    return v % rank if kind == "fdim" else v % rank - rank


def _unify_dim(pv: Any, gv: Any, rank: int, b: dict, kinds: Mapping[str, str]) -> bool:
    if isinstance(pv, tuple):
        if not isinstance(gv, tuple) or len(pv) != len(gv):
            return False
        return all(_unify_dim(p, x, rank, b, kinds) for p, x in zip(pv, gv))
    if is_var(pv):
        name = pv[1:]
        val = _dim_val(gv, rank, kinds.get(name, "dim"))
        if name in b:
            return b[name] == val
        b[name] = val
        return True
    if isinstance(pv, int) and isinstance(gv, int) and rank > 0:
        return -rank <= pv < rank and pv % rank == gv % rank
    return pv == gv


def _unify(pat_val: Any, val: Any, b: dict) -> bool:
    if is_var(pat_val):
        name = pat_val[1:]
        if name in b:
            return b[name] == val
        b[name] = val
        return True
    return pat_val == val


def _attrs_match(pn, attrs: Mapping[str, Any], rank: int, b: dict, defaults: Mapping[str, Any],
                 kinds: Mapping[str, str]) -> list[str] | None:
    """Unify attributes; returns the variables newly bound (for undo) or None on failure."""
    before = set(b)
    pa = pn.a
    dims = DIM_ATTRS.get(pn.op, ())
    for k, dv in defaults.items():
        if k in pa:
            ok = _unify_dim(pa[k], attrs.get(k), rank, b, kinds) if k in dims else _unify(pa[k], attrs.get(k), b)
        else:
            ok = dv is not REQUIRED and attrs.get(k) == dv
        if not ok:
            for n in set(b) - before:
                del b[n]
            return None
    return [n for n in b if n not in before]


def _sinks(p: Pattern) -> list[int]:
    used = {r[0] for n in p.nodes for r in n.inputs if not isinstance(r, str)}
    return [i for i in range(len(p.nodes)) if i not in used]


def find_matches(rule: Rule, g: PCG, index: GraphIndex | None = None, limit: int | None = None,
                 degrees: Sequence[int] = (2,)) -> list[Match]:
    return list(iter_matches(rule, g, index, limit, degrees))


def _free_choices(rule: Rule, g: PCG, inputs: Mapping[str, Ref], nodes: Sequence[int], degrees: Sequence[int]):
    """Every assignment of the rule's free (target-only) variables: degrees from ``degrees``, dims
    over the ranks of the matched tensors."""
    free = rule.free_vars()
    if not free:
        yield {}
        return
    kinds = rule.var_kinds
    rank = max([g.shape(r).rank for r in inputs.values()] + [max(s.rank for s in g.shapes(n)) for n in nodes])
    domains = []
    for v in free:
        k = kinds[v]
        domains.append(list(degrees) if k == "degree" else list(range(-rank, 0)) if k == "dim"
                       else list(range(rank)))
    for combo in itertools.product(*domains):
        yield dict(zip(free, combo))


#: id(rule) -> what matching it needs from its source pattern (computed once per rule object, dropped with it)
_PREPARED: dict[int, tuple] = {}


def _prepared(rule: Rule) -> tuple:
    """(sinks, output refs, interior uses per pattern tensor, op specs, variable kinds) of ``rule``'s source."""
    got = _PREPARED.get(id(rule))
    if got is not None:
        return got
    p = rule.source
    interior_uses: dict[Ref, int] = defaultdict(int)   # pattern tensor -> uses inside the pattern
    for n in p.nodes:
        for r in n.inputs:
            if not isinstance(r, str):
                interior_uses[tuple(r)] += 1
    prep = (_sinks(p), {tuple(o) for o in p.outputs}, dict(interior_uses), [ops.get_op(n.op) for n in p.nodes],
            rule.var_kinds)
    _PREPARED[id(rule)] = prep
    weakref.finalize(rule, _PREPARED.pop, id(rule), None)
    return prep


def iter_matches(rule: Rule, g: PCG, index: GraphIndex | None = None, limit: int | None = None,
                 degrees: Sequence[int] = (2,), avoid: set | None = None) -> Iterator[Match]:
    """Matches of ``rule`` in ``g``.  Free target variables (degrees, dims chosen at application)
    are enumerated: degrees from ``degrees``, dims over the matched tensors' ranks.  ``avoid``: a set of
    node ids (the caller may add to it between matches) no match binds, as a node or as the producer of
    an input: the caller's disjoint matches, found without building the ones it would refuse."""
    idx = index or GraphIndex(g)
    p = rule.source
    sinks, out_refs, interior_uses, specs, kinds = _prepared(rule)
    found = 0

    assign: dict[int, int] = {}       # pattern node -> graph node
    used: set[int] = set()
    inputs: dict[str, Ref] = {}
    b: dict[str, Any] = {}

    def match_node(pi: int, nid: int) -> Iterator[None]:
        """Match pattern node pi to graph node nid and, recursively, its pattern-node inputs."""
        if pi in assign:
            if assign[pi] == nid:
                yield
            return
        if nid in used or (avoid is not None and nid in avoid):
            return
        pn = p.nodes[pi]
        n = g.node(nid)
        if n.op != pn.op or len(n.inputs) != len(pn.inputs):
            return
        at, rank = idx.attrs(nid)
        new = _attrs_match(pn, at, rank, b, specs[pi].attrs, kinds)
        if new is None:
            return
        # interior outputs must not escape
        nouts = len(g.shapes(nid))
        ok = True
        for k in range(nouts):
            pr = (pi, k)
            if pr in out_refs:
                continue
            gr = (nid, k)
            if idx.users.get(gr, 0) != interior_uses.get(pr, 0) or gr in idx.graph_outputs:
                ok = False
                break
        if ok:
            assign[pi] = nid
            used.add(nid)
            yield from match_inputs(pn.inputs, n.inputs, 0)
            del assign[pi]
            used.discard(nid)
        for v in new:
            del b[v]

    def match_inputs(pins, gins, j) -> Iterator[None]:
        if j == len(pins):
            yield
            return
        pr, gr = pins[j], tuple(gins[j])
        if isinstance(pr, str):
            if pr in inputs:
                if inputs[pr] == gr:
                    yield from match_inputs(pins, gins, j + 1)
                return
            if avoid is not None and gr[0] in avoid:
                return
            inputs[pr] = gr
            yield from match_inputs(pins, gins, j + 1)
            del inputs[pr]
            return
        if gr[1] != pr[1]:
            return
        for _ in match_node(pr[0], gr[0]):
            yield from match_inputs(pins, gins, j + 1)

    def match_sinks(k: int) -> Iterator[None]:
        if k == len(sinks):
            yield
            return
        si = sinks[k]
        cands = idx.by_op.get(p.nodes[si].op, ())
        if k and cands and PRUNE_SINKS:
            # a later sink reading a tensor the earlier sinks bound (the duplicate-merging rules: two
            # Partitions of one tensor) can only be one of its readers: the same candidates, in the same
            # order, without trying every node of the op (quadratic on a whole graph)
            for j, pr in enumerate(p.nodes[si].inputs):
                if isinstance(pr, str):
                    bound = inputs.get(pr)
                else:
                    bound = (assign[pr[0]], pr[1]) if pr[0] in assign else None
                if bound is not None:
                    readers = {c for c, pos in g.consumers(bound) if pos == j}
                    cands = [n for n in cands if n in readers]
                    break
        for nid in cands:
            for _ in match_node(si, nid):
                yield from match_sinks(k + 1)

    for _ in match_sinks(0):
        if len(assign) != len(p.nodes):
            continue
        nodes = tuple(assign[i] for i in range(len(p.nodes)))
        for extra in _free_choices(rule, g, inputs, nodes, degrees):
            full = {**b, **extra}
            if not rule.check_constraints(full):
                continue
            yield Match(rule, nodes, tuple(sorted(inputs.items())), tuple(sorted(full.items())))
            found += 1
            if limit is not None and found >= limit:
                return


def match_all(rules, g: PCG, limit_per_rule: int | None = None, degrees: Sequence[int] = (2,)) -> list[Match]:
    """Every match of every rule (one shared index)."""
    idx = GraphIndex(g)
    out: list[Match] = []
    for r in rules:
        out.extend(iter_matches(r, g, idx, limit_per_rule, degrees))
    return out
