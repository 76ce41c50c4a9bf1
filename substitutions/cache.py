"""Load and save the rule cache (``rules_cache/rules.json`` + ``manifest.json``).

The manifest holds the generator settings, the op-set hash, counts, timings and the sha256 digest of
the rules file; ``load`` refuses a rules file whose digest does not match (a cache edited by hand) with a
one-line :class:`RuleError`.  Loaded sets are memoized per (path, digest).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from unity_pcg import ops

from .rule import Rule, RuleError, dumps_rules, loads_rules

MANIFEST_SCHEMA = "unity-pcg/rules-manifest/v1"


def default_dir() -> Path:
    try:
        from unity_pcg.rules_cache import DATA_DIR
        return DATA_DIR
    except ImportError:   # an editable install made before rules_cache/ became a package
        return Path(__file__).resolve().parent.parent / "rules_cache"


def rule_vocabulary() -> set[str]:
    """The operators rules can mention: those the verifier has axioms for (and the parallel operators).

    An operator added to the registry without axioms cannot appear in a proven rule, so it leaves the
    rule set valid; a change to an operator the axioms speak about (its kind or attributes) does not."""
    from unity_pcg.verifier.axioms import AXIOMS
    names = {n for a in AXIOMS for n in a.ops} | {n for n, s in ops.REGISTRY.items() if s.kind == "parallel"}
    return {n for n in names if n in ops.REGISTRY}


def op_set_hash() -> str:
    """Hash of the rule vocabulary's operator names, kinds and attributes (a change means: regenerate)."""
    items = sorted((n, s.kind, sorted(s.attrs)) for n, s in ops.REGISTRY.items() if n in rule_vocabulary())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


@dataclass
class RuleSet:
    rules: list[Rule]
    manifest: dict = field(default_factory=dict)
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):
        return iter(self.rules)

    def by_name(self) -> dict[str, Rule]:
        return {r.name: r for r in self.rules}

    def get(self, name: str) -> Rule:
        try:
            return self.by_name()[name]
        except KeyError:
            raise RuleError(f"no rule named {name!r} in {self.path or 'the rule set'}") from None

    def all_directions(self) -> list[Rule]:
        """Every rule, plus the reverse of every reversible rule (named ``<name>~rev``)."""
        out = list(self.rules)
        names = {r.name for r in self.rules}
        for r in self.rules:
            if r.reversible and r.name + "~rev" not in names:
                out.append(r.reversed())
        return out

    def without_ops(self, names: Iterable[str]) -> "RuleSet":
        """The rules that mention none of ``names`` (e.g. ``{"AllReduce"}`` for a consumer that cannot
        cost the fused operator yet)."""
        bad = set(names)
        keep = [r for r in self.rules if not any(n.op in bad for p in (r.source, r.target) for n in p.nodes)]
        return RuleSet(keep, dict(self.manifest), self.path)

    @property
    def stale(self) -> bool:
        """True when the operator registry changed since generation (regenerate to pick it up)."""
        return self.manifest.get("op_set_hash") not in (None, op_set_hash())


def counts(rules: Iterable[Rule]) -> dict[str, int]:
    rules = list(rules)
    par = sum(1 for r in rules if r.is_parallel)
    return {"rules": len(rules), "parallel_rules": par, "algebraic_rules": len(rules) - par,
            "generated_rules": sum(1 for r in rules if r.origin == "generated"),
            "template_rules": sum(1 for r in rules if r.origin != "generated")}


