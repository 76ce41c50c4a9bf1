"""Pipelines priced with memory techniques (search/pipeline.py with search/memtech.py, issue 19 points 2 and 6):
the stage DP chooses each stage's recomputation and the plan's ZeRO stage jointly with the stages, so a model
whose pipelines do not fit without them gets a feasible pipeline plan, priced with the recompute forward."""
import math

import pytest

from unity_pcg.plan import MemoryPlan
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import (PIPELINE_ZERO, PipelineError, evaluate_pipeline, in_flight, search_pipeline)
from unity_pcg.search.split import synthetic_transformer

from .test_pipeline import machine

MiB = 2**20


def _setup(cap_mib=56):     # below the plain pipelines, above the smallest with techniques
    g = synthetic_transformer(4, batch=8, seq=256, hidden=256, heads=4)
    m = machine(1, 4, memory=cap_mib * MiB)
    return g, m, CostModel(m, optimizer="adam")


def test_tiny_memory_needs_recompute_and_the_plan_fits():
    g, m, cm = _setup()
    cap = m.device.memory_bytes
    plain = search_pipeline(g, MachineMapper(cm), max_stages=2, micro_batches=2, techniques=False)
    assert plain is None or not plain.feasible
    r = search_pipeline(g, MachineMapper(cm, techniques=True), max_stages=2, micro_batches=2)
    assert r is not None and r.feasible and math.isfinite(r.cost)
    assert r.max_memory_bytes <= cap
    mem = r.memory_plan
    assert mem is not None and mem.recompute and mem.zero in PIPELINE_ZERO
    assert set(r.techniques["recompute"]) & {"full", "selective", "per-region"}
    # the regions are compute nodes of the plan's PCG, each inside one stage; the plan file takes them
    stage_of = {n: k for k, st in enumerate(r.stages) for n in st.nodes}
    for reg in mem.recompute:
        assert {stage_of[n] for n in reg.nodes} and len({stage_of[n] for n in reg.nodes}) == 1
        assert all(r.pcg.node(n).kind == "compute" for n in reg.nodes)
    assert MemoryPlan.from_json(mem.to_json(), r.pcg) == mem
    # stages without recomputation have no region in the plan
    for k, mode in enumerate(r.techniques["recompute"]):
        has = any(stage_of[reg.nodes[0]] == k for reg in mem.recompute)
        assert has == (mode != "none")


def test_recompute_forward_is_in_the_stage_time_and_memory_shrinks():
    """The same stages priced with and without recomputation: the backward grows by exactly the recompute
    forward memtech prices, the memory with the micro-batches in flight shrinks."""
    g, m, cm = _setup(cap_mib=1 << 20)
    mapper = MachineMapper(cm, techniques=True)
    plan = ((0, 2, 0, 2), (2, 4, 2, 2))
    none = evaluate_pipeline(g, mapper, plan, 2, max_layers=4, tech=(1, ("none", "none")))
    full = evaluate_pipeline(g, mapper, plan, 2, max_layers=4, tech=(1, ("full", "full")))
    assert none.feasible and full.feasible
    for k, (a, b) in enumerate(zip(none.stages, full.stages)):
        rec = full.techniques["recompute_s"][k]
        assert rec > 0
        assert b.fwd_s == pytest.approx(a.fwd_s)
        assert b.bwd_s == pytest.approx(a.bwd_s + rec)
        assert b.memory_bytes < a.memory_bytes
        assert b.in_flight == in_flight(2, k, 2)
    assert full.cost > none.cost
    assert none.memory_plan is not None and none.memory_plan.zero == 1 and not none.memory_plan.recompute
    # ZeRO-1 shards the optimizer states over each stage's two copies: never more memory than none
    z0 = evaluate_pipeline(g, mapper, plan, 2, max_layers=4, tech=(0, ("none", "none")))
    assert none.max_memory_bytes < z0.max_memory_bytes
    assert z0.memory_plan is None


def test_without_techniques_the_pipeline_prices_as_before():
    g, m, cm = _setup(cap_mib=1 << 20)
    plan = ((0, 2, 0, 2), (2, 4, 2, 2))
    a = evaluate_pipeline(g, MachineMapper(cm), plan, 2, max_layers=4)
    b = evaluate_pipeline(g, MachineMapper(cm, techniques=True), plan, 2, max_layers=4)
    assert a.cost == b.cost and a.memory == b.memory and a.memory_plan is None and b.memory_plan is None
    r = search_pipeline(g, MachineMapper(cm), max_stages=2, micro_batches=2)
    assert r.memory_plan is None and not r.techniques


def test_techniques_never_make_the_search_slower_where_memory_is_ample():
    g, m, cm = _setup(cap_mib=1 << 20)
    plain = search_pipeline(g, MachineMapper(cm), max_stages=2, micro_batches=2, techniques=False)
    with_t = search_pipeline(g, MachineMapper(cm), max_stages=2, micro_batches=2, techniques=True)
    # (the plain price has no overlap of the gradient sync; the test machine does not overlap either)
    assert with_t.feasible and with_t.cost <= plain.cost * (1 + 1e-9)
    assert all(x == "none" for x in with_t.techniques["recompute"])


def test_bad_tech_is_a_typed_error():
    g, m, cm = _setup(cap_mib=1 << 20)
    with pytest.raises(PipelineError):
        evaluate_pipeline(g, MachineMapper(cm), ((0, 4, 0, 4),), 2, max_layers=4, tech=(1, ("none", "full")))
    with pytest.raises(PipelineError):
        evaluate_pipeline(g, MachineMapper(cm), ((0, 4, 0, 4),), 2, max_layers=4, tech=(1, ("most",)))


def test_the_executor_accepts_the_pipeline_with_its_techniques_and_optimize_checks_bf16():
    """A multi-stage plan with its MemoryPlan passes the executor's pre-launch check, in fp32 and in bf16 (the
    pipeline runtime runs bf16 across stages), so optimize's check lets it through in both."""
    from types import SimpleNamespace

    from unity_pcg.search.optimize import _pipeline_refusal
    g, m, _ = _setup()
    for prec in ("fp32", "bf16"):
        mapper = MachineMapper(CostModel(m, optimizer="adam", precision=prec), techniques=True)
        r = search_pipeline(g, mapper, min_stages=2, max_stages=2, micro_batches=2)
        assert r is not None and r.feasible and r.num_stages == 2 and r.memory_plan is not None
        why = _pipeline_refusal(SimpleNamespace(m=m, ev=SimpleNamespace(mapper=mapper)), r)
        assert why is None, (prec, why)
