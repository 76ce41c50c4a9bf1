"""ONNX import: an ONNX model file -> a :class:`~unity_pcg.pcg.PCG` with every shape known.

``load_onnx(path_or_model, batch=None, *, load_weights=True)``

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

Errors are :class:`~unity_pcg.errors.ModelImportError` subclasses with one-line messages.
"""
from __future__ import annotations

from typing import Any

from .errors import DynamicDimension, InvalidModel, MissingTensor, ModelImportError, UnsupportedOperator


def load_onnx(path_or_model: Any, batch: int | None = None, *, load_weights: bool = True):
    """Import an ONNX model (path, bytes or ``onnx.ModelProto``) as a PCG.

    ``batch``: override the first dim of every graph input (needed when it is dynamic).
    ``load_weights=False``: leave ``PCG.weights`` empty (structure only).
    """
    from .importer import load
    return load(path_or_model, batch=batch, load_weights=load_weights)


__all__ = ["load_onnx", "ModelImportError", "UnsupportedOperator", "InvalidModel", "MissingTensor",
           "DynamicDimension"]
