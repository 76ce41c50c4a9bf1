"""`unity-pcg import MODEL.onnx [--batch N] [--json] [--dot FILE] [--png FILE] [--check [--seed S]]`: show an ONNX
model as a PCG; with ``--check``, also compare the PCG's numpy evaluation with onnxruntime (exit 1 if they differ)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from ..errors import UnityError

HELP = "import an ONNX model and show it as a PCG"


class RenderError(UnityError):
    """Graphviz is missing or failed to render a PNG."""


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="ONNX model file (external data is read next to it)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="batch size: replaces the first dimension of every graph input (required when it is dynamic)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--dot", metavar="FILE", help="write the PCG as Graphviz DOT to FILE")
    p.add_argument("--png", metavar="FILE", help="render the PCG to FILE with Graphviz `dot` (must be installed)")
    p.add_argument("--check", action="store_true",
                   help="evaluate the PCG with numpy and onnxruntime on the same seeded random inputs (integer "
                        "inputs: indices below the size of the table they index, else 0/1) and compare every "
                        "output: equal when |pcg - ort| <= f * (1e-5 * max|ort| + 1e-4 * |ort|) elementwise, "
                        "f = sqrt(depth), depth = compute operators on the longest path; exit 1 if not. "
                        "Random operators are switched off on both sides (Dropout in training mode as in "
                        "inference, random generators by their mean or, for Bernoulli/Multinomial, their most likely "
                        "value) and the output says so")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of --check's random inputs (default 0)")
    p.add_argument("--no-fuse", action="store_true",
                   help="keep the exporter's decompositions of GELU, LayerNorm, RMSNorm and SiLU as they are "
                        "(no pattern fusion at import)")


def _human(x: float) -> str:
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.2f}{unit}"
    return f"{x:g}"


def load(args):
    """The checks, the import and the optional numerical check of `unity-pcg import` (also
    `unity_pcg.import_model`): ``(pcg, check result or None, import seconds)``."""
    from ..onnx_import import load_onnx

    if args.batch is not None and not (isinstance(args.batch, int) and args.batch >= 1):
        raise UnityError(f"--batch must be a positive integer, got {args.batch}")
    t0 = time.perf_counter()
    g = load_onnx(args.model, batch=args.batch, load_weights=bool(args.check), fuse=not args.no_fuse)
    seconds = time.perf_counter() - t0
    chk = None
    if args.check:
        from ..onnx_import.check import check_model
        chk = check_model(args.model, batch=args.batch, seed=args.seed, graph=g)
    return g, chk, seconds


def run(args) -> int:
    if args.png and shutil.which("dot") is None:
        raise RenderError("--png needs Graphviz `dot`, which is not installed (apt-get install graphviz), "
                          "or use --dot FILE")
    g, chk, seconds = load(args)
    s = g.summary()
    if args.dot or args.png:
        dot = g.to_dot()
        if args.dot:
            _write(args.dot, dot)
        if args.png:
            try:
                r = subprocess.run(["dot", "-Tpng", "-o", args.png], input=dot.encode(), capture_output=True,
                                   timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise RenderError(f"graphviz dot failed: {e}") from None
            if r.returncode != 0:
                msg = r.stderr.decode(errors="replace").strip().splitlines()
                raise RenderError(f"graphviz dot failed to write {args.png}: {msg[0] if msg else r.returncode}")
    inputs = [{"name": n.a["name"], "shape": list(n.a["shape"]), "dtype": n.a["dtype"]} for n in g.sources("Input")]
    if args.json:
        out = {"model": os.path.basename(args.model), "ops": s["ops"], "op_types": s["op_types"], "params": s["params"],
               "flops": s["flops"], "weights": s["weights"], "inputs": inputs,
               "outputs": [list(g.shape(r).sizes) for r in g.outputs], "onnx_nodes": g.meta.get("onnx_nodes"),
               "opset": g.meta.get("opset"), "batch": args.batch, "import_seconds": round(seconds, 4)}
        if chk is not None:
            out["check"] = chk.to_json()
        print(json.dumps(out))
        return 0 if chk is None or chk.ok else 1
    w = sys.stdout.write
    w(f"{args.model}: ONNX opset {g.meta.get('opset')}, {g.meta.get('onnx_nodes')} ONNX nodes -> "
      f"PCG of {s['ops']} operators, {s['weights']} weights\n")
    for i in inputs:
        w(f"  input  {i['name']}: {i['dtype']}{i['shape']}\n")
    for k, r in enumerate(g.outputs):
        w(f"  output {k}: {g.shape(r).dtype}{list(g.shape(r).sizes)}\n")
    w("operators:\n")
    width = max((len(k) for k in s["op_types"]), default=4)
    for k, v in sorted(s["op_types"].items(), key=lambda kv: (-kv[1], kv[0])):
        w(f"  {k:<{width}}  {v:>6}\n")
    w(f"parameters: {s['params']:,} ({_human(s['params'])})\n")
    w(f"FLOPs (one forward pass): {s['flops']:.4g} ({_human(s['flops'])})\n")
    w(f"import time: {seconds:.3f} s\n")
    if args.dot:
        w(f"wrote {args.dot}\n")
    if args.png:
        w(f"wrote {args.png}\n")
    if chk is not None:
        _write_check(w, chk)
        return 0 if chk.ok else 1
    return 0


def _write_check(w, chk) -> None:
    w(f"check against onnxruntime (seed {chk.seed}; depth {chk.depth}, tolerance f = {chk.factor:.3g} x "
      f"(atol {chk.atol:g} x max|ort| + rtol {chk.rtol:g} x |ort|)")
    if chk.int_bounds:
        w("; integer inputs below " + ", ".join(f"{k}: {v}" for k, v in chk.int_bounds.items()))
    w(")")
    if chk.reference != "onnxruntime":
        w(f"; reference: {chk.reference}")
    w(":\n")
    if chk.randomness:
        w(f"  {chk.randomness}\n")
    width = max((len(o.name) for o in chk.outputs), default=6)
    for o in chk.outputs:
        w(f"  {o.name:<{width}}  {o.dtype}{list(o.shape)}  max abs err {o.max_abs:.3g}  max rel err {o.max_rel:.3g}"
          f"  ({o.ratio:.3g} of tolerance)  {'ok' if o.ok else 'DIFFERENT: ' + o.why}\n")
    w(f"check: {'equal' if chk.ok else 'DIFFERENT'} (max abs err {chk.max_abs:.3g}, max rel err {chk.max_rel:.3g}; "
      f"numpy {chk.eval_seconds:.2f} s, onnxruntime {chk.ort_seconds:.2f} s)\n")


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UnityError(f"cannot write {path}: {e.strerror}") from None
