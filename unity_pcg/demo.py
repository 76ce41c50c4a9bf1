"""The main job end to end on a bundled default (what `./run.sh` runs).

1. export a zoo model (default: the MLP at --size tiny) to ONNX,
2. import it as a PCG (checked numerically against onnxruntime when it is installed),
3. describe the machine: this computer's CPU processes, calibrated for --nproc processes (quick),
4. plan: Unity's joint search (`search.optimize`) when it is available, data parallelism otherwise,
   and the data-parallel baseline in the same cost model (predicted speedup),
5. explain the plan (degrees, views, transfers, gradient all-reduces; full text and DOT in --out),
6. run it on local processes with the executor on a synthetic task with a learnable signal (a fixed random
   teacher network: targets = teacher(inputs) + noise, written as a data folder of .npy files, trained
   with ``--loss mse``), and print the loss falling (first -> last) and predicted against measured step
   time.

Every stage prints a few lines; a failing stage prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from .errors import UnityError


def _stage(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _ms(t) -> str:
    return "-" if t is None or not math.isfinite(t) else f"{t * 1e3:.2f} ms"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unity_pcg.demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="zoo model (default mlp)")
    p.add_argument("--size", default="tiny", choices=["tiny", "paper"])
    p.add_argument("--batch", type=int, default=None, help="global batch size (default: the zoo's tiny batch x nproc)")
    p.add_argument("--nproc", type=int, default=2, help="local processes to plan for and run on (default 2)")
    p.add_argument("--machine", default=None, metavar="M",
                   help="machine to plan for (PRESET[:NxD] or JSON); default: calibrate this computer for "
                        "--nproc processes (quick, ~15 s)")
    p.add_argument("--budget", type=float, default=15.0, help="search budget in seconds (default 15)")
    p.add_argument("--steps", type=int, default=20, help="training steps of the run (default 20)")
    p.add_argument("--lr", type=float, default=None, help="learning rate of the run (default on the synthetic "
                   "task: 0.5 with sgd, 0.01 with adam; on random feeds the run's own default)")
    p.add_argument("--no-run", action="store_true", help="stop after planning and explaining")
    p.add_argument("--measure-dp", action="store_true",
                   help="also train with the data-parallel plan and print the measured speedup over it")
    p.add_argument("--out", default="out/demo", help="working directory for exported files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UnityError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from . import zoo
    from .onnx_import import load_onnx

    if args.nproc < 1 or args.steps < 1 or args.budget <= 0:
        raise UnityError("--nproc and --steps must be positive integers and --budget positive")
    entry = zoo.MODELS.get(args.model)
    if entry is None:
        raise UnityError(f"unknown zoo model {args.model!r} (known: {', '.join(zoo.MODELS)})")
    batch = args.batch or entry.tiny_batch * args.nproc
    optimizer = entry.paper_optimizer
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.model}_{args.size}_b{batch}.onnx")
    t_all = time.perf_counter()

    _stage(f"1. export {args.model} ({args.size}, batch {batch}) to ONNX")
    t = time.perf_counter()
    zoo.export(args.model, path, size=args.size, batch=batch)
    print(f"wrote {path} in {time.perf_counter() - t:.1f} s")

    _stage("2. import as a parallel computation graph")
    t = time.perf_counter()
    g = load_onnx(path)
    s = g.summary()
    print(f"{s['ops']} operators, {s['params']:,} parameters, {s['flops'] / 1e9:.3f} GFLOP per forward pass, "
          f"imported in {time.perf_counter() - t:.2f} s")
    if args.size == "tiny":
        _check_numerics(g, path)

    _stage("3. machine")
    machine = _machine(args)
    print(machine.describe())

    _stage(f"4. plan ({optimizer} optimizer)")
    plan_path = os.path.join(args.out, "plan.json")
    dp_plan, dp_res = data_parallel_plan(path, machine, args.nproc, optimizer)
    pl, how = _search(path, machine, optimizer, args.budget, dp_plan)
    t_plan = pl.predicted.get("predicted_iteration_s")
    t_dp = dp_res.cost if dp_res.feasible else None
    if pl is not dp_plan and t_dp is not None and (t_plan is None or t_plan > t_dp * (1 + 1e-9)):
        print(f"{how}, but its plan ({_ms(t_plan)}) is predicted slower than data parallelism: "
              "running data parallelism")
        pl, t_plan, how = dp_plan, t_dp, "data-parallel plan"
    pl.save(plan_path)
    print(f"{how}; plan written to {plan_path}")
    print(f"predicted iteration: plan {_ms(t_plan)}, data parallel ({args.nproc} processes) {_ms(t_dp)}")
    speedup = (t_dp / t_plan) if t_plan and t_dp else None
    print("predicted speedup over data parallel: " + (f"{speedup:.2f}x" if speedup else "- (one side infeasible)"))

    _stage("5. explain the plan")
    _explain(pl, plan_path)

    measured = measured_speedup = None
    if args.no_run:
        print("\n(run skipped: --no-run)")
    else:
        _stage("6. train on local processes with the plan")
        data, loss = teacher_data(g, os.path.join(args.out, "teacher_data"))
        lr = args.lr if args.lr is not None else (None if not data else 0.01 if optimizer == "adam" else 0.5)
        extra = (["--lr", repr(lr)] if lr is not None else []) + ["--loss", loss] + (["--data", data] if data else [])
        measured = _train(plan_path, path, args.steps, optimizer, extra)
        if args.measure_dp and measured:
            dp_path = os.path.join(args.out, "dp_plan.json")
            dp_plan.save(dp_path)
            print("the data-parallel plan, for comparison:")
            t_dp_run = _train(dp_path, path, args.steps, optimizer, extra)
            if t_dp_run:
                measured_speedup = t_dp_run / measured
                print(f"measured speedup over data parallel: {measured_speedup:.2f}x")

    print(f"\nsummary: {args.model} ({args.size}) on {machine.name} {machine.nodes}x{machine.devices_per_node}; "
          + (f"predicted speedup over data parallel {speedup:.2f}x" if speedup else "")
          + (f" (measured {measured_speedup:.2f}x)" if measured_speedup else "") + "; "
          + f"step time predicted {_ms(t_plan)}"
          + (f", measured {_ms(measured)} ({_ratio(measured, t_plan)})" if measured and t_plan else "")
          + f"; {time.perf_counter() - t_all:.0f} s in all")
    return 0


def _check_numerics(g, path: str) -> None:
    import numpy as np

    from .evaluate import evaluate, random_feeds
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed: numeric check skipped")
        return
    feeds = random_feeds(g)
    ours = evaluate(g, feeds)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    theirs = sess.run(None, feeds)
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs))
    ok = all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ours, theirs))
    print(f"numpy evaluation of the PCG vs onnxruntime: max abs difference {err:.2e} ({'ok' if ok else 'MISMATCH'})")
    if not ok:
        raise UnityError("the imported PCG does not reproduce onnxruntime's output")


def _machine(args):
    from .machine import parse_machine
    if args.machine:
        m = parse_machine(args.machine)
        print(f"given: {args.machine}")
        return m
    from unity_pcg.calibration.local import calibrate
    out = os.path.join(args.out, f"local-{args.nproc}.json")
    t = time.perf_counter()
    calibrate(quick=True, worlds=(args.nproc,), quiet=True).save(out)
    print(f"calibrated this computer for {args.nproc} processes in {time.perf_counter() - t:.0f} s -> {out}")
    return parse_machine(f"{out}:1x{args.nproc}")


def data_parallel_plan(model_path: str, machine, degree: int, optimizer: str):
    """The data-parallel plan of degree ``degree`` for ``model_path``, priced and mapped by the DP:
    ``(Plan, MappingResult)``."""
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper

    from .onnx_import import load_onnx
    from .plan import Plan, file_sha256

    if degree > machine.num_devices:
        raise UnityError(f"data-parallel degree {degree} exceeds the {machine.num_devices} devices of {machine.name}")
    g = load_onnx(model_path, load_weights=False)
    pg = data_parallel(g, degree)
    r = MachineMapper(CostModel(machine, optimizer=optimizer)).optimize(pg)
    if not r.views:
        raise UnityError(f"data parallelism of degree {degree} has no mapping on {machine.name}: {r.reason}")
    pred = dict(r.to_json(), optimizer=optimizer, strategy="dp")
    return Plan(model_path, file_sha256(model_path), machine, pg, r.views, pred, None,
                {"strategy": "dp", "degree": degree}), r


def _search(model_path: str, machine, optimizer: str, budget: float, fallback):
    """Unity's joint search when `search.optimize` is importable; the data-parallel plan otherwise."""
    try:
        from unity_pcg.search.optimize import optimize  # noqa: F401
    except Exception as e:   # not landed (or broken) yet: the demo still works end to end
        why = "not available" if isinstance(e, ImportError) else f"failed to import ({type(e).__name__})"
        return fallback, f"joint search {why}: using the data-parallel plan"
    try:
        return _optimize(model_path, machine, optimizer, budget, fallback)
    except Exception as e:   # the demo must finish: say loudly that the search failed and go on with dp
        msg = " ".join(str(e).split())[:160]
        return fallback, f"JOINT SEARCH FAILED ({type(e).__name__}: {msg}): using the data-parallel plan"


