"""ONNX import: the onnx wheel's light models, PyTorch exports (legacy and dynamo), the zoo, batch override,
external data, and typed one-line errors for bad input.

Equality with onnxruntime: ``|ours - ort| <= ATOL + RTOL * |ort|`` elementwise with RTOL = 1e-4 and
ATOL = 1e-5 * max|ort| (float32 sums are evaluated in different orders by numpy and onnxruntime, so
elements that cancel to ~0 need an absolute floor scaled to the tensor's magnitude).
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.errors import ModelImportError, UnityError, UnsupportedOperator
from unity_pcg.evaluate import evaluate, random_feeds
from unity_pcg.onnx_import import DynamicDimension, InvalidModel, MissingTensor, load_onnx

ort = pytest.importorskip("onnxruntime")

RTOL = 1e-4
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT = sorted(f[:-5] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx")) if os.path.isdir(LIGHT_DIR) else []


# --- helpers ----------------------------------------------------------------------------------------

def run_ort(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    src = model if isinstance(model, (str, os.PathLike)) else model.SerializeToString()
    s = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    return s.run(None, {k: v for k, v in feeds.items() if k in names})


def assert_close(ours, ref, what=""):
    assert len(ours) == len(ref), what
    for k, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what} output {k}: shape {a.shape} != {b.shape}"
        atol = 1e-5 * float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=f"{what} output {k}")


def import_and_compare(model, batch=None, seed=0, int_high=2):
    g = load_onnx(model, batch=batch)
    g.check()
    feeds = random_feeds(g, seed, int_high)
    ours = evaluate(g, feeds)
    ref = run_ort(model, feeds)
    assert_close(ours, ref, str(model)[-60:])
    return g


def randomize_light(name: str) -> onnx.ModelProto:
    """The light model with its ConstantOfShape 'weights' replaced by random initializers (He-scaled, positive
    1-D parameters so BatchNorm variances stay valid) and the input of the final Softmax exposed as an extra
    output (the logits: a one-hot-saturated softmax would hide errors).  Tensors of more than 4M elements (the
    first two FC layers of VGG/AlexNet/ZFNet) keep their constant fill: random ones cost ~1 GB and a minute."""
    m = onnx.load(os.path.join(LIGHT_DIR, name + ".onnx"))
    rng = np.random.default_rng(123)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    keep = []
    for n in m.graph.node:
        shape = [int(s) for s in inits[n.input[0]]] if n.op_type == "ConstantOfShape" and n.input[0] in inits \
            else None
        if shape is not None and np.prod(shape) <= 1 << 22:
            if len(shape) >= 2:
                v = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / max(1, int(np.prod(shape[1:])))))
            else:
                v = rng.uniform(0.5, 1.5, shape)
            m.graph.initializer.append(numpy_helper.from_array(v.astype(np.float32), n.output[0]))
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    soft = [n for n in m.graph.node if n.op_type == "Softmax"]
    if soft:
        m.graph.output.append(helper.make_tensor_value_info(soft[-1].input[0], TensorProto.FLOAT, None))
    return m


# --- the onnx wheel's light models --------------------------------------------------------------------

# all nine run by default (VGG-19 and ResNet-50, the heaviest, take ~20 s each: numpy convolutions on
# 224x224 images with ~100 MB of random weights)
@pytest.mark.parametrize("name", LIGHT)
def test_light_model_random_weights_matches_onnxruntime(name):
    g = import_and_compare(randomize_light(name))
    assert g.summary()["params"] > 100_000
    assert all(g.shape(r).numel > 0 for r in g.outputs)


def test_all_nine_light_models_present():
    assert len(LIGHT) == 9, LIGHT


@pytest.mark.parametrize("name", LIGHT)
def test_light_model_as_shipped_imports(name):
    """As shipped (weights from ConstantOfShape): imports; the folded weights are lazy callables."""
    path = os.path.join(LIGHT_DIR, name + ".onnx")
    g = load_onnx(path)
    g.check()
    assert g.summary()["params"] > 100_000
    assert g.op_counts()["Conv2d"] >= 5
    assert all(callable(v) for v in g.weights.values())
    m = onnx.load(path, load_external_data=False)
    cos = {n.output[0] for n in m.graph.node if n.op_type == "ConstantOfShape"}
    wnames = {n.a["name"] for n in g.sources("Weight")}
    assert cos <= wnames  # every ConstantOfShape result became a Weight named after it


@pytest.mark.parametrize("name", ["light_squeezenet"])
def test_light_model_as_shipped_matches_onnxruntime(name):
    import_and_compare(os.path.join(LIGHT_DIR, name + ".onnx"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT)
def test_light_model_as_shipped_matches_onnxruntime_all(name):
    import_and_compare(os.path.join(LIGHT_DIR, name + ".onnx"))


def test_densenet_folds_836_constant_of_shape_lazily():
    path = os.path.join(LIGHT_DIR, "light_densenet121.onnx")
    g = load_onnx(path)
    c = g.op_counts()
    assert c["Conv2d"] == 121 and c["BatchNorm"] == 121 and c["Concat"] == 58
    assert "Reshape" not in c  # the 242 Unsqueezes of BN parameters were folded into the weights
    assert g.meta["onnx_nodes"] == 1746


def test_light_model_batch_override_matches_per_sample_onnxruntime():
    """batch=3 on a model exported with batch 1: the literal Reshape target (1, 9216) is rewritten."""
    m = randomize_light("light_bvlc_alexnet")
    g = load_onnx(m, batch=3)
    g.check()
    (inp,) = g.sources("Input")
    assert inp.a["shape"][0] == 3
    feeds = random_feeds(g, seed=5)
    ours = evaluate(g, feeds)
    name = inp.a["name"]
    ref = [run_ort(m, {name: feeds[name][i:i + 1]}) for i in range(3)]
    ref = [np.concatenate([r[k] for r in ref]) for k in range(len(ours))]
    assert_close(ours, ref, "alexnet batch 3")


# --- PyTorch exports -----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(12, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 5)
        self.ln = nn.LayerNorm(32)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = self.ln(nn.functional.gelu(self.l2(h)) + h)
        h = torch.sigmoid(h) * torch.tanh(h) - h.clamp(-0.5, 0.5) / 3.0
        return torch.softmax(self.l3(h), dim=-1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4, bias=False)
        self.c1d = nn.Conv1d(8, 4, 3, padding=1)
        self.fc = nn.Linear(8 + 4, 6)
        for p in self.bn.parameters():
            nn.init.uniform_(p, 0.5, 1.5)
        self.bn.running_mean.uniform_(-0.2, 0.2)
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = nn.functional.max_pool2d(h, 3, stride=2, ceil_mode=True)
        h = h + nn.functional.avg_pool2d(self.c2(h), 3, stride=1, padding=1, count_include_pad=False)
        a = nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        s = self.c1d(h.mean(dim=2))                        # (N, 4, W)
        b = s.amax(dim=2) if False else s.sum(dim=2)
        return self.fc(torch.cat([a, b], dim=1))


class Attention(nn.Module):
    """A small BERT-like block: embeddings with a position_ids buffer, multi-head attention, FFN."""

    def __init__(self, vocab=20, d=16, heads=2, seq=6):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(32, d)
        self.register_buffer("position_ids", torch.arange(32).unsqueeze(0))
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.h, self.d = heads, d

    def forward(self, ids):
        b, s = ids.shape
        x = self.tok(ids) + self.pos(self.position_ids[:, :s])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        split = lambda t: t.view(b, s, self.h, self.d // self.h).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        att = torch.softmax(q @ k.transpose(-1, -2) / (self.d // self.h) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, self.d)
        x = self.ln1(x + self.o(y))
        x = self.ln2(x + self.ff2(nn.functional.gelu(self.ff1(x))))
        return x[:, 0], x.pow(2).mean(dim=-1).sqrt()


def _export(module, args, path, exporter, dynamic_batch=False, **kw):
    module.eval()
    torch.manual_seed(0)
    names = [f"in{i}" for i in range(len(args))]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            dyn = {n: {0: "batch"} for n in names} if dynamic_batch else None
            torch.onnx.export(module, args, path, dynamo=False, opset_version=kw.get("opset", 17),
                              input_names=names, dynamic_axes=dyn, do_constant_folding=kw.get("fold", True))
        else:
            torch.onnx.export(module, args, path, dynamo=True, input_names=names, verbose=False,
                              external_data=False)
    return path


def _modules():
    torch.manual_seed(0)
    return {
        "mlp": (MLP(), (torch.randn(4, 12),)),
        "conv": (ConvNet(), (torch.randn(2, 3, 17, 17),)),
        "attention": (Attention(), (torch.randint(0, 20, (3, 6)),)),
    }


@pytest.fixture(scope="module")
def torch_exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("torch_exports")
    out = {}
    for name, (mod, args) in _modules().items():
        for ex in ("legacy", "dynamo"):
            out[name, ex] = _export(mod, args, str(d / f"{name}_{ex}.onnx"), ex)
    return out


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["mlp", "conv", "attention"])
def test_torch_export_matches_onnxruntime(torch_exports, name, exporter):
    g = import_and_compare(torch_exports[name, exporter], int_high=20)
    c = g.op_counts()
    if name == "mlp":
        assert c["Linear"] == 3 and c["LayerNorm"] == 1
    if name == "conv":
        assert c["Conv2d"] == 3 and c["Pool2d"] >= 2
    if name == "attention":
        # (the dynamo exporter folds the position embedding of a static-shape model into a constant)
        assert c["Embedding"] in (1, 2) and c["Softmax"] == 1 and c["Linear"] == 4
        assert c["BatchMatMul"] + c["MatMul"] == 2


def test_torch_export_equals_torch_itself(torch_exports):
    mod, args = _modules()["attention"]
    mod.eval()
    g = load_onnx(torch_exports["attention", "legacy"])
    with torch.no_grad():
        want = [t.numpy() for t in mod(*args)]
    ours = evaluate(g, {"in0": args[0].numpy()})
    assert_close(ours, want, "attention vs torch")


def test_position_ids_buffer_becomes_int64_weight(tmp_path):
    """BERT-style position_ids[:, :s] folds to constant indices: an int64 Weight feeding an Embedding."""
    mod, args = _modules()["attention"]
    path = _export(mod, args, str(tmp_path / "nofold.onnx"), "legacy", fold=False)
    g = import_and_compare(path, int_high=20)
    embs = [n for n in g.nodes() if n.op == "Embedding"]
    idx_srcs = [g.node(n.inputs[0][0]) for n in embs]
    kinds = sorted((s.op, s.a["dtype"]) for s in idx_srcs)
    assert kinds == [("Input", "int64"), ("Weight", "int64")]
    w = [s for s in idx_srcs if s.op == "Weight"][0]
    np.testing.assert_array_equal(np.asarray(g.weights[w.a["name"]]()).reshape(-1), np.arange(6))


def test_dynamic_batch_needs_override_then_matches(tmp_path):
    """A dynamic batch dim: a one-line error naming the input without --batch; with batch=N, the exporter's
    Shape/Gather/Concat chains are folded from the new input shape and the result equals onnxruntime."""
    mod, args = _modules()["attention"]
    path = _export(mod, args, str(tmp_path / "dyn.onnx"), "legacy", dynamic_batch=True)
    with pytest.raises(DynamicDimension) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "in0" in msg and "--batch" in msg and "\n" not in msg
    kinds = {n.op_type for n in onnx.load(path).graph.node}
    assert "Shape" in kinds  # the exporter computed shapes at run time
    for b in (1, 5):
        g = import_and_compare(path, batch=b, int_high=20)
        assert g.shape(g.outputs[0]).sizes[0] == b


def test_batch_override_on_static_torch_export(tmp_path):
    """Static export with batch 4; batch=7 rewrites the reshape targets that baked in 4."""
    mod, args = _modules()["attention"]
    path = _export(mod, (torch.randint(0, 20, (4, 6)),), str(tmp_path / "static.onnx"), "legacy")
    g = load_onnx(path, batch=7)
    g.check()
    feeds = random_feeds(g, int_high=20)
    mod.eval()
    with torch.no_grad():
        want = [t.numpy() for t in mod(torch.from_numpy(feeds["in0"]))]
    assert_close(evaluate(g, feeds), want, "static export, batch 7")


def test_opset9_softmax_coerces_to_2d():
    """Softmax before opset 13 normalizes over all dims from `axis` on (flattened), not just one dim."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])
    for opset, axis in ((9, 1), (11, 0), (9, 2), (13, 1)):
        node = helper.make_node("Softmax", ["x"], ["y"], axis=axis, name="sm")
        m = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 7
        import_and_compare(m)


