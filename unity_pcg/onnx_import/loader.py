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


#: names torch's exporter and torch.export give their own constants (never a parameter)
_EXPORTER_CONSTANT = re.compile(r"val_\d+|(c_)?lifted_tensor_\d+|_?tensor_constant\d+")


def _names(text: str) -> set[str]:
    import ast
    try:
        v = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return set()
    return {x for x in v if isinstance(x, str)} if isinstance(v, (list, tuple, set)) else set()


def untrained_initializers(graph) -> set[str]:
    """Names of the initializers torch does not train, read from the signature torch's dynamo exporter
    writes (``metadata_props`` ``INPUT_KIND_KEY`` on each initializer's ``value_info`` entry, or on the
    tensor itself): every initializer whose kind is not ``PARAMETER`` (``BUFFER``: rotary tables, causal masks,
    running statistics; ``CONSTANT_TENSOR``) and, once any initializer has a kind, every initializer without
    one (the exporter's and its optimizer's constants) unless onnxscript's ``FOLDED_FROM_KEY`` names a source
    that may be a parameter: anything but an untrained initializer or a name the exporter gives its own
    constants (a transposed weight folded by the optimizer is that weight, trained; its parameter is gone
    from the file, so an unknown source counts as one).
    A graph with no kind at all (the legacy exporter, other tools) gives the empty set: every initializer
    may be trained, as before."""
    inits = [t.name for t in graph.initializer]
    names = set(inits)
    meta: dict[str, dict[str, str]] = {}
    for t in graph.initializer:
        props = getattr(t, "metadata_props", ())
        if props:
            meta.setdefault(t.name, {}).update((p.key, p.value) for p in props)
    for v in list(graph.value_info) + list(graph.input):
        if v.name in names and v.metadata_props:
            meta.setdefault(v.name, {}).update((p.key, p.value) for p in v.metadata_props)
    kinds = {n: m[INPUT_KIND_KEY] for n, m in meta.items() if INPUT_KIND_KEY in m}
    if not kinds:
        return set()
    params = {n for n, k in kinds.items() if k.rpartition(".")[2] == "PARAMETER"}
    out = {n for n, k in kinds.items() if n not in params}
    for n in inits:
        if n in kinds:
            continue
        # a fold: untrained when every source is known to be (a buffer, an exporter constant); a source the
        # optimizer removed may have been a parameter (a transposed weight), so an unknown one keeps it trained
        sources = _names(meta.get(n, {}).get(FOLDED_FROM_KEY, ""))
        if all(x in out or _EXPORTER_CONSTANT.fullmatch(x) for x in sources):
            out.add(n)
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
