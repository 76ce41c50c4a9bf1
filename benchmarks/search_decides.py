"""Does the general search decide on the import-coverage corpus at realistic sizes (issue 18 point 2)?

The corpus of ``benchmarks/import_coverage.py`` (the transformers and torchvision architectures of
``export_models.py`` and the onnx wheel's light CNNs) at realistic sizes: the
transformers models at their base configurations (BERT-base, GPT-2 small, RoBERTa-base, T5-base encoder,
ViT-B/16, DistilBERT, a Llama-style 1B decoder, Whisper-base encoder, wav2vec2-base, ALBERT-base,
ELECTRA-base), exported weight-free (``zoo.structure.export_structure``: real shapes, no weight bytes) once at
batch 8 and re-batched by ``optimize --batch``; the light CNNs as they ship (real ImageNet widths), re-batched
the same way; the torchvision models from ``export_models.py torchvision``'s exports (real size, batch 8, in
``benchmarks/.cache/coverage/``; torchvision runs in its own venv, so this script only reads them: a family
whose exports are absent is left out with a one-line note), re-batched the same way (``--tv-exporter``: which
exporter's file; a refused batch override exports at the row's batch with ``--tv-python`` when it exists).  Each (model, machine) is one ``unity-pcg optimize`` process (weak scaling: per-GPU batch x
devices) on ``h100:1x8``, ``h100:2x8``, ``h100:8x8`` with a short budget, recording ``info.search.chosen``,
the predicted iteration time, each floor's price (``info.search.baselines_s``: dp, ZeRO-3, tuned
Megatron-LM, expert) and

* ``pipeline``: a pipeline plan of two or more stages won (point 2 exempts those rows; one of one stage is
  judged as the floor it equals);
* ``own``: the plan is the general search's (a layout proposal, the segment search, accumulation), not a
  floor (the words of ``fig14_compare.own``);
* ``near_floor``: a floor was chosen, but the general search's best own candidate was within 1% of it
  (``info.search.best_own_s``, when the optimizer records it; else unknown);
* ``ok``: point 2 holds for the row (pipeline, own, or within 1% of a floor);
* ``slower_than_floor``: the plan is predicted slower than a floor it priced (point 3's promise broken).

``--strategy megatron`` (``simulate``) runs beside each row: its predicted time, or its one-line reason
(``status`` ``n/a``); a traceback or a multi-line message is a failure of point 3.

    nice .venv/bin/python benchmarks/search_decides.py [--models bert,gpt2] [--machines h100:1x8]
         [--budget 20] [--no-light] [--no-hf] [--no-tv] [--tv-exporter dynamo] [--report]

Writes ``benchmarks/results/search_decides.json`` and ``.md`` (``--out``) (rows appended as they finish, so a cut run
keeps what it measured; a rerun skips the rows already there unless ``--fresh``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
CACHE = os.path.join(HERE, ".cache", "search_decides")
RESULTS = os.path.join(HERE, "results")
JSON_OUT = os.path.join(RESULTS, "search_decides.json")
MD_OUT = os.path.join(RESULTS, "search_decides.md")
MACHINES = ("h100:1x8", "h100:2x8", "h100:8x8")
EXPORT_BATCH = 8
FLOOR_WORDS = ("baseline", "data parallel by rules", "fallback", "imported graph")

#: name -> (transformers class, config class, config kwargs, input kind, input size, per-GPU batch)
#: base-size configurations of the import-coverage architectures (export_models.HF_MODELS)
HF = {
    "bert": ("BertModel", "BertConfig", {}, "tokens", 512, 8),
    "gpt2": ("GPT2Model", "GPT2Config", {}, "tokens", 1024, 8),
    "roberta": ("RobertaModel", "RobertaConfig", {"max_position_embeddings": 514}, "tokens", 512, 8),
    "t5_encoder": ("T5EncoderModel", "T5Config", {"d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12,
                                                  "num_heads": 12}, "tokens", 512, 8),
    "vit": ("ViTModel", "ViTConfig", {}, "pixels", 224, 32),
    "distilbert": ("DistilBertModel", "DistilBertConfig", {}, "tokens", 512, 8),
    "llama": ("LlamaModel", "LlamaConfig", {"hidden_size": 2048, "intermediate_size": 5632,
                                            "num_hidden_layers": 16, "num_attention_heads": 32,
                                            "num_key_value_heads": 8, "max_position_embeddings": 2048},
              "tokens", 2048, 4),
    "whisper_encoder": ("WhisperModel", "WhisperConfig", {"d_model": 512, "encoder_layers": 6,
                                                           "encoder_attention_heads": 8, "decoder_layers": 1, "decoder_attention_heads": 8,
                                                           "encoder_ffn_dim": 2048, "num_mel_bins": 80},
                        "mel", 3000, 16),
    "wav2vec2": ("Wav2Vec2Model", "Wav2Vec2Config", {}, "audio", 16000 * 4, 8),
    "albert": ("AlbertModel", "AlbertConfig", {"hidden_size": 768, "num_attention_heads": 12,
                                               "intermediate_size": 3072}, "tokens", 512, 8),
    "electra": ("ElectraModel", "ElectraConfig", {"hidden_size": 768, "num_attention_heads": 12,
                                                  "intermediate_size": 3072, "embedding_size": 768},
                "tokens", 512, 8),
}
#: per-GPU batch of the onnx wheel's light CNNs and of the torchvision models (ImageNet training as usual)
LIGHT_BATCH = 32
TV_BATCH = 32
COVERAGE = os.path.join(HERE, ".cache", "coverage")
TV_PYTHON = "/work/tv-venv/bin/python"


def _factory(name: str):
    """A callable building the transformers model ``name`` (eager attention, no cache) wrapped so that it takes
    its one input positionally and returns its first output tensor."""
    def build():
        import torch
        import transformers as T
        cls_name, cfg_name, kw, kind, _, _ = HF[name]
        cfg = getattr(T, cfg_name)(**kw, attn_implementation="eager")
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        m = getattr(T, cls_name)(cfg)
        if name == "whisper_encoder":
            m = m.get_encoder()

        class Wrap(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = m

            def forward(self, x):
                out = self.m(x, return_dict=True)
                return out[0]
        return Wrap()
    return build


def _inputs(name: str, batch: int) -> list:
    _, _, _, kind, size, _ = HF[name]
    if kind == "tokens":
        return [("input_ids", (batch, size), "int64")]
    if kind == "pixels":
        return [("pixel_values", (batch, 3, size, size), "float32")]
    if kind == "mel":
        return [("input_features", (batch, HF[name][2]["num_mel_bins"], size), "float32")]
    return [("input_values", (batch, size), "float32")]


def export(name: str, batch: int = EXPORT_BATCH) -> tuple[str | None, str]:
    """The weight-free export of ``name`` at ``batch`` (cached): (path or None, note)."""
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{name}.onnx" if batch == EXPORT_BATCH else f"{name}-b{batch}.onnx")
    if os.path.exists(path):
        return path, "cached"
    from unity_pcg.zoo.structure import export_structure
    t = time.perf_counter()
    try:
        r = export_structure(_factory(name), path, inputs=_inputs(name, batch))
    except Exception as e:   # the exporter's reason: a row saying so
        return None, f"export failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return path, f"exported in {time.perf_counter() - t:.1f} s ({r.parameters} parameters)"


def light_models() -> list[str]:
    import onnx
    d = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    return sorted(glob.glob(os.path.join(d, "*.onnx")))


def tv_models(exporter: str) -> tuple[list[tuple[str, str]], str]:
    """The torchvision exports of ``export_models.py`` with ``exporter`` found in the coverage cache:
    ([(model, path)] in export_models' order, a one-line note saying which are absent)."""
    sys.path.insert(0, HERE)
    from export_models import TV_MODELS
    found = [(n, os.path.join(COVERAGE, f"{n}-{exporter}.onnx")) for n in TV_MODELS]
    have = [(n, p) for n, p in found if os.path.exists(p)]
    missing = [n for n, p in found if not os.path.exists(p)]
    if not have:
        return [], (f"torchvision left out: no {exporter} export in {os.path.relpath(COVERAGE, ROOT)} (run "
                    f"export_models.py torchvision with a Python that has torchvision)")
    return have, (f"torchvision: {len(have)} {exporter} exports" +
                  (f"; absent: {', '.join(missing)}" if missing else ""))


def tv_export(name: str, exporter: str, batch: int, tv_python: str) -> tuple[str | None, str]:
    """The torchvision export of ``name`` at ``batch`` (``export_models.py torchvision --batch``, run by
    ``tv_python``; cached): (path or None, note)."""
    path = os.path.join(COVERAGE, f"{name}-{exporter}-b{batch}.onnx")
    if os.path.exists(path):
        return path, "cached"
    if not os.path.exists(tv_python):
        return None, f"no export at batch {batch}: {tv_python} (a Python with torchvision) does not exist"
    t = time.monotonic()
    p = subprocess.run([tv_python, os.path.join(HERE, "export_models.py"), "torchvision", "--models", name,
                        "--exporters", exporter, "--batch", str(batch)], cwd=ROOT, capture_output=True, text=True)
    if not os.path.exists(path):
        lines = [ln for ln in (p.stdout + p.stderr).strip().splitlines() if ln.strip()]
        return None, f"export at batch {batch} failed: {(lines[-1] if lines else f'exit {p.returncode}')[:300]}"
    return path, f"exported at batch {batch} in {time.monotonic() - t:.1f} s"


def own(chosen: str | None) -> bool:
    """The plan came from the general search (not a floor: dp, a fixed strategy, a fallback; not a pipeline)."""
    head = (chosen or "").split(" (the executor refuses ")[0]     # the mechanism of the plan returned
    return bool(head) and head != "pipeline" and not any(w in head for w in FLOOR_WORDS)


def _cli(args: list[str], timeout: float) -> tuple[int, str, str, float]:
    exe = os.path.join(os.path.dirname(sys.executable), "unity-pcg")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t = time.monotonic()
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer in {timeout:.0f} s", time.monotonic() - t
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t


def classify(row: dict) -> dict:
    """The verdicts of one optimize row (see the module doc) from its recorded fields."""
    chosen, t = row.get("chosen"), row.get("predicted_s")
    floors = {k: v for k, v in (row.get("floors_s") or {}).items() if isinstance(v, (int, float))}
    best_floor = min(floors.values(), default=None)
    # a pipeline of one stage (the stage search's plan with every device in one stage: data parallelism
    # priced again) is no pipeline win: it is judged as the floor it equals
    v = {"pipeline": (chosen or "").split(" (the executor refuses ")[0] == "pipeline"
         and row.get("pipeline_stages") != 1, "own": own(chosen)}
    bo = row.get("best_own_s")
    v["near_floor"] = (None if bo is None or best_floor is None else bo <= best_floor * 1.01) \
        if not v["own"] and not v["pipeline"] else None
    v["ok"] = bool(v["pipeline"] or v["own"] or v["near_floor"])
    v["slower_than_floor"] = (t is not None and best_floor is not None and t > best_floor * (1 + 1e-9))
    return v


def run_row(model: str, path: str, machine: str, batch: int, budget: float) -> dict:
    from unity_pcg.machine import parse_machine
    row = {"model": model, "machine": machine, "devices": parse_machine(machine).num_devices, "batch": batch,
           "budget_s": budget}
    with tempfile.TemporaryDirectory() as tmp:
        rc, out, err, wall = _cli(["optimize", path, "--machine", machine, "--budget", f"{budget:g}", "--batch",
                                   str(batch), "--json", "-o", os.path.join(tmp, "plan.json")], budget * 4 + 120)
    row.update(wall_s=round(wall, 1), load_1min=round(os.getloadavg()[0], 2))
    if rc == 0:
        j = json.loads(out)
        s = j.get("search", {})
        row.update(status="ok", chosen=s.get("chosen"), predicted_s=j["predicted_iteration_s"],
                   search_s=round(j["search_s"], 1), floors_s=s.get("baselines_s"), best_own_s=s.get("best_own_s"),
                   pipeline_iteration_s=s.get("pipeline_iteration_s"), feasible=j["feasible"],
                   interrupted=j["interrupted"], rule_steps=j["rule_steps"], best_own=s.get("best_own"),
                   executor_check=s.get("executor_check"), pipeline_stages=s.get("pipeline_stages"),
                   micro_batches=s.get("micro_batches"))
        row.update(classify(row))
    else:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        row.update(status="error", reason=(lines[-1] if lines else f"exit {rc}")[:400], traceback="Traceback" in err)
    rc, out, err, wall = _cli(["simulate", path, "--machine", machine, "--strategy", "megatron", "--batch",
                               str(batch), "--json"], 600)
    if rc == 0:
        j = json.loads(out)
        row["megatron"] = {"status": "ok" if j.get("feasible") else "infeasible",
                           "time_s": j.get("predicted_iteration_s"), "wall_s": round(wall, 1)}
    else:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        row["megatron"] = {"status": "n/a" if rc == 2 and len(lines) == 1 else "error",
                           "reason": (lines[-1] if lines else f"exit {rc}")[:400], "lines": len(lines)}
    return row


def _f(x, d=4):
    return "-" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))


