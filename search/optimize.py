"""The joint optimizer behind `unity-pcg optimize`, the demo and the benchmarks.

    from unity_pcg.search.optimize import optimize
    res = optimize("model.onnx", "summit:2x6", budget_s=30)
    res.plan.save("plan.json"); print(res.json()["predicted_iteration_s"])

Strategies:

* ``unity`` (default): the joint search, one mechanism for every model.  The candidates are data
  parallelism (by rules: the floor), the layout proposals of :mod:`search.layouts` (Alpa's intra-operator
  ILP over every operator's labels, on every logical 2-D mesh of the machine in an order that follows from
  the machine, as many as the budget allows), each reached by rules from the imported graph where the rules
  reach it (:func:`search.realize.realize`), and the best-first substitution search of the graph's segments
  (:mod:`search.split`, :mod:`search.substitution`) started from data parallelism and the segments' layouts
  reached by rules; the segments' choices are combined and replayed on the whole graph, so the plan records
  a rule sequence from the imported graph.  The fixed strategies that apply (:data:`FLOOR_STRATEGIES`:
  ZeRO-3 and Megatron-LM as their users tune them, :mod:`search.tuned`) are priced too: the plan is never
  predicted slower than one of them.  Where nothing fits memory at the full batch, gradient accumulation
  (one stage, M micro-batches, each laid out by data parallelism or a mesh's ILP, with the memory
  techniques: :func:`search.tuned.accumulate`) is searched in the layouts phase.  ``info.search.chosen`` names the
  mechanism of the plan returned: ``"layout mesh 8x6 by rules"``, ``"layout mesh 8x6 (ILP, not by
  rules)"``, ``"search"``, ``"data parallel by rules"``, ``"pipeline"``, ``"<name> baseline (...)"``.
* ``sequential`` (TASO then FlexFlow, Unity Fig. 15b): algebraic rules only, to convergence, priced
  on one device; then parallelization rules only from that graph; the same total budget.
* ``dp``, ``megatron``, ``expert``, ``none``: the fixed strategies of :func:`search.baselines.build_strategy`
  (built by hand, so their plans record no rule sequence).

Pipelines: with ``pipeline=True`` (unity), the pipeline phase (after the segments and the pricing, whose
work stops PIPELINE_MIN_SHARE of the budget before the hard end, so its least share is never taken by work
that runs late) runs the 1F1B stage search of :mod:`search.pipeline`;
its plan is taken at the end when it is predicted faster than the chosen one, and then records its stages
(``Plan.pipeline``) and the rule sequence of the PCG inside them where the rules reach it.

Budgets: ``budget_s`` seconds of wall time for the whole call, import included, split into the named
phases of :data:`search.budget.PHASES` (floors, layouts, segments, pricing, pipeline, final),
each with a deadline the solvers check at their loop heads (the mapping DP at every subproblem, rule
application at every match round, the best-first search and the stage search at every step; no signals,
so any thread); when time is up the best plan priced so far is returned, and nothing runs past the hard
end (the budget plus 5%, at least 2 s).  ``max_candidates`` expanded candidates per segment; with a
candidate budget that is reached first the result does not depend on the machine's speed, so the same
seed gives the same plan.  A KeyboardInterrupt during the search stops it and the best plan so far is
returned (``result.interrupted``).  One DP solve of a candidate is limited to ``price_limit_s`` (default
max(1 s, budget / 30)); a slower one prices the candidate inf.
"""
from __future__ import annotations

import gc
import hashlib
import json
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec, Resource, parse_machine
from unity_pcg.pcg import PCG

from .budget import Budget, Deadline, Expired, linear, scope_passed, within
from . import budget as B
from .runnable import runnable
from .substitution import (Candidate, RuleBook, RuleStep, best_first, data_parallel_steps, dp_rule_missing,
                           neighbours, normalized_hash, trimmed)

INF = math.inf
SEARCHES = ("unity", "sequential")
FIXED = ("dp", "megatron", "expert", "none", "zero3")
TUNED = ("megatron", "zero3")     # fixed strategies as their users tune them (search/tuned.py)
STRATEGIES = SEARCHES + FIXED + ("alpa",)     # alpa: Alpa's planner (search/alpa/), priced in our model


class OptimizeError(UnityError, ValueError):
    """Bad input to the optimizer (unknown strategy, budget, batch the machine cannot split)."""


def machine_degrees(m: MachineSpec) -> list[int]:
    """Parallel degrees that fit the machine's hierarchy: a divisor of the devices per node times a
    divisor of the number of nodes (1 excluded)."""
    dpn, nodes = m.devices_per_node, m.nodes
    out = {a * b for a in range(1, dpn + 1) if dpn % a == 0 for b in range(1, nodes + 1) if nodes % b == 0}
    out.discard(1)
    return sorted(out)


def search_degrees(m: MachineSpec) -> list[int]:
    """Degrees enumerated for rules that introduce parallelism during the search: those inside a node
    and the whole machine (data-parallel seeds cover the others)."""
    dpn = m.devices_per_node
    return sorted({d for d in machine_degrees(m) if d <= dpn} | {m.num_devices} - {1})


@dataclass
class OptimizeResult:
    plan: Any                                    # unity_pcg.plan.Plan
    strategy: str
    mapping: Any                                 # MappingResult of the plan's PCG
    dp: Any | None                               # MappingResult of data parallelism (None: not buildable)
    steps: list = field(default_factory=list)    # RuleStep sequence (unity / sequential)
    search_s: float = 0.0
    stats: dict = field(default_factory=dict)
    interrupted: bool = False
    batch: int | None = None

    @property
    def predicted_iteration_s(self) -> float:
        return self.mapping.cost

    @property
    def feasible(self) -> bool:
        return bool(self.mapping.feasible)

    @property
    def speedup_over_dp(self) -> float | None:
        if self.dp is None or not self.dp.feasible or not self.feasible:
            return None
        return self.dp.cost / self.mapping.cost

    def json(self) -> dict:
        r = self.mapping
        mem = r.memory
        t = r.cost if math.isfinite(r.cost) else None
        dpt = self.dp.cost if self.dp is not None and math.isfinite(self.dp.cost) else None
        return {"strategy": self.strategy, "feasible": self.feasible, "reason": r.reason,
                "predicted_iteration_s": t,
                "throughput_samples_s": (self.batch / t) if t and self.batch else None,
                "search_s": self.search_s,
                "data_parallel_iteration_s": dpt,
                "data_parallel_memory_plan": _memory_summary(self.dp),
                "data_parallel_feasible": bool(self.dp.feasible) if self.dp is not None else None,
                "data_parallel_reason": self.dp.reason if self.dp is not None else "not buildable",
                "speedup_over_dp": self.speedup_over_dp,
                "comm_elements": r.breakdown.comm_elements,
                "max_memory_bytes": mem.max_bytes if mem else None,
                "memory_per_device": {str(d): v for d, v in sorted(mem.per_device.items())} if mem else {},
                "devices": r.devices, "devices_used": r.stats.get("devices_used", 0),
                "batch": self.batch, "rule_steps": len(self.steps), "interrupted": self.interrupted,
                "search": dict(self.stats)}


def _memory_summary(r) -> dict | None:
    """What the memory techniques made of mapping ``r`` (``data_parallel_memory_plan``): its ZeRO stage, offload
    and recomputed regions; all zero/False for a mapping priced plainly (``memory_techniques=False``, or no
    technique chosen), None without a mapping.  The data-parallel floor is priced with its cheapest techniques
    and overlap, as every candidate is, so its price is `simulate --strategy dp`'s (plain DDP) only when this
    is empty: at 1,024 GPUs ZeRO-3 (one collective per unit) beats DDP's 25 MiB buckets, each paying a ring
    latency."""
    if r is None:
        return None
    mp = getattr(r, "memory_plan", None)
    if mp is None:
        return {"zero": 0, "offload": False, "recompute_regions": 0}
    return {"zero": mp.zero, "offload": bool(mp.offload), "recompute_regions": len(mp.recompute)}


# --- evaluation ----------------------------------------------------------------------------------------

def _id_signature(g: PCG) -> str:
    """Which node id holds which node (ids with their structural node hashes): equal for two graphs exactly
    when a mapping of one (views by node id) is a mapping of the other."""
    return hashlib.blake2b(json.dumps([[i, g.node_hash(i)] for i in sorted(g.node_ids())]).encode(),
                           digest_size=16).hexdigest()


class Evaluator:
    """Prices candidate PCGs with one MachineMapper (its memo is shared by every candidate).  Every solve
    runs under a deadline (:mod:`search.budget`): the candidate's own limit, the phase's :attr:`wall`
    and the :attr:`hard` end, the soonest; the mapper checks it at every subproblem and a cut solve is
    priced inf (the mapper writes a memo entry only once a subproblem is solved, so it stays consistent)."""

    def __init__(self, machine: MachineSpec, optimizer: str, limit_s: float | None = None, precision: str = "fp32",
                 clock: Callable[[], float] | None = None, techniques: bool = True):
        from .cost import CostModel
        from .mapping import MachineMapper
        self.machine = machine
        self.mapper = MachineMapper(CostModel(machine, optimizer=optimizer, precision=precision),
                                    techniques=techniques)
        self.calls = 0
        self.timeouts = 0
        self.limit_s = limit_s
        self.clock = clock or time.monotonic
        #: the phase's wall: a solve is cut there (not started once it has passed), unless ``wall=False``
        self.wall: Deadline | None = None
        #: no solve at all runs past it (the budget's hard end; None: none)
        self.hard: Deadline | None = None
        #: clock time at which the last solve under :attr:`wall` ended (ended or was cut)
        self.last_walled_end = 0.0
        self._memo: dict = {}
        self._timed_out: dict = {}
        self._kept: dict = {}
        #: mappings :meth:`cheap` priced without the memory techniques, past the hard end (or their choice cut)
        self.plain_past_end = 0

    def cost(self, g: PCG, resource: Resource | None = None, limited: bool | float = True,
             wall: bool = True, keep: bool = False) -> float:
        """The DP's predicted iteration time (inf when infeasible or cut).  With ``limit_s``, a candidate
        whose DP solve takes longer is priced inf (pruned): on large machines, graphs that leave
        most operators on a few devices have many machine views per operator and solve slowly, and
        are never competitive.  ``limited``: True (``limit_s``), a number of seconds, or False (no
        limit of its own); a solve also stops at :attr:`wall` (unless ``wall=False``) and at :attr:`hard`.
        ``keep``: remember the mapping (:meth:`kept`), for a whole-graph candidate that may be the plan."""
        key = (g.structural_hash(), resource)
        c = self._memo.get(key)
        if c is None and limited:
            c = self._timed_out.get(key)
        if c is None:
            own_s = self.limit_s if limited is True else (limited or None)
            own = Deadline.after(own_s, self.clock) if own_s else None
            walled = wall and self.wall is not None
            dl = self.wall.sooner(own) if walled else own
            if self.hard is not None:
                dl = self.hard.sooner(dl)
            if dl is not None and dl.left() <= 0.01:        # past the wall: not started (and not remembered)
                self.timeouts += 1
                return INF
            self.calls += 1
            try:
                with within(dl):
                    if resource is not None and resource.size == 1:
                        # one device: one view per operator, so the DP's mapping is the linear one
                        r = self.mapper.first_views(g, resource, self.pins(g, resource))
                    else:
                        r = self.mapper.optimize(g, resource=resource, fixed=self.pins(g, resource))
                c = self._memo[key] = r.cost if r is not None and r.feasible else INF
                if keep:
                    self._kept[key] = (_id_signature(g), r)
            except Expired:             # remembered for limited calls only (not when a wall cut it)
                self.timeouts += 1
                c = INF
                if own is not None and dl is own:
                    self._timed_out[key] = INF
            if walled:
                self.last_walled_end = self.clock()
        return c

    def kept(self, g: PCG, resource: Resource | None = None):
        """The mapping of ``g`` a ``cost(..., keep=True)`` call solved (None: none).  Costs are remembered by
        structural hash, which is blind to node ids, but a mapping's views (and recompute regions) name node
        ids: the mapping kept for a structurally equal graph with other ids (a layout realized by another
        rule order) is not ``g``'s, so it is returned only when the node ids match."""
        got = self._kept.get((g.structural_hash(), resource))
        if got is None or got[0] != _id_signature(g):
            return None
        return got[1]

    def estimate(self, g: PCG) -> float:
        """Forward + backward compute of one task of every compute operator (no DP): the order in
        which the search prices sibling candidates."""
        t = 0.0
        for n in g.nodes():
            if n.kind == "compute":
                f, b = self.mapper.model.op_time(n.op, n.a, g.input_shapes(n.id), g.shapes(n.id))
                t += f + b
        return t

    def pins(self, g: PCG, resource: Resource | None = None):
        """Views fixed for the DP: a fixed strategy's pins (``meta["pinned"]``), else the round-robin
        placement of one-task embedding tables (:func:`search.baselines.table_pins`) on the whole
        machine; None: the DP's default (the meta pins)."""
        if g.meta.get("pinned") or (resource is not None and resource != Resource.whole(self.machine)):
            return None
        from .baselines import table_pins
        return table_pins(g, self.machine) or None

    def full(self, g: PCG, resource: Resource | None = None, deadline: Deadline | None = None):
        """The mapping of ``g`` (raises :class:`search.budget.Expired` past ``deadline`` or :attr:`hard`)."""
        dl = self.hard.sooner(deadline) if self.hard is not None else deadline
        with within(dl):
            return self.mapper.optimize(g, resource=resource, fixed=self.pins(g, resource))

    def cost_without_dp(self, g: PCG) -> float:
        """The price of :meth:`cheap`'s mapping of ``g`` (kept, as ``cost(keep=True)`` keeps a solve's)."""
        r = self.cheap(g)
        if r is None:
            return INF
        self._kept[(g.structural_hash(), None)] = (_id_signature(g), r)
        return r.cost if r.feasible else INF

    def cheap(self, g: PCG, resource: Resource | None = None):
        """A mapping of ``g`` without the DP (:meth:`MachineMapper.first_views`, with the pins); the last
        resort when even data parallelism's DP solve does not finish within the budget (a small batch on
        a large machine).  Past the :attr:`hard` end, or where the deadline of the caller's scope cuts their
        choice (search/memtech.py checks it), it is priced without the memory techniques (their choice is a
        search over the plan's regions: seconds on a full-depth decoder on a starved core, where only linear
        work may run); :attr:`plain_past_end` counts those mappings."""
        pins = self.pins(g, resource)
        if not getattr(self.mapper, "default_techniques", False):
            return self.mapper.first_views(g, resource, pins)
        if (self.hard is None or not self.hard.passed()) and not scope_passed():
            # (a choice the deadline cuts returns the plain mapping it had priced: not priced twice; the
            # choice stops at the hard end where no scope of the caller's bounds it)
            with within(self.hard):
                r = self.mapper.first_views(g, resource, pins, plain_when_cut=True)
            if r is None or not r.stats.get("techniques_cut"):
                return r
        else:                   # past the end already: not started
            r = self.mapper.first_views(g, resource, pins, techniques=False)
        self.plain_past_end += 1
        return r


