"""Alpa's chosen stages join into one plan (issue 18 points 3 and 7).

The failure this guards: ``--strategy alpa`` on transformers' GPT-2, Llama and T5 encoder (legacy exports) on
local:1x4 ended in "cannot join the stages: a tensor with 2 copies crosses a stage boundary into a stage that
partitions it differently".  The first stage's ILP left a cheap tensor it sends on (the attention mask's bias)
replicated over its 2 devices; the next stage reads it split by batch, and no parallel operator drops copies.
A stage before the last now leaves its outputs without copies (``solve_intra(copy_free_outputs=True)``), a
stage plan that still has a copied output is priced ``inf`` (so the stage DP never picks it), and a chosen plan
that does not join anyway is replaced by the DP's next best.  The model here is a small decoder with such a
mask bias, exported by torch's legacy exporter.
"""
from __future__ import annotations

import functools

import pytest

B, S, H, V = 4, 8, 16, 50


def export_masked_decoder(path: str) -> str:
    """Two attention-like blocks whose scores add ``(1 - mask) * -1e4`` (computed once, read by both) and MLPs."""
    import torch
    from torch import nn

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(V, H)
            self.q = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])
            self.k = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])
            self.f1 = nn.ModuleList([nn.Linear(H, 4 * H) for _ in range(2)])
            self.f2 = nn.ModuleList([nn.Linear(4 * H, H) for _ in range(2)])
            self.out = nn.Linear(H, 4)

        def forward(self, ids, mask):
            bias = (1.0 - mask[:, None, :].float()) * -1e4
            x = self.emb(ids)
            for i in range(2):
                a = torch.softmax(self.q[i](x) @ self.k[i](x).transpose(1, 2) + bias, -1)
                x = x + a @ x
                x = x + self.f2[i](torch.relu(self.f1[i](x)))
            return self.out(x)

    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, S, dtype=torch.long)
    with torch.no_grad():
        torch.onnx.export(Masked().eval(), (ids, mask), path, input_names=["ids", "mask"], output_names=["y"],
                          dynamo=False, opset_version=17)
    return path


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    return export_masked_decoder(str(tmp_path_factory.mktemp("alpa_join") / "masked.onnx"))


def alpa_plan_file(path: str, machine: str, **kw):
    """(AlpaResult, Plan) of Alpa's plan of the model at ``path``, as ``optimize`` writes it."""
    from unity_pcg import plan as P
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.alpa.inter import alpa_plan
    g = load_onnx(path, load_weights=False)
    m = parse_machine(machine)
    ar = alpa_plan(g, m, time_limit_s=5.0, **kw)
    p = ar.pipeline
    return ar, P.Plan(path, P.file_sha256(path), m, p.pcg, p.views, p.to_json(), p.to_plan_field())


def _copied_outputs(pg) -> list:
    return [r for r in pg.outputs if pg.shape(tuple(r)).copy_degree > 1 and pg.node(r[0]).kind != "source"]


def test_a_first_stage_solved_for_joining_sends_no_copies(masked):
    """Some first stage of the model, solved alone on a 1x2 mesh, sends a tensor in 2 copies (the cause of the
    failed joins); asked for copy-free outputs, no first stage does (or the ILP says it cannot)."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search import pipeline as P
    from unity_pcg.search.alpa.inter import cluster_operators
    from unity_pcg.search.alpa.intra import IntraInfeasible, solve_intra
    from unity_pcg.search.cost import CostModel, GraphCost
    g = load_onnx(masked, load_weights=False)
    m = parse_machine("local:1x4")
    roles = GraphCost(g, CostModel(m)).role
    lay, info = cluster_operators(g, roles, 8, 0.5)
    assert len(lay) >= 3
    copied = 0
    for k in range(1, len(lay)):
        sg = P.stage_graph(g, roles, [n for u in range(lay[0][0], lay[k - 1][1]) for n in info.units[u]])
        free = solve_intra(sg, m, (1, 2), price=False)
        copied += bool(_copied_outputs(free.pcg))
        try:
            plan = solve_intra(sg, m, (1, 2), price=False, copy_free_outputs=True)
        except IntraInfeasible:
            continue
        assert not _copied_outputs(plan.pcg)
        assert plan.objective >= free.objective - 1e-12      # a constraint: never cheaper than the free ILP
    assert copied, "no first stage sends copies: the model no longer reproduces the failed join"


def test_alpa_two_stage_plan_joins_and_passes_the_executor_check(masked):
    """On local:1x4 with two stages of one micro-batch (the plan that did not join), the stages join: the plan
    has a PCG, no ``stitch_error``, and the executor's pre-launch check accepts it."""
    from unity_pcg.search.runnable import executor_refusal
    ar, plan = alpa_plan_file(masked, "local:1x4", max_stages=2, micro_batches=1)
    assert ar.feasible and ar.pipeline.pcg is not None and "stitch_error" not in ar.stats
    assert len(ar.stages) == 2
    assert executor_refusal(plan) is None


def test_a_stage_plan_with_copied_outputs_is_never_picked(masked):
    """With a ``solve`` callback that knows nothing of joining (the raw ILP), the stages whose plans send copies
    are priced inf before the stage DP chooses, so the plan it picks still joins."""
    from unity_pcg.search.alpa.intra import solve_intra
    from unity_pcg.search.runnable import executor_refusal

    def raw(g, machine, mesh, *, start=0, optimizer="adam", memory_budget=None, weight_update_sharding=False,
            time_limit_s=30.0, deadline=None):
        return solve_intra(g, machine, mesh, start=start, optimizer=optimizer, memory_budget=memory_budget,
                           weight_update_sharding=weight_update_sharding, time_limit_s=time_limit_s,
                           deadline=deadline, price=False)
    ar, plan = alpa_plan_file(masked, "local:1x4", max_stages=2, micro_batches=1, solve=raw)
    assert ar.feasible and ar.pipeline.pcg is not None and "stitch_error" not in ar.stats
    assert executor_refusal(plan) is None


def test_a_chosen_plan_that_does_not_join_is_replaced_by_the_next_best(masked, monkeypatch):
    """A join that fails anyway (here forced: no stage may start at the layer the DP's first choice starts its
    second stage at) makes the planner price that stage inf and take the DP's next best, which joins."""
    from unity_pcg.search import pipeline as P
    first, _ = alpa_plan_file(masked, "local:1x2", micro_batches=2)
    assert len(first.stages) >= 2
    bad = first.stages[1]["layers"][0]
    plain = P._stitch_stage

    def refuse(b, idx, p, plan, *a, **kw):
        if idx >= 1 and plan[idx][0] == bad:
            raise P.PipelineError("refused by the test")
        return plain(b, idx, p, plan, *a, **kw)
    monkeypatch.setattr(P, "_stitch_stage", refuse)
    ar, _ = alpa_plan_file(masked, "local:1x2", micro_batches=2)
    assert ar.stats.get("join_retries", 0) >= 1
    assert ar.pipeline.pcg is not None and "stitch_error" not in ar.stats
    assert all(st["layers"][0] != bad for st in ar.stages[1:])


def test_copy_free_outputs_reaches_only_a_solve_that_takes_it():
    from unity_pcg.search.alpa.inter import _accepts, _default_solve
    assert _accepts(_default_solve(), "copy_free_outputs")
    assert not _accepts(lambda g, **kw: None, "copy_free_outputs")     # passing **kw on is not taking it
    assert not _accepts(functools.partial(lambda g, *, start=0: None), "copy_free_outputs")
