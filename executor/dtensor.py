"""Layouts and redistributions on PyTorch's own distributed tensors (DESIGN "Executor").

A tensor of the PCG whose pieces sit one per device on a set of devices is a DTensor: the device
set arranged as a :class:`~torch.distributed.device_mesh.DeviceMesh`, and one placement per mesh
dim -- ``Replicate()`` for a mesh dim that indexes copies, ``Partial()`` for one that indexes partial
sums, ``Shard(d)`` for one that indexes the pieces of logical dim d (several mesh dims sharding one
dim nest left to right, as DTensor does).  A movement between two such tensors on the same device
set (a parallel operator, or a chain of them whose intermediate tensors nobody else reads) is one
DTensor redistribution: Partial -> Replicate is an all-reduce (Reduce + Replicate, the fused
AllReduce), Shard -> Replicate an all-gather (Combine + Replicate), Partial -> Shard a
reduce-scatter (Reduce + Partition), Shard(i) -> Shard(j) an all-to-all; DTensor plans the steps and
runs its collectives (torch's functional collectives) forward and, on the gradient, backward.  By
default the local piece goes through DTensor's ``redistribute_local_tensor`` (the function
``DTensor.redistribute`` runs) inside one autograd node with the DTensorSpecs built once; with
``UNITY_PCG_DTENSOR=api`` through ``DTensor.from_local(...).redistribute(...).to_local(...)``, which
costs about twice the CPU time around the collective (DTensor objects, specs and three autograd
nodes per call; see ``Redistribution.run``).

:func:`plan_redistribution` finds the mesh.  Every tensor gives each device a grid index (copy, sum,
one per shard dim; :mod:`executor.lower`'s piece maps), so the device set is first written in the
mixed-radix digits of the input's grid axes (prime factors), then every order of those digits is tried
as a mesh: it fits when, on both tensors, each grid axis index is the row-major index of the mesh
coordinates of the mesh dims that belong to it (a copy or sum index need only be a function of its
mesh dims' coordinates: copies are equal and partial sums add up in any order).  Adjacent mesh dims that play the same role in both tensors are merged, every 1-D slice of
the mesh must list its devices in increasing order (a process group numbers its members that way), and
the fewest mesh dims win.  None when no mesh fits: the lowering keeps its torch.distributed collectives
or point-to-point messages for those movements (a Combine onto one device is a gather, not a
redistribution).

Gradients: the executor's copies carry their own gradient contributions (they are summed where the
copies were made: a Replicate's backward, a weight's gradient all-reduce), which is DTensor's Partial
for the gradient of a copy the redistribution creates and Replicate (untouched, no message) for a copy
it passes through; a partial sum's gradient is Replicate; a shard's is Shard.  A transition DTensor
would differentiate with a different convention -- Replicate -> Shard, whose backward all-gathers the
shards' gradients into every copy -- is not planned (the lowering slices locally instead, see
:mod:`executor.lower`).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Sequence

import torch

from unity_pcg.pieces import ravel, unravel

# placements as plain data: ("R",) copy, ("P",) partial sum, ("S", dim) shard of a logical dim
R = ("R",)
P = ("P",)

#: redistributions run in this process, by kind (tests and benchmarks read it)
CALLS: Counter = Counter()


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def axis_placement(axis: int):
    """Grid axis (0 copy, 1 sum, 2 + d shard dim d) -> placement."""
    return R if axis == 0 else P if axis == 1 else ("S", axis - 2)


@dataclass(frozen=True)
class MeshSpec:
    """Devices of a mesh, row-major over ``shape``."""
    shape: tuple[int, ...]
    devices: tuple[int, ...]

    def coord(self, dev: int) -> tuple[int, ...]:
        return unravel(self.devices.index(dev), self.shape)

    def slices(self) -> list[tuple[int, ...]]:
        """Every 1-D slice of the mesh (the process groups of its mesh dims)."""
        out = []
        for j in range(len(self.shape)):
            others = [range(s) if i != j else range(1) for i, s in enumerate(self.shape)]
            for base in itertools.product(*others):
                c = list(base)
                devs = []
                for k in range(self.shape[j]):
                    c[j] = k
                    devs.append(self.devices[ravel(c, self.shape)])
                out.append(tuple(devs))
        return out

    def slice_of(self, dev: int, j: int) -> tuple[int, ...]:
        c = list(self.coord(dev))
        devs = []
        for k in range(self.shape[j]):
            c[j] = k
            devs.append(self.devices[ravel(c, self.shape)])
        return tuple(devs)


def _express(idx_of: dict, n_axes: int, shape: tuple, dev_at: dict) -> list[int] | None:
    """The grid axis each mesh dim indexes, when every axis index of every device is the row-major
    index of its mesh dims' coordinates (in mesh order); else None."""
    k = len(shape)
    origin = (0,) * k
    x0 = dev_at[origin]
    assign = []
    for j in range(k):
        c = list(origin)
        c[j] = 1
        x1 = dev_at[tuple(c)]
        changed = [a for a in range(n_axes) if idx_of[x0][a] != idx_of[x1][a]]
        if len(changed) != 1:
            return None
        assign.append(changed[0])
    seen: dict = {}
    for coord, x in dev_at.items():
        for a in range(n_axes):
            dims = [j for j in range(k) if assign[j] == a]
            sub = tuple(coord[j] for j in dims)
            if a < 2:                 # copy / sum index: any numbering, a function of its mesh dims only
                if seen.setdefault((a, sub), idx_of[x][a]) != idx_of[x][a]:
                    return None
            elif idx_of[x][a] != ravel(sub, [shape[j] for j in dims]):
                return None
    return assign


