"""Large language models as they are trained today (issue 19.6): Unity (`optimize`) against Megatron-LM as its
users tune it (`--strategy megatron`: the best of the grid over tensor, pipeline and data degrees, micro-batch,
recomputation and the distributed optimizer, search/tuned.py), FSDP (`--strategy zero3`) and Alpa
(`--strategy alpa`), all priced in our cost model, planner seconds included.

Settings, on `h100:Nx8` (N = 1, 2, 4, 8), bf16, Adam:

* the zoo's Llama-style decoders (`unity_pcg.zoo.LLAMA_MODELS`: llama_1b, llama_7b, llama_13b, llama_70b) at
  every N, global batch 1,024 sequences of 2,048 tokens;
* Alpa's GPT settings (Alpa OSDI'22 Table 6, seq 1024, batch 1024) with the model Alpa pairs with that many GPUs:
  gpt_2_6b on 8, gpt_6_7b on 16, gpt_15b on 32, gpt_39b on 64.

Each model is exported weight-free (`unity_pcg.zoo.structure.export_structure`: graph and weight shapes, no
bytes) into benchmarks/.cache/llm/, once.  ``--layers K`` keeps K decoder blocks at the same width (the
per-layer structure repeats; a 2-core machine plans the full depth slowly): the table then says so, and its
numbers are those of the K-layer model, not of the full one.  Each planner runs in its own process
(`unity-pcg optimize --strategy S --budget B --batch 1024 --precision bf16 --json`); rows are appended to
benchmarks/results/llm.json as they finish, so a run resumes where it stopped (``--rerun`` prices again).

    .venv/bin/python benchmarks/llm.py --models llama_1b,llama_7b --nodes 1,2 --budget 30 --layers 4
    .venv/bin/python benchmarks/llm.py --report          # llm.md (and llm.png with matplotlib) from the JSON
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
CACHE = os.path.join(HERE, ".cache", "llm")
RESULTS = os.path.join(HERE, "results")
JSON_OUT = os.path.join(RESULTS, "llm.json")
MD_OUT = os.path.join(RESULTS, "llm.md")
PNG_OUT = os.path.join(RESULTS, "llm.png")
CLI = [sys.executable, "-m", "unity_pcg.cli"]

LLAMAS = ("llama_1b", "llama_7b", "llama_13b", "llama_70b")
GPT_AT = {1: "gpt_2_6b", 2: "gpt_6_7b", 4: "gpt_15b", 8: "gpt_39b"}      # Alpa's model for 8N GPUs
NODES = (1, 2, 4, 8)
BATCH = 1024
LLAMA_SEQ = 2048
PLANNERS = (("unity", "unity"), ("megatron", "megatron (tuned)"), ("zero3", "zero3 (FSDP)"), ("alpa", "alpa"))


def settings(models, nodes) -> list[tuple[str, int]]:
    """(model, N) pairs: every Llama at every N; a GPT only at the N Alpa pairs it with."""
    out = []
    for n in nodes:
        for name in models:
            if name in LLAMAS or GPT_AT.get(n) == name:
                out.append((name, n))
    return out


def model_path(name: str, layers: int | None) -> tuple[str, int]:
    """The weight-free ONNX of ``name`` (``layers`` blocks, None: all), exported once; (path, layers)."""
    from unity_pcg.zoo import CONFIGS
    from unity_pcg.zoo import models
    from unity_pcg.zoo.structure import export_structure
    cfg = CONFIGS[name]["paper"]
    full = cfg.layers
    k = min(layers, full) if layers else full
    changes = {"layers": k}
    if name in LLAMAS:
        changes["seq"] = LLAMA_SEQ
    cfg = dataclasses.replace(cfg, **changes)
    os.makedirs(CACHE, exist_ok=True)
    p = os.path.join(CACHE, f"{name}-L{k}-s{cfg.seq}.onnx")
    if not os.path.exists(p):
        print(f"exporting {name} ({k} of {full} layers, seq {cfg.seq}, structure only) ...", file=sys.stderr, flush=True)
        inputs = models.example_inputs(name, cfg, 1)
        in_names, out_names = models.io_names(name, cfg)
        specs = [(n, (1,) + tuple(x.shape[1:]), x.dtype) for n, x in zip(in_names, inputs)]
        export_structure(lambda: models.make_module(name, cfg), p, inputs=specs, output_names=out_names,
                         metadata={"unity_pcg.zoo": f"{name} paper, {k} layers, seq {cfg.seq}"})
    return p, k


def _full_layers(name: str) -> int:
    from unity_pcg.zoo import CONFIGS
    return CONFIGS[name]["paper"].layers


def _run(strategy: str, model: str, machine: str, budget: float) -> dict:
    out_plan = os.path.join(tempfile.mkdtemp(prefix="llm-"), "plan.json")
    args = ["optimize", model, "--machine", machine, "--strategy", strategy, "--budget", str(budget),
            "--batch", str(BATCH), "--precision", "bf16", "--optimizer", "adam", "--json", "-o", out_plan]
    t = time.monotonic()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        p = subprocess.run(CLI + args, capture_output=True, text=True, timeout=3 * budget + 300, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": time.monotonic() - t}
    wall = time.monotonic() - t
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru2.ru_utime + ru2.ru_stime) - (ru.ru_utime + ru.ru_stime)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        lines = p.stderr.strip().splitlines() or ["?"]
        # a crash keeps where it happened (the traceback's last frame) beside its message
        at = [ln.strip() for ln in lines if ln.strip().startswith("File ")][-1:]
        return {"status": "n/a", "reason": lines[-1][:400], **({"where": at[0][:300]} if at else {}),
                "wall_s": wall, "cpu_s": cpu}
    out["wall_s"] = wall
    out["cpu_s"] = cpu
    out["status"] = "ok" if out.get("feasible") else "infeasible"
    return out


def _plan_words(strategy: str, out: dict) -> str:
    se = out.get("search") or {}
    c = se.get(f"{strategy}_config")
    if c:
        s = f"tp{c['tp']} pp{c['pp']} dp{c['dp']} mbs{c['micro_batch']} x{c['micro_batches']}"
        if c["recompute"] != "none":
            s += f", {c['recompute']} recompute"
        if c.get("distributed_optimizer"):
            s += ", distributed optimizer"
        if c.get("zero") == 3:
            s += ", ZeRO-3"
        if c.get("offload"):
            s += ", optimizer offload"
        return s
    if se.get("alpa_stages"):
        st = se["alpa_stages"]
        return (f"{len(st)} stage(s) ({', '.join('%dx%d' % tuple(x['shape']) for x in st)}), "
                f"{se.get('micro_batches')} micro-batches")
    return str(se.get("chosen") or "")


def _load() -> dict:
    if os.path.exists(JSON_OUT):
        with open(JSON_OUT) as f:
            return json.load(f)
    return {"rows": []}


def _save(data: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    tmp = JSON_OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, JSON_OUT)


def _key(r: dict) -> tuple:
    return (r["model"], r["nodes"], r["planner"], r["layers"], r["budget_s"])


def run(models, nodes, budget: float, layers: int | None, planners, rerun: bool) -> None:
    data = _load()
    done = {_key(r) for r in data["rows"]}
    for name, n in settings(models, nodes):
        path, k = model_path(name, layers)
        machine = f"h100:{n}x8"
        for strategy, _ in PLANNERS:
            if strategy not in planners:
                continue
            key = (name, n, strategy, k, budget)
            if key in done and not rerun:
                continue
            out = _run(strategy, path, machine, budget)
            t = out.get("predicted_iteration_s")
            row = {"model": name, "nodes": n, "gpus": 8 * n, "machine": machine, "planner": strategy, "layers": k,
                   "full_layers": _full_layers(name),
                   "seq": LLAMA_SEQ if name in LLAMAS else 1024, "batch": BATCH, "budget_s": budget,
                   "status": out["status"], "iteration_s": t,
                   "samples_s": BATCH / t if t else None, "wall_s": round(out["wall_s"], 1),
                   "cpu_s": round(out["cpu_s"], 1) if out.get("cpu_s") is not None else None,
                   "chosen": (out.get("search") or {}).get("chosen"),
                   "best_own": (out.get("search") or {}).get("best_own"),
                   "best_own_s": (out.get("search") or {}).get("best_own_s"),
                   "grid": {k: ((out.get("search") or {}).get("tuned") or {}).get(k) for k in ("cut", "points_priced")}
                   if (out.get("search") or {}).get("tuned") else None,
                   "reason": out.get("reason", ""), "max_memory_bytes": out.get("max_memory_bytes"),
                   "plan": _plan_words(strategy, out), "config": (out.get("search") or {}).get(f"{strategy}_config"),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node()}
            data["rows"] = [r for r in data["rows"] if _key(r) != key] + [row]
            _save(data)
            print(f"{name:10s} N={n} {strategy:9s} {row['status']:10s} "
                  f"{(t or math.nan) * 1e3:12.1f} ms  wall {row['wall_s']:.0f} s  {row['plan'] or row['reason'][:80]}",
                  flush=True)


def _decides(unity_rows) -> list:
    """Issue 18 point 2 at this scale: of Unity's rows where no pipeline wins, those whose plan is the general
    search's own (``info.search.best_own``: the layouts, accumulation, the segments) or within 1% of it."""
    rows = [r for r in unity_rows if r and r.get("status") == "ok" and "best_own" in r]
    if not rows:
        return []

    def piped(r) -> bool:          # Unity's stage search, or a tuned floor with pipeline stages
        chosen = r.get("chosen") or ""
        return chosen.startswith("pipeline") or any(int(x) > 1 for x in re.findall(r"\bpp(\d+)", chosen))
    rest = [r for r in rows if not piped(r)]
    own = [r for r in rest if r.get("best_own_s") and r["iteration_s"] and r["best_own_s"] <= r["iteration_s"] * 1.01]
    feasible = [r for r in rows if r.get("best_own_s")]
    return [f"The search decides (issue 18 point 2): in {len(own)} of {len(rest)} setting(s) where no pipeline wins "
            f"the plan is the general search's own or within 1% of it; the general search has a feasible plan of "
            f"its own in {len(feasible)} of {len(rows)} setting(s)."]


