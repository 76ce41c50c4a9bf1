"""``import --check``: does the imported PCG compute what the ONNX model computes?

The PCG is evaluated with numpy (:func:`unity_pcg.evaluate.evaluate`, logical mode) and the ONNX file with
onnxruntime (CPU, graph optimizations off, so it runs the graph as written) on the same seeded random inputs:

* float inputs: standard normal;
* integer inputs that index a table (an ONNX ``Gather``/``GatherElements`` reads them as indices, possibly
  through Cast/Reshape/Unsqueeze/... views): uniform in ``[0, rows)`` where ``rows`` is the smallest indexed
  dimension among those tables (token ids within the vocabulary, token types within their table);
* other integer inputs and booleans (attention masks): 0/1.

With a batch override (``--batch N``) onnxruntime runs the file with its inputs set to batch N; where the file
fixes its exported batch B in its graph so that onnxruntime cannot, the reference is the file at batch B run on the
N samples in chunks of B (inference-mode models do not mix samples; an output that does not lead with the batch
leaves no reference: a one-line error).

Every output is compared elementwise with the tolerance scaled for the model's depth::

    |pcg - ort| <= f * (atol * max|ort| + rtol * |ort|),   f = sqrt(max(1, depth))

where ``depth`` is the number of compute operators on the longest input-to-output path of the PCG and
``max|ort|`` is the output's largest magnitude (float32 sums are evaluated in different orders by numpy and
onnxruntime; rounding errors grow like the square root of the number of rounded steps, and elements that
cancel to ~0 need an absolute floor in the unit of the tensor).  Integer and boolean outputs must be equal.

Random operators are compared with their randomness switched off on both sides (never by a looser
tolerance): onnxruntime runs a copy of the file rewritten by :func:`derandomize`, the PCG is evaluated with the
same stand-ins (``evaluate(..., random="standin")``, :data:`unity_pcg.evaluate.RANDOM_OPS`; ``*Like`` generators
are imported as RandomNormal/RandomUniform of the input's shape, Bernoulli(p) as ``RandomUniform <= p``).  The stand-ins
(:data:`RANDOM_STANDINS`): Dropout in training mode (a ``training_mode`` input that is true or not a constant;
``is_test=0`` before opset 7) runs as in inference (the data unchanged, the mask all true); RandomNormal(Like)
gives its ``mean``; RandomUniform(Like) gives ``(low + high) / 2``; Bernoulli gives its most likely value,
1 where ``p >= 0.5`` else 0; Multinomial gives its most likely class, the row's argmax (first on ties), in every
sample.  The result says what was switched off (:attr:`CheckResult.randomness`); a model without random
operators is run as it is.

Errors (no onnxruntime, a model onnxruntime refuses, a PCG whose evaluation fails) are one-line
:class:`CheckError` s.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelImportError, UnityError

RTOL = 1e-4
ATOL = 1e-5

# ONNX ops an integer index tensor may pass through unchanged in value before it is used as an index
_VIEW_OPS = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Slice", "Transpose",
             "Tile", "Concat", "Gather", "Split"}
# ONNX ops whose input 1 is an index tensor into input 0 along ``axis``
_INDEX_OPS = {"Gather": 0, "GatherElements": 0}


_INT_TYPES = (2, 3, 4, 5, 6, 7, 12, 13)   # ONNX integer element types
_PROTO_LIMIT = 2**31 - 2**24                # a ModelProto larger than this cannot be serialized in one piece


class CheckError(ModelImportError):
    """``--check`` could not run (onnxruntime missing or refusing the model, PCG evaluation failed)."""


@dataclass(frozen=True)
class OutputCheck:
    """One graph output: its name, shape, the errors and the tolerance it was judged by."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float       # max |pcg - ort| / (|ort| + atol * max|ort|)
    ratio: float         # max |pcg - ort| / tolerance; <= 1 is equal
    ok: bool
    why: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @staticmethod
    def from_json(d: dict) -> "OutputCheck":
        return OutputCheck(**{**d, "shape": tuple(d["shape"])})


