"""Calibrated local machines: per-world devices, DDP sync overheads, 1x1 convolutions.

No timings are asserted; the micro-benchmark helpers are checked for what they compute."""
import dataclasses

import pytest

from unity_pcg.calibration import local as cal
from unity_pcg.search import collectives as C
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost, op_class
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.machine import DeviceSpec, LinkSpec, MachineSpec, parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.shape import ParallelTensorShape

from tests.search.graphs import mlp


def _dev(scale: float) -> dict:
    d = DeviceSpec(1e10 * scale, 1e10, 2 ** 30, {"default": 1.0}, 1e-6 / scale, 2e-6, {"conv": 5e-6})
    return cal._device_json(d)


def calibrated(sync2=None, sync4=None) -> MachineSpec:
    worlds = {"2": {"device": _dev(1.0), "link": {"bandwidth": 1e9, "latency": 1e-4},
                    "sync": sync2 or {"iteration": 1e-3, "per_tensor": 2e-5, "buffers": 5e-4}},
              "4": {"device": _dev(0.5), "link": {"bandwidth": 5e8, "latency": 3e-4},
                    "sync": sync4 or {"iteration": 4e-3, "per_tensor": 3e-5, "buffers": 1e-3}}}
    dev = DeviceSpec(**{**_dev(1.0)})
    link = LinkSpec(1e9, 1e-4)
    return MachineSpec("local", 1, 2, 2, dev, {lv: link for lv in ("group", "node", "network")},
                       shared_cores=2, meta={"calibrated": True, "worlds": worlds, "device_world": 2,
                                             "sync": worlds["2"]["sync"]})


def test_resized_picks_the_nearest_world():
    m = calibrated()
    m4 = m.resized(1, 4)
    assert m4.device.peak_flops == pytest.approx(0.5e10)
    assert m4.links["group"].latency == pytest.approx(3e-4)
    assert m4.meta["sync"]["iteration"] == pytest.approx(4e-3)
    assert m4.meta["device_world"] == 4
    assert m4.share == 1.0                 # the sharing of the cores is inside the measurement
    assert m.resized(1, 3).meta["device_world"] == 2   # ties go to the smaller world
    m8 = m.resized(1, 8)
    assert m8.meta["device_world"] == 4 and m8.share == pytest.approx(0.5)   # 8 processes vs 4 measured
    # round trip through JSON keeps the per-world data
    again = MachineSpec.from_json(m.to_json()).resized(1, 4)
    assert again.device == m4.device


def test_uncalibrated_share_unchanged():
    m = dataclasses.replace(parse_machine("local:1x2"), shared_cores=2)
    assert m.resized(1, 4).share == pytest.approx(0.5)


def test_ddp_sync_overheads_sum_once_per_iteration():
    d = 2
    layers = 3
    g = data_parallel(mlp(batch=8, h=16, layers=layers), d)
    base = calibrated(sync2={"iteration": 0.0, "per_tensor": 0.0, "buffers": 0.0})
    with_sync = calibrated()
    r0 = MachineMapper(CostModel(base, sync_model="ddp")).optimize(g)
    r1 = MachineMapper(CostModel(with_sync, sync_model="ddp")).optimize(g)
    gc = GraphCost(g, CostModel(with_sync, sync_model="ddp"))
    n_tensors = sum(1 for nid in gc._chain_end if gc.trainable(nid) and g.shapes(nid)[0].copy_degree > 1)
    assert n_tensors == layers
    extra = 1e-3 + 2e-5 * n_tensors
    assert r1.breakdown.sync - r0.breakdown.sync == pytest.approx(extra, rel=1e-6)
    assert r1.cost - r0.cost == pytest.approx(extra, rel=1e-6)
    # one device: no replicas, no synchronization at all
    one = MachineMapper(CostModel(with_sync.resized(1, 1), sync_model="ddp")).optimize(mlp(batch=8, h=16, layers=layers))
    assert one.breakdown.sync == 0.0


