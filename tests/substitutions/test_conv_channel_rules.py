"""Channel parallelism of convolutional networks as proven rules (``templates.conv_channel_rules``, issue 18): each
rule is proven from its axiom and shipped, holds numerically at its example under the piece semantics, and the
numerically wrong variants (a weight split on the wrong dim, a sum gathered instead of reduced, a BatchNorm whose
parameters stay whole, a Combine of the wrong dim) are refused by the verifier."""
from __future__ import annotations

import numpy as np
import pytest

from unity_pcg.shape import ParallelTensorShape as S
from unity_pcg.substitutions.cache import load
from unity_pcg.substitutions.templates import conv_channel_rules, example_of
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.verifier.selfcheck import compare_sides, sample_values
from unity_pcg.verifier.verify import verify_rules

RULES = conv_channel_rules()
NAMES = [r.name for r in RULES]
CONV = {"stride": "$st", "padding": "$pad", "dilation": "$dil", "groups": "$g"}
CV = {"k": "degree", "st": "attr", "pad": "attr", "dil": "attr", "g": "attr"}


def P(t, d):
    return op("Partition", t, dim=d, degree="$k")


def R(t):
    return op("Replicate", t, degree="$k")


def C(t, d):
    return op("Combine", t, dim=d, degree="$k")


def test_every_rule_proven_and_shipped():
    assert {"conv_out_channels", "conv_out_channels_bias", "conv_in_channels", "conv_groups", "conv_groups_bias",
            "split_Conv2d", "split_Pool2d", "split_BatchNorm_channels", "replicate_lift_BatchNorm"} <= set(NAMES)
    verdicts = verify_rules(RULES, 10.0, 1)
    assert all(v.proven for v in verdicts), [v for v in verdicts if not v.proven]
    shipped = load().by_name()
    assert all(n in shipped and dict(shipped[n].proof)["status"] == "proven" for n in NAMES)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_holds_at_its_example(rule):
    ex = example_of(rule)
    rng = np.random.default_rng(0)
    for _ in range(2):
        vals = sample_values(ex["shapes"], ex["values"], rng)
        assert compare_sides(rule.source, rule.target, ex["bind"], ex["shapes"], vals, rng) == ""


X, W = S.of((2, 4, 3, 3)), S.of((4, 4, 3, 3))
BN = ("x", "s", "b", "mu", "var")
WRONG = [
    # the output channels split, but the weight split on its input channels
    ("out_wrong_weight_dim", op("Conv2d", "x", "w", **CONV), C(op("Conv2d", R("x"), P("w", 1), **CONV), 1),
     {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1, "k": 2}, {"x": X, "w": W}),
    # the input channels split, the partial sums gathered instead of reduced
    ("in_combined", op("Conv2d", "x", "w", **CONV), C(op("Conv2d", P("x", 1), P("w", 1), **CONV), 1),
     {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1, "k": 2}, {"x": X, "w": W}),
    # the input channels split, the weight split on its output channels (a grouped split of a dense conv)
    ("in_weight_out_dim", op("Conv2d", "x", "w", **CONV), op("Reduce", op("Conv2d", P("x", 1), P("w", 0), **CONV),
                                                              degree="$k"),
     {"st": (1, 1), "pad": (1, 1, 1, 1), "dil": (1, 1), "g": 1, "k": 2}, {"x": X, "w": W}),
]


@pytest.mark.parametrize("case", WRONG, ids=lambda c: c[0])
def test_wrong_variants_refused(case):
    name, lhs, rhs, bind, shapes = case
    r = rule_of(name, lhs, rhs, CV, inputs=list(shapes))
    assert not verify_rules([r], 5.0, 1)[0].proven


def test_batchnorm_with_whole_parameters_refused():
    # the channels split while the per-channel parameters stay whole (copied): not what BatchNorm computes,
    # and no axiom claims it
    r = rule_of("bn_whole_params", op("BatchNorm", *BN, eps="$e", momentum="$m"),
                C(op("BatchNorm", P("x", 1), *[R(n) for n in BN[1:]], eps="$e", momentum="$m"), 1),
                {"k": "degree", "e": "attr", "m": "attr"}, inputs=list(BN))
    assert not verify_rules([r], 5.0, 1)[0].proven


def test_pool_combined_on_another_dim_refused():
    pa = {"kind": "$kind", "kernel": "$ker", "stride": "$st", "padding": "$pad", "global_pool": "$gp",
          "count_include_pad": "$cip", "ceil_mode": "$cm"}
    V = {"k": "degree", "d": "dim", "e": "dim", **{v[1:]: "attr" for v in pa.values()}}
    r = rule_of("pool_wrong_combine", op("Pool2d", "x", **pa), op("Combine", op("Pool2d", op(
        "Partition", "x", dim="$d", degree="$k"), **pa), dim="$e", degree="$k"), V, [("$d", "!=", "$e")])
    assert not verify_rules([r], 5.0, 1)[0].proven
