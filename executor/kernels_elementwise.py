"""Torch kernels for :mod:`unity_pcg.ops.elementwise` (registered into :data:`unity_pcg.executor.kernels.KERNELS`).

They follow the numpy reference exactly (ONNX semantics), on one piece of every tensor; none needs the task
context (these operators are element-wise, or reduce only dims that are never partitioned)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import KERNELS

KERNELS.update({
    "Silu": lambda a, xs, c: [F.silu(xs[0])],
    "GeluTanh": lambda a, xs, c: [F.gelu(xs[0], approximate="tanh")],
})
