"""Data-parallel plan (executor) against torch DDP on the same model, local gloo processes, with executor
variants side by side (where the step time goes).

    .venv/bin/python benchmarks/executor_dp_vs_ddp.py [--world 2,4] [--models mlp,zoo] [--rounds 20]

Models are executor_bench's (``mlp``: Linear 512-1024-1024-512 with bias, batch 64; ``zoo``: tiny BERT-large,
batch 8), SGD, MSE against zeros; DDP trains the same torch module on the rank's shard.  In one launch per
(world, model) every rank builds DDP and one executor Trainer per variant:

* ``default``: what ``unity-pcg run`` does (gradients as views of the bucket buffers, DDP's bucket
  assignment, overlap with backward from ``OVERLAP_MIN_BYTES`` of gradients on CPU);
* ``copy``: gradients copied into the flat bucket and back (``grad_views=False``, the previous executor);
* ``no-overlap`` / ``overlap``: buckets launched after backward / from gradient hooks during backward.

They run interleaved in rounds (each timing ``--iters`` steps of every variant after a barrier, the order
reversed every other round), so a ratio is measured under the same load.  Reported per variant: rank 0's
median wall time and CPU time (process time of all its threads: the work done, less sensitive to the
host's load) per step, and the throughput ratio DDP time / variant time as the median over rounds.
``torch.get_num_threads()`` is the same (``--threads``, default 1) for every variant and DDP.
Writes benchmarks/results/executor_dp_vs_ddp.json and .md.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

VARIANTS = {"default": {}, "copy": {"grad_views": False}, "no-overlap": {"overlap": False},
            "overlap": {"overlap": True}}


def _worker(rank, world, port, model, variants, args, q):
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        from benchmarks import executor_bench as B
        from unity_pcg.executor.train import Trainer
        from unity_pcg.machine import local
        from unity_pcg.onnx_import import load_onnx
        from unity_pcg.plan import Plan, file_sha256
        from unity_pcg.search.baselines import data_parallel
        from unity_pcg.search.cost import CostModel
        from unity_pcg.search.mapping import MachineMapper
        path = B.export_model(model)
        g = data_parallel(load_onnx(path), world)
        machine = local(1, world)
        plan = Plan(path, file_sha256(path), machine, g,
                    dict(MachineMapper(CostModel(machine, optimizer="sgd")).optimize(g).views), {})
        x, _ = B._feeds(model, world, rank)
        name = next(iter(n.a["name"] for n in plan.pcg.sources("Input")))
        zeros = torch.zeros(plan.pcg.shape(tuple(plan.pcg.outputs[0])).sizes)
        steps, info = {"ddp": B._ddp_step({"model": model}, rank, world)}, {}
        for v in variants:
            tr = Trainer(plan, path, rank=rank, world=world, optimizer="sgd", lr=B.LR, seed=0, **VARIANTS[v])
            steps[v] = (lambda tr=tr: tr.step({name: x}, zeros))
            info[v] = {"overlap": tr.overlap, "buckets_bytes": [b["bytes"] for b in tr._buckets],
                       "grad_views": len(tr._view_params)}
        for f in steps.values():
            for _ in range(3):
                f()
        wall = {k: [] for k in steps}
        cpu = {k: [] for k in steps}
        order = list(steps)
        for r in range(args["rounds"]):
            for k in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(args["iters"]):
                    steps[k]()
                wall[k].append((time.perf_counter() - t0) / args["iters"])
                cpu[k].append((time.process_time() - c0) / args["iters"])
        if rank == 0:
            q.put({"wall": wall, "cpu": cpu, "info": info, "threads": torch.get_num_threads()})
    finally:
        dist.destroy_process_group()


def measure(world: int, model: str, variants: list, args: dict) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    load0 = os.getloadavg()[0]
    procs = [ctx.Process(target=_worker, args=(r, world, port, model, variants, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join()
    wall, cpu = res["wall"], res["cpu"]
    out = {"world": world, "model": model, "threads_per_rank": res["threads"], "loadavg_before": load0,
           "loadavg_after": os.getloadavg()[0], "ddp_ms": statistics.median(wall["ddp"]) * 1e3,
           "ddp_cpu_ms": statistics.median(cpu["ddp"]) * 1e3, "variants": {}}
    for v in variants:
        ratios = sorted(d / e for d, e in zip(wall["ddp"], wall[v]))
        n = len(ratios)
        out["variants"][v] = {**res["info"][v], "wall_ms": statistics.median(wall[v]) * 1e3,
                              "cpu_ms": statistics.median(cpu[v]) * 1e3,
                              "ratio": statistics.median(ratios),
                              "ratio_quartiles": [ratios[n // 4], ratios[(3 * n) // 4]],
                              "cpu_ratio": statistics.median(d / e for d, e in zip(cpu["ddp"], cpu[v]))}
    return out


def write_markdown(path: str, res: dict) -> None:
    L = ["# Executor data-parallel plan against torch DDP, with executor variants", "",
         f"Command: `{res['command']}` ({res['seconds']:.0f} s; {res['cores']} cores; commit {res['git_head']}; "
         f"1-min load average {res['loadavg_start']:.1f} at the start, {res['loadavg_end']:.1f} at the end)", "",
         "Ratio = DDP step time / variant step time (median over interleaved rounds; quartiles over rounds); "
         "CPU = rank 0's process time per step (all its threads). Target for `default`: ratio >= 0.95.", "",
         "| model | P | variant | grads as views | overlap | buckets (MiB) | ms | DDP ms | ratio | quartiles "
         "| CPU ms | DDP CPU ms | CPU ratio |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in res["measurements"]:
        for v, r in m["variants"].items():
            L.append(f"| {m['model']} | {m['world']} | {v} | {r['grad_views']} | {r['overlap']} | "
                     + ", ".join(f"{b / 2 ** 20:.2f}" for b in r["buckets_bytes"])
                     + f" | {r['wall_ms']:.2f} | {m['ddp_ms']:.2f} | {r['ratio']:.2f} | "
                     f"{r['ratio_quartiles'][0]:.2f}-{r['ratio_quartiles'][1]:.2f} | {r['cpu_ms']:.2f} | "
                     f"{m['ddp_cpu_ms']:.2f} | {r['cpu_ratio']:.2f} |")
    L += ["", "Grads as views: parameters whose `.grad` is a view of a bucket buffer (no copy into the bucket and "
          "back). Threads per rank: " + ", ".join(sorted({str(m['threads_per_rank']) for m in res['measurements']}))
          + " (the same for DDP and every variant)."]
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--models", default="mlp,zoo")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS, "executor_dp_vs_ddp.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "executor_dp_vs_ddp.md"))
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    from benchmarks import executor_bench as B
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    args = {"rounds": a.rounds, "iters": a.iters, "threads": a.threads}
    ms = []
    for model in a.models.split(","):
        B.export_model(model)
        for w in (int(x) for x in a.world.split(",")):
            m = measure(w, model, variants, args)
            print(json.dumps({"model": model, "world": w, "ddp_ms": round(m["ddp_ms"], 2),
                              **{v: round(r["ratio"], 3) for v, r in m["variants"].items()}}), flush=True)
            ms.append(m)
    prov = B._provenance()
    command = "python benchmarks/executor_dp_vs_ddp.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = {"command": command.strip(), "seconds": time.perf_counter() - t0, "cores": os.cpu_count(),
           "loadavg_start": load0, "loadavg_end": os.getloadavg()[0], "git_head": prov["git_head"],
           "uncommitted": prov["uncommitted"], "torch": prov["torch"], "args": vars(a), "measurements": ms}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    if a.md:
        write_markdown(a.md, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
