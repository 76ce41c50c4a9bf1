"""Substitution selection (Unity section 5.1): best-first search over PCGs reachable by proven rules.

Every candidate is the imported graph rewritten by a sequence of :class:`RuleStep` (rule name, the
matched graph nodes, the input bindings and the bound degrees/dims).  The sequence is recorded in the
plan and :func:`replay` re-applies it on a fresh import, re-checking at every step that the recorded
site is a match of the rule -- so a plan is reachable from the model by the shipped rules or it does
not load.  Node ids are deterministic: applying a match adds the target's nodes with the next free
ids, in the target pattern's order.

The search (:func:`best_first`) keeps a priority queue of candidates ordered by a cost function (the
machine-mapping DP's predicted iteration time; one :class:`search.mapping.MachineMapper` is reused so
its memo hits on every unchanged subgraph), deduplicates them by structural hash, drops a candidate
worse than ``alpha`` times the best, and stops after a budget of expanded candidates or seconds.  Ties
are broken by insertion order, so a candidate budget gives the same result every time.

Data parallelism is reachable by rules (:func:`data_parallel_steps`): the ``dp_<Op>`` rule of every
compute operator in topological order, each followed by merging the duplicate Partition/Replicate
nodes of a shared tensor (``partition_cse``, ``replicate_cse``) and cancelling the Combine/Partition
pairs left between neighbours (``partition_combine_cancel``).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from unity_pcg.substitutions import GraphIndex, Match, Rule, iter_matches, try_apply
from unity_pcg.substitutions.cache import RuleSet, load as load_rules
from unity_pcg import ops
from unity_pcg.errors import UnityError
from unity_pcg.pcg import PCG

from .budget import Deadline, Expired, check as _check_deadline

INF = math.inf
CANCEL_RULES = ("partition_cse", "replicate_cse", "partition_combine_cancel")


class ReplayError(UnityError, ValueError):
    """A recorded rule step does not apply to the graph it is replayed on."""


def _jv(v: Any) -> Any:
    return [_jv(x) for x in v] if isinstance(v, tuple) else v


def _tv(v: Any) -> Any:
    return tuple(_tv(x) for x in v) if isinstance(v, list) else v


@dataclass(frozen=True)
class RuleStep:
    """One rule application: ``rule`` matched at graph nodes ``nodes`` (one per source pattern node),
    named inputs bound to tensors ``inputs`` and variables bound to ``bindings``."""
    rule: str
    nodes: tuple[int, ...]
    inputs: tuple[tuple[str, tuple[int, int]], ...]
    bindings: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(m: Match) -> "RuleStep":
        return RuleStep(m.rule.name, tuple(m.nodes), tuple((k, (int(r[0]), int(r[1]))) for k, r in m.inputs),
                        tuple(m.bindings))

    def to_json(self) -> dict:
        return {"rule": self.rule, "nodes": list(self.nodes),
                "inputs": {k: list(r) for k, r in self.inputs},
                "bind": {k: _jv(v) for k, v in self.bindings}}

    @staticmethod
    def from_json(obj: Any) -> "RuleStep":
        try:
            return RuleStep(str(obj["rule"]), tuple(int(n) for n in obj["nodes"]),
                            tuple(sorted((str(k), (int(r[0]), int(r[1]))) for k, r in dict(obj["inputs"]).items())),
                            tuple(sorted((str(k), _tv(v)) for k, v in dict(obj.get("bind", {})).items())))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ReplayError(f"malformed rule step {obj!r:.80}: {type(e).__name__}: {e}") from None

    def remap(self, ids: Mapping[int, int], refs: Mapping[tuple, tuple]) -> "RuleStep":
        """The same step with node ids / input tensors translated (a subgraph's step on the whole graph)."""
        return RuleStep(self.rule, tuple(ids[n] for n in self.nodes),
                        tuple((k, tuple(refs[r]) if r in refs else (ids[r[0]], r[1])) for k, r in self.inputs), self.bindings)

    def describe(self, g: PCG | None = None) -> str:
        where = ", ".join(g.node(n).label() if g is not None and n in g else str(n) for n in self.nodes)
        b = ", ".join(f"{k}={v}" for k, v in self.bindings)
        return f"{self.rule} at [{where}]" + (f" with {b}" if b else "")


class RuleBook:
    """The rules the search may apply (every proven rule of the cache, reversible ones both ways),
    indexed by name, and the degrees free degree variables are chosen from."""

    def __init__(self, rules: RuleSet | Iterable[Rule] | None = None, degrees: Sequence[int] = (2,)):
        rs = rules if rules is not None else load_rules()
        self.rules: list[Rule] = rs.all_directions() if isinstance(rs, RuleSet) else list(rs)
        self.by_name: dict[str, Rule] = {r.name: r for r in self.rules}
        self.degrees = tuple(sorted(set(int(d) for d in degrees if d >= 2)))
        self.algebraic = [r for r in self.rules if not r.is_parallel]
        self.parallel = [r for r in self.rules if r.is_parallel]
        self.dp_names: dict[str, list[str]] = {}

    @property
    def expansion(self) -> list[Rule]:
        """The rules the best-first search expands a candidate by: all but the single-operator tensor-parallel
        rules of ``templates.tensor_parallel_rules`` (a split of one operator on any dim, a view moving a
        partition), which :mod:`search.realize` applies towards a layout proposal's target.  Expanded
        blindly they double a decoder's neighbours (every element-wise operator on every dim) and the
        budget is spent on moves no proposal asked for."""
        if getattr(self, "_expansion", None) is None:
            from unity_pcg.substitutions.templates import tensor_parallel_rules
            local = {r.name for r in tensor_parallel_rules()}
            self._expansion = [r for r in self.rules if r.name.split("~")[0] not in local and r.name not in local]
        return self._expansion

    def get(self, name: str) -> Rule:
        r = self.by_name.get(name)
        if r is None:
            raise ReplayError(f"rule {name!r} is not in the shipped rule cache")
        return r

    def subset(self, rules: Iterable[Rule]) -> "RuleBook":
        b = RuleBook(list(rules), self.degrees)
        return b


# --- matching and replay ---------------------------------------------------------------------------

def _window_index(g: PCG, window: Iterable[int] | None) -> GraphIndex:
    # every rule application starts here (a search's neighbours, the fixed sequences' rounds): the head of
    # their loops, where the deadline of the caller's scope is checked (search.budget.within: Expired)
    _check_deadline()
    return GraphIndex(g, window)


def neighbours(g: PCG, rules: Iterable[Rule], degrees: Sequence[int], window: Iterable[int] | None = None,
               limit_per_rule: int | None = None) -> Iterable[tuple[Match, PCG]]:
    """Every valid application of ``rules`` whose pattern ends in ``window`` (all nodes if None):
    (match, rewritten graph)."""
    idx = _window_index(g, window)
    for r in rules:
        for m in iter_matches(r, g, idx, limit_per_rule, degrees):
            g2 = try_apply(g, m)
            if g2 is not None:
                yield m, g2


def match_step(g: PCG, step: RuleStep, book: RuleBook) -> Match:
    """The match ``step`` records, checked to be a match of its rule in ``g`` (else ReplayError)."""
    rule = book.get(step.rule)
    for n in step.nodes:
        if n not in g:
            raise ReplayError(f"step {step.describe()}: node {n} is not in the graph")
    b = dict(step.bindings)
    kinds = rule.var_kinds
    degs = sorted({int(v) for k, v in b.items() if kinds.get(k) == "degree"}) or [2]
    idx = _window_index(g, step.nodes)
    for m in iter_matches(rule, g, idx, None, degs):
        if tuple(m.nodes) == step.nodes and RuleStep.of(m) == step:
            return m
    raise ReplayError(f"step {step.describe(g)} is not a match of rule {step.rule} in this graph")


def apply_step(g: PCG, step: RuleStep, book: RuleBook) -> PCG:
    m = match_step(g, step, book)
    g2 = try_apply(g, m)
    if g2 is None:
        raise ReplayError(f"step {step.describe(g)}: the rewritten graph is not a valid parallelization")
    return g2


def replay(g: PCG, steps: Iterable[RuleStep], book: RuleBook | None = None, trim_outputs: bool = False) -> PCG:
    """Apply a recorded rule sequence to ``g``, checking every step (raises ReplayError);
    ``trim_outputs``: then take the outputs before their trailing parallel operators, as a plan does
    (:func:`trimmed`)."""
    book = book or RuleBook()
    for s in steps:
        g = apply_step(g, s, book)
    return trimmed(g) if trim_outputs else g


def trailing(g: PCG, ref: tuple) -> tuple:
    """The tensor an output is computed from, before the chain of parallel operators that ends at the
    output (each read by nothing else)."""
    r = tuple(ref)
    while g.node(r[0]).kind == "parallel" and len(g.consumers(r)) <= 1:
        r = tuple(g.node(r[0]).inputs[0])
    return r


def trimmed(g: PCG) -> PCG:
    """``g`` with every output taken before its trailing parallel operators (removed).  Rules keep
    every output's parallel shape, so a rule-reached PCG ends in the gathers that bring its outputs
    back to one piece; training does not need them (the loss is computed where each piece of the
    output lives, as for every plan), so plans are priced and written without them.  An output whose
    pieces are partial sums (a row-parallel Linear's) is taken after an AllReduce of them: a loss reads
    values, and every device of the sums then holds them (Megatron-LM's layout of a model ending in a
    row-parallel layer).  A function of the graph alone, so :func:`replay` with ``trim_outputs`` repeats it."""
    outs = [trailing(g, r) for r in g.outputs]
    if outs == [tuple(r) for r in g.outputs]:
        return g
    e = g.edit()
    for i, r in enumerate(outs):
        k = g.shape(r).sum_degree
        if k > 1:         # partial sums are no values a loss reads: all-reduced (the chain's Reduce, with copies)
            outs[i] = (e.add_node("AllReduce", {"degree": k}, [r]), 0)
    e.set_outputs(outs)
    e.remove_dead()
    return e.finish()


def new_ids(before: PCG, after: PCG) -> list[int]:
    """Ids of the nodes a step added, in creation order."""
    return sorted(n for n in after.node_ids() if n not in before)


# --- data parallelism by rules --------------------------------------------------------------------------

def _dp_rule_names(op: str, book: "RuleBook") -> list[str]:
    """The data-parallel rules of an operator: ``dp_<Op>`` and its variants (``dp_Linear_bias``,
    ``dp_Transpose_0213``, ...)."""
    got = book.dp_names.get(op)
    if got is None:
        got = book.dp_names[op] = [n for n in book.by_name
                                   if n == f"dp_{op}" or (n.startswith(f"dp_{op}_") and "~" not in n)]
    return got


#: rules ``Replicate(op(a, b..)) -> op(Replicate(a), Replicate(b)..)``: an operator over constants that data
#: parallelism cannot partition (BERT's position Embedding over a [1, S] index) computed on every device
LIFT_PREFIX = "replicate_lift_"


def _on_constants(g: PCG, n) -> bool:
    """Whether every input of ``n`` is a non-Input source (a Weight, a constant), possibly behind parallel operators."""
    for r in n.inputs:
        m = g.node(r[0])
        while m.kind == "parallel":
            m = g.node(m.inputs[0][0])
        if m.kind != "source" or m.op == "Input":
            return False
    return bool(n.inputs)


def _lift_rules(book: RuleBook) -> list[Rule]:
    got = book.__dict__.get("_lift_rules")
    if got is None:
        got = book._lift_rules = [r for n, r in book.by_name.items() if n.startswith(LIFT_PREFIX) and "~" not in n]
    return got


def _around(g: PCG, ids: set) -> set:
    """``ids``, the producers of their inputs and every reader of those: the window in which a step's
    cancellations (duplicate Partitions / Replicates, Combine -> Partition pairs) can appear."""
    out = ids | {i[0] for k in ids for i in g.node(k).inputs}
    return out | {c for i in list(out) for kk in range(len(g.shapes(i))) for c, _ in g.consumers((i, kk))}


def lift_steps(g: PCG, book: RuleBook, window: Iterable[int] | None = None) -> tuple[PCG, list[RuleStep]]:
    """Lift every Replicate in ``window`` (all if None) above an operator over constants that has a
    ``replicate_lift_<Op>`` rule (the operator then runs on copies of its operands: what the hand-built
    data-parallel baseline does with weight-derived operators), merging the placements that duplicates."""
    rules = _lift_rules(book)
    steps: list[RuleStep] = []
    if not rules:
        return g, steps
    w = set(window) if window is not None else None
    while True:
        for r in rules:
            done = False
            for m in iter_matches(r, g, _window_index(g, w), None, (2,)):
                if not all(_on_constants(g, g.node(i)) for i in m.nodes if g.node(i).kind == "compute"):
                    continue
                g2 = try_apply(g, m)
                if g2 is None:
                    continue
                steps.append(RuleStep.of(m))
                fresh = set(new_ids(g, g2))
                if w is not None:
                    w |= fresh
                g, more = cancel_steps(g2, book, _around(g2, fresh))
                steps.extend(more)
                done = True
                break
            if done:
                break
        else:
            return g, steps


def cancel_steps(g: PCG, book: RuleBook, window: Iterable[int] | None = None,
                 max_steps: int = 10_000) -> tuple[PCG, list[RuleStep]]:
    """Merge duplicate Partition/Replicate nodes and cancel Combine->Partition pairs until none is left."""
    rules = [book.by_name[n] for n in CANCEL_RULES if n in book.by_name]
    steps: list[RuleStep] = []
    w = set(window) if window is not None else None
    for _ in range(max_steps):
        for m, g2 in neighbours(g, rules, (2,), w, limit_per_rule=1):
            steps.append(RuleStep.of(m))
            if w is not None:
                w |= set(new_ids(g, g2))
            g = g2
            break
        else:
            return g, steps
    return g, steps


#: copies of copies become one Replicate of the product degree (a proven template)
MERGE_RULE = "replicate_merge"


def _commute_rules(book: RuleBook) -> list[Rule]:
    """The book's unconstrained ``Partition(Replicate(x, j), d, k) -> Replicate(Partition(x, d, k), j)``
    rules (found by their patterns, not by name: generated ones with one degree, the template
    ``partition_replicate_commute`` with two)."""
    out = []
    for r in book.rules:
        s, t = r.source.nodes, r.target.nodes
        if (not r.constraints and [n.op for n in s] == ["Replicate", "Partition"] and len(r.inputs) == 1
                and [n.op for n in t] == ["Partition", "Replicate"] and s[0].inputs == r.inputs
                and t[0].inputs == r.inputs and not r.name.endswith("~rev")):
            out.append(r)
    return out


def merge_copies_steps(g: PCG, book: RuleBook) -> tuple[PCG, list[RuleStep]]:
    """Copies written the way a hand-built layout writes them, by rules: every ``Replicate(Replicate(x, k),
    j)`` (the inner read only by the outer) becomes ``Replicate(x, k * j)`` (``replicate_merge``), and a weight
    partitioned after being copied, ``Partition(Replicate(w, k), d, k)``, is copied after being partitioned.
    Where a stage is data and tensor parallel at once, the data-parallel rule and a replicate lift copy a
    weight twice (once per degree); Megatron-LM's layout copies it once.  The logical value and every
    tensor's parallel shape are unchanged (each step a proven rule); (graph, steps)."""
    steps: list[RuleStep] = []
    rule = book.by_name.get(MERGE_RULE)
    if rule is None:
        return g, steps
    while True:
        pairs = {n.a["degree"] * g.node(n.inputs[0][0]).a["degree"] for n in g.nodes()
                 if n.op == "Replicate" and g.node(n.inputs[0][0]).op == "Replicate"}
        if not pairs:
            break
        n0 = len(steps)
        for m in sorted(pairs):
            g = _apply_everywhere(g, rule, m, steps)
        if len(steps) == n0:
            break
    for r in _commute_rules(book):
        for k in sorted({n.a["degree"] for n in g.nodes() if n.op == "Replicate"}):
            g = _apply_everywhere(g, r, k, steps, where=lambda h, mt: all(
                h.node(ref[0]).kind == "source" for _, ref in mt.inputs))
    return g, steps


#: ``P(Combine(x, d, k), j) -> Combine(P(x, j), d, k)`` per parallel operator ``P`` that changes only the sum or
#: copy degree, and ``Combine(Combine(x, d, k), e, j) -> Combine(Combine(x, e, j), d, k)`` for a gather of another
#: dim (proven templates)
SINK_RULES = {"Reduce": "combine_sink_Reduce", "Replicate": "combine_sink_Replicate",
              "AllReduce": "combine_sink_AllReduce", "Combine": "combine_sink_Combine",
              "Partition": "combine_sink_Partition"}


def _cancelled_below(g: PCG, c) -> bool:
    """True when Combine node ``c``'s result reaches, through a chain of Reduce / Replicate / AllReduce and
    Combines and Partitions of other dims (each read by one consumer), a Partition of the same dim and degree:
    sunk there, the pair cancels."""
    rank = g.shape(c.inputs[0]).rank
    dim = c.a["dim"] % rank
    ref = (c.id, 0)
    while True:
        cons = g.consumers(ref)
        if len(cons) != 1 or ref in {tuple(r) for r in g.outputs}:
            return False
        n = g.node(cons[0][0])
        if n.op == "Partition" and n.a["dim"] % rank == dim:
            return n.a["degree"] == c.a["degree"]
        if n.op in SINK_RULES and (n.op not in ("Combine", "Partition") or n.a["dim"] % rank != dim):
            ref = (n.id, 0)
            continue
        return False


def sink_combines_steps(g: PCG, book: RuleBook, window: Iterable[int] | None = None) -> tuple[PCG, list[RuleStep]]:
    """Gathers that a later split undoes, removed by rules: a ``Combine(d, k)`` followed by sums, copies or
    gathers or splits of other dims (Reduce, Replicate, AllReduce, Combine(e), Partition(e): they change other
    degrees) and then by
    ``Partition(d, k)`` is moved past them (``combine_sink_<P>``, proven) and cancelled with the Partition
    (``partition_combine_cancel``).  Where a stage is data and tensor parallel at once, the data-parallel rule
    gathers a row-parallel Linear's batch pieces before its AllReduce and the next Megatron pair splits them
    again; Megatron-LM all-reduces the pieces where they are.  Likewise an ILP layout over a 2-D mesh gathers a
    feature dim only, where the rules gather the batch too and split it again.  Other Combines are left alone
    (moving them would change the layout, not write it differently).  ``window``: the Combines to look at
    (default every node); (graph, steps)."""
    steps: list[RuleStep] = []

    def step(h: PCG, m: Match):
        h2 = try_apply(h, m)
        return None if h2 is None else (h2, new_ids(h, h2))
    g = sink_combines(g, book, g.node_ids() if window is None else window, step, _window_index, steps)
    return g, steps


def sink_combines(g: PCG, book: RuleBook, window: Iterable[int], step: Callable, index: Callable,
                  steps: list) -> PCG:
    """:func:`sink_combines_steps` over any graph representation: ``step(g, match)`` applies a match and
    returns ``(graph, new node ids)`` or None; ``index(g, ids)`` a :class:`GraphIndex` over those ids.  Appends
    the applied steps to ``steps``; returns the graph."""
    rules = {p: book.by_name.get(name) for p, name in SINK_RULES.items()}
    cancel = book.by_name.get("partition_combine_cancel")
    if cancel is None:
        return g
    todo = sorted(i for i in window if i in g and g.node(i).op == "Combine")
    for cid in todo:
        if cid not in g or g.node(cid).op != "Combine":
            continue
        site = g.node(cid)
        while site is not None and _cancelled_below(g, site):
            below = g.node(g.consumers((site.id, 0))[0][0])
            rank = g.shape(site.inputs[0]).rank
            same = below.op == "Partition" and below.a["dim"] % rank == site.a["dim"] % rank
            rule = cancel if same else rules.get(below.op)
            if rule is None:
                break
            m = next((m for m in iter_matches(rule, g, index(g, [site.id, below.id]), None, (site.a["degree"],))
                      if set(m.nodes) == {site.id, below.id}), None)
            got = step(g, m) if m is not None else None
            if got is None:
                break
            g, fresh = got
            steps.append(RuleStep.of(m))
            # the sunk Combine is the last new Combine of a sink rule's target; none is left after the cancel
            site = None if rule is cancel else next(
                (g.node(i) for i in reversed(fresh) if g.node(i).op == "Combine"), None)
    return g


def data_parallel_steps(g: PCG, degree: int, book: RuleBook,
                        keep_whole: Callable[[PCG, Any], bool] | None = None, only: set | None = None,
                        siblings: bool = False, final_cancel: bool = True) -> tuple[PCG, list[RuleStep]]:
    """Data parallelism of ``degree`` built by rules: each compute operator in topological order gets
    its ``dp_<Op>`` rule (sample dim = dim 0), then shared Partitions are merged and Combine/Partition
    pairs cancelled.  Operators whose rule does not apply (the batch dim does not survive them) stay
    whole, with Combine before and Partition after them; so do those ``keep_whole(g, node)`` names
    (the expert seed: embedding tables whole, :func:`is_table_lookup`).  A fixed sequence of one
    rule per operator plus its cancellations: never cut by a candidate budget.  ``only``: the compute
    operators to parallelize (a pipeline stage's, :func:`search.pipeline.by_rules`); ``siblings``: each
    step's cancellations also look at the other readers of the tensors it touched (duplicate Partitions
    and Replicates merge there, not in the whole-graph pass at the end, which ``final_cancel=False``
    leaves out)."""
    steps: list[RuleStep] = []
    for nid in [i for i in g.topo_order() if only is None or i in only]:
        if nid not in g:
            continue
        n = g.node(nid)
        if n.kind != "compute":
            continue
        if keep_whole is not None and keep_whole(g, n):
            continue
        rank = g.shape(n.inputs[0]).rank if n.inputs else 0
        done = False
        for name in _dp_rule_names(n.op, book):
            r = book.by_name.get(name)
            if r is None or done:
                continue
            idx = _window_index(g, [nid])
            for m in iter_matches(r, g, idx, None, (degree,)):
                b = m.binding
                if "d" in b and b["d"] != -rank:        # the sample dim
                    continue
                g2 = try_apply(g, m)
                if g2 is None:
                    continue
                steps.append(RuleStep.of(m))
                window = set(new_ids(g, g2))
                g = g2
                for k in list(window):
                    ins = {r[0] for r in g.node(k).inputs}
                    window |= ins
                    window |= {c for c, _ in g.consumers((k, 0))}
                    if siblings:
                        window |= {c for i in ins for kk in range(len(g.shapes(i))) for c, _ in g.consumers((i, kk))}
                g, more = cancel_steps(g, book, window)
                steps.extend(more)
                g, more = lift_steps(g, book, {k for k in window if k in g})
                steps.extend(more)
                done = True
                break
    if final_cancel:
        g, more = cancel_steps(g, book)
        steps.extend(more)
    return g, steps


def dp_rule_missing(g: PCG, book: "RuleBook") -> list[str]:
    """Compute operators of ``g`` (sorted op names) without any data-parallel rule in ``book``: data
    parallelism by rules leaves them whole (a gather before, a scatter after)."""
    return sorted({n.op for n in g.nodes() if n.kind == "compute" and not _dp_rule_names(n.op, book)})


def _from_weight(g: PCG, ref) -> bool:
    """Whether ``ref`` is a Weight source, possibly behind parallel operators."""
    n = g.node(ref[0])
    while n.kind == "parallel":
        n = g.node(n.inputs[0][0])
    return n.op == "Weight"


def is_table_lookup(g: PCG, n) -> bool:
    """An Embedding whose table is a trainable Weight (what the expert strategy keeps whole on one
    device: its gradient never crosses devices)."""
    return n.op == "Embedding" and len(n.inputs) >= 2 and g.node(n.inputs[1][0]).op == "Weight" \
        and g.shape(n.inputs[1]).dtype in ("float32", "float16", "bfloat16", "float64")


def _apply_everywhere(g: PCG, rule: Rule, degree: int, steps: list, fresh: Sequence[str] | bool = (),
                      within: set | None = None, where: Callable[[PCG, Match], bool] | None = None) -> PCG:
    """Apply ``rule`` (free degrees bound to ``degree``) at its first valid match until none is left;
    inputs named in ``fresh`` (``True``: every input bound to a weight) must not be split yet (no
    template nested in its own result).  ``within``: only matches whose nodes all lie in it (a pipeline
    stage's nodes), grown by the nodes each step adds; ``where(g, match)``: a further condition."""
    while True:
        idx = _window_index(g, within)
        for m in iter_matches(rule, g, idx, None, (degree,)):
            if within is not None and not all(n in within for n in m.nodes):
                continue
            if any(not all(d.degree == 1 for d in g.shape(r).dims) for k, r in m.inputs
                   if (_from_weight(g, r) if fresh is True else k in fresh)):
                continue
            if where is not None and not where(g, m):
                continue
            g2 = try_apply(g, m)
            if g2 is not None:
                steps.append(RuleStep.of(m))
                if within is not None:
                    within |= set(new_ids(g, g2))
                g = g2
                break
        else:
            return g


def normalized_hash(g: PCG) -> str:
    """Structural hash with the dim attributes of parallel operators, and the integer ``axis`` of compute
    operators (a Concat's, a Softmax's: rules bind it as a dim, counted from the end), counted from the
    front (rules bind dims counted from the end, hand-built baselines and importers count from the front)."""
    b = g.edit()
    for n in g.nodes():
        if n.kind == "parallel" and "dim" in n.a:
            rank = g.shape(n.inputs[0]).rank
            a = dict(n.a, dim=n.a["dim"] % rank)
        elif (n.kind == "compute" and n.inputs and type(n.a.get("axis")) is int
              and -g.shape(n.inputs[0]).rank <= n.a["axis"] < 0):
            a = dict(n.a, axis=n.a["axis"] % g.shape(n.inputs[0]).rank)
        else:
            continue
        if a != n.a:
            from unity_pcg.pcg import Node
            b._nodes[n.id] = Node(n.id, n.op, tuple(sorted(a.items())), n.inputs, n.name)
            b._hashes.pop(n.id, None)
            b._dirty.add(n.id)
    return b.finish().structural_hash()


# --- best-first search ------------------------------------------------------------------------------------

@dataclass
class Candidate:
    cost: float
    graph: PCG
    steps: tuple[RuleStep, ...]
    info: Any = None


@dataclass
class SearchStats:
    explored: int = 0            # candidates expanded
    evaluated: int = 0           # candidates priced
    duplicates: int = 0
    pruned: int = 0
    seconds: float = 0.0
    stopped: str = ""            # "exhausted", "candidates", "seconds", "interrupted"

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SearchResult:
    best: Candidate
    stats: SearchStats
    front: dict = field(default_factory=dict)      # key -> best Candidate of that key (see best_first)


def best_first(start: Sequence[Candidate], expand: Callable[[Candidate], Iterable[tuple[PCG, tuple]]],
               evaluate: Callable[[PCG], tuple[float, Any]], alpha: float = 1.05,
               max_candidates: int = 100, max_seconds: float = INF,
               key: Callable[[PCG], Any] | None = None,
               estimate: Callable[[PCG], float] | None = None,
               progress: Callable[[SearchStats, float], None] | None = None,
               seen: set | None = None, deadline: "Deadline | None" = None) -> SearchResult:
    """Best-first search.  ``start``: candidates (the imported graph, seeds; cost None: priced when reached); ``expand(c)``
    yields (graph, steps) of its neighbours; ``evaluate(graph)`` -> (cost, info) is the DP.

    Pricing is lazy: a neighbour is queued at its parent's cost (siblings in order of ``estimate``,
    e.g. their compute time, then in generation order) and priced by ``evaluate`` when it reaches the
    front of the queue, then re-queued at its own cost; only priced candidates are expanded, so the
    expansion order is by DP-predicted cost and a budget cut costs no unneeded DP solves.  A
    candidate costing more than ``alpha`` times the best of its ``key`` (one key if None) is neither
    re-queued nor expanded.  Stops when the queue is empty, after ``max_candidates`` expansions or
    ``max_seconds`` or at ``deadline`` (:class:`search.budget.Deadline`, checked at the loop head and between
    an expansion's neighbours; a solve or an expansion it cuts, :class:`search.budget.Expired`, ends the search
    too: ``stats.stopped == "seconds"``); a KeyboardInterrupt stops it too (``stats.stopped == "interrupted"``) with the
    best so far.  Ties are broken by insertion order: with a candidate budget the result is the same
    every time."""
    t0 = time.perf_counter()
    stats = SearchStats()
    keyf = key or (lambda g: None)
    est = estimate or (lambda g: 0.0)
    seen = set() if seen is None else seen
    front: dict = {}
    queue: list = []
    counter = 0

    def push(prio: float, sub: float, c: Candidate, priced: bool, k) -> None:
        nonlocal counter
        heapq.heappush(queue, (prio, sub, counter, priced, k, c))
        counter += 1

    def record(c: Candidate, k) -> bool:
        """Update the front with a priced candidate; False when it is pruned."""
        best = front.get(k)
        if best is None or c.cost < best.cost:
            front[k] = c
        if c.cost == INF or (best is not None and c.cost > alpha * best.cost):
            stats.pruned += 1
            return False
        return True

    first = min((c.cost for c in start if c.cost is not None), default=0.0)
    for c in start:
        h = c.graph.structural_hash()
        if h in seen:
            continue
        seen.add(h)
        k = keyf(c.graph)
        if c.cost is None:                  # a seed to price when it reaches the front
            # before any neighbour of the best start (those queue at its cost with sub >= 0): lazily
            # priced neighbours with a smaller estimate would otherwise starve the seeds
            push(first, -1.0 / (1.0 + est(c.graph)), c, False, k)
        elif record(c, k):
            push(c.cost, 0.0, c, True, k)
    stats.stopped = "exhausted"
    try:
        while queue:
            if stats.explored >= max_candidates:
                stats.stopped = "candidates"
                break
            if time.perf_counter() - t0 > max_seconds or (deadline is not None and deadline.passed()):
                stats.stopped = "seconds"
                break
            prio, sub, _, priced, k, c = heapq.heappop(queue)
            if not priced:
                c.cost, c.info = evaluate(c.graph)
                stats.evaluated += 1
                if record(c, k):
                    push(c.cost, 0.0, c, True, k)
                continue
            best = front.get(k)
            if best is not None and c.cost > alpha * best.cost:
                stats.pruned += 1
                continue
            stats.explored += 1
            for g2, steps in expand(c):
                if deadline is not None and deadline.passed():
                    raise Expired()     # (one expansion of a large graph applies hundreds of rewrites)
                h = g2.structural_hash()
                if h in seen:
                    stats.duplicates += 1
                    continue
                seen.add(h)
                push(c.cost, est(g2), Candidate(INF, g2, c.steps + tuple(steps)), False, keyf(g2))
            if progress is not None:
                progress(stats, min((x.cost for x in front.values()), default=INF))
    except KeyboardInterrupt:
        stats.stopped = "interrupted"
    except Expired:
        stats.stopped = "seconds"
    stats.seconds = time.perf_counter() - t0
    best = min(front.values(), key=lambda x: x.cost) if front else start[0]
    if best.cost is None:
        best.cost = INF
    return SearchResult(best, stats, front)


__all__ = ["RuleStep", "RuleBook", "ReplayError", "replay", "apply_step", "match_step", "neighbours",
           "data_parallel_steps", "merge_copies_steps", "lift_steps", "dp_rule_missing", "is_table_lookup", "cancel_steps", "normalized_hash", "best_first", "Candidate", "SearchResult",
           "SearchStats", "new_ids", "trailing", "trimmed"]
