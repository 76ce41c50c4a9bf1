"""Lowering a plan to a per-rank torch program (DESIGN "Executor").

Every rank reads the same plan and derives, deterministically, the same global picture: for every
tensor of the PCG, which device holds each of its pieces (the machine view of its producer and the
producer's piece map, exactly as :meth:`search.cost.GraphCost.placement` reads them; rank == device id).
From that picture each rank keeps what concerns it:

* **sources**: an Input's logical value is fed on every rank and a Weight's logical value is a
  parameter on every rank, so any piece of a tensor reached from a source through parallel operators
  only (a *placement*: Partition / Replicate chains, the data loader's and the weight's layout) is a
  local slice of the logical value -- no communication.  Gradients of those slices land in the
  logical parameter's gradient (see :mod:`executor.train` for their synchronization).  These stay
  plain slices rather than DTensor Replicate -> Shard redistributions: a copy's gradient here is its own
  contribution (summed later by the gradient all-reduce), while DTensor's backward of Replicate -> Shard
  all-gathers the shards' gradients into every copy -- a message per weight per step, and a sum the
  gradient all-reduce would count again;
* **compute operators**: the rank runs the torch kernel (:mod:`executor.kernels`) of the task the
  view puts on it, on plain local tensors, with the operator's piece attributes;
* **parallel operators on activations** whose input and output sit one piece per device on one device
  set that forms a DeviceMesh (a chain of them, when the intermediate tensors are read by nobody else):
  one DTensor redistribution (:mod:`executor.dtensor`: the piece with the input's placements
  redistributed to the output's by DTensor; Partial -> Replicate an all-reduce, Shard -> Replicate an
  all-gather, Partial -> Shard a reduce-scatter, Shard -> Shard an all-to-all, the gradient redistributed
  back).  ``dtensor=False`` (or ``UNITY_PCG_DTENSOR=0``) keeps the collectives below for them too;
* **other parallel operators on activations** and **inputs of a compute task held by another device**:
  communication, with torch.distributed's own collectives where the pieces sit as a collective expects
  (one per output group; each with its autograd backward): ``AllReduce`` whose copies sit on the devices
  holding its partial sums -> ``all_reduce``; ``Reduce`` onto one of the devices holding the partial sums
  -> ``reduce`` (backward ``broadcast``); ``Combine`` onto one of the devices holding the parts ->
  ``gather`` (backward ``scatter``); ``Replicate`` from a device keeping a copy -> ``broadcast`` (backward
  ``reduce``); ``Partition`` of a piece held by one of the receivers -> ``scatter`` (backward ``gather``).
  Any other movement (a piece on devices its consumer does not use, mixed layouts) is a batch of
  point-to-point ``isend``/``irecv`` of whole pieces or slices, the gradient sent back in the backward.

Backward ordering: every rank creates its communication autograd nodes in the same global order (the
PCG's topological order), the autograd engine runs ready nodes latest-created first, and every
communication output is tied to the loss (``sinks``), so all ranks meet in the backward pass in
reverse creation order and none waits on a peer that never comes.
"""
from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from math import prod
from typing import Any, Mapping, Sequence

import torch

from unity_pcg import ops
from unity_pcg.machine import MachineView
from unity_pcg.ops.base import PieceMap, TensorMap
from unity_pcg.pcg import PCG
from unity_pcg.pieces import ravel, unravel
from unity_pcg.shape import ParallelTensorShape

from .dtensor import Redistribution, plan_redistribution
from .kernels import GENERATORS, ExecutorError, TaskContext, kernel

NON_DIFFERENTIABLE = ops.NON_DIFFERENTIABLE   # (operator, input) pairs without a gradient: OpSpec.nondiff_inputs
LOSS_WALK = ("Combine", "Batch", "Replicate", "Reduce", "AllReduce")   # what Trainer._loss_ref walks back through
FLOAT = ("float32", "float16", "bfloat16", "float64")


