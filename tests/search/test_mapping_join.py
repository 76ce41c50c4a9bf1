"""The DP's joint pricing of a k-way parallel split and the join that reads every branch
(``MachineMapper._series_join``) against exhaustive enumeration under the same cost model."""
import math

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper, exhaustive_mapping
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


def _random_join_graph(rng):
    """A random k-way split (k = 2..4) of Linear branches of random widths, some with a Relu, joined by
    a Concat that sometimes also reads the stem (a node of the series state)."""
    b = PCG.builder()
    batch, h = rng.choice([16, 64, 128]), rng.choice([64, 256])
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    x = b.add("Relu", {}, [x], name="stem")
    outs = []
    for i in range(rng.choice([2, 3, 4])):
        w = b.add("Weight", {"name": f"w{i}", "shape": (h, rng.choice([16, 64, 256, 512]))})
        y = b.add("Linear", {}, [x, w], name=f"fc{i}")
        if rng.random() < 0.3:
            y = b.add("Relu", {}, [y])
        outs.append(y)
    if rng.random() < 0.3:
        outs.append(x)
    y = b.add("Concat", {"axis": 1}, outs, name="concat")
    b.set_outputs([b.add("Tanh", {}, [y])])
    return b.finish()


@pytest.mark.parametrize("seed", range(8))
def test_random_joins_dp_equals_exhaustive(seed):
    import random
    rng = random.Random(seed)
    g = _random_join_graph(rng)
    machine = rng.choice(["summit:2x1", "summit:1x2", "summit:1x3", "local:1x2"])
    if rng.random() < 0.4:
        g = data_parallel(g, 2)
    model = CostModel(parse_machine(machine))
    best, _ = exhaustive_mapping(g, model, limit=300_000)
    assert MachineMapper(model).optimize(g).cost == pytest.approx(best, rel=1e-12, abs=1e-15)


def nested_join(batch=64, h=128):
    """Inception-like: a 3-way split whose first branch splits again (two ops joined by a Concat)
    before the outer Concat reads every branch end."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    x = b.add("Relu", {}, [x], name="stem")
    w0 = b.add("Weight", {"name": "w0", "shape": (h, h)})
    y0 = b.add("Linear", {}, [x, w0], name="fc0")
    a = b.add("Sigmoid", {}, [y0], name="inner_a")
    c = b.add("Tanh", {}, [y0], name="inner_b")
    y0 = b.add("Concat", {"axis": 1}, [a, c], name="inner_join")
    w1 = b.add("Weight", {"name": "w1", "shape": (h, 2 * h)})
    y1 = b.add("Linear", {}, [x, w1], name="fc1")
    y2 = b.add("Relu", {}, [x], name="branch2")
    y = b.add("Concat", {"axis": 1}, [y0, y1, y2], name="outer_join")
    b.set_outputs([b.add("Tanh", {}, [y], name="tail")])
    return b.finish()


@pytest.mark.parametrize("machine,dp", [("local:1x2", False), ("summit:2x1", False), ("summit:1x2", True)])
def test_nested_joins_dp_equals_exhaustive(machine, dp):
    g = nested_join()
    if dp:
        g = data_parallel(g, 2)
    model = CostModel(parse_machine(machine))
    best, _ = exhaustive_mapping(g, model, limit=500_000)
    assert MachineMapper(model).optimize(g).cost == pytest.approx(best, rel=1e-12, abs=1e-15)
