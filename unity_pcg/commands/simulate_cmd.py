"""`unity-pcg simulate MODEL.onnx --machine M --strategy none|dp|megatron|zero3|expert|alpa [--degree N] [--batch N]
[--optimizer O] [--precision fp32|tf32|bf16] [--budget S] [--json] [-o plan.json]`: predicted iteration time, communication
and memory per device of a fixed parallelization (search/baselines.py; ``megatron`` and ``zero3`` as their users tune
them, search/tuned.py, within ``--budget`` seconds), and with ``-o`` its plan (``unity-pcg/plan/v1``: the model's
path and sha256, the machine, the parallel PCG, the DP's machine views, the predicted figures) for
``unity-pcg run`` / ``explain``."""
from __future__ import annotations

import json
import math
import sys

from ..errors import UnityError

HELP = ("predict iteration time, communication and memory of a fixed parallelization "
        "(none / dp / megatron / expert); -o writes its plan")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="ONNX model file")
    p.add_argument("--machine", default="summit:1x6", metavar="M",
                   help="PRESET[:NODESxDEVICES] (summit, dgx-a100, h100, local) or a machine JSON file "
                        "(from `unity-pcg calibrate`), e.g. summit:32x6 (default summit:1x6)")
    p.add_argument("--strategy", choices=("none", "dp", "megatron", "zero3", "expert", "alpa"), default="dp",
                   help="none: the whole model on one device; dp: data parallel; megatron: Megatron-LM as its "
                        "users tune it: the best of a grid over tensor (inside a node), pipeline and data degrees, "
                        "micro-batch size, recomputation and the distributed optimizer (Transformers; --degree "
                        "ignored); zero3: FSDP, ZeRO-3 data parallelism with or without recomputation; "
                        "expert: embedding tables (and dense layers whose weights outweigh their "
                        "activations) model parallel, the rest data parallel (DLRM, XDL, CANDLE-Uno); "
                        "alpa: Alpa's plan (intra-operator ILP per stage, stage DP; --degree ignored) "
                        "(default dp)")
    p.add_argument("--degree", type=int, default=None, metavar="N",
                   help="devices the strategy uses (default: every device of the machine)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="global batch size: replaces the first dim of every model input")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="adam",
                   help="optimizer whose states count in memory and update time (default adam)")
    add_precision_argument(p)
    p.add_argument("--budget", type=float, default=60.0, metavar="S",
                   help="seconds for the grid of the tuned strategies megatron and zero3 (default 60)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json",
                   help="write the priced strategy's plan (unity-pcg/plan/v1) for `unity-pcg run`")


def add_precision_argument(p) -> None:
    """``--precision fp32|tf32|bf16`` (simulate, optimize, calibrate); a bad value: one line, exit 2."""
    p.add_argument("--precision", default="fp32", metavar="{fp32,tf32,bf16}",
                   help="math mode of the training step: fp32; tf32 (fp32 storage, matmul and convolution at "
                        "the TF32 peak); bf16 (mixed precision as torch.autocast: bf16 matmul, convolution and "
                        "activations, fp32 master weights, weight gradients and optimizer states) (default fp32)")


PRECISIONS = ("fp32", "tf32", "bf16")


def check_precision_arg(value, flag: str = "--precision") -> None:
    """A bad ``--precision`` is one line on stderr and exit status 2 (UnityError), not argparse's usage."""
    if value is not None and value not in PRECISIONS:
        raise UnityError(f"{flag} must be one of {', '.join(PRECISIONS)}, got {value!r}")


