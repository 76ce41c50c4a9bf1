"""Plan file: JSON round trip and validation on load (a plan from a stranger is checked data)."""
from __future__ import annotations

import json

import pytest

from unity_pcg.search.baselines import data_parallel
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg import plan as P
from unity_pcg.errors import PlanError
from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG


def _mlp() -> PCG:
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (8, 16)})
    h = x
    for i in range(3):
        w = b.add("Weight", {"name": f"w{i}", "shape": (16, 16)})
        h = b.add("Linear", {"activation": "relu"}, [h, w])
    b.set_outputs([h])
    return b.finish()


@pytest.fixture()
def made(tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"stand-in model bytes")
    m = parse_machine("summit:1x6")
    g = data_parallel(_mlp(), 2)
    r = MachineMapper(CostModel(m)).optimize(g)
    pl = P.Plan(str(model), P.file_sha256(str(model)), m, g, r.views, r.to_json())
    path = tmp_path / "plan.json"
    pl.save(str(path))
    return pl, path, model


def test_round_trip(made):
    pl, path, model = made
    back = P.load(str(path))
    assert back.pcg.structural_hash() == pl.pcg.structural_hash()
    assert back.views == dict(pl.views)
    assert back.machine == pl.machine
    assert back.predicted["predicted_iteration_s"] == pl.predicted["predicted_iteration_s"]
    back.check_model()
    assert json.loads(path.read_text())["schema"] == P.SCHEMA


def _tamper(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("what, fn, msg", [
    ("schema", lambda o: o.update(schema="unity-pcg/plan/v0"), "unsupported schema"),
    ("no machine", lambda o: o.pop("machine"), "missing field machine"),
    ("bad sha", lambda o: o["model"].update(sha256="xyz"), "sha256"),
    ("bad degree", lambda o: next(n for n in o["pcg"]["nodes"] if n["op"] == "Partition")["attrs"].update(degree=3),
     "does not divide"),
    ("view outside machine", lambda o: next(iter(o["views"].values())).update(start=100), "outside"),
    ("unknown op", lambda o: o["pcg"]["nodes"][-1].update(op="Frobnicate"), "Frobnicate"),
])
def test_tampered_plans_are_refused(made, what, fn, msg):
    _, path, _ = made
    _tamper(path, fn)
    with pytest.raises(PlanError, match=msg) as e:
        P.load(str(path))
    assert "\n" not in str(e.value)


def test_view_with_wrong_task_count_is_refused(made):
    pl, path, _ = made
    lin = next(n.id for n in pl.pcg.nodes() if n.op == "Linear")
    _tamper(path, lambda o: o["views"].update({str(lin): {"start": 0, "dims": [[3, 1]]}}))
    with pytest.raises(PlanError, match="tasks"):
        P.load(str(path))


def test_changed_model_is_detected(made):
    _, path, model = made
    model.write_bytes(b"another model")
    with pytest.raises(PlanError, match="sha256"):
        P.load(str(path)).check_model()


def test_not_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        P.load(str(p))


def _linears(pl) -> list[int]:
    return [n.id for n in pl.pcg.nodes() if n.op == "Linear"]


def test_memory_field_round_trips(made, tmp_path):
    pl, _, _ = made
    lin = _linears(pl)
    mem = P.MemoryPlan(zero=2, offload=True, recompute=(P.RecomputeRegion(tuple(lin[:2]), "selective"),))
    p2 = tmp_path / "mem.json"
    P.Plan(pl.model_path, pl.model_sha256, pl.machine, pl.pcg, pl.views, pl.predicted, memory=mem).save(str(p2))
    back = P.load(str(p2))
    assert back.memory == mem
    # no technique: no field, loads as None
    assert "memory" not in json.loads((tmp_path / "plan.json").read_text())
    assert P.load(str(tmp_path / "plan.json")).memory is None


@pytest.mark.parametrize("memory, msg", [
    ({"zero": 4}, "ZeRO stage"),
    ({"offload": "yes"}, "true or false"),
    ({"recompute": [{"nodes": [], "mode": "full"}]}, "non-empty"),
    ({"recompute": [{"nodes": ["a"]}]}, "node ids"),
    ({"recompute": [{"nodes": "LIN", "mode": "partial"}]}, "mode must be one of"),
    ({"recompute": [{"nodes": "LIN"}, {"nodes": "LIN"}]}, "two recompute regions"),
    ({"recompute": [{"nodes": [99999]}]}, "not a compute node"),
])
def test_bad_memory_field_is_refused(made, memory, msg):
    pl, path, _ = made
    lin = _linears(pl)
    for r in memory.get("recompute", []):
        if r["nodes"] == "LIN":
            r["nodes"] = lin[:1]
    _tamper(path, lambda o: o.update(memory=memory))
    with pytest.raises(PlanError, match=msg) as e:
        P.load(str(path))
    assert "\n" not in str(e.value)
