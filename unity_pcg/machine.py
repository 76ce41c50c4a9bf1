"""Machines and machine views (DESIGN "Machine"; Unity section 3.2, Figure 7).

A :class:`MachineSpec` is a homogeneous cluster: ``nodes`` x ``devices_per_node`` devices, the
devices of a node split into fast groups of ``group_size`` (Summit: two NVLink groups of 3 GPUs
joined by the X-Bus).  Device ids are linear: ``id = node * devices_per_node + local``.  Links are
described per level -- ``group`` (inside a fast group), ``node`` (between groups of one node) and
``network`` (between nodes; the bandwidth is the node's NIC, shared by its devices) -- each with a
bandwidth (bytes/s, one direction) and a latency (s).  An optional ``host`` link (device <-> host memory)
and ``host_mem_bandwidth`` price optimizer-state offload, whose capacity is ``host_memory_bytes`` per node
(shared by the node's devices); ``overlap_grad_sync`` says whether the runtime
overlaps gradient synchronization with the backward pass (GPU presets: yes; their host links -- PCIe, or
NVLink 2 on Summit -- and host bandwidths, about half the sockets' peak, are assumed, not measured).

A :class:`MachineView` maps an operator's task grid onto device ids: a start device and, per task
grid axis, a ``(degree, stride)`` pair; task ``(i1, ..., ik)`` runs on ``start + sum(i_j * stride_j)``.
:func:`enumerate_views` lists the views that follow the hierarchy (contiguous blocks, one device per
group, one device per node, and "minor axes inside a node, major axes across nodes"), with aligned
starts, so their number is linear in the device count.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from itertools import permutations
from math import prod
from typing import Any, Iterator, Mapping, Sequence

from .errors import UnityError

SCHEMA = "unity-pcg/machine/v1"
LEVELS = ("local", "group", "node", "network")   # "local": same device (free)


class MachineError(UnityError, ValueError):
    """A malformed machine description or machine argument."""


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float   # bytes/s, one direction, per link (network: per node NIC)
    latency: float     # seconds per message


@dataclass(frozen=True)
class DeviceSpec:
    peak_flops: float                 # FLOP/s (multiply-add = 2)
    mem_bandwidth: float              # bytes/s
    memory_bytes: int                 # capacity
    efficiency: Mapping[str, float] = field(default_factory=lambda: {"default": 1.0})
    op_overhead: float = 0.0          # seconds per operator launch (kernel launch / dispatch)
    update_overhead: float = 0.0      # seconds of optimizer-step overhead per weight tensor (0: op_overhead)
    overheads: Mapping[str, float] = field(default_factory=dict)  # per op class: "conv", "conv:bwd", ...
    # peak FLOP/s per math mode ("tf32", "bf16"; "fp32" is ``peak_flops``); a mode left out runs at
    # ``peak_flops`` (a CPU, or a device without that mode's units)
    peaks: Mapping[str, float] = field(default_factory=dict)
    # measured kernel times per operator class and math mode: "<class>/<mode>" -> ((work, seconds), ...)
    # sorted by work (FLOPs for compute classes, bytes for memory-bound ones; search.cost.kernel_work)
    kernel_tables: Mapping[str, tuple] = field(default_factory=dict)
    # the headroom a plan must leave: the memory a plan may fill is ``usable_bytes`` =
    # ``memory_bytes * usable_fraction - reserved_bytes`` (the runtime's own memory -- CUDA context, library
    # workspaces -- and the caching allocator's fragmentation); GPU presets: GPU_USABLE_FRACTION (and
    # GPU_RESERVED_BYTES), CPU processes (``local``) and machine files without the fields: none
    reserved_bytes: int = 0
    usable_fraction: float = 1.0

    @property
    def usable_bytes(self) -> int:
        """Bytes a plan may fill on one device: the capacity less the runtime's reserve (the one number every
        memory feasibility check compares against)."""
        return int(self.memory_bytes * self.usable_fraction) - int(self.reserved_bytes)

    def overhead(self, kind: str, backward: bool = False) -> float:
        o = dict(self.overheads)
        key = f"{kind}:bwd" if backward else kind
        return float(o.get(key, self.op_overhead))

    def eff(self, kind: str) -> float:
        e = dict(self.efficiency)
        return float(e.get(kind, e.get("default", 1.0)))

    def peak(self, mode: str = "fp32") -> float:
        """Peak FLOP/s of math mode ``mode`` (``fp32``, ``tf32``, ``bf16``): ``peaks[mode]``, else ``peak_flops``."""
        if mode == "fp32":
            return float(self.peak_flops)
        return float(dict(self.peaks).get(mode, self.peak_flops))

    def table(self, key: str) -> tuple | None:
        """The measured table ``"<class>/<mode>"`` (((work, seconds), ...), sorted), or None."""
        t = dict(self.kernel_tables).get(key)
        return t if t else None


MODES = ("fp32", "tf32", "bf16")


def interpolate_table(points: Sequence[Sequence[float]], work: float) -> float:
    """Seconds of a kernel of ``work`` from a measured table of (work, seconds) points sorted by work:
    piecewise linear in work between points (a kernel's time is a fixed cost plus work at a throughput,
    which is linear: interpolating log-log would lie above it between points); below the first point its time (the
    fixed per-kernel cost dominates small kernels); beyond the last point linear in work at the marginal
    throughput of the table's upper half (seconds per unit of work between the last point and the first
    point with at most half its work: one short segment between two kernels of nearly the same work
    would extrapolate its noise), at most the last point's average seconds per unit of work (a fixed
    cost plus a throughput never has a steeper marginal cost), which is also the slope when the table has
    one point or does not rise."""
    if work <= 0:
        return 0.0
    pts = [(float(w), float(t)) for w, t in points]
    w0, t0 = pts[0]
    if work <= w0:
        return t0
    for (wa, ta), (wb, tb) in zip(pts, pts[1:]):
        if work <= wb:
            return ta + (tb - ta) * (work - wa) / (wb - wa)
    wl, tl = pts[-1]
    avg = tl / wl
    base = [(w, t) for w, t in pts[:-1] if w <= wl / 2]
    if base:
        wp, tp = base[-1]
        slope = (tl - tp) / (wl - wp)
        if slope > 0:
            return tl + (work - wl) * min(slope, avg)
    return tl * work / wl


@dataclass(frozen=True)
class MachineSpec:
    name: str
    nodes: int
    devices_per_node: int
    group_size: int
    device: DeviceSpec
    links: Mapping[str, LinkSpec]     # "group", "node", "network"
    shared_cores: int = 0             # >0: devices are processes sharing this many cores (local)
    meta: Mapping[str, Any] = field(default_factory=dict)
    background_load: float = 0.0      # runnable tasks of other programs competing for the shared cores
    # the runtime overlaps gradient synchronization (and ZeRO's parameter all-gathers) with the backward and
    # forward passes (GPU presets: CUDA streams, as DDP / FSDP / Megatron-LM); False on CPU processes sharing
    # cores, where overlap was measured to lose, and for machine files written before the field existed
    overlap_grad_sync: bool = False
    # the host's memory bandwidth per node (bytes/s, shared by its devices): the speed of an optimizer update
    # offloaded to host memory (search/memtech.py); 0 = unknown (offload is not offered).  The device <-> host
    # link is ``links["host"]`` (optional; PCIe or NVLink-C2C)
    host_mem_bandwidth: float = 0.0
    # the host's memory per node (bytes, shared by its devices): what optimizer-state offload may fill
    # (search/memtech.py checks it per node); 0 = unknown (offload is not offered: it cannot be checked)
    host_memory_bytes: int = 0

    def __post_init__(self) -> None:
        validate(self)

    # --- size -------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def resized(self, nodes: int, devices_per_node: int) -> "MachineSpec":
        g = self.group_size if devices_per_node % self.group_size == 0 else devices_per_node
        g = min(g, devices_per_node)
        links = self.links
        meta = dict(self.meta)
        worlds = meta.get("worlds")
        if worlds:  # a local machine calibrated per number of concurrent processes: the nearest one
            try:
                p = nodes * devices_per_node
                k = min(worlds, key=lambda w: (abs(int(w) - p), int(w)))
                rec = worlds[k]
                lk = LinkSpec(float(rec["link"]["bandwidth"]), float(rec["link"]["latency"]))
                links = {lv: lk for lv in ("group", "node", "network")}
                links.update({k: v for k, v in self.links.items() if k == "host"})
                d = dict(rec["device"])
                device = DeviceSpec(float(d["peak_flops"]), float(d["mem_bandwidth"]), int(d["memory_bytes"]),
                                    dict(d.get("efficiency", {"default": 1.0})), float(d.get("op_overhead", 0.0)),
                                    float(d.get("update_overhead", 0.0)), dict(d.get("overheads", {})),
                                    _peaks(d.get("peaks", {}), f"machine {self.name!r} meta.worlds"),
                                    _tables(d.get("kernel_tables", {}), f"machine {self.name!r} meta.worlds"),
                                    int(d.get("reserved_bytes", self.device.reserved_bytes)),
                                    float(d.get("usable_fraction", self.device.usable_fraction)))
                meta.update(device_world=int(k), sync=dict(rec.get("sync", {})))
                for key in ("solo_speedup", "contention"):     # measured with this world (calibrate)
                    if rec.get(key) is not None:
                        meta[key] = float(rec[key])
                    else:
                        meta.pop(key, None)
            except MachineError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError):
                raise MachineError(f"machine {self.name!r}: malformed meta.worlds") from None
            return replace(self, nodes=nodes, devices_per_node=devices_per_node, group_size=g, links=links,
                           device=device, meta=meta)
        fits = meta.get("allreduce_fits")
        if fits:  # a calibrated local machine: the links measured for the nearest world size
            try:
                p = nodes * devices_per_node
                k = min(fits, key=lambda w: (abs(int(w) - p), int(w)))
                lk = LinkSpec(float(fits[k]["bandwidth"]), float(fits[k]["latency"]))
                links = {lv: lk for lv in ("group", "node", "network")}
                links.update({k: v for k, v in self.links.items() if k == "host"})
            except (KeyError, TypeError, ValueError):
                raise MachineError(f"machine {self.name!r}: malformed meta.allreduce_fits") from None
        return replace(self, nodes=nodes, devices_per_node=devices_per_node, group_size=g, links=links)

    # --- per-device throughput (local processes share the cores) ------------------------------
    @property
    def share(self) -> float:
        """Fraction of one device's calibrated throughput each device gets (1 unless cores are shared)."""
        if self.shared_cores > 0:
            def fraction(n: float) -> float:
                return min(1.0, self.shared_cores / (n + self.background_load))
            # a device calibrated while ``device_world`` processes ran together already includes
            # their sharing of the cores: scale relative to that
            base = dict(self.meta).get("device_world")
            return fraction(self.num_devices) / (fraction(int(base)) if base else 1.0)
        return 1.0

    def solo_speedup(self) -> float:
        """How much faster one device computes when it is the only one busy than when all
        ``num_devices`` compute at once (1 unless cores are shared).  Measured by calibration
        (``meta["solo_speedup"]``, from the nearest world size); otherwise from the core count:
        ``fraction(1) / fraction(P)``.  Clamped to [1, P]: all devices together never get more
        than P times one device's share of the cores."""
        p = self.num_devices
        if self.shared_cores <= 0 or p <= 1:
            return 1.0
        s = dict(self.meta).get("solo_speedup")
        if s is None:
            def fraction(n: float) -> float:
                return min(1.0, self.shared_cores / (n + self.background_load))
            s = fraction(1) / fraction(p)
        return min(max(float(s), 1.0), float(p))

    def concurrency_factor(self, busy: int) -> float:
        """Time of a task while only ``busy`` devices compute, relative to its time priced with all
        P devices busy (the calibration's setting); 1 unless cores are shared.  Devices sharing
        the cores share one pool of throughput R (P devices busy: R / P each), and one device never
        goes faster than its solo speed s * R / P: each of ``busy`` devices gets
        ``min(s R / P, R / busy)``, so the factor is ``max(1 / s, busy / P)`` -- a step costs the
        total work of all devices over the pool, or the slowest device's work at solo speed."""
        p = self.num_devices
        if self.shared_cores <= 0 or p <= 1:
            return 1.0
        b = min(max(int(busy), 1), p)
        return max(1.0 / self.solo_speedup(), b / p)

    @property
    def oversubscribed(self) -> bool:
        """Devices that share cores and outnumber them (P processes on fewer cores)."""
        return 0 < self.shared_cores < self.num_devices

    def contention(self) -> float:
        """How much longer a piece of CPU work takes in wall time while all devices compute than its CPU
        time (1 unless the devices outnumber the shared cores): measured by calibration
        (``meta["contention"]``, ``calibration.local.measure_contention``), otherwise
        ``(P + background_load) / cores``; at least 1."""
        if not self.oversubscribed:
            return 1.0
        c = dict(self.meta).get("contention")
        if c is None:
            c = (self.num_devices + self.background_load) / self.shared_cores
        return max(float(c), 1.0)

    def collective_cpu_time(self, kind: str, p: int, nbytes: float) -> float | None:
        """Seconds a collective ``kind`` over groups of ``p`` devices moving ``nbytes`` adds to an
        iteration of processes that outnumber their cores (:attr:`oversubscribed`): the CPU work it
        costs each process (calibrated ``worlds[w]["collectives_cpu"]``, all ranks in it at once) at the
        throughput each process gets while all compute (:meth:`contention`).  A process blocked in a
        collective waiting for a descheduled peer gives its core to the others, so what the shared
        cores lose to a collective is its CPU work, not the latency measured with idle peers; the
        compute priced from tables measured with all processes busy is that work over the cores too, so
        an iteration costs the total CPU work of all processes over the cores.  None where not
        oversubscribed or without the table (the wall-time table then prices it)."""
        tab = (self._collectives_cpu() or {}).get(kind, {}).get(str(p))
        return interpolate_table(tab, nbytes) * self.contention() if tab else None

    def _collectives_cpu(self) -> Mapping | None:
        if not self.oversubscribed:
            return None
        w = self.meta.get("device_world")
        worlds = self.meta.get("worlds")
        if w is None or not worlds:
            return None
        return (worlds.get(str(w)) or {}).get("collectives_cpu") or None

    @property
    def collectives_by_cpu(self) -> bool:
        """Collectives are priced by their CPU work (:meth:`collective_cpu_time`): oversubscribed and
        calibrated with the CPU tables."""
        return self._collectives_cpu() is not None

    @property
    def has_host(self) -> bool:
        """The machine describes a host its devices can put optimizer states in (offload): a ``host`` link,
        the host's memory bandwidth and capacity."""
        return "host" in self.links and self.host_mem_bandwidth > 0 and self.host_memory_bytes > 0

    @property
    def flops(self) -> float:
        return self.device.peak_flops * self.share

    def flops_for(self, mode: str = "fp32") -> float:
        """Per-device peak FLOP/s in math mode ``mode``, shared cores included (:attr:`flops` for fp32)."""
        return self.device.peak(mode) * self.share

    @property
    def mem_bandwidth(self) -> float:
        return self.device.mem_bandwidth * self.share

    # --- topology ------------------------------------------------------------------------------
    def node_of(self, dev: int) -> int:
        return dev // self.devices_per_node

    def group_of(self, dev: int) -> int:
        return dev // self.group_size if self.devices_per_node % self.group_size == 0 else \
            self.node_of(dev) * 10_000 + (dev % self.devices_per_node) // self.group_size

    def level(self, a: int, b: int) -> str:
        if a == b:
            return "local"
        if self.node_of(a) != self.node_of(b):
            return "network"
        if self.group_of(a) != self.group_of(b):
            return "node"
        return "group"

    def span_level(self, devs: Sequence[int]) -> str:
        """The slowest link level a set of devices spans."""
        devs = list(devs)
        if len(set(devs)) <= 1:
            return "local"
        if len({self.node_of(d) for d in devs}) > 1:
            return "network"
        if len({self.group_of(d) for d in devs}) > 1:
            return "node"
        return "group"

    def link(self, level: str) -> LinkSpec:
        return self.links[level]

    # --- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = {"schema": SCHEMA, "name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
             "group_size": self.group_size, "device": asdict(self.device),
             "links": {k: asdict(v) for k, v in self.links.items()}, "shared_cores": self.shared_cores,
             "background_load": self.background_load,
             "overlap_grad_sync": self.overlap_grad_sync, "host_mem_bandwidth": self.host_mem_bandwidth,
             "host_memory_bytes": self.host_memory_bytes, "meta": dict(self.meta)}
        d["device"]["efficiency"] = dict(self.device.efficiency)
        d["device"]["overheads"] = dict(self.device.overheads)
        d["device"]["peaks"] = dict(self.device.peaks)
        d["device"]["kernel_tables"] = {k: [list(p) for p in v] for k, v in dict(self.device.kernel_tables).items()}
        return d

    @staticmethod
    def from_json(obj: Any, source: str = "machine JSON") -> "MachineSpec":
        if not isinstance(obj, dict):
            raise MachineError(f"{source}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("schema", SCHEMA) != SCHEMA:
            raise MachineError(f"{source}: unknown schema {obj.get('schema')!r} (expected {SCHEMA!r})")
        unknown = set(obj) - {"schema", "name", "nodes", "devices_per_node", "group_size", "device", "links",
                              "shared_cores", "meta", "background_load", "overlap_grad_sync",
                              "host_mem_bandwidth", "host_memory_bytes"}
        if unknown:
            raise MachineError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            dev = obj["device"]
            if not isinstance(dev, dict):
                raise MachineError(f"{source}: field 'device' must be an object")
            bad = set(dev) - {"peak_flops", "mem_bandwidth", "memory_bytes", "efficiency", "op_overhead",
                              "update_overhead", "overheads", "peaks", "kernel_tables", "reserved_bytes",
                              "usable_fraction"}
            if bad:
                raise MachineError(f"{source}: unknown device field(s) {', '.join(sorted(bad))}")
            eff = dev.get("efficiency", {"default": 1.0})
            if not isinstance(eff, dict):
                raise MachineError(f"{source}: field 'device.efficiency' must be an object")
            device = DeviceSpec(_num(dev, "peak_flops", source), _num(dev, "mem_bandwidth", source),
                                int(_num(dev, "memory_bytes", source)),
                                {str(k): _num(eff, k, source) for k in eff},
                                _num(dev, "op_overhead", source, 0.0), _num(dev, "update_overhead", source, 0.0),
                                _overheads(dev.get("overheads", {}), source),
                                _peaks(dev.get("peaks", {}), source), _tables(dev.get("kernel_tables", {}), source),
                                _bytes_field(dev, "reserved_bytes", source),
                                _num(dev, "usable_fraction", source, 1.0))
            links_obj = obj["links"]
            if not isinstance(links_obj, dict):
                raise MachineError(f"{source}: field 'links' must be an object")
            links = {}
            for lv in ("group", "node", "network"):
                if lv not in links_obj or not isinstance(links_obj[lv], dict):
                    raise MachineError(f"{source}: links.{lv} is missing (needs bandwidth and latency)")
                links[lv] = LinkSpec(_num(links_obj[lv], "bandwidth", source), _num(links_obj[lv], "latency", source))
            if "host" in links_obj:             # optional: device <-> host memory (offload)
                if not isinstance(links_obj["host"], dict):
                    raise MachineError(f"{source}: links.host must be an object with bandwidth and latency")
                links["host"] = LinkSpec(_num(links_obj["host"], "bandwidth", source),
                                         _num(links_obj["host"], "latency", source))
            bad_links = set(links_obj) - {"group", "node", "network", "host"}
            if bad_links:
                raise MachineError(f"{source}: unknown link level(s) {', '.join(sorted(bad_links))}")
            overlap = obj.get("overlap_grad_sync", False)
            if not isinstance(overlap, bool):
                raise MachineError(f"{source}: field 'overlap_grad_sync' must be true or false")
            return MachineSpec(str(obj.get("name", "custom")), _int(obj, "nodes", source),
                               _int(obj, "devices_per_node", source),
                               _int(obj, "group_size", source, obj.get("devices_per_node")), device, links,
                               _int(obj, "shared_cores", source, 0), dict(obj.get("meta", {}) or {}),
                               _num(obj, "background_load", source, 0.0), overlap,
                               _num(obj, "host_mem_bandwidth", source, 0.0),
                               _bytes_field(obj, "host_memory_bytes", source))
        except KeyError as e:
            raise MachineError(f"{source}: missing field {e.args[0]!r}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    @staticmethod
    def load(path: str) -> "MachineSpec":
        try:
            with open(path) as f:
                obj = json.load(f)
        except FileNotFoundError:
            raise MachineError(f"machine file {path!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise MachineError(f"machine file {path!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
        return MachineSpec.from_json(obj, source=f"machine file {path!r}")

    def describe(self) -> str:
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s) "
                f"({self.num_devices} devices), {self.flops / 1e12:.3g} TFLOP/s, "
                f"{self.device.memory_bytes / 2**30:.3g} GiB each" + self._usable_text())

    def _usable_text(self) -> str:
        d = self.device
        if d.usable_bytes == d.memory_bytes:
            return ""
        parts = ([f"{d.reserved_bytes / 2**30:.3g} GiB reserved"] if d.reserved_bytes else []) + \
            ([f"{(1 - d.usable_fraction) * 100:.3g}% kept for the runtime"] if d.usable_fraction < 1 else [])
        return f" ({d.usable_bytes / 2**30:.3g} GiB usable: {', '.join(parts)})"


def _num(obj: Mapping, key: str, source: str, default: float | None = None) -> float:
    if key not in obj:
        if default is not None:
            return default
        raise MachineError(f"{source}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MachineError(f"{source}: field {key!r} must be a finite non-negative number, got {v!r}")
    return float(v)


def _overheads(obj: Any, source: str) -> dict:
    if not isinstance(obj, dict):
        raise MachineError(f"{source}: field 'device.overheads' must be an object")
    return {str(k): _num(obj, k, source) for k in obj}


def _peaks(obj: Any, source: str) -> dict:
    """``device.peaks``: math mode -> FLOP/s, modes from :data:`MODES`."""
    if not isinstance(obj, Mapping):
        raise MachineError(f"{source}: field 'device.peaks' must be an object")
    bad = [k for k in obj if k not in MODES]
    if bad:
        raise MachineError(f"{source}: device.peaks: unknown math mode {bad[0]!r} (known: {', '.join(MODES)})")
    out = {str(k): _num(obj, k, source) for k in obj}
    if any(v <= 0 for v in out.values()):
        raise MachineError(f"{source}: device.peaks must be positive")
    return out


def _tables(obj: Any, source: str) -> dict:
    """``device.kernel_tables``: "<class>/<mode>" -> [[work, seconds], ...] sorted by strictly increasing
    work, work > 0, seconds >= 0; stored as tuples."""
    if not isinstance(obj, Mapping):
        raise MachineError(f"{source}: field 'device.kernel_tables' must be an object")
    out = {}
    for k, pts in obj.items():
        cls, sep, mode = str(k).partition("/")
        if not sep or not cls or mode not in MODES:
            raise MachineError(f"{source}: device.kernel_tables key {k!r} must be '<op class>/<mode>' "
                               f"with mode one of {', '.join(MODES)}")
        if not isinstance(pts, (list, tuple)) or not pts:
            raise MachineError(f"{source}: device.kernel_tables[{k!r}] must be a non-empty list of [work, seconds]")
        rows = []
        for p in pts:
            if (not isinstance(p, (list, tuple)) or len(p) != 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in p)
                    or p[0] <= 0 or p[1] < 0):
                raise MachineError(f"{source}: device.kernel_tables[{k!r}]: bad point {p!r} "
                                   "(want [work > 0, seconds >= 0])")
            rows.append((float(p[0]), float(p[1])))
        if any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
            raise MachineError(f"{source}: device.kernel_tables[{k!r}] must be sorted by strictly increasing work")
        out[str(k)] = tuple(rows)
    return out


def _int(obj: Mapping, key: str, source: str, default: Any = None) -> int:
    v = obj.get(key, default)
    if v is None:
        raise MachineError(f"{source}: missing field {key!r}")
    if isinstance(v, bool) or not isinstance(v, int):
        raise MachineError(f"{source}: field {key!r} must be an integer, got {v!r}")
    return v


def _bytes_field(obj: Mapping, key: str, source: str) -> int:
    """An optional byte count (default 0): an integer, or a float with an integral value (``2.2e12``)."""
    v = obj.get(key, 0)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MachineError(f"{source}: field {key!r} must be a whole number of bytes >= 0, got {v!r}")
    return v


def validate(m: MachineSpec) -> None:
    for k in ("nodes", "devices_per_node", "group_size"):
        v = getattr(m, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MachineError(f"machine {m.name!r}: {k} must be a positive integer, got {v!r}")
    if m.group_size > m.devices_per_node:
        raise MachineError(f"machine {m.name!r}: group_size {m.group_size} exceeds devices_per_node "
                           f"{m.devices_per_node}")
    d = m.device
    for k in ("peak_flops", "mem_bandwidth", "memory_bytes"):
        v = getattr(d, k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise MachineError(f"machine {m.name!r}: device.{k} must be positive, got {v!r}")
    for k, v in dict(d.efficiency).items():
        if not isinstance(v, (int, float)) or not 0 < v <= 1.0:
            raise MachineError(f"machine {m.name!r}: device.efficiency[{k!r}] must be in (0, 1], got {v!r}")
    _peaks(d.peaks, f"machine {m.name!r}")
    if dict(d.peaks).get("fp32", d.peak_flops) != d.peak_flops:
        raise MachineError(f"machine {m.name!r}: device.peaks['fp32'] differs from device.peak_flops")
    _tables({k: [list(p) for p in v] for k, v in dict(d.kernel_tables).items()}, f"machine {m.name!r}")
    if not isinstance(d.reserved_bytes, int) or isinstance(d.reserved_bytes, bool) or d.reserved_bytes < 0:
        raise MachineError(f"machine {m.name!r}: device.reserved_bytes must be an integer >= 0, got "
                           f"{d.reserved_bytes!r}")
    if not isinstance(d.usable_fraction, (int, float)) or not 0 < d.usable_fraction <= 1.0:
        raise MachineError(f"machine {m.name!r}: device.usable_fraction must be in (0, 1], got {d.usable_fraction!r}")
    if d.usable_bytes <= 0:
        raise MachineError(f"machine {m.name!r}: device.reserved_bytes ({d.reserved_bytes}) leaves no usable memory "
                           f"of {d.memory_bytes} bytes")
    if d.op_overhead < 0 or d.update_overhead < 0:
        raise MachineError(f"machine {m.name!r}: device.op_overhead and update_overhead must be >= 0")
    for lv in ("group", "node", "network", "host"):
        if lv not in m.links:
            if lv == "host":
                continue
            raise MachineError(f"machine {m.name!r}: links.{lv} is missing")
        l = m.links[lv]
        if not l.bandwidth > 0 or not math.isfinite(l.bandwidth) or l.latency < 0 or not math.isfinite(l.latency):
            raise MachineError(f"machine {m.name!r}: links.{lv} needs bandwidth > 0 and latency >= 0")
    if m.shared_cores < 0:
        raise MachineError(f"machine {m.name!r}: shared_cores must be >= 0")
    if not isinstance(m.overlap_grad_sync, bool):
        raise MachineError(f"machine {m.name!r}: overlap_grad_sync must be true or false")
    if not isinstance(m.host_mem_bandwidth, (int, float)) or not m.host_mem_bandwidth >= 0 \
            or not math.isfinite(m.host_mem_bandwidth):
        raise MachineError(f"machine {m.name!r}: host_mem_bandwidth must be a finite number >= 0")
    if not isinstance(m.host_memory_bytes, int) or isinstance(m.host_memory_bytes, bool) or m.host_memory_bytes < 0:
        raise MachineError(f"machine {m.name!r}: host_memory_bytes must be an integer >= 0, got "
                           f"{m.host_memory_bytes!r}")
    if not isinstance(m.background_load, (int, float)) or not m.background_load >= 0:
        raise MachineError(f"machine {m.name!r}: background_load must be >= 0")


# --- presets ---------------------------------------------------------------------------------------

GiB = 2 ** 30
#: the share of a GPU's memory a plan may fill (GPU presets): the rest is the runtime's -- the CUDA context
#: and the libraries' workspaces (cuBLAS, cuDNN, NCCL) beside the caching allocator, and the allocator's
#: fragmentation (block rounding, segments split between sizes).  A plan predicted at 99.9% of the device
#: ran out of memory on its second step, one at 90% ran (benchmarks/results/gpu_memory_check.md).  A share,
#: not a fixed amount, so that a device shrunk to study a plan keeps the same proportions; a machine file
#: may add a fixed ``reserved_bytes``.  CPU processes (``local``) reserve nothing
GPU_USABLE_FRACTION = 0.95
GPU_RESERVED_BYTES = 0


def with_gpu_reserve(dev: DeviceSpec) -> DeviceSpec:
    """``dev`` with the GPU presets' reserve (:data:`GPU_USABLE_FRACTION`, :data:`GPU_RESERVED_BYTES`)."""
    return replace(dev, reserved_bytes=GPU_RESERVED_BYTES, usable_fraction=GPU_USABLE_FRACTION)


def summit(nodes: int = 1, devices_per_node: int = 6) -> MachineSpec:
    """Summit (the Unity evaluation): 6 x V100-SXM2 16 GB per node in two NVLink-2 groups of 3
    (50 GB/s per direction between GPUs of a group), X-Bus (64 GB/s, shared by the 3 GPUs of a socket,
    ~21 GB/s each) between the two groups, EDR InfiniBand 100 Gb/s (12.5 GB/s) per node.

    Datasheets: https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    (V100 SXM2: 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor cores, 900 GB/s HBM2) and
    https://www.olcf.ornl.gov/olcf-resources/compute-systems/summit/ (node layout, links).
    Measured: nothing (no V100 was at hand).  Taken from the datasheets: the peaks, memory bandwidth and
    capacity, link bandwidths.  Assumed: the per-class efficiencies (matmul 0.7, conv 0.6, default 0.6 of
    the peak), the 5 us launch overhead per kernel, the link latencies and the share of memory a plan may
    fill (:data:`GPU_USABLE_FRACTION`).  Math modes: V100 has no TF32
    (``tf32`` runs at the fp32 peak) and no bf16 units: ``bf16`` is priced as what V100 runs for mixed
    precision, fp16 autocast on its tensor cores (125 TFLOP/s, the same 2-byte activations; the loss
    scaler's cost is left out)."""
    dev = DeviceSpec(15.7e12, 900e9, 16 * GiB, {"default": 0.6, "matmul": 0.7, "conv": 0.6,
                                                  "elementwise": 1.0}, 5e-6,
                     peaks={"tf32": 15.7e12, "bf16": 125e12})
    dev = with_gpu_reserve(dev)
    links = {"group": LinkSpec(50e9, 5e-6), "node": LinkSpec(21e9, 8e-6), "network": LinkSpec(12.5e9, 5e-6),
             "host": LinkSpec(50e9, 10e-6)}          # NVLink 2 between each GPU and its POWER9
    return MachineSpec("summit", nodes, devices_per_node, min(3, devices_per_node), dev, links,
                       meta={"bf16_as": "fp16 tensor cores (V100 has no bf16)"}, overlap_grad_sync=True,
                       host_mem_bandwidth=150e9, host_memory_bytes=512 * GiB).resized(nodes, devices_per_node)


def dgx_a100(nodes: int = 1, devices_per_node: int = 8) -> MachineSpec:
    """DGX A100: 8 x A100-SXM4 80 GB on NVSwitch (300 GB/s per direction), 8 x HDR 200 Gb/s per node.

    Datasheet: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    (A100 SXM4 80 GB: 19.5 TFLOP/s fp32, 156 TF32, 312 bf16 tensor cores (dense; the datasheet's larger
    figures are with 2:4 sparsity), 2,039 GB/s HBM2e).  Measured: nothing (no A100 was at hand).  Taken
    from the datasheet: the peaks per math mode, memory bandwidth (rounded to 2.0 TB/s) and capacity,
    NVLink 3 / NVSwitch and HDR bandwidths.  Assumed: the per-class efficiencies (matmul 0.75, conv 0.6,
    default 0.6 of the mode's peak, the same in every mode), the 4 us launch overhead, the latencies and the
    share of memory a plan may fill (:data:`GPU_USABLE_FRACTION`)."""
    dev = DeviceSpec(19.5e12, 2.0e12, 80 * GiB, {"default": 0.6, "matmul": 0.75, "conv": 0.6,
                                                  "elementwise": 1.0}, 4e-6,
                     peaks={"tf32": 156e12, "bf16": 312e12})
    dev = with_gpu_reserve(dev)
    links = {"group": LinkSpec(300e9, 3e-6), "node": LinkSpec(300e9, 3e-6), "network": LinkSpec(200e9, 5e-6),
             "host": LinkSpec(25e9, 10e-6)}          # PCIe 4.0 x16
    return MachineSpec("dgx-a100", nodes, devices_per_node, devices_per_node, dev, links, overlap_grad_sync=True,
                       host_mem_bandwidth=200e9, host_memory_bytes=2048 * GiB)


def h100_datasheet(nodes: int = 1, devices_per_node: int = 8) -> MachineSpec:
    """HGX H100 from its datasheet alone (the base :func:`h100` fits its device on): 8 x H100-SXM5 80 GB
    on NVSwitch (NVLink 4, 450 GB/s per direction), 8 x NDR 400 Gb/s.

    Datasheet: https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    (H100 SXM: 67 TFLOP/s fp32, 495 TF32 and 989 bf16 tensor-core TFLOP/s dense -- the datasheet prints
    989 / 1,979 with 2:4 sparsity -- 3.35 TB/s HBM3).  Measured: nothing (issue 9's measurements on an
    H100 80 GB, predicted / measured step time 0.29-0.98 in fp32, showed these numbers predict small and
    launch-bound models 2-3x too fast).  Assumed: the per-class efficiencies (matmul 0.75, conv 0.6,
    default 0.6 of the mode's peak, the same in every mode), the 3 us launch overhead, the latencies and the
    share of memory a plan may fill (:data:`GPU_USABLE_FRACTION`)."""
    dev = DeviceSpec(67e12, 3.35e12, 80 * GiB, {"default": 0.6, "matmul": 0.75, "conv": 0.6,
                                                 "elementwise": 1.0}, 3e-6,
                     peaks={"tf32": 495e12, "bf16": 989e12})
    dev = with_gpu_reserve(dev)
    links = {"group": LinkSpec(450e9, 2.5e-6), "node": LinkSpec(450e9, 2.5e-6), "network": LinkSpec(400e9, 5e-6),
             "host": LinkSpec(50e9, 10e-6)}          # PCIe 5.0 x16
    return MachineSpec("h100", nodes, devices_per_node, devices_per_node, dev, links, overlap_grad_sync=True,
                       host_mem_bandwidth=300e9, host_memory_bytes=2048 * GiB)


PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")


@lru_cache(maxsize=None)
def fitted_device(name: str) -> tuple[DeviceSpec, dict] | None:
    """The device a preset fitted from measurements ships (``unity_pcg/presets/<name>.json``, written by
    ``benchmarks/fit_<name>.py``) and its provenance, or None when the file is missing."""
    path = os.path.join(PRESET_DIR, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        obj = json.load(f)
    base = h100_datasheet(1, 1).to_json()
    # the reserve for the runtime is the GPU presets' unless the file states its own
    base["device"] = {**{k: base["device"][k] for k in ("reserved_bytes", "usable_fraction")}, **obj["device"]}
    return MachineSpec.from_json(base, source=path).device, dict(obj.get("meta") or {})


def h100(nodes: int = 1, devices_per_node: int = 8) -> MachineSpec:
    """HGX H100: 8 x H100-SXM5 80 GB on NVSwitch (NVLink 4, 450 GB/s per direction), 8 x NDR 400 Gb/s,
    with the device FITTED FROM MEASUREMENTS on a real H100 80 GB HBM3 (torch 2.11, CUDA 13):
    ``unity_pcg/presets/h100.json``, written by ``benchmarks/fit_h100.py`` from
    ``benchmarks/results/h100_calibrated.json`` (``unity-pcg calibrate --device cuda`` on the H100).

    Measured: per-class kernel tables (work -> seconds) and fixed-cost + throughput fits for fp32, TF32
    and bf16 (matmul, convolutions, batched matmul, embedding forward/backward, element-wise,
    normalizations, softmax, reductions, pooling, SGD/Adam updates), the peak rate reached per math mode,
    the usable memory.  Against measured single-GPU training steps of the zoo at paper size
    (``benchmarks/gpu_cost.py``) the median error is 6-12% per precision.  Assumed: (one GPU measures no
    interconnect) NVLink 4 and NDR bandwidths from the datasheet (:func:`h100_datasheet`) and the link
    latencies; the share of memory held back for the runtime (:data:`GPU_USABLE_FRACTION`).  Without the fitted file (a trimmed install) the datasheet device is used."""
    m = h100_datasheet(nodes, devices_per_node)
    fitted = fitted_device("h100")
    if fitted is None:
        return m
    dev, meta = fitted
    return MachineSpec("h100", nodes, devices_per_node, devices_per_node, dev, m.links,
                       overlap_grad_sync=m.overlap_grad_sync, host_mem_bandwidth=m.host_mem_bandwidth,
                       host_memory_bytes=m.host_memory_bytes,
                       meta={"fitted": meta.get("fitted_from", "unity_pcg/presets/h100.json")})


def local(nodes: int = 1, devices_per_node: int = 2) -> MachineSpec:
    """This computer's CPU processes (uncalibrated guesses; run `unity-pcg calibrate` for real numbers).
    Devices are processes sharing the cores; links are loopback TCP (gloo).  Measured: nothing (these
    are guesses); every math mode runs at the fp32 peak (no ``peaks``) unless a calibration measured one."""
    cores = os.cpu_count() or 1
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 * GiB
    dev = DeviceSpec(30e9, 8e9, int(mem), {"default": 0.5, "matmul": 0.8, "conv": 0.4, "elementwise": 0.3}, 20e-6)
    links = {lv: LinkSpec(1.5e9, 60e-6) for lv in ("group", "node", "network")}
    return MachineSpec("local", nodes, devices_per_node, devices_per_node, dev, links, shared_cores=cores,
                       meta={"calibrated": False}, host_memory_bytes=int(mem))


PRESETS = {"summit": (summit, 6), "dgx-a100": (dgx_a100, 8), "h100": (h100, 8), "local": (local, None)}

_SIZE = re.compile(r"^(\d+)x(\d+)$")


def parse_machine(arg: str) -> MachineSpec:
    """``PRESET[:NODESxDEVICES]`` (``summit:32x6``) or ``FILE.json[:NODESxDEVICES]``."""
    if not isinstance(arg, str) or not arg.strip():
        raise MachineError("empty machine argument (use e.g. summit:32x6 or local.json)")
    base, _, size = arg.strip().rpartition(":") if _SIZE.match(arg.rpartition(":")[2]) else (arg.strip(), "", "")
    if base in PRESETS:
        fn, max_dpn = PRESETS[base]
        m = fn()
    elif base.endswith(".json") or os.path.exists(base):
        m = MachineSpec.load(base)
        max_dpn = None
    else:
        raise MachineError(f"unknown machine {base!r} (presets: {', '.join(PRESETS)}; or a machine JSON file)")
    if size:
        n, d = (int(x) for x in _SIZE.match(size).groups())
        if n < 1 or d < 1:
            raise MachineError(f"machine size {size!r}: nodes and devices must be >= 1")
        if max_dpn is not None and d > max_dpn:
            raise MachineError(f"machine {base!r} has at most {max_dpn} devices per node, {size!r} asks for {d}")
        m = m.resized(n, d)
    return m


# --- machine views --------------------------------------------------------------------------------

@lru_cache(maxsize=1 << 16)
def _view_devices(start: int, dims: tuple) -> tuple[int, ...]:
    out = [start]
    for d, s in dims:
        out = [o + i * s for o in out for i in range(d)]
    return tuple(out)


@dataclass(frozen=True, order=True)
class MachineView:
    start: int
    dims: tuple[tuple[int, int], ...]   # (degree, stride) per task-grid axis, major to minor

    @property
    def degree(self) -> int:
        return prod(d for d, _ in self.dims)

    def devices(self) -> tuple[int, ...]:
        """Device of every task, tasks in row-major order over ``dims``."""
        return _view_devices(self.start, self.dims)

    def __hash__(self) -> int:
        """The fields' hash, computed once (views key the pricers' memos; integers only, so a pickled view's
        kept value holds in any process)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.start, self.dims))
            object.__setattr__(self, "_hash", h)
        return h

    def is_valid(self, machine: MachineSpec) -> bool:
        devs = self.devices()
        return len(set(devs)) == len(devs) and min(devs) >= 0 and max(devs) < machine.num_devices

    def to_json(self) -> dict:
        return {"start": self.start, "dims": [list(d) for d in self.dims]}

    @staticmethod
    def from_json(obj: Mapping) -> "MachineView":
        try:
            return MachineView(int(obj["start"]), tuple((int(d), int(s)) for d, s in obj["dims"]))
        except (KeyError, TypeError, ValueError) as e:
            raise MachineError(f"malformed machine view {obj!r}: {e}") from None

    def __str__(self) -> str:
        return f"@{self.start}" + "".join(f"[{d}:{s}]" for d, s in self.dims)


@dataclass(frozen=True, order=True)
class Resource:
    """A block of devices the DP may use: ``nodes`` whole nodes from ``start`` (then ``per_node`` is
    ``devices_per_node``), or ``per_node`` devices of one node."""
    start: int
    nodes: int
    per_node: int

    @staticmethod
    def whole(machine: MachineSpec) -> "Resource":
        return Resource(0, machine.nodes, machine.devices_per_node)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    def devices(self, machine: MachineSpec) -> tuple[int, ...]:
        return tuple(self.start + n * machine.devices_per_node + j for n in range(self.nodes)
                     for j in range(self.per_node))

    def splits(self, machine: MachineSpec) -> Iterator[tuple["Resource", "Resource"]]:
        """Splits into two disjoint blocks by quantity (whole nodes, or devices inside one node)."""
        if self.nodes > 1:
            for a in range(1, self.nodes):
                yield (Resource(self.start, a, self.per_node),
                       Resource(self.start + a * machine.devices_per_node, self.nodes - a, self.per_node))
        else:
            for a in range(1, self.per_node):
                yield Resource(self.start, 1, a), Resource(self.start + a, 1, self.per_node - a)


def enumerate_views(grid: Sequence[int], machine: MachineSpec, resource: Resource | None = None
                    ) -> list[MachineView]:
    """Views of a task grid with the given per-axis degrees inside ``resource`` (default: the whole
    machine), following the hierarchy.  Axes of degree 1 get ``(1, 1)``.  For a grid of total degree
    D the count is at most ``6 * 4 * (devices / D)`` -- linear in the device count."""
    res = resource or Resource.whole(machine)
    grid = tuple(int(g) for g in grid)
    D = prod(grid)
    if D > res.size or D < 1:
        return []
    dpn = machine.devices_per_node
    k = res.per_node
    nontriv = [i for i, g in enumerate(grid) if g > 1]
    seen: set = set()
    out: list[MachineView] = []

    def to_abs(r: int) -> int:
        return res.start + (r // k) * dpn + (r % k)

    def rel_stride(rs: int) -> int:
        # relative stride -> absolute (valid because resources are whole nodes or part of one node)
        return (rs // k) * dpn + (rs % k) if k == dpn or res.nodes == 1 else rs

    for perm in (permutations(nontriv) if nontriv else [()]):
        degs = [grid[i] for i in perm]          # major .. minor
        layouts = []
        # (a) flat with relative stride s: contiguous (1), one per group, one per node
        for s in sorted({1, machine.group_size, k}):
            if s >= 1 and (D - 1) * s < res.size:
                strides, acc = [], s
                for d in reversed(degs):
                    strides.append(acc)
                    acc *= d
                layouts.append((tuple(reversed(strides)), (D - 1) * s + 1, s))
        # (b) minor axes inside a node, major axes across nodes
        if res.nodes > 1:
            for cut in range(1, len(degs)):
                b = prod(degs[cut:])
                a = prod(degs[:cut])
                if b <= k and a <= res.nodes:
                    strides, acc = [], 1
                    for d in reversed(degs[cut:]):
                        strides.append(acc)
                        acc *= d
                    acc = k
                    for d in reversed(degs[:cut]):
                        strides.append(acc)
                        acc *= d
                    layouts.append((tuple(reversed(strides)), (a - 1) * k + b, ("2d", cut)))
        for strides, span, tag in layouts:
            for st in _starts(tag, D, span, degs, res, k):
                devs_rel = [st]
                for d, s in zip(degs, strides):
                    devs_rel = [o + i * s for o in devs_rel for i in range(d)]
                if len(set(devs_rel)) != D or max(devs_rel) >= res.size:
                    continue
                abs_dims = {ax: (grid[ax], rel_stride(s)) for ax, s in zip(perm, strides)}
                dims = tuple(abs_dims.get(i, (1, 1)) for i in range(len(grid)))
                v = MachineView(to_abs(st), dims)
                if v not in seen:
                    seen.add(v)
                    out.append(v)
    return out


def _starts(tag, D: int, span: int, degs, res: Resource, k: int) -> list[int]:
    """Aligned start offsets (relative to the resource) for one layout."""
    size = res.size
    if isinstance(tag, tuple):                       # 2-D: blocks of a nodes x b local devices
        cut = tag[1]
        a, b = prod(degs[:cut]), prod(degs[cut:])
        return [n * k + j for n in range(0, res.nodes - a + 1, a) for j in range(0, k - b + 1, b)]
    s = tag
    if s == 1:                                       # contiguous block, aligned to its size
        return list(range(0, size - span + 1, D))
    # strided: interleaved offsets 0..s-1 inside each block of D*s devices
    return [blk + o for blk in range(0, size - span + 1, D * s) for o in range(s) if blk + o + span <= size]


__all__ = ["MachineSpec", "DeviceSpec", "LinkSpec", "MachineView", "Resource", "MachineError", "PRESETS", "MODES",
           "interpolate_table",
           "parse_machine", "enumerate_views", "summit", "dgx_a100", "h100", "h100_datasheet", "fitted_device", "local",
           "LEVELS", "SCHEMA"]
