"""Trained weights out: the ONNX model with its trained initializers, and a safetensors file beside it.

``save_model(model_path, state, out_path)`` writes ``out_path`` (the graph of ``model_path`` unchanged,
every initializer the state trained replaced by its trained value, in the initializer's own dtype) and
``OUT.safetensors`` (every initializer of the written model, keyed by its ONNX name).  Models whose
initializers pass ``external_threshold`` bytes (default 2 GiB, protobuf's limit) keep their tensors in
``OUT.onnx.data`` (ONNX external data; tensors of at least min(1 KiB, threshold) bytes move there).  No torch.distributed: the run's rank 0, ``unity-pcg
export-weights`` and library callers use it alike; the state may hold numpy arrays or torch tensors.

**State names -> initializers.**  The state is keyed by the PCG's Weight names (``Trainer.model_state()``),
and a Weight is not always its initializer as stored: the importer turns Gemm's ``transB`` weights into
(in, out) matrices, folds Transpose/Reshape/Squeeze chains on initializers, and names the result after the
initializer it came from.  :func:`weight_layout` finds, for every Weight named after a float initializer,
which element of the initializer each of its elements is: it imports the model once more with every float
initializer replaced by its element indices (in base-B digits when an index does not fit the dtype's exact
integers: one import per digit) and keeps the Weights whose values are a permutation of their initializer's
indices.  Writing back scatters the trained Weight through that permutation, so any layout-only derivation
is undone exactly.  Weights derived by arithmetic (a folded ``Mul``), from several initializers, or tied
copies of an initializer the importer named otherwise are not written back: they are reported in the
result's ``"skipped"`` (constants folded from ``Constant`` nodes, which training never changes, are not).

**ONNX names -> torch names** (:func:`torch_names`): what the exporters leave in the file.  A dynamo export
(``torch.onnx.export(dynamo=True)``) marks graph inputs/initializers that are module parameters or buffers
with ``pkg.torch.export.graph_signature.InputSpec.kind`` metadata: those names are state_dict keys.  A
legacy (TorchScript) export names an initializer after its state_dict key when it used the parameter as it
is; when it constant-folded the parameter (``Linear`` without a Gemm: ``weight.t()`` folded into
``onnx::MatMul_N``), nothing in the file names the parameter.  For that case, and dynamo's folded ``val_N``
transposes, the map is recovered from the consuming ``MatMul``'s module scope (legacy node names
``/seq/seq.0/lin/MatMul``, dynamo's ``pkg.torch.onnx.name_scopes``): its input B is ``<scope>.weight``,
transposed.  That is a heuristic that holds for ``nn.Linear`` (the case the exporters rename); a custom module
whose folded parameter is not a transposed ``weight`` gets a wrong or no name, and other folded parameters
(scaled, reshaped, merged) have none.  The map goes into the safetensors ``__metadata__`` (``onnx_to_torch``:
a JSON object ONNX name -> torch name; ``torch_transposed``: a JSON list of the ONNX names stored as the
transpose of their torch parameter); :func:`torch_state_dict` applies it.
"""
from __future__ import annotations

import json
import os
import re
import struct
from math import prod
from typing import Any, Mapping

import numpy as np

from unity_pcg.errors import UnityError

#: models whose initializers exceed this many bytes are written with external data (protobuf's 2 GiB limit)
EXTERNAL_THRESHOLD = 2 ** 31

# exact consecutive integers of each float dtype a probe can use: 2**mantissa bits (+1)
_EXACT = {np.dtype(np.float16): 2 ** 11, np.dtype(np.float32): 2 ** 24, np.dtype(np.float64): 2 ** 53}

_ST_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
              np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
              np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16",
              np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64", np.dtype(np.bool_): "BOOL"}
_ST_NP = {v: k for k, v in _ST_DTYPES.items()}
_BF16 = 16   # onnx.TensorProto.BFLOAT16


class ExportError(UnityError, ValueError):
    """Weights that cannot be written (output folder missing, a state that does not fit the model)."""


# --- paths ------------------------------------------------------------------------------------------------

def safetensors_path(out_path: str) -> str:
    """``OUT.safetensors`` beside ``OUT.onnx``."""
    root, ext = os.path.splitext(out_path)
    return (root if ext.lower() == ".onnx" else out_path) + ".safetensors"


def check_output(out_path: str, flag: str = "--save-model") -> str:
    """Refuse an output path whose folder does not exist or that is a folder; returns the absolute path."""
    p = os.path.abspath(out_path)
    d = os.path.dirname(p)
    if not os.path.isdir(d):
        raise ExportError(f"{flag} {out_path}: folder {d} does not exist")
    if os.path.isdir(p):
        raise ExportError(f"{flag} {out_path}: is a folder, expected a file name (OUT.onnx)")
    return p


