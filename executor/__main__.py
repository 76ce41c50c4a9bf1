"""One rank of a run: ``python -m unity_pcg.executor plan.json --model MODEL.onnx [options]``.

This is what `unity-pcg run` starts on every local rank, and what ``torchrun`` runs across machines::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m unity_pcg.executor plan.json --model model.onnx --steps 100

The rank and world size come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); without it the process is rank 0 of 1 (a one-device plan).  Every rank validates the plan,
the model and the world size itself (the same checks `unity-pcg run` makes before launching), joins the
process group (nccl when CUDA is available, else gloo; collective timeout ``--timeout``), then trains:
``executor.train.Trainer`` for plans without pipeline stages, ``executor.pipeline.PipelineTrainer`` for
plans with them.  Rank 0 prints one progress line per step (loss, step time).

Failures end every rank with one line and a non-zero status: 2 for a user error (plan, model, data,
checkpoint), 3 when a collective fails because a peer died or stopped answering, 4 when the loss or the
parameters turn NaN/inf (the last good checkpoint is left as it is), 5 when a checkpoint cannot be written
(no space, no permission: the line says so, ``latest`` still names the previous checkpoint and ``--resume``
continues from it; `unity-pcg run` exits 1 for it), 1 for anything else.  With
``--report-dir`` each failing rank also writes ``rank-R.json`` (kind, message) and rank 0 writes
``result.json`` for the launcher.

Every rank of a multi-rank run bumps a heartbeat counter in the process group's store (:class:`Heartbeat`);
when a collective fails, the ranks whose counters stand still are named in the failure line.

Test hooks: ``UNITY_PCG_FAULT_KILL=R:S`` makes rank R kill itself with SIGKILL when it reaches step S
(0-based, counted over resumes), the way a crashed or OOM-killed worker dies; ``UNITY_PCG_FAULT_HANG=R:S``
wedges it there (its heartbeat stops, it never returns), the way a stuck worker stops answering;
``UNITY_PCG_FAULT_CKPT=R:S[:WHERE]`` makes rank R's checkpoint write of step S fail with no space left
(``executor/checkpoint.py``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import statistics
import sys
import time

import numpy as np

from unity_pcg.errors import UnityError

from .checkpoint import CheckpointWriteError
from .launch import EXIT_CHECKPOINT, EXIT_DIVERGED, EXIT_ERROR, EXIT_PEER


class Diverged(Exception):
    """The loss or the parameters became NaN/inf."""


class PeerLost(Exception):
    """A collective failed: another rank died or stopped answering."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unity_pcg.executor", description="one rank of a unity-pcg run "
                                "(started by `unity-pcg run` or torchrun)")
    add_training_arguments(p)
    p.add_argument("--report-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--progress", choices=("stdout", "stderr", "none"), default="stdout",
                   help="where rank 0 prints one line per step (default stdout)")
    return p


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The options `unity-pcg run` and ``python -m unity_pcg.executor`` share."""
    p.add_argument("plan", metavar="plan.json", help="plan file (unity-pcg optimize / simulate -o)")
    p.add_argument("--model", required=True, metavar="MODEL.onnx",
                   help="the ONNX model the plan was made for (its sha256 must match the plan)")
    p.add_argument("--steps", type=int, default=10, metavar="N",
                   help="training steps to run (with --resume: steps after the checkpoint; default 10)")
    p.add_argument("--data", default=None, metavar="FILE.npz|DIR",
                   help="inputs by ONNX input name (+ optional 'targets'): an .npz file, or a folder of NAME.npy "
                        "(memory-mapped) or NAME/*.npy shards; default: seeded random feeds")
    p.add_argument("--loss", default=None, choices=("mean", "mse", "ce", "bce", "output"),
                   help="mean: of the first output; mse / bce: against float targets; ce: integer class "
                        "targets; output: the graph's first output is its own loss (default: mse for float "
                        "targets, ce for integer ones, output for a one-element output without targets)")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default=None,
                   help="sgd, momentum (SGD, 0.9) or adam (default: the optimizer the plan was priced for, else sgd)")
    p.add_argument("--lr", type=float, default=0.01, metavar="X", help="learning rate (default 0.01)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of random feeds and dropout (default 0)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="checkpoint folder (torch.distributed.checkpoint); written at the end of the run "
                        "and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint")
    p.add_argument("--save-model", default=None, metavar="OUT.onnx",
                   help="at the end, write the trained model: MODEL.onnx with the trained initializers "
                        "(+ OUT.safetensors by initializer name; external data past 2 GiB)")
    p.add_argument("--per-device-bn", action="store_true",
                   help="BatchNorm statistics per device (as DDP without SyncBatchNorm; such runs are not "
                        "claimed equal to one device)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads per rank (`unity-pcg run` default: cores // ranks; under torchrun: "
                        "OMP_NUM_THREADS). More threads than free cores slow CPU training down many times")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds a collective may wait for a peer before the run stops (default 30)")


# --- the rank ----------------------------------------------------------------------------------------

def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def _is_peer_error(e: BaseException) -> bool:
    import torch.distributed as dist
    if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError, ... (torch >= 2.2)
        return True
    s = str(e)
    return isinstance(e, RuntimeError) and any(k in s for k in (
        "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe",
        "gloo", "NCCL", "ProcessGroup"))


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= 300 else s[:297] + "..."


class Heartbeat:
    """Each rank bumps a counter in the process group's store every ``period`` seconds (a daemon thread).
    When a collective fails, the ranks whose counters stand still are the ones that died or stopped
    answering: the failure line names them.  The store is the launcher's (torchrun's agent hosts it), so
    it outlives a dead rank; without it the line names no rank."""

    KEY = "unity-pcg/heartbeat/{}"

    def __init__(self, rank: int, world: int, period: float = 0.25):
        import threading

        import torch.distributed.distributed_c10d as c10d
        self.rank, self.world, self.period = rank, world, period
        self.store = c10d._get_default_store()
        self.store.add(self.KEY.format(rank), 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unity-pcg-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.store.add(self.KEY.format(self.rank), 1)
            except Exception:  # noqa: BLE001 -- the store is gone: nothing left to tell
                return

    def counts(self) -> list[int]:
        return [int(self.store.add(self.KEY.format(r), 0)) for r in range(self.world)]

    def silent(self, wait: float = 1.5) -> list[int]:
        """Ranks (other than this one) whose counter does not move for ``wait`` seconds; [] if unknown."""
        try:
            a = self.counts()
            time.sleep(wait)
            b = self.counts()
        except Exception:  # noqa: BLE001
            return []
        return [r for r in range(self.world) if r != self.rank and a[r] == b[r]]

    def stop(self) -> None:
        self._stop.set()


class Rank:
    """State of one rank's run (what the loop, the checkpoints and the reports share)."""

    def __init__(self, args, rank: int, world: int):
        self.args, self.rank, self.world = args, rank, world
        self.step = 0            # steps done (counted over resumes)
        self.last_ckpt = None    # folder of the last good checkpoint
        self.heartbeat: Heartbeat | None = None

    def out(self, line: str) -> None:
        if self.rank != 0 or self.args.progress == "none":
            return
        print(line, file=sys.stdout if self.args.progress == "stdout" else sys.stderr, flush=True)

    def report(self, kind: str, message: str, **extra) -> None:
        if self.args.report_dir:
            _write_json(os.path.join(self.args.report_dir, f"rank-{self.rank}.json"),
                        {"kind": kind, "message": message, **extra})


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def make_trainer(plan, args, rank: int, world: int, device: str):
    """The trainer of a plan: pipeline stages -> PipelineTrainer, else the lowering's Trainer."""
    kw = dict(rank=rank, world=world, optimizer=args.optimizer, lr=args.lr, seed=args.seed, device=device,
              sync_batchnorm=not args.per_device_bn, loss=args.loss)
    if plan.pipeline is not None:
        from .pipeline import PipelineTrainer
        return PipelineTrainer(plan, args.model, **kw)
    from .train import Trainer
    return Trainer(plan, args.model, **kw)


