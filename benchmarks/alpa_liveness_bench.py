"""Alpa's intra-operator ILP: the memory constraint per liveness step against the single end-of-forward row.

For each GPT model (paper size, structure only, one of Alpa's 128 micro-batches of the global 1,024) on a
mesh of ``dgx-a100`` devices: the ILP (``IntraProblem``) built once, then solved under memory budgets (the
device's capacity and fractions of it) twice, with one row per liveness step that can bind (the default)
and with the single row of the end of the forward pass (``liveness=False``, what this pass had before).
Reports the rows, the solve time, the objective, and both memories of each choice (the liveness peak and
the end-of-forward total), so one sees where the per-step rows are tighter and what they cost.

    .venv/bin/python benchmarks/alpa_liveness_bench.py --models gpt_15b,gpt_39b
writes benchmarks/results/alpa_liveness.{json,md}.

    .venv/bin/python benchmarks/alpa_liveness_bench.py --planner gpt_39b --repeat 2
times Alpa's whole planner (``alpa_gpt.run_alpa``, the GPT settings) with the liveness rows and with the
single row alternately in one process (price caches cleared before each run, so both pay the same work
on the same loaded machine) -> benchmarks/results/alpa_liveness_planner.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

MESH = {"gpt_350m": (1, 1), "gpt_1_3b": (1, 4), "gpt_2_6b": (1, 8), "gpt_6_7b": (2, 8), "gpt_15b": (4, 8),
        "gpt_39b": (4, 8)}


def run(models, fractions, micro_batches):
    from alpa_gpt import GPT_BATCH, model_path
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.alpa.intra import IntraInfeasible, IntraProblem
    rows = []
    for name in models:
        n0, n1 = MESH[name]
        m = parse_machine(f"dgx-a100:{max(1, n0 * n1 // 8)}x{min(8, n0 * n1)}")
        batch = GPT_BATCH // micro_batches
        g = load_onnx(model_path(name), batch=batch, load_weights=False)
        t0 = time.perf_counter()
        prob = IntraProblem(g, m, (n0, n1), optimizer="adam")
        build = time.perf_counter() - t0
        cap = float(m.device.usable_bytes)
        for f in fractions:
            budget = cap * f
            row = dict(model=name, mesh=[n0, n1], batch=batch, build_s=build, budget_gib=budget / 2**30,
                       steps=prob.steps, **prob.size())
            for mode in ("liveness", "end_of_forward"):
                t = time.perf_counter()
                try:
                    choice, obj, status, _ = prob.solve(budget, liveness=(mode == "liveness"))
                    row[mode] = dict(solve_s=time.perf_counter() - t, objective_s=obj, status=status,
                                     rows=getattr(prob, "last_rows", None), lp_solves=getattr(prob, "solves", None),
                                     liveness_peak_gib=prob.memory(choice) / 2**30,
                                     end_of_forward_gib=prob.memory_end_of_forward(choice) / 2**30,
                                     choice=[choice[a] for a in prob.anchors])
                except IntraInfeasible as e:
                    row[mode] = dict(solve_s=time.perf_counter() - t, infeasible=str(e))
            a, b = row["liveness"], row["end_of_forward"]
            row["same_choice"] = a.get("choice") == b.get("choice") if "choice" in a and "choice" in b else None
            for mode in ("liveness", "end_of_forward"):
                row[mode].pop("choice", None)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def planner(model, repeat, out):
    """Alpa's planner on ``model`` (its Alpa GPT machine) with and without the liveness rows, alternating."""
    import alpa_gpt
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.alpa import intra
    m = parse_machine(alpa_gpt.gpt_machine(zoo.ALPA_GPUS[model]))
    g = load_onnx(alpa_gpt.model_path(model), batch=alpa_gpt.GPT_BATCH, load_weights=False)
    orig = intra.IntraProblem.solve
    runs = []
    for k in range(repeat):
        for live in (True, False):
            intra._SHARED.clear()
            intra.IntraProblem.solve = (lambda self, *a, _live=live, **kw: orig(self, *a, **dict(kw, liveness=_live)))
            try:
                r = alpa_gpt.run_alpa(g, m, "adam", alpa_gpt.ALPA_GPT)
            finally:
                intra.IntraProblem.solve = orig
            row = dict(model=model, machine=m.name if hasattr(m, "name") else str(m), run=k,
                       rows="liveness" if live else "end_of_forward", planner_s=r["planner_s"],
                       iteration_s=r.get("iteration_s"), solves=r.get("solves"), profile_s=r.get("profile_s"),
                       stage_dp_s=r.get("stage_dp_s"), stages=r.get("stages"))
            runs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    with open(out + ".json", "w") as f:
        json.dump(runs, f, indent=1)
    lines = ["# Alpa's planner with the liveness rows and with the single end-of-forward row", "",
             "Generated by `benchmarks/alpa_liveness_bench.py --planner MODEL`: `alpa_gpt.run_alpa` (8 layers, "
             "128 micro-batches, `layer_sum`) alternately with each formulation, price caches cleared before "
             "each run; wall seconds on a 2-core machine shared with other jobs (compare rows of one table).", "",
             "| model | run | rows | planner s | ILP solves | profile s | stage DP s | iteration s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['model']} | {r['run']} | {r['rows']} | {r['planner_s']:.1f} | {r['solves']} | "
                     f"{_f(r['profile_s'], '{:.1f}')} | {_f(r['stage_dp_s'])} | {_f(r['iteration_s'], '{:.2f}')} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def write(rows, out):
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["# Alpa's intra-operator ILP: memory rows per liveness step vs the single end-of-forward row", "",
             "Generated by `benchmarks/alpa_liveness_bench.py`. GPT at paper size, one micro-batch of 8 sequences "
             "(Alpa's 128 of the global 1,024), Adam, the mesh Alpa's plan uses; the ILP built once "
             "(`build s`), solved under each budget with the liveness rows (`live`: added lazily, each when a "
             "solution exceeds the budget at its step, so `rows` is what was needed) and with the single row "
             "(`eof`). Peak: the largest bytes per device over the liveness steps of the choice; eof: its "
             "end-of-forward total (what the single row bounds). Wall times on a 2-core machine shared "
             "with other jobs.", "",
             "| model | mesh | budget GiB | steps | build s | live rows (LP solves) | live solve s | eof solve s | live obj s "
             "| eof obj s | live peak / eof GiB | eof-row choice: peak / eof GiB | same choice |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["liveness"], r["end_of_forward"]
        lines.append(
            f"| {r['model']} | {r['mesh'][0]}x{r['mesh'][1]} | {r['budget_gib']:.1f} | {r['steps']} | "
            f"{r['build_s']:.1f} | {a.get('rows', '-')} ({a.get('lp_solves', '-')}) | {a['solve_s']:.2f} | {b['solve_s']:.2f} | "
            f"{_f(a.get('objective_s'), '{:.4f}') if 'objective_s' in a else 'infeasible'} | "
            f"{_f(b.get('objective_s'), '{:.4f}') if 'objective_s' in b else 'infeasible'} | "
            f"{_f(a.get('liveness_peak_gib'))} / {_f(a.get('end_of_forward_gib'))} | "
            f"{_f(b.get('liveness_peak_gib'))} / {_f(b.get('end_of_forward_gib'))} | {r['same_choice']} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt_15b,gpt_39b")
    ap.add_argument("--fractions", default="1.0,0.5,0.25", help="budgets as fractions of the device's memory")
    ap.add_argument("--micro-batches", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "alpa_liveness"))
    ap.add_argument("--planner", default=None, help="time Alpa's planner on this GPT model instead")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args(argv)
    if a.planner:
        planner(a.planner, a.repeat, os.path.join(HERE, "results", "alpa_liveness_planner"))
        return 0
    rows = run(a.models.split(","), [float(x) for x in a.fractions.split(",")], a.micro_batches)
    write(rows, a.out)
    print(open(a.out + ".md").read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
