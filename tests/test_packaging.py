"""The installed package owns one top-level name (issue 10, point 6).

A wheel built from this checkout holds only ``unity_pcg/`` (and its dist-info) at the top level; installed
alone (no editable finder, no checkout on the path), every module imports under ``unity_pcg.*`` only, the
old top-level names do not exist, and no module file is loaded under two names.
"""
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD_NAMES = ("search", "substitutions", "verifier", "executor", "rules_cache", "calibration")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src")     # a copy: setuptools writes build/ and *.egg-info beside the sources
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    for d in ("unity_pcg", *OLD_NAMES):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("unity_pcg-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    dist = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist == {"unity_pcg"}, sorted(tops)
    for sub in OLD_NAMES:
        assert any(n.startswith(f"unity_pcg/{sub}/__init__.py") for n in names), sub
    assert "unity_pcg/rules_cache/rules.json" in names and "unity_pcg/rules_cache/manifest.json" in names
    assert "unity_pcg/executor/__main__.py" in names
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["unity_pcg"]


_PROBE = r"""
import importlib, importlib.util, json, pkgutil, sys
import unity_pcg
mods = []
for m in pkgutil.walk_packages(unity_pcg.__path__, "unity_pcg."):
    if m.name.endswith("__main__"):
        continue
    importlib.import_module(m.name)
    mods.append(m.name)
files = {}
dups = []
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if f and f.startswith(sys.argv[1]):
        if f in files:
            dups.append([files[f], name])
        files[f] = name
old = {n: importlib.util.find_spec(n) is not None for n in sys.argv[2:]}
from unity_pcg.substitutions import cache
print(json.dumps({"mods": mods, "dups": dups, "old": old, "rules": len(cache.load().rules),
                  "where": unity_pcg.__file__}))
"""


def test_installed_wheel_imports_under_one_name_only(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    deps = sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]
    # -S: no .pth files, so the editable install of this checkout is not on the path; -I: no cwd, no PYTHONPATH
    code = "import sys; sys.path[:0] = " + repr([str(site), *deps]) + "\n" + _PROBE
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(site), *OLD_NAMES], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["where"].startswith(str(site))
    assert not got["dups"], got["dups"]
    assert not any(got["old"].values()), got["old"]
    assert got["rules"] > 1000
    for sub in ("unity_pcg.search.optimize", "unity_pcg.substitutions.match", "unity_pcg.verifier.verify",
                "unity_pcg.executor.train", "unity_pcg.onnx_import.importer", "unity_pcg.calibration.local",
                "unity_pcg.calibration.gpu"):
        assert sub in got["mods"], sub


def test_checkout_code_uses_the_package_names_only():
    """No file in the repository imports a folder by its old top-level name."""
    import re
    pat = re.compile(r"^\s*(from|import)\s+(" + "|".join(OLD_NAMES) + r")(\s|\.|$)", re.M)
    bad = []
    for folder in ("unity_pcg", *OLD_NAMES, "tests", "benchmarks", "scripts"):
        for f in (ROOT / folder).rglob("*.py"):
            for m in pat.finditer(f.read_text()):
                bad.append(f"{f.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not bad, bad
