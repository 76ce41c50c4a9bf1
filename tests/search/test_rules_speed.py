"""The rule machinery's fast paths reach what the plain ones reach (issue 7 points 1 and 10): the windowed
index and the multi-sink pruning find the same matches in the same order, the inlined topological sort is
Kahn's order, and a pipeline's data parallelism built segment by segment (pipeline._dp_by_segments) is the
PCG the whole-graph sequence builds, and replays on a fresh import."""
import json
import random

import pytest

from unity_pcg.pcg import Node, kahn_order, topo_sort
from unity_pcg.search import pipeline as P
from unity_pcg.search.cost import CostModel
from unity_pcg.search.substitution import RuleBook, RuleStep, data_parallel_steps, replay
from unity_pcg.substitutions import match as match_mod
from unity_pcg.substitutions.match import GraphIndex, iter_matches

from .graphs import mlp
from .test_pipeline import machine


@pytest.mark.parametrize("seed", range(6))
def test_topo_sort_is_kahns_smallest_ready_first_order(seed):
    rng = random.Random(seed)
    n = 60
    ids = list(range(n))
    rng.shuffle(ids)                          # ids not in topological order; dict order shuffled too
    nodes = {}
    for k, nid in enumerate(ids):
        ins = tuple((ids[rng.randrange(k)], 0) for _ in range(rng.randrange(min(k, 3) + 1))) if k else ()
        nodes[nid] = Node(nid, "Relu", (), ins + ins[:1])          # a repeated input too
    items = list(nodes.items())
    rng.shuffle(items)
    nodes = dict(items)
    want, stuck = kahn_order(nodes, lambda i: [r[0] for r in nodes[i].inputs if r[0] in nodes])
    assert stuck is None and topo_sort(nodes) == tuple(want)


def _reference_index(g, window):
    """The index as it was built before the fast path: every node, then filtered by the window."""
    idx = GraphIndex(g)
    if window is not None:
        w = set(window)
        idx.by_op = {op: [n for n in ids if n in w] for op, ids in idx.by_op.items()}
    return idx


@pytest.fixture(scope="module")
def dp_graphs():
    book = RuleBook(None, (2, 4))
    g = mlp(batch=8, h=16, layers=3)
    out = [g]
    for d in (2, 4):
        x, _ = data_parallel_steps(g, d, book, final_cancel=False)    # duplicate Partitions left to merge
        out.append(x)
    return book, out


def test_windowed_index_and_sink_pruning_find_the_same_matches(dp_graphs, monkeypatch):
    book, graphs = dp_graphs
    for g in graphs:
        ids = list(g.topo_order())
        windows = [None, ids[::2], ids[len(ids) // 2:]]
        for w in windows:
            for r in book.rules:
                got = [(m.rule.name, m.nodes, m.inputs, m.bindings) for m in iter_matches(r, g, GraphIndex(g, w), None, (2, 4))]
                monkeypatch.setattr(match_mod, "PRUNE_SINKS", False)
                want = [(m.rule.name, m.nodes, m.inputs, m.bindings)
                        for m in iter_matches(r, g, _reference_index(g, w), None, (2, 4))]
                monkeypatch.setattr(match_mod, "PRUNE_SINKS", True)
                assert got == want, r.name
    # the merging rules do match there (the test is not vacuous)
    assert any(iter_matches(book.by_name["partition_cse"], g, GraphIndex(g), None, (2,)) for g in graphs)


@pytest.fixture(scope="module")
def inception_tiny(tmp_path_factory):
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("inc") / "inception.onnx"
    zoo.export("inception_v3", str(p), size="tiny", batch=8)
    return str(p)


@pytest.mark.parametrize("stages", [[(0, 5, 0, 2), (5, 12, 2, 4)], [(0, 7, 0, 3), (7, 12, 3, 3)]])
def test_pipeline_dp_by_segments_is_the_whole_graph_sequences_pcg(inception_tiny, stages, monkeypatch):
    from unity_pcg.onnx_import import load_onnx

    def fresh():
        return load_onnx(inception_tiny, load_weights=False)
    m = machine(1, 6)
    g = fresh()
    res = P.evaluate_pipeline(g, CostModel(m, "sgd"), stages, 2)
    assert res.feasible and res.origin["dp_inside"]
    fast = P.by_rules(g, res, m)
    assert fast is not None
    assert P._dp_by_segments(g, res.origin["stage_nodes"], res.origin["degrees"], RuleBook()) is not None
    monkeypatch.setattr(P, "_dp_by_segments", lambda *a: None)      # the whole-graph sequence
    slow = P.by_rules(g, res, m)
    assert slow is not None
    assert fast.pcg.structural_hash() == slow.pcg.structural_hash()
    assert [s.devices for s in fast.stages] == [s.devices for s in slow.stages]
    assert sorted(map(str, fast.views.values())) == sorted(map(str, slow.views.values()))
    steps = [RuleStep.from_json(json.loads(json.dumps(s.to_json()))) for s in fast.rules]
    assert replay(fresh(), steps, trim_outputs=True).structural_hash() == fast.pcg.structural_hash()


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_edges_priced_once_per_node_renumbering_give_the_same_mapping(degree, monkeypatch):
    """search/mapping.py prices an edge once per renumbering of the nodes its two views touch: on a
    machine of several nodes the DP's optimum and its views are those of the plain per-view pricing."""
    from unity_pcg.search import mapping as MP
    from unity_pcg.search.baselines import data_parallel
    m = machine(4, 2)
    g = mlp(batch=8, h=32, layers=3)
    pg = data_parallel(g, degree) if degree > 1 else g
    got = {}
    for flag in (False, True):
        monkeypatch.setattr(MP, "CANON_EDGES", flag)
        r = MP.MachineMapper(CostModel(m, "sgd")).optimize(pg)
        got[flag] = (r.cost, sorted((k, str(v)) for k, v in r.views.items()))
    assert got[True] == got[False]
