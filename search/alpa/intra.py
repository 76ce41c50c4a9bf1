"""Alpa's intra-operator pass (Zheng et al., OSDI'22, section 4, Eq. 1) as an ILP in our cost model.

Given a logical PCG and a 2-D logical device mesh ``(n0, n1)`` over devices ``start .. start+n0*n1-1``
(device of mesh position (i, j) = ``start + i*n1 + j``: the inner axis 1 is contiguous, so it lies inside
a node where it fits, as Alpa maps the inner mesh axis to the fast links), :func:`solve_intra` picks one
parallel algorithm per operator minimizing compute + communication + resharding, and returns the result
as a PCG with parallel operators plus the machine view of every node (:class:`IntraPlan`).

**Parallel algorithms from the registry's labels.**  An algorithm of an operator assigns each mesh axis
(of size > 1) to one label of the operator's task grid or to none (the operator is then replicated
along that axis); both axes on one label is S01.  A tensor dim takes the mesh axes of its label (its
sharding spec: S0, S1, S01 or R), an input is copied along the mesh axes its labels do not use, an
output carries partial sums along the axes of contracted labels and copies along the unassigned
ones.  Unshardable labels are never assigned; an assignment the operator refuses (degrees that do not
divide, partial sums through a non-linear operator) is dropped by running the registry's shape
inference on it.  Partial sums are resolved inside the algorithm (Alpa puts the all-reduce in the node
cost c_v): ``AllReduce`` (the sum axes become copies) or ``Reduce`` + ``Partition`` of one output dim
onto the sum axes (a reduce-scatter in two steps, which is how our IR expresses it).

**Graph simplification** (section 4.2): operators that are not matmuls, convolutions or embeddings
(element-wise, normalization, reshape/transpose, reductions) are merged into their deepest operand
produced by a compute operator (BFS depth; an operand as large as the output first: a broadcast one,
such as BERT's position embedding added to every sample, cannot carry the batch split) and follow its
spec: each label of the merged operator takes the mesh axes of the operand dim it reads, except
unshardable ones (the operand is then gathered along that dim).  Only the remaining *anchors* are ILP variables; a merged operator's costs
are part of its anchor's node cost, its other inputs are edges of the ILP.

**Costs are our cost model's.**  A node cost is the sum of :meth:`GraphCost.leaf_cost` over a fragment
PCG holding the anchor group under that algorithm (compute as ``CostModel.op_time`` prices one task,
forward + backward; the partial-sum resolution; resharding between group members; each weight's
gradient all-reduce over its copies and its optimizer update), its memory the busiest device of
:func:`search.memory.memory_per_device` on that fragment.  An edge cost is the price of the chain of
parallel operators that turns the producer's layout into the consumer's (Reduce/AllReduce, Combine,
Partition, Replicate, each priced by :class:`GraphCost` with the views their layouts imply).  One
limit of our IR shows here: no parallel operator drops copies, so a tensor replicated along a mesh axis
cannot be resharded onto that axis (Alpa's free local slice R -> S); such edges are infeasible and the
ILP routes around them (a replicated tensor can be split by the *operator* that reads it: Megatron's
column-parallel Linear).  Tensors from model inputs and weights are placed for free in any layout
(the data loader feeds shards; a weight lives where it is used).

**ILP** (Eq. 1): one-hot s_v per anchor, node costs, and the quadratic edge term linearized with the
sum-to-one formulation of Alpa's prototype: edge variables e_uv over pairs of *layouts* (algorithms
that give the producer the same output layout, or the consumer the same input layout, share their
rows / columns, which keeps e_uv small and the formulation exact), with sum_j e_ij = (sum of s_u over
algorithms of layout i) and sum_i e_ij likewise for v; pairs that cannot be resharded get no variable.
Memory (``memory_budget``, default the device capacity): one constraint per liveness step, as Alpa's
prototype.  The steps are the training step's: every anchor group's forward pass in topological order,
then their backward passes in reverse.  Each group's bytes on its fragment's busiest device are split
into weights + gradients + optimizer states (live at every step) and activations: an output kept for the
backward pass lives from its producer's forward step to its last backward use (the earliest anchor that
saves it), one nobody keeps until its last consumer's forward step, the gradient of an output from its
last consumer's backward step to its producer's, the group's other kept bytes (resharding inside it)
from its forward to its backward step; a resharded tensor an edge's consumer keeps lives from the
consumer's forward to its backward step (:meth:`IntraProblem.memory_steps`).  Only steps that can bind
get a row (:meth:`IntraProblem.liveness_rows`): steps where some interval ends (elsewhere the live set
grows into the next step), identical live sets once, none whose live set is inside another's, none
below a nearby or a largest row for every choice (the sum over anchors of the largest coefficient
difference is <= 0), none whose largest possible value fits the budget; and those rows are added
lazily: the ILP is solved, the steps where the choice exceeds the budget get their rows (the four most
violated), and it is solved again (each row is valid, so the final choice, fitting at every step, is
optimal).  The end-of-forward total, the single row this pass had before (:meth:`memory_end_of_forward`,
``solve(..., liveness=False)``), is a lower bound of the peak: the gradients of the last operators'
outputs (a GPT's logits) live on top of every kept activation at the first backward step.  The peak
counts what our memory model (:func:`search.memory.memory_per_device`, kept activations only) does not,
so it is at least the plan's ``memory_bytes`` up to a few percent.

**Solver: HiGHS (highspy), presolve off, the LP relaxation first.**  Measured on the same ILPs
(benchmarks/alpa_intra_bench.py -> results/alpa_intra.md, one DGX A100 node, wall seconds on a loaded 2-core
machine): ResNeXt-50 (batch 512) 0.12 s with HiGHS vs 0.47 s with PuLP + CBC on a 2x4 mesh, BERT-Large
(batch 32) 0.17 vs 2.6 s, GPT-2.6B (batch 32) 0.92 vs 6.0 s; 0.03-0.04 vs 0.10-0.66 s on 1x8; the same optima.  CBC
pays for building the model in Python and a process round trip; HiGHS takes numpy arrays in process.  The
sum-to-one formulation's LP relaxation was integral on every model measured without a memory budget (then
its optimum is the ILP's), so both solvers solve the LP first and run the MIP only when it is fractional:
HiGHS's MIP spends 5-10x longer around the same root LP (GPT-1.3B on 2x4: 10 s vs 1.1 s), and its presolve
spent 16 s on a 2-layer GPT that solves in 0.3 s without it.  ``solver="cbc"`` keeps PuLP + CBC available
(not a dependency).

**Weight-update sharding** (``weight_update_sharding=True``, the post-ILP pass of section 4.2): every
weight copied over k > 1 devices is stored as k shards instead (its gradient, optimizer state and update
divided by k) and gathered before use; in our IR this is a sharded weight placement, an ``Identity`` task
per shard and a ``Combine`` + ``Replicate`` to the layout the operator reads, whose backward is the
reduce-scatter of the gradient (the cost model prices the edges forward and backward).  The ILP is
solved with it applied, so the choice of algorithms sees the sharded memory and traffic.  Autograd keeps
the gathered weight for the backward pass, an operand our memory model does not count (nobody "saves" a
weight): it is added to the ILP's memory and to ``memory_bytes`` (``pcg.meta["gathered_weight_bytes"]``),
so per weight byte a device holds 1 (gathered) + (2 + optimizer states) / k (its shard, gradient and
states) where Alpa counts 1 + (1 + optimizer states) / k.

The predicted iteration time ``time_s`` is :meth:`search.mapping.MachineMapper.evaluate` of the result
(every node on its view, one after the other), not the ILP objective (they agree within a few percent:
the plan shares a weight placement or a resharding between consumers that the ILP prices per edge).

Use: ``solve_intra`` for a plan; ``IntraProblem(g, machine, mesh).solve()`` for the ILP's choice and
objective alone (no PCG built: what a caller pricing many stage/mesh pairs needs).  Prices are memoized by
structure across problems on the same machine, mesh and settings, so the repeated layers of a model, and
stages cut from it, are priced once.  Known limits: an ``AllReduce`` after an operator replicated along the
other mesh axis is priced (by :class:`GraphCost`, as the executor runs it) as one all-reduce over all the
copies, not one per mesh row; on machines whose devices share cores (``local``) a fragment's inputs from
other groups are model inputs to :meth:`GraphCost.backward_scale`, so their operators' backward is
under-priced in the ILP (``time_s`` is exact).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import product
from math import prod
from typing import Any, Mapping

import numpy as np

from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization, ShapeError, UnityError
from unity_pcg.machine import MachineSpec, MachineView
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape

from ..cost import COMPUTE_CLASSES, CostModel, GraphCost, op_class
from ..memory import SAVES_INPUTS, SAVES_OUTPUT, format_bytes, kept_fraction, node_memory_arrays

INF = math.inf
# matmuls, convolutions and embeddings (by their cost class)
HEAVY_OPS = frozenset(n for n in ops.COMPUTE_OPS if op_class(n) in COMPUTE_CLASSES | {"embedding"})


class AlpaError(UnityError, ValueError):
    """The intra-operator pass cannot plan this model on this mesh (bad mesh, nothing fits)."""


class IntraInfeasible(AlpaError):
    """No combination of parallel algorithms fits the memory budget."""


@dataclass(frozen=True)
class IntraPlan:
    pcg: PCG                      # the logical graph with parallel operators inserted
    views: dict | None            # node id -> MachineView of every non-source node
    time_s: float                 # iteration time by our cost model (MachineMapper.evaluate)
    memory_bytes: float           # busiest device by our memory model
    objective: float              # the ILP objective (s)
    solve_s: float                # solver time (s)
    status: str                   # "optimal" or "time limit" (best found)
    specs: dict                   # node label -> its sharding specs, readable
    mesh: tuple = (1, 1)
    start: int = 0
    build_s: float = 0.0          # building the ILP (costing every algorithm) (s)
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"mesh": list(self.mesh), "start": self.start, "time_s": self.time_s,
                "memory_bytes": self.memory_bytes, "objective": self.objective, "solve_s": self.solve_s,
                "build_s": self.build_s, "status": self.status, "specs": dict(self.specs),
                "stats": dict(self.stats),
                "views": {str(k): v.to_json() for k, v in sorted((self.views or {}).items())}}


# --- the mesh and tensor layouts --------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Where the pieces of a tensor sit on the mesh: the mesh axes (major first) splitting each dim,
    holding partial sums, holding copies; the other axes are unused (the pieces sit at coordinate 0)."""
    dims: tuple
    sum: tuple = ()
    copy: tuple = ()

    @staticmethod
    def whole(rank: int) -> "Layout":
        return Layout(((),) * rank)


