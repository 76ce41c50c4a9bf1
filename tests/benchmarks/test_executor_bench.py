"""Smoke tests of benchmarks/executor_bench.py: its arguments, its rank correlation, and (slow) the plans
it measures.  The benchmark itself is run by hand (it takes minutes)."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("executor_bench",
                                                  os.path.join(ROOT, "benchmarks", "executor_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv", [["--runs", "0"], ["--rounds", "0"], ["--iters", "-1"], ["--procs", "1,2"],
                                  ["--procs", "two"]])
def test_bad_arguments_exit_2_before_any_work(argv, tmp_path, capsys):
    B = _bench()
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as e:
        B.main(argv + ["--out", str(out), "--md", str(tmp_path / "r.md")])
    assert e.value.code == 2
    assert not out.exists()
    assert "--" in capsys.readouterr().err


def test_spearman():
    B = _bench()
    assert B.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert B.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert B.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)          # 1 - 6*2/(4*15)
    # ties get their average rank: ranks (1.5, 1.5, 3) against (1, 2, 3)
    assert B.spearman([5, 5, 7], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)


@pytest.mark.slow
def test_plans_use_every_process_and_have_the_expected_kinds():
    B = _bench()
    models = {k: B.export_model(k) for k in ("mlp", "ffn", "block", "zoo")}
    for procs in (2, 4):
        cases = B.make_plans(procs, "local", models)
        ids = [c["id"] for c in cases]
        assert len(ids) == len(set(ids)) == (5 if procs == 2 else 6)
        for c in cases:
            assert c["devices_used"] == procs, c["id"]
            assert c["predicted_s"] > 0
            ops = {n["op"] for n in c["plan"]["pcg"]["nodes"]}
            if c["name"] in ("megatron", "reduction"):
                assert "Reduce" in ops or "AllReduce" in ops, c["id"]      # partial sums are reduced
