"""Memory per device of a mapped PCG.

On each device: every weight piece it holds (the end of a weight's placement chain, or a weight read
directly by a compute operator) times ``2 + optimizer states`` (weight, gradient, and 0 / 1 / 2 state
copies for SGD / SGD with momentum / Adam) if it is trained, once if not (BatchNorm running
statistics, integer index tables); every activation piece it holds that the backward pass needs
(:func:`kept_fraction`: a tensor some consumer saves for its gradient, e.g. the input of a Linear
or the output of a Relu, or a graph output; a view such as a Reshape's output or the output of an
Add that nobody saves is freed after the forward pass; Dropout keeps a one-byte mask per element);
and the input shards the data loader feeds it. No rematerialization.  A plan whose busiest device
exceeds ``MachineSpec.device.usable_bytes`` (the capacity less the
runtime's reserve) is infeasible.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np

from unity_pcg import ops
from unity_pcg.machine import MachineView

from .cost import OPTIMIZER_STATES, GraphCost


@dataclass
class MemoryReport:
    per_device: dict           # device -> bytes
    weights: dict              # device -> bytes of weights + grads + optimizer states
    activations: dict          # device -> bytes of activations and input shards
    capacity: int

    @property
    def max_bytes(self) -> int:
        return max(self.per_device.values(), default=0)

    @property
    def feasible(self) -> bool:
        return self.max_bytes <= self.capacity

    def reason(self) -> str:
        if self.feasible:
            return ""
        dev = max(self.per_device, key=self.per_device.get)
        need = self.per_device[dev]
        return (f"device {dev} needs {format_bytes(need)} "
                f"(weights+grads+optimizer {format_bytes(self.weights.get(dev, 0))}, activations "
                f"{format_bytes(self.activations.get(dev, 0))}) but has {format_bytes(self.capacity)}: "
                f"{format_bytes(need - self.capacity)} over capacity")


def format_bytes(b: float) -> str:
    """Bytes in GiB, two decimals; small amounts in MiB or bytes so that "over by" is never 0.00."""
    if b >= 2**30 / 100:
        return f"{b / 2**30:.2f} GiB"
    if b >= 2**20 / 100:
        return f"{b / 2**20:.2f} MiB"
    return f"{int(b)} bytes"


# what an operator saves for its backward pass is stated by its registry entry (``OpSpec.saves``,
# unity_pcg.ops.saves); these are views of it: the input positions each operator saves (an operator absent
# saves all its inputs) and the operators that save their own output
SAVES_INPUTS: dict = {n: set(s.saves.inputs) for n, s in ops.REGISTRY.items()
                      if s.saves is not None and s.saves.inputs != ops.ALL}
SAVES_OUTPUT = frozenset(n for n, s in ops.REGISTRY.items() if s.saves is not None and s.saves.output)


def kept_fraction(g, nid: int, k: int, saves_copy=None) -> float:
    """Fraction of output ``k`` of node ``nid`` held until the backward pass: 1 when its producer or
    a consumer saves it or it is a graph output; a Dropout output that nobody saves keeps only its
    one-byte-per-element mask; else 0.  ``saves_copy(u, pos)``: true when consumer ``u`` saves a
    converted copy of its input ``pos`` rather than the tensor itself (autocast's casts; the copy is
    counted at the consumer, :func:`node_memory`)."""
    node = g.node(nid)
    if node.op in SAVES_OUTPUT or (nid, k) in set(map(tuple, g.outputs)):
        return 1.0
    uses = g.consumers((nid, k))
    if not uses:
        return 1.0
    for u, pos in uses:
        saved = SAVES_INPUTS.get(g.node(u).op)
        if (saved is None or pos in saved) and not (saves_copy is not None and saves_copy(u, pos)):
            return 1.0
    if ops.saves(node.op).mask:     # Dropout: a one-byte mask per element
        return 1.0 / g.shapes(nid)[k].itemsize
    return 0.0


def node_memory(gc: GraphCost, nid: int, view: MachineView) -> tuple[dict, dict]:
    """What node ``nid`` on ``view`` holds: (device -> bytes of weights + grads + optimizer states,
    device -> bytes of kept activations and input shards).  A mapping's memory per device is the sum
    of these over its nodes (:func:`memory_per_device`), which is what lets the machine-mapping DP
    add memory up subproblem by subproblem.  Memoized per (node, view) on ``gc`` (a function of the
    graph and the model); the dicts returned are shared: read them, do not change them."""
    memo = gc.__dict__.get("_node_mem")
    if memo is None:
        memo = gc._node_mem = {}
    key = (nid, view)
    hit = memo.get(key)
    if hit is None:
        if len(memo) > 200_000:
            memo.clear()
        hit = memo[key] = _node_memory_of(gc, nid, view)
    return hit


def _node_memory_of(gc: GraphCost, nid: int, view: MachineView) -> tuple[dict, dict]:
    """:func:`node_memory` computed (not memoized)."""
    g = gc.g
    w: dict = {}
    a: dict = {}
    role = gc.role[nid]
    node = g.node(nid)
    if role == "weight-placement":
        if nid in gc._chain_end:
            pb = g.shapes(nid)[0].piece_nbytes * (gc.model.weight_memory_factor() if gc.trainable(nid) else 1)
            for d in set(gc.placement(nid, view)):
                w[d] = w.get(d, 0) + pb
        return w, a
    if role == "compute":
        factor = gc.model.weight_memory_factor()
        for r in gc._direct_weights.get(nid, ()):   # weights read directly (one task)
            f = factor if gc.trainable(r[0]) else 1
            for d in set(view.devices()):
                w[d] = w.get(d, 0) + g.shape(r).piece_nbytes * f
        _cast_copies(gc, nid, view, w, a)
    if role == "input-placement" and any(gc.role[x[0]] != "input" for x in node.inputs):
        return w, a   # only the first placement of an input holds data; later ones re-describe it
    for k, pb in _kept_bytes(gc, nid):
        for d in gc.placement(nid, view, k):
            a[d] = a.get(d, 0) + pb
    return w, a


def _kept_bytes(gc: GraphCost, nid: int) -> tuple:
    """(output, bytes of one piece kept until the backward) of every output of ``nid`` that keeps any: what
    :func:`node_memory` places on each device of a view, the same for every view (memoized on ``gc``)."""
    memo = gc.__dict__.get("_kept_bytes_memo")
    if memo is None:
        memo = gc._kept_bytes_memo = {}
    hit = memo.get(nid)
    if hit is None:
        g = gc.g
        role = gc.role[nid]
        out = []
        for k, s in enumerate(g.shapes(nid)):
            frac = 1.0 if role == "input-placement" else kept(gc, nid, k)
            if frac == 0.0:
                continue
            if frac < 1.0:          # a Dropout's one-byte mask
                pb = int(s.piece_nbytes * frac)
            else:                   # the tensor in the precision's dtype (bf16 activations: 2 bytes)
                pb = s.piece_numel * gc.itemsize((nid, k))
            out.append((k, pb))
        hit = memo[nid] = tuple(out)
    return hit


@lru_cache(maxsize=4096)
def _view_devices(view: MachineView) -> np.ndarray:
    """The distinct devices of ``view``, sorted (read-only)."""
    d = np.unique(np.asarray(view.devices(), dtype=np.int64))
    d.flags.writeable = False
    return d


def node_memory_arrays(gc: GraphCost, nid: int, view: MachineView, states: str = "whole"):
    """:func:`node_memory` as numpy arrays over all devices of the machine: (weight bytes, activation
    bytes, which devices hold weights, which hold activations) -- the same floats a device's entry of
    the dicts has (byte counts are integers, exact in a float), for pricers that add many nodes up
    device by device (Alpa's ILP fragments): one array operation per tensor instead of one dict entry
    per device.  ``states``: a trained weight's optimizer states -- ``"whole"`` on every device holding the
    weight (:func:`node_memory`), ``"sharded"`` over its copies (ZeRO-1: 1/k of them on each of k copies)."""
    if states not in ("whole", "sharded"):
        raise ValueError(f"states must be whole or sharded, got {states!r}")
    g = gc.g
    S = OPTIMIZER_STATES[gc.model.optimizer]

    def factor(s) -> float:         # bytes held per weight byte of a trained weight of shape ``s``
        if states == "whole":
            return gc.model.weight_memory_factor()
        return 2 + S / s.copy_degree

    n_dev = gc.machine.num_devices
    w = np.zeros(n_dev)
    a = np.zeros(n_dev)
    wm = np.zeros(n_dev, dtype=bool)
    am = np.zeros(n_dev, dtype=bool)
    role = gc.role[nid]
    node = g.node(nid)
    if role == "weight-placement":
        if nid in gc._chain_end:
            s0 = g.shapes(nid)[0]
            pb = s0.piece_nbytes * (factor(s0) if gc.trainable(nid) else 1)
            d = np.unique(np.asarray(gc.placement(nid, view), dtype=np.int64))
            w[d] += pb
            wm[d] = True
        return w, a, wm, am
    if role == "compute":
        devs = _view_devices(view)
        for r in gc._direct_weights.get(nid, ()):
            s0 = g.shape(r)
            w[devs] += s0.piece_nbytes * (factor(s0) if gc.trainable(r[0]) else 1)
            wm[devs] = True
        for b, weight in cast_items(gc, nid):      # autocast's copies (bf16), as _cast_copies counts them
            if weight:
                w[devs] += b
                wm[devs] = True
            else:
                a[devs] += b
                am[devs] = True
    if role == "input-placement" and any(gc.role[x[0]] != "input" for x in node.inputs):
        return w, a, wm, am
    for k, s in enumerate(g.shapes(nid)):
        frac = 1.0 if role == "input-placement" else kept(gc, nid, k)
        if frac == 0.0:
            continue
        pb = int(s.piece_nbytes * frac) if frac < 1.0 else s.piece_numel * gc.itemsize((nid, k))
        place = np.asarray(gc.placement(nid, view, k), dtype=np.int64)
        np.add.at(a, place, pb)             # a device holding two pieces holds both
        am[place] = True
    return w, a, wm, am


def _saves_copy(gc: GraphCost):
    """Under bf16 autocast: consumer ``u`` saves a converted copy of input ``pos`` (not the tensor)."""
    if gc.precision != "bf16":
        return None
    return lambda u, pos: gc.role[u] == "compute" and gc.kernel_dtype(u, pos) != gc.dtype(gc.g.node(u).inputs[pos])


def kept(gc: GraphCost, nid: int, k: int) -> float:
    """:func:`kept_fraction` of output ``k`` of ``nid`` under ``gc``'s precision (autocast's copies:
    :func:`_saves_copy`), memoized on ``gc`` (a function of the graph and the model, whatever the views):
    the memory model and the memory techniques (search/memtech.py) read it for every mapping.  The same
    decision as :func:`kept_fraction`, with the graph's outputs and each consumer's saving read once."""
    memo = gc.__dict__.get("_kept_memo")
    if memo is None:
        memo = gc._kept_memo = {}
        gc._kept_outs = set(map(tuple, gc.g.outputs))
        gc._kept_saves = {}
    hit = memo.get((nid, k))
    if hit is not None:
        return hit
    g = gc.g
    op = g.node(nid).op
    if op in SAVES_OUTPUT or (nid, k) in gc._kept_outs:
        hit = 1.0
    else:
        uses = g.consumers((nid, k))
        if not uses:
            hit = 1.0
        else:
            saves = gc._kept_saves
            copy = _saves_copy(gc)
            hit = None
            for u, pos in uses:
                sv = saves.get((u, pos))
                if sv is None:
                    saved = SAVES_INPUTS.get(g.node(u).op)
                    sv = saves[(u, pos)] = ((saved is None or pos in saved)
                                            and not (copy is not None and copy(u, pos)))
                if sv:
                    hit = 1.0
                    break
            if hit is None:
                hit = 1.0 / g.shapes(nid)[k].itemsize if ops.saves(op).mask else 0.0
    memo[(nid, k)] = hit
    return hit


def cast_items(gc: GraphCost, nid: int) -> tuple:
    """Autocast's converted copies compute node ``nid`` holds until the backward (:func:`_cast_copies`),
    whatever its view: ((bytes per device, held with the weights), ...) in input order, memoized on ``gc``
    (empty but under bf16).  Nodes of identical blocks share one computation: the casts depend on the
    operator, its attributes and its inputs' dtypes alone (``GraphCost.casts``), the bytes on the inputs'
    piece sizes and kinds, which the key holds (:data:`_CAST_KEYED`)."""
    memo = gc.__dict__.get("_cast_memo")
    if memo is None:
        memo = gc._cast_memo = {}
        gc._cast_keyed = {}
    hit = memo.get(nid)
    if hit is not None:
        return hit
    if gc.precision != "bf16" or gc.role[nid] != "compute":
        hit = memo[nid] = ()
        return hit
    g = gc.g
    node = g.node(nid)
    key = None
    if _CAST_KEYED:
        key = (node.op, node.attrs, tuple((gc.dtype(r), g.shape(r).piece_numel,
                                           gc.role[r[0]] in ("weight", "weight-placement")) for r in node.inputs))
        try:
            hit = gc._cast_keyed.get(key)
        except TypeError:             # an attribute that is no key: this node computed alone
            key = hit = None
        if hit is not None:
            memo[nid] = hit
            return hit
    out = []
    casts = gc.casts(nid)
    if casts:
        saved = SAVES_INPUTS.get(node.op)
        for pos, _, to in casts:
            r = node.inputs[pos]
            b = g.shape(r).piece_numel * gc.kernel_itemsize(to)
            if gc.role[r[0]] in ("weight", "weight-placement"):
                out.append((b, True))
            elif saved is None or pos in saved:
                out.append((b, False))
    hit = memo[nid] = tuple(out)
    if key is not None:
        gc._cast_keyed[key] = hit
    return hit


#: :func:`cast_items` shares one computation between nodes of equal operator, attributes and inputs (dtype,
#: piece size, weight or not); False: every node computed (the reference the tests compare with)
_CAST_KEYED = True


def _cast_copies(gc: GraphCost, nid: int, view: MachineView, w: dict, a: dict) -> None:
    """Autocast's converted copies held by compute node ``nid`` until the backward pass (bf16 only): a
    bf16 copy of every fp32 weight a bf16 operator reads (autocast's weight cast cache; counted with the
    weights), and the converted copy of every input the operator saves for its gradient (activations)."""
    items = cast_items(gc, nid)
    if not items:
        return
    devs = set(view.devices())
    for b, weight in items:
        into = w if weight else a
        for d in devs:
            into[d] = into.get(d, 0) + b


def memory_per_device(gc: GraphCost, views: Mapping[int, MachineView]) -> MemoryReport:
    w: dict = defaultdict(int)
    a: dict = defaultdict(int)
    for nid in gc.nodes():
        nw, na = node_memory(gc, nid, views[nid])
        for d, b in nw.items():
            w[d] += b
        for d, b in na.items():
            a[d] += b
    devs = set(w) | set(a)
    per = {d: w.get(d, 0) + a.get(d, 0) for d in devs}
    return MemoryReport(per, dict(w), dict(a), gc.machine.device.usable_bytes)


def memory_lower_bound(gc: GraphCost, resource=None) -> float:
    """A lower bound of the busiest device's bytes over every mapping of the graph onto ``resource``
    (default: the whole machine).  Each node holds the same bytes ``c`` on each of the ``k`` distinct
    devices of its view, whichever view it takes (a view places one task per device, and every task
    one piece of each tensor), so nodes of degree ``k = resource.size`` put ``c`` on every device
    (``F``, their sum), and the others put ``sum(c * k)`` somewhere: the busiest device holds at
    least ``F + max(sum(c * k) / devices, largest c)``.  The mapper uses it to say at once that no
    mapping fits (a data-parallel graph whose replicas are too large)."""
    from unity_pcg.machine import Resource
    res = resource or Resource.whole(gc.machine)
    n_dev = res.size
    full = spread = largest = 0.0
    for nid in gc.nodes():
        views = gc.views(nid, res)
        if not views:
            continue
        w, a = node_memory(gc, nid, views[0])
        per = [w.get(d, 0) + a.get(d, 0) for d in set(w) | set(a)]
        if not per:
            continue
        c = max(per)
        if len(per) >= n_dev:
            full += c
        else:
            spread += sum(per)
            largest = max(largest, c)
    return full + max(spread / n_dev, largest)


__all__ = ["kept", "cast_items", "node_memory_arrays", "MemoryReport", "memory_per_device", "node_memory", "memory_lower_bound"]
