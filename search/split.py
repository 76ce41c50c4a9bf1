"""Graph splitting (Unity section 5.3): search a large PCG as a sequence of small subgraphs.

The imported (logical) graph is cut, in topological order of its compute operators, at points where
exactly one activation tensor crosses (sources -- weights and model inputs -- are copied into every
segment that reads them).  Segments hold at most about ``k`` compute operators (default 10, as the
paper); among the admissible cuts in ``[k/2, k]`` operators the one that blocks the fewest substitutions
is taken: a rule whose source pattern has an edge from the producer's operator to a consumer's
operator could match across the cut and is blocked by it.

Each segment becomes a small *canonical* PCG (fresh ids in topological order, weights and inputs
renamed, the crossing tensor an ``Input``), so structurally identical segments -- the layers of a
Transformer -- are searched once (memo by the canonical graph).  The segment search keeps the best
candidate for every pair (partitioning of the tensor entering, partitioning of the tensor leaving):
that is "every partitioning of the tensor crossing the split" of the paper; the leaving tensor is
priced without the parallel operators that bring it back to one piece (they cancel against the
next segment's Partitions when both sides agree; when they disagree the gather is charged).  A
dynamic program over the sequence of segments picks one pair per segment, and the segments' rule
steps are replayed on the whole graph (ids translated) followed by the cancellation rules at the
boundaries, so the result is reachable from the imported graph by rules.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from unity_pcg import ops
from unity_pcg.pcg import PCG

from .substitution import RuleBook, RuleStep, apply_step, cancel_steps, new_ids, trailing, trimmed

INF = math.inf


@dataclass
class Segment:
    nodes: list[int]                      # original compute node ids, topological order
    crossing_in: tuple | None             # original ref of the activation entering (None: first)
    canon: PCG | None = None
    to_orig: dict = field(default_factory=dict)     # canonical node id -> original node id
    boundary: int | None = None           # canonical id of the Input standing for crossing_in
    outputs: list = field(default_factory=list)     # original refs the canonical outputs stand for
    key: str = ""


def blocking_pairs(book: RuleBook) -> dict[tuple[str, str], int]:
    """(producer op, consumer op) -> number of rules whose source pattern has that edge."""
    out: dict = defaultdict(int)
    for r in book.rules:
        seen = set()
        for n in r.source.nodes:
            for ref in n.inputs:
                if isinstance(ref, str):
                    continue
                p = r.source.nodes[ref[0]].op
                seen.add((p, n.op))
        for e in seen:
            out[e] += 1
    return dict(out)


def segments(g: PCG, k: int = 10, pairs: Mapping[tuple[str, str], int] | None = None) -> list[Segment]:
    """Cut ``g`` into sequential segments of about ``k`` compute operators (see module docstring)."""
    order = [n for n in g.topo_order() if g.node(n).kind != "source"]
    pos = {n: i for i, n in enumerate(order)}
    # tensors live after position i: produced at <= i, read at > i (graph outputs are not crossings)
    last_use: dict = {}
    for n in order:
        for r in g.node(n).inputs:
            if g.node(r[0]).kind == "source":
                continue
            last_use[tuple(r)] = max(last_use.get(tuple(r), -1), pos[n])
    starts = defaultdict(list)
    for r, lu in last_use.items():
        starts[pos[r[0]]].append((r, lu))
    live: dict = {}
    crossing: list = []                   # position -> the single crossing ref, or None
    for i, n in enumerate(order):
        for r, lu in starts.get(i, ()):
            live[r] = lu
        for r in [r for r, lu in live.items() if lu <= i]:
            del live[r]
        crossing.append(next(iter(live)) if len(live) == 1 else None)
    pairs = pairs or {}

    def score(i: int) -> int:
        r = crossing[i]
        p = g.node(r[0]).op
        return sum(pairs.get((p, g.node(c).op), 0) for c, _ in g.consumers(r))

    segs: list[Segment] = []
    s = 0
    n = len(order)
    prev = None
    while s < n:
        if n - s <= k + k // 2:
            end = n - 1
        else:
            lo, hi = s + max(k // 2, 1) - 1, min(s + k - 1, n - 2)
            cands = [i for i in range(lo, hi + 1) if crossing[i] is not None]
            if not cands:
                cands = [next((i for i in range(hi + 1, n - 1) if crossing[i] is not None), n - 1)]
            end = min(cands, key=lambda i: (score(i), -i)) if crossing[cands[0]] is not None else cands[0]
        segs.append(Segment(order[s:end + 1], prev))
        prev = crossing[end] if end < n - 1 else None
        s = end + 1
    return segs


def canonicalize(g: PCG, seg: Segment, next_reads: set) -> Segment:
    """Build the segment's canonical PCG (see module docstring).  ``next_reads``: original refs read
    after the segment (they become canonical outputs, with the graph outputs produced here)."""
    b = PCG.builder()
    to_canon: dict = {}
    to_orig: dict = {}
    nw = 0
    if seg.crossing_in is not None:
        s = g.shape(seg.crossing_in)
        bid = b.add_node("Input", {"name": "in", "shape": s.sizes, "dtype": s.dtype})
        to_canon[tuple(seg.crossing_in)] = (bid, 0)
        seg.boundary = bid
    mine = set(seg.nodes)
    for nid in seg.nodes:
        n = g.node(nid)
        ins = []
        for r in n.inputs:
            r = tuple(r)
            if r not in to_canon:
                src = g.node(r[0])
                if src.kind != "source":
                    raise ValueError(f"segment reads {src.label()} which is neither its input nor a source")
                a = dict(src.a, name=f"s{nw}")
                nw += 1
                sid = b.add_node(src.op, a)
                to_canon[r] = (sid, 0)
                to_orig[sid] = r[0]
            ins.append(to_canon[r])
        cid = b.add_node(n.op, n.a, ins)
        to_orig[cid] = nid
        for k in range(len(g.shapes(nid))):
            to_canon[(nid, k)] = (cid, k)
    outs = []
    gouts = {tuple(r) for r in g.outputs}
    for nid in seg.nodes:
        for k in range(len(g.shapes(nid))):
            r = (nid, k)
            if r in next_reads or r in gouts:
                outs.append(r)
    b.set_outputs([to_canon[r] for r in outs])
    seg.canon = b.finish()
    seg.to_orig = to_orig
    seg.outputs = outs
    body = seg.canon.to_json()
    for nd in body["nodes"]:
        nd.pop("name", None)
    seg.key = json.dumps(body, sort_keys=True, default=str)
    return seg


def canonical_segments(g: PCG, k: int = 10, pairs: Mapping[tuple[str, str], int] | None = None
                       ) -> tuple[list[Segment], list[set]]:
    """:func:`segments`, each canonicalized with the values read after it (what the search prices); also
    returns those read-after sets, one per segment."""
    segs = segments(g, k, pairs)
    later: list = []
    reads_after: set = set()
    for seg in reversed(segs):
        later.append(set(reads_after))
        for nid in seg.nodes:
            reads_after |= {tuple(r) for r in g.node(nid).inputs}
    later.reverse()
    for seg, nr in zip(segs, later):
        canonicalize(g, seg, nr)
    return segs, later

def boundary_keys(seg: Segment, g: PCG) -> tuple:
    """(shapes the entering tensor is read with, shapes of the leaving tensors before the parallel
    operators that bring them back to one piece) of a candidate of ``seg``."""
    ins: list = []
    if seg.boundary is not None:
        stack = [(seg.boundary, 0)]
        while stack:
            r = stack.pop()
            for c, _ in g.consumers(r):
                n = g.node(c)
                if n.op == "Partition":
                    stack.append((c, 0))
                else:
                    ins.append(str(g.shape(r)))
    outs = tuple(str(g.shape(trailing(g, r))) for r in g.outputs)
    return (tuple(sorted(set(ins))), outs)


@dataclass
class SegmentChoice:
    cost: float                # trimmed cost
    full_cost: float           # with the trailing gathers
    steps: tuple
    keys: tuple
    cross: str | None = None   # partitioning of the leaving crossing tensor (before its gathers)


def combine(fronts: Sequence[Mapping[tuple, SegmentChoice]]) -> list[SegmentChoice]:
    """Pick one choice per segment minimizing the sum of costs, where a segment whose leaving
    partitioning differs from how the next segment reads it also pays its trailing gathers."""
    states: list = [(0.0, [], None)]          # (total, path, last choice)
    for front in fronts:
        new: list = []
        for (kin, kout), ch in sorted(front.items(), key=lambda kv: repr(kv[0])):
            best = None
            for tot, path, prev in states:
                extra = 0.0
                if prev is not None and kin != (prev.cross,):
                    extra = prev.full_cost - prev.cost
                t = tot + ch.cost + extra
                if best is None or t < best[0]:
                    best = (t, path + [ch], ch)
            if best is not None:
                new.append(best)
        states = new
    if not states:
        return []
    tot, path, _ = min(states, key=lambda v: v[0])
    return path if math.isfinite(tot) else []


def assemble_by_replay(g: PCG, segs: Sequence[Segment], choices: Sequence[SegmentChoice],
                       book: RuleBook) -> tuple[PCG, list]:
    """Replay every segment's chosen steps on the whole graph, then cancel at the boundaries (the
    reference for :func:`assemble`; each step rebuilds the whole graph, so this is quadratic)."""
    steps: list[RuleStep] = []
    for seg, ch in zip(segs, choices):
        cg = seg.canon
        ids = dict(seg.to_orig)
        refs: dict = {}
        if seg.boundary is not None:
            # the entering tensor as it is now read by this segment's first consumer
            for c, p in cg.consumers((seg.boundary, 0)):
                orig = seg.to_orig[c]
                refs[(seg.boundary, 0)] = tuple(g.node(orig).inputs[p])
                break
        for s in ch.steps:
            full = s.remap(ids, refs)
            g2 = apply_step(g, full, book)
            c2 = apply_step(cg, s, book)
            for a, b in zip(new_ids(cg, c2), new_ids(g, g2)):
                ids[a] = b
            steps.append(full)
            g, cg = g2, c2
    g, more = cancel_rounds(g, book)
    steps.extend(more)
    return g, steps


def _canonical_run(cg: PCG, steps: Sequence[RuleStep], book: RuleBook) -> tuple[PCG, list]:
    """The segment's final graph and, per step, the ids it created (creation order)."""
    news = []
    for s in steps:
        c2 = apply_step(cg, s, book)
        news.append(new_ids(cg, c2))
        cg = c2
    return cg, news


