"""Executor benchmarks (issue 8, point 8): the executor against PyTorch's own parallel training, and the
calibrated cost model's predicted against measured iteration time of the executor's plans.

For every P in ``--procs`` (default 2 and 4 local gloo processes):

1. the local machine is calibrated for P concurrent processes right before the measurement
   (``calibration.local.calibrate(worlds=(P,))``, ``quick=True`` under ``--quick``: generic micro-benchmarks,
   never the models below), and every plan is priced and mapped on it (``MachineMapper``, SGD);
2. ``--runs`` launches, each of P ranks started by torch's elastic launch API (the mechanism of
   ``unity-pcg run``: a c10d rendezvous on a free local port, ``cores // P`` torch threads per rank, gloo),
   train every case of the table below in the same processes, interleaved: ``--rounds`` rounds, each
   timing ``--iters`` steps of every case (each executor plan next to its torch counterpart; the order
   reversed every other round) after a barrier.  A case's time in a run is the median over rounds of rank
   0's mean step time (the report: median over runs); a throughput ratio is taken per round between the
   two adjacent cases (the host is shared: its load drifts within seconds), the report gives the median
   over all rounds of all runs, each run's median and the quartiles.

Cases (one global batch per model, the same for both sides; SGD, lr 1e-3; loss = mean square of the output,
(the executor's MSE against zero targets); the first step's loss of both sides is recorded as a check that
they train the same model):

* ``mlp`` (3 Linear layers 512-1024-1024-512 with bias, ReLU; batch 64): the executor's data-parallel plan
  (``search.baselines.data_parallel``) against ``DistributedDataParallel`` (batch 64/P per rank);
* zoo ``bert_large`` tiny (batch 8): the same pair;
* ``ffn`` (bias-free Linear 512->2048, ReLU, Linear 2048->512; batch 64): the Megatron column->row plan
  (proven rule ``megatron_mlp_column_row`` of degree P) against ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel``; and a reduction-parallel plan (rule ``megatron_row_linear`` on
  the second Linear: contraction dim split, partial sums reduced) measured for the prediction table;
* ``block`` (Transformer block: bias-free Q/K/V/O with 4 heads, LayerNorm, FFN 256->1024->256; batch 8 x
  seq 32): ``search.baselines.build_strategy(g, "megatron", P)`` against the same ``parallelize_module``
  (Colwise Q/K/V and FFN-in, Rowwise O and FFN-out); at P=4 also the hybrid Megatron plan of tensor degree 2
  x data degree 2 (``devices_per_node=2``), prediction table only.

Predicted vs measured: every executor plan's predicted iteration time (the mapper's cost on the machine
calibrated for its P) against its measured step time; median absolute relative error and Spearman rank
correlation over all plans; and, for comparison, the same plans priced on the same calibration as
independent devices (``shared_cores=0``: the cost model before it modelled local processes sharing cores).

Usage:  .venv/bin/python benchmarks/executor_bench.py [--quick] [--procs 2,4] [--runs 3] [--rounds 7]
        [--iters 3] [--out F.json] [--md F.md]
Writes benchmarks/results/executor_bench.json and executor_bench.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
CACHE = os.path.join(ROOT, "benchmarks", ".cache", "executor_bench")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LR = 1e-3

# model configurations (global batch)
MLP = dict(d_in=512, width=1024, d_out=512, batch=64)
FFN = dict(h=512, ffn=2048, batch=64)
BLOCK = dict(h=256, heads=4, ffn=1024, seq=32, batch=8)
ZOO = dict(name="bert_large", batch=8)


# --- torch modules (built the same way in the main process, for ONNX, and in the ranks) ----------------------

def torch_module(kind: str):
    """The torch module of model ``kind`` with seeded weights (the ONNX export holds the same)."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    if kind == "mlp":
        c = MLP

        class DenseMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.l1 = nn.Linear(c["d_in"], c["width"])
                self.l2 = nn.Linear(c["width"], c["width"])
                self.l3 = nn.Linear(c["width"], c["d_out"])

            def forward(self, x):
                return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
        return DenseMLP(), (torch.randn(c["batch"], c["d_in"]),)
    if kind == "ffn":
        c = FFN

        class FFNPair(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(c["h"], c["ffn"], bias=False)
                self.fc2 = nn.Linear(c["ffn"], c["h"], bias=False)

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x)))
        return FFNPair(), (torch.randn(c["batch"], c["h"]),)
    if kind == "block":
        c = BLOCK

        class Block(nn.Module):
            """Post-LN Transformer block; the head count is inferred from the local width (-1), so the
            same forward runs on a rank's column shard of Q/K/V under tensor parallelism."""

            def __init__(self):
                super().__init__()
                h = c["h"]
                self.hd = h // c["heads"]
                self.scale = 1.0 / math.sqrt(self.hd)
                self.q = nn.Linear(h, h, bias=False)
                self.k = nn.Linear(h, h, bias=False)
                self.v = nn.Linear(h, h, bias=False)
                self.o = nn.Linear(h, h, bias=False)
                self.ln1 = nn.LayerNorm(h)
                self.fc1 = nn.Linear(h, c["ffn"], bias=False)
                self.fc2 = nn.Linear(c["ffn"], h, bias=False)
                self.ln2 = nn.LayerNorm(h)

            def forward(self, x):
                b, s = c["batch"], c["seq"]
                q = self.q(x).reshape(b, s, -1, self.hd).transpose(1, 2)
                k = self.k(x).reshape(b, s, -1, self.hd).permute(0, 2, 3, 1)
                v = self.v(x).reshape(b, s, -1, self.hd).transpose(1, 2)
                p = torch.softmax(torch.matmul(q, k) * self.scale, dim=-1)
                y = torch.matmul(p, v).transpose(1, 2).reshape(b, s, -1)
                x = self.ln1(x + self.o(y))
                return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))
        return Block(), (torch.randn(c["batch"], c["seq"], c["h"]),)
    if kind == "zoo":
        from unity_pcg import zoo
        module, inputs, _, _ = zoo.build(ZOO["name"], "tiny", batch=ZOO["batch"])
        return module, tuple(inputs)
    raise ValueError(kind)


