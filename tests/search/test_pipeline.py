"""Pipeline parallelism (search/pipeline.py): the 1F1B schedule and its simulation, memory in flight,
the stage search against data parallelism, and the plan field."""
import itertools
import json
import math
import random

import numpy as np
import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.memory import memory_per_device
from unity_pcg.search.pipeline import (PipelineError, evaluate_pipeline, in_flight, rebatch, schedule_1f1b, search_pipeline,
                             simulate_1f1b, stage_graph, validate_pipeline_field)
from unity_pcg import plan as plan_mod
from unity_pcg.errors import PlanError
from unity_pcg.evaluate import evaluate
from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec, MachineView, Resource
from unity_pcg.pcg import PCG

from .graphs import mlp

GiB = 2**30


def machine(nodes, per_node, network_bw=10e9, memory=16 * GiB, node_bw=100e9):
    dev = DeviceSpec(100e12, 1e12, memory, {"default": 0.5}, 5e-6)
    links = {"group": LinkSpec(node_bw, 2e-6), "node": LinkSpec(node_bw, 2e-6),
             "network": LinkSpec(network_bw, 5e-6)}
    return MachineSpec("test", nodes, per_node, per_node, dev, links)


# --- the schedule and its simulation ---------------------------------------------------------------

@pytest.mark.parametrize("S,M", [(1, 1), (1, 4), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_schedule_runs_every_micro_batch_once_and_holds_at_most_S_minus_i(S, M):
    for i in range(S):
        order = schedule_1f1b(S, i, M)
        assert sorted(order) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
        live, peak, done_f = 0, 0, set()
        for kind, m in order:
            if kind == "F":
                done_f.add(m)
                live += 1
            else:
                assert m in done_f            # a backward after its forward
                live -= 1
            peak = max(peak, live)
        assert peak == in_flight(S, i, M) == min(S - i, M)


@pytest.mark.parametrize("S,M", [(1, 3), (2, 2), (3, 8), (4, 4), (5, 2)])
def test_equal_stages_give_the_closed_form(S, M):
    f, b, u = 1.5, 3.0, 0.7
    tl = simulate_1f1b([f] * S, [b] * S, M, once=[u] * S)
    assert tl.makespan == pytest.approx((M + S - 1) * (f + b) + u)


def _brute_force(fwd, bwd, M, send, back, once):
    """Longest paths by repeated relaxation over every operation and message (Bellman-Ford style):
    an operation starts after the previous one on its stage and after its input's message arrives;
    a message starts after the operation that produces it and after the previous message on its link
    in the same direction (micro-batch order)."""
    S = len(fwd)
    ops_, dur, deps = [], {}, {}
    for i in range(S):
        order = schedule_1f1b(S, i, M)
        for j, (kind, m) in enumerate(order):
            key = ("op", i, kind, m)
            ops_.append(key)
            dur[key] = fwd[i] if kind == "F" else bwd[i]
            d = [("op", i) + order[j - 1]] if j else []
            if kind == "F" and i > 0:
                d.append(("msgF", i - 1, m))
            if kind == "B":
                d.append(("op", i, "F", m) if i == S - 1 else ("msgB", i, m))
            deps[key] = d
    for i in range(S - 1):
        for m in range(M):
            kf, kb = ("msgF", i, m), ("msgB", i, m)
            ops_ += [kf, kb]
            dur[kf], dur[kb] = send[i], back[i]
            deps[kf] = [("op", i, "F", m)] + ([("msgF", i, m - 1)] if m else [])
            deps[kb] = [("op", i + 1, "B", m)] + ([("msgB", i, m - 1)] if m else [])
    start = {k: 0.0 for k in ops_}
    for _ in range(len(ops_) + 1):
        changed = False
        for k in ops_:
            s = max([start[d] + dur[d] for d in deps[k]], default=0.0)
            if s > start[k] + 1e-15:
                start[k], changed = s, True
        if not changed:
            break
    return max(start[("op", i) + schedule_1f1b(S, i, M)[-1]] + dur[("op", i) + schedule_1f1b(S, i, M)[-1]] + once[i]
               for i in range(S))


@pytest.mark.parametrize("seed", range(8))
def test_unequal_stages_match_a_brute_force_simulation(seed):
    rng = random.Random(seed)
    S, M = rng.randint(1, 5), rng.randint(1, 7)
    fwd = [rng.uniform(0.1, 2.0) for _ in range(S)]
    bwd = [rng.uniform(0.1, 4.0) for _ in range(S)]
    send = [rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(S - 1)]
    back = [rng.uniform(0.0, 1.5) for _ in range(S - 1)]
    once = [rng.uniform(0.0, 1.0) for _ in range(S)]
    tl = simulate_1f1b(fwd, bwd, M, send, back, once)
    assert tl.makespan == pytest.approx(_brute_force(fwd, bwd, M, send, back, once), rel=1e-12)
    # and never below the busiest stage's work or the closed form's lower bound
    assert tl.makespan >= max(M * (f + b) for f, b in zip(fwd, bwd)) - 1e-12


def test_simulation_refuses_inconsistent_input():
    with pytest.raises(ValueError):
        simulate_1f1b([1.0, 1.0], [1.0], 2)
    with pytest.raises(ValueError):
        simulate_1f1b([1.0, 1.0], [1.0, 1.0], 2, send=[1.0, 2.0])


# --- graph surgery ------------------------------------------------------------------------------------

def test_rebatch_scales_inputs_and_reshapes():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 4, 4)})
    y = b.add("Reshape", {"shape": (32, 4)}, [x], name="merge")
    w = b.add("Weight", {"name": "w", "shape": (4, 8)})
    y = b.add("Linear", {}, [y, w], name="fc")
    y = b.add("Reshape", {"shape": (8, 32)}, [y], name="split")
    b.set_outputs([y])
    g = b.finish()
    h = rebatch(g, 8, 2)
    assert [n.id for n in h.nodes()] == [n.id for n in g.nodes()]
    assert h.shape(h.outputs[0]).sizes == (2, 32)
    assert dict(h.node(y[0]).a)["shape"] == (2, 32)
    assert h.shapes(w[0])[0].sizes == (4, 8)            # weights keep their shape


