"""Case generators for the operators of :mod:`unity_pcg.ops.elementwise` (merged into op_cases.GENERATORS)."""
from __future__ import annotations

from .op_cases import Case, Drawer, _shape

# unary operators without attributes, and how to fill their input
UNARY_FILL = {"Silu": "normal", "GeluTanh": "normal"}


def gen_unary(op):
    def g(d: Drawer) -> Case:
        return Case(op, {}, [_shape(d, 0, 4)], [d.choice(["float64", "float64", "float32"])], [UNARY_FILL[op]])
    return g


GENERATORS: dict = {
    **{op: gen_unary(op) for op in UNARY_FILL},
}
