"""What a plan does and why it costs what it costs (`unity-pcg explain`, issue 7 point 6).

:func:`explain` re-prices a loaded :class:`~unity_pcg.plan.Plan` with the cost model
(:class:`search.mapping.MachineMapper` / :class:`search.cost.GraphCost`) and returns an
:class:`Explanation`: one row per operator (its output's shard degree per dim, sum and copy degrees,
its task grid and machine view), the rule sequence the search applied (in words), every edge that
communicates (collective, elements, devices, predicted time), the gradient all-reduce of every
replicated weight, the pipeline stages if any, and the re-priced totals.  :func:`format_text` prints
it as tables; :func:`to_dot` draws the PCG with parallel operators colored by kind, edges labeled
with their parallel shapes and communicating edges drawn red.

Numbers come from the same cost model the search uses, edge by edge: the communication rows and the
gradient rows add up to the re-priced plan's ``comm_elements`` (tests hold them to it).  Times are
forward + backward (a transfer's gradient travels back over the same links).

Planning code: no torch import; the search modules are imported when :func:`explain` runs.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from . import ops
from .errors import PlanError
from .machine import MachineView

# parallel operator -> (collective it performs when pieces move, DOT fill color)
PARALLEL_KINDS: dict[str, tuple[str, str]] = {
    "Partition": ("scatter (slices sent)", "#f4a261"),
    "Combine": ("gather", "#8fd694"),
    "Replicate": ("broadcast", "#8ecae6"),
    "Reduce": ("reduce", "#f28482"),
    "AllReduce": ("all-reduce", "#c77dff"),
    "Pipeline": ("micro-batch scatter", "#ffd166"),
    "Batch": ("micro-batch gather", "#ffe8a3"),
}
COMPUTE_EDGE = "resharding (point-to-point)"
SOURCE_COLOR = "#e0e0e0"


# --- value types ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class OperatorRow:
    """One non-source node: its first output's parallel degrees and its machine view."""
    id: int
    name: str
    op: str
    kind: str                       # "compute" or "parallel"
    role: str                       # GraphCost role: compute, parallel, input-placement, weight-placement
    shape: str                      # first output, e.g. "[8/2, 16] copy=3"
    shard: tuple[int, ...]          # shard degree per dim of the first output
    sum_degree: int
    copy_degree: int
    grid: str                       # task grid of a compute node ("b:2 n:3"), "" for parallel nodes
    view: MachineView | None
    devices: tuple[int, ...]
    view_text: str = ""             # "@0 [b0 2:1]": start, then each task axis of degree > 1 as degree:stride

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "op": self.op, "kind": self.kind, "role": self.role,
                "shape": self.shape, "shard": list(self.shard), "sum_degree": self.sum_degree,
                "copy_degree": self.copy_degree, "grid": self.grid,
                "view": self.view.to_json() if self.view is not None else None, "view_text": self.view_text,
                "devices": list(self.devices)}


def view_text(view: MachineView, names: Sequence[str]) -> str:
    """``@start [axis degree:stride, ...]`` over the task axes of degree > 1 (``@start``: one device)."""
    parts = [f"{names[i] if i < len(names) else i} {d}:{s}" for i, (d, s) in enumerate(view.dims) if d > 1]
    return f"@{view.start}" + (f" [{', '.join(parts)}]" if parts else "")


@dataclass(frozen=True)
class CommRow:
    """One edge that moves data: input ``pos`` of node ``consumer`` (an operator) from ``producer``."""
    consumer: int
    consumer_name: str
    op: str
    pos: int
    producer: int
    producer_name: str
    collective: str
    shape: str                      # the parallel shape on the edge
    elements: int                   # forward + backward, all devices
    devices: tuple[int, ...]
    time_s: float                   # forward + backward

    def to_json(self) -> dict:
        return {"consumer": self.consumer, "consumer_name": self.consumer_name, "op": self.op, "input": self.pos,
                "producer": self.producer, "producer_name": self.producer_name, "collective": self.collective,
                "shape": self.shape, "elements": self.elements, "devices": list(self.devices),
                "time_s": self.time_s}


