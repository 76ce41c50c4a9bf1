"""The parallel computation graph (DESIGN "PCG").

A DAG of operator nodes whose edges carry ``ParallelTensorShape``.  Inputs and weights are nodes.
A PCG is immutable: edits go through :meth:`PCG.edit`, which returns a :class:`GraphBuilder` over
shallow copies (copy-on-write), and ``finish()`` re-infers only the shapes downstream of a change.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping, Sequence

from . import ops
from .errors import GraphError, InvalidParallelization, UnityError
from .shape import ParallelTensorShape

Ref = tuple  # (node id, output index)

# node roles (PCG.roles): sources; placements (parallel operators reached from a source through parallel
# operators only); other parallel operators; compute operators
ROLES = ("input", "weight", "input-placement", "weight-placement", "parallel", "compute")
PLACEMENT_ROLES = ("input-placement", "weight-placement")


def _canon(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_canon(x) for x in v]
    if isinstance(v, float):
        return repr(v)
    return v


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[Ref, ...]
    name: str = ""

    @property
    def a(self) -> dict:
        return dict(self.attrs)

    @property
    def kind(self) -> str:
        return ops.get_op(self.op).kind

    def label(self) -> str:
        if self.name:
            return self.name
        if self.op in ("Input", "Weight"):
            return str(dict(self.attrs).get("name", f"{self.op}_{self.id}"))
        return f"{self.op}_{self.id}"


class PCG:
    """Immutable parallel computation graph."""

    __slots__ = ("_nodes", "_shapes", "outputs", "weights", "_hashes", "_topo", "_consumers", "meta", "_roles",
                 "_in_shapes")

    def __init__(self, nodes: dict[int, Node], shapes: dict[int, tuple[ParallelTensorShape, ...]],
                 outputs: tuple[Ref, ...], weights: Mapping[str, Any] | None = None,
                 meta: Mapping[str, Any] | None = None, _hashes: dict | None = None):
        self._nodes = nodes
        self._shapes = shapes
        self.outputs = tuple(tuple(o) for o in outputs)
        self.weights = weights if weights is not None else {}
        self.meta = dict(meta or {})
        self._hashes: dict[int, str] = _hashes or {}
        self._topo: tuple[int, ...] | None = None
        self._consumers: dict | None = None
        self._roles: tuple | None = None         # (role, origin, weight-like): PCG.roles, cached
        self._in_shapes: dict = {}               # node -> its input shapes (input_shapes, cached)

    # --- construction --------------------------------------------------------------------------
    @staticmethod
    def builder(weights: Mapping[str, Any] | None = None) -> "GraphBuilder":
        return GraphBuilder({}, {}, [], weights if weights is not None else {}, {})

    def edit(self) -> "GraphBuilder":
        return GraphBuilder(dict(self._nodes), dict(self._shapes), list(self.outputs), self.weights,
                            dict(self._hashes), meta=self.meta)

    # --- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, nid: int) -> bool:
        return nid in self._nodes

    def node(self, nid: int) -> Node:
        return self._nodes[nid]

    def nodes(self) -> Iterator[Node]:
        for nid in self.topo_order():
            yield self._nodes[nid]

    def node_ids(self) -> list[int]:
        return list(self._nodes)

    def shapes(self, nid: int) -> tuple[ParallelTensorShape, ...]:
        return self._shapes[nid]

    def shape(self, ref: Ref) -> ParallelTensorShape:
        return self._shapes[ref[0]][ref[1]]

    def input_shapes(self, nid: int) -> tuple[ParallelTensorShape, ...]:
        hit = self._in_shapes.get(nid)
        if hit is None:
            shapes = self._shapes
            hit = self._in_shapes[nid] = tuple([shapes[r[0]][r[1]] for r in self._nodes[nid].inputs])
        return hit

    def sources(self, op: str | None = None) -> list[Node]:
        return [n for n in self.nodes() if n.kind == "source" and (op is None or n.op == op)]

    def consumers(self, ref: Ref) -> list[tuple[int, int]]:
        """(node id, input position) of every use of ``ref``."""
        if self._consumers is None:
            c: dict = defaultdict(list)
            for n in self._nodes.values():
                for pos, r in enumerate(n.inputs):
                    c[tuple(r)].append((n.id, pos))
            self._consumers = c
        return list(self._consumers.get(tuple(ref), ()))

    def op_counts(self) -> Counter:
        return Counter(n.op for n in self._nodes.values())

    def topo_order(self) -> tuple[int, ...]:
        if self._topo is None:
            self._topo = topo_sort(self._nodes)
        return self._topo

    # --- roles ---------------------------------------------------------------------------------
    def roles(self) -> Mapping[int, str]:
        """Each node's role (one of :data:`ROLES`), the one classification every part reads (cost and
        memory models, mapper, pipeline search, plan checks, lowering); computed once per graph:

        * ``"input"``, ``"weight"``: the sources (Input, Weight nodes);
        * ``"input-placement"``, ``"weight-placement"``: parallel operators reached from a source through
          parallel operators only -- how the data loader feeds an input, where a weight lives;
        * ``"parallel"``: the other parallel operators (they move activations);
        * ``"compute"``: compute operators, random generators included.
        """
        return MappingProxyType(self._classified()[0])

    def origin(self, nid: int) -> int:
        """The node at the start of ``nid``'s chain of parallel operators (followed through their input):
        the source of a placement, the producer of an activation a parallel operator moves; ``nid``
        itself for a source or compute node."""
        return self._classified()[1][nid]

    def weight_like(self) -> frozenset:
        """Nodes whose values depend on weights only: Weight sources and compute operators whose inputs
        are all weight-like (a transposed weight, a constant computed from weights)."""
        return self._classified()[2]

    def _classified(self) -> tuple:
        if self._roles is None:
            role: dict[int, str] = {}
            origin: dict[int, int] = {}
            wl: set = set()
            for nid in self.topo_order():
                n = self._nodes[nid]
                kind = n.kind
                if kind == "source":
                    role[nid] = "input" if n.op == "Input" else "weight"
                    origin[nid] = nid
                    if n.op == "Weight":
                        wl.add(nid)
                elif kind == "parallel":
                    src = n.inputs[0][0]
                    r = role[src]
                    role[nid] = r + "-placement" if r in ("input", "weight") else r if r in PLACEMENT_ROLES \
                        else "parallel"
                    origin[nid] = origin[src]
                else:
                    role[nid] = "compute"
                    origin[nid] = nid
                    if n.inputs and all(x[0] in wl for x in n.inputs):
                        wl.add(nid)
            self._roles = (role, origin, frozenset(wl))
        return self._roles

    # --- hashing -------------------------------------------------------------------------------
    def node_hash(self, nid: int) -> str:
        h = self._hashes.get(nid)
        if h is None:
            for i in self.topo_order():
                if i in self._hashes:
                    continue
                n = self._nodes[i]
                payload = [n.op, [[k, _canon(v)] for k, v in n.attrs],
                           [[self._hashes[r[0]], r[1]] for r in n.inputs]]
                self._hashes[i] = hashlib.blake2b(json.dumps(payload).encode(), digest_size=16).hexdigest()
            h = self._hashes[nid]
        return h

    def structural_hash(self) -> str:
        """Stable across processes and independent of node ids."""
        hs = sorted(self.node_hash(i) for i in self._nodes)
        outs = [[self.node_hash(r[0]), r[1]] for r in self.outputs]
        return hashlib.blake2b(json.dumps([hs, outs]).encode(), digest_size=16).hexdigest()

    # --- checks and stats ------------------------------------------------------------------------
    def check(self) -> None:
        """Re-verify the whole graph: edges point at existing outputs, no cycle, every shape re-infers."""
        for n in self._nodes.values():
            for r in n.inputs:
                if r[0] not in self._nodes or not 0 <= r[1] < len(self._shapes[r[0]]):
                    raise GraphError(f"node {n.label()} ({n.op}) reads a missing tensor {tuple(r)}")
        topo_sort(self._nodes)
        for n in self._nodes.values():
            inf = ops.infer(n.op, n.a, self.input_shapes(n.id))
            if tuple(inf.outputs) != tuple(self._shapes[n.id]):
                raise GraphError(f"node {n.label()} ({n.op}) has stale shapes")
        for r in self.outputs:
            if r[0] not in self._nodes or not 0 <= r[1] < len(self._shapes[r[0]]):
                raise GraphError(f"graph output {tuple(r)} is missing")

    def is_trainable(self, nid: int) -> bool:
        """A Weight is trainable unless it is a constant of the model (attribute ``trainable`` False: the
        importer's folded constants), integer (constant gather indices an importer turns into weights) or
        only feeds inputs that get no gradient (``OpSpec.nondiff_inputs``: BatchNorm's running statistics)."""
        n = self._nodes[nid]
        if n.op != "Weight" or not self._shapes[nid][0].dtype.startswith(("float", "bfloat")):
            return False
        if not n.a.get("trainable", True):
            return False
        uses = self.consumers((nid, 0))
        return not uses or any((self._nodes[u].op, pos) not in ops.NON_DIFFERENTIABLE for u, pos in uses)

    def param_count(self) -> int:
        """Trainable parameters (see :meth:`is_trainable`)."""
        return sum(self._shapes[n.id][0].numel for n in self._nodes.values() if self.is_trainable(n.id))

    def flops(self) -> float:
        """FLOPs of one forward pass (logical)."""
        total = 0.0
        for n in self._nodes.values():
            if n.kind == "compute":
                total += ops.flops(n.op, n.a, self.input_shapes(n.id), self._shapes[n.id])
        return total

    def summary(self) -> dict:
        counts = self.op_counts()
        compute = {k: v for k, v in counts.items() if k not in ("Input", "Weight")}
        return {"ops": sum(compute.values()), "op_types": dict(sorted(compute.items())),
                "inputs": counts.get("Input", 0), "weights": counts.get("Weight", 0),
                "params": self.param_count(), "flops": self.flops()}

    # --- export ----------------------------------------------------------------------------------
    def to_networkx(self):
        import networkx as nx
        g = nx.MultiDiGraph()
        for n in self.nodes():
            g.add_node(n.id, op=n.op, name=n.label(), attrs=n.a, shapes=[str(s) for s in self._shapes[n.id]])
        for n in self._nodes.values():
            for pos, r in enumerate(n.inputs):
                g.add_edge(r[0], n.id, src_output=r[1], dst_input=pos, shape=str(self.shape(r)))
        return g

    def to_dot(self) -> str:
        lines = ["digraph PCG {", "  rankdir=TB;", "  node [shape=box, fontname=Helvetica, fontsize=10];"]
        colors = {"source": "lightgrey", "parallel": "lightblue", "compute": "white"}
        for n in self.nodes():
            lab = f"{n.op}\\n{_esc(n.label())}"
            lines.append(f'  n{n.id} [label="{lab}", style=filled, fillcolor={colors[n.kind]}];')
        for n in self.nodes():
            for r in n.inputs:
                lines.append(f'  n{r[0]} -> n{n.id} [label="{_esc(str(self.shape(r)))}"];')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def render(self, path: str, fmt: str | None = None) -> str:
        """Draw the graph with graphviz's ``dot`` (PNG, SVG, PDF... from the file suffix unless
        ``fmt`` is given); returns the path.  Raises GraphError when graphviz is not installed."""
        import os
        import shutil
        import subprocess
        exe = shutil.which("dot")
        if exe is None:
            raise GraphError("graphviz 'dot' is not installed; write to_dot() to a file instead")
        fmt = fmt or (os.path.splitext(path)[1].lstrip(".") or "png")
        r = subprocess.run([exe, f"-T{fmt}", "-o", path], input=self.to_dot().encode(), capture_output=True)
        if r.returncode != 0:
            msg = r.stderr.decode(errors="replace").strip().splitlines()
            raise GraphError(f"dot failed on {path}: {msg[0] if msg else r.returncode}")
        return path

    def to_json(self) -> dict:
        return {"nodes": [{"id": n.id, "op": n.op, "name": n.name, "attrs": {k: _jsonable(v) for k, v in n.attrs},
                           "inputs": [list(r) for r in n.inputs]} for n in self.nodes()],
                "outputs": [list(r) for r in self.outputs]}

    @staticmethod
    def from_json(obj: Mapping, weights: Mapping[str, Any] | None = None) -> "PCG":
        try:
            b = PCG.builder(weights)
            idmap: dict[int, int] = {}
            for nd in obj["nodes"]:
                if int(nd["id"]) in idmap:
                    raise GraphError(f"malformed PCG JSON: duplicate node id {int(nd['id'])}")
                ins = [(idmap[int(r[0])], int(r[1])) for r in nd["inputs"]]
                idmap[int(nd["id"])] = b.add_node(str(nd["op"]), nd.get("attrs", {}), ins, str(nd.get("name", "")),
                                                  nid=int(nd["id"]))
            b.set_outputs([(idmap[int(r[0])], int(r[1])) for r in obj["outputs"]])
            return b.finish()
        except UnityError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise GraphError(f"malformed PCG JSON: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return f"PCG({len(self._nodes)} nodes, {len(self.outputs)} outputs)"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return v


def _unjson_attr(v: Any) -> Any:
    if not isinstance(v, str):
        return v
    if v == "inf":
        return float("inf")
    if v == "-inf":
        return float("-inf")
    return v


def kahn_order(keys: Iterable, deps) -> tuple[list, object]:
    """Topological order of ``keys`` (smallest ready key first, so the order is deterministic) where
    ``deps(k)`` lists the keys ``k`` reads (repeats allowed).  Returns ``(order, stuck)``: ``stuck`` is
    the smallest key on or behind a cycle, or None when every key was ordered."""
    import heapq
    keys = list(keys)
    indeg = {k: 0 for k in keys}
    users: dict = defaultdict(list)
    for k in keys:
        for d in deps(k):
            indeg[k] += 1
            users[d].append(k)
    ready = [k for k, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        k = heapq.heappop(ready)
        out.append(k)
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    stuck = min((k for k, d in indeg.items() if d > 0), default=None) if len(out) != len(keys) else None
    return out, stuck


def topo_sort(nodes: Mapping[int, Node]) -> tuple[int, ...]:
    """:func:`kahn_order` of the nodes (smallest ready id first), inlined: every rule application sorts
    its result, so this is on the rule machinery's hot path."""
    import heapq
    indeg: dict = {}
    users: dict = {}
    ready = []
    for i, n in nodes.items():
        c = 0
        for r in n.inputs:
            p = r[0]
            if p in nodes:
                c += 1
                u = users.get(p)
                if u is None:
                    users[p] = [i]
                else:
                    u.append(i)
        if c:
            indeg[i] = c
        else:
            ready.append(i)
    heapq.heapify(ready)
    out = []
    pop, push, none = heapq.heappop, heapq.heappush, ()
    while ready:
        k = pop(ready)
        out.append(k)
        for u in users.get(k, none):
            d = indeg[u] - 1
            if d:
                indeg[u] = d
            else:
                del indeg[u]
                push(ready, u)
    if indeg:
        n = nodes[min(indeg)]
        raise GraphError(f"the graph has a cycle through node {n.label()} ({n.op})")
    return tuple(out)


class GraphBuilder:
    """Mutable staging area for a PCG; ``finish()`` returns the immutable graph."""

    def __init__(self, nodes, shapes, outputs, weights, hashes, meta=None):
        self._nodes: dict[int, Node] = nodes
        self._shapes: dict[int, tuple[ParallelTensorShape, ...]] = shapes
        self._outputs: list[Ref] = outputs
        self._weights = weights
        self._hashes = hashes
        self._dirty: set[int] = set()
        self._next = max(nodes, default=-1) + 1
        self.meta = dict(meta or {})

    def shape(self, ref: Ref) -> ParallelTensorShape:
        return self._shapes[ref[0]][ref[1]]

    def node(self, nid: int) -> Node:
        return self._nodes[nid]

    def add_node(self, op: str, attrs: Mapping[str, Any] | None = None, inputs: Sequence[Ref] = (),
                 name: str = "", nid: int | None = None) -> int:
        spec = ops.get_op(op)
        a = spec.normalize_attrs({k: _unjson_attr(v) for k, v in (attrs or {}).items()})
        inputs = tuple((int(r[0]), int(r[1])) for r in inputs)
        for r in inputs:
            if r[0] not in self._nodes or not 0 <= r[1] < len(self._shapes[r[0]]):
                raise GraphError(f"{name or op}: input {r} does not exist")
        if nid is None or nid in self._nodes:
            nid = self._next
        self._next = max(self._next, nid + 1)
        try:
            inf = ops.infer(op, a, [self.shape(r) for r in inputs])
        except InvalidParallelization as e:
            raise InvalidParallelization(f"{name}: {e}" if name else str(e)) from None
        node = Node(nid, op, tuple(sorted(a.items())), inputs, name)
        self._nodes[nid] = node
        self._shapes[nid] = tuple(inf.outputs)
        return nid

    def add_like(self, node: Node, inputs: Sequence[Ref] = (), nid: int | None = None,
                 outputs: Sequence[ParallelTensorShape] | None = None, name: str | None = None) -> int:
        """:meth:`add_node` for a copy of ``node`` (a node of a PCG, its attributes already normalized) on
        ``inputs``: its operator, attributes and name (``name``: another); ``outputs``: its output shapes
        when the caller has inferred them on these inputs (:func:`ops.infer`), else inferred here."""
        inputs = tuple((int(r[0]), int(r[1])) for r in inputs)
        nodes, shapes = self._nodes, self._shapes
        name = node.name if name is None else name
        for r in inputs:
            if r[0] not in nodes or not 0 <= r[1] < len(shapes[r[0]]):
                raise GraphError(f"{name or node.op}: input {r} does not exist")
        if nid is None or nid in nodes:
            nid = self._next
        self._next = max(self._next, nid + 1)
        if outputs is None:
            try:
                outputs = ops.infer(node.op, dict(node.attrs), [shapes[r[0]][r[1]] for r in inputs]).outputs
            except InvalidParallelization as e:
                raise InvalidParallelization(f"{name}: {e}" if name else str(e)) from None
        nodes[nid] = Node(nid, node.op, node.attrs, inputs, name)
        shapes[nid] = tuple(outputs)
        return nid

    def add(self, op: str, attrs: Mapping[str, Any] | None = None, inputs: Sequence[Ref] = (),
            name: str = "") -> Ref:
        """Add a node and return a reference to its first output."""
        return (self.add_node(op, attrs, inputs, name), 0)

    def set_outputs(self, refs: Iterable[Ref]) -> None:
        self._outputs = [tuple(r) for r in refs]

    def replace_uses(self, old: Ref, new: Ref, exclude: Iterable[int] = ()) -> None:
        """Point every consumer of ``old`` (and graph outputs) at ``new``."""
        old, new = tuple(old), tuple(new)
        skip = set(exclude)
        for nid, n in list(self._nodes.items()):
            if nid in skip or old not in n.inputs:
                continue
            self._nodes[nid] = Node(n.id, n.op, n.attrs, tuple(new if r == old else r for r in n.inputs), n.name)
            self._dirty.add(nid)
        self._outputs = [new if tuple(r) == old else r for r in self._outputs]

    def replace_uses_many(self, pairs: Mapping[Ref, Ref], exclude: Iterable[int] = ()) -> None:
        """:meth:`replace_uses` for several tensors in one pass over the nodes: every consumer of an ``old``
        (and graph outputs), but those in ``exclude``, reads its ``new`` instead (one replacement each: a
        ``new`` is not replaced again)."""
        sub = {tuple(o): tuple(n) for o, n in pairs.items()}
        skip = set(exclude)
        for nid, n in list(self._nodes.items()):
            if nid in skip or not any(r in sub for r in n.inputs):
                continue
            self._nodes[nid] = Node(n.id, n.op, n.attrs, tuple(sub.get(r, r) for r in n.inputs), n.name)
            self._dirty.add(nid)
        self._outputs = [sub.get(tuple(r), r) for r in self._outputs]

    def set_inputs(self, nid: int, inputs: Sequence[Ref]) -> None:
        n = self._nodes[nid]
        self._nodes[nid] = Node(n.id, n.op, n.attrs, tuple(tuple(r) for r in inputs), n.name)
        self._dirty.add(nid)

    def remove(self, nid: int) -> None:
        if nid not in self._nodes:
            raise GraphError(f"cannot remove node {nid}: no such node")
        del self._nodes[nid]
        del self._shapes[nid]
        self._dirty.add(nid)

    def remove_dead(self) -> None:
        """Drop nodes that no graph output depends on."""
        live: set[int] = set()
        stack = [r[0] for r in self._outputs]
        while stack:
            i = stack.pop()
            if i in live or i not in self._nodes:
                continue
            live.add(i)
            stack.extend(r[0] for r in self._nodes[i].inputs)
        for i in [i for i in self._nodes if i not in live]:
            self.remove(i)

    def finish(self) -> PCG:
        for n in self._nodes.values():   # a removed node may still have consumers
            for r in n.inputs:
                if r[0] not in self._nodes:
                    raise GraphError(f"node {n.label()} ({n.op}) reads a missing tensor {tuple(r)}")
        order = topo_sort(self._nodes)
        users: dict[int, list[int]] = defaultdict(list)
        for n in self._nodes.values():
            for r in n.inputs:
                users[r[0]].append(n.id)
        # invalidate hashes downstream of any change
        stale = set(self._dirty)
        for i in order:
            if i in stale:
                continue
            if any(r[0] in stale for r in self._nodes[i].inputs):
                stale.add(i)
        for i in order:
            if i in self._dirty:
                n = self._nodes[i]
                for r in n.inputs:
                    if r[0] not in self._nodes or not 0 <= r[1] < len(self._shapes[r[0]]):
                        raise GraphError(f"node {n.label()} ({n.op}) reads a missing tensor {tuple(r)}")
                try:
                    inf = ops.infer(n.op, n.a, [self.shape(r) for r in n.inputs])
                except InvalidParallelization as e:
                    raise InvalidParallelization(f"{n.label()}: {e}") from None
                if tuple(inf.outputs) != self._shapes.get(i):
                    self._shapes[i] = tuple(inf.outputs)
                    self._dirty.update(users[i])
        for r in self._outputs:
            if r[0] not in self._nodes:
                raise GraphError(f"graph output {tuple(r)} refers to a removed node")
        hashes = {k: v for k, v in self._hashes.items() if k not in stale and k in self._nodes}
        g = PCG(self._nodes, self._shapes, tuple(self._outputs), self._weights, self.meta, hashes)
        g._topo = order
        self._hashes = dict(hashes)   # a builder reused after finish() must not keep stale hashes
        self._nodes, self._shapes = dict(self._nodes), dict(self._shapes)  # builder stays usable
        self._dirty = set()
        return g
