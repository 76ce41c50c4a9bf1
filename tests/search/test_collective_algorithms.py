"""Collective algorithms chosen as runtimes choose them (search/collectives.py): ring, tree across nodes and
per-level (hierarchical) phases, the fastest for the message size; never slower than the flat ring, a single
one-level node unchanged, calibrated tables kept."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from unity_pcg.machine import LinkSpec, parse_machine
from unity_pcg.search import collectives as C
from unity_pcg.search.cost import CostModel


def _ring_allreduce(m, p, level, n):
    """The flat ring all-reduce as the project priced it before algorithms were chosen."""
    link = m.link(level)
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * n / link.bandwidth


def _ring_gather(m, p, level, n):
    link = m.link(level)
    return (p - 1) * link.latency + (p - 1) / p * n / link.bandwidth


def _old_broadcast(m, p, level, n):
    link = m.link(level)
    return math.ceil(math.log2(p)) * link.latency + n / link.bandwidth


def _two_level(nodes=4, dpn=8, nvlink=300e9, nic=25e9, a_in=2e-6, a_net=10e-6):
    """One NVLink group per node, a slow NIC: the two-level machine where per-level phases pay."""
    m = parse_machine(f"h100:{nodes}x{dpn}")
    return replace(m, links={"group": LinkSpec(nvlink, a_in), "node": LinkSpec(nvlink, a_in),
                             "network": LinkSpec(nic, a_net), "host": m.links["host"]})


def test_packed_levels():
    assert C.packed_levels(parse_machine("h100:128x8"), 1024, "network") == (("group", 8), ("network", 128))
    assert C.packed_levels(parse_machine("h100:128x8"), 128, "network") == (("group", 8), ("network", 16))
    assert C.packed_levels(parse_machine("summit:171x6"), 1020, "network") == \
        (("group", 3), ("node", 2), ("network", 170))
    assert C.packed_levels(parse_machine("summit:1x6"), 6, "node") == (("group", 3), ("node", 2))
    assert C.packed_levels(parse_machine("summit:1x6"), 2, "node") == (("node", 2),)
    assert C.packed_levels(parse_machine("summit:4x6"), 4, "network") == (("group", 2), ("network", 2))
    assert C.packed_levels(parse_machine("h100:4x8"), 2, "network") == (("network", 2),)
    assert C.packed_levels(parse_machine("h100:4x8"), 11, "network") is None      # 11 devices: no even packing
    assert C.packed_levels(parse_machine("h100:4x8"), 5, "group") == (("group", 5),)


def test_group_shape_reads_the_levels_crossed():
    s = parse_machine("summit:4x6")
    assert C.group_shape(s, [0, 1, 3, 4]) == (4, "node", (("group", 2), ("node", 2)))
    assert C.group_shape(s, [2, 3, 4, 5]) == (4, "node", None)            # 1 + 3: uneven, flat only
    assert C.group_shape(s, [0, 6, 12, 18]) == (4, "network", (("network", 4),))
    assert C.group_shape(s, range(24)) == (24, "network", (("group", 3), ("node", 2), ("network", 4)))
    assert C.group_shape(s, [7, 7]) == (1, "local", None)
    # uneven groups are priced by the flat ring alone; the densest packing would have split 2 + 2
    n = 1e8
    assert C.allreduce_time(s, [2, 3, 4, 5], n) == pytest.approx(_ring_allreduce(s, 4, "node", n))
    assert C.allreduce_time(s, [0, 1, 3, 4], n) < C.allreduce_time(s, [2, 3, 4, 5], n)
    assert C.allreduce_time_of(s, 4, "node", n) == C.allreduce_time(s, [0, 1, 3, 4], n)


def test_tree_across_nodes_by_hand():
    """1,024 H100s (128 nodes x 8): NCCL's tree (a chain of 8 in each node, a double binary tree over the
    128 nodes) against the ring's 2 x 1,023 network latencies."""
    m = parse_machine("h100:128x8")
    g, net = m.links["group"], m.links["network"]
    n = 4e6
    tree = 2 * (7 * g.latency + 7 * net.latency) + 2 * n / min(net.bandwidth, g.bandwidth)
    assert C.allreduce_time(m, range(1024), n) == pytest.approx(tree)
    assert C.algorithm_name(m, "all_reduce", range(1024), n) == "tree"
    assert tree < _ring_allreduce(m, 1024, "network", n) / 10


