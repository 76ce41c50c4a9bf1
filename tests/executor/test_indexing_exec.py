"""Training a model built from the indexing/masking operators (Einsum, Where on a padding mask from Equal,
Trilu, CumSum, GatherElements, ScatterND, Tile) on 2 local gloo processes equals single-process training:
data parallel, and the einsum contraction split into partial sums (AllReduce) with everything after it
replicated.  Losses of 4 steps and final weights, relative 1e-4 (as tests/executor/test_equivalence.py)."""
from __future__ import annotations

import pytest

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H


def masks_model() -> str:
    torch = pytest.importorskip("torch")

    class Masks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 6) * 0.3)
            self.out = torch.nn.Linear(6, 3, bias=False)

        def forward(self, x, attn):
            h = torch.einsum("bsh,hd->bsd", x, self.w)                      # contraction over h
            s = torch.einsum("bqd,bkd->bqk", h, h)
            s = s.masked_fill(attn[:, None, :] == 0, -1e4)                   # Equal + Where
            p = torch.tril(torch.softmax(s, -1))                             # Trilu
            o = torch.einsum("bqk,bkd->bqd", p, h).cumsum(1)                 # CumSum
            idx = torch.tensor([[0], [3], [1]]).expand(3, 6)[None].expand(x.shape[0], 3, 6)
            g = torch.gather(o, 1, idx)                                      # GatherElements
            o = o.clone()
            o[:, 1] = g[:, 0]                                                # ScatterND
            return self.out(o.repeat(1, 2, 1))                               # Tile
    torch.manual_seed(3)
    return H.export(Masks(), (torch.randn(4, 4, 8), torch.ones(4, 4, dtype=torch.long)), "masks", ["x", "attn"])


def test_masks_model_two_processes_equal_one():
    path = masks_model()
    g = H.load(path)
    ops = {n.op for n in g.nodes()}
    assert {"Einsum", "Where", "Equal", "Trilu", "CumSum", "GatherElements", "ScatterND", "Tile"} <= ops, sorted(ops)
    first = next(n for n in g.nodes() if n.op == "Einsum")
    w = next(n.a["name"] for n in g.sources("Weight") if n.a["shape"] == (8, 6))
    rep = {n.a["name"]: [("Replicate", 2)] for n in g.sources() if n.a["name"] not in ("x", w)}
    contraction = H.rebuild(g, {"x": [("Partition", 2, 2)], w: [("Partition", 0, 2)], **rep},
                            after={first.id: [("AllReduce", 2)]})
    assert any(n.op == "Einsum" and contraction.shapes(n.id)[0].sum_degree == 2 for n in contraction.nodes())
    ref = H.reference(path, 4)
    got = H.run_cases(2, [H.case(H.make_plan(data_parallel(g, 2), path, 2), path, steps=4),
                          H.case(H.make_plan(contraction, path, 2), path, steps=4)])
    H.assert_same(ref, got[0], what="data parallel")
    H.assert_same(ref, got[1], what="einsum contraction split")
    assert ref[0][0] != ref[0][-1]
