"""Sequence parallelism's collectives in the cost model: a Reduce(k) whose only consumer is a
Partition(dim, k) is one ring reduce-scatter, a Combine(dim, k) whose only consumer is a Replicate(k) one
all-gather ((k-1) N elements each way, N the full piece), against hand computation; pieces the group does
not hold are sent first; `explain`'s rows still add up; the memory model holds the split activations at
1/k."""
from __future__ import annotations

import pytest

from unity_pcg import plan as P
from unity_pcg.explanation import explain
from unity_pcg.machine import MachineView, parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search import collectives as C
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.memory import memory_per_device

B, S, H = 8, 32, 256


def _graph(k: int = 4, fused: bool = True) -> PCG:
    """A row-parallel MatMul's partial sums reduce-scattered onto the sequence dim, a Relu on the sequence
    shards, an all-gather before a column-parallel MatMul.  ``fused=False``: the Reduce and the Combine
    also feed a second reader, so neither pair is one collective."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (B, S, H)})
    w = b.add("Weight", {"name": "w", "shape": (H, H)})
    y = b.add("MatMul", {}, [b.add("Partition", {"dim": 2, "degree": k}, [x]),
                             b.add("Partition", {"dim": 0, "degree": k}, [w])], name="row")
    red = b.add("Reduce", {"degree": k}, [y], name="reduce")
    y = b.add("Partition", {"dim": 1, "degree": k}, [red], name="scatter")
    y = b.add("Relu", {}, [y], name="relu")
    comb = b.add("Combine", {"dim": 1, "degree": k}, [y], name="combine")
    y = b.add("Replicate", {"degree": k}, [comb], name="gather")
    w2 = b.add("Weight", {"name": "w2", "shape": (H, H)})
    z = b.add("MatMul", {}, [y, b.add("Partition", {"dim": 1, "degree": k}, [w2])], name="column")
    outs = [z]
    if not fused:
        outs += [b.add("Relu", {}, [red], name="other1"), b.add("Relu", {}, [comb], name="other2")]
    b.set_outputs(outs)
    return b.finish()


def _ids(g: PCG) -> dict:
    return {n.name: n.id for n in g.nodes()}


@pytest.mark.parametrize("k", [2, 4])
def test_pairs_priced_as_one_reduce_scatter_and_one_all_gather(k):
    m = parse_machine(f"h100:1x{k}")
    cm = CostModel(m)
    g = _graph(k)
    r = MachineMapper(cm).optimize(g)
    assert r.feasible
    gc = GraphCost(g, cm)
    ids = _ids(g)
    assert gc.fused(ids["scatter"]) == "reduce-scatter" and gc.fused(ids["gather"]) == "all-gather"
    assert gc.fused_first(ids["reduce"]) and gc.fused_first(ids["combine"])
    assert gc.priced_inputs(ids["scatter"]) == [(0, ids["row"])] and gc.priced_inputs(ids["reduce"]) == []
    N = B * S * H                     # the reduced (gathered) tensor: one piece
    devs = list(range(k))
    rs = gc.leaf_cost(ids["scatter"], r.views[ids["scatter"]], r.views)
    ag = gc.leaf_cost(ids["gather"], r.views[ids["gather"]], r.views)
    # ring reduce-scatter: k-1 steps of N/k elements per device, forward, and its all-gather backward
    link = m.link(m.span_level(devs))
    one = (k - 1) * link.latency + (k - 1) / k * N * 4 / link.bandwidth
    assert rs.time == pytest.approx(2 * one) and ag.time == pytest.approx(2 * one)
    assert rs.time == pytest.approx(2 * C.reduce_scatter_time(m, devs, N * 4))
    assert rs.comm_elements == ag.comm_elements == 2 * (k - 1) * N
    assert gc.leaf_cost(ids["reduce"], r.views[ids["reduce"]], r.views).time == 0.0
    # no other activation moves; the only weights are split, so no gradient sync
    assert r.breakdown.comm_elements == 4 * (k - 1) * N
    # the same as a ring all-reduce in volume, not a reduce to one device and a scatter
    assert rs.comm_elements + ag.comm_elements == 2 * C.allreduce_elements(k, N)


def test_unfused_pairs_cost_more():
    """A Reduce (Combine) with a second reader is priced as a reduce to one device then a scatter (a
    gather then a broadcast): more time and more elements than the collective."""
    m = parse_machine("h100:1x4")
    fused = MachineMapper(CostModel(m)).optimize(_graph(4))
    g = _graph(4, fused=False)
    gc = GraphCost(g, CostModel(m))
    assert not gc._fused
    pair = MachineMapper(CostModel(m)).optimize(g)
    ids = _ids(g)
    parts = [pair.views[ids[n]] for n in ("reduce", "scatter", "combine", "gather")]
    t = sum(gc.leaf_cost(ids[n], pair.views[ids[n]], pair.views).time for n in ("reduce", "scatter", "combine", "gather"))
    f = GraphCost(_graph(4), CostModel(m))
    fi = _ids(f.g)
    tf = sum(f.leaf_cost(fi[n], fused.views[fi[n]], fused.views).time for n in ("reduce", "scatter", "combine", "gather"))
    assert parts and tf < t


def test_group_that_lacks_a_piece_receives_it_first():
    """Scattering onto devices 0, 1 while the partial sums sit on 2, 3: both partials are sent (two
    point-to-point messages of N), then the reduce-scatter."""
    m = parse_machine("h100:1x4")
    cm = CostModel(m)
    g = _graph(2)
    gc = GraphCost(g, cm)
    ids = _ids(g)
    N = B * S * H
    row = MachineView(2, tuple((d, 1) for d in gc.grid[ids["row"]]))
    on = MachineView(0, tuple((d, 1) for d in gc.grid[ids["scatter"]]))
    assert set(gc.placement(ids["row"], row)) == {2, 3} and set(on.devices()) == {0, 1}
    e = gc.edge_cost(ids["scatter"], 0, row, on)
    assert e.comm_elements == 2 * (2 * N + (2 - 1) * N)
    same = gc.edge_cost(ids["scatter"], 0, MachineView(0, row.dims), on)
    assert same.comm_elements == 2 * (2 - 1) * N
    moves = C.transfer_time(m, [(2, 0, N * 4), (3, 1, N * 4)])
    assert e.time == pytest.approx(same.time + 2 * moves)


def test_explain_rows_add_up(tmp_path):
    m = parse_machine("h100:1x4")
    g = _graph(4)
    r = MachineMapper(CostModel(m)).optimize(g)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"stand-in")
    pl = P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json())
    e = explain(pl)
    kinds = sorted(c.collective for c in e.comm)
    assert kinds == ["all-gather", "reduce-scatter"]
    assert sum(c.elements for c in e.comm) == e.totals["comm_elements"] == r.breakdown.comm_elements
    assert all(len(c.devices) == 4 for c in e.comm)


def test_sequence_split_activations_held_at_one_kth():
    """The Relu's output (which its backward saves) is a 1/k sequence shard on each device; the reduced
    tensor between Reduce and Partition and the gathered one between Combine and Replicate are held by
    nobody (no consumer saves them)."""
    k = 4
    m = parse_machine(f"h100:1x{k}")
    cm = CostModel(m)
    g = _graph(k)
    r = MachineMapper(cm).optimize(g)
    gc = GraphCost(g, cm)
    rep = memory_per_device(gc, r.views)
    N = B * S * H
    # per device: the input shard (N/k), the Relu output (N/k, saved for its backward), the gathered
    # input of the column MatMul (N, saved), the partial sums read by nobody's backward (0); weights:
    # two H x H/k shards x (weight, gradient, two Adam states)
    for d in range(k):
        assert rep.activations[d] == 4 * (N // k + N // k + N + N // k)
        assert rep.weights[d] == 4 * 4 * 2 * H * H // k


def test_layout_proposal_finds_sequence_parallelism_by_itself():
    """Alpa's ILP over the labels (search/layouts.py), with the pairs priced as collectives, puts a decoder
    block's LayerNorms on sequence shards between a reduce-scatter and an all-gather, with no all-reduce
    (Megatron-LM's sequence parallelism), and its time is the sequence-parallel Megatron builder's."""
    from unity_pcg.search.baselines import megatron
    from unity_pcg.search.layouts import propose
    from unity_pcg.search.split import synthetic_transformer
    g = synthetic_transformer(1, batch=2, seq=512, hidden=2048, heads=16)
    m = parse_machine("h100:1x4")
    mapper = MachineMapper(CostModel(m, optimizer="adam", precision="bf16"))
    p = propose(g, m, (1, 4), mapper=mapper, precision="bf16")
    gc = GraphCost(p.pcg, mapper.model)
    kinds = sorted(filter(None, (gc.fused(n.id) for n in p.pcg.nodes())))
    assert "reduce-scatter" in kinds and "all-gather" in kinds and p.pcg.op_counts().get("AllReduce", 0) == 0
    norms = [p.pcg.input_shapes(n.id)[0] for n in p.pcg.nodes() if n.op == "LayerNorm"]
    assert norms and all(s.degrees[1] == 4 and s.copy_degree == 1 for s in norms)
    sp = mapper.optimize(megatron(g, 4, 4, sequence_parallel=True))
    plain = mapper.optimize(megatron(g, 4, 4))
    assert p.time_s <= sp.cost * (1 + 1e-6) and sp.cost < plain.cost
