"""Running a plan's memory techniques (the plan's ``memory`` field, :class:`unity_pcg.plan.MemoryPlan`;
DESIGN "Executor").  The :class:`~executor.train.Trainer` owns the step; this module owns:

* **the schedule with recompute regions** (:func:`schedule`): the lowered steps in their global order,
  each :class:`~unity_pcg.plan.RecomputeRegion` gathered into one :class:`Region` item (its compute
  nodes plus the parallel operators between them: those fed by the region whose every consumer is in it;
  and the gathers feeding it -- Combine/Replicate chains from a compute output outside, every consumer in it --
  so that under sequence parallelism the checkpoint keeps the sequence shard and the all-gather runs again
  in the recomputation, as Megatron-LM does: :func:`search.memtech.region_members`),
  placed by a stable topological sort (a region that a path leaves and re-enters is refused).  Every rank
  derives the same items from the same plan.  A region's steps run under ``torch.utils.checkpoint``
  (non-reentrant) as one sub-program per *run*: ``full`` -> one run; ``selective`` -> each maximal run of
  steps that are not matmul/convolution-class operators (:data:`KEPT_CLASSES`, the cost model's
  ``op_class``), the matmul/convolution steps between them run plainly (their outputs kept), and so
  does a run whose operators save nothing (``search.memtech.saves_nothing``).  A run's inputs are the
  local tensors entering it, its outputs those read after it.  Its last operation is a *trigger*
  (:class:`Trigger`, saving ``anchor``) tied to the loss (:func:`tie`): the autograd engine runs nodes
  latest-created first, so on every rank the trigger is the run's first node reached by the backward, at
  the same point of the global order, and unpacking what it saved starts the recomputation there -- the
  run's communication runs again in the same order on every rank (no deadlock).  Dropout masks and random generators are
  hashes of (seed, step, node, index), so the recomputation draws the same values; BatchNorm running
  statistics are updated by the first run only.

* **ZeRO and offload** (:class:`ZeroRuntime`), over each weight's data-parallel copies: the atoms
  (weight regions read by one device set, ``Trainer._atoms``) that the plan all-reduces are grouped as the
  gradient buckets are (one :class:`ZeroGroup` per bucket of this rank; atoms read by this rank alone form
  one more group of one device).  A group is a flat vector of its atoms, padded to ``k * s`` and cut in
  ``k`` shards of ``s`` (k = the group's devices with ZeRO >= 1, else 1); rank j of the group owns shard j.
  With stage 3 a bucket is split further by *unit* (the cost model's: the ``search.memtech.regions`` region
  -- a layer -- of the weight's first read), so each all-gather brings one unit's weights, as it prices.
  The optimizer (torch's SGD / momentum / Adam: element-wise, so a flat shard updates exactly as the
  whole tensors) holds one parameter per group: this rank's shard of the values.  Stage 1: gradients
  all-reduced as without ZeRO, the update of one's shard, then an all-gather of the parameters.  Stage 2:
  reduce-scatter of the gradient buckets instead.  Stage 3: parameters held only as shards; each group is
  all-gathered (:class:`_ZeroGather`, backward: reduce-scatter of the padded flat gradient into the
  shard's) before its first use in the forward, a weight that is one atom of the group being a view of
  one split of the padded vector (its gradient made whole once, by the split's backward), and the full
  weights freed after its last use: tensors the autograd graph saves that live in a gathered vector (or
  an assembled weight) are packed as (group or name, view) and, in the backward,
  gathered again by a trigger (:class:`_Regather`) created after the group's last use (so it runs
  before any of the uses' backward, at the same point of the global order on every member) and freed by
  the gather's own backward.  Under bf16 autocast the weights only bf16 operators read (``read_in_bf16``) form
  groups of their own gathered in bf16 (their gradient reduce-scattered in float32); another weight a bf16
  operator reads is converted by the executor (:meth:`ZeroRuntime.cast`, as autocast would) and a saved
  conversion packed the same way (converted again from the values gathered for the backward).  Offload: the optimizer's parameters and states are separate host tensors;
  the gradient shard is copied there, the update runs there, the values are copied back.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .kernels import ExecutorError

def _kept_classes():
    """Operator classes (search.cost.op_class) whose outputs selective recomputation keeps: the cost
    model's :data:`search.memtech.SELECTIVE_KEEP` (dense matmuls, convolutions, embeddings; attention's
    batched matmuls are recomputed with its softmax, as Megatron-LM's selective form)."""
    from unity_pcg.search.memtech import SELECTIVE_KEEP
    return SELECTIVE_KEEP


