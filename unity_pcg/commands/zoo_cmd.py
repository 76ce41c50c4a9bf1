"""`unity-pcg zoo list` / `unity-pcg zoo export NAME --size S [--weights random|none] -o FILE`."""
from __future__ import annotations

import json
import sys
import time

from ..errors import UnityError

HELP = "list or export the models of Unity's evaluation (Table 1) as ONNX"


class ZooCommandError(UnityError):
    pass


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="list the models")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ex = sub.add_parser("export", help="export a model to ONNX with random weights")
    ex.add_argument("name", help="model name (see `unity-pcg zoo list`)")
    ex.add_argument("--size", default="tiny",
                    help="tiny: seconds on CPU, for tests; paper: the dimensions of Unity §6.1; small "
                         "(dlrm, candle_uno): their earlier published configurations; paper6 (dlrm): "
                         "6 embedding tables")
    ex.add_argument("--batch", type=int, default=None, help="batch size (default: the size's per-device batch)")
    ex.add_argument("--weights", default="random", choices=["random", "none"],
                    help="random: seeded random weights; none: the graph and every weight's shape, no bytes (a "
                         "sparse data file; any size in little memory; for planning, `run` refuses it)")
    ex.add_argument("--exporter", default=None, choices=["legacy", "dynamo", "auto"],
                    help="torch.onnx exporter (dynamo needs onnxscript); default legacy, and with --weights none "
                         "auto: the legacy narrow twin where it is exact, else dynamo from the meta device")
    ex.add_argument("--fold-batchnorm", action="store_true",
                    help="fold BatchNorm into the preceding Conv (inference graph); kept by default")
    ex.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ex.add_argument("-o", "--output", required=True, help="output .onnx path")


def run(args) -> int:
    from .. import zoo
    if args.action == "list":
        entries = zoo.list_models()
        if args.json:
            print(json.dumps({e.name: {"description": e.description, "paper_batch": e.paper_batch,
                                       "tiny_batch": e.tiny_batch} for e in entries}))
        else:
            w = max(len(e.name) for e in entries)
            for e in entries:
                print(f"{e.name:<{w}}  paper batch {e.paper_batch:>5}  {e.description}")
        return 0
    if args.batch is not None and args.batch < 1:
        raise ZooCommandError(f"--batch must be positive, got {args.batch}")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ZooCommandError("exporting needs PyTorch; install it (see README)") from None
    t = time.perf_counter()
    if args.weights == "none":
        exporter = args.exporter or "auto"
        try:
            path = zoo.export_structure(args.name, args.output, size=args.size, batch=args.batch, exporter=exporter,
                                        progress=lambda m: print(f"[{time.perf_counter() - t:6.1f} s] {m}",
                                                                 file=sys.stderr, flush=True))
        except zoo.ZooError as e:
            raise ZooCommandError(str(e)) from None
        except OSError as e:
            raise ZooCommandError(f"cannot write {args.output}: {e.strerror or e}") from None
        print(f"wrote {path} ({args.name}, {args.size}, no weights, {exporter} exporter) in "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
        return 0
    if args.exporter == "auto":
        raise ZooCommandError("--exporter auto is for --weights none")
    args.exporter = args.exporter or "legacy"
    try:
        path = zoo.export(args.name, args.output, size=args.size, batch=args.batch, exporter=args.exporter,
                          seed=args.seed, keep_batchnorm=False if args.fold_batchnorm else None)
    except zoo.ZooError as e:
        raise ZooCommandError(str(e)) from None
    except OSError as e:
        raise ZooCommandError(f"cannot write {args.output}: {e.strerror or e}") from None
    print(f"wrote {path} ({args.name}, {args.size}, {args.exporter} exporter) in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)
    return 0
