"""The executor: runs a plan's training on torch.distributed, one rank per device of the plan.

* ``executor.lower`` / ``executor.train`` / ``executor.kernels`` / ``executor.dropout``: the lowering of a
  plan to a per-rank program and its training step (``Trainer``);
* ``executor.pipeline``: plans with pipeline stages, run with ``torch.distributed.pipelining`` (1F1B);
* ``executor.__main__``: one rank (``python -m unity_pcg.executor plan.json --model M``; what torchrun runs);
* ``executor.launch``: checks before launch and the local launch of the ranks (`unity-pcg run`);
* ``executor.checkpoint``: ``torch.distributed.checkpoint`` save / resume;
* ``executor.export``: trained weights out (the ONNX model with trained initializers + safetensors;
  ``save_model`` needs no torch);
* ``executor.data``: the feeds of each step (an .npz file, a folder of memory-mapped .npy files or shards,
  or seeded random feeds), each rank reading the rows its pieces need; bad data refused before start;
* ``executor.loss``: ``--loss`` (mean, mse, ce, bce, output), derived from the data when not given, and
  checked against the targets before start.

Importing the package imports no torch; its modules do.
"""
