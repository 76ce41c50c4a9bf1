"""Alpa's inter-operator pass (OSDI'22 section 5, Eqs. 2-6; the equations are restored in
/work/shared/notes/alpa-oneflow.md): operator clustering, sub-mesh shapes, the stage DP over
``t_max`` with its early stop, 1F1B memory, and the plan it gives, priced in our cost model.

**Operator clustering** (:func:`cluster_operators`, Eq. 6): the shared clustering of
:func:`unity_pcg.search.stages.cluster` with Alpa's settings.  The operators are the *units* of
:func:`unity_pcg.search.sp.build_units` (a compute node with its placement chains) in topological
order.  They are grouped into ``L`` layers by Alpa's DP ``G(k, r) = min_i max{G(i-1, r-1), C(i, k)}``
subject to ``FLOP(o_i..o_k) <= (1 + delta) FLOP_total / L``, with ``C(i, k)`` the bytes the units
``i..k`` read from units before ``i``: the layers minimize the largest activation any layer receives.
Ties (a transformer's block boundaries all receive the same residual stream) are broken by the sum of
squared deviations of the layers' FLOPs from ``FLOP_total / L``, so identical blocks make identical
layers.  A layer may start only at a valid cut (no trained weight read on both sides, no partial sum
crossing).  If no clustering meets the FLOP bound (one unit heavier than it), the bound is doubled until
one does.  With fewer valid cuts than ``L`` the model has fewer layers (one more than its valid cuts,
down to the whole graph as one layer), so the clustering never refuses: transformers' exports share one
all-ones norm scale among every norm (the exporter merges equal initializers), a trained weight read on
both sides of every block boundary.

**Sub-mesh shapes** (:func:`submesh_shapes`, Appendix A): ``(1, 1), (1, 2), (1, 4), ..., (1, D)``
inside a node of ``D`` devices (the powers of two dividing ``D``, then ``D``: Appendix A assumes ``D`` a
power of two; for a node of 6 this keeps the sizes dividing each other, so they always pack), then ``(n, D)`` for ``n = 2..N`` whole nodes.  Any multiset of them
whose sizes sum to ``N * D`` covers the cluster exactly; :func:`place_submeshes` packs them (whole
nodes first, then the in-node meshes largest first, first fit), so the DP counts devices only.  Each
physical sub-mesh is tried under its logical meshes (``logical="physical"``: itself;
``"all"``: inside a node every 2-D factorization ``(a, b)`` of its size, across nodes those whose
second axis is whole nodes' devices, ``b`` a multiple of ``D``); a stage's cost on a sub-mesh is the best of them.

**Stage costs.**  ``t_intra(layers k..i, mesh)`` is the intra-operator plan of the stage's sub-PCG
(:func:`unity_pcg.search.pipeline.stage_graph` at the micro-batch size) on the mesh: a ``solve``
callback, by default :func:`unity_pcg.search.alpa.intra.solve_intra`, returning a plan with ``pcg``
and ``views``.  It is priced by our cost model (:meth:`MachineMapper.evaluate` of its views, or the
machine-mapping DP when it has none): ``t`` = iteration time minus gradient sync and optimizer update
(one micro-batch's forward + backward), ``once`` = sync + update, and per device the bytes of weights
(with gradients and optimizer states) and of one micro-batch's activations.  Results are memoized by
the stage sub-PCG's structure (node ids and names left out) and the logical mesh, so identical layers
are solved once.  Stages that cannot fit (their weights with optimizer states over the sub-mesh's
memory even if sharded over all of it) are not solved.

**The stage DP** (Eqs. 2-5): the shared :func:`unity_pcg.search.stages.stage_dp` over the sub-mesh shapes'
device counts. ``F(s, k, d; t_max)`` = the least sum of stage times of layers ``k..L-1`` cut into ``s`` stages
on ``d`` devices, each stage's ``t <= t_max`` and each stage fitting in memory with the micro-batches 1F1B
keeps in flight (Eq. 5: ``w + min(s, B) a <= capacity``, ``s`` = this stage and the ones after it);
``T*(t_max) = min_s F(s, 0, N D; t_max) + (B - 1) t_max``. ``t_max`` runs over the distinct stage times
ascending (skipping values within ``EPS = 1e-6`` s of the last one tried); the loop stops once ``B t_max``
reaches the best ``T*`` found (no later bound can do better). Each plan found is scored by Eq. 2 on its actual
stage times.

**Deadline.**  ``alpa_plan(deadline=, hard=)`` (:class:`~unity_pcg.search.budget.Deadline` objects on one clock;
``optimize --strategy alpa`` passes its budget's end and hard end) bounds every phase of the planner.  First the
*anchor* (:func:`_anchor`): this pass with data-parallel stages (:func:`mapping_standin` on one layer at a time,
``stage_cost="layer_sum"``; seconds), micro-batch counts started within
:data:`~unity_pcg.search.budget.ALPA_ANCHOR_SHARE` of the time; the result is
the faster of it and the plan below; a started count stops at ``deadline``.  Then per micro-batch count: the whole model as one stage on the whole cluster is solved first (the plan that keeps an
answer); the other stage costs are profiled until :data:`~unity_pcg.search.budget.ALPA_PROFILE_SHARE` of the
time left at the start (:data:`~unity_pcg.search.budget.ALPA_FIRST_PROFILE_SHARE` while no plan that fits is
known), each ILP limited to what is left (HiGHS's time limit; its construction checks the deadline between
operators), later ones neither built nor solved (``inf``); the stage DP stops at the deadline with its best
plan (or runs once at the largest ``t_max``).  Past the deadline the only solves are stand-ins for stages a
plan must have (the whole-cluster stage, a chosen stage not solved at its place): data parallel over the
sub-mesh, mapped by our DP (:func:`mapping_standin`; ``stats["deadline_fallback_solves"]``), which stops at
``hard`` and then maps without the DP (linear).  No further micro-batch count starts past the profiling
deadline once a plan fits, nor past ``hard`` (``stats["deadline_hit"]``).

**The plan** (:func:`alpa_plan`).  The best plan's stages are placed on the cluster, each stage's
intra plan is solved on its own sub-PCG at its place (a stage of the same structure and mesh is solved
once: its plan's sources are renamed and its views moved by whole nodes), and the pipeline is
priced with our 1F1B event simulation (:func:`unity_pcg.search.pipeline.simulate_1f1b`: per-stage
forward / backward, activation transfers between the sub-meshes, sync and update once, memory with
micro-batches in flight) and stitched into one PCG with the plan file's ``pipeline`` field, exactly
as Unity's own pipeline plans: Alpa's and Unity's numbers come from the same model.  **Joining**: no
parallel operator drops copies, so a stage before the last is solved with ``copy_free_outputs`` (its outputs
leave it partitioned, never replicated) and a stage plan that still sends copies costs ``inf``
(:func:`sends_no_copies`): the stage DP only picks stages that join.  Should the chosen stages still not join,
the stage that did not (``join_stage``) is priced ``inf`` and the DP runs again (``JOIN_RETRIES`` times; then
the plan has no PCG and ``stats["stitch_error"]`` says why).  Micro-batch
counts are Alpa's hyper-parameter: given, or by default the powers of two dividing the batch from 1
up, stopping after the first count that does not improve on a feasible plan.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec
from unity_pcg.pcg import PCG

from .. import pipeline as P
from .. import stages as S
from ..budget import ALPA_ANCHOR_SHARE, ALPA_FIRST_PROFILE_SHARE, ALPA_PROFILE_SHARE, Deadline, Expired, within
from ..cost import CostModel, GraphCost, LeafCost
from ..mapping import MachineMapper
from ..memory import memory_per_device

INF = math.inf
EPS = 1e-6                  # t_max values closer than this are skipped (the paper's epsilon)
BYTES_PER_PARAM = {"sgd": 8, "momentum": 12, "adam": 16}   # fp32 weight + gradient + optimizer states


class AlpaError(UnityError, ValueError):
    """An Alpa plan that cannot be built (no clustering, no stage plan that covers the cluster)."""


# --- sub-mesh shapes ---------------------------------------------------------------------------------

def submesh_shapes(machine: MachineSpec) -> list[tuple[int, int]]:
    """Alpa's sub-mesh shapes (Appendix A): (1, 2^k) inside a node, then (n, D) whole nodes."""
    D, N = machine.devices_per_node, machine.nodes
    out = []
    k = 1
    while k < D and D % k == 0:         # powers of two dividing D (a node of 6: 1, 2), so the sizes divide
        out.append((1, k))              # each other and always pack (Appendix A assumes D a power of two)
        k *= 2
    out.append((1, D))
    out.extend((n, D) for n in range(2, N + 1))
    return out


