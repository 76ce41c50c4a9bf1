import json

import pytest

from unity_pcg.machine import (MachineError, MachineSpec, MachineView, Resource, enumerate_views, parse_machine)


def test_presets_and_sizes():
    m = parse_machine("summit:32x6")
    assert (m.nodes, m.devices_per_node, m.group_size, m.num_devices) == (32, 6, 3, 192)
    assert m.device.memory_bytes == 16 * 2**30
    assert m.level(0, 1) == "group" and m.level(0, 3) == "node" and m.level(0, 6) == "network"
    assert m.level(4, 4) == "local"
    assert m.links["group"].bandwidth > m.links["node"].bandwidth > m.links["network"].bandwidth
    assert parse_machine("summit").num_devices == 6
    for name in ("dgx-a100", "h100"):
        assert parse_machine(f"{name}:2x8").num_devices == 16
    assert parse_machine("local:1x4").num_devices == 4


@pytest.mark.parametrize("arg", ["", "nosuch:1x2", "summit:1x7", "summit:0x6", "missing.json"])
def test_bad_machine_arguments_are_typed_errors(arg):
    with pytest.raises(MachineError):
        parse_machine(arg)


def test_json_round_trip_and_validation(tmp_path):
    m = parse_machine("summit:2x6")
    p = tmp_path / "m.json"
    m.save(str(p))
    back = MachineSpec.load(str(p))
    assert back == m
    assert parse_machine(f"{p}:4x6").num_devices == 24
    obj = json.loads(p.read_text())
    for mutate, msg in [
        (lambda o: o.pop("nodes"), "nodes"),
        (lambda o: o["device"].update(peak_flops=-1), "peak_flops"),
        (lambda o: o["device"].update(peak_flops="fast"), "peak_flops"),
        (lambda o: o["links"].pop("network"), "network"),
        (lambda o: o.update(group_size=9), "group_size"),
        (lambda o: o.update(colour="red"), "colour"),
        (lambda o: o["device"]["efficiency"].update(matmul=1.5), "efficiency"),
        (lambda o: o.update(schema="other/v9"), "schema"),
    ]:
        o = json.loads(json.dumps(obj))
        mutate(o)
        p2 = tmp_path / "bad.json"
        p2.write_text(json.dumps(o))
        with pytest.raises(MachineError, match=msg):
            MachineSpec.load(str(p2))
    p3 = tmp_path / "broken.json"
    p3.write_text("{nope")
    with pytest.raises(MachineError, match="not valid JSON"):
        MachineSpec.load(str(p3))


def test_view_devices_and_json():
    v = MachineView(6, ((2, 6), (3, 1)))
    assert v.devices() == (6, 7, 8, 12, 13, 14)
    assert v.degree == 6
    assert MachineView.from_json(v.to_json()) == v
    assert v.is_valid(parse_machine("summit:3x6")) and not v.is_valid(parse_machine("summit:2x6"))


@pytest.mark.parametrize("grid", [(1,), (2,), (3,), (6,), (12,), (2, 3), (3, 2, 2), (4,)])
def test_views_are_valid_distinct_and_follow_the_hierarchy(grid):
    m = parse_machine("summit:4x6")
    vs = enumerate_views(grid, m)
    assert vs and len(set(vs)) == len(vs)
    for v in vs:
        assert v.is_valid(m)
        assert tuple(d for d, _ in v.dims) == grid
    # a 1-D view inside one node exists for small degrees; data parallel over all devices is contiguous
    if len(grid) == 1 and grid[0] <= 6:
        assert any(m.span_level(v.devices()) in ("local", "group", "node") for v in vs)
    assert enumerate_views((24,), m) == [MachineView(0, ((24, 1),))]


def test_2d_view_model_parallel_inside_node_data_parallel_across():
    m = parse_machine("summit:4x6")
    vs = enumerate_views((4, 6), m)          # 4-way across nodes, 6-way inside each
    assert MachineView(0, ((4, 6), (6, 1))) in vs


def test_number_of_views_is_linear_in_devices():
    counts = []
    for n in (1, 2, 4, 8, 16, 32):
        m = parse_machine(f"summit:{n}x6")
        counts.append(sum(len(enumerate_views(g, m)) for g in [(1,), (2,), (3,), (6,), (2, 3)]))
    for n, c in zip((1, 2, 4, 8, 16, 32), counts):
        assert c <= 40 * n * 6
    assert counts[-1] / counts[-2] < 2.5       # doubling devices roughly doubles the views


def test_views_inside_a_resource_and_splits():
    m = parse_machine("summit:2x6")
    r = Resource(6, 1, 6)
    for v in enumerate_views((3,), m, r):
        assert set(v.devices()) <= set(range(6, 12))
    assert enumerate_views((12,), m, r) == []
    whole = Resource.whole(m)
    assert [(a.size, b.size) for a, b in whole.splits(m)] == [(6, 6)]
    assert [(a.size, b.size) for a, b in r.splits(m)] == [(k, 6 - k) for k in range(1, 6)]
