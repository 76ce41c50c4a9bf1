"""Rule format (JSON round trip, validation), matching (bindings, dims, free variables, escapes) and
application (new PCG, shapes re-inferred, invalid parallelizations refused)."""
import json

import numpy as np
import pytest

from unity_pcg.substitutions.apply import apply_match, try_apply
from unity_pcg.substitutions.match import GraphIndex, find_matches, match_all
from unity_pcg.substitutions.rule import Rule, RuleError, dumps_rules, loads_rules
from unity_pcg.substitutions.templates import template_rules
from unity_pcg.substitutions.terms import instantiate, op, rule_of
from unity_pcg.errors import InvalidParallelization
from unity_pcg.evaluate import evaluate
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape as S

RELU_PUSH = rule_of("relu_push", op("Relu", op("Partition", "x", dim="$d", degree="$k")),
                    op("Partition", op("Relu", "x"), dim="$d", degree="$k"), {"d": "dim", "k": "degree"})


def _chain(shape=(4, 6), dim=0, degree=2):
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": list(shape)})
    p = b.add("Partition", {"dim": dim, "degree": degree}, [x])
    r = b.add("Relu", {}, [p])
    y = b.add("Combine", {"dim": dim, "degree": degree}, [r])
    b.set_outputs([y])
    return b.finish()


def test_json_round_trip_every_template():
    rules = template_rules()
    text = dumps_rules(rules)
    back = loads_rules(text)
    assert back == rules
    for r in rules:
        assert Rule.from_json(json.loads(json.dumps(r.to_json()))) == r


def test_validation_names_the_rule():
    obj = RELU_PUSH.to_json()
    obj["target"]["nodes"][1]["attrs"]["degree"] = "$unknown"
    with pytest.raises(RuleError, match="relu_push"):
        Rule.from_json(obj)
    obj = RELU_PUSH.to_json()
    obj["source"]["nodes"][0]["op"] = "NoSuchOp"
    with pytest.raises(RuleError, match="unknown operator"):
        Rule.from_json(obj)
    with pytest.raises(RuleError, match="not a rule file"):
        loads_rules('{"hello": 1}')
    with pytest.raises(RuleError, match="not valid JSON"):
        loads_rules("{")


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_match_binds_dims_counted_from_the_end(dim):
    g = _chain(dim=dim)
    ms = find_matches(RELU_PUSH, g)
    assert len(ms) == 1
    b = ms[0].binding
    assert b["k"] == 2 and b["d"] == (dim % 2) - 2


def test_literal_dims_match_any_rank_form():
    r = rule_of("relu_push_last", op("Relu", op("Partition", "x", dim=-1, degree=2)),
                op("Partition", op("Relu", "x"), dim=-1, degree=2))
    assert len(find_matches(r, _chain(dim=1))) == 1
    assert len(find_matches(r, _chain(dim=0))) == 0


def test_apply_gives_equal_values_and_new_graph():
    g = _chain()
    m = find_matches(RELU_PUSH, g)[0]
    g2 = apply_match(g, m)
    assert g2 is not g and g2.op_counts()["Partition"] == 1 and len(g2) == len(g)
    g2.check()
    x = np.random.default_rng(0).standard_normal((4, 6))
    a = evaluate(g, {"x": x}, "pieces")[0]
    c = evaluate(g2, {"x": x}, "pieces")[0]
    assert np.allclose(a, c)
    assert g.structural_hash() != g2.structural_hash()


def test_interior_tensor_used_outside_is_not_matched():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": [4, 6]})
    p = b.add("Partition", {"dim": 0, "degree": 2}, [x])
    r = b.add("Relu", {}, [p])
    other = b.add("Neg", {}, [p])          # uses the Partition output outside the pattern
    b.set_outputs([r, other])
    g = b.finish()
    assert find_matches(RELU_PUSH, g) == []


def test_free_degree_enumerated_and_invalid_result_refused():
    r = next(t for t in template_rules() if t.name == "fig11a_relu_spatial")
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": [4, 3]})
    b.set_outputs([b.add("Relu", {}, [x])])
    g = b.finish()
    ms = find_matches(r, g, degrees=(2, 4))
    got = {(m.binding["d"], m.binding["k"]) for m in ms}
    assert got == {(-2, 2), (-1, 2), (-2, 4), (-1, 4)}
    ok = {(m.binding["d"], m.binding["k"]): try_apply(g, m) for m in ms}
    assert ok[(-2, 2)] is not None and ok[(-2, 4)] is not None
    assert ok[(-1, 2)] is None and ok[(-1, 4)] is None        # 3 is not divisible: refused
    bad = next(m for m in ms if m.binding["d"] == -1)
    with pytest.raises(InvalidParallelization, match="fig11a_relu_spatial"):
        apply_match(g, bad)


def test_constraints_checked_at_match_time():
    r = next(t for t in template_rules() if t.name == "dp_Softmax")
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": [4, 4]})
    b.set_outputs([b.add("Softmax", {"axis": -1}, [x])])
    ms = find_matches(r, b.finish())
    assert {m.binding["d"] for m in ms} == {-2}


def test_multi_output_rule_applies():
    r = next(t for t in template_rules() if t.name == "dp_Split")
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": [4, 4]})
    n = b.add_node("Split", {"axis": 1, "sizes": [1, 3]}, [x])
    b.set_outputs([(n, 0), (n, 1)])
    g = b.finish()
    ms = find_matches(r, g)
    assert len(ms) == 1
    g2 = apply_match(g, ms[0])
    v = np.arange(16.0).reshape(4, 4)
    for a, c in zip(evaluate(g, {"x": v}, "pieces"), evaluate(g2, {"x": v}, "pieces")):
        assert np.array_equal(a, c)


def test_match_all_shares_one_index():
    g = _chain()
    ms = match_all(template_rules(), g)
    names = {m.rule.name for m in ms}
    assert "dp_Relu" in names and "fig11a_relu_spatial" in names
    idx = GraphIndex(g)
    assert idx.by_op["Relu"] == [n.id for n in g.nodes() if n.op == "Relu"]


def test_reversed_rule_round_trip():
    r = next(t for t in template_rules() if t.name == "linear_relu_fusion")
    assert r.reversible
    g = instantiate(r.source, {}, {"x": S.of((4, 4)), "w": S.of((4, 4))})
    g2 = apply_match(g, find_matches(r, g)[0])
    assert g2.op_counts()["Linear"] == 1 and "Relu" not in g2.op_counts()
    g3 = apply_match(g2, find_matches(r.reversed(), g2)[0])
    assert g3.structural_hash() == g.structural_hash()
