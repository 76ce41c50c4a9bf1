"""Weights out: `unity-pcg run --save-model OUT.onnx` and `unity-pcg export-weights CHECKPOINT_DIR -o OUT.onnx`
(executor/export.py).  The written model, run in onnxruntime, computes what the PCG computes with the weights
a one-process Trainer reaches (so a shard assembled in the wrong order, a weight written back without
undoing the importer's transpose, or an untrained copy all fail), for data-parallel, tensor-parallel
(Megatron) and pipeline plans; OUT.safetensors loads with the safetensors library and gives a torch module's
state_dict back.  Each multi-process run costs a few seconds; the 4-process ones are marked slow."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from tests.executor import dist_helpers as H
from tests.executor import models
from tests.executor.runtime_plans import dp_plan, one_device_plan, pipeline_plan, tiny_mlp_onnx
from unity_pcg import plan as P
from unity_pcg.executor import export as E
from unity_pcg.onnx_import import load_onnx

STEPS, LR, OPT, SEED = 3, 0.02, "adam", 0


def cli(capfd, *args):
    from unity_pcg.cli import main
    capfd.readouterr()
    rc = main([*map(str, args)])
    out, err = capfd.readouterr()
    return rc, out, err


def train_run(capfd, plan, model, out, *extra):
    rc, o, err = cli(capfd, "run", plan, "--model", model, "--steps", STEPS, "--loss", "mean", "--optimizer", OPT, "--lr", LR,
                     "--seed", SEED, "--save-model", out, "--json", *extra)
    assert rc == 0, err
    res = json.loads(o)
    assert res["saved_model"] == os.path.abspath(out)
    return res


def reference_state(model: str, tmp) -> dict:
    """The weights a one-process Trainer reaches on the run's data (PCG names and layout)."""
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.train import Trainer
    one = P.load(one_device_plan(model, str(tmp / "ref-one.json")))
    t = Trainer(one, model, rank=0, world=1, seed=SEED, optimizer=OPT, lr=LR)
    src = open_data(one.pcg, None, seed=SEED)
    for s in range(STEPS):
        t.step(*src.feeds(s))
    return {k: v.detach().numpy() for k, v in t.model_state().items()}


def ort(path: str, feeds: dict) -> list:
    import onnxruntime as rt
    s = rt.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def feeds_of(model: str, seed: int = 11) -> dict:
    from unity_pcg.evaluate import random_feeds
    return random_feeds(load_onnx(model, load_weights=False), seed=seed, int_high=4)


def assert_exported(out: str, model: str, ref: dict):
    """ORT on the written model == the PCG with the reference weights; != the untrained model."""
    from unity_pcg.evaluate import evaluate
    x = feeds_of(model)
    g = load_onnx(model)
    assert set(ref) >= {n.a["name"] for n in g.sources("Weight")}
    g.weights.update(ref)
    want = evaluate(g, x)
    got = ort(out, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    before = ort(model, x)
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, before)) > 1e-3   # it trained
    # every float initializer of the model was trained (changed) and keeps its dtype and shape
    m0, m1 = onnx.load(model), onnx.load(out)
    assert [(t.name, t.data_type, list(t.dims)) for t in m0.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in m1.graph.initializer]
    assert list(m0.graph.node) == list(m1.graph.node)
    for t0, t1 in zip(m0.graph.initializer, m1.graph.initializer):
        if t0.data_type == onnx.TensorProto.FLOAT:
            assert not np.array_equal(numpy_helper.to_array(t0), numpy_helper.to_array(t1)), t0.name


def assert_safetensors(out: str):
    """OUT.safetensors holds the written model's initializers, readable by the safetensors library."""
    from safetensors.numpy import load_file
    st = E.safetensors_path(out)
    got = load_file(st)
    m = onnx.load(out)
    assert sorted(got) == sorted(t.name for t in m.graph.initializer)
    for t in m.graph.initializer:
        np.testing.assert_array_equal(got[t.name], numpy_helper.to_array(t))
    mine, meta = E.read_safetensors(st)
    assert sorted(mine) == sorted(got) and "onnx_to_torch" in meta


# --- plans -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    gemm = tiny_mlp_onnx(str(d / "mlp.onnx"))         # Gemm(transB=1): the PCG holds the weights transposed
    nobias = models.mlp_nobias()                      # MatMul of folded transposes: onnx::MatMul_N initializers
    return {"dir": d, "gemm": gemm, "nobias": nobias}