# --- the searches ----------------------------------------------------------------------------------------

def _segment_search(g: PCG, book: RuleBook, ev: "Evaluator", dp_deg: int, k: int, max_candidates: int,
                    alpha: float, progress, deadline: "Deadline | float", seeds: Callable | None = None,
                    price_dp_seeds: bool = True):
    """The split search (module docstring), until ``deadline`` (a :class:`search.budget.Deadline`; a
    number is a ``time.perf_counter`` instant).  Returns (searched graph, its steps, data parallelism
    by rules at ``dp_deg`` assembled from the segments' seeds, its steps, stats, interrupted).

    Every distinct canonical segment starts from itself, its data-parallel version at ``dp_deg`` (by rules:
    the floor's piece) and ``seeds(segment_graph, deadline)`` (a list of :class:`Candidate`: the layout
    proposals of the segment reached by rules; none when not given).  Two passes: every segment's seeds
    first, then the best-first search of each, each with its share of the time left."""
    from .split import SegmentChoice, assemble, blocking_pairs, boundary_keys, canonical_segments, combine
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline, time.perf_counter)
    segs, later = canonical_segments(g, k, blocking_pairs(book))
    uniq = list(dict.fromkeys(s.key for s in segs))
    memo: dict = {}
    dp_memo: dict = {}
    totals = {"segments": len(segs), "distinct_segments": len(uniq), "explored": 0, "evaluated": 0,
              "stopped": [], "layout_seeds": 0}
    interrupted = False

    def evaluate(x: PCG):
        return ev.cost(trimmed(x)), None

    def choice(c: Candidate, kk, cross_idx) -> SegmentChoice:
        cross = kk[1][cross_idx[0]] if cross_idx else None
        # with its trailing gathers (what a mismatch at the next boundary pays); past the deadline
        # not priced: such a choice must then match its neighbour
        full = ev.cost(c.graph) if not deadline.passed() else INF
        return SegmentChoice(c.cost, full, c.steps, kk, cross)

    starts: list = []
    for i, key in enumerate(uniq):                  # pass 1: every segment's seeds
        seg = next(s for s in segs if s.key == key)
        cg = seg.canon
        cross_idx = [j for j, r in enumerate(seg.outputs) if r in later[segs.index(seg)]]
        # the segment as imported is a seed priced when it reaches the front (its estimate is the largest)
        start = [Candidate(None, cg, ())]
        dp_seed = None
        if not interrupted:
            try:
                x, st = data_parallel_steps(cg, dp_deg, book) if dp_deg > 1 else (cg, [])
            except KeyboardInterrupt:
                interrupted = True
                x, st = cg, []
            if st:
                # priced without a per-solve limit (a data-parallel graph solves fast, and the floor needs
                # it), up to the wall; past the deadline only built (dp by rules is assembled from it);
                # not priced when data parallelism's own solve did not finish (``price_dp_seeds``)
                dp_seed = Candidate(ev.cost(trimmed(x), limited=False) if price_dp_seeds and not deadline.passed()
                                    else None, x, tuple(st))
                start.append(dp_seed)
        if seeds is not None and not interrupted and not deadline.passed():
            share = Deadline(deadline.clock() + max(deadline.left(), 0.0) / (2 * (len(uniq) - i)), deadline.clock)
            try:
                more = seeds(cg, deadline.sooner(share))
            except KeyboardInterrupt:
                interrupted, more = True, []
            start.extend(more)
            totals["layout_seeds"] += len(more)

        def keyf(x: PCG, seg=seg):
            return boundary_keys(seg, x)
        if dp_seed is not None and dp_seed.cost is not None:
            dp_memo[key] = choice(dp_seed, keyf(dp_seed.graph), cross_idx)
        elif dp_seed is not None:           # built past the deadline, not priced
            dp_memo[key] = SegmentChoice(INF, INF, dp_seed.steps, keyf(dp_seed.graph))
        else:
            dp_memo[key] = SegmentChoice(INF if start[0].cost is None else start[0].cost, INF, (), keyf(cg))
        starts.append((key, start, keyf, cross_idx))
    for i, (key, start, keyf, cross_idx) in enumerate(starts):     # pass 2: the search of each segment
        share = max(deadline.left(), 0.0) / (len(uniq) - i)

        def expand(c: Candidate):
            for m, x in neighbours(c.graph, book.expansion, book.degrees):
                yield x, (RuleStep.of(m),)

        def prog(stats, best, i=i):
            if progress is not None:
                progress({"segment": i + 1, "segments": len(uniq),
                          "explored": totals["explored"] + stats.explored, "best_segment_s": best})

        # this segment's share of the time left (on the deadline's clock)
        res = best_first(start, expand, evaluate, alpha, 0 if interrupted else max_candidates, INF,
                         key=keyf, estimate=ev.estimate, progress=prog,
                         deadline=deadline.sooner(Deadline(deadline.clock() + share, deadline.clock)))
        totals["explored"] += res.stats.explored
        totals["evaluated"] += res.stats.evaluated
        totals["stopped"].append(res.stats.stopped)
        if res.stats.stopped == "interrupted":
            interrupted = True
        memo[key] = {kk: choice(c, kk, cross_idx) for kk, c in res.front.items() if math.isfinite(c.cost)}
    for key in uniq:
        memo.setdefault(key, {})
    # assembling completes a plan: it runs past the segments' scope, so that once every segment's seeds were
    # built the floor (dp by rules) and the search's result exist; but not past the budget's hard end: on a
    # graph of thousands of operators its boundary cancellations are not linear (Expired: segments_cut)
    with linear(), within(ev.hard):
        dp_graph, dp_steps = assemble(g, segs, [dp_memo[s.key] for s in segs], book)
        choices = combine([memo[s.key] for s in segs])
        if not choices:
            return None, [], dp_graph, dp_steps, totals, interrupted
        out, steps = assemble(g, segs, choices, book)
    return out, steps, dp_graph, dp_steps, totals, interrupted


#: the fixed strategies (besides dp) the joint search prices as floors, where they apply, in this order; those of
#: :data:`TUNED` as their users tune them (search/tuned.py: Megatron-LM's grid, FSDP's ZeRO-3), so the plan is
#: never predicted slower than, and is feasible wherever, one of them that was priced
FLOOR_STRATEGIES = ("zero3", "megatron", "expert")


# --- candidates -----------------------------------------------------------------------------------------

#: the order in which equally fast candidates are preferred: data parallelism by rules (the floor), the
#: search's result, then the layout proposals (then the order they were found in)
FLOOR, SEARCH, LAYOUT = 0, 1, 2
#: relative difference under which two predicted times are the same (the rules' version of a layout prices
#: like the ILP's own up to the last bits)
TIE = 1e-6
#: the prices on memory (in units of the fastest layout's seconds per byte, :func:`search.alpa.intra.solve_intra`)
#: of the leaner layouts gradient accumulation offers beside each mesh's fastest: at 1, a layout that saves a
#: share of the fastest's memory for up to that share more time (a mesh bounds how far a layout can shard:
#: on a decoder the front's points between 1/4 and 4 are one layout per mesh)
MEMORY_PRICES = (1.0,)


@dataclass
class PlanCandidate:
    """One plan the policy compares: the mechanism that produced it (``info.search.chosen`` names the one
    returned), its PCG, its predicted iteration time and the rule steps that reach it."""
    mechanism: str                  # "search", "data parallel by rules", "layout mesh 8x6 by rules", ...
    pcg: PCG                        # the plan's PCG (a rule-reached one without its output gathers)
    cost: float                     # predicted iteration time (inf: infeasible, or not priced within the budget)
    steps: tuple = ()               # RuleStep sequence from the imported graph
    rank: int = LAYOUT              # tie-break among equal costs (FLOOR, SEARCH, LAYOUT)
    by_rules: bool = True           # the plan records ``steps`` (False: a hand-built baseline, a fallback)
    mapping: Any = None             # its MappingResult (or a pipeline's) once known
    pipeline: Any = None            # the PipelineResult of a pipeline plan

    @property
    def rules_json(self) -> tuple | None:
        return tuple(s.to_json() for s in self.steps) if self.by_rules else None