def test_stage_graph_turns_earlier_tensors_into_inputs():
    g = mlp(batch=8, h=16, layers=3)
    roles = GraphCost(g, CostModel(machine(1, 2))).role
    fc1 = next(n.id for n in g.nodes() if n.name == "fc1")
    relu1 = next(n.id for n in g.nodes() if n.name == "relu1")
    sg = stage_graph(g, roles, [fc1, relu1])
    ins = sg.sources("Input")
    assert [n.a["name"] for n in ins] == [f"pipe:{g.node(fc1).inputs[0][0]}:0"]
    assert {n.op for n in sg.nodes()} == {"Input", "Weight", "Linear", "Relu"}
    assert sg.outputs == ((relu1, 0),)


# --- the search ----------------------------------------------------------------------------------------

def _dp_cost(g, mapper, d):
    return mapper.optimize(data_parallel(g, d, combine_outputs=False))


def _check_views_inside_stages(res, m):
    for st in res.stages:
        for nid in st.nodes:
            v = res.views.get(nid)
            if v is not None:
                assert set(v.devices()) <= set(st.devices), (nid, v, st.devices)
    assert sorted(n for st in res.stages for n in st.nodes) == sorted(res.pcg.node_ids())
    validate_pipeline_field(res.to_plan_field(), res.pcg, res.views, m)