def _saves_nothing(op: str) -> bool:
    """Operator ``op`` saves nothing for its backward (views, casts, additions; search.memtech.saves_nothing):
    selective recomputation does not checkpoint a run made of these (and communication) alone -- it
    would keep its input instead."""
    from unity_pcg.search.memtech import saves_nothing
    return saves_nothing(op)


def kept_in_selective(op: str, in_shapes=None) -> bool:
    """Whether selective recomputation keeps the output of compute operator ``op`` on inputs of
    ``in_shapes`` (the cost model's class of it, which may depend on the shapes: a MatMul of two
    operands of rank >= 3 is a batched matmul, recomputed)."""
    from unity_pcg.search.cost import op_class
    return op_class(op, in_shapes) in _kept_classes()


# --- recompute regions ---------------------------------------------------------------------------------------

@dataclass
class Run:
    """Consecutive steps of a region: checkpointed (recomputed in the backward) or plain (kept)."""
    checkpointed: bool
    steps: list
    io: dict = field(default_factory=dict)     # per loss ref: (input refs, output refs) on this rank


@dataclass
class Region:
    index: int
    mode: str
    nodes: frozenset
    steps: list
    runs: list


def _members(low, nodes: set, taken: dict, outputs: set) -> set:
    """The region's steps: its compute nodes, the parallel operators between them (fed by the region,
    every consumer inside it, not a graph output) and the gathers feeding it (a Combine -> Replicate
    all-gather of a sequence shard: the checkpoint keeps the shard and the redistribution runs again in
    the recomputation) -- the cost model's :func:`search.memtech.region_members`, on the lowering's roles."""
    from unity_pcg.search.memtech import region_members
    return region_members(low.g, low.role, nodes, taken, outputs)


def schedule(low, regions) -> list:
    """The steps of ``low`` with each recompute region as one :class:`Region` item, in a stable
    topological order (the lowering's order wherever the regions allow); the same on every rank."""
    if not regions:
        return list(low.steps)
    g = low.g
    pos = {st.node: i for i, st in enumerate(low.steps)}
    outputs = {r[0] for r in g.outputs}
    unit: dict = {}            # node -> unit key
    regs: list[Region] = []
    for k, reg in enumerate(regions):
        for nid in reg.nodes:
            if nid not in pos or low.role.get(nid) != "compute":
                raise ExecutorError(f"recompute region {k}: node {nid} is not a compute node of the plan")
        mem = _members(low, set(reg.nodes), unit, outputs)
        for i in mem:
            unit[i] = ("r", k)
        steps = sorted((low.steps[pos[i]] for i in mem), key=lambda st: pos[st.node])
        regs.append(Region(k, reg.mode, frozenset(mem), steps, _runs(steps, reg.mode, g)))
    for st in low.steps:
        unit.setdefault(st.node, ("s", st.node))
    # dependencies between units: a step reads its node's inputs (a redistribution: its chain's head)
    deps: dict = {u: set() for u in set(unit.values())}
    prio: dict = {}
    for st in low.steps:
        u = unit[st.node]
        prio[u] = min(prio.get(u, pos[st.node]), pos[st.node])
        srcs = [r[0] for r in g.node(st.node).inputs]
        if st.node in low.redist:
            srcs.append(low.redist[st.node][0][0])
        for s in srcs:
            if s in unit and unit[s] != u:
                deps[u].add(unit[s])
    users: dict = {u: set() for u in deps}
    for u, ds in deps.items():
        for d in ds:
            users[d].add(u)
    left = {u: len(ds) for u, ds in deps.items()}
    heap = [(prio[u], u) for u, c in left.items() if c == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in users[u]:
            left[v] -= 1
            if left[v] == 0:
                heapq.heappush(heap, (prio[v], v))
    if len(order) != len(deps):
        bad = sorted(k for (kind, k) in deps if kind == "r" and left[(kind, k)] > 0)
        k = bad[0] if bad else 0
        raise ExecutorError(f"recompute region {k} (nodes {sorted(regions[k].nodes)}) cannot run as one "
                            f"sub-program: a path leaves it and comes back")
    return [regs[k] if kind == "r" else low.steps[pos[k]] for kind, k in order]


def _runs(steps: list, mode: str, g=None) -> list:
    if mode == "full":
        return [Run(True, list(steps))]
    runs: list = []
    for st in steps:
        kept = st.kind == "compute" and kept_in_selective(st.op, g.input_shapes(st.node) if g is not None else None)
        if kept:
            runs.append(Run(False, [st]))
        elif runs and runs[-1].checkpointed:
            runs[-1].steps.append(st)
        else:
            runs.append(Run(True, [st]))
    # a run of operators that save nothing and communication alone: run it plainly
    for run in runs:
        if run.checkpointed and all(st.kind != "compute" or _saves_nothing(st.op) for st in run.steps):
            run.checkpointed = False
    return runs


def step_reads(st, rank: int) -> list:
    """Local tensors (refs) a step reads on ``rank``, in order."""
    out = [s.ref for s in st.inputs if s.kind == "local"]
    for e in st.exchanges:
        out.extend(t.ref for t in e.transfers if t.src == rank)
    return out


def run_io(run: Run, all_items: list, rank: int, keep: set) -> tuple[list, list]:
    """(inputs, outputs) of a checkpointed run on ``rank``: the local tensors it reads that it does not
    produce, and those it produces that a step outside it (or ``keep``: the loss) reads."""
    inside = {id(st) for st in run.steps}
    produced: list = []
    for st in run.steps:
        produced.extend(st.outputs)
    pset = set(produced)
    ins: list = []
    for st in run.steps:
        for r in step_reads(st, rank):
            if r not in pset and r not in ins:
                ins.append(r)
    outside: set = set(keep)
    for item in all_items:
        for st in (item.steps if isinstance(item, Region) else [item]):
            if id(st) not in inside:
                outside.update(step_reads(st, rank))
    outs = [r for r in dict.fromkeys(produced) if r in outside]
    return ins, outs


# --- the recomputation's trigger and the tie to the loss --------------------------------------------------

class Trigger(torch.autograd.Function):
    """The last operation of a checkpointed run: saves ``anchor`` (so unpacking it in the backward starts
    the run's recomputation) and returns a zero scalar tied to the loss (:func:`tie`).  Its backward only
    unpacks; it launches no kernel and gives ``anchor`` no gradient."""

    @staticmethod
    def forward(ctx, anchor):
        ctx.save_for_backward(anchor)
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors            # noqa: B018 - unpacking is what recomputes the run
        return None


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, total, *sinks):
        ctx.meta = [(s.shape, s.dtype, s.device) for s in sinks]
        return total.clone()

    @staticmethod
    def backward(ctx, g):
        zeros: dict = {}
        out = [g]
        for i, (shape, dt, dev) in enumerate(ctx.meta):
            if not ctx.needs_input_grad[i + 1]:
                out.append(None)
                continue
            z = zeros.get((dt, dev))
            if z is None:
                z = zeros[(dt, dev)] = torch.zeros((), dtype=dt, device=dev)
            out.append(z.expand(shape))
        return tuple(out)


