"""Substitution search: data parallelism by rules, rule-step replay on a fresh import, best-first search."""
import json

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.optimize import optimize
from unity_pcg.search.substitution import (Candidate, ReplayError, RuleBook, RuleStep, best_first, data_parallel_steps,
                                 normalized_hash, replay, trimmed)
from unity_pcg.substitutions import load_rules
from unity_pcg import plan as P
from unity_pcg.errors import PlanError
from unity_pcg.pcg import PCG

from .graphs import diamond, mlp, n_shape, two_branches


@pytest.fixture(scope="module")
def book():
    return RuleBook(load_rules(), (2, 4))


def shared_input(batch=8, h=16):
    """One activation read by three Linear layers (as Q, K, V) and a weight used twice."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    w = b.add("Weight", {"name": "w", "shape": (h, h)})
    y = b.add("Relu", {}, [x])
    q = b.add("Linear", {}, [y, w])
    k = b.add("Linear", {}, [y, w])
    v = b.add("Gelu", {}, [y])
    s = b.add("Add", {}, [b.add("Add", {}, [q, k]), v])
    b.set_outputs([s])
    return b.finish()


@pytest.mark.parametrize("make", [mlp, diamond, n_shape, two_branches, shared_input])
@pytest.mark.parametrize("degree", [2, 4])
def test_data_parallel_by_rules_is_the_baseline(book, make, degree):
    g = make()
    pg, steps = data_parallel_steps(g, degree, book)
    assert steps and {"partition_combine_cancel"} <= {s.rule for s in steps}
    # rules keep the outputs' shapes (a final Combine); the baseline leaves them partitioned, as plans do
    assert pg.node(pg.outputs[0][0]).op == "Combine"
    assert normalized_hash(trimmed(pg)) == normalized_hash(data_parallel(g, degree))
    assert normalized_hash(trimmed(pg)) != normalized_hash(data_parallel(g, 6 - degree))   # it can fail
    assert replay(g, steps, book).structural_hash() == pg.structural_hash()


def test_step_json_round_trip_and_tampering_is_refused(book):
    g = mlp()
    pg, steps = data_parallel_steps(g, 2, book)
    back = [RuleStep.from_json(json.loads(json.dumps(s.to_json()))) for s in steps]
    assert back == steps
    bad = list(steps)
    s0 = bad[0]
    bad[0] = RuleStep(s0.rule, s0.nodes, s0.inputs, tuple((k, 3 if k == "k" else v) for k, v in s0.bindings))
    with pytest.raises(ReplayError):        # degree 3 does not divide the batch of 8
        replay(g, bad, book)
    with pytest.raises(ReplayError, match="not in the shipped"):
        replay(g, [RuleStep("no_such_rule", s0.nodes, s0.inputs, s0.bindings)], book)
    wrong_site = RuleStep(s0.rule, (max(g.node_ids()),), s0.inputs, s0.bindings)   # a Relu, not a Linear
    with pytest.raises(ReplayError):
        replay(g, [wrong_site], book)


def test_best_first_order_budget_alpha_and_dedup():
    """A synthetic space: integers, neighbours n+1 and n+2, cost |n - 7|; the search must reach 7."""
    def graph(n):
        b = PCG.builder()
        x = b.add("Input", {"name": "x", "shape": (n + 1, 2)})
        b.set_outputs([x])
        return b.finish()

    def size(g):
        return g.shape(g.outputs[0]).sizes[0] - 1

    def evaluate(g):
        return abs(size(g) - 7) + 1.0, None

    def expand(c):
        for d in (1, 2):
            yield graph(size(c.graph) + d), ()

    res = best_first([Candidate(8.0, graph(0), ())], expand, evaluate, alpha=1.0, max_candidates=100)
    assert size(res.best.graph) == 7 and res.stats.duplicates > 0
    small = best_first([Candidate(8.0, graph(0), ())], expand, evaluate, alpha=1.0, max_candidates=2)
    assert small.stats.stopped == "candidates" and size(small.best.graph) < 7
    # interrupted: the best so far comes back
    def boom(stats, best):
        raise KeyboardInterrupt
    res = best_first([Candidate(8.0, graph(0), ())], expand, evaluate, 1.0, 100, progress=boom)
    assert res.stats.stopped == "interrupted" and res.best.cost <= 8.0


def test_best_first_stops_inside_an_expansion_at_its_deadline():
    """One expansion of a large graph applies hundreds of rewrites: the deadline is checked between its
    neighbours, so the search stops inside it (with the best priced so far) instead of after all of them."""
    from unity_pcg.search.budget import Deadline

    from .test_budget import Tick

    def graph(n):
        b = PCG.builder()
        x = b.add("Input", {"name": "x", "shape": (n + 1, 2)})
        b.set_outputs([x])
        return b.finish()

    made = []

    def expand(c):
        for d in range(1, 1001):
            made.append(d)
            yield graph(d), ()

    clock = Tick(1.0)
    res = best_first([Candidate(5.0, graph(0), ())], expand, lambda g: (1.0, None), 1.0, 100,
                     deadline=Deadline(10.0, clock))
    assert res.stats.stopped == "seconds" and len(made) < 20 and res.best.cost == 5.0


def _export_mlp(path, b=16, h=32, ci=24, co=8):
    torch = pytest.importorskip("torch")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(ci, h, bias=False)
            self.fc2 = torch.nn.Linear(h, co, bias=False)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.onnx.export(M(), (torch.zeros(b, ci),), str(path), dynamo=False, input_names=["x"])
    return str(path)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    d = tmp_path_factory.mktemp("models")
    cu = d / "candle_uno.onnx"
    zoo.export("candle_uno", str(cu), size="tiny", batch=12)
    return {"mlp": _export_mlp(d / "mlp.onnx"), "candle_uno": str(cu)}


@pytest.mark.parametrize("name,k", [("mlp", 10), ("candle_uno", 6)])
def test_plan_rule_sequence_replays_on_a_fresh_import(tiny_models, tmp_path, name, k):
    from unity_pcg.onnx_import import load_onnx
    path = tiny_models[name]
    res = optimize(path, "summit:1x2", budget_s=600, max_candidates=2, k=k)
    assert res.plan.rules is not None and len(res.plan.rules) == len(res.steps) > 0
    out = tmp_path / "plan.json"
    res.plan.save(str(out))
    back = P.load(str(out))
    steps = [RuleStep.from_json(s) for s in back.rules]
    fresh = load_onnx(path, load_weights=False)
    assert back.info["outputs_trimmed"]
    got = replay(fresh, steps, trim_outputs=True)
    assert got.structural_hash() == back.pcg.structural_hash() == res.plan.pcg.structural_hash()
    if k == 6:
        assert res.stats["segments"] > 1          # the split path was taken


def test_plan_rules_are_validated_on_load(tiny_models, tmp_path):
    res = optimize(tiny_models["mlp"], "summit:1x2", budget_s=600, max_candidates=1)
    obj = res.plan.to_json()
    assert "rules" in obj
    obj["rules"] = [{"rule": "dp_Linear", "nodes": "3", "inputs": {}}]
    with pytest.raises(PlanError, match="rules\\[0\\].nodes"):
        P.from_json(obj)
    obj["rules"] = {"rule": "x"}
    with pytest.raises(PlanError, match="rules must be a list"):
        P.from_json(obj)
    del obj["rules"]                              # backward compatible: plans without it load
    assert P.from_json(obj).rules is None
