"""Weight-free ONNX export of any model at full size: the graph, every weight's real shape and dtype, no bytes.

:func:`export_structure` takes a ``torch.nn.Module`` factory (or a module), a transformers config (a
``config.json`` path, a folder holding one, or a ``PretrainedConfig``) and writes ``path`` plus
``path.data``, a sparse file of zeros (no disk blocks) that every weight points into as ONNX external data.
The file carries ``metadata_props`` ``unity_pcg.weight_free = true`` (:mod:`unity_pcg.weightfree`):
``import``, ``simulate``, ``optimize`` and ``explain`` plan it; ``run`` refuses it.

Method (the "meta route"):

1. The module is built with its parameters on the ``meta`` device (``nn.Module.register_parameter`` moves
   each one there as it is registered, and a tensor factory call of at least ``BIG_TENSOR`` elements makes
   a meta tensor: no weight is ever initialized or held) and its buffers real (rotary frequencies,
   position ids, masks: values the graph's constant folding needs).  The buffers' values are kept aside,
   then the module moves wholly to ``meta``.
2. Depth twin: when the module holds a run of at least 3 identical blocks (an ``nn.ModuleList`` or
   ``nn.Sequential`` whose children have the same class, parameter shapes and buffer values), only its
   first two are kept for the trace; the graph's second block is then copied once per further block
   (:func:`_replicate`, which checks that the blocks chain through one activation, else everything is
   traced).  A 70B decoder traces 2 of its 80 layers: seconds, not the ten minutes of the whole (most of
   them in onnxscript's rewriter, whose cost grows faster than the graph).
3. ``torch.onnx.export(..., dynamo=True, optimize=False)`` traces it with meta inputs of the given shapes
   (torch.export reasons on shapes only).
4. Each initializer is classified: a parameter becomes opaque (no value) while onnxscript's optimizer runs
   (constant folding, rewrites, de-duplication then never read a weight, so no weight's value shapes the
   graph); a buffer gets its real value back; any other initializer must have a real value (an exporter
   constant), or the export fails naming it.
5. Each opaque initializer becomes external data at its offset in the sparse ``.data`` file (``truncate``
   to the total length), node metadata (the exporter's stack traces) is dropped, the graph is written
   (kilobytes to tens of megabytes, whatever the model's size).  The initializers' ``value_info`` entries
   keep torch.export's signature (parameter or buffer), which the importer reads to leave buffers untrained
   (``onnx_import.loader.untrained_initializers``), as on the real export.

The graph equals the one ``torch.onnx.export(dynamo=True)`` writes from the same module with weights, up to
two value-dependent steps of that export which need weights: onnxscript's folding of small constant
subgraphs that read a weight (e.g. a transposed weight, a position-embedding lookup at fixed positions,
named ``val_N`` there, still the weight here) and the de-duplication of equal small weights.  Imported,
both give the same PCG up to weight names once every weight read at fixed positions exceeds the folding
limit (8192 elements); tests/zoo/test_structure.py checks it on transformers' Llama, GPT-2 and BERT.

Why not the narrow twin of :func:`unity_pcg.zoo.export_structure` (trace the model at widths <= 3, give each
initializer its real shape): a graph's width-dependent constants (Reshape targets with head counts and
head sizes, GQA's repeat factors) would have to be recomputed per model; on the meta device the exporter
computes them from the real shapes.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field

from ..errors import UnityError
from ..weightfree import WEIGHT_FREE_KEY

__all__ = ["StructureError", "StructureResult", "export_structure", "build_module", "parse_input_spec",
           "params_on_meta", "load_factory"]


class StructureError(UnityError, ValueError):
    """A bad config, factory or input spec, or a model the weight-free export cannot trace."""


@dataclass
class StructureResult:
    path: str
    data_path: str
    parameters: int            # elements of the module's parameters (tied ones once)
    weight_elements: int       # elements written as sparse external data
    weight_bytes: int          # the sparse data file's length
    inputs: list = field(default_factory=list)    # [(name, shape, dtype)]
    outputs: list = field(default_factory=list)   # [(name, shape, dtype)]
    seconds: dict = field(default_factory=dict)   # build / trace / optimize / write
    source: str = ""


_DTYPES = {"int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "float32": "float32",
           "float": "float32", "float16": "float16", "half": "float16", "float64": "float64", "bool": "bool"}


def parse_input_spec(spec: str):
    """``NAME:2x1024:int64`` (or ``2x1024:int64``, ``2x1024``; dtype default float32) -> (name, shape, dtype)."""
    parts = spec.split(":")
    if not 1 <= len(parts) <= 3:
        raise StructureError(f"bad input spec {spec!r}: expected NAME:DIMS:DTYPE, e.g. input_ids:2x1024:int64")
    name = None
    if len(parts) == 3 or (len(parts) == 2 and not parts[0][:1].isdigit()):
        name, parts = parts[0], parts[1:]
    dims, dtype = parts[0], (parts[1] if len(parts) > 1 else "float32")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise StructureError(f"bad input spec {spec!r}: dims {dims!r} are not integers joined by 'x'") from None
    if any(d < 1 for d in shape):
        raise StructureError(f"bad input spec {spec!r}: every dim must be positive")
    if dtype not in _DTYPES:
        raise StructureError(f"bad input spec {spec!r}: unknown dtype {dtype!r}; valid: {', '.join(sorted(_DTYPES))}")
    return name, shape, _DTYPES[dtype]


#: a tensor factory call (torch.empty, zeros, randn, ...) of at least this many elements made while a module is
#: built is made on the meta device: a weight that big would not fit (or not be worth) allocating, and a
#: buffer that big is refused later (its value is unknown)
BIG_TENSOR = 1 << 26

_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "empty_strided", "normal")


def _numel_of_factory(func, args, kwargs) -> int:
    size = kwargs.get("size")
    if size is None:
        if func.__name__ in ("randint",):
            ints = [a for a in args if isinstance(a, (tuple, list, torch_size()))]
            size = ints[0] if ints else None
        elif func.__name__ == "normal":
            size = args[2] if len(args) > 2 else None
        elif args and isinstance(args[0], (tuple, list, torch_size())):
            size = args[0]
        else:
            size = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    n = 1
    try:
        for d in size or ():
            n *= int(d)
    except (TypeError, ValueError):
        return 0
    return n if size else 0


def torch_size():
    import torch
    return torch.Size


@contextlib.contextmanager
def params_on_meta():
    """Within: every parameter a module registers is moved to the ``meta`` device as it is registered (its
    initialization then runs on meta: no time, no memory), and any tensor factory call of at least
    :data:`BIG_TENSOR` elements without an explicit device makes a meta tensor; other buffers stay real."""
    import torch
    from torch.overrides import TorchFunctionMode
    nn = torch.nn
    original = nn.Module.register_parameter
    factories = {getattr(torch, f) for f in _FACTORIES}

    def register_parameter(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    class BigOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in factories and kwargs.get("device") is None and _numel_of_factory(func, args, kwargs) >= BIG_TENSOR:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        with BigOnMeta():
            yield
    finally:
        nn.Module.register_parameter = original


def load_factory(spec: str):
    """``package.module:function`` (or ``path/to/file.py:function``) -> the callable."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise StructureError(f"bad factory {spec!r}: expected module:function (e.g. mypkg.models:make)")
    try:
        if mod_name.endswith(".py"):
            from importlib import util
            if not os.path.isfile(mod_name):
                raise StructureError(f"factory file {mod_name} not found")
            s = util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
            mod = util.module_from_spec(s)
            s.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except StructureError:
        raise
    except Exception as e:
        raise StructureError(f"cannot import factory module {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise StructureError(f"factory module {mod_name!r} has no {attr!r}")
    if not callable(fn):
        raise StructureError(f"factory {spec!r} is not callable")
    return fn


# ------------------------------------------------------------------------------------ transformers configs


def _transformers():
    try:
        import transformers
    except ImportError:
        raise StructureError("a transformers config needs the transformers package (pip install transformers)") from None
    return transformers


def _is_config_source(source) -> bool:
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        return p.endswith(".json") or os.path.isdir(p)
    t = type(source)
    return any(c.__name__.lower() == "pretrainedconfig" for c in t.__mro__)   # PreTrainedConfig in v5


def load_config(source):
    """A transformers ``PretrainedConfig`` from a ``config.json`` path, a folder holding one, or a config."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise StructureError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StructureError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise StructureError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict):
        raise StructureError(f"{path}: not a transformers config (a JSON object with model_type)")
    mt = d.get("model_type")
    if not mt:
        raise StructureError(f"{path}: not a transformers config (no model_type)")
    T = _transformers()
    try:
        cls = T.AutoConfig.for_model(mt).__class__
    except (ValueError, KeyError):
        raise StructureError(f"{path}: model_type {mt!r} is unknown to transformers {T.__version__}") from None
    d = {k: v for k, v in d.items() if k != "model_type"}
    try:
        return cls.from_dict(d)
    except Exception as e:
        raise StructureError(f"{path}: bad {cls.__name__}: {type(e).__name__}: {e}") from None


def _hf_wrapper(model):
    """A module taking ``input_ids`` and returning the model's first output (logits, or the last hidden
    state of an encoder), without a KV cache."""
    import torch

    class TransformersModel(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            out = self.model(input_ids=input_ids, use_cache=False, return_dict=True)
            logits = getattr(out, "logits", None)
            return logits if logits is not None else out[0]

    return TransformersModel(model)


def _hf_model_class(cfg):
    """The class to build ``cfg`` with: its first ``architectures`` entry transformers has (a config.json of
    the Hub names it: ``LlamaForCausalLM``), else the base model of the config type (``AutoModel``)."""
    T = _transformers()
    for arch in getattr(cfg, "architectures", None) or ():
        cls = getattr(T, arch, None)
        if cls is not None:
            return cls
    mapping = getattr(T.AutoModel, "_model_mapping", None)
    try:
        if mapping is not None and type(cfg) in mapping:
            return mapping[type(cfg)]
    except Exception:
        pass
    raise StructureError(f"transformers {T.__version__} has no model class for config {type(cfg).__name__}")


def _hf_seq(cfg, seq):
    if seq is not None:
        return seq
    for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return min(v, 4096)
    raise StructureError(f"{type(cfg).__name__} states no maximum sequence length: give seq (--seq)")


def _hf_build(cfg):
    import torch
    cls = _hf_model_class(cfg)
    cfg.use_cache = False
    try:  # written-out attention (MatMul/Softmax), the form the importer reads
        cfg._attn_implementation = "eager"
    except Exception:
        pass
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        kwargs = {}
        import inspect
        sig = inspect.signature(cls._from_config)
        if "dtype" in sig.parameters or any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            kwargs["dtype"] = torch.float32
        try:
            model = cls._from_config(cfg, **kwargs)
        except TypeError:
            model = cls._from_config(cfg)
    except StructureError:
        raise
    except Exception as e:
        raise StructureError(f"cannot build {cls.__name__} from its config: {type(e).__name__}: {e}") from None
    finally:
        torch.set_default_dtype(old)
    return _hf_wrapper(model.float())


# --------------------------------------------------------------------------------------------- the export


def build_module(source, *, batch=1, seq=None, inputs=None):
    """Build ``source`` with parameters on meta (see the module doc): returns ``(module, inputs, description,
    output names or None)`` where inputs is a list of (name, shape, torch dtype)."""
    import torch
    if _is_config_source(source):
        cfg = load_config(source)
        s = _hf_seq(cfg, seq)
        with params_on_meta():
            module = _hf_build(cfg)
        desc = f"{type(cfg).__name__} ({_hf_model_class(cfg).__name__})"
        specs = [("input_ids", (batch, s), torch.int64)] if inputs is None else _input_list(inputs)
        outs = ["logits" if "ForCausalLM" in desc or "LMHead" in desc else "output"]
    elif isinstance(source, torch.nn.Module):
        module, desc = source, type(source).__name__
        specs, outs = _input_list(inputs), None
    elif callable(source):
        try:
            with params_on_meta():
                module = source()
        except StructureError:
            raise
        except Exception as e:
            raise StructureError(f"factory {getattr(source, '__name__', source)!r} failed: "
                                 f"{type(e).__name__}: {e}") from None
        if not isinstance(module, torch.nn.Module):
            raise StructureError(f"factory {getattr(source, '__name__', source)!r} returned "
                                 f"{type(module).__name__}, not a torch.nn.Module")
        desc = type(module).__name__
        specs, outs = _input_list(inputs), None
    else:
        raise StructureError(f"cannot export {type(source).__name__}: give a module factory, a module or a "
                             "transformers config")
    return module, specs, desc, outs


def _input_list(inputs):
    import torch
    if not inputs:
        raise StructureError("a module or factory needs its example inputs (inputs=[(shape, dtype)], "
                             "--input NAME:DIMS:DTYPE)")
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            name, shape, dt = parse_input_spec(x)
            out.append((name or f"input{i}", shape, getattr(torch, dt)))
        elif isinstance(x, torch.Tensor):
            out.append((f"input{i}", tuple(x.shape), x.dtype))
        else:
            try:
                if len(x) == 3:
                    name, shape, dt = x
                else:
                    (shape, dt), name = x, f"input{i}"
                dt = getattr(torch, _DTYPES.get(dt, dt)) if isinstance(dt, str) else dt
                out.append((name, tuple(int(d) for d in shape), dt))
            except (TypeError, ValueError):
                raise StructureError(f"input {i}: expected (shape, dtype), (name, shape, dtype), a tensor or "
                                     f"'NAME:DIMS:DTYPE', got {x!r}") from None
    return out


def export_structure(source, path, *, inputs=None, batch: int = 1, seq: "int | None" = None,
                     input_names=None, output_names=None, exporter: str = "dynamo", progress=None,
                     metadata: "dict | None" = None, depth_twin: bool = True) -> StructureResult:
    """Write the weight-free ONNX graph of ``source`` to ``path`` (and its sparse ``path.data``).

    ``source``: a transformers config (``config.json`` path, folder, ``PretrainedConfig``; input
    ``input_ids`` int64 [batch, seq], ``seq`` default: the config's maximum positions, at most 4096), a
    factory (a callable returning an ``nn.Module``; its parameters are created on meta), or a module
    (traced as it is; its weights are not written).  ``inputs``: for a factory or module, a list of
    ``(shape, dtype)``, ``(name, shape, dtype)``, tensors or ``"NAME:DIMS:DTYPE"`` strings.
    ``exporter``: only ``"dynamo"`` (torch.export; see the module doc).  ``depth_twin``: trace two of a
    run of identical blocks and copy the second (see :func:`_replicate`); off, or when the copy's checks
    fail, every block is traced.  ``progress``: called with one line per stage.  Returns a
    :class:`StructureResult`.
    """
    if exporter != "dynamo":
        raise StructureError(f"export_structure: exporter {exporter!r} is not supported here (only 'dynamo'; "
                             "the zoo's legacy narrow-twin export is unity_pcg.zoo.export_structure)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise StructureError(f"batch must be a positive int, got {batch!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise StructureError(f"seq must be a positive int, got {seq!r}")
    say = progress or (lambda msg: None)
    import torch

    secs = {}
    t = time.perf_counter()
    say("building the module with its parameters on the meta device")
    module, specs, desc, default_outs = build_module(source, batch=batch, seq=seq, inputs=inputs)
    owned = not isinstance(source, torch.nn.Module)
    module.eval()
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    n_params = sum(p.numel() for p in module.parameters())
    buffers = {}
    for n, b in module.named_buffers(remove_duplicate=False):
        if b.device.type != "meta":
            buffers[n] = b.detach().cpu().clone()
    names = list(input_names) if input_names else [s_[0] for s_ in specs]
    if len(names) != len(specs):
        raise StructureError(f"{len(names)} input names for {len(specs)} inputs")
    outs = list(output_names) if output_names else default_outs
    twin = _repeated_blocks(module) if depth_twin and owned else None
    if owned:
        module.to("meta")
    secs["build"] = time.perf_counter() - t
    where = "meta" if owned else None
    proto = None
    if twin is not None:
        path_, container, child_names = twin
        _set_submodule(module, path_, _first_two(container))
        try:
            say(f"tracing {desc} with 2 of its {len(child_names)} blocks {path_ or '(root)'}")
            proto = _trace(module, specs, names, outs, params, buffers, desc, where, say, secs)
            _replicate(proto, path_, child_names)
            secs["blocks"] = f"2 of {len(child_names)} traced, copied"
        except (_NoTwin, StructureError) as e:     # e.g. a forward that indexes a block the twin lacks
            say(f"the blocks cannot be copied ({e}): tracing all of them")
            proto = None
        finally:
            _set_submodule(module, path_, container)
    if proto is None:
        say(f"tracing {desc} with torch.export")
        proto = _trace(module, specs, names, outs, params, buffers, desc, where, say, secs)
    return _write(proto, path, desc, metadata, n_params, secs, say)


class _NoTwin(Exception):
    """The depth twin does not apply (the reason is the message)."""


def _block_signature(m):
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def _repeated_blocks(module):
    """``(path, container, child names)`` of the module's largest run of identical blocks: an ``nn.ModuleList``
    or ``nn.Sequential`` of at least 3 children of one class whose parameters and buffers have the same names,
    shapes and dtypes and whose buffers hold equal values; None if there is none."""
    import torch
    nn = torch.nn
    best = None
    for path, m in module.named_modules():
        if type(m) not in (nn.ModuleList, nn.Sequential) or len(m) < 3:
            continue
        kids = list(m.named_children())
        sig = _block_signature(kids[0][1])
        if any(_block_signature(k) != sig for _, k in kids[1:]):
            continue
        first = dict(kids[0][1].named_buffers())
        if any(not all(b.is_meta or first[n].is_meta or torch.equal(b, first[n]) for n, b in k.named_buffers())
               for _, k in kids[1:]):
            continue
        size = sum(p.numel() for p in m.parameters())
        if size and (best is None or size > best[3]):
            best = (path, m, [n for n, _ in kids], size)
    return best[:3] if best else None


def _first_two(container):
    import collections

    import torch
    kids = list(container.named_children())[:2]
    if type(container) is torch.nn.ModuleList:
        return torch.nn.ModuleList([k for _, k in kids])
    return torch.nn.Sequential(collections.OrderedDict(kids))


def _set_submodule(module, path, sub):
    parent, _, attr = path.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, sub)


def _trace(module, specs, names, outs, params, buffers, desc, where, say, secs):
    """torch.export + ONNX translation + onnxscript's optimizer with the parameters opaque; returns the
    ModelProto whose parameters are external data placeholders (offsets set by :func:`_write`)."""
    import logging

    import numpy as np
    import onnx_ir as ir
    import torch
    t = time.perf_counter()
    args = tuple(torch.zeros(shape, dtype=dt, device=where) for _, shape, dt in specs)
    # the exporter logs each capture strategy it tries and drops (tracebacks included); its errors that matter
    # are raised
    quiet = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnx_ir",
                                            "onnxscript", "torch._subclasses", "torch._export")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    try:
        try:
            with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(_Null()):
                warnings.simplefilter("ignore")
                prog = torch.onnx.export(module, args, dynamo=True, optimize=False, verbose=False,
                                         input_names=names, output_names=outs, report=False)
        except Exception as e:
            cause = e.__cause__ or e
            line = (str(cause).strip().splitlines() or [""])[0]
            raise StructureError(f"torch.export cannot trace {desc} on the meta device: {type(cause).__name__}: "
                                 f"{line}") from None
        model = prog.model
        secs["trace"] = secs.get("trace", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        say("optimizing the graph (weights opaque)")
        for name, v in list(model.graph.initializers.items()):
            if name in params:
                v.const_value = None
            elif name in buffers:
                v.const_value = ir.tensor(buffers[name].numpy(), name=name)
            else:
                raw = getattr(v.const_value, "raw", None)
                if v.const_value is None or (isinstance(raw, torch.Tensor) and raw.is_meta):
                    raise StructureError(f"{desc}: constant {name!r} {list(v.shape or ())} was made on the meta "
                                         "device and has no value (make it a smaller buffer or compute it in forward)")
        from onnxscript import optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.optimize_ir(model)
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    for name, v in model.graph.initializers.items():
        if v.const_value is None:
            n = int(np.prod(v.shape.numpy())) if v.shape is not None else 0
            v.const_value = ir.ExternalTensor(_PLACEHOLDER, 0, int(n * v.dtype.itemsize), v.dtype, shape=v.shape,
                                              name=name)
    proto = ir.serde.serialize_model(model)
    secs["optimize"] = secs.get("optimize", 0.0) + time.perf_counter() - t
    return proto


_PLACEHOLDER = "unity-pcg-weight-free-placeholder"


def _scopes(node):
    import ast
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                return set(ast.literal_eval(p.value))
            except (ValueError, SyntaxError):
                return set()
    return set()


def _replicate(proto, prefix: str, child_names) -> None:
    """Turn the graph of a twin holding blocks 0 and 1 of ``prefix`` into the graph of all ``child_names``:
    block 1's nodes are copied once per further block, each copy reading the previous copy's output where
    block 1 reads block 0's, and its own parameters (block 1's, renamed) where block 1 reads its own.

    Block 1's nodes: those torch's exporter scoped in ``prefix.<second child>`` that read (transitively)
    block 1's parameters or its carried input; nodes of block 1 that read neither (constants the optimizer
    may share between blocks) are not copied, as a full trace would share them too.  Refused (:class:`_NoTwin`)
    unless exactly one value flows from block 0 into block 1 (the carried activation), exactly one leaves
    block 1 for the rest of the graph, none of block 0 is read past block 1, and block 1 reads no parameter
    of block 0."""
    g = proto.graph
    full = [f"{prefix}.{c}" if prefix else c for c in child_names]
    s0, s1 = full[0], full[1]
    inits = {t.name: t for t in g.initializer}
    p0 = {n for n in inits if n.startswith(s0 + ".")}
    p1 = {n for n in inits if n.startswith(s1 + ".")}
    if not p1:
        raise _NoTwin(f"no parameter of {s1} in the graph")
    nodes = list(g.node)
    scope = []
    for n in nodes:
        sc = _scopes(n)
        scope.append(1 if s1 in sc else 0 if s0 in sc else "other" if sc else None)
    produced, consumers = {}, {}
    for i, n in enumerate(nodes):
        for o in n.output:
            produced[o] = i
        for x in n.input:
            consumers.setdefault(x, []).append(i)
    # a node the optimizer made (no scope at all) belongs to block b when it reads block b and feeds only it
    for _ in range(3):
        for i, n in enumerate(nodes):
            if scope[i] is not None:
                continue
            ins = {scope[produced[x]] for x in n.input if x in produced} - {None}
            outs_ = {scope[c] for o in n.output for c in consumers.get(o, ())}
            if len(ins) == 1 and ins <= {0, 1} and outs_ and outs_ <= ins | {None}:
                scope[i] = ins.pop()
    variant0 = set(p0)
    for i, n in enumerate(nodes):
        if any(x in variant0 for x in n.input):
            variant0.update(n.output)
    carried = {x for i, n in enumerate(nodes) if scope[i] == 1 for x in n.input
               if x in variant0 and x in produced and scope[produced[x]] == 0}
    if len(carried) != 1:
        raise _NoTwin(f"{len(carried)} values flow from {s0} into {s1}")
    (x_in,) = carried
    if any(x in p0 for i, n in enumerate(nodes) if scope[i] == 1 for x in n.input):
        raise _NoTwin(f"{s1} reads a parameter of {s0}")
    variant1 = set(p1) | {x_in}
    copy = []
    for i, n in enumerate(nodes):
        if scope[i] == 1 and any(x in variant1 for x in n.input):
            variant1.update(n.output)
            copy.append(i)
    members = set(copy)
    graph_outs = {o.name for o in g.output}
    leaving = {o for i in copy for o in nodes[i].output
               if o in graph_outs or any(c not in members for c in consumers.get(o, ()))}
    if len(leaving) != 1:
        raise _NoTwin(f"{len(leaving)} values leave {s1}")
    (y_out,) = leaving
    for i, n in enumerate(nodes):
        if scope[i] == 0:
            for o in n.output:
                if o in variant0 and (o in graph_outs or any(scope[c] != 0 and c not in members
                                                             for c in consumers.get(o, ()))):
                    bad = [(nodes[c].op_type, nodes[c].name, scope[c]) for c in consumers.get(o, ())
                           if scope[c] != 0 and c not in members]
                    raise _NoTwin(f"a value of {s0} is read after the blocks ({o} by {bad})")
    after = [(c, k) for c in consumers.get(y_out, ()) if c not in members
             for k, x in enumerate(nodes[c].input) if x == y_out]
    import onnx
    new_nodes, new_inits, new_infos = [], [], []
    # an initializer's value_info entry carries the exporter's signature (parameter or buffer: the importer's
    # ``untrained_initializers``): each copy gets its own
    infos = {v.name: v for v in g.value_info if v.name in p1}
    prev = y_out
    for b in range(2, len(full)):
        sb, tag = full[b], f"__{child_names[b]}"
        rename = {x_in: prev}
        for name in p1:
            new = sb + name[len(s1):]
            rename[name] = new
            t = onnx.TensorProto()
            t.CopyFrom(inits[name])
            t.name = new
            new_inits.append(t)
            if name in infos:
                v = onnx.ValueInfoProto()
                v.CopyFrom(infos[name])
                v.name = new
                new_infos.append(v)
        for i in copy:
            for o in nodes[i].output:
                if o:
                    rename[o] = o + tag
        for i in copy:
            n = onnx.NodeProto()
            n.CopyFrom(nodes[i])
            n.name = (n.name or n.op_type) + tag
            for k, x in enumerate(n.input):
                n.input[k] = rename.get(x, x)
            for k, o in enumerate(n.output):
                n.output[k] = rename.get(o, o)
            new_nodes.append(n)
        prev = rename[y_out]
    for c, k in after:
        nodes[c].input[k] = prev
    for o in g.output:
        if o.name == y_out:
            o.name = prev
    g.initializer.extend(new_inits)
    g.value_info.extend(new_infos)
    ordered = _topo_sort(nodes + new_nodes, {i.name for i in g.input} | {t.name for t in g.initializer})
    del g.node[:]
    g.node.extend(ordered)


def _topo_sort(nodes, available):
    """Nodes in an order where each reads only what is defined before it (stable: the given order where
    possible)."""
    import collections
    avail = set(available) | {""}
    waiting = collections.defaultdict(list)
    missing = []
    out = []
    ready = collections.deque()
    for i, n in enumerate(nodes):
        need = {x for x in n.input if x not in avail}
        missing.append(need)
    producers = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            producers[o] = i
    for i, need in enumerate(missing):
        need &= set(producers)
        missing[i] = need
        if not need:
            ready.append(i)
        for x in need:
            waiting[x].append(i)
    import heapq
    heap = list(ready)
    heapq.heapify(heap)
    while heap:
        i = heapq.heappop(heap)
        out.append(nodes[i])
        for o in nodes[i].output:
            for j in waiting.pop(o, ()):
                missing[j].discard(o)
                if not missing[j]:
                    heapq.heappush(heap, j)
    if len(out) != len(nodes):
        raise _NoTwin("the copied graph has a cycle")
    return out


def _write(proto, path, desc, metadata, n_params, secs, say) -> StructureResult:
    import onnx
    t = time.perf_counter()
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    data_name = base + ".data"
    offset = elements = 0
    sizes = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
             onnx.TensorProto.DOUBLE: 8, onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4,
             onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1, onnx.TensorProto.BOOL: 1}
    for t_ in proto.graph.initializer:
        info = {e.key: e.value for e in t_.external_data}
        if t_.data_location != onnx.TensorProto.EXTERNAL or info.get("location") != _PLACEHOLDER:
            continue
        n = 1
        for d in t_.dims:
            n *= int(d)
        nbytes = n * sizes.get(t_.data_type, 4)
        del t_.external_data[:]
        for k, val in (("location", data_name), ("offset", str(offset)), ("length", str(nbytes))):
            e = t_.external_data.add()
            e.key, e.value = k, val
        offset += nbytes
        elements += n
    for n in proto.graph.node:      # the exporter's stack traces and scopes: megabytes, of no use here
        del n.metadata_props[:]
    props = {WEIGHT_FREE_KEY: "true", "unity_pcg.weight_free.source": desc, **{str(k): str(v) for k, v in
                                                                                (metadata or {}).items()}}
    kept = [p for p in proto.metadata_props if p.key not in props]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for k, v in props.items():
        e = proto.metadata_props.add()
        e.key, e.value = k, v
    say(f"writing {base} ({elements:,} weight elements as sparse external data)")
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())
        with open(os.path.join(directory, data_name), "wb") as f:
            f.truncate(offset)          # sparse: reads as zeros, occupies no blocks
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp's file is private; the model is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    secs["write"] = time.perf_counter() - t

    def io(vals):
        out = []
        for v in vals:
            tt = v.type.tensor_type
            out.append((v.name, [int(d.dim_value) for d in tt.shape.dim],
                        onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name))
        return out
    return StructureResult(path=path, data_path=os.path.join(directory, data_name), parameters=n_params,
                           weight_elements=elements, weight_bytes=offset, inputs=io(proto.graph.input),
                           outputs=io(proto.graph.output), seconds=secs, source=desc)


class _Null:
    def write(self, s):
        return len(s)

    def flush(self):
        pass
