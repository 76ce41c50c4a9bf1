"""Memory-technique pricing on a model of repeated identical blocks (search/memtech.py, search/memory.py):

* the memos shared by identical blocks -- tensors' device dicts and the walk's rows (``memtech.SHARE_BLOCKS``),
  autocast copies keyed up to renaming (``memory._CAST_KEYED``), kept fractions per GraphCost
  (``memory.kept``), a mapping's memory report handed in (``memtech.plain_report``) -- price every plan to the
  same floats as the reference (each tensor on its own, every node computed), on two decoders priced one
  after the other in the same process (a memo that confused their blocks -- equal placements, other bytes --
  would give the second the first's numbers);
* a caller's deadline stops the pricing (``search.budget.within``; fake clocks, no wall clock), and the data-
  parallel floor's linear fallback (``Evaluator.cheap``) prices plainly past it rather than run on."""
from __future__ import annotations

import dataclasses

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.onnx_import import load_onnx
from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search import memory, memtech
from unity_pcg.search.baselines import data_parallel, megatron
from unity_pcg.search.budget import Deadline, Expired, within
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """The zoo's Llama at test width, four identical blocks, at two batch sizes (same placements, other bytes)."""
    from unity_pcg import zoo
    assert zoo.get_config("llama_7b", "small").layers == 4
    out = []
    for b in (8, 4):
        p = zoo.export("llama_7b", str(tmp_path_factory.mktemp("tb") / f"llama{b}.onnx"), size="small", batch=b)
        out.append(load_onnx(p, load_weights=False))
    return out


def _plans(t: memtech.Techniques) -> list:
    R = t.regions
    half = tuple(RecomputeRegion(tuple(r), md) for r, md in zip(R, ("full", "selective") * len(R)) if r)[::2]
    out = [MemoryPlan()]
    for z in (0, 1, 2, 3):
        out.append(MemoryPlan(z))
        out.append(MemoryPlan(z, False, memtech.recompute_all(R, "full")))
        out.append(MemoryPlan(z, False, memtech.recompute_all(R, "selective")))
        out.append(MemoryPlan(z, False, half))
    out.append(MemoryPlan(1, True))
    out.append(MemoryPlan(3, True, memtech.recompute_all(R, "full")))
    return out


def _facts(p: memtech.Priced) -> tuple:
    return (p.iteration_s, p.feasible, p.reason, sorted(p.report.per_device.items()), sorted(p.report.weights.items()),
            sorted(p.report.activations.items()), p.compute_s, p.comm_s, p.sync_s, p.zero_comm_s, p.recompute_s,
            p.update_s, p.offload_s, p.hidden_s, p.exposed_sync_s, p.zero_units, sorted(p.host_per_node.items()),
            p.memory)


def _mappings(g, machine: str, precision: str):
    """(GraphCost maker, views, base cost, plain memory report) of dp and Megatron layouts of ``g``."""
    m = parse_machine(machine)
    model = CostModel(m, optimizer="adam", precision=precision)
    out = []
    for pg in (data_parallel(g, 4), megatron(g, 4, devices_per_node=4)):
        r = MachineMapper(model, techniques=False).optimize(pg)
        out.append((pg, model, r.views, r.cost, r.memory))
    return out


def _fresh(model: CostModel) -> CostModel:
    """A CostModel like ``model`` with no memo (a CostModel keeps its graphs' GraphCosts and their memos)."""
    return CostModel(model.machine, optimizer=model.optimizer, precision=model.precision)


def _price_all(cases, tight: bool) -> list:
    """Every plan of every case priced, and ``choose`` on a capacity that needs techniques (``tight``)."""
    got = []
    for pg, model, views, cost, report in cases:
        gc = GraphCost(pg, _fresh(model))                  # a fresh one: every per-GraphCost memo cold
        t = memtech.Techniques(gc, views, cost, report=report if memtech.SHARE_BLOCKS else None)
        for mp in _plans(t):
            got.append(_facts(t.price(mp)))
        got.append(sorted((k, sorted(v.per_dev.items()), sorted(v.mask_dev.items()), v.base)
                          for k, v in t.tensors.items()))
        if tight:
            t.capacity = int(max(t.base_report.per_device.values()) * 0.6)
            got.append(_facts(t.choose()))
    return got


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_shared_block_memos_price_the_same_floats_as_the_reference(decoders, monkeypatch, precision):
    cases = [c for g in decoders for c in _mappings(g, "h100:1x4", precision)]
    memtech._TEMPLATES.clear()
    shared = _price_all(cases, tight=True)                 # both decoders, memos kept between them
    assert len(memtech._TEMPLATES) > 0
    monkeypatch.setattr(memtech, "SHARE_BLOCKS", False)
    monkeypatch.setattr(memory, "_CAST_KEYED", False)
    reference = _price_all(cases, tight=True)
    assert len(shared) == len(reference)
    for a, b in zip(shared, reference):
        assert a == b