class Mesh:
    def __init__(self, n0: int, n1: int, start: int, idle: bool = False):
        self.n = (n0, n1)
        self.start = start
        #: algorithms may leave a mesh axis idle (the operator runs at coordinate 0 of it, no copies)
        self.idle = idle
        self.active = tuple(a for a in (0, 1) if self.n[a] > 1)
        self.cache: dict = {}          # memo of _instantiate, enumerate_algos, _follow

    def size(self, axes) -> int:
        return prod(self.n[a] for a in axes)

    def dim(self, axes) -> tuple[int, int]:
        """(degree, stride) of a grid axis spread over ``axes`` (sorted; axis 0 major)."""
        axes = tuple(axes)
        if not axes:
            return (1, 1)
        if axes == (0,):
            return (self.n[0], self.n[1])
        return (self.size(axes), 1)

    def view(self, lay: Layout) -> MachineView:
        return MachineView(self.start, (self.dim(lay.copy), self.dim(lay.sum)) + tuple(self.dim(d) for d in lay.dims))

    def spec(self, lay: Layout) -> str:
        s = ",".join("S" + "".join(map(str, d)) if d else "R" for d in lay.dims)
        if lay.sum:
            s += " P" + "".join(map(str, lay.sum))
        return s


class _Infeasible(Exception):
    pass


def _sorted(axes) -> tuple:
    return tuple(sorted(set(axes)))


# --- one operator under one algorithm ---------------------------------------------------------------

@dataclass(frozen=True)
class Algo:
    """An operator's parallel algorithm: ``assign`` maps labels to mesh axes; ``resolve`` says how its
    partial sums become whole (``"ar"``: AllReduce; ``("rs", j)``: Reduce then Partition of output dim j);
    ``idle``: mesh axes the operator does not use at all (it runs at their coordinate 0, with no copies: the
    machine-mapping DP may then place it on any devices), only on a mesh that allows it."""
    assign: tuple                 # sorted ((label, axes), ...)
    resolve: Any = None
    idle: tuple = ()

    @property
    def amap(self) -> dict:
        return dict(self.assign)


@dataclass
class OpInst:
    """A compute node under an algorithm: parallel input / output shapes, layouts, task view."""
    in_lay: tuple
    out_lay: tuple                # raw (partial sums possible)
    final_lay: tuple              # after the resolution
    in_shapes: tuple
    view: MachineView


def _labels(g: PCG, nid: int):
    n = g.node(nid)
    spec = ops.get_op(n.op)
    lins = g.input_shapes(nid)
    return spec.labels(n.a, [s.logical() for s in lins], [s.sizes for s in g.shapes(nid)])


_NODE_KEYS: dict = {}


def _node_key(g: PCG, nid: int):
    """(operator, attributes, input shapes): what an operator's algorithms depend on (memoized per graph)."""
    k = (id(g), nid)
    hit = _NODE_KEYS.get(k)
    if hit is not None and hit[0] is g:
        return hit[1]
    n = g.node(nid)
    key = (n.op, n.attrs, g.input_shapes(nid))
    if len(_NODE_KEYS) > 200_000:
        _NODE_KEYS.clear()
    _NODE_KEYS[k] = (g, key)
    return key


def _instantiate(g: PCG, nid: int, algo: Algo, mesh: Mesh, lab=None) -> OpInst | None:
    """The node under ``algo``, or None if the operator refuses it (memoized per mesh by the node's
    operator, attributes and input shapes: repeated layers are instantiated once)."""
    key = (_node_key(g, nid), algo)
    try:
        return mesh.cache[key]
    except KeyError:
        pass
    out = mesh.cache[key] = _instantiate_new(g, nid, algo, mesh, lab)
    return out


def _instantiate_new(g: PCG, nid: int, algo: Algo, mesh: Mesh, lab=None) -> OpInst | None:
    n = g.node(nid)
    lab = lab or _labels(g, nid)
    amap = algo.amap
    in_lay, shapes = [], []
    for i, ref in enumerate(n.inputs):
        s = g.shape(ref)
        dims = tuple(amap.get(l, ()) for l in lab.inputs[i])
        used = {a for d in dims for a in d}
        copy = tuple(a for a in mesh.active if a not in used and a not in algo.idle)
        lay = Layout(dims, (), copy)
        try:
            shapes.append(ParallelTensorShape.of(s.sizes, [mesh.size(d) for d in dims], 1, mesh.size(copy), s.dtype))
        except ShapeError:
            return None
        in_lay.append(lay)
    try:
        inf = ops.infer(n.op, n.a, shapes)
    except (InvalidParallelization, ShapeError):
        return None
    pm = inf.piece_map
    out_labels = {l for lo in lab.outputs for l in lo}
    used_all = {a for axes in amap.values() for a in axes}
    if set(algo.idle) & used_all:
        return None
    rep = tuple(a for a in mesh.active if a not in used_all and a not in algo.idle)
    contracted = _sorted(a for l, axes in amap.items() if l not in out_labels for a in axes)
    out_lay = []
    for k, lo in enumerate(lab.outputs):
        out_lay.append(Layout(tuple(amap.get(l, ()) for l in lo), contracted, rep))
    # the task view: one (degree, stride) per task axis of the piece map
    vd = []
    for ax, deg in pm.axes:
        if ax == "~rep":
            axes = rep
        elif ax.startswith("~"):
            return None                     # inputs are never partial here
        else:
            axes = amap.get(ax, ())
        d = mesh.dim(axes)
        if d[0] != deg:
            return None
        vd.append(d)
    final = []
    for k, lay in enumerate(out_lay):
        if not lay.sum:
            final.append(lay)
        elif algo.resolve == "ar" or algo.resolve is None:
            final.append(Layout(lay.dims, (), _sorted(lay.copy + lay.sum)))
        else:
            j = algo.resolve[1]
            dims = list(lay.dims)
            new = tuple(dims[j]) + lay.sum
            if tuple(sorted(new)) != new:
                return None
            sz = g.shapes(nid)[k].sizes[j]
            if sz % mesh.size(new):
                return None
            dims[j] = new
            final.append(Layout(tuple(dims), (), lay.copy))
    return OpInst(tuple(in_lay), tuple(out_lay), tuple(final), tuple(shapes),
                  MachineView(mesh.start, tuple(vd)))


def enumerate_algos(g: PCG, nid: int, mesh: Mesh) -> list[Algo]:
    """Every algorithm of node ``nid`` on the mesh, from its labels (see module docstring)."""
    key = ("algos", _node_key(g, nid))
    if key not in mesh.cache:
        mesh.cache[key] = _enumerate_algos(g, nid, mesh)
    return list(mesh.cache[key])


def _enumerate_algos(g: PCG, nid: int, mesh: Mesh) -> list[Algo]:
    lab = _labels(g, nid)
    names = []
    for lo in lab.inputs:
        for l in lo:
            if l not in names and l not in lab.unshardable:
                names.append(l)
    out_labels = {l for lo in lab.outputs for l in lo}
    algos = []
    idle = ["~idle"] if mesh.idle else []
    for choice in product(*[[None] + idle + names for _ in mesh.active]):
        amap: dict = {}
        for ax, l in zip(mesh.active, choice):
            if l is not None and l != "~idle":
                amap[l] = amap.get(l, ()) + (ax,)
        assign = tuple(sorted(amap.items()))
        off = tuple(ax for ax, l in zip(mesh.active, choice) if l == "~idle")
        contracted = [l for l in amap if l not in out_labels]
        if not contracted:
            resolves = [None]
        else:
            resolves = ["ar"]
            if len(lab.outputs) == 1:
                resolves += [("rs", j) for j in range(len(lab.outputs[0]))]
        for r in resolves:
            a = Algo(assign, r, off)
            if _instantiate(g, nid, a, mesh, lab) is not None:
                algos.append(a)
    return algos


def _follow(g: PCG, nid: int, pos: int, lay: Layout, mesh: Mesh) -> Algo:
    """The algorithm of a merged operator that follows the layout ``lay`` of its input ``pos``."""
    key = ("follow", _node_key(g, nid), pos, lay)
    if key not in mesh.cache:
        mesh.cache[key] = _follow_new(g, nid, pos, lay, mesh)
    return mesh.cache[key]


def _follow_new(g: PCG, nid: int, pos: int, lay: Layout, mesh: Mesh) -> Algo:
    lab = _labels(g, nid)
    amap: dict = {}
    used: set = set()
    for l, axes in zip(lab.inputs[pos], lay.dims):
        if not axes or l in lab.unshardable or l in amap or used & set(axes):
            continue
        amap[l] = tuple(axes)
        used |= set(axes)
    out_labels = {l for lo in lab.outputs for l in lo}
    # on a mesh with idle axes, an axis the operand neither splits, sums nor copies stays idle
    off = tuple(a for a in mesh.active if a not in used and a not in lay.copy and a not in lay.sum) \
        if mesh.idle else ()
    res = "ar" if any(l not in out_labels for l in amap) else None
    a = Algo(tuple(sorted(amap.items())), res, off)
    if _instantiate(g, nid, a, mesh, lab) is not None:
        return a
    # drop axes until the operator accepts (fewest dropped first)
    items = sorted(amap.items())
    for k in range(len(items) - 1, -1, -1):
        for keep in _subsets(items, k):
            res = "ar" if any(l not in out_labels for l, _ in keep) else None
            a = Algo(tuple(keep), res, off)
            if _instantiate(g, nid, a, mesh, lab) is not None:
                return a
    return Algo((), None)


def _subsets(items, k):
    from itertools import combinations
    return [list(c) for c in combinations(items, k)]


# --- conversion chains (our parallel operators) -----------------------------------------------------

