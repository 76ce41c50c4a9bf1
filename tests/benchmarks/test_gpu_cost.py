"""benchmarks/gpu_cost.py: the CPU flow end to end (tiny zoo sizes; the H100 run is by hand), its refusal
without CUDA, and its error summary."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_cost", os.path.join(ROOT, "benchmarks", "gpu_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    import torch
    B = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "g.json"
    assert B.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err and not out.exists()
    assert B.main(["--device", "cpu", "--size", "paper", "--out", str(out)]) == 2
    assert B.main(["--device", "cpu", "--precisions", "fp8", "--out", str(out)]) == 2
    assert not out.exists()


def test_cpu_flow_tiny(tmp_path):
    B = _bench()
    out = tmp_path / "g.json"
    rc = B.main(["--device", "cpu", "--size", "tiny", "--models", "mlp,candle_uno", "--precisions", "fp32,bf16",
                 "--iters", "2", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["model"], r["precision"]) for r in rows] == [("mlp", "fp32"), ("mlp", "bf16"),
                                                             ("candle_uno", "fp32"), ("candle_uno", "bf16")]
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["feasible"]
        assert r["time_ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        assert r["optimizer"] == "sgd" and r["zoo_size"] == "tiny" and r["peak_memory_bytes"] is None
    assert set(data["summary"]) == {"fp32", "bf16"} and data["meta"]["machine"] == "local:1x1"
    md = (tmp_path / "g.md").read_text()
    assert "| mlp | tiny |" in md and "median abs time error" in md


def test_summary_against_targets():
    B = _bench()
    rows = [{"precision": "fp32", "time_ratio": r, "memory_ratio": m}
            for r, m in ((1.1, 1.05), (0.9, 0.95), (1.3, 1.2))]
    s = B.summarize(rows)["fp32"]
    assert s["median_abs_time_error"] == pytest.approx(0.1) and s["max_abs_time_error"] == pytest.approx(0.3)
    assert s["within_15pct"] == 2 and s["within_35pct"] == 3
    assert s["median_abs_memory_error"] == pytest.approx(0.05) and s["meets_targets"]
    rows.append({"precision": "fp32", "time_ratio": 0.5, "memory_ratio": 1.0})
    assert not B.summarize(rows)["fp32"]["meets_targets"]      # one model 50% off


def test_from_an_earlier_run_predicts_again_without_measuring(tmp_path, monkeypatch):
    B = _bench()
    first = tmp_path / "first.json"
    assert B.main(["--device", "cpu", "--size", "tiny", "--models", "mlp", "--precisions", "fp32",
                   "--iters", "1", "--warmup", "0", "--out", str(first)]) == 0
    monkeypatch.setattr(B, "measure", lambda *a, **k: pytest.fail("--from must not measure"))
    again = tmp_path / "again.json"
    assert B.main(["--from", str(first), "--machine", "h100:1x1", "--out", str(again)]) == 0
    old, new = json.loads(first.read_text()), json.loads(again.read_text())
    (r0,), (r1,) = old["rows"], new["rows"]
    assert r1["measured_s"] == r0["measured_s"] and new["meta"]["machine"] == "h100:1x1"
    assert r1["predicted_s"] < r0["predicted_s"]          # an H100 is faster than this CPU's model
    assert new["meta"]["measured_in"]["file"] == str(first)
    assert "predicted again here" in (tmp_path / "again.md").read_text()
    assert B.main(["--from", str(first), "--out", str(first)]) == 2       # never overwrite the measurements
    assert B.main(["--from", str(tmp_path / "missing.json"), "--out", str(again)]) == 2