def _fixed_baselines(run: "_Run", until: Deadline) -> dict:
    """{name: (PCG, predicted cost or inf, note, MappingResult or None)} of the fixed strategies of
    :data:`FLOOR_STRATEGIES` that apply to the model, priced before ``until`` (the pipelines of the tuned
    ones in ``run.floor_pipes``), in two passes so that no floor's grid starves another floor or a later
    phase:

    1. every floor's *plain* point, the cheapest to price: the strategy as ``--strategy NAME`` builds it
       untuned (Megatron's tensor parallelism inside a node; the tuned ones' first grid point,
       :func:`search.tuned.tune` with ``grid=False``), each with an equal share of the time left to ``until``
       (a solve cut there is priced without the DP, so every floor that applies has a price);
    2. the tuned grids (:data:`TUNED`, as ``--strategy NAME`` prices them), each bounded by an equal share of
       the time left to ``until`` (a grid that ends early leaves its time to the next); the grid
       prices the plain point first again, from the mapper's memo (a cut solve continues where it stopped),
       and replaces the plain price only where it found a faster point.

    Their layouts are not all reachable by the shipped rules (Megatron runs the operators between its
    groups on the tensor-parallel copies; the expert strategy splits a communication-intensive Linear on
    top of data parallelism; the tuned ones micro-batch and pipeline), so the search cannot be relied on
    to find them; where one is faster than every plan of the search, it is returned, recorded as a fixed
    strategy (as the dp baseline is)."""
    from .tuned import floor
    g, ev, degree, m = run.g, run.ev, run.dp_deg, run.m
    out: dict = {}
    names = list(FLOOR_STRATEGIES)
    for i, name in enumerate(names):            # 1. the plain points
        if until.passed():              # built and priced when the floors resume (_resume_cut_floors)
            out[name] = (None, INF, "not built within the budget", None)
            continue
        own = Deadline(until.clock() + max(until.left(), 0.0) / (len(names) - i), until.clock).sooner(until)
        if name in TUNED:
            pg, c, note, r, pipe = floor(run, name, own, grid=False)
            if pg is not None:
                out[name] = (pg, c, note, r)
                run.floor_pipes[name] = pipe
            continue
        pg = _build_floor(g, name, degree, m)
        if pg is not None:
            out[name] = _price_baseline(ev, pg, own)
    grids = [n for n in names if n in TUNED and n in out]
    for i, name in enumerate(grids):            # 2. the tuned grids, each bounded
        if until.left() <= 0.05:
            break
        share = max(until.left(), 0.0) / (len(grids) - i)
        own = Deadline(until.clock() + share, until.clock).sooner(until)
        pg, c, note, r, pipe = floor(run, name, own, cheap=False)
        if pg is not None and (c < out[name][1] or (out[name][3] is None and r is not None)):
            out[name] = (pg, c, note, r)
            run.floor_pipes[name] = pipe
    return out


def _build_floor(g: PCG, name: str, degree: int, m: MachineSpec) -> PCG | None:
    """The fixed strategy ``name``'s PCG as ``--strategy NAME`` builds it; None where it does not apply."""
    from .baselines import StrategyError, build_strategy
    try:
        return build_strategy(g, name, degree, devices_per_node=m.devices_per_node)
    except StrategyError:
        return None


def _price_baseline(ev: "Evaluator", pg: PCG, until: Deadline) -> tuple:
    """(PCG, cost or inf, note, MappingResult or None) of a fixed strategy's PCG mapped before ``until``
    (its mapping is kept: the plan needs it when the baseline is returned)."""
    if until.left() <= 0.05:
        return (pg, INF, "not priced within the budget", None)
    try:
        r = ev.full(pg, deadline=until)
    except Expired:
        return (pg, INF, "not priced within the budget", None)
    return (pg, r.cost if r.feasible else INF, "" if r.feasible else (r.reason or "infeasible"), r)


def _whole_search(g: PCG, rules, book: RuleBook, cost: Callable[[PCG], float], until: Deadline,
                  max_candidates: int, alpha: float, progress, start_steps=()) -> tuple:
    """Best-first search over the whole graph with ``rules`` until ``until`` (the sequential strategy)."""
    def evaluate(x):
        return cost(x), None

    def expand(c):
        for m, x in neighbours(c.graph, rules, book.degrees):
            yield x, (RuleStep.of(m),)

    def prog(stats, best):
        if progress is not None:
            progress({"explored": stats.explored, "best_s": best})

    res = best_first([Candidate(cost(g), g, tuple(start_steps))], expand, evaluate, alpha, max_candidates,
                     INF, progress=prog, deadline=until)
    return res.best.graph, list(res.best.steps), res.stats


def _dp_steps_by_segments(g: PCG, dp_deg: int, book: RuleBook, k: int) -> tuple[PCG, list]:
    """Data parallelism by rules on ``g`` at ``dp_deg``: :func:`data_parallel_steps` run on each distinct
    canonical segment once and assembled (:func:`search.split.assemble`), as the segment search builds the
    floor -- the same rule sequence as on the whole graph, in time linear in the graph (a deep model's
    segments repeat; the whole-graph build's boundary cancellations are not linear)."""
    from .split import SegmentChoice, assemble, blocking_pairs, boundary_keys, canonical_segments
    segs, _ = canonical_segments(g, k, blocking_pairs(book))
    memo: dict = {}
    for seg in segs:
        if seg.key not in memo:
            x, st = data_parallel_steps(seg.canon, dp_deg, book)
            memo[seg.key] = SegmentChoice(INF, INF, st, boundary_keys(seg, x))
    return assemble(g, segs, [memo[seg.key] for seg in segs], book)


def _price_dp_by_rules(ev: "Evaluator", g: PCG, book: RuleBook, dpg: PCG, steps, dp_pg: PCG | None,
                       left: Callable[[], float], stats: dict, dp_cut: bool = False,
                       until: Deadline | None = None) -> PlanCandidate:
    """Data parallelism by rules, the search's floor.  When it is exactly the hand-built dp PCG (normalized
    structural hash) it is priced with no limit of its own (a data-parallel graph at full degree solves as
    fast as the baseline did, from the mapper's memo; the budget's hard end still bounds it), or, when the
    baseline's solve was cut (``dp_cut``), mapped as the baseline then was, without the DP (the memory
    techniques' choice, a search, stops at ``until``: then none); otherwise (an
    operator without a dp rule stays whole) within the time left, and ``stats["dp_by_rules"]`` says how it
    differs."""
    t = trimmed(dpg)
    same = dp_pg is not None and normalized_hash(t) == normalized_hash(dp_pg)
    info: dict = {"equal_to_baseline": same, "steps": len(steps)}
    if not same:
        miss = dp_rule_missing(g, book)
        info["missing_dp_rules"] = miss
        lw = {}
        for n in t.nodes():          # compute operators the rules left whole (one task)
            if n.kind == "compute" and all(s.piece_count == 1 for s in t.shapes(n.id)):
                lw[n.op] = lw.get(n.op, 0) + 1
        info["left_whole"] = dict(sorted(lw.items()))
        info["differs"] = (f"operators without a dp rule: {', '.join(miss)}" if miss
                           else "no dp rule applies to " + (", ".join(f"{k} x{v}" for k, v in sorted(lw.items()))
                                                            or "an operator"))
    stats["dp_by_rules"] = info
    if scope_passed() or (ev.hard is not None and ev.hard.passed()):   # assembled past the end: no DP
        with linear():
            c = ev.cost_without_dp(t)
        info["mapping"] = "without the DP (assembled past the end of its scope)"
    elif same and dp_cut:
        with within(until):
            c = ev.cost_without_dp(t)
        info["mapping"] = "without the DP (as data parallelism's)"
    elif same:
        c = ev.cost(t, limited=False, wall=False, keep=True)
    else:
        c = ev.cost(t, limited=left(), keep=True)
    return PlanCandidate("data parallel by rules", t, c, tuple(steps), FLOOR)


class _PipelineMapping:
    """A pipeline result seen through the MappingResult fields the optimizer reports."""

    def __init__(self, p, devices: int):
        from .cost import LeafCost
        from .memory import MemoryReport
        self.cost, self.feasible, self.reason, self.views = p.cost, p.feasible, p.reason, dict(p.views)
        self.breakdown = LeafCost(p.cost, comm_elements=p.comm_elements)
        self.memory = MemoryReport(dict(p.memory), {}, {}, p.capacity)
        self.devices = devices
        used = {d for s in p.stages for d in s.devices}
        self.stats = {"devices_used": len(used), "pipeline": p.to_json()}
        self.memory_plan = getattr(p, "memory_plan", None)     # each stage's techniques (search/pipeline.py)

    def to_json(self) -> dict:
        return {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.reason, "devices": self.devices,
                "comm_elements": self.breakdown.comm_elements, "max_memory_bytes": self.memory.max_bytes,
                "memory_per_device": {str(d): v for d, v in sorted(self.memory.per_device.items())},
                "stats": dict(self.stats)}


def _pipeline(g: PCG, ev: "Evaluator", budget_s: float, hard: Deadline | None = None, accept=None,
              near: int | None = None):
    """The best 1F1B pipeline (search/pipeline.py), or None: the stage search gets ``budget_s`` seconds
    (it finishes the number of micro-batches it is pricing) and is cut at ``hard``.  One stage with M
    micro-batches is gradient accumulation: in the space too (Alpa's GPT plans at batch 1024 are often
    just that).  Every stage may be data parallel or laid out by the layout ILP on its sub-mesh
    (``pipeline.ilp_intra``, the proposals' ILP), over Unity's layering and Alpa's (``clusterings``): the stage
    DP chooses by price.  ``accept(result)``: why the
    caller cannot use a plan (the executor's check), so the search returns the fastest it can."""
    try:
        from .pipeline import PipelineError, ilp_intra
        from .pipeline import search_pipeline as _search
    except ImportError:
        return None
    model, machine = getattr(ev.mapper, "model", None), getattr(ev, "machine", None)
    # (the ILP without memory rows, with ZeRO-1's update, where the techniques are priced, as in accumulation)
    techniques = bool(getattr(ev.mapper, "default_techniques", False))
    layouts = (ilp_intra(machine, optimizer=model.optimizer, precision=model.precision,
                         memory_budget=math.inf if techniques else None, batch=_batch_of(g),
                         sharded_update=techniques),) \
        if model is not None and machine is not None else ()

    def search_pipeline(*a, **kw):
        kw.setdefault("layouts", layouts)
        return _search(*a, accept=accept, clusterings=("fewest", "valid"), **kw)
    clock = hard.clock if hard is not None else time.perf_counter
    t0 = clock()
    # nothing may fit with the default micro-batch counts (at most 8 per stage): a large batch (a language
    # model's 1,024 sequences) may need many more micro-batches before one micro-batch's activations fit
    b = _batch_of(g)
    more = [m for m in (64, 128, 256, 512, 1024) if b and b % m == 0]
    try:       # the whole share, unless the fallbacks below may need time
        r = search_pipeline(g, ev.mapper, min_stages=1, budget_s=max(budget_s / 2 if more else budget_s, 0.01),
                            deadline=hard, near=near)
    except (PipelineError, UnityError, KeyboardInterrupt, Expired):      # Ctrl-C: keep the plan found so far
        return None
    if r is not None and r.feasible and more and (r.stats or {}).get("budget_exhausted") \
            and not (hard is not None and hard.passed()):
        # a feasible plan needs no fallback: the time kept for them goes to the micro-batch counts the first
        # search did not reach (the fastest is often the most micro-batches per stage, tried late)
        r = _more_micro_batches(g, ev, r, budget_s - (clock() - t0), hard, search_pipeline)
    if r is not None and r.feasible and not (hard is not None and hard.passed()):
        r = _finer_micro_batches(g, ev, r, budget_s - (clock() - t0), hard, search_pipeline, clock)
    if (r is None or not r.feasible) and more and not (hard is not None and hard.passed()):
        try:
            r2 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=more,
                                 budget_s=max(budget_s - (clock() - t0), 0.01), deadline=hard)
        except (PipelineError, UnityError, KeyboardInterrupt, Expired):
            return r
        if r2 is not None and (r is None or (r2.feasible, -r2.cost) > (r.feasible, -r.cost)):
            r = r2
    if (r is None or not r.feasible) and more and not (hard is not None and hard.passed()):
        # still nothing: stages data parallel inside hold every weight of the stage on each device;
        # Megatron's tensor parallelism inside the stages divides them (with the vocabulary-parallel
        # head: search/pipeline.py megatron_intra)
        from .pipeline import megatron_intra
        tensor_parallel = megatron_intra(ev.machine.devices_per_node)
        try:
            r3 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=more, intra=tensor_parallel,
                                 budget_s=max(budget_s - (clock() - t0), budget_s / 2, 0.01),
                                 deadline=hard)
        except (PipelineError, UnityError, KeyboardInterrupt, Expired):
            return r
        if r3 is not None and (r is None or (r3.feasible, -r3.cost) > (r.feasible, -r.cost)):
            r = r3
    return r


