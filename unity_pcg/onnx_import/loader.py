"""Reading an ONNX file: protobuf parsing, opset, lazy initializers (embedded and external data)."""
from __future__ import annotations

import os
import re
from math import prod
from typing import Any

import numpy as np

from .consts import Const, lazy
from .errors import InvalidModel, MissingTensor, ModelImportError

# ONNX TensorProto.DataType -> numpy dtype (the ones we can hold)
_NP = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
       9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
PCG_DTYPES = {"float32", "float16", "float64", "int64", "int32", "bool"}


def np_dtype(elem_type: int, what: str) -> np.dtype:
    try:
        return np.dtype(_NP[int(elem_type)])
    except KeyError:
        import onnx
        try:
            tname = onnx.TensorProto.DataType.Name(int(elem_type))
        except ValueError:
            tname = str(elem_type)
        raise InvalidModel(f"{what}: unsupported element type {tname}") from None


def read_model(src: Any):
    """ModelProto from a path, bytes or a ModelProto; also the directory external data is relative to."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(src, onnx.ModelProto):
        return src, None
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, base, what = bytes(src), None, "model bytes"
    else:
        path = os.fspath(src)
        what = os.path.basename(path) or path
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise ModelImportError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise ModelImportError(f"{path}: is a directory, not an ONNX file") from None
        except OSError as e:
            raise ModelImportError(f"{path}: cannot read ({e.strerror})") from None
        base = os.path.dirname(os.path.abspath(path))
    if not data:
        raise InvalidModel(f"{what}: empty file, not an ONNX model")
    m = onnx.ModelProto()
    try:
        m.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InvalidModel(f"{what}: not a valid ONNX model (protobuf parse failed: {e})") from None
    except Exception as e:  # the C++ protobuf backend raises odd types on garbage
        raise InvalidModel(f"{what}: not a valid ONNX model ({type(e).__name__})") from None
    if not m.HasField("graph") or (not m.graph.node and not m.graph.output):
        raise InvalidModel(f"{what}: not an ONNX model (no graph)")
    return m, base


def default_opset(m) -> int:
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    if not m.opset_import:  # IR version < 3 models
        return 1
    raise InvalidModel("the model imports no version of the default ONNX operator set")


#: torch's dynamo exporter writes, on each initializer's ``value_info`` entry, the kind torch.export gave it
INPUT_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
#: onnxscript's optimizer writes, on a tensor it folded, every tensor name it was computed from
FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"


#: torch's dynamo exporter writes the whole torch.export signature, as text, on the graph: one line per input,
#: ``p_lin_weight: PARAMETER target='lin.weight'``, parameters the optimizer folded away included
SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
_SIGNATURE_LINE = re.compile(r"^\s*[\w.]+:\s*([A-Z_]+)\s+target='([^']*)'", re.M)
#: operators whose initializer inputs are what a model trains (a folded transposed or reshaped parameter
#: feeds one of them)
_WEIGHT_READERS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})


def _names(text: str) -> set[str]:
    import ast
    try:
        v = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return set()
    return {x for x in v if isinstance(x, str)} if isinstance(v, (list, tuple, set)) else set()


def _kind(k: str) -> str:
    return k.rpartition(".")[2]


def untrained_initializers(graph) -> set[str]:
    """Names of the initializers torch does not train, from what torch's dynamo exporter records (no name
    patterns):

    - *kinds*: ``INPUT_KIND_KEY`` on an initializer's ``value_info`` entry (or the tensor), and the signature
      text on the graph (``SIGNATURE_KEY``: ``target`` -> kind for every input, parameters folded away
      included).  An initializer whose kind is not ``PARAMETER`` (``BUFFER``: rotary tables, causal masks,
      running statistics; ``CONSTANT_TENSOR``) is untrained.  No kind anywhere (the legacy exporter, other
      tools): the empty set, every initializer may be trained, as before.
    - an initializer without a kind was made by the exporter or its optimizer.  Where onnxscript's
      ``FOLDED_FROM_KEY`` lists its sources (transitively: every input of the fold, intermediates and
      ``Constant`` outputs besides), it is trained iff a source is a parameter (a transposed weight folded by
      the optimizer is that weight) or a trained kindless initializer; a source list naming no input of known
      kind did not record its inputs and is decided as below.
    - one without ``FOLDED_FROM_KEY`` in a file where other initializers carry it is not a fold: an exporter
      constant, untrained.  In a file where none does (an onnxscript that does not record folds), it may be a
      folded parameter: untrained only when the signature shows no parameter missing from the initializers
      (none was folded away), else trained iff a ``_WEIGHT_READERS`` operator reads it (where a folded
      transposed or reshaped parameter goes)."""
    inits = {t.name: t for t in graph.initializer}
    meta: dict[str, dict[str, str]] = {}
    for t in graph.initializer:
        props = getattr(t, "metadata_props", ())
        if props:
            meta.setdefault(t.name, {}).update((p.key, p.value) for p in props)
    for v in list(graph.value_info) + list(graph.input):
        if v.metadata_props:
            meta.setdefault(v.name, {}).update((p.key, p.value) for p in v.metadata_props)
    sig_text = next((p.value for p in getattr(graph, "metadata_props", ()) if p.key == SIGNATURE_KEY), None)
    known: dict[str, str] = {}
    if sig_text:
        known.update((target, kind) for kind, target in _SIGNATURE_LINE.findall(sig_text))
    known.update((n, _kind(m[INPUT_KIND_KEY])) for n, m in meta.items() if INPUT_KIND_KEY in m)
    if not any(n in inits for n in known) and not sig_text:
        return set()
    params = {n for n, k in known.items() if k == "PARAMETER"}
    out = {n for n in inits if n in known and n not in params}
    kindless = [n for n in inits if n not in known]
    sources = {n: _names(meta.get(n, {}).get(FOLDED_FROM_KEY, "")) for n in kindless}
    records_folds = any(sources.values())
    missing = {n for n in params if n not in inits} if sig_text else None   # None: not known

    def structural(n: str) -> bool:
        """Trained? for a kindless initializer whose fold was not recorded."""
        if missing is not None and not missing:
            return False
        return any(nd.op_type in _WEIGHT_READERS and n in nd.input for nd in graph.node)

    trained: dict[str, bool] = {}

    def is_trained(n: str, seen: frozenset = frozenset()) -> bool:
        if n not in trained:
            src = sources[n]
            if src:
                via = [x for x in src if x in trained or (x in sources and x not in seen)]
                if src & params or any(is_trained(x, seen | {n}) for x in via):
                    trained[n] = True
                elif src & set(known) or via:
                    trained[n] = False          # its inputs are recorded; none is a parameter
                else:
                    trained[n] = structural(n)
            else:
                trained[n] = False if records_folds else structural(n)
        return trained[n]

    out |= {n for n in kindless if not is_trained(n)}
    return out


def _external_info(t) -> dict:
    return {e.key: e.value for e in t.external_data}


def initializer_const(t, base: str | None, load: bool) -> Const:
    """A lazy :class:`Const` for a TensorProto initializer (embedded or external data)."""
    from onnx import numpy_helper

    name = t.name
    if t.data_type == 8:
        raise InvalidModel(f"initializer {name!r}: string tensors are not supported")
    dtype = np_dtype(t.data_type, f"initializer {name!r}")
    shape = tuple(int(d) for d in t.dims)
    if any(d < 0 for d in shape):
        raise InvalidModel(f"initializer {name!r} has a negative dimension {list(shape)}")
    n = prod(shape)
    if t.data_location == 1:  # EXTERNAL
        info = _external_info(t)
        loc = info.get("location", "")
        if base is None:
            raise MissingTensor(f"initializer {name!r} is stored in external file {loc!r}, but the model was "
                                "not loaded from a path")
        if not loc or os.path.isabs(loc):
            raise InvalidModel(f"initializer {name!r}: bad external data location {loc!r}")
        path = os.path.normpath(os.path.join(base, loc))
        if os.path.commonpath([path, base]) != base:
            raise InvalidModel(f"initializer {name!r}: external data location {loc!r} escapes the model folder")
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if info.get("length") else n * dtype.itemsize
        except ValueError:
            raise InvalidModel(f"initializer {name!r}: bad external data offset/length") from None
        if not os.path.isfile(path):
            raise MissingTensor(f"initializer {name!r}: external data file {loc!r} not found")
        if offset < 0 or length != n * dtype.itemsize or offset + length > os.path.getsize(path):
            raise InvalidModel(f"initializer {name!r}: external data {loc!r} (offset {offset}, length {length}) "
                               f"does not hold {n} {dtype} values")

        def read(path=path, offset=offset, n=n, dtype=dtype, shape=shape):
            return np.fromfile(path, dtype=dtype.newbyteorder("<"), count=n, offset=offset).astype(
                dtype, copy=False).reshape(shape)
        return lazy(read, shape, dtype, origin=name)
    # embedded: check the payload size now (cheap), convert on demand
    if t.HasField("raw_data") or t.raw_data:
        if len(t.raw_data) != n * dtype.itemsize:
            raise InvalidModel(f"initializer {name!r}: {len(t.raw_data)} bytes of data for shape {list(shape)}")
    else:
        have = max(len(t.float_data), len(t.int32_data), len(t.int64_data), len(t.double_data),
                   len(t.uint64_data))
        if have != n:
            raise InvalidModel(f"initializer {name!r}: {have} values for shape {list(shape)}")

    def conv(t=t):
        return numpy_helper.to_array(t)
    if n <= 4096:
        try:
            return Const(np.asarray(conv()).reshape(shape).astype(dtype, copy=False), origin=name)
        except Exception as e:
            raise InvalidModel(f"initializer {name!r}: cannot decode ({e})") from None
    return lazy(conv, shape, dtype, origin=name)


def tensor_attr_const(t, what: str) -> Const:
    """An attribute TensorProto (Constant's value, ConstantOfShape's value): decoded eagerly (small)."""
    from onnx import numpy_helper
    if t.data_location == 1:
        raise InvalidModel(f"{what}: external data in an attribute tensor is not supported")
    if t.data_type == 8:
        raise InvalidModel(f"{what}: string tensors are not supported")
    dtype = np_dtype(t.data_type, what)
    shape = tuple(int(d) for d in t.dims)
    if any(d < 0 for d in shape):
        raise InvalidModel(f"{what}: negative dimension in {list(shape)}")
    try:
        v = np.asarray(numpy_helper.to_array(t)).astype(dtype, copy=False)
        return Const(v.reshape(shape))
    except Exception as e:
        raise InvalidModel(f"{what}: cannot decode tensor ({type(e).__name__}: {e})") from None
