"""Parallel tensor shapes (DESIGN "Parallel tensor shape").

A parallel tensor is a grid of equally shaped pieces.  The grid has one axis per shard dim (its
``degree``), one axis for partial sums (``sum_degree``) and one for identical copies
(``copy_degree``).  Its logical value: take any copy, sum over the sum axis, concatenate along
every shard axis.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import prod
from typing import Iterable, Sequence

from .errors import ShapeError

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, order=True)
class ShardDim:
    size: int
    degree: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.size) or self.size < 0:
            raise ShapeError(f"dimension size must be a non-negative int, got {self.size!r}")
        if not _is_int(self.degree) or self.degree < 1:
            raise ShapeError(f"degree must be a positive int, got {self.degree!r}")
        if self.size % self.degree != 0:
            raise ShapeError(f"degree {self.degree} does not divide dimension size {self.size}")

    @property
    def piece(self) -> int:
        return self.size // self.degree


@dataclass(frozen=True)
class ParallelTensorShape:
    dims: tuple[ShardDim, ...]
    sum_degree: int = 1
    copy_degree: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.dims, tuple):
            object.__setattr__(self, "dims", tuple(self.dims))
        for d in self.dims:
            if not isinstance(d, ShardDim):
                raise ShapeError(f"dims must be ShardDim values, got {d!r}")
        for name in ("sum_degree", "copy_degree"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ShapeError(f"{name} must be a positive int, got {v!r}")
        if self.dtype not in DTYPES:
            raise ShapeError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")

    # --- construction -------------------------------------------------------------------------
    @staticmethod
    def of(sizes: Iterable[int], degrees: Iterable[int] | None = None, sum_degree: int = 1,
           copy_degree: int = 1, dtype: str = "float32") -> "ParallelTensorShape":
        sizes = tuple(int(s) for s in sizes)
        degrees = tuple(int(d) for d in degrees) if degrees is not None else (1,) * len(sizes)
        if len(degrees) != len(sizes):
            raise ShapeError(f"{len(degrees)} degrees given for {len(sizes)} dims")
        return ParallelTensorShape(tuple(ShardDim(s, d) for s, d in zip(sizes, degrees)),
                                   sum_degree, copy_degree, dtype)

    # --- views --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.dims)

    @cached_property            # kept in the instance, as piece_shape
    def sizes(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @cached_property
    def degrees(self) -> tuple[int, ...]:
        return tuple(d.degree for d in self.dims)

    def __hash__(self) -> int:
        """The fields' hash, computed once (shapes key many memos: shape inference, the cost model, the
        mapping's keys); free of string hashing, so a pickled shape's kept value holds in any process."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dims, self.sum_degree, self.copy_degree, _DTYPE_CODE.get(self.dtype, -1)))
            object.__setattr__(self, "_hash", h)
        return h

    @cached_property            # kept in the instance (the shape is frozen); the pricers ask millions of times
    def piece_shape(self) -> tuple[int, ...]:
        return tuple(d.piece for d in self.dims)

    @property
    def shard_degree(self) -> int:
        return prod(self.degrees)

    @property
    def piece_count(self) -> int:
        return self.shard_degree * self.sum_degree * self.copy_degree

    @property
    def grid(self) -> tuple[int, ...]:
        """Grid axes in the canonical order (copy, sum, shard dims...)."""
        return (self.copy_degree, self.sum_degree) + self.degrees

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @cached_property
    def piece_numel(self) -> int:
        return prod(self.piece_shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @cached_property
    def piece_nbytes(self) -> int:
        return self.piece_numel * self.itemsize

    def is_unpartitioned(self) -> bool:
        return self.piece_count == 1

    def logical(self) -> "ParallelTensorShape":
        return ParallelTensorShape.of(self.sizes, dtype=self.dtype)

    # --- edits (each returns a new shape) ------------------------------------------------------
    def _dim(self, dim: int) -> int:
        if not -self.rank <= dim < self.rank:
            raise ShapeError(f"dim {dim} out of range for rank {self.rank}")
        return dim % self.rank

    def with_degree(self, dim: int, degree: int) -> "ParallelTensorShape":
        dim = self._dim(dim)
        dims = list(self.dims)
        dims[dim] = ShardDim(dims[dim].size, degree)
        return replace(self, dims=tuple(dims))

    def with_sum(self, sum_degree: int) -> "ParallelTensorShape":
        return replace(self, sum_degree=sum_degree)

    def with_copy(self, copy_degree: int) -> "ParallelTensorShape":
        return replace(self, copy_degree=copy_degree)

    def with_dtype(self, dtype: str) -> "ParallelTensorShape":
        return replace(self, dtype=dtype)

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"dims": [[d.size, d.degree] for d in self.dims], "sum_degree": self.sum_degree,
                "copy_degree": self.copy_degree, "dtype": self.dtype}

    @staticmethod
    def from_json(obj: dict) -> "ParallelTensorShape":
        try:
            dims = tuple(ShardDim(int(s), int(d)) for s, d in obj["dims"])
            return ParallelTensorShape(dims, int(obj.get("sum_degree", 1)), int(obj.get("copy_degree", 1)),
                                       str(obj.get("dtype", "float32")))
        except ShapeError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ShapeError(f"malformed parallel tensor shape {obj!r}: {e}") from None

    def __str__(self) -> str:
        dims = ", ".join(f"{d.size}" if d.degree == 1 else f"{d.size}/{d.degree}" for d in self.dims)
        extra = ""
        if self.sum_degree > 1:
            extra += f" sum={self.sum_degree}"
        if self.copy_degree > 1:
            extra += f" copy={self.copy_degree}"
        dt = "" if self.dtype == "float32" else f" {self.dtype}"
        return f"[{dims}]{extra}{dt}"


def numpy_dtype(dtype: str) -> str:
    """The numpy dtype that holds values of ``dtype`` (numpy has no bfloat16: float32 holds it)."""
    return "float32" if dtype == "bfloat16" else dtype


def logical_shape(sizes: Sequence[int], dtype: str = "float32") -> ParallelTensorShape:
    return ParallelTensorShape.of(sizes, dtype=dtype)
