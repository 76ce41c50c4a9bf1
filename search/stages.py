"""Pipeline stages: the sequential structure of a PCG, its clustering into layers, and the stage DP over
layers x sub-meshes.  Shared by Unity's pipeline search (:mod:`unity_pcg.search.pipeline`) and Alpa's
inter-operator pass (:mod:`unity_pcg.search.alpa.inter`); each caller supplies its own stage prices.

**Structure** (:func:`analyze`).  The *units* of a PCG (a compute node with its placement chains,
:func:`unity_pcg.search.sp.build_units`) in topological order; per cut ``c`` (between unit ``c-1`` and ``c``)
the activation tensors crossing it and whether it may be cut.  A cut is invalid where a trained weight is
read on both sides, a partial sum or a tensor that may not cross a stage boundary (:func:`may_cross`)
crosses it, or an integer model input is read after it (the executor sends only floating tensors).

**Clustering** (:func:`cluster`).  Contiguous runs of units (*layers*) that start at allowed cuts: every
valid cut (``cuts="valid"``, Alpa's Eq. 6) or the valid cuts the fewest tensors cross (``cuts="fewest"``,
the single-tensor bottlenecks of a chain: Unity).  One DP over the allowed cuts chooses ``L = min(layers,
allowed cuts + 1)`` layers (never more than one layer per allowed cut, so it never refuses: the whole graph
is one layer), minimizing, in this order, (1) with ``inputs=True`` the largest number of bytes a layer reads
from earlier layers (Alpa's ``G(k, r) = min_i max{G(i-1, r-1), C(i, k)}``), (2) the FLOP imbalance:
``balance="layers"``, the sum of squared deviations of the layers' FLOPs from ``total / L`` (identical blocks
make identical layers); ``balance="cuts"``, the sum of squared deviations of each boundary's FLOPs before it
from its quantile ``r total / L`` (boundary r near the r-th quantile, so that runs of ``L / S`` layers make
``S`` balanced stages for every ``S`` dividing ``L``: where units do not divide evenly, the layer sizes are
spread along the chain instead of in any order of equal variance); subject to every layer's FLOPs at most
``(1 + delta) total / L`` (``delta=None``: no bound), the bound doubled until a layering meets it.  A graph
without FLOPs weighs each unit as one.  Alpa: ``cluster(g, roles, L)`` (valid cuts, inputs, ``delta=0.5``,
layers); Unity: ``cuts="fewest", inputs=False, delta=None, balance="cuts"``.

**The stage DP** (:func:`stage_dp`, Alpa's Eqs. 2-5).  Stages are contiguous runs of layers, each on one of
the sub-mesh *options* ``sizes[j]`` laid out left to right over ``devices`` devices (a stage's ``start``: the
devices before it).  For each bound ``t_max`` on a stage's time (ascending), for every stage count ``S``
the DP finds the stages of least total cost ``sum(t + extra + entry)`` with every ``t <= t_max``, every stage
holding the micro-batches 1F1B keeps in flight (Eq. 5: ``min(stages from it to the last, B)``) and the
options allowed where they start; each plan found is scored (default Eq. 2: ``sum t + (B - 1) max t``).  Close
bounds may be merged into one run at the largest (:func:`t_max_bounds`).  The loop stops once ``B`` times the
smallest stage time a bound newly admits reaches the best score (no later bound can do better), or at the deadline
(with the best plans found; when none was found yet it runs once at the largest bound, which admits every
plan).  Costs within ``tie`` (relative) of the least are equal and the smaller largest stage time wins.
Vectorized with numpy over (first layer, last layer, start).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from functools import reduce
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from unity_pcg import ops
from unity_pcg.errors import UnityError
from unity_pcg.machine import MachineSpec, Resource
from unity_pcg.pcg import PCG

from .budget import Deadline, check
from .sp import build_units

INF = math.inf


class PipelineError(UnityError, ValueError):
    """A pipeline that cannot be built (no cut, batch not divisible by the micro-batches, ...)."""


# --- the sequential structure ---------------------------------------------------------------------------

def may_cross(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` may cross a stage boundary (the executor's stages exchange floating
    tensors only; model inputs a later stage reads are sent along too, so an integer input read after a
    cut makes it one the executor cannot run)."""
    return str(dtype).startswith(("float", "bfloat"))


