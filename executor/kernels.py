"""Torch versions of the compute operators, run on one piece (one task) of every tensor.

Each kernel takes ``(attrs, inputs, ctx)`` where ``attrs`` are the operator's *piece* attributes
(``OpSpec.piece_attrs``: a Reshape's target is the piece's shape, a grouped Conv2d's groups are
those of one piece) and ``ctx`` is a :class:`TaskContext` that says where the piece sits in the
logical tensor (for Dropout's counter-based mask) and how BatchNorm's statistics are summed across
the tasks that split its batch or spatial dims.  Kernels follow the numpy reference
(:mod:`unity_pcg.ops.compute`) except where training differs (DESIGN "Numpy reference semantics"):
BatchNorm uses batch statistics and Dropout drops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from unity_pcg.errors import UnityError

from .dropout import dropout_keep, logical_index

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class ExecutorError(UnityError, RuntimeError):
    """A plan the executor cannot run (an operator without a torch kernel, a device outside the world)."""


@dataclass
class TaskContext:
    """What a kernel may need besides its piece values."""
    training: bool = True
    seed: int = 0
    step: int = 0
    node_id: int = 0
    # per output/input: (logical sizes, offsets of this piece in the logical tensor)
    out_logical: tuple = ()
    out_offset: tuple = ()
    in_logical: tuple = ()
    in_offset: tuple = ()
    # BatchNorm: all-gather of per-task statistics over the tasks splitting the reduced dims (None: local)
    stat_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    extra: dict = field(default_factory=dict)


def _pair(v, n=2):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _act(name: str, y: torch.Tensor) -> torch.Tensor:
    if name == "none":
        return y
    if name == "relu":
        return torch.relu(y)
    if name == "gelu":
        return F.gelu(y)
    if name == "sigmoid":
        return torch.sigmoid(y)
    if name == "tanh":
        return torch.tanh(y)
    raise ExecutorError(f"Linear: unknown activation {name!r}")


def _dropout(a, xs, ctx: TaskContext):
    x = xs[0]
    ratio = float(a["ratio"])
    if not ctx.training or ratio <= 0.0:
        return [x]
    if ratio >= 1.0:
        return [x * 0]
    idx = logical_index(ctx.out_logical[0], ctx.out_offset[0], x.shape, x.device)
    keep = dropout_keep(ctx.seed, ctx.step, ctx.node_id, idx, ratio)
    return [x * keep.to(x.dtype) * (1.0 / (1.0 - ratio))]


GENERATORS = ("RandomNormal", "RandomUniform")


def generate_block(op: str, a: dict, seed: int, step: int, sizes, offset, piece, device) -> torch.Tensor:
    """The block of shape ``piece`` at ``offset`` of the logical tensor (``sizes``) that generator ``op``
    (RandomNormal / RandomUniform, attributes ``a``) draws at ``step``: the counter-based hash of the numpy
    reference (unity_pcg/ops/random_gen.py) on torch tensors, so every partitioning draws one device's values;
    a node without its own seed uses the run's."""
    from unity_pcg.counter_rng import TWO32, hash_index, stream_key
    idx = logical_index(tuple(sizes), tuple(offset), tuple(piece), device)
    seed = int(a["seed"]) if int(a["seed"]) >= 0 else int(seed)
    key = int(a["key"])
    u1 = (hash_index(stream_key(seed, step, key, 1), idx).to(torch.float64) + 0.5) / TWO32
    if op == "RandomUniform":
        v = float(a["low"]) + (float(a["high"]) - float(a["low"])) * u1
    else:
        u2 = (hash_index(stream_key(seed, step, key, 2), idx).to(torch.float64) + 0.5) / TWO32
        v = float(a["mean"]) + float(a["scale"]) * (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2))
    return v.to(TORCH_DTYPES[a["dtype"]])