def test_executor_sync_model_ignores_ddp_terms_and_pays_each_bucket_latency_once():
    """The executor's own gradient sync (the default): DDP's calibrated terms play no part; a
    model whose gradients fit one bucket pays one all-reduce latency plus its bytes / bandwidth."""
    from unity_pcg.search import collectives as C
    from unity_pcg.search.cost import _bw_part
    layers = 3
    g = data_parallel(mlp(batch=8, h=16, layers=layers), 2)
    base = calibrated(sync2={"iteration": 0.0, "per_tensor": 0.0, "buffers": 0.0, "per_compute": 0.0})
    with_sync = calibrated(sync2={"iteration": 1e-3, "per_tensor": 2e-5, "buffers": 5e-4, "per_compute": 0.5})
    r0 = MachineMapper(CostModel(base)).optimize(g)
    r1 = MachineMapper(CostModel(with_sync)).optimize(g)
    assert CostModel(with_sync).sync_model == "executor"
    assert r1.cost == pytest.approx(r0.cost, rel=1e-12)
    gc = GraphCost(g, CostModel(base))
    ws = [g.shapes(nid)[0].piece_nbytes for nid in gc._chain_end
          if gc.trainable(nid) and g.shapes(nid)[0].copy_degree > 1]
    assert len(ws) == layers
    m = base
    lat = C.allreduce_time(m, [0, 1], ws[0]) - _bw_part(m, [0, 1], ws[0])
    assert lat > 0
    expected = lat + sum(_bw_part(m, [0, 1], n) for n in ws)
    assert r0.breakdown.sync == pytest.approx(expected, rel=1e-9)
    # the machine may name the sync model; the argument wins; unknown names are refused
    named = dataclasses.replace(with_sync, meta={**with_sync.meta, "sync_model": "ddp"})
    assert CostModel(named).sync_model == "ddp" and CostModel(named).sync_iteration == pytest.approx(1e-3)
    assert CostModel(named, sync_model="executor").sync_iteration == 0.0
    with pytest.raises(ValueError, match="sync model"):
        CostModel(base, sync_model="horovod")


def test_bucket_count_follows_the_executor():
    mib = 2 ** 20
    cpu = CostModel(calibrated())                      # shared cores: overlap from 8 MiB of gradients on
    assert [cpu.bucket_count(b * mib) for b in (0, 0.5, 2, 7.9, 25)] == [0, 1, 1, 1, 2]
    assert cpu.bucket_count(30 * mib) == 3             # 1 MiB first bucket, then 25 + 4 MiB
    gpu = CostModel(parse_machine("dgx-a100:1x2"))         # GPUs always overlap: first bucket 1 MiB
    assert [gpu.bucket_count(b * mib) for b in (0.5, 1, 2, 26, 27)] == [1, 1, 2, 2, 3]


def _bn_net(batch=8, c=4):
    b = PCG.builder({})
    x = b.add("Input", {"name": "x", "shape": (batch, c, 4, 4)})
    w = b.add("Weight", {"name": "w", "shape": (c, c, 1, 1)})
    h = b.add("Conv2d", {}, [x, w])
    ws = [b.add("Weight", {"name": n, "shape": (c,)}) for n in ("scale", "bias", "mean", "var")]
    y = b.add("BatchNorm", {}, [h] + ws)
    b.set_outputs([y])
    return b.finish()


def test_buffers_synchronized_once_per_iteration():
    g = data_parallel(_bn_net(), 2)
    no_buf = calibrated(sync2={"iteration": 0.0, "per_tensor": 0.0, "buffers": 0.0})
    buf = calibrated(sync2={"iteration": 0.0, "per_tensor": 0.0, "buffers": 7e-4})
    r0 = MachineMapper(CostModel(no_buf, sync_model="ddp")).optimize(g)
    r1 = MachineMapper(CostModel(buf, sync_model="ddp")).optimize(g)
    assert r1.cost - r0.cost == pytest.approx(7e-4, rel=1e-6)
    # the executor broadcasts no buffers
    assert MachineMapper(CostModel(buf)).optimize(g).cost == pytest.approx(MachineMapper(CostModel(no_buf)).optimize(g).cost)


def test_pointwise_conv_class():
    x = ParallelTensorShape.of([8, 4, 8, 8])
    w1 = ParallelTensorShape.of([4, 4, 1, 1])
    w3 = ParallelTensorShape.of([4, 4, 3, 3])
    assert op_class("Conv2d", [x, w1]) == "conv1x1"
    assert op_class("Conv2d", [x, w3]) == "conv"
    assert op_class("Conv2d") == "conv"
    m = calibrated()
    cm = CostModel(m)
    # no conv1x1 overhead calibrated: falls back to the conv class
    assert cm.roofline("Conv2d", 0.0, 0.0, "conv1x1") == cm.roofline("Conv2d", 0.0, 0.0, "conv")
    d = dataclasses.replace(m.device, overheads={"conv": 5e-6, "conv1x1": 1e-6, "conv1x1:bwd": 2e-6})
    cm2 = CostModel(dataclasses.replace(m, device=d))
    f, b = cm2.roofline("Conv2d", 0.0, 0.0, "conv1x1")
    assert (f, b) == (pytest.approx(1e-6), pytest.approx(2e-6))


