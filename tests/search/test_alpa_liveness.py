"""Alpa's intra-operator ILP: the memory constraint per liveness step (search/alpa/intra.py)."""
import math
from itertools import product

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.alpa.intra import IntraInfeasible, IntraProblem, solve_intra

from .graphs import diamond, mlp

DGX = parse_machine("dgx-a100:1x8")


def _naive_steps(prob, choice):
    """Bytes per device at every step, written out step by step from the intervals (no difference arrays)."""
    out = []
    for t in range(prob.steps):
        tot = 0.0
        for a in prob.anchors:
            i = choice[a]
            tot += prob.live_static[a][i]
            for (t0, t1), b in zip(prob.live_iv[a], prob.live_bytes[a][i]):
                if t0 <= t <= t1:
                    tot += b
        for (u, v, shape, src, dst, saves), (t0, t1) in zip(prob.edges, prob.edge_iv):
            if t0 <= t <= t1:
                tot += prob.edge_memory(shape, src[choice[u]], dst[choice[v]], saves)
        out.append(tot)
    return out


def _combos(prob):
    counts = [len(prob.algos[a]) for a in prob.anchors]
    return [dict(zip(prob.anchors, c)) for c in product(*[range(k) for k in counts])]


GRAPHS = [(lambda: mlp(batch=8, h=16, layers=3), (2, 2)),
          (lambda: mlp(batch=64, h=512, layers=3), (1, 4)),
          (lambda: diamond(batch=8, h=16), (2, 2)),
          (lambda: diamond(batch=1024, h=64), (1, 4))]


@pytest.mark.parametrize("graph,mesh", GRAPHS)
def test_liveness_steps_and_rows_against_brute_force(graph, mesh):
    prob = IntraProblem(graph(), DGX, mesh)
    combos = _combos(prob)
    assert len(combos) <= 30000 and prob.steps == 2 * len(prob.anchors)
    objs = [prob.objective(c) for c in combos]
    peaks, ends = [], []
    for c in combos:
        steps = prob.memory_steps(c)
        assert list(steps) == pytest.approx(_naive_steps(prob, c), rel=1e-12)
        peaks.append(float(max(steps)))
        ends.append(prob.memory_end_of_forward(c))
        # the old single row (end of the forward pass) is never above the liveness peak
        assert ends[-1] <= peaks[-1] * (1 + 1e-12)
    # the gradients of the last operators' outputs live on top of every kept activation: strictly tighter
    assert any(p > e * (1 + 1e-6) for p, e in zip(peaks, ends))
    levels = sorted(set(peaks))
    for budget in {levels[1], levels[len(levels) // 5], levels[len(levels) // 3], levels[-1]}:
        # the rows kept are the steps that can bind: any choice over the budget is over it on a kept row
        rows = prob.liveness_rows(None, budget)
        assert len(rows) <= prob.steps
        for c, p in zip(combos, peaks):
            on_rows = max((prob.memory_steps(c)[t] for t in rows), default=0.0)
            assert (p > budget * (1 + 1e-9)) == (on_rows > budget * (1 + 1e-9))
        # the ILP with one row per kept step: the brute-force optimum over the choices that fit at every step
        fit = min(o for o, p in zip(objs, peaks) if p <= budget)
        choice, obj, _, _ = prob.solve(budget)
        assert prob.memory(choice) <= budget * (1 + 1e-9)
        assert obj == pytest.approx(fit, rel=1e-6, abs=1e-12)
    with pytest.raises(IntraInfeasible):
        prob.solve(levels[0] * 0.99)


def test_rows_are_few_and_identical_live_sets_counted_once():
    prob = IntraProblem(mlp(batch=64, h=512, layers=8), DGX, (1, 4))
    rows = prob.liveness_rows()
    # every step where nothing is freed is dominated by the next one: far fewer rows than steps
    assert 1 <= len(rows) < prob.steps / 2
    # no kept row's live set is inside another kept row's
    sets = []
    for t in rows:
        s = set()
        for a in prob.anchors:
            for j, (t0, t1) in enumerate(prob.live_iv[a]):
                if t0 <= t <= t1 and prob.live_bytes[a][:, j].any():
                    s.add((a, j))
        for e, (t0, t1) in enumerate(prob.edge_iv):
            if t0 <= t <= t1 and prob.edge_matrices(e)[3].any():
                s.add((None, e))
        sets.append(frozenset(s))
    for i, x in enumerate(sets):
        for j, y in enumerate(sets):
            assert i == j or not x <= y
    # a budget no choice can exceed keeps no row at all
    assert prob.liveness_rows({a: list(range(len(prob.algos[a]))) for a in prob.anchors}, 1e30) == []


def test_liveness_binds_where_the_single_row_did_not():
    """A budget between the end-of-forward row and the liveness peak of the unconstrained optimum: the old
    single row accepted that plan, the per-step rows do not (a gradient or transient does not fit)."""
    g = mlp(batch=1024, h=256, layers=4)
    prob = IntraProblem(g, DGX, (1, 4))
    free, _, _, _ = prob.solve(None)
    peak, end = prob.memory(free), prob.memory_end_of_forward(free)
    assert peak > end
    budget = (peak + end) / 2
    assert prob.memory_end_of_forward(free) <= budget      # the old row accepted the free optimum
    choice, obj, _, _ = prob.solve(budget)
    assert choice != free and prob.memory(choice) <= budget * (1 + 1e-9)
    assert obj >= prob.objective(free) * (1 - 1e-9)


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    p = tmp_path_factory.mktemp("g") / "gpt.onnx"
    zoo.export("gpt_350m", str(p), size="tiny", batch=8)
    return load_onnx(str(p), load_weights=False)


def test_gpt_liveness_is_the_old_row_or_tighter(tiny_gpt):
    """On a GPT the per-step peak is at least the old single row, and the plan fits both; with a budget
    between the two the ILP changes its plan or reports that nothing fits."""
    plan = solve_intra(tiny_gpt, DGX, (2, 4), price=True)
    st = plan.stats
    assert st["memory_rows"] <= st["liveness_steps"]
    assert st["ilp_memory_bytes"] >= st["ilp_memory_end_of_forward_bytes"] * (1 - 1e-12)
    # our memory model (kept activations only) sees no more than the liveness peak
    assert plan.memory_bytes <= st["ilp_memory_bytes"] * 1.05
    # the gradient of the LM head's logits lives on top of every kept activation: strictly tighter
    assert st["ilp_memory_bytes"] > st["ilp_memory_end_of_forward_bytes"] * 1.001
    budget = (st["ilp_memory_bytes"] + st["ilp_memory_end_of_forward_bytes"]) / 2
    tight = solve_intra(tiny_gpt, DGX, (2, 4), memory_budget=budget, price=False)
    assert 0 < tight.stats["memory_rows"] < st["liveness_steps"]
    assert tight.stats["ilp_memory_bytes"] <= budget * (1 + 1e-9)
    assert tight.objective >= plan.objective * (1 - 1e-9)
    assert math.isfinite(plan.time_s)
