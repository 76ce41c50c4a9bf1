"""The plain point's technique pricing (search/tuned.py ``price_layout(..., cut=True)``) stops at its
deadline (a fake clock): the first combination is priced, the rest left out and counted; without the cut
every combination is priced."""
from __future__ import annotations

from unity_pcg.search import tuned
from unity_pcg.search.budget import Deadline


class _Tech:
    available = True
    recompute = ("none", "selective", "full")


def _tuner(clock, at):
    t = object.__new__(tuned._Tuner)
    t.strategy, t.tech, t.per_region = "megatron", _Tech(), False
    t._pp1_layouts, t.points, t.priced, t.stats = {}, [], [], {"technique_points": 0}
    t.deadline = Deadline(at, lambda: clock[0])

    def price(lay, cfg):           # each combination takes one second of the fake clock
        clock[0] += 1.0
        return tuned._Point(cfg, 2.0, False, "out of memory", 1, {}, lay)
    t._price_whole = price
    return t


def test_plain_pricing_stops_at_the_deadline():
    clock = [0.0]
    t = _tuner(clock, at=1.5)
    lay = tuned._Layout(2, 1, 4, 1, mapping=object())
    pts = t.price_layout(lay, 4, cut=True)
    n = len(t.combos())
    assert n == 6 and len(pts) == 2            # priced at 0 and 1 s; at 2 s the deadline has passed
    assert t.stats["plain_cut"] == n - 2 and t.stats["technique_points"] == 2


def test_without_cut_every_combination_is_priced():
    clock = [0.0]
    t = _tuner(clock, at=1.5)
    pts = t.price_layout(tuned._Layout(2, 1, 4, 1, mapping=object()), 4)
    assert len(pts) == len(t.combos()) and "plain_cut" not in t.stats
