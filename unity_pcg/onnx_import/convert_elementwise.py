"""ONNX converters for the element-wise, logical and reduction operators of :mod:`unity_pcg.ops.elementwise`
(registered into :data:`unity_pcg.onnx_import.convert.CONVERTERS`)."""
