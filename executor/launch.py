"""Checks before launch, and the local launch of the ranks of a run.

``check(plan_path, model_path, nproc)`` does everything that can fail before a process starts: the plan
loads and validates (``unity_pcg.plan.load``), the model file's sha256 is the one the plan was made for,
and the number of processes equals the plan's device count.

*Device count of a plan* (:func:`plan_world`): a rank is a device id, so a plan needs the ranks
``0 .. D-1`` where ``D - 1`` is the largest device id any of its machine views (or pipeline stages) use.
A plan priced on a bigger machine whose views use only its first devices therefore runs on that many
processes; the machine's own device count does not matter.

``launch(rank_args, nproc)`` starts ``nproc`` local ranks with torch's elastic launch API (the code
behind ``torchrun --standalone``: a c10d rendezvous on a free local port, no restarts), each running
``python -m unity_pcg.executor RANK_ARGS``.  The elastic agent watches the children: when one fails, it stops the
others at once (SIGTERM; 30 s later SIGKILL to a rank that is stopped and cannot die).  Each rank leaves a
one-line report in the run's report folder (``rank-R.json``: kind, message, and for a failed collective
the ranks whose heartbeats stood still) before it exits on an error it can name; rank 0 also writes
``result.json``.  From the exit codes and these reports :func:`diagnose` picks the one line that names
the cause: a rank that hung (its peers timed out on it), else a rank killed by a signal (other than the
agent's own SIGTERM), else a rank's own error, else a rank that lost its peers.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field

from unity_pcg.errors import PlanError, UnityError

# exit codes of a rank (executor/__main__.py)
EXIT_ERROR = 2      # a user error (plan, model, data, checkpoint): one line, every rank says the same
EXIT_PEER = 3       # a collective failed because another rank died or stopped answering
EXIT_DIVERGED = 4   # the loss or the parameters became NaN/inf
EXIT_CHECKPOINT = 5  # a checkpoint could not be written (no space, no permission); the previous one is kept


class RunFailed(UnityError):
    """A run that started and failed; ``code`` is the exit status `unity-pcg run` returns, ``exitcodes``
    the ranks' exit codes (negative: killed by that signal)."""

    def __init__(self, msg: str, code: int = 1, exitcodes: dict | None = None):
        super().__init__(msg)
        self.code = code
        self.exitcodes = dict(exitcodes or {})


def plan_devices(plan) -> list[int]:
    """Every device id the plan's machine views and pipeline stages use, sorted."""
    devs: set[int] = set()
    for v in plan.views.values():
        devs.update(v.devices())
    for st in (plan.pipeline or {}).get("stages", []) or []:
        if isinstance(st, dict):
            devs.update(int(d) for d in st.get("devices", []) if isinstance(d, int))
    return sorted(devs)


def plan_world(plan) -> int:
    """The number of ranks a plan runs on: the largest device id it uses + 1 (a rank is a device id)."""
    devs = plan_devices(plan)
    if not devs:
        raise PlanError("plan: no machine views (nothing says which device runs an operator)")
    return devs[-1] + 1


def plan_optimizer(plan) -> str:
    """The optimizer a run uses when --optimizer is not given: the one the plan was priced for (its memory and
    update time assume it), else plain SGD."""
    rec = (plan.predicted or {}).get("optimizer") or (plan.info or {}).get("optimizer")
    return rec if rec in ("sgd", "momentum", "adam") else "sgd"


def check(plan_path: str, model_path: str | None, nproc: int | None = None, per_device_bn: bool = False):
    """Load and validate the plan, check the model against it and the process count; returns
    ``(plan, world)``.  Raises a one-line UnityError; starts nothing."""
    from unity_pcg import plan as P
    from unity_pcg.weightfree import refuse_weight_free
    refuse_weight_free(model_path)      # a planning-only file (export-structure): no weights to train
    plan = P.load(plan_path)
    plan.check_model(model_path)
    world = plan_world(plan)
    if nproc is not None:
        if nproc < 1:
            raise UnityError(f"--nproc must be a positive integer, got {nproc}")
        if nproc != world:
            raise PlanError(f"plan {plan_path} runs on {world} device(s) (its views use devices up to "
                            f"{world - 1}; a rank is a device), but --nproc is {nproc}")
    if plan.pipeline is not None:
        from .pipeline import check_pipeline
        check_pipeline(plan, per_device_bn=per_device_bn)
    return plan, world


