"""Mutants of rules for the soundness test (issue point 4a): swap an op, change an attribute, drop an op,
change a degree, swap inputs.  Mutations are applied to the target side, so the rule's recorded example
still instantiates the source; ``numerically_wrong`` decides with the piece semantics whether a mutant
is wrong (its target evaluates differently, or to another parallel shape, on a valid instance)."""
from __future__ import annotations

import json
import random
from typing import Iterator

import numpy as np

from unity_pcg.substitutions.rule import Pattern, PatNode, Rule, RuleError
from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization, ShapeError

SWAPS = {
    "Relu": ["Gelu", "Neg", "Sigmoid", "Exp"], "Gelu": ["Relu", "Tanh"], "Neg": ["Relu", "Identity"],
    "Exp": ["Relu"], "Sigmoid": ["Tanh"], "Tanh": ["Sigmoid"], "Identity": ["Neg"],
    "Add": ["Sub", "Mul", "Max"], "Sub": ["Add"], "Mul": ["Add", "Min"], "Div": ["Mul"], "Max": ["Min"],
    "Min": ["Max"], "MatMul": ["Mul", "Add"], "BatchMatMul": ["Mul"], "Partition": ["Pipeline"],
    "Combine": ["Batch"], "Reduce": ["Replicate"], "Replicate": ["Reduce"], "AllReduce": ["Reduce"],
}


def _nodes(p: Pattern) -> list[PatNode]:
    return list(p.nodes)


def _with_target(r: Rule, nodes, outputs=None, tag="") -> Rule:
    return Rule(f"{r.name}~{tag}", r.inputs, r.source, Pattern(tuple(nodes), tuple(outputs or r.target.outputs)),
                r.vars, r.constraints, r.origin, (), r.example)


def mutants(r: Rule) -> Iterator[Rule]:
    tn = _nodes(r.target)
    for i, n in enumerate(tn):
        # swap an op
        for other in SWAPS.get(n.op, []):
            spec = ops.get_op(other)
            attrs = tuple((k, v) for k, v in n.attrs if k in spec.attrs)
            nodes = tn[:i] + [PatNode(other, attrs, n.inputs)] + tn[i + 1:]
            yield _with_target(r, nodes, tag=f"swap{i}:{other}")
        # change an attribute
        a = n.a
        for k, v in n.attrs:
            alts = []
            if k in ("dim", "axis") and isinstance(v, int):
                alts = [x for x in (-1, -2, 0) if x != v]
            elif k == "degree":
                alts = [4] if v != 4 else [2]
            elif k == "activation":
                alts = [x for x in ("none", "relu", "gelu") if x != v]
            for alt in alts:
                nodes = tn[:i] + [PatNode(n.op, tuple(sorted({**a, k: alt}.items())), n.inputs)] + tn[i + 1:]
                yield _with_target(r, nodes, tag=f"attr{i}:{k}={alt}")
        # swap inputs
        if len(n.inputs) >= 2 and n.inputs[0] != n.inputs[1]:
            ins = (n.inputs[1], n.inputs[0]) + n.inputs[2:]
            nodes = tn[:i] + [PatNode(n.op, n.attrs, ins)] + tn[i + 1:]
            yield _with_target(r, nodes, tag=f"swapin{i}")
        # drop an op (unary: its users read its input instead)
        if len(n.inputs) == 1:
            src = n.inputs[0]

            def fix(x):
                if isinstance(x, str):
                    return x
                if x[0] == i:
                    return src if isinstance(src, str) else src
                return (x[0] - 1, x[1]) if x[0] > i else x
            nodes = [PatNode(m.op, m.attrs, tuple(fix(x) for x in m.inputs)) for j, m in enumerate(tn) if j != i]
            outs = tuple(fix(o) if not isinstance(o, str) else o for o in r.target.outputs)
            yield _with_target(r, nodes, outs, tag=f"drop{i}")


def valid_mutants(rules, limit: int, seed: int = 0) -> list[Rule]:
    out = []
    rules = list(rules)
    random.Random(seed).shuffle(rules)
    for r in rules:
        for m in mutants(r):
            try:
                m.validate()
            except RuleError:
                continue
            out.append(m)
        if len(out) >= limit:
            break
    return out


def numerically_wrong(m: Rule, draws: int = 2, seed: int = 0) -> bool | None:
    """True if the mutant's two sides differ on a valid instance, False if they agree, None if its
    example is not a valid instance of the mutated target."""
    from unity_pcg.substitutions.templates import example_of
    from unity_pcg.substitutions.terms import eval_pattern

    from .selfcheck import sample_values
    ex = example_of(m)
    if ex is None:
        return None
    rng = np.random.default_rng(seed)
    ints = ex["ints"]
    high = {}
    srcops = {n.op for n in m.source.nodes}
    if "Embedding" in srcops:
        high = {"i": ex["shapes"]["t"].sizes[0]}
    if "Gather" in srcops:
        high = {"i": ex["shapes"]["x"].sizes[ex["bind"].get("a", 0)]}
    for _ in range(draws):
        vals = sample_values(ex["shapes"], ex["values"], rng, ints, high)
        try:
            a = eval_pattern(m.source, ex["bind"], ex["shapes"], vals, np.random.default_rng(1))
        except (InvalidParallelization, ShapeError):
            return None
        try:
            b = eval_pattern(m.target, ex["bind"], ex["shapes"], vals, np.random.default_rng(2))
        except (InvalidParallelization, ShapeError, KeyError, ValueError):
            return None
        for (sa, va), (sb, vb) in zip(a, b):
            if sa != sb or va.shape != vb.shape:
                return True
            if not np.allclose(np.asarray(va, np.float64), np.asarray(vb, np.float64), rtol=1e-6, atol=1e-8):
                return True
    return False
