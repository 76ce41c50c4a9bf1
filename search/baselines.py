"""Fixed parallelizations of a (logical) PCG: the baselines the search is compared with.

* ``none``: the model on one device -- the logical PCG itself (every degree 1).
* ``dp`` (data parallelism, degree d): every model input is partitioned d ways on its first dim (the
  batch), every weight is replicated d times (the cost model charges the gradient all-reduce this
  implies) and shape inference carries the batch partition through the graph.  Graph outputs stay
  partitioned: the loss is computed where each piece of the output lives (as torch DDP does), so
  nothing is gathered.
* ``megatron`` (Megatron-LM, Shoeybi et al.): tensor parallelism of degree t inside a node, data
  parallelism of degree d/t across nodes.  Column-parallel Linears (weight split on its output
  features) feed row-parallel Linears (weight split on its input features, partial sums all-reduced):
  the MLP's two matrices, and in attention the Q/K/V projections (their output features are the
  heads, so the attention heads split with them) feeding the output projection.  Everything else
  is data parallel over d/t with t copies.  Transformers only.  Found by structure, not names: grouped-
  query attention splits by key-value groups (t must divide every head count, read off the Reshapes by
  :func:`head_counts`; the repeat of each K/V head then stays on the rank of its query heads), a gated
  MLP's two projections (any element-wise operator on one of them, multiplied) are both column-parallel
  into one row-parallel down projection, norms and rotary tables (element-wise on the split heads)
  run on the t copies, and attention masks and rotary tables read from outside a block are broadcast.
  The layout is built on :func:`megatron_graph`, exact rewrites of the model: a fused Q/K/V projection (one
  Linear whose output is Split on its features, GPT-2's ``c_attn``) becomes one Linear per piece on a Slice
  of the one weight, so each of Q, K and V splits by heads as Megatron-LM splits them; a row Linear's fused
  bias moves to an Add after the all-reduce.  A model it does not apply to gets one line saying why (no
  matmul of two activations; a fused projection whose Split the rewrite cannot reach; head counts no
  tensor degree divides).
  ``sequence_parallel=True`` (Megatron-LM's sequence parallelism, Korthikanti et al. 2022): the operators
  outside the groups (the residual stream: norms, dropout, residual adds, the embedding and what follows
  the last group) run on t sequence shards instead of t copies -- model inputs are split on dim 1 (the
  sequence) t ways, a group's partial sums are reduce-scattered onto the sequence (Reduce then Partition,
  one collective) instead of all-reduced, and a group's inputs from outside are all-gathered (Combine then
  Replicate, one collective per tensor) where the column Linears read them.  Tensors whose dim 1 does not
  divide by t keep the copies.
* ``expert`` (the expert-designed strategy of Unity §6.1 / FlexFlow's DLRM example, [38]):
  communication-intensive operators in model parallelism, compute-intensive ones in data
  parallelism.  Embedding tables are communication-intensive: each table lives whole on one device,
  table i on device i mod d (as FlexFlow's dlrm_strategy; pinned in ``meta["pinned"]`` with the
  one-task operators that feed it its indices or pool its lookups, see :func:`pinned_views`); its
  lookup reads the whole batch of indices, and the looked-up vectors are scattered to the
  data-parallel layout where they meet dense operators.  (The machine-mapping DP prices the tables'
  branches one after the other: each ends in a scatter over every device, so no split of the
  devices runs them side by side -- pessimistic for many tables on many devices.)  A dense Linear is communication-intensive
  when its weight has more elements than the activations it reads and writes in one iteration
  (``k*n > B*(k+n)`` at global batch B: synchronizing its gradient would move more than moving its
  activations); it is split on its output features m ways (the largest divisor of d dividing them) and
  data parallel d/m ways (its input copied m times).  At a scale where nothing is communication-intensive
  the strategy is data parallelism.  Models with convolutions or attention (a softmax) raise
  :class:`StrategyError`.

All of them are built by one propagation (:class:`_Rebuild`): model inputs take the strategy's
layout, every compute operator keeps the parallel shapes its inputs arrive with, and each weight
takes the parallel shape the operator's labels imply for those inputs (a weight shares the degree of
every label it has; its copy degree covers the task axes it lacks).  Partial sums (a row-parallel
Linear's output) are all-reduced at once.  Where an operator refuses its inputs as they are, they are
first brought to the strategy's layout, and failing that combined into one piece (a gather): it runs
unpartitioned (``fallbacks`` in the PCG's ``meta`` lists these operators) and its outputs go back to
the strategy's layout.  The strategy's structural choices (which Linears are column-parallel, which
embeddings model-parallel) are found by graph pattern, not by node names.
"""
from __future__ import annotations

from math import gcd, prod
from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization, ShapeError, UnityError
from unity_pcg.pcg import PCG, Ref

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class StrategyError(UnityError, ValueError):
    """A fixed parallelization that cannot be built for this model (e.g. batch not divisible)."""


STRATEGIES = ("none", "dp", "megatron", "expert")


class GraphMemo:
    """Results of pure functions of an (immutable) PCG, kept per graph by identity for the ``kept`` graphs
    asked about most recently: the tuned grids, the floors, the pipeline's stage hooks and the fallbacks
    build the same layouts of the same graphs again.  :meth:`get` returns ``build()``'s result for
    ``(g, key)``, built once; an exception of ``errors`` it raised is raised again."""

    def __init__(self, kept: int, errors: tuple = (StrategyError,)):
        self.kept = kept
        self.errors = errors
        self._graphs: list = []           # [(graph, {key: result or _Refused})], most recent first
        self.hits = 0

    def get(self, g: PCG, key, build):
        gs = self._graphs
        for i, (h, d) in enumerate(gs):
            if h is g:
                if i:
                    gs.insert(0, gs.pop(i))
                break
        else:
            d = {}
            gs.insert(0, (g, d))
            del gs[self.kept:]
        hit = d.get(key, _MISSING)
        if hit is _MISSING:
            try:
                hit = build()
            except self.errors as e:
                hit = _Refused(e)
            d[key] = hit
        else:
            self.hits += 1
        if isinstance(hit, _Refused):
            raise hit.error.with_traceback(None)
        return hit

    def clear(self) -> None:
        self._graphs.clear()


class _Refused:
    def __init__(self, error: Exception):
        self.error = error


