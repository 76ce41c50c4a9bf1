"""Typed import errors (all :class:`~unity_pcg.errors.ModelImportError`, so the CLI exits 2)."""
from __future__ import annotations

from ..errors import ModelImportError, UnsupportedOperator


class InvalidModel(ModelImportError):
    """The file is not a well-formed ONNX model (truncated, not protobuf, cycle, bad attribute, ...)."""


class FoldTooLarge(InvalidModel):
    """Folding a node on constants would read or make a constant beyond the fold guard (``consts.MAX_FOLD``).
    :func:`~unity_pcg.onnx_import.fold.fold_any` defers such a fold when its result is the large one."""


class MissingTensor(ModelImportError):
    """A node reads a tensor that no node, input or initializer defines (or external data is missing)."""


class DynamicDimension(ModelImportError):
    """A graph input has a dimension that is not a fixed number and no override was given."""


class BatchOverride(ModelImportError):
    """``batch=N`` cannot be applied exactly: a node holds the exported batch in a way the importer cannot
    rewrite (per-sample constant values, a reshape that moves the batch into a dim it cannot place, indices
    whose batch an export at batch 1 leaves ambiguous)."""


__all__ = ["ModelImportError", "UnsupportedOperator", "InvalidModel", "MissingTensor", "DynamicDimension",
           "BatchOverride"]
