"""Unity's Figure 14 (and 15b) in simulation: the joint search against the baselines on Summit.

For every zoo model at paper size and every device count D of ``--devices`` (default 6, 12, 24, 48,
96, 192 GPUs = ``summit:(D/6)x6``), at the paper's global batch (its per-GPU batch x D, Unity §6.1) and
optimizer (Adam for BERT-Large, SGD otherwise), one task per row:

* the baselines that apply, each the real strategy in the same cost model: ``dp`` for every model,
  ``megatron`` for BERT-Large (tensor parallelism inside a node: ``devices_per_node`` of the machine),
  ``expert`` for DLRM, XDL and CANDLE-Uno -- built with :func:`search.baselines.build_strategy` and
  mapped by a fresh :class:`search.mapping.MachineMapper` (memory-aware: a plan that does not fit
  is reported infeasible with its reason);
* ``unity``: :func:`search.optimize.optimize` with strategy ``unity`` and ``--budget`` seconds;
* ``sequential`` (Figure 15b: TASO then FlexFlow): the same call with strategy ``sequential``, same
  budget, at ``--sequential-devices`` (default 96 GPUs, as the paper's Figure 15b).

Throughput = global batch / predicted iteration time; speedup = Unity's throughput over the best
feasible baseline's.  Extra rows: DenseNet-121 of the onnx wheel (backend/test/data/light, per-GPU
batch 64 as the CNNs) and 1,024 simulated GPUs (``h100:128x8``).

Each task runs in its own process (``--worker``) under a time limit (``--task-timeout``, then Ctrl-C, on
which the search returns its best plan so far: the row says ``interrupted``), and its row is appended to
benchmarks/results/fig14.json as soon as it is done, so a partial run keeps what it measured; a rerun
skips the rows already there (``--fresh`` starts over).  Paper-size models are written once to
benchmarks/.cache/ (``zoo.export_structure`` where the zoo supports it: no weights allocated).

    .venv/bin/python benchmarks/fig14.py                       # the whole matrix (hours on 2 busy cores)
    .venv/bin/python benchmarks/fig14.py --models mlp,dlrm --devices 6,192 --budget 30
    .venv/bin/python benchmarks/fig14.py --extras-only --budget-large 100   # DenseNet-121, 1,024 GPUs
    .venv/bin/python benchmarks/fig14.py --quick               # mlp and dlrm at 6 and 12 GPUs, 10 s budget
    .venv/bin/python benchmarks/fig14.py --report              # fig14.md from fig14.json (no measurement)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
CACHE = os.path.join(HERE, ".cache")
RESULTS = os.path.join(HERE, "results")
JSON_OUT = os.path.join(RESULTS, "fig14.json")
MD_OUT = os.path.join(RESULTS, "fig14.md")

PAPER_MODELS = ("resnext50", "inception_v3", "bert_large", "dlrm", "xdl", "candle_uno", "mlp")
DEVICES = (6, 12, 24, 48, 96, 192)
BIG_MACHINE = "h100:128x8"                  # 1,024 simulated GPUs
BIG_MODELS = ("mlp", "dlrm", "bert_large", "candle_uno", "xdl", "inception_v3", "resnext50")
DENSENET = "densenet121"
DENSENET_BATCH = 64                          # per GPU, as the paper's CNNs
#: Unity's speedup over the best baseline (Figure 14, at the largest scale) and the baseline named
PAPER_SPEEDUP = {"dlrm": 3.6, "candle_uno": 1.6, "mlp": 2.0, "xdl": 1.9, "inception_v3": 1.3,
                 "resnext50": 1.0, "bert_large": 1.0}
#: the searches: the joint search with its 1F1B pipeline stage (the product's default), the joint search
#: without pipelines (the paper's Figure 14 disables pipelines against baselines that have none, and
#: Figure 15b isolates joint vs sequential, which has none), and TASO then FlexFlow
NOPIPE = "unity-nopipe"
SEARCHES = ("unity", NOPIPE, "sequential")
GRACE_S = 120.0                              # after the SIGINT of a task past its limit


def baselines_for(model: str) -> list[str]:
    """The baselines of Figure 14 that apply to ``model``: data parallelism for all, Megatron for
    BERT, the expert strategy for the recommendation models and CANDLE-Uno."""
    out = ["dp"]
    if model == "bert_large":
        out.append("megatron")
    if model in ("dlrm", "xdl", "candle_uno"):
        out.append("expert")
    return out


def model_path(name: str) -> str:
    """The ONNX file of ``name`` at paper size (cached in benchmarks/.cache/); DenseNet-121 from the
    onnx wheel."""
    if name == DENSENET:
        import onnx
        return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                            "light_densenet121.onnx")
    from unity_pcg import zoo
    os.makedirs(CACHE, exist_ok=True)
    p = os.path.join(CACHE, f"{name}-paper.onnx")
    if not os.path.exists(p):
        print(f"exporting {name} (paper size) ...", file=sys.stderr, flush=True)
        try:
            zoo.export_structure(name, p, size="paper")      # graph and shapes only, no weights
        except zoo.ZooError:
            zoo.export(name, p, size="paper")                # models with width-dependent constants
    return p


def per_gpu_batch(name: str) -> int:
    if name == DENSENET:
        return DENSENET_BATCH
    from unity_pcg import zoo
    return zoo.MODELS[name].paper_batch


def optimizer_of(name: str) -> str:
    if name == DENSENET:
        return "sgd"
    from unity_pcg import zoo
    return zoo.MODELS[name].paper_optimizer


def machine_for(devices: int) -> str:
    if devices == 1024:
        return BIG_MACHINE
    if devices % 6:
        raise SystemExit(f"--devices: {devices} is not a multiple of Summit's 6 GPUs per node (or 1024)")
    return f"summit:{devices // 6}x6"


# --- one task (runs in a worker process) ------------------------------------------------------------------

def run_task(task: dict) -> dict:
    """Price one (model, devices, strategy) task; returns its row."""
    from unity_pcg.machine import parse_machine
    name, D, strategy = task["model"], task["devices"], task["strategy"]
    m = parse_machine(task["machine"])
    batch = per_gpu_batch(name) * D
    opt = optimizer_of(name)
    path = model_path(name)
    row = {"model": name, "devices": D, "machine": task["machine"], "strategy": strategy, "batch": batch,
           "optimizer": opt, "memory_techniques": task.get("techniques", True)}
    t0 = time.perf_counter()
    if strategy in SEARCHES:
        from unity_pcg.search.optimize import optimize
        r = optimize(path, m, budget_s=task["budget"], strategy=strategy.split("-")[0], optimizer=opt, batch=batch,
                     max_candidates=task["max_candidates"], pipeline=strategy != NOPIPE,
                     memory_techniques=task.get("techniques", True))
        j = r.json()
        j.pop("memory_per_device", None)
        row.update({"feasible": j["feasible"], "reason": j["reason"], "predicted_iteration_s": j["predicted_iteration_s"],
                    "search_s": j["search_s"], "budget_s": task["budget"], "max_candidates": task["max_candidates"],
                    "comm_elements": j["comm_elements"], "max_memory_bytes": j["max_memory_bytes"],
                    "data_parallel_iteration_s": j["data_parallel_iteration_s"], "rule_steps": j["rule_steps"],
                    "devices_used": j["devices_used"], "search": j["search"], "interrupted": j["interrupted"],
                    "breakdown": r.mapping.to_json().get("breakdown")})
    else:
        from unity_pcg.search.baselines import build_strategy
        from unity_pcg.search.cost import CostModel
        from unity_pcg.search.mapping import MachineMapper
        from unity_pcg.onnx_import import load_onnx
        g = load_onnx(path, batch=batch, load_weights=False)
        t1 = time.perf_counter()
        pg = build_strategy(g, strategy, D, devices_per_node=m.devices_per_node)
        r = MachineMapper(CostModel(m, optimizer=opt), techniques=task.get("techniques", True)).optimize(pg)
        row.update({"feasible": bool(r.feasible), "reason": r.reason,
                    "predicted_iteration_s": r.cost if r.feasible else None,
                    "build_and_map_s": time.perf_counter() - t1, "comm_elements": r.breakdown.comm_elements,
                    "max_memory_bytes": r.memory.max_bytes if r.memory else None,
                    "devices_used": r.stats.get("devices_used", 0), "fallbacks": len(pg.meta.get("fallbacks", [])),
                    "breakdown": r.to_json().get("breakdown")})
        for k in ("tp", "dp"):
            if k in pg.meta:
                row[k] = pg.meta[k]
    row["wall_s"] = time.perf_counter() - t0
    row["code"] = code_version()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    row["cpu_s"] = ru.ru_utime + ru.ru_stime      # the whole worker, import and export check included
    t = row.get("predicted_iteration_s")
    row["throughput_samples_s"] = batch / t if t else None
    return row


def code_version() -> str:
    """Short digest of the search code this row ran with (the search is being changed while the matrix
    runs): search/*.py and substitutions/*.py, and the git commit."""
    import hashlib
    h = hashlib.sha256()
    for d in ("search", "substitutions"):
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith(".py"):
                with open(os.path.join(ROOT, d, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=ROOT).stdout.strip()
    except OSError:
        git = "?"
    return f"{git}+{h.hexdigest()[:8]}"


def worker(arg: str) -> int:
    task = json.loads(arg)
    try:
        row = run_task(task)
    except Exception as e:                 # recorded, the run goes on
        row = dict(task, feasible=False, error=f"{type(e).__name__}: {e}"[:400], predicted_iteration_s=None)
    except KeyboardInterrupt:              # the limit's SIGINT came before the search had a plan
        row = dict(task, feasible=False, error="interrupted before a plan was found", predicted_iteration_s=None)
    sys.stdout.write("ROW " + json.dumps(row, default=str) + "\n")
    return 0


# --- the run ------------------------------------------------------------------------------------------------

def tasks_for(models, devices, budget, max_candidates, extras: bool, seq_devices,
              searches=("unity", NOPIPE), extras_only: bool = False, budget_large: float | None = None) -> list[dict]:
    """Tasks in the order they run, so that a run cut short still has the headline numbers: Unity and
    the baselines at the largest scale (the paper's anchors); at each GPU count of ``seq_devices``
    (Figure 15b: 96 GPUs in the paper) the same, then the sequential search; DenseNet-121 and 1,024
    GPUs for the four models of the paper's anchors with the largest speedups; then the other GPU
    counts (spread: smallest, middle, ...) and the other models at 1,024 GPUs."""
    def t(model, D, strategy, machine=None):
        # DenseNet-121 and 1,024 GPUs have a 120 s target (60 s for the paper models): their own budget
        big_row = model == DENSENET or D == 1024
        return {"model": model, "devices": D, "machine": machine or machine_for(D), "strategy": strategy,
                "budget": budget_large if big_row and budget_large else budget, "max_candidates": max_candidates}

    def block(name, D, machine=None):
        return [t(name, D, s, machine) for s in baselines_for(name)] + [t(name, D, s, machine) for s in searches]
    big = [x for x in BIG_MODELS if x in models]
    if extras_only:                              # DenseNet-121 and 1,024 GPUs only
        return ([t(DENSENET, 192, s) for s in ("dp",) + tuple(searches)]
                + [x for name in big for x in block(name, 1024, BIG_MACHINE)])
    top = max(devices)
    first = [top] + sorted((d for d in seq_devices if d in devices and d != top), reverse=True)
    rest = sorted(d for d in devices if d not in first)
    spread = []
    while rest:                                  # 6, 48, 12, ...: coverage early
        spread.append(rest.pop(0))
        if rest:
            spread.append(rest.pop(len(rest) // 2))
    out = []
    for D in first:
        out += [x for name in models for x in block(name, D)]
        if D in seq_devices:
            out += [t(name, D, "sequential") for name in models]
    big = [x for x in BIG_MODELS if x in models]
    if extras:
        out += [t(DENSENET, 192, s) for s in ("dp",) + tuple(searches)]
        out += [x for name in big[:4] for x in block(name, 1024, BIG_MACHINE)]
    for D in spread:
        out += [x for name in models for x in block(name, D)]
    if extras:
        out += [x for name in big[4:] for x in block(name, 1024, BIG_MACHINE)]
        if 192 in seq_devices:
            out.append(t(DENSENET, 192, "sequential"))
    return out


def _key(row) -> tuple:
    return (row["model"], row["machine"], row["strategy"])


def load_rows(path: str) -> dict:
    if not os.path.exists(path):
        return {"meta": {}, "rows": []}
    with open(path) as f:
        return json.load(f)


def save(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def run(tasks: list[dict], out: str, fresh: bool, task_timeout: float | None, meta: dict) -> None:
    data = {"meta": {}, "rows": []} if fresh else load_rows(out)
    data["meta"] = dict(data.get("meta") or {}, **meta)
    done = {_key(r) for r in data["rows"]}
    for i, task in enumerate(tasks):
        if _key(task) in done:
            continue
        model_path(task["model"])          # export outside the timed worker
        limit = task_timeout or max(3 * task["budget"], task["budget"] + 120)
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(task)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        note = None
        try:
            stdout, stderr = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            # past the limit: Ctrl-C, on which optimize() returns the best plan so far; killed if it does not
            p.send_signal(signal.SIGINT)
            note = f"interrupted (SIGINT) after {limit:.0f} s"
            try:
                stdout, stderr = p.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                note = f"killed: no answer {GRACE_S:.0f} s after SIGINT at {limit:.0f} s"
        line = next((x for x in stdout.splitlines() if x.startswith("ROW ")), None)
        row = json.loads(line[4:]) if line else dict(task, feasible=False, predicted_iteration_s=None,
                                                     error=note or f"worker exit {p.returncode}: {stderr[-400:]}")
        if note:
            row["limit_note"] = note
        row["task_wall_s"] = time.perf_counter() - t0
        row["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data["rows"].append(row)
        save(out, data)
        t = row.get("predicted_iteration_s")
        extra = f" search {row['search_s']:.1f} s" if row.get("search_s") is not None else ""
        print(f"[{i + 1}/{len(tasks)}] {row['model']:13s} {row['machine']:12s} {row['strategy']:10s} "
              f"{(f'{t * 1e3:10.2f} ms') if t else ('ERROR ' + row['error'][:60] if row.get('error') else 'infeasible')}"
              f"{extra}  ({row['task_wall_s']:.0f} s)", flush=True)


# --- the report ---------------------------------------------------------------------------------------------

def _fmt_t(x) -> str:
    return f"{x:,.0f}" if x is not None else "-"


def _cell(row) -> str:
    if row is None:
        return "n/m"                        # not measured (yet)
    if row.get("error"):
        return "error"
    if not row.get("feasible"):
        return "OOM" if "memory" in (row.get("reason") or "").lower() or "fit" in (row.get("reason") or "").lower() \
            else "infeasible"
    return _fmt_t(row.get("throughput_samples_s")) + ("*" if row.get("limit_note") else "")


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (model, machine): each strategy's row, the best feasible baseline and the speedups."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["devices"], r["machine"]), {})[r["strategy"]] = r
    out = []
    for (model, D, machine), s in by.items():
        base = [(k, r) for k, r in s.items() if k not in SEARCHES and r.get("feasible")
                and r.get("throughput_samples_s")]
        best = max(base, key=lambda kr: kr[1]["throughput_samples_s"], default=(None, None))
        u, q = s.get("unity"), s.get("sequential")
        tu = u.get("throughput_samples_s") if u and u.get("feasible") else None
        tq = q.get("throughput_samples_s") if q and q.get("feasible") else None
        n = s.get(NOPIPE)
        tn = n.get("throughput_samples_s") if n and n.get("feasible") else None
        out.append({"model": model, "devices": D, "machine": machine, "rows": s, "best_baseline": best[0],
                    "best_baseline_tput": best[1]["throughput_samples_s"] if best[1] else None,
                    "unity_tput": tu, "sequential_tput": tq,
                    "speedup": tu / best[1]["throughput_samples_s"] if tu and best[1] else None,
                    "joint_over_sequential": tu / tq if tu and tq else None,
                    "nopipe_tput": tn, "nopipe_speedup": tn / best[1]["throughput_samples_s"] if tn and best[1] else None,
                    "nopipe_over_sequential": tn / tq if tn and tq else None,
                    "nopipe_search_s": n.get("search_s") if n else None,
                    "search_s": u.get("search_s") if u else None,
                    "sequential_search_s": q.get("search_s") if q else None})
    order = {m: i for i, m in enumerate(PAPER_MODELS + (DENSENET,))}
    out.sort(key=lambda x: (x["devices"] == 1024, order.get(x["model"], 99), x["devices"]))
    return out


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _run_line(meta: dict) -> str:
    """The report's line on how the rows were measured: the run's own settings, or, for a file written by
    ``--merge`` alone (its meta holds only the merged runs), each merged run's."""
    if "command" not in meta and meta.get("merged"):
        m0 = meta["merged"][0]
        runs = "; ".join(f"`{m.get('command', '?')}` (git {m.get('git') or '?'}, started {m.get('started', '?')}, "
                         f"{m.get('rows', '?')} rows, load average at start {m.get('loadavg', '?')})"
                         for m in meta["merged"])
        return (f"Merged from {len(meta['merged'])} file(s), each named by the last command that wrote it: {runs}; "
                f"search budget {m0.get('budget_s', '?')} s "
                f"({m0.get('budget_large_s', '?')} s for DenseNet-121 and 1,024 GPUs), at most "
                f"{m0.get('max_candidates', '?')} expanded candidates per segment; {m0.get('cpus', '?')} CPUs.")
    return (f"Run: {meta.get('command', '?')}; search budget {meta.get('budget_s', '?')} s "
            f"({meta.get('budget_large_s', meta.get('budget_s', '?'))} s for DenseNet-121 and 1,024 GPUs), at most "
            f"{meta.get('max_candidates', '?')} expanded candidates per segment; {meta.get('cpus', '?')} CPUs shared "
            f"with other work (load average at start {meta.get('loadavg', '?')}); git {meta.get('git', '?')}; "
            f"started {meta.get('started', '?')}.")


def report(path: str = JSON_OUT, md: str = MD_OUT) -> str:
    data = load_rows(path)
    rows, meta = data["rows"], data.get("meta", {})
    lines = summarize(rows)
    o = ["# Figure 14 / 15b in simulation", "",
         "`benchmarks/fig14.py` (report from `benchmarks/results/fig14.json`). Predicted by the cost model on "
         "Summit (`summit:Nx6`, V100 16 GB) at the paper's global batch (per-GPU batch x GPUs) and optimizer "
         "(Adam for BERT-Large, SGD otherwise). Throughput in samples/s = global batch / predicted iteration. "
         "Baselines: `dp` all models, `megatron` BERT-Large (tensor parallel inside a node), `expert` DLRM, "
         "XDL, CANDLE-Uno. *OOM*: the strategy's best mapping does not fit a device; *n/m*: not measured "
         "(run cut short); *error*: see the JSON; a star: the search ran past the task's time limit and was "
         "stopped with Ctrl-C (its best plan so far).", "",
         _run_line(meta), ""]
    alpa = _alpa_rows()
    o += ["## Figure 14: Unity against the best baseline (throughput, samples/s)", "",
          "| model | GPUs | dp | megatron | expert | best baseline | Unity | Unity / best | search (s) | "
          "Unity, no pipeline | no pipeline / best | search (s) | paper | Alpa | Unity / Alpa |",
          "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in lines:
        if x["devices"] == 1024 or x["model"] == DENSENET:
            continue
        s = x["rows"]
        paper = PAPER_SPEEDUP.get(x["model"]) if x["devices"] == 192 else None
        st = f"{x['search_s']:.1f}" if x["search_s"] is not None else "-"
        sn = f"{x['nopipe_search_s']:.1f}" if x["nopipe_search_s"] is not None else "-"
        o.append(f"| {x['model']} | {x['devices']} | {_cell(s.get('dp'))} | "
                 f"{_cell(s.get('megatron')) if 'megatron' in baselines_for(x['model']) else ''} | "
                 f"{_cell(s.get('expert')) if 'expert' in baselines_for(x['model']) else ''} | "
                 f"{x['best_baseline'] or '-'} | {_cell(s.get('unity'))} | {_x(x['speedup'])} | {st} | "
                 f"{_cell(s.get(NOPIPE))} | {_x(x['nopipe_speedup'])} | {sn} | {_x(paper) if paper else ''} | "
                 f"{_alpa_cells(alpa.get((x['model'], x['devices'])), s.get('unity'))} |")
    o += ["", "*Unity*: `optimize(strategy=\"unity\")` as the product runs it, with its 1F1B pipeline stage "
          "(taken when predicted faster). *Unity, no pipeline*: the same with `pipeline=False`: the paper's "
          "Figure 14 disables pipeline parallelism against frameworks without it (all baselines here but "
          "Megatron). Paper column: Unity over the best baseline at the largest scale (Figure 14; BERT-Large "
          "on par with Megatron, ResNeXt-50 about 1.0x). *Alpa*: Alpa's plan (intra-operator ILP + stage DP, "
          "`--strategy alpa`) in the same cost model, machine, batch and optimizer, from "
          "`benchmarks/alpa_gpt.py --part zoo` (`alpa_gpt.json`; *n/m* where it has no row: by default it runs at 48 GPUs, `--zoo-gpus` adds other sizes).", ""]
    o += _breakdown(lines)
    o += _extras(lines)
    o += _fig15b(lines)
    o += _search_times(lines, meta)
    o += _notes(lines, rows)
    # the hand-written reading is about the committed full run (fig14.json); a partial run written elsewhere
    # (--out) gets its own (READINGS, keyed by the file name) or none
    reading = ANALYSIS if os.path.abspath(path) == os.path.abspath(JSON_OUT) else READINGS.get(os.path.basename(path))
    if reading:
        o += ["", reading]
    text = "\n".join(o) + "\n"
    with open(md, "w") as f:
        f.write(text)
    return text


ALPA_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "alpa_gpt.json")


def _alpa_rows(path: str = ALPA_JSON) -> dict:
    """(model, GPUs) -> Alpa's throughput on the zoo, from alpa_gpt.py's JSON (empty if it was not run)."""
    try:
        with open(path) as f:
            rows = json.load(f).get("rows", [])
    except (OSError, ValueError):
        return {}
    out = {}
    for r in rows:
        a = r.get("alpa") or {}
        if r.get("part") == "zoo" and a.get("feasible") and a.get("iteration_s"):
            out[(r["model"], r["gpus"])] = r["batch"] / a["iteration_s"]
    return out


def _alpa_cells(alpa_tput, unity_row) -> str:
    if alpa_tput is None:
        return "n/m | -"
    u = (unity_row or {}).get("throughput_samples_s") if (unity_row or {}).get("feasible") else None
    return f"{_fmt_t(alpa_tput)} | {_x(u / alpa_tput) if u else '-'}"


def _breakdown(lines) -> list[str]:
    """Where the predicted iteration goes, best baseline against Unity, at the largest Summit scale."""
    top = max((x["devices"] for x in lines if x["devices"] != 1024 and x["model"] != DENSENET), default=None)
    sel = [x for x in lines if x["devices"] == top and x["model"] != DENSENET]
    if not sel:
        return []
    o = [f"## Where the iteration goes at {top} GPUs (predicted ms: compute / activation communication / "
         "gradient synchronization / update; memory per device GiB)", "",
         "| model | strategy | iteration | compute | comm | grad sync | update | memory (GiB) | comm elements |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in sel:
        for name in ([x["best_baseline"]] if x["best_baseline"] else []) + ["unity"]:
            r = x["rows"].get(name)
            b = (r or {}).get("breakdown") or {}
            if not r or not r.get("feasible") or not b:
                continue
            ms = [f"{1e3 * b.get(k, 0.0):.1f}" for k in ("compute_s", "comm_s", "grad_sync_s", "update_s")]
            mem = r.get("max_memory_bytes")
            o.append(f"| {x['model']} | {name} | {1e3 * r['predicted_iteration_s']:.1f} | " + " | ".join(ms) +
                     f" | {mem / 2**30:.2f} | {r.get('comm_elements', 0):.3g} |" if mem else
                     f"| {x['model']} | {name} | {1e3 * r['predicted_iteration_s']:.1f} | " + " | ".join(ms) +
                     f" | - | {r.get('comm_elements', 0):.3g} |")
    return o + [""]


def _extras(lines) -> list[str]:
    ex = [x for x in lines if x["devices"] == 1024 or x["model"] == DENSENET]
    if not ex:
        return []
    o = ["## DenseNet-121 and 1,024 GPUs", "",
         "| model | machine | GPUs | best baseline | baseline samples/s | Unity samples/s | Unity / best | search (s) | target (s) |",
         "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for x in ex:
        st = f"{x['search_s']:.1f}" if x["search_s"] is not None else "-"
        o.append(f"| {x['model']} | {x['machine']} | {x['devices']} | {x['best_baseline'] or '-'} | "
                 f"{_fmt_t(x['best_baseline_tput'])} | {_cell(x['rows'].get('unity'))} | {_x(x['speedup'])} | "
                 f"{st} | 120 |")
    return o + [""]


def _fig15b(lines) -> list[str]:
    q = [x for x in lines if "sequential" in x["rows"]]
    o = ["## Figure 15b: joint (Unity) against sequential (TASO then FlexFlow), same budget", ""]
    if not q:
        return o + ["Not measured yet.", ""]
    o += ["| model | machine | sequential samples/s | Unity, no pipeline | joint / sequential | Unity (pipelines) | "
          "with pipelines / sequential | sequential search (s) |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in q:
        ss = x["sequential_search_s"]
        o.append(f"| {x['model']} | {x['machine']} | {_cell(x['rows'].get('sequential'))} | "
                 f"{_cell(x['rows'].get(NOPIPE))} | {_x(x['nopipe_over_sequential'])} | {_cell(x['rows'].get('unity'))} | "
                 f"{_x(x['joint_over_sequential'])} | {f'{ss:.1f}' if ss is not None else '-'} |")
    return o + ["", "The sequential strategy has no pipeline stage, so *joint / sequential* (no pipeline on "
                "either side) is the paper's comparison; paper: joint over sequential up to 1.6x (96 GPUs).", ""]


def _search_times(lines, meta) -> list[str]:
    o = ["## Unity search time (s) per model and GPU count (with pipelines / without)", ""]
    devs = sorted({x["devices"] for x in lines if x["search_s"] is not None or x["nopipe_search_s"] is not None})
    if not devs:
        return o + ["Not measured yet.", ""]
    o += ["| model | " + " | ".join(str(d) for d in devs) + " |", "|---|" + "---:|" * len(devs)]
    for name in PAPER_MODELS + (DENSENET,):
        cells = []
        for d in devs:
            x = next((y for y in lines if y["model"] == name and y["devices"] == d), None)
            a = f"{x['search_s']:.1f}" if x and x["search_s"] is not None else "-"
            b = f"{x['nopipe_search_s']:.1f}" if x and x["nopipe_search_s"] is not None else "-"
            cells.append("" if a == b == "-" else f"{a} / {b}")
        if any(cells):
            o.append(f"| {name} | " + " | ".join(cells) + " |")
    o += ["", "Targets on this machine: <= 60 s per paper model at 192 GPUs, <= 120 s at 1,024 GPUs and "
          "for DenseNet-121 (wall clock, including import and the data-parallel reference; "
          "the machine was shared, see the load average above).", ""]
    return o


def _notes(lines, rows) -> list[str]:
    o = ["## What the search chose", "",
         "| model | machine | Unity chose | pipeline stages x micro-batches | rule steps | explored | DP solves | "
         "DP solves cut by time | stopped by | code |",
         "|---|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r["strategy"] not in ("unity", NOPIPE) or r.get("error"):
            continue
        s = r.get("search") or {}
        stopped = ",".join(sorted(set(s.get("stopped", []))))
        pipe = f"{s['pipeline_stages']} x {s.get('micro_batches', '?')}" if s.get("pipeline_stages") else ""
        o.append(f"| {r['model']} | {r['machine']} | {r['strategy']}: {s.get('chosen', '-')}{' (fallback ' + s['fallback'] + ')' if s.get('fallback') else ''} | "
                 f"{pipe} | {r.get('rule_steps', '-')} | {s.get('explored', '-')} | {s.get('mapper_calls', '-')} | "
                 f"{s.get('mapper_timeouts', '-')} | {stopped} | {r.get('code') or 'unrecorded'} |")
    o += _checks(lines, rows)
    errs = [r for r in rows if r.get("error")]
    if errs:
        o += ["", "Errors:", ""] + [f"- {r['model']} {r['machine']} {r['strategy']}: {r['error'][:200]}" for r in errs]
    return o + [""]


#: readings of partial runs written with --out (file name -> markdown)
READINGS: dict = {
    "fig14_fix_before.json": """## Reading (the rows issue 7 points 5/10 named, before the fix)

Run 2026-11-26 10:20-10:40 UTC at git 040ac8c (another helper's rule work uncommitted in the tree, so the code digest
differs between some rows), `--budget 50`, load 1-10. DLRM and XDL at 24 and 96 GPUs were already above the expert
strategy (the tables-by-columns families of 8caa824; the 0.81x/0.47x of fig14.md were older code); BERT-Large was
below Megatron: 0.93x at 96 GPUs and 0.89x at 192, with and without pipelines (the search returned data
parallelism), and the search without pipelines at 96 GPUs took 55.8 s for its 50 s budget.
""",
    "fig14_fix.json": """## Reading (the same rows and BERT-Large at every scale, after the fix)

Run 2026-11-26 11:29-11:48 UTC (git 77cb025 to 6708d3e: other helpers committed during the run, the search code
of this fix unchanged; two comparisons mix rule-cache digests), `--budget 50`, load 6-10 falling to 1.5.

- **Never below a baseline**: 0 of 24 searches more than 1% below the best baseline (the check above). The joint
  search prices the fixed strategies that apply (`megatron` inside a node for BERT-Large, `expert` for DLRM/XDL) first,
  as it prices dp, and returns the fastest of them where every plan reached by rules is slower
  (`info.search.chosen` = "megatron baseline ..."; no rule sequence, as the dp baseline): BERT-Large without pipelines
  at 12-192 GPUs is Megatron's plan, 1.00x. The rules do not reach Megatron-LM's layout (its residual Adds and
  LayerNorms run on the tensor-parallel copies with one AllReduce per group; the rules' Megatron seeds leave them data
  parallel with a Reduce and a Replicate: 0.85 s against 0.676 s at 192 GPUs). With pipelines the stage search beats
  Megatron at every scale (1.01-1.12x). DLRM and XDL: the whole-graph tables-by-columns families, now built and priced
  before the segment search (DLRM at 192 GPUs 4.00x over expert, XDL 2.78x; at 96 GPUs 2.72x and 2.30x).
- **Budget**: no search more than 10% over its 50 s budget (largest 53.0 s, BERT-Large at 192 GPUs without
  pipelines; before: 55.8 s at 96 GPUs, and 66.7 s in fig14.md). `info.search.wall_s`: the last time-limited DP solve
  ended within 0.1 s of the substitution phase's wall in every row.
""",
}

#: What the committed run shows and why it falls short of the paper (written from fig14.json of 2026-11-26 at
#: 5f4a44b; rerun the matrix and this text may no longer match the tables above it)
ANALYSIS = """## Reading the results (the whole matrix rerun 2026-11-26 14:02-14:38 UTC at commit 5f4a44b)

- **One run, one code**: every row above ran on an isolated install of commit 5f4a44b (two processes side by side on
  the 2-core box, nothing else heavy running for most of it: load 1.3-5), `--budget 50` (100 s for DenseNet-121 and
  1,024 GPUs); Unity without pipelines at 6, 96 and 192 GPUs, Figure 15b at 96 (the checks: no mixed code).
- **Never below a baseline**: 0 of 71 searches below dp or more than 1% below the best baseline.
- **Plans reached by rules**: every plan records its rule sequence (pipeline plans through `pipeline.by_rules`, built
  by segments). BERT-Large at 1,024 GPUs and DenseNet-121 were rerun at 3c5ebaf (14:52-14:57): in the whole run
  BERT-Large there was the hand-built Megatron floor (one solve of its whole graph takes ~40 s at 1,024 GPUs, and
  the rules' Megatron-LM layout `tp8x128 copies` was built but its solve cut at the wall); with the floor priced
  after the copies families on machines of more than 256 devices it is that layout, by rules (1,803 steps), 1.00x.
  BERT-Large without pipelines is now Megatron-LM's layout by rules (`tp<k>x<d> copies`: the pooler column-parallel,
  the residual stream on the tensor-parallel copies, one AllReduce per group): 1.00x of the hand-built Megatron at
  96 and 192 GPUs (0.674 s against 0.676 s at 192), 1,803 rule steps.
- **Paper anchors (192 GPUs)**: ResNeXt-50 1.00x (paper ~1.0x), Inception-v3 1.00x (1.3x), BERT-Large 1.01x of
  Megatron (on par), DLRM 4.00x (3.6x), XDL 2.78x (1.9x), CANDLE-Uno 2.49x (1.6x: tensor parallel 4 on dp 48 with
  its towers' Replicate lifted above the 7-input join, Alpa's ILP plan), MLP 2.97x (2.0x). Inception-v3 falls short
  in our cost model, not in the search: data parallelism at 192 GPUs is 671 ms, 368 ms of it the SyncBatchNorm
  statistics all-reduces (the executor trains with SyncBatchNorm semantics; latency-bound rings over 192 devices);
  fewer devices per all-reduce costs compute in proportion (dp on 96 devices 756 ms, pipelines of 4-8 stages
  855-1,119 ms), no shipped rule splits a convolution or BatchNorm other than by samples, and no rule relates two
  degrees (a degree change between segments is a full gather): `cnn_why.md`. The paper's baseline presumably kept
  per-device BatchNorm statistics.
- **1,024 GPUs (h100:128x8)**: ResNeXt-50 1.62x, Inception-v3 1.81x (pipelines), DLRM 11.1x, XDL 11.7x, CANDLE-Uno
  21.5x, MLP 9.35x over the best baseline, BERT-Large 1.00x (Megatron-LM's layout by rules, above).
- **Figure 15b** (96 GPUs, no pipelines on either side): joint over sequential 1.00x on the CNNs and MLP, BERT-Large
  1.07x, CANDLE-Uno 2.21x, DLRM 5.11x, XDL 8.81x (paper: up to 1.6x); the sequential search's parallel phase starts
  from data parallelism and single steps, without the seed families.
- **Search time**: 21.2-51.7 s per paper model at 6-192 GPUs (at 192: 36.2-48.9 s, target 60 s), DenseNet-121 81.6 s,
  1,024 GPUs 79.8-95.2 s (target 120 s); the sequential search took 82.6 s on BERT-Large (its algebraic phase is not
  walled). `info.search.timeline_s` in the JSON says where the time went.
"""


def _checks(lines, rows) -> list[str]:
    """The issue's requirements, checked on the rows: Unity never predicted slower than data parallelism
    where that fits; search time within the targets; every search answered within its task limit."""
    o = ["", "## Checks", ""]
    n_u = 0
    slow = []
    for x in lines:
        dp = x["rows"].get("dp") or {}
        for strat in ("unity", NOPIPE):
            u = x["rows"].get(strat)
            if not u or not u.get("feasible") or not u.get("throughput_samples_s") or not dp.get("feasible"):
                continue
            n_u += 1
            if u["throughput_samples_s"] < dp["throughput_samples_s"] * (1 - 1e-9):
                slow.append(f"  - {x['model']} {x['machine']} {strat}: {1e3 * u['predicted_iteration_s']:.0f} ms "
                            f"({(u.get('search') or {}).get('chosen', '?')}) vs dp {1e3 * dp['predicted_iteration_s']:.0f} ms")
    o.append(f"- Unity predicted slower than hand-built data parallelism (which fits): {len(slow)} of {n_u} searches"
             + (":" if slow else "."))
    o += slow
    # every baseline the benchmark prices (dp, Megatron, expert): the search prices them too (issue 7 point 5)
    below, n_b = [], 0
    for x in lines:
        best = x["rows"].get(x["best_baseline"]) if x["best_baseline"] else None
        for strat in ("unity", NOPIPE):
            u = x["rows"].get(strat)
            if not best or not u or not u.get("feasible") or not u.get("throughput_samples_s"):
                continue
            n_b += 1
            if u["throughput_samples_s"] < best["throughput_samples_s"] * 0.99:
                below.append(f"  - {x['model']} {x['machine']} {strat}: {u['throughput_samples_s'] / best['throughput_samples_s']:.2f}x "
                             f"of {x['best_baseline']} ({(u.get('search') or {}).get('chosen', '?')})")
    o.append(f"- Unity predicted more than 1% slower than the best baseline: {len(below)} of {n_b} searches"
             + (":" if below else "."))
    o += below
    late = [f"{r['model']} {r['machine']} {r['strategy']} {r['search_s']:.1f} s of {r['budget_s']:.0f} s"
            for r in rows if r["strategy"] in ("unity", NOPIPE) and r.get("search_s") is not None
            and r.get("budget_s") and r["search_s"] > 1.1 * r["budget_s"]]
    o.append(f"- Searches more than 10% over their budget: {len(late)}" + (": " + "; ".join(late) if late else "."))
    over = []
    for r in rows:
        if r["strategy"] not in ("unity", NOPIPE) or r.get("search_s") is None:
            continue
        target = 120.0 if (r["devices"] == 1024 or r["model"] == DENSENET) else 60.0 if r["devices"] == 192 else None
        if target is not None and r["search_s"] > target:
            over.append(f"{r['model']} {r['machine']} {r['search_s']:.0f} s (target {target:.0f} s, "
                        f"CPU {r.get('cpu_s', 0):.0f} s)")
    o.append(f"- Search over its time target: {len(over)}" + (": " + "; ".join(over) if over else "."))
    mixed = [f"{x['model']} {x['machine']}" for x in lines
             if len({(r.get("code") or "unrecorded").split("+")[-1] for r in x["rows"].values()}) > 1]
    o.append(f"- Comparisons whose rows ran different search/cost code (search/ and substitutions/ changed during "
             f"the run; the digest after `+` in `code`): {len(mixed)}" + (": " + ", ".join(mixed) if mixed else "."))
    lim = [f"{r['model']} {r['machine']} {r['strategy']} ({r['limit_note']})" for r in rows if r.get("limit_note")]
    o.append(f"- Tasks past their time limit: {len(lim)}" + (": " + "; ".join(lim) if lim else "."))
    return o


# --- main ---------------------------------------------------------------------------------------------------

def _meta(a, argv) -> dict:
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=ROOT).stdout.strip()
    except OSError:
        git = "?"
    return {"command": "python benchmarks/fig14.py " + " ".join(argv), "budget_s": a.budget,
            "budget_large_s": a.budget_large,
            "max_candidates": a.max_candidates, "memory_techniques": not a.no_memory_techniques, "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()), "git": git,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(PAPER_MODELS))
    ap.add_argument("--devices", default=",".join(map(str, DEVICES)),
                    help="GPU counts on Summit (multiples of 6), 1024 = h100:128x8")
    ap.add_argument("--budget", type=float, default=50.0,
                    help="search budget in seconds (unity and sequential): the wall time of optimize(), import "
                         "included; 50 s keeps the 60 s target at 192 GPUs with a margin for a loaded machine")
    ap.add_argument("--budget-large", type=float, default=100.0,
                    help="budget of the DenseNet-121 and 1,024-GPU rows (target 120 s)")
    ap.add_argument("--max-candidates", type=int, default=40, help="expanded candidates per segment")
    ap.add_argument("--quick", action="store_true", help="mlp and dlrm at 6 and 12 GPUs, 10 s budget, no extras")
    ap.add_argument("--no-extras", action="store_true", help="skip DenseNet-121 and 1,024 GPUs")
    ap.add_argument("--extras-only", action="store_true", help="only DenseNet-121 and 1,024 GPUs")
    ap.add_argument("--searches", default=f"unity,{NOPIPE}",
                    help=f"joint searches per (model, GPUs): unity (with pipelines) and {NOPIPE}")
    ap.add_argument("--sequential-devices", default="96",
                    help="GPU counts at which the sequential search runs (Figure 15b; '' for none)")
    ap.add_argument("--fresh", action="store_true", help="discard the rows already in the output")
    ap.add_argument("--task-timeout", type=float, default=None,
                    help="seconds after which a task gets Ctrl-C (the search returns its best plan so far; "
                         "default max(3 x budget, budget + 120))")
    ap.add_argument("--out", default=JSON_OUT)
    ap.add_argument("--report", action="store_true", help="only write the markdown report from the JSON")
    ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                    help="add the rows of another run's JSON (e.g. a second process run with --out) to --out "
                         "(a task's later row replaces its earlier one), then write the report")
    ap.add_argument("--no-memory-techniques", action="store_true",
                    help="price every plan (Unity's and the baselines') without ZeRO, recomputation, offload and "
                         "overlap of the gradient sync: the cost model of the runs before them (fig14.json at c290828)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        return worker(a.worker)
    md = os.path.splitext(a.out)[0] + ".md"
    if a.merge:
        data = load_rows(a.out)
        have = {_key(r): i for i, r in enumerate(data["rows"])}
        for f in a.merge:
            extra = load_rows(f)
            new = 0
            for r in extra["rows"]:                   # a row measured later replaces the same task's row
                i = have.get(_key(r))
                if i is None:
                    have[_key(r)] = len(data["rows"])
                    data["rows"].append(r)
                elif r.get("finished", "") > data["rows"][i].get("finished", ""):
                    data["rows"][i] = r
                else:
                    continue
                new += 1
            data.setdefault("meta", {}).setdefault("merged", []).append(dict(extra.get("meta", {}), file=os.path.basename(f),
                                                                            rows=new))
            print(f"merged {new} rows of {f}")
        save(a.out, data)
    if a.report or a.merge:
        print(report(a.out, md))
        return 0
    if a.quick:
        a.models, a.devices, a.budget, a.no_extras, a.sequential_devices = "mlp,dlrm", "6,12", 10.0, True, "6,12"
    if a.budget <= 0:
        ap.error("--budget must be positive")
    models = [x for x in a.models.split(",") if x]
    from unity_pcg import zoo
    bad = [x for x in models if x not in zoo.MODELS]
    if bad:
        ap.error(f"unknown model(s) {', '.join(bad)}; known: {', '.join(zoo.MODELS)}")
    devices = [int(x) for x in a.devices.split(",") if x]
    for d in devices:
        machine_for(d)
    os.makedirs(RESULTS, exist_ok=True)
    seq = {int(x) for x in a.sequential_devices.split(",") if x}
    searches = tuple(x for x in a.searches.split(",") if x)
    if any(x not in ("unity", NOPIPE) for x in searches):
        ap.error(f"--searches: unity and/or {NOPIPE}")
    tasks = tasks_for(models, devices, a.budget, a.max_candidates, not a.no_extras, seq, searches, a.extras_only,
                      a.budget_large)
    for t in tasks:
        t["techniques"] = not a.no_memory_techniques
    run(tasks, a.out, a.fresh, a.task_timeout, _meta(a, argv))
    report(a.out, md)
    print(f"wrote {os.path.relpath(a.out, ROOT)} and {os.path.relpath(md, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
