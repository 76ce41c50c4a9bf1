"""Checkpoints of a run with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint folder ``DIR``::

    DIR/step-00000003/          one DCP checkpoint (DCP's .metadata + *.distcp files), meta.json and
                                state-R.json per rank (the structure of that rank's state)
    DIR/step-00000005/
    DIR/latest                  the name of the newest complete checkpoint ("step-00000005")

What a checkpoint holds: the model's own parameters (the ONNX initializers' names, logical full tensors,
as ``Trainer.model_state()`` returns them), the optimizer state (``Trainer.optimizer_state()``, nested
dicts/lists whose tensor leaves go to DCP and whose other leaves go to ``state-R.json``), the number of
steps done (the dropout generator and the data are functions of the step, so this is all the random
state a run has), the run's seed and the torch CPU RNG state; meta.json also names the run's model and
its sha256 (``model``, ``model_sha256``: what `unity-pcg export-weights` writes the weights into).  A tensor's DCP key is its path in the
state ("model/fc1.weight", "optim/state/fc1.weight/exp_avg"): ranks that hold the same key hold the same
tensor (DCP writes it once and every rank reads it); a pipeline stage's tensors have keys of their own.

``latest`` is rewritten (atomically, by rank 0, after every rank has finished writing) only when a
checkpoint is complete, so a run that dies or diverges mid-save leaves the previous checkpoint as the
one ``--resume`` reads.  The two newest checkpoints are kept; the one ``latest`` names is never removed
or overwritten (a save of the step it names goes to ``step-0000000S.1``).

A save that fails to write (no space, no permission: any ``OSError`` on any rank, in DCP's data, a rank's
state, the meta or ``latest``) raises :class:`CheckpointWriteError` on every rank with the same one line
(every rank learns every rank's outcome: a gather after each write phase, so no rank waits on a peer
that gave up); the half-written folder is removed (best effort: it is never the latest) and ``latest``
still names the previous checkpoint.  Test hook: ``UNITY_PCG_FAULT_CKPT=R:S[:WHERE]`` makes rank R's
save of step S fail with ``OSError(ENOSPC)`` after writing part of its file, WHERE one of ``data`` (DCP's
tensor data, the default), ``state`` (``state-R.json``), ``latest`` (rank 0's ``latest``).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from typing import Any

from unity_pcg.errors import UnityError

LATEST = "latest"
META = "meta.json"
KEEP = 2


class CheckpointError(UnityError, ValueError):
    """A checkpoint folder that cannot be resumed from (missing, incomplete, for another model)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (no space, no permission); the previous one is still the latest.
    Raised on every rank with the same message."""


def check_writable(root: str) -> None:
    """Refuse, before a run starts, a checkpoint folder that cannot be written: a file, or a folder (or the
    nearest existing folder above a new one) without write permission."""
    p = os.path.abspath(root)
    if os.path.exists(p) and not os.path.isdir(p):
        raise CheckpointError(f"--checkpoint {root}: is a file, expected a folder")
    q = p
    while not os.path.exists(q):
        q = os.path.dirname(q)
    if not os.access(q, os.W_OK | os.X_OK):
        raise CheckpointError(f"--checkpoint {root}: cannot write into {q} (no permission)")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


# --- nested state <-> (flat tensors, JSON skeleton) ----------------------------------------------------

def flatten(obj: Any, prefix: str, tensors: dict) -> Any:
    """Move every tensor leaf of ``obj`` into ``tensors`` (key ``prefix/path``); return a JSON skeleton
    that :func:`unflatten` turns back into ``obj`` (dict keys keep their int/str type)."""
    import torch
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach()
        return {"t": prefix}
    if isinstance(obj, dict):
        return {"d": [[k, flatten(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [flatten(v, f"{prefix}/{i}", tensors)
                                                      for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise CheckpointError(f"checkpoint: cannot store a {type(obj).__name__} at {prefix}")


def unflatten(skel: Any, tensors: dict) -> Any:
    if "t" in skel:
        return tensors[skel["t"]]
    if "d" in skel:
        return {k: unflatten(v, tensors) for k, v in skel["d"]}
    if "l" in skel:
        return [unflatten(v, tensors) for v in skel["l"]]
    if "u" in skel:
        return tuple(unflatten(v, tensors) for v in skel["u"])
    return skel["v"]


# --- save / load ---------------------------------------------------------------------------------------

def _dist() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if _dist() else 0


def _fault(step: int) -> str | None:
    """Test hook ``UNITY_PCG_FAULT_CKPT=R:S[:WHERE]``: WHERE when this rank's save of step S is to fail."""
    v = os.environ.get("UNITY_PCG_FAULT_CKPT")
    if not v:
        return None
    parts = v.split(":")
    if int(parts[0]) != _rank() or int(parts[1]) != step:
        return None
    return parts[2] if len(parts) > 2 else "data"