# --- piece geometry ----------------------------------------------------------------------------------

def piece_key(flat: int, shape: ParallelTensorShape) -> int:
    """A piece up to its copy index (copy is the most major grid axis)."""
    return flat % (shape.piece_count // shape.copy_degree)


def block(shape: ParallelTensorShape, flat: int) -> tuple[tuple[int, int], ...]:
    """The logical region (start, stop) per dim covered by piece ``flat``."""
    gi = unravel(flat, shape.grid)
    return tuple((j * d.piece, (j + 1) * d.piece) for j, d in zip(gi[2:], shape.dims))


def task_pieces(pm: PieceMap, tm: TensorMap, shape: ParallelTensorShape) -> list[int]:
    """Flat piece index (canonical grid order) of one tensor held by each task (row-major tasks)."""
    deg = dict(pm.axes)
    names = [a for a, _ in pm.axes]
    out = []
    for idx in itertools.product(*(range(deg[a]) for a in names)):
        task = dict(zip(names, idx))

        def mix(axes):
            v = 0
            for a in axes:
                v = v * deg[a] + task[a]
            return v
        gi = (mix(tm.copy), mix(tm.sum)) + tuple(mix(d) for d in tm.dims)
        out.append(ravel(gi, shape.grid))
    return out


def default_view(grid: Sequence[int]) -> MachineView:
    """Tasks on devices 0.. contiguously (used for nodes a plan gives no view)."""
    dims, acc = [], 1
    for d in reversed(tuple(grid)):
        dims.append((d, acc))
        acc *= d
    return MachineView(0, tuple(reversed(dims)))


# --- the global picture ---------------------------------------------------------------------------------

@dataclass
class Transfer:
    src: int                  # device sending
    dst: int                  # device receiving
    ref: tuple                # tensor read on the sender
    narrow: tuple | None      # (dim, start, length) applied by the sender, or None (whole piece)


@dataclass
class Source:
    """One piece a task or an output piece reads: local, derived from a source value, or received."""
    kind: str                 # "local" | "source" | "generate" | "recv"
    ref: tuple
    narrow: tuple | None = None
    slices: tuple | None = None   # kinds "source", "generate": logical region
    index: int = -1               # kind "recv": position in the exchange's receive list


@dataclass
class Exchange:
    ref: tuple                # the tensor moved
    transfers: list[Transfer]
    differentiable: bool

    def involves(self, rank: int) -> bool:
        return any(t.src == rank or t.dst == rank for t in self.transfers)


@dataclass
class Step:
    node: int
    op: str
    kind: str                         # "compute" | "parallel"
    exchanges: list[Exchange]         # run before the node (inputs held elsewhere)
    inputs: list[Source] = field(default_factory=list)    # compute: one per input; parallel: sources
    attrs: dict = field(default_factory=dict)
    ctx: TaskContext | None = None
    combine: tuple = ()               # parallel: ("cat", dim) | ("sum",) | ("one",) | ("allreduce", group)
    outputs: list[tuple] = field(default_factory=list)    # refs this rank stores
    bn_group: tuple | None = None


class Lowered:
    """The plan as one rank sees it (see module docstring)."""

    def __init__(self, g: PCG, views: Mapping[int, MachineView], rank: int, world: int, machine=None,
                 seed: int = 0, sync_batchnorm: bool = True, frozen: frozenset = frozenset(),
                 dtensor: bool | None = None, grad_inputs: frozenset = frozenset()):
        self.g = g
        # Inputs whose gradient is wanted (a pipeline stage's activations from the previous stage)
        self.grad_inputs = frozenset(grad_inputs)
        mode = os.environ.get("UNITY_PCG_DTENSOR", "1")
        if dtensor is None:           # UNITY_PCG_DTENSOR=0: the torch.distributed path only (benchmarks)
            dtensor = mode != "0"
        self.use_dtensor = bool(dtensor)
        self.dtensor_api = mode == "api"            # through DTensor objects (see Redistribution.run)
        self.redist: dict[int, tuple[tuple, Redistribution]] = {}   # chain end -> (chain input, redistribution)
        self.fused: set[int] = set()                # parallel nodes inside a redistribution (run by its end)
        self.frozen = frozenset(frozen)             # weight names that are model constants, not parameters
        self._views_in = dict(views)
        self.rank = rank
        self.world = world
        self.machine = machine
        self.sync_batchnorm = sync_batchnorm
        self.views: dict[int, MachineView] = {}
        self.role: dict[int, str] = {}
        self.origin: dict[int, int] = {}            # placement node -> its source node
        self.place: dict[tuple, list[int]] = {}     # activation ref -> device of each flat piece
        self.mine: dict[tuple, int] = {}            # activation ref -> flat piece this rank holds
        self.pm: dict[int, PieceMap] = {}
        self.groups: set[tuple] = set()             # device groups for collectives (all ranks create them)
        self.steps: list[Step] = []
        self._tags = 0
        self._classify()
        self.diff = self._differentiable()
        for n in g.nodes():
            if self.role[n.id] in ("compute", "parallel"):
                self._place(n)
        if self.use_dtensor:
            self._plan_redistributions()
        for n in g.nodes():
            r = self.role[n.id]
            if r == "compute":
                self.steps.append(self._lower_compute(n))
            elif r == "parallel":
                self.steps.append(self._lower_parallel(n))
        self.weight_uses = self._weight_uses()

    # --- roles and placements ---------------------------------------------------------------------
    def _classify(self) -> None:
        """Roles of the PCG (:meth:`PCG.roles`), with one refinement of the executor's: a random generator
        reads nothing, so every device draws the blocks it reads (counter-based, so any block equals that
        of one device's whole tensor), like a source's local slices: role ``"generator"``, and the
        parallel operators reached from it through parallel operators only ``"generator-placement"``."""
        g = self.g
        roles = g.roles()
        for n in g.nodes():
            role, o = roles[n.id], g.origin(n.id)
            if n.op in GENERATORS:
                role = "generator"
            elif role == "parallel" and g.node(o).op in GENERATORS:
                role = "generator-placement"
            self.role[n.id] = role
            if role not in ("parallel", "compute"):
                self.origin[n.id] = o
            if role == "compute":
                self.pm[n.id] = ops.infer(n.op, n.a, g.input_shapes(n.id)).piece_map

    def trainable_weights(self) -> set[int]:
        """Weight nodes that reach a differentiable operand of some compute operator."""
        out = set()
        for n in self.g.nodes():
            if self.role[n.id] != "compute":
                continue
            for pos, r in enumerate(n.inputs):
                o = self.origin.get(r[0])
                if o is None or self.role[o] != "weight":
                    continue
                if (n.op, pos) in NON_DIFFERENTIABLE or self.g.shape(r).dtype not in FLOAT:
                    continue
                if self.g.node(o).a.get("name") in self.frozen or not self.g.node(o).a.get("trainable", True):
                    continue                    # a constant of the model (the importer's folds): a buffer
                out.add(o)
        return out

    def _differentiable(self) -> dict[tuple, bool]:
        """Whether a tensor's gradient is needed: float and downstream of a trained weight."""
        g = self.g
        tw = self.trainable_weights()
        diff: dict[tuple, bool] = {}
        for n in g.nodes():
            outs = g.shapes(n.id)
            role = self.role[n.id]
            if role == "weight" or role == "weight-placement":
                d = self.origin[n.id] in tw
            elif role in ("input", "input-placement"):
                d = g.node(self.origin[n.id]).a.get("name") in self.grad_inputs
            else:
                d = any(diff[tuple(r)] for pos, r in enumerate(n.inputs)
                        if (n.op, pos) not in NON_DIFFERENTIABLE)
            for k, s in enumerate(outs):
                diff[(n.id, k)] = d and s.dtype in FLOAT
        return diff

    def _place(self, n) -> None:
        g = self.g
        if self.role[n.id] == "compute":
            grid = tuple(d for _, d in self.pm[n.id].axes)
        else:
            grid = g.shapes(n.id)[0].grid
        v = self._views_in.get(n.id) or default_view(grid)
        if v.degree != prod(grid):
            raise ExecutorError(f"node {n.label()} ({n.op}): view {v} has {v.degree} devices for {prod(grid)} tasks")
        devs = v.devices()
        if max(devs) >= self.world or min(devs) < 0:
            raise ExecutorError(f"node {n.label()} ({n.op}) runs on device {max(devs)}, but only {self.world} "
                                f"processes run the plan")
        self.views[n.id] = v
        if self.role[n.id] == "compute":
            pm = self.pm[n.id]
            for k, (tm, s) in enumerate(zip(pm.outputs, g.shapes(n.id))):
                place = [0] * s.piece_count
                for t, p in enumerate(task_pieces(pm, tm, s)):
                    place[p] = devs[t]
                self._set_place((n.id, k), place)
        else:
            self._set_place((n.id, 0), list(devs))

    def _set_place(self, ref, place) -> None:
        self.place[ref] = place
        for flat, d in enumerate(place):
            if d == self.rank:
                self.mine[ref] = flat

    def holders(self, ref) -> dict[int, list[int]]:
        s = self.g.shape(ref)
        out: dict[int, list[int]] = {}
        for flat, d in enumerate(self.place[ref]):
            out.setdefault(piece_key(flat, s), []).append(d)
        return out

    def nearest(self, holders: Sequence[int], dev: int) -> int:
        if self.machine is None:
            return min(holders)
        rank = {"local": 0, "group": 1, "node": 2, "network": 3}
        return min(holders, key=lambda h: (rank[self.machine.level(h, dev)], h))

    # --- sources of a piece ----------------------------------------------------------------------------
    def _need(self, ref, flat: int, dev: int, narrow, ex: dict) -> Source | None:
        """How device ``dev`` gets piece ``flat`` (any copy) of ``ref``, narrowed; records transfers in
        ``ex`` (ref -> Exchange).  Returns the Source for this rank when ``dev`` is this rank."""
        role = self.role[ref[0]]
        shape = self.g.shape(ref)
        if role in ("input", "weight", "input-placement", "weight-placement", "generator", "generator-placement"):
            sl = block(shape, flat)
            if narrow is not None:
                dim, start, length = narrow
                sl = tuple((a + start, a + start + length) if i == dim else (a, b) for i, (a, b) in enumerate(sl))
            if dev != self.rank:
                return None
            return Source("generate" if role.startswith("generator") else "source", ref, slices=sl)
        key = piece_key(flat, shape)
        hold = self.holders(ref)[key]
        if dev in hold:
            return Source("local", ref, narrow=narrow) if dev == self.rank else None
        src = self.nearest(hold, dev)
        e = ex.setdefault(ref, Exchange(ref, [], self.diff[ref]))
        e.transfers.append(Transfer(src, dev, ref, narrow))
        if dev == self.rank:
            idx = sum(1 for t in e.transfers[:-1] if t.dst == self.rank)
            return Source("recv", ref, index=idx)
        return None

    # --- compute operators ---------------------------------------------------------------------------
    def _lower_compute(self, n) -> Step:
        g = self.g
        pm = self.pm[n.id]
        devs = self.views[n.id].devices()
        in_shapes = g.input_shapes(n.id)
        ex: dict = {}
        mine: list[Source | None] = [None] * len(n.inputs)
        my_task = devs.index(self.rank) if self.rank in devs else None
        for i, (r, tm, s) in enumerate(zip(n.inputs, pm.inputs, in_shapes)):
            for t, p in enumerate(task_pieces(pm, tm, s)):
                src = self._need(tuple(r), p, devs[t], None, ex)
                if t == my_task:
                    mine[i] = src
        spec = ops.get_op(n.op)
        a = n.a
        pa = spec.piece_attrs(a, tuple(in_shapes), g.shapes(n.id)) if spec.piece_attrs else a
        st = Step(n.id, n.op, "compute", list(ex.values()), inputs=mine if my_task is not None else [],
                  attrs=dict(pa))
        if my_task is not None:
            outs = g.shapes(n.id)
            ctx = TaskContext(node_id=dropout_key(g, n.id))
            out_flat = [task_pieces(pm, tm, s)[my_task] for tm, s in zip(pm.outputs, outs)]
            ctx.out_logical = tuple(s.sizes for s in outs)
            ctx.out_offset = tuple(tuple(b[0] for b in block(s, f)) for s, f in zip(outs, out_flat))
            st.ctx = ctx
            st.outputs = [(n.id, k) for k in range(len(outs))]
            if n.op == "BatchNorm" and self.sync_batchnorm:
                st.bn_group = self._bn_group(n, my_task)
        if n.op == "BatchNorm" and self.sync_batchnorm:
            for t in range(len(devs)):
                grp = self._bn_group(n, t)
                if grp is not None:
                    self.groups.add(grp)
        return st

    def _bn_group(self, n, task: int) -> tuple | None:
        """Devices of the tasks that share this task's channels (and replica) but split the batch or
        spatial dims: BatchNorm's statistics are summed over them (SyncBatchNorm semantics)."""
        pm = self.pm[n.id]
        x_tm = pm.inputs[0]
        reduced = {a for j, axes in enumerate(x_tm.dims) if j != 1 for a in axes}
        if not reduced:
            return None
        names = [a for a, _ in pm.axes]
        deg = dict(pm.axes)
        devs = self.views[n.id].devices()
        me = dict(zip(names, unravel(task, [deg[a] for a in names])))
        grp = []
        for t, idx in enumerate(itertools.product(*(range(deg[a]) for a in names))):
            other = dict(zip(names, idx))
            if all(other[a] == me[a] for a in names if a not in reduced):
                grp.append(devs[t])
        return tuple(sorted(grp)) if len(grp) > 1 else None

    # --- DTensor redistributions ------------------------------------------------------------------------
    def _plan_redistributions(self) -> None:
        """Chains of parallel operators on activations (each intermediate tensor read by the next
        operator only) whose input and output sit one piece per device on one device set that forms a
        DeviceMesh become one DTensor redistribution each (:mod:`executor.dtensor`), run by the chain's
        last operator -- or nothing, when every device already holds its output piece (kind "none": a
        Combine undone by a Partition); the others keep the collectives below.  Greedy: from the start of a chain, the
        longest run of operators that fits.  A tensor the loss may be computed on (back from the model's
        output through ``LOSS_WALK`` operators, see ``Trainer._loss_ref``) ends a chain, so it exists."""
        g = self.g
        consumers: dict[tuple, list[int]] = {}
        for n in g.nodes():
            for r in n.inputs:
                consumers.setdefault(tuple(r), []).append(n.id)
        outputs = {tuple(r) for r in g.outputs}
        # tensors the loss may be computed on: back from an output through the operators the loss
        # walks through (Trainer._loss_ref); they must exist, so they never sit inside a chain
        loss_refs: set[tuple] = set()
        for r in outputs:
            loss_refs.add(r)
            while self.role.get(r[0]) == "parallel" and g.node(r[0]).op in LOSS_WALK:
                r = tuple(g.node(r[0]).inputs[0])
                loss_refs.add(r)

        def chainable(i):
            return self.role[i] == "parallel" and g.node(i).op not in ("Pipeline", "Batch")

        def link(i):
            """The operator that continues a chain after ``i`` (None where the chain ends)."""
            if (i, 0) in outputs or (i, 0) in loss_refs:
                return None
            c = consumers.get((i, 0), [])
            if len(c) != 1 or not chainable(c[0]):
                return None
            return c[0]
        has_prev = {link(i) for i in self.role if chainable(i)} - {None}
        for start in sorted(i for i in self.role if chainable(i) and i not in has_prev):
            chain = [start]
            while (nxt := link(chain[-1])) is not None:
                chain.append(nxt)
            i = 0
            while i < len(chain):
                head = tuple(g.node(chain[i]).inputs[0])
                hit = None
                if head in self.place:
                    for j in range(len(chain) - 1, i - 1, -1):
                        end = (chain[j], 0)
                        rd = plan_redistribution(g.shape(head), self.place[head], g.shape(end), self.place[end])
                        if rd is not None:
                            hit = (j, rd)
                            break
                if hit is None:
                    i += 1
                    continue
                j, rd = hit
                rd.api = self.dtensor_api
                self.redist[chain[j]] = (head, rd)
                self.fused.update(chain[i:j])
                if rd.kind != "none":
                    for sl in rd.mesh.slices():
                        self.groups.add(sl)
                i = j + 1

    def redistributions(self) -> list[tuple[int, Redistribution]]:
        """(last operator, redistribution) of every DTensor movement of the plan (all ranks alike; not
        the chains that move nothing)."""
        return sorted((i, rd) for i, (_, rd) in self.redist.items() if rd.kind != "none")

    # --- parallel operators on activations ---------------------------------------------------------------
    def _lower_parallel(self, n) -> Step:
        g = self.g
        a = n.a
        ref = tuple(n.inputs[0])
        if n.id in self.fused:            # moved by the redistribution of its chain's last operator
            return Step(n.id, n.op, "parallel", [], attrs=dict(a), combine=("fused",))
        if n.id in self.redist:
            head, rd = self.redist[n.id]
            # kind "none": every device already holds its output piece (e.g. Combine then Partition
            # back on the same devices): the piece itself, no message
            st = Step(n.id, n.op, "parallel", [], attrs=dict(a),
                      combine=("one",) if rd.kind == "none" else ("dtensor", rd))
            if self.rank in rd.mesh.devices:
                st.inputs = [Source("local", head)]
                st.outputs = [(n.id, 0)]
            return st
        s_in = g.shape(ref)
        s_out = g.shapes(n.id)[0]
        devs = self.views[n.id].devices()
        ex: dict = {}
        mine: list[Source] = []
        combine: tuple = ("one",)
        op = n.op
        if op == "AllReduce":
            grp = self._allreduce_group(n)
            if grp is not None:
                st = Step(n.id, op, "parallel", [], attrs=dict(a))
                if self.rank in devs:
                    flat_out = devs.index(self.rank)
                    gi = unravel(flat_out, s_out.grid)
                    k = a["degree"]
                    # the partial sum this rank holds is its contribution
                    st.inputs = [Source("local", ref)]
                    st.combine = ("allreduce", grp[gi_key(gi, k)])
                    st.outputs = [(n.id, 0)]
                for gg in grp.values():
                    self.groups.add(gg)
                return st
        plan = []                 # per output piece: (device, [(input flat, narrow)], combine)
        for q, dev in enumerate(devs):
            gi = list(unravel(q, s_out.grid))
            srcs: list = []
            if op in ("Partition", "Pipeline"):
                dim = a["dim"] % s_in.rank
                d = a["degree"]
                src = list(gi)
                src[0] = 0
                src[2 + dim] = gi[2 + dim] // d
                narrow = (dim, (gi[2 + dim] % d) * s_out.dims[dim].piece, s_out.dims[dim].piece)
                srcs = [(ravel(src, s_in.grid), narrow)]
                combine = ("one",)
            elif op in ("Combine", "Batch"):
                dim = a["dim"] % s_in.rank
                d = a["degree"]
                for j in range(d):
                    src = list(gi)
                    src[0] = 0
                    src[2 + dim] = gi[2 + dim] * d + j
                    srcs.append((ravel(src, s_in.grid), None))
                combine = ("cat", dim)
            elif op == "Replicate":
                src = list(gi)
                src[0] = gi[0] // a["degree"]
                srcs = [(ravel(src, s_in.grid), None)]
                combine = ("one",)
            elif op in ("Reduce", "AllReduce"):
                d = a["degree"]
                for j in range(d):
                    src = list(gi)
                    src[0] = gi[0] // d if op == "AllReduce" else gi[0]
                    src[1] = gi[1] * d + j
                    srcs.append((ravel(src, s_in.grid), None))
                combine = ("sum",)
            else:
                raise ExecutorError(f"parallel operator {op} has no lowering")
            plan.append((dev, srcs, combine))
        coll = self._collective(n, ref, plan)
        if coll is not None:
            return coll
        for dev, srcs, combine_q in plan:
            got = [self._need(ref, f, dev, nw, ex) for f, nw in srcs]
            if dev == self.rank:
                mine = got
                combine = combine_q
        st = Step(n.id, op, "parallel", list(ex.values()), inputs=mine, attrs=dict(a), combine=combine)
        if self.rank in devs:
            st.outputs = [(n.id, 0)]
        return st

    def _collective(self, n, ref, plan) -> Step | None:
        """One torch.distributed collective per output piece where the pieces sit as the collective
        expects: Reduce onto one of the devices holding its partial sums (``reduce``), Combine onto one
        of the devices holding its parts (``gather``), Replicate from a device that keeps a copy
        (``broadcast``), Partition from a device that keeps a slice (``scatter``).  None when any output piece does not fit (then: point-to-point)."""
        op = n.op
        if op not in ("Reduce", "Combine", "Batch", "Replicate", "Partition", "Pipeline"):
            return None
        hold = self.holders(ref)
        s_in = self.g.shape(ref)
        st = Step(n.id, op, "parallel", [], attrs=dict(n.a))
        groups = []
        if op in ("Partition", "Pipeline"):
            by_src = {}
            for dev, srcs, _ in plan:
                by_src.setdefault(piece_key(srcs[0][0], s_in), []).append((dev, srcs[0][1]))
            for key, outs in by_src.items():
                devs = [d for d, _ in outs]
                inside = sorted(set(hold[key]) & set(devs))
                if not inside or len(set(devs)) != len(devs) or len(devs) != n.a["degree"]:
                    return None
                grp = tuple(sorted(devs))
                groups.append(grp)
                if self.rank in grp:
                    narrows = tuple(dict(outs)[d] for d in grp)     # slice sent to each group member
                    st.combine = ("scatter", grp, inside[0], narrows)
                    st.inputs = [Source("local", ref)] if self.rank == inside[0] else []
                    st.outputs = [(n.id, 0)]
        elif op == "Replicate":
            by_src: dict = {}
            for dev, srcs, _ in plan:
                by_src.setdefault(piece_key(srcs[0][0], s_in), []).append(dev)
            for key, devs in by_src.items():
                inside = sorted(set(hold[key]) & set(devs))
                if not inside or len(set(devs)) != len(devs):
                    return None
                grp = tuple(sorted(devs))
                groups.append(grp)
                if self.rank in grp:
                    st.combine = ("broadcast", grp, inside[0])
                    st.inputs = [Source("local", ref)] if self.rank == inside[0] else []
                    st.outputs = [(n.id, 0)]
        else:
            for dev, srcs, comb in plan:
                owners = []
                for f, _ in srcs:
                    h = hold[piece_key(f, s_in)]
                    if len(h) != 1:
                        return None
                    owners.append(h[0])
                if dev not in owners or len(set(owners)) != len(owners):
                    return None
                grp = tuple(sorted(owners))
                groups.append(grp)
                if self.rank in grp:
                    st.inputs = [Source("local", ref)]
                    if op == "Reduce":
                        st.combine = ("reduce", grp, dev)
                    else:   # gather: part j comes from owners[j]
                        st.combine = ("gather", grp, dev, comb[1], tuple(grp.index(o) for o in owners))
                    if self.rank == dev:
                        st.outputs = [(n.id, 0)]
        if any(len(set(g) & set(h)) and g != h for g in groups for h in groups):
            return None       # a rank in two groups of one operator: keep it simple, point-to-point
        for grp in groups:
            self.groups.add(grp)
        return st

    def _allreduce_group(self, n) -> dict | None:
        """AllReduce as one ``all_reduce``: when every output group's k copies sit exactly on the devices
        holding its k partial sums.  Returns {group key: devices} or None (then: point-to-point)."""
        ref = tuple(n.inputs[0])
        s_in = self.g.shape(ref)
        s_out = self.g.shapes(n.id)[0]
        k = n.a["degree"]
        devs = self.views[n.id].devices()
        place_in = self.place[ref]
        out_groups: dict = {}
        in_groups: dict = {}
        for q, dev in enumerate(devs):
            gi = unravel(q, s_out.grid)
            out_groups.setdefault(gi_key(gi, k), []).append(dev)
        for f, dev in enumerate(place_in):
            gi = unravel(f, s_in.grid)
            key = (gi[0], gi[1] // k) + tuple(gi[2:])
            in_groups.setdefault(key, []).append(dev)
        res = {}
        for key, od in out_groups.items():
            idev = in_groups.get(key)
            if idev is None or sorted(idev) != sorted(od) or len(set(od)) != len(od):
                return None
            res[key] = tuple(sorted(od))
        return res

    # --- weights ----------------------------------------------------------------------------------------
    def _weight_uses(self) -> dict[str, list[tuple[tuple, int]]]:
        """Weight name -> (logical region, device) of every piece a compute task reads (trained only)."""
        g = self.g
        tw = self.trainable_weights()
        uses: dict[str, list] = {}
        for n in g.nodes():
            if self.role[n.id] != "compute":
                continue
            pm = self.pm[n.id]
            devs = self.views[n.id].devices()
            for pos, (r, tm, s) in enumerate(zip(n.inputs, pm.inputs, g.input_shapes(n.id))):
                o = self.origin.get(r[0])
                if o is None or o not in tw or (n.op, pos) in NON_DIFFERENTIABLE:
                    continue
                name = g.node(o).a["name"]
                for t, p in enumerate(task_pieces(pm, tm, s)):
                    uses.setdefault(name, []).append((block(s, p), devs[t]))
        return uses


def gi_key(gi: Sequence[int], k: int) -> tuple:
    """Group key of an AllReduce output piece: (input copy, output sum index, shard indices); its k
    copies and the k partial sums it adds share it."""
    return (gi[0] // k, gi[1]) + tuple(gi[2:])


def dropout_key(g: PCG, nid: int) -> int:
    """A node identity that survives substitutions: the names of the sources it depends on and its
    logical shape (rules create nodes with new ids and no names).  Used to key Dropout masks."""
    n = g.node(nid)
    if n.op != "Dropout":
        return 0
    seen = set()
    stack = [nid]
    names = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        m = g.node(i)
        if m.op in ("Input", "Weight"):
            names.add(m.a["name"])
        stack.extend(r[0] for r in m.inputs)
    payload = repr((sorted(names), g.shapes(nid)[0].sizes)).encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=4).digest(), "little")


def lower(g: PCG, views: Mapping[int, MachineView], rank: int, world: int, machine=None,
          sync_batchnorm: bool = True, frozen: frozenset = frozenset(), dtensor: bool | None = None,
          grad_inputs: frozenset = frozenset()) -> Lowered:
    return Lowered(g, views, rank, world, machine, sync_batchnorm=sync_batchnorm, frozen=frozen, dtensor=dtensor,
                   grad_inputs=grad_inputs)


__all__ = ["Lowered", "lower", "Step", "Source", "Exchange", "Transfer", "block", "task_pieces", "unravel",
           "ravel", "piece_key", "default_view", "dropout_key"]
