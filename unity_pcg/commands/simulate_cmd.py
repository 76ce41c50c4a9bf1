"""`unity-pcg simulate MODEL.onnx --machine M --strategy dp|none [--degree N] [--batch N] [--json]`:
predicted iteration time, communication and memory per device of a fixed parallelization."""
from __future__ import annotations

import json
import math
import sys

from ..errors import UnityError

HELP = "predict iteration time, communication and memory of a fixed parallelization (dp / none)"


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="ONNX model file")
    p.add_argument("--machine", default="summit:1x6", metavar="M",
                   help="PRESET[:NODESxDEVICES] (summit, dgx-a100, h100, local) or a machine JSON file "
                        "(from `unity-pcg calibrate`), e.g. summit:32x6 (default summit:1x6)")
    p.add_argument("--strategy", choices=("dp", "none"), default="dp",
                   help="dp: data parallel; none: the whole model on one device (default dp)")
    p.add_argument("--degree", type=int, default=None, metavar="N",
                   help="data-parallel degree (default: every device of the machine)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="global batch size: replaces the first dim of every model input")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="adam",
                   help="optimizer whose states count in memory and update time (default adam)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def simulate(model_path: str, machine: str, strategy: str = "dp", degree: int | None = None,
             batch: int | None = None, optimizer: str = "adam") -> dict:
    from search.baselines import build_strategy
    from search.cost import CostModel
    from search.mapping import MachineMapper

    from ..machine import parse_machine
    from ..onnx_import import load_onnx

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
    pg = build_strategy(g, strategy, deg)
    from ..machine import Resource
    # "none": the whole model on one device (the DP still picks the best views inside it)
    res = Resource(0, 1, 1) if deg == 1 else None
    r = MachineMapper(CostModel(m, optimizer=optimizer)).optimize(pg, resource=res)
    out = r.to_json()
    out.update({"model": model_path, "machine": m.describe(), "strategy": strategy, "degree": deg,
                "optimizer": optimizer, "batch": g.shape((g.sources("Input")[0].id, 0)).sizes[0]
                if g.sources("Input") else None, "fallbacks": list(pg.meta.get("fallbacks", []))})
    return out


def run(args) -> int:
    out = simulate(args.model, args.machine, args.strategy, args.degree, args.batch, args.optimizer)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if out["feasible"] else 1
    t = out["predicted_iteration_s"]
    b = out["breakdown"]
    print(f"model      {out['model']}  (batch {out['batch']})")
    print(f"machine    {out['machine']}")
    print(f"strategy   {out['strategy']} (degree {out['degree']}, {out['stats'].get('devices_used', 0)} devices used)")
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
    return 0 if out["feasible"] else 1
