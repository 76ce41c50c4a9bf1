"""Megatron-LM's layout on a whole Transformer reached by proven rules (issue 7 point 1).

Megatron-LM keeps the residual stream, its Adds and LayerNorms on the tensor-parallel copies, so that each
column -> row group ends in one AllReduce.  By rules: the model head goes column-parallel (BERT's pooler: a
Linear with its bias, then Tanh: ``megatron_column_linear_bias``, ``combine_sink_Tanh``), so the head reads a
Replicate, which lifts up through the views it reads (``replicate_lift_Slice`` / ``_Reshape``), the last
LayerNorm and Add, merges with each group's own Replicate (``replicate_cse``) and meets each group's Reduce
(``reduce_replicate_allreduce``), all the way up to the embeddings.  Without the head's rules nothing lifts:
every group ends in a Reduce and the next one starts with a Replicate, and the layout prices above the
hand-built Megatron baseline, which ``optimize`` then returned with no rule sequence (BERT-Large, 96 and 192
GPUs)."""
import json
import math
import time
from collections import Counter

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.optimize import Evaluator, search_degrees
from unity_pcg.search.substitution import RuleBook, RuleStep, data_parallel_steps, replay, tensor_parallel_steps, trimmed

from .graphs import same_function

BATCH = 6


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("bert") / "bert.onnx"
    zoo.export("bert_large", str(p), size="tiny", batch=BATCH)
    return str(p)


def fresh(path):
    from unity_pcg.onnx_import import load_onnx
    return load_onnx(path, load_weights=False)


def parallel_ops(g):
    return Counter(n.op for n in g.nodes() if n.kind == "parallel")


def replays(path, g, steps):
    steps = [RuleStep.from_json(json.loads(json.dumps(s.to_json()))) for s in steps]
    return replay(fresh(path), steps, trim_outputs=True).structural_hash() == trimmed(g).structural_hash()


def test_whole_bert_on_the_copies_by_rules(bert_path):
    m = parse_machine("summit:1x6")                  # Megatron: t = 2 (4 heads), data parallel 3
    g = fresh(bert_path)
    book = RuleBook(None, search_degrees(m))
    g1, st1 = data_parallel_steps(g, 3, book)
    g2, st2 = tensor_parallel_steps(g1, 2, book, head=True, copies=True)
    used = Counter(s.rule for s in st2)
    assert {"megatron_column_linear_bias", "combine_sink_Tanh", "replicate_lift_Slice", "replicate_lift_Reshape",
            "replicate_lift_LayerNorm", "replicate_lift_Add", "replicate_cse"} <= set(used), used
    ops = parallel_ops(trimmed(g2))
    # two layers of two groups, each ending in one AllReduce; nothing gathered, no Reduce left
    assert ops["AllReduce"] == 4 and ops["Reduce"] == 0 and ops["Combine"] == 0, ops
    ev = Evaluator(m, "adam")
    hand = ev.full(build_strategy(g, "megatron", 6, devices_per_node=6)).cost
    assert ev.full(trimmed(g2)).cost <= hand * (1 + 1e-9)
    assert replays(bert_path, g2, st1 + st2)
    assert same_function(fresh(bert_path), trimmed(g2))


def test_without_the_head_nothing_lifts(bert_path):
    m = parse_machine("summit:1x6")
    g = fresh(bert_path)
    book = RuleBook(None, search_degrees(m))
    g1, _ = data_parallel_steps(g, 3, book)
    g2, _ = tensor_parallel_steps(g1, 2, book, head=False, copies=True)
    ops = parallel_ops(trimmed(g2))
    assert ops["Reduce"] > 0 and ops["AllReduce"] == 0, ops
    ev = Evaluator(m, "adam")
    hand = ev.full(build_strategy(g, "megatron", 6, devices_per_node=6)).cost
    assert ev.full(trimmed(g2)).cost > hand