@dataclass(frozen=True)
class CheckResult:
    """The verdict over every output, with what it was judged by."""
    ok: bool
    outputs: tuple[OutputCheck, ...]
    depth: int
    factor: float
    rtol: float
    atol: float
    seed: int
    int_bounds: dict = field(default_factory=dict)   # integer input -> exclusive upper bound of its values
    eval_seconds: float = 0.0
    ort_seconds: float = 0.0
    reference: str = "onnxruntime"   # what was compared with (see check_model's batch handling)
    # random operators switched off (see the module docstring): ONNX operator (label) -> count rewritten in
    # onnxruntime's copy of the file, PCG operator -> count whose numpy reference is the stand-in, and the line
    # that says so ("" when the file has no random operator)
    derandomized: dict = field(default_factory=dict)
    pcg_random: dict = field(default_factory=dict)
    randomness: str = ""

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    def to_json(self) -> dict:
        d = asdict(self)
        d["outputs"] = [o.to_json() for o in self.outputs]
        d["max_abs"] = self.max_abs
        d["max_rel"] = self.max_rel
        return d

    @staticmethod
    def from_json(d: dict) -> "CheckResult":
        keys = {f for f in CheckResult.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in keys}
        d["outputs"] = tuple(OutputCheck.from_json(o) for o in d["outputs"])
        return CheckResult(**d)


def depth(g) -> int:
    """Compute operators on the longest source-to-output path of ``g`` (parallel operators count 0)."""
    best: dict[int, int] = {}
    for nid in g.topo_order():
        n = g.node(nid)
        d = max((best[r[0]] for r in n.inputs), default=0)
        best[nid] = d + (1 if n.kind == "compute" else 0)
    return max((best[r[0]] for r in g.outputs), default=0)


def tolerance_factor(d: int) -> float:
    return math.sqrt(max(1, d))


def int_bounds(model) -> dict[str, int]:
    """Exclusive upper bound for each integer graph input: the rows of the smallest table it indexes
    (through value-preserving views), else 2 (a mask)."""
    import onnx

    g = model.graph
    inits = {t.name for t in g.initializer}
    int_inputs = [vi for vi in g.input if vi.name not in inits and vi.type.HasField("tensor_type")
                  and vi.type.tensor_type.elem_type in _INT_TYPES]
    if not int_inputs:
        return {}
    shapes: dict[str, tuple] = {t.name: tuple(t.dims) for t in g.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim)
                shapes.setdefault(vi.name, dims)
    except Exception:   # shape inference is only a help here: initializer and Constant shapes still work
        pass
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value":
                    shapes.setdefault(n.output[0], tuple(a.t.dims))
    users: dict[str, list] = {}
    for n in g.node:
        for k, x in enumerate(n.input):
            if x:
                users.setdefault(x, []).append((n, k))
    out: dict[str, int] = {}
    for vi in int_inputs:
        bounds = []
        seen, stack = set(), [vi.name]
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            for n, k in users.get(t, ()):
                if n.op_type in _INDEX_OPS and k == 1:
                    axis = next((int(a.i) for a in n.attribute if a.name == "axis"), 0)
                    s = shapes.get(n.input[0])
                    if s and -len(s) <= axis < len(s) and s[axis] > 0:
                        bounds.append(int(s[axis]))
                elif n.op_type in _VIEW_OPS and (k == 0 or n.op_type == "Concat"):
                    stack.extend(o for o in n.output if o)
        out[vi.name] = min(bounds) if bounds else 2
    return out


