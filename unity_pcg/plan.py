"""The plan file (DESIGN "Plan file"): versioned JSON, validated on load, data only.

A plan holds the model's identity (path and sha256), the machine, the parallelized PCG, the machine
view of every operator, the pipeline schedule if any, and the predicted iteration time, memory per
device and communication volume, the precision it was priced in (``precision``: fp32, tf32 or bf16;
missing in older plans = fp32), the memory techniques it trains with (``memory``, :class:`MemoryPlan`: ZeRO
stage, optimizer-state offload, recomputed regions; missing = none), and (optional, ``rules``) the rule sequence that produced the PCG
from the imported model: one ``{"rule", "nodes", "inputs", "bind"}`` object per step (see
``search.substitution.RuleStep``; ``search.substitution.replay`` re-applies it).  Loading re-infers every shape of the PCG and checks every view
against its operator's task grid and the machine, so a plan from a stranger is checked data.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import ops
from .errors import PlanError, UnityError
from .machine import MODES as PRECISIONS
from .machine import MachineSpec, MachineView
from .pcg import PCG

SCHEMA = "unity-pcg/plan/v1"
PIPELINE_SCHEDULE = "1F1B"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


RECOMPUTE_MODES = ("full", "selective")


@dataclass(frozen=True)
class RecomputeRegion:
    """Compute nodes whose forward is run again in the backward pass.  ``full``: only the region's inputs
    are kept; ``selective``: inside the region the outputs of matmul- and convolution-class operators are
    kept too and the rest (softmax, dropout, norms, element-wise) is recomputed (Megatron-LM's selective
    form, by operator class)."""
    nodes: tuple[int, ...]
    mode: str = "full"

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "mode": self.mode}


@dataclass(frozen=True)
class MemoryPlan:
    """The memory techniques a plan trains with (DESIGN "Plan file").  ``zero``: ZeRO stage over each
    weight's data-parallel copies (the devices holding identical copies of one weight piece): 1 shards the
    optimizer states, 2 also the gradients (reduce-scatter), 3 also the parameters (all-gathered before use
    in the forward and again in the backward).  ``offload``: optimizer states and the update in host memory.
    ``recompute``: regions recomputed in the backward.  Sequence parallelism is a layout, not a field."""
    zero: int = 0
    offload: bool = False
    recompute: tuple[RecomputeRegion, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.zero and not self.offload and not self.recompute

    def to_json(self) -> dict:
        return {"zero": self.zero, "offload": self.offload, "recompute": [r.to_json() for r in self.recompute]}

    @staticmethod
    def from_json(obj: Any, pcg: PCG | None = None) -> "MemoryPlan":
        """Checked: stage 0-3, a boolean offload, regions of distinct compute nodes of ``pcg``."""
        if not isinstance(obj, Mapping):
            raise PlanError("plan: field memory must be an object")
        zero = obj.get("zero", 0)
        if not _is_int(zero) or not 0 <= zero <= 3:
            raise PlanError(f"plan: field memory.zero must be a ZeRO stage 0-3, got {zero!r}")
        offload = obj.get("offload", False)
        if not isinstance(offload, bool):
            raise PlanError("plan: field memory.offload must be true or false")
        regions, seen = [], set()
        for k, r in enumerate(_list(obj.get("recompute", []), "memory.recompute")):
            if not isinstance(r, Mapping):
                raise PlanError(f"plan: memory.recompute[{k}] must be an object")
            mode = r.get("mode", "full")
            if mode not in RECOMPUTE_MODES:
                raise PlanError(f"plan: memory.recompute[{k}].mode must be one of {', '.join(RECOMPUTE_MODES)}, "
                                f"got {mode!r}")
            nodes = _list(r.get("nodes"), f"memory.recompute[{k}].nodes")
            if not nodes or not all(_is_int(n) for n in nodes):
                raise PlanError(f"plan: memory.recompute[{k}].nodes must be a non-empty list of node ids")
            for n in nodes:
                if n in seen:
                    raise PlanError(f"plan: node {n} is in two recompute regions")
                seen.add(n)
                if pcg is not None and (n not in pcg or pcg.node(n).kind != "compute"):
                    raise PlanError(f"plan: memory.recompute[{k}] names node {n}, which is not a compute "
                                    f"node of the PCG")
            regions.append(RecomputeRegion(tuple(nodes), mode))
        return MemoryPlan(zero, offload, tuple(regions))


@dataclass(frozen=True)
class Plan:
    model_path: str
    model_sha256: str
    machine: MachineSpec
    pcg: PCG
    views: Mapping[int, MachineView]
    predicted: Mapping[str, Any]
    pipeline: Mapping[str, Any] | None = None
    info: Mapping[str, Any] = field(default_factory=dict)
    rules: tuple | None = None          # the rule sequence (JSON objects), None when not recorded
    precision: str = "fp32"             # math mode the plan was priced in (fp32, tf32, bf16: DESIGN "Cost model")
    memory: MemoryPlan | None = None    # memory techniques (None: none)

    def to_json(self) -> dict:
        return {"schema": SCHEMA,
                "model": {"path": self.model_path, "sha256": self.model_sha256},
                "machine": self.machine.to_json(),
                "pcg": self.pcg.to_json(),
                "views": {str(k): v.to_json() for k, v in sorted(self.views.items())},
                "pipeline": dict(self.pipeline) if self.pipeline is not None else None,
                "predicted": {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for k, v in self.predicted.items()},
                "info": dict(self.info),
                "precision": self.precision,
                **({"memory": self.memory.to_json()} if self.memory is not None and not self.memory.empty else {}),
                **({"rules": [dict(x) for x in self.rules]} if self.rules is not None else {})}

    def save(self, path: str) -> None:
        """Write the plan to ``path`` (atomically: a temporary file, then renamed), one top-level field a line,
        each in compact JSON: written by the json module's C encoder (an indented dump runs its Python encoder,
        seconds on a large plan, after the search and counted against ``optimize --budget``)."""
        tmp = f"{path}.tmp"
        text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in self.to_json().items()) + "\n}\n"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def check_model(self, path: str | None = None) -> None:
        """Refuse a model file whose contents differ from the one the plan was made for."""
        p = path or self.model_path
        if not os.path.exists(p):
            raise PlanError(f"model file {p} of the plan does not exist")
        got = file_sha256(p)
        if got != self.model_sha256:
            raise PlanError(f"model file {p} has sha256 {got[:12]}..., the plan was made for "
                            f"{self.model_sha256[:12]}...")


def _need(obj: Mapping, key: str, kind, where: str):
    # (a dict first: isinstance against typing's Mapping alias is slow, and a large plan has thousands of fields)
    if not (isinstance(obj, dict) or isinstance(obj, Mapping)) or key not in obj:
        raise PlanError(f"plan: missing field {where}{key}")
    v = obj[key]
    if not isinstance(v, kind):
        raise PlanError(f"plan: field {where}{key} must be {getattr(kind, '__name__', kind)}")
    return v


def from_json(obj: Any) -> Plan:
    if not isinstance(obj, Mapping):
        raise PlanError("plan: not a JSON object")
    schema = obj.get("schema")
    if schema != SCHEMA:
        raise PlanError(f"plan: unsupported schema {schema!r} (expected {SCHEMA!r})")
    model = _need(obj, "model", dict, "")
    path = _need(model, "path", str, "model.")
    sha = _need(model, "sha256", str, "model.")
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise PlanError("plan: field model.sha256 is not a sha256 hex digest")
    try:
        machine = MachineSpec.from_json(_need(obj, "machine", dict, ""), source="plan field machine")
        pcg = PCG.from_json(_need(obj, "pcg", dict, ""))
    except PlanError:
        raise
    except UnityError as e:
        raise PlanError(f"plan: {e}") from None
    views = {}
    for k, v in _need(obj, "views", dict, "").items():
        try:
            nid = int(k)
            view = MachineView.from_json(v)
        except (ValueError, UnityError) as e:
            raise PlanError(f"plan: bad view for node {k!r}: {e}") from None
        if nid not in pcg:
            raise PlanError(f"plan: view for node {nid}, which is not in the PCG")
        if not view.is_valid(machine):
            raise PlanError(f"plan: view {view} of node {pcg.node(nid).label()} uses devices outside the "
                            f"{machine.num_devices}-device machine")
        n = pcg.node(nid)
        if n.kind == "compute":
            pm = ops.infer(n.op, n.a, pcg.input_shapes(nid)).piece_map
            if view.degree != pm.degree:
                raise PlanError(f"plan: view {view} of node {n.label()} ({n.op}) has {view.degree} devices but "
                                f"the operator has {pm.degree} tasks")
        views[nid] = view
    predicted = _need(obj, "predicted", dict, "")
    pipeline = obj.get("pipeline")
    if pipeline is not None:
        validate_pipeline_field(pipeline, pcg, views, machine)
    rules = obj.get("rules")
    if rules is not None:
        rules = tuple(_check_step(k, st) for k, st in enumerate(_list(rules, "rules")))
    precision = obj.get("precision", "fp32")     # plans written before precision existed: fp32
    if precision not in PRECISIONS:
        raise PlanError(f"plan: field precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    memory = obj.get("memory")
    memory = MemoryPlan.from_json(memory, pcg) if memory is not None else None
    if memory is not None and pipeline is not None:
        stage_of = {n: i for i, st in enumerate(pipeline["stages"]) for n in st["nodes"]}
        for k, r in enumerate(memory.recompute):
            if len({stage_of.get(n) for n in r.nodes}) > 1:
                raise PlanError(f"plan: memory.recompute[{k}] spans two pipeline stages")
    return Plan(path, sha, machine, pcg, views, predicted, pipeline, obj.get("info") or {}, rules, precision,
                memory if memory is not None and not memory.empty else None)


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise PlanError(f"plan: field {where} must be a list")
    return v


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_step(k: int, st: Any) -> dict:
    """One recorded rule step, checked for shape: rule name, matched node ids, input tensors, bindings."""
    where = f"rules[{k}]"
    if not (isinstance(st, dict) or isinstance(st, Mapping)):
        raise PlanError(f"plan: field {where} must be an object")
    name = _need(st, "rule", str, where + ".")
    nodes = _list(_need(st, "nodes", list, where + "."), where + ".nodes")
    if not nodes or not all(_is_int(n) and n >= 0 for n in nodes):
        raise PlanError(f"plan: field {where}.nodes must be a non-empty list of node ids")
    ins = _need(st, "inputs", dict, where + ".")
    for key, r in ins.items():
        if not (isinstance(r, list) and len(r) == 2 and all(_is_int(x) and x >= 0 for x in r)):
            raise PlanError(f"plan: field {where}.inputs.{key} must be [node id, output index]")
    bind = st.get("bind", {})
    if not (isinstance(bind, dict) or isinstance(bind, Mapping)):
        raise PlanError(f"plan: field {where}.bind must be an object")
    return {"rule": name, "nodes": list(nodes), "inputs": {str(a): list(b) for a, b in ins.items()},
            "bind": dict(bind)}


def validate_pipeline_field(pipeline: Any, pcg: PCG, views: Mapping[int, MachineView],
                            machine: MachineSpec) -> None:
    """Check a plan's ``pipeline`` field against its PCG and views (raises PlanError): the
    schedule, a positive number of micro-batches dividing the batch, every node in exactly one
    stage, stages contiguous in topological order, devices of different stages disjoint and on the
    machine, every view inside its stage's devices, sources and placement chains in the stage of
    their first consumer (sources may be left out of the lists: they then belong there implicitly)."""
    if not isinstance(pipeline, Mapping):
        raise PlanError("plan: field pipeline must be an object")
    if pipeline.get("schedule") != PIPELINE_SCHEDULE:
        raise PlanError(f"plan: pipeline.schedule must be {PIPELINE_SCHEDULE!r}, got {pipeline.get('schedule')!r}")
    M = pipeline.get("micro_batches")
    if not isinstance(M, int) or isinstance(M, bool) or M < 1:
        raise PlanError(f"plan: pipeline.micro_batches must be a positive integer, got {M!r}")
    B = next((pcg.shapes(n.id)[0].sizes[0] for n in pcg.sources("Input") if pcg.shapes(n.id)[0].rank), M)
    if B % M:
        raise PlanError(f"plan: pipeline.micro_batches {M} does not divide the batch {B}")
    stages = pipeline.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanError("plan: pipeline.stages must be a non-empty list")
    stage_of: dict = {}
    used: set = set()
    for k, st in enumerate(stages):
        if not isinstance(st, Mapping) or not isinstance(st.get("nodes"), list) or \
                not isinstance(st.get("devices"), list) or not st["devices"]:
            raise PlanError(f"plan: pipeline.stages[{k}] needs lists 'nodes' and 'devices'")
        devs = set()
        for d in st["devices"]:
            if not isinstance(d, int) or not 0 <= d < machine.num_devices:
                raise PlanError(f"plan: pipeline.stages[{k}] names device {d!r}, not on the machine")
            devs.add(d)
        if devs & used:
            raise PlanError(f"plan: pipeline.stages[{k}] shares devices with an earlier stage")
        used |= devs
        for nid in st["nodes"]:
            if not isinstance(nid, int) or nid not in pcg:
                raise PlanError(f"plan: pipeline.stages[{k}] names node {nid!r}, not in the PCG")
            if nid in stage_of:
                raise PlanError(f"plan: node {nid} is in two pipeline stages")
            stage_of[nid] = k
            v = views.get(nid)
            if v is not None and not set(v.devices()) <= devs:
                raise PlanError(f"plan: view {v} of node {pcg.node(nid).label()} leaves the devices of "
                                f"pipeline stage {k}")
    # sources (Input, Weight) may be left out: they belong to the stage of their first consumer
    missing = [n for n in pcg.node_ids() if n not in stage_of and pcg.node(n).kind != "source"]
    if missing:
        raise PlanError(f"plan: node {pcg.node(missing[0]).label()} is in no pipeline stage")
    seq = [stage_of[n] for n in pcg.topo_order() if n in stage_of]
    if any(b < a for a, b in zip(seq, seq[1:])):
        raise PlanError("plan: pipeline stages are not contiguous in topological order")
    roles = pcg.roles()
    for nid in pcg.topo_order():     # sources and placements: in the stage of their first consumer
        n = pcg.node(nid)
        if roles[nid] in ("compute", "parallel"):
            continue
        uses = [c for k in range(len(pcg.shapes(nid))) for c, _ in pcg.consumers((nid, k))]
        if nid not in stage_of:
            continue
        if uses and stage_of[nid] != min(stage_of[c] for c in uses):
            raise PlanError(f"plan: node {n.label()} is not in the stage of its first consumer")


def load(path: str) -> Plan:
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"plan file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"plan file {path} is not JSON: {e}") from None
    return from_json(obj)
