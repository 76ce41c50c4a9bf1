"""The verifier: axioms hold under the piece semantics (and a wrong axiom is caught), true rules are
proven, wrong rules and >= 200 numerically wrong mutants of shipped rules are refused, and a fixed
deterministic sample of the shipped cache re-proves (the whole cache: ``-m slow``)."""
import pytest

from unity_pcg.substitutions import cache
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.shape import ParallelTensorShape as S
from unity_pcg.verifier.axioms import AXIOMS, Axiom, counts
from unity_pcg.verifier.mutate import numerically_wrong, valid_mutants
from unity_pcg.verifier.selfcheck import check_all, check_axiom
from unity_pcg.verifier.verify import verify_rule, verify_rules

P = lambda t, d="$d", k="$k": op("Partition", t, dim=d, degree=k)  # noqa: E731
DK = {"d": "dim", "k": "degree"}


def test_every_axiom_holds_under_the_piece_semantics():
    bad = [r for r in check_all(AXIOMS) if not r.ok]
    assert not bad, bad


def test_axiom_counts():
    c = counts()
    assert c["axioms"] == len(AXIOMS) and c["axiom_schemas"] >= 40 and c["parallel_axiom_schemas"] >= 25
    assert len({a.name for a in AXIOMS}) == len(AXIOMS)


WRONG_AXIOMS = [
    # relu is not linear: it does not commute with a sum of partial results
    ("relu_reduce", op("Relu", op("Reduce", "x", degree="$k")), op("Reduce", op("Relu", "x"), degree="$k"),
     {"k": "degree"}, {"k": 2}, {"x": S.of((4, 4), sum_degree=2)}),
    # softmax along a partitioned axis is not piecewise
    ("softmax_axis", op("Softmax", P("x", -1, 2), axis=-1), P(op("Softmax", "x", axis=-1), -1, 2), {}, {},
     {"x": S.of((4, 4))}),
    # matmul is not commutative
    ("matmul_comm", op("MatMul", "x", "y"), op("MatMul", "y", "x"), {}, {}, {"x": S.of((4, 4)), "y": S.of((4, 4))}),
    # combine along the wrong dim
    ("combine_wrong_dim", op("Combine", P("x", -1, 2), dim=-2, degree=2), "x", {}, {}, {"x": S.of((4, 4), (2, 1))}),
    # concat order matters
    ("concat_comm", op("Concat", "x", "y", axis=-1), op("Concat", "y", "x", axis=-1), {}, {},
     {"x": S.of((4, 2)), "y": S.of((4, 2))}),
    # a contraction split on one side only
    ("matmul_half_split", op("Reduce", op("MatMul", P("x", -1, 2), op("Replicate", "y", degree=2)), degree=2),
     op("MatMul", "x", "y"), {}, {}, {"x": S.of((4, 4)), "y": S.of((4, 4))}),
]


@pytest.mark.parametrize("case", WRONG_AXIOMS, ids=lambda c: c[0])
def test_a_wrong_axiom_is_caught(case):
    name, lhs, rhs, vars_, bind, shapes = case
    ax = Axiom(name, name, "parallel", rule_of(name, lhs, rhs, vars_), bind, shapes)
    assert not check_axiom(ax).ok


TRUE_RULES = [
    rule_of("relu_push", op("Relu", P("x")), P(op("Relu", "x")), DK),
    rule_of("fig2", op("MatMul", "x", "y"), op("Reduce", op("MatMul", P("x", -1), P("y", -2)), degree="$k"),
            {"k": "degree"}),
    rule_of("mlp", op("Linear", op("Relu", op("Linear", "x", "w1")), "w2"),
            op("Reduce", op("Linear", op("Relu", op("Linear", op("Replicate", "x", degree="$k"), P("w1", -1))),
                            P("w2", -2)), degree="$k"), {"k": "degree"}),
    rule_of("assoc", op("MatMul", op("MatMul", op("MatMul", "x", "y"), "z"), "w"),
            op("MatMul", "x", op("MatMul", "y", op("MatMul", "z", "w")))),
    rule_of("allreduce", op("Replicate", op("Reduce", op("Add", "x", "y"), degree="$k"), degree="$k"),
            op("AllReduce", op("Add", "x", "y"), degree="$k"), {"k": "degree"}),
]
FALSE_RULES = [
    rule_of("relu_reduce", op("Relu", op("Reduce", "x", degree="$k")), op("Reduce", op("Relu", "x"), degree="$k"),
            {"k": "degree"}),
    rule_of("mm_comm", op("MatMul", "x", "y"), op("MatMul", "y", "x")),
    rule_of("wrong_dim", op("Relu", P("x", -1)), P(op("Relu", "x"), -2), {"k": "degree"}),
    rule_of("linear_dp_last_dim", op("Linear", "x", "w"),
            op("Combine", op("Linear", P("x", "$d"), op("Replicate", "w", degree="$k")), dim="$d", degree="$k"), DK),
]


@pytest.mark.parametrize("rule", TRUE_RULES, ids=lambda r: r.name)
def test_true_rules_are_proven(rule):
    v = verify_rule(rule, timeout=20)
    assert v.proven, v
    assert v.axioms


