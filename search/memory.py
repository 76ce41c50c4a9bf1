"""Memory per device of a mapped PCG.

On each device: every weight piece it holds (the end of a weight's placement chain, or a weight read
directly by a compute operator) times ``2 + optimizer states`` (weight, gradient, and 0 / 1 / 2 state
copies for SGD / SGD with momentum / Adam) if it is trained, once if not (BatchNorm running
statistics, integer index tables); every activation piece it holds -- outputs of compute
operators and of data-moving parallel operators, all kept for the backward pass (no
rematerialization); and the input shards the data loader feeds it.  A plan whose busiest device
exceeds ``MachineSpec.device.memory_bytes`` is infeasible.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from unity_pcg.machine import MachineView

from .cost import GraphCost


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
        return (f"device {dev} needs {self.per_device[dev] / 2**30:.2f} GiB "
                f"(weights+grads+optimizer {self.weights.get(dev, 0) / 2**30:.2f} GiB, activations "
                f"{self.activations.get(dev, 0) / 2**30:.2f} GiB) but has {self.capacity / 2**30:.2f} GiB")


def memory_per_device(gc: GraphCost, views: Mapping[int, MachineView]) -> MemoryReport:
    g = gc.g
    factor = gc.model.weight_memory_factor()
    w: dict = defaultdict(int)
    a: dict = defaultdict(int)
    for nid in gc.nodes():
        role = gc.role[nid]
        view = views[nid]
        node = g.node(nid)
        if role == "weight-placement":
            if nid in gc._chain_end:
                pb = g.shapes(nid)[0].piece_nbytes * (factor if gc.trainable(nid) else 1)
                for d in set(gc.placement(nid, view)):
                    w[d] += pb
            continue
        if role == "compute":
            for r in gc._direct_weights.get(nid, ()):   # weights read directly (one task)
                f = factor if gc.trainable(r[0]) else 1
                for d in set(view.devices()):
                    w[d] += g.shape(r).piece_nbytes * f
        if role == "input-placement" and any(gc.role[x[0]] != "input" for x in node.inputs):
            continue  # only the first placement of an input holds data; later ones re-describe it
        for k, s in enumerate(g.shapes(nid)):
            pb = s.piece_nbytes
            for d in gc.placement(nid, view, k):
                a[d] += pb
    devs = set(w) | set(a)
    per = {d: w.get(d, 0) + a.get(d, 0) for d in devs}
    return MemoryReport(per, dict(w), dict(a), gc.machine.device.memory_bytes)


__all__ = ["MemoryReport", "memory_per_device"]
