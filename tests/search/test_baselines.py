import numpy as np
import pytest

from unity_pcg.search.baselines import (StrategyError, build_strategy, data_parallel, expert, expert_choices, megatron,
                              megatron_groups)
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.evaluate import evaluate, random_feeds
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG

from .graphs import diamond, mlp


def _close(a, b):
    return all(np.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(a, b))


def _same_function(g, pg, seed=0):
    feeds = random_feeds(g, seed=seed, int_high=2)
    rng = np.random.default_rng(seed + 1)
    for n in g.sources("Weight"):                 # weights without values: random ones
        name = n.a["name"]
        if name not in g.weights and name not in feeds:
            feeds[name] = rng.standard_normal(n.a["shape"]).astype("float32")
    return _close(evaluate(g, feeds), evaluate(pg, feeds, mode="pieces", rng=np.random.default_rng(seed)))


def _price(pg, machine, optimizer="sgd"):
    r = MachineMapper(CostModel(parse_machine(machine), optimizer=optimizer)).optimize(pg)
    assert r.feasible, r.reason
    return r


def _weight_shape(pg, consumer, pos):
    """Parallel shape of a weight input of ``consumer`` and the ops of its placement chain."""
    ref = pg.node(consumer).inputs[pos]
    chain = []
    n = pg.node(ref[0])
    while n.kind == "parallel":
        chain.append(n.op)
        n = pg.node(n.inputs[0][0])
    assert n.op == "Weight"
    return pg.shape(ref), chain


# --- data parallel -------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [2, 4])
def test_dp_graph_computes_the_same_function(d):
    g = mlp(batch=8, h=16, layers=2)
    pg = data_parallel(g, d)
    ops = pg.op_counts()
    assert ops["Partition"] == 1 and ops["Replicate"] == 2 and ops["Combine"] == 0
    lin = [n for n in pg.nodes() if n.op == "Linear"]
    assert all(pg.shapes(n.id)[0].degrees[0] == d for n in lin)
    assert _same_function(g, pg)
    # the output stays where it was computed: each device's loss reads its own piece
    assert pg.shape(pg.outputs[0]).degrees == (d, 1)
    whole = data_parallel(g, d, combine_outputs=True)
    assert whole.op_counts()["Combine"] == 1 and whole.shape(whole.outputs[0]).piece_count == 1


def _fig2_mlp(b=64, ci=784, h=512, co=10):
    bld = PCG.builder()
    x = bld.add("Input", {"name": "x", "shape": (b, ci)})
    w1 = bld.add("Weight", {"name": "w1", "shape": (ci, h)})
    w2 = bld.add("Weight", {"name": "w2", "shape": (h, co)})
    y = bld.add("Relu", {}, [bld.add("Linear", {}, [x, w1], name="fc1")], name="relu")
    bld.set_outputs([bld.add("Linear", {}, [y, w2], name="fc2")])
    return bld.finish()


def test_figure2_data_parallel_communicates_only_the_gradients():
    """Unity Figure 2: the 2-layer MLP (b=64, h=512, c_i=784, c_o=10) data parallel on 2 devices sends
    2(c_i*h + h*c_o) elements per iteration (two ring all-reduces over 2 devices), nothing else."""
    g = _fig2_mlp()
    r = _price(data_parallel(g, 2), "summit:1x2")
    assert r.breakdown.comm_elements == 2 * (784 * 512 + 512 * 10) == 813_056
    r1 = _price(build_strategy(g, "none"), "summit:1x1")
    assert r1.breakdown.comm_elements == 0


def test_dp_falls_back_where_an_op_refuses_a_partitioned_batch():
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 3, 2)})
    y = b.add("Relu", {}, [x], name="r")
    z = b.add("Softmax", {"axis": 0}, [y], name="flat")        # normalizes along the batch dim
    b.set_outputs([b.add("Tanh", {}, [z], name="t")])
    g = b.finish()
    pg = data_parallel(g, 2)
    assert pg.meta["fallbacks"] == ["flat"]
    # after the fallback the batch is partitioned again
    t = next(n for n in pg.nodes() if n.name == "t")
    assert pg.shapes(t.id)[0].degrees[0] == 2
    assert _same_function(g, pg)


