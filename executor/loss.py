"""The loss of a run (``--loss``), chosen explicitly or derived from the data, and checked against it.

=======  ====================================================================================
mean     the mean of the model's first output (only when asked for; no targets)
mse      mean squared error against float ``targets`` of the output's shape
ce       cross-entropy against integer class ``targets`` (classes on dim 1 of the output; the
         targets have the output's shape without dim 1), values in ``0 .. C-1``
bce      binary cross-entropy with logits against float 0/1 ``targets`` of the output's shape
output   the model's ONNX graph computes its own loss: its first output is the loss (a scalar, or
         the mean is taken over it); its targets are ordinary graph inputs fed by name
=======  ====================================================================================

Without ``--loss``: float targets -> mse, integer targets -> ce, no targets and a one-element first
output -> output; no targets and a larger output is refused (pass ``--loss``).  Every loss is computed on
the pieces of the output where they lie (executor.train ``_piece_loss``), so it equals one device's.
"""
from __future__ import annotations

import math

from .data import DataError, DataSource, scan_finite, scan_range
from unity_pcg.errors import UnityError

LOSSES = ("mean", "mse", "ce", "bce", "output")
TARGET_LOSSES = ("mse", "ce", "bce")


class LossError(UnityError, ValueError):
    """A --loss that does not fit the model or the data."""


def output_sizes(g) -> tuple[int, ...]:
    """Logical sizes of the graph's first output."""
    return tuple(g.shape(tuple(g.outputs[0])).sizes)


def resolve_loss(g, loss: str | None, data: DataSource) -> tuple[str, str | None]:
    """``(loss, note)``: the loss given, or the one derived from the data (``note`` says how, None when
    given).  Refuses a model whose output is not a loss when no targets and no --loss say what to do."""
    if loss is not None:
        if loss not in LOSSES:
            raise LossError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        return loss, None
    t = data.targets
    if t is not None:
        if t.dtype.kind == "f":
            return "mse", "mse (float targets; pass --loss to choose another)"
        return "ce", "ce (integer class targets; pass --loss to choose another)"
    sizes = output_sizes(g)
    if math.prod(sizes) == 1:
        return "output", "output (no targets, the model's first output is one number: its own loss)"
    raise LossError(f"the model's first output has shape {list(sizes)} and there are no targets: pass --loss "
                    f"(mean: train on the output's mean; mse|ce|bce: with a 'targets' array in --data)")


def check_loss(g, loss: str, data: DataSource, scan: bool = True) -> None:
    """Refuse a loss that does not fit the targets (dtype, shape, values when ``scan``), before step 0."""
    t = data.targets
    where = data.path or "the random feeds"
    if loss in ("mean", "output"):
        if t is not None:
            how = "the model computes its own loss: feed its targets as graph inputs by input name" \
                if loss == "output" else "it takes the output's mean"
            raise LossError(f"--loss {loss} takes no 'targets' array, but {where} has one ({how})")
        return
    if t is None:
        raise LossError(f"--loss {loss} needs targets: a 'targets' array in --data"
                        + ("" if data.path else " (random feeds have none)"))
    sizes = output_sizes(g)
    per = data.target_rows()
    got = [per] + list(t.shape[1:])
    what = f"data {where}: targets"
    if loss in ("mse", "bce"):
        if t.dtype.kind != "f":
            raise LossError(f"--loss {loss} needs float targets, {where} has {t.dtype} targets"
                            + (" (integer classes: --loss ce)" if t.dtype.kind in "iu" else ""))
        if tuple(got) != sizes:
            raise LossError(f"--loss {loss}: targets have shape {got} per batch, the model's output "
                            f"{list(sizes)}")
        if scan:
            scan_finite(t, what)
            if loss == "bce":
                scan_range(t, 0.0, 1.0, what, "--loss bce needs targets in [0, 1]", right_open=False)
        return
    # ce
    if t.dtype.kind not in "iu":
        raise LossError(f"--loss ce needs integer class targets, {where} has {t.dtype} targets"
                        + (" (float targets: --loss mse or bce)" if t.dtype.kind == "f" else ""))
    if len(sizes) < 2:
        raise LossError(f"--loss ce needs an output with classes on dim 1, the model's output has shape "
                        f"{list(sizes)}")
    want = [sizes[0]] + list(sizes[2:])
    if got != want:
        raise LossError(f"--loss ce: class targets have shape {got} per batch, the output {list(sizes)} needs "
                        f"{want} (classes on dim 1)")
    if scan:
        scan_range(t, 0, sizes[1], what, f"--loss ce needs classes 0..{sizes[1] - 1} (the output's dim 1)")


def check_resume_loss(checkpoint: str, loss: str) -> None:
    """Refuse resuming a checkpoint written by a run with another loss (meta ``loss``; older ones pass)."""
    from .checkpoint import read_meta
    meta = read_meta(checkpoint)
    if meta.get("loss") not in (None, loss):
        raise LossError(f"--resume: checkpoint {meta['dir']} was trained with --loss {meta['loss']}; this run "
                        f"uses --loss {loss}")


__all__ = ["LOSSES", "LossError", "resolve_loss", "check_loss", "check_resume_loss", "DataError"]
