"""`unity-pcg explain PLAN.json [--dot FILE] [--png FILE] [--limit N] [--json]`: show a plan -- parallel
degrees and machine views per operator, the rules applied, where communication happens and how much, the
gradient all-reduces, the pipeline stages -- and draw its PCG (DOT always; PNG with graphviz)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from ..errors import UnityError

HELP = "show a plan: parallel degrees, machine views, rules applied, communication, stages"


# graphviz lays out a few hundred nodes in seconds, thousands in minutes: draw a PNG by default only below
AUTO_PNG_NODES = 300


class RenderError(UnityError):
    """Graphviz is missing or failed, or a drawing cannot be written."""


def add_arguments(p) -> None:
    p.add_argument("plan", metavar="PLAN.json", help="plan file (from `unity-pcg optimize` or `simulate -o`)")
    p.add_argument("--dot", metavar="FILE", help="write the PCG as Graphviz DOT to FILE "
                   "(default: next to the plan, PLAN.dot)")
    p.add_argument("--png", metavar="FILE", help="render the PCG to FILE with Graphviz `dot` "
                   f"(default when `dot` is installed and the PCG has at most {AUTO_PNG_NODES} nodes: PLAN.png)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="show the first N operators and the N most expensive transfers and weights (default all)")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default=None,
                   help="optimizer for re-pricing (default: the one the plan records, else adam)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _stem(path: str) -> str:
    root, ext = os.path.splitext(path)
    return root if ext.lower() == ".json" else path


def write_drawings(plan, e, dot_path: str | None, png_path: str | None) -> dict:
    """Write the DOT (always, when a path is given) and the PNG (when asked and graphviz exists)."""
    from ..explanation import to_dot
    text = to_dot(plan, e)
    out = {"dot": None, "png": None}
    if dot_path:
        try:
            with open(dot_path, "w") as f:
                f.write(text)
        except OSError as err:
            raise RenderError(f"cannot write {dot_path}: {err.strerror or err}") from None
        out["dot"] = dot_path
    if png_path:
        exe = shutil.which("dot")
        if exe is None:
            raise RenderError("--png needs Graphviz `dot`, which is not installed (apt-get install graphviz)")
        try:
            r = subprocess.run([exe, "-Tpng", "-o", png_path], input=text.encode(), capture_output=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise RenderError(f"graphviz dot failed: {err}") from None
        if r.returncode != 0 or not os.path.exists(png_path):
            msg = r.stderr.decode(errors="replace").strip().splitlines()
            raise RenderError(f"graphviz dot failed to write {png_path}: {msg[0] if msg else r.returncode}")
        out["png"] = png_path
    return out


def run(args) -> int:
    from .. import plan as P
    from ..explanation import explain, format_text

    if args.limit is not None and args.limit < 1:
        raise UnityError(f"--limit must be a positive integer, got {args.limit}")
    if args.png and shutil.which("dot") is None:
        raise RenderError("--png needs Graphviz `dot`, which is not installed (apt-get install graphviz), "
                          "or use --dot FILE")
    pl = P.load(args.plan)
    e = explain(pl, optimizer=args.optimizer)
    stem = _stem(args.plan)
    dot_path = args.dot or f"{stem}.dot"
    auto_png = shutil.which("dot") is not None and len(pl.pcg) <= AUTO_PNG_NODES
    png_path = args.png or (f"{stem}.png" if auto_png else None)
    files = write_drawings(pl, e, dot_path, png_path)
    if args.json:
        obj = e.to_json()
        obj["files"] = files
        json.dump(obj, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(format_text(e, limit=args.limit))
    print()
    if files["png"]:
        note = f" and {files['png']}"
    elif shutil.which("dot") is None:
        note = " (install graphviz for a PNG: dot -Tpng)"
    else:
        note = f" (no PNG by default for {len(pl.pcg)} nodes: --png FILE draws it)"
    print(f"PCG drawn to {files['dot']}{note}")
    return 0
