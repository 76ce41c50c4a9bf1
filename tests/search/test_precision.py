"""Precision in the cost model (issue 9 point 1): fp32 / tf32 / bf16 (torch.autocast) change compute time,
memory and communication as DESIGN "Cost model" says; measured kernel tables (point 2); machine and plan
files carry peaks, tables and the precision; the CLI flags."""
from __future__ import annotations

import json
import math

import pytest

from unity_pcg import plan as P
from unity_pcg.cli import main
from unity_pcg.errors import PlanError
from unity_pcg.machine import (DeviceSpec, LinkSpec, MachineError, MachineSpec, h100_datasheet, interpolate_table,
                               parse_machine)
from unity_pcg.pcg import PCG
from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel, GraphCost, kernel_work, op_class
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.shape import ParallelTensorShape as S

from .graphs import mlp

MODES = ("fp32", "tf32", "bf16")


def _price(g, machine, precision, optimizer="adam"):
    return MachineMapper(CostModel(parse_machine(machine), optimizer=optimizer, precision=precision)).optimize(g)


# --- time --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("machine", ["dgx-a100:1x1", "h100:1x1"])
def test_matmul_heavy_model_bf16_faster_than_tf32_faster_than_fp32(machine):
    g = mlp(batch=2048, h=2048, layers=4)
    t = {p: _price(g, machine, p).cost for p in MODES}
    assert t["bf16"] < t["tf32"] < t["fp32"]
    # compute-bound: fp32 / tf32 close to the ratio of the peaks (launch overheads and element-wise work
    # aside), or, on a preset fitted from measurements, of the measured matmul tables at the layers' work
    m = parse_machine(machine)
    if m.device.kernel_tables:          # forward and backward kernels of the layers' work
        work = 2.0 * 2048 ** 3
        expected = (sum(interpolate_table(m.device.table(f"{k}/fp32"), work) for k in ("matmul", "matmul_bwd"))
                    / sum(interpolate_table(m.device.table(f"{k}/tf32"), work) for k in ("matmul", "matmul_bwd")))
    else:
        expected = m.device.peak("tf32") / m.device.peak_flops
    if m.device.kernel_tables:          # the update, casts and bias gradients run alike in both: a lower ratio
        assert 0.6 * expected <= t["fp32"] / t["tf32"] <= 1.05 * expected
    else:
        assert t["fp32"] / t["tf32"] == pytest.approx(expected, rel=0.35)


def test_modes_without_units_run_at_the_fp32_peak():
    g = mlp(batch=512, h=512, layers=2)
    # V100 has no TF32: tf32 == fp32; bf16 is priced on its fp16 tensor cores
    s = {p: _price(g, "summit:1x1", p).cost for p in MODES}
    assert s["tf32"] == pytest.approx(s["fp32"])
    assert s["bf16"] < s["fp32"]
    # the uncalibrated local CPU: every mode at the fp32 peak (bf16 only adds autocast's casts)
    loc = parse_machine("local:1x1")
    assert all(loc.device.peak(p) == loc.device.peak_flops for p in MODES)
    lt = {p: _price(g, "local:1x1", p).cost for p in MODES}
    assert lt["tf32"] == pytest.approx(lt["fp32"])
    assert lt["bf16"] >= lt["fp32"] * 0.999


def test_compute_classes_use_the_mode_peak_memory_bound_the_dtype_bytes():
    m = h100_datasheet(1, 1)         # the roofline device (the h100 preset prices from measured tables)
    x, w, y = S.of((4096, 4096)), S.of((4096, 4096)), S.of((4096, 4096))
    flops = 2 * 4096 ** 3
    for p in MODES:
        f, b = CostModel(m, precision=p).op_time("Linear", {}, [x, w], [y])
        t = flops / (m.device.peak(p) * m.device.eff("matmul"))
        assert f == pytest.approx(t + m.device.op_overhead)
        assert b == pytest.approx(2 * t + m.device.op_overhead)
    # memory bound: the same peak in every mode, the bytes of the dtypes the kernel streams
    xb, yb = S.of((4096, 4096), dtype="bfloat16"), S.of((4096, 4096), dtype="bfloat16")
    f32, _ = CostModel(m, precision="bf16").op_time("Relu", {}, [x], [y])
    f16, _ = CostModel(m, precision="bf16").op_time("Relu", {}, [xb], [yb])
    assert f32 == pytest.approx(2 * x.nbytes / m.mem_bandwidth + m.device.op_overhead)
    assert f16 == pytest.approx(x.nbytes / m.mem_bandwidth + m.device.op_overhead)


