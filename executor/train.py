"""Training with a plan: the per-rank runtime of a lowered plan (:mod:`executor.lower`).

    t = Trainer(plan, model_path, rank=r, world=w, optimizer="sgd", lr=0.01, seed=0, device="cpu")
    loss = t.step(feeds, targets)      # same float on every rank

The caller initializes ``torch.distributed`` (gloo on CPU, nccl on GPU) before building a Trainer when
``world > 1``.  What one step does:

* forward: every rank runs the steps of the lowered plan that reach the loss, on plain local tensors,
  with communication only where the plan moves pieces between devices;
* loss (``loss=``, :mod:`executor.loss`; None: derived from each step's targets): the mean of the model's
  first output (``mean``, and ``output`` for a graph that computes its own loss), MSE or binary
  cross-entropy with logits against float targets, cross-entropy against integer class targets,
  computed on the pieces where they are (each rank adds its pieces' share; copies count once) -- the
  global value one device would compute, whatever the partitioning.  Feeds and targets may hold just the
  rows this rank reads (:meth:`Trainer.feed_rows`, :meth:`Trainer.target_rows`) or whole batches;
* backward, then gradient synchronization exactly where the plan's PCG puts it: a weight region read
  on several devices (a weight with copy degree > 1) has its gradient all-reduced over those devices; a
  region read on one device (a sharded weight's piece) is not.  All-reduces are bucketed (one flat
  buffer per bucket of at most ``bucket_bytes``, one process group per device set) and start while the
  backward pass runs, as soon as every gradient of a bucket is ready (in a fixed bucket order, as DDP);
* the optimizer (SGD or Adam) updates the logical parameters.

The plan's ``memory`` field (:mod:`executor.memory`) changes how, never what: recompute regions run as
checkpointed sub-programs, ZeRO 1-3 shard the update, gradients and parameters over each weight's
data-parallel copies, offload keeps the update on the host; the losses stay those of one process.

Parameters are the ONNX model's own initializers; of each trained weight a rank holds the bounding box
of the regions its steps read (a Megatron shard; the whole tensor under data parallelism; a weight it
never reads, whole and untouched), and the pieces a task reads are slices of it, so operators that
substitutions put on weights (a Concat of two weights, Partition / Replicate chains) run inside the step
and gradients reach the original weights, and a shard costs no full-size gradient or update.
:meth:`Trainer.model_state` assembles the current full tensors from the ranks that own each region.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from unity_pcg import ops
from unity_pcg import plan as plan_mod
from unity_pcg.errors import PlanError

from .kernels import TORCH_DTYPES, ExecutorError, kernel
from .lower import Lowered, block, lower, task_pieces, unravel
from .memory import Region, Trigger, ZeroRuntime, run_io, schedule, step_reads, tie
from .precision import forward_context, set_math_mode

FIRST_BUCKET_BYTES = 1 << 20
LOSS_KINDS = ("mean", "mse", "ce", "bce", "output")
OVERLAP_MIN_BYTES = 8 << 20      # CPU: overlap the gradient all-reduces with backward from this many bytes
GRAD_TAG = 1 << 30     # backward messages of an exchange: its forward tags + GRAD_TAG


OPTIMIZERS = ("sgd", "momentum", "adam")   # what the cost model prices (search.cost.OPTIMIZER_STATES) and we run
MOMENTUM = 0.9


def make_optimizer(kind: str, params: list, lr: float):
    """The torch optimizer of ``--optimizer``: plain SGD, SGD with momentum 0.9, or Adam (torch defaults); with
    no parameter (a rank or stage that trains none), an optimizer that steps nothing."""
    if kind in OPTIMIZERS and not params:
        return _NoParameters(lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ExecutorError(f"unknown optimizer {kind!r} (known: {', '.join(OPTIMIZERS)})")


# --- communication with autograd ----------------------------------------------------------------------

def _p2p(sends, recvs) -> None:
    """Post every send and receive of one exchange together and wait for all of them."""
    ops_ = [dist.P2POp(dist.isend, t, peer, tag=tag) for peer, tag, t in sends]
    ops_ += [dist.P2POp(dist.irecv, t, peer, tag=tag) for peer, tag, t in recvs]
    if ops_:
        for r in dist.batch_isend_irecv(ops_):
            r.wait()


class _Exchange(torch.autograd.Function):
    """Point-to-point movement of pieces; the backward pass sends the gradients back."""

    @staticmethod
    def forward(ctx, meta, anchor, *sends):
        send_meta, recv_meta = meta
        ctx.meta = meta
        ctx.send_shapes = [(t.shape, t.dtype, t.device) for t in sends]
        ctx.device = anchor.device
        outs = [torch.empty(shape, dtype=dtype, device=anchor.device) for _, _, shape, dtype in recv_meta]
        _p2p([(peer, tag, t.contiguous()) for (peer, tag), t in zip(send_meta, sends)],
             [(peer, tag, o) for (peer, tag, _, _), o in zip(recv_meta, outs)])
        return (*outs, anchor.new_zeros(()))

    @staticmethod
    def backward(ctx, *grads):
        send_meta, recv_meta = ctx.meta
        gouts = []
        for g, (_, _, shape, dtype) in zip(grads, recv_meta):
            gouts.append(torch.zeros(shape, dtype=dtype, device=ctx.device) if g is None else g.contiguous())
        gins = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype, dev in ctx.send_shapes]
        _p2p([(peer, tag + GRAD_TAG, g) for (peer, tag, _, _), g in zip(recv_meta, gouts)],
             [(peer, tag + GRAD_TAG, g) for (peer, tag), g in zip(send_meta, gins)])
        return (None, None, *gins)


class _AllReduce(torch.autograd.Function):
    """Sum over a process group; the gradient of every input is the sum of the outputs' gradients."""

    @staticmethod
    def forward(ctx, group, anchor, x):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return None, None, g