def test_gemm_variants_and_sum_and_pow():
    rng = np.random.default_rng(0)
    W = numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "W")
    Wt = numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float32), "Wt")
    c = numpy_helper.from_array(rng.standard_normal((1, 6)).astype(np.float32), "c")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("Gemm", ["x", "W", "c"], ["g1"], alpha=0.5, beta=2.0, transB=1, name="gemm1"),
        helper.make_node("Gemm", ["x", "Wt"], ["g2"], name="gemm2"),
        helper.make_node("Gemm", ["x", "x"], ["g3"], transB=1, alpha=0.25, name="gemm3"),
        helper.make_node("Pow", ["g2", "two"], ["p"], name="pow"),
        helper.make_node("Sum", ["g1", "p", "g2"], ["s"], name="sum"),
        helper.make_node("MatMul", ["g3", "s"], ["y"], name="mm"),
    ]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])], [W, Wt, c, two]),
        opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    g = import_and_compare(m)
    c = g.op_counts()
    assert c["Linear"] == 2 and c["Scale"] == 1 and c["Mul"] == 1 and c["Add"] == 2
    assert {n.a["name"] for n in g.sources("Weight")} >= {"W", "Wt", "c"}


def test_external_data_loads_lazily(tmp_path):
    mod, args = _modules()["mlp"]
    src = _export(mod, args, str(tmp_path / "a.onnx"), "legacy")
    m = onnx.load(src)
    path = str(tmp_path / "ext.onnx")
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
                    size_threshold=64)
    assert os.path.getsize(tmp_path / "ext.data") > 1000
    g = import_and_compare(path)
    assert all(callable(v) for v in g.weights.values())
    # the data is read when a weight is called, not at import: change the file after import
    big = max(g.sources("Weight"), key=lambda n: g.shape((n.id, 0)).numel)
    before = np.array(g.weights[big.a["name"]]())
    with open(tmp_path / "ext.data", "r+b") as f:
        data = bytearray(f.read())
        f.seek(0)
        f.write(bytes(len(data)))  # zeros, same size
    assert not np.any(g.weights[big.a["name"]]()) and np.any(before)
    os.remove(tmp_path / "ext.data")
    with pytest.raises(MissingTensor, match="ext.data"):
        load_onnx(path)


