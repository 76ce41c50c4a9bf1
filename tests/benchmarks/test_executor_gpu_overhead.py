"""benchmarks/executor_gpu_overhead.py: the CPU flow end to end (the H100 run is by hand), its refusal without
CUDA, and measure-only rows from gpu_cost predicted later with --from."""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overhead_cpu_flow_and_refusal(tmp_path, monkeypatch, capsys):
    import torch
    B = _load("executor_gpu_overhead")
    out = tmp_path / "o.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert B.main(["--out", str(out)]) == 2 and not out.exists()
    assert "no CUDA device" in capsys.readouterr().err
    rc = B.main(["--device", "cpu", "--models", "mlp:tiny,nosuchmodel", "--rounds", "2", "--iters", "2",
                 "--warmup", "1", "--out", str(out), "--workdir", str(tmp_path / "w")])
    assert rc == 0
    data = json.loads(out.read_text())
    good, bad = data["rows"]
    assert bad["model"] == "nosuchmodel" and "error" in bad            # reported, the run went on
    assert good["model"] == "mlp" and good["size"] == "tiny" and len(good["executor_all_s"]) == 4
    assert good["executor_s"] == statistics.median(good["executor_all_s"])
    assert good["overhead"] == good["executor_s"] / good["eager_s"] - 1 and len(good["round_ratios"]) == 2
    md = (tmp_path / "o.md").read_text()
    assert "| mlp | tiny |" in md and "error" in md


def test_measure_only_rows_are_predicted_later(tmp_path):
    G = _load("gpu_cost")
    meas = tmp_path / "m.json"
    assert G.main(["--device", "cpu", "--size", "tiny", "--models", "mlp", "--precisions", "fp32", "--iters", "1",
                   "--warmup", "0", "--measure-only", "--out", str(meas)]) == 0
    rows = json.loads(meas.read_text())["rows"]
    assert rows and all("predicted_s" not in r and r["measured_s"] > 0 for r in rows)
    assert json.loads(meas.read_text())["meta"]["complete"] is True
    pred = tmp_path / "p.json"
    assert G.main(["--from", str(meas), "--out", str(pred)]) == 0
    r = json.loads(pred.read_text())["rows"][0]
    assert r["predicted_s"] > 0 and r["time_ratio"] == r["predicted_s"] / r["measured_s"]
