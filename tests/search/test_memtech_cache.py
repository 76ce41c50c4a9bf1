"""Memory-technique pricing with its caches and array walk (search/memtech.py ``Techniques._memory``,
``_comm_stream``, ``_peak``) gives exactly what a straightforward pricing gives: every plan priced afresh,
nothing reused between plans, the backward walked step by step (``Techniques.backward_peak``)."""
from __future__ import annotations

import dataclasses
import random
from itertools import product
from typing import Mapping

import pytest

from unity_pcg.machine import MachineSpec, parse_machine
from unity_pcg.plan import MemoryPlan, RecomputeRegion
from unity_pcg.search import memtech
from unity_pcg.search.baselines import build_strategy, data_parallel
from unity_pcg.search.cost import CostModel, GraphCost
from unity_pcg.search.mapping import MachineMapper
from unity_pcg.search.split import synthetic_transformer

from .graphs import mlp


class _Reference(memtech.Techniques):
    """The straightforward pricing: every cache emptied before each plan, the weights and the activations
    one at a time, the backward's peak from the step-by-step walk over :meth:`kept_items` and :meth:`recomputed_items`."""

    def price(self, mem):
        self._memo.clear()
        self._act_cache.clear()
        self._runs_cache.clear()
        self._fracs_cache.clear()
        return super().price(mem)

    # the loops over the weights, the touched tensors and the kept items, as search/memtech.py summed them before
    def weight_bytes(self, zero: int, offload: bool) -> dict:
        """Device -> bytes of weights, gradients and optimizer states with ZeRO ``zero`` and ``offload``
        (the base weights of the mapping, less what the techniques take off, plus stage 3's working copy)."""
        w = dict(self.base_report.weights)
        k = self.states
        gathered: dict = {}             # device -> unit -> bytes gathered beyond the owned shard
        for x in self.weights:
            c = x.copies
            p = x.nbytes
            param = p / c if zero >= 3 else p
            grad = p / c if zero >= 2 else p
            st = 0.0 if offload else (k * p / c if zero >= 1 else k * p)
            if 1 <= zero <= 2 and not offload:
                st += p / c          # the optimizer's own copy of the updated shard (all-gathered after)
            save = (2 + k) * p - (param + grad + st)
            for d in x.devices:
                w[d] = w.get(d, 0) - save
                if zero >= 3 and c > 1:
                    u = gathered.setdefault(d, {})
                    u[x.unit] = u.get(x.unit, 0) + p - p / c
        for d, u in gathered.items():
            top = sorted(u.values(), reverse=True)[:memtech.GATHERED_UNITS]
            w[d] = w.get(d, 0) + sum(top)
        return w

    def activation_bytes(self, assign: Mapping[int, tuple]) -> tuple[dict, dict]:
        """(device -> activation bytes, device -> recomputation's transient peak), one tensor at a time."""
        a = dict(self.base_report.activations)
        runs = self._runs(assign)
        touched = self._touched(runs)
        transient: dict = {}
        per_region: dict = {}          # per checkpointed run: what its recomputation brings back at once
        for key in touched:
            t = self.tensors[key]
            f = self._frac(t, runs)
            if f == t.base:
                continue
            for d, b in t.mask_dev.items():
                a[d] = a.get(d, 0) - b
            for d, b in self._bytes(t, f).items():
                a[d] = a.get(d, 0) + b
            if f < t.base and t.producer in runs:
                acc = per_region.setdefault(runs[t.producer], {})
                for d, b in t.mask_dev.items():
                    acc[d] = acc.get(d, 0) + b - self._bytes(t, f).get(d, 0)
        for n in runs:                 # autocast copies inside a run: recomputed
            for d, b in self.cast_act.get(n, {}).items():
                a[d] = a.get(d, 0) - b
                acc = per_region.setdefault(runs[n], {})
                acc[d] = acc.get(d, 0) + b
        if not per_region:
            return a, transient
        # a run is recomputed when the backward reaches it: what was kept for the operators after it is
        # freed by then (each kept tensor counted as freed once the backward passes its release step,
        # Techniques._release: its last saver; a graph output first)
        end: dict = {}
        for n, j in runs.items():
            end[j] = max(end.get(j, -1), self.exec_pos[n])
        kept = sorted(self.kept_items(assign, casts=False), key=lambda x: x[0])
        total: dict = {}
        for _, b in kept:
            for d, x in b.items():
                total[d] = total.get(d, 0) + x
        before: dict = {}
        i = 0
        for j in sorted(per_region, key=end.__getitem__):
            while i < len(kept) and kept[i][0] <= end[j]:
                for d, x in kept[i][1].items():
                    before[d] = before.get(d, 0) + x
                i += 1
            for d, b in per_region[j].items():
                extra = b - (total.get(d, 0) - before.get(d, 0))
                if extra > transient.get(d, 0):
                    transient[d] = extra
        return a, transient

    def _peak(self, a, act, made, base, held=()):
        assign = act["assign"]
        return self.backward_peak(a, self.kept_items(assign), made, base,
                                  self.recomputed_items(assign) + list(held))


