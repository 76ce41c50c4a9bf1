"""Megatron-LM with sequence parallelism, as the ``megatron(..., sequence_parallel=True)`` builder lays it
out (search/baselines.py), trains equal to one process: the zoo's tiny Llama-style decoder (RMSNorm,
SwiGLU, rotary, grouped-query attention) on 2 gloo processes (tp 2), and on 4 (tp 2 x dp 2, slow); every
rank runs each group's reduce-scatter and all-gather as DTensor redistributions."""
from __future__ import annotations

import os

import pytest

from unity_pcg.search.baselines import megatron

from . import dist_helpers as H

STEPS = 3


def _zoo(name: str, batch: int) -> str:
    from unity_pcg import zoo
    path = os.path.join(H.model_dir(), f"zoo_{name}_{batch}.onnx")
    if not os.path.exists(path):
        zoo.export(name, path, size="tiny", batch=batch)
    return path


def _sp_plan(world: int, tp: int):
    path = _zoo("llama_7b", 4)
    g = H.load(path)
    pg = megatron(g, world, tp, sequence_parallel=True)
    assert pg.meta["sp"] and pg.meta["tp"] == tp and not pg.meta["fallbacks"]
    return H.make_plan(pg, path, world), path


def _check(world: int, tp: int) -> None:
    plan, path = _sp_plan(world, tp)
    ref = H.reference(path, STEPS, optimizer="adam", lr=0.01)
    got = H.run_cases(world, [H.case(plan, path, steps=STEPS, optimizer="adam", lr=0.01)], timeout=300)
    H.assert_same(ref, got[0], what=f"llama sequence parallel on {world}")


def test_sequence_parallel_lowers_to_one_reduce_scatter_and_one_all_gather_per_group():
    """Per block: two reduce-scatters (attention and MLP outputs onto the sequence) and two all-gathers
    (the normed residual into Q/K/V and into the gated MLP), nothing else moves activations."""
    torch = pytest.importorskip("torch")  # noqa: F841
    from unity_pcg.executor.lower import lower
    plan, _ = _sp_plan(2, 2)
    blocks = sum(1 for n in plan.pcg.nodes() if n.op == "Softmax")
    for rank in range(2):
        low = lower(plan.pcg, plan.views, rank, 2, plan.machine)
        kinds = sorted(rd.kind for _, rd in low.redistributions())
        assert kinds == ["all_gather"] * (2 * blocks) + ["reduce_scatter"] * (2 * blocks), kinds


def test_sequence_parallel_two_processes_equal_one():
    pytest.importorskip("torch")
    _check(2, 2)


@pytest.mark.slow
def test_sequence_parallel_four_processes_equal_one():
    pytest.importorskip("torch")
    _check(4, 2)
