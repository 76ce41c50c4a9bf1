"""GPU calibration (calibration/gpu.py), tested as far as a CPU can: the measurement loop on a CPU
with tiny sizes (a fake timer, and real timing of a few kernels), the fits against synthetic data with
known throughput and overhead, the machine file it writes, and the cost model pricing from its tables."""
import json
import random

import pytest

from unity_pcg import cli
from unity_pcg.machine import MachineSpec, h100, interpolate_table
from unity_pcg.calibration import gpu as G
from unity_pcg.search.cost import CostModel
from unity_pcg.shape import ParallelTensorShape as S


# --- fits -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overhead,throughput", [(5e-6, 4e13), (2e-5, 1e12), (0.0, 3e11)])
def test_fit_recovers_throughput_and_overhead(overhead, throughput):
    rng = random.Random(1)
    xs = [2.0 ** k for k in range(10, 40, 2)]
    ts = [(overhead + x / throughput) * (1 + rng.uniform(-0.01, 0.01)) for x in xs]
    f = G.fit_affine(xs, ts)
    assert f["throughput"] == pytest.approx(throughput, rel=0.03)
    assert f["overhead"] == pytest.approx(overhead, rel=0.05, abs=1e-7)
    assert f["rel_rms"] < 0.02


def test_fit_exact_and_degenerate():
    xs = [1e3, 1e6, 1e9]
    f = G.fit_affine(xs, [1e-6 + x / 1e12 for x in xs])
    assert f["throughput"] == pytest.approx(1e12, rel=1e-9) and f["overhead"] == pytest.approx(1e-6, rel=1e-9)
    assert G.fit_predict(f, 1e8) == pytest.approx(1e-6 + 1e-4, rel=1e-9)
    # no size dependence (or time falling with size): a fixed cost only, never a negative term
    flat = G.fit_affine(xs, [3e-6, 3e-6, 3e-6])
    assert flat["throughput"] is None and flat["overhead"] == pytest.approx(3e-6)
    falling = G.fit_affine(xs, [5e-6, 4e-6, 3e-6])
    assert falling["overhead"] > 0 and falling["throughput"] is None
    # proportional times: no fixed cost
    prop = G.fit_affine(xs, [x / 1e11 for x in xs])
    assert prop["overhead"] == pytest.approx(0.0, abs=1e-15) and prop["throughput"] == pytest.approx(1e11)


def test_make_table_sorted_averaged_monotone():
    t = G.make_table([(4.0, 3.0), (1.0, 1.0), (2.0, 5.0), (2.0, 3.0), (3.0, 2.0), (8.0, 9.0), (0.0, 1.0)])
    xs = [w for w, _ in t]
    assert xs == [1.0, 2.0, 3.0, 4.0, 8.0]                    # work 0 dropped, equal works merged
    ts = [s for _, s in t]
    assert all(a <= b for a, b in zip(ts, ts[1:]))            # never cheaper with more work
    # pool-adjacent-violators, each measurement weighing alike: work 2 (5 and 3), 3 (2) and 4 (3) pool
    # to (5 + 3 + 2 + 3) / 4
    assert ts == [1.0, 3.25, 3.25, 3.25, 9.0]


def test_fit_collective_recovers_ring_model():
    p, alpha, beta = 4, 8e-6, 2e11
    res = {n: 2 * (p - 1) * alpha + 2 * (p - 1) / p * 4 * n / beta for n in (2 ** k for k in range(8, 28, 2))}
    f = G.fit_collective("all_reduce", p, res)
    assert f["latency"] == pytest.approx(alpha, rel=1e-6) and f["bandwidth"] == pytest.approx(beta, rel=1e-6)
    res = {n: (p - 1) * alpha + (p - 1) / p * 4 * n / beta for n in (2 ** k for k in range(8, 28, 2))}
    for kind in ("all_gather", "reduce_scatter"):
        f = G.fit_collective(kind, p, res)
        assert f["latency"] == pytest.approx(alpha, rel=1e-6) and f["bandwidth"] == pytest.approx(beta, rel=1e-6)


# --- the measurement loop on a CPU -----------------------------------------------------------------------

def counting_timer(value=1e-5):
    calls = []

    def timer(fn, warmup, reps):
        fn()                       # the callable really runs (shapes, dtypes, autograd)
        calls.append(fn)
        return value
    return timer, calls