def test_pipeline_beats_data_parallel_with_huge_weights_small_batch_slow_network():
    # 8 layers of 2048x2048 (16 MiB each), batch 8, 4 nodes of one device on a 1 GB/s network:
    # data parallel all-reduces 128 MiB of gradients over the network; a 4-stage pipeline sends
    # 64 KiB activations
    g = mlp(batch=8, h=2048, layers=8)
    m = machine(4, 1, network_bw=1e9)
    mapper = MachineMapper(CostModel(m, "adam"))
    dp = _dp_cost(g, mapper, 4)
    res = search_pipeline(g, mapper, max_stages=4)
    assert res is not None and res.feasible
    assert res.num_stages >= 2
    assert res.cost < 0.5 * dp.cost
    _check_views_inside_stages(res, m)
    # the reported makespan is the 1F1B simulation of the reported stages
    tl = simulate_1f1b([s.fwd_s for s in res.stages], [s.bwd_s for s in res.stages], res.micro_batches,
                       [s.send_s for s in res.stages[:-1]], None, [s.once_s for s in res.stages])
    assert res.cost == pytest.approx(tl.makespan)


def test_pipeline_fits_where_data_parallel_does_not():
    # 8 x 16 MiB of weights with Adam = 512 MiB per replica: data parallel cannot fit 300 MiB devices,
    # four stages of two layers (128 MiB each) can
    g = mlp(batch=8, h=2048, layers=8)
    m = machine(4, 1, network_bw=10e9, memory=300 * 2**20)
    mapper = MachineMapper(CostModel(m, "adam"))
    assert not _dp_cost(g, mapper, 4).feasible
    res = search_pipeline(g, mapper, max_stages=4)
    assert res.feasible and res.num_stages >= 3
    assert res.max_memory_bytes <= m.device.memory_bytes


def test_data_parallel_or_better_where_pipelining_does_not_pay():
    # small weights, a large batch, a fast network: data parallel is hard to beat
    g = mlp(batch=64, h=256, layers=4)
    m = machine(1, 4, node_bw=300e9)
    mapper = MachineMapper(CostModel(m, "sgd"))
    dp = _dp_cost(g, mapper, 4)
    res = search_pipeline(g, mapper, max_stages=4)
    assert res.feasible
    assert res.cost <= dp.cost * (1 + 1e-9)
    _check_views_inside_stages(res, m)


def test_memory_counts_the_micro_batches_in_flight():
    # four identical stages (a Linear and a Relu on one device each): stage i holds min(4 - i, M)
    # micro-batches of activations besides its weights
    g = mlp(batch=16, h=64, layers=4)
    m = machine(1, 4, memory=64 * GiB)
    model = CostModel(m, "adam")
    mapper = MachineMapper(model)
    res = search_pipeline(g, mapper, min_stages=4, max_stages=4, micro_batches=4, max_layers=4)
    assert res.num_stages == 4 and res.micro_batches == 4
    gm = rebatch(g, 16, 4)
    roles = GraphCost(gm, model).role
    for i, st in enumerate(res.stages):
        sg = stage_graph(gm, roles, [n.id for n in gm.nodes() if n.name in (f"fc{i}", f"relu{i}")])
        one = mapper.optimize(sg, Resource(0, 1, 1))          # one device: the stage as it is
        rep = memory_per_device(GraphCost(sg, model), one.views)
        w, a = max(rep.weights.values()), max(rep.activations.values())
        assert a > 0 and w > 0
        assert st.in_flight == 4 - i
        assert st.memory_bytes == w + (4 - i) * a


def test_stitched_pipeline_computes_the_model_and_reshards_between_unequal_stages():
    g = mlp(batch=8, h=16, layers=4)
    m = machine(1, 3)
    res = search_pipeline(g, CostModel(m, "sgd"), min_stages=2, max_stages=2, micro_batches=2)
    sizes = [len(s.devices) for s in res.stages]
    assert sorted(sizes) == [1, 2]
    x = np.random.default_rng(3).standard_normal((8, 16)).astype("float32")
    want = evaluate(g, {"x": x})
    got = evaluate(res.pcg, {"x": x}, mode="pieces", rng=np.random.default_rng(0))
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(want, got))
    # each stage runs data parallel over all its devices, so a Combine or a Partition joins them
    stage_of = {n: k for k, st in enumerate(res.stages) for n in st.nodes}
    for st in res.stages:
        assert {res.views[n].degree for n in st.nodes if res.pcg.node(n).op == "Linear"} == {len(st.devices)}
    joins = [n for n in res.pcg.nodes() if n.op in ("Combine", "Partition") and
             stage_of[n.inputs[0][0]] != stage_of[n.id]]
    assert len(joins) == 1 and stage_of[joins[0].id] == 1
    _check_views_inside_stages(res, m)


