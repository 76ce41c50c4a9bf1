"""Alpha-beta costs of collectives per link level (Alpa's prototype formulas; OneFlow Table 2 volumes).

Time of a message of ``n`` bytes over a link: ``alpha + n / beta`` (latency ``alpha`` s, bandwidth
``beta`` bytes/s).  A collective over ``p`` devices runs at the speed of the slowest link level it
spans (``MachineSpec.span_level``); across nodes the bandwidth is the node's NIC, which a ring that
visits the devices node by node crosses once per direction.

Volume convention (the whole project): the number of tensor elements sent by all devices.  For a
tensor of N elements: ring all-reduce 2(p-1)N, all-gather and reduce-scatter (p-1)N (N = the full,
gathered size), all-to-all (p-1)/p N, broadcast / reduce (p-1)N, point-to-point N.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

from unity_pcg.machine import LinkSpec, MachineSpec, interpolate_table


def _link(machine: MachineSpec, devs: Sequence[int]) -> LinkSpec | None:
    lv = machine.span_level(devs)
    return None if lv == "local" else machine.link(lv)


def measured_time(machine: MachineSpec, kind: str, p: int, nbytes: float) -> float | None:
    """Seconds of collective ``kind`` (``all_reduce``, ``all_gather``, ``broadcast``) over groups of ``p``
    devices moving ``nbytes`` (the full tensor; all-gather: the gathered one) from a calibrated local
    machine's measured table (``meta["worlds"][device_world]["collectives"]``, written by
    ``calibration.local``: P processes on shared cores wait for descheduled peers, which latency + bytes /
    bandwidth does not describe), interpolated as kernel tables are; None where the machine has none.
    Processes that outnumber the cores: the CPU work of the collective instead
    (:meth:`MachineSpec.collective_cpu_time`), where calibrated."""
    cpu = machine.collective_cpu_time(kind, p, nbytes)
    if cpu is not None:
        return cpu
    meta = machine.meta
    w = meta.get("device_world")
    worlds = meta.get("worlds")
    if w is None or not worlds:
        return None
    tab = ((worlds.get(str(w)) or {}).get("collectives") or {}).get(kind, {}).get(str(p))
    return interpolate_table(tab, nbytes) if tab else None


def group_level(machine: MachineSpec, devs: Sequence[int]) -> tuple[int, str]:
    """The shape a collective is priced by: the number of distinct devices and the slowest link level they
    span (``MachineSpec.span_level``); which devices they are matters no further."""
    return len(set(devs)), machine.span_level(devs)


def allreduce_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """Ring all-reduce: 2(p-1) steps of n/p bytes (a calibrated local machine: its measured table)."""
    return allreduce_time_of(machine, *group_level(machine, devs), nbytes)


def allreduce_time_of(machine: MachineSpec, p: int, level: str, nbytes: float) -> float:
    """:func:`allreduce_time` of a group of ``p`` devices spanning link level ``level``."""
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0
    link = machine.link(level)
    t = measured_time(machine, "all_reduce", p, nbytes)
    if t is not None:
        return t
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth


def allgather_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """Ring all-gather of a tensor of ``nbytes`` (gathered size): p-1 steps of n/p bytes (a calibrated
    local machine: its measured table)."""
    return allgather_time_of(machine, *group_level(machine, devs), nbytes)


def allgather_time_of(machine: MachineSpec, p: int, level: str, nbytes: float) -> float:
    """:func:`allgather_time` of a group of ``p`` devices spanning link level ``level``."""
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0
    link = machine.link(level)
    t = measured_time(machine, "all_gather", p, nbytes)
    if t is not None:
        return t
    return (p - 1) * link.latency + (p - 1) / p * nbytes / link.bandwidth


reduce_scatter_time = allgather_time
reduce_scatter_time_of = allgather_time_of


def alltoall_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """All-to-all of a tensor of ``nbytes`` in total: each device sends (p-1)/p of its n/p bytes."""
    p = len(set(devs))
    link = _link(machine, devs)
    if p <= 1 or link is None or nbytes <= 0:
        return 0.0
    return (p - 1) * link.latency + (p - 1) / (p * p) * nbytes / link.bandwidth


def broadcast_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """Pipelined (chunked ring) broadcast of ``nbytes`` from one of ``devs`` to the others (a calibrated
    local machine: its measured table)."""
    return broadcast_time_of(machine, *group_level(machine, devs), nbytes)


def broadcast_time_of(machine: MachineSpec, p: int, level: str, nbytes: float) -> float:
    """:func:`broadcast_time` of a group of ``p`` devices spanning link level ``level``."""
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0
    link = machine.link(level)
    t = measured_time(machine, "broadcast", p, nbytes)
    if t is not None:
        return t
    return math.ceil(math.log2(p)) * link.latency + nbytes / link.bandwidth


# reduce to one device = reduce-scatter + gather: 2(p-1)/p n bytes through the slowest link, the same
# alpha-beta cost as a ring all-reduce
reduce_time = allreduce_time
reduce_time_of = allreduce_time_of


def p2p_time(machine: MachineSpec, src: int, dst: int, nbytes: float) -> float:
    if src == dst or nbytes <= 0:
        return 0.0
    link = machine.link(machine.level(src, dst))
    return link.latency + nbytes / link.bandwidth


def transfer_time(machine: MachineSpec, moves: Iterable[tuple[int, int, float]]) -> float:
    """Many point-to-point messages at once (a resharding, an all-to-all): every endpoint sends and
    receives its bytes at its level's bandwidth (a node's network traffic shares its NIC); levels and
    endpoints work concurrently, so the time is the busiest endpoint's."""
    out_b: dict = defaultdict(float)
    in_b: dict = defaultdict(float)
    msgs: dict = defaultdict(int)
    any_move = False
    for src, dst, nb in moves:
        if src == dst or nb <= 0:
            continue
        any_move = True
        lv = machine.level(src, dst)
        if lv == "network":
            ks, kd = ("n", machine.node_of(src)), ("n", machine.node_of(dst))
        else:
            ks, kd = ("d", src), ("d", dst)
        out_b[(lv, ks)] += nb
        in_b[(lv, kd)] += nb
        msgs[(lv, ("d", src))] += 1
        msgs[(lv, ("d", dst))] += 1
    if not any_move:
        return 0.0
    t = 0.0
    for (lv, _), b in list(out_b.items()) + list(in_b.items()):
        t = max(t, b / machine.link(lv).bandwidth)
    lat = max(machine.link(lv).latency * n for (lv, _), n in msgs.items())
    return t + lat