def test_bf16_prices_autocast_casts():
    """Under bf16 the first Linear reads the fp32 input and weight through cast kernels (read 4 + write 2
    bytes an element each); its output and everything after are bf16."""
    m = h100_datasheet(1, 1)
    g = mlp(batch=64, h=64, layers=2)
    cm = CostModel(m, precision="bf16")
    gc = GraphCost(g, cm)
    fc0 = next(n.id for n in g.nodes() if n.name == "fc0")
    fc1 = next(n.id for n in g.nodes() if n.name == "fc1")
    assert [(a, b) for _, a, b in gc.casts(fc0)] == [("float32", "bfloat16")] * 2   # input and weight
    assert [(a, b) for _, a, b in gc.casts(fc1)] == [("float32", "bfloat16")]       # the weight only
    f0, _ = gc.task_time(fc0)
    ins, outs = gc.kernel_shapes(fc0)
    assert all(s.dtype == "bfloat16" for s in ins + outs)
    k, _ = cm.op_time("Linear", {}, ins, outs)
    one = 64 * 64 * 6 / m.mem_bandwidth + m.device.op_overhead
    assert f0 == pytest.approx(k + 2 * one)


# --- which dtype each tensor has -----------------------------------------------------------------------------

def _mixed_graph():
    b = PCG.builder()
    ids = b.add("Input", {"name": "ids", "shape": (4, 8), "dtype": "int64"})
    tab = b.add("Weight", {"name": "tab", "shape": (100, 32)})
    e = b.add("Embedding", {}, [ids, tab], name="emb")
    w = b.add("Weight", {"name": "w", "shape": (32, 32)})
    h = b.add("Linear", {}, [e, w], name="fc")
    r = b.add("Add", {}, [h, e], name="residual")          # bf16 + fp32 -> fp32 (type promotion)
    ln = b.add("LayerNorm", {"axis": -1}, [r], name="ln")  # autocast's fp32 list
    h2 = b.add("Linear", {}, [ln, w], name="fc2")
    sc = b.add("Scale", {"factor": 0.5}, [h2], name="scale")   # keeps bf16
    sm = b.add("Softmax", {"axis": -1}, [sc], name="softmax")  # fp32 list
    b.set_outputs([sm])
    return b.finish()


def test_autocast_dtypes_follow_torch():
    g = _mixed_graph()
    name = {n.name: n.id for n in g.nodes() if n.name}
    gc = GraphCost(g, CostModel(parse_machine("h100:1x1"), precision="bf16"))
    want = {"emb": "float32", "fc": "bfloat16", "residual": "float32", "ln": "float32", "fc2": "bfloat16",
            "scale": "bfloat16", "softmax": "float32"}
    assert {k: gc.dtype((name[k], 0)) for k in want} == want
    # fp32 and tf32 keep the declared dtypes
    for p in ("fp32", "tf32"):
        gc = GraphCost(g, CostModel(parse_machine("h100:1x1"), precision=p))
        assert all(gc.dtype((name[k], 0)) == "float32" for k in want)
        assert all(not gc.casts(name[k]) for k in want)


# --- memory ----------------------------------------------------------------------------------------------

def test_memory_hand_count_tiny_mlp():
    """x[8,16] -> fc0 -> relu0 -> fc1 -> relu1 with Adam, one device.  fp32: weights + grads + 2 states
    (16 bytes a parameter); kept activations: relu0's output (Relu saves it, fc1 saves it) and relu1's
    (the graph output), 4 bytes an element.  bf16 adds autocast's bf16 weight copies (2 bytes a
    parameter), keeps the activations in bf16 (2 bytes) and holds fc0's bf16 copy of the input x it saves."""
    B, H, L = 8, 16, 2
    g = mlp(batch=B, h=H, layers=L)
    params = L * H * H
    r32 = _price(g, "h100:1x1", "fp32")
    r16 = _price(g, "h100:1x1", "bf16")
    assert r32.memory.weights[0] == 16 * params
    assert r32.memory.activations[0] == 2 * B * H * 4
    assert r16.memory.weights[0] == 16 * params + 2 * params
    assert r16.memory.activations[0] == 2 * B * H * 2 + B * H * 2
    assert _price(g, "h100:1x1", "tf32").memory.max_bytes == r32.memory.max_bytes


