"""GraphCost prices an edge over all devices at once (``_edge_vec``: numpy, message times counted per
endpoint, collectives priced per group shape); ``_edge_loop`` is the straightforward device-by-device
reference.  Every edge Alpa's ILP prices on small machines of several node counts gets the same floats from
both (not approximately), and the collectives priced by group shape equal the ones priced by members."""
from collections import Counter

import numpy as np
import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search import collectives as C
from unity_pcg.search.alpa import intra
from unity_pcg.search.alpa.intra import IntraProblem
from unity_pcg.pcg import PCG
from unity_pcg.search import cost
from unity_pcg.search.cost import CostModel, GraphCost

from .graphs import diamond, mlp
from .test_alpa_intra import _attention

CASES = [
    (lambda: mlp(batch=16, h=32, layers=3), "dgx-a100:1x8", (2, 4), "fp32"),
    (lambda: mlp(batch=16, h=32, layers=2), "h100:4x2", (4, 2), "fp32"),
    (lambda: diamond(batch=16, h=32), "h100:2x4", (2, 4), "fp32"),
    (lambda: _attention(), "h100:2x4", (2, 4), "bf16"),
    (lambda: _attention(), "h100:4x2", (1, 8), "fp32"),
    (lambda: mlp(batch=32, h=16, layers=2), "h100:2x8", (4, 4), "fp32"),
    (lambda: mlp(batch=24, h=24, layers=2), "summit:2x6", (2, 6), "fp32"),
    (lambda: diamond(batch=16, h=32), "h100:8x2", (8, 2), "fp32"),
]


@pytest.mark.parametrize("make,machine,mesh,precision", CASES)
def test_vectorized_edges_equal_device_loop(make, machine, mesh, precision, monkeypatch):
    monkeypatch.setattr(cost, "_VEC_MIN_DEVICES", 1)          # small machines take the numpy path too
    seen: Counter = Counter()
    vec = GraphCost._edge_vec

    def both(self, nid, pos, shape, place, view, isz):
        fast = vec(self, nid, pos, shape, place, view, isz)
        ref = self._edge_loop(nid, pos, shape, place, view, isz)
        kind = self.g.node(nid).op if self.role[nid] != "compute" else "compute"
        seen[(kind, fast is not None, ref[0] > 0)] += 1
        if fast is not None:
            assert fast == ref, (kind, fast, ref)
            assert type(fast[1]) is int
        return fast

    monkeypatch.setattr(GraphCost, "_edge_vec", both)
    intra._SHARED.clear()
    IntraProblem(make(), parse_machine(machine), mesh, precision=precision, idle=True)
    intra._SHARED.clear()
    assert sum(n for (k, ok, _), n in seen.items() if ok) > 0
    assert sum(n for (k, ok, moved), n in seen.items() if ok and moved) > 0   # some edges move data
    assert not [k for (k, ok, _) in seen if not ok]                          # none declined here


@pytest.mark.parametrize("machine", ["h100:4x8", "summit:3x6", "dgx-a100:2x8"])
def test_collectives_by_shape_equal_by_members(machine):
    m = parse_machine(machine)
    rng = np.random.default_rng(0)
    for _ in range(200):
        devs = rng.choice(m.num_devices, size=int(rng.integers(1, 12)), replace=True).tolist()
        nb = int(rng.integers(0, 1 << 20))
        p, lv, levels = C.group_shape(m, devs)
        for by_members, by_shape in ((C.allreduce_time, C.allreduce_time_of), (C.allgather_time, C.allgather_time_of),
                                     (C.broadcast_time, C.broadcast_time_of)):
            assert by_members(m, devs, nb) == by_shape(m, p, lv, nb, levels)
        src = rng.choice(m.num_devices, size=len(devs))
        moves = list(zip(src.tolist(), devs, [nb] * len(devs)))
        assert C.transfer_time(m, moves) == C.transfer_time_uniform(m, src, np.asarray(devs), nb)