def _step_bar(R: Rank):
    """Rank 0's progress bar over the run's steps where its progress stream is a terminal (else the
    bar draws nothing and each step prints one line)."""
    from unity_pcg.progress import _Silent, bar
    if R.rank != 0 or R.args.progress == "none":
        return _Silent()
    return bar(R.args.steps, "train", unit="step",
               stream=sys.stdout if R.args.progress == "stdout" else sys.stderr)


def _fault_step(kind: str = "KILL") -> int | None:
    v = os.environ.get(f"UNITY_PCG_FAULT_{kind}")
    if not v:
        return None
    r, s = v.split(":")
    return int(s) if int(r) == _env_int("RANK", 0) else None


def _hang(R: Rank) -> None:
    """Test hook: wedge this rank (no more heartbeats, never returns; SIGTERM still ends it)."""
    if R.heartbeat is not None:
        R.heartbeat.stop()
    while True:
        time.sleep(3600)


def _all_finite(state: dict) -> bool:
    import torch
    return all(bool(torch.isfinite(t).all()) for t in state.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _agree(flag: bool) -> bool:
    """True on every rank iff ``flag`` is True on every rank (a MIN all-reduce)."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"   # nccl: GPU tensors
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _steps_done_attr(trainer) -> str | None:
    for name in ("step_no", "steps_done"):
        if hasattr(trainer, name):
            return name
    return None


def save_checkpoint(R: Rank, trainer) -> None:
    from . import checkpoint as C
    model = trainer.model_state()
    if not _agree(_all_finite(model)):
        raise Diverged(f"step {R.step}: parameters are NaN/inf after the update; stopped; "
                       + _kept(R))
    R.last_ckpt = C.save(R.args.checkpoint, R.step, model, trainer.optimizer_state(),
                         {"seed": R.args.seed, "optimizer": R.args.optimizer, "world": R.world,
                          "plan_sha256": _plan_hash(R.args.plan), "loss": R.args.loss,
                          "memory": C.memory_json(getattr(trainer, "plan", None)), **_model_meta(R)})


def _model_meta(R: Rank) -> dict:
    """The model of the run (path, sha256) for `unity-pcg export-weights` (hashed once per run)."""
    if getattr(R, "_model_meta", None) is None:
        from unity_pcg.plan import file_sha256
        R._model_meta = {"model": os.path.abspath(R.args.model), "model_sha256": file_sha256(R.args.model)}
    return R._model_meta


def save_model(R: Rank, plan, trainer) -> str | None:
    """--save-model: every rank contributes its state (a collective), rank 0 writes the files."""
    from .export import save_model as write, trained_state
    state = trained_state(trainer, plan.pipeline is not None)
    if R.rank != 0:
        return None
    batch = next((n.a["shape"][0] for n in plan.pcg.sources("Input") if n.a.get("shape")), None)
    res = write(R.args.model, state, R.args.save_model, batch=batch)
    if res["skipped"]:
        print(f"executor: warning: trained weights not written back to {R.args.save_model} (not a layout of "
              f"one initializer): {', '.join(res['skipped'][:8])}", file=sys.stderr, flush=True)
    R.out(f"saved the trained model to {res['onnx']} and {res['safetensors']}")
    return res["onnx"]


def _kept(R: Rank) -> str:
    return f"last good checkpoint {R.last_ckpt} kept" if R.last_ckpt else "no checkpoint was written"


def _plan_hash(path: str) -> str:
    from unity_pcg.plan import file_sha256
    return file_sha256(path)


def resume(R: Rank, trainer) -> None:
    import torch
    from . import checkpoint as C
    C.check_resume(R.args.checkpoint, _plan_hash(R.args.plan), R.args.optimizer, R.world,
                   C.memory_json(getattr(trainer, "plan", None)))
    model, optim, meta = C.load(R.args.checkpoint)
    trainer.load_model_state(model)
    trainer.load_optimizer_state(optim)
    R.step = int(meta["step"])
    attr = _steps_done_attr(trainer)
    if attr is not None:
        setattr(trainer, attr, R.step)
    if "torch_rng" in meta:
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
    R.last_ckpt = meta["dir"]


def train(R: Rank, plan) -> dict:
    import torch
    from .data import open_data

    args = R.args
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    from .loss import check_loss, check_resume_loss, resolve_loss
    # under `unity-pcg run` (a report folder) the launcher has scanned the data's values already
    data = open_data(plan.pcg, args.data, seed=args.seed, check=not args.report_dir)
    args.loss, note = resolve_loss(plan.pcg, args.loss, data)
    check_loss(plan.pcg, args.loss, data, scan=not args.report_dir)
    if note:
        R.out(f"loss: {note}")
    if args.resume:
        check_resume_loss(args.checkpoint, args.loss)
    trainer = make_trainer(plan, args, R.rank, R.world, device)
    rows = trainer.feed_rows() if hasattr(trainer, "feed_rows") else None
    trows = trainer.target_rows() if hasattr(trainer, "target_rows") and data.targets is not None else None
    if args.resume:
        resume(R, trainer)
        R.out(f"resumed from {R.last_ckpt} (step {R.step})")
    R.out(f"training {args.model} on {R.world} rank(s) ({device}), {args.optimizer} lr {args.lr}, "
          f"{data.describe()}")
    kill_at, hang_at = _fault_step("KILL"), _fault_step("HANG")
    bar = _step_bar(R)
    losses, times = [], []
    fed: dict = {}
    rss0 = _peak_rss()      # the peak before any step (model, trainer, process group)
    first = R.step
    for i in range(args.steps):
        s = R.step
        if kill_at is not None and s == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if hang_at is not None and s == hang_at:
            _hang(R)
        feeds, targets = data.feeds(s, rows, trows)
        if i == 0:
            fed = {k: int(np.shape(v)[0]) if np.ndim(v) else 1 for k, v in feeds.items()}
            if targets is not None:
                fed["targets"] = int(np.shape(targets)[0]) if np.ndim(targets) else 1
        t0 = time.perf_counter()
        try:
            loss = trainer.step(feeds, targets)
        except UnityError as e:   # a trainer that refuses a non-finite loss itself
            m = re.search(r"loss is (-?nan|-?inf)", str(e))
            if not m:
                raise
            loss = float(m.group(1))
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        R.step = s + 1
        if not math.isfinite(loss):
            raise Diverged(f"step {R.step}: loss is {loss}; stopped; {_kept(R)}")
        losses.append(float(loss))
        times.append(dt)
        if bar.drawn:
            bar.set_postfix_str(f"loss {loss:.6g}  {dt * 1e3:.2f} ms", refresh=False)
            bar.update(1)
        else:
            R.out(f"step {R.step:>5}  loss {loss:.6g}  {dt * 1e3:.2f} ms")
        if args.checkpoint and args.checkpoint_every and R.step % args.checkpoint_every == 0 \
                and i + 1 < args.steps:
            save_checkpoint(R, trainer)
    bar.close()
    if args.checkpoint and args.steps > 0:
        save_checkpoint(R, trainer)
    saved = save_model(R, plan, trainer) if args.save_model else None
    warm = times[1:] if len(times) > 1 else times
    pred = plan.predicted.get("predicted_iteration_s")
    ranks = _per_rank({"peak_rss_bytes": _peak_rss(), "before": rss0, "fed_rows": fed})
    return {"losses": losses, "step_times_s": times,
            "step_time_s": statistics.median(warm) if warm else None,
            "predicted_iteration_s": pred if isinstance(pred, (int, float)) else None,
            "nproc": R.world, "first_step": first, "steps": len(losses), "device": device,
            "optimizer": args.optimizer, "lr": args.lr, "loss": args.loss, "checkpoint": R.last_ckpt,
            "pipeline": plan.pipeline is not None, "saved_model": saved,
            # per rank: peak resident set (ru_maxrss) and the rows of each array fed at the first step
            "rank_peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "rank_peak_rss_before_steps_bytes": [r["before"] for r in ranks],
            "rank_fed_rows": [r["fed_rows"] for r in ranks]}


def _peak_rss() -> int:
    """This process's peak resident set in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(v) if sys.platform == "darwin" else int(v) * 1024


def _per_rank(obj) -> list:
    """``obj`` of every rank, in rank order (an all_gather_object when a process group is up)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


#: the CUDA caching allocator's setting for a rank unless the user sets PYTORCH_CUDA_ALLOC_CONF: expandable
#: segments grow one mapping instead of caching fixed blocks, so a plan the memory model fits to a device
#: does not run out of memory for fragmentation (a logits-sized block that no cached block holds)
CUDA_ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)     # read at the first CUDA allocation
    args = build_parser().parse_args(argv)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    R = Rank(args, rank, world)
    if args.threads:
        import torch
        torch.set_num_threads(max(1, args.threads))
    initialized = False
    try:
        if args.steps < 0:
            raise UnityError(f"--steps must be >= 0, got {args.steps}")
        if args.resume and not args.checkpoint:
            raise UnityError("--resume needs --checkpoint DIR")
        if args.save_model:
            from .export import check_output
            check_output(args.save_model)
        from .launch import check, plan_optimizer
        plan, need = check(args.plan, args.model, None, args.per_device_bn)
        args.optimizer = args.optimizer or plan_optimizer(plan)
        if need != world:
            raise UnityError(f"plan {args.plan} runs on {need} rank(s) (a rank is a device), this run has "
                             f"{world}" + ("" if world > 1 else ": start it with `unity-pcg run` or torchrun"))
        if args.resume:
            from .checkpoint import check_resume, memory_json
            # a missing or foreign checkpoint is a user error, found before any collective
            check_resume(args.checkpoint, _plan_hash(args.plan), args.optimizer, world, memory_json(plan))
        import torch
        import torch.distributed as dist
        if world > 1 or "MASTER_ADDR" in os.environ:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            # every process group of the run (the trainer's sub-groups too: new_group takes torch's
            # 30-minute default, not the world group's) waits at most --timeout for a peer
            import torch.distributed.distributed_c10d as c10d
            c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=args.timeout)
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=args.timeout))
            initialized = True
            if world > 1:
                try:
                    R.heartbeat = Heartbeat(rank, world)
                except Exception:  # noqa: BLE001 -- no store to use: failures name no rank
                    R.heartbeat = None
        res = train(R, plan)
        if rank == 0:
            if args.report_dir:
                _write_json(os.path.join(args.report_dir, "result.json"), res)
            if res["step_time_s"] is not None:
                pred = res["predicted_iteration_s"]
                R.out(f"done: {res['steps']} steps, median step {res['step_time_s'] * 1e3:.2f} ms"
                      + (f" (predicted {pred * 1e3:.2f} ms)" if pred else ""))
        code = 0
    except CheckpointWriteError as e:   # the same line on every rank
        code = _fail(R, "checkpoint", str(e), EXIT_CHECKPOINT)
    except UnityError as e:
        code = _fail(R, "error", str(e), EXIT_ERROR)
    except Diverged as e:
        code = _fail(R, "diverged", str(e), EXIT_DIVERGED)
    except KeyboardInterrupt:   # the launcher passes Ctrl-C on to the ranks; it says so itself
        code = _fail(R, "interrupted", f"rank {rank}: interrupted at step {R.step + 1}", 130)
    except Exception as e:  # noqa: BLE001 -- every failure ends in one line, never a traceback
        if _is_peer_error(e):
            code = _peer_failure(R, e)
        else:
            code = _fail(R, "internal", f"rank {rank}: {type(e).__name__} at step {R.step + 1}: {_one_line(e)}", 1)
            if os.environ.get("UNITY_PCG_TRACEBACK"):
                import traceback
                traceback.print_exc()
    if initialized and code == 0:
        # every rank is done before any leaves; the process then exits without tearing the process groups
        # down (os._exit in __main__): gloo's teardown with live subgroups can abort a finished rank
        try:
            import torch.distributed as dist
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            code = _fail(R, "peer", f"rank {rank}: the final barrier failed: {_one_line(e)}", EXIT_PEER)
    return code


def _peer_failure(R: Rank, e: BaseException) -> int:
    """A collective failed: name the ranks that stopped (their heartbeats stand still) when we can."""
    silent = R.heartbeat.silent() if R.heartbeat is not None else []
    timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
    what = f"timed out after {R.args.timeout:g} s" if timed_out else "failed"
    if silent:
        who = ", ".join(f"rank {r}" for r in silent)
        msg = (f"{who} stopped answering (no heartbeat): rank {R.rank}'s collective {what} at step {R.step + 1}")
    else:
        msg = (f"rank {R.rank}: a collective {what} at step {R.step + 1} (another rank died or stopped "
               f"answering): {_one_line(e)}")
    return _fail(R, "peer", msg, EXIT_PEER, silent=silent, timed_out=timed_out)


def _fail(R: Rank, kind: str, message: str, code: int, **extra) -> int:
    if R.heartbeat is not None:
        R.heartbeat.stop()
    R.report(kind, message, **extra)
    # under the local launcher (a report folder) the launcher prints the one line; under torchrun the ranks
    # do: user errors and divergence are the same on every rank, so rank 0 says it; other failures per rank
    if R.args.report_dir:
        return code
    if R.rank == 0 or kind in ("peer", "internal"):
        print(f"executor: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    rc = main()
    # leave at once: a failed rank does not wait in process-group teardown on peers that are gone, and a
    # finished one (past the final barrier) has nothing left to tear down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
