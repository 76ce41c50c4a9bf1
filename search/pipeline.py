"""Pipeline parallelism: 1F1B stages over a sequential cut of the PCG (Unity section 5, "Pipeline
parallelism"; the stage DP of Alpa, /work/shared/notes/alpa-oneflow.md).

A pipeline plan cuts the PCG, in topological order, into S contiguous *stages*; stage i runs on a
sub-mesh (a :class:`Resource`: whole nodes, or devices inside one node; the sub-meshes are laid out
left to right and cover the machine) with its own intra-stage parallelization; the mini-batch of B
samples is split into M micro-batches that flow through the stages under the 1F1B schedule
(PipeDream-Flush / Megatron-LM's non-interleaved schedule, with a synchronous weight update).

**The cost** (:func:`simulate_1f1b`).  Per micro-batch, stage i takes ``f_i`` forward and ``b_i``
backward; sending the activations to stage i+1 takes ``c_i`` (and the gradient back the same);
after its last backward a stage synchronizes its gradients and updates its weights once (``u_i``).
Stage i runs ``w_i = min(S-1-i, M)`` warm-up forwards, then alternates one forward and one backward,
then drains ``w_i`` backwards.  The makespan is computed by an event simulation of exactly that
order: an operation starts when its stage is free and its input has arrived (a forward needs the
previous stage's forward of the same micro-batch plus ``c``; a backward needs the next stage's
backward plus ``c``, or on the last stage its own forward); each direction of each inter-stage link
sends one message at a time, in micro-batch order.  Iteration time = max over stages of (end of its
last backward + ``u_i``).  For equal stages and free links this is the closed form
``(M + S - 1)(f + b) + u``; for unequal stages it is what the closed form only approximates.

**Per-micro-batch stage costs.**  The stage's sub-PCG is rebuilt at the micro-batch size
(:func:`rebatch`: every Input whose first dim is the batch B gets B/M, Reshape/Expand shapes follow),
parallelized by the ``intra`` hook (default: data parallel over the largest divisor of the
micro-batch that fits the stage's devices, :func:`search.baselines.data_parallel`; nothing on one
device) and mapped by :class:`search.mapping.MachineMapper` on the stage's Resource.  The mapping's
iteration time minus its gradient-sync and optimizer-update parts is ``f + b`` of one micro-batch
(split ``1 : backward_factor`` as the cost model prices backward); the sync and update parts are
``u`` (once per iteration).  Tensors produced by an earlier stage enter the stage graph as Inputs of
the same parallel shape (free for the mapping, counted in memory as the received activation).

**Inter-stage transfers.**  The tensors live across a cut (produced before it, read after it: a
tensor skipping a stage is relayed and counted on each link it crosses), at the micro-batch size,
spread evenly over the sending and the receiving stage's devices; the pieces move point to point
(:func:`search.collectives.transfer_time`, the slowest link level between the two sub-meshes).

**Memory per device** (1F1B): the weights, gradients and optimizer states of the stage's nodes plus
the activations of one micro-batch (what the backward keeps, :mod:`search.memory`) times the number
in flight, ``min(S - i, M)`` for stage i.  A plan whose busiest device does not fit is infeasible.

**The search** (:func:`search_pipeline`). The layers and the stage DP are the shared ones of
:mod:`unity_pcg.search.stages`. Layers (:func:`sequential_layers`): at most ``max_layers`` contiguous runs of
units (a node with its placement chains) cut where the fewest activation tensors cross (the single-tensor
bottlenecks of a chain), never across a trained weight read on both sides, of about equal FLOPs. For each
number of micro-batches M (:func:`_micro_batch_candidates`), every layer is priced alone on every candidate
sub-mesh size (a repeated layer once); a stage's price is the sum of its layers'. The stage DP (Alpa's Eq.
3-4; :func:`_stage_dp`) then, for each bound ``t_max`` on a stage's time (ascending, stopping once ``M *
t_max`` reaches the best estimate), finds for every stage count S the partition of layers and devices (blocks
laid out left to right, each a :class:`Resource`) minimizing ``sum_i (t_i + 2 c_i + lam * u_i)`` with every
``t_i <= t_max`` and every stage fitting in memory with its micro-batches in flight, once with ``lam = 1`` and
once with ``lam = 0`` (the updates run after each stage's last backward, overlapping the drain of the earlier
stages, so neither their sum nor nothing is right); each plan found is estimated by the 1F1B simulation on the
layer prices. The best few per (S, M) are priced exactly (each stage's whole sub-PCG mapped on its actual
sub-mesh, the simulation), the best estimate of every stage count and one stage with one micro-batch always;
the fastest feasible one is stitched into one PCG. A test holds the result within 5% of every pipeline priced
exactly on small cases.

**Memory techniques** (when the mapper prices them, ``MachineMapper(techniques=True)``, or
``techniques=True``).  Every layer and stage is priced by :func:`stage_techniques` with a recompute mode on
all its regions and the plan's ZeRO stage (:mod:`search.memtech`): the recompute forward runs in the stage's
backward, ``once`` is the sync left exposed by the machine's overlap plus the (sharded) update, the memory
is the weights part with ZeRO plus the kept activations times the micro-batches in flight.  The stage DP's
options are (sub-mesh, recompute mode) pairs, so every stage gets its own recomputation jointly with its
layers and devices; the ZeRO stage is one per plan (:data:`PIPELINE_ZERO`).  The plans priced exactly
refine it (:func:`stage_partial`): a stage given a mode recomputes only the regions its micro-batches in
flight need, so 1F1B's first stage (most in flight) recomputes more than the last.  The DP's memory table
counts a layer's non-additive memory (its backward's own peak, ``StagePrice.tr``) once per stage.  The result's ``memory_plan``
(ZeRO and every stage's regions on the stitched PCG) is the plan file's ``memory``.

**The plan.**  :attr:`PipelineResult.pcg` is the whole model at the full batch: every stage's
parallel sub-PCG, its boundary Inputs replaced by the producing stage's tensor (directly when the
parallel shapes agree, else through Reduce / Combine to one piece and the receiving stage's own
Partition / Replicate chain, all placed on the receiving stage's devices).  Node ids grow stage by
stage, so each stage is contiguous in the PCG's topological order.  :meth:`PipelineResult.to_plan_field`
is the plan file's ``pipeline`` field (schedule, micro_batches, stages with nodes and devices).
:func:`by_rules` reaches the same plan by the shipped rules (the stages are a mapping decision; the PCG
inside them is rules), with the sequence to record and replay: data parallel stages by the dp rules,
Megatron stages by :func:`search.realize.realize`.

**Intra-stage hooks.**  :func:`default_intra` (data parallel), :func:`megatron_intra` (Megatron-LM's
tensor parallelism inside the stage with the vocabulary-parallel head, data parallel across: the layout
the stage search prices, reached by rules through :func:`by_rules`) and :func:`ilp_intra` (the label ILP of
:mod:`search.alpa.intra` on the stage's sub-mesh, as the layout proposals solve the whole graph).

**Stage layouts and layerings as choices** (``search_pipeline(layouts=..., clusterings=...)``).  Further hooks
are alternatives to ``intra``: each stage DP option is also offered under each of them, so a stage's layout is
chosen by price with its layers, devices and recomputation; the layering (:func:`layerings`: Unity's
fewest-crossing cuts, Alpa's Eq. 6) is a choice too.  ``intra`` alone is searched first, as without layouts
(half the soft budget); then all layouts on the (micro-batch count, layering) pairs it tried, the most promising
first, within :data:`search.budget.PIPELINE_LAYOUTS_SHARE` of the time to the hard deadline (a layout past it is not offered on a
layer; the first pass's plans stay).  Exact prices start with the best plan of ``intra`` alone; the result is
the fastest plan that stitches and that ``accept`` does not refuse.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import reduce
from math import gcd
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec, MachineView, Resource
from unity_pcg.pcg import PCG
from unity_pcg.plan import PIPELINE_SCHEDULE, validate_pipeline_field  # noqa: F401 (re-exported)

from . import collectives as C
from .budget import PIPELINE_LAYOUTS_SHARE, Deadline, Expired, current, within
from .baselines import GraphMemo, StrategyError, data_parallel
from .cost import CostModel, GraphCost
from .mapping import MachineMapper
from .memory import node_memory
from .stages import (Cuts, PipelineError, analyze, cluster, may_cross, stage_dp, structure_key, sub_mesh,
                     t_max_bounds)

INF = math.inf
SCHEDULE = PIPELINE_SCHEDULE
MAX_BOUNDS = 48                         # stage-time bounds the DP tries per number of micro-batches
TIE = 1e-3                              # stage DP: relative cost difference below which the smaller max wins
#: recomputation a stage may run (every region of the stage in one mode, chosen per stage)
STAGE_RECOMPUTE = ("none", "selective", "full")
#: ZeRO stages of a pipeline plan (one for the plan, over each stage's copies): the executor runs 1-2 with
#: several stages, and sums the micro-batches' full gradients before its reduce-scatter, so stage 2 holds
#: what stage 1 holds and is not tried; 3 and offload it refuses with several stages
PIPELINE_ZERO = (0, 1)

# --- the 1F1B schedule ---------------------------------------------------------------------------

def schedule_1f1b(stages: int, i: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which stage ``i`` of ``stages`` runs its operations: ``("F", m)`` / ``("B", m)``.
    Warm-up forwards (``min(S-1-i, M)``), then one forward and one backward alternately, then the
    remaining backwards."""
    S, M = stages, micro_batches
    w = min(S - 1 - i, M)
    out = [("F", m) for m in range(w)]
    for k in range(M - w):
        out.append(("F", w + k))
        out.append(("B", k))
    out.extend(("B", m) for m in range(M - w, M))
    return out


def in_flight(stages: int, i: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``i`` holds at once under 1F1B: ``min(S - i, M)``."""
    return min(stages - i, micro_batches)


@dataclass(frozen=True)
class Timeline:
    makespan: float
    finish: tuple[float, ...]                 # per stage: end of its last backward + its update
    ops: dict                                 # (stage, "F"/"B", m) -> (start, end)

    def busy(self, i: int) -> float:
        return sum(e - s for (st, _, _), (s, e) in self.ops.items() if st == i)


def simulate_1f1b(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int,
                  send: Sequence[float] | None = None, send_back: Sequence[float] | None = None,
                  once: Sequence[float] | None = None) -> Timeline:
    """Event simulation of 1F1B (see module docstring).  ``fwd[i]`` / ``bwd[i]``: seconds per
    micro-batch on stage i; ``send[i]``: activation transfer stage i -> i+1 (``S - 1`` values);
    ``send_back[i]``: gradient transfer stage i+1 -> i (default ``send``); ``once[i]``: gradient
    sync + update of stage i after its last backward."""
    S, M = len(fwd), int(micro_batches)
    if S < 1 or M < 1 or len(bwd) != S:
        raise ValueError("simulate_1f1b needs at least one stage, one micro-batch and bwd per stage")
    send = list(send) if send is not None else [0.0] * (S - 1)
    back = list(send_back) if send_back is not None else list(send)
    once = list(once) if once is not None else [0.0] * S
    if len(send) != S - 1 or len(back) != S - 1 or len(once) != S:
        raise ValueError("send / send_back need S - 1 values, once S")
    order = [schedule_1f1b(S, i, M) for i in range(S)]
    ptr = [0] * S
    free = [0.0] * S
    arr_f = [[None] * M for _ in range(S)]   # activation m available at stage i
    arr_b = [[None] * M for _ in range(S)]   # gradient m available at stage i
    fend = [[None] * M for _ in range(S)]
    link_f = [0.0] * max(S - 1, 0)
    link_b = [0.0] * max(S - 1, 0)
    rec: dict = {}
    left = sum(len(o) for o in order)
    while left:
        moved = False
        for i in range(S):
            while ptr[i] < len(order[i]):
                kind, m = order[i][ptr[i]]
                if kind == "F":
                    dep = 0.0 if i == 0 else arr_f[i][m]
                else:
                    dep = fend[i][m] if i == S - 1 else arr_b[i][m]
                if dep is None:
                    break
                start = max(free[i], dep)
                end = start + (fwd[i] if kind == "F" else bwd[i])
                free[i] = end
                rec[(i, kind, m)] = (start, end)
                if kind == "F":
                    fend[i][m] = end
                    if i < S - 1:
                        s0 = max(end, link_f[i])
                        link_f[i] = s0 + send[i]
                        arr_f[i + 1][m] = s0 + send[i]
                elif i > 0:
                    s0 = max(end, link_b[i - 1])
                    link_b[i - 1] = s0 + back[i - 1]
                    arr_b[i - 1][m] = s0 + back[i - 1]
                ptr[i] += 1
                left -= 1
                moved = True
        if not moved:  # pragma: no cover - 1F1B cannot deadlock
            raise AssertionError("1F1B simulation deadlocked")
    finish = tuple(free[i] + once[i] for i in range(S))
    return Timeline(max(finish), finish, rec)


# --- graph surgery ---------------------------------------------------------------------------------

def batch_size(g: PCG) -> int:
    """The batch: the first dim of the first Input of rank >= 1 (topological order)."""
    for n in g.sources("Input"):
        sh = g.shapes(n.id)[0]
        if sh.rank:
            return sh.sizes[0]
    raise PipelineError("the model has no Input with a batch dimension")


#: per graph (by identity) its rebatched forms, stage sub-PCGs and stages laid out by the intra hooks
#: (:func:`megatron_intra`): the tuned grids, the floors and the pipeline search ask for them again
STAGE_MEMO = GraphMemo(16, errors=(StrategyError, PipelineError))


def rebatch(g: PCG, old: int, new: int) -> PCG:
    """The same PCG (same node ids, same parallelization) at batch ``new``: every Input whose first
    dim is ``old`` gets ``new``; a Reshape whose input shrank or grew scales its first target dim; an
    Expand whose first target dim was ``old`` follows.  Raises PipelineError where shapes do not
    follow (a degree no longer divides, a Reshape that cannot be rescaled) or where an operator would
    mean something else at ``new`` (:func:`broadcast_change`: a micro-batch of 1 broadcasting against a
    batch-sized tensor that does not follow the batch).  Built once per graph and batches
    (:data:`STAGE_MEMO`)."""
    if old == new:
        return g
    return STAGE_MEMO.get(g, ("rebatch", old, new), lambda: _rebatch(g, old, new))


def _rebatch(g: PCG, old: int, new: int) -> PCG:
    b = PCG.builder(g.weights)
    r = Fraction(new, old)
    try:
        for n in g.nodes():
            a = a0 = n.a
            ins = list(n.inputs)
            if n.op == "Input" and a["shape"] and a["shape"][0] == old:
                a = {**a, "shape": (new,) + tuple(a["shape"][1:])}
            elif n.op == "Reshape":
                before, after = g.shape(n.inputs[0]).numel, b.shape(ins[0]).numel
                if before != after:
                    s0 = Fraction(a["shape"][0]) * Fraction(after, before)
                    if s0.denominator != 1:
                        raise PipelineError(f"{n.label()}: Reshape to {list(a['shape'])} cannot follow "
                                            f"a batch of {new}")
                    a = {**a, "shape": (int(s0),) + tuple(a["shape"][1:])}
            elif n.op == "Expand" and a["shape"] and a["shape"][0] == old and r != 1:
                a = {**a, "shape": (new,) + tuple(a["shape"][1:])}
            if a is a0:       # the same operator on the same shapes: the same outputs, else inferred
                same = all(b.shape(x) == g.shape(x) for x in ins)
                b.add_like(n, ins, nid=n.id, outputs=g.shapes(n.id) if same else None)
            else:
                b.add_node(n.op, a, ins, n.name, nid=n.id)
    except PipelineError:
        raise
    except UnityError as e:
        raise PipelineError(f"batch {new}: {e}") from None
    b.set_outputs(g.outputs)
    b.meta = dict(g.meta)
    h = b.finish()
    why = broadcast_change(g, h)
    if why is not None:
        raise PipelineError(f"batch {new}: {why}")
    return h


def broadcast_change(g: PCG, h: PCG) -> str | None:
    """Why ``h`` (``g`` at another batch, same node ids) is not the same computation on fewer or more
    samples; None when it is.  Every compute operator's dims are grouped by its labels (one label: one
    axis the operator runs along, DESIGN "Operator spec"), read at the larger of the two batches, where a
    size-1 dim is a true broadcast; a dim *follows the batch* when its size differs between the two.  A
    label with a dim that follows and one that does not is a batch-sized tensor that does not come from
    the batch (a constant folded at export) meeting one that does: at a micro-batch of 1 the sizes still
    broadcast, but the operator then spreads one sample over the constant's rows.  A size-1 operand that
    broadcasts (its own label) never counts: it needs no split, whatever the other operand's batch."""
    big, small = (g, h) if batch_size(g) >= batch_size(h) else (h, g)
    for n in big.nodes():
        if n.kind != "compute":
            continue
        ins_b, outs_b = big.input_shapes(n.id), big.shapes(n.id)
        ins_s, outs_s = small.input_shapes(n.id), small.shapes(n.id)
        key = (n.op, n.attrs, tuple(ins_b), tuple(outs_b), tuple(ins_s), tuple(outs_s))
        try:
            mixed = _MIXED.get(key)
        except TypeError:                 # an attribute that cannot be a key (an array)
            key, mixed = None, None
        if mixed is None:
            mixed = _mixed_labels(n, ins_b, outs_b, ins_s, outs_s)
            if key is not None:
                if len(_MIXED) >= 1 << 16:
                    _MIXED.clear()
                _MIXED[key] = mixed
        if mixed:
            return (f"{n.label()}: {n.op} reads a batch-sized tensor that does not follow the batch beside one "
                    f"that does (a constant folded at the exported batch?); the micro-batch would broadcast "
                    f"against it")
    return None