def tie(total: torch.Tensor, sinks: list) -> torch.Tensor:
    """``total`` with every tensor of ``sinks`` (communication outputs, recomputation triggers) tied to it:
    the backward from the result reaches each sink with a zero gradient (their autograd nodes run: the
    collectives' backward, the recomputations).  One autograd node for all of them, one kernel for the
    zeros of each dtype -- not a sum, a product and an add per sink."""
    sinks = [t for t in sinks if isinstance(t, torch.Tensor) and t.requires_grad]
    if not sinks:
        return total
    return _Tie.apply(total, *sinks)


# --- ZeRO and offload --------------------------------------------------------------------------------------

def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


@dataclass
class ZeroGroup:
    """One flat group of atoms (see the module docstring): ``items`` = [(name, region, offset, numel)]."""
    devs: tuple
    items: list
    n: int
    k: int                   # shards (1: not sharded)
    j: int                   # this rank's shard
    s: int                   # shard length
    bucket: int | None       # the Trainer's gradient bucket (None: the atoms read by this rank alone)
    pg: object = None        # the bucket's process group (k > 1)
    dtype: torch.dtype = torch.float32
    work: torch.dtype | None = None   # stage 3: the dtype it is gathered in for the steps (None: ``dtype``)

    @property
    def lo(self) -> int:
        return self.j * self.s


