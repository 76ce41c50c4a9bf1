"""Calibrated local machines: per-class kernel tables and measured collective tables (issue 8, point 8).

No timings are asserted: the helpers are checked for what they compute, and the cost model for using
what the machine file carries (a prediction changes when a table changes)."""
import dataclasses

import pytest

from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec, interpolate_table
from unity_pcg.calibration import local as cal
from unity_pcg.search import collectives as C
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper

from tests.search.graphs import mlp


def _machine(tables: dict | None = None, coll: dict | None = None, world: int = 2) -> MachineSpec:
    """A calibrated local machine of ``world`` processes whose device has ``tables`` and whose world
    record has the collective tables ``coll``."""
    d = DeviceSpec(1e10, 1e10, 2 ** 30, {"default": 1.0}, 1e-6, 2e-6, {}, {}, tables or {})
    rec = {"device": cal._device_json(d), "link": {"bandwidth": 1e9, "latency": 1e-4},
           "sync": {}, "collectives": coll or {}}
    link = LinkSpec(1e9, 1e-4)
    m = MachineSpec("local", 1, world, world, d, {lv: link for lv in ("group", "node", "network")},
                    shared_cores=2, meta={"calibrated": True, "worlds": {str(world): rec}, "device_world": world})
    return MachineSpec.from_json(m.to_json()).resized(1, world)


def test_local_cases_cover_the_classes_small_steps_run():
    full = cal.local_cases(False)
    classes = {c.cls for c in full}
    assert {"matmul", "bmm", "elementwise", "norm", "softmax", "embedding", "default", "optimizer_sgd",
            "optimizer_adam"} <= classes
    assert len({(c.cls, c.label) for c in full}) == len(full)          # labels are unique per class
    assert all(cal._build_kernel(c) is not None for c in full)        # every case builds on this CPU
    quick = cal.local_cases(True)
    assert len(quick) < len(full) and {c.cls for c in quick} <= classes


def test_measured_kernels_make_tables_per_class():
    import torch
    torch.set_num_threads(1)
    prepared = [p for p in cal.prepare_kernels(quick=True) if p[0].cls in ("matmul", "default", "optimizer_sgd")]
    samples = cal.measure_kernels(prepared, window=0.0, samples=2)
    assert set(samples) == {f"{c.cls}:{c.label}" for c, _, _, _ in prepared}
    for key, rec in samples.items():
        assert len(rec["fwd"]) == 2 and all(t > 0 for t in rec["fwd"])
        assert len(rec["bwd"]) == (0 if key.startswith("optimizer") else 2)
    # tables from synthetic medians: time proportional to the case's index, so the table is checkable
    fake = {}
    for i, (c, _, _, _) in enumerate(prepared):
        fake[f"{c.cls}:{c.label}"] = {"fwd": 1e-5 * (i + 1)}
        if not c.cls.startswith("optimizer"):
            fake[f"{c.cls}:{c.label}"]["bwd"] = 3e-5 * (i + 1)
    fits, tables = cal.kernel_tables(True, fake)
    assert {"matmul/fp32", "matmul_bwd/fp32", "default/fp32", "default_bwd/fp32", "optimizer_sgd/fp32",
            "optimizer/fp32"} <= set(tables)
    mm = [c for c, _, _, _ in prepared if c.cls == "matmul"]
    assert len(tables["matmul/fp32"]) == len(mm)
    works = [w for w, _ in tables["matmul/fp32"]]
    assert works == sorted(works)
    assert 2.0 * 8 * 32 * 32 <= works[0] <= 2.0 * 8 * 32 * 32 + 8 * 32     # kernel_work: the forward's FLOPs
    assert [t for _, t in tables["matmul/fp32"]] == pytest.approx([1e-5 * (i + 1) for i in range(len(mm))])
    assert fits["matmul/fp32"]["points"] == len(mm)


def test_collective_tables_take_the_slowest_rank_and_never_decrease():
    r0 = {"all_reduce": {"2": {"256": 1e-4, "4096": 3e-4, "65536": 2e-4}}}
    r1 = {"all_reduce": {"2": {"256": 2e-4, "4096": 1e-4, "65536": 5e-4}}}
    t = cal.collective_tables([r0, r1])["all_reduce"]["2"]
    assert [w for w, _ in t] == [256.0, 4096.0, 65536.0]
    assert [s for _, s in t] == pytest.approx([2e-4, 3e-4, 5e-4])