#: memo of :func:`_mixed_labels` (a function of its key): a model's repeated blocks are checked once
_MIXED: dict = {}


def _mixed_labels(n, ins_b, outs_b, ins_s, outs_s) -> bool:
    """Whether a label of ``n`` has a dim that follows the batch and one that does not (:func:`broadcast_change`)."""
    lab = ops.get_op(n.op).labels(n.a, ins_b, [s.sizes for s in outs_b])
    follows: dict = {}
    for labels, sb, ss in zip(tuple(lab.inputs) + tuple(lab.outputs), tuple(ins_b) + tuple(outs_b),
                              tuple(ins_s) + tuple(outs_s)):
        for l, a, c in zip(labels, sb.sizes, ss.sizes):
            follows.setdefault(l, set()).add(a != c)
    return any(len(f) > 1 for f in follows.values())


# --- what the executor can micro-batch and send between stages (shared with executor/pipeline.py) -------

def logical_graph(g: PCG) -> tuple[PCG, dict]:
    """``g`` without parallel operators (on one device they move nothing); returns it and the map from a
    parallel operator's output to the tensor it stands for."""
    b = g.edit()
    alias: dict = {}
    for n in g.nodes():
        if n.kind == "parallel":
            src = tuple(n.inputs[0])
            src = alias.get(src, src)
            alias[(n.id, 0)] = src
    for n in g.nodes():
        if n.kind != "parallel":
            new = tuple(alias.get(tuple(r), tuple(r)) for r in n.inputs)
            if new != tuple(tuple(r) for r in n.inputs):
                b.set_inputs(n.id, new)
    b.set_outputs([alias.get(tuple(r), tuple(r)) for r in g.outputs])
    for n in g.nodes():
        if n.kind == "parallel":
            b.remove(n.id)
    return b.finish(), alias


def micro_graph(g: PCG, M: int) -> PCG:
    """The logical graph of ``g`` on micro-batch pieces: every model Input partitioned ``M`` ways on dim 0,
    every Weight copied ``M`` ways, each operator inferred on those parallel shapes.  THE test of whether
    the batch can be split into ``M`` micro-batches, for the pipeline search and the executor alike
    (``executor/pipeline.py::check_pipeline`` calls it): degrees, unlike sizes, follow which dims come from
    the batch, so a batch-sized tensor that does not (a constant folded at export, e.g. BLOOM's ALiBi mask
    index of shape [B, ...]) meets a split one and is refused -- :func:`rebatch` only changes sizes, and a
    micro-batch of 1 broadcasts silently against it.  Compute nodes keep their ids.  Raises PipelineError.
    Built once per graph and ``M`` (:data:`STAGE_MEMO`)."""
    return STAGE_MEMO.get(g, ("micro", M), lambda: _micro_graph(g, M))


def _micro_graph(g: PCG, M: int) -> PCG:
    lg, _ = logical_graph(g)
    if M == 1:
        return lg
    b = lg.edit()
    try:
        pairs: dict = {}
        for n in lg.sources():
            if n.op == "Input" and not n.a["shape"]:
                continue
            op, attrs = ("Partition", {"dim": 0, "degree": M}) if n.op == "Input" else ("Replicate", {"degree": M})
            pairs[(n.id, 0)] = b.add(op, attrs, [(n.id, 0)])
        b.replace_uses_many(pairs, exclude=[p[0] for p in pairs.values()])
        return b.finish()
    except UnityError as e:
        raise PipelineError(f"the pipeline's micro-batches cannot run through the model: {e}") from None


def batch_split_error(g: PCG, nid: int, K: int) -> str | None:
    """Why compute node ``nid`` is not data parallel ``K`` ways as the executor runs a data-parallel stage
    (every tensor it reads or writes split K ways on dim 0 and nowhere else, or whole and copied K ways);
    None when it is.  Shared with executor/pipeline.py (``_check_batch_split``)."""
    for s in tuple(g.input_shapes(nid)) + tuple(g.shapes(nid)):
        split = bool(s.dims) and s.dims[0].degree == K and all(d.degree == 1 for d in s.dims[1:]) \
            and s.copy_degree == 1
        copied = all(d.degree == 1 for d in s.dims) and s.copy_degree == K
        if s.sum_degree != 1 or not (split or copied):
            return f"shape {s}"
    return None


def executor_replicas(stage_pcgs: Sequence[PCG]) -> int:
    """R, the blocks every micro-batch must split into for stages with these parallel sub-PCGs: the least
    common multiple of their data-parallel degrees when every stage is data parallel inside (each compute
    operator one degree K, :func:`batch_split_error` clean; the executor lays each stage's micro-batch out
    K ways), else 1 (the stage graphs' own shape inference decides).  The batch must then split into M x R
    pieces (:func:`micro_graph`)."""
    Ks = []
    for P in stage_pcgs:
        K = None
        for n in P.nodes():
            if n.kind != "compute":
                continue
            pm = ops.infer(n.op, n.a, P.input_shapes(n.id)).piece_map
            d = pm.degree if pm is not None else 1
            if K is None:
                K = d
            if d != K or (K > 1 and batch_split_error(P, n.id, K) is not None):
                return 1
        Ks.append(K or 1)
    return math.lcm(*Ks) if Ks else 1


def sequential_layers(g: PCG, roles: Mapping[int, str], max_layers: int) -> tuple[list, Cuts]:
    """Unity's layers: at most ``max_layers`` contiguous runs of units cut where the fewest tensors cross,
    each boundary as near its FLOP quantile as the cuts allow (``balance="cuts"``: runs of layers then make
    balanced stages for every stage count dividing the layer count), no FLOP bound
    (:func:`unity_pcg.search.stages.cluster`).  Returns ``(layers, info)``: per layer the unit indices
    ``(first, last + 1)``; the units in order and, per cut between units, the refs crossing it and whether
    it may be cut."""
    return _clustered(g, roles, max_layers, cuts="fewest", inputs=False, delta=None, balance="cuts")


def _clustered(g: PCG, roles: Mapping[int, str], max_layers: int, **kw) -> tuple[list, Cuts]:
    """:func:`unity_pcg.search.stages.cluster` of ``g`` by its own roles, once per graph and arguments
    (:data:`STAGE_MEMO`: the tuned floors, gradient accumulation and the stage search cluster the same graph;
    on a decoder of 80 layers each clustering is a second on a starved core), its units' analysis shared."""
    if roles != g.roles():
        return cluster(g, roles, max_layers, **kw)
    info = STAGE_MEMO.get(g, ("cuts",), lambda: analyze(g, roles))
    key = ("layers", int(max_layers), tuple(sorted(kw.items())))
    return STAGE_MEMO.get(g, key, lambda: cluster(g, roles, max_layers, info=info, **kw))


def stage_graph(g: PCG, roles: Mapping[int, str], nodes: Iterable[int]) -> PCG:
    """The sub-PCG of ``nodes`` (non-source nodes of one stage, with their placement chains): the
    sources and placement chains they read are copied, every tensor produced outside (an earlier
    stage's activation) becomes an Input of the same parallel shape (an Input, then Partition /
    Replicate), named ``pipe:<producer id>:<output>``.  Node ids of copied nodes are kept; its
    outputs are the tensors later stages read and the graph outputs among ``nodes``.  ``roles``: ``g``'s;
    built once per graph and nodes (:data:`STAGE_MEMO`)."""
    nodes = tuple(nodes)
    return STAGE_MEMO.get(g, ("stage", nodes), lambda: _stage_graph(g, roles, nodes))


def _stage_graph(g: PCG, roles: Mapping[int, str], nodes: tuple) -> PCG:
    inside = set(nodes)
    b = PCG.builder(g.weights)
    m: dict = {}
    nxt = [max(g.node_ids(), default=-1) + 1]

    def fresh(op, attrs, ins, name=""):
        nid = b.add_node(op, attrs, ins, name, nid=nxt[0])
        nxt[0] = nid + 1
        return (nid, 0)

    def ensure(r):
        r = tuple(r)
        if r in m:
            return m[r]
        nid = r[0]
        role = roles[nid]
        if nid in inside or role in ("input", "weight", "input-placement", "weight-placement"):
            n = g.node(nid)
            ins = [ensure(x) for x in n.inputs]
            # a copy reading the same shapes computes the same ones (inference is a function of them)
            same = all(b.shape(x) == g.shape(r) for x, r in zip(ins, n.inputs))
            b.add_like(n, ins, nid=nid, outputs=g.shapes(nid) if same else None)
            for k in range(len(g.shapes(nid))):
                m[(nid, k)] = (nid, k)
            return m[r]
        sh = g.shape(r)
        if sh.sum_degree > 1:
            raise PipelineError(f"tensor {g.node(nid).label()}:{r[1]} crosses a stage boundary as partial sums")
        ref = fresh("Input", {"name": f"pipe:{nid}:{r[1]}", "shape": sh.sizes, "dtype": sh.dtype}, [],
                    name=f"pipe:{nid}:{r[1]}")
        for dim, deg in enumerate(sh.degrees):
            if deg > 1:
                ref = fresh("Partition", {"dim": dim, "degree": deg}, [ref])
        if sh.copy_degree > 1:
            ref = fresh("Replicate", {"degree": sh.copy_degree}, [ref])
        m[r] = ref
        return ref

    for nid in g.topo_order():
        if nid in inside:
            ensure((nid, 0))
    outs = []
    gouts = {tuple(r) for r in g.outputs}
    for nid in g.topo_order():
        if nid not in inside:
            continue
        for k in range(len(g.shapes(nid))):
            uses = [c for c, _ in g.consumers((nid, k))]
            if (nid, k) in gouts or any(c not in inside for c in uses):
                outs.append((nid, k))
    if not outs:
        outs = [(max(inside, key=lambda n: g.topo_order().index(n)), 0)]
    b.set_outputs(outs)
    b.meta = dict(g.meta)
    return b.finish()


def default_intra(stage: PCG, resource: Resource) -> PCG:
    """Data parallel over the largest divisor of the micro-batch that fits the stage's devices
    (outputs left batch-partitioned); the stage as given when it is already parallel or has one
    device."""
    d = _dp_degree(stage, resource.size)
    if d <= 1:
        return stage
    try:
        return data_parallel(stage, d, combine_outputs=False)
    except StrategyError:
        return stage


