"""Per-stage recomputation in a pipeline (issue 19 item 2, AdaPipe's choice): 1F1B's first stage holds more
micro-batches in flight than the last, so where memory binds on the first stage only, the first stage
recomputes only the regions it must and the last none (search.pipeline.stage_partial), never slower than
recomputing every region of the stage one way, and near the best assignment found by enumeration."""
from __future__ import annotations

from itertools import product

from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search import memtech
from unity_pcg.search import pipeline as P
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer

from .test_pipeline import machine

PLAN = ((0, 2, 0, 1), (2, 4, 1, 1))
M = 4


def _graph():
    return synthetic_transformer(4, batch=8, seq=256, hidden=256, heads=4)


def _cap(g) -> int:
    """A device memory where stage 0 (2 micro-batches in flight) does not fit without recomputation but fits
    with all of it, and stage 1 (1 in flight) fits without."""
    mp = MachineMapper(CostModel(machine(1, 2, memory=1 << 40), optimizer="adam"), techniques=True)
    none = P.evaluate_pipeline(g, mp, PLAN, M, max_layers=4, tech=(0, ("none", "none")))
    full = P.evaluate_pipeline(g, mp, PLAN, M, max_layers=4, tech=(0, ("full", "full")))
    m0, m1, f0 = none.stages[0].memory_bytes, none.stages[1].memory_bytes, full.stages[0].memory_bytes
    lo = max(m1, f0)
    assert lo < m0
    return lo + (m0 - lo) // 3


def test_first_stage_recomputes_only_what_it_must_and_the_last_none():
    g = _graph()
    cap = _cap(g)
    mp = MachineMapper(CostModel(machine(1, 2, memory=cap), optimizer="adam"), techniques=True)
    uniform = [P.evaluate_pipeline(g, mp, PLAN, M, max_layers=4, tech=(0, (md, "none")), stitch=False)
               for md in ("selective", "full")]
    assert not P.evaluate_pipeline(g, mp, PLAN, M, max_layers=4, tech=(0, ("none", "none")), stitch=False).feasible
    part = P.evaluate_pipeline(g, mp, PLAN, M, max_layers=4, tech=(0, ("full", "none")), partial=True)
    assert part.feasible and part.max_memory_bytes <= cap
    assert part.techniques["recompute"] == ["per-region", "none"]
    ok = [u.cost for u in uniform if u.feasible]
    assert ok and part.cost < min(ok)                     # fewer regions than the whole stage one way
    stage_of = {n: k for k, st in enumerate(part.stages) for n in st.nodes}
    assert part.memory_plan.recompute and {stage_of[r.nodes[0]] for r in part.memory_plan.recompute} == {0}
    # the search, free to choose the stages, recomputes in the first stage only
    r = P.search_pipeline(g, mp, min_stages=2, max_stages=2, micro_batches=M, max_layers=4)
    assert r is not None and r.feasible and r.techniques["recompute"][-1] == "none"


def test_stage_partial_is_near_the_exhaustive_assignment():
    g = _graph()
    cap = _cap(g)
    m = machine(1, 2, memory=cap)
    cm = CostModel(m, optimizer="adam")
    mp = MachineMapper(cm, techniques=True)
    roles = GraphCost(g, cm).role
    layers, info = P.sequential_layers(g, roles, 4)
    gM = P.rebatch(g, 8, 8 // M)
    nodes = [n for a, b in layers[0:2] for u in range(a, b) for n in info.units[u]]
    p = P._price(mp, P.stage_graph(gM, roles, nodes), P.default_intra, P.sub_mesh(m, 0, 1))
    infl = P.in_flight(2, 0, M)
    got = P.stage_partial(mp, p, infl, 0, cap)
    assert got is not None and got.memory_plan.recompute
    tq = P._analysis(mp, p)
    assert 2 <= len(tq.regions) <= 7
    best = None
    for modes in product(memtech.MODES, repeat=len(tq.regions)):
        regs = tuple(RecomputeRegion(tuple(r), md) for r, md in zip(tq.regions, modes) if md != "none")
        sp = P._with_priced(p, tq, tq.price(MemoryPlan(0, False, regs)))
        if max(P._stage_peak(sp, infl).values()) <= cap:
            best = min(best if best is not None else float("inf"), sp.t + sp.once)
    assert best is not None
    assert best * (1 - 1e-12) <= got.t + got.once <= best * 1.03
    assert max(P._stage_peak(got, infl).values()) <= cap


def test_the_stage_dp_memory_table_is_never_optimistic_and_not_far_below_exact():
    """The stage DP's micro-batches a stage holds (:func:`search.pipeline._holds_table`, from its layers'
    prices) against the exact price of the stage's whole sub-PCG: never more; and the backward's own peak of
    each layer (not additive) is counted once per stage, so the table is not far below (the sum over the
    layers refused stages that fit)."""
    import math
    g = _graph()
    for cap_mib in (40, 60, 80):
        cap = cap_mib << 20
        m = machine(1, 2, memory=cap)
        cm = CostModel(m, optimizer="adam")
        mp = MachineMapper(cm, techniques=True)
        roles = GraphCost(g, cm).role
        layers, info = P.sequential_layers(g, roles, 8)
        gM = P.rebatch(g, 8, 2)
        nodes_of = [[n for u in range(a, b) for n in info.units[u]] for a, b in layers]
        lay = P._LayerPrices(gM, roles, nodes_of, mp, (P.default_intra,), m, {})
        L = len(layers)
        for mode in ("none", "full"):
            h = P._holds_table([P.stage_techniques(mp, lay.get(x, 1, 0), mode, 0) for x in range(L)], cap)
            for k in range(L):
                for i in range(k, L):
                    nodes = [n for x in range(k, i + 1) for n in nodes_of[x]]
                    p = P._price(mp, P.stage_graph(gM, roles, nodes), P.default_intra, P.sub_mesh(m, 0, 1))
                    p = P.stage_techniques(mp, p, mode, 0)
                    w, a = max(p.w.values()), max(p.a.values())
                    exact = math.floor((cap - w) / a) if w <= cap else -1
                    assert exact // 2 - 1 <= h[k, i] <= exact, (cap_mib, mode, k, i, h[k, i], exact)


def test_counts_below_one_without_any_plan_are_skipped():
    """Where the stage DP finds no plan at M micro-batches (memory), it finds none at fewer, larger ones: those
    are skipped, the larger counts still searched; the result is the best of the counts searched one by one."""
    g = _graph()
    mp = MachineMapper(CostModel(machine(1, 2, memory=40 << 20), optimizer="adam"), techniques=True)
    counts = [1, 2, 4, 8]
    r = P.search_pipeline(g, mp, min_stages=2, max_stages=2, micro_batches=counts, max_layers=4)
    assert r is not None and r.feasible
    skipped = set(r.stats.get("micro_batches_skipped", []))
    assert skipped and max(skipped) < max(r.stats["micro_batches_tried"])
    one = [P.search_pipeline(g, mp, min_stages=2, max_stages=2, micro_batches=m, max_layers=4) for m in counts]
    assert all(x is None or not x.feasible for m, x in zip(counts, one) if m in skipped)
    assert r.cost == min(x.cost for x in one if x is not None and x.feasible)
