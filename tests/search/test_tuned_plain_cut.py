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


def test_a_cut_plain_solve_is_mapped_without_the_dp_within_the_walks_deadline(monkeypatch):
    """The plain point's DP solve gets PLAIN_SHARE of the walk's time; cut there, its mapping without the DP
    (``cheap``: first views, then the memory techniques' choice, a search) runs inside the walk's deadline, so
    that choice stops there (then none) instead of running on to the budget's hard end."""
    from types import SimpleNamespace

    from unity_pcg.search import baselines, budget

    clock = [0.0]
    pg = SimpleNamespace(meta={"tp": 8})
    monkeypatch.setattr(baselines, "build_strategy", lambda *a, **k: pg)

    class _Mapper:
        machine = SimpleNamespace(num_devices=8, devices_per_node=8)

        def optimize(self, g, **kw):
            clock[0] += 10.0            # the solve outlasts its share
            budget.check()
            raise AssertionError("the solve was not cut")

    seen = []

    def cheap(g):
        seen.append(budget.current())
        return SimpleNamespace(views={0: None}, reason="")
    t = object.__new__(tuned._Tuner)
    t.g, t.mapper, t.machine, t.stats, t.cheap = None, _Mapper(), _Mapper.machine, {}, cheap
    t.deadline = Deadline(5.0, lambda: clock[0])
    lay = t._whole(0, plain=True, sp=False)
    assert lay.mapping is not None and t.stats["plain_mapping"].startswith("without the DP")
    assert seen == [t.deadline]