@dataclass
class Cuts:
    """The sequential structure of a PCG: units in order, the tensors live across each cut."""
    units: list                    # unit index (in order) -> tuple of node ids
    crossing: list                 # cut c (between unit c-1 and c), c = 1..U-1 -> list of refs
    valid: list                    # cut c -> bool
    flops: list                    # unit -> forward FLOPs
    roles: dict

    def nodes(self, first: int, end: int) -> list:
        """The node ids of units ``first..end-1``."""
        return [n for u in range(first, end) for n in self.units[u]]


def analyze(g: PCG, roles: Mapping[int, str]) -> Cuts:
    """The units of ``g`` in topological order and its cuts (module docstring).  Raises PipelineError for a
    model that draws random numbers (the executor pipelines no generator)."""
    gen = next((n for n in g.nodes() if n.op in ("RandomNormal", "RandomUniform")), None)
    if gen is not None:
        raise PipelineError(f"no pipeline for a model that draws random numbers ({gen.label()}): the executor "
                            f"runs random generators only in plans without pipeline stages")
    units, unit_of, main = build_units(g, dict(roles))
    pos = {nid: i for i, nid in enumerate(g.topo_order())}
    order = sorted(range(len(units)), key=lambda u: pos[main[u]])
    rank = {u: k for k, u in enumerate(order)}
    U = len(units)
    first: dict = {}
    last: dict = {}
    for u in order:
        for nid in units[u]:
            for r in g.node(nid).inputs:
                r = tuple(r)
                v = unit_of.get(r[0])
                if v is None:
                    continue
                q, p = rank[v], rank[u]
                if q < p:
                    first[r] = q
                    last[r] = max(last.get(r, p), p)
    crossing: list = [[] for _ in range(U)]
    valid = [True] * U
    for r, q in first.items():
        role = roles[r[0]]
        for c in range(q + 1, last[r] + 1):
            if role == "input-placement":
                continue                   # the loader feeds the data again
            if role == "weight-placement" or g.shape(r).sum_degree > 1 or not may_cross(g.shape(r).dtype):
                valid[c] = False           # a weight used on both sides, partial sums, or not floating
            else:
                crossing[c].append(r)
    # the executor sends a model input from the first stage to every stage up to its last reader: an
    # integer one (token ids, masks) read after a cut would cross it (may_cross)
    for u in order:
        for nid in units[u]:
            for r in g.node(nid).inputs:
                if roles[r[0]] in ("input", "input-placement") and not may_cross(g.shape(tuple(r)).dtype):
                    for c in range(1, rank[u] + 1):
                        valid[c] = False
    # a trained Weight read by units on both sides of a cut
    trained = {n.id for n in g.sources("Weight") if g.is_trainable(n.id)}
    for n in g.sources("Weight"):
        us = set()
        for nid, _ in g.consumers((n.id, 0)):
            if nid in unit_of:
                us.add(rank[unit_of[nid]])
            else:
                stack = [nid]
                while stack:           # a weight read through a chain that is its own unit
                    x = stack.pop()
                    if x in unit_of:
                        us.add(rank[unit_of[x]])
                    else:
                        stack.extend(c for c, _ in g.consumers((x, 0)))
        if len(us) > 1 and n.id in trained:
            for c in range(min(us) + 1, max(us) + 1):
                valid[c] = False
    fl = []
    for u in order:
        f = 0.0
        for nid in units[u]:
            n = g.node(nid)
            if n.kind == "compute":
                f += ops.flops(n.op, n.a, g.input_shapes(nid), g.shapes(nid))
        fl.append(f)
    return Cuts([units[u] for u in order], crossing, valid, fl, dict(roles))