def transfer_time_uniform(machine: MachineSpec, src, dst, nbytes: int) -> float:
    """:func:`transfer_time` of the messages ``(src[i], dst[i], nbytes)`` (numpy integer arrays, one byte
    count for all), counted per endpoint instead of summed message by message.  Equal to
    :func:`transfer_time` bit for bit: an endpoint's bytes are a count times an integer ``nbytes``, exact in
    a float below 2**53 as every partial sum of the message-by-message loop is (larger or non-integer byte
    counts take that loop)."""
    import numpy as np
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if not isinstance(nbytes, int) or nbytes * max(len(src), 1) >= 2 ** 53:
        return transfer_time(machine, zip(src.tolist(), dst.tolist(), [nbytes] * len(src)))
    if nbytes <= 0:
        return 0.0
    keep = src != dst
    if not keep.any():
        return 0.0
    src, dst = src[keep], dst[keep]
    dpn = machine.devices_per_node
    ns, nd = src // dpn, dst // dpn
    gs, gd = device_groups(machine, src), device_groups(machine, dst)
    net = ns != nd
    node = ~net & (gs != gd)
    levels = (("network", net), ("node", node), ("group", ~net & ~node))
    t = 0.0
    lat = 0.0
    for lv, sel in levels:
        if not sel.any():
            continue
        link = machine.link(lv)
        ks, kd = (ns[sel], nd[sel]) if lv == "network" else (src[sel], dst[sel])
        busiest = max(int(np.bincount(ks).max()), int(np.bincount(kd).max()))
        t = max(t, float(busiest * nbytes) / link.bandwidth)
        n = int(np.bincount(np.concatenate([src[sel], dst[sel]])).max())
        lat = max(lat, link.latency * n)
    return t + lat


def device_groups(machine: MachineSpec, devs):
    """``MachineSpec.group_of`` of a numpy array of devices."""
    gsz, dpn = machine.group_size, machine.devices_per_node
    if dpn % gsz == 0:
        return devs // gsz
    return (devs // dpn) * 10_000 + (devs % dpn) // gsz


def allreduce_elements(p: int, numel: int) -> int:
    return 2 * (p - 1) * numel if p > 1 else 0


__all__ = ["measured_time", "group_level", "allreduce_time_of", "allgather_time_of", "reduce_scatter_time_of",
           "broadcast_time_of", "reduce_time_of", "transfer_time_uniform", "device_groups", "allreduce_time", "allgather_time", "reduce_scatter_time", "alltoall_time", "broadcast_time",
           "reduce_time", "p2p_time", "transfer_time", "allreduce_elements"]
