"""The pipeline search and the executor agree on what can be micro-batched and sent between stages, and
``optimize`` never returns a plan ``unity-pcg run`` refuses (issue 18 point 7; search/runnable.py).

The ALiBi pattern (BLOOM, MPT, Falcon-with-alibi exported with a fixed batch): a bias whose dim 0 is the batch
but which does not come from the batch (a constant the exporter folded) is added to the activations.
Sizes cannot tell it from a batch-derived tensor, and at a micro-batch of 1 it even broadcasts
(search/pipeline.py ``rebatch``, which the search used alone); the degrees of ``micro_graph`` (inputs split
M ways, weights copied) can, and both the search and the executor now use it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.executor.runtime_plans import one_device_plan, pipeline_plan
from unity_pcg import plan as P

B = 2


def _alibi_module():
    import torch
    from torch import nn

    class AlibiLike(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
            # input-independent, batch-sized: the folded ALiBi bias of an export at batch B
            self.register_buffer("alibi", torch.randn(B, 1, 32) * 0.1)

        def forward(self, x):
            h = torch.relu(self.l1(x)) + self.alibi
            h = torch.relu(self.l2(h)) + self.alibi
            return self.l3(h)
    return AlibiLike().eval()


def _int_input_module():
    import torch
    from torch import nn

    class LateMask(nn.Module):
        """An integer model input (a mask) first read after two layers."""
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.l3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

        def forward(self, x, mask):
            h = torch.relu(self.l2(torch.relu(self.l1(x))))
            return self.l3(h * mask.unsqueeze(-1).to(h.dtype))
    return LateMask().eval()


def _export(module, args, names, path) -> str:
    import torch
    with torch.no_grad():
        torch.onnx.export(module, args, path, input_names=names, output_names=["y"], dynamo=False,
                          opset_version=17)
    return path


@pytest.fixture(scope="module")
def alibi(tmp_path_factory):
    import torch
    d = tmp_path_factory.mktemp("alibi")
    return d, _export(_alibi_module(), (torch.randn(B, 4, 16),), ["x"], str(d / "alibi.onnx"))


def test_micro_graph_refuses_a_batch_sized_constant_that_sizes_accept(alibi):
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.pipeline import PipelineError, micro_graph, rebatch
    g = load_onnx(alibi[1], load_weights=False)
    # sizes: [1, 4, 32] + [2, 1, 32] broadcast -- the search's old test passed; the labels tell (broadcast_change)
    with pytest.raises(PipelineError, match="does not follow the batch"):
        rebatch(g, B, 1)
    with pytest.raises(PipelineError, match="cannot run through the model"):
        micro_graph(g, 2)
    assert micro_graph(g, 1) is not None


def test_pipeline_search_proposes_no_micro_batching_the_executor_refuses(alibi):
    """Forced to 2 micro-batches the search has nothing to offer (it used to offer a plan check_pipeline
    refused); with the counts it chooses, whatever it returns passes the executor's check."""
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import search_pipeline
    g = load_onnx(alibi[1], load_weights=False)
    m = parse_machine("local:1x2")
    assert search_pipeline(g, CostModel(m), min_stages=1, max_stages=2, micro_batches=[2]) is None
    r = search_pipeline(g, CostModel(m), min_stages=2, max_stages=2)
    assert r is not None and r.micro_batches == 1
    check_pipeline(P.Plan(alibi[1], P.file_sha256(alibi[1]), m, r.pcg, r.views, r.to_json(), r.to_plan_field()))


def test_no_cut_where_an_integer_input_is_still_to_be_read(tmp_path):
    """The executor sends model inputs along the stages and only floating tensors may cross: the search
    cuts nowhere before an integer input's last reader (search/pipeline.py may_cross)."""
    import torch
    from unity_pcg.executor.pipeline import check_pipeline
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.pipeline import search_pipeline, sequential_layers
    path = _export(_int_input_module(), (torch.randn(4, 16), torch.ones(4, dtype=torch.int64)), ["x", "mask"],
                   str(tmp_path / "late_mask.onnx"))
    g = load_onnx(path, load_weights=False)
    m = parse_machine("local:1x2")
    _, info = sequential_layers(g, GraphCost(g, CostModel(m)).role, 12)
    mask = next(n.id for n in g.sources("Input") if n.a["name"] == "mask")
    reader = max(u for u, nodes in enumerate(info.units)
                 if any(mask in (r[0] for r in g.node(nid).inputs) for nid in nodes))
    assert reader > 1 and not any(info.valid[1:reader + 1])
    r = search_pipeline(g, CostModel(m), min_stages=2, max_stages=2, micro_batches=1)
    if r is not None:
        check_pipeline(P.Plan(path, P.file_sha256(path), m, r.pcg, r.views, r.to_json(), r.to_plan_field()))


