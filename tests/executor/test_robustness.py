"""Robustness of `unity-pcg run`: a rank killed with SIGKILL stops every rank with one line naming it; a
diverging run stops with one line naming the step and keeps its last good checkpoint; plans for another
model, another device count, or a corrupted plan are refused before any process starts."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from unity_pcg.executor import checkpoint as C
from unity_pcg.executor.launch import diagnose
from tests.executor.runtime_plans import dp_plan, tiny_mlp_onnx


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("robust")
    model = tiny_mlp_onnx(str(d / "mlp.onnx"))
    return {"dir": d, "model": model, "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


def cli(capfd, *args):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", *map(str, args), "--loss", "mean"])
    out, err = capfd.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture()
def no_launch(monkeypatch):
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("a process was started"))


def test_killed_rank_stops_every_rank_with_one_line(work, capfd, monkeypatch):
    monkeypatch.setenv("UNITY_PCG_FAULT_KILL", "1:2")    # rank 1 SIGKILLs itself when it reaches step 2
    t = time.monotonic()
    rc, out, err = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 100000, "--timeout", 20)
    took = time.monotonic() - t
    assert rc != 0 and took < 60
    errors = [ln for ln in err if "error" in ln]
    assert len(errors) == 1, err
    assert errors[0].startswith("unity-pcg run: error: rank 1 died (killed by SIGKILL)")
    # every other rank ended non-zero too (stopped by the launcher or failing its collective)
    assert "rank 0: exit status 0" not in errors[0] and "rank 0:" in errors[0]
    assert sum(1 for ln in out.splitlines() if ln.startswith("step ")) == 2   # steps 1 and 2 completed


@pytest.mark.slow
def test_hung_rank_is_named_after_the_collective_timeout(work, capfd, monkeypatch):
    monkeypatch.setenv("UNITY_PCG_FAULT_HANG", "1:2")    # rank 1 wedges at step 2: no heartbeat, no collective
    t = time.monotonic()
    rc, out, err = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 100000, "--timeout", 3)
    took = time.monotonic() - t
    assert rc != 0 and took < 60
    errors = [ln for ln in err if "error" in ln]
    assert len(errors) == 1, err
    assert errors[0].startswith("unity-pcg run: error: rank 1 stopped answering (no heartbeat)"), errors[0]
    assert "timed out after 3 s at step 3" in errors[0]


def test_diverging_rank_stops_at_the_step_and_keeps_the_last_good_checkpoint(work, tmp_path, monkeypatch, capfd):
    """One rank in this process (no launch): the step named, the exit status, the checkpoint kept."""
    from unity_pcg.executor.__main__ import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ck, rep = tmp_path / "ck", tmp_path / "rep"
    rep.mkdir()
    one = tmp_path / "one.json"
    from tests.executor.runtime_plans import one_device_plan
    one_device_plan(work["model"], str(one))
    rc = main([str(one), "--model", work["model"], "--steps", "20", "--lr", "1e30", "--checkpoint", str(ck),
               "--checkpoint-every", "1", "--report-dir", str(rep), "--progress", "none", "--loss", "mean"])
    assert rc == 4
    report = json.loads((rep / "rank-0.json").read_text())
    good = (ck / "latest").read_text().strip()
    n_good = int(good.split("-")[1])
    assert report["kind"] == "diverged" and report["message"].startswith(f"step {n_good + 1}: ")
    assert f"{good} kept" in report["message"] and "\n" not in report["message"]
    model, _, meta = C.load(str(ck))
    assert meta["step"] == n_good and all(torch.isfinite(v).all() for v in model.values())


@pytest.mark.slow
def test_diverging_run_stops_at_the_step_and_keeps_the_last_good_checkpoint(work, capfd):
    ck = work["dir"] / "ck"
    rc, out, err = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 20, "--lr", "1e30",
                       "--checkpoint", ck, "--checkpoint-every", 1)
    assert rc != 0
    errors = [ln for ln in err if "error" in ln]
    assert len(errors) == 1, err
    line = errors[0]
    good = (ck / "latest").read_text().strip()
    n_good = int(good.split("-")[1])
    # the step named is the first whose loss or updated parameters are not finite; the checkpoint before
    # it is the latest, intact and finite
    assert line.startswith(f"unity-pcg run: error: step {n_good + 1}: ") and f"{good} kept" in line, line
    assert any(w in line for w in ("nan", "inf", "NaN")), line
    model, _, meta = C.load(str(ck))
    assert meta["step"] == n_good
    assert all(torch.isfinite(v).all() for v in model.values())
    printed = [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("step ")]
    # every good step was printed; the bad one too when its loss was finite but its update was not
    assert len(printed) == (n_good + 1 if "parameters" in line else n_good)


def test_other_model_is_refused_before_start(work, capfd, no_launch, tmp_path):
    other = tiny_mlp_onnx(str(tmp_path / "other.onnx"), seed=1)   # same graph, other weights
    rc, _, err = cli(capfd, work["dp2"], "--model", other)
    assert rc == 2 and len(err) == 1 and "sha256" in err[0] and "plan was made for" in err[0]


def test_other_device_count_is_refused_before_start(work, capfd, no_launch):
    rc, _, err = cli(capfd, work["dp2"], "--model", work["model"], "--nproc", 3)
    assert rc == 2 and len(err) == 1 and "runs on 2 device(s)" in err[0] and "--nproc is 3" in err[0]


@pytest.mark.parametrize("damage, msg", [
    (lambda text: text[: len(text) // 2], "not JSON"),
    (lambda text: text.replace('"schema": "unity-pcg/plan/v1"', '"schema": "x"'), "unsupported schema"),
    (lambda text: json.dumps({**json.loads(text), "views": {"999": {"start": 0, "dims": []}}}), "not in the PCG"),
    (lambda text: json.dumps({**json.loads(text), "views": {}}), "no machine views"),
])
def test_corrupted_plan_is_refused_before_start(work, capfd, no_launch, tmp_path, damage, msg):
    bad = tmp_path / "bad.json"
    with open(work["dp2"]) as f:
        bad.write_text(damage(f.read()))
    rc, _, err = cli(capfd, bad, "--model", work["model"])
    assert rc == 2 and len(err) == 1 and msg in err[0], err


def test_diagnosis_names_the_cause():
    rep = {0: {"kind": "peer", "message": "rank 0: a collective failed"}, 1: None}
    assert diagnose({0: 3, 1: -9}, rep)[0].startswith("rank 1 died (killed by SIGKILL)")
    # the launcher's own SIGTERM is not the cause; a rank's error is
    assert diagnose({0: -15, 1: 2}, {0: None, 1: {"kind": "error", "message": "bad data"}}) == ("bad data", 2)
    assert diagnose({0: 4, 1: -15}, {0: {"kind": "diverged", "message": "step 3: loss is nan"}, 1: None})[0] \
        == "step 3: loss is nan"
    assert diagnose({0: 3, 1: 1}, {0: rep[0], 1: None})[0] == "rank 1 exited with status 1 without a message"
    assert diagnose({0: 3, 1: -15}, {0: rep[0], 1: None})[0] == "rank 0: a collective failed"
