"""End to end over the IR: every tiny zoo model exported by PyTorch, imported, parallelized (data
parallel, degree 2) and evaluated piecewise must give the logical (single-device) result."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from unity_pcg.search.baselines import data_parallel  # noqa: E402
from unity_pcg import zoo  # noqa: E402
from unity_pcg.evaluate import evaluate, random_feeds  # noqa: E402
from unity_pcg.onnx_import import load_onnx  # noqa: E402


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_data_parallel_pieces_equal_logical(name, tmp_path):
    path = tmp_path / f"{name}.onnx"
    zoo.export(name, path, size="tiny", batch=4)
    g = load_onnx(str(path))
    pg = data_parallel(g, 2)
    counts = pg.op_counts()
    assert counts["Partition"] >= 1 and counts["Replicate"] >= 1
    # most operators really run on partitioned pieces (fallbacks are the exception)
    split = [n for n in pg.nodes() if n.kind == "compute" and any(s.piece_count > 1 for s in pg.shapes(n.id))]
    assert len(split) >= 0.8 * sum(1 for n in g.nodes() if n.kind == "compute"), pg.meta.get("fallbacks")
    feeds = random_feeds(g, seed=1, int_high=3)
    want = evaluate(g, feeds)
    got = evaluate(pg, feeds, mode="pieces")
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
