"""Predicted vs measured iteration time of torch DDP (gloo, CPU) on the zoo's tiny models.

For every zoo model and P in (2, 4) local processes:

* measured: P processes (torch.multiprocessing, gloo over tcp://127.0.0.1), each with
  ``max(1, cores // P)`` torch threads, train the tiny model wrapped in DistributedDataParallel with
  Adam on ``--batch`` samples per process; the median iteration time (forward, loss, backward with
  DDP's gradient all-reduce, optimizer step) of rank 0 after warm-up, median over ``--runs`` launches;
* predicted: the model exported to ONNX with global batch ``P * batch``, imported with
  ``load_onnx``, parallelized by ``search.baselines.data_parallel(P)`` and priced by the machine-
  mapping DP on the calibrated local machine (``unity-pcg calibrate``) resized to 1 x P.

Usage:  .venv/bin/python benchmarks/ddp_predict.py [--machine benchmarks/results/local.json]
        [--calibrate] [--recalibrate-each] [--models a,b] [--procs 2,4] [--batch 8] [--iters 20] [--runs 3]
Writes benchmarks/results/ddp_predict.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CACHE = os.path.join(ROOT, "benchmarks", ".cache")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, name, batch, iters, threads, q):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unity_pcg import zoo
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model, inputs, _, _ = zoo.build(name, "tiny", batch=batch)
        model.train()
        ddp = DDP(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            out = ddp(*inputs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            loss = sum(o.float().mean() for o in outs)
            loss.backward()
            opt.step()

        for _ in range(3):
            step()
        ts = []
        for _ in range(iters):
            dist.barrier()
            t = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t)
        if rank == 0:
            q.put(statistics.median(ts))
    finally:
        dist.destroy_process_group()


def measure(name: str, procs: int, batch: int, iters: int) -> float:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // procs)
    port = _free_port()
    ps = [ctx.Process(target=_worker, args=(r, procs, port, name, batch, iters, threads, q)) for r in range(procs)]
    for p in ps:
        p.start()
    try:
        return q.get(timeout=600)
    finally:
        for p in ps:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


def fresh_machine(procs: int, path: str, quick: bool = True) -> str:
    """Calibrate again right before a measurement (compute on one thread + gloo for ``procs``):
    the host is shared, so its speed drifts; the calibration never looks at the model."""
    from search.calibrate import calibrate
    calibrate(quick=quick, worlds=(procs,), quiet=True).save(path)
    return path


def background_runnable(seconds: float = 1.0, samples: int = 20) -> float:
    """Mean number of runnable tasks of other programs (``/proc/loadavg`` field 4, minus this
    sampler), sampled over ``seconds``: the competition our processes will meet on the shared cores."""
    vals = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        vals.append(max(0, running - 1))
        time.sleep(seconds / samples)
    return statistics.mean(vals)


def predict(name: str, procs: int, batch: int, machine_path: str, background: float = 0.0) -> dict:
    from search.baselines import data_parallel
    from search.cost import CostModel
    from search.mapping import MachineMapper
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{name}-tiny-b{batch * procs}.onnx")
    if not os.path.exists(path):
        zoo.export(name, path, size="tiny", batch=batch * procs)
    g = load_onnx(path, load_weights=False)
    pg = data_parallel(g, procs, combine_outputs=False)   # DDP computes each loss on its own shard
    import dataclasses
    m = parse_machine(f"{machine_path}:1x{procs}")
    r = MachineMapper(CostModel(m, optimizer="adam")).optimize(pg)
    out = {"predicted_s": r.cost, "breakdown": r.to_json()["breakdown"], "fallbacks": pg.meta.get("fallbacks", [])}
    if background > 0:   # the same cost model, the cores shared with the measured background load too
        mb = dataclasses.replace(m, background_load=background)
        rb = MachineMapper(CostModel(mb, optimizer="adam")).optimize(pg)
        out["predicted_loaded_s"] = rb.cost
    else:
        out["predicted_loaded_s"] = r.cost
    return out


def main() -> int:
    from unity_pcg import zoo
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", default=os.path.join(RESULTS, "local.json"))
    ap.add_argument("--calibrate", action="store_true", help="(re)calibrate into --machine first")
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--batch", type=int, default=8, help="samples per process")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "ddp_predict.json"))
    ap.add_argument("--recalibrate-each", action="store_true",
                    help="quick-calibrate right before every (model, P) measurement (shared, drifting hosts)")
    a = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if a.calibrate or not os.path.exists(a.machine):
        from search.calibrate import calibrate
        calibrate(quick=False).save(a.machine)
    rows = []
    for name in a.models.split(","):
        for p in (int(x) for x in a.procs.split(",")):
            mpath = a.machine
            if a.recalibrate_each:
                mpath = fresh_machine(p, os.path.join(CACHE, f"local-now-{p}.json"))
            load = os.getloadavg()[0]
            ms, bgs = [], []
            for _ in range(a.runs):
                bgs.append(background_runnable())
                ms.append(measure(name, p, a.batch, a.iters))
            meas = statistics.median(ms)
            bg = statistics.median(bgs)
            pred = predict(name, p, a.batch, mpath, bg)
            err = (pred["predicted_s"] - meas) / meas
            errl = (pred["predicted_loaded_s"] - meas) / meas
            rows.append({"model": name, "procs": p, "batch_per_proc": a.batch, "measured_s": meas,
                         "measured_runs_s": ms, **pred, "rel_error": err, "rel_error_loaded": errl,
                         "background_runnable": bg, "background_runs": bgs, "loadavg_1min_before": load})
            print(f"{name:13s} P={p}  measured {meas * 1e3:8.2f} ms  predicted {pred['predicted_s'] * 1e3:8.2f} ms"
                  f" ({err * 100:+6.1f}%)  with background load {bg:.1f}: {pred['predicted_loaded_s'] * 1e3:8.2f} ms"
                  f" ({errl * 100:+6.1f}%)", flush=True)
    errs = [abs(r["rel_error"]) for r in rows]
    errsl = [abs(r["rel_error_loaded"]) for r in rows]
    summary = {"median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
               "within_20pct": sum(e <= 0.2 for e in errs),
               "median_abs_rel_error_loaded": statistics.median(errsl),
               "within_20pct_loaded": sum(e <= 0.2 for e in errsl), "cases": len(errs)}
    with open(a.machine) as f:
        machine = json.load(f)
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "rows": rows, "machine": machine, "args": vars(a),
                   "command": "python benchmarks/ddp_predict.py " + " ".join(sys.argv[1:])}, f, indent=2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
