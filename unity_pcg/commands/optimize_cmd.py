"""`unity-pcg optimize MODEL.onnx --machine M [--budget S] [--alpha A] [--no-pipeline] [--strategy S]
[--optimizer O] [--precision fp32|tf32|bf16] [--batch N] [--seed S] -o plan.json [--json]`: search a plan (search/optimize.py),
show progress on stderr, write the plan and print a summary (or one JSON object)."""
from __future__ import annotations

import gc
import json
import math
import sys
import time

from ..errors import UnityError

HELP = "search the fastest parallelization plan that fits memory (Unity's joint search)"

STRATEGY_CHOICES = ("unity", "sequential", "dp", "megatron", "zero3", "expert", "none", "alpa")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="ONNX model file")
    p.add_argument("--machine", default="summit:1x6", metavar="M",
                   help="PRESET[:NODESxDEVICES] (summit, dgx-a100, h100, local) or a machine JSON file "
                        "(default summit:1x6)")
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="search time budget in seconds (default 60)")
    p.add_argument("--candidates", type=int, default=40, metavar="N",
                   help="candidates expanded per distinct subgraph (default 40)")
    p.add_argument("--alpha", type=float, default=1.05, metavar="A",
                   help="prune candidates slower than A times the best (default 1.05)")
    p.add_argument("--no-pipeline", action="store_true", help="do not consider pipeline parallelism")
    p.add_argument("--no-memory-techniques", action="store_true",
                   help="price plans without ZeRO, recomputation, offload and overlap of the gradient sync")
    p.add_argument("--strategy", default="unity", metavar="S",
                   help=f"one of {', '.join(STRATEGY_CHOICES)} (default unity: the joint search; alpa: "
                        "Alpa's intra-operator ILP and inter-operator stage DP, priced in our cost model)")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="adam",
                   help="optimizer whose states count in memory and update time (default adam)")
    from .simulate_cmd import add_precision_argument
    add_precision_argument(p)
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="global batch size: replaces the first dim of every model input")
    p.add_argument("--seed", type=int, default=0, help="recorded in the plan; the search is deterministic")
    p.add_argument("-o", "--output", default="plan.json", metavar="plan.json", help="plan file to write")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")


class _Progress:
    """The search's progress on stderr: a progress bar over the budget's seconds where stderr is a terminal
    (unity_pcg.progress), else one line rewritten in place (at most every 0.2 s)."""

    def __init__(self, stream=None, total_s: float | None = None, show: bool | None = None):
        from ..progress import time_bar
        # the stream of the moment (a default bound at import would keep a replaced, since closed, stderr)
        self.stream = stream if stream is not None else sys.stderr
        self.last, self.t0, self.shown = 0.0, time.perf_counter(), False
        bar = time_bar("search", total_s, stream=self.stream, show=show) if total_s else None
        self.bar = bar if getattr(bar, "drawn", False) else None

    def __call__(self, info: dict) -> None:
        now = time.perf_counter()
        if now - self.last < 0.2:
            return
        self.last = now
        best = info.get("best_segment_s", info.get("best_s"))
        seg = f"subgraph {info['segment']}/{info['segments']}  " if "segment" in info else ""
        b = f"{best * 1e3:.3f} ms" if isinstance(best, float) and math.isfinite(best) else "-"
        if self.bar is not None:
            self.bar.advance_to(now - self.t0, f"{seg}explored {info.get('explored', 0)}  best {b}")
            return
        self.stream.write(f"\r[{now - self.t0:6.1f} s] {seg}candidates explored {info.get('explored', 0):5d}  "
                          f"best so far {b}   ")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def search(args, progress=None):
    """The checks and the search of `unity-pcg optimize` (also `unity_pcg.optimize`): an OptimizeResult."""
    from unity_pcg.search.optimize import STRATEGIES, optimize
    from .simulate_cmd import check_precision_arg
    check_precision_arg(getattr(args, "precision", "fp32"))
    if args.strategy not in STRATEGIES:
        raise UnityError(f"unknown strategy {args.strategy!r} (known: {', '.join(STRATEGIES)})")
    if not (isinstance(args.budget, (int, float)) and args.budget > 0):
        raise UnityError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.batch is not None and not (isinstance(args.batch, int) and args.batch >= 1):
        raise UnityError(f"--batch must be a positive integer, got {args.batch}")
    from unity_pcg.search import budget as B
    # the budget counts from the process's start (the interpreter and the imports are the user's wait too)
    bud = B.for_call(args.budget, start=B.process_start())
    return optimize(args.model, args.machine, budget_s=bud, alpha=args.alpha,
                    pipeline=not args.no_pipeline, strategy=args.strategy, optimizer=args.optimizer,
                    batch=args.batch, seed=args.seed, progress=progress, max_candidates=args.candidates,
                    precision=getattr(args, "precision", "fp32"),
                    memory_techniques=not getattr(args, "no_memory_techniques", False))


def run(args) -> int:
    prog = None if args.json else _Progress(total_s=args.budget)
    try:
        res = search(args, prog)
    finally:
        if prog is not None:
            prog.done()
    # the plan and its report are written next, then the process ends (cli.FAST_EXIT): a full collection of
    # the search's heap would only delay them (restored for a caller in the same process)
    was = gc.isenabled()
    gc.disable()
    try:
        return _write(args, res)
    finally:
        if was:
            gc.enable()


def _write(args, res) -> int:
    """The plan file and the report of ``unity-pcg optimize`` (JSON with ``--json``)."""
    res.plan.save(args.output)
    out = res.json()
    out["plan"] = args.output
    out["precision"] = res.plan.precision
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if out["feasible"] else 1
    t = out["predicted_iteration_s"]
    print(f"plan        {args.output}  ({out['strategy']}, {out['rule_steps']} rule steps"
          + (", interrupted: best so far" if out["interrupted"] else "") + ")")
    print(f"machine     {res.plan.machine.describe()}  ({out['devices']} devices, {out['devices_used']} used)")
    print(f"precision   {res.plan.precision}")
    print(f"feasible    {'yes' if out['feasible'] else 'NO: ' + out['reason']}")
    if t is not None:
        thr = out["throughput_samples_s"]
        print(f"iteration   {t * 1e3:.3f} ms predicted" + (f"  ({thr:,.1f} samples/s, batch {out['batch']})"
                                                          if thr else ""))
    mx = out["max_memory_bytes"]
    if mx is not None:
        print(f"memory      {mx / 2**30:.3f} GiB on the busiest device")
    print(f"comm        {out['comm_elements']:,} elements sent per iteration (all devices)")
    dpt = out["data_parallel_iteration_s"]
    if dpt is not None and out["data_parallel_feasible"] and out["speedup_over_dp"]:
        print(f"vs dp       {dpt * 1e3:.3f} ms data parallel: speedup {out['speedup_over_dp']:.2f}x")
    elif out["data_parallel_feasible"] is False:
        print(f"vs dp       data parallel does not fit: {out['data_parallel_reason']}")
    print(f"search      {out['search_s']:.2f} s")
    return 0 if out["feasible"] else 1
