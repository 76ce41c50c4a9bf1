import numpy as np
import pytest

from search.baselines import StrategyError, build_strategy, data_parallel
from unity_pcg.evaluate import evaluate
from unity_pcg.pcg import PCG

from .graphs import diamond, mlp


def _close(a, b):
    return all(np.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(a, b))


@pytest.mark.parametrize("d", [2, 4])
def test_dp_graph_computes_the_same_function(d):
    g = mlp(batch=8, h=16, layers=2)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype("float32")
    ref = evaluate(g, {"x": x})
    pg = data_parallel(g, d)
    ops = pg.op_counts()
    assert ops["Partition"] == 1 and ops["Replicate"] == 2 and ops["Combine"] == 1
    lin = [n for n in pg.nodes() if n.op == "Linear"]
    assert all(pg.shapes(n.id)[0].degrees[0] == d for n in lin)
    out = evaluate(pg, {"x": x}, mode="pieces", rng=np.random.default_rng(0))
    assert _close(ref, out)
    assert pg.shape(pg.outputs[0]).piece_count == 1


def test_dp_falls_back_where_an_op_refuses_a_partitioned_batch():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 3, 2)})
    y = b.add("Relu", {}, [x], name="r")
    z = b.add("Softmax", {"axis": 0}, [y], name="flat")        # normalizes along the batch dim
    b.set_outputs([b.add("Tanh", {}, [z], name="t")])
    g = b.finish()
    pg = data_parallel(g, 2)
    assert "flat" in pg.meta["fallbacks"]
    xv = np.random.default_rng(0).standard_normal((4, 3, 2)).astype("float32")
    assert _close(evaluate(g, {"x": xv}), evaluate(pg, {"x": xv}, mode="pieces", rng=np.random.default_rng(0)))


def test_dp_errors_and_none():
    g = diamond(batch=6)
    with pytest.raises(StrategyError, match="not divisible"):
        data_parallel(g, 4)
    assert build_strategy(g, "none") is g
    assert build_strategy(g, "dp", 1) is g
    with pytest.raises(StrategyError):
        build_strategy(g, "zero")
    with pytest.raises(StrategyError, match="logical PCG"):
        build_strategy(data_parallel(g, 2), "dp", 2)