def logical_meshes(shape: tuple[int, int], devices_per_node: int, mode: str = "physical") -> list[tuple[int, int]]:
    """The logical meshes a physical sub-mesh is tried under (module docstring)."""
    if mode == "physical":
        return [tuple(shape)]
    if mode != "all":
        raise AlpaError(f"logical mesh mode must be 'physical' or 'all', got {mode!r}")
    size, D = shape[0] * shape[1], devices_per_node
    out = []
    for a in range(1, size + 1):
        if size % a:
            continue
        b = size // a
        if (shape[0] == 1 and D % b == 0) or (shape[0] > 1 and b % D == 0):
            out.append((a, b))
    return out


def place_submeshes(machine: MachineSpec, shapes: Sequence[tuple[int, int]]) -> list[int]:
    """First devices of sub-meshes of ``shapes`` (Alpa's shapes, sizes summing to the cluster) packed
    onto the cluster: whole-node meshes first, left to right, then the in-node meshes largest first,
    each in the first node with room (power-of-two sizes in a node of D then always fit aligned)."""
    D, N = machine.devices_per_node, machine.nodes
    if sum(n * m for n, m in shapes) != machine.num_devices:
        raise AlpaError(f"sub-meshes {list(shapes)} do not cover the {machine.num_devices} devices")
    starts = [0] * len(shapes)
    node = 0
    for j in sorted(range(len(shapes)), key=lambda j: -shapes[j][0]):
        n, m = shapes[j]
        if n > 1 or m == D:
            starts[j] = node * D
            node += n
    fill = [0] * N
    for j in sorted(range(len(shapes)), key=lambda j: (-(shapes[j][0] * shapes[j][1]), j)):
        n, m = shapes[j]
        if n > 1 or m == D:
            continue
        for x in range(node, N):
            if fill[x] + m <= D:
                starts[j] = x * D + fill[x]
                fill[x] += m
                break
        else:
            raise AlpaError(f"sub-meshes {list(shapes)} cannot be packed on {N} x {D} devices")
    return starts


# --- operator clustering (Eq. 6) ------------------------------------------------------------------------

def cluster_operators(g: PCG, roles: Mapping[int, str], layers: int, delta: float = 0.5):
    """Alpa's operator clustering (Eq. 6; module docstring): :func:`unity_pcg.search.stages.cluster` over every
    valid cut, minimizing the largest input of a layer, then the layers' squared FLOP deviations, under the
    FLOP bound ``(1 + delta)``.  Returns ``(layers, info)``: per layer ``(first unit, last unit + 1)``."""
    return S.cluster(g, roles, layers, cuts="valid", inputs=True, delta=delta)


