"""The machine-mapping dynamic program (Unity section 5.2).

Given a PCG (its parallelization fixed) and a machine, choose a machine view for every node so that
the predicted iteration time is minimal.  The PCG is decomposed into a series-parallel tree of units
(:mod:`search.sp`); the DP walks it:

* ``Leaf(unit)``: the unit's main node takes each of its views in the current resource; each
  placement node feeding it takes the view minimizing its own cost plus the edges into the main
  node (independent given the main node's view); the leaf's cost is :meth:`GraphCost.leaf_cost` of
  its nodes.
* ``Series(c1..ck)``: a left-to-right pass.  After child i the *state* is the views of the nodes of
  c1..ci that later children read (the boundary of a sequence split; for a post-dominator split it
  is just the post-dominator); each child is solved once per state and per combination of views of
  its own boundary nodes.  Series cost = sum.
* *Joins.*  When a child's boundary has two or more nodes and all of them are read only by the main
  node J of the next child (a k-way parallel split followed by the concat / add that reads every
  branch), the two are solved together: for each state and each view vJ of J, J's edges from
  the child decompose per boundary node, so the child is priced by its Pareto front of (child
  cost, cost of its edges into J).  A parallel split combines its branches' fronts (costs add one
  after the other and take the max side by side; edge costs always add); a branch's points come
  from one series pass whose final states are keyed by the branch end's view.  The optimum is
  the front's least cost + edges -- exact, without enumerating the V^k combinations of branch-end
  views.  Side-by-side splits whose lower bound (compute of the larger side plus the least
  possible edges) reaches the all-one-after-the-other value are skipped.
* ``Parallel(a, b)``: either one after the other on the whole resource (sum), or side by side on a
  split of the resource by *quantity* -- whole nodes, or devices inside one node, both orientations
  (max).  No interleaving of the two (as in Unity).  On a machine whose devices share cores (local
  processes) side by side adds instead (:meth:`CostModel.side_by_side`: the branches compete for
  the same cores).

Memoization.  :class:`MachineMapper` keeps one cache per machine and cost model across calls,
keyed by (subtree key, resource, the views fixed for the subtree's boundary), the last two taken
relative to the resource's first node: moving a subproblem by whole nodes moves its optimum (costs
depend only on which devices share a group or a node), so a hit is shifted back.  The subtree key is
built from the PCG's node hashes (which hash a node's operator, attributes and, transitively, its
inputs), so a candidate PCG produced by a substitution reuses every subproblem upstream of the
rewritten region.  Views are remembered by node hash and translated back to node ids per graph.

Complexity: each series child is solved once per (state, combination of its boundary views), so a
boundary of k nodes with V views each costs V^k -- except at joins (above), where a k-way split costs
about k * V^2 series passes per view of the join and per state.  Data-parallel PCGs at full degree have
V = 1-2; smaller degrees (V ~ 7 for degree 6 on 24 devices) are the expensive case
(benchmarks/results/machine_mapping.md, dp_join.md).

Memory: ``optimize`` returns the fastest mapping that fits the devices' memory.  The time DP runs
first; when its mapping fits (the common case) that is the answer, at no extra cost.  Otherwise
:func:`search.memory.memory_lower_bound` may show at once that no mapping fits (a data-parallel graph
whose replicas are too large: every view of a full-degree node puts the same bytes on every device);
else the memory-aware DP (:class:`_MemoryDP`, the same recursion over the same tree) keeps per
subproblem a Pareto front of (time, memory per device) and returns the fastest point that fits.
Memory is a *vector* (bytes per device), not a scalar peak: per device it is a sum over nodes, so
vectors add exactly in series and side by side (disjoint devices), while a scalar peak composes
exactly only side by side (max) and in series only as an upper bound (the sum of peaks) -- with it, a
chain of layers placed one per device, the very mapping a model too large for one device needs, would
look as large as all layers on one device (a scalar memory per subproblem is, as far as we read it,
what flexflow-train's memory-aware DP keeps).  Fronts drop dominated points and points already over
capacity; past ``front_limit`` points (default 16) they keep the (time, busiest device) front first;
side-by-side splits are tried where they could be faster, as in the time DP (see :class:`_MemoryDP`).
So the search agrees with ``exhaustive_mapping(memory=True)`` on the small graphs of the tests and is
a well-founded approximation beyond.  Cost: nothing when the time-optimal mapping fits; else 3-7x the
time DP alone in CPU time (benchmarks/memory_dp_bench.py), ~16x (80 s) on Inception-v3 at degree 6
on 24 devices, where the time DP's subproblems are many.  When nothing fits the result is
infeasible (``cost = inf``) and its reason names the busiest device of the fastest mapping and how
much it is over capacity.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Mapping

import numpy as np

from unity_pcg.machine import MachineSpec, MachineView, Resource
from unity_pcg.pcg import PCG

from .budget import Expired, check as _check_deadline
from .cost import CostModel, GraphCost, LeafCost
from .memory import MemoryReport, format_bytes, memory_lower_bound, memory_per_device, node_memory
from .sp import Decomposition, Leaf, Parallel, Series, decompose, tree_units

INF = math.inf


@dataclass
class MappingResult:
    cost: float                          # predicted iteration time (s); inf if infeasible
    views: dict                          # node id -> MachineView (every non-source node)
    breakdown: LeafCost                  # sums over leaves (compute, comm, sync, update, elements)
    memory: MemoryReport | None
    feasible: bool
    reason: str
    devices: int
    solve_s: float
    stats: dict = field(default_factory=dict)
    decomposition: Decomposition | None = None    # the DP's (optimize); None from evaluate (no DP)
    # priced with memory techniques and overlap (optimize / evaluate with techniques=True): the chosen
    # unity_pcg.plan.MemoryPlan and its search.memtech.Priced; then ``cost`` and ``memory`` are theirs
    memory_plan: Any = None
    techniques: Any = None

    def to_json(self) -> dict:
        b = self.breakdown
        mem = self.memory
        out = {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
               "feasible": self.feasible, "reason": self.reason, "devices": self.devices,
               "comm_elements": b.comm_elements,
               "max_memory_bytes": mem.max_bytes if mem else None,
               "breakdown": {"compute_s": b.compute, "comm_s": b.comm, "grad_sync_s": b.sync,
                             "update_s": b.update, "sum_of_leaves_s": b.time},
               "memory_per_device": {str(d): v for d, v in sorted(mem.per_device.items())} if mem else {},
               "solve_s": self.solve_s, "stats": dict(self.stats)}
        if self.techniques is not None:
            out.update(self.techniques.to_json())
            out["breakdown"].update(self.techniques.to_json())
            if self.memory_plan is not None and not self.memory_plan.empty:
                out["memory_plan"] = self.memory_plan.to_json()
        return out


class _Ctx:
    """Per-graph data for one DP run."""

    def __init__(self, g: PCG, gc: GraphCost, dec: Decomposition, facts: dict | None = None):
        self.g, self.gc, self.dec = g, gc, dec
        counts: dict = {}
        self.h: dict[int, str] = {}
        for nid in g.topo_order():
            base = g.node_hash(nid)
            k = counts.get(base, 0)
            counts[base] = k + 1
            self.h[nid] = base if k == 0 else f"{base}#{k}"
        self.by_hash = {v: k for k, v in self.h.items()}
        self.reads: dict[int, set] = {}                    # node -> nodes whose views its leaf reads
        for u in dec.units:
            for nid in u:
                self.reads[nid] = {p for _, p in gc.priced_inputs(nid)}
        self.nodes: dict[int, frozenset] = {}              # id(tree) -> nodes in it
        self.relevant: dict[int, frozenset] = {}           # id(tree) -> nodes + external producers
        self.relsorted: dict[int, list] = {}               # id(tree) -> (node, hash) by hash, small trees
        self.key: dict[int, str] = {}
        self.need: dict[int, int] = {}
        # computed on first use (:class:`_OnDemand`): a subtree inside one whose key hits (a model's repeated
        # blocks after the first) is never solved, so its lower bound, boundaries and keys are never needed
        self.lb: dict[int, float] = _OnDemand(self._lower_bound)
        self.boundary: dict[int, list] = _OnDemand(self._boundaries)   # id(series) -> per child: (outs, live_after)
        self.join: dict[tuple, int] = {}                   # (id(series), i) -> main node of child i+1 (with boundary)
        self._tree: dict[int, Any] = {}                    # id(tree) -> the subtree
        self.fronts: dict = {}                             # memo of MachineMapper._front / _open
        self._views: dict = {}
        self._edges: dict = {}
        self._cedges: dict = {}                            # edges by nodes renumbered (see edge)
        self._pin: dict = {}
        self.feed: dict = {}                               # (placement, main view, resource, fixed) -> best
        self.dpn = gc.model.machine.devices_per_node
        # local keys (see LOCAL_KEYS): per subtree its nodes and external producers by id, the key, and the
        # names (self.h) of its own nodes in that order, which a hit from an identical subtree renames
        self._facts = facts
        self.lorder: dict[int, tuple] = {}
        self.lkey: dict[int, str] = {}
        self.lnames: dict[int, tuple] = {}
        self.lpos: dict[int, dict] = {}                    # id(tree) -> node -> position in lorder
        self._fid: dict[int, int] = {}                     # node -> interned leaf / producer facts
        self._salt = (gc._sync_bytes, gc._buffer_bytes)     # graph-wide sums own_cost reads
        # per node, what a local key reads of it: its inputs, the producers its leaf prices
        self._ins: dict[int, tuple] = {}
        self._pprod: dict[int, tuple] = {}
        for u in dec.units:
            for nid in u:
                self._ins[nid] = tuple(g.node(nid).inputs)
                self._pprod[nid] = tuple(p for _, p in self.priced_inputs(nid))
        self._ext: dict[int, set] = {}                     # id(tree) -> external reads (while prepping)
        self._flat: dict[int, list] = {}                   # id(tree) -> its shape, flat, over node ids
        self._ct: dict[int, float] = {}                    # node -> compute_time (the lower bounds' terms)
        self._prep(dec.tree)
        self._ext.clear()

    def views(self, n: int, res: Resource) -> list:
        key = (self.gc.grid[n], res)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self.gc.views(n, res)
        return v

    def edge(self, n: int, pos: int, pv: MachineView, v: MachineView) -> float:
        # moving both views by whole nodes does not change the cost (see MachineMapper._solve)
        off = (min(pv.start, v.start) // self.dpn) * self.dpn
        key = (n, pos, pv.start - off, pv.dims, v.start - off, v.dims)
        e = self._edges.get(key)
        if e is None:
            # nor does renumbering the nodes the two views touch in the same order (costs depend on
            # which devices are equal or share a group or a node, and on device order where a nearest
            # holder is chosen): a producer in node 0 and a consumer in node 5 cost what they cost in
            # nodes 0 and 1 -- on a large machine most pairs of views are such a renumbering of another
            ck = (n, pos) + _renumbered(pv, v, self.dpn) if CANON_EDGES else None
            e = self._cedges.get(ck) if ck is not None else None
            if e is None:
                if off:
                    pv, v = MachineView(pv.start - off, pv.dims), MachineView(v.start - off, v.dims)
                e = self.gc.edge_cost(n, pos, pv, v).time
                if ck is not None:
                    self._cedges[ck] = e
            self._edges[key] = e
        return e

    def priced_inputs(self, n: int) -> list:
        p = self._pin.get(n)
        if p is None:
            p = self._pin[n] = self.gc.priced_inputs(n)
        return p

    def _fact_id(self, n: int, own: bool) -> int:
        """Interned :meth:`GraphCost.leaf_facts` (``own``) or :meth:`GraphCost.producer_facts` of ``n``."""
        k = (n, own)
        f = self._fid.get(k)
        if f is None:
            facts = ("own", self.gc.leaf_facts(n)) if own else ("ext", self.gc.producer_facts(n))
            f = self._facts.get(facts)
            if f is None:
                f = self._facts[facts] = len(self._facts)
            self._fid[k] = f
        return f

    def _local_key(self, t, ns: frozenset, rel: frozenset) -> None:
        """The key of subtree ``t`` up to renaming its nodes: its nodes and the producers outside it that
        its leaves read, in id order (the order every tie-break of the DP follows), each by its interned
        facts and its inputs by position in that order; the tree's shape over those positions (its flat
        form, :attr:`_flat`); the graph's salt.  Two subtrees with equal keys have the same optimum for the
        same fixed views (by position), the same floats, the corresponding views."""
        order = sorted(rel)
        pos = {n: i for i, n in enumerate(order)}
        get = pos.get
        fid, fact, ins, pin = self._fid, self._fact_id, self._ins, self._pprod
        desc = []
        for n in order:
            if n in ns:
                f = fid.get((n, True))
                desc.append((fact(n, True) if f is None else f, tuple([(get(r, -1), k) for r, k in ins[n]]),
                             tuple([pos[p] for p in pin[n]])))
            else:
                f = fid.get((n, False))
                desc.append(fact(n, False) if f is None else f)
        shape = tuple([x if x.__class__ is str else pos[x] for x in self._flat[id(t)]])
        raw = repr((self._salt, desc, shape))
        self.lkey[id(t)] = "l" + hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()
        self.lorder[id(t)] = tuple(order)
        h = self.h
        self.lnames[id(t)] = tuple([h[n] for n in order if n in ns])

    def local_key(self, t) -> str | None:
        """Subtree ``t``'s local key (:meth:`_local_key`, computed on first use; ``lorder`` and ``lnames``
        with it), None where it has none (over ``LOCAL_LIMIT``, or local keys off)."""
        k = self.lkey.get(id(t))
        if k is None and self._facts is not None and LOCAL_KEYS and id(t) in self._flat:
            self._local_key(t, self.nodes[id(t)], self.relevant[id(t)])
            k = self.lkey[id(t)]
        return k

    def sorted_relevant(self, t) -> list | None:
        """Subtree ``t``'s nodes and read producers as (node, name) sorted by name; None over 64 of them."""
        hit = self.relsorted.get(id(t))
        if hit is None and len(self.relevant[id(t)]) <= 64:
            hit = self.relsorted[id(t)] = sorted(((n, self.h[n]) for n in self.relevant[id(t)]), key=lambda x: x[1])
        return hit

    def _lower_bound(self, k: int) -> float:
        """A lower bound of the subtree's cost on any resource: the compute of its compute nodes (it does
        not depend on the view: devices are identical); summed in its node set's order."""
        ct, f = self._ct, self.gc.compute_time
        for n in self.nodes[k]:
            if n not in ct:
                ct[n] = f(n)
        return sum([ct[n] for n in self.nodes[k]])

    def _prep(self, t) -> None:
        """Per subtree (children first): its nodes, the producers its leaves read, its subtree key and degree
        need, and (up to ``LOCAL_LIMIT``) its shape over node ids for a local key.  Linear per tree level:
        a subtree's external reads, need and shape are its children's combined.  Keys, lower bounds and
        boundaries are computed when the DP first asks (:meth:`local_key`, :class:`_OnDemand`)."""
        self._tree[id(t)] = t
        if isinstance(t, Leaf):
            unit = self.dec.units[t.unit]
            ns = frozenset(unit)
            key = "L" + ",".join(self.h[n] for n in unit)
            ext = set()
            for n in unit:
                ext |= self.reads[n]
            need = max((_deg(self.gc, n) for n in unit), default=1)
            rel = frozenset(ns | ext)
            flat = ["L", *unit, ")"]
        else:
            kids = t.children if isinstance(t, Series) else (t.left, t.right)
            for c in kids:
                self._prep(c)
            ns = frozenset().union(*(self.nodes[id(c)] for c in kids))
            key = ("S(" if isinstance(t, Series) else "P(") + ";".join(self.key[id(c)] for c in kids) + ")"
            ext = set().union(*(self._ext.pop(id(c)) for c in kids))
            need = max(self.need[id(c)] for c in kids)
            rel = frozenset(ns | ext)
            flat = None
            if len(rel) <= LOCAL_LIMIT:
                flat = ["S" if isinstance(t, Series) else "P"]
                for c in kids:
                    flat.extend(self._flat[id(c)])
                flat.append(")")
        self.nodes[id(t)] = ns
        self.relevant[id(t)] = rel
        self._ext[id(t)] = ext
        self.key[id(t)] = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        if flat is not None and len(rel) <= LOCAL_LIMIT:
            self._flat[id(t)] = flat
        self.need[id(t)] = need

    def _boundaries(self, k: int) -> list:
        """Series ``k``'s per child (boundary outputs, alive after it); its joins into :attr:`join`."""
        kids = self._tree[k].children
        reads = self.reads
        info = []
        # last[n]: the last child whose nodes read n (n is read by children > i iff last[n] > i); the
        # nodes of children <= i read after child i are kept incrementally (linear in the series)
        last: dict = {}
        for j, c in enumerate(kids):
            for n in self.nodes[id(c)]:
                for p in reads[n]:
                    last[p] = j
        ends: dict = {}
        alive: set = set()
        for i, c in enumerate(kids):
            outs = sorted(n for n in self.nodes[id(c)] if last.get(n, -1) > i)
            alive.difference_update(ends.pop(i, ()))
            for n in outs:
                alive.add(n)
                ends.setdefault(last[n], []).append(n)
            info.append((outs, frozenset(alive)))
        # children i whose boundary nodes (two or more) are read only by the main node of the
        # next child, a leaf: the pair (i, i+1) is solved jointly (see MachineMapper._series_join)
        for i in range(len(kids) - 1):
            outs = info[i][0]
            j = kids[i + 1]
            if len(outs) < 2 or not isinstance(j, Leaf):
                continue
            unit = self.dec.units[j.unit]
            jmain = unit[-1]
            if any(last.get(n, -1) > i + 1 for n in outs):
                continue                                 # read again after the join
            if any(n in reads[m] for n in outs for m in unit[:-1]):
                continue
            if not set(outs) <= reads[jmain] or not set(info[i + 1][0]) <= {jmain}:
                continue
            self.join[(k, i)] = jmain
        return info