@dataclass(frozen=True)
class GradSyncRow:
    """The gradient all-reduce of one replicated weight (per group of copies of one piece)."""
    node: int                       # the end of the weight's placement chain
    weight: str
    shape: str
    groups: int                     # pieces of the weight, each all-reduced over its copies
    group_size: int                 # copies per piece
    elements: int
    devices: tuple[int, ...]
    time_s: float
    algorithm: str = ""             # the all-reduce algorithm priced (collectives.algorithm_name)

    def to_json(self) -> dict:
        return {"node": self.node, "weight": self.weight, "shape": self.shape, "groups": self.groups,
                "group_size": self.group_size, "elements": self.elements, "devices": list(self.devices),
                "time_s": self.time_s, "algorithm": self.algorithm}


@dataclass(frozen=True)
class StageRow:
    index: int
    nodes: tuple[str, ...]          # names of the stage's nodes
    devices: tuple[int, ...]
    leaves_s: float = 0.0           # the stage's operators re-priced one after the other (whole batch)
    operators: tuple[str, ...] = () # names of the stage's non-source nodes, topological order
    recorded: Mapping[str, Any] = field(default_factory=dict)   # the search's per-stage figures, if any

    def to_json(self) -> dict:
        return {"stage": self.index, "nodes": list(self.nodes), "devices": list(self.devices),
                "leaves_s": self.leaves_s, **{k: v for k, v in self.recorded.items() if k not in ("nodes", "devices")}}


@dataclass(frozen=True)
class Explanation:
    model: str
    machine: str
    devices: int
    operators: tuple[OperatorRow, ...]
    rules: tuple[str, ...]                  # the rule sequence, one sentence per step
    rules_recorded: bool                    # False: the plan records no rule sequence
    comm: tuple[CommRow, ...]
    grad_sync: tuple[GradSyncRow, ...]
    pipeline: Mapping[str, Any] | None      # schedule, micro_batches (stages in ``stages``)
    stages: tuple[StageRow, ...]
    totals: Mapping[str, Any]               # re-priced by the cost model + the plan's own prediction
    predicted: Mapping[str, Any] = field(default_factory=dict)
    steps: tuple = ()                       # the recorded rule steps as the plan holds them

    def __str__(self) -> str:
        """What `unity-pcg explain` prints."""
        return format_text(self)

    def to_json(self) -> dict:
        return {"model": self.model, "machine": self.machine, "devices": self.devices,
                "operators": [r.to_json() for r in self.operators],
                "rules": list(self.rules), "rules_recorded": self.rules_recorded,
                "rule_steps": [dict(x) if isinstance(x, Mapping) else x for x in self.steps],
                "communication": [r.to_json() for r in self.comm],
                "gradient_allreduce": [r.to_json() for r in self.grad_sync],
                "pipeline": None if self.pipeline is None else dict(self.pipeline, stages=[s.to_json() for s in self.stages]),
                "totals": dict(self.totals), "predicted": _finite(dict(self.predicted))}


