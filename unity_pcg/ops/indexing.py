"""Indexing, comparison and masking operators added for ONNX import coverage (issue 10): Where and the
comparisons on activations, GatherElements, Tile, Einsum, Trilu, ScatterND."""
