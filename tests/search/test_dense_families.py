"""The Megatron families of a small dense model at every tensor-parallel degree of the machine
(``optimize.whole_tp_degrees``): CANDLE-Uno's best layout (k = 4 on dp 12 at summit:8x6, faster than Alpa's
8 x 6 plan in the same cost model) has a degree that is neither the node count, the devices per node nor 2."""
from __future__ import annotations

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search import optimize as opt
from unity_pcg.search.optimize import machine_degrees, megatron_seed_degrees, optimize, whole_tp_degrees
from unity_pcg.search.substitution import RuleBook, replay, trimmed

from .test_tp_seed import _chain as _small_chain


def _chain(pairs: int = 2, batch: int = 768, h: int = 4096) -> PCG:
    """Linear (no bias) -> Relu, 2 * pairs times: CANDLE-Uno's dense layers (at its width)."""
    return _small_chain(pairs, batch, h)


def test_whole_tp_degrees_cover_the_machine_smallest_first():
    m = parse_machine("summit:8x6")
    got = whole_tp_degrees(m, machine_degrees(m))
    assert list(got.values()) == [2, 3, 4, 6, 8, 12, 16, 24]          # every k < 48, smallest first
    assert all(d * k == 48 for d, k in got.items())
    seeds = megatron_seed_degrees(m, machine_degrees(m))
    assert seeds.items() <= got.items() and 4 not in seeds.values()
    # a degree that divides no Linear weight's output features is left out (CANDLE-Uno: 4192 = 2^5 x 131, 1)
    assert list(whole_tp_degrees(m, machine_degrees(m), widths={4192, 1}).values()) == [2, 4, 8, 16]
    # only data-parallel degrees the batch allows
    m = parse_machine("summit:2x6")
    assert whole_tp_degrees(m, [2, 4, 6, 12]) == {6: 2, 4: 3, 2: 6}


def _price(g, m, d, k):
    ev = opt.Evaluator(m, "sgd", limit_s=None)
    book = RuleBook(None, opt.search_degrees(m))
    got = opt._whole_family(g, book, d, k, opt.tensor_parallel_steps)
    return None if got is None else ev.cost(trimmed(got[0]), limited=False)


def test_dense_family_at_a_degree_the_megatron_seeds_miss_wins_and_replays():
    """summit:2x6, two 4096-wide pairs at batch 768: tensor parallel 4 (2 devices x 2 nodes) on dp 3 is
    predicted faster than every family of megatron_seed_degrees (k = 2 on dp 6; k = 6 does not divide 4096)
    and than the fixed strategies; the search returns it, by rules, and its sequence replays."""
    m = parse_machine("summit:2x6")
    g = _chain()
    tp4 = _price(g, m, 3, 4)
    old = [c for d, k in megatron_seed_degrees(m, machine_degrees(m)).items()
           if (c := _price(g, m, d, k)) is not None]
    assert old and tp4 < 0.8 * min(old)
    r = optimize(g, m, budget_s=20, pipeline=False, optimizer="sgd", max_candidates=10)
    assert r.stats["chosen"] == "seed family tp4x3 whole by rules"
    assert r.predicted_iteration_s == pytest.approx(tp4, rel=1e-9)
    assert r.plan.rules and any(s.rule.startswith("megatron_mlp_column_") for s in r.steps)
    z = replay(_chain(), r.steps, RuleBook(None, opt.search_degrees(m)), trim_outputs=True)
    assert z.structural_hash() == r.plan.pcg.structural_hash()


def test_models_with_embedding_tables_keep_the_megatron_seed_degrees(monkeypatch):
    """DLRM and XDL (tables) do not get the extra whole-graph families (their budget goes to the
    tables-by-columns families): the dense condition checks for Embedding."""
    seen = []
    real = opt._whole_family

    def spy(g, book, d, tp, fn):
        seen.append((fn.__name__, tp))
        return real(g, book, d, tp, fn)
    monkeypatch.setattr(opt, "_whole_family", spy)
    b = PCG.builder()
    ix = b.add_node("Input", {"name": "i", "shape": (96, 3), "dtype": "int64"})
    t = b.add_node("Weight", {"name": "t", "shape": (64, 64), "dtype": "float32"})
    e = b.add_node("Embedding", {}, [(ix, 0), (t, 0)])
    s = b.add_node("ReduceSum", {"axes": (1,), "keepdims": False}, [(e, 0)])
    x = (s, 0)
    for i in range(2):
        w = b.add_node("Weight", {"name": f"w{i}", "shape": (64, 64), "dtype": "float32"})
        x = (b.add_node("Relu", {}, [(b.add_node("Linear", {"activation": "none"}, [x, (w, 0)]), 0)]), 0)
    b.set_outputs([x])
    m = parse_machine("summit:2x6")
    optimize(b.finish(), m, budget_s=8, pipeline=False, optimizer="sgd", max_candidates=2)
    tps = sorted(k for f, k in seen if f == "tensor_parallel_steps")
    assert tps == sorted(megatron_seed_degrees(m, machine_degrees(m)).values())


def _towers(batch: int = 96, h: int = 64, towers: int = 3) -> PCG:
    """CANDLE-Uno's shape: ``towers`` feature towers (Linear -> Relu, twice), joined by a Concat, then two Linears."""
    b = PCG.builder()
    outs = []
    for t_ in range(towers):
        t = (b.add_node("Input", {"name": f"x{t_}", "shape": (batch, h), "dtype": "float32"}), 0)
        for i in range(2):
            w = b.add_node("Weight", {"name": f"w{t_}_{i}", "shape": (h, h), "dtype": "float32"})
            t = (b.add_node("Relu", {}, [(b.add_node("Linear", {"activation": "none"}, [t, (w, 0)]), 0)]), 0)
        outs.append(t)
    t = (b.add_node("Concat", {"axis": 1}, outs), 0)
    for i, (k, n) in enumerate(((towers * h, h), (h, h))):
        w = b.add_node("Weight", {"name": f"d{i}", "shape": (k, n), "dtype": "float32"})
        t = (b.add_node("Linear", {"activation": "none"}, [t, (w, 0)]), 0)
    b.set_outputs([t])
    return b.finish()


def test_the_towers_end_in_one_allreduce_each():
    """The Replicate before the first layer after the join lifts into every tower (``replicate_lift_Concat_<n>``),
    so each tower's row-parallel Linear ends in one AllReduce (as Alpa's CANDLE-Uno plan), not a Reduce each and a
    broadcast of the join: no Replicate is left on a Concat's output, and the family replays."""
    m = parse_machine("summit:1x6")
    g = _towers()
    book = RuleBook(None, opt.search_degrees(m))
    fg, steps = opt._whole_family(g, book, 3, 2, opt.tensor_parallel_steps)
    used = {s.rule for s in steps}
    assert "replicate_lift_Concat_3" in used, used
    ops = [n.op for n in trimmed(fg).nodes()]          # the output's own Reduce and Combine trail it
    assert ops.count("AllReduce") == 3 and "Reduce" not in ops
    assert not any(n.op == "Replicate" and fg.node(n.inputs[0][0]).op == "Concat" for n in fg.nodes())
    assert replay(_towers(), steps).structural_hash() == fg.structural_hash()
