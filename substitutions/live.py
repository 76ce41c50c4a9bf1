"""Apply rule matches in place, touching only the nodes a match rewrites.

:func:`~unity_pcg.substitutions.apply.try_apply` builds a new immutable PCG per match: a pass over the whole
graph (copy, consumer scan, topological sort, consumer index of the result), fine for a search that keeps
its candidates, slow for a caller that applies thousands of steps in a row to one graph (search/realize.py
on a 700-operator model).  :class:`LiveGraph` is a PCG that such a caller rewrites in place:
``apply(m)`` has the result of ``try_apply`` -- the same node ids (the target pattern's nodes take the next
free ids in order), inputs, shapes and consumer order, None where ``try_apply`` returns None (a target
node's shape inference fails, a replaced output changes parallel shape, a removed node keeps a reader, a
cycle) and the graph unchanged then -- at a cost proportional to the match.  ``freeze()`` returns the
ordinary immutable PCG.

Contract: every PCG read (``node``, ``shape(s)``, ``consumers``, ``outputs``, ``topo_order``) is valid between
applications; the live graph must not be rewritten any other way (``edit()`` works on a snapshot).  The
consumer index is kept up to date; a topological numbering (``_pos``) is kept to reject cycles locally (a
full sort only where the numbering leaves no room).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from unity_pcg import ops
from unity_pcg.errors import GraphError, InvalidParallelization
from unity_pcg.pcg import PCG, Node, _unjson_attr, topo_sort

from .match import Match
from .rule import is_var


def _resolve(v: Any, b: dict) -> Any:
    if is_var(v):
        return b[v[1:]]
    if isinstance(v, tuple):
        return tuple(_resolve(x, b) for x in v)
    return v


class LiveGraph(PCG):
    """A PCG rewritten in place by :meth:`apply` (see module docstring)."""

    __slots__ = ("_rank", "_pos", "_clock", "_last")
    #: the smallest gap between topological numbers before the whole graph is renumbered
    MIN_GAP = 1e-6

    def __init__(self, g: PCG):
        super().__init__(dict(g._nodes), dict(g._shapes), g.outputs, g.weights, g.meta)
        cons: dict = defaultdict(list)
        for n in self._nodes.values():
            for p, r in enumerate(n.inputs):
                cons[tuple(r)].append((n.id, p))
        self._consumers = cons
        # insertion rank: a PCG's consumer lists follow its node dict's order, which edits keep (a rewired
        # node stays in place, new nodes come last); kept here so consumers() answers in the same order
        self._rank = {nid: i for i, nid in enumerate(self._nodes)}
        self._clock = len(self._nodes)
        self._pos = {nid: float(i) for i, nid in enumerate(g.topo_order())}
        self._last = None       # what undo() needs to revert the last apply()

    # --- reads ---------------------------------------------------------------------------------
    def consumers(self, ref) -> list[tuple[int, int]]:
        got = self._consumers.get(tuple(ref))
        if not got:
            return []
        if len(got) == 1:
            return list(got)
        rank = self._rank
        return sorted(got, key=lambda c: (rank[c[0]], c[1]))

    def input_shapes(self, nid: int):
        """Read afresh: a live graph's nodes are rewired in place (PCG's kept input shapes would go stale)."""
        shapes = self._shapes
        return tuple([shapes[r[0]][r[1]] for r in self._nodes[nid].inputs])

    def topo_order(self) -> tuple[int, ...]:
        if self._topo is None:
            self._topo = topo_sort(self._nodes)
        return self._topo

    def freeze(self) -> PCG:
        """The immutable PCG this graph is now (nodes in the order an edit chain would hold them)."""
        rank = self._rank
        nodes = {nid: self._nodes[nid] for nid in sorted(self._nodes, key=rank.__getitem__)}
        return PCG(nodes, {nid: self._shapes[nid] for nid in nodes}, self.outputs, self.weights, self.meta)

    # --- rewriting -----------------------------------------------------------------------------
    def apply(self, m: Match) -> list[int] | None:
        """Apply ``m`` in place; the new nodes' ids in the target pattern's order, or None (graph unchanged)
        where :func:`~unity_pcg.substitutions.apply.try_apply` would return None."""
        try:
            return self._apply(m)
        except (InvalidParallelization, GraphError):
            return None

    def _apply(self, m: Match) -> list[int]:
        rule, b, ins = m.rule, m.binding, m.input_map
        nodes, shapes = self._nodes, self._shapes
        nxt = max(nodes) + 1
        new_nodes: dict[int, Node] = {}
        new_shapes: dict[int, tuple] = {}

        def shape(r):
            s = new_shapes.get(r[0])
            if s is None:
                if r[0] not in shapes:
                    raise GraphError(f"input {r} does not exist")
                s = shapes[r[0]]
            if not 0 <= r[1] < len(s):
                raise GraphError(f"input {r} does not exist")
            return s[r[1]]

        refs: list[tuple[int, int]] = []
        for pn in rule.target.nodes:
            spec = ops.get_op(pn.op)
            a = spec.normalize_attrs({k: _unjson_attr(_resolve(v, b)) for k, v in pn.attrs})
            inputs = tuple((int(r[0]), int(r[1])) for r in
                           (ins[r] if isinstance(r, str) else (refs[r[0]][0], r[1]) for r in pn.inputs))
            new_shapes[nxt] = tuple(ops.infer(pn.op, a, [shape(r) for r in inputs]).outputs)
            new_nodes[nxt] = Node(nxt, pn.op, tuple(sorted(a.items())), inputs, "")
            refs.append((nxt, 0))
            nxt += 1

        # the uses each replaced output hands over, in order (as GraphBuilder.replace_uses)
        rewired: dict[int, tuple] = {}          # existing node id -> its new inputs
        outputs = list(self.outputs)
        for so, to in zip(rule.source.outputs, rule.target.outputs):
            old = (m.nodes[so[0]], so[1])
            new = tuple(ins[to]) if isinstance(to, str) else (refs[to[0]][0], to[1])
            if shape(old) != shape(new):
                raise InvalidParallelization(f"rule {rule.name}: target output {shape(new)} differs from source "
                                             f"output {shape(old)}")
            readers = {c for c, _ in self._consumers.get(old, ())} | set(rewired)
            for nid in readers:
                cur = rewired.get(nid, nodes[nid].inputs)
                if old in cur:
                    rewired[nid] = tuple(new if r == old else r for r in cur)
            for nid, n in new_nodes.items():
                if old in n.inputs:
                    new_nodes[nid] = Node(nid, n.op, n.attrs, tuple(new if r == old else r for r in n.inputs), n.name)
            outputs = [new if tuple(r) == old else r for r in outputs]

        gone = set(m.nodes)
        for nid in gone:
            if nid not in nodes:
                raise GraphError(f"cannot remove node {nid}: no such node")
        # a removed node's tensors must have no reader left (GraphBuilder.finish: "reads a missing tensor")
        for nid in gone:
            for k in range(len(shapes[nid])):
                for c, _ in self._consumers.get((nid, k), ()):
                    if c not in gone and (nid, k) in rewired.get(c, nodes[c].inputs):
                        raise GraphError(f"node {c} reads a removed tensor {(nid, k)}")
        for nid, inputs in list(rewired.items()) + [(i, n.inputs) for i, n in new_nodes.items()]:
            if nid in gone:
                continue
            for r in inputs:
                if r[0] in gone:
                    raise GraphError(f"node {nid} reads a removed tensor {r}")
        for r in outputs:
            if r[0] in gone:
                raise GraphError(f"graph output {tuple(r)} refers to a removed node")
        # shapes: every replaced tensor keeps its parallel shape, so no reader's shapes change

        # a topological number for each new node between what it reads and what reads it; else a full sort
        pos = self._pos
        rewired = {nid: r for nid, r in rewired.items() if nid not in gone}
        new_pos = self._place(new_nodes, rewired)
        renumbered = new_pos is None
        if renumbered:
            trial = {i: n for i, n in nodes.items() if i not in gone}
            for nid, inputs in rewired.items():
                n = nodes[nid]
                trial[nid] = Node(n.id, n.op, n.attrs, inputs, n.name)
            trial.update(new_nodes)
            order = topo_sort(trial)            # raises GraphError on a cycle
            new_pos = {nid: float(i) for i, nid in enumerate(order)}

        # commit, journalled for undo()
        self._last = ({nid: nodes[nid] for nid in rewired},
                      {nid: (nodes[nid], shapes[nid], self._rank[nid], pos[nid]) for nid in gone},
                      list(new_nodes), self.outputs, self._clock, dict(pos) if renumbered else None)
        if renumbered:
            pos.clear()
        cons = self._consumers
        for nid, inputs in rewired.items():
            n = nodes[nid]
            for p, r in enumerate(n.inputs):
                cons[r].remove((nid, p))
            nodes[nid] = Node(n.id, n.op, n.attrs, inputs, n.name)
            for p, r in enumerate(inputs):
                cons[r].append((nid, p))
        for nid in gone:
            self._unlink(nid)
            pos.pop(nid, None)
        for nid, n in new_nodes.items():
            nodes[nid] = n
            shapes[nid] = new_shapes[nid]
            self._rank[nid] = self._clock
            self._clock += 1
            for p, r in enumerate(n.inputs):
                cons[r].append((nid, p))
        pos.update(new_pos)
        self.outputs = tuple(tuple(r) for r in outputs)
        self._topo = None
        self._hashes = {}
        return list(new_nodes)

    def _unlink(self, nid: int) -> None:
        """Remove node ``nid`` with its consumer entries (its tensors have no reader left)."""
        cons = self._consumers
        for p, r in enumerate(self._nodes[nid].inputs):
            lst = cons.get(r)
            if lst is not None and (nid, p) in lst:
                lst.remove((nid, p))
        for k in range(len(self._shapes[nid])):
            cons.pop((nid, k), None)
        del self._nodes[nid], self._shapes[nid], self._rank[nid]

    def undo(self) -> None:
        """Revert the last successful :meth:`apply` (one level)."""
        if self._last is None:
            raise GraphError("nothing to undo")
        rewired, gone, added, outputs, clock, old_pos = self._last
        self._last = None
        nodes, cons, pos = self._nodes, self._consumers, self._pos
        for nid, n in rewired.items():
            for q, r in enumerate(nodes[nid].inputs):
                cons[r].remove((nid, q))
        for nid in added:
            self._unlink(nid)
            pos.pop(nid, None)
        for nid, (n, sh, rank, p) in gone.items():
            nodes[nid] = n
            self._shapes[nid] = sh
            self._rank[nid] = rank
            pos[nid] = p
            for q, r in enumerate(n.inputs):
                cons[r].append((nid, q))
        for nid, n in rewired.items():
            nodes[nid] = n
            for q, r in enumerate(n.inputs):
                cons[r].append((nid, q))
        self.outputs = outputs
        self._clock = clock
        if old_pos is not None:
            pos.clear()
            pos.update(old_pos)
        self._topo = None
        self._hashes = {}

    def _place(self, new_nodes: dict[int, Node], rewired: dict[int, tuple]) -> dict[int, float] | None:
        """Topological numbers for the new nodes keeping every edge increasing, or None where the current
        numbering leaves no room (then the caller sorts the whole graph, which also finds a cycle)."""
        pos = self._pos
        lo = -1.0
        for n in new_nodes.values():
            for r in n.inputs:
                if r[0] not in new_nodes:
                    lo = max(lo, pos[r[0]])
        hi = float("inf")
        for nid, inputs in rewired.items():
            if any(r[0] in new_nodes for r in inputs):
                hi = min(hi, pos[nid])
        if hi <= lo:
            return None
        k = len(new_nodes)
        step = 1.0 if hi == float("inf") else (hi - lo) / (k + 1)
        if step < self.MIN_GAP:
            return None
        got = {nid: lo + step * (i + 1) for i, nid in enumerate(new_nodes)}
        # a rewired node may now read an outside tensor directly (a target output that is a pattern input)
        for nid, inputs in rewired.items():
            p = pos[nid]
            if any(got.get(r[0], pos.get(r[0], -2.0)) >= p for r in inputs):
                return None
        return got


__all__ = ["LiveGraph"]
