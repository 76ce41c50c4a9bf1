"""ONNX import of the indexing/masking operators on activations (issue 10 point 2): Where, the comparisons,
Not/And/Or/Xor, GatherElements, Tile, Expand, Einsum, Trilu, ScatterND, CumSum.

Each is imported from a small hand-built ONNX model and evaluated with the numpy reference, then compared
with onnxruntime (floats as in test_onnx_import: rtol 1e-4, atol 1e-5 x max|ort|; booleans and integers
exactly); a module exported by torch (legacy exporter) puts the exporters' mask idioms together; the
data-parallel PCG of an attention-mask model evaluates piecewise to the same values.  Bad input (bad
attribute values, rank mismatches, zero-size dims, and seeded random mutations of these models) gives a
typed one-line error, and the CLI exits 2.
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from unity_pcg.errors import UnityError, UnsupportedOperator
from unity_pcg.evaluate import evaluate
from unity_pcg.onnx_import import InvalidModel, load_onnx

ort = pytest.importorskip("onnxruntime")

F, I64, B = TP.FLOAT, TP.INT64, TP.BOOL
N = helper.make_node


# --- helpers ----------------------------------------------------------------------------------------

def model(nodes, inputs, outputs=("y",), inits=(), opset=17, infer=True):
    """inputs: [(name, elem_type, shape)]; outputs: names (types left to inference)."""
    g = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    try:    # onnxruntime wants typed outputs: ONNX's shape inference fills them in (bad models stay as built)
        return onnx.shape_inference.infer_shapes(m, strict_mode=True) if infer else m
    except Exception:
        return m


def feeds_for(m, seed=0, int_high=3):
    """Standard normal floats, integers in [0, int_high) (equal values are common), random booleans."""
    rng = np.random.default_rng(seed)
    out = {}
    for vi in m.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        if tt.elem_type == B:
            out[vi.name] = rng.random(shape) < 0.5
        elif tt.elem_type in (I64, TP.INT32):
            out[vi.name] = rng.integers(0, int_high, shape).astype(np.int64 if tt.elem_type == I64 else np.int32)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def run_ort(m, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def assert_same(ours, ref, what=""):
    assert len(ours) == len(ref), what
    for k, (a, b) in enumerate(zip(ours, ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{what} output {k}: shape {a.shape} != {b.shape}"
        if b.dtype.kind in "biu":
            assert a.dtype.kind == b.dtype.kind, f"{what} output {k}: dtype {a.dtype} != {b.dtype}"
            np.testing.assert_array_equal(a, b, err_msg=f"{what} output {k}")
        else:
            atol = 1e-5 * float(np.max(np.abs(b[np.isfinite(b)]))) if np.isfinite(b).any() else 0.0
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol, err_msg=f"{what} output {k}")


def import_and_compare(m, seed=0, int_high=3, ops=()):
    g = load_onnx(m)
    g.check()
    used = {n.op for n in g.nodes()}
    assert set(ops) <= used, f"expected operators {sorted(ops)}, the PCG has {sorted(used)}"
    for s in range(seed, seed + 2):
        feeds = feeds_for(m, s, int_high)
        assert_same(evaluate(g, feeds), run_ort(m, feeds), m.graph.node[-1].op_type)
    return g


# --- one model per operator form ------------------------------------------------------------------------

TRIL = np.tril(np.ones((1, 1, 4, 4), bool))
CASES = {
    # attention masks: a constant causal mask, a mask computed from activations, a bool input mask
    "where_const_mask": (model([N("Where", ["mask", "s", "neg"], ["y"])], [("s", F, [2, 3, 4, 4])],
                               inits=[("mask", TRIL), ("neg", np.array(-1e9, np.float32))]), ["Where"]),
    "where_computed_mask": (model([N("Less", ["a", "b"], ["c"]), N("Where", ["c", "a", "b"], ["y"])],
                                  [("a", F, [2, 5]), ("b", F, [5])]), ["Where", "Less"]),
    "where_bool_input": (model([N("Where", ["m", "zero", "x"], ["y"])], [("m", B, [2, 1, 4]), ("x", F, [3, 4])],
                               inits=[("zero", np.zeros((1,), np.float32))]), ["Where"]),
    "where_int": (model([N("Greater", ["i", "j"], ["c"]), N("Where", ["c", "i", "j"], ["y"])],
                        [("i", I64, [3, 4]), ("j", I64, [3, 1])]), ["Where"]),
    "compare_all": (model([N(op, ["a", "b"], [f"y{k}"]) for k, op in
                           enumerate(["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])],
                          [("a", I64, [2, 3, 4]), ("b", I64, [3, 1])], outputs=[f"y{k}" for k in range(5)]),
                    ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]),
    "compare_float_const": (model([N("Equal", ["a", "c"], ["y0"]), N("GreaterOrEqual", ["c", "a"], ["y1"])],
                                  [("a", F, [3, 4])], outputs=["y0", "y1"],
                                  inits=[("c", np.array([0.0, 1.0, -1.0, 0.5], np.float32))]),
                            ["Equal", "GreaterOrEqual"]),
    "logic": (model([N("Not", ["p"], ["np"]), N("And", ["np", "q"], ["y0"]), N("Or", ["p", "q"], ["y1"]),
                     N("Xor", ["p", "q"], ["y2"]), N("Equal", ["p", "q"], ["y3"])],
                    [("p", B, [2, 4]), ("q", B, [4])], outputs=["y0", "y1", "y2", "y3"]),
              ["Not", "And", "Or", "Xor", "Equal"]),
    "gather_elements_const_idx": (model([N("GatherElements", ["x", "idx"], ["y"], axis=1)], [("x", F, [2, 5, 3])],
                                        inits=[("idx", np.array([[[0, -1, 4], [2, 2, -5]],
                                                                 [[1, 3, 0], [4, -2, 1]]], np.int64))]),
                                  ["GatherElements"]),
    "gather_elements_act_idx": (model([N("GatherElements", ["x", "i"], ["y"], axis=-1)],
                                      [("x", F, [3, 4]), ("i", I64, [2, 6])]), ["GatherElements"]),
    "gather_elements_const_data": (model([N("GatherElements", ["t", "i"], ["y"], axis=0)], [("i", I64, [2, 3])],
                                         inits=[("t", np.arange(12, dtype=np.float32).reshape(4, 3))]),
                                   ["GatherElements"]),
    "gather_nd_const_idx": (model([N("GatherND", ["x", "idx"], ["y"])], [("x", F, [3, 4, 2])],
                                  inits=[("idx", np.array([[[0, 1], [2, -1]], [[-3, 0], [1, 1]]]))]), ["GatherND"]),
    "gather_nd_act_idx": (model([N("GatherND", ["x", "i"], ["y"])], [("x", F, [3, 3, 2]), ("i", I64, [2, 2, 1])]),
                          ["GatherND"]),
    "gather_nd_batch_dims": (model([N("GatherND", ["x", "idx"], ["y"], batch_dims=1)], [("x", F, [2, 4, 3])],
                                   inits=[("idx", np.array([[[3], [0]], [[1], [1]]]))]), ["GatherND"]),
    # the dynamo exporter's vmapped attention mask: constant tuples (b, s) broadcasting mask[b, s] to [B,1,1,S]
    "gather_nd_mask_view": (model([N("GatherND", ["m", "idx"], ["y"])], [("m", B, [2, 5])],
                                  inits=[("idx", np.stack(np.broadcast_arrays(np.arange(2)[:, None, None, None],
                                                                              np.arange(5)[None, None, None, :]),
                                                          -1))]), ["Reshape"]),
    "gather_nd_view_expand": (model([N("GatherND", ["m", "idx"], ["y"])], [("m", F, [2, 5, 3])],
                                    inits=[("idx", np.stack(np.broadcast_arrays(np.arange(2)[:, None, None],
                                                                                np.zeros((1, 4, 1), np.int64),
                                                                                np.arange(5)[None, None, :]),
                                                            -1)[..., [0, 2]])]), ["Expand"]),
    "tile": (model([N("Tile", ["x", "r"], ["y"])], [("x", F, [2, 1, 3])], inits=[("r", np.array([1, 4, 2]))]),
             ["Tile"]),
    "tile_ones_is_identity": (model([N("Tile", ["x", "r"], ["t"]), N("Relu", ["t"], ["y"])], [("x", F, [2, 3])],
                                    inits=[("r", np.array([1, 1]))]), ["Relu"]),
    "expand": (model([N("Expand", ["x", "s"], ["y"])], [("x", F, [2, 1, 4])], inits=[("s", np.array([3, 1]))]),
               ["Expand"]),
    "expand_bool_mask": (model([N("Expand", ["m", "s"], ["e"]), N("Where", ["e", "x", "z"], ["y"])],
                               [("m", B, [2, 1, 1, 4]), ("x", F, [2, 3, 4, 4])],
                               inits=[("s", np.array([2, 3, 4, 4])), ("z", np.array(0.0, np.float32))]),
                         ["Expand", "Where"]),
    "einsum_scores": (model([N("Einsum", ["q", "k"], ["y"], equation="bhqd,bhkd->bhqk")],
                            [("q", F, [2, 3, 4, 5]), ("k", F, [2, 3, 6, 5])]), ["Einsum"]),
    "einsum_context": (model([N("Einsum", ["p", "v"], ["y"], equation="bhqk,bhkd->bhqd")],
                             [("p", F, [2, 3, 4, 6]), ("v", F, [2, 3, 6, 5])]), ["Einsum"]),
    "einsum_bmm": (model([N("Einsum", ["a", "b"], ["y"], equation="bij,bjk->bik")],
                         [("a", F, [2, 3, 4]), ("b", F, [2, 4, 5])]), ["Einsum"]),
    "einsum_ellipsis": (model([N("Einsum", ["a", "b"], ["y"], equation="...ij,...jk->...ik")],
                              [("a", F, [2, 3, 4, 5]), ("b", F, [1, 3, 5, 2])]), ["Einsum"]),
    "einsum_weight": (model([N("Einsum", ["x", "w"], ["y"], equation="bsh, hd -> bsd")], [("x", F, [2, 3, 4])],
                            inits=[("w", np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32))]),
                      ["Einsum"]),
    "einsum_implicit_and_unary": (model([N("Einsum", ["a", "b"], ["t"], equation="ji,jk"),
                                         N("Einsum", ["t"], ["y"], equation="ik->k")],
                                        [("a", F, [3, 4]), ("b", F, [3, 5])]), ["Einsum"]),
    "trilu": (model([N("Trilu", ["x"], ["y0"]), N("Trilu", ["x", "k"], ["y1"], upper=0),
                     N("Trilu", ["x", "km"], ["y2"], upper=1)], [("x", F, [2, 4, 5])], outputs=["y0", "y1", "y2"],
                    inits=[("k", np.array(1)), ("km", np.array(-2))]), ["Trilu"]),
    "scatter_nd_rows": (model([N("ScatterND", ["x", "idx", "u"], ["y"])], [("x", F, [4, 3]), ("u", F, [2, 3])],
                              inits=[("idx", np.array([[3], [-4]]))]), ["ScatterND"]),
    "scatter_nd_const_updates": (model([N("ScatterND", ["x", "idx", "u"], ["y"])], [("x", F, [2, 4, 4])],
                                       inits=[("idx", np.array([[0, 1, 2], [1, 3, 0], [1, 0, 0]])),
                                              ("u", np.array([-7.0, 8.0, 9.0], np.float32))]), ["ScatterND"]),
    "scatter_elements": (model([N("ScatterElements", ["x", "idx", "u"], ["y"], axis=1)],
                               [("x", F, [3, 5]), ("u", F, [3, 2])],
                               inits=[("idx", np.array([[0, 4], [-1, 2], [1, 1]]))]), ["ScatterElements"]),
    "scatter_elements_act_idx": (model([N("ScatterElements", ["x", "i", "u"], ["y"], axis=0)],
                                       [("x", F, [3, 4]), ("i", I64, [1, 4]), ("u", F, [1, 4])]), ["ScatterElements"]),
    "cumsum": (model([N("CumSum", ["x", "a0"], ["y0"]), N("CumSum", ["x", "a1"], ["y1"], exclusive=1),
                      N("CumSum", ["x", "a1"], ["y2"], reverse=1), N("CumSum", ["x", "a0"], ["y3"], exclusive=1,
                                                                        reverse=1)],
                     [("x", F, [3, 4])], outputs=["y0", "y1", "y2", "y3"],
                     inits=[("a0", np.array(1)), ("a1", np.array(-2, np.int32))]), ["CumSum"]),
    "cumsum_int_position_ids": (model([N("Cast", ["m"], ["mi"], to=I64), N("CumSum", ["mi", "a"], ["c"]),
                                       N("Mul", ["c", "mi"], ["y"])], [("m", B, [2, 6])],
                                      inits=[("a", np.array(1))]), ["CumSum"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_operator_matches_onnxruntime(name):
    m, ops = CASES[name]
    import_and_compare(m, ops=ops)


def test_gather_nd_mask_view_follows_a_changed_batch():
    """The exporter baked the batch (2) into the index tuples; imported at batch 4 the view takes every row."""
    m, _ = CASES["gather_nd_mask_view"]
    g = load_onnx(m, batch=4)
    assert "GatherND" not in {n.op for n in g.nodes()}
    mask = np.random.default_rng(0).random((4, 5)) < 0.5
    (y,) = evaluate(g, {"m": mask})
    np.testing.assert_array_equal(y, mask.reshape(4, 1, 1, 5))


def test_einsum_stays_one_operator_with_labels_from_the_equation():
    from unity_pcg import ops
    g = load_onnx(CASES["einsum_scores"][0])
    n = next(n for n in g.nodes() if n.op == "Einsum")
    shapes = g.input_shapes(n.id)
    lab = ops.get_op("Einsum").labels(n.a, shapes, [g.shapes(n.id)[0].sizes])
    assert lab.inputs == (tuple("bhqd"), tuple("bhkd")) and lab.outputs == (tuple("bhqk"),)
    # splitting the contracted d on both operands gives partial sums
    from unity_pcg.shape import ParallelTensorShape as P
    out = ops.infer("Einsum", n.a, [P.of(shapes[0].sizes, (1, 1, 1, 5)), P.of(shapes[1].sizes, (1, 1, 1, 5))])
    assert out.outputs[0].sum_degree == 5


def test_data_parallel_mask_model_evaluates_piecewise_to_the_same_values():
    """The attention-mask idioms in a data-parallel PCG: the piecewise result equals onnxruntime."""
    from unity_pcg.search.baselines import data_parallel
    m = model([N("Einsum", ["q", "k"], ["s"], equation="bhqd,bhkd->bhqk"),
               N("Where", ["mask", "s", "neg"], ["sm"]),
               N("Softmax", ["sm"], ["p"], axis=-1),
               N("Einsum", ["p", "k"], ["ctx"], equation="bhqk,bhkd->bhqd"),
               N("Trilu", ["ctx"], ["t"], upper=0),
               N("CumSum", ["t", "ax"], ["y"])],
              [("q", F, [4, 2, 4, 3]), ("k", F, [4, 2, 4, 3])],
              inits=[("mask", TRIL), ("neg", np.array(-1e9, np.float32)), ("ax", np.array(1))])
    g = data_parallel(load_onnx(m), 2)
    g.check()
    assert any(n.op == "Partition" for n in g.nodes())
    feeds = feeds_for(m)
    ours = evaluate(g, feeds, mode="pieces", rng=np.random.default_rng(0))
    assert_same(ours, run_ort(m, feeds), "dp")


def test_data_parallel_versions_of_every_case_evaluate_piecewise_to_the_logical_values():
    """Every model above whose inputs split two ways on dim 0: the data-parallel PCG's piecewise value equals
    the logical one (the operators' labels hold on imported graphs, constants copied to every task)."""
    from unity_pcg.search.baselines import StrategyError, data_parallel
    done = []
    for name, (m, _) in sorted(CASES.items()):
        g = load_onnx(m)
        try:
            gp = data_parallel(g, 2)
        except StrategyError:           # an input whose dim 0 is odd
            continue
        feeds = feeds_for(m, 1)
        assert_same(evaluate(gp, feeds, mode="pieces", rng=np.random.default_rng(1)), evaluate(g, feeds), name)
        done.append(name)
    assert len(done) >= 12, done


# --- a torch module exported as users do -----------------------------------------------------------------

@pytest.mark.parametrize("exporter", ["legacy", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_torch_export_of_mask_idioms_matches_onnxruntime(tmp_path, exporter):
    torch = pytest.importorskip("torch")

    class Masks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8)

        def forward(self, x, attn, ids):
            q = self.q(x).view(2, 4, 2, 4).transpose(1, 2)                      # b h s d
            s = torch.einsum("bhqd,bhkd->bhqk", q, q)
            s = s.masked_fill(attn[:, None, None, :] == 0, -1e4)               # padding mask (Equal + Where)
            s = torch.triu(s, diagonal=1) + torch.tril(s)                      # Trilu on activations
            p = torch.softmax(s, -1)
            o = torch.einsum("bhqk,bhkd->bhqd", p, q).transpose(1, 2).reshape(2, 4, 8)
            pos = torch.cumsum(attn, 1) * attn                                 # position ids from the mask
            g = torch.gather(o, 1, ids[:, :, None].expand(2, 3, 8))            # GatherElements
            o = o.clone()
            o[:, 0] = g[:, 0] * 2              # ScatterND (legacy) / ScatterElements (dynamo's select_scatter)
            return o.repeat(1, 2, 1), pos, (o > 0) & (attn[:, :, None] > 0)

    torch.manual_seed(0)
    mod = Masks().eval()
    args = (torch.randn(2, 4, 8), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), torch.tensor([[0, 3, 1], [2, 2, 0]]))
    path = tmp_path / "masks.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(mod, args, str(path), dynamo=False, opset_version=17,
                              input_names=["x", "attn", "ids"], do_constant_folding=True)
        else:
            torch.onnx.export(mod, args, str(path), dynamo=True, input_names=["x", "attn", "ids"])
    m = onnx.load(str(path))
    g = load_onnx(m)
    g.check()
    used = {n.op for n in g.nodes()}
    assert {"Einsum", "Where", "Equal", "Trilu", "CumSum", "GatherElements", "Tile", "Greater",
            "And"} <= used, sorted(used)
    assert used & {"ScatterND", "ScatterElements"}, sorted(used)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 4, 8)).astype(np.float32),
             "attn": rng.integers(0, 2, (2, 4)).astype(np.int64), "ids": rng.integers(0, 4, (2, 3)).astype(np.int64)}
    assert_same(evaluate(g, feeds), run_ort(m, feeds), "torch export")
    with torch.no_grad():
        want = [t.numpy() for t in mod(*(torch.as_tensor(feeds[k]) for k in ("x", "attn", "ids")))]
    assert_same(evaluate(g, feeds), want, "torch itself")


