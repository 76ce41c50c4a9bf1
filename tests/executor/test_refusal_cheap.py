"""``executor_refusal`` (search/runnable.py) without the plan's search statistics in its JSON round trip and
with its memo of recent checks refuses exactly what loading the whole plan file does (``run``'s check)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tests.executor.runtime_plans import dp_plan, pipeline_plan, tiny_mlp_onnx
from unity_pcg import plan as P
from unity_pcg.errors import UnityError
from unity_pcg.search import runnable


def _old_refusal(plan) -> str | None:
    """The check as it was: the whole plan through the JSON text, as `run` loads it from the file."""
    from unity_pcg.executor.launch import plan_world
    from unity_pcg.executor.pipeline import check_pipeline
    try:
        loaded = P.from_json(json.loads(json.dumps(plan.to_json())))
        plan_world(loaded)
        if loaded.pipeline is not None:
            check_pipeline(loaded, per_device_bn=False)
    except UnityError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusal")
    model = tiny_mlp_onnx(str(d / "m.onnx"))
    dp = P.load(dp_plan(model, str(d / "dp.json")))
    pipe = P.load(pipeline_plan(model, str(d / "pipe.json")))
    bad_m = dataclasses.replace(pipe, pipeline=dict(pipe.pipeline, micro_batches=3))      # 3 does not divide 8
    bad_dev = dataclasses.replace(pipe, pipeline=dict(pipe.pipeline, stages=[dict(s, devices=[9])
                                                                             for s in pipe.pipeline["stages"]]))
    bad_sched = dataclasses.replace(pipe, pipeline=dict(pipe.pipeline, schedule="GPipe"))
    no_views = dataclasses.replace(dp, views={})
    big_info = dataclasses.replace(dp, info={"search": {"big": list(range(1000))}})
    return {"dp": dp, "pipe": pipe, "bad_m": bad_m, "bad_dev": bad_dev, "bad_sched": bad_sched,
            "no_views": no_views, "big_info": big_info}


def test_same_answers_as_the_full_round_trip(plans):
    runnable._CHECKED.clear()
    answers = {k: runnable.executor_refusal(p) for k, p in plans.items()}
    assert answers == {k: _old_refusal(p) for k, p in plans.items()}
    assert answers["dp"] is None and answers["pipe"] is None and answers["big_info"] is None
    assert all(answers[k] for k in ("bad_m", "bad_dev", "bad_sched", "no_views"))
    # again, from the memo: the same answers (a changed field is a new key, not the memo's answer)
    assert {k: runnable.executor_refusal(p) for k, p in plans.items()} == answers


def test_memo_is_keyed_on_the_fields(plans):
    runnable._CHECKED.clear()
    pipe = plans["pipe"]
    assert runnable.executor_refusal(pipe) is None
    bad = dataclasses.replace(pipe, pipeline=dict(pipe.pipeline, micro_batches=3))
    assert runnable.executor_refusal(bad) == _old_refusal(bad) is not None
    assert len(runnable._CHECKED) == 2