def test_dp_errors_and_none():
    g = diamond(batch=6)
    with pytest.raises(StrategyError, match="not divisible"):
        data_parallel(g, 4)
    assert build_strategy(g, "none") is g
    assert build_strategy(g, "dp", 1) is g
    with pytest.raises(StrategyError, match="unknown strategy 'zero'"):
        build_strategy(g, "zero")
    with pytest.raises(StrategyError, match="logical PCG"):
        build_strategy(data_parallel(g, 2), "dp", 2)
    with pytest.raises(StrategyError, match="positive integer"):
        data_parallel(g, 0)


# --- zoo models (tiny) --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zoo_graphs(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    d = tmp_path_factory.mktemp("zoo")
    out = {}
    for name in ("bert_large", "dlrm", "xdl", "candle_uno"):
        p = zoo.export(name, str(d / f"{name}.onnx"), size="tiny")
        out[name] = p
    return lambda name, batch=None: load_onnx(out[name], batch=batch)


def test_megatron_bert_structure_function_and_price(zoo_graphs):
    g = zoo_graphs("bert_large", 4)
    layers = 2                                           # tiny BERT
    groups = megatron_groups(g)
    assert sum(gr.attention(g) for gr in groups) == layers
    pg = megatron(g, 4, devices_per_node=2)             # 2 nodes x 2: tensor parallel 2, data parallel 2
    assert pg.meta["tp"] == 2 and pg.meta["dp"] == 2 and pg.meta["fallbacks"] == []
    assert _same_function(g, pg)
    # column-parallel: Q, K, V and the first MLP matrix; row-parallel: attention output and second MLP
    assert len(pg.meta["column"]) == 4 * layers and len(pg.meta["row"]) == 2 * layers
    col, row = set(pg.meta["column"]), set(pg.meta["row"])
    for n in pg.nodes():
        if n.op != "Linear" or n.name not in col | row:
            continue
        s, chain = _weight_shape(pg, n.id, 1)
        # split inside the node (never copied there), copied only across the data-parallel nodes
        assert s.degrees == ((1, 2) if n.name in col else (2, 1)), n.name
        assert s.copy_degree == 2 and "Partition" in chain
        if n.name in row:                                 # partial sums all-reduced at once
            (user,) = [c for c, _ in pg.consumers((n.id, 0))]
            assert pg.node(user).op == "AllReduce" and pg.shapes(n.id)[0].sum_degree == 2
    assert pg.op_counts()["AllReduce"] == 2 * layers     # Megatron: two all-reduces per layer (forward)
    # the attention heads are split: the score matmul runs on heads / tp per task
    bmm = [n for n in pg.nodes() if n.op == "BatchMatMul"]
    assert all(pg.shapes(n.id)[0].degrees[1] == 2 for n in bmm)
    r = _price(pg, "summit:2x2", "adam")
    assert r.stats["devices_used"] == 4


def test_megatron_tensor_degree_follows_the_node(zoo_graphs):
    g = zoo_graphs("bert_large", 4)
    pg = build_strategy(g, "megatron", 4, devices_per_node=4)
    assert pg.meta["tp"] == 4 and pg.meta["dp"] == 1
    assert _same_function(g, pg)
    # 6 devices per node (Summit) and 4 heads: the largest degree dividing both is 2
    pg = build_strategy(zoo_graphs("bert_large", 6), "megatron", 6, devices_per_node=6)
    assert pg.meta["tp"] == 2 and pg.meta["dp"] == 3
    with pytest.raises(StrategyError, match="batch dim of size 5 is not divisible"):
        build_strategy(zoo_graphs("bert_large", 5), "megatron", 4, devices_per_node=2)


def test_megatron_refuses_non_transformers(zoo_graphs):
    for name in ("dlrm", "candle_uno"):
        with pytest.raises(StrategyError, match="applies to Transformers"):
            build_strategy(zoo_graphs(name), "megatron", 4)
    with pytest.raises(StrategyError, match="applies to Transformers"):
        build_strategy(mlp(batch=8, h=16, layers=4), "megatron", 2)


