"""Typed errors a user can cause.  Each carries a one-line message naming the culprit;
the CLI prints it and exits 2 (DESIGN "Conventions")."""
from __future__ import annotations


class UnityError(Exception):
    """Base of every user-facing error; ``str(e)`` is one line."""

    def __str__(self) -> str:  # keep messages to one line whatever was passed in
        msg = super().__str__()
        return " ".join(msg.split())


class ShapeError(UnityError, ValueError):
    """A malformed parallel tensor shape (e.g. a degree that does not divide its size)."""


class InvalidParallelization(UnityError, ValueError):
    """An operator cannot run piecewise on the given parallel input shapes."""


class UnknownOperator(UnityError, ValueError):
    pass


class GraphError(UnityError, ValueError):
    """A malformed PCG (cycle, dangling edge, shape mismatch)."""


class ModelImportError(UnityError):
    """A model file that cannot be imported ."""


class UnsupportedOperator(ModelImportError):
    pass


class PlanError(UnityError, ValueError):
    pass
