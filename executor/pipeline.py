"""Pipeline execution: a plan's ``pipeline`` field run with ``torch.distributed.pipelining``.

The plan field (written by search/pipeline.py)::

    "pipeline": {"schedule": "1F1B", "micro_batches": M,
                 "stages": [{"nodes": [node ids], "devices": [device ids]}, ...]}

**One runtime** (:class:`PipelineTrainer`), whatever the stages hold inside: data parallelism (the special
case), tensor/Megatron parallelism, hybrids.  Each stage is a :class:`StageGraph` -- its own sub-plan at
the micro-batch (the plan's PCG rebatched to B/M, the stage's nodes with their views, an Input per tensor
received followed by the Partition / Replicate chain that gives it the plan's layout, a Reduce / Combine /
Replicate chain leaving each tensor it sends whole on every one of its devices) -- run by
:class:`executor.train.Trainer`'s lowering on the stage's devices (DTensor redistributions and
torch.distributed collectives on process groups of those devices; every rank creates every stage's groups
in one agreed order), wrapped in a ``PipelineStage`` and driven by ``Schedule1F1B`` with ``M`` micro-batches
(``ScheduleGPipe`` when M < S: 1F1B without a steady state).  Stage ``i`` sends every tensor produced at or
before it (model inputs included) that a later stage reads, and the model's first output (the loss) when an
earlier stage computes it.  A Weight belongs to the stage of its first consumer.

*Equal stages* (K devices each): K pipelines run, pipeline j made of device j of every stage, each carrying
whole micro-batches: a received tensor is read as local slices (no communication), a sent one is assembled
in the stage (the all-gather or all-reduce the layout needs; its backward sums the gradient shares the next
stage's devices send back).  *Stages of different sizes*: one pipeline through the stages' first devices
(leaders); a leader broadcasts to its stage what it receives (the broadcast's backward sums the devices'
gradient shares onto it) and tells the other devices which micro-batch to run forward or backward next.  A
device of a stage's field that no operator uses holds copies of what the stage sends and nothing else.

Training semantics: the loss of a micro-batch is the Trainer's per-piece loss on the last stage's devices
(the run's ``--loss``: mean of the model's first output, or MSE / binary / class cross-entropy against the
targets' part; pieces where they lie, whole class rows for cross-entropy); gradients are accumulated over
the micro-batches, replicated weight regions all-reduced over the devices that read them (the Trainer's
buckets; shards are not), then divided by M: the gradient of the whole batch's mean loss.  Dropout draws its
mask from the element's index in the whole batch (the micro-batch number gives the offset), so pipelined
dropout equals one device's.  BatchNorm computes each micro-batch's statistics (per device), which is not
one device's training: refused unless ``--per-device-bn``; running statistics are updated once per
micro-batch, the stage's first device's are the model's.

Limits (refused by :func:`check_pipeline` with a one-line error before any process starts): BatchNorm in
stages that are not data parallel inside, a trained weight read in two stages (a constant is loaded by
each stage that reads it), partial sums crossing into a stage, a
schedule other than 1F1B, a batch that M (or a stage's layout of the micro-batch) does not divide,
non-floating tensors crossing stages, random generators; with several stages, ZeRO-3 and offload.

**Memory techniques** (the plan's ``memory``).  One stage with memory techniques (or bf16) is gradient
accumulation, run by :class:`executor.accumulate.AccumulationTrainer` (``PipelineTrainer(plan)`` returns one).
Several stages: each stage's Trainer is given the plan's ZeRO stage (1-2, over the stage's data-parallel
copies: the update after the micro-batches' gradients are summed and divided by M) and the recompute regions
cut to its nodes (checkpointed per micro-batch; the tensors a stage sends are kept; a region recomputed in
micro-batch k's backward draws k's Dropout masks).

**bf16** (mixed precision) with several stages: each stage runs its forward under autocast (executor/precision.py)
and casts every floating tensor it sends to the PCG's dtype, the dtype of the receiving stage's buffers (and of
the gradients sent back: the cast's backward returns them to the dtype the stage computed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from unity_pcg import ops
from unity_pcg.errors import InvalidParallelization, PlanError, UnityError
from unity_pcg.pcg import PCG

SCHEDULES = ("1F1B",)


class PipelineError(PlanError):
    """A pipeline field the executor cannot run."""


@dataclass(frozen=True)
class StagePlan:
    """One stage, resolved: its devices (the field's, in order: the first is its leader), its nodes in
    topological order (sources included), the tensors it receives from the previous stage and sends to the
    next one (in order)."""
    index: int
    devices: tuple[int, ...]
    nodes: tuple[int, ...]
    recv: tuple[tuple[int, int], ...]
    send: tuple[tuple[int, int], ...]

    @property
    def device(self) -> int:
        return self.devices[0]


def _stage_of_nodes(plan) -> list[list[int]]:
    pf = plan.pipeline
    if not isinstance(pf, Mapping):
        raise PipelineError("plan: field pipeline must be an object")
    sched = pf.get("schedule", "1F1B")
    if sched not in SCHEDULES:
        raise PipelineError(f"plan: pipeline schedule {sched!r} is not supported (the executor runs "
                            f"{', '.join(SCHEDULES)})")
    stages = pf.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PipelineError("plan: field pipeline.stages must be a non-empty list")
    out = []
    for i, st in enumerate(stages):
        if not isinstance(st, Mapping) or not isinstance(st.get("nodes"), list) \
                or not isinstance(st.get("devices"), list):
            raise PipelineError(f"plan: pipeline.stages[{i}] must have lists 'nodes' and 'devices'")
        if not all(isinstance(x, int) for x in st["nodes"] + st["devices"]):
            raise PipelineError(f"plan: pipeline.stages[{i}] nodes and devices must be integers")
        out.append(list(st["nodes"]))
    return out


def resolve(plan) -> tuple[int, list[StagePlan]]:
    """Validate the pipeline field against the plan's PCG and views; returns (micro-batches, stages).
    Raises PipelineError (one line).  Imports no torch."""
    g: PCG = plan.pcg
    pf = plan.pipeline
    node_lists = _stage_of_nodes(plan)
    M = pf.get("micro_batches")
    if not isinstance(M, int) or isinstance(M, bool) or M < 1:
        raise PipelineError(f"plan: pipeline.micro_batches must be a positive integer, got {M!r}")
    devices: list[tuple[int, ...]] = []
    for i, st in enumerate(pf["stages"]):
        devs = tuple(st["devices"])
        if not devs or len(set(devs)) != len(devs):
            raise PipelineError(f"plan: pipeline stage {i} has devices {list(devs)}")
        devices.append(devs)
    flat = [d for devs in devices for d in devs]
    if len(set(flat)) != len(flat):
        raise PipelineError(f"plan: pipeline stages share devices {[list(x) for x in devices]}")
    order_of: dict[int, tuple] = {}   # stage -> device of task r of its operators (data parallel inside)
    degree_of: dict[int, int] = {}    # stage -> the data-parallel degree of its operators
    stage_of: dict[int, int] = {}
    dp_error = None                   # why the stages are not all data parallel inside (None: they are)
    for i, nodes in enumerate(node_lists):
        for nid in nodes:
            if nid not in g:
                raise PipelineError(f"plan: pipeline stage {i} lists node {nid}, which is not in the PCG")
            if nid in stage_of and stage_of[nid] != i:
                raise PipelineError(f"plan: node {g.node(nid).label()} is in pipeline stages {stage_of[nid]} and {i}")
            stage_of[nid] = i
    order = g.topo_order()
    for nid in order:
        n = g.node(nid)
        if n.kind == "source":
            continue
        if nid not in stage_of:
            raise PipelineError(f"plan: node {n.label()} ({n.op}) is in no pipeline stage")
        for r in n.inputs:
            src = g.node(r[0])
            if src.kind != "source" and stage_of[r[0]] > stage_of[nid]:
                raise PipelineError(f"plan: node {n.label()} in pipeline stage {stage_of[nid]} reads "
                                    f"{src.label()} of the later stage {stage_of[r[0]]}")
        i = stage_of[nid]
        v = plan.views.get(nid)
        if v is not None and not set(v.devices()) <= set(devices[i]):
            raise PipelineError(f"plan: view {v} of node {n.label()} lies outside its pipeline stage's "
                                f"devices {list(devices[i])}")
        if n.kind == "compute" and dp_error is None:
            try:
                _dp_node(g, plan, n, i, devices, degree_of, order_of)
            except PipelineError as e:     # not data parallel inside (tensor/Megatron parallelism)
                dp_error = str(e)
    # sources join the stage of their first consumer (in topological order)
    for nid in order:
        n = g.node(nid)
        if n.kind == "source" and nid not in stage_of:
            users = [u for u, _ in g.consumers((nid, 0))]
            if users:
                stage_of[nid] = min(stage_of[u] for u in users)
    if dp_error is not None:
        _check_not_data_parallel(g, dp_error)
    # micro-batches: every model input's dim 0 must split M ways (each stage's own layout of the micro-batch
    # is checked when its stage graph is built: stage_graphs)
    for n in g.sources("Input"):
        b = n.a["shape"][0] if n.a["shape"] else None
        if b is None or b % M:
            raise PipelineError(f"plan: pipeline.micro_batches {M} does not divide the batch (dim 0 = {b}) "
                                f"of input {n.label()}")
    return _stage_plans(g, node_lists, stage_of, order, devices, M)


def _dp_node(g: PCG, plan, n, i: int, devices, degree_of: dict, order_of: dict) -> None:
    """Compute node ``n`` of stage ``i`` is data parallel on the same devices, in the same order, as the
    stage's other operators (records its degree and device order); raises PipelineError if not."""
    nid = n.id
    v = plan.views.get(nid)
    pm = ops.infer(n.op, n.a, g.input_shapes(nid)).piece_map
    deg = pm.degree if pm is not None else 1
    K = degree_of.setdefault(i, deg)
    if deg != K or deg > len(devices[i]):
        what = "a single-device" if len(devices[i]) == 1 else f"a {len(devices[i])}-device"
        raise PipelineError(f"plan: node {n.label()} ({n.op}) runs {deg} task(s) inside {what} pipeline "
                            f"stage whose operators run {K}")
    devs = tuple(v.devices()) if v is not None else (devices[i][:1] if K == 1 else None)
    if K > 1:
        _check_batch_split(g, n, K)
    if devs is None or len(devs) != K or len(set(devs)) != K or not set(devs) <= set(devices[i]):
        raise PipelineError(f"plan: node {n.label()} of pipeline stage {i} has no view on {K} of the "
                            f"stage's devices {list(devices[i])}")
    if order_of.setdefault(i, devs) != devs:
        raise PipelineError(f"plan: operators of pipeline stage {i} place their batch blocks on the "
                            f"devices in different orders ({list(order_of[i])}, {list(devs)})")


def _check_not_data_parallel(g: PCG, why: str) -> None:
    """What stages that are not all data parallel inside (tensor/Megatron parallelism) need: no BatchNorm
    (its statistics over a micro-batch whose pieces lie on the stage's devices are not run)."""
    bn = next((n for n in g.nodes() if n.op == "BatchNorm"), None)
    if bn is not None:
        raise PipelineError(f"plan: BatchNorm ({bn.label()}) in pipeline stages with tensor/Megatron "
                            f"parallelism inside is not supported by the executor")


def _stage_plans(g: PCG, node_lists, stage_of, order, devices, M: int):
    S = len(node_lists)
    first_out = tuple(g.outputs[0])
    # what each stage needs from earlier stages: tensors produced in stages < i (model inputs count as
    # produced "before" stage 0) and read in stage i or later
    def produced_at(ref) -> int:
        src = g.node(ref[0])
        if src.op == "Input":
            return -1
        return stage_of.get(ref[0], 0)

    stages = []
    order_pos = {nid: k for k, nid in enumerate(order)}

    def key(r):
        return (order_pos[r[0]], r[1])

    carried_in: tuple = tuple(sorted((tuple((n.id, 0)) for n in g.sources("Input")), key=key))
    for i in range(S):
        reads_later = set()
        for nid in order:
            if stage_of.get(nid, -2) > i:
                for r in g.node(nid).inputs:
                    r = tuple(r)
                    if g.node(r[0]).op != "Weight" and produced_at(r) <= i:
                        reads_later.add(r)
        # the loss is the model's first output on the last stage: computed earlier (BERT's pooler alone in
        # the last stage), it is passed on like an activation a later stage reads
        if i < S - 1 and g.node(first_out[0]).op != "Input" and produced_at(first_out) <= i:
            reads_later.add(first_out)
        if i == S - 1:
            send = (first_out,)
        else:
            send = tuple(sorted(reads_later, key=key))
            if not send:
                raise PipelineError(f"plan: pipeline stage {i} sends nothing to stage {i + 1}")
        nodes = tuple(nid for nid in order if stage_of.get(nid) == i)
        stages.append(StagePlan(i, devices[i], nodes, carried_in, send))
        carried_in = send
    if stage_of.get(first_out[0], -1) not in range(S) and g.node(first_out[0]).op != "Input":
        raise PipelineError("plan: the model's first output is produced by no pipeline stage")
    from unity_pcg.search.stages import may_cross     # the rule the pipeline search cuts by
    for st in stages[:-1]:
        for r in st.send:
            dt = g.shape(r).dtype
            if not may_cross(dt):
                raise PipelineError(f"plan: tensor {g.node(r[0]).label()} ({dt}) crosses from pipeline stage "
                                    f"{st.index} to {st.index + 1}; only floating tensors may cross stages")
    return M, stages


def _check_batch_split(g: PCG, n, K: int) -> None:
    """Inside a stage of K devices every operator must be data parallel: each tensor it reads or writes is
    split K ways on dim 0 (the batch) and nowhere else, or (a weight) whole and copied K ways."""
    from unity_pcg.search.pipeline import batch_split_error     # the search's rule too (executor_replicas)
    why = batch_split_error(g, n.id, K)
    if why is not None:
        raise PipelineError(f"plan: node {n.label()} ({n.op}) in a {K}-device pipeline stage is not data "
                            f"parallel ({why})")


def check_pipeline(plan, per_device_bn: bool = True) -> None:
    """Everything about a pipelined plan that can fail before a process starts."""
    accumulate = accumulation(plan)
    mem = getattr(plan, "memory", None)
    if mem is not None and not mem.empty and not one_stage(plan):
        if mem.zero == 3 or mem.offload:
            raise PipelineError("plan: ZeRO-3 and offload with several pipeline stages are not run by the executor "
                                "yet (recompute and ZeRO-1/2 are); optimize it without pipeline stages or without them")
    gen = next((n for n in plan.pcg.nodes() if n.op in ("RandomNormal", "RandomUniform")), None)
    if gen is not None:
        raise PipelineError(f"plan: {gen.label()} in a pipelined plan is not supported by the executor (a "
                            f"generator draws its whole tensor, not a micro-batch's rows); optimize without "
                            f"pipeline stages")
    M, stages = resolve(plan)
    devs = sorted(d for st in stages for d in st.devices)
    if devs != list(range(len(devs))):
        raise PipelineError(f"plan: pipeline stages run on devices {[list(st.devices) for st in stages]}; "
                            f"the executor needs the ranks 0..{len(devs) - 1}, each in one stage")
    # the batch, and only it, must split into the micro-batches: the test the pipeline search applies too
    # (search/pipeline.py::micro_graph); each stage's graph at the micro-batch must then build
    micro_graph(plan.pcg, M)
    if accumulate:                  # one stage run by executor.accumulate: the plan at the micro-batch
        micro_plan(plan)
    else:
        stage_graphs(plan, M, stages)
    if not per_device_bn and any(n.op == "BatchNorm" for n in plan.pcg.nodes()):
        raise PipelineError("plan: BatchNorm in a pipelined plan computes statistics per micro-batch, which "
                            "is not one device's training; run with --per-device-bn to accept that")


def one_stage(plan) -> bool:
    """Whether ``plan``'s pipeline field has exactly one stage (gradient accumulation)."""
    pf = getattr(plan, "pipeline", None)
    return isinstance(pf, Mapping) and isinstance(pf.get("stages"), list) and len(pf["stages"]) == 1


def micro_plan(plan):
    """``(M, B, the plan at the micro-batch B/M without its pipeline field)``: the same node ids, views and
    ``memory`` (``search.pipeline.rebatch``); PipelineError (one line) when the micro-batch cannot run
    through the model.  Imports no torch."""
    import dataclasses

    from unity_pcg.search.pipeline import PipelineError as SearchPipelineError
    from unity_pcg.search.pipeline import batch_size, rebatch
    M = plan.pipeline["micro_batches"]
    try:
        B = batch_size(plan.pcg)
        gm = rebatch(plan.pcg, B, B // M)
    except (SearchPipelineError, UnityError) as e:
        raise PipelineError(f"plan: the accumulation's micro-batches cannot run through the model: {e}") from None
    return M, B, dataclasses.replace(plan, pcg=gm, pipeline=None)


def accumulation(plan) -> bool:
    """Whether the executor runs ``plan`` as gradient accumulation (:mod:`executor.accumulate`): one pipeline
    stage with memory techniques or bf16, which the pipeline runtime does not run."""
    mem = getattr(plan, "memory", None)
    return one_stage(plan) and ((mem is not None and not mem.empty) or getattr(plan, "precision", "fp32") == "bf16")


def _stage_memory(plan, sg: PCG):
    """The plan's memory techniques for one stage: ZeRO as planned, each recompute region cut to the
    stage's compute nodes (None: none)."""
    mem = getattr(plan, "memory", None)
    if mem is None or mem.empty:
        return None
    import dataclasses
    regions = []
    for r in mem.recompute:
        nodes = tuple(nid for nid in r.nodes if nid in sg and sg.node(nid).kind == "compute")
        if nodes:
            regions.append(dataclasses.replace(r, nodes=nodes))
    return dataclasses.replace(mem, recompute=tuple(regions))


def micro_graph(g: PCG, M: int) -> PCG:
    """The logical graph on micro-batch pieces: inputs partitioned M ways on dim 0, weights copied M ways.
    Compute nodes keep their ids; their input shapes give the kernels' piece attributes.  The one test of
    micro-batching that the pipeline search uses too (``search/pipeline.py::micro_graph``)."""
    from unity_pcg.search.pipeline import PipelineError as SearchPipelineError
    from unity_pcg.search.pipeline import micro_graph as shared
    try:
        return shared(g, M)
    except (SearchPipelineError, InvalidParallelization, UnityError) as e:
        raise PipelineError(f"plan: {e}") from None


# --- stage graphs: each stage's sub-plan at the micro-batch, lowered on its devices --------------------

class _DeviceList:
    """A machine view given by its devices (tasks in row-major order), for devices that no (start,
    stride) view lists in that order."""

    def __init__(self, devs):
        self._devs = tuple(devs)
        self.degree = len(self._devs)
        self.dims = ((self.degree, 1),)

    def devices(self) -> tuple[int, ...]:
        return self._devs

    def __str__(self) -> str:
        return "@" + ",".join(map(str, self._devs))


def _view_on(devs) -> Any:
    """A view whose task t runs on ``devs[t]``."""
    from unity_pcg.machine import MachineView
    devs = tuple(devs)
    if len(devs) == 1:
        return MachineView(devs[0], ((1, 1),))
    step = devs[1] - devs[0]
    if step > 0 and all(b - a == step for a, b in zip(devs, devs[1:])):
        return MachineView(devs[0], ((len(devs), step),))
    return _DeviceList(devs)


@dataclass
class StageGraph:
    """One stage as a plan of its own at the micro-batch size, run by a :class:`executor.train.Trainer` on
    the stage's devices: ``pcg`` holds the stage's nodes (the plan's ids), the Weights they read, and an
    Input per tensor received from an earlier stage (``pipe:<node>:<output>``, the logical micro-batch
    tensor, every device of the stage holding all of it) followed by the Partition / Replicate chain that
    gives it the parallel shape the plan gives it (a local slice, no communication).  ``feeds``: received
    position -> Input name; ``sends``: per sent tensor, ``("recv", j)`` (passed on), ``("feed", name)`` (an
    Input's value) or ``("out", ref)`` (a tensor of ``pcg`` whose chain of Reduce / Combine / Replicate
    leaves a whole copy on every device of the stage, in ``devices`` order); ``loss``: the last stage's
    output ref.  ``dropout``: Dropout node -> (logical sizes at the whole batch, the micro-batch's dim 0 when
    dim 0 follows the batch, else 0)."""
    pcg: PCG
    views: dict
    devices: tuple
    feeds: dict
    sends: tuple
    loss: tuple | None
    dropout: dict
    grad_inputs: frozenset
    recv_shapes: tuple = ()          # (sizes, dtype) of each received tensor at the micro-batch
    send_shapes: tuple = ()


def stage_graphs(plan, M: int, stages) -> list[StageGraph]:
    """The :class:`StageGraph` of every stage of a pipeline (PipelineError, one line, when a stage
    cannot run that way)."""
    from unity_pcg.search.pipeline import PipelineError as SearchPipelineError
    from unity_pcg.search.pipeline import batch_size, rebatch
    g: PCG = plan.pcg
    B = batch_size(g)
    try:
        gm = rebatch(g, B, B // M)
    except (SearchPipelineError, UnityError) as e:
        raise PipelineError(f"plan: the pipeline's micro-batches cannot run through the model: {e}") from None
    role = gm.roles()
    owner: dict[str, int] = {}
    out = []
    for st in stages:
        try:
            out.append(_stage_graph(plan, g, gm, role, st, len(stages), owner))
        except PipelineError:
            raise
        except UnityError as e:     # a chain that the parallel shapes do not allow
            raise PipelineError(f"plan: pipeline stage {st.index} cannot run on its devices: {e}") from None
    return out


def _stage_graph(plan, g: PCG, gm: PCG, role: Mapping[int, str], st: StagePlan, S: int, owner: dict) -> StageGraph:
    inside = {nid for nid in st.nodes if gm.node(nid).kind != "source"}
    devs = tuple(st.devices)
    K = len(devs)
    b = PCG.builder(gm.weights)
    nxt = [max(gm.node_ids(), default=-1) + 1]
    m: dict = {}
    views: dict = {}
    recv_pos = {tuple(r): j for j, r in enumerate(st.recv)}
    feeds: dict = {}
    grad_inputs = set()

    def fresh(op, attrs, ins, name=""):
        nid = b.add_node(op, attrs, ins, name, nid=nxt[0])
        nxt[0] = nid + 1
        return (nid, 0)

    def ensure(r):
        r = tuple(r)
        if r in m:
            return m[r]
        nid = r[0]
        n = gm.node(nid)
        rl = role[nid]
        if rl == "input" or rl == "weight" or (nid in inside and rl != "weight-placement") or \
                (rl == "weight-placement" and r not in recv_pos):
            if rl == "input" and r not in recv_pos:
                raise PipelineError(f"plan: pipeline stage {st.index} reads model input {n.label()}, which it "
                                    f"does not receive")
            if rl == "weight" and gm.is_trainable(nid):     # a constant (untrained) is loaded by every reader
                name = n.a["name"]
                if owner.setdefault(name, st.index) != st.index:
                    raise PipelineError(f"plan: weight {name!r} is read in pipeline stages {owner[name]} and "
                                        f"{st.index}; the executor trains a weight in one stage")
            ins = [ensure(x) for x in n.inputs]
            b.add_node(n.op, n.a, ins, n.name, nid=nid)
            for k in range(len(gm.shapes(nid))):
                m[(nid, k)] = (nid, k)
            if rl == "input":
                feeds[recv_pos[r]] = n.a["name"]
            elif n.kind != "source":
                v = plan.views.get(nid)
                if v is None and rl in ("compute", "parallel"):
                    raise PipelineError(f"plan: node {n.label()} ({n.op}) of pipeline stage {st.index} has no "
                                        f"machine view")
                if v is not None:
                    views[nid] = v
            return m[r]
        if r not in recv_pos or rl.startswith("weight"):
            raise PipelineError(f"plan: pipeline stage {st.index} reads {n.label()}:{r[1]} ({rl}) of another "
                                f"stage, which it does not receive")
        sh = gm.shape(r)
        if sh.sum_degree > 1:
            raise PipelineError(f"plan: tensor {n.label()}:{r[1]} crosses into pipeline stage {st.index} as "
                                f"partial sums")
        name = f"pipe:{nid}:{r[1]}"
        x = fresh("Input", {"name": name, "shape": sh.sizes, "dtype": sh.dtype}, [], name=name)
        feeds[recv_pos[r]] = name
        grad_inputs.add(name)
        for dim, deg in enumerate(sh.degrees):
            if deg > 1:
                x = fresh("Partition", {"dim": dim, "degree": deg}, [x])
        if sh.copy_degree > 1:
            x = fresh("Replicate", {"degree": sh.copy_degree}, [x])
        m[r] = x
        return x

    def origin(ref):
        """The Input a tensor of the stage graph is a placement of (None: an activation)."""
        while True:
            n = b.node(ref[0])
            if n.op == "Input":
                return n.a["name"]
            if n.kind != "parallel":
                return None
            ref = n.inputs[0]

    def assemble(x):
        """Reduce / Combine / Replicate ``x`` into one whole copy per device of the stage."""
        if b.shape(x).sum_degree > 1:
            x = fresh("Reduce", {"degree": b.shape(x).sum_degree}, [x])
        for dim, deg in enumerate(b.shape(x).degrees):
            if deg > 1:
                x = fresh("Combine", {"dim": dim, "degree": deg}, [x])
        c = b.shape(x).copy_degree
        if c != K:
            if K % c:
                raise PipelineError(f"plan: pipeline stage {st.index} holds a tensor it sends in {c} copies, which "
                                    f"do not spread over its {K} devices")
            x = fresh("Replicate", {"degree": K // c}, [x])
        return x

    for nid in gm.topo_order():
        if nid in inside:
            for k in range(len(gm.shapes(nid))):
                ensure((nid, k))
    sends = []
    loss = None
    outs = []
    for j, r in enumerate(st.send):
        r = tuple(r)
        if st.index == S - 1:
            if gm.node(r[0]).kind == "source":
                raise PipelineError("plan: the model's first output is a source")
        if st.index < S - 1 and r in recv_pos:
            sends.append(("recv", recv_pos[r]))
        else:
            x = ensure(r)
            name = origin(x)
            if name is not None and st.index < S - 1:
                sends.append(("feed", name))
                continue
            # the model's output, too, ends in the chain: the loss reads the pieces where it can (the
            # mean, MSE) and the whole class rows for cross-entropy (Trainer._loss_ref walks back)
            first = nxt[0]
            if name is not None:     # the loss computed in an earlier stage and received: the Trainer's
                if b.shape(x).piece_count > K:     # loss reads a computed tensor; in more pieces than the
                    x = assemble(x)                # stage has devices (a larger stage made it): whole first
                x = fresh("Identity", {}, [x])
            y = assemble(x)
            # the chain's views: its intermediate pieces on the stage's first devices, the copies on all
            for nid in range(first, nxt[0]):
                grid = b.shape((nid, 0)).piece_count
                views[nid] = _view_on(devs[:grid])
            outs.append(y)
            sends.append(("out", y))
            if st.index == S - 1:
                loss = y
    if not outs:
        raise PipelineError(f"plan: pipeline stage {st.index} computes nothing it sends")
    b.set_outputs(outs)
    try:
        sg = b.finish()
    except UnityError as e:
        raise PipelineError(f"plan: pipeline stage {st.index} cannot run on its own: {e}") from None
    dropout = {}
    for nid in inside:
        if gm.node(nid).op == "Dropout":
            full, micro = g.shapes(nid)[0].sizes, gm.shapes(nid)[0].sizes
            dropout[nid] = (tuple(full), micro[0] if full and full[0] != micro[0] else 0)

    def shapes(refs):
        return tuple((tuple(gm.shape(r).sizes), gm.shape(r).dtype) for r in refs)
    return StageGraph(sg, views, devs, feeds, tuple(sends), loss, dropout, frozenset(grad_inputs),
                      shapes(st.recv), shapes(st.send))


# --- torch side ----------------------------------------------------------------------------------------

def _torch_modules():
    import torch
    from torch import nn
    return torch, nn


def _step_kind(loss: str | None, targets) -> str:
    """The Trainer's loss kind of a step: the run's loss (output -> mean), or derived from the targets."""
    if loss is not None:
        return "mean" if loss == "output" else loss
    if targets is None:
        return "mean"
    import torch
    t = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(np.asarray(targets))
    return "mse" if t.is_floating_point() else "ce"


def _stage_rows(plan, first: bool, last: bool):
    """(feed_rows, target_rows) of a pipeline stage's device: the first stage reads every input's whole
    batch, the last stage the whole targets; other stages read none."""
    g = plan.pcg
    feeds = {n.a["name"]: (0, (n.a["shape"][0] if n.a["shape"] else 0) if first else 0)
             for n in g.sources("Input")}
    out = g.shape(tuple(g.outputs[0]))
    rows = out.sizes[0] if out.rank else 1
    return feeds, ((0, rows) if last else (0, 0))


_FORWARD, _BACKWARD, _STOP = 1, 2, 3


_ON_BACKWARD: list = []


def _contiguous_grad(x):
    """``x`` unchanged, whose gradient is made contiguous on its way back (the schedule sends it to the
    previous stage, and gloo sends contiguous buffers only: the gradient of a Transpose's input is strided)."""
    torch = _torch_modules()[0]
    if not (isinstance(x, torch.Tensor) and x.requires_grad):
        return x
    if not _CONTIGUOUS_GRAD:
        class ContiguousGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                return g.contiguous()
        _CONTIGUOUS_GRAD.append(ContiguousGrad)
    return _CONTIGUOUS_GRAD[0].apply(x)


_CONTIGUOUS_GRAD: list = []


def _on_backward(x, fn):
    """``x`` (a copy), with ``fn()`` called when the backward pass reaches it."""
    if not _ON_BACKWARD:
        torch = _torch_modules()[0]

        class OnBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, fn):
                ctx.fn = fn
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                ctx.fn()
                return g, None
        _ON_BACKWARD.append(OnBackward)
    return _ON_BACKWARD[0].apply(x, fn)


def _as_dtype(y, dtype: str):
    """``y`` in the PCG dtype ``dtype`` (a floating tensor computed in another one under autocast; others
    as they are)."""
    from .kernels import TORCH_DTYPES
    dt = TORCH_DTYPES[dtype]
    return y.to(dt) if y.is_floating_point() and dt.is_floating_point and y.dtype != dt else y


class PipelineTrainer:
    """The Trainer API (executor.train.Trainer) for plans with pipeline stages; rank == device.  The one
    pipeline runtime: every stage -- data parallel, tensor/Megatron parallel or a hybrid inside -- runs its
    :class:`StageGraph` -- its sub-plan at the micro-batch -- with the lowering of
    :class:`executor.train.Trainer` (DTensor redistributions and torch.distributed collectives on process
    groups of the stage's devices), and ``torch.distributed.pipelining`` drives the stages with 1F1B
    (GPipe's order when M < S).  One stage with memory techniques or bf16 is gradient accumulation
    (``PipelineTrainer(plan)`` returns an :class:`executor.accumulate.AccumulationTrainer`).  Stages of
    different sizes run one pipeline through their first devices, which
    drive the others (see the module docstring).  Stages of K devices each: K pipelines run, pipeline j
    made of device j of every stage, each carrying whole micro-batches: every device of a stage receives every tensor it
    reads from the previous stage whole (its pieces are local slices) and sends every tensor it passes on
    whole (the stage graph's Reduce / Combine / Replicate chain, an all-gather or all-reduce inside the
    stage).  The gradient a device receives for a tensor is that device's share; the chain's backward
    (reduce-scatter, ...) sums the shares of the stage's devices, so the pieces get the whole gradient.
    The loss of a micro-batch is the sum over the last stage's devices of the Trainer's per-piece loss;
    gradients are accumulated over the micro-batches, replicated weight regions all-reduced over the
    devices that read them (sharded ones not: the Trainer's buckets), and divided by M."""

    def __new__(cls, plan, *args, **kw):
        if accumulation(plan):          # one stage with memory techniques / bf16: gradient accumulation
            from .accumulate import AccumulationTrainer
            return AccumulationTrainer(plan, *args, **kw)
        return super().__new__(cls)

    def __init__(self, plan, model_path: str, rank: int = 0, world: int = 1, optimizer: str = "sgd",
                 lr: float = 0.01, seed: int = 0, device: str = "cpu", sync_batchnorm: bool = True,
                 loss: str | None = None):
        torch, nn = _torch_modules()
        import torch.distributed as dist

        from unity_pcg import plan as plan_mod

        from .lower import dropout_key
        from .train import Trainer

        check_pipeline(plan, per_device_bn=not sync_batchnorm)
        self.M, stages = resolve(plan)
        graphs = stage_graphs(plan, self.M, stages)
        mine = [i for i, st in enumerate(stages) if rank in st.devices]
        if len(mine) != 1:
            raise PipelineError(f"rank {rank} runs no pipeline stage")
        self.st, self.sg = stages[mine[0]], graphs[mine[0]]
        self.S = len(stages)
        self.K = K = len(self.st.devices)
        self.rank, self.world = rank, world
        self._dist = dist
        self._stage_devices = [st.devices for st in stages]
        self.j = self.st.devices.index(rank)              # this device's pipeline
        # one process group per pipeline (every rank creates every one, in the same order; the stages'
        # own groups follow, see _make_groups)
        # stages of different sizes: one pipeline through the stages' first devices (leaders), which
        # share what they receive with their stage's other devices and tell them what to run
        self.lead = len({len(s.devices) for s in stages}) > 1
        self.leader = self.st.devices[0]
        pp_groups, pos = {}, {}
        for j in range(1 if self.lead else K):
            members = [s.devices[j] for s in stages]
            some = len(members) < world
            pp_groups[j] = dist.new_group(sorted(members)) if some else None
            pos[j] = {d: k for k, d in enumerate(sorted(members))} if some else {d: d for d in members}

        sub = plan_mod.Plan(plan.model_path, plan.model_sha256, plan.machine, self.sg.pcg, self.sg.views,
                            plan.predicted, None, precision=getattr(plan, "precision", "fp32"),
                            memory=_stage_memory(plan, self.sg.pcg))
        # the stage's Trainer creates no process group itself (torch.distributed.new_group is a collective
        # of every rank, and each rank builds its own stage only): it lists the groups it needs, then every
        # rank creates every stage's groups in one agreed order
        self.tr = tr = Trainer(sub, model_path, rank=rank, world=world, optimizer=optimizer, lr=lr, seed=seed,
                               device=device, sync_batchnorm=sync_batchnorm, overlap=False, grad_views=False,
                               new_group=lambda devs: None, grad_inputs=self.sg.grad_inputs)
        if world > 1:
            self._make_groups(len(stages))
            if tr._zrt is not None:      # ZeRO's groups are the buckets', created by _make_groups
                for grp in tr._zrt.groups:
                    grp.pg = tr._bucket_pgs.get(grp.devs) if grp.k > 1 else None
        self.dev = tr.device
        self.opt = tr.opt
        # Dropout draws its mask at the element's index in the whole batch: micro-batch k's rows start at
        # k times the micro-batch's dim 0
        self._dropout = []
        for step in tr.low.steps:
            if step.op == "Dropout" and step.ctx is not None:
                full, micro0 = self.sg.dropout[step.node]
                step.ctx.node_id = dropout_key(plan.pcg, step.node)
                step.ctx.out_logical = (full,)
                self._dropout.append((step, tuple(step.ctx.out_offset[0]), micro0))
        outs = [ref for kind, ref in self.sg.sends if kind == "out"]
        tr.keep_refs = frozenset(tuple(r) for r in outs)   # recompute regions return what the stage sends
        # a region recomputed in micro-batch k's backward (other micro-batches ran since) draws k's masks
        self._cur_micro = 0
        tr.recompute_context = (lambda: self._cur_micro, self._set_micro)
        self._need_send = self._ancestors(outs)
        self._plan_g = plan.pcg
        self.steps_done = 0
        self.micro = 0
        self._kind = "mean"
        self._targets = False
        self.loss = loss        # executor.loss kind (None: derived from the targets)
        self._rows = _stage_rows(plan, self.st.index == 0, self.st.index == self.S - 1)
        pj = 0 if self.lead else self.j
        self._pp = (pp_groups[pj], {s.index: pos[pj][s.devices[pj]] for s in stages})
        self._scheds: dict = {}
        ins = plan.pcg.sources("Input")
        self.batch = ins[0].a["shape"][0] if ins and ins[0].a["shape"] else self.M
        self.input_names = [plan.pcg.node(r[0]).a["name"] for r in self.st.recv] if self.st.index == 0 else []

        owner = self

        class StageModule(nn.Module):
            def __init__(self):
                super().__init__()
                self.params = nn.ParameterList(list(tr.params.values()))

            def forward(self, *xs):
                return owner._forward(xs)
        self.mod = StageModule()

    def _make_groups(self, S: int) -> None:
        """Every stage's process groups (its Trainer's communication and gradient-bucket groups, and the
        stage's devices for assembling state), created by every rank in stage order."""
        dist = self._dist
        tr = self.tr
        mine = (self.st.index, sorted(tr._pgs), sorted(tr._bucket_pgs))
        lists: list = [None] * self.world
        dist.all_gather_object(lists, mine)
        per_stage = {}
        for x in lists:
            per_stage.setdefault(x[0], x)
        for i in range(S):
            _, pgs, buckets = per_stage[i]
            for devs in pgs:
                grp = dist.new_group(list(devs))
                if i == self.st.index:
                    tr._pgs[tuple(devs)] = grp
            for devs in buckets:
                grp = dist.new_group(list(devs))
                if i == self.st.index:
                    tr._bucket_pgs[tuple(devs)] = grp
        for i in range(S):
            grp = dist.new_group(sorted(self._stage_devices[i]))
            if i == self.st.index:
                tr._world_pg = grp

    def _ancestors(self, refs) -> set:
        g = self.tr.g
        need, stack = set(), [r[0] for r in refs]
        while stack:
            i = stack.pop()
            if i not in need:
                need.add(i)
                stack.extend(r[0] for r in g.node(i).inputs)
        return need

    def _sched(self):
        """The schedule of this device's pipeline (built once per loss kind: the last stage's output is
        the piece the loss reads, which depends on it)."""
        torch = _torch_modules()[0]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from .kernels import TORCH_DTYPES
        if self._kind in self._scheds:
            return self._scheds[self._kind]
        last = self.st.index == self.S - 1

        def meta(shape, dtype, grad):
            dt = TORCH_DTYPES[dtype]
            return torch.empty(shape, dtype=dt, device="meta").requires_grad_(grad and dt.is_floating_point)
        pcg_in = {j: self.sg.recv_shapes[j] for j in range(len(self.st.recv))}
        inputs = tuple(meta(sz, dt, self._is_activation(self.st.recv[j])) for j, (sz, dt) in pcg_in.items())
        if last:
            pick, _, _ = self.tr._loss_ref(self._kind)
            flat = self.tr.low.mine.get(pick)
            s = self.tr.g.shape(pick)
            shape = tuple(s.piece_shape) if flat is not None else (1,)
            outputs = (meta(shape, s.dtype, True),)
        else:
            outputs = tuple(meta(sz, dt, self._is_activation(r))
                            for (sz, dt), r in zip(self.sg.send_shapes, self.st.send))
        group, to_rank = self._pp
        stage = PipelineStage(self.mod, self.st.index, self.S, self.dev, group=group, input_args=inputs,
                              output_args=outputs)
        stage.stage_index_to_group_rank = to_rank
        kind = Schedule1F1B if self.M >= self.S else ScheduleGPipe
        sched = kind(stage, self.M, scale_grads=False, loss_fn=lambda out, t: self._loss(out, t))
        self._scheds[self._kind] = sched
        return sched

    def _is_activation(self, ref) -> bool:
        """A tensor whose gradient crosses back (a model input's, or its placement's, does not)."""
        g = self._plan_g
        return g.node(g.origin(ref[0])).op != "Input"

    def _forward(self, xs):
        """The stage module's forward (every device with equal stages; the leader with different ones)."""
        k = self.micro
        self.micro += 1
        xs = tuple(_contiguous_grad(x) for x in xs)
        shared = xs
        if self.lead and self.K > 1:
            self._command(_FORWARD, k)
            shared = self._share_inputs(xs)
        return self._compute(xs, shared, k)

    def _compute(self, xs, shared, k: int):
        """Micro-batch ``k`` through the stage graph: ``shared`` holds what the stage reads (received
        position -> tensor), ``xs`` what the leader received (passed on)."""
        torch = _torch_modules()[0]
        from .memory import tie as _tie
        tr = self.tr
        fv = tr._feeds({name: shared[j] for j, name in self.sg.feeds.items()})
        self._set_micro(k)
        tr.step_no = self.steps_done
        anchor = torch.zeros((), device=self.dev, requires_grad=True)
        sinks: list = []
        last = self.st.index == self.S - 1
        if last:
            pick, need, split = tr._loss_ref(self._kind)
        else:
            pick, need, split = None, self._need_send, None
        tr._cur_loss_ref = pick
        from .precision import forward_context
        with forward_context(tr.precision, tr.device):   # bf16: the stage's forward under autocast
            vals = tr._run(fv, need, anchor, sinks, split)
        # a zero tied to every communication output (tie's backward hands each a zero gradient whatever
        # its values: a product with 0.0 would be NaN where a sink holds inf, e.g. a float32-min mask)
        if self.lead and self.K > 1:
            # every device's backward reaches the broadcasts of what the stage received (their backward
            # is a reduce onto the leader), also on a device whose operators read none of it
            sinks = sinks + [x for x in shared.values() if x.requires_grad]
        tie = _tie(anchor * 0.0, sinks)
        if self.lead and self.K > 1 and self.rank == self.leader:
            # the backward starts here (created last, run first): the followers start theirs
            tie = _on_backward(tie, lambda: self._command(_BACKWARD, k))
        if last:
            y = vals.get(pick) if tr.low.mine.get(pick) is not None else None
            # a device holding no piece of it returns a 1-element zero tied to its communication (the
            # schedule concatenates the micro-batches' outputs); bf16 autocast's output in the PCG's dtype
            if y is None:
                return tie.reshape(1)
            y = _as_dtype(y, tr.g.shape(pick).dtype)
            return y + tie.to(y.dtype)
        outs = []
        for (kind, v), (_, dt) in zip(self.sg.sends, self.sg.send_shapes):
            if xs is None and kind != "out":    # a follower: the leader passes these on
                outs.append(None)
            elif kind == "recv":
                x = xs[v]
                outs.append(x.view_as(x) if x.requires_grad else x)
            elif kind == "feed":
                outs.append(fv[v].contiguous())
            else:
                # sent in the PCG's dtype, the receiving stage's buffers' (under bf16 autocast a stage
                # computes bf16 tensors; the cast's backward returns the float32 gradient received to
                # bf16); gloo sends contiguous buffers only (elementwise ops keep a transposed layout)
                y = _as_dtype(vals[v], dt)
                outs.append((y + tie.to(y.dtype) if y.is_floating_point() else y).contiguous())
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _set_micro(self, k: int) -> None:
        """Dropout of micro-batch ``k``: its rows start at k times the micro-batch's dim 0."""
        self._cur_micro = k
        for step, base, micro0 in self._dropout:
            step.ctx.out_offset = ((base[0] + k * micro0,) + tuple(base[1:]),) if micro0 else (base,)

    # --- stages of different sizes: the leader drives its stage's other devices ------------------------
    def _command(self, kind: int, k: int = 0) -> tuple[int, int]:
        """What the leader runs next (forward or backward of micro-batch k, or stop), sent to the stage's
        other devices (they call this to receive it)."""
        torch = _torch_modules()[0]
        t = torch.tensor([kind, k], dtype=torch.int64, device=self.dev)
        self._dist.broadcast(t, self.leader, group=self.tr._world_pg)
        return int(t[0]), int(t[1])

    def _share_inputs(self, xs) -> dict:
        """What the stage reads of the received tensors, from the leader to every device of the stage
        (``xs`` None on the others); a differentiable one through the Trainer's broadcast, whose backward
        sums the devices' gradient shares onto the leader."""
        torch = _torch_modules()[0]
        from .kernels import TORCH_DTYPES
        from .train import _Broadcast
        out = {}
        anchor = torch.zeros((), device=self.dev, requires_grad=True)
        pg = self.tr._world_pg
        for j in sorted(self.sg.feeds):
            sizes, dtype = self.sg.recv_shapes[j]
            x = xs[j] if xs is not None else torch.empty(sizes, dtype=TORCH_DTYPES[dtype], device=self.dev)
            if x.is_floating_point() and self._is_activation(self.st.recv[j]):
                out[j] = _Broadcast.apply(pg, self.leader, anchor, x)
            else:
                y = x.detach().clone()
                self._dist.broadcast(y, self.leader, group=pg)
                out[j] = y
        return out

    def _follow(self, targets, losses: list) -> None:
        """A device of a stage other than its leader: run what the leader runs until it stops."""
        torch = _torch_modules()[0]
        last = self.st.index == self.S - 1
        saved: dict = {}
        while True:
            kind, k = self._command(0, 0)
            if kind == _STOP:
                break
            if kind == _FORWARD:
                out = self._compute(None, self._share_inputs(None), k)
                if last:
                    out = self._loss(out, targets[k] if targets is not None else None)
                    losses.append(out.detach())
                saved[k] = out
                continue
            out = saved.pop(k)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
            if outs:     # this device's copy of what the stage sends gets no gradient share
                torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs] if not last else None)

    def _loss(self, out, target):
        from .memory import tie as _tie
        tr = self.tr
        pick, _, split = tr._loss_ref(self._kind)
        c = tr._piece_loss({pick: out}, pick, self._kind, target if self._targets else None, split) \
            if tr.low.mine.get(pick) is not None else None
        # the loss tied to the whole output (zero gradient where this device's loss reads none of it)
        return _tie(out.new_zeros(()) if c is None else c, [out])

    def step(self, feeds=None, targets=None) -> float:
        torch = _torch_modules()[0]
        import numpy as _np
        tr = self.tr
        tr._zero_grads()
        self._targets = targets is not None
        if targets is not None:
            tt = targets if isinstance(targets, torch.Tensor) else torch.as_tensor(_np.asarray(targets))
        self._kind = _step_kind(self.loss, targets)
        self.micro = 0
        losses: list = []
        if self.rank == self.leader or not self.lead:
            sched = self._sched()
            args = []
            if self.st.index == 0:
                if feeds is None:
                    raise UnityError("the first pipeline stage needs the model inputs")
                args = [torch.as_tensor(feeds[n]).to(self.dev) for n in self.input_names]
            kw = {}
            if self.st.index == self.S - 1:
                kw["target"] = tt.to(self.dev) if targets is not None else torch.zeros(self.batch, device=self.dev)
                kw["losses"] = losses
            sched.step(*args, **kw)
            if self.lead and self.K > 1:
                self._command(_STOP, 0)
        else:
            chunks = list(torch.tensor_split(tt.to(self.dev), self.M)) if targets is not None else None
            self._follow(chunks, losses)
        # replicated weight regions: all-reduced over the devices that read them (the Trainer's buckets;
        # ZeRO-2: reduce-scattered), the micro-batches' sum divided by M first
        for p in tr.params.values():
            if p.grad is not None:
                p.grad.div_(self.M)
        tr._start_step_sync(torch.zeros(1, device=self.dev))
        tr._finish_sync()
        if tr._zrt is not None:          # ZeRO: the update of this device's shards, then the all-gather
            tr._zrt.step()
        else:
            tr.opt.step()
        self.steps_done += 1
        tr.step_no = self.steps_done
        loss = torch.zeros(1, dtype=torch.float64, device=self.dev)
        if self.st.index == self.S - 1:
            loss[0] = sum(float(x.detach()) for x in losses) / self.M
        if self.world > 1:
            self._dist.all_reduce(loss)
        return float(loss[0])

    def feed_rows(self) -> dict:
        """Input name -> rows of the batch this device reads: the first stage all, the others none."""
        return dict(self._rows[0])

    def target_rows(self, kind: str | None = None) -> tuple[int, int]:
        return self._rows[1]

    # --- state: the stage's parameters, whole (collective over the stage's devices) ----------------------
    def model_state(self) -> dict:
        return self.tr.model_state()

    def load_model_state(self, d: Mapping) -> None:
        self.tr.load_model_state({k: v for k, v in d.items() if k in self.tr.params or k in self.tr.buffers})

    def optimizer_state(self) -> dict:
        return self.tr.optimizer_state()

    def load_optimizer_state(self, d: Mapping) -> None:
        self.tr.load_optimizer_state(d)

    def local_shards(self) -> dict:
        return {name: (t, "stage") for name, t in self.model_state().items()}