# --- tensors ------------------------------------------------------------------------------------------------

def _np(v: Any) -> np.ndarray:
    """A numpy array of a state value (torch tensor on any device, or array-like); bf16 -> float32."""
    if hasattr(v, "detach"):
        t = v.detach()
        if hasattr(t, "cpu"):
            t = t.cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(v)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((b >> 16) & 1) + np.uint32(0x7FFF)
    out = ((b + r) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _tensor_array(t) -> np.ndarray:
    """An initializer's value (external data already loaded); bf16 as float32."""
    from onnx import numpy_helper
    if t.data_type == _BF16:
        raw = np.frombuffer(t.raw_data, dtype=np.uint16) if t.raw_data else np.asarray(t.int32_data, np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def _set_tensor(t, value: np.ndarray) -> None:
    """Replace an initializer's data by ``value`` in its own dtype (name, doc_string, metadata kept)."""
    from onnx import helper
    if t.data_type == _BF16:
        raw = _bf16_bits(value).tobytes()
    else:
        dt = helper.tensor_dtype_to_np_dtype(t.data_type)
        raw = np.ascontiguousarray(value.astype(dt, copy=False)).astype(dt.newbyteorder("<"), copy=False).tobytes()
    for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data", "external_data"):
        t.ClearField(f)
    t.data_location = 0   # DEFAULT
    t.raw_data = raw


# --- which element of an initializer each Weight element is ---------------------------------------------

def _float_dtype(t) -> np.dtype | None:
    from onnx import helper
    if t.data_type == _BF16:
        return None
    try:
        dt = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    except Exception:   # noqa: BLE001 -- a type numpy has no name for: not probed
        return None
    return dt if dt in _EXACT else None


def _import(model, batch: int | None):
    """The model as a PCG at the file's batch; at ``batch`` (else 1) when the file's batch is dynamic (the
    weights do not depend on it)."""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.onnx_import.errors import DynamicDimension
    try:
        return load_onnx(model)
    except DynamicDimension:
        return load_onnx(model, batch=batch or 1)


def weight_layout(model, batch: int | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """PCG Weight name -> (initializer name, flat element indices into the initializer, shaped as the
    Weight) for every Weight that is a layout-only derivation (a permutation) of one float initializer.
    ``model``: an ``onnx.ModelProto`` with its data loaded, or a path."""
    import onnx
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model)
    probe_dt = {t.name: dt for t in model.graph.initializer if (dt := _float_dtype(t)) is not None}
    if not probe_dt:
        return {}
    sizes = {t.name: prod(t.dims) for t in model.graph.initializer if t.name in probe_dt}
    base = min(_EXACT[dt] for dt in probe_dt.values())
    digits = 1
    while base ** digits < max(sizes.values()):
        digits += 1
    index: dict[str, np.ndarray] = {}
    names: set[str] | None = None
    for d in range(digits):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for t in m.graph.initializer:
            if t.name in probe_dt:
                v = (np.arange(sizes[t.name], dtype=np.int64) // base ** d) % base
                _set_tensor(t, v.astype(probe_dt[t.name]).reshape(tuple(t.dims)))
        g = _import(m, batch)
        here = {n.a["name"] for n in g.sources("Weight") if n.a["name"] in probe_dt}
        names = here if names is None else names & here
        for name in here:
            v = g.weights[name]
            v = np.asarray(v() if callable(v) else v)
            if v.dtype.kind != "f" or not np.all(np.isfinite(v)) or np.any(v != np.round(v)):
                names.discard(name)
                continue
            part = v.astype(np.int64) * base ** d
            index[name] = part if d == 0 else index[name] + part
    out = {}
    for name in sorted(names or ()):
        ix = index[name]
        n = sizes[name]
        if ix.size != n or ix.min(initial=0) < 0 or ix.max(initial=0) >= n:
            continue
        if not np.all(np.bincount(ix.ravel(), minlength=n) == 1):
            continue
        out[name] = (name, ix)
    return out


def _constant_tensors(model) -> set[str]:
    """ONNX tensor names computed from Constant nodes and untrained initializers alone (never trained;
    Trainer's ``model_constants``)."""
    from unity_pcg.onnx_import.loader import untrained_initializers
    const: set[str] = set(untrained_initializers(model.graph))
    for node in model.graph.node:
        if all(x == "" or x in const for x in node.input):
            const.update(o for o in node.output if o)
    return const


# --- ONNX names -> torch state_dict names ---------------------------------------------------------------------

def _module_path(segments) -> str:
    """A module's dotted path from scope segments: legacy ``['seq', 'seq.0', 'lin']`` and dynamo's qualified
    ``['', 'seq', 'seq.0', 'seq.0.lin']`` both give ``seq.0.lin``."""
    path = ""
    for s in segments:
        if not s:
            continue
        path = s if (not path or s.startswith(path + ".")) else f"{path}.{s}"
    return path


def _scope(node) -> str | None:
    md = {p.key: p.value for p in node.metadata_props}
    ns = md.get("pkg.torch.onnx.name_scopes")
    if ns:
        try:
            segs = json.loads(ns.replace("'", '"'))
        except ValueError:
            segs = None
        if isinstance(segs, list) and len(segs) >= 2:
            return _module_path(segs[:-1]) or None
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return _module_path(node.name.split("/")[1:-1]) or None
    return None


def torch_names(model) -> tuple[dict[str, str], list[str]]:
    """(ONNX initializer name -> torch state_dict name, ONNX names stored transposed) as far as the file
    tells (see module doc); initializers it says nothing about are left out."""
    import onnx
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model, load_external_data=False)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    kinds = {}
    for vi in list(g.input) + list(g.value_info):
        for p in vi.metadata_props:
            if p.key == "pkg.torch.export.graph_signature.InputSpec.kind":
                kinds[vi.name] = p.value
    for t in g.initializer:
        for p in getattr(t, "metadata_props", ()):
            if p.key == "pkg.torch.export.graph_signature.InputSpec.kind":
                kinds[t.name] = p.value
    dynamo = bool(kinds)
    out: dict[str, str] = {}
    for name in inits:
        if kinds.get(name) in ("PARAMETER", "BUFFER"):
            out[name] = name
        elif not dynamo and model.producer_name == "pytorch" and not name.startswith("onnx::") \
                and "/" not in name and re.fullmatch(r"[A-Za-z_][\w.]*", name):
            out[name] = name
    transposed: list[str] = []
    if not dynamo and model.producer_name != "pytorch":   # node names of other producers mean nothing here
        return out, transposed
    taken = set(out.values())
    for node in g.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        b = node.input[1]
        t = inits.get(b)
        if t is None or b in out or len(t.dims) != 2:
            continue
        scope = _scope(node)
        if scope is None:
            continue
        want = f"{scope}.weight"
        if want in taken:
            continue
        out[b] = want
        taken.add(want)
        transposed.append(b)
    return out, sorted(transposed)


# --- safetensors ---------------------------------------------------------------------------------------------

def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                      bf16: frozenset = frozenset()) -> None:
    """A safetensors file: u64 little-endian header length, JSON header {name: {dtype, shape, data_offsets}}
    (+ ``__metadata__``, str -> str), padded with spaces to 8 bytes, then each tensor's little-endian bytes.
    Names in ``bf16`` are float32 arrays written as BF16."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    order, off = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if name in bf16:
            data, code = _bf16_bits(a), "BF16"
        else:
            code = _ST_DTYPES.get(a.dtype)
            if code is None:
                continue
            data = a
        n = data.size * data.dtype.itemsize
        header[name] = {"dtype": code, "shape": [int(s) for s in a.shape], "data_offsets": [off, off + n]}
        order.append((name, data))
        off += n
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, data in order:
            d = np.ascontiguousarray(data)
            f.write(d.astype(d.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> array, __metadata__) of a safetensors file; BF16 tensors come back as float32."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ExportError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ExportError(f"{path}: not a safetensors file (bad header)") from None
        body = f.read()
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        shape = tuple(e["shape"])
        if e["dtype"] == "BF16":
            bits = np.frombuffer(body[a:b], dtype="<u2").astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(shape)
            continue
        dt = _ST_NP.get(e["dtype"])
        if dt is None:
            raise ExportError(f"{path}: tensor {name!r} has dtype {e['dtype']}, which this reader does not know")
        out[name] = np.frombuffer(body[a:b], dtype=dt.newbyteorder("<")).astype(dt).reshape(shape)
    return out, meta


# --- the writer ---------------------------------------------------------------------------------------------

def save_model(model_path: str, state: Mapping[str, Any], out_path: str, *,
               external_threshold: int = EXTERNAL_THRESHOLD, batch: int | None = None,
               safetensors: bool = True) -> dict:
    """Write ``model_path``'s graph with the trained values of ``state`` (PCG Weight name -> array, as
    ``Trainer.model_state()`` returns it, or ``checkpoint.read_model``) to ``out_path``, and
    ``OUT.safetensors`` beside it.  Returns ``{"onnx": path, "safetensors": path or None, "external_data":
    path or None, "written": [initializer names replaced], "skipped": [state names not written back]}``.
    ``batch``: the batch the plan imported the model at (only needed when the model's batch is dynamic)."""
    import onnx
    out_path = check_output(out_path, "output")
    try:
        model = onnx.load(model_path)
    except FileNotFoundError:
        raise ExportError(f"model {model_path}: no such file") from None
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"model {model_path}: cannot read it as ONNX ({type(e).__name__})") from None
    inits = {t.name: t for t in model.graph.initializer}
    try:
        layout = weight_layout(model, batch)
    except UnityError as e:
        raise ExportError(f"model {model_path}: cannot trace its weights to its initializers: {e}") from None
    const = _constant_tensors(model)
    written, skipped = [], []
    for name in sorted(state):
        v = _np(state[name])
        lay = layout.get(name)
        if lay is None:
            if name in inits and tuple(inits[name].dims) == tuple(v.shape) and _float_dtype(inits[name]) is None \
                    and inits[name].data_type != _BF16:
                # an integer initializer the importer kept as it is (never trained): leave it
                continue
            if name not in const:
                skipped.append(name)
            continue
        init_name, ix = lay
        t = inits[init_name]
        if ix.shape != v.shape:
            raise ExportError(f"state tensor {name!r} has shape {list(v.shape)}, the model's weight has "
                              f"{list(ix.shape)}")
        flat = np.empty(ix.size, dtype=v.dtype)
        flat[ix.ravel()] = v.ravel()
        _set_tensor(t, flat.reshape(tuple(t.dims)))
        written.append(init_name)
    arrays = {t.name: _tensor_array(t) for t in model.graph.initializer} if safetensors else {}
    bf16 = frozenset(t.name for t in model.graph.initializer if t.data_type == _BF16)
    total = sum(t.ByteSize() for t in model.graph.initializer)
    data_path = out_path + ".data"
    if os.path.exists(data_path):     # onnx appends to an existing data file
        os.remove(data_path)
    if total > external_threshold:
        onnx.save_model(model, out_path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(data_path), size_threshold=min(1024, external_threshold))
        if not os.path.exists(data_path):
            data_path = None
    else:
        onnx.save_model(model, out_path)
        data_path = None
    st = None
    if safetensors:
        st = safetensors_path(out_path)
        names, transposed = torch_names(model)
        meta = {"format": "onnx", "source_model": os.path.basename(model_path),
                "onnx_to_torch": json.dumps(names, sort_keys=True), "torch_transposed": json.dumps(transposed)}
        write_safetensors(st, arrays, meta, bf16=bf16)
    return {"onnx": out_path, "safetensors": st, "external_data": data_path, "written": written,
            "skipped": skipped}


