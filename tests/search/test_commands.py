import json
import os
import time

import pytest

from unity_pcg.calibration.local import fit_ring
from unity_pcg.cli import main


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("m") / "candle_uno.onnx"
    zoo.export("candle_uno", str(p), size="tiny", batch=12)
    return str(p)


def test_simulate_json_dp_and_none(tiny_onnx, capsys):
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--strategy", "dp", "--json"]) == 0
    dp = json.loads(capsys.readouterr().out)
    for k in ("predicted_iteration_s", "comm_elements", "max_memory_bytes", "devices", "feasible", "breakdown"):
        assert k in dp
    assert dp["feasible"] and dp["devices"] == 6 and dp["degree"] == 6 and dp["comm_elements"] > 0
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--strategy", "none", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["comm_elements"] == 0 and one["stats"]["devices_used"] == 1
    assert one["breakdown"]["compute_s"] > dp["breakdown"]["compute_s"]   # 6x the work per device
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--degree", "3"]) == 0
    assert "iteration" in capsys.readouterr().out


def test_simulate_errors_exit_2(tiny_onnx, capsys):
    assert main(["simulate", tiny_onnx, "--machine", "nosuch:1x2"]) == 2
    assert "unknown machine" in capsys.readouterr().err
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--degree", "5"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x2", "--degree", "4"]) == 2
    assert main(["simulate", "/nonexistent.onnx", "--machine", "summit:1x2"]) == 2


def test_simulate_writes_the_plan_it_priced(tiny_onnx, tmp_path, capsys):
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg import plan as P
    from unity_pcg.onnx_import import load_onnx
    path = tmp_path / "dp.json"
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--strategy", "dp", "--json",
                 "-o", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"] == str(path)
    pl = P.load(str(path))
    pl.check_model(tiny_onnx)
    assert pl.info["strategy"] == "dp" and pl.info["degree"] == 6
    assert pl.predicted["predicted_iteration_s"] == pytest.approx(out["predicted_iteration_s"])
    assert pl.predicted["comm_elements"] == out["comm_elements"]
    expect = data_parallel(load_onnx(tiny_onnx, load_weights=False), 6)
    assert pl.pcg.structural_hash() == expect.structural_hash()
    assert set(pl.views) == {n.id for n in pl.pcg.nodes() if n.kind != "source"}
    assert pl.machine.num_devices == 6
    # the whole model on one device
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x6", "--strategy", "none",
                 "-o", str(tmp_path / "one.json")]) == 0
    assert "plan" in capsys.readouterr().out
    one = P.load(str(tmp_path / "one.json"))
    assert {v.devices() for v in one.views.values()} == {(0,)}


def test_simulate_expert_and_megatron(tiny_onnx, tmp_path, capsys):
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x2", "--strategy", "expert", "--json",
                 "-o", str(tmp_path / "ex.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["model_parallel"]
    from unity_pcg import plan as P
    assert P.load(str(tmp_path / "ex.json")).info["model_parallel"] == out["model_parallel"]
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x2", "--strategy", "megatron"]) == 2
    assert "applies to Transformers" in capsys.readouterr().err
    assert main(["simulate", tiny_onnx, "--machine", "summit:1x2", "-o", str(tmp_path / "no" / "x.json")]) == 2
    assert "cannot write plan" in capsys.readouterr().err


def test_simulate_with_a_machine_file(tiny_onnx, tmp_path, capsys):
    from unity_pcg.machine import parse_machine
    p = tmp_path / "m.json"
    parse_machine("local:1x2").save(str(p))
    assert main(["simulate", tiny_onnx, "--machine", f"{p}:1x4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] == 4


def test_fit_ring_recovers_alpha_beta():
    alpha, beta, p = 50e-6, 1e9, 4

    def t(n):
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * n / beta
    f = fit_ring(p, {n: t(n) for n in (1, 2 ** 12, 2 ** 16, 2 ** 20)})
    assert f["bandwidth"] == pytest.approx(beta, rel=1e-3)
    assert f["latency"] == pytest.approx(alpha, rel=1e-3)


def test_calibrate_bad_worlds(capsys):
    assert main(["calibrate", "--worlds", "two", "-o", os.devnull]) == 2


@pytest.mark.slow
def test_calibrate_quick_within_a_minute(tmp_path):
    out = tmp_path / "local.json"
    t = time.perf_counter()
    assert main(["calibrate", "--quick", "-o", str(out)]) == 0
    assert time.perf_counter() - t <= 60
    from unity_pcg.machine import MachineSpec
    m = MachineSpec.load(str(out))
    assert m.meta["calibrated"] and set(m.meta["allreduce_fits"]) == {"2", "4"}
    assert m.resized(1, 4).links["group"].bandwidth == pytest.approx(m.meta["allreduce_fits"]["4"]["bandwidth"])


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy,batch", [("bert_large", "megatron", 4), ("dlrm", "expert", 8)])
def test_simulated_plans_train_as_one_device(name, strategy, batch, tmp_path, capsys):
    """The plans `simulate -o` writes run on the executor and train as the whole model on one
    device does (Megatron's tensor parallelism on tiny BERT, expert's round-robin tables on DLRM)."""
    pytest.importorskip("torch")
    from unity_pcg import zoo
    model = zoo.export(name, str(tmp_path / f"{name}.onnx"), size="tiny", batch=batch)
    losses = {}
    for strat, machine in ((strategy, "summit:1x2"), ("none", "summit:1x1")):
        plan = str(tmp_path / f"{strat}.json")
        assert main(["simulate", model, "--machine", machine, "--strategy", strat, "-o", plan]) == 0
        capsys.readouterr()
        nproc = "2" if strat != "none" else "1"
        assert main(["run", plan, "--model", model, "--steps", "3", "--nproc", nproc, "--json",
                     "--loss", "mean"]) == 0
        losses[strat] = json.loads(capsys.readouterr().out)["losses"]
    assert losses[strategy] == pytest.approx(losses["none"], rel=1e-4, abs=1e-6)