def test_measure_cases_every_class_and_mode_with_a_fake_timer():
    timer, calls = counting_timer(1e-3)      # "long" kernels: one backward call each (no copies)
    rows = G.measure_cases("cpu", G.MODES, "tiny", timer=timer, quiet=True)
    assert calls
    seen = {(r["class"], r["mode"]) for r in rows}
    for c in G.CLASSES:
        for mode in G.case_modes(c, G.MODES):
            assert (c, mode) in seen, (c, mode)
    assert ("embedding", "bf16") not in seen and ("elementwise", "tf32") not in seen
    for r in rows:
        assert r["work"][0] > 0 and r["work"][1] > 0
        if r["class"] in G.COMPUTE_CLASSES:
            assert r["key_mode"] == r["mode"]
        if r["class"].startswith("optimizer"):
            assert r["bwd"] is None and r["fwd"] == pytest.approx(1e-3 / 4)      # 4 tensors per step
        else:
            assert r["bwd"] == 1e-3
    # bf16 softmax and sum read bf16 and write fp32: fp32 tables, less work than the fp32 kernel's
    sm = {r["mode"]: r for r in rows if r["class"] == "softmax" and r["label"] == "softmax256"}
    assert sm["bf16"]["key_mode"] == "fp32" and sm["bf16"]["work"][0] == pytest.approx(0.75 * sm["fp32"]["work"][0])
    ew = {r["mode"]: r for r in rows if r["label"] == "relu256"}
    assert ew["bf16"]["key_mode"] == "bf16" and ew["bf16"]["work"][0] == pytest.approx(ew["fp32"]["work"][0] / 2)
    # work as the cost model counts it: a bias-free Linear 2MKN; the embedding's backward covers the table
    mm = next(r for r in rows if r["class"] == "matmul" and r["label"] == "64x128x32" and r["mode"] == "fp32")
    assert mm["work"] == [2 * 64 * 128 * 32] * 2
    emb = next(r for r in rows if r["label"] == "r1000d8n64")
    assert emb["work"] == [64 * 8 + 64 * 8 * 4, 64 * 8 * 4 + 1000 * 8 * 4]


def test_measure_cases_real_timer_on_cpu():
    rows = G.measure_cases("cpu", ["fp32"], "tiny", classes=["matmul", "elementwise"], warmup=1, reps=2,
                           quiet=True)
    assert {r["class"] for r in rows} == {"matmul", "elementwise"}
    assert all(r["fwd"] > 0 and r["bwd"] > 0 for r in rows)
    fits, tables = G.fit_rows(rows)
    assert set(tables) == {"matmul/fp32", "matmul_bwd/fp32", "elementwise/fp32", "elementwise_bwd/fp32"}
    for t in tables.values():
        assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(t, t[1:]))


def test_joint_backward_over_copies():
    import torch
    assert G.backward_copies(1e-5) == 16 and G.backward_copies(1e-4) == 4 and G.backward_copies(1e-2) == 1
    c = G.Case("matmul", "8x8x8", (8, 8, 8))
    built = [G.build_case(c, "cpu", "fp32") for _ in range(3)]
    seen = []
    real_grad = torch.autograd.grad

    def spy(outputs, inputs, grad_outputs=None, **kw):
        seen.append((len(outputs), len(inputs)))
        return real_grad(outputs, inputs, grad_outputs, **kw)
    bwd = G.joint_backward(built)
    torch.autograd.grad, old = spy, torch.autograd.grad
    try:
        bwd()
        bwd()                       # the graphs are kept: it can be timed repeatedly
    finally:
        torch.autograd.grad = old
    assert seen == [(3, 6), (3, 6)]      # one call: 3 outputs, x and w of each copy (bias-free GEMMs)


def test_math_mode_restores_tf32_flags():
    before = G.tf32_enabled()
    with G.math_mode("tf32", "cpu"):
        assert G.tf32_enabled() == (True, True)
        with G.math_mode("fp32", "cpu"):
            assert G.tf32_enabled() == (False, False)
        assert G.tf32_enabled() == (True, True)
    with G.math_mode("bf16", "cpu"):
        assert G.tf32_enabled() == (True, True)
    assert G.tf32_enabled() == before
    with pytest.raises(G.CalibrationError):
        with G.math_mode("fp8", "cpu"):
            pass


# --- the machine file and the cost model -----------------------------------------------------------------

