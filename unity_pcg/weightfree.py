"""The mark of a weight-free ONNX file (written by ``unity-pcg export-structure`` or ``zoo export --weights
none``): the model's graph with every weight's real shape and dtype, its bytes a sparse file of zeros.
Such a file is for planning (import, simulate, optimize, explain); training it would train zeros.

The mark is the model's ``metadata_props`` entry ``unity_pcg.weight_free = true``.  :func:`is_weight_free`
reads it without parsing the graph or touching external data (a scan of the top-level protobuf fields), so
checking a 2 GB file costs a few reads.  No torch, no onnx import.
"""
from __future__ import annotations

import os

from .errors import UnityError

#: metadata_props key marking a weight-free model; its value is "true"
WEIGHT_FREE_KEY = "unity_pcg.weight_free"

_METADATA_PROPS = 14   # ModelProto.metadata_props
_KEY, _VALUE = 1, 2    # StringStringEntryProto.key / .value


class WeightFreeModel(UnityError):
    """A weight-free model was given where weights are needed (``unity-pcg run``)."""


def _varint(f) -> int | None:
    shift = result = 0
    while True:
        b = f.read(1)
        if not b:
            return None
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            return None


def _entry(buf: bytes) -> "tuple[str, str]":
    """Key and value of a serialized StringStringEntryProto."""
    import io
    f, out = io.BytesIO(buf), {}
    while True:
        tag = _varint(f)
        if tag is None:
            break
        field, wire = tag >> 3, tag & 7
        if wire != 2:
            break
        n = _varint(f)
        if n is None:
            break
        out[field] = f.read(n).decode("utf-8", "replace")
    return out.get(_KEY, ""), out.get(_VALUE, "")


def metadata(path) -> "dict[str, str]":
    """The ``metadata_props`` of the ONNX file at ``path`` (top-level fields only; the graph is skipped
    by length, never parsed).  An unreadable or malformed file gives what was read before the fault."""
    props: dict = {}
    try:
        f = open(os.fspath(path), "rb")
    except OSError:
        return props
    with f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            tag = _varint(f)
            if tag is None:
                break
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                if _varint(f) is None:
                    break
            elif wire == 1:
                f.seek(8, 1)
            elif wire == 5:
                f.seek(4, 1)
            elif wire == 2:
                n = _varint(f)
                if n is None or f.tell() + n > size:
                    break
                if field == _METADATA_PROPS:
                    k, v = _entry(f.read(n))
                    props[k] = v
                else:
                    f.seek(n, 1)
            else:
                break
    return props


def is_weight_free(path) -> bool:
    """Whether the ONNX file at ``path`` is marked weight-free (see the module doc)."""
    return metadata(path).get(WEIGHT_FREE_KEY, "").lower() == "true"


def refuse_weight_free(path) -> None:
    """Raise :class:`WeightFreeModel` (one line) when ``path`` is a weight-free model."""
    if path and is_weight_free(path):
        name = os.path.basename(os.fspath(path))
        raise WeightFreeModel(f"{name} has no weights (written by export-structure for planning): export the "
                              "model with its weights to train it")
