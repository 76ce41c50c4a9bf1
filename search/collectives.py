"""Alpha-beta costs of collectives per link level, each priced by the fastest algorithm a runtime would pick.

Time of a message of ``n`` bytes over a link: ``alpha + n / beta`` (latency ``alpha`` s, bandwidth
``beta`` bytes/s).  Links are per level (``group``, ``node``: per device; ``network``: the node's NIC,
shared by its devices).  As NCCL's tuner does, a collective over ``p`` devices is priced by each algorithm
that applies and the fastest wins (:func:`algorithms_of`, :func:`best_of`), so a choice is never slower than
the flat ring (always a candidate):

* ``ring``: over the slowest link level spanned (``MachineSpec.span_level``); a ring that visits the devices
  node by node crosses each NIC once per direction.  All-reduce 2(p-1) steps of n/p bytes.
* ``tree`` (all-reduce across nodes): NCCL's double binary tree among nodes, a chain inside each node:
  2((d-1) alpha_intra + ceil(log2 k) alpha_net) latency, 2n through the slowest link (pipelined).
* ``hierarchical``: per-level phases on each level's own link -- reduce-scatter up the levels, an all-reduce
  (ring or tree) at the outermost, all-gather down; the inner phases leave shards on the devices, so the
  outer phase runs one "rail" per device of a node and the rails share the NIC (network bytes = the whole
  tensor's).  Adjacent levels may be merged into one phase (every split is priced).  Reduce-scatter and
  all-gather: ring or the per-level phases; broadcast: pipelined tree, flat or per level.

A collective's price reads the group's shape (:func:`group_shape`): its distinct devices, the slowest level
spanned and the levels it crosses with their fan-outs, exact where every node and fast group holds the same
number of its devices, else none (flat algorithms only).  The ``*_time_of`` functions take the shape; without
``levels`` they assume the densest packing of ``p`` devices (:func:`packed_levels`).  Calibrated local
machines with measured tables (:func:`measured_time`) keep their tables.

Volume convention (the whole project, whatever algorithm prices the time): the number of tensor elements
sent by all devices.  For a tensor of N elements: ring all-reduce 2(p-1)N, all-gather and reduce-scatter
(p-1)N (N = the full, gathered size), all-to-all (p-1)/p N, broadcast / reduce (p-1)N, point-to-point N.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
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
    """The number of distinct devices and the slowest link level they span (``MachineSpec.span_level``)."""
    return len(set(devs)), machine.span_level(devs)


def levels_from_counts(machine: MachineSpec, p: int, level: str, nodes: int, groups: int, per_node: int,
                       per_group: int) -> tuple[tuple[str, int], ...] | None:
    """The link levels a group of ``p`` distinct devices crosses, innermost first with their fan-outs, from
    the nodes and fast groups it touches and the most devices it has in one node and in one group; None
    where they are uneven (a node or group holds more than its share: only flat algorithms apply)."""
    if p <= 1 or level == "local":
        return None
    if nodes * per_node != p or groups * per_group != p or groups % nodes:
        return None
    q, m = per_group, groups // nodes
    return tuple(x for x in (("group", q), ("node", m), ("network", nodes)) if x[1] > 1)


def group_shape(machine: MachineSpec, devs: Sequence[int]) -> tuple[int, str, tuple | None]:
    """The shape a collective is priced by: the number of distinct devices, the slowest link level they span
    and the levels they cross (:func:`levels_from_counts`); which devices they are matters no further."""
    ds = set(devs)
    p = len(ds)
    if p <= 1:
        return p, "local", None
    dpn, gs = machine.devices_per_node, machine.group_size
    per_node = Counter([d // dpn for d in ds])
    # MachineSpec.group_of, inlined
    per_group = Counter([d // gs for d in ds] if dpn % gs == 0 else [(d // dpn, d % dpn // gs) for d in ds])
    level = "network" if len(per_node) > 1 else "node" if len(per_group) > 1 else "group"   # span_level
    return p, level, levels_from_counts(machine, p, level, len(per_node), len(per_group), max(per_node.values()),
                                        max(per_group.values()))


# --- algorithms -----------------------------------------------------------------------------------

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
#: ``levels`` argument meaning "the densest packing of p devices spanning the level" (:func:`packed_levels`)
PACKED = "packed"


def packed_levels(machine: MachineSpec, p: int, level: str) -> tuple[tuple[str, int], ...] | None:
    """The link levels ``p`` devices spanning ``level`` cross when packed as densely as the machine allows,
    innermost first, each with its fan-out (``(("group", 4), ("network", 16))``: 16 nodes of 4 devices, one
    group each); the fan-outs multiply to ``p``.  Fewest nodes (at least 2 when ``level`` is ``network``),
    then fewest groups per node (at least 2 when ``level`` is ``node``); a node part that fits no whole groups
    is one ``node`` level.  None where no even packing exists (``p`` prime past a node): flat algorithms only."""
    if p <= 1 or level == "local":
        return None
    if level == "group":
        return (("group", p),)
    dpn, gs = machine.devices_per_node, machine.group_size
    gpn = -(-dpn // gs)                             # groups per node

    def in_node(d: int, at_least: int) -> tuple[tuple[str, int], ...] | None:
        if d == 1:
            return ()
        if gpn == 1:
            return (("group", d),)
        for m in range(at_least, gpn + 1):
            if d % m == 0 and d // m <= gs:
                q = d // m
                return tuple(x for x in (("group", q), ("node", m)) if x[1] > 1)
        return None

    if level == "node":
        return in_node(p, 2)
    for k in range(2, machine.nodes + 1):
        if p % k == 0 and p // k <= dpn:
            inner = in_node(p // k, 1)
            if inner is None:
                inner = (("node", p // k),)
            return inner + (("network", k),)
    return None


def _splits(levels):
    """Every way to cut the levels (innermost first) into consecutive blocks, each block one phase."""
    n = len(levels)
    for mask in range(1 << (n - 1)):
        blocks, cur = [], [levels[0]]
        for i in range(1, n):
            if mask >> (i - 1) & 1:
                blocks.append(tuple(cur))
                cur = []
            cur.append(levels[i])
        blocks.append(tuple(cur))
        yield blocks


def _fan(block) -> int:
    return math.prod(f for _, f in block)


def _ring_phase(machine: MachineSpec, block, rails: int, steps_per_hop: int) -> tuple[float, float]:
    """(latency s, seconds per byte of the whole tensor) of a ring reduce-scatter (``steps_per_hop`` 1) or
    all-reduce (2) over one block of levels, run by ``rails`` concurrent rings on shards of 1/rails of the
    tensor; priced at the block's outermost link (the NIC shared by the rails of a node)."""
    f = _fan(block)
    lv = block[-1][0]
    link = machine.link(lv)
    per_byte = steps_per_hop * (f - 1) / f / link.bandwidth
    if lv != "network":
        per_byte /= rails                         # per-device links: each rail moves its own shard
    return steps_per_hop * (f - 1) * link.latency, per_byte


