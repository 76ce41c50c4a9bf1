"""optimize's pipeline step under its budget (search/optimize.py ``_pipeline``): when the batch allows the
fallbacks' larger micro-batch counts, the first stage search gets half the share; a feasible plan needs no
fallback, so a search stopped by that half continues over the default micro-batch counts it did not reach."""
from types import SimpleNamespace

import pytest

import unity_pcg.search.pipeline as P
from unity_pcg.search import optimize as O
from unity_pcg.search.budget import Deadline

from .test_pipeline import _chain


class _Spy:
    def __init__(self, results):
        self.results = list(results)
        self.calls = []

    def __call__(self, g, mapper, **kw):
        self.calls.append(kw)
        return self.results.pop(0)


def _res(cost, feasible=True, **stats):
    return SimpleNamespace(cost=cost, feasible=feasible, stats=stats)


@pytest.mark.parametrize("second,expect", [(1.0, 1.0), (3.0, 2.0)])
def test_a_feasible_pipeline_cut_by_half_the_share_searches_the_counts_it_did_not_reach(monkeypatch, second,
                                                                                       expect):
    g = _chain(128, [16, 16, 16])                   # a batch of 128: the fallbacks' 64 micro-batches divide it
    spy = _Spy([_res(2.0, budget_exhausted=True, micro_batches_tried=[8, 4], micro_batches_refused={16: "x"}),
                _res(second)])
    monkeypatch.setattr(P, "search_pipeline", spy)
    r = O._pipeline(g, SimpleNamespace(mapper=None), 10.0, Deadline.never())
    assert len(spy.calls) == 2
    assert spy.calls[0]["budget_s"] == pytest.approx(5.0)
    rest = spy.calls[1]["micro_batches"]
    assert rest == [m for m in P.micro_batch_candidates(128) if m not in (4, 8, 16)] and rest
    assert 0 < spy.calls[1]["budget_s"] <= 10.0         # what is left of the share
    assert r.cost == expect                        # the faster of the two


def test_a_pipeline_search_that_finished_is_not_searched_again(monkeypatch):
    g = _chain(128, [16, 16, 16])
    spy = _Spy([_res(2.0, micro_batches_tried=P.micro_batch_candidates(128))])
    monkeypatch.setattr(P, "search_pipeline", spy)
    assert O._pipeline(g, SimpleNamespace(mapper=None), 10.0, Deadline.never()).cost == 2.0
    assert len(spy.calls) == 1
