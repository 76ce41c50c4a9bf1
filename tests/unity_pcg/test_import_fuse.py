"""ONNX import, issue 10 point 3: pattern fusion. The Erf and Tanh GELU chains, the ReduceMean/Sub/Pow/Sqrt/Div
LayerNorm chain of older opsets and x*Sigmoid(x) become Gelu, GeluTanh, LayerNorm and Silu; attention stays
BatchMatMul + Softmax; nothing fuses when an intermediate value is read elsewhere.  Every case is compared with
onnxruntime on the same graph."""
from __future__ import annotations

import warnings
from math import pi, sqrt

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx
from unity_pcg.onnx_import.importer import load

ort = pytest.importorskip("onnxruntime")

F = TensorProto.FLOAT
X = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)


def _c(name, v):
    return numpy_helper.from_array(np.asarray(v, dtype=np.float32 if isinstance(v, float) else None), name)


def _model(nodes, inits, outs=("y",), opset=13):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3, 8])],
                          [helper.make_tensor_value_info(o, F, None) for o in outs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _check(m, fused=None, absent=()):
    g = load_onnx(m)
    g.check()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": X})
    for a, b in zip(evaluate(g, {"x": X}), ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    c = g.op_counts()
    if fused is not None:
        assert c[fused] == 1, c
    for op in absent:
        assert op not in c, c
    return g


N = helper.make_node
HALF, ONE, SQ2 = _c("half", 0.5), _c("one", 1.0), _c("sq2", float(np.float32(sqrt(2.0))))


def _erf_gelu(form):
    core = [N("Div", ["x", "sq2"], ["u"]), N("Erf", ["u"], ["e"]), N("Add", ["e", "one"], ["p"])]
    inits = [HALF, ONE, SQ2]
    if form == "torch":       # (x * p) * 0.5
        rest = [N("Mul", ["x", "p"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    elif form == "hf":        # (x * 0.5) * p
        rest = [N("Mul", ["x", "half"], ["hx"]), N("Mul", ["hx", "p"], ["y"])]
    elif form == "p_half":    # x * (p * 0.5), 1/sqrt2 as a Mul
        core[0] = N("Mul", ["inv", "x"], ["u"])
        inits.append(_c("inv", float(np.float32(1 / sqrt(2.0)))))
        rest = [N("Mul", ["p", "half"], ["ph"]), N("Mul", ["x", "ph"], ["y"])]
    return core + rest, inits


@pytest.mark.parametrize("form", ["torch", "hf", "p_half"])
def test_erf_gelu_chain_becomes_gelu(form):
    nodes, inits = _erf_gelu(form)
    _check(_model(nodes, inits), "Gelu", absent=("Erf", "Scale", "Mul"))


def test_erf_gelu_not_fused_when_an_intermediate_is_read_elsewhere():
    nodes, inits = _erf_gelu("torch")
    nodes.append(N("Add", ["y", "e"], ["y2"]))  # erf(x/sqrt2) read outside the pattern
    g = _check(_model(nodes, inits, outs=("y2",)))
    assert "Gelu" not in g.op_counts() and g.op_counts()["Erf"] == 1
    nodes, inits = _erf_gelu("hf")
    g = _check(_model(nodes, inits, outs=("y", "p")))  # an intermediate is a graph output
    assert "Gelu" not in g.op_counts()


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_tanh_gelu_chain_becomes_gelu_tanh(cube):
    c3 = [N("Pow", ["x", "three"], ["x3"])] if cube == "pow" else \
        [N("Mul", ["x", "x"], ["x2"]), N("Mul", ["x2", "x"], ["x3"])]
    nodes = c3 + [N("Mul", ["x3", "k1"], ["a"]), N("Add", ["x", "a"], ["i"]), N("Mul", ["i", "k2"], ["u"]),
                  N("Tanh", ["u"], ["t"]), N("Add", ["t", "one"], ["p"]), N("Mul", ["half", "x"], ["hx"]),
                  N("Mul", ["hx", "p"], ["y"])]
    inits = [HALF, ONE, _c("three", 3.0), _c("k1", 0.044715), _c("k2", float(np.float32(sqrt(2 / pi))))]
    _check(_model(nodes, inits), "GeluTanh", absent=("Tanh", "Mul", "Pow"))


def test_silu_both_operand_orders_and_not_when_sigmoid_is_shared():
    for order in (["x", "s"], ["s", "x"]):
        _check(_model([N("Sigmoid", ["x"], ["s"]), N("Mul", order, ["y"])], []), "Silu", absent=("Sigmoid",))
    g = _check(_model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["m"]), N("Add", ["m", "s"], ["y"])], []))
    assert "Silu" not in g.op_counts()
    # x * sigmoid(z) with z != x is not SiLU
    g = _check(_model([N("Relu", ["x"], ["z"]), N("Sigmoid", ["z"], ["s"]), N("Mul", ["x", "s"], ["y"])], []))
    assert "Silu" not in g.op_counts()


def _ln(square="pow", affine=2, opset=13, axes=(-1,)):
    rm = (lambda i, o: N("ReduceMean", [i, "axes"], [o])) if opset >= 18 else \
        (lambda i, o: N("ReduceMean", [i], [o], axes=list(axes)))
    sq = N("Pow", ["d", "two"], ["sq"]) if square == "pow" else N("Mul", ["d", "d"], ["sq"])
    nodes = [rm("x", "mu"), N("Sub", ["x", "mu"], ["d"]), sq, rm("sq", "var"), N("Add", ["var", "eps"], ["ve"]),
             N("Sqrt", ["ve"], ["sd"]), N("Div", ["d", "sd"], ["n" if affine else "y"])]
    rng = np.random.default_rng(1)
    inits = [_c("two", 2.0), _c("eps", 1e-5), numpy_helper.from_array(np.asarray(axes, np.int64), "axes")]
    if affine >= 1:
        nodes.append(N("Mul", ["n", "gamma"], ["y" if affine == 1 else "gn"]))
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma"))
    if affine >= 2:
        nodes.append(N("Add", ["gn", "beta"], ["y"]))
        inits.append(numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "beta"))
    return _model(nodes, inits, opset=opset)


@pytest.mark.parametrize("square,affine,opset", [("pow", 2, 13), ("mul", 2, 13), ("pow", 0, 13),
                                                  ("pow", 1, 13), ("pow", 2, 18)])
def test_layernorm_chain_becomes_layernorm(square, affine, opset):
    g = _check(_ln(square, affine, opset), "LayerNorm", absent=("ReduceMean", "Sqrt", "Div", "Sub"))
    (ln,) = [n for n in g.nodes() if n.op == "LayerNorm"]
    assert ln.a["eps"] == pytest.approx(1e-5) and len(ln.inputs) == 1 + affine


def test_layernorm_over_a_middle_axis_is_not_fused():
    """Axes that are not the trailing dims: the deferred nodes are converted one by one, still equal."""
    g = _check(_ln(axes=(1,)))
    assert "LayerNorm" not in g.op_counts() and g.op_counts()["ReduceMean"] == 2


def test_fusion_can_be_turned_off():
    nodes, inits = _erf_gelu("torch")
    assert "Gelu" not in load(_model(nodes, inits), fuse=False).op_counts()


# --- real exports ------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


class Block(nn.Module):
    """Attention + the four activations / norms whose exports the fusion targets."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads
        self.f1, self.f2, self.f3 = nn.Linear(d, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, S, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = ((q @ k.transpose(-1, -2)) / 2.0).softmax(-1) @ v
        h = x + a.transpose(1, 2).reshape(B, S, d)
        h = nn.functional.gelu(self.f1(h))
        h = nn.functional.gelu(self.f2(h), approximate="tanh")
        return nn.functional.silu(self.f3(h))


def _torch_export(path, opset):
    torch.manual_seed(0)
    m = Block().eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 3, 8),), path, dynamo=False, opset_version=opset, input_names=["x"])
    return path


def test_torch_legacy_export_opset13_fuses_everything(tmp_path):
    """opset 13 has no Gelu/LayerNormalization: the exporter writes the chains; they import fused, and the PCG
    has the operators of the opset-17 export (LayerNormalization, the same Gelu/GeluTanh/Silu)."""
    import onnx
    p13 = _torch_export(str(tmp_path / "b13.onnx"), 13)
    ops13 = {n.op_type for n in onnx.load(p13).graph.node}
    assert {"Erf", "Tanh", "Sigmoid", "ReduceMean", "Sqrt"} <= ops13  # the chains are there
    g = _check(onnx.load(p13))
    c = g.op_counts()
    assert c["Gelu"] == 1 and c["GeluTanh"] == 1 and c["Silu"] == 1 and c["LayerNorm"] == 1, c
    assert c["Softmax"] == 1 and c["BatchMatMul"] == 2, c  # attention stays BatchMatMul + Softmax
    assert not {"Erf", "Tanh", "Sigmoid", "Sqrt", "ReduceMean", "Pow"} & set(c), c
    g17 = load_onnx(_torch_export(str(tmp_path / "b17.onnx"), 17))
    assert g17.op_counts() == c


def _hf_export(model, args, path, dynamo):
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, args, path, dynamo=True, input_names=["ids"], external_data=False, verbose=False)
        else:
            torch.onnx.export(model, args, path, dynamo=False, opset_version=14, input_names=["ids"])
    return path


class _Hidden(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids).last_hidden_state


@pytest.mark.slow
@pytest.mark.parametrize("arch,dynamo", [("bert", False), ("bert", True), ("gpt2", True), ("llama", True)])
def test_transformers_exports_fuse(arch, dynamo, tmp_path):
    """Real exports from transformers (random weights, local configs): BERT's erf GELU and its opset-14
    LayerNorm chains, GPT-2's tanh GELU (NewGELU) import fused and equal to onnxruntime."""
    T = pytest.importorskip("transformers")
    import onnx
    torch.manual_seed(0)
    if arch == "bert":
        cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        m = T.BertModel(cfg, add_pooling_layer=False)
    elif arch == "gpt2":
        cfg = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
        cfg._attn_implementation = "eager"
        m = T.GPT2Model(cfg)
    else:  # SwiGLU MLP: x * sigmoid(x) -> Silu; RMSNorm's Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul chain -> RMSNorm
        cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        m = T.LlamaModel(cfg)
    path = _hf_export(_Hidden(m), (torch.randint(0, 100, (2, 8)),), str(tmp_path / "m.onnx"), dynamo)
    g = load_onnx(path)
    feeds = {"ids": np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int64)}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(evaluate(g, feeds)[0], ref[0], rtol=1e-4, atol=1e-4)
    c = g.op_counts()
    assert c["Softmax"] == 2 and c["BatchMatMul"] == 4, c
    if arch == "llama":
        assert c["Silu"] == 2 and "Sigmoid" not in c and "LayerNorm" not in c, c
        assert c["RMSNorm"] == 5 and not {"Sqrt", "Reciprocal", "Pow"} & set(c), c
        return
    assert c["Gelu" if arch == "bert" else "GeluTanh"] == 2 and c["LayerNorm"] == 5, c
    assert not {"Erf", "Tanh", "Sqrt"} & set(c), c
    assert onnx.load(path).graph.node  # the file itself is untouched


def test_cli_no_fuse_keeps_the_exporters_decomposition(tmp_path, capsys):
    import json

    import onnx

    from unity_pcg.cli import main
    nodes, inits = _erf_gelu("torch")
    p = tmp_path / "gelu.onnx"
    onnx.save(_model(nodes, inits), str(p))
    assert main(["import", str(p), "--json"]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert main(["import", str(p), "--json", "--no-fuse"]) == 0
    plain = json.loads(capsys.readouterr().out)
    text = json.dumps(fused), json.dumps(plain)
    assert '"Gelu"' in text[0] and '"Erf"' not in text[0]
    assert '"Erf"' in text[1] and '"Gelu"' not in text[1]
