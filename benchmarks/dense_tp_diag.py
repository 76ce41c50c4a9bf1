"""Why CANDLE-Uno's plan is what it is against Alpa's (issue 7 point 10): the Megatron families at every
tensor-parallel degree, Alpa's intra-operator ILP per logical mesh, and the one rule between them.

    .venv/bin/python benchmarks/dense_tp_diag.py                 # 48 and 192 GPUs -> results/dense_tp_diag.{md,json}
    .venv/bin/python benchmarks/dense_tp_diag.py --gpus 48

Everything is priced by the same machine-mapping DP (Summit, Figure 14's per-GPU batch and optimizer).  For
each machine:

1. every ``tp<k>x<d>`` family of ``optimize.whole_tp_degrees`` built on the whole graph by rules (data
   parallelism of degree d, then ``tensor_parallel_steps`` of degree k), marked where k is also one of
   ``megatron_seed_degrees`` (the three degrees the search used before), with its compute / activation
   communication / gradient-sync split;
2. Alpa's intra-operator ILP (``search/alpa/intra.solve_intra``) on the whole model under every logical mesh
   of the machine (one stage, one micro-batch), each plan priced by the same DP;
3. the activation communication of the best family and of Alpa's plan on the same mesh, by collective;
4. the best family with one more rule, **not shipped and not proven** (built in memory for this diagnosis
   only): ``Replicate(Concat(x1..x7)) -> Concat(Replicate(x1)..Replicate(x7))``, then the Relu lift and the
   Reduce + Replicate fusion the family already uses.  It measures what the missing rule is worth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results")
MODEL = "candle_uno"


def _machine(gpus: int) -> str:
    return f"summit:{gpus // 6}x6"


def _comm(pg, views, model) -> dict:
    """Activation communication by (parallel operator, shape): [count, seconds]."""
    from unity_pcg.explanation import _comm_rows
    from unity_pcg.search.cost import GraphCost
    gc = GraphCost(pg, model)
    agg: dict = defaultdict(lambda: [0, 0.0])
    for x in _comm_rows(pg, gc, views):
        k = f"{x.op} {x.shape}" if x.op != "Partition" else "Partition"
        agg[k][0] += 1
        agg[k][1] += x.time_s
    return {k: {"count": v[0], "s": v[1]} for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def _concat_lift(k: int, arity: int):
    """The n-ary Replicate-over-Concat lift, in memory (not in the rule cache, not proven)."""
    from unity_pcg.substitutions.templates import K, _rep
    from unity_pcg.substitutions.terms import op, rule_of
    xs = [f"x{i}" for i in range(arity)]
    return rule_of(f"replicate_lift_Concat_{arity}", _rep(op("Concat", *xs, axis="$a")),
                   op("Concat", *[_rep(x) for x in xs], axis="$a"), {**K, "a": "dim"})


def run(gpus: int) -> dict:
    import fig14
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.alpa.inter import logical_meshes
    from unity_pcg.search.alpa.intra import solve_intra
    from unity_pcg.search.optimize import (Evaluator, _whole_family, machine_degrees, megatron_seed_degrees,
                                           search_degrees, whole_tp_degrees)
    from unity_pcg.search.substitution import (RuleBook, _apply_everywhere, _unary_lift_rules, cancel_steps,
                                               tensor_parallel_steps, trimmed)
    mstr = _machine(gpus)
    m = parse_machine(mstr)
    batch = zoo.MODELS[MODEL].paper_batch * m.num_devices
    opt = zoo.MODELS[MODEL].paper_optimizer
    g = load_onnx(fig14.model_path(MODEL), batch=batch, load_weights=False)
    ev = Evaluator(m, opt, limit_s=None)
    book = RuleBook(None, search_degrees(m))
    dps = [d for d in machine_degrees(m) if batch % d == 0]
    widths = {g.shape(tuple(n.inputs[1])).sizes[-1] for n in g.nodes() if n.op == "Linear"}
    old = megatron_seed_degrees(m, dps)
    out = {"gpus": gpus, "machine": mstr, "batch": batch, "optimizer": opt, "families": {}, "alpa_intra": {}}
    best = None
    for d, k in whole_tp_degrees(m, dps, widths).items():
        t = time.perf_counter()
        fg, st = _whole_family(g, book, d, k, tensor_parallel_steps)
        r = ev.full(trimmed(fg))
        b = r.breakdown
        out["families"][f"tp{k}x{d}"] = {"k": k, "d": d, "iteration_s": r.cost, "samples_s": batch / r.cost,
                                         "megatron_seed_degree": old.get(d) == k, "compute_s": b.compute,
                                         "comm_s": b.comm, "grad_sync_s": b.sync, "steps": len(st),
                                         "wall_s": time.perf_counter() - t}
        print(f"{mstr} tp{k}x{d}: {r.cost:.4f} s", file=sys.stderr, flush=True)
        if best is None or r.cost < best[0]:
            best = (r.cost, k, d, fg, r)
    D = m.devices_per_node
    plans = {}
    for mesh in logical_meshes((m.nodes, D), D, "all"):
        p = solve_intra(g, m, mesh, optimizer=opt, time_limit_s=60)
        plans[mesh] = p
        out["alpa_intra"][f"{mesh[0]}x{mesh[1]}"] = {"iteration_s": p.time_s, "samples_s": batch / p.time_s,
                                                     "status": p.status}
        print(f"{mstr} alpa intra {mesh}: {p.time_s:.4f} s", file=sys.stderr, flush=True)
    cost, k, d, fg, r = best
    out["best_family"] = f"tp{k}x{d}"
    out["best_family_comm"] = _comm(trimmed(fg), r.views, ev.mapper.model)
    same = plans.get((k, d))
    if same is not None:
        out["alpa_same_mesh"] = f"{k}x{d}"
        out["alpa_same_mesh_comm"] = _comm(same.pcg, same.views, ev.mapper.model)
    # the missing rule, in memory
    arity = max((len(n.inputs) for n in fg.nodes() if n.op == "Concat"), default=0)
    steps: list = []
    y = _apply_everywhere(fg, _concat_lift(k, arity), k, steps)
    for rule in _unary_lift_rules(book) + [book.by_name["reduce_replicate_allreduce"]]:
        y = _apply_everywhere(y, rule, k, steps)
    y, more = cancel_steps(y, book)
    ry = ev.full(trimmed(y))
    out["with_concat_lift"] = {"rule": f"replicate_lift_Concat_{arity} (not shipped, not proven)",
                               "iteration_s": ry.cost, "samples_s": batch / ry.cost,
                               "extra_steps": len(steps) + len(more),
                               "comm": _comm(trimmed(y), ry.views, ev.mapper.model)}
    return out


def report(rows: list) -> str:
    o = ["# CANDLE-Uno: Megatron families, Alpa's ILP and the missing Concat rule", "",
         "`benchmarks/dense_tp_diag.py` (module docstring). Summit, Figure 14's batch (per-GPU 64) and optimizer "
         "(SGD); every time is the machine-mapping DP's predicted iteration.", ""]
    for r in rows:
        o += [f"## {r['machine']} ({r['gpus']} GPUs, batch {r['batch']})", "",
              "Megatron families by rules (`whole_tp_degrees`; *seed*: a degree of `megatron_seed_degrees`, the "
              "only ones searched before):", "",
              "| family | seed | iteration (s) | samples/s | compute (s) | activation comm (s) | grad sync (s) |",
              "|---|---|---:|---:|---:|---:|---:|"]
        for name, f in r["families"].items():
            o.append(f"| {name} | {'yes' if f['megatron_seed_degree'] else ''} | {f['iteration_s']:.4f} | "
                     f"{f['samples_s']:,.0f} | {f['compute_s']:.4f} | {f['comm_s']:.4f} | {f['grad_sync_s']:.4f} |")
        o += ["", "Alpa's intra-operator ILP on the whole model, per logical mesh (one stage, one micro-batch):", "",
              "| mesh | iteration (s) | samples/s |", "|---|---:|---:|"]
        for mesh, a in r["alpa_intra"].items():
            o.append(f"| {mesh} | {a['iteration_s']:.4f} | {a['samples_s']:,.0f} |")
        o += ["", f"Activation communication, best family ({r['best_family']}) against Alpa on the same mesh "
              f"({r.get('alpa_same_mesh', '-')}) and the best family with the Concat lift:", "",
              "| plan | collective (shape) | count | seconds |", "|---|---|---:|---:|"]
        for label, c in ((r["best_family"], r["best_family_comm"]),
                         (f"alpa {r.get('alpa_same_mesh', '-')}", r.get("alpa_same_mesh_comm", {})),
                         ("with the Concat lift", r["with_concat_lift"]["comm"])):
            for k, v in c.items():
                o.append(f"| {label} | {k} | {v['count']} | {v['s']:.4f} |")
        w = r["with_concat_lift"]
        o += ["", f"With `{w['rule']}` ({w['extra_steps']} more steps): {w['iteration_s']:.4f} s, "
              f"{w['samples_s']:,.0f} samples/s.", ""]
    o += ["## Reading", "", READING, ""]
    return "\n".join(o)


READING = """The best Megatron layout of CANDLE-Uno is tensor parallel 4 on data parallel n/4 at both sizes: k = 4
balances the activation all-reduces (growing with k) against the gradient all-reduces of its 4,192-wide weights
(shrinking with k). The search's Megatron seeds used only k = nodes, devices per node (6 divides no weight) and
2, so it never built it; `whole_tp_degrees` (small dense models) now builds every degree. Alpa's ILP on the
same logical mesh finds the same layout but for where the five towers meet the Concat: Unity's family reduces
each tower's partial sums (Reduce), concatenates, then broadcasts the concatenation (one Replicate), where Alpa
all-reduces each tower's output and concatenates the copies. The rules cannot move a Replicate above a Concat
of 7 inputs (the generated Replicate/Concat rules are binary), so the Reduces and the Replicate never meet to
fuse into AllReduces. With that one rule (built in memory here, neither proven nor shipped) the family prices
as Alpa's plan on the same mesh (21 AllReduces and the last layer's Reduce before the one-feature output,
against 22 AllReduces). Alpa as `alpa_gpt.py --part zoo` runs it (the stage DP on the physical mesh) does not
take that mesh: at 48 GPUs it keeps 8 x 6 (tensor parallel across the 8 nodes); at 192 GPUs, on 32 x 6, the
only even split of the 4,192-wide weights is 32 ways and its ILP keeps data parallelism; with `logical="all"`
its stage DP compares meshes by the micro-batch time without the gradient all-reduce and takes 1 x N (data
parallelism)."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="48,192", help="comma-separated Summit GPU counts (multiples of 6)")
    ap.add_argument("--report", action="store_true", help="only rewrite the markdown from the JSON")
    args = ap.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    if args.report:
        with open(os.path.join(RESULTS, "dense_tp_diag.json")) as f:
            rows = json.load(f)["rows"]
    else:
        rows = [run(int(x)) for x in args.gpus.split(",")]
        with open(os.path.join(RESULTS, "dense_tp_diag.json"), "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    text = report(rows)
    with open(os.path.join(RESULTS, "dense_tp_diag.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
