"""Why the joint search does not beat data parallelism on Inception-v3 at 192 GPUs (issue 7, point 10), and
what the rule machinery costs for the pipeline plans of the CNNs (point 1).

In the cost model, at the paper's size on ``summit:32x6`` (batch 32 per GPU, SGD):

* data parallelism over the whole graph at 192 and 96 devices: the iteration and where it
  goes (the mapper is free to run branches side by side);
* the same 13 distinct sequential segments the search uses (``split.canonical_segments``, k = 10), each
  data parallel by rules at 192 and at 96 devices, priced alone: where a lower degree would pay;
* those lower-degree segments assembled into the whole graph by rules (``pipeline._dp_by_segments``: a
  degree per segment), priced whole: what the transitions between degrees cost by the shipped rules;
* 1F1B pipelines of 4 stages (as ``optimize`` searches them) and, with ``--full``, 6 and 8;
* which rules the shipped cache has for Conv2d and BatchNorm;
* ``pipeline.by_rules`` on a 2-stage pipeline at ``summit:4x6``: built by segments (the default) and as
  one whole-graph sequence (the fallback), CPU seconds, PCG hash, replay.

Writes ``benchmarks/results/cnn_why.json`` and ``.md``.

    .venv/bin/python benchmarks/cnn_why.py            # ~5 min CPU
    .venv/bin/python benchmarks/cnn_why.py --full     # + 6- and 8-stage pipelines (~1 min CPU more)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import fig14  # noqa: E402

OUT = os.path.join(HERE, "results", "cnn_why")


def _cpu(f, *a, **k):
    t = time.process_time()
    r = f(*a, **k)
    return r, time.process_time() - t


def _bd(r) -> dict:
    b = r.to_json()["breakdown"]
    return {"iteration_ms": r.cost * 1e3 if r.feasible else None, "compute_ms": b["compute_s"] * 1e3,
            "comm_ms": b["comm_s"] * 1e3, "grad_sync_ms": b["grad_sync_s"] * 1e3,
            "devices_used": r.stats.get("devices_used")}


def degree_change_rules(book) -> list:
    """Rules made of parallel operators only that relate two different degrees (Combine(a*b) as Combine(a)
    after Combine(b), ...): what a change of data-parallel degree between neighbours would need."""
    par = ("Partition", "Combine", "Replicate", "Reduce", "AllReduce")
    out = []
    for r in book.rules:
        nodes = list(r.source.nodes) + list(r.target.nodes)
        if all(x.op in par for x in nodes) and len({dict(x.attrs).get("degree") for x in nodes}) > 1:
            out.append(r.name)
    return out


def write_md(out: dict) -> None:
    name, D = out["model"], int(out["devices"])
    low = D // 2
    whole = {int(k): v for k, v in out["dp_whole"].items()}
    rows, mixed, pipes, rules = out["segments"], out["mixed_by_rules"], out["pipelines"], out["rules_touching"]
    m_name, batch = out["machine"], out["batch"]
    dp_ms = whole[D]["iteration_ms"]
    wins, gain = out["lower_degree_wins"]["segments"], out["lower_degree_wins"]["sum_of_gains_ms"]
    L = [f"# Why Unity equals dp on {name} at {D} GPUs (`benchmarks/cnn_why.py`)", "",
         f"Machine {m_name}, batch {batch}, SGD; load average at start {out['loadavg'][0]:.1f} (2 shared CPUs).", "",
         "## Data parallelism over the whole graph", "", "| degree | iteration ms | compute | comm | grad sync | devices used |",
         "|---:|---:|---:|---:|---:|---:|"]
    for d, w in whole.items():
        L.append(f"| {d} | {w['iteration_ms']:.1f} | {w['compute_ms']:.1f} | {w['comm_ms']:.1f} | {w['grad_sync_ms']:.1f} | {w['devices_used']} |")
    L += ["", f"## The search's segments alone, dp{D} against dp{low} (ms)", "",
          f"| segment | ops | dp{D} | (compute / comm) | dp{low} | (compute / comm) |", "|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if "ops" not in r:
            L.append(f"| {r['segment']} | = {r['same_as']} | | | | |")
            continue
        h, lo = r[f"dp{D}"], r[f"dp{low}"]
        L.append(f"| {r['segment']} | {r['ops']} | {h['iteration_ms']:.1f} | {h['compute_ms']:.1f} / {h['comm_ms']:.1f} | "
                 f"{lo['iteration_ms']:.1f} | {lo['compute_ms']:.1f} / {lo['comm_ms']:.1f} |")
    L += ["", f"dp{low} is cheaper alone on segments {wins}: {gain:.1f} ms in all ({gain / dp_ms:.1%} of dp{D}'s "
          f"{dp_ms:.1f} ms), before any transition between the degrees.", "",
          "## Those segments at the lower degree, assembled by rules and priced whole", "",
          "| segments at the lower degree | steps | iteration ms | compute | comm |", "|---|---:|---:|---:|---:|"]
    for x in mixed:
        L.append(f"| {x['segments_at_low_degree']} | {x['steps']} | {x['iteration_ms']:.1f} | {x['compute_ms']:.1f} | {x['comm_ms']:.1f} |")
    L += ["", "## 1F1B pipelines", "", "| stages | devices per stage | micro-batches | iteration ms |", "|---:|---|---:|---:|"]
    for p in pipes:
        L.append(f"| {p['stages']} | {p['stage_devices']} | {p['micro_batches']} | {p['iteration_ms']:.1f} |")
    L += ["", "## Rules of the shipped cache that touch Conv2d or BatchNorm", ""]
    for op, names in rules.items():
        L.append(f"- {op}: {', '.join(names)}")
    b = out["by_rules_4x6"]
    L += ["", "## pipeline.by_rules at summit:4x6 (2 stages)", "",
          f"Stages of {b['stage_devices']} devices, {b['micro_batches']} micro-batches: by segments {b['by_segments_cpu_s']:.1f} s CPU, "
          f"as one whole-graph sequence {b['whole_graph_cpu_s']:.1f} s CPU; {b['steps']} steps ({b['steps_whole_graph']} whole-graph); "
          f"same PCG: {b['same_pcg']}; the sequence replays on a fresh import to the plan: {b['replays_to_plan']} "
          f"({b['replay_cpu_s']:.1f} s CPU)."]
    best_mixed = min(x["iteration_ms"] for x in mixed)
    best_pipe = min(p["iteration_ms"] for p in pipes)
    w = whole[D]
    L += ["", "## Reading", "",
          f"At {D} GPUs data parallelism spends {w['comm_ms']:.0f} of its {dp_ms:.0f} ms in activation communication: "
          f"the SyncBatchNorm statistics all-reduces (the executor trains with SyncBatchNorm semantics), each a ring over "
          f"all {D} devices and latency-bound (2(p-1) link latencies). What the shipped rules reach can shorten them only "
          f"by putting fewer devices in each BatchNorm's group, which costs compute in proportion: data parallelism at "
          f"{low} devices halves the all-reduces and doubles the compute ({whole[low]['iteration_ms']:.0f} ms; the mapper "
          f"leaves {D - low} devices idle rather than run branches side by side on the two halves); 1F1B pipelines give each stage fewer devices but repeat the all-reduces for every "
          f"micro-batch ({best_pipe:.0f} ms at best, 4 to 8 stages). Segment by segment, dp{low} alone is cheaper on "
          f"segments {wins}, by {gain:.1f} ms in all ({gain / dp_ms:.1%}), but by the shipped rules a change of degree "
          f"between segments goes through a full gather (Combine to one piece, then Partition): {best_mixed:.0f} ms at "
          f"best. A rule splitting a Combine into nested ones (Combine(a*b) = Combine(a) after Combine(b), which would "
          f"let one Combine(2) reshard {D} to {low} ways) is missing (parallel-operator rules relating two different "
          f"degrees in the cache: {len(out['degree_change_rules'])}); even with it the gain would be about those "
          f"{gain:.1f} ms at most. Nor do the rules have operator parallelism for Conv2d or BatchNorm (only "
          f"{', '.join(n for v in rules.values() for n in v)}): a BatchNorm split by channels needs no statistics "
          f"all-reduce (its input resharded instead). So in this cost model the best plan the shipped rules reach at {D} GPUs is data parallelism "
          f"(the search's result, 1.00x). The paper's 1.3x then points to a cost-model difference (our reading, not "
          f"measured): if the baseline's BatchNorm statistics are not a {D}-device ring per layer (per-device "
          f"statistics, or tree all-reduces for such small messages), data parallelism is bound by compute and "
          f"gradient synchronization instead, where other layouts can pay. At 1,024 GPUs (`h100:128x8`) the same "
          f"all-reduces make data parallelism slow enough that a 4-stage pipeline wins (fig14.md: 2.05x)."]
    with open(OUT + ".md", "w") as f:
        f.write("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="inception_v3")
    ap.add_argument("--devices", type=int, default=192)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--report", action="store_true", help="only the markdown, from the JSON")
    a = ap.parse_args(argv)
    if a.report:
        with open(OUT + ".json") as f:
            out = json.load(f)
        if "degree_change_rules" not in out:
            from unity_pcg.search.substitution import RuleBook
            out["degree_change_rules"] = degree_change_rules(RuleBook())
            with open(OUT + ".json", "w") as f:
                json.dump(out, f, indent=1, default=str)
        write_md(out)
        return 0
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search import pipeline as P
    from unity_pcg.search.baselines import build_strategy
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.split import blocking_pairs, canonical_segments
    from unity_pcg.search.substitution import RuleBook, data_parallel_steps, replay, trimmed

    name, D = a.model, a.devices
    m = parse_machine(fig14.machine_for(D))
    batch = fig14.per_gpu_batch(name) * D
    g = load_onnx(fig14.model_path(name), batch=batch, load_weights=False)
    cm = CostModel(m, optimizer=fig14.optimizer_of(name))
    mp = MachineMapper(cm)
    book = RuleBook(None, [2, D])
    out: dict = {"model": name, "devices": D, "machine": m.name, "batch": batch, "loadavg": os.getloadavg()}

    low = D // 2
    whole = {}
    for d in (D, low):
        r, s = _cpu(mp.optimize, build_strategy(g, "dp", d))
        whole[d] = dict(_bd(r), solve_cpu_s=s)
        print(f"dp{d} whole: {whole[d]}", flush=True)
    out["dp_whole"] = whole
    dp_ms = whole[D]["iteration_ms"]

    segs, _ = canonical_segments(g, 10, blocking_pairs(book))
    seen: dict = {}
    rows = []
    for i, s in enumerate(segs):
        if s.key in seen:
            rows.append({"segment": i, "same_as": seen[s.key]})
            continue
        seen[s.key] = i
        row = {"segment": i, "ops": sum(n.kind == "compute" for n in s.canon.nodes())}
        for d in (D, low):
            r = mp.optimize(trimmed(data_parallel_steps(s.canon, d, book)[0]))
            row[f"dp{d}"] = _bd(r)
        rows.append(row)
        print(row, flush=True)
    out["segments"] = rows
    wins = [r["segment"] for r in rows if "ops" in r and r[f"dp{low}"]["iteration_ms"] < r[f"dp{D}"]["iteration_ms"]]
    gain = sum(r[f"dp{D}"]["iteration_ms"] - r[f"dp{low}"]["iteration_ms"] for r in rows
               if "ops" in r and r["segment"] in wins)
    out["lower_degree_wins"] = {"segments": wins, "sum_of_gains_ms": gain}

    mixed = []
    tails = [wins[-k:] for k in range(1, min(len(wins), 4) + 1)] + [wins]
    for lows in tails:
        lows = set(lows) | {r["segment"] for r in rows if r.get("same_as") in lows}
        degrees = [low if i in lows else D for i in range(len(segs))]
        x, st = P._dp_by_segments(g, [list(s.nodes) for s in segs], degrees, book)
        r = mp.optimize(trimmed(x))
        mixed.append({"segments_at_low_degree": sorted(lows), "steps": len(st), **_bd(r)})
        print(mixed[-1], flush=True)
    out["mixed_by_rules"] = mixed

    pipes = []
    for S in ([4, 6, 8] if a.full else [4]):
        r, s = _cpu(P.search_pipeline, g, mp, min_stages=S, max_stages=S, budget_s=120, max_layers=max(12, S))
        pipes.append({"stages": S, "iteration_ms": r.cost * 1e3 if r.feasible else None, "micro_batches": r.micro_batches,
                      "stage_devices": [len(x.devices) for x in r.stages], "search_cpu_s": s})
        print(pipes[-1], flush=True)
    out["pipelines"] = pipes

    rules = {}
    for r in book.rules:
        ops = {n.op for n in r.source.nodes} | {n.op for n in r.target.nodes}
        for op in ("Conv2d", "BatchNorm"):
            if op in ops:
                rules.setdefault(op, []).append(r.name)
    out["rules_touching"] = rules
    out["degree_change_rules"] = degree_change_rules(book)

    # pipeline.by_rules on a 2-stage plan at summit:4x6
    m4 = parse_machine("summit:4x6")
    g4 = load_onnx(fig14.model_path(name), batch=fig14.per_gpu_batch(name) * 24, load_weights=False)
    mp4 = MachineMapper(CostModel(m4, optimizer=fig14.optimizer_of(name)))
    res = P.search_pipeline(g4, mp4, min_stages=2, max_stages=2, micro_batches=4, budget_s=60)
    fast, tf = _cpu(P.by_rules, g4, res, m4, book)
    keep = P._dp_by_segments
    P._dp_by_segments = lambda *x: None
    try:
        slow, ts = _cpu(P.by_rules, g4, res, m4, book)
    finally:
        P._dp_by_segments = keep
    rep, tr = _cpu(replay, g4, fast.rules, book, True)
    out["by_rules_4x6"] = {"stage_devices": [len(x.devices) for x in res.stages], "micro_batches": res.micro_batches,
                           "by_segments_cpu_s": tf, "whole_graph_cpu_s": ts, "steps": len(fast.rules),
                           "steps_whole_graph": len(slow.rules),
                           "same_pcg": fast.pcg.structural_hash() == slow.pcg.structural_hash(),
                           "replay_cpu_s": tr, "replays_to_plan": rep.structural_hash() == fast.pcg.structural_hash()}
    print(out["by_rules_4x6"], flush=True)

    with open(OUT + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    write_md(out)
    print(f"wrote {OUT}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
