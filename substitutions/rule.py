"""The rule format (DESIGN "Rule file").

A :class:`Rule` is a source pattern and a target pattern over the same named inputs.  Each pattern is
a list of :class:`PatNode` (op type, attribute constraints, inputs) in topological order plus its
outputs; ``source.outputs[i]`` and ``target.outputs[i]`` are the same tensor.

Attribute values in a pattern are literals or *variables* written ``"$name"``.  Variables have a kind
(``vars``): ``dim`` (a dimension index bound counted from the end: -1 is the last dim), ``fdim`` (a
dimension index bound counted from the front: 0 is the first dim), ``degree`` (a parallel degree >= 2) or ``attr`` (any value, copied from source to target).  An
attribute a pattern does not mention must equal its operator's default (so a pattern never silently
drops a non-default attribute).  ``constraints`` are ``[lhs, op, rhs]`` triples over variables and
integers (op one of ``== != < <= > >=``), checked at match time and assumed by the verifier; a side may
also be a product ``["*", a, b]`` of variables and integers (degrees that compose: ``replicate_merge``).
A literal dimension follows Python: ``0`` is the first dim, ``-1`` the last; it matches a graph
attribute naming the same dim of the operator's first input whatever the rank.

Inputs and pattern references: an input is named by its string (``"x0"``); a pattern node's output by
``[node index, output index]`` (or a bare node index for output 0).
"""
from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from unity_pcg import ops
from unity_pcg.errors import UnityError

SCHEMA = "unity-pcg/rules/v1"

# attributes that name a dimension of the operator's first input (normalized to negative at match)
DIM_ATTRS: dict[str, tuple[str, ...]] = {
    "Partition": ("dim",), "Combine": ("dim",), "Pipeline": ("dim",), "Batch": ("dim",),
    "Softmax": ("axis",), "LayerNorm": ("axis",), "Concat": ("axis",), "Split": ("axis",),
    "Gather": ("axis",), "ReduceSum": ("axes",), "ReduceMean": ("axes",),
}
DEGREE_ATTRS: dict[str, tuple[str, ...]] = {n: ("degree",) for n in
                                            ("Partition", "Combine", "Pipeline", "Batch", "Replicate",
                                             "Reduce", "AllReduce")}
VAR_KINDS = ("dim", "fdim", "degree", "attr")
CMP = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge}


class RuleError(UnityError, ValueError):
    """A malformed rule or rule file."""


def is_product(t: Any) -> bool:
    """A constraint side ``["*", a, b, ..]``: the product of its variables and integers."""
    return isinstance(t, (list, tuple)) and len(t) > 0 and t[0] == "*"


def term_value(t: Any, b: Mapping[str, Any]) -> Any:
    """A constraint side's value under the bindings ``b`` (KeyError for an unbound variable)."""
    if is_product(t):
        out = 1
        for v in t[1:]:
            out *= term_value(v, b)
        return out
    return b[t[1:]] if is_var(t) else t


def _term(t: Any) -> str:
    return " * ".join(str(v) for v in t[1:]) if is_product(t) else str(t)


def is_var(v: Any) -> bool:
    return isinstance(v, str) and v.startswith("$") and len(v) > 1


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _flat(v: Any) -> list:
    if isinstance(v, tuple):
        return [y for x in v for y in _flat(x)]
    return [v]


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


@dataclass(frozen=True)
class PatNode:
    op: str
    attrs: tuple[tuple[str, Any], ...] = ()
    inputs: tuple[Any, ...] = ()          # input name (str) or (node index, output index)

    @property
    def a(self) -> dict:
        return dict(self.attrs)

    def to_json(self) -> dict:
        return {"op": self.op, "attrs": {k: _thaw(v) for k, v in self.attrs},
                "inputs": [r if isinstance(r, str) else list(r) for r in self.inputs]}

    @staticmethod
    def from_json(obj: Mapping) -> "PatNode":
        ins = []
        for r in obj.get("inputs", []):
            if isinstance(r, str):
                ins.append(r)
            elif isinstance(r, int):
                ins.append((r, 0))
            else:
                ins.append((int(r[0]), int(r[1])))
        attrs = tuple(sorted((str(k), _freeze(v)) for k, v in dict(obj.get("attrs", {})).items()))
        return PatNode(str(obj["op"]), attrs, tuple(ins))


