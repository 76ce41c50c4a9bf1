"""benchmarks/every_plan_runs.py without torchrun: where the one-process reference diverges at lr 0.01, the
reference is measured again at the lr whose first update is small relative to the weights (probed), then
smaller while still not finite; the plans run at that lr; reports say the strategy and the lr.  Fake ``run``
callables stand in for the CLI."""
import importlib.util
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def epr():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("every_plan_runs", os.path.join(ROOT, "benchmarks",
                                                                                  "every_plan_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NAN_ERR = "unity-pcg run: error: step 2: loss is nan; stopped; no checkpoint was written"


def fake_run(max_ok_lr, losses=(1.0, 0.9, 0.8)):
    """A one-process run whose loss is finite at lr <= max_ok_lr, else exits 4 at step 2; records the lrs."""
    calls = []

    def run_at(lr):
        calls.append(lr)
        if lr <= max_ok_lr:
            return 0, list(losses), ""
        return 4, None, NAN_ERR
    return run_at, calls


def test_finite_reference_runs_once_at_the_default_lr(epr):
    run_at, calls = fake_run(1.0)
    got, lr, why = epr.reference_losses(run_at, lambda: pytest.fail("no probe for a finite reference"))
    assert (got, lr, why) == ([1.0, 0.9, 0.8], epr.LR, None) and calls == [epr.LR]


def test_divergent_reference_retries_at_the_probed_lr(epr):
    # gradient norm 1e11, weights 68: the probed lr moves the weights by REL_UPDATE of their norm
    want = epr.REL_UPDATE * 68.0 / 1e11
    run_at, calls = fake_run(want * 1.000001)
    got, lr, why = epr.reference_losses(run_at, lambda: (1e11, 68.0))
    assert why is None and got == [1.0, 0.9, 0.8]
    assert lr == pytest.approx(want) and calls == [epr.LR, lr]


def test_still_divergent_divides_by_100_then_gives_up_with_the_reason(epr):
    want = epr.REL_UPDATE * 1.0 / 1e3
    run_at, calls = fake_run(want / 100 * 1.000001)
    got, lr, why = epr.reference_losses(run_at, lambda: (1e3, 1.0))
    assert why is None and lr == pytest.approx(want / 100) and len(calls) == 3
    run_at, calls = fake_run(0.0)
    got, lr, why = epr.reference_losses(run_at, lambda: (1e3, 1.0))
    assert got is None and len(calls) == 1 + epr.LR_TRIES and "loss is nan" in why and f"{lr:.3g}" in why


def test_no_probe_or_other_failures_keep_their_reason(epr):
    run_at, calls = fake_run(0.0)
    got, lr, why = epr.reference_losses(run_at, lambda: None)
    assert got is None and lr == epr.LR and "no finite gradient" in why and calls == [epr.LR]
    got, lr, why = epr.reference_losses(lambda lr: (2, None, "unity-pcg run: error: bad plan"),
                                        lambda: pytest.fail("not a divergence"))
    assert got is None and why == "one-process run: unity-pcg run: error: bad plan"


def test_choose_lr_and_nonfinite(epr):
    assert epr.choose_lr(0.01, 2.0, 1.0, rel=1e-3) == pytest.approx(5e-4)
    assert epr.choose_lr(0.01, 1e-9, 1.0) == 0.01                     # never above the default
    assert epr.choose_lr(0.01, math.inf, 1.0) is None and epr.choose_lr(0.01, 0.0, 1.0) is None
    assert epr.nonfinite(4, "", None) and epr.nonfinite(1, "step 3: loss is -inf; stopped", None)
    assert epr.nonfinite(0, "", [1.0, math.nan]) and not epr.nonfinite(0, "", [1.0, 2.0])
    assert not epr.nonfinite(2, "error: no such file", None)


def test_update_norms_from_two_model_files(epr, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    def model(w, c):
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "c"],
                                                                                               ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
        return helper.make_model(g)
    w0 = np.array([[3.0, 0.0], [0.0, 4.0]], np.float32)
    c = np.ones(2, np.float32)
    onnx.save(model(w0, c), str(tmp_path / "a.onnx"))
    onnx.save(model(w0 - 0.5 * np.array([[1.0, 2.0], [2.0, 4.0]], np.float32), c), str(tmp_path / "b.onnx"))
    g, w = epr.update_norms(str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx"), lr=0.5)
    assert g == pytest.approx(5.0) and w == pytest.approx(5.0)       # c did not move: not counted
    assert epr.update_norms(str(tmp_path / "a.onnx"), str(tmp_path / "a.onnx")) is None


def test_report_names_strategy_and_lr(epr):
    meta = {"measured": "now", "budget_s": 15.0, "machines": ["local:1x4"], "strategy": "alpa", "steps": 3}
    rows = [{"model": "m", "exporter": "shipped", "machine": "local:1x4", "kind": "pipeline 2 stages",
             "chosen": "alpa", "lr": 4.7e-13, "steps": 3, "ok": True, "reason": "",
             "losses": [1.0, 1.0, 1.0], "reference": [1.0, 1.0, 1.0]},
            {"model": "n", "exporter": "shipped", "machine": "local:1x4", "kind": "-", "steps": 0, "ok": False,
             "reason": "run: boom", "max_rel": None}]
    md = epr.render(meta, rows)
    assert "`optimize --strategy alpa`" in md and "**1 of 2 plans" in md
    assert "| pipeline 2 stages [alpa] | 4.7e-13 | 3 |" in md and f"| {epr.LR:.3g} | 0 |" in md
