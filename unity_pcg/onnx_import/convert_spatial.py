"""ONNX converters for the spatial operators of :mod:`unity_pcg.ops.spatial` (registered into
:data:`unity_pcg.onnx_import.convert.CONVERTERS`)."""
