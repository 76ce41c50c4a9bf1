"""The joint optimizer behind `unity-pcg optimize`, the demo and the benchmarks.

    from unity_pcg.search.optimize import optimize
    res = optimize("model.onnx", "summit:2x6", budget_s=30)
    res.plan.save("plan.json"); print(res.json()["predicted_iteration_s"])

Strategies:

* ``unity`` (default): the joint search.  The imported graph is split into sequential segments
  (:mod:`search.split`); each distinct segment is searched best-first (:mod:`search.substitution`)
  over every proven rule of the shipped cache, from the segment itself and its data-parallel
  versions (built by rules); the segments' choices are combined and replayed on the whole graph, so
  the plan records a rule sequence from the imported graph.  The result is compared with data
  parallelism built by rules over the whole graph, and the faster of the two is returned: a plan is
  never predicted slower than data parallelism where that fits.
* ``sequential`` (TASO then FlexFlow, Unity Fig. 15b): algebraic rules only, to convergence, priced
  on one device; then parallelization rules only from that graph; the same total budget.
* ``dp``, ``megatron``, ``expert``, ``none``: the fixed strategies of :func:`search.baselines.build_strategy`
  (built by hand, so their plans record no rule sequence).

Pipelines: with ``pipeline=True`` (unity), the last quarter of the budget runs the 1F1B stage search of
:mod:`search.pipeline` (stages of at least two, data parallel inside each); its plan is taken when it is
predicted faster, and then records its stages (``Plan.pipeline``) and no rule sequence (the stages are
built by the stage DP, not by rules).

Budgets: ``budget_s`` seconds in all (split evenly over the distinct segments) and ``max_candidates``
expanded candidates per segment; with a candidate budget that is reached first the result does not
depend on the machine's speed, so the same seed gives the same plan.  A KeyboardInterrupt during
the search stops it and the best plan so far is returned (``result.interrupted``).  One DP solve
of a candidate is limited to ``price_limit_s`` (default max(1 s, budget / 30)); a slower one prices
the candidate inf.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec, Resource, parse_machine
from unity_pcg.pcg import PCG

from .runnable import runnable
from .substitution import (Candidate, RuleBook, RuleStep, best_first, copies_steps, data_parallel_steps,
                           dp_rule_missing, expert_whole, neighbours, normalized_hash, TABLE_COLUMN_RULES,
                           table_columns_steps, tensor_parallel_steps, trimmed)

INF = math.inf
SEARCHES = ("unity", "sequential")
FIXED = ("dp", "megatron", "expert", "none")
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
                "data_parallel_feasible": bool(self.dp.feasible) if self.dp is not None else None,
                "data_parallel_reason": self.dp.reason if self.dp is not None else "not buildable",
                "speedup_over_dp": self.speedup_over_dp,
                "comm_elements": r.breakdown.comm_elements,
                "max_memory_bytes": mem.max_bytes if mem else None,
                "memory_per_device": {str(d): v for d, v in sorted(mem.per_device.items())} if mem else {},
                "devices": r.devices, "devices_used": r.stats.get("devices_used", 0),
                "batch": self.batch, "rule_steps": len(self.steps), "interrupted": self.interrupted,
                "search": dict(self.stats)}


# --- evaluation ----------------------------------------------------------------------------------------

class _Timeout(Exception):
    pass


class _time_limit:
    """Raise _Timeout in the main thread after ``seconds`` (no limit elsewhere or when None).  The
    mapper writes a memo entry only once a subproblem is solved, so an interrupted solve leaves it
    consistent."""

    def __init__(self, seconds: float | None):
        import threading
        self.on = bool(seconds) and threading.current_thread() is threading.main_thread()
        self.seconds = seconds

    def __enter__(self):
        if self.on:
            import signal

            def fire(signum, frame):
                raise _Timeout()
            self.old = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.on:
            import signal
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


class Evaluator:
    """Prices candidate PCGs with one MachineMapper (its memo is shared by every candidate)."""

    def __init__(self, machine: MachineSpec, optimizer: str, limit_s: float | None = None, precision: str = "fp32"):
        from .cost import CostModel
        from .mapping import MachineMapper
        self.machine = machine
        self.mapper = MachineMapper(CostModel(machine, optimizer=optimizer, precision=precision))
        self.calls = 0
        self.timeouts = 0
        self.limit_s = limit_s
        #: perf_counter time past which a limited solve is cut (not started once it has passed): the
        #: budget's wall for the substitution phase (None: no wall)
        self.wall: float | None = None
        #: perf_counter time at which the last solve under :attr:`wall` ended (ended or was cut)
        self.last_walled_end = 0.0
        self._memo: dict = {}
        self._timed_out: dict = {}

    def cost(self, g: PCG, resource: Resource | None = None, limited: bool | float = True,
             wall: bool = True) -> float:
        """The DP's predicted iteration time (inf when infeasible).  With ``limit_s``, a candidate
        whose DP solve takes longer is priced inf (pruned): on large machines, graphs that leave
        most operators on a few devices have many machine views per operator and solve slowly, and
        are never competitive.  ``limited``: True (``limit_s``), a number of seconds, or False (no
        limit); a limited solve also stops at :attr:`wall` (unless ``wall=False``)."""
        key = (g.structural_hash(), resource)
        c = self._memo.get(key)
        if c is None and (limited or key not in self._timed_out):
            c = self._timed_out.get(key) if limited else None
        if c is None:
            lim = own = self.limit_s if limited is True else (limited or None)
            walled = limited is not False and wall and self.wall is not None
            if walled:
                left = self.wall - time.perf_counter()
                lim = left if lim is None else min(lim, left)
                if lim <= 0.01:             # past the wall: not started (and not remembered)
                    self.timeouts += 1
                    return INF
            self.calls += 1
            try:
                with _time_limit(lim):
                    r = self.mapper.optimize(g, resource=resource, fixed=self.pins(g, resource))
                c = self._memo[key] = r.cost if r.feasible else INF
            except _Timeout:            # remembered for limited calls only (not when the wall cut it)
                self.timeouts += 1
                c = INF
                if lim == own:
                    self._timed_out[key] = INF
            if walled:
                self.last_walled_end = time.perf_counter()
        return c

    def estimate(self, g: PCG) -> float:
        """Forward + backward compute of one task of every compute operator (no DP): the order in
        which the search prices sibling candidates."""
        from unity_pcg import ops
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

    def full(self, g: PCG, resource: Resource | None = None):
        return self.mapper.optimize(g, resource=resource, fixed=self.pins(g, resource))


# --- the searches ----------------------------------------------------------------------------------------

#: the largest model (compute operators) whose Megatron seeds are also built on the whole graph
WHOLE_TP_MAX_OPS = 60


def megatron_seed_degrees(m: MachineSpec, dp_degrees) -> dict[int, int]:
    """{data-parallel degree d: tensor-parallel degree k} of the Megatron seeds, d * k = the machine:
    k = nodes on data parallelism inside each node (Alpa's CANDLE-Uno layout), k = devices per node
    on data parallelism across nodes (Megatron-LM's), and k = 2 (the smallest split of the weights,
    CANDLE-Uno's 4,192-wide layers on one node: 6 = 3 x 2)."""
    n = m.num_devices
    out: dict = {}
    for k in (m.nodes, m.devices_per_node, 2):
        if k > 1 and n % k == 0 and n // k in dp_degrees and n // k not in out:
            out[n // k] = k
    return out


#: the largest dense model (compute operators, no embedding table) whose Megatron families are built on the
#: whole graph at every tensor-parallel degree (:func:`whole_tp_degrees`; CANDLE-Uno: 90)
WHOLE_DENSE_TP_MAX_OPS = 120


def whole_tp_degrees(m: MachineSpec, dp_degrees, widths=None) -> dict[int, int]:
    """{data-parallel degree d: tensor-parallel degree k} of the Megatron families built on the whole graph
    of a small dense model: every machine degree k < n with d = n / k a data-parallel degree, smallest k
    first.  :func:`megatron_seed_degrees`' three (nodes, devices per node, 2) miss the balance of activation
    all-reduces (growing with k) against gradient all-reduces (shrinking with it): CANDLE-Uno at summit:8x6
    is fastest at k = 4 on dp 12 (0.352 s; k = 8, Alpa's 8 x 6 mesh: 0.400 s; k = 2: 0.422 s), at summit:32x6
    at k = 4 on dp 48 (0.372 s; k = 2: 0.476 s; k = 32: 1.211 s).  Each family costs a rule sequence and
    one DP solve on the whole graph (1-5 s on CANDLE-Uno at 192 GPUs).  ``widths``: the Linear weights' output
    features; a k that divides none of them is left out (every Megatron template splits a weight's output
    features: the column-parallel Linear, the heads)."""
    n = m.num_devices
    return {n // k: k for k in machine_degrees(m) if k < n and n % k == 0 and n // k in dp_degrees
            and (widths is None or any(w % k == 0 for w in widths))}


def _segment_search(g: PCG, book: RuleBook, ev: "Evaluator", dp_degrees, dp_deg: int, k: int,
                    max_candidates: int, alpha: float, progress, deadline: float, families: dict | None = None,
                    early: Callable[[dict], None] | None = None):
    """The split search (module docstring).  Returns (searched graph, its steps, data parallelism
    by rules at ``dp_deg`` assembled from the segments' seeds, its steps, stats, interrupted).
    ``families``, when given, receives {name: (build, estimate)}: ``build()`` assembles the whole graph
    from every segment's seed of one family and returns (graph, steps) (``expert``, ``tp<k>x<d>``; data parallelism where a segment has
    none), so a seed layout is priced as a whole too (the segments' DP can prefer other choices on
    segment-local prices that the whole graph does not confirm).  Two passes: every segment's seeds first,
    then the best-first search of each; ``early(families)``, when given, is called between them (the
    families can be built then: Megatron-LM's layout on BERT-Large at 192 GPUs is the copies family, which
    the segments' search never beats, and their search would use the budget first)."""
    from .split import SegmentChoice, assemble, blocking_pairs, boundary_keys, canonical_segments, combine
    segs, later = canonical_segments(g, k, blocking_pairs(book))
    uniq = list(dict.fromkeys(s.key for s in segs))
    memo: dict = {}
    dp_memo: dict = {}
    fam_memo: dict = {}
    totals = {"segments": len(segs), "distinct_segments": len(uniq), "explored": 0, "evaluated": 0,
              "stopped": []}
    interrupted = False
    tp_seeds = megatron_seed_degrees(ev.machine, dp_degrees)
    # data-parallel seeds: the full degree, the Megatron seeds' data-parallel degrees and one node (each
    # seed is a rule sequence over the segment and a DP solve: every machine degree cost ~10 s per
    # segment at 96 GPUs, most of them never competitive)
    seed_degrees = {dp_deg, *tp_seeds} | ({ev.machine.devices_per_node} & set(dp_degrees))
    totals["seed_degrees"] = sorted(seed_degrees)
    # a data-parallel seed of a lower degree (or the segment as imported) whose solve hit the per-solve limit
    # (priced inf) on a segment is not solved again on segments at least as large (compute operators): on
    # Inception-v3 at 192 GPUs the degree-6 and -32 seeds each spent the whole limit on every segment, the
    # segments' whole share
    seed_deg: dict = {}                 # id(seed graph) -> (degree, compute operators of its segment)
    slow: dict = {}                     # degree -> fewest compute operators of a segment that hit the limit

    def evaluate(x: PCG):
        sd = seed_deg.get(id(x))
        if sd is not None and slow.get(sd[0], INF) <= sd[1]:
            totals["seeds_not_solved"] = totals.get("seeds_not_solved", 0) + 1
            return INF, None
        n0 = ev.timeouts
        c = ev.cost(trimmed(x))
        if sd is not None and ev.timeouts > n0:
            slow[sd[0]] = min(slow.get(sd[0], INF), sd[1])
        return c, None

    def choice(c: Candidate, kk, cross_idx) -> SegmentChoice:
        cross = kk[1][cross_idx[0]] if cross_idx else None
        # with its trailing gathers (what a mismatch at the next boundary pays); past the deadline
        # not priced: such a choice must then match its neighbour
        full = ev.cost(c.graph) if time.perf_counter() < deadline else INF
        return SegmentChoice(c.cost, full, c.steps, kk, cross)

    def build_families() -> dict:
        out: dict = {}
        for name, fm in fam_memo.items():
            if name.endswith(" copies"):
                continue
            chosen = [fm.get(s.key) or dp_memo[s.key] for s in segs]
            # the sum of the segments' prices (inf where a seed was not priced): the pricing order.
            # Assembled when it is priced (past the budget it is not: ~1 s each on BERT-Large)
            est = sum(c.cost if c.cost else INF for c in chosen)
            out[name] = ((lambda chosen=chosen: assemble(g, segs, chosen, book)), est)
            if name.startswith("tp"):
                # Megatron-LM's layout on the assembled family (the tables whole where the family split them
                # by columns): the heads column-parallel and every Replicate lifted up the residual stream
                # across the cuts (substitution.copies_steps); priced first
                cm = fam_memo.get(f"{name} copies", {})
                chosen = [cm.get(s.key) or fm.get(s.key) or dp_memo[s.key] for s in segs]
                out[f"{name} copies"] = ((lambda chosen=chosen, k=int(name[2:].split("x")[0]):
                                          _with_copies(assemble(g, segs, chosen, book), k, book)), est * (1 - 1e-6))
        return out

    starts: list = []
    for i, key in enumerate(uniq):                  # pass 1: every segment's seeds
        seg = next(s for s in segs if s.key == key)
        cg = seg.canon
        cross_idx = [j for j, r in enumerate(seg.outputs) if r in later[segs.index(seg)]]
        share = max(deadline - time.perf_counter(), 0.0) / (len(uniq) - i)

        # the segment as imported is a seed priced when it reaches the front (after the parallel seeds:
        # its estimate is the largest); on a large machine its solve (most views per operator) is the
        # slowest of all and, priced eagerly, cost a per-solve limit per segment past the deadline
        start = [Candidate(None, cg, ())]
        seed_deg[id(cg)] = (1, sum(n.kind == "compute" for n in cg.nodes()))   # as imported: degree 1
        dp_seed = None
        fam_seed: dict = {}
        for d in sorted(seed_degrees, key=lambda d: (d != dp_deg, -d)):
            if interrupted:
                break
            if d != dp_deg and time.perf_counter() > deadline:
                break               # past the deadline: only the full-degree seed (the floor needs it)
            try:
                x, st = data_parallel_steps(cg, d, book)
            except KeyboardInterrupt:
                interrupted = True
                break
            if not st:
                continue
            # the full-degree dp seed is priced without a time limit (a data-parallel graph solves fast,
            # and the segment's floor needs it); past the deadline it is only built (data parallelism by
            # rules over the whole graph is assembled from it, and priced as a whole)
            c = Candidate(ev.cost(trimmed(x), limited=False) if d == dp_deg and time.perf_counter() < deadline
                          else None, x, tuple(st))
            start.append(c)
            if d != dp_deg:
                seed_deg[id(x)] = (d, sum(n.kind == "compute" for n in cg.nodes()))
            if d == dp_deg:
                dp_seed = c
                whole = expert_whole(cg)
                if whole:
                    # the expert layout by rules: embedding tables (and their pooling) whole, the
                    # rest data parallel; the DP places the tables on disjoint devices
                    try:
                        y, st2 = data_parallel_steps(cg, d, book, keep_whole=lambda gg, n, w=whole: n.id in w)
                    except KeyboardInterrupt:
                        interrupted = True
                        break
                    # priced now, with a longer limit than a candidate's: many single-device
                    # tables side by side have many machine views and solve slowly
                    ce = ev.cost(trimmed(y), limited=max(ev.limit_s or 0.0, share / 3, 1.0)) \
                        if time.perf_counter() < deadline else None
                    start.append(Candidate(ce, y, tuple(st2)))
                    fam_seed["expert"] = start[-1]
                    totals["expert_seeds"] = totals.get("expert_seeds", 0) + 1
                    totals.setdefault("expert_seed_s", []).append(ce if ce is not None and math.isfinite(ce) else None)
            tp = tp_seeds.get(d)
            if tp:
                # Megatron pairs (and column-split tables) of degree tp on data parallelism of degree d
                try:
                    y, st2 = tensor_parallel_steps(x, tp, book)
                except KeyboardInterrupt:
                    interrupted = True
                    break
                if st2:
                    start.append(Candidate(None, y, tuple(st) + tuple(st2)))
                    fam_seed[f"tp{tp}x{d}"] = start[-1]
                    totals["tp_seeds"] = totals.get("tp_seeds", 0) + 1
                    if any(s.rule in TABLE_COLUMN_RULES for s in st2):
                        # Megatron-LM keeps the tables whole (on the copies): the segment's seed of the
                        # copies family (not a start of the segment search; assembled, see below); data
                        # parallel where only tables were split
                        y2, st3 = tensor_parallel_steps(x, tp, book, tables=False)
                        fam_seed[f"tp{tp}x{d} copies"] = Candidate(None, y2, tuple(st) + tuple(st3))

        def keyf(x: PCG, seg=seg):
            return boundary_keys(seg, x)
        if dp_seed is not None and dp_seed.cost is not None:
            dp_memo[key] = choice(dp_seed, keyf(dp_seed.graph), cross_idx)
        elif dp_seed is not None:           # built past the deadline, not priced
            dp_memo[key] = SegmentChoice(INF, INF, dp_seed.steps, keyf(dp_seed.graph))
        else:
            dp_memo[key] = SegmentChoice(INF if start[0].cost is None else start[0].cost, INF, (), keyf(cg))
        for name, c in fam_seed.items():
            # every segment's seed, priced or not (a segment solve cut by its time limit reads inf; a
            # family with dp in that segment instead reshards at both its ends): the whole decides
            fam_memo.setdefault(name, {})[key] = SegmentChoice(c.cost or 0.0, 0.0, c.steps, ())
        starts.append((key, start, keyf, cross_idx))
    if early is not None and families is not None and not interrupted:
        early(build_families())
    for i, (key, start, keyf, cross_idx) in enumerate(starts):     # pass 2: the search of each segment
        share = max(deadline - time.perf_counter(), 0.0) / (len(uniq) - i)

        def expand(c: Candidate):
            for m, x in neighbours(c.graph, book.rules, book.degrees):
                yield x, (RuleStep.of(m),)

        def prog(stats, best, i=i):
            if progress is not None:
                progress({"segment": i + 1, "segments": len(uniq),
                          "explored": totals["explored"] + stats.explored, "best_segment_s": best})

        res = best_first(start, expand, evaluate, alpha, 0 if interrupted else max_candidates, share,
                         key=keyf, estimate=ev.estimate, progress=prog)
        totals["explored"] += res.stats.explored
        totals["evaluated"] += res.stats.evaluated
        totals["stopped"].append(res.stats.stopped)
        if res.stats.stopped == "interrupted":
            interrupted = True
        memo[key] = {kk: choice(c, kk, cross_idx) for kk, c in res.front.items() if math.isfinite(c.cost)}
    for key in uniq:
        memo.setdefault(key, {})
    dp_graph, dp_steps = assemble(g, segs, [dp_memo[s.key] for s in segs], book)
    if families is not None:
        families.update(build_families())
    choices = combine([memo[s.key] for s in segs])
    if not choices:
        return None, [], dp_graph, dp_steps, totals, interrupted
    out, steps = assemble(g, segs, choices, book)
    return out, steps, dp_graph, dp_steps, totals, interrupted


def _with_copies(built: tuple, k: int, book: RuleBook) -> tuple | None:
    """(graph, steps) of a tensor-parallel family with :func:`copies_steps` of degree ``k`` on top; None
    when nothing lifts (the family itself is priced as it is)."""
    fg, fst = built
    cg, more = copies_steps(fg, k, book)
    return (cg, list(fst) + list(more)) if more else None


def _build_and_price(ev: "Evaluator", name: str, build, until: float, limit: float, fam_cost: dict):
    """Build a seed family (``build()`` -> (graph, steps) or None) and price it, both before ``until``
    (the solve also within ``limit`` seconds); (cost, 2, graph, steps) or None.  ``fam_cost[name]``
    records its price (None: infeasible or cut) or why it was not priced."""
    if time.perf_counter() > until:
        fam_cost.setdefault(name, "not built within the budget")
        return None
    try:
        with _time_limit(max(until - time.perf_counter(), 0.01)):
            built = build()
    except _Timeout:
        fam_cost[name] = "not built within the budget"
        return None
    if built is None:
        return None
    fg, fst = built
    c = ev.cost(trimmed(fg), limited=limit)
    fam_cost[name] = c if math.isfinite(c) else None
    return (c, 2, fg, fst)


def _whole_family(g: PCG, book: RuleBook, d: int, tp: int, steps_fn) -> tuple | None:
    """A seed family built on the whole graph: data parallelism of degree ``d`` by rules, then ``steps_fn``
    (:func:`table_columns_steps`, :func:`tensor_parallel_steps`) of degree ``tp`` on top; None when the
    latter does not apply."""
    wx, wst = data_parallel_steps(g, d, book) if d > 1 else (g, [])
    wy, wst2 = steps_fn(wx, tp, book)
    return (wy, list(wst) + list(wst2)) if wst2 else None


#: the share of the budget (from the start of the call) within which the fixed strategies besides dp are
#: priced by the joint search (Megatron on BERT-Large at 192 GPUs: ~9 s of a 50 s budget)
BASELINE_SHARE = 0.5
#: the share of the budget (from the start) by which the seed families built on the whole graph are priced
WHOLE_FAMILY_SHARE = 0.6
#: the largest model (compute operators) whose tables-by-columns family is built on the whole graph
WHOLE_COLS_MAX_OPS = 200
#: machines larger than this price a Transformer's Megatron floor after the copies families (see optimize)
LATE_FLOOR_DEVICES = 256
#: the fixed strategies (besides dp) the joint search prices as floors, where they apply
FLOOR_STRATEGIES = ("megatron", "expert")


def _fixed_baselines(g: PCG, ev: "Evaluator", degree: int, m: MachineSpec, until: float) -> dict:
    """{name: (PCG, predicted cost or inf, note, MappingResult or None)} of the fixed strategies of :data:`FLOOR_STRATEGIES` that
    apply to ``g`` (built as ``--strategy NAME`` builds them: Megatron's tensor parallelism inside a node),
    each solve limited to the time left before ``until``.  Their layouts are not all reachable by the
    shipped rules (Megatron runs the operators between its groups on the tensor-parallel copies; the
    expert strategy splits a communication-intensive Linear on top of data parallelism), so the search
    cannot be relied on to find them; where one is faster than every plan reached by rules, it is
    returned, recorded as a fixed strategy (as the dp baseline is)."""
    from .baselines import StrategyError, build_strategy
    out: dict = {}
    for name in FLOOR_STRATEGIES:
        try:
            pg = build_strategy(g, name, degree, devices_per_node=m.devices_per_node)
        except StrategyError:
            continue                    # does not apply to this model
        out[name] = _price_baseline(ev, pg, until - time.perf_counter())
    return out


def _price_baseline(ev: "Evaluator", pg: PCG, left: float) -> tuple:
    """(PCG, cost or inf, note, MappingResult or None) of a fixed strategy's PCG mapped within ``left``
    seconds (its mapping is kept: the plan needs it when the baseline is returned)."""
    if left <= 0.05:
        return (pg, INF, "not priced within the budget", None)
    try:
        with _time_limit(left):
            r = ev.full(pg)
    except _Timeout:
        return (pg, INF, "not priced within the budget", None)
    return (pg, r.cost if r.feasible else INF, "" if r.feasible else (r.reason or "infeasible"), r)


def _whole_search(g: PCG, rules, book: RuleBook, cost: Callable[[PCG], float], budget_s: float,
                  max_candidates: int, alpha: float, progress, start_steps=()) -> tuple:
    """Best-first search over the whole graph with ``rules`` (used by the sequential strategy)."""
    def evaluate(x):
        return cost(x), None

    def expand(c):
        for m, x in neighbours(c.graph, rules, book.degrees):
            yield x, (RuleStep.of(m),)

    def prog(stats, best):
        if progress is not None:
            progress({"explored": stats.explored, "best_s": best})

    res = best_first([Candidate(cost(g), g, tuple(start_steps))], expand, evaluate, alpha, max_candidates,
                     budget_s, progress=prog)
    return res.best.graph, list(res.best.steps), res.stats


def _price_dp_by_rules(ev: "Evaluator", g: PCG, book: RuleBook, dpg: PCG, steps, dp_pg: PCG | None,
                       left: Callable[[], float], stats: dict) -> tuple:
    """(cost, 0, graph, steps) of data parallelism by rules, the search's floor.  When it is exactly the
    hand-built dp PCG (normalized structural hash) it is priced without a time limit (a data-parallel
    graph at full degree solves as fast as the baseline did); otherwise (an operator without a dp
    rule stays whole) within the time left, and ``stats["dp_by_rules"]`` says how it differs."""
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
    return (ev.cost(t, limited=False if same else left()), 0, dpg, steps)


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

    def to_json(self) -> dict:
        return {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.reason, "devices": self.devices,
                "comm_elements": self.breakdown.comm_elements, "max_memory_bytes": self.memory.max_bytes,
                "memory_per_device": {str(d): v for d, v in sorted(self.memory.per_device.items())},
                "stats": dict(self.stats)}


def _pipeline(g: PCG, ev: "Evaluator", budget_s: float):
    """The best 1F1B pipeline (search/pipeline.py), or None.  One stage with M micro-batches is
    gradient accumulation: in the space too (Alpa's GPT plans at batch 1024 are often just that)."""
    try:
        from .pipeline import PipelineError, search_pipeline
    except ImportError:
        return None
    t0 = time.perf_counter()
    # nothing may fit with the default micro-batch counts (at most 8 per stage): a large batch (a language
    # model's 1,024 sequences) may need many more micro-batches before one micro-batch's activations fit
    b = _batch_of(g)
    more = [m for m in (64, 128, 256, 512, 1024) if b and b % m == 0]
    try:       # the whole share, unless the fallbacks below may need time
        r = search_pipeline(g, ev.mapper, min_stages=1, budget_s=max(budget_s / 2 if more else budget_s, 0.01))
    except (PipelineError, UnityError, KeyboardInterrupt):      # Ctrl-C: keep the plan found so far
        return None
    if (r is None or not r.feasible) and more:
        try:
            r2 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=more,
                                 budget_s=max(budget_s - (time.perf_counter() - t0), 0.01))
        except (PipelineError, UnityError, KeyboardInterrupt):
            return r
        if r2 is not None and (r is None or (r2.feasible, -r2.cost) > (r.feasible, -r.cost)):
            r = r2
    if (r is None or not r.feasible) and more:
        # still nothing: stages data parallel inside hold every weight of the stage on each device;
        # Megatron's tensor parallelism inside the stages divides them (with the vocabulary-parallel
        # head: search/pipeline.py megatron_intra)
        from .pipeline import megatron_intra
        tensor_parallel = megatron_intra(ev.machine.devices_per_node)
        try:
            r3 = search_pipeline(g, ev.mapper, min_stages=1, micro_batches=more, intra=tensor_parallel,
                                 budget_s=max(budget_s - (time.perf_counter() - t0), budget_s / 2, 0.01))
        except (PipelineError, UnityError, KeyboardInterrupt):
            return r
        if r3 is not None and (r is None or (r3.feasible, -r3.cost) > (r.feasible, -r.cost)):
            r = r3
    return r


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


def optimize(model, machine, budget_s: float | None = None, alpha: float = 1.05, pipeline: bool = True,
             strategy: str = "unity", optimizer: str = "adam", batch: int | None = None, seed: int = 0,
             progress: Callable[[dict], None] | None = None, max_candidates: int = 40, k: int = 10,
             budget: float | None = None, rules=None, price_limit_s: float | None = None,
             precision: str = "fp32") -> OptimizeResult:
    """Optimize ``model`` (an ONNX path or a PCG) for ``machine`` (a MachineSpec or a preset string
    such as ``"summit:2x6"``); see the module docstring.  ``budget`` is an alias of ``budget_s``
    (default 60 s).  ``seed`` is recorded; the search itself is deterministic."""
    from unity_pcg.plan import Plan
    t0 = time.perf_counter()
    if budget_s is None:
        budget_s = budget if budget is not None else 60.0
    if strategy not in STRATEGIES:
        raise OptimizeError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise OptimizeError(f"budget must be a positive number of seconds, got {budget_s!r}")
    if not alpha >= 1.0:
        raise OptimizeError(f"alpha must be at least 1, got {alpha!r}")
    if batch is not None and batch < 1:
        raise OptimizeError(f"batch must be a positive integer, got {batch}")
    if max_candidates < 0:
        raise OptimizeError(f"max_candidates must be >= 0, got {max_candidates}")
    if precision not in ("fp32", "tf32", "bf16"):
        raise OptimizeError(f"precision must be fp32, tf32 or bf16, got {precision!r}")
    m = machine if isinstance(machine, MachineSpec) else parse_machine(str(machine))
    g, model_path, sha = _load(model, batch)
    marks = {"import": time.perf_counter() - t0}
    b = _batch_of(g)
    degrees = machine_degrees(m)
    n_dev = m.num_devices
    if n_dev > 1 and b is not None and not any(b % d == 0 for d in degrees):
        raise OptimizeError(f"batch {b} is not divisible by any parallel degree of machine {m.name} "
                            f"({', '.join(map(str, degrees[:8]))}{' ...' if len(degrees) > 8 else ''})")
    ev = Evaluator(m, optimizer, limit_s=price_limit_s if price_limit_s is not None else max(1.0, budget_s / 30),
                   precision=precision)
    from .baselines import StrategyError, build_strategy
    dp_res = dp_pg = None
    dp_deg = max((d for d in degrees if b is None or b % d == 0), default=1)
    try:
        if n_dev > 1:
            dp_pg = build_strategy(g, "dp", dp_deg)
            dp_res = ev.full(dp_pg)
        marks["dp_baseline"] = time.perf_counter() - t0
    except StrategyError:
        dp_res = dp_pg = None

    steps: list = []
    stats: dict = {}
    interrupted = False
    pipe_plan = None
    if strategy == "alpa":
        # Alpa's two passes (intra-operator ILP per stage, inter-operator stage DP), priced by our
        # 1F1B simulation: the plan always has a pipeline field (one stage: gradient accumulation)
        from .alpa.inter import alpa_plan
        ar = alpa_plan(g, m, optimizer=optimizer, mapper=ev.mapper, time_limit_s=min(30.0, budget_s))
        pipe_plan = ar.pipeline
        if pipe_plan.pcg is None:
            raise OptimizeError(f"alpa: no plan for {m.name}: "
                                f"{ar.stats.get('stitch_error') or pipe_plan.reason or 'the stages do not join'}")
        pg, rules_json = pipe_plan.pcg, None
        final = _PipelineMapping(pipe_plan, n_dev)
        stats = {"chosen": "alpa", "pipeline_stages": pipe_plan.num_stages, "micro_batches": ar.micro_batches,
                 "alpa": {k: ar.stats.get(k) for k in ("layers", "planner_s", "solves", "micro_batches_tried")},
                 "alpa_stages": ar.stages}
    elif strategy in FIXED:
        deg = 1 if strategy == "none" else dp_deg
        try:
            # as `simulate --strategy` builds it (Megatron's tensor parallelism inside a node)
            pg = build_strategy(g, strategy, deg, devices_per_node=m.devices_per_node)
        except StrategyError as e:
            raise OptimizeError(str(e)) from None
        res_ = Resource(0, 1, 1) if strategy == "none" else None
        final = ev.full(pg, res_)
        rules_json = None
    else:
        book = RuleBook(rules, search_degrees(m))
        # The budget is the wall time of the whole call: the substitution search stops early enough
        # for the whole-graph pricing of its result (finish) and the pipeline stage search (pipe)
        end = t0 + budget_s
        pipe_share = budget_s * 0.25 if pipeline and strategy == "unity" and n_dev > 1 else 0.0
        finish = budget_s * 0.1
        deadline = max(end - pipe_share - finish, time.perf_counter())
        # the end of the substitution phase: no limited solve past it (the final whole-graph mapping of
        # the chosen plan, unlimited, has the last 4% of its share)
        sub_end = end - pipe_share - budget_s * 0.04

        def left_for_pricing() -> float:      # a whole-graph solve of the search's result, time-limited
            return max(finish, min(max(10.0, budget_s / 3), sub_end - time.perf_counter()))
        floor: list = []
        cands: list = []
        labels: dict = {}
        others: dict = {}
        late = False
        try:
            if strategy == "unity":
                if n_dev > 1 and dp_deg > 1:
                    # the other fixed strategies that apply (Megatron, expert), priced first like dp: the
                    # result is never predicted slower than one of them (they are the floor where the
                    # rules do not reach their layout); by BASELINE_SHARE of the budget
                    # on a large machine one solve of a Transformer takes a large share of the budget (BERT-Large at
                    # 1,024 GPUs: ~40 s of 100): Megatron's floor is then priced after the rules' Megatron-LM layout
                    # (the copies families, below; the floor's cut solve resumes with what is left)
                    late = n_dev > LATE_FLOOR_DEVICES and any(n.op == "Softmax" for n in g.nodes())
                    others = _fixed_baselines(g, ev, dp_deg, m, t0 + (0.0 if late else budget_s * BASELINE_SHARE))
                    marks["baselines"] = time.perf_counter() - t0
                dps = [d for d in degrees if b is None or b % d == 0]
                fams: dict = {}
                fam_cost: dict = {}
                # the seed families built on the whole graph (not from segments), priced before the
                # segment search (each is a fixed rule sequence; DLRM's best plan at 96 GPUs is one),
                # within WHOLE_FAMILY_SHARE of the budget. The tables-by-columns layout: assembled from
                # segment seeds it loses the dense layers' data parallelism on top (DLRM at summit:8x6:
                # 0.86 s assembled, 0.28 s whole); only for models with embedding tables and at most
                # WHOLE_COLS_MAX_OPS operators (data parallelism by rules over the whole of BERT-Large
                # takes ~2 minutes).  The Megatron seeds on the whole graph of a small model: a template
                # that spans a segment cut (the attention block of one Transformer layer: ~20 operators,
                # two segments) applies only there
                n_ops = sum(n.kind == "compute" for n in g.nodes())
                whole: dict = {}
                if any(n.op == "Embedding" for n in g.nodes()) and n_ops <= WHOLE_COLS_MAX_OPS:
                    for d, tp in sorted(megatron_seed_degrees(m, dps).items()):
                        whole[f"cols{tp}x{d} whole"] = partial(_whole_family, g, book, d, tp, table_columns_steps)
                # a small dense model (no embedding table) gets every tensor-parallel degree of the machine,
                # smallest first (whole_tp_degrees: CANDLE-Uno's best is k = 4, neither nodes nor 2)
                dense = n_ops <= WHOLE_DENSE_TP_MAX_OPS and not any(n.op == "Embedding" for n in g.nodes())
                widths = {g.shape(tuple(n.inputs[1])).sizes[-1] for n in g.nodes() if n.op == "Linear"}
                tp_whole = (whole_tp_degrees(m, dps, widths) if dense else
                            dict(sorted(megatron_seed_degrees(m, dps).items())) if n_ops <= WHOLE_TP_MAX_OPS else {})
                for d, tp in tp_whole.items():
                    whole[f"tp{tp}x{d} whole"] = partial(_whole_family, g, book, d, tp, tensor_parallel_steps)
                ev.wall = max(t0 + budget_s * WHOLE_FAMILY_SHARE, time.perf_counter())
                for name, build in whole.items():
                    # each may use the time left to the wall (DLRM's tables split 32 ways by columns at
                    # 192 GPUs solve in ~10 s, ~20 s on a loaded host)
                    got = _build_and_price(ev, name, build, ev.wall, max(ev.wall - time.perf_counter(), 0.05), fam_cost)
                    if got is not None:
                        cands.append(got)
                        labels[id(got[2])] = f"seed family {name} by rules"
                marks["whole_families"] = time.perf_counter() - t0
                deadline = max(end - pipe_share - finish, time.perf_counter())
                ev.wall = sub_end                   # no limited solve past the substitution phase
                attention = any(n.op == "Softmax" for n in g.nodes())

                def early(fs: dict):
                    # Megatron-LM's layout (the copies families) of a model with attention, built and priced
                    # between the segments' seeds and their search: on BERT-Large it is the best plan
                    # (192 GPUs: 0.668 s, hand-built Megatron 0.676 s, the segments' search 0.846 s) and
                    # takes ~15-30 s to build and solve, which the segments' search would use first
                    # Megatron-LM's degrees first: tensor parallel inside a node, the largest first (the
                    # families' estimates are unpriced seeds: inf; at h100:128x8 tp128x8 came first by name)
                    def order(kv):
                        k = int(kv[0][2:].split("x")[0]) if kv[0].startswith("tp") else 0
                        return (k > m.devices_per_node, -k, kv[1][1], kv[0])
                    for name, (build, _) in sorted(fs.items(), key=order):
                        if attention and name.endswith(" copies"):
                            got = _build_and_price(ev, name, build, sub_end, max(sub_end - time.perf_counter(), 0.05),
                                                   fam_cost)
                            if got is not None:
                                cands.append(got)
                                labels[id(got[2])] = f"seed family {name} by rules"
                    marks["early_families"] = time.perf_counter() - t0
                out, st, dpg, dpst, stats, interrupted = _segment_search(
                    g, book, ev, dps, dp_deg, k, max_candidates, alpha, progress, deadline, fams, early)
                # data parallelism by rules (assembled from the segments' seeds): the floor.  A fixed
                # sequence (one dp rule per operator, then cancellations), never cut by the budget;
                # when it is the hand-built dp PCG its solve costs what dp_res cost (cheap), so it is
                # priced without a time limit: a plan reached by rules always exists
                floor.append(_price_dp_by_rules(ev, g, book, dpg, dpst, dp_pg, left_for_pricing, stats))
                stats["phase_s"] = {"segments": time.perf_counter() - t0}
                stats["late_floors"] = late
                marks["segments"] = time.perf_counter() - t0
                if out is not None:
                    # the search's result is priced even when the segments ran to the wall (then for
                    # at most 3% of the budget): it is what the search found
                    c = ev.cost(trimmed(out), limited=max(min(left_for_pricing(), sub_end - time.perf_counter()),
                                                          min(budget_s * 0.03, 3.0)), wall=False)
                    cands.append((c, 1, out, st))
                    stats["search_result_s"] = c if math.isfinite(c) else None
                else:
                    stats["search_result_s"] = None
                # every seed family assembled over the whole graph from the segments' seeds (expert,
                # Megatron), priced as a whole
                for name, (build, _) in sorted(fams.items(), key=lambda kv: (kv[1][1], kv[0])):
                    if name in fam_cost:        # priced (or tried) between the segments' seeds and search
                        continue
                    got = _build_and_price(ev, name, build, sub_end, left_for_pricing(), fam_cost)
                    if got is not None:
                        cands.append(got)
                        labels[id(got[2])] = f"seed family {name} by rules"
                stats["seed_families_s"] = fam_cost
                stats["phase_s"]["whole_graph_pricing"] = time.perf_counter() - t0 - stats["phase_s"]["segments"]
                # a baseline whose solve was cut resumes (the mapper keeps the subproblems it solved) with
                # what is left of the substitution phase: on a loaded machine Megatron's solve on
                # BERT-Large outlasts its share
                for name, (opg, oc, note, ores) in list(others.items()):
                    if ores is None:
                        others[name] = _price_baseline(ev, opg, end - pipe_share - time.perf_counter())
            else:
                one = Resource(0, 1, 1)
                alg = [r for r in book.rules if not r.is_parallel]
                par = [r for r in book.rules if r.is_parallel]
                half = (deadline - t0) / 2
                g1, st1, s1 = _whole_search(g, alg, book, lambda x: ev.cost(trimmed(x), one), half, 10 ** 9, alpha, progress)
                # parallelization from the algebraic optimum: its data-parallel version seeds the search
                g2, st2 = (g1, [])
                if n_dev > 1 and dp_deg > 1:
                    g2, st2 = data_parallel_steps(g1, dp_deg, book)
                    dg, dst = data_parallel_steps(g, dp_deg, book)
                    stats = {}
                    floor.append(_price_dp_by_rules(ev, g, book, dg, dst, dp_pg, left_for_pricing, stats))
                left = max(deadline - time.perf_counter(), 0.01)
                g3, st3, s2 = _whole_search(g2, par, book, lambda x: ev.cost(trimmed(x)), left, max_candidates, alpha, progress,
                                            start_steps=st1 + st2)
                cands.append((ev.cost(trimmed(g3), limited=left_for_pricing()), 1, g3, st3))
                stats = dict(stats, algebraic=s1.to_json(), parallel=s2.to_json())
                interrupted = "interrupted" in (s1.stopped, s2.stopped)
        except KeyboardInterrupt:
            interrupted = True
        ev.wall = None
        if not floor and not cands:
            floor.append((ev.cost(g), 0, g, []))
        marks["whole_graph_pricing"] = time.perf_counter() - t0
        best = min(floor + cands, key=lambda c: (c[0], c[1]))
        pg, steps = trimmed(best[2]), list(best[3])
        if math.isfinite(best[0]):
            final = ev.full(pg)
        else:           # nothing reachable was priced feasible within the limits: no whole-graph solve
            final = ev.full(g, Resource(0, 1, 1))
            stats = dict(stats, unpriced=True)
        if not final.feasible or not math.isfinite(best[0]):
            # nothing reachable fits: fall back to a feasible fixed strategy (recorded as such)
            for name in FIXED:
                try:
                    alt = build_strategy(g, name, 1 if name == "none" else dp_deg, devices_per_node=m.devices_per_node)
                except StrategyError:
                    continue
                r = ev.full(alt, Resource(0, 1, 1) if name == "none" else None)
                if r.feasible:
                    pg, final, steps = alt, r, []
                    stats = dict(stats, fallback=name)
                    break
        rules_json = tuple(s.to_json() for s in steps) if not stats.get("fallback") else None
        marks["final_mapping"] = time.perf_counter() - t0
        if pipeline and strategy == "unity" and (n_dev > 1 or not final.feasible) and not interrupted:
            tp0 = time.perf_counter()
            # the stage search overshoots the budget it is given (DenseNet-121 at 192 GPUs: 16.7 s for
            # 9 s; one number of micro-batches always runs): it gets 60% of the time left, and a hard
            # stop 3% of the budget past the end (then no pipeline plan)
            room = max(end - tp0, budget_s * 0.05)
            try:
                with _time_limit(room + budget_s * 0.03):
                    pipe = _pipeline(g, ev, room * 0.6)
            except _Timeout:
                pipe = None
                stats = dict(stats, pipeline_cut=True)
            marks["pipeline"] = time.perf_counter() - t0
            stats = dict(stats, pipeline_s=time.perf_counter() - tp0,
                         pipeline_iteration_s=pipe.cost if pipe is not None and pipe.feasible else None)
            if pipe is not None and pipe.feasible and (not final.feasible or pipe.cost < final.cost):
                # pipeline stages (search/pipeline.py): a mapping decision of the stage DP; the PCG
                # inside them, data parallelism, reached by rules where it can be (pipeline.by_rules:
                # the sequence is recorded); Megatron's stages record none
                from .pipeline import by_rules
                tr = time.perf_counter()
                # within the budget: on BERT-Large at 192 GPUs it took 118 s (whole-graph rules); stages data
                # parallel inside are built by segments (linear, 2-4 s CPU on Inception-v3): like data
                # parallelism by rules they may run up to 10% of the budget past its end (at 1,024 GPUs on a
                # loaded host the stage search's overshoot left them the 3% floor, and the plan had no rules)
                floor = 0.10 if (pipe.origin or {}).get("dp_inside") else 0.03
                try:
                    with _time_limit(max(end - tr, budget_s * floor)):
                        pipe = by_rules(g, pipe, ev.machine, book, mapper=ev.mapper) or pipe
                    stats = dict(stats, pipeline_by_rules="reached" if pipe.rules is not None else "not reached")
                except _Timeout:
                    stats = dict(stats, pipeline_by_rules="cut by the budget")
                marks["pipeline_by_rules"] = time.perf_counter() - t0
                pipe_plan = pipe
                steps = list(pipe.rules or ())
                pg, rules_json = pipe.pcg, (tuple(s.to_json() for s in steps) if pipe.rules is not None else None)
                final = _PipelineMapping(pipe, n_dev)
                stats = dict(stats, chosen="pipeline", pipeline_stages=pipe.num_stages,
                             micro_batches=pipe.micro_batches)
        if strategy == "unity":
            # The promise "never predicted slower than data parallel where it fits" (and than the other
            # fixed strategies that apply: Megatron, expert) outranks rule reachability: where the rules
            # cannot build the baseline's PCG (an operator without a dp rule; Megatron's operators between
            # its groups on the tensor-parallel copies) or the budget ran out first, the fastest
            # hand-built baseline is returned, recorded as such (no rule sequence), as a pipeline plan is.
            alts = [(dp_res.cost, "dp", dp_pg, dp_res)] if dp_res is not None and dp_res.feasible else []
            alts += [(oc, name, opg, ores) for name, (opg, oc, _, ores) in others.items()
                     if ores is not None and math.isfinite(oc)]
            # (faster by more than rounding: the rules' version of a baseline prices the same up to the
            # last bits, and then the plan reached by rules is kept)
            for oc, name, opg, ores in sorted(alts, key=lambda a: a[0]):
                if final.feasible and not oc < final.cost * (1 - 1e-9):
                    break
                if not ores.feasible or (final.feasible and not ores.cost < final.cost * (1 - 1e-9)):
                    continue
                pipe_plan = None
                pg, steps, rules_json, final = opg, [], None, ores
                if name == "dp":
                    why = stats.get("dp_by_rules", {}).get("differs") or "not priced within the budget"
                    stats = dict(stats, chosen=f"data parallel baseline (dp by rules: {why})")
                else:
                    stats = dict(stats, chosen=f"{name} baseline (faster than every plan reached by rules within "
                                               f"the budget)")
                break
            stats = dict(stats, baselines_s={"dp": dp_res.cost if dp_res is not None and dp_res.feasible else None,
                                             **{name: (oc if math.isfinite(oc) else note or None)
                                                for name, (_, oc, note, _) in others.items()}})
        stats = dict(stats, chosen=stats.get("chosen") or labels.get(id(best[2]), "data parallel by rules" if best[1] == 0 else "search"),
                     mapper_calls=ev.calls, mapper_timeouts=ev.timeouts)
        if strategy == "unity":        # the substitution phase's wall and the end of the last solve under it
            stats["wall_s"] = {"wall": round(sub_end - t0, 3),
                               "last_walled_solve_end": round(max(ev.last_walled_end - t0, 0.0), 3)}
    search_s = time.perf_counter() - t0
    if strategy in SEARCHES:       # seconds since the start at the end of each phase
        marks["end"] = search_s
        stats["timeline_s"] = {k: round(v, 2) for k, v in marks.items()}
    pred = dict(final.to_json(), strategy=strategy, optimizer=optimizer, precision=precision, search_s=search_s)
    plan = Plan(model_path, sha, m, pg, final.views, pred,
                pipe_plan.to_plan_field() if pipe_plan is not None else None,
                {"strategy": strategy, "seed": seed, "alpha": alpha, "budget_s": budget_s, "optimizer": optimizer,
                 "batch": b, "search": stats,
                 **({"outputs_trimmed": True} if rules_json is not None else {})}, rules_json, precision)
    # never a plan the executor refuses before launch: else the fastest alternative it runs (search/runnable.py)
    if strategy in SEARCHES:
        plan, final, steps, stats = runnable(plan, final, steps, stats, ev, g, cands + (floor if isinstance(floor, list)
                                                                                         else []), labels,
                                             dp=(dp_pg, dp_res), others=others)
    else:
        runnable(plan, final, steps, stats)     # recorded: the strategy asked for is returned
    return OptimizeResult(plan, strategy, final, dp_res, steps, search_s, stats, interrupted, b)


__all__ = ["optimize", "OptimizeResult", "OptimizeError", "STRATEGIES", "machine_degrees", "search_degrees",
           "megatron_seed_degrees", "whole_tp_degrees"]