def test_calibrate_device_cpu_writes_a_loadable_machine(tmp_path):
    timer, _ = counting_timer(2e-3)
    obj = G.calibrate_device("cpu", size="tiny", timer=timer, quiet=True)
    m = MachineSpec.from_json(obj)
    path = tmp_path / "cpu.json"
    m.save(str(path))
    m2 = MachineSpec.load(str(path))
    assert m2.device.kernel_tables == m.device.kernel_tables and m2.device.peaks == m.device.peaks
    # every time is 2 ms: the peak is the largest compute work over it, the fits are fixed costs
    rows = obj["meta"]["gpu_calibration"]["measured"]
    for mode in G.MODES:
        best = max(r["work"][0] for r in rows if r["class"] in G.COMPUTE_CLASSES and r["mode"] == mode)
        assert m.device.peak(mode) == pytest.approx(best / 2e-3)
    assert m.device.overheads["matmul"] == pytest.approx(2e-3)
    assert m.device.overheads["embedding:bwd"] == pytest.approx(2e-3)
    assert m.device.op_overhead == pytest.approx(2e-3)
    assert "matmul_bwd/bf16" in m.device.kernel_tables and "optimizer/fp32" in m.device.kernel_tables
    assert json.loads(path.read_text())["meta"]["gpu_calibration"]["modes"] == list(G.MODES)


def _synthetic_rows():
    """Measured rows of a device with known costs: matmul fp32 5 us + FLOPs / 20 TFLOP/s, bf16 5 us +
    FLOPs / 200 TFLOP/s (backward 2x), embedding forward 3 us + bytes / 1 TB/s, backward 10 us + bytes /
    0.5 TB/s, element-wise 2 us + bytes / 2 TB/s, Adam 4 us + bytes / 1.5 TB/s per tensor."""
    rows = []
    for mode, thr in (("fp32", 20e12), ("bf16", 200e12)):
        for n in (64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096):
            w = 2.0 * n ** 3 + n * n
            rows.append({"class": "matmul", "label": str(n), "mode": mode, "key_mode": mode,
                         "names": ["matmul", "matmul_bwd"], "work": [w, w], "fwd": 5e-6 + w / thr,
                         "bwd": 2 * (5e-6 + w / thr)})
    for n in (1e3, 1e5, 1e7):
        wf, wb = 4 * n, 4 * n + 4e6
        rows.append({"class": "embedding", "label": str(n), "mode": "fp32", "key_mode": "fp32",
                     "names": ["embedding_fwd", "embedding_bwd"], "work": [wf, wb], "fwd": 3e-6 + wf / 1e12,
                     "bwd": 1e-5 + wb / 5e11})
    for n in (1e3, 1e5, 1e7, 1e9):
        rows.append({"class": "elementwise", "label": str(n), "mode": "fp32", "key_mode": "fp32",
                     "names": ["elementwise", "elementwise_bwd"], "work": [n, n], "fwd": 2e-6 + n / 2e12,
                     "bwd": 3e-6 + n / 2e12})
    for n in (1e4, 1e6, 1e8):
        rows.append({"class": "optimizer_adam", "label": str(n), "mode": "fp32", "key_mode": "fp32",
                     "names": ["optimizer_adam", None], "work": [n, n], "fwd": 4e-6 + n / 1.5e12, "bwd": None})
    return rows