def test_zoo_exports_external_data(tmp_path):
    zoo = pytest.importorskip("unity_pcg.zoo")
    path = zoo.export("mlp", str(tmp_path / "mlp.onnx"), size="tiny", external_data=True)
    assert os.path.exists(str(tmp_path / "mlp.onnx.data"))
    import_and_compare(path)


# --- the zoo (tiny) -------------------------------------------------------------------------------------

def _zoo():
    try:
        from unity_pcg import zoo
        return list(zoo.MODELS)
    except Exception:
        return []


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.parametrize("exporter,name", [("legacy", n) for n in _zoo()] +
                         [("dynamo", n) for n in ("bert_large", "dlrm") if n in _zoo()])
def test_zoo_tiny_matches_onnxruntime(zoo_dir, name, exporter):
    from unity_pcg import zoo
    path = zoo.export(name, str(zoo_dir / f"{name}_{exporter}.onnx"), size="tiny", exporter=exporter)
    g = import_and_compare(path)
    assert g.summary()["ops"] > 10


@pytest.mark.slow
@pytest.mark.parametrize("name", _zoo())
def test_zoo_tiny_dynamo_all(zoo_dir, name):
    from unity_pcg import zoo
    import_and_compare(zoo.export(name, str(zoo_dir / f"{name}_dyn.onnx"), size="tiny", exporter="dynamo"))


