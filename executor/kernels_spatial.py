"""Torch kernels for :mod:`unity_pcg.ops.spatial` (registered into :data:`unity_pcg.executor.kernels.KERNELS`)."""
