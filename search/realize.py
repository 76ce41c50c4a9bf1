"""Layout -> rule sequence: reach a given parallelization of a logical PCG by the shipped, proven rules.

A *layout* of a compute node is the parallel shapes of its inputs and outputs (:class:`NodeLayout`).  A
target is a PCG obtained from ``g`` by inserting parallel operators around the same compute nodes (a
baseline, an ILP plan) or a dict of layouts keyed by ``g``'s compute node ids.  :func:`realize` rewrites
``g`` by rules only, so that every compute node gets its target layout, and returns the graph with the
rule sequence that reaches it (``replay(g, steps)`` rebuilds it) -- or says which nodes it could not bring
there and why.

The mechanism knows no operator.  It walks the compute nodes in sweeps (topological order, then reverse,
alternating, until a sweep changes nothing); for a node away from its target it enumerates the rule
matches that rewrite it (windowed matching: only rules whose source pattern contains the node, found from
the nodes downstream of it within the pattern's depth), previews each one's result by shape inference on
the rule's target pattern (no graph copy), and applies the one that brings the node closest to its target
without moving any matched node that is already there away from it, preferring the match that brings the
most matched nodes closer (a Megatron template that lays out a whole attention block at once beats a
single-operator rule).  A node may take several steps (degrees compose: data parallel then column split).
After each step the Partition/Combine pairs and duplicate placements it left around it are cancelled by
the cancel rules; at the end the gathers a later split undoes are sunk to it and cancelled, a split of partial
sums is commuted below their Reduce (one reduce-scatter, as the ILP writes it), and a Reduce met by a Replicate
fuses into an AllReduce.  The second sweep moves
parallel operators backwards (``Partition(op(Combine(x), y)) -> op(x, Partition(y))``: a partition a later
node asked for) and lifts replicates above the operators that must run on copies.

Compute nodes are tracked through rewrites: a rule's source and target patterns hold the same compute
operators (only such *parallelization* rules are used), paired in pattern order, and the target pattern's
nodes take the next free ids in order (DESIGN "Matching and application").
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from unity_pcg import ops
from unity_pcg.errors import GraphError, InvalidParallelization, UnityError
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape
from unity_pcg.substitutions import GraphIndex, Match, Rule, iter_matches
from unity_pcg.substitutions.live import LiveGraph
from unity_pcg.substitutions.match import _Users
from unity_pcg.substitutions.rule import is_var

from .budget import Deadline, Expired, within
from .substitution import RuleBook, RuleStep, sink_combines

#: a node gets at most this many rule steps in one visit (degrees compose: 2 x 2 x 2 is three steps)
MAX_STEPS_PER_NODE = 6
#: sweeps over the nodes (forward, backward, forward, ...) before giving up on the rest
MAX_SWEEPS = 6
#: the rule that fuses a Reduce met by its Replicate into one AllReduce (run at the end)
FUSE_RULE = "reduce_replicate_allreduce"


class RealizeError(UnityError, ValueError):
    """The target is not a parallelization of the graph (its compute nodes do not pair with the graph's)."""


@dataclass(frozen=True)
class NodeLayout:
    """The parallel shapes a compute node reads and writes."""
    inputs: tuple[ParallelTensorShape, ...]
    outputs: tuple[ParallelTensorShape, ...]

    @staticmethod
    def of(g: PCG, nid: int) -> "NodeLayout":
        return NodeLayout(tuple(g.input_shapes(nid)), tuple(g.shapes(nid)))

    def describe(self) -> str:
        return f"({', '.join(map(str, self.inputs))}) -> ({', '.join(map(str, self.outputs))})"


@dataclass
class Realized:
    pcg: PCG                 # reached from g by `steps` (search.substitution.replay(g, steps) rebuilds it)
    steps: list              # RuleStep sequence
    complete: bool           # every compute node has the target's layout
    missing: list = field(default_factory=list)   # one line per compute node left at another layout, and why
    ids: dict = field(default_factory=dict)       # g's compute node id -> its id in pcg
    seconds: float = 0.0
    #: set by :func:`settle`: which layouts ``pcg`` reaches ("target"; "target, N nodes at the fallback";
    #: "fallback") and its price (the caller's price of ``trimmed(pcg)``)
    chosen: str = "target"
    price: float | None = None


# --- the target's layouts ----------------------------------------------------------------------------------

def _origin(g: PCG, ref) -> tuple:
    """The tensor ``ref`` is a placement of: back through parallel operators."""
    r = tuple(ref)
    while g.node(r[0]).kind == "parallel":
        r = tuple(g.node(r[0]).inputs[0])
    return r


def pair_nodes(g: PCG, target: PCG) -> dict[int, int]:
    """``g``'s node id -> ``target``'s, for every source and compute node of ``g``: sources by op and
    attributes (Weights and Inputs by name), compute nodes by op, attributes and the tensors they read
    (seen through the parallel operators ``target`` inserted).  Raises RealizeError where one has no pair."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for tid in target.topo_order():
        n = target.node(tid)
        if n.kind == "source":
            by_key[("s", n.op, n.attrs)].append(tid)
        elif n.kind == "compute":
            by_key[("c", n.op, n.attrs, tuple(_origin(target, r) for r in n.inputs))].append(tid)
    taken: dict[tuple, int] = defaultdict(int)
    out: dict[int, int] = {}
    for nid in g.topo_order():
        n = g.node(nid)
        if n.kind == "source":
            key = ("s", n.op, n.attrs)
        elif n.kind == "compute":
            try:
                key = ("c", n.op, n.attrs, tuple((out[r[0]], r[1]) for r in n.inputs))
            except KeyError:
                raise RealizeError(f"{n.label()} ({n.op}) reads a tensor the target does not have") from None
        else:
            raise RealizeError(f"the graph to realize on must be logical: {n.label()} is a {n.op}")
        cands = by_key.get(key, [])
        i = taken[key]
        if i >= len(cands):
            raise RealizeError(f"{n.label()} ({n.op}) has no counterpart in the target")
        taken[key] = i + 1
        out[nid] = cands[i]
    return out


def layout_of(target: PCG, g: PCG) -> dict[int, NodeLayout]:
    """The target's layouts keyed by ``g``'s compute node ids."""
    pairs = pair_nodes(g, target)
    return {nid: NodeLayout.of(target, pairs[nid]) for nid in g.topo_order() if g.node(nid).kind == "compute"}


# --- distances between layouts ------------------------------------------------------------------------------

def _shape_distance(a: ParallelTensorShape, b: ParallelTensorShape) -> float:
    if a.rank != b.rank:
        return INF
    d = abs(math.log2(a.sum_degree) - math.log2(b.sum_degree)) + abs(math.log2(a.copy_degree) - math.log2(b.copy_degree))
    for x, y in zip(a.dims, b.dims):
        if x.degree != y.degree:
            d += abs(math.log2(x.degree) - math.log2(y.degree))
    return d


def _outputs_farther(cur: NodeLayout, new: NodeLayout, tgt: NodeLayout) -> bool:
    """True when a step takes an output of the node farther from its target (what its readers see), or splits one of
    its dims beyond the target's degree: such a step is not taken even where its inputs come closer (data parallelism of a node the target runs on copies, chosen for
    its copied parameters, would block the copies its readers lift above it)."""
    def overshoots(a, b, t):     # a dim split beyond its target degree (and beyond where it was)
        return any(y.degree > z.degree and y.degree > x.degree for x, y, z in zip(a.dims, b.dims, t.dims))
    return any(_shape_distance(b, t) > _shape_distance(a, t) or (a.rank == b.rank == t.rank and overshoots(a, b, t))
               for a, b, t in zip(cur.outputs, new.outputs, tgt.outputs))


INF = math.inf
#: in :func:`loose_distance`, a step on an exact input counts this many steps on the others
EXACT_WEIGHT = 4


def distance(cur: NodeLayout, tgt: NodeLayout) -> float:
    """0 when equal; else the sum over tensors and axes of |log2(degree) - log2(target degree)|."""
    if len(cur.inputs) != len(tgt.inputs) or len(cur.outputs) != len(tgt.outputs):
        return INF
    return sum(_shape_distance(a, b) for a, b in zip(cur.inputs + cur.outputs, tgt.inputs + tgt.outputs))


def _pieces(s: ParallelTensorShape) -> int:
    return s.copy_degree * s.shard_degree


def loose_distance(cur: NodeLayout, tgt: NodeLayout, exact_inputs: Iterable[int]) -> float:
    """The distance of a layout the rules can reach in place of one they cannot (a graph output the target
    keeps on copies): inputs in ``exact_inputs`` as :func:`distance`; the other inputs and the outputs
    only by their number of pieces (copies x shards) and sum degree."""
    if len(cur.inputs) != len(tgt.inputs) or len(cur.outputs) != len(tgt.outputs):
        return INF
    ex = set(exact_inputs)
    d = 0.0
    for i, (a, b) in enumerate(zip(cur.inputs, tgt.inputs)):
        if i in ex:     # weighed above the rest: the activations are what the target's neighbours read
            d += EXACT_WEIGHT * _shape_distance(a, b)
        else:
            d += abs(math.log2(_pieces(a)) - math.log2(_pieces(b))) + abs(math.log2(a.sum_degree) - math.log2(b.sum_degree))
    for a, b in zip(cur.outputs, tgt.outputs):
        d += abs(math.log2(_pieces(a)) - math.log2(_pieces(b))) + abs(math.log2(a.sum_degree) - math.log2(b.sum_degree))
    return d


def _why(cur: NodeLayout, tgt: NodeLayout) -> str:
    parts = []
    for kind, xs, ys in (("input", cur.inputs, tgt.inputs), ("output", cur.outputs, tgt.outputs)):
        for i, (a, b) in enumerate(zip(xs, ys)):
            if a != b:
                parts.append(f"{kind} {i} is {a}, wanted {b}")
    return "; ".join(parts)


# --- the rules: which are parallelizations, how their compute nodes pair -------------------------------------

class _Rules:
    """The book's parallel rules whose two sides hold the same compute operators (with the same attributes),
    indexed by the op of their source pattern's sinks, with each rule's pairing of source to target compute
    nodes and the depth of its source pattern (how far downstream of a matched node its sinks can be)."""

    def __init__(self, book: RuleBook):
        self.book = book
        self.pairing: dict[str, list[tuple[int, int]]] = {}
        self.depth: dict[str, int] = {}
        self.by_sink: dict[str, list[Rule]] = defaultdict(list)
        #: the ops of each rule's source pattern (a rule can only rewrite a node whose op is among them)
        self.ops: dict[str, frozenset] = {}
        for r in book.parallel:
            p = self._pairing(r)
            if p is None:
                continue
            self.pairing[r.name] = p
            self.depth[r.name] = self._depth(r)
            self.ops[r.name] = frozenset(n.op for n in r.source.nodes)
            used = {x[0] for n in r.source.nodes for x in n.inputs if not isinstance(x, str)}
            for i, n in enumerate(r.source.nodes):
                if i not in used:
                    self.by_sink[n.op].append(r)
                    break
        self.max_depth = max(self.depth.values(), default=1)
        #: rules over parallel operators only that leave fewer of them and choose nothing (no free variable):
        #: the cancellations (Partition(Combine(x)) -> x, duplicate placements merged, Partition(Replicate(
        #: Combine(x))) -> Replicate(x), ...), except the AllReduce fusion, which runs at the end
        self.simplify = [r for r in book.parallel if r.name != FUSE_RULE and not r.free_vars()
                         and all(ops.get_op(n.op).kind != "compute" for n in r.source.nodes + r.target.nodes)
                         and len(r.target.nodes) < len(r.source.nodes)]
        #: the same with as many nodes on both sides (Partition(Reduce(x)) -> Reduce(Partition(x)), ...): taken
        #: only where a simplification follows at once (a chain Combine -> Reduce -> Partition then cancels)
        self.commute = [r for r in book.parallel if r.name != FUSE_RULE and not r.free_vars()
                        and all(ops.get_op(n.op).kind != "compute" for n in r.source.nodes + r.target.nodes)
                        and len(r.target.nodes) == len(r.source.nodes) and len(r.source.outputs) == 1]

    @staticmethod
    def _pairing(r: Rule) -> list[tuple[int, int]] | None:
        def comp(p):
            return [(i, n) for i, n in enumerate(p.nodes) if ops.get_op(n.op).kind == "compute"]
        src, tgt = comp(r.source), comp(r.target)
        if len(src) != len(tgt) or not src:
            return None
        free = list(tgt)
        out = []
        for i, n in src:
            for k, (j, m) in enumerate(free):
                if m.op == n.op and m.attrs == n.attrs:
                    out.append((i, j))
                    del free[k]
                    break
            else:
                return None
        return out

    @staticmethod
    def _depth(r: Rule) -> int:
        """Longest path (in nodes) from a source pattern node to a sink."""
        nodes = r.source.nodes
        down: dict[int, int] = {}
        for i in range(len(nodes) - 1, -1, -1):
            users = [j for j in range(i + 1, len(nodes)) for x in nodes[j].inputs
                     if not isinstance(x, str) and x[0] == i]
            down[i] = 1 + max((down[j] for j in users), default=0)
        return max(down.values(), default=1)




def _rules_of(book: RuleBook) -> _Rules:
    got = book.__dict__.get("_realize_rules")
    if got is None:
        got = book._realize_rules = _Rules(book)
    return got


class _Window(GraphIndex):
    """A GraphIndex over given node ids (no pass over the whole graph)."""

    def __init__(self, g: PCG, ids: Iterable[int], outputs: set):
        self.g = g
        self.by_op = defaultdict(list)
        for nid in sorted(ids):
            self.by_op[g.node(nid).op].append(nid)
        self.users = _Users(g)
        self.graph_outputs = outputs
        self._attrs = {}


def _downstream(g: PCG, nid: int, depth: int) -> dict[int, int]:
    """Nodes reachable from ``nid`` by at most ``depth - 1`` edges -> their distance."""
    dist = {nid: 0}
    frontier = [nid]
    for d in range(1, depth):
        nxt = []
        for u in frontier:
            for k in range(len(g.shapes(u))):
                for c, _ in g.consumers((u, k)):
                    if c not in dist:
                        dist[c] = d
                        nxt.append(c)
        frontier = nxt
        if not frontier:
            break
    return dist


def _resolve(v: Any, b: Mapping) -> Any:
    if is_var(v):
        return b[v[1:]]
    if isinstance(v, tuple):
        return tuple(_resolve(x, b) for x in v)
    return v


def preview(g: PCG, m: Match) -> list[NodeLayout] | None:
    """The layouts of the rule's target pattern nodes if ``m`` were applied (shape inference on the
    pattern only; rules keep every output's parallel shape, so nothing downstream changes); None when the
    result is not a valid parallelization."""
    rule = m.rule
    b = m.binding
    ins = m.input_map
    outs: list[tuple] = []
    layouts: list[NodeLayout] = []
    try:
        for pn in rule.target.nodes:
            spec = ops.get_op(pn.op)
            a = spec.normalize_attrs({k: _resolve(v, b) for k, v in pn.attrs})
            shapes = [g.shape(ins[r]) if isinstance(r, str) else outs[r[0]][r[1]] for r in pn.inputs]
            o = tuple(ops.infer(pn.op, a, shapes).outputs)
            outs.append(o)
            layouts.append(NodeLayout(tuple(shapes), o))
        for so, to in zip(rule.source.outputs, rule.target.outputs):
            new = g.shape(ins[to]) if isinstance(to, str) else outs[to[0]][to[1]]
            if g.shape((m.nodes[so[0]], so[1])) != new:
                return None
    except (InvalidParallelization, GraphError, KeyError, ValueError, TypeError):
        return None
    return layouts


def _unreachable_outputs(g: PCG, targets: Mapping[int, NodeLayout]) -> dict[int, tuple[int, ...]]:
    """Compute nodes writing a graph output that the target keeps on copies -> their inputs that are
    activations (not read from Weights or constants).  Rules keep every graph output's parallel shape and
    no parallel operator drops copies, so no rule sequence runs such a node on copies; :func:`realize` then
    takes any layout with as many pieces (the copies as a split: a vocabulary-parallel head) that reads its
    activations as the target does."""
    outs = {tuple(r) for r in g.outputs}
    got = {}
    for nid, t in targets.items():
        if any((nid, k) in outs and s.copy_degree > 1 for k, s in enumerate(t.outputs)):
            acts = tuple(i for i, r in enumerate(g.node(nid).inputs) if not _constant(g, r))
            got[nid] = acts
    return got


def _constant(g: PCG, ref) -> bool:
    """Whether ``ref`` is computed from non-Input sources only (a Weight, a constant)."""
    stack, seen = [tuple(ref)[0]], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        n = g.node(i)
        if n.op == "Input":
            return False
        stack.extend(r[0] for r in n.inputs)
    return True


# --- realize -------------------------------------------------------------------------------------------------

class _State:
    def __init__(self, g: PCG, book: RuleBook, targets: Mapping[int, NodeLayout], deadline: Deadline | None):
        self.g = LiveGraph(g)
        self.book = book
        self.rules = _rules_of(book)
        self.targets = dict(targets)
        self.cur = {nid: nid for nid in targets}          # g id -> current id
        self.inv = {nid: nid for nid in targets}          # current id -> g id
        self.steps: list[RuleStep] = []
        self.deadline = deadline
        self.fuse = book.by_name.get(FUSE_RULE)
        self.touched: set[int] = set()
        self.previews: dict = {}
        self.relaxed = _unreachable_outputs(g, self.targets)

    def preview(self, m: Match) -> list[NodeLayout] | None:
        """:func:`preview`, remembered by what it depends on (rule, bindings, the shapes of the named inputs
        and of the replaced outputs): the layers of a model ask the same questions."""
        g = self.g
        key = (m.rule.name, m.bindings, tuple(g.shape(r) for _, r in m.inputs),
               tuple(None if isinstance(o, str) else g.shape((m.nodes[o[0]], o[1])) for o in m.rule.source.outputs))
        got = self.previews.get(key, self)
        if got is self:
            got = self.previews[key] = preview(g, m)
        return got

    def dist(self, gid: int, layout: NodeLayout | None = None) -> float:
        t = self.targets.get(gid)
        if t is None:
            return 0.0
        cur = layout if layout is not None else NodeLayout.of(self.g, self.cur[gid])
        ex = self.relaxed.get(gid)
        return distance(cur, t) if ex is None else loose_distance(cur, t, ex)

    def degrees(self, gid: int) -> tuple[int, ...]:
        t = self.targets[gid]
        ds: set[int] = set()
        for s in t.inputs + t.outputs:
            for d in [s.sum_degree, s.copy_degree] + [x.degree for x in s.dims]:
                ds.update(k for k in range(2, d + 1) if d % k == 0)
        return tuple(sorted(ds)) or (2,)

    def candidates(self, nid: int, degrees: tuple[int, ...]) -> list[Match]:
        g = self.g
        down = _downstream(g, nid, self.rules.max_depth)
        outputs = {tuple(r) for r in g.outputs}
        by_depth: dict[int, _Window] = {}
        found: list[Match] = []
        seen_ops = {g.node(i).op for i in down}
        mine = g.node(nid).op
        for op in sorted(seen_ops):
            for r in self.rules.by_sink.get(op, ()):
                if mine not in self.rules.ops[r.name]:
                    continue
                dep = self.rules.depth[r.name]
                idx = by_depth.get(dep)
                if idx is None:
                    idx = by_depth[dep] = _Window(g, [i for i, d in down.items() if d < dep], outputs)
                if op not in idx.by_op:
                    continue
                for m in iter_matches(r, g, idx, None, degrees):
                    if nid in m.nodes:
                        found.append(m)
        return found

    def step_for(self, gid: int) -> bool:
        """Apply the best rule step for node ``gid``; False when none brings it closer."""
        g = self.g
        nid = self.cur[gid]
        d0 = self.dist(gid)
        best = None
        for order, m in enumerate(self.candidates(nid, self.degrees(gid))):
            lays = self.preview(m)
            if lays is None:
                continue
            pairing = self.rules.pairing[m.rule.name]
            focus_new = None
            before = after = 0.0
            ok = True
            for i, j in pairing:
                src = m.nodes[i]
                sg = self.inv.get(src)
                if sg is None:
                    continue
                old = self.dist(sg)
                new = self.dist(sg, lays[j])
                if old == 0 and new > 0:
                    ok = False
                    break
                before += old
                after += new
                if src == nid:
                    focus_new = new
                    if sg not in self.relaxed and _outputs_farther(NodeLayout.of(g, nid), lays[j], self.targets[sg]):
                        ok = False
                        break
            if not ok or focus_new is None or focus_new >= d0 or after > before:
                continue
            key = (focus_new, after - before, len(m.nodes), order)
            if best is None or key < best[0]:
                best = (key, m)
        if best is None:
            return False
        return self.apply(best[1])

    def apply(self, m: Match) -> bool:
        fresh = self.g.apply(m)
        if fresh is None:
            return False
        for i, j in self.rules.pairing[m.rule.name]:
            src = m.nodes[i]
            gid = self.inv.pop(src, None)
            if gid is not None:
                self.cur[gid] = fresh[j]
                self.inv[fresh[j]] = gid
        self.steps.append(RuleStep.of(m))
        self.touched.update(fresh)
        self.cancel(set(fresh))
        return True

    def cancel(self, around: set) -> None:
        """The simplifications (and commutations a simplification follows) around the nodes ``around``."""
        g = self.g
        w = {i for i in around if i in g}
        w |= {i[0] for k in list(w) for i in g.node(k).inputs}
        w |= {c for i in list(w) for kk in range(len(g.shapes(i))) for c, _ in g.consumers((i, kk))}
        while True:
            w, _ = self._simplify(w, self.rules.simplify)
            w2 = self._commute(w)
            if w2 is None:
                break
            w = w2
        self._check_kept()

    def _grow(self, w: set, fresh: list) -> set:
        g = self.g
        self.touched.update(fresh)
        w |= set(fresh)
        w |= {c for i in fresh for k in range(len(g.shapes(i))) for c, _ in g.consumers((i, k))}
        w |= {i[0] for k in fresh for i in g.node(k).inputs}
        return w

    def _simplify(self, w: set, rules: list, limit: int | None = None) -> tuple[set, int]:
        """Apply ``rules`` in the window ``w`` until none matches (at most ``limit`` steps)."""
        g = self.g
        outputs = {tuple(r) for r in g.outputs}
        n = 0
        while limit is None or n < limit:
            idx = _Window(g, [i for i in w if i in g], outputs)
            for r in rules:
                done = False
                for m in list(iter_matches(r, g, idx, None, (2,))):
                    fresh = g.apply(m)
                    if fresh is None:
                        continue
                    self.steps.append(RuleStep.of(m))
                    w = self._grow(w, fresh)
                    outputs = {tuple(r) for r in g.outputs}
                    n += 1
                    done = True
                    break
                if done:
                    break
            else:
                break
        return w, n

    def _commute(self, w: set) -> set | None:
        """One commutation of parallel operators in ``w`` that a simplification follows (both applied): the
        window after them, or None (graph unchanged)."""
        g = self.g
        outputs = {tuple(r) for r in g.outputs}
        # only chains of three parallel operators can hold a pair to cancel that a commutation brings together
        chains = [i for i in w if i in g and g.node(i).kind == "parallel"
                  and g.node(g.node(i).inputs[0][0]).kind == "parallel"
                  and g.node(g.node(g.node(i).inputs[0][0]).inputs[0][0]).kind == "parallel"]
        if not chains:
            return None
        idx = _Window(g, chains + [g.node(i).inputs[0][0] for i in chains], outputs)
        for r in self.rules.commute:
            for m in list(iter_matches(r, g, idx, None, (2,))):
                touched = set(self.touched)
                fresh = g.apply(m)
                if fresh is None:
                    continue
                nsteps = len(self.steps)
                self.steps.append(RuleStep.of(m))
                w1 = self._grow(set(w), fresh)
                w2, n = self._simplify(w1, self.rules.simplify, limit=1)
                if n:
                    return w2
                del self.steps[nsteps:]
                self.touched = touched
                g.undo()
        return None

    def _check_kept(self) -> None:
        g = self.g
        for cid in self.inv:
            if cid not in g:       # cancel rules move parallel operators only
                raise RealizeError(f"a cancel rule removed compute node {cid}")

    def reduce_then_split(self) -> None:
        """Every ``Reduce(Partition(x, d, k), k)`` the steps left (a Partition read only by the sum) written as
        ``Partition(Reduce(x, k), d, k)`` by a proven commute rule: the same values, one reduce-scatter as the
        cost model prices it and the executor runs it (the sums of a row-parallel operator scattered over the
        devices that hold them, instead of split onto more devices and then summed)."""
        g = self.g
        rules = _reduce_first_rules(self.book)
        if not rules:
            return
        outputs = {tuple(r) for r in g.outputs}
        for rid in sorted(i for i in self.touched if i in g and g.node(i).op == "Reduce"):
            if rid not in g:
                continue
            p = g.node(rid).inputs[0][0]
            if g.node(p).op != "Partition" or g.node(p).a["degree"] != g.node(rid).a["degree"]:
                continue
            for r in rules:
                m = next((m for m in iter_matches(r, g, _Window(g, [p, rid], outputs), None, (2,))
                          if set(m.nodes) == {p, rid}), None)
                if m is None:
                    continue
                fresh = g.apply(m)
                if fresh is not None:
                    self.steps.append(RuleStep.of(m))
                    self.touched.update(fresh)
                    break

    def finish(self) -> None:
        """Cancellations over every node the steps touched, gathers that a later split undoes sunk to it and
        cancelled (:func:`search.substitution.sink_combines`: a batch gather before a feature gather, a gather
        before a sum), then each Reduce -> Replicate fused."""
        g = self.g
        self.cancel({i for i in self.touched if i in g})

        def step(h, m):
            fresh = h.apply(m)
            if fresh is None:
                return None
            self.touched.update(fresh)
            return h, fresh
        sink_combines(g, self.book, [i for i in self.touched if i in g], step,
                      lambda h, ids: _Window(h, ids, {tuple(r) for r in h.outputs}), self.steps)
        self.reduce_then_split()
        if self.fuse is None:
            return
        reps = sorted(i for i in self.touched if i in g and g.node(i).op == "Replicate")
        while reps:
            for m in list(iter_matches(self.fuse, g, _Window(g, reps, {tuple(r) for r in g.outputs}), None, (2,))):
                fresh = g.apply(m)
                if fresh is not None:
                    self.steps.append(RuleStep.of(m))
                    self.touched.update(fresh)
                    reps = sorted([i for i in reps if i in g] + [i for i in fresh if g.node(i).op == "Replicate"])
                    break
            else:
                return


def _reduce_first_rules(book: RuleBook) -> list[Rule]:
    """The book's unconstrained ``Reduce(Partition(x, d, k), k) -> Partition(Reduce(x, k), d, k)`` rules, found
    by their patterns (one input, no free variable)."""
    got = book.__dict__.get("_reduce_first")
    if got is None:
        got = []
        for r in book.parallel:
            s, t = r.source.nodes, r.target.nodes
            if (not r.constraints and not r.free_vars() and len(r.inputs) == 1
                    and [n.op for n in s] == ["Partition", "Reduce"] and [n.op for n in t] == ["Reduce", "Partition"]
                    and s[0].inputs == r.inputs and t[0].inputs == r.inputs):
                got.append(r)
        book._reduce_first = got
    return got


def realize(g: PCG, target: PCG | Mapping[int, NodeLayout], book: RuleBook | None = None, *,
            deadline: Deadline | None = None) -> Realized:
    """Rewrite ``g`` by rules of ``book`` until every compute node has its layout in ``target`` (a PCG
    parallelizing ``g``: :func:`layout_of`; or layouts keyed by ``g``'s compute node ids).  Never raises
    for a layout it cannot reach: ``complete`` is False and ``missing`` says which nodes and why.
    ``deadline``: checked before every step (and by the rule matching under it); when it passes the
    result so far is returned (``missing`` says so)."""
    t0 = time.perf_counter()
    book = book or RuleBook()
    targets = layout_of(target, g) if isinstance(target, PCG) else dict(target)
    for nid in targets:
        if nid not in g or g.node(nid).kind != "compute":
            raise RealizeError(f"target layout for node {nid}, which is not a compute node of the graph")
    st = _State(g, book, targets, deadline)
    order = [nid for nid in g.topo_order() if nid in targets]
    expired = False
    try:
        with within(deadline):
            for sweep in range(MAX_SWEEPS):
                changed = False
                for gid in (order if sweep % 2 == 0 else reversed(order)):
                    for _ in range(MAX_STEPS_PER_NODE):
                        if deadline is not None:
                            deadline.check()
                        if st.dist(gid) == 0 or not st.step_for(gid):
                            break
                        changed = True
                if not changed and sweep > 0:
                    break
            st.finish()
    except Expired:
        expired = True
    missing = []
    for gid in order:
        cur = NodeLayout.of(st.g, st.cur[gid])
        if distance(cur, targets[gid]) == 0:
            continue
        if st.dist(gid) > 0:
            why = "the deadline passed" if expired else "no rule brings it closer"
            if gid in st.relaxed:
                why += (" (and the target keeps its output, a graph output, on copies, which no rule reaches: no "
                        "parallel operator drops copies)")
        else:
            why = ("the target keeps its output, a graph output, on copies, which no rule reaches (no parallel "
                   "operator drops copies); laid out with as many pieces instead")
        missing.append(f"{g.node(gid).label()} ({g.node(gid).op}): {why}: {_why(cur, targets[gid])}")
    return Realized(st.g.freeze(), st.steps, not missing, missing, dict(st.cur), time.perf_counter() - t0)


# --- never slower than the fallback ---------------------------------------------------------------------------

def devices_of(layouts: Mapping[int, NodeLayout]) -> int:
    """The most pieces (copies x shards x partial sums) any compute node of ``layouts`` writes: the devices
    the layout spans."""
    return max((s.copy_degree * s.shard_degree * s.sum_degree for t in layouts.values() for s in t.outputs),
               default=1)


def fallback_regions(g: PCG, targets: Mapping[int, NodeLayout], fallback: Mapping[int, NodeLayout],
                     missing: Iterable[int]) -> set[int]:
    """The compute nodes to lay out as ``fallback`` so that the nodes in ``missing`` (which the rules do not
    bring to ``targets``) take the fallback's layouts with no new resharding at the border: from ``missing``,
    a neighbour (the other end of a tensor between two compute nodes) joins while the tensor between them
    has different parallel shapes in ``targets`` and ``fallback`` (a border there would reshard what the
    target did not) and its own layouts differ in the two.  The rest keeps the target's layouts."""
    region = {n for n in missing if n in fallback}
    stack = list(region)
    while stack:
        u = stack.pop()
        for k in range(len(g.shapes(u))):
            for v, pos in g.consumers((u, k)):
                if v in targets and v in fallback and v not in region \
                        and targets[v].inputs[pos] != fallback[v].inputs[pos] and targets[v] != fallback[v]:
                    region.add(v)
                    stack.append(v)
        for pos, r in enumerate(g.node(u).inputs):
            v = r[0]
            if v in targets and v in fallback and v not in region \
                    and targets[u].inputs[pos] != fallback[u].inputs[pos] and targets[v] != fallback[v]:
                region.add(v)
                stack.append(v)
    return region


def settle(g: PCG, target: PCG | Mapping[int, NodeLayout], price: Callable[[PCG], float],
           book: RuleBook | None = None, *, fallback: PCG | Mapping[int, NodeLayout] | None = None,
           deadline: Deadline | None = None) -> Realized:
    """:func:`realize`, never priced slower than ``fallback`` where the rules do not reach the whole target.

    ``price``: the caller's price of a plan (called on :func:`search.substitution.trimmed` of a realized
    PCG; lower is better).  ``fallback``: the layouts the caller would use otherwise (a PCG parallelizing
    ``g``, or layouts by ``g``'s compute node ids); default data parallelism over the target's devices
    (:func:`devices_of`), none where the batch does not divide.  A complete realization is returned as it
    is (priced).  Otherwise the cheapest of: the partial realization; the target with the
    :func:`fallback_regions` of the nodes the rules missed at the fallback's layouts; the fallback itself
    -- each reached by rules (``chosen`` says which, ``complete`` and ``missing`` still describe the
    target's).  The deadline bounds the whole; what it cuts is not a choice."""
    from .substitution import trimmed
    t0 = time.perf_counter()
    book = book or RuleBook()
    targets = layout_of(target, g) if isinstance(target, PCG) else dict(target)
    first = realize(g, targets, book, deadline=deadline)
    first.price = price(trimmed(first.pcg))
    if first.complete:
        return first
    if fallback is None:
        from . import baselines
        try:
            fallback = baselines.data_parallel(g, devices_of(targets))
        except UnityError:
            return first
    fb = layout_of(fallback, g) if isinstance(fallback, PCG) else dict(fallback)
    missed = [gid for gid in targets if gid in first.ids and NodeLayout.of(first.pcg, first.ids[gid]) != targets[gid]]
    region = fallback_regions(g, targets, fb, missed)
    options = [(first, "target")]
    blends = []
    if region and len(region) < len(targets):
        blends.append(({gid: fb[gid] if gid in region else t for gid, t in targets.items()},
                       f"target, {len(region)} nodes at the fallback"))
    blends.append((fb, "fallback"))
    for layouts, name in blends:
        if deadline is not None and deadline.passed():
            break
        r = realize(g, layouts, book, deadline=deadline)
        if deadline is not None and deadline.passed():
            break
        r.price = price(trimmed(r.pcg))
        options.append((r, name))
    best, name = min(options, key=lambda o: o[0].price)
    return Realized(best.pcg, best.steps, first.complete, first.missing, best.ids, time.perf_counter() - t0,
                    chosen=name, price=best.price)


__all__ = ["NodeLayout", "Realized", "RealizeError", "realize", "layout_of", "pair_nodes", "distance", "preview",
           "settle", "fallback_regions", "devices_of"]
