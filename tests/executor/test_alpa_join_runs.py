"""Alpa's formerly unjoinable plans train as one process does (issue 18 points 3 and 7, slow: 4 gloo processes).

* The masked decoder of ``tests/search/test_alpa_join.py`` on local:1x4 in two stages of one micro-batch: the
  plan whose stages did not join ("a tensor with 2 copies crosses a stage boundary ...") now joins and trains.
* transformers' BERT (dynamo export) on local:1x4 in three stages (2 + 1 + 1 devices): the model's first output
  (the loss) is made in the 2-device first stage and relayed to the 1-device last stage, which read it in two
  pieces on one device ("view @3 has 1 devices for 2 tasks"); the last stage now gathers it first.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tests.executor.runtime_plans import one_device_plan
from tests.executor.test_alpa_runnable import _train
from tests.search.test_alpa_join import alpa_plan_file, export_masked_decoder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(model: str, tmp_path, capfd, **kw):
    from unity_pcg.search.runnable import executor_refusal
    ar, plan = alpa_plan_file(model, "local:1x4", **kw)
    assert plan.pipeline is not None and executor_refusal(plan) is None
    plan.save(str(tmp_path / "alpa.json"))
    got = _train(str(tmp_path / "alpa.json"), model, capfd)
    ref = _train(one_device_plan(model, str(tmp_path / "one.json")), model, capfd)
    assert len(got) == 3
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
    return ar


@pytest.mark.slow
def test_masked_decoder_two_stages_train_like_one_process(tmp_path, capfd):
    model = export_masked_decoder(str(tmp_path / "masked.onnx"))
    ar = _check(model, tmp_path, capfd, max_stages=2, micro_batches=1)
    assert len(ar.stages) == 2


@pytest.mark.slow
def test_bert_loss_relayed_to_a_smaller_last_stage_trains_like_one_process(tmp_path, capfd):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from export_models import export_one
    rec = export_one("transformers", "bert", "dynamo")
    assert rec["status"] in ("ok", "cached"), rec.get("error")
    ar = _check(os.path.join(ROOT, "benchmarks", rec["file"]), tmp_path, capfd, max_stages=3, micro_batches=1)
    assert [s["shape"][0] * s["shape"][1] for s in ar.stages] == [2, 1, 1]
