"""Pipelines with tensor (Megatron) parallelism inside the stages: plans of the pipeline search with its
``megatron_intra`` hook (search/pipeline.py), run by the executor with every stage lowered on its devices
(executor/pipeline.py PipelineTrainer), train as one process does: losses of 5 steps and final weights
(rtol 1e-4) against the one-process Trainer of the same ONNX model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from unity_pcg import plan as P
from unity_pcg.executor import checkpoint as C
from unity_pcg.executor.pipeline import PipelineError, check_pipeline, resolve, stage_graphs


def megatron_pipeline_plan(model: str, out: str, cut: int | None, devices: int = 4, size: int = 2,
                           micro_batches: int = 2) -> str:
    """The pipeline search's plan for ``devices // size`` stages of ``size`` devices (local:1xDEVICES),
    the first ``cut`` layers in stage 0, Megatron inside the stages (search.pipeline.megatron_intra)."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.pipeline import evaluate_pipeline, megatron_intra, sequential_layers
    from tests.executor.runtime_plans import _save
    g = load_onnx(model, load_weights=False)
    m = parse_machine(f"local:1x{devices}")
    cm = CostModel(m)
    layers, _ = sequential_layers(g, GraphCost(g, cm).role, 12)
    L = len(layers)
    stages = [(0, L, 0, size)] if cut is None else [(0, cut, 0, size), (cut, L, size, size)]
    res = evaluate_pipeline(g, cm, stages, micro_batches, intra=megatron_intra(size))
    assert res.feasible
    return _save(res.pcg, res.views, model, out, m, pipeline=res.to_plan_field(), predicted=res.to_json())


def two_pair_mlp() -> str:
    """Two Megatron MLP pairs (bias-free Linear -> ReLU -> bias-free Linear), one per pipeline stage."""
    import torch

    from tests.executor import dist_helpers as H

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16, bias=False)
            self.b = torch.nn.Linear(16, 8, bias=False)
            self.c = torch.nn.Linear(8, 16, bias=False)
            self.d = torch.nn.Linear(16, 8, bias=False)

        def forward(self, x):
            return self.d(torch.relu(self.c(self.b(torch.relu(self.a(x))))))
    torch.manual_seed(1)
    return H.export(M(), (torch.randn(8, 8),), "two_pair_mlp", ["x"])


def _train(plan: str, model: str, tmp, capfd, optimizer: str, data: str | None = None, seed: int = 3):
    """5 steps with ``unity-pcg run`` (checkpointing) and with the one-process Trainer: both results."""
    from unity_pcg.cli import main
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.train import Trainer
    from tests.executor.runtime_plans import one_device_plan
    ck = tmp / "ck"
    capfd.readouterr()
    rc = main(["run", plan, "--model", model, "--steps", "5", "--optimizer", optimizer, "--lr", "0.02",
               "--seed", str(seed), "--checkpoint", str(ck), "--json"] + (["--data", data] if data else ["--loss", "mean"]))
    out, err = capfd.readouterr()
    assert rc == 0, err
    got = json.loads(out)
    one = P.load(one_device_plan(model, str(tmp / "one.json")))
    t = Trainer(one, model, rank=0, world=1, seed=seed, optimizer=optimizer, lr=0.02)
    src = open_data(one.pcg, data, seed=seed)
    ref = [t.step(*src.feeds(s)) for s in range(5)]
    return got, ref, C.read_model(str(ck)), t.model_state()


def _assert_same(got, ref, saved, ref_w):
    np.testing.assert_allclose(got["losses"], ref, rtol=1e-4, atol=1e-7)
    assert sorted(saved) == sorted(ref_w)
    for k, v in ref_w.items():
        np.testing.assert_allclose(saved[k].numpy(), v.numpy(), rtol=1e-4, atol=1e-6, err_msg=k)


