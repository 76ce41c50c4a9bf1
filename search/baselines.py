"""Fixed parallelizations of a (logical) PCG: the baselines the search is compared with.

* ``none``: the model on one device -- the logical PCG itself (every degree 1).
* ``dp`` with degree d (data parallelism): every Input is partitioned d ways on its first dim (the
  batch), every Weight is replicated d times (each device holds a full copy; the cost model charges
  the gradient all-reduce this implies), shape inference propagates the batch partition through
  the graph, and every graph output is combined back to one piece.

Robustness: where an operator refuses its batch-partitioned inputs (a Reshape that merges the batch
dim into another, a reduction over the batch, ...), its partitioned inputs are combined back to
one piece (a gather onto one device), it reads the unreplicated weights and runs as a single task,
and its outputs are partitioned again on dim 0 when that dim is divisible by d (else they stay
whole and the next operators fall back the same way).  ``fallbacks`` in the returned PCG's ``meta``
lists these operators by name.
"""
from __future__ import annotations

from typing import Callable

from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization, UnityError
from unity_pcg.pcg import PCG


class StrategyError(UnityError, ValueError):
    """A fixed parallelization that cannot be built for this model (e.g. batch not divisible)."""


STRATEGIES = ("none", "dp")


def build_strategy(g: PCG, strategy: str, degree: int = 1) -> PCG:
    if strategy == "none":
        return none(g)
    if strategy == "dp":
        return data_parallel(g, degree)
    raise StrategyError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")


def none(g: PCG) -> PCG:
    for n in g.nodes():
        if n.kind == "parallel":
            raise StrategyError(f"strategy 'none' needs a logical PCG; node {n.label()} is a {n.op}")
    return g


def data_parallel(g: PCG, degree: int, combine_outputs: bool = True) -> PCG:
    """Data-parallel PCG of degree ``degree`` (see module docstring).  ``combine_outputs=False``
    leaves the outputs batch-partitioned (each device computes its loss on its shard, as torch DDP
    does)."""
    if not isinstance(degree, int) or degree < 1:
        raise StrategyError(f"data-parallel degree must be a positive integer, got {degree!r}")
    if degree == 1:
        return none(g)
    d = degree
    b = PCG.builder(g.weights)
    m: dict = {}          # old ref -> new ref (parallel version)
    raw: dict = {}        # old weight ref -> new unreplicated ref
    rep: dict = {}        # old weight ref -> new replicated ref (lazy)
    fallbacks: list[str] = []

    def replicated(r):
        if r not in rep:
            rep[r] = b.add("Replicate", {"degree": d}, [raw[r]], name=f"{_name(g, r)}/replicate")
        return rep[r]

    def unpartition(ref, label):
        s = b.shape(ref)
        if s.sum_degree > 1:
            ref = b.add("Reduce", {"degree": s.sum_degree}, [ref], name=f"{label}/reduce")
        s = b.shape(ref)
        for dim, deg in enumerate(s.degrees):
            if deg > 1:
                ref = b.add("Combine", {"dim": dim, "degree": deg}, [ref], name=f"{label}/combine{dim}")
        return ref

    for n in g.nodes():
        if n.kind == "parallel":
            raise StrategyError(f"strategy 'dp' needs a logical PCG; node {n.label()} is a {n.op}")
        if n.op == "Input":
            ref = b.add("Input", n.a, [], name=n.name)
            s = b.shape(ref)
            if s.rank == 0 or s.sizes[0] % d:
                size = s.sizes[0] if s.rank else "a scalar"
                raise StrategyError(f"input {n.label()!r}: batch dim of size {size} is not divisible by "
                                    f"data-parallel degree {d}")
            m[(n.id, 0)] = b.add("Partition", {"dim": 0, "degree": d}, [ref], name=f"{n.label()}/partition")
            continue
        if n.op == "Weight":
            raw[(n.id, 0)] = b.add("Weight", n.a, [], name=n.name)
            continue
        ins = [replicated(r) if r in raw else m[r] for r in n.inputs]
        try:
            ops.infer(n.op, n.a, [b.shape(r) for r in ins])
            nid = b.add_node(n.op, n.a, ins, name=n.name)
        except InvalidParallelization:
            fallbacks.append(n.label())
            ins = [raw[r] if r in raw else unpartition(m[r], f"{n.label()}/in{i}") for i, r in enumerate(n.inputs)]
            nid = b.add_node(n.op, n.a, ins, name=n.name)
            outs = []
            for k in range(len(g.shapes(n.id))):
                ref = (nid, k)
                s = b.shape(ref)
                if s.rank and s.sizes[0] % d == 0 and s.sizes[0] >= d:
                    ref = b.add("Partition", {"dim": 0, "degree": d}, [ref], name=f"{n.label()}/out{k}/partition")
                outs.append(ref)
            for k, ref in enumerate(outs):
                m[(n.id, k)] = ref
            continue
        for k in range(len(g.shapes(n.id))):
            m[(n.id, k)] = (nid, k)
    outs = []
    for r in g.outputs:
        ref = raw[r] if r in raw else m[r]
        outs.append(unpartition(ref, f"output{len(outs)}") if combine_outputs else ref)
    b.set_outputs(outs)
    b.meta = dict(g.meta, strategy="dp", degree=d, fallbacks=fallbacks)
    out = b.finish()
    out.meta.update(strategy="dp", degree=d, fallbacks=fallbacks)
    return out


def _name(g: PCG, r) -> str:
    return g.node(r[0]).label()


__all__ = ["build_strategy", "none", "data_parallel", "StrategyError", "STRATEGIES"]