def _no_space(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _writer(d: str, fault: bool):
    """DCP's file writer for folder ``d``; with ``fault`` one whose data write fails half-way (test hook)."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not fault:
        return FileSystemWriter(d)

    class _Full(FileSystemWriter):
        def write_data(self, plan, planner):
            p = os.path.join(d, f"__{_rank()}_fault.distcp")
            with open(p, "wb") as f:
                f.write(b"\0" * 64)
            raise _no_space(p)

    return _Full(d)


def _reason(e: BaseException) -> str:
    """One line for a failed write: the OSError's text (DCP wraps each rank's exception)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {_reason(x[0] if isinstance(x, tuple) else x)}"
                         for r, x in sorted(failures.items()))
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= 200 else s[:197] + "..."


def _gather_errors(err: str | None) -> list[tuple[int, str]]:
    """Every rank's error of a write phase (None: it succeeded), as (rank, message) of those that failed:
    the same list on every rank (a collective)."""
    import torch.distributed as dist
    if not _dist():
        return [(0, err)] if err else []
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, err)
    return [(r, m) for r, m in enumerate(out) if m]


def _target(root: str, step: int, latest: str | None) -> str:
    """The folder for the checkpoint of ``step``: ``step-S``, or ``step-S.1`` when ``latest`` names
    ``step-S`` (the latest is never overwritten)."""
    d = step_dir(root, step)
    if latest is not None and os.path.basename(d) == os.path.basename(latest):
        d += ".1"
    return d


