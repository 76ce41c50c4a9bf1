"""Data parallelism by proven rules through Concats of 3..32 inputs (issue 7 point 1).

Inception-v3's branch joins (4 to 6 inputs), DLRM's (1 + tables), XDL's (16 features) and CANDLE-Uno's (7 towers)
feature joins are n-input Concats; ``dp_Concat`` covers 2. The ``dp_Concat_<n>`` templates are proven on one
``Concat<n>_partition`` axiom each, and the verifier selects axioms by (operator, number of inputs), so those axioms
never reach a rule whose Concats have another arity (they raised the cost of verifying the old rules by ~28% when
selected by name only). The four zoo models at tiny size reach data parallelism by rules, equal to the hand-built
baseline, and the rule sequence replays on a fresh import.
"""
import pytest

from unity_pcg.pcg import PCG
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.substitution import RuleBook, data_parallel_steps, normalized_hash, replay, trimmed
from unity_pcg.substitutions import cache
from unity_pcg.substitutions.apply import apply_match
from unity_pcg.substitutions.match import find_matches
from unity_pcg.substitutions.templates import template_rules
from unity_pcg.verifier.axioms import AXIOMS, CONCAT_ARITIES
from unity_pcg.verifier.verify import relevant_axioms, relevant_axioms_by_name, signatures, verify_rule

from .test_soundness import check_instance

NARY = [f"dp_Concat_{n}" for n in range(3, 17)]          # written out: a template dropped must fail here


@pytest.fixture(scope="module")
def shipped():
    return cache.load()


@pytest.fixture(scope="module")
def book(shipped):
    return RuleBook(shipped, (2,))


def _nary_axiom_names(axs):
    return {a.name for a in axs if a.name.startswith("Concat") and a.name[6:7].isdigit()}


def test_nary_concat_rules_are_shipped_proven_on_their_own_axiom(shipped):
    assert tuple(range(3, 33)) == CONCAT_ARITIES
    by = shipped.by_name()
    for n, name in zip(CONCAT_ARITIES, NARY):
        r = by[name]
        assert r.origin == "template" and r.example
        assert len(r.source.nodes[0].inputs) == n
        proof = dict(r.proof)
        assert proof.get("status") == "proven", name
        assert f"Concat{n}_partition" in proof["axioms"], (name, proof["axioms"])
    assert not shipped.stale


@pytest.mark.parametrize("name", ["dp_Concat_3", "dp_Concat_7", "dp_Concat_16", "dp_Concat_25"])
def test_nary_concat_rule_applies_to_its_example_and_evaluates_equal(shipped, name):
    assert check_instance(shipped.get(name), seed=3, degree=None)


def test_axioms_are_selected_by_arity():
    rules = {r.name: r for r in template_rules()}
    two = relevant_axioms(rules["dp_Concat"])
    assert not _nary_axiom_names(two)
    # selected by name only, every n-ary Concat axiom reached the 2-input rule (the cost measured today)
    assert _nary_axiom_names(relevant_axioms_by_name(rules["dp_Concat"])) == {
        f"Concat{n}_{kind}" for n in CONCAT_ARITIES for kind in ("partition", "replicate")}
    for n in (3, 9, 16):
        got = relevant_axioms(rules[f"dp_Concat_{n}"])
        assert _nary_axiom_names(got) == {f"Concat{n}_partition", f"Concat{n}_replicate"}
        assert not any(a.name == "Concat_partition" for a in got)     # the 2-input one cannot fire on it
    # the arity filter only drops: it keeps a subset of the by-name selection, for every kind of rule
    for r in list(rules.values())[::7]:
        names = {a.name for a in relevant_axioms(r)}
        assert names <= {a.name for a in relevant_axioms_by_name(r)}, r.name
        # every axiom kept mentions, besides parallel operators, only signatures of the rule or of kept axioms
        kept_sigs = signatures(r) | {s for a in relevant_axioms(r) for s in signatures(a.rule)}
        assert all(signatures(a.rule) <= kept_sigs for a in relevant_axioms(r))


def test_the_nary_rule_is_not_provable_without_its_axiom():
    """The proof depends on the arity-matched axiom: without it (only the 2-input Concat axioms), no proof."""
    r = {x.name: x for x in template_rules()}["dp_Concat_4"]
    assert verify_rule(r, 1.0).proven
    without = tuple(a for a in AXIOMS if a.name != "Concat4_partition")
    assert not verify_rule(r, 1.0, without).proven


