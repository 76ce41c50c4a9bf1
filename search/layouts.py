"""Layout proposals: the parallelization of every operator, solved from its labels on each logical mesh.

    from unity_pcg.search.layouts import mesh_shapes, propose
    for p in proposals(g, machine, deadline=bud.deadline("layouts")):
        p.mesh, p.pcg, p.views                      # a target PCG with a machine view per node

The job: for any model, without knowing what it is, say which layouts are worth reaching.  A *proposal* is
Alpa's intra-operator plan (:func:`search.alpa.intra.solve_intra`: one ILP over every operator's
algorithms, derived from the registry's labels, with resharding between them priced by our cost model)
on one logical 2-D mesh (n0, n1) of all the machine's devices.  Which meshes, and in which order, follows
from the machine alone (:func:`mesh_shapes`): one axis over every device first (the cheapest ILP), then
the node x device split, then every other factorization n0 x n1 = devices, the inner axis closest to a node first.  How
many are solved follows from the budget: :func:`proposals` solves them in that order until its deadline.

Contract: a proposal's ``pcg`` is a valid PCG of the same logical graph (parallel operators inserted; its
``views`` a feasible placement on the mesh's devices, as the ILP chose it); ``time_s`` is that placement
priced by the caller's mapper (:meth:`search.mapping.MachineMapper.evaluate`), or the ILP objective when
no mapper is given.  A mesh whose ILP does not finish before the deadline, or that has no plan (memory),
gives a proposal with ``pcg=None`` and ``status`` saying why; nothing here raises for a model the ILP
cannot plan.  Nothing is gated on operator types, counts or names: every model gets every mesh.

Segments: a graph whose whole-graph ILP does not fit the time is proposed per canonical segment
(:func:`search.split.canonical_segments`: repeated layers solved once, their prices shared through the ILP's
structural memo); the caller reaches each segment's proposal by rules and the segment search assembles
them (:func:`search.split.assemble`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

from unity_pcg.machine import MachineSpec
from unity_pcg.pcg import PCG

from .budget import Deadline

INF = math.inf


@dataclass
class Proposal:
    """The ILP's layout of a graph on one logical mesh (``pcg`` None: not solved; ``status`` says why)."""
    mesh: tuple[int, int]
    pcg: PCG | None
    views: dict | None = None
    time_s: float = INF             # the placement priced by the caller's mapper (else the ILP objective)
    objective: float = INF          # the ILP's objective
    solve_s: float = 0.0            # building and solving the ILP (s, wall)
    status: str = ""                # "optimal", "time limit", or why there is no plan
    mapping: object = None          # the caller mapper's MappingResult of (pcg, views), when priced
    stats: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.mesh[0]}x{self.mesh[1]}"

    def to_json(self) -> dict:
        return {"mesh": self.name, "time_s": self.time_s if math.isfinite(self.time_s) else None,
                "objective": self.objective if math.isfinite(self.objective) else None,
                "solve_s": round(self.solve_s, 3), "status": self.status}


