"""Tiny torch modules for the executor tests, exported to ONNX once per test session."""
from __future__ import annotations

from . import dist_helpers as H


def _torch():
    import torch
    return torch


def mlp() -> str:
    torch = _torch()

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    torch.manual_seed(0)
    return H.export(MLP(), (torch.randn(8, 8),), "mlp", ["x"])
