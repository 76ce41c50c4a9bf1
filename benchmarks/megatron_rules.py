"""Layouts the Megatron-style rules reach, priced by the machine-mapping DP (issue 7 points 1 and 8; H6).

    .venv/bin/python benchmarks/megatron_rules.py                 # both parts, writes results/megatron_rules.{json,md}
    .venv/bin/python benchmarks/megatron_rules.py --part dlrm --search

Each layout is a fixed sequence of shipped, proven rules applied to the imported model (so it replays on a fresh
import: checked and reported), priced by ``Evaluator.cost`` (the search's pricing, no time limit):

* ``dlrm`` (paper size, summit:8x6 = 48 GPUs, Figure 14's batch and optimizer): data parallelism at 6 by rules,
  the embedding tables split 8 ways by columns (``megatron_embedding_bag_column``, then
  ``megatron_embedding_column`` for tables without a bag sum), then the rest data parallel at 8 on top (MLPs at 48)
  or Megatron MLP pairs at 8; against Alpa's plan in the same cost model (``results/alpa_gpt.json``).
* ``fig10`` (one Transformer layer, hidden 4096, 32 heads, batch 4, sequence 512, dgx-a100:1x8, Adam):
  ``megatron_attention_block`` and the Megatron MLP pair at tensor degree t on data parallelism at 8 / t.

``--search`` also runs ``optimize()`` on the model (the joint search as shipped at the time: its plan, rule steps and
the Megatron rules it used), so the table shows what the rules reach against what the search finds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
CACHE = os.path.join(HERE, ".cache")
RESULTS = os.path.join(HERE, "results")
JSON_OUT = os.path.join(RESULTS, "megatron_rules.json")
MD_OUT = os.path.join(RESULTS, "megatron_rules.md")
ALPA_JSON = os.path.join(RESULTS, "alpa_gpt.json")
EMB_RULES = ("megatron_embedding_bag_column", "megatron_embedding_column")
TABLE_OPS = ("Embedding", "ReduceSum")


def _price(ev, g0, g, steps, book, name: str, loader) -> dict:
    from unity_pcg.search.substitution import replay, trimmed
    t = time.perf_counter()
    c = ev.cost(trimmed(g), limited=False)
    price_s = time.perf_counter() - t
    again = replay(loader(), steps, book)
    used = sorted({s.rule for s in steps if s.rule.startswith("megatron")})
    row = {"layout": name, "iteration_s": c, "rule_steps": len(steps), "megatron_rules": used,
           "replays": again.structural_hash() == g.structural_hash(), "price_s": round(price_s, 2),
           "reduces": sum(1 for n in g.nodes() if n.op in ("Reduce", "AllReduce"))}
    print(f"  {name}: {c:.4f} s ({len(steps)} steps, replays {row['replays']})", file=sys.stderr, flush=True)
    return row


def _search(path, machine, batch, opt, budget, max_candidates) -> dict:
    from unity_pcg.search.optimize import optimize
    t = time.perf_counter()
    r = optimize(path, machine, budget_s=budget, optimizer=opt, batch=batch, max_candidates=max_candidates)
    j = r.json()
    used = sorted({s["rule"] for s in r.plan.rules if s["rule"].startswith("megatron")})
    print(f"  optimize(): {j['predicted_iteration_s']:.4f} s in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return {"layout": f"optimize() (budget {budget:g} s, {max_candidates} candidates)",
            "iteration_s": j["predicted_iteration_s"], "rule_steps": j["rule_steps"], "megatron_rules": used,
            "search_s": j["search_s"], "data_parallel_iteration_s": j["data_parallel_iteration_s"]}


def part_dlrm(search: bool, budget: float, max_candidates: int) -> dict:
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.optimize import Evaluator, machine_degrees
    from unity_pcg.search.substitution import (RuleBook, _apply_everywhere, cancel_steps, data_parallel_steps,
                                               tensor_parallel_steps)
    machine, dp, tp = "summit:8x6", 6, 8
    m = parse_machine(machine)
    batch = zoo.MODELS["dlrm"].paper_batch * m.num_devices
    opt = zoo.MODELS["dlrm"].paper_optimizer
    path = os.path.join(CACHE, "dlrm-paper.onnx")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        zoo.export_structure("dlrm", path, size="paper")

    def loader():
        return load_onnx(path, batch=batch, load_weights=False)
    g0 = loader()
    ev = Evaluator(m, opt)
    book = RuleBook(None, machine_degrees(m))
    rows = []
    g, st = data_parallel_steps(g0, m.num_devices, book)
    rows.append(_price(ev, g0, g, st, book, f"data parallel {m.num_devices} by rules", loader))
    g, st = data_parallel_steps(g0, dp, book)
    ge, ste = g, list(st)
    for name in EMB_RULES:
        ge = _apply_everywhere(ge, book.by_name[name], tp, ste, fresh=("t",))
    ge, more = cancel_steps(ge, book)
    ste += more
    rows.append(_price(ev, g0, ge, ste, book, f"dp {dp} + tables split {tp}x by columns (rest dp {dp})", loader))
    gm, more = tensor_parallel_steps(ge, tp, book)
    rows.append(_price(ev, g0, gm, ste + list(more), book,
                       f"dp {dp} + tables {tp}x by columns + Megatron MLP pairs {tp}x", loader))
    gd, more = data_parallel_steps(ge, tp, book, keep_whole=lambda gg, n: n.op in TABLE_OPS)
    rows.append(_price(ev, g0, gd, ste + list(more), book,
                       f"dp {dp} + tables {tp}x by columns, the rest dp {tp} on top (MLPs dp {dp * tp})", loader))
    if search:
        rows.append(_search(path, machine, batch, opt, budget, max_candidates))
    alpa = None
    try:
        with open(ALPA_JSON) as f:
            data = json.load(f)
        zr = [r for r in data["rows"] if r.get("part") == "zoo" and r.get("model") == "dlrm"]
        if zr and zr[0].get("alpa", {}).get("feasible"):
            alpa = zr[0]["alpa"]["iteration_s"]
    except (OSError, KeyError, ValueError):
        pass
    return {"model": "dlrm", "size": "paper", "machine": machine, "batch": batch, "optimizer": opt,
            "alpa_iteration_s": alpa, "rows": rows}


def part_fig10(search: bool, budget: float, max_candidates: int) -> dict:
    import torch
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.optimize import Evaluator, machine_degrees
    from unity_pcg.search.substitution import RuleBook, _apply_everywhere, data_parallel_steps, tensor_parallel_steps
    sys.path.insert(0, os.path.join(ROOT, "tests", "search"))
    from test_paper_checks import Layer
    machine = "dgx-a100:1x8"
    m = parse_machine(machine)
    path = os.path.join(CACHE, "fig10_layer.onnx")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        torch.onnx.export(Layer(), (torch.zeros(4, 512, 4096),), path, dynamo=False, input_names=["x"])

    def loader():
        return load_onnx(path, load_weights=False)
    g0 = loader()
    ev = Evaluator(m, "adam")
    book = RuleBook(None, machine_degrees(m))
    rows = []
    for dp, tp in ((4, 1), (4, 2), (2, 4), (1, 8)):
        g, st = data_parallel_steps(g0, dp, book) if dp > 1 else (g0, [])
        st = list(st)
        if tp > 1:
            g = _apply_everywhere(g, book.by_name["megatron_attention_block"], tp, st, fresh=("wq", "wk", "wv", "wo"))
            g, more = tensor_parallel_steps(g, tp, book)
            st += more
        name = f"dp {dp}" + (f" x heads/MLP split {tp}" if tp > 1 else " (batch 4: at most 4)")
        rows.append(_price(ev, g0, g, st, book, name, loader))
    if search:
        rows.append(_search(path, machine, None, "adam", budget, max_candidates))
    return {"model": "Figure 10 Transformer layer (4096, 32 heads, batch 4, seq 512)", "machine": machine,
            "batch": 4, "optimizer": "adam", "rows": rows}


def report(data: dict) -> str:
    o = ["# Megatron-style rules: the layouts they reach", "",
         f"Run: `{data['command']}` ({data['finished']}, load {data.get('load', '?')}). Every layout is a fixed "
         "sequence of shipped, proven rules on the imported model, priced by the search's DP (`Evaluator.cost`, no "
         "time limit); *replays*: the sequence applied to a fresh import gives the same structural hash.", ""]
    for part in data["parts"]:
        o += [f"## {part['model']} on {part['machine']} (batch {part['batch']}, {part['optimizer']})", ""]
        alpa = part.get("alpa_iteration_s")
        o += ["| layout | iteration (s) | " + ("vs Alpa (throughput) | " if alpa else "") +
              "rule steps | Megatron rules | replays |",
              "|---|---:|" + ("---:|" if alpa else "") + "---:|---|---|"]
        for r in part["rows"]:
            t = r["iteration_s"]
            vs = f"{alpa / t:.2f}x | " if alpa and t else ("- | " if alpa else "")
            o.append(f"| {r['layout']} | {t:.4f} | {vs}{r['rule_steps']} | {', '.join(r['megatron_rules']) or '-'} | "
                     f"{r.get('replays', '-')} |")
        if alpa:
            o += ["", f"Alpa's plan in the same cost model (`results/alpa_gpt.json`, zoo row): {alpa:.4f} s."]
        o.append("")
    return "\n".join(o)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("dlrm", "fig10", "all"), default="all")
    ap.add_argument("--search", action="store_true", help="also run optimize() on each model")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--max-candidates", type=int, default=40)
    a = ap.parse_args(argv)
    parts = []
    if a.part in ("dlrm", "all"):
        print("dlrm:", file=sys.stderr)
        parts.append(part_dlrm(a.search, a.budget, a.max_candidates))
    if a.part in ("fig10", "all"):
        print("fig10:", file=sys.stderr)
        parts.append(part_fig10(a.search, a.budget, a.max_candidates))
    data = {"command": "python benchmarks/megatron_rules.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": round(os.getloadavg()[0], 1), "parts": parts}
    os.makedirs(RESULTS, exist_ok=True)
    with open(JSON_OUT, "w") as f:
        json.dump(data, f, indent=1)
    md = report(data)
    with open(MD_OUT, "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
