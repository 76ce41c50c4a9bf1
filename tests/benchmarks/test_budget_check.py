"""benchmarks/budget_check.py's report names the memory techniques its data-parallel floor column includes."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("budget_check", os.path.join(ROOT, "benchmarks", "budget_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_names_the_dp_floors_techniques():
    B = _load()
    assert B.techniques({"zero": 3, "offload": False, "recompute_regions": 0}) == "ZeRO-3"
    assert B.techniques({"zero": 0, "offload": False, "recompute_regions": 0}) == "plain"
    assert B.techniques({"zero": 1, "offload": True, "recompute_regions": 2}) == "ZeRO-1, offload, 2 recomputed regions"
    assert B.techniques(None) == "-"
    row = {"row": "dlrm-1024", "machine": "h100:128x8", "batch": 8, "budget_s": 100.0, "wall_s": 1.0,
           "wall_over_budget": 0.01, "search_s": 1.0, "predicted_iteration_s": 0.044,
           "data_parallel_iteration_s": 0.16, "data_parallel_memory_plan": {"zero": 3, "offload": False,
                                                                           "recompute_regions": 0},
           "chosen": "x", "load_1min": 1.0}
    md = B.report([row], {})
    assert "| dp floor s | dp techniques |" in md and "| 0.160 | ZeRO-3 | x |" in md
