"""The tiny zoo models (unity_pcg.zoo) trained with a data-parallel plan on 2 gloo processes equal
single-process training (3 steps, losses and weights).  DLRM and CANDLE-Uno by default; the others,
and the Megatron (BERT) and expert (DLRM, XDL, CANDLE-Uno) baseline plans, under ``-m slow``.

Inception-v3 is left out on purpose: its tiny configuration trains ill-conditioned in float32 (merely
permuting the samples of the batch -- the same mathematics -- moves the third loss by 1% and weights
by 0.17 on one process), so no plan can be held to 1e-4 against it.
"""
from __future__ import annotations

import os

import pytest

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H


def _zoo(name: str, batch: int | None = None) -> str:
    from unity_pcg import zoo
    path = os.path.join(H.model_dir(), f"zoo_{name}_{batch}.onnx")
    if not os.path.exists(path):
        zoo.export(name, path, size="tiny", batch=batch)
    return path


def _check(names, world: int = 2, atol: float = 1e-6, strategy: str = "dp") -> None:
    from unity_pcg.search.baselines import build_strategy
    cases, refs = [], []
    for name, batch in names:
        path = _zoo(name, batch)
        g = H.load(path)
        refs.append(H.reference(path, 3))
        pg = data_parallel(g, world) if strategy == "dp" else build_strategy(g, strategy, world)
        cases.append(H.case(H.make_plan(pg, path, world), path, steps=3))
    got = H.run_cases(world, cases)
    for (name, _), r, o in zip(names, refs, got):
        H.assert_same(r, o, atol=atol, what=f"zoo {name} ({strategy})")


def test_zoo_dlrm_and_candle_uno_data_parallel():
    _check([("dlrm", None), ("candle_uno", None)])


@pytest.mark.slow
def test_zoo_models_data_parallel():
    _check([("mlp", None), ("xdl", None), ("bert_large", None)])
    # BatchNorm statistics over 4 samples per device; weights of magnitude 1e-3 differ at float32 noise
    _check([("resnext50", 8)], atol=2e-5)
    _check([("bert_large", None)], strategy="megatron")
    _check([("dlrm", None), ("xdl", None), ("candle_uno", None)], strategy="expert")
