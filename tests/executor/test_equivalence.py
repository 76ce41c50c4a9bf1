"""Training with a plan on 2 and 4 local gloo processes equals single-process training of the same
ONNX model: the losses of 5 steps and the final weights (relative 1e-4)."""
from __future__ import annotations

import pytest

from search.baselines import data_parallel

from . import dist_helpers as H
from . import models


def test_data_parallel_two_processes_equals_one():
    path = models.mlp()
    g = H.load(path)
    ref = H.reference(path, 5)
    ref_adam = H.reference(path, 5, optimizer="adam", lr=0.01)
    plan = H.make_plan(data_parallel(g, 2), path, 2)
    got = H.run_cases(2, [H.case(plan, path), H.case(plan, path, optimizer="adam", lr=0.01)])
    H.assert_same(ref, got[0], what="dp sgd")
    H.assert_same(ref_adam, got[1], what="dp adam")
    # the losses move: training happens
    assert ref[0][0] != ref[0][-1]
