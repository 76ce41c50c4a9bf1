"""optimize's pipeline step under its budget (search/optimize.py ``_pipeline``): when the batch allows the
fallbacks' larger micro-batch counts, the first stage search gets half the share; a feasible plan needs no
fallback, so a search stopped by that half continues over the default micro-batch counts it did not reach; a
feasible plan at the most micro-batches tried walks on to twice as many while that prices faster."""
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


def _res(cost, feasible=True, M=4, **stats):
    return SimpleNamespace(cost=cost, feasible=feasible, micro_batches=M, stats=stats)


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
    spy = _Spy([_res(2.0, M=8, micro_batches_tried=P.micro_batch_candidates(128))])
    monkeypatch.setattr(P, "search_pipeline", spy)
    assert O._pipeline(g, SimpleNamespace(mapper=None), 10.0, Deadline.never()).cost == 2.0
    assert len(spy.calls) == 1          # (its best count, 8, is inside the counts tried: no finer walk)


@pytest.mark.parametrize("prices,expect_calls,expect", [([1.5, 1.2], 3, 1.2), ([2.5], 2, 2.0), ([1.5, 1.7], 3, 1.5)])
def test_a_pipeline_best_at_its_most_micro_batches_walks_to_finer_ones_while_they_price_faster(
        monkeypatch, prices, expect_calls, expect):
    g = _chain(128, [16, 16, 16])
    tried = P.micro_batch_candidates(128)
    top = max(tried)                                 # 32: the best count is the largest the search tried
    walk = [_res(p, M=top * 2 ** (i + 1)) for i, p in enumerate(prices)]
    spy = _Spy([_res(2.0, M=top, micro_batches_tried=tried)] + walk)
    monkeypatch.setattr(P, "search_pipeline", spy)
    r = O._pipeline(g, SimpleNamespace(mapper=None), 10.0, Deadline.never())
    assert len(spy.calls) == expect_calls           # (a batch of 128: at most 128 micro-batches)
    assert [c["micro_batches"] for c in spy.calls[1:]] == [[top * 2 ** (i + 1)] for i in range(expect_calls - 1)]
    assert r.cost == expect
