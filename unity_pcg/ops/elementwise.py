"""Element-wise, logical, comparison and reduction operators added for ONNX import coverage (issue 10): registered
with :func:`unity_pcg.ops.compute.compute_op` like the core set."""