# --- stage costs -------------------------------------------------------------------------------------------

@dataclass
class StageCost:
    t: float                          # forward + backward of one micro-batch (s)
    once: float = 0.0                 # gradient sync + optimizer update, once per iteration
    w: dict = field(default_factory=dict)   # device -> bytes of weights, gradients, optimizer states
    a: dict = field(default_factory=dict)   # device -> bytes of one micro-batch's activations
    pcg: PCG | None = None
    views: dict = field(default_factory=dict)
    mesh: tuple = ()
    reason: str = ""
    solve_s: float = 0.0
    start: int = 0                    # the first device of the mesh it was solved on

    def memory(self, in_flight: int) -> int:
        keys = set(self.w) | set(self.a)
        return max((self.w.get(d, 0) + in_flight * self.a.get(d, 0) for d in keys), default=0)


#: how many times a chosen plan whose stages do not join is replaced by the stage DP's next best
JOIN_RETRIES = 4


def _accepts(fn, name: str) -> bool:
    """Whether the callable ``fn`` names the keyword ``name`` (a user's ``solve`` callback may not; one that
    only passes ``**kw`` on is not assumed to)."""
    import inspect
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def sends_no_copies(c: "StageCost") -> "StageCost":
    """``c``, or ``c`` priced ``inf`` when its plan sends an output in copies.  A stage before the last sends
    its outputs on, and no parallel operator drops copies: the next stage could not lay such a tensor out
    its own way and the stages would not join, so the stage DP must not pick it."""
    pg = c.pcg
    if pg is None or not math.isfinite(c.t):
        return c
    for r in pg.outputs:
        k = pg.shape(tuple(r)).copy_degree
        if k > 1 and pg.node(r[0]).kind != "source":
            return replace(c, t=INF, reason=f"the stage sends {pg.node(r[0]).label()} in {k} copies, which the "
                                            f"next stage cannot lay out its own way (no parallel operator drops "
                                            f"copies)")
    return c


def _default_solve():
    import functools

    from .intra import solve_intra          # the intra-operator ILP (its own module)
    return functools.partial(solve_intra, price=False)   # the plan is priced here (StageCosts._solve)


def mapping_standin(mapper_or_model) -> Callable:
    """A stand-in for the intra-operator pass with ``solve_intra``'s interface: data parallelism over
    the sub-mesh (:func:`unity_pcg.search.pipeline.default_intra`) mapped by our machine-mapping DP.
    Used where the ILP is not wanted (tests, comparisons) and where the planner's deadline cut the ILP.
    ``deadline`` (a :class:`~unity_pcg.search.budget.Deadline`; a float or None: unbounded): the DP stops there
    and the graph is mapped without it (:meth:`MachineMapper.first_views`, linear: every node on the first
    view of its degree, ``status="first views"``)."""
    mapper = mapper_or_model if isinstance(mapper_or_model, MachineMapper) else MachineMapper(mapper_or_model)

    @dataclass
    class _Plan:
        pcg: PCG
        views: dict | None
        time_s: float
        memory_bytes: int
        objective: float = 0.0
        solve_s: float = 0.0
        status: str = "standin"
        specs: dict = field(default_factory=dict)

    def solve(g, machine, mesh, *, start=0, optimizer="adam", memory_budget=None, weight_update_sharding=False,
              time_limit_s=30.0, deadline=None, precision=None, copy_free_outputs=False):
        # copy_free_outputs: data parallelism splits every output by the batch; one that the degree leaves
        # whole is priced inf by the caller (StageCosts._solve)
        t0 = time.perf_counter()
        size = mesh[0] * mesh[1]
        res = P.sub_mesh(machine, start, size)
        pg = P.default_intra(g, res)
        status = "standin"
        try:
            if deadline is not None and not isinstance(deadline, Deadline):
                deadline = Deadline(float(deadline))             # a time.monotonic() value
            with within(deadline):
                r = mapper.optimize(pg, res)
        except Expired:
            r, status = mapper.first_views(pg, res), "first views"
            if r is None:
                raise AlpaError(f"no view of the stage fits the {mesh[0]}x{mesh[1]} sub-mesh") from None
        return _Plan(pg, dict(r.views) if r.views else None, r.cost, r.memory.max_bytes if r.memory else 0,
                     solve_s=time.perf_counter() - t0, status=status)
    return solve