def assemble(g: PCG, segs: Sequence[Segment], choices: Sequence[SegmentChoice], book: RuleBook) -> tuple[PCG, list]:
    """The whole graph after every segment's chosen steps, and those steps in whole-graph ids, without
    replaying them on the whole graph: each segment's steps run on its small canonical graph, the
    ids a whole-graph replay would allocate are predicted (applying a match gives the target's nodes
    the ids following the largest id in the graph), and the segments' final graphs are stitched
    together.  Then the Combine/Partition pairs at the boundaries are cancelled by rules.  Linear in
    the graph size; ``assemble_by_replay`` is the quadratic reference (tests compare the two)."""
    from unity_pcg.pcg import Node
    live = set(g.node_ids())
    cur_max = max(live)
    nodes: dict = {}
    shapes: dict = {}
    for n in g.nodes():
        if n.kind == "source":
            nodes[n.id] = n
            shapes[n.id] = g.shapes(n.id)
    out_ref: dict = {}
    steps: list[RuleStep] = []
    runs: dict = {}
    for seg, ch in zip(segs, choices):
        rk = (seg.key, id(ch))
        if rk not in runs:
            runs[rk] = _canonical_run(seg.canon, ch.steps, book)
        cf, news = runs[rk]
        ids = dict(seg.to_orig)
        refs: dict = {}
        if seg.boundary is not None:
            refs[(seg.boundary, 0)] = out_ref[tuple(seg.crossing_in)]
        for s, cnew in zip(ch.steps, news):
            full = s.remap(ids, refs)
            steps.append(full)
            for k, a in enumerate(cnew):
                ids[a] = cur_max + 1 + k
            live.update(range(cur_max + 1, cur_max + 1 + len(cnew)))
            cur_max += len(cnew)
            live.difference_update(full.nodes)
            if cur_max not in live:
                cur_max = max(live)

        def ref(r):
            r = tuple(r)
            return refs[r] if r in refs else (ids[r[0]], r[1])

        for n in cf.nodes():
            if n.kind == "source":
                continue
            fid = ids[n.id]
            name = g.node(fid).name if n.id in seg.to_orig else ""
            nodes[fid] = Node(fid, n.op, n.attrs, tuple(ref(r) for r in n.inputs), name)
            shapes[fid] = cf.shapes(n.id)
        for j, r in enumerate(seg.outputs):
            out_ref[tuple(r)] = ref(cf.outputs[j])
    used = {r[0] for n in nodes.values() for r in n.inputs} | {out_ref[tuple(r)][0] for r in g.outputs}
    for sid in [i for i, n in nodes.items() if n.kind == "source" and i not in used]:
        del nodes[sid], shapes[sid]            # not possible for an imported graph; kept consistent
    out = PCG(nodes, shapes, tuple(out_ref[tuple(r)] for r in g.outputs), g.weights, g.meta)
    # where pairs are left: the parallel chain ending each segment and the chains starting the next
    window: set = set()
    for seg in segs:
        if seg.crossing_in is None:
            continue
        r = out_ref[tuple(seg.crossing_in)]
        stack = [r[0]]
        while stack:
            nid = stack.pop()
            if nid in window or out.node(nid).kind != "parallel":
                continue
            window.add(nid)
            stack.extend(x[0] for x in out.node(nid).inputs)
            stack.extend(c for c, _ in out.consumers((nid, 0)))
        for c, _ in out.consumers(r):
            stack.append(c)
        while stack:
            nid = stack.pop()
            if nid in window or out.node(nid).kind != "parallel":
                continue
            window.add(nid)
            stack.extend(c for c, _ in out.consumers((nid, 0)))
    for n in g.sources():                     # a source partitioned in several segments: merge them
        par = [c for c, _ in out.consumers((n.id, 0)) if out.node(c).kind == "parallel"]
        if len(par) > 1:
            window.update(par)
    out, more = cancel_rounds(out, book, window)
    steps.extend(more)
    return out, steps


