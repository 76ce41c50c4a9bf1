"""The Python API: the command line's jobs as functions, with the same checks and the same errors.

    import unity_pcg as up
    model = up.import_model("mlp.onnx", check=True)           # the PCG, and the check against onnxruntime
    res = up.optimize("mlp.onnx", machine="local:1x2", budget=15, output="plan.json")
    print(up.explain(res))                                     # what `unity-pcg explain` prints
    out = up.train(res, "mlp.onnx", steps=20, data="train.npz", loss="mse", save_model="trained.onnx")

Each function fills the options of its command (``unity_pcg/commands/*_cmd.py``) from its keyword
arguments, over the command's own defaults, and runs the same code the command runs: what the command
refuses, the function refuses with the same one-line :class:`unity_pcg.errors.UnityError`.  A keyword
the command does not know is a ``TypeError`` naming the ones it knows.  Progress bars (tqdm) are drawn
on stderr where a terminal is attached (:mod:`unity_pcg.progress`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import UnityError


class _Parser(argparse.ArgumentParser):
    """A command's parser that raises instead of exiting: argparse's complaints become UnityErrors."""

    def error(self, message: str):
        raise UnityError(f"{self.prog}: {message}")


def _options(command: str, positionals: list[str], kwargs: Mapping[str, Any], fn: str) -> argparse.Namespace:
    """The namespace `unity-pcg COMMAND POSITIONALS` would get, with ``kwargs`` set by option name."""
    import importlib

    from .cli import COMMANDS
    mod = importlib.import_module(COMMANDS[command])
    p = _Parser(prog=f"unity_pcg.{fn}", add_help=False)
    mod.add_arguments(p)
    # options that only shape the command's printed output have no meaning here
    known = {a.dest for a in p._actions if a.dest not in ("help", "json")}
    ns = p.parse_args([str(x) for x in positionals])
    for k, v in kwargs.items():
        if k not in known:
            raise TypeError(f"{fn}() got an unexpected keyword argument {k!r} (known: "
                            f"{', '.join(sorted(known - {a.dest for a in p._actions if not a.option_strings}))})")
        setattr(ns, k, v)
    return ns


def _path(x, what: str) -> str:
    if not isinstance(x, (str, os.PathLike)):
        raise UnityError(f"{what} must be a file path, got {type(x).__name__}")
    return os.fspath(x)


# --- import -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImportedModel:
    """An imported model: its PCG, the numerical check when asked for, and its inputs and outputs."""
    path: str
    pcg: Any                 # unity_pcg.pcg.PCG
    check: Any | None        # unity_pcg.onnx_import.check.CheckResult (check=True) or None
    import_s: float

    @property
    def inputs(self) -> list[dict]:
        """Graph inputs in order: name, shape (batch first) and dtype -- the keys of a data file."""
        return [{"name": n.a["name"], "shape": list(n.a["shape"]), "dtype": n.a["dtype"]}
                for n in self.pcg.sources("Input")]

    @property
    def outputs(self) -> list[dict]:
        return [{"shape": list(self.pcg.shape(r).sizes), "dtype": self.pcg.shape(r).dtype} for r in self.pcg.outputs]

    def summary(self) -> dict:
        return self.pcg.summary()


def import_model(model, *, batch: int | None = None, check: bool = False, seed: int = 0,
                 fuse: bool = True) -> ImportedModel:
    """`unity-pcg import MODEL [--batch N] [--check [--seed S]] [--no-fuse]`.  With ``check=True`` the PCG is
    evaluated with numpy against onnxruntime; a difference raises :class:`UnityError` (the CLI exits 1)."""
    from .commands.import_cmd import load
    ns = _options("import", [_path(model, "model")], {"batch": batch, "check": check, "seed": seed,
                                                       "no_fuse": not fuse}, "import_model")
    g, chk, seconds = load(ns)
    if chk is not None and not chk.ok:
        bad = [o for o in chk.outputs if not o.ok]
        raise UnityError(f"import check: {os.path.basename(ns.model)} differs from onnxruntime "
                         f"(output {bad[0].name}: {bad[0].why})" if bad else "import check failed")
    return ImportedModel(ns.model, g, chk, seconds)


# --- optimize / simulate ------------------------------------------------------------------------------

def optimize(model, machine: str | None = None, *, budget: float | None = None, pipeline: bool = True,
             output=None, progress: bool | None = None, **options):
    """`unity-pcg optimize MODEL --machine M [--budget S] ...`: Unity's joint search (or another
    ``strategy=``).  Returns a ``search.optimize.OptimizeResult``: ``.plan`` (save with
    ``.plan.save(path)``, or pass ``output=``), ``.predicted_iteration_s``, ``.speedup_over_dp``,
    ``.json()``.  Other options by their command-line names: ``strategy``, ``optimizer``, ``precision``,
    ``batch``, ``alpha``, ``candidates``, ``seed``.  ``progress``: draw a progress bar (default: when stderr
    is a terminal)."""
    from .commands.optimize_cmd import _Progress, search
    kw = dict(options)
    if machine is not None:
        kw["machine"] = machine
    if budget is not None:
        kw["budget"] = budget
    kw["no_pipeline"] = not pipeline
    ns = _options("optimize", [_path(model, "model")], kw, "optimize")
    prog = None
    if progress is not False:
        prog = _Progress(total_s=ns.budget, show=progress)
        if prog.bar is None:     # no terminal (and not asked for): no bar, and no in-place lines either
            prog = None
    try:
        res = search(ns, prog)
    finally:
        if prog is not None:
            prog.done()
    if output is not None:
        res.plan.save(_path(output, "output"))
    return res


def _plan_of(plan):
    """A Plan from a plan file path, a Plan or an OptimizeResult."""
    from . import plan as P
    if isinstance(plan, (str, os.PathLike)):
        return P.load(os.fspath(plan))
    if isinstance(plan, P.Plan):
        return plan
    inner = getattr(plan, "plan", None)
    if isinstance(inner, P.Plan):
        return inner
    raise UnityError(f"plan must be a plan file path, a Plan or an optimize() result, got {type(plan).__name__}")


# --- explain ------------------------------------------------------------------------------------------

def explain(plan, *, optimizer: str | None = None):
    """`unity-pcg explain PLAN`: an ``explain.Explanation`` (``str()`` of it is the command's text,
    ``.to_json()`` its ``--json``)."""
    from .explanation import explain as _explain
    if optimizer not in (None, "sgd", "momentum", "adam"):
        raise UnityError(f"optimizer must be sgd, momentum or adam, got {optimizer!r}")
    return _explain(_plan_of(plan), optimizer=optimizer)


# --- train --------------------------------------------------------------------------------------------

def train(plan, model=None, *, data=None, **options) -> dict:
    """`unity-pcg run PLAN --model MODEL ...`: train on local processes (one per device of the plan) and
    return rank 0's result (``losses``, ``step_time_s``, ``predicted_iteration_s``, ...).

    ``plan``: a plan file, a Plan or an ``optimize()`` result; ``model``: the ONNX file (default: the
    one the plan records).  ``data``: a data file or folder as ``--data`` takes it, or a dict of numpy
    arrays by graph input name (plus ``targets``), written to a temporary ``.npz``.  Other options by
    their command-line names (``steps``, ``nproc``, ``loss``, ``optimizer``, ``lr``, ``seed``,
    ``checkpoint``, ``checkpoint_every``, ``resume``, ``save_model``, ``threads``, ``timeout``).  A run that
    fails raises ``executor.launch.RunFailed`` (a UnityError; ``.code`` is the CLI's exit status)."""
    from .commands.run_cmd import train as _train
    tmp = tempfile.mkdtemp(prefix="unity-pcg-train-")
    try:
        if isinstance(plan, (str, os.PathLike)):
            plan_path = os.fspath(plan)
            pl = None
        else:
            pl = _plan_of(plan)
            plan_path = os.path.join(tmp, "plan.json")
            pl.save(plan_path)
        if model is None:
            model = (pl if pl is not None else _plan_of(plan_path)).model_path
        kw = dict(options)
        if data is not None:
            kw["data"] = _data_path(data, tmp)
        ns = _options("run", [plan_path, "--model", _path(model, "model")], kw, "train")
        return _train(ns)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _data_path(data, tmp: str) -> str:
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    if isinstance(data, Mapping):
        import numpy as np
        path = os.path.join(tmp, "data.npz")
        try:
            np.savez(path, **{str(k): np.asarray(v) for k, v in data.items()})
        except (TypeError, ValueError) as e:
            raise UnityError(f"data: cannot store the arrays as .npz: {e}") from None
        return path
    raise UnityError(f"data must be a path or a dict of arrays by input name, got {type(data).__name__}")


# --- trained weights out ------------------------------------------------------------------------------

def export_weights(checkpoint, output, *, model=None, external_threshold: int | None = None) -> dict:
    """`unity-pcg export-weights CHECKPOINT -o OUTPUT [--model MODEL]`: the trained model of a run's latest
    checkpoint as OUTPUT (ONNX, the trained initializers) and OUTPUT's ``.safetensors`` beside it.  Returns
    the paths written, the initializers written and skipped, the checkpoint's step."""
    from .commands.export_weights_cmd import export
    kw = {"output": _path(output, "output"), "external_threshold": external_threshold}
    if model is not None:
        kw["model"] = _path(model, "model")
    ns = _options("export-weights", [_path(checkpoint, "checkpoint"), "-o", kw["output"]], kw, "export_weights")
    return export(ns)


def save_model(model, state, output, *, external_threshold: int | None = None) -> dict:
    """Write ``state`` (initializer name -> array or tensor, e.g. a checkpoint's ``read_model``) into a copy
    of the ONNX file ``model`` as OUTPUT (+ OUTPUT's ``.safetensors``): ``executor.export.save_model``."""
    from .executor.export import EXTERNAL_THRESHOLD, check_output
    from .executor.export import save_model as _save
    out = check_output(_path(output, "output"), "output")
    thr = EXTERNAL_THRESHOLD if external_threshold is None else external_threshold
    return _save(_path(model, "model"), state, out, external_threshold=thr)
