"""Data parallelism by proven rules for the operators added for ONNX import coverage (issue 7 point 1, issue 10).

Every batch-parallel operator has a shipped, Z3-proven ``dp_<Op>`` template (variants where a broadcast operand is
replicated); each applies to a one-op graph of its operator and evaluates piecewise equal; where its axiom claims
nothing (dim 0 reduced, scanned, tiled, padded, gathered along, an operand that does not broadcast) application
refuses; and the joint search reaches data parallelism by rules on small models made of these operators.
"""
import numpy as np
import pytest

from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization
from unity_pcg.pcg import PCG
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.optimize import optimize
from unity_pcg.search.substitution import RuleBook, data_parallel_steps, normalized_hash, replay, trimmed
from unity_pcg.shape import ParallelTensorShape as S
from unity_pcg.substitutions import cache
from unity_pcg.substitutions.apply import apply_match
from unity_pcg.substitutions.match import find_matches
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.verifier.axioms import Axiom
from unity_pcg.verifier.selfcheck import check_axiom

from .test_soundness import check_instance

# the operators of the import-coverage change that are batch-parallel, each with its dp rules (written out:
# a rule dropped from the templates must fail here)
UNARY_NEW = ["Silu", "GeluTanh", "LeakyRelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "HardSigmoid",
             "HardSwish", "Abs", "Log", "Not"]