def test_collectives_priced_from_the_measured_table():
    coll = {"all_reduce": {"2": [[256.0, 1e-3], [65536.0, 2e-3]]},
            "all_gather": {"2": [[256.0, 4e-4], [65536.0, 8e-4]]},
            "broadcast": {"2": [[256.0, 3e-4], [65536.0, 6e-4]]}}
    m = _machine(coll=coll)
    plain = _machine()
    assert C.allreduce_time(m, [0, 1], 256.0) == pytest.approx(1e-3)
    assert C.allreduce_time(m, [0, 1], 4096.0) == pytest.approx(interpolate_table(coll["all_reduce"]["2"], 4096.0))
    assert C.allgather_time(m, [0, 1], 65536.0) == pytest.approx(8e-4)
    assert C.broadcast_time(m, [0, 1], 256.0) == pytest.approx(3e-4)
    # no table (or a group size not measured): the ring model of the link, as before
    assert C.allreduce_time(plain, [0, 1], 256.0) == pytest.approx(2 * 1e-4 + 256.0 / 1e9)
    assert C.measured_time(m, "all_reduce", 3, 256.0) is None
    assert C.allreduce_time(m, [0], 256.0) == 0.0


def test_grad_sync_follows_the_all_reduce_table():
    g = data_parallel(mlp(batch=8, h=16, layers=3), 2)
    small = {"all_reduce": {"2": [[64.0, 1e-3], [2.0 ** 24, 2e-3]]}}
    big = {"all_reduce": {"2": [[64.0, 3e-3], [2.0 ** 24, 6e-3]]}}
    r_small = MachineMapper(CostModel(_machine(coll=small))).optimize(g)
    r_big = MachineMapper(CostModel(_machine(coll=big))).optimize(g)
    # the model's gradients (a few KB) fit one bucket: the step pays the table's time for its bytes once
    cm = CostModel(_machine(coll=small))
    from unity_pcg.search.cost import GraphCost
    total = GraphCost(g, cm)._sync_bytes
    assert cm.bucket_count(total) == 1
    assert r_small.breakdown.sync == pytest.approx(interpolate_table(small["all_reduce"]["2"], total), rel=1e-9)
    assert r_big.breakdown.sync == pytest.approx(3 * r_small.breakdown.sync, rel=1e-9)
    assert r_big.cost > r_small.cost


def test_kernel_and_optimizer_tables_change_the_prediction():
    g = mlp(batch=8, h=16, layers=2)
    base = {"matmul/fp32": [[1.0, 1e-4], [1e9, 1e-1]], "matmul_bwd/fp32": [[1.0, 2e-4], [1e9, 2e-1]],
            "elementwise/fp32": [[1.0, 1e-5], [1e9, 1e-2]], "optimizer_sgd/fp32": [[1.0, 1e-5], [1e9, 1e-2]],
            "optimizer/fp32": [[1.0, 5e-5], [1e9, 5e-2]]}
    slower = dict(base, **{"matmul/fp32": [[1.0, 3e-4], [1e9, 3e-1]]})
    one = lambda tabs: dataclasses.replace(_machine(tables=tabs), devices_per_node=1, group_size=1)
    a = MachineMapper(CostModel(one(base), optimizer="sgd")).optimize(g)
    b = MachineMapper(CostModel(one(slower), optimizer="sgd")).optimize(g)
    assert b.breakdown.compute > a.breakdown.compute and b.cost > a.cost
    # the optimizer's own table first, the shared one for an optimizer not measured apart
    cm = CostModel(one(base), optimizer="sgd")
    assert cm.update_time(4096.0) == pytest.approx(interpolate_table(base["optimizer_sgd/fp32"], 3 * 4096.0))
    cm = CostModel(one(base), optimizer="momentum")
    assert cm.update_time(4096.0) == pytest.approx(interpolate_table(base["optimizer/fp32"], 5 * 4096.0))


def test_sync_slowdown_of_waiting_processes():
    assert cal.sync_slowdown(1e-3, 2.5e-3, 0.5e-3) == pytest.approx(2.0)
    assert cal.sync_slowdown(1e-3, 1.2e-3, 0.5e-3) == 1.0          # never below free processes
    assert cal.sync_slowdown(0.0, 1e-3, 0.0) == 1.0


def test_executor_slowdown_scales_compute_of_several_processes_only():
    g = data_parallel(mlp(batch=8, h=16, layers=2), 2)
    tabs = {"matmul/fp32": [[1.0, 1e-4], [1e9, 1e-1]], "elementwise/fp32": [[1.0, 1e-5], [1e9, 1e-2]]}

    def machine(slow):
        m = _machine(tables=tabs)
        meta = dict(m.meta, sync={"executor_slowdown": slow} if slow else {})
        return dataclasses.replace(m, meta=meta)
    r1 = MachineMapper(CostModel(machine(None))).optimize(g)
    r2 = MachineMapper(CostModel(machine(1.5))).optimize(g)
    assert r2.breakdown.compute == pytest.approx(1.5 * r1.breakdown.compute, rel=1e-9)
    assert CostModel(machine(1.5), sync_model="ddp").sync_per_compute == 0.0     # DDP: its own measured terms
    one = dataclasses.replace(machine(1.5), devices_per_node=1, group_size=1)
    assert CostModel(one).sync_per_compute == 0.0                                # nobody to wait for
