"""Losses and data as users have them: ``--loss mean|mse|ce|bce|output`` (explicit or derived, checked
before start), data folders (memory-mapped ``NAME.npy``, ``NAME/*.npy`` shards) read by each rank for the
rows its pieces need only, and bad data refused before any process starts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from unity_pcg.search.baselines import data_parallel

from . import dist_helpers as H
from . import models
from .runtime_plans import dp_plan, one_device_plan, pipeline_plan, reference_losses, tiny_mlp_onnx

STEPS = 4
LR = 0.05


# --- the Trainer: each loss on 1 and 2 processes equals a torch reference ---------------------------------

def _data(kind: str, rng):
    feeds = [{"x": rng.standard_normal((8, 8)).astype(np.float32)} for _ in range(STEPS)]
    if kind == "mse":
        tg = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(STEPS)]
    elif kind == "bce":
        tg = [(rng.random((8, 4)) < 0.5).astype(np.float32) for _ in range(STEPS)]
    elif kind == "ce":
        tg = [rng.integers(0, 4, (8,)).astype(np.int64) for _ in range(STEPS)]
    else:
        tg = None
    return feeds, tg


def _torch_reference(path: str, kind: str, feeds, targets):
    """mlp_nobias (relu(x A) B C, the PCG's weight layout) trained by plain torch with SGD."""
    import torch
    import torch.nn.functional as F
    w = H.load(path).weights
    ps = {n: torch.tensor(np.array(w[n]() if callable(w[n]) else w[n]), requires_grad=True)
          for n in ("a.weight", "b.weight", "c.weight")}
    opt = torch.optim.SGD(list(ps.values()), lr=LR)
    losses = []
    for i in range(STEPS):
        y = torch.relu(torch.as_tensor(feeds[i]["x"]) @ ps["a.weight"]) @ ps["b.weight"] @ ps["c.weight"]
        t = torch.as_tensor(targets[i]) if targets is not None else None
        lv = {"mean": lambda: y.mean(), "mse": lambda: F.mse_loss(y, t),
              "bce": lambda: F.binary_cross_entropy_with_logits(y, t),
              "ce": lambda: F.cross_entropy(y, t)}[kind]()
        opt.zero_grad()
        lv.backward()
        opt.step()
        losses.append(float(lv))
    return losses, {n: p.detach().numpy() for n, p in ps.items()}


def test_each_loss_on_one_and_two_processes_equals_torch():
    path = models.mlp_nobias()
    g = H.load(path)
    plans = {"one process": H.logical_plan(g, path),
             "data parallel": H.make_plan(data_parallel(g, 2), path, 2),
             # tensor parallel: the output's pieces lie on both ranks, the loss is computed on them
             "megatron column->row": H.make_plan(H.apply_rule(g, "megatron_mlp_column_row"), path, 2),
             "megatron pair at the output, AllReduce": H.make_plan(H.rebuild(
                 g, {"x": [("Replicate", 2)], "a.weight": [("Replicate", 2)], "b.weight": [("Partition", 1, 2)],
                     "c.weight": [("Partition", 0, 2)]}, after={7: [("AllReduce", 2)]}), path, 2)}
    rng = np.random.default_rng(11)
    cases, refs, names = [], [], []
    for kind in ("mean", "mse", "bce", "ce"):
        feeds, tg = _data(kind, rng)
        ref = _torch_reference(path, kind, feeds, tg)
        one = H.train(plans["one process"], path, STEPS, feeds=feeds, targets=tg, loss=kind, lr=LR)
        np.testing.assert_allclose(one[0], ref[0], rtol=1e-4, atol=1e-6, err_msg=f"{kind}: one process")
        for name in plans:
            if name != "one process":
                cases.append(H.case(plans[name], path, STEPS, feeds=feeds, targets=tg, loss=kind, lr=LR))
                refs.append(ref)
                names.append(f"{kind}, {name}")
    got = H.run_cases(2, cases)
    for name, (l0, s0), (l1, s1) in zip(names, refs, got):
        np.testing.assert_allclose(l1, l0, rtol=1e-4, atol=1e-6, err_msg=name)
        for k, v in s0.items():
            np.testing.assert_allclose(s1[k], v, rtol=1e-4, atol=1e-6, err_msg=f"{name}: {k}")
    assert refs[0][0][0] != refs[0][0][-1]


def _rows_worker(rank, world, plans, path):
    from unity_pcg import plan as plan_mod
    from unity_pcg.executor.train import Trainer
    out = []
    for pj in plans:
        t = Trainer(plan_mod.from_json(pj), path, rank=rank, world=world, loss="mse")
        out.append((t.feed_rows(), t.target_rows()))
    return out


def test_feed_rows_are_the_pieces_rows():
    """A data-parallel rank of 2 reads half of each batch; a Megatron rank (x replicated) all of it."""
    path = models.mlp_nobias()
    g = H.load(path)
    dp = H.make_plan(data_parallel(g, 2), path, 2)
    meg = H.make_plan(H.rebuild(g, {"x": [("Replicate", 2)], "a.weight": [("Partition", 1, 2)],
                                    "b.weight": [("Partition", 0, 2)], "c.weight": [("Replicate", 2)]},
                                after={5: [("AllReduce", 2)]}), path, 2)
    got = H.run_dist(2, _rows_worker, [dp.to_json(), meg.to_json()], path)
    assert got[0][0] == ({"x": (0, 4)}, (0, 4)) and got[1][0] == ({"x": (4, 8)}, (4, 8))
    assert got[0][1][0] == {"x": (0, 8)} and got[1][1][0] == {"x": (0, 8)}


# --- `unity-pcg run`: options, data formats, refusals ------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("lossdata")
    model = tiny_mlp_onnx(str(d / "mlp.onnx"))
    return {"dir": d, "model": model, "one": one_device_plan(model, str(d / "one.json")),
            "dp2": dp_plan(model, str(d / "dp2.json"), 2)}


def cli(capfd, *args):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main(["run", *map(str, args)])
    out, err = capfd.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


def _arrays(rng, batches=2, targets="float"):
    x = rng.standard_normal((8 * batches, 16)).astype(np.float32)
    if targets == "float":
        return {"x": x, "targets": rng.standard_normal((8 * batches, 8)).astype(np.float32)}
    if targets == "binary":
        return {"x": x, "targets": (rng.random((8 * batches, 8)) < 0.3).astype(np.float32)}
    return {"x": x, "targets": rng.integers(0, 8, 8 * batches)}


def _write_dir(d, arrays, shards: int = 0):
    d.mkdir(exist_ok=True)
    for k, v in arrays.items():
        if shards:
            (d / k).mkdir()
            for i, part in enumerate(np.array_split(v, shards)):
                np.save(d / k / f"part-{i:03d}.npy", part)
        else:
            np.save(d / f"{k}.npy", v)
    return d


def test_data_formats_train_alike_and_each_rank_reads_its_half(work, capfd):
    """The same data as .npz, as a folder of memory-mapped .npy and as shards: the same losses on 2
    data-parallel ranks (= plain PyTorch), each rank fed 4 of the 8 rows of every batch."""
    arrays = _arrays(np.random.default_rng(5), batches=3, targets="binary")
    npz = work["dir"] / "fmt.npz"
    np.savez(npz, **arrays)
    folders = {"npz": npz, "dir": _write_dir(work["dir"] / "fmt_dir", arrays),
               "shards": _write_dir(work["dir"] / "fmt_shards", arrays, shards=5)}   # shards cut across batches
    ref, _ = reference_losses(work["model"], 4, "sgd", lr=0.1, data=str(npz), loss="bce")
    for name, path in folders.items():
        rc, out, err = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 4, "--lr", 0.1, "--data", path,
                           "--loss", "bce", "--json")
        assert rc == 0, err
        res = json.loads(out)
        np.testing.assert_allclose(res["losses"], ref, rtol=1e-4, atol=1e-7, err_msg=name)
        assert res["loss"] == "bce"
        assert res["rank_fed_rows"] == [{"x": 4, "targets": 4}, {"x": 4, "targets": 4}], name
        assert len(res["rank_peak_rss_bytes"]) == 2 and min(res["rank_peak_rss_bytes"]) > 0


