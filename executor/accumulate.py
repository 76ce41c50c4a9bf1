"""Gradient accumulation: a plan with one pipeline stage and M micro-batches, run by the Trainer's lowering.

A plan whose ``pipeline`` field has one stage is data/tensor parallelism over M micro-batches: the search's
``accumulate`` writes it (with memory techniques: ZeRO, recompute, offload) when the full batch does not fit.
:class:`AccumulationTrainer` runs it as a :class:`executor.train.Trainer` of the plan's PCG at the
micro-batch (``search.pipeline.rebatch``: the same node ids, views and ``memory`` field, batch B/M), so every
memory technique runs as it does without micro-batches.  One ``step(feeds, targets)``:

* the batch splits into M micro-batches of consecutive rows (micro-batch m: rows ``m*B/M`` on, as
  ``micro_graph`` and the pipeline runtime split it); each runs forward and backward (recompute regions per
  micro-batch; ZeRO-3 gathers per micro-batch and reduce-scatters each micro-batch's gradient into the
  shards, as FSDP does when parameters are not kept gathered);
* gradients accumulate locally; the backward of micro-batch m < M-1 launches no gradient bucket (DDP's
  ``no_sync``), the last one launches them as the Trainer does: one all-reduce (ZeRO-2: reduce-scatter) of
  the accumulated buckets, then one update (ZeRO's sharded one where the plan says so);
* each micro-batch's loss is scaled by 1/M before its backward, so the gradient is the whole batch's mean
  loss's; the step's loss is the mean of the micro-batch losses (the pipeline runtime's definition), the
  same float on every rank.

Dropout draws its mask at the element's index in the whole batch (micro-batch m's rows are offset by m
times the micro-batch's dim 0), so accumulated training equals one process.  Feeds and targets are whole
batches (``feed_rows`` is the whole batch).  What the executor refuses for one stage (BatchNorm without
``--per-device-bn``, random generators, a batch M does not divide) is checked by
:func:`executor.pipeline.check_pipeline` before any process starts.
"""
from __future__ import annotations


import numpy as np
import torch

from .kernels import ExecutorError
from .pipeline import micro_plan, one_stage  # noqa: F401  (re-exported)
from .train import Trainer


class AccumulationTrainer(Trainer):
    """The Trainer API for a one-stage pipeline plan (gradient accumulation; see module doc)."""

    def __init__(self, plan, model_path: str | None = None, rank: int = 0, world: int = 1, **kw):
        from .lower import dropout_key
        from .pipeline import check_pipeline
        check_pipeline(plan, per_device_bn=not kw.get("sync_batchnorm", True))
        self.M, self.batch, micro = micro_plan(plan)
        self.full_plan = plan
        self._accumulating = False
        super().__init__(micro, model_path, rank=rank, world=world, **kw)
        # Dropout: the mask of an element is drawn at its index in the whole batch
        full_g = plan.pcg
        self._dropout = []
        for st in self.low.steps:
            if st.op == "Dropout" and st.ctx is not None:
                full = tuple(full_g.shapes(st.node)[0].sizes)
                micro0 = self.g.shapes(st.node)[0].sizes[0] if full and full[0] != self.g.shapes(st.node)[0].sizes[0] \
                    else 0
                st.ctx.node_id = dropout_key(full_g, st.node)
                st.ctx.out_logical = (full,)
                self._dropout.append((st, tuple(st.ctx.out_offset[0]), micro0))

    def _grad_ready(self, name: str) -> None:
        if not self._accumulating:          # micro-batches before the last launch no bucket (no_sync)
            super()._grad_ready(name)

    def feed_rows(self) -> dict[str, tuple[int, int]]:
        """Every input's whole batch: each micro-batch's rows of this rank lie anywhere in it."""
        return {n.a["name"]: (0, n.a["shape"][0] if n.a["shape"] else 0) for n in self.full_plan.pcg.sources("Input")}

    def target_rows(self, kind: str | None = None) -> tuple[int, int]:
        """The whole targets (or none for a loss without them)."""
        kind = kind or self.loss or "mse"
        if kind in ("output", "mean"):
            return (0, 0)
        out = self.full_plan.pcg.shape(tuple(self.full_plan.pcg.outputs[0]))
        return (0, out.sizes[0] if out.rank else 1)

    def _split(self, t: torch.Tensor, n: int, what: str) -> list:
        if t.dim() == 0 or t.shape[0] != n:
            raise ExecutorError(f"{what} has shape {list(t.shape)}: accumulation over {self.M} micro-batches "
                                f"takes the whole batch of {n} rows")
        return list(torch.chunk(t, self.M, dim=0))

    def step(self, feeds=None, targets=None) -> float:
        """One step over the M micro-batches; returns the mean of their losses (the same on every rank)."""
        if feeds is None:
            from unity_pcg.evaluate import random_feeds
            feeds = random_feeds(self.full_plan.pcg, seed=self.seed * 1_000_003 + self.step_no)
        micro_feeds: list[dict] = [{} for _ in range(self.M)]
        for n in self.full_plan.pcg.sources("Input"):
            name = n.a["name"]
            if name not in feeds:
                raise ExecutorError(f"no value fed for input {name!r}")
            v = feeds[name]
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(v))
            full = tuple(n.a["shape"])
            if not full or full[0] != self.batch:        # not batched: every micro-batch reads all of it
                for d in micro_feeds:
                    d[name] = t
                continue
            if tuple(t.shape) != full:
                raise ExecutorError(f"input {name!r} has shape {list(t.shape)}, the plan expects {list(full)}")
            for d, part in zip(micro_feeds, self._split(t, self.batch, f"input {name!r}")):
                d[name] = part
        kind, tt = self._loss_kind(targets)
        ref, need, split = self._loss_ref(kind)
        if tt is not None:
            out = self.full_plan.pcg.shape(tuple(self.full_plan.pcg.outputs[0]))
            tts = self._split(tt, out.sizes[0] if out.rank else 1, "the targets")
        zero3 = self._zrt if self.memory.zero == 3 else None
        parts = torch.zeros(1, device=self.device)
        for m in range(self.M):
            last = m == self.M - 1
            fv = self._feeds(micro_feeds[m])
            tm = None
            if tt is not None:
                tm = tts[m]
                self._tgt_off = self._target_offset(tm, kind, ref)
            for st, base, micro0 in self._dropout:
                st.ctx.out_offset = ((base[0] + m * micro0,) + tuple(base[1:]),) if micro0 else (base,)
            total, part = self._forward_step(fv, kind, tm, ref, need, split)
            parts = parts + part.to(parts.dtype)
            self._accumulating = not last
            if last:
                self._start_step_sync(parts / self.M)
            if total.requires_grad:
                (total / self.M).backward()
            if zero3 is not None:
                zero3.end_step()
        self._accumulating = False
        if zero3 is None:
            self._finish_sync()
        return self._update_and_loss(parts / self.M)


__all__ = ["AccumulationTrainer", "micro_plan", "one_stage"]
