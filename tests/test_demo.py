"""The main command (`./run.sh` -> `python -m unity_pcg.demo`): its planning stages run quickly and
produce a valid plan, its explanation and the predicted speedup; a bad argument is one line, exit 2.
The whole job (calibration, search, training on local processes) is the slow test."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from unity_pcg import plan as P
from unity_pcg.demo import data_parallel_plan, main
from unity_pcg.machine import parse_machine


def test_planning_stages(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--machine", "local:1x2", "--no-run", "--budget", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for stage in ("== 1. export", "== 2. import", "== 3. machine", "== 4. plan", "== 5. explain"):
        assert stage in text
    assert "max abs difference" in text and "(ok)" in text
    assert "JOINT SEARCH FAILED" not in text           # the search, where installed, ran to the end
    pl = P.load(str(out / "plan.json"))
    pl.check_model()                               # the plan is for the exported model file
    assert pl.machine.num_devices == 2
    # the printed prediction is the plan's own, and the speedup is data parallel's over it
    m = re.search(r"predicted iteration: plan ([\d.]+) ms, data parallel \(2 processes\) ([\d.]+) ms", text)
    assert m
    t_plan = pl.predicted["predicted_iteration_s"]
    assert float(m.group(1)) == pytest.approx(t_plan * 1e3, abs=0.006)
    _, dp = data_parallel_plan(pl.model_path, pl.machine, 2, "sgd")
    sp = re.search(r"predicted speedup over data parallel: ([\d.]+)x", text)
    assert sp and float(sp.group(1)) == pytest.approx(dp.cost / t_plan, abs=0.006)
    # the explanation: short on screen, complete on disk, with the PCG drawn
    assert "activation transfers" in text and "gradient all-reduces" in text
    full = (out / "plan_explain.txt").read_text()
    assert "operators (shard" in full and len(full.splitlines()) > len(text.split("== 5.")[1].splitlines()) - 5
    assert (out / "plan.dot").read_text().startswith("digraph plan {")
    assert "run skipped" in text and "summary: mlp (tiny) on local 1x2" in text


def test_data_parallel_plan_uses_every_process(tmp_path):
    model = tmp_path / "m.onnx"
    from unity_pcg import zoo
    zoo.export("mlp", str(model), size="tiny", batch=8)
    pl, res = data_parallel_plan(str(model), parse_machine("local:1x2"), 2, "sgd")
    assert res.feasible and res.stats["devices_used"] == 2
    assert sorted({d for v in pl.views.values() for d in v.devices()}) == [0, 1]
    assert pl.predicted["predicted_iteration_s"] == res.cost


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "unity_pcg.demo", "--model", "nosuch", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown zoo model 'nosuch'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_whole_job(tmp_path):
    """`./run.sh`'s job: calibrate, search, explain, train on 2 local processes; predicted vs measured."""
    r = subprocess.run([sys.executable, "-m", "unity_pcg.demo", "--out", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600, cwd=os.getcwd())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "== 6. train on local processes" in r.stdout
    m = re.search(r"step time: predicted ([\d.]+) ms, measured ([\d.]+) ms", r.stdout)
    assert m and float(m.group(2)) > 0
    # the synthetic teacher task is learned: the loss falls
    assert "--loss mse --data" in r.stdout
    m = re.search(r"mse loss ([\d.e+-]+) -> ([\d.e+-]+) \(first -> last", r.stdout)
    assert m and float(m.group(2)) < 0.7 * float(m.group(1)), r.stdout[-1500:]


def test_synthetic_task_is_learned(tmp_path, monkeypatch):
    """The demo's data (a fixed random teacher) trains the tiny MLP with the demo's loss and learning rate
    (sgd 0.5): the loss falls (one process, in this process: no process start)."""
    import json

    import numpy as np

    from tests.executor.runtime_plans import one_device_plan
    from unity_pcg import zoo
    from unity_pcg.demo import teacher_data
    from unity_pcg.executor.__main__ import main as rank_main
    from unity_pcg.onnx_import import load_onnx
    model = str(tmp_path / "mlp.onnx")
    zoo.export("mlp", model, size="tiny", batch=8)
    data, loss = teacher_data(load_onnx(model, load_weights=False), str(tmp_path / "data"))
    assert loss == "mse" and sorted(os.listdir(data)) == ["targets.npy", "x.npy"]
    t = np.load(os.path.join(data, "targets.npy"))
    assert t.shape == (32, 64) and np.isfinite(t).all()
    plan = one_device_plan(model, str(tmp_path / "one.json"))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    rep = tmp_path / "rep"
    rep.mkdir()
    assert rank_main([plan, "--model", model, "--steps", "12", "--lr", "0.5", "--data", data, "--loss", loss,
                      "--report-dir", str(rep), "--progress", "none"]) == 0
    losses = json.loads((rep / "result.json").read_text())["losses"]
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_search_plan_slower_than_data_parallel_is_not_run(tmp_path, capsys, monkeypatch):
    """The main command runs the faster of the search's plan and data parallelism, and says why."""
    import unity_pcg.demo as demo

    def slower(model_path, machine, optimizer, budget, fallback):
        pred = dict(fallback.predicted, predicted_iteration_s=fallback.predicted["predicted_iteration_s"] * 3)
        return P.Plan(fallback.model_path, fallback.model_sha256, machine, fallback.pcg, fallback.views, pred,
                      None, {"strategy": "unity"}), "joint search (stand-in)"
    monkeypatch.setattr(demo, "_optimize", slower)
    out = tmp_path / "demo"
    assert main(["--machine", "local:1x2", "--no-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "is predicted slower than data parallelism: running data parallelism" in text
    assert "predicted speedup over data parallel: 1.00x" in text
    assert P.load(str(out / "plan.json")).info["strategy"] == "dp"
