"""Single-operator tensor parallelism on a tiny Llama decoder (issue 18): every rule of
``templates.tensor_parallel_rules`` that speaks about an operator of the decoder matches its exported graph (the zoo's
``llama_1b`` at size tiny: RMSNorm, SwiGLU, rotary embeddings, grouped-query attention) and applies, and the rewritten
graph evaluates piecewise to the imported one's outputs.  The rules come from the shipped cache (so they are proven);
the heads split of Megatron-LM is walked operator by operator through the rotary and grouped-query views."""
import numpy as np
import pytest

from unity_pcg.evaluate import evaluate
from unity_pcg.pcg import PCG
from unity_pcg.substitutions import cache, find_matches, try_apply
from unity_pcg.substitutions.templates import tensor_parallel_rules

torch = pytest.importorskip("torch")

RULES = cache.load().by_name()
NEW = [r.name for r in tensor_parallel_rules()]

# the split rules with a valid application on the decoder (an ``_rp`` variant has none: the decoder's broadcast
# operands, the rotary tables and the mask, are second operands; Relu's is fig11a_relu_spatial)
LLAMA_SPLITS = ("split_Neg", "split_Silu", "split_Scale", "split_Mul", "split_Mul_pr", "split_Add", "split_Add_pr",
                "split_Slice", "split_Expand", "split_RMSNorm_scale")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    p = tmp_path_factory.mktemp("llama") / "llama.onnx"
    zoo.export("llama_1b", str(p), size="tiny")
    g = load_onnx(str(p), batch=2)
    ids = np.random.default_rng(0).integers(0, 64, size=(2, 16)).astype(np.int64)
    feeds = {g.sources("Input")[0].a["name"]: ids}
    return g, feeds, evaluate(g, feeds, "logical")


def _close(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-4, atol=1e-5)


def _applications(g: PCG, name: str, nodes=None):
    """(match, rewritten graph) for every valid application of rule ``name`` (at degree 2), optionally only
    where its matched nodes include one of ``nodes``."""
    out = []
    for m in find_matches(RULES[name], g, degrees=(2,)):
        if nodes is not None and not set(m.nodes) & set(nodes):
            continue
        g2 = try_apply(g, m)
        if g2 is not None:
            out.append((m, g2))
    return out


def _apply(g: PCG, name: str, nodes=None, **binding) -> PCG:
    """``g`` with rule ``name`` applied at its first valid match on ``nodes`` whose binding has ``binding``."""
    for m, g2 in _applications(g, name, nodes):
        if all(m.binding.get(k) == v for k, v in binding.items()):
            return g2
    raise AssertionError(f"{name} does not apply on {nodes} with {binding}")


def _cancel(g: PCG) -> PCG:
    """Partition(Combine(x)) -> x and duplicate Partitions/Replicates merged, until none is left."""
    while True:
        for name in ("partition_combine_cancel", "partition_cse", "replicate_cse"):
            apps = _applications(g, name)
            if apps:
                g = apps[0][1]
                break
        else:
            return g


def _new_ids(g: PCG, g2: PCG) -> list[int]:
    return sorted(set(g2.node_ids()) - set(g.node_ids()))


def _first(g: PCG, op: str, after=None, pred=lambda n: True) -> int:
    """The first node (topological order) of ``op`` satisfying ``pred``, reading ``after``'s output if given."""
    for nid in g.topo_order():
        n = g.node(nid)
        if n.op == op and pred(n) and (after is None or any(r[0] == after for r in n.inputs)):
            return nid
    raise AssertionError(f"no {op} after {after}")


def test_every_new_rule_is_shipped_and_proven():
    missing = [n for n in NEW if n not in RULES]
    assert not missing, missing
    assert all(dict(RULES[n].proof).get("status") == "proven" for n in NEW)