class _ZeroGather(torch.autograd.Function):
    """A ZeRO-3 group's padded flat values from its shards (all-gather); the backward reduce-scatters the
    padded flat gradient (made whole once, by the split the weights are views of) into this rank's shard
    and frees the group's values gathered again for the backward."""

    @staticmethod
    def forward(ctx, rt, gi, anchor, shard):
        """(the padded vector, a scalar token): the token ties the backward's reduce-scatter to the loss
        (a sink) without a gradient of the vector's size (a slice's backward would make one)."""
        ctx.rt, ctx.gi = rt, gi
        return rt._gather_work(rt.groups[gi], shard.detach()), shard.new_zeros(())

    @staticmethod
    def backward(ctx, gflat, _token):
        rt, grp = ctx.rt, ctx.rt.groups[ctx.gi]
        out = torch.empty(grp.s, dtype=grp.dtype, device=gflat.device)
        # (a group gathered in bf16: its gradient reduce-scattered in the parameters' dtype, as autocast's
        # conversion's backward would hand it on)
        dist.reduce_scatter_tensor(out, gflat.to(grp.dtype).contiguous(), group=grp.pg)
        rt.release(ctx.gi)
        return None, None, None, out


class _Regather(torch.autograd.Function):
    """Created after a ZeRO-3 group's last use in the forward; its backward (run before any use's
    backward) gathers the group's values again for the saved tensors the uses unpack."""

    @staticmethod
    def forward(ctx, rt, gi, anchor):
        ctx.rt, ctx.gi = rt, gi
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        ctx.rt.regather(ctx.gi)
        return None, None, torch.zeros((), device=g.device)


def _slices(region) -> tuple:
    return tuple(slice(a, b) for a, b in region)


