"""Stages laid out by the layout ILP in Unity's pipeline search (search/pipeline.py ``ilp_intra``, the
``layouts`` and ``clusterings`` choices of ``search_pipeline``), tested by outcome: on the zoo's small MLP and
CANDLE-Uno the search finds a plan at least as fast as Alpa's planner (the same ILP inside the stages, its
own stage DP) on the same machine in the same cost model; where data parallelism inside the stages is slow
the stage layouts the DP picks are the ILP's; the plan stitches into one PCG the executor accepts, and
(slow) trains as one process does."""
from __future__ import annotations

import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.pipeline import ilp_intra, search_pipeline

from .test_pipeline import _chain


@pytest.fixture(scope="module")
def zoo_small(tmp_path_factory):
    """The zoo's tiny MLP and CANDLE-Uno, exported at batch 32 (no weights needed to plan)."""
    pytest.importorskip("torch")
    from unity_pcg import zoo
    out = {}
    d = tmp_path_factory.mktemp("zoo")
    for name in ("mlp", "candle_uno"):
        p = d / f"{name}.onnx"
        zoo.export(name, str(p), size="tiny", batch=32)
        out[name] = str(p)
    return out


def _search(g, m, mapper, **kw):
    return search_pipeline(g, mapper, min_stages=1, layouts=(ilp_intra(m, optimizer="sgd"),),
                           clusterings=("fewest", "valid"), **kw)


@pytest.mark.parametrize("name", ["mlp", "candle_uno"])
def test_pipeline_with_ilp_stages_is_at_least_alpas_plan(zoo_small, name):
    """Alpa's planner (its operator clustering, sub-mesh shapes, stage DP and the intra-operator ILP per
    stage) and Unity's pipeline search with ILP stages, both at 2 micro-batches on 2 x 2 Summit GPUs, both
    priced by the same cost model: Unity's plan is no slower."""
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.alpa.inter import alpa_plan
    g = load_onnx(zoo_small[name], load_weights=False)
    m = parse_machine("summit:2x2")
    mapper = MachineMapper(CostModel(m, "sgd"))
    alpa = alpa_plan(g, m, optimizer="sgd", layers=4, micro_batches=2, mapper=mapper, stage_cost="layer_sum")
    ours = _search(g, m, mapper, micro_batches=2)
    assert alpa.feasible and ours.feasible and ours.pcg is not None
    assert ours.cost <= alpa.cost * (1 + 1e-9), (ours.cost, alpa.cost, ours.stats.get("stage_layouts"))


def test_the_stage_dp_picks_ilp_layouts_where_data_parallel_stages_are_slow():
    """Wide layers and a small batch: data parallelism inside a stage all-reduces every weight, the ILP's
    layout splits them.  The search with the ILP's layouts is faster than without, names them per stage, and
    its plan stitches into one PCG whose stages cover the machine."""
    from unity_pcg.plan import validate_pipeline_field
    g = _chain(8, [2048, 4096, 4096, 4096, 4096, 2048])
    m = parse_machine("summit:2x4")
    mapper = MachineMapper(CostModel(m, "sgd"))
    plain = search_pipeline(g, mapper, micro_batches=2, max_stages=2)
    ilp = _search(g, m, mapper, micro_batches=2, max_stages=2)
    assert plain.feasible and ilp.feasible
    assert ilp.cost < plain.cost * 0.99
    layouts = ilp.stats["stage_layouts"]
    assert len(layouts) == ilp.num_stages and any(x.startswith("ILP") for x in layouts)
    assert ilp.origin["layouts"] and "ilp" in ilp.origin["layouts"]
    assert not ilp.origin["dp_inside"]
    validate_pipeline_field(ilp.to_plan_field(), ilp.pcg, ilp.views, m)
    assert sorted(d for st in ilp.stages for d in st.devices) == list(range(m.num_devices))


def test_accept_refusing_the_fastest_plan_returns_the_next():
    """``accept`` (the caller's check, e.g. the executor's) refuses the fastest stitched plan: the search
    returns the fastest one it accepts and records the refusal."""
    g = _chain(8, [2048, 4096, 4096, 4096, 4096, 2048])
    m = parse_machine("summit:2x4")
    mapper = MachineMapper(CostModel(m, "sgd"))
    best = _search(g, m, mapper, micro_batches=2, max_stages=2)
    key = best.to_plan_field()["stages"]

    def accept(r):
        return "refused by the test" if r.to_plan_field()["stages"] == key else None
    nxt = _search(g, m, mapper, micro_batches=2, max_stages=2, accept=accept)
    assert nxt.feasible and nxt.to_plan_field()["stages"] != key
    assert nxt.cost >= best.cost and math.isfinite(nxt.cost)
    assert any("refused by the test" in x for x in nxt.stats["refused"])


@pytest.mark.slow
def test_ilp_stages_train_like_one_process(tmp_path, capfd):
    """Two stages laid out by the layout ILP on 2 devices each (local:1x4, 2 micro-batches): the executor
    accepts the plan (search/runnable.py) and it trains 5 steps to the losses and weights of one process
    (gloo, rtol 1e-4)."""
    from unity_pcg import plan as P
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import GraphCost
    from unity_pcg.search.pipeline import evaluate_pipeline, sequential_layers
    from unity_pcg.search.runnable import executor_refusal
    from tests.executor.runtime_plans import _save, tiny_mlp_onnx
    from tests.executor.test_pipeline_megatron import _assert_same, _train
    import numpy as np
    model = tiny_mlp_onnx(str(tmp_path / "mlp.onnx"), batch=8, dims=(16, 32, 32, 32, 8))
    g = load_onnx(model, load_weights=False)
    m = parse_machine("local:1x4")
    cm = CostModel(m, "adam")
    L = len(sequential_layers(g, GraphCost(g, cm).role, 12)[0])
    cut = max(1, L // 2)
    res = evaluate_pipeline(g, cm, [(0, cut, 0, 2), (cut, L, 2, 2)], 2,
                           intra=ilp_intra(m, optimizer="adam", idle=False))     # every operator on the mesh
    assert res.feasible and res.pcg is not None
    assert any(n.kind == "parallel" for n in res.pcg.nodes())
    pp = _save(res.pcg, res.views, model, str(tmp_path / "pp.json"), m, pipeline=res.to_plan_field(),
               predicted=res.to_json())
    why = executor_refusal(P.load(pp))
    if why is not None:
        pytest.skip(f"the executor refuses the ILP-laid-out pipeline: {why}")
    rng = np.random.default_rng(2)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 16)).astype(np.float32), targets=rng.integers(0, 8, 8))
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "adam", str(data))
    assert got["nproc"] == 4 and got["pipeline"]
    _assert_same(got, ref, saved, ref_w)
