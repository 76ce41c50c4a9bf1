import math

import pytest

from unity_pcg.search import collectives as C
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.machine import parse_machine

from .graphs import mlp


def test_collective_formulas_by_level():
    m = parse_machine("summit:2x6")
    n = 6e8
    g, nd, net = m.links["group"], m.links["node"], m.links["network"]
    assert C.allreduce_time(m, [0, 1, 2], n) == pytest.approx(4 * g.latency + 4 / 3 * n / g.bandwidth)
    # a whole Summit node: reduce-scatter in each NVLink group of 3, all-reduce of the thirds between the two
    # groups (3 rails over the X-Bus), all-gather in the groups -- faster than the ring through the X-Bus
    hier = 4 * g.latency + 2 * nd.latency + n * (4 / 3 / g.bandwidth + 1 / 3 / nd.bandwidth)
    assert C.allreduce_time(m, range(6), n) == pytest.approx(hier)
    assert hier < 10 * nd.latency + 10 / 6 * n / nd.bandwidth
    assert C.allreduce_time(m, [0, 6], n) == pytest.approx(2 * net.latency + n / net.bandwidth)
    assert C.allgather_time(m, [0, 1], n) == pytest.approx(g.latency + n / 2 / g.bandwidth)
    assert C.allreduce_time(m, [3], n) == 0.0
    # a faster level is never slower
    assert C.allreduce_time(m, [0, 1], n) < C.allreduce_time(m, [0, 3], n) < C.allreduce_time(m, [0, 6], n)
    assert C.allreduce_elements(4, 100) == 600


def test_transfer_time_busiest_endpoint():
    m = parse_machine("summit:1x6")
    bw, lat = m.links["group"].bandwidth, m.links["group"].latency
    one = C.transfer_time(m, [(0, 1, 1e6)])
    assert one == pytest.approx(1e6 / bw + lat)              # one message
    fan_in = C.transfer_time(m, [(1, 0, 1e6), (2, 0, 1e6)])
    assert fan_in > one                                       # the receiver is the bottleneck
    assert C.transfer_time(m, [(0, 0, 1e9)]) == 0.0


def test_roofline_and_backward_factor():
    m = parse_machine("summit:1x1")
    cm = CostModel(m, backward_factor=2.0)
    from unity_pcg.shape import ParallelTensorShape as S
    x, w, y = S.of((4096, 4096)), S.of((4096, 4096)), S.of((4096, 4096))
    f, b = cm.op_time("Linear", {}, [x, w], [y])
    flops = 2 * 4096 ** 3
    t = flops / (m.flops * m.device.eff("matmul"))
    assert f == pytest.approx(t + m.device.op_overhead)
    assert b == pytest.approx(2 * t + m.device.op_overhead)
    fr, _ = cm.op_time("Relu", {}, [x], [y])                 # memory bound
    assert fr == pytest.approx(2 * x.nbytes / m.mem_bandwidth + m.device.op_overhead)