def test_activation_bytes_halve_in_bf16_weights_do_not():
    g = mlp(batch=1024, h=64, layers=6)
    r32, r16 = _price(g, "h100:1x1", "fp32", "sgd"), _price(g, "h100:1x1", "bf16", "sgd")
    x = 1024 * 64 * 2          # fc0's bf16 copy of the fp32 input
    assert r16.memory.activations[0] - x == r32.memory.activations[0] // 2
    assert r16.memory.weights[0] == r32.memory.weights[0] * (8 + 2) // 8   # sgd: weight + grad, + bf16 copy


# --- communication ---------------------------------------------------------------------------------------

def test_activation_transfers_halve_gradient_allreduce_stays_fp32():
    g = data_parallel(mlp(batch=4096, h=1024, layers=2), 4, combine_outputs=True)
    out = {}
    for p in MODES:
        m = parse_machine("h100:1x4")
        model = CostModel(m, precision=p)
        r = MachineMapper(model).optimize(g)
        out[p] = r.breakdown
    # the output gather (an activation Combine, forward + backward): half the bytes, the same elements
    lat = 2 * 3 * parse_machine("h100:1x4").links["group"].latency     # fwd + bwd, 3 messages each
    assert out["bf16"].comm_elements == out["fp32"].comm_elements
    assert out["bf16"].comm - lat == pytest.approx((out["fp32"].comm - lat) / 2, rel=0.02)
    # gradients of fp32 master weights are all-reduced in fp32 (torch DDP under autocast)
    assert out["bf16"].sync == pytest.approx(out["fp32"].sync)
    assert out["tf32"].comm == pytest.approx(out["fp32"].comm)


# --- measured kernel tables ----------------------------------------------------------------------------------

def test_interpolate_table():
    pts = [(1e3, 2e-6), (1e6, 2e-5), (1e9, 1e-2)]
    assert interpolate_table(pts, 1e3) == pytest.approx(2e-6)
    assert interpolate_table(pts, 1e6) == pytest.approx(2e-5)
    assert interpolate_table(pts, 10.0) == pytest.approx(2e-6)           # below: the first point's time
    # linear in work between points: exact for a fixed cost plus work at a throughput
    affine = [(w, 5e-6 + w / 1e12) for w in (1e3, 1e6, 1e9)]
    for w in (3e3, 5e5, 2e8):
        assert interpolate_table(affine, w) == pytest.approx(5e-6 + w / 1e12)
    assert interpolate_table(pts, (1e3 + 1e6) / 2) == pytest.approx((2e-6 + 2e-5) / 2)
    # beyond the last point: linear at the marginal throughput of the upper half
    slope = (1e-2 - 2e-5) / (1e9 - 1e6)
    assert interpolate_table(pts, 3e9) == pytest.approx(1e-2 + 2e9 * slope)
    # two kernels of nearly the same work with very different times (a 7x7 stem convolution beside a
    # 3x3 one) do not set the slope: the secant from the upper half's base, at most the last point's average
    steep = [(1e9, 0.1e-3), (1.48e10, 0.37e-3), (1.51e10, 0.75e-3)]
    secant = (0.75e-3 - 0.1e-3) / (1.51e10 - 1e9)
    assert interpolate_table(steep, 1.1e11) == pytest.approx(0.75e-3 + (1.1e11 - 1.51e10) * secant)
    # (the last segment's slope would have given 0.75 ms + 95e9 * 1.27e-12 = 121 ms, 22x more)
    # a secant steeper than the last point's average time per work is capped at that average
    capped = [(1e3, 1e-9), (1e6, 1e-3)]
    assert interpolate_table(capped, 2e6) == pytest.approx(2e-3)
    assert interpolate_table([(100.0, 1.0)], 300.0) == pytest.approx(3.0)
    assert interpolate_table(pts, 0) == 0.0


def _with_tables(tables):
    obj = h100_datasheet(1, 1).to_json()          # the datasheet device: no fitted tables or overheads
    obj["device"]["kernel_tables"] = tables
    return MachineSpec.from_json(obj)