_MISSING = object()
#: memo of :meth:`_Rebuild._weight_targets` (a pure function of its key; results are read, never changed)
_TARGETS: dict = {}
#: the fixed layouts of the graphs asked about last (``megatron``, ``data_parallel``; the pipeline's stage
#: hooks keep theirs in their own, :data:`search.pipeline.STAGE_MEMO`)
LAYOUT_MEMO = GraphMemo(8)


def build_strategy(g: PCG, strategy: str, degree: int = 1, *, devices_per_node: int | None = None) -> PCG:
    """The PCG of fixed strategy ``strategy`` over ``degree`` devices.  ``devices_per_node`` bounds
    Megatron's tensor-parallel degree (default: all ``degree`` devices form one node)."""
    if strategy == "none":
        return none(g)
    if strategy == "dp":
        return data_parallel(g, degree)
    if strategy == "megatron":
        return megatron(g, degree, devices_per_node)
    if strategy == "expert":
        return expert(g, degree)
    raise StrategyError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")


def none(g: PCG) -> PCG:
    _check_logical(g, "none")
    return g


def _check_logical(g: PCG, strategy: str) -> None:
    for n in g.nodes():
        if n.kind == "parallel":
            raise StrategyError(f"strategy {strategy!r} needs a logical PCG; node {n.label()} is a {n.op}")


def _check_degree(degree) -> None:
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise StrategyError(f"parallel degree must be a positive integer, got {degree!r}")


def data_parallel(g: PCG, degree: int, combine_outputs: bool = False) -> PCG:
    """Data-parallel PCG of degree ``degree`` (see module docstring).  ``combine_outputs=True``
    gathers every output into one piece (what a caller that needs whole outputs on one device
    pays; training does not)."""
    _check_degree(degree)
    _check_logical(g, "dp")
    if degree == 1:
        return g
    return LAYOUT_MEMO.get(g, ("dp", degree, bool(combine_outputs)), lambda: _Rebuild(g, "dp", dp=degree).finish(
        combine_outputs=combine_outputs, degree=degree))


# --- Megatron-LM ------------------------------------------------------------------------------------

class _Group:
    """Column-parallel Linears (``starts``) whose outputs reach row-parallel Linears (``terms``)
    through the operators in ``nodes`` only."""

    def __init__(self, starts, nodes, terms):
        self.starts, self.nodes, self.terms = set(starts), set(nodes), set(terms)

    def attention(self, g: PCG) -> bool:
        """Whether two activations meet in a matmul inside the group (scores = Q K^T: attention)."""
        return any(g.node(i).op in ("BatchMatMul", "MatMul") for i in self.nodes)


def _is_dense(g: PCG, n, wl: set) -> bool:
    """A Linear whose activation input is not weight-derived and whose weight is a trainable 2-D Weight
    (or a Slice of one: a piece of a fused projection, see :func:`split_fused_linears`)."""
    if n.op != "Linear" or n.inputs[0][0] in wl:
        return False
    w = g.node(n.inputs[1][0])
    if w.op == "Slice":
        w = g.node(w.inputs[0][0])
    return w.op == "Weight" and g.shape(n.inputs[1]).dtype in FLOAT_DTYPES


def _fused_chain(g: PCG, n, wl: set):
    """(steps, split) when the output of Linear ``n`` reaches a Split on its feature (last) axis through
    single-consumer steps that keep the features last: Reshapes that keep the last dim, Identity, and the
    Add of a weight-derived bias over the features; None otherwise."""
    nf = g.shapes(n.id)[0].sizes[-1]
    outs = {tuple(r) for r in g.outputs}
    ref, steps = (n.id, 0), []
    while len(steps) < 8:
        cons = g.consumers(ref)
        if ref in outs or len(cons) != 1:
            return None
        c = g.node(cons[0][0])
        sizes = g.shapes(c.id)[0].sizes if c.op != "Split" else ()
        if c.op == "Split":
            rank = g.shape(c.inputs[0]).rank
            if c.a.get("axis", 0) % rank != rank - 1 or len(g.shapes(c.id)) < 2:
                return None
            return steps, c
        if c.op == "Reshape":
            if not (sizes and sizes[-1] == nf and all(int(v) > 0 for v in c.a["shape"])):
                return None
        elif c.op == "Add" and len(c.inputs) == 2:
            other = c.inputs[1 - cons[0][1]]
            if other[0] not in wl or g.shape(other).sizes != (nf,) or sizes != g.shape(ref).sizes:
                return None
        elif c.op != "Identity":
            return None
        steps.append((c, cons[0][1]))
        ref = (c.id, 0)
    return None


def split_fused_linears(g: PCG) -> PCG:
    """Exact rewrite: a Linear ``y = x @ W (+ b)`` whose output is Split on its features (a fused Q/K/V
    projection, as GPT-2's ``c_attn``), through the steps :func:`_fused_chain` allows, becomes one Linear
    per Split piece on a Slice of the same Weight's columns (and of the bias), each followed by its own
    copy of those steps; the Split's consumers read the pieces.  The weight stays one tensor (one
    initializer, its gradient the pieces' gradients side by side).  ``g`` itself when nothing matches."""
    wl = g.weight_like()
    found = []
    for n in g.nodes():
        if _is_dense(g, n, wl) and g.node(n.inputs[1][0]).op == "Weight":
            c = _fused_chain(g, n, wl)
            if c is not None:
                found.append((n, *c))
    if not found:
        return g
    b = g.edit()

    def piece(ref, axis, lo, hi, name):
        return b.add("Slice", {"axes": (axis,), "starts": (lo,), "ends": (hi,), "steps": (1,)}, [ref], name)
    for n, steps, split in found:
        lo = 0
        for i, size in enumerate(s.sizes[-1] for s in g.shapes(split.id)):
            hi = lo + size
            w = piece(n.inputs[1], 1, lo, hi, f"{n.label()}/weight{i}")
            ins = [n.inputs[0], w] + ([piece(n.inputs[2], 0, lo, hi, f"{n.label()}/bias{i}")]
                                      if len(n.inputs) == 3 else [])
            ref = b.add("Linear", n.a, ins, f"{n.label()}/{i}")
            for c, pos in steps:
                if c.op == "Reshape":
                    ref = b.add("Reshape", {"shape": tuple(c.a["shape"][:-1]) + (size,)}, [ref], f"{c.label()}/{i}")
                elif c.op == "Add":
                    bias = piece(c.inputs[1 - pos], 0, lo, hi, f"{c.label()}/bias{i}")
                    ref = b.add("Add", c.a, [ref, bias] if pos == 0 else [bias, ref], f"{c.label()}/{i}")
                else:
                    ref = b.add(c.op, c.a, [ref], f"{c.label()}/{i}")
            b.replace_uses((split.id, i), ref)
            lo = hi
    b.remove_dead()
    out = b.finish()
    out.meta["split_fused"] = sorted(n.label() for n, _, _ in found)
    return out