def test_median_time_counts_and_median_tree():
    calls = []
    cal._median_time(lambda: calls.append(1), reps=3, warmup=2, count=5)
    assert len(calls) == 2 + 3 * 5
    calls.clear()
    cal._median_time(lambda: calls.append(1), reps=4, warmup=0)
    assert len(calls) == 4                       # no window: one call per sample
    t = cal._median_tree([{"a": 1.0, "b": {"c": 3.0}}, {"a": 5.0, "b": {"c": 1.0}}, {"a": 2.0, "b": {"c": 2.0}}])
    assert t == {"a": 2.0, "b": {"c": 2.0}}


@pytest.mark.slow
def test_calibrate_quick_world_two():
    m = cal.calibrate(quick=True, worlds=(2,), quiet=True)
    rec = m.meta["worlds"]["2"]
    assert set(rec["sync"]) >= {"iteration", "per_tensor", "buffers"}
    assert "conv1x1" in rec["device"]["overheads"]
    assert {"matmul/fp32", "matmul_bwd/fp32", "elementwise/fp32", "optimizer_sgd/fp32"} <= set(rec["device"]["kernel_tables"])
    assert {"all_reduce", "all_gather", "broadcast"} <= set(rec["collectives"]) and "2" in rec["collectives"]["all_reduce"]
    # the CPU seconds per collective call (mean over ranks) and the contention, for processes that outnumber the cores
    assert set(rec["collectives_cpu"]) == set(rec["collectives"]) and "2" in rec["collectives_cpu"]["all_reduce"]
    assert all(t > 0 for _, t in rec["collectives_cpu"]["all_reduce"]["2"]) and rec["contention"] >= 1.0
    m2 = MachineSpec.from_json(m.to_json()).resized(1, 2)
    assert m2.device.table("matmul/fp32") and C.measured_time(m2, "all_reduce", 2, 1e4) > 0
    assert m2.share == 1.0 and m2.meta["device_world"] == 2


def test_sync_wait_grows_with_compute_only_with_replicas():
    g = mlp(batch=8, h=16, layers=2)
    s0 = {"iteration": 0.0, "per_tensor": 0.0, "buffers": 0.0, "per_compute": 0.0}
    s1 = dict(s0, per_compute=0.25)
    r0 = MachineMapper(CostModel(calibrated(sync2=s0), sync_model="ddp")).optimize(data_parallel(g, 2))
    r1 = MachineMapper(CostModel(calibrated(sync2=s1), sync_model="ddp")).optimize(data_parallel(g, 2))
    assert r1.breakdown.compute == pytest.approx(1.25 * r0.breakdown.compute, rel=1e-9)
    one = calibrated(sync2=s1)
    one = dataclasses.replace(one, devices_per_node=1, group_size=1)
    assert CostModel(one, sync_model="ddp").sync_per_compute == 0.0   # a single process waits for nobody


def test_ddp_sync_model_leaves_out_the_batchnorm_statistics_all_reduce():
    """torch DDP keeps per-device BatchNorm statistics; the executor synchronizes them (SyncBatchNorm): only the
    executor's sync model prices that all-reduce on a batch-split BatchNorm."""
    from unity_pcg.machine import local
    from unity_pcg.pcg import PCG
    from unity_pcg.search.baselines import data_parallel
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (8, 4, 6, 6), "dtype": "float32"})
    ws = [b.add_node("Weight", {"name": n, "shape": (4,), "dtype": "float32"}) for n in ("g", "b", "m", "v")]
    y = b.add_node("BatchNorm", {"eps": 1e-5, "momentum": 0.9}, [(x, 0)] + [(w, 0) for w in ws])
    b.set_outputs([(y, 0)])
    g = data_parallel(b.finish(), 2)
    m = local(1, 2)
    ex = MachineMapper(CostModel(m, sync_model="executor")).optimize(g)
    ddp = MachineMapper(CostModel(m, sync_model="ddp")).optimize(g)
    assert ex.feasible and ddp.feasible
    bn = next(n.id for n in g.nodes() if n.op == "BatchNorm")
    from unity_pcg.search.cost import GraphCost
    view = ex.views[bn]
    assert view.degree == 2                    # the batch-split BatchNorm runs on both devices
    assert GraphCost(g, CostModel(m, sync_model="executor")).leaf_cost(bn, view, ex.views).comm > 0
    assert GraphCost(g, CostModel(m, sync_model="ddp")).leaf_cost(bn, view, ex.views).comm == 0