def _with_capacity(m: MachineSpec, cap: int) -> MachineSpec:
    return dataclasses.replace(m, device=dataclasses.replace(m.device, memory_bytes=int(cap)))


def _cases():
    return [
        ("mlp dp", lambda: data_parallel(mlp(batch=256, h=64, layers=8), 4), "h100:1x4", "fp32"),
        ("transformer megatron bf16", lambda: build_strategy(synthetic_transformer(2, batch=8, seq=64, hidden=128,
                                                                                   heads=4), "megatron", 4),
         "h100:1x4", "bf16"),
        ("transformer dp 2 nodes", lambda: build_strategy(synthetic_transformer(3, batch=8, seq=32, hidden=64,
                                                                                heads=2), "dp", 4,
                                                          devices_per_node=2), "h100:2x2", "fp32"),
        ("mlp one device", lambda: mlp(batch=512, h=64, layers=12), "h100:1x1", "fp32"),
    ]


def _plans(regs, rnd):
    out = []
    for z, o in product(range(4), (False, True)):
        out.append(MemoryPlan(z, o))
        for mode in ("full", "selective"):
            out.append(MemoryPlan(z, o, memtech.recompute_all(regs, mode)))
        for _ in range(3):           # random subsets of the regions in mixed modes
            sub = tuple(RecomputeRegion(tuple(r), rnd.choice(("full", "selective"))) for r in regs
                        if rnd.random() < 0.5)
            out.append(MemoryPlan(z, o, sub))
    return out


@pytest.mark.parametrize("name,build,spec,precision", _cases(), ids=[c[0] for c in _cases()])
def test_cached_pricing_equals_the_straightforward_one(name, build, spec, precision):
    g = build()
    m = parse_machine(spec)
    cm = CostModel(m, optimizer="adam", precision=precision)
    r = MachineMapper(cm).optimize(g, techniques=False)
    gc = GraphCost(g, cm)
    new = memtech.Techniques(gc, r.views, r.cost)
    ref = _Reference(gc, r.views, r.cost)
    assert new.regions and new.weights
    rnd = random.Random(7)
    plans = _plans(new.regions, rnd)
    order = plans + rnd.sample(plans, len(plans))      # every plan twice, the second time from the caches
    for mem in order:
        a, b = new.price(mem), ref.price(mem)
        assert dataclasses.asdict(a) == dataclasses.asdict(b), (name, mem)
    # the array sums against the loops, on their own
    for mem in plans:
        assign = {n: (i, x.mode) for i, x in enumerate(mem.recompute) for n in x.nodes}
        assert new.activation_bytes(assign) == _Reference.activation_bytes(new, assign)
        assert new.weight_bytes(mem.zero, mem.offload) == _Reference.weight_bytes(new, mem.zero, mem.offload)
        act = new._activations(tuple(sorted(assign.items())), assign)
        made = new._made(new._zero_class(mem.zero))
        bucket = new.bucket_bytes(mem.zero)
        assert new._peak(act["a"], act, made, bucket) == \
            new.backward_peak(act["a"], new.kept_items(assign), made, bucket, new.recomputed_items(assign))


@pytest.mark.parametrize("name,build,spec,precision", _cases(), ids=[c[0] for c in _cases()])
def test_choose_is_unchanged_when_memory_is_short(name, build, spec, precision):
    """Capacities between "every region recomputed" and "nothing recomputed": the exact and the greedy
    choice (``exact_limit`` 0) price many recomputations; the choice and its numbers are the reference's."""
    g = build()
    m = parse_machine(spec)
    cm = CostModel(m, optimizer="adam", precision=precision)
    r = MachineMapper(cm).optimize(g, techniques=False)
    t0 = memtech.Techniques(GraphCost(g, cm), r.views, r.cost)
    lo = t0.price(MemoryPlan(recompute=memtech.recompute_all(t0.regions, "full"))).max_bytes
    hi = t0.price(MemoryPlan()).max_bytes
    for cap in (hi - 1, (lo + hi) // 2, lo + 1):
        gc = GraphCost(g, CostModel(_with_capacity(m, cap), optimizer="adam", precision=precision))
        for limit in (memtech.EXACT_LIMIT, 0):
            a = memtech.Techniques(gc, r.views, r.cost).choose(exact_limit=limit)
            b = _Reference(gc, r.views, r.cost).choose(exact_limit=limit)
            assert dataclasses.asdict(a) == dataclasses.asdict(b), (name, cap, limit)