def simulate(model_path: str, machine: str, strategy: str = "dp", degree: int | None = None,
             batch: int | None = None, optimizer: str = "adam", output: str | None = None,
             precision: str = "fp32", budget_s: float = 60.0) -> dict:
    """Price fixed strategy ``strategy`` of ``model_path`` on ``machine`` in ``precision``; with
    ``output``, write its plan there.  Returns the JSON summary (``plan`` holds the written path)."""
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper

    from ..machine import parse_machine
    from ..onnx_import import load_onnx

    check_precision_arg(precision)
    m = parse_machine(machine)
    if strategy == "none":
        deg = 1
    else:
        deg = m.num_devices if degree is None else degree
    if deg < 1:
        raise UnityError(f"--degree must be a positive integer, got {deg}")
    if deg > m.num_devices:
        raise UnityError(f"--degree {deg} exceeds the {m.num_devices} devices of machine {m.name}")
    if batch is not None and batch < 1:
        raise UnityError(f"--batch must be a positive integer, got {batch}")
    g = load_onnx(model_path, batch=batch, load_weights=False)
    if strategy == "alpa":
        return _simulate_alpa(g, model_path, m, optimizer, output, precision)
    if strategy in ("megatron", "zero3"):
        return _simulate_tuned(g, model_path, m, strategy, optimizer, output, precision, budget_s)
    pg = build_strategy(g, strategy, deg, devices_per_node=m.devices_per_node)
    from ..machine import Resource
    # "none": the whole model on one device (the DP still picks the best views inside it)
    res = Resource(0, 1, 1) if deg == 1 else None
    r = MachineMapper(CostModel(m, optimizer=optimizer, precision=precision)).optimize(pg, resource=res)
    out = r.to_json()
    out.update({"model": model_path, "machine": m.describe(), "strategy": strategy, "degree": deg,
                "optimizer": optimizer, "precision": precision, "batch": g.shape((g.sources("Input")[0].id, 0)).sizes[0]
                if g.sources("Input") else None, "fallbacks": list(pg.meta.get("fallbacks", []))})
    for k in ("tp", "dp", "model_parallel"):
        if k in pg.meta:
            out[k] = pg.meta[k]
    if output is not None:
        out["plan"] = write_plan(output, model_path, m, pg, r, out)
    return out


def _simulate_alpa(g, model_path: str, m, optimizer: str, output: str | None, precision: str = "fp32") -> dict:
    """``--strategy alpa``: Alpa's plan (search/alpa/inter.py), priced by our 1F1B simulation (the
    mapper's cost model carries the precision)."""
    from unity_pcg.search.alpa.inter import alpa_plan
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper

    from ..plan import Plan, file_sha256
    ar = alpa_plan(g, m, optimizer=optimizer,
                   mapper=MachineMapper(CostModel(m, optimizer=optimizer, precision=precision)))
    p = ar.pipeline
    used = {d for s in p.stages for d in s.devices}
    out = {"predicted_iteration_s": p.cost if math.isfinite(p.cost) else None, "feasible": p.feasible,
           "reason": p.reason, "devices": m.num_devices, "comm_elements": p.comm_elements,
           "max_memory_bytes": p.max_memory_bytes,
           "memory_per_device": {str(d): v for d, v in sorted(p.memory.items())},
           "solve_s": ar.stats.get("planner_s", 0.0), "stats": {"devices_used": len(used)},
           "model": model_path, "machine": m.describe(), "strategy": "alpa", "degree": m.num_devices,
           "optimizer": optimizer, "precision": precision, "batch": g.shape((g.sources("Input")[0].id, 0)).sizes[0]
           if g.sources("Input") else None, "fallbacks": [], "alpa": ar.to_json()}
    if output is not None:
        if p.pcg is None:
            raise UnityError(f"strategy 'alpa' has no plan on {m.name} "
                             f"({ar.stats.get('stitch_error') or p.reason}); no plan written")
        pred = {k: out[k] for k in ("predicted_iteration_s", "feasible", "reason", "devices", "comm_elements",
                                    "max_memory_bytes", "memory_per_device", "solve_s")}
        pred.update(strategy="alpa", optimizer=optimizer)
        info = {"strategy": "alpa", "optimizer": optimizer, "batch": out["batch"], "alpa_stages": ar.stages}
        plan = Plan(model_path, file_sha256(model_path), m, p.pcg, p.views, pred, p.to_plan_field(), info,
                    precision=precision)
        try:
            plan.save(output)
        except OSError as e:
            raise UnityError(f"cannot write plan {output}: {e.strerror or e}") from None
        out["plan"] = output
    return out


