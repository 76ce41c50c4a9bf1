"""The operator registry's building blocks.

Every compute operator describes its parallel behaviour with *labels*, einsum style: each dim of
each input and output gets a label; a label shared by several tensors is one axis of the task grid.
From the labels and the input parallel shapes, :func:`label_inference` derives

* whether the input parallelization is valid (and why not),
* the output parallel shapes,
* a :class:`PieceMap`: for every tensor, which task-grid axes index its copy, sum and shard axes.

Every tensor of a compute operator has exactly one piece per task (the operator's degree of
parallelism), so the piece map is a bijection per tensor.  The piecewise evaluator, the cost model
(machine views map task grids onto devices) and the executor all read the same piece map.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Mapping, Sequence

from ..errors import InvalidParallelization, ShapeError, UnknownOperator
from ..shape import ParallelTensorShape, ShardDim

Shapes = Sequence[ParallelTensorShape]


@dataclass(frozen=True)
class TensorMap:
    """Task-grid axes (major to minor) that index each grid axis of one tensor."""
    copy: tuple[str, ...]
    sum: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class PieceMap:
    axes: tuple[tuple[str, int], ...]          # task-grid axes (name, degree), degree > 1 only
    inputs: tuple[TensorMap, ...]
    outputs: tuple[TensorMap, ...]

    @property
    def degree(self) -> int:
        return prod(d for _, d in self.axes)

    def axis_degrees(self) -> dict[str, int]:
        return dict(self.axes)


@dataclass(frozen=True)
class Labels:
    """Einsum-style description of an operator's parallel behaviour.

    inputs/outputs: one label per dim.  ``unshardable``: labels whose degree must stay 1 (a softmax
    axis, a pooled spatial dim, ...).  A label in inputs but in no output is *contracted*: sharding
    it gives partial sums (only valid when the operator sums over it).  ``linearity``:
    ``"additive"`` (the operator is linear in all inputs jointly: every input carries the same sum
    degree, which passes to the output), or a tuple of per-input flags (multilinear: each flagged
    input may carry partial sums; the others are copied across them).
    """
    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    unshardable: frozenset = frozenset()
    linearity: Any = ()
    reason: Mapping[str, str] = field(default_factory=dict)  # why a label is unshardable


def _fail(op: str, msg: str) -> None:
    raise InvalidParallelization(f"{op}: {msg}")


def label_inference(op: str, labels: Labels, in_shapes: Shapes, out_sizes: Sequence[Sequence[int]],
                    out_dtypes: Sequence[str], strict: bool = True
                    ) -> tuple[tuple[ParallelTensorShape, ...], PieceMap]:
    """Derive output parallel shapes and the piece map from labels (see module docstring).

    With ``strict=False`` the validity checks that make the piecewise result equal the logical
    one (unshardable labels, partial sums through a non-linear input) are skipped; tests use this to
    show that every refusal is justified.
    """
    n_in = len(in_shapes)
    if len(labels.inputs) != n_in:
        raise AssertionError(f"{op}: labels for {len(labels.inputs)} inputs, got {n_in}")
    deg: dict[str, int] = {}
    where: dict[str, str] = {}
    for i, (lab, s) in enumerate(zip(labels.inputs, in_shapes)):
        if len(lab) != s.rank:
            raise AssertionError(f"{op}: {len(lab)} labels for a rank-{s.rank} input {i}")
        for j, (l, d) in enumerate(zip(lab, s.degrees)):
            if l in deg and deg[l] != d:
                _fail(op, f"input {i} dim {j} has degree {d} but {where[l]} has degree {deg[l]}; "
                          f"they must match")
            if l not in deg:
                deg[l], where[l] = d, f"input {i} dim {j}"
    if strict:
        for l in labels.unshardable:
            if deg.get(l, 1) > 1:
                why = labels.reason.get(l, "this dim cannot be partitioned")
                _fail(op, f"{where[l]} is partitioned (degree {deg[l]}) but {why}")
    out_labels = set(l for lab in labels.outputs for l in lab)
    contracted = [l for l in deg if l not in out_labels and deg[l] > 1]
    linear_somewhere = labels.linearity == "additive" or any(labels.linearity or ())
    if strict and contracted and not linear_somewhere:
        l = contracted[0]
        _fail(op, f"{where[l]} is partitioned (degree {deg[l]}) along a dim {op} sums over, which gives "
                  f"partial sums, but {op} is not linear")

    # partial sums
    sums = [s.sum_degree for s in in_shapes]
    sum_axes: list[tuple[str, ...]] = [() for _ in range(n_in)]
    extra_sum_for_copy: list[list[str]] = [[] for _ in range(n_in)]
    out_sum_axes: list[str] = []
    task: dict[str, int] = {l: d for l, d in deg.items() if d > 1}
    if labels.linearity == "additive":
        if len(set(sums)) > 1:
            _fail(op, f"inputs carry different partial-sum degrees {sums}; they must be equal")
        if sums and sums[0] > 1:
            task["~sum"] = sums[0]
            sum_axes = [("~sum",)] * n_in
            out_sum_axes.append("~sum")
    else:
        flags = tuple(labels.linearity) if labels.linearity else (False,) * n_in
        for i, s in enumerate(sums):
            if s == 1:
                continue
            if strict and not flags[i]:
                _fail(op, f"input {i} holds partial sums (sum degree {s}) but {op} is not linear in it; "
                          f"Reduce it first")
            ax = f"~sum{i}"
            task[ax] = s
            sum_axes[i] = (ax,)
            out_sum_axes.append(ax)
            for k in range(n_in):
                if k != i:
                    extra_sum_for_copy[k].append(ax)

    # copies: each input's copy degree = missing labels x other inputs' sum axes x replicas
    reps = set()
    in_copy: list[tuple[str, ...]] = []
    for i, (lab, s) in enumerate(zip(labels.inputs, in_shapes)):
        have = set(lab)
        missing = [l for l in task if not l.startswith("~") and l not in have]
        need = prod(task[l] for l in missing) * prod(task[a] for a in extra_sum_for_copy[i])
        if s.copy_degree % need != 0:
            what = ", ".join(f"{l} ({where[l]}, degree {task[l]})" for l in missing)
            what = what or "other inputs' partial sums"
            _fail(op, f"input {i} has copy degree {s.copy_degree}, which must be a multiple of {need} "
                      f"to give every task its own copy (it lacks {what})")
        reps.add(s.copy_degree // need)
        in_copy.append(tuple(missing) + tuple(extra_sum_for_copy[i]))
    if len(reps) > 1:
        _fail(op, f"inputs imply different replica degrees {sorted(reps)}; replicate them equally")
    rep = reps.pop() if reps else 1
    if rep > 1:
        task["~rep"] = rep
        in_copy = [c + ("~rep",) for c in in_copy]

    # outputs
    outs = []
    out_maps = []
    for lab, sizes, dt in zip(labels.outputs, out_sizes, out_dtypes):
        dims = []
        dmaps = []
        for l, size in zip(lab, sizes):
            d = deg.get(l, 1)
            try:
                dims.append(ShardDim(int(size), d))
            except ShapeError:
                if int(size) < 0:
                    _fail(op, f"output size {size} is negative")
                _fail(op, f"degree {d} of {where.get(l, 'a dim')} does not divide output size {size}")
            dmaps.append((l,) if d > 1 else ())
        out_sum = tuple(contracted) + tuple(out_sum_axes)
        outs.append(ParallelTensorShape(tuple(dims), prod(task[a] for a in out_sum), rep, dt))
        out_maps.append(TensorMap(("~rep",) if rep > 1 else (), out_sum, tuple(dmaps)))
    in_maps = []
    for i, (lab, s) in enumerate(zip(labels.inputs, in_shapes)):
        dmaps = tuple(((l,) if deg[l] > 1 else ()) for l in lab)
        in_maps.append(TensorMap(in_copy[i], sum_axes[i], dmaps))
    # a sharded label that reaches no output and is not summed would be computed twice: impossible
    # by construction (contracted labels always reach the output's sum axes).
    return tuple(outs), PieceMap(tuple(task.items()), tuple(in_maps), tuple(out_maps))


# --- operator specs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inference:
    outputs: tuple[ParallelTensorShape, ...]
    piece_map: PieceMap | None  # None for sources and parallel operators


ALL = "all"
AUTOCAST_MODES = ("low", "fp32", "fp32_direct", "follow", "follow_first", "declared")


@dataclass(frozen=True)
class Saves:
    """What an operator keeps from its forward pass for its backward (autograd's saved tensors), read
    by the memory model: ``inputs``, the input positions it saves (:data:`ALL`: every input);
    ``output``: whether it saves its output; ``mask``: it keeps a one-byte-per-element mask of its
    output (Dropout) when nothing else keeps the output; ``temps``: output-sized temporaries its backward
    holds at once besides the gradients (the memory model's backward walk)."""
    inputs: frozenset | str = frozenset()
    output: bool = False
    mask: bool = False
    temps: int = 0          # output-sized temporaries its backward makes besides the gradients (Softmax: 1)

    def __post_init__(self):
        if self.inputs != ALL:
            object.__setattr__(self, "inputs", frozenset(self.inputs))

    def saves_input(self, pos: int) -> bool:
        return self.inputs == ALL or pos in self.inputs


NOTHING = Saves()


@dataclass(frozen=True)
class OpSpec:
    """One registry entry.  See DESIGN "Operator spec".

    Besides semantics, a compute operator carries what the cost and memory models and the executor
    need to know about it (``tests/unity_pcg/test_op_knowledge.py`` fails, naming the operator, when
    one lacks it):

    * ``cost_class``: its class in the cost model (one of ``unity_pcg.search.cost.OP_CLASSES``: the
      unit of per-class efficiency, launch overhead and measured kernel tables), or a function of the
      input shapes (None when unknown) giving it, where the kernel depends on them (a 1x1 convolution);
    * ``autocast``: what ``torch.autocast`` does with it under bf16 mixed precision: ``"low"`` (its
      lower-precision list: reads and writes bf16), ``"fp32"`` (its fp32 list: casts float inputs to
      fp32, writes fp32), ``"fp32_direct"`` (fp32 list, but reads a bf16 input directly through a dtype
      argument: no cast kernel), ``"follow"`` (type promotion: the widest float dtype of its inputs of
      rank > 0), ``"follow_first"`` (the dtype of its first float input: BatchNorm), ``"declared"``
      (its declared output dtype: Cast);
    * ``saves``: what it keeps for its backward (:class:`Saves`);
    * ``nondiff_inputs``: float input positions that get no gradient (BatchNorm's running statistics).
    """
    name: str
    kind: str                                   # "source" | "compute" | "parallel"
    attrs: Mapping[str, Any]                    # attribute name -> default (REQUIRED if none)
    infer: Callable[..., Inference]             # (attrs, in_shapes, strict=True) -> Inference
    forward: Callable[[dict, list], list]       # numpy reference on logical (or piece) values
    flops: Callable[[dict, Shapes, Shapes], float] = lambda a, i, o: 0.0
    piece_attrs: Callable[[dict, Shapes, Shapes], dict] | None = None
    num_inputs: int | tuple[int, int] = 1       # exact count or (min, max)
    doc: str = ""
    # compute operators: (attrs, in_shapes, out_sizes) -> Labels, the description label_inference reads
    labels: Callable[[dict, Shapes, Sequence[Sequence[int]]], "Labels"] | None = None
    # operator knowledge of the cost and memory models (see the class docstring); None: not stated
    cost_class: str | Callable[[Shapes | None], str] | None = None
    autocast: str | None = None
    saves: Saves | None = None
    nondiff_inputs: tuple[int, ...] = ()

    def check_arity(self, n: int) -> None:
        lo, hi = (self.num_inputs, self.num_inputs) if isinstance(self.num_inputs, int) else self.num_inputs
        if not lo <= n <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise InvalidParallelization(f"{self.name}: takes {want} inputs, got {n}")

    def normalize_attrs(self, attrs: Mapping[str, Any]) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise InvalidParallelization(f"{self.name}: unknown attribute(s) {', '.join(sorted(unknown))}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = _freeze(attrs[k])
            elif default is REQUIRED:
                raise InvalidParallelization(f"{self.name}: missing required attribute {k!r}")
            else:
                out[k] = default
        return out

    def bytes_moved(self, in_shapes: Shapes, out_shapes: Shapes) -> int:
        """Bytes read and written by one forward pass over the given (logical or piece) shapes."""
        return sum(s.nbytes for s in in_shapes) + sum(s.nbytes for s in out_shapes)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


def _freeze(v: Any) -> Any:
    if hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0:   # numpy array
        return _freeze(v.tolist())
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_freeze(x) for x in v)
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        return v.item()
    return v


REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in REGISTRY:
        raise AssertionError(f"operator {spec.name} registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownOperator(f"unknown operator {name!r}") from None


def logical_shapes(shapes: Shapes) -> tuple[ParallelTensorShape, ...]:
    return tuple(s.logical() for s in shapes)


def piece_shapes(shapes: Shapes) -> tuple[ParallelTensorShape, ...]:
    """The shape of one piece of each tensor, as an unpartitioned tensor."""
    return tuple(ParallelTensorShape.of(s.piece_shape, dtype=s.dtype) for s in shapes)
