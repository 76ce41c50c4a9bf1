"""Alpa (OSDI'22) as a planner in our cost model: the intra-operator ILP (:mod:`.intra`) and the inter-operator
stage DP (:mod:`.inter`); ``--strategy alpa``."""
