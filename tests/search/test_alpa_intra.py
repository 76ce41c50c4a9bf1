"""Alpa's intra-operator ILP (unity_pcg.search.alpa.intra) in our cost model."""
import math
from itertools import product

import numpy as np
import pytest

from unity_pcg.errors import UnityError
from unity_pcg.evaluate import evaluate, random_feeds
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search.alpa.intra import (AlpaError, IntraInfeasible, IntraProblem, Layout, Mesh, convert,
                                         enumerate_algos, solve_intra)
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper

from .graphs import diamond, mlp

DGX = parse_machine("dgx-a100:1x8")


def _same_function(g, pg, seed=0):
    feeds = random_feeds(g, seed=seed, int_high=2)
    rng = np.random.default_rng(seed + 1)
    for n in g.sources("Weight"):
        name = n.a["name"]
        if name not in g.weights and name not in feeds:
            v = rng.standard_normal(n.a["shape"]).astype("float32")
            feeds[name] = np.abs(v) + 0.5 if name.endswith(".v") else v      # BatchNorm variances
    a = evaluate(g, feeds)
    b = evaluate(pg, feeds, mode="pieces", rng=np.random.default_rng(seed))
    return all(np.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(a, b))


def _attention(batch=2, seq=8, hidden=16, heads=4, ffn=32):
    """A small pre-LN Transformer layer as the importer gives it (bias Adds, heads by Reshape/Transpose)."""
    hd = hidden // heads
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, seq, hidden)})

    def w(name, shape):
        return b.add("Weight", {"name": name, "shape": shape})

    def dense(inp, k, n, name):
        y = b.add("Linear", {}, [inp, w(f"{name}.w", (k, n))], name=name)
        return b.add("Add", {}, [w(f"{name}.b", (n,)), y], name=f"{name}/bias")

    def heads_of(t, perm, name):
        r = b.add("Reshape", {"shape": (batch, seq, heads, hd)}, [t], name=f"{name}/reshape")
        return b.add("Transpose", {"perm": perm}, [r], name=f"{name}/transpose")
    y = b.add("LayerNorm", {"axis": -1}, [x, w("ln.g", (hidden,)), w("ln.b", (hidden,))], name="ln")
    q = heads_of(dense(y, hidden, hidden, "q"), (0, 2, 1, 3), "q")
    k = heads_of(dense(y, hidden, hidden, "k"), (0, 2, 3, 1), "k")
    v = heads_of(dense(y, hidden, hidden, "v"), (0, 2, 1, 3), "v")
    s = b.add("Scale", {"factor": hd ** -0.5}, [b.add("BatchMatMul", {}, [q, k], name="scores")], name="scale")
    ctx = b.add("BatchMatMul", {}, [b.add("Softmax", {"axis": -1}, [s], name="softmax"), v], name="context")
    ctx = b.add("Reshape", {"shape": (batch, seq, hidden)},
                [b.add("Transpose", {"perm": (0, 2, 1, 3)}, [ctx], name="ctx/transpose")], name="ctx/reshape")
    a = b.add("Add", {}, [x, dense(ctx, hidden, hidden, "out")], name="residual")
    h = b.add("Gelu", {}, [dense(a, hidden, ffn, "fc1")], name="gelu")
    b.set_outputs([b.add("Add", {}, [a, dense(h, ffn, hidden, "fc2")], name="residual2")])
    return b.finish()


