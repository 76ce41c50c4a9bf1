"""`unity-pcg import MODEL.onnx [--batch N] [--json] [--dot FILE] [--png FILE]`: show an ONNX model as a PCG."""
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


def _human(x: float) -> str:
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.2f}{unit}"
    return f"{x:g}"


def run(args) -> int:
    from ..onnx_import import load_onnx

    if args.batch is not None and args.batch < 1:
        raise UnityError(f"--batch must be a positive integer, got {args.batch}")
    if args.png and shutil.which("dot") is None:
        raise RenderError("--png needs Graphviz `dot`, which is not installed (apt-get install graphviz), "
                          "or use --dot FILE")
    t0 = time.perf_counter()
    g = load_onnx(args.model, batch=args.batch, load_weights=False)
    seconds = time.perf_counter() - t0
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
        print(json.dumps(out))
        return 0
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
    return 0


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UnityError(f"cannot write {path}: {e.strerror}") from None
