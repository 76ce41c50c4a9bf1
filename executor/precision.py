"""The plan's math mode at run time (DESIGN "Executor"; the cost model's precision, DESIGN "Cost model").

``fp32``: float32 everywhere; on CUDA TF32 is turned off for matmuls and convolutions (what the cost model
prices as fp32).  ``tf32``: float32 storage, TF32 matmuls and convolutions on CUDA (a CPU has no TF32 unit:
the same as fp32 there).  ``bf16``: mixed precision as ``torch.autocast`` does it: the forward pass runs
under autocast with bfloat16 (matmuls and convolutions in bf16, autocast's fp32 list in fp32), parameters,
their gradients, the gradient all-reduce and the optimizer states stay float32; the loss is accumulated in
float32.  With pipeline stages each stage's forward runs under autocast and the tensors crossing a stage
boundary (and their gradients) are cast to the PCG's dtype (executor/pipeline.py).
"""
from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "tf32", "bf16")


def set_math_mode(precision: str, device: torch.device) -> None:
    """TF32 on or off for CUDA matmuls/convolutions as the precision says (no effect on CPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    if device.type == "cuda":
        on = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def forward_context(precision: str, device: torch.device):
    """The context the forward pass runs in: autocast to bfloat16 for ``bf16``, else nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