def test_plan_field_round_trips_through_the_plan_file(tmp_path):
    g = mlp(batch=8, h=2048, layers=4)
    m = machine(2, 1, network_bw=1e9)
    res = search_pipeline(g, CostModel(m, "adam"), min_stages=2, max_stages=2)
    field = res.to_plan_field()
    assert field["schedule"] == "1F1B" and field["micro_batches"] == res.micro_batches
    assert [s["devices"] for s in field["stages"]] == [[0], [1]]
    p = plan_mod.Plan("model.onnx", "0" * 64, m, res.pcg, res.views, {"predicted_iteration_s": res.cost},
                      pipeline=field)
    path = tmp_path / "plan.json"
    p.save(str(path))
    back = plan_mod.load(str(path))
    assert json.loads(json.dumps(back.pipeline)) == field
    assert back.views == res.views
    validate_pipeline_field(back.pipeline, back.pcg, back.views, back.machine)


def test_validate_pipeline_field_refuses_broken_fields():
    g = mlp(batch=8, h=2048, layers=4)
    m = machine(2, 1, network_bw=1e9)
    res = search_pipeline(g, CostModel(m, "adam"), min_stages=2, max_stages=2)
    field = res.to_plan_field()
    bad_views = dict(res.views)
    nid = next(n for n in res.stages[0].nodes if n in bad_views)
    bad_views[nid] = MachineView(1, bad_views[nid].dims)
    with pytest.raises(PlanError, match="leaves the devices"):
        validate_pipeline_field(field, res.pcg, bad_views, m)
    swapped = dict(field, stages=[field["stages"][1], field["stages"][0]])
    with pytest.raises(PlanError, match="contiguous|first consumer"):
        validate_pipeline_field(swapped, res.pcg, res.views, m)
    first = next(n for n in field["stages"][0]["nodes"] if res.pcg.node(n).kind != "source")
    short = dict(field, stages=[dict(field["stages"][0], nodes=[n for n in field["stages"][0]["nodes"] if n != first]),
                                field["stages"][1]])
    with pytest.raises(PlanError, match="no pipeline stage"):
        validate_pipeline_field(short, res.pcg, res.views, m)
    with pytest.raises(PlanError, match="micro_batches"):
        validate_pipeline_field(dict(field, micro_batches=3), res.pcg, res.views, m)
    with pytest.raises(PlanError, match="schedule"):
        validate_pipeline_field(dict(field, schedule="GPipe"), res.pcg, res.views, m)


def test_bad_arguments_are_typed_errors():
    g = mlp(batch=8, h=16, layers=2)
    cm = CostModel(machine(1, 2))
    with pytest.raises(PipelineError, match="does not divide"):
        search_pipeline(g, cm, micro_batches=3)
    with pytest.raises(PipelineError, match="budget"):
        search_pipeline(g, cm, budget_s=0)
    assert search_pipeline(g, cm, min_stages=5) is None       # four units cannot make five stages
    assert math.isfinite(search_pipeline(g, cm, budget_s=5).cost)