@dataclass
class Outcome:
    result: dict
    exitcodes: dict = field(default_factory=dict)


def _quiet_elastic():
    """Silence the elastic agent's own log lines (the launcher prints one line of its own)."""
    saved = {}
    # elastic's module loggers carry their own level (torch.distributed.elastic.utils.logging), so each
    # one is silenced, not just the package's
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    for name in names:
        lg = logging.getLogger(name)
        saved[name] = lg.level
        lg.setLevel(logging.CRITICAL)
    return saved


def launch(rank_args: list[str], nproc: int, *, report_dir: str | None = None) -> Outcome:
    """Run ``python -m unity_pcg.executor RANK_ARGS --report-dir DIR`` on ``nproc`` local ranks; returns rank 0's
    result or raises :class:`RunFailed` with one line naming the cause."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    own = report_dir is None
    rdir = report_dir or tempfile.mkdtemp(prefix="unity-pcg-run-")
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"unity-pcg-{uuid.uuid4().hex[:8]}",
                       rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                       logs_specs=DefaultLogsSpecs(log_dir=os.path.join(rdir, "elastic")))
    saved = _quiet_elastic()
    try:
        elastic_launch(cfg, sys.executable)("-m", "unity_pcg.executor", *rank_args, "--report-dir", rdir)
        res = _read(os.path.join(rdir, "result.json"))
        if res is None:
            raise RunFailed("rank 0 finished without writing its result", code=1)
        return Outcome(res, {r: 0 for r in range(nproc)})
    except SignalException as e:   # Ctrl-C / SIGTERM to the launcher: the agent has stopped the ranks
        raise RunFailed(f"interrupted ({_signame(-int(e.sigval))}); the ranks were stopped",
                        code=128 + int(e.sigval)) from None
    except ChildFailedError as e:
        codes = {r: 0 for r in range(nproc)}
        codes.update({int(r): f.exitcode for r, f in e.failures.items()})
        msg, code = diagnose(codes, {r: _read(os.path.join(rdir, f"rank-{r}.json")) for r in range(nproc)})
        raise RunFailed(msg, code=code, exitcodes=codes) from None
    finally:
        for name, lv in saved.items():
            logging.getLogger(name).setLevel(lv)
        if own:
            import shutil
            shutil.rmtree(rdir, ignore_errors=True)


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _signame(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_word(c) -> str:
    if c is None:
        return "running"
    return f"killed by {_signame(c)}" if c < 0 else f"exit status {c}"


def diagnose(exitcodes: dict, reports: dict) -> tuple[str, int]:
    """One line naming the cause of a failed run, and the exit status for it.

    ``exitcodes``: rank -> exit code (negative: killed by that signal); ``reports``: rank -> the rank's
    report ({"kind", "message"}) or None.  Order: a rank killed by a signal it did not get from the
    agent (anything but SIGTERM), then a rank's own error or divergence (rank 0's first), then a rank
    that exited non-zero without a report, then a rank that only lost its peers."""
    ranks = sorted(exitcodes)
    for r in ranks:   # a rank whose peers timed out on it: it hung (the launcher killed it afterwards)
        rep = reports.get(r) or {}
        if rep.get("kind") == "peer" and rep.get("timed_out") and rep.get("silent"):
            return str(rep.get("message", "")), 1
    for r in ranks:
        c = exitcodes[r]
        if c is not None and c < 0 and -c != signal.SIGTERM and not (reports.get(r) or {}).get("kind"):
            others = ", ".join(f"rank {q}: {_exit_word(exitcodes[q])}" for q in ranks if q != r)
            return f"rank {r} died (killed by {_signame(c)}); the other ranks stopped ({others})", 1
    for kind, code in (("error", 2), ("checkpoint", 1), ("diverged", 1), ("internal", 1)):
        for r in ranks:
            rep = reports.get(r) or {}
            if rep.get("kind") == kind:
                return str(rep.get("message", "")), code
    for r in ranks:
        c = exitcodes[r]
        if c and c > 0 and not reports.get(r):
            return f"rank {r} exited with status {c} without a message", 1
    for r in ranks:
        rep = reports.get(r) or {}
        if rep.get("kind") == "peer":
            return str(rep.get("message", "")), 1
    for r in ranks:
        c = exitcodes[r]
        if c:
            what = f"killed by {_signame(c)}" if c < 0 else f"exit status {c}"
            return f"rank {r} failed ({what})", 1
    return "the run failed (no rank said why)", 1
