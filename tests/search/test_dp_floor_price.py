"""The data-parallel floor of ``optimize`` (``data_parallel_iteration_s``: what budget_check's and Figure 14's
``dp`` columns report) against ``simulate --strategy dp``: the floor is priced with its cheapest memory
techniques and overlap, as every candidate is; ``simulate`` prices plain DDP.  Where a technique wins the two
differ, and the JSON says which plan the floor's price is of; without techniques they agree."""
from __future__ import annotations

import pytest

import unity_pcg.onnx_import as onnx_import
from unity_pcg.commands.simulate_cmd import simulate
from unity_pcg.machine import parse_machine
from unity_pcg.search.baselines import build_strategy
from unity_pcg.search.cost import CostModel
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.optimize import _memory_summary, optimize

from .test_optimize import _tables_model

MACHINE = "h100:8x8"


@pytest.fixture(scope="module")
def tables():
    """A small DLRM: four 500,000 x 64 tables (128 MB each, replicated by data parallelism) and a dense tower."""
    return _tables_model(n=4, batch=64 * 64, rows=500_000, dim=64, bag=4, h=256, layers=2)


def _simulated_dp(g, monkeypatch) -> float:
    """``unity-pcg simulate --strategy dp --optimizer sgd`` of ``g`` (the model file's import replaced by ``g``)."""
    monkeypatch.setattr(onnx_import, "load_onnx", lambda path, batch=None, load_weights=False: g)
    out = simulate("tables.onnx", MACHINE, "dp", optimizer="sgd")
    assert out["feasible"]
    return out["predicted_iteration_s"]


def test_dp_floor_names_its_memory_techniques_and_prices_as_fig14_dp(tables, monkeypatch):
    r = optimize(tables, MACHINE, budget_s=3, max_candidates=0, pipeline=False, optimizer="sgd")
    j = r.json()
    m = parse_machine(MACHINE)
    pg = build_strategy(tables, "dp", m.num_devices, devices_per_node=m.devices_per_node)
    fig14 = MachineMapper(CostModel(m, optimizer="sgd"), techniques=True).optimize(pg)
    # the floor is Figure 14's dp mapping with its memory techniques, and names them
    assert j["data_parallel_memory_plan"] == _memory_summary(fig14)
    assert j["data_parallel_iteration_s"] == pytest.approx(fig14.cost, rel=1e-9)
    # plain DDP is one of the plans the techniques choose from: never faster than the floor
    plain = _simulated_dp(tables, monkeypatch)
    assert j["data_parallel_iteration_s"] <= plain * (1 + 1e-9)


def test_dp_floor_without_techniques_is_simulate_dp(tables, monkeypatch):
    r = optimize(tables, MACHINE, budget_s=3, max_candidates=0, pipeline=False, optimizer="sgd",
                 memory_techniques=False)
    j = r.json()
    assert j["data_parallel_memory_plan"] == {"zero": 0, "offload": False, "recompute_regions": 0}
    assert j["data_parallel_iteration_s"] == pytest.approx(_simulated_dp(tables, monkeypatch), rel=1e-9)


def test_dp_by_rules_equal_to_a_cut_dp_floor_chooses_its_techniques_only_until_its_deadline():
    """Data parallelism by rules equal to the hand-built dp PCG whose DP solve was cut is mapped as that one was,
    without the DP; its memory techniques' choice (a search) runs inside ``until`` (the segments' mark), so on a
    starved host it stops there (then none) instead of running on to the hard end."""
    from types import SimpleNamespace

    from unity_pcg.search import budget
    from unity_pcg.search.budget import Deadline
    from unity_pcg.search.optimize import _price_dp_by_rules

    from .test_pipeline import _chain
    g = _chain(64, [32, 64, 32])
    dp = build_strategy(g, "dp", 4)
    seen = []

    def cost_without_dp(t):
        seen.append(budget.current())
        return 1.0
    ev = SimpleNamespace(hard=None, cost_without_dp=cost_without_dp)
    until = Deadline.after(0.0)
    c = _price_dp_by_rules(ev, g, None, dp, (), dp, lambda: 1.0, {}, dp_cut=True, until=until)
    assert c.cost == 1.0 and seen == [until]
