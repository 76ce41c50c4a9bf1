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


def assemble(g: PCG, segs: Sequence[Segment], choices: Sequence[SegmentChoice], book: RuleBook) -> tuple[PCG, list]:
    """Replay every segment's chosen steps on the whole graph, then cancel at the boundaries."""
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
    g, more = cancel_steps(g, book)
    steps.extend(more)
    return g, steps


__all__ = ["Segment", "segments", "canonicalize", "boundary_keys", "trimmed", "trailing", "combine", "assemble",
           "blocking_pairs", "SegmentChoice"]
