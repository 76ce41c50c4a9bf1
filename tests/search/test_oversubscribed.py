"""Processes that outnumber the shared cores (issue 8, point 8): collectives priced by the CPU work they cost
at the contended throughput (``MachineSpec.collective_cpu_time``), not by the wall time measured with idle
peers; machines whose processes do not outnumber the cores are priced as before.

No timings are asserted: the helpers are checked for what they compute, and the cost model for using
what the machine file carries."""
import dataclasses

import pytest

from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec, interpolate_table
from unity_pcg.calibration import local as cal
from unity_pcg.search import collectives as C
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper

from .graphs import mlp

WALL = {"all_reduce": {"4": [[4.0, 5e-3], [2.0 ** 24, 2e-2]], "2": [[4.0, 3e-3], [2.0 ** 24, 1e-2]]},
        "all_gather": {"4": [[4.0, 3e-3], [2.0 ** 24, 1e-2]]},
        "broadcast": {"4": [[4.0, 6e-4], [2.0 ** 24, 4e-3]]}}
CPU = {"all_reduce": {"4": [[4.0, 4e-4], [2.0 ** 24, 8e-3]], "2": [[4.0, 3e-4], [2.0 ** 24, 5e-3]]},
       "all_gather": {"4": [[4.0, 3e-4], [2.0 ** 24, 6e-3]]},
       "broadcast": {"4": [[4.0, 1e-4], [2.0 ** 24, 1e-3]]}}
TABS = {"matmul/fp32": [[1.0, 1e-4], [1e9, 1e-1]], "matmul_bwd/fp32": [[1.0, 2e-4], [1e9, 2e-1]],
        "elementwise/fp32": [[1.0, 1e-5], [1e9, 1e-2]], "optimizer_sgd/fp32": [[1.0, 1e-5], [1e9, 1e-2]]}


def _machine(cores: int = 2, world: int = 4, cpu: dict | None = CPU, contention: float | None = 2.5,
             sync: dict | None = None) -> MachineSpec:
    """A local machine calibrated for ``world`` processes on ``cores`` shared cores, with wall-time and
    (``cpu``) CPU-time collective tables."""
    d = DeviceSpec(1e10, 1e10, 2 ** 30, {"default": 1.0}, 1e-6, 2e-6, {}, {}, TABS)
    rec = {"device": cal._device_json(d), "link": {"bandwidth": 1e9, "latency": 1e-4},
           "sync": sync or {}, "collectives": WALL}
    if cpu is not None:
        rec["collectives_cpu"] = cpu
    if contention is not None:
        rec["contention"] = contention
    link = LinkSpec(1e9, 1e-4)
    m = MachineSpec("local", 1, world, world, d, {lv: link for lv in ("group", "node", "network")},
                    shared_cores=cores, meta={"calibrated": True, "worlds": {str(world): rec}, "device_world": world})
    return MachineSpec.from_json(m.to_json()).resized(1, world)


def test_oversubscribed_and_contention():
    m = _machine()
    assert m.oversubscribed and m.contention() == pytest.approx(2.5)     # measured: from the world's record
    assert _machine(contention=None).contention() == pytest.approx(4 / 2)  # else P / cores
    assert _machine(contention=0.5).contention() == 1.0                   # never below 1
    fits = _machine(cores=4)                                               # a core per process
    assert not fits.oversubscribed and fits.contention() == 1.0
    assert not MachineSpec.from_json(_machine().to_json()).resized(1, 2).oversubscribed
    assert not dataclasses.replace(m, shared_cores=0).oversubscribed        # GPU presets: independent devices


