"""Baselines as users tune them (search/tuned.py, issue 19.5): Megatron-LM's grid over tensor, pipeline and
data degrees, micro-batch size and memory techniques, and ZeRO-3 (FSDP), in our cost model."""
import dataclasses
import math

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.budget import Deadline
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_chain, synthetic_transformer
from unity_pcg.search.tuned import TunedError, micro_batch_sizes, pairs, techniques, tune

KEYS = {"tp", "pp", "dp", "micro_batch", "micro_batches", "recompute", "distributed_optimizer", "sp"}


def _machine(preset: str, mib: float | None = None):
    m = parse_machine(preset)
    if mib is None:
        return m
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(mib * 2**20)))


def _consistent(c: dict, devices: int, batch: int) -> None:
    assert KEYS <= set(c)
    assert c["tp"] * c["pp"] * c["dp"] == devices
    assert c["micro_batch"] * c["dp"] * c["micro_batches"] == batch
    assert c["recompute"] in ("none", "selective", "full")


needs_memtech = pytest.mark.skipif(not techniques().available, reason="search.memtech is not in this tree")


def test_grid_pairs_and_micro_batches():
    m = parse_machine("h100:2x8")
    ps = pairs(m, "megatron", layers=24)
    assert (1, 1) in ps and (8, 2) in ps and (8, 1) in ps
    assert all(8 % tp == 0 and 16 % (tp * pp) == 0 for tp, pp in ps)
    assert (1, 16) in ps and pairs(m, "megatron", layers=4) == [p for p in ps if p[1] <= 4]
    assert pairs(m, "zero3", layers=24) == [(1, 1)]
    assert micro_batch_sizes(1024, 8, 1)[0] == 128           # pp = 1: one micro-batch first
    ms = micro_batch_sizes(1024, 8, 4)
    assert ms[0] == 1 and all(128 // x >= 4 for x in ms)     # pp > 1: smallest first, >= pp micro-batches


@pytest.mark.parametrize("preset,mib", [("h100:2x4", None), ("h100:1x4", 60)])
def test_never_slower_than_the_plain_megatron_it_contains(preset, mib):
    """The plain baseline (tensor parallel inside the node, data parallel across, the full batch, no
    technique) is a point of the grid: the tuned one is never predicted slower; where the plain one does
    not fit memory, the tuned one still finds a feasible configuration."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512 if mib else 256, heads=8)
    m = _machine(preset, mib)
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    plain = mp.optimize(build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node))
    r = tune(g, mp, "megatron")
    assert r.feasible and math.isfinite(r.cost)
    _consistent(r.config.to_json(), m.num_devices, 32)
    if plain.feasible:
        assert r.cost <= plain.cost * (1 + 1e-9)
    else:
        assert mib is not None                            # the tight machine: plain does not fit
        assert r.max_bytes <= m.device.memory_bytes
    tp0 = build_strategy(g, "megatron", m.num_devices, devices_per_node=m.devices_per_node).meta["tp"]
    plain_pts = [p for p in r.priced if p["config"]["pp"] == 1 and p["config"]["micro_batches"] == 1
                 and p["config"]["tp"] == tp0 and p["config"]["recompute"] == "none"
                 and not p["config"]["distributed_optimizer"]]
    assert plain_pts                                      # the plain point was priced
    assert len({(p["config"]["tp"], p["config"]["pp"]) for p in r.priced}) > 2   # and the grid around it


def test_megatron_refuses_a_model_without_attention_in_one_line():
    g = synthetic_chain(6, batch=16)
    mp = MachineMapper(CostModel(parse_machine("h100:1x4")))
    with pytest.raises(TunedError) as e:
        tune(g, mp, "megatron")
    assert "Transformers" in str(e.value) and "\n" not in str(e.value)


class _CountingMapper:
    """A mapper whose every solve advances a fake clock by one: a deadline of k passes after k solves."""

    def __init__(self, mapper):
        self.m = mapper
        self.machine, self.model = mapper.machine, mapper.model
        self.solves = 0

    def clock(self) -> float:
        return float(self.solves)

    def optimize(self, *a, **k):
        self.solves += 1
        return self.m.optimize(*a, **k)

    def __getattr__(self, name):
        return getattr(self.m, name)


def test_the_grid_respects_the_deadline():
    """On a fake clock that advances one unit per mapping solve, the grid stops at the deadline: fewer
    layouts are mapped than without one, the result is the best of those priced and says it was cut."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=256, heads=8)
    m = parse_machine("h100:2x4")
    full = tune(g, MachineMapper(CostModel(m)), "megatron")
    assert not full.stats.get("cut")
    cm = _CountingMapper(MachineMapper(CostModel(m)))
    r = tune(g, cm, "megatron", Deadline(3.0, cm.clock))
    assert r.stats.get("cut")
    assert r.stats["layout_points"] < full.stats["layout_points"]
    assert cm.solves <= 3 + 8                             # the solve running at the deadline finishes its stages
    assert r.feasible and r.config is not None
    best = min(p["cost"] for p in r.priced if p["cost"] is not None)
    assert r.cost == pytest.approx(best)
    assert r.cost >= full.cost * (1 - 1e-9)


@needs_memtech
def test_zero3_fits_where_data_parallelism_does_not():
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = _machine("h100:1x4", 200)
    mp = MachineMapper(CostModel(m, optimizer="adam"))
    dp = mp.optimize(build_strategy(g, "dp", 4))
    assert not dp.feasible
    r = tune(g, mp, "zero3")
    assert r.feasible and r.config.zero == 3 and r.config.dp == 4 and r.config.tp == r.config.pp == 1
    assert r.max_bytes <= m.device.memory_bytes
    assert r.memory_plan is not None and r.memory_plan.zero == 3


@needs_memtech
def test_optimize_records_the_configuration_and_the_memory_plan():
    """optimize(strategy="megatron" | "zero3"): info.search names the configuration; a pipeline plan with
    recomputation keeps every region inside one stage and loads back."""
    from unity_pcg.plan import from_json
    from unity_pcg.search.optimize import optimize
    g = synthetic_transformer(4, batch=32, seq=512, hidden=256, heads=8)
    seen = set()
    # ZeRO-3's smallest point needs more than 100 MiB: the backward's peak holds the loss's copies of the output
    for strategy, mib in (("megatron", None), ("megatron", 100), ("zero3", 140)):
        m = _machine("h100:1x4", mib)
        r = optimize(g, m, budget_s=30, strategy=strategy)
        assert r.feasible
        c = r.plan.info["search"][f"{strategy}_config"]
        _consistent(c, 4, 32)
        assert r.predicted_iteration_s == pytest.approx(r.stats["tuned"]["predicted_iteration_s"])
        back = from_json(r.plan.to_json())
        if c["recompute"] != "none" or c["distributed_optimizer"] or c["zero"]:
            assert back.memory is not None and back.memory.zero == c["zero"]
            assert bool(back.memory.recompute) == (c["recompute"] != "none")
        if r.plan.pipeline is not None:
            assert c["pp"] == len(r.plan.pipeline["stages"]) and r.plan.pipeline["micro_batches"] == c["micro_batches"]
            stage = {n: k for k, s in enumerate(r.plan.pipeline["stages"]) for n in s["nodes"]}
            for reg in (back.memory.recompute if back.memory else ()):
                assert len({stage.get(n) for n in reg.nodes}) == 1
            seen.add("pipeline with recompute" if back.memory and back.memory.recompute else "pipeline")
    assert "pipeline with recompute" in seen        # 100 MiB: gradient accumulation with recomputation


@needs_memtech
def test_simulate_prices_the_tuned_strategies_and_writes_their_plans(tmp_path, capsys):
    """`simulate --strategy megatron|zero3` on a Llama-style decoder: one JSON object with the configuration,
    and a plan that loads with it recorded."""
    pytest.importorskip("torch")
    import json

    from unity_pcg import plan as P
    from unity_pcg import zoo
    from unity_pcg.cli import main
    model = zoo.export("llama_7b", str(tmp_path / "llama.onnx"), size="tiny", batch=8)
    for strategy in ("megatron", "zero3"):
        out_plan = str(tmp_path / f"{strategy}.json")
        assert main(["simulate", model, "--machine", "h100:1x4", "--strategy", strategy, "--budget", "20",
                     "--json", "-o", out_plan]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["feasible"] and out["strategy"] == strategy
        _consistent(out[f"{strategy}_config"], 4, 8)
        p = P.load(out_plan)
        assert p.info["search"][f"{strategy}_config"] == out[f"{strategy}_config"]
        assert (p.pipeline is not None) == (out["config"]["micro_batches"] > 1 or out["config"]["pp"] > 1)
    assert main(["simulate", model, "--machine", "h100:1x4", "--strategy", "megatron", "--budget", "0"]) == 2
    assert "--budget" in capsys.readouterr().err


@needs_memtech
def test_without_memory_techniques_the_grid_has_none():
    """optimize(memory_techniques=False): Megatron's grid holds only 'no technique' points; zero3 says why
    it cannot run in one line."""
    from unity_pcg.search.optimize import OptimizeError, optimize
    g = synthetic_transformer(2, batch=16, seq=64, hidden=128, heads=4)
    r = optimize(g, "h100:1x4", budget_s=20, strategy="megatron", memory_techniques=False)
    c = r.plan.info["search"]["megatron_config"]
    assert c["recompute"] == "none" and not c["distributed_optimizer"] and r.plan.memory is None
    assert r.stats["tuned"]["techniques"].startswith("none")
    with pytest.raises(OptimizeError, match="zero3.*memory techniques"):
        optimize(g, "h100:1x4", budget_s=20, strategy="zero3", memory_techniques=False)


def test_heads_no_degree_splits_leave_the_tp1_points():
    """Three heads on an 8-device node: no tensor degree splits them, so the plain baseline does not
    exist (its one line is recorded) and the grid's tp = 1 points (data and pipeline parallel) remain."""
    g = synthetic_transformer(2, batch=8, seq=64, hidden=96, heads=3)
    mp = MachineMapper(CostModel(parse_machine("h100:1x8")))
    r = tune(g, mp, "megatron")
    assert r.feasible and r.config.tp == 1
    assert "heads" in r.stats["plain"] and "\n" not in r.stats["plain"]
    with pytest.raises(TunedError, match="batch 4 does not divide"):
        tune(synthetic_transformer(1, batch=4, seq=64, hidden=128, heads=8), mp, "zero3")


def test_sequence_parallelism_is_a_layout_point_of_its_own():
    """Every point with tp > 1 is priced without and with sequence parallelism (the same degrees,
    micro-batch and techniques); with it a device holds less (the residual stream's activations on tp
    sequence shards) and the iteration is no slower (the reduce-scatter and all-gather move what the
    all-reduce did), but for selective recomputation's re-gathers."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=256, heads=8)
    m = parse_machine("h100:1x4")
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    walked = {(q["config"]["tp"], q["config"]["pp"], q["config"]["micro_batch"], q["config"]["sp"])
              for q in r.priced if q["config"]["tp"] > 1}
    assert walked and all((tp, pp, mbs, not sp) in walked for tp, pp, mbs, sp in walked)
    ex = _exhaustive(g, MachineMapper(CostModel(m, optimizer="adam")))    # the pipelines' points too
    by: dict = {}
    for q in ex.priced:
        c = q["config"]
        if c["tp"] > 1 and q["cost"] is not None:
            by.setdefault((c["tp"], c["pp"], c["micro_batch"], c["recompute"], c["zero"]), {})[c["sp"]] = q
    assert any(tp == 4 for tp, *_ in by) and any(pp == 2 for _, pp, *_ in by)
    for k, v in by.items():
        assert set(v) == {False, True}, k
        # never more (a stage's peak may be set by what sequence parallelism does not split, e.g. its weights
        # and gradients at the backward's peak), and less somewhere
        assert v[True]["max_bytes"] <= v[False]["max_bytes"], k
        # selective recomputation re-runs the all-gather feeding a recomputed norm under sequence parallelism
        # (the region keeps the sequence shard: memtech.region_members), which the layout without it does
        # not: there it may be slower by that communication (a few tenths of a percent here)
        slack = 0.02 if k[3] == "selective" else 1e-9
        assert v[True]["cost"] <= v[False]["cost"] * (1 + slack), k
    assert any(v[True]["max_bytes"] < v[False]["max_bytes"] for v in by.values())
    assert not any(q["config"]["sp"] for q in r.priced if q["config"]["tp"] == 1)


class _SlowPlainMapper(_CountingMapper):
    """The first solve (the plain Megatron point, priced first) runs 100 clock units, checking the deadline of
    its scope at each as the DP does at its subproblems; every other solve advances the clock by one."""

    def optimize(self, *a, **k):
        from unity_pcg.search.budget import check
        if self.solves == 0:
            for _ in range(100):
                self.solves += 1
                check()
        return super().optimize(*a, **k)


def test_a_slow_plain_point_leaves_time_for_the_grid():
    """When the plain Megatron point's DP solve would take the whole deadline (ALBERT's shared weights), it is
    cut at a share of it and mapped without the DP, and the grid's other points are priced in the rest."""
    g = synthetic_transformer(2, batch=16, seq=64, hidden=128, heads=4)
    m = parse_machine("h100:1x4")
    cm = _SlowPlainMapper(MachineMapper(CostModel(m)))
    from unity_pcg.search.optimize import Evaluator
    ev = Evaluator(m, "adam", techniques=False)
    r = tune(g, cm, "megatron", Deadline(20.0, cm.clock), cheap=ev.cheap)
    assert r.stats.get("plain_mapping", "").startswith("without the DP")
    assert r.stats["layout_points"] > 1 and r.feasible and math.isfinite(r.cost)
    assert len([p for p in r.priced if p["cost"] is not None]) > 1


def test_simulate_megatron_prices_a_point_when_the_budget_cuts_every_solve(tmp_path, capsys):
    """`simulate --strategy megatron` with a budget that cuts the first solve still prices the plain layout
    (mapped without the DP, as optimize's floor is) instead of answering that nothing was priced."""
    pytest.importorskip("torch")
    import json

    from unity_pcg import zoo
    from unity_pcg.cli import main
    model = zoo.export("llama_7b", str(tmp_path / "llama.onnx"), size="tiny", batch=8)
    assert main(["simulate", model, "--machine", "h100:1x4", "--strategy", "megatron", "--budget", "1e-9",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["predicted_iteration_s"] > 0 and out["tp"] > 1


def _exhaustive(g, mapper, **kw):
    """Every (tp, pp, micro-batch size) point of the megatron grid priced (no walk, no deadline): the best."""
    from unity_pcg.search.tuned import _Tuner
    t = _Tuner(g, mapper, "megatron", None, techniques(), **kw)
    t._start()
    for w in t.walks:
        for mbs in w["ms"]:
            M = t.B // (w["dp"] * mbs)
            for sp in ((False, True) if w["tp"] > 1 else (False,)):
                lay = t.whole(w["tp"], sp=sp) if (w["pp"] == 1 and M == 1) else t.pipeline(w["tp"], w["pp"], M, sp=sp)
                t.price_layout(lay, mbs)
    return t.result()


@pytest.mark.parametrize("preset,mib", [("h100:2x4", None), ("h100:1x4", 60)])
def test_the_walk_finds_the_exhaustive_grids_best(preset, mib):
    """The best-first walk (view reuse across micro-batch sizes, pipelines ordered by their bound) returns the
    best point of the exhaustively priced grid."""
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512 if mib else 256, heads=8)
    m = _machine(preset, mib)
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    ex = _exhaustive(g, MachineMapper(CostModel(m, optimizer="adam")))
    assert ex.feasible and r.feasible
    assert r.cost == pytest.approx(ex.cost, rel=1e-9)
    assert len(r.priced) < len(ex.priced)          # without pricing every point


def test_views_reused_across_micro_batch_sizes_price_as_the_dp():
    """A layout mapped by the DP at one micro-batch size is priced at another on the same views: the price
    equals the DP's own solve at that size (these layouts' views do not depend on the batch)."""
    from unity_pcg.search.pipeline import rebatch
    from unity_pcg.search.baselines import megatron
    from unity_pcg.search.tuned import ViewReuse, layout_key
    g = synthetic_transformer(2, batch=32, seq=128, hidden=256, heads=8)
    m = parse_machine("h100:2x4")
    stats: dict = {}
    vr = ViewReuse(MachineMapper(CostModel(m, optimizer="adam")), stats)
    pa = megatron(rebatch(g, 32, 8), 8, devices_per_node=2)
    pb = megatron(rebatch(g, 32, 4), 8, devices_per_node=2)
    assert layout_key(pa) == layout_key(pb)
    vr.optimize(pa, techniques=False)
    got = vr.optimize(pb, techniques=False)
    assert stats.get("reused") == 1
    dp = MachineMapper(CostModel(m, optimizer="adam")).optimize(pb, techniques=False)
    assert got.cost == pytest.approx(dp.cost, rel=1e-9)


def test_a_cut_walk_resumes_where_it_stopped():
    """A walk cut by a deadline and resumed (as optimize's floors resume theirs) ends where an uncut walk ends
    and prices again only the layout point the deadline cut."""
    from unity_pcg.search.tuned import _Tuner
    g = synthetic_transformer(4, batch=32, seq=128, hidden=256, heads=8)
    m = parse_machine("h100:2x4")
    full = tune(g, MachineMapper(CostModel(m)), "megatron")
    cm = _CountingMapper(MachineMapper(CostModel(m)))
    t = _Tuner(g, cm, "megatron", Deadline(3.0, cm.clock), techniques())
    t.run()
    assert t.stats.get("cut")
    n = len(t.priced)
    t.resume(Deadline.never(cm.clock))
    assert not t.stats.get("cut") and len(t.priced) > n
    r = t.result()
    assert r.cost == pytest.approx(full.cost, rel=1e-9)
    keys = [tuple(sorted(p["config"].items())) for p in t.priced]
    assert len(keys) - len(set(keys)) <= len(t.combos())


@needs_memtech
def test_per_region_recompute_is_never_slower_and_records_its_regions():
    """The floors' grid (per_region=True) holds every point of the baseline's and a per-region recompute choice
    at each: its best is never slower; where that choice wins, the plan's MemoryPlan names the regions, a
    strict subset of the model's (else a uniform mode would have been as good), and the point fits."""
    from unity_pcg.search.tuned import PER_REGION, _Tuner
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = _machine("h100:1x4", 60)
    base = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron", None, techniques(), per_region=True)
    t.run()
    r = t.result()
    assert r.feasible and r.cost <= base.cost * (1 + 1e-9)
    assert any(p["config"]["recompute"] == PER_REGION for p in r.priced)
    if r.config.recompute == PER_REGION and r.cost < base.cost * (1 - 1e-9):
        assert r.memory_plan is not None and r.memory_plan.recompute
        assert r.max_bytes <= m.device.usable_bytes


@needs_memtech
@pytest.mark.parametrize("mib", [160, 200, 300])
def test_an_uncut_walk_equals_the_exhaustive_grid_where_a_pipeline_wins_at_its_largest_size(mib):
    """A pipeline walks its micro-batch sizes rising, so its next point's bound is the highest of its points
    left: the walk prunes size by size, never a whole pipeline by its first point.  At 160 / 200 MiB the best
    point is tp4 pp2 at the largest micro-batch (with and without recomputation), at 300 MiB a pp = 1 point;
    the uncut walk returns the exhaustive grid's best in each, pricing fewer points."""
    g = synthetic_transformer(4, batch=32, seq=64, hidden=1024, heads=8)
    m = _machine("h100:2x4", mib)
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "megatron")
    ex = _exhaustive(g, MachineMapper(CostModel(m, optimizer="adam")))
    assert ex.feasible and r.feasible and not r.stats.get("cut")
    assert r.cost == pytest.approx(ex.cost, rel=1e-9)
    assert len(r.priced) < len(ex.priced)


@needs_memtech
def test_offload_fits_where_nothing_on_the_device_does_and_only_there():
    """Optimizer-state offload is a point of every grid where the machine describes a host: on 12 MiB devices
    neither tuned Megatron-LM nor ZeRO-3 fits without it (host memory 0: no offload); with the host both fit
    by offloading, the configuration and the memory plan say so, and the fastest point that fits on the
    device is never traded for an offloaded one (24 MiB: no offload)."""
    g = synthetic_transformer(2, batch=8, seq=16, hidden=256, heads=4)
    for strategy in ("megatron", "zero3"):
        got = {}
        for host in (True, False):
            m = _machine("h100:1x2", 12)
            if not host:
                m = dataclasses.replace(m, host_memory_bytes=0)
            got[host] = tune(g, MachineMapper(CostModel(m, optimizer="adam")), strategy)
        assert not got[False].feasible and not any(p["config"]["offload"] for p in got[False].priced)
        r = got[True]
        assert r.feasible and r.config.offload and "offload" in r.config.label(), strategy
        assert r.memory_plan is not None and r.memory_plan.offload
        assert r.max_bytes <= 12 * 2**20
        roomy = tune(g, MachineMapper(CostModel(_machine("h100:1x2", 24), optimizer="adam")), strategy)
        assert roomy.feasible and not roomy.config.offload
        # offload is priced only where the same point without it did not fit
        for p in roomy.priced:
            if p["config"]["offload"]:
                twin = [q for q in roomy.priced if q["config"] == dict(p["config"], offload=False)]
                assert twin and twin[0]["cost"] is None


@needs_memtech
def test_a_falling_walk_prices_its_smallest_micro_batch_where_the_weights_fit():
    """A walk's skip over micro-batch sizes predicts their memory from a priced point (weights part + the
    activations part scaled), an estimate: on this decoder (long sequences, 90 MiB devices, no host) the
    full batch predicts no size fits, yet one micro-batch per copy does; the data-parallel walk still prices its
    smallest size, so ZeRO-3 finds that plan."""
    g = synthetic_transformer(2, batch=16, seq=1024, hidden=256, heads=4)
    m = dataclasses.replace(_machine("h100:1x2", 90), host_memory_bytes=0)
    r = tune(g, MachineMapper(CostModel(m, optimizer="adam")), "zero3")
    assert r.feasible and r.config.micro_batch == 1 and r.max_bytes <= m.device.usable_bytes
    first = r.priced[0]
    assert first["config"]["micro_batch"] == 8 and first["cost"] is None      # the full batch does not fit


@needs_memtech
def test_a_stage_whose_weights_alone_do_not_fit_prices_no_recomputing_point():
    """Recomputation frees activations only: where a ZeRO stage's point without it does not fit even its
    weights part (weights, gradients, states), none of that stage's recomputing points is priced."""
    from unity_pcg.search.pipeline import default_intra
    from unity_pcg.search.tuned import _Tuner
    g = synthetic_transformer(4, batch=32, seq=128, hidden=512, heads=8)
    m = _machine("h100:1x4", 150)          # ZeRO-0 holds ~192 MiB of weight state per device, ZeRO-1 ~120
    t = _Tuner(g, MachineMapper(CostModel(m, optimizer="adam")), "accumulate", None, techniques(), per_region=True)
    pts = t.price_layout(t.pipeline(1, 1, 8, intra=default_intra), 1)
    by = {(p.config.recompute, p.config.zero, p.config.offload): p for p in pts}
    cap = m.device.usable_bytes
    assert by[("none", 0, False)].split[0] >= cap and not by[("none", 0, False)].feasible
    assert not [k for k in by if k[1] == 0 and k[0] != "none"]          # ZeRO-0 recomputes nowhere
    assert t.stats["weights_bounded"] >= 2
    assert by[("none", 1, False)].split[0] < cap and ("full", 1, False) in by    # ZeRO-1's are priced