@pytest.mark.parametrize("name", LLAMA_SPLITS)
def test_split_rule_applies_on_a_non_batch_dim_of_the_decoder(llama, name):
    g, feeds, want = llama
    apps = _applications(g, name)
    assert apps, f"{name} has no valid application on the decoder"
    # on some dim other than the batch (the heads, the sequence, the features)
    off_batch = [(m, g2) for m, g2 in apps if m.binding["d"] > -g.shape(m.input_map["x"]).rank]
    assert off_batch, name
    m, g2 = off_batch[0]
    _close(want, evaluate(g2, feeds, "pieces"))


def _q_heads(g: PCG) -> tuple[int, int, int]:
    """The first layer's query projection, its Reshape to (b, s, heads, d) and the Transpose 0213 after it."""
    lin = _first(g, "Linear", pred=lambda n: True)
    while True:
        cons = [c for c, _ in g.consumers((lin, 0))]
        if len(cons) == 1 and g.node(cons[0]).op == "Reshape" and g.shape((cons[0], 0)).sizes[-2] == 4:
            break
        lin = _first(g, "Linear", pred=lambda n, after=lin: n.id > after)
    rs = cons[0]
    return lin, rs, _first(g, "Transpose", rs)


def test_heads_split_walks_through_the_query_views_and_the_rotary_embedding(llama):
    g, feeds, want = llama
    lin, rs, tr = _q_heads(g)
    g1 = _apply(g, "megatron_column_linear", [lin])                     # Q column-parallel: hidden dim split
    rs1 = _first(g1, "Reshape", pred=lambda n: n.id == rs)
    apps = _applications(g1, "combine_sink_Reshape", [rs1])
    assert [m.binding["e"] for m, _ in apps] == [-2]                  # the split lands on the heads, nowhere else
    g2 = apps[0][1]
    apps = _applications(g2, "combine_sink_Transpose", [tr])
    assert [m.binding["e"] for m, _ in apps] == [-3]                  # 0213: heads move to dim 1
    g3 = apps[0][1]
    # the rotary embedding on the heads split: both Slices (last dim), the Neg, the Concat, the products with the
    # cos/sin tables (broadcast, replicated) and their sum
    for name, op in (("split_Slice", "Slice"), ("split_Slice", "Slice"), ("split_Neg", "Neg"),
                     ("dp_Concat", "Concat"), ("split_Mul_pr", "Mul"), ("split_Mul_pr", "Mul"), ("split_Add", "Add")):
        tr3 = next(n for n in g3.topo_order() if g3.node(n).op == "Transpose" and n > max(g.node_ids()))
        region = _downstream(g3, tr3, 6)
        cand = [n for n in region if g3.node(n).op == op and all(d.degree == 1 for d in g3.shape((n, 0)).dims)]
        g3 = _cancel(_apply(g3, name, cand[:1], d=-3))
    _close(want, evaluate(g3, feeds, "pieces"))
    # every rotary operator now runs on the heads split
    tr3 = next(n for n in g3.topo_order() if g3.node(n).op == "Transpose" and n > max(g.node_ids()))
    for n in _downstream(g3, tr3, 6):
        if g3.node(n).op in ("Slice", "Neg", "Concat", "Mul", "Add"):
            assert g3.shape((n, 0)).dims[1].degree == 2, g3.node(n).label()


def _downstream(g: PCG, nid: int, depth: int) -> list[int]:
    """The nodes at most ``depth`` edges below ``nid``, up to the attention scores (the rotary embedding)."""
    seen, frontier = [], [nid]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for c, _ in g.consumers((u, 0)):
                if c not in seen and g.node(c).op != "BatchMatMul":
                    seen.append(c)
                    nxt.append(c)
        frontier = nxt
    return sorted(seen)


