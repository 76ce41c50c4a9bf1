"""Every plan runs (issue 18 point 7, slow): for every model of the import-coverage corpus this venv can export
(the transformers architectures at their small configs, both exporters, plus BLOOM's ALiBi decoder) and the
onnx wheel's light models, the plans ``optimize`` returns on local:1x2 and local:1x4 train 3 steps under
``unity-pcg run`` to the losses of the one-device plan on one process (|d| <= 1e-4 |ref| + 1e-6 per step).
The same cases as ``benchmarks/every_plan_runs.py`` (which writes the table), through the same CLI calls."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


def _bench():
    sys.path.insert(0, BENCH)      # export_models / import_coverage beside it
    spec = importlib.util.spec_from_file_location("every_plan_runs", os.path.join(BENCH, "every_plan_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _names() -> list[str]:
    sys.path.insert(0, BENCH)
    from export_models import HF_MODELS
    return HF_MODELS + ["bloom"]


@pytest.mark.slow
@pytest.mark.parametrize("name", _names())
def test_transformers_plans_train_like_one_process(name, tmp_path):
    pytest.importorskip("transformers")      # the exports need it (pip install transformers)
    B = _bench()
    recs = B.models([name], light=False, light_max_gflop=0)
    assert recs and all(r["error"] is None for r in recs), [r["error"] for r in recs]
    for rec in recs:
        for row in B.run_case(rec, ["local:1x2", "local:1x4"], 15.0, str(tmp_path)):
            assert row["ok"], f"{name} {row['exporter']} {row['machine']} ({row['kind']}): {row['reason']}"
            assert row["steps"] == B.STEPS


@pytest.mark.slow
def test_light_models_plans_train_like_one_process(tmp_path):
    B = _bench()
    for rec in B.models(["light_bvlc_alexnet", "light_squeezenet", "light_shufflenet"], light=True,
                        light_max_gflop=1.5):
        assert rec["error"] is None, rec["error"]
        for row in B.run_case(rec, ["local:1x2", "local:1x4"], 15.0, str(tmp_path)):
            assert row["ok"], f"{rec['model']} {row['machine']} ({row['kind']}): {row['reason']}"
