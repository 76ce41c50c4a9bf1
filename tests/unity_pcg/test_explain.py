"""`unity-pcg explain`: the tables agree with the cost model edge by edge, the paper's Figure 2 volume,
model-parallel collectives, rule sequences, pipeline stages, the DOT drawing and the CLI's errors."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg import plan as P
from unity_pcg.cli import main as cli
from unity_pcg.errors import PlanError
from unity_pcg.explanation import describe_steps, device_ranges, explain, format_text, to_dot
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG


def _mlp(b=64, ci=784, h=512, co=10) -> PCG:
    """Figure 2's 2-layer MLP (no biases)."""
    g = PCG.builder()
    x = g.add("Input", {"name": "x", "shape": (b, ci)})
    w1 = g.add("Weight", {"name": "w1", "shape": (ci, h)})
    w2 = g.add("Weight", {"name": "w2", "shape": (h, co)})
    y = g.add("Linear", {"activation": "relu"}, [x, w1], name="fc1")
    z = g.add("Linear", {}, [y, w2], name="fc2")
    g.set_outputs([z])
    return g.finish()


def _megatron(b=8, h=16, f=32, d=2) -> PCG:
    """Column-parallel then row-parallel Linear pair, partial sums all-reduced."""
    g = PCG.builder()
    x = g.add("Input", {"name": "x", "shape": (b, h)})
    w1 = g.add("Weight", {"name": "w1", "shape": (h, f)})
    w2 = g.add("Weight", {"name": "w2", "shape": (f, h)})
    xr = g.add("Replicate", {"degree": d}, [x], name="x/replicate")
    w1p = g.add("Partition", {"dim": 1, "degree": d}, [w1], name="w1/column")
    w2p = g.add("Partition", {"dim": 0, "degree": d}, [w2], name="w2/row")
    y = g.add("Linear", {"activation": "relu"}, [xr, w1p], name="fc1")
    z = g.add("Linear", {}, [y, w2p], name="fc2")
    out = g.add("AllReduce", {"degree": d}, [z], name="fc2/allreduce")
    g.set_outputs([out])
    return g.finish()


def _plan(tmp_path, g: PCG, machine="summit:1x6", **kw) -> P.Plan:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in model bytes")
    m = parse_machine(machine)
    r = MachineMapper(CostModel(m)).optimize(g)
    assert r.feasible
    return P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json(), **kw)


def _saved(tmp_path, pl: P.Plan) -> str:
    path = str(tmp_path / "plan.json")
    pl.save(path)
    return path


def test_figure2_data_parallel_volume_and_rows(tmp_path):
    """Data parallel on 2 devices: the gradient all-reduces move 2(c_i*h + h*c_o) elements, one row per
    weight with its own ring volume; every row adds up to the re-priced plan's total."""
    pl = _plan(tmp_path, data_parallel(_mlp(), 2))
    e = explain(pl)
    assert {r.weight for r in e.grad_sync} == {"w1", "w2"}
    for r in e.grad_sync:
        n = {"w1": 784 * 512, "w2": 512 * 10}[r.weight]
        assert (r.groups, r.group_size, r.elements) == (1, 2, 2 * (2 - 1) * n)
        assert r.time_s > 0 and len(r.devices) == 2
    assert e.totals["grad_sync_elements"] == 2 * (784 * 512 + 512 * 10) == 813_056
    again = MachineMapper(CostModel(pl.machine)).evaluate(pl.pcg, pl.views)
    assert e.totals["comm_elements"] == again.breakdown.comm_elements
    assert e.totals["activation_comm_elements"] + e.totals["grad_sync_elements"] == e.totals["comm_elements"]
    # no activation moves, except gathering the 64x10 output where the strategy combines it (one
    # 32x10 piece moves, forward and backward)
    assert [(c.op, c.collective, c.elements) for c in e.comm] in ([], [("Combine", "gather", 2 * 32 * 10)])
    # one row per non-source node, degrees read off the shapes
    rows = {r.name: r for r in e.operators}
    assert len(e.operators) == sum(1 for n in pl.pcg.nodes() if n.kind != "source")
    assert rows["fc1"].shard == (2, 1) and rows["fc1"].copy_degree == 1 and len(rows["fc1"].devices) == 2
    assert rows["w1/replicate"].copy_degree == 2 and rows["w1/replicate"].kind == "parallel"
    assert rows["fc1"].view == pl.views[rows["fc1"].id]