def _optimize(model_path: str, machine, optimizer: str, budget: float, fallback):
    from unity_pcg.search.optimize import optimize
    res = optimize(model_path, machine, budget_s=budget, optimizer=optimizer)
    pl = getattr(res, "plan", None)
    if pl is None:
        return fallback, "joint search returned no plan: using the data-parallel plan"
    st = getattr(res, "stats", {}) or {}
    what = st.get("chosen") or "search"
    steps = len(getattr(res, "steps", []) or [])
    return pl, (f"joint search ({res.search_s:.1f} s, budget {budget:g} s): {what}, {steps} rule steps"
                + (", interrupted" if getattr(res, "interrupted", False) else ""))


def _explain(pl, plan_path: str) -> None:
    from .commands.explain_cmd import write_drawings
    from .explanation import explain, format_text
    e = explain(pl)
    full = os.path.splitext(plan_path)[0] + "_explain.txt"
    with open(full, "w") as f:
        f.write(format_text(e))
    sections = ("summary", "rules", "communication", "gradients") + (("pipeline",) if e.pipeline else ())
    sys.stdout.write(format_text(e, limit=4, sections=sections))
    import shutil

    from .commands.explain_cmd import AUTO_PNG_NODES
    png = shutil.which("dot") is not None and len(pl.pcg) <= AUTO_PNG_NODES
    files = write_drawings(pl, e, os.path.splitext(plan_path)[0] + ".dot",
                           os.path.splitext(plan_path)[0] + ".png" if png else None)
    print(f"full explanation: {full}; PCG drawn to {files['png'] or files['dot']}")