def test_two_megatron_stages_train_like_one_process(tmp_path, capfd):
    """2 stages x 2-way Megatron (a column -> row pair per stage, its partial sums all-reduced inside the
    stage) on 4 processes, 2 micro-batches, MSE against targets (the loss is computed on the last stage's
    all-reduced copies), Adam: 4 pipelines, each carrying whole micro-batches."""
    model = two_pair_mlp()
    pp = megatron_pipeline_plan(model, str(tmp_path / "pp.json"), cut=3)
    pl = P.load(pp)
    M, stages = resolve(pl)
    assert [st.devices for st in stages] == [(0, 1), (2, 3)]
    for st in stages:     # each stage holds a Megatron pair: a row-parallel Linear whose sums are all-reduced
        assert any(pl.pcg.node(n).op == "AllReduce" for n in st.nodes)
    _train_mse_on_4_like_one_process(pp, model, tmp_path, capfd, seed=1)


def _train_mse_on_4_like_one_process(pp: str, model: str, tmp_path, capfd, seed: int) -> None:
    """Train plan ``pp`` of the two-pair MLP on seeded [8, 8] inputs and MSE targets with Adam on 4 processes:
    losses and weights equal one process's."""
    rng = np.random.default_rng(seed)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 8)).astype(np.float32),
             targets=rng.standard_normal((8, 8)).astype(np.float32))
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "adam", str(data))
    assert got["nproc"] == 4 and got["pipeline"]
    _assert_same(got, ref, saved, ref_w)