@pytest.mark.parametrize("name", ["dlrm", "xdl"])
def test_expert_embeddings_model_parallel_dense_data_parallel(zoo_graphs, name):
    g = zoo_graphs(name, 256)                           # at this batch no dense layer outweighs its activations
    embs, dense = expert_choices(g, 4)
    assert embs and not dense
    pg = expert(g, 4)
    assert _same_function(g, pg)
    emb = [n for n in pg.nodes() if n.op == "Embedding"]
    assert len(emb) == len(embs)
    for n in emb:
        s, chain = _weight_shape(pg, n.id, 1)
        assert chain == [] and s.piece_count == 1        # one whole table, on one device
        assert pg.shape(pg.node(n.id).inputs[0]).piece_count == 1   # reads the whole batch of indices
    for n in pg.nodes():
        if n.op == "Linear":
            s, chain = _weight_shape(pg, n.id, 1)
            assert chain == ["Replicate"] and s.copy_degree == 4       # data parallel
            assert pg.shape(n.inputs[0]).degrees[0] == 4
    r = _price(pg, "summit:1x4")
    assert r.breakdown.comm_elements > 0
    # tables round-robin over the devices, each whole on one (the mapping keeps the strategy's pins)
    devs = [r.views[n.id].devices() for n in emb]
    assert devs == [(k % 4,) for k in range(len(emb))]
    # the index slicing feeding a table and the pooling of its lookups stay on the table's device
    for n in emb:
        idx = pg.node(n.id).inputs[0][0]
        if pg.node(idx).kind == "compute":           # XDL slices one input; DLRM has one per table
            assert r.views[idx].devices() == r.views[n.id].devices()
        for c, _ in pg.consumers((n.id, 0)):         # the bag's sum pooling
            if pg.node(c).op == "ReduceSum":
                assert r.views[c].devices() == r.views[n.id].devices()
    assert len(pg.meta["pinned"]) > len(emb)


def test_expert_dense_layers_that_outweigh_their_activations(zoo_graphs):
    g = zoo_graphs("candle_uno", 4)                      # tiny batch: every weight outweighs its activations
    embs, dense = expert_choices(g, 2)
    assert not embs and len(dense) > 0
    pg = build_strategy(g, "expert", 2)
    assert _same_function(g, pg)
    names = {g.node(i).label() for i in dense}
    for n in pg.nodes():
        if n.op == "Linear" and n.name in names:
            s, _ = _weight_shape(pg, n.id, 1)
            assert s.degrees == (1, 2) and s.copy_degree == 1      # split, never copied
    _price(pg, "summit:1x2")
    # 6 devices and output features that 6 does not divide (16, 32): split 2 ways, data parallel 3 ways
    embs, dense = expert_choices(zoo_graphs("candle_uno", 6), 6)
    assert dense and set(dense.values()) == {2}
    pg = build_strategy(zoo_graphs("candle_uno", 6), "expert", 6)
    assert _same_function(zoo_graphs("candle_uno", 6), pg)
    lin = next(n for n in pg.nodes() if n.op == "Linear" and n.name in names)
    s, _ = _weight_shape(pg, lin.id, 1)
    assert s.degrees == (1, 2) and s.copy_degree == 3
    assert pg.shape(pg.node(lin.id).inputs[0]).degrees[0] == 3
    # at a large batch nothing is communication-intensive: the expert strategy is data parallelism
    big = zoo_graphs("candle_uno", 4096)
    assert expert_choices(big, 2) == ([], {})
    assert build_strategy(big, "expert", 2).structural_hash() == data_parallel(big, 2).structural_hash()


def test_expert_refuses_convolutions_and_attention(zoo_graphs):
    with pytest.raises(StrategyError, match="recommendation and dense models"):
        build_strategy(zoo_graphs("bert_large"), "expert", 2)
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 3, 8, 8)})
    w = b.add("Weight", {"name": "w", "shape": (6, 3, 3, 3)})
    b.set_outputs([b.add("Conv2d", {"padding": (1, 1, 1, 1)}, [x, w], name="conv")])
    with pytest.raises(StrategyError, match="recommendation and dense models"):
        build_strategy(b.finish(), "expert", 2)
    assert build_strategy(mlp(batch=8, h=16, layers=2), "expert", 2).meta["strategy"] == "expert"


