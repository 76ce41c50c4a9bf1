"""The shipped rule cache: loads fast, refuses hand edits, contains the paper's named substitutions."""
import json
import shutil

import pytest

from unity_pcg.substitutions import cache
from unity_pcg.substitutions.rule import RuleError
from unity_pcg.substitutions.templates import NAMED
from unity_pcg.verifier.axioms import SAMPLE_OPS, UNARY, BINARY


@pytest.fixture(scope="module")
def shipped():
    return cache.load()


def test_cache_loads_fresh_each_time():
    """Loading re-reads and re-checks the files when the memo is cleared (the load time itself is
    measured by benchmarks/rules_bench.py, not asserted here: speed goals live in benchmarks)."""
    sets = []
    for _ in range(2):
        cache._MEMO.clear()
        sets.append(cache.load())
    assert len(sets[0]) > 0
    assert sets[0] is not sets[1]
    assert [r.name for r in sets[0]] == [r.name for r in sets[1]]


def test_manifest_counts_match(shipped):
    c = shipped.manifest["counts"]
    assert c["rules"] == len(shipped)
    assert c["parallel_rules"] == sum(1 for r in shipped if r.is_parallel)
    assert c["axioms"] > 0
    assert all(dict(r.proof).get("status") == "proven" for r in shipped)
    assert not shipped.stale, "operator registry changed: run `unity-pcg rules generate`"


def test_hand_edited_cache_is_refused(tmp_path):
    d = tmp_path / "cache"
    shutil.copytree(cache.default_dir(), d, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    p = d / "rules.json"
    obj = json.loads(p.read_text())
    obj["rules"][0]["target"]["nodes"] = obj["rules"][0]["source"]["nodes"]
    p.write_text(json.dumps(obj))
    with pytest.raises(RuleError) as e:
        cache.load(d)
    msg = str(e.value)
    assert "digest" in msg and "edited by hand" in msg and "\n" not in msg


def test_missing_manifest_is_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(cache.default_dir() / "rules.json", d / "rules.json")
    with pytest.raises(RuleError, match="missing manifest"):
        cache.load(d)


def test_save_load_round_trip(tmp_path, shipped):
    some = shipped.rules[:20]
    cache.save(some, tmp_path)
    back = cache.load(tmp_path)
    assert back.rules == some
    assert back.manifest["counts"]["rules"] == 20


def test_named_paper_substitutions_present(shipped):
    names = set(shipped.by_name())
    missing = [n for n in NAMED if n not in names]
    assert not missing, missing
    dp_ops = list(UNARY) + list(BINARY) + list(SAMPLE_OPS) + ["Linear", "Linear_bias", "MatMul", "BatchMatMul",
                                                              "Softmax", "LayerNorm", "Concat", "Split"]
    missing = [f"dp_{o}" for o in dp_ops if f"dp_{o}" not in names]
    assert not missing, missing


def test_named_rules_have_the_paper_shape(shipped):
    r = shipped.get("fig2_matmul_reduction")
    assert [n.op for n in r.source.nodes] == ["MatMul"]
    assert r.target.nodes[-1].op == "Reduce"
    assert sorted(n.a.get("dim") for n in r.target.nodes if n.op == "Partition") == [-2, -1]
    r = shipped.get("megatron_mlp_column_row")
    assert r.target.nodes[-1].op == "Reduce" and [n.op for n in r.source.nodes] == ["Linear", "Linear"]
    r = shipped.get("megatron_attention_heads")
    assert r.source.nodes[0].op == "BatchMatMul"
    r = shipped.get("reduce_replicate_allreduce")
    assert [n.op for n in r.target.nodes] == ["AllReduce"]
    r = shipped.get("linear_relu_fusion")
    assert r.target.nodes[0].a.get("activation") == "relu"


def test_generated_rules_present(shipped):
    gen = [r for r in shipped if r.origin == "generated"]
    assert len(gen) > 100
    assert any(r.is_parallel for r in gen) and any(not r.is_parallel for r in gen)
    # the generator itself rediscovers Linear+Relu fusion and ReLU's partition commutation
    exprs = {str(r).split(": ", 1)[1] for r in gen}
    assert any("Linear(activation=relu" in e and "Relu(MatMul" in e for e in exprs), "fusion not generated"


def test_rules_mention_only_the_vocabulary_the_hash_covers(shipped):
    """The op-set hash covers the operators the axioms speak about; every shipped rule stays inside it,
    so an operator added without axioms cannot make the cache stale, and one changed inside it does."""
    vocab = cache.rule_vocabulary()
    used = {n.op for r in shipped for p in (r.source, r.target) for n in p.nodes}
    assert used <= vocab, used - vocab
    before = cache.op_set_hash()
    from unity_pcg import ops
    spec = ops.REGISTRY["Relu"]
    old_attrs = spec.attrs
    try:
        object.__setattr__(spec, "attrs", {**old_attrs, "extra_attr": 0})   # works on frozen dataclasses too
        assert cache.op_set_hash() != before
    finally:
        object.__setattr__(spec, "attrs", old_attrs)
    assert cache.op_set_hash() == before


def test_cnn_channel_rules_shipped_with_their_shape(shipped):
    """The channel parallelism of CNNs (``templates.conv_channel_rules``) ships proven: a Conv2d split on its output
    channels (weight dim 0, output channels gathered), on its input channels (input and weight dim 1, a Reduce),
    by groups (input dim 1 with weight dim 0), BatchNorm with its parameters split, the window operators on copies."""
    r = shipped.get("conv_out_channels")
    assert [n.op for n in r.source.nodes] == ["Conv2d"] and r.target.nodes[-1].op == "Combine"
    assert r.target.nodes[-1].a["dim"] == 1
    parts = {n.inputs[0]: n.a["dim"] for n in r.target.nodes if n.op == "Partition"}
    assert parts == {"w": 0} and any(n.op == "Replicate" and n.inputs[0] == "x" for n in r.target.nodes)
    r = shipped.get("conv_in_channels")
    assert r.target.nodes[-1].op == "Reduce"
    assert {n.inputs[0]: n.a["dim"] for n in r.target.nodes if n.op == "Partition"} == {"x": 1, "w": 1}
    r = shipped.get("conv_groups")
    assert {n.inputs[0]: n.a["dim"] for n in r.target.nodes if n.op == "Partition"} == {"x": 1, "w": 0}
    r = shipped.get("split_BatchNorm_channels")
    assert {n.inputs[0]: n.a["dim"] for n in r.target.nodes if n.op == "Partition"} == \
        {"x": 1, "s": 0, "b": 0, "mu": 0, "var": 0}
    for name in ("conv_out_channels_bias", "conv_groups_bias", "split_Conv2d", "split_Conv2d_bias", "split_Pool2d",
                 "replicate_lift_Conv2d", "replicate_lift_Conv2d_bias", "replicate_lift_BatchNorm",
                 "replicate_lift_Pool2d"):
        assert dict(shipped.get(name).proof)["status"] == "proven"