def report() -> None:
    data = _load()
    rows = data["rows"]
    by: dict = {}
    for r in rows:
        by.setdefault((r["model"], r["nodes"], r["layers"], r["budget_s"]), {})[r["planner"]] = r
    lines = ["# Large language models: Unity against tuned Megatron-LM, ZeRO-3 and Alpa (one cost model)", "",
             "`benchmarks/llm.py`: `h100:Nx8`, bf16, Adam, global batch 1,024 (Llama: seq 2,048; Alpa's GPTs: "
             "seq 1,024), predicted iteration time and throughput (samples/s); each planner runs in its own "
             "process under the same `--budget` (planner wall seconds, import included, and the CPU seconds it got, "
             "in parentheses: on a shared machine a planner may get a fraction of a core). "
             "Megatron-LM is the best configuration of its grid (search/tuned.py) found within the budget. "
             "`layers`: decoder blocks planned (a reduced depth keeps the width; its numbers are that model's, not "
             "the full one's).", "",
]
    header = ("| model | GPUs | layers | budget | Unity | Megatron-LM (tuned) | ZeRO-3 | Alpa | Unity / Megatron | "
              "Unity / best baseline |")
    sep = "|---|---:|---:|---:|---|---|---|---|---:|---:|"

    def secs(r):
        return f"{r['wall_s']:.0f} s" + (f", cpu {r['cpu_s']:.0f} s" if r.get("cpu_s") is not None else "")

    def cell(r):
        if r is None:
            return "-"
        if r["status"] != "ok":
            return f"{r['status']} ({secs(r)})" + (f": {r['reason'][:60]}" if r.get("reason") else "")
        g = r.get("grid") or {}
        cut = f"; grid cut at {g.get('points_priced')} points" if g.get("cut") else ""
        return f"{r['samples_s']:.1f}/s ({secs(r)}{cut}) {r['plan']}"

    def table(keys, title):
        """One table of settings ``keys`` and its summary lines (ratios over the settings where both priced)."""
        out = [title, "", header, sep]
        ratios, best_ratios, missing = [], [], []
        for model, n, k, b in keys:
            ps = by[(model, n, k, b)]
            u = ps.get("unity")
            ut = u["samples_s"] if u and u["status"] == "ok" else None
            mg = ps.get("megatron")
            mt = mg["samples_s"] if mg and mg["status"] == "ok" else None
            base = [ps[p]["samples_s"] for p in ("megatron", "zero3", "alpa") if p in ps and ps[p]["status"] == "ok"]
            r1 = f"{ut / mt:.2f}x" if ut and mt else ""
            r2 = f"{ut / max(base):.2f}x" if ut and base else ""
            if ut and mt:
                ratios.append(ut / mt)
            if ut and base:
                best_ratios.append(ut / max(base))
            if base and not ut:
                missing.append(f"{model} on {8 * n}")
            full = _full_layers(model)
            out.append(f"| {model} | {8 * n} | {k}{'' if k == full else f' of {full}'} | {b:.0f} s | {cell(u)} | "
                       f"{cell(mg)} | {cell(ps.get('zero3'))} | {cell(ps.get('alpa'))} | {r1} | {r2} |")
        out.append("")
        if ratios:
            out.append(f"Unity / tuned Megatron-LM: mean {sum(ratios) / len(ratios):.2f}x, lowest {min(ratios):.2f}x "
                       f"over {len(ratios)} setting(s); Unity / best baseline: mean "
                       f"{sum(best_ratios) / len(best_ratios):.2f}x, lowest {min(best_ratios):.2f}x.")
        if missing:
            out.append(f"No Unity plan where a baseline has one: {', '.join(missing)}.")
        alone = [f"{m} on {8 * n}" for m, n, k, b in keys
                 if (by[(m, n, k, b)].get("unity") or {}).get("status") == "ok"
                 and not any((by[(m, n, k, b)].get(p) or {}).get("status") == "ok" for p in ("megatron", "zero3", "alpa"))
                 and any(p in by[(m, n, k, b)] for p in ("megatron", "zero3", "alpa"))]
        if alone:
            out.append(f"Only Unity has a feasible plan: {', '.join(alone)}.")
        out += _decides([by[key].get("unity") for key in keys])
        return out + [""]

    order = sorted(by, key=lambda x: (x[1], x[0], x[2]))
    full_keys = [key for key in order if key[2] == _full_layers(key[0])]
    reduced_keys = [key for key in order if key[2] != _full_layers(key[0])]
    if full_keys:
        lines += table(full_keys, "## Full depth (every decoder block)")
    if reduced_keys:
        lines += table(reduced_keys, "## Reduced depth (the first K blocks at full width)")
    runs = sorted({(r["budget_s"], r["layers"], r["full_layers"] if "full_layers" in r else _full_layers(r["model"]))
                   for r in rows})
    if any(k != f for _, k, f in runs):
        lines.append("Reduced depth: on this 2-core machine one Megatron layout of the full-depth Llama 7B (32 blocks, "
                     "1,315 operators) takes ~4 s to build and map, so a 30 s budget prices a handful; the rows with "
                     "`K of L` layers plan the first K blocks at full width (embedding, head and vocabulary unchanged).")
    shares = sorted(r["cpu_s"] / r["wall_s"] for r in rows if r.get("cpu_s") and r.get("wall_s"))
    if shares:
        lines.append(f"CPU share of the planner runs that record it: median {shares[len(shares) // 2]:.0%} of a core "
                     f"(lowest {shares[0]:.0%}, highest {shares[-1]:.0%}); a deadline-bound grid (the tuned "
                     f"baselines walk theirs under the same budget) prices fewer points the less it gets.")
    dates = sorted({r["date"] for r in rows})
    if dates:
        lines.append(f"Measured {dates[0]} .. {dates[-1]} on a shared 2-core machine ({platform.platform()}).")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines.append("No plot: matplotlib is not installed here (`llm.png` is drawn where it is).")
    else:
        keys = sorted(by, key=lambda x: (x[1], x[0], x[2]))
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
        w = 0.2
        for i, (p, label) in enumerate(PLANNERS):
            ys = [(by[k].get(p) or {}).get("samples_s") or 0 for k in keys]
            ax.bar([j + (i - 1.5) * w for j in range(len(keys))], ys, w, label=label)
        for j, k in enumerate(keys):
            u, mg = by[k].get("unity"), by[k].get("megatron")
            if u and mg and u.get("samples_s") and mg.get("samples_s"):
                ax.annotate(f"{u['samples_s'] / mg['samples_s']:.2f}x", (j - 1.5 * w, u["samples_s"]),
                            ha="center", va="bottom", fontsize=6)
        ax.set_title("predicted throughput per setting (label: Unity / tuned Megatron-LM)", fontsize=8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{k[0]}\n{8 * k[1]} GPUs" for k in keys], fontsize=7)
        ax.set_ylabel("samples / s (predicted)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(PNG_OUT, dpi=120)
        lines.append("Plot: `llm.png` (throughput per setting).")
    with open(MD_OUT, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(LLAMAS + tuple(GPT_AT.values())),
                    help="comma-separated zoo names (default: the four Llamas and Alpa's GPTs)")
    ap.add_argument("--nodes", default="1,2,4,8", help="comma-separated N of h100:Nx8 (default 1,2,4,8)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per planner run (default 60)")
    ap.add_argument("--layers", type=int, default=0, help="decoder blocks to plan (default 0: the full depth)")
    ap.add_argument("--planners", default="unity,megatron,zero3,alpa")
    ap.add_argument("--rerun", action="store_true", help="price settings already in llm.json again")
    ap.add_argument("--report", action="store_true", help="only write llm.md (and llm.png) from llm.json")
    a = ap.parse_args(argv)
    if not a.report:
        models = [m for m in a.models.split(",") if m]
        bad = [m for m in models if m not in LLAMAS and m not in GPT_AT.values()]
        if bad:
            ap.error(f"unknown model(s) {', '.join(bad)} (known: {', '.join(LLAMAS + tuple(GPT_AT.values()))})")
        nodes = [int(x) for x in a.nodes.split(",") if x]
        run(models, nodes, a.budget, a.layers or None, set(a.planners.split(",")), a.rerun)
    report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
