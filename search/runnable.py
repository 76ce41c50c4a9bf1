"""The plan ``optimize`` returns is one the executor runs: its pre-launch checks, the part that needs no torch.

``unity-pcg run`` refuses a plan before any process starts when the plan file does not validate
(``unity_pcg.plan.from_json``), when its views name no device (``executor.launch.plan_world``) or when its
pipeline field is one the executor cannot run (``executor.pipeline.check_pipeline``: stages data parallel
inside or lowered, the batch split into the micro-batches by :func:`search.pipeline.micro_graph`, only
floating tensors crossing stages, BatchNorm only with ``--per-device-bn``;
memory techniques: any with one stage (gradient accumulation), recompute and ZeRO-1/2 with several).
:func:`executor_refusal` runs exactly those checks, as ``run`` does with its default flags, and says why
(None: it would run).  :func:`runnable` is what ``optimize`` calls on the plan it is about to return: a
refused plan is replaced by the fastest alternative that passes -- the plan itself without its pipeline
field when that field is one stage of one micro-batch (the same PCG and views, run by the Trainer), the
search's other candidates and the fixed baselines in order of predicted time, then one device (strategy
``none``) -- and ``info.search.executor_check`` records what happened (``"ok"``, or the refusal and what was
returned).  ``optimize`` applies it to the joint search and to ``--strategy alpa``; the other fixed strategies
are returned as asked, the refusal recorded.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping

from unity_pcg.errors import UnityError


def executor_refusal(plan, per_device_bn: bool = False) -> str | None:
    """Why ``unity-pcg run`` (default flags: no ``--per-device-bn``) would refuse ``plan`` before starting a
    process, as its one line; None when it would start.  Imports no torch.  A plan whose PCG object and
    other fields equal one checked lately gets that answer again (a PCG is immutable)."""
    obj = _as_loaded(plan)
    rest = json.dumps({k: v for k, v in obj.items() if k != "pcg"}, sort_keys=True)
    key = (id(plan.pcg), rest, per_device_bn)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0] is plan.pcg:      # the same (immutable) PCG with the same other fields
        return hit[1]
    why = _refusal(obj, per_device_bn)
    _CHECKED[key] = (plan.pcg, why)
    while len(_CHECKED) > _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    return why


#: the last checks (key: the PCG object's id and the plan's other fields as JSON text; value: (that PCG,
#: the answer)): the pipeline search checks the plan it may return, and ``runnable`` checks it again
_CHECKED: dict = {}
_CHECKED_MAX = 8


def _refusal(obj: dict, per_device_bn: bool) -> str | None:
    from unity_pcg import plan as P
    from unity_pcg.executor.launch import plan_world
    try:
        loaded = P.from_json(obj)      # what `run` loads from the file
        plan_world(loaded)
        if loaded.pipeline is not None:
            from unity_pcg.executor.pipeline import check_pipeline
            check_pipeline(loaded, per_device_bn=per_device_bn)
    except UnityError as e:
        return str(e)
    return None


def _as_loaded(plan) -> dict:
    """The plan's JSON object as ``run`` reads it back from the file, without the fields loading does not
    check: ``info`` (search statistics, the bulk of a big plan's file; loading only keeps it) and
    ``predicted`` (loading checks only that it is an object; :meth:`Plan.to_json` always writes one).
    The rest goes through the JSON text, so tuples, integer keys and non-finite numbers arrive as the
    file has them."""
    obj = plan.to_json()
    obj["info"], obj["predicted"] = {}, {}
    return json.loads(json.dumps(obj))


def _plan_of(plan, pg, mapping, steps, label: str, stats: dict):
    """``plan`` with its PCG, views, prediction and rule sequence replaced (no pipeline)."""
    rules_json = tuple(s.to_json() for s in steps) if steps else None
    pred = dict(mapping.to_json(), **{k: plan.predicted[k] for k in ("strategy", "optimizer", "precision", "search_s")
                                      if k in plan.predicted})
    info = {k: v for k, v in plan.info.items() if k != "outputs_trimmed"}
    info["search"] = stats
    if rules_json is not None:
        info["outputs_trimmed"] = True
    return dataclasses.replace(plan, pcg=pg, views=dict(mapping.views), predicted=pred, pipeline=None,
                               info=info, rules=rules_json, memory=getattr(mapping, "memory_plan", None))


def runnable(plan, final, steps: list, stats: dict, ev=None, g=None, candidates: Iterable = (),
             labels: dict | None = None, dp: tuple | None = None, others: dict | None = None
             ) -> tuple[Any, Any, list, dict]:
    """``(plan, final, steps, stats)`` to return: the given ones when the executor runs the plan, else the
    fastest alternative it runs.  ``candidates``: the search's ``(cost, kind, pcg, steps[, mapping])`` tuples
    (priced, untrimmed; ``labels`` by id of the pcg; a mapping given is the candidate's placement); ``dp``: the data-parallel baseline ``(pcg, MappingResult)``;
    ``others``: the other fixed strategies priced, ``{name: (pcg, cost, note, MappingResult)}``;
    ``ev``: the optimizer's Evaluator (maps a candidate on the whole machine); ``g``: the logical model
    (the one-device plan, the last resort).  Without ``ev`` the refusal is only recorded."""
    why = executor_refusal(plan)
    if why is None:
        stats["executor_check"] = "ok"
        return plan, final, steps, stats
    record: dict = {"refused": why, "chosen_before": stats.get("chosen"), "tried": []}
    stats["executor_check"] = record
    if ev is None:
        return plan, final, steps, stats
    pf = plan.pipeline
    if isinstance(pf, Mapping) and len(pf.get("stages") or ()) == 1 and pf.get("micro_batches") == 1:
        label = f"{stats.get('chosen')} without its pipeline field (one stage, one micro-batch)"
        new_stats = dict(stats, chosen=label)
        alt = dataclasses.replace(plan, pipeline=None, info=dict(plan.info, search=new_stats))
        w = executor_refusal(alt)
        if w is None:
            record["returned"] = label
            return alt, final, steps, new_stats
        record["tried"].append(f"{label}: {w}")
    from .substitution import trimmed
    labels = labels or {}
    alts: list = []
    for c in candidates:
        if math.isfinite(c[0]):
            alts.append((c[0], labels.get(id(c[2]), "data parallel by rules" if c[1] == 0 else "search"),
                         c[2], list(c[3]), c[4] if len(c) > 4 else None))
    baselines = [("dp", dp[0], dp[1])] if dp is not None and dp[1] is not None else []
    baselines += [(name, opg, ores) for name, (opg, _, _, ores) in (others or {}).items()]
    for name, pg, res in baselines:
        if res is not None and res.feasible and math.isfinite(res.cost):
            alts.append((res.cost, f"{name} baseline", pg, [], res))
    alts.sort(key=lambda a: a[0])
    if g is not None:
        alts.append((math.inf, "none (one device)", g, [], None))
    from unity_pcg.machine import Resource

    from .budget import Expired
    for cost, label, pg, st, mapping in alts:
        try:
            if mapping is None:
                res = Resource(0, 1, 1) if label.startswith("none") else None
                if res is None:
                    pg = trimmed(pg)
                try:
                    mapping = ev.full(pg, res)
                except Expired:                  # past the budget: the mapping without the DP (linear)
                    mapping = ev.cheap(pg, res)
            if mapping is None or not mapping.feasible:
                record["tried"].append(f"{label}: infeasible")
                continue
            new_stats = dict(stats, chosen=f"{label} (the executor refuses {stats.get('chosen')})")
            alt = _plan_of(plan, pg, mapping, st, label, new_stats)
        except UnityError as e:
            record["tried"].append(f"{label}: {e}")
            continue
        w = executor_refusal(alt)
        if w is None:
            record["returned"] = label
            return alt, mapping, st, new_stats
        record["tried"].append(f"{label}: {w}")
    record["returned"] = "the refused plan (no alternative runs)"
    return plan, final, steps, stats


__all__ = ["executor_refusal", "runnable"]
