"""The label ILP's channel-parallel CNN layouts reached by proven rules (issue 18; ``templates.conv_channel_rules``).

A small CNN (Conv -> BatchNorm -> Relu -> Pool -> Conv) at batch 1, so no layout but channel parallelism splits it:
the ILP's proposal (convolutions split on output channels, on input channels with a Reduce, or by groups; BatchNorm
with its parameters split; Relu and Pool on the split channels) is reached by ``realize`` with the shipped rules,
every compute node at the ILP's layout, the sequence replays, and the plan is priced as the ILP's."""
from __future__ import annotations

import re

import pytest

from unity_pcg.machine import parse_machine
from unity_pcg.pcg import PCG
from unity_pcg.search.cost import CostModel
from unity_pcg.search.layouts import propose
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.realize import NodeLayout, layout_of, realize
from unity_pcg.search.substitution import RuleBook, replay, trimmed
from unity_pcg.substitutions.templates import conv_channel_rules

BOOK = RuleBook()


def small_cnn(batch=1, c=256, hw=16, groups=1) -> PCG:
    """conv1 3x3 -> BatchNorm -> Relu -> max pool 2x2/2 -> conv2 3x3 (``groups``: grouped / depthwise)."""
    b = PCG.builder()
    x = b.add("Input", {"name": "x", "shape": (batch, c, hw, hw)})

    def w(name, shape):
        return b.add("Weight", {"name": name, "shape": shape})
    y = b.add("Conv2d", {"padding": (1, 1, 1, 1)}, [x, w("conv1.w", (c, c, 3, 3))], name="conv1")
    y = b.add("BatchNorm", {}, [y] + [w(f"bn.{k}", (c,)) for k in ("g", "b", "m", "v")], name="bn")
    y = b.add("Relu", {}, [y], name="relu")
    y = b.add("Pool2d", {"kind": "max", "kernel": (2, 2), "stride": (2, 2)}, [y], name="pool")
    y = b.add("Conv2d", {"padding": (1, 1, 1, 1), "groups": groups}, [y, w("conv2.w", (c, c // groups, 3, 3))],
              name="conv2")
    b.set_outputs([y])
    return b.finish()


def _reach(g, machine, mesh):
    m = parse_machine(machine)
    mapper = MachineMapper(CostModel(m))
    p = propose(g, m, mesh, mapper=mapper, time_limit_s=30)
    assert p.pcg is not None, p.status
    want = layout_of(p.pcg, g)
    by_name = {g.node(k).label(): want[k] for k in want}
    r = realize(g, p.pcg, BOOK)
    assert r.complete, r.missing
    assert all(NodeLayout.of(r.pcg, r.ids[k]) == want[k] for k in want)
    assert replay(g, r.steps, BOOK).structural_hash() == r.pcg.structural_hash()
    return by_name, r, mapper.optimize(trimmed(r.pcg)).cost, mapper.optimize(p.pcg).cost


@pytest.mark.parametrize("machine,mesh,groups,conv2_rule", [
    ("h100:1x4", (2, 2), 1, "conv_out_channels"),     # both convolutions split on their output channels
    ("local:1x2", (1, 2), 256, "conv_groups"),        # the second a depthwise convolution, split by groups
])
def test_channel_parallel_ilp_layout_at_the_ilp_price(machine, mesh, groups, conv2_rule):
    g = small_cnn(groups=groups)
    want, r, got, ilp = _reach(g, machine, mesh)
    # the target is channel parallel: conv1's weight split on its output channels, BatchNorm's parameters alike
    assert want["conv1"].inputs[1].degrees[0] > 1 and want["bn"].inputs[1].degrees[0] > 1
    assert want["pool"].outputs[0].degrees[1] > 1
    used = {s.rule.split("~")[0] for s in r.steps}
    assert {"conv_out_channels", "split_BatchNorm_channels", "split_Pool2d", conv2_rule} <= used
    assert got <= ilp * (1 + 1e-9), (got, ilp)


def test_input_channel_split_reduces_partial_sums():
    # on a 1 x 4 mesh the ILP splits conv2 on its input channels (partial sums): reached by conv_in_channels; the
    # ILP leaves the graph output reduce-scattered on the channels, which rules keep whole (a graph output's
    # parallel shape never changes), so the price is compared with that last step only
    g = small_cnn()
    want, r, got, ilp = _reach(g, "h100:1x4", (1, 4))
    assert want["conv2"].outputs[0].sum_degree == 4 and want["conv2"].inputs[1].degrees[1] == 4
    assert "conv_in_channels" in {s.rule.split("~")[0] for s in r.steps}
    assert got <= ilp * 1.05, (got, ilp)


def test_without_the_channel_rules_the_layout_is_missed():
    # the same target with the CNN channel rules left out of the book: the convolutions and BatchNorm are named
    # as missed (so the rules above are what reaches it)
    g = small_cnn()
    m = parse_machine("h100:1x4")
    p = propose(g, m, (2, 2), mapper=MachineMapper(CostModel(m)), time_limit_s=30)
    drop = {x.name for x in conv_channel_rules()}
    book = RuleBook([x for x in BOOK.rules if x.name.split("~")[0] not in drop])
    r = realize(g, p.pcg, book)
    assert not r.complete
    missed = {m.group(1) for m in (re.search(r"\((\w+)\)", line) for line in r.missing) if m}
    assert {"Conv2d", "BatchNorm"} <= missed
