"""Baselines as their users tune them (DESIGN "Baselines"): Megatron-LM's and FSDP's (ZeRO-3) best
configuration for a model and machine, priced in our cost model -- what Mist and Aceso compare against.

    from unity_pcg.search.tuned import tune
    r = tune(g, mapper, "megatron", deadline=Deadline.after(30))
    r.config.to_json()   # {"tp": 4, "pp": 2, "dp": 8, "micro_batch": 2, "micro_batches": 64,
                         #  "recompute": "selective", "distributed_optimizer": True, "sp": False}

**megatron**: the fastest feasible point of a grid over

* ``tp``: tensor-parallel degree, a divisor of the devices of a node (Megatron's column -> row Linear
  groups, :func:`search.baselines.megatron`; the degree a model's heads take, else smaller);
* ``pp``: pipeline degree, stages of (about) equal layers in order, each on a contiguous block of
  ``N / pp`` devices, 1F1B (:mod:`search.pipeline`'s layers, exact stage pricing and simulation; inside a
  stage :func:`search.pipeline.megatron_intra` at degree ``tp``, the vocabulary-parallel head included);
* ``dp = N / (tp pp)`` data-parallel copies, and the micro-batch size ``mbs`` per copy: a global batch
  B runs as ``M = B / (dp mbs)`` micro-batches (gradient accumulation when ``pp = 1``);
* activation recomputation ``none`` / ``selective`` / ``full`` on every region, the distributed optimizer
  (ZeRO-1 over the data-parallel copies) on or off -- the memory techniques, priced by
  :mod:`search.memtech` when it is present (else the grid holds only ``none`` / off: :func:`techniques`)
  -- and sequence parallelism ``sp`` at every tp > 1, a layout (:func:`search.baselines.megatron`'s
  ``sequence_parallel``, in stages :func:`search.pipeline.megatron_intra`'s ``sp``): each (tp, pp, mbs)
  point is mapped once without and once with it, and its techniques priced on both.

**zero3** (FSDP): data parallelism over every device with ZeRO-3 (parameters, gradients and optimizer
states sharded, parameters all-gathered for the forward and again for the backward, gradients
reduce-scattered every micro-batch), with and without recomputation, at every micro-batch size.

*Offload* in every grid, where the techniques are priced and the machine describes a host to put the
optimizer states in (``links["host"]``, ``host_mem_bandwidth``, ``host_memory_bytes``): the sharded states and
the update in host memory (Megatron-LM's distributed optimizer with CPU offload, ZeRO-3 with DeepSpeed's
optimizer offload, accumulation's ZeRO 1 / 3), on one-stage points (the executor offloads no pipeline), and
priced only where the same point without it does not fit: it adds the host transfers and runs the same
update at the host's bandwidth, so where that point fits it cannot be faster (:meth:`_Tuner._offload_may_fit`).

Unity's floors (:func:`floor`, not the ``--strategy`` baselines) price one more recompute choice at every
point, :data:`PER_REGION`: none where it fits, else memtech's fastest none / selective / full per region
that fits (``memtech.Techniques.choose``), the plan's MemoryPlan recording the regions.

The point ``tp`` = the plain baseline's degree, ``pp = 1``, ``mbs = B / dp``, no technique is exactly
the plain ``megatron`` baseline (built by :func:`search.baselines.build_strategy`, mapped by the same
mapper), priced first: the tuned result is never slower than it.  Layout points (``tp, pp, mbs``) need
a mapping each (the DP maps a layout once; its other micro-batch sizes are priced on the same views,
:class:`ViewReuse`); the techniques are priced on that mapping (no new mapping).  The walk is best-first
(:meth:`_Tuner._walk`): every pp = 1 pair prices one micro-batch size (the pairs nearest the plain point
first: the tensor degree nearest its own), then the walk whose next point has the lowest lower bound
(:meth:`_Tuner._bound`) takes the next step; each pair walks its micro-batch sizes from the promising end
(pp = 1: the largest first, fewest micro-batches; pp > 1: the smallest first, Megatron-LM's usual 1-4),
skipping sizes predicted not to fit and stopping once the time stops improving (:meth:`_Tuner._step`);
while no point of the grid fits, the walk is feasible-first instead (:meth:`_Tuner._feasible_first`: the
leanest walk, then alternately the time-best predicted to fit and the leanest; only the order changes);
the best point priced when a :class:`search.budget.Deadline` passes is the result, and the walk can go on
from there later (:meth:`_Tuner.resume`; ``stats["cut"]``).  A model the grid does not apply to (no attention block for Megatron; a
batch no degree divides) raises :class:`TunedError`, one line saying why.

Pipeline points with techniques: each stage's sub-PCG (at the micro-batch size, its own mapping) is
priced by ``memtech.price`` per technique; its recomputation is added to the stage's backward, its
per-iteration part (gradient sync as the machine overlaps it, the -- sharded -- update, ZeRO's gathers) to
the stage's once-per-iteration time (ZeRO-3: every micro-batch), and its memory is the weights part plus
the activations part times the micro-batches in flight (1F1B).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec, Resource
from unity_pcg.pcg import PCG

from .budget import Deadline, Expired, within

INF = math.inf
STRATEGIES = ("megatron", "zero3")
RECOMPUTE = ("none", "selective", "full")
#: recompute mode of a point whose regions are chosen one by one (``per_region``: Unity's floors, not the
#: baselines): memtech's fastest assignment of none / selective / full to each region that fits the device
PER_REGION = "per-region"
#: the most of the grid's time the plain Megatron point's DP solve takes (cut: mapped without the DP)
PLAIN_SHARE = 0.5
#: a (tp, pp = 1) pair whose best time after two micro-batch sizes is over DROP x the best of all pairs is dropped
DROP = 1.5
#: stage layers the pipeline points cut the model into (their count is a multiple of every pp <= 8 that
#: divides it, so stages get equal numbers of layers; layers have about equal forward FLOPs)
MAX_LAYERS = 24
SP_NOTE = ("sequence parallelism: a layout point of its own at every tp > 1 (the residual stream on tp sequence "
           "shards, reduce-scatter + all-gather at the tensor-parallel groups)")


class TunedError(UnityError, ValueError):
    """The tuned baseline does not apply to this model or machine (one line: why)."""


@dataclass(frozen=True)
class TunedConfig:
    """One point of the grid (``micro_batch``: samples per data-parallel copy and micro-batch;
    ``micro_batches``: per iteration; ``zero``: 1 with the distributed optimizer, 3 for zero3)."""
    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int
    recompute: str = "none"
    distributed_optimizer: bool = False
    sp: bool = False
    zero: int = 0
    layout: str = ""        # accumulate(): the layout's name ("data parallel", "layout mesh 2x4"); "": tp/dp
    offload: bool = False   # optimizer states and the update in host memory (module docstring)

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "micro_batch": self.micro_batch,
                "micro_batches": self.micro_batches, "recompute": self.recompute,
                "distributed_optimizer": self.distributed_optimizer, "sp": self.sp, "zero": self.zero,
                "offload": self.offload, **({"layout": self.layout} if self.layout else {})}

    def label(self) -> str:
        if self.layout:
            s = f"{self.layout}, micro-batch {self.micro_batch} x{self.micro_batches}"
        else:
            s = f"tp{self.tp} pp{self.pp} dp{self.dp} mbs{self.micro_batch} x{self.micro_batches}"
        if self.zero in (1, 2) and self.layout:
            s += f" zero{self.zero}"
        if self.recompute != "none":
            s += f" recompute={self.recompute}"
        if self.distributed_optimizer and not self.layout:
            s += " distopt"
        if self.zero == 3:
            s += " zero3"
        if self.offload:
            s += " offload"
        if self.sp:
            s += " sp"
        return s


@dataclass
class TunedResult:
    strategy: str
    config: TunedConfig | None        # the chosen point (None: nothing priced)
    cost: float                       # predicted iteration time (inf: infeasible)
    feasible: bool
    reason: str
    pcg: PCG | None                   # the plan's PCG (full batch; a pipeline's stages stitched)
    views: dict
    mapping: Any                      # MappingResult (pp = 1, one micro-batch) or None
    pipeline: Any                     # PipelineResult (otherwise) or None
    memory_plan: Any                  # unity_pcg.plan.MemoryPlan or None
    max_bytes: int = 0
    memory: dict = field(default_factory=dict)
    priced: list = field(default_factory=list)     # [{"config": ..., "cost": s or None, "reason": ...}]
    stats: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"strategy": self.strategy, "config": self.config.to_json() if self.config else None,
                "predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.reason, "max_memory_bytes": self.max_bytes,
                "points_priced": len(self.priced), **{k: v for k, v in self.stats.items()}}


# --- memory techniques (pluggable) -------------------------------------------------------------------

class _NoTechniques:
    """Without :mod:`search.memtech`: only 'no technique' is priced (the mapping's own numbers)."""
    available = False
    recompute = ("none",)

    def price(self, gc, views, recompute: str, zero: int, base, report=None, offload: bool = False):
        return None


class _Memtech:
    """The techniques as :mod:`search.memtech` prices them (one fixed MemoryPlan on a mapped graph); the
    per-mapping analysis (``memtech.Techniques``) is built once per mapping and reused by every plan."""
    available = True
    recompute = RECOMPUTE

    def __init__(self, mod):
        self.m = mod
        self._analysis: dict = {}
        self._chosen: dict = {}       # (id(graph), zero) -> (graph, the MemoryPlan PER_REGION chose on it)

    def plan(self, g: PCG, recompute: str, zero: int, regs=None, offload: bool = False):
        from unity_pcg.plan import MemoryPlan
        if recompute == PER_REGION:
            hit = self._chosen.get((id(g), zero, offload))
            return hit[1] if hit is not None and hit[0] is g else MemoryPlan(zero=zero, offload=offload)
        if recompute == "none":
            return MemoryPlan(zero=zero, offload=offload)
        regs = self.m.regions(g) if regs is None else regs
        return MemoryPlan(zero=zero, offload=offload, recompute=tuple(self.m.recompute_all(regs, recompute)))

    def price(self, gc, views, recompute: str, zero: int, base, report=None, offload: bool = False):
        """``report``: the mapping's memory without techniques, when known (the analysis then does not
        compute it again: ``memtech.plain_report``)."""
        key = (id(gc), id(views))
        hit = self._analysis.get(key)
        if hit is None or hit[0] is not gc:
            if len(self._analysis) > 64:
                self._analysis.clear()
            hit = self._analysis[key] = (gc, self.m.Techniques(gc, views, base, report=report))
        t = hit[1]
        if recompute == PER_REGION:      # no recomputation where it fits, else the fastest regions that fit
            q = t.choose(zero=(zero,), offload=(offload,))
            if len(self._chosen) > 256:
                self._chosen.clear()
            self._chosen[(id(gc.g), zero, offload)] = (gc.g, q.memory)
            return q
        return t.price(self.plan(gc.g, recompute, zero, t.regions, offload))


def techniques():
    """The technique pricer: :mod:`search.memtech` when it is importable, else none."""
    try:
        from . import memtech
    except ImportError:
        return _NoTechniques()
    if not all(hasattr(memtech, a) for a in ("Techniques", "regions", "recompute_all")):
        return _NoTechniques()
    return _Memtech(memtech)


# --- the grid ----------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_divisors(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        if n % k == 0:
            out.append(k)
        k *= 2
    if n not in out:
        out.append(n)
    return out


def _block_ok(machine: MachineSpec, size: int) -> bool:
    """A stage of ``size`` devices is whole nodes or a divisor of a node (the pipeline's sub-meshes)."""
    D = machine.devices_per_node
    return (size % D == 0 and machine.num_devices % size == 0) if size >= D else D % size == 0


def pairs(machine: MachineSpec, strategy: str, layers: int) -> list[tuple[int, int]]:
    """The (tp, pp) pairs of the grid: tp divides a node's devices and a stage's, pp divides the devices
    into stage blocks the pipeline can place and is at most the number of layers."""
    N, D = machine.num_devices, machine.devices_per_node
    if strategy == "zero3":
        return [(1, 1)]
    out = []
    for pp in _divisors(N):
        if pp > max(layers, 1) or not _block_ok(machine, N // pp):
            continue
        for tp in _divisors(D):
            if (N // pp) % tp == 0:
                out.append((tp, pp))
    return out


def _closeness(w: dict, plain) -> tuple:
    """The order in which the (tp, pp) walks take their first step: nearest the plain point first (fewest
    stages, then the tensor degree nearest the plain one's, on a log scale), so that when the deadline
    cuts the grid, the points priced are those most likely to beat the plain point; stable otherwise."""
    return (w["pp"], abs(math.log2(max(w["tp"], 1)) - math.log2(max(plain.tp, 1))))


def micro_batch_sizes(B: int, dp: int, pp: int) -> list[int]:
    """Micro-batch sizes per copy, most promising first: powers of two dividing B / dp (and B / dp itself);
    pp = 1 largest first (fewest micro-batches), pp > 1 smallest first, at least pp micro-batches."""
    per = B // dp
    ms = _pow2_divisors(per)
    if pp > 1:
        return sorted(m for m in ms if per // m >= pp)
    return sorted(ms, reverse=True)


# --- pricing ------------------------------------------------------------------------------------------

def _split(report) -> tuple:
    """(weights part, the rest) of a MemoryReport's busiest device: the weights, gradients and optimizer states
    do not scale with the micro-batch; everything else does (the activations kept, and the backward's working
    set: the gradients of activations, the loss's copies of the outputs)."""
    if report is None or not report.per_device:
        return (0, 0)
    dev = max(report.per_device, key=report.per_device.get)
    w = int(report.weights.get(dev, 0))
    return w, max(int(report.per_device[dev]) - w, 0)


def layout_key(g: PCG) -> tuple:
    """The layout of a parallel PCG without its sizes: every node's id, operator, inputs and the parallel
    degrees of its outputs (the batch, and what a reshape's attributes say of it, left out).  Two graphs with
    the same key differ only in sizes, so a machine view of one node is a view of the same node in the other."""
    out = []
    for nid in g.topo_order():
        n = g.node(nid)
        out.append((nid, n.op, tuple(tuple(r) for r in n.inputs),
                    tuple((s.copy_degree, s.sum_degree) + s.degrees for s in g.shapes(nid))))
    return tuple(out), tuple(tuple(r) for r in g.outputs)


def sized_key(g: PCG) -> tuple:
    """The structure of ``g`` with its sizes and parallel shapes but without node ids or names: every node in
    topological order by its operator, attributes (the name left out), inputs (by position) and output
    shapes.  Two graphs with the same key (a model's repeated stages) differ only in node ids and names,
    so a mapping of one is a mapping of the other, its nodes renamed by position."""
    idx: dict = {}
    items = []
    for nid in g.topo_order():
        n = g.node(nid)
        idx[nid] = len(items)
        attrs = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in n.attrs if k != "name")
        items.append((n.op, attrs, tuple((idx[r[0]], r[1]) for r in n.inputs),
                      tuple((s.sizes, s.degrees, s.copy_degree, s.sum_degree) for s in g.shapes(nid))))
    return tuple(items), tuple((idx[r[0]], r[1]) for r in g.outputs)


def moved(r, ids: dict, delta: int):
    """The MappingResult ``r`` of a graph carried to an identical graph (``ids``: its node id -> the other's)
    on a block ``delta`` devices further of the same :func:`_position` (costs depend only on which devices
    share a group or node, so the price is the same and the views and per-device memory move)."""
    from unity_pcg.machine import MachineView
    from .memory import MemoryReport
    views = {ids[n]: MachineView(v.start + delta, v.dims) for n, v in r.views.items()}
    mem = r.memory
    if mem is not None:
        mem = MemoryReport({d + delta: b for d, b in mem.per_device.items()},
                           {d + delta: b for d, b in mem.weights.items()},
                           {d + delta: b for d, b in mem.activations.items()}, mem.capacity)
    reason = ("out of memory: " + mem.reason()) if (mem is not None and not r.feasible) else r.reason
    return dataclasses.replace(r, views=views, memory=mem, reason=reason, decomposition=None,
                               stats=dict(r.stats, moved_by=delta))


def _position(machine: MachineSpec, res: Resource) -> tuple:
    """What of a block's place on the machine its DP's costs can see (they depend only on which devices share
    a group or a node): blocks of the same shape and position move onto one another.  A block inside one
    group: nothing (every pair of its devices is a group's); inside one node, with groups tiling the nodes:
    its offset in its group; otherwise its offset in its node (whole-node moves, as the DP's own memo)."""
    D, G = machine.devices_per_node, machine.group_size
    s = res.start
    if res.nodes == 1 and D % G == 0:
        if s // G == (s + res.size - 1) // G:
            return ("group",)
        return ("node", s % G)
    return ("machine", s % D)


class ViewReuse:
    """The mapper as the grid's points see it.  A layout (same :func:`layout_key`, same devices) mapped by
    the DP once is priced at every other micro-batch size on the views the DP chose for it
    (``mapper.evaluate``: the exact price of a valid mapping, linear in the graph) instead of solving the DP
    again; ``stats["reused"]`` counts them.  A graph identical to one already solved (same
    :func:`sized_key`: a pipeline's middle stages, up to node ids and names) on a block of the same shape
    and :func:`_position` takes that DP result, renamed and moved (:func:`moved`: the same floats as a fresh
    solve, since the DP's costs are invariant under such moves); ``stats["moved"]`` counts them.  Likewise
    a graph to be priced on reused views that are another identical graph's evaluated views, moved, takes that
    price, moved.
    Everything else is the wrapped mapper's."""

    def __init__(self, mapper, stats: dict):
        self._m = mapper
        self._views: dict = {}
        self._solved: dict = {}        # sized_key, block shape and position -> a DP's result
        self._evaluated: dict = {}     # the same -> an evaluate's result (priced on reused views)
        self._stats = stats

    def __getattr__(self, name):
        return getattr(self._m, name)

    def optimize(self, g: PCG, resource: Resource | None = None, fixed=None, techniques: bool | None = None):
        key = (layout_key(g), resource)
        views = self._views.get(key) if fixed is None else None
        skey = None
        if fixed is None and resource is not None:
            skey = (sized_key(g), resource.nodes, resource.per_node, _position(self._m.machine, resource),
                    techniques)
        if views is not None:
            self._stats["reused"] = self._stats.get("reused", 0) + 1
            hit = self._evaluated.get(skey) if skey is not None else None
            if hit is not None:         # the same graph already priced on these views, moved: moved too
                order, r0, start0 = hit
                ids = dict(zip(order, g.topo_order()))
                delta = resource.start - start0
                if {ids[n]: (v.start + delta, v.dims) for n, v in r0.views.items()} == \
                        {n: (v.start, v.dims) for n, v in views.items()}:
                    return moved(r0, ids, delta)
            r = self._m.evaluate(g, views, techniques=techniques)
            if skey is not None and r.views and r.memory_plan is None and r.techniques is None:
                self._evaluated[skey] = (list(g.topo_order()), r, resource.start)
            return r
        if skey is not None:
            hit = self._solved.get(skey)
            if hit is not None:
                order, r0, start0 = hit
                r = moved(r0, dict(zip(order, g.topo_order())), resource.start - start0)
                self._stats["moved"] = self._stats.get("moved", 0) + 1
                if r.views:
                    self._views[key] = dict(r.views)
                return r
        r = self._m.optimize(g, resource, fixed, techniques)
        if fixed is None and r is not None and r.views:
            self._views[key] = dict(r.views)
            if skey is not None and r.memory_plan is None and r.techniques is None:
                self._solved[skey] = (list(g.topo_order()), r, resource.start)
        return r


@dataclass
class _Point:
    """One priced technique combination of a layout point."""
    config: TunedConfig
    cost: float
    feasible: bool
    reason: str
    max_bytes: int
    memory: dict
    layout: Any                       # the _Layout it belongs to
    split: tuple = (0, 0)             # busiest device: (bytes that do not scale with the micro-batch, bytes that do)
    time_s: float = INF               # its time whether or not it fits (inf: not priced)


@dataclass
class _Layout:
    """A layout point (tp, pp, M) once mapped: either the whole graph (pp = 1, M = 1) or the stages."""
    tp: int
    pp: int
    dp: int
    M: int
    pcg: PCG | None = None            # whole: the parallel PCG
    mapping: Any = None               # whole: its MappingResult
    gM: PCG | None = None             # pipeline: the graph at the micro-batch size
    plan: tuple = ()                  # pipeline: ((first layer, end layer, first device, devices), ...)
    ev: dict | None = None            # pipeline: search.pipeline._evaluate's result
    reason: str = ""
    gc: Any = None                    # whole: the GraphCost the techniques are priced on
    name: str = ""                    # accumulate(): the layout's name
    sp: bool = False                  # Megatron-LM's sequence parallelism (a layout of its own)

    def work(self) -> float:
        """Per device and iteration, the forward and backward with their tensor-parallel transfers, no memory
        technique, no gradient sync or update (inf: not priced): what a pipeline of the same tensor degree and
        micro-batch size runs too, split over its stages (:meth:`_Tuner._bound`)."""
        if self.mapping is not None:
            b = self.mapping.breakdown
            return max(b.time - b.sync - b.update, 0.0) if math.isfinite(b.time) else INF
        if self.ev is not None and self.pp == 1 and self.ev.get("priced"):
            return self.M * sum(p.t for p in self.ev["priced"])
        return INF


class _Tuner:
    """One grid search: the layout points mapped (:meth:`whole`, :meth:`pipeline`), their technique
    points priced (:meth:`price_layout`), the walks over micro-batch sizes (:meth:`run`), the result."""

    #: a plan's time the caller has (accumulate(beat=)): points that recompute and could not be faster are not
    #: priced (:meth:`_recompute_bounded`)
    beat: float = INF
    #: whether the grid prices offload (set from the machine and the techniques in ``__init__``)
    offload: bool = False

    def __init__(self, g: PCG, mapper, strategy: str, deadline: Deadline | None, tech, cheap=None,
                 max_layers: int = MAX_LAYERS, sp: bool = True, grid: bool = True, per_region: bool = False):
        from .cost import GraphCost
        from .pipeline import batch_size, sequential_layers
        self.g, self.mapper, self.strategy = g, mapper, strategy
        self.sp = sp                      # the grid's sp axis (False: only sp = false points)
        self.per_region = per_region      # also the PER_REGION recompute (Unity's floors; not the baselines)
        self.grid = grid                  # False: only the first point (the plain one; zero3: one step)
        self.machine: MachineSpec = mapper.machine
        self.deadline = deadline
        self.tech = tech
        self.cheap = cheap
        self.B = batch_size(g)
        self.roles = GraphCost(g, mapper.model).role
        self.layers, self.info = sequential_layers(g, self.roles, max_layers)
        self.max_layers = max_layers
        self.points: list[_Point] = []
        self.priced: list[dict] = []
        self.graphs: dict = {}
        self.stats: dict = {"layers": len(self.layers), "layout_points": 0, "technique_points": 0,
                            "techniques": "memtech" if tech.available else "none (memory techniques off, or search.memtech absent)"}
        self.reuse = ViewReuse(mapper, self.stats)    # the micro-batch points of a layout: the DP once
        self.walks: list | None = None    # the (tp, pp) walks (None: not started)
        self.plain: _Layout | None = None
        self._pp1_layouts: dict = {}      # tp -> the pp = 1 layouts priced (the pipelines' bounds)
        self._ff_last = ""                # the last step's feasible-first pick: "time", "lean" or "" (none)
        # the least ratio of a walk's leanest bytes to what the estimate from other layouts said before it was
        # priced (1: none seen): how far that estimate has overstated on this grid (:meth:`_walk`)
        self._est_ratio = 1.0
        self._layout_points: dict = {}    # (tp, pp, M, sp) -> its points, once priced (a cut step resumes on them)
        # offload combinations (module docstring): where the techniques are priced and the machine has a host
        self.offload = bool(tech.available and self.machine.has_host)

    # the layout points --------------------------------------------------------------------------------
    def whole(self, tp: int, plain: bool = False, sp: bool = False) -> _Layout:
        """pp = 1, one micro-batch: Megatron's layout at degree tp (tp = 1: data parallelism) on the whole
        machine, mapped by the DP (``plain``: exactly the ``megatron`` baseline's PCG; ``sp``: with sequence
        parallelism)."""
        lay = self._whole(tp, plain, sp)
        lay.sp = sp
        return lay

    def _whole(self, tp: int, plain: bool, sp: bool) -> _Layout:
        from .baselines import StrategyError, build_strategy, data_parallel, megatron
        N, D = self.machine.num_devices, self.machine.devices_per_node
        try:
            if plain:
                pg = build_strategy(self.g, "megatron", N, devices_per_node=D)
            elif tp == 1:
                pg = data_parallel(self.g, N)
            else:
                pg = megatron(self.g, N, devices_per_node=tp, sequence_parallel=sp)
        except StrategyError as e:
            return _Layout(max(tp, 1), 1, N // max(tp, 1), 1, reason=str(e))
        got = int(pg.meta.get("tp", 1)) if N > 1 else 1
        if got != tp and not plain:
            return _Layout(tp, 1, N // tp, 1, reason=f"tensor degree {tp} does not split the model (got {got})")
        tp = got
        dl = self.deadline
        if plain and dl is not None and self.cheap is not None and math.isfinite(dl.at):
            # the plain point's DP solve gets at most PLAIN_SHARE of the grid's time (then the mapping without
            # the DP), so a model whose Megatron layout solves slowly (ALBERT's weights shared by every layer)
            # still leaves time for the grid's other points
            dl = Deadline(dl.clock() + PLAIN_SHARE * max(dl.left(), 0.0), dl.clock).sooner(dl)
        try:
            with within(dl):
                r = self.mapper.optimize(pg, resource=None if N > 1 else Resource(0, 1, 1), techniques=False)
        except Expired:
            if not plain or self.cheap is None:
                raise
            with within(self.deadline):     # the techniques' choice stops at the walk's deadline (then none)
                r = self.cheap(pg)
            self.stats["plain_mapping"] = "without the DP (its solve did not finish by the deadline)"
        if r is None or not r.views:
            return _Layout(tp, 1, N // tp, 1, pcg=pg, reason=(r.reason if r is not None else "") or "no mapping")
        return _Layout(tp, 1, N // tp, 1, pcg=pg, mapping=r)

    def pipeline(self, tp: int, pp: int, M: int, intra=None, sp: bool = False) -> _Layout:
        """pp stages of equal layer counts on equal device blocks, M micro-batches, Megatron inside
        (``sp``: with sequence parallelism), or the ``intra`` hook of
        :func:`search.pipeline.search_pipeline`, given."""
        lay = self._pipeline(tp, pp, M, intra, sp)
        lay.sp = sp
        return lay

    def _pipeline(self, tp: int, pp: int, M: int, intra, sp: bool) -> _Layout:
        from .pipeline import PipelineError, _evaluate, default_intra, megatron_intra, micro_graph, rebatch
        N = self.machine.num_devices
        dp = N // (tp * pp)
        L = len(self.layers)
        if pp > L:
            return _Layout(tp, pp, dp, M, reason=f"{L} layers cannot make {pp} stages")
        if M not in self.graphs:
            try:
                self.graphs[M] = rebatch(self.g, self.B, self.B // M)
                micro_graph(self.g, M)
            except PipelineError as e:
                self.graphs[M] = e
        gM = self.graphs[M]
        if isinstance(gM, Exception):
            return _Layout(tp, pp, dp, M, reason=str(gM))
        size = N // pp
        bounds = [round(k * L / pp) for k in range(pp + 1)]
        plan = tuple((bounds[k], bounds[k + 1], k * size, size) for k in range(pp))
        if intra is None:
            intra = megatron_intra(tp, sp=sp) if tp > 1 else default_intra
        with within(self.deadline):
            ev = _evaluate(gM, self.roles, self.info, self.layers, plan, M, self.reuse, intra, self.machine)
        if not all(math.isfinite(x) for x in ev["fwd"]):
            return _Layout(tp, pp, dp, M, gM=gM, plan=plan, ev=ev, reason=ev["reason"])
        if not ev["feasible"] and not ev["reason"].startswith("out of memory"):
            return _Layout(tp, pp, dp, M, gM=gM, plan=plan, ev=ev, reason=ev["reason"])
        tps = {int(p.pcg.meta.get("tp", 1)) for p in ev["priced"] if p.pcg is not None}
        if tp > 1 and tps != {tp}:
            return _Layout(tp, pp, dp, M, reason=f"tensor degree {tp} does not split every stage "
                                                 f"(got {sorted(tps)})")
        return _Layout(tp, pp, dp, M, gM=gM, plan=plan, ev=ev)

    def data_parallel_fit(self) -> int | None:
        """The largest micro-batch (per copy) at which data parallelism (tp = pp = 1) fitted without
        recomputing, else by recomputing; None where it never fitted.  (A larger micro-batch that fits only by
        recomputing pays another forward: a walk started there starts where it is least likely to win.)"""
        fits = [p for p in self.points if p.feasible and p.layout.tp == 1 and p.layout.pp == 1 and not p.layout.name]
        plain = [p.config.micro_batch for p in fits if p.config.recompute == "none"]
        return max(plain or [p.config.micro_batch for p in fits], default=None)

    # the techniques on a layout point -------------------------------------------------------------------
    def combos(self) -> list[tuple[str, int, bool]]:
        """(recompute, ZeRO stage, offload) of every technique point of a layout, in pricing order."""
        zs = {"zero3": (3,), "accumulate": (0, 1, 3)}.get(self.strategy, (0, 1))
        if not self.tech.available:      # micro-batching alone (zero3 is a technique: nothing to price)
            return [] if self.strategy == "zero3" else [("none", 0, False)]
        recs = list(self.tech.recompute)
        out = [(r, z, False) for z in zs for r in recs]
        # per-region recompute where memory binds: at every ZeRO stage of the grid that shards the states (they
        # leave more room for activations, so fewer regions recompute; ZeRO-1's one gather per iteration vs
        # ZeRO-3's per micro-batch is the techniques' trade, priced, not assumed)
        per = ([z for z in zs if z] or [max(zs)]) if self.per_region else []
        out += [(PER_REGION, z, False) for z in per]
        if self.offload:                 # the sharded states offloaded: after every point without offload
            out += [(r, z, True) for z in zs if z for r in recs] + [(PER_REGION, z, True) for z in per if z]
        return out

    def price_layout(self, lay: _Layout, mbs: int, cut: bool = False) -> list[_Point]:
        """The layout's points, one per technique combination (:meth:`combos`).  ``cut``: past the deadline
        the combinations not yet priced are left out (the first is always priced; ``stats["plain_cut"]``
        counts the rest): the plain point's pricing, which no walk resumes."""
        if lay.pp == 1 and not lay.reason and not lay.name:
            seen = self._pp1_layouts.setdefault(lay.tp, [])
            if not any(x is lay for x in seen):
                seen.append(lay)
        out = []
        fits: set = set()                 # ZeRO stages whose point without recomputation fits
        # (ZeRO stage, offload) whose point without recomputation does not fit its weights part alone (weights,
        # gradients, states on the busiest device): recomputation frees activations only, so none of that
        # stage's recomputing points fits either -- they are not priced (``stats["weights_bounded"]``)
        heavy: set = set()
        combos = self.combos()
        for k, (rec, z, off) in enumerate(combos):
            if cut and out and self.expired():
                self.stats["plain_cut"] = len(combos) - k
                break
            if off and not self._offload_may_fit(out, lay, rec, z, heavy):
                continue
            if rec != "none" and (z, off) in heavy:
                self.stats["weights_bounded"] = self.stats.get("weights_bounded", 0) + 1
                continue
            if rec == PER_REGION and (z, off) in fits:
                continue                  # it would choose no recomputation: that point is priced
            bounded = rec == PER_REGION or rec != "none" and math.isfinite(self.beat)
            if bounded and self._recompute_bounded(out, z, off):
                continue
            cfg = TunedConfig(lay.tp, lay.pp, lay.dp, mbs, lay.M, rec, z == 1, lay.sp, z, lay.name, off)
            if lay.reason:
                pt = _Point(cfg, INF, False, lay.reason, 0, {}, lay)
            elif lay.mapping is not None:
                pt = self._price_whole(lay, cfg)
            else:
                pt = self._price_stages(lay, cfg)
            if rec == "none" and pt.feasible:
                fits.add((z, off))
            elif rec == "none" and pt.split[0] and pt.split[0] >= self.machine.device.usable_bytes:
                heavy.add((z, off))
            out.append(pt)
            self.points.append(pt)
            self.priced.append({"config": cfg.to_json(), "cost": pt.cost if math.isfinite(pt.cost) else None,
                                "max_bytes": pt.max_bytes, "reason": pt.reason})
            self.stats["technique_points"] += 1
        return out

    def _offload_may_fit(self, out: list, lay: "_Layout", rec: str, z: int, heavy=()) -> bool:
        """Whether the layout's point (``rec``, ``z``) with offload is priced: on one stage (the executor
        offloads no pipeline) and only where the same point without offload was priced and does not fit --
        offload adds the host transfers and runs the same update at the host's bandwidth, so where that
        point fits (or was not priced: bounded, or per-region with a plain fit) offload cannot be faster --
        or was not priced because its weights part alone does not fit (``heavy``, :meth:`price_layout`)."""
        if lay.pp != 1:
            return False
        if rec != "none" and (z, False) in heavy:
            return True
        twin = [p for p in out if p.config.recompute == rec and p.config.zero == z and not p.config.offload]
        return bool(twin) and not twin[-1].feasible and twin[-1].reason.startswith("out of memory")

    def _recompute_bounded(self, out: list, z: int, off: bool = False) -> bool:
        """Whether the layout's point recomputing at ZeRO stage ``z`` (offload ``off``) cannot beat the best
        point that fits (or ``beat``, a plan the caller has): recomputing only adds time, so its time is at
        least that of the same layout, ZeRO stage and offload recomputing nothing (priced first, fitting or
        not; with offload where none is priced, the point without offload).  ``stats["recompute_bounded"]``
        counts them."""
        same = [p.time_s for p in out if p.config.recompute == "none" and p.config.zero == z
                and p.config.offload == off]
        if not same and off:
            same = [p.time_s for p in out if p.config.recompute == "none" and p.config.zero == z]
        lower = min(same, default=-INF)
        best = min(min((p.cost for p in self.points if p.feasible), default=INF), self.beat)
        if lower < best:
            return False
        self.stats["recompute_bounded"] = self.stats.get("recompute_bounded", 0) + 1
        return True

    def _price_whole(self, lay: _Layout, cfg: TunedConfig) -> _Point:
        r = lay.mapping
        if not self.tech.available:
            mem = dict(r.memory.per_device) if r.memory else {}
            return _Point(cfg, r.cost if r.feasible else INF, bool(r.feasible), r.reason,
                          max(mem.values(), default=0), mem, lay, _split(r.memory))
        from .cost import GraphCost
        base = r if getattr(r, "techniques", None) is None else None     # its cost without techniques
        if lay.gc is None:
            lay.gc = GraphCost(lay.pcg, self.mapper.model)
        q = self.tech.price(lay.gc, r.views, cfg.recompute, cfg.zero, base,
                            report=r.memory if base is not None else None, offload=cfg.offload)
        mem = dict(q.per_device)
        return _Point(cfg, q.iteration_s if q.feasible else INF, bool(q.feasible), q.reason, int(q.max_bytes), mem,
                      lay, _split(q.report), q.iteration_s)

    def _stage_numbers(self, p, cfg: TunedConfig, cache: dict):
        """(per-micro-batch compute, per-micro-batch extra, once, weights part, activations part) of one stage."""
        from .cost import GraphCost
        if not self.tech.available:
            return p.t, 0.0, p.once, dict(p.w), dict(p.a), dict(p.w)
        key = id(p)
        if key not in cache:
            cache[key] = GraphCost(p.pcg, self.mapper.model)
        gc = cache[key]

        def q(rec, z, off=False):
            k = (key, rec, z, off)
            if k not in cache:
                plain = p.memory_plan is None and not p.rec and self.tech.available
                report = self.tech.m.plain_report(p.w, p.a, self.machine.device.usable_bytes) if plain else None
                cache[k] = self.tech.price(gc, p.views, rec, z, p.t + p.once, report=report, offload=off)
            return cache[k]

        full = q(cfg.recompute, cfg.zero, cfg.offload)
        base0 = q("none", 0)
        rec0 = q(cfg.recompute, 0)
        devs = set(p.w) | set(p.a) | set(full.per_device)
        # activations with the recomputation, weights with ZeRO: memtech's totals split by differences
        a = {d: max(p.a.get(d, 0) + rec0.per_device.get(d, 0) - base0.per_device.get(d, 0), 0) for d in devs}
        w = {d: max(full.per_device.get(d, 0) - a[d], 0) for d in devs}
        t = p.t + full.recompute_s
        pure = dict(full.report.weights)          # what does not scale with the micro-batch
        if cfg.zero == 3:      # parameters gathered and gradients reduce-scattered every micro-batch
            once = full.update_s + full.offload_s       # (offload: the host transfers and update, once)
            extra = max(full.iteration_s - t - once, 0.0)
            return t, extra, once, w, a, pure
        return t, 0.0, max(full.iteration_s - t, 0.0), w, a, pure

    def _price_stages(self, lay: _Layout, cfg: TunedConfig) -> _Point:
        from .pipeline import in_flight, simulate_1f1b
        ev, M = lay.ev, lay.M
        S = len(lay.plan)
        bf = self.mapper.model.backward_factor
        cap = self.machine.device.usable_bytes
        fwd, bwd, once, mems, ws = [], [], [], [], []
        cache = lay.ev.setdefault("_tech_cache", {})
        for idx, p in enumerate(ev["priced"]):
            t, extra, o, w, a, pure = self._stage_numbers(p, cfg, cache)
            base_t = p.t
            fwd.append(base_t / (1 + bf) + extra / 2)
            bwd.append(base_t * bf / (1 + bf) + (t - base_t) + extra / 2)
            once.append(o)
            infl = in_flight(S, idx, M)
            mems.append({d: w.get(d, 0) + infl * a.get(d, 0) for d in set(w) | set(a)})
            ws.append(pure)
        if S == 1:
            makespan = M * (fwd[0] + bwd[0]) + once[0]
        else:
            makespan = simulate_1f1b(fwd, bwd, M, ev["send"], ev["send"], once).makespan
        memory = {d: v for m in mems for d, v in m.items()}
        mx = max(memory.values(), default=0)
        k = max(range(S), key=lambda i: max(mems[i].values(), default=0))
        dev = max(mems[k], key=mems[k].get) if mems[k] else None
        split = (int(ws[k].get(dev, 0)), max(int(mems[k][dev] - ws[k].get(dev, 0)), 0)) if dev is not None else (0, 0)
        for idx, m in enumerate(mems):
            if m and max(m.values()) > cap:
                dev = max(m, key=m.get)
                why = (f"out of memory: stage {idx} device {dev} needs {m[dev] / 2**30:.2f} GiB with "
                       f"{in_flight(S, idx, M)} micro-batches in flight but has {cap / 2**30:.2f} GiB")
                return _Point(cfg, INF, False, why, int(mx), memory, lay, split, makespan)
        lay.ev.setdefault("_adjusted", {})[cfg] = {"fwd": fwd, "bwd": bwd, "once": once, "mem": mems,
                                                    "memory": memory, "makespan": makespan}
        return _Point(cfg, makespan, True, "", int(mx), memory, lay, split, makespan)

    # the walk ---------------------------------------------------------------------------------------------
    def finished(self) -> bool:
        """Whether the grid walk has ended (every walk done; not started: False)."""
        return self.walks is not None and all(w["done"] for w in self.walks)

    def expired(self) -> bool:
        return self.deadline is not None and self.deadline.passed()

    def run(self) -> None:
        self.resume(self.deadline)

    def resume(self, deadline: Deadline | None, grid: bool | None = None) -> None:
        """Walk the grid until ``deadline`` (again: a walk cut by one deadline goes on from where it stopped;
        ``grid``: see :func:`tune`); ``stats["cut"]`` says whether this deadline cut it."""
        self.deadline = deadline
        if grid is not None:
            self.grid = grid
        self.stats.pop("cut", None)
        try:
            if self.walks is None:
                self._start()
            if not self.grid:                 # the first point only: the plain one, else one step
                if self.plain is None and self.walks and self.walks[0]["n"] == 0:
                    self._step(self.walks[0], None)
                return
            self._walk()
        except Expired:
            self.stats["cut"] = True

    def _start(self) -> None:
        """The (tp, pp) walks, and the plain baseline priced first (megatron)."""
        N, B = self.machine.num_devices, self.B
        walks = []
        for tp, pp in pairs(self.machine, self.strategy, len(self.layers)):
            dp = N // (tp * pp)
            if B % dp:
                continue
            ms = micro_batch_sizes(B, dp, pp)
            if ms:
                walks.append({"tp": tp, "pp": pp, "dp": dp, "ms": ms, "i": 0, "n": 0, "best": INF, "done": False})
        self.stats["pairs"] = [[w["tp"], w["pp"]] for w in walks]
        self.stats["grid_layout_points"] = sum(len(w["ms"]) for w in walks)
        if self.strategy == "zero3":
            if not walks:
                raise TunedError(f"strategy 'zero3': the batch {B} does not divide by the {N} devices of "
                                 f"{self.machine.name}")
            if not self.tech.available:
                raise TunedError("strategy 'zero3' needs the memory techniques (search.memtech), off or absent here")
        plain = None
        if self.strategy == "megatron":            # the plain baseline: priced first
            plain = self.whole(0, plain=True)
            self.stats["layout_points"] += 1
            if plain.pcg is None and "applies to Transformers" in plain.reason:
                raise TunedError(plain.reason)
            if plain.pcg is None:             # e.g. heads no degree of a node splits: tp = 1 points remain
                self.stats["plain"] = plain.reason
                plain = None
            else:
                self.price_layout(plain, B // plain.dp, cut=True)
        if plain is not None:
            self._skip_from(plain, walks)
            walks.sort(key=lambda w: _closeness(w, plain))
        self.plain, self.walks = plain, walks

    def _walk(self) -> None:
        """Best-first over the walks: every pp = 1 pair once (nearest the plain point first), then, once a
        point fits, the walks whose next point is predicted to fit (:meth:`_memory_estimate`; an estimate, so
        the others are walked later, never skipped) by the lowest bound (:meth:`_bound`; none yet: first),
        fewest stages, then fewest steps; then the others, the nearest to fitting first (while nothing fits:
        :meth:`_feasible_first`).  A walk not priced yet is estimated from other layouts: that estimate is
        scaled by the least ratio of actual to estimated bytes seen on this grid (``_est_ratio``: where it
        has overstated, a walk it puts a little over may fit).  Pruning is by the bound, per point: a walk's
        next sizes whose bound is over the best time of the grid cannot win and are skipped
        (``stats["sizes_bounded"]``), and the walk is done when every size left is (``stats["pairs_bounded"]``)
        -- a pipeline walks its sizes rising, so its next point's bound is the highest of its points left,
        never a bound on the whole walk."""
        walks, plain = self.walks, self.plain
        for w in walks:
            if w["pp"] == 1 and w["n"] == 0 and not w["done"]:
                self._step(w, plain)
        order = {id(w): k for k, w in enumerate(walks)}
        while True:
            live = [w for w in walks if not w["done"]]
            if not live:
                return
            glob = min((p.cost for p in self.points if p.feasible), default=INF)
            est = {}
            for w in live:
                if math.isfinite(glob):
                    skip = w["i"]
                    while skip < len(w["ms"]) and self._bound_at(w, w["ms"][skip]) > glob:
                        skip += 1
                    if skip >= len(w["ms"]):
                        w["done"] = True
                        self.stats["pairs_bounded"] = self.stats.get("pairs_bounded", 0) + 1
                        continue
                    if skip > w["i"]:
                        self.stats["sizes_bounded"] = self.stats.get("sizes_bounded", 0) + skip - w["i"]
                        w["i"] = skip
                est[id(w)] = self._bound(w)
            live = [w for w in live if not w["done"]]
            if not live:
                return
            kind = ""
            if math.isfinite(glob):           # the walks predicted to fit first, then the nearest to fitting
                cap = self.machine.device.usable_bytes
                over = {id(w): max(self._memory_estimate(w) * (1.0 if self._own_points(w) else self._est_ratio)
                                   / cap, 1.0) for w in live}
                w = min(live, key=lambda w: (over[id(w)], est[id(w)], w["pp"], w["n"], order[id(w)]))
            else:
                w, kind = self._feasible_first(live, est, order)
            self._step(w, plain)
            self._ff_last = kind              # (a pick a deadline cut is picked again: not a miss)

    def _feasible_first(self, live: list, est: dict, order: dict) -> tuple:
        """The next walk while no point of the grid fits (on a large model the fastest points are often the
        ones that do not fit, and each costs a mapping): first the leanest walk (:meth:`_memory_estimate`),
        then, alternating, the time-best walk (:meth:`_bound` order) among those predicted to fit and the
        leanest, so a feasible point is priced early; once one is, :meth:`_walk` goes best-first by time
        again.  Only the order changes: nothing is skipped, so an uncut walk prices what it priced before."""
        cap = self.machine.device.usable_bytes
        mem = {id(w): self._memory_estimate(w) for w in live}
        fit = [w for w in live if mem[id(w)] <= cap]
        self.stats["feasible_first_steps"] = self.stats.get("feasible_first_steps", 0) + 1
        if fit and self._ff_last == "lean":
            return min(fit, key=lambda w: (est[id(w)], w["pp"], w["n"], order[id(w)])), "time"
        return min(live, key=lambda w: (mem[id(w)], est[id(w)], w["pp"], w["n"], order[id(w)])), "lean"

    def _memory_estimate(self, w: dict) -> float:
        """An estimate (not a bound) of the busiest device's bytes at a walk's next point with its leanest
        technique: from the walk's own leanest point where it priced one (what its memory skips predict:
        the weights part plus the activations part scaled to the micro-batch size), else the largest of the
        estimates from every layout priced so far (each layout's leanest point, its weights part scaled by
        the devices the weights are split over, tp x pp, its activations part by the samples per device
        and the share of the model's micro-batches the busiest stage holds, min(pp, M) / pp); 0 where
        nothing was priced yet."""
        if w["i"] >= len(w["ms"]):
            return INF
        nxt = w["ms"][w["i"]]
        M = max(self.B // (w["dp"] * nxt), 1)
        own = self._own_points(w)
        if own:
            lean = min(own, key=lambda p: p.max_bytes)
            return lean.split[0] + lean.split[1] * nxt / max(lean.config.micro_batch, 1)
        leanest: dict = {}
        for p in self.points:
            if p.max_bytes and not p.layout.name:
                k = id(p.layout)
                if k not in leanest or p.max_bytes < leanest[k].max_bytes:
                    leanest[k] = p
        out = 0.0
        for p in leanest.values():
            c = p.config
            fixed, scaled = p.split
            share = min(w["pp"], M) / w["pp"]
            share0 = min(c.pp, c.micro_batches) / c.pp
            out = max(out, fixed * (c.tp * c.pp) / (w["tp"] * w["pp"])
                      + scaled * (nxt / max(c.micro_batch, 1)) * (c.tp / w["tp"]) * (share / share0))
        return out

    def _bound(self, w: dict) -> float:
        """A lower bound on the time of a walk's next point (-inf: none yet, or no size left):
        :meth:`_bound_at` its next micro-batch size."""
        if w["i"] >= len(w["ms"]):
            return -INF
        return self._bound_at(w, w["ms"][w["i"]])

    def _bound_at(self, w: dict, nxt: int) -> float:
        """A lower bound on the time of the walk's point at micro-batch size ``nxt`` (-inf: none yet).  Per
        device, a point runs the work of a pp = 1 point of the same tensor degree and micro-batch size
        (:meth:`_Layout.work`: forward, backward, tensor-parallel transfers; a pipeline's stages split it,
        and the 1F1B makespan is at least the busiest stage's share), plus recomputation, sync and update; a
        smaller micro-batch does not run a sample faster, so every pp = 1 point priced at a size >= ``nxt``
        bounds it (the largest counts; of the sequence-parallel variants of a size, the smaller).  It bounds
        that one point only: a larger size's bound may be lower."""
        at: dict = {}
        for lay in self._pp1_layouts.get(w["tp"], ()):
            mbs = self.B // (lay.dp * lay.M)
            if mbs >= nxt:
                at[mbs] = min(at.get(mbs, INF), lay.work())
        got = [v for v in at.values() if math.isfinite(v)]
        return max(got) if got else -INF

    def _skip_from(self, plain: "_Layout", walks: list) -> None:
        """Before the pp = 1 walks start: skip the micro-batch sizes whose activations alone the plain point
        predicts not to fit.  Per device, its leanest technique's activations part for mbs0 samples per copy
        at degree tp0 is mbs0 (n + s / tp0) (n: bytes per sample of the operators on the tp copies, s: of the
        split ones); at (tp, mbs) it is mbs (n + s / tp) >= part x (mbs / mbs0) x min(1, tp0 / tp): a lower
        bound, so no size that may fit is skipped (the smallest is always kept).

        Whole pairs too, by the weights part (weights, gradients, optimizer states: no micro-batch changes it):
        at degree tp0 it is r + s / tp0 on the busiest device (r: held whole by every tensor-parallel copy, s:
        split; the states sharded over the tp x dp = N / pp copies), so at (tp, pp) it is at least the plain
        point's leanest weights part x min(1, tp0 / tp) / pp (pp stages share the layers: the busiest holds at
        least the mean); a pair at which that alone does not fit is done before a point of it is mapped (on a
        model of many layers each mapping costs seconds)."""
        pts = [p for p in self.points if p.layout is plain and p.max_bytes]
        if not pts:
            return
        cap = self.machine.device.usable_bytes
        fixed0 = min(p.split[0] for p in pts)
        tp0 = min(p.config.tp for p in pts)
        for w in walks:
            if not w["done"] and fixed0 * min(1.0, tp0 / w["tp"]) / w["pp"] >= cap:
                w["i"], w["done"] = len(w["ms"]), True
                self.stats["pairs_skipped_by_weights"] = self.stats.get("pairs_skipped_by_weights", 0) + 1
        lean = min(pts, key=lambda p: p.max_bytes)
        scaled = lean.split[1]
        cap = self.machine.device.usable_bytes
        mbs0, tp0 = lean.config.micro_batch, lean.config.tp
        for w in walks:
            if w["pp"] != 1:
                continue
            while w["i"] < len(w["ms"]) - 1 and \
                    scaled * w["ms"][w["i"]] / mbs0 * min(1.0, tp0 / w["tp"]) > cap:
                w["i"] += 1
                self.stats["skipped_by_memory"] = self.stats.get("skipped_by_memory", 0) + 1

    def _step(self, w: dict, plain: "_Layout | None") -> None:
        """:meth:`_price_next`; a point the deadline cuts is priced again when the walk resumes."""
        i, n = w["i"], w["n"]
        fresh = not self._own_points(w) and any(p.max_bytes for p in self.points)
        guess = self._memory_estimate(w) if fresh else 0.0
        k = len(self.points)
        try:
            self._price_next(w, plain)
        except Expired:
            w["i"], w["n"] = i, n
            raise
        got = [p.max_bytes for p in self.points[k:] if p.max_bytes]
        if guess > 0 and got:
            self._est_ratio = min(self._est_ratio, min(got) / guess)

    def _own_points(self, w: dict) -> list:
        """The points of the walk's (tp, pp) priced so far (the grid's layouts, not accumulate()'s)."""
        return [p for p in self.points if p.max_bytes and p.layout.tp == w["tp"] and p.layout.pp == w["pp"]
                and not p.layout.name]

    def _price_next(self, w: dict, plain: "_Layout | None") -> None:
        """Price the next micro-batch size of one (tp, pp) walk, then decide where it goes on.  A point's
        bytes on the busiest device split into a part that does not scale with the micro-batch (weights,
        gradients, states) and one that does (activations), which predict every other size's:

        * nothing fits: skip to the next size its leanest technique is predicted to fit (none: done; pp = 1,
          where the weights part fits: its smallest size, the prediction being an estimate);
        * the time improved: the next size;
        * it did not: done, unless (pp = 1, sizes falling) the best point here recomputes: then skip to the
          largest size at which no recomputation is predicted to fit (a smaller micro-batch may drop it);
          the walk's first point skips so too when its best recomputes (the sizes between would recompute
          as well: under a deadline the size that drops it is priced next);
        * a pp = 1 pair whose best, after two sizes, is over :data:`DROP` x the best of every pair is dropped
          (a pipeline's sizes rise, its later points may be the fastest: :meth:`_walk` prunes them by bound);
        * a tensor degree that does not split the model ends the pair."""
        if self.expired():
            raise Expired()
        B = self.B
        mbs = w["ms"][w["i"]]
        w["i"] += 1
        w["n"] += 1
        M = B // (w["dp"] * mbs)
        if plain is not None and (w["tp"], w["pp"], M) == (plain.tp, 1, 1):
            pts = [p for p in self.points if p.layout is plain]
        elif w.get("intra") is not None:         # accumulate(): one stage, M micro-batches, the walk's layout
            lay = self.pipeline(w["tp"], 1, M, intra=w["intra"])
            lay.name = w["name"]
            self.stats["layout_points"] += 1
            pts = self.price_layout(lay, mbs)
        else:
            # sequence parallelism (tp > 1): the same point as a layout of its own, priced first (it keeps
            # less and moves what the all-reduce did: where a deadline cuts the step, the likelier winner)
            pts = []
            for sp in ((True, False) if self.sp and self.strategy == "megatron" and w["tp"] > 1 else (False,)):
                key = (w["tp"], w["pp"], M, sp)
                got = self._layout_points.get(key)
                if got is None:               # else priced by a step a deadline cut: not mapped or priced again
                    lay = self.whole(w["tp"], sp=sp) if (w["pp"] == 1 and M == 1) else \
                        self.pipeline(w["tp"], w["pp"], M, sp=sp)
                    self.stats["layout_points"] += 1
                    got = self._layout_points[key] = self.price_layout(lay, mbs)
                pts = pts + got
                if any(p.layout.reason.startswith("tensor degree") for p in got):
                    w["i"] = len(w["ms"])
                    break
        if plain is not None and (w["tp"], w["pp"], M) == (plain.tp, 1, 1) and self.sp and \
                self.strategy == "megatron" and w["tp"] > 1:
            lay = self.whole(w["tp"], sp=True)
            self.stats["layout_points"] += 1
            pts = pts + self.price_layout(lay, mbs)
        best = min((p.cost for p in pts), default=INF)
        top = min(pts, key=lambda p: p.cost) if pts else None
        cap = self.machine.device.usable_bytes

        def skip_while(split) -> None:
            fixed, scaled = split
            if fixed >= cap:
                w["i"] = len(w["ms"])             # the weights alone do not fit: no micro-batch will
            # the prediction is an estimate (the activations part is not linear in the micro-batch: the
            # backward's peak, what the update frees): a falling walk keeps its smallest size
            end = len(w["ms"]) - (1 if w["pp"] == 1 and not w.get("rising") else 0)
            while w["i"] < end and fixed + scaled * w["ms"][w["i"]] / mbs > cap:
                w["i"] += 1
                self.stats["skipped_by_memory"] = self.stats.get("skipped_by_memory", 0) + 1

        if not math.isfinite(best):
            lean = min((p for p in pts if p.max_bytes), key=lambda p: p.max_bytes, default=None)
            if lean is not None:
                skip_while(lean.split)
        elif best >= w["best"] or w["n"] == 1:
            plain_pts = [p for p in pts if p.config.recompute == "none" and p.max_bytes]
            if w["pp"] == 1 and top.config.recompute != "none" and plain_pts:
                skip_while(min(plain_pts, key=lambda p: p.max_bytes).split)
            elif best >= w["best"]:
                w["i"] = len(w["ms"])             # the time stopped improving
        w["best"] = min(w["best"], best)
        glob = min((p.cost for p in self.points), default=INF)
        if w["pp"] == 1 and w["n"] >= 2 and math.isfinite(glob) and w["best"] > DROP * glob:
            w["i"] = len(w["ms"])
            self.stats["pairs_dropped"] = self.stats.get("pairs_dropped", 0) + 1
        w["done"] = w["i"] >= len(w["ms"])

    def result(self) -> TunedResult:
        feas = [p for p in self.points if p.feasible and math.isfinite(p.cost)]
        if feas:
            best = min(feas, key=lambda p: (p.cost, p.config.pp, p.config.tp, p.config.micro_batches))
        elif self.points:     # nothing fits: the point closest to fitting
            best = min(self.points, key=lambda p: p.max_bytes if p.max_bytes else INF)
        else:
            return TunedResult(self.strategy, None, INF, False, "no configuration was priced before the deadline",
                               None, {}, None, None, None, priced=self.priced, stats=dict(self.stats))
        lay = best.layout
        stats = dict(self.stats, chosen=best.config.label())
        if not feas:
            reasons = sorted({p.reason for p in self.points if p.reason})
            why = best.reason or (reasons[0] if reasons else "infeasible")
            stats["reasons"] = reasons[:8]
        else:
            why = ""
        mem_plan = None
        if lay.mapping is not None:
            if self.tech.available:
                mem_plan = self.tech.plan(lay.pcg, best.config.recompute, best.config.zero,
                                          offload=best.config.offload)
            return TunedResult(self.strategy, best.config, best.cost, bool(feas), why, lay.pcg, dict(lay.mapping.views),
                               lay.mapping, None, mem_plan, best.max_bytes, best.memory, self.priced, stats)
        if lay.ev is None:
            return TunedResult(self.strategy, best.config, INF, False, why, None, {}, None, None, None,
                               best.max_bytes, best.memory, self.priced, stats)
        from .pipeline import assemble
        adj = lay.ev.get("_adjusted", {}).get(best.config)
        ev = dict(lay.ev)
        if best.config.recompute == PER_REGION and self.tech.available:
            # each stage's own choice, on the stitched PCG's node ids (assemble maps them)
            ev["tech"] = (best.config.zero, (PER_REGION,))
            ev["priced"] = [dataclasses.replace(p, memory_plan=self.tech.plan(p.pcg, PER_REGION, best.config.zero,
                                                                              offload=best.config.offload))
                            for p in ev["priced"]]
        if adj is not None:
            ev.update(fwd=adj["fwd"], bwd=adj["bwd"], once=adj["once"], mem=adj["mem"], memory=adj["memory"],
                      cost=adj["makespan"], makespan=adj["makespan"], feasible=True, reason="")
        res = assemble(self.g, lay.gM, lay.plan, lay.M, ev, self.machine)
        if res.pcg is not None and self.tech.available and best.config.recompute == PER_REGION:
            mem_plan = res.memory_plan
            if mem_plan is None and (best.config.zero or best.config.offload):
                from unity_pcg.plan import MemoryPlan
                mem_plan = MemoryPlan(zero=best.config.zero, offload=best.config.offload)
        elif res.pcg is not None and self.tech.available and (best.config.recompute != "none" or best.config.zero
                                                              or best.config.offload):
            mem_plan = self._stage_memory_plan(res, best.config)
        feasible = bool(feas) and res.feasible
        return TunedResult(self.strategy, best.config, res.cost if feasible else INF, feasible, why or res.reason,
                           res.pcg, dict(res.views), None, res, mem_plan, best.max_bytes, best.memory, self.priced,
                           stats)

    def _stage_memory_plan(self, res, cfg: TunedConfig):
        """The MemoryPlan on the stitched PCG: the technique's regions cut at the stage boundaries."""
        from unity_pcg.plan import MemoryPlan, RecomputeRegion
        whole = self.tech.plan(res.pcg, cfg.recompute, cfg.zero, offload=cfg.offload)
        stage_of = {n: k for k, s in enumerate(res.stages) for n in s.nodes}
        regs = []
        for r in whole.recompute:
            by: dict = {}
            for n in r.nodes:
                by.setdefault(stage_of.get(n), []).append(n)
            regs.extend(RecomputeRegion(tuple(ns), r.mode) for k, ns in sorted(by.items(), key=lambda x: str(x[0]))
                        if k is not None)
        return MemoryPlan(zero=whole.zero, offload=whole.offload, recompute=tuple(regs))


def tune(g: PCG, mapper, strategy: str = "megatron", deadline: Deadline | None = None, *, cheap=None,
         tech=None, max_layers: int = MAX_LAYERS, sequence_parallel: bool = True, grid: bool = True) -> TunedResult:
    """The tuned baseline ``strategy`` (``megatron`` or ``zero3``) of the logical PCG ``g`` on
    ``mapper.machine`` (see the module docstring).  ``deadline`` bounds the grid (the plain Megatron point
    is always priced; ``cheap(pcg)``, a mapping without the DP, prices it when even its solve is cut).
    ``tech``: the technique pricer (default :func:`techniques`); ``sequence_parallel=False`` leaves the sp
    axis out (every point sp = false); ``grid=False`` prices only the first point (megatron: the plain
    baseline; zero3: the first micro-batch size), the cheapest to price.  Raises :class:`TunedError` (one
    line) when the strategy does not apply."""
    if strategy not in STRATEGIES:
        raise TunedError(f"unknown tuned strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    if any(n.kind == "parallel" for n in g.nodes()):
        raise TunedError(f"strategy {strategy!r} needs a logical PCG")
    t = _Tuner(g, mapper, strategy, deadline, tech or techniques(), cheap=cheap, max_layers=max_layers,
               sp=sequence_parallel, grid=grid)
    t.run()
    out = t.result()
    out.stats["sp"] = SP_NOTE if sequence_parallel else "sequence parallelism left out (sequence_parallel=False)"
    return out


def accumulate(g: PCG, mapper, layouts, deadline: Deadline | None = None, *, tech=None,
               max_layers: int = MAX_LAYERS, fitted: int | None = None, beat: float = INF) -> TunedResult:
    """Gradient accumulation in the joint search (DESIGN "optimize() policy"): the fastest feasible plan of
    one stage that runs the global batch as M micro-batches (:func:`search.pipeline.micro_graph`, the one
    test of micro-batching), each micro-batch parallelized by one of ``layouts`` -- ``[(name, intra)]``,
    ``intra`` a :func:`search.pipeline.search_pipeline` hook (data parallelism, the layout ILP of a mesh; an
    entry ``(name, intra, "rising")`` is walked from the most micro-batches to fewer: a layout that trades time
    for memory pays where the weights, not the activations, fill the device, at the smallest sizes) --
    jointly with the memory techniques (recomputation none / selective / full on every region, and
    :data:`PER_REGION` -- memtech's choice per region of what must go -- x ZeRO 0 / 1 / 3, priced by
    :mod:`search.memtech`; ZeRO-3 gathers every micro-batch).  The micro-batch count is walked per layout as
    the tuned grid walks it: fewest micro-batches first, skipping those a priced point predicts not to fit;
    the first layout's walk runs first (after each rising walk's first step) and the others start where it first
    fitted.  The full batch (M = 1) is not priced here (the caller has it).  ``fitted``: the largest micro-batch (per data-parallel copy) at which
    the caller already found data parallelism to fit without recomputing (a tuned floor's walk): every walk
    starts there (a larger one fits only on a layout that splits the activations finer than the batch: under a
    deadline the likelier sizes first), and each takes its first step before any takes a second (the layouts
    breadth-first).  ``beat``: the time of a plan the caller has: a point that recomputes and whose layout, at its ZeRO stage
    without recomputing, is no faster, is not priced (it could not win).  ``deadline`` bounds everything;
    what was priced by then counts."""
    if any(n.kind == "parallel" for n in g.nodes()):
        raise TunedError("accumulate needs a logical PCG")
    t = _Tuner(g, mapper, "accumulate", deadline, tech or techniques(), max_layers=max_layers, per_region=True)
    t.beat = beat
    N, B = t.machine.num_devices, t.B
    dp = N if B % N == 0 else 1
    ms = [m for m in micro_batch_sizes(B, dp, 1) if m < B // dp]
    walks = [{"tp": 1, "pp": 1, "dp": dp, "ms": ms[::-1] if rising else ms, "i": 0, "n": 0, "best": INF,
              "done": not ms, "intra": intra, "name": name, "rising": rising}
             for name, intra, *more in layouts for rising in [bool(more and more[0] == "rising")]]
    t.stats["layouts"] = [w["name"] for w in walks]
    for w in walks if fitted else ():
        if w["rising"]:
            continue
        while w["i"] < len(w["ms"]) - 1 and w["ms"][w["i"]] > fitted:
            w["i"] += 1
    try:
        rest = walks
        first = next((w for w in walks if not w["rising"]), None)
        if first is not None and not fitted:
            # data parallelism fits at no size without recomputing: the weights bind, so each leaner layout
            # (a rising walk) takes its first step before the first layout's walk runs to its end
            for w in walks:
                if w["rising"] and not w["done"]:
                    t._step(w, None)
            while not first["done"]:
                t._step(first, None)
            fits = [p.config.micro_batch for p in t.points if p.feasible and p.layout.name == first["name"]]
            start = max(fits) if fits else None
            for w in walks:                 # the others from the fewest micro-batches the first fitted at
                while w is not first and start is not None and not w["rising"] and w["i"] < len(w["ms"]) - 1 \
                        and w["ms"][w["i"]] > start:
                    w["i"] += 1
            rest = [w for w in walks if w is not first]
        for w in rest:
            if not w["done"]:
                t._step(w, None)
        while any(not w["done"] for w in rest):
            w = min((w for w in rest if not w["done"]),
                    key=lambda w: (math.isfinite(w["best"]), w["best"], w["n"]))
            t._step(w, None)
    except Expired:
        t.stats["cut"] = True
    out = t.result()
    return out


# --- what optimize and simulate take from a result -------------------------------------------------------

class TunedMapping:
    """A tuned result seen through the MappingResult fields optimize and simulate report (cost, views,
    memory, breakdown, ``memory_plan`` for the plan file)."""

    def __init__(self, r: TunedResult, devices: int, capacity: int):
        from .cost import LeafCost
        from .memory import MemoryReport
        base = r.mapping if r.mapping is not None else None
        self.cost, self.feasible, self.reason, self.views = r.cost, r.feasible, r.reason, dict(r.views)
        comm = r.pipeline.comm_elements if r.pipeline is not None else (base.breakdown.comm_elements if base else 0)
        self.breakdown = base.breakdown if base is not None else LeafCost(r.cost, comm_elements=comm)
        self.memory = MemoryReport(dict(r.memory), {}, {}, capacity)
        self.devices = devices
        self.memory_plan = r.memory_plan if r.memory_plan is not None and not r.memory_plan.empty else None
        self.techniques = None
        self.solve_s = r.stats.get("seconds", 0.0)
        self.stats = {"devices_used": devices, "tuned": r.summary()}
        if r.pipeline is not None:
            self.stats["pipeline"] = r.pipeline.to_json()

    def to_json(self) -> dict:
        b = self.breakdown
        return {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.reason, "devices": self.devices,
                "comm_elements": b.comm_elements, "max_memory_bytes": self.memory.max_bytes,
                "memory_per_device": {str(d): v for d, v in sorted(self.memory.per_device.items())},
                "solve_s": self.solve_s, "stats": dict(self.stats),
                **({"pipeline": self.stats["pipeline"]} if "pipeline" in self.stats else {})}   # explain's stages


def _tuned(run, strategy: str, deadline: Deadline, grid: bool = True, cheap: bool = True,
           per_region: bool = False) -> TunedResult:
    """The tuned baseline ``strategy`` of ``run``'s model under ``deadline`` (optimize(memory_techniques=False):
    the grid without techniques, as the mapper prices; ``grid``, ``cheap``: see :func:`floor`).  Where ``run``
    keeps tuners (``run.tuners``, a dict), the grid walked by an earlier call for ``strategy`` goes on from where
    that call's deadline cut it (:meth:`_Tuner.resume`; one whose plain point was priced without the DP and fits
    starts again, so the DP's solve of it continues from the mapper's memo)."""
    import time as _time
    tech = techniques() if getattr(run.ev.mapper, "default_techniques", True) else _NoTechniques()
    kept = getattr(run, "tuners", None)
    t = kept.get(strategy) if isinstance(kept, dict) else None
    if t is not None and t.stats.get("plain_mapping") and \
            any(p.feasible for p in t.points if t.plain is not None and p.layout is t.plain):
        t = None            # (a plain point that does not fit is not solved again: the walk goes on)
    t0 = _time.perf_counter()
    if t is None:
        if any(n.kind == "parallel" for n in run.g.nodes()):
            raise TunedError(f"strategy {strategy!r} needs a logical PCG")
        t = _Tuner(run.g, run.ev.mapper, strategy, deadline, tech, cheap=None, grid=grid, per_region=per_region)
        if isinstance(kept, dict):
            kept[strategy] = t
    t.cheap = run.ev.cheap if cheap else None
    t.resume(deadline, grid)
    t.stats["seconds"] = t.stats.get("seconds", 0.0) + (_time.perf_counter() - t0)
    r = t.result()
    r.stats["sp"] = SP_NOTE
    return r


def floor(run, strategy: str, deadline: Deadline, grid: bool = True, cheap: bool = True) -> tuple:
    """The tuned baseline ``strategy`` as a floor of the joint search (priced in its floors phase under
    ``deadline``): ``(pcg, cost or inf, note, TunedMapping or None, PipelineResult or None)``; ``pcg`` None
    where the strategy does not apply to the model (or nothing was priced by ``deadline``).  ``grid=False``:
    only the grid's first point (the plain one); ``cheap=False``: a plain point whose solve the deadline cuts
    is not priced without the DP (the caller has that price already)."""
    try:
        r = _tuned(run, strategy, deadline, grid=grid, cheap=cheap, per_region=True)
    except TunedError as e:
        return (None, INF, str(e), None, None)
    except Expired:
        return (None, INF, "not priced within the budget", None, None)
    if r.pcg is None:
        return (None, INF, r.reason or "no plan", None, None)
    mapping = TunedMapping(r, run.n_dev, run.m.device.usable_bytes)
    note = r.config.label() if r.feasible and r.config is not None else (r.reason or "infeasible")
    return (r.pcg, r.cost if r.feasible else INF, note, mapping, r.pipeline)


def plan_candidate(run):
    """``optimize(strategy="megatron" | "zero3")``: the tuned baseline under the call's budget (the grid
    stops at 90% of the time left), as the PlanCandidate the optimizer writes; ``info.search`` records
    the configuration (``megatron_config`` / ``zero3_config``) and the grid's statistics."""
    from .optimize import OptimizeError, PlanCandidate
    bud = run.budget
    deadline = Deadline(bud.clock() + 0.9 * max(bud.left(), 0.0), bud.clock)
    try:
        r = _tuned(run, run.strategy, deadline)
    except TunedError as e:
        raise OptimizeError(str(e)) from None
    if r.pcg is None:
        raise OptimizeError(f"strategy {run.strategy!r}: no plan on {run.m.name} ({r.reason})")
    mapping = TunedMapping(r, run.n_dev, run.m.device.usable_bytes)
    run.stats = {"chosen": f"{run.strategy} tuned: {r.config.label()}",
                 f"{run.strategy}_config": r.config.to_json(), "tuned": r.summary()}
    return PlanCandidate(f"{run.strategy} tuned", r.pcg, r.cost, (), by_rules=False, mapping=mapping,
                         pipeline=r.pipeline)


__all__ = ["tune", "accumulate", "floor", "plan_candidate", "TunedMapping", "TunedResult", "TunedConfig", "TunedError", "techniques", "pairs", "micro_batch_sizes",
           "STRATEGIES", "RECOMPUTE"]