def _ruled_plan(model: str, devices: int, stages, tp: int, out: str, rule: str):
    """The hand-built Megatron pipeline plan (megatron_intra(tp)) reached by rules (pipeline.by_rules), using
    ``rule``, its sequence replayed on a fresh import to the plan's PCG, written with its rules to ``out``."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import by_rules, evaluate_pipeline, megatron_intra
    from unity_pcg.search.substitution import RuleStep, replay
    g = load_onnx(model, load_weights=False)
    m = parse_machine(f"local:1x{devices}")
    hand = evaluate_pipeline(g, CostModel(m), stages, 2, intra=megatron_intra(tp))
    assert hand.feasible
    ruled = by_rules(g, hand, m)
    assert ruled is not None and rule in {s.rule for s in ruled.rules}
    assert ruled.cost == hand.cost
    steps = [RuleStep.from_json(s.to_json()) for s in ruled.rules]
    assert replay(load_onnx(model, load_weights=False), steps, trim_outputs=True).structural_hash() == \
        ruled.pcg.structural_hash()
    P.Plan(model, P.file_sha256(model), m, ruled.pcg, ruled.views, ruled.to_json(), ruled.to_plan_field(),
           rules=tuple(s.to_json() for s in ruled.rules)).save(out)
    pl = P.load(out)
    assert any(n.op == "AllReduce" for n in pl.pcg.nodes())
    return out


@pytest.mark.slow
def test_data_by_tensor_parallel_stages_reached_by_rules_train_like_one_process(tmp_path, capfd):
    """The tiny GPT on 4 devices as one stage data parallel 2 x tensor parallel 2 (megatron_intra(2)) and as
    two stages of 2 x 2 on 8 devices, each plan's PCG reached by rules (pipeline.by_rules: realize, the two
    copies of each weight merged by ``replicate_merge``), written with its rule sequence and run under
    ``unity-pcg run``: losses and weights of 5 steps equal one process (SGD)."""
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.pipeline import sequential_layers
    model = str(tmp_path / "gpt.onnx")
    zoo.export("gpt_350m", model, size="tiny", batch=4)
    g = load_onnx(model, load_weights=False)
    for devices in (4, 8):
        m = parse_machine(f"local:1x{devices}")
        L = len(sequential_layers(g, GraphCost(g, CostModel(m)).role, 12)[0])
        stages = [(0, L, 0, 4)] if devices == 4 else [(0, L // 2, 0, 4), (L // 2, L, 4, 4)]
        pp = _ruled_plan(model, devices, stages, 2, str(tmp_path / f"ruled{devices}.json"), "replicate_merge")
        (tmp_path / str(devices)).mkdir()
        got, ref, saved, ref_w = _train(pp, model, tmp_path / str(devices), capfd, "sgd")
        assert got["nproc"] == devices
        _assert_same(got, ref, saved, ref_w)


@pytest.mark.slow
def test_two_pairs_data_by_tensor_parallel_reached_by_rules_train_like_one_process(tmp_path, capfd):
    """The two-pair MLP as one stage data parallel 2 x tensor parallel 2 on 4 devices: reached by rules (the
    dp rule's gather before the first pair's AllReduce sunk and cancelled, ``combine_sink_AllReduce``; the
    output's partial sums all-reduced for the loss), written with its rule sequence and run under ``unity-pcg
    run``: losses and weights of 5 steps (MSE against targets, Adam) equal one process."""
    model = two_pair_mlp()
    pp = _ruled_plan(model, 4, [(0, 6, 0, 4)], 2, str(tmp_path / "ruled.json"), "combine_sink_AllReduce")
    pl = P.load(pp)
    assert not any(n.op == "Combine" for n in pl.pcg.nodes())
    assert pl.pcg.node(pl.pcg.outputs[0][0]).op == "AllReduce"
    _train_mse_on_4_like_one_process(pp, model, tmp_path, capfd, seed=2)


def test_vocabulary_parallel_head_and_split_boundary(tmp_path, capfd):
    """A Linear MLP whose stage outputs are column-parallel (Megatron's vocabulary-parallel head, output
    split on the features): stage 0 sends its split output whole (an all-gather inside the stage, whose
    backward reduce-scatters the two devices' gradient shares), stage 1 ends split and cross-entropy reads
    whole class rows (gathered for the loss).  Losses and weights equal one process (Adam)."""
    from tests.executor.runtime_plans import tiny_mlp_onnx
    model = tiny_mlp_onnx(str(tmp_path / "mlp.onnx"), batch=8, dims=(16, 32, 32, 32, 8))
    pp = megatron_pipeline_plan(model, str(tmp_path / "pp.json"), cut=3)
    pl = P.load(pp)
    M, stages = resolve(pl)
    sg = stage_graphs(pl, M, stages)
    kinds = [k for k, _ in sg[0].sends]
    assert kinds == ["out"] and sg[0].pcg.shape(sg[0].sends[0][1]).copy_degree == 2
    split = [n for n in pl.pcg.nodes() if n.op == "Linear" and pl.pcg.shapes(n.id)[0].degrees[-1] == 2]
    assert len(split) == 2        # both heads column-parallel, output left split
    rng = np.random.default_rng(2)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 16)).astype(np.float32), targets=rng.integers(0, 8, 8))
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "adam", str(data))
    _assert_same(got, ref, saved, ref_w)


def test_one_megatron_stage_with_micro_batches_and_dropout(tmp_path, capfd):
    """One stage of 2 devices (Megatron pair with Dropout between its Linears) and 2 micro-batches (gradient
    accumulation with tensor parallelism): each micro-batch's Dropout mask is that of its rows in the whole
    batch, so losses and weights equal one process's."""
    from tests.executor.models import dropout_mlp
    from unity_pcg.evaluate import evaluate
    from unity_pcg.executor.data import open_data
    from unity_pcg.onnx_import import load_onnx
    model = dropout_mlp()
    pp = megatron_pipeline_plan(model, str(tmp_path / "pp.json"), cut=None, devices=2, size=2)
    pl = P.load(pp)
    drop = next(n for n in pl.pcg.nodes() if n.op == "Dropout")
    assert pl.pcg.shapes(drop.id)[0].degrees[-1] == 2      # inside the tensor-parallel region
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "sgd", seed=5)
    _assert_same(got, ref, saved, ref_w)
    # dropout is active: inference semantics (Dropout = identity) give another first loss
    src = open_data(load_onnx(model), None, seed=5)
    assert abs(float(np.mean(evaluate(load_onnx(model), src.feeds(0)[0])[0])) - got["losses"][0]) > 1e-4


@pytest.mark.slow
def test_megatron_transformer_stages_train_like_one_process(tmp_path, capfd):
    """The zoo's tiny GPT (2 Transformer blocks) in 2 stages x 2-way Megatron: attention heads, the MLP pair
    and the vocabulary-parallel head split inside the stages.  SGD: the key projection's bias has a zero
    gradient in exact arithmetic (softmax is shift-invariant), which Adam turns into lr-sized steps of
    rounding noise, in one process too."""
    from unity_pcg import zoo
    model = str(tmp_path / "gpt.onnx")
    zoo.export("gpt_350m", model, size="tiny", batch=4)
    pp = megatron_pipeline_plan(model, str(tmp_path / "pp.json"), cut=4)      # the embedding and the first block
    pl = P.load(pp)
    assert sum(n.op == "AllReduce" for n in pl.pcg.nodes()) == 4
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "sgd")
    _assert_same(got, ref, saved, ref_w)
    # stages of different sizes: the embedding and first block on one device, the rest 2-way Megatron
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import evaluate_pipeline, megatron_intra
    from tests.executor.runtime_plans import _save
    m = parse_machine("local:1x3")
    res = evaluate_pipeline(load_onnx(model, load_weights=False), CostModel(m), [(0, 4, 0, 1), (4, 8, 1, 2)], 2,
                            intra=megatron_intra(2))
    pp = _save(res.pcg, res.views, model, str(tmp_path / "uneq.json"), m, pipeline=res.to_plan_field(),
               predicted=res.to_json())
    (tmp_path / "u").mkdir()
    got, ref, saved, ref_w = _train(pp, model, tmp_path / "u", capfd, "sgd")
    assert got["nproc"] == 3
    _assert_same(got, ref, saved, ref_w)