class _AllGather(torch.autograd.Function):
    """Every member's tensor, stacked in group order; a member's gradient is the sum over members of
    the gradients of its slot (one all-reduce)."""

    @staticmethod
    def forward(ctx, group, k, me, anchor, x):
        ctx.group, ctx.me = group, me
        parts = [torch.empty_like(x) for _ in range(k)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return None, None, None, None, g[ctx.me]


class _AllReduceToLoss(torch.autograd.Function):
    """An all-reduce whose k copies each add 1/k of the loss: their gradients are equal, so the sum
    over copies that the backward all-reduce would compute is k times the local one (no message)."""

    @staticmethod
    def forward(ctx, group, k, x):
        ctx.k = k
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return None, None, g * ctx.k


class _Reduce(torch.autograd.Function):
    """Sum onto ``dst``; the backward broadcasts the gradient from ``dst`` to every contributor."""

    @staticmethod
    def forward(ctx, group, dst, anchor, x):
        ctx.group, ctx.dst = group, dst
        y = x.contiguous().clone()
        dist.reduce(y, dst, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.broadcast(g, ctx.dst, group=ctx.group)
        return None, None, None, g


class _Broadcast(torch.autograd.Function):
    """Copy ``src``'s piece to every member; the backward sums the copies' gradients onto ``src``."""

    @staticmethod
    def forward(ctx, group, src, anchor, x):
        ctx.group, ctx.src = group, src
        y = x.contiguous().clone()
        dist.broadcast(y, src, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.reduce(g, ctx.src, group=ctx.group)
        return None, None, None, g


class _Gather(torch.autograd.Function):
    """Every member's piece onto ``dst`` (stacked in group order); the backward scatters the gradient."""

    @staticmethod
    def forward(ctx, group, dst, me, n, anchor, x):
        ctx.group, ctx.dst, ctx.me, ctx.shape = group, dst, me, x.shape
        x = x.contiguous()
        if me == dst:
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.gather(x, parts, dst=dst, group=group)
            return torch.stack(parts)
        dist.gather(x, None, dst=dst, group=group)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        out = torch.empty(ctx.shape, dtype=g.dtype, device=g.device)
        if ctx.me == ctx.dst:
            dist.scatter(out, list(g.contiguous().unbind(0)), src=ctx.dst, group=ctx.group)
        else:
            dist.scatter(out, None, src=ctx.dst, group=ctx.group)
        return None, None, None, None, None, out


class _Scatter(torch.autograd.Function):
    """Slices of ``src``'s piece to the members (``narrows`` in group order); the backward gathers the
    slices' gradients back into the piece's gradient."""

    @staticmethod
    def forward(ctx, group, src, me, narrows, shape, anchor, x):
        ctx.group, ctx.src, ctx.me, ctx.narrows, ctx.xshape = group, src, me, narrows, x.shape
        out = torch.empty(shape, dtype=x.dtype, device=anchor.device)
        if me == src:
            parts = [x.narrow(*nw).contiguous() for nw in narrows]
            dist.scatter(out, parts, src=src, group=group)
        else:
            dist.scatter(out, None, src=src, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.me == ctx.src:
            parts = [torch.empty_like(g) for _ in ctx.narrows]
            dist.gather(g, parts, dst=ctx.src, group=ctx.group)
            gx = torch.zeros(ctx.xshape, dtype=g.dtype, device=g.device)
            for nw, p in zip(ctx.narrows, parts):
                gx.narrow(*nw).add_(p)
            return None, None, None, None, None, None, gx
        dist.gather(g, None, dst=ctx.src, group=ctx.group)
        return None, None, None, None, None, None, None


def _narrow(t: torch.Tensor, nw) -> torch.Tensor:
    if nw is None:
        return t
    dim, start, length = nw
    return t.narrow(dim, start, length)


# --- the trainer ----------------------------------------------------------------------------------------

def model_constants(g, model_path: str) -> frozenset:
    """Names of the PCG's Weight nodes that are constants of the ONNX graph: values computed from
    Constant nodes and untrained initializers alone (GELU's 0.5 and sqrt(2) in a legacy export; a dynamo
    export's module buffers, :func:`unity_pcg.onnx_import.loader.untrained_initializers`), which the importer
    turns into weights.  torch trains only its parameters, so these stay fixed; a weight derived from a
    parameter (a transposed matrix, a tied copy) is trained.  The importer's rule (``trainable`` False)."""
    import onnx

    from unity_pcg.onnx_import.loader import untrained_initializers
    try:
        m = onnx.load(model_path, load_external_data=False)
    except Exception:                       # unreadable here: the weight loader reports it
        return frozenset()
    const: set[str] = set(untrained_initializers(m.graph))
    for node in m.graph.node:               # ONNX graphs are topologically sorted
        if all(x == "" or x in const for x in node.input):
            const.update(o for o in node.output if o)
    return frozenset(n.a["name"] for n in g.sources("Weight") if n.a.get("name") in const)



class _NoParameters:
    """The optimizer of a rank (or pipeline stage) that holds no trainable parameter -- a stage of
    parameter-free operators (a 4-stage ViT plan has a stage holding one Reshape):
    torch's optimizers refuse an empty parameter list.  Steps nothing; its state is its hyperparameters."""

    def __init__(self, **hyper):
        self.param_groups = [dict(hyper, params=[])]

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, d) -> None:
        for grp, saved in zip(self.param_groups, d.get("param_groups", [])):
            grp.update({k: v for k, v in saved.items() if k != "params"})


class Trainer:
    """Trains the ONNX model ``model_path`` with ``plan`` as rank ``rank`` of ``world`` (see module doc)."""

    def __init__(self, plan, model_path: str | None = None, rank: int = 0, world: int = 1,
                 optimizer: str = "sgd", lr: float = 0.01, seed: int = 0, device: str = "cpu",
                 sync_batchnorm: bool = True, bucket_bytes: int = 25 * 2 ** 20, weights: Mapping | None = None,
                 first_bucket_bytes: int | None = None, overlap: bool | None = None, grad_views: bool = True,
                 new_group=None, world_group=None, grad_inputs: frozenset = frozenset(),
                 loss: str | None = None):
        # new_group(devices) -> process group (default: torch.distributed.new_group, called by every rank
        # for every group); world_group: the group of the whole-model collectives (assembling state), the
        # default group unless this Trainer runs one pipeline stage (executor.pipeline)
        self._new_group = new_group or (lambda devs: dist.new_group(list(devs)))
        self._world_pg = world_group
        if isinstance(plan, str):
            plan = plan_mod.load(plan)
        self.plan = plan
        self.g = plan.pcg
        self._inputs = self.g.sources("Input")     # read every step: scanning the graph costs ~1 ms
        self._src_cache: dict = {}                 # per-step lookups, computed once
        self._cut_cache: dict = {}
        self._feed_off: dict[str, int] = {}        # input name -> first batch row of the fed array
        self._tgt_off = 0                          # first batch row of the fed targets
        if loss is not None and loss not in LOSS_KINDS:
            raise ExecutorError(f"unknown loss {loss!r} (known: {', '.join(LOSS_KINDS)})")
        self.loss = loss                           # None: derived from the targets of each step
        self.rank, self.world = int(rank), int(world)
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ExecutorError("torch.distributed must be initialized before a Trainer with world > 1")
        if device == "cuda":
            self.device = torch.device("cuda", self.rank % max(1, torch.cuda.device_count()))
        else:
            self.device = torch.device(device)
        self.seed = int(seed)
        self.step_no = 0
        self.precision = getattr(plan, "precision", "fp32")
        set_math_mode(self.precision, self.device)
        self.keep_values = False          # debugging: keep every local piece of the last step
        path = model_path or plan.model_path
        frozen = model_constants(self.g, path) if weights is None and path else frozenset()
        self.low: Lowered = lower(self.g, plan.views, self.rank, self.world, plan.machine, sync_batchnorm,
                                  frozen=frozen, grad_inputs=grad_inputs)
        # memory techniques (the plan's ``memory`` field; executor.memory): recompute regions become
        # items of the schedule, ZeRO / offload run the update (self._zrt)
        self.memory = getattr(plan, "memory", None) or plan_mod.MemoryPlan()
        self._items = schedule(self.low, self.memory.recompute)
        self._cur_loss_ref = None
        self.keep_refs: frozenset = frozenset()    # tensors read outside the steps (a pipeline stage's sends)
        # (capture, restore): what a recompute re-establishes before running a region again (a pipeline
        # stage's micro-batch: its Dropout offsets); None: nothing
        self.recompute_context = None
        self._zrt: ZeroRuntime | None = None
        self._zero3_names: frozenset = frozenset()
        self._load_weights(model_path or plan.model_path, weights)
        self._loss_refs = {}
        self._pgs: dict[tuple, Any] = {}
        # overlap (DDP-style: a 1 MiB first bucket, buckets launched from gradient hooks during the
        # backward pass) pays on GPUs; on CPU processes (gloo) the collectives compete with the backward
        # for the same cores and each costs milliseconds, so below OVERLAP_MIN_BYTES of gradients to
        # synchronize, fewer buckets launched after the backward are faster (measured on 4-layer MLPs of
        # width 256, 512 and 1024 on 2 processes; with DDP's bucket assignment the 8 MiB MLP and the tiny
        # BERT measure overlap and no overlap within the noise: benchmarks/results/executor_dp_vs_ddp.md)
        self._plan_sync(bucket_bytes, bucket_bytes)
        if overlap is None:
            # decided from the global bucket list, so every rank lays out the same buckets
            overlap = self.device.type == "cuda" or sum(b["bytes"] for b in self._buckets) >= OVERLAP_MIN_BYTES
        self.overlap = bool(overlap)
        if first_bucket_bytes is None:
            first_bucket_bytes = FIRST_BUCKET_BYTES if self.overlap else bucket_bytes
        self._plan_sync(bucket_bytes, first_bucket_bytes)
        zero = self.memory.zero
        sharded_update = bool(zero or self.memory.offload)
        if zero == 3:
            self._bucket_views(False, loss_slot=False, skip=True)   # gradients reach the shards through the gathers
        else:                                          # the loss rides alone: buckets are the groups' layout
            self._bucket_views(grad_views, loss_slot=not sharded_update, pad=zero == 2)
        self._plan_bn()
        for grp in sorted(self.low.groups | {b["devs"] for b in self._buckets}):
            self._group(grp)
        self._bucket_pgs = {}
        for grp in sorted({b["devs"] for b in self._buckets}):   # gradient buckets get their own groups
            self._bucket_pgs[grp] = self._new_group(grp) if self.world > 1 else None
        self._opt_kind = optimizer
        self._rs_out: dict[int, torch.Tensor] = {}
        if sharded_update:
            self._zrt = ZeroRuntime(self, zero, self.memory.offload, optimizer, lr)
            self.opt = self._zrt.opt
            if zero == 3:
                self._zrt.plan_gathers(self._items)
                self._zero3_names = frozenset(self._zrt.names)
        else:
            self.opt = make_optimizer(optimizer, list(self.params.values()), lr)
        if zero != 3:
            self._hooks()
        # message tags: every exchange of the plan gets its own range (same numbers on every rank)
        self._tags = {}
        for st in self.low.steps:
            for j in range(len(st.exchanges)):
                self._tags[(st.node, j)] = len(self._tags) * 4096

    # --- setup --------------------------------------------------------------------------------------
    def _group(self, devs: tuple):
        if devs not in self._pgs:
            self._pgs[devs] = self._new_group(devs) if self.world > 1 else None
        return self._pgs[devs]

    def _load_weights(self, model_path: str | None, weights: Mapping | None) -> None:
        if weights is None:
            if model_path is None:
                raise PlanError("no model file to read the weights from")
            from unity_pcg.onnx_import import load_onnx
            from unity_pcg.onnx_import.errors import DynamicDimension
            try:
                g0 = load_onnx(model_path)
            except DynamicDimension:
                batch = next(iter(n.a["shape"][0] for n in self.g.sources("Input")), None)
                g0 = load_onnx(model_path, batch=batch)
            weights = g0.weights
        trained = {self.g.node(o).a["name"] for o in self.low.trainable_weights()}
        self.params: dict[str, torch.nn.Parameter] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self._full: dict[str, tuple] = {}       # parameter name -> the logical (full) shape
        self._region: dict[str, tuple] = {}     # parameter name -> the region this rank holds
        reads = self._read_regions()
        for n in self.g.sources("Weight"):
            name = n.a["name"]
            if name in self.params or name in self.buffers:
                continue
            v = weights.get(name)
            if v is None:
                raise PlanError(f"weight {name!r} of the plan is not in the model")
            if callable(v):
                v = v()
            v = np.asarray(v)
            if tuple(v.shape) != tuple(n.a["shape"]):
                raise PlanError(f"weight {name!r} has shape {list(v.shape)} in the model, the plan expects "
                                f"{list(n.a['shape'])}")
            t = torch.as_tensor(np.ascontiguousarray(v).reshape(v.shape)).to(self.device, TORCH_DTYPES[n.a["dtype"]])
            if name in trained:
                # a rank holds the bounding box of the regions it reads (a Megatron shard, not the whole
                # matrix: no full-size gradient, no full-size update); a weight it never reads, whole
                full = tuple((0, d) for d in t.shape)
                region = reads.get(name, full)
                self._full[name] = tuple(t.shape)
                self._region[name] = region
                self.params[name] = torch.nn.Parameter(t[_slices(region)].clone())
            else:
                self.buffers[name] = t.clone()     # BatchNorm's running statistics change in place

    def _read_regions(self) -> dict[str, tuple]:
        """Weight name -> bounding box of the logical regions this rank's steps read of it."""
        box: dict[str, tuple] = {}
        for st in self.low.steps:
            for src in st.inputs:
                if src.kind != "source":
                    continue
                n = self.g.node(self.low.origin[src.ref[0]])
                if n.op != "Weight":
                    continue
                b = box.get(n.a["name"])
                box[n.a["name"]] = tuple(src.slices) if b is None else tuple(
                    (min(a0, b0), max(a1, b1)) for (a0, a1), (b0, b1) in zip(b, src.slices))
        return box

    def _rel(self, name: str, sl) -> tuple:
        """Slices of the tensor this rank holds for ``name`` that are the logical region ``sl``."""
        off = self._region.get(name)
        if off is None:
            return _slices(sl)
        return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sl, off))

    def _plan_sync(self, bucket_bytes: int, first_bucket_bytes: int) -> None:
        """Atoms of every trained weight (regions read by the same set of devices) and the buckets of
        those read on more than one device, in the order their gradients become ready."""
        uses = self.low.weight_uses
        self._atoms: dict[str, list] = {}
        order = []   # weights by the position of their last use, latest first (gradients ready first)
        last = {}
        for pos, st in enumerate(self.low.steps):
            n = self.g.node(st.node)
            for r in n.inputs:
                o = self.low.origin.get(r[0])
                if o is not None and self.low.role[o] == "weight":
                    last[self.g.node(o).a["name"]] = pos
        order = sorted(self.params, key=lambda nm: (-last.get(nm, -1), nm))
        entries = []
        for name in order:
            atoms = _atoms(self._full[name], uses.get(name, []))
            self._atoms[name] = atoms
            for sl, devs in atoms:
                if len(devs) > 1:
                    entries.append((devs, name, sl))
        buckets: list[dict] = []
        open_: dict[tuple, dict] = {}
        count: dict[tuple, int] = {}
        for devs, name, sl in entries:
            nbytes = _numel(sl) * self.params[name].element_size()
            b = open_.get(devs)
            if b is None:
                b = {"devs": devs, "items": [], "bytes": 0}
                buckets.append(b)
                open_[devs] = b
                count[devs] = count.get(devs, 0) + 1
            b["items"].append((name, sl))
            b["bytes"] += nbytes
            # as DDP: a bucket closes once it holds cap bytes; the first bucket of a device set is small
            # (1 MiB, DDP's) so communication starts early
            cap = min(bucket_bytes, first_bucket_bytes) if count[devs] <= 1 else bucket_bytes
            if b["bytes"] >= cap:
                del open_[devs]
        self._buckets = buckets
        self._my_buckets = [i for i, b in enumerate(buckets) if self.rank in b["devs"]]
        self._bucket_of: dict[str, list[int]] = {}
        for i in self._my_buckets:
            for name, _ in buckets[i]["items"]:
                self._bucket_of.setdefault(name, []).append(i)

    def _plan_bn(self) -> None:
        """BatchNorm running statistics: node -> (momentum, mean buffer, var buffer), and the regions of
        those buffers each device updates (its tasks' channels), so model_state assembles them from
        their owners as it does parameters.  A channel region held by several devices (the batch or
        spatial dims split) gets the same update on each of them with synchronized statistics; with
        per-device statistics each keeps its own and the lowest rank's are the model's (as DDP, which
        broadcasts rank 0's buffers)."""
        self._bn: dict[int, tuple] = {}
        uses: dict[str, list] = {}
        for n in self.g.nodes():
            if n.op != "BatchNorm" or self.low.role.get(n.id) != "compute":
                continue
            names = []
            for pos in (3, 4):
                o = self.low.origin.get(n.inputs[pos][0])
                nm = self.g.node(o).a.get("name") if o is not None and self.low.role[o] == "weight" else None
                names.append(nm if nm in self.buffers else None)
            if None in names:      # statistics computed in the graph (not the model's buffers): nothing to keep
                continue
            self._bn[n.id] = (float(n.a.get("momentum", 0.9)), names[0], names[1])
            pm = self.low.pm[n.id]
            devs = self.low.views[n.id].devices()
            shapes = self.g.input_shapes(n.id)
            for pos, nm in zip((3, 4), names):
                for t, piece in enumerate(task_pieces(pm, pm.inputs[pos], shapes[pos])):
                    uses.setdefault(nm, []).append((block(shapes[pos], piece), devs[t]))
        for nm, u in uses.items():
            self._atoms[nm] = _atoms(tuple(self.buffers[nm].shape), u)
        for st in self.low.steps:
            if st.node in self._bn and st.ctx is not None:
                st.ctx.extra["want_stats"] = True

    def _update_running_stats(self, st, x, done: set) -> None:
        """ONNX BatchNormalization's update (momentum m: running = m * running + (1 - m) * batch; the
        torch exporter writes m = 1 - torch's momentum), on this task's channels, once per step."""
        stats = st.ctx.extra.pop("bn_stats", None)
        if stats is None:
            return
        mom, mean_name, var_name = self._bn[st.node]
        c0 = st.ctx.out_offset[0][1] if len(st.ctx.out_offset[0]) > 1 else 0
        key = (st.node, c0)
        if key in done:
            return
        done.add(key)
        with torch.no_grad():
            for name, v in ((mean_name, stats[0]), (var_name, stats[1])):
                buf = self.buffers[name].narrow(0, c0, v.shape[0])
                buf.mul_(mom).add_(v.to(buf.dtype), alpha=1.0 - mom)

    def _bucket_views(self, enabled: bool, loss_slot: bool = True, pad: bool = False, skip: bool = False) -> None:
        """One flat buffer per bucket of this rank (plus the loss's slot in the first all-rank bucket), and
        gradients as views into it where a parameter's whole gradient is one bucket item (as DDP's
        gradient_as_bucket_view): backward accumulates into the buffer, so nothing is copied into the
        bucket before the all-reduce nor back after it; the buffers are zeroed after the update instead
        of the gradients being freed.  Other items (a region of a parameter) are copied in and out."""
        self._flat: dict[int, torch.Tensor] = {}
        self._viewed: dict[int, set] = {}
        self._view_params: set = set()
        self._loss_bucket = next((i for i in self._my_buckets if len(self._buckets[i]["devs"]) == self.world), None)
        if not loss_slot:
            self._loss_bucket = None
        self._free_grads = list(self.params.values())
        if self.world == 1 or skip:
            return
        nitems = {}
        for i in self._my_buckets:
            for nm, _ in self._buckets[i]["items"]:
                nitems[nm] = nitems.get(nm, 0) + 1
        for i in self._my_buckets:
            b = self._buckets[i]
            n = sum(_numel(sl) for _, sl in b["items"]) + (1 if i == self._loss_bucket else 0)
            if pad:                       # ZeRO-2: reduce-scattered in len(devs) equal shards
                k = len(b["devs"])
                n = -(-n // k) * k
            dt = self.params[b["items"][0][0]].dtype
            flat = torch.zeros(n, dtype=dt, device=self.device)
            self._flat[i] = flat
            self._viewed[i] = set()
            off = 0
            for nm, sl in b["items"]:
                p = self.params[nm]
                k = _numel(sl)
                whole = tuple(sl) == tuple(self._region[nm])
                if enabled and whole and nitems[nm] == 1 and p.dtype == dt:
                    p.grad = flat[off:off + k].view(p.shape)
                    self._viewed[i].add(nm)
                    self._view_params.add(nm)
                off += k
        self._free_grads = [p for nm, p in self.params.items() if nm not in self._view_params]

    def _release_buckets(self) -> None:
        """ZeRO-2 between steps: the full-size gradient buckets (and the gradients viewing them) are freed
        after the update -- a rank keeps only its reduce-scattered shard -- and made again, zeroed, by
        :meth:`_alloc_buckets` when the backward starts."""
        for i in self._flat:
            self._flat[i] = None
            for nm in self._viewed[i]:
                self.params[nm].grad = None

    def _alloc_buckets(self) -> None:
        for i, flat in list(self._flat.items()):
            if flat is not None:
                continue
            b = self._buckets[i]
            n = sum(_numel(sl) for _, sl in b["items"]) + (1 if i == self._loss_bucket else 0)
            k = len(b["devs"])
            n = -(-n // k) * k
            flat = self._flat[i] = torch.zeros(n, dtype=self.params[b["items"][0][0]].dtype, device=self.device)
            off = 0
            for nm, sl in b["items"]:
                k = _numel(sl)
                if nm in self._viewed[i]:
                    self.params[nm].grad = flat[off:off + k].view(self.params[nm].shape)
                off += k

    def _zero_grads(self) -> None:
        if self._zrt is not None:
            self._zrt.zero_grad()
            for p in self._free_grads:
                p.grad = None
            if self.memory.zero == 2:
                self._release_buckets()
                return
            for flat in self._flat.values():
                flat.zero_()
            return
        if not self._view_params:
            self.opt.zero_grad(set_to_none=True)
            return
        for p in self._free_grads:
            p.grad = None
        for flat in self._flat.values():
            flat.zero_()

    def _hooks(self) -> None:
        if self.world == 1 or not self._my_buckets or not self.overlap:
            return
        for name, p in self.params.items():
            if name in self._bucket_of:
                p.register_post_accumulate_grad_hook(lambda p, name=name: self._grad_ready(name))

    # --- gradient buckets -----------------------------------------------------------------------------
    def _start_step_sync(self, loss_part: torch.Tensor) -> None:
        if self.memory.zero == 2:
            self._alloc_buckets()
        self._ready = {i: set() for i in self._my_buckets}
        self._next = 0
        self._works: dict[int, tuple] = {}
        self._loss_part = loss_part        # rides in the first bucket over all ranks (one collective less)

    def _grad_ready(self, name: str) -> None:
        for i in self._bucket_of.get(name, ()):
            self._ready[i].add(name)
        self._launch(final=False)

    def _launch(self, final: bool) -> None:
        while self._next < len(self._my_buckets):
            i = self._my_buckets[self._next]
            b = self._buckets[i]
            need = {nm for nm, _ in b["items"]}
            if not final and not need <= self._ready[i]:
                return
            flat = self._flat[i]
            viewed = self._viewed[i]
            off = 0
            for nm, sl in b["items"]:
                k = _numel(sl)
                if nm not in viewed:
                    p = self.params[nm]
                    if p.grad is None:
                        flat[off:off + k].zero_()
                    else:
                        flat[off:off + k].view([e - a for a, e in sl]).copy_(p.grad[self._rel(nm, sl)])
                off += k
            if i == self._loss_bucket:
                flat[-1] = self._loss_part.to(flat.dtype).reshape(())
            if self.memory.zero == 2:     # ZeRO-2: each member gets its shard of the summed bucket
                out = self._rs_out.get(i)
                if out is None:
                    out = self._rs_out[i] = flat.new_empty(flat.numel() // len(b["devs"]))
                work = dist.reduce_scatter_tensor(out, flat, group=self._bucket_pgs[b["devs"]], async_op=True)
            else:
                work = dist.all_reduce(flat, group=self._bucket_pgs[b["devs"]], async_op=True)
            self._works[i] = (work, flat)
            self._next += 1

    def _finish_sync(self) -> None:
        if self.world == 1 or not self._my_buckets:
            return
        self._launch(final=True)
        for i in self._my_buckets:
            work, flat = self._works[i]
            work.wait()
            if self._zrt is not None:     # the sharded update reads the buckets (ZeroRuntime.grad_shard)
                continue
            viewed = self._viewed[i]
            off = 0
            for nm, sl in self._buckets[i]["items"]:
                n = _numel(sl)
                if nm not in viewed:
                    p = self.params[nm]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    view = p.grad[self._rel(nm, sl)]
                    view.copy_(flat[off:off + n].view_as(view))
                off += n

    # --- one step ---------------------------------------------------------------------------------------
    def _feeds(self, feeds) -> dict[str, torch.Tensor]:
        if feeds is None:
            from unity_pcg.evaluate import random_feeds
            feeds = random_feeds(self.g, seed=self.seed * 1_000_003 + self.step_no)
        out = {}
        for n in self._inputs:
            name = n.a["name"]
            if name not in feeds:
                raise ExecutorError(f"no value fed for input {name!r}")
            v = feeds[name]
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            full = tuple(n.a["shape"])
            off = 0
            if tuple(t.shape) != full:
                lo, hi = self.feed_rows()[name]
                if not (full and t.dim() == len(full) and t.shape[0] == hi - lo and tuple(t.shape[1:]) == full[1:]):
                    raise ExecutorError(f"input {name!r} has shape {list(t.shape)}, the plan expects {list(full)}"
                                        + (f" (or this rank's rows {lo}:{hi} of it)" if full else ""))
                off = lo
            self._feed_off[name] = off
            out[name] = t.to(self.device, TORCH_DTYPES[n.a["dtype"]])
        return out

    def _source_value(self, nid: int, feeds) -> torch.Tensor:
        hit = self._src_cache.get(nid)
        if hit is None:
            n = self.g.node(self.low.origin[nid])
            hit = self._src_cache[nid] = (n.op == "Input", n.a["name"])
        is_input, name = hit
        if is_input:
            return feeds[name]
        if self._zero3_names and name in self._zero3_names:
            return self._zrt.value(name)
        return self.params[name] if name in self.params else self.buffers[name]

    def _zero3_casts(self, st, xs: list) -> list:
        """ZeRO-3 under bf16 autocast: the float32 gathered weights a bf16 operator reads, cast to bf16 here
        (as autocast would cast them) and registered with the ZeRO runtime, so the copy the operator saves
        for its backward is gathered and cast again there rather than kept (the storages registered;
        ``casts_done`` forgets them after the kernel).  Forward only (a recomputation saves as usual)."""
        if not self._zrt.forward_phase or ops.autocast(st.op) != "low":
            return []
        out = []
        for i, src in enumerate(st.inputs):
            if src.kind != "source" or xs[i].dtype != torch.float32:
                continue
            name = self._source_name(src.ref[0])
            if name in self._zero3_names:
                cut = self._cut_cache.get((id(src), 0), ())
                xs[i] = self._zrt.cast(name, cut, xs[i], torch.bfloat16)
                out.append(xs[i])
        return out

    def _source_name(self, nid: int) -> str | None:
        n = self.g.node(self.low.origin[nid])
        return n.a["name"] if n.op == "Weight" else None

    def _resolve(self, src, vals, recv, feeds) -> torch.Tensor:
        if src.kind == "source":
            v = self._source_value(src.ref[0], feeds)
            is_input, iname = self._src_cache[src.ref[0]]
            off = self._feed_off.get(iname, 0) if is_input else 0
            key = (id(src), off)
            cut = self._cut_cache.get(key)
            if cut is None:
                name = self._source_name(src.ref[0])
                if name in self.params:
                    rel = self._rel(name, src.slices)
                else:       # an Input fed from row ``off`` of its batch on
                    sl = src.slices
                    if off and sl:
                        sl = ((sl[0][0] - off, sl[0][1] - off),) + tuple(sl[1:])
                    rel = _slices(sl)
                whole = all(r.start == 0 and r.stop == d for r, d in zip(rel, v.shape))
                cut = self._cut_cache[key] = () if whole else rel
            return v[cut] if cut else v
        if src.kind == "generate":     # a random generator's block, drawn here (executor/lower.py)
            from .kernels import generate_block
            n = self.g.node(self.low.origin[src.ref[0]])
            sl = src.slices
            return generate_block(n.op, n.a, self.seed, self.step_no, n.a["shape"], tuple(a for a, _ in sl),
                                  tuple(b - a for a, b in sl), self.device)
        if src.kind == "local":
            return _narrow(vals[src.ref], src.narrow)
        return recv[src.ref][src.index]

    def _exchange(self, e, tag_base: int, vals, anchor, sinks) -> list:
        s = self.g.shape(e.ref)
        sends, send_meta, recv_meta = [], [], []
        for i, t in enumerate(e.transfers):
            if t.src == self.rank:
                sends.append(_narrow(vals[t.ref], t.narrow).contiguous())
                send_meta.append((t.dst, tag_base + i))
            if t.dst == self.rank:
                shape = list(s.piece_shape)
                if t.narrow is not None:
                    shape[t.narrow[0]] = t.narrow[2]
                recv_meta.append((t.src, tag_base + i, tuple(shape), TORCH_DTYPES[s.dtype]))
        if e.differentiable:
            outs = _Exchange.apply((send_meta, recv_meta), anchor, *sends)
            sinks.extend(outs)
            return list(outs[:-1])
        outs = [torch.empty(shape, dtype=dt, device=self.device) for _, _, shape, dt in recv_meta]
        _p2p([(peer, tag, t) for (peer, tag), t in zip(send_meta, sends)],
             [(peer, tag, o) for (peer, tag, _, _), o in zip(recv_meta, outs)])
        return outs

    def _collective(self, st, c, vals, recv, fv, anchor, sinks):
        """Reduce / broadcast / gather of one parallel operator (see ``Lowered._collective``)."""
        ref = st.outputs[0] if st.outputs else None
        diff = self.low.diff[(st.node, 0)]
        pg = self._group(c[1])
        s_out = self.g.shapes(st.node)[0]
        if c[0] == "scatter":
            _, grp, src, narrows = c
            shape = list(s_out.piece_shape)
            dt = TORCH_DTYPES[s_out.dtype]
            x = self._resolve(st.inputs[0], vals, recv, fv) if st.inputs else \
                torch.empty((0,), dtype=dt, device=self.device)
            if not diff:
                out = torch.empty(shape, dtype=dt, device=self.device)
                parts = [x.narrow(*nw).contiguous() for nw in narrows] if self.rank == src else None
                dist.scatter(out, parts, src=src, group=pg)
                return out
            y = _Scatter.apply(pg, src, self.rank, narrows, tuple(shape), anchor, x)
            sinks.append(y)
            return y
        if c[0] == "broadcast":
            if st.inputs:
                x = self._resolve(st.inputs[0], vals, recv, fv)
            else:
                x = torch.empty(s_out.piece_shape, dtype=TORCH_DTYPES[s_out.dtype], device=self.device)
            if not diff:
                y = x.contiguous().clone()
                dist.broadcast(y, c[2], group=pg)
                return y
            y = _Broadcast.apply(pg, c[2], anchor, x)
            sinks.append(y)
            return y
        x = self._resolve(st.inputs[0], vals, recv, fv)
        if c[0] == "reduce":
            if not diff:
                y = x.contiguous().clone()
                dist.reduce(y, c[2], group=pg)
            else:
                y = _Reduce.apply(pg, c[2], anchor, x)
                sinks.append(y)
            return y if ref is not None else None
        _, grp, dst, dim, order = c
        if not diff:
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in grp] if self.rank == dst else None
            dist.gather(x, parts, dst=dst, group=pg)
            if parts is None:
                return None
            y = torch.stack(parts)
        else:
            y = _Gather.apply(pg, dst, self.rank, len(grp), anchor, x)
            sinks.append(y)
            if self.rank != dst:
                return None
        return torch.cat([y[i] for i in order], dim=dim)

    def _loss_ref(self, kind: str):
        """The tensor the loss is computed on, its weight per piece, and the nodes to run.

        Starting from the first output, the walk goes back through parallel operators whose result is
        only fed to the loss: Combine / Batch / Replicate always (the loss adds the pieces where they
        are; copies count once), Reduce / AllReduce for the mean (a mean of a sum is the sum of the
        pieces' means), and stops where the pieces allow the loss (mean square and cross-entropy need
        no partial sums; cross-entropy needs whole class rows).  When the tensor is an AllReduce's
        output (a non-linear loss of a replicated result, as a Megatron row-parallel layer ends), every
        one of its k copies adds 1/k of its loss and the AllReduce's backward scales the local gradient
        by k instead of all-reducing identical gradients."""
        if kind in self._loss_refs:
            return self._loss_refs[kind]
        g = self.g
        ref = tuple(g.outputs[0])
        chain = [ref]
        linear = ("Reduce", "AllReduce") if kind == "mean" else ()
        while self.low.role[ref[0]] == "parallel" and g.node(ref[0]).op in ("Combine", "Batch", "Replicate") + linear:
            ref = tuple(g.node(ref[0]).inputs[0])
            chain.append(ref)
        pick = None
        for r in reversed(chain):
            s = g.shape(r)
            if self.low.role[r[0]] not in ("compute", "parallel") or (s.sum_degree != 1 and kind != "mean"):
                continue
            if kind == "ce" and s.rank >= 2 and s.degrees[1] != 1:
                continue
            pick = r
            break
        if pick is None:
            raise ExecutorError(f"cannot compute the loss on output {g.node(ref[0]).label()}: it holds partial "
                                f"sums or is not computed")
        split = None           # (AllReduce node, k): each copy adds 1/k (see docstring)
        n = g.node(pick[0])
        if kind != "mean" and n.op == "AllReduce" and self.low.role[n.id] == "parallel" \
                and self.low._allreduce_group(n) is not None:
            split = (n.id, n.a["degree"])
        need = set()
        stack = [pick[0]]
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            stack.extend(r[0] for r in g.node(i).inputs)
        self._loss_refs[kind] = (pick, need, split)
        return self._loss_refs[kind]

    def _forward_step(self, fv, kind, tt, ref, need, split):
        """The forward pass under the precision's context and, with ZeRO-3, its gathering hooks: the gathered
        weights are freed after the forward (the backward gathers again)."""
        zero3 = self._zrt if self.memory.zero == 3 else None
        if zero3 is not None:
            zero3.forward_phase = True
        try:
            with forward_context(self.precision, self.device), \
                    (zero3.hooks() if zero3 is not None else contextlib.nullcontext()):
                return self._forward(fv, kind, tt, ref, need, split)
        finally:
            if zero3 is not None:
                zero3.forward_phase = False
                zero3.work.clear()
                zero3._ptr.clear()

    def step(self, feeds=None, targets=None) -> float:
        """One training step; returns the loss (the same float on every rank)."""
        kind, tt = self._loss_kind(targets)
        ref, need, split = self._loss_ref(kind)
        fv = self._feeds(feeds)
        if tt is not None:
            self._tgt_off = self._target_offset(tt, kind, ref)
        zero3 = self._zrt if self.memory.zero == 3 else None
        total, part = self._forward_step(fv, kind, tt, ref, need, split)
        self._start_step_sync(part)
        if total.requires_grad:
            total.backward()
        if zero3 is None:
            self._finish_sync()
        else:
            zero3.end_step()
        return self._update_and_loss(part)

    def _update_and_loss(self, part) -> float:
        """The end of a step, after the gradient sync: the optimizer update, the step's loss (this rank's
        ``part``, summed over ranks: read from the loss bucket when it rode along with the gradients), the
        gradients zeroed; a non-finite loss stops the run."""
        if self._zrt is not None:
            self._zrt.step()
        else:
            self.opt.step()
        if self.world > 1 and self._loss_bucket is not None:
            lv = self._works[self._loss_bucket][1][-1:].to(torch.float64, copy=True)   # before the zeroing
        else:
            lv = part.double()
            if self.world > 1:
                dist.all_reduce(lv)
        self._zero_grads()
        self.step_no += 1
        loss = float(lv.item())
        if not math.isfinite(loss):
            raise ExecutorError(f"step {self.step_no - 1}: the loss is {loss}")
        return loss

    def _loss_kind(self, targets):
        """The loss kind of a step (``output`` runs as ``mean``: the graph's output is the loss) and the
        targets as a tensor on the device (None for mean / output)."""
        kind = self.loss
        if kind is None:
            kind = "mean" if targets is None else None
        if kind == "output":
            kind = "mean"
        if targets is None:
            if kind != "mean":
                raise ExecutorError(f"loss {kind} needs targets")
            return kind, None
        tt = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(np.asarray(targets))
        if kind is None:
            kind = "mse" if tt.is_floating_point() else "ce"
        if kind == "mean":
            raise ExecutorError(f"loss {self.loss} takes no targets")
        return kind, tt.to(self.device)

    def _target_offset(self, tt, kind, ref) -> int:
        """First batch row of the fed targets: 0 for whole targets, else this rank's target_rows()."""
        rows = self.g.shape(ref).sizes[0] if self.g.shape(ref).rank else 0
        if tt.dim() == 0 or tt.shape[0] == rows:
            return 0
        lo, hi = self.target_rows(kind)
        if tt.shape[0] != hi - lo:
            raise ExecutorError(f"targets have {tt.shape[0]} rows: neither the batch's {rows} nor this rank's "
                                f"rows {lo}:{hi}")
        return lo

    def feed_rows(self) -> dict[str, tuple[int, int]]:
        """Input name -> the rows ``(lo, hi)`` of its batch (dim 0) that this rank's steps read: the bounding
        range of the Input pieces its tasks take ((0, 0): none).  ``step`` takes feeds of exactly these rows
        (or whole batches)."""
        if getattr(self, "_rows", None) is None:
            rows: dict[str, tuple[int, int]] = {}
            for st in self.low.steps:
                for src in st.inputs:
                    if src is None or src.kind != "source":
                        continue
                    n = self.g.node(self.low.origin[src.ref[0]])
                    if n.op != "Input":
                        continue
                    full = tuple(n.a["shape"])
                    lo, hi = src.slices[0] if src.slices else (0, full[0] if full else 0)
                    r = rows.get(n.a["name"])
                    rows[n.a["name"]] = (lo, hi) if r is None else (min(r[0], lo), max(r[1], hi))
            for n in self._inputs:
                rows.setdefault(n.a["name"], (0, 0))
            self._rows = rows
        return dict(self._rows)

    def target_rows(self, kind: str | None = None) -> tuple[int, int]:
        """The rows ``(lo, hi)`` of the targets (dim 0 of the loss's output) this rank's loss pieces read
        ((0, 0): none)."""
        kind = kind or self.loss or "mse"
        if kind in ("output", "mean"):
            return (0, 0)
        ref, _, _ = self._loss_ref(kind)
        s = self.g.shape(ref)
        flat = self.low.mine.get(ref)
        if flat is None:
            return (0, 0)
        if not s.rank:
            return (0, 1)
        return tuple(block(s, flat)[0])

    def _forward(self, fv, kind, tt, ref, need, split):
        """The forward pass and the loss of this rank's pieces: ``(total, part)`` -- what backward starts
        from (the loss contribution tied to every communication output) and the detached contribution."""
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        sinks: list = []
        self._cur_loss_ref = ref
        vals = self._run(fv, need, anchor, sinks, split, keep=(ref,))
        contrib = self._piece_loss(vals, ref, kind, tt, split)
        total = contrib if contrib is not None else torch.zeros((), device=self.device)
        total = tie(total, sinks)
        part = (contrib.detach() if contrib is not None else torch.zeros((), device=self.device)).reshape(1)
        return total, part

    def _run(self, fv, need, anchor, sinks: list, split=None, keep=None) -> dict:
        """This rank's steps of the nodes in ``need`` on the feeds ``fv``: the local piece of every tensor
        it holds (ref -> tensor); communication outputs are appended to ``sinks`` (tie them to what the
        backward starts from).  Recompute regions run as checkpointed sub-programs; with ZeRO-3 each
        weight group is gathered before its first use (executor.memory).  With ``keep`` (the refs the
        caller reads afterwards) a value is dropped after the last item that reads it: the forward then
        holds only what the autograd graph saved for the backward, as the memory model counts; without,
        every value stays to the end (the returned table holds them all)."""
        vals: dict = {}
        bn_done: set = set()
        zrt = self._zrt if self.memory.zero == 3 else None
        frees = self._frees(need, keep) if keep is not None and not self.keep_values else {}
        for idx, item in enumerate(self._items):
            if zrt is not None:
                zrt.before_item(idx, anchor, sinks)
            if isinstance(item, Region):
                self._run_region(item, vals, fv, need, anchor, sinks, bn_done, split)
            elif item.node in need:
                self._run_step(item, vals, fv, anchor, sinks, bn_done, split)
            if zrt is not None:
                zrt.after_item(idx, anchor, sinks)
            for r in frees.get(idx, ()):
                vals.pop(r, None)
        if self.keep_values:
            self.last_values = {r: v.detach().clone() for r, v in vals.items() if isinstance(v, torch.Tensor)}
        return vals

    def _frees(self, need, keep) -> dict:
        """Item index -> the refs of this rank's values that no later item of ``need`` reads and the caller
        does not ``keep``: dropped from the forward's table after that item (cached per need and keep)."""
        key = (id(need), tuple(keep))
        hit = self._free_cache.get(key) if hasattr(self, "_free_cache") else None
        if hit is not None and hit[0] is need:
            return hit[1]
        last: dict = {}
        for idx, item in enumerate(self._items):
            for st in (item.steps if isinstance(item, Region) else [item]):
                if st.node not in need:
                    continue
                for r in st.outputs:
                    last.setdefault(r, idx)        # produced and never read: dropped after its item
                for r in step_reads(st, self.rank):
                    last[r] = idx
        out: dict = {}
        for r, idx in last.items():
            if r not in keep:
                out.setdefault(idx, []).append(r)
        if not hasattr(self, "_free_cache"):
            self._free_cache = {}
        self._free_cache[key] = (need, out)
        return out

    def _run_region(self, reg, vals, fv, need, anchor, sinks, bn_done, split) -> None:
        """One recompute region: its checkpointed runs under torch.utils.checkpoint (non-reentrant), the
        steps selective recomputation keeps plainly (executor.memory)."""
        from torch.utils.checkpoint import checkpoint
        keep = ({self._cur_loss_ref} if self._cur_loss_ref is not None else set()) | self.keep_refs
        for run in reg.runs:
            steps = [st for st in run.steps if st.node in need]
            if not steps:
                continue
            if not run.checkpointed:
                for st in steps:
                    self._run_step(st, vals, fv, anchor, sinks, bn_done, split)
                continue
            key = (self._cur_loss_ref, tuple(st.node for st in steps))
            io = run.io.get(key)
            if io is None:
                io = run.io[key] = run_io(type(run)(True, steps), self._items, self.rank, keep)
            ins, outs = io
            first = [True]
            drop = run.io.get(("drop",) + key)
            if drop is None:       # the run's own values, dropped after their last read inside it
                last = {}
                for i, st in enumerate(steps):
                    for r in st.outputs:
                        last.setdefault(r, i)
                    for r in step_reads(st, self.rank):
                        last[r] = i
                drop = run.io[("drop",) + key] = [[r for r, i in last.items() if i == j and r not in outs]
                                                   for j in range(len(steps))]

            ctx = self.recompute_context
            token = ctx[0]() if ctx is not None else None

            def fn(anchor_, *xs, steps=steps, ins=ins, outs=outs, first=first, drop=drop, token=token):
                local = dict(zip(ins, xs))
                sk: list = []
                again = not first[0]
                first[0] = False
                if again and ctx is not None:
                    ctx[1](token)
                for st, gone in zip(steps, drop):
                    self._run_step(st, local, fv, anchor_, sk, None if again else bn_done, split)
                    if not self.keep_values:
                        for r in gone:
                            local.pop(r, None)
                # the trigger: the run's last node, so the backward reaches it first and recomputes here
                trig = Trigger.apply(anchor_)
                return (*[local[r] for r in outs], *sk, trig)
            res = checkpoint(fn, anchor, *[vals[r] for r in ins], use_reentrant=False, preserve_rng_state=False)
            for r, y in zip(outs, res):
                vals[r] = y
            sinks.extend(res[len(outs):])

    def _run_step(self, st, vals, fv, anchor, sinks, bn_done, split) -> None:
        """One step of the lowered program (``bn_done`` None: a recomputation, which leaves BatchNorm's
        running statistics alone)."""
        recv = {}
        for j, e in enumerate(st.exchanges):
            if e.involves(self.rank):
                recv[e.ref] = self._exchange(e, self._tags[(st.node, j)], vals, anchor, sinks)
        if not st.outputs and not st.inputs:
            return
        if st.kind == "compute":
            xs = [self._resolve(s, vals, recv, fv) for s in st.inputs]
            casts = self._zero3_casts(st, xs) if self._zero3_names and self.precision == "bf16" else ()
            st.ctx.seed, st.ctx.step, st.ctx.training = self.seed, self.step_no, True
            st.ctx.extra["device"] = self.device
            if st.bn_group is not None:
                pg = self._group(st.bn_group)
                me = st.bn_group.index(self.rank)

                def gather(t, pg=pg, me=me, k=len(st.bn_group)):
                    y = _AllGather.apply(pg, k, me, anchor, t)
                    sinks.append(y)
                    return y
                st.ctx.stat_gather = gather
            outs = kernel(st.op)(st.attrs, xs, st.ctx)
            if casts:
                self._zrt.casts_done(casts)
            if st.bn_group is not None:
                st.ctx.stat_gather = None
            if st.node in self._bn:
                if bn_done is None:
                    st.ctx.extra.pop("bn_stats", None)
                else:
                    self._update_running_stats(st, xs[0], bn_done)
            for r, y in zip(st.outputs, outs):
                vals[r] = y
            return
        c = st.combine
        if c[0] == "allreduce":
            x = self._resolve(st.inputs[0], vals, recv, fv)
            if split is not None and split[0] == st.node and self.low.diff[st.outputs[0]]:
                y = _AllReduceToLoss.apply(self._group(c[1]), split[1], x)
            elif self.low.diff[st.outputs[0]]:
                y = _AllReduce.apply(self._group(c[1]), anchor, x)
                sinks.append(y)
            else:
                y = x.clone()
                dist.all_reduce(y, group=self._group(c[1]))
        elif c[0] == "dtensor":       # a DTensor redistribution on a DeviceMesh (executor.dtensor)
            x = self._resolve(st.inputs[0], vals, recv, fv)
            k = split[1] if split is not None and split[0] == st.node else 1
            y = c[1].run(x, self.rank, self._group, anchor, sinks, self.low.diff[st.outputs[0]], k)
        elif c[0] in ("reduce", "broadcast", "gather", "scatter"):
            y = self._collective(st, c, vals, recv, fv, anchor, sinks)
            if not st.outputs:
                return
        else:
            xs = [self._resolve(s, vals, recv, fv) for s in st.inputs]
            if c[0] == "cat":
                y = torch.cat(xs, dim=c[1])
            elif c[0] == "sum":
                y = xs[0]
                for x in xs[1:]:
                    y = y + x
            else:
                y = xs[0]
        vals[st.outputs[0]] = y

    def _piece_loss(self, vals, ref, kind, tt, split):
        """This rank's share of the loss on the pieces of ``ref`` it holds (copy 0 only; each AllReduce copy
        1/k with ``split``), or None when it holds none."""
        s = self.g.shape(ref)
        contrib = None
        flat = self.low.mine.get(ref)
        weight = 1.0
        if split is not None and flat is not None:
            copy = unravel(flat, s.grid)[0]
            flat = flat if copy // split[1] == 0 else None
            weight = 1.0 / split[1]
        if flat is not None and unravel(flat, s.grid)[0] == 0 or (split is not None and flat is not None):
            y = vals[ref]
            if y.dtype in (torch.bfloat16, torch.float16):
                y = y.float()         # the loss in float32 (under bf16 autocast the output is bf16)
            blk = block(s, flat)
            region = _slices(blk)
            off = self._tgt_off if kind != "mean" and s.rank else 0
            treg = _slices(((blk[0][0] - off, blk[0][1] - off),) + tuple(blk[1:])) if off else region
            if kind != "mean" and tt.dim() and s.rank and tt.shape[0] != s.sizes[0]:
                tshape = (s.sizes[0],) + tuple(tt.shape[1:])     # this rank's rows of the targets
            else:
                tshape = tuple(tt.shape) if tt is not None else None
            if kind == "mean":
                contrib = y.sum() / s.numel
            elif kind in ("mse", "bce"):
                if tshape != s.sizes:
                    raise ExecutorError(f"targets have shape {list(tt.shape)}, the output has {list(s.sizes)}")
                if kind == "mse":
                    contrib = ((y - tt[treg].to(y.dtype)) ** 2).sum() / s.numel
                else:
                    contrib = F.binary_cross_entropy_with_logits(y, tt[treg].to(y.dtype), reduction="sum") / s.numel
            else:
                want = s.sizes[:1] + s.sizes[2:]
                if tshape != want:
                    raise ExecutorError(f"class targets have shape {list(tt.shape)}, expected {list(want)}")
                treg = treg[:1] + treg[2:]
                contrib = F.cross_entropy(y, tt[treg].long(), reduction="sum") / (s.numel // s.sizes[1])
        if contrib is not None and weight != 1.0:
            contrib = contrib * weight
        return contrib


    # --- state ------------------------------------------------------------------------------------------
    def _assemble(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The full tensor, each region from the rank that owns it (collective when world > 1); ``t`` is
        what this rank holds (a parameter's region, or a full buffer)."""
        full = self._full.get(name, tuple(t.shape))
        if self.world == 1 and tuple(t.shape) == full:
            return t.detach().clone()
        buf = t.detach().new_zeros(full)
        for sl, devs in self._atoms.get(name, [((tuple((0, s) for s in full)), (0,))]):
            owner = min(devs) if devs else 0
            if owner == self.rank:
                buf[_slices(sl)] = t.detach()[self._rel(name, sl)]
        if self.world > 1:
            dist.all_reduce(buf, group=self._world_pg)
        return buf

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's own parameters and buffers, logical and full (collective: call on every rank)."""
        out = {name: self._assemble(name, p) for name, p in sorted(self._param_values().items())}
        out.update({name: self._assemble(name, b) if name in self._atoms else b.detach().clone()
                    for name, b in sorted(self.buffers.items())})
        return out

    def _param_values(self) -> dict[str, torch.Tensor]:
        """Weight name -> the region this rank holds (ZeRO-3: gathered from the shards, a collective)."""
        if self._zero3_names:
            vals = self._zrt.param_values()
            return {nm: vals.get(nm, p) for nm, p in self.params.items()}
        return dict(self.params)

    def load_model_state(self, d: Mapping[str, Any]) -> None:
        with torch.no_grad():
            mine = {}
            for name, p in self.params.items():
                if name in d:
                    v = torch.as_tensor(np.asarray(d[name]) if not isinstance(d[name], torch.Tensor) else d[name])
                    mine[name] = v[_slices(self._region[name])].to(self.device)
                    if name not in self._zero3_names:
                        p.copy_(mine[name])
            if self._zrt is not None:
                self._zrt.load_values(mine)
            for name, b in self.buffers.items():
                if name in d:
                    b.copy_(torch.as_tensor(d[name]))

    def optimizer_state(self) -> dict:
        """Optimizer state per parameter name, logical full tensors, plus the step count (collective:
        call on every rank).  A rank that never read a parameter has no state for it: every rank
        contributes the same entries (zeros where it has none, each region from its owner; scalar
        entries such as Adam's step count from the rank that stepped most)."""
        st = self.opt.state_dict()
        names = list(self.params)
        keys = {"adam": ("step", "exp_avg", "exp_avg_sq"), "momentum": ("momentum_buffer",)}.get(self._opt_kind, ())
        out: dict = {"step": self.step_no, "param_groups": [{k: v for k, v in grp.items() if k != "params"}
                                                            for grp in st["param_groups"]], "state": {}}
        if self._zrt is not None:
            return self._sharded_optimizer_state(out, keys)
        for idx, name in enumerate(names):
            s = st["state"].get(idx) or {}
            if not keys and not s:
                continue
            p = self.params[name]
            ent = {}
            for k in keys or tuple(s):
                v = s.get(k)
                if k == "step":
                    t = torch.as_tensor(float(v) if v is not None else 0.0, dtype=torch.float64)
                    if self.world > 1:
                        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._world_pg)
                    ent[k] = t.to(torch.float32)
                else:
                    v = v if isinstance(v, torch.Tensor) else torch.zeros_like(p)
                    ent[k] = self._assemble(name, v)
            out["state"][name] = ent
        return out

    def _sharded_optimizer_state(self, out: dict, keys) -> dict:
        """optimizer_state() of a sharded / offloaded update: each group's state shards gathered, then
        assembled per weight as without ZeRO (every rank the same entries, in the same order)."""
        per_key, step = self._zrt.state_tensors(keys)
        for name, p in self.params.items():
            if not keys:
                continue
            ent = {}
            for k in keys:
                if k == "step":
                    t = torch.as_tensor(step or 0.0, dtype=torch.float64)
                    if self.world > 1:
                        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._world_pg)
                    ent[k] = t.to(torch.float32)
                else:
                    v = per_key[k].get(name)
                    ent[k] = self._assemble(name, v if v is not None else torch.zeros_like(p))
            out["state"][name] = ent
        return out

    def load_optimizer_state(self, d: Mapping) -> None:
        names = list(self.params)
        if self._zrt is not None:
            keys = {"adam": ("step", "exp_avg", "exp_avg_sq"), "momentum": ("momentum_buffer",)}.get(self._opt_kind, ())
            saved = d.get("state", {})
            self._zrt.load_state_tensors({nm: saved[nm] for nm in self._zrt.names if nm in saved}, keys)
            for grp, sv in zip(self.opt.param_groups, d.get("param_groups", [])):
                grp.update({k: v for k, v in sv.items() if k != "params"})
            self.step_no = int(d.get("step", self.step_no))
            return
        cur = self.opt.state_dict()
        state = {}
        for idx, name in enumerate(names):
            if name in d.get("state", {}):
                full, region = self._full[name], _slices(self._region[name])
                state[idx] = {k: ((v[region] if tuple(v.shape) == full and v.dim() else v).to(self.device).clone()
                                  if isinstance(v, torch.Tensor) else v)
                              for k, v in d["state"][name].items()}
        cur["state"] = state
        for grp, saved in zip(cur["param_groups"], d.get("param_groups", [])):
            grp.update({k: v for k, v in saved.items() if k != "params"})
        self.opt.load_state_dict(cur)
        self.step_no = int(d.get("step", self.step_no))

    def local_shards(self) -> dict[str, tuple[torch.Tensor, dict]]:
        """The regions of each parameter this rank owns: name/region -> (tensor, placement info)
        (collective under ZeRO-3: the shards are gathered)."""
        out = {}
        for name, p in self._param_values().items():
            for sl, devs in self._atoms.get(name, []):
                if devs and min(devs) == self.rank:
                    key = name if len(self._atoms[name]) == 1 else f"{name}@" + ",".join(f"{a}:{b}" for a, b in sl)
                    out[key] = (p.detach()[self._rel(name, sl)], {"name": name, "region": sl, "devices": devs})
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: ``parameters`` (its weights' regions; ZeRO-3: its shards),
        ``optimizer`` (optimizer states, and the updated shard copies of ZeRO 1-2, on the device) and
        ``optimizer_host`` (the same in host memory, with offload)."""
        par = sum(p.numel() * p.element_size() for p in self.params.values())
        if self._zrt is not None:
            par += sum(sh.numel() * sh.element_size() for sh in self._zrt.shards)
            return {"parameters": par, **self._zrt.bytes()}
        opt = sum(v.numel() * v.element_size() for st in self.opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim()) if hasattr(self.opt, "state") else 0
        return {"parameters": par, "optimizer": opt, "optimizer_host": 0}


# --- helpers ---------------------------------------------------------------------------------------------

def _slices(region) -> tuple:
    return tuple(slice(a, b) for a, b in region)


def _numel(region) -> int:
    return math.prod(b - a for a, b in region)


def _atoms(shape: tuple, uses: list) -> list[tuple[tuple, tuple]]:
    """Split a weight into the regions read by the same set of devices: [(region, devices)]."""
    if not uses:
        return [(tuple((0, s) for s in shape), ())]
    cuts = []
    for d, size in enumerate(shape):
        pts = {0, size}
        for blk, _ in uses:
            pts.update(blk[d])
        cuts.append(sorted(pts))
    out = []
    import itertools
    for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
        region = tuple((cuts[d][i], cuts[d][i + 1]) for d, i in enumerate(idx))
        devs = sorted({dev for blk, dev in uses
                       if all(b0 <= r0 and r1 <= b1 for (b0, b1), (r0, r1) in zip(blk, region))})
        out.append((region, tuple(devs)))
    return out


__all__ = ["Trainer"]
