"""The Python API (`unity_pcg.import_model / optimize / explain / train`): the same jobs, checks and errors
as the command line, and progress bars only where a terminal is attached."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

import unity_pcg as up
from tests.executor.runtime_plans import dp_plan, tiny_mlp_onnx
from unity_pcg import plan as P
from unity_pcg.cli import main as cli_main
from unity_pcg.errors import UnityError


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    model = tiny_mlp_onnx(str(d / "mlp.onnx"))
    return {"dir": d, "model": model, "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


def _cli(capfd, *args):
    capfd.readouterr()
    rc = cli_main([str(a) for a in args])
    out, err = capfd.readouterr()
    return rc, out, err


def test_import_model_matches_the_command(work, capfd):
    m = up.import_model(work["model"], check=True)
    rc, out, _ = _cli(capfd, "import", work["model"], "--json", "--check")
    cli = json.loads(out)
    assert rc == 0 and m.check.ok and cli["check"]["ok"]
    assert m.summary()["ops"] == cli["ops"] and m.summary()["params"] == cli["params"]
    assert m.inputs == cli["inputs"]
    assert [o["shape"] for o in m.outputs] == cli["outputs"]


@pytest.mark.parametrize("kwargs", [{"batch": 0}, {"batch": -3}])
def test_import_model_refuses_what_the_command_refuses(work, capfd, kwargs):
    with pytest.raises(UnityError) as e:
        up.import_model(work["model"], **kwargs)
    rc, _, err = _cli(capfd, "import", work["model"], "--batch", kwargs["batch"])
    assert rc == 2 and str(e.value) in err


def test_missing_model_is_the_commands_one_line_error(tmp_path, capfd):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(UnityError) as e:
        up.import_model(missing)
    rc, _, err = _cli(capfd, "import", missing)
    assert rc == 2 and str(e.value) in err and "\n" not in str(e.value)


def test_optimize_writes_the_plan_the_command_writes(work, tmp_path, capfd):
    res = up.optimize(work["model"], machine="local:1x2", budget=3, strategy="dp", output=tmp_path / "api.json")
    rc, out, _ = _cli(capfd, "optimize", work["model"], "--machine", "local:1x2", "--budget", 3,
                      "--strategy", "dp", "-o", tmp_path / "cli.json", "--json")
    assert rc == 0
    a, b = P.load(str(tmp_path / "api.json")), P.load(str(tmp_path / "cli.json"))
    assert a.views == b.views and a.pcg.structural_hash() == b.pcg.structural_hash()
    assert res.predicted_iteration_s == pytest.approx(json.loads(out)["predicted_iteration_s"])


@pytest.mark.parametrize("kwargs,flag", [({"budget": 0}, ["--budget", "0"]),
                                         ({"strategy": "nonsense"}, ["--strategy", "nonsense"]),
                                         ({"precision": "fp8"}, ["--precision", "fp8"]),
                                         ({"machine": "mars:1x2"}, ["--machine", "mars:1x2"])])
def test_optimize_refuses_what_the_command_refuses(work, tmp_path, capfd, kwargs, flag):
    with pytest.raises(UnityError) as e:
        up.optimize(work["model"], **kwargs)
    rc, _, err = _cli(capfd, "optimize", work["model"], *flag, "-o", tmp_path / "p.json")
    assert rc == 2 and str(e.value).split(":")[-1].strip() in err


def test_unknown_option_names_the_known_ones(work):
    with pytest.raises(TypeError, match="unexpected keyword argument 'budgett'.*budget"):
        up.optimize(work["model"], budgett=3)
    with pytest.raises(TypeError, match="'epochs'.*steps"):
        up.train(work["dp2"], work["model"], epochs=3)


def test_explain_is_the_commands_text(work, capfd):
    e = up.explain(work["dp2"])
    rc, out, _ = _cli(capfd, "explain", work["dp2"], "--dot", work["dir"] / "x.dot")
    assert rc == 0 and str(e).strip() in out
    assert e.to_json()["devices"] == 2
    with pytest.raises(UnityError):
        up.explain(42)


def test_train_with_arrays_equals_the_command_with_a_file(work, tmp_path, capfd):
    x = np.random.default_rng(3).standard_normal((32, 16)).astype(np.float32)
    y = np.random.default_rng(4).standard_normal((32, 8)).astype(np.float32)
    g = P.load(work["dp2"]).pcg
    name = g.sources("Input")[0].a["name"]
    res = up.train(work["dp2"], work["model"], steps=3, data={name: x, "targets": y}, lr=0.05)
    np.savez(tmp_path / "d.npz", **{name: x, "targets": y})
    rc, out, _ = _cli(capfd, "run", work["dp2"], "--model", work["model"], "--steps", 3, "--lr", 0.05,
                      "--data", tmp_path / "d.npz", "--json")
    assert rc == 0
    cli = json.loads(out[out.index("{"):])
    assert res["nproc"] == 2 and len(res["losses"]) == 3
    np.testing.assert_allclose(res["losses"], cli["losses"], rtol=1e-6)
    assert res["losses"][-1] != res["losses"][0]


def test_train_takes_an_optimize_result_and_refuses_bad_input(work):
    res = up.optimize(work["model"], machine="local:1x1", budget=2, strategy="none")
    out = up.train(res, steps=2, loss="mean")    # the model is the one the plan records
    assert out["nproc"] == 1 and len(out["losses"]) == 2
    with pytest.raises(UnityError, match="--steps must be >= 0"):
        up.train(res, steps=-1, loss="mean")
    with pytest.raises(UnityError, match="--nproc"):
        up.train(work["dp2"], work["model"], nproc=3, steps=1, loss="mean")
    with pytest.raises(UnityError, match="--loss"):
        up.train(work["dp2"], work["model"], steps=1)      # no targets: the loss must be stated
    with pytest.raises(UnityError, match="data"):
        up.train(work["dp2"], work["model"], data=[1, 2, 3], steps=1)


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from unity_pcg import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("UNITY_PCG_PROGRESS", raising=False)
    plain, tty = io.StringIO(), Tty()
    b = progress.bar(3, "steps", stream=plain)
    b.update(3)
    b.close()
    assert not b.drawn and plain.getvalue() == ""
    b = progress.bar(3, "steps", stream=tty)
    b.update(3)
    b.close()
    assert b.drawn and "3/3" in tty.getvalue()
    t = progress.time_bar("search", 10.0, stream=Tty())
    t.advance_to(4.0, "best 1.0 ms")
    t.advance_to(30.0)                     # past the budget: the bar stops at its end
    assert t.n == pytest.approx(10.0)
    t.close()
    monkeypatch.setenv("UNITY_PCG_PROGRESS", "0")
    assert not progress.enabled(Tty())
    monkeypatch.setenv("UNITY_PCG_PROGRESS", "1")
    assert progress.enabled(io.StringIO())


def test_readme_example_runs(tmp_path):
    """The README's Python API example, as written there, in a fresh process: it plans, explains, trains
    (the loss falls on its learnable targets) and writes the trained model."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "README.md")).read()
    m = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README has no api-example block"
    env = dict(os.environ, UNITY_PCG_PROGRESS="0")
    r = subprocess.run([sys.executable, "-c", m.group(1)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    first, last = map(float, re.search(r"loss ([-\d.e]+) -> ([-\d.e]+)", r.stdout).groups())
    assert last < 0.8 * first
    assert (tmp_path / "mlp_trained.onnx").exists() and (tmp_path / "plan.json").exists()
    assert "predicted iteration" in r.stdout


def test_export_weights_writes_what_train_saved(work, tmp_path):
    """train(save_model=...) and export_weights(checkpoint) of the same run write the same model; a
    missing checkpoint is the command's one-line error."""
    ck = tmp_path / "ck"
    res = up.train(work["dp2"], work["model"], steps=2, lr=0.1, loss="mean", checkpoint=ck,
                   save_model=tmp_path / "a.onnx")
    assert res["saved_model"]
    out = up.export_weights(ck, tmp_path / "b.onnx")
    assert out["step"] == 2 and out["written"]
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with pytest.raises(UnityError, match="does not exist"):
        up.export_weights(tmp_path / "nothing", tmp_path / "c.onnx")


def test_train_uses_the_optimizer_the_plan_was_priced_for(work):
    """A plan priced for SGD with momentum trains with it unless told otherwise; two data-parallel ranks equal
    one device (rtol 1e-4), and plain SGD gives other losses (the momentum is really applied)."""
    dp = up.optimize(work["model"], machine="local:1x2", budget=2, strategy="dp", optimizer="momentum")
    one = up.optimize(work["model"], machine="local:1x1", budget=2, strategy="none", optimizer="momentum")
    out = up.train(dp, steps=3, loss="mean", lr=0.05)
    ref = up.train(one, steps=3, loss="mean", lr=0.05)
    assert out["optimizer"] == ref["optimizer"] == "momentum" and out["nproc"] == 2
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-4)
    sgd = up.train(one, steps=3, loss="mean", lr=0.05, optimizer="sgd")
    assert sgd["optimizer"] == "sgd" and abs(sgd["losses"][2] - ref["losses"][2]) > 1e-6
