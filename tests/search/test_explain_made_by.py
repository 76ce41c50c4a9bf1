"""`explain` names what made a plan: for `simulate --strategy megatron` the configuration its tuned grid chose
(the one `simulate` reports), for `optimize` the mechanism the search names (info.search.chosen)."""
from __future__ import annotations

import json

import pytest

from unity_pcg import plan as P
from unity_pcg.cli import main
from unity_pcg.explanation import explain, format_text


def test_explain_names_the_tuned_configuration_simulate_chose(tmp_path, capsys):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    model = zoo.export("llama_7b", str(tmp_path / "llama.onnx"), size="tiny", batch=8)
    out_plan = str(tmp_path / "megatron.json")
    assert main(["simulate", model, "--machine", "h100:1x4", "--strategy", "megatron", "--budget", "20",
                 "--json", "-o", out_plan]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["tuned"]["chosen"]
    c = out["megatron_config"]
    assert chosen.startswith(f"tp{c['tp']} pp{c['pp']} dp{c['dp']} mbs{c['micro_batch']} x{c['micro_batches']}")
    e = explain(P.load(out_plan))
    assert e.totals["made_by"].startswith(f"megatron (tuned): {chosen},")
    assert f"made by: megatron (tuned): {chosen}," in format_text(e, sections=["summary"])


def test_explain_names_the_search_mechanism(tmp_path):
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.split import synthetic_transformer
    g = synthetic_transformer(1, batch=8, seq=16, hidden=32, heads=2)
    r = optimize(g, "local:1x2", budget_s=5)
    chosen = r.plan.info["search"]["chosen"]
    assert explain(r.plan).totals["made_by"] == f"unity: {chosen}"


def test_explain_of_a_micro_batched_plan_names_its_memory_techniques_not_the_whole_batch_as_infeasible():
    """A plan that fits only as micro-batches with its memory techniques (ZeRO-3 and recomputation on 90 MiB
    devices): explain says which techniques it runs and that the whole batch at once (what it re-prices) does
    not fit, never that the plan is infeasible."""
    import dataclasses

    from unity_pcg.machine import parse_machine
    from unity_pcg.search.optimize import optimize
    from unity_pcg.search.split import synthetic_transformer
    g = synthetic_transformer(2, batch=16, seq=1024, hidden=256, heads=4)
    m = parse_machine("h100:1x2")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=90 * 2**20), host_memory_bytes=0)
    r = optimize(g, m, budget_s=20, strategy="zero3")
    assert r.feasible and r.plan.pipeline is not None and r.plan.memory is not None
    text = format_text(explain(r.plan), sections=["summary"])
    assert "memory techniques: ZeRO-3" in text and "recomputed" in text
    assert "INFEASIBLE" not in text and "the whole batch at once, without the plan's techniques" in text