def _finer_micro_batches(g: PCG, ev: "Evaluator", r, budget_s: float, hard: Deadline | None, search_pipeline,
                         clock):
    """``r`` (a feasible pipeline) or a faster one at more micro-batches.  Where ``r``'s count is the largest
    its search tried (the price still fell there), twice as many while that divides the batch and prices
    faster, within ``budget_s`` seconds.  The default counts stop at 8 per stage (the bubble's bound); past
    them smaller micro-batches still shrink the activations each stage holds in flight (less recomputation)
    and the bubble, until a device's share of a micro-batch is too small to run efficiently: the price
    decides where that is."""
    from .pipeline import PipelineError, batch_size
    B = batch_size(g)
    M = r.micro_batches
    if any(m > M for m in r.stats.get("micro_batches_tried", ())):
        return r                        # the best count is inside the range tried
    end = clock() + budget_s
    walked = []
    while B % (2 * M) == 0 and clock() < end and not (hard is not None and hard.passed()):
        M *= 2
        walked.append(M)
        try:
            r2 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=[M], budget_s=max(end - clock(), 0.01),
                                 deadline=hard)
        except (PipelineError, UnityError, KeyboardInterrupt, Expired):
            break
        if r2 is None or not r2.feasible or r2.cost >= r.cost:
            break
        r = r2
    if walked:
        r.stats = dict(r.stats, finer_micro_batches=walked)
    return r


def _more_micro_batches(g: PCG, ev: "Evaluator", r, budget_s: float, hard: Deadline | None, search_pipeline=None):
    """``r`` (a feasible pipeline whose search stopped at its budget) or a faster one found by searching, within
    ``budget_s`` seconds, the default micro-batch counts ``r``'s search did not try (``search_pipeline``: the
    stage search as :func:`_pipeline` calls it)."""
    from .pipeline import PipelineError, batch_size, micro_batch_candidates
    if search_pipeline is None:
        from .pipeline import search_pipeline
    done = set(r.stats.get("micro_batches_tried", ())) | set(r.stats.get("micro_batches_refused", ()))
    rest = [m for m in micro_batch_candidates(batch_size(g)) if m not in done]
    if not rest or budget_s <= 0:
        return r
    try:
        r2 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=rest, budget_s=budget_s, deadline=hard)
    except (PipelineError, UnityError, KeyboardInterrupt, Expired):
        return r
    if r2 is None or not r2.feasible or r2.cost >= r.cost:
        return r
    r2.stats = dict(r2.stats, micro_batches_tried=sorted(set(r2.stats.get("micro_batches_tried", ())) | done))
    return r2


# --- the entry point -------------------------------------------------------------------------------------

def _load(model, batch):
    from unity_pcg.plan import file_sha256
    if isinstance(model, PCG):
        if batch is not None:
            raise OptimizeError("batch can only be set when optimizing a model file")
        sha = hashlib.sha256(json.dumps(model.to_json(), sort_keys=True, default=str).encode()).hexdigest()
        return model, "<in-memory PCG>", sha
    from unity_pcg.onnx_import import load_onnx
    try:
        sha = file_sha256(str(model))
    except OSError as e:
        raise OptimizeError(f"cannot read model file {model}: {e.strerror}") from None
    return load_onnx(str(model), batch=batch, load_weights=False), str(model), sha


def _batch_of(g: PCG) -> int | None:
    ins = g.sources("Input")
    if not ins:
        return None
    s = g.shape((ins[0].id, 0))
    return s.sizes[0] if s.rank else None


class _Run:
    """The state of one ``optimize`` call: its inputs, its budget, the evaluator, and what each step found."""

    def __init__(self, g: PCG, m: MachineSpec, strategy: str, budget: Budget, ev: Evaluator, *, alpha: float,
                 pipeline: bool, progress, max_candidates: int, k: int, rules, optimizer: str):
        self.g, self.m, self.strategy, self.budget, self.ev = g, m, strategy, budget, ev
        self.alpha, self.pipeline, self.progress = alpha, pipeline, progress
        self.max_candidates, self.k, self.rules, self.optimizer = max_candidates, k, rules, optimizer
        self.b = _batch_of(g)
        self.degrees = machine_degrees(m)
        self.n_dev = m.num_devices
        self.dps = [d for d in self.degrees if self.b is None or self.b % d == 0]
        self.dp_deg = max(self.dps, default=1)
        self.dp_pg = self.dp_res = None
        self.dp_cut = False                           # data parallelism's DP solve did not finish in its phase
        #: seconds data parallelism took to build and map, but the DP's solve and the memory techniques' choice
        #: (its linear part: measured on this host as loaded now): the least time another whole-graph
        #: candidate's build and mapping is expected to take (:func:`_leaves_a_mapping`)
        self.linear_s = 0.0
        self.book: RuleBook | None = None
        self.stats: dict = {}
        self.marks: dict = {}
        self.interrupted = False
        self.floor: list[PlanCandidate] = []          # data parallelism by rules (or the imported graph)
        self.cands: list[PlanCandidate] = []          # the search's result and the layout proposals
        self.proposals: list = []                     # search.layouts.Proposal, in the order solved
        self.reached: list = []                       # those reached by rules
        self.others: dict = {}                        # the fixed strategies' floors (_fixed_baselines)
        self.floor_pipes: dict = {}                   # name -> the PipelineResult of a tuned floor (or None)
        self.tuners: dict = {}                        # name -> the tuned floor's grid walk (search.tuned), resumable
        self.pipe = None                              # the pipeline stage search's result (or None)
        self.pipe_searched = False                    # whether the stage search ran

    def mark(self, name: str) -> None:
        """The seconds since the start at the end of a step (``info.search.timeline_s``)."""
        self.marks[name] = self.budget.elapsed()

    def later(self, phase: str) -> Deadline:
        """The end of ``phase``, or now when it has passed (a step that starts late still gets to start)."""
        d = self.budget.deadline(phase)
        return Deadline(max(d.at, d.clock()), d.clock)


def optimize(model, machine, budget_s: "float | Budget | None" = None, alpha: float = 1.05, pipeline: bool = True,
             strategy: str = "unity", optimizer: str = "adam", batch: int | None = None, seed: int = 0,
             progress: Callable[[dict], None] | None = None, max_candidates: int = 40, k: int = 10,
             budget: "float | Budget | None" = None, rules=None, price_limit_s: float | None = None,
             precision: str = "fp32", memory_techniques: bool = True) -> OptimizeResult:
    """Optimize ``model`` (an ONNX path or a PCG) for ``machine`` (a MachineSpec or a preset string
    such as ``"summit:2x6"``); see the module docstring.  ``budget`` is an alias of ``budget_s``
    (default 60 s); either may be a :class:`search.budget.Budget` (its clock, e.g. a test's).  ``seed``
    is recorded; the search itself is deterministic.  ``memory_techniques=False`` prices every candidate
    without ZeRO, recomputation, offload and overlap (DESIGN "Memory techniques"), as plans were priced before them.

    The policy: price the floors (data parallelism, the fixed strategies), collect the candidates of the
    strategy (the joint search's: the layout proposals of every mesh, reached by rules where they can be;
    the segments' search seeded by them; data parallelism by rules), take the fastest and map it, then
    the pipeline stage search, and never return a plan predicted slower than a floor that was priced."""
    bud = _make_budget(budget_s if budget_s is not None else budget)
    _check_arguments(strategy, alpha, batch, max_candidates, precision)
    with _caller_heap_frozen():
        return _optimize(model, machine, bud, alpha, pipeline, strategy, optimizer, batch, seed, progress,
                         max_candidates, k, rules, price_limit_s, precision, memory_techniques)


def _optimize(model, machine, bud: Budget, alpha, pipeline, strategy, optimizer, batch, seed, progress,
              max_candidates, k, rules, price_limit_s, precision, memory_techniques) -> OptimizeResult:
    m = machine if isinstance(machine, MachineSpec) else parse_machine(str(machine))
    if not (pipeline and strategy == "unity" and m.num_devices > 1):
        bud.skip("pipeline")
    with bud.phase("floors"):
        g, model_path, sha = _load(model, batch)
    ev = Evaluator(m, optimizer, limit_s=price_limit_s if price_limit_s is not None else bud.solve_limit(),
                   precision=precision, clock=bud.clock, techniques=memory_techniques)
    ev.hard = bud.hard_end()
    run = _Run(g, m, strategy, bud, ev, alpha=alpha, pipeline=pipeline, progress=progress,
               max_candidates=max_candidates, k=k, rules=rules, optimizer=optimizer)
    run.mark("import")
    _check_batch(run)
    with bud.phase("floors"):
        _price_data_parallel(run)
    if strategy == "alpa":
        chosen = _alpa(run)
    elif strategy in FIXED:
        chosen = _fixed(run)
    else:
        chosen = _search(run)
    with _no_cyclic_gc():
        return _result(run, chosen, model_path, sha, seed, precision)


_FROZEN = {"depth": 0}
_FROZEN_LOCK = threading.Lock()


@contextmanager
def _caller_heap_frozen():
    """The objects alive when the call starts (the caller's heap: a notebook's, a test session's, a service's)
    moved out of the cyclic collector's reach for the call (``gc.freeze``), then back (``gc.unfreeze``, by
    the outermost call): a full collection scans only what the search allocated.  Without it a collection
    of a large caller heap is a pause of 0.2-0.8 s at a random instant of the search, past a small budget's
    marks (measured: a pytest session of the planner's tests, one such pause every second or two)."""
    with _FROZEN_LOCK:
        _FROZEN["depth"] += 1
        gc.freeze()
    try:
        yield
    finally:
        with _FROZEN_LOCK:
            _FROZEN["depth"] -= 1
            if not _FROZEN["depth"]:
                gc.unfreeze()


