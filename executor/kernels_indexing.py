"""Torch kernels for :mod:`unity_pcg.ops.indexing` (registered into :data:`unity_pcg.executor.kernels.KERNELS`)."""