TEACHER_BATCHES = 4          # batches in the synthetic data set (step s trains on batch s mod 4)
TEACHER_MAX_BYTES = 256 << 20


def teacher_data(g, out_dir: str, batches: int = TEACHER_BATCHES, seed: int = 0,
                 noise: float = 0.05) -> tuple[str | None, str]:
    """A synthetic regression task for the model of ``g``: every float input drawn N(0, 1), targets of the
    first output's shape computed by a fixed random teacher (per output element a fixed N(0, 1) offset
    plus a tanh layer of width 32 over the inputs' features mapped linearly to standard deviation 0.5)
    plus ``noise``.  Written to ``out_dir`` as NAME.npy per
    input and targets.npy (`unity-pcg run --data` reads the folder memory-mapped); returns
    ``(out_dir, "mse")``.  Models with integer inputs (token ids, embedding indices), or whose data would
    exceed 256 MiB, get no task: ``(None, loss)`` with the loss of random feeds (mean, or the graph's own
    one-element output)."""
    import numpy as np
    ins = g.sources("Input")
    out = tuple(g.shape(tuple(g.outputs[0])).sizes)
    rows = [n.a["shape"][0] for n in ins if n.a["shape"]]
    per_row = sum(math.prod(n.a["shape"][1:]) for n in ins) + math.prod(out[1:])
    if (not ins or any(not n.a["dtype"].startswith(("float", "bfloat")) for n in ins) or not out
            or len(set(rows)) != 1 or rows[0] != out[0] or per_row * out[0] * batches * 4 > TEACHER_MAX_BYTES):
        print("no synthetic task for this model (integer inputs, or too large): random feeds")
        return None, "output" if math.prod(out) == 1 else "mean"
    rng = np.random.default_rng(seed)
    n = out[0] * batches
    xs = {a.a["name"]: rng.standard_normal((n, *a.a["shape"][1:])).astype(np.float32) for a in ins}
    feat = np.concatenate([v.reshape(n, -1) for v in xs.values()], axis=1)
    w1 = rng.standard_normal((feat.shape[1], 32)) / math.sqrt(feat.shape[1])
    w2 = rng.standard_normal((32, math.prod(out[1:]))) / math.sqrt(32)
    offset = rng.standard_normal((1, w2.shape[1]))
    y = np.tanh(feat @ w1 * 2.0) @ w2
    y = offset + 0.5 * y / y.std()
    t = (y + noise * rng.standard_normal(y.shape)).reshape(n, *out[1:]).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):              # a folder of an earlier run (another model)
        if name.endswith(".npy"):
            os.remove(os.path.join(out_dir, name))
    for name, v in xs.items():
        np.save(os.path.join(out_dir, f"{name}.npy"), v)
    np.save(os.path.join(out_dir, "targets.npy"), t)
    print(f"synthetic task: targets = teacher(inputs) + noise (a fixed random tanh layer with offsets), "
          f"{batches} batches of {out[0]} -> {out_dir}")
    return out_dir, "mse"