def test_runnable_falls_back_from_a_refused_plan(alibi, tmp_path):
    """A plan check_pipeline refuses (2 micro-batches through the ALiBi bias) is replaced by one the executor
    runs, and info.search.executor_check says what was refused and what came instead."""
    from unity_pcg.search.optimize import Evaluator
    from unity_pcg.search.runnable import executor_refusal, runnable
    from unity_pcg.onnx_import import load_onnx
    bad = P.load(pipeline_plan(alibi[1], str(tmp_path / "bad.json"), stages=2, micro_batches=2))
    assert "cannot run through the model" in executor_refusal(bad)
    stats: dict = {"chosen": "pipeline"}
    bad = P.Plan(bad.model_path, bad.model_sha256, bad.machine, bad.pcg, bad.views, bad.predicted, bad.pipeline,
                 {"search": stats}, None)
    g = load_onnx(alibi[1], load_weights=False)
    plan, final, steps, st = runnable(bad, None, [], stats, ev=Evaluator(bad.machine, "adam"), g=g)
    assert executor_refusal(plan) is None and plan.pipeline is None and final.feasible and steps == []
    rec = st["executor_check"]
    assert "cannot run through" in rec["refused"] and rec["returned"] == "none (one device)"
    assert plan.info["search"]["executor_check"] is rec and plan.info["search"]["chosen"].startswith("none")
    # without an evaluator the refusal is only recorded
    _, _, _, st2 = runnable(bad, None, [], {"chosen": "pipeline"})
    assert "returned" not in st2["executor_check"]


def test_optimize_plan_on_two_devices_runs_like_one_process(alibi, capfd):
    """optimize's plan for the ALiBi pattern on local:1x2 passes the executor's checks and trains 2 steps to
    the losses of the one-device plan on one process."""
    from unity_pcg.cli import main
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.runnable import executor_refusal
    d, model = alibi
    r = optimize(model, "local:1x2", budget_s=3)
    assert executor_refusal(r.plan) is None and r.stats["executor_check"] == "ok"
    r.plan.save(str(d / "opt.json"))
    one = one_device_plan(model, str(d / "one.json"))
    losses = []
    for p in (str(d / "opt.json"), one):
        capfd.readouterr()
        rc = main(["run", p, "--model", model, "--steps", "2", "--loss", "mean", "--optimizer", "sgd", "--json"])
        out, err = capfd.readouterr()
        assert rc == 0, err
        losses.append(json.loads(out)["losses"])
    assert len(losses[0]) == 2
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4, atol=1e-7)


def test_a_stage_without_parameters_trains(tmp_path, capfd):
    """A stage of parameter-free operators (a ReLU alone; the search gave ViT one holding a Reshape) has no
    optimizer parameters: it runs, and the pipeline trains as one process does."""
    from tests.executor.runtime_plans import reference_losses, tiny_mlp_onnx
    from unity_pcg.cli import main
    model = tiny_mlp_onnx(str(tmp_path / "mlp.onnx"))
    plan = pipeline_plan(model, str(tmp_path / "pp.json"), stages=5, micro_batches=2)
    g = P.load(plan).pcg
    assert [[g.node(n).op for n in st["nodes"] if g.node(n).kind == "compute"]
            for st in P.load(plan).pipeline["stages"]][1] == ["Relu"]
    capfd.readouterr()
    rc = main(["run", plan, "--model", model, "--steps", "2", "--loss", "mean", "--optimizer", "sgd", "--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    ref, _ = reference_losses(model, 2, "sgd")
    np.testing.assert_allclose(json.loads(out)["losses"], ref, rtol=1e-4, atol=1e-7)


def test_strided_sends_and_a_loss_computed_before_the_last_stage(tmp_path, capfd):
    """Stage 0 sends a Transpose's output (a strided view: gloo sends contiguous buffers only) and computes
    the model's first output, the loss, which the last stage must pass on (BERT's 2-stage plan had its
    pooler alone in the last stage): 2 processes train as one."""
    import torch
    from torch import nn
    from unity_pcg.cli import main

    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(4, 3)

        def forward(self, x):
            h = self.l1(x)
            t = torch.transpose(h, 1, 2)
            return h, self.l2(t * 2.0)
    model = _export(TwoOut().eval(), (torch.randn(4, 4, 8),), ["x"], str(tmp_path / "two.onnx"))
    plan = pipeline_plan(model, str(tmp_path / "pp.json"), stages=2, micro_batches=2)
    pl = P.load(plan)
    g = pl.pcg
    first = [g.node(n).op for n in pl.pipeline["stages"][0]["nodes"] if g.node(n).kind == "compute"]
    assert first[-1] == "Transpose" and g.outputs[0][0] in pl.pipeline["stages"][0]["nodes"]
    losses = []
    for p in (plan, one_device_plan(model, str(tmp_path / "one.json"))):
        capfd.readouterr()
        rc = main(["run", p, "--model", model, "--steps", "2", "--loss", "mean", "--optimizer", "sgd", "--json"])
        out, err = capfd.readouterr()
        assert rc == 0, err
        losses.append(json.loads(out)["losses"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4, atol=1e-7)
