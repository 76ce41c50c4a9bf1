"""`unity-pcg import`: table and JSON output, --batch, --dot, --png, and exit code 2 with one line on bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from unity_pcg.cli import main
from unity_pcg.onnx_import import load_onnx

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
ALEXNET = os.path.join(LIGHT_DIR, "light_bvlc_alexnet.onnx")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def test_json_output_matches_the_pcg():
    r = _cli(ALEXNET, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    g = load_onnx(ALEXNET)
    s = g.summary()
    assert out["ops"] == s["ops"] and out["op_types"] == s["op_types"]
    assert out["params"] == s["params"] == 60_965_224  # AlexNet (BVLC, grouped convs)
    assert out["flops"] == pytest.approx(s["flops"]) and out["flops"] > 1e9
    assert isinstance(out["import_seconds"], float) and out["import_seconds"] >= 0
    assert out["op_types"]["Conv2d"] == 5 and out["op_types"]["Linear"] == 3


def test_batch_scales_flops_and_shapes():
    r1 = json.loads(_cli(ALEXNET, "--json").stdout)
    r8 = json.loads(_cli(ALEXNET, "--json", "--batch", "8").stdout)
    assert r8["inputs"][0]["shape"][0] == 8 and r8["outputs"][0][0] == 8
    assert r8["params"] == r1["params"]
    assert r8["flops"] == pytest.approx(8 * r1["flops"], rel=1e-9)


def test_table_output(capsys):
    assert main(["import", ALEXNET]) == 0
    out = capsys.readouterr().out
    for word in ("Conv2d", "Linear", "parameters: 60,965,224", "FLOPs", "import time"):
        assert word in out


def test_dot_file(tmp_path):
    p = tmp_path / "g.dot"
    assert main(["import", ALEXNET, "--dot", str(p)]) == 0
    text = p.read_text()
    assert text.startswith("digraph") and text.count("->") > 20


def test_png_renders_or_says_graphviz_is_missing(tmp_path, capsys):
    p = tmp_path / "g.png"
    rc = main(["import", ALEXNET, "--png", str(p)])
    if shutil.which("dot"):
        assert rc == 0 and p.read_bytes()[:4] == b"\x89PNG"
    else:
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "graphviz" in err[0].lower()


def _bad_models(tmp_path):
    out = {}
    (tmp_path / "text.onnx").write_text("not a model\n")
    out["text"] = str(tmp_path / "text.onnx")
    data = open(ALEXNET, "rb").read()
    (tmp_path / "trunc.onnx").write_bytes(data[: len(data) // 3])
    out["truncated"] = str(tmp_path / "trunc.onnx")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    for name, nodes in {"unsupported": [helper.make_node("Hardmax", ["x"], ["y"], name="hm")],
                        "dynamic": [helper.make_node("Relu", ["x"], ["y"], name="r")],
                        "missing": [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                        "cycle": [helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                                  helper.make_node("Relu", ["a"], ["b"], name="n2"),
                                  helper.make_node("Relu", ["a"], ["y"], name="n3")]}.items():
        m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 13)])
        p = tmp_path / f"{name}.onnx"
        onnx.save(m, str(p))
        out[name] = str(p)
    out["nofile"] = str(tmp_path / "does_not_exist.onnx")
    return out


@pytest.mark.parametrize("case,needle", [("text", "not a valid ONNX"), ("truncated", "not a valid ONNX"),
                                         ("unsupported", "Hardmax"), ("dynamic", "--batch"), ("missing", "'W'"),
                                         ("cycle", "cycle"), ("nofile", "no such file")])
def test_bad_input_exits_2_with_one_line(tmp_path, case, needle):
    paths = _bad_models(tmp_path)
    extra = ["--batch", "2"] if case in ("unsupported", "missing", "cycle") else []
    r = _cli(paths[case], *extra)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unity-pcg import: error: ") and needle in lines[0], lines
    if case == "unsupported":
        assert "'hm'" in lines[0]


def test_dynamic_batch_fixed_with_batch_flag(tmp_path):
    paths = _bad_models(tmp_path)
    r = _cli(paths["dynamic"], "--batch", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["inputs"][0]["shape"] == [3, 4] and out["ops"] == 1


def test_bad_batch_value():
    assert main(["import", ALEXNET, "--batch", "0"]) == 2
