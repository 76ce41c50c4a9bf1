"""The GPT models of the Alpa evaluation in the zoo (unity_pcg.zoo.ALPA_MODELS): paper sizes as Alpa's
Table 6, the tiny model exports, runs causally and imports, and export_structure gives the real graph."""
from __future__ import annotations

import numpy as np
import pytest

import unity_pcg.zoo as zoo
from unity_pcg.zoo import ZooError

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

TABLE6 = {"gpt_350m": (1024, 24, 16, 1), "gpt_1_3b": (2048, 24, 32, 4), "gpt_2_6b": (2560, 32, 32, 8),
          "gpt_6_7b": (4096, 32, 32, 16), "gpt_15b": (5120, 48, 32, 32), "gpt_39b": (8192, 48, 64, 64)}


def test_gpt_entries_are_alpas_table_6_and_not_unitys_seven():
    assert list(zoo.ALPA_MODELS) == list(TABLE6)
    assert not set(zoo.ALPA_MODELS) & set(zoo.MODELS)
    for name, (h, layers, heads, gpus) in TABLE6.items():
        cfg = zoo.get_config(name, "paper")
        assert (cfg.hidden, cfg.layers, cfg.heads, cfg.seq, cfg.vocab) == (h, layers, heads, 1024, 51200)
        assert zoo.ALPA_GPUS[name] == gpus
        assert zoo.entry(name).paper_batch == 1024 and zoo.entry(name).paper_optimizer == "adam"
        assert zoo.sizes(name) == ["paper", "tiny"]
    with pytest.raises(ZooError):
        zoo.entry("gpt_7b")


@pytest.mark.parametrize("name", list(TABLE6))
def test_paper_parameter_counts(name):
    # blocks: Q, K, V, output projection (h^2 + h each), MLP 4h (8h^2 + 5h), two LayerNorms (4h);
    # token and position embeddings, final LayerNorm, untied LM head
    cfg = zoo.get_config(name, "paper")
    h, L, V, S = cfg.hidden, cfg.layers, cfg.vocab, cfg.seq
    want = L * (12 * h * h + 13 * h) + 2 * V * h + S * h + 2 * h
    assert zoo.param_count(name) == want
    nominal = {"gpt_350m": 350e6, "gpt_1_3b": 1.3e9, "gpt_2_6b": 2.6e9, "gpt_6_7b": 6.7e9, "gpt_15b": 15e9,
               "gpt_39b": 39e9}[name]
    assert 0.95 * nominal < want - V * h < 1.1 * nominal      # the name counts a tied head


def test_tiny_gpt_exports_matches_onnxruntime_and_is_causal(tmp_path):
    torch.manual_seed(0)
    model, inputs, in_names, out_names = zoo.build("gpt_350m", "tiny")
    assert in_names == ["input_ids"] and out_names == ["logits"]
    with torch.no_grad():
        want = model(*inputs)
        changed = inputs[0].clone()
        changed[:, -1] = (changed[:, -1] + 1) % zoo.get_config("gpt_350m", "tiny").vocab
        other = model(changed)
    cfg = zoo.get_config("gpt_350m", "tiny")
    assert tuple(want.shape) == (zoo.entry("gpt_350m").tiny_batch, cfg.seq, cfg.vocab)
    assert torch.allclose(want[:, :-1], other[:, :-1], atol=1e-6)       # the last token is not seen earlier
    assert not torch.allclose(want[:, -1], other[:, -1])
    path = zoo.export("gpt_350m", tmp_path / "gpt.onnx", size="tiny", seed=0)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": inputs[0].numpy()})[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_export_structure_gives_the_graph_of_the_real_export(tmp_path):
    from unity_pcg.onnx_import import load_onnx
    real = load_onnx(zoo.export("gpt_1_3b", tmp_path / "real.onnx", size="tiny", batch=3), load_weights=False)
    struct = load_onnx(zoo.export_structure("gpt_1_3b", tmp_path / "s.onnx", size="tiny", batch=3),
                       load_weights=False)

    def sig(g):
        return sorted((n.op, tuple(tuple(s.sizes) for s in g.shapes(n.id))) for n in g.nodes())
    assert sig(struct) == sig(real)
    assert struct.param_count() == real.param_count()
    assert struct.shape(struct.outputs[0]).sizes == (3, 16, 64)
