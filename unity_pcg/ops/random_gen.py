"""Random generators: ``RandomNormal`` and ``RandomUniform`` (ONNX's, and their ``*Like`` forms converted at
import to these when the input's shape is static).

Compute operators without inputs: attributes ``shape``, ``dtype`` (a float type), ``mean``/``scale`` or
``low``/``high``, ``seed`` (-1: the run's seed) and ``key`` (the node's identity in the hash, set by the
importer from the ONNX output name, so substitutions that copy the node keep its values).  Labels: one per
output dim, none unshardable (an element's value depends only on its logical index, so every block of the
logical tensor is drawn on its own); with no input to partition, a plan splits the output with parallel
operators.  Not trainable, no gradient (nothing flows in).  FLOPs: the elements generated.

Numpy reference: a counter-based draw keyed by (seed, step 0, key, logical element index)
(:mod:`unity_pcg.counter_rng`; normals by Box-Muller), the executor's kernel draws the same at the step it
trains; ``evaluate(..., random="standin")`` (the import check) gives the deterministic stand-ins of
:data:`STANDINS` instead.
"""
from __future__ import annotations

import numpy as np

from .. import counter_rng as R
from ..shape import numpy_dtype
from .base import NOTHING, REQUIRED, Labels
from .compute import ATTR_KINDS, _bad, _dims, compute_op

FLOAT_DTYPES = ("float32", "float16", "float64")
#: generator -> its deterministic stand-in (the ONNX import check's, see unity_pcg/onnx_import/check.py)
STANDINS = {"RandomNormal": "its mean", "RandomUniform": "(low + high) / 2"}


def standin_value(op: str, a: dict) -> float:
    return float(a["mean"]) if op == "RandomNormal" else (float(a["low"]) + float(a["high"])) / 2


def run_seed(a: dict, seed: int) -> int:
    """The seed the node draws with: its own (``seed >= 0``) else the run's."""
    return int(a["seed"]) if int(a["seed"]) >= 0 else int(seed)


def draw(op: str, a: dict, seed: int = 0, step: int = 0, offset=None, piece=None) -> np.ndarray:
    """The block of shape ``piece`` at ``offset`` (default: all) of the tensor node ``a`` draws at ``step``."""
    sizes = tuple(a["shape"])
    idx = R.np_logical_index(sizes, offset, piece)
    s = run_seed(a, seed)
    if op == "RandomNormal":
        v = R.np_normal(s, step, int(a["key"]), idx, float(a["mean"]), float(a["scale"]))
    else:
        v = R.np_uniform(s, step, int(a["key"]), idx, float(a["low"]), float(a["high"]))
    return v.astype(numpy_dtype(a["dtype"]))


def _logical(op):
    def logical(a, ins):
        if a["dtype"] not in FLOAT_DTYPES:
            _bad(op, f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {a['dtype']!r}")
        if any(s < 0 for s in a["shape"]):
            _bad(op, f"invalid shape {list(a['shape'])}")
        if not 0 <= int(a["key"]) <= R.MASK32:
            _bad(op, f"key {a['key']} is not a 32-bit unsigned integer")
        return [(tuple(a["shape"]), a["dtype"])]
    return logical


def _labels(a, ins, outs):
    return Labels((), (_dims("d", len(outs[0])),))


_COMMON = {"shape": REQUIRED, "dtype": "float32", "seed": -1, "key": 0}
for _op, _params in (("RandomNormal", {"mean": 0.0, "scale": 1.0}), ("RandomUniform", {"low": 0.0, "high": 1.0})):
    ATTR_KINDS[_op] = {"shape": "ints", "dtype": "str", "seed": "int", "key": "int",
                       **{k: "num" for k in _params}}
    compute_op(_op, attrs={**_COMMON, **_params}, num_inputs=0, logical=_logical(_op), labels=_labels,
               forward=(lambda op: lambda a, xs: [draw(op, a, seed=0)])(_op),
               flops=lambda a, i, o: float(o[0].numel), cost_class="elementwise", autocast="follow", saves=NOTHING,
               doc=f"{_op}: a tensor drawn from a counter-based generator (unity_pcg/ops/random_gen.py).")