def test_the_second_decoder_is_not_priced_with_the_first_ones_blocks(decoders):
    """Priced after the first (memos warm), the batch-4 decoder's tensors hold half the bytes of the batch-8
    one's on the same devices: the shared dicts tell them apart."""
    (g8, g4) = decoders
    memtech._TEMPLATES.clear()
    t = {}
    for g, b in ((g8, 8), (g4, 4)):
        pg, model, views, cost, report = _mappings(g, "h100:1x4", "bf16")[0]
        t[b] = memtech.Techniques(GraphCost(pg, _fresh(model)), views, cost)
    big = {k: v.per_dev for k, v in t[8].tensors.items()}
    small = {k: v.per_dev for k, v in t[4].tensors.items()}
    batched = [k for k in big if k in small and big[k] != small[k]]
    assert batched                                          # activations scale with the batch
    for k in batched:
        assert big[k] is not small[k]
    # and within one decoder its four blocks share their dicts (what makes the memo pay)
    ids = {id(v.per_dev) for v in t[8].tensors.values()}
    assert len(ids) < len(t[8].tensors) / 2


@pytest.mark.parametrize("layout", ["dp", "megatron"])
def test_kept_and_cast_memos_equal_the_functions_they_memoize(decoders, layout):
    g = data_parallel(decoders[0], 4) if layout == "dp" else megatron(decoders[0], 4, devices_per_node=4)
    gc = GraphCost(g, CostModel(parse_machine("h100:1x4"), optimizer="adam", precision="bf16"))
    copy = memory._saves_copy(gc)
    for n in gc.nodes():
        for k in range(len(g.shapes(n))):
            assert memory.kept(gc, n, k) == memory.kept_fraction(g, n, k, copy)
    keyed = {n: memory.cast_items(gc, n) for n in gc.nodes()}
    assert len(set(gc._cast_keyed)) < sum(1 for n in gc.nodes() if gc.role[n] == "compute")
    fresh = GraphCost(g, _fresh(gc.model))
    assert fresh is not gc
    old = memory._CAST_KEYED
    memory._CAST_KEYED = False
    try:
        assert keyed == {n: memory.cast_items(fresh, n) for n in gc.nodes()}
    finally:
        memory._CAST_KEYED = old


def test_plain_report_is_the_mappings_memory(decoders):
    for pg, model, views, cost, report in _mappings(decoders[0], "h100:1x4", "bf16"):
        want = memory.memory_per_device(GraphCost(pg, _fresh(model)), views)
        got = memtech.plain_report(report.weights, report.activations, report.capacity)
        assert got == want and list(got.per_device) == list(want.per_device)


# --- deadlines ------------------------------------------------------------------------------------------

class _Clock:
    """Advances one unit at every reading (so where a deadline cuts does not depend on the host's speed)."""

    def __init__(self):
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.now += 1.0
        self.readings += 1
        return self.now


def _tight(decoders):
    pg, model, views, cost, report = _mappings(decoders[0], "h100:1x4", "bf16")[0]
    t = memtech.Techniques(GraphCost(pg, _fresh(model)), views, cost)
    t.capacity = int(max(t.base_report.per_device.values()) * 0.6)      # only techniques make it fit
    return t, pg, model, views, cost


def test_a_callers_deadline_stops_choosing_and_building(decoders):
    t, pg, model, views, cost = _tight(decoders)
    free = t.choose()
    clock = _Clock()
    with within(Deadline.never(clock)):                     # a deadline that never passes: the same choice
        assert _facts(t.choose()) == _facts(free)
    # one reading per loop head: the whole choice reads the clock many times ...
    n = clock.readings
    assert n > 20
    # ... and a deadline passing halfway stops it
    clock = _Clock()
    with pytest.raises(Expired):
        with within(Deadline(n / 2, clock)):
            t.choose()
    assert clock.readings <= n / 2 + 2                      # it stopped at the first check past the deadline
    # building the per-mapping analysis checks it too
    clock = _Clock()
    with pytest.raises(Expired):
        with within(Deadline(1.5, clock)):                  # passed at the second reading
            memtech.Techniques(GraphCost(pg, _fresh(model)), views, cost)
    assert clock.readings == 2


def test_the_dp_floors_linear_fallback_prices_plainly_past_the_deadline(decoders):
    from unity_pcg.search.optimize import Evaluator
    pg = data_parallel(decoders[0], 4)
    m = parse_machine("h100:1x4")
    ev = Evaluator(m, "adam", precision="bf16")
    with_tech = ev.cheap(pg)                                # no deadline: its techniques chosen
    assert with_tech.techniques is not None
    clock = _Clock()
    with within(Deadline(0.5, clock)):                      # passed at the first reading
        cut = ev.cheap(pg)
    assert cut is not None and cut.techniques is None and cut.views == with_tech.views
    plain = ev.mapper.first_views(pg, None, ev.pins(pg), techniques=False)
    assert (cut.cost, cut.feasible, cut.memory) == (plain.cost, plain.feasible, plain.memory)
    def untimed(r):
        return dataclasses.replace(r, solve_s=0.0, stats={k: v for k, v in r.stats.items() if not k.endswith("_s")})
    assert untimed(cut) == untimed(plain)


