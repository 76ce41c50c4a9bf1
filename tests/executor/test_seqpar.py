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


def after_gathers(pcg, regs):
    """Each region cut before its first compute node fed by a gather (Combine / Replicate from an
    activation): the gather then feeds the second part from outside it -- where a recompute region must
    take the gather in (search.memtech.region_members) to keep the sequence shard, not the gathered input."""
    from unity_pcg.plan import RecomputeRegion
    from unity_pcg.search.memtech import GATHER_OPS
    role = pcg.roles()

    def gathered(n):
        for r in pcg.node(n).inputs:
            p = r[0]
            if role[p] == "parallel" and pcg.node(p).op in GATHER_OPS:
                return True
        return False
    out = []
    for reg in regs:
        nodes = list(reg)
        cut = next((i for i, n in enumerate(nodes) if i > 0 and gathered(n)), None)
        parts = [nodes] if cut is None else [nodes[:cut], nodes[cut:]]
        out.extend(RecomputeRegion(tuple(p), "full") for p in parts if p)
    return tuple(out)


def _sp_recompute_plan(world: int, tp: int):
    import dataclasses

    from unity_pcg.plan import MemoryPlan
    from unity_pcg.search import memtech
    plan, path = _sp_plan(world, tp)
    regs = after_gathers(plan.pcg, memtech.regions(plan.pcg))
    return dataclasses.replace(plan, memory=MemoryPlan(recompute=regs)), path


def test_recompute_regions_keep_the_sequence_shard_and_gather_again():
    """A recompute region fed by the all-gather of a sequence shard (the norm outside it, the column-parallel
    Linears inside) takes the gather in: its checkpointed run reads the norm's shard (half the sequence),
    never the gathered tensor, and runs the all-gather again when recomputed; the cost model's runs are the
    executor's (the gather is recomputed, the shard kept) and its recomputation is priced with the gather."""
    pytest.importorskip("torch")
    from unity_pcg.executor.lower import lower
    from unity_pcg.executor.memory import Region, run_io, schedule
    from unity_pcg.search import memtech
    from unity_pcg.search.cost import CostModel, GraphCost
    plan, _ = _sp_recompute_plan(2, 2)
    g = plan.pcg
    fed = 0
    for rank in range(2):
        low = lower(g, plan.views, rank, 2, plan.machine)
        items = schedule(low, plan.memory.recompute)
        for item in items:
            if not isinstance(item, Region):
                continue
            gathers = [st for st in item.steps if st.combine and st.combine[0] == "dtensor"
                       and st.combine[1].kind == "all_gather"]
            for run in item.runs:
                ins, _ = run_io(run, items, rank, set())
                for r in ins:      # a region reads no gathered (sequence-whole, copied) activation
                    s = g.shape(r)
                    assert not (g.node(r[0]).op in memtech.GATHER_OPS and s.copy_degree > 1), (item.index, r)
            fed += bool(gathers)
    assert fed >= 2 * 2 * sum(1 for n in g.nodes() if n.op == "Softmax")
    t = memtech.Techniques(GraphCost(g, CostModel(plan.machine, "adam")), plan.views)
    assign = {n: (i, r.mode) for i, r in enumerate(plan.memory.recompute) for n in r.nodes}
    runs = t._runs(assign)
    role = g.roles()
    gathered = [n for n in runs if role[n] == "parallel" and g.node(n).op == "Replicate"]
    assert gathered
    for n in gathered:
        assert t._frac(t.tensors[(n, 0)], runs) == 0.0           # recomputed
        src = g.node(g.node(n).inputs[0][0]).inputs[0]             # Combine's input: the norm's shard
        assert t._frac(t.tensors[tuple(src)], runs) == 1.0
    p = t.price(plan.memory)
    compute_only = sum(t.fwd[n] for n in runs if role[n] == "compute")
    assert p.recompute_s == pytest.approx(sum(t.fwd[n] for n in runs)) and p.recompute_s > compute_only


def test_sequence_parallel_recompute_after_the_norms_equals_one_process():
    pytest.importorskip("torch")
    plan, path = _sp_recompute_plan(2, 2)
    ref = H.reference(path, STEPS, optimizer="adam", lr=0.01)
    got = H.run_cases(2, [H.case(plan, path, steps=STEPS, optimizer="adam", lr=0.01)], timeout=300)
    H.assert_same(ref, got[0], what="llama sequence parallel, recompute with the gathers")