def apply_disjoint(g: PCG, matches: Sequence) -> PCG:
    """Apply matches that share no node (and read nothing another one removes) in one edit, giving
    every new node the id a one-by-one application would (the largest id in the graph + 1, ...)."""
    from unity_pcg.substitutions.apply import _resolve
    from unity_pcg.errors import InvalidParallelization
    live = set(g.node_ids())
    cur_max = max(live)
    e = g.edit()
    moved: dict = {}                  # every match's outputs -> their replacements (one pass at the end)
    for m in matches:
        rule, b, ins = m.rule, m.binding, m.input_map
        new_refs: list = []

        def ref(r):
            return ins[r] if isinstance(r, str) else (new_refs[r[0]][0], r[1])

        for k, pn in enumerate(rule.target.nodes):
            nid = e.add_node(pn.op, {a: _resolve(v, b) for a, v in pn.attrs}, [ref(r) for r in pn.inputs],
                             name="", nid=cur_max + 1 + k)
            new_refs.append((nid, 0))
        for so, to in zip(rule.source.outputs, rule.target.outputs):
            old = (m.nodes[so[0]], so[1])
            nw = ins[to] if isinstance(to, str) else ref(to)
            if e.shape(old) != e.shape(nw):
                raise InvalidParallelization(f"rule {rule.name}: target output differs from source output")
            moved[old] = nw           # disjoint matches: no replacement is another's replaced tensor
        for nid in m.nodes:
            e.remove(nid)
        live.update(range(cur_max + 1, cur_max + 1 + len(rule.target.nodes)))
        cur_max += len(rule.target.nodes)
        live.difference_update(m.nodes)
        if cur_max not in live:
            cur_max = max(live)
    e.replace_uses_many(moved)
    return e.finish()


