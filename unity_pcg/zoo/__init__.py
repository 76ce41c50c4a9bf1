"""Model zoo: the DNNs of the Unity evaluation (OSDI'22, section 6.1), buildable as
PyTorch modules and exportable to ONNX.

This package does not import torch at import time; :func:`build`, :func:`export` and
:func:`param_count` import it when called.  Model hyper-parameters are plain data in
:mod:`unity_pcg.zoo.configs`.

Models (``paper_batch`` is the per-device batch of the Unity evaluation):

==============  ===========  ======================================================
name            paper_batch  model
==============  ===========  ======================================================
resnext50       64           ResNeXt-50 32x4d, 224x224
inception_v3    64           Inception-v3 (no aux head), 299x299
bert_large      4            BERT-Large encoder + pooler, seq 512
dlrm            1024         DLRM, Criteo Kaggle config (tables capped at 1M rows)
xdl             1024         XDL sparse ads model: 16 multi-hot features + deep MLP
candle_uno      256          CANDLE Uno drug-response model
mlp             256          16 x Linear(8192, 8192) with ReLU
==============  ===========  ======================================================
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections import OrderedDict
from dataclasses import dataclass

from .configs import CONFIGS

try:  # the project-wide user-error base class (CLI prints it and exits 2)
    from ..errors import UnityError as _ErrorBase
except ImportError:  # pragma: no cover - zoo used standalone
    _ErrorBase = Exception

__all__ = ["ZooEntry", "ZooError", "MODELS", "SIZES", "EXPORTERS", "LARGE_MODEL_BYTES",
           "list_models", "get_config", "build", "export", "param_count"]


class ZooError(_ErrorBase, ValueError):
    """Unknown model name, size, exporter or a bad batch size."""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    paper_batch: int   # per-device batch size used in the Unity paper
    tiny_batch: int    # batch size used for the tiny (test) configuration

    @property
    def paper_optimizer(self) -> str:
        """The optimizer of Unity §6.1: Adam for BERT-Large, SGD for the other models."""
        return "adam" if self.name == "bert_large" else "sgd"


MODELS: "OrderedDict[str, ZooEntry]" = OrderedDict(
    (e.name, e) for e in (
        ZooEntry("resnext50", "ResNeXt-50 32x4d image classifier (grouped-conv bottlenecks "
                 "[3,4,6,3], BatchNorm, 224x224, 1000 classes)", 64, 2),
        ZooEntry("inception_v3", "Inception-v3 image classifier (Inception A-E modules with "
                 "factorized convolutions, no aux head, 299x299, 1000 classes)", 64, 2),
        ZooEntry("bert_large", "BERT-Large encoder (24 layers, hidden 1024, 16 heads, FFN 4096, "
                 "seq 512, vocab 30522) with pooler", 4, 2),
        ZooEntry("dlrm", "DLRM recommendation model, Criteo Kaggle config (bottom MLP "
                 "13-512-256-64-16, 26 embedding tables of dim 16, dot interaction, top MLP "
                 "512-256-1)", 1024, 4),
        ZooEntry("xdl", "XDL sparse ads CTR model (16 multi-hot features x 4 ids, sum-pooled "
                 "64-dim embeddings, 500k rows/table, MLP 1024-512-256-1)", 1024, 4),
        ZooEntry("candle_uno", "CANDLE Uno drug-response model (3x1000 towers for gene "
                 "expression, drug descriptors, fingerprints; 3x1000 dense; regression)", 256, 4),
        ZooEntry("mlp", "16 dense layers of 8192 units with ReLU", 256, 4),
    )
)

SIZES = ("tiny", "paper")
EXPORTERS = ("legacy", "dynamo")

#: Exports whose parameters take at least this many bytes store weights as ONNX
#: external data (one ``<file>.data`` next to the ``.onnx``) unless told otherwise.
LARGE_MODEL_BYTES = 500 * 1024 * 1024


def list_models() -> "list[ZooEntry]":
    return list(MODELS.values())


def _check(name: str, size: str) -> ZooEntry:
    if name not in MODELS:
        raise ZooError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ZooError(f"unknown size {size!r} for model {name!r}; valid sizes: "
                       f"{', '.join(SIZES)}")
    return MODELS[name]


def get_config(name: str, size: str = "tiny"):
    """The (frozen dataclass) hyper-parameters of ``name`` at ``size``; no torch needed."""
    _check(name, size)
    return CONFIGS[name][size]


def _batch(entry: ZooEntry, size: str, batch) -> int:
    if batch is None:
        return entry.paper_batch if size == "paper" else entry.tiny_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ZooError(f"batch must be a positive int, got {batch!r}")
    return batch


def build(name: str, size: str = "tiny", batch: "int | None" = None):
    """Build model ``name``.

    Returns ``(module, example_inputs, input_names, output_names)``: the torch module in
    eval() mode with weights drawn from torch's global RNG (call ``torch.manual_seed``
    first for determinism), a tuple of example input tensors (deterministic) whose
    leading dimension is ``batch`` (default: the entry's paper or tiny batch), and the
    names to give the graph inputs / outputs.
    """
    entry = _check(name, size)
    b = _batch(entry, size, batch)
    from . import models
    return models.build(name, CONFIGS[name][size], b)


def param_count(name: str, size: str = "paper") -> int:
    """Number of parameters (not buffers) of ``name`` at ``size``, counted on a module
    built on the ``meta`` device (no memory is allocated)."""
    _check(name, size)
    from . import models
    module = models.make_module(name, CONFIGS[name][size], device="meta")
    return sum(p.numel() for p in module.parameters())


def export(name: str, path, size: str = "tiny", batch: "int | None" = None,
           exporter: str = "legacy", external_data: "bool | None" = None, seed: int = 0,
           keep_batchnorm: "bool | None" = None):
    """Export model ``name`` to the ONNX file ``path`` and return ``path``.

    Weights are random but deterministic (``torch.manual_seed(seed)``); the model is in
    eval() mode and all shapes are static (the batch dimension included).

    ``exporter="legacy"``: TorchScript exporter (``dynamo=False``), opset 17.
    ``exporter="dynamo"``: ``torch.export``-based exporter (``dynamo=True``), opset 18.
    ``keep_batchnorm``: keep BatchNormalization nodes (``TrainingMode.PRESERVE``; a training
    graph has them). Default: kept with the legacy exporter; the dynamo exporter always folds
    inference BatchNorm into the preceding Conv.

    ``external_data``: None = automatic (parameters >= ``LARGE_MODEL_BYTES``); True
    stores all weights in ``<basename>.data`` next to ``path``; False embeds them (fails
    beyond protobuf's 2 GB limit).
    """
    entry = _check(name, size)
    b = _batch(entry, size, batch)
    if exporter not in EXPORTERS:
        raise ZooError(f"unknown exporter {exporter!r}; valid exporters: {', '.join(EXPORTERS)}")
    if keep_batchnorm is None:
        keep_batchnorm = exporter == "legacy"
    if keep_batchnorm and exporter != "legacy":
        raise ZooError("keep_batchnorm=True is only supported with exporter='legacy'")

    import onnx
    import torch

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)

    torch.manual_seed(seed)
    from . import models
    model, inputs, in_names, out_names = models.build(name, CONFIGS[name][size], b)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    use_external = (nbytes >= LARGE_MODEL_BYTES) if external_data is None else bool(external_data)

    with tempfile.TemporaryDirectory(prefix=".zoo-export-", dir=directory) as tmp:
        tmp_path = os.path.join(tmp, base)
        with torch.no_grad(), warnings.catch_warnings():
            # the exporters' own deprecation chatter, and the PRESERVE-mode constant
            # folding advice (irrelevant: the module is in eval mode)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*constant folding.*", category=UserWarning)
            if exporter == "legacy":
                mode = (torch.onnx.TrainingMode.PRESERVE if keep_batchnorm
                        else torch.onnx.TrainingMode.EVAL)
                torch.onnx.export(model, inputs, tmp_path, dynamo=False, opset_version=17,
                                  input_names=in_names, output_names=out_names,
                                  do_constant_folding=True, training=mode)
            else:
                torch.onnx.export(model, inputs, tmp_path, dynamo=True, opset_version=18,
                                  input_names=in_names, output_names=out_names,
                                  external_data=True, verbose=False)
        del model
        proto = onnx.load(tmp_path)  # pulls in any external data the exporter wrote
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory cleans it up again
        data_file = os.path.join(directory, base + ".data")
        if os.path.exists(data_file):  # onnx appends to an existing data file
            os.remove(data_file)
        if use_external:
            onnx.save_model(proto, path, save_as_external_data=True,
                            all_tensors_to_one_file=True, location=base + ".data",
                            size_threshold=1024)
        else:
            onnx.save_model(proto, path)
    return path