def random_inputs(g, bounds: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Seeded values for every Input of the PCG ``g`` (shapes after any batch override)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in g.sources("Input"):
        a = n.a
        shape = tuple(a["shape"])
        if a["dtype"] == "bool":
            feeds[a["name"]] = rng.random(shape) < 0.5
        elif a["dtype"].startswith("int") or a["dtype"].startswith("uint"):
            feeds[a["name"]] = rng.integers(0, max(1, bounds.get(a["name"], 2)), shape).astype(a["dtype"])
        else:
            feeds[a["name"]] = rng.standard_normal(shape).astype(a["dtype"])
    return feeds


#: random ONNX operators -> the deterministic stand-in ``--check`` computes instead, on both sides
RANDOM_STANDINS = {
    "Dropout": "identity",
    "RandomNormal": "its mean",
    "RandomNormalLike": "its mean",
    "RandomUniform": "(low + high) / 2",
    "RandomUniformLike": "(low + high) / 2",
    "Bernoulli": "1 where p >= 0.5 else 0",
    "Multinomial": "the argmax class",
}
_DROPOUT_TRAINING = "Dropout (training mode)"


def _const_values(g) -> dict:
    """Tensor name -> numpy value of the graph's initializers and Constant nodes (``value`` only)."""
    from onnx import numpy_helper
    vals = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value":
                    vals[n.output[0]] = a.t
    out = {}
    for k, t in vals.items():
        if len(t.dims) <= 1 and all(d <= 1 for d in t.dims):   # scalars only: never read a big external tensor
            try:
                out[k] = numpy_helper.to_array(t)
            except Exception:  # noqa: BLE001 -- unreadable: treated as not constant
                pass
    return out


def _dropout_in_training(n, opset: int, consts: dict) -> bool:
    """Whether Dropout ``n`` drops at random under onnxruntime: its ``training_mode`` input is true or not a
    constant (opset >= 12), or ``is_test`` is 0 (opsets before 7)."""
    if opset >= 12:
        if len(n.input) < 3 or not n.input[2]:
            return False
        v = consts.get(n.input[2])
        return v is None or bool(np.asarray(v).reshape(-1)[:1].any())
    if opset < 7:
        return not any(a.name == "is_test" and a.i for a in n.attribute)
    return False


def derandomize(model):
    """``(copy, counts)``: a copy of ``model`` whose random operators compute :data:`RANDOM_STANDINS` instead
    (outputs keep their names), and how many of each were replaced (label -> count); ``(model, {})`` itself when
    it has none.  Only the main graph is rewritten (the importer refuses control flow on activations)."""
    import onnx
    from onnx import helper, numpy_helper

    g = model.graph
    opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    consts = _const_values(g)
    todo = [k for k, n in enumerate(g.node) if n.domain in ("", "ai.onnx") and (
        n.op_type in RANDOM_STANDINS and n.op_type != "Dropout"
        or n.op_type == "Dropout" and _dropout_in_training(n, opset, consts))]
    if not todo:
        return model, {}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    taken = {x for n in g.node for x in list(n.input) + list(n.output)} | {t.name for t in g.initializer} \
        | {v.name for v in g.input}
    elem: dict | None = None

    def fresh(base: str) -> str:
        k = 0
        while f"{base}__derandomized{k}" in taken:
            k += 1
        name = f"{base}__derandomized{k}"
        taken.add(name)
        return name

    def elem_type(x: str) -> int:
        nonlocal elem
        if elem is None:
            elem = {t.name: t.data_type for t in g.initializer}
            for vi in list(g.input) + list(g.output) + list(g.value_info):
                if vi.type.HasField("tensor_type"):
                    elem[vi.name] = vi.type.tensor_type.elem_type
            try:
                shallow = onnx.ModelProto()                # types only: the graph without its weights
                shallow.ir_version = model.ir_version
                shallow.opset_import.extend(model.opset_import)
                for part in ("node", "input", "output", "value_info"):
                    getattr(shallow.graph, part).extend(getattr(model.graph, part))
                for t in model.graph.initializer:
                    shallow.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
                inf = onnx.shape_inference.infer_shapes(shallow, strict_mode=False)
                for vi in list(inf.graph.value_info) + list(inf.graph.output) + list(inf.graph.input):
                    if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                        elem.setdefault(vi.name, vi.type.tensor_type.elem_type)
            except Exception:  # noqa: BLE001 -- inference is a help only: float below
                pass
        return int(elem.get(x) or onnx.TensorProto.FLOAT)

    def attr(n, key, default):
        for a in n.attribute:
            if a.name == key:
                return helper.get_attribute_value(a)
        return default

    def scalar(v: float, dt: int, name: str):
        return numpy_helper.from_array(np.array([v], dtype=onnx.helper.tensor_dtype_to_np_dtype(dt)), name)

    counts: dict[str, int] = {}
    new_nodes = []
    todo_set = set(todo)
    for k, n in enumerate(g.node):
        if k not in todo_set:
            new_nodes.append(n)
            continue
        op, nm = n.op_type, n.name or n.output[0]
        if op == "Dropout":
            d = onnx.NodeProto()
            d.CopyFrom(n)
            if opset >= 12:
                del d.input[2:]          # no training_mode: inference (the data as it is, the mask all true)
            else:
                for a in d.attribute:
                    if a.name == "is_test":
                        a.i = 1
                if not any(a.name == "is_test" for a in d.attribute):
                    d.attribute.append(helper.make_attribute("is_test", 1))
            new_nodes.append(d)
            counts[_DROPOUT_TRAINING] = counts.get(_DROPOUT_TRAINING, 0) + 1
            continue
        y = n.output[0]
        if op in ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"):
            if op.startswith("RandomNormal"):
                v = float(attr(n, "mean", 0.0))
            else:
                v = (float(attr(n, "low", 0.0)) + float(attr(n, "high", 1.0))) / 2
            if op.endswith("Like"):
                dt = int(attr(n, "dtype", 0)) or elem_type(n.input[0])
                shape = fresh(y)
                new_nodes.append(helper.make_node("Shape", [n.input[0]], [shape], name=fresh(nm)))
            else:
                dt = int(attr(n, "dtype", onnx.TensorProto.FLOAT))
                shape = fresh(y)
                dims = np.asarray(list(attr(n, "shape", [])), dtype=np.int64)
                new_nodes.append(helper.make_node("Constant", [], [shape], name=fresh(nm),
                                                  value=numpy_helper.from_array(dims, shape)))
            new_nodes.append(helper.make_node("ConstantOfShape", [shape], [y], name=fresh(nm),
                                              value=scalar(v, dt, "value")))
        elif op == "Bernoulli":
            p = n.input[0]
            pt = elem_type(p)
            half, ge = fresh(y), fresh(y)
            new_nodes += [helper.make_node("Constant", [], [half], name=fresh(nm), value=scalar(0.5, pt, half)),
                          helper.make_node("GreaterOrEqual", [p, half], [ge], name=fresh(nm)),
                          helper.make_node("Cast", [ge], [y], name=fresh(nm), to=int(attr(n, "dtype", 0)) or pt)]
        else:   # Multinomial: [batch, classes] -> [batch, sample_size] of the argmax class
            am, reps, tiled = fresh(y), fresh(y), fresh(y)
            size = int(attr(n, "sample_size", 1))
            new_nodes += [helper.make_node("ArgMax", [n.input[0]], [am], name=fresh(nm), axis=1, keepdims=1),
                          helper.make_node("Constant", [], [reps], name=fresh(nm),
                                           value=numpy_helper.from_array(np.array([1, size], np.int64), reps)),
                          helper.make_node("Tile", [am, reps], [tiled], name=fresh(nm)),
                          helper.make_node("Cast", [tiled], [y], name=fresh(nm),
                                           to=int(attr(n, "dtype", onnx.TensorProto.INT32)))]
        counts[op] = counts.get(op, 0) + 1
    del g.node[:]
    g.node.extend(new_nodes)
    return m, counts


def randomness_line(onnx_counts: dict, pcg_counts: dict) -> str:
    """The one line saying what was switched off ("" when nothing was)."""
    if not onnx_counts:
        return ""
    what = ", ".join(f"{n} {k} as {RANDOM_STANDINS[k.split()[0]]}" for k, n in onnx_counts.items())
    pcg = ", ".join(f"{n} {k}" for k, n in pcg_counts.items()) or "no random operator"
    return (f"randomness switched off on both sides: onnxruntime runs {what}; the PCG ({pcg}) is evaluated "
            f"with the same stand-ins")


def _with_batch(model, batch: int):
    """A copy of ``model`` whose graph inputs have first dim ``batch`` (output/value_info shapes cleared,
    so onnxruntime infers them again)."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name for t in m.graph.initializer}
    for vi in m.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_value = batch
    del m.graph.value_info[:]
    for vo in m.graph.output:
        if vo.type.HasField("tensor_type"):
            vo.type.tensor_type.ClearField("shape")
    return m


def run_onnxruntime(src, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every graph output of ``src`` (a path or ModelProto) under onnxruntime's CPU provider."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise CheckError("--check needs onnxruntime (pip install onnxruntime)") from None
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    import tempfile
    with tempfile.TemporaryDirectory(prefix="unity-pcg-check-") as tmp:
        if isinstance(src, (str, os.PathLike)):
            data: Any = os.fspath(src)
        elif src.ByteSize() < _PROTO_LIMIT:
            data = src.SerializeToString()
        else:   # a rewritten copy of a model beyond protobuf's 2 GiB: through a file with external data
            import onnx
            data = os.path.join(tmp, "model.onnx")
            big = onnx.ModelProto()
            big.CopyFrom(src)      # onnx.save moves the tensors out of the proto it is given: keep src whole
            try:
                onnx.save(big, data, save_as_external_data=True, location="model.data")
            except OSError as e:
                raise CheckError(f"cannot write a temporary copy of the model for onnxruntime: {e.strerror}") \
                    from None
        try:
            s = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise CheckError(f"onnxruntime cannot load the model: {_first_line(e)}") from None
    names = {i.name for i in s.get_inputs()}
    try:
        return [np.asarray(v) for v in s.run(None, {k: v for k, v in feeds.items() if k in names})]
    except Exception as e:
        raise CheckError(f"onnxruntime cannot run the model on the check's inputs: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    s = msg[0] if msg else type(e).__name__
    return s if len(s) <= 300 else s[:297] + "..."


def compare(name: str, ours: np.ndarray, ref: np.ndarray, factor: float, rtol: float = RTOL,
            atol: float = ATOL) -> OutputCheck:
    """One output against onnxruntime's (see the module docstring for the tolerance)."""
    a, b = np.asarray(ours), np.asarray(ref)
    dt = str(b.dtype)
    if a.shape != b.shape:
        return OutputCheck(name, tuple(b.shape), dt, math.inf, math.inf, math.inf, False,
                           f"shape {list(a.shape)} != onnxruntime's {list(b.shape)}")
    if b.size == 0:
        return OutputCheck(name, tuple(b.shape), dt, 0.0, 0.0, 0.0, True)
    exact = b.dtype.kind in "biu" or b.dtype == object
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    if (nan_a != nan_b).any():
        k = int(np.argmax(nan_a != nan_b))
        return OutputCheck(name, tuple(b.shape), dt, math.inf, math.inf, math.inf, False,
                           f"NaN where the other has a number (flat index {k})")
    both = nan_a & nan_b
    same_inf = np.isinf(b64) & (a64 == b64)
    diff = np.where(both | same_inf, 0.0, np.abs(a64 - b64))
    finite_b = np.where(np.isfinite(b64), np.abs(b64), 0.0)
    scale = float(finite_b.max())
    max_abs = float(diff.max())
    max_rel = float((diff / (finite_b + max(atol * scale, np.finfo(np.float64).tiny))).max())
    if exact:
        return OutputCheck(name, tuple(b.shape), dt, max_abs, max_rel, math.inf if max_abs else 0.0,
                           max_abs == 0.0, "" if max_abs == 0.0 else "integer/boolean values differ")
    tol = factor * (atol * scale + rtol * finite_b)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(diff == 0, 0.0, diff / np.where(tol > 0, tol, np.finfo(np.float64).tiny))
    ratio = float(r.max())
    ok = bool(ratio <= 1.0) and math.isfinite(max_abs)
    why = "" if ok else f"max |error| {max_abs:.3g} exceeds the tolerance {ratio:.3g}x"
    return OutputCheck(name, tuple(b.shape), dt, max_abs, max_rel, ratio, ok, why)


def check_model(src: Any, batch: int | None = None, seed: int = 0, rtol: float = RTOL, atol: float = ATOL,
                graph=None) -> CheckResult:
    """Import ``src`` (path, bytes or ModelProto) and compare the PCG's outputs with onnxruntime's.

    ``graph``: an already imported PCG of ``src`` (with weights) to check instead of importing again.
    """
    import time

    import onnx

    from ..evaluate import evaluate, random_ops
    from . import load_onnx
    from .loader import read_model

    model, _ = read_model(src)
    path = src if isinstance(src, (str, os.PathLike)) else None
    if path is not None and any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        try:
            model = onnx.load(os.fspath(path))
        except Exception as e:
            raise CheckError(f"cannot read the model's external data: {_first_line(e)}") from None
    g = graph if graph is not None else load_onnx(model if path is None else path, batch=batch)
    bounds = int_bounds(model)
    feeds = random_inputs(g, bounds, seed)
    d = depth(g)
    f = tolerance_factor(d)
    t0 = time.perf_counter()
    try:
        ours = evaluate(g, feeds, random="standin")
    except UnityError as e:
        raise CheckError(f"evaluating the imported PCG failed: {e}") from None
    except (ValueError, TypeError, IndexError, KeyError, ArithmeticError, MemoryError) as e:
        raise CheckError(f"evaluating the imported PCG failed ({type(e).__name__}: {_first_line(e)})") from None
    t1 = time.perf_counter()
    # random operators: onnxruntime runs a copy of the file with their stand-ins (the PCG's numpy reference
    # computes the same ones), else the file itself
    ort_model, derandomized = derandomize(model)
    pcg_random = random_ops(g) if derandomized else {}
    base: Any = ort_model if derandomized or path is None else path
    ort_src: Any = base
    rebatched = batch is not None and _needs_batch_change(model, batch)
    if rebatched:
        ort_src = _with_batch(ort_model, batch)
    reference = "onnxruntime"
    try:
        ref = run_onnxruntime(ort_src, feeds)
        if rebatched:
            reference = f"onnxruntime on the file with its inputs set to batch {batch}"
    except CheckError as e:
        if not rebatched:
            raise
        old_b = _file_batch(model)
        ref = _per_sample_reference(base, feeds, old_b, batch, str(e))
        reference = f"onnxruntime on the file at its batch {old_b}, {batch} samples in chunks of {old_b}"
    t2 = time.perf_counter()
    names = [o.name for o in model.graph.output]
    if len(ref) != len(ours):
        raise CheckError(f"the PCG has {len(ours)} outputs, onnxruntime gives {len(ref)}")
    outs = tuple(compare(names[k] if k < len(names) else f"output{k}", ours[k], ref[k], f, rtol, atol)
                 for k in range(len(ref)))
    return CheckResult(all(o.ok for o in outs), outs, d, f, rtol, atol, seed,
                       {k: v for k, v in bounds.items() if k in feeds}, t1 - t0, t2 - t1, reference,
                       derandomized, pcg_random, randomness_line(derandomized, pcg_random))


def _file_batch(model) -> int:
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    raise CheckError("no fixed batch in the file's inputs")


def _per_sample_reference(src, feeds: dict[str, np.ndarray], old_b: int, new_b: int, why: str) -> list[np.ndarray]:
    """The file fixes its batch ``old_b`` (onnxruntime cannot run it at ``new_b``: ``why``): run it on the
    ``new_b`` samples in chunks of ``old_b`` (the last one padded by repeating its first sample) and join the
    outputs along dim 0.  Exact for models whose samples do not interact (inference-mode networks), which is
    what a batch override assumes; an output that does not lead with the batch leaves no reference."""
    parts: list[list[np.ndarray]] = []
    for start in range(0, new_b, old_b):
        n = min(old_b, new_b - start)
        chunk = {}
        for k, v in feeds.items():
            c = v[start:start + n]
            if n < old_b:
                c = np.concatenate([c] + [c[:1]] * (old_b - n), axis=0)
            chunk[k] = c
        outs = run_onnxruntime(src, chunk)
        for j, o in enumerate(outs):
            if o.ndim == 0 or o.shape[0] != old_b:
                raise CheckError(f"no reference at batch {new_b}: onnxruntime cannot run the file at that batch "
                                 f"({why}) and its output {j} (shape {list(o.shape)}) does not lead with the "
                                 f"exported batch {old_b}, so it cannot be run in chunks")
        parts.append([o[:n] for o in outs])
    return [np.concatenate([p[j] for p in parts], axis=0) for j in range(len(parts[0]))]


def _needs_batch_change(model, batch: int) -> bool:
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) and not (dims[0].HasField("dim_value") and dims[0].dim_value == batch) \
                and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return True
    return False