def cancel_rounds(g: PCG, book: RuleBook, window: set | None = None, max_rounds: int = 64) -> tuple[PCG, list]:
    """:func:`search.substitution.cancel_steps` in rounds: each round finds the matches of one
    cancellation rule (ending in ``window``, with the nodes the rounds create; everywhere if None)
    that do not interfere and applies them together (linear per round).  Two matches interfere where one
    binds a node the other binds or reads; reading the same tensor is not interference (the Replicates of
    one weight read by every layer merge pairwise, so in a number of rounds logarithmic in the layers)."""
    from unity_pcg.substitutions import iter_matches

    from .substitution import CANCEL_RULES, _window_index
    rules = [book.by_name[n] for n in CANCEL_RULES if n in book.by_name]
    steps: list = []
    for _ in range(max_rounds):
        idx = _window_index(g, window)
        chosen: list = []
        for r in rules:
            bound: set = set()      # the chosen matches' nodes (no later match binds or reads one)
            read: set = set()       # the producers of what they read (no later match binds one)
            # (avoid prunes what binds or reads a bound node when it is bound; a match found while its first
            # nodes were bound before is checked again here)
            for m in iter_matches(r, g, idx, None, (2,), avoid=bound):
                if not (bound.isdisjoint(m.nodes) and read.isdisjoint(m.nodes)) \
                        or any(x[0] in bound for _, x in m.inputs):
                    continue
                chosen.append(m)
                bound.update(m.nodes)
                read.update(x[0] for _, x in m.inputs)
            if chosen:
                break
        if not chosen:
            break
        g2 = apply_disjoint(g, chosen)
        if window is not None:
            window = window | (set(g2.node_ids()) - set(g.node_ids()))
        g = g2
        steps.extend(RuleStep.of(m) for m in chosen)
    return g, steps