# --- the two streams' critical path ---------------------------------------------------------------------

def _simulate_reference(dur, ops) -> float:
    """memtech._simulate as it was written first (triggers compared as tuples, the stream entered at every task)."""
    import math
    ops = sorted(ops, key=lambda o: (o[0], o[1]))
    need: dict = {}
    for j, o in enumerate(ops):
        if o[3] is not None:
            need.setdefault(o[3], []).append(j)
    start = [0.0] * len(dur)
    end = [0.0] * len(dur)
    op_end: dict = {}
    state = {"k": 0, "free": 0.0}

    def issue(upto):
        while state["k"] < len(ops) and ops[state["k"]][0] <= upto:
            k = state["k"]
            (ti, which), _, t, _ = ops[k]
            at = 0.0 if ti < 0 else (start[ti] if which == 0 else end[ti])
            state["free"] = max(state["free"], at) + t
            op_end[k] = state["free"]
            state["k"] += 1

    issue((-1, 1))
    prev = 0.0
    for i, d in enumerate(dur):
        s = prev
        for j in need.get(i, ()):
            if j not in op_end:
                issue(ops[j][0])
            s = max(s, op_end[j])
        start[i] = s
        issue((i, 0))
        end[i] = s + d
        prev = end[i]
        issue((i, 1))
    issue((math.inf, 1))
    return max(prev, state["free"])


def test_the_critical_path_is_the_references_float_for_float():
    import random
    rng = random.Random(7)
    for _ in range(2000):
        nt = rng.randint(1, 30)
        dur = [rng.random() * rng.choice([1e-3, 1.0, 7.0]) for _ in range(nt)]
        ops = []
        for q in range(rng.randint(0, 25)):
            ti, which = rng.randint(-1, nt - 1), rng.randint(0, 1)
            needer = rng.randint(ti + 1, nt - 1) if rng.random() < 0.5 and ti + 1 < nt else None
            ops.append(((ti, which), q, rng.random() * rng.choice([1e-4, 1.0, 3.0]), needer))
        rng.shuffle(ops)
        assert memtech._simulate(dur, ops) == _simulate_reference(dur, ops)


@pytest.mark.parametrize("layout", [0, 1])
def test_the_greedy_recomputation_is_the_scans_choice(decoders, layout):
    """The greedy choice of regions (array form) is the step-by-step scan's, plan for plan, on capacities from
    a little short to far short of what the mapping needs (exact when few regions: EXACT_LIMIT 0 forces it)."""
    pg, model, views, cost, report = _mappings(decoders[0], "h100:1x4", "bf16")[layout]
    got, want = [], []
    for frac in (0.97, 0.9, 0.75, 0.6, 0.45, 0.3, 0.1):
        for greedy, out in ((memtech.Techniques._greedy, got), (memtech.Techniques._greedy_loop, want)):
            t = memtech.Techniques(GraphCost(pg, _fresh(model)), views, cost)
            t._greedy = greedy.__get__(t)
            t.capacity = int(max(t.base_report.per_device.values()) * frac)
            out.append(_facts(t.choose(exact_limit=0)))
    assert got == want
    assert len({g[-1] for g in got}) > 2                    # the capacities ask for different plans


@pytest.mark.parametrize("layout", [0, 1])
def test_the_trim_leaves_unpriced_only_steps_like_one_that_failed(decoders, layout, monkeypatch):
    """The greedy's trim does not price a step down like one that failed since the plan last changed (the same
    step of an identical block earlier in the forward: ``memtech.TRIM_PREDICT``), and chooses the plan the trim
    that prices every step chooses, on capacities from a little short to far short of what the mapping needs."""
    pg, model, views, cost, report = _mappings(decoders[0], "h100:1x4", "bf16")[layout]
    got, want, skipped = [], [], 0
    for frac in (0.97, 0.9, 0.75, 0.6, 0.45, 0.3, 0.1):
        for predict, out in ((True, got), (False, want)):
            monkeypatch.setattr(memtech, "TRIM_PREDICT", predict)
            t = memtech.Techniques(GraphCost(pg, _fresh(model)), views, cost)
            t.capacity = int(max(t.base_report.per_device.values()) * frac)
            out.append(_facts(t.choose(exact_limit=0)))
            skipped += t.trim_skipped
    assert got == want
    assert skipped > 0                                      # steps were left unpriced
