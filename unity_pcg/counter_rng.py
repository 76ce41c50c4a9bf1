"""Counter-based random numbers: a pure function of (seed, step, node key, stream, logical element index).

A stateful generator's values depend on how a tensor is split (each device draws its own stream); here an
element's value is a hash of its row-major index in the *logical* tensor, so every partitioning -- and one
device -- draws the same tensor.  The hash is a few rounds of a 32-bit integer finalizer written with ``^ >> *
&`` only, so the same functions run on numpy int64 arrays (the numpy reference, :mod:`unity_pcg.ops.random_gen`)
and on torch int64 tensors (the executor: ``executor/dropout.py``, ``executor/kernels.py``); products wrap
modulo 2**64 in int64 and only their low 32 bits are kept (numpy runs it in uint64: :func:`np_bits`).  No torch import here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

M1 = 0x7FEB352D
M2 = 0x846CA68B
MASK32 = 0xFFFFFFFF
TWO32 = 4294967296.0


def mix32(x):
    """A 32-bit integer finalizer (lowbias32) on int64 arrays/tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * M2) & MASK32
    x = x ^ (x >> 16)
    return x


def stream_key(seed: int, step: int, node: int, stream: int = 0) -> int:
    """The 32-bit key of one random tensor: (seed, step, node) -- Dropout's key -- and a stream number
    (0 for Dropout; the generators draw their uniforms from streams 1 and 2)."""
    return ((seed * 0x9E3779B1) ^ (step * 0x85EBCA77) ^ (node * 0xC2B2AE3D) ^ (stream * 0x165667B1)) & MASK32


def hash_index(key: int, index):
    """32 random bits (as int64 values in [0, 2**32)) for every logical element index in ``index``."""
    lo = index & MASK32
    hi = (index >> 32) & MASK32
    h = mix32(lo ^ key)
    h = mix32(h ^ hi ^ 0x27D4EB2F)
    return mix32(h ^ key)


def np_logical_index(sizes: Sequence[int], offset: Sequence[int] | None = None,
                     piece: Sequence[int] | None = None) -> np.ndarray:
    """Row-major linear index, in the logical tensor of ``sizes``, of every element of the block of shape
    ``piece`` (default: all of it) that starts at ``offset`` (default: the origin).  The numpy twin of
    ``executor.dropout.logical_index``."""
    sizes = tuple(int(s) for s in sizes)
    offset = tuple(offset) if offset is not None else (0,) * len(sizes)
    piece = tuple(piece) if piece is not None else sizes
    idx = np.zeros(piece, dtype=np.int64)
    stride = 1
    for d in range(len(sizes) - 1, -1, -1):
        ar = np.arange(offset[d], offset[d] + piece[d], dtype=np.int64) * stride
        shape = [1] * len(sizes)
        shape[d] = piece[d]
        idx = idx + ar.reshape(shape)
        stride *= sizes[d]
    return idx


def np_bits(key: int, index: np.ndarray) -> np.ndarray:
    """:func:`hash_index` on numpy, in uint64 (products of 32-bit values never overflow; same bits as int64)."""
    return hash_index(key, np.asarray(index).astype(np.uint64))


def open_unit(bits):
    """Uniform in the open interval (0, 1) from 32 random bits (float64; never 0, so a log is finite)."""
    return (bits + 0.5) / TWO32


def np_uniform(seed: int, step: int, node: int, index: np.ndarray, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    """Uniform in (low, high) at every logical index (float64)."""
    u = open_unit(np_bits(stream_key(seed, step, node, 1), index).astype(np.float64))
    return low + (high - low) * u


def np_normal(seed: int, step: int, node: int, index: np.ndarray, mean: float = 0.0, scale: float = 1.0
              ) -> np.ndarray:
    """Normal(mean, scale) at every logical index (float64), by Box-Muller from streams 1 and 2."""
    u1 = open_unit(np_bits(stream_key(seed, step, node, 1), index).astype(np.float64))
    u2 = open_unit(np_bits(stream_key(seed, step, node, 2), index).astype(np.float64))
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return mean + scale * z
