"""Alpa's plans run (issue 18 points 3 and 7): ``optimize --strategy alpa`` returns a plan ``unity-pcg run``
accepts, and it trains as one process does.

Two ways an Alpa plan used to be refused by the executor's pre-launch check:

* micro-batching through a batch-sized tensor that does not follow the batch (a constant the exporter folded at
  its batch: BERT's token-type ids ``expand`` [B, S], an ALiBi bias).  At a micro-batch of 1 the sizes still
  broadcast ([1, S, H] + [B, S, H]), so ``search.pipeline.rebatch`` built a stage graph that spreads one
  sample over the constant's rows, Alpa's planner priced it and the executor's ``micro_graph`` refused the
  plan.  ``rebatch`` now refuses it (``broadcast_change``), so the planner never offers that count.  A true
  size-1 broadcast ([1, S, H], a parameter) needs no split and runs at any micro-batch, 1 included;
* BatchNorm in a pipelined plan (Alpa's plans always carry a pipeline field): ``optimize`` now returns, instead
  of a refused plan, the same plan without its pipeline field when it is one stage of one micro-batch, else the
  data-parallel floor, and says so in ``info.search.chosen``.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.executor import models
from tests.executor.runtime_plans import one_device_plan
from tests.search.test_alpa_join import alpa_plan_file as _plan

B, S, H = 4, 4, 8


def _embed_module(token_types: bool):
    """Token embedding + (optionally) token-type embedding of a buffer expanded to the batch (folded by the
    importer into a [B, S] constant) + a [1, S, H] position parameter (a true broadcast), then an MLP."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.tt = nn.Embedding(10, H), nn.Embedding(2, H)
            self.register_buffer("tt_ids", torch.zeros(1, S, dtype=torch.long))
            self.pos = nn.Parameter(torch.randn(1, S, H))
            self.a, self.b, self.c = nn.Linear(H, 16), nn.Linear(16, H), nn.Linear(H, 4)

        def forward(self, ids):
            b, s = ids.shape
            x = self.emb(ids) + self.pos
            if token_types:
                x = x + self.tt(self.tt_ids.expand(b, s))
            x = x + self.b(torch.relu(self.a(x)))
            return self.c(x)
    return Embed().eval()


def _export(module, path: str) -> str:
    import torch
    ids = torch.randint(0, 10, (B, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.onnx.export(module, (ids,), path, input_names=["ids"], output_names=["y"], dynamo=False,
                          opset_version=17)
    return path


@pytest.fixture(scope="module")
def embeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("alpa_embed")
    return d, {k: _export(_embed_module(k == "folded"), str(d / f"{k}.onnx")) for k in ("folded", "broadcast")}


def _train(plan_path: str, model: str, capfd, steps: int = 3) -> list:
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", plan_path, "--model", model, "--steps", str(steps), "--loss", "mean", "--optimizer", "sgd",
               "--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    return json.loads(out)["losses"]


def test_a_micro_batch_of_one_does_not_broadcast_against_a_folded_batch_constant(embeds):
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.pipeline import PipelineError, rebatch
    _, paths = embeds
    g = load_onnx(paths["folded"], load_weights=False)
    with pytest.raises(PipelineError, match="does not follow the batch"):
        rebatch(g, B, 1)                      # [1, S, H] + [B, S, H] broadcast: not the same computation
    with pytest.raises(PipelineError):
        rebatch(g, B, 2)                      # [2, S, H] + [B, S, H]: sizes refuse it already
    # a true size-1 broadcast (the [1, S, H] parameter) follows any batch, 1 included, both ways
    h = load_onnx(paths["broadcast"], load_weights=False)
    assert rebatch(rebatch(h, B, 1), 1, B).structural_hash() == h.structural_hash()


def test_alpa_offers_no_micro_batch_count_the_executor_refuses(embeds):
    """Forced to B micro-batches, Alpa has no plan (it used to return one check_pipeline refuses); offered
    1 and B it keeps 1, and the plan passes the executor's pre-launch check."""
    from unity_pcg.search.alpa.inter import AlpaError
    from unity_pcg.search.runnable import executor_refusal
    _, paths = embeds
    with pytest.raises(AlpaError):
        _plan(paths["folded"], "local:1x2", micro_batches=B)
    ar, plan = _plan(paths["folded"], "local:1x2", micro_batches=[1, B])
    assert ar.stats["micro_batches_tried"] == [1] and ar.micro_batches == 1
    assert executor_refusal(plan) is None


def test_alpa_plan_with_a_size_one_broadcast_at_micro_batch_one_trains_like_one_process(embeds, capfd):
    """The [1, S, H] parameter meets micro-batches of one sample in Alpa's 2-stage plan on local:1x2 (the
    size-1 dim broadcasts, no split): 2 processes train 3 steps to the one-process losses."""
    from unity_pcg.search.runnable import executor_refusal
    d, paths = embeds
    model = paths["broadcast"]
    ar, plan = _plan(model, "local:1x2", micro_batches=B)
    assert ar.micro_batches == B and plan.pipeline is not None and executor_refusal(plan) is None
    plan.save(str(d / "alpa.json"))
    got = _train(str(d / "alpa.json"), model, capfd)
    ref = _train(one_device_plan(model, str(d / "one.json")), model, capfd)
    assert len(got) == 3
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)


def test_optimize_alpa_never_returns_a_plan_the_executor_refuses(tmp_path, capfd, monkeypatch):
    """A BatchNorm model: Alpa's pipelined plan is refused by the executor.  ``optimize --strategy alpa``
    returns the data-parallel floor instead (two stages), or Alpa's own plan without its pipeline field (one
    stage of one micro-batch), says so, and that plan trains as one process does."""
    import unity_pcg.search.alpa.inter as inter
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.runnable import executor_refusal
    model = models.convnet()
    r = optimize(model, "local:1x2", budget_s=5, strategy="alpa")
    assert executor_refusal(r.plan) is None
    rec = r.stats["executor_check"]
    assert rec == "ok" or ("BatchNorm" in rec["refused"] and "the executor refuses alpa" in r.stats["chosen"])

    plain = inter.alpa_plan

    def one_stage(*a, **kw):
        return plain(*a, **dict(kw, max_stages=1, micro_batches=1))
    monkeypatch.setattr(inter, "alpa_plan", one_stage)
    r = optimize(model, "local:1x2", budget_s=5, strategy="alpa")
    assert executor_refusal(r.plan) is None and r.plan.pipeline is None
    assert "BatchNorm" in r.stats["executor_check"]["refused"]
    assert r.stats["chosen"] == "alpa without its pipeline field (one stage, one micro-batch)"
    assert r.plan.info["search"]["chosen"] == r.stats["chosen"]
    r.plan.save(str(tmp_path / "alpa.json"))
    got = _train(str(tmp_path / "alpa.json"), model, capfd)
    ref = _train(one_device_plan(model, str(tmp_path / "one.json")), model, capfd)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)
