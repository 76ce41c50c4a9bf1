"""ONNX constants (Constant nodes the importer turns into Weight nodes, such as a GELU's 0.5) are
not parameters: the executor keeps them fixed, so training matches torch, which never trains them."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from . import dist_helpers as H


class _TanhGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc1(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h * h * h)))
        return self.fc2(h)


def test_constants_stay_fixed_and_training_matches_torch():
    from unity_pcg.executor.train import Trainer, model_constants

    m = _TanhGelu()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    path = H.export(m, (x,), "tanh_gelu_consts", ["x"])
    g = H.load(path)
    consts = model_constants(g, path)
    assert consts, "the export should hold Constant nodes that became weights"
    t = Trainer(H.logical_plan(g, path), path, optimizer="sgd", lr=0.05)
    assert not consts & set(t.params)
    import onnx
    assert set(t.params) == {i.name for i in onnx.load(path).graph.initializer}
    feeds = {"x": x.numpy()}
    ours = [t.step(feeds) for _ in range(4)]

    ref = _TanhGelu()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    theirs = []
    for _ in range(4):
        opt.zero_grad()
        loss = ref(x).mean()
        loss.backward()
        opt.step()
        theirs.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
