"""Step time of pipelines with Megatron tensor parallelism inside the stages (the executor's lowered stages,
executor/pipeline.py PipelineTrainer) against the same stages data parallel inside, on local gloo
processes, with the cost model's prediction of each plan and a check that both train as one process.

Model: a bias-free MLP of ``--pairs`` Megatron pairs (Linear h -> 4h, ReLU, Linear 4h -> h), batch ``--batch``.
Plans: ``search.pipeline.evaluate_pipeline`` on ``local:1xP`` with 2 stages of P/2 devices (the first half of the
layers in stage 0), ``--micro-batches`` M, intra-stage parallelization ``megatron_intra(P/2)`` (tensor parallel)
or ``default_intra`` (data parallel).  Each plan runs ``--repeats`` times with ``unity-pcg run --steps N --json``
(SGD, random feeds); a run's time is its ``step_time_s`` (median after the first step), a plan's the median over
runs; the first run's losses are compared with the one-process Trainer's (rtol 1e-4).

Usage:  .venv/bin/python benchmarks/pipeline_megatron_bench.py [--procs 4] [--hidden 256] [--pairs 2]
        [--batch 32] [--micro-batches 4] [--steps 6] [--repeats 3]
Writes benchmarks/results/pipeline_megatron_bench.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def export_mlp(path: str, hidden: int, pairs: int, batch: int) -> str:
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList()
            for _ in range(pairs):
                self.layers.append(torch.nn.Linear(hidden, 4 * hidden, bias=False))
                self.layers.append(torch.nn.Linear(4 * hidden, hidden, bias=False))

        def forward(self, x):
            for i in range(0, len(self.layers), 2):
                x = self.layers[i + 1](torch.relu(self.layers[i](x)))
            return x
    torch.manual_seed(0)
    m = M().eval()
    torch.onnx.export(m, (torch.randn(batch, hidden),), path, input_names=["x"], output_names=["y"],
                      dynamo=False, opset_version=17)
    return path


def make_plan(model: str, out: str, procs: int, micro_batches: int, intra: str) -> dict:
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.pipeline import default_intra, evaluate_pipeline, megatron_intra, sequential_layers
    from tests.executor.runtime_plans import _save
    g = load_onnx(model, load_weights=False)
    m = parse_machine(f"local:1x{procs}")
    cm = CostModel(m)
    L = len(sequential_layers(g, GraphCost(g, cm).role, 12)[0])
    half = procs // 2
    hook = megatron_intra(half) if intra == "megatron" else default_intra
    res = evaluate_pipeline(g, cm, [(0, L // 2, 0, half), (L // 2, L, half, half)], micro_batches, intra=hook)
    if not res.feasible:
        raise SystemExit(f"{intra}: plan infeasible ({res.reason})")
    _save(res.pcg, res.views, model, out, m, pipeline=res.to_plan_field(), predicted=res.to_json())
    comm = sorted({n.op for n in res.pcg.nodes() if n.op in ("AllReduce", "Reduce", "Combine")})
    return {"plan": out, "predicted_iteration_s": res.to_json().get("predicted_iteration_s", res.cost),
            "parallel_ops": comm}


def run(plan: str, model: str, steps: int) -> dict:
    cmd = [os.path.join(ROOT, ".venv", "bin", "unity-pcg"), "run", plan, "--model", model, "--steps", str(steps),
           "--optimizer", "sgd", "--lr", "0.01", "--json", "--loss", "mean"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"run failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)


def reference(model: str, steps: int, work: str) -> list[float]:
    from unity_pcg import plan as P
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.train import Trainer
    from tests.executor.runtime_plans import one_device_plan
    one = P.load(one_device_plan(model, os.path.join(work, "one.json")))
    t = Trainer(one, model, rank=0, world=1, seed=0, optimizer="sgd", lr=0.01)
    src = open_data(one.pcg, None, seed=0)
    return [t.step(*src.feeds(s)) for s in range(steps)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import numpy as np
    work = tempfile.mkdtemp(prefix="pp_megatron_")
    model = export_mlp(os.path.join(work, "mlp.onnx"), a.hidden, a.pairs, a.batch)
    ref = reference(model, a.steps, work)
    rows = []
    for intra in ("megatron", "dp"):
        info = make_plan(model, os.path.join(work, f"{intra}.json"), a.procs, a.micro_batches, intra)
        times, equal = [], None
        for k in range(a.repeats):
            res = run(info["plan"], model, a.steps)
            times.append(res["step_time_s"])
            if k == 0:
                equal = bool(np.allclose(res["losses"], ref, rtol=1e-4, atol=1e-7))
            print(f"{intra}: run {k + 1}/{a.repeats} step {res['step_time_s'] * 1e3:.2f} ms", flush=True)
        rows.append({"intra": intra, "step_time_s": statistics.median(times), "runs_s": times,
                     "predicted_iteration_s": info["predicted_iteration_s"], "parallel_ops": info["parallel_ops"],
                     "losses_equal_one_process": equal})
    out = {"procs": a.procs, "hidden": a.hidden, "pairs": a.pairs, "batch": a.batch,
           "micro_batches": a.micro_batches, "steps": a.steps, "repeats": a.repeats, "rows": rows,
           "load": os.getloadavg()[0]}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pipeline_megatron_bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Pipelines with Megatron inside the stages vs data parallel inside",
             "",
             f"`benchmarks/pipeline_megatron_bench.py --procs {a.procs} --hidden {a.hidden} --pairs {a.pairs} "
             f"--batch {a.batch} --micro-batches {a.micro_batches} --steps {a.steps} --repeats {a.repeats}`: "
             f"bias-free MLP of {a.pairs} Megatron pairs (h {a.hidden}, 4h {4 * a.hidden}), 2 stages of "
             f"{a.procs // 2} local gloo processes each, {a.micro_batches} micro-batches, SGD; step time = median "
             f"over runs of each run's median step after the first (load {out['load']:.1f}).",
             "",
             "| inside the stages | measured step (ms) | runs (ms) | predicted (ms) | parallel ops | losses = one process |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['intra']} | {r['step_time_s'] * 1e3:.2f} | "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in r['runs_s'])} | {r['predicted_iteration_s'] * 1e3:.2f} | "
                     f"{', '.join(r['parallel_ops']) or '-'} | {'yes' if r['losses_equal_one_process'] else 'NO'} |")
    lines.append("")
    with open(os.path.join(RESULTS, "pipeline_megatron_bench.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
