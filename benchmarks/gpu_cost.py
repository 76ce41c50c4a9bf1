"""Predicted vs measured single-GPU training step of the zoo's seven models (issue 9, point 4).

For every zoo model at paper size and the paper's per-device batch, and every precision (``fp32``: TF32
off; ``tf32``: TF32 on for cuBLAS and cuDNN; ``bf16``: ``torch.autocast(bfloat16)`` around the forward,
fp32 parameters and optimizer states):

* measured: the plain torch module of the zoo (``unity_pcg.zoo.models``, built on the device, training
  mode) trains with the paper's optimizer (``zoo.MODELS[m].paper_optimizer``: Adam for BERT-Large, SGD
  for the others; torch's default implementation, lr 1e-3): one step = ``zero_grad(set_to_none)`` (with
  ``--keep-grads`` zeroed in place: they persist, as in our executor's and DDP's gradient buckets),
  forward, loss (the mean of the output, in fp32), backward, ``opt.step()``.  Timed with CUDA events,
  the median of ``--iters`` (20) steps after ``--warmup`` (5); peak memory is
  ``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients, optimizer states,
  activations; the allocator's reserve and the CUDA context are not counted);
* predicted: ``unity-pcg simulate MODEL --machine M --strategy none --optimizer O --precision P`` (the
  function behind it, :func:`unity_pcg.commands.simulate_cmd.simulate`) on the model's ONNX export at the
  same size and batch (paper size: ``zoo.export_structure`` where the zoo supports it, cached in
  benchmarks/.cache/ as ``benchmarks/fig14.py`` does); ``M`` is ``h100:1x1`` or the machine file given
  with ``--machine`` (``unity-pcg calibrate --device cuda -o FILE``).

Writes JSON and a markdown report (the table, the error summary per precision against the issue's
targets -- median absolute time error <= 15%, none off by more than 35%, memory median error <= 10% --
and a predicted-vs-measured plot when matplotlib is installed).

``--from RUN.json`` predicts the measurements of an earlier run again (with another ``--machine``, or
after a cost-model change) without measuring: no GPU needed.

Without CUDA it says so in one line and exits 2, unless ``--from`` or ``--device cpu``: the same flow on this CPU with
``--size small`` (the zoo's ``small`` configuration where a model has one, else ``tiny``; tiny batches)
or ``--size tiny``; CPU runs record no peak memory.

Usage: .venv/bin/python benchmarks/gpu_cost.py [--machine h100:1x1|FILE] [--precisions fp32,tf32,bf16]
       [--models a,b] [--iters 20] [--warmup 5] [--device cuda|cpu] [--size paper|small|tiny]
       [--out benchmarks/results/gpu_cost.json] [--md ...] [--plot ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CACHE = os.path.join(ROOT, "benchmarks", ".cache")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PRECISIONS = ("fp32", "tf32", "bf16")
TARGETS = {"median_abs_time_error": 0.15, "max_abs_time_error": 0.35, "median_abs_memory_error": 0.10}


def zoo_size(name: str, size: str) -> str:
    """The zoo configuration measured: ``paper``; ``small`` where the model has one, else ``tiny``."""
    from unity_pcg import zoo
    if size == "small":
        return "small" if "small" in zoo.sizes(name) else "tiny"
    return size


def zoo_batch(name: str, size: str) -> int:
    from unity_pcg import zoo
    e = zoo.MODELS[name]
    return e.paper_batch if size == "paper" else e.tiny_batch


def model_path(name: str, size: str, batch: int) -> str:
    """The ONNX export of ``name`` at zoo size ``size`` and ``batch`` (cached in benchmarks/.cache/);
    at paper size the files ``benchmarks/fig14.py`` uses (the paper batch)."""
    from unity_pcg import zoo
    os.makedirs(CACHE, exist_ok=True)
    if size == "paper":
        p = os.path.join(CACHE, f"{name}-paper.onnx")
        if not os.path.exists(p):
            print(f"[gpu_cost] exporting {name} (paper size) ...", file=sys.stderr, flush=True)
            try:
                zoo.export_structure(name, p, size="paper")
            except zoo.ZooError:
                zoo.export(name, p, size="paper")
        return p
    p = os.path.join(CACHE, f"{name}-{size}-b{batch}.onnx")
    if not os.path.exists(p):
        zoo.export(name, p, size=size, batch=batch)
    return p


def predict(name: str, size: str, batch: int, machine: str, optimizer: str, precision: str) -> dict:
    from unity_pcg.commands.simulate_cmd import simulate
    r = simulate(model_path(name, size, batch), machine, strategy="none", batch=batch, optimizer=optimizer,
                 precision=precision)
    return {"predicted_s": r["predicted_iteration_s"], "predicted_memory_bytes": r["max_memory_bytes"],
            "feasible": r["feasible"], "breakdown": r.get("breakdown", {}), "machine": r["machine"]}


def step_timer(cuda: bool):
    """``timed(fn)``: seconds of one call of ``fn`` -- between two CUDA events on a GPU (the kernels it
    queued included), by ``perf_counter`` on a CPU."""
    import torch

    def timed(fn) -> float:
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return timed


def measure(name: str, size: str, batch: int, optimizer: str, precision: str, device: str, warmup: int,
            iters: int, profile: str | None = None, keep_grads: bool = False) -> dict:
    """Median seconds of one training step and peak allocated bytes (CUDA only)."""
    import torch

    from unity_pcg.calibration.gpu import math_mode, tf32_enabled
    from unity_pcg.zoo import CONFIGS, models
    cuda = device.startswith("cuda")
    dev = torch.device(device)
    torch.manual_seed(0)
    cfg = CONFIGS[name][size]
    model = models.make_module(name, cfg, device=dev).to(dev)     # buffers made on the CPU follow
    model.train()
    inputs = tuple(x.to(dev) for x in models.example_inputs(name, cfg, batch))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(params, lr=1e-3)
    amp = precision == "bf16"

    def step():
        opt.zero_grad(set_to_none=not keep_grads)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        loss = sum(o.float().mean() for o in outs)
        loss.backward()
        opt.step()

    times = []
    with math_mode(precision, device):
        tf32 = tf32_enabled()
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timed = step_timer(cuda)
        for _ in range(iters):
            times.append(timed(step))
        peak = torch.cuda.max_memory_allocated() if cuda else None
        if profile:           # where the step's time goes, per torch op (for fitting the cost model offline)
            from torch.profiler import ProfilerActivity, profile as torch_profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=acts) as prof:
                for _ in range(3):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            os.makedirs(profile, exist_ok=True)
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            with open(os.path.join(profile, f"{name}-{precision}.txt"), "w") as f:
                f.write(f"# {name} {precision}: 3 steps, sorted by {key}\n")
                f.write(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=60))
    model = opt = inputs = params = None          # free the step's tensors before the next case
    if cuda:
        torch.cuda.empty_cache()
    return {"measured_s": statistics.median(times), "measured_all_s": times, "peak_memory_bytes": peak,
            "tf32_matmul_conv": list(tf32)}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for prec in sorted({r["precision"] for r in rows}, key=PRECISIONS.index):
        rs = [r for r in rows if r["precision"] == prec and r.get("time_ratio") is not None]
        if not rs:
            continue
        errs = [abs(r["time_ratio"] - 1) for r in rs]
        mem = [abs(r["memory_ratio"] - 1) for r in rs if r.get("memory_ratio") is not None]
        s = {"cases": len(rs), "median_abs_time_error": statistics.median(errs), "max_abs_time_error": max(errs),
             "within_15pct": sum(e <= 0.15 for e in errs), "within_35pct": sum(e <= 0.35 for e in errs)}
        if mem:
            s["median_abs_memory_error"] = statistics.median(mem)
            s["max_abs_memory_error"] = max(mem)
        s["meets_targets"] = (s["median_abs_time_error"] <= TARGETS["median_abs_time_error"]
                              and s["max_abs_time_error"] <= TARGETS["max_abs_time_error"]
                              and (not mem or s["median_abs_memory_error"] <= TARGETS["median_abs_memory_error"]))
        out[prec] = s
    return out


def plot(rows: list[dict], path: str) -> str | None:
    """Predicted vs measured step time (log-log, one colour per precision); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 6))
    pts = [r for r in rows if r.get("predicted_s") and r.get("measured_s")]
    if not pts:
        return None
    lo = min(min(r["predicted_s"], r["measured_s"]) for r in pts) / 1.5
    hi = max(max(r["predicted_s"], r["measured_s"]) for r in pts) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.85", label="within 15%")
    for prec, colour in zip(PRECISIONS, ("tab:blue", "tab:orange", "tab:green")):
        rs = [r for r in pts if r["precision"] == prec]
        if rs:
            ax.scatter([r["measured_s"] for r in rs], [r["predicted_s"] for r in rs], c=colour, label=prec, zorder=3)
            for r in rs:
                ax.annotate(r["model"], (r["measured_s"], r["predicted_s"]), fontsize=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(data: dict) -> str:
    meta, rows, summ = data["meta"], data["rows"], data["summary"]
    precs = [p for p in PRECISIONS if p in meta["precisions"]]
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"           # noqa: E731
    ms = lambda s: "-" if s is None else f"{s * 1e3:.2f}"           # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.2f}"              # noqa: E731
    cpu = meta["device"].startswith("cpu")
    out = [f"# Single-device training step: predicted vs measured ({meta['device_name']})", "",
           f"Command: `{meta['command']}`", ""] + (
              [f"Measurements from `{meta['measured_in']['file']}` (`{meta['measured_in']['command']}`), "
               "predicted again here.", ""] if meta.get("measured_in") else []) + [
           f"Device `{meta['device']}` ({meta['device_name']}), torch {meta['torch']}, CUDA {meta['cuda']}; "
           f"predicted on machine `{meta['machine']}` (`simulate --strategy none`); zoo size `{meta['size']}`, "
           f"{'the paper per-device batch' if meta['size'] == 'paper' else 'the tiny batch'}; one step = forward, "
           f"loss, backward, the paper's optimizer (gradients between steps: {meta.get('grads', 'set to None')}); "
           f"median of {meta['iters']} steps after {meta['warmup']} warm-ups "
           + ("(perf_counter); no peak memory on a CPU." if cpu else
              "(CUDA events); peak memory = `torch.cuda.max_memory_allocated`.")
           + (f" 1-min load average at the end: {meta['loadavg']:.1f}." if meta.get("loadavg") is not None else ""),
           "",
           "| model | size | batch | optimizer | " + " | ".join(
               f"{p} measured ms | {p} predicted ms | {p} pred/meas" for p in precs)
           + " | " + " | ".join(f"{p} peak GB | {p} pred/peak mem" for p in precs) + " |",
           "|---|---|---|---|" + "---:|" * (3 * len(precs)) + "---:|" * (2 * len(precs))]
    by = {(r["model"], r["precision"]): r for r in rows}
    for name in meta["models"]:
        first = next((by[(name, p)] for p in precs if (name, p) in by), None)
        if first is None:
            continue
        cells = [name, first["zoo_size"], str(first["batch"]), first["optimizer"]]
        for p in precs:
            r = by.get((name, p), {})
            cells += [ms(r.get("measured_s")), ms(r.get("predicted_s")), ratio(r.get("time_ratio"))]
        for p in precs:
            r = by.get((name, p), {})
            cells += [gb(r.get("peak_memory_bytes")), ratio(r.get("memory_ratio"))]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Errors per precision (targets: median |time error| <= 15%, none above 35%, "
            "median |memory error| <= 10%)", "",
            "| precision | cases | median abs time error | max abs time error | within 15% | within 35% | "
            "median abs memory error | meets targets |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in precs:
        s = summ.get(p)
        if not s:
            continue
        mem = s.get("median_abs_memory_error")
        out.append(f"| {p} | {s['cases']} | {s['median_abs_time_error'] * 100:.1f}% | "
                   f"{s['max_abs_time_error'] * 100:.1f}% | {s['within_15pct']} | {s['within_35pct']} | "
                   f"{'-' if mem is None else f'{mem * 100:.1f}%'} | {'yes' if s['meets_targets'] else 'no'} |")
    out.append("")
    if meta.get("plot"):
        out += [f"![predicted vs measured]({os.path.basename(meta['plot'])})", ""]
    else:
        out += [f"No plot: {meta.get('plot_note', 'matplotlib is not installed')}.", ""]
    if cpu:
        out += ["This run is the benchmark's CPU flow (`--device cpu`), not the H100 measurement issue 9 asks "
                "for: it checks the script end to end; its ratios are about this CPU and machine "
                f"`{meta['machine']}`, not about GPU predictions.", ""]
    skipped = [r for r in rows if r.get("error")]
    if skipped:
        out += ["Cases that did not run:", ""] + [f"- {r['model']} {r['precision']}: {r['error']}" for r in skipped]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    from unity_pcg import zoo
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the smoke flow: --size small/tiny)")
    ap.add_argument("--size", choices=("paper", "small", "tiny"), default=None,
                    help="zoo size (default paper on cuda, small on cpu)")
    ap.add_argument("--machine", default=None,
                    help="machine to predict with, a preset or a calibrated file (default h100:1x1; local:1x1 on cpu)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--from", dest="source", default=None, metavar="JSON",
                    help="re-predict the measurements of an earlier run (its JSON) with --machine; measures nothing, "
                         "needs no GPU (e.g. after a cost-model change or with a calibrated machine file)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also profile 3 steps of every case (torch.profiler, per-op table) into DIR")
    ap.add_argument("--keep-grads", action="store_true",
                    help="zero the gradients in place (zero_grad(set_to_none=False)): they persist between steps, as "
                         "in the executor's and DDP's gradient buckets (default: set to None, torch's default)")
    ap.add_argument("--measure-only", action="store_true",
                    help="measure, predict nothing (on a GPU machine without the ONNX exports; predict later with "
                         "--from)")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/gpu_cost.json; "
                                                "gpu_cost_cpu.json for --device cpu)")
    ap.add_argument("--md", default=None, help="markdown report (default: the JSON's name with .md)")
    ap.add_argument("--plot", default=None, help="plot PNG (default: the JSON's name with .png)")
    a = ap.parse_args(argv)
    import torch
    prior = None
    if a.source:
        try:
            with open(a.source) as f:
                prior = json.load(f)
            prior_meta = prior["meta"]
            prior_rows = prior["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"gpu_cost: --from {a.source}: not a gpu_cost result ({e})", file=sys.stderr)
            return 2
        a.device = prior_meta["device"]
    cuda = a.device.startswith("cuda")
    if cuda and prior is None and not torch.cuda.is_available():
        print(f"gpu_cost: no CUDA device available (torch {torch.__version__}); nothing measured "
              "(use --device cpu --size small for the CPU smoke flow, or --from an earlier run's JSON)",
              file=sys.stderr)
        return 2
    if not cuda and a.device != "cpu":
        print(f"gpu_cost: --device must be cuda or cpu, got {a.device!r}", file=sys.stderr)
        return 2
    size = prior_meta["size"] if prior else (a.size or ("paper" if cuda else "small"))
    a.machine = a.machine or ("h100:1x1" if cuda else "local:1x1")
    if a.iters < 1 or a.warmup < 0:
        print("gpu_cost: --iters must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if not cuda and size == "paper":
        print("gpu_cost: --device cpu runs --size small or tiny (paper size is for a GPU)", file=sys.stderr)
        return 2
    precs = [p for p in a.precisions.split(",") if p]
    bad = [p for p in precs if p not in PRECISIONS]
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in zoo.MODELS]
    if bad or unknown or not precs or not models:
        print(f"gpu_cost: unknown precision(s) {bad} or model(s) {unknown}", file=sys.stderr)
        return 2
    out = a.out or os.path.join(RESULTS, "gpu_cost.json" if cuda else "gpu_cost_cpu.json")
    if prior and os.path.abspath(out) == os.path.abspath(a.source):
        print("gpu_cost: --from and --out name the same file (the measurements would be overwritten)",
              file=sys.stderr)
        return 2
    md = a.md or os.path.splitext(out)[0] + ".md"
    png = a.plot or os.path.splitext(out)[0] + ".png"
    if prior:
        name = prior_meta["device_name"]
        measured = {(r["model"], r["precision"]): r for r in prior_rows}
        models = [m for m in models if m in prior_meta["models"]]
        precs = [p for p in precs if p in prior_meta["precisions"]]
    else:
        name = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()}, " \
                                                            f"{torch.get_num_threads()} threads)"
    keep = ("measured_s", "measured_all_s", "peak_memory_bytes", "tf32_matmul_conv", "error")
    prior_meta = prior_meta if prior else {}
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write(rows: list, final: bool) -> dict:
        """The JSON and the report of the rows so far (after every case: a run cut short keeps them)."""
        meta = {"command": "python benchmarks/gpu_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "device": a.device, "device_name": name,
                "torch": prior_meta["torch"] if prior else torch.__version__,
                "cuda": prior_meta["cuda"] if prior else torch.version.cuda, "machine": a.machine, "size": size,
                "precisions": precs, "models": models,
                "iters": prior_meta["iters"] if prior else a.iters,
                "warmup": prior_meta["warmup"] if prior else a.warmup,
                "host": prior_meta.get("host") if prior else platform.node(), "targets": TARGETS,
                "loadavg": prior_meta.get("loadavg") if prior else (os.getloadavg()[0] if hasattr(os, "getloadavg")
                                                                     else None),
                "complete": final, "measure_only": bool(a.measure_only),
                "grads": prior_meta.get("grads", "set to None") if prior else
                ("kept (zeroed in place)" if a.keep_grads else "set to None")}
        if prior:
            meta["measured_in"] = {"file": a.source, "command": prior_meta.get("command")}
        data = {"meta": meta, "rows": rows, "summary": summarize(rows)}
        got = plot(rows, png) if final else None
        if got:
            meta["plot"] = got
        else:
            meta["plot_note"] = ("matplotlib is not installed in this environment" if final
                                 else "the run was cut short")
        with open(out, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        with open(md, "w") as f:
            f.write(markdown(data))
        return data
    for m in models:
        zs = zoo_size(m, size)
        batch = zoo_batch(m, zs)
        optimizer = zoo.MODELS[m].paper_optimizer
        for prec in precs:
            row = {"model": m, "zoo_size": zs, "batch": batch, "optimizer": optimizer, "precision": prec}
            if prior:
                old = measured.get((m, prec))
                if old is None:
                    continue
                row.update({k: old[k] for k in keep if k in old})
            else:
                try:
                    row.update(measure(m, zs, batch, optimizer, prec, a.device, a.warmup, a.iters, a.profile,
                                       a.keep_grads))
                except torch.cuda.OutOfMemoryError as e:          # reported, not hidden
                    row["error"] = f"out of memory: {str(e).splitlines()[0]}"
                    torch.cuda.empty_cache()
                except Exception as e:                              # reported; the next case still runs
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    if cuda:
                        torch.cuda.empty_cache()
            if not a.measure_only:
                row.update(predict(m, zs, batch, a.machine, optimizer, prec))
            if row.get("measured_s") and row.get("predicted_s"):
                row["time_ratio"] = row["predicted_s"] / row["measured_s"]
            if row.get("peak_memory_bytes") and row.get("predicted_memory_bytes"):
                row["memory_ratio"] = row["predicted_memory_bytes"] / row["peak_memory_bytes"]
            rows.append(row)
            write(rows, final=False)
            print(f"{m:13s} {prec:5s} measured {row.get('measured_s', float('nan')) * 1e3:9.2f} ms  predicted "
                  f"{(row.get('predicted_s') or float('nan')) * 1e3:9.2f} ms  "
                  f"ratio {row.get('time_ratio', float('nan')):.2f}"
                  + (f"  memory ratio {row['memory_ratio']:.2f}" if row.get("memory_ratio") else ""), flush=True)
    data = write(rows, final=True)
    print(json.dumps(data["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
