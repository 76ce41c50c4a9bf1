"""`unity-pcg run plan.json --model MODEL.onnx [--steps N] [--nproc K] [--data FILE.npz|DIR]
[--loss mean|mse|ce|bce|output] [--optimizer sgd|momentum|adam] [--lr X] [--checkpoint DIR] [--resume] [--save-model OUT.onnx]
[--json] [--seed S] [--per-device-bn]`: train with a plan on local ranks.

Everything that can be checked is checked before a process starts (executor/launch.py ``check``): the plan
loads and validates, the model's sha256 is the plan's, ``--nproc`` (default: the plan's device count) is
the plan's device count, the --data file or folder fits the model (shapes, dtypes, and its values scanned in
bounded chunks: no NaN/inf, embedding indices in range), the loss (--loss, or derived from the targets and
printed) fits the targets, --resume finds a checkpoint of the same loss.  Then K local ranks
run ``python -m unity_pcg.executor`` under torch's elastic launch API; rank 0 prints one line per step.  ``--json``
prints one JSON object at the end (losses, step_time_s, predicted_iteration_s, nproc, ...) and sends the
progress lines to stderr.  torch is imported only here, when the command runs.
"""
from __future__ import annotations

import json
import os
import sys

from ..errors import UnityError

HELP = "train an ONNX model with a plan on torch.distributed (local processes or torchrun)"


def add_arguments(p) -> None:
    from unity_pcg.executor.__main__ import add_training_arguments
    add_training_arguments(p)
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="local processes (ranks); must be the plan's device count (default: that count)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end (progress to stderr)")


def _rank_args(args) -> list[str]:
    out = [os.path.abspath(args.plan), "--model", os.path.abspath(args.model), "--steps", str(args.steps),
           "--optimizer", args.optimizer, "--lr", repr(args.lr), "--seed", str(args.seed),
           "--timeout", repr(args.timeout), "--progress", "stderr" if args.json else "stdout", "--loss", args.loss]
    if args.data:
        out += ["--data", os.path.abspath(args.data)]
    if args.checkpoint:
        out += ["--checkpoint", os.path.abspath(args.checkpoint), "--checkpoint-every", str(args.checkpoint_every)]
    if args.resume:
        out.append("--resume")
    if args.save_model:
        out += ["--save-model", os.path.abspath(args.save_model)]
    if args.per_device_bn:
        out.append("--per-device-bn")
    return out


def precheck(args):
    """Every check that needs no process: returns (plan, nproc)."""
    from unity_pcg.executor.launch import check
    if args.steps < 0:
        raise UnityError(f"--steps must be >= 0, got {args.steps}")
    if args.checkpoint_every < 0:
        raise UnityError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.resume and not args.checkpoint:
        raise UnityError("--resume needs --checkpoint DIR")
    if args.save_model:
        from unity_pcg.executor.export import check_output
        check_output(args.save_model)
    if args.checkpoint:
        from unity_pcg.executor.checkpoint import check_writable
        check_writable(args.checkpoint)
    plan, world = check(args.plan, args.model, args.nproc, args.per_device_bn)
    from unity_pcg.executor.launch import plan_optimizer
    args.optimizer = args.optimizer or plan_optimizer(plan)
    import torch
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise UnityError(f"plan {args.plan} runs on {world} ranks, one per GPU, but this machine has "
                         f"{torch.cuda.device_count()} GPU(s); run it with torchrun across machines")
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.loss import check_loss, check_resume_loss, resolve_loss
    data = open_data(plan.pcg, args.data, seed=args.seed)
    args.loss, args.loss_note = resolve_loss(plan.pcg, args.loss, data)
    check_loss(plan.pcg, args.loss, data)
    if args.resume:
        from unity_pcg.executor.checkpoint import check_resume, memory_json

        from ..plan import file_sha256
        check_resume(args.checkpoint, file_sha256(args.plan), args.optimizer, world, memory_json(plan))
        check_resume_loss(args.checkpoint, args.loss)
    return plan, world


def train(args) -> dict:
    """The checks and the run of `unity-pcg run` (also `unity_pcg.train`): rank 0's result dict, or
    ``executor.launch.RunFailed`` (a UnityError with the exit ``code``) naming why the run failed."""
    plan, world = precheck(args)
    from unity_pcg.executor.launch import launch
    if getattr(args, "loss_note", None):
        print(f"loss: {args.loss_note}", file=sys.stderr if args.json else sys.stdout, flush=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    if threads < 1:
        raise UnityError(f"--threads must be a positive integer, got {threads}")
    return launch(_rank_args(args) + ["--threads", str(threads)], world).result


def run(args) -> int:
    from unity_pcg.executor.launch import RunFailed
    try:
        res = train(args)
    except RunFailed as e:
        print(f"unity-pcg run: error: {e}", file=sys.stderr)
        return e.code
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
