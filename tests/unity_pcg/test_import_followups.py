"""ONNX import follow-ups (issue 10): IsNaN/IsInf (transformers' sdpa attention exported by the dynamo exporter
guards its softmax with Where(IsNaN(p), 0, p)), the legacy exporter's flattened-Gather masks under ``batch=N``,
and the package's public names (errors, ``load_onnx(fuse=False)``).

Fast tests use small hand-built ONNX models compared with onnxruntime; real transformers exports (BERT, GPT-2,
ViT with their default sdpa attention, dynamo exporter; BERT/GPT-2 with the legacy exporter under a batch
override) are under the slow marker.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from unity_pcg.cli import main
from unity_pcg.errors import ModelImportError, UnsupportedOperator
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import BatchOverride, InvalidModel, load_onnx

ort = pytest.importorskip("onnxruntime")

F, I64, B = TP.FLOAT, TP.INT64, TP.BOOL
N = helper.make_node


def model(nodes, inputs, outputs=("y",), inits=(), opset=18):
    g = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    try:   # typed outputs for onnxruntime; models that are bad on purpose stay as built
        return onnx.shape_inference.infer_shapes(m, strict_mode=True)
    except Exception:
        return m


def run_ort(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def special(shape, seed=0):
    """Normal values with NaN, +inf and -inf sprinkled in (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    pick = rng.permutation(flat.size)
    k = max(1, flat.size // 6)
    flat[pick[:k]] = np.nan
    flat[pick[k:2 * k]] = np.inf
    flat[pick[2 * k:3 * k]] = -np.inf
    return x


# --- IsNaN / IsInf ----------------------------------------------------------------------------------------

def test_sdpa_softmax_guard_zeroes_fully_masked_rows_like_onnxruntime():
    """The dynamo exporter's sdpa: p = Softmax(scores + mask); Where(IsNaN(p), 0, p).  A fully masked row (all
    -inf) gives NaN from Softmax, which the guard turns into zeros; equal to onnxruntime, rows and all."""
    m = model([N("Add", ["s", "mask"], ["z"]), N("Softmax", ["z"], ["p"], axis=-1), N("IsNaN", ["p"], ["nan"]),
               N("Where", ["nan", "zero", "p"], ["y"])],
              [("s", F, [2, 3, 4, 4]), ("mask", F, [2, 1, 4, 4])], inits=[("zero", np.float32(0.0))])
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    mask = np.where(rng.random((2, 1, 4, 4)) < 0.4, -np.inf, 0.0).astype(np.float32)
    mask[0, 0, 1, :] = -np.inf          # one fully masked row -> NaN softmax -> zeros
    g = load_onnx(m)
    got = evaluate(g, {"s": s, "mask": mask})[0]
    want = run_ort(m, {"s": s, "mask": mask})[0]
    assert np.all(want[0, :, 1, :] == 0) and not np.isnan(want).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    c = g.op_counts()
    assert c["Equal"] == 1 and c["Not"] == 1 and "IsNaN" not in c, c


@pytest.mark.parametrize("neg,pos", [(1, 1), (0, 1), (1, 0), (0, 0), (None, None)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_isinf_and_isnan_equal_onnxruntime(neg, pos, dtype):
    attrs = {k: v for k, v in (("detect_negative", neg), ("detect_positive", pos)) if v is not None}
    et = F if dtype == np.float32 else TP.DOUBLE
    m = model([N("IsInf", ["x"], ["y"], **attrs), N("IsNaN", ["x"], ["n"])], [("x", et, [3, 5, 4])],
              outputs=("y", "n"))
    x = special((3, 5, 4), seed=1).astype(dtype)
    got = evaluate(load_onnx(m), {"x": x})
    want = run_ort(m, {"x": x})
    assert want[0].dtype == bool and want[0].any() == bool(neg or pos or neg is None)
    for a, b in zip(got, want):
        assert a.dtype == np.bool_
        np.testing.assert_array_equal(a, b)


def test_isnan_isinf_fold_when_constant():
    """All-constant inputs fold (no operator in the PCG)."""
    c = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    m = model([N("IsNaN", ["c"], ["n"]), N("IsInf", ["c"], ["i"]), N("Or", ["n", "i"], ["bad"]),
               N("Where", ["bad", "zero", "c"], ["cc"]), N("Add", ["x", "cc"], ["y"])],
              [("x", F, [2, 4])], inits=[("c", c), ("zero", np.float32(0))])
    g = load_onnx(m)
    assert set(g.op_counts()) <= {"Input", "Weight", "Add"}, g.op_counts()
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(evaluate(g, {"x": x})[0], run_ort(m, {"x": x})[0])


@pytest.mark.parametrize("nodes,inputs,err,words", [
    ([N("IsNaN", ["x"], ["y"])], [("x", I64, [2, 3])], InvalidModel, "float"),
    ([N("IsInf", ["x"], ["y"])], [("x", B, [2, 3])], InvalidModel, "float"),
    ([N("IsInf", ["x"], ["y"], detect_negative=2)], [("x", F, [2, 3])], InvalidModel, "detect_negative"),
    ([N("IsInf", ["x"], ["y"], flavor=1)], [("x", F, [2, 3])], UnsupportedOperator, "flavor"),
    ([N("IsNaN", ["x"], ["y"], axis=1)], [("x", F, [2, 3])], UnsupportedOperator, "axis"),
    ([N("IsNaN", ["x"], ["y"])], [("x", F, [2, 0])], ModelImportError, "zero-size"),
])
def test_isnan_isinf_bad_input_is_a_one_line_error(nodes, inputs, err, words, tmp_path, capsys):
    m = model(nodes, inputs)
    with pytest.raises(err) as e:
        load_onnx(m)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and (nodes[0].op_type in msg or words == "zero-size")
    p = tmp_path / "bad.onnx"
    onnx.save(m, str(p))
    assert main(["import", str(p)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0]


# --- legacy flattened-Gather masks under batch=N ------------------------------------------------------------

H, S = 2, 5


def legacy_mask(batch, rows="per_sample"):
    """What the legacy exporter makes of transformers' vmapped padding mask: the (B, S) mask flattened to (B*S, 1)
    and gathered with constant indices b*S + s of shape (B, 1, 1, S); reshaped, turned into a bias, added to the
    scores.  ``rows="fixed"``: the first sample's rows for everyone (indices that do not follow the batch)."""
    if rows == "per_sample":
        idx = (np.arange(batch).reshape(batch, 1, 1, 1) * S + np.arange(S).reshape(1, 1, 1, S)).astype(np.int64)
    else:
        idx = np.arange(S, dtype=np.int64).reshape(1, 1, 1, S)
    shape = np.array([idx.shape[0], 1, 1, S], dtype=np.int64)
    return model([N("Cast", ["mask"], ["mb"], to=B), N("Flatten", ["mb"], ["flat"], axis=2),
                  N("Gather", ["flat", "idx"], ["gat"], axis=0, name="mask_gather"),
                  N("Reshape", ["gat", "shape"], ["m4"]), N("Where", ["m4", "zero", "ninf"], ["bias"]),
                  N("Add", ["s", "bias"], ["y"])],
                 [("s", F, [batch, H, S, S]), ("mask", I64, [batch, S])],
                 inits=[("idx", idx), ("shape", shape), ("zero", np.float32(0)), ("ninf", np.float32(-1e9))],
                 opset=17)


def _feeds(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"s": rng.standard_normal((batch, H, S, S)).astype(np.float32),
            "mask": rng.integers(0, 2, (batch, S)).astype(np.int64)}


@pytest.mark.parametrize("src,dst", [(2, 6), (6, 2), (3, 5), (4, 1)])
def test_flattened_gather_mask_follows_the_batch(src, dst):
    g = load_onnx(legacy_mask(src), batch=dst)
    want = load_onnx(legacy_mask(dst))
    assert g.structural_hash() == want.structural_hash()
    f = _feeds(dst)
    np.testing.assert_array_equal(evaluate(g, f)[0], run_ort(legacy_mask(dst), f)[0])
    # and the mask is really per sample: sample b's bias comes from mask[b]
    assert (evaluate(g, f)[0] < -1e8).sum() == H * S * (f["mask"] == 0).sum()


def test_fixed_rows_of_a_flattened_batch_are_not_rewritten():
    """Indices that do not hold one block per sample stay as exported (an export at N holds the same)."""
    g = load_onnx(legacy_mask(2, rows="fixed"), batch=5)
    assert g.structural_hash() == load_onnx(legacy_mask(5, rows="fixed")).structural_hash()


@pytest.mark.parametrize("rows", ["per_sample", "fixed"])
def test_flattened_gather_exported_at_batch_1_is_a_one_line_error(rows, tmp_path, capsys):
    """At batch 1, indices inside the one sample's block could be that sample's rows or fixed rows: refused,
    naming the node, never a silently different graph."""
    with pytest.raises(BatchOverride) as e:
        load_onnx(legacy_mask(1, rows), batch=4)
    assert "mask_gather" in str(e.value) and "\n" not in str(e.value)
    p = tmp_path / "b1.onnx"
    onnx.save(legacy_mask(1, rows), str(p))
    assert main(["import", str(p), "--batch", "4"]) == 2
    assert "mask_gather" in capsys.readouterr().err


def token_types(batch, per_sample=False):
    """BERT without a token_type_ids input, legacy exporter: the buffered zeros expanded to (B, S) are folded into
    a constant, gathered from the token-type table (an Embedding of constant ids) and added to the word
    embeddings of the real input.  ``per_sample``: ids that differ between samples (cannot follow the batch)."""
    tt = np.zeros((batch, S), np.int64)
    if per_sample:
        tt[0, 0] = 1
    rng = np.random.default_rng(3)
    return model([N("Gather", ["words", "ids"], ["we"]), N("Expand", ["tt0", "tshape"], ["tt"]),
                  N("Gather", ["types", "tt"], ["te"], name="type_gather"), N("Add", ["we", "te"], ["y"])],
                 [("ids", I64, [batch, S])],
                 inits=[("words", rng.standard_normal((11, 4)).astype(np.float32)),
                        ("types", rng.standard_normal((2, 4)).astype(np.float32)),
                        ("tt0", tt), ("tshape", np.array([batch, S], np.int64))], opset=17)


@pytest.mark.parametrize("src,dst", [(2, 7), (3, 2)])
def test_embedding_of_folded_constant_ids_follows_the_batch(src, dst):
    g = load_onnx(token_types(src), batch=dst)
    assert g.structural_hash() == load_onnx(token_types(dst)).structural_hash()
    f = {"ids": np.random.default_rng(0).integers(0, 11, (dst, S)).astype(np.int64)}
    np.testing.assert_allclose(evaluate(g, f)[0], run_ort(token_types(dst), f)[0], rtol=1e-6, atol=1e-6)


def test_embedding_of_per_sample_constant_ids_is_a_one_line_error():
    with pytest.raises(BatchOverride) as e:
        load_onnx(token_types(2, per_sample=True), batch=6)
    assert "type_gather" in str(e.value) and "\n" not in str(e.value)


# --- public names --------------------------------------------------------------------------------------

def test_public_errors_and_fuse_flag():
    import unity_pcg.onnx_import as oi
    from unity_pcg.onnx_import import check, errors, importer
    for name in ("BatchOverride", "InvalidModel", "MissingTensor", "DynamicDimension", "UnsupportedOperator",
                 "ModelImportError", "CheckError"):
        assert name in oi.__all__ and issubclass(getattr(oi, name), ModelImportError), name
    assert oi.BatchOverride is importer.BatchOverride is errors.BatchOverride
    assert oi.CheckError is check.CheckError
    # fuse=False keeps an Erf GELU chain as the exporter wrote it
    m = model([N("Div", ["x", "r2"], ["a"]), N("Erf", ["a"], ["b"]), N("Add", ["b", "one"], ["c"]),
               N("Mul", ["x", "c"], ["d"]), N("Mul", ["d", "half"], ["y"])], [("x", F, [2, 8])],
              inits=[("r2", np.float32(np.sqrt(2))), ("one", np.float32(1)), ("half", np.float32(0.5))])
    assert "Gelu" in load_onnx(m).op_counts()
    plain = load_onnx(m, fuse=False).op_counts()
    assert "Gelu" not in plain and plain["Erf"] == 1, plain
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(evaluate(load_onnx(m, fuse=False), {"x": x})[0], run_ort(m, {"x": x})[0],
                               rtol=1e-5, atol=1e-6)


# --- RMSNorm fusion ------------------------------------------------------------------------------------

def rms_chain(square="pow", inv="reciprocal", gamma=True, axes=(-1,), leak=False, eps=1e-6):
    """T5's / Llama's RMSNorm as exporters write it: x^2 (Pow or Mul), ReduceMean, Add eps, Sqrt, then
    Reciprocal + Mul x (dynamo), Div(1, .) + Mul x (legacy) or Div(x, .); optionally Mul gamma (weight first, as
    Llama's ``weight * h``).  ``leak``: the mean is also a graph output (read outside the pattern)."""
    nodes = [N("Pow", ["x", "two"], ["sq"]) if square == "pow" else N("Mul", ["x", "x"], ["sq"]),
             N("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1), N("Add", ["ms", "eps"], ["ve"]),
             N("Sqrt", ["ve"], ["rt"])]
    if inv == "reciprocal":
        nodes += [N("Reciprocal", ["rt"], ["iv"]), N("Mul", ["x", "iv"], ["h"])]
    elif inv == "div1":
        nodes += [N("Div", ["one", "rt"], ["iv"]), N("Mul", ["iv", "x"], ["h"])]
    else:
        nodes += [N("Div", ["x", "rt"], ["h"])]
    nodes += [N("Mul", ["w", "h"], ["y"])] if gamma else [N("Identity", ["h"], ["y"])]
    rng = np.random.default_rng(5)
    return model(nodes, [("x", F, [2, 3, 8])], outputs=("y", "ms") if leak else ("y",),
                 inits=[("two", np.float32(2)), ("one", np.float32(1)), ("eps", np.float32(eps)),
                        ("axes", np.array(axes, np.int64)), ("w", rng.standard_normal(8).astype(np.float32))])


@pytest.mark.parametrize("square,inv,gamma", [("pow", "reciprocal", True), ("mul", "div1", True),
                                              ("pow", "div", False), ("pow", "div1", False)])
def test_rmsnorm_chains_fuse_and_equal_onnxruntime(square, inv, gamma):
    m = rms_chain(square, inv, gamma)
    g = load_onnx(m)
    c = g.op_counts()
    assert c.get("RMSNorm") == 1 and not {"Sqrt", "Reciprocal", "Div", "Pow", "ReduceMean"} & set(c), c
    assert "Mul" not in c and g.meta["fused"] == {"RMSNorm": 1}
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32) * 3
    np.testing.assert_allclose(evaluate(g, {"x": x})[0], run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(axes=(1,)), dict(leak=True), dict(eps=-1.0)])
def test_rmsnorm_lookalikes_stay_unfused_and_equal(kw):
    """A reduction over a non-trailing dim, a mean read outside the chain, a negative eps: not an RMSNorm, the
    nodes import one by one (same values)."""
    m = rms_chain(**kw)
    g = load_onnx(m)
    assert "RMSNorm" not in g.op_counts() and "RMSNorm" not in g.meta["fused"]
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    for a, b in zip(evaluate(g, {"x": x}), run_ort(m, {"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_rmsnorm_fusion_off_with_fuse_false():
    c = load_onnx(rms_chain(), fuse=False).op_counts()
    assert "RMSNorm" not in c and c["Sqrt"] == 1 and c["Reciprocal"] == 1, c


# --- real transformers exports (slow) -------------------------------------------------------------------

def _hf(arch, attn):
    T = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    if arch == "bert":
        cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32)
        m = T.BertModel(cfg, add_pooling_layer=False)
    elif arch == "gpt2":
        cfg = T.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32, use_cache=False)
        m = T.GPT2Model(cfg)
    else:
        cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=16, patch_size=8)
        m = T.ViTModel(cfg, add_pooling_layer=False)
    m.config._attn_implementation = attn
    return m.eval()


def _export(arch, attn, batch, dynamo, path):
    torch = pytest.importorskip("torch")
    m = _hf(arch, attn)

    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, *xs):
            if arch == "vit":
                return self.m(pixel_values=xs[0]).last_hidden_state
            return self.m(input_ids=xs[0], attention_mask=xs[1]).last_hidden_state

    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        args, names = (torch.randn(batch, 3, 16, 16, generator=g),), ["pixel_values"]
    else:
        args = (torch.randint(0, 100, (batch, 6), generator=g), torch.ones(batch, 6, dtype=torch.int64))
        names = ["input_ids", "attention_mask"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(W().eval(), args, path, input_names=names, dynamo=True, opset_version=18,
                              external_data=False, verbose=False)
        else:
            torch.onnx.export(W().eval(), args, path, input_names=names, dynamo=False, opset_version=17)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "gpt2", "vit"])
def test_transformers_sdpa_dynamo_exports_import_and_check_equal(arch, tmp_path):
    """transformers' default attention (sdpa), dynamo exporter: imports (IsNaN guard included) and checks equal
    with onnxruntime, also under a batch override (ORT on the file at its batch, in chunks where it must)."""
    from unity_pcg.onnx_import.check import check_model
    path = _export(arch, "sdpa", 2, True, str(tmp_path / "m.onnx"))
    assert any(n.op_type == "IsNaN" for n in onnx.load(path).graph.node)
    r = check_model(path)
    assert r.ok, r.to_json()
    assert check_model(path, batch=3).ok
    if arch == "bert":   # exact batch: the same PCG as exporting at that batch
        p4 = _export(arch, "sdpa", 4, True, str(tmp_path / "m4.onnx"))
        assert load_onnx(path, batch=4, load_weights=False).structural_hash() == \
            load_onnx(p4, load_weights=False).structural_hash()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_transformers_legacy_mask_under_batch_override(arch, tmp_path):
    """The legacy exporter bakes the batch into the mask's flattened-Gather indices: exported at 2 and imported
    with batch=8 (and back) is the same PCG as the export at that batch, and checks equal."""
    from unity_pcg.onnx_import.check import check_model
    p = {b: _export(arch, "eager", b, False, str(tmp_path / f"m{b}.onnx")) for b in (2, 8)}
    for src, dst in ((2, 8), (8, 2)):
        assert load_onnx(p[src], batch=dst, load_weights=False).structural_hash() == \
            load_onnx(p[dst], load_weights=False).structural_hash(), (src, dst)
    assert check_model(p[2], batch=8).ok
