"""Prove rules with Z3 (TASO's method).

Tensors are an uninterpreted sort ``T``; every operator is an uninterpreted function taking its
attributes as integers (dims and degrees as themselves, other values interned, tuples through
uninterpreted ``tupN``) and its inputs as ``T``.  Each axiom (axioms.py) becomes a universally
quantified equation guarded by its constraints (degrees >= 2 always).  A rule is *proven* when
"some source output differs from its target output" is unsatisfiable under the relevant axioms and the
rule's constraints, within a per-rule timeout; the unsat core names the axioms used.

A rule may name the axiom subset it is proved from (``proof["axiom_subset"]``: axiom names, written by a
template).  Every axiom is sound on its own (each is checked numerically by ``selfcheck``), so a proof from a
subset is a proof; it helps where the whole relevant set sends Z3's e-matching into a loop (the Megatron
attention block: 10 axioms prove it in 0.1 s, the ~77 relevant ones time out).  The verifier tries the named
subset first (restricted to the axioms it was given), then the relevant set; the verdict says which proved it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import z3

from unity_pcg import ops
from unity_pcg.ops.base import REQUIRED
from unity_pcg.substitutions.rule import Pattern, Rule, is_var

from .axioms import AXIOMS, Axiom

PARALLEL = set(ops.PARALLEL_OPS) | {"AllReduce"}
RLIMIT_PER_SECOND = 1_000_000


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str            # proven | unproven | timeout
    seconds: float
    axioms: tuple[str, ...] = ()
    detail: str = ""
    axiom_set: str = "relevant"   # relevant | subset (the rule's named axiom subset)

    @property
    def proven(self) -> bool:
        return self.status == "proven"


class Encoder:
    """Maps patterns to Z3 terms (one instance per solver context)."""

    def __init__(self, ctx: "z3.Context | None" = None) -> None:
        self.ctx = ctx
        self.T = z3.DeclareSort("T", ctx)
        self._funcs: dict[tuple, z3.FuncDeclRef] = {}
        self._tups: dict[int, z3.FuncDeclRef] = {}
        self._intern: dict[Any, int] = {}

    def func(self, opname: str, n_in: int, out: int) -> tuple[z3.FuncDeclRef, list[str]]:
        spec = ops.get_op(opname)
        names = sorted(spec.attrs)
        key = (opname, n_in, out)
        if key not in self._funcs:
            sig = [z3.IntSort(self.ctx)] * len(names) + [self.T] * n_in + [self.T]
            self._funcs[key] = z3.Function(f"{opname}_{n_in}_{out}", *sig)
        return self._funcs[key], names

    def value(self, v: Any, env: Mapping[str, z3.ExprRef]) -> z3.ExprRef:
        if is_var(v):
            return env[v[1:]]
        if isinstance(v, bool):
            return z3.IntVal(int(v), self.ctx)
        if isinstance(v, int):
            return z3.IntVal(v, self.ctx)
        if isinstance(v, (tuple, list)):
            n = len(v)
            if n not in self._tups:
                self._tups[n] = z3.Function(f"tup{n}", *([z3.IntSort(self.ctx)] * n + [z3.IntSort(self.ctx)]))
            return self._tups[n](*[self.value(x, env) for x in v])
        key = (type(v).__name__, repr(v))
        if key not in self._intern:
            self._intern[key] = 1_000_000 + len(self._intern)
        return z3.IntVal(self._intern[key], self.ctx)

    def pattern(self, p: Pattern, inputs: Mapping[str, z3.ExprRef], env: Mapping[str, z3.ExprRef]
                ) -> list[z3.ExprRef]:
        vals: list[list[z3.ExprRef]] = []
        for pn in p.nodes:
            spec = ops.get_op(pn.op)
            pa = pn.a
            args = [inputs[r] if isinstance(r, str) else vals[r[0]][r[1]] for r in pn.inputs]
            n_out = 1 + max([r[1] for q in (p.nodes) for r in q.inputs
                             if not isinstance(r, str) and p.nodes[r[0]] is pn] +
                            [o[1] for o in p.outputs if not isinstance(o, str) and p.nodes[o[0]] is pn] + [0])
            outs = []
            for k in range(n_out):
                f, names = self.func(pn.op, len(args), k)
                attrs = [self.value(pa[nm] if nm in pa else ("<REQUIRED>" if spec.attrs[nm] is REQUIRED
                                                             else spec.attrs[nm]), env) for nm in names]
                outs.append(f(*attrs, *args))
            vals.append(outs)
        return [inputs[o] if isinstance(o, str) else vals[o[0]][o[1]] for o in p.outputs]

    def term(self, t, env) -> z3.ExprRef:
        """A constraint side: a value, or a product ``["*", a, b, ..]`` of them."""
        if isinstance(t, (list, tuple)) and t and t[0] == "*":
            out = self.value(t[1], env)
            for v in t[2:]:
                out = out * self.value(v, env)
            return out
        return self.value(t, env)

    def constraint(self, c, env) -> z3.BoolRef:
        lhs, opn, rhs = c
        a, b = self.term(lhs, env), self.term(rhs, env)
        return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[opn]

    def rule_vars(self, r: Rule, prefix: str) -> tuple[dict, dict, list]:
        ins = {n: z3.Const(f"{prefix}{n}", self.T) for n in r.inputs}
        env = {v: z3.Int(f"{prefix}v_{v}", self.ctx) for v, _ in r.vars}
        side = [self.constraint(c, env) for c in r.constraints]
        side += [env[v] >= 2 for v, k in r.vars if k == "degree"]
        return ins, env, side

    def axiom(self, ax: Axiom, directed: bool = False) -> z3.BoolRef:
        """The axiom as a quantified formula.  ``directed``: its left side is the only trigger (e-matching
        instantiates it on terms shaped like its left side, never on its right side), where the left side
        mentions every bound variable; triggers only steer instantiation, the formula is the same."""
        r = ax.rule
        ins, env, side = self.rule_vars(r, f"A_{ax.name}_")
        lhs = self.pattern(r.source, ins, env)
        rhs = self.pattern(r.target, ins, env)
        eq = z3.And([a == b for a, b in zip(lhs, rhs)]) if len(lhs) > 1 else lhs[0] == rhs[0]
        body = z3.Implies(z3.And(side), eq) if side else eq
        bound = list(ins.values()) + list(env.values())
        if directed and lhs and all(z3.is_app(t) and t.num_args() > 0 for t in lhs):
            names = {str(v) for v in bound}
            seen = {str(x) for t in lhs for x in _subterms(t)}
            if names <= seen:
                pat = z3.MultiPattern(*lhs) if len(lhs) > 1 else lhs[0]
                return z3.ForAll(bound, body, patterns=[pat])
        return z3.ForAll(bound, body)


def _subterms(t: z3.ExprRef):
    yield t
    for c in t.children():
        yield from _subterms(c)


def rule_ops(r: Rule) -> set[str]:
    return {n.op for p in (r.source, r.target) for n in p.nodes}


def signatures(r: Rule) -> set[tuple[str, int]]:
    """The (operator, number of inputs) pairs a rule or axiom mentions.  The encoder gives each pair its
    own Z3 function (``Concat_3_0`` is not ``Concat_2_0``), so an axiom about a 3-input Concat can never
    fire on terms whose Concats have 2 inputs: relevance is decided per signature, not per name."""
    return {(n.op, len(n.inputs)) for p in (r.source, r.target) for n in p.nodes}


_SIGS: dict[int, tuple] = {}


def _axiom_sigs(a: Axiom) -> tuple:
    """(axiom, lhs, rhs, both): its signatures other than the parallel operators' (always allowed),
    computed once per axiom object."""
    got = _SIGS.get(id(a))
    if got is None or got[0] is not a:
        lhs = frozenset((n.op, len(n.inputs)) for n in a.rule.source.nodes if n.op not in PARALLEL)
        rhs = frozenset((n.op, len(n.inputs)) for n in a.rule.target.nodes if n.op not in PARALLEL)
        got = _SIGS[id(a)] = (a, lhs, rhs, lhs | rhs)
    return got


def relevant_axioms(r: Rule, axioms: Sequence[Axiom] = AXIOMS) -> list[Axiom]:
    """Axioms over the rule's operator signatures (name and arity), the parallel operators, and the
    signatures that axioms firing on those can introduce (two steps)."""
    sigs = [_axiom_sigs(a) for a in axioms]
    allowed = signatures(r)
    for _ in range(2):   # signatures an axiom can introduce when it fires on terms of allowed ones
        grown = set(allowed)
        for _a, lhs, rhs, both in sigs:
            if lhs <= allowed or rhs <= allowed:
                grown |= both
        allowed = grown
    return [a for a, _l, _r, both in sigs if both <= allowed]


def relevant_axioms_by_name(r: Rule, axioms: Sequence[Axiom] = AXIOMS) -> list[Axiom]:
    """The filter before arity was taken into account (by operator name only), kept to measure and test
    that the arity-aware one drops only axioms that cannot fire."""
    allowed = rule_ops(r) | PARALLEL
    for _ in range(2):
        grown = set(allowed)
        for a in axioms:
            lhs = {n.op for n in a.rule.source.nodes}
            rhs = {n.op for n in a.rule.target.nodes}
            if lhs <= allowed or rhs <= allowed:
                grown |= a.ops
        allowed = grown
    return [a for a in axioms if a.ops <= allowed]


def named_subset(r: Rule) -> tuple[str, ...]:
    """The axiom names a rule says it is proved from (``proof["axiom_subset"]``), or ()."""
    names = dict(r.proof).get("axiom_subset") or ()
    return tuple(str(n) for n in names)


def verify_rule(r: Rule, timeout: float = 10.0, axioms: Sequence[Axiom] = AXIOMS, select=None) -> Verdict:
    """Prove ``r``: from its named axiom subset first (if any and no ``select`` is given), then from
    ``select(r, axioms)`` (default: the relevant axioms).  Each attempt has the whole budget."""
    subset = named_subset(r)
    if subset and select is None:
        want = set(subset)
        chosen = [a for a in axioms if a.name in want]
        v = _prove(r, timeout, chosen, directed=True)
        if v.proven:
            return Verdict(v.name, v.status, v.seconds, v.axioms, v.detail, "subset")
        t_sub, why = v.seconds, f"named subset: {v.status} ({v.detail}); relevant set: "
    else:
        t_sub, why = 0.0, ""
    v = _prove(r, timeout, (select or relevant_axioms)(r, axioms))
    return Verdict(v.name, v.status, v.seconds + t_sub, v.axioms, why + v.detail, "relevant")


def _prove(r: Rule, timeout: float, used: Sequence[Axiom], directed: bool = False) -> Verdict:
    t0 = time.perf_counter()
    # a named subset is proved in a fresh Z3 context: e-matching then sees the same term order in every
    # process (in the shared context, terms made by earlier proofs changed it: a subset proof failed with
    # "incomplete quantifiers" in some verify_rules workers and not in others)
    ctx = z3.Context() if directed else None
    enc = Encoder(ctx)
    s = z3.Solver(ctx=ctx)
    # the budget is Z3's deterministic resource count (about 1e6 per second of an unloaded core), so
    # verdicts do not depend on machine load; the wall-clock timeout is only a safety net
    s.set("rlimit", int(timeout * RLIMIT_PER_SECOND))
    s.set("timeout", int(timeout * 1000 * 10))
    s.set("unsat_core", True)
    s.set("smt.mbqi", False)
    if directed:
        # every instance eagerly: with left-side triggers e-matching saturates, and a delayed instance could
        # leave the check "unknown (incomplete quantifiers)" depending on term order (seen in worker processes)
        s.set("smt.qi.eager_threshold", 1000.0)
    for a in used:
        s.assert_and_track(enc.axiom(a, directed), z3.Bool(f"ax:{a.name}", ctx))
    ins, env, side = enc.rule_vars(r, "")
    for c in side:
        s.add(c)
    src = enc.pattern(r.source, ins, env)
    tgt = enc.pattern(r.target, ins, env)
    s.add(z3.Not(z3.And([a == b for a, b in zip(src, tgt)])))
    try:
        res = s.check()
    except z3.Z3Exception as e:       # "out of memory" (a process memory limit): not proven, like a timeout
        return Verdict(r.name, "timeout", time.perf_counter() - t0, (), str(e))
    dt = time.perf_counter() - t0
    if res == z3.unsat:
        core = tuple(sorted(str(c)[3:] for c in s.unsat_core()))
        return Verdict(r.name, "proven", dt, core)
    if res == z3.unknown:
        why = s.reason_unknown()
        status = "timeout" if ("timeout" in why or "canceled" in why or "resource" in why) else "unproven"
        return Verdict(r.name, status, dt, (), why)
    return Verdict(r.name, "unproven", dt, (), "a counter-model exists under the axioms")


def _verify_json(args) -> dict:
    obj, timeout = args
    v = verify_rule(Rule.from_json(obj), timeout)
    return {"name": v.name, "status": v.status, "seconds": v.seconds, "axioms": list(v.axioms), "detail": v.detail,
            "axiom_set": v.axiom_set}


def verify_rules(rules: Iterable[Rule], timeout: float = 10.0, workers: int = 2, progress=None) -> list[Verdict]:
    """Verify many rules, in ``workers`` processes; ``progress(done, total)`` is called as they finish."""
    rules = list(rules)
    jobs = [(r.to_json(), timeout) for r in rules]
    out: list[dict] = []
    if workers <= 1 or len(rules) < 8:
        for k, j in enumerate(jobs):
            out.append(_verify_json(j))
            if progress:
                progress(k + 1, len(jobs))
    else:
        import multiprocessing as mp
        # spawn, not fork: a caller may hold threads (torch, onnxruntime, a test runner's), and a forked
        # child can inherit one of their locks held and hang for ever (seen in the test suite)
        ctx = mp.get_context("spawn")
        # a worker is replaced after 16 chunks (64 rules): Z3 keeps the memory of a proof that ran out its budget
        # (measured: ~0.8 GB per hard mutant, not returned after the solver and even its context are gone), so a
        # long-lived worker grew to 15 GB and was OOM-killed in the 400-mutant test, hanging the pool
        with ctx.Pool(workers, maxtasksperchild=16) as pool:
            for k, res in enumerate(pool.imap(_verify_json, jobs, chunksize=4)):
                out.append(res)
                if progress:
                    progress(k + 1, len(jobs))
    return [Verdict(d["name"], d["status"], d["seconds"], tuple(d["axioms"]), d["detail"], d["axiom_set"])
            for d in out]
