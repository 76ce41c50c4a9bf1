"""Every refusal is justified: evaluated anyway (``strict=False``), a refused parallelization's piecewise
result differs from the logical result, or the piecewise kernel cannot even run on its pieces."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from unity_pcg import ops
from unity_pcg import pieces as P
from unity_pcg.errors import InvalidParallelization, UnityError
from unity_pcg.shape import ParallelTensorShape

from .op_cases import GENERATORS, Case, HypDrawer, RandDrawer, accepts, draw_parallel

from .test_ops_pieces import check_piecewise

OPS = sorted(GENERATORS)


def loose_outcome(case: Case, shapes, seed: int) -> str:
    """'cannot-infer', 'cannot-run', 'differs' or 'equal' for one evaluation with validity checks off."""
    try:
        ops.infer(case.op, case.attrs, shapes, strict=False)
    except InvalidParallelization:
        return "cannot-infer"
    rng = np.random.default_rng(seed)
    xs = case.values(rng)
    want = ops.run_logical(case.op, case.attrs, xs)
    pieces = [P.split(x, s, rng) for x, s in zip(xs, shapes)]
    try:
        with np.errstate(all="ignore"):
            outs, out_shapes = ops.run_pieces(case.op, case.attrs, pieces, shapes, strict=False)
            got = [P.join(p, s) for p, s in zip(outs, out_shapes)]
    except (ValueError, IndexError, UnityError):   # the pieces do not fit the kernel or the output
        return "cannot-run"
    for p, g, w in zip(outs, got, want):
        if g.shape != w.shape or not P.copies_agree(p, rtol=1e-7, atol=1e-9):
            return "differs"
        if not np.allclose(g, w, rtol=1e-7, atol=1e-9, equal_nan=True):
            return "differs"
    return "equal"


def justified(case: Case, shapes, tries: int = 20) -> str:
    """A refusal is justified when some input makes the loose evaluation wrong (random values: a
    tiny tensor may agree by chance, e.g. relu(a) + relu(b) = relu(a + b) when a, b share a sign)."""
    for seed in range(tries):
        out = loose_outcome(case, shapes, seed)
        if out != "equal":
            return out
    return "equal"


# single-input operators that are linear and act independently along every dim: every layout of
# their input is valid, so they must refuse nothing
REFUSE_NOTHING = ("Dropout", "Expand", "Identity", "Neg", "ReduceSum", "Scale", "Transpose", "RandomNormal",
                  "RandomUniform")


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_refusals_are_justified(op, data):
    d = HypDrawer(data)
    case = GENERATORS[op](d)
    par = draw_parallel(d, case, violate=True)
    if op in REFUSE_NOTHING:
        assert accepts(case, par.shapes), (op, case.attrs, [str(s) for s in par.shapes])
        check_piecewise(case, par.shapes, data.draw(st.integers(0, 2 ** 32 - 1)))
        return
    assume(not accepts(case, par.shapes))
    out = justified(case, par.shapes)
    event(out)
    assert out != "equal", (f"{op} {case.attrs} refuses {[str(s) for s in par.shapes]} "
                            f"but its piecewise result is right: an over-conservative rule")


@pytest.mark.parametrize("op", OPS)
def test_refusals_are_drawn(op):
    """The violating drawer really produces refusals for every operator that has unshardable dims
    or non-linear inputs, and some of them evaluate (loosely) to a wrong value rather than failing."""
    refused, differs = 0, 0
    for seed in range(150):
        d = RandDrawer(seed)
        case = GENERATORS[op](d)
        par = draw_parallel(d, case, violate=True)
        if accepts(case, par.shapes):
            continue
        refused += 1
        if seed < 60:
            out = justified(case, par.shapes, tries=5)
            assert out != "equal", (op, case.attrs, [str(s) for s in par.shapes])
            differs += out == "differs"
    if op in REFUSE_NOTHING:
        assert refused == 0
    else:
        assert refused >= 10, f"{op}: only {refused} refusals drawn"


def S(sizes, degrees=None, s=1, c=1, dtype="float64"):
    return ParallelTensorShape.of(sizes, degrees, s, c, dtype)


N = "normal"
# (op, attrs, parallel input shapes, fill, expected loose outcome, words of the refusal message)
REFUSED = [
    ("Relu", {}, [S([4, 6], s=2)], [N], "differs", "partial sums"),
    ("Gelu", {}, [S([4, 6], [2, 1], s=2)], [N], "differs", "partial sums"),
    ("Sigmoid", {}, [S([8], s=2)], [N], "differs", "partial sums"),
    ("Tanh", {}, [S([8], s=3)], [N], "differs", "partial sums"),
    ("Exp", {}, [S([8], s=2)], [N], "differs", "partial sums"),
    ("Clip", {"min": 0.0, "max": 1.0}, [S([8], s=2)], [N], "differs", "partial sums"),
    ("Cast", {"to": "int64"}, [S([8], s=2)], [N], "differs", "partial sums"),
    ("Max", {}, [S([4, 6], s=2), S([6], c=2)], [N, N], "differs", "partial sums"),
    ("Pow", {}, [S([8], s=2), S([8], c=2)], ["positive", N], "differs", "partial sums"),
    ("Div", {}, [S([8], c=2), S([8], s=2)], [N, "nonzero"], "differs", "partial sums"),
    ("Softmax", {"axis": -1}, [S([4, 6], [1, 2])], [N], "differs", "softmax normalizes"),
    ("Softmax", {"axis": 0}, [S([4, 6], [2, 1])], [N], "differs", "softmax normalizes"),
    ("Softmax", {"axis": -1}, [S([4, 6], s=2)], [N], "differs", "partial sums"),
    ("LayerNorm", {"axis": -1}, [S([4, 6], [1, 2])], [N], "differs", "layer norm"),
    ("LayerNorm", {"axis": 1}, [S([2, 4, 6], [1, 2, 1]), S([4, 6], [2, 1]), S([4, 6], [2, 1])], [N] * 3,
     "differs", "layer norm"),
    ("LayerNorm", {"axis": -1}, [S([4, 6], s=2)], [N], "differs", "partial sums"),
    ("BatchNorm", {}, [S([4, 2], s=2)] + [S([2], c=2)] * 4, [N, N, N, N, "positive"], "differs", "partial sums"),
    ("Conv2d", {"padding": (1, 1, 1, 1)}, [S([1, 2, 6, 6], [1, 1, 2, 1]), S([3, 2, 3, 3], c=2)], [N, N],
     "cannot-run", "window"),
    ("Conv2d", {}, [S([1, 2, 6, 6], [1, 1, 2, 1]), S([3, 2, 3, 3], c=2)], [N, N], "cannot-run", "window"),
    ("Conv2d", {"stride": (2, 2)}, [S([1, 2, 12, 4], [1, 1, 2, 1]), S([3, 2, 3, 3], c=2)], [N, N],
     "cannot-run", "window"),
    ("Conv2d", {"stride": (2, 1)}, [S([1, 2, 6, 4], [1, 1, 2, 1]), S([3, 2, 1, 1], c=2)], [N, N],
     "cannot-run", "stride"),
    ("Conv2d", {}, [S([2, 4, 3, 3], [1, 2, 1, 1]), S([5, 4, 1, 1], [1, 2, 1, 1]), S([5], c=2)], [N] * 3,
     "differs", "bias"),
    ("Conv2d", {}, [S([2, 4, 3, 3], s=2), S([5, 4, 1, 1], c=2), S([5], c=2)], [N] * 3, "differs", "partial sums"),
    ("Pool2d", {"kind": "max", "kernel": (3, 3), "stride": (1, 1), "padding": (1, 1, 1, 1)},
     [S([1, 2, 6, 6], [1, 1, 2, 1])], [N], "cannot-run", "window"),
    ("Pool2d", {"kind": "avg", "kernel": (2, 2), "stride": (2, 2)}, [S([1, 2, 6, 6], [1, 1, 2, 1])], [N],
     "cannot-run", "stride"),
    ("Pool2d", {"kind": "max", "kernel": (1, 1), "stride": (3, 1)}, [S([1, 2, 4, 4], [1, 1, 2, 1])], [N],
     "cannot-run", "not a multiple of the stride 3"),
    ("Conv2d", {"stride": (1, 3)}, [S([1, 2, 4, 4], [1, 1, 1, 2]), S([3, 2, 1, 1], c=2)], [N, N],
     "cannot-run", "not a multiple of the stride 3"),
    ("Pool2d", {"kind": "avg", "global_pool": True}, [S([1, 2, 6, 6], [1, 1, 2, 1])], [N], "differs",
     "global"),
    ("Pool2d", {"kind": "max", "kernel": (2, 2), "stride": (2, 2)}, [S([1, 2, 4, 4], s=2)], [N], "differs",
     "partial sums"),
    ("LRN", {"size": 3}, [S([1, 4, 2, 2], [1, 2, 1, 1])], [N], "differs", "neighbouring channels"),
    ("MatMul", {}, [S([4, 6], [1, 2]), S([6, 3])], [N, N], "cannot-infer", "must match"),
    ("MatMul", {}, [S([4, 6], [2, 1]), S([6, 3])], [N, N], "cannot-infer", "copy degree"),
    ("BatchMatMul", {}, [S([2, 4, 6], [2, 1, 1]), S([2, 6, 3], [1, 1, 1], c=2)], [N, N], "cannot-infer",
     "must match"),
    ("ReduceMean", {"axes": (1,)}, [S([4, 6], [1, 2])], [N], "differs", "mean"),
    ("ReduceMean", {"axes": (), "keepdims": False}, [S([4, 6], [2, 1])], [N], "differs", "mean"),
    ("Linear", {}, [S([4, 6], s=2), S([6, 8], c=2), S([8], c=2)], [N] * 3, "differs", "partial sums"),
    ("Linear", {}, [S([4, 6], [1, 2]), S([6, 8], [2, 1]), S([8], c=2)], [N] * 3, "differs", "bias"),
    ("Linear", {"activation": "relu"}, [S([4, 6], [1, 2]), S([6, 8], [2, 1])], [N] * 2, "differs", "relu"),
    ("Linear", {"activation": "tanh"}, [S([4, 6], s=2), S([6, 8], c=2)], [N] * 2, "differs", "partial"),
    ("Concat", {"axis": 0}, [S([4, 3], [2, 1]), S([2, 3], [2, 1])], [N, N], "cannot-infer", "concatenation"),
    ("Concat", {"axis": 1}, [S([4, 3], s=2), S([4, 2])], [N, N], "cannot-infer", "partial-sum degrees"),
    ("Split", {"axis": 0, "sizes": (2, 2)}, [S([4, 3], [2, 1])], [N], "cannot-run", "split"),
    ("Slice", {"axes": (0,), "starts": (1,), "ends": (4,), "steps": (1,)}, [S([4, 3], [2, 1])], [N],
     "cannot-run", "sliced"),
    ("Embedding", {}, [S([4], c=2, dtype="int64"), S([8, 3], [2, 1])], [("index", 8), N], "cannot-run",
     "vocabulary"),
    ("Embedding", {}, [S([4], s=2, dtype="int64"), S([8, 3], c=2)], [("index", 8), N], "differs",
     "partial sums"),
    ("Gather", {"axis": 1}, [S([2, 6], [1, 2]), S([3], c=2, dtype="int64")], [N, ("index", 6)], "cannot-run",
     "gathered"),
    ("Reshape", {"shape": (24,)}, [S([4, 6], [1, 2])], [N], "cannot-run", "outermost"),
    ("Reshape", {"shape": (6, 4)}, [S([4, 6], [4, 1])], [N], "cannot-infer", "divide"),
    ("Flatten", {"axis": 1}, [S([2, 3, 4], [1, 1, 2])], [N], "cannot-run", "outermost"),
]


@pytest.mark.parametrize("op,attrs,shapes,fill,expect,words", REFUSED,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_named_refusals(op, attrs, shapes, fill, expect, words):
    case = Case(op, attrs, [list(s.sizes) for s in shapes], [s.dtype for s in shapes], fill)
    with pytest.raises(InvalidParallelization) as e:
        ops.infer(op, attrs, shapes)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(op) and words in msg, msg
    assert justified(case, shapes) == expect


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
@settings(max_examples=400)
def test_refusals_are_justified_thorough(op, data):
    test_refusals_are_justified.hypothesis.inner_test(op, data)


def test_a_contraction_split_in_a_non_linear_operator_is_refused_by_the_label_rule():
    """The generic guard in label_inference: sharding a label that reaches no output gives partial
    sums, valid only for an operator that is linear (here a made-up op whose labels forget to say so)."""
    from unity_pcg.ops.base import Labels, label_inference
    lab = Labels((("m", "k"), ("k", "n")), (("m", "n"),), linearity=())
    ins = [S([4, 6], [1, 2]), S([6, 8], [2, 1])]
    with pytest.raises(InvalidParallelization, match="not linear"):
        label_inference("Bilinear", lab, ins, [(4, 8)], ["float64"])
    outs, _ = label_inference("Bilinear", lab, ins, [(4, 8)], ["float64"], strict=False)
    assert outs[0].sum_degree == 2
    lab = Labels((("m", "k"), ("k", "n")), (("m", "n"),), linearity=(True, True))
    assert label_inference("MatMul", lab, ins, [(4, 8)], ["float64"])[0][0].sum_degree == 2


# --- robustness: mutated attributes and shapes give a typed error or a consistent result ---------------------

def _mutate(d, v):
    pick = d.int(0, 7)
    if pick == 0:
        return d.choice([-3, -1, 0, 1, 2, 5, 100])
    if pick == 1:
        return tuple(d.choice([-2, 0, 1, 2, 3]) for _ in range(d.int(0, 5)))
    if pick == 2:
        return d.choice(["", "max", "none", "float32", "x"])
    if pick == 3:
        return d.choice([True, False, None, 0.5, float("inf")])
    if pick == 4 and isinstance(v, tuple) and v:
        t = list(v)
        t[d.int(0, len(t) - 1)] = d.choice([-5, -1, 0, 3, 7])
        return tuple(t)
    if pick == 5 and isinstance(v, tuple):
        return v[:-1] if v and d.bool() else v + (d.choice([0, 1, 2]),)
    if pick == 6 and isinstance(v, int) and not isinstance(v, bool):
        return v + d.choice([-2, -1, 1, 2])
    return v


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_mutated_operators_fail_typed_or_agree_with_their_kernels(op, data):
    d = HypDrawer(data)
    case = GENERATORS[op](d)
    attrs = dict(ops.get_op(op).normalize_attrs(case.attrs))
    for k in d.subset(sorted(attrs)):
        attrs[k] = _mutate(d, attrs[k])
    sizes = [list(s) for s in case.sizes]
    if d.bool(0.3) and sizes:
        i = d.int(0, len(sizes) - 1)
        if sizes[i] and d.bool():
            sizes[i][d.int(0, len(sizes[i]) - 1)] = d.choice([0, 1, 2, 5])
        elif d.bool():
            sizes[i] = sizes[i][1:]
        else:
            sizes[i] = sizes[i] + [d.choice([1, 2])]
    mutated = Case(op, attrs, sizes, case.dtypes, case.fill)
    try:
        inf = ops.infer(op, attrs, mutated.shapes())
    except UnityError as e:
        assert "\n" not in str(e)
        event("refused")
        return
    event("accepted")
    if op in ("Gather", "Embedding"):   # indices must address the (mutated) table: a data error otherwise
        n = sizes[0][attrs["axis"] % len(sizes[0])] if op == "Gather" else sizes[1][0]
        if n == 0:
            return
        mutated.fill = [("index", n) if isinstance(f, tuple) else f for f in mutated.fill]
    xs = mutated.values(np.random.default_rng(0))
    with np.errstate(all="ignore"):
        ys = ops.run_logical(op, attrs, xs)
    assert [tuple(np.shape(y)) for y in ys] == [s.sizes for s in inf.outputs], (attrs, sizes)
