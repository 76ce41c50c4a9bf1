"""The memory a plan may fill (``DeviceSpec.usable_bytes``: the capacity less the runtime's reserve --
``usable_fraction``, ``reserved_bytes``): a plan that fits a device's raw capacity but not its usable
memory is infeasible for the machine mapper and the memory techniques, GPU presets reserve
``GPU_USABLE_FRACTION`` and CPU processes nothing, the reserve survives the machine and plan JSON, old
files without it load with none, a reserve leaving nothing is refused in one line, and ``describe``
(what ``explain`` and ``optimize`` print) names the usable memory."""
from __future__ import annotations

import dataclasses

import pytest

from unity_pcg import plan as P
from unity_pcg.machine import GPU_USABLE_FRACTION, MachineError, MachineSpec, local, parse_machine
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.plan import MemoryPlan

from .graphs import mlp


def _device(m, **kw):
    return dataclasses.replace(m, device=dataclasses.replace(m.device, **kw))


def _need(g, m) -> int:
    r = MachineMapper(CostModel(_device(m, memory_bytes=2**50, usable_fraction=1.0, reserved_bytes=0))).optimize(g)
    assert r.feasible
    return r.memory.max_bytes


@pytest.mark.parametrize("reserve", [dict(usable_fraction=0.9), dict(reserved_bytes=1 << 20)])
def test_fits_the_capacity_but_not_the_usable_memory_is_infeasible(reserve):
    from unity_pcg.search import memtech
    g = mlp(batch=64, h=256, layers=2)
    base = parse_machine("summit:1x1")
    need = _need(g, base)
    cap = need + need // 50                   # 2% above what the plan holds: fits the raw capacity
    raw = _device(base, memory_bytes=cap, usable_fraction=1.0, reserved_bytes=0)
    held = _device(base, memory_bytes=cap, **{"usable_fraction": 1.0, "reserved_bytes": 0, **reserve})
    assert held.device.usable_bytes < need <= raw.device.usable_bytes == cap
    ok = MachineMapper(CostModel(raw)).optimize(g)
    assert ok.feasible
    bad = MachineMapper(CostModel(held)).optimize(g)
    assert not bad.feasible and "over capacity" in bad.reason
    # the memory techniques' pricing of the same mapping reads the same number
    for m, fits in ((raw, True), (held, False)):
        p = memtech.price(GraphCost(g, CostModel(m)), ok.views, MemoryPlan())
        assert p.report.feasible is fits, (m.device, p.report.max_bytes)


def test_presets_reserve_on_gpus_only():
    for name in ("summit:1x2", "dgx-a100:1x2", "h100:1x2"):
        d = parse_machine(name).device
        assert d.usable_fraction == GPU_USABLE_FRACTION < 1.0
        assert d.usable_bytes < d.memory_bytes
    d = local(1, 2).device
    assert d.usable_bytes == d.memory_bytes


def test_reserve_round_trips_machine_and_plan_json(tmp_path):
    m = _device(parse_machine("h100:1x2"), reserved_bytes=3 << 30, usable_fraction=0.93)
    back = MachineSpec.from_json(m.to_json())
    assert back.device.reserved_bytes == 3 << 30 and back.device.usable_fraction == 0.93
    assert back.device.usable_bytes == m.device.usable_bytes
    old = m.to_json()
    del old["device"]["reserved_bytes"], old["device"]["usable_fraction"]
    assert MachineSpec.from_json(old).device.usable_bytes == m.device.memory_bytes     # files from before
    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in")
    g = mlp(batch=8, h=16, layers=2)
    r = MachineMapper(CostModel(m)).optimize(g)
    pl = P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json())
    pl.save(str(tmp_path / "plan.json"))
    got = P.load(str(tmp_path / "plan.json")).machine.device
    assert (got.reserved_bytes, got.usable_fraction) == (3 << 30, 0.93)


def test_a_reserve_leaving_nothing_is_refused_in_one_line():
    obj = parse_machine("summit:1x1").to_json()
    obj["device"]["reserved_bytes"] = obj["device"]["memory_bytes"]
    with pytest.raises(MachineError) as e:
        MachineSpec.from_json(obj)
    assert "usable" in str(e.value) and "\n" not in str(e.value)
    obj["device"]["reserved_bytes"], obj["device"]["usable_fraction"] = 0, 1.5
    with pytest.raises(MachineError):
        MachineSpec.from_json(obj)


def test_describe_names_the_usable_memory():
    m = parse_machine("h100:1x8")
    text = m.describe()
    assert f"{m.device.usable_bytes / 2**30:.3g} GiB usable" in text
    assert "usable" not in local(1, 2).describe()