def _tp_plan(model: str, out: str, degree: int) -> str:
    H.make_plan(H.apply_rule(H.load(model), "megatron_mlp_column_row", degree=degree), model, degree).save(out)
    return out


def _pp_tp_plan(model: str, out: str) -> str:
    from tests.executor.test_pipeline_megatron import megatron_pipeline_plan
    return megatron_pipeline_plan(model, out, cut=3)


PLANS = {
    "dp2": ("gemm", lambda m, o: dp_plan(m, o, 2)),
    "tp2": ("nobias", lambda m, o: _tp_plan(m, o, 2)),
    "pp2": ("gemm", lambda m, o: pipeline_plan(m, o, 2)),
    "dp4": ("gemm", lambda m, o: dp_plan(m, o, 4)),
    "tp4": ("nobias", lambda m, o: _tp_plan(m, o, 4)),
    "pp2xtp2": ("pair", _pp_tp_plan),
}


def _model(work, key):
    if key == "pair":
        from tests.executor.test_pipeline_megatron import two_pair_mlp
        return two_pair_mlp()
    return work[key]


def rank_run(tmp, monkeypatch, plan: str, model: str, out: str) -> None:
    """``python -m unity_pcg.executor PLAN --save-model OUT`` as a world of one, in this process."""
    from unity_pcg.executor.__main__ import main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    rep = tmp / "rep"
    rep.mkdir(exist_ok=True)
    rc = main([plan, "--model", model, "--steps", str(STEPS), "--loss", "mean", "--optimizer", OPT, "--lr", str(LR),
               "--save-model", out, "--report-dir", str(rep), "--progress", "none"])
    assert rc == 0, [p.read_text() for p in rep.iterdir()]
    assert json.loads((rep / "result.json").read_text())["saved_model"] == out


def test_one_process_save_model(work, tmp_path, monkeypatch):
    """One rank, in this process (python -m unity_pcg.executor): the written model is the trained one."""
    model = work["gemm"]
    out = str(tmp_path / "one.onnx")
    rank_run(tmp_path, monkeypatch, one_device_plan(model, str(tmp_path / "one.json")), model, out)
    assert_exported(out, model, reference_state(model, tmp_path))
    assert_safetensors(out)


@pytest.mark.parametrize("name", [
    "tp2", "pp2",   # dp2: the run of the ``ckrun`` fixture (test_export_weights_writes_what_save_model_wrote)
    pytest.param("dp4", marks=pytest.mark.slow), pytest.param("tp4", marks=pytest.mark.slow),
    pytest.param("pp2xtp2", marks=pytest.mark.slow)])
def test_save_model_equals_one_process_training(work, tmp_path, capfd, name):
    key, make = PLANS[name]
    model = _model(work, key)
    plan = make(model, str(tmp_path / f"{name}.json"))
    out = str(tmp_path / f"{name}.onnx")
    res = train_run(capfd, plan, model, out)
    assert res["nproc"] == int(name[-1]) * (2 if name == "pp2xtp2" else 1)
    assert_exported(out, model, reference_state(model, tmp_path))
    assert_safetensors(out)


# --- a torch module back from the file ------------------------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4, bias=False)

    def forward(self, ids):
        return self.fc2(torch.relu(self.ln(self.fc1(self.emb(ids)))))


def _net_onnx(path: str, dynamo: bool = False) -> tuple[str, _Net]:
    torch.manual_seed(4)
    net = _Net().eval()
    torch.onnx.export(net, (torch.randint(0, 10, (4, 3)),), path, input_names=["ids"], output_names=["y"],
                      dynamo=dynamo, opset_version=18 if dynamo else 17)
    return path, net


