"""Alpa's inter-operator pass (search/alpa/inter.py): the stage DP against brute force on synthetic
stage costs, operator clustering against brute force, Appendix A's sub-mesh shapes and packing, and the
whole pass on small graphs with a stand-in intra pass (the plan validates, identical layers are solved
once, the 1F1B price is our simulation's)."""
import itertools
import math
import random

import numpy as np
import pytest

from unity_pcg.machine import MachineView
from unity_pcg.pcg import PCG
from unity_pcg.plan import validate_pipeline_field
from unity_pcg.search import pipeline as P
from unity_pcg.search.alpa.inter import (AlpaError, alpa_plan, cluster_costs, cluster_operators, logical_meshes,
                                         mapping_standin, place_submeshes, stage_dp, submesh_shapes)
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper

from .test_pipeline import _chain, machine


# --- the stage DP against brute force ------------------------------------------------------------------

def _brute(t, fit, sizes, T, B):
    """Every cut of the layers into stages and every sequence of sub-mesh shapes covering T devices."""
    L = t.shape[0]
    best = math.inf
    for S in range(1, L + 1):
        for cuts in itertools.combinations(range(1, L), S - 1):
            b = (0,) + cuts + (L,)
            for js in itertools.product(range(len(sizes)), repeat=S):
                if sum(sizes[j] for j in js) != T:
                    continue
                ts = []
                for idx, j in enumerate(js):
                    k, i = b[idx], b[idx + 1] - 1
                    if not math.isfinite(t[k, i, j]) or not fit(S - idx)[k, i, j]:
                        break
                    ts.append(t[k, i, j])
                else:
                    best = min(best, sum(ts) + (B - 1) * max(ts))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_stage_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 5)
    sizes = [1, 2, 4, 8][: rng.randint(2, 4)]
    T = rng.choice([s for s in (2, 4, 6, 8) if s <= 2 * sizes[-1]])
    B = rng.choice([1, 2, 4, 8])
    t = np.full((L, L, len(sizes)), math.inf)
    mem = np.zeros((L, L, len(sizes)))
    act = np.zeros((L, L, len(sizes)))
    for k in range(L):
        for i in range(k, L):
            for j, s in enumerate(sizes):
                if rng.random() < 0.1:
                    continue                       # a stage with no plan on that mesh
                work = sum(rng.uniform(0.5, 2.0) for _ in range(k, i + 1))
                t[k, i, j] = work / s ** rng.uniform(0.6, 1.0) + rng.uniform(0, 0.1)
                mem[k, i, j] = (i - k + 1) / s
                act[k, i, j] = rng.uniform(0.05, 0.4) * (i - k + 1)
    cap = rng.uniform(0.8, 2.0)

    def fit(s):
        return mem + min(s, B) * act <= cap

    dp = stage_dp(t, fit, sizes, T, B)
    want = _brute(t, fit, sizes, T, B)
    assert dp.cost == pytest.approx(want, rel=1e-12) if math.isfinite(want) else dp.cost == math.inf
    if dp.stages:                               # the plan returned is one that scores its cost
        assert sum(sizes[j] for _, _, j in dp.stages) == T
        assert [k for k, _, _ in dp.stages] == [0] + [i for _, i, _ in dp.stages[:-1]]
        assert dp.stages[-1][1] == L
        ts = [t[k, i - 1, j] for k, i, j in dp.stages]
        assert sum(ts) + (B - 1) * max(ts) == pytest.approx(dp.cost, rel=1e-12)


def test_stage_dp_stops_early_once_B_times_t_max_reaches_the_best():
    # two layers on one device: t_max = 1 finds nothing (two stages need two devices), t_max = 2 finds
    # the one-stage plan (64 * 2 = 128); the next bound, 3 (a two-device mesh), is not tried: 64 * 3 >= 128
    t = np.array([[[1.0, 3.0], [2.0, 3.0]], [[math.inf, math.inf], [1.0, 3.0]]])
    dp = stage_dp(t, None, [1, 2], 1, 64)
    assert dp.cost == pytest.approx(2.0 + 63 * 2.0) and dp.stages == ((0, 2, 0),)
    assert dp.t_max_tried == 2
    # with memory refusing the one-stage plan nothing covers the device
    dp = stage_dp(t, np.zeros_like(t, dtype=bool), [1, 2], 1, 4)
    assert dp.cost == math.inf and dp.stages == ()


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
        res = P._resource(m, d, n * k)
        assert res is not None                  # a block inside one node or of whole nodes
        devs = set(res.devices(m))
        assert not devs & used
        used |= devs
    assert used == set(range(N * D))
    with pytest.raises(AlpaError):
        place_submeshes(m, [(1, 1)] * (N * D - 1))