def save(root: str, step: int, model: dict, optim: Any, extra: dict | None = None) -> str:
    """Write the checkpoint of ``step`` steps done under ``root`` (a collective: every rank calls it with
    its own state) and make it the latest.  Returns its folder.  A write that fails on any rank raises
    :class:`CheckpointWriteError` on every rank and leaves the previous latest as it was."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors: dict = {}
    skel = {"model": flatten(dict(model), "model", tensors), "optim": flatten(optim, "optim", tensors)}
    try:
        prev = latest_dir(root)      # every rank reads it: rank 0 rewrites it only after the last gather
    except OSError:
        prev = None
    d = _target(root, step, prev)
    fault = _fault(step)

    def failed(errors: list[tuple[int, str]]) -> CheckpointWriteError:
        if _rank() == 0 and os.path.isdir(d):  # half-written (never the latest): free its space
            shutil.rmtree(d, ignore_errors=True)
        why = "; ".join(m if m.startswith("rank ") else f"rank {r}: {m}" for r, m in errors)
        kept = (f"the latest is still {os.path.basename(prev)} (--resume continues from it)" if prev
                else "no earlier checkpoint")
        return CheckpointWriteError(f"the checkpoint of step {step} could not be written to {d} ({why}); {kept}")

    err = None
    if _rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(d):   # a half-written or an older one, never the latest: replace it
                shutil.rmtree(d)
        except OSError as e:
            err = _reason(e)
    errors = _gather_errors(err)
    if errors:
        raise failed(errors)
    try:
        with warnings.catch_warnings():   # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=_writer(d, fault == "data"), no_dist=not _dist())
    except (OSError, CheckpointException) as e:   # DCP raises it on every rank alike
        raise failed([(_rank(), _reason(e))]) from None
    err = None
    try:
        _write_atomic(os.path.join(d, f"state-{_rank()}.json"), json.dumps(skel), fault == "state")
        if _rank() == 0:
            meta = {"step": step, "torch_rng": torch.get_rng_state().tolist(), **(extra or {})}
            _write_atomic(os.path.join(d, META), json.dumps(meta))
    except OSError as e:
        err = _reason(e)
    errors = _gather_errors(err)
    if errors:
        raise failed(errors)
    err = None
    if _rank() == 0:
        try:
            _write_atomic(os.path.join(root, LATEST), os.path.basename(d) + "\n", fault == "latest")
        except OSError as e:
            err = _reason(e)
        else:
            _prune(root, keep=KEEP)
    errors = _gather_errors(err)
    if errors:
        raise failed(errors)
    return d


def _write_atomic(path: str, text: str, fault: bool = False) -> None:
    """Write ``text`` to ``path`` through ``path.tmp`` and a rename: ``path`` is the old text or the new,
    never a part.  A failed write removes the temporary file.  ``fault``: fail half-way (test hook)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            if fault:
                f.write(text[: len(text) // 2])
                f.flush()
                raise _no_space(path)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _prune(root: str, keep: int) -> None:
    """Remove all but the ``keep`` newest ``step-*`` folders, never the one ``latest`` names (nothing is
    removed when ``latest`` cannot be read)."""
    try:
        latest = latest_dir(root)
        dirs = sorted(x for x in os.listdir(root) if x.startswith("step-") and os.path.isdir(os.path.join(root, x)))
    except OSError:
        return
    if latest is None:
        return
    for x in dirs[:-keep]:
        if x != os.path.basename(latest):
            shutil.rmtree(os.path.join(root, x), ignore_errors=True)


def latest_dir(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` or None."""
    p = os.path.join(root, LATEST)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    return os.path.join(root, name) if name else None


def read_meta(root: str, context: str = "--resume: ") -> dict:
    """The meta.json of the latest checkpoint; refuses a folder without a complete one (no collective).
    ``context`` starts each error line (who asked)."""
    d = latest_dir(root)
    if d is None:
        raise CheckpointError(f"{context}no checkpoint in {root} (no {LATEST} file names a complete one)")
    try:
        with open(os.path.join(d, META)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{context}checkpoint {d} is incomplete (no {META})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{context}cannot read {d}/{META} ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{context}{d}/{META} is not a checkpoint description")
    meta["dir"] = d
    return meta


def check_resume(root: str, plan_sha256: str, optimizer: str, world: int, memory: dict | None = None) -> dict:
    """The latest checkpoint's meta, refusing one written by a run of another plan, optimizer, rank count
    or memory techniques (``memory``: the plan's ``memory`` field as JSON, None for none; no collective:
    `unity-pcg run` calls it before launching, every rank again)."""
    meta = read_meta(root)
    d = meta["dir"]
    if "memory" in meta and (meta["memory"] or None) != (memory or None):
        raise CheckpointError(f"--resume: checkpoint {d} was written with memory techniques {_mem(meta['memory'])}, "
                              f"this plan has {_mem(memory)}")
    if meta.get("plan_sha256") not in (None, plan_sha256):
        raise CheckpointError(f"--resume: checkpoint {d} was written by a run of another plan")
    if meta.get("optimizer") not in (None, optimizer):
        raise CheckpointError(f"--resume: checkpoint {d} holds {meta['optimizer']} state; this run uses "
                              f"--optimizer {optimizer}")
    if meta.get("world") not in (None, world):
        raise CheckpointError(f"--resume: checkpoint {d} was written by {meta['world']} ranks, this run has {world}")
    return meta


def memory_json(plan) -> dict | None:
    """The plan's memory field as a checkpoint records it (None: no memory technique)."""
    m = getattr(plan, "memory", None)
    return None if m is None or m.empty else m.to_json()


def _mem(m: dict | None) -> str:
    """A plan's memory field in words (for error lines)."""
    if not m:
        return "none"
    parts = [f"ZeRO-{m['zero']}"] if m.get("zero") else []
    parts += ["offload"] if m.get("offload") else []
    parts += [f"{len(m['recompute'])} recompute region(s)"] if m.get("recompute") else []
    return ", ".join(parts) or "none"


def load(root: str) -> tuple[dict, Any, dict]:
    """(model state, optimizer state, meta) of the latest checkpoint under ``root`` (a collective)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_meta(root)
    d = meta["dir"]
    md = dcp.FileSystemReader(d).read_metadata()
    tensors = {}
    for k, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            tensors[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    try:
        with open(os.path.join(d, f"state-{_rank()}.json")) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError):
        raise CheckpointError(f"--resume: checkpoint {d} has no readable state-{_rank()}.json "
                              "(written by a run with fewer ranks?)") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=d, no_dist=not _dist())
    return unflatten(state["model"], tensors), unflatten(state["optim"], tensors), meta


def read_model(root: str) -> dict:
    """The model's parameters in the latest checkpoint under ``root``, merged over every rank's part (a
    pipeline stage holds its own): for inspection or export, in one process."""
    import glob

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    d = read_meta(root)["dir"]
    md = dcp.FileSystemReader(d).read_metadata()
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in md.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata) and k.startswith("model/")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=d, no_dist=True)
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(d, "state-*.json"))):
        with open(path) as f:
            out.update(unflatten(json.load(f)["model"], tensors))
    return out