def _concat_graph(n, axis, batch=4, same=False):
    b = PCG.builder()
    xs = [b.add("Input", {"name": f"x{i}", "shape": (batch, 2 if same else 1 + i % 3)}) for i in range(n)]
    b.set_outputs([b.add("Relu", {}, [b.add("Concat", {"axis": axis}, xs)])])
    return b.finish()


@pytest.mark.parametrize("n", [3, 5, 16, 25, 32])
def test_data_parallel_through_an_nary_concat_equals_the_baseline(book, n):
    g = _concat_graph(n, 1)
    pg, steps = data_parallel_steps(g, 2, book)
    assert f"dp_Concat_{n}" in {s.rule for s in steps}
    assert normalized_hash(trimmed(pg)) == normalized_hash(data_parallel(g, 2))
    assert replay(g, steps, book).structural_hash() == pg.structural_hash()


def test_nary_concat_is_never_partitioned_along_its_axis(shipped):
    """A Concat along dim 0 joins batches: partitioning dim 0 of every input is not a partition of the output
    (the rule's constraint d != a); partitioning the other dim is, and applies."""
    g = _concat_graph(4, 0, same=True)
    ms = find_matches(shipped.get("dp_Concat_4"), g, degrees=[2])
    assert ms and all(m.binding["d"] % 2 != m.binding["a"] % 2 for m in ms)
    applied = [apply_match(g, m) for m in ms]
    parts = {n.a["dim"] % 2 for h in applied for n in h.nodes() if n.op == "Partition"}
    assert parts == {1}
    # and data parallelism by rules leaves that Concat whole (the sample dim does not survive it)
    pg, steps = data_parallel_steps(g, 2, RuleBook(shipped, (2,)))
    assert "dp_Concat_4" not in {s.rule for s in steps}


ZOO = ["dlrm", "xdl", "candle_uno", pytest.param("inception_v3", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    pytest.importorskip("torch")
    return tmp_path_factory.mktemp("zoo")


def _export(zoo_dir, name):
    from unity_pcg import zoo
    path = zoo_dir / f"{name}.onnx"
    if not path.exists():
        zoo.export(name, str(path), size="tiny")
    return str(path)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_reaches_data_parallelism_by_rules(book, zoo_dir, name):
    from unity_pcg.onnx_import import load_onnx
    path = _export(zoo_dir, name)
    g = load_onnx(path, load_weights=False)
    arities = {len(n.inputs) for n in g.nodes() if n.op == "Concat"}
    assert arities and max(arities) >= 3, arities          # the models this is about
    pg, steps = data_parallel_steps(g, 2, book)
    used = {s.rule for s in steps}
    assert {f"dp_Concat_{a}" if a > 2 else "dp_Concat" for a in arities} <= used, (arities, used)
    assert normalized_hash(trimmed(pg)) == normalized_hash(data_parallel(g, 2))
    fresh = load_onnx(path, load_weights=False)
    assert replay(fresh, steps, book).structural_hash() == pg.structural_hash()


@pytest.mark.parametrize("name", ["dlrm", pytest.param("xdl", marks=pytest.mark.slow), "candle_uno",
                                  pytest.param("inception_v3", marks=pytest.mark.slow)])
def test_joint_search_on_zoo_model_reaches_data_parallelism_by_rules(book, zoo_dir, name):
    """The search's plan is reached by rules (not the hand-built baseline), no slower than data parallelism, and
    its rule sequence replays on a fresh import. (Tiny Inception-v3 on 2 devices: the search's plan, its branches
    on different devices with no parallel operator, is predicted faster than data parallelism.)"""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.optimize import optimize
    path = _export(zoo_dir, name)
    res = optimize(path, "summit:1x2", budget_s=120, max_candidates=4, pipeline=False)
    assert res.feasible and res.dp is not None and res.dp.feasible
    assert "baseline" not in str(res.stats.get("chosen", "")), res.stats.get("chosen")
    assert res.plan.rules is not None and len(res.plan.rules) == len(res.steps)
    fresh = load_onnx(path, load_weights=False)
    assert replay(fresh, res.steps, book, trim_outputs=True).structural_hash() == res.plan.pcg.structural_hash()
    g = load_onnx(path, load_weights=False)
    assert (normalized_hash(res.plan.pcg) == normalized_hash(data_parallel(g, 2))
            or res.predicted_iteration_s < res.dp.cost)
    assert res.predicted_iteration_s <= res.dp.cost * (1 + 1e-9)
