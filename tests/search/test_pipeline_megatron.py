"""optimize's pipeline with Megatron tensor parallelism inside the stages (search/pipeline.py megatron_intra),
on a small GPT from the zoo and a machine where nothing with data parallelism inside the stages fits."""
import pytest

from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import (evaluate_pipeline, megatron_intra, search_pipeline, sequential_layers,
                                       stage_graph)

from .graphs import same_function

# 8 devices of one node, 150 kB each: the tiny GPT's weights with Adam take 490 kB; data parallel inside any
# pipeline of at most 4 stages needs >= 196 kB on some device, Megatron inside the stages 130 kB
CAP = 150_000


def machine(memory=CAP):
    dev = DeviceSpec(100e12, 1e12, memory, {"default": 0.5}, 5e-6)
    links = {"group": LinkSpec(100e9, 2e-6), "node": LinkSpec(100e9, 2e-6), "network": LinkSpec(10e9, 5e-6)}
    return MachineSpec("test", 1, 8, 8, dev, links)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    p = tmp_path_factory.mktemp("g") / "gpt.onnx"
    zoo.export("gpt_350m", str(p), size="tiny", batch=64)
    return load_onnx(str(p), load_weights=False)


def test_optimize_fits_where_data_parallel_stages_do_not(gpt):
    from unity_pcg.search.optimize import optimize
    m = machine()
    mapper = MachineMapper(CostModel(m, "adam"))
    # data parallel inside the stages fits nowhere, with the default micro-batch counts or with 64
    for ms in (None, [64]):
        r = search_pipeline(gpt, mapper, min_stages=1, micro_batches=ms)
        assert r is None or not r.feasible
    res = optimize(gpt, m, budget_s=60, max_candidates=5)       # candidates bound it; the budget is slack for load
    assert not res.dp.feasible
    assert res.feasible and res.json()["max_memory_bytes"] <= CAP
    pipe = res.stats.get("pipeline_iteration_s")
    assert pipe is None or res.predicted_iteration_s <= pipe * (1 + 1e-9)
    pg = res.plan.pcg
    if res.stats["chosen"] == "pipeline":
        # Megatron inside: row-parallel Linears reduce their partial sums; column-parallel weights split on
        # their output features
        assert sum(n.op in ("AllReduce", "Reduce") for n in pg.nodes()) >= 2
        col = [n for n in pg.nodes() if n.op == "Linear" and pg.shape(n.inputs[1]).degrees[-1] > 1]
        row = [n for n in pg.nodes() if n.op == "Linear" and pg.shape(n.inputs[1]).degrees[0] > 1]
        assert col and row
    assert same_function(gpt, pg)


def test_a_stage_without_attention_still_splits_its_mlp_and_the_head_is_vocabulary_parallel(gpt):
    m = machine(memory=10**9)
    mapper = MachineMapper(CostModel(m, "adam"))
    roles = GraphCost(gpt, mapper.model).role
    layers, info = sequential_layers(gpt, roles, 12)
    units = [n for a, b in layers for u in range(a, b) for n in info.units[u]]
    ops_of = {}
    for k, (a, b) in enumerate(layers):
        ops_of[k] = {gpt.node(n).op for u in range(a, b) for n in info.units[u]}
    # a layer holding an MLP (Gelu) and no attention (no BatchMatMul): Megatron refuses it as a strategy,
    # the hook splits its column -> row pair
    mlp_only = [k for k, o in ops_of.items() if "Gelu" in o and "BatchMatMul" not in o]
    assert mlp_only and units
    a, b = layers[mlp_only[0]]
    sg = stage_graph(gpt, roles, [n for u in range(a, b) for n in info.units[u]])
    from unity_pcg.machine import Resource
    P = megatron_intra(8)(sg, Resource(0, 1, 4))
    assert P.meta["tp"] == 4 and P.meta["column"] and P.meta["row"]
    assert same_function(sg, P)
    # the last layer (the LM head): column-parallel with its output left split, faster and lighter than
    # running it on every tensor-parallel copy
    one = [(0, len(layers), 0, 8)]
    with_head = evaluate_pipeline(gpt, mapper, one, 8, intra=megatron_intra(8))
    without = evaluate_pipeline(gpt, mapper, one, 8, intra=megatron_intra(8, head=False))
    assert with_head.max_memory_bytes < without.max_memory_bytes
    assert with_head.cost <= without.cost
    assert same_function(gpt, with_head.pcg)
