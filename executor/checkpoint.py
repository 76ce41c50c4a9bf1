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
one ``--resume`` reads.  The two newest checkpoints are kept.
"""
from __future__ import annotations

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


def _barrier() -> None:
    import torch.distributed as dist
    if _dist():
        dist.barrier()


def save(root: str, step: int, model: dict, optim: Any, extra: dict | None = None) -> str:
    """Write the checkpoint of ``step`` steps done under ``root`` (a collective: every rank calls it with
    its own state) and make it the latest.  Returns its folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    d = step_dir(root, step)
    tensors: dict = {}
    skel = {"model": flatten(dict(model), "model", tensors), "optim": flatten(optim, "optim", tensors)}
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(d):  # a half-written one from a run that died: replace it
            shutil.rmtree(d)
    _barrier()
    with warnings.catch_warnings():   # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=d, no_dist=not _dist())
    _write_atomic(os.path.join(d, f"state-{_rank()}.json"), json.dumps(skel))
    if _rank() == 0:
        meta = {"step": step, "torch_rng": torch.get_rng_state().tolist(), **(extra or {})}
        _write_atomic(os.path.join(d, META), json.dumps(meta))
    _barrier()
    if _rank() == 0:
        _write_atomic(os.path.join(root, LATEST), os.path.basename(d) + "\n")
        _prune(root, keep=KEEP)
    _barrier()
    return d


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: str, keep: int) -> None:
    dirs = sorted(x for x in os.listdir(root) if x.startswith("step-") and os.path.isdir(os.path.join(root, x)))
    latest = latest_dir(root)
    for x in dirs[:-keep]:
        if os.path.join(root, x) != latest:
            shutil.rmtree(os.path.join(root, x), ignore_errors=True)


def latest_dir(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` or None."""
    p = os.path.join(root, LATEST)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    return os.path.join(root, name) if name else None


def read_meta(root: str) -> dict:
    """The meta.json of the latest checkpoint; refuses a folder without a complete one (no collective)."""
    d = latest_dir(root)
    if d is None:
        raise CheckpointError(f"--resume: no checkpoint in {root} (no {LATEST} file)")
    try:
        with open(os.path.join(d, META)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"--resume: checkpoint {d} is incomplete (no {META})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"--resume: {d}/{META} is not JSON: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"--resume: {d}/{META} is not a checkpoint description")
    meta["dir"] = d
    return meta


def check_resume(root: str, plan_sha256: str, optimizer: str, world: int) -> dict:
    """The latest checkpoint's meta, refusing one written by a run of another plan, optimizer or rank
    count (no collective: `unity-pcg run` calls it before launching, every rank again)."""
    meta = read_meta(root)
    d = meta["dir"]
    if meta.get("plan_sha256") not in (None, plan_sha256):
        raise CheckpointError(f"--resume: checkpoint {d} was written by a run of another plan")
    if meta.get("optimizer") not in (None, optimizer):
        raise CheckpointError(f"--resume: checkpoint {d} holds {meta['optimizer']} state; this run uses "
                              f"--optimizer {optimizer}")
    if meta.get("world") not in (None, world):
        raise CheckpointError(f"--resume: checkpoint {d} was written by {meta['world']} ranks, this run has {world}")
    return meta


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