def _finite(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


# --- building ------------------------------------------------------------------------------------

def explain(plan, optimizer: str | None = None) -> Explanation:
    """Re-price ``plan`` edge by edge and collect what it does (see module docstring).  ``optimizer``
    (sgd / momentum / adam) defaults to the one the plan records, else adam."""
    from unity_pcg.search.cost import OPTIMIZER_STATES, CostModel, GraphCost
    from unity_pcg.search.mapping import MachineMapper

    g = plan.pcg
    opt = optimizer or _recorded(plan, "optimizer") or "adam"
    if opt not in OPTIMIZER_STATES:
        raise PlanError(f"plan: unknown optimizer {opt!r} (known: {', '.join(OPTIMIZER_STATES)})")
    precision = getattr(plan, "precision", "fp32")
    model = CostModel(plan.machine, optimizer=opt, precision=precision)
    gc = GraphCost(g, model)
    views = dict(plan.views)
    for nid in gc.nodes():
        if nid not in views:
            n = g.node(nid)
            raise PlanError(f"plan: no machine view for node {n.label()} ({n.op})")
    res = MachineMapper(model).evaluate(g, views)

    operators = tuple(_operator_row(g, gc, nid, views[nid]) for nid in gc.nodes())
    comm = tuple(_comm_rows(g, gc, views))
    grads = tuple(_grad_rows(g, gc, views))
    steps = rule_steps(plan)
    rules = tuple(describe_steps(steps)) if steps else ()
    pipe, stages = _pipeline(plan, gc, views)
    b = res.breakdown
    tech = _techniques(plan, gc, views, res)
    totals = {"sum_of_leaves_s": b.time if math.isfinite(b.time) else None,
              "compute_s": b.compute, "comm_s": b.comm, "grad_sync_s": b.sync, "update_s": b.update,
              "comm_elements": b.comm_elements,
              "activation_comm_elements": sum(r.elements for r in comm),
              "grad_sync_elements": sum(r.elements for r in grads),
              "max_memory_bytes": res.memory.max_bytes if res.memory else None,
              "feasible": res.feasible, "reason": res.reason, "devices_used": res.stats.get("devices_used", 0),
              "optimizer": opt, "precision": precision,
              "parallel_ops": {k: v for k, v in sorted(g.op_counts().items()) if ops.get_op(k).kind == "parallel"}}
    if tech is not None:
        totals.update(techniques=tech)
    mem = getattr(plan, "memory", None)
    if mem is not None and not mem.empty:
        totals.update(memory_plan=memory_words(mem))
    made = made_by(plan)
    if made:
        totals.update(made_by=made)
    return Explanation(plan.model_path, plan.machine.describe(), plan.machine.num_devices, operators, rules,
                       steps is not None, comm, grads, pipe, stages, totals, dict(plan.predicted),
                       tuple(steps or ()))


def _techniques(plan, gc, views, res) -> dict | None:
    """The plan's memory techniques and the machine's overlap (search/memtech.py) re-priced: the rows of the
    iteration (they add up to ``iteration_s``), one line per technique, memory with them.  None for a
    pipeline plan and where neither applies (the leaves are then the whole story)."""
    mem = getattr(plan, "memory", None)
    if plan.pipeline is not None or (mem is None and not plan.machine.overlap_grad_sync):
        return None
    from unity_pcg.search import memtech
    p = memtech.price(gc, views, mem, base=res.breakdown.time)
    return {"iteration_s": p.iteration_s, "rows": [[k, v] for k, v in p.rows()], "lines": memtech.describe(p),
            "max_memory_bytes": p.max_bytes, "feasible": p.feasible, "reason": p.reason,
            "memory": None if mem is None else mem.to_json(), **p.to_json()}


def memory_words(mem) -> str:
    """The plan's memory techniques in a line (the priced figures are the search's: see the stages)."""
    parts = []
    if mem.zero:
        parts.append(f"ZeRO-{mem.zero}")
    if mem.offload:
        parts.append("optimizer states and update offloaded to host memory")
    if mem.recompute:
        modes: dict = {}
        for r in mem.recompute:
            modes[r.mode] = modes.get(r.mode, 0) + 1
        parts.append(f"{len(mem.recompute)} region(s) recomputed ("
                     + ", ".join(f"{k} {v}" for k, v in sorted(modes.items())) + ")")
    return "; ".join(parts) or "none"


def made_by(plan) -> str | None:
    """What made the plan, from its ``info``: the strategy and, for a tuned baseline, the configuration its grid
    chose (``megatron (tuned): tp1 pp1 dp8 mbs4 x1 distopt, best of 294 configurations priced``); for the
    search, the mechanism it names (``info.search.chosen``).  None when the plan records neither."""
    info = plan.info if isinstance(plan.info, Mapping) else {}
    strategy = info.get("strategy")
    search = info.get("search") if isinstance(info.get("search"), Mapping) else {}
    tuned = search.get("tuned") if isinstance(search.get("tuned"), Mapping) else None
    if tuned and isinstance(tuned.get("chosen"), str):
        n = tuned.get("points_priced")
        return f"{strategy or tuned.get('strategy')} (tuned): {tuned['chosen']}" + \
            (f", best of {n} configurations priced" if isinstance(n, int) else "")
    if isinstance(search.get("chosen"), str):
        return f"{strategy or 'unity'}: {search['chosen']}"
    return strategy if isinstance(strategy, str) else None


def _recorded(plan, key: str):
    for src in (plan.predicted, plan.info):
        if isinstance(src, Mapping) and isinstance(src.get(key), str):
            return src[key]
    return None


def _operator_row(g, gc, nid: int, view: MachineView) -> OperatorRow:
    n = g.node(nid)
    s = g.shapes(nid)[0]
    grid = ""
    if n.kind == "compute":
        pm = ops.infer(n.op, n.a, g.input_shapes(nid)).piece_map
        grid = " ".join(f"{a}:{d}" for a, d in pm.axes)
        names = [a for a, _ in pm.axes]
    else:   # a parallel operator's tasks are its output's pieces: (copy, sum, dims...)
        names = ["copy", "sum"] + [f"dim{i}" for i in range(s.rank)]
    return OperatorRow(nid, n.label(), n.op, n.kind, gc.role[nid], str(s), s.degrees, s.sum_degree,
                       s.copy_degree, grid, view, tuple(sorted(set(view.devices()))),
                       view_text(view, names))


def _comm_rows(g, gc, views) -> Iterable[CommRow]:
    for nid in gc.nodes():
        n = g.node(nid)
        for pos, prod in gc.priced_inputs(nid):
            e = gc.edge_cost(nid, pos, views[prod], views[nid])
            if e.comm_elements == 0 and e.time == 0:
                continue
            ref = gc.read_ref(nid, pos)
            kind = gc.fused(nid) or (PARALLEL_KINDS[n.op][0] if n.op in PARALLEL_KINDS else COMPUTE_EDGE)
            devs = set(views[nid].devices()) | set(gc.placement(prod, views[prod], ref[1]))
            yield CommRow(nid, n.label(), n.op, pos, prod, g.node(prod).label(), kind, str(g.shape(ref)),
                          e.comm_elements, tuple(sorted(devs)), e.time)


def _weight_name(g, nid: int) -> str:
    while g.node(nid).kind != "source":
        nid = g.node(nid).inputs[0][0]
    return g.node(nid).label()


def _grad_rows(g, gc, views) -> Iterable[GradSyncRow]:
    """Chain ends of trained weights with copies: their gradients are all-reduced over the copies (the
    algorithm named is the one priced for the message the gradient travels in)."""
    from unity_pcg.search import collectives as C
    for nid in gc.nodes():
        if gc.role[nid] != "weight-placement" or not gc.trainable(nid):
            continue
        users = [u for k in range(len(g.shapes(nid))) for u, _ in g.consumers((nid, k))]
        if users and all(gc.role[u] == "weight-placement" for u in users):
            continue                                   # not where the weight lives
        s = g.shapes(nid)[0]
        if s.copy_degree <= 1:
            continue
        c = gc.own_cost(nid, views[nid])
        devs = views[nid].devices()
        rest = s.piece_count // s.copy_degree
        first = sorted({d for i, d in enumerate(devs) if i % rest == 0})     # the copies of one piece
        total = gc.model.sync_total_bytes or gc._sync_bytes
        algo = C.algorithm_name(gc.machine, "all_reduce", first, gc.model.sync_message_bytes(s.piece_nbytes, total))
        yield GradSyncRow(nid, _weight_name(g, nid), str(s), rest, s.copy_degree,
                          c.comm_elements, tuple(sorted(set(devs))), c.sync, algo)


# --- rule sequence -------------------------------------------------------------------------------

def rule_steps(plan) -> list | None:
    """The rule sequence a plan records (None when it records none).  Read from the plan's
    ``rules`` / ``rule_sequence`` attribute or from its ``info`` (the search writes it there)."""
    for name in ("rules", "rule_sequence", "rule_steps"):
        v = getattr(plan, name, None)
        if v is not None and not callable(v):
            return list(v)
    info = plan.info if isinstance(plan.info, Mapping) else {}
    for name in ("rules", "rule_sequence", "rule_steps"):
        v = info.get(name)
        if v is not None:
            if not isinstance(v, (list, tuple)):
                raise PlanError(f"plan: field info.{name} must be a list")
            return list(v)
    return None


def _get(step: Any, *names: str):
    for k in names:
        if isinstance(step, Mapping) and k in step:
            return step[k]
        v = getattr(step, k, None)
        if v is not None and not callable(v):
            return v
    return None


def describe_steps(steps: Sequence[Any]) -> list[str]:
    """One sentence per step: the rule's name, what it rewrites into what (from the shipped rule set
    when the rule is found there), where it matched and the values it bound."""
    try:
        from unity_pcg.substitutions.cache import load as load_rules
        rs = load_rules()
        known = {r.name: r for r in rs.all_directions()}
    except Exception:   # a plan stays explainable without a readable rule cache
        known = {}
    out = []
    for i, st in enumerate(steps, 1):
        if isinstance(st, str):
            name, site, bind = st, None, None
        else:
            name = _get(st, "rule", "rule_id", "name", "id")
            if name is not None and not isinstance(name, str):
                name = _get(name, "name") or str(name)
            site = _get(st, "site", "nodes", "match", "at")
            bind = _get(st, "bindings", "binding", "bind", "bound")
        rule = known.get(name) if isinstance(name, str) else None
        pairs = list(bind.items() if isinstance(bind, Mapping) else bind) if bind else []
        words = f"{i}. {name or '(unnamed rule)'}"
        if rule is not None:   # the rule's patterns with the bound values put in
            outs = range(len(rule.source.outputs))
            text = "; ".join(f"{rule.source.expr(k)} into {rule.target.expr(k)}" for k in outs)
            for k, v in sorted(pairs, key=lambda kv: -len(str(kv[0]))):
                text = re.sub(r"\$" + re.escape(str(k)) + r"\b", str(v), text)
            words += ": rewrites " + text
        if site:
            shown = site if isinstance(site, str) else ", ".join(str(x) for x in (
                site.values() if isinstance(site, Mapping) else site))
            words += f" at {'nodes ' if not isinstance(site, str) else ''}{shown}"
        if pairs and rule is None:
            words += " with " + ", ".join(f"{k}={v}" for k, v in pairs)
        out.append(words)
    return out


# --- pipeline ------------------------------------------------------------------------------------

# per-stage figures the search may record (search/pipeline.py PipelineStage.to_json)
STAGE_FIGURES = ("fwd_s", "bwd_s", "send_s", "once_s", "in_flight", "memory_bytes", "layers")


def _recorded_stages(plan) -> list:
    """Per-stage figures from the plan's prediction (``predicted.pipeline.stages`` or
    ``predicted.stages``), when the search wrote them."""
    pred = plan.predicted if isinstance(plan.predicted, Mapping) else {}
    for src in (pred.get("pipeline"), pred):
        if isinstance(src, Mapping) and isinstance(src.get("stages"), list):
            return [st if isinstance(st, Mapping) else {} for st in src["stages"]]
    return []


def _pipeline(plan, gc=None, views=None) -> tuple[Mapping[str, Any] | None, tuple[StageRow, ...]]:
    p = plan.pipeline
    if p is None:
        return None, ()
    if not isinstance(p, Mapping):
        raise PlanError("plan: field pipeline must be an object or null")
    stages = p.get("stages", [])
    if not isinstance(stages, list):
        raise PlanError("plan: field pipeline.stages must be a list")
    g = plan.pcg
    rec = _recorded_stages(plan)
    by_name = {n.label(): n.id for n in g.nodes()}
    rows = []
    for i, st in enumerate(stages):
        if not isinstance(st, Mapping):
            raise PlanError(f"plan: pipeline stage {i} must be an object")
        names = []
        ids = []
        for x in st.get("nodes", []):
            if isinstance(x, int) and not isinstance(x, bool) and x in g:
                names.append(g.node(x).label())
                ids.append(x)
            else:
                names.append(str(x))
                if isinstance(x, str) and x in by_name:
                    ids.append(by_name[x])
        leaves = 0.0
        if gc is not None:
            priced = set(gc.nodes())
            leaves = sum(gc.leaf_cost(n, views[n], views).time for n in ids if n in priced)
        figures = {k: rec[i][k] for k in STAGE_FIGURES if i < len(rec) and k in rec[i]}
        try:
            devs = tuple(int(d) for d in st.get("devices", []))
        except (TypeError, ValueError):
            raise PlanError(f"plan: pipeline stage {i} has a malformed device list") from None
        topo = {n: k for k, n in enumerate(g.topo_order())}
        opnames = tuple(g.node(n).label() for n in sorted(set(ids), key=topo.get) if g.node(n).kind != "source")
        rows.append(StageRow(i, tuple(names), devs, leaves_s=leaves, recorded=figures, operators=opnames))
    head = {k: v for k, v in p.items() if k != "stages"}
    return head, tuple(rows)


# --- text ----------------------------------------------------------------------------------------

def device_ranges(devs: Iterable[int]) -> str:
    """``0-3,6,8-9``: a device set in a few characters."""
    ds = sorted(set(devs))
    if not ds:
        return "-"
    parts = []
    a = b = ds[0]
    for d in ds[1:]:
        if d == b + 1:
            b = d
            continue
        parts.append(f"{a}-{b}" if b > a else f"{a}")
        a = b = d
    parts.append(f"{a}-{b}" if b > a else f"{a}")
    return ",".join(parts)


def _ms(t: float | None) -> str:
    """A duration in the unit that shows it (s, ms, us)."""
    if t is None or not math.isfinite(t):
        return "-"
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3 or t == 0:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.2f} us"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set = frozenset()) -> list[str]:
    w = [len(h) for h in header]
    for r in rows:
        w = [max(a, len(c)) for a, c in zip(w, r)]

    def line(cells):
        return "  ".join(c.rjust(x) if i in right else c.ljust(x) for i, (c, x) in enumerate(zip(cells, w))).rstrip()
    return [line(header), line(["-" * x for x in w])] + [line(r) for r in rows]


