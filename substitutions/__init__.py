"""Graph substitutions: the rule format, matching, application, the generator and the rule cache.

    from unity_pcg.substitutions import load_rules, GraphIndex, iter_matches, try_apply
    rules = load_rules().all_directions()      # proven rules, reversible ones in both directions
    idx = GraphIndex(g)
    for r in rules:
        for m in iter_matches(r, g, idx, degrees=(2, 4)):
            g2 = try_apply(g, m)                 # None when the result is not a valid parallelization
"""
from .apply import apply_match, try_apply
from .cache import RuleSet, load as load_rules
from .match import GraphIndex, Match, find_matches, iter_matches, match_all
from .rule import Rule, RuleError

__all__ = ["Rule", "RuleError", "RuleSet", "load_rules", "GraphIndex", "Match", "find_matches", "iter_matches",
           "match_all", "apply_match", "try_apply"]
