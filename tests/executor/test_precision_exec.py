"""The plan's precision at run time (executor/precision.py): bf16 runs the forward under autocast with float32
parameters, gradients and optimizer states; a data-parallel bf16 plan trains as one bf16 process does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H
from . import models


def _with_precision(plan, precision):
    return dataclasses.replace(plan, precision=precision)


def test_bf16_plan_runs_matmuls_in_bf16_and_keeps_float32_state():
    from unity_pcg.executor.train import Trainer
    path = models.mlp()
    g = H.load(path)
    base = H.logical_plan(g, path)
    t32 = Trainer(base, path, lr=0.05)
    t16 = Trainer(_with_precision(base, "bf16"), path, lr=0.05)
    t16.keep_values = t32.keep_values = True
    l32 = [t32.step() for _ in range(3)]
    l16 = [t16.step() for _ in range(3)]
    dtypes = {v.dtype for v in t16.last_values.values()}
    assert torch.bfloat16 in dtypes                     # autocast ran the matmuls in bf16
    assert torch.bfloat16 not in {v.dtype for v in t32.last_values.values()}
    assert all(p.dtype == torch.float32 for p in t16.params.values())
    assert all(v.dtype == np.float32 for v in (x.numpy() for x in t16.model_state().values()))
    assert l16 != l32                                   # not the fp32 computation ...
    np.testing.assert_allclose(l16, l32, rtol=3e-2)     # ... but the same training, to bf16 accuracy


def test_bf16_data_parallel_two_processes_trains_as_one_bf16_process():
    path = models.mlp()
    g = H.load(path)
    ref = H.reference(path, 5)
    from unity_pcg.executor.train import Trainer
    t = Trainer(_with_precision(H.logical_plan(g, path), "bf16"), path, lr=0.05)
    ref16 = [t.step() for _ in range(5)]
    plan = _with_precision(H.make_plan(data_parallel(g, 2), path, 2), "bf16")
    (losses, state), = H.run_cases(2, [H.case(plan, path)])
    np.testing.assert_allclose(losses, ref16, rtol=1e-2)
    assert losses != ref[0]                            # it did run in bf16
    for k, v in t.model_state().items():
        np.testing.assert_allclose(state[k], v.numpy(), rtol=2e-2, atol=1e-3)


def test_bf16_pipeline_plan_is_refused_before_start():
    from unity_pcg.executor.pipeline import PipelineError, check_pipeline
    path = models.mlp()
    plan = _with_precision(H.logical_plan(H.load(path), path), "bf16")
    plan = dataclasses.replace(plan, pipeline={"schedule": "1F1B", "micro_batches": 2, "stages": []})
    with pytest.raises(PipelineError, match="bf16"):
        check_pipeline(plan)