def test_trained_torch_module_loads_the_state_dict_back(work, tmp_path, monkeypatch):
    """Embedding, Linear with bias (MatMul+Add on 3-D input: folded onnx::MatMul_N), LayerNorm and a bias-free
    Linear, exported legacy, trained (one rank, in this process): torch_state_dict(...) loads strictly into the
    module and its forward equals onnxruntime on the written file."""
    model, net = _net_onnx(str(tmp_path / "net.onnx"))
    init = {k: v.clone() for k, v in net.state_dict().items()}
    out = str(tmp_path / "net-trained.onnx")
    rank_run(tmp_path, monkeypatch, one_device_plan(model, str(tmp_path / "net-one.json")), model, out)
    for src in (E.safetensors_path(out), out):   # from the safetensors file and from the ONNX file alone
        if src == out:
            os.remove(E.safetensors_path(out))
        sd = E.torch_state_dict(src)
        assert sorted(sd) == sorted(init)
        net.load_state_dict(sd, strict=True)
        assert not torch.equal(net.fc2.weight, init["fc2.weight"]) and not torch.equal(net.fc1.weight,
                                                                                        init["fc1.weight"])
        ids = np.random.default_rng(3).integers(0, 10, (4, 3)).astype(np.int64)
        with torch.no_grad():
            y = net(torch.as_tensor(ids)).numpy()
        np.testing.assert_allclose(ort(out, {"ids": ids})[0], y, rtol=1e-4, atol=1e-5)
    from safetensors import safe_open
    E.save_model(model, {}, str(tmp_path / "again.onnx"))
    with safe_open(str(tmp_path / "again.safetensors"), "np") as f:
        names = json.loads(f.metadata()["onnx_to_torch"])
    assert sorted(names.values()) == sorted(init)
    assert all(k.startswith("onnx::MatMul") for k, v in names.items() if v in ("fc1.weight", "fc2.weight"))


def test_dynamo_export_names_map_to_the_module(tmp_path):
    """A dynamo export (initializers named by the module, folded transposes named val_N in a Linear's name scope):
    writing changed weights and reading them back gives the module's state_dict."""
    model, net = _net_onnx(str(tmp_path / "dyn.onnx"), dynamo=True)
    g = load_onnx(model)
    rng = np.random.default_rng(0)
    state = {n.a["name"]: rng.standard_normal(n.a["shape"]).astype(np.float32) for n in g.sources("Weight")
             if n.a["dtype"] == "float32"}
    out = str(tmp_path / "dyn-out.onnx")
    res = E.save_model(model, state, out)
    assert not res["skipped"]
    sd = E.torch_state_dict(out)
    assert sorted(sd) == sorted(net.state_dict())
    net.load_state_dict(sd, strict=True)
    ids = rng.integers(0, 10, (4, 3)).astype(np.int64)
    with torch.no_grad():
        y = net(torch.as_tensor(ids)).numpy()
    np.testing.assert_allclose(ort(out, {"ids": ids})[0], y, rtol=1e-4, atol=1e-5)


# --- the library ---------------------------------------------------------------------------------------------

def test_weight_layout_undoes_the_importers_transpose(work):
    """Gemm(transB=1) weights are (out, in) in the file and (in, out) in the PCG: written back transposed."""
    model = work["gemm"]
    g = load_onnx(model)
    lay = E.weight_layout(model)
    m = onnx.load(model)
    for t in m.graph.initializer:
        w = g.weights[t.name]
        w = np.asarray(w() if callable(w) else w)
        name, ix = lay[t.name]
        assert name == t.name
        np.testing.assert_array_equal(numpy_helper.to_array(t).ravel()[ix], w)
    assert any(len(t.dims) == 2 and g.weights[t.name]().shape != tuple(t.dims) for t in m.graph.initializer)