def test_model_parallel_pair_has_allreduce_and_no_gradient_sync(tmp_path):
    pl = _plan(tmp_path, _megatron())
    e = explain(pl)
    assert e.grad_sync == ()                      # both weights are sharded, none is replicated
    rows = {r.name: r for r in e.operators}
    assert rows["fc2"].sum_degree == 2 and rows["fc1"].shard == (1, 2)
    ar = [c for c in e.comm if c.op == "AllReduce"]
    assert len(ar) == 1 and ar[0].collective == "all-reduce"
    # ring all-reduce of the 8x16 output over 2 devices, forward and backward
    assert ar[0].elements == 2 * (2 * (2 - 1) * 8 * 16) and len(ar[0].devices) == 2
    assert sum(c.elements for c in e.comm) == e.totals["comm_elements"]
    text = format_text(e)
    assert "all-reduce" in text and "gradient all-reduces: none" in text


def test_rule_sequence_in_words(tmp_path):
    from unity_pcg.substitutions.cache import load
    rule = next(r for r in load() if r.is_parallel and "$k0" in r.source.expr(0) and "$d0" in r.source.expr(0))
    steps = [{"rule": rule.name, "nodes": [3, 4], "inputs": {"x0": [1, 0]}, "bind": {"k0": 2, "d0": -1}}]
    pl = _plan(tmp_path, data_parallel(_mlp(8, 16, 16, 4), 2), rules=tuple(steps))
    back = P.load(_saved(tmp_path, pl))
    e = explain(back)
    assert e.rules_recorded and len(e.rules) == 1
    # the rule's own patterns, with the bound degree and dim put in
    src = rule.source.expr(0).replace("$k0", "2").replace("$d0", "-1")
    dst = rule.target.expr(0).replace("$k0", "2").replace("$d0", "-1")
    assert e.rules[0] == f"1. {rule.name}: rewrites {src} into {dst} at nodes 3, 4"
    assert "rules applied (1, in order)" in format_text(e)
    many = explain(P.load(_saved(tmp_path, _plan(tmp_path, data_parallel(_mlp(8, 16, 16, 4), 2),
                                                 info={"rules": steps * 5}))))
    text = format_text(many, limit=2)
    assert text.count(rule.name) == 2 and "... 3 more steps" in text
    assert "rules applied: none recorded" in format_text(explain(_plan(tmp_path, _megatron())))
    assert describe_steps(["no_such_rule"]) == ["1. no_such_rule"]
    assert describe_steps([{"rule": "no_such_rule", "nodes": [1], "bind": {"k": 2}}]) == \
        ["1. no_such_rule at nodes 1 with k=2"]


def test_plan_from_the_joint_search(tmp_path):
    """A plan written by search.optimize: its recorded rule steps are told in words, in order, and
    its rows add up to the search's own prediction of communication.  (A batch large enough that a
    parallel plan reached by rules wins: on a tiny one the one-device graph, no rules, is fastest.)"""
    from unity_pcg.search.optimize import optimize
    res = optimize(_mlp(4096, 256, 256, 256), "summit:1x2", budget_s=6, max_candidates=5, optimizer="sgd")
    path = tmp_path / "opt.json"
    res.plan.save(str(path))
    e = explain(P.load(str(path)))
    assert e.rules_recorded and len(e.rules) == len(res.steps) >= 1
    for words, st in zip(e.rules, res.steps):
        assert st.to_json()["rule"] in words and " into " in words
    assert e.totals["optimizer"] == "sgd"
    assert e.to_json()["rule_steps"] == [st.to_json() for st in res.steps]
    assert e.totals["comm_elements"] == res.mapping.breakdown.comm_elements
    assert e.totals["activation_comm_elements"] + e.totals["grad_sync_elements"] == e.totals["comm_elements"]