def export_model(kind: str) -> str:
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{kind}.onnx")
    if os.path.exists(path):
        return path
    if kind == "zoo":
        from unity_pcg import zoo
        return zoo.export(ZOO["name"], path, size="tiny", batch=ZOO["batch"], seed=0)
    import torch
    module, example = torch_module(kind)
    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, example, path, input_names=["x"], output_names=["out"], dynamo=False,
                          opset_version=17, do_constant_folding=False)
    return path


# --- plans -------------------------------------------------------------------------------------------------

def apply_rule(g, name: str, degree: int, index: int = 0):
    """``g`` with proven rule ``name`` of the shipped cache applied at its ``index``-th valid match."""
    from unity_pcg.substitutions import cache
    from unity_pcg.substitutions.apply import try_apply
    from unity_pcg.substitutions.match import find_matches
    rule = cache.load().by_name()[name]
    k = 0
    for m in find_matches(rule, g, degrees=(degree,)):
        out = try_apply(g, m)
        if out is None:
            continue
        if k == index:
            return out
        k += 1
    raise RuntimeError(f"rule {name} has no valid match")


def plan_graphs(procs: int, models: dict) -> list[dict]:
    """The executor plans measured on ``procs`` processes: name, model kind, PCG and what it is compared to."""
    from unity_pcg.search.baselines import build_strategy, data_parallel
    from unity_pcg.onnx_import import load_onnx
    gs = {k: load_onnx(p) for k, p in models.items()}
    fused = apply_rule(gs["ffn"], "linear_relu_fusion", procs)      # Linear(activation=relu) -> Linear
    out = [
        {"name": "dp", "model": "mlp", "pcg": data_parallel(gs["mlp"], procs), "vs": "ddp"},
        {"name": "dp", "model": "zoo", "pcg": data_parallel(gs["zoo"], procs), "vs": "ddp"},
        {"name": "megatron", "model": "ffn", "pcg": apply_rule(fused, "megatron_mlp_column_row", procs),
         "vs": "tp"},
        {"name": "reduction", "model": "ffn", "pcg": apply_rule(fused, "megatron_row_linear", procs),
         "vs": None},
        {"name": "megatron", "model": "block", "pcg": build_strategy(gs["block"], "megatron", procs), "vs": "tp"},
    ]
    if procs >= 4 and procs % 2 == 0:
        out.append({"name": "megatron tp2 x dp" + str(procs // 2), "model": "block",
                    "pcg": build_strategy(gs["block"], "megatron", procs, devices_per_node=2), "vs": None})
    return out


def make_plans(procs: int, machine_path: str, models: dict) -> list[dict]:
    """Map every plan on the calibrated machine; returns JSON-ready cases with the prediction."""
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.machine import parse_machine
    from unity_pcg.plan import Plan, file_sha256
    import dataclasses
    m = parse_machine(f"{machine_path}:1x{procs}")
    # the same calibration priced as independent devices (no shared cores): the cost model before
    # it knew that local processes share one pool of cores, for comparison in the report
    indep = MachineMapper(CostModel(dataclasses.replace(m, shared_cores=0), optimizer="sgd"))
    # the same views priced with the gradient sync of torch DDP (sync_model "ddp": the DDP-calibrated
    # per-iteration, per-tensor and per-compute terms), as the cost model priced executor plans before
    # it priced the executor's own buckets: for comparison in the report, not the prediction
    ddp_sync = MachineMapper(CostModel(m, optimizer="sgd", sync_model="ddp"))
    cases = []
    for c in plan_graphs(procs, models):
        r = MachineMapper(CostModel(m, optimizer="sgd")).optimize(c["pcg"])
        if not r.feasible:
            raise RuntimeError(f"plan {c['name']} of {c['model']} is infeasible: {r.reason}")
        path = models[c["model"]]
        plan = Plan(path, file_sha256(path), m, c["pcg"], dict(r.views), r.to_json())
        devs = sorted({d for v in r.views.values() for d in v.devices()})
        cases.append({"id": f"exec:{c['name']}:{c['model']}", "kind": "exec", "name": c["name"],
                      "model": c["model"], "plan": plan.to_json(), "vs": c["vs"], "predicted_s": r.cost,
                      "breakdown": r.to_json().get("breakdown"), "devices_used": len(devs),
                      "predicted_independent_s": indep.optimize(c["pcg"]).cost,
                      # the same views re-priced (the plan measured), not re-mapped
                      "predicted_ddp_sync_s": ddp_sync.evaluate(c["pcg"], r.views).cost,
                      "_pcg": c["pcg"], "_views": dict(r.views)})
    return cases


def insitu_machine(machine_path: str, procs: int, runs: list, out_path: str) -> str:
    """The calibration of ``machine_path`` with world ``procs``'s kernel and collective tables replaced by
    those measured inside the launches, interleaved with the step rounds (``--insitu``): per kernel and
    collective point the median over the launches of each launch's median.  Only the generic
    micro-benchmarks of ``calibration.local`` (never the models) are measured there."""
    from unity_pcg.calibration import local as cal
    with open(machine_path) as f:
        obj = json.load(f)
    kern = {}
    for r in runs:
        for k, rec in r["insitu"]["kernels"].items():
            for d, v in rec.items():
                kern.setdefault(k, {}).setdefault(d, []).append(v)
    kern = {k: {d: statistics.median(v) for d, v in rec.items()} for k, rec in kern.items()}
    _, tables = cal.kernel_tables(False, kern)
    coll: dict = {}
    for r in runs:
        for kind, d in r["insitu"]["collectives"].items():
            for g, pts in d.items():
                for x, t in pts:
                    coll.setdefault(kind, {}).setdefault(g, {}).setdefault(x, []).append(t)
    from unity_pcg.calibration.gpu import make_table
    coll = {kind: {g: make_table([(x, statistics.median(v)) for x, v in pts.items()]) for g, pts in d.items()}
            for kind, d in coll.items()}
    ccpu: dict = {}
    for r in runs:
        for kind, d in r["insitu"]["collectives_cpu"].items():
            for g, pts in d.items():
                for x, t in pts:
                    ccpu.setdefault(kind, {}).setdefault(g, {}).setdefault(x, []).append(t)
    ccpu = {kind: {g: make_table([(x, statistics.mean(v)) for x, v in pts.items()]) for g, pts in d.items()}
            for kind, d in ccpu.items()}
    wait = {k: statistics.median(r["insitu"]["wait"][k] for r in runs) for k in ("free", "synced", "alone")}
    cont = statistics.median(r["insitu"]["contention"] for r in runs)
    w = obj["meta"]["worlds"][str(procs)]
    w["device"]["kernel_tables"] = tables
    w["collectives"] = coll
    w["collectives_cpu"] = ccpu
    w["contention"] = cont
    w["sync"] = dict(w.get("sync") or {}, executor_wait=wait,
                     executor_slowdown=cal.sync_slowdown(wait["free"], wait["synced"], wait["alone"]))
    if procs > (obj.get("shared_cores") or os.cpu_count() or 1):
        w["sync"]["executor_slowdown_cpu"] = cal.sync_slowdown_cpu(wait, ccpu, procs, cont)
    w["insitu"] = {"kernels": kern}
    if obj["meta"].get("device_world") == procs:
        obj["device"]["kernel_tables"] = tables
        obj["meta"]["sync"] = w["sync"]
    with open(out_path, "w") as f:
        json.dump(obj, f)
    return out_path


def wall_collectives(m):
    """``m`` without its collectives' CPU tables: processes that outnumber the cores then price collectives
    by their measured wall time and compute by ``sync.executor_slowdown`` (the cost model before
    ``MachineSpec.collective_cpu_time``), for comparison in the report."""
    import dataclasses
    meta = dict(m.meta)
    worlds = {k: {kk: vv for kk, vv in dict(v).items() if kk != "collectives_cpu"}
              for k, v in dict(meta.get("worlds") or {}).items()}
    if worlds:
        meta["worlds"] = worlds
    return dataclasses.replace(m, meta=meta)


def reprice(cases: list, machine_path: str, procs: int, wall: bool = False) -> dict:
    """Each case's measured views priced on ``machine_path`` (``MachineMapper.evaluate``): {id: seconds};
    ``wall``: with collectives priced by their wall time (:func:`wall_collectives`)."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    m = parse_machine(f"{machine_path}:1x{procs}")
    if wall:
        m = wall_collectives(m)
    mm = MachineMapper(CostModel(m, optimizer="sgd"))
    return {c["id"]: mm.evaluate(c["_pcg"], c["_views"]).cost for c in cases}


# --- one rank of a launch ------------------------------------------------------------------------------------

def _feeds(kind: str, world: int, rank: int):
    """The global batch (for the executor, which slices its pieces) and the rank's part of it (DDP)."""
    import torch
    _, example = torch_module(kind)
    x = example[0]
    return x, x.chunk(world, 0)[rank].contiguous()


def _exec_step(case: dict, rank: int, world: int):
    import torch
    from unity_pcg.executor.train import Trainer
    from unity_pcg import plan as plan_mod
    plan = plan_mod.from_json(case["plan"])
    t = Trainer(plan, plan.model_path, rank=rank, world=world, optimizer="sgd", lr=LR, seed=0)
    x, _ = _feeds(case["model"], world, rank)
    name = next(iter(n.a["name"] for n in plan.pcg.sources("Input")))
    feeds = {name: x}
    zeros = torch.zeros(plan.pcg.shape(tuple(plan.pcg.outputs[0])).sizes)
    return lambda: t.step(feeds, zeros)


def _ddp_step(case: dict, rank: int, world: int):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    module, _ = torch_module(case["model"])
    module.train()
    ddp = DDP(module)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    _, xl = _feeds(case["model"], world, rank)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = ddp(xl).square().mean()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _tp_step(case: dict, rank: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    module, _ = torch_module(case["model"])
    module.train()
    mesh = init_device_mesh("cpu", (world,))
    if case["model"] == "ffn":
        layout = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    else:
        layout = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                  "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    parallelize_module(module, mesh, layout)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    x, _ = _feeds(case["model"], world, 0)          # every rank holds the whole (replicated) batch

    def step():
        opt.zero_grad(set_to_none=True)
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def rank_main(spec: dict) -> dict:
    """One rank: build every case, then time them interleaved (see module docstring)."""
    import torch
    import torch.distributed as dist
    import warnings
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    try:
        steps, first = {}, {}
        for c in spec["cases"]:
            mk = {"exec": _exec_step, "ddp": _ddp_step, "tp": _tp_step}[c["kind"]]
            try:
                steps[c["id"]] = mk(c, rank, world)
            except Exception as e:
                raise RuntimeError(f"case {c['id']}: {type(e).__name__}: {e}") from e
            loss = steps[c["id"]]()           # the first step's loss (before any update): same model?
            if c["kind"] == "ddp":              # DDP's loss is the rank's own shard's: average it
                t = torch.tensor([loss], dtype=torch.float64)
                dist.all_reduce(t)
                loss = t.item() / world
            first[c["id"]] = loss
            for _ in range(spec["warmup"]):
                steps[c["id"]]()
        times = {cid: [] for cid in steps}
        cpu = {cid: [] for cid in steps}       # CPU seconds of the rank's process (all its threads) per step
        order = list(steps)
        insitu = spec.get("insitu")
        if insitu:       # the calibration's generic kernel and collective tables, measured between the rounds
            from unity_pcg.calibration import local as cal
            prepared = cal.prepare_kernels(False)
            cops = cal.prepare_collectives(world, rank, False)
            kern: dict = {}
            cts: dict = {}
            ccpu: dict = {}
            sw: dict = {}
            cont: list = []
        for r in range(spec["rounds"]):
            if insitu:
                dist.barrier()
                for key, rec in cal.measure_kernels(prepared, window=insitu["window"]).items():
                    mine = kern.setdefault(key, {"fwd": [], "bwd": []})
                    mine["fwd"] += rec["fwd"]
                    mine["bwd"] += rec["bwd"]
                cal.measure_collectives_round(cops, insitu["reps"], cts, ccpu)
                cal.measure_sync_wait(1, sw)
                dist.barrier()
                cal.measure_contention(1, ts=cont)
            for cid in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(spec["iters"]):
                    steps[cid]()
                times[cid].append((time.perf_counter() - t0) / spec["iters"])
                cpu[cid].append((time.process_time() - c0) / spec["iters"])
        out = {"rank": rank, "times": times, "cpu": cpu, "first_loss": first}
        if insitu:
            out["insitu"] = {"kernels": {k: {d: statistics.median(v[d]) for d in ("fwd", "bwd") if v[d]}
                                         for k, v in kern.items()},
                             "collectives": cal.collective_medians(cts),
                             "collectives_cpu": cal.collective_medians(ccpu, statistics.mean),
                             "contention": cal.contention_ratio(cont),
                             "wait": {k: statistics.median(v) for k, v in sw.items()}}
        return out
    finally:
        dist.barrier()
        dist.destroy_process_group()


def launch(spec: dict, procs: int) -> dict:
    """Run :func:`rank_main` on ``procs`` local ranks under torch's elastic launch API."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=procs, run_id=f"xbench-{uuid.uuid4().hex[:8]}",
                       rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                       logs_specs=DefaultLogsSpecs(log_dir=os.path.join(CACHE, "elastic")))
    res = elastic_launch(cfg, rank_main)(spec)
    out = dict(res[0])
    if "insitu" in out:     # kernels: the median over ranks; collectives: the slowest rank (calibration.local)
        from unity_pcg.calibration import local as cal
        out["insitu"] = {"kernels": cal._median_tree([res[r]["insitu"]["kernels"] for r in res]),
                         "collectives": cal.collective_tables([res[r]["insitu"]["collectives"] for r in res]),
                         "collectives_cpu": cal.collective_cpu_tables([res[r]["insitu"]["collectives_cpu"]
                                                                      for r in res]),
                         "contention": statistics.median(res[r]["insitu"]["contention"] for r in res),
                         "wait": cal._median_tree([res[r]["insitu"]["wait"] for r in res])}
    # CPU seconds per step summed over the ranks (the host's total work for one step), per round
    out["cpu_all"] = {cid: [sum(res[r]["cpu"][cid][i] for r in res) for i in range(len(v))]
                      for cid, v in res[0]["cpu"].items()}
    return out


# --- the benchmark ---------------------------------------------------------------------------------------------

def spearman(a: list, b: list) -> float:
    def ranks(v):
        idx = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(idx):
            j = i
            while j + 1 < len(idx) and v[idx[j + 1]] == v[idx[i]]:
                j += 1
            for k in range(i, j + 1):
                r[idx[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else float("nan")


def _quartiles(v: list) -> list:
    if len(v) < 2:
        return [v[0], v[0]] if v else []
    q = statistics.quantiles(v, n=4)
    return [q[0], q[2]]


def run_procs(procs: int, a, models: dict) -> dict:
    from unity_pcg.calibration.local import calibrate
    t0 = time.perf_counter()
    load_cal = os.getloadavg()[0]
    mpath = os.path.join(CACHE, f"local-{procs}.json")
    if a.machine:
        mpath = a.machine
    else:
        calibrate(quick=a.quick, worlds=(procs,), quiet=True).save(mpath)
    cal_s = time.perf_counter() - t0
    plans = make_plans(procs, mpath, models)
    cases = []
    for c in plans:          # each executor plan next to its torch counterpart: paired in time
        cases.append(c)
        if c["vs"]:
            cases.append({"id": f"{c['vs']}:{c['model']}", "kind": c["vs"], "model": c["model"]})
    spec = {"cases": [{k: v for k, v in c.items() if k in ("id", "kind", "model", "plan", "name")} for c in cases],
            "threads": max(1, (os.cpu_count() or 1) // procs), "rounds": a.rounds, "iters": a.iters,
            "warmup": 2, "insitu": {"window": 0.01, "reps": 2} if a.insitu else None}
    runs = []
    for i in range(a.runs):
        l0 = os.getloadavg()[0]
        t = time.perf_counter()
        res = launch(spec, procs)
        runs.append({"times": {cid: statistics.median(v) for cid, v in res["times"].items()},
                     "rounds": res["times"], "cpu_rounds": res["cpu"], "cpu_all_rounds": res["cpu_all"],
                     "loadavg_before": l0, "loadavg_after": os.getloadavg()[0],
                     "seconds": time.perf_counter() - t, "first_loss": res["first_loss"]})
        if "insitu" in res:
            runs[-1]["insitu"] = res["insitu"]
        print(f"  P={procs} run {i + 1}/{a.runs}: " + ", ".join(f"{cid} {v * 1e3:.1f}"
              for cid, v in runs[-1]["times"].items()) + f" ms (load {l0:.1f})", flush=True)
    priced = {}
    if a.insitu:
        ipath = insitu_machine(mpath, procs, runs, os.path.join(CACHE, f"local-{procs}-insitu.json"))
        priced = {"before": reprice(plans, mpath, procs), "insitu": reprice(plans, ipath, procs),
                  "insitu_wall": reprice(plans, ipath, procs, wall=True)}
    priced["before_wall"] = reprice(plans, mpath, procs, wall=True)
    rows = []
    torch_of = {c["model"]: f"{c['vs']}:{c['model']}" for c in plans if c["vs"]}
    for c in plans:
        meas = [r["times"][c["id"]] for r in runs]
        row = {"plan": c["name"], "model": c["model"], "procs": procs, "predicted_s": c["predicted_s"],
               "predicted_independent_s": c.get("predicted_independent_s"),
               "predicted_ddp_sync_s": c.get("predicted_ddp_sync_s"),
               "measured_s": statistics.median(meas), "measured_runs_s": meas, "breakdown": c["breakdown"],
               "devices_used": c["devices_used"],
               "cpu_all_ranks_s": statistics.median(x for r in runs for x in r["cpu_all_rounds"][c["id"]])}
        row["rel_error"] = (row["predicted_s"] - row["measured_s"]) / row["measured_s"]
        row["predicted_wall_s"] = priced["before_wall"][c["id"]]
        if "insitu_wall" in priced:
            row["predicted_insitu_wall_s"] = priced["insitu_wall"][c["id"]]
        if "insitu" in priced:      # the measured views priced on the calibration before (evaluate) and on the in-situ tables
            row["predicted_eval_s"] = priced["before"][c["id"]]
            row["predicted_insitu_s"] = priced["insitu"][c["id"]]
            row["rel_error_insitu"] = (row["predicted_insitu_s"] - row["measured_s"]) / row["measured_s"]
        ref = torch_of.get(c["model"])      # the same model trained by torch in the same run: same first loss?
        if ref is not None:
            la, lb = runs[0]["first_loss"][c["id"]], runs[0]["first_loss"][ref]
            row["first_loss"] = {"executor": la, "torch": lb, "torch_case": ref,
                                 "rel_diff": abs(la - lb) / max(abs(lb), 1e-12)}
        if c["vs"]:
            other = f"{c['vs']}:{c['model']}"
            # throughput executor / torch = torch time / executor time, paired per round (adjacent in time)
            paired = [[t / e for e, t in zip(r["rounds"][c["id"]], r["rounds"][other])] for r in runs]
            row.update({"vs": c["vs"], "torch_s": statistics.median(r["times"][other] for r in runs),
                        "torch_runs_s": [r["times"][other] for r in runs],
                        "ratio": statistics.median(x for pr in paired for x in pr),
                        "ratio_runs": [statistics.median(pr) for pr in paired],
                        "ratio_rounds_iqr": _quartiles([x for pr in paired for x in pr]),
                        # diagnostic, robust to the host's load: CPU time of rank 0 per step, torch / executor
                        "cpu_ratio": statistics.median(t / e for r in runs for e, t in
                                                       zip(r["cpu_rounds"][c["id"]], r["cpu_rounds"][other]))})
        rows.append(row)
    with open(mpath) as f:
        machine = json.load(f)
    for r in runs:
        r.pop("insitu", None)         # kept in the in-situ machine file (benchmarks/.cache), not the results
    return {"procs": procs, "rows": rows, "runs": runs, "calibration_s": cal_s, "loadavg_calibration": load_cal,
            "machine": machine.get("meta", {}).get("worlds", {}).get(str(procs), machine.get("meta"))}


def _provenance() -> dict:
    """The commit measured and whether the executor had uncommitted changes (the tree is shared)."""
    import subprocess
    import torch

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"git_head": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--short", "executor", "search", "unity_pcg").splitlines(),
            "torch": torch.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="quick calibration and 1 run of 3 rounds x 3 steps per P (about 3 minutes)")
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--runs", type=int, default=3, help="launches per P (default 3)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per launch (default 7)")
    ap.add_argument("--iters", type=int, default=3, help="steps per case per round (default 3)")
    ap.add_argument("--machine", default=None,
                    help="price on this machine file instead of calibrating for each P right before measuring")
    ap.add_argument("--insitu", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the calibration's generic kernel and collective tables inside each launch, "
                         "one round before every round of steps, and re-price the measured views on them "
                         "(default on; --no-insitu: the calibration before each P only)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "executor_bench.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "executor_bench.md"))
    a = ap.parse_args(argv)
    if a.quick:
        a.runs, a.rounds, a.iters = 1, 3, 3
    for k in ("runs", "rounds", "iters"):
        if getattr(a, k) < 1:
            ap.error(f"--{k} must be >= 1")
    try:
        procs = [int(x) for x in a.procs.split(",")]
    except ValueError:
        ap.error(f"--procs must be a comma-separated list of integers, got {a.procs!r}")
    if any(p < 2 for p in procs):
        ap.error("--procs: every process count must be >= 2")
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    models = {k: export_model(k) for k in ("mlp", "ffn", "block", "zoo")}
    per = []
    for p in procs:
        print(f"P={p}: calibrating, planning, measuring ...", flush=True)
        per.append(run_procs(p, a, models))
    rows = [r for x in per for r in x["rows"]]
    bad = [f"{r['plan']}:{r['model']}:p{r['procs']}" for r in rows
           if r.get("first_loss") and r["first_loss"]["rel_diff"] > 1e-4]
    errs = [abs(r["rel_error"]) for r in rows]
    summary = {"plans": len(rows), "median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
               "within_20pct": sum(e <= 0.2 for e in errs),
               "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
               "seconds": time.perf_counter() - t0, "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
               "cores": os.cpu_count(), "first_loss_mismatches": bad, **_provenance()}
    summary.update(independent_summary(rows))
    for p in procs:
        sub = [r for r in rows if r["procs"] == p]
        summary[f"median_abs_rel_error_p{p}"] = statistics.median(abs(r["rel_error"]) for r in sub)
        summary[f"spearman_p{p}"] = spearman([r["predicted_s"] for r in sub], [r["measured_s"] for r in sub])
        if all("predicted_insitu_s" in r for r in sub):
            summary[f"median_abs_rel_error_insitu_p{p}"] = statistics.median(abs(r["rel_error_insitu"]) for r in sub)
            summary[f"spearman_insitu_p{p}"] = spearman([r["predicted_insitu_s"] for r in sub],
                                                        [r["measured_s"] for r in sub])
        for key, suffix in (("predicted_wall_s", "wall"), ("predicted_insitu_wall_s", "insitu_wall")):
            if all(r.get(key) is not None for r in sub):
                summary[f"median_abs_rel_error_{suffix}_p{p}"] = statistics.median(
                    abs(r[key] - r["measured_s"]) / r["measured_s"] for r in sub)
                summary[f"spearman_{suffix}_p{p}"] = spearman([r[key] for r in sub], [r["measured_s"] for r in sub])
    for r in rows:
        if "ratio" in r:
            summary[f"ratio_{r['vs']}_{r['model']}_p{r['procs']}"] = r["ratio"]
    command = "python benchmarks/executor_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = {"summary": summary, "rows": rows, "per_procs": per, "args": vars(a), "command": command.strip(),
           "configs": {"mlp": MLP, "ffn": FFN, "block": BLOCK, "zoo": ZOO, "lr": LR, "optimizer": "sgd"}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    if a.md:
        write_markdown(a.md, res)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))
    return 0


def independent_summary(rows: list) -> dict:
    """Median error and Spearman of the predictions that price the devices as independent (the
    same calibration with ``shared_cores=0``), and of the same views priced with torch DDP's sync terms."""
    out = {}
    for key, suffix in (("predicted_independent_s", "independent"), ("predicted_ddp_sync_s", "ddp_sync"),
                        ("predicted_eval_s", "eval"), ("predicted_insitu_s", "insitu"),
                        ("predicted_wall_s", "wall"), ("predicted_insitu_wall_s", "insitu_wall")):
        if not rows or any(r.get(key) is None for r in rows):
            continue
        out[f"median_abs_rel_error_{suffix}"] = statistics.median(
            abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows)
        out[f"spearman_{suffix}"] = spearman([r[key] for r in rows], [r["measured_s"] for r in rows])
    return out


def write_markdown(path: str, res: dict) -> None:
    s, rows = res["summary"], res["rows"]
    names = {"mlp": "MLP 512-1024-1024-512", "zoo": f"zoo {ZOO['name']} tiny", "ffn": "FFN pair 512-2048-512",
             "block": "Transformer block"}
    L = ["# Executor benchmarks: against torch DDP and tensor parallelism; predicted vs measured", "",
         f"Command: `.venv/bin/{res['command']}` ({s['seconds']:.0f} s; {s['cores']} cores; 1-min load average "
         f"{s['loadavg_start'][0]:.1f} at the start, {s['loadavg_end'][0]:.1f} at the end; commit {s['git_head']}"
         + (f", uncommitted changes in {', '.join(x.split()[-1] for x in s['uncommitted'])}" if s["uncommitted"] else "")
         + f"; torch {s['torch']})", "",
         "First-step losses that differ from torch's by more than 1e-4 (relative): "
         + (", ".join(s["first_loss_mismatches"]) or "none") + ".", "",
         "## Throughput against PyTorch (ratio = torch step time / executor step time; target >= 0.95)", "",
         "| model | P | executor plan | torch | executor ms | torch ms | ratio (median) | quartiles | ratio per run | "
         "CPU-time ratio |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" in r:
            torch_name = "DDP" if r["vs"] == "ddp" else "parallelize_module (Colwise/Rowwise)"
            L.append(f"| {names[r['model']]} | {r['procs']} | {r['plan']} | {torch_name} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['torch_s'] * 1e3:.2f} | {r['ratio']:.2f} | "
                     + "-".join(f"{x:.2f}" for x in r["ratio_rounds_iqr"]) + " | "
                     + ", ".join(f"{x:.2f}" for x in r["ratio_runs"]) + f" | {r['cpu_ratio']:.2f} |")
    L += ["", "CPU-time ratio: rank 0's process CPU time per step (all its threads), torch / executor, median of "
          "the paired rounds: the work each side does, less sensitive to the host's load than wall time.", "",
          "## Predicted vs measured iteration time (calibrated local machine)", "",
           "| model | P | plan | measured ms | predicted ms | error | compute | grad sync | transfers | CPU ms, all ranks "
          "| first loss rel. diff to torch | devices used | independent devices: predicted ms | DDP's sync terms: "
          "predicted ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.get("breakdown") or {}
        xfer = b.get("transfer_s", b.get("comm_s", 0.0)) or 0.0
        L.append(f"| {names[r['model']]} | {r['procs']} | {r['plan']} | {r['measured_s'] * 1e3:.2f} | "
                 f"{r['predicted_s'] * 1e3:.2f} | {r['rel_error'] * 100:+.1f}% | {(b.get('compute_s') or 0) * 1e3:.2f} | "
                 f"{(b.get('grad_sync_s') or 0) * 1e3:.2f} | {xfer * 1e3:.2f} | {r['cpu_all_ranks_s'] * 1e3:.1f} | "
                 + (f"{r['first_loss']['rel_diff']:.1e} |" if r.get("first_loss") else "- |")
                 + f" {r.get('devices_used', '-')} | "
                 + (f"{r['predicted_independent_s'] * 1e3:.2f} |" if r.get("predicted_independent_s") else "- |")
                 + (f" {r['predicted_ddp_sync_s'] * 1e3:.2f} |" if r.get("predicted_ddp_sync_s") else " - |"))
    L += ["", f"Median absolute error {s['median_abs_rel_error'] * 100:.1f}% (target <= 20%; {s['within_20pct']} of "
          f"{s['plans']} within 20%, max {s['max_abs_rel_error'] * 100:.1f}%); Spearman rank correlation "
          f"{s['spearman']:.3f} (target >= 0.9)."
          + (f" The same calibrations priced as independent devices (`shared_cores=0`: the cost model before it "
             f"modelled shared cores): median absolute error {s['median_abs_rel_error_independent'] * 100:.1f}%, "
             f"Spearman {s['spearman_independent']:.3f}." if "spearman_independent" in s else "")
          + (f" The same views priced with torch DDP's gradient sync (`sync_model=\"ddp\"`: the DDP-calibrated "
             f"`sync.iteration`, `per_tensor`, `per_compute` terms, as executor plans were priced before): median "
             f"absolute error {s['median_abs_rel_error_ddp_sync'] * 100:.1f}%, Spearman {s['spearman_ddp_sync']:.3f}."
             if "spearman_ddp_sync" in s else ""), "",
          "Compute, grad sync and transfers: the cost model's breakdown of the prediction. CPU ms, all ranks: the "
          "measured CPU time of one step summed over the ranks (median over rounds).", ""]
    if "spearman_insitu" in s:
        L += ["### Priced on the tables measured inside the launches (`--insitu`)", "",
              "The calibration's generic kernel and collective tables (`calibration.local.prepare_kernels`, "
              "`prepare_collectives`: never the models) measured again in the launches' processes, one round before "
              "each round of steps, so that they see the host's load of the same seconds; the measured views "
              "re-priced on them (`MachineMapper.evaluate`) and, for comparison, on the calibration before "
              "(evaluate: the same views).", "",
              "| model | P | plan | measured ms | in-situ tables: predicted ms | error | calibration before, "
              "evaluate: predicted ms | error |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {names[r['model']]} | {r['procs']} | {r['plan']} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['predicted_insitu_s'] * 1e3:.2f} | {r['rel_error_insitu'] * 100:+.1f}% | "
                     f"{r['predicted_eval_s'] * 1e3:.2f} | "
                     f"{(r['predicted_eval_s'] - r['measured_s']) / r['measured_s'] * 100:+.1f}% |")
        L += ["", f"In-situ tables: median absolute error {s['median_abs_rel_error_insitu'] * 100:.1f}%, Spearman "
              f"{s['spearman_insitu']:.3f}; " + "; ".join(
                  f"P={p}: {s[f'median_abs_rel_error_insitu_p{p}'] * 100:.1f}% / {s[f'spearman_insitu_p{p}']:.3f}"
                  for p in sorted({r['procs'] for r in rows})) + ". Calibration before, the same views (evaluate): "
              f"{s['median_abs_rel_error_eval'] * 100:.1f}% / {s['spearman_eval']:.3f}.", ""]
    L += ["Per process count: " + "; ".join(
        f"P={p}: median absolute error {s[f'median_abs_rel_error_p{p}'] * 100:.1f}%, Spearman "
        f"{s[f'spearman_p{p}']:.3f}" for p in sorted({r['procs'] for r in rows})) + ".", ""]
    if "spearman_wall" in s:
        ps = sorted({r['procs'] for r in rows})

        def line(label, suffix):
            return (f"{label}: {s[f'median_abs_rel_error_{suffix}'] * 100:.1f}% / {s[f'spearman_{suffix}']:.3f} ("
                    + "; ".join(f"P={p}: {s[f'median_abs_rel_error_{suffix}_p{p}'] * 100:.1f}% / "
                                f"{s[f'spearman_{suffix}_p{p}']:.3f}" for p in ps) + ")")
        L += ["### Processes that outnumber the cores: collectives priced by their CPU work", "",
              "Where the processes outnumber the cores (P > cores), a collective is priced by the CPU time it costs "
              "each process (calibrated per kind, group size and bytes, all ranks in it at once, the mean) times the "
              "measured contention (wall over CPU time of compute while all ranks compute), "
              "`MachineSpec.collective_cpu_time`: a rank blocked in a collective gives its core to the others, so "
              "the iteration costs the CPU work of all ranks over the cores. For comparison, the same views priced "
              "with the collectives' measured wall time (the cost model before; where P <= cores both are the "
              "same):", "",
              "| model | P | plan | measured ms | CPU-priced ms | wall-priced ms |"
              + (" in-situ CPU-priced ms | in-situ wall-priced ms |" if "spearman_insitu_wall" in s else ""),
              "|---|---|---|---|---|---|" + ("---|---|" if "spearman_insitu_wall" in s else "")]
        for r in rows:
            cpu_p = r.get("predicted_eval_s", r["predicted_s"])
            L.append(f"| {names[r['model']]} | {r['procs']} | {r['plan']} | {r['measured_s'] * 1e3:.2f} | "
                     f"{cpu_p * 1e3:.2f} | {r['predicted_wall_s'] * 1e3:.2f} |"
                     + (f" {r['predicted_insitu_s'] * 1e3:.2f} | {r['predicted_insitu_wall_s'] * 1e3:.2f} |"
                        if "spearman_insitu_wall" in s else ""))
        L += ["", "Median absolute error / Spearman. " + line("Calibration before, wall-priced", "wall")
              + (". " + line("In-situ tables, wall-priced", "insitu_wall") if "spearman_insitu_wall" in s else "")
              + ".", ""]
    L += ["## The calibrations (right before each P's runs)", "",
          "| P | seconds | load (1 min) | matmul GFLOP/s | memory GB/s | op overhead us | all-reduce latency us | "
          "all-reduce GB/s | per_compute | solo speedup | contention | executor slowdown (priced / diagnostic) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in res["per_procs"]:
        m = x.get("machine") or {}
        meas, link, sync = m.get("measured", {}), m.get("link", {}), m.get("sync", {})
        L.append(f"| {x['procs']} | {x['calibration_s']:.0f} | {x['loadavg_calibration']:.1f} | "
                 f"{meas.get('matmul_flops', 0) / 1e9:.1f} | {meas.get('mem_bandwidth', 0) / 1e9:.2f} | "
                 f"{meas.get('op_overhead', 0) * 1e6:.0f} | {link.get('latency', 0) * 1e6:.0f} | "
                 f"{link.get('bandwidth', 0) / 1e9:.2f} | {sync.get('per_compute', 0):.2f} | "
                 + (f"{m['solo_speedup']:.2f} |" if m.get("solo_speedup") is not None else "- |")
                 + (f" {m['contention']:.2f} |" if m.get("contention") is not None else " - |")
                 + f" {sync.get('executor_slowdown', 0):.2f} / "
                 + (f"{sync['executor_slowdown_cpu']:.2f} |" if sync.get("executor_slowdown_cpu") is not None
                    else "- |"))
    L += ["", "Solo speedup: how much faster one process multiplies matrices while the others wait than while "
          "all compute (`calibration.local.measure_solo`); the cost model prices a node on fewer devices with it "
          "(`MachineSpec.concurrency_factor`). Contention: wall over CPU time of compute while all ranks compute "
          "(`calibration.local.measure_contention`). Executor slowdown: `sync.executor_slowdown`, which scales the "
          "executor's compute; diagnostic: `sync.executor_slowdown_cpu`, the same synchronized loop with its "
          "all-reduce priced by its CPU work (P > cores; ~1 where the collective's CPU work explains the loop).", ""]
    L += ["Load average (1 min) per launch: " + "; ".join(
        f"P={x['procs']}: calibration {x['loadavg_calibration']:.1f}, runs "
        + ", ".join(f"{r['loadavg_before']:.1f}" for r in x["runs"]) for x in res["per_procs"]), ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    sys.exit(main())
