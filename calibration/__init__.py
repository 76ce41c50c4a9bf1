"""Calibration: measure a machine and describe it as a machine file (DESIGN "Calibration").

It runs devices, which the search never does: the search reads the machine files it writes.

* :mod:`unity_pcg.calibration.local`: ``calibrate`` (``unity-pcg calibrate -o local.json``): a ``local``
  machine of CPU processes sharing cores, measured per world size; ``device=`` dispatches to
* :mod:`unity_pcg.calibration.gpu`: one accelerator's kernels per operator class and math mode (and NCCL
  collectives with several GPUs), fitted into a GPU preset.

Both label what they measure with the cost model's own definitions (``unity_pcg.search.cost.kernel_work``,
the classes of ``search.cost.OP_CLASSES``), so the tables are keyed as the cost model looks them up.
"""
