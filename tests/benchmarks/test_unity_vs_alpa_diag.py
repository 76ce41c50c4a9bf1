"""Fast checks of benchmarks/unity_vs_alpa_diag.py's layout reader (the diagnosis itself is run by hand:
about a minute)."""
from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _diag():
    spec = importlib.util.spec_from_file_location("unity_vs_alpa_diag",
                                                  os.path.join(ROOT, "benchmarks", "unity_vs_alpa_diag.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mlp():
    from unity_pcg.pcg import PCG
    b = PCG.builder()
    x = b.add_node("Input", {"name": "x", "shape": (8, 4), "dtype": "float32"})
    w1 = b.add_node("Weight", {"name": "w1", "shape": (4, 8), "dtype": "float32"})
    w2 = b.add_node("Weight", {"name": "w2", "shape": (8, 4), "dtype": "float32"})
    h = b.add_node("Linear", {"activation": "none"}, [(x, 0), (w1, 0)])
    r = b.add_node("Relu", {}, [(h, 0)])
    y = b.add_node("Linear", {"activation": "none"}, [(r, 0), (w2, 0)])
    b.set_outputs([(y, 0)])
    return b.finish()


def test_layouts_read_the_megatron_split_and_dp():
    from unity_pcg.search.substitution import RuleBook, data_parallel_steps
    d = _diag()
    g = _mlp()
    book = RuleBook(None, (2,))
    x, _ = data_parallel_steps(g, 2, book)
    lay = d.layouts(x)
    assert lay["w1"]["x_batch_degree"] == 2 and lay["w1"]["w_degrees"] == [1, 1]
    y, n = d._greedy(x, book.by_name["megatron_mlp_column_relu_row"], 2, fresh=True)
    assert n == 1                                   # not nested inside its own result
    assert d._greedy(x, book.by_name["megatron_mlp_column_relu_row"], 2)[1] > 1
    lay = d.layouts(y)
    assert d._split(lay["w1"]).startswith("column") and d._split(lay["w2"]).startswith("row")
    assert lay["w2"]["out_sum_degree"] == 2 and lay["w1"]["x_batch_degree"] == 2