def _clip(s: str, n: int = 40) -> str:
    """At most ``n`` characters, cut in the middle (names differ at their ends: layer and op)."""
    if len(s) <= n:
        return s
    head = (n - 3) // 2
    return s[:head] + "..." + s[len(s) - (n - 3 - head):]


def format_text(e: Explanation, limit: int | None = None, sections: Sequence[str] | None = None) -> str:
    """The explanation as text tables.  ``limit`` keeps the first ``limit`` operators and the
    ``limit`` most expensive transfers (the rest are counted); ``sections`` picks among
    summary, operators, rules, communication, gradients, pipeline (default all)."""
    want = set(sections or ("summary", "operators", "rules", "communication", "gradients", "pipeline"))
    t = e.totals
    out: list[str] = []
    if "summary" in want:
        pred = e.predicted.get("predicted_iteration_s")
        out.append(f"plan for {e.model} on {e.machine}, precision {t.get('precision', 'fp32')}")
        if t.get("made_by"):
            out.append(f"made by: {t['made_by']}")
        out.append(f"predicted iteration: {_ms(pred)} (the plan's); re-priced with every operator one after "
                   f"the other: {_ms(t['sum_of_leaves_s'])}")
        out.append(f"  compute {_ms(t['compute_s'])}, transfers {_ms(t['comm_s'])}, gradient sync "
                   f"{_ms(t['grad_sync_s'])}, optimizer update {_ms(t['update_s'])}")
        out.append(f"communication per iteration: {t['comm_elements']:,} elements ({t['activation_comm_elements']:,} "
                   f"activations, {t['grad_sync_elements']:,} gradients); busiest device holds "
                   f"{_bytes(t.get('max_memory_bytes'))}"
                   + (" (the whole batch at once)" if e.pipeline is not None else ""))
        tech = t.get("techniques")
        if tech:
            rows = " ".join(f"{'-' if v < 0 else '+'} {k} {_ms(abs(v))}" for k, v in tech["rows"]).lstrip("+ ")
            out.append(f"with memory techniques and overlap: {_ms(tech['iteration_s'])} = {rows}; busiest device "
                       f"holds {_bytes(tech['max_memory_bytes'])}")
            for line in tech["lines"]:
                out.append(f"  {line}")
        if t.get("memory_plan") and not tech:
            out.append(f"memory techniques: {t['memory_plan']}")
        if not t["feasible"] and not (tech and tech["feasible"]):
            if e.pipeline is not None:       # the re-pricing above runs the whole batch at once, without them
                out.append(f"the whole batch at once, without the plan's techniques: {t['reason']}; the plan runs "
                           f"{e.pipeline.get('micro_batches', '?')} micro-batches (per stage: pipeline below)")
            else:
                out.append(f"INFEASIBLE: {t['reason']}")
        par = ", ".join(f"{k} {v}" for k, v in t["parallel_ops"].items()) or "none"
        out.append(f"parallel operators: {par}; {t['devices_used']} of {e.devices} devices used")
    if "operators" in want:
        out.append("")
        out.append("operators (shard: degree per dim of the output; view: @start [task axis degree:stride])")
        rows = [[_clip(r.name), r.op + ("*" if r.kind == "parallel" else ""),
                 "x".join(map(str, r.shard)) or "-", str(r.sum_degree), str(r.copy_degree),
                 r.view_text or "-", device_ranges(r.devices)]
                for r in e.operators]
        shown = rows if limit is None else rows[:limit]
        out += _table(["node", "op", "shard", "sum", "copy", "view", "devices"], shown, {3, 4})
        if len(shown) < len(rows):
            out.append(f"... {len(rows) - len(shown)} more operators (* = parallel operator)")
        else:
            out.append("(* = parallel operator)")
    if "rules" in want:
        out.append("")
        if not e.rules_recorded:
            out.append("rules applied: none recorded")
        elif not e.rules:
            out.append("rules applied: none (the plan is the imported graph's own parallelization)")
        else:
            out.append(f"rules applied ({len(e.rules)}, in order):")
            shown_r = e.rules if limit is None else e.rules[:limit]
            out += ["  " + r for r in shown_r]
            if len(shown_r) < len(e.rules):
                out.append(f"  ... {len(e.rules) - len(shown_r)} more steps")
    if "communication" in want:
        out.append("")
        if not e.comm:
            out.append("activation transfers: none")
        else:
            out.append(f"activation transfers (forward + backward; {len(e.comm)} edges, most expensive first)")
            rows_c = sorted(e.comm, key=lambda r: (-r.time_s, -r.elements, r.consumer))
            shown_c = rows_c if limit is None else rows_c[:limit]
            out += _table(["into", "from", "collective", "shape", "elements", "devices", "time"],
                          [[_clip(r.consumer_name, 44), _clip(r.producer_name, 44), r.collective, r.shape,
                            f"{r.elements:,}", device_ranges(r.devices), _ms(r.time_s)] for r in shown_c], {4, 6})
            if len(shown_c) < len(rows_c):
                rest = rows_c[len(shown_c):]
                out.append(f"... {len(rest)} more edges ({sum(r.elements for r in rest):,} elements, "
                           f"{_ms(sum(r.time_s for r in rest))})")
    if "gradients" in want:
        out.append("")
        if not e.grad_sync:
            out.append("gradient all-reduces: none (no replicated trained weight)")
        else:
            algos = sorted({r.algorithm for r in e.grad_sync if r.algorithm}) or ["ring"]
            out.append(f"gradient all-reduces ({len(e.grad_sync)} weights; per group of copies: {', '.join(algos)})")
            rows_g = sorted(e.grad_sync, key=lambda r: (-r.time_s, r.node))
            shown_g = rows_g if limit is None else rows_g[:limit]
            out += _table(["weight", "shape", "groups x copies", "elements", "devices", "algorithm", "time"],
                          [[_clip(r.weight), r.shape, f"{r.groups} x {r.group_size}", f"{r.elements:,}",
                            device_ranges(r.devices), r.algorithm or "ring", _ms(r.time_s)] for r in shown_g], {3, 6})
            if len(shown_g) < len(rows_g):
                rest = rows_g[len(shown_g):]
                out.append(f"... {len(rest)} more weights ({sum(r.elements for r in rest):,} elements)")
    if "pipeline" in want:
        out.append("")
        if e.pipeline is None:
            out.append("pipeline: none (every operator runs on its own view, no stages)")
        else:
            out.append(f"pipeline: schedule {e.pipeline.get('schedule', '?')}, "
                       f"{e.pipeline.get('micro_batches', '?')} micro-batches, {len(e.stages)} stages")
            rows_s = []
            for s in e.stages:
                r = s.recorded
                o = s.operators
                names = (f"{_clip(o[0], 24)} .. {_clip(o[-1], 24)} ({len(o)} operators)" if len(o) > 1
                         else (o[0] if o else f"{len(s.nodes)} nodes"))
                rows_s.append([str(s.index), device_ranges(s.devices), _ms(s.leaves_s),
                               _ms(r.get("fwd_s")) if "fwd_s" in r else "-", _ms(r.get("bwd_s")) if "bwd_s" in r else "-",
                               _ms(r.get("send_s")) if "send_s" in r else "-", str(r.get("in_flight", "-")),
                               _bytes(r.get("memory_bytes")), names])
            out += ["  " + x for x in _table(
                ["stage", "devices", "operators", "fwd/mb", "bwd/mb", "send/mb", "in flight", "memory", "nodes"],
                rows_s, {2, 3, 4, 5, 6, 7})]
            out.append("  (operators: the stage's operators re-priced one after the other for the whole batch; "
                       "per micro-batch (mb) figures are the search's)")
    return "\n".join(out) + "\n"


