"""Alpa's inter-operator pass (search/alpa/inter.py): Appendix A's sub-mesh shapes and packing, and the
whole pass on small graphs with a stand-in intra pass (the plan validates, identical layers are solved
once, the 1F1B price is our simulation's)."""
import random

import numpy as np
import pytest

from unity_pcg.plan import validate_pipeline_field
from unity_pcg.search import pipeline as P
from unity_pcg.search.alpa.inter import (AlpaError, alpa_plan, logical_meshes, mapping_standin, place_submeshes,
                                         submesh_shapes)
from unity_pcg.search.cost import CostModel
from unity_pcg.search.stages import structure_key, sub_mesh
from unity_pcg.search.mapping import MachineMapper

from .test_pipeline import _chain, machine


# --- sub-mesh shapes (Appendix A) ----------------------------------------------------------------------

def test_submesh_shapes_are_appendix_a():
    m = machine(8, 8)
    assert submesh_shapes(m) == [(1, 1), (1, 2), (1, 4), (1, 8)] + [(n, 8) for n in range(2, 9)]
    assert submesh_shapes(machine(1, 4)) == [(1, 1), (1, 2), (1, 4)]
    assert submesh_shapes(machine(2, 6)) == [(1, 1), (1, 2), (1, 6), (2, 6)]
    assert logical_meshes((2, 8), 8, "all") == [(1, 16), (2, 8)]
    assert logical_meshes((1, 8), 8, "all") == [(1, 8), (2, 4), (4, 2), (8, 1)]
    with pytest.raises(AlpaError):
        logical_meshes((1, 8), 8, "nope")


@pytest.mark.parametrize("seed", range(20))
def test_any_multiset_of_shapes_covering_the_cluster_packs_exactly(seed):
    rng = random.Random(seed)
    N, D = rng.choice([(1, 8), (2, 8), (4, 8), (3, 4), (8, 8), (4, 6), (2, 12)])
    m = machine(N, D)
    shapes = submesh_shapes(m)
    left, chosen = N * D, []
    while left:
        sh = rng.choice([s for s in shapes if s[0] * s[1] <= left])
        chosen.append(sh)
        left -= sh[0] * sh[1]
    starts = place_submeshes(m, chosen)
    used = set()
    for (n, k), d in zip(chosen, starts):
        res = sub_mesh(m, d, n * k)
        assert res is not None                  # a block inside one node or of whole nodes
        devs = set(res.devices(m))
        assert not devs & used
        used |= devs
    assert used == set(range(N * D))
    with pytest.raises(AlpaError):
        place_submeshes(m, [(1, 1)] * (N * D - 1))


# --- the whole pass with a stand-in intra pass ---------------------------------------------------------

def test_alpa_plan_validates_and_is_priced_by_our_1f1b_simulation():
    g = _chain(16, [256, 1024, 1024, 1024, 1024, 256])
    m = machine(2, 4, network_bw=5e9)
    mapper = MachineMapper(CostModel(m, "adam"))
    res = alpa_plan(g, m, layers=4, solve=mapping_standin(mapper), mapper=mapper, micro_batches=[1, 4])
    pr = res.pipeline
    assert res.feasible and pr.pcg is not None
    validate_pipeline_field(pr.to_plan_field(), pr.pcg, pr.views, m)
    assert sum(s.resource.size for s in pr.stages) == m.num_devices
    fwd = [s.fwd_s for s in pr.stages]
    bwd = [s.bwd_s for s in pr.stages]
    send = [s.send_s for s in pr.stages][:-1]
    once = [s.once_s for s in pr.stages]
    assert pr.cost == pytest.approx(P.simulate_1f1b(fwd, bwd, res.micro_batches, send, send, once).makespan)
    # the DP's estimate (sum + (B-1) max) and the simulation agree on the stage times alone
    ts = [st["t_s"] for st in res.stages]
    assert res.dp_cost == pytest.approx(sum(ts) + (res.micro_batches - 1) * max(ts))
    assert set(res.stats["micro_batches_tried"]) == {1, 4}


def test_identical_layers_are_solved_once_per_mesh():
    g = _chain(16, [512] * 9)                   # 8 identical Linear+Relu layers
    m = machine(1, 4)
    mapper = MachineMapper(CostModel(m, "adam"))
    calls = []
    base = mapping_standin(mapper)

    def solve(sg, machine_, mesh, **kw):
        calls.append((structure_key(sg), mesh, kw["start"]))
        return base(sg, machine_, mesh, **kw)

    res = alpa_plan(g, m, layers=8, solve=solve, mapper=mapper, micro_batches=2)
    assert res.feasible
    S = len(res.stages)
    profiled = calls[:-S]                       # then each stage of the plan once more, on its own sub-PCG
    assert len(profiled) == len(set(profiled))  # nothing solved twice
    # ranges of identical layers differ only by length (and whether they hold the model's input):
    # at most 2 x 8 structures x 3 meshes, not 36 ranges x 3
    assert len(profiled) <= 2 * 8 * 3 < 36 * 3
    assert res.stats["solves"] == len(calls)


def test_memory_decides_between_plans_as_1f1b_holds_it():
    # a model too big for one device of its memory is split into stages; every stage's busiest device
    # fits with the micro-batches in flight
    g = _chain(32, [2048] * 7)
    m = machine(1, 4, memory=2**28)            # 256 MiB per device: 6 x 64 MiB of weights + states do not fit one
    mapper = MachineMapper(CostModel(m, "adam"))
    res = alpa_plan(g, m, layers=6, solve=mapping_standin(mapper), mapper=mapper, micro_batches=4)
    assert res.feasible and len(res.pipeline.stages) > 1
    assert all(s.memory_bytes <= m.device.memory_bytes for s in res.pipeline.stages)
    with pytest.raises(AlpaError):
        alpa_plan(g, machine(1, 1, memory=2**20), layers=4, solve=mapping_standin(mapper), micro_batches=4)