def _transformer_layer(batch=4, seq=512, hidden=4096, heads=32, ffn=16384):
    """One post-LN Transformer layer as the ONNX importer gives it (bias-free Linear + bias Add,
    heads split by Reshape/Transpose), without weight values."""
    hd = hidden // heads
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, seq, hidden)})

    def w(name, shape):
        return b.add("Weight", {"name": name, "shape": shape})

    def dense(inp, k, n, name):
        y = b.add("Linear", {}, [inp, w(f"{name}.w", (k, n))], name=name)
        return b.add("Add", {}, [w(f"{name}.b", (n,)), y], name=f"{name}/bias")

    def heads_of(t, perm, name):
        r = b.add("Reshape", {"shape": (batch, seq, heads, hd)}, [t], name=f"{name}/reshape")
        return b.add("Transpose", {"perm": perm}, [r], name=f"{name}/transpose")
    q = heads_of(dense(x, hidden, hidden, "q"), (0, 2, 1, 3), "q")
    k = heads_of(dense(x, hidden, hidden, "k"), (0, 2, 3, 1), "k")
    v = heads_of(dense(x, hidden, hidden, "v"), (0, 2, 1, 3), "v")
    s = b.add("Scale", {"factor": hd ** -0.5}, [b.add("BatchMatMul", {}, [q, k], name="scores")], name="scale")
    ctx = b.add("BatchMatMul", {}, [b.add("Softmax", {"axis": -1}, [s], name="softmax"), v], name="context")
    ctx = b.add("Reshape", {"shape": (batch, seq, hidden)},
                [b.add("Transpose", {"perm": (0, 2, 1, 3)}, [ctx], name="ctx/transpose")], name="ctx/reshape")
    a = b.add("Add", {}, [x, dense(ctx, hidden, hidden, "out")], name="residual1")
    a = b.add("LayerNorm", {"axis": -1}, [a, w("ln1.g", (hidden,)), w("ln1.b", (hidden,))], name="ln1")
    h = b.add("Gelu", {}, [dense(a, hidden, ffn, "fc1")], name="gelu")
    y = b.add("Add", {}, [a, dense(h, ffn, hidden, "fc2")], name="residual2")
    b.set_outputs([b.add("LayerNorm", {"axis": -1}, [y, w("ln2.g", (hidden,)), w("ln2.b", (hidden,))], name="ln2")])
    return b.finish()


def test_megatron_figure10_layer_on_a_dgx():
    """Unity Figure 10: one Transformer layer (hidden 4096, 32 heads, batch 4, sequence 512) on 8 A100s.
    Megatron splits the heads and every projection and MLP matrix 8 ways (none is copied), all-reduces
    twice in the forward pass (twice more in the backward: 4 per iteration), and is predicted faster
    than data parallelism, whose gradient all-reduce moves every weight."""
    g = _transformer_layer()
    pg = megatron(g, 8, devices_per_node=8)
    assert pg.meta["tp"] == 8 and pg.meta["fallbacks"] == []
    for n in pg.nodes():
        if n.op == "Linear":
            s, _ = _weight_shape(pg, n.id, 1)
            assert s.copy_degree == 1 and s.shard_degree == 8, n.name
    assert pg.op_counts()["AllReduce"] == 2
    assert all(pg.shapes(n.id)[0].degrees[1] == 8 for n in pg.nodes() if n.op == "BatchMatMul")
    small = _transformer_layer(batch=2, seq=8, hidden=64, heads=8, ffn=128)    # same structure, evaluable
    psmall = megatron(small, 8, devices_per_node=8)
    assert _same_function(small, psmall)
    r_mt = _price(pg, "dgx-a100:1x8", "adam")
    r_dp = _price(data_parallel(g, 4), "dgx-a100:1x4", "adam")               # batch 4: at most 4-way
    r_dp8 = _price(data_parallel(g, 4), "dgx-a100:1x8", "adam")
    assert r_mt.cost < min(r_dp.cost, r_dp8.cost)
    # the activation all-reduces: 2 forward + 2 backward of batch x seq x hidden over 8 devices
    act = 4 * 2 * 7 * (4 * 512 * 4096)
    assert r_mt.breakdown.comm_elements - act < 2 * 7 * 4 * 4096 * 4    # plus the small replicated weights
