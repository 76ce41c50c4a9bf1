"""Activation memory counts only what the backward pass needs."""
from __future__ import annotations

from unity_pcg.search.memory import kept_fraction
from unity_pcg.pcg import PCG


def test_kept_fraction_follows_what_backward_saves():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 16)})
    w1 = b.add("Weight", {"name": "w1", "shape": (16, 32)})
    w2 = b.add("Weight", {"name": "w2", "shape": (32, 4)})
    h = b.add("Linear", {}, [x, w1])               # consumed by a view only: freed
    r = b.add("Reshape", {"shape": (8, 32)}, [h])   # consumed by Relu, which saves its output: freed
    a = b.add("Relu", {}, [r])                      # Relu saves its output: kept
    d = b.add("Dropout", {"ratio": 0.1}, [a])       # read by Linear (saves input 0): kept whole
    d2 = b.add("Dropout", {"ratio": 0.1}, [d])      # read by Add (saves nothing): only the mask
    y = b.add("Add", {}, [b.add("Linear", {}, [d2, w2]), b.add("Linear", {}, [d, w2])])
    b.set_outputs([y])
    g = b.finish()
    assert kept_fraction(g, h[0], 0) == 0.0
    assert kept_fraction(g, r[0], 0) == 0.0
    assert kept_fraction(g, a[0], 0) == 1.0
    assert kept_fraction(g, d[0], 0) == 1.0
    assert kept_fraction(g, d2[0], 0) == 1.0      # read by a Linear: saved
    assert kept_fraction(g, y[0], 0) == 1.0       # graph output


def test_dropout_feeding_only_an_add_keeps_its_mask():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 16)})
    w = b.add("Weight", {"name": "w", "shape": (16, 16)})
    h = b.add("Linear", {}, [x, w])
    d = b.add("Dropout", {"ratio": 0.1}, [h])
    y = b.add("Add", {}, [d, x])
    b.set_outputs([b.add("Relu", {}, [y])])
    g = b.finish()
    assert kept_fraction(g, d[0], 0) == 0.25      # one byte per float32 element
    assert kept_fraction(g, y[0], 0) == 0.0       # Relu saves its output, not its input