def convert(b, ref, src: Layout, dst: Layout, mesh: Mesh, views: dict, name: str = ""):
    """Add to builder ``b`` the parallel operators that bring ``ref`` (laid out as ``src``) to ``dst``
    (no partial sums); record each one's view in ``views``.  Raises _Infeasible when ``dst`` would
    need copies of ``src`` to be dropped."""
    cur = src
    dst_dim_axes = {a for d in dst.dims for a in d}
    if cur.sum:
        S = cur.sum
        if not set(S) & dst_dim_axes and not set(S) & set(cur.copy):
            ref = b.add("AllReduce", {"degree": mesh.size(S)}, [ref], name=f"{name}/allreduce")
            cur = Layout(cur.dims, (), _sorted(cur.copy + S))
        else:
            ref = b.add("Reduce", {"degree": mesh.size(S)}, [ref], name=f"{name}/reduce")
            cur = Layout(cur.dims, (), cur.copy)
        views[ref[0]] = mesh.view(cur)
    dims = list(cur.dims)
    for j, (s, d) in enumerate(zip(cur.dims, dst.dims)):
        if s == d or not s or d[:len(s)] == s:
            continue
        keep = s[:len(d)] if s[:len(d)] == d else ()
        drop = s[len(keep):]
        ref = b.add("Combine", {"dim": j, "degree": mesh.size(drop)}, [ref], name=f"{name}/combine{j}")
        dims[j] = keep
        cur = Layout(tuple(dims), (), cur.copy)
        views[ref[0]] = mesh.view(cur)
    if not set(cur.copy) <= set(dst.copy):
        raise _Infeasible()
    for j, (s, d) in enumerate(zip(cur.dims, dst.dims)):
        if s == d:
            continue
        new = d[len(s):]
        ref = b.add("Partition", {"dim": j, "degree": mesh.size(new)}, [ref], name=f"{name}/partition{j}")
        dims[j] = d
        cur = Layout(tuple(dims), (), cur.copy)
        views[ref[0]] = mesh.view(cur)
    extra = tuple(a for a in dst.copy if a not in cur.copy)
    if extra:
        ref = b.add("Replicate", {"degree": mesh.size(extra)}, [ref], name=f"{name}/replicate")
        cur = Layout(cur.dims, (), _sorted(cur.copy + extra))
        views[ref[0]] = mesh.view(cur)
    assert cur == dst, (cur, dst)
    return ref


def _zero_shard_layout(shape: ParallelTensorShape, lay: Layout, mesh: Mesh) -> Layout | None:
    """Weight-update sharding: the layout of a weight copied along ``lay.copy`` stored sharded along those
    axes instead (on its largest dim they divide), or None if no dim divides."""
    if not lay.copy:
        return None
    order = sorted(range(shape.rank), key=lambda j: -shape.sizes[j])
    for j in order:
        new = _sorted(lay.dims[j] + lay.copy)
        if lay.dims[j] and new[:len(lay.dims[j])] != lay.dims[j]:
            continue
        if shape.sizes[j] % mesh.size(new) == 0:
            dims = list(lay.dims)
            dims[j] = new
            return Layout(tuple(dims), (), ())
    return None


# --- anchor groups (graph simplification) -----------------------------------------------------------

def _groups(g: PCG) -> tuple[dict, list]:
    """(node -> its anchor, anchors in topological order) after merging cheap operators into their
    deepest compute operand."""
    depth: dict = {}
    anchor: dict = {}
    via: dict = {}                 # merged node -> the input position it follows
    anchors = []
    for n in g.nodes():
        if n.kind != "compute":
            depth[n.id] = 0
            continue
        depth[n.id] = 1 + max((depth[r[0]] for r in n.inputs), default=0)
        # the operand to follow: one of the output's full size first (a broadcast operand, such as a
        # position embedding added to every sample, cannot carry the batch split), then the deepest
        out_numel = max((s.numel for s in g.shapes(n.id)), default=0)
        comp = [(g.shape(r).numel >= out_numel, depth[r[0]], -pos, pos) for pos, r in enumerate(n.inputs)
                if g.node(r[0]).kind == "compute"]
        if n.op in HEAVY_OPS or not comp:
            anchor[n.id] = n.id
            anchors.append(n.id)
        else:
            pos = max(comp)[3]
            via[n.id] = pos
            anchor[n.id] = anchor[n.inputs[pos][0]]
    return anchor, anchors, via


_SHARED: dict = {}      # (machine, mesh, start, optimizer, sharding) -> caches of prices by structure