def layer_inputs(g: PCG, info: Cuts, rows: Sequence[int] | None = None,
                 cols: Sequence[int] | None = None) -> np.ndarray:
    """``C[i, k]``: the bytes units ``i..k`` read from units before ``i`` (Alpa's Eq. 6 communication);
    with ``rows`` / ``cols`` (unit indices, ``cols`` ascending) ``C[np.ix_(rows, cols)]``."""
    U = len(info.units)
    rows = range(U) if rows is None else rows
    cols = range(U) if cols is None else cols
    diff = np.zeros((len(rows), len(cols)))
    for k, inc in enumerate(input_columns(g, info, rows, cols)):
        for j, nb in inc:
            diff[j, k] += nb
    return np.cumsum(diff, axis=1)


def input_columns(g: PCG, info: Cuts, rows: Sequence[int], cols: Sequence[int]) -> list[list[tuple[int, float]]]:
    """:func:`layer_inputs`'s matrix ``C[np.ix_(rows, cols)]`` column by column, as increments: entry ``k`` lists
    the (row index, bytes) that column ``k`` adds to column ``k - 1`` (nothing dense: on a decoder of 80
    layers every one of 3,763 units may start a layer, a 14 M-entry matrix of which the clustering reads
    the part its FLOP bound allows, a column at a time)."""
    roles = info.roles
    units = info.units
    rows = [int(i) for i in rows]
    cols = [int(k) for k in cols]
    if any(a >= b for a, b in zip(cols, cols[1:])):
        raise ValueError("input_columns: cols must be ascending")
    row_of: dict = {}
    for j, i in enumerate(rows):
        row_of.setdefault(i, []).append(j)
    unit_of = {nid: u for u, ns in enumerate(units) for nid in ns}
    readers: dict = {}
    for u, ns in enumerate(units):
        for nid in ns:
            for r in g.node(nid).inputs:
                r = tuple(r)
                q = unit_of.get(r[0])
                if q is None or q >= u or roles.get(r[0]) in ("input-placement", "weight-placement"):
                    continue
                readers.setdefault(r, (q, set()))[1].add(u)
    out: list = [[] for _ in cols]
    wanted = sorted(row_of)
    for r, (q, us) in readers.items():
        nb = float(g.shape(r).nbytes)
        cons = sorted(us)
        j = 0
        # every wanted row i in q+1..last reader: the tensor counts from its first reader at or after i,
        # in the first column at or after that reader
        for i in wanted[bisect.bisect_left(wanted, q + 1):bisect.bisect_right(wanted, cons[-1])]:
            while cons[j] < i:
                j += 1
            k = bisect.bisect_left(cols, cons[j])
            if k < len(cols):
                out[k].extend((jr, nb) for jr in row_of[i])
    return out


# --- clustering units into layers ------------------------------------------------------------------------

def allowed_cuts(info: Cuts, cuts: str = "valid") -> list[int]:
    """The cuts a layer may start at (besides 0): every valid one, or the valid ones the fewest tensors cross."""
    cand = [c for c in range(1, len(info.units)) if info.valid[c]]
    if cuts == "fewest" and cand:
        low = min(len(info.crossing[c]) for c in cand)
        cand = [c for c in cand if len(info.crossing[c]) == low]
    elif cuts not in ("valid", "fewest"):
        raise ValueError(f"cuts must be 'valid' or 'fewest', got {cuts!r}")
    return cand