def _simulate_tuned(g, model_path: str, m, strategy: str, optimizer: str, output: str | None, precision: str,
                    budget_s: float) -> dict:
    """``--strategy megatron|zero3``: the best configuration of the tuned grid (search/tuned.py) found within
    ``budget_s`` seconds, priced with its memory techniques."""
    import time
    from unity_pcg.search.budget import Deadline
    from unity_pcg.search.tuned import TunedMapping, tune

    from ..plan import Plan, file_sha256
    if not budget_s > 0:
        raise UnityError(f"--budget must be a positive number of seconds, got {budget_s}")
    t0 = time.perf_counter()
    from unity_pcg.search.optimize import Evaluator
    # the plain Megatron point, when its DP solve is cut by the budget, is mapped without the DP (as optimize's
    # floor is): a priced configuration rather than none
    ev = Evaluator(m, optimizer, precision=precision, techniques=False)
    r = tune(g, ev.mapper, strategy, Deadline.after(budget_s), cheap=ev.cheap)
    r.stats["seconds"] = time.perf_counter() - t0
    tm = TunedMapping(r, m.num_devices, m.device.usable_bytes)
    out = tm.to_json()
    c = r.config.to_json() if r.config else {}
    out.update({"model": model_path, "machine": m.describe(), "strategy": strategy, "degree": m.num_devices,
                "optimizer": optimizer, "precision": precision,
                "batch": g.shape((g.sources("Input")[0].id, 0)).sizes[0] if g.sources("Input") else None,
                "fallbacks": [], "config": c, f"{strategy}_config": c, "tp": c.get("tp"), "dp": c.get("dp"),
                "pp": c.get("pp"), "memory": tm.memory_plan.to_json() if tm.memory_plan else None,
                "tuned": r.summary()})
    if output is not None:
        if r.pcg is None or not r.views:
            raise UnityError(f"strategy {strategy!r} has no plan on {m.name} ({r.reason}); no plan written")
        pred = {k: out[k] for k in ("predicted_iteration_s", "feasible", "reason", "devices", "comm_elements",
                                    "max_memory_bytes", "memory_per_device", "solve_s")}
        pred.update(strategy=strategy, optimizer=optimizer)
        info = {"strategy": strategy, "optimizer": optimizer, "batch": out["batch"],
                "search": {f"{strategy}_config": c, "tuned": r.summary()}}
        plan = Plan(model_path, file_sha256(model_path), m, r.pcg, r.views, pred,
                    r.pipeline.to_plan_field() if r.pipeline is not None else None, info, precision=precision,
                    memory=tm.memory_plan)
        try:
            plan.save(output)
        except OSError as e:
            raise UnityError(f"cannot write plan {output}: {e.strerror or e}") from None
        out["plan"] = output
    return out


def write_plan(path: str, model_path: str, machine, pg, result, summary: dict) -> str:
    """Save the plan of a priced fixed strategy (DESIGN "Plan file")."""
    from ..plan import Plan, file_sha256

    if not result.views:
        raise UnityError(f"strategy {summary['strategy']!r} has no machine mapping on {machine.name} "
                         f"({result.reason}); no plan written")
    pred = {k: summary[k] for k in ("predicted_iteration_s", "feasible", "reason", "devices", "comm_elements",
                                    "max_memory_bytes", "breakdown", "memory_per_device", "solve_s")}
    pred.update(strategy=summary["strategy"], optimizer=summary["optimizer"])
    info = {k: summary[k] for k in ("strategy", "degree", "optimizer", "batch", "fallbacks") if k in summary}
    info.update({k: summary[k] for k in ("tp", "dp", "model_parallel") if k in summary})
    plan = Plan(model_path, file_sha256(model_path), machine, pg, result.views, pred, None, info,
                precision=summary.get("precision", "fp32"))
    try:
        plan.save(path)
    except OSError as e:
        raise UnityError(f"cannot write plan {path}: {e.strerror or e}") from None
    return path


