"""Peak host memory per rank when a large per-step batch is read from a memory-mapped --data folder:
4 data-parallel processes against 1 (issue 20, point 2).

The model is a small MLP (input width ``--width``, hidden 64, output 8) exported at a per-step batch of
``--batch`` rows; the data folder holds ``--batches`` batches of ``x`` (float32) and ``targets`` as
``NAME.npy`` files, which `unity-pcg run` opens with ``np.load(mmap_mode="r")``.  Each run trains
``--batches`` steps (every batch once) with ``--loss mse`` and reports per rank the peak resident set
(``ru_maxrss``) at the end and before the first step (model loaded, process group up): their difference
is what the steps, the data read included, added.  A data-parallel rank of K reads only its 1/K of the
rows of each batch, so the added memory per rank should fall about K-fold; a rank that held the whole
logical batch would add as much as the single process.

Each configuration runs ``--repeats`` times (1 and 4 processes alternating, in one invocation); the
report takes medians.  Results: benchmarks/results/data_memory.json and data_memory.md.

Usage:  .venv/bin/python benchmarks/data_memory.py [--batch 65536] [--width 512] [--batches 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 1 << 20


def prepare(d: str, batch: int, width: int, batches: int) -> tuple[str, dict, int]:
    import numpy as np

    from tests.executor.runtime_plans import dp_plan, one_device_plan, tiny_mlp_onnx
    model = tiny_mlp_onnx(os.path.join(d, "mlp.onnx"), batch=batch, dims=(width, 64, 8))
    plans = {1: one_device_plan(model, os.path.join(d, "one.json")),
             4: dp_plan(model, os.path.join(d, "dp4.json"), 4)}
    data = os.path.join(d, "data")
    os.makedirs(data)
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(os.path.join(data, "x.npy"), mode="w+", dtype=np.float32,
                                  shape=(batch * batches, width))
    for lo in range(0, x.shape[0], 8192):        # written in slices: this process stays small too
        x[lo:lo + 8192] = rng.standard_normal((min(8192, x.shape[0] - lo), width), dtype=np.float32)
    x.flush()
    del x
    np.save(os.path.join(data, "targets.npy"), rng.standard_normal((batch * batches, 8)).astype(np.float32))
    return model, plans, os.path.getsize(os.path.join(data, "x.npy")) // batches


def run(plan: str, model: str, data: str, steps: int) -> dict:
    cmd = [os.path.join(ROOT, ".venv", "bin", "unity-pcg"), "run", plan, "--model", model, "--data", data,
           "--loss", "mse", "--steps", str(steps), "--threads", "1", "--json"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"run failed: {r.stderr.strip().splitlines()[-1:]}")
    res = json.loads(r.stdout)
    res["wall_s"] = time.perf_counter() - t
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "data_memory.json"))
    args = p.parse_args(argv)
    d = tempfile.mkdtemp(prefix="unity-data-memory-")
    try:
        model, plans, batch_bytes = prepare(d, args.batch, args.width, args.batches)
        runs: dict = {1: [], 4: []}
        for i in range(args.repeats):
            for k in (1, 4):
                res = run(plans[k], model, os.path.join(d, "data"), args.batches)
                peak = res["rank_peak_rss_bytes"]
                before = res["rank_peak_rss_before_steps_bytes"]
                runs[k].append({"peak_rss_mib": [b / MiB for b in peak],
                                "before_steps_mib": [b / MiB for b in before],
                                "added_mib": [(a - b) / MiB for a, b in zip(peak, before)],
                                "fed_rows": res["rank_fed_rows"], "wall_s": res["wall_s"]})
                print(f"repeat {i}, {k} process(es): peak {[round(v) for v in runs[k][-1]['peak_rss_mib']]} MiB, "
                      f"added by the steps {[round(v) for v in runs[k][-1]['added_mib']]} MiB, fed rows "
                      f"{[r['x'] for r in res['rank_fed_rows']]}", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def med(k, key):   # median over repeats of the largest rank's figure
        return statistics.median(max(r[key]) for r in runs[k])
    summary = {k: {"peak_rss_mib": med(k, "peak_rss_mib"), "added_mib": med(k, "added_mib"),
                   "before_steps_mib": med(k, "before_steps_mib")} for k in (1, 4)}
    out = {"config": {"batch_rows": args.batch, "width": args.width, "batches": args.batches,
                      "x_bytes_per_batch": batch_bytes, "repeats": args.repeats, "loss": "mse",
                      "data": "folder of NAME.npy, np.load(mmap_mode='r')", "host": os.uname().nodename,
                      "cpus": os.cpu_count()},
           "runs": {str(k): v for k, v in runs.items()},
           "median_of_max_rank": {str(k): v for k, v in summary.items()},
           "ratio_4_over_1": {"peak_rss": summary[4]["peak_rss_mib"] / summary[1]["peak_rss_mib"],
                              "added_by_steps": summary[4]["added_mib"] / summary[1]["added_mib"]}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    md = os.path.splitext(args.out)[0] + ".md"
    r = out["ratio_4_over_1"]
    with open(md, "w") as f:
        f.write(f"""# Peak host memory per rank: memory-mapped data, 4 data-parallel processes vs 1

`.venv/bin/python benchmarks/data_memory.py --batch {args.batch} --width {args.width} --batches {args.batches} \
--repeats {args.repeats}` ({os.cpu_count()} CPU cores, shared machine).

MLP {args.width} -> 64 -> 8, per-step batch {args.batch} rows: `x` is {batch_bytes / MiB:.0f} MiB per batch
(float32), {args.batches} batches in a folder of `x.npy` / `targets.npy` opened with `np.load(mmap_mode="r")`;
{args.batches} steps, `--loss mse`.  Per rank: peak resident set (`ru_maxrss`) at the end of the run, and
before the first step (model, trainer, process group); "added" is their difference (what the steps, the
data read included, cost).  Medians over {args.repeats} runs of the largest rank's figure.

| processes | rows of x fed per rank | peak RSS per rank (MiB) | before step 0 (MiB) | added by the steps (MiB) |
|---|---|---|---|---|
| 1 | {runs[1][0]['fed_rows'][0]['x']} | {summary[1]['peak_rss_mib']:.0f} | {summary[1]['before_steps_mib']:.0f} | {summary[1]['added_mib']:.0f} |
| 4 | {runs[4][0]['fed_rows'][0]['x']} | {summary[4]['peak_rss_mib']:.0f} | {summary[4]['before_steps_mib']:.0f} | {summary[4]['added_mib']:.0f} |

Ratio 4 processes / 1: peak RSS per rank {r['peak_rss']:.2f}, added by the steps {r['added_by_steps']:.2f}
(1/4 = 0.25 would be the data alone; the process's own footprint -- torch, the model -- does not shrink).
""")
    print(json.dumps(out["median_of_max_rank"], indent=1), json.dumps(out["ratio_4_over_1"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