def cluster(g: PCG, roles: Mapping[int, str], layers: int, *, cuts: str = "valid", inputs: bool = True,
            delta: float | None = 0.5, balance: str = "layers", info: Cuts | None = None) -> tuple[list, Cuts]:
    """Cluster the units of ``g`` into at most ``layers`` layers (module docstring; ``balance``: "layers" or
    "cuts").  Returns ``(layers, info)``: per layer ``(first unit, last unit + 1)``, covering the units in
    order, and :func:`analyze`'s structure.  Never refuses (fewer allowed cuts: fewer layers, down to the
    whole graph as one).  The clustering DP checks the deadline of the thread's :func:`search.budget.within`
    scope at its loop heads (raises :class:`search.budget.Expired` once it has passed; none: unbounded)."""
    if balance not in ("layers", "cuts"):
        raise ValueError(f"balance must be 'layers' or 'cuts', got {balance!r}")
    check()
    info = info or analyze(g, roles)
    check()
    U = len(info.units)
    pos = [0] + allowed_cuts(info, cuts) + [U]          # where layers may start or end
    L = max(1, min(int(layers), len(pos) - 1))
    fl = np.array(info.flops, dtype=float)
    if not fl.sum() > 0:
        fl = np.ones(U)
    pre = np.concatenate([[0.0], np.cumsum(fl)])[pos]   # cumulative FLOPs at each position
    C = input_columns(g, info, pos[:-1], [p - 1 for p in pos[1:]]) if inputs else None
    total = pre[-1]
    bound = INF if delta is None else (1 + delta) * total / L
    for _ in range(64):
        check()
        res = _cluster_dp(C, pre, L, bound, balance == "cuts")
        if res is not None:
            return [(pos[a], pos[b]) for a, b in res], info
        bound *= 2
    raise PipelineError("operator clustering found no layering")  # pragma: no cover - one layer meets a bound


def _cluster_dp(C, pre, L, bound, at_cuts=False):
    """Over positions 0..P-1 (``pre``: cumulative FLOPs there; ``C[a, b-1]``: bytes the layer from position
    a to b reads from before a, given as :func:`input_columns`'s increments, or None): G[r, b] the least
    (largest input, imbalance) of r layers ending at b; the imbalance a sum over layers of
    (FLOPs - total / L)^2, or with ``at_cuts`` over boundaries r of (FLOPs before it - r total / L)^2."""
    P = len(pre)
    total = pre[-1]
    target = total / L
    G = np.full((L + 1, P), INF)
    V = np.full((L + 1, P), INF)
    arg = np.zeros((L + 1, P), dtype=int)
    G[0, 0] = V[0, 0] = 0.0
    for r in range(1, L + 1):
        check()                     # the scope's deadline: O(L P^2) on a graph of thousands of cuts
        col = np.zeros(P)           # C[:, b - 1], built a column at a time
        for b in range(1, P):
            if not b & 255:
                check()
            if C is not None:
                for j, nb in C[b - 1]:
                    col[j] += nb
            # the layer's FLOPs pre[b] - pre[a] fall as a grows (pre is a cumulative sum): only the suffix
            # a0..b-1 is within the bound (what lies before it would price inf)
            a0 = int(np.searchsorted(pre, pre[b] - bound, side="left")) if math.isfinite(bound) else 0
            a0 = min(a0, b)
            while a0 > 0 and pre[b] - pre[a0 - 1] <= bound:
                a0 -= 1
            while a0 < b and not pre[b] - pre[a0] <= bound:
                a0 += 1
            a = np.arange(a0, b)
            fl = pre[b] - pre[a]
            ok = (fl <= bound) & np.isfinite(G[r - 1, a])
            if not ok.any():
                continue
            comm = np.where(a > 0, col[a0:b], 0.0) if C is not None else np.zeros(b - a0)
            cand = np.where(ok, np.maximum(G[r - 1, a], comm), INF)
            best = cand.min()
            tie = ok & (cand <= best * (1 + 1e-9) + 1e-12)
            term = (pre[b] - r * target) ** 2 if at_cuts else (fl - target) ** 2
            dev = np.where(tie, V[r - 1, a] + term, INF)
            j = int(np.argmin(dev))
            G[r, b], V[r, b], arg[r, b] = best, dev[j], a0 + j
    if not math.isfinite(G[L, P - 1]):
        return None
    out = []
    b = P - 1
    for r in range(L, 0, -1):
        a = int(arg[r, b])
        out.append((a, b))
        b = a
    return out[::-1]


# --- sub-meshes and stage structure --------------------------------------------------------------------

