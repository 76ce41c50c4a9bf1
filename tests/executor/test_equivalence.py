"""Training with a plan on 2 and 4 local gloo processes equals single-process training of the same
ONNX model: the losses of 5 steps and the final weights (relative 1e-4).

Plans come from proven rules of the shipped cache (data parallel, Megatron column->row pair,
reduction parallel, attention heads) or from parallel operators put on the model's inputs and
weights where no rule introduces that form (spatial convolution, embedding-table parallel, hybrids);
views come from the machine mapper.  Each test launches its processes once and trains many cases.
"""
from __future__ import annotations

import numpy as np
import pytest

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H
from . import models


def _heads(g, m):
    return m.binding.get("d") == -3       # split the heads dim of (batch, heads, seq, dim)


def test_data_parallel_two_processes_equals_one():
    path = models.mlp()
    g = H.load(path)
    ref = H.reference(path, 5)
    ref_adam = H.reference(path, 5, optimizer="adam", lr=0.01)
    plan = H.make_plan(data_parallel(g, 2), path, 2)
    got = H.run_cases(2, [H.case(plan, path), H.case(plan, path, optimizer="adam", lr=0.01),
                          # DDP-style overlap (the GPU default): tiny buckets launched from gradient hooks
                          H.case(plan, path, overlap=True, bucket_bytes=300, first_bucket_bytes=100)])
    H.assert_same(ref, got[0], what="dp sgd")
    H.assert_same(ref_adam, got[1], what="dp adam")
    H.assert_same(ref, got[2], what="dp sgd, overlapped buckets")
    assert ref[0][0] != ref[0][-1]        # the losses move: training happens


def test_plan_kinds_two_processes_equal_one():
    mlp, att, conv, emb = models.mlp_nobias(), models.attention(), models.convnet(), models.embedding()
    gm, ga, gc, ge = H.load(mlp), H.load(att), H.load(conv), H.load(emb)
    ws = lambda g: {n.a["name"]: [("Replicate", 2)] for n in g.sources("Weight")}   # noqa: E731
    plans = {
        "megatron column->row": (H.apply_rule(gm, "megatron_mlp_column_row"), mlp),
        "megatron pair ending in AllReduce": (H.rebuild(gm, {"x": [("Replicate", 2)], "a.weight": [("Partition", 1, 2)],
                                                            "b.weight": [("Partition", 0, 2)],
                                                            "c.weight": [("Replicate", 2)]},
                                                        after={5: [("AllReduce", 2)]}), mlp),
        "megatron pair at the output, AllReduce": (H.rebuild(gm, {"x": [("Replicate", 2)], "a.weight": [("Replicate", 2)],
                                                                  "b.weight": [("Partition", 1, 2)],
                                                                  "c.weight": [("Partition", 0, 2)]},
                                                              after={7: [("AllReduce", 2)]}), mlp),
        "reduction parallel (row linear)": (H.apply_rule(gm, "megatron_row_linear", index=1), mlp),
        "attention heads": (H.apply_rule(ga, "megatron_attention_heads", pick=_heads), att),
        "spatial conv (height split) + sync batchnorm": (H.rebuild(gc, {"x": [("Partition", 2, 2)], **ws(gc)}), conv),
        "embedding-table parallel": (H.rebuild(ge, {"idx": [("Replicate", 2)], "emb.weight": [("Partition", 1, 2)],
                                                    "lin.weight": [("Partition", 0, 2)]}), emb),
    }
    from unity_pcg.search.baselines import build_strategy
    plans.update({
        "baseline strategy megatron (attention)": (build_strategy(ga, "megatron", 2), att),
        "baseline strategy expert (embedding table)": (build_strategy(ge, "expert", 2), emb),
    })
    cases, refs, names = [], [], []
    ref_cache = {}
    for name, (g, path) in plans.items():
        cases.append(H.case(H.make_plan(g, path, 2), path))
        if path not in ref_cache:
            ref_cache[path] = H.reference(path, 5)
        refs.append(ref_cache[path])
        names.append(name)
    # model parallel without partitioning: layers alternate between the two devices (point-to-point)
    base = H.make_plan(gm, mlp, 2)
    views = H.with_views(base.views, gm, lambda n: n.id % 2)
    cases.append(H.case(H.make_plan(gm, mlp, 2, views=views), mlp))
    refs.append(ref_cache[mlp])
    names.append("layers on alternating devices")
    # targets: mean square (float) and cross-entropy (class indices) on replicated, reduced and split outputs
    rng = np.random.default_rng(7)
    mse = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(5)]
    ce = [rng.integers(0, 4, (8,)).astype(np.int64) for _ in range(5)]
    for name in ("megatron column->row", "megatron pair ending in AllReduce", "megatron pair at the output, AllReduce"):
        g, path = plans[name]
        for tname, tg in (("mse", mse), ("cross-entropy", ce)):
            cases.append(H.case(H.make_plan(g, path, 2), path, targets=tg))
            refs.append(H.reference(path, 5, targets=tg))
            names.append(f"{name}, {tname} loss")
    cases.append(H.case(H.make_plan(data_parallel(gm, 2), mlp, 2), mlp, targets=ce))
    refs.append(H.reference(mlp, 5, targets=ce))
    names.append("data parallel, cross-entropy loss")
    got = H.run_cases(2, cases)
    for name, r, o in zip(names, refs, got):
        H.assert_same(r, o, what=name)