def test_derived_loss_is_printed_and_in_the_result(work, capfd):
    data = work["dir"] / "cls.npz"
    np.savez(data, **_arrays(np.random.default_rng(2), targets="int"))
    rc, out, err = cli(capfd, work["dp2"], "--model", work["model"], "--steps", 2, "--data", data, "--json")
    assert rc == 0, err
    assert json.loads(out)["loss"] == "ce"
    assert any(ln.startswith("loss: ce (integer class targets") for ln in err), err


def test_pipeline_with_bce(work, capfd, tmp_path):
    """The pipeline trainer's loss path: bce through 2 stages of 2 micro-batches equals plain PyTorch."""
    pp = pipeline_plan(work["model"], str(tmp_path / "pp.json"), stages=2, micro_batches=2)
    data = tmp_path / "bin.npz"
    np.savez(data, **_arrays(np.random.default_rng(8), targets="binary"))
    rc, out, err = cli(capfd, pp, "--model", work["model"], "--steps", 3, "--lr", 0.1, "--data", data,
                       "--loss", "bce", "--json")
    assert rc == 0, err
    res = json.loads(out)
    ref, _ = reference_losses(work["model"], 3, "sgd", lr=0.1, data=str(data), loss="bce")
    np.testing.assert_allclose(res["losses"], ref, rtol=1e-4, atol=1e-7)
    # inputs on the first stage only, targets on the last only
    assert res["rank_fed_rows"] == [{"x": 8, "targets": 0}, {"x": 0, "targets": 8}]


