"""Graph splitting (Unity 5.3): sequential segments, canonical memo, stitching equals replay."""
import pytest

from unity_pcg.search.optimize import Evaluator, _segment_search
from unity_pcg.search.split import (assemble, assemble_by_replay, blocking_pairs, canonicalize, segments, synthetic_chain,
                          synthetic_transformer)
from unity_pcg.search.substitution import RuleBook, replay
from unity_pcg.machine import parse_machine


@pytest.fixture(scope="module")
def book():
    return RuleBook(None, (2,))


def _crossing(g, order, i):
    """Activation tensors produced at positions <= i and read after i."""
    pos = {n: k for k, n in enumerate(order)}
    out = set()
    for n in order[i + 1:]:
        for r in g.node(n).inputs:
            if g.node(r[0]).kind != "source" and pos[r[0]] <= i:
                out.add(tuple(r))
    return out


@pytest.mark.parametrize("g", [synthetic_chain(60), synthetic_transformer(4)], ids=["chain", "transformer"])
def test_segments_are_sequential_small_and_cut_at_one_tensor(book, g):
    pairs = blocking_pairs(book)
    segs = segments(g, 10, pairs)
    order = [n for n in g.topo_order() if g.node(n).kind != "source"]
    assert [n for s in segs for n in s.nodes] == order
    assert len(segs) > 3
    end = -1
    for s in segs[:-1]:
        end += len(s.nodes)
        cross = _crossing(g, order, end)
        assert len(cross) == 1
    for a, b in zip(segs, segs[1:]):
        assert b.crossing_in == next(iter(_crossing(g, order, order.index(a.nodes[-1]))))
    assert max(len(s.nodes) for s in segs) <= 16


def test_cuts_block_the_fewest_substitutions(book):
    pairs = blocking_pairs(book)
    assert pairs[("Linear", "Relu")] > 0              # linear_relu_fusion at least
    g = synthetic_chain(40)
    segs = segments(g, 10, pairs)
    cheaper = min((("Linear", "Relu"), ("Relu", "Linear")), key=lambda p: pairs.get(p, 0))
    for a in segs[:-1]:
        assert g.node(a.nodes[-1]).op == cheaper[0]


def test_repeated_layers_share_canonical_segments(book):
    g = synthetic_transformer(6)
    segs = segments(g, 10, blocking_pairs(book))
    for s in segs:
        canonicalize(g, s, {tuple(r) for n in g.node_ids() for r in g.node(n).inputs})
    keys = [s.key for s in segs]
    assert len(set(keys)) <= 4 < len(keys)


@pytest.mark.parametrize("layers", [1, 3])
def test_split_search_result_is_reachable_and_stitching_equals_replay(book, layers):
    g = synthetic_transformer(layers, batch=4, seq=16, hidden=32, heads=2)
    m = parse_machine("summit:1x2")
    ev = Evaluator(m, "adam")
    b2 = RuleBook(None, (2,))
    out, steps, dpg, dpst, stats, _ = _segment_search(g, b2, ev, 2, 6, 2, 1.05, None, float("inf"))
    assert stats["segments"] > 1 and out is not None
    assert replay(g, steps, b2).structural_hash() == out.structural_hash()
    assert replay(g, dpst, b2).structural_hash() == dpg.structural_hash()
    # data parallelism assembled from the segments' seeds is the dp baseline
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.substitution import normalized_hash, trimmed
    assert normalized_hash(trimmed(dpg)) == normalized_hash(data_parallel(g, 2))
    # the linear stitching and the step-by-step replay on the whole graph agree
    from unity_pcg.search.split import SegmentChoice, boundary_keys
    from unity_pcg.search.substitution import data_parallel_steps
    segs = segments(g, 6, blocking_pairs(b2))
    choices = []
    for i, s in enumerate(segs):
        after = {tuple(r) for t in segs[i + 1:] for n in t.nodes for r in g.node(n).inputs}
        canonicalize(g, s, after)
        x, st = data_parallel_steps(s.canon, 2, b2) if i % 3 != 2 else (s.canon, [])
        choices.append(SegmentChoice(0.0, 0.0, tuple(st), boundary_keys(s, x)))
    a, sa = assemble(g, segs, choices, b2)
    r, sr = assemble_by_replay(g, segs, choices, b2)
    assert a.structural_hash() == r.structural_hash()
    n_own = sum(len(c.steps) for c in choices)
    assert any(st.rule == "partition_combine_cancel" for st in sa[n_own:])     # a boundary was cancelled
    assert replay(g, sa, b2).structural_hash() == a.structural_hash()


