"""Fit the ``h100`` machine preset from measurements on a real H100 (issue 9, point 3).

Input: the machine file ``unity-pcg calibrate --device cuda`` wrote on an H100
(``benchmarks/results/h100_calibrated.json``: its ``meta.gpu_calibration.measured`` holds every kernel
measured, by class, math mode and size).  The fit is redone here from those raw rows with the current
fitting code (:func:`unity_pcg.calibration.gpu.fit_rows`: per class and mode a fixed cost + throughput
fit and a measured table work -> seconds; :func:`~unity_pcg.calibration.gpu.machine_json`: peaks per
math mode, efficiencies, overheads), on the datasheet preset (:func:`unity_pcg.machine.h100_datasheet`)
so the interconnect keeps its datasheet numbers (one GPU measures no NVLink or network).  Output: the
device section the ``h100`` preset loads (``unity_pcg/presets/h100.json``) with its provenance.

Usage: python benchmarks/fit_h100.py [--from benchmarks/results/h100_calibrated.json]
                                     [--out unity_pcg/presets/h100.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def fit(calibrated: dict, source: str) -> dict:
    from unity_pcg.machine import h100_datasheet
    from unity_pcg.calibration.gpu import fit_rows, machine_json
    cal = (calibrated.get("meta") or {}).get("gpu_calibration") or {}
    rows = cal.get("measured")
    if not rows:
        raise SystemExit(f"fit_h100: {source} has no meta.gpu_calibration.measured rows "
                         "(write it with `unity-pcg calibrate --device cuda`)")
    if "H100" not in str(cal.get("device_name", "")):
        raise SystemExit(f"fit_h100: {source} was measured on {cal.get('device_name')!r}, not an H100")
    fits, tables = fit_rows(rows)
    modes = cal.get("modes") or ["fp32"]
    memory = calibrated["device"].get("memory_bytes")
    base = h100_datasheet(1, 1).to_json()
    m = machine_json(base, fits, tables, modes, memory, None, {}, rows=rows)
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"device": m["device"],
            "meta": {"fitted_from": os.path.relpath(source, ROOT), "fitted_from_sha256": digest,
                     "fitted_by": "python benchmarks/fit_h100.py",
                     "measured_on": cal.get("device_name"), "torch": cal.get("torch"), "cuda": cal.get("cuda"),
                     "modes": list(modes), "kernels_measured": len(rows), "calibration_size": cal.get("size"),
                     "measured": "per-class kernel tables and fits per math mode, peaks per mode, memory capacity",
                     "assumed": "interconnect (NVLink 4 / NDR bandwidths and latencies) from the datasheet"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="source", default=os.path.join(ROOT, "benchmarks", "results",
                                                                  "h100_calibrated.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "unity_pcg", "presets", "h100.json"))
    a = ap.parse_args(argv)
    with open(a.source) as f:
        calibrated = json.load(f)
    out = fit(calibrated, a.source)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    d = out["device"]
    print(f"wrote {a.out}: peaks " + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in sorted(d["peaks"].items()))
          + f"; {len(d['kernel_tables'])} kernel tables; memory {d['memory_bytes'] / 2 ** 30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