def _convnet(batch=4, c=8, hw=8, classes=4):
    """A ResNet-like block: conv -> BatchNorm -> relu -> conv -> BatchNorm, residual add, relu, global
    pool, flatten, linear."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, c, hw, hw)})

    def w(name, shape):
        return b.add("Weight", {"name": name, "shape": shape})

    def conv_bn(t, name):
        y = b.add("Conv2d", {"padding": (1, 1, 1, 1)}, [t, w(f"{name}.w", (c, c, 3, 3))], name=name)
        stats = [w(f"{name}.bn.{k}", (c,)) for k in ("g", "b", "m", "v")]
        return b.add("BatchNorm", {}, [y] + stats, name=f"{name}/bn")
    y = b.add("Relu", {}, [conv_bn(x, "conv1")], name="relu1")
    y = b.add("Relu", {}, [b.add("Add", {}, [x, conv_bn(y, "conv2")], name="residual")], name="relu2")
    y = b.add("Pool2d", {"kind": "avg", "global_pool": True}, [y], name="pool")
    y = b.add("Flatten", {"axis": 1}, [y], name="flatten")
    b.set_outputs([b.add("Linear", {}, [y, w("fc.w", (c, classes))], name="fc")])
    return b.finish()


def _dp_time(g, machine, d, optimizer="adam"):
    r = MachineMapper(CostModel(machine, optimizer=optimizer)).optimize(data_parallel(g, d))
    return r.cost, r.memory.max_bytes


# --- the ILP is exact: it equals brute force over the same cost function --------------------------------

@pytest.mark.parametrize("graph,mesh", [(lambda: mlp(batch=8, h=16, layers=3), (2, 2)),
                                        (lambda: mlp(batch=64, h=512, layers=3), (1, 4)),
                                        (lambda: diamond(batch=8, h=16), (2, 2)),
                                        (lambda: diamond(batch=1024, h=64), (1, 4))])
def test_ilp_equals_brute_force(graph, mesh):
    prob = IntraProblem(graph(), DGX, mesh)
    counts = [len(prob.algos[a]) for a in prob.anchors]
    assert prod_(counts) <= 30000 and len(prob.anchors) >= 2
    combos = [dict(zip(prob.anchors, c)) for c in product(*[range(k) for k in counts])]
    objs = [prob.objective(c) for c in combos]
    mems = [prob.memory(c) for c in combos]
    choice, obj, status, _ = prob.solve(None)
    assert status == "optimal"
    assert obj == pytest.approx(min(objs), rel=1e-6, abs=1e-12)
    # under memory budgets too (the tightest ones make the LP relaxation fractional: the MIP runs):
    # brute force over the choices that fit
    levels = sorted(set(mems))
    for budget in {levels[1], levels[len(levels) // 5], levels[len(levels) // 3]}:
        fit = min(o for o, m in zip(objs, mems) if m <= budget)
        choice, obj, _, _ = prob.solve(budget)
        assert prob.memory(choice) <= budget * (1 + 1e-9)
        assert obj == pytest.approx(fit, rel=1e-6, abs=1e-12)
        choice, obj, _, _ = prob.solve(budget, mip_gap=0.05)          # a looser gap: within it, and fits
        assert prob.memory(choice) <= budget * (1 + 1e-9) and fit * (1 - 1e-9) <= obj <= fit * 1.05 + 1e-12
    with pytest.raises(IntraInfeasible):
        prob.solve(levels[0] * 0.99)


def prod_(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def test_cbc_agrees_with_highs():
    pytest.importorskip("pulp")
    prob = IntraProblem(mlp(batch=8, h=16, layers=3), DGX, (2, 2))
    for budget in (None, 5000.0):         # the LP path, and the MIP (the budget makes the LP fractional)
        _, a, _, _ = prob.solve(budget, solver="highs")
        _, b, _, _ = prob.solve(budget, solver="cbc")
        assert a == pytest.approx(b, rel=1e-6)


# --- algorithms come from the registry's labels ------------------------------------------------------------

def test_algorithms_from_labels():
    g = mlp(batch=8, h=16, layers=1)
    fc = next(n.id for n in g.nodes() if n.op == "Linear")
    mesh = Mesh(2, 2, 0)
    algos = enumerate_algos(g, fc, mesh)
    assigns = {a.assign for a in algos}
    # Linear's labels b0 (batch), k (contracted), n: each mesh axis to one of them or none
    assert (("b0", (0,)), ("n", (1,))) in assigns             # S0 x S1 -> (S0, S1), Table 3 #1
    assert (("b0", (0, 1)),) in assigns                        # S01: both axes on the batch
    assert () in assigns                                       # fully replicated
    contracted = [a for a in algos if any(l == "k" for l, _ in a.assign)]
    assert contracted and {a.resolve for a in contracted} >= {"ar", ("rs", 0)}
    assert all(l in ("b0", "k", "n") for a in algos for l, _ in a.assign)
    # Softmax's normalized axis is unshardable: never assigned
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 8)})
    b.set_outputs([b.add("Softmax", {"axis": -1}, [x])])
    sm = b.finish()
    algos = enumerate_algos(sm, 1, mesh)
    assert algos and all(l == "d0" for a in algos for l, _ in a.assign)


def test_resharding_chain_is_our_parallel_operators():
    mesh = Mesh(2, 2, 4)
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 8)})
    views = {}
    y = convert(b, x, Layout.whole(2), Layout(((0,), (1,)), (), ()), mesh, views)
    z = convert(b, y, Layout(((0,), (1,)), (), ()), Layout(((0, 1), ()), (), ()), mesh, views)
    r = convert(b, z, Layout(((0, 1), ()), (), ()), Layout(((), ()), (), (0, 1)), mesh, views)
    b.set_outputs([r])
    g = b.finish()
    assert [n.op for n in g.nodes()][1:] == ["Partition", "Partition", "Combine", "Partition", "Combine",
                                             "Replicate"]
    assert g.shape(r).copy_degree == 4 and all(v.is_valid(DGX) and min(v.devices()) >= 4 for v in views.values())
    with pytest.raises(Exception):   # copies cannot be dropped: R -> S is not a parallel operator
        convert(b, r, Layout(((), ()), (), (0, 1)), Layout(((0,), ()), (), (1,)), mesh, {})


# --- plans: the right shape for the sizes, valid PCGs, the same function ---------------------------------

def test_mlp_big_batch_is_data_parallel():
    g = mlp(batch=4096, h=256, layers=2)
    p = solve_intra(g, DGX, (1, 8))
    for n in p.pcg.nodes():
        if n.op == "Linear":
            x, w = p.pcg.input_shapes(n.id)
            assert x.degrees[0] == 8 and w.copy_degree == 8, p.specs
    dp, _ = _dp_time(g, DGX, 8)
    assert p.time_s <= dp * (1 + 1e-9)
    assert p.time_s == pytest.approx(p.objective, rel=1e-6)
    q = solve_intra(g, DGX, (1, 8), price=False)       # the same plan, not priced again
    assert q.specs == p.specs and q.time_s == q.objective and q.memory_bytes == p.stats["ilp_memory_bytes"]


def test_mlp_huge_weights_are_tensor_parallel():
    g = mlp(batch=8, h=8192, layers=2)
    p = solve_intra(g, DGX, (1, 8))
    for n in p.pcg.nodes():
        if n.op == "Linear":
            w = p.pcg.input_shapes(n.id)[1]
            assert w.copy_degree == 1 and w.shard_degree == 8, p.specs
    dp, dp_mem = _dp_time(g, DGX, 8)
    assert p.time_s < dp / 5 and p.memory_bytes < dp_mem / 4


@pytest.mark.parametrize("graph,mesh,start", [(lambda: _attention(), (2, 2), 4),
                                              (lambda: _attention(), (1, 4), 0),
                                              (lambda: mlp(batch=8, h=16, layers=2), (2, 4), 0),
                                              (lambda: diamond(batch=8, h=16), (2, 2), 0),
                                              (lambda: _convnet(), (2, 2), 0)])
def test_plan_validates_and_computes_the_same_function(graph, mesh, start):
    g = graph()
    p = solve_intra(g, DGX, mesh, start=start)
    p.pcg.check()
    assert _same_function(g, p.pcg)
    devs = set()
    for nid, v in p.views.items():
        assert v.is_valid(DGX)
        devs |= set(v.devices())
    assert devs <= set(range(start, start + mesh[0] * mesh[1]))
    assert math.isfinite(p.time_s) and p.memory_bytes > 0 and p.stats["feasible"]
    # the plan as the rest of the project prices it: the mapper's own search does no worse
    r = MachineMapper(CostModel(DGX)).optimize(p.pcg, fixed=p.views)
    assert r.cost == pytest.approx(p.time_s, rel=1e-6)


def test_attention_on_a_mesh_beats_or_matches_data_parallel():
    g = _attention(batch=8, seq=512, hidden=1024, heads=16, ffn=4096)
    p = solve_intra(g, DGX, (2, 4))
    dp, _ = _dp_time(g, DGX, 8)
    assert p.time_s <= dp * (1 + 1e-6)
    assert p.time_s == pytest.approx(p.objective, rel=0.05)


def test_broadcast_operand_does_not_capture_the_batch_split():
    """BERT's embeddings: word embedding (batch, seq, h) + position embedding (1, seq, h).  The Add is
    merged into the full-size operand, so data parallelism stays reachable (merged into the position
    lookup, the Add could never split the batch)."""
    batch, seq, vocab, h = 64, 16, 512, 64
    b = PCG.builder()
    ids = b.add("Input", {"name": "ids", "shape": (batch, seq), "dtype": "int64"})
    pos = b.add("Weight", {"name": "pos_ids", "shape": (1, seq), "dtype": "int64"})
    word = b.add("Embedding", {}, [ids, b.add("Weight", {"name": "wte", "shape": (vocab, h)})], name="word")
    where = b.add("Embedding", {}, [pos, b.add("Weight", {"name": "wpe", "shape": (seq, h)})], name="position")
    x = b.add("Add", {}, [word, where], name="sum")
    y = b.add("Linear", {}, [x, b.add("Weight", {"name": "w", "shape": (h, h)})], name="fc")
    b.set_outputs([b.add("Relu", {}, [y], name="relu")])
    g = b.finish()
    dgx4 = parse_machine("dgx-a100:1x4")     # the dp baseline on 8 devices would run branches side by side
    p = solve_intra(g, dgx4, (1, 4))
    dp, _ = _dp_time(g, dgx4, 4)
    # within the one term the ILP cannot price exactly: the executor pays each gradient bucket's
    # all-reduce latency once per step, whatever share of the weights is replicated (the ILP spreads it
    # over the whole step's gradient bytes, additively per weight)
    assert p.time_s <= dp * 1.02
    prob = IntraProblem(g, dgx4, (1, 4))
    word = next(n.id for n in g.nodes() if n.name == "word")
    assert [g.node(m).name for m in prob.members[word]] == ["word", "sum"]


# --- memory --------------------------------------------------------------------------------------------------

def test_memory_budget_forces_another_plan_and_an_infeasible_one_is_a_typed_error():
    g = mlp(batch=2048, h=2048, layers=2)
    free = solve_intra(g, DGX, (1, 8))
    dp, dp_mem = _dp_time(g, DGX, 8)
    assert free.time_s <= dp * (1 + 1e-9)
    budget = free.memory_bytes * 0.8      # the free plan reduce-scatters fc1's partial sums (36 MiB a device)
    tight = solve_intra(g, DGX, (1, 8), memory_budget=budget)
    assert tight.specs != free.specs
    assert tight.memory_bytes <= budget and tight.time_s >= free.time_s
    with pytest.raises(IntraInfeasible) as e:
        solve_intra(g, DGX, (1, 8), memory_budget=2**20)
    assert isinstance(e.value, UnityError) and "\n" not in str(e.value) and "memory budget" in str(e.value)
    assert "needs -" not in str(e.value) and ("the leanest it found needs" in str(e.value) or "none was found" in str(e.value))


def test_weight_update_sharding_shards_the_weights():
    g = mlp(batch=16384, h=512, layers=2)    # data parallel (smaller batches: Megatron with a reduce-scatter)
    plain = solve_intra(g, DGX, (1, 8))
    zero = solve_intra(g, DGX, (1, 8), weight_update_sharding=True)
    assert zero.memory_bytes < plain.memory_bytes
    assert zero.pcg.op_counts()["Identity"] == 2            # one shard task per weight
    for n in zero.pcg.nodes():
        if n.op == "Identity":
            assert zero.pcg.input_shapes(n.id)[0].copy_degree == 1
    small = mlp(batch=16, h=16, layers=2)
    assert _same_function(small, solve_intra(small, DGX, (1, 8), weight_update_sharding=True).pcg)


def test_bad_mesh_and_parallel_graph_are_typed_errors():
    g = mlp(batch=8, h=16, layers=1)
    with pytest.raises(AlpaError, match="does not fit"):
        solve_intra(g, DGX, (4, 4))
    with pytest.raises(AlpaError, match="logical PCG"):
        solve_intra(data_parallel(g, 2), DGX, (1, 2))


# --- the executor trains an Alpa plan exactly as one process does (slow: 4 gloo processes) ---------------------

@pytest.mark.slow
def test_executor_trains_alpa_plans_like_one_process():
    pytest.importorskip("torch")
    from unity_pcg.machine import local

    from ..executor import dist_helpers as H
    from ..executor import models
    cases, refs, names = [], [], []
    for make in (models.mlp_nobias, models.attention):
        path = make()
        g = H.load(path)
        ref = H.reference(path, 3)
        for mesh, zero in (((2, 2), False), ((1, 4), False), ((2, 2), True)):
            p = solve_intra(g, local(1, 4), mesh, weight_update_sharding=zero)
            cases.append(H.case(H.make_plan(p.pcg, path, 4, views=p.views), path, steps=3))
            refs.append(ref)
            names.append(f"{make.__name__} {mesh} zero={zero}")
    for name, ref, got in zip(names, refs, H.run_cases(4, cases, timeout=600)):
        H.assert_same(ref, got, what=name)


# --- a price on memory: the Lagrangian of the memory rows ------------------------------------------------

@pytest.mark.parametrize("graph,mesh", [(lambda: mlp(batch=64, h=512, layers=3), (1, 4)),
                                        (lambda: diamond(batch=8, h=16), (2, 2))])
def test_a_price_on_memory_minimizes_time_plus_priced_memory_exactly(graph, mesh):
    """solve(memory_price=lam) is exact for its objective (time + lam x end-of-forward bytes: brute force over
    every choice), and raising the price never buys more memory or less time (a Lagrangian's front)."""
    prob = IntraProblem(graph(), DGX, mesh, sharded_update=True)
    counts = [len(prob.algos[a]) for a in prob.anchors]
    combos = [dict(zip(prob.anchors, c)) for c in product(*[range(k) for k in counts])]
    times = [prob.objective(c) for c in combos]
    mems = [prob.memory_end_of_forward(c) for c in combos]
    unit, fastest, _ = prob.unit_price()
    assert prob.objective(fastest) == pytest.approx(min(times), rel=1e-6, abs=1e-12)
    last_t, last_m, seen = 0.0, math.inf, set()
    for k in (0.01, 0.1, 0.5, 2, 8, 64, 1024):
        lam = k * unit
        choice, obj, status, _ = prob.solve(None, memory_price=lam)
        assert status == "optimal" and obj == pytest.approx(prob.objective(choice), rel=1e-9)
        best = min(t + lam * m for t, m in zip(times, mems))
        got = prob.objective(choice) + lam * prob.memory_end_of_forward(choice)
        assert got == pytest.approx(best, rel=1e-6, abs=1e-12), k
        m = prob.memory_end_of_forward(choice)
        assert m <= last_m * (1 + 1e-9) and obj >= last_t * (1 - 1e-9)
        last_t, last_m = obj, m
        seen.add(tuple(sorted(choice.items())))
    assert len(seen) >= 2            # the sweep reaches a leaner layout than the fastest


def test_solve_intra_at_a_memory_price_trades_time_for_memory_and_refuses_the_fastest_itself():
    g = mlp(batch=64, h=512, layers=3)
    fast = solve_intra(g, DGX, (1, 4), memory_budget=math.inf, sharded_update=True, price=False)
    lean = solve_intra(g, DGX, (1, 4), memory_budget=math.inf, sharded_update=True, price=False, memory_price=64)
    assert lean.memory_bytes < fast.memory_bytes and lean.objective >= fast.objective
    assert lean.specs != fast.specs
    with pytest.raises(AlpaError, match="the fastest layout itself"):      # a big batch: data parallelism
        solve_intra(mlp(batch=4096, h=256, layers=2), DGX, (1, 4), memory_budget=math.inf, sharded_update=True,
                    price=False, memory_price=1e-3)
    with pytest.raises(AlpaError, match="replaces the memory rows"):
        solve_intra(g, DGX, (1, 4), memory_budget=2**30, memory_price=1)


def test_a_sharded_update_holds_a_copied_weights_optimizer_states_in_shards():
    """sharded_update=True (ZeRO-1) counts 1/k of a weight's optimizer states on each of its k copies."""
    g = mlp(batch=64, h=512, layers=3)
    whole, sharded = IntraProblem(g, DGX, (1, 4)), IntraProblem(g, DGX, (1, 4), sharded_update=True)

    def data_parallel(prob):            # every Linear's batch split 4 ways, its weight copied 4 ways
        return {a: next(i for i, al in enumerate(prob.algos[a]) if "b0" in str(al) and "'n'" not in str(al)
                        and "'k'" not in str(al)) for a in prob.anchors}
    cw, cs = data_parallel(whole), data_parallel(sharded)
    states = 3 * 512 * 512 * 4 * 2            # adam: two fp32 states per weight
    assert whole.memory_end_of_forward(cw) - sharded.memory_end_of_forward(cs) == pytest.approx(states * 3 / 4)
