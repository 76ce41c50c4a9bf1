"""ONNX import, batch override of a large folded mask: a causal mask [B, 1, S, S] that an exporter computed from
small constants (transformers' vmapped mask as the dynamo exporter writes it for a Llama-style decoder) is
checked along the batch slice by slice and rewritten lazily, with no element cap: re-batched, the model
imports equal to its export at the new batch, and a 4096-token mask never needs its whole in memory."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import consts, fold, load_onnx
from unity_pcg.onnx_import.consts import Const
from unity_pcg.onnx_import.importer import BatchOverride

F = TensorProto.FLOAT


def _causal(batch: int, seq: int, per_sample: bool = False):
    """y = x + mask, x [B, 1, S, S]; mask = Where(ones & (pos[b, j] <= pos[b, i]), 0, min) at [B, 1, S, S],
    folded from the exporter's small constants: positions [B, S] read by GatherND with per-batch indices
    [B, 1, 1, S, 2] and [B, 1, S, 1, 2] (as transformers' vmapped mask exports).  ``per_sample``: sample b's
    key positions are shifted by b (a per-sample mask, which no other batch's export holds)."""
    b, s = np.meshgrid(np.arange(batch), np.arange(seq), indexing="ij")
    pos = s.astype(np.int64)
    posk = (s + (b if per_sample else 0)).astype(np.int64)
    cols = np.stack([b, s], -1).reshape(batch, 1, 1, seq, 2)
    rows = np.stack([b, s], -1).reshape(batch, 1, seq, 1, 2)
    nodes = [helper.make_node("GatherND", ["posk", "cols"], ["kv"]),
             helper.make_node("GatherND", ["pos", "rows"], ["q"]),
             helper.make_node("LessOrEqual", ["kv", "q"], ["le"]),
             helper.make_node("And", ["ones", "le"], ["keep"]),
             helper.make_node("Where", ["keep", "zero", "low"], ["mask"]),
             helper.make_node("Add", ["x", "mask"], ["y"], name="add_mask")]
    inits = {"pos": pos, "posk": posk, "cols": cols, "rows": rows, "ones": np.array(True), "zero": np.array(0, np.float32),
             "low": np.array(np.finfo(np.float32).min, np.float32)}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [batch, 1, seq, seq])],
                          [helper.make_tensor_value_info("y", F, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.fixture(params=["eager", "deferred"])
def fold_limit(request, monkeypatch):
    """``deferred``: the fold guard lowered below the mask's size, so the mask is a deferred lazy constant (what
    a 4096-token mask is at the real guard) and the override must check it through its slices."""
    if request.param == "deferred":
        for mod in (consts, fold):
            monkeypatch.setattr(mod, "MAX_FOLD", 4096)
    return request.param


@pytest.mark.parametrize("src,dst", [(3, 5), (4, 2)])
def test_folded_causal_mask_follows_the_batch(fold_limit, src, dst):
    seq = 40
    g = load_onnx(_causal(src, seq), batch=dst)
    want = load_onnx(_causal(dst, seq))
    assert g.structural_hash() == want.structural_hash()
    x = np.random.default_rng(0).standard_normal((dst, 1, seq, seq)).astype(np.float32)
    got = evaluate(g, {"x": x})[0]
    np.testing.assert_array_equal(got, evaluate(want, {"x": x})[0])
    tri = np.tril(np.ones((seq, seq), bool))
    np.testing.assert_array_equal(got, np.where(tri, x, x + np.finfo(np.float32).min))


def test_per_sample_mask_is_refused_in_one_line(fold_limit):
    with pytest.raises(BatchOverride) as ei:
        load_onnx(_causal(3, 40, per_sample=True), batch=5)
    msg = str(ei.value)
    assert "\n" not in msg and "add_mask" in msg and "differ along dim 0" in msg


def test_a_slice_of_a_lazy_element_wise_constant_is_its_fold_of_slices(monkeypatch):
    """Const.take on a deferred element-wise constant (no value held) equals the slice of its whole value along
    every dim, and is computed from its operand's slices (the operand is never built whole)."""
    for mod in (consts, fold):
        monkeypatch.setattr(mod, "MAX_FOLD", 64)
    seq = 6
    m = _causal(3, seq)
    calls = []

    class Ctx:      # the fold context of the Where node, as the importer gives it
        op, what, name, opset, n_outputs = "Where", "node 'w' (Where)", "w", 17, 1
        node = m.graph.node[4]

        def has(self, k):
            return False
    keep = Const(np.tril(np.ones((seq, seq), bool))[None, None].repeat(3, 0))
    big = consts.lazy(lambda: calls.append(1) or keep.value, keep.shape, bool, deferred="too large",
                      part=lambda a, i: np.take(keep.value, [i], axis=a))
    out = fold.fold_any(Ctx(), [big, Const(np.float32(0)), Const(np.float32(-1))])[0]
    assert out.lazy and out.deferred and out.part is not None
    whole = np.where(keep.value, np.float32(0), np.float32(-1))
    for a in (0, 2, 3):     # (a slice along a dim of size 1 is the whole)
        for i in range(out.shape[a]):
            np.testing.assert_array_equal(out.take(a, i), np.take(whole, [i], axis=a))
    assert not calls    # never built whole
    np.testing.assert_array_equal(out.materialize(), whole)


def test_4096_token_mask_rebatches_in_bounded_memory(tmp_path):
    """A mask [8, 1, 4096, 4096] (134 M elements: 537 MB as float32, more in its folds) re-batched to 32 and
    imported to plan in a process allowed 400 MB above what the imports themselves take: the check runs slice by
    slice and the rewritten mask [32, 1, 4096, 4096] is not built."""
    import onnx
    path = str(tmp_path / "mask.onnx")
    onnx.save(_causal(8, 4096), path)
    code = ("import resource, numpy, onnx\n"
            "from unity_pcg.onnx_import import load_onnx\n"
            "vm = [int(l.split()[1]) << 10 for l in open('/proc/self/status') if l.startswith('VmSize')][0]\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (400 << 20), vm + (400 << 20)))\n"
            f"g = load_onnx({path!r}, batch=32, load_weights=False)\n"
            "print(g.shapes(g.outputs[0][0])[0].sizes)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    assert "32" in r.stdout
