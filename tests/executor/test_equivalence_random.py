"""Plans no one wrote by hand: random sequences of proven rules from the shipped cache applied to tiny
models, mapped by the machine mapper, trained on 2 gloo processes; losses and final weights equal
single-process training (relative 1e-4).  A few examples by default, more under ``-m slow``."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from . import dist_helpers as H
from . import models

_REFS: dict = {}
MODELS = ("mlp_nobias", "attention", "dropout_mlp", "convnet")


def _applications(g, rules, degrees=(2,)):
    from unity_pcg.substitutions.apply import try_apply
    from unity_pcg.substitutions.match import GraphIndex, find_matches
    idx = GraphIndex(g)
    out = []
    for r in rules:
        for m in find_matches(r, g, idx, limit=8, degrees=degrees):
            out.append((r.name, m))
    return out, try_apply


def _random_plan(data, world: int, max_steps: int):
    from unity_pcg.substitutions import cache
    name = data.draw(st.sampled_from(MODELS), label="model")
    path = getattr(models, name)()
    g = H.load(path)
    rules = cache.load().rules
    applied = []
    for _ in range(data.draw(st.integers(1, max_steps), label="steps")):
        apps, try_apply = _applications(g, rules, (2,) if world == 2 else (2, 4))
        if not apps:
            break
        k = data.draw(st.integers(0, len(apps) - 1), label="application")
        out = try_apply(g, apps[k][1])
        if out is None:
            continue
        g = out
        applied.append(apps[k][0])
    assume(applied)
    return name, path, g, applied


def _check(data, world: int, max_steps: int) -> None:
    name, path, g, applied = _random_plan(data, world, max_steps)
    plan = H.make_plan(g, path, world, strict=False)
    assume(plan is not None)           # e.g. two nested degree-2 splits need 4 devices
    if path not in _REFS:
        _REFS[path] = H.reference(path, 5)
    got = H.run_cases(world, [H.case(plan, path)])[0]
    H.assert_same(_REFS[path], got, what=f"{name} after rules {applied}")


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                 derandomize=True)


@settings(max_examples=4, **_SETTINGS)
@given(st.data())
def test_random_rule_sequences_train_as_one_device(data):
    _check(data, world=2, max_steps=3)


@pytest.mark.slow
@settings(max_examples=60, **_SETTINGS)
@given(st.data())
def test_random_rule_sequences_train_as_one_device_many(data):
    _check(data, world=2, max_steps=6)


@pytest.mark.slow
@settings(max_examples=30, **_SETTINGS)
@given(st.data())
def test_random_rule_sequences_train_as_one_device_four_processes(data):
    _check(data, world=4, max_steps=5)
