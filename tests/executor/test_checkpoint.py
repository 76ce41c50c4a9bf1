"""Checkpoints (torch.distributed.checkpoint): a resumed run continues with exactly the losses of an
uninterrupted one; the checkpoint holds the model's own parameters by their ONNX names."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from unity_pcg.executor import checkpoint as C
from tests.executor.runtime_plans import dp_plan, reference_losses, tiny_mlp_onnx


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    model = tiny_mlp_onnx(str(d / "mlp.onnx"))
    return {"dir": d, "model": model, "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


def run(capfd, *args):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", *map(str, args), "--json", "--loss", "mean"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_flatten_round_trip_keeps_structure_and_key_types():
    state = {"step": 3, "state": {"fc.weight": {"exp_avg": torch.randn(2, 3), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "amsgrad": False, "foreach": None}],
             7: ["a", 1.5]}
    tensors: dict = {}
    skel = C.flatten(state, "optim", tensors)
    back = C.unflatten(json.loads(json.dumps(skel)), tensors)
    assert set(tensors) == {"optim/state/fc.weight/exp_avg", "optim/state/fc.weight/step"}
    assert back["param_groups"] == state["param_groups"] and back[7] == ["a", 1.5] and back["step"] == 3
    assert torch.equal(back["state"]["fc.weight"]["exp_avg"], state["state"]["fc.weight"]["exp_avg"])


def test_resume_continues_exactly_like_an_uninterrupted_run(work, capfd):
    """5 steps checkpointing every 3 (so after step 3 and at the end); then, as if the run had died after
    step 3, resume from that checkpoint for 2 steps: the same losses and the same final weights, exactly."""
    ck, ck2 = work["dir"] / "ck", work["dir"] / "ck2"
    common = [work["dp2"], "--model", work["model"], "--optimizer", "adam", "--lr", "0.02"]
    full = run(capfd, *common, "--steps", 5, "--checkpoint", ck, "--checkpoint-every", 3)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000003", "step-00000005"]
    assert (ck / "latest").read_text().strip() == "step-00000005"
    # the run "died" after step 3: copy that checkpoint alone into a fresh folder
    import shutil
    ck2.mkdir()
    shutil.copytree(ck / "step-00000003", ck2 / "step-00000003")
    (ck2 / "latest").write_text("step-00000003\n")
    resumed = run(capfd, *common, "--steps", 2, "--checkpoint", ck2, "--resume")
    assert resumed["first_step"] == 3
    assert resumed["losses"] == full["losses"][3:]
    m1, o1, meta1 = C.load(str(ck))
    m2, o2, meta2 = C.load(str(ck2))
    assert meta1["step"] == meta2["step"] == 5
    assert sorted(m1) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
        assert torch.equal(o1["state"][k]["exp_avg_sq"], o2["state"][k]["exp_avg_sq"]), k
    # and they are the weights plain PyTorch training reaches (the exporter stores Linear weights as
    # Gemm's (in, out) initializers: the checkpoint holds the ONNX model's own layout)
    ref_losses, ref_w = reference_losses(work["model"], 5, "adam", lr=0.02)
    np.testing.assert_allclose(full["losses"], ref_losses, rtol=1e-4, atol=1e-7)
    for k, v in ref_w.items():
        v = v.numpy().T if v.ndim == 2 else v.numpy()
        np.testing.assert_allclose(m1[k].numpy(), v, rtol=1e-4, atol=1e-6)


def test_resume_refuses_a_foreign_checkpoint_before_start(work, capfd, monkeypatch):
    from unity_pcg.executor import launch as _launch
    from unity_pcg.cli import main
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    ck = work["dir"] / "foreign"
    ck.mkdir()
    step = ck / "step-00000002"
    step.mkdir()
    (step / "meta.json").write_text(json.dumps({"step": 2, "optimizer": "sgd", "world": 2, "plan_sha256": None}))
    (ck / "latest").write_text("step-00000002\n")
    capfd.readouterr()
    rc = main(["run", work["dp2"], "--model", work["model"], "--checkpoint", str(ck), "--resume", "--optimizer", "adam",
               "--loss", "mean"])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "holds sgd state" in err[0], err
    rc = main(["run", work["dp2"], "--model", work["model"], "--checkpoint", str(work["dir"] / "empty"), "--resume",
               "--loss", "mean"])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no checkpoint" in err[0], err


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_start(work, capfd, monkeypatch, tmp_path):
    """--checkpoint naming a file, or a folder the user may not write into, is one line before any process."""
    import os

    from unity_pcg.cli import main
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    f = tmp_path / "afile"
    f.write_text("x")
    capfd.readouterr()
    rc = main(["run", work["dp2"], "--model", work["model"], "--checkpoint", str(f), "--loss", "mean"])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a file" in err[0], err
    real = os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    # the permission answer of a read-only folder (root may write anywhere, so os.access is asked to say no)
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if os.path.abspath(p) == str(locked) else real(p, m))
    rc = main(["run", work["dp2"], "--model", work["model"], "--checkpoint", str(locked / "new" / "ck"),
               "--loss", "mean"])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot write into" in err[0] and "locked" in err[0], err


# --- a checkpoint that cannot be written (issue 20, point 5b) ---------------------------------------------

def _one_rank(monkeypatch, capfd, *args):
    """The executor's rank main in this process (rank 0 of 1): (exit status, losses printed, stderr lines)."""
    from unity_pcg.executor.__main__ import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    capfd.readouterr()
    rc = main([*map(str, args), "--loss", "mean"])
    out, err = capfd.readouterr()
    losses = [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("step ")]
    return rc, losses, [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def one(work):
    from tests.executor.runtime_plans import one_device_plan
    p = str(work["dir"] / "one.json")
    one_device_plan(work["model"], p)
    return p


@pytest.mark.parametrize("where", ["data", "state", "latest"])
def test_failed_checkpoint_write_keeps_the_previous_one_and_resume_continues_exactly(
        work, one, tmp_path, monkeypatch, capfd, where):
    """5 steps checkpointing every 2: the save after step 4 fails (no space left, in DCP's data, the rank's
    state file or `latest`): the run ends with status 5 and one line naming the failure and the checkpoint
    kept; `latest` still names step 2, nothing of step 4 is left, and resuming from step 2 gives the
    uninterrupted run's losses exactly."""
    common = [one, "--model", work["model"], "--optimizer", "adam", "--lr", "0.02", "--progress", "stdout"]
    rc, full, err = _one_rank(monkeypatch, capfd, *common, "--steps", 5, "--checkpoint", tmp_path / "full",
                              "--checkpoint-every", 2)
    assert rc == 0 and len(full) == 5, err
    ck = tmp_path / "ck"
    monkeypatch.setenv("UNITY_PCG_FAULT_CKPT", "0:4" + ("" if where == "data" else f":{where}"))
    rc, losses, err = _one_rank(monkeypatch, capfd, *common, "--steps", 5, "--checkpoint", ck,
                                "--checkpoint-every", 2)
    assert rc == 5 and losses == full[:4], err
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("executor: error: the checkpoint of step 4 could not be written to "), err[0]
    assert "No space left on device" in err[0] and "the latest is still step-00000002" in err[0], err[0]
    assert (ck / "latest").read_text() == "step-00000002\n"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002"]
    monkeypatch.delenv("UNITY_PCG_FAULT_CKPT")
    rc, resumed, err = _one_rank(monkeypatch, capfd, *common, "--steps", 3, "--checkpoint", ck, "--resume")
    assert rc == 0 and resumed == full[2:], err
    m1, o1, meta1 = C.load(str(tmp_path / "full"))
    m2, o2, meta2 = C.load(str(ck))
    assert meta1["step"] == meta2["step"] == 5
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
        assert torch.equal(o1["state"][k]["exp_avg"], o2["state"][k]["exp_avg"]), k


def test_failed_checkpoint_write_on_one_of_two_ranks_ends_the_run_with_one_line(work, tmp_path, capfd,
                                                                                 monkeypatch):
    """Rank 1's part of the final checkpoint (step 4) fails: every rank stops with the same line (status 1
    from `unity-pcg run`), step 2 stays the latest and a run resumes from it (exactness of a resume after a
    failed write: the one-rank test above; of a two-rank resume: test_resume_continues_exactly...)."""
    from unity_pcg.cli import main
    common = [work["dp2"], "--model", work["model"], "--lr", "0.05", "--loss", "mean"]
    ck = tmp_path / "ck"
    monkeypatch.setenv("UNITY_PCG_FAULT_CKPT", "1:4")
    capfd.readouterr()
    t = time.monotonic()
    rc = main(["run", *map(str, common), "--steps", "4", "--checkpoint", str(ck), "--checkpoint-every", "2"])
    took = time.monotonic() - t
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert rc == 1 and took < 60, err
    assert len(err) == 1 and err[0].startswith("unity-pcg run: error: the checkpoint of step 4 could not be "
                                               "written"), err
    assert "rank 1: No space left on device" in err[0] and "the latest is still step-00000002" in err[0], err[0]
    assert (ck / "latest").read_text() == "step-00000002\n"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002"]
    monkeypatch.delenv("UNITY_PCG_FAULT_CKPT")
    resumed = run(capfd, *common, "--steps", 2, "--checkpoint", ck, "--resume")
    assert resumed["first_step"] == 2 and len(resumed["losses"]) == 2
    assert C.read_meta(str(ck))["step"] == 4


def test_saving_the_step_latest_names_never_overwrites_it(tmp_path, monkeypatch):
    """A second save of the step `latest` names goes to step-S.1; when it fails, the first stays whole."""
    root = str(tmp_path / "ck")
    a, b = torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3)
    assert C.save(root, 3, {"w": a}, {}) == C.step_dir(root, 3)
    monkeypatch.setenv("UNITY_PCG_FAULT_CKPT", "0:3")
    with pytest.raises(C.CheckpointWriteError, match="the latest is still step-00000003"):
        C.save(root, 3, {"w": b}, {})
    model, _, meta = C.load(root)
    assert torch.equal(model["w"], a) and meta["dir"] == C.step_dir(root, 3)
    monkeypatch.delenv("UNITY_PCG_FAULT_CKPT")
    assert C.save(root, 3, {"w": b}, {}) == C.step_dir(root, 3) + ".1"
    model, _, _ = C.load(root)
    assert torch.equal(model["w"], b)
    assert C.save(root, 3, {"w": a}, {}) == C.step_dir(root, 3)    # .1 is the latest now: the plain name
    assert torch.equal(C.load(root)[0]["w"], a)


def test_prune_never_removes_the_latest(tmp_path):
    for s in (1, 2, 3, 4):
        (tmp_path / f"step-{s:08d}").mkdir()
    (tmp_path / "latest").write_text("step-00000001\n")
    C._prune(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000003",
                                                          "step-00000004"]
    (tmp_path / "latest").write_text("")      # unreadable name: nothing is removed
    C._prune(str(tmp_path), keep=1)
    assert len(list(tmp_path.iterdir())) == 4


def test_read_only_checkpoint_folder_is_one_line(tmp_path):
    """A folder the process may not write to (not effective as root, where chmod does not stop writes)."""
    import os
    root = tmp_path / "ro"
    root.mkdir()
    C.save(str(root), 1, {"w": torch.ones(2)}, {})
    os.chmod(root, 0o555)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: a read-only mode does not stop writes (the injected faults cover it)")
        with pytest.raises(C.CheckpointWriteError, match="Permission denied.*the latest is still step-00000001"):
            C.save(str(root), 2, {"w": torch.zeros(2)}, {})
        assert (root / "latest").read_text() == "step-00000001\n"
        assert torch.equal(C.load(str(root))[0]["w"], torch.ones(2))
    finally:
        os.chmod(root, 0o755)