def save(rules: Iterable[Rule], out_dir: str | Path | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    rules = list(rules)
    for r in rules:
        r.validate()
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise RuleError("rule names must be unique in a rule file")
    d = Path(out_dir) if out_dir is not None else default_dir()
    d.mkdir(parents=True, exist_ok=True)
    text = dumps_rules(rules) + "\n"
    (d / "rules.json").write_text(text)
    from unity_pcg.verifier.axioms import counts as axiom_counts
    manifest = {"schema": MANIFEST_SCHEMA, "op_set_hash": op_set_hash(), "digest": digest(text),
                "counts": {**counts(rules), **axiom_counts()}, **dict(extra or {})}
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _MEMO.clear()
    return d


_MEMO: dict[tuple[str, str], RuleSet] = {}


def load(path: str | Path | None = None) -> RuleSet:
    """Load a rule directory (or a rules.json beside its manifest.json); refuses a digest mismatch."""
    p = Path(path) if path is not None else default_dir()
    rules_path = p / "rules.json" if p.is_dir() else p
    man_path = rules_path.parent / "manifest.json"
    try:
        data = rules_path.read_bytes()
    except OSError as e:
        raise RuleError(f"{rules_path}: cannot read the rule cache ({e.strerror}); run `unity-pcg rules generate`") \
            from None
    try:
        manifest = json.loads(man_path.read_text())
    except OSError:
        raise RuleError(f"{man_path}: missing manifest; run `unity-pcg rules generate`") from None
    except json.JSONDecodeError:
        raise RuleError(f"{man_path}: the manifest is not valid JSON") from None
    if manifest.get("schema") != MANIFEST_SCHEMA:
        raise RuleError(f"{man_path}: not a rule-cache manifest (schema {manifest.get('schema')!r})")
    dg = digest(data)
    if dg != manifest.get("digest"):
        raise RuleError(f"{rules_path}: digest {dg[:12]} does not match the manifest ({str(manifest.get('digest'))[:12]}); "
                        f"the cache was edited by hand: regenerate it with `unity-pcg rules generate`")
    key = (str(rules_path), dg)
    if key not in _MEMO:
        # the digest proves the file is what save() wrote (and validated): skip re-validation
        _MEMO[key] = RuleSet(loads_rules(data.decode(), str(rules_path), validate=False), manifest, rules_path)
    rs = _MEMO[key]
    return RuleSet(list(rs.rules), dict(rs.manifest), rs.path)


def load_file(path: str | Path) -> list[Rule]:
    """A rule file without a manifest (for `rules verify FILE`)."""
    p = Path(path)
    try:
        return loads_rules(p.read_text(), str(p))
    except OSError as e:
        raise RuleError(f"{p}: cannot read ({e.strerror})") from None


def _numerically_false(r: Rule, settings) -> bool:
    """True if a (concrete) unproven candidate is wrong under the real kernels (float inputs): it
    collided only through a polynomial stand-in.  Unproven candidates that are not false would be
    gaps in the axioms."""
    import numpy as np

    from unity_pcg.shape import ParallelTensorShape
    from unity_pcg.verifier.selfcheck import compare_sides
    if r.vars:
        return False
    shapes = {n: ParallelTensorShape.of((settings.size,) * settings.rank) for n in r.inputs}
    rng = np.random.default_rng(0)
    for _ in range(3):
        vals = {n: rng.standard_normal(s.sizes) for n, s in shapes.items()}
        if compare_sides(r.source, r.target, {}, shapes, vals, rng):
            return True
    return False


def rebuild(settings, out_dir: str | Path | None = None, timeout: float = 2.0, workers: int = 2,
            progress: bool = True, log=print) -> tuple[RuleSet, dict]:
    """Generate, add the named template rules, prove everything, save with a manifest."""
    from unity_pcg.verifier.verify import verify_rules

    from .generate import generate
    from .templates import template_rules
    t0 = time.perf_counter()
    gen_rules, stats, unproven = generate(settings, timeout, workers, progress)
    t1 = time.perf_counter()
    templ = template_rules()
    verdicts = verify_rules(templ, max(timeout, 10.0), workers)
    t_templ = time.perf_counter() - t1
    shipped = list(gen_rules)
    names = {r.name for r in shipped}
    for r, v in zip(templ, verdicts):
        if v.proven:
            sub = dict(r.proof).get("axiom_subset")     # a template's named axiom subset (templates.AXIOM_SUBSETS)
            extra = {"axiom_subset": list(sub), "axiom_set": v.axiom_set} if sub else {}
            shipped.append(r.with_proof(status="proven", axioms=list(v.axioms), seconds=round(v.seconds, 4), **extra))
            names.add(r.name)
        else:
            unproven.append((r, f"{v.status}: {v.detail}"))
    false_unproven = sum(1 for r, _ in unproven if _numerically_false(r, settings))
    info = {
        "generator": settings.to_json(),
        "stats": {"graphs": stats.graphs, "classes": stats.classes, "candidates": stats.candidates,
                  "false_candidates": stats.false_candidates,
                  "pruned": dict(stats.pruned), "duplicates": stats.duplicates, "proven": len(shipped),
                  "unproven": len(unproven), "unproven_numerically_false": false_unproven,
                  "generalized": sum(1 for r in shipped if r.vars),
                  "template_rules": len(templ)},
        "seconds": {"generate": round(stats.enumerate_seconds, 2),
                    "verify": round(stats.verify_seconds + t_templ, 2),
                    "total": round(time.perf_counter() - t0, 2)},
        "timeout_s": timeout, "workers": workers,
        "unproven": [{"rule": str(r), "reason": why} for r, why in unproven][:500],
    }
    d = save(shipped, out_dir, info)
    return load(d), info


def add_templates(out_dir: str | Path | None = None, timeout: float = 10.0, workers: int = 1,
                  log=print) -> tuple[RuleSet, list[str]]:
    """The template rules (:func:`substitutions.templates.template_rules`) that the cache lacks, proven exactly as
    :func:`rebuild` proves templates (the verifier, its named axiom subset first), appended to the cache and
    saved with the manifest's counts updated; the generated rules are kept as they are.  An unproven template
    is not shipped (listed in the manifest's ``unproven``).  (rule set, names added)."""
    from unity_pcg.verifier.verify import verify_rules

    from .templates import template_rules
    have = load(out_dir)
    names = {r.name for r in have.rules}
    new = [r for r in template_rules() if r.name not in names]
    verdicts = verify_rules(new, max(timeout, 10.0), workers) if new else []
    info = {k: v for k, v in have.manifest.items() if k not in ("schema", "op_set_hash", "digest", "counts")}
    info["stats"] = dict(info.get("stats", {}))
    info["unproven"] = list(info.get("unproven", []))
    shipped, added = list(have.rules), []
    for r, v in zip(new, verdicts):
        if v.proven:
            sub = dict(r.proof).get("axiom_subset")
            extra = {"axiom_subset": list(sub), "axiom_set": v.axiom_set} if sub else {}
            shipped.append(r.with_proof(status="proven", axioms=list(v.axioms), seconds=round(v.seconds, 4), **extra))
            added.append(r.name)
        else:
            info["unproven"].append({"rule": str(r), "reason": f"{v.status}: {v.detail}"})
            log(f"not proven, not shipped: {r.name} ({v.status})")
    st = info["stats"]
    st["proven"] = len(shipped)
    st["generalized"] = sum(1 for r in shipped if r.vars)
    st["template_rules"] = len(template_rules())
    st["unproven"] = len(info["unproven"])
    d = save(shipped, out_dir if out_dir is not None else have.path.parent, info)
    return load(d), added


load_rules = load   # the name the demo and the search use
