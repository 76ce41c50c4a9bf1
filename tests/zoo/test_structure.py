"""Weight-free export (unity_pcg/zoo/structure.py, `unity-pcg export-structure`, `zoo export --weights none`):
the imported PCG equals the one of a real export of the same model (transformers Llama, GPT-2, BERT at tiny
widths; the zoo's Llama), a factory's parameters are never allocated, the data file is sparse, `run` refuses
the file before starting anything, bad configs fail in one line."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from unity_pcg.cli import main  # noqa: E402
from unity_pcg.errors import UnityError  # noqa: E402
from unity_pcg.onnx_import import load_onnx  # noqa: E402
from unity_pcg.pcg import _canon  # noqa: E402
from unity_pcg.weightfree import WEIGHT_FREE_KEY, WeightFreeModel, is_weight_free, metadata  # noqa: E402
from unity_pcg.zoo import structure  # noqa: E402
from unity_pcg.zoo.structure import StructureError, export_structure  # noqa: E402


def anon_hash(g) -> str:
    """PCG.structural_hash with the names of weights left out (an exporter names a weight it folded
    ``val_N``; the weight-free file keeps the parameter's name): ops, attributes (weight shapes and dtypes
    included), edges and outputs."""
    h = {}
    for nid in g.topo_order():
        n = g.node(nid)
        attrs = [[k, _canon(v)] for k, v in n.attrs if not (n.op == "Weight" and k == "name")]
        h[nid] = hashlib.blake2b(json.dumps([n.op, attrs, [[h[r[0]], r[1]] for r in n.inputs]]).encode(),
                                 digest_size=16).hexdigest()
    return hashlib.blake2b(json.dumps([sorted(h.values()), [[h[r[0]], r[1]] for r in g.outputs]]).encode(),
                           digest_size=16).hexdigest()


def real_dynamo_export(module, inputs, path, names=None):
    """The module with random weights (so no two are equal), exported as users do: dynamo, default options."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    module.eval()
    torch.onnx.export(module, tuple(inputs), str(path), dynamo=True, input_names=names, verbose=False)
    return path


def weight_names(g):
    return {n.a["name"]: tuple(n.a["shape"]) for n in g.nodes() if n.op == "Weight"}


# ----------------------------------------------------------------------------- transformers configs

T = None
try:
    import transformers as T  # noqa: F811
except ImportError:  # optional dependency (in the test extra): these tests need it
    pass
needs_transformers = pytest.mark.skipif(T is None, reason="transformers is not installed")

# tiny widths; position / token-type tables of more than 8192 elements, since onnxscript's optimizer folds a
# lookup at constant positions in a smaller table into a constant (the real export then has no such weight)
HF_TINY = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32, n_layer=2,
                 n_head=4, n_positions=512),
    "bert": dict(model_type="bert", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=512, type_vocab_size=300),
}


@needs_transformers
@pytest.mark.parametrize("kind", list(HF_TINY))
def test_config_export_equals_the_real_export(kind, tmp_path):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(HF_TINY[kind]))
    res = export_structure(str(cfg_path), tmp_path / "wf.onnx", batch=2, seq=16)
    assert res.inputs == [("input_ids", [2, 16], "int64")]
    assert is_weight_free(res.path)
    # the real export of the same config: the same class, same wrapper, weights on the CPU
    real_module = structure._hf_build(structure.load_config(str(cfg_path)))
    ids = torch.randint(0, 64, (2, 16))
    real = load_onnx(real_dynamo_export(real_module, [ids], tmp_path / "real.onnx", ["input_ids"]),
                     load_weights=False)
    wf = load_onnx(res.path, load_weights=False)
    assert anon_hash(wf) == anon_hash(real)
    assert wf.param_count() == real.param_count()
    assert wf.shape(wf.outputs[0]).sizes == real.shape(real.outputs[0]).sizes
    # every parameter is one weight of the file, by name, with its shape (the module's, transposed or not)
    shapes = {n: tuple(p.shape) for n, p in real_module.named_parameters()}
    got = weight_names(wf)
    assert res.parameters == sum(int(np.prod(s)) for s in shapes.values())
    for name, shape in shapes.items():
        if name in got:
            assert got[name] in (shape, shape[::-1])
    # tied weights (GPT-2's head) count once; BERT's pooler is not read by last_hidden_state
    assert res.weight_elements == res.parameters - (32 * 32 + 32 if kind == "bert" else 0)


