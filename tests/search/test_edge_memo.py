"""GraphCost's edge prices memoized per cost model (CostModel._edge_memo, keyed by GraphCost._edge_key) are
exactly the prices each graph computes on its own: Alpa's ILP priced with the memo against the same ILP with
it disabled (every fragment graph pricing its edges itself, the path before the memo)."""
import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.alpa import intra
from unity_pcg.search.alpa.intra import IntraProblem
from unity_pcg.search.cost import CostModel

from .graphs import diamond, mlp
from .test_alpa_intra import _attention


class _NoMemo(dict):
    """A memo that never keeps anything: every lookup misses."""

    def __setitem__(self, key, value):
        pass


def _prices(g, machine, mesh, precision="fp32"):
    intra._SHARED.clear()
    p = IntraProblem(g, machine, mesh, precision=precision, idle=True)
    nodes = {a: list(p.node_cost[a]) for a in p.anchors}
    mems = {a: list(p.node_mem[a]) for a in p.anchors}
    edges = [p.edge_matrices(e)[2].tolist() for e in range(len(p.edges))]
    intra._SHARED.clear()
    return nodes, mems, edges


CASES = [
    (lambda: mlp(batch=16, h=32, layers=3), "dgx-a100:1x8", (2, 4), "fp32"),
    (lambda: diamond(batch=16, h=32), "h100:2x4", (2, 4), "fp32"),
    (lambda: _attention(), "h100:2x4", (2, 4), "bf16"),
    (lambda: _attention(), "h100:4x2", (1, 8), "fp32"),
    (lambda: mlp(batch=32, h=16, layers=2), "h100:2x8", (4, 4), "fp32"),
]


@pytest.mark.parametrize("make,machine,mesh,precision", CASES)
def test_memoized_edge_prices_equal_unmemoized(make, machine, mesh, precision, monkeypatch):
    g = make()
    m = parse_machine(machine)
    memo = _prices(g, m, mesh, precision)
    init = CostModel.__init__

    def no_memo_init(self, *a, **k):
        init(self, *a, **k)
        self._edge_memo = _NoMemo()

    monkeypatch.setattr(CostModel, "__init__", no_memo_init)
    plain = _prices(g, m, mesh, precision)
    assert any(x > 0 for row in memo[2] for r in row for x in r if x != float("inf"))   # collectives priced
    assert memo == plain        # the same floats, not approximately
