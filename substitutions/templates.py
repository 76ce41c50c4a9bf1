"""Named rules the paper relies on, written as patterns (origin "template") and proven by the verifier
like every generated rule (rules_cmd / generate re-prove them; none is shipped unproven).

* ``dp_<Op>``: data (sample-dim) parallelism for every compute operator that allows it: ``op(x, w..)``
  becomes ``Combine(op(Partition(x), Replicate(w)..))`` (Unity Fig. 9a); ``dp_<Op>_<variant>`` where
  the inputs that carry the sample dim differ (``_pr``/``_rp``: the broadcast operand replicated,
  ``_bias``, ``dp_GatherND_batch``; the specs are ``verifier.axioms.SAMPLE_RULES``);
* Megatron-LM (Fig. 10): ``megatron_attention_heads`` (BatchMatMul on partitioned heads),
  ``megatron_attention_block`` (a whole attention block with its heads split: Q/K/V column-parallel, the
  output projection row-parallel, one Reduce; proved from a named axiom subset, ``AXIOM_SUBSETS``),
  ``megatron_embedding_column`` / ``megatron_embedding_bag_column`` (an embedding table split by columns,
  the bag variant summing the bag before the features are gathered),
  ``megatron_column_linear``, ``megatron_row_linear`` and ``megatron_mlp_column_row`` (column- then
  row-parallel Linear ending in a Reduce), ``megatron_mlp_column_<gelu|relu>_row`` (the same with the
  activation as its own operator, as exported);
* ``fig11a_relu_spatial`` (ReLU on a partitioned spatial/any dim), ``fig11b_add_concat_reduce`` (Add as
  Concat, a local ReduceSum over the partitioned concat dim, then Reduce, see below);
* ``fig2_matmul_reduction`` (split the contraction dim of MatMul on both inputs -> partial sums -> Reduce);
* ``linear_relu_fusion`` / ``linear_relu_unfusion`` (and with bias);
* ``reduce_replicate_allreduce`` / ``allreduce_split``;
* ``replicate_merge`` (``Replicate(Replicate(x, k), j) -> Replicate(x, k * j)``: copies of copies, as the data-
  parallel rule and a replicate lift leave on a weight of a stage data and tensor parallel at once; the product
  degree is chosen at application, the constraint keeps only ``k * j``);
* ``combine_sink_<Reduce|Replicate|AllReduce>`` (``P(Combine(x, d, k), j) -> Combine(P(x, j), d, k)``: a gather
  commutes with a sum or a copy, which change other degrees; a stage data and tensor parallel at once gathers a
  row-parallel Linear's batch pieces before its AllReduce, the next pair splits them again: sunk, they cancel)
  and ``partition_replicate_commute`` (``Partition(Replicate(x, j), d, k) -> Replicate(Partition(x, d, k), j)``,
  any two degrees: a weight copied by the data-parallel rule, then split by a Megatron template);
  ``combine_sink_Combine`` (``Combine(Combine(x, d, k), e, j) -> Combine(Combine(x, e, j), d, k)``, ``d != e``:
  a gather moves past a gather of another dim, so a batch gather before a feature gather reaches the next
  operator's batch Partition and cancels) and ``combine_sink_Partition`` (the same past a split of another dim); ``partition_combine_cancel_shared`` (``(Combine(x, d, k),
  Partition(Combine(x, d, k), d, k)) -> (Combine(x, d, k), x)``: a gather with other readers, one of which
  splits it again, reads the pieces there);
* ``replicate_lift_Embedding`` (``Replicate(Embedding(i, t)) -> Embedding(Replicate(i), Replicate(t))``: an
  operator over constants computed on every device, where data parallelism cannot partition it),
  ``replicate_lift_Add`` and ``replicate_lift_LayerNorm`` (the operators between Megatron's groups on the
  tensor-parallel copies), ``replicate_lift_<Reshape|Slice|Flatten|Transpose>`` (the views a head reads) and
  ``replicate_lift_Concat[_<n>]`` (a join of branches on the copies, every arity);
* ``megatron_column_linear_bias`` (a head Linear with its bias, column-parallel) and ``combine_sink_<U>`` for every
  element-wise unary ``U`` (``U(Combine(x)) -> Combine(U(x))``: the head's activation on the column pieces).

Figure 11b under our piece semantics: partial sums only arise from a contraction over a partitioned
dim, so "Add == Concat then Reduce" is stated for tensors summed along a dim ``a``:
``Add(ReduceSum_a(x), ReduceSum_a(y)) == Reduce(2, ReduceSum_a(Partition(a, 2, Concat(a, x, y))))``;
with equal sizes each device holds exactly x or y (the Concat moves no data), sums it locally and the
Reduce adds the two partial sums (an AllReduce when followed by Replicate).  With size-1 ``a`` dims
(keepdims) it is exactly ``Add(x, y)``.
"""
from __future__ import annotations

import json
from typing import Any

from unity_pcg.shape import ParallelTensorShape as S
from unity_pcg.verifier.axioms import (BINARY, CNN_REPLICATE, CONCAT_ARITIES, CONV_ATTRS, CONV_CHANNEL, SAMPLE_OPS,
                                       SAMPLE_RULES, SPLIT_VIEWS, TRANSPOSE_SAMPLE_PERMS, UNARY, VIEW_MOVES,
                                       VIEW_REPLICATE, WINDOW_SPLIT, concat_names)

from .rule import Pattern, PatNode, Rule
from .terms import op, rule_of

K = {"k": "degree"}


def _part(t, d, k="$k"):
    return op("Partition", t, dim=d, degree=k)