def test_cost_model_uses_a_table_where_the_class_and_mode_have_one():
    mm = [[1e6, 1e-5], [1e9, 2e-3], [1e12, 1.5]]
    m = _with_tables({"matmul/bf16": mm, "elementwise/fp32": [[1e3, 3e-6], [1e9, 1e-3]],
                      "optimizer/fp32": [[1e3, 4e-6], [1e10, 4e-3]]})
    x, w, y = S.of((1024, 1024)), S.of((1024, 1024)), S.of((1024, 1024))
    flops = 2 * 1024 ** 3
    assert kernel_work("Linear", [x, w], [y]) == (flops, flops)
    f, b = CostModel(m, precision="bf16").op_time("Linear", {}, [x, w], [y])
    assert f == pytest.approx(interpolate_table(mm, flops))
    assert b == pytest.approx(2 * interpolate_table(mm, flops))      # two kernels of the same work
    # no fp32 matmul table: fp32 falls back to peak x efficiency + overhead
    f32, _ = CostModel(m, precision="fp32").op_time("Linear", {}, [x, w], [y])
    assert f32 == pytest.approx(flops / (m.device.peak_flops * m.device.eff("matmul")) + m.device.op_overhead)
    # memory-bound: the work is bytes; a bf16 kernel without a bf16 table uses the fp32 one
    xb = S.of((1024, 1024), dtype="bfloat16")
    fr, _ = CostModel(m, precision="bf16").op_time("Relu", {}, [xb], [xb])
    assert fr == pytest.approx(interpolate_table([[1e3, 3e-6], [1e9, 1e-3]], 2 * xb.nbytes))
    # the optimizer: work = bytes the update moves ((3 + 2 states) x weight bytes)
    assert CostModel(m, optimizer="adam").update_time(4e6) == pytest.approx(
        interpolate_table([[1e3, 4e-6], [1e10, 4e-3]], 7 * 4e6))


def test_linear_bias_gradient_is_a_reduction_over_the_output_gradient():
    mm = [[1e6, 1e-5], [1e12, 1.5]]
    red = [[1e3, 7e-6], [1e9, 5e-4]]
    m = _with_tables({"matmul/fp32": mm, "reduce/fp32": red})
    x, w, bias, y = S.of((1024, 512)), S.of((512, 256)), S.of((256,)), S.of((1024, 256))
    cm = CostModel(m)
    f0, b0 = cm.op_time("Linear", {}, [x, w], [y])
    f1, b1 = cm.op_time("Linear", {}, [x, w, bias], [y])
    # the forward bias add is in the GEMM's epilogue; the backward adds one column sum of dY
    assert f1 == pytest.approx(interpolate_table(mm, kernel_work("Linear", [x, w, bias], [y])[0]))
    assert b1 - 2 * interpolate_table(mm, kernel_work("Linear", [x, w, bias], [y])[1]) == pytest.approx(
        interpolate_table(red, y.nbytes))
    assert b1 > b0
    # no reduce table (an older calibration): nothing added
    m2 = _with_tables({"matmul/fp32": mm})
    _, b2 = CostModel(m2).op_time("Linear", {}, [x, w, bias], [y])
    assert b2 == pytest.approx(2 * interpolate_table(mm, kernel_work("Linear", [x, w, bias], [y])[1]))


def test_embedding_tables_forward_and_backward():
    fwd, bwd = [[1e3, 5e-6], [1e9, 1e-3]], [[1e3, 9e-6], [1e10, 2e-2]]
    m = _with_tables({"embedding_fwd/fp32": fwd, "embedding_bwd/fp32": bwd})
    ids, tab, out = S.of((64, 8), dtype="int64"), S.of((10000, 32)), S.of((64, 8, 32))
    assert op_class("Embedding") == "embedding"
    wf, wb = kernel_work("Embedding", [ids, tab], [out])
    assert wf == out.nbytes + ids.nbytes and wb == out.nbytes + tab.nbytes
    f, b = CostModel(m).op_time("Embedding", {}, [ids, tab], [out])
    assert f == pytest.approx(interpolate_table(fwd, wf))
    assert b == pytest.approx(interpolate_table(bwd, wb))


def test_machine_json_peaks_and_tables_round_trip_and_validation(tmp_path):
    m = _with_tables({"conv/tf32": [[1e6, 1e-5], [1e9, 1e-3]]})
    p = tmp_path / "m.json"
    m.save(str(p))
    back = MachineSpec.load(str(p))
    assert back.to_json() == m.to_json()
    assert back.device.peak("bf16") == 989e12 and back.device.table("conv/tf32")[1] == (1e9, 1e-3)
    # files written before peaks and tables existed: every mode at peak_flops, no tables
    old = parse_machine("dgx-a100:1x2").to_json()
    del old["device"]["peaks"], old["device"]["kernel_tables"]
    mo = MachineSpec.from_json(old)
    assert all(mo.device.peak(x) == mo.device.peak_flops for x in MODES) and not mo.device.kernel_tables
    for bad, msg in [({"matmul/fp16": [[1, 1]]}, "mode"), ({"matmul": [[1, 1]]}, "mode"),
                     ({"matmul/fp32": [[2, 1], [1, 2]]}, "increasing"), ({"matmul/fp32": []}, "non-empty"),
                     ({"matmul/fp32": [[0, 1]]}, "bad point")]:
        with pytest.raises(MachineError, match=msg):
            _with_tables(bad)
    obj = m.to_json()
    obj["device"]["peaks"] = {"int8": 1e15}
    with pytest.raises(MachineError, match="math mode"):
        MachineSpec.from_json(obj)


