"""Training data for `unity-pcg run`: the feeds of one step, each rank reading the rows its pieces need.

Sources (``--data PATH``):

* ``FILE.npz``: one array per ONNX graph input, keyed by the input's name, plus an optional ``targets``
  array (the whole file is loaded into memory, as numpy loads an .npz).
* ``DIR`` holding, per graph input NAME (and optionally for ``targets``), either

  - ``DIR/NAME.npy``: one array, opened with ``np.load(mmap_mode="r")`` (an array larger than memory
    works: a rank reads only its rows), or
  - ``DIR/NAME/*.npy``: shards, each opened memory-mapped, concatenated along dim 0 in file-name order
    (``part-000.npy``, ``part-001.npy``, ...: name them so that their sorted order is the data's order;
    every shard has the same dtype and the same trailing dims).

  Any other ``.npy`` file or folder in DIR is refused (a misspelled input name).
* no path: seeded random feeds from :func:`unity_pcg.evaluate.random_feeds`, seeded by ``(seed, step)``
  so that every rank draws the same batch and a resumed run draws what an uninterrupted one would.

Every array's first dim is a whole number of batches (``k * B`` rows, where ``B`` is the first dim of
that input in the plan's PCG); step ``s`` reads batch ``s mod k``.  The rest of each input's shape must
equal the model's.  :func:`open_data` checks all of that (headers only) and, with ``check=True``, scans
the contents in bounded chunks: floats must be finite, an integer input must hold integers (and, where it
indexes an embedding table, indices inside the table).  Everything raises :class:`DataError` (one line)
before any step runs.

:meth:`DataSource.feeds` takes the rows each input's pieces need on this rank (``rows``: input name ->
``(lo, hi)`` inside the batch; the trainers' ``feed_rows()``) and reads only those: a data-parallel rank
of K holds 1/K of each batch, never the whole logical batch.  Values are converted to the model's dtypes
on the rows read (never on the whole file).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from unity_pcg.errors import UnityError
from unity_pcg.evaluate import random_feeds
from unity_pcg.pcg import PCG
from unity_pcg.shape import numpy_dtype

SCAN_BYTES = 32 << 20      # rows scanned at a time by the content checks (bounded memory)


class DataError(UnityError, ValueError):
    """A --data file that does not fit the model (missing input, wrong shape, bad values, ...)."""


def _inputs(g: PCG) -> dict[str, dict]:
    return {n.a["name"]: n.a for n in g.sources("Input")}


def step_seed(seed: int, step: int) -> int:
    """The random-feed seed of one step: a fixed mix of the run's seed and the step number."""
    return (int(seed) * 1_000_003 + int(step) * 7_919 + 17) % (2 ** 63)