def _unfuse_biases(g: PCG, ids) -> PCG:
    """Exact rewrite: each Linear of ``ids`` (activation none) drops its bias input, which an Add after it
    adds instead (node ids kept; the Add is named ``<linear>/bias``)."""
    if not ids:
        return g
    b = g.edit()
    for nid in sorted(ids):
        n = g.node(nid)
        b.set_inputs(nid, n.inputs[:2])
        add = b.add("Add", {}, [(nid, 0), n.inputs[2]], f"{n.label()}/bias")
        b.replace_uses((nid, 0), add, exclude=(add[0],))
    out = b.finish()
    out.meta["unfused_bias"] = sorted(g.node(i).label() for i in ids)
    return out


def megatron_graph(g: PCG) -> PCG:
    """The logical graph Megatron's layout is built on, by exact rewrites of ``g``: fused projections Split
    into pieces become one Linear per piece (:func:`split_fused_linears`), and a row-parallel candidate's
    fused bias moves to an Add after it (Megatron-LM adds it once, after the all-reduce of the partial
    sums): the biased Linears without activation that end a column -> row group once unfused.  ``g``
    itself when neither applies."""
    g = split_fused_linears(g)
    wl = g.weight_like()
    cand = {n.id for n in g.nodes() if _is_dense(g, n, wl) and len(n.inputs) == 3
            and n.a.get("activation", "none") == "none" and n.inputs[2][0] in wl}
    if not cand:
        return g
    terms = set().union(*(gr.terms for gr in megatron_groups(_unfuse_biases(g, cand))))
    return _unfuse_biases(g, cand & terms)


def _closure(g: PCG, start: int, wl: set, limit: int = 64):
    """Operators reached from ``start``'s output before any Linear (which ends a path), or None when
    the region reaches a graph output or grows past ``limit`` operators (no row-parallel partner)."""
    outs = {tuple(r) for r in g.outputs}
    nodes: set = set()
    terms: set = set()
    stack = [c for c, _ in g.consumers((start, 0))]
    if (start, 0) in outs:
        return None
    while stack:
        c = stack.pop()
        if c in nodes or c in terms:
            continue
        cn = g.node(c)
        if cn.op == "Linear" and cn.inputs[0][0] not in wl and len(cn.inputs) >= 2:
            terms.add(c)
            continue
        nodes.add(c)
        if len(nodes) > limit:
            return None
        for k in range(len(g.shapes(c))):
            if (c, k) in outs:
                return None
            stack.extend(x for x, _ in g.consumers((c, k)))
    return nodes, terms


def megatron_groups(g: PCG) -> list[_Group]:
    """Candidate column -> row Linear groups, found by graph pattern: the regions between dense
    Linears, merged where they share operators (Q, K and V meet in the attention scores); a group
    qualifies when every path from its column Linears ends in a bias-free Linear without activation
    (the row-parallel one, whose partial sums are all-reduced) and its operators read no activation
    from outside the group except broadcast ones (an attention mask, rotary tables: fewer elements than
    the reader's output; the rebuild drops a group whose operators refuse them)."""
    wl = g.weight_like()
    regions = {}
    for n in g.nodes():
        if _is_dense(g, n, wl):
            c = _closure(g, n.id, wl)
            if c is not None and c[1]:
                regions[n.id] = c
    # union regions that share operators
    parent = {s: s for s in regions}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    owner: dict = {}
    for s, (nodes, _) in regions.items():
        for v in nodes:
            if v in owner:
                parent[find(s)] = find(owner[v])
            else:
                owner[v] = s
    merged: dict = {}
    for s in regions:
        merged.setdefault(find(s), []).append(s)
    order = {nid: i for i, nid in enumerate(g.topo_order())}
    groups = []
    for starts in merged.values():
        nodes = set().union(*(regions[s][0] for s in starts))
        terms = set().union(*(regions[s][1] for s in starts))
        if terms & set(starts):
            continue
        ok = all(len(g.node(t).inputs) == 2 and g.node(t).a.get("activation", "none") == "none"
                 and g.node(t).inputs[0][0] in nodes | set(starts) for t in terms)
        inside = nodes | set(starts)
        # an activation from outside may be read only where the reader broadcasts it (an attention mask, rotary
        # tables): a full-size one (the residual stream into an Add) means the region is not one block
        ok = ok and all(r[0] in inside or r[0] in wl or _broadcast_read(g, v, r) for v in nodes
                        for r in g.node(v).inputs)
        if ok:
            groups.append(_Group(starts, nodes, terms))
    groups.sort(key=lambda gr: min(order[s] for s in gr.starts))
    return groups


def _broadcast_read(g: PCG, v: int, ref) -> bool:
    """Whether operator ``v`` reads ``ref`` broadcast: fewer elements than each of its outputs."""
    n = g.shape(tuple(ref)).numel
    return all(n < s.numel for s in g.shapes(v))


def _divisors_desc(n: int) -> list[int]:
    return [t for t in range(n, 1, -1) if n % t == 0]


def megatron(g: PCG, degree: int, devices_per_node: int | None = None, *, sequence_parallel: bool = False) -> PCG:
    """Megatron-LM: tensor parallelism of the largest degree t dividing the devices of a node (and
    ``degree``) that splits the attention heads and MLP matrices evenly; data parallelism of degree
    ``degree / t`` across nodes; ``sequence_parallel``: the residual stream on t sequence shards (see
    module docstring; ``meta["sp"]`` says so).  Built once per graph and arguments (:data:`LAYOUT_MEMO`)."""
    _check_degree(degree)
    _check_logical(g, "megatron")
    return LAYOUT_MEMO.get(g, ("megatron", degree, devices_per_node, bool(sequence_parallel)),
                           lambda: _megatron(g, degree, devices_per_node, sequence_parallel))


