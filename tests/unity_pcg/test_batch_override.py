"""ONNX import, issue 10 point 7: ``batch=N`` on a model exported with a fixed batch gives the same PCG
(structural hash) as exporting at batch N, whatever the exporter baked into Expand, Reshape, Tile,
ConstantOfShape or Range targets; where it cannot, one line names the node (exit 2 on the CLI)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.cli import main
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import load_onnx
from unity_pcg.onnx_import.importer import BatchOverride

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
from torch import nn  # noqa: E402


class ViTLike(nn.Module):
    """What a ViT export bakes the batch into: the class token's Expand, a Tile (repeat), reshapes with the
    batch as a literal (also merged with the sequence: B*S rows), a ConstantOfShape (zeros mask), and with
    ``arange_rows`` a Range used as row indices."""

    def __init__(self, arange_rows: bool, d=12, p=4, heads=2):
        super().__init__()
        self.arange_rows = arange_rows
        self.patch = nn.Conv2d(3, d, p, p)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.reg = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 2 + (8 // p) ** 2, d))
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads
        self.out = nn.Linear(d, 5)

    def forward(self, x):
        B = x.shape[0]
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(B, -1, -1), self.reg.repeat(B, 1, 1), t], dim=1) + self.pos
        S, d = t.shape[1], t.shape[2]
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        q, k, v = (z.reshape(B, S, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = (q @ k.transpose(-1, -2) + torch.zeros(B, 1, 1, S)).softmax(-1)
        t = (a @ v).transpose(1, 2).reshape(B * S, d).reshape(B, S, d)
        first = t[torch.arange(B), 0] if self.arange_rows else t[:, 0]
        return self.out(first)


def _export(batch, path, exporter, arange_rows=True):
    torch.manual_seed(0)
    m = ViTLike(arange_rows).eval()
    x = torch.randn(batch, 3, 8, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), path, dynamo=(exporter == "dynamo"), opset_version=17 if exporter == "legacy"
                          else 18, input_names=["x"], **({"do_constant_folding": True} if exporter == "legacy"
                                                          else {"external_data": False, "verbose": False}))
    return path


def _ort(path, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(scope="module")
def vit_legacy(tmp_path_factory):
    d = tmp_path_factory.mktemp("vit")
    return {b: _export(b, str(d / f"vit{b}.onnx"), "legacy") for b in (2, 8)}


@pytest.mark.parametrize("src,dst", [(2, 8), (8, 2)])
def test_vit_like_legacy_override_equals_export_at_that_batch(vit_legacy, src, dst):
    g = load_onnx(vit_legacy[src], batch=dst)
    want = load_onnx(vit_legacy[dst])
    assert g.structural_hash() == want.structural_hash()
    # and it computes what onnxruntime computes on the file exported at that batch (same weights)
    feeds = {"x": np.random.default_rng(1).standard_normal((dst, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(evaluate(g, feeds)[0], _ort(vit_legacy[dst], feeds)[0], rtol=1e-4, atol=1e-5)


def test_issue_example_batch_48_on_a_batch_8_export(vit_legacy):
    """The issue's report: a ViT exported at batch 8 stopped at the class token's Concat with --batch 48."""
    g = load_onnx(vit_legacy[8], batch=48)
    assert g.shape(g.outputs[0]).sizes == (48, 5)
    exp = [n for n in g.nodes() if n.op == "Weight" and g.shape((n.id, 0)).sizes[:1] == (48,)]
    assert exp  # the folded class-token / register Expand and Tile constants now hold 48 rows
    assert main(["import", vit_legacy[8], "--batch", "48"]) == 0


@pytest.mark.slow
def test_vit_like_dynamo_override_equals_export_at_that_batch(tmp_path):
    """The dynamo exporter folds the Expand, Tile and zeros into initializers [B, ...]."""
    p2 = _export(2, str(tmp_path / "d2.onnx"), "dynamo", arange_rows=False)
    p8 = _export(8, str(tmp_path / "d8.onnx"), "dynamo", arange_rows=False)
    assert load_onnx(p2, batch=8).structural_hash() == load_onnx(p8).structural_hash()


def test_exported_at_batch_1(tmp_path):
    """Batch 1 is ambiguous where a size-1 dim may or may not be the batch: the class-token Concat (sizes must
    match) is rewritten and the result equals onnxruntime on the file exported at 4; a constant row index along
    the batch ([0]: arange(1) or the first row?) is a one-line error naming the Gather."""
    p1 = _export(1, str(tmp_path / "v1.onnx"), "legacy", arange_rows=False)
    p4 = _export(4, str(tmp_path / "v4.onnx"), "legacy", arange_rows=False)
    g = load_onnx(p1, batch=4)
    feeds = {"x": np.random.default_rng(2).standard_normal((4, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(evaluate(g, feeds)[0], _ort(p4, feeds)[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(BatchOverride, match="Gather") as ei:
        load_onnx(_export(1, str(tmp_path / "r1.onnx"), "legacy", arange_rows=True), batch=4)
    assert "\n" not in str(ei.value)


# --- hand-made graphs ------------------------------------------------------------------------------

F = TensorProto.FLOAT


def _model(nodes, inits, batch, in_shape, out="y"):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [batch] + list(in_shape))],
                          [helper.make_tensor_value_info(out, F, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _seq_first(batch, seq=6, heads=3, hd=4):
    """nn.MultiheadAttention's layout: x [S, B, d] reshaped to [S, B*heads, hd] (the batch is not dim 0)."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["xt", "t1"], ["r"]),
             helper.make_node("Transpose", ["r"], ["rt"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["rt", "t2"], ["y"])]
    inits = {"t1": np.array([seq, batch * heads, hd]), "t2": np.array([batch, heads, seq, hd])}
    return _model(nodes, inits, batch, [seq, heads * hd])


