"""``replicate_merge`` (substitutions/templates.py): ``Replicate(Replicate(x, k), j) -> Replicate(x, k * j)``, proven
from the ``Replicate_compose`` axiom under a product constraint (``["$m", "==", ["*", "$k", "$j"]]``), shipped in
the rule cache, and applied by ``search.substitution.merge_copies_steps``."""
from __future__ import annotations

import dataclasses
import json

from unity_pcg.pcg import PCG
from unity_pcg.search.substitution import RuleBook, merge_copies_steps, replay
from unity_pcg.substitutions.rule import Rule
from unity_pcg.substitutions.templates import template_rules
from unity_pcg.verifier.verify import verify_rules


def _rule() -> Rule:
    return next(r for r in template_rules() if r.name == "replicate_merge")


def test_proven_and_a_wrong_product_is_not():
    r = _rule()
    assert verify_rules([r], 10.0, 1)[0].proven
    for wrong in (("*", "$k", "$k"), ("*", "$k", "$j", 2)):
        bad = dataclasses.replace(r, name="bad", constraints=(("$m", "==", wrong),))
        assert not verify_rules([bad], 10.0, 1)[0].proven


def test_product_constraint_checked_at_match_and_survives_json():
    r = _rule()
    assert r.check_constraints({"k": 2, "j": 3, "m": 6}) and not r.check_constraints({"k": 2, "j": 3, "m": 5})
    back = Rule.from_json(json.loads(json.dumps(r.to_json())))
    assert back.constraints == r.constraints and back.check_constraints({"k": 3, "j": 2, "m": 6})


def _copies_twice(k: int, j: int) -> PCG:
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (6, 4), "dtype": "float32"})
    w = b.add_node("Weight", {"name": "w", "shape": (4, 4), "dtype": "float32"})
    xr = b.add_node("Replicate", {"degree": k * j}, [(x, 0)])
    wr = b.add_node("Replicate", {"degree": j}, [(b.add_node("Replicate", {"degree": k}, [(w, 0)]), 0)])
    y = b.add_node("Linear", {"activation": "none"}, [(xr, 0), (wr, 0)])
    b.set_outputs([(y, 0)])
    return b.finish()


def test_merge_copies_writes_one_replicate_of_the_product_and_replays():
    book = RuleBook(None, (2, 3))
    g = _copies_twice(2, 3)
    h, steps = merge_copies_steps(g, book)
    assert [s.rule for s in steps] == ["replicate_merge"]
    reps = sorted(n.a["degree"] for n in h.nodes() if n.op == "Replicate")
    assert reps == [6, 6]
    assert h.shapes(h.outputs[0][0]) == g.shapes(g.outputs[0][0])
    assert replay(_copies_twice(2, 3), steps, book).structural_hash() == h.structural_hash()
