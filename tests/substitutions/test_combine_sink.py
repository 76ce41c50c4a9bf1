"""``combine_sink_<Reduce|Replicate|AllReduce>`` and ``partition_replicate_commute`` (substitutions/templates.py):
a gather commutes with a sum or a copy, a split with a copy, at any two degrees; proven from the parallel
operators' commute axioms, shipped in the rule cache, and applied by ``search.substitution.sink_combines_steps``
(a Combine undone by a later Partition through sums and copies is sunk and cancelled).  ``trimmed`` takes an
output whose pieces are partial sums after an AllReduce of them."""
from __future__ import annotations

import pytest

from unity_pcg.pcg import PCG
from unity_pcg.search.substitution import RuleBook, replay, sink_combines_steps, trimmed
from unity_pcg.substitutions.cache import load
from unity_pcg.substitutions.templates import template_rules
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.verifier.verify import verify_rules

V = {"d": "dim", "k": "degree", "j": "degree"}
NAMES = ("combine_sink_Reduce", "combine_sink_Replicate", "combine_sink_AllReduce", "partition_replicate_commute")


def test_proven_shipped_and_a_swapped_degree_is_not():
    rules = [r for r in template_rules() if r.name in NAMES]
    assert sorted(r.name for r in rules) == sorted(NAMES)
    assert all(v.proven for v in verify_rules(rules, 10.0, 1))
    shipped = load().by_name()
    assert all(n in shipped and dict(shipped[n].proof)["status"] == "proven" for n in NAMES)
    # the degrees swapped on the right-hand side: false where they differ
    for p in ("Reduce", "Replicate", "AllReduce"):
        bad = rule_of("bad", op(p, op("Combine", "x", dim="$d", degree="$k"), degree="$j"),
                      op("Combine", op(p, "x", degree="$k"), dim="$d", degree="$j"), V)
        assert not verify_rules([bad], 10.0, 1)[0].proven, p
    bad = rule_of("bad", op("Partition", op("Replicate", "x", degree="$j"), dim="$d", degree="$k"),
                  op("Replicate", op("Partition", "x", dim="$d", degree="$j"), degree="$k"), V)
    assert not verify_rules([bad], 10.0, 1)[0].proven


def _chain(k: int, j: int, tail: str) -> PCG:
    """Rows split k ways with j partial sums (a row-parallel MatMul of a data-parallel stage), gathered, then
    all-reduced; then split again (``tail`` "Partition") or read whole (``tail`` "Relu")."""
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (8, 4 * j), "dtype": "float32"})
    w = b.add_node("Weight", {"name": "w", "shape": (4 * j, 4), "dtype": "float32"})
    xs = b.add_node("Partition", {"dim": 0, "degree": k}, [(b.add_node("Partition", {"dim": 1, "degree": j},
                                                                         [(x, 0)]), 0)])
    wp = b.add_node("Replicate", {"degree": k}, [(b.add_node("Partition", {"dim": 0, "degree": j}, [(w, 0)]), 0)])
    y = b.add_node("MatMul", {}, [(xs, 0), (wp, 0)])                     # rows split k, j partial sums
    c = b.add_node("Combine", {"dim": 0, "degree": k}, [(y, 0)])
    a = b.add_node("AllReduce", {"degree": j}, [(c, 0)])
    if tail == "Partition":
        z = b.add_node("Relu", {}, [(b.add_node("Partition", {"dim": 0, "degree": k}, [(a, 0)]), 0)])
        z = b.add_node("Combine", {"dim": 0, "degree": k}, [(z, 0)])
    else:
        z = b.add_node("Relu", {}, [(a, 0)])
    b.set_outputs([(z, 0)])
    return b.finish()


@pytest.mark.parametrize("k,j", [(2, 2), (2, 4), (4, 2)])
def test_a_gather_undone_later_is_sunk_and_cancelled(k, j):
    book = RuleBook(None, (k, j))
    g = _chain(k, j, "Partition")
    h, steps = sink_combines_steps(g, book)
    assert [s.rule for s in steps] == ["combine_sink_AllReduce", "partition_combine_cancel"]
    ar = next(n for n in h.nodes() if n.op == "AllReduce")
    assert h.node(ar.inputs[0][0]).op == "MatMul"                     # all-reduced where the pieces are
    assert sum(n.op == "Combine" for n in h.nodes()) == 1            # only the output's gather is left
    assert h.shapes(h.outputs[0][0]) == g.shapes(g.outputs[0][0])
    assert replay(_chain(k, j, "Partition"), steps, book).structural_hash() == h.structural_hash()


def test_a_gather_nothing_undoes_is_left():
    h, steps = sink_combines_steps(_chain(2, 2, "Relu"), RuleBook(None, (2,)))
    assert steps == [] and sum(n.op == "Combine" for n in h.nodes()) == 1


def test_trimmed_all_reduces_partial_sums_of_an_output():
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (8, 4), "dtype": "float32"})
    w = b.add_node("Weight", {"name": "w", "shape": (4, 4), "dtype": "float32"})
    y = b.add_node("MatMul", {}, [(b.add_node("Partition", {"dim": 1, "degree": 2}, [(x, 0)]), 0),
                                  (b.add_node("Partition", {"dim": 0, "degree": 2}, [(w, 0)]), 0)])
    b.set_outputs([(b.add_node("Reduce", {"degree": 2}, [(y, 0)]), 0)])
    t = trimmed(b.finish())
    out = t.node(t.outputs[0][0])
    assert out.op == "AllReduce" and t.node(out.inputs[0][0]).op == "MatMul"
    assert t.shape(t.outputs[0]).sum_degree == 1 and t.shape(t.outputs[0]).copy_degree == 2
