"""The planner's memos on a decoder of repeated identical blocks (a 4-block zoo Llama at test width) give the
reference's results exactly: shape inference (``ops.infer`` against ``ops.infer_uncached``), the micro-batch
graph (one pass of ``replace_uses_many`` against one ``replace_uses`` per source), a GraphCost's per-node task
times, and the prices the mapper and the tuned grid compute from them (same floats with every memo cold)."""
from __future__ import annotations

import pytest

from unity_pcg import ops
from unity_pcg.machine import parse_machine
from unity_pcg.onnx_import import load_onnx
from unity_pcg.search.baselines import data_parallel, megatron
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import logical_graph, micro_graph

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from unity_pcg import zoo
    assert zoo.get_config("llama_7b", "small").layers == 4        # four identical blocks
    p = zoo.export("llama_7b", str(tmp_path_factory.mktemp("rb") / "llama.onnx"), size="small", batch=8)
    return load_onnx(p, load_weights=False)


def _graphs(g):
    return [g, data_parallel(g, 4), megatron(g, 4, devices_per_node=4), micro_graph(g, 2)]


def test_memoized_inference_equals_the_reference_on_every_node(decoder):
    for g in _graphs(decoder):
        for n in g.nodes():
            if n.kind == "source":
                continue
            want = ops.infer_uncached(n.op, n.a, g.input_shapes(n.id))
            got = ops.infer(n.op, n.a, g.input_shapes(n.id))
            assert got == want
            assert got.outputs == g.shapes(n.id)


def test_inference_memo_tells_apart_equal_comparing_attributes():
    from unity_pcg.shape import ParallelTensorShape
    x = ParallelTensorShape.of((4, 6))
    key = lambda a: tuple(sorted((k, ops._frozen(v)) for k, v in a.items()))      # noqa: E731
    assert key({"axis": 1}) != key({"axis": True}) != key({"axis": 1.0})
    assert key({"perm": [1, 0]}) != key({"perm": (1, 0)})
    # a refusal is raised every time (not memoized as a result)
    for _ in range(2):
        with pytest.raises(Exception):
            ops.infer("Partition", {"dim": 0, "degree": 3}, [x])


def _micro_reference(g, M):
    """micro_graph as one replace_uses per source (the reference the one-pass rewrite must equal)."""
    lg, _ = logical_graph(g)
    b = lg.edit()
    for n in lg.sources():
        if n.op == "Input" and not n.a["shape"]:
            continue
        op, attrs = ("Partition", {"dim": 0, "degree": M}) if n.op == "Input" else ("Replicate", {"degree": M})
        p = b.add(op, attrs, [(n.id, 0)])
        b.replace_uses((n.id, 0), p, exclude=[p[0]])
    return b.finish()


def test_micro_graph_one_pass_equals_replacing_uses_source_by_source(decoder):
    for M in (2, 4):
        got, want = micro_graph(decoder, M), _micro_reference(decoder, M)
        assert got.structural_hash() == want.structural_hash()
        assert sorted(got.node_ids()) == sorted(want.node_ids())
        for i in want.node_ids():
            assert got.node(i) == want.node(i) and got.shapes(i) == want.shapes(i)
        assert list(got.outputs) == list(want.outputs)


def test_prices_are_the_same_floats_with_every_memo_cold(decoder, monkeypatch):
    m = parse_machine("h100:1x4")
    g = megatron(decoder, 4, devices_per_node=4)

    def price():
        model = CostModel(m, optimizer="adam", precision="bf16")
        gc = GraphCost(g, model)
        times = {n: gc.task_time(n) for n in gc.nodes() if gc.role[n] == "compute"}
        assert times == {n: gc.task_time(n) for n in times}        # the per-node memo returns what it computed
        r = MachineMapper(model).optimize(g)
        return times, r.cost, dict(r.memory.per_device) if r.memory else {}

    warm = price()
    monkeypatch.setattr(ops, "infer", ops.infer_uncached)          # no inference memo at all
    cold = price()
    assert warm == cold


def test_nothing_fits_falls_back_to_the_imported_graph_mapped_once(monkeypatch):
    """Where no plan fits, the fallback returns the imported graph on one device, mapped once: a strategy whose
    floor was mapped and does not fit is not mapped again, and ``none`` (the imported graph itself) answers for
    the last resort (its mapping equals a fresh one by the DP, which on one device has no other: the DP's reason
    adds the lower bound of every mapping, here that same one)."""
    from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec
    from unity_pcg.machine import Resource
    from unity_pcg.search import optimize as O
    from .graphs import mlp
    dev = DeviceSpec(100e12, 1e12, 1_000, {"default": 0.5}, 5e-6)           # 1 kB: nothing fits
    links = {"group": LinkSpec(100e9, 2e-6), "node": LinkSpec(100e9, 2e-6), "network": LinkSpec(10e9, 5e-6)}
    m = MachineSpec("tiny-memory", 1, 4, 4, dev, links)
    g = mlp(batch=8, h=16, layers=3)
    calls = []
    full = O.Evaluator.full

    def counting(self, pg, resource=None, deadline=None):
        calls.append((pg.structural_hash(), resource))
        return full(self, pg, resource, deadline)
    monkeypatch.setattr(O.Evaluator, "full", counting)
    res = O.optimize(g, m, budget_s=5, strategy="unity", pipeline=False)
    assert not res.feasible and res.stats["chosen"] == "imported graph (nothing fits)"
    one = Resource(0, 1, 1)
    assert calls.count((g.structural_hash(), one)) <= 1
    fresh = MachineMapper(CostModel(m, optimizer="adam")).optimize(g, resource=one)
    assert res.mapping.cost == fresh.cost and res.mapping.views == fresh.views
    assert res.mapping.reason.startswith("out of memory: device 0 needs") and \
        fresh.reason.endswith(res.mapping.reason.removeprefix("out of memory: "))