class StageCosts:
    """``t_intra`` of (layers k..i, sub-mesh) by the ``solve`` callback, priced by our cost model and
    memoized by (stage structure, logical mesh, in-node offset)."""

    def __init__(self, gM: PCG, roles, layer_nodes, mapper: MachineMapper, solve: Callable, *, optimizer: str,
                 logical: str = "physical", weight_update_sharding: bool = False, time_limit_s: float = 30.0,
                 memo: dict | None = None, micro_batches: int = 1, stage_cost: str = "exact",
                 deadline: Deadline | None = None, hard: Deadline | None = None):
        if stage_cost not in ("exact", "layer_sum"):
            raise AlpaError(f"stage_cost must be 'exact' or 'layer_sum', got {stage_cost!r}")
        self.mode = stage_cost
        self.gM, self.roles, self.layer_nodes = gM, roles, layer_nodes
        self.mapper, self.machine, self.solve = mapper, mapper.machine, solve
        self.optimizer, self.logical, self.wus, self.limit = optimizer, logical, weight_update_sharding, time_limit_s
        self.memo = memo if memo is not None else {}
        self.graphs: dict = {}
        self.skeys: dict = {}
        self.solves = 0
        self.solve_s = 0.0
        self.M = micro_batches
        # ``deadline`` (a Deadline): the solves are limited to it and none starts past it (the stage costs
        # INF, reason "deadline", and its sub-PCG is not even built), except where the plan must have the
        # stage (``must=True``): there the stage falls back to data parallelism over its sub-mesh mapped by
        # our DP, which stops at ``hard`` (then mapped without the DP: linear) (``self.fallbacks``)
        self.deadline = deadline
        self.hard = hard
        self.fallbacks = 0
        self.copy_free = _accepts(solve, "copy_free_outputs")    # stages before the last asked for no copies
        self._standin = None
        per = BYTES_PER_PARAM.get(optimizer, 16)
        self.wbytes = []
        for ns in layer_nodes:
            tot = 0
            for nid in ns:
                for r in gM.node(nid).inputs:
                    n = gM.node(r[0])
                    if n.op == "Weight" and gM.is_trainable(n.id):
                        tot += gM.shape(tuple(r)).numel * per
            self.wbytes.append(tot)

    def _fallback(self) -> Callable:
        if self._standin is None:
            self._standin = mapping_standin(self.mapper)
        return self._standin

    def stage_graph(self, k: int, i: int) -> PCG:
        key = (k, i)
        if key not in self.graphs:
            nodes = [n for x in range(k, i + 1) for n in self.layer_nodes[x]]
            self.graphs[key] = P.stage_graph(self.gM, self.roles, nodes)
        return self.graphs[key]

    def lower_bound_bytes(self, k: int, i: int) -> float:
        """Weights with gradients and optimizer states of layers k..i (trained weights read by their
        nodes; shared ones counted per layer, an upper side that only skips hopeless stages)."""
        return float(sum(self.wbytes[k:i + 1]))

    def get(self, k: int, i: int, shape: tuple[int, int], start: int = 0, must: bool = False) -> StageCost:
        n, m = shape
        size = n * m
        cap = self.machine.device.usable_bytes
        if self.lower_bound_bytes(k, i) / size > cap:
            return StageCost(INF, reason="weights and optimizer states exceed the sub-mesh's memory")
        if self.mode == "layer_sum" and i > k:
            return self._layer_sum(k, i, shape, start)
        if not must and (k, i) not in self.graphs and self._late():
            # nothing will be solved: building the stage's sub-PCG (seconds on a large model) is not needed
            return StageCost(INF, mesh=tuple(shape), reason="deadline: not solved, the planner's deadline passed")
        try:
            sg = self.stage_graph(k, i)
        except UnityError as e:
            return StageCost(INF, reason=str(e))
        D = self.machine.devices_per_node
        skey = self.skeys.get((k, i))
        if skey is None:
            skey = self.skeys[(k, i)] = P.structure_key(sg)
        best = None
        last = i == len(self.layer_nodes) - 1       # the last stage's outputs go nowhere: copies allowed
        free = not last and self.copy_free          # the solve is asked for copy-free outputs
        for mesh in logical_meshes(shape, D, self.logical):
            key = (skey, tuple(mesh), start % D if n == 1 else 0, self.optimizer, self.wus, free)
            hit = self.memo.get(key)
            if hit is None or (must and not math.isfinite(hit.t) and hit.reason.startswith("deadline")):
                hit = self.memo[key] = self._solve(sg, mesh, start, must=must, copy_free=free)
                if hit.pcg is not None and hit.start == start:     # solve_at of this place reuses it
                    self.memo.setdefault(("at", skey, tuple(mesh), start % D, self.optimizer, self.wus, free),
                                         (hit, sg))
            hit = hit if last else sends_no_copies(hit)
            if best is None or hit.t < best.t:
                best = hit
        return best

    def _layer_sum(self, k: int, i: int, shape, start: int) -> StageCost:
        """``stage_cost="layer_sum"``: the stage's cost as the sum of its layers' costs, each layer
        solved alone on the mesh (its best logical mesh): per-device memory adds (the layers' plans
        use the same mesh); the resharding between the layers' plans is not counted.  Solves scale
        with the distinct layers, not the ranges."""
        parts = [self.get(x, x, shape, start) for x in range(k, i + 1)]
        if any(not math.isfinite(p.t) for p in parts):
            bad = next(p for p in parts if not math.isfinite(p.t))
            return StageCost(INF, reason=bad.reason)
        w: dict = {}
        a: dict = {}
        for p in parts:
            for d, v in p.w.items():
                w[d] = w.get(d, 0) + v
            for d, v in p.a.items():
                a[d] = a.get(d, 0) + v
        meshes = {p.mesh for p in parts}
        return StageCost(sum(p.t for p in parts), sum(p.once for p in parts), w, a, None, {},
                         parts[0].mesh if len(meshes) == 1 else tuple(shape), "", 0.0, start)

    def solve_at(self, sg: PCG, mesh, start: int, last: bool = False) -> StageCost:
        """The stage sub-PCG ``sg`` solved on ``mesh`` at device ``start``, as stitching the stages needs
        it: its sources named as ``sg``'s.  A stage of the same structure solved before on the same mesh
        at the same offset inside a node is reused: its plan's sources renamed, its views moved by whole
        nodes.  ``last``: the pipeline's last stage (its outputs may keep copies; before it, a stage that
        sends copies costs inf: :func:`sends_no_copies`)."""
        c = self._solve_at(sg, mesh, start, not last and self.copy_free)
        return c if last else sends_no_copies(c)

    def _solve_at(self, sg: PCG, mesh, start: int, free: bool) -> StageCost:
        D = self.machine.devices_per_node
        key = ("at", P.structure_key(sg), tuple(mesh), start % D, self.optimizer, self.wus, free)
        hit = self.memo.get(key)
        if hit is None:
            c = self._solve(sg, mesh, start, must=True, copy_free=free)
            self.memo[key] = (c, sg)
            return c
        c, sg0 = hit
        if c.pcg is None:
            return c
        shift = start - c.start
        names = {}
        for a, b in zip(sg0.topo_order(), sg.topo_order()):
            na, nb = sg0.node(a), sg.node(b)
            if na.kind == "source" and na.a.get("name") != nb.a.get("name"):
                names[na.a.get("name")] = nb.a.get("name")
        b = PCG.builder(sg.weights)
        for n in c.pcg.nodes():
            a = n.a
            if n.kind == "source" and a.get("name") in names:
                a = {**a, "name": names[a["name"]]}
            b.add_node(n.op, a, list(n.inputs), names.get(n.name, n.name), nid=n.id)
        b.set_outputs(c.pcg.outputs)
        b.meta = dict(c.pcg.meta)
        views = {nid: replace(v, start=v.start + shift) for nid, v in c.views.items()}
        return replace(c, pcg=b.finish(), views=views, w={d + shift: v for d, v in c.w.items()},
                       a={d + shift: v for d, v in c.a.items()}, start=start)

    def _late(self) -> bool:
        return self.deadline is not None and self.deadline.passed()

    def _solve(self, sg: PCG, mesh, start: int, must: bool = False, copy_free: bool = False) -> StageCost:
        """One stage solved and priced; ``copy_free``: the solve is asked to leave the stage's outputs without
        copies (``copy_free_outputs``: a stage before the last)."""
        t0 = time.perf_counter()
        solve = self.solve
        if self._late():
            if not must:
                return StageCost(INF, mesh=tuple(mesh), reason="deadline: not solved, the planner's deadline passed")
            solve = self._fallback()
        self.solves += 1
        kw = {}
        if solve is self.solve and self.deadline is not None:
            # the ILP reads time.monotonic(): the deadline moved onto it (the same on the real clock)
            kw["deadline"] = time.monotonic() + max(self.deadline.left(), 0.0)
        elif solve is not self.solve:
            kw["deadline"] = self.hard
        prec = getattr(self.mapper.model, "precision", "fp32")
        if prec != "fp32" and solve is self.solve:
            kw["precision"] = prec          # the ILP priced in the mapper's math mode (one cost model)
        if copy_free and _accepts(solve, "copy_free_outputs"):
            kw["copy_free_outputs"] = True
        try:
            plan = solve(sg, self.machine, tuple(mesh), start=start, optimizer=self.optimizer,
                         memory_budget=None, weight_update_sharding=self.wus, time_limit_s=self.limit, **kw)
        except UnityError as e:
            if must and solve is self.solve and self._late():      # cut by the deadline: data parallel instead
                self.solve_s += time.perf_counter() - t0
                return self._solve(sg, mesh, start, must=True, copy_free=copy_free)
            self.solve_s += time.perf_counter() - t0
            why = str(e)
            return StageCost(INF, mesh=tuple(mesh), reason=("deadline: " + why) if self._late() else why)
        if solve is not self.solve:
            self.fallbacks += 1
        pg = getattr(plan, "pcg", None)
        views = getattr(plan, "views", None)
        try:
            if pg is None:
                raise AlpaError(f"the intra pass found no plan ({getattr(plan, 'status', '?')})")
            if len(pg.outputs) != len(sg.outputs):
                raise AlpaError("the intra plan changed the stage's outputs")
            if views:
                # what MachineMapper.evaluate prices (every leaf one after the other), in one pass
                gc = GraphCost(pg, self.mapper.model)
                b = LeafCost()
                for n in gc.nodes():
                    b = b.add(gc.leaf_cost(n, views[n], views))
                mem, views, total = memory_per_device(gc, views), dict(views), b.time
            else:
                r = self.mapper.optimize(pg, P.sub_mesh(self.machine, start, mesh[0] * mesh[1]))
                b, mem, views = r.breakdown, r.memory, dict(r.views or {})
                total = r.cost if math.isfinite(r.cost) else b.time    # side by side where the DP runs so
        except UnityError as e:
            self.solve_s += time.perf_counter() - t0
            return StageCost(INF, mesh=tuple(mesh), reason=str(e))
        dt = time.perf_counter() - t0
        self.solve_s += dt
        if mem is None or not views or not math.isfinite(total):
            return StageCost(INF, mesh=tuple(mesh), reason=b.reason or "no mapping", solve_s=dt)
        once = b.sync + b.update                 # over memory at one micro-batch: Eq. 5 decides
        return StageCost(max(total - once, 0.0), once, dict(mem.weights), dict(mem.activations), pg,
                         views, tuple(mesh), "", dt, start)