# --- operator clustering (Eq. 6) against brute force --------------------------------------------------

def _skip_chain(batch, widths):
    """A chain of Linear+Relu whose every other layer also reads the block input two back (a skip):
    cuts differ in the bytes they carry."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, widths[0])})
    prev = None
    for i in range(len(widths) - 1):
        w = b.add("Weight", {"name": f"w{i}", "shape": (widths[i], widths[i + 1])})
        y = b.add("Linear", {}, [x, w], name=f"fc{i}")
        y = b.add("Relu", {}, [y], name=f"relu{i}")
        if prev is not None and i % 2 == 1 and widths[i + 1] == widths[i - 1]:
            y = b.add("Add", {}, [y, prev], name=f"skip{i}")
        prev, x = x, y
    b.set_outputs([x])
    return b.finish()


@pytest.mark.parametrize("widths,L,delta", [
    ([64, 64, 64, 64, 64, 64, 64], 3, 0.5),
    ([32, 256, 32, 256, 32, 128, 32], 2, 0.5),
    ([64, 128, 64, 128, 64], 4, 1.0),
])
def test_clustering_minimizes_the_largest_layer_input_under_the_flop_bound(widths, L, delta):
    g = _skip_chain(8, widths)
    roles = GraphCost(g, CostModel(machine(1, 4))).role
    layers, info = cluster_operators(g, roles, L, delta)
    _, C = cluster_costs(g, roles)
    U = len(info.units)
    fl = info.flops
    total = sum(fl)

    def score(bounds):
        return max(C[a, b - 1] if a else 0.0 for a, b in zip(bounds, bounds[1:]))

    bound = (1 + delta) * total / L
    best = math.inf
    for cuts in itertools.combinations(range(1, U), L - 1):
        bounds = (0,) + cuts + (U,)
        if not all(info.valid[c] for c in cuts):
            continue
        if any(sum(fl[a:b]) > bound for a, b in zip(bounds, bounds[1:])):
            continue
        best = min(best, score(bounds))
    assert len(layers) == L and layers[0][0] == 0 and layers[-1][1] == U
    assert all(a < b for a, b in layers) and all(x[1] == y[0] for x, y in zip(layers, layers[1:]))
    assert all(sum(fl[a:b]) <= bound * (1 + 1e-9) for a, b in layers)
    assert score([a for a, _ in layers] + [U]) == pytest.approx(best)


def test_cluster_cost_counts_bytes_read_from_earlier_layers():
    g = _skip_chain(8, [64, 64, 64])           # fc0, relu0, fc1, relu1, skip1 (reads relu0's input x? no: prev)
    roles = GraphCost(g, CostModel(machine(1, 4))).role
    info, C = cluster_costs(g, roles)
    U = len(info.units)
    act = 8 * 64 * 4
    # a layer starting right after the first Relu reads that Relu's output (fc1 and nothing else)
    names = [g.node(info.units[u][-1]).name for u in range(U)]
    k = names.index("fc1")
    assert C[k, k] == act
    assert C[0, U - 1] == 0


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
        calls.append((P._shape_key(sg), mesh, kw["start"]))
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
    r = optimize(g, m, budget_s=5, optimizer="adam")
    assert r.feasible and r.stats["chosen"] == "pipeline" and r.stats["pipeline_stages"] == 1
    assert r.stats["micro_batches"] >= 64 and r.plan.pipeline["micro_batches"] == r.stats["micro_batches"]
    assert max(r.plan.predicted["memory_per_device"].values()) <= cap