def _loss_model(path: str):
    """A torch module whose forward returns its own MSE loss (targets ``t`` are a graph input)."""
    import torch

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 8)

        def forward(self, x, t):
            return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), t)
    torch.manual_seed(3)
    m = WithLoss()
    ref = WithLoss()
    ref.load_state_dict(m.state_dict())
    m.eval()
    with torch.no_grad():
        torch.onnx.export(m, (torch.randn(8, 16), torch.randn(8, 8)), path, input_names=["x", "t"],
                          output_names=["loss"], dynamo=False, opset_version=17)
    return ref


def test_a_graph_that_computes_its_own_loss_trains_as_torch(work, capfd, tmp_path):
    import torch
    model = str(tmp_path / "withloss.onnx")
    ref_module = _loss_model(model)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    t = rng.standard_normal((16, 8)).astype(np.float32)
    data = tmp_path / "xt.npz"
    np.savez(data, x=x, t=t)
    opt = torch.optim.SGD(ref_module.parameters(), lr=0.1)
    ref = []
    for s in range(4):
        k = s % 2
        lv = ref_module(torch.as_tensor(x[8 * k:8 * k + 8]), torch.as_tensor(t[8 * k:8 * k + 8]))
        opt.zero_grad()
        lv.backward()
        opt.step()
        ref.append(float(lv))
    one = one_device_plan(model, str(tmp_path / "one.json"))
    dp2 = dp_plan(model, str(tmp_path / "dp2.json"), 2)
    for plan, loss in ((one, "output"), (dp2, None)):     # None: derived (a one-element output, no targets)
        args = [plan, "--model", model, "--steps", 4, "--lr", 0.1, "--data", data, "--json"]
        rc, out, err = cli(capfd, *args, *(["--loss", loss] if loss else []))
        assert rc == 0, err
        res = json.loads(out)
        assert res["loss"] == "output"
        np.testing.assert_allclose(res["losses"], ref, rtol=1e-4, atol=1e-7)
    assert any(ln.startswith("loss: output") for ln in err), err


def test_resume_with_another_loss_is_refused(work, capfd, monkeypatch):
    from unity_pcg.executor import launch as _launch
    ck = work["dir"] / "ck"
    data = work["dir"] / "res.npz"
    np.savez(data, **_arrays(np.random.default_rng(1), targets="binary"))
    rc, _, err = cli(capfd, work["one"], "--model", work["model"], "--steps", 1, "--data", data, "--loss", "mse",
                     "--checkpoint", ck)
    assert rc == 0, err
    assert json.loads(next(ck.glob("step-*/meta.json")).read_text())["loss"] == "mse"
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    rc, _, err = cli(capfd, work["one"], "--model", work["model"], "--steps", 1, "--data", data, "--loss", "bce",
                     "--checkpoint", ck, "--resume")
    assert rc == 2 and len(err) == 1 and "trained with --loss mse" in err[0], err


def _emb_work(d):
    model = models.embedding()
    return model, one_device_plan(model, str(d / "emb.json"))


