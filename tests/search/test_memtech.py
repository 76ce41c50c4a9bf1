"""Memory techniques priced in time and memory and chosen by the search (search/memtech.py, issue 19)."""
from __future__ import annotations

import dataclasses
import json
from itertools import product

import pytest

from unity_pcg.machine import MachineSpec, parse_machine
from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search import memtech
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.memory import memory_per_device
from unity_pcg.search.split import synthetic_transformer

from .graphs import mlp


def _mapped(g, machine, optimizer="adam"):
    cm = CostModel(machine, optimizer=optimizer)
    r = MachineMapper(cm).optimize(g)
    return GraphCost(g, cm), r


def _with_capacity(m: MachineSpec, cap: int) -> MachineSpec:
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(cap)))


def test_zero_stages_memory_by_hand():
    """Two 16x16 fp32 weights (P = 1 KiB each) replicated on 4 devices, Adam (2 states): per device a weight
    costs P + P + 2P; stage 1 shards the states, 2 also the gradient, 3 also the parameter and gathers the
    largest units back (here one unit: both weights are read in the one region); stages 1-2 hold the
    optimizer's copy of the updated shard (P/c) besides the parameter, as the executor does."""
    g = data_parallel(mlp(batch=8, h=16, layers=2), 4)
    gc, r = _mapped(g, parse_machine("h100:1x4"))
    P, c = 16 * 16 * 4, 4
    t = memtech.Techniques(gc, r.views)
    assert len(t.regions) == 1 and t.n_units == 1
    base = memory_per_device(gc, r.views)
    # the step's peak is the loss's backward step: the forward's activations plus the output's gradient
    # and the loss's float32 copies of the output (a 2x16 fp32 piece per device)
    out = 2 * 16 * 4
    got = t.price(MemoryPlan()).report.per_device
    assert got == {d: b + (1 + memtech.LOSS_FP32_COPIES) * out for d, b in base.per_device.items()}
    want = {0: 2 * 4 * P,
            1: 2 * (P + P + 2 * P / c + P / c),
            2: 2 * (P + P / c + 2 * P / c + P / c),
            3: 2 * (P / c + P / c + 2 * P / c) + 2 * (P - P / c)}
    for z, w in want.items():
        p = t.price(MemoryPlan(zero=z))
        for d in range(4):
            assert p.report.weights[d] == w, (z, d)
            assert p.report.activations[d] == base.activations[d]
    off = t.price(MemoryPlan(zero=1, offload=True))
    assert off.report.weights[0] == 2 * (P + P)          # states in host memory
    assert off.offload_s > 0 and off.update_s == 0


def test_full_region_halves_kept_activations():
    """Linear/Relu x 4 on one device: a Relu saves its output and the next Linear its input, so the four
    Relu outputs (8x16 fp32 = 512 bytes each) are kept.  Recomputing the first three layers keeps only
    what the fourth reads (the third Relu's output) and the graph output: half; during that region's
    backward its two dropped outputs live again (the graph output, kept for the layers after it, is freed
    by then: one more than the kept).  Selective recomputation checkpoints each Relu alone (the
    Linears run plainly): a checkpoint keeps its input, a Linear output nobody saved, and the Relu's output
    is still saved by the next Linear -- it keeps more than no recomputation (7 tensors), as the executor
    does."""
    g = mlp(batch=8, h=16, layers=4)
    gc, r = _mapped(g, parse_machine("h100:1x1"))
    comp = [n for n in gc.nodes() if gc.role[n] == "compute"]
    assert len(comp) == 8
    region = tuple(comp[:6])
    t = memtech.Techniques(gc, r.views, regs=[region, tuple(comp[6:])])
    T = 8 * 16 * 4
    assert t.base_report.activations[0] == 4 * T
    a, transient = t.activation_bytes({n: (0, "full") for n in region})
    assert a[0] == 2 * T and transient[0] == T
    a, transient = t.activation_bytes({n: (0, "selective") for n in region})
    assert a[0] == 7 * T and transient.get(0, 0) == 0
    full = t.price(MemoryPlan(recompute=(RecomputeRegion(region, "full"),)))
    sel = t.price(MemoryPlan(recompute=(RecomputeRegion(region, "selective"),)))
    assert full.report.activations[0] == 3 * T              # kept half + the transient
    assert full.recompute_s == pytest.approx(sum(t.fwd[n] for n in region))
    relus = [n for n in region if g.node(n).op == "Relu"]
    assert sel.recompute_s == pytest.approx(sum(t.fwd[n] for n in relus)) and sel.recompute_s < full.recompute_s
    assert full.iteration_s == pytest.approx(t.price(MemoryPlan()).iteration_s + full.recompute_s)