def report(rows: list[dict], meta: dict) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    pipe = [r for r in ok if r["pipeline"]]
    rest = [r for r in ok if not r["pipeline"]]
    n_own = sum(r["own"] for r in rest)
    n_near = sum(bool(r.get("near_floor")) for r in rest)
    n_unknown = sum(r.get("near_floor") is None and not r["own"] for r in rest)
    n_fail = sum(not r["ok"] for r in rest)
    slower = [r for r in ok if r["slower_than_floor"]]
    meg = [r.get("megatron", {}) for r in rows]
    o = ["# The search decides: the import-coverage corpus at realistic sizes (issue 18 point 2)", "",
         f"{meta.get('when', '?')}, commit {meta.get('commit', '?')}, {meta.get('host', '?')}; budget "
         f"{meta.get('budget_s')} s per `optimize`, each a fresh process run with `nice` on the shared box. "
         "Weak scaling: global batch = per-GPU batch x devices. Predicted iteration times in seconds (our cost "
         "model; no device). *own*: `info.search.chosen` is the general search's (a layout proposal, the segment "
         "search, accumulation); *floor*: a floor was chosen (dp, tuned Megatron-LM, ZeRO-3, expert); *near*: "
         "the search's best own candidate within 1% of that floor; *slower*: predicted slower than a floor it "
         "priced.", "",
         f"Rows: {len(rows)} ({len(rows) - len(ok)} failed); pipeline wins: {len(pipe)}; of the {len(rest)} "
         f"others: own {n_own}, a floor within 1% of the search's own {n_near}, a floor with the search's own "
         f"unknown {n_unknown}; point 2 fails in {n_fail}. Slower than a priced floor: {len(slower)}. "
         f"`--strategy megatron`: priced {sum(m.get('status') in ('ok', 'infeasible') for m in meg)}, "
         f"one-line n/a {sum(m.get('status') == 'n/a' for m in meg)}, errors "
         f"{sum(m.get('status') == 'error' for m in meg)}.", "",
         "| model | machine | batch | chosen | predicted | dp | megatron (floor) | zero3 | expert | best own | "
         "point 2 | wall s | `--strategy megatron` |",
         "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if r.get("status") != "ok":
            o.append(f"| {r['model']} | {r['machine']} | {r['batch']} | error: {r.get('reason', '')[:120]} | "
                     f"| | | | | | fail | {r.get('wall_s')} | |")
            continue
        fl = r.get("floors_s") or {}

        def fv(k):
            v = fl.get(k)
            return _f(v) if isinstance(v, (int, float)) or v is None else "n/a"
        verdict = f"pipeline ({r.get('pipeline_stages') or '?'} stages)" if r["pipeline"] else "own" if r["own"] else \
            "near" if r.get("near_floor") else "floor (own ?)" if r.get("near_floor") is None else "FLOOR"
        if r["slower_than_floor"]:
            verdict += ", SLOWER"
        m = r.get("megatron", {})
        ms = _f(m.get("time_s")) if m.get("status") == "ok" else f"{m.get('status')}: {m.get('reason', '')[:90]}"
        o.append(f"| {r['model']} | {r['machine']} | {r['batch']} | {r['chosen']} | {_f(r['predicted_s'])} | "
                 f"{fv('dp')} | {fv('megatron')} | {fv('zero3')} | {fv('expert')} | {_f(r.get('best_own_s'))} | "
                 f"{verdict} | {r['wall_s']} | {ms} |")
    notes = sorted({f"{k}: {v}" for r in ok for k, v in (r.get("floors_s") or {}).items()
                    if isinstance(v, str)})
    if notes:
        o += ["", "Floors that did not apply (their notes):", ""] + [f"- {n}" for n in notes]
    if meta.get("tv_note"):
        o += ["", f"Torchvision models: {meta['tv_note']} (real size, exported at batch {EXPORT_BATCH}, per-GPU "
                  f"batch {TV_BATCH} by `optimize --batch`)."]
    if meta.get("note"):
        o += ["", meta["note"]]
    o += ["", f"Command: `{meta.get('command')}`"]
    return "\n".join(o) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="comma-separated subset (transformers names, light_* names)")
    ap.add_argument("--machines", default=",".join(MACHINES))
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--no-light", action="store_true", help="leave out the onnx wheel's light CNNs")
    ap.add_argument("--no-hf", action="store_true", help="leave out the transformers models")
    ap.add_argument("--no-tv", action="store_true", help="leave out the torchvision models")
    ap.add_argument("--tv-exporter", default="dynamo", choices=["dynamo", "legacy"],
                    help="which exporter's torchvision files (default dynamo)")
    ap.add_argument("--tv-python", default=TV_PYTHON,
                    help="Python with torchvision, for an export at a row's batch where the override is refused")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="measure again the rows already in the JSON")
    ap.add_argument("--report", action="store_true", help="write the markdown from the JSON only")
    ap.add_argument("--out", default=os.path.join(RESULTS, "search_decides"),
                    help="OUT.json and OUT.md (default benchmarks/results/search_decides)")
    a = ap.parse_args(argv)
    global JSON_OUT, MD_OUT
    JSON_OUT, MD_OUT = a.out + ".json", a.out + ".md"
    os.makedirs(RESULTS, exist_ok=True)
    if a.report:
        with open(JSON_OUT) as f:
            d = json.load(f)
        for r in d["rows"]:
            if r.get("status") == "ok":
                r.update(classify(r))
        with open(MD_OUT, "w") as f:
            f.write(report(d["rows"], d["meta"]))
        return 0
    want = set(a.models.split(",")) - {""}
    models: list[tuple[str, str | None, int, str]] = []
    tv_names: set[str] = set()
    tv_note = ""
    for n in HF:
        if a.no_hf or (want and n not in want):
            continue
        p, note = export(n)
        print(f"{n}: {note}", file=sys.stderr, flush=True)
        models.append((n, p, HF[n][5], note))
    if not a.no_light:
        for p in light_models():
            n = os.path.basename(p)[:-5]
            if not want or n in want:
                models.append((n, p, LIGHT_BATCH, "as shipped"))
    if not a.no_tv:
        tv, tv_note = tv_models(a.tv_exporter)
        print(tv_note, file=sys.stderr, flush=True)
        for n, p in tv:
            if not want or n in want:
                models.append((n, p, TV_BATCH, f"{a.tv_exporter} export, batch {EXPORT_BATCH}"))
                tv_names.add(n)
    if a.export_only:
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit, "budget_s": a.budget,
            "host": f"{platform.machine()}, {os.cpu_count()} cores",
            "command": "benchmarks/search_decides.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if tv_note:
        meta["tv_note"] = tv_note
    rows: list[dict] = []
    if os.path.exists(JSON_OUT) and not a.fresh:
        with open(JSON_OUT) as f:
            rows = json.load(f)["rows"]
    from unity_pcg.machine import parse_machine
    for machine in a.machines.split(","):
        D = parse_machine(machine).num_devices
        for n, p, per_gpu, note in models:
            key = (n, machine)
            if any((r["model"], r["machine"]) == key for r in rows):
                continue
            if p is None:
                r = {"model": n, "machine": machine, "devices": D, "batch": per_gpu * D, "status": "error",
                     "reason": note}
            else:
                print(f"{n} on {machine} ...", file=sys.stderr, flush=True)
                r = run_row(n, p, machine, per_gpu * D, a.budget)
                if r.get("status") == "error" and "the exported batch" in r.get("reason", "") \
                        and (n in HF or n in tv_names):   # the batch override refused (a constant holds it)
                    p2, note2 = export(n, per_gpu * D) if n in HF else \
                        tv_export(n, a.tv_exporter, per_gpu * D, a.tv_python)
                    print(f"  {note2}", file=sys.stderr, flush=True)
                    if p2 is not None:
                        r = dict(run_row(n, p2, machine, per_gpu * D, a.budget), exported_at_batch=True,
                                 override_refused=r["reason"])
                print(f"  {r.get('chosen') or r.get('reason')} ({r['wall_s']} s)", file=sys.stderr, flush=True)
            rows = [x for x in rows if (x["model"], x["machine"]) != key] + [r]
            with open(JSON_OUT, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(MD_OUT, "w") as f:
        f.write(report(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
