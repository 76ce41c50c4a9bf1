"""`unity-pcg run` end to end: local ranks under the elastic launcher, the --json result, --data files,
and the same per-rank code under torchrun.  Each launch costs a few seconds (process start, gloo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.executor.runtime_plans import dp_plan, one_device_plan, reference_losses, tiny_mlp_onnx
from unity_pcg import plan as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    model = tiny_mlp_onnx(str(d / "mlp.onnx"))
    return {"dir": d, "model": model, "one": one_device_plan(model, str(d / "one.json")),
            "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


class Result:
    def __init__(self, rc, out, err):
        self.returncode, self.stdout, self.stderr = rc, out, err


def cli(capfd, *args) -> Result:
    """`unity-pcg run ARGS` in this process (the ranks are its children; their output is captured too)."""
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", *map(str, args)])
    out, err = capfd.readouterr()
    return Result(rc, out, err)


def test_dp_run_on_two_ranks_prints_json_and_trains_as_pytorch(work, capfd):
    r = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 4, "--optimizer", "adam", "--json",
            "--loss", "mean")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["nproc"] == 2 and out["steps"] == 4 and len(out["losses"]) == 4
    assert out["step_time_s"] > 0 and len(out["step_times_s"]) == 4
    assert out["predicted_iteration_s"] == pytest.approx(P.load(work["dp2"]).predicted["predicted_iteration_s"])
    # progress went to stderr (stdout is the JSON alone), one line per step from rank 0 only
    assert sum(1 for ln in r.stderr.splitlines() if ln.startswith("step ")) == 4
    ref, _ = reference_losses(work["model"], 4, "adam")
    np.testing.assert_allclose(out["losses"], ref, rtol=1e-4, atol=1e-7)


def rank_main(tmp, monkeypatch, *args) -> tuple[int, dict | None]:
    """``python -m unity_pcg.executor ARGS`` as a world of one, in this process (no process start); returns the exit
    code and rank 0's result."""
    from unity_pcg.executor.__main__ import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    rep = tmp / "report"
    rep.mkdir(exist_ok=True)
    rc = main([*map(str, args), "--report-dir", str(rep), "--progress", "none"])
    res = rep / "result.json"
    return rc, (json.loads(res.read_text()) if res.exists() else None)


def test_data_file_with_class_targets(work, monkeypatch):
    rng = np.random.default_rng(3)
    data = work["dir"] / "data.npz"
    # two batches of 8: step s reads batch s mod 2
    np.savez(data, x=rng.standard_normal((16, 16)).astype(np.float32), targets=rng.integers(0, 8, 16))
    rc, out = rank_main(work["dir"], monkeypatch, work["one"], "--model", work["model"], "--steps", 3,
                        "--data", data, "--lr", 0.1)
    assert rc == 0 and out["nproc"] == 1
    ref, _ = reference_losses(work["model"], 3, "sgd", lr=0.1, data=str(data))
    np.testing.assert_allclose(out["losses"], ref, rtol=1e-4, atol=1e-7)
    assert out["losses"][0] != out["losses"][1]   # a different batch (and updated weights) each step


@pytest.mark.parametrize("arrays, msg", [
    (lambda r: {"y": r.standard_normal((8, 16))}, "no array for model input 'x'"),
    (lambda r: {"x": r.standard_normal((12, 16))}, "k batches of 8"),
    (lambda r: {"x": r.standard_normal((8, 15))}, "has shape [8, 15]"),
    (lambda r: {"x": r.standard_normal((8, 16)), "bias": r.standard_normal(3)}, "neither a model input"),
    (lambda r: {"x": r.standard_normal((16, 16)), "targets": r.integers(0, 8, 15)}, "multiple of the 2 batches"),
])
def test_data_files_that_do_not_fit_are_refused_before_start(work, capfd, monkeypatch, arrays, msg):
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    data = work["dir"] / "bad.npz"
    np.savez(data, **arrays(np.random.default_rng(0)))
    r = cli(capfd, work["dp2"], "--model", work["model"], "--data", data)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], lines


@pytest.mark.slow
def test_same_rank_code_under_torchrun(work):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "unity_pcg.executor", work["dp2"], "--model", work["model"], "--steps", "2",
                        "--loss", "mean"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2   # rank 0 prints, rank 1 does not
    ref, _ = reference_losses(work["model"], 2)
    got = [float(ln.split()[3]) for ln in steps]
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_one_rank_without_torchrun_refuses_a_two_device_plan(work, capfd, monkeypatch):
    from unity_pcg.executor.__main__ import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    capfd.readouterr()
    assert main([work["dp2"], "--model", work["model"], "--steps", "1"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "runs on 2 rank(s)" in lines[0] and "torchrun" in lines[0]
