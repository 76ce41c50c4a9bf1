"""Pipeline plans by rules (search/pipeline.py by_rules): the stages are a mapping decision, the PCG inside
them (data parallelism at each stage's degree) is reached by the shipped rules, and the sequence replays on a
fresh import to the plan's structural hash (issue 7 point 1)."""
import json

import pytest

from unity_pcg import plan as plan_mod
from unity_pcg.search.cost import CostModel
from unity_pcg.search.pipeline import by_rules, evaluate_pipeline, search_pipeline
from unity_pcg.search.substitution import RuleStep, replay

from .graphs import mlp, same_function
from .test_pipeline import machine


def _check(fresh, res, ruled, m):
    assert ruled is not None and ruled.rules
    # the recorded sequence replays on a fresh copy of the model to the plan's PCG
    steps = [RuleStep.from_json(json.loads(json.dumps(s.to_json()))) for s in ruled.rules]
    assert replay(fresh(), steps, trim_outputs=True).structural_hash() == ruled.pcg.structural_hash()
    # the same plan: every stage keeps its devices, every non-source node has a view inside its stage
    assert [s.devices for s in ruled.stages] == [s.devices for s in res.stages]
    assert ruled.cost == res.cost and ruled.micro_batches == res.micro_batches
    for n in ruled.pcg.nodes():
        assert n.kind == "source" or n.id in ruled.views
    plan_mod.validate_pipeline_field(ruled.to_plan_field(), ruled.pcg, ruled.views, m)
    # the parallel ops of each stage match the stitched plan's, degree for degree
    def degrees(r):
        return sorted((k, r.pcg.node(n).op, r.views[n].degree) for k, st in enumerate(r.stages) for n in st.nodes
                      if r.pcg.node(n).kind == "compute")
    assert degrees(ruled) == degrees(res)
    assert same_function(fresh(), ruled.pcg)


def test_mlp_stages_of_unequal_degrees_by_rules():
    m = machine(1, 3)
    res = search_pipeline(mlp(batch=8, h=16, layers=4), CostModel(m, "sgd"), min_stages=2, max_stages=2,
                          micro_batches=2)
    assert sorted(len(s.devices) for s in res.stages) == [1, 2] and res.rules is None
    _check(lambda: mlp(batch=8, h=16, layers=4), res, by_rules(mlp(batch=8, h=16, layers=4), res, m), m)


@pytest.fixture(scope="module")
def gpt_path(tmp_path_factory):
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("g") / "gpt.onnx"
    zoo.export("gpt_350m", str(p), size="tiny", batch=8)
    return str(p)


@pytest.mark.parametrize("stages", [[(0, 4, 0, 2), (4, 8, 2, 2)], [(0, 4, 0, 1), (4, 8, 1, 3)],
                                    [(0, 3, 0, 1), (3, 5, 1, 1), (5, 8, 2, 2)]])
def test_gpt_pipelines_by_rules_replay_on_a_fresh_import(gpt_path, stages):
    from unity_pcg.onnx_import import load_onnx

    def fresh():
        return load_onnx(gpt_path, load_weights=False)
    m = machine(1, 4)
    g = fresh()
    res = evaluate_pipeline(g, CostModel(m, "adam"), stages, 2)
    _check(fresh, res, by_rules(g, res, m), m)


def test_unstitched_plans_have_no_rule_sequence(gpt_path):
    """(Hand-built Megatron stages are reached by realize: tests/search/test_rules_pipeline_megatron.py.)"""
    from unity_pcg.onnx_import import load_onnx
    g = load_onnx(gpt_path, load_weights=False)
    m = machine(1, 4)
    bare = evaluate_pipeline(g, CostModel(m, "adam"), [(0, 4, 0, 2), (4, 8, 2, 2)], 2, stitch=False)
    assert by_rules(g, bare, m) is None


def test_optimize_records_and_replays_a_pipeline_plans_rules(tmp_path):
    """The joint search's plan is never slower than its pipeline candidate; its rules, where recorded, replay on
    the model to the plan's PCG and the plan file round-trips (the pipeline's own rules: the test below)."""
    from unity_pcg.search.optimize import optimize
    m = machine(2, 1, network_bw=1e9)
    r = optimize(mlp(batch=8, h=2048, layers=4), m, budget_s=20, max_candidates=1)
    # whatever wins (the pipeline, or a layout the search found faster) is never slower than the pipeline
    pipe = r.stats.get("pipeline_iteration_s")
    assert pipe is not None and r.predicted_iteration_s <= pipe * (1 + 1e-9)
    if r.plan.pipeline is not None:
        assert r.stats.get("pipeline_by_rules") in ("reached", "not reached", "cut by the budget")
    if r.plan.rules is not None:
        steps = [RuleStep.from_json(s) for s in r.plan.rules]
        assert replay(mlp(batch=8, h=2048, layers=4), steps, trim_outputs=True).structural_hash() == \
            r.plan.pcg.structural_hash()
    path = tmp_path / "p.json"
    r.plan.save(str(path))
    back = plan_mod.load(str(path))
    assert back.rules == r.plan.rules and back.pipeline == r.plan.pipeline


def test_rule_reached_pipeline_plans_pass_the_executors_checks():
    ex = pytest.importorskip("unity_pcg.executor.pipeline")
    g = mlp(batch=8, h=2048, layers=4)
    m = machine(2, 2, network_bw=1e9)
    res = search_pipeline(g, CostModel(m, "adam"), min_stages=2, max_stages=2)
    assert [len(s.devices) for s in res.stages] == [2, 2]
    ruled = by_rules(mlp(batch=8, h=2048, layers=4), res, m)
    assert ruled is not None and ruled.rules          # data parallel of degree 2 inside each stage
    p = plan_mod.Plan("model.onnx", "0" * 64, m, ruled.pcg, ruled.views, {}, pipeline=ruled.to_plan_field(),
                      rules=tuple(s.to_json() for s in ruled.rules))
    ex.check_pipeline(p)
    M, stages = ex.resolve(p)
    assert M == res.micro_batches and len(stages) == 2
