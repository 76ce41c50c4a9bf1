"""Memory techniques priced in time and memory, and the choice among them (DESIGN "Memory model").

Job: given a mapped PCG (a :class:`search.cost.GraphCost` and a view per node), price a
:class:`unity_pcg.plan.MemoryPlan` and choose the cheapest feasible one.  One mechanism for every
model and strategy; nothing here knows layer names.

*ZeRO* (stage 1-3, over each weight's data-parallel copies: the ``c`` devices holding identical copies
of one weight piece).  Memory per device: stage 1 keeps ``1/c`` of the optimizer states, stage 2 also
of the gradient, stage 3 also of the parameter plus a gathered working copy (the largest *unit* --
weights grouped by the region of their first use -- at full size with, under bf16, the converted copies of
its weights, which then leave the weights part -- a weight only bf16 operators read is gathered in bf16 --,
:data:`GATHERED_UNITS`: the executor
gathers one unit at a time, before its first use and again in its backward, and frees it after its
last use; no prefetch).  Time: a
reduce-scatter of the gradient in place of its all-reduce; the update of ``1/c`` of the weight;
stages 1-2 all-gather the updated parameters (overlapping the next forward where the runtime
overlaps), stage 3 all-gathers each unit before its forward and again before its backward and reduce-
scatters its gradient when the backward passes its first use: one collective per unit and copy group,
each with its own latency, as the executor runs them (executor/memory.py: a ZeRO-3 group is a unit).
*Recomputation* per region (:func:`regions`): ``full`` keeps nothing produced inside but what is read
outside (the region's inputs are kept, as a checkpoint keeps them); ``selective`` also keeps the
outputs of operators of class :data:`SELECTIVE_KEEP`.  Time: one more forward of what is recomputed
(its compute and its forward transfers, the collectives of the region and the gathers feeding it:
:func:`region_members`).  Memory: while a region's backward runs its recomputed
activations live again (the largest region's, on top).
*Offload*: optimizer states (and the update) in host memory: the states leave the device; the
gradient shard goes to the host and the parameter shard back over ``links["host"]``, the update runs
at ``host_mem_bandwidth`` shared by the node's devices.  The host holds, per device, the states, the
updated parameter shard and the gradient shard copied for the update; the devices of a node share its
``host_memory_bytes``: a plan whose node needs more is infeasible (an unknown capacity offers no offload).

*Overlap* (``MachineSpec.overlap_grad_sync``): the iteration is the critical path of a compute stream
(forward in topological order, backward in reverse, recomputation before a region's backward) and one
communication stream (gradient buckets of ``grad_bucket_bytes`` in the order their gradients become
ready -- the reverse order of use -- each issued when its last gradient is ready; stages 1-2's
all-gathers from the iteration's start; stage 3's collectives synchronous, as the executor runs them:
a unit's gathers right before its forward and its backward, its reduce-scatter before the next task).
Without overlap every collective is on the critical path, so an empty MemoryPlan prices exactly as
:class:`search.mapping.MachineMapper` does (iteration = compute + transfers + sync + update).  With
``base`` a mapping's own cost (side-by-side branches make it less than the sum of its leaves), the
iteration is that cost plus the techniques' change.

:func:`choose` tries every allowed (ZeRO stage, offload) and, where memory does not fit, recomputes
regions: every assignment when there are at most ``exact_limit`` regions, else greedily the region
and mode saving the most bytes on the busiest device per second added, until it fits.  It returns the
fastest feasible combination (ZeRO-1 can win when memory fits: it shrinks the update).

*Deadlines*: building a :class:`Techniques` and every pricing and choosing loop check the deadline of the
caller's scope (:func:`search.budget.check`; no signal): past it they raise :class:`search.budget.Expired`
and the caller keeps what it had.  *Identical blocks*: tensors with equal placement, bytes and kept
fraction share one pair of device dicts (:data:`_TEMPLATES`) and one row of the backward walk's tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Mapping, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg.machine import MachineView
from unity_pcg.pcg import PCG
from unity_pcg.plan import MemoryPlan, RecomputeRegion

from . import collectives as C
from .cost import FLOAT_DTYPES, OPTIMIZER_STATES, GraphCost, op_class
from .budget import check
from .memory import (SAVES_INPUTS, SAVES_OUTPUT, MemoryReport, _saves_copy, cast_items, format_bytes, kept,
                     memory_per_device)

#: operator classes whose outputs a ``selective`` region keeps (everything else inside is recomputed):
#: dense matmuls, convolutions and embeddings; batched matmuls (attention's scores and its product with
#: the values) are recomputed with the softmax and dropout between them, as Megatron-LM's selective form
SELECTIVE_KEEP = frozenset({"matmul", "conv", "conv1x1", "conv_grouped", "embedding"})
#: operators that save nothing for their backward (views, copies, casts): a checkpointed run made of these
#: and communication alone runs plainly (checkpointing it would keep its input for nothing); the executor
#: (executor/memory.py) and the pricing here read this one set
LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Identity", "Slice", "Split", "Expand", "Concat", "Cast",
                        "Tile", "Pad"})


def saves_nothing(op: str) -> bool:
    """Whether operator ``op`` saves nothing for its backward (no input, not its output, no mask: views,
    casts, additions -- its registry entry's ``saves``): a checkpointed run made of these and communication
    alone runs plainly under selective recomputation (checkpointing it would keep its inputs and save
    nothing, and cost a checkpoint: a recomputation's host work and launches); the executor
    (executor/memory.py) and the pricing here read this one predicate."""
    if op in LAYOUT_OPS:
        return True
    return (SAVES_INPUTS.get(op) == set() and op not in SAVES_OUTPUT and op in ops.REGISTRY
            and not ops.saves(op).mask)


#: parallel operators that gather (each output piece holds at least its input piece: concatenations and
#: copies): a chain of them feeding a recompute region belongs to the region (:func:`region_members`), so
#: the region keeps the smaller input and gathers again when recomputed
GATHER_OPS = frozenset({"Combine", "Replicate"})
#: ZeRO-3: the largest units counted gathered at full size on top of the shards (the executor gathers one
#: unit at a time -- before its first use, again in its backward -- and frees it after its last use)
GATHERED_UNITS = 1
#: fewest compute operators of a region found by :func:`regions` (then it ends at the next cut)
MIN_REGION_OPS = 4
#: :func:`choose` tries every recompute assignment up to this many regions, else it is greedy
EXACT_LIMIT = 4
MODES = ("none", "selective", "full")


# --- regions ------------------------------------------------------------------------------------------

def regions(g: PCG | GraphCost, min_ops: int = MIN_REGION_OPS) -> tuple[tuple[int, ...], ...]:
    """Recompute regions found from the graph's structure: the compute nodes in topological order,
    cut after a position where exactly one activation (or none) is live -- what the backward of the
    region would need from before it is one tensor, a layer's or half-layer's boundary on a
    transformer's residual stream, a block's on a CNN -- once the region has ``min_ops`` compute
    nodes.  Placements (weights, input shards) are not activations.  Each region a tuple of node ids."""
    if isinstance(g, GraphCost):
        g = g.g
    role = g.roles()
    order = [n for n in g.topo_order() if role[n] in ("compute", "parallel")]
    pos = {n: i for i, n in enumerate(order)}
    last: dict = {}
    for n in order:
        for r in g.node(n).inputs:
            if r[0] in pos:
                last[tuple(r)] = max(last.get(tuple(r), -1), pos[n])
    ends: dict = {}
    for r, lu in last.items():
        ends.setdefault(pos[r[0]], []).append(lu)
    live: list = []          # last uses of the live tensors
    out, cur = [], []
    for i, n in enumerate(order):
        live = [lu for lu in live if lu > i] + [lu for lu in ends.get(i, ()) if lu > i]
        if role[n] == "compute":
            cur.append(n)
        if len(live) <= 1 and len(cur) >= min_ops:
            out.append(tuple(cur))
            cur = []
    if cur:
        if out and len(cur) < min_ops:
            out[-1] = out[-1] + tuple(cur)
        else:
            out.append(tuple(cur))
    return tuple(out)


def region_members(g: PCG, role: Mapping[int, str], nodes, taken=frozenset(), outputs=frozenset()) -> set:
    """What a recompute region runs (and recomputes), the same in the cost model (:meth:`Techniques._runs`)
    and the executor (``executor.memory.schedule``): its compute ``nodes``; the parallel operators between
    them (fed by the region through parallel operators, every consumer inside); and the *gathers feeding
    it*: chains of :data:`GATHER_OPS` operators whose first input is a compute node's output made outside
    and every consumer is inside -- under sequence parallelism the Combine -> Replicate all-gather of a sequence
    shard into a column-parallel Linear, so the region keeps the shard and all-gathers again in its
    recomputation, as Megatron-LM does.  ``role``: node -> role (``PCG.roles()``, or the executor's);
    ``taken``: nodes of earlier regions; ``outputs``: graph output node ids (never inside)."""
    S = set(nodes)
    T: set = set()
    stack = list(S)
    while stack:                  # parallel operators fed by the region
        x = stack.pop()
        for k in range(len(g.shapes(x))):
            for u, _ in g.consumers((x, k)):
                if role.get(u) == "parallel" and u not in T and u not in taken and u not in S:
                    T.add(u)
                    stack.append(u)
    F: set = set()
    for n in S:                   # gathers feeding it, back from each input
        for r in g.node(n).inputs:
            p = r[0]
            while (role.get(p) == "parallel" and g.node(p).op in GATHER_OPS and p not in taken
                   and p not in S and p not in T and p not in F):
                F.add(p)
                p = g.node(p).inputs[0][0]

    def consumers(x):
        return [u for k in range(len(g.shapes(x))) for u, _ in g.consumers((x, k))]
    changed = True
    while changed:                # ... whose every consumer is inside, not a graph output
        changed = False
        for x in sorted(T | F):
            inside = S | T | F
            src = g.node(x).inputs[0][0]
            if x in T:
                ok = src in inside
            else:                 # a whole gather chain, from a compute node's output (not from a Reduce:
                ok = src in F or role.get(src) == "compute"      # an all-reduce keeps a partial sum as big)
            ok = ok and x not in outputs and all(u in inside for u in consumers(x))
            if not ok:
                T.discard(x)
                F.discard(x)
                changed = True
    return S | T | F


def recompute_all(regs: Sequence[Sequence[int]], mode: str = "full") -> tuple[RecomputeRegion, ...]:
    """Every region in ``mode`` (Megatron-LM's uniform recomputation)."""
    return tuple(RecomputeRegion(tuple(r), mode) for r in regs)


# --- the priced result ----------------------------------------------------------------------------------

#: float32 copies of a graph output the loss holds at its backward's step, beyond the output's gradient
#: (executor/train.py ``_piece_loss``: mse keeps its difference and its backward makes a temporary of the
#: same size; cross-entropy keeps the log-probabilities and makes their gradient)
LOSS_FP32_COPIES = 2


@dataclass
class Priced:
    """A MemoryPlan priced on one mapping.  Times in seconds; ``iteration_s`` = ``base_s`` - ``leaves_s``
    + ``compute_s`` + ``comm_s`` + ``recompute_s`` + ``sync_s`` + ``zero_comm_s`` - ``hidden_s`` +
    ``update_s`` + ``offload_s`` (``base_s - leaves_s``: what side-by-side branches save)."""
    memory: MemoryPlan
    iteration_s: float
    feasible: bool
    reason: str
    report: MemoryReport
    base_s: float = 0.0          # the mapping's cost without techniques and overlap
    leaves_s: float = 0.0        # its leaves one after the other
    compute_s: float = 0.0
    comm_s: float = 0.0          # activation transfers (forward + backward)
    sync_s: float = 0.0          # gradient all-reduces as priced without techniques (and buffer syncs)
    zero_comm_s: float = 0.0     # ZeRO's collectives minus the all-reduces they replace
    recompute_s: float = 0.0
    update_s: float = 0.0        # the optimizer update on the devices, with the techniques
    base_update_s: float = 0.0   # the same without them
    offload_s: float = 0.0       # host transfers and the host update
    hidden_s: float = 0.0        # communication the compute hides (overlap)
    exposed_sync_s: float = 0.0  # communication of the sync stream left on the critical path
    zero_units: int = 0
    overlap: bool = False
    host_per_node: dict = field(default_factory=dict)   # offload: node -> bytes in its host memory
    host_capacity: int = 0                               # the machine's host memory per node

    @property
    def host_max_bytes(self) -> int:
        return max(self.host_per_node.values(), default=0)

    @property
    def max_bytes(self) -> int:
        return self.report.max_bytes

    @property
    def per_device(self) -> dict:
        return dict(self.report.per_device)

    def to_json(self) -> dict:
        return {"recompute_s": self.recompute_s, "zero_comm_s": self.zero_comm_s, "offload_s": self.offload_s,
                "exposed_sync_s": self.exposed_sync_s, "hidden_comm_s": self.hidden_s,
                "update_with_techniques_s": self.update_s, "overlap_grad_sync": self.overlap,
                **({"offload_host_bytes": self.host_max_bytes, "host_memory_bytes": self.host_capacity}
                   if self.memory.offload else {})}

    def rows(self) -> list[tuple[str, float]]:
        """The iteration as rows that add up to it (explain)."""
        rows = [("compute", self.compute_s), ("transfers", self.comm_s), ("gradient sync", self.sync_s)]
        if abs(self.base_s - self.leaves_s) > 1e-12 * max(self.leaves_s, 1e-30):
            rows.append(("side-by-side branches", self.base_s - self.leaves_s))
        if self.recompute_s:
            rows.append(("recompute", self.recompute_s))
        if self.memory.zero and self.zero_comm_s:
            rows.append((f"ZeRO-{self.memory.zero} collectives", self.zero_comm_s))
        if self.hidden_s:
            rows.append(("hidden by overlap", -self.hidden_s))
        rows.append(("optimizer update", self.update_s))
        if self.offload_s:
            rows.append(("offload", self.offload_s))
        return rows


@dataclass
class _Weight:
    """A trained weight piece placement (a chain end, or a weight a compute node reads directly)."""
    nid: int
    nbytes: int                    # one piece, fp32
    devices: tuple                 # every device holding a piece
    groups: tuple                  # copy groups (devices holding the same piece)
    copies: int
    sync: float                    # its all-reduce as the leaves price it (0: one copy)
    update: float                  # its update as the leaves price it
    first: int                     # first consumer (topological)
    last: int                      # last consumer
    unit: int = 0
    cast: float = 0.0              # bytes per device of autocast's converted copies its readers keep (bf16)
    low: bool = False              # bf16: every reader converts it to bf16 (ZeRO-3 gathers it in bf16)


@dataclass
class _Tensor:
    key: tuple
    producer: int
    consumers: tuple
    base: float                    # kept fraction without recomputation
    per_dev: dict                  # device -> bytes at fraction 1
    mask_dev: dict                 # device -> bytes at the base fraction (Dropout masks)
    fixed: bool = False            # input shards: never change


#: (placement, piece bytes, kept fraction, mask bytes) -> (device -> bytes, device -> kept bytes): the device
#: dicts of a tensor, shared by every tensor with the same key (a model's identical blocks; read-only)
_TEMPLATES: dict = {}
_TEMPLATE_LIMIT = 4096          # cleared (before an analysis) beyond this many: one graph needs a few hundred
#: the per-node and per-tensor loops of the analysis check the caller's deadline every this many items (a
#: clock reading each); the pricing and choosing loops check it at every step
CHECK_EVERY = 256
#: share the device dicts (and the walk's rows) of equal tensors; False: one per tensor (the reference the
#: tests compare the shared ones with, float for float)
SHARE_BLOCKS = True
#: the greedy's trim skips a step down like one that did not fit (:meth:`Techniques._trim`; False: it prices
#: every step, the reference the tests compare it with)
TRIM_PREDICT = True


# --- pricing --------------------------------------------------------------------------------------------

class Techniques:
    """Everything the techniques need about one mapping, computed once (choose prices many plans).

    Pricing reuses what a plan shares with plans priced before (:meth:`_memory`, :meth:`_comm_stream`):
    the weights per (stage, offload), the activations and the backward's peak per recomputation, the
    communication stream per (stage, offload); per-device sums run over device-column rows
    (:meth:`_walk_tables`) in the order the per-item loops add them, so every price is the same float."""
    #: recomputations whose activations (and backward peaks) a Techniques keeps (oldest dropped first)
    ACT_CACHE = 256
    #: steps down the trim left unpriced (like one that did not fit, :meth:`_trim`), over this object's life
    trim_skipped = 0

    def __init__(self, gc: GraphCost, views: Mapping[int, MachineView], base: Any = None,
                 regs: Sequence[Sequence[int]] | None = None, report: MemoryReport | None = None):
        """``base``: the mapping's cost (or its MappingResult); ``regs``: the recompute regions (default
        :func:`regions`); ``report``: the mapping's memory without techniques when the caller has it (what
        :func:`search.memory.memory_per_device` gives for ``views`` on this graph: :func:`plain_report`),
        else computed here."""
        self.gc, self.g, self.views = gc, gc.g, dict(views)
        self.model = gc.model
        self.machine = gc.machine
        g = self.g
        nodes = gc.nodes()
        self.order = [n for n in nodes if gc.role[n] in ("compute", "parallel")]
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.leaf = {}
        for i, n in enumerate(nodes):
            if not i % CHECK_EVERY:
                check()
            self.leaf[n] = gc.leaf_cost(n, self.views[n], self.views)
        self.leaves_s = sum(c.time for c in self.leaf.values())
        self.compute_s = sum(c.compute for c in self.leaf.values())
        self.comm_s = sum(c.comm for c in self.leaf.values())
        self.sync_s = sum(c.sync for c in self.leaf.values())
        self.update_s = sum(c.update for c in self.leaf.values())
        bc = getattr(base, "cost", base)
        self.base_s = float(bc) if bc is not None and math.isfinite(float(bc)) else self.leaves_s
        self.base_report = report if report is not None else memory_per_device(gc, self.views)
        self.capacity = self.base_report.capacity
        self.states = OPTIMIZER_STATES[self.model.optimizer]
        # forward / backward durations of every node on the compute stream (compute + half its transfers)
        self.fwd, self.bwd = {}, {}
        for n in self.order:
            c = self.leaf[n]
            f = b = 0.0
            if gc.role[n] == "compute":
                f, b = gc.task_time(n)
                k = self.model.busy_factor(self.views[n].degree)
                f, b = f * k, c.compute - f * k
            self.fwd[n] = f + c.comm / 2
            self.bwd[n] = b + c.comm / 2
        nf = len(self.order)        # the compute stream's tasks: forwards, then backwards in reverse
        self._dur = [self.fwd[n] for n in self.order] + [self.bwd[n] for n in reversed(self.order)]
        self._bidx = {n: 2 * nf - 1 - self.pos[n] for n in self.order}     # backward task of node n
        self.regions = tuple(tuple(r) for r in (regs if regs is not None else regions(g)))
        self.exec_pos = {n.id: i for i, n in enumerate(g.nodes())}     # the executor's step order
        self._runs_cache: dict = {}
        self._fracs_cache: dict = {}
        self._memo: dict = {}          # per (stage, offload) or ZeRO class: weights, gradients
        self._act_cache: dict = {}     # per recomputation: activations, the backward's peaks
        self._weights()
        self._tensors()
        self._grad_events()

    # --- weights ----------------------------------------------------------------------------------
    def _first_last(self, nid: int) -> tuple[int, int]:
        """First and last compute-stream consumers of a weight placement (topological positions)."""
        seen, stack, ps = set(), [nid], []
        while stack:
            x = stack.pop()
            for k in range(len(self.g.shapes(x))):
                for u, _ in self.g.consumers((x, k)):
                    if u in seen:
                        continue
                    seen.add(u)
                    if u in self.pos:
                        ps.append(self.pos[u])
                    else:
                        stack.append(u)
        return (min(ps), max(ps)) if ps else (0, 0)

    def _casts_of(self, nid: int) -> tuple[float, bool]:
        """(bytes per device of the converted copies of weight placement ``nid`` that autocast makes for the
        compute nodes reading it -- bf16: ``GraphCost.casts``; the weights part counts them whole,
        :func:`search.memory.cast_items` --, whether every reader converts it to bf16)."""
        gc, g = self.gc, self.g
        if gc.precision != "bf16":
            return 0.0, False
        out, low, readers = 0.0, True, 0
        seen, stack = set(), [nid]
        while stack:
            x = stack.pop()
            for k in range(len(g.shapes(x))):
                for u, pos in g.consumers((x, k)):
                    if u in self.pos:
                        readers += 1
                        to = [t for p, _, t in gc.casts(u) if p == pos]
                        if to and to[0] == "bfloat16":
                            out += g.shape((x, k)).piece_numel * gc.kernel_itemsize(to[0])
                        else:
                            low = False
                    elif u not in seen:
                        seen.add(u)
                        stack.append(u)
        return out, low and readers > 0

    def _weights(self) -> None:
        gc, g = self.gc, self.g
        ws: list = []
        self.buffer_sync: list = []     # (position, seconds): syncs of untrained replicated buffers
        for i, n in enumerate(gc.nodes()):
            if not i % CHECK_EVERY:
                check()
            role = gc.role[n]
            if role == "weight-placement" and n in gc._chain_end:
                if not gc.trainable(n):
                    if self.leaf[n].sync:
                        self.buffer_sync.append((self._first_last(n)[0], self.leaf[n].sync))
                    continue
                sh = g.shapes(n)[0]
                devs = self.views[n].devices()
                rest = sh.piece_count // sh.copy_degree
                grp: dict = {}
                for flat, d in enumerate(devs):
                    grp.setdefault(flat % rest, []).append(d)
                f, l = self._first_last(n)
                cast, low = self._casts_of(n)
                ws.append(_Weight(n, sh.piece_nbytes, tuple(devs), tuple(tuple(x) for x in grp.values()),
                                  sh.copy_degree, self.leaf[n].sync, self.leaf[n].update, self.order[f],
                                  self.order[l], cast=cast, low=low))
            elif role == "compute":
                for r in gc._update_owner.get(n, ()):
                    nb = g.shape(r).piece_nbytes
                    devs = self.views[n].devices()
                    ws.append(_Weight(r[0], nb, tuple(devs), tuple((d,) for d in devs), 1, 0.0,
                                      self.model.update_time(nb), n, n))
        region_of = {n: i for i, r in enumerate(self.regions) for n in r}
        units: dict = {}
        for w in ws:
            key = ("r", region_of[w.first]) if w.first in region_of else ("n", w.first)
            w.unit = units.setdefault(key, len(units))
        self.weights = ws
        self.n_units = len(units)
        self.has_copies = any(w.copies > 1 for w in ws)

    def weight_bytes(self, zero: int, offload: bool) -> dict:
        """Device -> bytes of weights, gradients and optimizer states with ZeRO ``zero`` and ``offload``
        (the base weights of the mapping, less what the techniques take off, plus stage 3's working copy)."""
        w = dict(self.base_report.weights)
        k = self.states
        gathered: dict = {}             # device -> unit -> bytes gathered beyond the owned shard
        saves: list = []
        for x in self.weights:
            c = x.copies
            p = x.nbytes
            param = p / c if zero >= 3 else p
            grad = p / c if zero >= 2 else p
            st = 0.0 if offload else (k * p / c if zero >= 1 else k * p)
            if 1 <= zero <= 2 and not offload:
                st += p / c          # the optimizer's own copy of the updated shard (all-gathered after)
            save = (2 + k) * p - (param + grad + st)
            if zero >= 3 and c > 1:
                # the converted copies too are made from the gathered values, one unit at a time: a weight
                # every reader converts to bf16 is gathered in bf16 (the gathered vector is the copy; the
                # fp32 parameters are float32 under bf16), another converted for its bf16 readers and again
                # in the backward
                save += x.cast
                work = p / 2 if x.low else p - p / c + x.cast
                for d in x.devices:
                    u = gathered.setdefault(d, {})
                    u[x.unit] = u.get(x.unit, 0) + work
            saves.append(save)
        wt = self._weight_table()
        if wt is None:                  # a device twice in one weight's list: one subtraction at a time
            for x, save in zip(self.weights, saves):
                for d in x.devices:
                    w[d] = w.get(d, 0) - save
        else:                           # per device, the weights' savings subtracted in order
            col = wt["col"]
            vec = np.cumsum(np.concatenate([wt["base"], -(np.array(saves, dtype=float)[:, None] * wt["on"])]),
                            axis=0)[-1].tolist()
            w = {d: vec[col[d]] for d in w}
            for d in wt["devs"]:
                if d not in w:
                    w[d] = vec[col[d]]
        for d, u in gathered.items():
            top = sorted(u.values(), reverse=True)[:GATHERED_UNITS]
            w[d] = w.get(d, 0) + sum(top)
        return w

    def _weight_table(self) -> dict | None:
        """Columns for :meth:`weight_bytes`: the mapping's weight bytes per device (``base``, one row) and
        which devices hold each weight (``on``, one row per weight); None where a weight lists a device twice."""
        if not hasattr(self, "_wtab"):
            devs = list(dict.fromkeys([*self.base_report.weights, *(d for x in self.weights for d in x.devices)]))
            col = {d: i for i, d in enumerate(devs)}
            on = np.zeros((len(self.weights), len(devs)))
            ok = True
            for i, x in enumerate(self.weights):
                ok = ok and len(set(x.devices)) == len(x.devices)
                on[i, [col[d] for d in x.devices]] = 1.0
            base = np.zeros((1, len(devs)))
            for d, b in self.base_report.weights.items():
                base[0, col[d]] = b
            self._wtab = {"col": col, "devs": devs, "on": on, "base": base} if ok else None
        return self._wtab

    def free_grad_bytes(self, zero: int) -> dict:
        """Device -> bytes of the gradients that exist only from the backward on: those no gradient
        bucket holds between steps -- a weight with one copy (nothing to all-reduce), every weight with
        ZeRO-3 (its gradient reaches the shard in the backward); as the executor does (executor/train.py:
        buckets persist, other gradients are freed after the update)."""
        out: dict = {}
        for x in self.weights:
            if zero >= 3 or x.copies == 1:
                g = x.nbytes / x.copies if zero >= 2 else x.nbytes
                for d in x.devices:
                    out[d] = out.get(d, 0) + g
        return out

    def bucket_bytes(self, zero: int) -> dict:
        """Device -> bytes of ZeRO-2's full-size gradient buckets: made when the backward starts, reduce-
        scattered into the rank's shard (held between steps, in :meth:`weight_bytes`) and freed after the
        update -- backward-only memory, as :meth:`free_grad_bytes`."""
        out: dict = {}
        if zero != 2:
            return out
        for x in self.weights:
            if x.copies > 1:
                for d in x.devices:
                    out[d] = out.get(d, 0) + x.nbytes
        return out

    # --- activations ------------------------------------------------------------------------------
    def _tensors(self) -> None:
        """Every activation (and input shard) a mapping holds, one :class:`_Tensor` per output: its kept
        fraction (:func:`search.memory.kept`) and its bytes per device.  Tensors of identical blocks (equal
        placement, piece bytes and fraction) share one pair of device dicts (:data:`_TEMPLATES`), which the
        walk's tables turn into rows once (:meth:`_walk_tables`); they are read, never changed."""
        gc, g = self.gc, self.g
        self.copy = _saves_copy(gc)
        outs = set(map(tuple, g.outputs))
        self.outs = outs
        ts: dict = {}
        self.by_node: dict = {}          # node -> keys of tensors it produces or reads
        by_node = self.by_node
        tmpl = _TEMPLATES
        if len(tmpl) > _TEMPLATE_LIMIT:
            tmpl.clear()
        for i, n in enumerate(gc.nodes()):
            if not i % CHECK_EVERY:
                check()
            role = gc.role[n]
            if role == "weight-placement":
                continue
            if role == "input-placement" and any(gc.role[x[0]] != "input" for x in g.node(n).inputs):
                continue
            view = self.views[n]
            fixed = role == "input-placement"
            for k, s in enumerate(g.shapes(n)):
                frac = 1.0 if fixed else kept(gc, n, k)
                pb = s.piece_numel * gc.itemsize((n, k))
                place = gc.placement(n, view, k)
                tk = (place, pb, frac, s.piece_nbytes if 0 < frac < 1 else None)
                pair = tmpl.get(tk) if SHARE_BLOCKS else None
                if pair is None:
                    per: dict = {}
                    for d in place:
                        per[d] = per.get(d, 0) + pb
                    if 0 < frac < 1:
                        mb = int(s.piece_nbytes * frac)
                        mask = {d: b // pb * mb for d, b in per.items()}
                    else:
                        mask = {d: b * frac for d, b in per.items()}
                    pair = (per, mask)
                    if SHARE_BLOCKS:
                        tmpl[tk] = pair
                cons = tuple(g.consumers((n, k)))
                key = (n, k)
                ts[key] = _Tensor(key, n, cons, frac, pair[0], pair[1], fixed)
                by_node.setdefault(n, set()).add(key)
                for u, _ in cons:
                    by_node.setdefault(u, set()).add(key)
        self.tensors = ts
        # autocast's saved converted copies (activation part) per compute node
        self.cast_act: dict = {}
        for n in gc.nodes():
            if gc.role[n] == "compute":
                items = [b for b, weight in cast_items(gc, n) if not weight]
                if items:
                    a: dict = {}
                    devs = set(self.views[n].devices())
                    for b in items:
                        for d in devs:
                            a[d] = a.get(d, 0) + b
                    self.cast_act[n] = a

    def _grad_events(self) -> None:
        """The backward's gradients of activations (static for the mapping): per tensor that carries one
        (a float tensor computed from a trained weight), the backward step that makes it (its last
        consumer's, in the executor's order; a graph output's: the loss's, first of all), the step that
        frees it (its producer's, which turns it into its inputs' gradients) and its bytes per device."""
        g, gc = self.g, self.gc
        req: dict = {}
        for n in g.topo_order():
            node = g.node(n)
            req[n] = (node.op == "Weight" and gc.trainable(n)) or any(req.get(i[0], False) for i in node.inputs)
        ev = []
        for i, (key, t) in enumerate(self.tensors.items()):
            if not i % CHECK_EVERY:
                check()
            if t.fixed or not req.get(t.producer) or gc.dtype(key) not in FLOAT_DTYPES:
                continue
            grad = t.per_dev
            if key in self.outs:
                made = math.inf
                # the loss (executor/train.py) is computed on copy 0 of the output's pieces only, in float32:
                # there the output's gradient, what the loss saves (mse's difference, cross-entropy's
                # log-probabilities) and its backward's temporary, for the loss's step only
                s = g.shape(key)
                pb = s.piece_numel * gc.itemsize(key)
                grad = {}
                for d in gc.placement(t.producer, self.views[t.producer], key[1])[:s.piece_count // s.copy_degree]:
                    grad[d] = grad.get(d, 0) + pb
                k = LOSS_FP32_COPIES * 4 / gc.itemsize(key)
                if gc.itemsize(key) != 4:         # the gradient comes in float32 before its cast
                    k += 4 / gc.itemsize(key)
                ev.append((made, made, {d: b * k for d, b in grad.items()}))
            else:
                ps = [self.exec_pos[u] for u, _ in t.consumers if u in self.exec_pos]
                if not ps:
                    continue
                made = max(ps)
            ev.append((made, self.exec_pos[t.producer], grad))
            sv = ops.saves(g.node(t.producer).op)
            if sv is not None and sv.temps:      # the producer's backward temporaries, during its step
                at = self.exec_pos[t.producer]
                ev.append((at, at, {d: b * sv.temps for d, b in t.per_dev.items()}))
        self.grad_events = ev

    def backward_peak(self, a: Mapping[int, float], kept: Sequence[tuple], extra: Sequence[tuple],
                      base: Mapping[int, float], recomputed: Sequence[tuple] = ()) -> dict:
        """Device -> the most bytes the backward holds at once: walking it step by step (the loss first,
        then every node in reverse executor order), the activations still kept (``a`` at the forward's
        end, less each ``kept`` item (free step, device -> bytes) once its step is done), the gradients of
        activations alive (made by their last consumer's step, freed by their producer's:
        :meth:`_grad_events`), the weight gradients made so far (``extra``: (make step, device -> bytes)),
        what recomputation brought back (``recomputed``: :meth:`recomputed_items`) and ``base`` bytes
        throughout (ZeRO-2's buckets)."""
        steps: dict = {}
        for made, freed, b in self.grad_events:
            steps.setdefault(made, [[], [], []])[0].append(b)
            steps.setdefault(freed, [[], [], []])[1].append(b)
        for at, b in kept:
            steps.setdefault(at, [[], [], []])[2].append(b)
        for at, b in extra:
            steps.setdefault(at, [[], [], []])[0].append(b)
        for at, freed, b in recomputed:
            steps.setdefault(at, [[], [], []])[0].append(b)
            steps.setdefault(freed, [[], [], []])[2].append(b)
        cur = {d: a.get(d, 0) + base.get(d, 0) for d in set(a) | set(base)}
        peak = dict(cur)
        for at in sorted(steps, reverse=True):
            made, freed, released = steps[at]
            for b in made:
                for d, x in b.items():
                    cur[d] = cur.get(d, 0) + x
            for b in made:
                for d in b:
                    if cur[d] > peak.get(d, 0):
                        peak[d] = cur[d]
            for b in freed:
                for d, x in b.items():
                    cur[d] = cur.get(d, 0) - x
            for b in released:
                for d, x in b.items():
                    cur[d] = cur.get(d, 0) - x
        return peak

    # the backward's walk as arrays: one row per item (device columns), in the walk's order, summed
    # cumulatively from the forward's end -- the same additions in the same order as backward_peak
    _PHASE_MADE, _PHASE_FREED, _PHASE_RELEASED = 0, 1, 2

    def _walk_tables(self) -> dict:
        """What the backward's walk takes from the mapping alone, built once: device columns, the gradient
        events' rows (:meth:`_grad_events`), every non-fixed tensor's kept rows (at its base fraction, and
        whole) and the autocast copies' rows, with the steps that free them."""
        wt = getattr(self, "_wt", None)
        if wt is not None:
            return wt
        devs: set = set(self.base_report.per_device) | set(self.base_report.activations)
        seen: set = set()
        for t in self.tensors.values():
            if id(t.per_dev) not in seen or id(t.mask_dev) not in seen:
                seen.add(id(t.per_dev))
                seen.add(id(t.mask_dev))
                devs |= set(t.per_dev) | set(t.mask_dev)
        for x in self.weights:
            devs |= set(x.devices)
        for b in self.cast_act.values():
            devs |= set(b)
        for _, _, b in self.grad_events:
            devs |= set(b)
        col = {d: i for i, d in enumerate(sorted(devs, key=repr))}
        D = len(col)

        def rows(dicts) -> np.ndarray:
            # one row per distinct dict (tensors of identical blocks share theirs), then gathered
            uniq, idx = _distinct(dicts)
            ii, jj, vv = [], [], []
            for i, b in enumerate(uniq):
                if not i % CHECK_EVERY:
                    check()
                ii.extend([i] * len(b))
                jj.extend([col[d] for d in b])
                vv.extend(b.values())
            out = np.zeros((len(uniq), D))
            if vv:
                out[ii, jj] = np.array(vv, dtype=float)
            return out[idx] if len(uniq) != len(dicts) else out

        def present(dicts) -> np.ndarray:
            uniq, idx = _distinct(dicts)
            ii, jj = [], []
            for i, b in enumerate(uniq):
                ii.extend([i] * len(b))
                jj.extend([col[d] for d in b])
            out = np.zeros((len(uniq), D), dtype=bool)
            out[ii, jj] = True
            return out[idx] if len(uniq) != len(dicts) else out
        ev = self.grad_events
        kt = [k for k, t in self.tensors.items() if not t.fixed]
        full = rows([self.tensors[k].per_dev for k in kt])
        full_p = present([self.tensors[k].per_dev for k in kt])
        # a tensor kept whole or not at all keeps (every byte x its fraction) on the same devices; a
        # fraction in between (a Dropout's mask) is its own row
        mask = full.copy()
        for i, k in enumerate(kt):
            t = self.tensors[k]
            if t.base == 0.0:
                mask[i] = full[i] * 0.0
            elif t.base != 1.0:
                mask[i] = rows([t.mask_dev])[0]
        mask_p = full_p.copy()
        for i, k in enumerate(kt):
            t = self.tensors[k]
            if t.mask_dev.keys() != t.per_dev.keys():
                mask_p[i] = present([t.mask_dev])[0]
        # the gradient events: most carry a tensor's bytes (its row above), the rest their own rows
        of_dict = {id(self.tensors[k].per_dev): i for i, k in enumerate(kt)}
        ev_rows = np.zeros((len(ev), D))
        own = [j for j, (_, _, b) in enumerate(ev) if id(b) not in of_dict]
        same = [j for j in range(len(ev)) if id(ev[j][2]) in of_dict]
        if same:
            ev_rows[same] = full[[of_dict[id(ev[j][2])] for j in same]]
        if own:
            ev_rows[own] = rows([ev[j][2] for j in own])
        ev_p = np.zeros(D, dtype=bool)
        if same:
            ev_p |= full_p[[of_dict[id(ev[j][2])] for j in same]].any(axis=0)
        if own:
            ev_p |= present([ev[j][2] for j in own]).any(axis=0)
        wt = self._wt = {
            "col": col, "D": D, "rows": rows,
            "ev": ev_rows,
            "ev_made": np.array([m for m, _, _ in ev], dtype=float),
            "ev_freed": np.array([f for _, f, _ in ev], dtype=float),
            "ev_present": ev_p,
            "kt": kt, "kt_row": {k: i for i, k in enumerate(kt)},
            "kt_mask": mask,
            "kt_full": full,
            "kt_step": np.array([self._release(k, {}) for k in kt], dtype=float),
            "cast": list(self.cast_act), "cast_row": {n: i for i, n in enumerate(self.cast_act)},
            "cast_rows": rows(list(self.cast_act.values())),
            "cast_step": np.array([self.exec_pos[n] for n in self.cast_act], dtype=float),
            "devs": list(col),
            "kt_mask_p": mask_p,
            "kt_full_p": full_p,
            "cast_p": present(list(self.cast_act.values())),
        }
        return wt

    def _peak(self, a: Mapping[int, float], act: dict, made: Sequence[tuple], base: Mapping[int, float],
              held: Sequence[tuple] = ()) -> dict:
        """:meth:`backward_peak` of ``a``, :meth:`kept_items`, ``made`` (the ``extra`` weight gradients),
        ``base`` and :meth:`recomputed_items` for the recomputation of ``act`` (:meth:`_activations`),
        the same sums in the same order: the static rows (gradient events, tensors kept at their base
        fraction, autocast copies) are built once; a plan changes the rows of the tensors its runs touch.
        ``held``: more (make step, release step, device -> bytes) items, walked as the recomputed ones
        (ZeRO-3's whole unit gradients, :meth:`_unit_grads`)."""
        wt = self._walk_tables()
        col, D, rows = wt["col"], wt["D"], wt["rows"]
        if any(d not in col for d in set(a) | set(base)):
            return self.backward_peak(a, self.kept_items(act["assign"]), made, base,
                                      list(act["recomputed"]) + list(held))
        assign = act["assign"]
        runs = self._runs(assign)
        kept = self._kept_rows(runs)
        casts = wt["cast_rows"]
        drop = [wt["cast_row"][n] for n in runs if n in wt["cast_row"]]
        if drop:
            casts = casts.copy()
            casts[drop] = 0.0
        rec = list(act["recomputed"]) + list(held) if held else act["recomputed"]
        # blocks: (rows, steps, phase, group); a released or freed row is subtracted
        n_ev = len(wt["ev_made"])
        made_rows = self._memo.get(("made_rows", id(made)))
        if made_rows is None or made_rows[0] is not made:
            made_rows = self._memo[("made_rows", id(made))] = (made, rows([b for _, b in made]))
        made_rows = made_rows[1]
        rec_rows = rows([b for _, _, b in rec])
        blocks = [(wt["ev"], wt["ev_made"], 0, 0, 1.0),
                  (made_rows, np.array([s for s, _ in made], dtype=float), 0, 1, 1.0),
                  (rec_rows, np.array([s for s, _, _ in rec], dtype=float), 0, 2, 1.0),
                  (wt["ev"], wt["ev_freed"], 1, 0, -1.0),
                  (kept, self._kept_steps(runs), 2, 0, -1.0),
                  (casts, wt["cast_step"], 2, 1, -1.0),
                  (rec_rows, np.array([f for _, f, _ in rec], dtype=float), 2, 2, -1.0)]
        blocks = [b for b in blocks if len(b[1])]
        mat = np.concatenate([r if sign > 0 else -r for r, _, _, _, sign in blocks])
        steps = np.concatenate([st for _, st, _, _, _ in blocks])
        phase = np.concatenate([np.full(len(st), ph) for _, st, ph, _, _ in blocks])
        group = np.concatenate([np.full(len(st), gr) for _, st, _, gr, _ in blocks])
        idx = np.concatenate([np.arange(len(st)) for _, st, _, _, _ in blocks])
        order = np.lexsort((idx, group, phase, -steps))
        init = np.zeros((1, D))
        for d in set(a) | set(base):
            init[0, col[d]] = a.get(d, 0) + base.get(d, 0)
        cum = np.cumsum(np.concatenate([init, mat[order]]), axis=0)
        # the peak is taken once a step's gradients are made (frees only lower it)
        ph, st = phase[order], steps[order]
        last_made = (ph == 0) & np.append((ph[1:] != 0) | (st[1:] != st[:-1]), True)
        peak = cum[np.concatenate([[0], 1 + np.flatnonzero(last_made)])].max(axis=0)
        present = wt["ev_present"].copy() if n_ev else np.zeros(D, dtype=bool)
        for d in set(a) | set(base):
            present[col[d]] = True
        for b in [b for _, b in made] + [b for _, _, b in rec]:
            for d in b:
                present[col[d]] = True
        vals = peak.tolist()
        return {d: vals[i] for d, i in col.items() if present[i]}

    def _saves(self, u: int, pos: int) -> bool:
        saved = SAVES_INPUTS.get(self.g.node(u).op)
        return (saved is None or pos in saved) and not (self.copy is not None and self.copy(u, pos))

    def _assign_key(self, assign: Mapping[int, tuple]) -> tuple:
        """``assign``'s sorted items (the key of its runs and activations), once per assignment object (a
        plan's assignment is read by several steps of its pricing; it is never changed once made)."""
        memo = self.__dict__.setdefault("_key_memo", {})
        hit = memo.get(id(assign))
        if hit is not None and hit[0] is assign:
            return hit[1]
        key = tuple(sorted(assign.items()))
        if len(memo) > 64:
            memo.clear()
        memo[id(assign)] = (assign, key)
        return key

    def _runs(self, assign: Mapping[int, tuple]) -> dict:
        """Node -> its checkpointed run (a key) for the regions of ``assign`` (node -> (region, mode)), as
        the executor runs them (executor/memory.py): a region is :func:`region_members` (its compute nodes,
        the parallel operators between them and the gathers feeding it), in the PCG's node order;
        ``full``: one run; ``selective``: each maximal run of steps between the kept operators
        (:data:`SELECTIVE_KEEP`), which run plainly.  A run of operators that save nothing
        (:func:`saves_nothing`) and communication alone runs plainly too.  Nodes that run plainly are absent."""
        key = self._assign_key(assign)
        hit = self._runs_cache.get(key)
        if hit is not None:
            return hit
        g = self.g
        by_region: dict = {}
        for n, (i, md) in assign.items():
            by_region.setdefault((i, md), set()).add(n)
        taken = set(assign)
        out: dict = {}
        outputs = {r[0] for r in self.outs}
        for (i, md), S in sorted(by_region.items()):
            check()
            members = region_members(g, self.gc.role, S, taken - S, outputs)
            taken |= members
            steps = sorted(members, key=self.exec_pos.__getitem__)
            runs: list = []
            for n in steps:
                kept = (md == "selective" and self.gc.role[n] == "compute"
                        and op_class(g.node(n).op, g.input_shapes(n)) in SELECTIVE_KEEP)
                if kept:
                    runs.append(None)
                elif runs and runs[-1] is not None:
                    runs[-1].append(n)
                else:
                    runs.append([n])
            for j, run in enumerate(runs):
                if run is None or (md != "full" and all(self.gc.role[n] != "compute" or saves_nothing(g.node(n).op)
                                                        for n in run)):
                    continue
                for n in run:
                    out[n] = (i, j)
        self._runs_cache[key] = out
        return out

    def _frac(self, t: _Tensor, runs: Mapping[int, tuple]) -> float:
        """Kept fraction of tensor ``t`` when the nodes of ``runs`` (node -> checkpointed run, :meth:`_runs`)
        are recomputed: a tensor a checkpointed run reads from outside it is kept (the checkpoint keeps its
        inputs); one produced inside a run is recomputed unless read outside the run by something that
        keeps it (another run, a consumer that saves it) or a graph output."""
        if t.fixed:
            return t.base
        rp = runs.get(t.producer)
        if rp is None:
            if any(runs.get(u) is not None for u, _ in t.consumers):
                return 1.0
            return t.base
        if t.key in self.outs or not t.consumers:
            return 1.0
        for u, pos in t.consumers:
            ru = runs.get(u)
            if ru == rp:
                continue
            if ru is not None or self._saves(u, pos):
                return 1.0
        return 0.0

    def _bytes(self, t: _Tensor, frac: float) -> dict:
        if frac == t.base:
            return t.mask_dev
        if frac == 1.0:
            return t.per_dev
        return {}

    def activation_bytes(self, assign: Mapping[int, tuple]) -> tuple[dict, dict]:
        """(device -> activation bytes, device -> recomputation's transient peak) with ``assign``.

        The activations are the mapping's, less what each touched tensor kept at its base fraction, plus
        what it keeps now (less the autocast copies of recomputed nodes).  A checkpointed run is recomputed
        when the backward reaches it: what was kept for the operators after it is freed by then (each kept
        tensor counted as freed once the backward passes its release step, :meth:`_release`); what its
        recomputation brings back beyond that is the transient.  Summed as cumulative sums over the rows of
        :meth:`_walk_tables` in the order of a loop over the touched tensors (the same floats)."""
        base = self.base_report.activations
        runs = self._runs(assign)
        if not runs:
            return dict(base), {}
        wt = self._walk_tables()
        col, D = wt["col"], wt["D"]
        fr = self._fracs(runs)
        kt_row = wt["kt_row"]
        idx, full, region_rows = [], [], {}
        for key, f in fr.items():
            t = self.tensors[key]
            if f == t.base:
                continue
            i = kt_row[key]
            idx.append(i)
            full.append(f == 1.0)
            if f < t.base and t.producer in runs:
                region_rows.setdefault(runs[t.producer], []).append(("t", i))
        cidx = []
        for n, j in runs.items():        # autocast copies inside a run: recomputed
            c = wt["cast_row"].get(n)
            if c is not None:
                cidx.append(c)
                region_rows.setdefault(j, []).append(("c", c))
        idx_a = np.array(idx, dtype=int)
        full_a = np.array(full, dtype=bool)
        cidx_a = np.array(cidx, dtype=int)
        init = np.zeros((1, D))
        for d, b in base.items():
            init[0, col[d]] = b
        steps = np.empty((2 * len(idx), D))
        steps[0::2] = -wt["kt_mask"][idx_a]
        steps[1::2] = np.where(full_a[:, None], wt["kt_full"][idx_a], 0.0)
        total_a = np.cumsum(np.concatenate([init, steps, -wt["cast_rows"][cidx_a]]), axis=0)[-1].tolist()
        present = (wt["kt_mask_p"][idx_a].any(axis=0) | (wt["kt_full_p"][idx_a] & full_a[:, None]).any(axis=0)
                   | wt["cast_p"][cidx_a].any(axis=0))
        a = {d: total_a[col[d]] for d in base}
        for d, c in col.items():
            if present[c] and d not in a:
                a[d] = total_a[c]
        transient: dict = {}
        if not region_rows:
            return a, transient
        end: dict = {}
        for n, j in runs.items():
            end[j] = max(end.get(j, -1), self.exec_pos[n])
        steps_k = self._kept_steps(runs)
        sfx = self._suffix_table()
        if sfx is not None:
            # what stays kept past a step (freed after it): the mapping's rows past it (their sums, once per
            # mapping), less the rows the runs touch as they were, plus them as they are now -- whole bytes,
            # so the same numbers as summing every row
            kt_row, tidx, trows = wt["kt_row"], [], []
            for key, f in fr.items():
                i = kt_row.get(key)
                if i is None:
                    continue
                t = self.tensors[key]
                tidx.append(i)
                trows.append(0 if f == t.base else (1 if f == 1.0 else 2))
            tidx_a = np.array(tidx, dtype=int)
            kind = np.array(trows, dtype=int)
            old_rows, old_steps = wt["kt_mask"][tidx_a], wt["kt_step"][tidx_a]
            new_rows = np.where((kind == 1)[:, None], wt["kt_full"][tidx_a],
                                np.where((kind == 0)[:, None], old_rows, 0.0))
            new_steps = steps_k[tidx_a]
            sstep, scum, stotal = sfx

            def kept_after(x):
                i = int(np.searchsorted(sstep, x, side="right"))
                out = stotal - (scum[i - 1] if i > 0 else 0.0)
                return out - old_rows[old_steps > x].sum(axis=0) + new_rows[new_steps > x].sum(axis=0)
        else:
            kept = self._kept_rows(runs)           # what stays kept, freed at its release step
            order = np.argsort(steps_k, kind="stable")
            kstep = steps_k[order]
            cum = np.cumsum(kept[order], axis=0)
            total = cum[-1] if len(cum) else np.zeros(D)

            def kept_after(x):
                i = int(np.searchsorted(kstep, x, side="right"))
                return total - (cum[i - 1] if i > 0 else np.zeros(D))
        for j in sorted(region_rows, key=end.__getitem__):
            rows = [wt["kt_mask"][x] if kind == "t" else wt["cast_rows"][x] for kind, x in region_rows[j]]
            pres = [wt["kt_mask_p"][x] if kind == "t" else wt["cast_p"][x] for kind, x in region_rows[j]]
            back = np.cumsum(np.array(rows), axis=0)[-1]
            extra = (back - kept_after(end[j])).tolist()
            for c in np.flatnonzero(np.any(pres, axis=0)).tolist():
                if extra[c] > transient.get(wt["devs"][c], 0):
                    transient[wt["devs"][c]] = extra[c]
        return a, transient

    def _suffix_table(self):
        """The mapping's kept rows (:meth:`_walk_tables`) in the order of their release steps: (steps, their
        cumulative sums, the total), once per mapping; None unless every kept row is whole bytes and every
        sum exact in a float (then sums in any order are the same numbers: :meth:`activation_bytes` uses it)."""
        wt = self._walk_tables()
        if "suffix" not in wt:
            order = np.argsort(wt["kt_step"], kind="stable")
            rows = wt["kt_mask"][order]
            whole = all(bool(np.all(x == np.floor(x))) and bool(np.all(x >= 0))
                        for x in (wt["kt_mask"], wt["kt_full"]))
            big = float(wt["kt_mask"].sum(axis=0).max(initial=0.0) + wt["kt_full"].sum(axis=0).max(initial=0.0))
            if whole and big < 2.0 ** 52 and SHARE_BLOCKS:
                cum = np.cumsum(rows, axis=0)
                wt["suffix"] = (wt["kt_step"][order], cum, cum[-1] if len(cum) else np.zeros(wt["D"]))
            else:
                wt["suffix"] = None
        return wt["suffix"]

    def _fracs(self, runs: Mapping[int, tuple]) -> dict:
        """Key -> kept fraction (:meth:`_frac`) of every tensor the nodes of ``runs`` touch, once per runs."""
        hit = self._fracs_cache.get(id(runs))
        if hit is not None and hit[0] is runs:
            return hit[1]
        fr = {key: self._frac(self.tensors[key], runs) for key in self._touched(runs)}
        self._fracs_cache[id(runs)] = (runs, fr)
        return fr

    def _kept_rows(self, runs: Mapping[int, tuple]) -> np.ndarray:
        """Every non-fixed tensor's kept bytes with ``runs`` (:meth:`kept_items` without the autocast
        copies), one row each in the tables' order (:meth:`_walk_tables`)."""
        wt = self._walk_tables()
        kept = wt["kt_mask"]
        if not runs:
            return kept
        kept = kept.copy()
        for key, f in self._fracs(runs).items():
            i = wt["kt_row"].get(key)
            if i is None:
                continue
            t = self.tensors[key]
            if f == t.base:
                kept[i] = wt["kt_mask"][i]
            elif f == 1.0:
                kept[i] = wt["kt_full"][i]
            else:
                kept[i] = 0.0
        return kept

    def _release(self, key: tuple, runs: Mapping[int, tuple]) -> float:
        """The backward step after which kept activation ``key`` is released with ``runs``: the last of the
        steps that hold it to run (the lowest executor position) -- each consumer outside its producer's run
        that saves it (autograd releases a node's saved tensors once its backward has run), a checkpointed
        run reading it (the checkpoint keeps its inputs until the run's backward is done: the run's first
        step), its producer when that saves its output or a mask (Softmax, Dropout); a graph output at the
        loss's step (first of all)."""
        if key in self.outs:
            return math.inf
        t = self.tensors[key]
        at = self.exec_pos[t.producer]
        if runs:
            frac = self._fracs(runs).get(key)
            if frac is None:
                frac = self._frac(t, runs)
        else:
            frac = t.base
        if frac < 1.0 or t.producer in self._keeps_output:
            return at
        rp = runs.get(t.producer)
        steps = []
        for u, pos in t.consumers:
            if u not in self.exec_pos:
                continue
            ru = runs.get(u)
            if ru is not None:
                if ru != rp:
                    steps.append(self._run_first(runs)[ru])
            elif self._saves(u, pos):
                steps.append(self.exec_pos[u])
        return float(min(steps)) if steps else at

    @property
    def _keeps_output(self) -> set:
        """Nodes whose operator saves its own output or a mask of it for its backward."""
        hit = self._memo.get("keeps_output")
        if hit is None:
            g = self.g
            hit = self._memo["keeps_output"] = {n for n in self.exec_pos if _op_keeps_output(g.node(n).op)}
        return hit

    def _unpacked(self, t: _Tensor, runs: Mapping[int, tuple]) -> int:
        """The backward step after which a value recomputed for the backward of its run is gone: the last
        (lowest executor position) of the consumers in its run that save it -- the backward unpacks each
        recomputed value once, and nothing holds it after that step -- or its producer when that saves its
        output (or none saves it)."""
        at = self.exec_pos[t.producer]
        if t.producer in self._keeps_output or 0.0 < t.base < 1.0:
            return at
        rp = runs.get(t.producer)
        steps = [self.exec_pos[u] for u, pos in t.consumers
                 if u in self.exec_pos and runs.get(u) == rp and self._saves(u, pos)]
        return min(steps) if steps else at

    def _run_first(self, runs: Mapping[int, tuple]) -> dict:
        """Run key -> the executor position of its first step (its backward's last) for ``runs``."""
        hit = self._memo.get(("first", id(runs)))
        if hit is not None and hit[0] is runs:
            return hit[1]
        first: dict = {}
        for n, j in runs.items():
            first[j] = min(first.get(j, math.inf), self.exec_pos[n])
        self._memo[("first", id(runs))] = (runs, first)
        return first

    def _kept_steps(self, runs: Mapping[int, tuple]) -> np.ndarray:
        """:meth:`_release` of every non-fixed tensor with ``runs``, in the tables' order
        (:meth:`_walk_tables`): the static steps, those of the tensors the runs touch recomputed."""
        wt = self._walk_tables()
        if not runs:
            return wt["kt_step"]
        hit = self._memo.get(("steps", id(runs)))
        if hit is not None and hit[0] is runs:
            return hit[1]
        steps = wt["kt_step"].copy()
        for key in self._touched(runs):
            i = wt["kt_row"].get(key)
            if i is not None:
                steps[i] = self._release(key, runs)
        self._memo[("steps", id(runs))] = (runs, steps)
        return steps

    def _touched(self, runs: Mapping[int, tuple]) -> set:
        """Keys of the tensors the nodes of ``runs`` produce or read."""
        out: set = set()
        for n in runs:
            out |= self.by_node.get(n, set())
        return out

    def kept_items(self, assign: Mapping[int, tuple], casts: bool = True) -> list:
        """(backward step that frees it, device -> bytes) of every activation kept for the backward with
        ``assign``: a tensor is freed once the backward passes its last saver (:meth:`_release`; a graph
        output by the loss's backward, first of all); ``casts``: autocast's saved copies too, freed by their
        node's step (those of a recomputed node are not kept)."""
        runs = self._runs(assign)
        touched = self._touched(runs)
        kept = []
        for key, t in self.tensors.items():
            b = self._bytes(t, self._frac(t, runs)) if key in touched else t.mask_dev
            if b and not t.fixed:
                kept.append((self._release(key, runs), b))
        if casts:
            kept.extend((self.exec_pos[n], b) for n, b in self.cast_act.items() if n not in runs)
        return kept

    def recomputed_items(self, assign: Mapping[int, tuple]) -> list:
        """(backward step that recomputes it, step that frees it, device -> bytes) of what the
        recomputation of ``assign``'s runs brings back: a run is recomputed when the backward reaches its
        last step, its values freed once unpacked (:meth:`_unpacked`), its autocast copies at their node's step."""
        runs = self._runs(assign)
        if not runs:
            return []
        end: dict = {}
        for n, j in runs.items():
            end[j] = max(end.get(j, -1), self.exec_pos[n])
        out = []
        touched = self._touched(runs)
        fr = self._fracs(runs)
        for key in touched:
            t = self.tensors[key]
            if t.producer not in runs:
                continue
            f = fr[key]
            if f >= t.base:
                continue
            kept = self._bytes(t, f)
            back = {d: b - kept.get(d, 0) for d, b in t.mask_dev.items()}
            out.append((end[runs[t.producer]], self._unpacked(t, runs), back))
        for n, j in runs.items():
            if n in self.cast_act:
                out.append((end[j], self.exec_pos[n], self.cast_act[n]))
        return out

    def recompute_time(self, nodes: Sequence[int], mode: str) -> float:
        """One more forward of what region ``nodes`` recomputes in ``mode`` alone: every step of its
        checkpointed runs (:meth:`_runs`), compute and communication (the gathers feeding it, the
        collectives inside)."""
        return self.recompute_times({n: (0, mode) for n in nodes}).get(0, 0.0)

    def recompute_times(self, assign: Mapping[int, tuple]) -> dict:
        """Region index -> seconds of its recomputation with the regions of ``assign``."""
        out: dict = {}
        for n, (i, _) in self._runs(assign).items():
            out[i] = out.get(i, 0.0) + self.fwd.get(n, 0.0)
        return out

    # --- collectives --------------------------------------------------------------------------------
    def _coll(self, groups: Sequence[Sequence[int]], nbytes: float) -> float:
        """A weight's reduce-scatter (or all-gather: the same ring cost) of ``nbytes`` over each copy group
        (groups run concurrently: the slowest), its latency spread over the step's buckets by bytes as the
        gradient all-reduce's is (CostModel.grad_allreduce_time), so that reduce-scatter + all-gather costs
        what the all-reduce it replaces costs."""
        key = ("coll", tuple(map(tuple, groups)), nbytes)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._coll_uncached(groups, nbytes)
        return hit

    def _coll_uncached(self, groups: Sequence[Sequence[int]], nbytes: float) -> float:
        total = self.model.sync_total_bytes or self.gc._sync_bytes or nbytes
        nb = self.model.bucket_count(total) if self.model.grad_bucket_bytes > 0 else 1
        best = 0.0
        for grp in groups:
            p = len(set(grp))
            if p <= 1:
                continue
            split = C.reduce_scatter_split(self.machine, grp, nbytes, total / nb)   # the bucket's algorithm
            if split is None:
                t = C.measured_time(self.machine, "all_gather", p, total / nb) * nb * nbytes / total
            else:
                t = split[1] + split[0] * nb * nbytes / total
            best = max(best, t)
        return best

    def _coll_once(self, groups: Sequence[Sequence[int]], nbytes: float) -> float:
        """One all-gather (or reduce-scatter) of ``nbytes`` over each copy group (concurrent: the slowest),
        its own latency: ZeRO-3's per-unit collectives, one call each in the executor."""
        best = 0.0
        for grp in groups:
            p = len(set(grp))
            if p <= 1:
                continue
            best = max(best, C.allgather_time(self.machine, grp, nbytes))
        return best

    # --- memory per plan (cached: what depends on the plan's parts alone is computed once) ------------
    def _memory(self, zero: int, offload: bool, assign: Mapping[int, tuple]) -> tuple:
        """(weights, activations, recomputation's transient, backward-only gradients, ZeRO-2 buckets, the
        backward's peak), each device -> bytes, for ZeRO ``zero``, ``offload`` and the recomputation
        ``assign``: the weights depend on (``zero``, ``offload``) alone, the activations on ``assign``
        alone and the backward's peak on ``assign`` and what ZeRO makes of the weight gradients
        (:meth:`_zero_class`), so each is computed once per Techniques and reused by every plan sharing it.
        A gradient made in the backward (free_grad_bytes) comes as the backward frees activations: the
        peak holds the activations at the forward's end or those gradients at the backward's, not both;
        the backward's own peak (:meth:`backward_peak`) holds activations not yet freed, the gradients of
        activations alive and the weight gradients made so far, step by step (it is the peak where an
        activation's gradient is large: a language model's logits at the loss, attention scores)."""
        c = self._memo
        key = self._assign_key(assign)
        w = c.get(("w", zero, offload))
        if w is None:
            w = c[("w", zero, offload)] = self.weight_bytes(zero, offload)
        zc = self._zero_class(zero)
        free = c.get(("free", zc))
        if free is None:
            free = c[("free", zc)] = self.free_grad_bytes(zero)
        bucket = c.get(("bucket", zc))
        if bucket is None:
            bucket = c[("bucket", zc)] = self.bucket_bytes(zero)
        act = self._activations(key, assign)
        a, transient = act["a"], act["transient"]
        bwd = act["peak"].get(zc)
        if bwd is None:
            bwd = act["peak"][zc] = self._peak(a, act, self._made(zc), bucket, self._unit_grads(zc))
        return w, a, transient, free, bucket, bwd

    @staticmethod
    def _zero_class(zero: int) -> int:
        """ZeRO stages that make the same backward-only gradients and buckets: 0 and 1 alike, 2, 3."""
        return zero if zero >= 2 else 0

    def _made(self, zc: int) -> list:
        """(make step, device -> bytes) of the weight gradients made in the backward with ZeRO class ``zc``
        (:meth:`free_grad_bytes`'s, at the step of the weight's last consumer)."""
        hit = self._memo.get(("made", zc))
        if hit is None:
            hit = self._memo[("made", zc)] = [
                (self.exec_pos.get(x.last, 0), {d: x.nbytes / x.copies if zc >= 2 else x.nbytes for d in x.devices})
                for x in self.weights if zc >= 3 or x.copies == 1]
        return hit

    def _unit_grads(self, zc: int) -> list:
        """ZeRO-3 (``zc`` 3): (make step, release step, device -> bytes) of what a sharded unit's gradient
        holds beyond the shards :meth:`_made` counts: each weight's gradient is made whole at its last
        consumer's step and stays whole until the backward reaches the unit's first use, where the unit's
        gradient is reduce-scattered into the shard (executor/memory.py ``_ZeroGather``).  At that step the
        unit's gradient is also made whole once more, as one vector (the reduce-scatter's input, while the
        weights' gradients it is made from are alive: FSDP's flat split's backward, FSDP2's copy-in; the
        executor's split), for that step only."""
        hit = self._memo.get(("unit_grads", zc))
        if hit is not None:
            return hit
        out: list = []
        if zc >= 3:
            first: dict = {}
            whole: dict = {}
            for x in self.weights:
                if x.copies > 1:
                    first[x.unit] = min(first.get(x.unit, math.inf), self.exec_pos.get(x.first, 0))
            for x in self.weights:
                if x.copies > 1:
                    # gathered in bf16 (``low``): its gradient is bf16, made whole once more in float32 for
                    # the reduce-scatter (beside the bf16 vector)
                    grad = x.nbytes / 2 if x.low else x.nbytes
                    rest = max(grad - x.nbytes / x.copies, 0.0)
                    out.append((self.exec_pos.get(x.last, 0), first[x.unit], {d: rest for d in x.devices}))
                    w = whole.setdefault(x.unit, {})
                    for d in x.devices:
                        w[d] = w.get(d, 0) + x.nbytes + (grad if x.low else 0.0)
            for u, w in whole.items():
                out.append((first[u], first[u], w))
        self._memo[("unit_grads", zc)] = out
        return out

    def _activations(self, key: tuple, assign: Mapping[int, tuple]) -> dict:
        """What recomputation ``assign`` (``key``: its sorted items) makes of the activations, once:
        ``a`` and ``transient`` (:meth:`activation_bytes`), ``recomputed`` (:meth:`recomputed_items`) and
        ``peak`` (ZeRO class -> the backward's peak, filled by :meth:`_memory`)."""
        hit = self._act_cache.get(key)
        if hit is None:
            if len(self._act_cache) >= self.ACT_CACHE:
                self._act_cache.pop(next(iter(self._act_cache)))
            a, transient = self.activation_bytes(assign)
            hit = self._act_cache[key] = {"a": a, "transient": transient, "assign": dict(assign),
                                          "recomputed": self.recomputed_items(assign), "peak": {}}
        return hit

    # --- the iteration ------------------------------------------------------------------------------
    def _comm_stream(self, zero: int, offload: bool) -> tuple:
        """The communication stream and the update of (``zero``, ``offload``), which no recomputation
        changes, computed once per pair: (collectives as :func:`_simulate` takes them, the update's
        seconds, offload's seconds, node -> host bytes, the collectives' seconds, ZeRO's change to them)."""
        hit = self._memo.get(("comm", zero, offload))
        if hit is not None:
            return hit
        m, model = self.machine, self.model
        nf = len(self.order)
        bidx = self._bidx
        # communication stream: (trigger (task, 0 start / 1 end), seq, seconds, needed by task or None)
        ops: list = []
        update = self.update_s
        host_bytes = host_moved = host_update = 0.0
        host_mem: dict = {}
        bucket: list = []
        cap = model.grad_bucket_bytes if model.grad_bucket_bytes > 0 else math.inf
        limit = [min(cap, model.first_bucket_bytes) if m.overlap_grad_sync else cap]

        def flush():
            if bucket:
                trig = max(b[0] for b in bucket)
                ops.append(((trig, 1), len(ops), sum(b[1] for b in bucket), None))
                bucket.clear()
                limit[0] = cap
            if ag_bucket:           # stages 1-2: the bucket's updated parameters, before the next forward reads them
                need = min(self.pos[b[1]] for b in ag_bucket)
                ag_ops.append((need, sum(b[0] for b in ag_bucket)))
                ag_bucket.clear()

        acc = 0.0
        units3: dict = {}           # stage 3: (unit, copy groups, bf16) -> [bytes, first consumer, last consumer]
        ag_bucket: list = []
        ag_ops: list = []           # (forward task needing it, seconds)
        fwd_gather: dict = {}
        bwd_gather: dict = {}
        for x in sorted(self.weights, key=lambda x: bidx.get(x.first, 0)):
            c = x.copies
            if c > 1 and x.sync > 0 or (c > 1 and zero >= 1):
                if zero >= 3:              # one collective per unit, copy groups and gather dtype, as the executor runs them
                    cur = units3.setdefault((x.unit, x.groups, x.low), [0.0, x.first, x.last])
                    cur[0] += x.nbytes
                    cur[1] = min(cur[1], x.first, key=lambda n: self.pos[n])
                    cur[2] = max(cur[2], x.last, key=lambda n: self.pos[n])
                else:
                    if zero >= 1:
                        t = self._coll(x.groups, x.nbytes)
                        bucket.append((bidx[x.first], t))
                        ag_bucket.append((t, x.first))     # the updated parameters, in the gradient's buckets
                    else:
                        bucket.append((bidx[x.first], x.sync))
                    acc += x.nbytes
                    if acc >= limit[0]:
                        flush()
                        acc = 0.0
            share = x.nbytes / c if zero >= 1 else x.nbytes
            if zero >= 1 or offload:
                update -= x.update
                if not offload:
                    update += model.update_time(share)
            if offload:               # the device's update of the shard, at the host's bandwidth
                for d in x.devices:   # states, the updated shard and its gradient, in the node's memory
                    nd = d // m.devices_per_node
                    host_mem[nd] = host_mem.get(nd, 0.0) + (self.states + 2) * share
                host_bytes += 2 * share
                host_moved += (3 + 2 * self.states) * share
                host_update += model.update_time(share)
        flush()
        # stage 3, per unit: the gradient's reduce-scatter when the backward passes the unit's first use
        # (the gather's backward); all-gathers before its forward and again before its backward
        for (u, groups, low), (nbytes, first, last) in units3.items():
            t = self._coll_once(groups, nbytes)
            nxt = bidx[first] + 1          # synchronous in the executor: the next backward task waits
            ops.append(((bidx[first], 1), len(ops), t, nxt if nxt < 2 * nf else None))
            tg = self._coll_once(groups, nbytes / 2) if low else t      # gathered in bf16: half the bytes
            for d in (fwd_gather, bwd_gather):
                cur = d.setdefault(u, [0.0, 0.0, first, last])
                cur[0] += tg
                cur[2] = min(cur[2], first, key=lambda n: self.pos[n])
                cur[3] = max(cur[3], last, key=lambda n: self.pos[n])
        for pos_, t in self.buffer_sync:
            ops.append(((2 * nf - 1 - pos_, 1), len(ops), t, None))
        # stages 1-2: every bucket's all-gather issued at the iteration's start (after the previous update)
        for need, t in sorted(ag_ops):
            ops.append(((-1, 0), len(ops), t, need))
        # stage 3: each unit gathered right before its first forward task and again before its first
        # backward task, the compute waiting (the executor's gathers are synchronous: no prefetch)
        for v in sorted(fwd_gather.values(), key=lambda v: self.pos[v[2]]):
            need = self.pos[v[2]]
            ops.append(((need - 1, 1), len(ops), v[0] + v[1], need))
        for v in sorted(bwd_gather.values(), key=lambda v: bidx[v[3]]):
            need = bidx[v[3]]
            ops.append(((need - 1, 1), len(ops), v[0] + v[1], need))
        comm_total = sum(o[2] for o in ops)
        zero_comm = comm_total - self.sync_s
        if abs(zero_comm) <= 1e-9 * max(comm_total, 1e-300):    # stages 1-2: reduce-scatter + all-gather = all-reduce
            zero_comm = 0.0
        off = 0.0
        if offload:
            host = m.links["host"]
            per_dev = m.host_mem_bandwidth / m.devices_per_node
            off = (host_bytes / host.bandwidth + 2 * host.latency + host_update
                   + host_moved * max(1.0 / per_dev - 1.0 / m.mem_bandwidth, 0.0))
        host_mem = {nd: int(math.ceil(b)) for nd, b in host_mem.items()}
        hit = self._memo[("comm", zero, offload)] = (sorted(ops, key=lambda o: (o[0], o[1])), update, off,
                                                     host_mem, comm_total, zero_comm)
        return hit

    def price(self, mem: MemoryPlan) -> Priced:
        """``mem`` priced on this mapping (:class:`Priced`).  Like every loop here it checks the deadline of
        the caller's scope (:func:`search.budget.within`): past it, :class:`search.budget.Expired`."""
        check()
        m, model = self.machine, self.model
        zero, offload = int(mem.zero), bool(mem.offload)
        if offload and not self.can_offload:
            offload = False
        assign = {n: (i, r.mode) for i, r in enumerate(mem.recompute) for n in r.nodes}
        # memory
        w, a, transient, free, bucket, bwd = self._memory(zero, offload, assign)
        per = {d: w.get(d, 0) - free.get(d, 0) + max(a.get(d, 0) + transient.get(d, 0),
                                                      free.get(d, 0) + bucket.get(d, 0), bwd.get(d, 0))
               for d in set(w) | set(a) | set(transient)}
        per = {d: int(math.ceil(b)) for d, b in per.items()}
        act = {d: a.get(d, 0) + transient.get(d, 0) for d in set(a) | set(transient)}
        report = MemoryReport(per, {d: int(b) for d, b in w.items()}, {d: int(b) for d, b in act.items()},
                              self.capacity)
        # compute stream
        times = self.recompute_times(assign)
        recompute = [(r, times.get(i, 0.0)) for i, r in enumerate(mem.recompute)]
        rec_s = sum(t for _, t in recompute)
        dur = list(self._dur)
        bidx = self._bidx
        for r, t in recompute:            # (the gathers feeding a region come after its nodes' backward)
            ps = [bidx[n] for n in r.nodes if n in bidx]
            if ps:
                dur[min(ps)] += t          # recomputed right before the region's backward starts
        ops, update, off, host_mem, comm_total, zero_comm = self._comm_stream(zero, offload)
        compute_total = sum(dur)
        if m.overlap_grad_sync:
            makespan = _simulate(dur, ops)
        else:
            makespan = compute_total + comm_total
        exposed = makespan - compute_total
        hidden = comm_total - exposed
        it = self.base_s - self.leaves_s + makespan + update + off
        host_mem = dict(host_mem)
        feasible = report.feasible
        reason = "" if feasible else "out of memory: " + report.reason()
        over = {nd: b for nd, b in host_mem.items() if b > m.host_memory_bytes}
        if over:
            nd = max(over, key=over.get)
            feasible = False
            reason = "; ".join(x for x in (reason, (
                f"out of host memory: offload puts {format_bytes(over[nd])} of optimizer states, parameter and "
                f"gradient shards in node {nd}'s host memory but it has {format_bytes(m.host_memory_bytes)}")) if x)
        return Priced(MemoryPlan(zero, offload, tuple(mem.recompute)), it, feasible, reason, report,
                      self.base_s, self.leaves_s, self.compute_s, self.comm_s, self.sync_s, zero_comm, rec_s,
                      update, self.update_s, off, hidden, exposed, self.n_units, m.overlap_grad_sync,
                      host_mem, m.host_memory_bytes)

    @property
    def can_offload(self) -> bool:
        return self.machine.has_host and self.states > 0 and bool(self.weights)

    # --- choosing -----------------------------------------------------------------------------------
    def choose(self, zero: Sequence[int] = (0, 1, 2, 3), offload: Sequence[bool] = (False, True),
               recompute: str = "auto", exact_limit: int = EXACT_LIMIT) -> Priced:
        zs = [z for z in zero if z == 0 or self.has_copies] or [min(zero)]
        offs = [o for o in offload if not o or self.can_offload] or [False]
        cands = []
        if recompute == "auto":
            # without recomputation first, fastest first: recomputing only adds time, so a (stage, offload)
            # whose plan without it is already slower than a feasible plan found cannot win
            firsts = sorted((self.price(MemoryPlan(z, o)) for z, o in product(zs, offs)),
                            key=lambda p: p.iteration_s)
            best = math.inf
            for p0 in firsts:
                check()
                got = [p0] if self._least_with_recompute(p0) > best else \
                    self._fit(p0.memory.zero, p0.memory.offload, exact_limit, p0)
                cands.extend(got)
                best = min([best] + [p.iteration_s for p in got if p.feasible])
        for z, o in product(zs, offs) if recompute != "auto" else ():
            if recompute in ("full", "selective"):
                cands.append(self.price(MemoryPlan(z, o, recompute_all(self.regions, recompute))))
            elif recompute == "none":
                cands.append(self.price(MemoryPlan(z, o)))
            else:
                raise ValueError(f"recompute must be auto, none, full or selective, got {recompute!r}")
        ok = [p for p in cands if p.feasible]
        if ok:
            return min(ok, key=lambda p: (p.iteration_s, p.memory.zero, p.memory.offload, len(p.memory.recompute)))
        return min(cands, key=lambda p: (p.max_bytes, p.iteration_s))

    def _fit(self, zero: int, offload: bool, exact_limit: int, p0: Priced | None = None) -> list:
        """Priced plans for one (stage, offload): no recomputation if it fits; else every assignment
        (few regions) or the greedy one.  ``p0``: the plan without recomputation, when priced already."""
        p0 = p0 if p0 is not None else self.price(MemoryPlan(zero, offload))
        if p0.feasible or not self.regions:
            return [p0]
        R = self.regions
        if len(R) <= exact_limit:
            out = [p0]
            for modes in product(MODES, repeat=len(R)):
                if all(x == "none" for x in modes):
                    continue
                check()
                regs = tuple(RecomputeRegion(tuple(r), md) for r, md in zip(R, modes) if md != "none")
                out.append(self.price(MemoryPlan(zero, offload, regs)))
            return out
        return [self._greedy(zero, offload, p0)]

    def _least_with_recompute(self, p0: Priced) -> float:
        """A lower bound on the iteration time of any plan of ``p0``'s (stage, offload) that fits: ``p0``'s
        own if it fits; else its compute stream grows by at least the recomputation that saves what the
        busiest device is over at the best bytes per second of any single region, where savings add up (its
        exposed communication may hide under that growth)."""
        if p0.feasible or not self.regions:
            return p0.iteration_s
        busiest = max(p0.report.per_device, key=p0.report.per_device.get)
        over = p0.report.per_device[busiest] - self.capacity
        rate = max((sv.get(busiest, 0) / max(t, 1e-12) for sv, t in self._single_savings().values()), default=0.0)
        if rate <= 0:
            return p0.iteration_s
        return p0.iteration_s - p0.exposed_sync_s + over / rate

    def _single_savings(self) -> dict:
        """(region, mode) -> (device -> activation bytes no longer kept, seconds of recomputation) of that
        region alone; ZeRO and offload change neither (computed once per mapping)."""
        single = getattr(self, "_single", None)
        if single is None:
            single = self._single = {}
            base_a = self.base_report.activations
            for i, r in enumerate(self.regions):
                check()
                for md in ("selective", "full"):
                    # bytes no longer kept (the transient of the largest region is paid once, not per region)
                    a, _ = self.activation_bytes({n: (i, md) for n in r})
                    single[(i, md)] = ({d: base_a.get(d, 0) - a.get(d, 0) for d in set(a)},
                                       self.recompute_time(r, md))
        return single

    def _greedy(self, zero: int, offload: bool, p0: Priced) -> Priced:
        """Regions one at a time (or selective -> full), the most bytes saved on the busiest device per
        second of recomputation first, until the plan fits or nothing saves more; where one step alone covers
        what is left over in no more seconds than the best-ratio step takes, the cheapest such step instead
        (steps are whole regions: the last step of a fit need not be the best ratio, a small region may
        finish it).  The steps
        whose savings (each region's alone, :meth:`_single_savings`) add up to what the busiest device is
        over are taken together and the plan priced once (the same steps as one at a time where savings add
        up).  Once it fits, :meth:`_trim` drops the steps it no longer needs."""
        R = self.regions
        single = self._single_savings()
        nR = len(R)
        # the steps, region by region, selective then full (flat index 2 i + mode - 1): seconds of each from
        # none, and of full from selective; the bytes each saves on the busiest device, per busiest device
        c1 = np.array([single[(i, "selective")][1] for i in range(nR)], dtype=float)
        c2 = np.array([single[(i, "full")][1] for i in range(nR)], dtype=float)
        c21 = c2 - c1
        st = np.zeros(nR, dtype=np.int8)            # 0 none, 1 selective, 2 full
        state: dict = {}
        cur = p0
        while not cur.feasible:
            check()
            busiest = max(cur.report.per_device, key=cur.report.per_device.get)
            over = cur.report.per_device[busiest] - self.capacity
            s1 = np.array([single[(i, "selective")][0].get(busiest, 0) for i in range(nR)], dtype=float)
            s2 = np.array([single[(i, "full")][0].get(busiest, 0) for i in range(nR)], dtype=float)
            s21 = s2 - s1
            added, saved_sum = 0, 0.0
            while saved_sum < over:
                left = over - saved_sum
                none, sel = st == 0, st == 1
                saved = np.empty(2 * nR)
                cost = np.empty(2 * nR)
                saved[0::2] = np.where(none, s1, 0.0)
                saved[1::2] = np.where(none, s2, np.where(sel, s21, 0.0))
                cost[0::2] = c1
                cost[1::2] = np.where(sel, c21, c2)
                ok = saved > 0
                if not ok.any():
                    break
                ratio = np.where(ok, saved / np.maximum(cost, 1e-12), -np.inf)
                best = int(np.argmax(ratio))        # the first of the best ratio, as a scan keeping the first
                best_saved, best_cost = float(saved[best]), float(cost[best])
                cov = ok & (saved >= left)
                if cov.any():                       # the cheapest step covering what is left (the first of them)
                    cc = np.where(cov, cost, np.inf)
                    cover = int(np.argmin(cc))
                    if cc[cover] < math.inf and cc[cover] <= best_cost:
                        best, best_saved = cover, float(saved[cover])
                i, md = divmod(best, 2)
                st[i] = md + 1
                state[i] = MODES[md + 1]
                added += 1
                saved_sum += best_saved
            if not added:
                break
            cur = self.price(MemoryPlan(zero, offload, self._regs(state)))
        return self._trim(zero, offload, state, cur) if cur.feasible else cur

    def _greedy_loop(self, zero: int, offload: bool, p0: Priced) -> Priced:
        """:meth:`_greedy` as a scan over every step (the reference the tests compare it with)."""
        R = self.regions
        single = self._single_savings()
        state: dict = {}
        cur = p0
        while not cur.feasible:
            check()
            busiest = max(cur.report.per_device, key=cur.report.per_device.get)
            over = cur.report.per_device[busiest] - self.capacity
            added, saved_sum = 0, 0.0
            while saved_sum < over:
                left = over - saved_sum
                best, best_ratio, best_saved, best_cost = None, 0.0, 0.0, 0.0
                cover, cover_cost, cover_saved = None, math.inf, 0.0
                for i in range(len(R)):
                    have = state.get(i, "none")
                    for md in ("selective", "full"):
                        if MODES.index(md) <= MODES.index(have):
                            continue
                        saved = single[(i, md)][0].get(busiest, 0)
                        cost = single[(i, md)][1]
                        if have != "none":
                            saved -= single[(i, have)][0].get(busiest, 0)
                            cost -= single[(i, have)][1]
                        if saved <= 0:
                            continue
                        ratio = saved / max(cost, 1e-12)
                        if ratio > best_ratio:
                            best, best_ratio, best_saved, best_cost = (i, md), ratio, saved, cost
                        if saved >= left and cost < cover_cost:
                            cover, cover_cost, cover_saved = (i, md), cost, saved
                if best is None:
                    break
                if cover is not None and cover_cost <= best_cost:
                    best, best_saved = cover, cover_saved
                state[best[0]] = best[1]
                added += 1
                saved_sum += best_saved
            if not added:
                break
            cur = self.price(MemoryPlan(zero, offload, self._regs(state)))
        return self._trim(zero, offload, state, cur) if cur.feasible else cur

    def _regs(self, state: Mapping[int, str]) -> tuple:
        return tuple(RecomputeRegion(tuple(self.regions[i]), md) for i, md in sorted(state.items()) if md != "none")

    def _trim(self, zero: int, offload: bool, state: dict, cur: Priced) -> Priced:
        """A feasible greedy plan with every step it can do without undone: each recomputed region, the
        costliest first (of equal costs, the latest in the forward first), one mode down (full -> selective ->
        none) while the plan still fits (savings on the peak need not add up, so an earlier step may have
        become unnecessary).

        A step is not priced where one like it failed since the plan last changed (:data:`TRIM_PREDICT`): a
        region of the same saving per device and recomputation seconds for the same modes (:meth:`_step_key`;
        a model's identical blocks), later in the forward.  Its activations are freed earlier in the
        backward, so the step down of the earlier region keeps the same bytes at least as long: where the later
        one did not fit, neither does it.  On a model of many identical layers the trim then prices a few
        steps per kind of region, not one per region (each price walks the whole graph)."""
        single = self._single_savings()
        at = self._region_starts()
        failed: dict = {}                 # step key -> the latest start of a region whose step failed
        for i in sorted(state, key=lambda i: (-single[(i, state[i])][1], -at[i])):
            while state.get(i, "none") != "none":
                check()
                lower = MODES[MODES.index(state[i]) - 1]
                key = self._step_key(single, i, state[i], lower)
                if TRIM_PREDICT and failed.get(key, -1) > at[i]:
                    self.trim_skipped += 1
                    break
                trial = dict(state)
                trial[i] = lower
                p = self.price(MemoryPlan(zero, offload, self._regs(trial)))
                if not p.feasible or p.iteration_s > cur.iteration_s:
                    failed[key] = max(failed.get(key, -1), at[i])
                    break
                state, cur = trial, p
                failed.clear()            # another plan: what failed before may fit now
        return cur

    def _region_starts(self) -> list:
        """Each recompute region's first position in the forward (the execution order)."""
        return [min((self.exec_pos.get(n, 0) for n in r), default=0) for r in self.regions]

    @staticmethod
    def _step_key(single: Mapping, i: int, mode: str, lower: str) -> tuple:
        """What region ``i``'s step down (``mode`` -> ``lower``) keeps again on each device and the seconds of
        recomputation it saves (:meth:`_single_savings`): equal for the same step of identical blocks."""
        now, t_now = single[(i, mode)]
        after, t_after = single[(i, lower)] if lower != "none" else ({}, 0.0)
        return (mode, lower, t_now - t_after,
                tuple(sorted((d, b - after.get(d, 0)) for d, b in now.items())))


_KEEPS_OUTPUT: dict = {}


def plain_report(weights: Mapping[int, float], activations: Mapping[int, float], capacity: int) -> MemoryReport:
    """The MemoryReport :func:`search.memory.memory_per_device` makes of a mapping's weight and activation
    bytes per device (``MemoryReport.weights`` / ``.activations`` of a mapping priced without techniques,
    or a pipeline stage's ``w`` / ``a``): the same dicts, the same sums."""
    per = {d: weights.get(d, 0) + activations.get(d, 0) for d in set(weights) | set(activations)}
    return MemoryReport(per, dict(weights), dict(activations), capacity)


def _op_keeps_output(op: str) -> bool:
    """Whether operator ``op`` saves its own output or a mask of it for its backward (memoized per name)."""
    hit = _KEEPS_OUTPUT.get(op)
    if hit is None:
        hit = _KEEPS_OUTPUT[op] = bool(op in SAVES_OUTPUT or (op in ops.REGISTRY and ops.saves(op) is not None
                                                               and ops.saves(op).mask))
    return hit


def _distinct(dicts: Sequence[dict]) -> tuple[list, list]:
    """The distinct dicts of ``dicts`` (by identity, in first-seen order) and each one's index among them."""
    if not SHARE_BLOCKS:
        return list(dicts), list(range(len(dicts)))
    seen: dict = {}
    uniq: list = []
    idx: list = []
    for b in dicts:
        j = seen.get(id(b))
        if j is None:
            j = seen[id(b)] = len(uniq)
            uniq.append(b)
        idx.append(j)
    return uniq, idx


def _simulate(dur: Sequence[float], ops: Sequence[tuple]) -> float:
    """Critical path of one compute stream (tasks in order, each waiting for the collectives it needs)
    and one communication stream (collectives in the order they are issued, each issued at its trigger:
    the start (0) or end (1) of a task; task -1 ends at time 0).  A trigger (task, which) is kept as the
    number ``2 task + which`` (the same order), and the stream is only entered where a collective is due."""
    ops = sorted(ops, key=lambda o: (o[0], o[1]))
    n = len(ops)
    trig = [2 * o[0][0] + o[0][1] for o in ops]
    need: dict = {}
    for j, o in enumerate(ops):
        if o[3] is not None:
            need.setdefault(o[3], []).append(j)
    start: list = [0.0] * len(dur)
    end: list = [0.0] * len(dur)
    op_end: list = [None] * n
    comm_free = 0.0
    k = 0

    def issue(upto: float) -> None:
        nonlocal k, comm_free
        while k < n and trig[k] <= upto:
            (ti, which), _, t, _ = ops[k]
            at = 0.0 if ti < 0 else (start[ti] if which == 0 else end[ti])
            s = max(comm_free, at)
            comm_free = s + t
            op_end[k] = comm_free
            k += 1

    issue(-1)
    prev = 0.0
    for i, d in enumerate(dur):
        s = prev
        js = need.get(i)
        if js:
            for j in js:
                if op_end[j] is None:      # cannot happen: a needed collective is triggered earlier
                    issue(trig[j])
                s = max(s, op_end[j])
        start[i] = s
        if k < n and trig[k] <= 2 * i:
            issue(2 * i)
        end[i] = s + d
        prev = end[i]
        if k < n and trig[k] <= 2 * i + 1:
            issue(2 * i + 1)
    issue(math.inf)
    return max(prev, comm_free)


# --- the public functions -------------------------------------------------------------------------------

def price(gc: GraphCost, views: Mapping[int, MachineView], mem: MemoryPlan | None, base: Any = None) -> Priced:
    """Price ``mem`` (None: no technique) on ``views``; ``base`` the mapping's cost (or MappingResult)."""
    return Techniques(gc, views, base).price(mem or MemoryPlan())


def choose(gc: GraphCost, views: Mapping[int, MachineView], base: Any = None, *, zero: Sequence[int] = (0, 1, 2, 3),
           offload: Sequence[bool] = (False, True), recompute: str = "auto",
           exact_limit: int = EXACT_LIMIT) -> tuple[MemoryPlan, Priced]:
    """The cheapest feasible MemoryPlan for ``views`` among the allowed options (see module docstring);
    when none fits, the one needing the least memory (``Priced.feasible`` False, ``reason`` says why)."""
    p = Techniques(gc, views, base).choose(zero, offload, recompute, exact_limit)
    return p.memory, p


def describe(p: Priced) -> list[str]:
    """One line per technique (explain)."""
    mem = p.memory
    out = []
    if mem.zero:
        out.append(f"ZeRO-{mem.zero}: optimizer states{', gradients' if mem.zero >= 2 else ''}"
                   f"{', parameters' if mem.zero >= 3 else ''} sharded over each weight's copies; collectives "
                   f"{p.zero_comm_s * 1e3:+.3f} ms beyond the all-reduces; update {p.base_update_s * 1e3:.3f} -> "
                   f"{p.update_s * 1e3:.3f} ms")
    if mem.recompute:
        n = sum(len(r.nodes) for r in mem.recompute)
        modes = sorted({r.mode for r in mem.recompute})
        out.append(f"recompute: {len(mem.recompute)} region(s), {n} operators ({'/'.join(modes)}): "
                   f"+{p.recompute_s * 1e3:.3f} ms")
    if mem.offload:
        out.append(f"offload: optimizer states and update in host memory: +{p.offload_s * 1e3:.3f} ms; host memory "
                   f"{format_bytes(p.host_max_bytes)} of {format_bytes(p.host_capacity)} on the fullest node")
    if p.overlap:
        out.append(f"overlap: {p.hidden_s * 1e3:.3f} ms of communication hidden by compute; "
                   f"exposed {p.exposed_sync_s * 1e3:.3f} ms")
    return out


__all__ = ["plain_report", "SELECTIVE_KEEP", "LAYOUT_OPS", "saves_nothing", "GATHER_OPS", "GATHERED_UNITS", "region_members",
           "MIN_REGION_OPS", "EXACT_LIMIT", "Priced", "Techniques", "regions", "recompute_all", "price", "choose",
           "describe", "format_bytes"]