class IntraProblem:
    """The ILP of one (graph, mesh, cost model): anchors, their algorithms, node costs and memory,
    edges with their resharding costs over layouts.  :meth:`objective` prices one choice (the brute
    force of the tests uses it); :meth:`solve` solves the ILP."""

    def __init__(self, g: PCG, machine: MachineSpec, mesh: tuple[int, int], start: int = 0,
                 optimizer: str = "adam", weight_update_sharding: bool = False, deadline: float | None = None,
                 precision: str = "fp32", idle: bool = False, micro_batches: int = 1, sharded_update: bool = False):
        n0, n1 = mesh
        self.g = g
        # ``micro_batches`` M: the graph is one of M micro-batches of an iteration (gradient accumulation, a
        # pipeline stage), so a node's gradient sync and optimizer update, once per iteration, weigh 1/M of
        # a micro-batch's compute and transfers in the objective (its per-micro-batch share)
        self.micro_batches = max(int(micro_batches), 1)
        # ``sharded_update``: the optimizer update of a weight copied k ways priced at 1/k of it, as ZeRO-1 (the
        # distributed optimizer, which the memory techniques choose where it pays) shards it over the copies
        self.sharded_update = bool(sharded_update)
        # and in memory: a device holds 1/k of the optimizer states of a weight copied k ways
        # (:func:`search.memory.node_memory_arrays`)
        self.states = "sharded" if self.sharded_update else "whole"
        self.machine = machine
        self.zero = weight_update_sharding
        self._deadline = deadline
        # prices depend on structure only: problems on the same machine, mesh and settings share them
        # (the inter-operator pass asks for many stages of the same layers)
        import json
        # the executor's gradient buckets are priced over the whole step's gradient bytes (every trained
        # weight replicated: the data-parallel step), so a fragment's sync is its share of the whole's
        sync_total = float(sum(g.shapes(n.id)[0].nbytes for n in g.nodes() if n.op == "Weight"
                               and g.shapes(n.id)[0].dtype in ("float32", "float16", "bfloat16", "float64")))
        skey = (json.dumps(machine.to_json(), sort_keys=True, default=str), n0, n1, start, optimizer,
                bool(weight_update_sharding), sync_total, precision, bool(idle))
        shared = _SHARED.get(skey)
        if shared is None:
            if len(_SHARED) >= 32:
                _SHARED.clear()
            model = CostModel(machine, optimizer=optimizer, precision=precision)
            model.sync_total_bytes = sync_total or None
            shared = _SHARED[skey] = dict(mesh=Mesh(n0, n1, start, bool(idle)), model=model, edge={}, frag={}, emat={},
                                          anchor={}, unit={})
        self._unit_cache: dict = shared["unit"]
        self.mesh = shared["mesh"]
        self.model = shared["model"]
        self.anchor, self.anchors, self.via = _groups(g)
        self.members: dict = {a: [] for a in self.anchors}
        for n in g.nodes():
            if n.kind == "compute":
                self.members[self.anchor[n.id]].append(n.id)
        self._edge_cache: dict = shared["edge"]
        self._frag_cache: dict = shared["frag"]
        self._emat: dict = {}
        self._emat_struct: dict = shared["emat"]
        self._static: dict = {}
        self._anchor_cache: dict = shared["anchor"]
        self.algos: dict = {}
        self.node_cost: dict = {}
        self.node_mem: dict = {}         # anchor -> per algorithm: bytes at the end of the forward pass
        self.node_parts: dict = {}       # anchor -> per algorithm: (static, rest, per output (kept, not kept, grad))
        self.derived: dict = {}          # (anchor, k) -> {member: Algo}
        self.insts: dict = {}            # (anchor, k) -> {member: OpInst}
        for a in self.anchors:
            _check_deadline(deadline, "building the intra-operator ILP")
            self._build_anchor(a)
        _check_deadline(deadline, "building the intra-operator ILP")
        self._build_edges()
        self._build_liveness()

    # --- per anchor ----------------------------------------------------------------------------------
    def _derive(self, a: int, algo: Algo):
        g, mesh = self.g, self.mesh
        chosen = {a: algo}
        insts = {a: _instantiate(g, a, algo, mesh)}
        for m in self.members[a][1:]:
            pos = self.via[m]
            ref = g.node(m).inputs[pos]
            lay = insts[ref[0]].final_lay[ref[1]]
            al = _follow(g, m, pos, lay, mesh)
            chosen[m] = al
            insts[m] = _instantiate(g, m, al, mesh)
            if insts[m] is None:            # not even replicated: an operator our labels cannot run
                n = g.node(m)
                raise AlpaError(f"alpa intra-op: operator {n.label()} ({n.op}) refuses every layout on the "
                                f"{mesh.n[0]}x{mesh.n[1]} mesh")
        return chosen, insts

    def _build_anchor(self, a: int) -> None:
        """The algorithms of anchor ``a`` with their group's derived algorithms, node costs and memory
        (memoized by the group's structure: the layers of a deep model are priced once)."""
        mem_ids = self.members[a]
        key = (self._static_key(a), tuple(_node_key(self.g, m) for m in mem_ids), self.micro_batches,
               self.sharded_update, self.states)
        hit = self._anchor_cache.get(key)
        if hit is None:
            algos = enumerate_algos(self.g, a, self.mesh) or [Algo((), None)]
            entries, seen = [], set()
            for al in algos:            # one group's algorithms may take long on a large mesh: checked each
                _check_deadline(self._deadline, "building the intra-operator ILP")
                chosen, insts = self._derive(a, al)
                c, m, parts, once, shardable = self._group_cost(a, insts)
                if not math.isfinite(c):
                    continue
                M = self.micro_batches
                c -= (once * (M - 1) + (shardable if self.sharded_update else 0.0)) / M
                sig = (self._signature(a, insts), c, m, parts)
                if sig in seen:        # the same layouts at every boundary at the same price
                    continue
                seen.add(sig)
                entries.append((al, c, m, tuple(chosen[x] for x in mem_ids), tuple(insts[x] for x in mem_ids),
                                parts))
            hit = self._anchor_cache[key] = entries
        if not hit:
            n = self.g.node(a)
            raise AlpaError(f"alpa intra-op: operator {n.label()} ({n.op}) has no parallel algorithm on the "
                            f"{self.mesh.n[0]}x{self.mesh.n[1]} mesh that our IR can express")
        self.algos[a] = [e[0] for e in hit]
        for i, (_, _, _, chosen, insts, _) in enumerate(hit):
            self.derived[(a, i)] = dict(zip(mem_ids, chosen))
            self.insts[(a, i)] = dict(zip(mem_ids, insts))
        self.node_cost[a] = [e[1] for e in hit]
        self.node_mem[a] = [e[2] for e in hit]
        self.node_parts[a] = [e[5] for e in hit]

    def _signature(self, a: int, insts: dict):
        g = self.g
        out = []
        for x, m in enumerate(self.members[a]):
            n = g.node(m)
            for pos, r in enumerate(n.inputs):
                if self.anchor.get(r[0]) != a:
                    out.append(("in", x, pos, insts[m].in_lay[pos]))
            for k, lay in enumerate(insts[m].final_lay):
                out.append(("out", x, k, lay))
        return tuple(out)

    def _static_key(self, a: int):
        """What a group's fragment depends on besides its layouts: operators, attributes, where inputs
        come from (their shapes), what the real graph keeps (identical layers share it)."""
        hit = self._static.get(a)
        if hit is not None:
            return hit
        g = self.g
        local = {m: i for i, m in enumerate(self.members[a])}
        parts = []
        for m in self.members[a]:
            n = g.node(m)
            ins = []
            for pos, r in enumerate(n.inputs):
                p = g.node(r[0])
                if p.kind == "source":
                    ins.append(("src", p.op, g.shape(r).sizes, g.shape(r).dtype, g.is_trainable(p.id)))
                elif r[0] in local:
                    ins.append(("int", local[r[0]], r[1]))
                else:
                    ins.append(("ext", g.shape(r).sizes, g.shape(r).dtype))
            kept = tuple(kept_fraction(g, m, k) for k in range(len(g.shapes(m))))
            parts.append((n.op, n.attrs, tuple(ins), kept))
        out = self._static[a] = tuple(parts)
        return out

    def _group_cost(self, a: int, insts: dict) -> tuple[float, float, tuple, float, float]:
        """Node cost, memory and its parts of anchor group ``a`` with its members laid out as ``insts``, the
        part of the cost paid once per iteration (gradient sync, optimizer update), and the part of the update a
        sharded update over the weights' copies saves (ZeRO-1): priced on a
        fragment PCG by :class:`GraphCost` (cached by structure).  The memory is the busiest
        device's bytes; its parts, on that device: (weights + gradients + optimizer states, activations
        kept that are no member's output, per member output in order (bytes kept for backward, bytes
        not kept, bytes of its gradient)), which :meth:`_build_liveness` puts on liveness intervals."""
        g = self.g
        local = {m: i for i, m in enumerate(self.members[a])}
        static = self._static_key(a)
        key = (static, tuple((insts[m].in_lay, insts[m].final_lay, insts[m].view) for m in self.members[a]),
               self.states)
        hit = self._frag_cache.get(key)
        if hit is not None:
            return hit
        b = PCG.builder()
        views: dict = {}
        new: dict = {}
        srcs: dict = {}
        placed: dict = {}
        ext_nodes: set = set()           # placements of tensors from other groups: no memory here
        gathered: list = []              # weight-update sharding: gathered weights kept for backward
        kept: dict = {}                  # fragment ref -> fraction kept, from the real graph's consumers
        copies: dict = {}                # fragment node -> how many copies of its weights the mesh holds
        for m in self.members[a]:
            n = g.node(m)
            inst = insts[m]
            ins = []
            k_copies = 1
            for pos, r in enumerate(n.inputs):
                p = g.node(r[0])
                want = inst.in_lay[pos]
                if p.op == "Weight":
                    k_copies = max(k_copies, self.mesh.size(want.copy))
                if r[0] in local:
                    have = insts[r[0]].final_lay[r[1]]
                    ck = (("int", r), want)
                    if ck not in placed:
                        try:
                            placed[ck] = convert(b, new[r], have, want, self.mesh, views, f"m{m}.{pos}")
                        except _Infeasible:
                            self._frag_cache[key] = (INF, INF, (), 0.0, 0.0)
                            return INF, INF, (), 0.0, 0.0
                    ins.append(placed[ck])
                    continue
                if p.kind == "source":
                    if r[0] not in srcs:
                        srcs[r[0]] = b.add(p.op, p.a, [], name=p.label())
                    src = srcs[r[0]]
                    ck = (("src", r[0]), want)
                else:
                    ek = ("ext", r)
                    if ek not in srcs:
                        s = g.shape(r)
                        srcs[ek] = b.add("Input", {"name": f"ext{r[0]}_{r[1]}", "shape": s.sizes,
                                                   "dtype": s.dtype}, [])
                    src = srcs[ek]
                    ck = (ek, want)
                if ck not in placed:
                    before = set(views)
                    placed[ck] = self._place(b, src, g.shape(r), want, views, p.kind == "source" and p.op == "Weight",
                                             f"m{m}.{pos}", gathered)
                    if p.kind != "source":
                        ext_nodes |= set(views) - before
                ins.append(placed[ck])
            nid = b.add_node(n.op, n.a, ins, name=n.name)
            views[nid] = inst.view
            copies[nid] = k_copies
            for k in range(len(g.shapes(m))):
                ref = (nid, k)
                if inst.out_lay[k].sum:
                    ref = self._resolve(b, ref, inst.out_lay[k], inst.final_lay[k], views, f"m{m}")
                new[(m, k)] = ref
                kept[ref] = kept_fraction(g, m, k)
        outs = [new[(m, k)] for m in self.members[a] for k in range(len(g.shapes(m)))]
        b.set_outputs(outs)
        frag = b.finish()
        gc = GraphCost(frag, self.model)
        total = once = shardable = 0.0
        for nid in gc.nodes():
            leaf = gc.leaf_cost(nid, views[nid], views)
            total += leaf.time
            once += leaf.sync + leaf.update
            shardable += leaf.update * (1.0 - 1.0 / copies.get(nid, 1))
        n_dev = self.model.machine.num_devices     # per device: bytes held, weight bytes, whether any
        per_dev = np.zeros(n_dev)
        w_dev = np.zeros(n_dev)
        held = np.zeros(n_dev, dtype=bool)
        for nid in gc.nodes():
            if nid in ext_nodes:
                continue
            w, act, wm, am = node_memory_arrays(gc, nid, views[nid], self.states)
            for k in range(len(frag.shapes(nid))):
                if (nid, k) in kept:      # a member's output: kept as the real graph keeps it
                    less = frag.shapes(nid)[k].piece_nbytes * (kept_fraction(frag, nid, k) - kept[(nid, k)])
                    place = np.asarray(gc.placement(nid, views[nid], k), dtype=np.int64)
                    np.subtract.at(act, place, less)
                    am[place] = True
            per_dev = per_dev + w + act
            w_dev = w_dev + w
            held |= wm | am
        if held.any():
            busiest = int(np.argmax(np.where(held, per_dev, -np.inf)))   # the lowest of the busiest
            peak = float(per_dev[busiest])
        else:
            busiest, peak = None, 0.0
        static = float(w_dev[busiest] if busiest is not None else 0.0) + sum(gathered)
        outs_parts = []
        for r in outs:
            s = frag.shape(r)
            kb = float(s.piece_nbytes * kept[r])
            outs_parts.append((kb, float(s.piece_nbytes) - kb,
                               float(s.piece_nbytes) if s.dtype.startswith(("float", "bfloat")) else 0.0))
        rest = max(0.0, float(peak) - (static - sum(gathered)) - sum(p[0] for p in outs_parts))
        res = (total, float(peak) + sum(gathered), (static, rest, tuple(outs_parts)), once, shardable)
        self._frag_cache[key] = res
        return res

    def _resolve(self, b, ref, raw: Layout, final: Layout, views: dict, name: str):
        """Resolve partial sums: AllReduce, or Reduce then Partition (see :class:`Algo`)."""
        mesh = self.mesh
        if set(final.copy) >= set(raw.sum):
            ref = b.add("AllReduce", {"degree": mesh.size(raw.sum)}, [ref], name=f"{name}/allreduce")
            views[ref[0]] = mesh.view(final)
            return ref
        ref = b.add("Reduce", {"degree": mesh.size(raw.sum)}, [ref], name=f"{name}/reduce")
        views[ref[0]] = mesh.view(Layout(raw.dims, (), raw.copy))
        j = next(j for j, (x, y) in enumerate(zip(raw.dims, final.dims)) if x != y)
        ref = b.add("Partition", {"dim": j, "degree": mesh.size(raw.sum)}, [ref], name=f"{name}/partition{j}")
        views[ref[0]] = mesh.view(final)
        return ref

    def _place(self, b, src, shape, want: Layout, views: dict, weight: bool, name: str, gathered=None):
        """A source (or a fragment's external input) placed in layout ``want``; with weight-update
        sharding a copied weight is stored sharded and gathered through an Identity task (the gathered
        piece's bytes per device are appended to ``gathered``: autograd keeps it for the backward pass,
        which our memory model, seeing an operand nobody saves, does not count)."""
        mesh = self.mesh
        if weight and self.zero:
            z = _zero_shard_layout(shape, want, mesh)
            if z is not None:
                if gathered is not None:
                    gathered.append(shape.nbytes / prod(mesh.size(d) for d in want.dims))
                ref = convert(b, src, Layout.whole(shape.rank), z, mesh, views, name)
                ref = b.add("Identity", {}, [ref], name=f"{name}/shard")
                views[ref[0]] = MachineView(mesh.start, tuple(mesh.dim(d) for d in z.dims if d))
                return convert(b, ref, z, want, mesh, views, name)
        return convert(b, src, Layout.whole(shape.rank), want, mesh, views, name)

    # --- edges -------------------------------------------------------------------------------------------
    def edge_cost(self, shape: ParallelTensorShape, src: Layout, dst: Layout) -> float:
        """Forward + backward price of resharding a tensor from ``src`` to ``dst`` (inf if impossible)."""
        if src == dst:
            return 0.0
        key = (shape.sizes, shape.dtype, src, dst)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        mesh = self.mesh
        b = PCG.builder()
        views: dict = {}
        x = b.add("Input", {"name": "x", "shape": shape.sizes, "dtype": shape.dtype}, [])
        x = convert(b, x, Layout.whole(shape.rank), Layout(src.dims, (), src.copy), mesh, views, "in")
        y = b.add("Identity", {}, [x], name="producer")
        amap = {f"d{j}": d for j, d in enumerate(src.dims) if d}
        vd = []
        pm = ops.infer("Identity", {}, [b.shape(x)]).piece_map
        for ax, _ in pm.axes:
            vd.append(mesh.dim(src.copy if ax == "~rep" else amap[ax]))
        views[y[0]] = MachineView(mesh.start, tuple(vd))
        chain_start = len(views)
        try:
            z = convert(b, y, Layout(src.dims, (), src.copy), dst, mesh, views, "edge")
        except _Infeasible:
            self._edge_cache[key] = INF
            return INF
        b.set_outputs([z])
        frag = b.finish()
        gc = GraphCost(frag, self.model)
        total = 0.0
        nodes = [n for n in list(views)[chain_start:]]
        for nid in nodes:
            total += gc.leaf_cost(nid, views[nid], views).time
        self._edge_cache[key] = total
        return total

    def _build_edges(self) -> None:
        """Edges between anchor groups: (producer anchor, consumer anchor, tensor shape, per-algorithm
        producer layout, per-algorithm consumer layout)."""
        g = self.g
        self.edges = []
        for v in self.anchors:
            for m in self.members[v]:
                for pos, r in enumerate(g.node(m).inputs):
                    if g.node(r[0]).kind != "compute":
                        continue
                    u = self.anchor[r[0]]
                    if u == v:
                        continue
                    src = [self.insts[(u, i)][r[0]].final_lay[r[1]] for i in range(len(self.algos[u]))]
                    dst = [self.insts[(v, j)][m].in_lay[pos] for j in range(len(self.algos[v]))]
                    saved = SAVES_INPUTS.get(g.node(m).op)
                    self.edges.append((u, v, g.shape(r), src, dst, saved is None or pos in saved))

    # --- objective and the ILP ------------------------------------------------------------------------------
    def objective(self, choice: Mapping[int, int]) -> float:
        """ILP objective of choosing algorithm ``choice[a]`` for every anchor ``a``."""
        tot = sum(self.node_cost[a][choice[a]] for a in self.anchors)
        for u, v, shape, src, dst, saves in self.edges:
            tot += self.edge_cost(shape, src[choice[u]], dst[choice[v]])
        return tot

    def edge_memory(self, shape: ParallelTensorShape, src: Layout, dst: Layout, saves: bool) -> float:
        """Bytes per device an edge adds: the resharded tensor, when the consumer keeps it for its
        backward pass (the producer's own copy is counted with the producer)."""
        if not saves or src == dst:
            return 0.0
        return shape.nbytes / prod(self.mesh.size(d) for d in dst.dims)

    def _build_liveness(self) -> None:
        """Liveness intervals of the simplified graph's tensors over the steps of the training step
        (Alpa prototype's memory constraint per liveness step).  Steps: the forward pass of every anchor
        group in topological order (step p for the p-th), then their backward passes in reverse (step
        2K-1-p).  Weights, gradients and optimizer states live at every step; an output kept for the
        backward pass lives from its producer's forward step to the backward step of its last backward
        use (the earliest anchor saving it; its producer when the producer saves it, it is a graph
        output or nobody reads it); an output not kept lives until the forward step of its last
        consumer; its gradient from the backward step of its last consumer (the first to run
        backward) to its producer's; a group's other kept bytes (resharded inside it) from its
        forward to its backward step; a resharded tensor an edge's consumer keeps, likewise for the
        consumer.  The intervals depend on the graph only; the bytes on the algorithm."""
        import numpy as np
        g = self.g
        K = len(self.anchors)
        self.steps = 2 * K
        pos = {a: p for p, a in enumerate(self.anchors)}
        fwd = lambda p: p                       # noqa: E731
        bwd = lambda p: 2 * K - 1 - p           # noqa: E731
        outputs = set(map(tuple, g.outputs))
        self.live_iv: dict = {}                 # anchor -> list of (t0, t1), t1 inclusive
        self.live_bytes: dict = {}              # anchor -> array (algorithms x intervals)
        self.live_static: dict = {}             # anchor -> array (algorithms,)
        for a in self.anchors:
            p = pos[a]
            ivs = [(fwd(p), bwd(p))]            # the group's other kept bytes
            for m in self.members[a]:
                node = g.node(m)
                for k in range(len(g.shapes(m))):
                    uses = g.consumers((m, k))
                    ext = [pos[self.anchor[u]] for u, _ in uses if self.anchor.get(u, a) != a]
                    last = max(ext, default=p)
                    savers = []
                    for u, q in uses:
                        saved = SAVES_INPUTS.get(g.node(u).op)
                        if saved is None or q in saved:
                            savers.append(pos[self.anchor[u]])
                    if node.op in SAVES_OUTPUT or (m, k) in outputs or not uses:
                        savers.append(p)
                    keep_until = min(savers, default=p)
                    ivs.append((fwd(p), bwd(keep_until)))           # kept for backward
                    ivs.append((fwd(p), fwd(last)))                 # not kept: until its last forward use
                    ivs.append((bwd(last), bwd(p)))                 # its gradient
            parts = self.node_parts[a]
            B = np.zeros((len(parts), len(ivs)))
            for i, (static, rest, outs) in enumerate(parts):
                B[i, 0] = rest
                for x, (kb, nk, gb) in enumerate(outs):
                    B[i, 1 + 3 * x: 4 + 3 * x] = (kb, nk, gb)
            self.live_iv[a] = ivs
            self.live_bytes[a] = B
            self.live_static[a] = np.asarray([pt[0] for pt in parts], dtype=float)
        self.edge_iv = [(fwd(pos[v]), bwd(pos[v])) for u, v, *_r in self.edges]

    def memory_steps(self, choice: Mapping[int, int]):
        """Bytes per device at every liveness step of a choice (numpy array of ``self.steps``): the
        ILP's memory, step by step (see :meth:`_build_liveness`)."""
        import numpy as np
        diff = np.zeros(self.steps + 1)
        static = 0.0
        for a in self.anchors:
            i = choice[a]
            static += self.live_static[a][i]
            for (t0, t1), b in zip(self.live_iv[a], self.live_bytes[a][i]):
                if b:
                    diff[t0] += b
                    diff[t1 + 1] -= b
        for (u, v, shape, src, dst, saves), (t0, t1) in zip(self.edges, self.edge_iv):
            b = self.edge_memory(shape, src[choice[u]], dst[choice[v]], saves)
            if b:
                diff[t0] += b
                diff[t1 + 1] -= b
        return static + np.cumsum(diff)[:-1]

    def memory(self, choice: Mapping[int, int]) -> float:
        """The ILP's memory per device of a choice: the largest over the liveness steps."""
        return float(self.memory_steps(choice).max(initial=0.0))

    def memory_end_of_forward(self, choice: Mapping[int, int]) -> float:
        """The single row this pass used before the liveness steps: every group's busiest device at the
        end of the forward pass plus the resharded tensors consumers keep (a lower bound of
        :meth:`memory`: the comparison of the tests and of ``stats``)."""
        tot = sum(self.node_mem[a][choice[a]] for a in self.anchors)
        for u, v, shape, src, dst, saves in self.edges:
            tot += self.edge_memory(shape, src[choice[u]], dst[choice[v]], saves)
        return tot

    def liveness_rows(self, alive: Mapping[int, list] | None = None, budget: float | None = None) -> list:
        """The liveness steps whose constraint can bind: steps where some interval ends (at any other
        step the live set only grows into the next one), identical live sets once, none whose live set
        is inside another's (its row is dominated: every coefficient is at most the other's), and, given
        a ``budget``, none whose largest possible value (each anchor's largest coefficient among the
        ``alive`` algorithms, each edge's largest) fits it.  Returns the kept steps, ascending."""
        import numpy as np
        ivs: list = []
        owners: list = []                   # (anchor or None, index) per interval
        for a in self.anchors:
            B = self.live_bytes[a]
            for j, iv in enumerate(self.live_iv[a]):
                if B[:, j].any():
                    ivs.append(iv)
                    owners.append((a, j))
        for e, iv in enumerate(self.edge_iv):
            M = self.edge_matrices(e)[3]
            if M.any():
                ivs.append(iv)
                owners.append((None, e))
        if not ivs:
            return [0] if self.steps else []
        t0 = np.asarray([iv[0] for iv in ivs])
        t1 = np.asarray([iv[1] for iv in ivs])
        cand = np.unique(t1)
        L = (t0[None, :] <= cand[:, None]) & (cand[:, None] <= t1[None, :])
        # identical live sets once; then drop the sets inside another one
        _, first = np.unique(L, axis=0, return_index=True)
        first = np.sort(first)
        cand, L = cand[first], L[first]
        Lf = L.astype(np.float32)
        inter = Lf @ Lf.T
        size = Lf.sum(axis=1)
        sub = (inter >= size[:, None] - 0.5)            # row i's set inside row j's
        np.fill_diagonal(sub, False)
        keep = ~sub.any(axis=1)
        cand, L = cand[keep], L[keep]
        # a row below another one for every choice is dropped: row t never exceeds row t' when the sum over
        # anchors (and edges) of the largest coefficient difference c(t) - c(t') is <= 0 (differences can
        # cancel across anchors, which coefficient-wise comparison misses: the transient of one forward step
        # against the next layer's kept activations); compared with nearby steps and the largest rows
        cols = [(C[alive[a]] if alive else C) for a in self.anchors for C in (self.step_coefs(a, cand),)]
        emax = []
        for e, (lo, hi) in enumerate(self.edge_iv):
            M = self.edge_matrices(e)[3]
            if M.any():
                emax.append((lo, hi, float(M.max()), float(M.min())))
        seg = np.cumsum([0] + [len(C) for C in cols])[:-1]
        A = np.vstack(cols) if cols else np.zeros((0, len(cand)))
        n = len(cand)
        dropped = np.zeros(n, dtype=bool)
        largest = np.maximum.reduceat(A, seg, axis=0).sum(axis=0) if len(A) else np.zeros(n)
        biggest = [int(j) for j in np.argsort(-largest, kind="stable")[:4]]

        def below(i, j):
            d = np.maximum.reduceat(A[:, i] - A[:, j], seg).sum() if len(A) else 0.0
            for lo, hi, mx, mn in emax:
                li, lj = lo <= cand[i] <= hi, lo <= cand[j] <= hi
                d += (mx if li and not lj else 0.0) - (mn if lj and not li else 0.0)
            return d <= 0.0
        for i in range(n):
            for j in sorted(set(range(max(0, i - 3), min(n, i + 4))) | set(biggest)):
                if j != i and not dropped[j] and below(i, j):
                    dropped[i] = True
                    break
        cand = cand[~dropped]
        A = A[:, ~dropped]
        if budget is None or not math.isfinite(budget):
            return [int(t) for t in cand]
        tot = np.maximum.reduceat(A, seg, axis=0).sum(axis=0) if len(A) else np.zeros(len(cand))
        for lo, hi, mx, _ in emax:
            tot += np.where((lo <= cand) & (cand <= hi), mx, 0.0)
        return [int(t) for t, v in zip(cand, tot) if v > budget * (1 - 1e-9)]

    def step_coefs(self, a: int, steps):
        """Bytes per device anchor ``a``'s algorithms hold at each of ``steps``: (algorithms x steps)."""
        import numpy as np
        steps = np.asarray(steps)
        iv = np.asarray(self.live_iv[a]).reshape(-1, 2)
        live = (iv[:, 0][:, None] <= steps[None, :]) & (steps[None, :] <= iv[:, 1][:, None])
        return self.live_static[a][:, None] + self.live_bytes[a] @ live.astype(float)

    def size(self) -> dict:
        return {"anchors": len(self.anchors), "algorithms": sum(len(self.algos[a]) for a in self.anchors),
                "edges": len(self.edges), "compute_nodes": sum(len(m) for m in self.members.values())}

    def edge_matrices(self, e: int):
        """Edge ``e``'s producer layouts, consumer layouts (each with the algorithms giving it), and the
        cost and memory of every pair (numpy arrays; inf where it cannot be resharded)."""
        hit = self._emat.get(e)
        if hit is None:
            import numpy as np
            u, v, shape, src, dst, saves = self.edges[e]
            cu, cv = _classes(src), _classes(dst)
            mkey = (shape.sizes, shape.dtype, saves, tuple(l for l, _ in cu), tuple(l for l, _ in cv))
            mats = self._emat_struct.get(mkey)
            if mats is None:
                C = np.array([[self.edge_cost(shape, lu, lv) for lv, _ in cv] for lu, _ in cu], dtype=float)
                M = np.array([[self.edge_memory(shape, lu, lv, saves) for lv, _ in cv] for lu, _ in cu],
                             dtype=float)
                mats = self._emat_struct[mkey] = (C, M)
            C, M = mats
            iu = np.zeros(len(src), dtype=int)
            for ci, (_, idx) in enumerate(cu):
                iu[idx] = ci
            iv = np.zeros(len(dst), dtype=int)
            for cj, (_, idx) in enumerate(cv):
                iv[idx] = cj
            hit = self._emat[e] = (cu, cv, C, M, iu, iv)
        return hit

    #: every graph output must leave without copies (a pipeline stage's outputs: no parallel operator drops
    #: copies, so a stage cannot hand a replicated tensor to a stage that lays it out otherwise)
    copy_free_outputs: bool = False

    def copied_outputs(self) -> dict:
        """Per anchor, the indices of its algorithms that leave a graph output with copies on the mesh."""
        outs = {tuple(r) for r in self.g.outputs}
        banned: dict = {}
        for a in self.anchors:
            for i in range(len(self.algos[a])):
                for m, inst in self.insts[(a, i)].items():
                    if any((m, k) in outs and self.mesh.size(lay.copy) > 1 for k, lay in enumerate(inst.final_lay)):
                        banned.setdefault(a, set()).add(i)
                        break
        for a, out in banned.items():
            if len(out) == len(self.algos[a]):
                n = self.g.node(a)
                raise IntraInfeasible(f"alpa intra-op: operator {n.label()} ({n.op}) cannot leave its output "
                                      f"without copies on the {self.mesh.n[0]}x{self.mesh.n[1]} mesh")
        return banned

    def prune(self, use_memory: bool = True) -> dict:
        """Algorithms kept per anchor: an algorithm is dropped when another one of the same anchor costs no
        more on the node, needs no more memory (if ``use_memory``) and costs no more on every incident edge
        against every layout the other end can take (then some optimum avoids it; the optimum is unchanged)."""
        import numpy as np
        blocks: dict = {a: [np.asarray(self.node_cost[a], dtype=float)[:, None]] for a in self.anchors}
        if use_memory:          # no more bytes in any liveness interval: no larger coefficient in any row
            for a in self.anchors:
                blocks[a].append(self.live_static[a][:, None])
                blocks[a].append(self.live_bytes[a])
        for e, (u, v, *_rest) in enumerate(self.edges):
            cu, cv, C, M, iu, iv = self.edge_matrices(e)
            blocks[u].append(C[iu])
            blocks[v].append(C.T[iv])
            if use_memory:
                blocks[u].append(M[iu])
                blocks[v].append(M.T[iv])
        banned = self.copied_outputs() if self.copy_free_outputs else {}
        alive: dict = {}
        for a in self.anchors:
            M = np.hstack(blocks[a])
            out = banned.get(a, ())
            if out:                                      # a banned algorithm never dominates another
                M = M.copy()
                M[list(out)] = np.inf
            k = len(M)
            idx = np.arange(k)
            keep = []
            for i in range(k):
                if i in out:
                    continue
                le = np.all(M <= M[i], axis=1)           # algorithms at least as good everywhere
                eq = np.all(M == M[i], axis=1)
                dom = le & (~eq | (idx < i))             # strictly better somewhere, or equal and earlier
                if not dom.any():
                    keep.append(i)
            alive[a] = keep
        return alive

    def solve(self, memory_budget: float | None = None, time_limit_s: float = 30.0, solver: str = "highs",
              mip_gap: float = 1e-7, liveness: bool = True, deadline: float | None = None,
              memory_price: float = 0.0):
        """(choice, objective, status, solve seconds); raises IntraInfeasible if nothing fits.  ``mip_gap``:
        the relative optimality gap at which the MIP stops (only when the LP relaxation is fractional).
        ``liveness=False``: the single end-of-forward row this pass used before (:meth:`memory_end_of_forward`;
        for comparisons: the result may then exceed the budget at another step).  ``memory_price``: seconds per
        byte added to the objective for each algorithm's end-of-forward bytes (:attr:`node_mem`) and each
        resharded tensor's (the Lagrangian of the memory rows; the returned objective is the time alone)."""
        use_mem = memory_budget is not None and math.isfinite(memory_budget)
        mem_of = self.memory if liveness else self.memory_end_of_forward
        alive = self.prune(use_mem or memory_price > 0)
        cols_cost: list = []
        col_int: list = []
        svar: dict = {}
        for a in self.anchors:
            for i in alive[a]:
                svar[(a, i)] = len(cols_cost)
                cols_cost.append(self.node_cost[a][i] + memory_price * self.node_mem[a][i])
                col_int.append(True)
        rows: list = []                     # (coefficients {col: v}, lo, hi)
        emem: dict = {}                     # edge variable -> bytes per device it adds
        edge_cols: list = []                # (u, v, u's layout classes, v's, {(class u, class v): column})
        for a in self.anchors:
            rows.append(({svar[(a, i)]: 1.0 for i in alive[a]}, 1.0, 1.0))
        for e, (u, v, *_rest) in enumerate(self.edges):
            cu_all, cv_all, C, Mm, iu, iv = self.edge_matrices(e)
            # the layouts the kept algorithms give (class index in the full matrices -> those algorithms)
            cu: dict = {}
            for i in alive[u]:
                cu.setdefault(int(iu[i]), []).append(i)
            cv: dict = {}
            for j in alive[v]:
                cv.setdefault(int(iv[j]), []).append(j)
            row_u = {ci: {} for ci in cu}
            row_v = {cj: {} for cj in cv}
            ecols: dict = {}
            edge_cols.append((u, v, iu, iv, ecols))
            for ci in cu:
                for cj in cv:
                    c = float(C[ci, cj])
                    if not math.isfinite(c):
                        continue
                    col = len(cols_cost)
                    cols_cost.append(c + memory_price * max(float(Mm[ci, cj]), 0.0))
                    col_int.append(False)
                    ecols[(ci, cj)] = col
                    emem[col] = float(Mm[ci, cj])
                    row_u[ci][col] = 1.0
                    row_v[cj][col] = 1.0
            for ci, members in cu.items():
                r = dict(row_u[ci])
                for i in members:
                    r[svar[(u, i)]] = r.get(svar[(u, i)], 0.0) - 1.0
                rows.append((r, 0.0, 0.0))
            for cj, members in cv.items():
                r = dict(row_v[cj])
                for j in members:
                    r[svar[(v, j)]] = r.get(svar[(v, j)], 0.0) - 1.0
                rows.append((r, 0.0, 0.0))
        mem_rows: list = []
        cand: list = []
        row_of: dict = {}                   # liveness step -> its row
        # memory rows relative to the budget: coefficients of order one keep the solver's tolerances meaningful
        scale = 1.0 / max(float(memory_budget), 1.0) if use_mem else 1.0

        def add_rows(steps):
            """One row per liveness step of ``steps``: every kept algorithm's bytes at that step, every
            edge variable's resharded tensor when the step is inside its consumer's interval."""
            import numpy as np
            st = np.asarray(steps)
            coefs = [dict() for _ in steps]
            for a in self.anchors:
                C = self.step_coefs(a, st) * scale
                for i in alive[a]:
                    col = svar[(a, i)]
                    for r, v in enumerate(C[i]):
                        if v > 0:
                            coefs[r][col] = float(v)
            for (e, ecols), (lo, hi) in zip(enumerate(edge_cols), self.edge_iv):
                for col in ecols[4].values():
                    b = emem.get(col, 0.0)
                    if b <= 0:
                        continue
                    for r, t in enumerate(steps):
                        if lo <= t <= hi:
                            coefs[r][col] = b * scale
            for t, c in zip(steps, coefs):
                row_of[t] = len(rows)
                mem_rows.append(len(rows))
                rows.append((c, -INF, 1.0))

        if use_mem and liveness:
            # rows are added lazily, each when a solution exceeds the budget at its step, among the steps
            # that can bind (liveness_rows, computed at the first violation: most solves never need it);
            # a row is a valid cut, so the final choice, fitting at every step, is optimal
            cand = None
        elif use_mem:
            c = {svar[(a, i)]: self.node_mem[a][i] * scale for a in self.anchors for i in alive[a]}
            c.update({col: b * scale for col, b in emem.items() if b > 0})
            mem_rows.append(len(rows))
            rows.append((c, -INF, 1.0))
        t0 = time.perf_counter()
        cols_cost = [c * _SCALE for c in cols_cost]      # microseconds: keeps the solver's tolerances meaningful
        if solver not in ("highs", "cbc"):
            raise AlpaError(f"unknown ILP solver {solver!r} (known: highs, cbc)")
        def rounded(x):
            """The columns of the choice that rounds a fractional LP solution (each anchor's largest), or None
            when that choice is infeasible (a pair that cannot be resharded, over the budget)."""
            ch = {a: max(alive[a], key=lambda i: x[svar[(a, i)]]) for a in self.anchors}
            if use_mem and mem_of(ch) > memory_budget:
                return None
            vec = [0.0] * len(cols_cost)
            for a, i in ch.items():
                vec[svar[(a, i)]] = 1.0
            for u, v, iu, iv, ecols in edge_cols:
                c = ecols.get((int(iu[ch[u]]), int(iv[ch[v]])))
                if c is None:
                    return None
                vec[c] = 1.0
            return vec

        tightened = 0
        self.solves = 0
        while True:
            self.solves += 1
            # every solver run is limited by what is left of the time limit and of the deadline (each run
            # of a lazy memory-row loop included): HiGHS / CBC stop there with their best solution, if any
            limit = _time_left(time_limit_s - (time.perf_counter() - t0), deadline, "solving the intra-operator ILP")
            if solver == "highs":
                x, obj, status = _solve_highs(cols_cost, col_int, rows, limit, rounded, mip_gap)
            else:
                x, obj, status = _solve_pulp(cols_cost, col_int, rows, limit, mip_gap)
            if x is None:
                break
            choice = {a: max(alive[a], key=lambda i: x[svar[(a, i)]]) for a in self.anchors}
            if not use_mem:
                over = 0.0
                break
            if liveness:
                vals = self.memory_steps(choice)
                if cand is None and float(vals.max(initial=0.0)) > memory_budget * (1 + 1e-9):
                    cand = self.liveness_rows(alive, memory_budget)
                new = sorted((t for t in (cand or ()) if t not in row_of and vals[t] > memory_budget * (1 + 1e-9)),
                             key=lambda t: -vals[t])[:4]
                if new:                     # the most violated steps get their rows; solve again
                    add_rows(new)
                    continue
                over = float(vals.max(initial=0.0)) / memory_budget - 1.0
                rest = [t for t in (cand or ()) if t not in row_of]
                if over > 1e-9 and not mem_rows and rest:     # pragma: no cover - numerically at a dropped step
                    add_rows(rest)
                    continue
            else:
                over = mem_of(choice) / memory_budget - 1.0
            if over <= 1e-9 or tightened >= 4 or not mem_rows:
                break
            # within the solver's feasibility tolerance but over the budget: tighten the rows by as much
            tightened += 1
            for r in mem_rows:
                rows[r] = (rows[r][0], -INF, rows[r][2] - 2 * over)
        dt = time.perf_counter() - t0
        if x is None or over > 1e-9:
            # the solved plan's peak where there is one (per-operator terms may be negative: a sum of their
            # minima is no bound), else that sum where it is one
            lb = (1.0 + over) * memory_budget if x is not None else sum(min(self.node_mem[a]) for a in self.anchors)
            need = f"the leanest it found needs {_gib(lb)}" if lb > memory_budget else "none was found"
            raise IntraInfeasible(f"alpa intra-op: no parallel plan on the {self.mesh.n[0]}x{self.mesh.n[1]} mesh "
                                  f"fits the memory budget of {_gib(memory_budget)} per device ({need})"
                                  f"{'' if status == 'infeasible' else f'; solver status: {status}'}")
        self.last_rows = len(mem_rows)
        return choice, self.objective(choice), status, dt


    def unit_price(self, time_limit_s: float = 30.0, deadline: float | None = None) -> tuple[float, dict, str]:
        """(seconds per byte of the fastest choice -- its objective over its peak (:meth:`memory`) --, that
        choice, the solver's status), memoized by graph and settings: the unit of :func:`solve_intra`'s
        ``memory_price`` (at 1, halving the fastest's memory is worth half its time)."""
        key = (self.g.structural_hash(), tuple(self.g.node_ids()), self.micro_batches, self.states)
        hit = self._unit_cache.get(key)
        if hit is None:
            ch, obj, status, _ = self.solve(None, time_limit_s, deadline=deadline)
            if len(self._unit_cache) > 256:
                self._unit_cache.clear()
            hit = self._unit_cache[key] = (max(float(obj), 1e-12) / max(self.memory(ch), 1.0), ch, status)
        return hit


