"""ONNX import benchmark: the seven zoo models at paper size, plus the onnx wheel's light_densenet121.

For each model: export once with the legacy exporter (cached under benchmarks/.cache/, git-ignored; with
``zoo.export_structure`` where the zoo supports it: the real graph and weight shapes, weights a sparse
zero file, nothing allocated), import
it N times (default 5) with ``load_onnx`` and record the median wall time, the ONNX node count and the PCG's
operator counts (compute operators; sources = Input/Weight nodes are counted apart), parameters and FLOPs of one
forward pass.  Target (issue 2, point 8): paper-size BERT-Large and DenseNet-121 import in <= 5 s each.

    .venv/bin/python benchmarks/import_bench.py [--repeats 5] [--models a,b] [--refresh]

Writes benchmarks/results/import.json and benchmarks/results/import.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CACHE = os.path.join(HERE, ".cache")
RESULTS = os.path.join(HERE, "results")
TARGET_S = 5.0


def _export(name: str, refresh: bool) -> tuple[str, float | None]:
    from unity_pcg import zoo
    path = os.path.join(CACHE, f"{name}-paper.onnx")     # shared with dp_bench.py and fig14.py
    if os.path.exists(path) and not refresh:
        return path, None
    os.makedirs(CACHE, exist_ok=True)
    t = time.perf_counter()
    try:   # the graph with every weight's shape, weights in a sparse zero file (nothing allocated)
        zoo.export_structure(name, path, size="paper")
    except zoo.ZooError:   # models with width-dependent constants: the real export
        zoo.export(name, path, size="paper", exporter="legacy")
    return path, time.perf_counter() - t


def _measure(name: str, path: str, repeats: int) -> dict:
    import onnx

    from unity_pcg.onnx_import import load_onnx
    times = []
    g = None
    for _ in range(repeats):
        t = time.perf_counter()
        g = load_onnx(path)
        times.append(time.perf_counter() - t)
    s = g.summary()
    m = onnx.load(path, load_external_data=False)
    files = [path] + [os.path.join(os.path.dirname(path), f) for f in os.listdir(os.path.dirname(path))
                      if f.startswith(os.path.basename(path) + ".")]
    return {
        "model": name, "file": os.path.relpath(path, ROOT), "file_bytes": sum(os.path.getsize(f) for f in files
                                                                             if os.path.exists(f)),
        "onnx_nodes": len(m.graph.node), "opset": g.meta.get("opset"),
        "inputs": {n.a["name"]: list(n.a["shape"]) for n in g.sources("Input")},
        "import_seconds_median": statistics.median(times), "import_seconds_all": times,
        "ops": s["ops"], "op_types": s["op_types"], "weights": s["weights"], "params": s["params"],
        "flops": s["flops"],
    }


def rewrite_markdown() -> None:
    """Regenerate import.md from import.json (no measurement)."""
    with open(os.path.join(RESULTS, "import.json")) as f:
        d = json.load(f)
    with open(os.path.join(RESULTS, "import.md"), "w") as f:
        f.write(_markdown(d["meta"], d["results"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default=None, help="comma-separated zoo models (default: all seven)")
    ap.add_argument("--refresh", action="store_true", help="re-export even when a cached export exists")
    args = ap.parse_args(argv)

    import onnx

    from unity_pcg import zoo
    names = args.models.split(",") if args.models else list(zoo.MODELS)
    rows = []
    for name in names:
        path, export_s = _export(name, args.refresh)
        r = _measure(name, path, args.repeats)
        r["size"], r["exporter"], r["export_seconds"] = "paper", "legacy", export_s
        rows.append(r)
        print(f"{name:14s} {r['onnx_nodes']:6d} ONNX nodes -> {r['ops']:5d} ops, {r['params']:>13,d} params, "
              f"import median {r['import_seconds_median']:.3f} s", flush=True)
    dn = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_densenet121.onnx")
    r = _measure("light_densenet121", dn, args.repeats)
    r["size"], r["exporter"], r["export_seconds"] = "onnx backend test data", None, None
    rows.append(r)
    print(f"{'densenet121':14s} {r['onnx_nodes']:6d} ONNX nodes -> {r['ops']:5d} ops, {r['params']:>13,d} params, "
          f"import median {r['import_seconds_median']:.3f} s", flush=True)

    meta = {"repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "onnx": onnx.__version__, "target_seconds": TARGET_S,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "import.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(RESULTS, "import.md"), "w") as f:
        f.write(_markdown(meta, rows))
    print(f"wrote {os.path.relpath(os.path.join(RESULTS, 'import.json'), ROOT)} and import.md")
    return 0


def _markdown(meta, rows) -> str:
    out = ["# ONNX import benchmark", "",
           f"`benchmarks/import_bench.py`: median of {meta['repeats']} imports with `load_onnx` "
           f"({meta['cpus']} CPUs, Python {meta['python']}, onnx {meta['onnx']}, {meta['date']}). "
           "Zoo models at paper size, exported once with the legacy exporter (weights stay on disk: "
           "they are read lazily; DLRM, XDL, CANDLE-Uno and MLP by `zoo.export_structure`: their weights "
           "are a sparse zero file). *ops* = compute operators of the PCG (Input/Weight nodes not counted).", "",
           "| model | batch | ONNX nodes | PCG ops | params | GFLOPs (fwd) | import (s, median) | top op types |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        batch = ",".join(str(v[0]) for v in r["inputs"].values() if v)
        top = ", ".join(f"{k} {v}" for k, v in sorted(r["op_types"].items(), key=lambda kv: -kv[1])[:5])
        out.append(f"| {r['model']} | {batch} | {r['onnx_nodes']} | {r['ops']} | {r['params']:,} | "
                   f"{r['flops'] / 1e9:.1f} | {r['import_seconds_median']:.3f} | {top} |")
    out += ["", f"Target: paper-size BERT-Large and DenseNet-121 import in <= {meta['target_seconds']:.0f} s."]
    for name in ("bert_large", "light_densenet121"):
        r = next((x for x in rows if x["model"] == name), None)
        if r:
            ok = "meets" if r["import_seconds_median"] <= meta["target_seconds"] else "MISSES"
            out.append(f"- {name}: {r['import_seconds_median']:.3f} s ({ok} the target)")
    inc = next((x for x in rows if x["model"] == "inception_v3"), None)
    if inc:
        bn = inc["op_types"].get("BatchNorm", 0)
        out.append(f"- Inception-v3: {inc['ops']} PCG operators (Unity's paper counts 323). The count depends on "
                   "what is fused: the importer maps one ONNX operator to one PCG operator here (Conv, "
                   f"{'BatchNorm, ' if bn else ''}Relu, pooling and Concat stay separate; fusion is left to the "
                   "substitution engine).")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
