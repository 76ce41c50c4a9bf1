"""Measure one accelerator (``--device cuda``; ``cpu`` runs the same code on this CPU) and describe it
as a machine file: per math mode and operator class, a measured table of kernel time against work and
a fitted throughput + fixed per-kernel cost (DESIGN "Calibration").

Math modes (:data:`MODES`): ``fp32`` (TF32 off for cuBLAS and cuDNN), ``tf32`` (on), ``bf16`` (what a
``torch.autocast(bfloat16)`` step runs).  Each kernel is measured in the dtypes it reads and writes in
such a step, so the tables are keyed as ``search.cost`` looks them up and the casts autocast inserts stay
with the cost model's own cast pricing: matmul and convolution operands (weights included) in bf16;
element-wise kernels, BatchNorm and pooling on bf16 activations; softmax and sum reading bf16 and writing fp32;
LayerNorm, the embedding (fp32 tables) and the optimizer (fp32 master weights and states) only in fp32.

* Classes (:func:`cases`, sizes up to the zoo's paper-size layers): ``matmul`` (``F.linear`` without
  bias: the cost model adds a bias gradient as a reduction), ``conv`` (dense spatial ``conv2d``; also
  Inception's large 3x3 layers), ``conv1x1``, ``conv_grouped`` (ResNeXt's grouped 3x3),
  ``bmm`` (attention-like batched matmuls, DLRM's interaction), ``embedding`` (``F.embedding``: the
  gather forward and the dense backward, the table gradient zeroed and the rows scatter-added),
  ``elementwise`` (ReLU, Add), ``norm`` (LayerNorm), ``batchnorm`` (training-mode BatchNorm2d at
  the zoo's channel x spatial shapes), ``softmax`` and
  ``reduce`` (sum) over the last dim, ``pool`` (3x3 max and average pooling, stride 1), the optimizer
  step (``optimizer_sgd``, ``optimizer_adam``: ``torch.optim`` defaults, foreach on CUDA, over equal
  fp32 tensors; per tensor).  Forward and backward
  (``torch.autograd.grad`` of the forward's output with respect to every operand that needs a
  gradient, the graph kept; short kernels: one call over up to 16 independent copies, divided by the
  copies, so the engine's start is shared as in a whole backward pass, :func:`joint_backward`).
* Timing (:func:`make_timer`): a sample is a loop of calls between two CUDA events (``perf_counter`` on
  a CPU) lasting about a millisecond, so a kernel shorter than its launch is priced at the rate the host
  issues it, as in a training step; the median of the samples after warm-up.
* Work (``search.cost.kernel_work``, the tables' x axis): FLOPs for compute classes (forward and
  backward tables alike); bytes moved by the forward for memory-bound classes; the embedding's forward
  indices + gathered rows, its backward gathered rows + table gradient; the optimizer's bytes moved per
  tensor ``(3 + 2 states) * weight bytes`` (``CostModel.update_time``).
* Tables (:func:`make_table`): ``"<name>/<mode>" -> [[work, seconds], ...]``, names ``<class>`` and
  ``<class>_bwd`` (``embedding_fwd`` / ``embedding_bwd``; ``optimizer`` holds both optimizers' points,
  ``optimizer_sgd`` / ``optimizer_adam`` each one's), memory-bound classes under the dtype they stream
  (``CostModel.mode_of``): points sorted by work, equal works averaged, made non-decreasing
  (pool-adjacent-violators).  Fits (:func:`fit_affine`): ``t = overhead + work / throughput`` per table,
  least squares on the relative error.
* With more than one GPU: NCCL all-reduce, all-gather and reduce-scatter over sizes, one process per GPU
  (:func:`measure_collectives`), fitted to the ring model the cost model uses (:func:`fit_collective`).

:func:`calibrate_device` writes the machine JSON (``unity-pcg calibrate --device cuda -o FILE``): the
preset of the same GPU (``h100``, ``dgx-a100``, ``summit``; ``base``) keeps its topology and network link;
measured are ``peak_flops`` and ``peaks`` per mode (the best rate a compute kernel reached),
``efficiency`` per class (``"<class>/<mode>"`` outside fp32), ``mem_bandwidth`` (element-wise fp32 fit),
``op_overhead`` and per-class ``overheads`` (fp32 fits), ``update_overhead`` (Adam per tensor),
``kernel_tables``, ``memory_bytes`` (``torch.cuda.mem_get_info``'s total) and, with several GPUs, the
``group`` and ``node`` links (all-reduce fit).  ``meta["gpu_calibration"]`` keeps every measurement, fit
and the collectives.  Progress goes to stderr.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from unity_pcg.errors import UnityError

MODES = ("fp32", "tf32", "bf16")
COMPUTE_CLASSES = ("matmul", "conv", "conv1x1", "conv_grouped", "bmm")
MEMORY_CLASSES = ("embedding", "elementwise", "batchnorm", "norm", "softmax", "reduce", "pool")
OPTIMIZER_CLASSES = ("optimizer_sgd", "optimizer_adam")
CLASSES = COMPUTE_CLASSES + MEMORY_CLASSES + OPTIMIZER_CLASSES
SIZES = ("tiny", "quick", "full")

Timer = Callable[[Callable[[], Any], int, int], float]


class CalibrationError(UnityError):
    """No such device, or a measurement that cannot run."""


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


# --- timing -------------------------------------------------------------------------------------------

def make_timer(device: str, min_sample_s: float = 1e-3) -> Timer:
    """``timer(fn, warmup, reps)``: median seconds per call of ``fn`` on ``device``.  One sample is a
    loop of calls lasting about ``min_sample_s`` (the loop length is set from a first timed call) between
    two CUDA events (perf_counter on a CPU)."""
    import torch
    cuda = str(device).startswith("cuda")

    def once(fn, n: int) -> float:
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3 / n
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    def timer(fn, warmup: int, reps: int) -> float:
        for _ in range(max(warmup, 1)):
            fn()
        if cuda:
            torch.cuda.synchronize()
        first = once(fn, 1)
        n = max(1, min(1000, int(min_sample_s / max(first, 1e-7))))
        return statistics.median(once(fn, n) for _ in range(reps))
    return timer


@contextlib.contextmanager
def math_mode(mode: str, device: str):
    """TF32 off (``fp32``) or on (``tf32``, ``bf16``) for cuBLAS matmuls and cuDNN convolutions while
    inside; restored on exit.  Uses torch's ``fp32_precision`` flags where torch has them (2.9+: reading
    the legacy ``allow_tf32`` after the new flags were set is an error), else ``allow_tf32``.  bf16
    kernels get their dtypes from the tensors (:func:`build_case`) or from ``torch.autocast``."""
    import torch
    if mode not in MODES:
        raise CalibrationError(f"unknown math mode {mode!r} (known: {', '.join(MODES)})")
    on = mode != "fp32"
    mm, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    new_api = hasattr(mm, "fp32_precision") and conv is not None and hasattr(conv, "fp32_precision")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if new_api:
            old = (mm.fp32_precision, conv.fp32_precision)
            mm.fp32_precision = conv.fp32_precision = "tf32" if on else "ieee"
        else:
            old = (mm.allow_tf32, torch.backends.cudnn.allow_tf32)
            mm.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if new_api:
                mm.fp32_precision, conv.fp32_precision = old
            else:
                mm.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def tf32_enabled() -> tuple[bool, bool]:
    """(cuBLAS matmul, cuDNN convolution) TF32 flags as torch reports them."""
    import torch
    mm, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if hasattr(mm, "fp32_precision") and conv is not None and hasattr(conv, "fp32_precision"):
        return mm.fp32_precision == "tf32", conv.fp32_precision == "tf32"
    return bool(mm.allow_tf32), bool(torch.backends.cudnn.allow_tf32)


# --- the benchmark cases --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One benchmark: an operator class at one size (``params``: the class's dimensions)."""
    cls: str
    label: str
    params: tuple