def _megatron(g: PCG, degree: int, devices_per_node: int | None, sequence_parallel: bool) -> PCG:
    if degree == 1:
        if not any(gr.attention(g) for gr in megatron_groups(megatron_graph(g))):
            raise StrategyError("strategy 'megatron' applies to Transformers: " + _why_no_attention(g))
        return g
    # fused Q/K/V pieces, row biases after the sum (exact rewrites), and the groups: once per graph
    logical = g
    g = LAYOUT_MEMO.get(logical, "megatron_graph", lambda: megatron_graph(logical))
    groups = LAYOUT_MEMO.get(g, "megatron_groups", lambda: megatron_groups(g))
    if not any(gr.attention(g) for gr in groups):
        raise StrategyError("strategy 'megatron' applies to Transformers: " + _why_no_attention(g))
    dpn = devices_per_node or degree
    last = None
    batch_error = None
    for tp in _divisors_desc(gcd(dpn, degree)):
        try:
            accepted = _accept(g, groups, tp, degree // tp, sequence_parallel)
        except StrategyError as e:          # the batch does not divide by this data-parallel degree
            batch_error = batch_error or e
            continue
        r, chosen = accepted
        if any(gr.attention(g) for gr in chosen):
            out = r.finish(degree=degree, tp=tp, dp=degree // tp, sp=bool(sequence_parallel),
                           column=sorted(g.node(s).label() for gr in chosen for s in gr.starts),
                           row=sorted(g.node(t).label() for gr in chosen for t in gr.terms))
            return out
        last = tp
    if batch_error is not None and last is None:
        raise StrategyError(f"strategy 'megatron': {batch_error}")
    wl = g.weight_like()
    fused = _fused_qkv(g, [g.node(s) for gr in groups if gr.attention(g) for s in gr.starts if _is_dense(g, g.node(s), wl)])
    if fused and batch_error is None:
        raise StrategyError(f"strategy 'megatron' applies to Transformers with separate Q/K/V projections: {fused}")
    heads = sorted({h for gr in groups if gr.attention(g) for h in head_counts(g, gr).values()}, reverse=True)
    tps = _divisors_desc(gcd(dpn, degree))
    if tps and all(h % tps[0] == 0 for h in heads):
        lost = _head_split_lost(g, groups, tps[0], degree // tps[0])
        if lost:
            raise StrategyError(f"strategy 'megatron': {lost}")
    hs = (f" (the attention projections have {' / '.join(map(str, heads))} heads: t must divide "
          f"{'each, e.g. the key-value heads of grouped-query attention' if len(heads) > 1 else 'them'})"
          if heads else "")
    raise StrategyError(f"strategy 'megatron': no tensor-parallel degree t > 1 dividing {gcd(dpn, degree)} (devices "
                        f"per node and degree {degree}) splits the attention heads evenly{hs}"
                        + (f" with a batch that divides by {degree}/t ({batch_error})" if batch_error else ""))


def _head_split_lost(g: PCG, groups: list[_Group], tp: int, dp: int) -> str | None:
    """Why the heads split at degree ``tp`` do not reach an attention block's output projection, in one line:
    the first operator inside the block that runs unpartitioned or gathers a split it reads from the block
    (as one that merges the split heads with the batch, ``(B, h, S, d) -> (B * h, S, d)``); None when none is
    found (or the batch does not divide by ``dp``)."""
    att = [gr for gr in groups if gr.attention(g)]
    try:
        r = _Rebuild(g, "megatron", dp=dp, tp=tp, column=frozenset().union(*(gr.starts for gr in att)),
                     inside=frozenset().union(*(gr.nodes | gr.starts for gr in att)))
    except StrategyError:
        return None
    bad = set(r.fallback_ids)
    for gr in att:
        inside = gr.nodes | gr.starts
        for i in (i for i in g.topo_order() if i in gr.nodes):
            n = g.node(i)
            what = None
            if i in bad:
                what = "runs unpartitioned"
            elif i in r.new_id:
                new_ins = r.b.node(r.new_id[i]).inputs
                if any(ref[0] in inside and tuple(new_ins[k]) != tuple(r.m[ref]) and max(r.shape(r.m[ref]).degrees,
                                                                                          default=1) > 1
                       for k, ref in enumerate(n.inputs)):
                    what = "gathers the split heads"
            if what:
                ins = " x ".join(str(list(g.shape(ref).sizes)) for ref in n.inputs)
                return (f"the attention's heads split {tp} ways do not reach its output projection: {n.label()} "
                        f"({n.op} {ins} -> {list(g.shapes(i)[0].sizes)}) {what} (an operator that merges the heads "
                        f"with another dim, as batch x heads, cannot keep them split)")
    return None


_VIEWS = ("Reshape", "Transpose", "Flatten", "Identity")


def head_counts(g: PCG, group: _Group) -> dict:
    """{column Linear id: heads} of an attention group: the heads are read off the first Reshape after the
    projection (through views and element-wise operators) that splits its features ``n`` into ``(h, n / h)``.
    Grouped-query attention has fewer key-value heads than query heads; the tensor-parallel degree must
    divide every count (each rank then holds whole key-value groups with their query heads)."""
    out = {}
    for s in group.starts:
        n = g.shapes(s)[0].sizes[-1]
        stack, seen = [c for c, _ in g.consumers((s, 0))], set()
        while stack:
            c = stack.pop()
            if c in seen or c not in group.nodes:
                continue
            seen.add(c)
            cn = g.node(c)
            if cn.op == "Reshape":
                i, o = g.shape(cn.inputs[0]).sizes, g.shapes(c)[0].sizes
                if i and i[-1] == n and len(o) >= 2 and o[-2] * o[-1] == n and o[-2] > 1:
                    out[s] = o[-2]
                    break
                if not (o and o[-1] == n):
                    continue
            elif cn.op not in _VIEWS and len(g.shapes(c)) == 1 and g.shapes(c)[0].sizes[-1:] != (n,):
                continue
            stack.extend(x for x, _ in g.consumers((c, 0)))
    return out


def _why_no_attention(g: PCG) -> str:
    """One line: why no attention block qualifies for Megatron's column -> row split."""
    wl = g.weight_like()
    dense = [n for n in g.nodes() if _is_dense(g, n, wl)]
    act_mm = [n for n in g.nodes() if n.op in ("BatchMatMul", "MatMul")
              and all(r[0] not in wl for r in n.inputs)]
    if not act_mm:
        conv = sum(1 for n in g.nodes() if n.op.startswith("Conv"))
        what = f"{len(dense)} dense Linear(s)" + (f", {conv} convolution(s)" if conv else "")
        return (f"no attention block (no matmul of two activations, as Q K^T; the model has {what}), so no "
                f"Q/K/V -> output projection pair to split")
    fused = _fused_qkv(g, dense)
    if fused:
        return fused
    rows = [n for n in dense if len(n.inputs) == 3 or n.a.get("activation", "none") != "none"]
    return ("no attention block whose Q/K/V projections feed, through the heads' matmuls only, a bias-free output "
            "projection without activation" + (f" ({len(rows)} dense Linear(s) carry a fused bias or activation, "
                                               f"which partial sums cannot take)" if rows else ""))


def _fused_qkv(g: PCG, dense) -> str | None:
    """The one-line reason when a dense projection's output is Split on its features (a fused Q/K/V)."""
    for n in dense:                           # one projection whose output is split into Q, K and V
        ref, seen = (n.id, 0), 0
        while seen < 8:
            cons = g.consumers(ref)
            if len(cons) != 1:
                break
            c = g.node(cons[0][0])
            if c.op == "Split" and c.a.get("axis", 0) in (-1, g.shape(c.inputs[0]).rank - 1):
                return (f"the attention's Q/K/V projection {n.label()} is one fused Linear whose output is Split "
                        f"into Q, K and V ({c.label()}): a column split of its weight would not follow the heads")
            if c.op not in _VIEWS:
                break
            ref, seen = (c.id, 0), seen + 1
    return None


def _accept(g: PCG, groups: list[_Group], tp: int, dp: int, sp: bool = False):
    """Build with every non-conflicting group column-parallel at degree ``tp``; drop the groups the
    operators refuse (a fallback inside, or a row Linear that did not get split inputs) and rebuild
    until none is dropped.  Returns (rebuild, accepted groups); raises StrategyError if ``dp`` does
    not divide the batch."""
    chosen: list[_Group] = []
    starts: set = set()
    terms: set = set()
    for gr in groups:
        if gr.starts & terms or gr.terms & starts:
            continue
        chosen.append(gr)
        starts |= gr.starts
        terms |= gr.terms
    while True:
        col = frozenset().union(*(gr.starts for gr in chosen)) if chosen else frozenset()
        inside = frozenset().union(*(gr.nodes | gr.starts for gr in chosen)) if chosen else frozenset()
        r = _Rebuild(g, "megatron", dp=dp, tp=tp, column=col, sp=sp, inside=inside)
        bad = set(r.fallback_ids)
        keep = []
        for gr in chosen:
            if (gr.nodes | gr.starts | gr.terms) & bad:
                continue
            if any(r.row_input_degree.get(t) != tp for t in gr.terms):
                continue
            keep.append(gr)
        if len(keep) == len(chosen):
            return r, chosen
        chosen = keep


# --- expert (embeddings and communication-intensive dense layers model-parallel) -------------------

def expert_choices(g: PCG, degree: int) -> tuple[list[int], dict]:
    """(model-parallel Embedding ids, {model-parallel Linear id: model degree}) of the expert strategy
    over ``degree`` devices: every embedding whose table is a trainable weight, and every dense Linear
    whose weight outweighs its activations at the global batch (see module docstring), split on its
    output features by the largest divisor m > 1 of ``degree`` that divides them (data parallel over
    the remaining ``degree / m``)."""
    wl = g.weight_like()
    embs, dense = [], {}
    for n in g.nodes():
        if (n.op == "Embedding" and n.inputs[0][0] not in wl and g.node(n.inputs[1][0]).op == "Weight"
                and g.shape(n.inputs[1]).dtype in FLOAT_DTYPES):
            embs.append(n.id)
        elif _is_dense(g, n, wl) and degree > 1:
            x, w = g.shape(n.inputs[0]), g.shape(n.inputs[1])
            k, nf = w.sizes
            rows = x.numel // x.sizes[-1]
            m = next((t for t in _divisors_desc(degree) if nf % t == 0), 1)
            if k * nf > rows * (k + nf) and m > 1:
                dense[n.id] = m
    return embs, dense


def expert_applies(g: PCG) -> bool:
    """The expert strategy is for recommendation and dense models: embedding tables or dense layers,
    and no convolution or attention (a softmax: Transformers have Megatron, CNNs data parallelism)."""
    wl = g.weight_like()
    some = other = False
    for n in g.nodes():
        if (n.op == "Embedding" and n.inputs[0][0] not in wl and g.node(n.inputs[1][0]).op == "Weight") \
                or _is_dense(g, n, wl):
            some = True
        elif n.op in ("Conv2d", "Conv3d", "ConvTranspose", "Softmax"):
            other = True
    return some and not other


def expert(g: PCG, degree: int) -> PCG:
    _check_degree(degree)
    _check_logical(g, "expert")
    if not expert_applies(g):
        raise StrategyError("strategy 'expert' applies to recommendation and dense models (embedding tables, "
                            "or dense layers without convolutions or attention: DLRM, XDL, CANDLE-Uno, MLP); "
                            "this model has none of them")
    if degree == 1:
        return g
    embs, dense = expert_choices(g, degree)
    r = _Rebuild(g, "expert", dp=degree, mp_embeddings=frozenset(embs), mp_dense=dense)
    out = r.finish(degree=degree, model_parallel=sorted(g.node(i).label() for i in embs + list(dense)))
    # table i lives on device i mod degree (round-robin), and so do the one-task operators that only
    # feed it its indices or only reduce its lookups: the machine mapping keeps them there
    pins = _chain_pins(out, {r.new_id[e]: k % degree for k, e in enumerate(embs) if e in r.new_id})
    out.meta["pinned"] = {str(n): d for n, d in sorted(pins.items())}
    return out


def _chain_pins(g: PCG, pins: dict) -> dict:
    """Extend pins (node -> device) to the one-task compute operators upstream of a pinned node that
    feed only pinned nodes of the same device, and downstream ones that read only them."""
    def one_task(nid):
        n = g.node(nid)
        return n.kind == "compute" and all(s.piece_count == 1 for s in g.shapes(nid)) \
            and all(g.shape(r).piece_count == 1 for r in n.inputs)

    def users(nid):
        return {c for k in range(len(g.shapes(nid))) for c, _ in g.consumers((nid, k))}
    out = dict(pins)
    for start, dev in pins.items():
        stack = [r[0] for r in g.node(start).inputs]
        while stack:                                   # upstream: the index pipeline
            p = stack.pop()
            if p in out or not one_task(p) or any(out.get(u) != dev for u in users(p)):
                continue
            out[p] = dev
            stack.extend(r[0] for r in g.node(p).inputs)
        stack = list(users(start))
        while stack:                                   # downstream: pooling of the lookups
            c = stack.pop()
            if c in out or not one_task(c):
                continue
            producers = [r[0] for r in g.node(c).inputs if g.node(r[0]).kind != "source"]
            if any(out.get(p) != dev for p in producers):
                continue
            out[c] = dev
            stack.extend(users(c))
    return out


def pinned_views(g: PCG, machine=None) -> dict:
    """Machine views a fixed strategy pinned in ``g.meta["pinned"]`` (node id -> device: expert's
    embedding tables, round-robin), for :meth:`search.mapping.MachineMapper.optimize`.  Pins of nodes
    that are not one-task operators of ``g``, or that name a device outside ``machine``, are ignored
    (a PCG rewritten by the search keeps its meta but not necessarily those nodes)."""
    return _views_of(g, dict(g.meta.get("pinned") or {}), machine)


def table_pins(g: PCG, machine) -> dict:
    """Machine views placing the one-task table lookups of ``g`` (an Embedding of a trainable table
    kept whole, as the search's expert seed leaves them) round-robin on the devices, with the
    one-task operators that only feed or pool them (as :func:`expert` pins its tables); {} when
    ``g`` has fewer than two.  A hint for the machine-mapping DP: it finds such a placement by itself
    (on DLRM at 96 GPUs the unpinned optimum equals the pinned cost), but with dozens of single-device
    branches of ~100 views each its solve takes ~20 s per segment, over the search's per-candidate
    limit."""
    from .substitution import is_table_lookup
    look = [n.id for n in (g.node(i) for i in g.topo_order()) if n.kind == "compute" and is_table_lookup(g, n)
            and all(s.piece_count == 1 for s in g.shapes(n.id))
            and all(g.shape(r).piece_count == 1 for r in n.inputs)]
    if len(look) < 2 or machine.num_devices < 2:
        return {}
    pins = _chain_pins(g, {nid: k % machine.num_devices for k, nid in enumerate(look)})
    return _views_of(g, pins, machine)


def _views_of(g: PCG, pins: dict, machine) -> dict:
    from unity_pcg.machine import MachineView
    out = {}
    for k, dev in pins.items():
        try:
            nid, dev = int(k), int(dev)
        except (TypeError, ValueError):
            continue
        if nid not in g or g.node(nid).kind != "compute" or dev < 0:
            continue
        if machine is not None and dev >= machine.num_devices:
            continue
        pm = ops.infer(g.node(nid).op, g.node(nid).a, g.input_shapes(nid)).piece_map
        if pm.degree != 1:
            continue
        out[nid] = MachineView(dev, ())
    return out


# --- the propagation ---------------------------------------------------------------------------------

class _Rebuild:
    """Rebuilds a logical PCG with parallel operators for one strategy (see module docstring).

    ``dp``: degree of the batch partition; ``tp``: copies of every activation in the strategy's
    layout (Megatron's tensor-parallel degree; 1 otherwise); ``column``: Linears whose weight is
    split on its output features by ``tp``; ``mp_embeddings``: embeddings run whole on one device;
    ``mp_dense``: Linear id -> m: split on its output features m ways, data parallel ``dp / m`` ways;
    ``sp``: sequence parallelism -- the strategy's layout outside the tensor-parallel groups ``inside``
    (their operators but the row Linears) splits dim 1 ``tp`` ways instead of copying (:meth:`_seq`)."""

    def __init__(self, g: PCG, strategy: str, dp: int, tp: int = 1, column: frozenset = frozenset(),
                 mp_embeddings: frozenset = frozenset(), mp_dense: dict | None = None, sp: bool = False,
                 inside: frozenset = frozenset()):
        self.g = g
        self.strategy = strategy
        self.dp, self.tp = dp, tp
        self.sp = bool(sp) and tp > 1
        self.inside = inside
        self._in_group = False            # the node being rebuilt is inside a group (sp: the copied layout)
        self.gathered: dict = {}          # sp: new ref -> its all-gathered (copied) form, made once
        self.column = column
        self.mp_emb = mp_embeddings
        self.mp_dense = dict(mp_dense or {})
        self.b = PCG.builder(g.weights)
        self.m: dict = {}                 # old ref -> new ref (activations)
        self.wl = g.weight_like()
        self.raw: dict = {}               # old Weight id -> new unpartitioned ref
        self.wcache: dict = {}            # (old ref, shards, copy) -> new ref
        self.whole: set = set()           # new refs kept whole on one device (model-parallel lookups)
        self.fallback_ids: list[int] = []
        self.new_id: dict = {}            # old compute node id -> its node in the new graph
        self.row_input_degree: dict = {}  # Linear id -> degree of its x input's last dim
        for n in g.nodes():
            if n.kind == "parallel":
                raise StrategyError(f"strategy {strategy!r} needs a logical PCG; node {n.label()} is a {n.op}")
            if n.id in self.wl:
                continue
            if n.op == "Input":
                self._input(n)
            else:
                self._compute(n)

    # --- layout helpers ----------------------------------------------------------------------------
    def shape(self, ref):
        return self.b.shape(ref)

    def _add(self, op, attrs, ins, name) -> Ref:
        return self.b.add(op, attrs, ins, name=name)

    def _canon_degrees(self, s) -> tuple[int, ...]:
        degs = [1] * s.rank
        if s.rank and s.sizes[0] % self.dp == 0 and s.sizes[0] >= self.dp:
            degs[0] = self.dp
        if self._seq(s):
            degs[1] = self.tp
        return tuple(degs)

    def _seq(self, s) -> bool:
        """Sequence parallelism splits this tensor on dim 1 (the sequence) here: sp is on, the node is
        outside the groups, and dim 1 (not the last dim of a tensor of rank >= 3; a rank-2 model input's
        tokens) divides by tp."""
        return (self.sp and not self._in_group and s.rank >= 2 and s.sizes[1] % self.tp == 0
                and s.sizes[1] >= self.tp)

    def _canon_copy(self, s) -> int:
        return 1 if self._seq(s) else self.tp

    def _reshard(self, ref: Ref, degrees: tuple[int, ...], copy: int, label: str) -> Ref:
        """Bring ``ref`` to shard ``degrees`` and (at least) ``copy`` copies: Reduce partial sums,
        Combine dims whose degree differs, Partition, Replicate.  Copies cannot be dropped (no
        parallel operator does that); a tensor with more copies keeps them."""
        s = self.shape(ref)
        if s.sum_degree > 1:
            ref = self._add("Reduce", {"degree": s.sum_degree}, [ref], f"{label}/reduce")
        s = self.shape(ref)
        for dim, (cur, want) in enumerate(zip(s.degrees, degrees)):
            if cur != want and cur > 1:
                ref = self._add("Combine", {"dim": dim, "degree": cur}, [ref], f"{label}/combine{dim}")
        s = self.shape(ref)
        for dim, (cur, want) in enumerate(zip(s.degrees, degrees)):
            if want > 1 and cur != want:
                ref = self._add("Partition", {"dim": dim, "degree": want}, [ref], f"{label}/partition{dim}")
        c = self.shape(ref).copy_degree
        if c < copy and copy % c == 0:
            ref = self._add("Replicate", {"degree": copy // c}, [ref], f"{label}/replicate")
        return ref

    @staticmethod
    def _mp_degrees(s, batch_degree: int) -> tuple[int, ...]:
        degs = [1] * s.rank
        if s.rank > 1 and s.sizes[0] % batch_degree == 0:
            degs[0] = batch_degree
        return tuple(degs)

    def _canonical(self, ref: Ref, label: str) -> Ref:
        s = self.shape(ref)
        copy = self._canon_copy(s)
        if self._canon_degrees(s) == s.degrees and s.sum_degree == 1 and s.copy_degree == copy:
            return ref
        if self.sp and self._in_group and s.sum_degree == 1:     # an all-gather, made once per tensor
            hit = self.gathered.get(ref)
            if hit is None:
                hit = self.gathered[ref] = self._reshard(ref, self._canon_degrees(s), copy, label)
            return hit
        return self._reshard(ref, self._canon_degrees(s), copy, label)

    def _whole(self, ref: Ref, label: str) -> Ref:
        s = self.shape(ref)
        if s.sum_degree == 1 and all(d == 1 for d in s.degrees):
            return ref
        return self._reshard(ref, (1,) * s.rank, 1, label)

    # --- weights -----------------------------------------------------------------------------------
    def _weight(self, ref: Ref, shards: tuple[int, ...], copy: int) -> Ref:
        """The weight(-derived) tensor ``ref`` of the logical graph with the given shard degrees and
        copy degree (a placement chain: Partition per dim, then Replicate)."""
        key = (ref, shards, copy)
        hit = self.wcache.get(key)
        if hit is not None:
            return hit
        n = self.g.node(ref[0])
        if n.op == "Weight":
            if n.id not in self.raw:
                self.raw[n.id] = (self.b.add_like(n, []), 0)
            x = self.raw[n.id]
            for dim, d in enumerate(shards):
                if d > 1:
                    x = self._add("Partition", {"dim": dim, "degree": d}, [x], f"{n.label()}/partition{dim}")
            if copy > 1:
                x = self._add("Replicate", {"degree": copy}, [x], f"{n.label()}/replicate")
        else:
            # an operator on weights only: computed on ``copy`` devices from copied inputs, then sliced
            ins = [self._weight(r, (1,) * self.g.shape(r).rank, copy) for r in n.inputs]
            wkey = (ref[0], copy)
            nid = self.wcache.get(wkey)
            if nid is None:
                nid = self.wcache[wkey] = self.b.add_like(n, ins)
            x = (nid, ref[1])
            for dim, d in enumerate(shards):
                if d > 1:
                    x = self._add("Partition", {"dim": dim, "degree": d}, [x], f"{n.label()}/partition{dim}")
        self.wcache[key] = x
        return x

    def _weight_targets(self, n, acts: dict, force: dict | None = None):
        """Shard and copy degrees of every weight input of ``n`` given its activation inputs ``acts``
        (position -> new ref), from the operator's labels; ``force`` sets degrees of labels no
        activation carries (a column-parallel Linear's output features).  None if the activations
        disagree (the operator would refuse them).  A function of the operator, its attributes, the shapes
        it reads and ``force``: memoized (:data:`_TARGETS`), so a model's repeated blocks derive it once."""
        g = self.g
        lins = tuple([self.shape(acts[i]) if i in acts else s for i, s in enumerate(g.input_shapes(n.id))])
        key = (n.op, n.attrs, lins, tuple(sorted(acts)), g.shapes(n.id),
               tuple(sorted(force.items())) if force else ())
        try:
            hit = _TARGETS.get(key, _MISSING)
        except TypeError:                 # an attribute that cannot be a key (an array)
            key, hit = None, _MISSING
        if hit is _MISSING:
            hit = self._weight_targets_of(n, lins, acts, force)
            if key is not None:
                if len(_TARGETS) >= 1 << 16:
                    _TARGETS.clear()
                _TARGETS[key] = hit
        return hit

    def _weight_targets_of(self, n, lins: tuple, acts: dict, force: dict | None):
        g = self.g
        spec = ops.get_op(n.op)
        lab = spec.labels(n.a, list(lins), [s.sizes for s in g.shapes(n.id)])
        deg: dict = {}
        for i, ref in acts.items():
            s = lins[i]
            if s.sum_degree > 1:
                return None
            for l, d in zip(lab.inputs[i], s.degrees):
                if deg.get(l, d) != d:
                    return None
                deg[l] = d
        for l, d in (force or {}).items():
            if deg.get(l, d) != d:
                return None
            deg[l] = d
        G = prod(deg.values())
        reps = set()
        for i in acts:
            s = lins[i]
            have = set(lab.inputs[i])
            need = prod(d for l, d in deg.items() if l not in have)
            if s.copy_degree % need:
                return None
            reps.add(s.copy_degree // need)
        if len(reps) > 1:
            return None
        r = reps.pop() if reps else 1
        out = {}
        for i in range(len(n.inputs)):
            if i in acts:
                continue
            shards = tuple(deg.get(l, 1) for l in lab.inputs[i])
            out[i] = (shards, G // prod(shards) * r)
        return out

    # --- nodes -------------------------------------------------------------------------------------
    def _input(self, n) -> None:
        ref = (self.b.add_like(n, []), 0)
        s = self.shape(ref)
        if self.strategy == "expert" and not s.dtype.startswith("float"):
            self.m[(n.id, 0)] = ref            # indices: each lookup reads the batch it needs
            self.whole.add(ref)
            return
        if s.rank == 0 or s.sizes[0] % self.dp:
            size = s.sizes[0] if s.rank else "a scalar"
            raise StrategyError(f"input {n.label()!r}: batch dim of size {size} is not divisible by "
                                f"data-parallel degree {self.dp}")
        if self.dp > 1:
            ref = self._add("Partition", {"dim": 0, "degree": self.dp}, [ref], f"{n.label()}/partition")
        if self._seq(s):
            ref = self._add("Partition", {"dim": 1, "degree": self.tp}, [ref], f"{n.label()}/sequence")
        elif self.tp > 1:
            ref = self._add("Replicate", {"degree": self.tp}, [ref], f"{n.label()}/replicate")
        self.m[(n.id, 0)] = ref

    def _try(self, n, acts: dict, force: dict | None = None):
        targets = self._weight_targets(n, acts, force)
        if targets is None:
            return None
        try:
            ins = [acts[i] if i in acts else self._weight(r, *targets[i]) for i, r in enumerate(n.inputs)]
            inf = ops.infer(n.op, n.a, [self.shape(x) for x in ins])
            return self.b.add_like(n, ins, outputs=inf.outputs)
        except (InvalidParallelization, ShapeError):
            return None

    def _has_float_weights(self, n) -> bool:
        return any(r[0] in self.wl and self.g.shape(r).dtype in FLOAT_DTYPES for r in n.inputs)

    def _compute(self, n) -> None:
        acts = {i: self.m[r] for i, r in enumerate(n.inputs) if r[0] not in self.wl}
        label = n.label()
        self._in_group = n.id in self.inside
        if self.sp and self._in_group:    # what a group reads from the residual stream: all-gathered
            acts = {i: (self._canonical(r, f"{label}/in{i}") if n.inputs[i][0] not in self.inside else r)
                    for i, r in acts.items()}
        nid = None
        whole_out = False
        if n.id in self.mp_emb:
            acts = {i: self._whole(r, f"{label}/in{i}") for i, r in acts.items()}
            nid = self._try(n, acts)
            whole_out = nid is not None
        elif n.id in self.column:
            acts = {i: self._canonical(r, f"{label}/in{i}") for i, r in acts.items()}
            nid = self._try(n, acts, force={"n": self.tp})
        elif n.id in self.mp_dense:
            # output features split m ways, the batch dp / m ways; the input copied m times
            m = self.mp_dense[n.id]
            acts = {i: self._reshard(r, self._mp_degrees(self.shape(r), self.dp // m), m, f"{label}/in{i}")
                    for i, r in acts.items()}
            nid = self._try(n, acts, force={"n": m})
        else:
            if self.strategy == "expert" and (self._has_float_weights(n) or (
                    len(acts) > 1 and any(r in self.whole for r in acts.values()))):
                # dense operators run data parallel; model-parallel lookups that meet them are
                # scattered to that layout (the all-to-all of FlexFlow's DLRM)
                acts = {i: self._canonical(r, f"{label}/in{i}") for i, r in acts.items()}
            nid = self._try(n, acts)
            if nid is not None and len(acts) == 1 and next(iter(acts.values())) in self.whole:
                whole_out = True
            if nid is None:
                canon = {i: self._canonical(r, f"{label}/in{i}") for i, r in acts.items()}
                if canon != acts:
                    nid = self._try(n, canon)
        if nid is not None:
            self.new_id[n.id] = nid
        if n.op == "Linear" and nid is not None:
            self.row_input_degree[n.id] = self.b.shape(self.b.node(nid).inputs[0]).degrees[-1]
        if nid is None:
            nid = self._fallback(n, acts)
            for k in range(len(self.g.shapes(n.id))):
                self.m[(n.id, k)] = self._canonical((nid, k), f"{label}/out{k}")
            return
        for k in range(len(self.g.shapes(n.id))):
            ref = (nid, k)
            s = self.shape(ref)
            if s.sum_degree == self.tp and self.sp and self._seq(s) and s.degrees == self._canon_degrees(s)[:1] + (1,) * (
                    s.rank - 1) and s.copy_degree == 1:
                # sequence parallelism: a reduce-scatter onto the sequence (Reduce + Partition, one collective)
                ref = self._add("Reduce", {"degree": s.sum_degree}, [ref], f"{label}/reduce")
                ref = self._add("Partition", {"dim": 1, "degree": self.tp}, [ref], f"{label}/reduce_scatter")
            elif s.sum_degree > 1:        # partial sums (a row-parallel Linear): all-reduce at once
                ref = self._add("AllReduce", {"degree": s.sum_degree}, [ref], f"{label}/allreduce")
            if whole_out:
                self.whole.add(ref)
            self.m[(n.id, k)] = ref

    def _fallback(self, n, acts: dict) -> int:
        """Run ``n`` unpartitioned: its activations combined into one piece (copies kept), its
        weights with as many copies."""
        self.fallback_ids.append(n.id)
        label = n.label()
        whole = {i: self._whole(r, f"{label}/in{i}") for i, r in acts.items()}
        c = max((self.shape(r).copy_degree for r in whole.values()), default=1)
        for i, r in whole.items():
            have = self.shape(r).copy_degree
            if c % have:
                raise StrategyError(f"node {label} ({n.op}): inputs with {have} and {c} copies cannot be "
                                    f"brought together")
            if have < c:
                whole[i] = self._add("Replicate", {"degree": c // have}, [r], f"{label}/in{i}/replicate")
        try:
            ins = [whole[i] if i in whole else self._weight(r, (1,) * self.g.shape(r).rank, c)
                   for i, r in enumerate(n.inputs)]
            return self.b.add_node(n.op, n.a, ins, name=n.name)
        except (InvalidParallelization, ShapeError) as e:
            raise StrategyError(f"node {label} ({n.op}) cannot run even unpartitioned under strategy "
                                f"{self.strategy!r}: {e}") from None

    # --- result ------------------------------------------------------------------------------------
    def finish(self, combine_outputs: bool = False, **meta) -> PCG:
        outs = []
        for r in self.g.outputs:
            r = tuple(r)
            if r[0] in self.wl:
                ref = self._weight(r, (1,) * self.g.shape(r).rank, 1)
            else:
                ref = self.m[r]
                s = self.shape(ref)
                if s.sum_degree > 1:
                    ref = self._add("Reduce", {"degree": s.sum_degree}, [ref], f"output{len(outs)}/reduce")
                if combine_outputs:
                    ref = self._whole(ref, f"output{len(outs)}")
            outs.append(ref)
        self.b.set_outputs(outs)
        self.b.remove_dead()
        fallbacks = [self.g.node(i).label() for i in self.fallback_ids]
        info = dict(strategy=self.strategy, fallbacks=fallbacks, **meta)
        self.b.meta = dict(self.g.meta, **info)
        out = self.b.finish()
        out.meta.update(info)
        return out


__all__ = ["build_strategy", "none", "data_parallel", "megatron", "expert", "megatron_groups", "megatron_graph",
           "split_fused_linears",
           "expert_choices", "expert_applies", "head_counts", "pinned_views", "StrategyError", "STRATEGIES"]
