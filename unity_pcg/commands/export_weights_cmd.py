"""`unity-pcg export-weights CHECKPOINT_DIR -o OUT.onnx [--model MODEL.onnx]`: the trained model of a checkpoint.

Reads the latest complete checkpoint under CHECKPOINT_DIR (``unity-pcg run --checkpoint``; every rank's part
of the model, merged in this process: ``executor.checkpoint.read_model``) and writes what ``run
--save-model`` writes (``executor.export.save_model``): OUT.onnx, the model's graph with the trained
initializers (external data past 2 GiB), and OUT.safetensors beside it.  The model defaults to the one the
checkpoint records (its meta.json: path and sha256); a --model whose sha256 is not the recorded one, a
missing or incomplete checkpoint and an output in a missing folder are refused before anything is written.
"""
from __future__ import annotations

import json
import os
import sys

from ..errors import UnityError

HELP = "write the trained model (ONNX + safetensors) of a run's checkpoint"


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="the --checkpoint folder of a run")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx",
                   help="ONNX file to write (OUT.safetensors is written beside it)")
    p.add_argument("--model", default=None, metavar="MODEL.onnx",
                   help="the run's ONNX model (default: the one the checkpoint records; its sha256 must match)")
    p.add_argument("--external-threshold", type=int, default=None, metavar="BYTES",
                   help="write the tensors as external data (OUT.onnx.data) past this many bytes (default 2 GiB)")
    p.add_argument("--json", action="store_true", help="print the paths written as one JSON object")


def latest_checkpoint(root: str) -> dict:
    """meta.json of the latest complete checkpoint under ``root`` (with "dir"); one-line errors."""
    from unity_pcg.executor.checkpoint import read_meta
    if not os.path.isdir(root):
        raise UnityError(f"checkpoint folder {root} does not exist")
    meta = read_meta(root, context="")
    if not os.path.exists(os.path.join(meta["dir"], ".metadata")):
        raise UnityError(f"checkpoint {meta['dir']} is incomplete (no .metadata)")
    return meta


def resolve_model(meta: dict, model: str | None) -> str:
    """The model to write: --model (checked against the recorded sha256) or the recorded one."""
    from ..plan import file_sha256
    d = meta["dir"]
    path = model or meta.get("model")
    if not path:
        raise UnityError(f"checkpoint {d} does not record its model (written by an older run): pass --model MODEL.onnx")
    if not os.path.isfile(path):
        raise UnityError(f"model {path}: no such file" + ("" if model else f" (recorded by checkpoint {d}); pass --model"))
    want = meta.get("model_sha256")
    if want is not None and file_sha256(path) != want:
        raise UnityError(f"model {path} is not the model checkpoint {d} was trained from (sha256 differs)")
    return path


def export(args) -> dict:
    """The checks and the writing of `unity-pcg export-weights` (also `unity_pcg.export_weights`): what
    ``executor.export.save_model`` returns, plus the checkpoint's step and folder and the model."""
    from unity_pcg.executor.export import EXTERNAL_THRESHOLD, check_output
    root = os.path.abspath(args.checkpoint)
    meta = latest_checkpoint(root)
    model = resolve_model(meta, args.model)
    out = check_output(args.output, "-o")
    if args.external_threshold is not None and args.external_threshold < 0:
        raise UnityError(f"--external-threshold must be >= 0, got {args.external_threshold}")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UnityError("export-weights needs torch to read checkpoints (pip install 'unity-pcg[torch]')") from None
    from unity_pcg.executor.checkpoint import read_model
    from unity_pcg.executor.export import save_model
    try:
        state = read_model(root)
    except UnityError:
        raise
    except Exception as e:  # noqa: BLE001 -- DCP's errors on missing or truncated files
        raise UnityError(f"checkpoint {meta['dir']} is incomplete or unreadable ({type(e).__name__})") from None
    thr = EXTERNAL_THRESHOLD if args.external_threshold is None else args.external_threshold
    res = save_model(model, state, out, external_threshold=thr)
    return {**res, "step": meta["step"], "checkpoint": meta["dir"], "model": model}


def run(args) -> int:
    res = export(args)
    if res["skipped"]:
        print(f"unity-pcg export-weights: warning: trained weights not written back (not a layout of one "
              f"initializer): {', '.join(res['skipped'][:8])}", file=sys.stderr)
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"wrote {res['onnx']}" + (f" (+ {res['external_data']})" if res["external_data"] else "")
              + f" and {res['safetensors']}: {len(res['written'])} trained initializers of step {res['step']} "
              f"({res['checkpoint']})")
    return 0