# --- the whole pass ------------------------------------------------------------------------------------

@dataclass
class AlpaResult:
    pipeline: P.PipelineResult          # the plan, priced by our 1F1B simulation (cost, pcg, views, stages)
    micro_batches: int
    layers: list                        # per layer (first unit, last unit + 1)
    stages: list                        # per stage: {"layers": [k, i], "shape": [n, m], "mesh": [a, b], "start": d}
    dp_cost: float                      # Eq. 2 estimate of the chosen plan
    stats: dict = field(default_factory=dict)

    @property
    def cost(self) -> float:
        return self.pipeline.cost

    @property
    def feasible(self) -> bool:
        return self.pipeline.feasible

    def to_json(self) -> dict:
        return {"predicted_iteration_s": self.cost if math.isfinite(self.cost) else None,
                "feasible": self.feasible, "reason": self.pipeline.reason, "micro_batches": self.micro_batches,
                "layers": [list(x) for x in self.layers], "stages": self.stages,
                "dp_estimate_s": self.dp_cost if math.isfinite(self.dp_cost) else None,
                "pipeline": self.pipeline.to_json(), "stats": dict(self.stats)}


def _micro_batch_list(B: int, micro_batches) -> list[int]:
    if micro_batches is not None:
        ms = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
        for m in ms:
            if not isinstance(m, int) or isinstance(m, bool) or m < 1 or B % m:
                raise AlpaError(f"micro-batch count {m!r} does not divide the batch {B}")
        return list(dict.fromkeys(ms))
    return [m for m in (1 << k for k in range(B.bit_length())) if B % m == 0]