@dataclass(frozen=True)
class Pattern:
    nodes: tuple[PatNode, ...]
    outputs: tuple[Any, ...]          # (node index, output index) or an input name

    def to_json(self) -> dict:
        return {"nodes": [n.to_json() for n in self.nodes],
                "outputs": [o if isinstance(o, str) else list(o) for o in self.outputs]}

    @staticmethod
    def from_json(obj: Mapping) -> "Pattern":
        nodes = tuple(PatNode.from_json(n) for n in obj["nodes"])
        outs = tuple(o if isinstance(o, str) else (o, 0) if isinstance(o, int) else (int(o[0]), int(o[1]))
                     for o in obj["outputs"])
        return Pattern(nodes, outs)

    def inputs_used(self) -> list[str]:
        seen: list[str] = [o for o in self.outputs if isinstance(o, str)]
        for n in self.nodes:
            for r in n.inputs:
                if isinstance(r, str) and r not in seen:
                    seen.append(r)
        return seen

    def op_count(self, kinds: Iterable[str] | None = None) -> int:
        if kinds is None:
            return len(self.nodes)
        ks = set(kinds)
        return sum(1 for n in self.nodes if ops.get_op(n.op).kind in ks)

    def expr(self, out: int = 0) -> str:
        """A readable one-line expression of an output (for listings and errors)."""
        def show(r):
            if isinstance(r, str):  # an input
                return r
            n = self.nodes[r[0]]
            args = [f"{k}={_thaw(v)}" for k, v in n.attrs]
            sub = [show(x) for x in n.inputs]
            s = f"{n.op}({', '.join(args + sub)})"
            return s if r[1] == 0 else f"{s}[{r[1]}]"
        return show(self.outputs[out])


