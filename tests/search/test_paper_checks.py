"""The paper's worked examples as checks of the joint search (Unity Figures 2 and 10)."""
import pytest

from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.optimize import optimize
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG

torch = pytest.importorskip("torch")


def _export(module, args, path):
    torch.onnx.export(module, args, str(path), dynamo=False, input_names=["x"])
    return str(path)


class MLP2(torch.nn.Module):
    def __init__(self, ci=784, h=512, co=10):
        super().__init__()
        self.fc1 = torch.nn.Linear(ci, h, bias=False)
        self.fc2 = torch.nn.Linear(h, co, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _fig2b(g: PCG, k: int = 2) -> PCG:
    """Figure 2b built by hand on the imported graph: the input replicated, the first weight split by
    columns and the second by rows (each device holds h/k hidden units), the partial outputs reduced."""
    b = PCG.builder()
    ref = {}
    for n in g.nodes():
        if n.kind == "source":
            ref[n.id] = b.add(n.op, n.a, [], name=n.name)
    lin = [n for n in g.nodes() if n.op == "Linear"]
    relu = next(n for n in g.nodes() if n.op == "Relu")
    x, w1 = (ref[r[0]] for r in lin[0].inputs)
    _, w2 = lin[1].inputs[0], ref[lin[1].inputs[1][0]]
    y = b.add("Linear", {}, [b.add("Replicate", {"degree": k}, [x]), b.add("Partition", {"dim": 1, "degree": k}, [w1])])
    y = b.add("Relu", {}, [y], name=relu.name)
    y = b.add("Linear", {}, [y, b.add("Partition", {"dim": 0, "degree": k}, [w2])])
    b.set_outputs([b.add("Reduce", {"degree": k}, [y])])
    return b.finish()


def test_figure2_mlp_on_two_devices(tmp_path):
    from unity_pcg.onnx_import import load_onnx
    path = _export(MLP2(), (torch.zeros(64, 784),), tmp_path / "mlp2.onnx")
    res = optimize(path, "summit:1x2", budget_s=600, optimizer="sgd", max_candidates=40)
    b, h, ci, co = 64, 512, 784, 10
    assert res.dp.breakdown.comm_elements == 2 * (ci * h + h * co)      # 813,056: the gradient all-reduces
    assert res.mapping.breakdown.comm_elements <= 4 * b * h              # 131,072
    hand = MachineMapper(CostModel(parse_machine("summit:1x2"), optimizer="sgd")).optimize(
        _fig2b(load_onnx(path, load_weights=False)))
    assert hand.feasible and hand.breakdown.comm_elements <= 4 * b * h
    assert res.predicted_iteration_s <= hand.cost * (1 + 1e-9)
    assert res.predicted_iteration_s < res.dp.cost
    used = {s["rule"] for s in res.plan.rules}
    assert any(r.startswith("megatron") or r.startswith("fig2") for r in used)


class Layer(torch.nn.Module):
    """One Transformer encoder layer (post-LayerNorm, as BERT), bias-free projections."""

    def __init__(self, hidden=4096, heads=32):
        super().__init__()
        self.h, self.n = hidden, heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.ff1 = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.ff2 = torch.nn.Linear(4 * hidden, hidden, bias=False)
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, _ = x.shape
        d = self.h // self.n

        def heads(t):
            return t.reshape(b, s, self.n, d).transpose(1, 2)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1) @ v
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, self.h)))
        return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


@pytest.mark.slow
def test_figure10_transformer_layer_on_dgx_a100(tmp_path):
    path = _export(Layer(), (torch.zeros(4, 512, 4096),), tmp_path / "layer.onnx")
    res = optimize(path, "dgx-a100:1x8", budget_s=300, max_candidates=20)
    g = res.plan.pcg
    assert res.feasible and res.dp.feasible and res.predicted_iteration_s < res.dp.cost
    weights = {n.id: n for n in g.nodes() if n.op == "Weight" and len(n.a["shape"]) == 2}
    for wid, w in weights.items():                      # Q/K/V/O and the two MLP matrices
        r = (wid, 0)
        while len(g.consumers(r)) == 1 and g.node(g.consumers(r)[0][0]).kind == "parallel":
            r = (g.consumers(r)[0][0], 0)
        s = g.shape(r)
        assert s.copy_degree < 8 and max(s.degrees) > 1, f"{w.a['name']} is replicated on all devices"
    reduces = sum(1 for n in g.nodes() if n.op in ("Reduce", "AllReduce"))
    assert reduces <= 4