def test_preset_docstrings_name_datasheets_and_what_was_measured():
    from unity_pcg import machine as M
    for fn in (M.summit, M.dgx_a100, M.h100_datasheet, M.h100):
        doc = fn.__doc__
        assert ("https://" in doc or fn is M.h100) and "Measured:" in doc and "Assumed:" in doc
    # the h100 preset is the one fitted from measurements, and its file names where it came from
    dev, meta = M.fitted_device("h100")
    assert M.h100(1, 1).device == dev and dev.kernel_tables and set(dev.peaks) >= {"tf32", "bf16"}
    assert meta["measured_on"].startswith("NVIDIA H100") and meta["fitted_by"] == "python benchmarks/fit_h100.py"
    assert M.h100(2, 8).links == M.h100_datasheet(2, 8).links       # the interconnect stays the datasheet's


# --- plan file and CLI -----------------------------------------------------------------------------------

def _plan(tmp_path, precision):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in")
    m = parse_machine("h100:1x2")
    g = data_parallel(mlp(), 2)
    r = MachineMapper(CostModel(m, precision=precision)).optimize(g)
    return P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json(), precision=precision)


@pytest.mark.parametrize("precision", MODES)
def test_plan_records_precision(tmp_path, precision):
    pl = _plan(tmp_path, precision)
    path = tmp_path / "plan.json"
    pl.save(str(path))
    obj = json.loads(path.read_text())
    assert obj["precision"] == precision
    assert P.load(str(path)).precision == precision
    del obj["precision"]                               # a plan from before: fp32
    assert P.from_json(obj).precision == "fp32"
    obj["precision"] = "fp8"
    with pytest.raises(PlanError, match="precision"):
        P.from_json(obj)


def test_explain_reprices_in_the_plans_precision(tmp_path):
    from unity_pcg.explanation import explain, format_text
    pl = _plan(tmp_path, "bf16")
    e = explain(pl)
    assert e.totals["precision"] == "bf16"
    assert "precision bf16" in format_text(e, sections=["summary"])


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    pytest.importorskip("torch")
    from unity_pcg import zoo
    p = tmp_path_factory.mktemp("m") / "mlp.onnx"
    zoo.export("candle_uno", str(p), size="tiny", batch=12)
    return str(p)


def test_simulate_precision_flag(tiny_onnx, tmp_path, capsys):
    t = {}
    for prec in MODES:
        plan = tmp_path / f"{prec}.json"
        assert main(["simulate", tiny_onnx, "--machine", "h100:1x1", "--strategy", "none", "--precision", prec,
                     "--json", "-o", str(plan)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["precision"] == prec
        assert P.load(str(plan)).precision == prec
        t[prec] = out["predicted_iteration_s"]
    assert t["bf16"] != t["fp32"]
    assert main(["simulate", tiny_onnx, "--machine", "h100:1x1", "--precision", "bf16"]) == 0
    assert "precision  bf16" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", [["simulate", "M.onnx"], ["optimize", "M.onnx"], ["calibrate"]])
def test_bad_precision_is_one_line_exit_2(cmd, capsys):
    assert main(cmd + ["--precision", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision" in err[0] and "fp16" in err[0]


def test_optimize_precision_is_recorded(tmp_path):
    from unity_pcg.search.optimize import OptimizeError, optimize
    g = mlp(batch=8, h=16, layers=2)
    res = optimize(g, "h100:1x2", budget_s=5, max_candidates=3, pipeline=False, precision="bf16")
    assert res.plan.precision == "bf16" and res.plan.predicted["precision"] == "bf16"
    with pytest.raises(OptimizeError, match="precision"):
        optimize(g, "h100:1x2", budget_s=5, precision="fp16")


def test_optimize_cli_precision(tiny_onnx, tmp_path, capsys):
    plan = tmp_path / "p.json"
    assert main(["optimize", tiny_onnx, "--machine", "h100:1x2", "--budget", "5", "--candidates", "2",
                 "--no-pipeline", "--precision", "tf32", "-o", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "tf32" and P.load(str(plan)).precision == "tf32"