@pytest.mark.parametrize("rule", FALSE_RULES, ids=lambda r: r.name)
def test_false_rules_are_refused(rule):
    assert not verify_rule(rule, timeout=2).proven


def test_mutants_of_shipped_rules_that_are_wrong_are_refused():
    """Issue point 4(a): >= 200 mutants; every numerically wrong one is refused by the verifier."""
    rs = cache.load()
    pool = valid_mutants(rs.rules, limit=900, seed=7)
    wrong = []
    kinds = set()
    for m in pool:
        if numerically_wrong(m):
            wrong.append(m)
            kinds.add(m.name.split("~")[-1].split(":")[0].rstrip("0123456789"))
        if len(wrong) >= 220:
            break
    assert len(wrong) >= 200, len(wrong)
    assert {"swap", "attr", "swapin", "drop"} <= kinds, kinds
    verdicts = verify_rules(wrong, timeout=0.2, workers=2)
    proven = [v.name for v in verdicts if v.proven]
    assert not proven, proven


@pytest.mark.slow
def test_many_mutants_with_a_large_budget_are_refused():
    rs = cache.load()
    wrong = [m for m in valid_mutants(rs.rules, limit=5000, seed=11) if numerically_wrong(m)][:400]
    assert len(wrong) >= 400
    verdicts = verify_rules(wrong, timeout=1.0, workers=2)
    proven = [v.name for v in verdicts if v.proven]
    assert not proven, proven


def test_reprove_shipped_cache_and_digest():
    """Issue point 4(c): the whole shipped cache re-proves (about 20 s on 2 cores); ``load`` checked its
    digest against the manifest."""
    rs = cache.load()
    vs = verify_rules(rs.rules, timeout=10, workers=2)
    bad = [v for v in vs if not v.proven]
    assert not bad, bad
    assert len(vs) == rs.manifest["counts"]["rules"]


# --- rules proved from a named axiom subset (megatron_attention_block) -----------------------------------------

def _template(name):
    from unity_pcg.substitutions.templates import template_rules
    return next(r for r in template_rules() if r.name == name)


def _attention_block():
    return _template("megatron_attention_block")


def _subset_names():
    from unity_pcg.substitutions.templates import AXIOM_SUBSETS
    return sorted(AXIOM_SUBSETS)


@pytest.mark.parametrize("name", _subset_names())
def test_template_is_proven_from_its_named_subset_and_the_cache_records_it(name):
    from unity_pcg.substitutions.templates import AXIOM_SUBSETS
    r = _template(name)
    v = verify_rule(r, timeout=10)
    assert v.proven and v.axiom_set == "subset", v
    assert set(v.axioms) <= set(AXIOM_SUBSETS[r.name])
    shipped = dict(cache.load().get(r.name).proof)
    assert shipped["status"] == "proven" and shipped["axiom_set"] == "subset"
    assert set(shipped["axioms"]) <= set(shipped["axiom_subset"]) == set(AXIOM_SUBSETS[r.name])
    names = {a.name for a in AXIOMS}
    assert set(shipped["axiom_subset"]) <= names      # every axiom of the subset is a self-checked one


def test_subset_proofs_do_not_depend_on_earlier_proofs_in_the_process():
    """A named subset is proved in a fresh Z3 context with left-side triggers: after many other proofs in
    the same process (as in a verify_rules worker) it still proves (in the shared context a subset proof
    came back "incomplete quantifiers" in some workers)."""
    from unity_pcg.substitutions.templates import template_rules
    rs = template_rules()
    for r in rs[:: max(1, len(rs) // 40)]:
        verify_rule(r, timeout=2)
    for name in _subset_names():
        v = verify_rule(_template(name), timeout=10)
        assert v.proven and v.axiom_set == "subset", v


def test_named_subset_is_restricted_to_the_given_axioms():
    """An axiom missing from the verifier's set is not used even if the subset names it: without
    Softmax_partition the block has no proof (the subset fails, the relevant set times out)."""
    r = _attention_block()
    without = [a for a in AXIOMS if a.name != "Softmax_partition"]
    assert not verify_rule(r, timeout=1.0, axioms=without).proven


def test_a_wrong_attention_block_is_not_proven_from_the_subset():
    """The output projection split on its columns instead of its rows (with the same Reduce) is wrong; the
    named subset does not prove it, nor does the relevant set."""
    from unity_pcg.substitutions.rule import PatNode, Pattern, Rule
    r = _attention_block()
    nodes = list(r.target.nodes)
    i = next(k for k, n in enumerate(nodes) if n.op == "Partition" and n.inputs == ("wo",))
    a = dict(nodes[i].attrs)
    nodes[i] = PatNode("Partition", tuple(sorted({**a, "dim": -1}.items())), nodes[i].inputs)
    bad = Rule(r.name + "_wrong", r.inputs, r.source, Pattern(tuple(nodes), r.target.outputs), r.vars,
               r.constraints, r.origin, r.proof, r.example)
    v = verify_rule(bad, timeout=1.0)
    assert not v.proven, v