def test_grouped_query_repetition_and_key_transpose_split_by_kv_heads(llama):
    g, feeds, want = llama
    # K/V heads repeated for their query groups: Reshape (b, kv, s, d) -> (b, kv, 1, s, d), Expand, Reshape back.
    # The Expand split by K/V heads (dim -4) leaves a Partition of the first Reshape's output, which moves above it
    ex = _first(g, "Expand")
    g1 = _apply(g, "split_Expand", [ex], d=-4)
    lift = _applications(g1, "partition_lift_Reshape")
    assert lift and {m.binding["d"] for m, _ in lift} == {-3}           # the K/V heads dim of (b, kv, s, d)
    g2 = lift[0][1]
    # the repeated heads merge back: the Combine after the Expand sinks through the Reshape onto the heads dim
    sink = _applications(_cancel(g2), "combine_sink_Reshape")
    assert any(m.binding["e"] == -3 for m, _ in sink)
    g3 = next(g3 for m, g3 in sink if m.binding["e"] == -3)
    _close(want, evaluate(g3, feeds, "pieces"))
    # K^T (Transpose 0132) under the heads-split scores: the BatchMatMul's Partition of it lifts above the Transpose
    bmm = _first(g, "BatchMatMul")
    g4 = _apply(g, "megatron_attention_heads", [bmm], d=-3)
    lift = [(m, x) for m, x in _applications(g4, "partition_lift_Transpose") if m.binding["e"] == -3]
    assert lift and lift[0][0].binding["d"] == -3
    _close(want, evaluate(lift[0][1], feeds, "pieces"))


def test_rmsnorm_lifts_onto_the_tensor_parallel_copies(llama):
    # Q, K and V column-parallel read three copies of the attention RMSNorm's output; merged into one Replicate,
    # it lifts above the RMSNorm (Megatron-LM runs the norm on every tensor-parallel device)
    g, feeds, want = llama
    norm = _first(g, "RMSNorm")
    for lin in [c for c, _ in g.consumers((norm, 0))]:
        g = _apply(g, "megatron_column_linear", [lin])
    g = _cancel(g)
    apps = _applications(g, "replicate_lift_RMSNorm_scale")
    assert apps
    _close(want, evaluate(apps[0][1], feeds, "pieces"))


@pytest.mark.parametrize("name", [n for n in NEW if n.startswith("replicate_lift_")])
def test_replicate_lift_applies_at_the_decoders_shapes(llama, name):
    """Each element-wise lift on copies, on an operator of the decoder where it has one (at its shapes and
    attributes), else at the rule's example shapes: ``Replicate(op(x..))`` built, matched, lifted, equal."""
    from unity_pcg.substitutions.templates import example_of
    g, _, _ = llama
    rule = RULES[name]
    opname = rule.source.nodes[0].op
    n_in = len(rule.source.nodes[0].inputs)
    at = [g.node(n) for n in g.topo_order() if g.node(n).op == opname and len(g.node(n).inputs) == n_in]
    if at:
        node = at[0]
        shapes = [g.shape(r) for r in node.inputs]
        attrs = dict(node.attrs)
    else:
        ex = example_of(rule)
        shapes = [ex["shapes"][x] for x in rule.inputs]
        attrs = {k: (ex["bind"][v[1:]] if isinstance(v, str) and v.startswith("$") else v)
                 for k, v in rule.source.nodes[0].attrs}
    b = PCG.builder()
    ins = [b.add("Input", {"name": f"in{i}", "shape": list(s.sizes), "dtype": s.dtype}, [], f"in{i}")
           for i, s in enumerate(shapes)]
    y = b.add(opname, attrs, ins)
    b.set_outputs([b.add("Replicate", {"degree": 2}, [y])])
    h = b.finish()
    apps = _applications(h, name)
    assert apps, name
    rng = np.random.default_rng(1)
    feeds = {f"in{i}": rng.uniform(0.5, 2.0, s.sizes) for i, s in enumerate(shapes)}
    _close(evaluate(h, feeds, "pieces"), evaluate(apps[0][1], feeds, "pieces"))
    if at:
        assert apps[0][1].shape(apps[0][1].outputs[0]).copy_degree == 2
