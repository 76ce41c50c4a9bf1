"""Dropout masks from a counter-based hash of (seed, step, node, logical element index).

A mask drawn from a stateful generator depends on how the tensor is split: each device would draw its
own stream.  Here the keep decision of an element is a pure function of its row-major index in the
*logical* tensor (plus the seed, the step and the node), computed with a few rounds of 32-bit integer
mixing (:mod:`unity_pcg.counter_rng`, shared with the numpy reference of the random generators), so every
partitioning of the tensor -- and one device -- draws the same mask.
"""
from __future__ import annotations

from typing import Sequence

import torch

from unity_pcg.counter_rng import hash_index, mix32 as _mix32, stream_key  # noqa: F401  (shared with numpy)


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
    h = hash_index(stream_key(seed, step, node_id), index)
    u = h.to(torch.float64) / 4294967296.0
    return u >= ratio
