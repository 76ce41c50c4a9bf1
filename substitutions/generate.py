"""Candidate rule generator (TASO's method, extended with parallel operators as in Unity §4).

1. **Enumerate** every graph of up to ``max_ops`` operators over a fixed operator list (compute and
   parallel operators with concrete dims and degrees) and fixed input tensors of a small symbolic size
   (4x4, so every degree in ``degrees`` divides every dim).  Graphs are built one operator at a time;
   an operator whose input parallelization is invalid is dropped with everything built on it.  No two
   operators may compute the same thing (common subexpressions), every operator but the last must be
   used, inputs appear in canonical order (renaming symmetry).
2. **Fingerprint** each graph: evaluate it piecewise (``ops.run_pieces``) on fixed random *integer*
   inputs (two draws, so no float noise and few false collisions), with polynomial stand-ins for
   non-polynomial operators (Relu -> x*x + x; the stand-in is element-wise and non-linear, as the axioms
   require), and hash the output's logical value together with its parallel shape (every shard degree,
   sum and copy degree: Unity's extension).
3. **Pair** graphs with equal fingerprints: each graph with the smallest graph of its class (the class
   representative; every equality in the class follows by composing two such rules, one reversed).
4. **Prune** as TASO does: pairs sharing a common subgraph (the same operator on the same inputs in both
   sides: a smaller rule with that subgraph as an input implies it), pairs with a common supergraph
   (same root operator whose arguments are pairwise equivalent: implied by a smaller rule), and
   duplicates up to renaming of inputs and variables (after generalization).
5. **Generalize**: degree constants become degree variables and dim constants dim variables (``d <=``
   the enumerated value, so "any batch-like dim" generalizes), to be proven by the verifier; if the general
   form is not proven, the concrete form is tried.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg import pieces as P
from unity_pcg.errors import InvalidParallelization, ShapeError
from unity_pcg.shape import ParallelTensorShape

from .rule import PatNode, Pattern, Rule, _freeze, is_var

GENERATOR_VERSION = "1"
RETRY_FACTOR = 10      # budget multiplier for the second attempt at numerically true candidates

# --- settings -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    max_ops: int = 3
    degrees: tuple[int, ...] = (2,)
    size: int = 4
    rank: int = 2
    n_inputs: int = 3                      # distinct inputs per graph at most
    input_kinds: tuple[str, ...] = ("plain", "plain", "plain", "rows", "cols", "sum")
    compute_ops: tuple[str, ...] = ("Relu", "Add", "Mul", "MatMul", "Linear_relu", "Concat")
    parallel_ops: tuple[str, ...] = ("Partition", "Combine", "Replicate", "Reduce")
    seed: int = 1234
    draws: int = 2

    def to_json(self) -> dict:
        return {"max_ops": self.max_ops, "degrees": list(self.degrees), "size": self.size, "rank": self.rank,
                "n_inputs": self.n_inputs, "input_kinds": list(self.input_kinds), "compute_ops": list(self.compute_ops),
                "parallel_ops": list(self.parallel_ops), "seed": self.seed, "draws": self.draws,
                "generator_version": GENERATOR_VERSION}


def op_variants(st: Settings) -> list[tuple[str, tuple, int]]:
    """(op, attrs, arity) for every operator instance the enumerator may add."""
    dims = list(range(-st.rank, 0))
    out: list[tuple[str, tuple, int]] = []
    for name in st.compute_ops:
        if name == "Linear":
            out.append(("Linear", (), 2))
        elif name == "Linear_relu":
            out.append(("Linear", (("activation", "relu"),), 2))
        elif name == "Concat":
            out += [("Concat", (("axis", d),), 2) for d in dims]
        else:
            n = ops.get_op(name).num_inputs
            out.append((name, (), n if isinstance(n, int) else n[0]))
    for name in st.parallel_ops:
        if name in ("Partition", "Combine", "Pipeline", "Batch"):
            out += [(name, (("degree", k), ("dim", d)), 1) for d in dims for k in st.degrees]
        else:
            out += [(name, (("degree", k),), 1) for k in st.degrees]
    return out


# --- piecewise evaluation with polynomial stand-ins ------------------------------------------------------

def _relu_standin(x: np.ndarray) -> np.ndarray:
    return x * x + x


def slot_shape(st: Settings, k: int, dtype: str = "int64") -> ParallelTensorShape:
    """The parallel shape of input slot ``k``: plain, rows/cols partitioned, or partial sums."""
    kind = st.input_kinds[k]
    d = st.degrees[0]
    sizes = (st.size,) * st.rank
    if kind == "plain":
        return ParallelTensorShape.of(sizes, dtype=dtype)
    if kind == "rows":
        return ParallelTensorShape.of(sizes, (d,) + (1,) * (st.rank - 1), dtype=dtype)
    if kind == "cols":
        return ParallelTensorShape.of(sizes, (1,) * (st.rank - 1) + (d,), dtype=dtype)
    if kind == "sum":
        return ParallelTensorShape.of(sizes, sum_degree=d, dtype=dtype)
    if kind == "copy":
        return ParallelTensorShape.of(sizes, copy_degree=d, dtype=dtype)
    raise ValueError(f"unknown input kind {kind!r}")


def run_op(op: str, attrs: dict, xs: Sequence[np.ndarray], shapes: Sequence[ParallelTensorShape]):
    """ops.run_pieces, with Relu (and Linear's relu activation) replaced by an integer polynomial."""
    spec = ops.get_op(op)
    if op == "Relu" or (op == "Linear" and attrs.get("activation", "none") == "relu"):
        inf = ops.infer(op, attrs, shapes)
        pa = spec.piece_attrs(attrs, tuple(shapes), inf.outputs) if spec.piece_attrs else attrs
        if op == "Relu":
            kern = lambda a, v: [_relu_standin(v[0])]  # noqa: E731
        else:
            kern = lambda a, v: [_relu_standin(v[0] @ v[1])]  # noqa: E731
        return P.run_piecewise(kern, attrs, pa, inf.piece_map, xs, shapes, inf.outputs), inf.outputs
    return ops.run_pieces(op, attrs, xs, shapes)


# --- enumeration ------------------------------------------------------------------------------------------

@dataclass
class Graph:
    """A candidate graph: ops as (op, attrs, args); an arg is ("i", k) for input k or ("o", j)."""
    nodes: tuple[tuple[str, tuple, tuple], ...]
    fingerprint: str
    n_inputs_used: Any
    arg_fps: tuple[str, ...] = ()           # fingerprints of the root's arguments
    node_fps: tuple[str, ...] = ()          # fingerprint of each node

    @property
    def size(self) -> int:
        return len(self.nodes)


def _fp(shape: ParallelTensorShape, logical: Sequence[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(shape.to_json(), sort_keys=True).encode())
    for v in logical:
        h.update(str(v.shape).encode())
        h.update(np.ascontiguousarray(v.astype(np.int64)).tobytes())
    return h.hexdigest()


class Enumerator:
    def __init__(self, st: Settings):
        self.st = st
        self.variants = op_variants(st)
        rng = np.random.default_rng(st.seed)
        self.shapes = [slot_shape(st, k) for k in range(len(st.input_kinds))]
        self.inputs = [[rng.integers(-2, 3, size=s.sizes).astype(np.int64) for s in self.shapes]
                       for _ in range(st.draws)]
        self._split_rng = np.random.default_rng(st.seed + 1)

    def input_fp(self, k: int) -> str:
        return _fp(self.shapes[k], [d[k] for d in self.inputs])

    def available(self, used: frozenset) -> list[int]:
        """Input slots a new operator may read: used ones, plus the first unused slot of each kind
        (renaming symmetry) while fewer than ``n_inputs`` are used."""
        out = sorted(used)
        if len(used) < self.st.n_inputs:
            seen = set()
            for k, kind in enumerate(self.st.input_kinds):
                if k not in used and kind not in seen:
                    out.append(k)
                seen.add(kind) if k not in used else None
        return out

    def enumerate(self, first: Iterable[int] | None = None, progress: Callable | None = None) -> list[Graph]:
        """Every graph (as a list) whose first operator variant index is in ``first``."""
        st = self.st
        out: list[Graph] = []
        # tensors: list of (key, shape, [pieces per draw], fp)
        inputs = []
        for k in range(len(st.input_kinds)):
            pieces = [P.split(d[k], self.shapes[k], self._split_rng) for d in self.inputs]
            inputs.append((("i", k), self.shapes[k], pieces, self.input_fp(k)))
        firsts = list(range(len(self.variants))) if first is None else list(first)

        def rec(nodes, tensors, keys, used_inputs, unused, depth, fps):
            # record the graph if every op but the last is used
            if nodes and unused <= {len(nodes) - 1}:
                last = tensors[-1]
                root = nodes[-1]
                arg_fps = tuple(self._tfp(a, tensors, used_inputs) for a in root[2])
                out.append(Graph(tuple(nodes), last[3], used_inputs, arg_fps, tuple(fps)))
            if depth == st.max_ops:
                return
            if len(unused) > st.max_ops - depth:      # cannot use them all any more
                return
            vlist = firsts if depth == 0 else range(len(self.variants))
            avail = [("i", k) for k in self.available(used_inputs)] + \
                    [("o", j) for j in range(len(nodes))]
            for vi in vlist:
                opn, attrs, arity = self.variants[vi]
                for args in itertools.product(avail, repeat=arity):
                    new_inputs = used_inputs
                    ok = True
                    for a in args:           # canonical input order within each kind
                        if a[0] == "i" and a[1] not in new_inputs:
                            if a[1] not in self.available(new_inputs):
                                ok = False
                                break
                            new_inputs = new_inputs | {a[1]}
                    if not ok:
                        continue
                    key = (opn, attrs, args)
                    if key in keys:
                        continue
                    xs_shapes = [self._tensor(a, tensors, inputs) for a in args]
                    try:
                        res = []
                        shape = None
                        for d in range(st.draws):
                            ys, oshapes = run_op(opn, dict(attrs), [t[2][d] for t in xs_shapes],
                                                 [t[1] for t in xs_shapes])
                            res.append(ys[0])
                            shape = oshapes[0]
                    except (InvalidParallelization, ShapeError):
                        continue
                    if any(np.abs(r).max(initial=0) > 1 << 40 for r in res):
                        continue
                    logical = [P.join(r, shape) for r in res]
                    fp = _fp(shape, logical)
                    node = (opn, attrs, args)
                    nu = set(unused)
                    for a in args:
                        if a[0] == "o":
                            nu.discard(a[1])
                    nu.add(len(nodes))
                    tensors.append((("o", len(nodes)), shape, res, fp))
                    nodes.append(node)
                    keys.add(key)
                    fps.append(fp)
                    rec(nodes, tensors, keys, new_inputs, nu, depth + 1, fps)
                    fps.pop()
                    keys.discard(key)
                    nodes.pop()
                    tensors.pop()
                if depth == 0 and progress:
                    progress()

        rec([], [], set(), frozenset(), set(), 0, [])
        return out

    def _tensor(self, a, tensors, inputs):
        if a[0] == "i":
            return inputs[a[1]]
        return tensors[a[1]]

    def _tfp(self, a, tensors, used):
        if a[0] == "i":
            return self.input_fp(a[1])
        return tensors[a[1]][3]


def _enum_worker(args):
    st_json, firsts = args
    st = Settings(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in st_json.items()
                     if k != "generator_version"})
    return Enumerator(st).enumerate(firsts)


# --- pairing and pruning -----------------------------------------------------------------------------------

def _node_keys(g: Graph) -> list[tuple]:
    """Structural key of every node (inputs by index), for common-subgraph detection."""
    keys: list[tuple] = []
    for opn, attrs, args in g.nodes:
        ka = tuple(("i", a[1]) if a[0] == "i" else keys[a[1]] for a in args)
        keys.append((opn, attrs, ka))
    return keys


def _inputs_of(g: Graph) -> set[int]:
    return {a[1] for _, _, args in g.nodes for a in args if a[0] == "i"}


def prune_reason(a: Graph, b: Graph) -> str | None:
    """Why the pair (a, b) is implied by a smaller rule (TASO's pruning), or None."""
    if a.size and b.size:
        ka, kb = _node_keys(a), _node_keys(b)
        if set(ka) & set(kb):
            return "common subgraph"
        ra, rb = a.nodes[-1], b.nodes[-1]
        if ra[0] == rb[0] and ra[1] == rb[1] and len(ra[2]) == len(rb[2]) and a.arg_fps == b.arg_fps:
            return "common supergraph"
    return None


@dataclass
class GenStats:
    graphs: int = 0
    classes: int = 0
    candidates: int = 0
    pruned: dict = field(default_factory=lambda: defaultdict(int))
    generalized: int = 0
    proven: int = 0
    unproven: int = 0
    duplicates: int = 0
    false_candidates: int = 0
    enumerate_seconds: float = 0.0
    verify_seconds: float = 0.0


def candidate_pairs(graphs: list[Graph], inputs: list[Graph], stats: GenStats) -> list[tuple[Graph, Graph]]:
    classes: dict[str, list[Graph]] = defaultdict(list)
    for g in inputs + graphs:
        classes[g.fingerprint].append(g)
    stats.classes = len(classes)
    pairs = []
    for fp, gs in classes.items():
        if len(gs) < 2:
            continue
        gs.sort(key=lambda g: (g.size, repr(g.nodes)))
        rep = gs[0]
        for g in gs[1:]:
            if _inputs_of(g) != _inputs_of(rep):
                stats.pruned["different inputs"] += 1
                continue
            why = prune_reason(g, rep)
            if why:
                stats.pruned[why] += 1
                continue
            pairs.append((g, rep))
    stats.candidates = len(pairs)
    return pairs


# --- graphs to rules -----------------------------------------------------------------------------------------

def graph_pattern(g: Graph, names: Sequence[str]) -> Pattern:
    if not g.nodes:
        raise ValueError("an input graph has no pattern")
    nodes = tuple(PatNode(opn, attrs, tuple(names[a[1]] if a[0] == "i" else (a[1], 0) for a in args))
                  for opn, attrs, args in g.nodes)
    return Pattern(nodes, ((len(nodes) - 1, 0),))


def pair_rule(src: Graph, tgt: Graph, name: str) -> Rule:
    used = sorted(_inputs_of(src) | _inputs_of(tgt))
    names = [f"x{k}" for k in range(max(used) + 1)] if used else []
    sp = graph_pattern(src, names)
    if tgt.nodes:
        tp = graph_pattern(tgt, names)
    else:   # the target is an input itself
        k = int(tgt.nodes_input) if hasattr(tgt, "nodes_input") else None
        tp = Pattern((), (names[k],))
    ins = tuple(n for n in names if n in set(sp.inputs_used()) | set(tp.inputs_used()))
    st = _CURRENT_SETTINGS[0]
    ex = {"bind": {}, "shapes": {n: slot_shape(st, int(n[1:])).to_json() for n in ins}, "ints": [],
          "values": "int"}
    r = Rule(name, ins, sp, tp, (), (), "generated", (), json.dumps(ex, sort_keys=True))
    return canonical(r)


_CURRENT_SETTINGS: list = [Settings()]


def canonical(r: Rule) -> Rule:
    """Rename inputs (x0, x1, ...) and variables (in order of first appearance in the source)."""
    order: list[str] = []
    vorder: list[str] = []

    def see(p: Pattern):
        for n in p.nodes:
            for _, v in sorted(n.attrs):
                for x in (v if isinstance(v, tuple) else (v,)):
                    if is_var(x) and x[1:] not in vorder:
                        vorder.append(x[1:])
            for i in n.inputs:
                if isinstance(i, str) and i not in order:
                    order.append(i)
        for o in p.outputs:
            if isinstance(o, str) and o not in order:
                order.append(o)
    see(r.source)
    see(r.target)
    ren = {n: f"x{k}" for k, n in enumerate(order)}
    kinds = r.var_kinds
    vren = {}
    counters: dict[str, int] = defaultdict(int)
    letters = {"dim": "d", "fdim": "f", "degree": "k", "attr": "a"}
    for v in vorder:
        kd = kinds[v]
        vren[v] = f"{letters[kd]}{counters[kd]}"
        counters[kd] += 1

    def rv(v):
        if is_var(v):
            return "$" + vren[v[1:]]
        if isinstance(v, tuple):
            return tuple(rv(x) for x in v)
        return v

    def rp(p: Pattern) -> Pattern:
        nodes = tuple(PatNode(n.op, tuple(sorted((k, rv(v)) for k, v in n.attrs)),
                              tuple(ren[i] if isinstance(i, str) else i for i in n.inputs)) for n in p.nodes)
        return Pattern(nodes, tuple(ren[o] if isinstance(o, str) else o for o in p.outputs))
    cons = tuple(sorted(((rv(a), o, rv(b)) for a, o, b in r.constraints), key=repr))
    example = r.example
    if example:
        ex = json.loads(example)
        ex["shapes"] = {ren.get(n, n): v for n, v in ex.get("shapes", {}).items() if n in ren}
        ex["bind"] = {vren.get(k, k): v for k, v in ex.get("bind", {}).items()}
        example = json.dumps(ex, sort_keys=True)
    return Rule(r.name, tuple(ren[n] for n in order), rp(r.source), rp(r.target),
                tuple(sorted((vren[v], k) for v, k in r.vars if v in vren)), cons, r.origin, r.proof, example)


def generalizations(r: Rule) -> list[Rule]:
    """Forms of a concrete rule from most to least general: (1) degrees and dims as variables with
    ``d <= value`` constraints and distinct dims kept distinct, (2) degrees only, (3) as is."""
    dims_vals: list[int] = []
    deg_vals: list[int] = []
    for p in (r.source, r.target):
        for n in p.nodes:
            a = n.a
            if "dim" in a and isinstance(a["dim"], int) and a["dim"] not in dims_vals:
                dims_vals.append(a["dim"])
            if "degree" in a and isinstance(a["degree"], int) and a["degree"] not in deg_vals:
                deg_vals.append(a["degree"])
    forms = []
    for gen_dims in (True, False):
        if gen_dims and not dims_vals:
            continue
        if not deg_vals and not gen_dims:
            continue
        dmap = {v: f"$d{i}" for i, v in enumerate(sorted(dims_vals))} if gen_dims else {}
        kmap = {v: f"$k{i}" for i, v in enumerate(sorted(deg_vals))}

        def sub(p: Pattern) -> Pattern:
            nodes = []
            for n in p.nodes:
                at = []
                for k, v in n.attrs:
                    if k == "dim" and v in dmap:
                        v = dmap[v]
                    elif k == "degree" and v in kmap:
                        v = kmap[v]
                    at.append((k, v))
                nodes.append(PatNode(n.op, tuple(sorted(at)), n.inputs))
            return Pattern(tuple(nodes), p.outputs)
        vars_ = {v[1:]: "dim" for v in dmap.values()}
        vars_.update({v[1:]: "degree" for v in kmap.values()})
        cons = [(dmap[v], "<=", v) for v in dims_vals if v < -1 and gen_dims]
        if gen_dims:   # a generalized dim stays distinct from the operator axes it differed from
            axes = sorted({n.a["axis"] for p in (r.source, r.target) for n in p.nodes
                           if isinstance(n.a.get("axis"), int)})
            cons += [(dmap[v], "!=", a) for v in dims_vals for a in axes if a != v]
        ds = sorted(dmap.values())
        cons += [(a, "!=", b) for a, b in itertools.combinations(ds, 2)]
        ks = sorted(kmap.values())
        cons += [(a, "!=", b) for a, b in itertools.combinations(ks, 2)]
        g = Rule(r.name, r.inputs, sub(r.source), sub(r.target), tuple(sorted(vars_.items())),
                 tuple(cons), r.origin)
        forms.append(canonical(g))
    forms.append(r)
    return forms


def pattern_cse(p: Pattern) -> Pattern:
    """Merge identical nodes (same op, attrs and inputs) of a pattern."""
    nodes: list[PatNode] = []
    memo: dict[tuple, int] = {}
    remap: dict[int, int] = {}
    for i, n in enumerate(p.nodes):
        ins = tuple(x if isinstance(x, str) else (remap[x[0]], x[1]) for x in n.inputs)
        key = (n.op, n.attrs, ins)
        if key not in memo:
            nodes.append(PatNode(n.op, n.attrs, ins))
            memo[key] = len(nodes) - 1
        remap[i] = memo[key]
    # drop nodes no longer reachable from the outputs
    live = set()
    stack = [o[0] for o in p.outputs if not isinstance(o, str)]
    outs = [o if isinstance(o, str) else (remap[o[0]], o[1]) for o in p.outputs]
    stack = [o[0] for o in outs if not isinstance(o, str)]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack += [x[0] for x in nodes[i].inputs if not isinstance(x, str)]
    keep = sorted(live)
    pos = {i: k for k, i in enumerate(keep)}
    nn = tuple(PatNode(nodes[i].op, nodes[i].attrs, tuple(x if isinstance(x, str) else (pos[x[0]], x[1])
                                                          for x in nodes[i].inputs)) for i in keep)
    return Pattern(nn, tuple(o if isinstance(o, str) else (pos[o[0]], o[1]) for o in outs))


def _set_partitions(items: list[str]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def merged_instances(r: Rule) -> list[str]:
    """Keys of the rules obtained from ``r`` by identifying some of its inputs (its instances)."""
    keys = []
    names = list(r.inputs)
    for part in _set_partitions(names):
        if len(part) == len(names):
            continue
        ren = {n: grp[0] for grp in part for n in grp}

        def rp(p: Pattern) -> Pattern:
            nodes = tuple(PatNode(n.op, n.attrs, tuple(ren[i] if isinstance(i, str) else i for i in n.inputs))
                          for n in p.nodes)
            return pattern_cse(Pattern(nodes, tuple(ren[o] if isinstance(o, str) else o for o in p.outputs)))
        src, tgt = rp(r.source), rp(r.target)
        ins = tuple(dict.fromkeys(src.inputs_used() + tgt.inputs_used()))
        q = Rule(r.name, ins, src, tgt, r.vars, r.constraints, r.origin)
        try:
            keys.append(rule_key(q))
        except Exception:
            continue
    return keys


def _walk_pairs(general: Rule, concrete: Rule):
    for pg, pc in ((general.source, concrete.source), (general.target, concrete.target)):
        for ng, nc in zip(pg.nodes, pc.nodes):
            yield ng, nc
        for og, oc in zip(pg.outputs, pc.outputs):
            if isinstance(og, str) and isinstance(oc, str):
                yield og, oc


def _bind_by_names(general: Rule, concrete: Rule) -> dict:
    """Variable values of ``general`` read off the concrete rule it generalizes (same structure)."""
    b = {}
    for ng, nc in _walk_pairs(general, concrete):
        if isinstance(ng, str):
            continue
        for (k, v), (_, c) in zip(ng.attrs, nc.attrs):
            if is_var(v):
                b[v[1:]] = c
    return b


def _renamed_shapes(general: Rule, concrete: Rule, shapes: dict) -> dict:
    ren = {}
    for ng, nc in _walk_pairs(general, concrete):
        if isinstance(ng, str):
            ren[ng] = nc
            continue
        for a, c in zip(ng.inputs, nc.inputs):
            if isinstance(a, str):
                ren[a] = c
    return {n: shapes[ren[n]] for n in general.inputs}


def _false_under_real_kernels(r: Rule, st: Settings) -> bool:
    from unity_pcg.verifier.selfcheck import compare_sides
    shapes = {n: ParallelTensorShape.from_json(v).with_dtype("float64")
              for n, v in json.loads(r.example)["shapes"].items()}
    rng = np.random.default_rng(st.seed)
    for _ in range(2):
        vals = {n: rng.standard_normal(s.sizes) for n, s in shapes.items()}
        if compare_sides(r.source, r.target, {}, shapes, vals, rng):
            return True
    return False


def example_for(general: Rule, concrete: Rule, st: Settings) -> str:
    """A valid instance of ``general``: the enumerated one (bindings found by matching the concrete
    source graph), as JSON for the rule file."""
    from .match import find_matches
    from .terms import instantiate
    shapes = {n: ParallelTensorShape.from_json(v) for n, v in json.loads(concrete.example)["shapes"].items()}
    if any(s.sum_degree > 1 for s in shapes.values()):
        # instance graphs cannot start from partial sums: bind by matching a sum-free stand-in
        return json.dumps({"bind": _bind_by_names(general, concrete), "shapes": {n: s.to_json() for n, s in
                           _renamed_shapes(general, concrete, shapes).items()}, "ints": [], "values": "int"},
                          sort_keys=True)
    g = instantiate(concrete.source, {}, shapes, list(concrete.inputs))
    ms = find_matches(general, g, degrees=st.degrees)
    bind = dict(ms[0].binding) if ms else {}
    # input names of the general rule, fed in the order matched
    ins = dict(ms[0].inputs) if ms else {}
    by_ref = {tuple(r): name for name, r in g.meta["inputs"].items()}
    shapes_g = {name: shapes[by_ref[ref]] for name, ref in ins.items()} if ms else \
        {n: shapes[n] for n in general.inputs}
    return json.dumps({"bind": {k: list(v) if isinstance(v, tuple) else v for k, v in bind.items()},
                       "shapes": {n: s.to_json() for n, s in shapes_g.items()}, "ints": [], "values": "int"},
                      sort_keys=True)


def rule_key(r: Rule) -> str:
    """Identity up to renaming and direction."""
    a = canonical(r).body_key()
    if r.reversible:
        b = canonical(r.reversed()).body_key()
        return min(a, b)
    return a


def rule_name(r: Rule) -> str:
    """A stable, readable name from the rule's content."""
    ops_s = "_".join(n.op for n in r.source.nodes)
    ops_t = "_".join(n.op for n in r.target.nodes) or "id"
    h = canonical(r).body_key()[:6]
    return f"gen_{ops_s}__{ops_t}_{h}"


# --- driver ----------------------------------------------------------------------------------------------

class Progress:
    """Progress of a generation phase on stderr: a tqdm bar where stderr is a terminal
    (:mod:`unity_pcg.progress`), else one line rewritten in place (at most every 0.2 s)."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        from unity_pcg.progress import bar, enabled as tty
        stream = sys.stderr if stream is None else stream
        self.label, self.total, self.n, self.stream, self.enabled = label, max(total, 1), 0, stream, enabled
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._bar = bar(self.total, label, unit="item", stream=stream) if enabled and tty(stream) else None

    def update(self, n: int | None = None, total: int | None = None) -> None:
        self.n = self.n + 1 if n is None else n
        if total:
            self.total = total
        if self._bar is not None:
            if total:
                self._bar.total = total
            self._bar.advance_to(min(self.n, self.total))
            return
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.2 and self.n < self.total):
            return
        self._last = now
        frac = min(1.0, self.n / self.total)
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r{self.label:<10} [{bar:<30}] {self.n}/{self.total} {now - self.t0:6.1f}s")
        self.stream.flush()

    def done(self) -> None:
        if self._bar is not None:
            self._bar.advance_to(self.total)
            self._bar.close()
        elif self.enabled:
            self.update(self.total)
            self.stream.write("\n")


def enumerate_all(st: Settings, workers: int = 2, progress: bool = True) -> list[Graph]:
    variants = op_variants(st)
    n = len(variants)
    bar = Progress("enumerate", n, enabled=progress)
    if workers <= 1:
        e = Enumerator(st)
        gs = e.enumerate(None, progress=lambda: bar.update())
        bar.done()
        return gs
    import multiprocessing as mp
    # interleave first-operator indices so the workers get similar loads
    jobs = [(st.to_json(), [i]) for i in range(n)]
    out: list[Graph] = []
    # spawn, not fork: a caller holding threads (torch, onnxruntime) can leave a forked worker hung on a lock
    with mp.get_context("spawn").Pool(workers) as pool:
        for k, gs in enumerate(pool.imap_unordered(_enum_worker, jobs)):
            out.extend(gs)
            bar.update(k + 1)
    bar.done()
    return out


def generate(st: Settings, timeout: float = 5.0, workers: int = 2, progress: bool = True,
             log=None) -> tuple[list[Rule], GenStats, list[tuple[Rule, str]]]:
    """Enumerate, fingerprint, pair, prune, generalize and prove.  Returns (proven rules, stats,
    unproven (rule, reason))."""
    from unity_pcg.verifier.verify import verify_rules
    stats = GenStats()
    t0 = time.perf_counter()
    _CURRENT_SETTINGS[0] = st
    graphs = enumerate_all(st, workers, progress)
    stats.graphs = len(graphs)
    e = Enumerator(st)
    in_graphs = []
    for k in range(len(st.input_kinds)):
        g = Graph((), e.input_fp(k), frozenset([k]))
        g.nodes_input = k  # type: ignore[attr-defined]
        in_graphs.append(g)
    pairs = candidate_pairs(graphs, in_graphs, stats)
    # concrete rules, deduplicated up to renaming
    concrete: dict[str, Rule] = {}
    for src, tgt in pairs:
        r = pair_rule(src, tgt, "candidate")
        key = rule_key(r)
        if key in concrete:
            stats.duplicates += 1
            continue
        concrete[key] = r
    # instances: a rule equal to another candidate with some inputs identified is implied by it
    inst: set[str] = set()
    for r in concrete.values():
        inst.update(merged_instances(r))
    for key in [k for k in concrete if k in inst]:
        del concrete[key]
        stats.pruned["instance of a rule with more inputs"] += 1
    stats.enumerate_seconds = time.perf_counter() - t0
    # candidates that collided only through a polynomial stand-in are false under the real kernels:
    # they are reported unproven without spending solver time on them
    early_unproven: list[tuple[Rule, str]] = []
    for key in list(concrete):
        if _false_under_real_kernels(concrete[key], st):
            early_unproven.append((concrete.pop(key), "numerically false with the real kernels "
                                                      "(a fingerprint collision through a stand-in)"))
    stats.false_candidates = len(early_unproven)
    # generalize and prove: most general form first; forms equal (up to renaming) to an already proven
    # rule are dropped as duplicates
    t1 = time.perf_counter()
    pending = [(key, generalizations(r)) for key, r in concrete.items()]
    proven: dict[str, Rule] = {}
    unproven: list[tuple[Rule, str]] = list(early_unproven)
    level = 0
    bar = Progress("verify", sum(len(f) for _, f in pending), enabled=progress)
    done_count = 0
    while pending:
        batch = []
        for key, forms in pending:
            if level < len(forms):
                batch.append((key, forms, forms[level]))
        if not batch:
            break
        # forms that duplicate an already proven rule need no proof
        todo = []
        for key, forms, f in batch:
            fk = rule_key(f)
            if fk in proven:
                stats.duplicates += 1
                continue
            todo.append((key, forms, f, fk))
        base = done_count
        verdicts = verify_rules([f.with_name(f"cand{i}") for i, (_, _, f, _) in enumerate(todo)], timeout, workers,
                                progress=lambda d, t: bar.update(base + d))
        done_count += len(todo)
        nxt = []
        for (key, forms, f, fk), v in zip(todo, verdicts):
            if v.proven:
                if fk not in proven:
                    proven[fk] = f.with_name(rule_name(f)).with_proof(status="proven", axioms=list(v.axioms),
                                                                      seconds=round(v.seconds, 4))
                    proven[fk] = proven[fk].with_example(example_for(f, forms[-1], st))
                else:
                    stats.duplicates += 1
            elif level + 1 < len(forms):
                nxt.append((key, forms))
            else:
                unproven.append((f, v.status + (f": {v.detail}" if v.detail else "")))
        pending = nxt
        level += 1
    bar.done()
    # a second chance with a larger budget for candidates that are true numerically
    late = [(f, why) for f, why in unproven if (f, why) not in early_unproven]
    if late:
        vs = verify_rules([f for f, _ in late], timeout * RETRY_FACTOR, workers)
        unproven = list(early_unproven)
        for (f, why), v in zip(late, vs):
            fk = rule_key(f)
            if v.proven and fk not in proven:
                proven[fk] = f.with_name(rule_name(f)).with_proof(status="proven", axioms=list(v.axioms),
                                                                  seconds=round(v.seconds, 4))
                proven[fk] = proven[fk].with_example(example_for(f, f, st))
            elif not v.proven:
                unproven.append((f, v.status + (f": {v.detail}" if v.detail else "")))
    stats.verify_seconds = time.perf_counter() - t1
    rules = sorted(proven.values(), key=lambda r: r.name)
    # names must be unique
    seen: dict[str, int] = defaultdict(int)
    named = []
    for r in rules:
        seen[r.name] += 1
        named.append(r if seen[r.name] == 1 else r.with_name(f"{r.name}_{seen[r.name]}"))
    stats.proven = len(named)
    stats.unproven = len(unproven)
    stats.generalized = sum(1 for r in named if r.vars)
    return named, stats, unproven
