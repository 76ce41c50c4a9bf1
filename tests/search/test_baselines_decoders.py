"""Megatron-LM's layout and Alpa's plan on decoders with grouped-query attention and gated MLPs (issue 18):
transformers' Llama (both exporters) and a hand-written decoder nobody named (GeGLU, no mask), found by
structure; the one-line reasons where Megatron does not apply; Alpa's plan by a deadline."""
from __future__ import annotations

import contextlib
import io
import time
import warnings

import numpy as np
import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.onnx_import import load_onnx
from unity_pcg.search.alpa.inter import alpa_plan, cluster_operators
from unity_pcg.search.alpa.intra import AlpaDeadline, solve_intra
from unity_pcg.search.baselines import (StrategyError, build_strategy, head_counts, megatron,
                                        megatron_groups)
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.budget import Deadline
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.stages import stage_dp

from .test_baselines import _same_function

torch = pytest.importorskip("torch")

HID, HEADS, KV, FFN, LAYERS, SEQ, BATCH, VOCAB = 64, 4, 2, 128, 2, 8, 4, 100


def _export(module, args, names, path, dynamo):
    module.eval()
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, args, path, input_names=names, dynamo=True, external_data=False,
                              optimize=True)
        else:
            torch.onnx.export(module, args, path, input_names=names, opset_version=17, dynamo=False,
                              do_constant_folding=False)
    return path


class _Wrap(torch.nn.Module):
    def __init__(self, m, names):
        super().__init__()
        self.m, self.names = m, names

    def forward(self, *xs):
        return self.m(**dict(zip(self.names, xs))).last_hidden_state


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.ones(BATCH, SEQ, dtype=torch.int64)


_CACHE: dict = {}


def _hf(name, dynamo, tmp_path_factory):
    """A tiny transformers model exported with one exporter (once per session)."""
    key = (name, dynamo)
    if key in _CACHE:
        return _CACHE[key]
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(attn_implementation="eager")
    ids, mask = _tokens()
    if name == "llama":
        m = T.LlamaModel(T.LlamaConfig(vocab_size=VOCAB, hidden_size=HID, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
                                       max_position_embeddings=64, use_cache=False, **common))
        ex = {"input_ids": ids, "attention_mask": mask}
    elif name == "bert":
        m = T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                     **common))
        ex = {"input_ids": ids, "attention_mask": mask}
    elif name == "gpt2":
        m = T.GPT2Model(T.GPT2Config(vocab_size=VOCAB, n_embd=HID, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                     use_cache=False, **common))
        ex = {"input_ids": ids, "attention_mask": mask}
    elif name == "bloom":
        m = T.BloomModel(T.BloomConfig(vocab_size=VOCAB, hidden_size=HID, n_layer=LAYERS, n_head=HEADS,
                                       use_cache=False, **common))
        ex = {"input_ids": ids, "attention_mask": mask}
    elif name == "vit":
        m = T.ViTModel(T.ViTConfig(hidden_size=HID, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   intermediate_size=FFN, image_size=16, patch_size=8, **common))
        ex = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))}
    else:
        raise KeyError(name)
    names = list(ex)
    d = tmp_path_factory.mktemp("hf")
    path = _export(_Wrap(m, names), tuple(ex.values()), names, str(d / f"{name}-{int(dynamo)}.onnx"), dynamo)
    _CACHE[key] = path
    return path


