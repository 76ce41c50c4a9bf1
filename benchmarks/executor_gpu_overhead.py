"""The executor's overhead on one device: a plan's training step against plain PyTorch eager training of
the same zoo model (issue 8, point 8: "run a plan on one GPU and report its step time against plain
PyTorch eager training of the same zoo model (target: overhead at most 5%)").

For each model: the zoo's torch module is exported to ONNX with its weights (``zoo.export``, the
``--size`` configuration at its batch), the one-device plan is written by ``simulate --strategy none``
and trained by the executor's :class:`executor.train.Trainer` (``unity-pcg run``'s step: the plan's
lowering, its torch kernels, the loss, backward, the optimizer, the loss read back as a float); the
baseline is the zoo's torch module trained with the same optimizer (SGD, lr 1e-3) and loss (the mean
of the first output), its loss read back every step too (``loss.item()``, as a training loop that logs
its loss does; ``--eager-no-sync`` also times it without).  Both are fed the same input tensors, already
on the device.  They run interleaved in ``--rounds`` rounds of ``--iters`` steps each (after ``--warmup``
steps of each), the order reversed every other round, each step timed with CUDA events on a GPU
(``perf_counter`` on a CPU); reported: the medians over all steps and the overhead = executor median /
eager median - 1, with the per-round ratios' spread.

Usage: python benchmarks/executor_gpu_overhead.py [--device cuda|cpu] [--models mlp,bert_large,...]
       [--size paper|tiny|small] (a model may name its own: dlrm:small) [--batch N] [--rounds 5] [--iters 10] [--warmup 5] [--precision fp32|tf32|bf16]
       [--out benchmarks/results/executor_gpu_overhead.json]
Writes the JSON after every model (a cut-short run keeps what it measured) and a markdown report beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGET = 0.05


def measure_model(name: str, size: str, batch: int | None, device: str, precision: str, rounds: int, iters: int,
                  warmup: int, eager_no_sync: bool, workdir: str) -> dict:
    import onnx
    import torch

    from unity_pcg.executor.precision import forward_context, set_math_mode
    from unity_pcg.executor.train import Trainer
    from unity_pcg import zoo
    from unity_pcg.commands.simulate_cmd import simulate
    from unity_pcg.zoo import CONFIGS, models

    cuda = device == "cuda"
    dev = torch.device(device)
    entry = zoo.MODELS[name]
    b = batch or (entry.paper_batch if size == "paper" else entry.tiny_batch)
    path = os.path.join(workdir, f"{name}-{size}-b{b}.onnx")
    t0 = time.perf_counter()
    zoo.export(name, path, size=size, batch=b)
    export_s = time.perf_counter() - t0
    plan_path = os.path.join(workdir, f"{name}-{size}-b{b}.plan.json")
    sim = simulate(path, "h100:1x1" if cuda else "local:1x1", strategy="none", batch=b, optimizer="sgd",
                   output=plan_path, precision=precision)
    trainer = Trainer(plan_path, path, rank=0, world=1, optimizer="sgd", lr=1e-3, device=device)

    # the same inputs for both, on the device; ONNX graph inputs in the order of the module's arguments
    cfg = CONFIGS[name][size]
    xs = tuple(x.to(dev) for x in models.example_inputs(name, cfg, b))
    m = onnx.load(path, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    names = [i.name for i in m.graph.input if i.name not in inits]
    if len(names) != len(xs):
        raise RuntimeError(f"{name}: {len(names)} ONNX inputs, {len(xs)} module inputs")
    feeds = dict(zip(names, xs))

    torch.manual_seed(0)
    module = models.make_module(name, cfg, device=dev).to(dev)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    set_math_mode(precision, dev)

    def eager(sync: bool = True):
        opt.zero_grad(set_to_none=True)
        with forward_context(precision, dev):
            out = module(*xs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        loss = first.float().mean()
        loss.backward()
        opt.step()
        if sync:
            loss.item()

    def executor():
        trainer.step(feeds)

    from gpu_cost import step_timer            # benchmarks/gpu_cost.py: one step between CUDA events
    timed = step_timer(cuda)
    for _ in range(warmup):
        executor()
        eager()
    if cuda:
        torch.cuda.synchronize()
    runs = {"executor": [], "eager": []}
    if eager_no_sync:
        runs["eager_no_sync"] = []
    fns = {"executor": executor, "eager": eager, "eager_no_sync": lambda: eager(False)}
    ratios = []
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        got = {}
        for k in order:
            got[k] = [timed(fns[k]) for _ in range(iters)]
            runs[k] += got[k]
        ratios.append(statistics.median(got["executor"]) / statistics.median(got["eager"]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"model": name, "size": size, "batch": b, "precision": precision, "export_s": export_s,
           "executor_s": med["executor"], "eager_s": med["eager"],
           "overhead": med["executor"] / med["eager"] - 1, "round_ratios": ratios,
           "executor_all_s": runs["executor"], "eager_all_s": runs["eager"],
           "predicted_s": sim["predicted_iteration_s"], "onnx_nodes": len(m.graph.node)}
    if eager_no_sync:
        out["eager_no_sync_s"] = med["eager_no_sync"]
        out["overhead_vs_no_sync"] = med["executor"] / med["eager_no_sync"] - 1
    if cuda:
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    del trainer, module, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def markdown(data: dict) -> str:
    meta = data["meta"]
    out = [f"# Executor overhead on one device ({meta['device_name']})", "",
           f"Command: `{meta['command']}`", "",
           f"torch {meta['torch']}, CUDA {meta['cuda']}, precision {meta['precision']}; {meta['rounds']} interleaved "
           f"rounds of {meta['iters']} steps after {meta['warmup']} warm-ups; "
           + ("CUDA events." if meta["device"] == "cuda" else "perf_counter (a CPU run: not the GPU measurement)."),
           "", "Executor = `unity-pcg run`'s step on the one-device plan (`simulate --strategy none`) of the "
           "ONNX export; eager = the zoo's torch module, same inputs, SGD, mean loss read back each step.", "",
           "| model | size | batch | ONNX nodes | executor ms | eager ms | overhead | round ratios (min-max) |"
           + (" eager no-sync ms |" if any("eager_no_sync_s" in r for r in data["rows"]) else ""),
           "|---|---|---:|---:|---:|---:|---:|---|" + ("---:|" if any("eager_no_sync_s" in r for r in data["rows"])
                                                       else "")]
    for r in data["rows"]:
        if r.get("error"):
            out.append(f"| {r['model']} | {r.get('size', '')} | | | | | error: {r['error']} | |")
            continue
        line = (f"| {r['model']} | {r['size']} | {r['batch']} | {r['onnx_nodes']} | {r['executor_s'] * 1e3:.2f} | "
                f"{r['eager_s'] * 1e3:.2f} | {r['overhead'] * 100:+.1f}% | "
                f"{min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f} |")
        if "eager_no_sync_s" in r:
            line += f" {r['eager_no_sync_s'] * 1e3:.2f} |"
        out.append(line)
    ok = [r for r in data["rows"] if not r.get("error")]
    if ok:
        med = statistics.median(r["overhead"] for r in ok)
        out += ["", f"Median overhead {med * 100:+.1f}% (target at most {TARGET * 100:.0f}%); "
                f"{sum(r['overhead'] <= TARGET for r in ok)} of {len(ok)} models within the target.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="resnext50,inception_v3,bert_large",
                    help="comma-separated zoo models, each optionally MODEL:SIZE (default size: --size)")
    ap.add_argument("--size", default=None, help="zoo size (default paper on cuda, tiny on cpu)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eager-no-sync", action="store_true", help="also time eager without loss.item()")
    ap.add_argument("--workdir", default=None, help="where the ONNX exports and plans go (default: a temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    if a.device not in ("cuda", "cpu"):
        print(f"executor_gpu_overhead: --device must be cuda or cpu, got {a.device!r}", file=sys.stderr)
        return 2
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("executor_gpu_overhead: no CUDA device (use --device cpu for the CPU flow)", file=sys.stderr)
        return 2
    size = a.size or ("paper" if cuda else "tiny")
    out = a.out or os.path.join(RESULTS, "executor_gpu_overhead.json" if cuda else "executor_cpu_overhead.json")
    md = os.path.splitext(out)[0] + ".md"
    meta = {"command": "python benchmarks/executor_gpu_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": a.device, "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "CPU",
            "torch": torch.__version__, "cuda": torch.version.cuda, "precision": a.precision, "rounds": a.rounds,
            "iters": a.iters, "warmup": a.warmup, "size": size}
    data = {"meta": meta, "rows": []}
    workdir = a.workdir or tempfile.mkdtemp(prefix="unity-pcg-overhead-")
    os.makedirs(workdir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for item in [m for m in a.models.split(",") if m]:
        name, _, msize = item.partition(":")          # "model" or "model:size"
        try:
            row = measure_model(name, msize or size, a.batch, a.device, a.precision, a.rounds, a.iters, a.warmup,
                                a.eager_no_sync, workdir)
            print(f"{name:13s} executor {row['executor_s'] * 1e3:9.3f} ms  eager {row['eager_s'] * 1e3:9.3f} ms  "
                  f"overhead {row['overhead'] * 100:+.1f}%", flush=True)
        except Exception as e:          # reported in the results, the next model still runs
            row = {"model": name, "size": msize or size, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{name:13s} error {row['error']}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
        data["rows"].append(row)
        with open(out, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        with open(md, "w") as f:
            f.write(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
