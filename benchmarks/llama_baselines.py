"""A Llama-style decoder at a realistic size under the baselines and the search, in one cost model (issue 18):
`simulate --strategy dp`, `simulate --strategy megatron`, `optimize --strategy alpa --budget B` and
`optimize --budget B` (Unity's search), each in its own process, their predicted iteration times side by side.

The model: transformers' LlamaModel (hidden 4096, 32 heads / 8 key-value heads, SwiGLU 11008, RMSNorm, 4 layers,
vocabulary 32,000, sequence 2048) written by `benchmarks/llama_structure.py` (graph and weight shapes; its
external data a sparse file of zeros, read by nobody: `load_onnx(load_weights=False)`); the default path is
written on the first run.

    nice .venv/bin/python benchmarks/llama_baselines.py [--model benchmarks/.cache/llama/llama-4096.onnx]
        [--machine h100:4x8] [--batch 32] [--precision bf16] [--budget 60] [--out benchmarks/results/llama_baselines]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLI = [sys.executable, "-m", "unity_pcg.cli"]


def _cli(args: list, timeout: float) -> dict:
    import tempfile
    t = time.monotonic()
    if args[0] == "optimize":            # its plan file (default plan.json in the working directory) goes nowhere
        args = args + ["-o", os.path.join(tempfile.mkdtemp(prefix="llama-baselines-"), "plan.json")]
    try:
        p = subprocess.run(CLI + args + ["--json"], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "wall_s": time.monotonic() - t}
    wall = time.monotonic() - t
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": "n/a", "reason": err[:400], "wall_s": wall}
    out["wall_s"] = wall
    out["status"] = "ok" if out.get("feasible", out.get("predicted", {}).get("feasible")) else "infeasible"
    return out


def _time(out: dict):
    for k in ("predicted_iteration_s",):
        if out.get(k) is not None:
            return out[k]
    pred = out.get("predicted") or out.get("plan", {}).get("predicted") or {}
    return pred.get("predicted_iteration_s") or pred.get("iteration_s")


def _plan(r: dict) -> str:
    """What the plan is, in a few words (the search's choice; Alpa's stages and what its deadline cut)."""
    se = r["info"].get("search") or {}
    if se.get("alpa_stages"):
        st = se["alpa_stages"]
        a = se.get("alpa") or {}
        return (f"{len(st)} stage(s) ({', '.join('%dx%d' % tuple(x['shape']) for x in st)}), "
                f"{se.get('micro_batches')} micro-batch(es), {a.get('layers')} layers, {a.get('solves')} ILP solves")
    if se.get("chosen"):
        return f"{se['chosen']}, {r['info'].get('rule_steps', 0)} rule steps"
    fb = r["info"].get("fallbacks") or []
    return f"{len(fb)} op(s) unpartitioned" if fb else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(HERE, ".cache", "llama", "llama-4096.onnx"))
    ap.add_argument("--machine", default="h100:4x8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "llama_baselines"))
    a = ap.parse_args(argv)
    if not os.path.exists(a.model):     # written once by llama_structure.py (its defaults are the model above)
        print(f"writing {os.path.relpath(a.model, ROOT)} (benchmarks/llama_structure.py) ...", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "llama_structure.py"), a.model], check=True, cwd=ROOT)
    common = ["--machine", a.machine, "--batch", str(a.batch), "--precision", a.precision]
    runs = [("dp", ["simulate", a.model, "--strategy", "dp"] + common, 1800),
            ("megatron", ["simulate", a.model, "--strategy", "megatron"] + common, 1800),
            ("alpa", ["optimize", a.model, "--strategy", "alpa", "--budget", str(a.budget)] + common, 1800),
            ("unity (optimize)", ["optimize", a.model, "--budget", str(a.budget)] + common, 1800)]
    rows = []
    for name, args, tmo in runs:
        out = _cli(args, tmo)
        t = _time(out)
        row = {"strategy": name, "command": "unity-pcg " + " ".join(os.path.relpath(x, ROOT) if x == a.model else x
                                                                     for x in args),
               "status": out["status"], "time_s": t, "wall_s": out["wall_s"], "reason": out.get("reason", ""),
               "tp": out.get("tp"), "dp": out.get("dp"), "max_memory_bytes": out.get("max_memory_bytes"),
               "info": {k: out.get(k) for k in ("search_s", "solve_s", "stats", "search", "fallbacks", "rule_steps",
                                                "comm_elements") if k in out}}
        rows.append(row)
        print(f"{name:18s} {row['status']:10s} {t * 1e3 if t else float('nan'):10.1f} ms  wall {out['wall_s']:.1f} s "
              f"{row['reason'][:100]}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.platform(),
            "model": os.path.relpath(a.model, ROOT), "machine": a.machine, "batch": a.batch, "precision": a.precision,
            "budget_s": a.budget}
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    dp = next((r["time_s"] for r in rows if r["strategy"] == "dp" and r["time_s"]), None)
    lines = ["# A Llama-style decoder under the baselines and the search, one cost model", "",
             f"Measured {meta['date']} on {meta['host']} (shared, 2 CPUs). Model: transformers LlamaModel, hidden 4096, "
             f"32 heads / 8 key-value heads, SwiGLU 11008, RMSNorm, 4 layers, vocabulary 32,000, sequence 2048 "
             f"(`benchmarks/llama_structure.py`: graph and weight shapes only); batch {a.batch}, {a.precision}, Adam, "
             f"`{a.machine}`; budgets {a.budget:.0f} s.", "",
             "| strategy | predicted iteration | vs dp | memory / device | wall | plan | command |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        t = f"{r['time_s'] * 1e3:.1f} ms" if r["time_s"] else r["status"] + (": " + r["reason"] if r["reason"] else "")
        sp = f"{dp / r['time_s']:.2f}x" if dp and r["time_s"] else ""
        mem = f"{r['max_memory_bytes'] / 2**30:.1f} GiB" if r.get("max_memory_bytes") else ""
        lines.append(f"| {r['strategy']}{' (tp %s x dp %s)' % (r['tp'], r['dp']) if r.get('tp') else ''} | {t} | {sp} "
                     f"| {mem} | {r['wall_s']:.0f} s | {_plan(r)} | `{r['command']}` |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
