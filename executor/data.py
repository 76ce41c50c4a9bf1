"""Training data for `unity-pcg run`: the feeds of one step, the same on every rank.

Two sources:

* ``--data FILE.npz``: one array per ONNX graph input, keyed by the input's name, plus an optional
  ``targets`` array.  Every array's first dim is a whole number of batches (``k * B`` rows, where ``B``
  is the first dim of that input in the plan's PCG); step ``s`` reads batch ``s mod k``.  The rest of
  each input's shape must equal the model's.  Loading checks everything and raises ``DataError`` (one
  line) before any step runs.
* no file: seeded random feeds from :func:`unity_pcg.evaluate.random_feeds`, seeded by ``(seed, step)``
  so that every rank draws the same batch and a resumed run draws what an uninterrupted one would.

Every rank holds the whole (logical) batch; the trainer takes the pieces its plan gives it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from unity_pcg.errors import UnityError
from unity_pcg.evaluate import random_feeds
from unity_pcg.pcg import PCG
from unity_pcg.shape import numpy_dtype


class DataError(UnityError, ValueError):
    """A --data file that does not fit the model (missing input, wrong shape, ...)."""


def _inputs(g: PCG) -> dict[str, dict]:
    return {n.a["name"]: n.a for n in g.sources("Input")}


def step_seed(seed: int, step: int) -> int:
    """The random-feed seed of one step: a fixed mix of the run's seed and the step number."""
    return (int(seed) * 1_000_003 + int(step) * 7_919 + 17) % (2 ** 63)


@dataclass
class DataSource:
    """Feeds (and targets) per step; ``arrays`` is None for seeded random feeds."""
    graph: PCG
    seed: int = 0
    arrays: Mapping[str, np.ndarray] | None = None
    targets: np.ndarray | None = None
    batches: int = 1
    path: str | None = None

    def feeds(self, step: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(input name -> whole batch, targets or None) of step ``step`` (0-based, counted over resumes)."""
        if self.arrays is None:
            return random_feeds(self.graph, seed=step_seed(self.seed, step)), None
        k = step % self.batches
        out = {}
        for name, a in self.arrays.items():
            b = _inputs(self.graph)[name]["shape"][0]
            out[name] = a[k * b:(k + 1) * b]
        t = None
        if self.targets is not None:
            tb = self.targets.shape[0] // self.batches
            t = self.targets[k * tb:(k + 1) * tb]
        return out, t

    def describe(self) -> str:
        if self.arrays is None:
            return f"random feeds (seed {self.seed})"
        return f"{self.path} ({self.batches} batch{'es' if self.batches != 1 else ''}" + \
               (", with targets)" if self.targets is not None else ")")


def open_data(g: PCG, path: str | None, seed: int = 0) -> DataSource:
    """The data source of a run over the graph ``g`` (its Input nodes give names, shapes, dtypes)."""
    inputs = _inputs(g)
    if path is None:
        return DataSource(g, seed=seed)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except Exception as e:  # zipfile / format errors
        raise DataError(f"data file {path} is not a readable .npz file: {' '.join(str(e).split())}") from None
    targets = arrays.pop("targets", None)
    missing = [n for n in inputs if n not in arrays]
    if missing:
        raise DataError(f"data file {path} has no array for model input {missing[0]!r} "
                        f"(it has: {', '.join(sorted(arrays)) or 'nothing'})")
    extra = [k for k in arrays if k not in inputs]
    if extra:
        raise DataError(f"data file {path}: array {extra[0]!r} is neither a model input "
                        f"({', '.join(inputs)}) nor 'targets'")
    batches = None
    for name, a in inputs.items():
        v = arrays[name]
        shape = tuple(a["shape"])
        if v.ndim != len(shape) or tuple(v.shape[1:]) != shape[1:] or v.shape[0] % shape[0] or not v.shape[0]:
            raise DataError(f"data file {path}: input {name!r} has shape {list(v.shape)}; the model needs "
                            f"[k*{shape[0]}, {', '.join(map(str, shape[1:]))}] (k batches of {shape[0]})"
                            .replace(", ]", "]"))
        k = v.shape[0] // shape[0]
        if batches is not None and k != batches:
            raise DataError(f"data file {path}: input {name!r} holds {k} batches, another input {batches}")
        batches = k
        want = numpy_dtype(a["dtype"])
        if a["dtype"].startswith("int") and not np.issubdtype(v.dtype, np.integer):
            raise DataError(f"data file {path}: input {name!r} must hold integers, got {v.dtype}")
        arrays[name] = v.astype(want, copy=False)
    batches = batches or 1
    if targets is not None:
        if targets.ndim == 0 or targets.shape[0] % batches:
            raise DataError(f"data file {path}: targets' first dim ({targets.shape[0] if targets.ndim else 0}) "
                            f"is not a multiple of the {batches} batches")
        if not (np.issubdtype(targets.dtype, np.integer) or np.issubdtype(targets.dtype, np.floating)):
            raise DataError(f"data file {path}: targets must be integers (classes) or floats, got {targets.dtype}")
    return DataSource(g, seed=seed, arrays=arrays, targets=targets, batches=batches, path=path)
