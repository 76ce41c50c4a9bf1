"""benchmarks/gpu_memory_check.py on CPU processes (the script's test, not a measurement; the GPU run is by
hand): the fill part plans a device by its usable memory and runs both plans, the recompute rows record
the checkpointed runs, the parts run in the order given, the markdown report renders."""
from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_memory_check",
                                                  os.path.join(ROOT, "benchmarks", "gpu_memory_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_fill_then_recompute(tmp_path):
    B = _bench()
    out = tmp_path / "out"
    rc = B.main(["--device", "cpu", "--parts", "fill,recompute", "--models", "gpt_l1", "--precisions", "fp32",
                 "--iters", "1", "--fill-budget", "2", "--fill-steps", "2", "--out", str(out),
                 "--workdir", str(tmp_path / "work")])
    assert rc == 0
    rows = json.loads((out / "gpu_memory_check.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["fill", "recompute", "recompute", "recompute"]
    fill = rows[0]
    assert "error" not in fill, fill.get("error")
    assert fill["usable"] <= fill["capacity"]
    assert [x["ran"] for x in fill["runs"]] == [True, True]
    first = fill["runs"][0]
    assert abs(first["predicted_bytes"] / first["usable"] - 0.9) < 0.01       # the first plan at 90% of it
    assert fill["predicted"]["bytes"] <= fill["usable"]
    by = {r["technique"]: r["measured"] for r in rows[1:]}
    assert by["none"]["checkpointed_runs"] == 0 < by["selective"]["checkpointed_runs"]
    assert by["full"]["checkpointed_runs"] == rows[3]["predicted"]["regions"]
    md = (out / "gpu_memory_check.md").read_text()
    assert "usable" in md and "checkpointed runs" in md