def test_machine_from_synthetic_measurements_and_cost_model_uses_tables():
    fits, tables = G.fit_rows(_synthetic_rows())
    assert fits["matmul/fp32"]["throughput"] == pytest.approx(20e12, rel=1e-6)
    assert fits["matmul/bf16"]["overhead"] == pytest.approx(5e-6, rel=1e-6)
    assert fits["embedding_bwd/fp32"]["throughput"] == pytest.approx(5e11, rel=1e-6)
    obj = G.machine_json(h100(1, 1).to_json(), fits, tables, ("fp32", "bf16"), 80 * 2 ** 30, None, {"x": 1})
    m = MachineSpec.from_json(obj)
    d = m.device
    assert d.peak("bf16") > d.peak("fp32") == d.peak_flops
    assert d.mem_bandwidth == pytest.approx(2e12, rel=1e-6)
    assert d.overheads["matmul"] == pytest.approx(5e-6, rel=1e-6)
    assert d.overheads["matmul:bwd"] == pytest.approx(1e-5, rel=1e-6)
    assert d.overheads["embedding"] == pytest.approx(3e-6, rel=1e-6)
    assert d.update_overhead == pytest.approx(4e-6, rel=1e-6)
    assert m.links == h100(1, 1).links and m.meta["x"] == 1
    # a Linear between two measured sizes: the cost model interpolates the table of its math mode
    M = 448
    x, w, b, y = S.of((M, M)), S.of((M, M)), S.of((M,)), S.of((M, M))
    work = 2.0 * M ** 3 + M * M
    for mode in ("fp32", "bf16"):
        fwd, bwd = CostModel(m, precision=mode).op_time("Linear", {}, [x, w, b], [y])
        assert fwd == pytest.approx(interpolate_table(d.kernel_tables[f"matmul/{mode}"], work), rel=1e-9)
        assert bwd == pytest.approx(interpolate_table(d.kernel_tables[f"matmul_bwd/{mode}"], work), rel=1e-9)
    f32 = CostModel(m, precision="fp32").op_time("Linear", {}, [x, w, b], [y])[0]
    b16 = CostModel(m, precision="bf16").op_time("Linear", {}, [x, w, b], [y])[0]
    assert b16 < f32
    # the table is close to the model it was measured from (interpolated between 384 and 512)
    assert f32 == pytest.approx(5e-6 + work / 20e12, rel=0.15)
    # an embedding: gather forward and scatter backward from their own tables
    ids, table, out = S.of((1000,), dtype="int64"), S.of((1000, 64)), S.of((1000, 64))
    fwd, bwd = CostModel(m).op_time("Embedding", {}, [ids, table], [out])
    assert fwd == pytest.approx(interpolate_table(d.kernel_tables["embedding_fwd/fp32"], 8000 + 256000), rel=1e-9)
    assert bwd == pytest.approx(interpolate_table(d.kernel_tables["embedding_bwd/fp32"], 256000 + 256000), rel=1e-9)


# --- collectives and the CLI ------------------------------------------------------------------------------

def test_collectives_sweep_with_gloo():
    res = G.measure_collectives(2, "gloo", sizes=[256, 4096], reps=2, timeout=120)
    assert set(res) == set(G.COLLECTIVES)
    for kind, sweep in res.items():
        assert sorted(sweep) == [256, 4096] and all(t > 0 for t in sweep.values())
        f = G.fit_collective(kind, 2, sweep)
        assert f["latency"] >= 0 and (f["bandwidth"] is None or f["bandwidth"] > 0)


def test_cli_device_cuda_without_cuda_is_one_line(monkeypatch, capsys, tmp_path):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    rc = cli.main(["calibrate", "--device", "cuda", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no CUDA device" in err
    assert not out.exists()


def test_base_preset_from_device_name():
    assert G.base_preset("NVIDIA H100 80GB HBM3") == "h100"
    assert G.base_preset("NVIDIA A100-SXM4-80GB") == "dgx-a100"
    assert G.base_preset("Tesla V100-SXM2-16GB") == "summit"
    assert G.base_preset("NVIDIA L4") == "h100"


def test_cli_device_cpu_precision_writes_machine_file(monkeypatch, tmp_path, capsys):
    timer, _ = counting_timer(3e-3)
    monkeypatch.setattr(G, "make_timer", lambda device, min_sample_s=1e-3: timer)
    out = tmp_path / "cpu.json"
    rc = cli.main(["calibrate", "--device", "cpu", "--size", "tiny", "--precision", "bf16", "-o", str(out)])
    cap = capsys.readouterr()
    assert rc == 0 and "[calibrate]" in cap.err and "wrote" in cap.out
    m = MachineSpec.load(str(out))
    assert m.meta["gpu_calibration"]["modes"] == ["fp32", "bf16"]          # fp32 always, then the precision
    assert {k.rsplit("/", 1)[1] for k in m.device.kernel_tables} == {"fp32", "bf16"}
    assert set(m.device.peaks) == {"fp32", "bf16"}
    assert cli.main(["calibrate", "--device", "cpu", "--worlds", "2", "-o", str(out)]) == 2


def test_make_table_merges_kernels_of_nearly_equal_work():
    # a 7x7 stem convolution (slow) beside 3x3 ones of nearly the same FLOPs: one point, their mean
    pts = [(1e9, 1e-4), (1.48e10, 0.37e-3), (1.51e10, 0.75e-3), (4e10, 1.2e-3)]
    t = G.make_table(pts)
    assert len(t) == 3
    assert t[1][0] == pytest.approx((1.48e10 + 1.51e10) / 2) and t[1][1] == pytest.approx((0.37e-3 + 0.75e-3) / 2)
    # still non-decreasing (pool-adjacent-violators) after merging
    t2 = G.make_table([(1e6, 2e-5), (2e6, 1e-5), (1e9, 1e-3)])
    assert [p[1] for p in t2] == sorted(p[1] for p in t2)
