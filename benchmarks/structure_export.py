"""Weight-free export of every zoo model at paper size: time and peak memory.

For each model, ``unity-pcg zoo export NAME --size paper --weights none`` runs in its own process under
``/usr/bin/time -v`` (wall time, maximum resident set size); then the file is imported
(``load_onnx(load_weights=False)``) and its sparse weights are counted against ``zoo.param_count``.  Also a
transformers config of Llama 2 70B through ``unity-pcg export-structure`` (when transformers is installed).

    nice .venv/bin/python benchmarks/structure_export.py [--models a,b] [--out benchmarks/results/structure_export]
    nice .venv/bin/python benchmarks/structure_export.py --twin-check 8

Writes ``OUT.json`` and ``OUT.md``.  ``--twin-check L``: Llama 2 70B's widths at L layers (transformers config and
the zoo's module) exported with the depth twin (2 layers traced, the rest copied) and with every layer traced;
their imported PCGs compared (structure up to weight names), times and the verdict into ``OUT_twin.json``.  Run it alone (it is one export at a time, each a few hundred MB).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
              "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def timed(cmd):
    """Run ``cmd`` under /usr/bin/time -v: (returncode, wall s, max RSS MiB, stderr tail)."""
    t = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    rss = int(m.group(1)) / 1024 if m else None
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("\t")
             and "torchvision" not in ln]
    return p.returncode, wall, rss, lines[-3:]


def weight_count(path):
    """Elements of the initializers stored in the sparse data file, the file's logical size and its blocks."""
    import onnx
    m = onnx.load(path, load_external_data=False)
    n = 0
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            k = 1
            for d in t.dims:
                k *= d
            n += k
    data = path + ".data"
    st = os.stat(data) if os.path.exists(data) else None
    props = {p.key: p.value for p in m.metadata_props}
    return n, (st.st_size if st else 0), (st.st_blocks * 512 if st else 0), os.path.getsize(path), props


def measure(label, cmd, path, want_params, exporter):
    from unity_pcg.onnx_import import load_onnx
    rc, wall, rss, tail = timed(cmd)
    row = {"model": label, "exporter": exporter, "rc": rc, "export_s": round(wall, 2),
           "max_rss_mib": round(rss, 1) if rss else None}
    if rc != 0:
        row["error"] = " | ".join(tail)
        return row
    n, logical, blocks, graph_bytes, props = weight_count(path)
    t = time.perf_counter()
    g = load_onnx(path, load_weights=False)
    row.update({"import_s": round(time.perf_counter() - t, 2), "pcg_nodes": len(g),
                "weight_elements": n, "module_parameters": want_params,
                "params_match": n == want_params if want_params is not None else None,
                "graph_mib": round(graph_bytes / 2**20, 2), "weights_gib_logical": round(logical / 2**30, 2),
                "data_disk_kib": blocks // 1024, "weight_free_mark": props.get("unity_pcg.weight_free"),
                "output": list(g.shape(g.outputs[0]).sizes)})
    return row


