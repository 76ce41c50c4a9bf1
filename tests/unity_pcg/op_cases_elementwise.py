"""Case generators for the operators of :mod:`unity_pcg.ops.elementwise` (merged into op_cases.GENERATORS)."""
from __future__ import annotations

from .op_cases import Case, Drawer, _bcast_partner, _shape

# unary operators without attributes, and how to fill their input (HardSwish: integers in [-5, 5], so that
# both bends at -3 and 3 are crossed)
UNARY_FILL = {"Silu": "normal", "GeluTanh": "normal", "Softplus": "normal", "Softsign": "normal",
              "Mish": "normal", "HardSwish": "int", "Abs": "normal", "Log": "positive"}
# unary operators with attributes: values to draw for each (the first of each is the ONNX default)
UNARY_ATTRS = {
    "LeakyRelu": {"alpha": [0.01, 0.2, -0.5, 1.5]},
    "Elu": {"alpha": [1.0, 0.5, 2.0]},
    "Selu": {"alpha": [1.67326319217681884765625, 1.0], "gamma": [1.05070102710723876953125, 2.0]},
    "Celu": {"alpha": [1.0, 0.5, 3.0]},
    "HardSigmoid": {"alpha": [0.2, 1 / 6, -0.5], "beta": [0.5, 0.0, 1.0]},
}
REDUCE = ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp")


def _float(d: Drawer) -> str:
    return d.choice(["float64", "float64", "float32"])


def gen_unary(op):
    def g(d: Drawer) -> Case:
        fill = UNARY_FILL[op]
        return Case(op, {}, [_shape(d, 0, 4)], [_float(d)], [fill])
    return g


def gen_unary_attrs(op):
    def g(d: Drawer) -> Case:
        attrs = {k: d.choice(v) for k, v in UNARY_ATTRS[op].items() if d.bool(0.7)}
        return Case(op, attrs, [_shape(d, 0, 4)], [_float(d)], ["normal"])
    return g


def gen_prelu(d: Drawer) -> Case:
    x = _shape(d, 1, 4)
    if len(x) >= 2 and d.bool():   # the usual per-channel slope: [C] on NC or [C, 1, 1] on NCHW
        slope = [x[1]] + [1] * (len(x) - 2)
    else:
        slope = _bcast_partner(d, x)
    dt = _float(d)
    return Case("PRelu", {}, [x, slope], [dt, dt], ["normal", "normal"])


def gen_log_softmax(d: Drawer) -> Case:
    s = _shape(d, 1, 4)
    ax = d.int(-len(s), len(s) - 1)
    return Case("LogSoftmax", {"axis": ax}, [s], [_float(d)], ["normal"])


def gen_reduce(op):
    def g(d: Drawer) -> Case:
        # a product of many elements over/underflows, and one of integers in [-5, 5] is mostly 0: keep
        # products short and of floats away from 0
        s = _shape(d, 1, 4, max_numel=32 if op == "ReduceProd" else 256)
        axes = d.subset(range(len(s)))
        axes = [a - len(s) if d.bool(0.3) else a for a in axes]
        if axes and d.bool(0.2):   # ONNX allows naming an axis twice (r-1 and -1)
            axes.append(axes[0] - len(s) if axes[0] >= 0 else axes[0] + len(s))
        integer = op in ("ReduceMax", "ReduceMin") and d.bool(0.25)
        dt = "int64" if integer else _float(d)
        fill = "int" if integer else "nonzero" if op == "ReduceProd" else "normal"
        return Case(op, {"axes": tuple(axes), "keepdims": d.bool()}, [s], [dt], [fill])
    return g


def gen_rms_norm(d: Drawer) -> Case:
    s = _shape(d, 1, 4)
    ax = d.int(-len(s), len(s) - 1)
    k = d.int(0, 1)
    norm = s[ax % len(s):]
    dt = _float(d)
    return Case("RMSNorm", {"axis": ax, "eps": d.choice([1e-6, 1e-5, 0.1])}, [s] + [norm] * k, [dt] * (1 + k),
                ["normal"] * (1 + k))


GENERATORS: dict = {
    **{op: gen_unary(op) for op in UNARY_FILL},
    **{op: gen_unary_attrs(op) for op in UNARY_ATTRS},
    "PRelu": gen_prelu, "LogSoftmax": gen_log_softmax, "RMSNorm": gen_rms_norm,
    **{op: gen_reduce(op) for op in REDUCE},
}