@pytest.mark.parametrize("src,dst", [(3, 6), (6, 3), (2, 4)])
def test_batch_inside_a_reshape_target_is_placed_exactly(src, dst):
    """Here the exported batch (also a multiple of the seq length 6) is a factor of dim 1 of the target."""
    g = load_onnx(_seq_first(src), batch=dst)
    assert g.structural_hash() == load_onnx(_seq_first(dst)).structural_hash()
    x = np.random.default_rng(0).standard_normal((dst, 6, 12)).astype(np.float32)
    want = x.transpose(1, 0, 2).reshape(6, dst * 3, 4).transpose(1, 0, 2).reshape(dst, 3, 6, 4)
    np.testing.assert_array_equal(evaluate(g, {"x": x})[0], want)


def _seq_first_merged(batch, seq=5, heads=3, hd=4):
    """torchvision ViT's attention layout (nn.MultiheadAttention, batch_first=False inside): x [B, S, d] made
    sequence-first, the batch MERGED with the sequence ([S, B, H, D] -> [S*B, H*D]) and split back
    ([S*B, d] -> [S, B, d])."""
    d = heads * hd
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["xt", "t1"], ["r4"]),
             helper.make_node("Reshape", ["r4", "t2"], ["m"]),
             helper.make_node("Reshape", ["m", "t3"], ["s"]),
             helper.make_node("Transpose", ["s"], ["y"], perm=[1, 0, 2])]
    inits = {"t1": np.array([seq, batch, heads, hd]), "t2": np.array([seq * batch, d]),
             "t3": np.array([seq, batch, d])}
    return _model(nodes, inits, batch, [seq, d])


@pytest.mark.parametrize("src,dst", [(8, 2), (2, 3), (3, 8), (2, 4), (8, 256)])
def test_batch_merged_with_the_sequence_is_placed_exactly(src, dst):
    """[S, B, H, D] -> [S*B, H*D] and back: the merged dim scales with the batch; the split back puts the new
    batch in the dim that held the exported one (same hash as the export at ``dst``, same values), also where
    the sequence dim could take the new batch's factor (2 -> 4, 8 -> 256: torchvision's ViT-B/16 at 8 -> 256)."""
    g = load_onnx(_seq_first_merged(src), batch=dst)
    assert g.structural_hash() == load_onnx(_seq_first_merged(dst)).structural_hash()
    x = np.random.default_rng(0).standard_normal((dst, 5, 12)).astype(np.float32)
    np.testing.assert_array_equal(evaluate(g, {"x": x})[0], x)