def test_plan_kinds_four_processes_equal_one():
    mlp, att, drop = models.mlp_nobias(), models.attention(), models.dropout_mlp()
    gm, ga, gd = H.load(mlp), H.load(att), H.load(drop)
    hybrid = {"x": [("Partition", 0, 2), ("Replicate", 2)], "a.weight": [("Partition", 1, 2), ("Replicate", 2)],
              "b.weight": [("Partition", 0, 2), ("Replicate", 2)], "c.weight": [("Replicate", 4)]}
    plans = [
        ("data parallel x4", data_parallel(gm, 4), mlp),
        ("megatron column->row x4", H.apply_rule(gm, "megatron_mlp_column_row", degree=4), mlp),
        ("hybrid: batch x2 times megatron x2", H.rebuild(gm, hybrid, after={5: [("AllReduce", 2)]}), mlp),
        ("attention heads x2 then data parallel", H.apply_rule(data_parallel(ga, 2), "megatron_attention_heads",
                                                               pick=_heads), att),
        ("dropout, batch split x4", data_parallel(gd, 4), drop),
        ("dropout, column split x2 times batch x2",
         H.rebuild(gd, {"x": [("Partition", 0, 2), ("Replicate", 2)], "w1": [("Partition", 1, 2), ("Replicate", 2)],
                        "b1": [("Partition", 0, 2), ("Replicate", 2)], "w2": [("Partition", 0, 2), ("Replicate", 2)]}),
         drop),
    ]
    refs = {p: H.reference(p, 5) for p in (mlp, att, drop)}
    got = H.run_cases(4, [H.case(H.make_plan(g, p, 4), p) for _, g, p in plans])
    for (name, _, p), o in zip(plans, got):
        H.assert_same(refs[p], o, what=name)