class ZeroRuntime:
    """The sharded (or offloaded) update and, with stage 3, sharded parameters of one Trainer."""

    def __init__(self, tr, stage: int, offload: bool, optimizer: str, lr: float):
        from .train import _numel, make_optimizer
        self.tr = tr
        self.stage = int(stage)
        self.offload = bool(offload)
        self.device = tr.device
        self.host = torch.device("cpu")
        rank = tr.rank
        self.groups: list[ZeroGroup] = []

        def add(devs, items, bucket):
            flat, off = [], 0
            for name, sl in items:
                k = _numel(sl)
                flat.append((name, tuple(sl), off, k))
                off += k
            k = len(devs) if self.stage >= 1 else 1
            s = -(-off // k)
            dt = tr.params[items[0][0]].dtype
            pg = tr._bucket_pgs.get(devs) if k > 1 else None
            self.groups.append(ZeroGroup(tuple(devs), flat, off, k, devs.index(rank) if k > 1 else 0, s, bucket,
                                         pg, dt))
        unit = self.units(tr._items) if self.stage == 3 else {}
        # stage 3 under bf16: weights every step reads in bf16 (autocast's "low" operators) are gathered in bf16
        low = self.read_in_bf16(tr._items) if self.stage == 3 and getattr(tr, "precision", "fp32") == "bf16" \
            else frozenset()
        for i in tr._my_buckets:
            b = tr._buckets[i]
            if self.stage == 3:     # one group per unit (and gather dtype): the bucket's weights of one unit
                units: dict = {}
                for it in b["items"]:
                    units.setdefault((unit.get(it[0], (-1, -1)), it[0] in low), []).append(it)
                for (_, bf16), its in sorted(units.items()):
                    add(b["devs"], its, i)
                    grp = self.groups[-1]
                    if bf16 and grp.k > 1 and grp.dtype == torch.float32:
                        grp.work = torch.bfloat16
            else:
                add(b["devs"], b["items"], i)
        alone = [(name, sl) for name in tr.params for sl, devs in tr._atoms.get(name, []) if tuple(devs) == (rank,)]
        if alone:
            add((rank,), alone, None)
        self.names = sorted({it[0] for grp in self.groups for it in grp.items})
        # this rank's shard of every group: the optimizer's parameters (host copies with offload)
        values = {nm: tr.params[nm].detach() for nm in self.names}
        self.shards: list[torch.Tensor] = []       # stage 3: the parameters at rest (device, leaves)
        self.upd: list[torch.Tensor] = []          # what the optimizer updates
        for grp in self.groups:
            sh = self._flatten(grp, values)[grp.lo:grp.lo + grp.s].clone()
            if self.stage == 3:
                sh = torch.nn.Parameter(sh)
                self.shards.append(sh)
            if self.offload:
                u = sh.detach().to(self.host, copy=True)
                if self.device.type == "cuda":
                    u = u.pin_memory()
                u = torch.nn.Parameter(u)
            elif self.stage == 3:
                u = sh
            else:
                u = torch.nn.Parameter(sh)
            self.upd.append(u)
        self.opt = make_optimizer(optimizer, list(self.upd), lr)
        # stage 3: where each weight is read (item positions of the schedule), gathered values
        self.first: dict[int, list[int]] = {}      # item index -> groups gathered before it
        self.last: dict[int, list[int]] = {}       # item index -> groups whose regather trigger follows it
        self.drop: dict[int, list[str]] = {}       # item index -> weights freed after it
        self.work: dict[str, torch.Tensor] = {}    # forward: weight name -> its values (region shape)
        self._ptr: dict[int, tuple] = {}           # storage address -> ("w", weight name) / ("g", group) (forward)
        self._open: dict[int, set] = {}            # group -> its weights still read in the forward
        # weight name -> (group, offset, numel, shape) where the weight is one atom of one group: its values
        # are a view of the group's gathered vector (no copy; the gradient made whole once, by the split)
        self._whole: dict[str, tuple] = {}
        atoms: dict = {}
        for gi, grp in enumerate(self.groups):
            for name, sl, off, k in grp.items:
                atoms.setdefault(name, []).append((gi, sl, off, k))
        for name, al in atoms.items():
            if len(al) == 1 and tuple(al[0][1]) == tuple(tuple(x) for x in tr._region.get(name, al[0][1])):
                gi, sl, off, k = al[0]
                self._whole[name] = (gi, off, k, [b - a for a, b in sl])
        self.flat_bw: dict[int, torch.Tensor] = {}  # backward: values gathered again
        self.work_bw: dict[str, torch.Tensor] = {}
        self.forward_phase = False
        if self.stage == 3:
            with torch.no_grad():
                for nm in self.names:
                    tr.params[nm].data = tr.params[nm].data.new_empty(0)

    # --- flat layout ---------------------------------------------------------------------------------
    def _flatten(self, grp: ZeroGroup, values: dict) -> torch.Tensor:
        """The group's padded flat vector from region-shaped tensors per weight name (of this rank)."""
        out = torch.zeros(grp.s * grp.k, dtype=grp.dtype, device=self.device)
        for name, sl, off, k in grp.items:
            v = values.get(name)
            if v is not None:
                out[off:off + k] = v[self.tr._rel(name, sl)].reshape(-1).to(out.device, out.dtype)
        return out

    def _unflatten(self, grp: ZeroGroup, flat: torch.Tensor, out: dict) -> None:
        for name, sl, off, k in grp.items:
            dst = out[name][self.tr._rel(name, sl)]
            dst.copy_(flat[off:off + k].view_as(dst))

    def _gather_work(self, grp: ZeroGroup, shard: torch.Tensor) -> torch.Tensor:
        """The group's padded flat vector for the steps (stage 3): gathered in its work dtype."""
        if grp.work is not None and grp.k > 1:
            shard = shard.detach().to(self.device, grp.work)
        return self._full(grp, shard)

    def _full(self, grp: ZeroGroup, shard: torch.Tensor) -> torch.Tensor:
        """The group's padded flat vector from this rank's shard (all-gather over the group)."""
        shard = shard.detach().to(self.device)
        if grp.k == 1:
            return shard
        out = torch.empty(grp.s * grp.k, dtype=shard.dtype, device=self.device)
        _all_gather(out, shard.contiguous(), grp.pg)
        return out

    # --- the update -----------------------------------------------------------------------------------
    def grad_shard(self, gi: int) -> torch.Tensor | None:
        """This rank's shard of group ``gi``'s synchronized gradient (stages 0-2, after the sync)."""
        tr, grp = self.tr, self.groups[gi]
        if grp.bucket is not None:
            if self.stage == 2:
                return tr._rs_out[grp.bucket]
            flat = tr._flat[grp.bucket]
            g = flat[grp.lo:grp.lo + grp.s]
            if g.numel() < grp.s:
                g = torch.cat([g, g.new_zeros(grp.s - g.numel())])
            return g
        grads = {nm: tr.params[nm].grad for nm in self.names if tr.params[nm].grad is not None}
        if not grads:
            return None
        return self._flatten(grp, grads)[grp.lo:grp.lo + grp.s]

    def step(self) -> None:
        """The update of this rank's shards, then the parameters made whole again (stages 0-2)."""
        if self.stage < 3:
            for gi, u in enumerate(self.upd):
                g = self.grad_shard(gi)
                if g is not None and g.device == u.device and g.dtype == u.dtype and g.is_contiguous():
                    u.grad = g.detach()      # the synchronized shard itself: no copy of it at the update
                else:
                    u.grad = None if g is None else g.detach().to(u.device, copy=True)
        elif self.offload:
            for sh, u in zip(self.shards, self.upd):
                u.grad = None if sh.grad is None else sh.grad.detach().to(self.host, copy=True)
        self.opt.step()
        with torch.no_grad():
            if self.stage == 3:
                if self.offload:
                    for sh, u in zip(self.shards, self.upd):
                        sh.copy_(u.to(self.device))
                return
            params = {nm: self.tr.params[nm].data for nm in self.names}
            for grp, u in zip(self.groups, self.upd):
                self._unflatten(grp, self._full(grp, u), params)

    def zero_grad(self) -> None:
        for u in self.upd:
            u.grad = None
        for sh in self.shards:
            sh.grad = None

    # --- stage 3: gathering ------------------------------------------------------------------------------
    def uses(self, items: list) -> tuple[dict, dict, dict]:
        """Weight name -> index of the first / last item of the schedule reading it (a recompute region is
        one item), and -> the compute node that reads it first."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        node: dict[str, int] = {}
        for idx, st, nm in self._weight_reads(items):
            if nm not in first:
                first[nm], node[nm] = idx, st.node
            last[nm] = idx
        return first, last, node

    def _weight_reads(self, items: list):
        """(item index, compute step, weight name) of every weight a compute step of ``items`` reads."""
        g, low = self.tr.g, self.tr.low
        for idx, item in enumerate(items):
            for st in (item.steps if isinstance(item, Region) else [item]):
                if st.kind != "compute":
                    continue
                for r in g.node(st.node).inputs:
                    o = low.origin.get(r[0])
                    if o is not None and low.role[o] == "weight":
                        yield idx, st, g.node(o).a["name"]

    def read_in_bf16(self, items: list) -> frozenset:
        """Names of the weights whose every reading step is an operator autocast runs in bf16 (the registry's
        ``autocast == "low"``: it would convert the float32 weight itself)."""
        from unity_pcg import ops
        seen: dict[str, bool] = {}
        for _, st, nm in self._weight_reads(items):
            seen[nm] = seen.get(nm, True) and ops.autocast(st.op) == "low"
        return frozenset(nm for nm, ok in seen.items() if ok and self.tr.params[nm].dtype == torch.float32)

    def units(self, items: list) -> dict:
        """Weight name -> its ZeRO-3 *unit*, as the cost model's (search.memtech.Techniques): the region
        of ``search.memtech.regions`` (cut where one activation is live: a layer) holding the compute
        node that reads it first, else that node; a unit's weights are gathered together, ordered by
        their first read."""
        from unity_pcg.search.memtech import regions
        first, _, node = self.uses(items)
        region_of = {n: i for i, r in enumerate(regions(self.tr.g)) for n in r}
        out: dict = {}
        start: dict = {}
        for nm, n in node.items():
            key = ("r", region_of[n]) if n in region_of else ("n", n)
            start[key] = min(start.get(key, first[nm]), first[nm])
            out[nm] = key
        return {nm: (start[key], key[1] if key[0] == "r" else -1 - key[1]) for nm, key in out.items()}

    def plan_gathers(self, items: list) -> None:
        """Item positions of the schedule where each group is gathered (first use of its weights: with
        stage 3 a group is one unit of one bucket), its regather trigger created (after the last use)
        and each weight freed (after its last use)."""
        first, last, _ = self.uses(items)
        for gi, grp in enumerate(self.groups):
            names = {it[0] for it in grp.items}
            f = min(first.get(nm, 0) for nm in names)
            la = max(last.get(nm, 0) for nm in names)
            self.first.setdefault(f, []).append(gi)
            if grp.k > 1:
                self.last.setdefault(la, []).append(gi)
        for nm in self.names:
            self.drop.setdefault(last.get(nm, 0), []).append(nm)
        self._groups_of = {nm: [gi for gi, grp in enumerate(self.groups) if any(it[0] == nm for it in grp.items)]
                           for nm in self.names}

    def _split(self, grp: ZeroGroup, full: torch.Tensor) -> list:
        """The group's atoms as views of one split of its padded vector (the padding the last piece): the
        backward of the split makes the padded gradient whole once, from the atoms' gradients."""
        sizes = [k for _, _, _, k in grp.items]
        if full.numel() > grp.n:
            sizes.append(full.numel() - grp.n)
        return list(full.split(sizes))

    def before_item(self, idx: int, anchor, sinks: list) -> None:
        for gi in self.first.get(idx, ()):
            grp = self.groups[gi]
            if grp.k > 1:
                full, token = _ZeroGather.apply(self, gi, anchor, self.shards[gi])
                sinks.append(token)                 # ties the backward's reduce-scatter, keeps no values
                if full.numel():
                    self._ptr[full.untyped_storage().data_ptr()] = ("g", gi)
                    self._open[gi] = {it[0] for it in grp.items}
            else:
                full = self.shards[gi]               # the parameter itself (alive anyway)
            parts = self._split(grp, full)
            for (name, sl, off, k), part in zip(grp.items, parts):
                shape = [b - a for a, b in sl]
                if name in self._whole:
                    self.work[name] = part.view(shape)
                    continue
                w = self.work.get(name)
                if w is None:
                    w = self._blank(name, work=True)
                    self.work[name] = w
                    if w.numel():
                        self._ptr[w.untyped_storage().data_ptr()] = ("w", name)
                w[self.tr._rel(name, sl)] = part.view(shape)

    def after_item(self, idx: int, anchor, sinks: list) -> None:
        for gi in self.last.get(idx, ()):
            sinks.append(_Regather.apply(self, gi, anchor))
        for nm in self.drop.get(idx, ()):
            w = self.work.pop(nm, None)
            if nm in self._whole:
                gi = self._whole[nm][0]
                left = self._open.get(gi)
                if left is not None:
                    left.discard(nm)
                    if not left:                 # the group's vector is freed with its last weight's view
                        del self._open[gi]
                        for ptr, key in list(self._ptr.items()):
                            if key == ("g", gi):
                                del self._ptr[ptr]
            elif w is not None and w.numel():
                self._ptr.pop(w.untyped_storage().data_ptr(), None)

    def _blank(self, name: str, work: bool = False) -> torch.Tensor:
        """Zeros of weight ``name``'s region shape: in the parameter's dtype, or (``work``) in the dtype its
        groups are gathered in for the steps."""
        shape = [b - a for a, b in self.tr._region[name]]
        dt = self.tr.params[name].dtype
        if work:
            dt = next((self.groups[gi].work for gi in self._groups_of.get(name, ())
                       if self.groups[gi].work is not None), dt)
        return torch.zeros(shape, dtype=dt, device=self.device)

    def value(self, name: str) -> torch.Tensor:
        """A stage-3 weight's values (region shape): the forward's gathered ones, or in the backward
        (a recomputed region, an unpacked saved tensor) the ones gathered again."""
        if self.forward_phase:
            w = self.work.get(name)
            if w is None:
                raise ExecutorError(f"ZeRO-3: weight {name!r} read outside the steps that gather it")
            return w
        w = self.work_bw.get(name)
        if w is None and name in self._whole:
            gi, off, k, shape = self._whole[name]
            w = self._flat_bw(gi)[off:off + k].view(shape).detach()
            w.requires_grad_(True)
            self.work_bw[name] = w
        if w is None:
            w = self._blank(name, work=True)
            for gi in self._groups_of[name]:
                grp = self.groups[gi]
                flat = self._flat_bw(gi)
                for nm, sl, off, k in grp.items:
                    if nm == name:
                        w[self.tr._rel(nm, sl)] = flat[off:off + k].view([b - a for a, b in sl])
            # as the forward's: a recomputed region saves what the forward saved (its graph is dropped)
            w.requires_grad_(True)
            self.work_bw[name] = w
        return w

    def _flat_bw(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s padded vector in the backward: gathered again (kept until its reduce-scatter)."""
        flat = self.flat_bw.get(gi)
        if flat is None:
            grp = self.groups[gi]
            flat = self.shards[gi].detach() if grp.k == 1 else self._gather_work(grp, self.shards[gi])
            if grp.k > 1:
                self.flat_bw[gi] = flat
        return flat

    def regather(self, gi: int) -> None:
        grp = self.groups[gi]
        self.flat_bw[gi] = self._gather_work(grp, self.shards[gi])

    def release(self, gi: int) -> None:
        self.flat_bw.pop(gi, None)
        for name, _, _, _ in self.groups[gi].items:
            self.work_bw.pop(name, None)

    def end_step(self) -> None:
        self.work.clear()
        self._ptr.clear()
        self._open.clear()
        self.flat_bw.clear()
        self.work_bw.clear()

    def cast(self, name: str, cut: tuple, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight ``name`` (its slices ``cut``: ``x``) converted to ``dtype`` for one operator, registered
        so a saved copy is packed as the conversion of the values gathered again (see :meth:`hooks`)."""
        y = x.to(dtype, memory_format=torch.contiguous_format)
        if y.numel():
            self._ptr[y.untyped_storage().data_ptr()] = ("c", (name, cut, dtype))
        return y

    def casts_done(self, ys: list) -> None:
        """The operator that read the conversions ``ys`` has run: their storages are forgotten (freed
        unless saved, their addresses may be another tensor's next)."""
        for y in ys:
            if y.numel():
                self._ptr.pop(y.untyped_storage().data_ptr(), None)

    def hooks(self):
        """saved_tensors_hooks for the forward: a saved tensor living in a gathered group's vector (or a
        weight assembled from several atoms, or a conversion of one: :meth:`cast`) is kept as (group or
        weight name, view) and rebuilt from the values gathered again in the backward (the same padded
        layout; a conversion converted again, the same values)."""
        def pack(t):
            if self._ptr and t.numel():
                key = self._ptr.get(t.untyped_storage().data_ptr())
                if key is not None:
                    return ("zero3", key, tuple(t.size()), tuple(t.stride()), t.storage_offset())
            return t

        def unpack(h):
            if isinstance(h, tuple) and h and h[0] == "zero3":
                _, (kind, key), size, stride, off = h
                if kind == "c":
                    name, cut, dtype = key
                    v = self.value(name)
                    base = (v[cut] if cut else v).to(dtype, memory_format=torch.contiguous_format)
                else:
                    base = self._flat_bw(key) if kind == "g" else self.value(key)
                return base.as_strided(size, stride, off)
            return h
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    # --- state ----------------------------------------------------------------------------------------
    def param_values(self) -> dict[str, torch.Tensor]:
        """Region-shaped values of every weight of the groups (stage 3: gathered; collective over the
        groups, in group order)."""
        out = {nm: self._blank(nm) for nm in self.names}
        with torch.no_grad():
            for grp, sh in zip(self.groups, self.shards):
                self._unflatten(grp, self._full(grp, sh), out)
        return out

    def load_values(self, values: dict) -> None:
        """Shards (and host copies) from full-size or region-shaped values per name (no collective)."""
        with torch.no_grad():
            for gi, grp in enumerate(self.groups):
                sh = self._flatten(grp, values)[grp.lo:grp.lo + grp.s]
                if self.stage == 3:
                    self.shards[gi].copy_(sh)
                self.upd[gi].copy_(sh.to(self.upd[gi].device))

    def state_tensors(self, keys) -> tuple[dict, float | None]:
        """Optimizer state per key and weight name (region-shaped; collective over the groups) and the
        step count (None: no state yet)."""
        sd = self.opt.state
        out: dict = {}
        step = None
        for key in keys:
            if key == "step":
                continue
            out[key] = {nm: self._blank(nm) for nm in self.names}
            for grp, u in zip(self.groups, self.upd):
                v = sd.get(u, {}).get(key)
                v = torch.zeros(grp.s, dtype=grp.dtype) if v is None else v
                self._unflatten(grp, self._full(grp, v), out[key])
        for u in self.upd:
            v = sd.get(u, {}).get("step")
            if v is not None:
                step = max(step or 0.0, float(v))
        return out, step

    def load_state_tensors(self, per_name: dict, keys) -> None:
        """Optimizer state from full tensors: ``per_name`` weight name -> {key: tensor}."""
        state = {}
        for gi, (grp, u) in enumerate(zip(self.groups, self.upd)):
            ent = {}
            for key in keys:
                vals = {nm: d[key] for nm, d in per_name.items() if key in d}
                if key == "step":
                    if vals:
                        v = next(iter(vals.values()))
                        ent[key] = torch.as_tensor(float(v), dtype=torch.float32)
                    continue
                if not vals:
                    continue
                full = {nm: torch.as_tensor(v)[_slices(self.tr._region[nm])]
                        if tuple(v.shape) == self.tr._full[nm] else torch.as_tensor(v) for nm, v in vals.items()}
                ent[key] = self._flatten(grp, full)[grp.lo:grp.lo + grp.s].to(u.device).clone()
            if ent:
                state[gi] = ent
        cur = self.opt.state_dict()
        cur["state"] = state
        self.opt.load_state_dict(cur)

    def bytes(self) -> dict:
        """Bytes this rank holds for the update: optimizer states and the updated copies, on the device
        and on the host (offload)."""
        dev = host = 0
        for u in self.upd:
            n = u.numel() * u.element_size()
            st = sum(v.numel() * v.element_size() for v in self.opt.state.get(u, {}).values()
                     if isinstance(v, torch.Tensor) and v.dim())
            if self.offload:
                host += n + st
            else:
                dev += st + (0 if self.stage == 3 else n)
        return {"optimizer": dev, "optimizer_host": host}


__all__ = ["schedule", "Region", "Run", "ZeroRuntime", "ZeroGroup", "kept_in_selective", "run_io"]