def alpa_plan(pcg: PCG, machine: MachineSpec, *, optimizer: str = "adam", layers: int = 8, delta: float = 0.5,
              micro_batches: int | Sequence[int] | None = None, max_stages: int | None = None,
              logical: str = "physical", solve: Callable | None = None, weight_update_sharding: bool = False,
              time_limit_s: float = 30.0, mapper: MachineMapper | None = None, stitch: bool = True,
              stage_cost: str = "exact", imbalance: float = INF, deadline: Deadline | float | None = None,
              hard: Deadline | None = None, _keep: bool = True) -> AlpaResult:
    """Alpa's plan of the logical PCG ``pcg`` for ``machine`` (module docstring).  ``solve``: the
    intra-operator pass with :func:`unity_pcg.search.alpa.intra.solve_intra`'s interface (default:
    that function).  ``micro_batches``: one count, several (the best is kept), or None (powers of two
    ascending, stopping after the first that does not improve on a feasible plan).  Raises
    :class:`AlpaError` when no plan covers the cluster.  ``stage_cost``: ``"exact"`` (every range of
    layers solved as one stage, Alpa's profiling) or ``"layer_sum"`` (:meth:`StageCosts._layer_sum`).
    ``imbalance``: stage-mesh pairs whose share of the FLOPs and share of the devices differ by more than
    this factor are not solved (Alpa's ``stage_imbalance_tolerance``; default: none skipped).
    ``deadline``: a :class:`~unity_pcg.search.budget.Deadline` (or a ``time.monotonic()`` value) the planner
    stops at, and ``hard`` (default: ``deadline``) the instant nothing but linear work runs past (module
    docstring, "Deadline")."""
    t0 = time.perf_counter()
    if deadline is not None and not isinstance(deadline, Deadline):
        deadline = Deadline(float(deadline))
    if deadline is not None:
        hard = deadline if hard is None else hard
        left = max(deadline.left(), 0.0)
        # the profiling of a micro-batch count stops here (earlier while no plan that fits is known, so that
        # the next counts' whole-cluster stage is solved before the deadline)
        prof_deadline = deadline.plus(-(1 - ALPA_PROFILE_SHARE) * left) if _keep else deadline
        first_deadline = deadline.plus(-(1 - ALPA_FIRST_PROFILE_SHARE) * left) if _keep else deadline
    else:
        hard = prof_deadline = first_deadline = None
    mapper = mapper or MachineMapper(CostModel(machine, optimizer))
    solve = solve or _default_solve()
    roles = GraphCost(pcg, mapper.model).role
    lay, info = cluster_operators(pcg, roles, layers, delta)
    cluster_s = time.perf_counter() - t0
    L = len(lay)
    layer_nodes = [[n for u in range(a, b) for n in info.units[u]] for a, b in lay]
    lflops = np.concatenate([[0.0], np.cumsum([sum(info.flops[a:b]) for a, b in lay])])
    shapes = submesh_shapes(machine)
    sizes = [n * m for n, m in shapes]
    T = machine.num_devices
    cap = machine.device.usable_bytes
    B = P.batch_size(pcg)
    ms = _micro_batch_list(B, micro_batches)
    auto = micro_batches is None
    memo: dict = {}
    best = None
    tried = []
    stats: dict = {"layers": L, "cluster_s": cluster_s, "shapes": [list(s) for s in shapes], "per_m": {},
                   "valid_cuts": int(sum(bool(v) for v in info.valid[1:]))}
    full = max(range(len(shapes)), key=lambda j: sizes[j])        # the whole cluster (Appendix A's (N, D))
    fallbacks = 0
    anchor = None
    if deadline is not None and _keep:
        anchor = _anchor(pcg, machine, dict(optimizer=optimizer, layers=layers, delta=delta,
                                            micro_batches=micro_batches, max_stages=max_stages, mapper=mapper,
                                            weight_update_sharding=weight_update_sharding,
                                            time_limit_s=time_limit_s, stitch=stitch),
                         deadline.plus(-(1 - ALPA_ANCHOR_SHARE) * left), deadline, hard, stats)

    def fits_known() -> bool:
        return (best is not None and best.feasible) or anchor is not None

    for M in ms:
        # past the hard end no count starts but the first (its stages past the deadline are stand-ins,
        # linear past ``hard``): a plan covering the cluster exists whenever one fits
        if deadline is not None and (fits_known() and prof_deadline.passed() or hard.passed() and tried):
            stats["deadline_hit"] = True            # a plan that fits and no time for another count (or none)
            break
        tm = time.perf_counter()
        try:
            gM = P.rebatch(pcg, B, B // M)
        except P.PipelineError:
            continue
        costs = StageCosts(gM, roles, layer_nodes, mapper, solve, optimizer=optimizer, logical=logical,
                           weight_update_sharding=weight_update_sharding, time_limit_s=time_limit_s, memo=memo,
                           micro_batches=M, stage_cost=stage_cost,
                           deadline=prof_deadline if fits_known() else first_deadline,
                           hard=hard)
        t = np.full((L, L, len(shapes)), INF)
        sc: dict = {}
        if not _keep and sizes[full] == T and not _layers_fit(costs, L, shapes[full], cap):
            tried.append(M)
            stats["per_m"][M] = {"skipped": "a layer does not fit on the whole cluster"}
            continue
        if deadline is not None and _keep and sizes[full] == T:
            # the whole model as one stage on the whole cluster first (without the anchor: a plan within the
            # deadline, data parallel if its ILP does not finish in time)
            c = costs.get(0, L - 1, shapes[full], must=anchor is None)
            sc[(0, L - 1, full)] = c
            t[0, L - 1, full] = c.t
        for k in range(L):
            for i in range(k, L):
                for j, sh in enumerate(shapes):
                    if (k, i, j) in sc:
                        continue
                    share = (lflops[i + 1] - lflops[k]) / lflops[-1] if lflops[-1] > 0 else 1.0
                    ratio = share / (sizes[j] / T)
                    if math.isfinite(imbalance) and not 1 / imbalance <= ratio <= imbalance:
                        sc[(k, i, j)] = StageCost(INF, reason="skipped: FLOP share and device share differ")
                        continue
                    c = costs.get(k, i, sh)
                    sc[(k, i, j)] = c
                    t[k, i, j] = c.t
        prof_s = time.perf_counter() - tm

        hold = np.full((L, L, len(shapes)), -1.0)       # Eq. 5: micro-batches each stage holds in flight
        for (k, i, j), c in sc.items():
            if math.isfinite(c.t):
                hold[k, i, j] = S.holds(c.w, c.a, cap)

        if deadline is not None:
            costs.deadline = deadline          # the chosen stages are solved at their places by the deadline
        def stage_dp():
            return S.stage_dp(L, sizes, T, M, t, fits=hold, max_stages=max_stages,
                              bounds=[(lo, lo) for lo, _ in S.t_max_bounds(t[np.isfinite(t)], eps=EPS)],
                              deadline=deadline)
        dp = stage_dp()
        found = dp.best()
        est = found[0] if found else INF
        stats["per_m"][M] = {"profile_s": prof_s, "dp_s": dp.dp_s, "t_max_tried": dp.tried,
                             "solves": costs.solves, "estimate_s": est if math.isfinite(est) else None}
        tried.append(M)
        if not found:
            if auto and best is not None:
                break
            continue
        res = _price_plan(pcg, gM, info, lay, found, M, machine, mapper, costs, shapes, stitch)
        for _ in range(JOIN_RETRIES):
            # a plan whose stages do not join (a safety net: stages are priced so that they join) is not
            # picked: the stage that did not join the ones before it is priced inf and the DP runs again
            bad = res.pipeline.stats.get("join_stage")
            if bad is None:
                break
            st = found[1][bad]
            t[st.first, st.end - 1, st.option] = INF
            hold[st.first, st.end - 1, st.option] = -1.0
            stats["join_retries"] = stats.get("join_retries", 0) + 1
            again = stage_dp().best()
            if not again:
                break
            found = again
            res = _price_plan(pcg, gM, info, lay, found, M, machine, mapper, costs, shapes, stitch)
        fallbacks += costs.fallbacks
        stats["per_m"][M].update(fallback_stages=costs.fallbacks, predicted_s=res.cost if math.isfinite(res.cost) else None, solves=costs.solves)
        rank = (not res.feasible, res.cost)
        improved = best is None or rank < (not best.feasible, best.cost)
        if improved:
            best = res
        elif auto and best.feasible:
            break
    if anchor is not None and (best is None or (not best.feasible, best.cost) > (False, anchor.cost)):
        best = anchor                    # the deadline's plan is faster than what the profiling found (or alone)
        stats["anchor_chosen"] = True
    if best is None:
        raise AlpaError(f"no pipeline of the {L} layers covers the {T} devices within memory "
                        f"(micro-batches tried: {tried})")
    if best.pipeline.stats.get("stitch_error"):
        stats["stitch_error"] = best.pipeline.stats["stitch_error"]
    if deadline is not None:
        stats["deadline_hit"] = stats.get("deadline_hit", False) or prof_deadline.passed()
        stats["deadline_fallback_solves"] = fallbacks
    best.stats = dict(stats, micro_batches_tried=tried, planner_s=time.perf_counter() - t0,
                      solves=sum(v["solves"] for v in stats["per_m"].values()))
    best.pipeline.search_s = best.stats["planner_s"]
    return best


def _layers_fit(costs: StageCosts, L: int, whole: tuple, cap: float) -> bool:
    """Whether every layer alone, solved on the whole cluster, keeps one micro-batch in flight (data
    parallel stages: on a smaller sub-mesh a layer holds the same weights and more activations per device, so
    a layer that does not fit on the whole cluster fits nowhere).  The solves are memoized for the profiling."""
    for k in range(L):
        c = costs.get(k, k, whole)
        if not math.isfinite(c.t) or S.holds(c.w, c.a, cap) < 1:
            return False
    return True


def _anchor(pcg: PCG, machine: MachineSpec, kw: dict, start_by: Deadline, stop_by: Deadline, hard: Deadline,
            stats: dict) -> "AlpaResult | None":
    """The plan that keeps :func:`alpa_plan` feasible under a deadline, found before its ILP profiling: Alpa's
    inter-operator pass with data-parallel stages (:func:`mapping_standin`, the DP's mapping of one layer at
    a time on every sub-mesh, ``stage_cost="layer_sum"``): seconds where the ILP profiling takes minutes.  Its
    micro-batch counts, the fewest first, then more while they fit and are faster, start before ``start_by``
    (the first always); a count started runs on to
    ``stop_by`` (the planner's deadline; its solves are the DP's mapping of one layer).  None when it has no plan
    that fits.  ``stats["anchor"]``: what it found."""
    t0 = time.perf_counter()
    kw = dict(kw, solve=mapping_standin(kw["mapper"]), stage_cost="layer_sum", logical="physical",
              imbalance=INF, deadline=stop_by, hard=hard, _keep=False)
    tried, why, best = [], "", None
    # Alpa's order (the fewest micro-batches first), then more while they fit and are faster
    for M in _micro_batch_list(P.batch_size(pcg), kw.pop("micro_batches")):
        if tried and start_by.passed():
            break
        tried.append(M)
        try:
            res = alpa_plan(pcg, machine, micro_batches=M, **kw)
        except AlpaError as e:
            why = str(e)
            if best is not None:
                break
            continue
        if not (res.feasible and res.pipeline.pcg is not None):
            why = res.pipeline.reason
            if best is not None:
                break
            continue
        if best is not None and res.cost >= best.cost:
            break
        best = res
    stats["anchor"] = {"micro_batches": best.micro_batches if best else None, "tried": tried,
                       "s": time.perf_counter() - t0, "predicted_s": best.cost if best else None,
                       **({} if best else {"reason": why})}
    return best


def _price_plan(pcg, gM, info, lay, found, M, machine, mapper, costs: StageCosts, shapes, stitch) -> AlpaResult:
    estimate, plan_stages = found                 # the stage DP's Eq. 2 score and its stages
    plan_stages = [(st.first, st.end, st.option) for st in plan_stages]
    stage_shapes = [shapes[j] for _, _, j in plan_stages]
    starts = place_submeshes(machine, stage_shapes)
    n_st = len(plan_stages)
    bf = mapper.model.backward_factor
    priced, fwd, bwd, once, mems, reasons, plan, out_stages = [], [], [], [], [], [], [], []
    for idx, ((k, i, j), d) in enumerate(zip(plan_stages, starts)):
        c = costs.get(k, i - 1, shapes[j])
        sg = costs.stage_graph(k, i - 1)
        if math.isfinite(c.t):          # the memo's plan may be of another range of the same structure
            c = costs.solve_at(sg, c.mesh, d, last=i == len(lay))   # (or a sum of layers): on its own sub-PCG
        priced.append(P.StagePrice(c.t, c.once, dict(c.w), dict(c.a), dict(c.views), c.pcg,
                                tuple(tuple(x) for x in sg.outputs), c.reason))
        fwd.append(c.t / (1 + bf))
        bwd.append(c.t * bf / (1 + bf))
        once.append(c.once)
        if c.reason:
            reasons.append(f"stage {idx}: {c.reason}")
        infl = P.in_flight(n_st, idx, M)
        mems.append({dev: c.w.get(dev, 0) + infl * c.a.get(dev, 0) for dev in set(c.w) | set(c.a)})
        size = shapes[j][0] * shapes[j][1]
        plan.append((k, i, d, size))
        out_stages.append({"layers": [k, i], "shape": list(shapes[j]), "mesh": list(c.mesh), "start": d,
                           "t_s": c.t, "once_s": c.once})
    send, send_el = [], []
    for idx in range(n_st - 1):
        _, i, d, s = plan[idx]
        _, _, d2, s2 = plan[idx + 1]
        refs = info.crossing[lay[i][0]]
        send.append(P.stage_transfer(machine, tuple(range(d, d + s)), tuple(range(d2, d2 + s2)),
                                P.crossing_bytes(gM, refs)))
        send_el.append(sum(gM.shape(r).numel for r in refs))
    ev = {"priced": priced, "fwd": fwd, "bwd": bwd, "once": once, "send": send, "mem": mems,
          "memory": {dev: v for mem in mems for dev, v in mem.items()}, "send_elements": send_el}
    cap = machine.device.usable_bytes
    if any(not math.isfinite(x) for x in fwd):
        ev.update(cost=INF, makespan=INF, feasible=False, reason="; ".join(reasons) or "a stage has no plan")
    else:
        mk = P.simulate_1f1b(fwd, bwd, M, send, send, once).makespan
        ev.update(cost=mk, makespan=mk, feasible=True, reason="")
        for idx, mem in enumerate(mems):
            if mem and max(mem.values()) > cap:
                dev = max(mem, key=mem.get)
                ev.update(cost=INF, feasible=False,
                          reason=f"out of memory: stage {idx} device {dev} needs {mem[dev] / 2**30:.2f} GiB "
                                 f"with {P.in_flight(n_st, idx, M)} micro-batches in flight, has {cap / 2**30:.2f} GiB")
                break
    pr = P.assemble(pcg, gM, tuple(plan), M, ev, machine, stitch)
    stats = {"makespan_s": ev["makespan"], "layers": len(lay)}
    if stitch and ev["feasible"] and not pr.feasible and pr.reason.startswith("cannot join the stages"):
        # The stages are priced (our 1F1B simulation, transfers as bytes spread over the sub-meshes) but
        # their PCGs do not join into one (stages that send copies are priced inf before the DP chooses, so
        # this is a safety net).  The price is kept; the plan has no PCG (``stitch_error``); ``join_stage``
        # tells alpa_plan which stage to price inf before it asks the DP again.
        stats["stitch_error"] = pr.reason
        stats["join_stage"] = pr.stats.get("join_stage", 0)
        pr = P.assemble(pcg, gM, tuple(plan), M, ev, machine, False)
    pr.stats = stats
    return AlpaResult(pr, M, list(lay), out_stages, estimate)


__all__ = ["alpa_plan", "AlpaResult", "AlpaError", "cluster_operators",
           "submesh_shapes", "logical_meshes", "place_submeshes", "StageCosts", "StageCost", "mapping_standin"]