def _bad(name):
    r = np.random.default_rng(0)
    x = r.standard_normal((16, 16)).astype(np.float32)
    f = r.standard_normal((16, 8)).astype(np.float32)
    if name == "nan input":
        x[11, 3] = np.nan
        return "npz", {"x": x, "targets": f}, ()
    if name == "inf input, memory-mapped, found across chunks":
        x[13, 0] = np.inf
        return "dir", {"x": x, "targets": f}, ()
    if name == "nan in a shard":
        x[9, 5] = np.nan
        return "shards", {"x": x, "targets": f}, ()
    if name == "non-numeric input":
        return "npz", {"x": np.array([["a"] * 16] * 16), "targets": f}, ()
    if name == "nan target":
        f[6, 1] = np.nan
        return "npz", {"x": x, "targets": f}, ()
    if name == "bce target outside [0, 1]":
        b = (r.random((16, 8)) < 0.5).astype(np.float32)
        b[14, 2] = 2.0
        return "npz", {"x": x, "targets": b}, ("--loss", "bce")
    if name == "ce class out of range":
        c = r.integers(0, 8, 16)
        c[5] = 8
        return "npz", {"x": x, "targets": c}, ()
    if name == "ce with float targets":
        return "npz", {"x": x, "targets": f}, ("--loss", "ce")
    if name == "mse with integer targets":
        return "npz", {"x": x, "targets": r.integers(0, 8, 16)}, ("--loss", "mse")
    if name == "mse targets of the wrong shape":
        return "npz", {"x": x, "targets": r.standard_normal((16, 7)).astype(np.float32)}, ()
    if name == "no targets, no --loss":
        return "npz", {"x": x}, ()
    if name == "--loss mean with targets":
        return "npz", {"x": x, "targets": f}, ("--loss", "mean")
    if name == "--loss bce without targets":
        return "npz", {"x": x}, ("--loss", "bce")
    raise KeyError(name)


@pytest.mark.parametrize("name, msg", [
    ("nan input", "input 'x' holds nan at row 11"),
    ("inf input, memory-mapped, found across chunks", "input 'x' holds inf at row 13"),
    ("nan in a shard", "input 'x' holds nan at row 9"),
    ("non-numeric input", "input 'x' has the non-numeric dtype <U1"),
    ("nan target", "targets holds nan at row 6"),
    ("bce target outside [0, 1]", "targets holds 2.0 at row 14; --loss bce needs targets in [0, 1]"),
    ("ce class out of range", "targets holds 8 at row 5; --loss ce needs classes 0..7"),
    ("ce with float targets", "--loss ce needs integer class targets"),
    ("mse with integer targets", "--loss mse needs float targets"),
    ("mse targets of the wrong shape", "targets have shape [8, 7] per batch, the model's output [8, 8]"),
    ("no targets, no --loss", "there are no targets: pass --loss"),
    ("--loss mean with targets", "--loss mean takes no 'targets' array"),
    ("--loss bce without targets", "--loss bce needs targets"),
])
def test_bad_data_is_refused_before_start(work, capfd, monkeypatch, name, msg):
    from unity_pcg.executor import data as D
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(D, "SCAN_BYTES", 3 * 16 * 4)        # 3 rows a chunk: the scan goes chunk by chunk
    fmt, arrays, extra = _bad(name)
    tag = "".join(c if c.isalnum() else "_" for c in name)
    if fmt == "npz":
        path = work["dir"] / f"bad_{tag}.npz"
        np.savez(path, **arrays)
    else:
        path = _write_dir(work["dir"] / f"bad_{tag}", arrays, shards=3 if fmt == "shards" else 0)
    rc, _, err = cli(capfd, work["dp2"], "--model", work["model"], "--data", path, *extra)
    assert rc == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("idx, msg", [
    (lambda r: r.standard_normal((8, 3)), "input 'idx' must hold integers (int64), got float64"),
    (lambda r: np.where(np.arange(24).reshape(8, 3) == 19, 10, r.integers(0, 10, (8, 3))),
     "input 'idx' holds 10 at row 6; it indexes an embedding table of 10 rows (0..9)"),
])
def test_bad_embedding_indices_are_refused_before_start(work, capfd, monkeypatch, idx, msg):
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    model, plan = _emb_work(work["dir"])
    path = work["dir"] / "emb_bad.npz"
    np.savez(path, idx=idx(np.random.default_rng(0)))
    rc, _, err = cli(capfd, plan, "--model", model, "--data", path, "--loss", "mean")
    assert rc == 2 and len(err) == 1 and msg in err[0], err
