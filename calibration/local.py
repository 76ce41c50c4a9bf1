"""Measure this computer and describe it as a ``local`` :class:`MachineSpec`.

Devices of the local machine are CPU processes that share the cores.  Everything is measured once
per *world size* ``w`` (number of processes training together), with ``w`` processes running the
same micro-benchmarks at the same time (``torch.multiprocessing`` + gloo over
``tcp://127.0.0.1``), each on ``max(1, cores // w)`` torch threads as a data-parallel launcher
would set them, so the numbers include what sharing the cores costs (oversubscription, SMT
siblings, other programs' load at that moment).  Per world size (medians over repeated samples
and over the ranks; every sample loops for at least a few scheduler time slices, so the time a
process waits for a core is counted):

* matmul and conv2d throughput (FLOP/s; the faster is the device's ``peak_flops``, each kind's
  efficiency is its throughput relative to it), memory bandwidth (a large tensor copy);
* the per-operator overhead of a training step: a chain of tiny Linear+ReLU layers, forward and
  backward, per operator run; and per operator class (conv 3x3, conv 1x1, matmul, elementwise,
  norm, pool) the forward and backward time of a chain of tiny module instances;
* the optimizer (Adam) step overhead per weight tensor (64 tiny tensors);
* ``solo_speedup`` (:func:`measure_solo`): how much faster one process computes while the others
  wait than while all compute (the cores idle processes leave to the busy one);
* DistributedDataParallel's own cost (:func:`measure_ddp`): per iteration, per gradient tensor,
  for buffer synchronization and per second of compute, from generic Linear chains with and
  without DDP;
* gloo all-reduce over a sweep of sizes (1 to 4M floats), fitted to the ring model
  ``2(p-1) alpha + 2(p-1)/p n / beta`` by least squares on relative error;
* per-class kernel tables (:func:`local_cases`: matmul, bmm, element-wise, LayerNorm, BatchNorm, softmax,
  sum, pooling, small convolutions, embedding, views (``default``), SGD and Adam steps, at the small sizes
  such steps run), forward and backward, timed as ``calibration.gpu`` builds them, in rounds spread
  over the calibration (one sample of ``KERNEL_WINDOW`` = 10 ms each per round, the median): ``device.kernel_tables`` per world,
  which the cost model prefers to peak x efficiency + overhead;
* gloo all-reduce, all-gather and broadcast tables per group size dividing the world (all groups at
  once) and tensor size, the slowest rank's median (:func:`measure_collective_tables`):
  ``worlds[w]["collectives"]``, which ``search.collectives`` prices from (a small collective among
  processes on shared cores costs what the waits for descheduled peers cost, not a ring's latencies);
* the executor slowdown (:func:`measure_sync_wait`): a few ms of kernels timed with a tiny all-reduce
  after each segment against the same kernels free: ``sync.executor_slowdown``, by which the cost model
  scales the compute of the executor's synchronized processes.

``meta["worlds"][str(w)]`` keeps each world's device, link and ``sync`` costs;
:meth:`MachineSpec.resized` picks the nearest world (and ``meta["allreduce_fits"]`` keeps the
fits as before).  Nothing here looks at a particular model.  Progress goes to stderr.
``quick=True`` uses smaller sizes, fewer repeats and world sizes 2 and 4.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time
import warnings
from dataclasses import asdict, replace
from typing import Callable

from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _median_time(fn: Callable[[], None], reps: int, warmup: int = 1, window: float = 0.0, count: int = 0) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples.  With ``window`` > 0 each sample is
    the mean over a loop of calls lasting at least ``window`` seconds, so that a sample covers
    several scheduler time slices: when processes outnumber the cores a short timing would catch a
    process while it holds a core and miss the time it waits for one.  ``count`` > 0 fixes the
    number of calls per sample instead (collectives: every rank must make the same calls)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        n = 0
        t = time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t
            if (count and n >= count) or (not count and el >= window):
                break
        ts.append(el / n)
    return statistics.median(ts)


def measure_compute(quick: bool = False, quiet: bool = False, threads: int = 1, window: float = 0.0) -> dict:
    """Compute micro-benchmarks on ``threads`` torch threads (see the module docstring)."""
    import torch
    torch.set_num_threads(threads)
    reps = 3 if quick else 7
    w = window
    out = {}
    n = 384 if quick else 768
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = _median_time(lambda: torch.mm(a, b), reps, window=w)
    out["matmul_flops"] = 2 * n ** 3 / t
    _say(f"matmul {n}^3: {out['matmul_flops'] / 1e9:.1f} GFLOP/s", quiet)
    x = torch.randn(8, 32, 32, 32)
    wt = torch.randn(32, 32, 3, 3)
    t = _median_time(lambda: torch.nn.functional.conv2d(x, wt, padding=1), reps, window=w)
    out["conv_flops"] = 2 * 8 * 32 * 32 * 32 * 32 * 9 / t
    _say(f"conv2d 3x3: {out['conv_flops'] / 1e9:.1f} GFLOP/s", quiet)
    m = (4 if quick else 16) * 2 ** 20
    src = torch.randn(m)
    dst = torch.empty(m)
    t = _median_time(lambda: dst.copy_(src), reps, window=w)
    out["mem_bandwidth"] = 2 * 4 * m / t
    _say(f"memory copy: {out['mem_bandwidth'] / 1e9:.1f} GB/s", quiet)
    # per-operator overhead of a training step: tiny layers, forward + backward
    layers = 20 if quick else 50
    mods = [torch.nn.Linear(4, 4) for _ in range(layers)]
    params = [p for mm in mods for p in mm.parameters()]
    xin = torch.randn(2, 4)

    def step():
        h = xin
        for mm in mods:
            h = torch.relu(mm(h))
        h.sum().backward()
        for p in params:
            p.grad = None
    t = _median_time(step, reps * 3, warmup=2, window=w)
    runs = 2 * (2 * layers)  # Linear and ReLU, forward and backward
    out["op_overhead"] = t / runs
    _say(f"per-operator overhead: {out['op_overhead'] * 1e6:.1f} us", quiet)
    # per-class launch overheads: tiny module instances (as models call them), forward and
    # forward+backward; a chain of ``k`` instances amortizes the loss's own two tiny operators
    nn = torch.nn
    k = 8
    xi = torch.randn(2, 4, 8, 8)
    xl = torch.randn(2, 4)
    kinds = {
        "conv": (lambda: nn.Conv2d(4, 4, 3, padding=1), xi),
        "conv1x1": (lambda: nn.Conv2d(4, 4, 1), xi),
        "matmul": (lambda: nn.Linear(4, 4), xl),
        "elementwise": (lambda: nn.ReLU(), xl),
        "norm": (lambda: nn.BatchNorm2d(4), xi),
        "pool": (lambda: nn.MaxPool2d(3, 1, 1), xi),
    }
    over = {}
    for kind, (make, xin0) in kinds.items():
        chain = nn.Sequential(*[make() for _ in range(k)])
        cps = list(chain.parameters())
        xg = xin0.clone().requires_grad_(True)

        def fwd_grad(chain=chain, xg=xg):
            chain(xg)

        def fb(chain=chain, xg=xg, cps=cps):
            chain(xg).sum().backward()
            xg.grad = None
            for p in cps:
                p.grad = None
        tf = _median_time(fwd_grad, reps * 3, warmup=2, window=w)
        tfb = _median_time(fb, reps * 3, warmup=2, window=w)
        t_sum = _median_time(lambda xg=xg: xg.sum(), reps * 3, warmup=2, window=w)
        over[kind] = tf / k
        over[f"{kind}:bwd"] = max(tfb - tf - 2 * t_sum, 0.0) / k
    out["overheads"] = over
    _say("launch overheads (us, fwd/bwd): " + ", ".join(
        f"{k} {over[k] * 1e6:.0f}/{over[k + ':bwd'] * 1e6:.0f}" for k in kinds), quiet)
    # optimizer step overhead per weight tensor (Adam on tiny tensors; bytes are negligible)
    ps = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(64)]
    for p in ps:
        p.grad = torch.randn(4, 4)
    opt = torch.optim.Adam(ps, lr=1e-4)
    t = _median_time(opt.step, reps * 3, warmup=2, window=w)
    out["update_overhead"] = t / len(ps)
    _say(f"optimizer step overhead: {out['update_overhead'] * 1e6:.1f} us per weight tensor", quiet)
    return out


KERNEL_WINDOW = 0.01     # seconds per kernel-table sample (as executor_bench's in-situ rounds)


def local_cases(quick: bool = False) -> list:
    """The kernels of the per-class tables of CPU processes (:func:`measure_kernels`): the sizes small models'
    steps run on one process (a piece of a 512-2048 wide layer at batch 8 to 128, attention of a few
    heads over 32 to 128 positions), from a few hundred FLOPs or bytes, where the per-kernel cost
    dominates, to tens of MB or hundreds of MFLOPs.  ``calibration.gpu.Case`` objects of its classes,
    plus ``default`` (a transpose, a view as the executor's reshapes, transposes and slices are)."""
    from .gpu import Case
    out: list = []

    def add(cls, label, *params):
        out.append(Case(cls, label, tuple(params)))
    mm = ([(8, 32, 32), (32, 128, 128), (64, 512, 512), (128, 1024, 1024)] if quick else
          [(8, 32, 32), (16, 64, 64), (32, 128, 128), (64, 256, 256), (64, 512, 512), (64, 512, 1024),
           (128, 1024, 1024)])
    for m, k, n in mm:
        add("matmul", f"{m}x{k}x{n}", m, k, n)
    bm = [(4, 16, 16, 16), (32, 32, 64, 32)] if quick else [(4, 16, 16, 16), (8, 32, 64, 32), (32, 32, 64, 32),
                                                             (32, 128, 64, 128)]
    for b, m, k, n in bm:
        add("bmm", f"{b}x{m}x{k}x{n}", b, m, k, n)
    counts = [2 ** 8, 2 ** 14, 2 ** 20] if quick else [2 ** 8, 2 ** 11, 2 ** 14, 2 ** 17, 2 ** 20]
    for n in counts:
        add("elementwise", f"relu{n}", "relu", n)
        add("elementwise", f"add{n}", "add", n)
        add("default", f"transpose{n}", n)
        cols = 256 if n >= 256 else n
        add("norm", f"layernorm{n}", max(n // cols, 1), cols)
        sc = 32 if n <= 2 ** 14 else 128
        add("softmax", f"softmax{n}", max(n // sc, 1), sc)
    if not quick:
        for n in (2 ** 10, 2 ** 16):
            add("reduce", f"sum{n}", max(n // 256, 1), min(n, 256))
        for ch, hw in ((8, 8), (32, 16)):
            add("batchnorm", f"n8c{ch}h{hw}", 8, ch, hw)
            add("pool", f"maxpool{ch}x{hw}", "max", 8, ch, hw)
        for b, c, h in ((2, 8, 8), (8, 32, 16)):
            add("conv", f"n{b}c{c}h{h}k3", b, c, h, c, 3, 1, 1)
            add("conv1x1", f"n{b}c{c}h{h}", b, c, h, c, 1, 1, 1)
    emb = [(1000, 64, 64), (30_000, 128, 1024)]
    for r, d, n in emb:
        add("embedding", f"r{r}d{d}n{n}", r, d, n)
    opt = [(8, 2 ** 6), (8, 2 ** 12), (4, 2 ** 18)] if quick else [(8, 2 ** 6), (8, 2 ** 10), (8, 2 ** 14),
                                                                  (4, 2 ** 18), (2, 2 ** 20)]
    for k, s in opt:
        add("optimizer_sgd", f"{k}x{s}", k, s)
        add("optimizer_adam", f"{k}x{s}", k, s)
    return out


def _build_kernel(c) -> dict | None:
    """``calibration.gpu.build_case`` of ``c`` on this CPU in fp32 (and the ``default`` class's transpose)."""
    from .gpu import _shape, build_case
    if c.cls != "default":
        return build_case(c, "cpu", "fp32")
    import torch

    from unity_pcg.search.cost import kernel_work
    n = c.params[0]
    cols = 64 if n >= 64 else n
    x = torch.randn(n // cols, cols).requires_grad_(True)
    f = (lambda: x.transpose(0, 1))       # a view, as the executor runs Reshape, Transpose and Slice
    y = f()
    g = torch.ones_like(y)
    work = kernel_work("Transpose", [_shape(x)], [_shape(y)], kind="default")

    def bwd():
        torch.autograd.grad(y, [x], g, retain_graph=True)
    return {"fwd": f, "bwd": bwd, "work": work, "names": ("default", "default_bwd"), "key_mode": "fp32",
            "graph": (y, [x], g)}


def prepare_kernels(quick: bool = False) -> list:
    """Build every :func:`local_cases` kernel once: ``[(case, built, backward callable, copies)]``; a short
    kernel's backward is one ``autograd.grad`` call over up to 16 independent copies
    (``calibration.gpu.joint_backward``), as a training step's backward pass shares the engine's start."""
    from .gpu import backward_copies, joint_backward
    out = []
    for c in local_cases(quick):
        b = _build_kernel(c)
        if b is None:
            continue
        per = b.get("per_call", 1)
        tf = _median_time(b["fwd"], 3, warmup=1) / per
        bwd, k = None, 1
        if b["bwd"] is not None:
            k = backward_copies(tf)
            if k > 1 and "graph" in b:
                bwd = joint_backward([b] + [_build_kernel(c) for _ in range(k - 1)])
            else:
                bwd, k = b["bwd"], 1
        out.append((c, b, bwd, k))
    return out


def measure_kernels(prepared: list, window: float = 0.0, samples: int = 1) -> dict:
    """One round over every prepared kernel, interleaved (each kernel's forward then backward, all kernels
    in turn, ``samples`` times): ``{"<class>:<label>": {"fwd": [s, ...], "bwd": [s, ...]}}`` (seconds per
    kernel; the optimizer's per tensor).  Rounds spread over a calibration share the host's load with
    the other benchmarks, and a kernel's number is the median over all its samples."""
    out: dict = {}
    for _ in range(max(1, samples)):
        for c, b, bwd, k in prepared:
            rec = out.setdefault(f"{c.cls}:{c.label}", {"fwd": [], "bwd": []})
            rec["fwd"].append(_median_time(b["fwd"], 1, warmup=1, window=window) / b.get("per_call", 1))
            if bwd is not None:
                rec["bwd"].append(_median_time(bwd, 1, warmup=1, window=window) / k)
    return out


def kernel_rows(prepared: list, samples: dict) -> list:
    """Rows as ``calibration.gpu.measure_cases`` gives them (``fit_rows`` makes the tables) from the
    measured ``{"<class>:<label>": {"fwd": s, "bwd": s or absent}}``."""
    rows = []
    for c, b, _, _ in prepared:
        rec = samples.get(f"{c.cls}:{c.label}")
        if not rec or not rec.get("fwd"):
            continue
        rows.append({"class": c.cls, "label": c.label, "mode": "fp32", "key_mode": b["key_mode"],
                     "names": list(b["names"]), "work": list(b["work"]), "fwd": rec["fwd"],
                     "bwd": rec.get("bwd") or None})
    return rows


def measure_sync_wait(reps: int = 5, ts: dict | None = None) -> dict:
    """What synchronizing costs the computing processes of a running group (every rank calls this at the
    same time): a segment of kernels (8 matmuls 64x256x256, a few ms: the work between two collectives of
    a step) timed in a loop ``free`` (each rank on its own), ``synced`` (a 1-element all-reduce after every
    segment, as a step's collectives make every rank wait for the slowest) and the all-reduce alone
    (``alone``).  On cores shared with other programs a rank that loses its core stalls the others at the
    next collective: ``synced - alone`` exceeds ``free``.  Seconds per iteration appended to ``ts`` (returned)."""
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    a, w = torch.randn(64, 256), torch.randn(256, 256)
    tiny = torch.zeros(1)

    def seg():
        for _ in range(8):
            torch.mm(a, w)
    ts = {} if ts is None else ts
    for k in ("free", "synced", "alone"):
        ts.setdefault(k, [])
    n = 8
    for _ in range(reps):
        for kind in ("free", "synced", "alone"):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(n):
                if kind != "alone":
                    seg()
                if kind != "free":
                    dist.all_reduce(tiny)
            ts[kind].append((time.perf_counter() - t) / n)
    return ts


def sync_slowdown(free: float, synced: float, alone: float) -> float:
    """Compute time of synchronized processes relative to free ones: ``(synced - alone) / free``, >= 1."""
    return max((synced - alone) / free, 1.0) if free > 0 else 1.0


def sync_slowdown_cpu(wait: dict, cpu_tables: dict, world: int, contention: float) -> float:
    """:func:`sync_slowdown` where processes outnumber the cores and a collective is priced by its CPU work
    at the contended throughput (``MachineSpec.collective_cpu_time``): ``(synced - price) / free``, >= 1,
    with ``price`` the 1-float all-reduce of :func:`measure_sync_wait` priced so (``cpu_tables``:
    :func:`collective_cpu_tables`), so that the cost model prices the synchronized loop as measured."""
    from unity_pcg.machine import interpolate_table
    tab = (cpu_tables.get("all_reduce") or {}).get(str(world))
    price = interpolate_table(tab, 4.0) * contention if tab else wait["alone"]
    return sync_slowdown(wait["free"], wait["synced"], price)


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "broadcast")


def prepare_collectives(world: int, rank: int, quick: bool = False) -> list:
    """The collectives of :func:`measure_collective_tables` in a running process group (every rank calls
    this at the same time: it creates the groups): ``[(kind, g, bytes, callable)]``, each called once."""
    import torch
    import torch.distributed as dist
    sizes = [2 ** k for k in ((6, 10, 14, 18) if quick else (6, 8, 10, 12, 14, 16, 18, 20))]
    gsizes = [g for g in range(2, world + 1) if world % g == 0]
    mine = {}
    for g in gsizes:
        for start in range(0, world, g):
            pg = None if g == world else dist.new_group(list(range(start, start + g)))
            if start <= rank < start + g:
                mine[g] = (pg, start)
    ops = []
    for g in gsizes:
        pg, root = mine[g]
        for n in sizes:
            full = torch.ones(n)
            piece = torch.ones(max(n // g, 1))
            parts = [torch.empty_like(piece) for _ in range(g)]
            ops.append(("all_reduce", g, 4 * n, lambda full=full, pg=pg: dist.all_reduce(full, group=pg)))
            ops.append(("all_gather", g, 4 * g * piece.numel(),
                        lambda parts=parts, piece=piece, pg=pg: dist.all_gather(parts, piece, group=pg)))
            ops.append(("broadcast", g, 4 * n, lambda full=full, pg=pg, root=root: dist.broadcast(full, root, group=pg)))
    for _, _, _, fn in ops:
        fn()
    return ops


def measure_collectives_round(ops: list, reps: int, ts: dict | None = None, cpu: dict | None = None) -> dict:
    """One sweep over :func:`prepare_collectives`' ops, ``reps`` calls each after a barrier over all ranks:
    the seconds of every call appended to ``ts[(kind, g, bytes)]`` (returned); with ``cpu``, the CPU
    seconds of this process (all its threads: gloo's too) during the call to ``cpu[(kind, g, bytes)]``."""
    import torch.distributed as dist
    ts = {} if ts is None else ts
    for kind, g, nb, fn in ops:
        for _ in range(reps):
            dist.barrier()
            c = time.process_time()
            t = time.perf_counter()
            fn()
            ts.setdefault((kind, g, nb), []).append(time.perf_counter() - t)
            if cpu is not None:
                cpu.setdefault((kind, g, nb), []).append(time.process_time() - c)
    return ts


def collective_medians(ts: dict, stat: Callable = statistics.median) -> dict:
    """``{kind: {str(g): {str(bytes): median seconds}}}`` of :func:`measure_collectives_round`'s samples
    (``stat``: another statistic, e.g. the mean for CPU seconds, whose total is what the cores lose)."""
    out: dict = {k: {} for k in COLLECTIVE_KINDS}
    for (kind, g, nb), v in ts.items():
        out[kind].setdefault(str(g), {})[str(nb)] = stat(v)
    return out


def measure_collective_tables(world: int, rank: int, quick: bool = False, cpu: dict | None = None) -> dict:
    """Seconds of gloo collectives per group size and tensor size in a running process group of
    ``world`` (every rank calls this at the same time): for each group size ``g`` dividing ``world``,
    the ranks split into ``world / g`` groups of consecutive ranks that all run the collective at once
    (as the groups of a hybrid plan do), over float32 tensors of 64 to 1M elements (``all_gather``:
    each member's piece is ``1/g`` of the size).  Interleaved sweeps (rounds) of a few calls each, a
    barrier over all ranks before every call, the median of each rank's calls:
    ``{kind: {str(g): {str(bytes): seconds}}}`` (bytes: the full tensor; for all-gather the gathered one).
    With ``cpu`` (a dict), it is filled with the means of the process's CPU seconds per call."""
    ops = prepare_collectives(world, rank, quick)
    reps, rounds = (3, 2) if quick else (5, 3)
    ts: dict = {}
    cs: dict | None = {} if cpu is not None else None
    for _ in range(rounds):
        measure_collectives_round(ops, reps, ts, cs)
    if cpu is not None:
        cpu.update(collective_medians(cs, statistics.mean))
    return collective_medians(ts)


def collective_tables(per_rank: list) -> dict:
    """``{kind: {str(g): [[bytes, seconds], ...]}}`` from every rank's :func:`measure_collective_tables`:
    the slowest rank per size (a collective ends for the group when its last member has it), points made
    non-decreasing (``calibration.gpu.make_table``)."""
    from .gpu import make_table
    out: dict = {}
    for kind in per_rank[0]:
        for g, pts in per_rank[0][kind].items():
            worst = [(float(nb), max(r[kind][g][nb] for r in per_rank)) for nb in pts]
            out.setdefault(kind, {})[g] = make_table(worst)
    return out


def collective_cpu_tables(per_rank: list) -> dict:
    """``{kind: {str(g): [[bytes, CPU seconds], ...]}}`` from every rank's CPU medians of
    :func:`measure_collective_tables` (its ``cpu`` argument): the mean over the ranks per size (the host's
    CPU work of one call, all ranks together, divided by the ranks), made non-decreasing.  A rank blocked
    in a collective waiting for its peers takes no CPU time, so this is the work a collective adds to the
    shared cores, not its latency (``MachineSpec.oversubscribed`` machines price it so)."""
    from .gpu import make_table
    out: dict = {}
    for kind in per_rank[0]:
        for g, pts in per_rank[0][kind].items():
            mean = [(float(nb), sum(r[kind][g][nb] for r in per_rank) / len(per_rank)) for nb in pts]
            out.setdefault(kind, {})[g] = make_table(mean)
    return out


def measure_contention(reps: int = 2, window: float = 0.03, ts: list | None = None) -> list:
    """Wall and CPU seconds of this process for ``reps`` loops of matmuls lasting ``window`` each (every rank
    calls this at the same time, so all compute): ``[(wall, cpu), ...]`` appended to ``ts`` (returned).
    Their ratio (:func:`contention_ratio`) is how much longer a piece of CPU work takes in wall time while
    all ranks compute: ~1 with a core per process, ~P / cores when the processes outnumber the cores
    (more with other programs' load)."""
    import torch
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    ts = [] if ts is None else ts
    torch.mm(a, b)
    for _ in range(reps):
        c, t = time.process_time(), time.perf_counter()
        while time.perf_counter() - t < window:
            torch.mm(a, b)
        ts.append((time.perf_counter() - t, time.process_time() - c))
    return ts


def contention_ratio(samples: list) -> float:
    """Wall over CPU seconds of :func:`measure_contention`'s samples (total over them), >= 1."""
    wall = sum(w for w, _ in samples)
    cpu = sum(c for _, c in samples)
    return max(wall / cpu, 1.0) if cpu > 0 else 1.0


def measure_solo(world: int, rank: int, quick: bool = False, window: float = 0.0) -> float:
    """How much faster one process multiplies matrices when it is the only one of ``world`` busy
    than when all are (every rank calls this at the same time).  All ranks time a matmul together,
    then each rank in turn times it alone while the others wait in a barrier; the ratio of the
    medians over ranks (>= 1: the cores the idle processes leave; ~1 on a host with a core per
    process).  ``MachineSpec.concurrency_factor`` prices nodes placed on fewer devices with it."""
    import torch
    import torch.distributed as dist
    reps = 3 if quick else 5
    n = 256 if quick else 512
    a, b = torch.randn(n, n), torch.randn(n, n)

    def timed() -> float:
        return _median_time(lambda: torch.mm(a, b), reps, window=window)
    dist.barrier()
    busy = timed()
    solo = 0.0
    for k in range(world):
        dist.barrier()
        if k == rank:
            solo = timed()
        dist.barrier()
    t = torch.tensor([busy, solo], dtype=torch.float64)
    every = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    busy_m = statistics.median(float(x[0]) for x in every)
    solo_m = statistics.median(float(x[1]) for x in every)
    return busy_m / solo_m if solo_m > 0 else 1.0


def measure_ddp(quick: bool = False) -> dict:
    """DistributedDataParallel's own cost in a running process group (every rank calls this at
    the same time).  Generic chains of tiny Linear(16, 16) + ReLU layers (gradients of a few KB, so
    bandwidth plays no part) train with Adam, with and without DDP; the difference per iteration is
    fitted as ``iteration + per_tensor * weight tensors`` over two chain lengths (the bucket's
    all-reduce latency, the wait for the slowest peer, the per-gradient hooks and bucket copies).
    A chain with BatchNorm layers, with and without ``broadcast_buffers``, gives the per-iteration
    cost of synchronizing buffers (one coalesced broadcast in every forward).  A compute-heavy,
    parameter-light chain (a few Linear(64, 64) on 4096 rows) gives ``per_compute``: DDP's extra
    time beyond the fixed terms per second of compute (replicas waiting for each other grows with
    the compute between synchronizations)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    nn = torch.nn
    reps = 5 if quick else 9
    count = 10 if quick else 15
    heavy_count = 2 if quick else 3    # iterations per sample (tens of ms: several scheduler slices)
    x = torch.randn(8, 16)

    heavy_x = torch.randn(4096, 64)

    def chain(layers: int, bn: bool = False, width: int = 16):
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods.append(nn.Linear(width, width))
            if bn:
                mods.append(nn.BatchNorm1d(16))
            mods.append(nn.ReLU())
        return nn.Sequential(*mods)

    def make_step(model, wrap, inp=x):
        m = wrap(model) if wrap else model
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            m(inp).mean().backward()
            opt.step()
        return step

    short, long_ = 4, 16
    configs = {
        "short": make_step(chain(short), None), "short_ddp": make_step(chain(short), DDP),
        "long": make_step(chain(long_), None), "long_ddp": make_step(chain(long_), DDP),
        "bn_sync": make_step(chain(short, bn=True), lambda mm: DDP(mm, broadcast_buffers=True)),
        "bn_nosync": make_step(chain(short, bn=True), lambda mm: DDP(mm, broadcast_buffers=False)),
        # few tiny weights, much compute (tens of ms): how the replicas' waiting for each other
        # grows with the compute between synchronizations (processes descheduled while others
        # compute, gloo's waiting ranks taking CPU time)
        "heavy": make_step(chain(short, width=64), None, heavy_x),
        "heavy_ddp": make_step(chain(short, width=64), DDP, heavy_x),
    }
    # interleaved samples (one of every configuration per round), so that a drifting host load
    # affects the configurations alike and cancels in their differences
    samples: dict = {k: [] for k in configs}
    for step in configs.values():
        for _ in range(3):
            step()
    for _ in range(reps):
        for k, step in configs.items():
            dist.barrier()
            samples[k].append(_median_time(step, 1, warmup=0, count=heavy_count if k.startswith("heavy") else count))
    t = {k: statistics.median(v) for k, v in samples.items()}
    res = {short: max(t["short_ddp"] - t["short"], 0.0), long_: max(t["long_ddp"] - t["long"], 0.0)}
    per_tensor = max((res[long_] - res[short]) / (2 * (long_ - short)), 0.0)
    iteration = max(res[short] - per_tensor * 2 * short, 0.0)
    fixed = iteration + per_tensor * 2 * short
    per_compute = max((t["heavy_ddp"] - t["heavy"] - fixed) / max(t["heavy"], 1e-9), 0.0)
    return {"iteration": iteration, "per_tensor": per_tensor, "buffers": max(t["bn_sync"] - t["bn_nosync"], 0.0),
            "per_compute": per_compute, "measured": t}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_sweep(sizes: list, reps: int, rounds: int = 3) -> dict:
    """Median seconds of one all-reduce per size: ``rounds`` interleaved sweeps over the sizes of
    ``reps`` timed calls each (after a barrier), the median over all of them, so that a burst of load
    on a shared host hits every size alike and a few slow calls do not set a size's time."""
    import torch
    import torch.distributed as dist
    bufs = {n: torch.ones(n) for n in sizes}
    for x in bufs.values():
        for _ in range(2):
            dist.all_reduce(x)
    ts: dict = {n: [] for n in sizes}
    for _ in range(max(1, rounds)):
        for n, x in bufs.items():
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(x)
                ts[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in ts.items()}


def _world_worker(rank: int, world: int, port: int, quick: bool, threads: int, window: float, q) -> None:
    """One of ``world`` processes measuring together, so every number includes the sharing of the
    cores with the other ranks (all busy with the same benchmarks), as in data-parallel training."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # the compute benchmarks and the kernel tables in rounds spread over the calibration (start, after
        # DDP's, after the all-reduce sweep, after the collective tables), the median of each number over
        # the rounds: a burst of load from other jobs on a shared host then sets no number alone
        prepared = prepare_kernels(quick)
        kern: dict = {}
        sw: dict = {}
        cont: list = []

        def kernel_round(samples: int = 1) -> None:
            dist.barrier()
            for key, rec in measure_kernels(prepared, window=KERNEL_WINDOW, samples=samples).items():
                mine = kern.setdefault(key, {"fwd": [], "bwd": []})
                mine["fwd"] += rec["fwd"]
                mine["bwd"] += rec["bwd"]
            measure_sync_wait(2 * samples, sw)
            dist.barrier()
            measure_contention(2 * samples, ts=cont)
        comps = []
        dist.barrier()
        comps.append(measure_compute(quick, quiet=True, threads=threads, window=window))
        kernel_round(2 if quick else 1)
        dist.barrier()
        solo = measure_solo(world, rank, quick, window=window)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = measure_ddp(quick)
        if not quick:
            dist.barrier()
            comps.append(measure_compute(quick, quiet=True, threads=threads, window=window))
            kernel_round()
        sizes = [1, 2 ** 12, 2 ** 16, 2 ** 18, 2 ** 20] + ([] if quick else [2 ** 22])
        ar = _allreduce_sweep(sizes, 5 if quick else 10, rounds=2 if quick else 3)
        if not quick:
            dist.barrier()
            comps.append(measure_compute(quick, quiet=True, threads=threads, window=window))
            kernel_round()
        coll_cpu: dict = {}
        coll = measure_collective_tables(world, rank, quick, cpu=coll_cpu)
        kernel_round()
        ddp["executor_wait"] = {k: statistics.median(v) for k, v in sw.items()}
        comp = _median_tree(comps)
        comp["solo_speedup"] = solo
        comp["contention"] = contention_ratio(cont)
        kernels = {k: {d: statistics.median(v[d]) for d in ("fwd", "bwd") if v[d]} for k, v in kern.items()}
        q.put((rank, {"compute": comp, "ddp": ddp, "allreduce": ar, "kernels": kernels, "collectives": coll,
                      "collectives_cpu": coll_cpu}))
    finally:
        dist.destroy_process_group()


def _median_tree(items: list):
    """Element-wise median of equally shaped nested dicts of numbers."""
    first = items[0]
    if isinstance(first, dict):
        return {k: _median_tree([it[k] for it in items]) for k in first}
    return statistics.median(items)


def measure_world(world: int, quick: bool = False, threads: int | None = None, window: float | None = None) -> dict:
    """Run :func:`measure_compute`, :func:`measure_ddp` and an all-reduce sweep in ``world``
    concurrent processes (gloo over loopback); the median over ranks of each number.  Threads per
    process: ``max(1, cores // world)`` unless given (as a data-parallel launcher would set them)."""
    import torch.multiprocessing as mp
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // world)
    if window is None:
        window = 0.02 if quick else 0.03
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_world_worker, args=(r, world, port, quick, threads, window, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = []
        deadline = time.monotonic() + 900
        while len(got) < world:
            try:
                got.append(q.get(timeout=2)[1])
            except Exception:     # queue.Empty: a rank that died (an error, killed) sends nothing
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"calibration of {world} processes failed: "
                                       + (f"a rank exited with code {dead[0]}" if dead else "timed out")) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    coll = [g.pop("collectives") for g in got]
    coll_cpu = [g.pop("collectives_cpu") for g in got]
    out = _median_tree(got)
    out["collectives_cpu"] = collective_cpu_tables(coll_cpu)
    ew = out["ddp"].pop("executor_wait")
    # the executor's processes wait for each other at its collectives: compute slowed by this factor
    out["ddp"]["executor_slowdown"] = sync_slowdown(ew["free"], ew["synced"], ew["alone"])
    if world > cores:       # collectives priced by their CPU work (MachineSpec.collective_cpu_time)
        out["ddp"]["executor_slowdown_cpu"] = sync_slowdown_cpu(ew, out["collectives_cpu"], world,
                                                                out["compute"]["contention"])
    out["ddp"]["executor_wait"] = ew
    out["collectives"] = collective_tables(coll)
    out["threads"] = threads
    out["allreduce"] = {int(k): v for k, v in out["allreduce"].items()}
    return out


def measure_allreduce(world: int, quick: bool = False) -> dict:
    """Median all-reduce seconds per float32 tensor size over ``world`` processes (measured together
    with the other per-world benchmarks, see :func:`measure_world`)."""
    return measure_world(world, quick)["allreduce"]


def fit_ring(world: int, res: dict) -> dict:
    """Fit alpha (s) and beta (bytes/s) of the ring all-reduce model
    ``t(n) = 2(p-1) alpha + 2(p-1)/p * 4n / beta`` to the measured sizes (float32 elements), by least
    squares on the relative error (so small and large messages weigh alike)."""
    steps = 2 * (world - 1)
    xs = [(steps, (2 * (world - 1) / world) * 4 * n, t) for n, t in sorted(res.items())]
    # minimize sum ((a*x1 + b*x2 - t) / t)^2 over a = alpha, b = 1/beta (2x2 normal equations)
    s11 = sum((x1 / t) ** 2 for x1, x2, t in xs)
    s12 = sum((x1 / t) * (x2 / t) for x1, x2, t in xs)
    s22 = sum((x2 / t) ** 2 for x1, x2, t in xs)
    r1 = sum(x1 / t for x1, x2, t in xs)
    r2 = sum(x2 / t for x1, x2, t in xs)
    det = s11 * s22 - s12 * s12
    a = (r1 * s22 - r2 * s12) / det if det else xs[0][2] / steps
    b = (s11 * r2 - s12 * r1) / det if det else 0.0
    if a <= 0 or b <= 0:   # degenerate noise: fall back to the two extreme sizes
        t0, t1 = xs[0][2], xs[-1][2]
        a = max(t0 / steps, 1e-7)
        b = max((t1 - t0) / max(xs[-1][1] - xs[0][1], 1.0), 1e-12)
    return {"latency": a, "bandwidth": 1.0 / b, "measured": {str(n): t for n, t in sorted(res.items())}}


def _device(comp: dict, mem: int) -> DeviceSpec:
    peak = max(comp["matmul_flops"], comp["conv_flops"])
    eff = {"matmul": comp["matmul_flops"] / peak, "conv": comp["conv_flops"] / peak,
           "conv1x1": comp["conv_flops"] / peak, "default": min(comp["matmul_flops"], comp["conv_flops"]) / peak, "elementwise": 1.0}
    return DeviceSpec(peak, comp["mem_bandwidth"], int(mem), eff, comp["op_overhead"], comp["update_overhead"],
                      comp["overheads"])


def _device_json(dev: DeviceSpec) -> dict:
    d = asdict(dev)
    d["efficiency"] = dict(dev.efficiency)
    d["overheads"] = dict(dev.overheads)
    d["kernel_tables"] = {k: [list(p) for p in v] for k, v in dict(dev.kernel_tables).items()}
    return d


def kernel_tables(quick: bool, measured: dict) -> tuple[dict, dict]:
    """(fits, tables) of the per-class kernel tables (``calibration.gpu.fit_rows``) from the medians
    ``measured`` (``{"<class>:<label>": {"fwd": s, "bwd": s}}``); the work of each kernel is labelled
    here, in the calling process, from the same cases (``search.cost.kernel_work``)."""
    from .gpu import fit_rows
    built = [(c, _build_kernel(c)) for c in local_cases(quick)]
    return fit_rows(kernel_rows([(c, b, None, 1) for c, b in built if b is not None], measured))


def calibrate(quick: bool = False, worlds: tuple | None = None, quiet: bool = False, device: str | None = None,
              precision: str | None = None, size: str | None = None, base: str | None = None) -> MachineSpec:
    """Measure this computer once per world size (``worlds``: numbers of concurrent processes) and
    describe it as a ``local`` machine.  ``meta["worlds"][str(w)]`` holds, for ``w`` processes, the
    device (compute measured while all ``w`` ranks compute), the link (ring fit of the all-reduce
    sweep) and DDP's own costs (``sync``); :meth:`MachineSpec.resized` picks the nearest world size.

    ``device="cuda"`` (or ``"cpu"``: one process, the same code) measures one accelerator's kernels per
    operator class and math mode instead (:func:`unity_pcg.calibration.gpu.calibrate_device`; ``precision``:
    one math mode, default all; ``size``: ``tiny``, ``quick`` (default with ``quick``) or ``full``;
    ``base``: the preset whose topology and network link are kept)."""
    if device is not None and device != "local":
        from .gpu import calibrate_device
        obj = calibrate_device(device, precision=precision, size=size or ("quick" if quick else "full"),
                               base=base, quiet=quiet)
        return MachineSpec.from_json(obj, source=f"calibration of {device}")
    t_start = time.perf_counter()
    cores = os.cpu_count() or 1
    worlds = tuple(sorted(worlds or ((2, 4) if quick else (2, 3, 4))))
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 * 2 ** 30
    per_world = {}
    fits = {}
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    for w in worlds:
        _say(f"{cores} core(s); {w} concurrent processes: compute, DDP and gloo all-reduce ...", quiet)
        res = measure_world(w, quick)
        comp = res["compute"]
        fits[w] = fit_ring(w, res["allreduce"])
        kfits, tables = kernel_tables(quick, res["kernels"])
        dev = replace(_device(comp, mem), kernel_tables=tables)
        per_world[str(w)] = {"device": _device_json(dev),
                             "link": {"bandwidth": fits[w]["bandwidth"], "latency": fits[w]["latency"]},
                             "sync": res["ddp"], "threads": res["threads"], "measured": comp,
                             "solo_speedup": comp["solo_speedup"], "kernels": res["kernels"],
                             "kernel_fits": kfits, "collectives": res["collectives"],
                             "collectives_cpu": res["collectives_cpu"], "contention": comp["contention"]}
        o = comp["overheads"]
        _say(f"  world {w}: matmul {comp['matmul_flops'] / 1e9:.1f} GFLOP/s, conv {comp['conv_flops'] / 1e9:.1f}"
             f" GFLOP/s, one busy alone {comp['solo_speedup']:.2f}x faster, contention {comp['contention']:.2f}, op {comp['op_overhead'] * 1e6:.1f} us, Adam {comp['update_overhead'] * 1e6:.1f} us/tensor;"
             " fwd/bwd us " + ", ".join(f"{k} {o[k] * 1e6:.0f}/{o[k + ':bwd'] * 1e6:.0f}"
                                         for k in ("conv", "conv1x1", "matmul", "elementwise", "norm",
                                                   "pool")), quiet)
        _say(f"  world {w}: all-reduce latency {fits[w]['latency'] * 1e6:.0f} us, bandwidth "
             f"{fits[w]['bandwidth'] / 1e9:.2f} GB/s; executor slowdown {res['ddp']['executor_slowdown']:.2f}; "
             f"DDP {res['ddp']['iteration'] * 1e6:.0f} us/iteration + "
             f"{res['ddp']['per_tensor'] * 1e6:.1f} us/tensor, buffers {res['ddp']['buffers'] * 1e6:.0f} us", quiet)
    first = min(worlds)
    dev = replace(_device(per_world[str(first)]["measured"], mem),
                  kernel_tables=per_world[str(first)]["device"]["kernel_tables"])
    link = LinkSpec(fits[first]["bandwidth"], fits[first]["latency"])
    meta = {"calibrated": True, "quick": bool(quick), "cores": cores,
            "threads_per_process": {str(w): per_world[str(w)]["threads"] for w in worlds},
            "device_world": first, "sync": per_world[str(first)]["sync"],
            "solo_speedup": per_world[str(first)]["solo_speedup"],
            "worlds": per_world,
            "allreduce_fits": {str(k): v for k, v in fits.items()},
            "loadavg_before": load_before,
            "seconds": time.perf_counter() - t_start,
            "host": socket.gethostname()}
    m = MachineSpec("local", 1, first, first, dev, {"group": link, "node": link, "network": link},
                    shared_cores=cores, meta=meta, host_memory_bytes=int(dev.memory_bytes))
    _say(f"done in {meta['seconds']:.1f} s", quiet)
    return m


__all__ = ["calibrate", "measure_compute", "measure_ddp", "measure_world", "measure_allreduce", "fit_ring"]