#: per mesh dim, (input placement kind, output placement kind) DTensor differentiates as the executor does
_OK = {("P", "R"), ("S", "R"), ("P", "S"), ("S", "S"), ("R", "R"), ("P", "P")}


@dataclass
class Redistribution:
    """One DTensor redistribution: the input's local piece on ``mesh`` with ``src`` placements becomes
    the output's local piece with ``dst`` placements (see the module docstring)."""
    mesh: MeshSpec
    src: tuple
    dst: tuple
    sizes: tuple                      # logical shape (both sides)
    kind: str                         # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "mixed"
    api: bool = False                 # through DTensor objects (from_local / redistribute / to_local)
    _meshes: dict = field(default_factory=dict, repr=False, compare=False)

    # --- torch objects (built lazily on the members from the process groups the Trainer made) -----------
    def device_mesh(self, rank: int, group_of: Callable, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh
        key = (rank, device_type)
        m = self._meshes.get(key)
        if m is None:
            if len(self.mesh.shape) == 1:
                m = DeviceMesh.from_group(group_of(self.mesh.devices), device_type)
            else:
                groups = [group_of(self.mesh.slice_of(rank, j)) for j in range(len(self.mesh.shape))]
                mesh = torch.tensor(self.mesh.devices, dtype=torch.int).reshape(self.mesh.shape)
                m = DeviceMesh.from_group(groups, device_type, mesh=mesh,
                                          mesh_dim_names=tuple(f"d{j}" for j in range(len(groups))))
            self._meshes[key] = m
        return m

    def placements(self):
        from torch.distributed.tensor import Partial, Replicate, Shard

        def conv(p):
            return Replicate() if p == R else Partial() if p == P else Shard(p[1])
        cached = self._meshes.get("placements")
        if cached is None:
            src = tuple(conv(p) for p in self.src)
            dst = tuple(conv(p) for p in self.dst)
            # gradient of the local result: a copy made here carries a contribution (Partial), a copy
            # passed through keeps its own (Replicate: no message), a partial sum's is whole (Replicate)
            grad = tuple(Partial() if q == R and p != R else Replicate() if q in (R, P) else conv(q)
                         for p, q in zip(self.src, self.dst))
            # the loss adds 1/k per copy: the copies' gradients are equal parts (Replicate, scaled by k)
            grad_loss = tuple(Replicate() if q == R else g for q, g in zip(self.dst, grad))
            stride = []
            acc = 1
            for s in reversed(self.sizes):
                stride.append(acc)
                acc *= s
            cached = self._meshes["placements"] = (src, dst, grad, grad_loss, tuple(reversed(stride)))
        return cached

    def new_copies(self) -> int:
        """How many copies of each piece the redistribution makes (product of the new Replicate dims)."""
        return prod(s for s, p, q in zip(self.mesh.shape, self.src, self.dst) if q == R and p != R)

    def specs(self, mesh, dtype, split: bool) -> tuple:
        """DTensorSpecs of the input, the output, the output's gradient and the input's gradient (cached
        per mesh, dtype and loss split)."""
        key = ("specs", id(mesh), dtype, split)
        hit = self._meshes.get(key)
        if hit is None:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
            src, dst, grad, grad_loss, stride = self.placements()
            meta = TensorMeta(torch.Size(self.sizes), stride, dtype)
            gsrc = tuple(Replicate() if p.is_partial() else p for p in src)   # a partial sum's gradient is whole
            hit = self._meshes[key] = tuple(DTensorSpec(mesh, pl, tensor_meta=meta)
                                            for pl in (src, dst, grad_loss if split else grad, gsrc))
        return hit

    def run(self, x: torch.Tensor, rank: int, group_of: Callable, anchor: torch.Tensor | None = None,
            sinks: list | None = None, diff: bool = True, loss_k: int = 1) -> torch.Tensor:
        """The output's local piece from the input's local piece ``x`` (collective over the mesh).
        ``loss_k``: the result is an AllReduce's copies each adding 1/k of the loss (the gradient of a
        copy is then 1/k of the whole: scaled by k, no backward message).

        By default the local piece goes through DTensor's own redistribution
        (``redistribute_local_tensor``: DTensor's transform planner and collectives) in one autograd
        node, with the DTensorSpecs built once; ``api=True`` (``UNITY_PCG_DTENSOR=api``) goes through
        ``DTensor.from_local(...).redistribute(...).to_local(...)``, which builds DTensor objects,
        specs and three autograd nodes per call: the same collectives, about twice the CPU time around
        them (``benchmarks/executor_dtensor_overhead.py``)."""
        CALLS[self.kind] += 1
        mesh = self.device_mesh(rank, group_of, x.device.type)
        if not diff:
            x = x.detach()
        elif not x.requires_grad and anchor is not None:
            x = x + anchor            # the backward must run here too (peers wait on its collective)
        split = loss_k > 1 and diff and self.new_copies() == loss_k
        if self.api or _redistribute_local is None:
            from torch.distributed.tensor import DTensor
            src, dst, grad, grad_loss, stride = self.placements()
            d = DTensor.from_local(x.contiguous(), mesh, src, run_check=False, shape=torch.Size(self.sizes),
                                   stride=stride)
            y = d.redistribute(mesh, dst).to_local(grad_placements=grad_loss if split else grad)
            if split:
                y = _ScaleGrad.apply(y, loss_k)
        elif diff:
            y = _Redistribute.apply(x, self.specs(mesh, x.dtype, split), loss_k if split else 1)
        else:
            sp = self.specs(mesh, x.dtype, False)
            y = _redistribute_local(x.contiguous(), sp[0], sp[1])
        if diff and sinks is not None:
            sinks.append(y)
        return y


try:
    from torch.distributed.tensor._redistribute import redistribute_local_tensor as _redistribute_local
except ImportError:                   # another torch: the public DTensor API path
    _redistribute_local = None


class _Redistribute(torch.autograd.Function):
    """DTensor's redistribution of a local piece; the backward redistributes the gradient from the
    output's gradient placements to the input's (what DTensor's from_local / redistribute / to_local
    nodes do together, in one node)."""

    @staticmethod
    def forward(ctx, x, specs, scale):
        ctx.specs, ctx.scale = specs, scale
        y = _redistribute_local(x.contiguous(), specs[0], specs[1])
        if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone()             # a local chunk of the input: an output of its own
        return y

    @staticmethod
    def backward(ctx, g):
        _, _, gout, gin = ctx.specs
        g = g.contiguous()
        if ctx.scale != 1:
            g = g * ctx.scale
        if gout.placements != gin.placements:
            g = _redistribute_local(g, gout, gin)
        return g, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


def _kind(src: tuple, dst: tuple) -> str:
    moves = {(p[0], q[0]) for p, q in zip(src, dst) if p != q}
    names = {("P", "R"): "all_reduce", ("S", "R"): "all_gather", ("P", "S"): "reduce_scatter",
             ("S", "S"): "all_to_all"}
    kinds = {names[m] for m in moves}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def plan_redistribution(shape_a, place_a: Sequence[int], shape_b, place_b: Sequence[int]) -> Redistribution | None:
    """The DTensor redistribution moving tensor A (pieces on ``place_a``: flat piece -> device) to
    tensor B on the same device set, or None when no mesh fits (see the module docstring)."""
    n = len(place_a)
    if n < 2 or len(place_b) != n or len(set(place_a)) != n or set(place_a) != set(place_b):
        return None
    if tuple(shape_a.sizes) != tuple(shape_b.sizes):
        return None
    for s in (shape_a, shape_b):
        if any(d.size % d.degree for d in s.dims):
            return None
    grid_a, grid_b = tuple(shape_a.grid), tuple(shape_b.grid)
    idx_a = {d: unravel(f, grid_a) for f, d in enumerate(place_a)}
    idx_b = {d: unravel(f, grid_b) for f, d in enumerate(place_b)}
    digits = []                       # (axis of A, radix) in A's grid order, each axis major digit first
    for a, deg in enumerate(grid_a):
        digits.extend((a, p) for p in _primes(deg))
    base = {}
    for d, idx in idx_a.items():
        c = []
        for a, deg in enumerate(grid_a):
            radices = _primes(deg)
            c.extend(unravel(idx[a], radices))
        base[d] = tuple(c)
    best = None
    for perm in itertools.islice(itertools.permutations(range(len(digits))), 720):
        shape = tuple(digits[p][1] for p in perm)
        dev_at = {tuple(base[d][p] for p in perm): d for d in place_a}
        ga = _express(idx_a, len(grid_a), shape, dev_at)
        if ga is None:
            continue
        gb = _express(idx_b, len(grid_b), shape, dev_at)
        if gb is None:
            continue
        # merge adjacent mesh dims with the same role on both sides
        sizes, roles = [], []
        for j, s in enumerate(shape):
            if roles and roles[-1] == (ga[j], gb[j]):
                sizes[-1] *= s
            else:
                sizes.append(s)
                roles.append((ga[j], gb[j]))
        devices = tuple(dev_at[c] for c in itertools.product(*(range(s) for s in shape)))
        spec = MeshSpec(tuple(sizes), devices)
        if any(list(sl) != sorted(sl) for sl in spec.slices()):
            continue
        src = tuple(axis_placement(a) for a, _ in roles)
        dst = tuple(axis_placement(b) for _, b in roles)
        if any((p[0], q[0]) not in _OK for p, q in zip(src, dst)):
            continue
        if best is None or len(sizes) < len(best.mesh.shape):
            best = Redistribution(spec, src, dst, tuple(shape_a.sizes), _kind(src, dst))
    return best


__all__ = ["Redistribution", "MeshSpec", "plan_redistribution", "CALLS"]