def test_collectives_priced_by_cpu_work_only_where_processes_outnumber_the_cores():
    m, fits, no_cpu = _machine(), _machine(cores=4), _machine(cpu=None)
    devs = [0, 1, 2, 3]
    for nb in (4.0, 65536.0, 2.0 ** 22):
        assert C.allreduce_time(m, devs, nb) == pytest.approx(interpolate_table(CPU["all_reduce"]["4"], nb) * 2.5)
        assert C.allgather_time(m, devs, nb) == pytest.approx(interpolate_table(CPU["all_gather"]["4"], nb) * 2.5)
        assert C.broadcast_time(m, devs, nb) == pytest.approx(interpolate_table(CPU["broadcast"]["4"], nb) * 2.5)
        assert C.allreduce_time(m, [0, 1], nb) == pytest.approx(interpolate_table(CPU["all_reduce"]["2"], nb) * 2.5)
        # P <= cores, or no CPU table: the measured wall time as before
        for other in (fits, no_cpu):
            assert C.allreduce_time(other, devs, nb) == pytest.approx(interpolate_table(WALL["all_reduce"]["4"], nb))
    assert m.collectives_by_cpu and not fits.collectives_by_cpu and not no_cpu.collectives_by_cpu
    assert C.measured_time(m, "all_reduce", 3, 256.0) is None             # a group size not measured


def test_the_new_term_changes_predictions_only_where_p_exceeds_the_cores():
    g = data_parallel(mlp(batch=16, h=32, layers=3), 4)

    def cost(machine):
        return MachineMapper(CostModel(machine, optimizer="sgd")).optimize(g)
    # oversubscribed: with the CPU tables the gradient sync costs the CPU work at the contended throughput
    over, over_wall = cost(_machine()), cost(_machine(cpu=None))
    assert over.breakdown.sync < over_wall.breakdown.sync and over.cost != over_wall.cost
    # the same tables where the processes have a core each: nothing changes
    fits, fits_wall = cost(_machine(cores=4)), cost(_machine(cores=4, cpu=None))
    assert fits.cost == pytest.approx(fits_wall.cost, rel=1e-12)
    assert fits.breakdown.sync == pytest.approx(fits_wall.breakdown.sync, rel=1e-12)


def test_compute_keeps_the_executor_slowdown():
    # the executor's compute is scaled by sync.executor_slowdown at every P; executor_slowdown_cpu is a diagnostic
    sync = {"executor_slowdown": 3.0, "executor_slowdown_cpu": 1.5}
    for m in (_machine(sync=sync), _machine(sync=sync, cpu=None), _machine(sync=sync, cores=4)):
        assert CostModel(m).sync_per_compute == pytest.approx(2.0)


def test_calibration_helpers():
    # CPU tables: the mean over the ranks (the host's work per call / ranks), never decreasing in bytes
    r0 = {"all_reduce": {"4": {"256": 1e-4, "4096": 4e-4, "65536": 2e-4}}}
    r1 = {"all_reduce": {"4": {"256": 3e-4, "4096": 2e-4, "65536": 6e-4}}}
    t = cal.collective_cpu_tables([r0, r1])["all_reduce"]["4"]
    assert [w for w, _ in t] == [256.0, 4096.0, 65536.0]
    assert [s for _, s in t] == pytest.approx([2e-4, 3e-4, 4e-4])
    # contention: wall over CPU seconds of the samples together, at least 1
    assert cal.contention_ratio([(2e-2, 1e-2), (3e-2, 1e-2)]) == pytest.approx(2.5)
    assert cal.contention_ratio([(1e-2, 1.1e-2)]) == 1.0
    assert cal.contention_ratio([]) == 1.0
    # the synchronized loop priced as measured: its 1-float all-reduce at the CPU table's price
    wait = {"free": 1e-3, "synced": 4e-3, "alone": 2.5e-3}
    tabs = {"all_reduce": {"4": [[4.0, 4e-4], [1e6, 1e-3]]}}
    assert cal.sync_slowdown_cpu(wait, tabs, 4, 2.5) == pytest.approx((4e-3 - 1e-3) / 1e-3)
    assert cal.sync_slowdown_cpu(wait, {}, 4, 2.5) == pytest.approx(cal.sync_slowdown(1e-3, 4e-3, 2.5e-3))


def test_calibrated_worlds_carry_their_contention():
    m = _machine()
    assert m.meta["contention"] == pytest.approx(2.5)
    d = DeviceSpec(1e10, 1e10, 2 ** 30, {"default": 1.0}, 1e-6, 2e-6, {}, {}, {})
    rec = {"device": cal._device_json(d), "link": {"bandwidth": 1e9, "latency": 1e-4}}
    meta = dict(m.meta, worlds={**m.meta["worlds"], "2": rec})
    two = dataclasses.replace(m, meta=meta).resized(1, 2)
    assert "contention" not in two.meta                    # not measured for 2 processes
