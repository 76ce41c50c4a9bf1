"""`unity-pcg` command line.

Each subcommand lives in its own module (``unity_pcg/commands/*.py``, or another package's
``cli`` module) exposing ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.  Errors a
user can cause are ``UnityError``s: printed as one line, exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import UnityError

# name -> module; modules are imported only when their command runs (fast start, no torch)
COMMANDS: dict[str, str] = {
    "import": "unity_pcg.commands.import_cmd",
    "zoo": "unity_pcg.commands.zoo_cmd",
    "export-structure": "unity_pcg.commands.export_structure_cmd",
    "rules": "unity_pcg.commands.rules_cmd",
    "calibrate": "unity_pcg.commands.calibrate_cmd",
    "simulate": "unity_pcg.commands.simulate_cmd",
    "optimize": "unity_pcg.commands.optimize_cmd",
    "explain": "unity_pcg.commands.explain_cmd",
    "run": "unity_pcg.commands.run_cmd",
    "export-weights": "unity_pcg.commands.export_weights_cmd",
}

# one-line help per command, kept here so `unity-pcg --help` imports nothing heavy
HELP: dict[str, str] = {
    "import": "import an ONNX model and show it as a PCG",
    "zoo": "list or export the models of Unity's evaluation as ONNX",
    "export-structure": "write a model's ONNX graph at full size without weights (transformers config or factory)",
    "rules": "generate, verify and inspect the verified substitution rules",
    "calibrate": "measure this computer and write a machine description (JSON)",
    "simulate": "predict iteration time, communication and memory of a fixed parallelization",
    "optimize": "search the fastest parallelization plan that fits memory (Unity's joint search)",
    "explain": "show a plan: parallel degrees, machine views, rules applied, communication, stages",
    "run": "train an ONNX model with a plan on torch.distributed (local processes or torchrun)",
    "export-weights": "write the trained model (ONNX + safetensors) of a run's checkpoint",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unity-pcg", description="Joint algebraic and parallelization optimization "
                                "of DNN training over parallel computation graphs (after Unity, OSDI'22).")
    p.add_argument("--version", action="version", version=f"unity-pcg {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=HELP.get(name, ""), add_help=False)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("unity-pcg")
    except Exception:
        return "0+unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv or ["--help"])  # prints help / errors (exit 2 from argparse)
        return 2
    name = argv[0]
    mod = importlib.import_module(COMMANDS[name])
    p = argparse.ArgumentParser(prog=f"unity-pcg {name}", description=HELP.get(name) or mod.HELP)
    mod.add_arguments(p)
    args = p.parse_args(argv[1:])
    try:
        return int(mod.run(args) or 0)
    except UnityError as e:
        print(f"unity-pcg {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"unity-pcg {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


#: commands whose work is done once ``main`` returns (their output written): the console script ends their
#: process there, without the interpreter's teardown of the heap they built (freeing a search's graphs,
#: memos and mappings one object at a time: seconds on a full-depth model on a starved core, after the plan
#: was written, counted against ``optimize --budget``)
FAST_EXIT = ("optimize", "simulate", "explain", "import")


def console() -> None:
    """The ``unity-pcg`` command (the console script; ``python -m unity_pcg.cli``): :func:`main`, then for the
    commands of :data:`FAST_EXIT` the process ends at once (stdout and stderr flushed, ``os._exit``); the
    others exit as usual."""
    rc = main()
    if len(sys.argv) > 1 and sys.argv[1] in FAST_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (BrokenPipeError, ValueError):
            pass
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    console()
