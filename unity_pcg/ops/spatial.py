"""Spatial operators added for ONNX import coverage (issue 10): N-d convolution and pooling, ConvTranspose,
instance/group normalization, Resize, Pad; registered with :func:`unity_pcg.ops.compute.compute_op`."""