_SCALE = 1e6


class AlpaDeadline(AlpaError):
    """The caller's deadline (a ``time.monotonic()`` value) passed before the intra-operator pass had a plan."""


def _check_deadline(deadline: float | None, what: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise AlpaDeadline(f"alpa: the deadline passed while {what}")


def _time_left(limit_s: float, deadline: float | None, what: str) -> float:
    """Seconds a solver run may take: ``limit_s`` capped by the deadline (AlpaDeadline when none is left)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AlpaDeadline(f"alpa: the deadline passed before {what}")
        limit_s = min(limit_s, left)
    return max(limit_s, 1e-3)


def _gib(b) -> str:
    return "inf" if b is None or not math.isfinite(b) else format_bytes(b)


def _classes(lays: list, among=None) -> list:
    """Distinct layouts and the algorithm indices (of ``among``, default all) that give each."""
    out: dict = {}
    for i in (range(len(lays)) if among is None else among):
        out.setdefault(lays[i], []).append(i)
    return list(out.items())


def _quiet_highs(highspy):
    """A Highs instance without its banner (printed by the C++ constructor on stdout)."""
    import os
    import sys
    sys.stdout.flush()
    fd = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(fd, 1)
        os.close(fd)
    h.setOptionValue("output_flag", False)
    return h


def _solve_highs(cost, is_int, rows, time_limit_s, rounded=None, mip_gap=1e-7):
    import highspy
    import numpy as np
    t_start = time.perf_counter()
    h = _quiet_highs(highspy)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    # HiGHS's presolve spends seconds on these equality-heavy models (16 s vs 0.3 s on a 2-layer GPT);
    # the LP relaxation of the sum-to-one formulation is tight enough without it
    h.setOptionValue("presolve", "off")
    n = len(cost)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = len(rows)
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.ones(n)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.asarray([-inf if not math.isfinite(lo) else lo for _, lo, _ in rows], dtype=float)
    lp.row_upper_ = np.asarray([inf if not math.isfinite(hi) else hi for _, _, hi in rows], dtype=float)
    # column-wise sparse matrix
    cols: list = [[] for _ in range(n)]
    for ri, (coef, _, _) in enumerate(rows):
        for c, v in coef.items():
            if v != 0.0:
                cols[c].append((ri, v))
    start, index, value = [0], [], []
    for c in cols:
        for ri, v in c:
            index.append(ri)
            value.append(v)
        start.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.asarray(start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)
    # the LP relaxation first: the sum-to-one formulation is tight, and when its optimum is integral it is the
    # ILP's optimum (a lower bound that is feasible) -- the root LP of HiGHS's MIP is the same LP, but the
    # MIP solver spends 5-10x longer around it (GPT-1.3B on 2x4: 1.1 s vs 10 s)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
        return None, INF, "infeasible"
    if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
        x = np.asarray(h.getSolution().col_value)
        xi = x[np.asarray(is_int, dtype=bool)]
        if np.all((xi < 1e-7) | (xi > 1 - 1e-7)):
            return list(x), h.getObjectiveValue(), "optimal"
        # fractional (ties between equally priced algorithms on a cycle of the graph, or the budget): the
        # rounded choice is optimal when it prices at the LP bound, else it starts the MIP
        start = rounded(list(x)) if rounded is not None else None
        if start is not None:
            lp_obj = h.getObjectiveValue()
            r_obj = float(np.dot(lp.col_cost_, start))
            if r_obj - lp_obj <= max(1e-9 * max(1.0, abs(lp_obj)), mip_gap * abs(r_obj)):
                return start, r_obj, "optimal"     # at the LP bound, or within the gap asked for
    else:
        start = None
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in is_int]
    left = float(time_limit_s) - (time.perf_counter() - t_start)
    if left <= 0:                                  # the LP used the whole limit: no MIP run
        return None, INF, "time limit"
    h.setOptionValue("time_limit", left)
    h.passModel(lp)
    if start is not None:
        try:
            sol = highspy.HighsSolution()
            sol.col_value = list(start)
            h.setSolution(sol)
        except Exception:          # pragma: no cover - an older highspy without MIP starts
            pass
    h.run()
    st = h.getModelStatus()
    name = h.modelStatusToString(st).lower()
    if st == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif st == highspy.HighsModelStatus.kInfeasible:
        return None, INF, "infeasible"
    else:
        status = name
    info = h.getInfo()
    if info.primal_solution_status < 2:           # no feasible solution
        return None, INF, name
    x = list(h.getSolution().col_value)
    return x, h.getObjectiveValue(), status


def _solve_pulp(cost, is_int, rows, time_limit_s, mip_gap=1e-7):
    import pulp
    prob = pulp.LpProblem("alpa_intra", pulp.LpMinimize)
    xs = [pulp.LpVariable(f"x{i}", 0, 1, cat=pulp.LpContinuous) for i in range(len(is_int))]
    prob += pulp.lpSum(c * x for c, x in zip(cost, xs) if c != 0.0)
    for k, (coef, lo, hi) in enumerate(rows):
        expr = pulp.lpSum(v * xs[c] for c, v in coef.items())
        if lo == hi:
            prob += (expr == lo), f"r{k}"
        else:
            if math.isfinite(hi):
                prob += (expr <= hi), f"r{k}u"
            if math.isfinite(lo):
                prob += (expr >= lo), f"r{k}l"
    # as with HiGHS: the LP relaxation first (CBC's LP solver), the MIP when it is fractional
    prob.solve(pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit_s))
    if pulp.LpStatus[prob.status] == "Optimal":
        vals = [x.value() or 0.0 for x, b in zip(xs, is_int) if b]
        if all(v < 1e-7 or v > 1 - 1e-7 for v in vals):
            return [x.value() or 0.0 for x in xs], pulp.value(prob.objective), "optimal"
    for x, b in zip(xs, is_int):
        if b:
            x.cat = pulp.LpBinary
    prob.solve(pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit_s, gapRel=mip_gap))
    st = pulp.LpStatus[prob.status]
    if st != "Optimal":
        return None, INF, "infeasible" if st == "Infeasible" else st.lower()
    return [x.value() or 0.0 for x in xs], pulp.value(prob.objective), "optimal"


# --- the plan ----------------------------------------------------------------------------------------------

def build_plan_pcg(problem: IntraProblem, choice: Mapping[int, int]) -> tuple[PCG, dict, dict]:
    """The logical graph with every node under its chosen (or derived) algorithm: (PCG, views, specs)."""
    g, mesh = problem.g, problem.mesh
    insts: dict = {}
    for a in problem.anchors:
        insts.update(problem.insts[(a, choice[a])])
    b = PCG.builder(g.weights)
    views: dict = {}
    new: dict = {}
    placed: dict = {}
    specs: dict = {}
    gathered: list = []
    for n in g.nodes():
        if n.kind == "source":
            new[(n.id, 0)] = b.add(n.op, n.a, [], name=n.name)
            continue
        inst = insts[n.id]
        ins = []
        for pos, r in enumerate(n.inputs):
            want = inst.in_lay[pos]
            key = (tuple(r), want)
            if key not in placed:
                p = g.node(r[0])
                if p.kind == "source":
                    placed[key] = problem._place(b, new[tuple(r)], g.shape(r), want, views, p.op == "Weight",
                                                 f"{n.label()}/in{pos}", gathered)
                else:
                    placed[key] = convert(b, new[tuple(r)], insts[r[0]].final_lay[r[1]], want, mesh, views,
                                          f"{n.label()}/in{pos}")
            ins.append(placed[key])
        nid = b.add_node(n.op, n.a, ins, name=n.name)
        views[nid] = inst.view
        for k in range(len(g.shapes(n.id))):
            ref = (nid, k)
            if inst.out_lay[k].sum:
                ref = problem._resolve(b, ref, inst.out_lay[k], inst.final_lay[k], views, n.label())
            new[(n.id, k)] = ref
        specs[n.label()] = (" x ".join(mesh.spec(l) for l in inst.in_lay) + " -> "
                            + " ; ".join(mesh.spec(l) for l in inst.out_lay)
                            + ("" if inst.out_lay == inst.final_lay else
                               " => " + " ; ".join(mesh.spec(l) for l in inst.final_lay)))
    b.set_outputs([new[tuple(r)] for r in g.outputs])
    b.remove_dead()
    b.meta = dict(g.meta, strategy="alpa", mesh=list(mesh.n), mesh_start=mesh.start)
    if gathered:       # weight-update sharding: the gathered weights autograd keeps (see IntraProblem._place)
        b.meta["gathered_weight_bytes"] = float(sum(gathered))
    out = b.finish()
    views = {k: v for k, v in views.items() if k in out}
    return out, views, specs


def solve_intra(g: PCG, machine: MachineSpec, mesh: tuple[int, int], *, start: int = 0, optimizer: str = "adam",
                memory_budget: float | None = None, weight_update_sharding: bool = False,
                time_limit_s: float = 30.0, solver: str = "highs", mip_gap: float = 1e-7,
                price: bool = True, deadline: float | None = None, precision: str = "fp32",
                idle: bool = False, copy_free_outputs: bool = False, micro_batches: int = 1,
                sharded_update: bool = False, memory_price: float = 0.0) -> IntraPlan:
    """Alpa's intra-operator plan of the logical PCG ``g`` on the ``mesh`` (n0, n1) of devices
    ``start .. start+n0*n1-1`` of ``machine`` (see module docstring).  ``memory_budget``: bytes per device
    (default: the device's capacity).  ``mip_gap``: relative gap at which the MIP stops when the LP relaxation
    is fractional (default exact up to 1e-7; with 1e-4, GPT-2.6B with weight-update sharding on 2x4, whose LP
    bound is 0.009% below the optimum, takes its rounded LP solution at once: 1 s instead of 16-20 s).
    ``price=False`` skips pricing the plan (a third of the time on a GPT stage; for a caller that prices it
    itself): ``time_s`` is then the ILP objective and ``memory_bytes`` the ILP's memory.  Raises
    :class:`AlpaError` for a bad mesh or graph, :class:`IntraInfeasible` when no plan fits the budget.
    ``deadline``: a ``time.monotonic()`` value: the ILP's construction stops there and every solver run is
    limited to the time left (:class:`AlpaDeadline`, an :class:`AlpaError`, when it has passed or the solver
    found no solution by then).  ``precision``: the math mode the node and edge costs are priced in (the
    caller's cost model's: the inter-operator pass passes its mapper's).  ``idle``: operators may also leave a
    mesh axis unused (they run at its coordinate 0, without copies; not Alpa's space: the layout proposals of
    :mod:`search.layouts` use it, and the machine-mapping DP then places such operators on any devices).
    ``copy_free_outputs``: every graph output must leave partitioned (and reduced), never with copies (a
    pipeline stage that sends its outputs to a stage laid out otherwise; :class:`IntraInfeasible` when an
    output's operator cannot).  ``micro_batches``: ``g`` is one of that many micro-batches of an iteration
    (gradient accumulation, a pipeline stage): the objective counts each operator's gradient sync and update
    as 1/M of it (they run once per iteration), so the layout is the fastest over the iteration.
    ``sharded_update``: a copied weight's optimizer update is priced as ZeRO-1 shards it over the copies (where
    the caller prices the memory techniques, which choose it where it pays), and its optimizer states in memory
    as ZeRO-1 holds them (1/k on each copy).  ``memory_price`` (> 0, with ``memory_budget``
    infinite): no memory rows, a price on memory in the objective instead -- each algorithm's end-of-forward
    bytes at that many :meth:`IntraProblem.unit_price` (the Lagrangian of the memory rows: the LP stays
    integral, where exact rows make a MIP that runs for minutes on a decoder): a point of the layouts' Pareto
    front of time and memory that trades time for memory, for a caller that prices the memory techniques
    on it (they, not the ILP's memory model, decide whether it fits); :class:`AlpaError` when it is the
    fastest layout itself."""
    t0 = time.perf_counter()
    try:
        n0, n1 = (int(x) for x in mesh)
    except (TypeError, ValueError):
        raise AlpaError(f"alpa intra-op: mesh must be two positive integers, got {mesh!r}") from None
    if n0 < 1 or n1 < 1 or start < 0 or start + n0 * n1 > machine.num_devices:
        raise AlpaError(f"alpa intra-op: mesh {n0}x{n1} from device {start} does not fit the machine's "
                        f"{machine.num_devices} devices")
    for n in g.nodes():
        if n.kind == "parallel":
            raise AlpaError(f"alpa intra-op needs a logical PCG; node {n.label()} is a {n.op}")
    if memory_budget is None:
        memory_budget = float(machine.device.usable_bytes)
    _check_deadline(deadline, "the intra-operator pass")
    prob = IntraProblem(g, machine, (n0, n1), start, optimizer, weight_update_sharding, deadline=deadline,
                        precision=precision, idle=idle, micro_batches=micro_batches,
                        sharded_update=sharded_update)
    prob.copy_free_outputs = bool(copy_free_outputs)
    t1 = time.perf_counter()
    try:
        if memory_price > 0 and math.isfinite(memory_budget):
            raise AlpaError("alpa intra-op: a price on memory replaces the memory rows (memory_budget=inf)")
        if not math.isfinite(memory_budget) and (solver == "highs" or memory_price > 0):
            # the fastest layout (memoized: the priced ones start from it)
            t2 = time.perf_counter()
            unit, choice, status = prob.unit_price(time_limit_s, deadline)
            obj, solve_s = prob.objective(choice), time.perf_counter() - t2
            if memory_price > 0:
                fastest = choice
                choice, obj, status, solve_s = prob.solve(None, time_limit_s, solver, mip_gap, deadline=deadline,
                                                          memory_price=memory_price * unit)
                if choice == fastest:
                    raise AlpaError(f"alpa intra-op: at memory price {memory_price:g} the fastest layout itself")
        else:
            choice, obj, status, solve_s = prob.solve(memory_budget, time_limit_s, solver, mip_gap, deadline=deadline)
    except IntraInfeasible as e:
        if deadline is not None and time.monotonic() >= deadline:
            raise AlpaDeadline(f"alpa intra-op: the deadline passed before the ILP found a solution ({e})") from None
        raise
    pcg, views, specs = build_plan_pcg(prob, choice)
    ilp_mem = prob.memory(choice)
    live = dict(memory_rows=getattr(prob, "last_rows", 0), liveness_steps=prob.steps,
                ilp_memory_end_of_forward_bytes=prob.memory_end_of_forward(choice))
    if not price:
        return IntraPlan(pcg, views, float(obj), ilp_mem, float(obj), solve_s, status, specs, (n0, n1), start,
                         t1 - t0, dict(prob.size(), total_s=time.perf_counter() - t0, ilp_memory_bytes=ilp_mem,
                                       priced=False, **live))
    from ..mapping import MachineMapper
    # the plan as the rest of the project prices it (its own gradient bytes, not the ILP's whole-step share)
    r = MachineMapper(CostModel(machine, optimizer=optimizer, precision=precision)).evaluate(pcg, views)
    mem = float(r.memory.max_bytes) if r.memory is not None else INF
    mem += pcg.meta.get("gathered_weight_bytes", 0.0)
    return IntraPlan(pcg, views, float(r.cost), mem, float(obj), solve_s, status, specs, (n0, n1), start,
                     t1 - t0, dict(prob.size(), total_s=time.perf_counter() - t0, ilp_memory_bytes=ilp_mem,
                                   feasible=r.feasible, reason=r.reason, priced=True, **live))


__all__ = ["solve_intra", "IntraPlan", "IntraProblem", "AlpaError", "AlpaDeadline", "IntraInfeasible", "Layout", "Mesh",
           "enumerate_algos", "build_plan_pcg", "convert"]