def test_megatron_stages_of_different_sizes_train_like_one_process(tmp_path, capfd):
    """1 device, then a 2-way Megatron stage (local:1x3): one pipeline through the stages' first devices,
    the Megatron stage's leader sharing what it receives with the other device (a broadcast whose backward
    sums the gradient shares) and telling it which micro-batch to run forward or backward.  MSE, Adam."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import evaluate_pipeline, megatron_intra
    from tests.executor.runtime_plans import _save
    model = two_pair_mlp()
    m = parse_machine("local:1x3")
    res = evaluate_pipeline(load_onnx(model, load_weights=False), CostModel(m), [(0, 3, 0, 1), (3, 6, 1, 2)], 2,
                            intra=megatron_intra(2))
    pp = _save(res.pcg, res.views, model, str(tmp_path / "pp.json"), m, pipeline=res.to_plan_field(),
               predicted=res.to_json())
    M, stages = resolve(P.load(pp))
    assert [st.devices for st in stages] == [(0,), (1, 2)]
    assert any(P.load(pp).pcg.node(n).op == "AllReduce" for n in stages[1].nodes)
    rng = np.random.default_rng(4)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 8)).astype(np.float32),
             targets=rng.standard_normal((8, 8)).astype(np.float32))
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "adam", str(data))
    assert got["nproc"] == 3
    _assert_same(got, ref, saved, ref_w)


def test_batchnorm_in_megatron_stages_is_refused(tmp_path):
    """A BatchNorm model whose stages are not data parallel inside: one line before any process starts."""
    from tests.executor import dist_helpers as H
    from tests.executor.models import convnet
    from tests.executor.runtime_plans import _save
    model = convnet()
    g = H.load(model)
    conv = next(n for n in g.nodes() if n.op == "Conv2d")
    x, w, bias = (g.node(r[0]).a["name"] for r in conv.inputs)
    # the convolution split on its output channels (weight and bias), gathered back after it
    g = H.rebuild(g, {x: [("Replicate", 2)], w: [("Partition", 0, 2)], bias: [("Partition", 0, 2)]},
                  after={conv.id: [("Combine", 1, 2)]})
    plan = H.make_plan(g, model, 2)
    field = {"schedule": "1F1B", "micro_batches": 2,
             "stages": [{"nodes": [n.id for n in g.nodes() if n.kind != "source"], "devices": [0, 1]}]}
    pl = P.load(_save(g, plan.views, model, str(tmp_path / "bn.json"), plan.machine, pipeline=field))
    with pytest.raises(PipelineError, match="BatchNorm") as e:
        check_pipeline(pl)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_hybrid_stage_and_data_parallel_stage_train_like_one_process(tmp_path, capfd):
    """Hybrids: one 4-device stage with tensor degree 2 and data parallel 2 across (megatron_intra(2): the
    batch split, Megatron pairs inside each half, replicated weight shards all-reduced over the copies),
    and the tiny GPT cut after its embedding, whose stage 0 has no Megatron group and is data parallel
    (its batch pieces gathered whole for the Megatron stage).  SGD, as one process."""
    from unity_pcg import zoo
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel, GraphCost
    from unity_pcg.search.pipeline import evaluate_pipeline, megatron_intra, sequential_layers
    from tests.executor.runtime_plans import _save
    model = two_pair_mlp()
    g = load_onnx(model, load_weights=False)
    m = parse_machine("local:1x4")
    L = len(sequential_layers(g, GraphCost(g, CostModel(m)).role, 12)[0])
    res = evaluate_pipeline(g, CostModel(m), [(0, L, 0, 4)], 2, intra=megatron_intra(2))
    pp = _save(res.pcg, res.views, model, str(tmp_path / "hyb.json"), m, pipeline=res.to_plan_field(),
               predicted=res.to_json())
    assert res.pcg.meta.get("tp", 2) == 2
    rng = np.random.default_rng(1)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 8)).astype(np.float32),
             targets=rng.standard_normal((8, 8)).astype(np.float32))
    _assert_same(*_train(pp, model, tmp_path, capfd, "sgd", str(data)))
    gpt = str(tmp_path / "gpt.onnx")
    zoo.export("gpt_350m", gpt, size="tiny", batch=4)
    pp = megatron_pipeline_plan(gpt, str(tmp_path / "mixed.json"), cut=2)     # after the embedding
    pl = P.load(pp)
    emb = next(n for n in pl.pcg.nodes() if n.op == "Embedding")
    assert pl.pcg.shapes(emb.id)[0].degrees[0] == 2         # stage 0: data parallel
    (tmp_path / "m").mkdir()
    _assert_same(*_train(pp, gpt, tmp_path / "m", capfd, "sgd"))


@pytest.mark.slow
def test_megatron_pipeline_resume_continues_exactly(tmp_path, capfd):
    """3 steps + checkpoint, then 2 resumed steps (Adam: its moments are restored whole per stage) equal
    5 uninterrupted steps exactly."""
    from unity_pcg.cli import main
    model = two_pair_mlp()
    pp = megatron_pipeline_plan(model, str(tmp_path / "pp.json"), cut=3)

    def run(*extra):
        capfd.readouterr()
        rc = main(["run", pp, "--model", model, "--optimizer", "adam", "--json", "--loss", "mean",
                   *map(str, extra)])
        out, err = capfd.readouterr()
        assert rc == 0, err
        return json.loads(out)["losses"]
    full = run("--steps", 5)
    ck = tmp_path / "ck"
    assert run("--steps", 3, "--checkpoint", ck) == full[:3]
    assert run("--steps", 2, "--checkpoint", ck, "--resume") == full[3:]


@pytest.mark.slow
def test_searched_megatron_pipeline_plan_trains_like_one_process(tmp_path, capfd):
    """The pipeline search's own plan where only Megatron inside the stages fits (tests/search/
    test_pipeline_megatron.py's 8-device machine, tiny GPT at batch 64; what optimize takes there, found
    here without a time budget so the plan does not depend on the host's load): 4 stages x 2-way tensor
    parallelism, 64 micro-batches, on 8 processes, trains as one process (3 steps, SGD)."""
    from unity_pcg import zoo
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.mapping import MachineMapper
    from unity_pcg.search.pipeline import megatron_intra, search_pipeline
    from tests.executor.runtime_plans import _save
    from tests.search.test_pipeline_megatron import machine
    model = str(tmp_path / "gpt.onnx")
    zoo.export("gpt_350m", model, size="tiny", batch=64)
    m = machine()
    r = search_pipeline(load_onnx(model, load_weights=False), MachineMapper(CostModel(m, "adam")), min_stages=1,
                        intra=megatron_intra(8), micro_batches=[64])
    assert r is not None and r.feasible
    pp = _save(r.pcg, r.views, model, str(tmp_path / "pp.json"), m, pipeline=r.to_plan_field(),
               predicted=r.to_json())
    M, stages = resolve(P.load(pp))
    assert len(stages) > 1 and len(stages[0].devices) == 2
    from unity_pcg.cli import main
    from unity_pcg.executor.data import open_data
    from unity_pcg.executor.train import Trainer
    from tests.executor.runtime_plans import one_device_plan
    capfd.readouterr()
    rc = main(["run", pp, "--model", model, "--steps", "3", "--optimizer", "sgd", "--lr", "0.02", "--seed", "3",
               "--checkpoint", str(tmp_path / "ck"), "--json", "--loss", "mean"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    one = P.load(one_device_plan(model, str(tmp_path / "one.json")))
    t = Trainer(one, model, rank=0, world=1, seed=3, optimizer="sgd", lr=0.02)
    src = open_data(one.pcg, None, seed=3)
    ref = [t.step(*src.feeds(s)) for s in range(3)]
    got = json.loads(out)
    assert got["nproc"] == 8
    _assert_same(got, ref, C.read_model(str(tmp_path / "ck")), t.model_state())


@pytest.mark.slow
def test_stage_with_an_idle_device_before_a_megatron_stage(tmp_path, capfd):
    """local:1x5, 3 devices then 2: the first stage's operators use 2 of its 3 devices (the third only holds
    a copy of what the stage sends), the second is 2-way Megatron; stages of different sizes (leaders)."""
    from unity_pcg.machine import parse_machine
    from unity_pcg.onnx_import import load_onnx
    from unity_pcg.search.cost import CostModel
    from unity_pcg.search.pipeline import evaluate_pipeline, megatron_intra
    from tests.executor.runtime_plans import _save
    model = two_pair_mlp()
    m = parse_machine("local:1x5")
    res = evaluate_pipeline(load_onnx(model, load_weights=False), CostModel(m), [(0, 3, 0, 3), (3, 6, 3, 2)], 2,
                            intra=megatron_intra(2))
    pp = _save(res.pcg, res.views, model, str(tmp_path / "pp.json"), m, pipeline=res.to_plan_field(),
               predicted=res.to_json())
    pl = P.load(pp)
    M, stages = resolve(pl)
    used = {d for n in stages[0].nodes if n in pl.views for d in pl.views[n].devices()}
    assert stages[0].devices == (0, 1, 2) and used == {0, 1}
    rng = np.random.default_rng(6)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((8, 8)).astype(np.float32),
             targets=rng.standard_normal((8, 8)).astype(np.float32))
    got, ref, saved, ref_w = _train(pp, model, tmp_path, capfd, "adam", str(data))
    assert got["nproc"] == 5
    _assert_same(got, ref, saved, ref_w)