def run(args) -> int:
    check_precision_arg(getattr(args, "precision", "fp32"))
    out = simulate(args.model, args.machine, args.strategy, args.degree, args.batch, args.optimizer, args.output,
                   getattr(args, "precision", "fp32"), getattr(args, "budget", 60.0))
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if out["feasible"] else 1
    t = out["predicted_iteration_s"]
    if out["strategy"] == "alpa":
        a = out["alpa"]
        print(f"model      {out['model']}  (batch {out['batch']})")
        print(f"machine    {out['machine']}")
        print(f"precision  {out['precision']}")
        print(f"strategy   alpa ({len(a['stages'])} stage(s), {a['micro_batches']} micro-batches: "
              + ", ".join(f"layers {s['layers'][0]}-{s['layers'][1] - 1} on {s['shape'][0]}x{s['shape'][1]}"
                          for s in a["stages"]) + ")")
        print(f"feasible   {'yes' if out['feasible'] else 'NO: ' + out['reason']}")
        if t is not None:
            print(f"iteration  {t * 1e3:.3f} ms predicted (1F1B simulation)")
        print(f"comm       {out['comm_elements']:,} elements sent per iteration (all devices)")
        print(f"memory     {out['max_memory_bytes'] / 2**30:.3f} GiB on the busiest device")
        print(f"planner    {out['solve_s']:.3f} s")
        if out.get("plan"):
            print(f"plan       {out['plan']}")
        return 0 if out["feasible"] else 1
    if out["strategy"] in ("megatron", "zero3"):
        c, tu = out["config"], out["tuned"]
        print(f"model      {out['model']}  (batch {out['batch']})")
        print(f"machine    {out['machine']}")
        print(f"precision  {out['precision']}")
        print(f"strategy   {out['strategy']} tuned: " + (", ".join(f"{k} {v}" for k, v in c.items()) if c else "-"))
        print(f"feasible   {'yes' if out['feasible'] else 'NO: ' + out['reason']}")
        if t is not None:
            print(f"iteration  {t * 1e3:.3f} ms predicted")
        mx = out["max_memory_bytes"]
        if mx:
            print(f"memory     {mx / 2**30:.3f} GiB on the busiest device")
        print(f"grid       {tu.get('layout_points', 0)} layouts, {tu.get('points_priced', 0)} configurations priced in "
              f"{out['solve_s']:.1f} s" + (" (cut by --budget)" if tu.get("cut") else ""))
        if out.get("plan"):
            print(f"plan       {out['plan']}")
        return 0 if out["feasible"] else 1
    b = out["breakdown"]
    print(f"model      {out['model']}  (batch {out['batch']})")
    print(f"machine    {out['machine']}")
    print(f"precision  {out['precision']}")
    extra = f", tensor parallel {out['tp']} x data parallel {out['dp']}" if "tp" in out else ""
    print(f"strategy   {out['strategy']} (degree {out['degree']}{extra}, "
          f"{out['stats'].get('devices_used', 0)} devices used)")
    if out["fallbacks"]:
        print(f"fallbacks  {len(out['fallbacks'])} op(s) run unpartitioned: {', '.join(out['fallbacks'][:5])}"
              + (" ..." if len(out["fallbacks"]) > 5 else ""))
    print(f"feasible   {'yes' if out['feasible'] else 'NO: ' + out['reason']}")
    if t is not None:
        print(f"iteration  {t * 1e3:.3f} ms predicted")
    print(f"  compute  {b['compute_s'] * 1e3:.3f} ms   comm {b['comm_s'] * 1e3:.3f} ms   "
          f"grad sync {b['grad_sync_s'] * 1e3:.3f} ms   update {b['update_s'] * 1e3:.3f} ms")
    print(f"comm       {out['comm_elements']:,} elements sent per iteration (all devices)")
    mx = out["max_memory_bytes"]
    if mx is not None:
        print(f"memory     {mx / 2**30:.3f} GiB on the busiest device")
    print(f"solve      {out['solve_s']:.3f} s")
    if out.get("plan"):
        print(f"plan       {out['plan']}")
    return 0 if out["feasible"] else 1
