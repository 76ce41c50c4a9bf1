"""Case generators for the operators of :mod:`unity_pcg.ops.elementwise` (merged into op_cases.GENERATORS)."""
from __future__ import annotations

GENERATORS: dict = {}