def _generator(op: str):
    """The kernel of a generator task (the lowering draws a generator's pieces where they are read instead,
    ``executor/lower.py``; this runs where a program calls the node as a task)."""
    def run(a, xs, ctx: TaskContext):
        sizes = tuple(ctx.out_logical[0]) if ctx.out_logical else tuple(a["shape"])
        offset = tuple(ctx.out_offset[0]) if ctx.out_offset else (0,) * len(sizes)
        return [generate_block(op, a, ctx.seed, ctx.step, sizes, offset, tuple(a["shape"]),
                               ctx.extra.get("device", "cpu"))]
    return run


# --- normalization -------------------------------------------------------------------------------------

def _batchnorm(a, xs, ctx: TaskContext):
    x, scale, bias, mean, var = xs
    sh = (1, -1) + (1,) * (x.dim() - 2)
    eps = float(a["eps"])
    if not ctx.training:
        y = (x - mean.reshape(sh)) / torch.sqrt(var.reshape(sh) + eps) * scale.reshape(sh) + bias.reshape(sh)
        return [y]
    dims = [0] + list(range(2, x.dim()))
    if ctx.stat_gather is None:         # statistics of this piece alone: torch's fused kernel
        if ctx.extra.get("want_stats"):
            # the running statistics (mean, unbiased variance) from the same fused kernel: fresh buffers
            # updated with momentum 1 hold exactly this batch's statistics (no extra passes over x)
            c = x.shape[1]
            rm = torch.zeros(c, dtype=scale.dtype, device=x.device)
            rv = torch.ones(c, dtype=scale.dtype, device=x.device)
            y = F.batch_norm(x, rm, rv, scale, bias, training=True, momentum=1.0, eps=eps)
            ctx.extra["bn_stats"] = (rm, rv)
            return [y]
        return [F.batch_norm(x, None, None, scale, bias, training=True, eps=eps)]
    # statistics over the tasks that split the batch or spatial dims (SyncBatchNorm): every task's
    # (mean, squared deviations, count) per channel in one all-gather, combined as Chan et al.'s
    # parallel variance (numerically stable; E[x^2] - E[x]^2 would lose the variance to cancellation)
    c = x.shape[1]
    m = x.mean(dims)
    d0 = x - m.reshape(sh)
    local = torch.cat([m, (d0 * d0).sum(dims), x.new_full((1,), float(x.numel() // c))])
    allv = ctx.stat_gather(local)                       # (tasks, 2C + 1)
    ns = allv[:, 2 * c:2 * c + 1]
    ms = allv[:, :c]
    total = ns.sum()
    mu = (ns * ms).sum(0) / total
    var_b = (allv[:, c:2 * c] + ns * (ms - mu) ** 2).sum(0) / total
    if ctx.extra.get("want_stats"):     # running statistics: torch's unbiased variance of the whole batch
        t = float(total)
        ctx.extra["bn_stats"] = (mu.detach(), var_b.detach() * (t / (t - 1) if t > 1 else 1.0))
    y = (x - mu.reshape(sh)) * torch.rsqrt(var_b.reshape(sh) + eps) * scale.reshape(sh) + bias.reshape(sh)
    return [y]


def _layernorm(a, xs, ctx):
    x = xs[0]
    ax = a["axis"] % x.dim()
    w = xs[1] if len(xs) > 1 else None
    b = xs[2] if len(xs) > 2 else None
    return [F.layer_norm(x, tuple(x.shape[ax:]), w, b, float(a["eps"]))]


def _lrn(a, xs, ctx):
    x = xs[0]
    size = int(a["size"])
    sq = F.pad(x * x, (0, 0, 0, 0, (size - 1) // 2, size // 2))
    s = sum(sq[:, i:i + x.shape[1]] for i in range(size))
    return [x / (float(a["bias"]) + float(a["alpha"]) / size * s) ** float(a["beta"])]


# --- convolution and pooling --------------------------------------------------------------------------

def _conv(a, xs, ctx):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) == 3 else None
    t, l, bo, r = _pair(a["padding"], 4)
    if (t, l) == (bo, r):
        return [F.conv2d(x, w, b, _pair(a["stride"]), (t, l), _pair(a["dilation"]), int(a["groups"]))]
    x = F.pad(x, (l, r, t, bo))
    return [F.conv2d(x, w, b, _pair(a["stride"]), 0, _pair(a["dilation"]), int(a["groups"]))]


def _pool_extra(size, k, s, p0, p1):
    out = -(-(size + p0 + p1 - k) // s) + 1
    if (out - 1) * s >= size + p0:
        out -= 1
    return max(0, (out - 1) * s + k - (size + p0 + p1))


def _pool(a, xs, ctx):
    x = xs[0]
    if a["global_pool"]:
        if a["kind"] == "max":
            return [x.amax(dim=(2, 3), keepdim=True)]
        return [x.mean(dim=(2, 3), keepdim=True)]
    kh, kw = _pair(a["kernel"])
    sh, sw = _pair(a["stride"])
    top, left, bottom, right = _pair(a["padding"], 4)
    h, w = x.shape[2], x.shape[3]
    pb, pr = bottom, right
    if a["ceil_mode"]:
        pb += _pool_extra(h, kh, sh, top, bottom)
        pr += _pool_extra(w, kw, sw, left, right)
    if a["kind"] == "max":
        xp = F.pad(x, (left, pr, top, pb), value=-math.inf)
        return [F.max_pool2d(xp, (kh, kw), (sh, sw))]
    xp = F.pad(x, (left, pr, top, pb), value=0.0)
    s = F.avg_pool2d(xp, (kh, kw), (sh, sw)) * (kh * kw)
    ones = torch.ones((1, 1, h, w), dtype=x.dtype, device=x.device)
    if a["count_include_pad"]:
        ones = F.pad(ones, (left, right, top, bottom), value=1.0)
        ones = F.pad(ones, (0, pr - right, 0, pb - bottom), value=0.0)
    else:
        ones = F.pad(ones, (left, pr, top, pb), value=0.0)
    cnt = F.avg_pool2d(ones, (kh, kw), (sh, sw)) * (kh * kw)
    return [s / torch.clamp(cnt, min=1.0)]


# --- shapes --------------------------------------------------------------------------------------------

def _slice(a, xs, ctx):
    x = xs[0]
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        ax = ax % x.dim()
        r = range(*slice(st, en, sp).indices(x.shape[ax]))
        if sp > 0:
            x = x.narrow(ax, r.start, len(r)) if sp == 1 else \
                x.index_select(ax, torch.arange(r.start, r.start + sp * len(r), sp, device=x.device)
                               if len(r) else torch.zeros(0, dtype=torch.int64, device=x.device))
        else:
            x = x.index_select(ax, torch.tensor(list(r), dtype=torch.int64, device=x.device))
    return [x]


def _reduce(kind):
    def k(a, xs, ctx):
        x = xs[0]
        axes = sorted({ax % x.dim() for ax in a["axes"]}) if a["axes"] else list(range(x.dim()))
        f = torch.sum if kind == "sum" else torch.mean
        if not axes:
            return [x]
        return [f(x, dim=axes, keepdim=bool(a["keepdims"]))]
    return k


def _gather(a, xs, ctx):
    data, idx = xs
    ax = a["axis"] % data.dim()
    out = data.index_select(ax, idx.reshape(-1).long() % data.shape[ax])   # ONNX allows negative indices
    shape = data.shape[:ax] + idx.shape + data.shape[ax + 1:]
    return [out.reshape(shape)]


def _clip(a, xs, ctx):
    lo, hi = a["min"], a["max"]
    if lo == -math.inf and hi == math.inf:
        return [xs[0]]
    return [torch.clamp(xs[0], min=None if lo == -math.inf else lo, max=None if hi == math.inf else hi)]


def _split(a, xs, ctx):
    return list(torch.split(xs[0], list(a["sizes"]), dim=a["axis"] % xs[0].dim()))


def _expand(a, xs, ctx):
    shape = a.get("_piece_shape") or torch.broadcast_shapes(xs[0].shape, tuple(a["shape"]))
    return [xs[0].expand(tuple(shape)).contiguous()]


def _flatten(a, xs, ctx):
    x = xs[0]
    if a.get("_piece_shape"):
        return [x.reshape(tuple(a["_piece_shape"]))]
    ax = a["axis"] + x.dim() if a["axis"] < 0 else a["axis"]
    return [x.reshape(math.prod(x.shape[:ax]), math.prod(x.shape[ax:]))]


def _linear(a, xs, ctx):
    if len(xs) == 3 and xs[0].dim() == 2:
        return [_act(a["activation"], torch.addmm(xs[2], xs[0], xs[1]))]
    y = torch.matmul(xs[0], xs[1])
    if len(xs) == 3:
        y = y + xs[2]
    return [_act(a["activation"], y)]


KERNELS: dict[str, Callable[[dict, list, TaskContext], list]] = {
    "Relu": lambda a, xs, c: [torch.relu(xs[0])],
    "Gelu": lambda a, xs, c: [F.gelu(xs[0])],
    "Sigmoid": lambda a, xs, c: [torch.sigmoid(xs[0])],
    "Tanh": lambda a, xs, c: [torch.tanh(xs[0])],
    "Erf": lambda a, xs, c: [torch.erf(xs[0])],
    "Exp": lambda a, xs, c: [torch.exp(xs[0])],
    "Sqrt": lambda a, xs, c: [torch.sqrt(xs[0])],
    "Reciprocal": lambda a, xs, c: [torch.reciprocal(xs[0])],
    "Neg": lambda a, xs, c: [-xs[0]],
    "Identity": lambda a, xs, c: [xs[0]],
    "Dropout": _dropout,
    "RandomNormal": _generator("RandomNormal"),
    "RandomUniform": _generator("RandomUniform"),
    "Scale": lambda a, xs, c: [xs[0] * float(a["factor"])],
    "Clip": _clip,
    "Cast": lambda a, xs, c: [xs[0].to(TORCH_DTYPES[a["to"]])],
    "Add": lambda a, xs, c: [xs[0] + xs[1]],
    "Sub": lambda a, xs, c: [xs[0] - xs[1]],
    "Mul": lambda a, xs, c: [xs[0] * xs[1]],
    "Div": lambda a, xs, c: [xs[0] / xs[1]],
    "Pow": lambda a, xs, c: [torch.pow(xs[0], xs[1])],
    "Max": lambda a, xs, c: [torch.maximum(xs[0], xs[1])],
    "Min": lambda a, xs, c: [torch.minimum(xs[0], xs[1])],
    "Linear": _linear,
    "MatMul": lambda a, xs, c: [torch.matmul(xs[0], xs[1])],
    "BatchMatMul": lambda a, xs, c: [torch.matmul(xs[0], xs[1])],
    "Conv2d": _conv,
    "Pool2d": _pool,
    "LRN": _lrn,
    "Softmax": lambda a, xs, c: [torch.softmax(xs[0], dim=a["axis"] % xs[0].dim())],
    "LayerNorm": _layernorm,
    "BatchNorm": _batchnorm,
    "Embedding": lambda a, xs, c: [F.embedding(xs[0].long() % xs[1].shape[0], xs[1])],
    "Gather": _gather,
    "Concat": lambda a, xs, c: [torch.cat(list(xs), dim=a["axis"] % xs[0].dim())],
    "Split": _split,
    "Slice": _slice,
    "Reshape": lambda a, xs, c: [xs[0].reshape(tuple(a["shape"]))],
    "Transpose": lambda a, xs, c: [xs[0].permute(tuple(a["perm"]))],
    "Flatten": _flatten,
    "Expand": _expand,
    "ReduceSum": _reduce("sum"),
    "ReduceMean": _reduce("mean"),
}


def kernel(op: str) -> Callable[[dict, list, TaskContext], list]:
    try:
        return KERNELS[op]
    except KeyError:
        raise ExecutorError(f"operator {op} has no torch kernel in the executor") from None


from . import kernels_elementwise, kernels_indexing, kernels_spatial  # noqa: E402,F401  (they add to KERNELS)

__all__ = ["KERNELS", "kernel", "TaskContext", "ExecutorError", "TORCH_DTYPES", "dropout_keep", "logical_index"]
