"""Dropout masks from a counter-based hash of (seed, step, node, logical element index).

A mask drawn from a stateful generator depends on how the tensor is split: each device would draw its
own stream.  Here the keep decision of an element is a pure function of its row-major index in the
*logical* tensor (plus the seed, the step and the node), computed with a few rounds of 32-bit integer
mixing in torch, so every partitioning of the tensor -- and one device -- draws the same mask.
"""
from __future__ import annotations

from typing import Sequence

import torch

_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    return x


def logical_index(sizes: Sequence[int], offset: Sequence[int], piece: Sequence[int], device) -> torch.Tensor:
    """Row-major linear index, in the logical tensor of ``sizes``, of every element of the piece of
    shape ``piece`` that starts at ``offset``."""
    idx = torch.zeros(tuple(piece), dtype=torch.int64, device=device)
    stride = 1
    for d in range(len(sizes) - 1, -1, -1):
        ar = torch.arange(offset[d], offset[d] + piece[d], dtype=torch.int64, device=device) * stride
        shape = [1] * len(sizes)
        shape[d] = piece[d]
        idx = idx + ar.reshape(shape)
        stride *= sizes[d]
    return idx


def dropout_keep(seed: int, step: int, node_id: int, index: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep-mask of Dropout: a hash of (seed, step, node, logical index), so every partitioning of the
    tensor draws the same mask as one device."""
    key = ((seed * 0x9E3779B1) ^ (step * 0x85EBCA77) ^ (node_id * 0xC2B2AE3D)) & _MASK32
    lo = index & _MASK32
    hi = (index >> 32) & _MASK32
    h = _mix32(lo ^ key)
    h = _mix32(h ^ hi ^ 0x27D4EB2F)
    h = _mix32(h ^ key)
    u = h.to(torch.float64) / 4294967296.0
    return u >= ratio