def test_pipeline_stages_are_shown_and_drawn(tmp_path):
    g = data_parallel(_mlp(8, 16, 16, 4), 2)
    ids = [n.id for n in g.nodes() if n.kind != "source"]
    pipe = {"schedule": "1F1B", "micro_batches": 4,
            "stages": [{"nodes": ids[:3], "devices": [0, 1]}, {"nodes": ids[3:], "devices": [2, 3]}]}
    pl = _plan(tmp_path, g)
    from unity_pcg.machine import MachineView
    views = {i: (MachineView(v.start + 2, v.dims) if i in ids[3:] else v) for i, v in pl.views.items()}
    pl = P.Plan(pl.model_path, pl.model_sha256, pl.machine, g, views, pl.predicted, pipe)
    pred = dict(pl.predicted, pipeline={"stages": [{"fwd_s": 1e-3, "bwd_s": 2e-3, "send_s": 1e-4, "in_flight": 2,
                                                    "memory_bytes": 3 * 2**20}, {"fwd_s": 5e-4}]})
    pl = P.load(_saved(tmp_path, P.Plan(pl.model_path, pl.model_sha256, pl.machine, g, pl.views, pred, pipe)))
    e = explain(pl)
    assert [s.devices for s in e.stages] == [(0, 1), (2, 3)]
    # each stage's operators re-priced: together, every priced leaf of the plan
    assert e.stages[0].leaves_s > 0 and e.stages[1].leaves_s > 0
    assert sum(s.leaves_s for s in e.stages) == pytest.approx(e.totals["sum_of_leaves_s"])
    assert e.stages[0].recorded["in_flight"] == 2 and e.stages[1].recorded == {"fwd_s": 5e-4}
    assert e.stages[0].nodes == tuple(g.node(i).label() for i in ids[:3])
    text = format_text(e)
    assert "schedule 1F1B, 4 micro-batches, 2 stages" in text
    row0 = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert "0-1" in row0 and "1.000 ms" in row0 and "2.000 ms" in row0 and "3.0 MiB" in row0
    dot = to_dot(pl, e)
    assert "cluster_stage0" in dot and "cluster_stage1" in dot
    second = dot[dot.index("cluster_stage1"):dot.index("}", dot.index("cluster_stage1"))]
    assert all(f"n{i} [" in second for i in ids[3:]) and not any(f"n{i} [" in second for i in ids[:3])
    assert e.to_json()["pipeline"]["stages"][1]["devices"] == [2, 3]


def test_pipeline_plan_from_the_stage_search(tmp_path):
    """A plan built from search.pipeline's result: every stage is shown with its devices, its operators
    and the search's per-micro-batch figures; the transfers between stages are point-to-point."""
    from unity_pcg.search.pipeline import search_pipeline
    m = parse_machine("summit:1x4")
    r = search_pipeline(_mlp(8, 16, 16, 4), MachineMapper(CostModel(m, "sgd")), max_stages=2, min_stages=2)
    assert r is not None and r.feasible and r.num_stages == 2
    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in")
    pl = P.Plan(str(model), P.file_sha256(str(model)), m, r.pcg, r.views,
                {"predicted_iteration_s": r.cost, "pipeline": r.to_json()}, r.to_plan_field())
    e = explain(P.load(_saved(tmp_path, pl)))
    assert [s.devices for s in e.stages] == [tuple(st.devices) for st in r.stages]
    assert [s.recorded["fwd_s"] for s in e.stages] == [st.fwd_s for st in r.stages]
    assert "fc1" in e.stages[0].operators and "fc2" in e.stages[1].operators
    assert "fc2" not in e.stages[0].operators and "fc1" not in e.stages[1].operators
    # fc1's output travels from stage 0's devices to stage 1's
    cross = [c for c in e.comm if c.producer_name == "fc1"]
    assert len(cross) == 1 and cross[0].elements > 0
    d0, d1 = set(e.stages[0].devices), set(e.stages[1].devices)
    assert d0 <= set(cross[0].devices) <= d0 | d1 and set(cross[0].devices) & d1
    assert f"{r.micro_batches} micro-batches, 2 stages" in format_text(e)


