"""Checkpoints (torch.distributed.checkpoint): a resumed run continues with exactly the losses of an
uninterrupted one; the checkpoint holds the model's own parameters by their ONNX names."""
from __future__ import annotations

import json

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