def test_one_device_stages_pass_the_executors_pipeline_checks():
    # the executor runs single-device stages (executor/pipeline.py); a plan of such stages from the
    # search must pass its checks before any process starts
    ex = pytest.importorskip("unity_pcg.executor.pipeline")
    g = mlp(batch=8, h=2048, layers=4)
    m = machine(2, 1, network_bw=1e9)
    res = search_pipeline(g, CostModel(m, "adam"), min_stages=2, max_stages=2)
    p = plan_mod.Plan("model.onnx", "0" * 64, m, res.pcg, res.views, {}, pipeline=res.to_plan_field())
    ex.check_pipeline(p)
    M, stages = ex.resolve(p)
    assert M == res.micro_batches and [s.device for s in stages] == [0, 1]


def test_a_parallel_pcg_keeps_its_parallelization_inside_the_stages():
    g = mlp(batch=8, h=16, layers=4)
    pg = data_parallel(g, 2, combine_outputs=True)
    m = machine(1, 4)
    res = search_pipeline(pg, CostModel(m, "sgd"), min_stages=2, max_stages=2)
    assert res.feasible and [len(s.devices) for s in res.stages] == [2, 2]
    assert {res.views[n.id].degree for n in res.pcg.nodes() if n.op == "Linear"} == {2}
    x = np.random.default_rng(5).standard_normal((8, 16)).astype("float32")
    got = evaluate(res.pcg, {"x": x}, mode="pieces", rng=np.random.default_rng(0))
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(evaluate(g, {"x": x}), got))
    _check_views_inside_stages(res, m)


def _chain(batch, widths):
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, widths[0])})
    for i in range(len(widths) - 1):
        w = b.add("Weight", {"name": f"w{i}", "shape": (widths[i], widths[i + 1])})
        x = b.add("Linear", {}, [x, w], name=f"fc{i}")
        x = b.add("Relu", {}, [x], name=f"relu{i}")
    b.set_outputs([x])
    return b.finish()


@pytest.mark.parametrize("widths,shape,net,batch", [
    ([512, 2048, 256, 4096, 512], (1, 4), 20e9, 16),
    ([1024, 1024, 4096, 1024, 64], (4, 1), 2e9, 8),
    ([256, 4096, 4096, 256], (2, 2), 5e9, 32),
])
def test_search_is_near_the_best_of_every_pipeline(widths, shape, net, batch):
    # every cut of the layers, every sequence of sub-meshes covering the machine and every searched
    # micro-batch count (1 and 4 here), each priced exactly: the search's plan is within 5% of the best
    g = _chain(batch, widths)
    m = machine(*shape, network_bw=net, node_bw=net * 10)
    mapper = MachineMapper(CostModel(m, "adam"))
    res = search_pipeline(g, mapper, max_stages=4, max_layers=100, micro_batches=(1, 4))
    L, T = res.stats["layers"], m.num_devices
    best = math.inf
    for M in res.stats["micro_batches_tried"]:
        for S in range(1, 5):
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0,) + cuts + (L,)
                for sizes in itertools.product(range(1, T + 1), repeat=S):
                    if sum(sizes) != T:
                        continue
                    starts = [sum(sizes[:k]) for k in range(S)]
                    stages = [(bounds[k], bounds[k + 1], starts[k], sizes[k]) for k in range(S)]
                    try:
                        r = evaluate_pipeline(g, mapper, stages, M, max_layers=100, stitch=False)
                    except PipelineError:
                        continue                      # a block across a node boundary
                    if r.feasible:
                        best = min(best, r.cost)
    assert res.feasible and best < math.inf
    assert best * (1 - 1e-9) <= res.cost <= 1.05 * best


def test_a_spent_budget_still_returns_the_best_plan_of_the_first_micro_batch_count():
    g = mlp(batch=8, h=2048, layers=8)
    mapper = MachineMapper(CostModel(machine(4, 1, network_bw=1e9), "adam"))
    full = search_pipeline(g, mapper, max_stages=4)
    quick = search_pipeline(g, mapper, max_stages=4, budget_s=1e-9)
    assert len(full.stats["micro_batches_tried"]) > 1
    assert len(quick.stats["micro_batches_tried"]) == 1 and quick.stats["budget_exhausted"]
    assert quick.feasible and quick.cost >= full.cost


