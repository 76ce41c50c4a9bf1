"""Plans for the runtime tests (run CLI, checkpoints, robustness, pipelines), built by hand from a tiny
ONNX MLP: one device, data parallel, and a pipeline of single-device stages."""
from __future__ import annotations

import os

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg import plan as P
from unity_pcg.machine import MachineView, Resource, parse_machine
from unity_pcg.onnx_import import load_onnx


DIMS = (16, 32, 32, 8)


def tiny_mlp(dims=DIMS, seed: int = 0):
    """A Linear/ReLU MLP with seeded weights (the same module every call)."""
    import torch
    from torch import nn
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers.append(nn.Linear(a, b))
        if i + 2 < len(dims):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def tiny_mlp_onnx(path: str, batch: int = 8, dims=DIMS, seed: int = 0) -> str:
    """:func:`tiny_mlp` exported with the TorchScript exporter (static shapes, input "x")."""
    import torch
    m = tiny_mlp(dims, seed).eval()
    torch.onnx.export(m, (torch.randn(batch, dims[0]),), path, input_names=["x"], output_names=["y"],
                      dynamo=False, opset_version=17)
    return path


def reference_losses(model_path: str, steps: int, optimizer: str = "sgd", lr: float = 0.01, seed: int = 0,
                     data: str | None = None, dims=DIMS, first_step: int = 0, loss: str | None = None):
    """Plain PyTorch training of :func:`tiny_mlp` on the executor's feeds (executor.data): the losses
    and the final parameters (by ONNX initializer name: "0.weight", ...)."""
    import torch
    import torch.nn.functional as F

    from unity_pcg.executor.data import open_data
    m = tiny_mlp(dims)
    g = load_onnx(model_path, load_weights=False)
    src = open_data(g, data, seed=seed)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(m.parameters(), lr=lr)
    losses = []
    for s in range(first_step, first_step + steps):
        feeds, t = src.feeds(s)
        y = m(torch.as_tensor(feeds["x"]))
        kind = loss or ("mean" if t is None else "ce" if t.dtype.kind in "iu" else "mse")
        if kind == "mean":
            lv = y.mean()
        elif kind == "ce":
            lv = F.cross_entropy(y, torch.as_tensor(t).long())
        elif kind == "bce":
            lv = F.binary_cross_entropy_with_logits(y, torch.as_tensor(t))
        else:
            lv = F.mse_loss(y, torch.as_tensor(t))
        opt.zero_grad()
        lv.backward()
        opt.step()
        losses.append(float(lv.detach()))
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def _save(g, views, model: str, out: str, machine, pipeline=None, predicted=None) -> str:
    pl = P.Plan(os.path.abspath(model), P.file_sha256(model), machine, g, views,
                predicted or {"predicted_iteration_s": 1e-3}, pipeline)
    pl.save(out)
    return out


def one_device_plan(model: str, out: str) -> str:
    g = load_onnx(model, load_weights=False)
    m = parse_machine("local:1x2")
    r = MachineMapper(CostModel(m)).optimize(g, resource=Resource(0, 1, 1))
    return _save(g, r.views, model, out, m, predicted=r.to_json())


def dp_plan(model: str, out: str, degree: int = 2) -> str:
    g = data_parallel(load_onnx(model, load_weights=False), degree)
    m = parse_machine(f"local:1x{degree}")
    r = MachineMapper(CostModel(m)).optimize(g)
    return _save(g, r.views, model, out, m, predicted=r.to_json())


def pipeline_plan(model: str, out: str, stages: int = 2, micro_batches: int = 2) -> str:
    """Compute nodes cut into ``stages`` contiguous runs (topological order), stage i on device i."""
    g = load_onnx(model, load_weights=False)
    m = parse_machine(f"local:1x{stages}")
    r = MachineMapper(CostModel(m)).optimize(g, resource=Resource(0, 1, 1))
    comp = [n.id for n in g.nodes() if n.kind == "compute"]
    per = -(-len(comp) // stages)
    groups = [comp[i * per:(i + 1) * per] for i in range(stages)]
    views = {}
    for i, nodes in enumerate(groups):
        for nid in nodes:
            views[nid] = MachineView(i, r.views[nid].dims)
    field = {"schedule": "1F1B", "micro_batches": micro_batches,
             "stages": [{"nodes": nodes, "devices": [i]} for i, nodes in enumerate(groups)]}
    return _save(g, views, model, out, m, pipeline=field, predicted=r.to_json())


def searched_pipeline_plan(model: str, out: str, stages: int = 2, micro_batches: int = 2,
                           devices: int | None = None, preset: str = "local") -> str:
    """A pipeline plan as the search writes it (search.pipeline.search_pipeline on PRESET:1xD, forced to
    ``stages`` stages): its stitched PCG, views and ``pipeline`` field."""
    from unity_pcg.search.pipeline import search_pipeline
    g = load_onnx(model, load_weights=False)
    m = parse_machine(f"{preset}:1x{devices or stages}")
    r = search_pipeline(g, CostModel(m), min_stages=stages, max_stages=stages, micro_batches=micro_batches)
    assert r is not None and r.feasible, "the search found no pipeline"
    return _save(r.pcg, r.views, model, out, m, pipeline=r.to_plan_field(), predicted=r.to_json())
