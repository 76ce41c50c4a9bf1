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


def mlp_nobias() -> str:
    """Two bias-free Linear layers with a ReLU between them (the Megatron MLP pattern) and a third."""
    torch = _torch()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16, bias=False)
            self.b = torch.nn.Linear(16, 8, bias=False)
            self.c = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x):
            return self.c(self.b(torch.relu(self.a(x))))
    torch.manual_seed(1)
    return H.export(M(), (torch.randn(8, 8),), "mlp_nobias", ["x"])


def attention() -> str:
    """One self-attention block: heads split by reshape/transpose, two batched matmuls, softmax."""
    torch = _torch()

    class A(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8, bias=False)
            self.k = torch.nn.Linear(8, 8, bias=False)
            self.v = torch.nn.Linear(8, 8, bias=False)
            self.o = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).reshape(b, s, 2, 4).transpose(1, 2)
            k = self.k(x).reshape(b, s, 2, 4).permute(0, 2, 3, 1)
            v = self.v(x).reshape(b, s, 2, 4).transpose(1, 2)
            p = torch.softmax(torch.matmul(q, k) * 0.5, dim=-1)
            y = torch.matmul(p, v).transpose(1, 2).reshape(b, s, 8)
            return self.o(y)
    torch.manual_seed(2)
    return H.export(A(), (torch.randn(2, 4, 8),), "attention", ["x"])


def convnet() -> str:
    """1x1 convolution (spatially splittable), BatchNorm, ReLU, dropout, 2x2 pooling."""
    torch = _torch()

    class C(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.conv2 = torch.nn.Conv2d(4, 4, 1, bias=False)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(x)))
            return self.drop(self.conv2(y))
    torch.manual_seed(3)
    m = C()
    m.train()  # keep BatchNorm and Dropout in the exported graph
    return H.export(m, (torch.randn(4, 3, 4, 4),), "convnet", ["x"])


def embedding() -> str:
    """An embedding table followed by a Linear layer."""
    torch = _torch()

    class E(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.lin = torch.nn.Linear(8, 4, bias=False)

        def forward(self, idx):
            return self.lin(self.emb(idx))
    torch.manual_seed(4)
    return H.export(E(), (torch.randint(0, 10, (4, 3)),), "embedding", ["idx"])


def dropout_mlp() -> str:
    """x @ W1 + b1 -> Relu -> Dropout(0.3) -> @ W2, written with onnx.helper (the torch exporter marks
    Dropout with a training-mode input the importer refuses)."""
    import os

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    path = os.path.join(H.model_dir(), "dropout_mlp.onnx")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.4).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((8, 4)) * 0.4).astype(np.float32), "w2"),
             numpy_helper.from_array(np.asarray(0.3, dtype=np.float32), "ratio")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]), helper.make_node("Dropout", ["h2", "ratio"], ["h3"]),
             helper.make_node("MatMul", ["h3", "w2"], ["out"])]
    graph = helper.make_graph(nodes, "dropout_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def bn_net() -> str:
    """Convolution, BatchNorm (momentum 0.1), ReLU, convolution: no dropout, so torch's own training of
    the module is a reference for the running statistics."""
    torch = _torch()

    class C(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)
            self.bn = torch.nn.BatchNorm2d(4, momentum=0.2)
            self.conv2 = torch.nn.Conv2d(4, 2, 1, bias=False)

        def forward(self, x):
            return self.conv2(torch.relu(self.bn(self.conv(x))))
    torch.manual_seed(6)
    m = C()
    with torch.no_grad():                    # non-trivial starting statistics
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 1.5)
    m.train()
    return H.export(m, (torch.randn(4, 3, 4, 4),), "bn_net", ["x"])


def wide_mlp() -> str:
    """Four 256-wide Linear layers on a batch of 2: the weights far outweigh the activations (what ZeRO-3
    and autocast's converted weights change shows in the memory)."""
    torch = _torch()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))

        def forward(self, x):
            for i, lin in enumerate(self.layers):
                x = lin(x) if i == 3 else torch.relu(lin(x))
            return x
    torch.manual_seed(2)
    return H.export(M(), (torch.randn(2, 256),), "wide_mlp", ["x"])
