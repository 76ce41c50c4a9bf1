"""`--strategy megatron` and `--strategy alpa` over the import-coverage corpus (issue 18): per model, each either
prices a plan (predicted iteration time in our cost model) or says in one line why it does not apply.

The corpus is `benchmarks/export_models.py`'s exports (`benchmarks/.cache/coverage/*.onnx`: transformers at
2 layers / hidden 64 / batch 2 / sequence 16, torchvision at real size / batch 8, each by the legacy and the
dynamo exporter) plus the onnx wheel's light test models.  Each case runs in its own process (a timeout
cannot leave state behind):

* megatron: `simulate --strategy megatron` (search/baselines.py) on MACHINE (tensor parallel inside a node);
* alpa: `alpa_plan(..., deadline=now + BUDGET)` (search/alpa/inter.py), as `optimize --strategy alpa` runs it;
  the planner's wall time is reported beside the budget.

    nice .venv/bin/python benchmarks/baselines_coverage.py [--machine h100:1x4] [--budget 20] [--models bert,llama]
        [--light] [--out benchmarks/results/baselines_coverage]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, ".cache", "coverage")
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.dirname(HERE))


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:400]


def _megatron(path: str, machine: str, q) -> None:
    try:
        from unity_pcg.commands.simulate_cmd import simulate
        t = time.perf_counter()
        out = simulate(path, machine, "megatron")
        q.put({"status": "ok" if out["feasible"] else "infeasible", "time_s": out["predicted_iteration_s"],
               "tp": out.get("tp"), "dp": out.get("dp"), "fallbacks": len(out.get("fallbacks", [])),
               "reason": out.get("reason") or "", "wall_s": time.perf_counter() - t})
    except Exception as e:   # the strategy's one-line reason (or an error: recorded as such)
        from unity_pcg.errors import UnityError
        q.put({"status": "n/a" if isinstance(e, UnityError) else "error", "reason": _one_line(e)})


def _alpa(path: str, machine: str, budget: float, q) -> None:
    try:
        from unity_pcg.machine import parse_machine
        from unity_pcg.onnx_import import load_onnx
        from unity_pcg.search.alpa.inter import alpa_plan
        from unity_pcg.search.cost import CostModel
        from unity_pcg.search.mapping import MachineMapper
        t = time.monotonic()
        g = load_onnx(path, load_weights=False)
        m = parse_machine(machine)
        ar = alpa_plan(g, m, mapper=MachineMapper(CostModel(m)), deadline=t + budget)
        wall = time.monotonic() - t
        q.put({"status": "ok" if ar.feasible else "infeasible", "time_s": ar.cost if math.isfinite(ar.cost) else None,
               "stages": len(ar.stages), "micro_batches": ar.micro_batches, "layers": ar.stats.get("layers"),
               "valid_cuts": ar.stats.get("valid_cuts"), "deadline_hit": ar.stats.get("deadline_hit"),
               "fallback_solves": ar.stats.get("deadline_fallback_solves"), "plan": ar.pipeline.pcg is not None,
               "reason": ar.pipeline.reason or ar.stats.get("stitch_error") or "", "wall_s": wall})
    except Exception as e:
        from unity_pcg.errors import UnityError
        q.put({"status": "n/a" if isinstance(e, UnityError) else "error", "reason": _one_line(e)})


def _run(fn, args, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return {"status": "timeout", "reason": f"no answer in {timeout:.0f} s"}
    try:
        return q.get(timeout=5)
    except Exception:
        return {"status": "error", "reason": f"process exited with {p.exitcode}"}


def corpus(models: set | None, light: bool) -> list[tuple[str, str, str, str]]:
    """(model, family, exporter, path) of every export found, in the import-coverage order."""
    sys.path.insert(0, HERE)
    from export_models import HF_MODELS, TV_MODELS
    order = {n: k for k, n in enumerate(HF_MODELS + list(TV_MODELS))}
    fam = {n: "transformers" for n in HF_MODELS}
    fam.update({n: "torchvision" for n in TV_MODELS})
    rows = []
    for p in glob.glob(os.path.join(CACHE, "*.onnx")):
        base = os.path.basename(p)[:-5]
        name, _, exporter = base.rpartition("-")
        if name not in fam or (models and name not in models):
            continue
        rows.append((name, fam[name], exporter, p))
    rows.sort(key=lambda r: (r[1] != "transformers", order[r[0]], r[2]))
    if light:
        import onnx
        d = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
        for p in sorted(glob.glob(os.path.join(d, "*.onnx"))):
            n = os.path.basename(p)[:-5]
            if not models or n in models:
                rows.append((n, "onnx-light", "-", p))
    return rows


def _cell(r: dict) -> str:
    if r["status"] == "ok":
        extra = ""
        if "tp" in r and r.get("tp"):
            extra = f" (tp {r['tp']} x dp {r['dp']})"
        elif "stages" in r:
            extra = f" ({r['stages']} stage(s), {r['micro_batches']} mb, {r['wall_s']:.1f} s)"
        return f"ok {r['time_s'] * 1e3:.3f} ms{extra}"
    return f"{r['status']}: {r.get('reason', '')}".replace("|", "/")


def markdown(meta: dict, rows: list[dict]) -> str:
    ok_m = sum(r["megatron"]["status"] == "ok" for r in rows)
    ok_a = sum(r["alpa"]["status"] == "ok" for r in rows)
    over = [r for r in rows if r["alpa"].get("wall_s", 0) > meta["budget_s"] * 1.05]
    lines = [f"# Baselines over the import-coverage corpus: `--strategy megatron` and `--strategy alpa`", "",
             f"Measured {meta['date']} on {meta['host']} (shared, 2 CPUs); machine `{meta['machine']}`, fp32, Adam; "
             f"Alpa's budget {meta['budget_s']:.0f} s per model (`alpa_plan(deadline=...)`, as `optimize --strategy "
             f"alpa --budget` passes it). Command: `{meta['command']}`.", "",
             f"**megatron: {ok_m} of {len(rows)} priced; alpa: {ok_a} of {len(rows)} priced, "
             f"{len(over)} over its budget by more than 5%.** Where a strategy does not apply, its one-line reason.",
             "", "| model | family | exporter | megatron | alpa |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['family']} | {r['exporter']} | {_cell(r['megatron'])} | {_cell(r['alpa'])} |")
    if meta.get("notes"):
        lines += [""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="h100:1x4")
    ap.add_argument("--budget", type=float, default=20.0, help="Alpa's seconds per model (default 20)")
    ap.add_argument("--models", default="", help="comma-separated model names (default: all exported)")
    ap.add_argument("--light", action="store_true", help="also the onnx wheel's light test models")
    ap.add_argument("--out", default=os.path.join(RESULTS, "baselines_coverage"))
    ap.add_argument("--note", action="append", default=[])
    a = ap.parse_args(argv)
    sel = {m for m in a.models.split(",") if m} or None
    rows = []
    for name, fam, exp, path in corpus(sel, a.light):
        meg = _run(_megatron, (path, a.machine), 600)
        alp = _run(_alpa, (path, a.machine, a.budget), a.budget * 3 + 120)
        rows.append({"model": name, "family": fam, "exporter": exp, "file": os.path.relpath(path, HERE),
                     "megatron": meg, "alpa": alp})
        print(f"{name:22s} {exp:7s} megatron {_cell(meg)[:90]:90s} alpa {_cell(alp)[:90]}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.platform(),
            "machine": a.machine, "budget_s": a.budget, "notes": a.note,
            "command": "nice .venv/bin/python benchmarks/baselines_coverage.py " + " ".join(argv or sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