def _comb(t, d, k="$k"):
    return op("Combine", t, dim=d, degree=k)


def _rep(t, k="$k"):
    return op("Replicate", t, degree=k)


def _with_example(r: Rule, bind: dict, shapes: dict, ints: tuple = (), values: str = "float") -> Rule:
    ex = {"bind": bind, "shapes": {n: s.to_json() for n, s in shapes.items()}, "ints": list(ints),
          "values": values}
    return r.with_example(json.dumps(ex, sort_keys=True))


def _attention(x, wq, wk, wv, wo, biases=None, mask=None):
    """One multi-head attention block as the exporters write it; ``biases`` (bq, bk, bv, bo) as BERT
    exports them, ``Add(bias, Linear(x, w))`` (bo None: the output bias is left to the caller); ``mask``: an
    additive mask added to the scaled scores (GPT's causal mask, ``Add(Scale(scores), mask)``)."""
    def proj(w, b):
        y = op("Linear", x, w)
        return y if b is None else op("Add", b, y)

    bq, bk, bv, bo = biases or (None,) * 4

    def heads(w, b, perm):
        return op("Transpose", op("Reshape", proj(w, b), shape="$sh"), perm=perm)
    q, k, v = heads(wq, bq, (0, 2, 1, 3)), heads(wk, bk, (0, 2, 3, 1)), heads(wv, bv, (0, 2, 1, 3))
    s = op("Scale", op("BatchMatMul", q, k), factor="$f")
    if mask is not None:
        s = op("Add", s, mask)
    a = op("BatchMatMul", op("Softmax", s, axis=-1), v)
    out = op("Linear", op("Reshape", op("Transpose", a, perm=(0, 2, 1, 3)), shape="$sm"), wo)
    return out if bo is None else op("Add", bo, out)


# Templates proved from a named subset of the (self-checked, hence sound) axioms: with every relevant axiom
# loaded, Z3's e-matching loops (the unary_partition axioms that Linear_<act>_fused brings in, and
# Reduce_Partition_commute, each alone make megatron_attention_block time out; measured by adding the
# relevant axioms one at a time to this subset).  The verifier tries the subset first, then the relevant set.
AXIOM_SUBSETS: dict[str, tuple[str, ...]] = {
    "megatron_attention_block": (
        "Linear_partition_cols", "Reshape_partition_split_last", "Transpose_partition_0213_d-2",
        "Transpose_partition_0231_d-2", "BatchMatMul_partition_batch", "Scale_partition", "Softmax_partition",
        "Reshape_Transpose_partition_merge_heads", "Linear_is_MatMul", "MatMul_partition_inner"),
}
AXIOM_SUBSETS["megatron_attention_block_bias"] = AXIOM_SUBSETS["megatron_attention_block"] + ("Add_partition",)
AXIOM_SUBSETS["megatron_attention_block_bias_mask"] = AXIOM_SUBSETS["megatron_attention_block_bias"] + (
    "Add_partition_broadcast",)
for _u in ("Gelu", "Relu"):
    AXIOM_SUBSETS[f"megatron_mlp_column_{_u.lower()}_row_bias"] = (
        "Linear_partition_cols", "Add_partition", f"{_u}_partition", "Linear_is_MatMul", "MatMul_partition_inner")


def _with_subset(r: Rule) -> Rule:
    return r.with_proof(axiom_subset=list(AXIOM_SUBSETS[r.name]))