# --- DOT -----------------------------------------------------------------------------------------

def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(plan, e: Explanation) -> str:
    """The plan's PCG in Graphviz DOT: compute nodes white, sources grey, parallel operators filled by
    kind (legend included), each node with its devices; edges labeled with their parallel shape,
    communicating edges red with their element count; pipeline stages as clusters."""
    g = plan.pcg
    rows = {r.id: r for r in e.operators}
    comm = {}
    for c in e.comm:
        comm[(c.producer, c.consumer, c.pos)] = c
    grads = {r.node: r for r in e.grad_sync}
    lines = ["digraph plan {", "  rankdir=TB;", "  node [shape=box, fontname=Helvetica, fontsize=10];",
             "  edge [fontname=Helvetica, fontsize=8];"]

    def node_line(n) -> str:
        r = rows.get(n.id)
        lab = f"{n.op}\\n{_esc(n.label())}"
        if r is not None:
            if r.grid:
                lab += f"\\ntasks {r.grid}"
            lab += f"\\ndevices {device_ranges(r.devices)}"
        if n.id in grads:
            lab += f"\\ngrad all-reduce {grads[n.id].elements:,} el"
        if n.kind == "parallel":
            color = PARALLEL_KINDS.get(n.op, ("", "#cccccc"))[1]
            style = "filled,bold"
            shape = ", shape=octagon" if n.op in ("Reduce", "AllReduce") else ""
        elif n.kind == "source":
            color, style, shape = SOURCE_COLOR, "filled", ", shape=ellipse"
        else:
            color, style, shape = "white", "filled", ""
        return f'n{n.id} [label="{lab}", style="{style}", fillcolor="{color}"{shape}];'

    staged: set = set()
    by_name = {n.label(): n.id for n in g.nodes()}
    for s in e.stages:
        ids = [by_name.get(x, x) for x in (plan.pipeline or {}).get("stages", [])[s.index].get("nodes", [])]
        ids = [x for x in ids if isinstance(x, int) and not isinstance(x, bool) and x in g]
        lines.append(f"  subgraph cluster_stage{s.index} {{")
        lines.append(f'    label="stage {s.index}: devices {device_ranges(s.devices)}"; style=dashed;')
        for x in ids:
            if x not in staged:
                staged.add(x)
                lines.append("    " + node_line(g.node(x)))
        lines.append("  }")
    for n in g.nodes():
        if n.id not in staged:
            lines.append("  " + node_line(n))
    for n in g.nodes():
        for pos, r in enumerate(n.inputs):
            lab = _esc(str(g.shape(r)))
            c = comm.get((r[0], n.id, pos))
            if c is not None:
                lines.append(f'  n{r[0]} -> n{n.id} [label="{lab}\\n{c.collective}: {c.elements:,} el", '
                             f'color="#d62828", fontcolor="#d62828", penwidth=2];')
            else:
                lines.append(f'  n{r[0]} -> n{n.id} [label="{lab}"];')
    used = sorted({r.op for r in e.operators if r.kind == "parallel"})
    if used:
        lines.append("  subgraph cluster_legend {")
        lines.append('    label="parallel operators"; style=rounded; fontsize=10;')
        for op in used:
            lines.append(f'    legend_{op} [label="{op}: {PARALLEL_KINDS.get(op, ("?", ""))[0]}", style=filled, '
                         f'fillcolor="{PARALLEL_KINDS.get(op, ("", "#cccccc"))[1]}"];')
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


__all__ = ["Explanation", "OperatorRow", "CommRow", "GradSyncRow", "StageRow", "explain", "format_text", "to_dot",
           "rule_steps", "describe_steps", "device_ranges", "PARALLEL_KINDS"]
