"""Small hand-built PCGs for the search tests."""
from __future__ import annotations

import numpy as np

from unity_pcg.pcg import PCG


def mlp(batch=8, h=16, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    w = {f"w{i}": rng.standard_normal((h, h)).astype("float32") for i in range(layers)} if h <= 256 else {}
    b = PCG.builder(w)
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    for i in range(layers):
        wi = b.add("Weight", {"name": f"w{i}", "shape": (h, h)})
        x = b.add("Linear", {}, [x, wi], name=f"fc{i}")
        x = b.add("Relu", {}, [x], name=f"relu{i}")
    b.set_outputs([x])
    return b.finish()


def diamond(batch=8, h=16):
    """x -> fc_a -> relu  and  x -> fc_b ; add: series-parallel."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    wa = b.add("Weight", {"name": "wa", "shape": (h, h)})
    wb = b.add("Weight", {"name": "wb", "shape": (h, h)})
    a = b.add("Linear", {}, [x, wa], name="fc_a")
    a = b.add("Relu", {}, [a], name="relu_a")
    c = b.add("Linear", {}, [x, wb], name="fc_b")
    y = b.add("Add", {}, [a, c], name="add")
    b.set_outputs([y])
    return b.finish()


def n_shape(batch=8, h=16):
    """Not series-parallel: a->c, a->d, b->d (the 'N' graph), with a, b reading one input."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    a = b.add("Relu", {}, [x], name="a")
    bb = b.add("Tanh", {}, [x], name="b")
    c = b.add("Sigmoid", {}, [a], name="c")
    d = b.add("Add", {}, [a, bb], name="d")
    e = b.add("Mul", {}, [c, d], name="e")
    b.set_outputs([e])
    return b.finish()


def two_branches(batch=8, h=32):
    """Two independent heavy branches from one input joined by an add (side-by-side candidates)."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    outs = []
    for k in range(2):
        w = b.add("Weight", {"name": f"w{k}", "shape": (h, h)})
        y = b.add("Linear", {}, [x, w], name=f"fc{k}")
        outs.append(b.add("Relu", {}, [y], name=f"relu{k}"))
    b.set_outputs([b.add("Add", {}, outs, name="add")])
    return b.finish()


def shared_weight(batch=8, h=16):
    """One weight read by two layers (tied weights): its placement is a boundary of a series split."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    w = b.add("Weight", {"name": "w", "shape": (h, h)})
    y = b.add("Linear", {}, [x, w], name="fc0")
    y = b.add("Relu", {}, [y], name="relu")
    y = b.add("Linear", {}, [y, w], name="fc1")
    b.set_outputs([y])
    return b.finish()


def same_function(g: PCG, pg: PCG, seed: int = 0, int_high: int = 8) -> bool:
    """``pg`` (evaluated piecewise) computes what ``g`` computes on seeded inputs; weights without values
    get random ones."""
    from unity_pcg.evaluate import evaluate, random_feeds
    feeds = random_feeds(g, seed=seed, int_high=int_high)
    rng = np.random.default_rng(seed + 1)
    for n in g.sources("Weight"):
        if n.a["name"] not in g.weights and n.a["name"] not in feeds:
            feeds[n.a["name"]] = rng.standard_normal(n.a["shape"]).astype("float32")
    a = evaluate(g, feeds)
    b = evaluate(pg, feeds, mode="pieces", rng=np.random.default_rng(seed))
    return all(np.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(a, b))
