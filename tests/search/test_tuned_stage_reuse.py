"""The tuned grid's mapper (search/tuned.py ViewReuse): a pipeline stage identical to one already solved (a
model's middle stages, up to node ids and names) on a block moved by whole nodes takes that solve, renamed
and moved -- it must price every stage exactly as a fresh DP does."""
import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer
from unity_pcg.search.tuned import _Tuner, techniques


class _Never(dict):
    """A memo that never hits (the fresh-solve reference)."""

    def get(self, key, default=None):
        return default


def _tuner(g, m):
    return _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron", None, techniques())


# 4 nodes of 2: pp = 4 stages of one node each (whole-node moves); one node of 8: stages of 2 devices moved
# inside the node
@pytest.mark.parametrize("preset", ["h100:4x2", "h100:1x8"])
def test_moved_stage_mappings_price_like_fresh_solves(preset):
    g = synthetic_transformer(8, batch=32, seq=64, hidden=256, heads=8)
    m = parse_machine(preset)
    fast, ref = _tuner(g, m), _tuner(g, m)
    ref.reuse._solved = _Never()
    ref.reuse._evaluated = _Never()
    n = 0
    # the last point: the micro-batch reuse sees the moved views too (a second micro-batch count solves
    # nothing new), and its identical stages take one another's evaluated prices, moved
    for tp, pp, M in ((2, 4, 4), (1, 4, 8), (2, 2, 4), (2, 4, 8)):
        if (tp, pp, M) == (2, 4, 8):
            n = fast.stats.get("moved", 0)
        a, b = fast.pipeline(tp, pp, M), ref.pipeline(tp, pp, M)
        assert a.reason == b.reason
        assert a.ev is not None and b.ev is not None
        for pa, pb in zip(a.ev["priced"], b.ev["priced"]):
            assert math.isfinite(pa.t)
            assert (pa.t, pa.once, pa.w, pa.a, pa.a_in) == (pb.t, pb.once, pb.w, pb.a, pb.a_in)
            assert pa.views == pb.views
        assert a.ev["cost"] == b.ev["cost"] and a.ev["memory"] == b.ev["memory"]
    assert fast.stats.get("moved", 0) == n >= 2 and not ref.stats.get("moved")
