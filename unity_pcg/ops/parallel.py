"""The six parallel operators (Unity §3.1).  They move pieces and never change the logical value.

Partition(dim, degree) splits every piece along ``dim``; Combine(dim, degree) concatenates groups
of ``degree`` neighbouring pieces; Replicate(degree) copies; Reduce(degree) sums groups of partial
sums; Pipeline(dim, degree) and Batch(dim, degree) split into and gather micro-batches.  Pipeline and
Batch move pieces exactly as Partition and Combine do; what differs is *when* the pieces run: the
pieces of a pipelined dim are processed one after another (over time) by the same devices, which the
machine mapping and the executor read from the operator type.
"""
from __future__ import annotations

from ..errors import InvalidParallelization, ShapeError
from .base import NOTHING, REQUIRED, Inference, OpSpec, Shapes, register


def _bad(op: str, msg: str):
    raise InvalidParallelization(f"{op}: {msg}")


def _dim(op, a, s):
    dim = a["dim"]
    if not isinstance(dim, int) or isinstance(dim, bool):
        _bad(op, f"dim must be an int, got {dim!r}")
    if not -s.rank <= dim < s.rank:
        _bad(op, f"dim {dim} out of range for rank {s.rank}")
    return dim % s.rank


def _degree(op, a):
    d = a["degree"]
    if not isinstance(d, int) or isinstance(d, bool) or d < 2:
        _bad(op, f"degree must be an int >= 2, got {d!r}")
    return d


def _partition_infer(op):
    def infer(a, ins: Shapes, strict: bool = True) -> Inference:
        s = ins[0]
        dim, d = _dim(op, a, s), _degree(op, a)
        try:
            return Inference((s.with_degree(dim, s.degrees[dim] * d),), None)
        except ShapeError:
            _bad(op, f"degree {s.degrees[dim] * d} does not divide dim {dim} of size {s.sizes[dim]}")
    return infer


def _combine_infer(op):
    def infer(a, ins: Shapes, strict: bool = True) -> Inference:
        s = ins[0]
        dim, d = _dim(op, a, s), _degree(op, a)
        if s.degrees[dim] % d:
            _bad(op, f"dim {dim} has degree {s.degrees[dim]}, not a multiple of {d}")
        return Inference((s.with_degree(dim, s.degrees[dim] // d),), None)
    return infer


def _replicate_infer(a, ins: Shapes, strict: bool = True) -> Inference:
    s = ins[0]
    return Inference((s.with_copy(s.copy_degree * _degree("Replicate", a)),), None)


def _reduce_infer(a, ins: Shapes, strict: bool = True) -> Inference:
    s = ins[0]
    d = _degree("Reduce", a)
    if s.sum_degree % d:
        _bad("Reduce", f"sum degree {s.sum_degree} is not a multiple of {d}")
    return Inference((s.with_sum(s.sum_degree // d),), None)


def _identity(a, xs):
    return [xs[0]]


def _par(name, attrs, infer, doc):
    def checked(a, ins: Shapes, strict: bool = True) -> Inference:
        for k in attrs:
            if k not in a:
                _bad(name, f"missing required attribute {k!r}")
        return infer(a, ins, strict)
    return register(OpSpec(name=name, kind="parallel", attrs=attrs, infer=checked, forward=_identity,
                           num_inputs=1, doc=doc, saves=NOTHING))


_par("Partition", {"dim": REQUIRED, "degree": REQUIRED}, _partition_infer("Partition"),
     "Split every piece along dim into degree pieces (raises that dim's degree).")
_par("Combine", {"dim": REQUIRED, "degree": REQUIRED}, _combine_infer("Combine"),
     "Concatenate groups of degree neighbouring pieces along dim (lowers its degree).")
_par("Replicate", {"degree": REQUIRED}, _replicate_infer, "Copy every piece degree times.")
_par("Reduce", {"degree": REQUIRED}, _reduce_infer, "Sum groups of degree partial-sum pieces.")
_par("Pipeline", {"dim": REQUIRED, "degree": REQUIRED}, _partition_infer("Pipeline"),
     "Split along dim into degree micro-batches processed over time.")
_par("Batch", {"dim": REQUIRED, "degree": REQUIRED}, _combine_infer("Batch"),
     "Gather degree micro-batches along dim.")

PARALLEL_OPS = ("Partition", "Combine", "Replicate", "Reduce", "Pipeline", "Batch")
