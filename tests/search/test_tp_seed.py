"""Seeds of the best-first search priced before the neighbours of the best start
(benchmarks/unity_vs_alpa_diag.py); ``_chain`` (Linear -> Relu pairs) is shared with tests/search/test_layouts.py.
Megatron layouts by rules are reached by ``search.realize`` (tests/search/test_rules_pipeline_megatron.py)."""
from __future__ import annotations

from unity_pcg.pcg import PCG
from unity_pcg.search.substitution import Candidate, RuleBook, best_first, data_parallel_steps


def _chain(pairs: int = 2, batch: int = 8, h: int = 8) -> PCG:
    b = PCG.builder()
    t = (b.add_node("Input", {"name": "x", "shape": (batch, h), "dtype": "float32"}), 0)
    for i in range(2 * pairs):
        w = b.add_node("Weight", {"name": f"w{i}", "shape": (h, h), "dtype": "float32"})
        t = (b.add_node("Linear", {"activation": "none"}, [t, (w, 0)]), 0)
        t = (b.add_node("Relu", {}, [t]), 0)
    b.set_outputs([t])
    return b.finish()


def test_seeds_are_priced_before_the_neighbours_of_the_best_start():
    # the best start's neighbours have a smaller estimate than the seed; with lazy pricing ordered by
    # estimate alone they were priced first and, in a budget, the seed never was
    g = _chain(1)
    book = RuleBook(None, (2,))
    seed, _ = data_parallel_steps(g, 2, book)
    others = [data_parallel_steps(_chain(1, h=8 + 2 * i), 2, book)[0] for i in range(1, 6)]
    priced = []

    def evaluate(x):
        priced.append(x.structural_hash())
        return (0.5 if x.structural_hash() == seed.structural_hash() else 2.0), None

    def expand(c):
        for o in others:
            yield o, ()

    est = {seed.structural_hash(): 10.0}
    res = best_first([Candidate(1.0, g, ()), Candidate(None, seed, ())], expand, evaluate, alpha=1.05,
                     max_candidates=2, estimate=lambda x: est.get(x.structural_hash(), 0.0))
    assert priced[0] == seed.structural_hash()
    assert res.best.cost == 0.5