def test_reshape_that_scatters_the_batch_is_refused_naming_it():
    """A reshape whose groups do not line up with the batch dim ([S, B, d] -> [B, S*d] read row-major: the
    batch lands inside no output dim) stays a one-line refusal naming the node."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["xt", "t"], ["y"], name="scatter")]
    m = _model(nodes, {"t": np.array([4, 30])}, 4, [5, 6])
    with pytest.raises(BatchOverride, match="'scatter'") as ei:
        load_onnx(m, batch=2)
    assert "\n" not in str(ei.value)


def _masked(batch, per_sample: bool, rows: bool):
    """x [B, 4] + a constant [B, 4] (a folded ConstantOfShape/Expand, or per-sample data); with ``rows`` a
    Gather of rows Range(0, B) as the exporters fold ``x[torch.arange(B)]``."""
    c = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32) if per_sample else \
        np.tile(np.array([[0.5, 1, 2, 3]], np.float32), (batch, 1))
    nodes = [helper.make_node("Add", ["x", "c"], ["a"])]
    inits = {"c": c}
    if rows:
        nodes += [helper.make_node("Range", ["zero", "b", "one"], ["ids"]),
                  helper.make_node("Gather", ["a", "ids"], ["y"], axis=0)]
        inits.update(zero=np.array(0), b=np.array(batch), one=np.array(1))
    else:
        nodes[0].output[0] = "y"
    return _model(nodes, inits, batch, [4])


@pytest.mark.parametrize("rows", [False, True])
def test_folded_constant_and_range_rows_follow_the_batch(rows):
    g = load_onnx(_masked(2, False, rows), batch=5)
    assert g.structural_hash() == load_onnx(_masked(5, False, rows)).structural_hash()


def _row_index(batch):
    """x [B, 4] + Range(0, B) as a column (a folded ``torch.arange(B)[:, None] * 2``): an arithmetic progression
    along the batch, which extends to any batch."""
    c = (np.arange(batch, dtype=np.float32)[:, None] * 2).repeat(4, axis=1)
    return _model([helper.make_node("Add", ["x", "c"], ["y"])], {"c": c}, batch, [4])


def test_folded_range_column_follows_the_batch():
    g = load_onnx(_row_index(3), batch=7)
    assert g.structural_hash() == load_onnx(_row_index(7)).structural_hash()
    x = np.zeros((7, 4), np.float32)
    np.testing.assert_array_equal(evaluate(g, {"x": x})[0], (np.arange(7)[:, None] * 2.0).repeat(4, axis=1))


@pytest.mark.parametrize("exported", [2, 3])
def test_per_sample_constant_is_a_one_line_error_naming_the_node(tmp_path, exported):
    with pytest.raises(BatchOverride) as ei:
        load_onnx(_masked(exported, True, False), batch=5)
    msg = str(ei.value)
    assert "\n" not in msg and "'c'" in msg and "Add" in msg and "batch 5" in msg
    path = str(tmp_path / "m.onnx")
    import onnx
    onnx.save(_masked(exported, True, False), path)
    assert main(["import", path, "--batch", "5"]) == 2
    assert load_onnx(path, batch=exported).structural_hash() == load_onnx(path).structural_hash()  # no change


# --- the zoo -----------------------------------------------------------------------------------------

def _zoo_same(name, exporter, tmp_path):
    from unity_pcg import zoo
    p2 = zoo.export(name, str(tmp_path / f"{name}2.onnx"), batch=2, exporter=exporter)
    p8 = zoo.export(name, str(tmp_path / f"{name}8.onnx"), batch=8, exporter=exporter)
    for a, b, n in ((p2, p8, 8), (p8, p2, 2)):
        assert load_onnx(a, batch=n, load_weights=False).structural_hash() == \
            load_onnx(b, load_weights=False).structural_hash(), (name, exporter, n)


@pytest.mark.parametrize("name", ["bert_large", "dlrm", "mlp"])
def test_zoo_override_equals_export_fast(name, tmp_path):
    _zoo_same(name, "legacy", tmp_path)


def _zoo_names():
    try:
        from unity_pcg import zoo
        return [e.name for e in zoo.list_models()]
    except Exception:  # pragma: no cover - the zoo needs torch
        return []


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_override_equals_export_every_model(name, exporter, tmp_path):
    _zoo_same(name, exporter, tmp_path)


def test_file_is_not_rewritten(vit_legacy):
    """The override reads the file; a second import without it is the file's own batch."""
    load_onnx(vit_legacy[2], batch=8)
    assert load_onnx(vit_legacy[2]).shape(load_onnx(vit_legacy[2]).outputs[0]).sizes == (2, 5)
    assert os.path.getsize(vit_legacy[2]) > 0


