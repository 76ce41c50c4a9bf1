"""Data-parallel plan (executor) against torch DDP on the same model, local gloo processes.

    .venv/bin/python benchmarks/executor_dp_vs_ddp.py --world 2 --hidden 512 --layers 4 --batch 64

Both run in the same processes, interleaved in windows (DDP window, plan window, ...) so the ratio is
measured in one run under the same load; reported: median step time of each after warm-up and the
throughput ratio DDP time / plan time (1.0 = as fast as DDP; the target is at least 0.95) as the median
over adjacent window pairs (robust to the load of a shared machine drifting during the run).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(hidden: int, layers: int):
    import torch
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(hidden, hidden))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def _worker(rank, world, port, args, path, q):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unity_pcg.executor.train import Trainer
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.machine import local
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.plan import Plan, file_sha256
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    g = data_parallel(load_onnx(path), world)
    machine = local(1, world)
    views = MachineMapper(CostModel(machine, optimizer="sgd")).optimize(g).views
    plan = Plan(path, file_sha256(path), machine, g, views, {})
    tr = Trainer(plan, path, rank=rank, world=world, optimizer="sgd", lr=1e-3,
                 first_bucket_bytes=int(args.first_bucket_mb * 2 ** 20) if args.first_bucket_mb else None,
                 overlap=args.overlap)
    torch.manual_seed(0)
    m = _model(args.hidden, args.layers)
    ddp = DDP(m)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.hidden)).astype(np.float32)
    feeds = {"x": x}
    shard = torch.as_tensor(x[rank * args.batch // world:(rank + 1) * args.batch // world])

    def ddp_step():
        opt.zero_grad(set_to_none=True)
        loss = ddp(shard).mean() / world
        loss.backward()
        opt.step()

    def plan_step():
        tr.step(feeds)

    times = {"ddp": [], "plan": [], "ratios": []}
    for _ in range(3):                  # warm-up
        ddp_step()
        plan_step()
    for w in range(args.windows):
        block = {}
        for name, fn in (("ddp", ddp_step), ("plan", plan_step)) if w % 2 == 0 else (("plan", plan_step), ("ddp", ddp_step)):
            ts = []
            for i in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            times[name].extend(ts)
            block[name] = statistics.median(ts)
        times["ratios"].append(block["ddp"] / block["plan"])   # adjacent windows: the same load
    dist.destroy_process_group()
    if rank == 0:
        q.put(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--first-bucket-mb", type=float, default=None,
                    help="size of the plan's first gradient bucket (default: the executor's choice)")
    ap.add_argument("--overlap", action="store_true", default=None,
                    help="launch buckets from gradient hooks during backward (default: on GPUs only)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    import torch
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "mlp.onnx")
    torch.manual_seed(0)
    m = _model(args.hidden, args.layers).eval()
    torch.onnx.export(m, (torch.randn(args.batch, args.hidden),), path, input_names=["x"], output_names=["y"],
                      dynamo=False, do_constant_folding=False)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, path, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    times = q.get(timeout=1200)
    for p in procs:
        p.join()
    d, p_ = statistics.median(times["ddp"]), statistics.median(times["plan"])
    out = {"world": args.world, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
           "ddp_step_ms": round(d * 1e3, 3), "plan_step_ms": round(p_ * 1e3, 3),
           "throughput_ratio": round(statistics.median(times["ratios"]), 3),
           "ratio_of_medians": round(d / p_, 3), "windows": args.windows, "samples": len(times["plan"])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