# --- bad input: typed one-line errors -------------------------------------------------------------------

X = [("x", F, [2, 3])]
BAD = [
    # (id, model, error class, words the message must contain)
    ("einsum_repeated_output", model([N("Einsum", ["x", "x"], ["y"], equation="ij,jk->ii")], X), InvalidModel,
     "equation"),
    ("einsum_rank_mismatch", model([N("Einsum", ["x"], ["y"], equation="ijk->k")], X), InvalidModel, "equation"),
    ("einsum_bad_chars", model([N("Einsum", ["x"], ["y"], equation="i1->i")], X), InvalidModel, "equation"),
    ("einsum_two_arrows", model([N("Einsum", ["x"], ["y"], equation="ij->i->j")], X), InvalidModel, "equation"),
    ("einsum_operand_count", model([N("Einsum", ["x"], ["y"], equation="ij,jk->ik")], X), InvalidModel,
     "equation"),
    ("einsum_unknown_output", model([N("Einsum", ["x"], ["y"], equation="ij->z")], X), InvalidModel, "'z'"),
    ("einsum_sums_ellipsis", model([N("Einsum", ["x"], ["y"], equation="...j->j")], [("x", F, [2, 3, 4])]),
     UnsupportedOperator, "equation"),
    ("einsum_size_mismatch", model([N("Einsum", ["x", "x"], ["y"], equation="ij,jk->ik")], X), InvalidModel,
     "size"),
    ("einsum_missing_equation", model([N("Einsum", ["x"], ["y"])], X), InvalidModel, "equation"),
    ("scatter_reduction", model([N("ScatterND", ["x", "i", "u"], ["y"], reduction="add")],
                                [("x", F, [4, 3]), ("u", F, [1, 3])], inits=[("i", np.array([[1]]))]),
     UnsupportedOperator, "reduction"),
    ("scatter_elements_reduction", model([N("ScatterElements", ["x", "i", "u"], ["y"], reduction="max")],
                                         [("x", F, [4, 3]), ("u", F, [1, 3])], inits=[("i", np.zeros((1, 3), np.int64))],
                                         opset=18), UnsupportedOperator, "reduction"),
    ("scatter_elements_shapes", model([N("ScatterElements", ["x", "i", "u"], ["y"])],
                                      [("x", F, [4, 3]), ("u", F, [2, 3])], inits=[("i", np.zeros((1, 3), np.int64))]),
     InvalidModel, "one shape"),
    ("scatter_elements_index", model([N("ScatterElements", ["x", "i", "u"], ["y"], axis=-1)],
                                     [("x", F, [4, 3]), ("u", F, [1, 3])], inits=[("i", np.full((1, 3), 3))]),
     InvalidModel, "out of range"),
    ("gather_nd_batch_dims", model([N("GatherND", ["x", "i"], ["y"], batch_dims=2)], X,
                                   inits=[("i", np.zeros((2, 1), np.int64))]), InvalidModel, "'batch_dims'"),
    ("gather_nd_negative_batch_dims", model([N("GatherND", ["x", "i"], ["y"], batch_dims=-1)], X,
                                            inits=[("i", np.zeros((2, 1), np.int64))]), InvalidModel, "'batch_dims'"),
    # all constant: folded, where onnx 1.23's shape inference segfaulted on a negative batch_dims
    ("gather_nd_const_negative_batch_dims", model([N("GatherND", ["i", "i"], ["y"], batch_dims=-2)], X,
                                                  inits=[("i", np.zeros((2, 2, 1), np.int64))], infer=False),
     InvalidModel,
     "'batch_dims'"),
    ("gather_nd_tuple_too_long", model([N("GatherND", ["x", "i"], ["y"])], X, inits=[("i", np.zeros((1, 3), np.int64))]),
     InvalidModel, "index tuples"),
    ("gather_nd_index", model([N("GatherND", ["x", "i"], ["y"])], X, inits=[("i", np.array([[1, 3]]))]), InvalidModel,
     "out of range"),
    ("gather_nd_batch_mismatch", model([N("GatherND", ["x", "i"], ["y"], batch_dims=1)], [("x", F, [2, 3]),
                                                                                        ("i", I64, [3, 1])]),
     UnityError, "batch dims"),
    ("scatter_index_range", model([N("ScatterND", ["x", "i", "u"], ["y"])], [("x", F, [4, 3]), ("u", F, [1, 3])],
                                  inits=[("i", np.array([[4]]))]), InvalidModel, "out of range"),
    ("scatter_updates_shape", model([N("ScatterND", ["x", "i", "u"], ["y"])], [("x", F, [4, 3]), ("u", F, [2, 3])],
                                    inits=[("i", np.array([[1]]))]), UnityError, "updates"),
    ("scatter_tuple_too_long", model([N("ScatterND", ["x", "i", "u"], ["y"])], [("x", F, [4, 3]), ("u", F, [1])],
                                     inits=[("i", np.array([[1, 1, 1]]))]), InvalidModel, "indices"),
    ("trilu_computed_k", model([N("ReduceSum", ["x"], ["s"], keepdims=0), N("Cast", ["s"], ["k"], to=I64),
                                N("Trilu", ["x", "k"], ["y"])], X), UnsupportedOperator, "'k'"),
    ("trilu_rank1", model([N("Trilu", ["x"], ["y"])], [("x", F, [3])]), InvalidModel, "rank"),
    ("trilu_upper_2", model([N("Trilu", ["x"], ["y"], upper=2)], X), InvalidModel, "'upper'"),
    ("trilu_k_vector", model([N("Trilu", ["x", "k"], ["y"])], X, inits=[("k", np.array([1, 2]))]), InvalidModel,
     "'k'"),
    ("cumsum_exclusive_3", model([N("CumSum", ["x", "a"], ["y"], exclusive=3)], X, inits=[("a", np.array(0))]),
     InvalidModel, "'exclusive'"),
    ("cumsum_axis_range", model([N("CumSum", ["x", "a"], ["y"])], X, inits=[("a", np.array(2))]), InvalidModel,
     "axis"),
    ("cumsum_bool", model([N("CumSum", ["x", "a"], ["y"])], [("x", B, [2, 3])], inits=[("a", np.array(0))]),
     UnityError, "bool"),
    ("tile_repeats_length", model([N("Tile", ["x", "r"], ["y"])], X, inits=[("r", np.array([2]))]), InvalidModel,
     "'repeats'"),
    ("tile_repeats_negative", model([N("Tile", ["x", "r"], ["y"])], X, inits=[("r", np.array([2, -1]))]),
     InvalidModel, "'repeats'"),
    ("tile_repeats_zero", model([N("Tile", ["x", "r"], ["y"])], X, inits=[("r", np.array([0, 1]))]),
     UnsupportedOperator, "empty"),
    ("gather_elements_rank", model([N("GatherElements", ["x", "i"], ["y"])], X, inits=[("i", np.array([0, 1]))]),
     InvalidModel, "same rank"),
    ("gather_elements_axis", model([N("GatherElements", ["x", "i"], ["y"], axis=2)], X,
                                   inits=[("i", np.array([[0, 1]]))]), InvalidModel, "axis 2"),
    ("gather_elements_index", model([N("GatherElements", ["x", "i"], ["y"], axis=1)], X,
                                    inits=[("i", np.array([[0, 3]]))]), InvalidModel, "out of range"),
    ("gather_elements_too_wide", model([N("GatherElements", ["x", "i"], ["y"], axis=1)], X,
                                       inits=[("i", np.zeros((3, 1), np.int64))]), UnityError, "exceed"),
    ("gather_elements_float_idx", model([N("GatherElements", ["x", "x"], ["y"])], X), InvalidModel, "integers"),
    ("gather_elements_empty_axis", model([N("GatherElements", ["t", "i"], ["y"])], [("i", I64, [1, 3])],
                                         inits=[("t", np.zeros((0, 3), np.float32))]), UnityError, "empty"),
    ("where_float_cond", model([N("Where", ["x", "x", "x"], ["y"])], X), InvalidModel, "bool"),
    ("where_no_broadcast", model([N("Where", ["c", "x", "z"], ["y"])], [("c", B, [2, 3]), ("x", F, [2, 3])],
                                 inits=[("z", np.zeros((4,), np.float32))]), InvalidModel, "broadcast"),
    ("where_dtype_mix", model([N("Where", ["c", "x", "z"], ["y"])], [("c", B, [2, 3]), ("x", F, [2, 3])],
                              inits=[("z", np.zeros((3,), np.int64))]), InvalidModel, "element type"),
    ("less_of_bool", model([N("Less", ["c", "c"], ["y"])], [("c", B, [2, 3])]), InvalidModel, "bool"),
    ("and_of_float", model([N("And", ["x", "x"], ["y"])], X), InvalidModel, "bool"),
    ("equal_dtype_mix", model([N("Equal", ["x", "z"], ["y"])], X, inits=[("z", np.zeros((3,), np.int64))]),
     InvalidModel, "element type"),
    ("zero_size_einsum", model([N("Einsum", ["x", "w"], ["y"], equation="bh,hd->bd")], X,
                               inits=[("w", np.zeros((3, 0), np.float32))]), UnsupportedOperator, "empty output"),
    ("zero_size_gather_elements", model([N("GatherElements", ["x", "i"], ["y"], axis=1)], X,
                                        inits=[("i", np.zeros((2, 0), np.int64))]), UnsupportedOperator, "empty output"),
    ("zero_size_gather_nd", model([N("GatherND", ["x", "i"], ["y"])], X, inits=[("i", np.zeros((0, 1), np.int64))]),
     UnsupportedOperator, "empty output"),
    ("zero_size_where", model([N("Where", ["c", "x", "z"], ["y"])], X,
                              inits=[("c", np.zeros((0, 3), bool)), ("z", np.zeros((1,), np.float32))]),
     InvalidModel, "broadcast"),
    ("zero_size_scatter", model([N("ScatterND", ["t", "i", "u"], ["y"])], [("i", I64, [1, 1]), ("u", F, [1, 3])],
                                inits=[("t", np.zeros((0, 3), np.float32))]), UnityError, "empty"),
]