def test_hierarchical_wins_on_a_two_level_machine():
    """4 nodes x 8 GPUs, 300 GB/s NVLink, a 25 GB/s NIC: a large all-reduce runs as a reduce-scatter in the
    node, a ring all-reduce of the eighths among the 4 nodes (8 rails sharing the NIC), an all-gather."""
    m = _two_level()
    g, net = m.links["group"], m.links["network"]
    n = 1e9
    hier = (2 * 7 * g.latency + 2 * 7 / 8 * n / g.bandwidth          # reduce-scatter + all-gather in the node
            + 2 * 3 * net.latency + 2 * 3 / 4 * n / net.bandwidth)    # 8 rails x 1/8 of the bytes through a NIC
    assert C.allreduce_time(m, range(32), n) == pytest.approx(hier)
    assert C.algorithm_name(m, "all_reduce", range(32), n) == "hierarchical group>network (ring)"
    ring = _ring_allreduce(m, 32, "network", n)
    tree = 2 * (7 * g.latency + 2 * net.latency) + 2 * n / net.bandwidth
    assert hier < min(ring, tree) * 0.9
    # reduce-scatter and all-gather: the same per-level phases, once each
    rs = 7 * g.latency + 7 / 8 * n / g.bandwidth + 3 * net.latency + 3 / 4 * n / net.bandwidth
    assert C.reduce_scatter_time(m, range(32), n) == pytest.approx(rs)
    assert C.allgather_time(m, range(32), n) == pytest.approx(rs)
    assert rs < _ring_gather(m, 32, "network", n)


@pytest.mark.parametrize("machine", ["h100:1x8", "dgx-a100:1x8", "h100:1x4"])
def test_a_single_one_level_node_is_unchanged(machine):
    m = parse_machine(machine)
    for p in range(2, m.devices_per_node + 1):
        for n in (1.0, 1e3, 1e6, 1e9):
            assert C.allreduce_time(m, range(p), n) == pytest.approx(_ring_allreduce(m, p, "group", n), rel=1e-12)
            assert C.allgather_time(m, range(p), n) == pytest.approx(_ring_gather(m, p, "group", n), rel=1e-12)
            assert C.broadcast_time(m, range(p), n) == pytest.approx(_old_broadcast(m, p, "group", n), rel=1e-12)
            assert C.algorithm_name(m, "all_reduce", range(p), n) == "ring"


