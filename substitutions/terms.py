"""A tiny term language for writing patterns by hand (templates, axioms, tests), and instantiation of
a pattern into a concrete PCG (for numeric checks).

    x = "x"
    t = op("Relu", op("Partition", "x", dim="$d", degree="$k"))
    pattern_of(t)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg import pieces as P
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape

from .rule import Pattern, PatNode, Rule, _freeze, is_var


@dataclass(frozen=True)
class Term:
    op: str
    attrs: tuple[tuple[str, Any], ...]
    args: tuple[Any, ...]       # Term or input name
    out: int = 0

    def __getitem__(self, k: int) -> "Term":
        return Term(self.op, self.attrs, self.args, k)


def op(name: str, *args: Any, **attrs: Any) -> Term:
    return Term(name, tuple(sorted((k, _freeze(v)) for k, v in attrs.items())), tuple(args))


def pattern_of(*outs: Any) -> Pattern:
    """Pattern with common subterms shared (a term used twice is one node)."""
    nodes: list[PatNode] = []
    memo: dict[tuple, int] = {}

    def visit(t: Any):
        if isinstance(t, str):
            return t
        key = (t.op, t.attrs, tuple(visit(a) for a in t.args))
        if key not in memo:
            nodes.append(PatNode(t.op, t.attrs, key[2]))
            memo[key] = len(nodes) - 1
        return (memo[key], t.out)

    outputs = tuple(visit(t) for t in outs)
    return Pattern(tuple(nodes), outputs)


def rule_of(name: str, lhs: Any, rhs: Any, vars: Mapping[str, str] | None = None,
            constraints: Sequence[Sequence[Any]] = (), origin: str = "template",
            inputs: Sequence[str] | None = None) -> Rule:
    lhs_t = lhs if isinstance(lhs, tuple) else (lhs,)
    rhs_t = rhs if isinstance(rhs, tuple) else (rhs,)
    src, tgt = pattern_of(*lhs_t), pattern_of(*rhs_t)
    names = list(inputs) if inputs is not None else src.inputs_used()
    r = Rule(name, tuple(names), src, tgt, tuple(sorted((vars or {}).items())),
             tuple(tuple(c) for c in constraints), origin)  # type: ignore[arg-type]
    r.validate()
    return r


def resolve(v: Any, b: Mapping[str, Any]) -> Any:
    if is_var(v):
        return b[v[1:]]
    if isinstance(v, tuple):
        return tuple(resolve(x, b) for x in v)
    return v


def instantiate(p: Pattern, bindings: Mapping[str, Any], input_shapes: Mapping[str, ParallelTensorShape],
                names: Sequence[str] | None = None) -> PCG:
    """A concrete PCG: one Input node per pattern input (with the given parallel shape: its value is
    fed logically and split into pieces by the evaluator), the pattern's nodes, its outputs.
    Raises InvalidParallelization when the instance is not a valid parallelization."""
    b = PCG.builder()
    refs: dict[str, tuple[int, int]] = {}
    order = list(names) if names is not None else p.inputs_used()
    for name in order:
        s = input_shapes[name]
        refs[name] = b.add("Input", {"name": name, "shape": list(s.sizes), "dtype": s.dtype}, [], name)
        # parallel inputs: the instance starts from the given parallel shape via parallel ops
        r = refs[name]
        for d, deg in enumerate(s.degrees):
            if deg > 1:
                r = b.add("Partition", {"dim": d, "degree": deg}, [r])
        if s.copy_degree > 1:
            r = b.add("Replicate", {"degree": s.copy_degree}, [r])
        refs[name] = r
        if s.sum_degree > 1:
            refs[name] = _with_sum(b, r, s)
    node_refs: list[int] = []

    def ref(r):
        if isinstance(r, str):
            return refs[r]
        return (node_refs[r[0]], r[1])

    for pn in p.nodes:
        attrs = {k: resolve(v, bindings) for k, v in pn.attrs}
        node_refs.append(b.add_node(pn.op, attrs, [ref(r) for r in pn.inputs]))
    b.set_outputs([ref(o) for o in p.outputs])
    b.meta["inputs"] = {name: tuple(r) for name, r in refs.items()}
    return b.finish()


def _with_sum(b, r, s: ParallelTensorShape):
    from unity_pcg.errors import InvalidParallelization
    raise InvalidParallelization(f"an instance PCG cannot start from partial sums ({s}); use eval_pattern")


def eval_pattern(p: Pattern, bindings: Mapping[str, Any], input_shapes: Mapping[str, ParallelTensorShape],
                 values: Mapping[str, np.ndarray], rng: np.random.Generator | None = None,
                 run=None) -> list[tuple[ParallelTensorShape, np.ndarray]]:
    """Evaluate a pattern piecewise: each input's logical value is split into pieces of its parallel
    shape (partial sums split at random with ``rng``), every node runs with ``ops.run_pieces`` (or
    ``run``, same signature), and each output is returned as (parallel shape, logical value).
    Raises InvalidParallelization if a node cannot run on its inputs' parallel shapes."""
    runner = run or ops.run_pieces
    vals: dict[Any, tuple[np.ndarray, ParallelTensorShape]] = {}
    for name, s in input_shapes.items():
        vals[name] = (P.split(np.asarray(values[name]), s, rng), s)
    outs: list[list[tuple[np.ndarray, ParallelTensorShape]]] = []
    for pn in p.nodes:
        attrs = {k: resolve(v, bindings) for k, v in pn.attrs}
        xs, ss = [], []
        for r in pn.inputs:
            v, s = vals[r] if isinstance(r, str) else outs[r[0]][r[1]]
            xs.append(v)
            ss.append(s)
        ys, shapes = runner(pn.op, ops.get_op(pn.op).normalize_attrs(attrs), xs, ss)
        outs.append(list(zip(ys, shapes)))
    res = []
    for o in p.outputs:
        v, s = vals[o] if isinstance(o, str) else outs[o[0]][o[1]]
        res.append((s, P.join(v, s)))
    return res
