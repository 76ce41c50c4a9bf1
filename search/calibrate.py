"""Measure this computer and describe it as a ``local`` :class:`MachineSpec`.

Devices of the local machine are CPU processes (one torch thread each) that share the cores: the
measured per-process throughput is scaled by ``cores / processes`` when there are more processes
than cores (``MachineSpec.share``).  What is measured (medians of repeated runs, torch on one
thread):

* matmul and conv2d throughput (FLOP/s; the faster is the device's ``peak_flops``, each kind's
  efficiency is its throughput relative to it), memory bandwidth (a large tensor copy: read + write);
* the per-operator overhead of a training step: a chain of tiny Linear+ReLU layers, forward and
  backward, divided by the number of operator runs (forward + backward); and per operator class
  (conv, matmul, elementwise, norm, pool) the forward and backward time of a tiny instance;
* the optimizer (Adam) step overhead per weight tensor;
* gloo collectives over loopback TCP for world sizes 2..4 (``torch.multiprocessing`` +
  ``torch.distributed``, ``init_method=tcp://127.0.0.1:PORT``): all-reduce time of a tiny and a large
  tensor sweep (1 to 4M floats), fitted to the ring model ``2(p-1) alpha + 2(p-1)/p n / beta`` by least
  squares on relative error.  The fit for each world size
  is kept in ``meta["allreduce_fits"]``; the links of a resized local machine use the fit of its
  device count (nearest measured).

Progress goes to stderr.  ``quick=True`` uses smaller sizes, fewer repeats and world sizes 2 and 4,
and finishes well within a minute.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from typing import Callable

from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _median_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_compute(quick: bool = False, quiet: bool = False) -> dict:
    import torch
    torch.set_num_threads(1)
    reps = 3 if quick else 7
    out = {}
    n = 384 if quick else 768
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = _median_time(lambda: torch.mm(a, b), reps)
    out["matmul_flops"] = 2 * n ** 3 / t
    _say(f"matmul {n}^3: {out['matmul_flops'] / 1e9:.1f} GFLOP/s", quiet)
    x = torch.randn(8, 32, 32, 32)
    w = torch.randn(32, 32, 3, 3)
    t = _median_time(lambda: torch.nn.functional.conv2d(x, w, padding=1), reps)
    out["conv_flops"] = 2 * 8 * 32 * 32 * 32 * 32 * 9 / t
    _say(f"conv2d 3x3: {out['conv_flops'] / 1e9:.1f} GFLOP/s", quiet)
    m = (4 if quick else 16) * 2 ** 20
    src = torch.randn(m)
    dst = torch.empty(m)
    t = _median_time(lambda: dst.copy_(src), reps)
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
    t = _median_time(step, reps * 3, warmup=2)
    runs = 2 * (2 * layers)  # Linear and ReLU, forward and backward
    out["op_overhead"] = t / runs
    _say(f"per-operator overhead: {out['op_overhead'] * 1e6:.1f} us", quiet)
    # per-class launch overheads: tiny instances, forward and forward+backward
    F = torch.nn.functional
    xi = torch.randn(2, 4, 8, 8, requires_grad=True)
    wc = torch.randn(4, 4, 3, 3, requires_grad=True)
    wl = torch.randn(4, 4, requires_grad=True)
    xl = torch.randn(2, 4, requires_grad=True)
    kinds = {
        "conv": lambda: F.conv2d(xi, wc, padding=1),
        "matmul": lambda: F.linear(xl, wl),
        "elementwise": lambda: torch.relu(xl),
        "norm": lambda: F.batch_norm(xi, None, None, training=True),
        "pool": lambda: F.max_pool2d(xi, 2),
    }
    over = {}
    for kind, fn in kinds.items():
        tf = _median_time(lambda: fn(), reps * 3, warmup=2)

        def fb(fn=fn):
            fn().sum().backward()
        tfb = _median_time(fb, reps * 3, warmup=2)
        # the sum and the backward of the sum are two more tiny ops
        t_sum = _median_time(lambda: xl.sum(), reps * 3, warmup=2)
        over[kind] = tf
        over[f"{kind}:bwd"] = max(tfb - tf - 2 * t_sum, 0.0)
    out["overheads"] = over
    _say("launch overheads (us, fwd/bwd): " + ", ".join(
        f"{k} {over[k] * 1e6:.0f}/{over[k + ':bwd'] * 1e6:.0f}" for k in kinds), quiet)
    # optimizer step overhead per weight tensor (Adam on tiny tensors; bytes are negligible)
    ps = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(64)]
    for p in ps:
        p.grad = torch.randn(4, 4)
    opt = torch.optim.Adam(ps, lr=1e-4)
    t = _median_time(opt.step, reps * 3, warmup=2)
    out["update_overhead"] = t / len(ps)
    _say(f"optimizer step overhead: {out['update_overhead'] * 1e6:.1f} us per weight tensor", quiet)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, world: int, port: int, sizes: list, reps: int, q) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {}
        for n in sizes:
            x = torch.ones(n)
            for _ in range(2):
                dist.all_reduce(x)
            ts = []
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(x)
                ts.append(time.perf_counter() - t)
            res[n] = statistics.median(ts)
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def measure_allreduce(world: int, quick: bool = False) -> dict:
    """Median all-reduce seconds per float32 tensor size over ``world`` processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [1, 2 ** 12, 2 ** 16, 2 ** 18, 2 ** 20] + ([] if quick else [2 ** 22])
    reps = 5 if quick else 10
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, sizes, reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return res


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


def calibrate(quick: bool = False, worlds: tuple | None = None, quiet: bool = False) -> MachineSpec:
    t_start = time.perf_counter()
    cores = os.cpu_count() or 1
    _say(f"{cores} core(s); measuring compute on one thread", quiet)
    comp = measure_compute(quick, quiet)
    worlds = worlds or ((2, 4) if quick else (2, 3, 4))
    fits = {}
    for w in worlds:
        _say(f"gloo all-reduce over {w} processes ...", quiet)
        res = measure_allreduce(w, quick)
        fits[w] = fit_ring(w, res)
        _say(f"  world {w}: latency {fits[w]['latency'] * 1e6:.0f} us, bandwidth "
             f"{fits[w]['bandwidth'] / 1e9:.2f} GB/s", quiet)
    peak = max(comp["matmul_flops"], comp["conv_flops"])
    eff = {"matmul": comp["matmul_flops"] / peak, "conv": comp["conv_flops"] / peak,
           "default": min(comp["matmul_flops"], comp["conv_flops"]) / peak, "elementwise": 1.0}
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 * 2 ** 30
    dev = DeviceSpec(peak, comp["mem_bandwidth"], int(mem), eff, comp["op_overhead"], comp["update_overhead"],
                     comp["overheads"])
    first = fits[min(fits)]
    link = LinkSpec(first["bandwidth"], first["latency"])
    meta = {"calibrated": True, "quick": bool(quick), "cores": cores, "threads_per_process": 1,
            "measured": {k: v for k, v in comp.items()},
            "allreduce_fits": {str(k): v for k, v in fits.items()},
            "seconds": time.perf_counter() - t_start,
            "host": socket.gethostname()}
    m = MachineSpec("local", 1, min(fits), min(fits), dev, {"group": link, "node": link, "network": link},
                    shared_cores=cores, meta=meta)
    _say(f"done in {meta['seconds']:.1f} s", quiet)
    return m


__all__ = ["calibrate", "measure_compute", "measure_allreduce", "fit_ring"]