def test_a_tensor_every_layer_reads_is_replicated_once_and_every_boundary_cancels(book):
    """Data parallelism by rules on a deep chain whose layers all read one shared weight (a bias, like a
    position table): each segment's dp steps Replicate it, so the stitched graph holds one Replicate per
    segment, all reading one tensor.  The boundary cancellations merge them (disjoint merges of readers of one
    tensor run in the same round) and cancel every Combine/Partition pair at the segment boundaries, on a chain
    deeper than the rounds' cap (one merge per round would leave most of them)."""
    from unity_pcg.pcg import PCG
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.split import SegmentChoice, boundary_keys, cancel_rounds
    from unity_pcg.search.substitution import data_parallel_steps, normalized_hash, trimmed
    layers = 150
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 16)})
    bias = b.add("Weight", {"name": "shared", "shape": (16,)})
    for i in range(layers):
        w = b.add("Weight", {"name": f"w{i}", "shape": (16, 16)})
        x = b.add("Add", {}, [b.add("Linear", {}, [x, w], name=f"fc{i}"), bias], name=f"add{i}")
    b.set_outputs([x])
    g = b.finish()
    segs = segments(g, 4, blocking_pairs(book))
    choices = []
    for i, s in enumerate(segs):
        canonicalize(g, s, {tuple(r) for t in segs[i + 1:] for n in t.nodes for r in g.node(n).inputs})
        xs, st = data_parallel_steps(s.canon, 2, book)
        choices.append(SegmentChoice(0.0, 0.0, tuple(st), boundary_keys(s, xs)))
    assert len(segs) > 64
    rounds = []
    real = cancel_rounds.__globals__["apply_disjoint"]

    def counting(gr, matches):
        rounds.append(len(matches))
        return real(gr, matches)
    cancel_rounds.__globals__["apply_disjoint"] = counting
    try:
        a, steps = assemble(g, segs, choices, book)
    finally:
        cancel_rounds.__globals__["apply_disjoint"] = real
    readers = [c for c, _ in a.consumers(tuple(bias))]
    assert len(readers) == 1 and a.node(readers[0]).op == "Replicate"
    assert not any(a.node(n).op == "Partition" and a.node(a.node(n).inputs[0][0]).op == "Combine"
                   for n in a.node_ids())
    assert len(rounds) < 20
    assert normalized_hash(trimmed(a)) == normalized_hash(data_parallel(g, 2))
    assert replay(g, steps, book).structural_hash() == a.structural_hash()


def test_data_parallelism_by_rules_per_distinct_segment_is_the_whole_graph_build(book):
    """The sequential search builds data parallelism by rules per distinct segment and assembles it (as the
    segment search builds its floor): the graph of the whole-graph build, its steps replayable on the model."""
    from unity_pcg.search.optimize import _dp_steps_by_segments
    from unity_pcg.search.substitution import data_parallel_steps, normalized_hash, trimmed
    b4 = RuleBook(None, (2, 4))
    g = synthetic_transformer(6)
    a, steps = _dp_steps_by_segments(g, 4, b4, 10)
    whole, _ = data_parallel_steps(g, 4, b4)
    assert steps and normalized_hash(trimmed(a)) == normalized_hash(trimmed(whole))
    assert replay(g, steps, b4).structural_hash() == a.structural_hash()
