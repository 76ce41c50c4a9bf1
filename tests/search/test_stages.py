"""The shared stage DP and layer clustering (search/stages.py) against brute force: the DP over layers x
sub-meshes on synthetic stage costs (Alpa's device counts, and sub-meshes laid out left to right with
placement rules and entry costs as Unity's pipeline search uses it), and the clustering (every layer
boundary a valid cut, no trained weight on both sides, never refused, optimal for its objective)."""
import itertools
import math
import random

import numpy as np
import pytest

from unity_pcg.pcg import PCG
from unity_pcg.search.budget import Deadline
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.stages import allowed_cuts, cluster, holds, layer_inputs, stage_dp, t_max_bounds

from .test_pipeline import machine


# --- the stage DP against brute force ------------------------------------------------------------------

def _random_costs(rng, L, sizes):
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
    return t, mem, act


def _brute(t, fit, sizes, T, B, allowed=None, entry=None, stages=None):
    """Every cut of the layers into stages and every sequence of sub-mesh options covering T devices left
    to right; the least ``sum(t + entry) + (B - 1) max t``."""
    L = t.shape[0]
    best = math.inf
    for S in (range(1, L + 1) if stages is None else [stages]):
        for cuts in itertools.combinations(range(1, L), S - 1):
            b = (0,) + cuts + (L,)
            for js in itertools.product(range(len(sizes)), repeat=S):
                if sum(sizes[j] for j in js) != T:
                    continue
                ts, extra, d = [], 0.0, 0
                for idx, j in enumerate(js):
                    k, i = b[idx], b[idx + 1] - 1
                    if not math.isfinite(t[k, i, j]) or not fit(S - idx)[k, i, j]:
                        break
                    if allowed is not None and not allowed(d, j, idx == S - 1):
                        break
                    ts.append(t[k, i, j])
                    extra += entry(k, d, j) if entry else 0.0
                    d += sizes[j]
                else:
                    best = min(best, sum(ts) + extra + (B - 1) * max(ts))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_stage_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 5)
    sizes = [1, 2, 4, 8][: rng.randint(2, 4)]
    T = rng.choice([s for s in (2, 4, 6, 8) if s <= 2 * sizes[-1]])
    B = rng.choice([1, 2, 4, 8])
    t, mem, act = _random_costs(rng, L, sizes)
    cap = rng.uniform(0.8, 2.0)
    hold = np.vectorize(lambda w, a: holds({0: w}, {0: a}, cap), otypes=[float])(mem, act)

    def fit(s):
        return mem + min(s, B) * act <= cap

    dp = stage_dp(L, sizes, T, B, t, fits=hold)
    want = _brute(t, fit, sizes, T, B)
    best = dp.best()
    assert (best[0] == pytest.approx(want, rel=1e-12)) if math.isfinite(want) else best is None
    if best:                                    # the plan returned is one that scores its cost
        stages = best[1]
        assert sum(sizes[s.option] for s in stages) == T
        assert [s.first for s in stages] == [0] + [s.end for s in stages[:-1]]
        assert stages[-1].end == L
        assert [s.start for s in stages] == [sum(sizes[x.option] for x in stages[:n]) for n in range(len(stages))]
        ts = [t[s.first, s.end - 1, s.option] for s in stages]
        assert sum(ts) + (B - 1) * max(ts) == pytest.approx(best[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_stage_dp_with_placement_rules_and_entry_costs_equals_brute_force(seed):
    # sub-meshes laid out left to right: an option may start only where ``allowed`` says (a block inside a
    # node, or whole nodes), the last stage takes any allowed block to the end, and a stage pays an entry
    # cost that depends on where it starts; the best plan is among those returned
    rng = random.Random(100 + seed)
    L = rng.randint(1, 4)
    D = rng.choice([2, 4])
    N = rng.choice([1, 2])
    T = N * D
    sizes = list(range(1, T + 1))
    B = rng.choice([1, 2, 4])
    t, mem, act = _random_costs(rng, L, sizes)
    cap = rng.uniform(1.0, 3.0)
    hold = np.vectorize(lambda w, a: holds({0: w}, {0: a}, cap), otypes=[float])(mem, act)
    inner = {s for s in sizes if s <= D and D % s == 0} | {n * D for n in range(1, N + 1)}
    E = {(k, d, j): (rng.uniform(0, 0.3) if k and d else 0.0) for k in range(L) for d in range(T + 1)
         for j in range(len(sizes))}

    def allowed(d, j, last):
        s = sizes[j]
        block = (s <= D and d % D + s <= D) or (d % D == 0 and s % D == 0)
        return block and (last or s in inner)

    def fit(s):
        return mem + min(s, B) * act <= cap

    def score(stages):
        ts = [t[s.first, s.end - 1, s.option] for s in stages]
        return sum(ts) + sum(E[(s.first, s.start, s.option)] for s in stages) + (B - 1) * max(ts)

    dp = stage_dp(L, sizes, T, B, t, fits=hold, entry=lambda k, d, j: E[(k, d, j)], allowed=allowed,
                  score=score, max_stages=3)
    want = min(_brute(t, fit, sizes, T, B, allowed, lambda k, d, j: E[(k, d, j)], stages=S)
               for S in range(1, min(3, L) + 1))
    got = min((sc for sc, st in dp.plans), default=math.inf)
    assert got == pytest.approx(want, rel=1e-12) if math.isfinite(want) else got == math.inf
    for _, stages in dp.plans:
        assert all(allowed(s.start, s.option, n == len(stages) - 1) for n, s in enumerate(stages))


def test_stage_dp_stops_early_once_B_times_t_max_reaches_the_best():
    # two layers on one device: t_max = 1 finds nothing (two stages need two devices), t_max = 2 finds
    # the one-stage plan (64 * 2 = 128); the next bound, 3 (a two-device mesh), is not tried: 64 * 3 >= 128
    t = np.array([[[1.0, 3.0], [2.0, 3.0]], [[math.inf, math.inf], [1.0, 3.0]]])
    dp = stage_dp(2, [1, 2], 1, 64, t)
    assert dp.best()[0] == pytest.approx(2.0 + 63 * 2.0) and dp.best()[1] == ((0, 2, 0, 0),)
    assert dp.tried == 2
    # with memory refusing every stage nothing covers the device
    dp = stage_dp(2, [1, 2], 1, 4, t, fits=np.zeros_like(t))
    assert dp.best() is None and dp.plans == []


def test_stage_dp_stops_at_its_deadline_with_a_plan():
    ticks = iter(range(10**6))
    clock = lambda: next(ticks)                 # noqa: E731 - advances on every reading
    t = np.random.default_rng(0).uniform(1, 2, (3, 3, 2))
    full = stage_dp(3, [1, 2], 2, 4, t)
    r = stage_dp(3, [1, 2], 2, 4, t, deadline=Deadline(-1, clock))
    assert r.cut and r.tried == 1 and r.best()[0] >= full.best()[0]
    assert not full.cut and full.tried >= 1


def test_ties_within_tie_prefer_the_smaller_largest_stage():
    # three layers in two stages of one device: [0][1, 2] sums 1 + 3 = 4 (largest 3), [0, 1][2] sums
    # 2 + 2.002 = 4.002 (largest 2.002), within 0.1% of each other
    t = np.full((3, 3, 1), math.inf)
    t[0, 0, 0], t[1, 2, 0], t[0, 1, 0], t[2, 2, 0] = 1.0, 3.0, 2.0, 2.002
    dp = stage_dp(3, [1], 2, 1, t, bounds=[3.0], tie=1e-3, min_stages=2)
    assert [(s.first, s.end) for s in dp.plans[0][1]] == [(0, 2), (2, 3)]
    dp = stage_dp(3, [1], 2, 1, t, bounds=[3.0], tie=0.0, min_stages=2)
    assert [(s.first, s.end) for s in dp.plans[0][1]] == [(0, 1), (1, 3)]


def test_holds_and_bounds():
    assert holds({0: 1.0}, {0: 0.25}, 2.0) == 4
    assert holds({0: 3.0}, {}, 2.0) == -1
    assert holds({0: 1.0, 1: 0.0}, {1: 1.0}, 2.0) == 2
    assert holds({}, {}, 2.0) == math.inf
    assert t_max_bounds([1.0, 1.005, 1.02, math.inf, 2.0], rel=0.01) == [(1.0, 1.005), (1.02, 1.02), (2.0, 2.0)]
    assert t_max_bounds([1.0, 1.0 + 1e-7, 2.0], eps=1e-6) == [(1.0, 1.0 + 1e-7), (2.0, 2.0)]
    assert len(t_max_bounds(np.linspace(1, 100, 1000), rel=0.01, most=10)) <= 10


# --- clustering ----------------------------------------------------------------------------------------

def _skip_chain(batch, widths, shared_scale=False):
    """A chain of Linear+Relu whose every other layer also reads the block input two back (a skip): cuts
    differ in the bytes they carry.  ``shared_scale``: one trained scale multiplies every block's output
    (a weight read on both sides of every cut, as an exporter's deduplicated norm scale)."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, widths[0])})
    scale = b.add("Weight", {"name": "scale", "shape": (widths[1],)}) if shared_scale else None
    prev = None
    for i in range(len(widths) - 1):
        w = b.add("Weight", {"name": f"w{i}", "shape": (widths[i], widths[i + 1])})
        y = b.add("Linear", {}, [x, w], name=f"fc{i}")
        y = b.add("Relu", {}, [y], name=f"relu{i}")
        if scale is not None and widths[i + 1] == widths[1]:
            y = b.add("Mul", {}, [y, scale], name=f"scale{i}")
        if prev is not None and i % 2 == 1 and widths[i + 1] == widths[i - 1]:
            y = b.add("Add", {}, [y, prev], name=f"skip{i}")
        prev, x = x, y
    b.set_outputs([x])
    return b.finish()


def _roles(g):
    return GraphCost(g, CostModel(machine(1, 4))).role


def _check_layers(g, layers, info, cuts):
    U = len(info.units)
    assert layers[0][0] == 0 and layers[-1][1] == U
    assert all(a < b for a, b in layers) and all(x[1] == y[0] for x, y in zip(layers, layers[1:]))
    ok = set(allowed_cuts(info, cuts))
    assert all(a in ok for a, _ in layers[1:])            # every boundary an allowed (so valid) cut
    assert len(layers) <= len(ok) + 1                     # at most one layer per allowed cut
    # no trained weight is read in two layers
    layer_of = {n: x for x, (a, b) in enumerate(layers) for u in range(a, b) for n in info.units[u]}
    for w in g.sources("Weight"):
        if g.is_trainable(w.id):
            readers = {layer_of[c] for c, _ in g.consumers((w.id, 0)) if c in layer_of}
            assert len(readers) <= 1, g.node(w.id).name


@pytest.mark.parametrize("widths,L,delta", [
    ([64, 64, 64, 64, 64, 64, 64], 3, 0.5),
    ([32, 256, 32, 256, 32, 128, 32], 2, 0.5),
    ([64, 128, 64, 128, 64], 4, 1.0),
])
def test_alpa_clustering_minimizes_the_largest_layer_input_under_the_flop_bound(widths, L, delta):
    g = _skip_chain(8, widths)
    roles = _roles(g)
    layers, info = cluster(g, roles, L, cuts="valid", inputs=True, delta=delta)
    _check_layers(g, layers, info, "valid")
    C = layer_inputs(g, info)
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
    assert len(layers) == L
    assert all(sum(fl[a:b]) <= bound * (1 + 1e-9) for a, b in layers)
    assert score([a for a, _ in layers] + [U]) == pytest.approx(best)


@pytest.mark.parametrize("widths,L", [([64] * 9, 4), ([32, 256, 32, 256, 32, 128, 32], 3), ([64, 512, 64] * 3, 5),
                                      ([64] * 5, 12)])
def test_unity_clustering_cuts_at_the_fewest_crossings_near_the_flop_quantiles(widths, L):
    g = _skip_chain(8, widths)
    roles = _roles(g)
    layers, info = cluster(g, roles, L, cuts="fewest", inputs=False, delta=None, balance="cuts")
    _check_layers(g, layers, info, "fewest")
    cand = allowed_cuts(info, "fewest")
    assert all(len(info.crossing[c]) == min(len(info.crossing[x]) for x in range(1, len(info.units))
                                             if info.valid[x]) for c in cand)
    pre = np.concatenate([[0.0], np.cumsum(info.flops)])
    n = min(L, len(cand) + 1)
    assert len(layers) == n                     # every allowed cut used when there are fewer than L - 1
    target = pre[-1] / n

    def dev(cuts):                              # each boundary's distance from its FLOP quantile
        return sum((pre[c] - r * target) ** 2 for r, c in enumerate(cuts, 1))

    best = min(dev(c) for c in itertools.combinations(cand, n - 1))
    assert dev([a for a, _ in layers[1:]]) == pytest.approx(best)


def _plain_chain(batch, width, blocks):
    """``blocks`` x (Linear, Relu) of one width, no skips: every cut carries one tensor (the zoo's mlp)."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, width)})
    for i in range(blocks):
        w = b.add("Weight", {"name": f"w{i}", "shape": (width, width)})
        x = b.add("Relu", {}, [b.add("Linear", {}, [x, w], name=f"fc{i}")], name=f"relu{i}")
    b.set_outputs([x])
    return b.finish()


@pytest.mark.parametrize("blocks,L", [(16, 12), (10, 8), (9, 6), (12, 8), (7, 4), (16, 6)])
def test_unity_layers_group_into_balanced_stages_for_every_stage_count_dividing_them(blocks, L):
    """Where the blocks do not divide into L equal layers, equal-variance layerings differ in where the
    larger layers sit; Unity's stage DP groups runs of layers, so for every S dividing both L and the
    blocks, runs of L / S layers must hold blocks / S blocks each (the layering the paper-size mlp needs
    for its 4 equal stages over 12 layers of 16 blocks)."""
    g = _plain_chain(8, 64, blocks)
    layers, info = cluster(g, _roles(g), L, cuts="fewest", inputs=False, delta=None, balance="cuts")
    _check_layers(g, layers, info, "fewest")
    assert len(layers) == L
    linears = [sum(g.node(n).op == "Linear" for u in range(a, b) for n in info.units[u]) for a, b in layers]
    for S in range(2, L + 1):
        if L % S == 0 and blocks % S == 0:
            runs = [sum(linears[k:k + L // S]) for k in range(0, L, L // S)]
            assert runs == [blocks // S] * S, (S, linears)


@pytest.mark.parametrize("cuts", ["valid", "fewest"])
def test_clustering_never_refuses_when_a_weight_blocks_every_cut(cuts):
    g = _skip_chain(8, [64] * 7, shared_scale=True)       # the scale is read after every block
    roles = _roles(g)
    layers, info = cluster(g, roles, 8, cuts=cuts)
    _check_layers(g, layers, info, cuts)
    valid = sum(bool(v) for v in info.valid[1:])
    assert valid < 7 and len(layers) == len(allowed_cuts(info, cuts)) + 1
    assert any(not v for v in info.valid[1:])


def test_cluster_cost_counts_bytes_read_from_earlier_layers():
    g = _skip_chain(8, [64, 64, 64])
    roles = _roles(g)
    layers, info = cluster(g, roles, 2)
    C = layer_inputs(g, info)
    U = len(info.units)
    act = 8 * 64 * 4
    # a layer starting right after the first Relu reads that Relu's output (fc1 and nothing else)
    names = [g.node(info.units[u][-1]).name for u in range(U)]
    k = names.index("fc1")
    assert C[k, k] == act
    assert C[0, U - 1] == 0


def test_layer_inputs_of_some_rows_and_columns_are_those_of_the_whole_matrix():
    """The rows and columns a clustering reads (its allowed cuts) are those of the dense unit x unit matrix,
    without building it; the clustering over them is the one over the dense matrix's (same layers)."""
    from unity_pcg.search.stages import _cluster_dp, analyze, input_columns
    g = _skip_chain(8, [64, 128, 64, 128, 64, 64])
    info = analyze(g, _roles(g))
    C = layer_inputs(g, info)
    U = len(info.units)
    assert C.any()
    rows, cols = [0, 3, 3, U - 1, 1], [1, 2, U - 2, U - 1]
    assert np.array_equal(layer_inputs(g, info, rows, cols), C[np.ix_(rows, cols)])
    pos = [0] + allowed_cuts(info, "valid") + [U]
    pre = np.concatenate([[0.0], np.cumsum(np.array(info.flops, dtype=float))])[pos]
    cols_inc = input_columns(g, info, pos[:-1], [p - 1 for p in pos[1:]])
    dense = C[np.ix_(pos[:-1], np.array(pos[1:]) - 1)]

    class Dense:                    # the dense matrix's columns as increments, the form _cluster_dp reads
        def __getitem__(self, k):
            prev = dense[:, k - 1] if k else np.zeros(len(dense))
            return [(j, dense[j, k] - prev[j]) for j in range(len(dense)) if dense[j, k] != prev[j]]
    for L in (2, 3):
        assert _cluster_dp(cols_inc, pre, L, 1.5 * pre[-1] / L) == _cluster_dp(Dense(), pre, L, 1.5 * pre[-1] / L)
