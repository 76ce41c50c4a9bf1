"""Predicted vs measured iteration time of torch DDP (gloo, CPU) on the zoo's tiny models.

For every zoo model and P in (2, 4) local processes:

* measured: P processes (torch.multiprocessing, gloo over tcp://127.0.0.1), each with
  ``max(1, cores // P)`` torch threads, train the tiny model wrapped in DistributedDataParallel with
  Adam on ``--batch`` samples per process; the median iteration time (forward, loss, backward with
  DDP's gradient all-reduce, optimizer step) of rank 0 after warm-up, median over ``--runs`` launches;
* predicted: right before the measurement, the local machine is calibrated for P concurrent
  processes (``calibration.local.calibrate(worlds=(P,))``: generic micro-benchmarks run in P
  processes at once -- operator chains forward+backward, an Adam step over many tensors, DDP on
  chains of tiny Linear layers, gloo all-reduce sweeps; never the model); the model exported to
  ONNX with global batch ``P * batch`` is imported with ``load_onnx``, parallelized by
  ``search.baselines.data_parallel(P)`` and priced by the machine-mapping DP on that machine.

Usage:  .venv/bin/python benchmarks/ddp_predict.py [--fixed-machine [--machine F] [--calibrate]]
        [--models a,b] [--procs 2,4] [--batch 8] [--iters 20] [--runs 3]
        .venv/bin/python benchmarks/ddp_predict.py --reprice RUN.json --out R.json --md R.md   (no measuring:
        an earlier run's rows priced again with their own calibrations and today's cost model)
Writes benchmarks/results/ddp_predict.json and ddp_predict.md.
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


def fresh_machine(procs: int, path: str, quick: bool = False) -> str:
    """Calibrate the local machine for ``procs`` concurrent processes right before a measurement:
    the host is shared, so its speed drifts; the calibration runs generic micro-benchmarks only
    (never the model)."""
    from unity_pcg.calibration.local import calibrate
    calibrate(quick=quick, worlds=(procs,), quiet=True).save(path)
    return path


def predict(name: str, procs: int, batch: int, machine_path: str) -> dict:
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx

    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{name}-tiny-b{batch * procs}.onnx")
    if not os.path.exists(path):
        zoo.export(name, path, size="tiny", batch=batch * procs)
    g = load_onnx(path, load_weights=False)
    pg = data_parallel(g, procs, combine_outputs=False)   # DDP computes each loss on its own shard
    m = parse_machine(f"{machine_path}:1x{procs}")
    r = MachineMapper(CostModel(m, optimizer="adam", sync_model="ddp")).optimize(pg)   # prices torch DDP itself
    return {"predicted_s": r.cost, "breakdown": r.to_json()["breakdown"], "fallbacks": pg.meta.get("fallbacks", [])}


def reprice(path: str, out: str, md: str | None) -> int:
    """Price the rows of an earlier run again with today's cost model and that run's own calibrations (its
    ``machines``: the world record each row was calibrated with), measuring nothing: tells a change of the
    cost model from a change of the calibration or of the host."""
    with open(path) as f:
        old = json.load(f)
    rows = []
    for r in old["rows"]:
        name, p = r["model"], r["procs"]
        base = calibrated_base(old["machines"][f"{name}:{p}"], p)
        mpath = os.path.join(CACHE, f"reprice-{name}-{p}.json")
        with open(mpath, "w") as f:
            json.dump(base, f)
        pred = predict(name, p, r["batch_per_proc"], mpath)
        rows.append({"model": name, "procs": p, "measured_s": r["measured_s"], "then_predicted_s": r["predicted_s"],
                     "then_breakdown": r["breakdown"], "now_predicted_s": pred["predicted_s"],
                     "now_breakdown": pred["breakdown"]})
        print(f"{name:13s} P={p}  then {r['predicted_s'] * 1e3:8.2f} ms  now {pred['predicted_s'] * 1e3:8.2f} ms  "
              f"measured {r['measured_s'] * 1e3:8.2f} ms", flush=True)
    command = "python benchmarks/ddp_predict.py " + " ".join(sys.argv[1:])
    with open(out, "w") as f:
        json.dump({"rows": rows, "source": path, "command": command, "commit": _commit()}, f, indent=2)
    if md:
        ms = lambda b, k: b.get(k, 0.0) * 1e3          # noqa: E731
        lines = [f"# DDP prediction re-priced: `{path}` with the cost model at commit {_commit()}", "",
                 f"Command: `.venv/bin/{command}`", "",
                 "| model | P | measured ms | predicted then | now | now compute | comm | grad sync | update |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            b = r["now_breakdown"]
            lines.append(f"| {r['model']} | {r['procs']} | {r['measured_s'] * 1e3:.2f} | "
                         f"{r['then_predicted_s'] * 1e3:.2f} | {r['now_predicted_s'] * 1e3:.2f} | "
                         f"{ms(b, 'compute_s'):.2f} | {ms(b, 'comm_s'):.2f} | {ms(b, 'grad_sync_s'):.2f} | "
                         f"{ms(b, 'update_s'):.2f} |")
        with open(md, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def calibrated_base(world_record: dict, procs: int) -> dict:
    """A local machine JSON holding one calibrated world record (``meta.worlds``), as ``calibrate`` writes."""
    from unity_pcg.machine import local
    m = local(1, procs).to_json()
    m["meta"] = {"calibrated": True, "worlds": {str(procs): world_record}, "device_world": procs,
                 "sync": world_record.get("sync", {})}
    return m


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
    ap.add_argument("--fixed-machine", action="store_true",
                    help="price with --machine as is instead of calibrating for P processes right before "
                         "every (model, P) measurement")
    ap.add_argument("--md", default=os.path.join(RESULTS, "ddp_predict.md"))
    ap.add_argument("--reprice", default=None, metavar="RUN.json",
                    help="measure nothing: price an earlier run's rows again with its own calibrations (--out/--md: "
                         "where to write)")
    a = ap.parse_args()
    if a.reprice:
        return reprice(a.reprice, a.out, a.md)
    os.makedirs(RESULTS, exist_ok=True)
    t_start = time.time()
    if a.fixed_machine and (a.calibrate or not os.path.exists(a.machine)):
        from unity_pcg.calibration.local import calibrate
        calibrate(quick=False).save(a.machine)
    rows = []
    machines = {}
    for name in a.models.split(","):
        for p in (int(x) for x in a.procs.split(",")):
            load = os.getloadavg()[0]
            mpath = a.machine
            if not a.fixed_machine:
                mpath = fresh_machine(p, os.path.join(CACHE, f"local-now-{p}.json"))
                with open(mpath) as f:
                    machines[f"{name}:{p}"] = json.load(f)["meta"]["worlds"][str(p)]
            ms = [measure(name, p, a.batch, a.iters) for _ in range(a.runs)]
            meas = statistics.median(ms)
            pred = predict(name, p, a.batch, mpath)
            err = (pred["predicted_s"] - meas) / meas
            rows.append({"model": name, "procs": p, "batch_per_proc": a.batch, "measured_s": meas,
                         "measured_runs_s": ms, **pred, "rel_error": err, "loadavg_1min_before": load,
                         "loadavg_1min_after": os.getloadavg()[0]})
            print(f"{name:13s} P={p}  measured {meas * 1e3:8.2f} ms  predicted {pred['predicted_s'] * 1e3:8.2f} ms"
                  f" ({err * 100:+6.1f}%)  load {load:.1f}", flush=True)
    errs = [abs(r["rel_error"]) for r in rows]
    summary = {"median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
               "within_20pct": sum(e <= 0.2 for e in errs), "cases": len(errs)}
    for p in sorted({r["procs"] for r in rows}):
        e = [abs(r["rel_error"]) for r in rows if r["procs"] == p]
        summary[f"median_abs_rel_error_p{p}"] = statistics.median(e)
    if a.fixed_machine:
        with open(a.machine) as f:
            machines = json.load(f)
    command = "python benchmarks/ddp_predict.py " + " ".join(sys.argv[1:])
    loads = [r["loadavg_1min_before"] for r in rows] + [r["loadavg_1min_after"] for r in rows]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "seconds": time.time() - t_start,
            "cores": os.cpu_count(), "commit": _commit(), "loadavg_1min_min": min(loads),
            "loadavg_1min_max": max(loads),
            "host": socket.gethostname()}
    with open(a.out, "w") as f:
        json.dump({"summary": summary, "rows": rows, "machines": machines, "args": vars(a),
                   "command": command, "meta": meta}, f, indent=2)
    if a.md:
        write_markdown(a.md, rows, summary, command, meta)
    print(json.dumps(summary))
    return 0


def _commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_markdown(path: str, rows: list, summary: dict, command: str, meta: dict | None = None) -> None:
    lines = ["# DDP iteration time: predicted vs measured (tiny zoo models, torch DDP, gloo, CPU)", "",
             f"Command: `.venv/bin/{command}`", ""]
    if meta:
        lines += [f"Run {meta['date']} at commit {meta['commit']}, {meta['seconds'] / 60:.0f} min, {meta['cores']} "
                  f"cores; 1-min load average {meta['loadavg_1min_min']:.1f}-{meta['loadavg_1min_max']:.1f} "
                  "(before/after each row; other programs included).", ""]
    lines += ["| model | P | measured ms | predicted ms | error | compute | grad sync | update | load before |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown"]
        lines.append(f"| {r['model']} | {r['procs']} | {r['measured_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | "
                     f"{r['rel_error'] * 100:+.1f}% | {b.get('compute_s', 0) * 1e3:.2f} | "
                     f"{b.get('grad_sync_s', 0) * 1e3:.2f} | {b.get('update_s', 0) * 1e3:.2f} | "
                     f"{r['loadavg_1min_before']:.1f} |")
    lines += ["", f"Median absolute error: {summary['median_abs_rel_error'] * 100:.1f}% "
              f"({summary['within_20pct']} of {summary['cases']} within 20%; max "
              f"{summary['max_abs_rel_error'] * 100:.1f}%)."]
    for k, v in summary.items():
        if k.startswith("median_abs_rel_error_p"):
            lines.append(f"- P={k.rsplit('p', 1)[1]}: median absolute error {v * 100:.1f}%")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