def template_rules() -> list[Rule]:
    rules: list[Rule] = []
    x44 = {"x": S.of((4, 4))}
    # --- data parallelism, element-wise ---------------------------------------------------------------
    for u, (pa, ex, vk, _) in UNARY.items():
        V = {**K, **{v[1:]: "attr" for v in pa.values()}}
        r = rule_of(f"dp_{u}", op(u, "x", **pa), _comb(op(u, _part("x", 0), **pa), 0), V)
        rules.append(_with_example(r, {**ex, "k": 2}, x44, values=vk))
    for b, (_, vk) in BINARY.items():
        r = rule_of(f"dp_{b}", op(b, "x", "y"), _comb(op(b, _part("x", 0), _part("y", 0)), 0), K)
        rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "y": S.of((4, 4))}, values=vk))
    # --- data parallelism, dense ------------------------------------------------------------------------
    D = {**K, "d": "dim"}
    r = rule_of("dp_Linear", op("Linear", "x", "w", activation="$act"),
                _comb(op("Linear", _part("x", "$d"), _rep("w"), activation="$act"), "$d"), {**D, "act": "attr"},
                [["$d", "<=", -2]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "act": "none"}, {"x": S.of((4, 4)), "w": S.of((4, 4))}))
    r = rule_of("dp_Linear_bias", op("Linear", "x", "w", "b", activation="$act"),
                _comb(op("Linear", _part("x", "$d"), _rep("w"), _rep("b"), activation="$act"), "$d"),
                {**D, "act": "attr"}, [["$d", "<=", -2]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "act": "relu"},
                               {"x": S.of((4, 4)), "w": S.of((4, 4)), "b": S.of((4,))}))
    r = rule_of("dp_MatMul", op("MatMul", "x", "y"), _comb(op("MatMul", _part("x", "$d"), _rep("y")), "$d"), D,
                [["$d", "<=", -2]])
    rules.append(_with_example(r, {"k": 2, "d": -2}, {"x": S.of((4, 4)), "y": S.of((4, 4))}))
    r = rule_of("dp_BatchMatMul", op("BatchMatMul", "x", "y"),
                _comb(op("BatchMatMul", _part("x", "$d"), _part("y", "$d")), "$d"), D, [["$d", "<=", -3]])
    rules.append(_with_example(r, {"k": 2, "d": -3}, {"x": S.of((2, 4, 4)), "y": S.of((2, 4, 4))}))
    # --- data parallelism, the rest (sample dim = dim 0) -----------------------------------------------------
    for o, (pa, ex, shapes, vk, ints, cons, V) in SAMPLE_OPS.items():
        names = list(shapes)
        args = [_part(names[0], 0)] + [_rep(n) for n in names[1:]]
        r = rule_of(f"dp_{o}", op(o, *names, **pa), _comb(op(o, *args, **pa), 0), V, cons, inputs=names)
        rules.append(_with_example(r, {**ex, "k": 2}, shapes, ints, vk))
    # the import-coverage operators (issue 10; variants with a broadcast operand replicated)
    for name, sr in SAMPLE_RULES.items():
        names = list(sr.shapes)
        args = [_part(n, 0) if p else _rep(n) for n, p in zip(names, sr.parts)]
        r = rule_of(name, op(sr.op, *names, **sr.attrs), _comb(op(sr.op, *args, **sr.attrs), 0), dict(sr.vars),
                    [list(c) for c in sr.cons], inputs=names)
        rules.append(_with_example(r, {**sr.example, "k": 2}, sr.shapes, sr.ints, sr.values))
    for p in TRANSPOSE_SAMPLE_PERMS:        # a permutation that keeps the sample dim first
        r = rule_of("dp_Transpose_" + "".join(map(str, p)), op("Transpose", "x", perm=p),
                    _comb(op("Transpose", _part("x", 0), perm=p), 0), K)
        rules.append(_with_example(r, {"k": 2}, {"x": S.of((2,) + tuple(range(2, len(p) + 1)))}))
    r = rule_of("dp_Softmax", op("Softmax", "x", axis="$a"), _comb(op("Softmax", _part("x", "$d"), axis="$a"), "$d"),
                {**D, "a": "dim"}, [["$d", "!=", "$a"]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "a": -1}, x44))
    r = rule_of("dp_LayerNorm", op("LayerNorm", "x", "g", "b", axis="$a", eps="$e"),
                _comb(op("LayerNorm", _part("x", "$d"), _rep("g"), _rep("b"), axis="$a", eps="$e"), "$d"),
                {**D, "a": "dim", "e": "attr"}, [["$d", "<", "$a"]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "a": -1, "e": 1e-5},
                               {"x": S.of((4, 4)), "g": S.of((4,)), "b": S.of((4,))}))
    r = rule_of("dp_Concat", op("Concat", "x", "y", axis="$a"),
                _comb(op("Concat", _part("x", "$d"), _part("y", "$d"), axis="$a"), "$d"),
                {**D, "a": "dim"}, [["$d", "!=", "$a"]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "a": -1}, {"x": S.of((4, 2)), "y": S.of((4, 2))}))
    for n in CONCAT_ARITIES:              # Concats of 3..32 inputs (axioms Concat<n>_partition)
        xs = concat_names(n)
        r = rule_of(f"dp_Concat_{n}", op("Concat", *xs, axis="$a"),
                    _comb(op("Concat", *[_part(x, "$d") for x in xs], axis="$a"), "$d"),
                    {**D, "a": "dim"}, [["$d", "!=", "$a"]], inputs=xs)
        rules.append(_with_example(r, {"k": 2, "d": -2, "a": -1}, {x: S.of((4, 1 + i % 3)) for i, x in enumerate(xs)}))
    sp = op("Split", "x", axis="$a", sizes="$s")
    spp = op("Split", _part("x", "$d"), axis="$a", sizes="$s")
    r = rule_of("dp_Split", (sp[0], sp[1]), (_comb(spp[0], "$d"), _comb(spp[1], "$d")),
                {**D, "a": "dim", "s": "attr"}, [["$d", "!=", "$a"]])
    rules.append(_with_example(r, {"k": 2, "d": -2, "a": -1, "s": (1, 3)}, x44))

    # --- Megatron-LM (Fig. 10) -----------------------------------------------------------------------------
    r = rule_of("megatron_attention_heads", op("BatchMatMul", "x", "y"),
                _comb(op("BatchMatMul", _part("x", "$d"), _part("y", "$d")), "$d"), D, [["$d", "<=", -3]])
    rules.append(_with_example(r, {"k": 2, "d": -3}, {"x": S.of((2, 4, 4, 4)), "y": S.of((2, 4, 4, 4))}))
    r = rule_of("megatron_column_linear", op("Linear", "x", "w", activation="$act"),
                _comb(op("Linear", _rep("x"), _part("w", -1), activation="$act"), -1), {**K, "act": "attr"})
    rules.append(_with_example(r, {"k": 2, "act": "relu"}, {"x": S.of((4, 4)), "w": S.of((4, 4))}))
    r = rule_of("megatron_row_linear", op("Linear", "x", "w"),
                op("Reduce", op("Linear", _part("x", -1), _part("w", -2)), degree="$k"), K)
    rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "w": S.of((4, 4))}))
    r = rule_of("megatron_mlp_column_row", op("Linear", op("Linear", "x", "w1", activation="$act"), "w2"),
                op("Reduce", op("Linear", op("Linear", _rep("x"), _part("w1", -1), activation="$act"), _part("w2", -2)),
                   degree="$k"), {**K, "act": "attr"})
    rules.append(_with_example(r, {"k": 2, "act": "relu"},
                               {"x": S.of((4, 4)), "w1": S.of((4, 8)), "w2": S.of((8, 4))}))
    r = rule_of("megatron_mlp_column_row_allreduce", op("Replicate", op("Linear", op("Linear", "x", "w1", activation="$act"), "w2"), degree="$k"),
                op("AllReduce", op("Linear", op("Linear", _rep("x"), _part("w1", -1), activation="$act"),
                                   _part("w2", -2)), degree="$k"), {**K, "act": "attr"})
    rules.append(_with_example(r, {"k": 2, "act": "relu"},
                               {"x": S.of((4, 4)), "w1": S.of((4, 8)), "w2": S.of((8, 4))}))

    # attention heads (Fig. 10): Q/K/V column-parallel (each device computes heads/k heads: the hidden-dim
    # Partition of the projections moves through the head split onto the heads dim), the attention per head
    # on its device, the output projection row-parallel, one Reduce.  As exported: x @ Wq|Wk|Wv, Reshape to
    # (b, s, heads, d), Transpose 0213 (K: 0231), BatchMatMul, Scale, Softmax, BatchMatMul, Transpose 0213,
    # Reshape to (b, s, hidden), @ Wo.  Proved from its named axiom subset (AXIOM_SUBSETS)
    r = rule_of("megatron_attention_block", _attention("x", "wq", "wk", "wv", "wo"),
                op("Reduce", _attention(_rep("x"), _part("wq", -1), _part("wk", -1), _part("wv", -1),
                                        _part("wo", -2)), degree="$k"),
                {**K, "sh": "attr", "sm": "attr", "f": "attr"})
    rules.append(_with_example(_with_subset(r), {"k": 2, "sh": (2, 3, 4, 2), "sm": (2, 3, 8), "f": 0.5},
                               {"x": S.of((2, 3, 8)), **{w: S.of((8, 8)) for w in ("wq", "wk", "wv", "wo")}}))
    # Embedding tables split by columns (the feature dim; DLRM's tables, issue 7): the indices replicated,
    # each device looks up its columns, the Combine gathers the features.  The bag variant sums the bag
    # first (ReduceSum over a dim before the features), so only the pooled vectors are gathered; it comes
    # first (a seed applying templates in cache order must split a bag's table with it, not the plain one)
    bag = lambda i, t: op("ReduceSum", op("Embedding", i, t), axes=("$a",), keepdims="$kd")  # noqa: E731
    r = rule_of("megatron_embedding_bag_column", bag("i", "t"), _comb(bag(_rep("i"), _part("t", -1)), -1),
                {**K, "a": "dim", "kd": "attr"}, [["$a", "<=", -2]])
    rules.append(_with_example(r, {"k": 2, "a": -2, "kd": False},
                               {"i": S.of((4, 3), dtype="int64"), "t": S.of((6, 4))}, ints=("i",)))
    r = rule_of("megatron_embedding_column", op("Embedding", "i", "t"),
                _comb(op("Embedding", _rep("i"), _part("t", -1)), -1), K)
    rules.append(_with_example(r, {"k": 2}, {"i": S.of((4, 3), dtype="int64"), "t": S.of((6, 4))}, ints=("i",)))
    # computing on copies: a Replicate lifted above a lookup whose operands are copied too (BERT's position and
    # token-type Embeddings over a constant [1, S] index have no batch dim to partition: data parallelism runs
    # them on every device, as the hand-built baseline does; proven from the Embedding_replicate axiom)
    r = rule_of("replicate_lift_Embedding", _rep(op("Embedding", "i", "t")), op("Embedding", _rep("i"), _rep("t")), K)
    rules.append(_with_example(r, {"k": 2}, {"i": S.of((1, 3), dtype="int64"), "t": S.of((5, 4))}, ints=("i",)))
    # the same for the operators between Megatron's groups (search.realize lifts the
    # Replicate of a group's input up the residual stream, so they run on the tensor-parallel copies as in
    # Megatron-LM, and a Reduce meets its Replicate: one AllReduce)
    r = rule_of("replicate_lift_Add", _rep(op("Add", "x", "y")), op("Add", _rep("x"), _rep("y")), K)
    rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "y": S.of((4, 4))}))
    r = rule_of("replicate_lift_LayerNorm", _rep(op("LayerNorm", "x", "g", "b", axis="$a", eps="$e")),
                op("LayerNorm", _rep("x"), _rep("g"), _rep("b"), axis="$a", eps="$e"),
                {**K, "a": "dim", "e": "attr"})
    rules.append(_with_example(r, {"k": 2, "a": -1, "e": 1e-5},
                               {"x": S.of((4, 4)), "g": S.of((4,)), "b": S.of((4,))}))
    # the views a head reads the residual stream through (BERT's pooler: Slice of the first token, Reshape), so
    # that a column-parallel head's Replicate lifts up to the residual stream (proven from <View>_replicate)
    for v, (pa, ex, shapes) in VIEW_REPLICATE.items():
        V = {**K, **{x[1:]: "attr" for x in pa.values()}}
        r = rule_of(f"replicate_lift_{v}", _rep(op(v, "x", **pa)), op(v, _rep("x"), **pa), V)
        rules.append(_with_example(r, {**ex, "k": 2}, shapes))
    # a join of branches on the copies (proven from Concat_replicate / Concat<n>_replicate): the Replicate before the
    # layers after a join lifts into every branch (CANDLE-Uno's feature towers on the tensor-parallel copies)
    for n in (2,) + tuple(CONCAT_ARITIES):
        xs = concat_names(n)
        name = "replicate_lift_Concat" if n == 2 else f"replicate_lift_Concat_{n}"
        r = rule_of(name, _rep(op("Concat", *xs, axis="$a")), op("Concat", *[_rep(x) for x in xs], axis="$a"),
                    {**K, "a": "dim"})
        rules.append(_with_example(r, {"k": 2, "a": -1}, {x: S.of((4, 1 + i % 3)) for i, x in enumerate(xs)}))
    # a model head whose Linear carries its bias (BERT's pooler): column-parallel, the bias split with its columns
    r = rule_of("megatron_column_linear_bias", op("Linear", "x", "w", "b", activation="$act"),
                _comb(op("Linear", _rep("x"), _part("w", -1), _part("b", -1), activation="$act"), -1),
                {**K, "act": "attr"})
    rules.append(_with_example(r, {"k": 2, "act": "none"}, {"x": S.of((4, 4)), "w": S.of((4, 4)), "b": S.of((4,))}))
    # an element-wise activation after a column-parallel head runs on the column pieces: the Combine moves to
    # the model output, where it is trimmed (proven from <U>_combine)
    for u, (pa, ex, vk, _) in UNARY.items():
        V = {**K, "d": "dim", **{x[1:]: "attr" for x in pa.values()}}
        r = rule_of(f"combine_sink_{u}", op(u, _comb("x", "$d"), **pa), _comb(op(u, "x", **pa), "$d"), V)
        rules.append(_with_example(r, {**ex, "k": 2, "d": -1}, {"x": S.of((4, 4), (1, 2))}, values=vk))
    # the MLP with an element-wise activation between the two Linears (as exported: Linear -> Gelu -> Linear)
    for u in ("Gelu", "Relu"):
        r = rule_of(f"megatron_mlp_column_{u.lower()}_row", op("Linear", op(u, op("Linear", "x", "w1")), "w2"),
                    op("Reduce", op("Linear", op(u, op("Linear", _rep("x"), _part("w1", -1))), _part("w2", -2)),
                       degree="$k"), K)
        rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "w1": S.of((4, 8)), "w2": S.of((8, 4))}))
    # the same with biases as BERT exports them (Add(bias, Linear(x, w))): the column-parallel bias split with its
    # columns, the row-parallel one added after the Reduce
    for u in ("Gelu", "Relu"):
        src = op("Add", "b2", op("Linear", op(u, op("Add", "b1", op("Linear", "x", "w1"))), "w2"))
        tgt = op("Add", "b2", op("Reduce", op("Linear", op(u, op("Add", _part("b1", -1), op("Linear", _rep("x"),
                                                                                               _part("w1", -1)))),
                                                       _part("w2", -2)), degree="$k"))
        r = rule_of(f"megatron_mlp_column_{u.lower()}_row_bias", src, tgt, K)
        rules.append(_with_example(_with_subset(r), {"k": 2},
                                   {"x": S.of((2, 4)), "w1": S.of((4, 8)), "b1": S.of((8,)), "w2": S.of((8, 4)),
                                    "b2": S.of((4,))}))
    r = rule_of("megatron_attention_block_bias", _attention("x", "wq", "wk", "wv", "wo", ("bq", "bk", "bv", "bo")),
                op("Add", "bo", op("Reduce", _attention(_rep("x"), _part("wq", -1), _part("wk", -1), _part("wv", -1),
                                                        _part("wo", -2), (_part("bq", -1), _part("bk", -1),
                                                                          _part("bv", -1), None)), degree="$k")),
                {**K, "sh": "attr", "sm": "attr", "f": "attr"})
    rules.append(_with_example(_with_subset(r), {"k": 2, "sh": (2, 3, 4, 2), "sm": (2, 3, 8), "f": 0.5},
                               {"x": S.of((2, 3, 8)), **{w: S.of((8, 8)) for w in ("wq", "wk", "wv", "wo")},
                                **{b: S.of((8,)) for b in ("bq", "bk", "bv", "bo")}}))
    # GPT's attention (issue 7 point 1: Megatron inside pipeline stages): the same with the causal mask added to the
    # scores, the mask replicated to every head's device
    r = rule_of("megatron_attention_block_bias_mask",
                _attention("x", "wq", "wk", "wv", "wo", ("bq", "bk", "bv", "bo"), "m"),
                op("Add", "bo", op("Reduce", _attention(_rep("x"), _part("wq", -1), _part("wk", -1), _part("wv", -1),
                                                        _part("wo", -2), (_part("bq", -1), _part("bk", -1),
                                                                          _part("bv", -1), None), _rep("m")),
                                   degree="$k")),
                {**K, "sh": "attr", "sm": "attr", "f": "attr"})
    rules.append(_with_example(_with_subset(r), {"k": 2, "sh": (2, 3, 4, 2), "sm": (2, 3, 8), "f": 0.5},
                               {"x": S.of((2, 3, 8)), **{w: S.of((8, 8)) for w in ("wq", "wk", "wv", "wo")},
                                **{b: S.of((8,)) for b in ("bq", "bk", "bv", "bo")}, "m": S.of((3, 3))}))
    # --- Figure 11 -------------------------------------------------------------------------------------------
    r = rule_of("fig11a_relu_spatial", op("Relu", "x"), _comb(op("Relu", _part("x", "$d")), "$d"), D)
    rules.append(_with_example(r, {"k": 2, "d": -1}, {"x": S.of((2, 2, 4, 4))}))
    rs = lambda t: op("ReduceSum", t, axes=("$a",), keepdims=True)  # noqa: E731
    r = rule_of("fig11b_add_concat_reduce", op("Add", rs("x"), rs("y")),
                op("Reduce", rs(_part(op("Concat", "x", "y", axis="$a"), "$a", 2)), degree=2), {"a": "dim"})
    rules.append(_with_example(r, {"a": -2}, {"x": S.of((1, 4)), "y": S.of((1, 4))}))

    # --- Figure 2: reduction parallelism -----------------------------------------------------------------------
    r = rule_of("fig2_matmul_reduction", op("MatMul", "x", "y"),
                op("Reduce", op("MatMul", _part("x", -1), _part("y", -2)), degree="$k"), K)
    rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "y": S.of((4, 4))}))

    # --- fusion -----------------------------------------------------------------------------------------------
    r = rule_of("linear_relu_fusion", op("Relu", op("Linear", "x", "w")), op("Linear", "x", "w", activation="relu"))
    rules.append(_with_example(r, {}, {"x": S.of((4, 4)), "w": S.of((4, 4))}))
    rules.append(_with_example(r.reversed().with_name("linear_relu_unfusion"), {},
                               {"x": S.of((4, 4)), "w": S.of((4, 4))}))
    r = rule_of("linear_bias_relu_fusion", op("Relu", op("Linear", "x", "w", "b")),
                op("Linear", "x", "w", "b", activation="relu"))
    shapes = {"x": S.of((4, 4)), "w": S.of((4, 4)), "b": S.of((4,))}
    rules.append(_with_example(r, {}, shapes))
    rules.append(_with_example(r.reversed().with_name("linear_bias_relu_unfusion"), {}, shapes))

    # --- Reduce + Replicate as one AllReduce -----------------------------------------------------------------------
    r = rule_of("reduce_replicate_allreduce", op("Replicate", op("Reduce", "x", degree="$k"), degree="$k"),
                op("AllReduce", "x", degree="$k"), K)
    ex = {"x": S.of((4, 4), sum_degree=2)}
    rules.append(_with_example(r, {"k": 2}, ex))
    rules.append(_with_example(r.reversed().with_name("allreduce_split"), {"k": 2}, ex))

    # --- copies of copies are copies: one Replicate of the product degree -----------------------------------------
    r = rule_of("replicate_merge", _rep(_rep("x", "$k"), "$j"), _rep("x", "$m"),
                {"k": "degree", "j": "degree", "m": "degree"}, [("$m", "==", ("*", "$k", "$j"))])
    rules.append(_with_example(r, {"k": 2, "j": 2, "m": 4}, x44))

    # --- a gather moves past a sum or a copy (they change other degrees): a Combine left between a data-parallel
    # row-parallel Linear and its AllReduce sinks to the next pair's Partition and cancels ---------------------------
    DKJ = {"d": "dim", "k": "degree", "j": "degree"}
    for p in ("Reduce", "Replicate", "AllReduce"):
        r = rule_of(f"combine_sink_{p}", op(p, _comb("x", "$d"), degree="$j"), _comb(op(p, "x", degree="$j"), "$d"),
                    DKJ)
        rules.append(_with_example(r, {"k": 2, "j": 2, "d": -2},
                                   {"x": S.of((4, 4), (2, 1), sum_degree=1 if p == "Replicate" else 2)}))
    # a gather moves past a gather of another dim (any two degrees): an ILP layout splits the batch over one mesh
    # axis and a feature dim over the other; the rules' data-parallel step gathers the batch before the feature
    # gather, the next operator's Partition of the batch undoes it: sunk past the feature gather, the pair cancels
    r = rule_of("combine_sink_Combine", _comb(_comb("x", "$d"), "$e", "$j"), _comb(_comb("x", "$e", "$j"), "$d"),
                {**DKJ, "e": "dim"}, [("$d", "!=", "$e")])
    rules.append(_with_example(r, {"k": 2, "j": 2, "d": -2, "e": -1}, {"x": S.of((4, 4), (2, 2))}))
    # and past a split of another dim (a row-parallel Linear's reduce-scatter on the features, the batch gathered
    # before it by the data-parallel step and split again after it)
    r = rule_of("combine_sink_Partition", _part(_comb("x", "$d"), "$e", "$j"), _comb(_part("x", "$e", "$j"), "$d"),
                {**DKJ, "e": "dim"}, [("$d", "!=", "$e")])
    rules.append(_with_example(r, {"k": 2, "j": 2, "d": -2, "e": -1}, {"x": S.of((4, 4), (2, 1))}))
    # a tensor copied, then split, is split, then copied (the degrees may differ: a weight of a stage data parallel
    # j x tensor parallel k, as Megatron-LM's layout writes it)
    r = rule_of("partition_replicate_commute", _part(_rep("x", "$j"), "$d"), _rep(_part("x", "$d"), "$j"), DKJ)
    rules.append(_with_example(r, {"k": 2, "j": 2, "d": -1}, x44))

    # --- cancelling a Combine/Partition pair (the search builds data parallelism op by op with dp_<Op>
    # and removes the Combine -> Partition pairs left between neighbours) ---------------------------------------
    r = rule_of("partition_combine_cancel", _part(_comb("x", "$d"), "$d"), "x", D)
    rules.append(_with_example(r, {"k": 2, "d": -2}, {"x": S.of((4, 4), (2, 1))}))
    r = rule_of("combine_partition_cancel", _comb(_part("x", "$d"), "$d"), "x", D)
    rules.append(_with_example(r, {"k": 2, "d": -2}, x44))
    # the same where the gather has other readers too (a residual stream read by the next layer whole and by
    # the residual Add split): the reader that splits it again reads the pieces; the others keep the gather
    c = _comb("x", "$d")
    r = rule_of("partition_combine_cancel_shared", (c, _part(c, "$d")), (c, "x"), D)
    rules.append(_with_example(r, {"k": 2, "d": -2}, {"x": S.of((4, 4), (2, 1))}))
    # two identical parallel operators on one tensor (left where several consumers were parallelized
    # one by one) become one: its output feeds both
    for o, at in (("Partition", (("degree", "$k"), ("dim", "$d"))), ("Replicate", (("degree", "$k"),))):
        two = Pattern((PatNode(o, at, ("x",)), PatNode(o, at, ("x",))), ((0, 0), (1, 0)))
        one = Pattern((PatNode(o, at, ("x",)),), ((0, 0), (0, 0)))
        V = D if o == "Partition" else K
        r = Rule(f"{o.lower()}_cse", ("x",), two, one, tuple(sorted(V.items())))
        r.validate()
        rules.append(_with_example(r, {"k": 2, "d": -2} if o == "Partition" else {"k": 2}, x44))
    rules += tensor_parallel_rules()
    return [r.with_name(r.name, origin="template") for r in rules]


