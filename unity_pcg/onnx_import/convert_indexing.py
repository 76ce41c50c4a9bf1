"""ONNX converters for the operators of :mod:`unity_pcg.ops.indexing` (registered into
:data:`unity_pcg.onnx_import.convert.CONVERTERS`)."""