def _tree_phase(machine: MachineSpec, block, rails: int) -> tuple[float, float] | None:
    """NCCL's tree all-reduce over one block ending at the network: a double binary tree among the ``k``
    nodes, a chain through the block's ``d`` devices inside each node; 2n through the NIC (shared by the
    rails) and 2 n / rails through the chain's links, pipelined (the slower of the two)."""
    if block[-1][0] != "network":
        return None
    k = block[-1][1]
    net = machine.link("network")
    lat = 2 * math.ceil(math.log2(k)) * net.latency
    per_byte = 2 / net.bandwidth
    d = _fan(block[:-1])
    if d > 1:
        intra = machine.link(block[-2][0])
        lat += 2 * (d - 1) * intra.latency
        per_byte = max(per_byte, 2 / rails / intra.bandwidth)
    return lat, per_byte


def algorithms_of(machine: MachineSpec, kind: str, p: int, level: str, levels=PACKED) -> list[tuple[str, float, float]]:
    """Every algorithm that runs collective ``kind`` (:data:`KINDS`) over ``p`` devices spanning link level
    ``level`` and crossing ``levels`` (:func:`group_shape`; None: uneven, flat algorithms only; default the
    densest packing, :func:`packed_levels`), as ``(name, latency s, seconds per byte)``: its time for a
    tensor of ``n`` bytes (all-gather: the gathered size) is ``latency + n * seconds per byte``.  The first
    is the flat ring (broadcast: the flat pipelined tree), the formula the project priced before
    algorithms were chosen.  Empty where nothing moves (``p <= 1`` or ``local``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r} (known: {', '.join(KINDS)})")
    if p <= 1 or level == "local":
        return []
    link = machine.link(level)
    if kind == "broadcast":
        out = [("tree", math.ceil(math.log2(p)) * link.latency, 1 / link.bandwidth)]
    elif kind == "all_reduce":
        out = [("ring", 2 * (p - 1) * link.latency, 2 * (p - 1) / p / link.bandwidth)]
    else:
        out = [("ring", (p - 1) * link.latency, (p - 1) / p / link.bandwidth)]
    if levels == PACKED:
        levels = packed_levels(machine, p, level)
    if not levels:
        return out
    if kind == "broadcast":
        if len(levels) > 1:   # one pipelined tree per level, the bytes through the slowest link
            out.append(("hierarchical " + ">".join(lv for lv, _ in levels),
                        sum(math.ceil(math.log2(f)) * machine.link(lv).latency for lv, f in levels),
                        max(1 / machine.link(lv).bandwidth for lv, _ in levels)))
        return out
    if kind == "all_reduce":
        tree = _tree_phase(machine, levels, 1)
        if tree is not None:
            out.append(("tree", *tree))
    for blocks in _splits(levels):
        if len(blocks) == 1:
            continue                                  # the flat ring / tree above
        lat = per_byte = 0.0
        rails = 1
        names = []
        outer = blocks[-1]
        for blk in blocks[:-1]:                       # reduce-scatter up (all-reduce: all-gather down too)
            l_, b_ = _ring_phase(machine, blk, rails, 1)
            mult = 2 if kind == "all_reduce" else 1
            lat, per_byte = lat + mult * l_, per_byte + mult * b_
            rails *= _fan(blk)
            names.append("+".join(lv for lv, _ in blk))
        tag = "hierarchical " + ">".join(names + ["+".join(lv for lv, _ in outer)])
        if kind != "all_reduce":
            l_, b_ = _ring_phase(machine, outer, rails, 1)
            out.append((tag, lat + l_, per_byte + b_))
            continue
        l_, b_ = _ring_phase(machine, outer, rails, 2)
        out.append((tag + " (ring)", lat + l_, per_byte + b_))
        tree = _tree_phase(machine, outer, rails)
        if tree is not None:
            out.append((tag + " (tree)", lat + tree[0], per_byte + tree[1]))
    return out


def best_of(machine: MachineSpec, kind: str, p: int, level: str, nbytes: float,
            levels=PACKED) -> tuple[str, float, float]:
    """The fastest of :func:`algorithms_of` for a message of ``nbytes``: ``(name, latency s, seconds per
    byte)`` (the first listed on a tie, so the ring where nothing is faster); ``("none", 0, 0)`` where
    nothing moves."""
    best = ("none", 0.0, 0.0)
    t_best = math.inf
    for alg in _algorithms_cached(machine, kind, p, level, levels):
        t = alg[1] + nbytes * alg[2]
        if t < t_best:
            best, t_best = alg, t
    return best


_ALG_MEMO: dict = {}


def _algorithms_cached(machine: MachineSpec, kind: str, p: int, level: str, levels=PACKED) -> list:
    """:func:`algorithms_of`, memoized on everything it reads of the machine."""
    links = machine.links
    key = (kind, p, level, levels, machine.nodes, machine.devices_per_node, machine.group_size,
           tuple((lv, links[lv].bandwidth, links[lv].latency) for lv in ("group", "node", "network")))
    hit = _ALG_MEMO.get(key)
    if hit is None:
        if len(_ALG_MEMO) > 50_000:
            _ALG_MEMO.clear()
        hit = _ALG_MEMO[key] = algorithms_of(machine, kind, p, level, levels)
    return hit


def _time_of(machine: MachineSpec, kind: str, p: int, level: str, nbytes: float, levels=PACKED) -> float:
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0
    t = measured_time(machine, "all_gather" if kind == "reduce_scatter" else kind, p, nbytes)
    if t is not None:
        return t
    _, lat, per_byte = best_of(machine, kind, p, level, nbytes, levels)
    return lat + nbytes * per_byte


def algorithm_name(machine: MachineSpec, kind: str, devs: Sequence[int], nbytes: float) -> str:
    """The algorithm that prices collective ``kind`` of ``nbytes`` over ``devs``: ``measured`` (a calibrated
    machine's table), ``none`` (nothing moves), else :func:`best_of`'s name (``ring``, ``tree``,
    ``hierarchical group>network (tree)``, ...)."""
    p, level, levels = group_shape(machine, devs)
    if p <= 1 or level == "local" or nbytes <= 0:
        return "none"
    table = "all_gather" if kind == "reduce_scatter" else kind
    if measured_time(machine, table, p, nbytes) is not None:
        return "measured"
    return best_of(machine, kind, p, level, nbytes, levels)[0]


def allreduce_split(machine: MachineSpec, devs: Sequence[int], nbytes: float,
                    message: float | None = None) -> tuple[float, float]:
    """(latency part, bandwidth part) in seconds of the all-reduce of ``nbytes`` over ``devs`` when it travels
    in messages of ``message`` bytes (gradient buckets; default ``nbytes``): the algorithm is the fastest
    for the message size (as a runtime picks per call), the bandwidth part its bytes term for ``nbytes``,
    the latency part one message's.  A calibrated machine's measured table: the table's time less the ring's
    bytes term at its fitted link."""
    p, level, levels = group_shape(machine, devs)
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0, 0.0
    full = measured_time(machine, "all_reduce", p, nbytes)
    if full is not None:
        bw = 2 * (p - 1) / p * nbytes / machine.link(level).bandwidth
        return full - bw, bw
    _, lat, per_byte = best_of(machine, "all_reduce", p, level, message if message else nbytes, levels)
    return lat, nbytes * per_byte


def reduce_scatter_split(machine: MachineSpec, devs: Sequence[int], nbytes: float,
                         message: float | None = None) -> tuple[float, float] | None:
    """:func:`allreduce_split` of a reduce-scatter (or all-gather, the same cost) of ``nbytes`` (the full
    size); None on a calibrated machine with a measured table (the caller interpolates it per bucket)."""
    p, level, levels = group_shape(machine, devs)
    if p <= 1 or level == "local" or nbytes <= 0:
        return 0.0, 0.0
    if measured_time(machine, "all_gather", p, nbytes) is not None:
        return None
    _, lat, per_byte = best_of(machine, "reduce_scatter", p, level, message if message else nbytes, levels)
    return lat, nbytes * per_byte


# --- times -----------------------------------------------------------------------------------------

def allreduce_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """All-reduce: the fastest of ring, tree and per-level algorithms (:func:`algorithms_of`; a calibrated
    local machine: its measured table)."""
    p, level, levels = group_shape(machine, devs)
    return allreduce_time_of(machine, p, level, nbytes, levels)


def allreduce_time_of(machine: MachineSpec, p: int, level: str, nbytes: float, levels=PACKED) -> float:
    """:func:`allreduce_time` of a group of ``p`` devices spanning link level ``level`` and crossing ``levels``
    (:func:`group_shape`; default the densest packing)."""
    return _time_of(machine, "all_reduce", p, level, nbytes, levels)


def allgather_time(machine: MachineSpec, devs: Sequence[int], nbytes: float) -> float:
    """All-gather of a tensor of ``nbytes`` (gathered size): the faster of the ring (p-1 steps of n/p bytes)
    and the per-level phases (a calibrated local machine: its measured table)."""
    p, level, levels = group_shape(machine, devs)
    return allgather_time_of(machine, p, level, nbytes, levels)


def allgather_time_of(machine: MachineSpec, p: int, level: str, nbytes: float, levels=PACKED) -> float:
    """:func:`allgather_time` of a group of ``p`` devices spanning link level ``level`` and crossing
    ``levels``."""
    return _time_of(machine, "all_gather", p, level, nbytes, levels)


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
    """Pipelined (chunked) tree broadcast of ``nbytes`` from one of ``devs`` to the others, flat or one tree
    per level (a calibrated local machine: its measured table)."""
    p, level, levels = group_shape(machine, devs)
    return broadcast_time_of(machine, p, level, nbytes, levels)


def broadcast_time_of(machine: MachineSpec, p: int, level: str, nbytes: float, levels=PACKED) -> float:
    """:func:`broadcast_time` of a group of ``p`` devices spanning link level ``level`` and crossing
    ``levels``."""
    return _time_of(machine, "broadcast", p, level, nbytes, levels)


# reduce to one device = reduce-scatter + gather: priced as the all-reduce (its algorithms)
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


__all__ = ["KINDS", "PACKED", "packed_levels", "levels_from_counts", "group_shape", "algorithms_of", "best_of", "algorithm_name", "allreduce_split",
           "reduce_scatter_split", "measured_time", "group_level", "allreduce_time_of", "allgather_time_of", "reduce_scatter_time_of",
           "broadcast_time_of", "reduce_time_of", "transfer_time_uniform", "device_groups", "allreduce_time", "allgather_time", "reduce_scatter_time", "alltoall_time", "broadcast_time",
           "reduce_time", "p2p_time", "transfer_time", "allreduce_elements"]
