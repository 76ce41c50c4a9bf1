"""The cost model, behind one small interface (Unity section 5, "Cost estimation").

:class:`CostModel` (machine + training settings) answers three questions:

* ``op_time(op, attrs, in_shapes, out_shapes)`` -- forward and backward time of one task (one
  device's piece of work): a roofline ``max(FLOPs / (peak * efficiency), bytes / memory bandwidth)``
  plus a per-operator launch overhead (per operator class and direction when calibrated).  Backward = ``backward_factor`` (default 2) x forward, for
  FLOPs and bytes alike (the input and the weight gradient each cost about one forward).
* collectives and transfers (:mod:`search.collectives`), per link level;
* ``update_time(bytes)`` -- the optimizer step over a device's weight bytes (memory bound).

:class:`GraphCost` binds a cost model to one PCG and prices *leaves* for the machine-mapping DP: the
cost of one node given its machine view and the views of its producers.  A leaf's cost is the node's
own forward+backward compute plus the forward+backward communication on its incoming edges (the
backward of a transfer moves the gradient back over the same links, the backward of a Replicate is a
Reduce and vice versa, so each activation edge costs twice its forward transfer) plus, for the
weight placement it represents, gradient synchronization and the optimizer update.  The iteration
time of a mapping is the sum of its leaves' costs along the series-parallel structure (see
:mod:`search.mapping`).

Node roles (:meth:`unity_pcg.pcg.PCG.roles`) and what each costs:

* sources (Input, Weight): no view, no cost;
* *placement* nodes: parallel operators reached from a source through parallel operators only.
  Partitioning / replicating an Input says how the data loader feeds shards: free.  For a Weight it
  says where the weight lives: free in the forward pass; each ``Replicate(d)`` in a weight's chain
  implies a ring all-reduce of the gradient over every group of ``d`` copies in the backward pass,
  and the optimizer updates every piece on its device;
* compute nodes: compute + incoming edges;
* other parallel nodes: their incoming edge only (Partition: slices, local when the device already
  holds the piece; Combine: gather; Replicate: broadcast; Reduce: reduce; Pipeline / Batch priced as
  Partition / Combine);
* *fused pairs* (:meth:`GraphCost.fused`): ``Reduce(k)`` whose only consumer is ``Partition(dim, k)``
  is one reduce-scatter, ``Combine(dim, k)`` whose only consumer is ``Replicate(k)`` one all-gather
  (what the executor runs as one DTensor redistribution; Megatron-LM's sequence parallelism).  The
  first node of a pair is priced nothing and its view is moot; the second reads the first's input
  directly (:meth:`GraphCost.priced_inputs`): per group of k devices that hold the k partial sums
  (shards) and receive the k slices (copies), one ring reduce-scatter (all-gather), (k-1) N elements
  (N the full piece); a piece the group does not hold is first sent to it.

Communication volume (``comm_elements``): tensor elements sent by all devices in one iteration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg.machine import MODES, MachineSpec, MachineView, Resource, enumerate_views, interpolate_table
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape

from . import collectives as C

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}   # extra fp32 copies per weight
INF = math.inf
NON_DIFFERENTIABLE = ops.NON_DIFFERENTIABLE      # from the registry: OpSpec.nondiff_inputs (running statistics)
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}

# Operator classes (DESIGN "Cost model"): the unit of per-class efficiency, launch overhead and measured
# kernel tables.  Compute-bound classes run at the math mode's peak (DeviceSpec.peak); the others are
# memory bound and see the bytes of their tensors' dtypes.  A class a machine file does not describe
# (no efficiency / overhead key) falls back along CLASS_FALLBACK, so calibrations written before a class
# existed price it as before (bmm and embedding as matmul, softmax as norm, reduce as default).
COMPUTE_CLASSES = frozenset({"matmul", "bmm", "conv", "conv1x1", "conv_grouped"})
OP_CLASSES = ("matmul", "bmm", "conv", "conv1x1", "conv_grouped", "embedding", "elementwise", "batchnorm", "norm",
              "softmax", "reduce", "pool", "optimizer", "default")
CLASS_FALLBACK = {"bmm": "matmul", "embedding": "matmul", "conv1x1": "conv", "conv_grouped": "conv",
                  "batchnorm": "norm", "softmax": "norm", "reduce": "default", "optimizer": "default"}
PRECISIONS = MODES                      # "fp32", "tf32", "bf16"
# classes priced from another class's measured table when the machine has none of their own (calibrations
# made before the class existed); the other fallbacks (bmm, embedding, ...) go to the roofline instead
TABLE_FALLBACK = {"conv1x1": "conv", "conv_grouped": "conv", "batchnorm": "norm"}


def op_class(op: str, in_shapes: Sequence[ParallelTensorShape] | None = None) -> str:
    """Operator class of ``op`` (one of :data:`OP_CLASSES`): for per-class efficiency, launch overhead
    and measured tables.  Stated by the operator's registry entry (``OpSpec.cost_class``), on the input
    shapes where the kernel depends on them: a convolution whose kernel is 1x1 is ``"conv1x1"`` (CPU
    libraries run pointwise convolutions through a much cheaper path than spatial ones), one with
    groups ``"conv_grouped"``, a MatMul of two operands of rank >= 3 ``"bmm"``."""
    return ops.cost_class(op, in_shapes)


def class_chain(kind: str) -> list[str]:
    """``kind`` then its fallbacks (:data:`CLASS_FALLBACK`)."""
    out = [kind]
    while out[-1] in CLASS_FALLBACK:
        out.append(CLASS_FALLBACK[out[-1]])
    return out


def table_keys(kind: str) -> tuple[str, str]:
    """Names of the measured tables of class ``kind`` (without the ``/<mode>`` suffix): forward and
    backward.  The embedding's forward (a gather) and backward (a scatter-add into the table's
    gradient) are different kernels measured separately (``embedding_fwd``, ``embedding_bwd``); other
    classes have one table whose backward is ``backward_factor`` kernels of the same work, unless a
    ``<class>_bwd`` table exists."""
    if kind == "embedding":
        return "embedding_fwd", "embedding_bwd"
    return kind, f"{kind}_bwd"


def kernel_work(op: str, in_shapes: Sequence[ParallelTensorShape], out_shapes: Sequence[ParallelTensorShape],
                kind: str | None = None, flops: float | None = None,
                attrs: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """(forward, backward) work of one task, the x axis of the measured tables: FLOPs of the forward
    (:func:`unity_pcg.ops.task_flops`) for compute classes (backward: the same, per kernel); bytes for
    memory-bound ones -- the embedding's forward reads the indices and writes the gathered rows
    (indices + output piece bytes), its backward reads the output gradient and writes the table's
    gradient (output + table piece bytes); other classes the forward's bytes moved
    (:func:`unity_pcg.ops.bytes_moved`, per task).  Byte counts use the tensors' dtypes, so shapes
    carrying bfloat16 give the bf16 work.  Calibration calls this to label what it measured.  ``flops``
    (else computed from ``attrs``: a convolution needs its stride and groups) saves recomputing them."""
    kind = kind or op_class(op, in_shapes)
    if kind in COMPUTE_CLASSES:
        f = float(ops.task_flops(op, attrs or {}, in_shapes, out_shapes)) if flops is None else float(flops)
        return f, f
    if kind == "embedding" and len(in_shapes) >= 2 and out_shapes:
        o = out_shapes[0].piece_nbytes
        return float(o + in_shapes[0].piece_nbytes), float(o + in_shapes[1].piece_nbytes)
    b = float(ops.bytes_moved(op, in_shapes, out_shapes, per_task=True))
    return b, b


# torch.autocast (bf16 mixed precision): each operator's registry entry says what autocast does with it
# (OpSpec.autocast): its lower-precision list (bf16: matmul, linear, bmm, einsum, convolutions, prelu), its
# fp32 list (softmax, norms, exp, log, pow, reductions by sum, ...; "fp32_direct": takes a dtype argument and
# reads a bf16 input directly, no separate cast kernel), or type promotion (the widest float dtype of its
# inputs; a 0-d operand does not widen a tensor).
SYNC_MODELS = ("executor", "ddp")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


def autocast_dtype(op: str, declared: str, in_dtypes: Sequence[str], in_ranks: Sequence[int]) -> str:
    """Dtype of an operator's output under bf16 autocast, from its inputs' dtypes (``OpSpec.autocast``)."""
    mode = ops.autocast(op)
    if declared not in FLOAT_DTYPES or declared == "float64" or mode == "declared":
        return declared
    if mode == "low":
        return "bfloat16"
    if mode in ("fp32", "fp32_direct"):
        return "float32"
    fl = [(d, r) for d, r in zip(in_dtypes, in_ranks) if d in FLOAT_DTYPES]
    if mode == "follow_first" and fl:
        return fl[0][0]
    ranked = [d for d, r in fl if r > 0] or [d for d, _ in fl]
    if not ranked:
        return declared
    return max(ranked, key=lambda d: _ITEMSIZE[d])



class CostModel:
    """Costs of tasks, collectives and the optimizer step on one machine."""

    def __init__(self, machine: MachineSpec, optimizer: str = "adam", backward_factor: float = 2.0,
                 grad_bucket_bytes: float = 25 * 2**20, precision: str = "fp32", sync_model: str | None = None,
                 first_bucket_bytes: float = 2**20, overlap_min_bytes: float = 8 * 2**20):
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZER_STATES)})")
        check_precision(precision)
        # who synchronizes the gradients (DESIGN "Cost model", gradient synchronization): "executor"
        # (default: our executor's bucketed all-reduce, gradients as bucket views; a bucket costs the
        # all-reduce fit's latency + bytes / bandwidth) or "ddp" (torch DDP, whose own costs the
        # calibration measures: ``sync`` iteration / per_tensor / buffers / per_compute); the
        # machine's ``meta["sync_model"]`` where the argument is not given
        sync_model = sync_model or dict(machine.meta).get("sync_model") or "executor"
        if sync_model not in SYNC_MODELS:
            raise ValueError(f"unknown sync model {sync_model!r} (known: {', '.join(SYNC_MODELS)})")
        self.sync_model = sync_model
        # the gradient bytes a step synchronizes, where a caller prices fragments of a graph apart (Alpa's
        # ILP): the executor's bucket latencies are spread over the whole step's bytes, not a fragment's
        self.sync_total_bytes: float | None = None
        # the executor's buckets (unity_pcg/executor/train.py): a bucket closes once it holds
        # grad_bucket_bytes; where it overlaps the all-reduces with the backward (GPUs; CPU processes
        # from overlap_min_bytes of gradients on) the first bucket closes at first_bucket_bytes, as DDP's
        self.first_bucket_bytes = float(first_bucket_bytes)
        self.overlap_min_bytes = float(overlap_min_bytes)
        self.machine = machine
        self.optimizer = optimizer
        # math mode of the training step (DESIGN "Cost model"): fp32; tf32 (fp32 storage, matmul and
        # convolution at the TF32 peak); bf16 (torch.autocast: bf16 matmul / convolution and
        # activations, fp32 master weights, gradients of weights and optimizer states).  GraphCost
        # decides every tensor's dtype from it (GraphCost.dtype)
        self.precision = precision
        self.backward_factor = float(backward_factor)
        self.grad_bucket_bytes = float(grad_bucket_bytes)
        self._op_cache: dict = {}
        # GraphCost edge prices shared by every graph priced on this model (GraphCost._edge_key): Alpa's
        # ILP prices the same resharding on thousands of fragment graphs
        self._edge_memo: dict = {}
        self._sync_memo: dict = {}      # the same for gradient all-reduces (GraphCost._grad_sync)
        self._task_memo: dict = {}      # the same for task times (GraphCost._task_key)
        self._views_memo: dict = {}     # (task grid, resource) -> its views (GraphCost.views; read-only lists)
        # data-parallel framework costs measured by calibration (local machines; 0 elsewhere):
        # per iteration (bucket all-reduce latency, waiting for the slowest replica), per gradient
        # tensor (hooks, bucket copies), and per iteration for synchronizing replicated buffers
        # (torch DDP's micro-benchmarks: they price DDP only, sync_model "ddp"; the executor pays none
        # of them: no per-gradient hooks or copies, no buffer broadcast, its bucket latency is priced
        # from the all-reduce fit, grad_allreduce_time)
        sync = (dict(machine.meta).get("sync") or {}) if sync_model == "ddp" else {}
        self.sync_iteration = max(float(sync.get("iteration", 0.0)), 0.0)
        self.sync_per_tensor = max(float(sync.get("per_tensor", 0.0)), 0.0)
        self.sync_buffers = max(float(sync.get("buffers", 0.0)), 0.0)
        # waiting for the other replicas grows with the compute between synchronizations
        self.sync_per_compute = max(float(sync.get("per_compute", 0.0)), 0.0) if machine.num_devices > 1 else 0.0
        if sync_model == "executor" and machine.num_devices > 1 and machine.shared_cores > 0:
            # the executor's processes on shared cores wait for each other at its collectives: calibrate's
            # measured slowdown of synchronized against free computing processes (``sync.executor_slowdown``)
            # (also where the processes outnumber the cores and collectives are priced by their CPU work: the
            # slowdown left once the loop's all-reduce is priced so, ``sync.executor_slowdown_cpu``, is ~1 --
            # the collectives' CPU explains that loop -- and the executor's compute beyond the kernel tables,
            # which this factor carries, would go unpriced)
            slow = (dict(machine.meta).get("sync") or {}).get("executor_slowdown")
            self.sync_per_compute = max(float(slow) - 1.0, 0.0) if slow is not None else 0.0
        # devices that share cores (local processes): see busy_factor, side_by_side and
        # GraphCost.backward_scale; machines without shared cores (GPU presets) are priced as before
        self.shared = machine.shared_cores > 0

    def busy_factor(self, busy: int) -> float:
        """Compute time of a task while ``busy`` devices compute at once, relative to its priced
        time (which assumes every device busy): ``MachineSpec.concurrency_factor`` on machines whose
        devices share cores (a node placed on fewer devices leaves the others' cores to it), else 1."""
        return self.machine.concurrency_factor(busy) if self.shared else 1.0

    def side_by_side(self, a: float, b: float) -> float:
        """Cost of two branches run side by side on disjoint devices: the slower one; on a machine
        whose devices share cores the branches compete for the same cores, so their costs add (each
        already priced with the cores its own devices leave free, :meth:`busy_factor`)."""
        return a + b if self.shared else max(a, b)

    # --- compute -------------------------------------------------------------------------------
    def op_time(self, op: str, attrs: Mapping[str, Any], in_shapes: Sequence[ParallelTensorShape],
                out_shapes: Sequence[ParallelTensorShape], bwd_scale: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds of one task.  ``bwd_scale``: the part of the backward that
        runs (1: every operand needs a gradient; 0: none does, no backward at all).  The shapes' dtypes
        are the ones the kernel reads and writes (GraphCost passes its precision's dtypes); compute
        classes run in the cost model's math mode, memory-bound ones in their output's dtype."""
        key = (op, tuple(sorted(dict(attrs).items())), tuple(in_shapes), tuple(out_shapes), bwd_scale)
        r = self._op_cache.get(key)
        if r is None:
            f = ops.task_flops(op, attrs, in_shapes, out_shapes)
            b = ops.bytes_moved(op, in_shapes, out_shapes, per_task=True)
            kind = op_class(op, in_shapes)
            work = None
            if self.machine.device.kernel_tables:
                work = kernel_work(op, in_shapes, out_shapes, kind, f)
            mode = self.mode_of(kind, out_shapes[0].dtype if out_shapes else "float32")
            r = self.roofline(op, f, b, kind, bwd_scale, mode=mode, work=work)
            if work is not None and op == "Linear" and len(in_shapes) >= 3 and bwd_scale > 0 and out_shapes:
                # the measured matmul tables are bias-free GEMMs (cuBLAS adds a forward bias in its epilogue);
                # the bias gradient is one more kernel: a column sum of the output gradient
                tb = self.table_time("reduce", "fp32", float(out_shapes[0].piece_nbytes))
                if tb is not None:
                    r = (r[0], r[1] + tb * (1.0 + self.sync_per_compute))
            self._op_cache[key] = r
        return r

    def mode_of(self, kind: str, out_dtype: str = "float32") -> str:
        """Math mode a kernel of class ``kind`` runs in: the precision for compute classes; for
        memory-bound ones the dtype it streams (bf16 for 2-byte floats, else fp32)."""
        if kind in COMPUTE_CLASSES:
            return self.precision
        return "bf16" if out_dtype in ("bfloat16", "float16") else "fp32"

    def _key(self, table: Mapping, kind: str, mode: str) -> str | None:
        """The first key of ``table`` along the class chain, mode-specific keys first."""
        chain = class_chain(kind)
        for k in [f"{c}/{mode}" for c in chain] + chain:
            if k in table:
                return k
        return None

    def efficiency(self, kind: str, mode: str = "fp32") -> float:
        dev = self.machine.device
        k = self._key(dev.efficiency, kind, mode)
        return dev.eff(k) if k is not None else dev.eff("default")

    def overhead(self, kind: str, backward: bool = False) -> float:
        """Launch overhead of a kernel of class ``kind`` (per class and direction where calibrated)."""
        dev = self.machine.device
        o = dict(dev.overheads)
        for c in class_chain(kind):
            key = f"{c}:bwd" if backward else c
            if key in o:
                return float(o[key])
        return float(dev.op_overhead)

    def table_time(self, name: str, mode: str, work: float) -> float | None:
        """Seconds of a kernel from the machine's measured table ``name/mode`` (memory-bound classes
        fall back to the fp32 table: their work is bytes either way), or None without a table."""
        dev = self.machine.device
        t = dev.table(f"{name}/{mode}")
        if t is None and mode != "fp32" and name.split("_")[0] not in COMPUTE_CLASSES:
            t = dev.table(f"{name}/fp32")
        base = name[:-4] if name.endswith("_bwd") else name
        if t is None and base in TABLE_FALLBACK:        # the table of the class it falls back to
            return self.table_time(TABLE_FALLBACK[base] + name[len(base):], mode, work)
        if t is None:
            return None
        return interpolate_table(t, work) / self.machine.share

    def roofline(self, op: str, flops: float, nbytes: float, kind: str | None = None,
                 bwd_scale: float = 1.0, mode: str | None = None,
                 work: tuple[float, float] | None = None) -> tuple[float, float]:
        """(forward, backward) seconds: a measured table of the class and mode where the machine has
        one (``work``: :func:`kernel_work`), else ``max(FLOPs / (peak(mode) * efficiency), bytes /
        bandwidth)`` plus the class's launch overhead.  Compute classes use the math mode's peak."""
        m = self.machine
        kind = kind or op_class(op)
        mode = mode or self.mode_of(kind)
        k = 1.0 + self.sync_per_compute
        if work is not None and m.device.kernel_tables:
            fk, bk = table_keys(kind)
            tf = self.table_time(fk, mode, work[0])
            if tf is not None:
                tb = self.table_time(bk, mode, work[1])
                bwd = bwd_scale * (tb if tb is not None else self.backward_factor * tf)
                return tf * k, bwd * k
        peak = m.flops_for(mode) if kind in COMPUTE_CLASSES else m.flops
        t = max(flops / (peak * self.efficiency(kind, mode)), nbytes / m.mem_bandwidth)
        # launch / dispatch overhead per class (calibrated), on the (shared) cores too
        fwd = t + self.overhead(kind) / m.share
        bwd = self.backward_factor * t + self.overhead(kind, backward=True) / m.share
        if bwd_scale != 1.0:
            bwd = bwd_scale * self.backward_factor * t + (self.overhead(kind, backward=True) / m.share
                                                          if bwd_scale > 0 else 0.0)
        return fwd * k, bwd * k

    def cast_time(self, nbytes: float) -> float:
        """One dtype conversion kernel moving ``nbytes`` (read + write): autocast's casts."""
        if nbytes <= 0:
            return 0.0
        t = self.table_time("elementwise", "fp32", nbytes)
        if t is not None:
            return t * (1.0 + self.sync_per_compute)
        m = self.machine
        return (nbytes / m.mem_bandwidth + self.overhead("elementwise") / m.share) * (1.0 + self.sync_per_compute)

    # --- gradient synchronization --------------------------------------------------------------
    def bucket_count(self, total_bytes: float) -> int:
        """Buckets the executor all-reduces for ``total_bytes`` of gradients: the first closes at
        ``first_bucket_bytes`` where it overlaps the all-reduces with the backward (GPUs, or from
        ``overlap_min_bytes`` on), the others at ``grad_bucket_bytes``."""
        if total_bytes <= 0:
            return 0
        cap = self.grad_bucket_bytes
        if cap <= 0:
            return 1
        first = cap
        if self.machine.shared_cores <= 0 or total_bytes >= self.overlap_min_bytes:
            first = min(cap, self.first_bucket_bytes)
        if total_bytes <= first:
            return 1
        return 1 + math.ceil((total_bytes - first) / cap)

    def sync_message_bytes(self, nbytes: float, total_bytes: float | None = None) -> float:
        """The message a weight's gradient of ``nbytes`` travels in (what a runtime picks the all-reduce
        algorithm for, :func:`collectives.allreduce_split`): the executor's average bucket of ``total_bytes``,
        a DDP bucket (or the weight, when larger), or the weight itself without buckets."""
        if self.grad_bucket_bytes <= 0:
            return nbytes
        if self.sync_model == "executor" and total_bytes:
            return total_bytes / self.bucket_count(total_bytes)
        return max(nbytes, self.grad_bucket_bytes)

    def grad_allreduce_time(self, devs, nbytes: float, total_bytes: float | None = None) -> float:
        """All-reduce of one weight's gradient.  Frameworks fuse gradients into buckets
        (``grad_bucket_bytes``, 25 MiB as in torch DDP; 0 = one all-reduce per weight): a weight then
        pays the bandwidth term for its bytes and its share of the buckets' latency terms.  With
        ``total_bytes`` (all gradients synchronized per step) under the executor's sync model, the
        :meth:`bucket_count` buckets' latencies are spread over the weights by bytes (the step pays
        every bucket's latency once, a 0.4 MiB model one whole bucket); else a weight pays
        ``nbytes / grad_bucket_bytes`` of one latency (torch DDP, whose per-iteration cost
        ``sync.iteration`` is calibrated apart)."""
        full = C.allreduce_time(self.machine, devs, nbytes)
        if self.grad_bucket_bytes <= 0 or full == 0.0:
            return full
        if self.sync_model == "executor" and total_bytes:
            # a calibrated local machine's measured all-reduce table: every bucket's measured time, spread
            # over the weights by bytes
            nb = self.bucket_count(total_bytes)
            tb = C.measured_time(self.machine, "all_reduce", len(set(devs)), total_bytes / nb)
            if tb is not None:
                return tb * nb * nbytes / total_bytes
        lat, bw_only = C.allreduce_split(self.machine, devs, nbytes, self.sync_message_bytes(nbytes, total_bytes))
        if self.sync_model == "executor" and total_bytes:
            return bw_only + lat * self.bucket_count(total_bytes) * nbytes / total_bytes
        return bw_only + lat * min(1.0, nbytes / self.grad_bucket_bytes)

    # --- optimizer -----------------------------------------------------------------------------
    def update_time(self, weight_bytes: float) -> float:
        """Memory-bound update: read weight, grad, states; write weight, states (fp32 master weights
        in every precision).  A measured ``optimizer/fp32`` table takes the bytes moved as work."""
        if weight_bytes <= 0:
            return 0.0
        k = OPTIMIZER_STATES[self.optimizer]
        moved = (3 + 2 * k) * weight_bytes
        # this optimizer's own table where measured (a CPU's SGD and Adam differ more than in bytes), else both's
        t = self.table_time(f"optimizer_{self.optimizer}", "fp32", moved)
        if t is None:
            t = self.table_time("optimizer", "fp32", moved)
        if t is not None:
            return t
        dev = self.machine.device
        over = dev.update_overhead if dev.update_overhead > 0 else dev.op_overhead
        return moved / self.machine.mem_bandwidth + over / self.machine.share

    def weight_memory_factor(self) -> int:
        """Bytes per weight byte held on a device: weight + gradient + optimizer states."""
        return 2 + OPTIMIZER_STATES[self.optimizer]


def check_precision(precision: Any) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError (one line)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    return precision


def _bw_part(machine: MachineSpec, devs, nbytes: float) -> float:
    """The bytes term of the all-reduce of ``nbytes`` over ``devs`` (:func:`collectives.allreduce_split`)."""
    return C.allreduce_split(machine, devs, nbytes)[1]


# --- per-graph pricing ------------------------------------------------------------------------------

@dataclass
class LeafCost:
    time: float = 0.0
    compute: float = 0.0
    comm: float = 0.0        # activation / weight transfers (forward + backward)
    sync: float = 0.0        # gradient all-reduce of replicated weights
    update: float = 0.0      # optimizer step
    comm_elements: int = 0
    reason: str = ""         # why the cost is infinite

    def add(self, o: "LeafCost") -> "LeafCost":
        return LeafCost(self.time + o.time, self.compute + o.compute, self.comm + o.comm, self.sync + o.sync,
                        self.update + o.update, self.comm_elements + o.comm_elements, self.reason or o.reason)


_TASK_PIECE: dict = {}


def _task_piece_map(axes, tm, grid) -> tuple[int, ...]:
    """Flat piece index (canonical grid order) held by each task (row-major over ``axes``);
    shared by every node with the same piece map and tensor grid."""
    key = (axes, tm, grid)
    hit = _TASK_PIECE.get(key)
    if hit is not None:
        return hit
    deg = dict(axes)
    names = [a for a, _ in axes]
    total = 1
    for _, d in axes:
        total *= d
    out = []
    for t in range(total):
        idx = {}
        r = t
        for a in reversed(names):
            idx[a] = r % deg[a]
            r //= deg[a]
        gi = [_mixed(idx, tm.copy, deg), _mixed(idx, tm.sum, deg)] + [_mixed(idx, d, deg) for d in tm.dims]
        flat = 0
        for x, gsz in zip(gi, grid):
            flat = flat * gsz + x
        out.append(flat)
    res = tuple(out)
    if len(_TASK_PIECE) > 100_000:
        _TASK_PIECE.clear()
    _TASK_PIECE[key] = res
    return res


def _mixed(idx: dict, axes: Sequence[str], deg: dict) -> int:
    v = 0
    for a in axes:
        v = v * deg[a] + idx[a]
    return v


class _NearIndex:
    """The lowest-numbered device of a set of holders per group, per node and overall: which holder a device
    outside the set reads from (:meth:`GraphCost._nearest`) in O(1) instead of a pass over the set."""
    __slots__ = ("holders", "size", "low", "by_group", "by_node")

    def __init__(self, holders: set, machine):
        self.holders, self.size = holders, len(holders)
        self.low = min(holders)
        self.by_group: dict = {}
        self.by_node: dict = {}
        for h in holders:
            g, n = machine.group_of(h), machine.node_of(h)
            if h < self.by_group.get(g, h + 1):
                self.by_group[g] = h
            if h < self.by_node.get(n, h + 1):
                self.by_node[n] = h

    def get(self, dev: int, machine) -> int:
        h = self.by_group.get(machine.group_of(dev))
        if h is not None:
            return h
        h = self.by_node.get(machine.node_of(dev))
        return self.low if h is None else h


_VEC_MIN_DEVICES = 64      # views this large are priced by numpy (_edge_vec, _fused_vec, _grad_sync), smaller by loops


class _Holdings:
    """Who holds each piece key (a piece up to its copy index) of a placed tensor, as arrays, asked about
    many (key, device) pairs at once: whether the device holds the key, and which holder it reads from
    (:meth:`GraphCost._nearest`'s rule: itself, else the lowest holder in its group, else in its node, else
    the lowest overall)."""
    _SHIFT = 32                         # a (key, device / group / node) pair as one int64: key << 32 | id

    def __init__(self, place: Sequence[int], rest: int, machine: MachineSpec):
        self.machine = machine
        devs = np.asarray(place, dtype=np.int64)
        keys = np.arange(len(devs), dtype=np.int64) % rest
        self.low = np.full(rest, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(self.low, keys, devs)
        self.have = np.sort((keys << self._SHIFT) | devs)      # repeats do no harm to the lookups
        self.by_group = self._lowest(keys, C.device_groups(machine, devs), devs)
        self.by_node = self._lowest(keys, devs // machine.devices_per_node, devs)

    def _lowest(self, keys, ids, devs):
        """(sorted pair codes, the lowest holder of each): the lowest device per (key, id) pair."""
        codes = (keys << self._SHIFT) | ids
        order = np.lexsort((devs, codes))
        uc, first = np.unique(codes[order], return_index=True)
        return uc, devs[order][first]

    @staticmethod
    def _find(table, codes):
        uc, val = table
        if len(uc) == 0:
            return np.zeros(len(codes), dtype=bool), val[:0]
        i = np.minimum(np.searchsorted(uc, codes), len(uc) - 1)
        return uc[i] == codes, val[i]

    def holds(self, keys, devs):
        codes = (keys << self._SHIFT) | devs
        i = np.minimum(np.searchsorted(self.have, codes), len(self.have) - 1)
        return self.have[i] == codes

    def nearest(self, keys, devs):
        res = self.low[keys].copy()
        ok, v = self._find(self.by_node, (keys << self._SHIFT) | (devs // self.machine.devices_per_node))
        res[ok] = v[ok]
        ok, v = self._find(self.by_group, (keys << self._SHIFT) | C.device_groups(self.machine, devs))
        res[ok] = v[ok]
        mine = self.holds(keys, devs)
        res[mine] = devs[mine]
        return res


def _group_shapes(machine: MachineSpec, gid, devs):
    """The shape of every group whose members are ``devs[i]`` of group ``gid[i]`` (repeats allowed):
    (group ids sorted, distinct devices, link level spanned as 0 local / 1 group / 2 node / 3 network,
    the group's distinct devices sorted, as one array, where each group starts in it, and per group the
    nodes and fast groups it touches and its most devices in one node and in one group, as columns of one
    array: what :func:`collectives.levels_from_counts` reads)."""
    sh = _Holdings._SHIFT
    pairs = np.unique((gid << sh) | devs)
    g = pairs >> sh
    d = pairs & ((1 << sh) - 1)
    ug, start, p = np.unique(g, return_index=True, return_counts=True)
    cols = []
    for part in (d // machine.devices_per_node, C.device_groups(machine, d)):
        keys, cnt = np.unique((g << sh) | part, return_counts=True)
        at = np.searchsorted(ug, keys >> sh)
        most = np.zeros(len(ug), dtype=np.int64)
        np.maximum.at(most, at, cnt)
        cols += [np.bincount(at, minlength=len(ug)), most]
    n_nodes, n_groups = cols[0], cols[2]
    level = np.where(p <= 1, 0, np.where(n_nodes > 1, 3, np.where(n_groups > 1, 2, 1)))
    return ug, p, level, d, start, np.stack([n_nodes, n_groups, cols[1], cols[3]], axis=1)


_LEVEL_NAMES = ("local", "group", "node", "network")


def _group_times(machine: MachineSpec, gid, devs, fn, nbytes) -> tuple[float, np.ndarray]:
    """The slowest of the collectives ``fn`` (a ``collectives.*_time_of``) of ``nbytes`` over the groups
    whose members are ``devs[i]`` of group ``gid[i]`` (repeats allowed), each priced by its shape (distinct
    devices, link level spanned, levels crossed: :func:`collectives.group_shape`), and the distinct device
    count of every group (sorted by group id)."""
    _, p, level, _, _, counts = _group_shapes(machine, gid, devs)
    t = 0.0
    for pp, lv, kn, kg, mn, mg in set(zip(p.tolist(), level.tolist(), *counts.T.tolist())):
        name = _LEVEL_NAMES[lv]
        t = max(t, fn(machine, pp, name, nbytes, C.levels_from_counts(machine, pp, name, kn, kg, mn, mg)))
    return t, p


class GraphCost:
    """Prices the leaves of one PCG on one machine (see module docstring).

    Everything it computes is a function of the graph (immutable) and the model, so ``GraphCost(g, model)``
    returns the instance already built for ``g`` on ``model`` while it is one of the model's
    ``GRAPHS_KEPT`` most recent graphs (its memos warm): a layout mapped, then evaluated, then priced with
    techniques and as a stage analyzes its graph once."""
    #: graphs whose GraphCost a CostModel keeps (most recent first)
    GRAPHS_KEPT = 4

    def __new__(cls, g: PCG | None = None, model: CostModel | None = None):
        if cls is GraphCost and g is not None and model is not None:
            for gc in model.__dict__.get("_graph_costs", ()):
                if gc.g is g and gc.precision == model.precision:
                    return gc
        return super().__new__(cls)

    def __init__(self, g: PCG, model: CostModel):
        if self.__dict__.get("g") is g and self.__dict__.get("model") is model:
            return                                       # the model's kept instance (see __new__)
        self._build(g, model)
        kept = model.__dict__.setdefault("_graph_costs", [])
        kept.insert(0, self)
        del kept[self.GRAPHS_KEPT:]

    def _build(self, g: PCG, model: CostModel) -> None:
        self.g = g
        self.model = model
        self.machine = model.machine
        self.role = g.roles()                            # node -> role (PCG.roles: the one classifier)
        self.grid: dict[int, tuple[int, ...]] = {}       # view grid of every non-source node
        self._task_piece: dict[int, list] = {}           # compute: per tensor, task -> piece flat index
        self._pm: dict[int, Any] = {}
        self._edge_cache: dict = {}
        self._near_cache: dict = {}             # id(holder set) -> _NearIndex (see _nearest)
        self._leaf_cache: dict = {}
        self._place_cache: dict = {}            # (compute node, view, output) -> placement
        self._update_owner: dict[int, set] = {}          # compute node -> trained Weight inputs it updates
        self._direct_weights: dict[int, set] = {}        # compute node -> Weight inputs it holds
        self._fused: dict[int, tuple[str, int]] = {}     # second node of a fused pair -> (kind, first node)
        self._fused_first: set[int] = set()
        self._find_fused()
        seen_w: set = set()
        for n in g.nodes():
            if self.role[n.id] in ("input", "weight"):
                continue
            if n.kind == "parallel":
                self.grid[n.id] = g.shapes(n.id)[0].grid
            else:
                inf = ops.infer(n.op, n.a, g.input_shapes(n.id))
                pm = inf.piece_map
                self._pm[n.id] = pm
                self.grid[n.id] = tuple(d for _, d in pm.axes)
                owned = set()
                for r in n.inputs:
                    if self.role[r[0]] == "weight" and r[0] not in seen_w:
                        seen_w.add(r[0])
                        owned.add(r)
                self._direct_weights[n.id] = owned
        # which weights are trained: float weights that reach some differentiable operand (not the
        # running statistics of a BatchNorm, not integer indices); others get no gradient, no
        # synchronization, no optimizer state
        origin = {nid: g.origin(nid) for nid, r in self.role.items() if r in ("weight", "weight-placement")}
        self._trainable_src: dict[int, bool] = {}
        for n in g.nodes():
            if self.role[n.id] != "compute":
                continue
            for pos, r in enumerate(n.inputs):
                w = origin.get(r[0])
                if w is None:
                    continue
                diff = (n.op, pos) not in NON_DIFFERENTIABLE and g.shape(r).dtype in FLOAT_DTYPES \
                    and g.node(w).a.get("trainable", True)      # a constant of the model is not trained
                self._trainable_src[w] = self._trainable_src.get(w, False) or diff
        self._origin = origin
        # which tensors carry a gradient in the backward pass: those computed from a trained weight
        # (torch skips the gradient of an operand that needs none, e.g. the first Linear's input)
        self._needs_grad: dict[int, bool] = {}
        for n in g.nodes():
            role = self.role[n.id]
            if role in ("input", "input-placement"):
                self._needs_grad[n.id] = False
            elif role in ("weight", "weight-placement"):
                self._needs_grad[n.id] = self._trainable_src.get(origin[n.id], False)
            elif role == "parallel":
                self._needs_grad[n.id] = self._needs_grad[n.inputs[0][0]]
            else:
                self._needs_grad[n.id] = any(self._operand_needs_grad(n, pos) for pos in range(len(n.inputs)))
        self._update_owner = {nid: {r for r in ws if self.trainable(r[0])} for nid, ws in self._direct_weights.items()}
        # placement chains whose consumers leave the chain own the weight update
        self._chain_end: set[int] = set()
        for nid, role in self.role.items():
            if role == "weight-placement":
                users = [c for c, _ in self._consumers_of(nid)]
                if any(self.role[u] != "weight-placement" for u in users) or not users:
                    self._chain_end.add(nid)
        # replicated weights: the bytes whose gradients are synchronized (trained) and the bytes of
        # buffers kept in sync (untrained float weights); the per-iteration costs of either are
        # spread over those weights in proportion to their bytes, so the leaves sum to them once
        self._sync_bytes = 0.0
        self._buffer_bytes = 0.0
        for nid in self._chain_end:
            sh = g.shapes(nid)[0]
            if sh.copy_degree <= 1:
                continue
            if self.trainable(nid):
                self._sync_bytes += sh.piece_nbytes
            elif sh.dtype in FLOAT_DTYPES and g.node(self._origin.get(nid, nid)).a.get("trainable", True):
                self._buffer_bytes += sh.piece_nbytes       # (a constant of the model is never synchronized)
        # the dtype of every tensor under the model's precision (the one place that decides it):
        # the declared dtypes in fp32 and tf32; torch.autocast's in bf16 (autocast_dtype)
        self.precision = model.precision
        self._dtype: dict = {}
        self._kshapes: dict = {}
        self._task_times: dict = {}                      # compute node -> task_time (a function of the graph)
        if self.precision == "bf16":
            for nid in g.topo_order():
                n = g.node(nid)
                outs = g.shapes(nid)
                if n.kind == "source":
                    continue
                ins = [self.dtype(r) for r in n.inputs]
                if n.kind == "parallel":
                    self._dtype[(nid, 0)] = ins[0]
                    continue
                ranks = [g.shape(r).rank for r in n.inputs]
                for k, sh in enumerate(outs):
                    d = autocast_dtype(n.op, sh.dtype, ins, ranks)
                    if d != sh.dtype:
                        self._dtype[(nid, k)] = d

    # --- fused pairs ------------------------------------------------------------------------------
    #: (first operator, second operator) -> the collective the pair is (see the module docstring)
    FUSED_PAIRS = {("Reduce", "Partition"): "reduce-scatter", ("Combine", "Replicate"): "all-gather"}

    def _find_fused(self) -> None:
        g = self.g
        outs = {tuple(r) for r in g.outputs}
        for n in g.nodes():
            if self.role.get(n.id) != "parallel" or (n.id, 0) in outs:
                continue
            uses = g.consumers((n.id, 0))
            if len(uses) != 1:
                continue
            m = g.node(uses[0][0])
            kind = self.FUSED_PAIRS.get((n.op, m.op))
            if kind is None or self.role.get(m.id) != "parallel" or m.a["degree"] != n.a["degree"]:
                continue
            if self.role.get(n.inputs[0][0]) in ("input", "weight"):
                continue
            self._fused[m.id] = (kind, n.id)
            self._fused_first.add(n.id)

    def fused(self, nid: int) -> str | None:
        """The collective node ``nid`` performs with the node before it (``"reduce-scatter"``,
        ``"all-gather"``), None when it is not the second node of a fused pair."""
        f = self._fused.get(nid)
        return f[0] if f else None

    def fused_first(self, nid: int) -> bool:
        """Whether ``nid`` is the first node of a fused pair (priced nothing; its view is moot)."""
        return nid in self._fused_first

    def read_ref(self, nid: int, pos: int):
        """The tensor whose placement input ``pos`` of ``nid`` is priced from: the input itself, or for the
        second node of a fused pair the first node's input."""
        f = self._fused.get(nid)
        if f is not None:
            return tuple(self.g.node(f[1]).inputs[0])
        return tuple(self.g.node(nid).inputs[pos])

    def _fused_edge(self, nid: int, prod_view: MachineView, view: MachineView) -> LeafCost:
        """Forward + backward cost of the fused pair ending at ``nid`` (its first node's input placed by
        ``prod_view``): per group of k devices, one ring reduce-scatter / all-gather (its backward is the
        other one, the same cost); the pieces a group lacks are first sent to its members that hold none."""
        kind, first = self._fused[nid]
        g = self.g
        m = self.machine
        ref = tuple(g.node(first).inputs[0])
        xs = g.shape(ref)
        place = self.placement(ref[0], prod_view, ref[1])
        isz = self.itemsize(ref)
        fa = g.node(first).a
        k = fa["degree"]
        out = g.shapes(nid)[0]
        igrid = xs.grid
        if kind == "reduce-scatter":
            d = 2 + g.node(nid).a["dim"] % out.rank
            full = g.shapes(first)[0].piece_numel      # the reduced piece: what the group scatters
        else:
            d = 2 + fa["dim"] % xs.rank
            full = out.piece_numel                     # the gathered piece
        part = xs.piece_numel                          # one partial sum (reduce-scatter) / one shard

        # the piece key of an input grid index (copy, sum, dims...): sum of index x stride over all but the copy
        stride = [1] * len(igrid)
        for i in range(len(igrid) - 2, 0, -1):
            stride[i] = stride[i + 1] * igrid[i + 1]

        fast = self._fused_vec(kind, k, d, xs, out, stride, place, view, part * isz, full * isz, part, full)
        if fast is not None:
            t, elements = fast
            return LeafCost(time=2 * t, comm=2 * t, comm_elements=2 * elements)
        hold = self._holders(xs, place)
        self._near_cache = {}           # the holder sets of this edge (see _nearest)
        groups: dict = {}
        for flat, dev in enumerate(view.devices()):
            gi, r = [], flat
            for gsz in reversed(out.grid):
                gi.append(r % gsz)
                r //= gsz
            gi.reverse()
            if kind == "reduce-scatter":      # output slice gi[d] % k of the sum over partials gi[1]*k + j
                key = tuple(gi[:d]) + (gi[d] // k,) + tuple(gi[d + 1:])
                src = [0, gi[1] * k] + list(gi[2:])
                src[d] = gi[d] // k
                base = sum(x * st for x, st in zip(src[1:], stride[1:]))
                srcs = [base + j * stride[1] for j in range(k)]
            else:                             # copy gi[0] % k of the gathered shards gi[d]*k + j
                key = (gi[0] // k,) + tuple(gi[1:])
                src = [0] + list(gi[1:])
                src[d] = gi[d] * k
                base = sum(x * st for x, st in zip(src[1:], stride[1:]))
                srcs = [base + j * stride[d] for j in range(k)]
            grp = groups.setdefault(key, [srcs, []])
            grp[1].append(dev)
        moves: list = []
        elements = 0
        t = 0.0
        for srcs, devs in groups.values():
            have = [next((j for j, s in enumerate(srcs) if dv in hold[s]), None) for dv in devs]
            held = {j for j in have if j is not None}
            free = [dv for dv, j in zip(devs, have) if j is None]
            for j, s in enumerate(srcs):
                if j in held:
                    continue
                dst = free.pop(0) if free else devs[0]
                moves.append((self._nearest(hold[s], dst), dst, part * isz))
                elements += part
            if len(devs) > 1:
                coll = C.reduce_scatter_time if kind == "reduce-scatter" else C.allgather_time
                t = max(t, coll(m, devs, full * isz))
                elements += (len(set(devs)) - 1) * full
        t += C.transfer_time(m, moves)
        return LeafCost(time=2 * t, comm=2 * t, comm_elements=2 * elements)

    def _fused_vec(self, kind: str, k: int, d: int, xs: ParallelTensorShape, out: ParallelTensorShape, stride,
                   place, view: MachineView, part_b: int, full_b: int, part: int, full: int):
        """:meth:`_fused_edge`'s (seconds, elements) of one direction over all devices at once (numpy): the
        same groups, the same pieces sent to the same members, collectives priced by group shape.  None on
        views of few devices and where the groups differ in size (the loop takes those)."""
        devs = np.asarray(view.devices(), dtype=np.int64)
        n = len(devs)
        if n < _VEC_MIN_DEVICES or n != out.piece_count or len(out.grid) != len(xs.grid):
            return None
        m = self.machine
        H = _Holdings(place, xs.piece_count // xs.copy_degree, m)
        gi = np.stack(np.unravel_index(np.arange(n), out.grid)).astype(np.int64)
        st = np.asarray(stride, dtype=np.int64)
        src = gi.copy()
        src[0] = 0
        keyv = gi.copy()
        if kind == "reduce-scatter":
            keyv[d] = gi[d] // k
            src[1] = gi[1] * k
            src[d] = gi[d] // k
            step = int(st[1])
        else:
            keyv[0] = gi[0] // k
            src[d] = gi[d] * k
            step = int(st[d])
        base = (src[1:] * st[1:, None]).sum(axis=0)
        code = np.ravel_multi_index(tuple(keyv), out.grid)
        order = np.argsort(code, kind="stable")                     # by group, members in device order
        _, counts = np.unique(code, return_counts=True)
        c = int(counts[0])
        if (counts != c).any():
            return None
        G = len(counts)
        M = devs[order].reshape(G, c)
        S = base[order].reshape(G, c)[:, :1] + step * np.arange(k, dtype=np.int64)[None, :]   # (G, k) pieces
        holds = H.holds(np.broadcast_to(S[:, None, :], (G, c, k)).ravel(),
                        np.broadcast_to(M[:, :, None], (G, c, k)).ravel()).reshape(G, c, k)
        has = holds.any(axis=2)
        first = holds.argmax(axis=2)                                # the first piece a member holds
        held = np.zeros((G, k), dtype=bool)
        gg, ii = np.nonzero(has)
        held[gg, first[gg, ii]] = True
        free = ~has
        nfree = free.sum(axis=1)
        fidx = np.argsort(~free, axis=1, kind="stable")            # the free members first, in order
        need = ~held
        rank = np.cumsum(need, axis=1) - 1
        gj, jj = np.nonzero(need)
        r = rank[gj, jj]
        pick = np.where(r < nfree[gj], fidx[gj, np.minimum(r, c - 1)], 0)
        dst = M[gj, pick]
        elements = part * len(dst)
        t = 0.0
        if c > 1:
            coll = C.reduce_scatter_time_of if kind == "reduce-scatter" else C.allgather_time_of
            t, p = _group_times(m, np.repeat(np.arange(G, dtype=np.int64), c), M.ravel(), coll, full_b)
            elements += int(((p - 1) * full).sum())
        t += C.transfer_time_uniform(m, H.nearest(S[gj, jj], dst), dst, part_b)
        return t, elements

    # --- dtypes under the precision -------------------------------------------------------------
    def dtype(self, ref) -> str:
        """The dtype tensor ``ref`` has in the training step under the model's precision."""
        if ref.__class__ is not tuple:
            ref = tuple(ref)
        return self._dtype.get(ref) or self.g.shape(ref).dtype

    def itemsize(self, ref) -> int:
        return _ITEMSIZE[self.dtype(ref)]

    @staticmethod
    def kernel_itemsize(dtype: str) -> int:
        return _ITEMSIZE[dtype]

    def kernel_dtype(self, nid: int, pos: int) -> str:
        """The dtype in which compute node ``nid`` reads input ``pos``: autocast casts the float inputs
        of its bf16 operators to bf16 and those of its fp32 operators to fp32 (a cast kernel and a copy,
        unless the operator reads the input directly: ``OpSpec.autocast == "fp32_direct"``)."""
        n = self.g.node(nid)
        d = self.dtype(n.inputs[pos])
        if self.precision != "bf16" or d not in FLOAT_DTYPES or d == "float64":
            return d
        mode = ops.autocast(n.op)
        if mode == "low":
            return "bfloat16"
        if mode == "fp32":
            return "float32"
        return d

    def casts(self, nid: int) -> list[tuple[int, str, str]]:
        """Inputs that autocast converts before compute node ``nid`` runs: (position, from, to)."""
        if self.precision != "bf16" or self.role[nid] != "compute":
            return []
        n = self.g.node(nid)
        out = []
        for pos, r in enumerate(n.inputs):
            a, b = self.dtype(r), self.kernel_dtype(nid, pos)
            if a != b:
                out.append((pos, a, b))
        return out

    def kernel_shapes(self, nid: int) -> tuple[tuple, tuple]:
        """Input and output shapes of compute node ``nid`` with the dtypes its kernel reads and writes."""
        hit = self._kshapes.get(nid)
        if hit is not None:
            return hit
        ins, outs = self.g.input_shapes(nid), self.g.shapes(nid)
        if self.precision == "bf16":
            ins = tuple(sh if sh.dtype == self.kernel_dtype(nid, pos) else replace(sh, dtype=self.kernel_dtype(nid, pos))
                        for pos, sh in enumerate(ins))
            outs = tuple(sh if self.dtype((nid, k)) == sh.dtype else replace(sh, dtype=self.dtype((nid, k)))
                         for k, sh in enumerate(outs))
        r = self._kshapes[nid] = (tuple(ins), tuple(outs))
        return r

    def task_time(self, nid: int) -> tuple[float, float]:
        """(forward, backward) seconds of one task of compute node ``nid`` in the model's precision:
        the kernel (CostModel.op_time on :meth:`kernel_shapes`) plus autocast's casts of its inputs
        (forward; and the gradient's cast back in the backward when that input needs a gradient).
        Memoized per node, and per :meth:`_task_key` on the model (what it reads, graph-independently:
        a model's identical blocks and every graph of a layout grid share one computation)."""
        hit = self._task_times.get(nid)
        if hit is not None:
            return hit
        key = self._task_key(nid)
        memo = self.model._task_memo
        hit = memo.get(key)
        if hit is None:
            if len(memo) > 200_000:
                memo.clear()
            hit = memo[key] = self._task_time_of(nid)
        self._task_times[nid] = hit
        return hit

    def _task_key(self, nid: int) -> tuple:
        """Everything :meth:`_task_time_of` reads: the operator, attributes, input and output shapes and
        their dtypes under the precision, which operands need a gradient (backward scale, casts back)."""
        node = self.g.node(nid)
        outs = self.g.shapes(nid)
        return (node.op, node.attrs, self.g.input_shapes(nid), outs, tuple(self.dtype(r) for r in node.inputs),
                tuple(self.dtype((nid, k)) for k in range(len(outs))), self.role[nid],
                tuple(self._operand_needs_grad(node, pos) for pos in range(len(node.inputs))))

    def _task_time_of(self, nid: int) -> tuple[float, float]:
        node = self.g.node(nid)
        ins, outs = self.kernel_shapes(nid)
        bs = self.backward_scale(nid)
        f, b = self.model.op_time(node.op, node.a, ins, outs, bs)
        for pos, a, c in self.casts(nid):
            sh = self.g.shape(node.inputs[pos])
            t = self.model.cast_time(sh.piece_numel * (_ITEMSIZE[a] + _ITEMSIZE[c]))
            f += t
            if bs > 0 and self._operand_needs_grad(node, pos):
                b += t
        return f, b

    def _operand_needs_grad(self, n, pos: int) -> bool:
        r = n.inputs[pos]
        return ((n.op, pos) not in NON_DIFFERENTIABLE and self.g.shape(r).dtype in FLOAT_DTYPES
                and self._needs_grad.get(r[0], False))

    def backward_scale(self, nid: int) -> float:
        """The part of a compute node's backward that runs, on machines whose devices share cores
        (1 elsewhere, so GPU presets keep the uniform ``backward_factor``): 0 when no operand needs
        a gradient (no backward); for a matmul or convolution the data operand's gradient is half of
        the backward and the weights' the other half (Linear(x) with an input x: 0.5); other
        operators run their whole backward when any operand needs a gradient."""
        if not self.model.shared or self.role[nid] != "compute":
            return 1.0
        n = self.g.node(nid)
        need = [self._operand_needs_grad(n, pos) for pos in range(len(n.inputs))]
        if not any(need):
            return 0.0
        if op_class(n.op) in COMPUTE_CLASSES and len(need) >= 2:
            return 0.5 * need[0] + 0.5 * any(need[1:])
        return 1.0

    def trainable(self, nid: int) -> bool:
        """Whether the weight behind ``nid`` (a Weight or a node of its placement chain) is trained."""
        return self._trainable_src.get(self._origin.get(nid, nid), False)

    def _consumers_of(self, nid: int) -> list[tuple[int, int]]:
        out = []
        for k in range(len(self.g.shapes(nid))):
            out.extend(self.g.consumers((nid, k)))
        return out

    # --- views and piece placement --------------------------------------------------------------
    def nodes(self) -> list[int]:
        """Nodes that take a machine view (everything but sources), topological order."""
        return [i for i in self.g.topo_order() if self.role[i] not in ("input", "weight")]

    def views(self, nid: int, resource: Resource | None = None) -> list[MachineView]:
        key = (self.grid[nid], resource)                # all enumerate_views reads (the machine is the model's)
        memo = self.model._views_memo
        v = memo.get(key)
        if v is None:
            if len(memo) > 10_000:
                memo.clear()
            v = memo[key] = enumerate_views(self.grid[nid], self.machine, resource)
        return v

    def _task_to_piece(self, nid: int, which: str, k: int) -> tuple[int, ...]:
        """For a compute node: the flat piece index (canonical grid order) of tensor ``which``
        ('in' / 'out') number ``k`` that each task (row-major over the task axes) holds."""
        key = (nid, which, k)
        hit = self._task_piece.get(key)
        if hit is not None:
            return hit
        pm = self._pm[nid]
        tm = (pm.inputs if which == "in" else pm.outputs)[k]
        shape = (self.g.input_shapes(nid)[k] if which == "in" else self.g.shapes(nid)[k])
        res = _task_piece_map(pm.axes, tm, shape.grid)
        self._task_piece[key] = res
        return res

    def placement(self, nid: int, view: MachineView, k: int = 0) -> tuple[int, ...]:
        """Device of every piece (canonical flat order) of output ``k`` of ``nid`` under ``view``."""
        devs = view.devices()
        if self.role[nid] == "compute":
            key = (nid, view, k)
            hit = self._place_cache.get(key)
            if hit is not None:
                return hit
            t2p = self._task_to_piece(nid, "out", k)
            out = [0] * len(devs)
            for t, p in enumerate(t2p):
                out[p] = devs[t]
            if len(self._place_cache) > 50_000:
                self._place_cache.clear()
            res = self._place_cache[key] = tuple(out)
            return res
        return devs

    # --- edges -----------------------------------------------------------------------------------
    def _holders(self, shape: ParallelTensorShape, place: Sequence[int]) -> list[set]:
        """Devices holding each piece key (a piece up to its copy index)."""
        rest = shape.piece_count // shape.copy_degree
        hold = [set() for _ in range(rest)]
        for flat, d in enumerate(place):
            hold[flat % rest].add(d)
        return hold

    def edge_cost(self, nid: int, pos: int, prod_view: MachineView | None, view: MachineView) -> LeafCost:
        """Forward + backward cost of input ``pos`` of ``nid`` (its producer placed by ``prod_view``)."""
        if nid in self._fused_first:
            return LeafCost()
        ref = self.g.node(nid).inputs[pos]
        prole = self.role[ref[0]]
        if prole in ("input", "weight"):
            return LeafCost()
        key = (nid, pos, prod_view, view)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        mkey = self._edge_key(nid, pos, ref, prole, prod_view, view)
        memo = self.model._edge_memo
        hit = memo.get(mkey)
        if hit is not None:
            self._edge_cache[key] = hit
            return hit
        if len(memo) > 200_000:
            memo.clear()
        if nid in self._fused:
            res = self._edge_cache[key] = memo[mkey] = self._fused_edge(nid, prod_view, view)
            return res
        shape = self.g.shape(ref)
        place = self.placement(ref[0], prod_view, ref[1])
        isz = self.itemsize(ref)           # the precision's dtype (bf16 activations move half the bytes)
        res = self._edge_vec(nid, pos, shape, place, view, isz)
        t, elements = res if res is not None else self._edge_loop(nid, pos, shape, place, view, isz)
        factor = 1 if prole == "input-placement" else 2   # no gradient flows back to the data
        res = LeafCost(time=factor * t, comm=factor * t, comm_elements=factor * elements)
        self._edge_cache[key] = memo[mkey] = res
        return res

    def _edge_vec(self, nid: int, pos: int, shape: ParallelTensorShape, place: Sequence[int], view: MachineView,
                  isz: int) -> tuple[float, int] | None:
        """:meth:`_edge_loop` over all devices at once (numpy): the same messages, collectives and floats
        (message times counted per endpoint, collectives priced per group shape).  None where the view
        and the tensor's grid disagree in size, and on views of few devices, where the loop is quicker."""
        m = self.machine
        if len(view.devices()) < _VEC_MIN_DEVICES:
            return None
        rest = shape.piece_count // shape.copy_degree
        H = _Holdings(place, rest, m)
        pnum = shape.piece_numel
        pbytes = pnum * isz
        devs = np.asarray(view.devices(), dtype=np.int64)
        if self.role[nid] == "compute":
            t2p = np.asarray(self._task_to_piece(nid, "in", pos), dtype=np.int64)
            if len(t2p) != len(devs):
                return None
            keys = t2p % rest
            miss = ~H.holds(keys, devs)
            dst = devs[miss]
            t = C.transfer_time_uniform(m, H.nearest(keys[miss], dst), dst, pbytes)
            return t, pnum * int(miss.sum())
        node = self.g.node(nid)
        out = self.g.shapes(nid)[0]
        ogrid, igrid = out.grid, shape.grid
        n = len(devs)
        if n != out.piece_count or len(ogrid) != len(igrid):
            return None
        a, op = node.a, node.op
        kstride = np.zeros(len(igrid), dtype=np.int64)     # piece key = grid index . stride (not the copy)
        acc = 1
        for i in range(len(igrid) - 1, 0, -1):
            kstride[i] = acc
            acc *= igrid[i]
        gi = np.stack(np.unravel_index(np.arange(n), ogrid)).astype(np.int64)   # (axes, devices)
        opnum = out.piece_numel

        def keys_with(axis, values):   # piece keys of gi with ``axis`` replaced by ``values``
            return (gi * kstride[:, None]).sum(axis=0) + (values - gi[axis]) * kstride[axis]

        if op in ("Partition", "Pipeline"):
            dim = 2 + a["dim"] % shape.rank
            keys = keys_with(dim, gi[dim] // a["degree"])
            miss = ~H.holds(keys, devs)
            dst = devs[miss]
            t = C.transfer_time_uniform(m, H.nearest(keys[miss], dst), dst, opnum * isz)
            return t, opnum * int(miss.sum())
        if op in ("Combine", "Batch"):
            dim = 2 + a["dim"] % shape.rank
            k = a["degree"]
            keys = np.concatenate([keys_with(dim, gi[dim] * k + j) for j in range(k)])
            dd = np.tile(devs, k)
            miss = ~H.holds(keys, dd)
            dst = dd[miss]
            t = C.transfer_time_uniform(m, H.nearest(keys[miss], dst), dst, pbytes)
            return t, pnum * int(miss.sum())
        if op == "Replicate":
            keys = keys_with(0, np.zeros(n, dtype=np.int64))
            miss = ~H.holds(keys, devs)
            if not miss.any():
                return 0.0, 0
            km, dm = keys[miss], devs[miss]
            uk, first = np.unique(km, return_index=True)
            src = H.nearest(uk, dm[first])               # each group's sender: nearest its first receiver
            t, _ = _group_times(m, np.concatenate([km, uk]), np.concatenate([dm, src]), C.broadcast_time_of,
                                pbytes)
            return t, pnum * int(miss.sum())
        if op in ("Reduce", "AllReduce"):
            k = a["degree"]
            keys = np.concatenate([keys_with(1, gi[1] * k + j) for j in range(k)])
            dd = np.tile(devs, k)
            near = H.nearest(keys, dd)
            flat = np.tile(np.arange(n, dtype=np.int64), k)
            if op == "Reduce":
                miss = near != dd
                if not miss.any():
                    return 0.0, 0
                gid = np.unique(flat[miss])
                t, _ = _group_times(m, np.concatenate([flat[miss], gid]), np.concatenate([near[miss], devs[gid]]),
                                    C.reduce_time_of, opnum * isz)
                return t, pnum * int(miss.sum())
            per = n // ogrid[0]                          # the group: the output index but its copy
            gid = flat % per
            t, p = _group_times(m, np.concatenate([gid, np.arange(n, dtype=np.int64) % per]),
                                np.concatenate([near, devs]), C.allreduce_time_of, opnum * isz)
            return t, int(sum(C.allreduce_elements(int(q), opnum) for q in p))
        return None

    def _edge_loop(self, nid: int, pos: int, shape: ParallelTensorShape, place: Sequence[int], view: MachineView,
                   isz: int) -> tuple[float, int]:
        """One direction's (seconds, elements) of input ``pos`` of ``nid`` whose pieces lie at ``place``:
        device by device (the reference :meth:`_edge_vec` equals; it takes the cases that one declines)."""
        m = self.machine
        hold = self._holders(shape, place)
        self._near_cache = {}           # the holder sets of this edge (see _nearest)
        pnum = shape.piece_numel
        pbytes = pnum * isz
        rest = len(hold)
        node = self.g.node(nid)
        moves: list = []
        elements = 0
        t = 0.0
        near = self._nearest

        if self.role[nid] == "compute":
            t2p = self._task_to_piece(nid, "in", pos)
            for dev, p in zip(view.devices(), t2p):
                h = hold[p % rest]
                if dev not in h:
                    moves.append((near(h, dev), dev, pbytes))
                    elements += pnum
            t = C.transfer_time(m, moves)
        else:
            out = self.g.shapes(nid)[0]
            odevs = view.devices()
            a = node.a
            op = node.op
            ogrid = out.grid
            igrid = shape.grid

            kstride = [0] * len(igrid)      # piece key = sum of grid index x stride over all but the copy
            acc = 1
            for i in range(len(igrid) - 1, 0, -1):
                kstride[i] = acc
                acc *= igrid[i]

            def key_of(gi):  # grid index (copy, sum, dims...) of the input -> piece key
                return sum(map(int.__mul__, gi, kstride))

            opnum = out.piece_numel

            groups: dict = {}
            for flat, dev in enumerate(odevs):
                gi, r = [], flat
                for gsz in reversed(ogrid):
                    gi.append(r % gsz)
                    r //= gsz
                gi.reverse()
                if op in ("Partition", "Pipeline"):
                    dim = 2 + a["dim"] % shape.rank
                    src = list(gi)
                    src[dim] //= a["degree"]
                    src[0] = 0
                    h = hold[key_of(src)]
                    if dev not in h:
                        moves.append((near(h, dev), dev, opnum * isz))
                        elements += opnum
                elif op in ("Combine", "Batch"):
                    dim = 2 + a["dim"] % shape.rank
                    for j in range(a["degree"]):
                        src = list(gi)
                        src[dim] = gi[dim] * a["degree"] + j
                        src[0] = 0
                        h = hold[key_of(src)]
                        if dev not in h:
                            moves.append((near(h, dev), dev, pbytes))
                            elements += pnum
                elif op == "Replicate":
                    src = list(gi)
                    src[0] = 0
                    k = key_of(src)
                    if dev not in hold[k]:
                        groups.setdefault(("b", k), [set(hold[k]), []])[1].append(dev)
                        elements += pnum
                elif op == "Reduce":
                    contrib = set()
                    local = False
                    for j in range(a["degree"]):
                        src = list(gi)
                        src[1] = gi[1] * a["degree"] + j
                        src[0] = 0
                        h = hold[key_of(src)]
                        if dev in h:
                            local = True
                        else:
                            contrib.add(near(h, dev))
                            elements += pnum
                    if contrib:
                        groups[("r", flat)] = [contrib, [dev], local]
                elif op == "AllReduce":   # Reduce(k) then Replicate(k) as one collective
                    k = a["degree"]
                    grp = groups.setdefault(("a", tuple(gi[1:])), [set(), []])
                    for j in range(k):
                        src = list(gi)
                        src[1] = gi[1] * k + j
                        src[0] = 0
                        grp[0].add(near(hold[key_of(src)], dev))
                    grp[1].append(dev)
                else:  # pragma: no cover - registry has exactly these parallel ops
                    raise AssertionError(op)
            t = C.transfer_time(m, moves)
            for (kind, _), grp in groups.items():
                if kind == "b":
                    srcs, dsts = grp[0], grp[1]
                    devs = [near(srcs, dsts[0])] + dsts
                    t = max(t, C.broadcast_time(m, devs, pbytes))
                elif kind == "a":
                    devs = sorted(grp[0] | set(grp[1]))
                    if len(devs) > 1:
                        t = max(t, C.allreduce_time(m, devs, opnum * isz))
                        elements += C.allreduce_elements(len(devs), opnum)
                else:
                    devs = list(grp[0]) + grp[1]
                    t = max(t, C.reduce_time(m, devs, opnum * isz))
        return t, elements

    def _edge_key(self, nid: int, pos: int, ref, prole: str, prod_view: MachineView, view: MachineView) -> tuple:
        """Everything :meth:`edge_cost` reads, graph-independently: equal keys on graphs priced by the same
        model give the same price (the consumer's operator, attributes and shapes; the producer's role and
        piece map, which with ``prod_view`` decide where the input's pieces are; the dtype sizes)."""
        g = self.g
        node = g.node(nid)
        role = self.role[nid]
        ppm = self._pm.get(ref[0]) if self.role[ref[0]] == "compute" else None
        pplace = (ppm.axes, ppm.outputs[ref[1]]) if ppm is not None else None
        if nid in self._fused:
            kind, first = self._fused[nid]
            fn = g.node(first)
            fref = tuple(fn.inputs[0])
            fppm = self._pm.get(fref[0]) if self.role[fref[0]] == "compute" else None
            return ("fused", kind, fn.attrs, node.attrs, g.shape(fref), g.shapes(first)[0], g.shapes(nid)[0],
                    self.itemsize(fref), self.role[fref[0]],
                    (fppm.axes, fppm.outputs[fref[1]]) if fppm is not None else None, prod_view, view)
        if role == "compute":
            pm = self._pm[nid]
            cons = (pm.axes, pm.inputs[pos], g.input_shapes(nid)[pos].grid)
        else:
            cons = (node.op, node.attrs, g.shapes(nid)[0])
        return (role, cons, g.shape(ref), self.itemsize(ref), prole, pplace, prod_view, view)

    def _nearest(self, holders: set, dev: int) -> int:
        """The holder ``dev`` reads from: itself, else the lowest-numbered holder in its group, else in its
        node, else anywhere (the nearest level first, then the lowest device)."""
        if dev in holders:
            return dev
        if len(holders) == 1:
            return next(iter(holders))
        return self._near_index(holders).get(dev, self.machine)

    def _near_index(self, holders: set) -> "_NearIndex":
        """The lowest holder per group, per node and overall of ``holders`` (kept while the same set is
        asked about again: an edge asks once per destination device; each edge starts a new cache)."""
        idx = self._near_cache.get(id(holders))
        if idx is None or idx.holders is not holders or idx.size != len(holders):
            if len(self._near_cache) > 4096:
                self._near_cache.clear()
            idx = self._near_cache[id(holders)] = _NearIndex(holders, self.machine)
        return idx

    # --- leaves ----------------------------------------------------------------------------------
    def own_cost(self, nid: int, view: MachineView) -> LeafCost:
        """The part of a leaf's cost that depends on its own view only: compute, sync, update."""
        key = (nid, view)
        hit = self._leaf_cache.get(key)
        if hit is not None:
            return hit
        node = self.g.node(nid)
        role = self.role[nid]
        c = LeafCost()
        if role == "weight-placement":
            if nid in self._chain_end and self.trainable(nid):  # where it lives: sync copies, update pieces
                c.sync, c.comm_elements = self._grad_sync(nid, view)
                c.update = self.model.update_time(self.g.shapes(nid)[0].piece_nbytes)
            elif nid in self._chain_end and self._buffer_bytes > 0:   # a replicated buffer
                sh = self.g.shapes(nid)[0]
                if sh.copy_degree > 1 and sh.dtype in FLOAT_DTYPES and \
                        self.g.node(self._origin.get(nid, nid)).a.get("trainable", True):
                    c.sync = self.model.sync_buffers * sh.piece_nbytes / self._buffer_bytes
        elif role == "compute":
            f, b = self.task_time(nid)
            # on shared cores a node on fewer devices runs faster (the idle devices' cores)
            c.compute = (f + b) * self.model.busy_factor(view.degree)
            c.update = sum(self.model.update_time(self.g.shape(r).piece_nbytes)
                           for r in self._update_owner.get(nid, ()))
            if node.op == "BatchNorm" and self.model.sync_model != "ddp":
                # SyncBatchNorm semantics (the executor's); torch DDP keeps per-device statistics
                c.comm += self._stat_sync(nid, view)
        c.time = c.compute + c.comm + c.sync + c.update
        self._leaf_cache[key] = c
        return c

    def _stat_sync(self, nid: int, view: MachineView) -> float:
        """Training BatchNorm over a partitioned batch or spatial dim (SyncBatchNorm): an all-gather of
        every task's 2*C+1 statistics (per-channel mean, squared deviations, count) over the tasks sharing
        its channels in the forward pass, an all-reduce of their gradients in the backward pass."""
        x = self.g.input_shapes(nid)[0]
        if x.shard_degree // x.degrees[1] <= 1:
            return 0.0
        pm = self._pm[nid]
        red = {a for j, axes in enumerate(pm.inputs[0].dims) if j != 1 for a in axes}
        devs = view.devices()
        strides, acc = {}, 1
        for a, d in reversed(pm.axes):
            strides[a] = acc
            acc *= d
        grp = [devs[t] for t in range(len(devs))
               if all((t // strides[a]) % d == 0 for a, d in pm.axes if a not in red)]
        nbytes = len(grp) * (2 * x.piece_shape[1] + 1) * x.itemsize
        return 2 * C.allreduce_time(self.machine, grp, nbytes)

    def compute_time(self, nid: int) -> float:
        """A lower bound of the forward + backward compute of a compute node over its views (0 for
        others): its time on the fewest busy devices (:meth:`CostModel.busy_factor`; the same on
        every view unless cores are shared)."""
        if self.role[nid] != "compute":
            return 0.0
        f, b = self.task_time(nid)
        return (f + b) * self.model.busy_factor(1)

    def leaf_cost(self, nid: int, view: MachineView, prod_views: Mapping[int, MachineView]) -> LeafCost:
        """Cost of node ``nid`` on ``view`` given the views of its producers (:meth:`producers`):
        :meth:`own_cost` plus :meth:`edge_cost` of every priced input.  Placement nodes pay nothing
        for their inputs (the data loader feeds any shard; a weight's chain only says where it lives)."""
        c = self.own_cost(nid, view)
        if self.role[nid] in ("input-placement", "weight-placement"):
            return c
        c = LeafCost(c.time, c.compute, c.comm, c.sync, c.update, c.comm_elements)
        for pos, p in self.priced_inputs(nid):
            pview = prod_views.get(p)
            if pview is None:
                raise KeyError(f"no view for producer {p} of node {nid}")
            e = self.edge_cost(nid, pos, pview, view)
            c.comm += e.comm
            c.time += e.comm
            c.comm_elements += e.comm_elements
        return c

    def leaf_facts(self, nid: int) -> tuple:
        """Everything :meth:`own_cost`, :meth:`edge_cost` (as the consumer) and :meth:`compute_time` read
        about non-source node ``nid`` apart from views and which nodes feed it, as a hashable tuple free of
        node ids: two nodes (of this graph or another priced by the same model) with equal facts, fed by
        producers with equal :meth:`producer_facts`, cost the same floats on the same views.  The mapping
        DP keys subproblems by them, so a model's identical blocks are solved once (search/mapping.py)."""
        g = self.g
        n = g.node(nid)
        role = self.role[nid]
        fused = self._fused.get(nid)
        if fused is not None:
            kind, first = fused
            fn = g.node(first)
            fref = tuple(fn.inputs[0])
            fppm = self._pm.get(fref[0]) if self.role[fref[0]] == "compute" else None
            fused = (kind, fn.op, fn.attrs, fref[1], g.shape(fref), g.shapes(first), self.itemsize(fref),
                     self.role[fref[0]], (fppm.axes, fppm.outputs[fref[1]]) if fppm is not None else None)
        pm = self._pm.get(nid)
        upd = tuple(g.shape(r).piece_nbytes for r in self._update_owner.get(nid, ()))   # own_cost's sum order
        return (role, n.op, n.attrs, g.input_shapes(nid), g.shapes(nid),
                tuple(self.dtype(r) for r in n.inputs), tuple(self.dtype((nid, k)) for k in range(len(g.shapes(nid)))),
                (pm.axes, pm.inputs, pm.outputs) if pm is not None else None, self.grid.get(nid),
                fused, nid in self._fused_first,
                tuple(self._operand_needs_grad(n, pos) for pos in range(len(n.inputs))), self._needs_grad.get(nid),
                nid in self._chain_end, self.trainable(nid),
                g.node(self._origin.get(nid, nid)).a.get("trainable", True), upd,
                tuple(pos for pos, _ in self.priced_inputs(nid)))

    def producer_facts(self, nid: int) -> tuple:
        """What :meth:`edge_cost` reads about a producer besides its view (its role, output shapes and
        dtypes, piece map): see :meth:`leaf_facts`."""
        g = self.g
        pm = self._pm.get(nid) if self.role[nid] == "compute" else None
        return (self.role[nid], g.shapes(nid), tuple(self.dtype((nid, k)) for k in range(len(g.shapes(nid)))),
                (pm.axes, pm.outputs) if pm is not None else None)

    def priced_inputs(self, nid: int) -> list[tuple[int, int]]:
        """(input position, producer) pairs whose edges are priced in the leaf of ``nid``: none for
        placements and the first node of a fused pair; the second node of a fused pair reads the first
        one's producer (:meth:`read_ref`)."""
        if self.role[nid] in ("input-placement", "weight-placement") or nid in self._fused_first:
            return []
        if nid in self._fused:
            return [(0, self.read_ref(nid, 0)[0])]
        return [(pos, r[0]) for pos, r in enumerate(self.g.node(nid).inputs)
                if self.role[r[0]] not in ("input", "weight")]

    def producers(self, nid: int) -> list[int]:
        """Producers whose views the leaf cost of ``nid`` depends on."""
        return sorted({p for _, p in self.priced_inputs(nid)})

    def _grad_sync(self, nid: int, view: MachineView) -> tuple[float, int]:
        """Ring all-reduce of the gradient over the devices holding copies of the same weight piece
        (the copy groups of the chain end's shape); groups run concurrently."""
        out = self.g.shapes(nid)[0]
        if out.copy_degree == 1:
            return 0.0, 0
        mo = self.model
        key = (out, view, self._sync_bytes, mo.sync_total_bytes, mo.sync_per_tensor, mo.sync_iteration,
               mo.grad_bucket_bytes, mo.first_bucket_bytes, mo.overlap_min_bytes, mo.sync_model)   # all it reads
        memo = mo._sync_memo
        hit = memo.get(key)
        if hit is None:
            if len(memo) > 100_000:
                memo.clear()
            hit = memo[key] = self._grad_sync_of(out, view)
        return hit

    def _grad_sync_of(self, out: ParallelTensorShape, view: MachineView) -> tuple[float, int]:
        """:meth:`_grad_sync` of a chain end of shape ``out`` on ``view`` (not memoized)."""
        devs = view.devices()
        rest = out.piece_count // out.copy_degree
        total = self.model.sync_total_bytes or self._sync_bytes
        if len(devs) >= _VEC_MIN_DEVICES:     # price each shape of copy group once (the price reads only it)
            flat = np.arange(len(devs), dtype=np.int64)
            _, p, level, members, start, counts = _group_shapes(self.machine, flat % rest,
                                                                np.asarray(devs, dtype=np.int64))
            t = 0.0
            for i in np.unique(np.column_stack([p, level, counts]), axis=0, return_index=True)[1].tolist():
                rep = members[start[i]:start[i] + p[i]].tolist()
                t = max(t, self.model.grad_allreduce_time(rep, out.piece_nbytes, total))
            el = sum(C.allreduce_elements(int(q), out.piece_numel) for q in p.tolist())
            if t > 0 and self._sync_bytes > 0:
                t += self.model.sync_per_tensor + self.model.sync_iteration * out.piece_nbytes / self._sync_bytes
            return t, el
        groups: dict = {}
        for flat, dev in enumerate(devs):
            groups.setdefault(flat % rest, set()).add(dev)
        t = 0.0
        el = 0
        for g in groups.values():
            t = max(t, self.model.grad_allreduce_time(sorted(g), out.piece_nbytes,
                                                      self.model.sync_total_bytes or self._sync_bytes))
            el += C.allreduce_elements(len(g), out.piece_numel)
        if t > 0 and self._sync_bytes > 0:
            t += self.model.sync_per_tensor + self.model.sync_iteration * out.piece_nbytes / self._sync_bytes
        return t, el


__all__ = ["CostModel", "GraphCost", "LeafCost", "OPTIMIZER_STATES", "op_class", "INF", "PRECISIONS", "OP_CLASSES",
           "COMPUTE_CLASSES", "kernel_work", "table_keys", "check_precision", "autocast_dtype", "SYNC_MODELS"]
