"""Apply a match: a new PCG with the source subgraph replaced by the target, shapes re-inferred.

A match whose result is not a valid parallelization (any target node, or any node downstream, fails
shape inference) raises :class:`InvalidParallelization`; so does a result whose replaced outputs
change parallel shape (rules preserve the parallel shape of every output, see DESIGN "Piece
semantics").  ``try_apply`` returns None instead of raising.
"""
from __future__ import annotations

from typing import Any

from unity_pcg.errors import GraphError, InvalidParallelization
from unity_pcg.pcg import PCG

from .match import Match
from .rule import is_var


def _resolve(v: Any, b: dict) -> Any:
    if is_var(v):
        return b[v[1:]]
    if isinstance(v, tuple):
        return tuple(_resolve(x, b) for x in v)
    return v


def apply_match(g: PCG, m: Match) -> PCG:
    rule = m.rule
    b = m.binding
    ins = m.input_map
    e = g.edit()
    new_refs: list[tuple[int, int]] = []

    def ref(r):
        if isinstance(r, str):
            return ins[r]
        return (new_refs[r[0]][0], r[1])

    try:
        for pn in rule.target.nodes:
            attrs = {k: _resolve(v, b) for k, v in pn.attrs}
            nid = e.add_node(pn.op, attrs, [ref(r) for r in pn.inputs], name="")
            new_refs.append((nid, 0))
        for so, to in zip(rule.source.outputs, rule.target.outputs):
            old = (m.nodes[so[0]], so[1])
            new = ins[to] if isinstance(to, str) else ref(to)
            if g.shape(old) != e.shape(new):
                raise InvalidParallelization(
                    f"rule {rule.name}: target output {e.shape(new)} differs from source output {g.shape(old)}")
            e.replace_uses(old, new)
        # remove the matched source nodes (interior tensors have no outside consumers by construction)
        for nid in set(m.nodes):        # (the order of removals does not matter)
            e.remove(nid)
        return e.finish()
    except InvalidParallelization as err:
        raise InvalidParallelization(f"rule {rule.name}: {err}") from None
    except GraphError as err:
        raise InvalidParallelization(f"rule {rule.name}: {err}") from None


def try_apply(g: PCG, m: Match) -> PCG | None:
    try:
        return apply_match(g, m)
    except InvalidParallelization:
        return None