class _OnDemand(dict):
    """A dict whose missing entries ``make(key)`` computes and keeps (``d[key]``)."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        v = self[key] = self._make(key)
        return v


#: key the time DP's subproblems up to renaming their nodes (:meth:`_Ctx._local_key`), so a model's identical
#: blocks are solved once (off: by the subtree hash, which includes everything upstream: the reference)
LOCAL_KEYS = True
#: subtrees with more nodes and read producers than this keep the subtree hash (a key costs its size)
LOCAL_LIMIT = 400


#: price an edge once per renumbering of the nodes its two views touch (:meth:`_Ctx.edge`; off: once per
#: pair of views up to a shift by whole nodes, the reference the tests compare with)
CANON_EDGES = True


def _renumbered(pv: MachineView, v: MachineView, dpn: int) -> tuple:
    """The devices of ``pv`` and ``v`` (task order) with the nodes they touch renumbered 0, 1, .. in
    increasing order (a device keeps its place inside its node)."""
    a, b = pv.devices(), v.devices()
    nodes = sorted({d // dpn for d in a} | {d // dpn for d in b})
    if nodes[-1] == len(nodes) - 1:
        return (a, b)                    # already 0, 1, ..
    r = {x: i * dpn for i, x in enumerate(nodes)}
    return (tuple(r[d // dpn] + d % dpn for d in a), tuple(r[d // dpn] + d % dpn for d in b))


def _deg(gc: GraphCost, n: int) -> int:
    d = 1
    for x in gc.grid[n]:
        d *= x
    return d


class MachineMapper:
    """Finds optimal machine views; one instance per (machine, cost model), reused across PCGs."""

    def __init__(self, model: CostModel, front_limit: int = 16, techniques: bool = False):
        self.model = model
        # price mappings with the memory techniques and overlap by default (search.memtech); a call's
        # ``techniques`` argument overrides it (the pipeline search prices stages without)
        self.default_techniques = techniques
        self.machine: MachineSpec = model.machine
        self.cache: dict = {}
        self.mcache: dict = {}               # the memory-aware DP's subproblems (fronts)
        self.fcache: dict = {}               # the time DP's join fronts by local key (_front)
        self.front_limit = front_limit       # most points a memory-aware front keeps (see _mselect)
        self._inside_memo: dict = {}
        self._facts: dict = {}               # leaf / producer facts -> small int (local keys, see _Ctx)
        self.hits = 0
        self.misses = 0

    # --- public -------------------------------------------------------------------------------
    def optimize(self, g: PCG, resource: Resource | None = None,
                 fixed: Mapping[int, MachineView] | None = None, techniques: bool | None = None) -> MappingResult:
        """The fastest mapping of ``g`` (that fits).  ``fixed``: views some nodes must take; by default
        the placements a fixed strategy pinned in ``g.meta["pinned"]`` (expert's embedding tables,
        :func:`search.baselines.pinned_views`).  ``techniques``: price the mapping with the memory
        techniques and the machine's overlap (:mod:`search.memtech`, :meth:`_with_techniques`)."""
        t0 = time.perf_counter()
        h0, m0 = self.hits, self.misses
        gc = GraphCost(g, self.model)
        dec = decompose(g, gc.role)
        ctx = _Ctx(g, gc, dec, self._facts)
        setup_s = time.perf_counter() - t0
        res = resource or Resource.whole(self.machine)
        if fixed is None:
            from .baselines import pinned_views
            fixed = pinned_views(g, self.machine)
        fixed = {n: v for n, v in fixed.items() if n in g}
        cost, assign = self._solve(ctx, dec.tree, res, fixed)
        views: dict[int, MachineView] = {}
        if math.isfinite(cost):
            for hsh, v in _flatten(assign):
                views[ctx.by_hash[hsh]] = v
        stats = {"cache_hits": self.hits - h0, "cache_misses": self.misses - m0, "cache_size": len(self.cache),
                 "series_parallel": dec.is_sp, "units": len(dec.units), "setup_s": setup_s}
        out = self._finish(g, gc, dec, cost, views, t0, stats)
        if techniques is None:
            techniques = self.default_techniques
        if techniques:
            return self._with_techniques(ctx, res, out, t0, stats, fixed, cost)
        if out.feasible or out.memory is None:
            return out                      # the time-optimal mapping fits (or no view fits at all)
        return self._memory_aware(ctx, res, out, t0, stats, fixed)

    def _with_techniques(self, ctx: _Ctx, res: Resource, fastest: MappingResult, t0: float, stats: dict,
                         fixed, cost: float) -> MappingResult:
        """The time-optimal mapping priced with its cheapest feasible memory techniques
        (:func:`search.memtech.choose`); when it does not fit without them, also the memory DP's mapping
        (which fits without them) with its own, and the faster of the two feasible ones."""
        if fastest.memory is None:
            return fastest
        a = self.techniques(ctx.gc, fastest, cost)
        if fastest.feasible:
            return a
        b = self._memory_aware(ctx, res, fastest, t0, stats, fixed)
        if b.feasible:
            b = self.techniques(ctx.gc, b)
            if b.feasible and (not a.feasible or b.cost < a.cost):
                return b
        if a.feasible:
            return a
        return dataclasses.replace(a, reason=b.reason or a.reason)

    def techniques(self, gc: GraphCost, r: MappingResult, base: float | None = None) -> MappingResult:
        """``r`` priced with :func:`search.memtech.choose`: cost, memory and feasibility with the chosen
        MemoryPlan (``memory_plan``, ``techniques``).  ``base``: the mapping's cost without them (default
        ``r.cost``, else the sum of its leaves)."""
        from .memtech import choose
        if r.memory is None or not r.views:
            return r
        if base is None or not math.isfinite(base):
            base = r.cost if math.isfinite(r.cost) else r.breakdown.time
        mem, p = choose(gc, r.views, base=base)
        reason = "" if p.feasible else p.reason
        return dataclasses.replace(r, cost=p.iteration_s if p.feasible else INF, memory=p.report,
                                   feasible=p.feasible, reason=reason, memory_plan=None if mem.empty else mem,
                                   techniques=p)

    def _memory_aware(self, ctx: _Ctx, res: Resource, fastest: MappingResult, t0: float,
                      stats: dict, fixed: Mapping[int, MachineView] | None = None) -> MappingResult:
        """The time-optimal mapping does not fit: the fastest mapping that fits, from the Pareto DP
        (:class:`_MemoryDP`), or ``fastest`` (infeasible) with a reason saying that none fits."""
        g, gc, dec = ctx.g, ctx.gc, ctx.dec
        cap = self.machine.device.usable_bytes
        t1 = time.perf_counter()
        lb = memory_lower_bound(gc, res)
        stats = dict(stats, memory_lower_bound=lb)
        why = "out of memory: " + fastest.memory.reason()
        if lb > cap:
            return dataclasses.replace(
                fastest, reason=(f"out of memory: every mapping of this graph needs at least "
                                 f"{format_bytes(lb)} on some device, capacity {format_bytes(cap)}; "
                                 f"the fastest: {fastest.memory.reason()}"),
                solve_s=time.perf_counter() - t0, stats=dict(stats, memory_dp_s=0.0))
        mdp = _MemoryDP(self, ctx, cap, self.front_limit)
        front = mdp.solve(dec.tree, res, dict(fixed or {}))
        stats = dict(stats, memory_dp_s=time.perf_counter() - t1, memory_front=len(front),
                     memory_front_capped=mdp.capped, memory_cache_size=len(self.mcache))
        if not len(front):
            return dataclasses.replace(
                fastest, reason=f"out of memory: no mapping of this graph fits; the fastest: {fastest.memory.reason()}",
                solve_s=time.perf_counter() - t0, stats=stats)
        best = int(np.argmin(front.keys[:, 0]))
        cost, assign = float(front.keys[best, 0]), front.a[best]
        views = {ctx.by_hash[hsh]: v for hsh, v in _flatten(assign)}
        out = self._finish(g, gc, dec, cost, views, t0, stats)
        if not out.feasible:                # cannot happen: the DP adds memory exactly (kept as a guard)
            return dataclasses.replace(out, reason=why)
        return out

    def first_views(self, g: PCG, resource: Resource | None = None,
                    fixed: Mapping[int, MachineView] | None = None,
                    techniques: bool | None = None, plain_when_cut: bool = False) -> MappingResult | None:
        """A mapping of ``g`` without the DP (linear in the graph), priced by :meth:`evaluate`: every node on
        the first view of its degree in ``resource`` (lowest start), ``fixed`` nodes on theirs -- the
        data-parallel layout of a data-parallel graph.  The last resort when the DP's solve cannot finish
        within a deadline; None when a node has no view in ``resource``.  ``techniques``, ``plain_when_cut``:
        as :meth:`evaluate`."""
        gc = GraphCost(g, self.model)
        res = resource or Resource.whole(self.machine)
        fixed = fixed or {}
        first: dict = {}                    # task grid -> its first view (nodes share a few grids)
        views = {}
        for n in gc.nodes():
            if n in fixed:
                views[n] = fixed[n]
                continue
            grid = gc.grid[n]
            if grid not in first:
                vs = gc.views(n, res)
                first[grid] = min(vs, key=lambda v: (v.start, v.devices())) if vs else None
            if first[grid] is None:
                return None
            views[n] = first[grid]
        return self.evaluate(g, views, techniques=techniques, plain_when_cut=plain_when_cut)

    def evaluate(self, g: PCG, views: Mapping[int, MachineView], techniques: bool | None = None,
                 plain_when_cut: bool = False) -> MappingResult:
        """Price a given mapping, every leaf one after the other (no side-by-side execution);
        ``techniques``: with its cheapest feasible memory techniques (:meth:`techniques`).  Their choice
        checks the deadline of the caller's scope (:class:`search.budget.Expired` past it); with
        ``plain_when_cut`` a cut choice returns the mapping priced without them instead (``stats
        ["techniques_cut"]``)."""
        t0 = time.perf_counter()
        gc = GraphCost(g, self.model)
        leaves = [gc.leaf_cost(n, views[n], views) for n in gc.nodes()]
        total = sum(lc.time for lc in leaves)
        out = self._finish(g, gc, None, total, dict(views), t0, {"setup_s": time.perf_counter() - t0}, leaves)
        if techniques is None:
            techniques = self.default_techniques
        if techniques:
            if out.memory is None:      # out of memory without techniques: _finish left cost inf
                return out
            try:
                return self.techniques(gc, dataclasses.replace(out, cost=total))
            except Expired:
                if not plain_when_cut:
                    raise
                return dataclasses.replace(out, stats=dict(out.stats, techniques_cut=True))
        return out

    def _finish(self, g, gc, dec, cost, views, t0, stats, leaves=None) -> MappingResult:
        """The mapping's result: its cost, the sum of its leaves' costs (``leaves``: those of ``gc.nodes()``
        in order, where the caller priced them) and its memory per device."""
        n_dev = self.machine.num_devices
        if not math.isfinite(cost):
            return MappingResult(INF, {}, LeafCost(), None, False, "no machine view fits the resources",
                                 n_dev, time.perf_counter() - t0, stats, dec)
        t1 = time.perf_counter()
        b = LeafCost()
        for lc in leaves if leaves is not None else (gc.leaf_cost(n, views[n], views) for n in gc.nodes()):
            b = b.add(lc)
        mem = memory_per_device(gc, views)
        used = set()
        for n in gc.nodes():
            used |= set(views[n].devices())
        # the linear part of the call (the cost model's set-up, the decomposition, this pricing; not the DP's
        # solve nor the techniques' choice): what any whole-graph mapping on this host costs at least
        stats = dict(stats, devices_used=len(used), linear_s=stats.get("setup_s", 0.0) + time.perf_counter() - t1)
        if not mem.feasible:
            return MappingResult(INF, views, b, mem, False, "out of memory: " + mem.reason(), n_dev,
                                 time.perf_counter() - t0, stats, dec)
        return MappingResult(cost, views, b, mem, True, "", n_dev, time.perf_counter() - t0, stats, dec)

    # --- the DP --------------------------------------------------------------------------------
    def _solve(self, ctx: _Ctx, t, res: Resource, fixed: Mapping[int, MachineView]):
        # Costs only depend on which devices share a group / node, so a subproblem moved by whole
        # nodes (its resource and every fixed view) has the same optimum, moved: the key is taken
        # relative to the resource's first node and a hit is shifted back.
        off = (res.start // self.machine.devices_per_node) * self.machine.devices_per_node
        rel = ctx.relevant[id(t)]
        lkey = ctx.local_key(t)
        if lkey is not None:
            fk = tuple((i, v.start - off, v.dims) for i, n in enumerate(ctx.lorder[id(t)])
                       if (v := fixed.get(n)) is not None)
            key = (lkey, res.start - off, res.nodes, res.per_node, fk)
            hit = self.cache.get(key)
            if hit is not None:
                self.hits += 1
                cost, assign, at, names = hit
                if not assign:
                    return (cost, assign)
                if off != at:
                    assign = _Shift(off - at, assign)
                mine = ctx.lnames[id(t)]
                if names is not mine and names != mine:
                    assign = _Rename(names, mine, assign)
                return (cost, assign)
            out = self._solve_miss(ctx, t, res, fixed)
            self.cache[key] = (out[0], out[1], off, ctx.lnames[id(t)])
            return out
        if len(rel) <= len(fixed) and (rs := ctx.sorted_relevant(t)) is not None:
            fk = tuple((h, v.start - off, v.dims) for n, h in rs if (v := fixed.get(n)) is not None)
        else:
            h = ctx.h
            fk = tuple(sorted((h[n], v.start - off, v.dims) for n, v in fixed.items() if n in rel))
        key = (ctx.key[id(t)], res.start - off, res.nodes, res.per_node, fk)
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            cost, assign, at = hit
            return (cost, _Shift(off - at, assign) if off != at and assign else assign)
        out = self._solve_miss(ctx, t, res, fixed)
        self.cache[key] = (out[0], out[1], off)
        return out

    def _solve_miss(self, ctx: _Ctx, t, res: Resource, fixed: Mapping[int, MachineView]):
        self.misses += 1
        _check_deadline()           # the deadline of the caller's scope (search.budget.within): Expired
        if ctx.need[id(t)] > res.size:
            out = (INF, ())
        elif isinstance(t, Leaf):
            out = self._leaf(ctx, t, res, fixed)
        elif isinstance(t, Series):
            out = self._series(ctx, t, res, fixed)
        else:
            out = self._parallel(ctx, t, res, fixed)
        return out

    def _inside(self, v: MachineView, res: Resource) -> bool:
        key = (v, res)
        hit = self._inside_memo.get(key)
        if hit is None:
            devs = set(res.devices(self.machine))
            hit = self._inside_memo[key] = all(d in devs for d in v.devices())
        return hit

    def _cands(self, ctx: _Ctx, n: int, res: Resource, fixed: Mapping[int, MachineView]) -> list:
        if n in fixed:
            v = fixed[n]
            return [v] if self._inside(v, res) else []
        return ctx.views(n, res)

    def _leaf(self, ctx: _Ctx, t: Leaf, res: Resource, fixed, skip=frozenset()):
        """The leaf's optimum given ``fixed``; edges from producers in ``skip`` are left out (the
        caller prices them)."""
        gc = ctx.gc
        unit = ctx.dec.units[t.unit]
        main = unit[-1]
        others = unit[:-1]
        feeders = {p for _, p in ctx.priced_inputs(main) if p in others}
        # placements that feed nothing priced in this unit: their own cost only
        base = 0.0
        chosen: list = []
        for p in others:
            if p in feeders:
                continue
            cands = self._cands(ctx, p, res, fixed)
            if not cands:
                return (INF, ())
            best = min(cands, key=lambda v: gc.own_cost(p, v).time)
            base += gc.own_cost(p, best).time
            chosen.append((ctx.h[p], best))
        main_cands = self._cands(ctx, main, res, fixed)
        feed_cands = {p: self._cands(ctx, p, res, fixed) for p in feeders}
        if not main_cands or any(not c for c in feed_cands.values()):
            return (INF, ())
        inputs = ctx.priced_inputs(main)
        best_total, best_choice = INF, None
        for vm in main_cands:
            _check_deadline()
            tot = base + gc.own_cost(main, vm).time
            ch = [(ctx.h[main], vm)]
            for pos, p in inputs:
                if p not in feeders and p not in skip:
                    tot += ctx.edge(main, pos, fixed[p], vm)
            for p in sorted(feeders):
                fkey = (p, vm, res, fixed.get(p))     # independent of the other fixed views
                hit = ctx.feed.get(fkey)
                if hit is None:
                    bp, bv = INF, None
                    for vp in feed_cands[p]:
                        c = gc.own_cost(p, vp).time + sum(ctx.edge(main, pos, vp, vm)
                                                           for pos, q in inputs if q == p)
                        if c < bp:
                            bp, bv = c, vp
                    hit = ctx.feed[fkey] = (bp, bv)
                bp, bv = hit
                tot += bp
                ch.append((ctx.h[p], bv))
            if tot < best_total:
                best_total, best_choice = tot, ch
        return (best_total, tuple(chosen) + tuple(best_choice))

    def _series(self, ctx: _Ctx, t: Series, res: Resource, fixed):
        states = self._series_pass(ctx, t, res, fixed, frozenset())
        if not states:
            return (INF, ())
        return min(states.values(), key=lambda x: x[0])

    def _series_pass(self, ctx: _Ctx, t: Series, res: Resource, fixed, extra: frozenset) -> dict:
        """The left-to-right pass; the final states are keyed by the views of the nodes in ``extra``
        (not in ``fixed``), which are treated as read after the series."""
        states: dict = {(): (0.0, ())}
        kids, info = t.children, ctx.boundary[id(t)]
        done: set = set()
        i = 0
        while i < len(kids):
            child, (outs, live) = kids[i], info[i]
            mine = ctx.nodes[id(child)]
            done |= mine
            if extra:
                outs = sorted(set(outs) | (extra & mine))
                live = live | (extra & done)
            outs = [n for n in outs if n not in fixed]
            jmain = ctx.join.get((id(t), i))
            if (jmain is not None and len(outs) >= 2
                    and not (extra & mine) and (extra & ctx.nodes[id(kids[i + 1])]) <= {jmain}):
                jlive = info[i + 1][1]
                done |= ctx.nodes[id(kids[i + 1])]
                if extra:
                    jlive = jlive | (extra & done)
                states = self._series_join(ctx, child, kids[i + 1], jmain, outs, jlive, states, res, fixed)
                i += 2
            else:
                states = self._series_step(ctx, child, outs, live, states, res, fixed)
                i += 1
            if not states:
                return {}
        return states

    def _open(self, ctx: _Ctx, t, res: Resource, fixed, R: tuple) -> list:
        """The optimum of subtree ``t`` for every combination of views of its nodes ``R`` (none in
        ``fixed``): a list of (views of R, cost, assignment).  A series is solved in one pass whose
        final states are keyed by those views."""
        rel = ctx.relevant[id(t)]
        key = ("open", id(t), res, R, tuple(sorted((n, v) for n, v in fixed.items() if n in rel)))
        hit = ctx.fronts.get(key)
        if hit is not None:
            return hit
        out = []
        if isinstance(t, Series) and ctx.need[id(t)] <= res.size:
            for skey, (c, a) in self._series_pass(ctx, t, res, fixed, frozenset(R)).items():
                vm = dict(skey)
                out.append((tuple(vm[n] for n in R), c, a))
        else:
            for combo in product(*(self._cands(ctx, n, res, fixed) for n in R)):
                f2 = dict(fixed)
                f2.update(zip(R, combo))
                c, a = self._solve(ctx, t, res, f2)
                if c < INF:
                    out.append((combo, c, a))
        ctx.fronts[key] = out
        return out

    def _series_step(self, ctx: _Ctx, child, outs, live, states, res, fixed) -> dict:
        """One child of the left-to-right pass: solved once per state and combination of views of its
        boundary nodes ``outs``; the new states are keyed by the views of the ``live`` nodes."""
        out_cands = [self._cands(ctx, n, res, fixed) for n in outs]
        keep = sorted(n for n in live if n not in fixed)
        new: dict = {}
        for skey, (scost, sass) in states.items():
            _check_deadline()       # memo hits skip _solve's check: a pass over states x views can be long
            f = dict(fixed)
            f.update(skey)
            for combo in product(*out_cands):
                f2 = f
                if outs:
                    f2 = dict(f)
                    f2.update(zip(outs, combo))
                c, a = self._solve(ctx, child, res, f2)
                if c == INF:
                    continue
                tot = scost + c
                nkey = tuple((n, f2[n]) for n in keep if n in f2)
                old = new.get(nkey)
                if old is None or tot < old[0]:
                    new[nkey] = (tot, (sass, a))
        return new

    def _series_join(self, ctx: _Ctx, child, jleaf: Leaf, jmain: int, outs, live, states, res, fixed) -> dict:
        """A child whose boundary nodes ``outs`` are read only by ``jmain``, the main node of the next
        child (a join after a parallel split), solved together with that leaf.  Given the join's view
        vJ, the edges from the child into the join depend on one boundary node's view each, so
        instead of enumerating every combination of boundary views the child is priced by its
        Pareto front of (child cost, cost of its edges into the join) (:meth:`_front`): a parallel
        split combines its branches' fronts (sum of costs one after the other, max side by side;
        the edge costs always add), and the optimum is the front's least cost + edges."""
        gc = ctx.gc
        outset = frozenset(outs)
        keep = sorted(n for n in live if n not in fixed)
        new: dict = {}
        for skey, (scost, sass) in states.items():
            _check_deadline()       # memo hits skip _solve's check: a pass over states x views can be long
            f = dict(fixed)
            f.update(skey)
            for vj in self._cands(ctx, jmain, res, f):
                fj = dict(f)
                fj[jmain] = vj
                jc, ja = self._leaf(ctx, jleaf, res, fj, skip=outset)
                if jc == INF:
                    continue
                ub = self._seqval(ctx, child, res, f, jmain, vj, outset)
                if ub == INF:
                    continue
                front = self._front(ctx, child, res, f, jmain, vj, outset, ub)
                if not front:
                    continue
                c, e, a = min(front, key=lambda p: p[0] + p[1])
                tot = scost + jc + c + e
                nkey = tuple((n, fj[n]) for n in keep if n in fj)
                old = new.get(nkey)
                if old is None or tot < old[0]:
                    new[nkey] = (tot, (sass, (a, ja)))
        return new

    def _seqval(self, ctx: _Ctx, t, res: Resource, fixed, jmain: int, vj: MachineView, outs: frozenset) -> float:
        """The least cost + edges into the join with every parallel split of ``t`` run one branch
        after the other (an achievable value: the upper bound for :meth:`_front`)."""
        if isinstance(t, Parallel) and any(n in ctx.nodes[id(t)] for n in outs):
            return (self._seqval(ctx, t.left, res, fixed, jmain, vj, outs)
                    + self._seqval(ctx, t.right, res, fixed, jmain, vj, outs))
        return min((c + e for c, e, _ in self._front(ctx, t, res, fixed, jmain, vj, outs, INF)), default=INF)

    def _emin(self, ctx: _Ctx, t, res: Resource, jmain: int, vj: MachineView, outs: frozenset) -> float:
        """A lower bound of the edges from ``t``'s nodes in ``outs`` into the join, ``t`` on ``res``."""
        tot = 0.0
        mine = ctx.nodes[id(t)]
        for pos, p in ctx.priced_inputs(jmain):
            if p in outs and p in mine:
                tot += min((ctx.edge(jmain, pos, v, vj) for v in ctx.views(p, res)), default=INF)
        return tot

    def _front(self, ctx: _Ctx, t, res: Resource, fixed, jmain: int, vj: MachineView, outs: frozenset,
               ub: float) -> list:
        """Pareto front of (cost of subtree ``t`` on ``res``, cost of the edges from its nodes in
        ``outs`` into ``jmain`` on view ``vj``, assignment), sorted by cost.  ``ub`` is an
        achievable value of the join's cost + edges: side-by-side splits whose lower bound (branch
        compute and least edges) reaches it are skipped (their points cannot win: every cost the
        caller adds is non-negative)."""
        rel = ctx.relevant[id(t)]
        key = (id(t), res, vj, ub, tuple(sorted((n, v) for n, v in fixed.items() if n in rel)))
        hit = ctx.fronts.get(key)
        if hit is not None:
            return hit
        lkey = self._front_key(ctx, t, res, fixed, jmain, vj, outs, ub)
        if lkey is not None:
            hit = self.fcache.get(lkey)
            if hit is not None:
                pts, names = hit
                mine = ctx.lnames[id(t)]
                if names is not mine and names != mine:
                    pts = [(c, e, _Rename(names, mine, a) if a else a) for c, e, a in pts]
                ctx.fronts[key] = pts
                return pts
        out = self._front_miss(ctx, t, res, fixed, jmain, vj, outs, ub)
        ctx.fronts[key] = out
        if lkey is not None:
            if len(self.fcache) > 200_000:
                self.fcache.clear()
            self.fcache[lkey] = (out, ctx.lnames[id(t)])
        return out

    def _front_key(self, ctx: _Ctx, t, res: Resource, fixed, jmain: int, vj: MachineView, outs: frozenset,
                   ub: float):
        """:meth:`_front`'s key up to renaming (a local key, :meth:`_Ctx._local_key`): the subtree's key, the
        fixed views by position, the join's facts and which of its inputs read which of the subtree's
        nodes, the boundary nodes in it by position; None where the subtree has no local key."""
        lk = ctx.local_key(t)
        if lk is None:
            return None
        pos = ctx.lpos.get(id(t))
        if pos is None:
            pos = ctx.lpos[id(t)] = {n: i for i, n in enumerate(ctx.lorder[id(t)])}
        mine = ctx.nodes[id(t)]
        fk = tuple((i, v) for i, n in enumerate(ctx.lorder[id(t)]) if (v := fixed.get(n)) is not None)
        jin = tuple((q, pos[p], ctx.gc.read_ref(jmain, q)[1]) for q, p in ctx.priced_inputs(jmain) if p in mine)
        R = tuple(sorted(pos[n] for n in outs if n in mine))
        return (lk, res, vj, ub, fk, ctx._fact_id(jmain, True), jin, R)

    def _front_miss(self, ctx: _Ctx, t, res: Resource, fixed, jmain: int, vj: MachineView, outs: frozenset,
                    ub: float) -> list:
        R = sorted(n for n in outs if n in ctx.nodes[id(t)])
        pts = []
        if not R:
            c, a = self._solve(ctx, t, res, fixed)
            if c < INF:
                pts.append((c, 0.0, a))
        elif isinstance(t, Parallel):
            fl = self._front(ctx, t.left, res, fixed, jmain, vj, outs, ub)
            fr = self._front(ctx, t.right, res, fixed, jmain, vj, outs, ub) if fl else []
            pts = [(ca + cb, ea + eb, (aa, ab)) for ca, ea, aa in fl for cb, eb, ab in fr]
            # side by side costs at least max(lb) and edges at least the least edge cost of any
            # one-after-the-other point (the latter allows every boundary view the former does)
            lbmax = max(ctx.lb[id(t.left)], ctx.lb[id(t.right)])
            e0 = min((p[1] for p in pts), default=INF)
            c0 = min((p[0] for p in pts if p[1] == e0), default=INF)
            if c0 > lbmax:
                for r1, r2 in res.splits(self.machine):
                    for x, y in ((t.left, t.right), (t.right, t.left)):
                        if ctx.need[id(x)] > r1.size or ctx.need[id(y)] > r2.size:
                            continue
                        if (max(ctx.lb[id(x)], ctx.lb[id(y)]) + self._emin(ctx, x, r1, jmain, vj, outs)
                                + self._emin(ctx, y, r2, jmain, vj, outs)) >= ub:
                            continue
                        fx = self._front(ctx, x, r1, fixed, jmain, vj, outs, ub)
                        if not fx:
                            continue
                        fy = self._front(ctx, y, r2, fixed, jmain, vj, outs, ub)
                        side = self.model.side_by_side
                        pts.extend((side(cx, cy), ex + ey, (ax, ay)) for cx, ex, ax in fx for cy, ey, ay in fy)
        else:
            gc = ctx.gc
            inputs = [(pos, p) for pos, p in ctx.priced_inputs(jmain) if p in R]
            idx = {n: k for k, n in enumerate(R)}
            for views, c, a in self._open(ctx, t, res, fixed, tuple(R)):
                e = sum(ctx.edge(jmain, pos, views[idx[p]], vj) for pos, p in inputs)
                pts.append((c, e, a))
        return _pareto(pts)

    def _parallel(self, ctx: _Ctx, t: Parallel, res: Resource, fixed):
        ca, aa = self._solve(ctx, t.left, res, fixed)
        cb, ab = self._solve(ctx, t.right, res, fixed) if ca < INF else (INF, ())
        best = (ca + cb, (aa, ab))
        if max(ctx.lb[id(t.left)], ctx.lb[id(t.right)]) >= best[0]:
            return best                      # side by side cannot beat one after the other
        for r1, r2 in res.splits(self.machine):
            for x, y in ((t.left, t.right), (t.right, t.left)):
                if ctx.need[id(x)] > r1.size or ctx.need[id(y)] > r2.size:
                    continue
                cx, ax = self._solve(ctx, x, r1, fixed)
                if cx >= best[0]:
                    continue
                cy, ay = self._solve(ctx, y, r2, fixed)
                c = self.model.side_by_side(cx, cy)
                if c < best[0]:
                    best = (c, (ax, ay))
        return best


class _Front:
    """A memory-aware DP value: ``k`` points, each with its scalar keys (``keys[i]``: the time, or
    for a branch into a join (its time, its edges into the join)), its bytes on every device
    (``mem[i]``) and its assignment (``a[i]``)."""
    __slots__ = ("keys", "mem", "a")

    def __init__(self, keys: np.ndarray, mem: np.ndarray, a: list):
        self.keys, self.mem, self.a = keys, mem, a

    def __len__(self) -> int:
        return len(self.a)


class _MemoryDP:
    """The memory-aware DP: the same recursion as :class:`MachineMapper`'s, but every subproblem's
    value is a Pareto front (:class:`_Front`) of (time, memory vector, assignment) instead of the
    least time.

    The memory vector holds the bytes of the subproblem's nodes on every device of the machine
    (:func:`search.memory.node_memory`).  A mapping's memory is a sum over nodes per device, so the
    vectors compose exactly: a series or a one-after-the-other split adds them, a side-by-side split
    adds vectors with disjoint supports; times add or take the max as in the time DP.  A point is
    dropped when another is no slower and holds no more on any device (it cannot be part of a better
    completion: everything added later is the same for both), and when its busiest device is already
    over capacity (memory only grows).  The fastest point of the root's front is the fastest mapping
    that fits.

    Side by side.  As in the time DP, a parallel split is tried side by side on a split of the
    resource only when that could be faster than its fastest one-after-the-other point that fits
    (the larger side's compute, plus the least edges into a join, below it).  For time alone that is
    exact; for memory it is a restriction: side by side puts the branches on disjoint devices, but
    one after the other can do so too (its views range over the whole resource), so a side-by-side
    mapping that is slower anyway is rarely the only one that fits -- and when no
    one-after-the-other point fits, every split is tried.

    Exact while no front exceeds ``limit`` points; beyond, :func:`_mselect` keeps the points on the
    two-dimensional front of (time, busiest device) first, so the fastest and the least-peak
    mappings of every subproblem always survive (``capped`` counts the fronts cut)."""

    def __init__(self, mapper: MachineMapper, ctx: _Ctx, cap: float, limit: int):
        self.mp, self.ctx, self.cap, self.limit = mapper, ctx, float(cap), max(2, int(limit))
        self.machine = mapper.machine
        self.D = self.machine.num_devices
        self.unit = _Front(np.zeros((1, 1)), np.zeros((1, self.D)), [()])
        self.nmem: dict = {}
        self.fronts: dict = {}
        self.feed: dict = {}
        self.capped = 0

    def mem(self, n: int, v: MachineView) -> np.ndarray:
        key = (n, v)
        hit = self.nmem.get(key)
        if hit is None:
            w, a = node_memory(self.ctx.gc, n, v)
            hit = np.zeros(self.D)
            for d, b in w.items():
                hit[d] += b
            for d, b in a.items():
                hit[d] += b
            self.nmem[key] = hit
        return hit

    def make(self, pts: list) -> _Front:
        """A pruned front from a list of (time, node memory vector, assignment)."""
        if not pts:
            return _Front(np.zeros((0, 1)), np.zeros((0, self.D)), [])
        return self.prune(_Front(np.array([[p[0]] for p in pts]), np.array([p[1] for p in pts]),
                                 [p[2] for p in pts]))

    def prune(self, f: _Front) -> _Front:
        if len(f) <= 1:
            if len(f) == 1 and f.mem[0].max() > self.cap:
                return _Front(f.keys[:0], f.mem[:0], [])
            return f
        idx, cut = _mselect(f.keys, f.mem, self.cap, self.limit)
        self.capped += cut
        return _Front(f.keys[idx], f.mem[idx], [f.a[i] for i in idx])

    def combine(self, fa: _Front, fb: _Front, side: bool = False, prune: bool = True) -> _Front:
        """Every point of ``fa`` with every point of ``fb``: memory adds; times add (one after the
        other) or take the max (side by side, ``side``); a join branch's edge costs always add."""
        na, nb = len(fa), len(fb)
        if not na or not nb:
            return _Front(np.zeros((0, fa.keys.shape[1])), np.zeros((0, self.D)), [])
        keys = fa.keys[:, None, :] + fb.keys[None, :, :]
        if side and not self.mp.model.shared:      # shared cores: side by side adds (CostModel.side_by_side)
            keys[:, :, 0] = np.maximum(fa.keys[:, None, 0], fb.keys[None, :, 0])
        keys = keys.reshape(na * nb, -1)
        mem = (fa.mem[:, None, :] + fb.mem[None, :, :]).reshape(na * nb, self.D)
        if not prune or na == 1 or nb == 1:
            # one point on a side moves the other side's points alike (no new domination one after
            # the other; side by side at most the other side's count): only the capacity filters
            if prune:
                ok = np.flatnonzero(mem.max(axis=1) <= self.cap)
                if len(ok) < na * nb:
                    return _Front(keys[ok], mem[ok], [(fa.a[i // nb], fb.a[i % nb]) for i in ok])
            return _Front(keys, mem, [(x, y) for x in fa.a for y in fb.a])
        idx, cut = _mselect(keys, mem, self.cap, self.limit)
        self.capped += cut
        return _Front(keys[idx], mem[idx], [(fa.a[i // nb], fb.a[i % nb]) for i in idx])

    def cat(self, fs: list) -> _Front:
        fs = [f for f in fs if len(f)]
        if not fs:
            return _Front(np.zeros((0, 1)), np.zeros((0, self.D)), [])
        if len(fs) == 1:
            return fs[0]
        return _Front(np.concatenate([f.keys for f in fs]), np.concatenate([f.mem for f in fs]),
                      [x for f in fs for x in f.a])

    # --- the recursion (mirrors MachineMapper._solve and the methods it calls) ---------------------
    def solve(self, t, res: Resource, fixed) -> _Front:
        ctx, mp = self.ctx, self.mp
        dpn = self.machine.devices_per_node
        off = (res.start // dpn) * dpn
        rel = ctx.relevant[id(t)]
        fk = tuple(sorted((ctx.h[n], v.start - off, v.dims) for n, v in fixed.items() if n in rel))
        key = (self.cap, self.limit, ctx.key[id(t)], res.start - off, res.nodes, res.per_node, fk)
        hit = mp.mcache.get(key)
        if hit is not None:
            f, at = hit
            if off != at and len(f):
                k = off - at
                f = _Front(f.keys, np.roll(f.mem, k, axis=1), [_Shift(k, a) if a else a for a in f.a])
            return f
        _check_deadline()
        if ctx.need[id(t)] > res.size:
            out = self.cat([])
        elif isinstance(t, Leaf):
            out = self.leaf(t, res, fixed)
        elif isinstance(t, Series):
            out = self.prune(self.cat(list(self.series_pass(t, res, fixed, frozenset()).values())))
        else:
            out = self.parallel(t, res, fixed)
        mp.mcache[key] = (out, off)
        return out

    def leaf(self, t: Leaf, res: Resource, fixed, skip=frozenset()) -> _Front:
        ctx, mp, gc = self.ctx, self.mp, self.ctx.gc
        unit = ctx.dec.units[t.unit]
        main, others = unit[-1], unit[:-1]
        inputs = ctx.priced_inputs(main)
        feeders = {p for _, p in inputs if p in others}
        base = self.unit
        for p in others:                      # placements feeding nothing priced: own cost, memory
            if p in feeders:
                continue
            cands = mp._cands(ctx, p, res, fixed)
            base = self.combine(base, self.make([(gc.own_cost(p, v).time, self.mem(p, v), (ctx.h[p], v))
                                                 for v in cands]))
            if not len(base):
                return base
        feed_cands = {p: mp._cands(ctx, p, res, fixed) for p in sorted(feeders)}
        out: list = []
        for vm in mp._cands(ctx, main, res, fixed):
            _check_deadline()
            t0 = gc.own_cost(main, vm).time
            for pos, p in inputs:
                if p not in feeders and p not in skip:
                    t0 += ctx.edge(main, pos, fixed[p], vm)
            cur = self.make([(t0, self.mem(main, vm), (ctx.h[main], vm))])
            for p, cands in feed_cands.items():
                fkey = (p, vm, res, fixed.get(p))     # independent of the other fixed views
                fr = self.feed.get(fkey)
                if fr is None:
                    fr = self.feed[fkey] = self.make([
                        (gc.own_cost(p, vp).time + sum(ctx.edge(main, pos, vp, vm) for pos, q in inputs if q == p),
                         self.mem(p, vp), (ctx.h[p], vp)) for vp in cands])
                cur = self.combine(cur, fr)
                if not len(cur):
                    break
            out.append(self.combine(cur, base, prune=False))
        return self.prune(self.cat(out))

    def series_pass(self, t: Series, res: Resource, fixed, extra: frozenset) -> dict:
        ctx = self.ctx
        states: dict = {(): self.unit}
        kids, info = t.children, ctx.boundary[id(t)]
        done: set = set()
        i = 0
        while i < len(kids):
            child, (outs, live) = kids[i], info[i]
            mine = ctx.nodes[id(child)]
            done |= mine
            if extra:
                outs = sorted(set(outs) | (extra & mine))
                live = live | (extra & done)
            outs = [n for n in outs if n not in fixed]
            jmain = ctx.join.get((id(t), i))
            if (jmain is not None and len(outs) >= 2
                    and not (extra & mine) and (extra & ctx.nodes[id(kids[i + 1])]) <= {jmain}):
                jlive = info[i + 1][1]
                done |= ctx.nodes[id(kids[i + 1])]
                if extra:
                    jlive = jlive | (extra & done)
                states = self.series_join(child, kids[i + 1], jmain, outs, jlive, states, res, fixed)
                i += 2
            else:
                states = self.series_step(child, outs, live, states, res, fixed)
                i += 1
            if not states:
                return {}
        return states

    def _add(self, new: dict, nkey, f: _Front) -> None:
        if not len(f):
            return
        cur = new.setdefault(nkey, [])
        cur.append(f)
        if sum(len(x) for x in cur) > 32 * self.limit:
            new[nkey] = [self.prune(self.cat(cur))]

    def _close(self, new: dict) -> dict:
        out = {}
        for k, fs in new.items():
            f = self.prune(self.cat(fs))
            if len(f):
                out[k] = f
        return out

    def series_step(self, child, outs, live, states, res, fixed) -> dict:
        ctx, mp = self.ctx, self.mp
        out_cands = [mp._cands(ctx, n, res, fixed) for n in outs]
        keep = sorted(n for n in live if n not in fixed)
        new: dict = {}
        for skey, sfront in states.items():
            f = dict(fixed)
            f.update(skey)
            for combo in product(*out_cands):
                f2 = f
                if outs:
                    f2 = dict(f)
                    f2.update(zip(outs, combo))
                cf = self.solve(child, res, f2)
                if len(cf):
                    self._add(new, tuple((n, f2[n]) for n in keep if n in f2),
                              self.combine(sfront, cf, prune=len(sfront) * len(cf) > 4 * self.limit))
        return self._close(new)

    def series_join(self, child, jleaf: Leaf, jmain: int, outs, live, states, res, fixed) -> dict:
        ctx, mp = self.ctx, self.mp
        outset = frozenset(outs)
        keep = sorted(n for n in live if n not in fixed)
        new: dict = {}
        for skey, sfront in states.items():
            f = dict(fixed)
            f.update(skey)
            for vj in mp._cands(ctx, jmain, res, f):
                fj = dict(f)
                fj[jmain] = vj
                jf = self.leaf(jleaf, res, fj, skip=outset)
                if not len(jf):
                    continue
                fr = self.front(child, res, f, jmain, vj, outset)
                if not len(fr):
                    continue
                cf = self.prune(_Front(fr.keys.sum(axis=1, keepdims=True), fr.mem, fr.a))
                self._add(new, tuple((n, fj[n]) for n in keep if n in fj),
                          self.combine(self.combine(sfront, cf), jf))
        return self._close(new)

    def front(self, t, res: Resource, fixed, jmain: int, vj: MachineView, outs: frozenset) -> _Front:
        """Pareto front of (cost of ``t``, cost of its edges into the join) and memory."""
        ctx = self.ctx
        rel = ctx.relevant[id(t)]
        key = ("front", id(t), res, vj, tuple(sorted((n, v) for n, v in fixed.items() if n in rel)))
        hit = self.fronts.get(key)
        if hit is not None:
            return hit
        R = sorted(n for n in outs if n in ctx.nodes[id(t)])
        parts: list = []
        if not R:
            f = self.solve(t, res, fixed)
            parts.append(_Front(np.hstack([f.keys, np.zeros((len(f), 1))]), f.mem, f.a))
        elif isinstance(t, Parallel):
            fl = self.front(t.left, res, fixed, jmain, vj, outs)
            if len(fl):
                parts.append(self.combine(fl, self.front(t.right, res, fixed, jmain, vj, outs)))
            # as in the time DP, side by side is tried only where it can be faster than the fastest
            # one-after-the-other point that fits (see the class docstring)
            seq = float(parts[0].keys.sum(axis=1).min()) if parts and len(parts[0]) else INF
            lbmax = max(ctx.lb[id(t.left)], ctx.lb[id(t.right)])
            for r1, r2 in res.splits(self.machine) if lbmax < seq else ():
                for x, y in ((t.left, t.right), (t.right, t.left)):
                    if ctx.need[id(x)] > r1.size or ctx.need[id(y)] > r2.size:
                        continue
                    mp = self.mp
                    if (lbmax + mp._emin(ctx, x, r1, jmain, vj, outs) + mp._emin(ctx, y, r2, jmain, vj, outs)
                            >= seq):
                        continue
                    fx = self.front(x, r1, fixed, jmain, vj, outs)
                    if len(fx):
                        parts.append(self.combine(fx, self.front(y, r2, fixed, jmain, vj, outs), side=True))
        else:
            inputs = [(pos, p) for pos, p in ctx.priced_inputs(jmain) if p in R]
            idx = {n: k for k, n in enumerate(R)}
            for views, f in self.open(t, res, fixed, tuple(R)):
                e = sum(ctx.edge(jmain, pos, views[idx[p]], vj) for pos, p in inputs)
                parts.append(_Front(np.hstack([f.keys, np.full((len(f), 1), e)]), f.mem, f.a))
        if not parts:
            out = _Front(np.zeros((0, 2)), np.zeros((0, self.D)), [])
        else:
            out = self.prune(self.cat(parts))
        self.fronts[key] = out
        return out

    def open(self, t, res: Resource, fixed, R: tuple) -> list:
        """(views of ``R``, front of ``t`` with those views) for every combination of views of R."""
        ctx, mp = self.ctx, self.mp
        rel = ctx.relevant[id(t)]
        key = ("open", id(t), res, R, tuple(sorted((n, v) for n, v in fixed.items() if n in rel)))
        hit = self.fronts.get(key)
        if hit is not None:
            return hit
        out = []
        if isinstance(t, Series) and ctx.need[id(t)] <= res.size:
            for skey, fr in self.series_pass(t, res, fixed, frozenset(R)).items():
                vm = dict(skey)
                out.append((tuple(vm[n] for n in R), fr))
        else:
            for combo in product(*(mp._cands(ctx, n, res, fixed) for n in R)):
                f2 = dict(fixed)
                f2.update(zip(R, combo))
                fr = self.solve(t, res, f2)
                if len(fr):
                    out.append((combo, fr))
        self.fronts[key] = out
        return out

    def parallel(self, t: Parallel, res: Resource, fixed) -> _Front:
        ctx = self.ctx
        fa = self.solve(t.left, res, fixed)
        parts = [self.combine(fa, self.solve(t.right, res, fixed))] if len(fa) else []
        seq = float(parts[0].keys[:, 0].min()) if parts and len(parts[0]) else INF
        if max(ctx.lb[id(t.left)], ctx.lb[id(t.right)]) >= seq:
            return parts[0]                   # side by side cannot be faster (see the class docstring)
        for r1, r2 in res.splits(self.machine):
            for x, y in ((t.left, t.right), (t.right, t.left)):
                if ctx.need[id(x)] > r1.size or ctx.need[id(y)] > r2.size:
                    continue
                fx = self.solve(x, r1, fixed)
                if len(fx):
                    parts.append(self.combine(fx, self.solve(y, r2, fixed), side=True))
        return self.prune(self.cat(parts))


def _mselect(keys: np.ndarray, mem: np.ndarray, cap: float, limit: int, chunk: int = 64) -> tuple[np.ndarray, int]:
    """Which points (rows of ``keys`` and ``mem``) a front keeps, ordered by the sum of their keys
    (the time): those that fit ``cap`` on every device and that no other point dominates (keys and
    memory on every device no larger); at most ``limit`` of them: the points on the front of (time,
    busiest device) first -- evenly spaced along it if even they are too many, always including its
    two ends, the fastest and the least-peak point -- then the fastest of the rest.  Returns the row
    indices and 1 if some non-dominated point was cut for the limit, else 0."""
    peak = mem.max(axis=1)
    ok = np.flatnonzero(peak <= cap)
    if len(ok) <= 1:
        return ok, 0
    s = keys.sum(axis=1)
    order = ok[np.lexsort((peak[ok], s[ok]))]
    if len(order) <= chunk:
        # small: every pair at once; i dominates j if no larger anywhere and (larger somewhere the
        # other way round, or equal and earlier)
        k, m = keys[order], mem[order]
        le = np.all(k[:, None, :] <= k[None, :, :], axis=2) & np.all(m[:, None, :] <= m[None, :, :], axis=2)
        n = len(order)
        dom = le & (~le.T | (np.arange(n)[:, None] < np.arange(n)[None, :]))
        cand = order[~dom.any(axis=0)]
        if len(cand) <= limit:
            return cand, 0
        pk = peak[cand]
        f2 = np.empty(len(cand), dtype=bool)
        f2[0] = True
        f2[1:] = pk[1:] < np.minimum.accumulate(pk)[:-1]
        front2 = cand[f2]
        if len(front2) > limit:
            return front2[_spread(len(front2), limit)], 1
        idx = np.concatenate([front2, cand[~f2][:limit - len(front2)]])
        return idx[np.lexsort((peak[idx], s[idx]))], 1
    pk = peak[order]
    f2 = np.empty(len(order), dtype=bool)
    f2[0] = True
    f2[1:] = pk[1:] < np.minimum.accumulate(pk)[:-1]
    front2 = order[f2]
    if len(front2) > limit:
        return front2[_spread(len(front2), limit)], 1
    kept = [front2]
    kk, km = keys[front2], mem[front2]
    rest = order[~f2]
    room = limit - len(front2)
    cut = 0
    for i in range(0, len(rest), chunk):
        c = rest[i:i + chunk]
        ck, cm = keys[c], mem[c]
        dom = np.any(np.all(kk[None, :, :] <= ck[:, None, :], axis=2)
                     & np.all(km[None, :, :] <= cm[:, None, :], axis=2), axis=1)
        if len(c) > 1:                       # an earlier point of the chunk dominates a later one
            mut = (np.all(ck[None, :, :] <= ck[:, None, :], axis=2)
                   & np.all(cm[None, :, :] <= cm[:, None, :], axis=2))
            dom |= np.tril(mut, -1).any(axis=1)
        surv = c[~dom]
        if len(surv) > room:
            surv = surv[:room]
            cut = 1
        if len(surv):
            kept.append(surv)
            kk, km = np.concatenate([kk, keys[surv]]), np.concatenate([km, mem[surv]])
            room -= len(surv)
        if room <= 0:
            if not cut and i + chunk < len(rest):
                cut = 1                      # (conservatively: the rest was not examined)
            break
    idx = np.concatenate(kept)
    return idx[np.lexsort((peak[idx], s[idx]))], cut


def _spread(n: int, k: int) -> list:
    """``k`` indices evenly spaced over ``range(n)``, first and last included (k >= 2, n > k)."""
    return [(i * (n - 1) + (k - 1) // 2) // (k - 1) for i in range(k)]


def _pareto(pts: list) -> list:
    """The points (cost, edges, assignment) not dominated in both cost and edges, by cost."""
    pts.sort(key=lambda p: (p[0], p[1]))
    out, best_e = [], INF
    for p in pts:
        if p[1] < best_e:
            out.append(p)
            best_e = p[1]
    return out


class _Shift:
    """An assignment moved by ``k`` devices (a translated cache hit); flattened lazily."""
    __slots__ = ("k", "inner")

    def __init__(self, k: int, inner):
        self.k, self.inner = k, inner

    def __bool__(self) -> bool:
        return True


class _Rename:
    """An assignment of one subtree used for an identical one (a hit by local key): node names ``src``
    stand for ``dst`` (position by position); flattened lazily."""
    __slots__ = ("src", "dst", "inner")

    def __init__(self, src: tuple, dst: tuple, inner):
        self.src, self.dst, self.inner = src, dst, inner

    def __bool__(self) -> bool:
        return True


def _flatten(a) -> list:
    out = []
    stack = [(a, 0, ())]
    while stack:
        x, k, ren = stack.pop()
        if isinstance(x, _Shift):
            stack.append((x.inner, k + x.k, ren))
            continue
        if isinstance(x, _Rename):
            stack.append((x.inner, k, ren + (dict(zip(x.src, x.dst)),)))
            continue
        if not x:
            continue
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], MachineView):
            h = x[0]
            for m in reversed(ren):              # the innermost rename first
                h = m[h]
            out.append((h, MachineView(x[1].start + k, x[1].dims)) if k else (h, x[1]))
        else:
            stack.extend((y, k, ren) for y in x)
    return out


# --- exhaustive reference (tests) ----------------------------------------------------------------

def exhaustive_mapping(g: PCG, model: CostModel, limit: int = 2_000_000,
                       memory: bool = False) -> tuple[float, dict]:
    """The optimum over the DP's search space by brute force: every way to run each parallel split
    (one after the other, or side by side on every split of the resource by quantity, both
    orientations) and every combination of views of every node inside its resource, each priced by
    summing leaf costs over series and taking the max over side-by-side branches.  With ``memory``,
    only mappings whose memory per device (:func:`search.memory.memory_per_device`) fits the
    device's capacity count: the fastest mapping that fits (``inf`` if none does).  Exponential: for
    tests on small graphs only (raises ValueError past ``limit`` combinations)."""
    gc = GraphCost(g, model)
    cap = model.machine.device.usable_bytes
    nmem: dict = {}

    def fits(views) -> bool:
        per: dict = {}
        for n, v in views.items():
            hit = nmem.get((n, v))
            if hit is None:
                w, a = node_memory(gc, n, v)
                hit = nmem[(n, v)] = [(d, w.get(d, 0) + a.get(d, 0)) for d in set(w) | set(a)]
            for d, b in hit:
                per[d] = per.get(d, 0) + b
        return max(per.values(), default=0) <= cap
    dec = decompose(g, gc.role)
    m = model.machine

    def allocs(t, res):
        if isinstance(t, Leaf):
            yield {t.unit: res}, ()
        elif isinstance(t, Series):
            def rec(i):
                if i == len(t.children):
                    yield {}, ()
                    return
                for a1, m1 in allocs(t.children[i], res):
                    for a2, m2 in rec(i + 1):
                        yield {**a1, **a2}, m1 + m2
            yield from rec(0)
        else:
            for a1, m1 in allocs(t.left, res):
                for a2, m2 in allocs(t.right, res):
                    yield {**a1, **a2}, m1 + m2 + ((id(t), "seq"),)
            for r1, r2 in res.splits(m):
                for x, y in ((t.left, t.right), (t.right, t.left)):
                    for a1, m1 in allocs(x, r1):
                        for a2, m2 in allocs(y, r2):
                            yield {**a1, **a2}, m1 + m2 + ((id(t), "side"),)

    def value(t, leaf_costs, modes):
        if isinstance(t, Leaf):
            return leaf_costs[t.unit]
        if isinstance(t, Series):
            return sum(value(c, leaf_costs, modes) for c in t.children)
        a, b = value(t.left, leaf_costs, modes), value(t.right, leaf_costs, modes)
        return a + b if modes[id(t)] == "seq" else model.side_by_side(a, b)

    best, best_views, count = INF, {}, 0
    order = [n for u in dec.units for n in u]
    for alloc, modes in allocs(dec.tree, Resource.whole(m)):
        modes = dict(modes)
        res_of = {n: alloc[dec.unit_of[n]] for n in order}
        cands = [gc.views(n, res_of[n]) for n in order]
        for combo in product(*cands):
            count += 1
            if count > limit:
                raise ValueError(f"exhaustive enumeration exceeds {limit} combinations")
            views = dict(zip(order, combo))
            leaf = [sum(gc.leaf_cost(n, views[n], views).time for n in u) for u in dec.units]
            v = value(dec.tree, leaf, modes)
            if v < best and (not memory or fits(views)):
                best, best_views = v, views
    return best, best_views


__all__ = ["MachineMapper", "MappingResult", "exhaustive_mapping"]
