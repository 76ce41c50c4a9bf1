"""The label ILP's CNN layouts reached by rules (issue 18): for each model, machine and 2-D mesh of
``search.layouts.mesh_shapes``, the ILP's proposal (``search.layouts.propose``) is realized by the shipped rules
(``search.realize.realize``) with and without the CNN channel rules (``substitutions.templates.conv_channel_rules``),
and each result is priced by the machine-mapping DP beside the ILP's own PCG.  A row: compute nodes brought to the
ILP's layout, and the realized plan's price as a multiple of the ILP's ("x1.0000": reached at the ILP's price).

    python benchmarks/realize_cnn.py --models resnet50,squeezenet,vgg19 --machines local:1x2,local:2x2,h100:1x8
    python benchmarks/realize_cnn.py --models resnext50,inception_v3 --json out.jsonl

A model is a file of the onnx wheel's light models (``light_<name>.onnx``), a zoo name (exported at ``--size``) or
a path to an .onnx file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter


def load(name: str, size: str, batch: int):
    from unity_pcg.onnx_import import load_onnx
    if name.endswith(".onnx"):
        return load_onnx(name, batch=batch, load_weights=False)
    import onnx
    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"light_{name}.onnx")
    if os.path.exists(light):
        return load_onnx(light, batch=batch, load_weights=False)
    from unity_pcg import zoo
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, f"{name}.onnx")
        zoo.export(name, p, size=size)
        return load_onnx(p, batch=batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,squeezenet,shufflenet,inception_v1,densenet121,vgg19")
    ap.add_argument("--machines", default="local:1x2,local:2x2,h100:1x8")
    ap.add_argument("--size", default="tiny", help="zoo size for zoo models")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=60.0, help="the ILP's time limit per mesh (s)")
    ap.add_argument("--json", help="append the rows here (JSON lines)")
    a = ap.parse_args(argv)
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.layouts import mesh_shapes, propose
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.realize import NodeLayout, layout_of, realize
    from unity_pcg.search.substitution import RuleBook, trimmed
    from unity_pcg.substitutions.templates import conv_channel_rules
    after = RuleBook()
    drop = {r.name for r in conv_channel_rules()}
    before = RuleBook([r for r in after.rules if r.name.split("~")[0] not in drop])
    rows = []
    for name in a.models.split(","):
        g = load(name, a.size, a.batch)
        for mach in a.machines.split(","):
            m = parse_machine(mach)
            mapper = MachineMapper(CostModel(m))
            for mesh in mesh_shapes(m):
                t0 = time.perf_counter()
                p = propose(g, m, mesh, mapper=mapper, time_limit_s=a.time_limit)
                if p.pcg is None:
                    print(f"{name} {mach} {mesh}: no proposal ({p.status})", flush=True)
                    continue
                ilp = mapper.optimize(p.pcg).cost
                want = layout_of(p.pcg, g)
                row = {"model": os.path.basename(name).replace(".onnx", ""), "machine": mach, "mesh": list(mesh),
                       "nodes": len(want), "ilp_ms": ilp * 1e3, "propose_s": round(time.perf_counter() - t0, 1)}
                for tag, book in (("before", before), ("after", after)):
                    r = realize(g, p.pcg, book)
                    miss = [k for k in want if NodeLayout.of(r.pcg, r.ids[k]) != want[k]]
                    got = mapper.optimize(trimmed(r.pcg)).cost
                    row[tag] = {"reached": len(want) - len(miss), "ratio": got / ilp,
                                "realize_s": round(r.seconds, 2), "missed": dict(Counter(g.node(k).op for k in miss)),
                                "why": r.missing[:3]}
                rows.append(row)
                b, f = row["before"], row["after"]
                print(f"{row['model']} {mach} mesh {mesh[0]}x{mesh[1]}: {len(want)} nodes, ILP {row['ilp_ms']:.3f} ms; "
                      f"before {b['reached']} x{b['ratio']:.4f}; after {f['reached']} x{f['ratio']:.4f} "
                      f"{f['missed'] or ''}", flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