class _Decoder(torch.nn.Module):
    """A decoder written here: grouped-query attention (6 query heads over 3 key-value heads, rotary
    embeddings, causal by ``tril``), a GeGLU MLP (GELU gate times up projection), RMSNorm-style scaling."""

    def __init__(self, hid=48, heads=6, kv=3, ffn=96, layers=2, vocab=50):
        super().__init__()
        self.h, self.kv, self.d = heads, kv, hid // heads
        self.emb = torch.nn.Embedding(vocab, hid)
        L = torch.nn.Linear
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict(dict(
                q=L(hid, heads * self.d, bias=False), k=L(hid, kv * self.d, bias=False),
                v=L(hid, kv * self.d, bias=False), o=L(heads * self.d, hid, bias=False),
                gate=L(hid, ffn, bias=False), up=L(hid, ffn, bias=False), down=L(ffn, hid, bias=False))))
        self.n1 = torch.nn.Parameter(torch.rand(layers, hid) + 0.5)

    def _rot(self, x, cos, sin):
        a, b = x[..., : self.d // 2], x[..., self.d // 2:]
        return x * cos + torch.cat([-b, a], -1) * sin

    def forward(self, ids):
        B, S = ids.shape
        x = self.emb(ids)
        pos = torch.arange(S, dtype=torch.float32)[:, None] / (10.0 ** (torch.arange(self.d) / self.d))[None, :]
        cos, sin = torch.cos(pos), torch.sin(pos)
        causal = torch.full((S, S), -1e4).triu(1)
        for li, blk in enumerate(self.blocks):
            y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.n1[li]
            q = blk["q"](y).view(B, S, self.h, self.d).transpose(1, 2)
            k = blk["k"](y).view(B, S, self.kv, self.d).transpose(1, 2)
            v = blk["v"](y).view(B, S, self.kv, self.d).transpose(1, 2)
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            r = self.h // self.kv
            k = k[:, :, None].expand(B, self.kv, r, S, self.d).reshape(B, self.h, S, self.d)
            v = v[:, :, None].expand(B, self.kv, r, S, self.d).reshape(B, self.h, S, self.d)
            a = torch.softmax(q @ k.transpose(-1, -2) / self.d ** 0.5 + causal, -1) @ v
            x = x + blk["o"](a.transpose(1, 2).reshape(B, S, self.h * self.d))
            x = x + blk["down"](torch.nn.functional.gelu(blk["gate"](x)) * blk["up"](x))
        return x


def _decoder(tmp_path_factory):
    if "decoder" not in _CACHE:
        torch.manual_seed(0)
        ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
        d = tmp_path_factory.mktemp("dec")
        _CACHE["decoder"] = _export(_Decoder(), (ids,), ["ids"], str(d / "decoder.onnx"), False)
    return _CACHE["decoder"]


def _linear_weight(pg, n):
    ref = pg.node(n.id).inputs[1]
    return pg.shape(ref)


def _check_megatron_layout(g, pg, tp, heads):
    """Q/K/V and the gated MLP's two projections column-parallel, the output and down projections
    row-parallel with one AllReduce each, the heads' matmuls on heads / tp per task."""
    layers = sum(gr.attention(g) for gr in megatron_groups(g))
    assert layers >= 2
    assert pg.meta["tp"] == tp
    col, row = set(pg.meta["column"]), set(pg.meta["row"])
    assert not set(pg.meta["fallbacks"]) & (col | row)
    assert len(col) == 5 * layers and len(row) == 2 * layers        # q, k, v, gate, up | o, down
    for n in pg.nodes():
        if n.op != "Linear" or n.name not in col | row:
            continue
        s = _linear_weight(pg, n)
        assert s.degrees == ((1, tp) if n.name in col else (tp, 1)), n.name
        if n.name in row:
            (user,) = [c for c, _ in pg.consumers((n.id, 0))]
            assert pg.node(user).op == "AllReduce"
    for n in pg.nodes():
        if n.op == "BatchMatMul":
            assert pg.shapes(n.id)[0].degrees[1] == tp                  # heads split, query heads with their group
    # the gated product (two column-parallel outputs multiplied element-wise) runs on the split features
    gated = [n for n in pg.nodes() if n.op == "Mul" and len(n.inputs) == 2
             and all(pg.node(r[0]).op in ("Linear", "Silu", "Gelu", "GeluTanh", "Relu", "Sigmoid", "Tanh")
                     for r in n.inputs)]
    assert gated and all(pg.shapes(n.id)[0].degrees[-1] == tp for n in gated)
    # the head counts are read off the graph: grouped-query attention has fewer key-value heads
    counts = {h for gr in megatron_groups(g) if gr.attention(g) for h in head_counts(g, gr).values()}
    assert counts == set(heads)


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("machine,tp", [("local:1x2", 2), ("h100:1x4", 2)])
def test_megatron_on_llama_splits_kv_groups_and_swiglu(dynamo, machine, tp, tmp_path_factory):
    g = load_onnx(_hf("llama", dynamo, tmp_path_factory), load_weights=False)
    m = parse_machine(machine)
    # 4 devices in a node, but 2 key-value heads: the tensor degree is 2 (data parallel 2 across)
    pg = build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node)
    assert pg.meta["dp"] == m.num_devices // tp
    _check_megatron_layout(g, pg, tp, (HEADS, KV))
    assert _same_function(g, pg)
    # priced in the same cost model as data parallelism
    cm = CostModel(m)
    r = MachineMapper(cm).optimize(pg)
    rd = MachineMapper(cm).optimize(build_strategy(g, "dp", m.num_devices))
    assert r.feasible and rd.feasible and np.isfinite(r.cost) and np.isfinite(rd.cost)


def test_megatron_on_a_decoder_nobody_named(tmp_path_factory):
    g = load_onnx(_decoder(tmp_path_factory))      # its weights: random ones make its scores overflow the mask
    pg = megatron(g, 6, devices_per_node=6)       # 6 query / 3 key-value heads: t = 3, not 6 or 2
    _check_megatron_layout(g, pg, 3, (6, 3))
    assert _same_function(g, pg)
    with pytest.raises(StrategyError, match=r"6 / 3 heads: t must divide each"):
        megatron(g, 4, devices_per_node=4)        # t in {4, 2}: neither divides 3 key-value heads