@pytest.mark.parametrize("machine", ["h100:128x8", "summit:171x6", "dgx-a100:16x8", "summit:8x4", "two-level"])
def test_never_slower_than_the_ring(machine):
    """Over group sizes, the levels they span and message sizes: each collective's choice is at most the flat
    ring (the old formulas) and is the fastest of the algorithms listed."""
    m = _two_level(nodes=64) if machine == "two-level" else parse_machine(machine)
    dpn = m.devices_per_node
    sizes = sorted({2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 510, 512, 1020, 1024})
    seen = set()
    checked = 0
    for p in sizes:
        if p > m.num_devices:
            continue
        groups = {"packed": list(range(p))}
        if p <= m.nodes:
            groups["one per node"] = [i * dpn for i in range(p)]
        if p <= dpn:
            groups["strided in a node"] = list(range(0, p * (dpn // p), dpn // p))
        for devs in groups.values():
            q, level, levels = C.group_shape(m, devs)
            for n in (8.0, 4e3, 1e5, 4e6, 1.6e8, 4e9):
                for kind, got, old in (("all_reduce", C.allreduce_time, _ring_allreduce),
                                       ("reduce_scatter", C.reduce_scatter_time, _ring_gather),
                                       ("all_gather", C.allgather_time, _ring_gather),
                                       ("broadcast", C.broadcast_time, _old_broadcast)):
                    t = got(m, devs, n)
                    assert 0 < t <= old(m, q, level, n) * (1 + 1e-12), (kind, q, level, n)
                    algs = C.algorithms_of(m, kind, q, level, levels)
                    assert t == pytest.approx(min(a[1] + n * a[2] for a in algs), rel=1e-12)
                    seen.add(C.algorithm_name(m, kind, devs, n).split(" ")[0])
                    checked += 1
                # an all-reduce is never dearer than the reduce-scatter + all-gather that make it (ZeRO's pair)
                assert C.allreduce_time(m, devs, n) <= (C.reduce_scatter_time(m, devs, n)
                                                        + C.allgather_time(m, devs, n)) * (1 + 1e-12)
    assert checked > 300
    assert "ring" in seen or "tree" in seen


def test_split_parts_add_up_and_follow_the_message_size():
    m = parse_machine("h100:16x8")
    devs = range(128)
    for n in (1e3, 1e6, 1e9):
        lat, bw = C.allreduce_split(m, devs, n)
        assert lat + bw == pytest.approx(C.allreduce_time(m, devs, n))
    # the algorithm is the bucket's: a small weight in a 25 MiB bucket pays that algorithm's bytes term
    lat, bw = C.allreduce_split(m, devs, 1e3, message=25 * 2 ** 20)
    name, l2, pb = C.best_of(m, "all_reduce", 128, "network", 25 * 2 ** 20)
    assert (lat, bw) == pytest.approx((l2, 1e3 * pb))
    assert C.allreduce_split(m, [3], 1e6) == (0.0, 0.0)


def test_gradient_sync_at_1024_gpus_is_not_latency_bound():
    """Data-parallel gradient sync over 1,024 H100s: per weight at most the ring's price, and the step's
    bucket latencies no longer 2 x 1,023 network latencies each."""
    m = parse_machine("h100:128x8")
    cm = CostModel(m)
    total = 4e9
    devs = list(range(1024))
    t = cm.grad_allreduce_time(devs, 1e8, total)
    ring_lat = 2 * 1023 * m.links["network"].latency
    ring = 2 * 1023 / 1024 * 1e8 / m.links["network"].bandwidth + ring_lat * cm.bucket_count(total) * 1e8 / total
    assert t < ring / 10                       # the ring: 2 x 1,023 x 5 us per 25 MiB bucket


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError):
        C.algorithms_of(parse_machine("h100:2x8"), "all_to_all", 16, "network")


def test_explain_names_the_gradient_sync_algorithm(tmp_path):
    """`explain` records the algorithm each gradient all-reduce is priced with: the tree over 32 nodes, the
    ring inside one node."""
    from unity_pcg import plan as P
    from unity_pcg.explanation import explain, format_text
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.mapping import MachineMapper
    from tests.unity_pcg.test_explain import _mlp

    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in model bytes")
    seen = {}
    for machine, d in (("h100:32x8", 256), ("h100:1x8", 8)):
        m = parse_machine(machine)
        g = data_parallel(_mlp(b=d * 2), d)
        r = MachineMapper(CostModel(m)).optimize(g)
        assert r.feasible
        e = explain(P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json()))
        seen[machine] = {row.algorithm for row in e.grad_sync}
        assert all(row.to_json()["algorithm"] == row.algorithm for row in e.grad_sync)
        assert "per group of copies: " + ", ".join(sorted(seen[machine])) in format_text(e)
    assert seen["h100:1x8"] == {"ring"}
    assert seen["h100:32x8"] and "ring" not in seen["h100:32x8"]
