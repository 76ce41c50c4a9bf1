"""Megatron-LM's layout on a fused Q/K/V projection (issue 18, point 3): transformers' GPT-2 projects Q, K and V
with one Linear whose output is Split; :func:`split_fused_linears` rewrites it, exactly, into one Linear per
piece on a Slice of the one weight, so the head split applies to each piece (as Megatron-LM splits each of
Q, K and V by heads).  Both exporters; priced as a tensor-parallel plan; trains as one process."""
from __future__ import annotations

import numpy as np
import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.onnx_import import load_onnx
from unity_pcg.search.baselines import (StrategyError, build_strategy, megatron, megatron_graph,
                                        split_fused_linears)
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper

from .test_baselines import _same_function
from .test_baselines_decoders import HEADS, LAYERS, _hf

pytest.importorskip("transformers")


def _split_nodes(g):
    return [n for n in g.nodes() if n.op == "Split"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_fused_qkv_rewrite_is_exact(dynamo, tmp_path_factory):
    g = load_onnx(_hf("gpt2", dynamo, tmp_path_factory), load_weights=False)
    splits = _split_nodes(g)
    assert len(splits) == LAYERS
    r = split_fused_linears(g)
    assert not _split_nodes(r) and len(r.meta["split_fused"]) == LAYERS
    # the weight stays one Weight, read through three Slices of its columns
    assert sorted(n.a["name"] for n in r.sources("Weight")) == sorted(n.a["name"] for n in g.sources("Weight"))
    slices = [n for n in r.nodes() if n.op == "Slice" and r.node(n.inputs[0][0]).op == "Weight"
              and r.shape(n.inputs[0]).rank == 2]
    assert len(slices) == 3 * LAYERS and len({n.inputs[0] for n in slices}) == LAYERS
    assert _same_function(g, r)
    assert _same_function(g, megatron_graph(g))
    # nothing to rewrite: the graph itself
    assert split_fused_linears(r) is r


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_megatron_on_gpt2_prices_tensor_parallel(dynamo, tmp_path_factory):
    g = load_onnx(_hf("gpt2", dynamo, tmp_path_factory), load_weights=False)
    m = parse_machine("h100:1x4")
    pg = build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node)
    assert pg.meta["tp"] == HEADS and pg.meta["dp"] == 1
    # q, k, v and the MLP's first projection column-parallel; the attention output and MLP down projections row
    assert len(pg.meta["column"]) == 4 * LAYERS and len(pg.meta["row"]) == 2 * LAYERS
    assert not set(pg.meta["fallbacks"]) & set(pg.meta["column"] + pg.meta["row"])
    for n in pg.nodes():
        if n.op == "Linear" and n.name in pg.meta["column"]:
            assert pg.shape(n.inputs[1]).degrees == (1, HEADS), n.name
        if n.op == "Linear" and n.name in pg.meta["row"]:
            assert pg.shape(n.inputs[1]).degrees == (HEADS, 1), n.name
            (user,) = [c for c, _ in pg.consumers((n.id, 0))]
            assert pg.node(user).op == "AllReduce"
        if n.op == "BatchMatMul":
            assert pg.shapes(n.id)[0].degrees[1] == HEADS           # the heads split
    assert _same_function(g, pg)
    r = MachineMapper(CostModel(m)).optimize(pg)
    assert r.feasible and np.isfinite(r.cost)


def test_simulate_megatron_on_gpt2_is_tensor_parallel(tmp_path_factory):
    """``simulate --strategy megatron`` (the tuned Megatron grid): a priced plan, and its tensor-parallel
    points priced too (before the rewrite every tp > 1 point was refused)."""
    from unity_pcg.commands.simulate_cmd import simulate
    from unity_pcg.search.budget import Deadline
    from unity_pcg.search.optimize import Evaluator
    from unity_pcg.search.tuned import tune
    path = _hf("gpt2", False, tmp_path_factory)
    out = simulate(path, "local:1x2", strategy="megatron", budget_s=30.0)
    assert out["feasible"] and out["predicted_iteration_s"] > 0
    m = parse_machine("local:1x2")
    ev = Evaluator(m, "adam", techniques=False)
    r = tune(load_onnx(path, load_weights=False), ev.mapper, "megatron", Deadline.after(30.0), cheap=ev.cheap)
    tp2 = [p for p in r.priced if p["config"]["tp"] == 2 and p["config"]["pp"] == 1]
    assert tp2 and any(p["cost"] is not None and p["cost"] > 0 for p in tp2), tp2


def test_megatron_still_says_why_in_one_line(tmp_path_factory):
    # the rewrite applies, but no tensor degree splits GPT-2's heads: the one-line reason of the heads
    g = load_onnx(_hf("gpt2", False, tmp_path_factory), load_weights=False)
    with pytest.raises(StrategyError, match="no tensor-parallel degree t > 1") as e:
        megatron(g, 3, devices_per_node=3)                    # 4 heads: 3 does not divide them
    assert "\n" not in str(e.value)


def test_megatron_says_where_the_head_split_is_lost(tmp_path_factory):
    """BLOOM's attention merges batch and heads into one dim for its ALiBi scores ((B, h, S, d) -> (B*h, S, d)):
    no tensor degree keeps the heads split there, and the one line names that Reshape (not the head count)."""
    g = load_onnx(_hf("bloom", False, tmp_path_factory), load_weights=False)
    with pytest.raises(StrategyError, match=r"heads split 2 ways do not reach its output projection: .*Reshape "
                                            r"\[\d+, 4, \d+, \d+\] -> ") as e:
        build_strategy(g, "megatron", 2)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("dynamo,world,tp", [(False, 2, 2), (True, 4, 2)], ids=["legacy-tp2", "dynamo-tp2xdp2"])
def test_megatron_gpt2_trains_as_one_process(dynamo, world, tp, tmp_path_factory):
    from tests.executor import dist_helpers as H
    path = _hf("gpt2", dynamo, tmp_path_factory)
    g = H.load(path)
    pg = megatron(g, world, devices_per_node=tp)
    assert pg.meta["tp"] == tp and pg.meta["split_fused"]
    ref = H.reference(path, 3)
    got = H.run_cases(world, [H.case(H.make_plan(pg, path, world), path, steps=3)])
    H.assert_same(ref, got[0], rtol=1e-4, what=f"megatron tp{tp} on GPT-2 ({'dynamo' if dynamo else 'legacy'})")
    assert ref[0][0] != ref[0][2]
    # the fused weight is one parameter: it trained (its gradient came through the Slices), as in one process
    fused = {g.node(n.inputs[1][0]).a["name"] for n in g.nodes() if n.label() in pg.meta["split_fused"]}
    assert len(fused) == LAYERS
    init = H.reference(path, 0)[1]                           # the parameters before any step
    for name in fused:
        assert name in got[0][1] and name in init
        assert not np.allclose(got[0][1][name], init[name]), f"{name} did not train"