def test_pairs_whose_weights_alone_do_not_fit_are_skipped_and_the_grid_best_is_kept():
    """Megatron's tuned grid skips, before mapping a point of them, the (tp, pp) pairs at which the plain point's
    weights part (scaled to the pair: a lower bound) alone does not fit; the walk still returns the exhaustively
    priced grid's best (here only pipelines fit; no host memory: optimizer offload would fit pp = 1 points)."""
    import dataclasses
    from unity_pcg.search.split import synthetic_transformer
    from unity_pcg.search.tuned import tune
    from .test_tuned import _exhaustive
    g = synthetic_transformer(4, batch=32, seq=64, hidden=1024, heads=8)
    m = parse_machine("h100:2x4")
    m = dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=170 * 2**20), host_memory_bytes=0)
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    ex = _exhaustive(g, MachineMapper(CostModel(m, optimizer="adam")))
    assert r.stats.get("pairs_skipped_by_weights", 0) >= 1
    assert ex.feasible and r.feasible and ex.config.pp > 1
    assert r.cost == pytest.approx(ex.cost, rel=1e-9)
    skipped = {(p["config"]["tp"], p["config"]["pp"]) for p in ex.priced} - {(p["config"]["tp"], p["config"]["pp"])
                                                                             for p in r.priced}
    assert all(pp == 1 for _, pp in skipped) and skipped


@pytest.mark.parametrize("machine,tp", [("h100:1x4", 4), ("h100:2x4", 2)])
def test_local_keys_solve_identical_blocks_once_with_the_reference_prices(decoder, monkeypatch, machine, tp):
    """The time DP keyed by subtrees up to renaming (``mapping.LOCAL_KEYS``) solves a block like the block
    before it from the memo, and gives the reference's (subtree-hash keys') cost, views and memory exactly."""
    from unity_pcg.search import mapping
    m = parse_machine(machine)
    graphs = [megatron(decoder, tp, devices_per_node=m.devices_per_node), data_parallel(decoder, m.num_devices)]

    def run(local):
        monkeypatch.setattr(mapping, "LOCAL_KEYS", local)
        mapper = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"))
        out = []
        for g in graphs:
            r = mapper.optimize(g)
            out.append((r.cost, dict(r.views), dict(r.memory.per_device) if r.memory else {},
                        r.stats["cache_misses"]))
        return out

    ref, got = run(False), run(True)
    for (c0, v0, m0, miss0), (c1, v1, m1, miss1) in zip(ref, got):
        assert c1 == c0 and v1 == v0 and m1 == m0
        assert miss1 < miss0                 # the later blocks are memo hits


def test_task_times_shared_by_graphs_equal_each_nodes_own_computation(decoder):
    """``GraphCost.task_time`` answers from the model's memo (``_task_key``) what the node itself computes
    (``_task_time_of``), for every compute node of several graphs priced by one model."""
    model = CostModel(parse_machine("h100:1x4"), optimizer="adam", precision="bf16")
    hits = 0
    for g in _graphs(decoder):
        gc = GraphCost(g, model)
        for n in gc.nodes():
            if gc.role[n] == "compute":
                hits += gc._task_key(n) in model._task_memo
                assert gc.task_time(n) == gc._task_time_of(n)
    assert hits > 0


def test_local_keys_on_a_deeper_decoder_with_side_by_side_joins(tmp_path, monkeypatch):
    """The join fronts shared by local key (``MachineMapper.fcache``) give the reference's mapping exactly on
    a machine of several nodes, where branches may run side by side on split resources."""
    from unity_pcg import zoo
    from unity_pcg.search import mapping
    p = zoo.export("llama_7b", str(tmp_path / "llama.onnx"), size="small", batch=8)
    g0 = load_onnx(p, load_weights=False)
    m = parse_machine("h100:2x2")
    g = megatron(g0, 2, devices_per_node=2)

    def run(local):
        monkeypatch.setattr(mapping, "LOCAL_KEYS", local)
        mapper = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"))
        r = mapper.optimize(g)
        return r.cost, dict(r.views), len(mapper.fcache)

    c0, v0, _ = run(False)
    c1, v1, nf = run(True)
    assert c1 == c0 and v1 == v0 and nf > 0


def test_graph_costs_kept_per_graph_and_node_memory_memo_equal_fresh_ones(decoder):
    """``GraphCost(g, model)`` returns the model's instance for ``g`` (not for another graph), and
    ``node_memory``'s memo answers what it computes afresh, on every node of a mapped graph."""
    from unity_pcg.search.memory import _node_memory_of, node_memory
    model = CostModel(parse_machine("h100:1x4"), optimizer="adam", precision="bf16")
    g = megatron(decoder, 4, devices_per_node=4)
    r = MachineMapper(model).optimize(g)
    gc = GraphCost(g, model)
    assert GraphCost(g, model) is gc and GraphCost(decoder, model) is not gc
    assert GraphCost(g, CostModel(parse_machine("h100:1x4"), optimizer="adam", precision="bf16")) is not gc
    for n in gc.nodes():
        assert node_memory(gc, n, r.views[n]) == _node_memory_of(gc, n, r.views[n])
