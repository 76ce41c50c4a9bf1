"""`unity-pcg export-structure (CONFIG.json | --factory MODULE:FUNCTION --input NAME:DIMS:DTYPE ...) [--batch B]
[--seq S] -o MODEL.onnx`: write a model's ONNX graph at full size without its weights.

Every weight keeps its real shape and dtype and points into ``MODEL.onnx.data``, a sparse file of zeros (no
disk blocks); the file is marked weight-free, so ``import``, ``simulate``, ``optimize`` and ``explain`` plan it
and ``run`` refuses it.  A transformers config (``config.json`` or its folder; needs the transformers package)
is built with ``from_config`` (no download) and fed ``input_ids`` [B, S]; a factory is a callable returning a
``torch.nn.Module``, fed the ``--input`` shapes.  See unity_pcg/zoo/structure.py for the method.
"""
from __future__ import annotations

import json
import os
import sys
import time

from ..errors import UnityError

HELP = "write a model's ONNX graph at full size without its weights (a transformers config or a module factory)"


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", help="a transformers config.json (or the folder holding it)")
    p.add_argument("--factory", metavar="MODULE:FUNCTION",
                   help="a callable returning a torch.nn.Module (package.module:fn or path/file.py:fn)")
    p.add_argument("--input", action="append", default=[], metavar="NAME:DIMS:DTYPE",
                   help="an input of the factory's module, e.g. x:8x1024:float32 (repeat per input)")
    p.add_argument("--batch", type=int, default=1, help="batch of a config's input_ids (default 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length of a config's input_ids (default: its maximum positions, at most 4096)")
    p.add_argument("-o", "--output", required=True, help="output .onnx path (the weights' sparse file is OUTPUT.data)")
    p.add_argument("--json", action="store_true", help="print one JSON object (path, parameters, seconds)")


def run(args) -> int:
    if bool(args.config) == bool(args.factory):
        raise UnityError("give a transformers config.json or --factory MODULE:FUNCTION (one of them)")
    if args.batch < 1:
        raise UnityError(f"--batch must be positive, got {args.batch}")
    if args.seq is not None and args.seq < 1:
        raise UnityError(f"--seq must be positive, got {args.seq}")
    if args.config and args.input:
        raise UnityError("--input is for --factory; a config's input is input_ids [--batch, --seq]")
    if args.config and not os.path.exists(args.config):
        raise UnityError(f"{args.config}: no such file")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UnityError("export-structure needs PyTorch; install it (see README)") from None
    from ..zoo import structure
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    if args.factory:
        inputs = args.input
        if not inputs:
            raise UnityError("--factory needs the module's inputs: --input NAME:DIMS:DTYPE (repeat per input)")
        for spec in inputs:
            structure.parse_input_spec(spec)     # a bad spec fails before the factory is imported
        source = structure.load_factory(args.factory)
    else:
        source, inputs = args.config, None
    try:
        res = structure.export_structure(source, args.output, inputs=inputs, batch=args.batch, seq=args.seq,
                                         progress=say)
    except OSError as e:
        raise UnityError(f"cannot write {args.output}: {e.strerror or e}") from None
    total = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"path": res.path, "data": res.data_path, "source": res.source,
                          "parameters": res.parameters, "weight_elements": res.weight_elements,
                          "weight_bytes": res.weight_bytes, "inputs": res.inputs, "outputs": res.outputs,
                          "seconds": {**{k: round(v, 3) for k, v in res.seconds.items()}, "total": round(total, 3)}}))
    print(f"wrote {res.path} ({res.source}, {res.parameters / 1e9:.3g}B parameters, "
          f"{res.weight_bytes / 2**30:.1f} GiB of weights as a sparse file) in {total:.1f} s", file=sys.stderr)
    return 0
