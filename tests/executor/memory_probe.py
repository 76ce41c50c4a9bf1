"""What a Trainer really holds during a training step, in bytes (the measured side of the memory model's
check: tests/executor/test_memory_prediction.py, benchmarks/memory_check.py).

:class:`Probe` wraps one step of an :class:`unity_pcg.executor.train.Trainer` and takes *moments*: after
every forward step of the lowered program, at the end of the forward, after each recomputation of a
checkpointed run (torch.utils.checkpoint) in the backward, whenever the backward makes the gradient of a
forward value (a tensor hook), as each node of the backward graph finishes (a node post-hook: its incoming
gradients, those it made and what it saved alive at once), and when the optimizer steps.  At a moment it
counts every tensor storage the rank holds, each storage once (a view keeps its whole storage alive):

* ``state``: the Trainer's parameters (ZeRO-3: the shards, and the values gathered for the forward or
  again for the backward), gradients (``.grad``, gradient buckets, reduce-scatter outputs, shard
  gradients) and optimizer states and updated copies on the device (host copies of offload are not
  device memory and are left out);
* ``saved``: tensors the autograd graph saved for the backward and still holds (counted through
  ``torch.autograd.graph.saved_tensors_hooks``, chained with ZeRO-3's own hooks; the inputs a
  checkpointed run keeps are saved through them too), plus the tensors a recomputation produced for
  the backward of its run, from the recomputation until the backward unpacks each (the checkpoint
  frame's table of recomputed values);
* ``grads``: gradients of forward values the backward has made and not yet freed (each tracked by a weak
  reference to its storage from its hook on);
* ``held``: other forward values the program still references (its table of local tensors and the
  feeds), which the autograd graph does not need;
* ``temps``: in the backward, every other tensor an operator made that is still alive: the temporaries
  inside a backward node (mse's ``grad * 2 * diff``: made and freed within the node, seen by no hook)
  -- a dispatch mode (``TorchDispatchMode``) notes each operator's outputs (a weak reference to the
  storage) and takes a moment after every operator of the backward, on the step's thread only (the
  copies gloo's collectives make on their worker threads are the CPU backend's, not the plan's).

The peak is the moment with the most bytes.  Parameters are never counted as activations.  The probe
patches ``torch.utils.checkpoint._recomputation_hook`` while active (a private torch name: a torch
without it raises at once rather than measuring wrong).
"""
from __future__ import annotations

import contextlib
import threading
import resource
import weakref
from dataclasses import dataclass, field


