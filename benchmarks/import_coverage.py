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
    .venv/bin/python benchmarks/import_coverage.py --batch-hash 3 --tv-batch 2      # ~1 min cached, ~8 min not

``--batch-hash N`` (issue 10 point 7): each export is ALSO exported at batch N (``export_models.py --batch N``;
``--tv-batch M`` sets torchvision's, default N), then the default export imported with ``batch=N`` and the batch-N
export imported as is are compared by ``PCG.structural_hash``: equal; ``names``: equal once Weight names are left
out (the dynamo exporter numbers some folded constants ``val_K`` by a counter that the batch shifts); differs (the
first differing node on each side); refused (the importer's one line naming the node).  The onnx wheel's light
models ship at one batch: no rows there.

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


def _name_free_hash(g) -> str:
    """``structural_hash`` with Weight names left out (shapes, dtypes, attributes and wiring kept)."""
    import hashlib
    from unity_pcg.pcg import _canon
    hs: dict = {}
    for i in g.topo_order():
        n = g.node(i)
        attrs = [[k, _canon(v)] for k, v in n.attrs if not (n.op == "Weight" and k == "name")]
        hs[i] = hashlib.blake2b(json.dumps([n.op, attrs, [[hs[r[0]], r[1]] for r in n.inputs]]).encode(),
                                digest_size=16).hexdigest()
    outs = [[hs[r[0]], r[1]] for r in g.outputs]
    return hashlib.blake2b(json.dumps([sorted(hs.values()), outs]).encode(), digest_size=16).hexdigest()


def _first_difference(a, b) -> str:
    """The first node (topological order) of each PCG whose structural node hash the other lacks."""
    def first(g, other):
        have = {other.node_hash(i) for i in other.node_ids()}
        for i in g.topo_order():
            if g.node_hash(i) not in have:
                n = g.node(i)
                return f"{n.label()} {n.op} {[list(s.sizes) for s in g.shapes(i)]}"
        return "-"
    return f"override: {first(a, b)}; export: {first(b, a)}"


def hash_compare(src: str, ref: str, batch: int) -> dict:
    """``load_onnx(src, batch=batch)`` against ``load_onnx(ref)`` (the export at that batch) by structural hash."""
    from unity_pcg.errors import UnityError
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.onnx_import.importer import BatchOverride
    t = time.perf_counter()
    try:
        b = load_onnx(ref, load_weights=False)
    except UnityError as e:
        return {"status": "error", "reason": f"export at {batch}: {e}"}
    try:
        a = load_onnx(src, batch=batch, load_weights=False)
    except BatchOverride as e:
        return {"status": "refused", "reason": str(e)}
    except UnityError as e:
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    row = {"seconds": round(time.perf_counter() - t, 2), "nodes": len(a)}
    if a.structural_hash() == b.structural_hash():
        return {**row, "status": "equal"}
    if _name_free_hash(a) == _name_free_hash(b):
        wa = sorted(n.a["name"] for n in a.nodes() if n.op == "Weight")
        wb = sorted(n.a["name"] for n in b.nodes() if n.op == "Weight")
        da, db = sorted(set(wa) - set(wb)), sorted(set(wb) - set(wa))
        return {**row, "status": "names", "reason": f"Weight names only: {da[:3]} vs {db[:3]}"
                + (f" (+{len(da) - 3})" if len(da) > 3 else "")}
    return {**row, "status": "differs", "reason": _first_difference(a, b)}


def batch_hash_rows(batch_tf: int, batch_tv: int, sel: set, tv_python: str) -> list[dict]:
    """Export every coverage model at its new batch (cached) and compare by structural hash."""
    script = os.path.join(HERE, "export_models.py")
    extra = ["--models", ",".join(sorted(sel))] if sel else []
    subprocess.run([sys.executable, script, "transformers", "--batch", str(batch_tf), *extra], cwd=ROOT)
    if os.path.exists(tv_python):
        subprocess.run([tv_python, script, "torchvision", "--batch", str(batch_tv), *extra], cwd=ROOT)
    ref = {}
    for fam, n in (("transformers", batch_tf), ("torchvision", batch_tv)):
        p = os.path.join(CACHE, f"{fam}-b{n}.json")
        if os.path.exists(p):
            with open(p) as f:
                ref.update({(r["model"], r["exporter"]): r for r in json.load(f).values()})
    rows = []
    for rec in manifest():
        if sel and rec["model"] not in sel:
            continue
        n = batch_tf if rec["family"] == "transformers" else batch_tv
        row = {"model": rec["model"], "family": rec["family"], "exporter": rec["exporter"], "batch": n}
        r2 = ref.get((rec["model"], rec["exporter"]))
        if rec["status"] != "ok" or r2 is None or r2["status"] != "ok":
            row.update(status="no_export", reason=(r2 or {}).get("error") or rec.get("error") or "not exported")
        else:
            row.update(hash_compare(os.path.join(HERE, rec["file"]), os.path.join(HERE, r2["file"]), n))
        rows.append(row)
        print(f"{row['model']:20s} {row['exporter']:7s} -> {n}: {row['status']:8s} {row.get('reason', '')}",
              flush=True)
    return rows


def batch_hash_markdown(rows: list[dict], date: str = "") -> list[str]:
    counts: dict = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    bs = sorted({(r["family"], r["batch"]) for r in rows})
    L = ["", "## `--batch-hash`: the batch override against exporting at that batch (structural hash)", "",
         (f"Measured {date}. " if date else "") + "Each export imported with `batch=N` vs the same model exported at batch N ("
         + ", ".join(f"{f}: {n}" for f, n in bs) + "), both `load_onnx(..., load_weights=False)`, compared by "
         "`PCG.structural_hash`. equal: same hash; names: same once Weight names are left out (the dynamo "
         "exporter names its constants, some weights among them, `val_K` by a counter that another batch shifts; "
         "`structural_hash` keeps Weight names, which bind the weights); differs: the first node each side lacks; "
         "refused: the importer's one line naming the node that holds the batch. The onnx wheel's light models "
         "ship at one batch (no rows).", "", "; ".join(f"{k}: {v}" for k, v in sorted(counts.items())), "",
         "| model | exporter | N | status | detail |", "|---|---|---:|---|---|"]
    for r in rows:
        L.append(f"| {r['model']} | {r['exporter']} | {r['batch']} | {r['status']} | "
                 f"{r.get('reason', '')[:300]} |".replace("\n", " "))
    return L


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
    if meta.get("batch_hash"):
        L += batch_hash_markdown(meta["batch_hash"], meta.get("batch_hash_date", ""))
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
    ap.add_argument("--batch-hash", type=int, default=0, metavar="N",
                    help="only compare each export's batch override to N with an export at N (structural hash), "
                         "keeping the rest of the report")
    ap.add_argument("--tv-batch", type=int, default=0, metavar="M", help="torchvision's N for --batch-hash")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of earlier runs for models not measured now")
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    sel = {m for m in a.models.split(",") if m}
    if a.batch_hash:
        bh = batch_hash_rows(a.batch_hash, a.tv_batch or a.batch_hash, sel, a.tv_python)
        out_json = os.path.join(RESULTS, "import_coverage.json")
        with open(out_json) as f:
            d = json.load(f)
        d["meta"]["batch_hash"] = bh
        d["meta"]["batch_hash_date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(out_json, "w") as f:
            json.dump(d, f, indent=1)
        with open(os.path.join(RESULTS, "import_coverage.md"), "w") as f:
            f.write(markdown(d["meta"], d["results"]))
        print("; ".join(f"{k}: {sum(r['status'] == k for r in bh)}" for k in sorted({r["status"] for r in bh})))
        return 0
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
