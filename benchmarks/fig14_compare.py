"""Figure 14 rerun against an earlier run: Unity's throughput per row and the mechanism that chose the plan.

    .venv/bin/python benchmarks/fig14_compare.py NEW.json [--base BASE.json | --base-commit c290828] [-o OUT.md]

``NEW.json`` and the base are files ``benchmarks/fig14.py`` writes (``--base-commit`` reads
benchmarks/results/fig14.json as of that commit from git).  Per (model, GPUs): the base and new throughput of the
``unity`` search, their ratio, the search seconds, the mechanism (``info.search.chosen``) then and now, and the
counts the search issue asks for: rows at or above 0.98x of the base, and rows whose plan is the general search's
own (a layout proposal, the segment search, accumulation, a pipeline) rather than a floor.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLOOR_WORDS = ("baseline", "data parallel by rules", "fallback")


def _rows(obj: dict) -> dict:
    return {(r["model"], r["devices"]): r for r in obj["rows"] if r.get("strategy") == "unity"}


def _load_base(path: str | None, commit: str | None) -> dict:
    if path:
        with open(path) as f:
            return json.load(f)
    out = subprocess.run(["git", "show", f"{commit}:benchmarks/results/fig14.json"], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    return json.loads(out)


def own(chosen: str | None) -> bool:
    """The plan came from the general search (not a floor: dp, a fixed strategy, a fallback)."""
    c = chosen or ""
    return bool(c) and not any(w in c for w in FLOOR_WORDS)


def compare(new: dict, base: dict) -> tuple[list[dict], dict]:
    nb, bb = _rows(new), _rows(base)
    out = []
    for key in sorted(nb):
        r, b = nb[key], bb.get(key)
        t, bt = r.get("throughput_samples_s") or 0.0, (b or {}).get("throughput_samples_s") or 0.0
        out.append({"model": key[0], "devices": key[1], "base": bt, "new": t, "ratio": t / bt if bt else None,
                    "search_s": r.get("search_s"), "chosen": (r.get("search") or {}).get("chosen"),
                    "base_chosen": ((b or {}).get("search") or {}).get("chosen"), "code": r.get("code")})
    ok = [x for x in out if x["ratio"] is not None and x["ratio"] >= 0.98]
    counts = {"rows": len(out), "at_least_0.98": len(ok), "own": sum(own(x["chosen"]) for x in out),
              "own_base": sum(own(x["base_chosen"]) and "seed family" not in (x["base_chosen"] or "")
                              for x in out)}
    return out, counts


def report(out: list[dict], counts: dict, new_name: str, base_name: str) -> str:
    o = [f"# Figure 14 rerun ({new_name}) against {base_name}", "",
         "`benchmarks/fig14_compare.py`. Unity's throughput (samples/s) per row in both runs, their ratio and the "
         "mechanism that chose the plan (`info.search.chosen`). *own*: the general search's plan (a layout "
         "proposal, the segment search, gradient accumulation, a pipeline), not a floor.", "",
         "| model | GPUs | base | new | new / base | search (s) | chosen now | chosen before |",
         "|---|---:|---:|---:|---:|---:|---|---|"]
    for x in out:
        ratio = f"{x['ratio']:.3f}x" if x["ratio"] is not None else "-"
        o.append(f"| {x['model']} | {x['devices']:,} | {x['base']:,.0f} | {x['new']:,.0f} | {ratio} | "
                 f"{x['search_s'] or 0:.1f} | {x['chosen']} | {x['base_chosen']} |")
    o += ["", f"Rows: {counts['rows']}; at least 0.98x of the base: {counts['at_least_0.98']}; plan from the "
          f"general search: {counts['own']} (before: {counts['own_base']} outside the seed families)."]
    return "\n".join(o) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("--base", default=None)
    ap.add_argument("--base-commit", default="c290828")
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args(argv)
    with open(a.new) as f:
        new = json.load(f)
    base = _load_base(a.base, None if a.base else a.base_commit)
    out, counts = compare(new, base)
    md = report(out, counts, os.path.basename(a.new), a.base or f"fig14.json at {a.base_commit}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"rows": out, "counts": counts}, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