class ShardedArray:
    """``.npy`` shards (memory-mapped) read as one array concatenated along dim 0."""

    def __init__(self, paths: list[str], what: str):
        self.paths = list(paths)
        self.parts = []
        for p in self.paths:
            a = _load_npy(p)
            if self.parts and (a.dtype != self.parts[0].dtype or a.shape[1:] != self.parts[0].shape[1:]
                               or a.ndim != self.parts[0].ndim):
                raise DataError(f"{what}: shard {p} has dtype {a.dtype} and shape {list(a.shape)}, shard "
                                f"{self.paths[0]} {self.parts[0].dtype} and {list(self.parts[0].shape)}: shards "
                                f"must differ in dim 0 only")
            if a.ndim == 0:
                raise DataError(f"{what}: shard {p} is a scalar; shards concatenate along dim 0")
            self.parts.append(a)
        self.starts = np.cumsum([0] + [a.shape[0] for a in self.parts])
        self.dtype = self.parts[0].dtype
        self.shape = (int(self.starts[-1]),) + tuple(self.parts[0].shape[1:])
        self.ndim = len(self.shape)

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` (a copy of just those rows: only the shards holding them are read)."""
        out = []
        for a, s in zip(self.parts, self.starts):
            e = s + a.shape[0]
            if e <= lo or s >= hi:
                continue
            out.append(a[max(lo, s) - s:min(hi, e) - s])
        if not out:
            return np.empty((0,) + self.shape[1:], dtype=self.dtype)
        return np.concatenate(out, axis=0) if len(out) > 1 else np.array(out[0])


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- format errors, object arrays
        raise DataError(f"data file {path} is not a readable .npy array: {' '.join(str(e).split())}") from None


def _rows(a, lo: int, hi: int, dtype=None) -> np.ndarray:
    """Rows ``lo:hi`` of an array, memmap or shards, as a fresh in-memory array (of ``dtype``)."""
    v = a.rows(lo, hi) if isinstance(a, ShardedArray) else a[lo:hi]
    return np.array(v, dtype=dtype if dtype is not None else v.dtype, copy=True)


def _chunks(a):
    """(first row, rows) of ``a`` in pieces of at most SCAN_BYTES (a memmap is re-opened per chunk, so the
    pages read are not kept mapped)."""
    if isinstance(a, ShardedArray):
        for part, s in zip(a.parts, a.starts):
            for lo, c in _chunks(part):
                yield int(s) + lo, c
        return
    n = a.shape[0] if a.ndim else 1
    row = max(1, int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize) if a.ndim else a.dtype.itemsize
    step = max(1, SCAN_BYTES // row)
    if a.ndim == 0:
        yield 0, np.asarray(a).reshape(1)
        return
    path = getattr(a, "filename", None)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if isinstance(a, np.memmap) and path:
            m = np.load(path, mmap_mode="r")
            c = np.array(m[lo:hi])
            del m
        else:
            c = _rows(a, lo, hi)
        yield lo, c


def first_bad_row(a, ok) -> tuple[int, object] | None:
    """The first row of ``a`` holding an element where ``ok(chunk)`` is False, and that element; None if
    every element passes.  Scanned in bounded chunks."""
    for lo, c in _chunks(a):
        good = ok(c)
        if not np.all(good):
            flat = np.argmin(good.reshape(good.shape[0], -1).all(axis=1)) if c.ndim else 0
            bad = c[flat][~good[flat]] if c.ndim > 1 else c[flat]
            return lo + int(flat), np.asarray(bad).reshape(-1)[0]
    return None


def scan_finite(a, what: str) -> None:
    if a.dtype.kind != "f":
        return
    hit = first_bad_row(a, np.isfinite)
    if hit is not None:
        raise DataError(f"{what} holds {hit[1]} at row {hit[0]} (NaN/inf data is refused)")


def scan_range(a, lo: float, hi: float, what: str, why: str, right_open: bool = True) -> None:
    def ok(c):
        return (c >= lo) & ((c < hi) if right_open else (c <= hi))
    hit = first_bad_row(a, ok)
    if hit is not None:
        raise DataError(f"{what} holds {hit[1]} at row {hit[0]}; {why}")


@dataclass
class DataSource:
    """Feeds (and targets) per step; ``arrays`` is None for seeded random feeds."""
    graph: PCG
    seed: int = 0
    arrays: Mapping[str, object] | None = None
    targets: object | None = None
    batches: int = 1
    path: str | None = None
    kind: str = "random"            # "random" | "npz" | "dir"
    dtypes: dict = field(default_factory=dict)

    def target_rows(self) -> int:
        """Rows of targets per batch (0 without targets)."""
        return 0 if self.targets is None else self.targets.shape[0] // self.batches

    def feeds(self, step: int, rows: Mapping[str, tuple[int, int]] | None = None,
              target_rows: tuple[int, int] | None = None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(input name -> rows of the batch, targets or None) of step ``step`` (0-based, counted over resumes).

        ``rows``: input name -> ``(lo, hi)``, the rows of the batch this rank needs (default: all of them);
        ``target_rows`` likewise for the targets.  Only those rows are read.  Random feeds are whole."""
        if self.arrays is None:
            return random_feeds(self.graph, seed=step_seed(self.seed, step)), None
        k = step % self.batches
        ins = _inputs(self.graph)
        out = {}
        for name, a in self.arrays.items():
            b = ins[name]["shape"][0]
            lo, hi = rows.get(name, (0, b)) if rows is not None else (0, b)
            out[name] = _rows(a, k * b + lo, k * b + hi, self.dtypes.get(name))
        t = None
        if self.targets is not None:
            tb = self.target_rows()
            lo, hi = target_rows if target_rows is not None else (0, tb)
            t = _rows(self.targets, k * tb + lo, k * tb + hi)
        return out, t

    def describe(self) -> str:
        if self.arrays is None:
            return f"random feeds (seed {self.seed})"
        return f"{self.path} ({self.batches} batch{'es' if self.batches != 1 else ''}" + \
               (", with targets)" if self.targets is not None else ")")


def _open_npz(path: str) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k]) for k in z.files}
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except Exception as e:  # zipfile / format errors
        raise DataError(f"data file {path} is not a readable .npz file: {' '.join(str(e).split())}") from None


def _open_dir(path: str) -> dict:
    """NAME -> memmap (DIR/NAME.npy) or ShardedArray (DIR/NAME/*.npy)."""
    out: dict = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if os.path.isdir(full):
            shards = sorted(glob.glob(os.path.join(full, "*.npy")))
            if not shards:
                raise DataError(f"data folder {path}: {entry}/ holds no .npy shards")
            if entry in out:
                raise DataError(f"data folder {path}: {entry!r} is both {entry}.npy and a folder of shards")
            out[entry] = ShardedArray(shards, f"data folder {path}: {entry!r}")
        elif entry.endswith(".npy"):
            name = entry[:-4]
            if name in out:
                raise DataError(f"data folder {path}: {name!r} is both {entry} and a folder of shards")
            out[name] = _load_npy(full)
    if not out:
        raise DataError(f"data folder {path} holds no .npy arrays (one NAME.npy or NAME/*.npy per model input)")
    return out


def embedding_tables(g: PCG) -> dict[str, int]:
    """Input name -> rows of the embedding table it indexes (inputs feeding an Embedding's indices)."""
    out: dict[str, int] = {}
    for n in g.sources("Input"):
        stack, seen = [(n.id, 0)], set()
        while stack:
            ref = stack.pop()
            if ref in seen:
                continue
            seen.add(ref)
            for cid, pos in g.consumers(ref):
                c = g.node(cid)
                if c.kind == "parallel":
                    stack.append((cid, 0))
                elif c.op == "Embedding" and pos == 0:
                    rows = g.shape(tuple(c.inputs[1])).sizes[0]
                    name = n.a["name"]
                    out[name] = min(out.get(name, rows), rows)
    return out


def open_data(g: PCG, path: str | None, seed: int = 0, check: bool = True) -> DataSource:
    """The data source of a run over the graph ``g`` (its Input nodes give names, shapes, dtypes).

    Shapes and dtypes are always checked; ``check`` also scans the values (finite floats, embedding
    indices in range) in bounded chunks."""
    inputs = _inputs(g)
    if path is None:
        return DataSource(g, seed=seed)
    if os.path.isdir(path):
        arrays, kind = _open_dir(path), "dir"
    elif not os.path.exists(path):
        raise DataError(f"data file {path} does not exist")
    else:
        arrays, kind = _open_npz(path), "npz"
    what = f"data {'folder' if kind == 'dir' else 'file'} {path}"
    targets = arrays.pop("targets", None)
    missing = [n for n in inputs if n not in arrays]
    if missing:
        raise DataError(f"{what} has no array for model input {missing[0]!r} "
                        f"(it has: {', '.join(sorted(arrays)) or 'nothing'})")
    extra = [k for k in arrays if k not in inputs]
    if extra:
        raise DataError(f"{what}: array {extra[0]!r} is neither a model input "
                        f"({', '.join(inputs)}) nor 'targets'")
    batches = None
    dtypes = {}
    for name, a in inputs.items():
        v = arrays[name]
        shape = tuple(a["shape"])
        if v.ndim != len(shape) or tuple(v.shape[1:]) != shape[1:] or v.shape[0] % shape[0] or not v.shape[0]:
            raise DataError(f"{what}: input {name!r} has shape {list(v.shape)}; the model needs "
                            f"[k*{shape[0]}, {', '.join(map(str, shape[1:]))}] (k batches of {shape[0]})"
                            .replace(", ]", "]"))
        k = v.shape[0] // shape[0]
        if batches is not None and k != batches:
            raise DataError(f"{what}: input {name!r} holds {k} batches, another input {batches}")
        batches = k
        if v.dtype.kind not in "biuf":
            raise DataError(f"{what}: input {name!r} has the non-numeric dtype {v.dtype}")
        if a["dtype"].startswith(("int", "uint")) and v.dtype.kind not in "iu":
            raise DataError(f"{what}: input {name!r} must hold integers ({a['dtype']}), got {v.dtype}")
        dtypes[name] = np.dtype(numpy_dtype(a["dtype"]))
    batches = batches or 1
    if targets is not None:
        if targets.ndim == 0 or targets.shape[0] % batches:
            raise DataError(f"{what}: targets' first dim ({targets.shape[0] if targets.ndim else 0}) "
                            f"is not a multiple of the {batches} batches")
        if targets.dtype.kind not in "iuf":
            raise DataError(f"{what}: targets must be integers (classes) or floats, got {targets.dtype}")
    if check:
        tables = embedding_tables(g)
        for name in inputs:
            v = arrays[name]
            scan_finite(v, f"{what}: input {name!r}")
            if name in tables and v.dtype.kind in "iu":
                scan_range(v, 0, tables[name], f"{what}: input {name!r}",
                           f"it indexes an embedding table of {tables[name]} rows (0..{tables[name] - 1})")
    return DataSource(g, seed=seed, arrays=arrays, targets=targets, batches=batches, path=path, kind=kind,
                      dtypes=dtypes)