#: the element-wise operators ``tensor_parallel_rules`` covers: every unary and binary one the axioms know
#: (``verifier.axioms.UNARY``/``BINARY``: one loop, no list of names)
def tensor_parallel_rules() -> list[Rule]:
    """Single-operator tensor parallelism on any dim (issue 18): what a layout -> rule sequence step needs to lay
    out a Llama decoder as Megatron-LM does (heads split, SwiGLU column/row, residual stream on copies), an ILP
    plan's layouts, or any other, one operator at a time.  Every rule has one compute operator on each side.

    * ``split_<Op>``: ``op(x..) -> Combine(op(Partition(x, d)..), d)`` for a free dim ``d`` (counted from the end)
      and degree: every element-wise unary operator (Relu: ``fig11a_relu_spatial``), every binary one with both
      operands partitioned or, ``_pr``/``_rp``, one broadcast operand replicated (rotary tables, masks), Slice on
      another dim, Expand of a dim it does not broadcast, RMSNorm over later dims (``_scale``: with its weight);
    * ``combine_sink_<Transpose|Reshape>``: ``op(Combine(x, d)) -> Combine(op(x), e)``, the op run on the
      pieces, and ``partition_lift_<Transpose|Reshape>``: ``Partition(op(x), e) -> op(Partition(x, d))``: the
      partition moves to the permuted dim or to the outermost dim of the Reshape's group (the heads split);
      the landing dim is free, chosen at application, where shape inference refuses every other choice;
    * ``replicate_lift_<Op>`` for every element-wise operator and RMSNorm (``_scale``): the operators between
      Megatron's groups on the tensor-parallel copies (``replicate_lift_Add`` is written above);
    * the channel parallelism of convolutional networks, :func:`conv_channel_rules`."""
    rules: list[Rule] = []
    D = {**K, "d": "dim"}
    for u, (pa, ex, vk, _) in UNARY.items():
        V = {**D, **{v[1:]: "attr" for v in pa.values()}}
        if u != "Relu":       # fig11a_relu_spatial is this rule
            r = rule_of(f"split_{u}", op(u, "x", **pa), _comb(op(u, _part("x", "$d"), **pa), "$d"), V)
            rules.append(_with_example(r, {**ex, "k": 2, "d": -1}, {"x": S.of((4, 4))}, values=vk))
        r = rule_of(f"replicate_lift_{u}", _rep(op(u, "x", **pa)), op(u, _rep("x"), **pa),
                    {**K, **{v[1:]: "attr" for v in pa.values()}})
        rules.append(_with_example(r, {**ex, "k": 2}, {"x": S.of((4, 4))}, values=vk))
    for b, (_, vk) in BINARY.items():
        r = rule_of(f"split_{b}", op(b, "x", "y"), _comb(op(b, _part("x", "$d"), _part("y", "$d")), "$d"), D)
        rules.append(_with_example(r, {"k": 2, "d": -1}, {"x": S.of((4, 4)), "y": S.of((4, 4))}, values=vk))
        r = rule_of(f"split_{b}_pr", op(b, "x", "y"), _comb(op(b, _part("x", "$d"), _rep("y")), "$d"), D)
        rules.append(_with_example(r, {"k": 2, "d": -3}, {"x": S.of((4, 2, 3)), "y": S.of((2, 3))}, values=vk))
        if b != "PRelu":
            r = rule_of(f"split_{b}_rp", op(b, "x", "y"), _comb(op(b, _rep("x"), _part("y", "$d")), "$d"), D)
            rules.append(_with_example(r, {"k": 2, "d": -3}, {"x": S.of((2, 3)), "y": S.of((4, 2, 3))}, values=vk))
        if b != "Add":
            r = rule_of(f"replicate_lift_{b}", _rep(op(b, "x", "y")), op(b, _rep("x"), _rep("y")), K)
            rules.append(_with_example(r, {"k": 2}, {"x": S.of((4, 4)), "y": S.of((4, 4))}, values=vk))
    for name, (pa, ex, shapes) in SPLIT_VIEWS.items():
        o = name.split("_")[0]
        ns = list(shapes)
        args = [_part(ns[0], "$d")] + [_rep(n) for n in ns[1:]]
        r = rule_of(f"split_{name}", op(o, *ns, **pa), _comb(op(o, *args, **pa), "$d"),
                    {**D, **{v[1:]: "attr" for v in pa.values()}}, inputs=ns)
        rules.append(_with_example(r, {**ex, "k": 2}, shapes))
    for o, (pa, ex, sz) in VIEW_MOVES.items():
        V = {**D, "e": "dim", **{v[1:]: "attr" for v in pa.values()}}
        degs = tuple(2 if j == ex["d"] + len(sz) else 1 for j in range(len(sz)))
        r = rule_of(f"combine_sink_{o}", op(o, _comb("x", "$d"), **pa), _comb(op(o, "x", **pa), "$e"), V)
        rules.append(_with_example(r, {**ex, "k": 2}, {"x": S.of(sz, degs)}))
        r = rule_of(f"partition_lift_{o}", _part(op(o, "x", **pa), "$e"), op(o, _part("x", "$d"), **pa), V)
        rules.append(_with_example(r, {**ex, "k": 2}, {"x": S.of(sz)}))
    for name, shapes in (("RMSNorm", {"x": S.of((2, 3))}), ("RMSNorm_scale", {"x": S.of((2, 3)), "s": S.of((3,))})):
        ns = list(shapes)
        r = rule_of(f"replicate_lift_{name}", _rep(op("RMSNorm", *ns, axis="$a", eps="$e")),
                    op("RMSNorm", *[_rep(n) for n in ns], axis="$a", eps="$e"), {**K, "a": "attr", "e": "attr"},
                    inputs=ns)
        rules.append(_with_example(r, {"k": 2, "a": -1, "e": 1e-6}, shapes))
    return rules + conv_channel_rules()


