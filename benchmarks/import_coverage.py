"""Import coverage: real architectures (random weights, no download) through ``unity-pcg import --check``.

The exports come from ``benchmarks/export_models.py`` (transformers with .venv's Python, torchvision with a
separate venv: see there), cached under ``benchmarks/.cache/coverage/``; the onnx wheel's own light models are
added as they ship.  Each file goes through the CLI as a user runs it, in its own process::

    unity-pcg import FILE --check --json

which imports it (ONNX nodes, PCG operators, import time), evaluates the PCG with numpy and the file with
onnxruntime on the same seeded random inputs and compares every output (tolerance scaled for the depth: see
``unity_pcg/onnx_import/check.py``).  A failing export, import or check is a row with its one-line reason.

    .venv/bin/python benchmarks/import_coverage.py [--export] [--models bert,resnet50] [--no-light]
                                                   [--tv-python /work/tv-venv/bin/python] [--batch-check N]

``--export`` first runs the exports that are not cached yet (transformers here, torchvision with
``--tv-python`` when it exists).  Writes benchmarks/results/import_coverage.json and .md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.join(HERE, ".cache", "coverage")
RESULTS = os.path.join(HERE, "results")
TARGET_IMPORT_S = 5.0
CASE_TIMEOUT_S = 900


def light_models() -> list[str]:
    import onnx
    d = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    return sorted(glob.glob(os.path.join(d, "*.onnx")))


def manifest() -> list[dict]:
    """Export records of both families (export_models.py's <family>.json), in a stable order."""
    from export_models import HF_MODELS, TV_MODELS  # noqa: E402  (beside this file)
    order = {n: k for k, n in enumerate(HF_MODELS + list(TV_MODELS))}
    recs = []
    for fam in ("transformers", "torchvision"):
        p = os.path.join(CACHE, f"{fam}.json")
        if os.path.exists(p):
            with open(p) as f:
                recs.extend(json.load(f).values())
    return sorted(recs, key=lambda r: (r["family"] != "transformers", order.get(r["model"], 99), r["model"],
                                       r["exporter"]))


def batch_check(path: str, batch: int, timeout: float = CASE_TIMEOUT_S) -> dict:
    """``import --check --batch N``: the batch override checked against onnxruntime running the file at N.
    ``refused``: the importer says which node holds the batch; ``no_reference``: onnxruntime cannot run the file
    at N either (its graph fixes the batch), so there is nothing to compare with."""
    r = check_file(path, timeout, ["--batch", str(batch)])
    st, why = r["status"], r.get("reason", "")
    if st == "import_error" and why.startswith("no reference at batch"):
        st = "no_reference"
    elif st == "import_error" and f"batch {batch}:" in why:
        st = "refused"
    return {"batch": batch, "status": st, "reason": why, "ratio": r.get("ratio"), "reference": r.get("reference")}


def check_file(path: str, timeout: float = CASE_TIMEOUT_S, extra: list | None = None) -> dict:
    """``unity-pcg import PATH --check --json`` in a fresh process -> the row's measured fields."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", path, "--check", "--json",
                            *(extra or [])], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"import --check took over {timeout:.0f} s"}
    wall = time.perf_counter() - t
    row: dict = {"wall_seconds": round(wall, 2)}
    if r.returncode == 2 or not r.stdout.strip():
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        row.update(status="import_error" if r.returncode == 2 else "crash",
                   reason=(lines[-1] if lines else f"exit {r.returncode}").replace("unity-pcg import: error: ", ""),
                   traceback="Traceback" in r.stderr)
        return row
    out = json.loads(r.stdout)
    c = out["check"]
    row.update(status="equal" if r.returncode == 0 and c["ok"] else "different", onnx_nodes=out["onnx_nodes"],
               opset=out["opset"], pcg_ops=out["ops"], op_types=out["op_types"], params=out["params"],
               import_seconds=out["import_seconds"], inputs={i["name"]: i["shape"] for i in out["inputs"]},
               max_abs=c["max_abs"], max_rel=c["max_rel"], ratio=max((o["ratio"] for o in c["outputs"]), default=0),
               depth=c["depth"], factor=c["factor"], int_bounds=c["int_bounds"],
               eval_seconds=round(c["eval_seconds"], 2), ort_seconds=round(c["ort_seconds"], 2),
               reference=c.get("reference"))
    if row["status"] != "equal":
        row["reason"] = "; ".join(f"{o['name']}: {o['why']}" for o in c["outputs"] if not o["ok"])
    return row


def _fmt(x, nd=3):
    return "" if x is None else f"{x:.{nd}g}"


def markdown(meta: dict, rows: list[dict]) -> str:
    n_eq = sum(r["status"] == "equal" for r in rows)
    slow = [r for r in rows if r.get("import_seconds", 0) > TARGET_IMPORT_S]
    L = ["# Import coverage: `unity-pcg import --check` over real architectures", "",
         f"Measured {meta['date']} on {meta['machine']} (shared, {meta['cpus']} CPUs); torch "
         f"{meta.get('torch_transformers', '?')} + transformers {meta.get('transformers', '?')} for the "
         f"transformers exports, torch {meta.get('torch_torchvision', '?')} + torchvision "
         f"{meta.get('torchvision', '?')} for the torchvision exports; onnxruntime {meta.get('onnxruntime', '?')}.",
         "Random weights, configs built locally, nothing downloaded (`benchmarks/export_models.py`). Transformers: "
         "2 layers, hidden 64, batch 2, sequence 16. torchvision: real size, batch 8, 224x224 (Inception-v3 299x299). "
         "onnx-light: the onnx wheel's own test models, as shipped: their weights are constant fills, so outputs "
         "hardly depend on the input and an error of 0 says little (tests/unity_pcg/test_onnx_import.py checks them "
         "with random weights). torchvision: BatchNorm statistics from two random batches, so the logits depend on "
         "the image.",
         "Check: numpy evaluation of the imported PCG vs onnxruntime (optimizations off) on the same seeded inputs; "
         "`err/tol` is the largest elementwise |pcg - ort| / (f (1e-5 max|ort| + 1e-4 |ort|)) with f = sqrt(depth), "
         "equal when <= 1. Import time: one `load_onnx` in the CLI process (target <= 5 s). \"export: autograd on\": "
         "the legacy exporter has no symbolic for the fused attention nn.MultiheadAttention runs under no_grad "
         "(aten::_native_multi_head_attention), so that model was exported with autograd on.", "",
         f"**{n_eq} of {len(rows)} exports import and check equal**"
         + (f"; {len(slow)} import over {TARGET_IMPORT_S:g} s" if slow else "") + ".", "",
         "| model | family | exporter | ONNX nodes | PCG ops | import s | max abs err | max rel err | err/tol | "
         "status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        st = r["status"]
        if st != "equal":
            st = f"**{st}**: {r.get('reason', '')}".replace("|", "\\|")
        if r.get("export_note"):
            st += " (export: autograd on)"
        L.append(f"| {r['model']} | {r['family']} | {r['exporter']} | {r.get('onnx_nodes', '')} | "
                 f"{r.get('pcg_ops', '')} | {_fmt(r.get('import_seconds'))} | {_fmt(r.get('max_abs'))} | "
                 f"{_fmt(r.get('max_rel'))} | {_fmt(r.get('ratio'))} | {st} |")
    bc = [r for r in rows if r.get("batch_check")]
    if bc:
        b = bc[0]["batch_check"]["batch"]
        counts: dict = {}
        for r in bc:
            counts[r["batch_check"]["status"]] = counts.get(r["batch_check"]["status"], 0) + 1
        L += ["", f"## `--check --batch {b}` (the batch override against onnxruntime running the file at batch {b})",
              "", "equal: imported at the new batch and equal to onnxruntime running the file with its inputs at "
              "the new batch or, where the file's graph fixes its batch, the file at its own batch on the samples in "
              "chunks (`(chunks)`); refused: the importer names the node that holds the exported batch (one line, "
              "exit 2); no_reference: neither reference can be run.", "",
              "; ".join(f"{k}: {v}" for k, v in sorted(counts.items())), "",
              "| model | exporter | status | err/tol or reason |", "|---|---|---|---|"]
        for r in bc:
            c = r["batch_check"]
            detail = _fmt(c.get("ratio")) + (" (chunks)" if "chunks" in (c.get("reference") or "") else "") \
                if c["status"] == "equal" else c.get("reason", "")
            L.append(f"| {r['model']} | {r['exporter']} | {c['status']} | {detail[:240]} |".replace("\n", " "))
    fails = [r for r in rows if r["status"] != "equal"]
    if fails:
        L += ["", "## What stops the others", ""]
        for r in fails:
            L.append(f"- {r['model']} ({r['exporter']}): {r['status']}: {r.get('reason', '')}")
    return "\n".join(L) + "\n"


def rewrite_markdown() -> None:
    """Regenerate import_coverage.md from import_coverage.json (no measurement)."""
    with open(os.path.join(RESULTS, "import_coverage.json")) as f:
        d = json.load(f)
    with open(os.path.join(RESULTS, "import_coverage.md"), "w") as f:
        f.write(markdown(d["meta"], d["results"]))


def _versions(py: str, mods: list[str]) -> dict:
    if not os.path.exists(py):
        return {}
    code = "import json,importlib\nd={}\nfor m in %r:\n    try: d[m]=importlib.import_module(m).__version__\n" \
           "    except Exception: pass\nprint(json.dumps(d))" % (mods,)
    try:
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout)
    except Exception:
        return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="store_true", help="run the exports that are not cached first")
    ap.add_argument("--models", default="", help="comma-separated subset (model names; light models as light_*)")
    ap.add_argument("--no-light", action="store_true", help="leave out the onnx wheel's light models")
    ap.add_argument("--tv-python", default="/work/tv-venv/bin/python",
                    help="Python with torch + torchvision for the torchvision exports")
    ap.add_argument("--batch-check", type=int, default=0, metavar="N",
                    help="also run `import --check --batch N` on each export (the batch override)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of earlier runs for models not measured now")
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    sel = {m for m in a.models.split(",") if m}
    if a.export:
        script = os.path.join(HERE, "export_models.py")
        extra = ["--models", a.models] if a.models else []
        subprocess.run([sys.executable, script, "transformers", *extra], cwd=ROOT)
        if os.path.exists(a.tv_python):
            subprocess.run([a.tv_python, script, "torchvision", *extra], cwd=ROOT)
    rows = []
    for rec in manifest():
        if sel and rec["model"] not in sel:
            continue
        row = {"model": rec["model"], "family": rec["family"], "exporter": rec["exporter"], "file": rec["file"]}
        if rec.get("note"):
            row["export_note"] = rec["note"]
        if rec["status"] != "ok":
            row.update(status="export_failed", reason=rec.get("error", ""))
        else:
            row.update(check_file(os.path.join(HERE, rec["file"])))
            if a.batch_check and row["status"] == "equal":
                row["batch_check"] = batch_check(os.path.join(HERE, rec["file"]), a.batch_check)
        rows.append(row)
        print(f"{row['model']:20s} {row['exporter']:7s} {row['status']:13s} {_fmt(row.get('import_seconds'))} "
              f"{_fmt(row.get('ratio'))} {row.get('reason', '')}"
              + (f" | batch {row['batch_check']['status']}" if row.get("batch_check") else ""), flush=True)
    if not a.no_light:
        for p in light_models():
            name = os.path.basename(p)[:-5]
            if sel and name not in sel:
                continue
            row = {"model": name, "family": "onnx-light", "exporter": "shipped",
                   "file": os.path.relpath(p, ROOT)}
            row.update(check_file(p))
            rows.append(row)
            print(f"{name:20s} shipped {row['status']:13s} {_fmt(row.get('import_seconds'))} "
                  f"{_fmt(row.get('ratio'))} {row.get('reason', '')}", flush=True)
    out_json = os.path.join(RESULTS, "import_coverage.json")
    if a.merge and os.path.exists(out_json):
        with open(out_json) as f:
            old = json.load(f)["results"]
        have = {(r["model"], r["exporter"]) for r in rows}
        rows = [r for r in old if (r["model"], r["exporter"]) not in have] + rows
        fam = {"transformers": 0, "torchvision": 1, "onnx-light": 2}
        order = {n: k for k, n in enumerate(_model_order())}
        rows.sort(key=lambda r: (fam.get(r["family"], 3), order.get(r["model"], 99), r["model"], r["exporter"]))
    import numpy
    import onnxruntime
    vt = _versions(sys.executable, ["torch", "transformers"])
    vv = _versions(a.tv_python, ["torch", "torchvision"])
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": numpy.__version__,
            "onnxruntime": onnxruntime.__version__, "torch_transformers": vt.get("torch"),
            "transformers": vt.get("transformers"), "torch_torchvision": vv.get("torch"),
            "torchvision": vv.get("torchvision"),
            "equal": sum(r["status"] == "equal" for r in rows), "total": len(rows)}
    os.makedirs(RESULTS, exist_ok=True)
    with open(out_json, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(RESULTS, "import_coverage.md"), "w") as f:
        f.write(markdown(meta, rows))
    print(f"{meta['equal']} of {meta['total']} equal; wrote {os.path.relpath(out_json, ROOT)} and .md")
    return 0


def _model_order() -> list[str]:
    from export_models import HF_MODELS, TV_MODELS
    return HF_MODELS + list(TV_MODELS)


if __name__ == "__main__":
    sys.exit(main())