def test_stages_of_one_structure_share_a_plan_and_the_stitched_pipeline_computes_the_model():
    from unity_pcg.evaluate import evaluate
    from .graphs import mlp
    g = mlp(batch=8, h=64, layers=8)            # 8 identical Linear+Relu layers with real weights
    m = machine(2, 2, memory=2**20)             # 1 MiB per device: two layers of weights + Adam states each
    mapper = MachineMapper(CostModel(m, "adam"))
    calls = []
    base = mapping_standin(mapper)

    def solve(sg, machine_, mesh, **kw):
        calls.append(kw["start"])
        return base(sg, machine_, mesh, **kw)

    res = alpa_plan(g, m, layers=8, solve=solve, mapper=mapper, micro_batches=2)
    pr = res.pipeline
    assert res.feasible and len(pr.stages) == 4
    # stages of one structure at the same offset in a node are solved once (profiling solves at start 0)
    assert sum(1 for c in calls if c) < sum(1 for st in res.stages if st["start"])
    validate_pipeline_field(pr.to_plan_field(), pr.pcg, pr.views, m)
    x = np.random.default_rng(3).standard_normal((8, 64)).astype("float32")
    want = evaluate(g, {"x": x})
    got = evaluate(pr.pcg, {"x": x}, mode="pieces", rng=np.random.default_rng(0))
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(want, got))
    # every stage reads its own weights (renamed from the plan it shares)
    names = [sorted(pr.pcg.node(n).a["name"] for n in st.nodes if pr.pcg.node(n).op == "Weight")
             for st in pr.stages]
    assert sorted(sum(names, [])) == [f"w{i}" for i in range(8)]


def test_bad_micro_batches_are_typed_errors():
    g = _chain(12, [64, 64, 64])
    m = machine(1, 2)
    with pytest.raises(AlpaError):
        alpa_plan(g, m, layers=2, solve=mapping_standin(MachineMapper(CostModel(m))), micro_batches=5)


# --- --strategy alpa (the stand-in intra pass patched in: these test the plumbing) ---------------------

@pytest.fixture
def standin(monkeypatch):
    from unity_pcg.search.alpa import inter
    from unity_pcg.search.cost import CostModel as CM

    def default_solve():
        def solve(g, machine_, mesh, **kw):
            return mapping_standin(MachineMapper(CM(machine_, kw.get("optimizer", "adam"))))(g, machine_, mesh, **kw)
        return solve
    monkeypatch.setattr(inter, "_default_solve", default_solve)
    real = inter.alpa_plan

    def small(*a, **kw):                        # few layers and one micro-batch count: seconds, not minutes
        return real(*a, **dict(kw, layers=4, micro_batches=2))
    monkeypatch.setattr(inter, "alpa_plan", small)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("g") / "gpt.onnx"
    zoo.export("gpt_350m", str(p), size="tiny", batch=8)
    return str(p)


def test_optimize_and_simulate_strategy_alpa(standin, tiny_gpt, tmp_path, capsys):
    import json

    from unity_pcg.cli import main
    from unity_pcg.plan import load as load_plan
    from unity_pcg.search.optimize import STRATEGIES, optimize
    assert "alpa" in STRATEGIES
    # a budget the planner never reaches (it stops by it: simulate, without one, must give the same plan)
    r = optimize(tiny_gpt, "dgx-a100:1x4", strategy="alpa", budget_s=120)
    assert not r.stats["alpa"]["deadline_hit"]
    assert r.feasible and r.stats["chosen"] == "alpa" and r.plan.pipeline is not None
    out = tmp_path / "plan.json"
    r.plan.save(str(out))
    back = load_plan(str(out))                  # validates the pipeline field against the PCG
    assert back.pipeline["micro_batches"] == r.stats["micro_batches"]
    assert main(["simulate", tiny_gpt, "--machine", "dgx-a100:1x4", "--strategy", "alpa", "--json",
                 "-o", str(tmp_path / "sim.json")]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["strategy"] == "alpa" and js["feasible"]
    assert js["predicted_iteration_s"] == pytest.approx(r.predicted_iteration_s, rel=1e-9)
    load_plan(str(tmp_path / "sim.json"))
    assert main(["simulate", tiny_gpt, "--machine", "dgx-a100:1x4", "--strategy", "alpa"]) == 0
    assert "alpa (" in capsys.readouterr().out


# --- what the comparison with Alpa added to Unity's search (search/optimize.py) -----------------------

def test_unity_plans_gradient_accumulation_where_the_full_batch_does_not_fit():
    # Alpa's GPT plans at batch 1,024 are one stage with many micro-batches; Unity's pipeline stage
    # now includes that plan, on one device too, with micro-batch counts beyond 8 per stage
    from unity_pcg.search.optimize import optimize
    from .graphs import mlp
    g = mlp(batch=256, h=512, layers=4)
    model = CostModel(machine(1, 1), "adam")
    full = MachineMapper(model).optimize(g)
    w = max(full.memory.weights.values())
    a = max(full.memory.activations.values())
    cap = int(w + a / 2)                        # the full batch does not fit; 64 micro-batches do
    m = machine(1, 1, memory=cap)
    # (memory techniques off: recomputation alone would also fit the full batch here)
    r = optimize(g, m, budget_s=10, optimizer="adam", memory_techniques=False)
    assert r.feasible and r.plan.pipeline is not None and len(r.plan.pipeline["stages"]) == 1, r.stats["chosen"]
    assert r.plan.pipeline["micro_batches"] >= 2
    assert max(r.plan.predicted["memory_per_device"].values()) <= cap