def conv_channel_rules() -> list[Rule]:
    """Channel parallelism of convolutional networks, one compute operator each side (issue 18: the label ILP's CNN
    layouts reached by rules; the specs are ``verifier.axioms.CONV_CHANNEL``, ``WINDOW_SPLIT``, ``CNN_REPLICATE``).

    * ``conv_<out_channels|in_channels|groups>[_bias]``: a Conv2d split on its output channels (input copied,
      weight dim 0 and bias split, output split on its channels), on its input channels (input and weight dim 1
      split, partial sums then ``Reduce``; no bias), or with its groups split with the channels (input dim 1,
      weight dim 0: grouped and depthwise convolutions);
    * ``split_<Conv2d|Conv2d_bias|Pool2d>``: the operator on any dim its labels allow, the weight copied (a free
      dim, chosen at application; shape inference refuses the others); ``split_BatchNorm_channels``: BatchNorm
      with its four per-channel parameters split with the channels;
    * ``replicate_lift_<Conv2d|Conv2d_bias|BatchNorm|Pool2d>``: the operator on copies."""
    rules: list[Rule] = []
    cv = {"k": "degree", "st": "attr", "pad": "attr", "dil": "attr", "g": "attr"}
    for name, (parts, out, ex, shapes) in CONV_CHANNEL.items():
        ns = list(shapes)
        inner = op("Conv2d", *[_rep(n) if d is None else _part(n, d) for n, d in zip(ns, parts)], **CONV_ATTRS)
        tgt = op("Reduce", inner, degree="$k") if out == "sum" else _comb(inner, out)
        r = rule_of(f"conv_{name}", op("Conv2d", *ns, **CONV_ATTRS), tgt, cv, inputs=ns)
        rules.append(_with_example(r, ex, shapes))
    for name, (pa, ex, shapes) in WINDOW_SPLIT.items():
        o = name.split("_")[0]
        ns = list(shapes)
        V = {"k": "degree", "d": "dim", **{v[1:]: "attr" for v in pa.values()}}
        r = rule_of(f"split_{name}", op(o, *ns, **pa),
                    _comb(op(o, _part(ns[0], "$d"), *[_rep(n) for n in ns[1:]], **pa), "$d"), V, inputs=ns)
        rules.append(_with_example(r, ex, shapes))
    bn = ("x", "s", "b", "mu", "var")
    r = rule_of("split_BatchNorm_channels", op("BatchNorm", *bn, eps="$e", momentum="$m"),
                _comb(op("BatchNorm", _part("x", 1), *[_part(n, 0) for n in bn[1:]], eps="$e", momentum="$m"), 1),
                {"k": "degree", "e": "attr", "m": "attr"}, inputs=list(bn))
    rules.append(_with_example(r, {"k": 2, "e": 1e-5, "m": 0.9},
                               {"x": S.of((2, 4, 2, 2)), **{n: S.of((4,)) for n in bn[1:]}}, values="pos"))
    for name, (o, pa, ex, shapes, vk) in CNN_REPLICATE.items():
        ns = list(shapes)
        r = rule_of(f"replicate_lift_{name}", _rep(op(o, *ns, **pa)), op(o, *[_rep(n) for n in ns], **pa),
                    {"k": "degree", **{v[1:]: "attr" for v in pa.values()}}, inputs=ns)
        rules.append(_with_example(r, ex, shapes, values=vk))
    return rules


NAMED = ("fig2_matmul_reduction", "fig11a_relu_spatial", "fig11b_add_concat_reduce", "megatron_attention_heads",
         "megatron_column_linear", "megatron_row_linear", "megatron_mlp_column_row", "linear_relu_fusion",
         "linear_relu_unfusion", "reduce_replicate_allreduce")


def example_of(r: Rule) -> dict[str, Any] | None:
    if not r.example:
        return None
    ex = json.loads(r.example)
    ex["shapes"] = {n: S.from_json(s) for n, s in ex["shapes"].items()}
    ex["bind"] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in ex["bind"].items()}
    return ex