# --- bad input: typed one-line errors -------------------------------------------------------------------

def _tiny_model(nodes, inits=(), inputs=None, outputs=None, opset=13):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _one_line(e):
    s = str(e.value)
    assert s and "\n" not in s and "Traceback" not in s
    return s


def test_unsupported_operator_names_op_and_node():
    m = _tiny_model([helper.make_node("Relu", ["x"], ["h"], name="r"),
                     helper.make_node("Hardmax", ["h"], ["y"], name="my_hardmax")])
    with pytest.raises(UnsupportedOperator) as e:
        load_onnx(m)
    s = _one_line(e)
    assert "Hardmax" in s and "my_hardmax" in s


def test_custom_domain_is_unsupported():
    n = helper.make_node("FusedThing", ["x"], ["y"], name="f1", domain="com.example")
    m = _tiny_model([n])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOperator, match="FusedThing.*f1"):
        load_onnx(m)


def test_truncated_and_non_onnx_files(tmp_path):
    path = os.path.join(LIGHT_DIR, "light_squeezenet.onnx")
    data = open(path, "rb").read()
    for k, blob in enumerate([data[: len(data) // 2], data[:37], b"hello, this is not onnx\n", b"",
                              b"\x08\x07\x12" + os.urandom(64)]):
        p = tmp_path / f"bad{k}.onnx"
        p.write_bytes(blob)
        with pytest.raises(ModelImportError) as e:
            load_onnx(str(p))
        _one_line(e)
    with pytest.raises(ModelImportError, match="no such file"):
        load_onnx(str(tmp_path / "missing.onnx"))


def test_cycle_is_an_error():
    m = _tiny_model([helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                     helper.make_node("Relu", ["a"], ["b"], name="n2"),
                     helper.make_node("Relu", ["a"], ["y"], name="n3")])
    with pytest.raises(InvalidModel, match="cycle") as e:
        load_onnx(m)
    assert "n1" in _one_line(e) or "n2" in str(e.value)


def test_missing_initializer_is_an_error():
    m = _tiny_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")])
    with pytest.raises(MissingTensor) as e:
        load_onnx(m)
    s = _one_line(e)
    assert "'W'" in s and "mm" in s


def test_dynamic_non_batch_dim_is_an_error():
    m = _tiny_model([helper.make_node("Relu", ["x"], ["y"])],
                    inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "seq"])])
    with pytest.raises(DynamicDimension, match="'x'.*seq"):
        load_onnx(m, batch=4)