@dataclass(frozen=True)
class Rule:
    name: str
    inputs: tuple[str, ...]
    source: Pattern
    target: Pattern
    vars: tuple[tuple[str, str], ...] = ()          # (name without $, kind)
    constraints: tuple[tuple[Any, str, Any], ...] = ()
    origin: str = "generated"                        # generated | template | hand
    proof: tuple[tuple[str, Any], ...] = ()          # status, axioms, seconds
    example: str = ""                                # JSON: a valid concrete instance (bind, input shapes)

    # --- derived --------------------------------------------------------------------------------
    @property
    def var_kinds(self) -> dict[str, str]:
        return dict(self.vars)

    @property
    def is_parallel(self) -> bool:
        par = set(ops.PARALLEL_OPS) | {"AllReduce"}
        return any(n.op in par for p in (self.source, self.target) for n in p.nodes)

    def free_vars(self) -> list[str]:
        """Target variables not bound by the source: chosen when the rule is applied (degrees, dims)."""
        src = {v[1:] for n in self.source.nodes for _, v in n.attrs for v in _flat(v) if is_var(v)}
        tgt = {v[1:] for n in self.target.nodes for _, v in n.attrs for v in _flat(v) if is_var(v)}
        return sorted(tgt - src)

    @property
    def reversible(self) -> bool:
        return not any(isinstance(o, str) for o in self.target.outputs) and \
            set(self.source.inputs_used()) == set(self.target.inputs_used()) and not self.free_vars() and \
            bool(self.target.nodes)

    def reversed(self) -> "Rule":
        return Rule(self.name + "~rev", self.inputs, self.target, self.source, self.vars, self.constraints,
                    self.origin, self.proof, self.example)

    def check_constraints(self, b: Mapping[str, Any]) -> bool:
        for lhs, op, rhs in self.constraints:
            try:
                lv, rv = term_value(lhs, b), term_value(rhs, b)
                if not CMP[op](lv, rv):
                    return False
            except TypeError:
                return False
        return True

    def validate(self) -> None:
        """Structural checks; raises RuleError naming the rule."""
        kinds = self.var_kinds
        for k in kinds.values():
            if k not in VAR_KINDS:
                raise RuleError(f"rule {self.name}: unknown variable kind {k!r}")
        if len(self.source.outputs) != len(self.target.outputs) or not self.source.outputs:
            raise RuleError(f"rule {self.name}: source and target must have the same number of outputs")
        for side, p in (("source", self.source), ("target", self.target)):
            for i, n in enumerate(p.nodes):
                if n.op not in ops.REGISTRY:
                    raise RuleError(f"rule {self.name}: {side} node {i} has unknown operator {n.op!r}")
                if ops.get_op(n.op).kind == "source":
                    raise RuleError(f"rule {self.name}: {side} node {i} is a {n.op}; use a named input")
                for r in n.inputs:
                    if isinstance(r, str):
                        if r not in self.inputs:
                            raise RuleError(f"rule {self.name}: {side} node {i} reads unknown input {r!r}")
                    elif not 0 <= r[0] < i:
                        raise RuleError(f"rule {self.name}: {side} node {i} reads node {r[0]} (not earlier)")
                for k, v in n.attrs:
                    if k not in ops.get_op(n.op).attrs:
                        raise RuleError(f"rule {self.name}: {side} node {i} ({n.op}) has unknown attribute {k!r}")
                    for x in _flat(v):
                        if is_var(x) and x[1:] not in kinds:
                            raise RuleError(f"rule {self.name}: variable {x} is not declared")
            for o in p.outputs:
                if isinstance(o, str):
                    if o not in self.inputs:
                        raise RuleError(f"rule {self.name}: {side} output {o!r} is not an input")
                    if side == "source":
                        raise RuleError(f"rule {self.name}: a source output must be a pattern node")
                elif not 0 <= o[0] < len(p.nodes):
                    raise RuleError(f"rule {self.name}: {side} output {o} does not exist")
        src_vars = {v[1:] for n in self.source.nodes for _, v in n.attrs for v in _flat(v) if is_var(v)}
        tgt_vars = {v[1:] for n in self.target.nodes for _, v in n.attrs for v in _flat(v) if is_var(v)}
        free = tgt_vars - src_vars
        bad = [v for v in free if kinds.get(v) not in ("degree", "dim", "fdim")]
        if bad:
            raise RuleError(f"rule {self.name}: target variables {sorted(bad)} are not bound by the source "
                            f"(only degree and dim variables may be chosen at application)")
        if set(self.target.inputs_used()) - set(self.source.inputs_used()) or \
                {o for o in self.target.outputs if isinstance(o, str)} - set(self.source.inputs_used()):
            raise RuleError(f"rule {self.name}: target reads inputs the source does not")
        for c in self.constraints:
            if len(c) != 3 or c[1] not in CMP:
                raise RuleError(f"rule {self.name}: malformed constraint {list(c)}")
            for t in (c[0], c[2]):
                if is_product(t) and len(t) < 3:
                    raise RuleError(f"rule {self.name}: malformed constraint {list(c)}")
                for v in (t[1:] if is_product(t) else [t]):
                    if is_var(v) and v[1:] not in src_vars | tgt_vars:
                        raise RuleError(f"rule {self.name}: constraint names unbound variable {v}")

    # --- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"name": self.name, "origin": self.origin, "inputs": list(self.inputs),
                "vars": {k: v for k, v in self.vars}, "constraints": [list(c) for c in self.constraints],
                "source": self.source.to_json(), "target": self.target.to_json(),
                "proof": {k: _thaw(v) for k, v in self.proof},
                **({"example": json.loads(self.example)} if self.example else {})}

    @staticmethod
    def from_json(obj: Mapping, validate: bool = True) -> "Rule":
        try:
            r = Rule(name=str(obj["name"]), inputs=tuple(str(x) for x in obj["inputs"]),
                     source=Pattern.from_json(obj["source"]), target=Pattern.from_json(obj["target"]),
                     vars=tuple(sorted((str(k), str(v)) for k, v in dict(obj.get("vars", {})).items())),
                     constraints=tuple((_freeze(c[0]), str(c[1]), _freeze(c[2])) for c in obj.get("constraints", [])),
                     origin=str(obj.get("origin", "generated")),
                     proof=tuple(sorted((str(k), _freeze(v)) for k, v in dict(obj.get("proof", {})).items())),
                     example=json.dumps(obj["example"], sort_keys=True) if obj.get("example") else "")
        except (KeyError, TypeError, ValueError, IndexError) as e:
            name = obj.get("name", "?") if isinstance(obj, Mapping) else "?"
            raise RuleError(f"rule {name}: malformed rule JSON ({type(e).__name__}: {e})") from None
        if validate:
            r.validate()
        return r

    def with_proof(self, **proof: Any) -> "Rule":
        return Rule(self.name, self.inputs, self.source, self.target, self.vars, self.constraints, self.origin,
                    tuple(sorted((k, _freeze(v)) for k, v in proof.items())), self.example)

    def with_name(self, name: str, origin: str | None = None) -> "Rule":
        return Rule(name, self.inputs, self.source, self.target, self.vars, self.constraints,
                    origin or self.origin, self.proof, self.example)

    def with_example(self, example: str) -> "Rule":
        return Rule(self.name, self.inputs, self.source, self.target, self.vars, self.constraints,
                    self.origin, self.proof, example)

    def body_key(self) -> str:
        """Hash of everything but name and proof (used for deduplication)."""
        d = self.to_json()
        d.pop("name"); d.pop("proof"); d.pop("origin"); d.pop("example", None)
        return hashlib.blake2b(json.dumps(d, sort_keys=True).encode(), digest_size=12).hexdigest()

    def __str__(self) -> str:
        outs = range(len(self.source.outputs))
        s = "; ".join(f"{self.source.expr(i)} => {self.target.expr(i)}" for i in outs)
        if self.constraints:
            s += "  where " + ", ".join(f"{_term(a)} {o} {_term(b)}" for a, o, b in self.constraints)
        return f"{self.name}: {s}"