def twin_check(layers, out):
    import dataclasses
    sys.path.insert(0, os.path.join(ROOT, "tests", "zoo"))
    from test_structure import anon_hash

    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.zoo import configs, models
    from unity_pcg.zoo.structure import export_structure
    rows = []
    with tempfile.TemporaryDirectory(prefix="twin-check-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump({**LLAMA2_70B, "num_hidden_layers": layers}, f)
        zcfg = dataclasses.replace(configs.CONFIGS["llama_70b"]["paper"], layers=layers)
        cases = [("transformers LlamaForCausalLM", cfg_path, {"seq": 4096}),
                 ("zoo Llama", lambda: models.make_module("llama_70b", zcfg),
                  {"inputs": [("input_ids", (1, zcfg.seq), "int64")]})]
        for label, src, kw in cases:
            got = {}
            for twin in (True, False):
                t = time.perf_counter()
                res = export_structure(src, os.path.join(tmp, f"m{twin}.onnx"), depth_twin=twin, **kw)
                secs = time.perf_counter() - t
                g = load_onnx(res.path, load_weights=False)
                got[twin] = (anon_hash(g), round(secs, 1), res.weight_elements, len(g))
            rows.append({"model": f"{label}, Llama 2 70B widths, {layers} layers", "equal": got[True][0] == got[False][0],
                         "twin_s": got[True][1], "full_s": got[False][1], "weights_equal": got[True][2] == got[False][2],
                         "pcg_nodes": got[True][3]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
    return 0 if all(r["equal"] and r["weights_equal"] for r in rows) else 1


def main():
    import unity_pcg.zoo as zoo
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: all, plus Llama 2 70B "
                    "from a transformers config)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "structure_export"))
    ap.add_argument("--twin-check", type=int, default=None, metavar="L")
    args = ap.parse_args()
    if args.twin_check:
        return twin_check(args.twin_check, args.out + "_twin.json")
    names = args.models.split(",") if args.models else (list(zoo.MODELS) + list(zoo.ALPA_MODELS)
                                                        + list(zoo.LLAMA_MODELS) + ["hf:llama2-70b"])
    cli = [sys.executable, "-m", "unity_pcg.cli"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="structure-export-") as tmp:
        for name in names:
            path = os.path.join(tmp, f"{name.replace(':', '_')}.onnx")
            if name.startswith("hf:"):
                try:
                    import transformers  # noqa: F401
                except ImportError:
                    print(f"{name}: transformers is not installed, skipped", file=sys.stderr)
                    continue
                cfg = os.path.join(tmp, "config.json")
                with open(cfg, "w") as f:
                    json.dump(LLAMA2_70B, f)
                from unity_pcg.zoo.structure import build_module
                module = build_module(cfg, seq=8)[0]
                want = sum(p.numel() for p in module.parameters())
                del module
                row = measure("Llama 2 70B (transformers config.json)", cli + ["export-structure", cfg, "--seq", "4096",
                                                                               "-o", path], path, want, "dynamo")
            else:
                exporter = "legacy" if zoo.narrow_twin_ok(name, "paper") else "dynamo"
                row = measure(name, cli + ["zoo", "export", name, "--size", "paper", "--weights", "none", "-o", path],
                              path, zoo.param_count(name, "paper"), exporter)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            for f in (path, path + ".data"):
                if os.path.exists(f):
                    os.remove(f)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "python": platform.python_version(), "command": "nice .venv/bin/python benchmarks/structure_export.py",
            "note": "2-core machine shared by several users; each export in its own process under /usr/bin/time -v"}
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = ["# Weight-free export at paper size (`zoo export NAME --size paper --weights none`)", "",
             f"{meta['date']}, {meta['cpus']} CPUs (shared), torch {meta.get('torch', '?')}. Each export in its own "
             "process: wall time and maximum RSS from `/usr/bin/time -v`; `weights` is the logical size of the "
             "sparse data file (its disk use in the last column); `params` compares the file's weight elements "
             "with the torch module's `sum(p.numel())`.", "",
             "| model | exporter | export s | max RSS MiB | import s | parameters | params match | graph MiB | "
             "weights GiB (logical) | data on disk KiB |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r.get("rc"):
            lines.append(f"| {r['model']} | {r['exporter']} | {r['export_s']} | {r['max_rss_mib']} | failed: "
                         f"{r.get('error', '')} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['exporter']} | {r['export_s']} | {r['max_rss_mib']} | {r['import_s']} | "
                     f"{r['weight_elements']:,} | {'yes' if r['params_match'] else 'NO'} | {r['graph_mib']} | "
                     f"{r['weights_gib_logical']} | {r['data_disk_kib']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.json and {args.out}.md", file=sys.stderr)
    return 0 if all(r.get("rc") == 0 and r.get("params_match") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
