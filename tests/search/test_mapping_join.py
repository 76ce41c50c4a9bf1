"""The DP's joint pricing of a k-way parallel split and the join that reads every branch
(``MachineMapper._series_join``) against exhaustive enumeration under the same cost model."""
import math

import pytest

from search.baselines import data_parallel
from search.cost import CostModel
from search.mapping import MachineMapper, exhaustive_mapping
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG


def k_branches(k=4, depth=1, batch=8, h=16, widths=None, join="Concat"):
    """x -> k independent branches (Linear, then Relu for depth 2) -> one node reading all k -> Tanh."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    x = b.add("Relu", {}, [x], name="stem")
    outs = []
    for i in range(k):
        wd = widths[i] if widths else h
        w = b.add("Weight", {"name": f"w{i}", "shape": (h, wd)})
        y = b.add("Linear", {}, [x, w], name=f"fc{i}")
        if depth > 1:
            y = b.add("Relu", {}, [y], name=f"relu{i}")
        outs.append(y)
    if join == "Concat":
        y = b.add("Concat", {"axis": 1}, outs, name="concat")
    else:
        y = outs[0]
        for o in outs[1:]:
            y = b.add("Add", {}, [y, o])
    y = b.add("Tanh", {}, [y], name="tail")
    b.set_outputs([y])
    return b.finish()


CASES = [
    ("4way-none", lambda: k_branches(4), "local:1x2"),
    ("4way-dp2", lambda: data_parallel(k_branches(4), 2), "local:1x2"),
    ("4way-uneven-2nodes", lambda: k_branches(4, batch=64, h=256, widths=(256, 64, 512, 128)), "summit:2x1"),
    ("4way-add-chain", lambda: k_branches(4, batch=64, h=128, join="Add"), "summit:2x1"),
    ("3way-deep-none", lambda: k_branches(3, depth=2, batch=32, h=128, widths=(128, 32, 256)), "summit:1x3"),
    ("4way-side-by-side-2x2", lambda: k_branches(4, batch=64, h=512, widths=(512, 64, 1024, 128)), "summit:2x2"),
    ("4way-side-by-side-1x3", lambda: k_branches(4, batch=64, h=256, widths=(256, 64, 512, 128)), "summit:1x3"),
    ("3way-deep-dp2", lambda: data_parallel(k_branches(3, depth=2, batch=64, h=128), 2), "summit:2x1"),
]


@pytest.mark.parametrize("name,make,machine", CASES, ids=[c[0] for c in CASES])
def test_join_dp_equals_exhaustive(name, make, machine, monkeypatch):
    g = make()
    model = CostModel(parse_machine(machine))
    calls = []
    orig = MachineMapper._series_join
    monkeypatch.setattr(MachineMapper, "_series_join", lambda self, *a: calls.append(1) or orig(self, *a))
    r = MachineMapper(model).optimize(g)
    assert calls, "the join was not solved jointly"
    best, views = exhaustive_mapping(g, model)
    assert math.isfinite(best)
    assert r.cost == pytest.approx(best, rel=1e-12, abs=1e-15)
    # the returned views reproduce the cost when priced leaf by leaf (no side by side) or less
    ev = MachineMapper(model).evaluate(g, r.views)
    assert ev.cost >= r.cost * (1 - 1e-12)
