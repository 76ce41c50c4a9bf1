"""Fused parallel operators: a seventh parallel operator, ``AllReduce(degree)``.

``AllReduce(k)`` is ``Reduce(k)`` followed by ``Replicate(k)`` executed as one collective (Unity §3:
"executing a pair of Reduce-Replicate operators as an AllReduce"): it divides the sum degree by ``k``
and multiplies the copy degree by ``k``; every resulting copy holds the summed value.  The rule
``reduce_replicate_allreduce`` (rules_cache) introduces it; the verifier axiom
``AllReduce_is_Reduce_Replicate`` defines it.
"""
from __future__ import annotations

import numpy as np

from .. import pieces as P
from ..errors import InvalidParallelization
from .base import NOTHING, REQUIRED, Inference, OpSpec, Shapes, register


def _infer(a, ins: Shapes, strict: bool = True) -> Inference:
    s = ins[0]
    d = a["degree"]
    if not isinstance(d, int) or d < 2:
        raise InvalidParallelization(f"AllReduce: degree must be an int >= 2, got {d!r}")
    if s.sum_degree % d:
        raise InvalidParallelization(f"AllReduce: sum degree {s.sum_degree} is not a multiple of {d}")
    return Inference((s.with_sum(s.sum_degree // d).with_copy(s.copy_degree * d),), None)


def allreduce_pieces(x: np.ndarray, degree: int) -> np.ndarray:
    """Piece kernel: sum groups of ``degree`` partial sums, then copy the result ``degree`` times."""
    return P.replicate(P.reduce(x, degree), degree)


register(OpSpec(name="AllReduce", kind="parallel", attrs={"degree": REQUIRED}, infer=_infer,
                forward=lambda a, xs: [xs[0]], num_inputs=1, saves=NOTHING,
                doc="Reduce(degree) then Replicate(degree) as one collective."))

PIECE_KERNELS = {"AllReduce": lambda x, shape, a: allreduce_pieces(x, a["degree"])}