def megatron_intra(devices_per_node: int, head: bool = True, sp: bool = False) -> Callable[[PCG, Resource], PCG]:
    """An ``intra`` hook: Megatron-LM's tensor parallelism inside the stage (the column -> row Linear
    groups of :func:`search.baselines.megatron_groups` at the largest tensor degree t dividing
    ``devices_per_node`` and the stage's devices that splits them, data parallel across) and, with
    ``head``, the vocabulary-parallel head of Megatron-LM: every dense Linear outside the groups whose
    output leaves the stage (a GPT's LM head) is column-parallel at degree t too, its output left split on
    the features (the loss is computed where each piece lives; a next stage reshards what it reads).
    Without it such a Linear runs on every one of the t copies with its weight copied t times (GPT-15B
    on 32 A100s: 254.6 s -> 229.9 s per iteration, below Alpa's 231.2 s).  Unlike the ``megatron``
    strategy a stage need not hold an attention block (a pipeline layer may hold only a Transformer's
    MLP).  A stage with no group that takes the split is data parallel (:func:`default_intra`).  ``sp``:
    with Megatron-LM's sequence parallelism (:func:`search.baselines.megatron`'s ``sequence_parallel``;
    the head reads an all-gathered input like a group)."""
    from .baselines import _Rebuild, _divisors_desc, _is_dense, megatron_groups

    def hook(stage: PCG, resource: Resource) -> PCG:
        key = ("megatron_intra", devices_per_node, head, sp, resource.size)    # all it reads of the resource
        return STAGE_MEMO.get(stage, key, lambda: lay_out(stage, resource))

    def lay_out(stage: PCG, resource: Resource) -> PCG:
        if resource.size <= 1 or any(n.kind == "parallel" for n in stage.nodes()):
            return default_intra(stage, resource)
        groups = megatron_groups(stage)
        wl = stage.weight_like()
        outs = {tuple(r)[0] for r in stage.outputs}
        in_groups = set().union(*(gr.starts | gr.terms | gr.nodes for gr in groups)) if groups else set()
        heads = {n.id for n in stage.nodes() if head and n.op == "Linear" and n.id in outs
                 and n.id not in in_groups and _is_dense(stage, n, wl)} if head else set()
        for tp in _divisors_desc(gcd(devices_per_node, resource.size)):
            dp = resource.size // tp
            chosen, starts, terms = [], set(), set()
            for gr in groups:                 # non-conflicting groups, as the megatron strategy takes them
                if gr.starts & terms or gr.terms & starts:
                    continue
                chosen.append(gr)
                starts |= gr.starts
                terms |= gr.terms
            extra = {h for h in heads if stage.shapes(h)[0].sizes[-1] % tp == 0}
            while chosen or extra:
                col = frozenset().union(*(gr.starts for gr in chosen), extra)
                try:
                    inside = frozenset().union(*(gr.nodes | gr.starts for gr in chosen), extra)
                    r = _Rebuild(stage, "megatron", dp=dp, tp=tp, column=col, sp=sp, inside=inside)
                except StrategyError:         # the micro-batch does not divide by dp
                    break
                bad = set(r.fallback_ids)
                keep = [gr for gr in chosen if not (gr.nodes | gr.starts | gr.terms) & bad
                        and all(r.row_input_degree.get(t) == tp for t in gr.terms)]
                ok = {h for h in extra if h not in bad}
                if len(keep) == len(chosen) and ok == extra:
                    if not chosen and not extra:
                        break
                    return r.finish(degree=resource.size, tp=tp, dp=dp, sp=bool(sp),
                                    column=sorted(stage.node(s).label() for gr in chosen for s in gr.starts),
                                    row=sorted(stage.node(t).label() for gr in chosen for t in gr.terms),
                                    vocab_parallel=sorted(stage.node(h).label() for h in extra))
                chosen, extra = keep, ok
        return default_intra(stage, resource)
    hook.__name__ = f"megatron_intra_{devices_per_node}{'_head' if head else ''}{'_sp' if sp else ''}"
    if not sp:                     # by_rules: its rule-built twin (none with sequence parallelism)
        hook.megatron = {"devices_per_node": devices_per_node, "head": head}
    return hook


def ilp_intra(machine: MachineSpec, optimizer: str = "adam", precision: str = "fp32", time_limit_s: float = 30.0,
              idle: bool = True, memory_budget: float | None = None,
              batch: int | None = None, sharded_update: bool = False) -> Callable[[PCG, Resource], PCG]:
    """An ``intra`` hook: the stage laid out by the label ILP of :func:`search.alpa.intra.solve_intra` on its
    sub-mesh, as the layouts phase lays out the whole graph (:mod:`search.layouts`): the logical mesh is the
    sub-mesh's own shape (whole nodes x the devices of a node, or 1 x its devices inside a node), from its
    first device of ``machine``.  ``idle``: operators may leave a mesh axis unused (the proposals' space).  The plan's views
    are dropped: :func:`_price` maps the laid-out stage by the machine-mapping DP, as every stage.  Raises
    UnityError (the stage is then not offered on that sub-mesh: an infinite price) on one device (the
    data-parallel layout is the same), a parallel stage, no plan, or the deadline of the thread's scope
    (:func:`search.budget.current`) passed; each solve is bounded by that deadline and ``time_limit_s``.
    The hook remembers its layouts per stage (its nodes) and sub-mesh; with ``hook.reuse`` set (the search's
    cheap pass, :func:`search_pipeline`) the same stage at another micro-batch size gets that layout rebatched
    (:func:`rebatch`; solved anew where a degree no longer divides) instead of a new solve.  ``memory_budget``:
    the ILP's memory rows (:func:`search.layouts.propose`; ``math.inf`` where the memory techniques are priced:
    the fastest layout, which they and the stage's micro-batches in flight then make fit or not).  ``batch``:
    the global batch: a stage at a micro-batch of ``b`` is one of ``batch / b`` micro-batches, whose gradient
    sync and update the ILP weighs at that share, and ``sharded_update`` (:func:`search.alpa.intra.solve_intra`)."""
    from .alpa.intra import solve_intra
    solved: dict = {}           # (the stage's nodes, its sub-mesh) -> (laid-out PCG, its batch)

    def hook(stage: PCG, resource: Resource) -> PCG:
        if resource.size <= 1:
            raise UnityError("one device: the stage's data-parallel layout")
        if any(n.kind == "parallel" for n in stage.nodes()):
            raise UnityError("the stage is already parallel")
        try:
            b = batch_size(stage)
        except PipelineError:
            b = None
        key = (tuple((n.id, n.op, n.name) for n in stage.nodes()), resource.start, resource.nodes,
               resource.per_node)
        hit = solved.get(key)
        if hit is not None and b is not None and (hook.reuse or hit[1] == b):
            try:            # the layout solved for this stage at another micro-batch size (or this one)
                return rebatch(hit[0], hit[1], b)
            except UnityError:          # a degree no longer divides: solved anew
                pass
        dl = current()
        limit = time_limit_s
        at = None
        if dl is not None:
            if dl.passed():
                raise Expired("the layout ILP of a stage: deadline passed")
            limit = max(min(limit, dl.left()), 0.05)
            at = dl.at if dl.clock is time.monotonic else None
        mesh = (resource.nodes, resource.per_node) if resource.nodes > 1 else (1, resource.size)
        plan = solve_intra(stage, machine, mesh, start=resource.start, optimizer=optimizer,
                           precision=precision, price=False, deadline=at, time_limit_s=limit, idle=idle,
                           memory_budget=memory_budget, micro_batches=batch // b if batch and b else 1,
                           sharded_update=sharded_update)
        if plan.pcg is None:
            raise UnityError(f"the layout ILP on {mesh[0]}x{mesh[1]}: {plan.status}")
        if b is not None:
            if len(solved) > 4096:
                solved.clear()
            solved[key] = (plan.pcg, b)
        return plan.pcg
    hook.__name__ = "ilp_intra"
    hook.layout = "ilp"
    hook.reuse = False
    return hook


def layout_name(hook, resource: Resource | None = None) -> str:
    """A stage layout's name for reports: ``data parallel``, ``Megatron``, ``ILP AxB`` or the hook's name."""
    if hook is default_intra:
        return "data parallel"
    if getattr(hook, "layout", None) == "ilp":
        if resource is None:
            return "ILP"
        mesh = (resource.nodes, resource.per_node) if resource.nodes > 1 else (1, resource.size)
        return f"ILP {mesh[0]}x{mesh[1]}"
    if getattr(hook, "megatron", None) is not None:
        return "Megatron"
    return getattr(hook, "__name__", "intra")


def _dp_degree(stage: PCG, size: int) -> int:
    """The degree :func:`default_intra` uses (1: the stage as given)."""
    if any(n.kind == "parallel" for n in stage.nodes()):
        return 1
    g0 = 0
    for n in stage.sources("Input"):
        sh = stage.shapes(n.id)[0]
        if sh.rank:
            g0 = gcd(g0, sh.sizes[0])
    return max((k for k in range(1, min(size, g0) + 1) if g0 % k == 0), default=1) if g0 else 1


# --- results ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineStage:
    nodes: tuple[int, ...]            # node ids of PipelineResult.pcg, topological order
    devices: tuple[int, ...]
    resource: Resource
    layers: tuple[int, int]           # first layer, last layer + 1
    fwd_s: float                      # per micro-batch
    bwd_s: float
    once_s: float                     # gradient sync + optimizer update, once per iteration
    send_s: float                     # activations to the next stage per micro-batch (0 on the last)
    in_flight: int
    memory_bytes: int                 # busiest device of the stage

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "devices": list(self.devices), "layers": list(self.layers),
                "fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "once_s": self.once_s, "send_s": self.send_s,
                "in_flight": self.in_flight, "memory_bytes": self.memory_bytes}


@dataclass
class PipelineResult:
    cost: float                       # predicted iteration time (s), the 1F1B makespan; inf if infeasible
    feasible: bool
    reason: str
    micro_batches: int
    stages: tuple[PipelineStage, ...]
    pcg: PCG | None                   # the whole model at the full batch, stages stitched
    views: dict                       # node id of pcg -> MachineView
    memory: dict                      # device -> bytes
    capacity: int
    search_s: float = 0.0
    stats: dict = field(default_factory=dict)
    comm_elements: int = 0            # elements sent by all devices per iteration
    rules: tuple | None = None        # RuleSteps reaching ``pcg`` from the logical model (see by_rules)
    origin: dict | None = field(default=None, repr=False)   # what by_rules needs: stages' nodes of the model
    memory_plan: Any = None           # MemoryPlan on ``pcg`` (ZeRO, each stage's recompute regions), or None
    techniques: dict = field(default_factory=dict)   # zero, recompute mode and seconds per stage (when priced)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def max_memory_bytes(self) -> int:
        return max(self.memory.values(), default=0)

    def to_plan_field(self) -> dict:
        """The plan file's ``pipeline`` field."""
        return {"schedule": SCHEDULE, "micro_batches": self.micro_batches,
                "stages": [{"nodes": list(s.nodes), "devices": list(s.devices)} for s in self.stages]}

    def to_json(self) -> dict:
        return {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.reason, "micro_batches": self.micro_batches,
                "stages": [s.to_json() for s in self.stages], "max_memory_bytes": self.max_memory_bytes,
                "comm_elements": self.comm_elements, "search_s": self.search_s, "stats": dict(self.stats),
                **({"techniques": dict(self.techniques)} if self.techniques else {})}


# --- pricing ---------------------------------------------------------------------------------------

@dataclass
class StagePrice:
    t: float                          # fwd + bwd per micro-batch
    once: float                       # gradient sync + optimizer update, once per iteration
    w: dict                           # device -> bytes of weights + grads + states
    a: dict                           # device -> bytes of activations of one micro-batch
    views: dict                       # node id of pcg -> view
    pcg: PCG | None                   # the stage's parallel sub-PCG (micro-batch size)
    outputs: tuple = ()               # the original refs its outputs stand for, in order
    reason: str = ""
    a_in: dict = field(default_factory=dict)   # device -> bytes of ``a`` that are the stage's received inputs
    rec: float = 0.0                  # of ``t``: the recompute forward (in the backward), with techniques
    tr: dict = field(default_factory=dict)     # device -> of ``w``: recomputation's transient peak (once a stage)
    memory_plan: Any = None           # the techniques priced in (MemoryPlan on ``pcg``), None: priced without
    tech: dict = field(default_factory=dict, repr=False)   # (mode, zero) -> StagePrice; "analysis" -> Techniques


def _failed(reason: str) -> StagePrice:
    return StagePrice(INF, 0.0, {}, {}, {}, None, (), reason)