@needs_transformers
def test_config_object_and_default_seq(tmp_path):
    cfg = T.LlamaConfig(**{k: v for k, v in HF_TINY["llama"].items() if k != "model_type"})
    res = export_structure(cfg, tmp_path / "m.onnx")
    assert res.inputs == [("input_ids", [1, 64], "int64")]      # batch 1, seq = max_position_embeddings
    assert res.outputs[0][0] == "logits" and res.outputs[0][1] == [1, 64, 64]


@needs_transformers
@pytest.mark.parametrize("content, words", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a transformers config"),
    ('{"hidden_size": 8}', "no model_type"),
    ('{"model_type": "no-such-model"}', "unknown to transformers"),
    ('{"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4, "num_hidden_layers": 1, '
     '"vocab_size": 8, "max_position_embeddings": 8, "intermediate_size": 8}', ""),
])
def test_bad_configs_fail_in_one_line(content, words, tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(content)
    rc = main(["export-structure", str(p), "-o", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("unity-pcg export-structure: error: ") and words in err[-1]
    assert not (tmp_path / "m.onnx").exists()


def test_missing_config_and_bad_arguments(tmp_path, capsys):
    assert main(["export-structure", str(tmp_path / "none.json"), "-o", str(tmp_path / "m.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["export-structure", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "one of them" in capsys.readouterr().err
    assert main(["export-structure", "--factory", "os.path:join", "--input", "x:2xa:float32",
                 "-o", str(tmp_path / "m.onnx")]) == 2
    assert "not integers" in capsys.readouterr().err
    assert main(["export-structure", "--factory", "os.path:join", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "--input" in capsys.readouterr().err
    assert main(["export-structure", "--factory", "no_such_module_xyz:f", "--input", "x:2:float32",
                 "-o", str(tmp_path / "m.onnx")]) == 2
    assert "cannot import" in capsys.readouterr().err
    with pytest.raises(StructureError, match="not a torch.nn.Module"):
        export_structure(lambda: 3, tmp_path / "m.onnx", inputs=[((2,), "float32")])
    with pytest.raises(StructureError, match="example inputs"):
        export_structure(lambda: torch.nn.Linear(2, 2), tmp_path / "m.onnx")
    with pytest.raises(StructureError, match="unknown dtype"):
        structure.parse_input_spec("x:2x3:complex7")
    assert structure.parse_input_spec("ids:2x1024:int64") == ("ids", (2, 1024), "int64")
    assert structure.parse_input_spec("2x3") == (None, (2, 3), "float32")


# -------------------------------------------------------------------------------------------- factories

FACTORY = textwrap.dedent('''
    import torch
    from torch import nn

    class Huge(nn.Module):
        """40 GB of float32 weights if they were made; a buffer whose values the graph needs."""
        def __init__(self, width):
            super().__init__()
            self.emb = nn.Embedding(1000, width)
            self.fc = nn.Linear(width, width)
            self.out = nn.Linear(width, 10, bias=False)
            self.register_buffer("pos", torch.arange(8), persistent=False)

        def forward(self, ids):
            x = self.emb(ids) + self.emb(self.pos)
            return self.out(torch.relu(self.fc(x)))

    def make():
        return Huge(100_000)
''')


def test_factory_of_a_huge_module_allocates_nothing(tmp_path, monkeypatch):
    (tmp_path / "huge_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "huge.onnx"
    rc = main(["export-structure", "--factory", "huge_factory:make", "--input", "ids:4x8:int64", "-o", str(out)])
    assert rc == 0
    width = 100_000
    want = 1000 * width + width * width + width + 10 * width
    g = load_onnx(str(out), load_weights=False)
    assert g.param_count() == want
    assert g.shape(g.outputs[0]).sizes == (4, 8, 10)
    data = str(out) + ".data"
    assert os.path.getsize(data) == 4 * want
    assert os.stat(data).st_blocks * 512 < 1 << 20       # sparse: no disk blocks behind 40 GB
    assert os.path.getsize(out) < 1 << 20                # the graph only
    assert metadata(out)[WEIGHT_FREE_KEY] == "true"
    sys.modules.pop("huge_factory", None)


def test_factory_graph_equals_the_real_export(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(96, 128)
            self.fc2 = torch.nn.Linear(128, 96)
            self.norm = torch.nn.LayerNorm(96)
            self.register_buffer("offset", torch.linspace(0, 1, 96))

        def forward(self, x):
            return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) + self.offset)

    res = export_structure(Net, tmp_path / "wf.onnx", inputs=[("x", (4, 96), "float32")])
    wf = load_onnx(res.path, load_weights=False)
    real = load_onnx(real_dynamo_export(Net(), [torch.randn(4, 96)], tmp_path / "real.onnx", ["x"]),
                     load_weights=False)
    assert anon_hash(wf) == anon_hash(real)
    assert res.parameters == sum(p.numel() for p in Net().parameters())
    # a module instance (its weights real) is traced as it is, its weights not written
    inst = export_structure(Net(), tmp_path / "inst.onnx", inputs=[torch.zeros(4, 96)], input_names=["x"])
    assert anon_hash(load_onnx(inst.path, load_weights=False)) == anon_hash(wf)
    assert inst.weight_bytes == res.weight_bytes and os.stat(inst.data_path).st_blocks * 512 < 1 << 20
    # the buffer keeps its value (the graph's constant), the weights read as zeros
    g = load_onnx(res.path)
    vals = {k: v() for k, v in g.weights.items()}
    assert np.allclose(vals["offset"], np.linspace(0, 1, 96))
    assert not vals["fc1.weight"].any()


def test_a_module_whose_constant_lives_on_meta_is_refused(tmp_path):
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4, device="meta"))

        def forward(self, x):
            return self.fc(x) * self.scale

    with pytest.raises(StructureError, match="'scale'.*no value"):
        export_structure(Bad, tmp_path / "m.onnx", inputs=[((2, 4), "float32")])


# ---------------------------------------------------------------------------------------------- run


def test_run_refuses_a_weight_free_model_before_starting_anything(tmp_path, capsys, monkeypatch):
    res = export_structure(lambda: torch.nn.Linear(8, 8), tmp_path / "wf.onnx", inputs=[((2, 8), "float32")])
    import unity_pcg.executor.launch as launch

    def no_launch(*a, **k):
        raise AssertionError("a process was started")
    monkeypatch.setattr(launch, "launch", no_launch)
    rc = main(["run", str(tmp_path / "plan.json"), "--model", res.path, "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0] == ("unity-pcg run: error: wf.onnx has no weights (written by export-structure for planning): "
                      "export the model with its weights to train it")
    with pytest.raises(WeightFreeModel):
        launch.check(str(tmp_path / "plan.json"), res.path)


def test_weight_free_mark_is_read_without_parsing_the_graph(tmp_path):
    import onnx
    from onnx import helper
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                                            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])]))
    p = tmp_path / "plain.onnx"
    onnx.save(m, p)
    assert not is_weight_free(p) and metadata(p) == {}
    helper.set_model_props(m, {"a": "b", WEIGHT_FREE_KEY: "true"})
    onnx.save(m, p)
    assert metadata(p) == {"a": "b", WEIGHT_FREE_KEY: "true"} and is_weight_free(p)
    (tmp_path / "junk.onnx").write_bytes(b"\xff\xff\xff")
    assert not is_weight_free(tmp_path / "junk.onnx") and not is_weight_free(tmp_path / "missing.onnx")


# ---------------------------------------------------------------------------------------------- zoo


def test_zoo_llama_tiny_with_weights_checks_equal_against_onnxruntime(tmp_path):
    import unity_pcg.zoo as zoo
    from unity_pcg.onnx_import.check import check_model
    path = zoo.export("llama_70b", tmp_path / "llama.onnx", size="tiny")
    res = check_model(str(path))
    assert res.ok
    cfg = zoo.get_config("llama_70b", "tiny")
    g = load_onnx(str(path), load_weights=False)
    assert g.shape(g.outputs[0]).sizes == (2, cfg.seq, cfg.vocab)
    assert cfg.heads != cfg.kv_heads          # the tiny model has grouped-query attention too


def test_zoo_llama_configs_and_parameter_counts():
    import unity_pcg.zoo as zoo
    table = {"llama_1b": (2048, 16, 32, 8, 8192, 128256), "llama_7b": (4096, 32, 32, 32, 11008, 32000),
             "llama_13b": (5120, 40, 40, 40, 13824, 32000), "llama_70b": (8192, 80, 64, 8, 28672, 32000)}
    nominal = {"llama_1b": 1.24e9, "llama_7b": 6.74e9, "llama_13b": 13.0e9, "llama_70b": 69.0e9}
    assert list(zoo.LLAMA_MODELS) == list(table)
    for name, (h, layers, heads, kv, ffn, vocab) in table.items():
        c = zoo.get_config(name, "paper")
        assert (c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab) == (h, layers, heads, kv, ffn, vocab)
        d = h // heads
        want = layers * (2 * h * h + 2 * h * kv * d + 3 * h * ffn + 2 * h) + 2 * vocab * h + h
        assert zoo.param_count(name) == want
        tied = want - (vocab * h if name == "llama_1b" else 0)   # Llama 3.2 1B ties its head to the embedding
        assert abs(tied - nominal[name]) < 0.02 * nominal[name]
        assert zoo.sizes(name) == ["paper", "small", "tiny"]


def test_zoo_weight_free_llama_equals_its_real_export(tmp_path):
    import unity_pcg.zoo as zoo
    from unity_pcg.zoo import models
    rc = main(["zoo", "export", "llama_7b", "--size", "tiny", "--weights", "none", "--batch", "3",
               "-o", str(tmp_path / "wf.onnx")])
    assert rc == 0 and is_weight_free(tmp_path / "wf.onnx")
    cfg = zoo.get_config("llama_7b", "tiny")
    module = models.make_module("llama_7b", cfg)
    (ids,) = models.example_inputs("llama_7b", cfg, 3)
    real = load_onnx(real_dynamo_export(module, [ids], tmp_path / "real.onnx", ["input_ids"]), load_weights=False)
    wf = load_onnx(str(tmp_path / "wf.onnx"), load_weights=False)
    assert anon_hash(wf) == anon_hash(real)
    assert wf.shape(wf.outputs[0]).sizes == (3, cfg.seq, cfg.vocab)


def test_zoo_weights_none_on_a_narrow_twin_model_is_marked(tmp_path):
    import unity_pcg.zoo as zoo
    assert zoo.narrow_twin_ok("mlp", "tiny") and not zoo.narrow_twin_ok("llama_7b", "tiny")
    p = zoo.export_structure("mlp", tmp_path / "mlp.onnx", size="tiny")
    assert is_weight_free(p)
    with pytest.raises(zoo.ZooError, match="exporter='dynamo'"):
        zoo.export_structure("llama_7b", tmp_path / "x.onnx", size="tiny", exporter="legacy")
    with pytest.raises(UnityError):
        zoo.export_structure("mlp", tmp_path / "x.onnx", size="tiny", exporter="tf")


# ------------------------------------------------------------------------------------- depth twin


@pytest.mark.parametrize("kind", ["zoo", "gpt2"])
def test_two_traced_blocks_copied_equal_all_blocks_traced(kind, tmp_path):
    """The depth twin (blocks 0 and 1 traced, block 1 copied for the others) gives the PCG of the full trace."""
    if kind == "zoo":
        import dataclasses

        from unity_pcg.zoo import configs, models
        cfg = dataclasses.replace(configs.CONFIGS["llama_70b"]["tiny"], layers=4)
        src, kw = (lambda: models.make_module("llama_70b", cfg)), dict(inputs=[("input_ids", (2, cfg.seq), "int64")])
    else:
        if T is None:
            pytest.skip("transformers is not installed")
        (tmp_path / "c.json").write_text(json.dumps({**HF_TINY["gpt2"], "n_layer": 3}))
        src, kw = str(tmp_path / "c.json"), dict(batch=2, seq=16)
    said = []
    twin = export_structure(src, tmp_path / "twin.onnx", progress=said.append, **kw)
    assert any("2 of its" in m for m in said) and not any("cannot be copied" in m for m in said)
    full = export_structure(src, tmp_path / "full.onnx", depth_twin=False, **kw)
    a, b = load_onnx(twin.path, load_weights=False), load_onnx(full.path, load_weights=False)
    assert anon_hash(a) == anon_hash(b)
    def params(g):       # the weights named after parameters (the optimizer numbers its constants val_N)
        return {k: v for k, v in weight_names(g).items() if not k.startswith("val_")}
    assert params(a) == params(b) and len(params(a)) > 20
    assert twin.weight_elements == full.weight_elements == twin.parameters
    assert twin.weight_bytes == full.weight_bytes


@pytest.mark.parametrize("wiring", ["sum", "index"])
def test_blocks_that_cannot_be_copied_are_all_traced(wiring, tmp_path):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
            self.skip = torch.nn.Linear(16, 16)

        def forward(self, x):
            if wiring == "index":          # reads a block the twin of two blocks lacks
                return self.blocks[2](self.blocks[1](self.blocks[0](x))) + self.skip(x)
            hs = [x]
            for b in self.blocks:
                hs.append(b(hs[-1]))
            return sum(hs[1:]) + self.skip(x)     # every block's output is read after the blocks

    said = []
    res = export_structure(Net, tmp_path / "m.onnx", inputs=[((2, 16), "float32")], progress=said.append)
    assert any("cannot be copied" in m for m in said)
    full = export_structure(Net, tmp_path / "full.onnx", inputs=[((2, 16), "float32")], depth_twin=False)
    g = load_onnx(res.path, load_weights=False)
    assert anon_hash(g) == anon_hash(load_onnx(full.path, load_weights=False))
    assert g.param_count() == res.parameters == 4 * (16 * 16 + 16)


def test_simulate_optimize_explain_plan_a_weight_free_file_and_run_refuses_it(tmp_path, capsys, monkeypatch):
    import unity_pcg.executor.launch as launch
    model = tmp_path / "llama.onnx"
    assert main(["zoo", "export", "llama_13b", "--size", "tiny", "--weights", "none", "-o", str(model)]) == 0
    assert main(["simulate", str(model), "--machine", "summit:1x2", "--strategy", "dp", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim
    plan = tmp_path / "plan.json"
    assert main(["optimize", str(model), "--machine", "summit:1x2", "--budget", "5", "-o", str(plan)]) == 0
    assert main(["explain", str(plan)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a process was started"))
    assert main(["run", str(plan), "--model", str(model), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["unity-pcg run: error: llama.onnx has no weights (written by export-structure for planning): "
                   "export the model with its weights to train it"]