@pytest.mark.parametrize("d", [2, 3, 6])
def test_data_parallel_volume_is_gradient_allreduce_plus_output_gather(d):
    batch, h, layers = 12, 32, 3
    g = data_parallel(mlp(batch=batch, h=h, layers=layers), d, combine_outputs=True)
    r = MachineMapper(CostModel(parse_machine(f"summit:1x{d}"))).optimize(g)
    params = layers * h * h
    gather = (d - 1) * (batch // d) * h                      # Combine of the output onto one device
    assert r.breakdown.comm_elements == 2 * (d - 1) * params + 2 * gather   # forward + backward
    assert r.breakdown.sync > 0


def test_local_devices_share_cores():
    m2 = parse_machine("local:1x2")
    import dataclasses
    m = dataclasses.replace(m2, shared_cores=2)
    assert m.share == 1.0
    m4 = m.resized(1, 4)
    assert m4.share == pytest.approx(0.5)
    assert m4.flops == pytest.approx(m.flops / 2)
    busy = dataclasses.replace(m, background_load=2.0)      # two other runnable tasks on the 2 cores
    assert busy.share == pytest.approx(0.5)
    assert dataclasses.replace(m4, background_load=4.0).share == pytest.approx(0.25)


def test_optimizer_states_change_memory_and_update():
    g = mlp(batch=8, h=64, layers=2)
    m = parse_machine("summit:1x1")
    sgd = MachineMapper(CostModel(m, optimizer="sgd")).optimize(g)
    adam = MachineMapper(CostModel(m, optimizer="adam")).optimize(g)
    wbytes = 2 * 64 * 64 * 4
    assert adam.memory.max_bytes - sgd.memory.max_bytes == 2 * wbytes
    assert adam.breakdown.update > sgd.breakdown.update
    with pytest.raises(ValueError):
        CostModel(m, optimizer="lion")


def test_gradient_sync_grows_across_nodes():
    g6 = data_parallel(mlp(batch=12, h=512, layers=2), 6)
    g12 = data_parallel(mlp(batch=12, h=512, layers=2), 12)
    one = MachineMapper(CostModel(parse_machine("summit:1x6"))).optimize(g6)
    two = MachineMapper(CostModel(parse_machine("summit:2x6"))).optimize(g12)
    assert two.breakdown.sync > one.breakdown.sync


def test_batchnorm_running_stats_are_not_trained():
    from unity_pcg.pcg import PCG
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (4, 3, 8, 8)})
    w = b.add("Weight", {"name": "w", "shape": (6, 3, 3, 3)})
    y = b.add("Conv2d", {"padding": (1, 1, 1, 1)}, [x, w], name="conv")
    ps = [b.add("Weight", {"name": n, "shape": (6,)}) for n in ("scale", "bias", "mean", "var")]
    y = b.add("BatchNorm", {}, [y] + ps, name="bn")
    b.set_outputs([y])
    g = data_parallel(b.finish(), 2, combine_outputs=True)
    r = MachineMapper(CostModel(parse_machine("summit:1x2"), optimizer="adam")).optimize(g)
    trained = 6 * 3 * 3 * 3 + 6 + 6
    gather = (4 // 2) * 6 * 8 * 8
    assert r.breakdown.comm_elements == 2 * trained + 2 * gather
    per_dev = 4 * (4 * trained + 2 * 6)                       # adam: w, g, m, v; running stats once
    assert max(r.memory.weights.values()) == per_dev


def test_op_classes_fall_back_to_the_classes_older_calibrations_know():
    """bmm and embedding price like matmul, softmax like norm, reduce like default unless the machine
    describes the finer class; a "<class>/<mode>" efficiency is preferred in that mode."""
    from dataclasses import replace
    from unity_pcg.search.cost import op_class
    from unity_pcg.shape import ParallelTensorShape as S
    from unity_pcg.machine import h100_datasheet
    base = h100_datasheet(1, 1)          # the roofline device (the h100 preset prices from measured tables)
    a, b, y = S.of((8, 2048, 2048)), S.of((8, 2048, 2048)), S.of((8, 2048, 2048))
    assert op_class("BatchMatMul") == "bmm" and op_class("MatMul", [a, b]) == "bmm"
    assert op_class("Softmax") == "softmax" and op_class("ReduceSum") == "reduce"
    flops = 2 * 8 * 2048 ** 3

    def fwd(eff, precision="fp32", overheads=None):
        dev = replace(base.device, efficiency=eff, overheads=overheads or {})
        m = replace(base, device=dev)
        return CostModel(m, precision=precision).op_time("BatchMatMul", {}, [a, b], [y])[0]
    ov = base.device.op_overhead
    assert fwd({"default": 0.5, "matmul": 0.8}) == pytest.approx(flops / (base.device.peak_flops * 0.8) + ov)
    assert fwd({"default": 0.5, "matmul": 0.8, "bmm": 0.4}) == pytest.approx(flops / (base.device.peak_flops * 0.4) + ov)
    assert fwd({"default": 0.5, "matmul": 0.8, "matmul/bf16": 0.6}, "bf16") == pytest.approx(
        flops / (base.device.peak("bf16") * 0.6) + ov)
    assert fwd({"default": 0.5}, overheads={"matmul": 1e-3}) == pytest.approx(
        flops / (base.device.peak_flops * 0.5) + 1e-3)