def _train(plan_path: str, model_path: str, steps: int, optimizer: str, extra=()) -> float | None:
    """`unity-pcg run PLAN --model MODEL --json`: returns the measured step time (None when the
    executor is not available yet)."""
    import importlib.util
    if importlib.util.find_spec("unity_pcg.commands.run_cmd") is None:
        print("executor (`unity-pcg run`) not available yet: run skipped")
        return None
    cmd = [sys.executable, "-m", "unity_pcg.cli", "run", plan_path, "--model", model_path, "--steps", str(steps),
           "--optimizer", optimizer, *extra, "--json"]
    print("$ unity-pcg " + " ".join(cmd[3:]), flush=True)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise UnityError(f"the run failed: {last}")
    try:
        out = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError:
        raise UnityError("the run printed no JSON result") from None
    losses = out.get("losses") or []
    step = out.get("step_time_s")
    pred = out.get("predicted_iteration_s")
    print(f"{out.get('nproc', '?')} processes, {len(losses)} steps in {wall:.0f} s; {out.get('loss', '?')} loss "
          + (f"{losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "-")
          + (f" (first -> last; {100 * (1 - losses[-1] / losses[0]):.0f}% lower)"
             if len(losses) > 1 and losses[0] > 0 and losses[-1] < losses[0] else ""))
    times = [t for t in (out.get("step_times_s") or [])[1:] if isinstance(t, (int, float))]
    print(f"step time: predicted {_ms(pred)}, measured {_ms(step)} (median after warm-up"
          + (f"; fastest {_ms(min(times))}" if times else "") + ")"
          + (f": {_ratio(step, pred)}" if pred and step else ""))
    load = _loadavg()
    if load is not None and load > (os.cpu_count() or 1):
        print(f"note: this computer is busy (load average {load:.1f} on {os.cpu_count()} cores): "
              "measured times are noisy")
    return step


def _ratio(measured: float, predicted: float) -> str:
    r = measured / predicted
    return f"measured is {r:.2f}x the prediction" if r >= 1 else f"measured is {1 / r:.2f}x faster than predicted"


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