def test_shape_mismatch_is_a_unity_error():
    W = numpy_helper.from_array(np.ones((4, 2), np.float32), "W")
    m = _tiny_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], inits=[W])
    with pytest.raises(UnityError) as e:
        load_onnx(m)
    assert "mm" in _one_line(e)


def test_load_weights_false_leaves_store_empty():
    g = load_onnx(os.path.join(LIGHT_DIR, "light_squeezenet.onnx"), load_weights=False)
    assert g.weights == {} and g.summary()["params"] > 0


# --- operator coverage: a hand-written graph of exporter idioms, opset 20 --------------------------------

def _idioms_model() -> onnx.ModelProto:
    rng = np.random.default_rng(7)

    def init(name, v):
        return numpy_helper.from_array(np.asarray(v), name)

    inits = [
        init("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3),
        init("ax1", np.array([1], np.int64)), init("ax0", np.array([0], np.int64)),
        init("ax23", np.array([2, 3], np.int64)),
        init("st", np.array([-1], np.int64)), init("en", np.array([-100], np.int64)),
        init("stp", np.array([-2], np.int64)),
        init("exp_shape", np.array([1, 1, 5, 1], np.int64)),
        init("lo", np.array(-0.5, np.float32)), init("hi", np.array(0.75, np.float32)),
        init("three", np.array(3.0, np.float32)),
        init("cvec", rng.standard_normal((1, 4, 1, 1)).astype(np.float32)),
        init("ratio", np.array(0.3, np.float32)),
        init("ln_s", rng.uniform(0.5, 1.5, (4,)).astype(np.float32)),
        init("gidx", np.array([[2, 0], [1, 1]], np.int64)),
    ]
    N = helper.make_node
    nodes = [
        N("Conv", ["x", "w"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2], name="conv_same"),
        N("AveragePool", ["c"], ["ap"], kernel_shape=[2, 2], auto_pad="SAME_LOWER", name="avg_same"),
        N("GlobalMaxPool", ["c"], ["gm"], name="gmax"),
        N("LRN", ["c"], ["lrn"], size=3, alpha=1e-3, beta=0.7, bias=1.5, name="lrn"),
        N("Sub", ["cvec", "lrn"], ["s1"], name="sub_const_first"),
        N("Div", ["s1", "three"], ["d1"], name="div_scalar"),
        N("Expand", ["gm", "exp_shape"], ["ex"], name="expand_batch"),
        N("Max", ["d1", "ex", "cvec"], ["mx"], name="max3"),
        N("Mean", ["mx", "lrn"], ["mn"], name="mean2"),
        N("Clip", ["mn", "lo", "hi"], ["cl"], name="clip"),
        N("Gelu", ["cl"], ["ge"], approximate="tanh", name="gelu_tanh"),
        N("Gelu", ["ge"], ["ge2"], name="gelu"),
        N("Slice", ["ge2", "st", "en", "ax1", "stp"], ["sl"], name="slice_reverse"),
        N("Split", ["sl"], ["sp1", "sp2"], axis=3, num_outputs=2, name="split_uneven"),
        N("ReduceMean", ["sp1", "ax23"], ["rm"], keepdims=1, name="reduce_mean"),
        N("Squeeze", ["rm", "ax23"], ["sq"], name="squeeze"),
        N("Unsqueeze", ["sq", "ax0"], ["us"], name="unsqueeze"),
        N("Flatten", ["sp2"], ["fl"], axis=-2, name="flatten_neg"),
        N("Transpose", ["fl"], ["tr"], name="transpose_default"),
        N("Dropout", ["tr", "ratio"], ["dr"], name="dropout"),
        N("ReduceSum", ["dr", "ax0"], ["rs"], keepdims=0, name="reduce_sum"),
        N("Gather", ["ap", "gidx"], ["ga"], axis=1, name="gather_const_idx"),
        N("LayerNormalization", ["rs", "ln_s"], ["ln"], axis=-1, epsilon=1e-3, name="layernorm_no_bias"),
        N("Cast", ["ga"], ["ga64"], to=TensorProto.DOUBLE, name="cast64"),
    ]
    g = helper.make_graph(nodes, "idioms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 10])],
                          [helper.make_tensor_value_info(n, t, None) for n, t in
                           (("us", TensorProto.FLOAT), ("ln", TensorProto.FLOAT), ("ga64", TensorProto.DOUBLE),
                            ("ap", TensorProto.FLOAT))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 9
    return m


def test_exporter_idioms_opset20_match_onnxruntime():
    g = import_and_compare(_idioms_model())
    c = g.op_counts()
    for op in ("Conv2d", "Pool2d", "LRN", "Scale", "Expand", "Max", "Clip", "Gelu", "Slice", "Split",
               "ReduceMean", "Reshape", "Flatten", "Transpose", "Dropout", "ReduceSum", "Gather", "Cast",
               "LayerNorm"):
        assert c[op] >= 1, op
    gather = next(n for n in g.nodes() if n.op == "Gather")
    idx = g.node(gather.inputs[1][0])
    assert idx.op == "Weight" and idx.a["dtype"] == "int64" and idx.a["shape"] == (2, 2)


def test_slice_bounds_follow_onnx_clamping():
    """Out-of-range and negative starts/ends/steps are clamped as the ONNX spec says (= onnxruntime); an empty
    result is refused with a typed error."""
    import itertools
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    for st, en, sp in itertools.product([-9, -6, -5, -1, 0, 2, 4, 5, 9], [-9, -6, -1, 0, 3, 5, 9], [-3, -1, 1, 2]):
        inits = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in
                 (("s", st), ("e", en), ("a", 1), ("p", sp))]
        m = _tiny_model([helper.make_node("Slice", ["x", "s", "e", "a", "p"], ["y"], name="sl")], inits=inits,
                        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])])
        (ref,) = run_ort(m, {"x": x})
        if ref.size == 0:
            with pytest.raises(UnityError):
                load_onnx(m)
            continue
        np.testing.assert_array_equal(evaluate(load_onnx(m), {"x": x})[0], ref, err_msg=str((st, en, sp)))
