"""Operator properties used as axioms (TASO-style), written once as pattern pairs.

Every axiom is an equation ``lhs = rhs`` between two patterns over named input tensors, with
variables (dims, degrees, attribute values) and constraints, like a rule.  The verifier reads it as a
universally quantified first-order formula over an uninterpreted tensor sort (see verify.py); the
self-check (selfcheck.py) instantiates it on small concrete tensors and evaluates both sides under the
piece semantics, so a wrong axiom is caught before it can prove a wrong rule.

Meaning of ``=`` (DESIGN "Piece semantics"): both sides have the same parallel shape and the same
logical value, for every input on which both sides are valid parallelizations.  Shape side conditions
are not encoded (as in TASO); a rule is only applied where shape inference accepts the result.

Axioms are grouped in *schemas* (one property, e.g. "an element-wise unary op commutes with
Partition"), instantiated once per operator of a family; the counts report both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from unity_pcg.shape import ParallelTensorShape as S
from unity_pcg.substitutions.rule import Rule
from unity_pcg.substitutions.terms import op, rule_of


@dataclass(frozen=True)
class Axiom:
    name: str
    schema: str
    group: str                      # "algebraic" | "parallel"
    rule: Rule                      # source = lhs, target = rhs
    bind: Mapping[str, Any]         # example variable values for the self-check
    shapes: Mapping[str, S]         # example parallel input shapes for the self-check
    values: str = "float"           # "float" | "pos" (positive floats) | "int"
    int_inputs: tuple[str, ...] = ()  # inputs fed as small non-negative integer indices

    @property
    def ops(self) -> set[str]:
        return {n.op for p in (self.rule.source, self.rule.target) for n in p.nodes}


_AXIOMS: list[Axiom] = []


def _ax(name: str, schema: str, group: str, lhs, rhs, vars: Mapping[str, str] | None = None,
        constraints=(), bind=None, shapes=None, values="float", int_inputs=()) -> None:
    r = rule_of(name, lhs, rhs, vars, constraints, origin="axiom")
    _AXIOMS.append(Axiom(name, schema, group, r, dict(bind or {}), dict(shapes or {}), values, tuple(int_inputs)))


DK = {"d": "dim", "k": "degree"}
X44 = {"x": S.of((4, 4))}

# --- element-wise unary family -------------------------------------------------------------------
UNARY: dict[str, tuple[dict, dict, str, bool]] = {
    # op: (attr pattern, example attrs, value kind, linear)
    "Relu": ({}, {}, "float", False),
    "Gelu": ({}, {}, "float", False),
    "Sigmoid": ({}, {}, "float", False),
    "Tanh": ({}, {}, "float", False),
    "Erf": ({}, {}, "float", False),
    "Exp": ({}, {}, "float", False),
    "Sqrt": ({}, {}, "pos", False),
    "Reciprocal": ({}, {}, "pos", False),
    "Neg": ({}, {}, "float", True),
    "Identity": ({}, {}, "float", True),
    "Dropout": ({"ratio": "$r"}, {"r": 0.1}, "float", True),
    "Scale": ({"factor": "$f"}, {"f": 1.5}, "float", True),
    "Clip": ({"min": "$lo", "max": "$hi"}, {"lo": -0.5, "hi": 0.5}, "float", False),
    "Cast": ({"to": "$t"}, {"t": "float64"}, "float", True),
    # import-coverage activations (issue 10): element-wise, every dim free, no partial sums
    "Silu": ({}, {}, "float", False),
    "GeluTanh": ({}, {}, "float", False),
    "LeakyRelu": ({"alpha": "$al"}, {"al": 0.01}, "float", False),
    "Elu": ({"alpha": "$al"}, {"al": 1.0}, "float", False),
    "Selu": ({"alpha": "$al", "gamma": "$ga"}, {"al": 1.6732632, "ga": 1.0507010}, "float", False),
    "Celu": ({"alpha": "$al"}, {"al": 1.0}, "float", False),
    "Softplus": ({}, {}, "float", False),
    "Softsign": ({}, {}, "float", False),
    "Mish": ({}, {}, "float", False),
    "HardSigmoid": ({"alpha": "$al", "beta": "$be"}, {"al": 0.2, "be": 0.5}, "float", False),
    "HardSwish": ({}, {}, "float", False),
    "Abs": ({}, {}, "float", False),
    "Log": ({}, {}, "pos", False),
}
BINARY: dict[str, tuple[str, str]] = {
    # op: (linearity: additive | bilinear | linear0 | none, value kind)
    "Add": ("additive", "float"), "Sub": ("additive", "float"), "Mul": ("bilinear", "float"),
    "Div": ("linear0", "pos"), "Pow": ("none", "pos"), "Max": ("none", "float"), "Min": ("none", "float"),
    # import-coverage operators (issue 10): the slope of PRelu and the comparisons (bool out), no partial sums
    "PRelu": ("none", "float"), "Equal": ("none", "float"), "Less": ("none", "float"),
    "Greater": ("none", "float"), "LessOrEqual": ("none", "float"), "GreaterOrEqual": ("none", "float"),
}


def _uvars(attrs: dict) -> dict:
    return {v[1:]: "attr" for v in attrs.values()}


for _u, (_pa, _ex, _vk, _lin) in UNARY.items():
    V = {**DK, **_uvars(_pa)}
    u = lambda t, _u=_u, _pa=_pa: op(_u, t, **_pa)  # noqa: E731
    _ax(f"{_u}_partition", "unary_partition", "parallel", u(op("Partition", "x", dim="$d", degree="$k")),
        op("Partition", u("x"), dim="$d", degree="$k"), V, bind={**_ex, "d": -1, "k": 2}, shapes=X44, values=_vk)
    _ax(f"{_u}_combine", "unary_combine", "parallel", u(op("Combine", "x", dim="$d", degree="$k")),
        op("Combine", u("x"), dim="$d", degree="$k"), V, bind={**_ex, "d": -2, "k": 2},
        shapes={"x": S.of((4, 4), (2, 1))}, values=_vk)
    _ax(f"{_u}_replicate", "unary_replicate", "parallel", u(op("Replicate", "x", degree="$k")),
        op("Replicate", u("x"), degree="$k"), V, bind={**_ex, "k": 2}, shapes=X44, values=_vk)
    _ax(f"{_u}_pipeline", "unary_pipeline", "parallel", u(op("Pipeline", "x", dim="$d", degree="$k")),
        op("Pipeline", u("x"), dim="$d", degree="$k"), V, bind={**_ex, "d": -2, "k": 2}, shapes=X44, values=_vk)
    _ax(f"{_u}_batch", "unary_batch", "parallel", u(op("Batch", "x", dim="$d", degree="$k")),
        op("Batch", u("x"), dim="$d", degree="$k"), V, bind={**_ex, "d": -2, "k": 2},
        shapes={"x": S.of((4, 4), (2, 1))}, values=_vk)
    if _lin:
        _ax(f"{_u}_reduce", "linear_unary_reduce", "parallel", u(op("Reduce", "x", degree="$k")),
            op("Reduce", u("x"), degree="$k"), V, bind={**_ex, "k": 2}, shapes={"x": S.of((4, 4), sum_degree=2)},
            values=_vk)
    _ax(f"{_u}_concat", "unary_concat", "algebraic", u(op("Concat", "x", "y", axis="$a")),
        op("Concat", u("x"), u("y"), axis="$a"), {**_uvars(_pa), "a": "dim"}, bind={**_ex, "a": -1},
        shapes={"x": S.of((4, 2)), "y": S.of((4, 3))}, values=_vk)

# --- element-wise binary family ---------------------------------------------------------------------
XY = {"x": S.of((4, 4)), "y": S.of((4, 4))}
for _b, (_lin, _vk) in BINARY.items():
    b = lambda p, q, _b=_b: op(_b, p, q)  # noqa: E731
    P = lambda t: op("Partition", t, dim="$d", degree="$k")  # noqa: E731
    _ax(f"{_b}_partition", "binary_partition", "parallel", b(P("x"), P("y")), P(b("x", "y")), DK,
        bind={"d": -2, "k": 2}, shapes=XY, values=_vk)
    C = lambda t: op("Combine", t, dim="$d", degree="$k")  # noqa: E731
    _ax(f"{_b}_combine", "binary_combine", "parallel", b(C("x"), C("y")), C(b("x", "y")), DK,
        bind={"d": -1, "k": 2}, shapes={"x": S.of((4, 4), (1, 2)), "y": S.of((4, 4), (1, 2))}, values=_vk)
    R = lambda t: op("Replicate", t, degree="$k")  # noqa: E731
    _ax(f"{_b}_replicate", "binary_replicate", "parallel", b(R("x"), R("y")), R(b("x", "y")), {"k": "degree"},
        bind={"k": 2}, shapes=XY, values=_vk)
    _ax(f"{_b}_concat", "binary_concat", "algebraic",
        b(op("Concat", "x1", "x2", axis="$a"), op("Concat", "y1", "y2", axis="$a")),
        op("Concat", b("x1", "y1"), b("x2", "y2"), axis="$a"), {"a": "dim"}, bind={"a": -2},
        shapes={"x1": S.of((2, 4)), "x2": S.of((2, 4)), "y1": S.of((2, 4)), "y2": S.of((2, 4))}, values=_vk)
    Rd = lambda t: op("Reduce", t, degree="$k")  # noqa: E731
    XYs = {"x": S.of((4, 4), sum_degree=2), "y": S.of((4, 4), sum_degree=2)}
    if _lin == "additive":
        _ax(f"{_b}_reduce", "additive_binary_reduce", "parallel", b(Rd("x"), Rd("y")), Rd(b("x", "y")),
            {"k": "degree"}, bind={"k": 2}, shapes=XYs, values=_vk)
    if _lin in ("bilinear", "linear0"):
        _ax(f"{_b}_reduce_lhs", "linear_binary_reduce", "parallel", b(Rd("x"), "y"), Rd(b("x", R("y"))),
            {"k": "degree"}, bind={"k": 2}, shapes={"x": S.of((4, 4), sum_degree=2), "y": S.of((4, 4))},
            values=_vk)
    if _lin == "bilinear":
        _ax(f"{_b}_reduce_rhs", "linear_binary_reduce", "parallel", b("x", Rd("y")), Rd(b(R("x"), "y")),
            {"k": "degree"}, bind={"k": 2}, shapes={"x": S.of((4, 4)), "y": S.of((4, 4), sum_degree=2)},
            values=_vk)

# algebraic properties of the binary ops (TASO Table 2 style)
XYZ = {"x": S.of((4, 4)), "y": S.of((4, 4)), "z": S.of((4, 4))}
for _b in ("Add", "Mul", "Max", "Min"):
    _ax(f"{_b}_comm", "commutative", "algebraic", op(_b, "x", "y"), op(_b, "y", "x"), shapes=XY)
    _ax(f"{_b}_assoc", "associative", "algebraic", op(_b, op(_b, "x", "y"), "z"), op(_b, "x", op(_b, "y", "z")),
        shapes=XYZ)
_ax("Mul_distrib_Add", "distributive", "algebraic", op("Mul", "x", op("Add", "y", "z")),
    op("Add", op("Mul", "x", "y"), op("Mul", "x", "z")), shapes=XYZ)
_ax("Sub_as_Add_Neg", "sub_neg", "algebraic", op("Sub", "x", "y"), op("Add", "x", op("Neg", "y")), shapes=XY)
_ax("Scale_Mul_comm", "scale_linear", "algebraic", op("Scale", op("Mul", "x", "y"), factor="$f"),
    op("Mul", op("Scale", "x", factor="$f"), "y"), {"f": "attr"}, bind={"f": 2.0}, shapes=XY)

# --- matrix multiplication -----------------------------------------------------------------------------
M = {"x": S.of((4, 4)), "y": S.of((4, 4))}
_ax("MatMul_assoc", "matmul_assoc", "algebraic", op("MatMul", op("MatMul", "x", "y"), "z"),
    op("MatMul", "x", op("MatMul", "y", "z")), shapes=XYZ)
_ax("MatMul_distrib_lhs", "matmul_distrib", "algebraic", op("MatMul", "x", op("Add", "y", "z")),
    op("Add", op("MatMul", "x", "y"), op("MatMul", "x", "z")), shapes=XYZ)
_ax("MatMul_distrib_rhs", "matmul_distrib", "algebraic", op("MatMul", op("Add", "x", "y"), "z"),
    op("Add", op("MatMul", "x", "z"), op("MatMul", "y", "z")), shapes=XYZ)
_ax("MatMul_concat_cols", "matmul_concat", "algebraic", op("MatMul", "x", op("Concat", "y", "z", axis=-1)),
    op("Concat", op("MatMul", "x", "y"), op("MatMul", "x", "z"), axis=-1),
    shapes={"x": S.of((4, 4)), "y": S.of((4, 2)), "z": S.of((4, 3))})
_ax("MatMul_concat_rows", "matmul_concat", "algebraic", op("MatMul", op("Concat", "x", "y", axis=-2), "z"),
    op("Concat", op("MatMul", "x", "z"), op("MatMul", "y", "z"), axis=-2),
    shapes={"x": S.of((2, 4)), "y": S.of((3, 4)), "z": S.of((4, 4))})
_ax("MatMul_concat_inner", "matmul_concat", "algebraic",
    op("MatMul", op("Concat", "x1", "x2", axis=-1), op("Concat", "y1", "y2", axis=-2)),
    op("Add", op("MatMul", "x1", "y1"), op("MatMul", "x2", "y2")),
    shapes={"x1": S.of((4, 2)), "x2": S.of((4, 3)), "y1": S.of((2, 4)), "y2": S.of((3, 4))})
_ax("MatMul_scale", "scale_linear", "algebraic", op("MatMul", op("Scale", "x", factor="$f"), "y"),
    op("Scale", op("MatMul", "x", "y"), factor="$f"), {"f": "attr"}, bind={"f": 2.0}, shapes=M)

for _mm, _b, _shape in (("MatMul", -2, (4, 4)), ("BatchMatMul", -3, (2, 4, 4))):
    X = {"x": S.of(_shape), "y": S.of(_shape)}
    if _mm == "MatMul":
        _ax("MatMul_partition_rows", "matmul_partition_rows", "parallel",
            op(_mm, op("Partition", "x", dim="$d", degree="$k"), op("Replicate", "y", degree="$k")),
            op("Partition", op(_mm, "x", "y"), dim="$d", degree="$k"), DK, [["$d", "<=", -2]],
            bind={"d": -2, "k": 2}, shapes=X)
    else:
        _ax("BatchMatMul_partition_rows", "matmul_partition_rows", "parallel",
            op(_mm, op("Partition", "x", dim=-2, degree="$k"), op("Replicate", "y", degree="$k")),
            op("Partition", op(_mm, "x", "y"), dim=-2, degree="$k"), {"k": "degree"},
            bind={"k": 2}, shapes=X)
        _ax("BatchMatMul_partition_batch", "matmul_partition_batch", "parallel",
            op(_mm, op("Partition", "x", dim="$d", degree="$k"), op("Partition", "y", dim="$d", degree="$k")),
            op("Partition", op(_mm, "x", "y"), dim="$d", degree="$k"), DK, [["$d", "<=", -3]],
            bind={"d": -3, "k": 2}, shapes=X)
    _ax(f"{_mm}_partition_cols", "matmul_partition_cols", "parallel",
        op(_mm, op("Replicate", "x", degree="$k"), op("Partition", "y", dim=-1, degree="$k")),
        op("Partition", op(_mm, "x", "y"), dim=-1, degree="$k"), {"k": "degree"}, bind={"k": 2}, shapes=X)
    _ax(f"{_mm}_partition_inner", "matmul_partition_inner", "parallel",
        op("Reduce", op(_mm, op("Partition", "x", dim=-1, degree="$k"), op("Partition", "y", dim=-2, degree="$k")),
           degree="$k"),
        op(_mm, "x", "y"), {"k": "degree"}, bind={"k": 2}, shapes=X)
    _ax(f"{_mm}_reduce_lhs", "matmul_reduce", "parallel", op(_mm, op("Reduce", "x", degree="$k"), "y"),
        op("Reduce", op(_mm, "x", op("Replicate", "y", degree="$k")), degree="$k"), {"k": "degree"},
        bind={"k": 2}, shapes={"x": S.of(_shape, sum_degree=2), "y": S.of(_shape)})
    _ax(f"{_mm}_reduce_rhs", "matmul_reduce", "parallel", op(_mm, "x", op("Reduce", "y", degree="$k")),
        op("Reduce", op(_mm, op("Replicate", "x", degree="$k"), "y"), degree="$k"), {"k": "degree"},
        bind={"k": 2}, shapes={"x": S.of(_shape), "y": S.of(_shape, sum_degree=2)})
    _ax(f"{_mm}_replicate", "matmul_replicate", "parallel",
        op(_mm, op("Replicate", "x", degree="$k"), op("Replicate", "y", degree="$k")),
        op("Replicate", op(_mm, "x", "y"), degree="$k"), {"k": "degree"}, bind={"k": 2}, shapes=X)

# --- Linear -----------------------------------------------------------------------------------------------
LIN = {"x": S.of((4, 4)), "w": S.of((4, 4))}
LINB = {**LIN, "b": S.of((4,))}
_ax("Linear_is_MatMul", "linear_matmul", "algebraic", op("Linear", "x", "w"), op("MatMul", "x", "w"), shapes=LIN)
_ax("Linear_bias_is_Add", "linear_bias", "algebraic", op("Linear", "x", "w", "b"),
    op("Add", op("Linear", "x", "w"), "b"), shapes=LINB)
for _act, _u in (("relu", "Relu"), ("gelu", "Gelu"), ("sigmoid", "Sigmoid"), ("tanh", "Tanh")):
    _ax(f"Linear_{_act}_fused", "linear_activation", "algebraic", op("Linear", "x", "w", activation=_act),
        op(_u, op("Linear", "x", "w")), shapes=LIN)
    _ax(f"Linear_{_act}_bias_fused", "linear_activation", "algebraic", op("Linear", "x", "w", "b", activation=_act),
        op(_u, op("Linear", "x", "w", "b")), shapes=LINB)
_A = {"act": "attr"}
_ax("Linear_partition_rows", "linear_partition_rows", "parallel",
    op("Linear", op("Partition", "x", dim="$d", degree="$k"), op("Replicate", "w", degree="$k"), activation="$act"),
    op("Partition", op("Linear", "x", "w", activation="$act"), dim="$d", degree="$k"), {**DK, **_A},
    [["$d", "<=", -2]], bind={"d": -2, "k": 2, "act": "relu"}, shapes=LIN)
_ax("Linear_bias_partition_rows", "linear_partition_rows", "parallel",
    op("Linear", op("Partition", "x", dim="$d", degree="$k"), op("Replicate", "w", degree="$k"),
       op("Replicate", "b", degree="$k"), activation="$act"),
    op("Partition", op("Linear", "x", "w", "b", activation="$act"), dim="$d", degree="$k"), {**DK, **_A},
    [["$d", "<=", -2]], bind={"d": -2, "k": 2, "act": "relu"}, shapes=LINB)
_ax("Linear_partition_cols", "linear_partition_cols", "parallel",
    op("Linear", op("Replicate", "x", degree="$k"), op("Partition", "w", dim=-1, degree="$k"), activation="$act"),
    op("Partition", op("Linear", "x", "w", activation="$act"), dim=-1, degree="$k"), {"k": "degree", **_A},
    bind={"k": 2, "act": "relu"}, shapes=LIN)
_ax("Linear_bias_partition_cols", "linear_partition_cols", "parallel",
    op("Linear", op("Replicate", "x", degree="$k"), op("Partition", "w", dim=-1, degree="$k"),
       op("Partition", "b", dim=-1, degree="$k"), activation="$act"),
    op("Partition", op("Linear", "x", "w", "b", activation="$act"), dim=-1, degree="$k"), {"k": "degree", **_A},
    bind={"k": 2, "act": "relu"}, shapes=LINB)
_ax("Linear_replicate", "linear_replicate", "parallel",
    op("Linear", op("Replicate", "x", degree="$k"), op("Replicate", "w", degree="$k"), activation="$act"),
    op("Replicate", op("Linear", "x", "w", activation="$act"), degree="$k"), {"k": "degree", **_A},
    bind={"k": 2, "act": "relu"}, shapes=LIN)

# --- parallel operators among themselves ---------------------------------------------------------------
_ax("Combine_Partition", "combine_partition_inverse", "parallel",
    op("Combine", op("Partition", "x", dim="$d", degree="$k"), dim="$d", degree="$k"), "x", DK,
    bind={"d": -1, "k": 2}, shapes=X44)
_ax("Partition_Combine", "combine_partition_inverse", "parallel",
    op("Partition", op("Combine", "x", dim="$d", degree="$k"), dim="$d", degree="$k"), "x", DK,
    bind={"d": -2, "k": 2}, shapes={"x": S.of((4, 4), (2, 1))})
_ax("Batch_Pipeline", "batch_pipeline_inverse", "parallel",
    op("Batch", op("Pipeline", "x", dim="$d", degree="$k"), dim="$d", degree="$k"), "x", DK,
    bind={"d": -2, "k": 2}, shapes=X44)
_ax("Pipeline_Batch", "batch_pipeline_inverse", "parallel",
    op("Pipeline", op("Batch", "x", dim="$d", degree="$k"), dim="$d", degree="$k"), "x", DK,
    bind={"d": -2, "k": 2}, shapes={"x": S.of((4, 4), (2, 1))})
_DD = {"d": "dim", "e": "dim", "k": "degree", "j": "degree"}
for _p1 in ("Partition", "Combine"):
    for _p2 in ("Partition", "Combine"):
        shp = S.of((4, 4), (2 if _p1 == "Combine" else 1, 2 if _p2 == "Combine" else 1))
        _ax(f"{_p1}_{_p2}_commute", "partition_commute", "parallel",
            op(_p1, op(_p2, "x", dim="$e", degree="$j"), dim="$d", degree="$k"),
            op(_p2, op(_p1, "x", dim="$d", degree="$k"), dim="$e", degree="$j"), _DD, [["$d", "!=", "$e"]],
            bind={"d": -2, "e": -1, "k": 2, "j": 2}, shapes={"x": shp})
for _p in ("Partition", "Combine"):
    shp = S.of((4, 4), (2, 1)) if _p == "Combine" else S.of((4, 4))
    _ax(f"Replicate_{_p}_commute", "replicate_commute", "parallel",
        op("Replicate", op(_p, "x", dim="$d", degree="$k"), degree="$j"),
        op(_p, op("Replicate", "x", degree="$j"), dim="$d", degree="$k"), _DD,
        bind={"d": -2, "k": 2, "j": 2}, shapes={"x": shp})
    _ax(f"Reduce_{_p}_commute", "reduce_commute", "parallel",
        op("Reduce", op(_p, "x", dim="$d", degree="$k"), degree="$j"),
        op(_p, op("Reduce", "x", degree="$j"), dim="$d", degree="$k"), _DD,
        bind={"d": -2, "k": 2, "j": 2}, shapes={"x": S.of((4, 4), shp.degrees, sum_degree=2)})
_ax("Reduce_Replicate_commute", "reduce_commute", "parallel",
    op("Reduce", op("Replicate", "x", degree="$j"), degree="$k"),
    op("Replicate", op("Reduce", "x", degree="$k"), degree="$j"), {"k": "degree", "j": "degree"},
    bind={"k": 2, "j": 2}, shapes={"x": S.of((4, 4), sum_degree=2)})
# copies of copies: j copies of each of k copies are j * k copies (degrees compose; ``replicate_merge``)
_ax("Replicate_compose", "replicate_compose", "parallel",
    op("Replicate", op("Replicate", "x", degree="$k"), degree="$j"), op("Replicate", "x", degree="$m"),
    {"k": "degree", "j": "degree", "m": "degree"}, [("$m", "==", ("*", "$k", "$j"))],
    bind={"k": 2, "j": 2, "m": 4}, shapes=X44)
_ax("AllReduce_is_Reduce_Replicate", "allreduce", "parallel", op("AllReduce", "x", degree="$k"),
    op("Replicate", op("Reduce", "x", degree="$k"), degree="$k"), {"k": "degree"},
    bind={"k": 2}, shapes={"x": S.of((4, 4), sum_degree=2)})

# --- concat, split, reductions -----------------------------------------------------------------------------
XY24 = {"x": S.of((4, 2)), "y": S.of((4, 2))}
_ax("Concat_partition", "concat_parallel", "parallel",
    op("Concat", op("Partition", "x", dim="$d", degree="$k"), op("Partition", "y", dim="$d", degree="$k"), axis="$a"),
    op("Partition", op("Concat", "x", "y", axis="$a"), dim="$d", degree="$k"), {**DK, "a": "dim"},
    [["$d", "!=", "$a"]], bind={"d": -2, "k": 2, "a": -1}, shapes=XY24)
# the same for Concats of 3..32 inputs (Inception's branch joins, DLRM/XDL/CANDLE-Uno's feature joins: 25 in the
# paper-size DLRM); the encoder gives each arity its own function and the verifier selects axioms by
# (op, arity), so these reach only rules with Concats of that many inputs
CONCAT_ARITIES = tuple(range(3, 33))


def concat_names(n: int) -> list[str]:
    return [f"x{i}" for i in range(1, n + 1)]


for _n in CONCAT_ARITIES:
    _xs = concat_names(_n)
    _ax(f"Concat{_n}_partition", "concat_parallel", "parallel",
        op("Concat", *[op("Partition", x, dim="$d", degree="$k") for x in _xs], axis="$a"),
        op("Partition", op("Concat", *_xs, axis="$a"), dim="$d", degree="$k"), {**DK, "a": "dim"},
        [["$d", "!=", "$a"]], bind={"d": -2, "k": 2, "a": -1}, shapes={x: S.of((4, 1 + i % 3)) for i, x in enumerate(_xs)})
_ax("Concat_combine", "concat_parallel", "parallel",
    op("Concat", op("Combine", "x", dim="$d", degree="$k"), op("Combine", "y", dim="$d", degree="$k"), axis="$a"),
    op("Combine", op("Concat", "x", "y", axis="$a"), dim="$d", degree="$k"), {**DK, "a": "dim"},
    [["$d", "!=", "$a"]], bind={"d": -2, "k": 2, "a": -1},
    shapes={"x": S.of((4, 2), (2, 1)), "y": S.of((4, 2), (2, 1))})
_ax("Concat_replicate", "concat_parallel", "parallel",
    op("Concat", op("Replicate", "x", degree="$k"), op("Replicate", "y", degree="$k"), axis="$a"),
    op("Replicate", op("Concat", "x", "y", axis="$a"), degree="$k"), {"k": "degree", "a": "dim"},
    bind={"k": 2, "a": -1}, shapes=XY24)
# a Concat of copies is the copied Concat, for every arity (a Replicate lifted above a join of branches: CANDLE-Uno's
# feature towers on the tensor-parallel copies, as Alpa's plan keeps them)
for _n in CONCAT_ARITIES:
    _xs = concat_names(_n)
    _ax(f"Concat{_n}_replicate", "concat_parallel", "parallel",
        op("Concat", *[op("Replicate", x, degree="$k") for x in _xs], axis="$a"),
        op("Replicate", op("Concat", *_xs, axis="$a"), degree="$k"), {"k": "degree", "a": "dim"},
        bind={"k": 2, "a": -1}, shapes={x: S.of((4, 1 + i % 3)) for i, x in enumerate(_xs)})
_ax("Concat_reduce", "concat_parallel", "parallel",
    op("Concat", op("Reduce", "x", degree="$k"), op("Reduce", "y", degree="$k"), axis="$a"),
    op("Reduce", op("Concat", "x", "y", axis="$a"), degree="$k"), {"k": "degree", "a": "dim"},
    bind={"k": 2, "a": -1}, shapes={"x": S.of((4, 2), sum_degree=2), "y": S.of((4, 2), sum_degree=2)})
_ax("Concat_assoc", "concat_assoc", "algebraic", op("Concat", op("Concat", "x", "y", axis="$a"), "z", axis="$a"),
    op("Concat", "x", op("Concat", "y", "z", axis="$a"), axis="$a"), {"a": "dim"}, bind={"a": -1},
    shapes={"x": S.of((4, 1)), "y": S.of((4, 2)), "z": S.of((4, 3))})
_ax("Concat_blocks", "concat_blocks", "algebraic",
    op("Concat", op("Concat", "x1", "x2", axis="$b"), op("Concat", "y1", "y2", axis="$b"), axis="$a"),
    op("Concat", op("Concat", "x1", "y1", axis="$a"), op("Concat", "x2", "y2", axis="$a"), axis="$b"),
    {"a": "dim", "b": "dim"}, [["$a", "!=", "$b"]], bind={"a": -2, "b": -1},
    shapes={"x1": S.of((2, 1)), "x2": S.of((2, 3)), "y1": S.of((3, 1)), "y2": S.of((3, 3))})
_ax("ReduceSum_partition_reduced", "reducesum_partition", "parallel",
    op("Reduce", op("ReduceSum", op("Partition", "x", dim="$a", degree="$k"), axes=("$a",), keepdims="$kd"),
       degree="$k"),
    op("ReduceSum", "x", axes=("$a",), keepdims="$kd"), {"a": "dim", "k": "degree", "kd": "attr"},
    bind={"a": -2, "k": 2, "kd": True}, shapes=X44)
_ax("ReduceSum_partition_kept", "reducesum_partition", "parallel",
    op("ReduceSum", op("Partition", "x", dim="$d", degree="$k"), axes=("$a",), keepdims=True),
    op("Partition", op("ReduceSum", "x", axes=("$a",), keepdims=True), dim="$d", degree="$k"),
    {**DK, "a": "dim"}, [["$d", "!=", "$a"]], bind={"a": -2, "d": -1, "k": 2}, shapes=X44)
_ax("ReduceSum_concat", "reducesum_concat", "algebraic",
    op("ReduceSum", op("Concat", "x", "y", axis="$a"), axes=("$a",), keepdims=True),
    op("Add", op("ReduceSum", "x", axes=("$a",), keepdims=True), op("ReduceSum", "y", axes=("$a",), keepdims=True)),
    {"a": "dim"}, bind={"a": -2}, shapes={"x": S.of((2, 4)), "y": S.of((3, 4))})
_ax("Softmax_partition", "softmax_partition", "parallel",
    op("Softmax", op("Partition", "x", dim="$d", degree="$k"), axis="$a"),
    op("Partition", op("Softmax", "x", axis="$a"), dim="$d", degree="$k"), {**DK, "a": "dim"},
    [["$d", "!=", "$a"]], bind={"d": -2, "k": 2, "a": -1}, shapes=X44)
_ax("Softmax_replicate", "softmax_replicate", "parallel",
    op("Softmax", op("Replicate", "x", degree="$k"), axis="$a"),
    op("Replicate", op("Softmax", "x", axis="$a"), degree="$k"), {"k": "degree", "a": "dim"},
    bind={"k": 2, "a": -1}, shapes=X44)
_ax("Split_partition", "split_partition", "parallel",
    tuple(op("Split", op("Partition", "x", dim="$d", degree="$k"), axis="$a", sizes="$s")[i] for i in range(2)),
    tuple(op("Partition", op("Split", "x", axis="$a", sizes="$s")[i], dim="$d", degree="$k") for i in range(2)),
    {**DK, "a": "dim", "s": "attr"}, [["$d", "!=", "$a"]], bind={"d": -2, "k": 2, "a": -1, "s": (1, 3)},
    shapes=X44)
_ax("LayerNorm_partition", "layernorm_partition", "parallel",
    op("LayerNorm", op("Partition", "x", dim="$d", degree="$k"), op("Replicate", "g", degree="$k"),
       op("Replicate", "b", degree="$k"), axis="$a", eps="$e"),
    op("Partition", op("LayerNorm", "x", "g", "b", axis="$a", eps="$e"), dim="$d", degree="$k"),
    {**DK, "a": "dim", "e": "attr"}, [["$d", "<", "$a"]], bind={"d": -2, "k": 2, "a": -1, "e": 1e-5},
    shapes={"x": S.of((4, 4)), "g": S.of((4,)), "b": S.of((4,))})
_ax("LayerNorm_replicate", "layernorm_replicate", "parallel",
    op("LayerNorm", op("Replicate", "x", degree="$k"), op("Replicate", "g", degree="$k"),
       op("Replicate", "b", degree="$k"), axis="$a", eps="$e"),
    op("Replicate", op("LayerNorm", "x", "g", "b", axis="$a", eps="$e"), degree="$k"),
    {"k": "degree", "a": "dim", "e": "attr"}, bind={"k": 2, "a": -1, "e": 1e-5},
    shapes={"x": S.of((4, 4)), "g": S.of((4,)), "b": S.of((4,))})

# --- sample-dim (data) parallelism of the remaining compute operators (dim 0 counted from the front) ---------
_SAMPLE: list[tuple[str, dict, dict, dict, str, tuple]] = [
    # op, attr pattern, example attrs, example shapes (first input partitioned, others replicated), values, ints
    ("Conv2d", {"stride": "$st", "padding": "$pad", "dilation": "$dil", "groups": "$g"},
     {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1},
     {"x": S.of((2, 2, 3, 3)), "w": S.of((2, 2, 3, 3))}, "float", ()),
    ("Pool2d", {"kind": "$kind", "kernel": "$ker", "stride": "$st", "padding": "$pad", "global_pool": "$gp",
                "count_include_pad": "$cip", "ceil_mode": "$cm"},
     {"kind": "max", "ker": (2, 2), "st": (2, 2), "pad": (0, 0, 0, 0), "gp": False, "cip": False, "cm": False},
     {"x": S.of((2, 2, 4, 4))}, "float", ()),
    ("LRN", {"size": "$sz", "alpha": "$al", "beta": "$be", "bias": "$bi"},
     {"sz": 3, "al": 1e-4, "be": 0.75, "bi": 1.0}, {"x": S.of((2, 4, 2, 2))}, "float", ()),
    ("BatchNorm", {"eps": "$e", "momentum": "$m"}, {"e": 1e-5, "m": 0.9},
     {"x": S.of((2, 3, 2, 2)), "s": S.of((3,)), "b": S.of((3,)), "mu": S.of((3,)), "var": S.of((3,))}, "pos", ()),
    ("Embedding", {}, {}, {"i": S.of((4, 2), dtype="int64"), "t": S.of((5, 3))}, "float", ("i",)),
    ("Gather", {"axis": "$a"}, {"a": 1}, {"x": S.of((2, 5)), "i": S.of((3,), dtype="int64")}, "float", ("i",)),
    ("Reshape", {"shape": "$sh"}, {"sh": (2, 6)}, {"x": S.of((2, 3, 2))}, "float", ()),
    ("Flatten", {"axis": "$a"}, {"a": 1}, {"x": S.of((2, 3, 2))}, "float", ()),
    ("ReduceMean", {"axes": ("$a",), "keepdims": "$kd"}, {"a": 1, "kd": True}, {"x": S.of((2, 3))}, "float", ()),
    ("ReduceSum", {"axes": ("$a",), "keepdims": "$kd"}, {"a": 1, "kd": False}, {"x": S.of((2, 3))}, "float", ()),
]
SAMPLE_OPS: dict[str, tuple] = {}
for _o, _pa, _ex, _shapes, _vk, _ints in _SAMPLE:
    names = list(_shapes)
    args_l = [op("Partition", names[0], dim=0, degree="$k")] + [op("Replicate", n, degree="$k") for n in names[1:]]
    V = {"k": "degree"}
    for v in _pa.values():
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, str) and x.startswith("$"):
                V[x[1:]] = "attr"
    cons = []
    if _o in ("Gather", "Flatten", "ReduceMean", "ReduceSum"):
        V["a"] = "fdim"
        cons = [["$a", ">=", 1]]
    SAMPLE_OPS[_o] = (_pa, _ex, _shapes, _vk, _ints, cons, V)
    _ax(f"{_o}_partition_sample", "sample_partition", "parallel", op(_o, *args_l, **_pa),
        op("Partition", op(_o, *names, **_pa), dim=0, degree="$k"), V, cons, bind={**_ex, "k": 2},
        shapes=_shapes, values=_vk, int_inputs=_ints)

# Transpose keeps the sample dim where its permutation fixes dim 0: one axiom per such permutation (a
# permutation is an attribute value, and constraints cannot look inside it)
TRANSPOSE_SAMPLE_PERMS = ((0, 2, 1), (0, 2, 1, 3), (0, 2, 3, 1), (0, 1, 3, 2), (0, 3, 1, 2), (0, 3, 2, 1))
for _p in TRANSPOSE_SAMPLE_PERMS:
    _ax("Transpose_partition_sample_" + "".join(map(str, _p)), "sample_partition", "parallel",
        op("Transpose", op("Partition", "x", dim=0, degree="$k"), perm=_p),
        op("Partition", op("Transpose", "x", perm=_p), dim=0, degree="$k"), {"k": "degree"}, (), bind={"k": 2},
        shapes={"x": S.of((2,) + tuple(range(2, len(_p) + 1)))})

# Megatron attention heads (Fig. 10): a Partition of a non-sample dim moves through a Transpose onto the
# permuted dim (one axiom per permutation and dim: constraints cannot look inside a permutation), and
# through a Reshape that splits the last dim into (heads, head size) or merges them back, where the
# partition lands on the outermost dim of the split group (the heads).  Partition does not change the
# logical value, so both sides always have the same value; a Reshape whose groups put the partition
# elsewhere gives the two sides different parallel shapes, which rule application refuses (DESIGN: shape
# side conditions are not in the axioms).
# Only the two moves the exported attention needs are axioms (the heads dim -2 of (b, s, heads, d) goes to
# -3 under perms 0213 and 0231); merging the heads back (Transpose 0213 then Reshape) is one axiom below.
# More Transpose/Partition axioms make Z3's e-matching loop: a bare Partition(x, d, k) covers every bound
# variable, so each such axiom fires on every Partition of its dim and builds nested Transposes (measured:
# with any other (perm, dim) pair added, megatron_attention_block times out).
for _p, _d in (((0, 2, 1, 3), -2), ((0, 2, 3, 1), -2)):
    _r = len(_p)
    _ax(f"Transpose_partition_{''.join(map(str, _p))}_d{_d}", "transpose_partition", "parallel",
        op("Transpose", op("Partition", "x", dim=_d, degree="$k"), perm=_p),
        op("Partition", op("Transpose", "x", perm=_p), dim=_p.index(_d + _r) - _r, degree="$k"), {"k": "degree"},
        (), bind={"k": 2}, shapes={"x": S.of(tuple(2 for _ in _p))})
_ax("Reshape_partition_split_last", "reshape_partition_heads", "parallel",
    op("Reshape", op("Partition", "x", dim=-1, degree="$k"), shape="$sh"),
    op("Partition", op("Reshape", "x", shape="$sh"), dim=-2, degree="$k"), {"k": "degree", "sh": "attr"},
    (), bind={"k": 2, "sh": (2, 2, 2)}, shapes={"x": S.of((2, 4))})
_ax("Reshape_Transpose_partition_merge_heads", "reshape_partition_heads", "parallel",
    op("Reshape", op("Transpose", op("Partition", "x", dim=-3, degree="$k"), perm=(0, 2, 1, 3)), shape="$sh"),
    op("Partition", op("Reshape", op("Transpose", "x", perm=(0, 2, 1, 3)), shape="$sh"), dim=-1, degree="$k"),
    {"k": "degree", "sh": "attr"}, (), bind={"k": 2, "sh": (2, 2, 4)}, shapes={"x": S.of((2, 2, 2, 2))})
_ax("Reshape_partition_merge_last", "reshape_partition_heads", "parallel",
    op("Reshape", op("Partition", "x", dim=-2, degree="$k"), shape="$sh"),
    op("Partition", op("Reshape", "x", shape="$sh"), dim=-1, degree="$k"), {"k": "degree", "sh": "attr"},
    (), bind={"k": 2, "sh": (2, 4)}, shapes={"x": S.of((2, 2, 2))})


# Megatron embedding (issue 7 point 1, DLRM): a table split by columns (its feature dim) over k devices, the
# indices replicated: each device looks up every index in its columns, so the output is partitioned on its
# last (feature) dim.  Rows (dim 0 of the table) cannot be split: the labels make the vocabulary unshardable
# (a row-sharded lookup would need masking and partial sums the registry's Embedding does not define).
_ax("Embedding_partition_table_cols", "embedding_partition_cols", "parallel",
    op("Embedding", op("Replicate", "i", degree="$k"), op("Partition", "t", dim=-1, degree="$k")),
    op("Partition", op("Embedding", "i", "t"), dim=-1, degree="$k"), {"k": "degree"},
    bind={"k": 2}, shapes={"i": S.of((4, 2), dtype="int64"), "t": S.of((5, 4))}, int_inputs=("i",))
# an additive mask broadcast along a partitioned dim (GPT's causal mask [S, S] added to the scores [B, heads, S, S]
# split by heads): each piece adds the whole mask.  Where the replicated operand does not broadcast along d the
# labels refuse the left side (its dim d has degree 1 against k), so the equation claims nothing there
_ax("Add_partition_broadcast", "binary_partition_broadcast", "parallel",
    op("Add", op("Partition", "x", dim="$d", degree="$k"), op("Replicate", "y", degree="$k")),
    op("Partition", op("Add", "x", "y"), dim="$d", degree="$k"), DK,
    bind={"d": -3, "k": 2}, shapes={"x": S.of((2, 2, 3, 3)), "y": S.of((3, 3))})
# computing on copies (BERT's position / token-type Embeddings over a constant [1, S] index: no batch dim to
# partition, so data parallelism runs them on every device): the lookup of replicated indices in a replicated
# table is the replicated lookup
_ax("Embedding_replicate", "embedding_replicate", "parallel",
    op("Embedding", op("Replicate", "i", degree="$k"), op("Replicate", "t", degree="$k")),
    op("Replicate", op("Embedding", "i", "t"), degree="$k"), {"k": "degree"},
    bind={"k": 2}, shapes={"i": S.of((1, 3), dtype="int64"), "t": S.of((5, 4))}, int_inputs=("i",))
# the view operators on copies (Megatron-LM's layout by rules: a head that reads one token of the residual stream,
# as BERT's pooler does with Slice then Reshape, runs its view on the tensor-parallel copies, so the Replicate of a
# column-parallel head lifts up to the residual stream): a view of a copied tensor is the copied view
VIEW_REPLICATE: dict[str, tuple[dict, dict, dict]] = {
    # op: (attr pattern, example attrs, example shapes)
    "Reshape": ({"shape": "$sh"}, {"sh": (2, 6)}, {"x": S.of((2, 3, 2))}),
    "Slice": ({"axes": "$ax", "starts": "$st", "ends": "$en", "steps": "$sp"},
              {"ax": (1,), "st": (0,), "en": (3,), "sp": (2,)}, {"x": S.of((2, 4))}),
    "Flatten": ({"axis": "$a"}, {"a": 1}, {"x": S.of((2, 3, 2))}),
    "Transpose": ({"perm": "$p"}, {"p": (1, 0)}, {"x": S.of((2, 3))}),
}
for _o, (_pa, _ex, _shapes) in VIEW_REPLICATE.items():
    _ax(f"{_o}_replicate", "view_replicate", "parallel", op(_o, op("Replicate", "x", degree="$k"), **_pa),
        op("Replicate", op(_o, "x", **_pa), degree="$k"), {"k": "degree", **_uvars(_pa)},
        bind={**_ex, "k": 2}, shapes=_shapes)
# a sum over a dim before the partitioned one (counted from the end) keeps the partition where it is, with or
# without keepdims (the bag sum of an embedding bag: ReduceSum over the bag dim -2 of (batch, bag, features))
_ax("ReduceSum_partition_after", "reducesum_partition", "parallel",
    op("ReduceSum", op("Partition", "x", dim="$d", degree="$k"), axes=("$a",), keepdims="$kd"),
    op("Partition", op("ReduceSum", "x", axes=("$a",), keepdims="$kd"), dim="$d", degree="$k"),
    {**DK, "a": "dim", "kd": "attr"}, [["$a", "<", "$d"]], bind={"a": -2, "d": -1, "k": 2, "kd": False},
    shapes={"x": S.of((2, 3, 4))})

# --- tensor parallelism operator by operator (issue 18) --------------------------------------------------
# What a layout -> rule sequence step needs to lay out a Llama decoder as Megatron-LM does (heads split, SwiGLU
# column/row, the residual stream on copies) one operator at a time, on any dim.  Stated in the Combine form
# (DESIGN "Verifier": ``Combine(op(P(x), R(y)), e) = op(x, y)``): the left side is the only trigger (it alone holds
# the degree and the dims), so each fires only on terms a rule builds.  Value: a valid parallelization computes the
# logical result and parallel operators keep the logical value, so the two sides agree wherever the left side is
# valid; a dim the labels cannot split (a sliced, normalized or broadcast dim) makes the left side invalid and the
# equation claims nothing there.
P = lambda t: op("Partition", t, dim="$d", degree="$k")  # noqa: E731
R = lambda t: op("Replicate", t, degree="$k")  # noqa: E731
C = lambda t: op("Combine", t, dim="$d", degree="$k")  # noqa: E731
for _b, (_lin, _vk) in BINARY.items():
    # one operand broadcast along the partitioned dim, replicated (the rotary cos/sin tables [S, D] multiplied into
    # the query heads [B, H, S, D] split by heads; the causal mask added to the scores)
    _ax(f"{_b}_combine_split_pr", "binary_combine_broadcast", "parallel", C(op(_b, P("x"), R("y"))),
        op(_b, "x", "y"), DK, bind={"d": -3, "k": 2}, shapes={"x": S.of((4, 2, 3)), "y": S.of((2, 3))}, values=_vk)
    if _b != "PRelu":   # PRelu's output has its first input's shape: the slope never carries more dims
        _ax(f"{_b}_combine_split_rp", "binary_combine_broadcast", "parallel", C(op(_b, R("x"), P("y"))),
            op(_b, "x", "y"), DK, bind={"d": -3, "k": 2}, shapes={"x": S.of((2, 3)), "y": S.of((4, 2, 3))},
            values=_vk)
# a view or a normalization on a partitioned dim it does not read across: Slice on another dim (the rotary halves of
# heads split by heads), Expand of a dim it does not broadcast (grouped-query K/V heads repeated, split by K/V
# heads: dims counted from the end, as broadcasting aligns them), RMSNorm over dims after the partitioned one
SPLIT_VIEWS: dict[str, tuple[dict, dict, dict]] = {
    # op: (attr pattern, example binding, example shapes (first input partitioned, others replicated))
    "Slice": ({"axes": "$ax", "starts": "$st", "ends": "$en", "steps": "$sp"},
              {"ax": (2,), "st": (2,), "en": (4,), "sp": (1,), "d": -3}, {"x": S.of((2, 4, 3, 4))}),
    "Expand": ({"shape": "$sh"}, {"sh": (2, 4, 3, 2), "d": -4}, {"x": S.of((2, 4, 1, 2))}),
    "RMSNorm": ({"axis": "$a", "eps": "$e"}, {"a": -1, "e": 1e-6, "d": -2}, {"x": S.of((2, 4, 3))}),
    "RMSNorm_scale": ({"axis": "$a", "eps": "$e"}, {"a": 2, "e": 1e-6, "d": -2},
                      {"x": S.of((2, 4, 3)), "s": S.of((3,))}),
}
for _name, (_pa, _ex, _shapes) in SPLIT_VIEWS.items():
    _o = _name.split("_")[0]
    _ns = list(_shapes)
    _args = [op("Partition", _ns[0], dim="$d", degree="$k")] + [op("Replicate", n, degree="$k") for n in _ns[1:]]
    _ax(f"{_name}_combine_split", "view_combine_split", "parallel",
        op("Combine", op(_o, *_args, **_pa), dim="$d", degree="$k"), op(_o, *_ns, **_pa), {**DK, **_uvars(_pa)},
        bind={**_ex, "k": 2}, shapes=_shapes)
# Transpose and Reshape move a partitioned dim (a Transpose to its permuted position, a Reshape that splits the hidden
# dim into (heads, head size) or merges them back, or inserts a unit dim, to the outermost dim of its group): where it
# lands depends on the permutation or on the shapes, which a constraint cannot read, so the landing dim ``e`` is a
# variable of its own, chosen at application; shape inference refuses every choice but the one where the partition
# lands (a Combine of a dim of degree 1 is invalid).  ``_sink``: a Combine after the op moved past it (the op then
# runs on the pieces); ``_lift``: a Partition of the op's output moved before it.  Neither side holds every variable,
# so Z3 instantiates them only where terms of both sides exist (a rule's two sides).  The values are exact wherever
# both sides are valid; the parallel shapes agree where ``e`` is the landing dim, the one choice application accepts
# when ``x`` carries no other partition of the same degree (with one, a wrong ``e`` can be valid and give another
# parallel shape, which application refuses as it refuses every changed output shape).
VIEW_MOVES: dict[str, tuple[dict, dict, dict]] = {
    # op: (attr pattern, example binding, example logical input shape)
    "Transpose": ({"perm": "$p"}, {"p": (0, 2, 1, 3), "d": -2, "e": -3}, (2, 3, 4, 2)),
    "Reshape": ({"shape": "$sh"}, {"sh": (2, 3, 2, 4), "d": -1, "e": -2}, (2, 3, 8)),
    # a CNN's head: the channels of (N, C, 1, 1), split, flattened into the features (N, C)
    "Flatten": ({"axis": "$a"}, {"a": 1, "d": -3, "e": -1}, (2, 4, 1, 1)),
}
_DEK = {"d": "dim", "e": "dim", "k": "degree"}
for _o, (_pa, _ex, _sz) in VIEW_MOVES.items():
    _r = len(_sz)
    _degs = tuple(2 if j == _ex["d"] + _r else 1 for j in range(_r))
    _ax(f"{_o}_combine_sink", "view_partition_move", "parallel",
        op(_o, op("Combine", "x", dim="$d", degree="$k"), **_pa),
        op("Combine", op(_o, "x", **_pa), dim="$e", degree="$k"), {**_DEK, **_uvars(_pa)},
        bind={**_ex, "k": 2}, shapes={"x": S.of(_sz, _degs)})
    _ax(f"{_o}_partition_lift", "view_partition_move", "parallel",
        op("Partition", op(_o, "x", **_pa), dim="$e", degree="$k"),
        op(_o, op("Partition", "x", dim="$d", degree="$k"), **_pa), {**_DEK, **_uvars(_pa)},
        bind={**_ex, "k": 2}, shapes={"x": S.of(_sz)})
# the residual stream of a Llama decoder on the tensor-parallel copies (Megatron-LM): its RMSNorms run on the copies
for _name, _shapes in (("RMSNorm", {"x": S.of((2, 3))}), ("RMSNorm_scale", {"x": S.of((2, 3)), "s": S.of((3,))})):
    _ns = list(_shapes)
    _ax(f"{_name}_replicate", "rmsnorm_replicate", "parallel",
        op("RMSNorm", *[op("Replicate", n, degree="$k") for n in _ns], axis="$a", eps="$e"),
        op("Replicate", op("RMSNorm", *_ns, axis="$a", eps="$e"), degree="$k"),
        {"k": "degree", "a": "attr", "e": "attr"}, bind={"k": 2, "a": -1, "e": 1e-6}, shapes=_shapes)

# --- data parallelism of the import-coverage operators (issue 10) ------------------------------------------
# One entry per dp template (rule name -> spec) and one ``sample_partition`` axiom that proves it: the
# operator on its inputs partitioned on dim 0 (the sample dim) or replicated equals its output partitioned
# on dim 0.  Attribute-dependent cases need no constraint beyond those written (a reduced, scanned, tiled,
# padded, resized or sliced dim 0; a gather or scatter along dim 0; an operand that does not broadcast along
# dim 0 but is replicated): the operator's labels make such an input unshardable or its degrees mismatch,
# so the left side is not a valid parallelization and the equation claims nothing there (DESIGN: "=" holds
# where both sides are valid; the self-check runs each at its example).  Einsum and Expand, whose output's
# sample dim depends on an attribute, are stated in the Combine form (below).  An axis attribute is a plain
# ``attr`` variable, not a constrained ``fdim``: the
# matcher normalizes only the dim attributes of ``substitutions.rule.DIM_ATTRS`` (the core operators'), so
# ``axis=-1`` would not satisfy ``a >= 1``; an axis 0 is refused by the labels instead (LogSoftmax, CumSum,
# GatherElements and ScatterElements make their axis unshardable).

@dataclass(frozen=True)
class SampleRule:
    """A data-parallel template: ``op(inputs)`` -> ``Combine(op(Partition or Replicate of each), 0)``."""
    op: str
    attrs: Mapping[str, Any]          # attribute pattern
    example: Mapping[str, Any]        # example values of the variables (the degree k is added)
    shapes: Mapping[str, S]           # input name -> example shape (dim 0 the sample dim)
    parts: tuple[bool, ...]           # per input: True = Partition(dim 0), False = Replicate
    values: str = "float"
    ints: tuple[str, ...] = ()
    cons: tuple = ()
    vars: Mapping[str, str] = field(default_factory=dict)


SAMPLE_RULES: dict[str, SampleRule] = {}


def _sample_rule(name: str, o: str, attrs: dict, example: dict, shapes: dict, parts=None, values: str = "float",
                 ints=(), cons=(), kinds=None, combine: bool = False) -> None:
    """``combine``: state the axiom as ``Combine(op(parts..), 0) = op(inputs)`` instead of ``op(parts..) =
    Partition(op(inputs), 0)`` (the same claim, as Combine undoes Partition): its right side then lacks the
    degree, so Z3 can trigger it only on its left side.  Used for operators that already have other axioms,
    whose e-matching the ``Partition(op(x, y))`` form sends into a loop (measured: dp_Mul_pr timed out with the
    Mul_reduce_lhs/rhs and Mul_partition axioms in its relevant set)."""
    V = {"k": "degree"}
    for v in attrs.values():
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, str) and x.startswith("$"):
                V[x[1:]] = "attr"
    V.update(kinds or {})
    names = list(shapes)
    parts = tuple(parts) if parts is not None else (True,) + (False,) * (len(names) - 1)
    SAMPLE_RULES[name] = SampleRule(o, dict(attrs), dict(example), dict(shapes), parts, values, tuple(ints),
                                    tuple(tuple(c) for c in cons), V)
    args = [op("Partition", n, dim=0, degree="$k") if p else op("Replicate", n, degree="$k")
            for n, p in zip(names, parts)]
    if combine:
        _ax(f"{name[3:]}_combine_sample", "sample_combine", "parallel",
            op("Combine", op(o, *args, **attrs), dim=0, degree="$k"), op(o, *names, **attrs), V,
            [list(c) for c in cons], bind={**example, "k": 2}, shapes=shapes, values=values, int_inputs=ints)
        return
    _ax(f"{name[3:]}_partition_sample", "sample_partition", "parallel", op(o, *args, **attrs),
        op("Partition", op(o, *names, **attrs), dim=0, degree="$k"), V, [list(c) for c in cons],
        bind={**example, "k": 2}, shapes=shapes, values=values, int_inputs=ints)


_B44 = S.of((4, 4), dtype="bool")
_B14 = S.of((1, 4), dtype="bool")
# boolean logic (bool inputs): Not, and And/Or/Xor with both operands or one broadcast operand replicated
_sample_rule("dp_Not", "Not", {}, {}, {"x": _B44})
for _o in ("And", "Or", "Xor"):
    _sample_rule(f"dp_{_o}", _o, {}, {}, {"x": _B44, "y": _B44}, (True, True))
    _sample_rule(f"dp_{_o}_pr", _o, {}, {}, {"x": _B44, "y": _B14}, (True, False))
    _sample_rule(f"dp_{_o}_rp", _o, {}, {}, {"x": _B14, "y": _B44}, (False, True))
# the float-input binary operators added above (dp_<Op> partitions both): one operand broadcast along dim 0
# (a PRelu slope, a comparison with a per-feature threshold) is replicated
for _o in ("PRelu", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
    _sample_rule(f"dp_{_o}_pr", _o, {}, {}, {"x": S.of((4, 4)), "y": S.of((1, 4))}, (True, False))
    if _o != "PRelu":   # PRelu's output has the input's shape: its input never broadcasts
        _sample_rule(f"dp_{_o}_rp", _o, {}, {}, {"x": S.of((1, 4)), "y": S.of((4, 4))}, (False, True))
# the core binary operators likewise: a bias, a per-channel scale (GroupNorm as exported: InstanceNorm then Mul
# and Add by (C, 1, ...) weights) or a mask broadcast along dim 0 is replicated
for _o, (_lin, _vk) in list(BINARY.items())[:7]:
    _sample_rule(f"dp_{_o}_pr", _o, {}, {}, {"x": S.of((4, 4)), "y": S.of((1, 4))}, (True, False), values=_vk,
                 combine=True)
    _sample_rule(f"dp_{_o}_rp", _o, {}, {}, {"x": S.of((1, 4)), "y": S.of((4, 4))}, (False, True), values=_vk,
                 combine=True)
# Where(cond, x, y): every pattern of partitioned (full) and replicated (broadcast along dim 0) operands
for _m in range(1, 8):
    _pp = tuple(bool(_m >> (2 - j) & 1) for j in range(3))
    _sh = {n: S.of((4, 4) if p else (1, 4), dtype="bool" if n == "c" else "float32")
           for n, p in zip(("c", "x", "y"), _pp)}
    _sample_rule("dp_Where" + ("" if all(_pp) else "_" + "".join("p" if p else "r" for p in _pp)), "Where", {}, {},
                 _sh, _pp)
_sample_rule("dp_LogSoftmax", "LogSoftmax", {"axis": "$a"}, {"a": -1}, {"x": S.of((2, 3))})
for _o in ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp"):
    _sample_rule(f"dp_{_o}", _o, {"axes": "$ax", "keepdims": "$kd"}, {"ax": (1,), "kd": False}, {"x": S.of((2, 3))})
_CONV = {"stride": "$st", "padding": "$pad", "dilation": "$dil", "groups": "$g"}
_ex3 = {"st": (1, 1, 1), "pad": (0, 1, 0, 0, 1, 0), "dil": (1, 1, 1), "g": 1}
# a 2-D convolution with its bias (DenseNet-121's classifier, a 1x1 Conv with bias, as the onnx wheel exports it)
_sample_rule("dp_Conv2d_bias", "Conv2d", _CONV, {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1},
             {"x": S.of((2, 2, 3, 3)), "w": S.of((2, 2, 3, 3)), "b": S.of((2,))})
_sample_rule("dp_Conv3d", "Conv3d", _CONV, _ex3, {"x": S.of((2, 2, 3, 3, 3)), "w": S.of((2, 2, 2, 2, 2))})
_sample_rule("dp_Conv3d_bias", "Conv3d", _CONV, _ex3,
             {"x": S.of((2, 2, 3, 3, 3)), "w": S.of((2, 2, 2, 2, 2)), "b": S.of((2,))})
_POOL = {"kind": "$kind", "kernel": "$ker", "stride": "$st", "padding": "$pad", "dilation": "$dil",
         "global_pool": "$gp", "count_include_pad": "$cip", "ceil_mode": "$cm"}
_sample_rule("dp_Pool1d", "Pool1d", _POOL, {"kind": "max", "ker": (2,), "st": (2,), "pad": (0, 0), "dil": (1,),
                                            "gp": False, "cip": False, "cm": False}, {"x": S.of((2, 2, 4))})
_sample_rule("dp_Pool3d", "Pool3d", _POOL, {"kind": "avg", "ker": (2, 2, 2), "st": (2, 2, 2), "pad": (0,) * 6,
                                            "dil": (1, 1, 1), "gp": False, "cip": False, "cm": False},
             {"x": S.of((2, 2, 2, 2, 4))})
_CT = {"stride": "$st", "padding": "$pad", "dilation": "$dil", "output_padding": "$op", "groups": "$g"}
_exct = {"st": (2, 1), "pad": (0, 0, 1, 0), "dil": (1, 1), "op": (0, 0), "g": 1}
_sample_rule("dp_ConvTranspose", "ConvTranspose", _CT, _exct, {"x": S.of((2, 2, 3, 3)), "w": S.of((2, 2, 2, 2))})
_sample_rule("dp_ConvTranspose_bias", "ConvTranspose", _CT, _exct,
             {"x": S.of((2, 2, 3, 3)), "w": S.of((2, 2, 2, 2)), "b": S.of((2,))})
_sample_rule("dp_InstanceNorm", "InstanceNorm", {"eps": "$e"}, {"e": 1e-5},
             {"x": S.of((2, 3, 2, 2)), "s": S.of((3,)), "b": S.of((3,))})
_sample_rule("dp_GroupNorm", "GroupNorm", {"groups": "$gr", "eps": "$e"}, {"gr": 2, "e": 1e-5},
             {"x": S.of((2, 4, 2, 2)), "s": S.of((4,)), "b": S.of((4,))})
_sample_rule("dp_Resize", "Resize", {"sizes": "$sz", "scales": "$sc", "mode": "$m", "coordinate_mode": "$cmode",
                                     "nearest_mode": "$nm"},
             {"sz": (2, 2, 4, 3), "sc": (1.0, 1.0, 2.0, 1.5), "m": "linear", "cmode": "half_pixel",
              "nm": "round_prefer_floor"}, {"x": S.of((2, 2, 2, 2))})
_sample_rule("dp_Pad", "Pad", {"pads": "$p", "mode": "$m", "value": "$v"}, {"p": (0, 1, 0, 2), "m": "reflect", "v": 0.0},
             {"x": S.of((2, 3))})
_sample_rule("dp_Tile", "Tile", {"repeats": "$r"}, {"r": (1, 2)}, {"x": S.of((2, 3))})
_sample_rule("dp_Trilu", "Trilu", {"upper": "$u", "k": "$kk"}, {"u": True, "kk": 0}, {"x": S.of((2, 3, 3))})
_sample_rule("dp_CumSum", "CumSum", {"axis": "$a", "exclusive": "$ex", "reverse": "$rev"},
             {"a": -1, "ex": True, "rev": True}, {"x": S.of((2, 3))})
_sample_rule("dp_Slice", "Slice", {"axes": "$ax", "starts": "$st", "ends": "$en", "steps": "$sp"},
             {"ax": (1,), "st": (0,), "en": (3,), "sp": (2,)}, {"x": S.of((2, 4))})
_sample_rule("dp_RMSNorm", "RMSNorm", {"axis": "$a", "eps": "$e"}, {"a": -1, "e": 1e-6}, {"x": S.of((2, 3))})
_sample_rule("dp_RMSNorm_scale", "RMSNorm", {"axis": "$a", "eps": "$e"}, {"a": 1, "e": 1e-6},
             {"x": S.of((2, 3, 2)), "s": S.of((3, 2))})
_sample_rule("dp_GatherElements", "GatherElements", {"axis": "$a"}, {"a": 1},
             {"x": S.of((2, 3)), "i": S.of((2, 2), dtype="int64")}, (True, True), ints=("i",))
# GatherND: the index rows are the sample dim (batch_dims 0, the data replicated), or a batch dim is
_sample_rule("dp_GatherND", "GatherND", {"batch_dims": "$b"}, {"b": 0},
             {"x": S.of((3, 2)), "i": S.of((4, 1), dtype="int64")}, (False, True), ints=("i",))
_sample_rule("dp_GatherND_batch", "GatherND", {"batch_dims": "$b"}, {"b": 1},
             {"x": S.of((2, 3, 2)), "i": S.of((2, 2, 1), dtype="int64")}, (True, True), ints=("i",))
_sample_rule("dp_ScatterElements", "ScatterElements", {"axis": "$a", "reduction": "$red"}, {"a": 1, "red": "none"},
             {"x": S.of((2, 3)), "i": S.of((2, 2), dtype="int64"), "u": S.of((2, 2))}, (True, True, True),
             ints=("i",))
# Einsum and Expand: where the input's dim 0 lands in the output depends on the equation or on a rank raise,
# which a constraint cannot read.  So they are stated in the Combine form, ``Combine(op(parts..), 0) =
# op(inputs)``, which claims something only where its left side is valid: the output's dim 0 must carry
# exactly the degree the Combine removes, i.e. the partitioned input dim 0 went to output dim 0.  A subscript
# summed over (partial sums), moved elsewhere (a transposing equation, a rank-raising Expand), shared with a
# replicated operand or two partitioned operands' subscripts landing on two output dims leave the output with
# another parallel shape, and the Combine (or the Einsum itself) is refused.  ScatterND gets no rule: its
# index tuples always address dim 0 of the data (the labels make it unshardable).
_sample_rule("dp_Einsum", "Einsum", {"equation": "$eq"}, {"eq": "bij->bji"}, {"x": S.of((4, 2, 3))}, combine=True)
_sample_rule("dp_Einsum_pr", "Einsum", {"equation": "$eq"}, {"eq": "bij,jk->bik"},
             {"x": S.of((4, 2, 3)), "y": S.of((3, 2))}, (True, False), combine=True)
_sample_rule("dp_Einsum_rp", "Einsum", {"equation": "$eq"}, {"eq": "jk,bij->bik"},
             {"x": S.of((3, 2)), "y": S.of((4, 2, 3))}, (False, True), combine=True)
_sample_rule("dp_Einsum_pp", "Einsum", {"equation": "$eq"}, {"eq": "bij,bjk->bik"},
             {"x": S.of((4, 2, 3)), "y": S.of((4, 3, 2))}, (True, True), combine=True)
_sample_rule("dp_Expand", "Expand", {"shape": "$sh"}, {"sh": (4, 3)}, {"x": S.of((4, 1))}, combine=True)


# --- channel parallelism of convolutional networks (issue 18: the ILP's CNN layouts by rules) ----------------
# A convolution split on its output channels (the weight's dim 0 and the bias split, the input copied: each device
# computes its channels), on its input channels (input and weight split on dim 1: partial sums, then Reduce; the
# labels refuse it with a bias, which would be added to every partial sum), a grouped or depthwise convolution
# with its groups split together with the channels (input dim 1 and weight dim 0: each device holds whole groups;
# the labels refuse it for groups=1, where input and output channels differ), BatchNorm with its per-channel
# parameters split with the channels, Pool2d and Conv2d on any dim the labels allow (the sample dim, a spatial dim
# whose windows do not cross pieces, Pool2d's channels), and these operators on copies.  Stated in the Combine form
# (the left side the only trigger), dims literal and counted from the front (NCHW, OIHW): the sides agree wherever
# the left side is a valid parallelization, and where the labels refuse it the equation claims nothing.
CONV_ATTRS = {"stride": "$st", "padding": "$pad", "dilation": "$dil", "groups": "$g"}
POOL_ATTRS = {"kind": "$kind", "kernel": "$ker", "stride": "$st", "padding": "$pad", "global_pool": "$gp",
              "count_include_pad": "$cip", "ceil_mode": "$cm"}
_CV = {"k": "degree", "st": "attr", "pad": "attr", "dil": "attr", "g": "attr"}
_cex = {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1, "k": 2}
_P1 = lambda t, d: op("Partition", t, dim=d, degree="$k")  # noqa: E731
_C1 = lambda t, d: op("Combine", t, dim=d, degree="$k")  # noqa: E731
_R1 = lambda t: op("Replicate", t, degree="$k")  # noqa: E731
_X = S.of((2, 4, 3, 3))
#: the channel-parallel convolution templates: name -> (inputs: per input its Partition dim or None = copied,
#: output: the Combine dim or "sum" (a Reduce of partial sums), example binding, example shapes)
CONV_CHANNEL: dict[str, tuple[tuple, Any, dict, dict]] = {
    "out_channels": ((None, 0), 1, _cex, {"x": _X, "w": S.of((4, 4, 3, 3))}),
    "out_channels_bias": ((None, 0, 0), 1, _cex, {"x": _X, "w": S.of((4, 4, 3, 3)), "b": S.of((4,))}),
    "in_channels": ((1, 1), "sum", _cex, {"x": _X, "w": S.of((2, 4, 3, 3))}),
    "groups": ((1, 0), 1, {**_cex, "g": 2}, {"x": _X, "w": S.of((6, 2, 3, 3))}),
    "groups_bias": ((1, 0, 0), 1, {**_cex, "g": 4}, {"x": _X, "w": S.of((4, 1, 3, 3)), "b": S.of((4,))}),
}
for _n, (_parts, _out, _ex, _shapes) in CONV_CHANNEL.items():
    _ns = list(_shapes)
    _inner = op("Conv2d", *[_R1(n) if d is None else _P1(n, d) for n, d in zip(_ns, _parts)], **CONV_ATTRS)
    _lhs = op("Reduce", _inner, degree="$k") if _out == "sum" else _C1(_inner, _out)
    _ax(f"Conv2d_{_n}_combine_split", "conv_channel_split", "parallel", _lhs, op("Conv2d", *_ns, **CONV_ATTRS), _CV,
        bind=_ex, shapes=_shapes)
# Conv2d and Pool2d on any dim their labels allow, the weight copied (the sample dim; a spatial dim whose windows
# do not cross pieces: 1x1 convolutions, 2x2/2 pooling; Pool2d's channels)
WINDOW_SPLIT: dict[str, tuple[dict, dict, dict]] = {
    # name: (attr pattern, example binding, example shapes (first input partitioned, the others copied))
    "Conv2d": (CONV_ATTRS, {**_cex, "pad": (0, 0, 0, 0), "d": -1},
               {"x": S.of((2, 2, 4, 4)), "w": S.of((3, 2, 1, 1))}),
    "Conv2d_bias": (CONV_ATTRS, {**_cex, "pad": (0, 0, 0, 0), "d": -2},
                    {"x": S.of((2, 2, 4, 4)), "w": S.of((3, 2, 1, 1)), "b": S.of((3,))}),
    "Pool2d": (POOL_ATTRS, {"kind": "max", "ker": (2, 2), "st": (2, 2), "pad": (0, 0, 0, 0), "gp": False,
                           "cip": False, "cm": False, "d": -3, "k": 2}, {"x": S.of((2, 4, 4, 4))}),
}
for _name, (_pa, _ex, _shapes) in WINDOW_SPLIT.items():
    _o = _name.split("_")[0]
    _ns = list(_shapes)
    _ax(f"{_name}_combine_split", "window_combine_split", "parallel",
        op("Combine", op(_o, op("Partition", _ns[0], dim="$d", degree="$k"), *[_R1(n) for n in _ns[1:]], **_pa),
           dim="$d", degree="$k"), op(_o, *_ns, **_pa), {**DK, **_uvars(_pa)}, bind=_ex, shapes=_shapes)
_BN = {"x": S.of((2, 4, 2, 2)), "s": S.of((4,)), "b": S.of((4,)), "mu": S.of((4,)), "var": S.of((4,))}
_ax("BatchNorm_channels_combine_split", "batchnorm_channel_split", "parallel",
    _C1(op("BatchNorm", _P1("x", 1), *[_P1(n, 0) for n in ("s", "b", "mu", "var")], eps="$e", momentum="$m"), 1),
    op("BatchNorm", "x", "s", "b", "mu", "var", eps="$e", momentum="$m"), {"k": "degree", "e": "attr", "m": "attr"},
    bind={"k": 2, "e": 1e-5, "m": 0.9}, shapes=_BN, values="pos")
# on copies: an operator of copied inputs is the copied operator (a layer the ILP computes on every device of an
# axis, between channel-parallel layers)
CNN_REPLICATE: dict[str, tuple[str, dict, dict, dict, str]] = {
    # name: (op, attr pattern, example binding, example shapes, values)
    "Conv2d": ("Conv2d", CONV_ATTRS, _cex, {"x": _X, "w": S.of((4, 4, 3, 3))}, "float"),
    "Conv2d_bias": ("Conv2d", CONV_ATTRS, _cex, {"x": _X, "w": S.of((4, 4, 3, 3)), "b": S.of((4,))}, "float"),
    "BatchNorm": ("BatchNorm", {"eps": "$e", "momentum": "$m"}, {"k": 2, "e": 1e-5, "m": 0.9}, _BN, "pos"),
    "Pool2d": ("Pool2d", POOL_ATTRS, {"kind": "avg", "ker": (2, 2), "st": (1, 1), "pad": (0, 0, 0, 0), "gp": False,
                                      "cip": False, "cm": False, "k": 2}, {"x": S.of((2, 2, 3, 3))}, "float"),
}
for _name, (_o, _pa, _ex, _shapes, _vk) in CNN_REPLICATE.items():
    _ns = list(_shapes)
    _ax(f"{_name}_replicate", "cnn_replicate", "parallel", op(_o, *[_R1(n) for n in _ns], **_pa),
        _R1(op(_o, *_ns, **_pa)), {"k": "degree", **_uvars(_pa)}, bind=_ex, shapes=_shapes, values=_vk)

AXIOMS: tuple[Axiom, ...] = tuple(_AXIOMS)


def by_name() -> dict[str, Axiom]:
    return {a.name: a for a in AXIOMS}


def schemas() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a in AXIOMS:
        out.setdefault(a.schema, []).append(a.name)
    return out


def counts() -> dict[str, int]:
    sch = schemas()
    par = {a.schema for a in AXIOMS if a.group == "parallel"}
    return {"axioms": len(AXIOMS), "axiom_schemas": len(sch), "parallel_axiom_schemas": len(par),
            "algebraic_axiom_schemas": len(sch) - len(par),
            "parallel_axioms": sum(1 for a in AXIOMS if a.group == "parallel")}
