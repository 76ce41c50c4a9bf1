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
dlrm            1024         DLRM as FlexFlow's example: 24 x 1M-row 64-dim embedding bags
xdl             1024         XDL sparse ads model: 16 multi-hot features + deep MLP
candle_uno      256          CANDLE Uno drug-response model, two drugs, 8 x 4192 towers
mlp             256          16 x Linear(8192, 8192) with ReLU
==============  ===========  ======================================================

The GPT models of the Alpa evaluation (OSDI'22, Appendix B, Table 6: seq 1024, vocab 51200) are in
:data:`ALPA_MODELS`, not in :data:`MODELS` (Unity's seven): ``gpt_350m`` (1 GPU), ``gpt_1_3b`` (4),
``gpt_2_6b`` (8), ``gpt_6_7b`` (16), ``gpt_15b`` (32), ``gpt_39b`` (64) (:data:`ALPA_GPUS`), global batch
1024 (``paper_batch``: for these the global batch, not a per-device one), sizes ``tiny`` and ``paper``;
plan them from :func:`export_structure` (no weights are materialized; 39B would be 156 GB).

Llama-style decoders (RMSNorm, SwiGLU, rotary, grouped-query attention) as the Llama 2 and Llama 3 papers
state them are in :data:`LLAMA_MODELS`: ``llama_1b`` (Llama 3.2 1B), ``llama_7b``, ``llama_13b``, ``llama_70b``
(Llama 2), sizes ``tiny``, ``small`` and ``paper``, ``paper_batch`` the global batch of 4M tokens (1024 x 4096).

Every model at every size exports weight-free through :func:`export_structure` (``unity-pcg zoo export NAME
--weights none``, exporter ``auto``): the narrow twin of the legacy exporter where it is exact, else the meta route of
:mod:`unity_pcg.zoo.structure` (the dynamo exporter on a module whose parameters live on the meta device).

Sizes: ``tiny`` (tests), ``paper`` (Unity §6.1) and, for DLRM and CANDLE-Uno, ``small`` (their
earlier published configurations) and DLRM's 6-table ``paper6``; :func:`sizes` lists them.
Paper-size DLRM and CANDLE-Uno hold 1.7 and 0.8 billion parameters: :func:`export_structure`
writes their graph without weights (a sparse zero file stands in), enough to plan them.
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

__all__ = ["ZooEntry", "ZooError", "MODELS", "ALPA_MODELS", "ALPA_GPUS", "LLAMA_MODELS", "entry", "SIZES", "EXPORTERS", "LARGE_MODEL_BYTES",
           "list_models", "sizes", "get_config", "build", "export", "export_structure", "param_count"]


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
        return "adam" if self.name == "bert_large" or self.name.startswith(("gpt_", "llama_")) else "sgd"


MODELS: "OrderedDict[str, ZooEntry]" = OrderedDict(
    (e.name, e) for e in (
        ZooEntry("resnext50", "ResNeXt-50 32x4d image classifier (grouped-conv bottlenecks "
                 "[3,4,6,3], BatchNorm, 224x224, 1000 classes)", 64, 2),
        ZooEntry("inception_v3", "Inception-v3 image classifier (Inception A-E modules with "
                 "factorized convolutions, no aux head, 299x299, 1000 classes)", 64, 2),
        ZooEntry("bert_large", "BERT-Large encoder (24 layers, hidden 1024, 16 heads, FFN 4096, "
                 "seq 512, vocab 30522) with pooler", 4, 2),
        ZooEntry("dlrm", "DLRM recommendation model as FlexFlow's example (24 embedding bags of "
                 "100 lookups, 1M rows x 64; bottom MLP 2048-4096x5; concat; top MLP 4096x4-1; "
                 "no biases)", 1024, 4),
        ZooEntry("xdl", "XDL sparse ads CTR model (16 multi-hot features x 4 ids, sum-pooled "
                 "64-dim embeddings, 500k rows/table, MLP 1024-512-256-1)", 1024, 4),
        ZooEntry("candle_uno", "CANDLE Uno drug-response model as FlexFlow's example (two drugs; "
                 "8x4192 towers on RNA-seq and each drug's descriptors and fingerprints; 4x4192 "
                 "dense; regression; no biases)", 256, 4),
        ZooEntry("mlp", "16 dense layers of 8192 units with ReLU", 256, 4),
    )
)

#: Alpa's GPT benchmark models (Alpa OSDI'22 Table 6); ``paper_batch`` is the global batch (1024)
ALPA_MODELS: "OrderedDict[str, ZooEntry]" = OrderedDict(
    (e.name, e) for e in (
        ZooEntry(n, f"GPT-3-style decoder as Alpa's GPT-{p} (hidden {h}, {l} layers, {a} heads, FFN 4 x hidden, "
                 f"seq 1024, vocab 51200, pre-LN, causal attention, untied LM head)", 1024, 2)
        for n, p, h, l, a in (("gpt_350m", "350M", 1024, 24, 16), ("gpt_1_3b", "1.3B", 2048, 24, 32),
                              ("gpt_2_6b", "2.6B", 2560, 32, 32), ("gpt_6_7b", "6.7B", 4096, 32, 32),
                              ("gpt_15b", "15B", 5120, 48, 32), ("gpt_39b", "39B", 8192, 48, 64))
    )
)
#: Llama-style decoders (configs.LlamaConfig); ``paper_batch`` is the global batch, 4M tokens of 4096
LLAMA_MODELS: "OrderedDict[str, ZooEntry]" = OrderedDict(
    (e.name, e) for e in (
        ZooEntry(n, f"Llama-style decoder as {p} (hidden {h}, {l} layers, {a} heads, {kv} KV heads, SwiGLU FFN {f}, "
                 f"vocab {v}, seq 4096, RMSNorm, rotary, untied LM head)", 1024, 2)
        for n, p, h, l, a, kv, f, v in (
            ("llama_1b", "Llama 3.2 1B", 2048, 16, 32, 8, 8192, 128256),
            ("llama_7b", "Llama 2 7B", 4096, 32, 32, 32, 11008, 32000),
            ("llama_13b", "Llama 2 13B", 5120, 40, 40, 40, 13824, 32000),
            ("llama_70b", "Llama 2 70B", 8192, 80, 64, 8, 28672, 32000))
    )
)
#: GPUs each GPT model is trained on in the Alpa evaluation
ALPA_GPUS = {"gpt_350m": 1, "gpt_1_3b": 4, "gpt_2_6b": 8, "gpt_6_7b": 16, "gpt_15b": 32, "gpt_39b": 64}

SIZES = ("tiny", "small", "paper")   # "small" only where a model has one (see sizes())
EXPORTERS = ("legacy", "dynamo")
#: exporters of :func:`export_structure`: "auto" picks the legacy narrow twin where it is exact, else dynamo
STRUCTURE_EXPORTERS = ("auto", "legacy", "dynamo")

#: Exports whose parameters take at least this many bytes store weights as ONNX
#: external data (one ``<file>.data`` next to the ``.onnx``) unless told otherwise.
LARGE_MODEL_BYTES = 500 * 1024 * 1024


def list_models() -> "list[ZooEntry]":
    return list(MODELS.values())


def entry(name: str) -> ZooEntry:
    """The entry of ``name`` among Unity's models and Alpa's GPT models."""
    e = MODELS.get(name) or ALPA_MODELS.get(name) or LLAMA_MODELS.get(name)
    if e is None:
        raise ZooError(f"unknown model {name!r}; valid names: "
                       f"{', '.join(list(MODELS) + list(ALPA_MODELS) + list(LLAMA_MODELS))}")
    return e


def sizes(name: str) -> "list[str]":
    """The sizes model ``name`` comes in (tiny and paper always)."""
    entry(name)
    return list(CONFIGS[name])


def _check(name: str, size: str) -> ZooEntry:
    if size not in sizes(name):
        raise ZooError(f"unknown size {size!r} for model {name!r}; valid sizes: "
                       f"{', '.join(sizes(name))}")
    return entry(name)


def get_config(name: str, size: str = "tiny"):
    """The (frozen dataclass) hyper-parameters of ``name`` at ``size``; no torch needed."""
    _check(name, size)
    return CONFIGS[name][size]


def _batch(entry: ZooEntry, size: str, batch) -> int:
    if batch is None:
        return entry.tiny_batch if size == "tiny" else entry.paper_batch
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


#: models whose ONNX graph holds no constant that depends on a layer width (only on the batch and
#: structural counts), so :func:`export_structure` can trace a narrow twin of them
_STRUCTURE_OK = {"dlrm": lambda c: c.interaction == "cat", "xdl": lambda c: True,
                 "candle_uno": lambda c: True, "mlp": lambda c: True,
                 **{n: (lambda c: True) for n in ALPA_MODELS}}


def _narrow(cfg):
    """A twin of ``cfg`` with every layer width and row count (fields of sizes, not counts) cut to 3
    or less, its structure (layers, tables, bag, drugs) unchanged."""
    import dataclasses
    if type(cfg).__name__ == "GPTConfig":   # widths only; heads (in the Reshape constants) and seq stay
        return dataclasses.replace(cfg, hidden=cfg.heads, ffn=3, vocab=3)
    small = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in ("bag", "drugs", "num_features", "layers") or isinstance(v, (bool, str)):
            continue
        if isinstance(v, int):
            small[f.name] = min(v, 3)
        elif isinstance(v, tuple):
            small[f.name] = tuple(min(x, 3) for x in v)
    return dataclasses.replace(cfg, **small)


def narrow_twin_ok(name: str, size: str = "paper") -> bool:
    """Whether the legacy narrow-twin export of :func:`export_structure` is exact for ``name`` at ``size``
    (its ONNX graph holds no constant that depends on a layer width)."""
    _check(name, size)
    return name in _STRUCTURE_OK and bool(_STRUCTURE_OK[name](CONFIGS[name][size]))


def export_structure(name: str, path, size: str = "paper", batch: "int | None" = None, exporter: str = "legacy",
                     progress=None):
    """Write the ONNX graph of ``name`` at ``size`` with every float weight stored as external data
    in ``<path>.data``, a sparse file of zeros (no disk blocks, no memory): the graph and every
    weight's shape are those of the real model, so ``load_onnx(path, load_weights=False)`` gives
    its PCG for planning; the file is marked weight-free (``unity-pcg run`` refuses it).

    ``exporter``: ``"legacy"``: the graph is traced by the TorchScript exporter from a narrow twin (widths
    <= 3) whose weights are tagged by value, and each initializer is given the shape of the parameter it
    came from; exact only for models whose graph has no width-dependent constant (:func:`narrow_twin_ok`),
    refused for the others.  ``"dynamo"``: the meta route of :func:`unity_pcg.zoo.structure.export_structure`
    (any model).  ``"auto"``: legacy where it is exact, else dynamo (what ``unity-pcg zoo export --weights
    none`` does).  The default stays ``"legacy"``, whose refusal callers use to fall back to :func:`export`.
    Returns ``path``."""
    if exporter not in STRUCTURE_EXPORTERS:
        raise ZooError(f"unknown exporter {exporter!r}; valid exporters: {', '.join(STRUCTURE_EXPORTERS)}")
    entry = _check(name, size)
    b = _batch(entry, size, batch)
    if exporter == "dynamo" or (exporter == "auto" and not narrow_twin_ok(name, size)):
        from . import models
        from .structure import export_structure as meta_export
        cfg = CONFIGS[name][size]
        inputs = models.example_inputs(name, cfg, 1)       # shapes and dtypes at batch 1 (cheap) ...
        in_names, out_names = models.io_names(name, cfg)
        specs = [(n, (b,) + tuple(x.shape[1:]), x.dtype) for n, x in zip(in_names, inputs)]   # ... at batch b
        meta_export(lambda: models.make_module(name, cfg), path, inputs=specs, output_names=out_names,
                    progress=progress, metadata={"unity_pcg.zoo": f"{name} {size} batch {b}"})
        return os.fspath(path)
    return _export_narrow(name, path, size, b, entry)


def _export_narrow(name, path, size, b, entry):
    cfg = CONFIGS[name][size]
    if name not in _STRUCTURE_OK or not _STRUCTURE_OK[name](cfg):
        raise ZooError(f"export_structure: model {name!r} ({size}) has width-dependent constants, so its legacy "
                       "narrow twin is not exact; use exporter='dynamo' (or 'auto')")
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper

    from . import models
    twin = _narrow(cfg)
    with torch.device("meta"):
        real = models.make_module(name, cfg)
    module = models.make_module(name, twin)
    params = list(module.named_parameters())
    real_shapes = dict((n, tuple(p.shape)) for n, p in real.named_parameters())
    with torch.no_grad():
        for j, (_, p) in enumerate(params):
            p.fill_(float(j + 1))
    module.eval()
    # GPT's graph reads the batch from the tensor shapes (no constant holds it): trace at batch 1, which
    # spares the twin's [batch, heads, seq, seq] attention at seq 1024
    inputs = models.example_inputs(name, twin, 1 if name in ALPA_MODELS else b)
    in_names, out_names = models.io_names(name, cfg)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    with tempfile.TemporaryDirectory(prefix=".zoo-structure-", dir=directory) as tmp:
        tmp_path = os.path.join(tmp, base)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, inputs, tmp_path, dynamo=False, opset_version=17,
                              input_names=in_names, output_names=out_names, do_constant_folding=True)
        proto = onnx.load(tmp_path)
    users: dict = {}
    for node in proto.graph.node:
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        for pos, x in enumerate(node.input):
            users.setdefault(x, []).append((node.op_type, pos, trans_b))
    offset = 0
    data_name = base + ".data"
    for t in proto.graph.initializer:
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
            continue
        v = numpy_helper.to_array(t)
        tags = np.unique(v)
        if v.size == 0 or len(tags) != 1 or not 1 <= tags[0] <= len(params) or tags[0] != int(tags[0]):
            raise ZooError(f"export_structure: initializer {t.name!r} of {name} is not one parameter")
        pname, p = params[int(tags[0]) - 1]
        dims, twin_shape, shape = tuple(t.dims), tuple(p.shape), real_shapes[pname]
        # a Linear's (out, in) weight is stored transposed for MatMul (and Gemm without transB)
        flip = any((op == "MatMul" and pos == 1) or (op == "Gemm" and pos == 1 and not trans_b)
                   for op, pos, trans_b in users.get(t.name, ()))
        if len(dims) == 2 and flip and dims == twin_shape[::-1]:
            new = shape[::-1]
        elif not flip and dims == twin_shape:
            new = shape
        else:
            raise ZooError(f"export_structure: initializer {t.name!r} has shape {list(dims)}, parameter "
                           f"{pname} {list(twin_shape)}")
        nbytes = int(np.prod(new)) * v.dtype.itemsize
        t.ClearField("raw_data")
        t.ClearField("float_data")
        del t.dims[:]
        t.dims.extend(new)
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for k, val in (("location", data_name), ("offset", str(offset)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, val
        offset += nbytes
    from ..weightfree import WEIGHT_FREE_KEY
    for k, val in ((WEIGHT_FREE_KEY, "true"), ("unity_pcg.zoo", f"{name} {size} batch {b}")):
        prop = proto.metadata_props.add()
        prop.key, prop.value = k, val
    for vi in list(proto.graph.value_info):       # intermediate shapes of the twin: not the model's
        proto.graph.value_info.remove(vi)
    # the graph's inputs and outputs get the real model's shapes (outputs from a meta-device forward)
    real_inputs = models.example_inputs(name, cfg, b)
    with torch.no_grad():
        real_outputs = real(*[x.to("meta") for x in real_inputs])
    real_outputs = real_outputs if isinstance(real_outputs, tuple) else (real_outputs,)
    for vi, x in list(zip(proto.graph.input, real_inputs)) + list(zip(proto.graph.output, real_outputs)):
        dims = vi.type.tensor_type.shape.dim
        del dims[:]
        for d in x.shape:
            dims.add().dim_value = int(d)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    with open(os.path.join(directory, data_name), "wb") as f:
        f.truncate(offset)                         # sparse: reads as zeros, occupies no blocks
    return path
