"""The PCG: structural hash, topological order, copy-on-write edits, checks, JSON, exports, and whole-graph
evaluation (logical vs piecewise) on hand-built data- and tensor-parallel graphs."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unity_pcg import ops
from unity_pcg.errors import GraphError, InvalidParallelization, UnityError
from unity_pcg.evaluate import evaluate
from unity_pcg.pcg import PCG, Node
from unity_pcg.shape import ParallelTensorShape

ROOT = Path(__file__).resolve().parents[2]


def _weights(seed=0, **shapes):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v) for k, v in shapes.items()}


def mlp(dp=2, tp=2, act="relu", batch=8, d=6, hidden=12, weights_first=False):
    """Data parallel over the batch (dp) x Megatron tensor parallel (tp): column-parallel Linear,
    then row-parallel Linear giving partial sums, then Reduce."""
    b = PCG.builder(_weights(W1=(d, hidden), W2=(hidden, d)))
    if weights_first:
        w1 = b.add("Weight", {"name": "W1", "shape": (d, hidden), "dtype": "float64"})
        w2 = b.add("Weight", {"name": "W2", "shape": (hidden, d), "dtype": "float64"})
        x = b.add("Input", {"name": "x", "shape": (batch, d), "dtype": "float64"})
    else:
        x = b.add("Input", {"name": "x", "shape": (batch, d), "dtype": "float64"})
        w1 = b.add("Weight", {"name": "W1", "shape": (d, hidden), "dtype": "float64"})
        w2 = b.add("Weight", {"name": "W2", "shape": (hidden, d), "dtype": "float64"})
    if dp > 1:
        x = b.add("Partition", {"dim": 0, "degree": dp}, [x])
    if tp > 1:
        x = b.add("Replicate", {"degree": tp}, [x])
        w1 = b.add("Partition", {"dim": 1, "degree": tp}, [w1])
        w2 = b.add("Partition", {"dim": 0, "degree": tp}, [w2])
    if dp > 1:
        w1 = b.add("Replicate", {"degree": dp}, [w1])
        w2 = b.add("Replicate", {"degree": dp}, [w2])
    h = b.add("Linear", {"activation": act}, [x, w1], name="fc1")
    y = b.add("Linear", {}, [h, w2], name="fc2")
    if tp > 1:
        y = b.add("Reduce", {"degree": tp}, [y])
    if dp > 1:
        y = b.add("Combine", {"dim": 0, "degree": dp}, [y])
    b.set_outputs([y])
    return b.finish()


def attention(dp=2, tp=2, B=4, T=4, H=2, dh=3):
    """Self-attention: batch split dp ways, heads split tp ways (column-parallel Q/K/V, row-parallel
    output projection), softmax over keys, partial sums reduced at the end."""
    D = H * dh
    w = _weights(1, Wq=(D, D), Wk=(D, D), Wv=(D, D), Wo=(D, D))
    b = PCG.builder(w)
    x = b.add("Input", {"name": "x", "shape": (B, T, D), "dtype": "float64"})
    if dp > 1:
        x = b.add("Partition", {"dim": 0, "degree": dp}, [x])
    residual = x
    if tp > 1:
        x = b.add("Replicate", {"degree": tp}, [x])

    def weight(name, dim):
        r = b.add("Weight", {"name": name, "shape": (D, D), "dtype": "float64"})
        if tp > 1:
            r = b.add("Partition", {"dim": dim, "degree": tp}, [r])
        if dp > 1:
            r = b.add("Replicate", {"degree": dp}, [r])
        return r

    def heads(r):   # [B, T, D] -> [B, H, T, dh]
        r = b.add("Reshape", {"shape": (B, T, H, dh)}, [r])
        return b.add("Transpose", {"perm": (0, 2, 1, 3)}, [r])

    q = heads(b.add("Linear", {}, [x, weight("Wq", 1)], name="q"))
    k = heads(b.add("Linear", {}, [x, weight("Wk", 1)], name="k"))
    v = heads(b.add("Linear", {}, [x, weight("Wv", 1)], name="v"))
    kt = b.add("Transpose", {"perm": (0, 1, 3, 2)}, [k])
    s = b.add("Scale", {"factor": 1 / np.sqrt(dh)}, [b.add("BatchMatMul", {}, [q, kt])])
    p = b.add("Softmax", {"axis": -1}, [s])
    o = b.add("BatchMatMul", {}, [p, v])
    o = b.add("Reshape", {"shape": (B, T, D)}, [b.add("Transpose", {"perm": (0, 2, 1, 3)}, [o])])
    y = b.add("Linear", {}, [o, weight("Wo", 0)], name="out")
    if tp > 1:
        y = b.add("Reduce", {"degree": tp}, [y])
    y = b.add("LayerNorm", {"axis": -1}, [b.add("Add", {}, [y, residual])])
    b.set_outputs([y])
    return b.finish()


def chain():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 4), "dtype": "float64"})
    p = b.add("Partition", {"dim": 0, "degree": 2}, [x])
    r = b.add("Relu", {}, [p])
    t = b.add("Tanh", {}, [r])
    c = b.add("Clip", {}, [t])   # default bounds are +-inf: exercises JSON of infinities
    b.set_outputs([c])
    return b.finish()


# --- evaluation ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3), (2, 6)])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_mlp_logical_and_pieces_agree(dp, tp, act):
    g = mlp(dp, tp, act)
    g.check()
    x = np.random.default_rng(5).standard_normal((8, 6))
    (lo,) = evaluate(g, {"x": x})
    (pi,) = evaluate(g, {"x": x}, mode="pieces")
    w = g.weights
    h = x @ w["W1"]
    h = np.maximum(h, 0) if act == "relu" else ops.run_logical("Gelu", {}, [h])[0]
    np.testing.assert_allclose(lo, h @ w["W2"], rtol=1e-12)
    np.testing.assert_allclose(pi, lo, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 2), (4, 2), (1, 2)])
def test_attention_logical_and_pieces_agree(dp, tp):
    g = attention(dp, tp)
    g.check()
    x = np.random.default_rng(6).standard_normal((4, 4, 6))
    (lo,) = evaluate(g, {"x": x})
    (pi,) = evaluate(g, {"x": x}, mode="pieces")
    np.testing.assert_allclose(pi, lo, rtol=1e-10, atol=1e-12)
    (ref,) = evaluate(attention(1, 1), {"x": x})
    np.testing.assert_allclose(lo, ref, rtol=1e-12)
    # the tensor-parallel Linear really produced partial sums and ran on dp * tp devices
    out = [n for n in g.nodes() if n.name == "out"][0]
    assert g.shapes(out.id)[0].sum_degree == tp
    assert max(s.piece_count for n in g.nodes() for s in g.shapes(n.id)) == dp * tp


def test_evaluate_keep_returns_every_tensor_and_pieces_have_grid_shape():
    g = mlp(2, 2)
    x = np.ones((8, 6))
    vals = evaluate(g, {"x": x}, mode="pieces", keep=True)
    assert set(vals) == {(n.id, 0) for n in g.nodes()}
    for (nid, k), v in vals.items():
        s = g.shapes(nid)[k]
        assert v.shape == s.grid + s.piece_shape


def test_evaluate_errors_are_typed():
    g = mlp(2, 2)
    with pytest.raises(GraphError, match="no value fed for input 'x'"):
        evaluate(g, {})
    with pytest.raises(GraphError, match="expected \\[8, 6\\]"):
        evaluate(g, {"x": np.ones((8, 5))})
    with pytest.raises(ValueError):
        evaluate(g, {"x": np.ones((8, 6))}, mode="bogus")
    h = PCG(dict((n.id, n) for n in g.nodes()), {n.id: g.shapes(n.id) for n in g.nodes()}, g.outputs, {})
    with pytest.raises(GraphError, match="no value for weight 'W1'"):
        evaluate(h, {"x": np.ones((8, 6))})
    # weights may be zero-argument callables (lazy loading)
    lazy = PCG(dict((n.id, n) for n in g.nodes()), {n.id: g.shapes(n.id) for n in g.nodes()}, g.outputs,
               {k: (lambda v=v: v) for k, v in g.weights.items()})
    np.testing.assert_allclose(evaluate(lazy, {"x": np.ones((8, 6))})[0], evaluate(g, {"x": np.ones((8, 6))})[0])


# --- hashing -----------------------------------------------------------------------------------------------

def test_structural_hash_is_stable_across_processes():
    code = ("import sys; sys.path.insert(0, %r); from tests.unity_pcg.test_pcg import mlp, attention; "
            "print(mlp().structural_hash(), attention().structural_hash())" % str(ROOT))
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip())
    assert outs == {f"{mlp().structural_hash()} {attention().structural_hash()}"}


def _shift_ids(g: PCG, offset: int, reverse_ties=False) -> PCG:
    obj = g.to_json()
    for n in obj["nodes"]:
        n["id"] += offset
        n["inputs"] = [[r[0] + offset, r[1]] for r in n["inputs"]]
    obj["outputs"] = [[r[0] + offset, r[1]] for r in obj["outputs"]]
    return PCG.from_json(obj, g.weights)


def test_structural_hash_is_independent_of_node_ids():
    g = mlp()
    h = mlp(weights_first=True)
    assert [n.id for n in g.nodes() if n.op == "Input"] != [n.id for n in h.nodes() if n.op == "Input"]
    assert g.structural_hash() == h.structural_hash()
    s = _shift_ids(g, 1000)
    assert min(s.node_ids()) == 1000 and s.structural_hash() == g.structural_hash()
    # per-node hashes too
    assert sorted(g.node_hash(i) for i in g.node_ids()) == sorted(s.node_hash(i) for i in s.node_ids())


def test_structural_hash_changes_with_attributes_degrees_and_wiring():
    base = mlp()
    hashes = {base.structural_hash(), mlp(act="gelu").structural_hash(), mlp(dp=4).structural_hash(),
              mlp(tp=3).structural_hash(), mlp(dp=1).structural_hash(), mlp(hidden=24).structural_hash()}
    assert len(hashes) == 6
    assert mlp().structural_hash() == base.structural_hash()
    # swapping the operands of a non-commutative op changes the hash
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4,)})
    y = b.add("Input", {"name": "y", "shape": (4,)})
    b.set_outputs([b.add("Sub", {}, [x, y])])
    b2 = PCG.builder()
    x2 = b2.add("Input", {"name": "x", "shape": (4,)})
    y2 = b2.add("Input", {"name": "y", "shape": (4,)})
    b2.set_outputs([b2.add("Sub", {}, [y2, x2])])
    assert b.finish().structural_hash() != b2.finish().structural_hash()


# --- order, checks, edits -------------------------------------------------------------------------------------

def test_topo_order_puts_inputs_first_and_is_deterministic():
    g = attention()
    order = g.topo_order()
    pos = {nid: i for i, nid in enumerate(order)}
    assert sorted(order) == sorted(g.node_ids())
    for n in g.nodes():
        for r in n.inputs:
            assert pos[r[0]] < pos[n.id]
    assert attention().topo_order() == order
    assert [n.id for n in g.nodes()] == list(order)


def test_copy_on_write_edit_leaves_the_original_untouched_and_reinfers_downstream():
    g = chain()
    before = (g.structural_hash(), {i: g.shapes(i) for i in g.node_ids()}, g.to_json())
    part = [n for n in g.nodes() if n.op == "Partition"][0]
    e = g.edit()
    x = part.inputs[0]
    p4 = e.add("Partition", {"dim": 0, "degree": 4}, [x])
    e.replace_uses((part.id, 0), p4)
    e.remove_dead()
    h = e.finish()
    h.check()
    assert (g.structural_hash(), {i: g.shapes(i) for i in g.node_ids()}, g.to_json()) == before
    g.check()
    assert part.id not in h and part.id in g
    for n in h.nodes():
        if n.op in ("Relu", "Tanh", "Clip"):
            assert h.shapes(n.id)[0].degrees == (4, 1)
            assert g.shapes(n.id)[0].degrees == (2, 1)
    assert h.structural_hash() != g.structural_hash()
    # unchanged nodes are shared, not copied
    assert h.node(x[0]) is g.node(x[0])
    x_val = np.random.default_rng(0).standard_normal((8, 4))
    np.testing.assert_allclose(evaluate(h, {"x": x_val}, mode="pieces")[0], np.tanh(np.maximum(x_val, 0)))


def test_edit_that_breaks_a_downstream_node_is_refused():
    g = mlp(2, 2)
    e = g.edit()
    part = [n for n in g.nodes() if n.op == "Partition" and n.a["dim"] == 0 and
            g.node(n.inputs[0][0]).op == "Input"][0]
    p4 = e.add("Partition", {"dim": 0, "degree": 4}, [part.inputs[0]])
    e.replace_uses((part.id, 0), p4)   # the weights are replicated only 2 ways: fc1 cannot run 4 ways
    with pytest.raises(InvalidParallelization, match="fc1"):
        e.finish()


def test_cycles_are_graph_errors():
    g = chain()
    order = g.topo_order()
    e = g.edit()
    e.set_inputs(order[1], [(order[-1], 0)])   # Partition now reads the Clip at the end
    with pytest.raises(GraphError, match="cycle"):
        e.finish()
    nodes = {n.id: n for n in g.nodes()}
    n1 = nodes[order[1]]
    nodes[order[1]] = Node(n1.id, n1.op, n1.attrs, ((order[-1], 0),), n1.name)
    bad = PCG(nodes, {i: g.shapes(i) for i in g.node_ids()}, g.outputs)
    with pytest.raises(GraphError, match="cycle"):
        bad.check()
    with pytest.raises(GraphError, match="cycle"):
        bad.topo_order()


def test_removing_a_used_node_is_a_graph_error():
    g = chain()
    relu = [n for n in g.nodes() if n.op == "Relu"][0]
    e = g.edit()
    e.remove(relu.id)
    with pytest.raises(GraphError, match="missing tensor"):
        e.finish()
    with pytest.raises(GraphError, match="no such node"):
        g.edit().remove(12345)


def test_check_finds_stale_shapes_and_dangling_edges():
    g = chain()
    shapes = {i: g.shapes(i) for i in g.node_ids()}
    relu = [n for n in g.nodes() if n.op == "Relu"][0]
    shapes[relu.id] = (ParallelTensorShape.of([8, 4], dtype="float64"),)
    with pytest.raises(GraphError, match="stale"):
        PCG({n.id: n for n in g.nodes()}, shapes, g.outputs).check()
    with pytest.raises(GraphError, match="output"):
        PCG({n.id: n for n in g.nodes()}, {i: g.shapes(i) for i in g.node_ids()}, [(relu.id, 3)]).check()
    b = PCG.builder()
    with pytest.raises(GraphError, match="does not exist"):
        b.add("Relu", {}, [(7, 0)])


def test_builder_refuses_bad_nodes_with_typed_errors():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 6)})
    with pytest.raises(InvalidParallelization, match="unknown attribute"):
        b.add("Relu", {"bogus": 1}, [x])
    with pytest.raises(InvalidParallelization, match="missing required attribute"):
        b.add("Partition", {"dim": 0}, [x])
    with pytest.raises(InvalidParallelization, match="my_softmax"):
        b.add("Softmax", {"axis": 0}, [b.add("Partition", {"dim": 0, "degree": 2}, [x])], name="my_softmax")
    with pytest.raises(UnityError, match="unknown operator 'Frobnicate'"):
        b.add("Frobnicate", {}, [x])


# --- serialization and exports ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [mlp, attention, chain])
def test_json_round_trip(make):
    g = make()
    text = json.dumps(g.to_json())
    h = PCG.from_json(json.loads(text), g.weights)
    assert h.structural_hash() == g.structural_hash()
    assert {i: h.shapes(i) for i in h.node_ids()} == {i: g.shapes(i) for i in g.node_ids()}
    assert h.outputs == g.outputs and json.dumps(h.to_json()) == text
    h.check()


@pytest.mark.parametrize("bad", [{}, {"nodes": []}, {"nodes": [{"id": 0, "op": "Relu", "inputs": [[5, 0]]}],
                                                        "outputs": []},
                                 {"nodes": [{"id": "x"}], "outputs": []}, {"nodes": 3, "outputs": []}])
def test_malformed_json_is_a_graph_error(bad):
    with pytest.raises(GraphError):
        PCG.from_json(bad)


def test_networkx_export_counts():
    g = attention()
    nx_g = g.to_networkx()
    assert nx_g.number_of_nodes() == len(g)
    assert nx_g.number_of_edges() == sum(len(n.inputs) for n in g.nodes())
    for n in g.nodes():
        assert nx_g.nodes[n.id]["op"] == n.op
    import networkx as nx
    assert nx.is_directed_acyclic_graph(nx_g)


def _parse_dot(text: str):
    """A small parser for the DOT subset to_dot writes: digraph { attr stmts; node stmts; edge stmts }."""
    m = re.fullmatch(r"\s*digraph\s+(\w+)\s*\{(.*)\}\s*", text, re.S)
    assert m, "not a digraph"
    body = m.group(2)
    q = r'"(?:[^"\\]|\\.)*"'
    attr = rf'\w+\s*=\s*(?:{q}|[\w.]+)'
    attrs = rf'\[\s*(?:{attr}\s*,?\s*)*\]'
    stmt = re.compile(rf'\s*(?:(?P<gattr>(?:node|edge|graph)\s*{attrs})|(?P<edge>(?P<a>\w+)\s*->\s*(?P<b>\w+)\s*{attrs})|'
                      rf'(?P<node>(?P<n>\w+)\s*{attrs})|(?P<kv>{attr}))\s*;')
    nodes, edges, pos = set(), [], 0
    while body[pos:].strip():
        s = stmt.match(body, pos)
        assert s, f"cannot parse DOT near {body[pos:pos + 60]!r}"
        if s.group("edge"):
            edges.append((s.group("a"), s.group("b")))
        elif s.group("node"):
            nodes.add(s.group("n"))
        pos = s.end()
    return nodes, edges


def test_to_dot_parses():
    b = PCG.builder()
    x = b.add("Input", {"name": 'we"ird\\name', "shape": (4,)})
    b.set_outputs([b.add("Relu", {}, [x], name='quote " and backslash \\')])
    for g in (attention(), b.finish()):
        nodes, edges = _parse_dot(g.to_dot())
        assert nodes == {f"n{i}" for i in g.node_ids()}
        assert len(edges) == sum(len(n.inputs) for n in g.nodes())
        assert all(a in nodes and c in nodes for a, c in edges)
    try:
        import pydot
    except ImportError:
        return
    (parsed,) = pydot.graph_from_dot_data(attention().to_dot())
    assert len(parsed.get_edges()) == sum(len(n.inputs) for n in attention().nodes())


def test_render_png(tmp_path):
    g = mlp()
    if shutil.which("dot") is None:
        with pytest.raises(GraphError, match="graphviz"):
            g.render(str(tmp_path / "g.png"))
        pytest.skip("graphviz 'dot' is not installed: PNG rendering not checked")
    out = g.render(str(tmp_path / "g.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_flops_and_params():
    g = mlp(2, 2)
    s = g.summary()
    assert s["params"] == 6 * 12 * 2 and s["inputs"] == 1 and s["weights"] == 2
    assert s["op_types"]["Linear"] == 2 and s["ops"] == sum(s["op_types"].values())
    assert s["flops"] >= 2 * 8 * 6 * 12 * 2
    assert mlp(1, 1).flops() <= s["flops"] <= mlp(1, 1).flops() + 8 * 12 * 4   # parallel ops add no FLOPs


@given(st.lists(st.sampled_from(["Relu", "Tanh", "Neg", "Sigmoid"]), min_size=1, max_size=6),
       st.sampled_from([1, 2, 4]))
def test_random_chains_hash_and_evaluate_consistently(ops_list, deg):
    def build(offset):
        b = PCG.builder()
        for k in range(offset):   # unused nodes shift the ids; removed before finishing
            b.add("Input", {"name": f"pad{k}", "shape": (1,)})
        x = b.add("Input", {"name": "x", "shape": (8, 2), "dtype": "float64"})
        if deg > 1:
            x = b.add("Partition", {"dim": 0, "degree": deg}, [x])
        for o in ops_list:
            x = b.add(o, {}, [x])
        b.set_outputs([x])
        b.remove_dead()
        return b.finish()
    g, h = build(0), build(3)
    assert g.structural_hash() == h.structural_hash()
    v = np.random.default_rng(0).standard_normal((8, 2))
    np.testing.assert_allclose(evaluate(g, {"x": v}, mode="pieces")[0], evaluate(h, {"x": v})[0])


def test_builder_reused_after_finish_keeps_hashes_fresh():
    g = chain()
    g.structural_hash()   # fills g's hash cache, which edit() hands to the builder
    part = [n for n in g.nodes() if n.op == "Partition"][0]
    e = g.edit()
    e.replace_uses((part.id, 0), e.add("Partition", {"dim": 0, "degree": 4}, [part.inputs[0]]))
    e.remove_dead()
    h1 = e.finish()
    h2 = e.finish()
    fresh = PCG.from_json(h1.to_json())
    assert h1.structural_hash() == h2.structural_hash() == fresh.structural_hash() != g.structural_hash()


def test_json_with_duplicate_node_ids_is_refused():
    obj = chain().to_json()
    obj["nodes"][1]["id"] = obj["nodes"][0]["id"]
    with pytest.raises(GraphError, match="duplicate node id"):
        PCG.from_json(obj)


def test_finish_reinfers_only_downstream_of_the_edit(monkeypatch):
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 4), "dtype": "float64"})
    refs = [x]
    for k in range(200):
        refs.append(b.add("Tanh" if k % 2 else "Relu", {}, [refs[-1]]))
    b.set_outputs([refs[-1]])
    g = b.finish()
    calls = []
    real = ops.infer
    monkeypatch.setattr("unity_pcg.pcg.ops.infer", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    e = g.edit()
    p = e.add("Partition", {"dim": 0, "degree": 2}, [refs[-4]])   # partition the last 3 ops' input
    e.replace_uses(refs[-4], p, exclude=[p[0]])
    h = e.finish()
    assert calls.count("Partition") == 1 and len(calls) == 1 + 3   # the new node, then 3 downstream ops
    assert h.shape(refs[-1]).degrees == (2, 1) and h.shape(refs[-5]).degrees == (1, 1)
    assert g.shape(refs[-1]).degrees == (1, 1)
    v = np.random.default_rng(0).standard_normal((8, 4))
    np.testing.assert_allclose(evaluate(h, {"x": v}, mode="pieces")[0], evaluate(g, {"x": v})[0])


def test_param_count_counts_only_float_weights():
    b = PCG.builder()
    idx = b.add("Weight", {"name": "idx", "shape": (4,), "dtype": "int64"})
    tab = b.add("Weight", {"name": "table", "shape": (10, 3)})
    b.set_outputs([b.add("Embedding", {}, [idx, tab])])
    assert b.finish().param_count() == 30


def test_batchnorm_running_statistics_are_not_parameters():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (2, 3, 4, 4)})
    ps = [b.add("Weight", {"name": k, "shape": (3,)}) for k in ("scale", "bias", "mean", "var")]
    b.set_outputs([b.add("BatchNorm", {}, [x] + ps)])
    g = b.finish()
    assert g.param_count() == 6
    assert [g.is_trainable(r[0]) for r in ps] == [True, True, False, False]


# --- roles (PCG.roles: the one classifier of sources, placements, activation movement and compute) ----------

def _naive_roles(g: PCG) -> dict:
    """The definition, walked node by node: a parallel operator is a placement when following its inputs
    through parallel operators only ends at a source."""
    out = {}
    for n in g.nodes():
        m = n
        while m.kind == "parallel":
            m = g.node(m.inputs[0][0])
        if n.kind == "source":
            out[n.id] = n.op.lower()
        elif n.kind == "compute":
            out[n.id] = "compute"
        elif m.kind == "source":
            out[n.id] = m.op.lower() + "-placement"
        else:
            out[n.id] = "parallel"
    return out


def _roles_graph():
    """x -> Partition -> Replicate; W1 -> Partition; W2 -> Transpose (weight-like); a generator -> Partition."""
    b = PCG.builder(_weights(W1=(6, 4), W2=(6, 4)))
    x = b.add("Input", {"name": "x", "shape": (8, 6), "dtype": "float64"}, name="x")
    w1 = b.add("Weight", {"name": "W1", "shape": (6, 4), "dtype": "float64"}, name="W1")
    w2 = b.add("Weight", {"name": "W2", "shape": (6, 4), "dtype": "float64"}, name="W2")
    xp = b.add("Partition", {"dim": 0, "degree": 2}, [x], name="x_shard")
    xr = b.add("Replicate", {"degree": 2}, [xp], name="x_copy")
    w1p = b.add("Partition", {"dim": 1, "degree": 2}, [w1], name="W1_cols")
    w1r = b.add("Replicate", {"degree": 2}, [w1p], name="W1_copy")
    w2t = b.add("Transpose", {"perm": (1, 0)}, [w2], name="W2_t")
    h = b.add("Linear", {}, [xr, w1r], name="fc1")
    hr = b.add("Combine", {"dim": 1, "degree": 2}, [h], name="h_gather")
    noise = b.add("RandomNormal", {"shape": (8, 4), "dtype": "float64"}, name="noise")
    noise_p = b.add("Partition", {"dim": 0, "degree": 2}, [noise], name="noise_shard")
    hn = b.add("Add", {}, [hr, noise_p], name="add")
    y = b.add("Linear", {}, [b.add("Combine", {"dim": 0, "degree": 2}, [hn], name="y_in"), w2t], name="fc2")
    b.set_outputs([y])
    return b.finish()


def test_roles_classify_sources_placements_and_activation_movement():
    g = _roles_graph()
    nid = {n.name: n.id for n in g.nodes()}
    role = {name: g.roles()[i] for name, i in nid.items()}
    assert role == {"x": "input", "W1": "weight", "W2": "weight", "x_shard": "input-placement",
                    "x_copy": "input-placement", "W1_cols": "weight-placement", "W1_copy": "weight-placement",
                    "W2_t": "compute", "fc1": "compute", "h_gather": "parallel", "noise": "compute",
                    "noise_shard": "parallel", "add": "compute", "y_in": "parallel", "fc2": "compute"}
    # origins: the start of each chain of parallel operators
    assert g.origin(nid["W1_copy"]) == nid["W1"] and g.origin(nid["x_copy"]) == nid["x"]
    assert g.origin(nid["noise_shard"]) == nid["noise"] and g.origin(nid["h_gather"]) == nid["fc1"]
    assert g.origin(nid["fc1"]) == nid["fc1"]
    # weight-like: Weights and compute operators reading only weight-like nodes
    assert g.weight_like() == {nid["W1"], nid["W2"], nid["W2_t"]}


@pytest.mark.parametrize("make", [lambda: mlp(2, 2), lambda: mlp(1, 2), lambda: attention(2, 2), chain,
                                  _roles_graph])
def test_roles_match_the_definition(make):
    g = make()
    assert dict(g.roles()) == _naive_roles(g)
    assert set(g.roles()) == set(g.node_ids())


def test_roles_are_cached_read_only_and_edits_get_their_own():
    g = mlp(1, 1)
    assert g._classified() is g._classified()          # computed once per graph
    with pytest.raises(TypeError):
        g.roles()[0] = "compute"
    before = dict(g.roles())
    x = next(n.id for n in g.nodes() if n.op == "Input")
    b = g.edit()
    p = b.add("Partition", {"dim": 0, "degree": 2}, [(x, 0)])
    c = b.add("Combine", {"dim": 0, "degree": 2}, [p])
    b.replace_uses((x, 0), c, exclude=[p[0]])
    g2 = b.finish()
    assert dict(g.roles()) == before                    # the original keeps its roles
    assert g2.roles()[p[0]] == g2.roles()[c[0]] == "input-placement"
    assert dict(g2.roles()) == _naive_roles(g2)


def test_the_models_and_the_lowering_read_the_roles():
    """GraphCost's roles are the PCG's; the lowering refines them only for random generators."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.search.cost import CostModel, GraphCost
    g = _roles_graph()
    assert dict(GraphCost(g, CostModel(parse_machine("summit:1x4"))).role) == dict(g.roles())
    pytest.importorskip("torch")
    from unity_pcg.executor.lower import Lowered
    low = Lowered.__new__(Lowered)                     # only the classification step of the lowering
    low.g, low.role, low.origin, low.pm = g, {}, {}, {}
    low._classify()
    nid = {n.name: n.id for n in g.nodes()}
    want = {**g.roles(), nid["noise"]: "generator", nid["noise_shard"]: "generator-placement"}
    assert low.role == want
    assert low.origin[nid["noise_shard"]] == nid["noise"] and nid["fc1"] not in low.origin