def case_modes(cls: str, modes: Sequence[str]) -> list[str]:
    """The math modes a class is measured in: compute classes in every mode; the memory-bound ones with
    a bf16 kernel (element-wise, BatchNorm, softmax and sum reading bf16) in fp32 and bf16; the
    embedding (fp32 tables in every precision), LayerNorm (autocast runs it in fp32) and the optimizer
    (fp32 master weights and states) in fp32 only.  TF32 changes nothing but matmul and convolution kernels."""
    if cls in COMPUTE_CLASSES:
        return list(modes)
    if cls in ("elementwise", "batchnorm", "softmax", "reduce", "pool"):
        return [m for m in modes if m in ("fp32", "bf16")]
    return [m for m in modes if m == "fp32"]


def cases(size: str = "full") -> list[Case]:
    """The benchmark cases of every class at ``size`` (``tiny``: tests on a CPU, seconds; ``quick``: a
    smaller sweep; ``full``: up to paper-size layers)."""
    if size not in SIZES:
        raise CalibrationError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
    tiny, quick = size == "tiny", size == "quick"
    out: list[Case] = []

    def add(cls, label, *params):
        out.append(Case(cls, label, tuple(params)))
    # matmul: (M, K, N) squares and the zoo's skinny layers
    if tiny:
        mm = [(8, 8, 8), (32, 32, 32), (64, 64, 64), (64, 128, 32)]
    else:
        sq = [128, 256, 512, 1024, 2048, 4096] if quick else [128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                                                               4096, 6144, 8192]
        mm = [(n, n, n) for n in sq] + [(64, 2048, 1000), (1024, 1024, 512), (2048, 1024, 1024), (2048, 1024, 4096),
                                        (2048, 4096, 1024), (256, 4192, 4192), (1024, 4096, 4096)]
        mm += [] if quick else [(256, 8192, 8192), (1024, 2048, 4096), (4096, 64, 512)]
    for m, k, n in mm:
        add("matmul", f"{m}x{k}x{n}", m, k, n)
    # convolutions: (N, Cin, H, Cout, kernel, stride, groups)
    if tiny:
        batches, spatial, c1, grouped = [1, 2], [(8, 8)], [(8, 8, 16)], [(16, 8, 4)]
    else:
        batches = [1, 8] if quick else [1, 8, 32, 64]
        spatial = [(64, 56), (128, 28), (256, 14), (512, 7)]
        c1 = [(256, 56, 64), (64, 56, 256), (512, 28, 128), (1024, 14, 256), (2048, 7, 512)]
        grouped = [(128, 56, 32), (256, 28, 32), (512, 14, 32), (1024, 7, 32)]
    for b in batches:
        for c, h in spatial:
            add("conv", f"n{b}c{c}h{h}k3", b, c, h, c, 3, 1, 1)
        for c, h, co in c1:
            add("conv1x1", f"n{b}c{c}h{h}o{co}", b, c, h, co, 1, 1, 1)
        for c, h, gr in grouped:
            add("conv_grouped", f"n{b}c{c}h{h}g{gr}", b, c, h, c, 3, 1, gr)
    if not tiny:
        b = 8 if quick else 64
        add("conv", f"n{b}c3h224k7s2", b, 3, 224, 64, 7, 2, 1)
        # Inception-v3's large 3x3 convolutions (up to 1e11 FLOPs: beyond the square sweep above)
        for ci, h, co, s in ((32, 147, 64, 1), (80, 73, 192, 1), (288, 35, 384, 2), (64, 56, 64, 1)):
            add("conv", f"n{b}c{ci}h{h}o{co}s{s}", b, ci, h, co, 3, s, 1)
    # batched matmul: (B, M, K, N): attention scores / context, DLRM's interaction
    if tiny:
        bm = [(2, 8, 4, 8), (4, 16, 8, 16)]
    else:
        bm = [(b, s, 64, s) for b in ([1, 16] if quick else [1, 16, 64]) for s in (128, 512)]
        bm += [(b, s, s, 64) for b in ([16] if quick else [16, 64]) for s in (128, 512)]
        bm += [(1024, 25, 64, 25), (4096, 25, 64, 25)]
    for b, m, k, n in bm:
        add("bmm", f"{b}x{m}x{k}x{n}", b, m, k, n)
    # embeddings: (rows, dim, ids); forward gather and backward (dense table gradient)
    if tiny:
        emb = [(100, 8, 16), (1000, 8, 64)]
    else:
        emb = [(r, 64, n) for r in ((100_000,) if quick else (100_000, 1_000_000))
               for n in (1024, 8192, 102_400)] + [(30_522, 1024, 2048), (500_000, 64, 4096)]
    for r, d, n in emb:
        add("embedding", f"r{r}d{d}n{n}", r, d, n)
    # memory-bound classes: element counts
    counts = [2 ** 8, 2 ** 12, 2 ** 14] if tiny else [2 ** k for k in range(10, 26 if quick else 28, 2)]
    for n in counts:
        add("elementwise", f"relu{n}", "relu", n)
        add("elementwise", f"add{n}", "add", n)
        add("reduce", f"sum{n}", max(n // 1024, 1), min(n, 1024))
        add("softmax", f"softmax{n}", max(n // 512, 1), min(n, 512))
        add("norm", f"layernorm{n}", max(n // 1024, 1), min(n, 1024))
        ch = 4 if tiny else 64
        hw = max(int(math.isqrt(max(n // (ch * 8), 1))), 1)
        add("pool", f"maxpool{n}", "max", 8, ch, hw)
        add("pool", f"avgpool{n}", "avg", 8, ch, hw)
    # BatchNorm: (N, C, H) with the zoo's CNN shapes (channels x spatial as ResNe(X)t / Inception have
    # them: a per-channel reduction's speed depends on the channel count, not on the bytes alone)
    if tiny:
        bn = [(2, 4, 8), (2, 8, 4), (4, 16, 8)]
    else:
        bn = [(n, c, h) for n in ((8, 64) if quick else (1, 8, 32, 64))
              for c, h in ((64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7))]
        bn += [] if quick else [(64, 32, 147), (64, 192, 71), (64, 288, 35), (64, 768, 17), (64, 2048, 8)]
    for n, c, h in bn:
        add("batchnorm", f"n{n}c{c}h{h}", n, c, h)
    # optimizer: (tensors, elements each)
    opt_sizes = [(4, 2 ** 6), (4, 2 ** 10)] if tiny else [(16, 2 ** k) for k in range(10, 22 if quick else 25, 2)]
    if size == "full":          # the zoo's largest weights (DLRM's 1M x 64 tables, MLP's 8192 x 8192): 64M elements
        opt_sizes += [(4, 2 ** 25), (4, 2 ** 26)]
    for k, s in opt_sizes:
        add("optimizer_sgd", f"{k}x{s}", k, s)
        add("optimizer_adam", f"{k}x{s}", k, s)
    return out


_OPT_STATES = {"optimizer_sgd": 0, "optimizer_adam": 2}     # search.cost.OPTIMIZER_STATES


def _shape(t):
    from unity_pcg.shape import ParallelTensorShape
    return ParallelTensorShape.of(tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""))


def _mode_key(cls: str, mode: str, out_dtype) -> str:
    """The ``/<mode>`` of a measured table (as ``CostModel.mode_of`` looks it up): the precision for
    compute classes; for memory-bound ones the dtype streamed (bf16 for 2-byte outputs, else fp32)."""
    if cls in COMPUTE_CLASSES:
        return mode
    return "bf16" if str(out_dtype).endswith(("bfloat16", "float16")) else "fp32"


def build_case(c: Case, device: str, mode: str) -> dict | None:
    """The callables of case ``c`` in ``mode`` and what they are recorded as: ``{"fwd", "bwd" (None where
    training runs no backward), "work": (forward work, backward work), "names": (forward table, backward
    table), "key_mode"}``; None when the case does not run in ``mode`` (a LayerNorm reading bf16: autocast
    runs it in fp32 after a cast, which the cost model prices apart).  Tensors are in the dtypes the
    kernel reads in a bf16 autocast step (matmul and convolution operands, weights included: bf16;
    element-wise and BatchNorm: bf16 activations; softmax and sum: bf16 in, fp32 out), so the casts
    autocast adds are left to the cost model's cast pricing.  Work: ``search.cost.kernel_work``."""
    import torch
    import torch.nn.functional as F

    from unity_pcg.search.cost import kernel_work
    low = mode == "bf16"
    adt = torch.bfloat16 if low else torch.float32
    p = c.params
    dev = torch.device(device)

    def act(*shape, dtype=adt):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(True)

    def param(*shape, dtype=torch.float32):
        return (torch.randn(*shape, device=dev, dtype=dtype) * 0.05).requires_grad_(True)

    def with_grad(f, operands, op, ins, names, flops=None, kind=None):
        y = f()
        outs = [y]
        holder = {"y": y, "g": torch.ones_like(y)}

        def bwd():
            torch.autograd.grad(holder["y"], operands, holder["g"], retain_graph=True)
        work = kernel_work(op, [_shape(t) for t in ins], [_shape(t) for t in outs], kind=kind, flops=flops)
        return {"fwd": f, "bwd": bwd, "work": work, "names": names, "key_mode": _mode_key(c.cls, mode, y.dtype),
                "graph": (holder["y"], list(operands), holder["g"])}

    if c.cls == "matmul":
        # a bias-free GEMM: cuBLAS picks other algorithms with a bias (measured on an H100: 263 vs 197 us
        # for 256x4192x4192 in fp32, either way round on other shapes); the cost model adds a Linear's bias
        # gradient as a reduction (CostModel.op_time)
        m, k, n = p
        x, w = act(m, k), param(n, k, dtype=adt)
        return with_grad(lambda: F.linear(x, w), [x, w], "Linear", [x, w.t()], ("matmul", "matmul_bwd"),
                         flops=2.0 * m * k * n, kind="matmul")
    if c.cls.startswith("conv"):
        b, ci, h, co, kk, s, g = p
        x, w = act(b, ci, h, h), param(co, ci // g, kk, kk, dtype=adt)
        ho = (h + 2 * (kk // 2) - kk) // s + 1
        return with_grad(lambda: F.conv2d(x, w, None, s, kk // 2, 1, g), [x, w], "Conv2d", [x, w],
                         (c.cls, f"{c.cls}_bwd"), flops=2.0 * b * co * ho * ho * (ci // g) * kk * kk, kind="conv")
    if c.cls == "bmm":
        b, m, k, n = p
        x, y = act(b, m, k), act(b, k, n)
        return with_grad(lambda: torch.bmm(x, y), [x, y], "BatchMatMul", [x, y], ("bmm", "bmm_bwd"),
                         flops=2.0 * b * m * k * n, kind="bmm")
    if c.cls == "embedding":
        r, d, n = p
        table = param(r, d)
        ids = torch.randint(0, r, (n,), device=dev)
        return with_grad(lambda: F.embedding(ids, table), [table], "Embedding", [ids, table],
                         ("embedding_fwd", "embedding_bwd"), kind="embedding")
    if c.cls == "elementwise":
        kind, n = p
        x, y = act(n), act(n)
        if kind == "relu":
            return with_grad(lambda: torch.relu(x), [x], "Relu", [x], ("elementwise", "elementwise_bwd"))
        return with_grad(lambda: x + y, [x, y], "Add", [x, y], ("elementwise", "elementwise_bwd"))
    if c.cls == "reduce":
        rows, cols = p
        x = act(rows, cols)
        return with_grad(lambda: x.sum(dim=-1, dtype=torch.float32), [x], "ReduceSum", [x], ("reduce", "reduce_bwd"))
    if c.cls == "softmax":
        rows, cols = p
        x = act(rows, cols)
        return with_grad(lambda: torch.softmax(x, dim=-1, dtype=torch.float32), [x], "Softmax", [x],
                         ("softmax", "softmax_bwd"))
    if c.cls == "norm":
        if len(p) == 2:
            if low:
                return None
            rows, cols = p
            x, w, b = act(rows, cols), param(cols), param(cols)
            return with_grad(lambda: F.layer_norm(x, (cols,), w, b), [x, w, b], "LayerNorm", [x, w, b],
                             ("norm", "norm_bwd"))
        raise CalibrationError(f"norm case {c.label}: (rows, cols) expected")
    if c.cls == "batchnorm":
        n, ch, hw = p
        x, w, b = act(n, ch, hw, hw), param(ch), param(ch)
        rm, rv = torch.zeros(ch, device=dev), torch.ones(ch, device=dev)
        return with_grad(lambda: F.batch_norm(x, rm, rv, w, b, training=True), [x, w, b], "BatchNorm",
                         [x, w, b, rm, rv], ("batchnorm", "batchnorm_bwd"))
    if c.cls == "pool":
        kind, n, ch, hw = p
        x = act(n, ch, hw, hw)
        f = (lambda: F.max_pool2d(x, 3, 1, 1)) if kind == "max" else (lambda: F.avg_pool2d(x, 3, 1, 1))
        return with_grad(f, [x], "Pool2d", [x], ("pool", "pool_bwd"))
    if c.cls.startswith("optimizer_"):
        k, s = p
        ps = [torch.nn.Parameter(torch.randn(s, device=dev)) for _ in range(k)]
        for q in ps:
            q.grad = torch.randn(s, device=dev) * 1e-3
        opt = (torch.optim.SGD(ps, lr=1e-6) if c.cls == "optimizer_sgd" else torch.optim.Adam(ps, lr=1e-6))
        moved = (3 + 2 * _OPT_STATES[c.cls]) * 4.0 * s      # bytes moved per tensor, as CostModel.update_time
        return {"fwd": opt.step, "bwd": None, "work": (moved, moved), "names": (c.cls, None), "key_mode": "fp32",
                "per_call": k}
    raise CalibrationError(f"unknown class {c.cls!r}")


# --- fits and tables ------------------------------------------------------------------------------------

def fit_affine(xs: Sequence[float], ts: Sequence[float]) -> dict:
    """Fit ``t = overhead + x / throughput`` to points ``(x, t)`` by least squares on the relative error
    ``(pred - t) / t`` (small and large sizes weigh alike), overhead and 1 / throughput >= 0.  Returns
    ``{"overhead": s, "throughput": work/s or None (no size dependence), "rel_rms": ...}``."""
    pts = [(float(x), float(t)) for x, t in zip(xs, ts) if t > 0 and math.isfinite(t)]
    if not pts:
        raise CalibrationError("fit_affine: no positive times")
    s11 = sum(1 / t ** 2 for x, t in pts)
    s12 = sum(x / t ** 2 for x, t in pts)
    s22 = sum(x * x / t ** 2 for x, t in pts)
    r1 = sum(1 / t for x, t in pts)
    r2 = sum(x / t for x, t in pts)
    det = s11 * s22 - s12 * s12
    a = b = -1.0
    if det > 1e-12 * max(s11 * s22, 1e-300):
        a = (r1 * s22 - r2 * s12) / det
        b = (s11 * r2 - s12 * r1) / det
    if a < 0 or b < 0 or not (math.isfinite(a) and math.isfinite(b)):
        # one of the two terms at its bound 0: the better of the two one-parameter fits
        cands = []
        if s22 > 0:
            cands.append((0.0, r2 / s22))
        cands.append((r1 / s11, 0.0))
        a, b = min(cands, key=lambda ab: sum(((ab[0] + ab[1] * x) / t - 1) ** 2 for x, t in pts))
    rms = math.sqrt(sum(((a + b * x) / t - 1) ** 2 for x, t in pts) / len(pts))
    return {"overhead": a, "throughput": (1.0 / b) if b > 0 else None, "rel_rms": rms, "points": len(pts)}


def fit_predict(fit: dict, x: float) -> float:
    thr = fit.get("throughput")
    return fit["overhead"] + (x / thr if thr else 0.0)


MERGE_WORK = 1.1      # make_table: points whose work is within this factor of a group's first are one point


def make_table(points: Iterable[tuple[float, float]]) -> list[list[float]]:
    """``[[work, seconds], ...]`` sorted by work: points of nearly equal work (within :data:`MERGE_WORK`)
    merged into one (mean work, mean time: kernels of one class and one size but different shapes, e.g. a
    7x7 stem convolution beside a 3x3 one, would otherwise make a near-vertical segment that the
    interpolation extrapolates from), then made non-decreasing by pool-adjacent-violators (least
    squares), so more work never costs less."""
    pts = sorted((float(x), float(t)) for x, t in points if t > 0 and math.isfinite(t) and x > 0)
    groups: list[list[tuple[float, float]]] = []
    for x, t in pts:
        if groups and x <= groups[-1][0][0] * MERGE_WORK:
            groups[-1].append((x, t))
        else:
            groups.append([(x, t)])
    by: dict[float, list[float]] = {}
    for grp in groups:
        by[sum(x for x, _ in grp) / len(grp)] = [t for _, t in grp]
    xs = sorted(by)
    blocks: list[list[float]] = []          # [sum of t, count, first index, last index]
    for i, x in enumerate(xs):
        ts = by[x]
        blocks.append([sum(ts), len(ts), i, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n, _, j = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][3] = j
    out = []
    for s, n, i, j in blocks:
        for k in range(i, j + 1):
            out.append([xs[k], s / n])
    return out


# --- measuring ------------------------------------------------------------------------------------------

def backward_copies(forward_s: float) -> int:
    """Independent copies of a kernel whose backwards run in one ``autograd.grad`` call (see
    :func:`joint_backward`): many for short kernels, whose time one call's engine start would dominate."""
    return 16 if forward_s < 5e-5 else 4 if forward_s < 5e-4 else 1


def joint_backward(built: list[dict]) -> Callable[[], Any]:
    """One ``torch.autograd.grad`` call over the kept graphs of several independent copies of a case
    (``build_case`` results): as in a training step's backward pass, the engine starts once for many
    nodes, so a short kernel is not charged a whole call's start; the time is divided by the copies."""
    import torch
    ys = [b["graph"][0] for b in built]
    ins = [t for b in built for t in b["graph"][1]]
    gs = [b["graph"][2] for b in built]

    def bwd():
        torch.autograd.grad(ys, ins, gs, retain_graph=True)
    return bwd


def measure_cases(device: str, modes: Sequence[str], size: str = "full", timer: Timer | None = None,
                  classes: Sequence[str] | None = None, warmup: int = 3, reps: int = 7,
                  quiet: bool = False) -> list[dict]:
    """Time every case of ``cases(size)`` (of ``classes``, default all) in each of ``modes`` where the
    class runs in it (:func:`case_modes`): rows ``{"class", "label", "mode", "key_mode", "names", "work",
    "fwd", "bwd"}`` (seconds; ``bwd`` None where no backward; the optimizer's ``fwd`` is per tensor).
    ``timer`` defaults to :func:`make_timer` for ``device`` (tests pass a fake one)."""
    import torch
    timer = timer or make_timer(device)
    rows: list[dict] = []
    todo = [c for c in cases(size) if classes is None or c.cls in classes]
    cuda = str(device).startswith("cuda")
    oom = (torch.cuda.OutOfMemoryError, MemoryError) if cuda else (MemoryError,)
    for mode in modes:
        t0 = time.perf_counter()
        n0 = len(rows)
        with math_mode(mode, device):
            for c in todo:
                if mode not in case_modes(c.cls, modes):
                    continue
                try:
                    b = build_case(c, device, mode)
                    if b is None:
                        continue
                    tf = timer(b["fwd"], warmup, reps) / b.get("per_call", 1)
                    tb = None
                    if b["bwd"] is not None:
                        k = backward_copies(tf)
                        if k > 1 and "graph" in b:
                            tb = timer(joint_backward([b] + [build_case(c, device, mode) for _ in range(k - 1)]),
                                       warmup, reps) / k
                        else:
                            tb = timer(b["bwd"], warmup, reps)
                except oom:
                    _say(f"  {mode} {c.cls} {c.label}: out of memory, skipped", quiet)
                    b = None
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                rows.append({"class": c.cls, "label": c.label, "mode": mode, "key_mode": b["key_mode"],
                             "names": list(b["names"]), "work": list(b["work"]), "fwd": tf, "bwd": tb})
                b = None
            if cuda:
                torch.cuda.empty_cache()
        _say(f"{mode}: {len(rows) - n0} kernels timed in {time.perf_counter() - t0:.1f} s", quiet)
    return rows


def fit_rows(rows: list[dict]) -> tuple[dict, dict]:
    """Fits ``{"<table>/<mode>": fit_affine(...)}`` and tables ``{same key: make_table(...)}`` of measured
    rows; the optimizers' points also go to one ``optimizer/fp32`` table (work: bytes moved)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        fname, bname = r["names"]
        groups.setdefault(f"{fname}/{r['key_mode']}", []).append((r["work"][0], r["fwd"]))
        if fname.startswith("optimizer_"):
            groups.setdefault(f"optimizer/{r['key_mode']}", []).append((r["work"][0], r["fwd"]))
        if r.get("bwd") is not None and bname:
            groups.setdefault(f"{bname}/{r['key_mode']}", []).append((r["work"][1], r["bwd"]))
    fits, tables = {}, {}
    for key, pts in sorted(groups.items()):
        fits[key] = fit_affine([x for x, _ in pts], [t for _, t in pts])
        tables[key] = make_table(pts)
    return fits, tables


# --- collectives ----------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list, reps: int, q) -> None:
    import torch
    import torch.distributed as dist
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res: dict = {k: {} for k in COLLECTIVES}
        for n in sizes:
            n = max(world, n - n % world)
            full = torch.ones(n, device=dev)
            shard = torch.ones(n // world, device=dev)
            ops = {"all_reduce": lambda: dist.all_reduce(full),
                   "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
                   "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
            for name, fn in ops.items():
                for _ in range(2):
                    fn()
                ts = []
                for _ in range(reps):
                    dist.barrier()
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    if cuda:
                        torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                res[name][n] = statistics.median(ts)
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, backend: str = "nccl", sizes: Sequence[int] | None = None,
                        reps: int = 10, timeout: float = 600) -> dict:
    """Median seconds of all-reduce, all-gather and reduce-scatter of ``n`` float32 elements (the full
    tensor) over ``world`` processes (one per GPU with ``nccl``; ``gloo`` on a CPU for tests), the
    slowest rank per size: ``{collective: {n: seconds}}``."""
    import torch.multiprocessing as mp
    sizes = list(sizes or [2 ** k for k in range(10, 29, 2)])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, world, port, backend, sizes, reps, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=timeout)[1] for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return {k: {n: max(g[k][n] for g in got) for n in got[0][k]} for k in COLLECTIVES}


def fit_collective(kind: str, world: int, res: dict) -> dict:
    """Ring-model fit of one collective's sweep ``{elements: seconds}``: all-reduce
    ``2(p-1) alpha + 2(p-1)/p * 4n / beta``, all-gather / reduce-scatter ``(p-1) alpha + (p-1)/p * 4n / beta``.
    Returns ``{"latency": alpha, "bandwidth": beta, "rel_rms", "measured"}``."""
    p = world
    k = 2 if kind == "all_reduce" else 1
    steps = k * (p - 1)
    xs = [k * (p - 1) / p * 4 * n for n in res]        # bytes each device sends
    fit = fit_affine(xs, list(res.values()))
    # t = overhead + x / throughput: alpha = overhead / steps, beta = throughput
    lat = fit["overhead"] / steps
    bw = fit["throughput"]
    return {"latency": lat, "bandwidth": bw, "rel_rms": fit["rel_rms"],
            "measured": {str(n): t for n, t in sorted(res.items())}}


# --- the machine file -----------------------------------------------------------------------------------

def base_preset(device_name: str) -> str:
    """The preset describing a GPU of this name (its topology, network link and uncalibrated defaults)."""
    n = device_name.upper()
    if "A100" in n:
        return "dgx-a100"
    if "V100" in n:
        return "summit"
    return "h100"


def _overhead_key(table: str) -> str | None:
    """The ``DeviceSpec.overheads`` key of a table's fitted fixed cost: ``matmul``, ``matmul:bwd``,
    ``embedding`` / ``embedding:bwd``; None for the optimizer (``update_overhead``)."""
    if table.startswith("optimizer"):
        return None
    if table == "embedding_fwd":
        return "embedding"
    if table == "embedding_bwd":
        return "embedding:bwd"
    if table.endswith("_bwd"):
        return table[:-4] + ":bwd"
    return table


def machine_json(base: dict, fits: dict, tables: dict, modes: Sequence[str], memory_bytes: int | None,
                 links: dict | None, meta: dict, rows: Sequence[dict] | None = None) -> dict:
    """The machine JSON: ``base`` (a preset's ``to_json()``) with the measured device fields: peaks per
    mode (the fastest rate a compute class's forward reached), efficiencies per class
    (``"<class>"`` in fp32, ``"<class>/<mode>"`` for the others: fitted throughput / the mode's peak),
    memory bandwidth (element-wise fp32), fixed costs per class and direction (fp32 fits), Adam's
    per-tensor cost as ``update_overhead``, the tables, and the capacity."""
    out = dict(base)
    dev = dict(out["device"])
    peaks = dict(dev.get("peaks") or {})
    peaks.setdefault("fp32", dev["peak_flops"])
    eff = dict(dev.get("efficiency") or {})
    for mode in modes:
        # the peak: the best rate any compute kernel reached (measured, never a fit's extrapolation): from
        # the measured rows where given (a table merges kernels of nearly equal work)
        if rows is not None:
            rates = [r["work"][0] / r["fwd"] for r in rows
                     if r["class"] in COMPUTE_CLASSES and r["key_mode"] == mode and r["fwd"] > 0]
        else:
            rates = [w / t for c in COMPUTE_CLASSES for w, t in tables.get(f"{c}/{mode}", ()) if t > 0]
        thr = {c: fits[f"{c}/{mode}"]["throughput"] for c in COMPUTE_CLASSES
               if f"{c}/{mode}" in fits and fits[f"{c}/{mode}"]["throughput"]}
        if not rates:
            continue
        peaks[mode] = max(rates)
        for c, v in thr.items():
            eff[c if mode == "fp32" else f"{c}/{mode}"] = min(1.0, v / peaks[mode])
    dev["peak_flops"] = peaks["fp32"]
    dev["peaks"] = peaks
    dev["efficiency"] = eff
    ew = fits.get("elementwise/fp32")
    if ew and ew["throughput"]:
        dev["mem_bandwidth"] = ew["throughput"]
    over = dict(dev.get("overheads") or {})
    fwd = []
    for key, f in fits.items():
        table, mode = key.rsplit("/", 1)
        k = _overhead_key(table)
        if mode == "fp32" and k is not None:
            over[k] = f["overhead"]
            if ":" not in k:
                fwd.append(f["overhead"])
    dev["overheads"] = over
    if fwd:
        dev["op_overhead"] = statistics.median(fwd)
    if "optimizer_adam/fp32" in fits:
        dev["update_overhead"] = fits["optimizer_adam/fp32"]["overhead"]
    if memory_bytes:
        dev["memory_bytes"] = int(memory_bytes)
    dev["kernel_tables"] = tables
    out["device"] = dev
    if links:
        lk = dict(out["links"])
        lk.update(links)
        out["links"] = lk
    m = dict(out.get("meta") or {})
    m.update(meta)
    out["meta"] = m
    return out


def calibrate_device(device: str = "cuda", precision: str | None = None, size: str = "full",
                     base: str | None = None, timer: Timer | None = None, collectives: bool | None = None,
                     quiet: bool = False) -> dict:
    """Measure ``device`` (``cuda`` or ``cpu``) and return its machine JSON (a dict; ``MachineSpec.from_json``
    loads it).  ``precision``: measure fp32 and that math mode (default: every mode of :data:`MODES`); a mode
    not measured keeps the base preset's peak.
    ``collectives``: measure NCCL collectives (default: when more than one GPU is present)."""
    import torch

    from unity_pcg.machine import PRESETS
    t_start = time.perf_counter()
    if precision is not None and precision not in MODES:
        raise CalibrationError(f"unknown precision {precision!r} (known: {', '.join(MODES)})")
    # fp32 always: the memory-bound classes, the embedding and the optimizer run in fp32 in every precision
    modes = tuple(MODES) if precision is None else tuple(dict.fromkeys(("fp32", precision)))
    cuda = str(device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise CalibrationError("calibrate --device cuda: no CUDA device is available "
                               f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA)")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name = props.name
        free, total = torch.cuda.mem_get_info()
        count = torch.cuda.device_count()
        info = {"device_name": name, "device_count": count, "memory_free": int(free), "memory_total": int(total),
                "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(0))}
        if "bf16" in modes and not torch.cuda.is_bf16_supported():
            raise CalibrationError(f"calibrate --precision bf16: {name} has no bfloat16 support")
    else:
        name, count, total = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", 1, None
        info = {"device_name": name, "device_count": 1, "threads": torch.get_num_threads()}
    base = base or (base_preset(name) if cuda else "local")
    if base not in PRESETS:
        raise CalibrationError(f"unknown base preset {base!r} (presets: {', '.join(PRESETS)})")
    fn, dpn = PRESETS[base]
    per_node = max(count, 1)
    if dpn is not None:
        per_node = min(per_node, dpn)
    bm = fn(1, per_node) if base != "local" else fn(1, 1)
    _say(f"{name}: {len(cases(size))} kernels x {len(modes)} math mode(s) ({', '.join(modes)}), base preset {base}",
         quiet)
    rows = measure_cases(device, modes, size, timer=timer, quiet=quiet)
    fits, tables = fit_rows(rows)
    for key in sorted(fits):
        f = fits[key]
        if key.endswith("/fp32"):
            thr = f["throughput"]
            unit = "FLOP/s" if key.split("/")[0].replace("_bwd", "") in COMPUTE_CLASSES else "B/s"
            _say(f"  {key:28s} overhead {f['overhead'] * 1e6:8.1f} us, throughput "
                 f"{(thr or 0) / 1e12:8.3f} T{unit}, rms {f['rel_rms'] * 100:4.1f}%", quiet)
    links = None
    coll = {}
    if collectives is None:
        collectives = cuda and count > 1
    if collectives:
        world = count if cuda else 2
        _say(f"collectives over {world} {'GPUs (NCCL)' if cuda else 'processes (gloo)'} ...", quiet)
        sizes = [2 ** k for k in range(10, 29 if size == "full" else 23, 2)] if size != "tiny" else [256, 4096]
        res = measure_collectives(world, "nccl" if cuda else "gloo", sizes, reps=10 if size != "tiny" else 3)
        coll = {k: fit_collective(k, world, v) for k, v in res.items()}
        ar = coll["all_reduce"]
        if ar["bandwidth"]:
            lk = {"bandwidth": ar["bandwidth"], "latency": ar["latency"]}
            links = {"group": lk, "node": dict(lk)}
            _say(f"  all-reduce: latency {ar['latency'] * 1e6:.1f} us, bandwidth {ar['bandwidth'] / 1e9:.1f} GB/s",
                 quiet)
    meta = {"calibrated": True, "gpu_calibration": {
        **info, "device": str(device), "modes": list(modes), "size": size, "base": base,
        "torch": torch.__version__, "host": socket.gethostname(), "fits": fits, "measured": rows,
        "collectives": coll, "seconds": time.perf_counter() - t_start,
        "network_link": "from the base preset (not measured)"}}
    out = machine_json(bm.to_json(), fits, tables, modes, total, links, meta, rows=rows)
    out["name"] = f"{base}-calibrated" if cuda else "cpu-calibrated"
    _say(f"done in {time.perf_counter() - t_start:.1f} s", quiet)
    return out


__all__ = ["MODES", "CLASSES", "COMPUTE_CLASSES", "MEMORY_CLASSES", "OPTIMIZER_CLASSES", "Case", "cases",
           "case_modes", "build_case", "backward_copies", "joint_backward", "make_timer", "math_mode", "tf32_enabled",
           "fit_affine", "fit_predict", "make_table", "measure_cases", "fit_rows", "measure_collectives",
           "fit_collective", "machine_json", "calibrate_device", "base_preset", "CalibrationError"]
