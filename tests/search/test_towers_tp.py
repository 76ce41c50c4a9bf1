"""Megatron's column -> row templates by rules on CANDLE-Uno's shape (feature towers joined by a Concat):
the Replicate before the join lifts into every tower, so each tower ends in one AllReduce."""
from __future__ import annotations

from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search.optimize import search_degrees
from unity_pcg.search.substitution import RuleBook, data_parallel_steps, replay, tensor_parallel_steps, trimmed


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
    book = RuleBook(None, search_degrees(m))
    x, st = data_parallel_steps(g, 3, book)
    fg, st2 = tensor_parallel_steps(x, 2, book)
    steps = list(st) + list(st2)
    used = {s.rule for s in steps}
    assert "replicate_lift_Concat_3" in used, used
    ops = [n.op for n in trimmed(fg).nodes()]          # the output's own Reduce and Combine trail it
    assert ops.count("AllReduce") == 3 and "Reduce" not in ops
    assert not any(n.op == "Replicate" and fg.node(n.inputs[0][0]).op == "Concat" for n in fg.nodes())
    assert replay(_towers(), steps).structural_hash() == fg.structural_hash()
