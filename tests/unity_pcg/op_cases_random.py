"""Case generators for the random generators of :mod:`unity_pcg.ops.random_gen` (merged into op_cases.GENERATORS).
They have no input: their one task draws the whole output; a plan splits it with parallel operators after them."""
from __future__ import annotations

from .op_cases import Case, Drawer, _shape


def gen_generator(op):
    def g(d: Drawer) -> Case:
        a = {"shape": tuple(_shape(d, 0, 4)), "dtype": d.choice(["float64", "float32"]),
             "seed": d.choice([-1, 0, 7]), "key": d.int(0, 2 ** 32 - 1)}
        if op == "RandomNormal":
            a.update(mean=d.choice([0.0, 1.5]), scale=d.choice([1.0, 0.25]))
        else:
            a.update(low=d.choice([0.0, -2.0]), high=d.choice([1.0, 3.0]))
        return Case(op, a, [], [], [])
    return g


GENERATORS = {op: gen_generator(op) for op in ("RandomNormal", "RandomUniform")}
