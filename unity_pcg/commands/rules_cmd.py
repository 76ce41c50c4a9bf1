"""`unity-pcg rules`: generate, verify and inspect the verified substitution rules."""
from __future__ import annotations

import json
import sys
import time

HELP = "generate, verify and inspect the verified substitution rules (rules_cache/)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    g = sub.add_parser("generate", help="enumerate, fingerprint, prune and prove rules; write a rule cache")
    g.add_argument("--max-ops", type=int, default=3, help="operators per graph (default 3; 4 is slow)")
    g.add_argument("--degrees", default="2", help="parallel degrees to enumerate, comma separated (default 2)")
    g.add_argument("-o", "--output", default=None, help="output directory (default: the shipped rules_cache/)")
    g.add_argument("--timeout", type=float, default=2.0, help="Z3 seconds per rule (default 2)")
    g.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="re-prove every rule of a rule file (default: the shipped cache)")
    v.add_argument("file", nargs="?", default=None)
    v.add_argument("--timeout", type=float, default=10.0)
    v.add_argument("--workers", type=int, default=2)
    v.add_argument("--sample", type=int, default=0, help="re-prove only a fixed deterministic sample of N rules")
    s = sub.add_parser("stats", help="counts of the shipped (or given) rule cache")
    s.add_argument("dir", nargs="?", default=None)
    s.add_argument("--json", action="store_true")
    ls = sub.add_parser("list", help="list rules (optionally only names containing TEXT)")
    ls.add_argument("text", nargs="?", default="")
    sub.add_parser("selfcheck", help="check every axiom numerically under the piece semantics")


def _degrees(text: str) -> tuple[int, ...]:
    from unity_pcg.substitutions.rule import RuleError
    try:
        ds = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise RuleError(f"--degrees: expected comma-separated integers, got {text!r}") from None
    if not ds or any(d < 2 for d in ds):
        raise RuleError(f"--degrees: every degree must be >= 2, got {text!r}")
    return ds


def run(args) -> int:
    if args.action == "generate":
        from unity_pcg.substitutions.cache import rebuild
        from unity_pcg.substitutions.generate import Settings
        from unity_pcg.substitutions.rule import RuleError
        if not 1 <= args.max_ops <= 5:
            raise RuleError(f"--max-ops must be between 1 and 5, got {args.max_ops}")
        st = Settings(max_ops=args.max_ops, degrees=_degrees(args.degrees))
        rs, info = rebuild(st, args.output, args.timeout, args.workers, progress=not args.quiet)
        c = rs.manifest["counts"]
        print(f"{c['rules']} rules ({c['parallel_rules']} with parallel operators) proven and written to "
              f"{rs.path.parent}; {info['stats']['unproven']} unproven not shipped; "
              f"generation {info['seconds']['generate']}s, verification {info['seconds']['verify']}s")
        return 0
    if args.action == "verify":
        from unity_pcg.substitutions.cache import load, load_file
        from unity_pcg.verifier.verify import verify_rules
        from pathlib import Path
        if args.file is None or Path(args.file).is_dir():
            rules = load(args.file).rules          # a cache directory: digest checked too
        else:
            rules = load_file(args.file)
        if args.sample:
            rules = sorted(rules, key=lambda r: r.name)[:: max(1, len(rules) // args.sample)][: args.sample]
        t0 = time.perf_counter()
        vs = verify_rules(rules, args.timeout, args.workers)
        bad = [v for v in vs if not v.proven]
        for v in bad:
            print(f"NOT PROVEN {v.name}: {v.status} {v.detail}")
        print(f"{len(vs) - len(bad)}/{len(vs)} rules proven in {time.perf_counter() - t0:.1f}s")
        return 1 if bad else 0
    if args.action == "stats":
        from unity_pcg.substitutions.cache import load
        t0 = time.perf_counter()
        rs = load(args.dir)
        load_s = time.perf_counter() - t0
        m = rs.manifest
        st = m.get("stats", {})
        out = {**m.get("counts", {}), "candidates": st.get("candidates"), "pruned": st.get("pruned"),
               "proven": st.get("proven"), "unproven": st.get("unproven"), "graphs": st.get("graphs"),
               "generate_seconds": m.get("seconds", {}).get("generate"),
               "verify_seconds": m.get("seconds", {}).get("verify"), "load_seconds": round(load_s, 4),
               "generator": m.get("generator"), "stale": rs.stale}
        if args.json:
            print(json.dumps(out, indent=1, sort_keys=True))
        else:
            for k, v in out.items():
                print(f"{k:>18}: {v}")
        return 0
    if args.action == "list":
        from unity_pcg.substitutions.cache import load
        for r in load(None).rules:
            if args.text in r.name:
                print(r)
        return 0
    if args.action == "selfcheck":
        from unity_pcg.verifier.axioms import AXIOMS
        from unity_pcg.verifier.selfcheck import check_all
        res = check_all(AXIOMS)
        bad = [r for r in res if not r.ok]
        for r in bad:
            print(f"WRONG {r.name}: {r.detail}")
        print(f"{len(res) - len(bad)}/{len(res)} axioms hold under the piece semantics")
        return 1 if bad else 0
    return 2
