"""Case generators for the operators of :mod:`unity_pcg.ops.indexing` (merged into op_cases.GENERATORS)."""
from __future__ import annotations

GENERATORS: dict = {}
