"""ONNX import: an ONNX model file -> a :class:`~unity_pcg.pcg.PCG` with every shape known.

``load_onnx(path_or_model, batch=None, *, load_weights=True, fuse=True)``

* Initializers become ``Weight`` nodes named after the initializer; their values stay on disk (or in the
  parsed protobuf) and enter ``PCG.weights`` as zero-arg callables, read only when called.  External
  data files are resolved next to the model file.
* Constant subgraphs (Constant, Shape, Gather, Unsqueeze, Concat, ConstantOfShape, Where, Expand, Cast,
  Range, Slice, Reshape, arithmetic, ...) are folded with numpy at import time; the shapes of
  activations are known, so ``Shape`` of an activation is a constant too.  A folded constant that
  feeds an operator as a tensor becomes a ``Weight``; small constants that are really attributes
  (reshape targets, axes, a scalar factor of Mul/Div -> ``Scale``) become attributes.
* Constant indices of a ``Gather`` become an int64 ``Weight`` node (or a ``Slice`` when they are a
  contiguous range on an activation); a ``Gather`` from a constant 2-D table with axis 0 is an
  ``Embedding``.
* ``batch=N`` replaces the first dim of every graph input; shape computations (Shape chains) follow,
  and literal reshape/expand targets whose leading dim baked in the old batch are rewritten.

Errors are :class:`~unity_pcg.errors.ModelImportError` subclasses with one-line messages, all importable from
here: ``UnsupportedOperator``, ``InvalidModel``, ``MissingTensor``, ``DynamicDimension``, ``BatchOverride`` (a
``batch=N`` that cannot be applied exactly) and ``CheckError`` (``--check`` could not run; loaded on first use).
"""
from __future__ import annotations

from typing import Any

from .errors import (BatchOverride, DynamicDimension, InvalidModel, MissingTensor, ModelImportError,
                     UnsupportedOperator)


def load_onnx(path_or_model: Any, batch: int | None = None, *, load_weights: bool = True, fuse: bool = True):
    """Import an ONNX model (path, bytes or ``onnx.ModelProto``) as a PCG.

    ``batch``: override the first dim of every graph input (needed when it is dynamic; exact when the file
    fixes another batch, else :class:`BatchOverride`).
    ``load_weights=False``: leave ``PCG.weights`` empty (structure only).
    ``fuse=False``: keep the exporter's decompositions of GELU, LayerNorm and SiLU (no pattern fusion).
    """
    from .importer import load
    return load(path_or_model, batch=batch, load_weights=load_weights, fuse=fuse)


def __getattr__(name: str):
    # CheckError lives with the checker (numpy and onnxruntime plumbing), loaded only when asked for
    if name == "CheckError":
        from .check import CheckError
        return CheckError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["load_onnx", "ModelImportError", "UnsupportedOperator", "InvalidModel", "MissingTensor",
           "DynamicDimension", "BatchOverride", "CheckError"]
