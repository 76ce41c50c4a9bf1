"""Rule-set benchmark (issue 3, point 7): counts, generation + verification time, cache load time, and
matching speed of the whole rule set on paper-size BERT-Large.

    .venv/bin/python benchmarks/rules_bench.py [--regen] [--runs 3] [--skip-bert]

``--regen`` re-runs ``unity-pcg rules generate`` (default settings) into a temporary directory and
times it (minutes); without it the timings recorded in the shipped manifest are reported.  Writes
``benchmarks/results/rules_bench.json`` and ``rules_bench.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / ".cache"
RESULTS = ROOT / "benchmarks" / "results"


def cache_load_times(runs: int) -> dict:
    from unity_pcg.substitutions import cache
    inproc = []
    for _ in range(runs):
        cache._MEMO.clear()
        t0 = time.perf_counter()
        cache.load()
        inproc.append(time.perf_counter() - t0)
    code = ("import time; t=time.perf_counter(); from substitutions import cache; cache.load(); "
            "print(time.perf_counter()-t)")
    fresh = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        fresh.append(float(out.stdout.strip()))
    return {"load_s_median": statistics.median(inproc), "load_s_runs": inproc,
            "fresh_process_import_and_load_s_median": statistics.median(fresh), "fresh_runs": fresh}


def bert_matching(runs: int) -> dict:
    from unity_pcg.substitutions import cache
    from unity_pcg.substitutions.match import GraphIndex, iter_matches
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "bert_large-paper.onnx"
    if not path.exists():
        zoo.export("bert_large", str(path), size="paper")
    t0 = time.perf_counter()
    g = load_onnx(str(path), load_weights=False)
    import_s = time.perf_counter() - t0
    rules = cache.load().all_directions()
    times, counts = [], []
    per_rule: dict[str, int] = {}
    for _ in range(runs):
        t0 = time.perf_counter()
        idx = GraphIndex(g)
        n = 0
        for r in rules:
            k = 0
            for _m in iter_matches(r, g, idx, degrees=(2, 4)):
                k += 1
            per_rule[r.name] = k
            n += k
        times.append(time.perf_counter() - t0)
        counts.append(n)
    med = statistics.median(times)
    top = sorted(per_rule.items(), key=lambda kv: -kv[1])[:10]
    return {"graph_nodes": len(g), "op_counts": dict(g.op_counts().most_common(12)), "import_s": import_s,
            "rules_tried": len(rules), "matches": counts[0], "match_all_s_median": med, "match_all_s_runs": times,
            "matches_per_s": counts[0] / med if med else None,
            "rule_graph_scans_per_s": len(rules) / med if med else None, "top_rules": top}


def regenerate() -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "unity_pcg.cli", "rules", "generate", "-o", d, "--quiet"],
                       cwd=ROOT, check=True)
        wall = time.perf_counter() - t0
        man = json.loads((Path(d) / "manifest.json").read_text())
    return {"wall_s": wall, "manifest_seconds": man.get("seconds"), "counts": man.get("counts"),
            "stats": man.get("stats")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regen", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-bert", action="store_true")
    a = ap.parse_args()
    from unity_pcg.substitutions import cache
    rs = cache.load()
    man = rs.manifest
    res = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg_at_start": os.getloadavg()},
           "counts": man.get("counts"), "stats": {k: v for k, v in man.get("stats", {}).items()},
           "shipped_generation_seconds": man.get("seconds"), "generator": man.get("generator")}
    res["cache_load"] = cache_load_times(max(a.runs, 5))
    if a.regen:
        res["regeneration"] = regenerate()
    if not a.skip_bert:
        res["bert_large_paper_matching"] = bert_matching(a.runs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rules_bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    c = res["counts"] or {}
    lines = ["# Rule set benchmark", "", "Command: `.venv/bin/python benchmarks/rules_bench.py"
             + (" --regen" if a.regen else "") + "` (2-core CPU box shared with other jobs; medians).", "",
             "| quantity | value |", "|---|---|"]
    for k in ("rules", "parallel_rules", "algebraic_rules", "generated_rules", "template_rules", "axioms",
              "axiom_schemas", "parallel_axiom_schemas", "algebraic_axiom_schemas"):
        lines.append(f"| {k} | {c.get(k)} |")
    st = res["stats"]
    for k in ("graphs", "classes", "candidates", "pruned", "duplicates", "proven", "unproven"):
        lines.append(f"| {k} | {st.get(k)} |")
    sec = res["shipped_generation_seconds"] or {}
    lines.append(f"| generation s (shipped run) | {sec.get('generate')} |")
    lines.append(f"| verification s (shipped run) | {sec.get('verify')} |")
    lines.append(f"| total s (shipped run) | {sec.get('total')} |")
    if "regeneration" in res:
        lines.append(f"| regeneration wall s (this run) | {res['regeneration']['wall_s']:.1f} |")
    cl = res["cache_load"]
    lines.append(f"| cache load s (in process, median) | {cl['load_s_median']:.3f} |")
    lines.append(f"| import + cache load s (fresh process, median) | {cl['fresh_process_import_and_load_s_median']:.3f} |")
    if "bert_large_paper_matching" in res:
        b = res["bert_large_paper_matching"]
        lines.append(f"| BERT-Large (paper) nodes | {b['graph_nodes']} |")
        lines.append(f"| rules tried (both directions) | {b['rules_tried']} |")
        lines.append(f"| matches found (degrees 2,4) | {b['matches']} |")
        lines.append(f"| match-all s (median) | {b['match_all_s_median']:.3f} |")
        lines.append(f"| matches per second | {b['matches_per_s']:.0f} |")
    (RESULTS / "rules_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
