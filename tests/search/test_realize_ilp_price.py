"""ILP layouts reached by rules at the ILP's price (search/realize.py's finish): the rules' sequence may write a
layout with more parallel operators than the ILP (a batch gather before a feature gather that the next operator
splits again; a gather with several readers, one of which splits it again; partial sums split onto more devices
and then summed instead of reduce-scattered).  By outcome: on small graphs the realized plan is complete, priced
as the ILP's layout, and its rule sequence replays; the rules it needs are proven and shipped."""
from __future__ import annotations

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.cost import CostModel
from unity_pcg.search.layouts import propose
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.realize import NodeLayout, layout_of, realize
from unity_pcg.search.split import synthetic_chain, synthetic_transformer
from unity_pcg.search.substitution import RuleBook, replay, trimmed
from unity_pcg.substitutions.cache import load
from unity_pcg.substitutions.templates import template_rules
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.verifier.verify import verify_rules

BOOK = RuleBook()
NAMES = ("combine_sink_Combine", "combine_sink_Partition", "partition_combine_cancel_shared")


def test_rules_proven_shipped_and_wrong_variants_refused():
    rules = [r for r in template_rules() if r.name in NAMES]
    assert sorted(r.name for r in rules) == sorted(NAMES)
    assert all(v.proven for v in verify_rules(rules, 10.0, 1))
    shipped = load().by_name()
    assert all(n in shipped and dict(shipped[n].proof)["status"] == "proven" for n in NAMES)
    V = {"d": "dim", "e": "dim", "k": "degree", "j": "degree"}
    # the gathers' degrees swapped: false where they differ
    bad = rule_of("bad", op("Combine", op("Combine", "x", dim="$d", degree="$k"), dim="$e", degree="$j"),
                  op("Combine", op("Combine", "x", dim="$e", degree="$k"), dim="$d", degree="$j"), V,
                  [("$d", "!=", "$e")])
    assert not verify_rules([bad], 10.0, 1)[0].proven
    bad = rule_of("bad", op("Partition", op("Combine", "x", dim="$d", degree="$k"), dim="$e", degree="$j"),
                  op("Combine", op("Partition", "x", dim="$e", degree="$k"), dim="$d", degree="$j"), V,
                  [("$d", "!=", "$e")])
    assert not verify_rules([bad], 10.0, 1)[0].proven
    # a split of another dim does not undo the gather
    c = op("Combine", "x", dim="$d", degree="$k")
    bad = rule_of("bad", (c, op("Partition", c, dim="$e", degree="$k")), (c, "x"), V, [("$d", "!=", "$e")])
    assert not verify_rules([bad], 10.0, 1)[0].proven


@pytest.mark.parametrize("make,machine,mesh", [
    (lambda: synthetic_transformer(2, batch=8), "local:1x2", (1, 2)),     # residual reads a shared gather
    (lambda: synthetic_transformer(1, batch=8), "h100:1x4", (2, 2)),      # + a reduce-scatter of partial sums
    # batch x features on a 2-D mesh: the row-parallel Linears' sums reduce-scattered on the features
    (lambda: synthetic_chain(6, batch=12288, h=8192), "summit:8x6", (8, 6)),
])
def test_ilp_layout_by_rules_at_the_ilp_price(make, machine, mesh):
    g = make()
    m = parse_machine(machine)
    mapper = MachineMapper(CostModel(m))
    p = propose(g, m, mesh, mapper=mapper, time_limit_s=30)
    assert p.pcg is not None, p.status
    r = realize(g, p.pcg, BOOK)
    assert r.complete, r.missing
    want = layout_of(p.pcg, g)
    assert all(NodeLayout.of(r.pcg, r.ids[k]) == want[k] for k in want)
    assert replay(g, r.steps, BOOK).structural_hash() == r.pcg.structural_hash()
    got = mapper.optimize(trimmed(r.pcg)).cost
    ilp = mapper.optimize(p.pcg).cost
    assert got <= ilp * (1 + 1e-9), (got, ilp)


def test_add_templates_proves_and_appends_what_the_cache_lacks(tmp_path):
    from unity_pcg.substitutions.cache import add_templates, save
    shipped = load()
    keep = [r for r in shipped.rules if r.name != "combine_sink_Partition"]
    extra = {k: v for k, v in shipped.manifest.items() if k not in ("schema", "op_set_hash", "digest", "counts")}
    save(keep, tmp_path, extra)
    rs, added = add_templates(tmp_path, log=lambda *_: None)
    assert added == ["combine_sink_Partition"]
    got = rs.by_name()["combine_sink_Partition"]
    assert dict(got.proof)["status"] == "proven" and "Partition_Combine_commute" in dict(got.proof)["axioms"]
    assert len(rs) == len(shipped) and rs.manifest["stats"]["proven"] == len(shipped)
    assert add_templates(tmp_path, log=lambda *_: None)[1] == []          # nothing left to add
