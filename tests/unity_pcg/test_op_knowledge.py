"""Operator knowledge lives in the operator registry (DESIGN "Operator spec"): every compute operator states its
cost class, what torch.autocast does with it, what it saves for its backward pass and which inputs get no
gradient, and the cost model, memory model and executor read these from its entry (no name tables)."""
from __future__ import annotations

import pytest

from unity_pcg import ops
from unity_pcg.errors import UnknownOperator
from unity_pcg.ops.base import OpSpec, Saves
from unity_pcg.shape import ParallelTensorShape
from unity_pcg.search.cost import OP_CLASSES, op_class


def _max_inputs(spec: OpSpec) -> int:
    n = spec.num_inputs
    return n if isinstance(n, int) else n[1]


def knowledge_problems(specs) -> list[str]:
    """One line per thing a compute operator's registry entry lacks or states wrongly."""
    out = []
    for spec in specs:
        if spec.kind != "compute":
            continue
        for field in ("cost_class", "autocast", "saves"):
            if getattr(spec, field) is None:
                out.append(f"{spec.name}: no {field}")
        c = spec.cost_class
        if c is not None:
            cls = c(None) if callable(c) else c
            if cls not in OP_CLASSES:
                out.append(f"{spec.name}: cost class {cls!r} is not one of {OP_CLASSES}")
        if spec.autocast is not None and spec.autocast not in ops.AUTOCAST_MODES:
            out.append(f"{spec.name}: autocast {spec.autocast!r} is not one of {ops.AUTOCAST_MODES}")
        n = _max_inputs(spec)
        if spec.saves is not None:
            if not isinstance(spec.saves, Saves):
                out.append(f"{spec.name}: saves must be a Saves, got {spec.saves!r}")
            elif spec.saves.inputs != ops.ALL and any(not 0 <= p < n for p in spec.saves.inputs):
                out.append(f"{spec.name}: saves input positions {sorted(spec.saves.inputs)} of a {n}-input operator")
        if any(not 0 <= p < n for p in spec.nondiff_inputs):
            out.append(f"{spec.name}: non-differentiable inputs {spec.nondiff_inputs} of a {n}-input operator")
    return out


def test_every_compute_operator_states_its_knowledge():
    problems = knowledge_problems(ops.REGISTRY.values())
    assert not problems, "operator registry entries without cost/memory knowledge:\n" + "\n".join(problems)


def test_the_check_names_an_operator_that_lacks_knowledge():
    """A new operator registered without the fields is reported by name (the check above can fail), and the
    cost model refuses to price it rather than calling it "default"."""
    relu = ops.get_op("Relu")
    bare = OpSpec(name="NewOp", kind="compute", attrs={}, infer=relu.infer, forward=relu.forward)
    problems = knowledge_problems([bare])
    assert problems == ["NewOp: no cost_class", "NewOp: no autocast", "NewOp: no saves"]
    wrong = OpSpec(name="Odd", kind="compute", attrs={}, infer=relu.infer, forward=relu.forward,
                   cost_class="gemm", autocast="bf16", saves=Saves({1}), nondiff_inputs=(2,))
    assert [p.split(":")[0] for p in knowledge_problems([wrong])] == ["Odd"] * 4
    ops.base.REGISTRY["NewOp"] = bare
    try:
        with pytest.raises(AssertionError, match="NewOp.*cost_class"):
            op_class("NewOp")
        with pytest.raises(AssertionError, match="NewOp.*saves"):
            ops.saves("NewOp")
    finally:
        del ops.base.REGISTRY["NewOp"]


def test_shape_dependent_classes():
    x = ParallelTensorShape.of((2, 8, 6, 6))
    assert op_class("Conv2d", [x, ParallelTensorShape.of((4, 8, 1, 1))]) == "conv1x1"
    assert op_class("Conv2d", [x, ParallelTensorShape.of((4, 2, 3, 3))]) == "conv_grouped"
    assert op_class("Conv2d", [x, ParallelTensorShape.of((4, 8, 3, 3))]) == "conv"
    a, b = ParallelTensorShape.of((2, 3, 4)), ParallelTensorShape.of((2, 4, 5))
    assert op_class("MatMul", [a, b]) == "bmm"
    assert op_class("MatMul", [a, ParallelTensorShape.of((4, 5))]) == "matmul"
    assert op_class("Partition") == "default"       # parallel operators have no class of their own


def test_models_read_the_registry():
    """The tables the models use are views of the registry entries, not lists of their own."""
    from unity_pcg.executor import lower
    from unity_pcg.search import cost, memory
    assert cost.NON_DIFFERENTIABLE == lower.NON_DIFFERENTIABLE == {("BatchNorm", 3), ("BatchNorm", 4)}
    for name, spec in ops.REGISTRY.items():
        s = ops.saves(name)
        assert (name in memory.SAVES_OUTPUT) == s.output
        assert memory.SAVES_INPUTS.get(name) == (None if s.inputs == ops.ALL else set(s.inputs))
    assert ops.saves("Dropout").mask and not any(ops.saves(n).mask for n in ops.REGISTRY if n != "Dropout")
    # autocast: the lower-precision list writes bf16, the fp32 list fp32, the others follow their inputs
    ad = cost.autocast_dtype
    assert ad("Linear", "float32", ["float32", "float32"], [2, 2]) == "bfloat16"
    assert ad("Softmax", "float32", ["bfloat16"], [2]) == "float32"
    assert ad("Add", "float32", ["bfloat16", "float32"], [2, 0]) == "bfloat16"      # a 0-d operand does not widen
    assert ad("Add", "float32", ["bfloat16", "float32"], [2, 2]) == "float32"
    assert ad("BatchNorm", "float32", ["bfloat16", "float32"], [4, 1]) == "bfloat16"  # follows its data input
    assert ad("Cast", "float32", ["bfloat16"], [2]) == "float32"                      # its declared dtype


def test_unknown_operator_is_refused():
    with pytest.raises(UnknownOperator):
        op_class("NoSuchOp")
