"""RandomNormal / RandomUniform (unity_pcg/ops/random_gen.py): the counter-based draw has the right
distribution, any block of it is the logical tensor's block, a PCG that partitions a generator's output
evaluates piecewise to its logical value (drawn or stand-in), and the cost/memory models know the operators."""
from __future__ import annotations

import numpy as np
import pytest

from unity_pcg import ops
from unity_pcg.counter_rng import hash_index, np_logical_index, stream_key
from unity_pcg.evaluate import evaluate, random_ops
from unity_pcg.ops.random_gen import draw
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape

NORMAL = {"shape": (200, 100), "dtype": "float64", "mean": 1.5, "scale": 0.5, "seed": -1, "key": 99}
UNIFORM = {"shape": (200, 100), "dtype": "float64", "low": -2.0, "high": 3.0, "seed": -1, "key": 98}


def test_the_draws_have_their_distributions():
    z = draw("RandomNormal", NORMAL, seed=4)
    assert abs(z.mean() - 1.5) < 0.02 and abs(z.std() - 0.5) < 0.02
    assert abs(np.mean(np.abs(z - 1.5) < 0.5) - 0.6827) < 0.02          # one sigma
    u = draw("RandomUniform", UNIFORM, seed=4)
    assert u.min() > -2.0 and u.max() < 3.0 and abs(u.mean() - 0.5) < 0.05
    assert abs(np.mean(u < 0.0) - 0.4) < 0.02
    # neighbouring elements, two nodes, two seeds: uncorrelated
    f = z.ravel()
    assert abs(np.corrcoef(f[:-1], f[1:])[0, 1]) < 0.03
    assert abs(np.corrcoef(u.ravel(), f)[0, 1]) < 0.03
    assert abs(np.corrcoef(draw("RandomNormal", NORMAL, seed=5).ravel(), f)[0, 1]) < 0.03


def test_a_block_is_the_logical_tensors_block():
    idx = np_logical_index((5, 6, 7), (1, 2, 3), (3, 2, 4))
    whole = np_logical_index((5, 6, 7))
    np.testing.assert_array_equal(idx, whole[1:4, 2:4, 3:7])
    a = {**NORMAL, "shape": (8, 6)}
    w = draw("RandomNormal", a, seed=2, step=5)
    for off, piece in (((0, 0), (4, 6)), ((4, 3), (4, 3)), ((2, 1), (1, 1))):
        b = draw("RandomNormal", a, seed=2, step=5, offset=off, piece=piece)
        np.testing.assert_array_equal(b, w[off[0]:off[0] + piece[0], off[1]:off[1] + piece[1]])
    # the key of stream 0 is Dropout's (executor/dropout.py): (seed, step, node)
    assert stream_key(3, 7, 11) == ((3 * 0x9E3779B1) ^ (7 * 0x85EBCA77) ^ (11 * 0xC2B2AE3D)) & 0xFFFFFFFF
    h = hash_index(stream_key(3, 7, 11), whole)
    assert h.min() >= 0 and h.max() < 2 ** 32 and len(np.unique(h)) == h.size


def _partitioned(op, attrs, degree=2):
    """x + Generator, both split on dim 0 (the generator by a Partition after it), then combined."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": attrs["shape"], "dtype": attrs["dtype"]})
    xp = b.add("Partition", {"dim": 0, "degree": degree}, [x])
    r = b.add(op, attrs)
    rp = b.add("Partition", {"dim": 0, "degree": degree}, [r])
    y = b.add("Add", {}, [xp, rp])
    b.set_outputs([b.add("Combine", {"dim": 0, "degree": degree}, [y])])
    return b.finish()


@pytest.mark.parametrize("op, attrs", [("RandomNormal", {**NORMAL, "shape": (6, 4)}),
                                       ("RandomUniform", {**UNIFORM, "shape": (6, 4), "dtype": "float32"})])
def test_piecewise_evaluation_equals_logical(op, attrs):
    g = _partitioned(op, attrs)
    assert random_ops(g) == {op: 1}
    x = {"x": np.random.default_rng(0).standard_normal((6, 4)).astype(attrs["dtype"])}
    for random in ("draw", "standin"):
        for seed in (0, 3):
            lg = evaluate(g, x, random=random, seed=seed)[0]
            pc = evaluate(g, x, mode="pieces", random=random, seed=seed)[0]
            np.testing.assert_array_equal(pc, lg)
    np.testing.assert_allclose(evaluate(g, x)[0] - x["x"], draw(op, attrs, seed=0), rtol=1e-5, atol=1e-6)
    stand = attrs.get("mean", (attrs.get("low", 0.0) + attrs.get("high", 1.0)) / 2)
    np.testing.assert_allclose(evaluate(g, x, random="standin")[0], x["x"] + stand, rtol=1e-6)


def test_attributes_are_checked_in_one_line():
    from unity_pcg.errors import InvalidParallelization
    for attrs, words in (({"shape": (2,), "dtype": "int64"}, "dtype must be"),
                         ({"shape": (2, -1)}, "invalid shape"), ({"shape": (2,), "key": -1}, "key"),
                         ({"shape": (2,), "mean": "a"}, "mean must be a number"), ({}, "shape")):
        with pytest.raises(InvalidParallelization, match=words) as e:
            ops.infer("RandomNormal", attrs, [])
        assert "\n" not in str(e.value)


def test_cost_and_memory_models_know_the_generators():
    from unity_pcg.search.cost import CostModel, GraphCost, op_class
    from unity_pcg.search.memory import SAVES_INPUTS
    from unity_pcg.machine import parse_machine
    assert op_class("RandomNormal") == op_class("RandomUniform") == "elementwise"
    assert SAVES_INPUTS["RandomNormal"] == SAVES_INPUTS["RandomUniform"] == set()
    s = ParallelTensorShape.of((6, 4))
    assert ops.flops("RandomNormal", {"shape": (6, 4)}, [], [s]) == 24.0
    g = _partitioned("RandomNormal", {**NORMAL, "shape": (6, 4)})
    gc = GraphCost(g, CostModel(parse_machine("local:1x2")))
    gen = next(n.id for n in g.nodes() if n.op == "RandomNormal")
    assert gc.role[gen] == "compute" and not gc._needs_grad[gen]