def mesh_shapes(machine: MachineSpec) -> list[tuple[int, int]]:
    """Every logical 2-D mesh (n0, n1) with n0 x n1 = the machine's devices (device of position (i, j) =
    i * n1 + j: the inner axis contiguous, inside a node where it fits), in the order they are tried: one
    axis over all devices first ((1, N); (N, 1) is the same set of positions, so it is not repeated): its
    ILP has one active axis, so about the square root of a 2-D mesh's algorithms per operator and far
    fewer resharding pairs, and is solved within a short budget on any model, so some proposal of the
    search's own is priced even where no 2-D ILP can be built in time; then the node x device split
    (Alpa's physical mesh), then the others, the inner axis nearest a node's size first (ratio in either
    direction), fewer outer positions first among equals."""
    n, d, nodes = machine.num_devices, machine.devices_per_node, machine.nodes
    if n <= 1:
        return []
    out = [(1, n)]
    if nodes > 1 and d > 1:
        out.append((nodes, d))
    rest = [(a, n // a) for a in range(2, n) if n % a == 0]
    rest.sort(key=lambda s: (abs(math.log(s[1] / d)), s[0]))
    for s in rest:
        if s not in out:
            out.append(s)
    return out


def _monotonic_deadline(deadline: Deadline | None) -> float | None:
    """The ILP checks ``time.monotonic()``: the deadline on that clock (None on any other clock: a test's
    fake clock advances only when read, so the ILP is bounded by its own time limit there)."""
    if deadline is None or deadline.clock is not time.monotonic:
        return None
    return deadline.at


def propose(g: PCG, machine: MachineSpec, mesh: tuple[int, int], *, optimizer: str = "adam",
            precision: str = "fp32", deadline: Deadline | None = None, mapper=None,
            time_limit_s: float = 30.0, idle: bool = True, memory_budget: float | None = None,
            micro_batches: int = 1, sharded_update: bool = False, memory_price: float = 0.0) -> Proposal:
    """The ILP's layout of the logical graph ``g`` on ``mesh`` (all the machine's devices), before
    ``deadline``; priced by ``mapper`` (a :class:`search.mapping.MachineMapper`) on the ILP's views.
    ``idle``: operators may leave a mesh axis unused instead of running on copies along it
    (:func:`search.alpa.intra.solve_intra`), so a layer too small for every device, or an embedding table
    whole, runs on a subset of them, as the machine-mapping DP would place it.  ``memory_budget``: bytes per
    device the ILP's memory rows keep to (default the device's capacity; ``math.inf``: no rows, the fastest
    layout, which the memory techniques may then make fit).  ``micro_batches``: ``g`` is one of that many
    micro-batches of an iteration; ``sharded_update``: ZeRO-1's update and states; ``memory_price``: a price on
    memory instead of memory rows (:func:`search.alpa.intra.solve_intra`)."""
    from .alpa.intra import AlpaError, solve_intra
    t0 = time.perf_counter()
    if deadline is not None and deadline.left() <= 0:
        return Proposal(tuple(mesh), None, status="not solved: the deadline passed")
    dl = _monotonic_deadline(deadline)
    limit = max(min(time_limit_s, deadline.left()), 0.05) if deadline is not None else time_limit_s
    try:
        ip = solve_intra(g, machine, tuple(mesh), optimizer=optimizer, precision=precision, price=False,
                         deadline=dl, time_limit_s=limit, idle=idle, memory_budget=memory_budget,
                         micro_batches=micro_batches, sharded_update=sharded_update, memory_price=memory_price)
    except AlpaError as e:
        return Proposal(tuple(mesh), None, solve_s=time.perf_counter() - t0, status=f"no plan: {e}")
    p = Proposal(tuple(mesh), ip.pcg, ip.views, float(ip.objective), float(ip.objective),
                 time.perf_counter() - t0, ip.status, stats={"anchors": ip.stats.get("anchors")})
    if mapper is not None and ip.views is not None:
        r = mapper.evaluate(ip.pcg, ip.views)
        p.mapping = r
        p.time_s = r.cost if r.feasible else INF
        if not r.feasible:
            p.status = f"{p.status}; infeasible placement: {r.reason}"
    return p


def proposals(g: PCG, machine: MachineSpec, *, deadline: Deadline | None = None, optimizer: str = "adam",
              precision: str = "fp32", mapper=None, meshes=None, run_until: Deadline | None = None) -> Iterator[Proposal]:
    """:func:`propose` on every mesh of :func:`mesh_shapes` (or ``meshes``) in order, until ``deadline``;
    a mesh reached past it yields nothing more.  ``run_until`` (later than ``deadline``): a mesh started before
    ``deadline`` may solve until then (a large mesh's ILP whose build started late is not cut at the start
    mark); default ``deadline``."""
    for mesh in (mesh_shapes(machine) if meshes is None else meshes):
        if deadline is not None and deadline.passed():
            return
        yield propose(g, machine, mesh, optimizer=optimizer, precision=precision,
                      deadline=run_until if run_until is not None and deadline is not None else deadline,
                      mapper=mapper)


def segment_proposals(g: PCG, machine: MachineSpec, meshes, *, k: int = 10, pairs=None,
                      deadline: Deadline | None = None, optimizer: str = "adam", precision: str = "fp32"
                      ) -> dict:
    """{segment key: [Proposal per mesh]} of the distinct canonical segments of ``g`` (each solved once),
    until ``deadline``: what a graph too large for whole-graph solves is proposed as."""
    from .split import canonical_segments
    segs, _ = canonical_segments(g, k, pairs)
    out: dict = {}
    for s in segs:
        if s.key in out:
            continue
        out[s.key] = []
        for mesh in meshes:
            if deadline is not None and deadline.passed():
                return out
            out[s.key].append(propose(s.canon, machine, mesh, optimizer=optimizer, precision=precision,
                                      deadline=deadline))
    return out


__all__ = ["Proposal", "mesh_shapes", "propose", "proposals", "segment_proposals"]
