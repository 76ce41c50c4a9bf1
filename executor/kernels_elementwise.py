"""Torch kernels for :mod:`unity_pcg.ops.elementwise` (registered into :data:`unity_pcg.executor.kernels.KERNELS`)."""
