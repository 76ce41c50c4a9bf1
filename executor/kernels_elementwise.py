"""Torch kernels for :mod:`unity_pcg.ops.elementwise` (registered into :data:`unity_pcg.executor.kernels.KERNELS`).

They follow the numpy reference (ONNX semantics) on one piece of every tensor; none needs the task context:
these operators are element-wise, or reduce only dims that are never partitioned."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import KERNELS


def _axes(a, x) -> list[int]:
    return sorted({ax % x.dim() for ax in a["axes"]}) if a["axes"] else list(range(x.dim()))


def _reduce(fn):
    def k(a, xs, ctx):
        x = xs[0]
        axes = _axes(a, x)
        if not axes:
            return [x]
        return [fn(x, axes, bool(a["keepdims"]))]
    return k


def _prod(x, axes, keep):
    for ax in sorted(axes, reverse=True):   # torch.prod takes one dim at a time
        x = torch.prod(x, dim=ax, keepdim=keep)
    return x


def _celu(a, xs, c):
    alpha = float(a["alpha"])
    x = xs[0]
    return [torch.clamp(x, min=0) + torch.clamp(alpha * torch.expm1(torch.clamp(x, max=0) / alpha), max=0)]


def _leaky_relu(a, xs, c):
    x = xs[0]
    return [torch.where(x >= 0, x, x * float(a["alpha"]))]


def _elu(a, xs, c, gamma=1.0):
    x = xs[0]
    y = torch.where(x > 0, x, float(a["alpha"]) * torch.expm1(torch.clamp(x, max=0)))
    return [y * gamma if gamma != 1.0 else y]


def _rms_norm(a, xs, ctx):
    x = xs[0]
    dims = list(range(a["axis"] % x.dim(), x.dim()))
    y = x * torch.rsqrt(torch.mean(x * x, dim=dims, keepdim=True) + float(a["eps"]))
    return [y * xs[1] if len(xs) > 1 else y]


KERNELS.update({
    "Silu": lambda a, xs, c: [F.silu(xs[0])],
    "GeluTanh": lambda a, xs, c: [F.gelu(xs[0], approximate="tanh")],
    "LeakyRelu": _leaky_relu,
    "Elu": _elu,
    "Selu": lambda a, xs, c: _elu(a, xs, c, float(a["gamma"])),
    "Celu": _celu,
    "Softplus": lambda a, xs, c: [torch.logaddexp(xs[0], torch.zeros_like(xs[0]))],
    "Softsign": lambda a, xs, c: [F.softsign(xs[0])],
    "Mish": lambda a, xs, c: [F.mish(xs[0])],
    "HardSigmoid": lambda a, xs, c: [torch.clamp(xs[0] * float(a["alpha"]) + float(a["beta"]), 0.0, 1.0)],
    "HardSwish": lambda a, xs, c: [F.hardswish(xs[0])],
    "Abs": lambda a, xs, c: [torch.abs(xs[0])],
    "Log": lambda a, xs, c: [torch.log(xs[0])],
    "PRelu": lambda a, xs, c: [torch.where(xs[0] >= 0, xs[0], xs[0] * xs[1])],
    "RMSNorm": _rms_norm,
    "LogSoftmax": lambda a, xs, c: [torch.log_softmax(xs[0], dim=a["axis"] % xs[0].dim())],
    "ReduceMax": _reduce(lambda x, ax, k: torch.amax(x, dim=ax, keepdim=k)),
    "ReduceMin": _reduce(lambda x, ax, k: torch.amin(x, dim=ax, keepdim=k)),
    "ReduceProd": _reduce(_prod),
    "ReduceL2": _reduce(lambda x, ax, k: torch.sqrt(torch.sum(x * x, dim=ax, keepdim=k))),
    "ReduceLogSumExp": _reduce(lambda x, ax, k: torch.logsumexp(x, dim=ax, keepdim=k)),
})

