"""The plan file (DESIGN "Plan file"): versioned JSON, validated on load, data only.

A plan holds the model's identity (path and sha256), the machine, the parallelized PCG, the machine
view of every operator, the pipeline schedule if any, and the predicted iteration time, memory per
device and communication volume, and (optional, ``rules``) the rule sequence that produced the PCG
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
from .machine import MachineSpec, MachineView
from .pcg import PCG

SCHEMA = "unity-pcg/plan/v1"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
                **({"rules": [dict(x) for x in self.rules]} if self.rules is not None else {})}

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
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
    if not isinstance(obj, Mapping) or key not in obj:
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
    if pipeline is not None and not isinstance(pipeline, Mapping):
        raise PlanError("plan: field pipeline must be an object or null")
    rules = obj.get("rules")
    if rules is not None:
        rules = tuple(_check_step(k, st) for k, st in enumerate(_list(rules, "rules")))
    return Plan(path, sha, machine, pcg, views, predicted, pipeline, obj.get("info") or {}, rules)


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise PlanError(f"plan: field {where} must be a list")
    return v


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_step(k: int, st: Any) -> dict:
    """One recorded rule step, checked for shape: rule name, matched node ids, input tensors, bindings."""
    where = f"rules[{k}]"
    if not isinstance(st, Mapping):
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
    if not isinstance(bind, Mapping):
        raise PlanError(f"plan: field {where}.bind must be an object")
    return {"rule": name, "nodes": list(nodes), "inputs": {str(a): list(b) for a, b in ins.items()},
            "bind": dict(bind)}


def load(path: str) -> Plan:
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"plan file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"plan file {path} is not JSON: {e}") from None
    return from_json(obj)