def test_dropout_drops_and_batchnorm_statistics_are_synchronized():
    """Dropout is active (training differs from the inference-mode model) and draws the same mask
    under two partitionings; BatchNorm over a partitioned batch equals one device only with
    synchronized statistics (per-device statistics give a different, documented result)."""
    drop, conv = models.dropout_mlp(), models.convnet()
    gd, gc = H.load(drop), H.load(conv)
    ref_d = H.reference(drop, 5)
    ref_c = H.reference(conv, 5)
    cases = [H.case(H.make_plan(data_parallel(gd, 2), drop, 2), drop),
             H.case(H.make_plan(H.rebuild(gd, {"x": [("Replicate", 2)], "w1": [("Partition", 1, 2)],
                                               "b1": [("Partition", 0, 2)], "w2": [("Partition", 0, 2)]}), drop, 2),
                    drop),
             H.case(H.make_plan(data_parallel(gc, 2), conv, 2), conv),
             H.case(H.make_plan(data_parallel(gc, 2), conv, 2), conv, sync_batchnorm=False)]
    got = H.run_cases(2, cases)
    H.assert_same(ref_d, got[0], what="dropout, batch split")
    H.assert_same(ref_d, got[1], what="dropout, column split")
    H.assert_same(ref_c, got[2], what="batchnorm, batch split, synchronized statistics")
    assert not np.allclose(got[3][0], ref_c[0], rtol=1e-4), "per-device statistics should differ"
    # dropout is really active: the first loss differs from the inference-mode numpy reference
    from unity_pcg.evaluate import evaluate, random_feeds
    y = evaluate(gd, random_feeds(gd, seed=0))[0]
    assert abs(float(y.mean()) - ref_d[0][0]) > 1e-4


def test_model_and_optimizer_state_round_trip_continues_identically():
    """Adam on a Megatron plan (a weight read on one device only, others split): training 3 steps,
    handing model_state/optimizer_state to fresh Trainers and training 2 more equals 5 steps on one
    process."""
    path = models.mlp_nobias()
    g = H.apply_rule(H.load(path), "megatron_mlp_column_row")
    plan = H.make_plan(g, path, 2)
    ref = H.reference(path, 5, optimizer="adam", lr=0.01)
    got = H.run_dist(2, H._resume_worker, plan.to_json(), path, 3, 2, "adam", 0.01)[0]
    H.assert_same(ref, got, what="resumed adam")


def _layout_worker(rank: int, world: int, megatron_json: dict, dp_json: dict, model: str):
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.train import Trainer
    meg = Trainer(plan_mod.from_json(megatron_json), model, rank=rank, world=world)
    dp = Trainer(plan_mod.from_json(dp_json), model, rank=rank, world=world)
    meg.step()
    dp.step()
    flats = [f.data_ptr() for f in dp._flat.values()]
    sizes = [f.numel() * f.element_size() for f in dp._flat.values()]
    in_bucket = {n: any(a <= p.grad.data_ptr() < a + s for a, s in zip(flats, sizes)) for n, p in dp.params.items()}
    return ({n: tuple(p.shape) for n, p in meg.params.items()}, in_bucket,
            {n: tuple(t.shape) for n, t in meg.model_state().items()})


def test_ranks_hold_their_shards_and_data_parallel_grads_live_in_the_buckets():
    """What makes the executor as fast as torch's own parallelism: under the Megatron pair a rank holds only
    its column / row block of the two weights (no full-size gradient or update), while model_state still
    gives the full tensors; under data parallelism every gradient is a view of a bucket buffer (nothing is
    copied into the bucket or back)."""
    path = models.mlp_nobias()
    g = H.load(path)
    meg = H.make_plan(H.apply_rule(g, "megatron_mlp_column_row"), path, 2)
    dp = H.make_plan(data_parallel(g, 2), path, 2)
    shapes, in_bucket, full = H.run_dist(2, _layout_worker, meg.to_json(), dp.to_json(), path)[0]
    whole = {n.a["name"]: tuple(n.a["shape"]) for n in g.sources("Weight")}
    halved = [n for n, s in shapes.items() if s != whole[n]]
    assert len(halved) == 2, shapes                       # the column- and the row-parallel weight
    for n in halved:
        assert sorted(a * 2 if a != b else a for a, b in zip(shapes[n], whole[n])) == sorted(whole[n])
    assert full == {n: whole[n] for n in full}
    assert in_bucket and all(in_bucket.values()), in_bucket