def test_external_data_and_safetensors_format(work, tmp_path):
    """external_threshold=0 forces external data on a tiny model; the files load in onnxruntime and in the
    safetensors library with the same values as the inline ones; the header is the documented layout."""
    import struct
    model = work["gemm"]
    g = load_onnx(model)
    rng = np.random.default_rng(1)
    state = {n.a["name"]: rng.standard_normal(n.a["shape"]).astype(np.float32) for n in g.sources("Weight")}
    a = E.save_model(model, state, str(tmp_path / "inline.onnx"))
    b = E.save_model(model, state, str(tmp_path / "ext.onnx"), external_threshold=0)
    assert a["external_data"] is None and b["external_data"] == str(tmp_path / "ext.onnx.data")
    assert os.path.getsize(b["external_data"]) > 0
    assert os.path.getsize(b["onnx"]) < os.path.getsize(a["onnx"])
    x = feeds_of(model)
    np.testing.assert_array_equal(ort(a["onnx"], x)[0], ort(b["onnx"], x)[0])
    with open(b["safetensors"], "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert n % 8 == 0 and header["__metadata__"]["format"] == "onnx"
    assert all(e["dtype"] == "F32" for k, e in header.items() if k != "__metadata__")
    with open(a["safetensors"], "rb") as f1, open(b["safetensors"], "rb") as f2:
        assert f1.read() == f2.read()
    # writing again over existing files replaces them (the data file is not appended to)
    size = os.path.getsize(b["external_data"])
    E.save_model(model, state, str(tmp_path / "ext.onnx"), external_threshold=0)
    assert os.path.getsize(b["external_data"]) == size


def test_safetensors_writer_dtypes_round_trip(tmp_path):
    from safetensors.numpy import load_file
    arrays = {"f16": np.arange(6, dtype=np.float16).reshape(2, 3), "i64": np.array([1, -2], np.int64),
              "b": np.array([True, False]), "scalar": np.array(2.5, np.float64), "empty": np.zeros((0, 4), np.float32)}
    p = str(tmp_path / "x.safetensors")
    E.write_safetensors(p, arrays, {"k": "v"})
    got = load_file(p)
    mine, meta = E.read_safetensors(p)
    assert meta == {"k": "v"}
    for k, v in arrays.items():
        np.testing.assert_array_equal(got[k], v)
        np.testing.assert_array_equal(mine[k], v)
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
    E.write_safetensors(p, {"w": np.array([1.0, -2.5, 3.140625], np.float32)}, bf16=frozenset({"w"}))
    from safetensors.torch import load_file as tload
    t = tload(p)["w"]
    assert t.dtype == torch.bfloat16 and t.float().tolist() == [1.0, -2.5, 3.140625]


# --- export-weights from a checkpoint ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckrun(work, tmp_path_factory):
    """One 2-process run that checkpoints and saves the model."""
    from unity_pcg.cli import main
    d = tmp_path_factory.mktemp("ckrun")
    plan = dp_plan(work["gemm"], str(d / "dp2.json"), 2)
    out = d / "saved.onnx"
    rc = main(["run", plan, "--model", work["gemm"], "--steps", str(STEPS), "--loss", "mean", "--optimizer", OPT, "--lr", str(LR),
               "--checkpoint", str(d / "ck"), "--save-model", str(out), "--seed", "0"])
    assert rc == 0
    return {"dir": d, "ck": d / "ck", "saved": out, "plan": plan}


def test_export_weights_writes_what_save_model_wrote(work, ckrun, capfd):
    """The data-parallel run on 2 processes: its --save-model is the trained model, and export-weights of its
    checkpoint writes the same bytes."""
    assert_exported(str(ckrun["saved"]), work["gemm"], reference_state(work["gemm"], ckrun["dir"]))
    assert_safetensors(str(ckrun["saved"]))
    out = ckrun["dir"] / "exported.onnx"
    rc, o, err = cli(capfd, "export-weights", ckrun["ck"], "-o", out)
    assert rc == 0, err
    assert "wrote" in o and "step 3" in o
    assert out.read_bytes() == ckrun["saved"].read_bytes()
    assert E.safetensors_path(str(out)) and open(E.safetensors_path(str(out)), "rb").read() == \
        open(E.safetensors_path(str(ckrun["saved"])), "rb").read()
    meta = json.loads(next(ckrun["ck"].glob("step-*/meta.json")).read_text())
    assert meta["model"] == os.path.abspath(work["gemm"]) and meta["model_sha256"] == P.file_sha256(work["gemm"])
    # --model given explicitly (the same file) and external data
    out2 = ckrun["dir"] / "exported2.onnx"
    rc, o, err = cli(capfd, "export-weights", ckrun["ck"], "-o", out2, "--model", work["gemm"],
                     "--external-threshold", "0", "--json")
    assert rc == 0, err
    res = json.loads(o)
    assert res["external_data"] and os.path.exists(res["external_data"]) and res["step"] == 3
    x = feeds_of(work["gemm"])
    np.testing.assert_array_equal(ort(str(out2), x)[0], ort(str(ckrun["saved"]), x)[0])


def _one_error(rc, out, err, words):
    assert rc == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("unity-pcg "), err
    for w in words:
        assert w in lines[0], lines[0]


def test_export_weights_refusals(work, ckrun, tmp_path, capfd):
    ck = ckrun["ck"]
    # another model than the checkpoint's
    other = tiny_mlp_onnx(str(tmp_path / "other.onnx"), seed=1)
    _one_error(*cli(capfd, "export-weights", ck, "-o", tmp_path / "a.onnx", "--model", other), ["sha256 differs"])
    # a missing folder, a folder without a checkpoint, an incomplete checkpoint
    _one_error(*cli(capfd, "export-weights", tmp_path / "nope", "-o", tmp_path / "a.onnx"), ["does not exist"])
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_error(*cli(capfd, "export-weights", empty, "-o", tmp_path / "a.onnx"), ["no checkpoint in"])
    half = tmp_path / "half"
    (half / "step-00000002").mkdir(parents=True)
    (half / "latest").write_text("step-00000002\n")
    _one_error(*cli(capfd, "export-weights", half, "-o", tmp_path / "a.onnx"), ["incomplete"])
    # an output in a missing folder
    _one_error(*cli(capfd, "export-weights", ck, "-o", tmp_path / "missing" / "a.onnx"), ["does not exist"])
    # a checkpoint that does not record its model (an older run) needs --model
    old = tmp_path / "old"
    import shutil
    shutil.copytree(ck, old)
    for m in old.glob("step-*/meta.json"):
        meta = json.loads(m.read_text())
        del meta["model"], meta["model_sha256"]
        m.write_text(json.dumps(meta))
    _one_error(*cli(capfd, "export-weights", old, "-o", tmp_path / "a.onnx"), ["--model"])
    rc, o, err = cli(capfd, "export-weights", old, "-o", tmp_path / "a.onnx", "--model", work["gemm"])
    assert rc == 0, err
    assert not list(tmp_path.glob("missing*"))


def test_run_refuses_an_output_in_a_missing_folder_before_start(work, tmp_path, capfd, monkeypatch):
    from unity_pcg.executor import launch as _launch
    monkeypatch.setattr(_launch, "launch", lambda *a, **k: pytest.fail("launched"))
    plan = dp_plan(work["gemm"], str(tmp_path / "dp2.json"), 2)
    _one_error(*cli(capfd, "run", plan, "--model", work["gemm"], "--save-model", tmp_path / "no" / "x.onnx"),
               ["--save-model", "does not exist"])


def test_float16_initializers_keep_their_dtype_and_multi_digit_probe(tmp_path):
    """A float16 model (MatMul by a transposed fp16 initializer of 64x48 = 3,072 elements: more than fp16's
    2,048 exact integers, so the layout probe needs two digits); a float32 state (as bf16/fp32 master weights
    are) is written in float16, through the Transpose the importer folded."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 64)).astype(np.float16)
    g = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
        "fp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 48])],
        initializer=[numpy_helper.from_array(w, "w")])
    model = str(tmp_path / "fp16.onnx")
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    pg = load_onnx(model)
    (wn,) = list(pg.sources("Weight"))
    assert wn.a["name"] == "w" and tuple(wn.a["shape"]) == (64, 48)
    trained = rng.standard_normal((64, 48)).astype(np.float32)
    res = E.save_model(model, {"w": trained}, str(tmp_path / "out.onnx"))
    assert res["written"] == ["w"]
    (t,) = onnx.load(res["onnx"]).graph.initializer
    assert t.data_type == TensorProto.FLOAT16
    np.testing.assert_array_equal(numpy_helper.to_array(t), trained.T.astype(np.float16))


def test_weights_derived_by_arithmetic_are_reported_not_written(tmp_path):
    """A weight the importer folded from an initializer by arithmetic (W * 2) cannot be written back into W:
    it is reported in "skipped" and W is copied unchanged; the bias beside it is written."""
    from onnx import TensorProto, helper
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = helper.make_graph(
        [helper.make_node("Mul", ["w", "two"], ["w2"]), helper.make_node("MatMul", ["x", "w2"], ["h"]),
         helper.make_node("Add", ["h", "b"], ["y"])],
        "derived", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                     numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    model = str(tmp_path / "derived.onnx")
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    pg = load_onnx(model)
    names = sorted(n.a["name"] for n in pg.sources("Weight"))
    assert "w" not in names and "b" in names
    state = {n: np.ones(pg.weights[n]().shape, np.float32) for n in names}
    res = E.save_model(model, state, str(tmp_path / "out.onnx"))
    assert res["written"] == ["b"] and res["skipped"] == [n for n in names if n != "b"]
    out = {t.name: numpy_helper.to_array(t) for t in onnx.load(res["onnx"]).graph.initializer}
    np.testing.assert_array_equal(out["w"], w)
    np.testing.assert_array_equal(out["b"], np.ones(3, np.float32))