def _parallel_ops(k: int) -> PCG:
    """Every parallel operator between compute nodes, each read by a second node so none is fused."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (6, 4 * k, 12)})
    w = b.add("Weight", {"name": "w", "shape": (12, 12)})
    y = b.add("MatMul", {}, [b.add("Partition", {"dim": 2, "degree": k}, [x], name="px"),
                             b.add("Partition", {"dim": 0, "degree": k}, [w])], name="row")
    red = b.add("Reduce", {"degree": k}, [y], name="reduce")
    alr = b.add("AllReduce", {"degree": k}, [y], name="allreduce")
    sc = b.add("Partition", {"dim": 1, "degree": k}, [red], name="scatter")
    r = b.add("Relu", {}, [sc], name="relu")
    comb = b.add("Combine", {"dim": 1, "degree": k}, [r], name="combine")
    rep = b.add("Replicate", {"degree": k}, [comb], name="replicate")
    outs = [b.add("Relu", {}, [t], name=f"use{i}") for i, t in enumerate((red, alr, comb, rep, sc))]
    b.set_outputs(outs)
    return b.finish()


@pytest.mark.parametrize("machine,k", [("h100:2x4", 2), ("h100:4x2", 4), ("summit:2x6", 3), ("h100:1x8", 4)])
def test_every_view_pair_prices_alike(machine, k, monkeypatch):
    """Every parallel operator and compute node, every producer view against every view of its own: the
    vectorized price equals the device loop's."""
    monkeypatch.setattr(cost, "_VEC_MIN_DEVICES", 1)
    g = _parallel_ops(k)
    gc = GraphCost(g, CostModel(parse_machine(machine)))
    seen: Counter = Counter()
    for nid in gc.nodes():
        for pos, ref in enumerate(g.node(nid).inputs):
            if gc.role[ref[0]] in ("input", "weight"):
                continue
            shape = g.shape(ref)
            isz = gc.itemsize(ref)
            for pv in gc.views(ref[0]):
                place = gc.placement(ref[0], pv, ref[1])
                for v in gc.views(nid):
                    fast = gc._edge_vec(nid, pos, shape, place, v, isz)
                    ref_ = gc._edge_loop(nid, pos, shape, place, v, isz)
                    op = g.node(nid).op if gc.role[nid] != "compute" else "compute"
                    assert fast == ref_, (g.node(nid).name, pv, v)
                    seen[(op, ref_[0] > 0)] += 1
    moved = {op for op, m in seen if m}
    assert {"Partition", "Combine", "Replicate", "Reduce", "AllReduce", "compute"} <= moved, sorted(seen)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("machine,k", [("h100:2x4", 2), ("summit:2x6", 3)])
def test_memory_arrays_equal_memory_dicts(machine, k, precision):
    """node_memory_arrays holds, device by device, the bytes node_memory's dicts hold (and on the same
    devices), for every node of a graph with weights, casts and every parallel operator, on every view."""
    from unity_pcg.search.memory import node_memory, node_memory_arrays
    g = _parallel_ops(k)
    gc = GraphCost(g, CostModel(parse_machine(machine), precision=precision))
    nonzero = 0
    for nid in gc.nodes():
        for v in gc.views(nid):
            w, a = node_memory(gc, nid, v)
            wa, aa, wm, am = node_memory_arrays(gc, nid, v)
            assert set(np.flatnonzero(wm).tolist()) == set(w) and set(np.flatnonzero(am).tolist()) == set(a)
            assert all(float(wa[d]) == float(b) for d, b in w.items())
            assert all(float(aa[d]) == float(b) for d, b in a.items())
            assert not wa[~wm].any() and not aa[~am].any()
            nonzero += bool(w) + bool(a)
    assert nonzero > 0


def _both_ways(monkeypatch, fn):
    """``fn()`` priced by numpy (threshold 1 device) and by the device loops (threshold never reached)."""
    monkeypatch.setattr(cost, "_VEC_MIN_DEVICES", 1)
    fast = fn()
    monkeypatch.setattr(cost, "_VEC_MIN_DEVICES", 10 ** 9)
    return fast, fn()


def _replicated_weight(k: int) -> PCG:
    """Data parallelism: a weight copied k times, its gradient all-reduced over the copies."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4 * k, 12)})
    w = b.add("Weight", {"name": "w", "shape": (12, 12)})
    y = b.add("MatMul", {}, [b.add("Partition", {"dim": 0, "degree": k}, [x]),
                             b.add("Replicate", {"degree": k}, [w], name="wcopy")], name="mm")
    b.set_outputs([y])
    return b.finish()


@pytest.mark.parametrize("machine,k", [("h100:2x4", 2), ("h100:1x8", 4), ("summit:2x6", 2), ("h100:4x2", 4),
                                       ("h100:4x2", 8)])
def test_fused_pairs_and_gradient_sync_alike(machine, k, monkeypatch):
    """The fused reduce-scatter / all-gather pairs and the gradient all-reduce of copied weights: the
    numpy paths give the loops' floats on every view pair."""
    from .test_seqpar_cost import _graph
    g = _graph(k)
    m = parse_machine(machine)
    ids = {n.name: n.id for n in g.nodes()}

    def prices():
        gc = GraphCost(g, CostModel(m))
        out = []
        for name in ("scatter", "gather"):
            nid = ids[name]
            src = g.node(g.node(nid).inputs[0][0]).inputs[0][0]      # the fused pair's input producer
            for pv in gc.views(src):
                for v in gc.views(nid):
                    c = gc._fused_edge(nid, pv, v)
                    out.append((c.time, c.comm_elements))
        gw = _replicated_weight(k)
        gc = GraphCost(gw, CostModel(m))
        sync = [gc._grad_sync(nid, v) for nid in gc.nodes() if gc.role[nid] == "weight-placement"
                for v in gc.views(nid)]
        return out, sync

    fast, loop = _both_ways(monkeypatch, prices)
    assert fast == loop
    assert any(t > 0 for t, _ in fast[0]) and any(t > 0 for t, _ in fast[1])
