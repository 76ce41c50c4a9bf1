"""Pipelines with Megatron-LM inside their stages, reached by proven rules (issue 7 point 1, issue 18 point 5).

The stage search prices ``pipeline.megatron_intra`` (Megatron-LM's layout, tensor parallel inside a stage and
data parallel across); ``pipeline.by_rules`` reaches the stitched plan from the logical model by
``search.realize.realize`` (GPT's masked attention block, the MLP, the vocabulary-parallel head, the residual
stream on the copies; a stage data and tensor parallel at once has its weights' two copies merged by
``replicate_merge``), and the recorded sequence replays on a fresh import to the plan's structural hash."""
import json

import pytest

from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import by_rules, evaluate_pipeline, megatron_intra
from unity_pcg.search.substitution import RuleStep, replay

from .test_pipeline import machine
from .test_pipeline_rules import _check


@pytest.fixture(scope="module")
def gpt_path(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("g") / "gpt.onnx"
    zoo.export("gpt_350m", str(p), size="tiny", batch=8)
    return str(p)


ATTN = "megatron_attention_block_bias_mask"
# (mesh, stages, whether a tensor-parallel stage holds an attention block)
PLANS = [((1, 4), [(0, 8, 0, 4)], True),
         ((1, 4), [(0, 4, 0, 2), (4, 8, 2, 2)], True),
         ((2, 2), [(0, 8, 0, 4)], True),
         ((1, 4), [(0, 3, 0, 1), (3, 5, 1, 1), (5, 8, 2, 2)], False)]


@pytest.mark.parametrize("mesh,stages,attention", PLANS)
def test_megatron_stages_by_rules_use_the_templates_and_split_the_weights(gpt_path, mesh, stages, attention):
    from unity_pcg.onnx_import import load_onnx

    def fresh():
        return load_onnx(gpt_path, load_weights=False)
    m = machine(*mesh)
    g = fresh()
    res = evaluate_pipeline(g, CostModel(m, "adam"), stages, 2, intra=megatron_intra(m.devices_per_node))
    assert res.feasible
    ruled = by_rules(g, res, m)
    _check(fresh, res, ruled, m)
    used = {s.rule for s in ruled.rules}
    assert "megatron_mlp_column_gelu_row_bias" in used and "replicate_lift_Add" in used, used
    assert (ATTN in used) == attention
    # the attention and MLP weights are split, not copied, on the tensor-parallel stages
    pg = ruled.pcg

    def weight_below(n):
        while n.kind == "parallel":
            n = pg.node(n.inputs[0][0])
        return n.op == "Weight"
    split = [n for n in pg.nodes() if n.op == "Partition" and weight_below(n)]
    assert len(split) >= (8 if attention else 4)          # Q/K/V/O + biases, MLP, head


@pytest.mark.parametrize("mesh,stages,dp", [((1, 4), [(0, 8, 0, 4)], 1), ((1, 4), [(0, 4, 0, 2), (4, 8, 2, 2)], 1),
                                           ((2, 2), [(0, 8, 0, 4)], 2), ((2, 2), [(0, 4, 0, 2), (4, 8, 2, 2)], 1),
                                           ((4, 2), [(0, 4, 0, 4), (4, 8, 4, 4)], 2)])
def test_hand_built_megatron_stages_reached_by_realize(gpt_path, mesh, stages, dp):
    """Stages tensor parallel inside (megatron_intra: Megatron-LM's layout by structure) are reached by
    realize from the logical model: the hand-built plan itself (same stages, views, price) with a rule
    sequence that replays on a fresh import, no mapper needed.  Stages data and tensor parallel at once
    (``dp`` 2) too: the rules' two copies of a weight written as one (``replicate_merge``)."""
    from unity_pcg.onnx_import import load_onnx

    def fresh():
        return load_onnx(gpt_path, load_weights=False)
    m = machine(*mesh)
    g = fresh()
    hand = evaluate_pipeline(g, CostModel(m, "adam"), stages, 2, intra=megatron_intra(m.devices_per_node))
    assert hand.feasible and hand.origin.get("megatron")
    ruled = by_rules(g, hand, m)
    _check(fresh, hand, ruled, m)
    assert ruled.cost == hand.cost
    used = {s.rule for s in ruled.rules}
    assert any(r.startswith("megatron_") or r.startswith("split_") for r in used)
    assert ("replicate_merge" in used) == (dp > 1)
    if dp > 1:                      # every weight copied by one Replicate of the stage's degree
        pg = ruled.pcg
        assert not any(n.op == "Replicate" and pg.node(n.inputs[0][0]).op == "Replicate" for n in pg.nodes())


def test_recorded_sequence_survives_the_plan_file(gpt_path, tmp_path):
    from unity_pcg import plan as plan_mod
    from unity_pcg.onnx_import import load_onnx
    m = machine(2, 2)
    g = load_onnx(gpt_path, load_weights=False)
    res = by_rules(g, evaluate_pipeline(g, CostModel(m, "adam"), [(0, 8, 0, 4)], 2,
                                        intra=megatron_intra(2)), m)
    p = plan_mod.Plan("gpt.onnx", "0" * 64, m, res.pcg, res.views, {}, pipeline=res.to_plan_field(),
                      rules=tuple(s.to_json() for s in res.rules))
    path = tmp_path / "p.json"
    p.save(str(path))
    back = plan_mod.load(str(path))
    steps = [RuleStep.from_json(json.loads(json.dumps(s))) for s in back.rules]
    assert replay(load_onnx(gpt_path, load_weights=False), steps, trim_outputs=True).structural_hash() == \
        back.pcg.structural_hash()


def test_optimize_records_rules_for_its_megatron_pipeline(tmp_path_factory):
    """Where data parallelism does not fit (tests/search/test_pipeline_megatron.py's machine), a plan optimize
    returns with rules replays on a fresh import to the plan's PCG and computes the model's function."""
    pytest.importorskip("torch")
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.optimize import optimize

    from .graphs import same_function
    from .test_pipeline_megatron import machine as tight
    p = str(tmp_path_factory.mktemp("g64") / "gpt.onnx")
    zoo.export("gpt_350m", p, size="tiny", batch=64)
    res = optimize(load_onnx(p, load_weights=False), tight(), budget_s=90, max_candidates=5)   # slack for load
    assert res.feasible and not res.dp.feasible
    if res.plan.rules is None:          # a floor (tuned Megatron-LM, ZeRO-3) won: recorded as such, no rules
        assert "baseline" in res.stats["chosen"] or "accumulation" in res.stats["chosen"], res.stats["chosen"]
        return
    steps = [RuleStep.from_json(s) for s in res.plan.rules]
    fresh = load_onnx(p, load_weights=False)
    assert replay(fresh, steps, trim_outputs=True).structural_hash() == res.plan.pcg.structural_hash()
    assert same_function(load_onnx(p, load_weights=False), res.plan.pcg)


@pytest.fixture(scope="module")
def two_pair_path():
    pytest.importorskip("torch")
    from tests.executor.test_pipeline_megatron import two_pair_mlp
    return two_pair_mlp()


@pytest.mark.parametrize("mesh,stages,tp", [((1, 2), [(0, 6, 0, 2)], 2), ((1, 4), [(0, 3, 0, 2), (3, 6, 2, 2)], 2),
                                           ((1, 4), [(0, 6, 0, 4)], 2), ((1, 8), [(0, 6, 0, 8)], 2),
                                           ((1, 8), [(0, 6, 0, 8)], 4)])
def test_two_megatron_pairs_in_one_stage_reached_by_rules(two_pair_path, mesh, stages, tp):
    """Two column -> row Linear pairs (ReLU between) ending in the model's output, tensor parallel ``tp`` and
    data parallel across (stage devices / tp): the hand-built stages (megatron_intra) are reached by rules, the
    same plan and price.  Data parallel x tensor parallel, the dp rule's gather of the first pair's batch pieces
    before its AllReduce is sunk past it (``combine_sink_AllReduce``) and cancelled with the next pair's split;
    the output's partial sums are all-reduced where the loss reads them, as Megatron-LM's layout does."""
    from unity_pcg.onnx_import import load_onnx

    def fresh():
        return load_onnx(two_pair_path, load_weights=False)
    m = machine(*mesh)
    g = fresh()
    hand = evaluate_pipeline(g, CostModel(m, "adam"), stages, 2, intra=megatron_intra(tp))
    assert hand.feasible and hand.origin.get("megatron")
    ruled = by_rules(g, hand, m)
    _check(fresh, hand, ruled, m)
    assert ruled.cost == hand.cost
    pg = ruled.pcg
    used = {s.rule for s in ruled.rules}
    if (mesh, tp) == ((1, 4), 2) and len(stages) == 1:      # dp2 x tp2: the pair templates, then the dp rules
        assert "combine_sink_AllReduce" in used
    assert not any(n.op == "Combine" for n in pg.nodes())             # every gather cancelled
    assert [pg.node(r[0]).op for r in pg.outputs] == ["AllReduce"]
    assert sum(n.op == "AllReduce" for n in pg.nodes()) == 2             # one per pair