def torch_state_dict(path: str) -> dict:
    """torch tensors by the torch module's state_dict names, for ``module.load_state_dict(..., strict=...)``
    of the module a legacy or dynamo export came from.  ``path``: the ``.safetensors`` that
    :func:`save_model` wrote, or an ``.onnx`` file (its ``.safetensors`` sibling when there is one, else its
    own initializers and the names :func:`torch_names` recovers).  Initializers without a known torch name
    are left out: load with ``strict=False`` when the file could not name every parameter."""
    import torch
    if path.lower().endswith(".safetensors"):
        arrays, meta = read_safetensors(path)
        names = json.loads(meta.get("onnx_to_torch", "{}"))
        transposed = set(json.loads(meta.get("torch_transposed", "[]")))
    elif os.path.exists(safetensors_path(path)):
        return torch_state_dict(safetensors_path(path))
    else:
        import onnx
        m = onnx.load(path)
        arrays = {t.name: _tensor_array(t) for t in m.graph.initializer}
        names, tr = torch_names(m)
        transposed = set(tr)
    out = {}
    for onnx_name, torch_name in names.items():
        if onnx_name not in arrays:
            continue
        a = arrays[onnx_name]
        if onnx_name in transposed:
            a = a.T
        out[torch_name] = torch.from_numpy(np.ascontiguousarray(a).copy())
    return out


def trained_state(trainer, pipeline: bool) -> dict | None:
    """The whole trained state on rank 0 (None on the other ranks): a collective, every rank calls it.
    A ``Trainer`` assembles every weight on every rank (``model_state``); a pipeline stage holds its own
    weights only, so the stages' states are gathered to rank 0 (each rank's part on the CPU)."""
    import torch.distributed as dist
    state = trainer.model_state()
    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if on else 0
    if not pipeline or not on:
        return {k: _np(v) for k, v in state.items()} if rank == 0 else None
    mine = {k: _np(v) for k, v in state.items()}
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return None
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out.setdefault(k, v)
    return out