def test_communication_volume_counts_boundaries_per_micro_batch_and_sync_once():
    g = mlp(batch=8, h=2048, layers=4)
    m = machine(2, 1, network_bw=1e9)
    mapper = MachineMapper(CostModel(m, "adam"))
    # two one-device stages: only the boundary moves, 8 x 2048 activations forward and gradients back
    two = evaluate_pipeline(g, mapper, [(0, 4, 0, 1), (4, 8, 1, 1)], 4, max_layers=8)
    assert two.stats["layers"] == 8
    assert two.comm_elements == 2 * 8 * 2048
    # one stage, one micro-batch: data parallelism, as the mapping counts it
    one = evaluate_pipeline(g, mapper, [(0, 8, 0, 2)], 1, max_layers=8)
    dp = mapper.optimize(data_parallel(g, 2))
    assert one.comm_elements == dp.breakdown.comm_elements > 0
    assert one.cost == pytest.approx(dp.cost)
    # four micro-batches: the same gradient sync once, the activation transfers (none here) four times
    four = evaluate_pipeline(g, mapper, [(0, 8, 0, 2)], 4, max_layers=8)
    assert four.comm_elements == one.comm_elements
    with pytest.raises(PipelineError, match="does not continue"):
        evaluate_pipeline(g, mapper, [(0, 4, 0, 1), (5, 8, 1, 1)], 4, max_layers=8)
    with pytest.raises(PipelineError, match="cover"):
        evaluate_pipeline(g, mapper, [(0, 4, 0, 1)], 4, max_layers=8)


def test_the_stage_dp_memory_table_matches_holds_on_every_run_of_layers():
    """The stage DP's vectorized ``holds`` per run of layers k..i (pipeline._holds_table) against
    stages.holds on the summed per-device weights and activations (a later layer's received input counted
    in the earlier layer's output)."""
    from types import SimpleNamespace

    from unity_pcg.search.pipeline import _holds_table
    from unity_pcg.search.stages import holds
    rng = random.Random(3)
    for _ in range(200):
        L, cap = rng.randint(1, 6), rng.choice([7.0, 1000.0, 1e10])
        ps = []
        for _ in range(L):
            devs = rng.sample(range(8), rng.randint(1, 5))
            a = {d: rng.randint(1, max(1, int(cap) // 7)) for d in devs if rng.random() < 0.8}
            ps.append(SimpleNamespace(w={d: rng.choice([0, rng.randint(0, int(cap) // 2)]) for d in devs}, a=a,
                                      a_in={d: rng.randint(0, v) for d, v in a.items()}))
        h = _holds_table(ps, cap)
        for k in range(L):
            w, a = {}, {}
            for i in range(k, L):
                for d, v in ps[i].w.items():
                    w[d] = w.get(d, 0) + v
                for d, v in ps[i].a.items():
                    a[d] = a.get(d, 0) + (max(v - ps[i].a_in.get(d, 0), 0) if i > k else v)
                assert h[k, i] == holds(w, a, cap)


def test_the_micro_batch_count_a_caller_found_fast_is_tried_first():
    # 64 is past the default counts of 4 stages (up to 32); under a spent budget only the first count is tried
    g = mlp(batch=64, h=512, layers=8)
    mapper = MachineMapper(CostModel(machine(4, 1, network_bw=1e9), "adam"))
    default = search_pipeline(g, mapper, max_stages=4, budget_s=1e-9)
    assert default.stats["micro_batches_tried"] == [8]
    near = search_pipeline(g, mapper, max_stages=4, budget_s=1e-9, near=64)
    assert near.stats["micro_batches_tried"] == [64]
    full = search_pipeline(g, mapper, max_stages=4, near=64)
    assert 64 in full.stats["micro_batches_tried"] and 32 in full.stats["micro_batches_tried"]