def test_dot_marks_parallel_operators_and_communication(tmp_path):
    pl = _plan(tmp_path, _megatron())
    e = explain(pl)
    dot = to_dot(pl, e)
    g = pl.pcg
    for n in g.nodes():
        assert f"  n{n.id} [" in dot
    n_edges = sum(len(n.inputs) for n in g.nodes())
    assert sum(1 for line in dot.splitlines() if " -> " in line) == n_edges
    fills = {line.split("[")[0].strip(): line for line in dot.splitlines() if "fillcolor" in line}
    ar = next(n.id for n in g.nodes() if n.op == "AllReduce")
    lin = next(n.id for n in g.nodes() if n.op == "Linear")
    assert "white" not in fills[f"n{ar}"] and "white" in fills[f"n{lin}"]
    red = [line for line in dot.splitlines() if " -> " in line and "penwidth=2" in line]
    assert len(red) == len(e.comm) and any("all-reduce" in line for line in red)
    assert "legend_AllReduce" in dot and 'label="[8, 32/2]"' in dot     # fc1 -> fc2: column-sharded


def test_device_ranges():
    assert device_ranges([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"
    assert device_ranges([5]) == "5" and device_ranges([]) == "-"


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_table_json_and_files(tmp_path, capsys):
    path = _saved(tmp_path, _plan(tmp_path, data_parallel(_mlp(8, 16, 16, 4), 2)))
    dot = tmp_path / "g.dot"
    assert cli(["explain", path, "--dot", str(dot), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "operators" in out and "more operators" in out and "gradient all-reduces (2 weights" in out
    assert dot.read_text().startswith("digraph plan {")
    assert cli(["explain", path, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["files"]["dot"] == str(tmp_path / "plan.dot") and os.path.exists(obj["files"]["dot"])
    assert {"operators", "communication", "gradient_allreduce", "rules", "pipeline", "totals"} <= set(obj)
    assert obj["totals"]["grad_sync_elements"] == 2 * (16 * 16 + 16 * 4)


def test_cli_png_through_graphviz(tmp_path, capsys, monkeypatch):
    """--png pipes the DOT into graphviz `dot -Tpng -o FILE` (a stand-in `dot` records what it got)."""
    path = _saved(tmp_path, _plan(tmp_path, _megatron()))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "dot"
    fake.write_text("#!/bin/sh\n# args: -Tpng -o FILE\n[ \"$1\" = -Tpng ] || exit 3\ncat > \"$3\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    png = tmp_path / "g.png"
    assert cli(["explain", path, "--png", str(png)]) == 0
    assert png.read_text().startswith("digraph plan {") and "legend_AllReduce" in png.read_text()
    assert str(png) in capsys.readouterr().out


def test_cli_default_png_only_for_small_graphs(tmp_path, capsys, monkeypatch):
    """With graphviz present a PNG is drawn by default next to the plan, unless the PCG is large."""
    import unity_pcg.commands.explain_cmd as cmd
    path = _saved(tmp_path, _plan(tmp_path, _megatron()))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "dot"
    fake.write_text("#!/bin/sh\ncat > \"$3\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    assert cli(["explain", path]) == 0
    assert (tmp_path / "plan.png").exists() and "plan.png" in capsys.readouterr().out
    (tmp_path / "plan.png").unlink()
    monkeypatch.setattr(cmd, "AUTO_PNG_NODES", 3)
    assert cli(["explain", path]) == 0
    assert not (tmp_path / "plan.png").exists() and "--png FILE draws it" in capsys.readouterr().out


def test_cli_png_without_graphviz_is_one_line(tmp_path, capsys, monkeypatch):
    path = _saved(tmp_path, _plan(tmp_path, _megatron()))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cli(["explain", path, "--png", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Graphviz" in err and "\n" not in err


@pytest.mark.parametrize("content, msg", [
    (None, "does not exist"),
    ("{not json", "not JSON"),
    ('{"schema": "unity-pcg/plan/v0"}', "unsupported schema"),
])
def test_cli_bad_plan_is_one_line_exit_2(tmp_path, content, msg):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "explain", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_plan_missing_a_view_is_refused(tmp_path):
    pl = _plan(tmp_path, _megatron())
    lin = next(n.id for n in pl.pcg.nodes() if n.op == "Linear")
    views = {k: v for k, v in pl.views.items() if k != lin}
    bad = P.Plan(pl.model_path, pl.model_sha256, pl.machine, pl.pcg, views, pl.predicted)
    with pytest.raises(PlanError, match="no machine view for node fc1"):
        explain(bad)