def _storage(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Box:
    """A saved tensor as the autograd graph holds it: lives exactly as long as the graph keeps it."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


@dataclass
class Moment:
    where: str
    state: int
    saved: int
    held: int
    grads: int = 0                        # gradients of activations alive (the backward's moments)
    temps: int = 0                        # other outputs of the backward's operators still alive

    @property
    def total(self) -> int:
        return self.state + self.saved + self.held + self.grads + self.temps

    @property
    def activations(self) -> int:
        return self.saved + self.held


@dataclass
class Measured:
    peak: Moment                          # the moment with the most bytes
    forward_end: Moment                   # the end of the forward pass
    saved_peak: int                       # most saved bytes at any moment
    memory_bytes: dict                    # Trainer.memory_bytes() after the step
    rss_peak: int                         # the process's peak resident set (bytes, ru_maxrss)
    moments: int = 0
    where: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak.total, "peak_at": self.peak.where, "state_bytes": self.peak.state,
                "saved_bytes": self.peak.saved, "held_bytes": self.peak.held, "grads_bytes": self.peak.grads,
                "temps_bytes": self.peak.temps,
                "forward_end_bytes": self.forward_end.total, "saved_peak_bytes": self.saved_peak,
                "memory_bytes": dict(self.memory_bytes), "rss_peak_bytes": self.rss_peak, "moments": self.moments}


class Probe:
    """Measure one :meth:`Trainer.step` (see module docstring): ``with Probe(tr) as p: tr.step(...)``;
    then ``p.result()``."""

    def __init__(self, trainer):
        self.tr = trainer
        self.live: dict = {}          # storage ptr -> [boxes alive, nbytes]
        self.moments: list[Moment] = []
        self._vals: list = []         # the forward's table of values (while it runs)
        self._feeds: dict = {}
        self._in_forward = False
        self._exclude: set = set()
        self.grads: dict = {}         # storage ptr -> (weak reference to the storage, nbytes)
        self.frames: list = []        # (weak reference to a checkpoint frame, gid) recomputed in the backward
        self.temps: dict = {}         # storage ptr -> (weak reference, nbytes): the backward's operator outputs
        self._ops = None              # the dispatch mode noting them (during the backward)

    # --- saved tensors ---------------------------------------------------------------------------------
    def _pack(self, t):
        import torch
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        ptr, nb = _storage(t)
        if nb == 0 or ptr in self._exclude:
            return t
        box = _Box(t)
        ent = self.live.setdefault(ptr, [0, nb])
        ent[0] += 1
        weakref.finalize(box, self._drop, ptr)
        return box

    def _drop(self, ptr) -> None:
        ent = self.live.get(ptr)
        if ent is not None:
            ent[0] -= 1
            if ent[0] <= 0:
                del self.live[ptr]

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Box) else x

    def _hooks(self):
        import torch
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # --- inventory -------------------------------------------------------------------------------------
    def _state_tensors(self) -> list:
        tr = self.tr
        out = []
        for p in tr.params.values():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(getattr(tr, "_flat", {}).values())
        out.extend(getattr(tr, "_rs_out", {}).values())
        z = tr._zrt
        if z is not None:
            for sh in z.shards:
                out.append(sh)
                if sh.grad is not None:
                    out.append(sh.grad)
            if not z.offload:
                for u in z.upd:
                    out.append(u)
                    if u.grad is not None:
                        out.append(u.grad)
                    out.extend(v for v in z.opt.state.get(u, {}).values() if hasattr(v, "untyped_storage"))
            out.extend(z.work.values())
            out.extend(z.flat_bw.values())
            out.extend(z.work_bw.values())
        else:
            for st in getattr(tr.opt, "state", {}).values():
                out.extend(v for v in st.values() if hasattr(v, "untyped_storage") and v.dim())
        return [t for t in out if t is not None and t.device.type != "meta"]

    def moment(self, where: str, extra=(), tables=(), grads=()) -> None:
        import torch
        seen: set = set()
        state = 0
        for t in self._state_tensors():
            ptr, nb = _storage(t)
            if nb and ptr not in seen:
                seen.add(ptr)
                state += nb
        saved = 0
        for ptr, (_, nb) in self.live.items():
            if ptr not in seen:
                seen.add(ptr)
                saved += nb
        for t in extra:
            if isinstance(t, torch.Tensor):
                ptr, nb = _storage(t)
                if nb and ptr not in seen:
                    seen.add(ptr)
                    saved += nb
        for t in self._pending():
            ptr, nb = _storage(t)
            if nb and ptr not in seen:
                seen.add(ptr)
                saved += nb
        held = 0
        tables = list(self._vals) + list(tables) + [self._feeds]
        for tab in tables:
            for t in list(tab.values()):
                if isinstance(t, torch.Tensor):
                    ptr, nb = _storage(t)
                    if nb and ptr not in seen:
                        seen.add(ptr)
                        held += nb
        gsum = 0
        for t in grads:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr, nb = _storage(t)
                if nb and ptr not in seen:
                    seen.add(ptr)
                    gsum += nb
        for ptr, (ref, nb) in list(self.grads.items()):
            if ref.expired():
                del self.grads[ptr]
            elif ptr not in seen:
                seen.add(ptr)
                gsum += nb
        tsum = 0
        for ptr, (ref, nb, _) in list(self.temps.items()):
            if ref.expired():
                del self.temps[ptr]
            elif ptr not in seen and ptr not in self._exclude:
                seen.add(ptr)
                tsum += nb
        self.moments.append(Moment(where, state, saved, held, gsum, tsum))

    def _op_mode(self):
        """A dispatch mode for the backward: notes the storage of every operator's outputs and takes a
        moment after each operator (the temporaries inside a backward node are alive then)."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        probe = self
        main = threading.get_ident()

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if threading.get_ident() != main:    # a collective's worker (gloo's copies; NCCL makes none)
                    return out
                for t in tree_flatten(out)[0]:
                    if type(t) is torch.Tensor and t.device.type != "meta":    # plain tensors (a DTensor's
                        st = t.untyped_storage()                              # local one is seen itself)
                        if st.nbytes():
                            probe.temps[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), func.__name__)
                probe.moment(f"backward op {func.__name__}")
                return out
        return _Ops()

    def _pending(self) -> list:
        """Tensors recomputations have produced that the backward has not unpacked yet: a checkpoint frame
        holds them (``frame.recomputed[gid]``, a weak-key table that loses each entry when its saved slot is
        unpacked) until the backward of the operator that saved them runs."""
        out = []
        alive = []
        for ref, gid in self.frames:
            frame = ref()
            if frame is None:
                continue
            vals = list(frame.recomputed.get(gid, {}).values())
            if vals:
                alive.append((ref, gid))
                out.extend(vals)
        self.frames = alive
        return out

    # --- gradients of activations ------------------------------------------------------------------------
    def _watch(self, t, name: str) -> None:
        """Take a moment when the backward makes ``t``'s gradient, counting it (and every other gradient of
        an activation still alive: a weak reference to its C++ storage, which outlives the Python tensor
        the hook saw) until it is freed."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        if not isinstance(t, torch.Tensor) or not t.requires_grad or t.device.type == "meta":
            return
        probe = self

        def hook(grad):
            st = grad.untyped_storage()
            if st.nbytes():
                probe.grads[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            probe.moment(f"backward {name}")
            return None
        t.register_hook(hook)

    def _hook_graph(self, out) -> None:
        """Take a moment as each node of the backward graph of ``out`` finishes (a post-hook): its incoming
        gradients, the gradients it has just made and what it saved are all alive then -- the busiest
        instant of a backward step, which a tensor hook (after the node has released its incoming
        gradient) does not see."""
        import torch
        probe = self
        roots = []
        stack = [out]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                if x.grad_fn is not None:
                    roots.append(x.grad_fn)
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
        seen: dict = {}                 # id -> node (held, so that no id is reused during the walk)
        while roots:
            node = roots.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            name = node.name()

            def post(grad_inputs, grad_outputs, name=name):
                probe.moment(f"backward node {name}", grads=[*grad_inputs, *grad_outputs])
            node.register_hook(post)
            roots.extend(nf for nf, _ in node.next_functions)

    # --- patching --------------------------------------------------------------------------------------
    def __enter__(self):
        import torch.utils.checkpoint as ckpt
        tr = self.tr
        probe = self
        self._stack = contextlib.ExitStack()
        st = self._stack
        self._exclude = {_storage(p)[0] for p in tr.params.values() if p.numel()}
        if tr._zrt is not None:
            self._exclude |= {_storage(s)[0] for s in tr._zrt.shards}

        def patch(obj, name, new):
            old = getattr(obj, name)
            setattr(obj, name, new)
            st.callback(setattr, obj, name, old)
            return old

        run_step = tr._run_step

        def _run_step(step, vals, *a, **k):
            if probe._in_forward and not probe._vals:
                probe._vals.append(vals)        # the forward's table (a checkpointed run has its own)
            before = set(vals)
            r = run_step(step, vals, *a, **k)
            for key in set(vals) - before:
                probe._watch(vals[key], f"{step.kind} {step.node}")
            if probe._in_forward:
                inner = [] if probe._vals and probe._vals[0] is vals else [vals]
                probe.moment(f"forward {step.op if step.kind == 'compute' else step.kind} {step.node}",
                             tables=inner)
            return r
        patch(tr, "_run_step", _run_step)

        run = tr._run

        def _run(*a, **k):
            probe._in_forward = True
            vals = run(*a, **k)
            probe.moment("forward end", ())
            probe.forward_end = probe.moments[-1]
            probe._in_forward = False
            return vals
        patch(tr, "_run", _run)

        feeds = tr._feeds

        def _feeds(*a, **k):
            fv = feeds(*a, **k)
            probe._feeds = fv
            return fv
        patch(tr, "_feeds", _feeds)

        forward = tr._forward

        def _forward(*a, **k):
            out = forward(*a, **k)
            probe._hook_graph(out)
            probe._vals.clear()          # the value tables are gone with the forward
            probe._feeds = {}
            probe.moment("backward start")
            probe._ops = probe._op_mode()
            probe._ops.__enter__()
            return out
        patch(tr, "_forward", _forward)

        opt_step = tr.opt.step

        def _opt_step(*a, **k):
            probe._end_ops()
            probe.moment("optimizer step")
            return opt_step(*a, **k)
        patch(tr.opt, "step", _opt_step)

        if tr._zrt is not None and tr.memory.zero == 3:
            zhooks = tr._zrt.hooks

            def hooks():
                import torch
                h = zhooks()

                def pack(t):
                    r = h.pack_hook(t)
                    return r if isinstance(r, tuple) else probe._pack(r)

                def unpack(x):
                    return h.unpack_hook(x) if isinstance(x, tuple) else probe._unpack(x)
                return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            patch(tr._zrt, "hooks", hooks)

        base = ckpt._recomputation_hook

        class _Recomputation(base):
            def __init__(self, frame_ref, gid):
                super().__init__(frame_ref, gid)
                self._frame_ref, self._gid = frame_ref, gid

            def __exit__(self, *exc):
                r = super().__exit__(*exc)
                if self._frame_ref() is not None:
                    probe.frames.append((self._frame_ref, self._gid))
                    probe.moment("recomputed")
                return r
        patch(ckpt, "_recomputation_hook", _Recomputation)
        st.enter_context(self._hooks())
        self.forward_end = None
        return self

    def _end_ops(self) -> None:
        if self._ops is not None:
            self._ops.__exit__(None, None, None)
            self._ops = None

    def __exit__(self, *exc):
        self._end_ops()
        self._stack.close()
        return False

    def result(self) -> Measured:
        peak = max(self.moments, key=lambda m: m.total)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return Measured(peak, self.forward_end, max(m.saved for m in self.moments), self.tr.memory_bytes(), rss,
                        len(self.moments))


__all__ = ["Probe", "Measured", "Moment"]