@pytest.mark.parametrize("name", ["vit", "bert_large", "dlrm"])
def test_exported_shapes_from_onnx_inference_agree_with_the_probe_import(name, vit_legacy, tmp_path, monkeypatch):
    """The override's reference shapes (the graph at its exported batch) come from ONNX's shape inference,
    and from a second import of the graph (the probe) for what it leaves unknown: where both know a tensor they
    agree, and the override imports the same PCG with the inference, without it, and with only the probe."""
    import onnx

    from unity_pcg.onnx_import import importer as imp
    if name == "vit":
        path = vit_legacy[2]
    else:
        from unity_pcg import zoo
        path = zoo.export(name, str(tmp_path / f"{name}.onnx"), batch=2, exporter="legacy")
    model = onnx.load(path, load_external_data=False)
    shapes = imp._ExportedShapes(model, os.path.dirname(path))
    probe = shapes._probed()
    known = [k for k in shapes.inferred if k in probe]
    assert len(known) > len(model.graph.node) // 2       # the inference answers most of them
    assert {k: shapes.inferred[k] for k in known} == {k: probe[k] for k in known}
    want = load_onnx(path, batch=6, load_weights=False).structural_hash()
    calls = []
    orig = imp._ExportedShapes._probed
    monkeypatch.setattr(imp._ExportedShapes, "_probed", lambda self: calls.append(1) or orig(self))
    monkeypatch.setattr(imp, "_onnx_inferred_shapes", lambda m: {})    # no inference: the probe answers all
    assert load_onnx(path, batch=6, load_weights=False).structural_hash() == want and calls


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True])
def test_transformers_vit_exported_at_8_imports_at_48(dynamo, tmp_path):
    """The issue's report with a real transformers ViT (random weights, local config): exported at batch 8,
    imported with batch=48, the same PCG as exported at 48."""
    T = pytest.importorskip("transformers")
    cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=32, patch_size=8)
    cfg._attn_implementation = "eager"

    class W(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.m = T.ViTModel(cfg, add_pooling_layer=False)

        def forward(self, x):
            return self.m(pixel_values=x).last_hidden_state

    paths = {}
    for b in (8, 48):
        paths[b] = str(tmp_path / f"vit{b}.onnx")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(W().eval(), (torch.randn(b, 3, 32, 32),), paths[b], dynamo=dynamo, input_names=["x"],
                              **({"external_data": False, "verbose": False} if dynamo else {"opset_version": 17}))
    assert load_onnx(paths[8], batch=48).structural_hash() == load_onnx(paths[48]).structural_hash()


# --- the benchmark's comparison (benchmarks/import_coverage.py --batch-hash) ---------------------------------------

def test_batch_hash_compare_tells_equal_names_differs_and_refused(tmp_path):
    """``hash_compare`` on hand-made files: the override equal to the export at N; the same graph with a
    renamed initializer (the dynamo exporter's counter names) is ``names``; another target is ``differs`` naming a
    node; a reshape that scatters the batch is ``refused`` with the importer's line."""
    import sys

    import onnx
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
    import import_coverage as ic

    def save(m, name):
        p = str(tmp_path / name)
        onnx.save(m, p)
        return p

    src, ref = save(_seq_first_merged(8), "s8.onnx"), save(_seq_first_merged(2), "s2.onnx")
    assert ic.hash_compare(src, ref, 2)["status"] == "equal"
    renamed = _masked(2, False, False)   # x + c, c a folded Expand [B, 4]: a Weight named after its tensor
    renamed.graph.initializer[0].name = "val_7"
    renamed.graph.node[0].input[1] = "val_7"
    r = ic.hash_compare(save(_masked(3, False, False), "m3.onnx"), save(renamed, "r2.onnx"), 2)
    assert r["status"] == "names" and "val_7" in r["reason"], r
    assert ic.hash_compare(save(_masked(3, False, False), "m3.onnx"), save(_masked(2, False, False), "m2.onnx"),
                           2)["status"] == "equal"
    other = _seq_first_merged(2, heads=2, hd=6)   # same sizes in and out, another head split inside
    r = ic.hash_compare(src, save(other, "o2.onnx"), 2)
    assert r["status"] == "differs" and "Reshape" in r["reason"], r
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["xt", "t"], ["y"], name="scatter")]
    bad = save(_model(nodes, {"t": np.array([4, 30])}, 4, [5, 6]), "b4.onnx")
    r = ic.hash_compare(bad, bad, 2)
    assert r["status"] == "refused" and "'scatter'" in r["reason"], r


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "t5_encoder", "llama", "wav2vec2"])
def test_coverage_transformers_override_equals_export_at_3(name, exporter):
    """Real transformers exports of the import-coverage set (benchmarks/export_models.py, cached): exported at
    2 and imported with batch=3, the PCG of the export at 3; the dynamo exporter's counter-numbered Weight names
    are the only difference it may leave (``names``)."""
    import sys
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
    import export_models as E
    import import_coverage as ic
    recs = [E.export_one("transformers", name, exporter, batch=b) for b in (None, 3)]
    assert E.TBATCH == 2   # the override export leaves the module's batch as it was
    assert all(r["status"] in ("ok", "cached") for r in recs), recs
    r = ic.hash_compare(*(os.path.join(E.HERE, x["file"]) for x in recs), 3)
    assert r["status"] == "equal" or (exporter == "dynamo" and r["status"] == "names"), r


