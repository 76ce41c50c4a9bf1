"""Layout -> rule sequence (search/realize.py) on zoo models: how much of a target the rules reach, how long it
takes, and what the result is priced at beside the target and data parallelism.

For each model and target kind (``dp``: data parallelism; ``megatron``: Megatron-LM, tensor parallel inside a
node; ``ilp``: the label ILP's layout on a 2 x (devices/2) mesh; ``meshAxB``: the layouts phase's proposal on
mesh AxB, idle axes allowed) it prints the compute nodes brought to the
target's layouts, the CPU seconds of ``realize`` (median of ``--repeat``), and -- with ``--price`` -- the price
(the machine-mapping DP) of the partial realization, of the target PCG itself, of data parallelism, and what
``settle`` returns (the cheapest of the partial realization, the missed regions at data parallelism, data
parallelism).

    python benchmarks/realize_bench.py --models bert_large,gpt_350m,llama_1b --targets megatron,ilp --price
    python benchmarks/realize_bench.py --models bert_large --size paper --batch 24 --machine summit:4x6 \\
        --targets dp,megatron --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str, size: str, batch: int):
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    if size == "paper":
        sys.path.insert(0, HERE)
        from fig14 import model_path
        return load_onnx(model_path(name), batch=batch, load_weights=False)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, f"{name}.onnx")
        zoo.export(name, p, size=size)
        return load_onnx(p, batch=batch)


def target_of(kind: str, g, machine):
    from unity_pcg.search import baselines
    if kind == "dp":
        return baselines.data_parallel(g, machine.num_devices)
    if kind == "megatron":
        return baselines.megatron(g, machine.num_devices, devices_per_node=machine.devices_per_node)
    if kind == "ilp":
        from unity_pcg.search.alpa.intra import solve_intra
        return solve_intra(g, machine, (2, machine.num_devices // 2), time_limit_s=60).pcg
    if kind.startswith("mesh"):         # the layouts phase's proposal on mesh AxB (idle axes allowed)
        from unity_pcg.search.layouts import propose
        a, b = (int(x) for x in kind[4:].split("x"))
        p = propose(g, machine, (a, b), time_limit_s=60)
        if p.pcg is None:
            raise SystemExit(f"no proposal on mesh {a}x{b}: {p.status}")
        return p.pcg
    raise SystemExit(f"--targets: unknown target kind {kind!r} (dp, megatron, ilp, meshAxB)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert_large,gpt_350m,llama_1b")
    ap.add_argument("--size", default="tiny", help="zoo size (tiny, paper, ...)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--machine", default="h100:2x2")
    ap.add_argument("--targets", default="dp,megatron,ilp")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--price", action="store_true", help="price the results with the machine-mapping DP")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--with-templates", action="store_true",
                    help="add substitutions.templates.tensor_parallel_rules() to the shipped rules (before the cache "
                         "ships them: unproven here)")
    a = ap.parse_args(argv)
    from unity_pcg.machine import parse_machine
    from unity_pcg.search import baselines
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.realize import NodeLayout, layout_of, realize, settle
    from unity_pcg.search.substitution import RuleBook, trimmed
    m = parse_machine(a.machine)
    book = RuleBook()
    if a.with_templates:
        from unity_pcg.substitutions.templates import tensor_parallel_rules
        have = set(book.by_name)
        book = RuleBook(book.rules + [r for r in tensor_parallel_rules() if r.name not in have])
    mapper = MachineMapper(CostModel(m))

    def price(p):
        return mapper.optimize(p).cost
    rows = []
    for name in a.models.split(","):
        g = load(name, a.size, a.batch)
        for kind in a.targets.split(","):
            target = target_of(kind, g, m)
            secs = []
            for _ in range(a.repeat):
                c = time.process_time()
                r = realize(g, target, book)
                secs.append(time.process_time() - c)
            want = layout_of(target, g)
            row = {"model": name, "target": kind, "reached": sum(NodeLayout.of(r.pcg, r.ids[k]) == want[k] for k in want),
                   "nodes": len(want), "cpu_s": round(statistics.median(secs), 3), "steps": len(r.steps)}
            if a.price:
                s = settle(g, target, price, book)
                row.update(realized_ms=price(trimmed(r.pcg)) * 1e3, target_ms=price(target) * 1e3,
                           dp_ms=price(baselines.data_parallel(g, m.num_devices)) * 1e3, settled_ms=s.price * 1e3,
                           settled=s.chosen)
            rows.append(row)
            print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