BINARY_NEW = ["PRelu", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"]
OTHER_NEW = ["Where", "LogSoftmax", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "Conv3d",
             "Conv3d_bias", "Pool1d", "Pool3d", "ConvTranspose", "ConvTranspose_bias", "InstanceNorm", "GroupNorm",
             "Resize", "Pad", "Tile", "Trilu", "CumSum", "Slice", "GatherElements", "GatherND", "GatherND_batch",
             "ScatterElements", "RMSNorm", "RMSNorm_scale",
             # Combine-form axioms (the sample dim's place in the output depends on an attribute)
             "Einsum", "Einsum_pr", "Einsum_rp", "Einsum_pp", "Expand"]
VARIANTS = ([f"{b}_pr" for b in BINARY_NEW] + [f"{b}_rp" for b in BINARY_NEW if b != "PRelu"]
            + [f"Where_{m}" for m in ("ppr", "prp", "prr", "rpp", "rpr", "rrp")]
            # the core binary operators with a broadcast operand (GroupNorm as exported: InstanceNorm, then Mul and
            # Add by (C, 1, ...) weights)
            + [f"{b}_{v}" for b in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min") for v in ("pr", "rp")])
DP_NEW = [f"dp_{o}" for o in UNARY_NEW + BINARY_NEW + OTHER_NEW + VARIANTS]
# compute operators with no dp rule, and why (DESIGN.md lists them too)
NO_DP = {"ScatterND": "the index tuples address dim 0 of the data (an update may land in any piece)",
         "Transpose": "only permutations that keep dim 0 first have a rule (dp_Transpose_<perm>)"}


@pytest.fixture(scope="module")
def shipped():
    return cache.load()


@pytest.fixture(scope="module")
def book(shipped):
    return RuleBook(shipped, (2,))


def test_new_dp_rules_are_shipped_proven_with_examples(shipped):
    by = shipped.by_name()
    missing = [n for n in DP_NEW if n not in by]
    assert not missing, missing
    for n in DP_NEW:
        r = by[n]
        assert r.origin == "template" and r.example, n
        proof = dict(r.proof)
        assert proof.get("status") == "proven" and proof.get("axioms"), n
        opname = r.source.nodes[0].op         # the proof uses an axiom of the operator itself
        assert any(a.split("_")[0] == opname for a in proof["axioms"]), (n, proof["axioms"])
        assert proof["seconds"] < 10, n
    assert not shipped.stale


def test_every_import_coverage_operator_has_a_dp_rule_or_a_reason(shipped):
    names = set(shipped.by_name())
    listed = {o.split("_")[0] for o in UNARY_NEW + BINARY_NEW + OTHER_NEW} | set(NO_DP)
    assert listed <= set(ops.REGISTRY), listed - set(ops.REGISTRY)
    without = {n for n in listed if f"dp_{n}" not in names and not any(r.startswith(f"dp_{n}_") for r in names)}
    assert without == {"ScatterND"}, without    # Transpose: dp_Transpose_<perm>


def test_every_compute_operator_has_a_dp_rule_but_scatternd(shipped):
    """Issue 7 / H6 point 3: the op registry's compute operators all have a ``dp_<Op>`` rule (or variants)
    except ScatterND, whose index tuples always address dim 0 of the data."""
    covered = {n.op for r in shipped.rules if r.name.startswith("dp_") for n in r.source.nodes}
    # operators without inputs (the random generators) have nothing to split: a plan partitions their output
    compute = {n for n, s in ops.REGISTRY.items() if s.kind == "compute" and s.num_inputs != 0}
    assert compute - covered == {"ScatterND"}, compute - covered
    assert {n for n, s in ops.REGISTRY.items() if s.kind == "compute" and s.num_inputs == 0} == \
        {"RandomNormal", "RandomUniform"}


@pytest.mark.parametrize("name", DP_NEW)
def test_new_dp_rule_applies_to_its_one_op_graph_and_evaluates_equal(shipped, name):
    r = shipped.get(name)
    assert check_instance(r, seed=7, degree=None)


def _graph(opname, attrs, inputs, outputs=1):
    """A one-op graph: ``inputs`` is a list of (shape, dtype)."""
    b = PCG.builder()
    refs = [b.add("Input", {"name": f"i{j}", "shape": s, "dtype": dt}) for j, (s, dt) in enumerate(inputs)]
    b.set_outputs([b.add(opname, attrs, refs)])
    return b.finish()


F = "float32"
POOL = {"kind": "max", "kernel": (2,), "stride": (2,), "padding": (0, 0), "dilation": (1,), "global_pool": False,
        "count_include_pad": False, "ceil_mode": False}
# (rule, operator, attrs, inputs): instances where dim 0 is not a sample dim for the rule's layout
REFUSED = [
    ("dp_ReduceMax", "ReduceMax", {"axes": (0,), "keepdims": True}, [((4, 3), F)]),
    ("dp_ReduceL2", "ReduceL2", {"axes": (), "keepdims": False}, [((4, 3), F)]),
    ("dp_LogSoftmax", "LogSoftmax", {"axis": 0}, [((4, 3), F)]),
    ("dp_CumSum", "CumSum", {"axis": -2, "exclusive": False, "reverse": False}, [((4, 3), F)]),
    ("dp_Tile", "Tile", {"repeats": (2, 1)}, [((4, 3), F)]),
    ("dp_Pad", "Pad", {"pads": (1, 0, 0, 0), "mode": "constant", "value": 0.0}, [((4, 3), F)]),
    ("dp_Resize", "Resize", {"sizes": (8, 3), "scales": (2.0, 1.0), "mode": "nearest",
                             "coordinate_mode": "asymmetric", "nearest_mode": "floor"}, [((4, 3), F)]),
    ("dp_Slice", "Slice", {"axes": (0,), "starts": (0,), "ends": (2,), "steps": (1,)}, [((4, 3), F)]),
    ("dp_Trilu", "Trilu", {"upper": True, "k": 0}, [((4, 4), F)]),
    ("dp_GatherElements", "GatherElements", {"axis": 0}, [((4, 3), F), ((4, 3), "int64")]),
    ("dp_ScatterElements", "ScatterElements", {"axis": 0, "reduction": "none"},
     [((4, 3), F), ((4, 3), "int64"), ((4, 3), F)]),
    ("dp_GatherND", "GatherND", {"batch_dims": 1}, [((4, 3, 2), F), ((4, 2, 1), "int64")]),
    ("dp_GatherND_batch", "GatherND", {"batch_dims": 0}, [((4, 3), F), ((4, 1), "int64")]),
    ("dp_PRelu_pr", "PRelu", {}, [((4, 3), F), ((4, 3), F)]),
    ("dp_Less_rp", "Less", {}, [((4, 3), F), ((4, 3), F)]),
    ("dp_Where_ppr", "Where", {}, [((4, 3), "bool"), ((4, 3), F), ((4, 3), F)]),
    ("dp_Mul_pr", "Mul", {}, [((4, 3), F), ((4, 3), F)]),
    ("dp_Add_rp", "Add", {}, [((4, 3), F), ((4, 3), F)]),
    ("dp_Pool1d", "Pool1d", dict(POOL, global_pool=True), [((4, 2, 6), F)]),   # dim 0 stays: a control
    # Einsum: the partitioned subscript summed over, moved off dim 0, shared with a replicated operand, a diagonal,
    # two partitioned operands' subscripts on two output dims
    ("dp_Einsum", "Einsum", {"equation": "ij->j"}, [((4, 3), F)]),
    ("dp_Einsum", "Einsum", {"equation": "ij->ji"}, [((4, 4), F)]),
    ("dp_Einsum", "Einsum", {"equation": "ii->i"}, [((4, 4), F)]),
    ("dp_Einsum_pr", "Einsum", {"equation": "bij,jk->ibk"}, [((4, 2, 3), F), ((3, 2), F)]),
    ("dp_Einsum_pr", "Einsum", {"equation": "bij,bk->bik"}, [((4, 2, 3), F), ((4, 2), F)]),
    ("dp_Einsum_pp", "Einsum", {"equation": "ij,kj->ik"}, [((4, 3), F), ((4, 3), F)]),
    ("dp_Einsum_pp", "Einsum", {"equation": "bij,bjk->ik"}, [((4, 2, 3), F), ((4, 3, 2), F)]),
    # Expand: a rank raise moves dim 0; a broadcast dim 0 (size 1) cannot be split
    ("dp_Expand", "Expand", {"shape": (2, 4, 3)}, [((4, 3), F)]),
    ("dp_Expand", "Expand", {"shape": (4, 3)}, [((1, 3), F)]),
    ("dp_Einsum_pp", "Einsum", {"equation": "bij,bjk->bik"}, [((4, 2, 3), F), ((4, 3, 2), F)]),   # controls
    ("dp_Expand", "Expand", {"shape": (4, 3)}, [((4, 1), F)]),
]
CONTROLS = {("dp_Pool1d", "Pool1d"), ("dp_Einsum_pp", "bij,bjk->bik"), ("dp_Expand", (4, 1))}


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c[0]}-{c[1]}-{list(c[2].values())[:1]}")
def test_dp_rule_is_refused_where_dim0_is_not_the_sample_dim(shipped, case):
    name, opname, attrs, inputs = case
    g = _graph(opname, attrs, inputs)
    ms = find_matches(shipped.get(name), g, degrees=[2])
    assert ms                          # the pattern matches: the refusal is the labels', at application
    applied = []
    for m in ms:
        try:
            applied.append(apply_match(g, m))
        except InvalidParallelization:
            pass
    control = {(name, opname), (name, attrs.get("equation")), (name, inputs[0][0])} & CONTROLS
    if control:                        # the controls: a global pool keeps its batch dim, a batched einsum, ...
        assert applied
    else:
        assert not applied, f"{name} applied to {opname}{attrs}"


def test_a_wrong_sample_axiom_is_caught_by_the_self_check():
    """The self-check has teeth for the new family: a wrong attribute or a wrong layout fails it."""
    wrong = [
        ("leaky_alpha", op("LeakyRelu", op("Partition", "x", dim=0, degree="$k"), alpha=0.1),
         op("Partition", op("LeakyRelu", "x", alpha=0.2), dim=0, degree="$k"), {"x": S.of((4, 4))}),
        ("tile_repeats", op("Tile", op("Partition", "x", dim=0, degree="$k"), repeats=(1, 2)),
         op("Partition", op("Tile", "x", repeats=(2, 1)), dim=0, degree="$k"), {"x": S.of((4, 4))}),
        ("where_full_y_replicated",
         op("Where", op("Partition", "c", dim=0, degree="$k"), op("Partition", "x", dim=0, degree="$k"),
            op("Replicate", "y", degree="$k")),
         op("Partition", op("Where", "c", "x", "y"), dim=0, degree="$k"),
         {"c": S.of((4, 4), dtype="bool"), "x": S.of((4, 4)), "y": S.of((4, 4))}),
        ("cumsum_reverse", op("CumSum", op("Partition", "x", dim=0, degree="$k"), axis=1, exclusive=False, reverse=True),
         op("Partition", op("CumSum", "x", axis=1, exclusive=False, reverse=False), dim=0, degree="$k"),
         {"x": S.of((4, 4))}),
    ]
    for name, lhs, rhs, shapes in wrong:
        ax = Axiom(name, "wrong", "parallel", rule_of(name, lhs, rhs, {"k": "degree"}), {"k": 2}, shapes)
        assert not check_axiom(ax).ok, name


# --- the joint search reaches data parallelism by rules ---------------------------------------------------

def spatial_model(batch=64):
    """Conv3d (bias) -> GroupNorm -> Silu -> Pool3d -> ConvTranspose -> InstanceNorm -> Mul, Add by per-channel
    (C, 1, 1, 1) weights (as exporters write a norm's affine part) -> LeakyRelu -> Pool3d -> Flatten -> Linear ->
    LogSoftmax."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, 8, 16, 16, 16)})
    w = b.add("Weight", {"name": "w", "shape": (16, 8, 3, 3, 3)})
    bias = b.add("Weight", {"name": "b", "shape": (16,)})
    y = b.add("Conv3d", {"stride": (1, 1, 1), "padding": (1,) * 6, "dilation": (1, 1, 1), "groups": 1}, [x, w, bias])
    y = b.add("GroupNorm", {"groups": 4, "eps": 1e-5},
              [y, b.add("Weight", {"name": "gs", "shape": (16,)}), b.add("Weight", {"name": "gb", "shape": (16,)})])
    y = b.add("Silu", {}, [y])
    y = b.add("Pool3d", {"kind": "max", "kernel": (4, 4, 4), "stride": (4, 4, 4), "padding": (0,) * 6,
                         "dilation": (1, 1, 1), "global_pool": False, "count_include_pad": False, "ceil_mode": False}, [y])
    y = b.add("ConvTranspose", {"stride": (2, 2, 2), "padding": (), "dilation": (), "output_padding": (), "groups": 1},
              [y, b.add("Weight", {"name": "wt", "shape": (16, 8, 2, 2, 2)})])
    y = b.add("InstanceNorm", {"eps": 1e-5},
              [y, b.add("Weight", {"name": "is", "shape": (8,)}), b.add("Weight", {"name": "ib", "shape": (8,)})])
    y = b.add("Mul", {}, [y, b.add("Weight", {"name": "ms", "shape": (8, 1, 1, 1)})])
    y = b.add("Add", {}, [b.add("Weight", {"name": "ma", "shape": (8, 1, 1, 1)}), y])
    y = b.add("LeakyRelu", {"alpha": 0.2}, [y])
    y = b.add("Pool3d", {"kind": "avg", "kernel": (2, 2, 2), "stride": (2, 2, 2), "padding": (0,) * 6,
                         "dilation": (1, 1, 1), "global_pool": False, "count_include_pad": False, "ceil_mode": False}, [y])
    y = b.add("Flatten", {"axis": 1}, [y])
    y = b.add("Linear", {}, [y, b.add("Weight", {"name": "wl", "shape": (512, 10)})])
    b.set_outputs([b.add("LogSoftmax", {"axis": -1}, [y])])
    return b.finish()


def mlp_model(batch=256, h=512):
    """Linear -> LeakyRelu -> PRelu (per-feature slope) -> Where(Greater(thr), ., Mish(.)) -> CumSum -> Linear
    -> minus its ReduceMax -> LogSoftmax."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    y = b.add("Linear", {}, [x, b.add("Weight", {"name": "w1", "shape": (h, h)})])
    y = b.add("LeakyRelu", {"alpha": 0.1}, [y])
    y = b.add("PRelu", {}, [y, b.add("Weight", {"name": "slope", "shape": (h,)})])
    c = b.add("Greater", {}, [y, b.add("Weight", {"name": "thr", "shape": (1, h)})])
    y = b.add("Where", {}, [c, y, b.add("Mish", {}, [y])])
    y = b.add("CumSum", {"axis": 1, "exclusive": False, "reverse": False}, [y])
    y = b.add("Linear", {}, [y, b.add("Weight", {"name": "w2", "shape": (h, h)})])
    m = b.add("ReduceMax", {"axes": (1,), "keepdims": True}, [y])
    b.set_outputs([b.add("LogSoftmax", {"axis": -1}, [b.add("Sub", {}, [y, m])])])
    return b.finish()


@pytest.mark.parametrize("make", [spatial_model, mlp_model])
def test_data_parallel_by_rules_equals_the_baseline(book, make):
    g = make()
    pg, steps = data_parallel_steps(g, 2, book)
    used = {s.rule for s in steps}
    news = {n.op for n in g.nodes() if n.kind == "compute"} - {"Linear", "Flatten"}
    assert all(any(u == f"dp_{o}" or u.startswith(f"dp_{o}_") for u in used) for o in news), (news, used)
    assert normalized_hash(trimmed(pg)) == normalized_hash(data_parallel(g, 2))
    assert replay(g, steps, book).structural_hash() == pg.structural_hash()


@pytest.mark.parametrize("make", [spatial_model, mlp_model])
def test_joint_search_reaches_data_parallelism_by_rules(book, make):
    g = make()
    res = optimize(g, "summit:1x2", budget_s=120, max_candidates=4, pipeline=False)
    assert res.feasible and res.dp is not None and res.dp.feasible
    assert "baseline" not in str(res.stats.get("chosen", "")), res.stats.get("chosen")
    assert res.plan.rules and len(res.plan.rules) == len(res.steps)
    assert replay(g, res.steps, book, trim_outputs=True).structural_hash() == res.plan.pcg.structural_hash()
    dp_hash = normalized_hash(data_parallel(g, 2))
    assert normalized_hash(res.plan.pcg) == dp_hash or res.predicted_iteration_s < res.dp.cost
    assert res.predicted_iteration_s <= res.dp.cost * (1 + 1e-9)
    # data parallelism beats one device on these sizes, so the plan really is parallel
    assert any(n.kind == "parallel" for n in res.plan.pcg.nodes())


@pytest.mark.slow
def test_imported_spatial_model_reaches_data_parallelism_by_rules(book, tmp_path):
    """The same on an ONNX export (torch, legacy exporter): GroupNorm arrives as Reshape -> InstanceNorm ->
    Reshape -> Mul/Add by per-channel weights, ConvTranspose3d, LeakyRelu, LogSoftmax; the plan's rule sequence
    replays on a fresh import."""
    torch = pytest.importorskip("torch")
    from unity_pcg.onnx_import import load_onnx

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv3d(4, 8, 3, padding=1)
            self.g = torch.nn.GroupNorm(2, 8)
            self.ct = torch.nn.ConvTranspose3d(8, 4, 2, stride=2)
            self.i = torch.nn.InstanceNorm3d(4, affine=True)
            self.fc = torch.nn.Linear(4 * 8 * 8 * 8, 10)

        def forward(self, x):
            y = torch.nn.functional.max_pool3d(torch.nn.functional.silu(self.g(self.c(x))), 2)
            y = torch.nn.functional.leaky_relu(self.i(self.ct(y)), 0.2)
            return torch.log_softmax(self.fc(y.flatten(1)), -1)

    path = str(tmp_path / "net.onnx")
    torch.onnx.export(Net(), (torch.zeros(32, 4, 8, 8, 8),), path, dynamo=False, input_names=["x"])
    g = load_onnx(path, load_weights=False)
    pg, steps = data_parallel_steps(g, 2, book)
    assert normalized_hash(trimmed(pg)) == normalized_hash(data_parallel(g, 2))
    res = optimize(path, "summit:1x2", budget_s=120, max_candidates=4, pipeline=False)
    assert "baseline" not in str(res.stats.get("chosen", "")) and res.plan.rules
    fresh = load_onnx(path, load_weights=False)
    assert replay(fresh, res.steps, book, trim_outputs=True).structural_hash() == res.plan.pcg.structural_hash()
    assert res.predicted_iteration_s <= res.dp.cost * (1 + 1e-9)