def _brute(t: memtech.Techniques):
    out = []
    for z, o in product(range(4), (False, True)):
        for modes in product(memtech.MODES, repeat=len(t.regions)):
            regs = tuple(RecomputeRegion(r, md) for r, md in zip(t.regions, modes) if md != "none")
            out.append(t.price(MemoryPlan(z, o, regs)))
    return out


def test_infeasible_model_becomes_feasible_and_the_choice_is_the_cheapest():
    g = data_parallel(mlp(batch=256, h=64, layers=8), 4)
    m = parse_machine("h100:1x4")
    gc0, r0 = _mapped(g, m)
    need = r0.memory.max_bytes
    t0 = memtech.Techniques(gc0, r0.views)
    assert 1 < len(t0.regions) <= memtech.EXACT_LIMIT
    z1 = t0.price(MemoryPlan(zero=1)).max_bytes
    for cap in (need - 1, (need + z1) // 2, z1 - 1):      # each needs some technique
        mc = _with_capacity(m, cap)
        cm = CostModel(mc, optimizer="adam")
        plain = MachineMapper(cm).optimize(g, techniques=False)
        assert not plain.feasible and "out of memory" in plain.reason
        res = MachineMapper(cm).optimize(g, techniques=True)
        assert res.feasible and res.memory.max_bytes <= cap and res.memory_plan is not None
        gc = GraphCost(g, cm)
        t = memtech.Techniques(gc, res.views, base=res.techniques.base_s)
        ok = [p for p in _brute(t) if p.feasible]
        assert ok
        assert res.cost == pytest.approx(min(p.iteration_s for p in ok), rel=1e-12)
        mem, p = memtech.choose(gc, res.views, base=res.techniques.base_s)
        assert p.iteration_s == pytest.approx(res.cost, rel=1e-12) and mem == res.memory_plan


def test_greedy_recompute_fits_when_regions_are_many():
    g = mlp(batch=512, h=64, layers=12)
    m = parse_machine("h100:1x1")
    gc0, r0 = _mapped(g, m)
    t0 = memtech.Techniques(gc0, r0.views)
    assert len(t0.regions) > memtech.EXACT_LIMIT
    every = t0.price(MemoryPlan(recompute=memtech.recompute_all(t0.regions, "full")))
    cap = (every.max_bytes + r0.memory.max_bytes) // 2
    gc = GraphCost(g, CostModel(_with_capacity(m, cap), optimizer="adam"))
    mem, p = memtech.choose(gc, r0.views, exact_limit=0, offload=(False,))
    assert p.feasible and p.max_bytes <= cap and mem.recompute
    assert len(mem.recompute) < len(t0.regions)             # only as many regions as it takes
    assert p.recompute_s < every.recompute_s


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_overlap_hides_at_most_the_sync_and_never_beats_the_critical_path(zero):
    g = data_parallel(synthetic_transformer(2, batch=8, seq=64, hidden=256, heads=4), 8)
    m = parse_machine("h100:1x8")
    assert m.overlap_grad_sync
    gc, r = _mapped(g, m)
    p = memtech.price(gc, r.views, MemoryPlan(zero=zero), base=r)
    comm = p.sync_s + p.zero_comm_s
    assert 0 <= p.exposed_sync_s <= comm + 1e-12
    assert p.hidden_s >= 0
    assert p.iteration_s >= max(p.compute_s + p.comm_s, comm) + p.update_s - 1e-12
    assert p.iteration_s == pytest.approx(sum(v for _, v in p.rows()), rel=1e-9)
    no = dataclasses.replace(m, overlap_grad_sync=False)
    gcn, rn = _mapped(g, no)
    q = memtech.price(gcn, rn.views, MemoryPlan(zero=zero), base=rn)
    assert q.exposed_sync_s == pytest.approx(q.sync_s + q.zero_comm_s) and q.hidden_s == pytest.approx(0, abs=1e-15)
    assert p.iteration_s <= q.iteration_s + 1e-12


def test_without_overlap_and_techniques_the_price_is_todays():
    for spec in ("local:1x2", "summit:1x6"):
        m = parse_machine(spec)
        m = dataclasses.replace(m, overlap_grad_sync=False)
        g = data_parallel(mlp(batch=48, h=64, layers=3), m.num_devices)
        cm = CostModel(m, optimizer="adam")
        plain = MachineMapper(cm).optimize(g)
        withp = MachineMapper(cm).optimize(g, techniques=True)
        p = memtech.price(GraphCost(g, cm), plain.views, None, base=plain)
        assert p.iteration_s == pytest.approx(plain.cost, rel=1e-12)
        assert withp.cost <= plain.cost + 1e-15


def test_regions_partition_the_compute_nodes_at_single_activation_cuts():
    g = synthetic_transformer(3, batch=4, seq=16, hidden=64, heads=2)
    regs = memtech.regions(g)
    comp = [n for n in g.topo_order() if g.node(n).kind == "compute"]
    flat = [n for r in regs for n in r]
    assert sorted(flat) == sorted(comp) and len(flat) == len(set(flat))
    assert len(regs) >= 3 and all(len(r) >= memtech.MIN_REGION_OPS for r in regs)


def test_machine_files_without_the_new_fields_load_with_defaults():
    m = parse_machine("h100:1x8")
    assert m.overlap_grad_sync and "host" in m.links and m.host_mem_bandwidth > 0
    assert MachineSpec.from_json(json.loads(json.dumps(m.to_json()))) == m
    old = m.to_json()
    for k in ("overlap_grad_sync", "host_mem_bandwidth"):
        old.pop(k)
    old["links"].pop("host")
    o = MachineSpec.from_json(old)
    assert not o.overlap_grad_sync and "host" not in o.links and o.host_mem_bandwidth == 0
    assert not parse_machine("local:1x2").overlap_grad_sync
    gc, r = _mapped(data_parallel(mlp(batch=8, h=16, layers=2), 2), parse_machine("local:1x2"))
    assert not memtech.Techniques(gc, r.views).can_offload


def test_optimize_writes_the_memory_plan_and_its_numbers():
    from unity_pcg.plan import Plan, from_json
    from unity_pcg.search.optimize import optimize
    g = mlp(batch=1536, h=8192, layers=16)
    r = optimize(g, "summit:1x6", budget_s=10, optimizer="adam", max_candidates=3, pipeline=False)
    assert r.feasible and r.plan.memory is not None
    for k in ("recompute_s", "zero_comm_s", "offload_s", "exposed_sync_s"):
        assert k in r.plan.predicted
    back = from_json(json.loads(json.dumps(r.plan.to_json())))
    assert back.memory == r.plan.memory
    from unity_pcg.explanation import explain
    e = explain(r.plan)
    tech = e.totals["techniques"]
    assert tech["iteration_s"] == pytest.approx(r.predicted_iteration_s, rel=1e-9)
    assert sum(v for _, v in tech["rows"]) == pytest.approx(tech["iteration_s"], rel=1e-9)
    assert any(line.startswith(f"ZeRO-{r.plan.memory.zero}") for line in tech["lines"]) or not r.plan.memory.zero
    assert isinstance(r.plan, Plan)


def test_offload_is_checked_against_the_host_memory_of_each_node():
    """Offload puts, per device, the optimizer states, the updated parameter shard and its gradient shard in
    host memory (Adam: (2 + 2) x shard); the devices of a node share its ``host_memory_bytes``.  Two 1 KiB
    weights on 4 devices with ZeRO-1: 2 x 4 x 256 = 2 KiB per device, 8 KiB on one node of 4, 4 KiB per
    node on 2 nodes of 2.  Over capacity the plan is infeasible and ``choose`` does not take it."""
    g = data_parallel(mlp(batch=8, h=16, layers=2), 4)
    P = 16 * 16 * 4
    per_device = 2 * (2 + 2) * P // 4
    for size, per_node in (("1x4", 4 * per_device), ("2x2", 2 * per_device)):
        m = parse_machine(f"h100:{size}")
        assert m.host_memory_bytes >= 2**40
        gc, r = _mapped(g, m)
        p = memtech.Techniques(gc, r.views).price(MemoryPlan(zero=1, offload=True))
        assert p.feasible and p.host_per_node == {nd: per_node for nd in range(m.nodes)}
        assert any("host memory" in line for line in memtech.describe(p))
        assert p.to_json()["offload_host_bytes"] == per_node
        for cap, ok in ((per_node, True), (per_node - 1, False), (per_device, False)):
            small = dataclasses.replace(m, host_memory_bytes=cap)
            gc2, _ = _mapped(g, small)
            q = memtech.Techniques(gc2, r.views).price(MemoryPlan(zero=1, offload=True))
            assert q.feasible == ok, (size, cap)
            if not ok:
                assert "host memory" in q.reason and "node 0" in q.reason
    # choose: a device too small for the states, a host too small for them: no feasible offload plan
    m = parse_machine("h100:1x4")
    gc, r = _mapped(g, m)
    t = memtech.Techniques(gc, r.views)
    need = min(max(t.price(MemoryPlan(zero=z)).report.per_device.values()) for z in range(4))   # least without offload
    tight = _with_capacity(dataclasses.replace(m, host_memory_bytes=per_device), need - 1)
    gc3, _ = _mapped(g, tight)
    _, p = memtech.choose(gc3, r.views, recompute="none")
    assert not (p.feasible and p.memory.offload)
    roomy = _with_capacity(m, need - 1)
    gc4, _ = _mapped(g, roomy)
    _, p4 = memtech.choose(gc4, r.views, recompute="none")
    assert p4.feasible and p4.memory.offload


def test_host_memory_in_machine_files():
    """``host_memory_bytes``: presets carry it, JSON files round-trip and validate it, older files load with 0
    (unknown: offload is not offered)."""
    from unity_pcg.machine import MachineError
    for name, want in (("summit", 512 * 2**30), ("dgx-a100", 2 * 2**40), ("h100", 2 * 2**40)):
        assert parse_machine(f"{name}:2x4").host_memory_bytes == want
    assert parse_machine("local:1x2").host_memory_bytes > 0
    m = parse_machine("h100:1x8")
    obj = json.loads(json.dumps(m.to_json()))
    assert MachineSpec.from_json(obj) == m
    obj["host_memory_bytes"] = 1.5e12
    assert MachineSpec.from_json(obj).host_memory_bytes == 1_500_000_000_000
    for bad in (-1, "lots", 1.5, True):
        obj["host_memory_bytes"] = bad
        with pytest.raises(MachineError, match="host_memory_bytes"):
            MachineSpec.from_json(obj)
    with pytest.raises(MachineError, match="host_memory_bytes"):
        dataclasses.replace(m, host_memory_bytes=-5)
    obj.pop("host_memory_bytes")
    old = MachineSpec.from_json(obj)
    assert old.host_memory_bytes == 0
    gc, r = _mapped(data_parallel(mlp(batch=8, h=16, layers=2), 2), parse_machine("h100:1x2"))
    gc0 = GraphCost(gc.g, CostModel(dataclasses.replace(old.resized(1, 2)), optimizer="adam"))
    assert memtech.Techniques(gc, r.views).can_offload and not memtech.Techniques(gc0, r.views).can_offload


def test_zero3_collectives_are_one_per_unit():
    """ZeRO-3 runs one all-gather per unit before its forward, one before its backward and one reduce-scatter
    of its gradient (the executor's groups are the units), each paying its own latency: on links of 1 s
    latency and no bandwidth cost, 3 x units x (p - 1) seconds; stages 1-2 keep the buckets' (the
    all-reduce's) latency.  The executor runs them synchronously (no prefetch): nothing hidden."""
    g = data_parallel(mlp(batch=8, h=16, layers=8), 4)
    m = parse_machine("h100:1x4")
    from unity_pcg.machine import LinkSpec
    slow = dataclasses.replace(m, overlap_grad_sync=False,
                               links={k: LinkSpec(1e30, 1.0) for k in m.links})
    gc, r = _mapped(g, slow)
    t = memtech.Techniques(gc, r.views)
    assert t.n_units >= 3
    p3 = t.price(MemoryPlan(zero=3))
    assert p3.sync_s + p3.zero_comm_s == pytest.approx(3 * t.n_units * 3 * 1.0, rel=1e-6)
    p1 = t.price(MemoryPlan(zero=1))
    assert p1.zero_comm_s == 0.0
    # the executor's stage-3 collectives are synchronous: with overlap, none of them is hidden
    ov = dataclasses.replace(slow, overlap_grad_sync=True)
    gco, _ = _mapped(g, ov)
    po = memtech.Techniques(gco, r.views).price(MemoryPlan(zero=3))
    assert po.hidden_s == pytest.approx(0.0, abs=1e-9) and po.exposed_sync_s == pytest.approx(3 * t.n_units * 3.0)


def test_recompute_regions_take_in_the_all_gather_feeding_them(monkeypatch):
    """Megatron-LM's sequence parallelism on post-LayerNorm blocks, regions cut after each LayerNorm on
    sequence shards, whose Combine -> Replicate (an all-gather) feeds the next region's Linears.
    The region takes the gather in: fully recomputed, it keeps the shard (which the residual keeps anyway),
    not the gathered tensor, and its recomputation runs the all-gather again -- less memory and more time
    than a region of compute nodes only."""
    from unity_pcg.search.baselines import megatron
    g = megatron(synthetic_transformer(2, batch=4, seq=16, hidden=64, heads=4), 2, 2, sequence_parallel=True)
    role = g.roles()
    outs = {r[0] for r in g.outputs}
    regs = [list(x) for x in memtech.regions(g)]
    for i in range(1, len(regs)):      # a region ending with the LayerNorm, the next fed by its all-gather
        if g.node(regs[i][0]).op == "LayerNorm":
            regs[i - 1].append(regs[i].pop(0))
    regs = [tuple(x) for x in regs]
    fed = 0
    taken: set = set()
    for r in regs:
        m = memtech.region_members(g, role, r, taken, outs)
        taken |= m
        gathers = sorted(g.node(n).op for n in m - set(r) if g.node(n).op in memtech.GATHER_OPS)
        if gathers:
            fed += 1
            assert gathers == ["Combine", "Replicate"]
    assert fed == 3            # every region after a LayerNorm but the first layer (its input: the model input)
    gc, r = _mapped(g, parse_machine("h100:1x2"))
    plan = MemoryPlan(recompute=memtech.recompute_all(regs, "full"))
    assign = {n: (i, "full") for i, x in enumerate(regs) for n in x}
    t = memtech.Techniques(gc, r.views)
    with_gather, kept_with = t.price(plan), t.activation_bytes(assign)[0]
    monkeypatch.setattr(memtech, "GATHER_OPS", frozenset())
    t0 = memtech.Techniques(gc, r.views)
    without, kept_without = t0.price(plan), t0.activation_bytes(assign)[0]
    gathered = 4 * 16 * 64 * 4                             # the all-gathered input on each device, fp32
    for d in (0, 1):                                       # (the shard is kept either way: the residual)
        assert kept_without[d] - kept_with[d] == fed * gathered, d
    assert with_gather.max_bytes <= without.max_bytes
    assert with_gather.recompute_s > without.recompute_s


def test_zero3_reduce_scatter_holds_the_unit_gradient_twice():
    """ZeRO-3, one weight (one unit) on 2 copies: beyond what the weights hold throughout (the shard, its
    gradient, Adam's moments, as ``report.weights``), the backward's peak is at the unit's reduce-scatter,
    where the weight's gradient is whole (the half beyond the shard's) and made whole once more as the
    reduce-scatter's input vector (FSDP's flat split, the executor's ``_ZeroGather``): W/2 + W."""
    g = data_parallel(mlp(batch=2, h=256, layers=1), 2)
    gc, r = _mapped(g, parse_machine("h100:1x2"))
    t = memtech.Techniques(gc, r.views)
    ws = [x for x in t.weights if x.copies > 1]
    assert len(ws) == 1
    w = ws[0].nbytes
    rep = t.price(MemoryPlan(zero=3)).report
    for d, total in rep.per_device.items():
        assert total - rep.weights[d] - rep.activations[d] == pytest.approx(1.5 * w, rel=1e-6)