def _one_line(e) -> str:
    s = str(e)
    assert s and "\n" not in s and "Traceback" not in s
    return s


@pytest.mark.parametrize("name,m,cls,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_typed_one_line_error(name, m, cls, words):
    with pytest.raises(UnityError) as e:
        load_onnx(m)
    assert isinstance(e.value, cls), (type(e.value).__name__, str(e.value))
    msg = _one_line(e.value)
    assert words in msg, msg
    assert m.graph.node[-1].op_type in msg or m.graph.node[0].op_type in msg, msg


def test_cli_exits_2_with_one_line_on_an_unsupported_attribute(tmp_path):
    bad = dict((b[0], b[1]) for b in BAD)["scatter_reduction"]
    path = tmp_path / "bad.onnx"
    onnx.save(bad, str(path))
    r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "reduction" in err, err


def test_seeded_mutations_of_these_models_fail_typed_or_import():
    """Random mutations (attributes, shapes, initializers, rewiring, ...) of every model above: each imports
    to a PCG that passes check() or raises a one-line UnityError, never another exception."""
    from .test_import_fuzz import check_case, mutate
    rng = np.random.default_rng(20261123)
    seeds = [m for m, _ in CASES.values()] + [b[1] for b in BAD]
    outcomes = {}
    for k in range(240):
        data, desc = mutate(seeds[k % len(seeds)], rng)
        out = check_case(data, desc)
        outcomes[out] = outcomes.get(out, 0) + 1
    assert set(outcomes) <= {"ok", "error"} and outcomes.get("ok", 0) > 20 and outcomes.get("error", 0) > 20, outcomes


@pytest.mark.parametrize("data_is_table", [True, False])
def test_gather_with_a_large_constant_index_tensor(data_is_table):
    """A lookup by a constant index tensor larger than the importer's small-constant limit (T5's
    relative-position buckets at sequence 512 are [512, 512]) imports, negative indices included, and
    evaluates to onnxruntime's values (on a table weight: an Embedding; on an activation: a Gather)."""
    rng = np.random.default_rng(3)
    idx = rng.integers(-6, 6, (300, 300)).astype(np.int64)
    tbl = rng.standard_normal((6, 4)).astype(np.float32)
    if data_is_table:
        m = model([N("Gather", ["t", "i"], ["y"], axis=0)], [("x", F, [1])], inits=[("t", tbl), ("i", idx)])
        m.graph.output.append(helper.make_tensor_value_info("x", F, [1]))
        feeds = {"x": np.zeros(1, np.float32)}
    else:
        m = model([N("Gather", ["x", "i"], ["y"], axis=0)], [("x", F, [6, 4])], inits=[("i", idx)])
        feeds = {"x": tbl}
    g = load_onnx(m)
    if data_is_table:
        assert "Embedding" in {n.op for n in g.nodes()}
    got = evaluate(g, feeds)[0]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
    np.testing.assert_array_equal(got, want)
