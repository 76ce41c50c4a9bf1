"""benchmarks/fig14.py: which baselines apply, the task order, and the report's arithmetic (speedup over
the best *feasible* baseline, joint over sequential) from synthetic rows -- no search is run."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def fig14():
    spec = importlib.util.spec_from_file_location("fig14", os.path.join(ROOT, "benchmarks", "fig14.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_baselines_per_model(fig14):
    assert fig14.baselines_for("bert_large") == ["dp", "megatron"]
    for m in ("dlrm", "xdl", "candle_uno"):
        assert fig14.baselines_for(m) == ["dp", "expert"]
    for m in ("mlp", "resnext50", "inception_v3"):
        assert fig14.baselines_for(m) == ["dp"]
    assert fig14.machine_for(192) == "summit:32x6" and fig14.machine_for(1024) == "h100:128x8"


def test_tasks_cover_matrix_once_largest_scale_first(fig14):
    tasks = fig14.tasks_for(("bert_large", "dlrm", "mlp"), (6, 12, 48), 5.0, 3, True, {48})
    keys = [(t["model"], t["machine"], t["strategy"]) for t in tasks]
    assert len(keys) == len(set(keys))
    assert all(t["budget"] == 5.0 and t["max_candidates"] == 3 for t in tasks)
    assert tasks[0]["devices"] == 48
    # every (model, D) has its baselines and unity; sequential only at 48
    for m in ("bert_large", "dlrm", "mlp"):
        for d in (6, 12, 48):
            strategies = {s for (mm, mach, s) in keys if mm == m and mach == fig14.machine_for(d)}
            assert strategies == (set(fig14.baselines_for(m)) | {"unity", "unity-nopipe"}
                                  | ({"sequential"} if d == 48 else set()))
    assert ("densenet121", "summit:32x6", "unity") in keys
    assert ("bert_large", "h100:128x8", "megatron") in keys
    last48 = max(i for i, t in enumerate(tasks) if t["devices"] == 48)
    first6 = min(i for i, t in enumerate(tasks) if t["devices"] == 6)
    assert last48 < first6                           # the largest scale and its sequential rows first
    tasks = fig14.tasks_for(("mlp",), (6, 12, 48), 5.0, 3, False, {12}, searches=("unity",))
    assert [(t["devices"], t["strategy"]) for t in tasks][:4] == [(48, "dp"), (48, "unity"), (12, "dp"), (12, "unity")]
    assert tasks[4]["strategy"] == "sequential" and tasks[4]["devices"] == 12
    # --extras-only: DenseNet-121 at 192 GPUs and the models at 1,024 GPUs, nothing else
    tasks = fig14.tasks_for(("mlp", "dlrm"), (), 5.0, 3, True, set(), searches=("unity",), extras_only=True)
    assert {(t["model"], t["devices"]) for t in tasks} == {("densenet121", 192), ("mlp", 1024), ("dlrm", 1024)}
    assert {t["strategy"] for t in tasks if t["model"] == "dlrm"} == {"dp", "expert", "unity"}


def _row(model, D, strategy, t, feasible=True, **kw):
    batch = 100 * D
    return dict({"model": model, "devices": D, "machine": f"summit:{D // 6}x6", "strategy": strategy,
                 "batch": batch, "feasible": feasible, "predicted_iteration_s": t if feasible else None,
                 "throughput_samples_s": batch / t if feasible else None, "reason": "" if feasible else
                 "does not fit in device memory"}, **kw)


def test_report_speedup_over_best_feasible_baseline(fig14, tmp_path):
    rows = [_row("dlrm", 6, "dp", 0.5, feasible=False), _row("dlrm", 6, "expert", 2.0),
            _row("dlrm", 6, "unity", 0.5, search_s=3.0), _row("dlrm", 6, "sequential", 1.0, search_s=2.0),
            _row("dlrm", 6, "unity-nopipe", 0.8, search_s=3.0),
            _row("bert_large", 6, "dp", 1.0), _row("bert_large", 6, "megatron", 0.8),
            _row("bert_large", 6, "unity", 1.0, search_s=1.0)]
    lines = {(x["model"], x["devices"]): x for x in fig14.summarize(rows)}
    d = lines[("dlrm", 6)]
    assert d["best_baseline"] == "expert"            # dp is faster but does not fit
    assert d["speedup"] == pytest.approx(4.0)
    assert d["joint_over_sequential"] == pytest.approx(2.0)
    assert d["nopipe_speedup"] == pytest.approx(2.5) and d["nopipe_over_sequential"] == pytest.approx(1.25)
    b = lines[("bert_large", 6)]
    assert b["best_baseline"] == "megatron" and b["speedup"] == pytest.approx(0.8)
    assert b["joint_over_sequential"] is None
    p = tmp_path / "f.json"
    p.write_text(json.dumps({"meta": {}, "rows": rows}))
    text = fig14.report(str(p), str(tmp_path / "f.md"))
    dl = next(x for x in text.splitlines() if x.startswith("| dlrm | 6 |"))
    assert "OOM" in dl and "4.00x" in dl and "expert" in dl
    assert (tmp_path / "f.md").read_text() == text


def test_a_merged_files_report_names_each_merged_run(fig14, tmp_path):
    """A file written by --merge alone has no run of its own: the report names each merged file's command, commit
    and start (not '?')."""
    rows = [_row("dlrm", 6, "dp", 0.5), _row("dlrm", 6, "unity", 0.4, search_s=3.0)]
    merged = [{"command": "fig14.py --devices 6 --out a.json", "git": "abc1234", "started": "T1", "rows": 1,
               "budget_s": 50.0, "budget_large_s": 100.0, "max_candidates": 40, "cpus": 2, "loadavg": "1 1 1"},
              {"command": "fig14.py --devices 12 --out b.json", "git": "def5678", "started": "T2", "rows": 1}]
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"meta": {"merged": merged}, "rows": rows}))
    text = fig14.report(str(p), str(tmp_path / "m.md"))
    line = next(x for x in text.splitlines() if x.startswith("Merged from 2 file(s)"))
    assert "--devices 6 --out a.json" in line and "abc1234" in line and "def5678" in line and "T2" in line
    assert "search budget 50.0 s" in line