def dumps_rules(rules: Iterable[Rule]) -> str:
    return json.dumps({"schema": SCHEMA, "rules": [r.to_json() for r in rules]}, indent=1, sort_keys=True)


def loads_rules(text: str, what: str = "rule file", validate: bool = True) -> list[Rule]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RuleError(f"{what}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(obj, list):
        items = obj
    elif isinstance(obj, dict) and obj.get("schema") == SCHEMA:
        items = obj.get("rules", [])
    else:
        raise RuleError(f"{what}: not a rule file (expected schema {SCHEMA!r})")
    return [Rule.from_json(x, validate) for x in items]


# --- small builder used by templates, tests and the generator ------------------------------------------

@dataclass
class PatternBuilder:
    nodes: list[PatNode] = field(default_factory=list)

    def add(self, op: str, attrs: Mapping[str, Any] | None = None, *inputs: Any) -> tuple[int, int]:
        ins = tuple(r if isinstance(r, str) else (int(r[0]), int(r[1])) for r in inputs)
        self.nodes.append(PatNode(op, tuple(sorted((k, _freeze(v)) for k, v in (attrs or {}).items())), ins))
        return (len(self.nodes) - 1, 0)

    def pattern(self, *outputs: tuple[int, int]) -> Pattern:
        return Pattern(tuple(self.nodes), tuple(outputs))


def make_rule(name: str, inputs: Iterable[str], source: Pattern, target: Pattern, vars: Mapping[str, str] | None = None,
              constraints: Iterable[Iterable[Any]] = (), origin: str = "template") -> Rule:
    r = Rule(name, tuple(inputs), source, target, tuple(sorted((vars or {}).items())),
             tuple(tuple(c) for c in constraints), origin)  # type: ignore[arg-type]
    r.validate()
    return r