@contextmanager
def _no_cyclic_gc():
    """The cyclic garbage collector paused (then restored as it was) for the work after the search: the plan's
    executor checks allocate enough to start a full collection of the search's heap (a third of a second on
    BERT-Large, past the search and counted against the budget), and free nothing it would find."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _search(run: _Run) -> PlanCandidate:
    """The joint (or sequential) search: its candidates phase by phase, the fastest of them mapped, then
    the pipeline stage search, and never a plan predicted slower than a floor it priced."""
    bud, ev, strategy = run.budget, run.ev, run.strategy
    run.book = RuleBook(run.rules, search_degrees(run.m))
    try:
        with within(bud.hard_end()):        # every rule sequence and solve stops there at the latest
            if strategy == "unity":
                _unity_candidates(run)
            else:
                _sequential_candidates(run)
    except KeyboardInterrupt:
        run.interrupted = True
    except Expired:                         # the hard end: what was priced so far competes
        run.stats["cut_by_budget"] = True
    ev.wall = None
    chosen = _choose(run)
    _record_best_own(run)
    if strategy == "unity" and run.pipeline and (run.n_dev > 1 or not chosen.mapping.feasible) \
            and not run.interrupted:
        chosen = _pipeline_step(run, chosen)     # the stage search ran in its phase (else it runs now)
    if strategy == "unity":
        chosen = _never_slower_than_a_floor(run, chosen)
    run.stats = dict(run.stats, chosen=run.stats.get("chosen") or chosen.mechanism,
                     mapper_calls=ev.calls, mapper_timeouts=ev.timeouts)
    if ev.plain_past_end:           # (their price has no memory techniques: DESIGN "optimize() policy" 2)
        run.stats["mapped_without_techniques_past_end"] = ev.plain_past_end
    if strategy == "unity":        # the substitution phase's wall and the end of the last solve under it
        run.stats["wall_s"] = {"wall": round(bud.deadline("pricing").at - bud.start, 3),
                               "last_walled_solve_end": round(max(ev.last_walled_end - bud.start, 0.0), 3)}
    return chosen


def _record_best_own(run: _Run) -> None:
    """``info.search.best_own_s`` / ``best_own``: the fastest priced candidate of the general search itself
    (the layout proposals, the segment search, accumulation; not a floor, not a pipeline), so a report can tell
    whether a floor that wins does so by more than a margin (issue 18 point 2)."""
    own = [c for c in run.cands if math.isfinite(c.cost)]
    if own:
        best = min(own, key=lambda c: (c.cost, c.rank))
        run.stats["best_own_s"], run.stats["best_own"] = best.cost, best.mechanism


def _make_budget(b) -> Budget:
    if b is None:
        return B.for_call(60.0)
    if isinstance(b, Budget):
        return b
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
        raise OptimizeError(f"budget must be a positive number of seconds, got {b!r}")
    return B.for_call(b)


def _check_arguments(strategy, alpha, batch, max_candidates, precision) -> None:
    if strategy not in STRATEGIES:
        raise OptimizeError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if not alpha >= 1.0:
        raise OptimizeError(f"alpha must be at least 1, got {alpha!r}")
    if batch is not None and batch < 1:
        raise OptimizeError(f"batch must be a positive integer, got {batch}")
    if max_candidates < 0:
        raise OptimizeError(f"max_candidates must be >= 0, got {max_candidates}")
    if precision not in ("fp32", "tf32", "bf16"):
        raise OptimizeError(f"precision must be fp32, tf32 or bf16, got {precision!r}")


def _check_batch(run: _Run) -> None:
    if run.n_dev > 1 and run.b is not None and not any(run.b % d == 0 for d in run.degrees):
        d = run.degrees
        raise OptimizeError(f"batch {run.b} is not divisible by any parallel degree of machine {run.m.name} "
                            f"({', '.join(map(str, d[:8]))}{' ...' if len(d) > 8 else ''})")


def _price_data_parallel(run: _Run) -> None:
    """The hand-built data-parallel plan and its mapping (``run.dp_res``: the floor of every strategy), by
    the end of the floors phase; when its DP does not finish by then (a small batch on a large machine:
    BERT-Large at batch 4 on 192 GPUs, degree 4, has thousands of views per operator) it is mapped without
    the DP (:meth:`Evaluator.cheap`), which is linear."""
    from .baselines import StrategyError, build_strategy
    if run.n_dev <= 1:
        return
    t0 = run.budget.now()
    try:
        run.dp_pg = build_strategy(run.g, "dp", run.dp_deg)
    except StrategyError:
        return
    built_s = run.budget.now() - t0
    try:
        run.dp_res = run.ev.full(run.dp_pg, deadline=run.later("floors"))
    except Expired:                 # the DP or the memory techniques' choice (search/memtech.py) was cut:
        with within(run.later("floors")):   # the linear mapping, priced plainly once its techniques are cut
            run.dp_res = run.ev.cheap(run.dp_pg)
        run.dp_cut = True
        run.stats["dp_mapping"] = "without the DP (its solve did not finish within the floors' phase)"
    run.linear_s = built_s + (run.dp_res.stats.get("linear_s", run.dp_res.solve_s) if run.dp_res is not None else 0.0)
    run.stats["linear_s"] = round(run.linear_s, 3)
    run.mark("dp_baseline")


def _alpa(run: _Run) -> PlanCandidate:
    """Alpa's two passes (intra-operator ILP per stage, inter-operator stage DP), priced by our 1F1B
    simulation: the plan always has a pipeline field (one stage: gradient accumulation)."""
    from .alpa.inter import AlpaError, alpa_plan
    bud = run.budget
    # every phase of the planner checks the budget's end (on the budget's clock); past it only the stand-ins
    # that complete a plan run, and nothing but linear work past the hard end
    try:
        ar = alpa_plan(run.g, run.m, optimizer=run.optimizer, mapper=run.ev.mapper,
                       time_limit_s=max(0.1, min(30.0, bud.left())), deadline=bud.deadline(), hard=bud.hard_end())
    except AlpaError as e:
        if not bud.expired() or run.dp_pg is None or run.dp_res is None:
            raise
        # no plan of Alpa's within the budget: the data-parallel floor, said so (as when `run` refuses its plan)
        run.stats = {"chosen": f"data parallel (fallback: alpa found no plan within the budget: {e})",
                     "alpa": {"deadline_hit": True}}
        return PlanCandidate("data parallel", run.dp_pg, run.dp_res.cost, (), by_rules=False, mapping=run.dp_res)
    pipe = ar.pipeline
    if pipe.pcg is None:
        raise OptimizeError(f"alpa: no plan for {run.m.name}: "
                            f"{ar.stats.get('stitch_error') or pipe.reason or 'the stages do not join'}")
    run.stats = {"chosen": "alpa", "pipeline_stages": pipe.num_stages, "micro_batches": ar.micro_batches,
                 "alpa": {k: ar.stats.get(k) for k in ("layers", "planner_s", "solves", "micro_batches_tried",
                                                       "valid_cuts", "deadline_hit", "deadline_fallback_solves",
                                                       "anchor", "anchor_chosen")},
                 "alpa_stages": ar.stages}
    return PlanCandidate("alpa", pipe.pcg, pipe.cost, (), by_rules=False, mapping=_PipelineMapping(pipe, run.n_dev),
                         pipeline=pipe)


def _fixed(run: _Run) -> PlanCandidate:
    """A fixed strategy as ``simulate --strategy`` builds it (Megatron's tensor parallelism inside a node),
    mapped by the DP within the budget (without it when the DP does not finish: :meth:`Evaluator.cheap`)."""
    from .baselines import StrategyError, build_strategy
    name = run.strategy
    if name in TUNED:
        from .tuned import plan_candidate
        return plan_candidate(run)
    try:
        pg = build_strategy(run.g, name, 1 if name == "none" else run.dp_deg, devices_per_node=run.m.devices_per_node)
    except StrategyError as e:
        raise OptimizeError(str(e)) from None
    res = Resource(0, 1, 1) if name == "none" else None
    try:
        final = run.ev.full(pg, res)
    except Expired:
        final = run.ev.cheap(pg, res)
        run.stats["mapping"] = "without the DP (its solve did not finish within the budget)"
    return PlanCandidate(name, pg, final.cost, (), by_rules=False, mapping=final)


def _unity_candidates(run: _Run) -> None:
    """The joint search's candidates, phase by phase (:data:`search.budget.PHASES`); each step appends to
    ``run.floor`` / ``run.cands`` as it goes, so when time runs out what was priced competes.

    1. floors: the fixed strategies that apply, the tuned ones included (dp is priced before any strategy runs);
    2. layouts: gradient accumulation where the full batch does not fit or a micro-batched floor is faster
       (:func:`_accumulation_candidates`);
       the ILP's layout of every logical mesh (:mod:`search.layouts`), each reached by rules
       (:func:`search.realize.realize`) where the rules reach it, else a candidate as the ILP built it;
    3. segments: the best-first substitution search of every distinct segment, seeded by data
       parallelism and the segment's layouts reached by rules; data parallelism by rules assembled;
    4. pricing: the search's result on the whole graph;
    5. pipeline: the 1F1B stage search (steps 3-4 stop PIPELINE_MIN_SHARE of the budget before the hard end
       when it is to run, so it always gets that share);
    6. final: floors whose solve was cut resume."""
    bud = run.budget
    if run.n_dev > 1 and run.dp_deg > 1:
        with bud.phase("floors"):
            _price_floors(run)
    with bud.phase("layouts"):
        _layout_candidates(run)
    pipe_next = run.pipeline and run.n_dev > 1 and "pipeline" not in bud.skipped
    stop = Deadline(bud.hard_end().at - bud.share(B.PIPELINE_MIN_SHARE), bud.clock) if pipe_next else None
    try:
        with within(stop):
            with bud.phase("segments"):
                out = _search_segments(run)
            with bud.phase("pricing"):
                _price_search_result(run, out)
    except Expired:                 # the stage search's least share: what was priced so far competes
        run.stats["segments_cut"] = True
    if pipe_next:
        with bud.phase("pipeline"):
            _pipeline_search(run)
    with bud.phase("final"):
        _resume_cut_floors(run)


def _price_floors(run: _Run) -> None:
    """Every fixed strategy of :data:`FLOOR_STRATEGIES` that applies, priced by the end of the floors phase
    (the result is never predicted slower than one of them); a solve the mark cuts resumes in the final
    phase (:func:`_resume_cut_floors`)."""
    run.others = _fixed_baselines(run, run.budget.deadline("floors"))
    run.mark("baselines")


def _realizer():
    """:func:`search.realize.realize`, or None where this build has none (proposals then compete as the ILP
    built them, not by rules)."""
    try:
        from .realize import realize
    except ImportError:
        return None
    return realize


def _reach(run: _Run, target: PCG, g: PCG | None = None, deadline: Deadline | None = None):
    """``target`` reached from ``g`` (default the model) by rules: the Realized result, or None (no realizer,
    the deadline cut it, or the rules raised)."""
    realize = _realizer()
    if realize is None:
        return None
    try:
        with within(deadline):
            return realize(run.g if g is None else g, target, run.book, deadline=deadline)
    except (Expired, UnityError):
        return None


def _layout_candidates(run: _Run) -> None:
    """The layouts phase.  First the proposals (:func:`search.layouts.proposals`: every mesh of the machine
    in its order, started within ``PROPOSALS_START_SHARE`` of the phase, each solving until
    ``PROPOSALS_SOLVE_SHARE`` of it), each a
    candidate "layout mesh AxB (ILP, not by rules)" priced on the ILP's own placement; then, fastest first
    until the phase's mark, the ILP's PCG is priced by the DP too (it may place the pieces better than the mesh did: a faster price is the same candidate)
    and each is reached by rules (:func:`search.realize.realize`): a complete one is the candidate "layout
    mesh AxB by rules" (priced by the DP; its mesh seeds the segments)."""
    from .layouts import proposals
    ev, bud = run.ev, run.budget
    wall = run.later("layouts")
    ev.wall = wall
    info: dict = {}
    run.stats["layouts"] = info
    if run.n_dev <= 1:
        return
    share = B.FLOOR_RESUME_SHARE if _anything_fits(run) else B.FLOOR_RESUME_NOFIT_SHARE
    _resume_cut_grids(run, Deadline(bud.now() + max(wall.left(), 0.0) * share, bud.clock))
    # gradient accumulation first when data parallelism does not fit at the full batch (then no layout is
    # likely to: its activations are the batch's); else after the proposals, when none of them fits either
    early = not _fits_full_batch(run)
    if early:                   # most of the phase: the full-batch proposals are then unlikely to fit either
        _accumulation_candidates(run, Deadline(bud.now() + max(wall.left(), 0.0) * B.ACCUMULATION_EARLY_SHARE,
                                               bud.clock))
    left = max(wall.left(), 0.0)
    start_by = Deadline(bud.now() + left * B.PROPOSALS_START_SHARE, bud.clock)
    for p in proposals(run.g, run.m, deadline=start_by, optimizer=run.optimizer,
                       precision=ev.mapper.model.precision, mapper=ev.mapper,
                       run_until=Deadline(bud.now() + left * B.PROPOSALS_SOLVE_SHARE, bud.clock)):
        info[p.name] = p.to_json()
        run.proposals.append(p)
        if p.pcg is not None:
            run.cands.append(PlanCandidate(f"layout mesh {p.name} (ILP, not by rules)", p.pcg, p.time_s, (), LAYOUT,
                                           by_rules=False, mapping=p.mapping))
    run.mark("layout_proposals")
    if not early and (not _fits_full_batch(run) or _micro_batching_pays(run)):
        _accumulation_candidates(run, wall)
    for p in sorted((p for p in run.proposals if p.pcg is not None), key=lambda p: p.time_s):
        if wall.passed():
            break
        rec = info[p.name]
        # the DP's placement of the ILP's PCG first (a solve of up to a third of the time left, at least the
        # per-solve limit): the mesh fixes which devices share an axis, the DP may place the same layout
        # better (DLRM's tables: their gradient sync groups)
        d = ev.cost(p.pcg, limited=max(ev.limit_s or 0.0, wall.left() / 3), keep=True)
        rec["dp_placement_cost"] = d if math.isfinite(d) else None
        if d < p.time_s * (1 - TIE):
            run.cands.append(PlanCandidate(f"layout mesh {p.name} (ILP, not by rules)", p.pcg, d, (), LAYOUT,
                                           by_rules=False, mapping=ev.kept(p.pcg)))
        got = _reach(run, p.pcg, deadline=wall)
        if got is not None and got.complete:
            pg = trimmed(got.pcg)
            # priced with every compute operator on the ILP's view (the DP places the parallel operators
            # between them), and by the DP alone; the faster
            mapping = _on_proposal_views(run, p, got, pg, wall)
            c = mapping.cost if mapping is not None and mapping.feasible else INF
            d = ev.cost(pg, keep=True)
            if d < c:
                c, mapping = d, ev.kept(pg)
            run.cands.append(PlanCandidate(f"layout mesh {p.name} by rules", pg, c, tuple(got.steps), LAYOUT,
                                           mapping=mapping))
            run.reached.append(p)
            rec.update(by_rules=True, by_rules_cost=c if math.isfinite(c) else None, realize_s=round(got.seconds, 3))
            continue
        rec["by_rules"] = False
        if got is not None:
            rec["missing"] = list(got.missing)[:3] + ([f"... {len(got.missing) - 3} more"] if len(got.missing) > 3 else [])
    run.mark("layouts")


def _anything_fits(run: _Run) -> bool:
    """Whether a plan priced so far fits: data parallelism, a floor, a candidate of the search."""
    return (run.dp_res is not None and run.dp_res.feasible) or \
        any(math.isfinite(oc) for _, oc, _, _ in run.others.values()) or \
        any(math.isfinite(c.cost) for c in run.floor + run.cands)


def _resume_cut_grids(run: _Run, until: Deadline) -> None:
    """The tuned floors whose grid walk (``run.tuners``) their share of the floors phase cut or never
    reached walk on until ``until``, the fastest first, sharing the time (:func:`search.tuned.floor` resumes
    the same walk: nothing priced twice); each is taken where it found a faster point.  A walk goes
    best-first (feasible-first while nothing of its grid fits), so its next points are the most promising."""
    from .tuned import floor
    if until.left() <= 0.05 or not _leaves_a_mapping(run, until):
        return
    prices = {name: oc for name, (_, oc, _, _) in run.others.items()}
    cut = sorted((prices[n], n) for n in TUNED if n in prices and run.others[n][0] is None
                 or n in prices and run.tuners.get(n) is not None and not run.tuners[n].finished())
    for i, (before, name) in enumerate(cut):       # the fastest first, the time left shared equally
        left = max(until.left(), 0.0)
        if left <= 0.05:
            break
        own = Deadline(until.clock() + left / (len(cut) - i), until.clock).sooner(until)
        if not _leaves_a_mapping(run, own):         # (a later one gets what this one does not use)
            continue
        # (a floor the floors phase never built: its plain point priced without the DP where its solve is cut)
        pg, c, note, r, pipe = floor(run, name, own, cheap=run.others[name][0] is None)
        run.stats.setdefault("floor_resumed", {})[name] = {"before": before if math.isfinite(before) else None,
                                                           "after": c if math.isfinite(c) else None}
        if pg is not None and (c < before or run.others[name][0] is None):
            run.others[name] = (pg, c, note, r)
            run.floor_pipes[name] = pipe


def _fits_full_batch(run: _Run) -> bool:
    """Whether a candidate at the full batch priced so far fits without recomputing: data parallelism, a
    layout proposal, a fixed strategy that does not micro-batch.  (One that fits only by recomputing pays
    for its batch's activations in time; micro-batches that keep fewer activations may pay less.)"""
    def plain(r) -> bool:
        mem = getattr(r, "memory_plan", None)
        return r is not None and bool(r.feasible) and not (mem is not None and mem.recompute)
    if plain(run.dp_res):
        return True
    if any(math.isfinite(c.cost) and c.pipeline is None and (c.mapping is None or plain(c.mapping))
           for c in run.cands):
        return True
    return any(math.isfinite(oc) and plain(r) for name, (_, oc, _, r) in run.others.items() if name not in TUNED)


def _micro_batching_pays(run: _Run) -> bool:
    """Whether a floor that micro-batches (a tuned one with a pipeline field) is predicted faster than every
    full-batch candidate priced so far: then gradient accumulation is searched too."""
    best = min([c.cost for c in run.cands if c.pipeline is None]
               + ([run.dp_res.cost] if run.dp_res is not None and run.dp_res.feasible else []), default=INF)
    return any(run.floor_pipes.get(name) is not None and oc < best
               for name, (_, oc, _, _) in run.others.items())


def _floor_grids_cover_data_parallel(run: _Run) -> bool:
    """Whether the tuned floors' grid walks (``run.tuners``) price every point gradient accumulation's data-parallel
    layout would: Megatron-LM's (tp 1, pp 1) walk is that layout (one stage of M data-parallel micro-batches,
    ``search.pipeline.default_intra``) at ZeRO 0 / 1 with every recomputation, ZeRO-3's walk the same at ZeRO 3
    (where techniques are priced).  A walk its bound or memory ended early could not have won there either."""
    tuners = getattr(run, "tuners", None) or {}
    meg = tuners.get("megatron")
    if meg is None or meg.walks is None or not any(w["tp"] == 1 and w["pp"] == 1 for w in meg.walks):
        return False
    return not meg.tech.available or tuners.get("zero3") is not None and tuners["zero3"].walks is not None


def _accumulation_candidates(run: _Run, until: Deadline) -> None:
    """Micro-batching in the joint search (gradient accumulation: one stage, M micro-batches,
    :func:`search.tuned.accumulate`), jointly with the layouts and the memory techniques: each micro-batch
    data parallel, or laid out by the ILP of each mesh of :func:`search.layouts.mesh_shapes` (in order, as
    the time until ``until`` allows), at the fewest micro-batches that fit.  The fastest feasible one is a
    candidate "accumulation: <layout>, micro-batch b xM" (a plan with a one-stage pipeline field, no rules)."""
    from .layouts import mesh_shapes, propose
    from .pipeline import default_intra
    from .tuned import TunedError, TunedMapping, accumulate
    if run.n_dev <= 1 or not run.b or run.b < 2:
        return
    m, ev = run.m, run.ev
    # with the memory techniques priced, each micro-batch's ILP keeps no memory rows: its layout is the
    # fastest, and the techniques (recomputation, ZeRO, offload) and the micro-batch walk make it fit, jointly
    # priced; without them the ILP keeps the layout within the device's memory itself
    techniques = getattr(ev.mapper, "default_techniques", True)
    budget = math.inf if techniques else None

    def ilp(mesh, price=0.0):
        def hook(stage: PCG, resource: Resource) -> PCG:
            micro_batches = run.b // max(_batch_of(stage) or run.b, 1)
            p = propose(stage, m, mesh, optimizer=run.optimizer, precision=ev.mapper.model.precision,
                        deadline=until, memory_budget=budget, micro_batches=micro_batches,
                        sharded_update=techniques, memory_price=price)
            if p.pcg is None:
                raise UnityError(f"mesh {p.name}: {p.status}")
            return p.pcg
        return hook

    if not _leaves_a_mapping(run, until):
        run.stats["accumulation"] = {"none": "too little time left to build and map its graph"}
        return
    # each mesh's fastest layout and (with the techniques) the leaner point of its time / memory front the ILP
    # finds at a price on memory (search.alpa.intra.solve_intra): the techniques price all of them, so a layout
    # that splits weights and activations finer (tensor parallelism) competes with the fastest one made to fit
    # by recomputation or ZeRO-3
    meshes = mesh_shapes(m)

    def of(order):
        fast = [(f"layout mesh {a}x{b}", ilp((a, b))) for a, b in order]
        # the leaner layouts alternate with the fastest ones (where the batch splits over every device the
        # meshes' fastest layouts differ least: each is data parallelism), the smallest inner axis first: its
        # tensor parallelism is the one a mesh row confines to the fewest, closest devices
        lean = [(f"layout mesh {a}x{b} memory-priced {p:g}", ilp((a, b), p), "rising")
                for p in (MEMORY_PRICES if techniques else ()) for a, b in sorted(order, key=lambda s: (s[1], s[0]))]
        out = []
        for k in range(max(len(fast), len(lean))):
            out += fast[k:k + 1] + lean[k:k + 1]
        return out
    layouts = [("data parallel", default_intra)] + of(meshes)
    t0 = time.perf_counter()
    fitted = None
    if _floor_grids_cover_data_parallel(run):
        # the floors' grids walk those points already (best-first, with their other pairs): they go on instead
        # for up to half the time, the meshes' layouts get the rest; the one-axis mesh, whose layout is the
        # nearest data parallelism, last
        _resume_cut_grids(run, Deadline(run.budget.now() + max(until.left(), 0.0) / 2, run.budget.clock))
        run.stats["accumulation_data_parallel"] = "walked by the tuned floors' grids"
        fitted = run.tuners["megatron"].data_parallel_fit()
        layouts = of(meshes[1:] + meshes[:1])
        if not layouts or until.passed():
            return
    try:
        # optimize(memory_techniques=False): micro-batching alone, as the mapper prices every other candidate
        # (a point that cannot beat a floor priced so far is not priced: the floor would be returned)
        beat = min([oc for _, oc, _, _ in run.others.values()]
                   + ([run.dp_res.cost] if run.dp_res is not None and run.dp_res.feasible else []), default=INF)
        r = accumulate(run.g, ev.mapper, layouts, until, fitted=fitted, beat=beat,
                       tech=None if techniques else _no_techniques())
    except (TunedError, Expired) as e:
        run.stats["accumulation"] = {"none": str(e) or "cut by the budget"}
        return
    per: dict = {}
    for q in r.priced:
        name = q["config"].get("layout", "")
        per[name] = per.get(name, 0) + 1
    rec = {"seconds": round(time.perf_counter() - t0, 3), "feasible": r.feasible,
           "points": len(r.priced), "cut": bool(r.stats.get("cut")), "points_per_layout": per}
    run.stats["accumulation"] = rec
    run.mark("accumulation")
    if r.pcg is None or not r.feasible or r.config is None:
        rec["reason"] = r.reason
        return
    rec["chosen"] = r.config.label()
    mapping = TunedMapping(r, run.n_dev, m.device.usable_bytes)
    run.cands.append(PlanCandidate(f"accumulation: {r.config.label()}", r.pcg, r.cost, (), LAYOUT,
                                   by_rules=False, mapping=mapping, pipeline=r.pipeline))


def _on_proposal_views(run: _Run, p, got, pg: PCG, until: Deadline):
    """The mapping of ``pg`` (``p`` reached by rules: ``got``) with each compute operator pinned to the view
    the ILP gave it (the DP places the rest), or None (cut by ``until``, or a view the node cannot take)."""
    from .realize import pair_nodes
    try:
        pair = pair_nodes(run.g, p.pcg)
    except UnityError:
        return None
    fixed = {got.ids[gid]: p.views[tid] for gid, tid in pair.items()
             if gid in got.ids and tid in p.views and got.ids[gid] in pg}
    try:
        with within(until):
            r = run.ev.full(pg, deadline=until) if not fixed else None
            if r is None:
                with within(run.ev.hard):
                    r = run.ev.mapper.optimize(pg, fixed=fixed)
    except (Expired, UnityError):
        return None
    return r


def _segment_layout_seeds(run: _Run):
    """The segments' seeds from the layouts: each segment's ILP layout on the meshes whose whole-graph
    proposal was reached by rules (fastest first; every mesh when none was solved on the whole graph),
    reached by rules on the segment; None when nothing can be reached by rules."""
    if _realizer() is None or run.n_dev <= 1:
        return None
    from .layouts import mesh_shapes, propose
    solved = [p for p in run.proposals if p.pcg is not None]
    meshes = [p.mesh for p in sorted(run.reached, key=lambda p: p.time_s)] if solved else mesh_shapes(run.m)
    if not meshes:
        return None

    def seeds(cg: PCG, deadline: Deadline) -> list:
        out = []
        for mesh in meshes:
            if deadline.passed():
                break
            p = propose(cg, run.m, mesh, optimizer=run.optimizer, precision=run.ev.mapper.model.precision,
                        deadline=deadline)
            if p.pcg is None:
                continue
            got = _reach(run, p.pcg, g=cg, deadline=deadline)
            if got is not None and got.complete and got.steps:
                out.append(Candidate(None, got.pcg, tuple(got.steps)))
        return out
    return seeds


def _search_segments(run: _Run):
    """The segments' seeds and best-first search (:func:`_segment_search`) until the end of the segments
    phase, then data parallelism by rules assembled from the segments' seeds: the floor.  Returns the
    search's (graph, steps), or None."""
    ev, bud = run.ev, run.budget
    if _segments_futile(run):
        return None
    ev.wall = bud.deadline("pricing")                   # no limited solve past the substitution phase
    out, st, dpg, dpst, stats, interrupted = _segment_search(
        run.g, run.book, ev, run.dp_deg, run.k, run.max_candidates, run.alpha, run.progress,
        run.later("segments"), _segment_layout_seeds(run), price_dp_seeds=not run.dp_cut)
    run.stats.update(stats)
    run.interrupted = run.interrupted or interrupted
    # data parallelism by rules (assembled from the segments' seeds): the floor.  A fixed sequence (one dp
    # rule per operator, then cancellations); when it is the hand-built dp PCG its solve costs what
    # dp_res cost (in the memo), so it is priced with no limit of its own: a plan reached by rules exists
    run.floor.append(_price_dp_by_rules(ev, run.g, run.book, dpg, dpst, run.dp_pg, lambda: _pricing_left(run),
                                        run.stats, run.dp_cut, until=run.later("segments")))
    run.stats["phase_s"] = {"segments": bud.elapsed()}
    run.mark("segments")
    return (out, st) if out is not None else None


def _segments_futile(run: _Run, passes: int = 1) -> bool:
    """Whether the segments phase (either search's) has nothing to build that could be chosen: with less time to
    its mark than the ``passes`` whole-graph passes its search needs before it gets any (each ``run.linear_s``:
    :func:`_leaves_a_mapping`; the segment search's one: canonicalizing the segments and their dp seeds; the
    sequential search's two: pricing its start, building data parallelism by rules), it would only build data
    parallelism by rules, priced past the mark no better than data parallelism (the same graph, mapped as the
    floor was or more plainly); when that does not fit, the phase is skipped (recorded)."""
    if run.dp_res is None or run.dp_res.feasible or \
            run.budget.deadline("segments").left() > passes * run.linear_s:
        return False
    run.stats["segments_skipped"] = "too little time to its mark, and data parallelism (its floor) does not fit"
    run.mark("segments")
    return True


def _pricing_left(run: _Run) -> float:
    """Seconds a whole-graph solve of the pricing phase may take (the wall at the phase's end still cuts it)."""
    bud = run.budget
    return max(bud.share(B.PRICING_MIN_SHARE),
               min(max(B.PRICING_SOLVE_S, bud.share(B.PRICING_SOLVE_SHARE)), bud.left("pricing")))


def _price_search_result(run: _Run, out) -> None:
    """The search's result, priced on the whole graph even when the segments ran to their deadline (then
    for at least min(3% of the budget, 3 s)): it is what the search found."""
    if out is None:
        run.stats["search_result_s"] = None
        return
    bud = run.budget
    graph, steps = out
    pg = trimmed(graph)
    floor_s = min(bud.share(B.RESULT_SHARE), B.RESULT_MAX_S)
    if scope_passed() or bud.hard_end().passed():     # assembled past the end: mapped without the DP
        with linear():
            c = run.ev.cost_without_dp(pg)
        run.stats["search_result_mapping"] = "without the DP (past the end of its scope)"
    else:
        c = run.ev.cost(pg, limited=max(min(_pricing_left(run), bud.left("pricing")), floor_s), wall=False,
                        keep=True)
    run.cands.append(PlanCandidate("search", pg, c, tuple(steps), SEARCH))
    run.stats["search_result_s"] = c if math.isfinite(c) else None


def _resume_cut_floors(run: _Run) -> None:
    """A floor whose solve was cut resumes (the mapper keeps the subproblems it solved) with what is left of
    the final phase: on a loaded machine Megatron's solve on BERT-Large outlasts its share."""
    for name, (opg, oc, note, ores) in list(run.others.items()):
        if ores is None and run.budget.expired("final"):
            break
        if name in TUNED:               # priced in the floors phase; a plain solve that was cut resumes
            if ores is None:
                del run.others[name]
            elif _plain_cut(ores) and not run.budget.expired("final"):
                _resume_tuned(run, name, oc)
            continue
        if opg is None:
            opg = _build_floor(run.g, name, run.dp_deg, run.m)
            if opg is None:             # does not apply to this model
                del run.others[name]
                continue
        if ores is None:
            run.others[name] = _price_baseline(run.ev, opg, run.budget.deadline("final"))


def _plain_cut(mapping) -> bool:
    """Whether a tuned floor's price came from its plain point mapped without the DP (its solve was cut)."""
    tuned = (getattr(mapping, "stats", None) or {}).get("tuned") or {}
    return bool(tuned.get("plain_mapping"))


def _resume_tuned(run: _Run, name: str, cost: float) -> None:
    """The plain point of the tuned floor ``name`` solved again by the DP within the final phase (the
    mapper's memo keeps what the cut solve finished); taken where it prices faster."""
    from .tuned import floor
    pg, c, note, r, pipe = floor(run, name, run.budget.deadline("final"), grid=False, cheap=False)
    if pg is not None and c < cost:
        run.others[name] = (pg, c, note, r)
        run.floor_pipes[name] = pipe


def _sequential_candidates(run: _Run) -> None:
    """TASO then FlexFlow (Unity Fig. 15b): algebraic rules only on one device, to convergence or half of
    the time to the end of the segments phase; then parallel rules only, from its data-parallel version,
    until that end."""
    g, ev, book, bud = run.g, run.ev, run.book, run.budget
    with bud.phase("segments"):
        if _segments_futile(run, passes=2):
            return
        one = Resource(0, 1, 1)
        alg = [r for r in book.rules if not r.is_parallel]
        par = [r for r in book.rules if r.is_parallel]
        end = run.later("segments")
        half = Deadline(bud.now() + (end.at - bud.start) / 2, bud.clock)
        g1, st1, s1 = _whole_search(g, alg, book, lambda x: ev.cost(trimmed(x), one), half, 10 ** 9, run.alpha,
                                    run.progress)
        run.stats["algebraic"] = s1.to_json()
        run.interrupted = run.interrupted or s1.stopped == "interrupted"
        if _segments_futile(run, passes=2):     # as above, now: dp by rules and the parallel search from it
            return
        # parallelization from the algebraic optimum: its data-parallel version seeds the search
        g2, st2 = (g1, [])
        if run.n_dev > 1 and run.dp_deg > 1:
            with within(bud.hard_end()):
                g2, st2 = _dp_steps_by_segments(g1, run.dp_deg, book, run.k)
                # (from the imported graph: the same sequence when the algebraic search kept it)
                dg, dst = (g2, st2) if not st1 else _dp_steps_by_segments(g, run.dp_deg, book, run.k)
            run.floor.append(_price_dp_by_rules(ev, g, book, dg, dst, run.dp_pg, lambda: _pricing_left(run),
                                                run.stats, run.dp_cut))
        g3, st3, s2 = _whole_search(g2, par, book, lambda x: ev.cost(trimmed(x)), end, run.max_candidates,
                                    run.alpha, run.progress, start_steps=st1 + st2)
    with bud.phase("pricing"):
        pg = trimmed(g3)
        run.cands.append(PlanCandidate("search", pg, ev.cost(pg, limited=_pricing_left(run), keep=True),
                                       tuple(st3), SEARCH))
    run.stats["parallel"] = s2.to_json()
    run.interrupted = run.interrupted or s2.stopped == "interrupted"


def _choose(run: _Run) -> PlanCandidate:
    """The fastest candidate (ties: the floor, then the search, then the layouts, then the order found)
    with its mapping (kept from its pricing; else solved within the hard end).  When nothing reachable was
    priced feasible, a feasible fixed strategy (recorded as such, ``info.search.fallback``)."""
    ev = run.ev
    run.mark("whole_graph_pricing")
    # sorted is stable: among equal (cost, rank) the first found comes first; a plan reached by rules
    # within rounding (TIE) of one that is not is preferred to it (the same layout, with its sequence)
    pool = sorted(run.floor + run.cands, key=lambda c: (c.cost, c.rank))
    if pool and not pool[0].by_rules:
        near = [c for c in pool if c.by_rules and c.cost <= pool[0].cost * (1 + TIE)]
        if near:
            pool.remove(near[0])
            pool.insert(0, near[0])
    chosen = None
    for c in pool:
        if not math.isfinite(c.cost):
            break
        if c.mapping is None:           # a proposal not reached by rules carries the placement it was priced on
            c.mapping = ev.kept(c.pcg)
        if c.mapping is None:           # priced from the memo (a segment's graph): solved again, from the mapper's memo
            try:
                c.mapping = ev.full(c.pcg)
            except Expired:             # past the hard end: the next one
                continue
        if c.mapping.feasible:
            chosen = c
            break
    if chosen is None:
        if not pool or not math.isfinite(pool[0].cost):
            run.stats["unpriced"] = True
        chosen = _fallback(run)
    run.mark("final_mapping")
    return chosen


def _leaves_a_mapping(run: _Run, deadline: Deadline) -> bool:
    """Whether ``deadline`` leaves the time a whole-graph candidate takes at least to build and map on this host
    as loaded (the linear part of data parallelism's, ``run.linear_s``).  A step that builds one (a strategy, a
    tuned grid's point, gradient accumulation's micro-batch graph) and starts with less would run its set-up,
    which checks no deadline, past ``deadline``: it does not start."""
    return deadline.left() > run.linear_s


def _too_late_to_map(run: _Run) -> bool:
    """Past the budget's end, or too near its hard end for another strategy's build and mapping
    (:func:`_leaves_a_mapping`)."""
    return run.budget.expired() or not _leaves_a_mapping(run, run.budget.hard_end())


def _fallback(run: _Run) -> PlanCandidate:
    """Nothing reachable fits (or nothing was priced within the budget): the first fixed strategy whose
    mapping is feasible (data parallelism's from the floors first, else each solved within the hard end),
    else the imported graph on one device.  A strategy whose floor (``run.others``: its plain point and,
    tuned, its grid) was mapped is not mapped again: taken as mapped where it fits, skipped where it does
    not (on a model of many layers one more mapping of each costs seconds past the budget).  Past the
    budget's end (or nearer its hard end than data parallelism took to build and map: ``run.linear_s``) only
    linear work runs: a strategy over the machine whose floor was not mapped is skipped
    (``info.search.fallback_skipped``; before the end, one whose solve the hard end cuts is not mapped
    again without the DP).  The imported graph on one device is always mapped without the DP
    (:meth:`Evaluator.cheap`): with one view per operator the DP would find that same mapping."""
    from .baselines import StrategyError, build_strategy
    ev, g = run.ev, run.g
    one = Resource(0, 1, 1)
    imported = None                 # the imported graph's mapping on one device, once mapped (``none`` is it)

    # the imported graph's mapping on one device, the last resort, takes up to ``linear_s`` (the linear part of
    # data parallelism's): a strategy's solve, and the memory techniques' choice (a search) in that mapping,
    # stop that long before the hard end
    last_map = run.budget.hard_end().plus(-run.linear_s)

    def on_one_device():
        # one view per operator: the DP's mapping is the linear one
        with within(last_map):
            return ev.cheap(g, one)
    for name in FIXED:
        floor_pg, _, _, floor_map = run.others.get(name, (None, None, None, None))
        if name == "dp" and run.dp_res is not None:
            alt, r = run.dp_pg, run.dp_res
        elif floor_map is not None and floor_map.views and not floor_map.feasible:
            continue
        elif floor_map is not None and floor_map.feasible and floor_pg is not None:
            alt, r = floor_pg, floor_map            # its floor, mapped already
        elif name != "none" and (_too_late_to_map(run) or not _leaves_a_mapping(run, last_map)):
            # past the end only linear work: a strategy over the machine not mapped before is not built or
            # mapped; nor is one where the time to the hard end is shorter than data parallelism's build and
            # mapping took (on this host, as loaded: it would end past the hard end), with the imported
            # graph's mapping on one device after it (where it does not fit)
            run.stats.setdefault("fallback_skipped", []).append(name)
            continue
        else:
            try:
                alt = build_strategy(g, name, 1 if name == "none" else run.dp_deg, devices_per_node=run.m.devices_per_node)
            except StrategyError:
                continue
            if name == "none":
                r = imported = on_one_device()
            else:
                try:
                    with within(last_map):
                        r = ev.full(alt)
                except Expired:     # the hard end came during its solve: not mapped again without the DP
                    run.stats.setdefault("fallback_skipped", []).append(name)
                    continue
        if r is not None and r.feasible:
            run.stats = dict(run.stats, fallback=name)
            mech = f"{name} (fallback: nothing reachable by rules fits)"
            if name in TUNED and alt is floor_pg:
                mech = f"{name} tuned baseline ({run.others[name][2]}; fallback: nothing reachable by rules fits)"
            return PlanCandidate(mech, alt, r.cost, (), by_rules=False, mapping=r, pipeline=run.floor_pipes.get(name))
    r = imported if imported is not None else on_one_device()
    return PlanCandidate("imported graph (nothing fits)", g, r.cost if r is not None else INF, (), FLOOR, mapping=r)


def _no_techniques():
    from .tuned import _NoTechniques
    return _NoTechniques()


def _pipeline_refusal(run: _Run, pipe) -> str | None:
    """Why the executor would refuse the pipeline plan ``pipe`` (search/runnable.py's check, the plan's
    precision and memory techniques included), or None."""
    from unity_pcg.plan import Plan
    from .runnable import executor_refusal
    if pipe.pcg is None:
        return "the stages were not joined into one PCG"
    plan = Plan("<pipeline>", "0" * 64, run.m, pipe.pcg, pipe.views, {}, pipe.to_plan_field(), {}, None,
                run.ev.mapper.model.precision, getattr(pipe, "memory_plan", None))
    try:
        return executor_refusal(plan)
    except UnityError as e:
        return str(e)


def _fast_micro_batches(run: _Run) -> int | None:
    """The micro-batch count of the fastest plan priced so far that micro-batches (a tuned floor's pipeline,
    gradient accumulation), or None: where the stage search starts its counts."""
    got = [(oc, run.floor_pipes[name].micro_batches) for name, (_, oc, _, _) in run.others.items()
           if math.isfinite(oc) and getattr(run.floor_pipes.get(name), "micro_batches", None)]
    got += [(c.cost, c.pipeline.micro_batches) for c in run.cands
            if math.isfinite(c.cost) and getattr(c.pipeline, "micro_batches", None)]
    return min(got)[1] if got else None


def _pipeline_search(run: _Run, until: Deadline | None = None) -> None:
    """The 1F1B stage search (``run.pipe``: its result, or None) until ``until`` (default: the pipeline
    phase's mark): it gets a share of the time to it (it finishes the number of micro-batches it is pricing)
    and is cut shortly past it (at least a small share of the budget when it starts late), and never nearer
    the hard end than the final mapping of a whole graph takes (``run.linear_s``: it does not start there)."""
    bud, ev = run.budget, run.ev
    until = until or bud.deadline("pipeline")
    tp0 = time.perf_counter()
    room = max(until.left(), bud.share(B.PIPELINE_MIN_SHARE))
    last = bud.hard_end().plus(-run.linear_s)
    cut = Deadline(bud.now() + room + bud.share(B.PIPELINE_OVER), bud.clock).sooner(last)
    if cut.left() <= 0.01:          # at the hard end (a starved host): no stage search starts
        pipe = None
        run.stats["pipeline_not_started"] = "past the budget's hard end, less the final mapping's time"
    else:
        pipe = _pipeline(run.g, ev, room * B.PIPELINE_SEARCH_SHARE, cut, accept=lambda p: _pipeline_refusal(run, p),
                         near=_fast_micro_batches(run))
    if pipe is None and cut.passed():
        run.stats["pipeline_cut"] = True
    run.pipe, run.pipe_searched = pipe, True
    run.mark("pipeline")
    run.stats = dict(run.stats, pipeline_s=time.perf_counter() - tp0,
                     pipeline_iteration_s=pipe.cost if pipe is not None and pipe.feasible else None)
    if pipe is not None:        # how the stage search went (its passes, micro-batch counts, stage layouts, cuts)
        run.stats["pipeline_search"] = {k: v for k, v in (pipe.stats or {}).items() if k in PIPELINE_STATS}


#: the stage search's stats recorded in ``info.search.pipeline_search``
PIPELINE_STATS = ("micro_batches_tried", "budget_exhausted", "cut", "layering", "layouts_tried", "layouts_cut",
                  "layouts_budget_exhausted", "layouts_s", "dp_s", "stage_layouts", "refused", "makespan_s",
                  "exact_priced", "finer_micro_batches")


def _pipeline_step(run: _Run, chosen: PlanCandidate) -> PlanCandidate:
    """The pipeline plan (the stage search of the pipeline phase; searched now where that phase did not run:
    one device whose plan does not fit), taken when faster than ``chosen`` (such a plan records its stages,
    and the rule sequence of the PCG inside them where it is data parallel: ``pipeline.by_rules``).  The
    rule sequence gets the time to the end (at least a small share; bounded by the hard end)."""
    from .budget import run_within
    bud, ev, n_dev = run.budget, run.ev, run.n_dev
    hard = bud.hard_end()
    if not run.pipe_searched:
        _pipeline_search(run, bud.deadline())
    pipe = run.pipe
    final = chosen.mapping
    if pipe is None or not pipe.feasible or (final.feasible and not pipe.cost < final.cost):
        return chosen
    why = _pipeline_refusal(run, pipe)
    if why is not None:        # the plan it replaces stays (a refused plan would fall back to one without stages)
        run.stats = dict(run.stats, pipeline_refused=why)
        return chosen
    # pipeline stages (search/pipeline.py): a mapping decision of the stage DP; the PCG inside them, data
    # parallelism or Megatron's layout, reached by rules where it can be (pipeline.by_rules: dp stages by the
    # dp rules, Megatron stages by realize; the sequence is recorded), within its share of the budget
    from .pipeline import by_rules
    least = B.BY_RULES_DP_MIN_SHARE if (pipe.origin or {}).get("dp_inside") else B.BY_RULES_MIN_SHARE
    until = Deadline(max(bud.end, bud.now() + bud.share(least)), bud.clock).sooner(hard)
    try:
        got, done = run_within(until, by_rules, run.g, pipe, ev.machine, run.book, mapper=ev.mapper)
    except (UnityError, KeyboardInterrupt):
        got, done = None, True
    if done:
        pipe = got or pipe
        run.stats = dict(run.stats, pipeline_by_rules="reached" if pipe.rules is not None else "not reached")
    else:
        run.stats = dict(run.stats, pipeline_by_rules="cut by the budget")
    run.mark("pipeline_by_rules")
    run.stats = dict(run.stats, chosen="pipeline", pipeline_stages=pipe.num_stages, micro_batches=pipe.micro_batches,
                     pipeline_stage_layouts=(pipe.stats or {}).get("stage_layouts"))
    return PlanCandidate("pipeline", pipe.pcg, pipe.cost, tuple(pipe.rules or ()), by_rules=pipe.rules is not None,
                         mapping=_PipelineMapping(pipe, n_dev), pipeline=pipe)


def _never_slower_than_a_floor(run: _Run, chosen: PlanCandidate) -> PlanCandidate:
    """The promise "never predicted slower than data parallel where it fits" (and than the other fixed
    strategies that apply: Megatron, expert) outranks rule reachability: where the rules cannot build the
    baseline's PCG (an operator without a dp rule; Megatron's operators between its groups on the
    tensor-parallel copies) or the budget ran out first, the fastest hand-built baseline is returned,
    recorded as such (no rule sequence), as a pipeline plan is."""
    dp_res = run.dp_res
    alts = [(dp_res.cost, "dp", run.dp_pg, dp_res)] if dp_res is not None and dp_res.feasible else []
    alts += [(oc, name, opg, ores) for name, (opg, oc, _, ores) in run.others.items()
             if ores is not None and math.isfinite(oc)]
    final = chosen.mapping
    # (faster by more than rounding: the rules' version of a baseline prices the same up to the last bits,
    # and then the plan reached by rules is kept)
    for oc, name, opg, ores in sorted(alts, key=lambda a: a[0]):
        if final.feasible and not oc < final.cost * (1 - 1e-9):
            break
        if not ores.feasible or (final.feasible and not ores.cost < final.cost * (1 - 1e-9)):
            continue
        if name == "dp":
            why = run.stats.get("dp_by_rules", {}).get("differs") or "not priced within the budget"
            mech = f"data parallel baseline (dp by rules: {why})"
        elif name in TUNED:
            mech = f"{name} tuned baseline ({run.others[name][2]}; faster than every plan of the search)"
        else:
            mech = f"{name} baseline (faster than every plan reached by rules within the budget)"
        run.stats = dict(run.stats, chosen=mech)
        chosen = PlanCandidate(mech, opg, ores.cost, (), by_rules=False, mapping=ores,
                               pipeline=run.floor_pipes.get(name))
        break
    run.stats = dict(run.stats, baselines_s={"dp": dp_res.cost if dp_res is not None and dp_res.feasible else None,
                                             **{name: (oc if math.isfinite(oc) else note or None)
                                                for name, (_, oc, note, _) in run.others.items()}})
    return chosen


def _result(run: _Run, chosen: PlanCandidate, model_path: str, sha: str, seed: int, precision: str) -> OptimizeResult:
    """The plan file and the result of the call."""
    from unity_pcg.plan import Plan
    bud, stats, final = run.budget, run.stats, chosen.mapping
    search_s = bud.elapsed()
    if run.strategy in SEARCHES:       # seconds since the start at the end of each step, and each phase
        run.marks["end"] = search_s
        stats["timeline_s"] = {k: round(v, 2) for k, v in run.marks.items()}
        stats["budget"] = {"seconds": bud.seconds, "phases": bud.timeline()}
    rules_json = chosen.rules_json
    pipe = chosen.pipeline
    pred = dict(final.to_json(), strategy=run.strategy, optimizer=run.optimizer, precision=precision,
                search_s=search_s)
    plan = Plan(model_path, sha, run.m, chosen.pcg, final.views, pred,
                pipe.to_plan_field() if pipe is not None else None,
                {"strategy": run.strategy, "seed": seed, "alpha": run.alpha, "budget_s": bud.seconds,
                 "optimizer": run.optimizer, "batch": run.b, "search": stats,
                 **({"outputs_trimmed": True} if rules_json is not None else {})}, rules_json, precision,
                getattr(final, "memory_plan", None))
    steps = list(chosen.steps)
    # never a plan the executor refuses before launch: else the fastest alternative it runs (search/runnable.py)
    if run.strategy in SEARCHES:
        # (a candidate with a pipeline field is no alternative: the fallback writes plans without one)
        cands = [c for c in run.cands + run.floor if c.pcg is not None and c.pipeline is None]
        plan, final, steps, stats = runnable(plan, final, steps, stats, run.ev, run.g,
                                             [(c.cost, 1, c.pcg, c.steps if c.by_rules else (),
                                               None if c.by_rules else c.mapping) for c in cands],
                                             {id(c.pcg): c.mechanism for c in cands},
                                             dp=(run.dp_pg, run.dp_res),
                                             others={k: v for k, v in run.others.items()
                                                     if run.floor_pipes.get(k) is None})
    elif run.strategy == "alpa":
        # Alpa's plan too: when the executor refuses it, its one stage of one micro-batch as a plain plan,
        # else the data-parallel floor, else one device (info.search.chosen says which and why)
        plan, final, steps, stats = runnable(plan, final, steps, stats, run.ev, run.g, (),
                                             dp=(run.dp_pg, run.dp_res))
    else:
        runnable(plan, final, steps, stats)     # recorded: the fixed strategy asked for is returned
    return OptimizeResult(plan, run.strategy, final, run.dp_res, steps, search_s, stats, run.interrupted, run.b)


__all__ = ["optimize", "OptimizeResult", "OptimizeError", "PlanCandidate", "STRATEGIES", "FLOOR_STRATEGIES",
           "machine_degrees", "search_degrees"]