def test_megatron_decoder_trains_as_one_process(tmp_path_factory):
    from tests.executor import dist_helpers as H
    path = _decoder(tmp_path_factory)
    g = H.load(path)
    pg = megatron(g, 3, devices_per_node=3)
    assert pg.meta["tp"] == 3
    ref = H.reference(path, 2)
    got = H.run_cases(3, [H.case(H.make_plan(pg, path, 3), path, steps=2)])
    H.assert_same(ref, got[0], what="megatron tp3 on the GQA/GeGLU decoder")
    assert ref[0][0] != ref[0][1]


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_megatron_llama_trains_as_one_process(dynamo, tmp_path_factory):
    from tests.executor import dist_helpers as H
    path = _hf("llama", dynamo, tmp_path_factory)
    pg = megatron(H.load(path), 2, devices_per_node=2)     # tp 2: the two key-value groups, one per rank
    assert pg.meta["tp"] == 2 and len(pg.meta["column"]) == 5 * LAYERS
    ref = H.reference(path, 2)
    got = H.run_cases(2, [H.case(H.make_plan(pg, path, 2), path, steps=2)])
    H.assert_same(ref, got[0], what="megatron tp2 on transformers' Llama")
    assert ref[0][0] != ref[0][1]


def test_megatron_one_line_reasons(tmp_path_factory):
    from tests.executor import models
    cnn = load_onnx(models.convnet(), load_weights=False)
    with pytest.raises(StrategyError, match=r"no attention block \(no matmul of two activations") as e:
        build_strategy(cnn, "megatron", 2)
    assert "\n" not in str(e.value)
    gpt2 = load_onnx(_hf("gpt2", False, tmp_path_factory), load_weights=False)
    # a fused Q/K/V projection no longer refuses: it is split into one Linear per piece (test_megatron_fused_qkv)
    assert build_strategy(gpt2, "megatron", 2).meta["tp"] == 2


# --- Alpa ------------------------------------------------------------------------------------------------

def test_clustering_never_refuses_when_weights_block_cuts(tmp_path_factory):
    # the exporter shares one all-ones norm scale among every RMSNorm: few valid cuts, fewer layers
    g = load_onnx(_hf("llama", True, tmp_path_factory), load_weights=False)
    roles = GraphCost(g, CostModel(parse_machine("local:1x2"))).role
    lay, info = cluster_operators(g, roles, 8)
    valid = sum(bool(v) for v in info.valid[1:])
    assert valid < 7 and len(lay) == valid + 1
    assert lay[0][0] == 0 and lay[-1][1] == len(info.units)
    assert all(a[1] == b[0] for a, b in zip(lay, lay[1:]))
    assert all(a == 0 or info.valid[a] for a, _ in lay)


@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "llama"])
def test_alpa_plan_by_a_deadline(name, tmp_path_factory):
    """A deadline already passed: no ILP runs, the whole model is one data-parallel stage (the stand-in),
    and the plan is complete (stitched, priced)."""
    g = load_onnx(_hf(name, False, tmp_path_factory), load_weights=False)
    m = parse_machine("local:1x2")
    ar = alpa_plan(g, m, mapper=MachineMapper(CostModel(m)), deadline=time.monotonic() - 1.0)
    assert ar.feasible and ar.pipeline.pcg is not None and np.isfinite(ar.cost)
    assert ar.stats["deadline_hit"] and ar.stats["deadline_fallback_solves"] >= 1
    assert len(ar.stats["micro_batches_tried"]) == 1


def test_alpa_plan_with_time_solves_ilps_tiny_llama(tmp_path_factory):
    g = load_onnx(_hf("llama", True, tmp_path_factory), load_weights=False)
    m = parse_machine("local:1x2")
    ar = alpa_plan(g, m, mapper=MachineMapper(CostModel(m)), micro_batches=1)
    assert ar.feasible and ar.pipeline.pcg is not None and ar.stats["solves"] > 0


def test_intra_and_stage_dp_stop_at_the_deadline(tmp_path_factory):
    g = load_onnx(_hf("llama", False, tmp_path_factory), load_weights=False)
    with pytest.raises(AlpaDeadline):
        solve_intra(g, parse_machine("local:1x2"), (1, 2), deadline=time.monotonic() - 1.0)
    # stage DP past its deadline: one run at the largest t_max, a plan all the same
    rng = np.random.default_rng(0)
    t = rng.uniform(1, 2, (3, 3, 2))
    t[np.tril_indices(3, -1)] = np.inf
    r = stage_dp(3, [1, 2], 2, 4, t, deadline=Deadline(time.monotonic() - 1.0))
    full = stage_dp(3, [1, 2], 2, 4, t)
    assert r.best() and r.tried == 1 and r.cut and r.best()[0] >= full.best()[0]
