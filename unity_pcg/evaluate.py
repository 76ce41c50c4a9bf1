"""Numpy evaluation of a whole PCG, logical or piecewise (DESIGN "Piece semantics")."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import ops
from . import pieces as P
from .errors import GraphError
from .pcg import PCG, Ref
from .shape import numpy_dtype
from .ops.random_gen import STANDINS as GENERATOR_STANDINS, run_seed, standin_value


#: PCG operators that draw random numbers when the executor trains, and the deterministic value
#: ``evaluate(..., random="standin")`` computes instead.  ``import --check`` gives onnxruntime the same stand-ins
#: (:data:`unity_pcg.onnx_import.check.RANDOM_STANDINS`); an operator added here must compute the stand-in its
#: ONNX operator has there.  Dropout is the identity in every evaluation (inference semantics); the generators
#: (:mod:`unity_pcg.ops.random_gen`) draw by default, from a counter-based hash of (seed, node key, logical
#: index), so ``evaluate`` is deterministic for a given ``seed`` and any partitioning gives the same values.
RANDOM_OPS = {"Dropout": "identity (inference mode)", **GENERATOR_STANDINS}
RANDOM_MODES = ("draw", "standin")


def random_ops(g: PCG) -> dict[str, int]:
    """How many operators of each :data:`RANDOM_OPS` kind ``g`` has (the ones ``evaluate`` runs as their
    deterministic stand-in)."""
    out: dict[str, int] = {}
    for n in g.nodes():
        if n.op in RANDOM_OPS:
            out[n.op] = out.get(n.op, 0) + 1
    return out


def _source_value(g: PCG, n, feeds: Mapping[str, Any]) -> np.ndarray:
    a = n.a
    name = a["name"]
    if n.op == "Input":
        if name not in feeds:
            raise GraphError(f"no value fed for input {name!r}")
        v = feeds[name]
    else:
        v = feeds[name] if name in feeds else g.weights.get(name)
        if v is None:
            raise GraphError(f"no value for weight {name!r}")
        if callable(v):
            v = v()
    v = np.asarray(v)
    if tuple(v.shape) != tuple(a["shape"]):
        raise GraphError(f"value for {name!r} has shape {list(v.shape)}, expected {list(a['shape'])}")
    return v.astype(numpy_dtype(a["dtype"]), copy=False)


def evaluate(g: PCG, feeds: Mapping[str, Any], mode: str = "logical", rng: np.random.Generator | None = None,
             keep: bool = False, random: str = "draw", seed: int = 0) -> list[np.ndarray] | dict[Ref, np.ndarray]:
    """Evaluate ``g`` on ``feeds`` (input name -> array; weights default to ``g.weights``).

    ``mode="logical"`` runs every operator on whole tensors (parallel operators are identities);
    ``mode="pieces"`` runs every operator piecewise and joins the graph outputs at the end.
    Returns the graph outputs' logical values, or with ``keep=True`` every tensor's value (piece
    values in pieces mode).  ``rng`` splits partial sums of sources at random (sources are
    unpartitioned today, so it matters only for graphs whose sources carry a sum degree).
    ``random``: what the random generators (:data:`RANDOM_OPS` but Dropout, always the identity) compute:
    ``"draw"`` their counter-based values at step 0 (``seed``: the run's seed, for nodes without their own),
    ``"standin"`` their deterministic stand-in (the import check's).
    """
    if mode not in ("logical", "pieces"):
        raise ValueError(f"mode must be logical or pieces, got {mode!r}")
    if random not in RANDOM_MODES:
        raise ValueError(f"random must be one of {', '.join(RANDOM_MODES)}, got {random!r}")
    vals: dict[Ref, np.ndarray] = {}
    remaining: dict[Ref, int] = {}
    if not keep:
        for n in g.nodes():
            for r in n.inputs:
                remaining[r] = remaining.get(r, 0) + 1
        for r in g.outputs:
            remaining[tuple(r)] = remaining.get(tuple(r), 0) + 1
    for n in g.nodes():
        if n.kind == "source":
            v = _source_value(g, n, feeds)
            vals[(n.id, 0)] = P.split(v, g.shapes(n.id)[0], rng) if mode == "pieces" else v
            continue
        xs = [vals[r] for r in n.inputs]
        a = n.a
        if n.op in GENERATOR_STANDINS:
            if random == "standin":
                s = g.shapes(n.id)[0]
                v = np.full(tuple(a["shape"]), standin_value(n.op, a), dtype=numpy_dtype(a["dtype"]))
                vals[(n.id, 0)] = P.split(v, s, None) if mode == "pieces" else v
                continue
            a = {**a, "seed": run_seed(a, seed)}
        if mode == "logical":
            outs = ops.run_logical(n.op, a, xs)
        else:
            outs, _ = ops.run_pieces(n.op, a, xs, g.input_shapes(n.id))
        for k, y in enumerate(outs):
            vals[(n.id, k)] = y
        if not keep:
            for r in n.inputs:
                remaining[r] -= 1
                if remaining[r] == 0:
                    del vals[r]
    if keep:
        return vals
    res = []
    for r in g.outputs:
        v = vals[tuple(r)]
        res.append(P.join(v, g.shape(r)) if mode == "pieces" else v)
    return res


def random_feeds(g: PCG, seed: int = 0, int_high: int = 2) -> dict[str, np.ndarray]:
    """Random values for every Input of ``g``: standard normal floats, integers in [0, int_high)
    (valid indices for any table with at least ``int_high`` rows), random booleans."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in g.sources("Input"):
        a = n.a
        if a["dtype"].startswith("int"):
            feeds[a["name"]] = rng.integers(0, int_high, a["shape"]).astype(a["dtype"])
        elif a["dtype"] == "bool":
            feeds[a["name"]] = rng.random(a["shape"]) < 0.5
        else:
            feeds[a["name"]] = rng.standard_normal(a["shape"]).astype(a["dtype"])
    return feeds