def _wide_row_index(batch, width=40000):
    c = (np.arange(batch, dtype=np.float32)[:, None] * 2).repeat(width, axis=1)
    return _model([helper.make_node("Add", ["x", "c"], ["y"])], {"c": c}, batch, [width])


def test_a_large_constant_follows_the_batch_with_its_values():
    """A constant holding the batch that grows past the small-constant size when rewritten (GPT-2's causal mask
    [B, 1, S, S] at a large global batch) is computed only when its values are read: the PCG equals the export
    at that batch and evaluates to the same values."""
    g = load_onnx(_wide_row_index(3), batch=7)
    assert g.structural_hash() == load_onnx(_wide_row_index(7)).structural_hash()
    x = np.ones((7, 40000), np.float32)
    np.testing.assert_array_equal(evaluate(g, {"x": x})[0], 1 + (np.arange(7)[:, None] * 2.0).repeat(40000, axis=1))


def test_planning_at_a_huge_batch_does_not_build_the_rewritten_constant(tmp_path):
    """Imported without weights (to plan) at a batch where the rewritten constant would be 16 GB, the import
    does not compute it: it succeeds in a process limited to 3 GB of address space."""
    import subprocess
    import sys

    import onnx
    path = str(tmp_path / "wide.onnx")
    onnx.save(_wide_row_index(3), path)
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from unity_pcg.onnx_import import load_onnx; "
            f"g = load_onnx({path!r}, batch=100000, load_weights=False); print(g.shapes(g.outputs[0][0])[0].sizes)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    assert "100000" in r.stdout