def sub_mesh(machine: MachineSpec, start: int, size: int) -> Resource | None:
    """The block of ``size`` devices from ``start`` if it is a Resource (inside one node, or whole nodes)."""
    D = machine.devices_per_node
    if size < 1 or start < 0 or start + size > machine.num_devices:
        return None
    if size <= D and start % D + size <= D:
        return Resource(start, 1, size)
    if start % D == 0 and size % D == 0:
        return Resource(start, size // D, D)
    return None


def structure_key(g: PCG) -> tuple:
    """The structure of ``g`` with node names and ids left out (repeated layers share it): the memo key of
    stage prices."""
    idx: dict = {}
    items = []
    for nid in g.topo_order():
        n = g.node(nid)
        idx[nid] = len(items)
        items.append((n.op, tuple((k, v if not isinstance(v, list) else tuple(v)) for k, v in n.attrs
                                  if k != "name"), tuple((idx[r[0]], r[1]) for r in n.inputs)))
    return tuple(items), tuple((idx[r[0]], r[1]) for r in g.outputs)


# --- the stage DP ----------------------------------------------------------------------------------------

class Stage(NamedTuple):
    first: int          # first layer
    end: int            # last layer + 1
    option: int         # index into the DP's sub-mesh sizes
    start: int          # devices before it


@dataclass
class StagePlans:
    plans: list                 # (score, stages) of every distinct plan found, in the order found
    tried: int = 0              # bounds t_max the DP ran at
    dp_s: float = 0.0
    cut: bool = False           # the deadline stopped the loop over t_max

    def best(self):
        """The plan of least score (the first found among equals), or None."""
        return min(self.plans, key=lambda x: x[0]) if self.plans else None


def holds(w: Mapping, a: Mapping, capacity: float) -> float:
    """The most micro-batches a stage can keep in flight: the largest integer ``n`` with ``w[d] + n a[d] <=
    capacity`` on every device (``w``: weights, gradients, optimizer states; ``a``: one micro-batch's
    activations); ``inf`` without activations, -1 when the weights alone do not fit."""
    n = INF
    for d in set(w) | set(a):
        wd, ad = w.get(d, 0), a.get(d, 0)
        if wd > capacity:
            return -1
        if ad <= 0:
            continue
        k = math.floor((capacity - wd) / ad)
        while k >= 0 and wd + k * ad > capacity:
            k -= 1
        while wd + (k + 1) * ad <= capacity:
            k += 1
        n = min(n, k)
    return n


def t_max_bounds(values, rel: float = 0.0, eps: float = 0.0, most: int | None = None) -> list[tuple[float, float]]:
    """Stage-time bounds for :func:`stage_dp`, ascending ``(low, high)`` pairs: the finite ``values`` clustered
    (a value within ``eps`` seconds or ``rel`` of its cluster's smallest joins it); the DP runs at a cluster's
    largest value (admitting every plan its values admit) and stops before a cluster whose smallest, times
    the micro-batches, reaches the best score; ``rel`` doubles (from 1%) while more than ``most`` remain."""
    vals = sorted({float(v) for v in np.asarray(values, dtype=float).ravel() if math.isfinite(v)})
    while True:
        merged: list = []
        for t in vals:
            if merged and (t <= merged[-1][0] * (1 + rel) or t - merged[-1][0] < eps):
                merged[-1][1] = t
            else:
                merged.append([t, t])
        if most is None or len(merged) <= most:
            return [(a, b) for a, b in merged]
        rel = rel * 2 if rel > 0 else 0.01


class _Columns:
    """The DP's per-stage arrays ``[k, i, j]`` (time, micro-batches held, extra terms) and entry costs
    ``[k, p, j]``: given as arrays, or filled from the callbacks, every ``(k, i)`` of an option that may run
    a non-last stage at once, an option only ever last (``i = L - 1``) when the DP first reaches it."""

    def __init__(self, L, J, P, g, cost, fits, extra, entry, allow_nl, allow_last):
        self.L, self.g, self.allow = L, g, allow_nl | allow_last
        self.f = {"t": cost, "hold": fits}
        self.f.update({("x", n): e for n, e in enumerate(extra)})
        fill = {"t": INF, "hold": -1.0}
        self.a = {}
        for key, f in self.f.items():
            if f is None:
                self.a[key] = None
            elif callable(f):
                self.a[key] = np.full((L, L, J), fill.get(key, 0.0))
            else:
                self.a[key] = np.asarray(f, dtype=float)
        self.entry = entry
        self.E = np.zeros((L, P, J)) if entry is None or callable(entry) else np.asarray(entry, dtype=float)
        self.pending = set()
        for j in range(J):
            if allow_nl[:, j].any():
                self._fill(j, [(k, i) for k in range(L) for i in range(k, L)])
            elif allow_last[:, j].any():
                self.pending.add(j)
        self.a["t"] = np.where(np.triu(np.ones((L, L), dtype=bool))[:, :, None], self.a["t"], INF)

    def _fill(self, j, rows):
        for key, f in self.f.items():
            if callable(f):
                for k, i in rows:
                    self.a[key][k, i, j] = f(k, i, j)
        if callable(self.entry):
            for k in range(self.L):
                for p in np.nonzero(self.allow[:, j])[0]:
                    self.E[k, p, j] = self.entry(k, int(p) * self.g, j)

    def need(self, j):
        """Option ``j``'s last-stage column, filled on first use."""
        if j in self.pending:
            self.pending.discard(j)
            self._fill(j, [(k, self.L - 1) for k in range(self.L)])


def stage_dp(layers: int, sizes: Sequence[int], devices: int, micro_batches: int, cost, *,
             fits=None, extra: Sequence | None = None, entry=None, allowed=None, min_stages: int = 1,
             max_stages: int | None = None, bounds=None, score: Callable | None = None, tie: float = 0.0,
             deadline: Deadline | None = None) -> StagePlans:
    """The stage DP (module docstring).

    ``cost(k, i, j)`` (or an array ``[k, i, j]``): seconds per micro-batch of the stage of layers ``k..i`` on
    option ``j`` of ``sizes`` (``inf``: impossible).  ``fits(k, i, j)`` (or an array): the most micro-batches
    the stage holds in flight (:func:`holds`); None: any number.  ``extra``: per-stage terms ``[k, i, j]``
    (callables or arrays, None for nothing) added to ``cost`` in the DP's objective, one DP run per term
    (default: one run on ``cost`` alone).  ``entry(k, d, j)``: added for a stage from layer ``k`` on option
    ``j`` after ``d`` devices (an inter-stage transfer).  ``allowed(d, j, last)``: whether option ``j`` may
    start after ``d`` devices (``last``: as the last stage, which ends at ``devices``); default: anywhere.
    Stage counts ``min_stages..max_stages`` (default 1..layers).  ``bounds``: the ``t_max`` values, or
    ``(low, high)`` pairs of :func:`t_max_bounds` (the DP runs at ``high`` and stops once ``B low`` reaches
    the best score), or a callable of the cost array giving them (in it, options only ever last are not
    priced yet: the DP prices them where it first reaches them); default: every distinct stage time.
    ``score(stages)``: a plan's score (default Eq. 2).  ``tie``: DP costs within this relative difference
    are equal and the smaller largest stage time wins (0: the first of the least, in option then layer
    order).  ``deadline``: checked before each bound.

    Returns every distinct plan found (tuples of :class:`Stage`) with its score."""
    t0 = time.perf_counter()
    L, T, B, J = int(layers), int(devices), int(micro_batches), len(sizes)
    S_max = L if max_stages is None else max(1, min(int(max_stages), L))
    sizes = [int(s) for s in sizes]
    g = reduce(math.gcd, [s for s in sizes if s <= T], T)
    P = T // g + 1                                        # start positions 0, g, 2g, .., T
    allow_nl = np.zeros((P, J), dtype=bool)
    allow_last = np.zeros((P, J), dtype=bool)
    for p in range(P):
        d = p * g
        for j, s in enumerate(sizes):
            if s % g or d + s > T:
                continue
            last = d + s == T
            if allowed is None or allowed(d, j, last):
                (allow_last if last else allow_nl)[p, j] = True
    cols = _Columns(L, J, P, g, cost, fits, list(extra or ()), entry, allow_nl, allow_last)
    t = cols.a["t"]
    if bounds is None:                  # every stage time (options only ever last filled now)
        for j in sorted(cols.pending):
            cols.need(j)
        bounds = t_max_bounds(t[np.isfinite(t)])
    elif callable(bounds):
        bounds = bounds(t)
    vals = [(float(b), float(b)) if np.ndim(b) == 0 else (float(b[0]), float(b[1])) for b in bounds]
    if score is None:
        def score(stages):
            ts = [t[s.first, s.end - 1, s.option] for s in stages]
            return sum(ts) + (B - 1) * max(ts)
    steps = [s // g for s in sizes]
    nl = [j for j in range(J) if allow_nl[:, j].any()]
    ends_of = {j: np.nonzero(allow_nl[:, j])[0] + steps[j] for j in nl}
    pairs = [[j for j in range(J) if allow_last[p, j]] for p in range(P)]
    rounds = []                         # the last stages' (position, option) pairs, one per position a round
    for n in range(max((len(x) for x in pairs), default=0)):
        ps = [p for p in range(P) if len(pairs[p]) > n]
        rounds.append((np.array(ps, dtype=int), np.array([pairs[p][n] for p in ps], dtype=int)))
    out = StagePlans([])
    seen: set = set()
    best = INF
    late = False
    for low, t_max in vals:
        if deadline is not None and not late and deadline.passed():
            out.cut = True
            if out.plans:
                break
            fin = t[np.isfinite(t)]     # once more at the largest bound, admitting every plan
            late, low, t_max = True, vals[-1][0], max(vals[-1][1], float(fin.max()) if fin.size else -INF)
        if B * low >= best:
            break
        out.tried += 1
        for term in ([None] if not extra else [("x", n) for n in range(len(extra))]):
            for stages in _dp(cols, term, steps, nl, rounds, ends_of, allow_nl, L, P, B, S_max, t_max, tie, g):
                if len(stages) < min_stages or stages in seen:
                    continue
                seen.add(stages)
                sc = score(stages)
                out.plans.append((sc, stages))
                best = min(best, sc)
        if late:
            break
    out.dp_s = time.perf_counter() - t0
    return out


def _dp(cols, term, steps, nl, rounds, ends_of, allow_nl, L, P, B, S_max, t_max, tie, g):
    """One DP at ``t_max``: F_r[k, p] the least cost of layers k..L-1 in r stages from position p to the end
    (with ``tie``, MX_r the largest stage time of that plan); the best plan per stage count, from layer 0 at
    0.  ``rounds``: the (positions, options) pairs of last stages, at most one per position per round;
    ``ends_of[j]``: where a non-last stage on option j may end."""
    t, hold, E = cols.a["t"], cols.a["hold"], cols.E
    if cols.pending:                    # options only ever last, where a non-last stage within the bound ends
        ends = {0}
        for j in nl:
            if (t[:, :, j] <= t_max).any():
                ends.update(ends_of[j].tolist())
        for ps, js in rounds:
            for p, j in zip(ps.tolist(), js.tolist()):
                if p in ends:
                    cols.need(j)
    x = cols.a[term] if term is not None else None
    c_all = t if x is None else t + np.where(np.isfinite(t), x, 0.0)
    big = INF
    F_prev = np.full((L + 1, P), big)
    F_prev[L, P - 1] = 0.0
    MX_prev = np.zeros((L + 1, P))
    choices = []
    plans = []
    nl_arr = np.array(nl, dtype=int)
    for r in range(1, S_max + 1):
        ok = t <= t_max
        if hold is not None:
            ok &= min(r, B) <= hold
        F = np.full((L + 1, P), big)
        MX = np.zeros((L + 1, P))
        ch_i = np.full((L + 1, P), -1, dtype=int)
        ch_j = np.full((L + 1, P), -1, dtype=int)
        if r == 1:
            for ps, js in rounds:
                v = np.where(ok[:, L - 1, js], c_all[:, L - 1, js] + E[:, ps, js], big)    # [k, pairs]
                mx = t[:, L - 1, js]
                better = _better(v, mx, F[:L, ps], MX[:L, ps], tie)
                F[:L, ps] = np.where(better, v, F[:L, ps])
                MX[:L, ps] = np.where(better, mx, MX[:L, ps])
                ch_i[:L, ps] = np.where(better, L - 1, ch_i[:L, ps])
                ch_j[:L, ps] = np.where(better, js[None, :], ch_j[:L, ps])
        elif nl and tie == 0:           # the least sum, the first (option, last layer) among equals
            for j in nl:
                sz = steps[j]
                c = np.where(ok[:, :, j], c_all[:, :, j], big)                      # [k, i]
                rest = np.full((L, P), big)                                        # [i, p]
                rest[:, :P - sz] = F_prev[1:, sz:]
                rest[:, ~allow_nl[:, j]] = big
                tot = c[:, :, None] + rest[None, :, :]                             # [k, i, p]
                i_best = np.argmin(tot, axis=1)                                    # [k, p]
                v = np.take_along_axis(tot, i_best[:, None, :], axis=1)[:, 0, :] + E[:, :, j]
                better = v < F[:L]
                F[:L] = np.where(better, v, F[:L])
                ch_i[:L] = np.where(better, i_best, ch_i[:L])
                ch_j[:L] = np.where(better, j, ch_j[:L])
        elif nl:                        # within ``tie`` of the least sum, the smallest largest stage time
            cs = np.empty((L, len(nl), L, P))
            ms = np.empty((L, len(nl), L, P))
            for n, j in enumerate(nl):
                sz = steps[j]
                c = np.where(ok[:, :, j], c_all[:, :, j], big)                      # [k, i]
                rest = np.full((L, P), big)                                        # [i, p]
                rmx = np.zeros((L, P))
                rest[:, :P - sz] = F_prev[1:, sz:]
                rmx[:, :P - sz] = MX_prev[1:, sz:]
                rest[:, ~allow_nl[:, j]] = big
                cs[:, n] = c[:, :, None] + rest[None, :, :] + E[:, None, :, j]     # [k, i, p]
                ms[:, n] = np.maximum(t[:, :, j][:, :, None], rmx[None, :, :])
            cs = cs.reshape(L, len(nl) * L, P)                                      # [k, (j, i), p]
            ms = ms.reshape(L, len(nl) * L, P)
            with np.errstate(invalid="ignore"):
                cmin = cs.min(axis=1)                                              # [k, p]
                within = np.isfinite(cs) & (cs <= (cmin * (1 + tie))[:, None, :])
                mw = np.where(within, ms, big)
                mmin = mw.min(axis=1)
                sel = within & (mw <= mmin[:, None, :])
                idx = np.argmin(np.where(sel, cs, big), axis=1)                     # [k, p]
            v = np.take_along_axis(cs, idx[:, None, :], axis=1)[:, 0, :]
            fin = np.isfinite(v)
            F[:L] = np.where(fin, v, big)
            MX[:L] = np.where(fin, np.take_along_axis(ms, idx[:, None, :], axis=1)[:, 0, :], 0.0)
            ch_i[:L] = np.where(fin, idx % L, -1)
            ch_j[:L] = np.where(fin, nl_arr[idx // L], -1)
        choices.append((ch_i, ch_j))
        if math.isfinite(F[0, 0]):
            stages, k, p = [], 0, 0
            for rr in range(r, 0, -1):
                ci, cj = choices[rr - 1]
                i, j = int(ci[k, p]), int(cj[k, p])
                stages.append(Stage(k, i + 1, j, p * g))
                k, p = i + 1, p + steps[j]
            plans.append(tuple(stages))
        F_prev, MX_prev = F, MX
    return plans


def _better(v, mx, F, MX, tie):
    """Elementwise: candidate (v, mx) replaces (F, MX): clearly cheaper, or as cheap within ``tie`` and
    with a smaller largest stage time."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(v) & ((v < F * (1 - tie)) | ((v <= F * (1 + tie)) & (mx < MX)) | ~np.isfinite(F))


__all__ = ["PipelineError", "may_cross", "Cuts", "analyze", "layer_inputs", "input_columns", "allowed_cuts", "cluster",
           "sub_mesh", "structure_key", "Stage", "StagePlans", "holds", "t_max_bounds", "stage_dp"]
