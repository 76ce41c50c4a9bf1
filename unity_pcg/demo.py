"""The main job end to end on the bundled default (what `./run.sh` runs).

1. export a zoo model (default: BERT-Large at --size tiny) to ONNX,
2. import it as a PCG and check the import numerically against onnxruntime when available,
3. load the shipped, verified rule set and count its matches on the model,
4. predict the iteration time of single-device and data-parallel training on a machine preset.

Every stage prints what it did; a failing stage prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .errors import UnityError


def _stage(title: str) -> None:
    print(f"\n== {title}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="unity_pcg.demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert_large", help="zoo model (default bert_large)")
    p.add_argument("--size", default="tiny", choices=["tiny", "paper"])
    p.add_argument("--machine", default="summit:1x6", help="machine preset for the prediction")
    p.add_argument("--batch", type=int, default=24, help="global batch size (default 24)")
    p.add_argument("--out", default="out/demo", help="working directory for exported files")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except UnityError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from . import zoo
    from .onnx_import import load_onnx

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.model}_{args.size}.onnx")

    _stage(f"1. export {args.model} ({args.size}) to ONNX")
    t = time.perf_counter()
    zoo.export(args.model, path, size=args.size, batch=args.batch)
    print(f"wrote {path} in {time.perf_counter() - t:.1f} s")

    _stage("2. import as a parallel computation graph")
    t = time.perf_counter()
    g = load_onnx(path)
    s = g.summary()
    print(f"{s['ops']} operators, {s['params']:,} parameters, {s['flops'] / 1e9:.3f} GFLOP per forward pass, "
          f"imported in {time.perf_counter() - t:.2f} s")
    print("operators: " + ", ".join(f"{k} {v}" for k, v in s["op_types"].items()))
    if args.size == "tiny":
        _check_numerics(g, path)

    _stage("3. verified substitution rules")
    _rules(g)

    _stage(f"4. predicted training iteration on {args.machine}")
    from .commands.simulate_cmd import simulate
    for strategy in ("none", "dp"):
        r = simulate(path, args.machine, strategy)
        t_s = r["predicted_iteration_s"]
        mem = r["max_memory_bytes"]
        print(f"{strategy:>5}: {r['degree']} device(s), "
              + (f"{t_s * 1e3:.3f} ms/iteration" if t_s is not None else "infeasible")
              + (f", {mem / 2**20:.1f} MiB on the busiest device" if mem is not None else "")
              + f", {r['comm_elements']:,} elements communicated")
    return 0


def _check_numerics(g, path: str) -> None:
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


def _rules(g) -> None:
    from substitutions.cache import load_rules
    from substitutions.match import find_matches
    t = time.perf_counter()
    rules = load_rules()
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    n = sum(len(find_matches(r, g)) for r in rules)
    print(f"{len(rules)} proven rules loaded in {load_s:.2f} s; {n} matches on this model "
          f"({time.perf_counter() - t:.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
