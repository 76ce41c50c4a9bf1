"""Tests of the model zoo (unity_pcg.zoo): tiny models build, run, export to ONNX and
match onnxruntime; paper-size parameter counts are checked on the meta device."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import unity_pcg.zoo as zoo
from unity_pcg.zoo import ZooError

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

NAMES = ["resnext50", "inception_v3", "bert_large", "dlrm", "xdl", "candle_uno", "mlp"]

# ops the importer is promised (plus constant producers)
ALLOWED_OPS = {
    "Conv", "BatchNormalization", "Relu", "MaxPool", "AveragePool", "GlobalAveragePool",
    "Gemm", "MatMul", "Add", "Mul", "Concat", "Reshape", "Flatten", "Transpose", "Softmax",
    "LayerNormalization", "Gather", "ReduceSum", "ReduceMean", "Sigmoid", "Tanh", "Erf",
    "Split", "Div", "Sub", "Sqrt", "Pow", "Constant",
}

# output shape per sample at size tiny
TINY_OUT = {"resnext50": (10,), "inception_v3": (10,), "bert_large": (64,), "dlrm": (1,),
            "xdl": (1,), "candle_uno": (1,), "mlp": (64,)}

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_ort(path, input_names, inputs):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {n: t.numpy() for n, t in zip(input_names, inputs)})


def _op_types(path):
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def _check_export(name, path, exporter, batch=None):
    torch.manual_seed(0)
    model, inputs, in_names, out_names = zoo.build(name, "tiny", batch=batch)
    with torch.no_grad():
        expected = model(*inputs)
    out = zoo.export(name, path, size="tiny", batch=batch, exporter=exporter, seed=0)
    assert os.fspath(out) == os.fspath(path)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert [i.name for i in proto.graph.input] == in_names
    assert [o.name for o in proto.graph.output] == out_names
    for vi, t in zip(proto.graph.input, inputs):  # static shapes, batch included
        dims = [d.dim_value if d.HasField("dim_value") else None
                for d in vi.type.tensor_type.shape.dim]
        assert dims == list(t.shape)
    ops = {n.op_type for n in proto.graph.node}
    assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
    (got,) = _run_ort(path, in_names, inputs)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-3, atol=1e-4)
    return ops


# --------------------------------------------------------------------------- registry


def test_registry():
    assert list(zoo.MODELS) == NAMES
    assert [e.name for e in zoo.list_models()] == NAMES
    paper = {e.name: e.paper_batch for e in zoo.list_models()}
    assert paper == {"resnext50": 64, "inception_v3": 64, "bert_large": 4, "dlrm": 1024,
                     "xdl": 1024, "candle_uno": 256, "mlp": 256}
    for e in zoo.list_models():
        assert e.tiny_batch >= 1 and e.description
        with pytest.raises(Exception):
            e.paper_batch = 1  # frozen


def test_package_import_is_torch_free():
    code = ("import sys, unity_pcg.zoo as z; z.list_models(); z.get_config('bert_large', 'paper');"
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize("call", [
    lambda: zoo.build("resnet50"),
    lambda: zoo.build("mlp", size="huge"),
    lambda: zoo.build("mlp", batch=0),
    lambda: zoo.export("nope", "/tmp/never-written.onnx"),
    lambda: zoo.export("mlp", "/tmp/never-written.onnx", exporter="tf"),
    lambda: zoo.param_count("gpt3"),
    lambda: zoo.get_config("mlp", "medium"),
    lambda: zoo.get_config("mlp", "small"),
    lambda: zoo.export_structure("bert_large", "/tmp/never-written.onnx"),
    lambda: zoo.export_structure("dlrm", "/tmp/never-written.onnx", size="small"),
])
def test_errors(call):
    with pytest.raises(ZooError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


def test_unknown_name_message_lists_models():
    with pytest.raises(ZooError, match="resnext50, inception_v3, bert_large, dlrm, xdl, "
                                       "candle_uno, mlp"):
        zoo.build("alexnet")


# ------------------------------------------------------------------------------ tiny


@pytest.mark.parametrize("name", NAMES)
def test_tiny_build_forward(name):
    torch.manual_seed(0)
    model, inputs, in_names, out_names = zoo.build(name)
    assert not model.training
    assert len(inputs) == len(in_names) and len(out_names) == 1
    batch = zoo.MODELS[name].tiny_batch
    assert all(t.shape[0] == batch for t in inputs)
    with torch.no_grad():
        y = model(*inputs)
    assert tuple(y.shape) == (batch,) + TINY_OUT[name]
    assert torch.isfinite(y).all()
    # same seed -> same weights and inputs
    torch.manual_seed(0)
    model2, inputs2, _, _ = zoo.build(name)
    for a, b in zip(inputs, inputs2):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(model2(*inputs2), y)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_legacy_export_matches_torch(name, tmp_path):
    _check_export(name, tmp_path / f"{name}.onnx", "legacy")


def test_batch_override(tmp_path):
    model, inputs, names, _ = zoo.build("dlrm", batch=3)
    assert [t.shape[0] for t in inputs] == [3] * 5 and names == ["dense", "sparse0", "sparse1", "sparse2", "sparse3"]
    _check_export("candle_uno", tmp_path / "uno.onnx", "legacy", batch=5)


def test_expected_tiny_graph_structure(tmp_path):
    ops = _check_export("bert_large", tmp_path / "bert.onnx", "legacy")
    assert {"MatMul", "Softmax", "Transpose", "Reshape", "LayerNormalization", "Erf",
            "Gather"} <= ops
    nodes = onnx.load(str(tmp_path / "bert.onnx")).graph.node
    assert not any(n.op_type in ("Range", "Shape") for n in nodes)
    ops = _check_export("dlrm", tmp_path / "dlrm.onnx", "legacy")
    assert {"Gather", "MatMul", "Concat", "Sigmoid", "ReduceSum"} <= ops   # embedding bags, concat


def test_keep_batchnorm(tmp_path):
    path = tmp_path / "rx.onnx"
    zoo.export("resnext50", path, keep_batchnorm=True)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("BatchNormalization") == ops.count("Conv")
    torch.manual_seed(0)
    model, inputs, in_names, _ = zoo.build("resnext50")
    with torch.no_grad():
        expected = model(*inputs).numpy()
    (got,) = _run_ort(path, in_names, inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    with pytest.raises(ZooError):
        zoo.export("resnext50", path, exporter="dynamo", keep_batchnorm=True)


def test_batchnorm_kept_by_default_with_legacy(tmp_path):
    kept, folded = tmp_path / "kept.onnx", tmp_path / "folded.onnx"
    zoo.export("resnext50", kept)
    zoo.export("resnext50", folded, keep_batchnorm=False)
    assert [n.op_type for n in onnx.load(str(kept)).graph.node].count("BatchNormalization") == 20
    assert "BatchNormalization" not in [n.op_type for n in onnx.load(str(folded)).graph.node]


def test_external_data(tmp_path):
    path = tmp_path / "mlp.onnx"
    zoo.export("mlp", path, external_data=True)
    data = tmp_path / "mlp.onnx.data"
    assert data.exists() and data.stat().st_size > path.stat().st_size
    size = data.stat().st_size
    zoo.export("mlp", path, external_data=True)  # re-export does not append
    assert data.stat().st_size == size
    torch.manual_seed(0)
    model, inputs, in_names, _ = zoo.build("mlp")
    with torch.no_grad():
        expected = model(*inputs).numpy()
    (got,) = _run_ort(path, in_names, inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    zoo.export("mlp", path, external_data=False)  # back to one file: stale data removed
    assert not data.exists()


DYNAMO_FAST = ["mlp", "bert_large"]


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in DYNAMO_FAST else pytest.mark.slow) for n in NAMES])
def test_tiny_dynamo_export_matches_torch(name, tmp_path):
    _check_export(name, tmp_path / f"{name}.onnx", "dynamo")


# ------------------------------------------------------------------------ paper size

# published / analytically known parameter counts (parameters only, no buffers)
PAPER_PARAMS = {
    "resnext50": 25_028_904,       # ResNeXt-50 32x4d (torchvision reference count)
    "inception_v3": 23_834_568,    # Inception-v3 without the auxiliary classifier
    "bert_large": 335_141_888,     # BERT-Large (embeddings + 24 layers + pooler)
    "mlp": 16 * (8192 * 8192 + 8192),
}


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_paper_param_counts(name):
    got = zoo.param_count(name, "paper")
    assert abs(got - PAPER_PARAMS[name]) <= 0.03 * PAPER_PARAMS[name], got
    if name == "mlp":
        assert got == PAPER_PARAMS[name]


def test_paper_embedding_models_param_counts():
    # DLRM as FlexFlow's example: 24 tables of 1M x 64, bottom 2048-4096x5, concat, top 4096x4-1, no bias
    d = zoo.get_config("dlrm", "paper")
    assert (len(d.table_rows), d.emb_dim, d.bag, d.interaction, d.bias) == (24, 64, 100, "cat", False)
    assert set(d.table_rows) == {1_000_000}
    mlp = 2048 * 4096 + 4 * 4096 * 4096
    mlp += (4096 + 24 * 64) * 4096 + 3 * 4096 * 4096 + 4096
    assert zoo.param_count("dlrm", "paper") == 24 * 1_000_000 * 64 + mlp
    assert len(zoo.get_config("dlrm", "paper6").table_rows) == 6
    # the Criteo Kaggle configuration stays as "small"
    d = zoo.get_config("dlrm", "small")
    assert len(d.table_rows) == 26 and d.emb_dim == 16 and max(d.table_rows) == 1_000_000
    mlp = (13 * 512 + 512) + (512 * 256 + 256) + (256 * 64 + 64) + (64 * 16 + 16)
    top_in = 16 + 27 * 26 // 2
    mlp += (top_in * 512 + 512) + (512 * 256 + 256) + (256 + 1)
    assert zoo.param_count("dlrm", "small") == sum(d.table_rows) * 16 + mlp
    x = zoo.get_config("xdl", "paper")
    emb = x.num_features * x.rows * x.emb_dim
    mlp = (1024 * 1024 + 1024) + (1024 * 512 + 512) + (512 * 256 + 256) + 257
    assert zoo.param_count("xdl", "paper") == emb + mlp


def test_paper_candle_uno_param_count():
    # two drugs: five towers of 8 x 4192 (no bias) on 942, 5270, 2048, 5270, 2048 features; the two
    # doses join the concatenation; 4 x 4192 dense and one output
    h = 4192
    towers = sum(f * h + 7 * h * h for f in (942, 5270, 2048, 5270, 2048))
    dense = (2 + 5 * h) * h + 3 * h * h + h
    assert zoo.param_count("candle_uno", "paper") == towers + dense
    assert zoo.param_count("candle_uno", "small") == 19_274_001   # 3 towers of 3x1000 + 3x1000 + 1


@pytest.mark.parametrize("name", ["dlrm", "candle_uno", "xdl"])
def test_export_structure_is_the_model_without_weights(name, tmp_path):
    from unity_pcg.onnx_import import load_onnx
    real = load_onnx(zoo.export(name, tmp_path / "real.onnx"), load_weights=False)
    skel = load_onnx(zoo.export_structure(name, tmp_path / "skel.onnx", size="tiny"), load_weights=False)
    assert skel.structural_hash() == real.structural_hash()


def test_export_structure_paper_dlrm(tmp_path):
    from unity_pcg.onnx_import import load_onnx
    path = zoo.export_structure("dlrm", tmp_path / "dlrm.onnx", batch=8)
    data = tmp_path / "dlrm.onnx.data"
    assert data.stat().st_size >= 4 * zoo.param_count("dlrm", "paper")
    assert data.stat().st_blocks * 512 < 2**20               # sparse: no disk used
    g = load_onnx(path, load_weights=False)
    assert g.param_count() == zoo.param_count("dlrm", "paper")
    assert g.op_counts()["Embedding"] == 24 and g.shape(g.outputs[0]).sizes == (8, 1)


def test_paper_inputs_shapes_on_meta():
    """The paper-size modules accept paper-size inputs (checked on the meta device)."""
    from unity_pcg.zoo import models
    shapes = {"resnext50": (64, 1000), "inception_v3": (64, 1000), "bert_large": (4, 1024),
              "dlrm": (1024, 1), "xdl": (1024, 1), "candle_uno": (256, 1), "mlp": (256, 8192)}
    for name, out_shape in shapes.items():
        cfg = zoo.get_config(name, "paper")
        module = models.make_module(name, cfg, device="meta")
        inputs = models.example_inputs(name, cfg, zoo.MODELS[name].paper_batch)
        with torch.no_grad():
            y = module(*[t.to("meta") for t in inputs])
        assert tuple(y.shape) == out_shape, name