def _price(mapper: MachineMapper, sg: PCG, intra, res: Resource, memo: dict | None = None) -> StagePrice:
    """Parallelize the stage sub-PCG ``sg`` with ``intra`` for ``res`` and map it on the smallest block
    of ``res`` (from its first device) that holds its largest degree: a data-parallel stage of degree
    d < |res| leaves the other devices idle either way, and the mapping then costs a d-device search,
    not a |res|-device one.  ``memo`` shares results between parallel sub-PCGs of the same structure
    (names ignored) on blocks of the same size."""
    try:
        P = intra(sg, res)
    except UnityError as e:
        return _failed(str(e))
    if len(P.outputs) != len(sg.outputs):
        raise PipelineError(f"the intra hook returned {len(P.outputs)} outputs for a stage with "
                            f"{len(sg.outputs)}; it must keep the outputs and their order")
    machine = mapper.machine
    deg = _max_degree(P)
    if deg > res.size:
        return StagePrice(INF, 0.0, {}, {}, {}, P, tuple(sg.outputs),
                       f"the stage needs {deg} devices, its sub-mesh has {res.size}")
    D = machine.devices_per_node
    size = deg if deg <= D else -(-deg // D) * D
    block = sub_mesh(machine, res.start, min(size, res.size)) or res
    key = None
    if memo is not None:
        key = (structure_key(P), block.size, block.start % D if block.nodes == 1 else 0)
        hit = memo.get(key)
        if hit is not None:
            return hit
    # the same laid-out stage (the hooks keep theirs, STAGE_MEMO) on the same block: priced once
    out = STAGE_MEMO.get(P, ("price", mapper, block, tuple(tuple(x) for x in sg.outputs)),
                         lambda: _map_stage(mapper, sg, P, block))
    if key is not None:
        memo[key] = out
    return out


def _map_stage(mapper: MachineMapper, sg: PCG, P: PCG, block: Resource) -> StagePrice:
    r = mapper.optimize(P, block, techniques=False)   # sync and update are priced once by the pipeline
    if r.memory is None or not r.views:
        out = StagePrice(INF, 0.0, {}, {}, {}, P, tuple(sg.outputs), r.reason or "no machine view fits the stage")
    else:
        b = r.breakdown
        total = r.cost if math.isfinite(r.cost) else b.time   # out of memory at one micro-batch: priced anyway
        once = b.sync + b.update
        gc = GraphCost(P, mapper.model)
        a_in: dict = {}
        for nid in gc.nodes():
            if gc.role[nid] == "input-placement" and nid in r.views:
                for d, v in node_memory(gc, nid, r.views[nid])[1].items():
                    a_in[d] = a_in.get(d, 0) + v
        out = StagePrice(max(total - once, 0.0), once, dict(r.memory.weights), dict(r.memory.activations),
                      dict(r.views), P, tuple(tuple(x) for x in sg.outputs), a_in=a_in)
    return out


def _max_degree(g: PCG) -> int:
    """The most devices any node of ``g`` runs on: every tensor of an operator has one piece per task,
    so it is the largest piece count of any output."""
    return max((s.piece_count for n in g.nodes() if n.kind != "source" for s in g.shapes(n.id)), default=1)


def stage_techniques(mapper: MachineMapper, p: StagePrice, mode: str, zero: int) -> StagePrice:
    """``p`` (one stage or layer at the micro-batch size) priced with memory techniques
    (:mod:`search.memtech`): recomputation ``mode`` (``none`` / ``selective`` / ``full``) on every region of
    its sub-PCG and ZeRO stage ``zero`` over its weights' data-parallel copies, the machine's overlap of the
    gradient sync included.  ``t`` gains the recompute forward (run in the backward, ``rec``), ``once`` is
    the rest of memtech's iteration beyond the compute (the sync left exposed, the -- sharded -- update,
    ZeRO's collectives), ``a`` the activations one micro-batch keeps with the recomputation and ``w`` the
    weights, gradients and states with ZeRO (memtech's per-device peak split by differences, as the tuned
    baseline prices its stages).  Memoized on ``p``; a failed price is returned as is."""
    if p.pcg is None or not p.views or not math.isfinite(p.t):
        return p
    key = (mode, zero)
    hit = p.tech.get(key)
    if hit is not None:
        return hit
    from unity_pcg.plan import MemoryPlan
    from . import memtech
    tq = _analysis(mapper, p)
    k = ("priced", mode, zero)
    if k not in p.tech:
        regs = memtech.recompute_all(tq.regions, mode) if mode != "none" else ()
        p.tech[k] = tq.price(MemoryPlan(zero=zero, recompute=tuple(regs)))
    out = _with_priced(p, tq, p.tech[k])
    p.tech[key] = out
    return out


def _analysis(mapper: MachineMapper, p: StagePrice):
    """``p``'s :class:`search.memtech.Techniques` (built once, kept in ``p.tech``)."""
    from . import memtech
    tq = p.tech.get("analysis")
    if tq is None:
        # the stage's memory without techniques is its mapping's (``w``, ``a``) unless techniques priced it
        report = memtech.plain_report(p.w, p.a, mapper.machine.device.usable_bytes) \
            if p.memory_plan is None and not p.rec else None
        tq = p.tech["analysis"] = memtech.Techniques(GraphCost(p.pcg, mapper.model), p.views, p.t + p.once,
                                                     report=report)
    return tq


def _with_priced(p: StagePrice, tq, full) -> StagePrice:
    """``p`` with memtech's price ``full`` of one MemoryPlan on its sub-PCG (see :func:`stage_techniques`)."""
    kept, tr = tq.activation_bytes({n: (i, r.mode) for i, r in enumerate(full.memory.recompute) for n in r.nodes})
    base = tq.base_report.activations
    devs = set(p.w) | set(p.a) | set(full.per_device)
    # kept activations of one micro-batch with the recomputation; the rest of memtech's peak (weights,
    # gradients, states with ZeRO, the recomputation's transient) does not grow with the micro-batches in flight
    a = {d: int(max(p.a.get(d, 0) + kept.get(d, 0) - base.get(d, 0), 0)) for d in devs}
    w = {d: int(max(full.per_device.get(d, 0) - a[d], 0)) for d in devs}
    # of ``w``, what does not add up over the layers of a stage (``tr``, counted once per stage by the stage DP's
    # memory table): all but the weights, gradients and optimizer states -- the recomputation's transient and
    # the backward's own peak (activation gradients alive, a weight gradient whole, the loss's outputs)
    static = full.report.weights
    tr = {d: int(min(max(w[d] - static.get(d, 0), 0), w[d])) for d in w}
    tr = {d: v for d, v in tr.items() if v > 0}
    t = p.t + full.recompute_s
    return replace(p, t=t, once=max(full.iteration_s - t, 0.0), w=w, a=a, rec=full.recompute_s,
                   memory_plan=full.memory, tech={}, tr=tr)


def _stage_peak(p: StagePrice, infl: int) -> dict:
    """Per device: the weights part plus ``infl`` micro-batches' activations (1F1B's in-flight memory)."""
    return {d: p.w.get(d, 0) + infl * p.a.get(d, 0) for d in set(p.w) | set(p.a)}


def stage_partial(mapper: MachineMapper, p: StagePrice, infl: int, zero: int, cap: float) -> StagePrice | None:
    """``p`` (a stage without techniques) with only the recomputation it must do to hold ``infl``
    micro-batches in flight within ``cap`` per device, at ZeRO ``zero`` -- AdaPipe's per-stage choice at the
    granularity of memtech's regions, where :func:`stage_techniques` recomputes every region one way.
    Greedily (as ``memtech.Techniques.choose``): regions and modes (none -> selective -> full) by bytes saved
    on the fullest device, times ``infl``, per second of recomputation, the last step the cheapest that covers
    what is left where it costs no more than the best ratio's; then each step undone, the costliest first,
    while it still fits.  None when nothing fits (or ``p`` has no regions); memoized on ``p``."""
    if p.pcg is None or not p.views or not math.isfinite(p.t):
        return None
    key = ("partial", infl, zero, cap)
    if key in p.tech:
        return p.tech[key]
    from unity_pcg.plan import MemoryPlan, RecomputeRegion
    from . import memtech
    tq = _analysis(mapper, p)
    R = tq.regions
    modes = memtech.MODES
    single = tq._single_savings()
    memo: dict = {}

    def at(state: dict) -> StagePrice:
        k = tuple(sorted((i, m) for i, m in state.items() if m != "none"))
        if k not in memo:
            regs = tuple(RecomputeRegion(tuple(R[i]), m) for i, m in k)
            memo[k] = _with_priced(p, tq, tq.price(MemoryPlan(zero=zero, recompute=regs)))
        return memo[k]

    def over(sp: StagePrice) -> tuple:
        peak = _stage_peak(sp, infl)
        d = max(peak, key=peak.get) if peak else None
        return (peak[d] - cap if d is not None else 0.0), d

    state: dict = {}
    cur = at(state)
    left, dev = over(cur)
    out = None
    while R:
        if left <= 0:
            out = cur
            break
        best, best_ratio, best_cost, cover, cover_cost = None, 0.0, 0.0, None, math.inf
        for i in range(len(R)):
            have = state.get(i, "none")
            for md in ("selective", "full"):
                if modes.index(md) <= modes.index(have):
                    continue
                saved = single[(i, md)][0].get(dev, 0) - (single[(i, have)][0].get(dev, 0) if have != "none" else 0)
                cost = single[(i, md)][1] - (single[(i, have)][1] if have != "none" else 0)
                saved *= infl
                if saved <= 0:
                    continue
                ratio = saved / max(cost, 1e-12)
                if ratio > best_ratio:
                    best, best_ratio, best_cost = (i, md), ratio, cost
                if saved >= left and cost < cover_cost:
                    cover, cover_cost = (i, md), cost
        if best is None:
            break
        if cover is not None and cover_cost <= best_cost:
            best = cover
        state[best[0]] = best[1]
        cur = at(state)
        left, dev = over(cur)
    if out is not None:
        for i in sorted(state, key=lambda i: -single[(i, state[i])][1] if state[i] != "none" else 0):
            while state.get(i, "none") != "none":
                trial = dict(state)
                trial[i] = modes[modes.index(state[i]) - 1]
                q = at(trial)
                if over(q)[0] > 0 or q.t + q.once > out.t + out.once:
                    break
                state, out = trial, q
    p.tech[key] = out
    return out


def stage_modes(mapper: MachineMapper, p: StagePrice) -> tuple[str, ...]:
    """The recompute modes worth pricing on ``p``: ``none``, and the others where it has regions."""
    if p.pcg is None or not p.views or not math.isfinite(p.t):
        return ("none",)
    stage_techniques(mapper, p, "none", 0)
    return STAGE_RECOMPUTE if p.tech["analysis"].regions else ("none",)


def _sizes(machine: MachineSpec, max_stages: int) -> list[int]:
    """Sub-mesh sizes the DP tries: divisors and powers of two inside a node (unless the machine has
    more than 64 devices and at least two nodes per stage: that keeps the DP's device states to
    whole nodes); whole nodes (every count up to 8 nodes, beyond that powers of two,
    the machine, and the machine over each stage count)."""
    D, N = machine.devices_per_node, machine.nodes
    part = {k for k in range(1, D + 1) if D % k == 0} | {1 << k for k in range(D.bit_length()) if 1 << k <= D}
    if N >= 2 * max_stages and N * D > 64:   # large machines: every stage has whole nodes
        part = {D}
    if N <= 8:
        whole = set(range(1, N + 1))
    else:
        whole = {1 << k for k in range(N.bit_length()) if 1 << k <= N} | {N}
        whole |= {N // s for s in range(1, max_stages + 1) if N % s == 0}
    return sorted(part | {n * D for n in whole})


def stage_transfer(machine: MachineSpec, src: Sequence[int], dst: Sequence[int], nbytes: float) -> float:
    """Point-to-point moves of a tensor of ``nbytes`` spread evenly over ``src`` to ``dst``: sender
    i holds [i/p, (i+1)/p) of it, receiver j needs [j/q, (j+1)/q)."""
    if nbytes <= 0 or not src or not dst:
        return 0.0
    p, q = len(src), len(dst)
    moves = []
    for i, s in enumerate(src):
        for j, d in enumerate(dst):
            lo, hi = max(Fraction(i, p), Fraction(j, q)), min(Fraction(i + 1, p), Fraction(j + 1, q))
            if hi > lo:
                moves.append((s, d, float(hi - lo) * nbytes))
    return C.transfer_time(machine, moves)


def crossing_bytes(g: PCG, refs: Iterable) -> float:
    return float(sum(g.shape(r).nbytes for r in refs))


# --- the search ------------------------------------------------------------------------------------

def _micro_batch_candidates(B: int, micro_batches, max_stages: int) -> list[int]:
    """The numbers of micro-batches tried: the given ones, else the divisors of the batch that are
    powers of two up to 8 x max_stages (the bubble is then below 1/9 of the iteration for equal stages),
    the batch itself if it is within that bound (one sample per micro-batch), and the smallest other
    divisors where that makes fewer than four."""
    if micro_batches is not None:
        ms = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
        for m in ms:
            if not isinstance(m, int) or isinstance(m, bool) or m < 1 or B % m:
                raise PipelineError(f"micro-batch count {m!r} does not divide the batch {B}")
        return sorted(set(ms))
    top = 8 * max(1, max_stages) if max_stages > 1 else 1
    divs = [m for m in range(1, min(B, top) + 1) if B % m == 0]
    out = {m for m in divs if m & (m - 1) == 0}
    if B <= top:
        out.add(B)
    for m in divs:                      # an odd batch: a few other divisors
        if len(out) >= 4:
            break
        out.add(m)
    return sorted(out)


def micro_batch_candidates(B: int, max_stages: int = 4) -> list[int]:
    """The numbers of micro-batches :func:`search_pipeline` tries by default for a batch of ``B`` and up to
    ``max_stages`` stages (when the graph has at least that many layers and devices)."""
    return _micro_batch_candidates(B, None, max_stages)


def search_pipeline(pcg: PCG, mapper_or_cost_model: MachineMapper | CostModel, *, max_stages: int = 4,
                    min_stages: int = 1, micro_batches: int | Sequence[int] | None = None,
                    budget_s: float | None = None, intra: Callable[[PCG, Resource], PCG] | None = None,
                    max_layers: int = 12, candidates: int = 2, max_exact: int = 8,
                    deadline: Deadline | None = None, techniques: bool | None = None,
                    layouts: Sequence[Callable[[PCG, Resource], PCG]] = (),
                    accept: Callable[[PipelineResult], str | None] | None = None,
                    clusterings: Sequence[str] = ("fewest",), near: int | None = None) -> PipelineResult | None:
    """The fastest 1F1B pipeline plan of ``pcg`` found by the stage DP (see module docstring).

    ``pcg`` is logical or parallel (a parallel one keeps its parallelization inside each stage under
    the default ``intra``).  ``intra(stage_pcg, resource)`` returns the parallelization of a stage's
    sub-PCG (at the micro-batch size) for its sub-mesh, computing the same outputs in the same order;
    default :func:`default_intra`.  It is called once per distinct layer structure, sub-mesh size and
    number of micro-batches (layer prices are reused for layers of the same structure, so a hook
    should depend on the structure and the resource only), and once per stage of each plan priced
    exactly.  ``micro_batches``: one count or several (default: the powers of two dividing the batch
    up to 8 x max_stages, :func:`_micro_batch_candidates`).  Stage counts from ``min_stages`` to
    ``max_stages`` (one stage is no pipeline: gradient accumulation over M micro-batches).
    ``budget_s`` bounds the search (at least one number of micro-batches is searched; the best plan
    found so far is returned).  ``candidates``: DP plans kept per stage count and number of
    micro-batches; the best estimate of every stage count and up to ``max_exact`` in all are priced
    exactly.  ``deadline`` (:class:`search.budget.Deadline`) is a hard stop, checked by every solve (the
    stage DP's layer prices, the exact prices): past it the best plan priced exactly so far is returned
    (None if none; ``stats["cut"]``).  Returns the fastest feasible plan, else the fastest infeasible one
    (``feasible`` False, with the reason), or None when the graph has no split into ``min_stages`` stages.
    ``techniques``: choose memory techniques per stage jointly with the stages (:func:`_stage_dp`; the plan's
    ``memory_plan``); default: as the mapper prices mappings (``MachineMapper(techniques=...)``).

    ``layouts``: further intra hooks (e.g. :func:`ilp_intra`), alternatives to ``intra``: a stage's layout is
    one more option of the stage DP beside its sub-mesh and recompute mode (every layer priced under every
    layout, memoized per layer structure x sub-mesh x micro-batch count), so each stage gets the layout
    its price picks; the plan records them (``stats["stage_layouts"]``).  ``accept(result)``: why the caller
    cannot use a stitched result (None: it can; e.g. the executor's pre-launch check); the plans priced
    exactly are then stitched best first until one is accepted (``stats["refused"]`` lists the others).
    ``clusterings``: the layerings the stage DP runs on, each a choice the plans compete over (:func:`layerings`:
    ``"fewest"``, Unity's cuts where the fewest tensors cross; ``"valid"``, Alpa's Eq. 6 over every valid cut,
    which splits side-by-side branches); every layering of the first micro-batch count is searched.
    ``near``: a micro-batch count a plan priced elsewhere found fast (a tuned floor's pipeline): the counts are
    tried nearest it first, and it is tried among the default counts (else about two per stage first)."""
    with within(deadline):
        return _search_pipeline(pcg, mapper_or_cost_model, max_stages, min_stages, micro_batches, budget_s, intra,
                                max_layers, candidates, max_exact, techniques, layouts, accept, clusterings, near)


def layerings(g: PCG, roles: Mapping[int, str], max_layers: int, clusterings: Sequence[str] = ("fewest",)
              ) -> list[tuple[list, Cuts]]:
    """The distinct layerings of ``clusterings`` (the shared :func:`unity_pcg.search.stages.cluster`):
    ``"fewest"`` is :func:`sequential_layers`; ``"valid"`` Alpa's operator clustering (Eq. 6: every valid cut,
    the largest input of a layer minimized under a FLOP bound).  A layering equal to an earlier one is dropped."""
    return [(lay, info) for _, lay, info in _layerings(g, roles, max_layers, clusterings)]


def _layerings(g, roles, max_layers, clusterings) -> list[tuple[str, list, Cuts]]:
    out: list = []
    for c in clusterings:
        if c == "fewest":
            lay, info = _clustered(g, roles, max_layers, cuts="fewest", inputs=False, delta=None, balance="cuts")
        elif c == "valid":
            lay, info = _clustered(g, roles, max_layers, cuts="valid", inputs=True, delta=0.5)
        else:
            raise PipelineError(f"clustering must be 'fewest' or 'valid', got {c!r}")
        if all(lay != x[1] for x in out):
            out.append((c, lay, info))
    return out


def _search_pipeline(pcg, mapper_or_cost_model, max_stages, min_stages, micro_batches, budget_s, intra,
                     max_layers, candidates, max_exact, techniques=None, layouts=(), accept=None,
                     clusterings=("fewest",), near=None) -> PipelineResult | None:
    t0 = time.perf_counter()
    if budget_s is not None and budget_s <= 0:
        raise PipelineError(f"pipeline search budget must be positive, got {budget_s}")
    mapper = mapper_or_cost_model if isinstance(mapper_or_cost_model, MachineMapper) \
        else MachineMapper(mapper_or_cost_model)
    machine = mapper.machine
    intra = intra or default_intra
    hooks = (intra,) + tuple(h for h in layouts if h is not intra)
    passes = [hooks] if len(hooks) == 1 else [hooks[:1], hooks]
    if techniques is None:
        techniques = bool(getattr(mapper, "default_techniques", False))
    # the soft budget is read on the clock of the hard deadline when there is one (a test's clock)
    clock = (current() or Deadline.never(time.perf_counter)).clock
    deadline = clock() + budget_s if budget_s is not None else INF
    roles = GraphCost(pcg, mapper.model).role
    named = _layerings(pcg, roles, max_layers, clusterings or ("fewest",))
    lys = [(ly, inf) for _, ly, inf in named]
    layers, info = lys[0]
    L = max(len(x[0]) for x in lys)
    T = machine.num_devices
    max_stages = max(1, min(max_stages, L, T))
    if min_stages > max_stages:
        return None
    B = batch_size(pcg)
    sizes = _sizes(machine, max_stages)
    stats: dict = {"layers": L, "layer_units": [list(x) for x in layers], "priced": 0, "exact": 0,
                   "micro_batches_tried": []}
    if len(lys) > 1:
        stats["layerings"] = [[list(x) for x in ly] for ly, _ in lys]
    nodes_of = [[[n for u in range(a, b) for n in inf.units[u]] for a, b in ly] for ly, inf in lys]
    memo: dict = {}
    graphs: dict = {}
    cands: list = []
    # under a budget the counts most likely to pay come first: about two micro-batches per stage, or those
    # nearest a count the caller found fast
    ms = _micro_batch_candidates(B, micro_batches, max_stages)
    if near is not None and micro_batches is None and 1 <= near <= B and B % near == 0 and near not in ms:
        ms.append(near)
    aim = near if near is not None and near >= 1 else 2 * max_stages
    ms = sorted(ms, key=lambda m: (abs(math.log2(m) - math.log2(aim)), m))
    lys_all = list(range(len(lys)))

    def dp_pass(M, hs_, which, soft):
        for li in which:
            ly, inf = lys[li]
            lay = _LayerPrices(graphs[M], roles, nodes_of[li], mapper, hs_, machine, memo)
            found = _stage_dp(lay, inf, ly, graphs[M], machine, sizes, T, M, min_stages, min(max_stages, len(ly)),
                              soft, candidates, clock, techniques)
            for est, plan, tech, hs in found:
                cands.append((est, len(plan), M, plan, tech, tuple(hooks.index(hs_[h]) for h in hs), li))

    # first ``intra`` alone, every micro-batch count the budget allows (half of it when further layouts follow),
    # on every layering
    soft_a = deadline if len(hooks) == 1 or not math.isfinite(deadline) else clock() + (deadline - clock()) / 2
    # a count whose stage DP found no plan at all (no stages hold their micro-batches in flight) rules out the
    # smaller counts: fewer, larger micro-batches never need less activation memory on a stage
    no_plan: list = []
    for M in ms:
        if cands and clock() > soft_a:
            stats["budget_exhausted"] = True
            break
        if any(M < f for f in no_plan):
            stats.setdefault("micro_batches_skipped", []).append(M)
            continue
        try:
            graphs[M] = rebatch(pcg, B, B // M)
            micro_graph(pcg, M)       # the executor's test: the batch, and only it, splits M ways
        except PipelineError as e:
            stats.setdefault("micro_batches_refused", {})[M] = str(e)
            continue
        stats["micro_batches_tried"].append(M)
        first = len(stats["micro_batches_tried"]) == 1
        n0 = len(cands)
        try:
            dp_pass(M, hooks[:1], lys_all, soft_a if cands and not first else INF)
        except Expired:                 # the hard deadline: the plans found so far are priced (if time is left)
            stats["cut"] = True
            break
        if len(cands) == n0:
            no_plan.append(M)
    # then with the further layouts (their layer prices added to the first pass's) on the (micro-batch count,
    # layering) pairs tried, the most promising first (the first pass's best estimate), until the soft budget
    # (the first pair past it too) and within PIPELINE_LAYOUTS_SHARE of the time left to the hard deadline (the rest is
    # the exact prices'): a deadline keeps what the first pass found
    if len(hooks) > 1 and not stats.get("cut"):
        est_of: dict = {}
        for c in cands:
            est_of[(c[2], c[6])] = min(est_of.get((c[2], c[6]), INF), c[0])
        pairs = sorted(est_of, key=est_of.__getitem__)
        hard = current()
        stop = Deadline(hard.clock() + PIPELINE_LAYOUTS_SHARE * hard.left(), hard.clock) \
            if hard is not None and math.isfinite(hard.at) else None
        t1 = time.perf_counter()
        reusing = [h for h in hooks[1:] if hasattr(h, "reuse")]
        fresh: set = set()

        def layouts_pass(M, li, reuse, soft):
            for h in reusing:
                h.reuse = reuse
            try:
                dp_pass(M, hooks, [li], soft)
            finally:
                for h in reusing:
                    h.reuse = False
            stats.setdefault("layouts_tried", []).append([M, named[li][0]] + (["reused"] if reuse else []))
            if not reuse:
                fresh.add((M, li))
        try:
            with within(stop):
                # the most promising pair solved; the others priced with those layouts where the hooks can
                # reuse them (else solved, within the soft budget)
                for n, (M, li) in enumerate(pairs):
                    reuse = bool(n and reusing and any(x[1] == li for x in fresh))   # same layers, solved
                    if n and not reuse and clock() > deadline:
                        stats["layouts_budget_exhausted"] = True
                        continue
                    layouts_pass(M, li, reuse, INF if n == 0 else deadline)
                # then the pairs solved anew, best estimate first, while the time lasts
                while reusing and (stop is None or not stop.passed()):
                    best_pair = min(((c[0], (c[2], c[6])) for c in cands if any(c[5]) and (c[2], c[6]) not in fresh),
                                    default=None)
                    if best_pair is None:
                        break
                    layouts_pass(*best_pair[1], False, INF)
        except Expired:
            stats["layouts_cut"] = True
        stats["layouts_s"] = time.perf_counter() - t1
    stats["dp_s"] = time.perf_counter() - t0
    stats["priced"] = len(memo)
    # exact prices, most promising first: at least the best per stage count, then while an estimate
    # is within 25% of the best exact makespan (at most max_exact)
    # (one stage with one micro-batch, the plain intra plan on the whole machine, is always priced)
    cands.sort(key=lambda c: c[:3])
    uniq: dict = {}
    for c in cands:                     # a plan found by both passes: once
        uniq.setdefault((c[2], c[3], c[4], c[5], c[6]), c)
    cands = list(uniq.values())
    if len(hooks) > 1:      # the best plan of ``intra`` alone first: a hard deadline while pricing the others keeps it
        own = next((c for c in cands if not any(c[5])), None)
        if own is not None:
            cands.remove(own)
            cands.insert(0, own)
    done: list = []
    best = None
    seen: set = set()
    for est, S, M, plan, tech, hs, li in cands:
        layers, info = lys[li]
        must = S not in seen or (S == 1 and M == 1 and (1, 1) not in seen)
        if best is not None and not must and (stats["exact"] >= max_exact or est > 1.25 * best[0][1]
                                              or clock() > deadline):
            continue
        seen.update({S, (S, M)})
        te = time.perf_counter()
        try:
            ev = _evaluate(graphs[M], roles, info, layers, plan, M, mapper, [hooks[h] for h in hs], machine, memo,
                           tech, partial=True)
        except Expired:
            stats["cut"] = True
            break
        ev["estimate"] = est
        stats["exact"] += 1
        stats.setdefault("exact_priced", []).append(
            [S, M, [layout_name(hooks[h]) for h in hs], round(est, 6), round(ev["makespan"], 6) if math.isfinite(
                ev["makespan"]) else None, round(time.perf_counter() - te, 3)])
        rank = (not ev["feasible"], ev["makespan"], S, M)
        done.append((rank, M, plan, ev, hs, li))
        if best is None or rank < best[0]:
            best = (rank, M, plan, ev)
    if best is None:
        return None
    # the fastest plan whose stages join into one PCG and that the caller accepts (``accept``), else the fastest
    done.sort(key=lambda x: x[0])
    result, first, refused = None, None, []
    for rank, M, plan, ev, hs, li in done:
        layers, info = lys[li]
        r = assemble(pcg, graphs[M], plan, M, ev, machine)
        used = [hooks[h] for h in hs]
        r.origin = _origin(layers, info, plan, ev, all(h is default_intra for h in used))
        megatron = [getattr(h, "megatron", None) for h in used]
        r.origin.update(max_layers=max_layers, megatron=megatron[0] if all(megatron) else None,
                        tech=ev.get("tech"), layouts=[getattr(h, "layout", None) for h in used])
        r.stats = dict(stats, estimate_s=ev["estimate"], makespan_s=ev["makespan"], layering=named[li][0],
                       stage_layouts=[layout_name(h, st.resource) for h, st in zip(used, r.stages)])
        first = first or r
        if rank[0]:                      # infeasible as priced: so is every plan after it
            break
        why = r.reason if not r.feasible else accept(r) if accept is not None else None
        if why is None:
            result = r
            break
        refused.append(f"{len(plan)} stages x {M} micro-batches ({', '.join(r.stats['stage_layouts'])}): {why}")
    result = result or first
    if refused:
        result.stats["refused"] = refused
    result.search_s = time.perf_counter() - t0
    return result


def evaluate_pipeline(pcg: PCG, mapper_or_cost_model: MachineMapper | CostModel,
                      stages: Sequence[tuple[int, int, int, int]], micro_batches: int, *,
                      intra: Callable[[PCG, Resource], PCG] | None = None, max_layers: int = 12,
                      stitch: bool = True, tech: tuple | None = None, partial: bool = False) -> PipelineResult:
    """Price one given pipeline exactly, as the search prices its candidates: ``stages`` lists
    ``(first layer, last layer + 1, first device, number of devices)`` over the layers of
    :func:`sequential_layers` (``max_layers`` of them), covering the layers and the machine in order.
    ``stitch=False`` prices only (no plan PCG, views or stage node lists).  ``tech``: ``(zero, modes)``, the
    ZeRO stage and each stage's recompute mode (:func:`stage_techniques`); None: no memory techniques.
    ``partial``: as the search prices, a stage with a mode recomputes only what it must (:func:`stage_partial`)."""
    t0 = time.perf_counter()
    mapper = mapper_or_cost_model if isinstance(mapper_or_cost_model, MachineMapper) \
        else MachineMapper(mapper_or_cost_model)
    machine = mapper.machine
    roles = GraphCost(pcg, mapper.model).role
    layers, info = sequential_layers(pcg, roles, max_layers)
    plan = tuple(tuple(int(x) for x in st) for st in stages)
    at_layer, at_dev = 0, 0
    for k, i, d, s in plan:
        if k != at_layer or i <= k or d != at_dev or sub_mesh(machine, d, s) is None:
            raise PipelineError(f"stage {(k, i, d, s)} does not continue the previous one (layer {at_layer}, "
                                f"device {at_dev}) with a block of whole nodes or devices inside one node")
        at_layer, at_dev = i, d + s
    if at_layer != len(layers) or at_dev != machine.num_devices:
        raise PipelineError(f"the stages cover layers 0..{at_layer} of {len(layers)} and devices 0..{at_dev} of "
                            f"{machine.num_devices}")
    B = batch_size(pcg)
    if not isinstance(micro_batches, int) or micro_batches < 1 or B % micro_batches:
        raise PipelineError(f"micro-batch count {micro_batches!r} does not divide the batch {B}")
    gM = rebatch(pcg, B, B // micro_batches)
    if tech is not None and (len(tech) != 2 or len(tech[1]) != len(plan)
                             or any(m not in STAGE_RECOMPUTE for m in tech[1])):
        raise PipelineError(f"tech must be (zero, one recompute mode of {STAGE_RECOMPUTE} per stage), got {tech!r}")
    ev = _evaluate(gM, roles, info, layers, plan, micro_batches, mapper, intra or default_intra, machine, None, tech,
                   partial=partial)
    out = assemble(pcg, gM, plan, micro_batches, ev, machine, stitch)
    out.origin = _origin(layers, info, plan, ev, (intra or default_intra) is default_intra)
    out.origin.update(max_layers=max_layers, megatron=getattr(intra, "megatron", None), tech=tech)
    out.search_s = time.perf_counter() - t0
    out.stats = {"layers": len(layers), "makespan_s": ev["makespan"]}
    return out


class _LayerPrices:
    """Per-layer costs at one micro-batch size, memoized per (layer, sub-mesh size, layout) and, through
    :func:`_price`, per structure of the parallel layer: repeated layers are parallelized and mapped once.
    ``intra``: one hook, or the layouts (hooks) a stage may take (``get``'s ``h`` indexes them)."""

    def __init__(self, gM, roles, layer_nodes, mapper, intra, machine, memo: dict):
        self.gM, self.roles, self.layer_nodes = gM, roles, layer_nodes
        self.hooks = tuple(intra) if isinstance(intra, (tuple, list)) else (intra,)
        self.mapper, self.intra, self.machine = mapper, self.hooks[0], machine
        self.memo: dict = {}
        self.shared = memo
        self.graphs: dict = {}
        self.keys: dict = {}
        self.degrees: dict = {}

    def _degree(self, layer: int, sg: PCG) -> int:
        d = self.degrees.get(layer)
        if d is None:
            d = self.degrees[layer] = _max_degree(sg)
        return d

    def get(self, layer: int, size: int, h: int = 0) -> StagePrice:
        key = (layer, size, h)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        res = sub_mesh(self.machine, 0, size)
        sg = self.graphs.get(layer)
        if sg is None:
            try:
                sg = stage_graph(self.gM, self.roles, self.layer_nodes[layer])
            except PipelineError as e:
                sg = e
            self.graphs[layer] = sg
        hook = self.hooks[h]
        if res is None:
            p = _failed(f"no sub-mesh of {size} devices")
        elif isinstance(sg, PipelineError):
            p = _failed(str(sg))
        else:
            # repeated layers are parallelized and mapped once; under the default intra, so are the
            # sub-mesh sizes that give the same data-parallel degree
            shape = self.keys.get(layer)
            if shape is None:
                shape = self.keys[layer] = structure_key(sg)
            tag: Any = ("size", size)
            if hook is default_intra:            # the devices it uses: the data-parallel degree, or the
                need = max(_dp_degree(sg, size), self._degree(layer, sg))   # given parallelization's
                D = self.machine.devices_per_node
                if need <= size and (need <= D or need % D == 0):
                    tag = need
            skey = ("layer", shape, tag) if hook is default_intra else ("layer", shape, tag, _hook_key(hook))
            p = self.shared.get(skey)
            if p is None and h > 0:
                # a further layout past the deadline is not offered on this layer and sub-mesh (not memoized
                # across passes); the first hook's prices stop the search as before
                try:
                    p = self.shared[skey] = _price(self.mapper, sg, hook, res, self.shared)
                except Expired:
                    p = _failed("the deadline passed before the layout was solved")
            elif p is None:
                p = self.shared[skey] = _price(self.mapper, sg, hook, res, self.shared)
        self.memo[key] = p
        return p


def _hook_key(hook) -> tuple:
    """What tells a layout hook's prices apart in the shared memo (the default's key is unchanged)."""
    return (getattr(hook, "__name__", "intra"), id(hook), bool(getattr(hook, "reuse", False)))


def _stage_dp(lay: _LayerPrices, info: Cuts, layers, gM, machine, sizes, T, M, min_stages, max_stages,
              deadline, candidates, clock=time.perf_counter, techniques: bool = False) -> list:
    """The shared stage DP (:func:`unity_pcg.search.stages.stage_dp`) on layer prices (module docstring).
    Returns up to ``candidates`` plans per stage count, best first, each ``(estimate, plan, tech, layouts)``; a plan is a
    tuple of stages ``(first layer, last layer + 1, first device, number of devices)``; ``tech`` is None
    (priced without memory techniques) or ``(zero, modes)``: the plan's ZeRO stage and each stage's
    recompute mode; ``layouts`` each stage's layout (an index into ``lay.hooks``).  Sub-meshes are
    blocks of ``sizes`` laid out left to right, the last stage any block to the end; bounds ``t_max`` closer
    than 1% are merged (the DP runs at the larger one; the estimate uses the plan's actual maximum), more
    coarsely where that leaves more than ``MAX_BOUNDS`` of them, the search stopping once ``M`` times a
    merged bound reaches the best estimate; objectives with and without the stages'
    updates (they run after each stage's last backward, overlapping the drain of the earlier stages, so
    neither their sum nor nothing is right); DP costs within ``TIE`` are ties (the smaller largest stage
    time wins).  Each plan is estimated by the 1F1B simulation on the layer prices.

    With ``techniques`` the DP's options are (sub-mesh size, recompute mode) pairs: a stage's layers are
    priced by :func:`stage_techniques` (the recompute forward in its time, its memory with the recomputation
    and ZeRO), so the DP chooses each stage's recomputation jointly with its layers and devices; a
    recompute mode is offered on a size only where some stage does not hold its micro-batches in flight
    without it.  The ZeRO stage is one per plan (:data:`PIPELINE_ZERO`): the DP runs once per stage, but
    stage 0 is left out where ZeRO-1 is nowhere slower (it never holds more).

    With several layouts (``lay.hooks``) every option is also offered under each layout (its layers priced
    under that hook), so a stage's layout is chosen by the DP with its layers, devices and recomputation."""
    L = len(layers)
    D = machine.devices_per_node
    cap = machine.device.usable_bytes
    inner = set(sizes)
    # the last stage starts where the inner blocks end: a multiple of their gcd (other starts are unreachable,
    # and would make the DP's positions finer than the blocks)
    step = reduce(gcd, [s for s in inner if s <= T], T)
    opts = sorted(inner | {T - d for d in range(0, T, step) if sub_mesh(machine, d, T - d) is not None})
    tab: dict = {}                      # (size, mode, zero, layout) -> (t[k][i], once[k][i], holds[k][i], rec[k][i])
    mapper = lay.mapper

    H = len(lay.hooks)

    def prices(s, mode, zero, h=0):
        ps = [lay.get(x, s, h) for x in range(L)]
        if mode is None:
            return ps
        return [stage_techniques(mapper, p, mode, zero) for p in ps]

    def table(key):
        hit = tab.get(key)
        if hit is None:
            t = [[INF] * L for _ in range(L)]
            o = [[0.0] * L for _ in range(L)]
            r = [[0.0] * L for _ in range(L)]
            ps = prices(*key)
            for k in range(L):
                tk, ok, rk = 0.0, 0.0, 0.0
                for i in range(k, L):
                    tk += ps[i].t
                    ok += ps[i].once
                    rk += ps[i].rec
                    t[k][i], o[k][i], r[k][i] = tk, ok, rk
            hit = tab[key] = (t, o, _holds_table(ps, cap), r)
        return hit

    cut_bytes = [0.0] * (L + 1)
    for j in range(1, L):
        cut_bytes[j] = crossing_bytes(gM, info.crossing[layers[j][0]])
    xmemo: dict = {}

    def xfer(j, d, s):                  # estimate: activations into the stage from layer j on devices d..
        key = (j, d, s)
        hit = xmemo.get(key)
        if hit is None:
            hit = 0.0
            if j and d and cut_bytes[j] > 0:
                lv = machine.level(d - 1, d)
                link = machine.link(lv)
                par = max(1, s // D) if lv == "network" else max(1, min(s, D))
                hit = 2 * (link.latency + cut_bytes[j] / (link.bandwidth * par))
            xmemo[key] = hit
        return hit

    # the options: sizes, or (size, recompute mode) pairs; the ZeRO stages tried
    # a further layout's layers are priced (the costly part) in an order that meets a deadline with the likely
    # sub-meshes done: blocks that split the machine into equal stages, two stages first, then the whole machine,
    # then the others, largest first
    later = sorted(opts, key=lambda s: (T % s != 0, T // s == 1, -s))
    if not techniques:
        choices, zeros = [(s, None, h) for h in range(H) for s in (opts if h == 0 else later)], [0]
    else:
        need = min(max_stages, M)
        choices = []
        for hk in range(H):
            for s in (opts if hk == 0 else later):
                modes = ("none",)
                held = table((s, "none", PIPELINE_ZERO[-1], hk))[2]
                if (held[np.triu(np.ones((L, L), dtype=bool))] < need).any():
                    modes = tuple(dict.fromkeys(m for x in range(L) for m in stage_modes(mapper, lay.get(x, s, hk))))
                    modes = tuple(m for m in STAGE_RECOMPUTE if m in modes)
                choices.extend((s, m, hk) for m in modes)
        zeros = list(PIPELINE_ZERO)
        if 0 in zeros and len(zeros) > 1:
            z1 = zeros[-1]
            if all(stage_techniques(mapper, p, "none", z1).once <= stage_techniques(mapper, p, "none", 0).once
                   * (1 + 1e-9) + 1e-15 for hk in range(H) for s in opts
                   for p in (lay.get(x, s, hk) for x in range(L))):
                zeros = [z1]
    sizes_j = [c[0] for c in choices]

    def allowed(d, j, last):
        s = sizes_j[j]
        return sub_mesh(machine, d, s) is not None and (last or s in inner)

    bf = mapper.model.backward_factor
    per_s: dict = {}
    hard = current()
    for zero in zeros:
        keys = [(s, m, zero if m is not None else 0, hk) for s, m, hk in choices]

        def estimate(stages, keys=keys) -> float:      # the 1F1B simulation on the layer prices
            ts = [table(keys[st.option])[0][st.first][st.end - 1] for st in stages]
            rs = [table(keys[st.option])[3][st.first][st.end - 1] for st in stages]
            once = [table(keys[st.option])[1][st.first][st.end - 1] for st in stages]
            send = [xfer(b.first, b.start, sizes_j[b.option]) / 2 for b in stages[1:]]
            return simulate_1f1b([(t - r) / (1 + bf) for t, r in zip(ts, rs)],
                                 [(t - r) * bf / (1 + bf) + r for t, r in zip(ts, rs)], M, send, send,
                                 once).makespan

        inner_times = [table(key)[0][k][i] for key in keys if key[0] in inner for k in range(L) for i in range(k, L)]
        soft = Deadline(deadline, clock) if math.isfinite(deadline) else None
        found = stage_dp(L, sizes_j, T, M, lambda k, i, j, keys=keys: table(keys[j])[0][k][i],
                         fits=lambda k, i, j, keys=keys: table(keys[j])[2][k, i],
                         extra=(lambda k, i, j, keys=keys: table(keys[j])[1][k][i], None),
                         entry=lambda k, d, j: xfer(k, d, sizes_j[j]), allowed=allowed,
                         min_stages=min_stages, max_stages=max_stages,
                         bounds=[(hi, hi) for _, hi in t_max_bounds(inner_times, rel=0.01, most=MAX_BOUNDS)],
                         score=estimate, tie=TIE, deadline=soft.sooner(hard) if soft else hard)
        for est, stages in found.plans:
            plan = tuple((st.first, st.end, st.start, sizes_j[st.option]) for st in stages)
            tech = (zero, tuple(choices[st.option][1] for st in stages)) if techniques else None
            hs = tuple(choices[st.option][2] for st in stages)
            per_s.setdefault(len(plan), []).append((est, plan, tech, hs))
    out = []
    for plans in per_s.values():
        out.extend(sorted(plans, key=lambda x: x[0])[:candidates])
    out.sort(key=lambda x: x[0])
    return out


def _holds_table(ps: Sequence[StagePrice], cap: float) -> np.ndarray:
    """``h[k, i]``: :func:`unity_pcg.search.stages.holds` of the stage of layers ``k..i`` priced ``ps`` (one
    per layer, on one sub-mesh): its weights are the layers' sums per device (a recomputation's transient
    peak, ``tr``, counted once: the largest of the layers'), its activations the first layer's and every
    later layer's less its received input (the earlier layer's output, counted there)."""
    L = len(ps)
    devs = sorted({d for p in ps for d in (*p.w, *p.a)})
    if not devs:
        return np.full((L, L), INF)
    col = {d: n for n, d in enumerate(devs)}
    W, A, N, TR = (np.zeros((L, len(devs))) for _ in range(4))
    for x, p in enumerate(ps):
        for d, v in p.w.items():
            W[x, col[d]] = v - getattr(p, "tr", {}).get(d, 0)
        for d, v in getattr(p, "tr", {}).items():
            TR[x, col[d]] = v
        for d, v in p.a.items():
            A[x, col[d]] = v
            N[x, col[d]] = max(v - p.a_in.get(d, 0), 0)
    Wc = np.vstack([np.zeros(len(devs)), np.cumsum(W, axis=0)])
    Nc = np.vstack([np.zeros(len(devs)), np.cumsum(N, axis=0)])
    w = Wc[1:][None, :, :] - Wc[:-1][:, None, :]                      # [k, i, device]
    if TR.any():                        # the largest transient of layers k..i
        w = w + np.maximum.accumulate(np.broadcast_to(TR[None, :, :], (L, L, len(devs))) *
                                      np.triu(np.ones((L, L)))[:, :, None], axis=1)
    a = A[:, None, :] + Nc[1:][None, :, :] - Nc[1:][:, None, :]       # the first layer's, then the others'
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(a > 0, np.floor((cap - w) / np.where(a > 0, a, 1.0)), INF)
        for _ in range(2):              # the exact largest integer (the quotient may round across one)
            n = np.where((a > 0) & (w + n * a > cap), n - 1, n)
            n = np.where((a > 0) & (w + (n + 1) * a <= cap), n + 1, n)
    h = n.min(axis=2)
    h = np.where((w > cap).any(axis=2), -1.0, h)
    return np.where(np.triu(np.ones((L, L), dtype=bool)), h, -1.0)


def _evaluate(gM, roles, info, layers, plan, M, mapper, intra, machine, memo=None, tech=None,
              partial: bool = False) -> dict:
    """Exact price of one plan at the micro-batch size: every stage's sub-PCG mapped on its actual
    sub-mesh, transfers between the sub-meshes, the 1F1B simulation, memory with micro-batches in
    flight.  ``tech`` ``(zero, modes)``: each stage priced with its memory techniques
    (:func:`stage_techniques`; ``ev["tech"]``, and each priced stage's ``memory_plan``).  ``intra``: one
    hook for every stage, or one per stage.  With ``memo`` a stage (its layers, micro-batch graph, sub-mesh
    and hook) is priced once across the plans.  ``partial`` (the search's exact pricing): a stage the DP gave
    a recompute mode recomputes only the regions its micro-batches in flight need (:func:`stage_partial`)
    where that fits and is faster; ``ev["modes"]`` says per stage ("per-region")."""
    S = len(plan)
    hooks = list(intra) if isinstance(intra, (list, tuple)) else [intra] * S
    bf = mapper.model.backward_factor
    cap = machine.device.usable_bytes
    fwd, bwd, once, send, priced, mems, reasons, send_el = [], [], [], [], [], [], [], []
    modes = list(tech[1]) if tech is not None else []
    for idx, (k, i, d, s) in enumerate(plan):
        res = sub_mesh(machine, d, s)
        nodes = [n for a, b in layers[k:i] for u in range(a, b) for n in info.units[u]]
        key = ("exact", id(gM), nodes[0] if nodes else None, nodes[-1] if nodes else None, len(nodes), d, s,
               _hook_key(hooks[idx]))
        p = memo.get(key) if memo is not None else None
        if p is None:
            try:
                p = _price(mapper, stage_graph(gM, roles, nodes), hooks[idx], res)
            except PipelineError as e:
                p = _failed(str(e))
            if memo is not None:
                memo[key] = p
        if tech is not None:
            base = p
            p = stage_techniques(mapper, base, tech[1][idx], tech[0])
            if partial and tech[1][idx] != "none" and math.isfinite(p.t):
                # the stage DP recomputes every region of a stage one way; here the stage recomputes only what
                # its micro-batches in flight need (per region), where that fits and is faster
                part = stage_partial(mapper, base, in_flight(S, idx, M), tech[0], cap)
                if part is not None and part.t + part.once < p.t + p.once:
                    p = part
                    modes[idx] = "per-region" if part.memory_plan is not None and part.memory_plan.recompute else "none"
        priced.append(p)
        fwd.append((p.t - p.rec) / (1 + bf))
        bwd.append((p.t - p.rec) * bf / (1 + bf) + p.rec)      # recomputed before the stage's backward
        once.append(p.once)
        if p.reason:
            reasons.append(f"stage {idx}: {p.reason}")
        infl = in_flight(S, idx, M)
        mems.append({dev: p.w.get(dev, 0) + infl * p.a.get(dev, 0) for dev in set(p.w) | set(p.a)})
    for idx in range(S - 1):
        _, i, d, s = plan[idx]
        _, _, d2, s2 = plan[idx + 1]
        nb = crossing_bytes(gM, info.crossing[layers[i][0]])
        send.append(stage_transfer(machine, tuple(range(d, d + s)), tuple(range(d2, d2 + s2)), nb))
        send_el.append(sum(gM.shape(r).numel for r in info.crossing[layers[i][0]]))
    out = {"priced": priced, "fwd": fwd, "bwd": bwd, "once": once, "send": send, "mem": mems,
           "memory": {dev: v for mem in mems for dev, v in mem.items()}, "send_elements": send_el, "tech": tech,
           "modes": modes}
    if any(not math.isfinite(x) for x in fwd):
        return dict(out, cost=INF, makespan=INF, feasible=False,
                    reason="; ".join(reasons) or "a stage cannot be mapped")
    # data-parallel stages of degrees K_i: every micro-batch must split lcm(K_i) ways (the batch M x R)
    R = executor_replicas([p.pcg for p in priced])
    if R > 1:
        key = ("micro", id(gM), R)
        why = memo.get(key, "?") if memo is not None else "?"
        if why == "?":
            try:
                micro_graph(gM, R)
                why = None
            except PipelineError as e:
                why = str(e)
            if memo is not None:
                memo[key] = why
        if why is not None:
            return dict(out, cost=INF, makespan=INF, feasible=False,
                        reason=f"{R} data-parallel pieces per micro-batch: {why}")
    makespan = simulate_1f1b(fwd, bwd, M, send, send, once).makespan
    for idx, mem in enumerate(mems):
        if mem and max(mem.values()) > cap:
            dev = max(mem, key=mem.get)
            return dict(out, cost=INF, makespan=makespan, feasible=False,
                        reason=f"out of memory: stage {idx} device {dev} needs {mem[dev] / 2**30:.2f} GiB with "
                               f"{in_flight(S, idx, M)} micro-batches in flight but has {cap / 2**30:.2f} GiB")
    return dict(out, cost=makespan, makespan=makespan, feasible=True, reason="")


# --- stitching the stages into one PCG ----------------------------------------------------------

def _origin(layers, info: "Cuts", plan, ev: dict, dp_inside: bool) -> dict:
    """The model's node ids of every stage and the data-parallel degree inside it (for :func:`by_rules`)."""
    nodes = [[n for u in range(layers[k][0], layers[i - 1][1]) for n in info.units[u]] for k, i, _, _ in plan]
    degrees = [_max_degree(p.pcg) if p.pcg is not None else 1 for p in ev["priced"]]
    return {"stage_nodes": nodes, "degrees": degrees, "dp_inside": dp_inside}


def assemble(pcg: PCG, gM: PCG, plan, M: int, ev: dict, machine: MachineSpec, stitch: bool = True
              ) -> PipelineResult:
    S = len(plan)
    cap = machine.device.usable_bytes
    full, views, members, idmaps = None, {}, [[] for _ in range(S)], None
    cost, feasible, reason = ev["cost"], ev["feasible"], ev["reason"]
    join_stage = None
    if stitch and all(p.pcg is not None and p.views for p in ev["priced"]):
        try:
            full, views, members, idmaps = _stitch(pcg, gM, ev["priced"], plan, machine)
        except UnityError as e:
            cost, feasible, reason = INF, False, f"cannot join the stages: {e}"
            join_stage = getattr(e, "stage", None)
    stages = []
    for idx, (k, i, d, s) in enumerate(plan):
        res = sub_mesh(machine, d, s)
        mem = ev["mem"][idx]
        stages.append(PipelineStage(tuple(members[idx]), res.devices(machine), res, (k, i), ev["fwd"][idx],
                                    ev["bwd"][idx], ev["once"][idx], ev["send"][idx] if idx < S - 1 else 0.0,
                                    in_flight(S, idx, M), int(max(mem.values(), default=0))))
    out = PipelineResult(cost, feasible, reason, M, tuple(stages), full, views, dict(ev["memory"]), cap,
                         comm_elements=_comm_elements(ev, M, machine))
    if join_stage is not None:
        out.stats["join_stage"] = join_stage        # the stage that did not join the ones before it
    if ev.get("tech") is not None and idmaps is not None:
        out.memory_plan = _memory_plan(ev["tech"][0], ev["priced"], idmaps)
        out.techniques = {"zero": ev["tech"][0], "recompute": list(ev.get("modes") or ev["tech"][1]),
                          "recompute_s": [p.rec for p in ev["priced"]]}
    return out


def _memory_plan(zero: int, priced: Sequence[StagePrice], idmaps: Sequence[dict]):
    """The plan's MemoryPlan from the stages' own (each priced on its sub-PCG): ZeRO ``zero``, every stage's
    recompute regions on the stitched PCG's node ids, offload where a stage's plan offloads (one stage: the
    executor offloads no pipeline) (None: no technique)."""
    from unity_pcg.plan import MemoryPlan, RecomputeRegion
    regs = []
    offload = False
    for p, ids in zip(priced, idmaps):
        mp = p.memory_plan
        offload = offload or bool(mp is not None and mp.offload)
        for r in (mp.recompute if mp is not None else ()):
            nodes = tuple(ids[n] for n in r.nodes if n in ids)
            if nodes:
                regs.append(RecomputeRegion(nodes, r.mode))
    mem = MemoryPlan(zero=int(zero), offload=offload, recompute=tuple(regs))
    return None if mem.empty else mem


def _remap_memory(mem, ids: Mapping[int, int]):
    """``mem`` with its regions' node ids mapped through ``ids`` (nodes not in it dropped)."""
    if mem is None:
        return None
    regs = tuple(replace(r, nodes=tuple(ids[n] for n in r.nodes if n in ids)) for r in mem.recompute)
    return replace(mem, recompute=tuple(r for r in regs if r.nodes))


def _comm_elements(ev: dict, M: int, machine: MachineSpec) -> int:
    """Elements sent by all devices in one iteration (the project's convention): each stage's
    activation transfers once per micro-batch, its gradient synchronization once, and every
    boundary's activations forward and gradients back once per micro-batch."""
    total = 2 * M * sum(ev.get("send_elements", ()))
    model = CostModel(machine)
    for p in ev["priced"]:
        if p.pcg is None or not p.views:
            continue
        gc = GraphCost(p.pcg, model)
        for n in gc.nodes():
            el = gc.leaf_cost(n, p.views[n], p.views).comm_elements
            total += el if gc.role[n] == "weight-placement" else M * el
    return int(total)


def _stitch(pcg: PCG, gM: PCG, priced: Sequence[StagePrice], plan, machine: MachineSpec
            ) -> tuple[PCG, dict, list]:
    """One PCG at the full batch from the stages' parallel sub-PCGs (module docstring).  Returns the
    PCG, its views and the node ids of every stage in topological order."""
    B, Bm = batch_size(pcg), batch_size(gM)
    b = PCG.builder(pcg.weights)
    where: dict = {}                   # original ref -> global ref
    sources: dict = {}                 # (op, name) -> global ref
    views: dict = {}
    members: list = []
    idmaps: list = []                  # per stage: its sub-PCG's compute node id -> the stitched PCG's
    for idx, p in enumerate(priced):
        try:
            _stitch_stage(b, idx, p, plan, machine, B, Bm, where, sources, views, members, idmaps)
        except UnityError as e:
            e.stage = idx                       # the stage that could not be joined to the ones before it
            raise
    b.set_outputs([where[tuple(r)] for r in pcg.outputs])
    b.meta = dict(pcg.meta)
    g = b.finish()
    g.meta["pipeline_stages"] = len(plan)
    pos = {nid: i for i, nid in enumerate(g.topo_order())}
    return g, views, [sorted(ms, key=pos.__getitem__) for ms in members], idmaps


def _stitch_stage(b, idx: int, p: StagePrice, plan, machine: MachineSpec, B: int, Bm: int, where: dict,
                  sources: dict, views: dict, members: list, idmaps: list) -> None:
    """Stage ``idx`` of :func:`_stitch` added to the builder ``b`` (its tensors read from ``where``)."""
    idm: dict = {}
    idmaps.append(idm)
    R = rebatch(p.pcg, Bm, B)
    res = sub_mesh(machine, plan[idx][2], plan[idx][3])
    devs = res.devices(machine)
    mine: list = []
    m: dict = {}                   # R ref -> global ref
    pending: dict = {}             # R ref on a boundary chain -> global ref of the same logical tensor
    logical: dict = {}             # global ref -> its logical version (made on this stage)

    def resolve(r):
        r = tuple(r)
        if r in m:
            return m[r]
        src = pending[r]
        n = R.node(r[0])
        if n.op == "Input":
            lg = logical.get(src)
            if lg is None:
                lg = logical[src] = _to_logical(b, src, devs, views, mine)
            m[r] = lg
            return lg
        x = resolve(n.inputs[0])
        new = b.add_node(n.op, n.a, [x], n.name)
        mine.append(new)
        if r[0] in p.views:
            views[new] = p.views[r[0]]
        m[r] = (new, 0)
        return m[r]

    for nid in R.topo_order():
        n = R.node(nid)
        name = str(n.a.get("name", "")) if n.kind == "source" else ""
        if n.op == "Input" and name.startswith("pipe:"):
            _, pid, k = name.split(":")
            pending[(nid, 0)] = where[(int(pid), int(k))]
            continue
        if n.kind == "parallel" and tuple(n.inputs[0]) in pending:
            src = pending[tuple(n.inputs[0])]
            if b.shape(src) == R.shapes(nid)[0]:
                m[(nid, 0)] = src          # the producer already has this parallel shape
            else:
                pending[(nid, 0)] = src    # made only if something reads it
            continue
        if n.kind == "source":
            key = (n.op, name)
            if key not in sources:
                sources[key] = (b.add_node(n.op, n.a, [], n.name), 0)
                mine.append(sources[key][0])
            m[(nid, 0)] = sources[key]
            continue
        new = b.add_node(n.op, n.a, [resolve(r) for r in n.inputs], n.name)
        mine.append(new)
        idm[nid] = new
        for k in range(len(R.shapes(nid))):
            m[(nid, k)] = (new, k)
        if nid in p.views:
            views[new] = p.views[nid]
    for orig, r in zip(p.outputs, R.outputs):
        where[tuple(orig)] = resolve(r)
    members.append(mine)


# --- the plan by rules --------------------------------------------------------------------------------

def by_rules(pcg: PCG, result: PipelineResult, machine: MachineSpec, book=None, mapper=None
             ) -> PipelineResult | None:
    """The same plan reached by the shipped rules from the logical ``pcg`` (issue 7 point 1), or None.

    The stages are a mapping decision (which devices run which nodes, the 1F1B schedule); the PCG
    inside them is data parallelism by rules: each stage's compute operators get their ``dp_<Op>``
    rule at the stage's degree, in topological order with the cancellations after each
    (:func:`search.substitution.data_parallel_steps`, restricted to the stage), then the
    cancellations over the whole graph; the outputs are trimmed of their gathers as every plan.  The
    result is the rule-reached PCG, the stitched plan's views and stage nodes carried over node by node
    (matched by structural hash with parallel dims counted from the front: the hand-built stages and
    the rules write them differently), and ``rules`` the sequence (replayed on a fresh import it gives
    the plan's structural hash).  Stages built by :func:`megatron_intra` (Megatron-LM's layout by structure,
    tensor parallel and possibly data parallel too) are reached by :func:`search.realize.realize`
    (:func:`_megatron_by_rules`), the one way Megatron is built by rules.  ``mapper`` is unused (kept for
    callers).  None when the plan was not
    stitched, or the rules do not reach the stitched PCG (or its stages would not be contiguous in the
    rule-reached PCG's topological order)."""
    info = result.origin
    if result.pcg is None or not result.feasible or info is None:
        return None
    if info.get("megatron") or "ilp" in (info.get("layouts") or ()):
        # Megatron's layout or the layout ILP's inside some stage: the stitched PCG reached by realize
        return _megatron_by_rules(pcg, result, machine, book, mapper)
    if not info.get("dp_inside") or any(n.kind == "parallel" for n in pcg.nodes()):
        return None
    from .substitution import RuleBook, cancel_steps, trimmed
    book = book or RuleBook()
    # data parallelism inside every stage: built segment by segment and stitched (linear in the model),
    # checked against the stitched plan like the whole-graph sequence below
    fast = _dp_by_segments(pcg, info["stage_nodes"], info["degrees"], book)
    if fast is not None:
        out = _rules_plan(pcg, result, machine, trimmed(fast[0]), fast[1])
        if out is not None:
            return out
    g, steps = pcg, []
    for nodes, d in zip(info["stage_nodes"], info["degrees"]):
        if d > 1:
            g, st = _dp_steps_on(g, set(nodes), d, book)
            steps.extend(st)
    g, more = cancel_steps(g, book)
    steps.extend(more)
    return _rules_plan(pcg, result, machine, trimmed(g), steps)


def _rules_plan(pcg: PCG, result: PipelineResult, machine: MachineSpec, g: PCG, steps: list
                ) -> PipelineResult | None:
    """``result`` with its PCG replaced by ``g`` (reached by ``steps``, outputs trimmed), the views and
    stage lists carried over node by node; None when ``g`` is not the stitched PCG or its stages would
    not be contiguous."""
    ids = _match_nodes(g, result.pcg, result.views)
    if ids is None:
        return None
    views = {ids[k]: v for k, v in result.views.items() if k in ids}
    pos = {nid: i for i, nid in enumerate(g.topo_order())}
    # sources left out (they belong to the stage of their first consumer): the rules keep the model's
    # source ids, which the topological order puts first
    stages = tuple(replace(st, nodes=tuple(sorted((ids[n] for n in st.nodes if n in ids
                                                   and g.node(ids[n]).kind != "source"), key=pos.__getitem__)))
                   for st in result.stages)
    from unity_pcg.plan import validate_pipeline_field as _valid

    def valid(g, views, stages) -> bool:
        try:
            _valid({"schedule": SCHEDULE, "micro_batches": result.micro_batches,
                    "stages": [{"nodes": list(st.nodes), "devices": list(st.devices)} for st in stages]},
                   g, views, machine)
        except UnityError:
            return False
        return True
    mem = _remap_memory(result.memory_plan, ids)
    if not valid(g, views, stages):
        # a Replicate lifted across a cut (Megatron stages) adds nodes to a stage after the next stage's:
        # the same PCG with its ids in stage order (the structural hash, which a replay is checked
        # against, does not depend on ids)
        g, views, stages, new = _in_stage_order(g, views, stages)
        if not valid(g, views, stages):
            return None
        mem = _remap_memory(mem, new)
    g.meta.update(result.pcg.meta)
    out = replace(result, pcg=g, views=views, stages=stages, rules=tuple(steps), memory_plan=mem)
    return out


def _in_stage_order(g: PCG, views: dict, stages: tuple):
    """``g`` rebuilt with fresh ids: the nodes in no stage list first (sources), then each stage's nodes
    in the order of its list; ``views`` and the stage lists carried over."""
    where = {n: k for k, st in enumerate(stages) for n in st.nodes}
    first = [n for n in g.topo_order() if n not in where]
    b = PCG.builder(g.weights)
    new: dict = {}
    for nid in first + [n for st in stages for n in st.nodes]:
        n = g.node(nid)
        if any(r[0] not in new for r in n.inputs):      # a stage reads a later one: no such order
            return g, views, stages, {k: k for k in g.node_ids()}
        new[nid] = b.add_node(n.op, n.a, [(new[r[0]], r[1]) for r in n.inputs], n.name)
    b.set_outputs([(new[r[0]], r[1]) for r in g.outputs])
    b.meta = dict(g.meta)
    h = b.finish()
    return (h, {new[k]: v for k, v in views.items() if k in new},
            tuple(replace(st, nodes=tuple(new[n] for n in st.nodes)) for st in stages), new)


def _megatron_by_rules(pcg: PCG, result: PipelineResult, machine: MachineSpec, book, mapper=None
                       ) -> PipelineResult | None:
    """A plan whose stages :func:`megatron_intra` parallelized (Megatron-LM's layout of
    :mod:`search.baselines`, built by structure), reached by rules: :func:`search.realize.realize` of the
    stitched PCG from the logical ``pcg``, then the cancellations and the outputs trimmed, as every plan --
    the same plan (stages, devices, views, price) with its rule sequence.  Where a stage is data and tensor
    parallel at once the rules copy a weight twice (the data-parallel rule, then a replicate lift) where the
    hand-built stage copies it once: :func:`search.substitution.merge_copies_steps` writes those copies as
    one (``replicate_merge``, proven), and the data-parallel rule's gather of a row-parallel Linear's batch
    pieces before its AllReduce, split again by the next pair, is sunk past the AllReduce and cancelled
    (:func:`search.substitution.sink_combines_steps`), so the rule-reached PCG is the hand-built one.  None when the rules
    do not reach it (the hand-built plan, no rule sequence).  ``mapper`` is unused (kept for callers)."""
    from .realize import realize
    from .substitution import RuleBook, cancel_steps, merge_copies_steps, sink_combines_steps, trimmed
    book = book or RuleBook()
    try:
        r = realize(pcg, result.pcg, book)
    except UnityError:
        return None
    if not r.complete:
        return None
    g, more = cancel_steps(r.pcg, book)
    steps = list(r.steps) + list(more)
    out = _rules_plan(pcg, result, machine, trimmed(g), steps)
    if out is not None:
        return out
    g, merged = merge_copies_steps(g, book)
    g, sunk = sink_combines_steps(g, book)
    if not merged and not sunk:
        return None
    g, more = cancel_steps(g, book)
    return _rules_plan(pcg, result, machine, trimmed(g), steps + merged + sunk + list(more))


#: (canonical segment key, degree, id(rule book)) -> SegmentChoice of data parallelism by rules on it
_SEG_DP: dict = {}


def _dp_by_segments(pcg: PCG, stage_nodes, degrees, book):
    """Data parallelism by rules of each stage's degree, built on the model's finest sequential segments
    (cut wherever one activation crosses, :func:`search.split.segments` with k = 1) and stitched without a
    whole-graph replay (:func:`search.split.assemble`: the ids a replay allocates are predicted, the
    Combine/Partition pairs at the cuts cancelled by rules), then the cancellations over the whole graph:
    (graph, steps), or None when a stage boundary is not such a cut.  Equal segments at equal degrees
    are built once (memo across calls).  Linear in the model: Inception-v3's two stages at summit:4x6
    (652 steps on ~1,300 nodes) took 8-13 s as one whole-graph sequence."""
    from .split import SegmentChoice, assemble, canonicalize, segments
    from .substitution import cancel_steps, data_parallel_steps
    where: dict = {}
    for k, nodes in enumerate(stage_nodes):
        for n in nodes:
            where[n] = k
    segs = segments(pcg, 1)
    stage_of = []
    for seg in segs:
        ks = {where.get(n) for n in seg.nodes if pcg.node(n).kind == "compute"}
        if len(ks) != 1 or None in ks:
            return None                  # a segment across a stage boundary (or outside every stage)
        stage_of.append(ks.pop())
    reads_after: set = set()
    later: list = []
    for seg in reversed(segs):
        later.append(set(reads_after))
        for nid in seg.nodes:
            reads_after |= {tuple(r) for r in pcg.node(nid).inputs}
    later.reverse()
    choices = []
    if len(_SEG_DP) > 4096:
        _SEG_DP.clear()
    for seg, nr, k in zip(segs, later, stage_of):
        canonicalize(pcg, seg, nr)
        d = degrees[k]
        key = (seg.key, d, id(book))
        ch = _SEG_DP.get(key)
        if ch is None or ch[0] is not book:
            st = data_parallel_steps(seg.canon, d, book)[1] if d > 1 else []
            ch = _SEG_DP[key] = (book, SegmentChoice(0.0, 0.0, tuple(st), ()))
        choices.append(ch[1])
    g, steps = assemble(pcg, segs, choices, book)
    g, more = cancel_steps(g, book)
    return g, list(steps) + list(more)


def _dp_steps_on(g: PCG, nodes: set, degree: int, book):
    """:func:`search.substitution.data_parallel_steps` on the compute operators ``nodes`` of ``g`` only, the
    duplicate placements of shared tensors merged step by step (no whole-graph pass)."""
    from .substitution import data_parallel_steps
    return data_parallel_steps(g, degree, book, only=set(nodes), siblings=True, final_cancel=False)


def _normal_hashes(g: PCG) -> dict:
    """Node id -> structural hash with parallel operators' dims and compute operators' integer axes
    counted from the front (as :func:`search.substitution.normalized_hash`)."""
    from unity_pcg.pcg import Node
    b = g.edit()
    for n in g.nodes():
        a = n.a
        if n.kind == "parallel" and "dim" in n.a:
            a = dict(n.a, dim=n.a["dim"] % g.shape(n.inputs[0]).rank)
        elif (n.kind == "compute" and n.inputs and type(n.a.get("axis")) is int
              and -g.shape(n.inputs[0]).rank <= n.a["axis"] < 0):     # rules bind an axis from the end
            a = dict(n.a, axis=n.a["axis"] % g.shape(n.inputs[0]).rank)
        if a != n.a:
            b._nodes[n.id] = Node(n.id, n.op, tuple(sorted(a.items())), n.inputs, n.name)
            b._hashes.pop(n.id, None)
            b._dirty.add(n.id)
    h = b.finish()
    return {i: h.node_hash(i) for i in h.node_ids()}


def _match_nodes(new: PCG, old: PCG, views: dict) -> dict | None:
    """Old node id -> new node id for two PCGs equal up to ids and parallel dims' sign (None if they
    differ, or if structurally identical nodes of ``old`` run on different views)."""
    hn, ho = _normal_hashes(new), _normal_hashes(old)
    by_new: dict = {}
    for i in new.topo_order():
        by_new.setdefault(hn[i], []).append(i)
    by_old: dict = {}
    for i in old.topo_order():
        by_old.setdefault(ho[i], []).append(i)
    if {k: len(v) for k, v in by_new.items()} != {k: len(v) for k, v in by_old.items()}:
        return None
    outs_n = [(hn[r[0]], r[1]) for r in new.outputs]
    outs_o = [(ho[r[0]], r[1]) for r in old.outputs]
    if outs_n != outs_o:
        return None
    ids: dict = {}
    for k, olds in by_old.items():
        if len(olds) > 1 and len({views.get(i) for i in olds}) > 1:
            return None
        ids.update(zip(olds, by_new[k]))
    return ids



def _to_logical(b, src, devs: Sequence[int], views: dict, mine: list):
    """Reduce and Combine ``src`` to one piece on the receiving stage's devices (contiguous views)."""
    s = b.shape(src)
    if s.copy_degree > 1:
        raise PipelineError(f"a tensor with {s.copy_degree} copies crosses a stage boundary into a stage that "
                            f"partitions it differently")
    ref = src
    steps = ([("Reduce", {"degree": s.sum_degree})] if s.sum_degree > 1 else []) + \
        [("Combine", {"dim": dim, "degree": deg}) for dim, deg in sorted(enumerate(s.degrees), key=lambda x: -x[1])
         if deg > 1]
    for op, attrs in steps:
        nid = b.add_node(op, attrs, [ref], f"pipe/{op.lower()}")
        ref = (nid, 0)
        grid = b.shape(ref).grid
        if prod_(grid) > len(devs):
            raise PipelineError(f"{prod_(grid)} pieces do not fit the receiving stage's {len(devs)} devices")
        strides, acc = [], 1
        for g_ in reversed(grid):
            strides.append(acc)
            acc *= g_
        views[nid] = MachineView(devs[0], tuple((g_, st if g_ > 1 else 1)
                                                for g_, st in zip(grid, reversed(strides))))
        mine.append(nid)
    return ref


def prod_(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m unity_pcg.search.pipeline MODEL.onnx --machine summit:2x6 --batch 24``: the pipeline plan
    against data parallelism on the whole machine (both predicted by this cost model), as JSON."""
    import argparse
    import json

    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    ap = argparse.ArgumentParser(prog="python -m unity_pcg.search.pipeline", description=main.__doc__)
    ap.add_argument("model")
    ap.add_argument("--machine", default="summit:2x6")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--max-stages", type=int, default=4)
    ap.add_argument("--budget", type=float, default=None)
    args = ap.parse_args(argv)
    try:
        g = load_onnx(args.model, batch=args.batch, load_weights=False)
        m = parse_machine(args.machine)
        mapper = MachineMapper(CostModel(m, args.optimizer))
        t = time.perf_counter()
        try:
            dp = mapper.optimize(data_parallel(g, m.num_devices))
            dp_s = dp.cost if dp.feasible else None
        except StrategyError:
            dp_s = None
        dp_t = time.perf_counter() - t
        r = search_pipeline(g, mapper, max_stages=args.max_stages, budget_s=args.budget)
    except UnityError as e:
        print(f"error: {e}")
        return 2
    out = {"model": args.model, "machine": args.machine, "batch": batch_size(g), "pcg_nodes": len(g),
           "data_parallel_iteration_s": dp_s, "data_parallel_solve_s": dp_t,
           "pipeline": r.to_json() if r is not None else None}
    if r is not None:
        for st, js in zip(r.stages, out["pipeline"]["stages"]):
            js["nodes"] = len(st.nodes)
            js["devices"] = [st.devices[0], st.devices[-1] + 1]
    print(json.dumps(out, indent=1))
    return 0


__all__ = ["search_pipeline", "evaluate_pipeline", "simulate_1f1b", "schedule_1f1b", "in_flight", "PipelineResult",
           "PipelineStage", "PipelineError", "Timeline", "rebatch", "broadcast_change", "stage_graph", "sequential_layers", "default_intra",
           "megatron_intra", "by_rules", "micro_graph", "logical_graph", "may_cross", "batch_split_error", "executor_replicas",
           "validate_pipeline_field", "batch_size", "SCHEDULE"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