# --- synthetic graphs (scaling benchmark and tests) --------------------------------------------------------

def synthetic_chain(n_ops: int, batch: int = 64, h: int = 256) -> PCG:
    """A chain of ``n_ops`` operators: Linear, Relu, Linear, Relu, ... (each Linear its own weight)."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, h)})
    for i in range(n_ops):
        if i % 2 == 0:
            w = b.add("Weight", {"name": f"w{i}", "shape": (h, h)})
            x = b.add("Linear", {}, [x, w], name=f"fc{i}")
        else:
            x = b.add("Relu", {}, [x], name=f"relu{i}")
    b.set_outputs([x])
    return b.finish()


def synthetic_transformer(layers: int, batch: int = 8, seq: int = 128, hidden: int = 256, heads: int = 4) -> PCG:
    """``layers`` post-LayerNorm Transformer encoder layers (20 operators each): Q/K/V projections,
    heads split by Reshape/Transpose, two BatchMatMuls around a Softmax, output projection, residual
    Add + LayerNorm, a Gelu MLP of 4x hidden, residual Add + LayerNorm."""
    b = PCG.builder()
    d = hidden // heads
    x = b.add("Input", {"name": "x", "shape": (batch, seq, hidden)})

    def w(name, shape):
        return b.add("Weight", {"name": name, "shape": shape})

    for L in range(layers):
        p = f"l{L}."
        q, k, v = (b.add("Linear", {}, [x, w(p + n, (hidden, hidden))], name=p + n) for n in "qkv")
        q, k, v = (b.add("Reshape", {"shape": (batch, seq, heads, d)}, [t]) for t in (q, k, v))
        q = b.add("Transpose", {"perm": (0, 2, 1, 3)}, [q])
        k = b.add("Transpose", {"perm": (0, 2, 3, 1)}, [k])
        v = b.add("Transpose", {"perm": (0, 2, 1, 3)}, [v])
        s = b.add("Softmax", {"axis": -1}, [b.add("BatchMatMul", {}, [q, k])])
        o = b.add("Transpose", {"perm": (0, 2, 1, 3)}, [b.add("BatchMatMul", {}, [s, v])])
        o = b.add("Reshape", {"shape": (batch, seq, hidden)}, [o])
        o = b.add("Linear", {}, [o, w(p + "o", (hidden, hidden))], name=p + "o")
        x = b.add("LayerNorm", {}, [b.add("Add", {}, [o, x]), w(p + "ln1g", (hidden,)), w(p + "ln1b", (hidden,))])
        f = b.add("Gelu", {}, [b.add("Linear", {}, [x, w(p + "ff1", (hidden, 4 * hidden))], name=p + "ff1")])
        f = b.add("Linear", {}, [f, w(p + "ff2", (4 * hidden, hidden))], name=p + "ff2")
        x = b.add("LayerNorm", {}, [b.add("Add", {}, [f, x]), w(p + "ln2g", (hidden,)), w(p + "ln2b", (hidden,))])
    b.set_outputs([x])
    return b.finish()


__all__ = ["synthetic_chain", "synthetic_transformer", "Segment", "segments", "canonicalize", "canonical_segments", "boundary_keys", "trimmed", "trailing", "combine", "assemble", "assemble_by_replay", "cancel_rounds", "apply_disjoint",
           "blocking_pairs", "SegmentChoice"]
