"""Import coverage (issue 10, point 5), slow: real architectures with random weights, exported by both of
PyTorch's exporters, import and check equal against onnxruntime (``check_model``, the code of
``unity-pcg import --check``); the torchvision ones (batch 8, real size) import in at most 5 s.

Exports are made by ``benchmarks/export_models.py`` and cached under ``benchmarks/.cache/coverage/``:
transformers with this Python (skipped without transformers), torchvision with the Python of a separate venv
named by ``UNITY_TV_PYTHON`` (default /work/tv-venv/bin/python; skipped where it does not exist, since
torchvision does not import beside this venv's torch).  ``benchmarks/import_coverage.py`` writes the same
cases as a table.

    .venv/bin/python -m pytest -m slow tests/unity_pcg/test_import_coverage.py -n 0
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import onnx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import export_models as E  # noqa: E402

pytestmark = pytest.mark.slow
pytest.importorskip("onnxruntime")
TV_PYTHON = os.environ.get("UNITY_TV_PYTHON", "/work/tv-venv/bin/python")
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT = sorted(f[:-5] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx")) if os.path.isdir(LIGHT_DIR) else []


def _export(family: str, name: str, exporter: str) -> str:
    path = os.path.join(E.CACHE, f"{name}-{exporter}.onnx")
    if not os.path.exists(path):
        if family == "transformers":
            pytest.importorskip("transformers")
            rec = E.export_one(family, name, exporter)
        else:
            if not os.path.exists(TV_PYTHON):
                pytest.skip(f"no Python with torchvision at {TV_PYTHON} (set UNITY_TV_PYTHON)")
            subprocess.run([TV_PYTHON, os.path.join(BENCH, "export_models.py"), family, "--models", name,
                            "--exporters", exporter], cwd=ROOT, capture_output=True, timeout=900)
            with open(os.path.join(E.CACHE, f"{family}.json")) as f:
                rec = json.load(f).get(f"{name}-{exporter}", {"status": "export_failed", "error": "no record"})
        if rec["status"] not in ("ok", "cached"):
            pytest.fail(f"{exporter} export of {name} failed: {rec.get('error')}")
    return path


def _check(path: str, max_import_s: float | None = None):
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.onnx_import.check import check_model
    g = load_onnx(path)
    g.check()
    if max_import_s is not None:
        assert g.meta["import_seconds"] <= max_import_s, f"import took {g.meta['import_seconds']:.2f} s"
    r = check_model(path, graph=g)
    assert r.ok, [(o.name, o.why) for o in r.outputs if not o.ok]
    return r


@pytest.mark.parametrize("exporter", E.EXPORTERS)
@pytest.mark.parametrize("name", E.HF_MODELS)
def test_transformers_model_imports_and_checks_equal(name, exporter):
    _check(_export("transformers", name, exporter))


@pytest.mark.parametrize("exporter", E.EXPORTERS)
@pytest.mark.parametrize("name", list(E.TV_MODELS))
def test_torchvision_model_imports_in_5s_and_checks_equal(name, exporter):
    _check(_export("torchvision", name, exporter), max_import_s=5.0)


@pytest.mark.parametrize("name", LIGHT)
def test_onnx_light_model_checks_equal(name):
    _check(os.path.join(LIGHT_DIR, name + ".onnx"))
