"""BatchNorm's running statistics in training: updated with the model's momentum from the batch statistics
(synchronized over the devices that split the batch or spatial dims: SyncBatchNorm semantics; unbiased
variance for the running variance, as torch), kept under the ONNX initializers' names in the model state."""
from __future__ import annotations

import numpy as np

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H
from . import models

STEPS = 4
LR = 0.05


def _torch_reference(path: str, steps: int):
    """torch's own training of the same network (F.batch_norm with running statistics, momentum 0.2)."""
    import torch
    import torch.nn.functional as F

    from unity_pcg.evaluate import random_feeds
    g = H.load(path)
    w = {k: torch.tensor(np.array(v() if callable(v) else v)) for k, v in g.weights.items()}
    params = {k: w[k].clone().requires_grad_(True) for k in ("conv.weight", "conv.bias", "bn.weight", "bn.bias",
                                                               "conv2.weight")}
    rm, rv = w["bn.running_mean"].clone(), w["bn.running_var"].clone()
    losses = []
    for s in range(steps):
        x = torch.tensor(random_feeds(g, seed=s)["x"])
        y = F.conv2d(x, params["conv.weight"], params["conv.bias"])
        y = F.batch_norm(y, rm, rv, params["bn.weight"], params["bn.bias"], training=True, momentum=0.2)
        loss = F.conv2d(torch.relu(y), params["conv2.weight"]).mean()
        loss.backward()
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    state = {k: v.detach().numpy() for k, v in params.items()}
    state.update({"bn.running_mean": rm.numpy(), "bn.running_var": rv.numpy()})
    return losses, state


def test_single_process_running_statistics_equal_torch():
    path = models.bn_net()
    got = H.reference(path, STEPS, lr=LR)
    ref = _torch_reference(path, STEPS)
    H.assert_same(ref, got, rtol=1e-5, what="one process vs torch")
    init = H.load(path).weights["bn.running_mean"]
    init = np.asarray(init() if callable(init) else init)
    assert not np.allclose(got[1]["bn.running_mean"], init)   # the statistics move


def test_running_statistics_of_split_plans_equal_one_device():
    """Batch split, height split and channel split on 2 ranks: losses, weights and running statistics equal
    one process; per-device statistics (--per-device-bn) keep rank 0's own, which differ."""
    path = models.bn_net()
    g = H.load(path)
    ref = H.reference(path, STEPS, lr=LR)
    rep = {n.a["name"]: [("Replicate", 2)] for n in g.sources("Weight")}
    chan = {"x": [("Replicate", 2)], "conv.weight": [("Partition", 0, 2)], "conv.bias": [("Partition", 0, 2)],
            "bn.weight": [("Partition", 0, 2)], "bn.bias": [("Partition", 0, 2)],
            "bn.running_mean": [("Partition", 0, 2)], "bn.running_var": [("Partition", 0, 2)],
            "conv2.weight": [("Partition", 1, 2)]}
    plans = [("batch split", data_parallel(g, 2)),
             ("height split", H.rebuild(g, {"x": [("Partition", 2, 2)], **rep})),
             ("channel split", H.rebuild(g, chan))]
    cases = [H.case(H.make_plan(pg, path, 2), path, steps=STEPS, lr=LR) for _, pg in plans]
    cases.append(H.case(H.make_plan(data_parallel(g, 2), path, 2), path, steps=STEPS, lr=LR, sync_batchnorm=False))
    got = H.run_cases(2, cases)
    for (name, _), o in zip(plans, got):
        H.assert_same(ref, o, what=name)
    per_dev = got[-1][1]
    assert not np.allclose(per_dev["bn.running_mean"], ref[1]["bn.running_mean"], rtol=1e-4)
    assert np.all(np.isfinite(per_dev["bn.running_var"]))
