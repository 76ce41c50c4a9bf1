"""What the DTensor lowering costs: step time of the same plan with its redistributions on DTensor /
DeviceMesh and with the lowering's torch.distributed collectives (``UNITY_PCG_DTENSOR=0``), local gloo
processes.  Two DTensor paths: the default (DTensor's ``redistribute_local_tensor`` -- its transform
planner and collectives -- in one autograd node, the DTensorSpecs built once) and ``UNITY_PCG_DTENSOR=api``
(``DTensor.from_local(...).redistribute(...).to_local(...)`` per movement).

Cases (models of ``benchmarks/executor_bench.py``; SGD, MSE against zero targets):

* ``ffn`` (bias-free Linear 512->2048, ReLU, Linear 2048->512; batch 64): the Megatron pair ending in an
  AllReduce of the partial sums (input replicated, first weight column-split, second row-split): one
  all-reduce forward; the loss on the AllReduce's copies (backward: no message);
* ``ffn`` with the reduction into batch shards instead (Reduce + Partition of the partial sums, a
  reduce-scatter; the all-gather back in the backward);
* ``block`` (Transformer block: 4 heads, h 256, FFN 1024, batch 8 x seq 32):
  ``search.baselines.build_strategy(g, "megatron", P)`` (Megatron attention and FFN pairs: two AllReduces
  of partial sums, the last one read by the loss).

The three variants of a case are built in the same processes (three Trainers) and timed interleaved:
``--rounds`` rounds, each timing ``--iters`` steps of every (case, variant) after a barrier, the order reversed every
other round; a variant's time is the median over rounds of rank 0's mean step time, the overhead ratio is
the median over rounds of (DTensor time / c10d time) of the adjacent pair.  A micro-benchmark of one
redistribution (the FFN's all-reduce, forward + backward) against the same torch.distributed all-reduce
pair says where a difference comes from.

Usage:  .venv/bin/python benchmarks/executor_dtensor_overhead.py [--procs 2,4] [--rounds 7] [--iters 5]
Writes benchmarks/results/executor_dtensor_overhead.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LR = 1e-3


def plan_cases(procs: int) -> list[dict]:
    """(name, model kind, plan JSON) of every case on ``procs`` processes."""
    from benchmarks.executor_bench import export_model
    from tests.executor.dist_helpers import make_plan, rebuild
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.baselines import build_strategy
    out = []
    ffn, block = export_model("ffn"), export_model("block")
    gf, gb = load_onnx(ffn), load_onnx(block)
    w = [n.a["name"] for n in gf.sources("Weight")]
    x = next(n.a["name"] for n in gf.sources("Input"))
    mm = [n.id for n in gf.nodes() if n.op in ("Linear", "MatMul")]
    pair = {x: [("Replicate", procs)], w[0]: [("Partition", 1, procs)], w[1]: [("Partition", 0, procs)]}
    out.append({"name": "megatron pair + AllReduce", "model": "ffn",
                "plan": make_plan(rebuild(gf, pair, after={mm[-1]: [("AllReduce", procs)]}), ffn, procs)})
    out.append({"name": "megatron pair + Reduce/Partition", "model": "ffn",
                "plan": make_plan(rebuild(gf, pair, after={mm[-1]: [("Reduce", procs), ("Partition", 0, procs)]}),
                                  ffn, procs)})
    out.append({"name": "megatron strategy", "model": "block",
                "plan": make_plan(build_strategy(gb, "megatron", procs), block, procs)})
    for c in out:
        c["plan"] = c["plan"].to_json()
    return out


def _rank(rank: int, world: int, port: int, spec: dict, q) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(spec["threads"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            q.put((rank, "ok", _measure(rank, world, spec)))
        finally:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put((rank, "err", traceback.format_exc()))


def _measure(rank: int, world: int, spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from benchmarks.executor_bench import torch_module
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor import dtensor as dt
    from unity_pcg.executor.train import Trainer
    steps, info = {}, {}
    for c in spec["cases"]:
        plan = plan_mod.from_json(c["plan"])
        _, example = torch_module(c["model"])
        name = next(n.a["name"] for n in plan.pcg.sources("Input"))
        feeds = {name: example[0]}
        zeros = torch.zeros(plan.pcg.shape(tuple(plan.pcg.outputs[0])).sizes)
        for variant, env in (("dtensor", "1"), ("dtensor-api", "api"), ("c10d", "0")):
            os.environ["UNITY_PCG_DTENSOR"] = env
            t = Trainer(plan, plan.model_path, rank=rank, world=world, optimizer="sgd", lr=LR, seed=0)
            key = f"{c['name']}|{c['model']}|{variant}"
            steps[key] = (lambda t=t, f=feeds, z=zeros: t.step(f, z))
            before = sum(dt.CALLS.values())
            loss0 = steps[key]()
            info[key] = {"first_loss": loss0, "redistributions_per_step": sum(dt.CALLS.values()) - before,
                         "kinds": sorted(rd.kind for _, rd in t.low.redistributions()),
                         "fused_operators": len(t.low.fused)}
            for _ in range(spec["warmup"]):
                steps[key]()
    os.environ.pop("UNITY_PCG_DTENSOR", None)
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}          # CPU seconds of the rank's process (all its threads) per step
    order = list(steps)
    for r in range(spec["rounds"]):
        for k in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(spec["iters"]):
                steps[k]()
            times[k].append((time.perf_counter() - t0) / spec["iters"])
            cpu[k].append((time.process_time() - c0) / spec["iters"])
    return {"times": times, "cpu": cpu, "info": info, "micro": _micro(rank, world, spec)}


def _micro(rank: int, world: int, spec: dict) -> dict:
    """One all-reduce of the FFN's output piece (64 x 512 float32), forward + backward: DTensor
    redistribution (from_local, redistribute, to_local, autograd) against torch.distributed's all_reduce
    in an autograd Function (the c10d lowering's path); and the parts of the DTensor call."""
    import torch
    import torch.distributed as dist
    from unity_pcg.executor.dtensor import MeshSpec, Redistribution
    from unity_pcg.executor.train import _AllReduce
    devs = tuple(range(world))
    pg = dist.new_group(list(devs))
    rd = Redistribution(MeshSpec((world,), devs), (("P",),), (("R",),), (64, 512), "all_reduce")
    x = torch.randn(64, 512, requires_grad=True)
    anchor = torch.zeros((), requires_grad=True)

    def group_of(d):
        return pg

    def f_dt():
        rd.run(x, rank, group_of, anchor, None, True, 1).sum().backward()

    def f_c10d():
        _AllReduce.apply(pg, anchor, x).sum().backward()

    rd_api = Redistribution(MeshSpec((world,), devs), (("P",),), (("R",),), (64, 512), "all_reduce", api=True)

    def f_api():
        rd_api.run(x, rank, group_of, anchor, None, True, 1).sum().backward()

    def f_dt_fwd():
        rd.run(x.detach(), rank, group_of, None, None, False, 1)

    def f_c10d_fwd():
        y = x.detach().clone()
        dist.all_reduce(y, group=pg)

    # a weight placement (Partition of a replicated value): the lowering's slice against DTensor's
    # Replicate -> Shard redistribution (its backward all-gathers the gradient: see executor/lower.py)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = DeviceMesh.from_group(pg, "cpu")
    w = torch.randn(512, 512, requires_grad=True)

    def f_slice():
        w.narrow(1, rank * (512 // world), 512 // world).sum().backward()

    def f_dt_slice():
        DTensor.from_local(w, mesh, (Replicate(),), run_check=False, shape=(512, 512), stride=(512, 1)) \
            .redistribute(mesh, (Shard(1),)).to_local().sum().backward()

    fns = {"dtensor fwd+bwd": f_dt, "dtensor-api fwd+bwd": f_api, "c10d fwd+bwd": f_c10d, "dtensor fwd": f_dt_fwd,
           "c10d fwd": f_c10d_fwd,
           "weight slice fwd+bwd": f_slice, "dtensor Replicate->Shard fwd+bwd": f_dt_slice}
    res = {k: [] for k in fns}
    for r in range(spec["rounds"]):
        for k, f in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            res[k].append((time.perf_counter() - t0) / 20)
    return {k: statistics.median(v) for k, v in res.items()}


def run(procs: int, spec: dict) -> dict:
    import multiprocessing as mp
    import queue
    import socket
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [ctx.Process(target=_rank, args=(r, procs, port, spec, q), daemon=True) for r in range(procs)]
    for p in ps:
        p.start()
    got, deadline = {}, time.monotonic() + 1500
    while len(got) < procs:
        try:
            r, status, val = q.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in ps):
                raise RuntimeError("a rank failed or timed out")
            continue
        if status != "ok":
            raise RuntimeError(f"rank {r}: {val}")
        got[r] = val
    for p in ps:
        p.join(timeout=10)
    r0 = got[0]
    rows = []
    keys = list(r0["times"])
    for k in keys:
        name, model, variant = k.split("|")
        if variant == "c10d":
            continue
        other = f"{name}|{model}|c10d"
        ratios = [a / b for a, b in zip(r0["times"][k], r0["times"][other])]
        cpu_ratios = [a / b for a, b in zip(r0["cpu"][k], r0["cpu"][other])]
        rows.append({"case": name, "model": model, "procs": procs, "variant": variant,
                     "dtensor_step_s": statistics.median(r0["times"][k]),
                     "c10d_step_s": statistics.median(r0["times"][other]),
                     "ratio_dtensor_over_c10d": statistics.median(ratios),
                     "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
                     "dtensor_cpu_s": statistics.median(r0["cpu"][k]), "c10d_cpu_s": statistics.median(r0["cpu"][other]),
                     "cpu_ratio_dtensor_over_c10d": statistics.median(cpu_ratios),
                     "redistribution_kinds": r0["info"][k]["kinds"],
                     "redistributions_per_step": r0["info"][k]["redistributions_per_step"],
                     "fused_operators": r0["info"][k]["fused_operators"],
                     "first_loss": [r0["info"][k]["first_loss"], r0["info"][other]["first_loss"]]})
    return {"procs": procs, "rows": rows, "micro_s": r0["micro"]}


def write_markdown(path: str, res: dict) -> None:
    lines = ["# DTensor lowering overhead (executor_dtensor_overhead.py)", "",
             f"Command: `{res['command']}`; torch {res['torch']}, {res['threads']} torch thread(s) per rank, "
             f"{res['rounds']} rounds x {res['iters']} steps, host with {res['cpus']} cores (shared).", "",
             "Step time of the same plan with its movements as DTensor redistributions -- `dtensor` (the default: "
             "DTensor's `redistribute_local_tensor` in one autograd node, specs cached) and `dtensor-api` "
             "(`UNITY_PCG_DTENSOR=api`: `DTensor.from_local(...).redistribute(...).to_local(...)`) -- and with the "
             "lowering's torch.distributed collectives (`UNITY_PCG_DTENSOR=0`); ratio = DTensor / c10d, the "
             "median over rounds of adjacent pairs (1.00 = no overhead).", "",
             "| procs | model | plan | redistributions (kinds) | DTensor path | DTensor step | c10d step | "
             "ratio (quartiles) | CPU per step DTensor / c10d | CPU ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        for row in r["rows"]:
            q = row["ratio_quartiles"]
            qs = f" ({q[0]:.2f}-{q[-1]:.2f})" if len(q) > 1 else ""
            lines.append(f"| {row['procs']} | {row['model']} | {row['case']} | {row['redistributions_per_step']} "
                         f"({', '.join(row['redistribution_kinds']) or '-'}) | {row['variant']} | "
                         f"{row['dtensor_step_s'] * 1e3:.2f} ms | "
                         f"{row['c10d_step_s'] * 1e3:.2f} ms | {row['ratio_dtensor_over_c10d']:.2f}{qs} | "
                         f"{row['dtensor_cpu_s'] * 1e3:.2f} / {row['c10d_cpu_s'] * 1e3:.2f} ms | "
                         f"{row['cpu_ratio_dtensor_over_c10d']:.2f} |")
    lines += ["", "One all-reduce of a 64 x 512 float32 piece (rank 0, median of rounds of 20 calls):", "",
              "| procs | DTensor fwd+bwd | DTensor API fwd+bwd | c10d fwd+bwd | DTensor fwd | c10d fwd | "
              "weight slice fwd+bwd | DTensor Replicate->Shard fwd+bwd |", "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        m = r["micro_s"]
        lines.append(f"| {r['procs']} | {m['dtensor fwd+bwd'] * 1e3:.3f} ms | {m['dtensor-api fwd+bwd'] * 1e3:.3f} ms | "
                     f"{m['c10d fwd+bwd'] * 1e3:.3f} ms | "
                     f"{m['dtensor fwd'] * 1e3:.3f} ms | {m['c10d fwd'] * 1e3:.3f} ms | "
                     f"{m['weight slice fwd+bwd'] * 1e3:.3f} ms | {m['dtensor Replicate->Shard fwd+bwd'] * 1e3:.3f} ms |")
    lines += ["", "(weight slice: the lowering's placement of a 512 x 512 weight column-split over the ranks, a "
              "narrow; DTensor Replicate->Shard: the same as a redistribution, whose backward all-gathers the "
              "gradient.)"]
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS, "executor_dtensor_overhead.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "executor_dtensor_overhead.md"))
    a = ap.parse_args(argv)
    import torch
    res = {"command": "python benchmarks/executor_dtensor_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__, "threads": a.threads, "rounds": a.rounds, "iters": a.iters,
           "cpus": os.cpu_count(), "runs": []}
    for p in [int(x) for x in a.procs.split(",")]:
        spec = {"cases": plan_cases(p), "rounds": a.rounds, "iters": a.iters, "warmup": a.warmup,
                "threads": a.threads}
        r = run(p, spec)
        res["runs"].append(r)
        for row in r["rows"]:
            print(f"P={p} {row['model']:6s} {row['case']:34s} {row['variant']:12s} {row['dtensor_step_s'] * 1e3:7.2f} ms  "
                  f"c10d {row['c10d_step_s'] * 1e3:7.2f} ms  ratio {row['ratio_dtensor_over_c10d']:.3f}  "
                  f"cpu ratio {row['cpu_ratio_dtensor_over_c10d']:.3f}  "
                  f"{row['redistributions_per_step']} x {row['redistribution_kinds']}", flush=True)
        print(f"P={p} micro {r['micro_s']}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(a.md, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
