"""The executor: lowers a plan to per-rank torch programs (DTensor, DeviceMesh, pipelining).

Not built yet: no issue has asked for it so far. Nothing here pretends to run a plan.
"""
