"""ONNX graph -> PCG: graph checks, batch override, constant folding, op conversion.

Values during import are either a :class:`Const` (folded at import time) or a PCG ``Ref`` (an
activation, whose full shape the builder knows).  Nodes are visited in topological order; a node
whose inputs are all constant is folded with numpy (:mod:`.fold`), any other node is converted to
registry operators (:mod:`.convert`).  Constants that feed a converted operator become ``Weight``
nodes named after the initializer they come from.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import UnityError
from ..pcg import PCG, kahn_order
from .consts import MAX_FOLD, SMALL, Const, first_slices, lazy, uniform_along
from .errors import (BatchOverride, DynamicDimension, InvalidModel, MissingTensor, ModelImportError,  # noqa: F401
                     UnsupportedOperator)
from .loader import PCG_DTYPES, default_opset, initializer_const, np_dtype, read_model, untrained_initializers

_AT = {1: "float", 2: "int", 3: "string", 4: "tensor", 5: "graph", 6: "floats", 7: "ints", 8: "strings"}


_REQ = object()


class RegatherNeeded(Exception):
    """Internal (never leaves :func:`load`): the import at the new batch met an embedding of constant ids that
    must follow the batch; ``load`` imports again with ``Importer.regather[name] = (dim, new size)``."""

    def __init__(self, name: str, dim: int, n: int):
        super().__init__(name)
        self.name, self.dim, self.n = name, dim, n


#: operators whose operands line up dim by dim (numpy broadcasting or equal ranks): a constant that holds the
#: exported batch along a dim where an activation operand changed batch is re-broadcast to the new batch
_ALIGNED = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "Greater", "LessOrEqual",
            "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "PRelu", "BitShift", "Concat",
            "GatherElements", "ScatterElements", "BitwiseAnd", "BitwiseOr", "BitwiseXor"}

# element-wise broadcasting operators: a constant operand whose values repeat along a dim that an activation
# operand has is read as its first slice there (:meth:`Importer._reduce_consts`; exact by broadcasting)
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                 "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "BitwiseAnd", "BitwiseOr",
                 "BitwiseXor"}


class NodeCtx:
    """One ONNX node: typed attribute access with one-line errors."""

    __slots__ = ("node", "op", "name", "opset", "attrs", "what", "n_outputs")

    def __init__(self, node, index: int, opset: int):
        self.node = node
        self.op = node.op_type
        self.name = node.name or f"{node.op_type}_{index}"
        self.opset = opset
        self.attrs = {a.name: a for a in node.attribute}
        self.what = f"node {self.name!r} ({self.op})"
        self.n_outputs = len(node.output)

    def has(self, key: str) -> bool:
        return key in self.attrs

    def _get(self, key, kind, default):
        a = self.attrs.get(key)
        if a is None:
            if default is _REQ:
                raise InvalidModel(f"{self.what}: missing attribute {key!r}")
            return default
        t = _AT.get(a.type)
        if t is None and a.type == 0:  # old files: infer from the filled field
            t = next((k for k, f in (("floats", a.floats), ("ints", a.ints)) if len(f)), None)
            if t is None:
                t = "float" if a.HasField("f") else "int" if a.HasField("i") else "string" if a.HasField("s") \
                    else "tensor" if a.HasField("t") else None
        if t != kind:
            raise InvalidModel(f"{self.what}: attribute {key!r} must be {kind}, got {t or 'undefined'}")
        return a

    def i(self, key, default=None):
        a = self._get(key, "int", _REQ if default is None else default)
        return a if not hasattr(a, "type") else int(a.i)

    def f(self, key, default=None):
        a = self._get(key, "float", _REQ if default is None else default)
        return a if not hasattr(a, "type") else float(a.f)

    def s(self, key, default=None):
        a = self._get(key, "string", _REQ if default is None else default)
        return a if not hasattr(a, "type") else a.s.decode("utf-8", "replace")

    def ints(self, key, default: Any = _REQ):
        a = self.attrs.get(key)
        if a is None:
            if default is _REQ:
                raise InvalidModel(f"{self.what}: missing attribute {key!r}")
            return default
        self._get(key, "ints", None)
        return [int(x) for x in a.ints]

    def floats(self, key):
        self._get(key, "floats", _REQ)
        return [float(x) for x in self.attrs[key].floats]

    def t(self, key):
        return self._get(key, "tensor", _REQ).t

    def const_in(self, ins, i) -> Const:
        v = ins[i] if len(ins) > i else None
        if v is None:
            raise InvalidModel(f"{self.what}: missing input {i}")
        if not isinstance(v, Const):
            raise UnsupportedOperator(f"{self.op} with a computed (non-constant) input {i} "
                                      f"(node {self.name!r})")
        return v


def _constant_only(nodes, order, seeds=()) -> set[str]:
    """ONNX tensor names computed from Constant nodes and the untrained initializers ``seeds`` alone (every
    input of their node is one, or it has none; the seeds included): torch trains only its parameters, so a
    Weight holding one is a constant of the model.  The executor's ``model_constants`` applies the same rule
    to a PCG read back."""
    const: set[str] = set(seeds)
    for j in order:
        node = nodes[j]
        if all(x == "" or x in const for x in node.input):
            const.update(o for o in node.output if o)
    return const


def _topo(nodes, producers) -> list[int]:
    """Topological order of ONNX nodes, file order where possible (cycle -> InvalidModel naming a node)."""
    def deps(j):
        return [producers[name] for name in set(x for x in nodes[j].input if x) if name in producers]
    out, stuck = kahn_order(range(len(nodes)), deps)
    if stuck is not None:
        node = nodes[stuck]
        raise InvalidModel(f"the graph has a cycle through node {node.name or node.op_type + '_' + str(stuck)!r} "
                           f"({node.op_type})")
    return out


class Importer:
    def __init__(self, model, base_dir, batch: int | None, load_weights: bool, fuse: bool = True):
        self.m = model
        self.g = model.graph
        self.base = base_dir
        self.batch = batch
        self.load_weights = load_weights
        self.opset = default_opset(model)
        self.b = PCG.builder({})
        self.weights: dict[str, Any] = {}
        self.vals: dict[str, Any] = {}
        self.wnames: set[str] = set()
        # ONNX tensors computed from Constant nodes and untrained initializers alone (no parameter, no input):
        # a Weight of one is a constant of the model (a legacy export's causal mask, rotary tables, GELU's
        # 0.5; a dynamo export's module buffers, see ``loader.untrained_initializers``), not trained
        self.model_consts: set[str] = set()
        self.old_batch: int | None = None
        self.batch_changed = False
        # batch override: the shape of every ONNX tensor when imported at the exported batch (None: no override)
        self.old_shapes: dict[str, tuple[int, ...]] | None = None
        self._rebatched: dict[int, Const] = {}
        # ONNX outputs of Gathers of constant ids from a constant table (embeddings of a folded id tensor) whose
        # ids must follow the batch along (output dim, new size): learnt from an aligned consumer, then re-run
        self.regather: dict[str, tuple[int, int]] = {}
        self._producer: dict[str, Any] = {}
        self.fuse = fuse  # pattern fusion (:mod:`.fuse`); counts of fused patterns by kind
        self.fused: dict[str, int] = {}
        # constant operands reduced to their first slices: id(const) -> (const, reduced) (one Weight per constant)
        self._reduced: dict[int, tuple[Const, Const]] = {}
        # (id(const), axis) of re-batched constants known to repeat along axis (the override checked it)
        self._uniform: dict[tuple[int, int], Const] = {}

    # --- values ---------------------------------------------------------------------------------
    def is_const(self, v) -> bool:
        return isinstance(v, Const)

    def sizes(self, v) -> tuple[int, ...]:
        return v.shape if isinstance(v, Const) else self.b.shape(v).sizes

    def dtype(self, v) -> str:
        return np.dtype(v.dtype).name if isinstance(v, Const) else self.b.shape(v).dtype

    def ref(self, v, hint: str):
        """The PCG ref of a value: a constant becomes a Weight node (once)."""
        if not isinstance(v, Const):
            return v
        if v.wref is not None:
            return v.wref
        dt = np.dtype(v.dtype).name
        if dt not in PCG_DTYPES:
            if v.dtype.kind in "iu" and v.numel <= 1 << 20:
                v2 = Const(v.value.astype(np.int64), origin=v.origin)
                return self._weight(v2, hint, v)
            raise InvalidModel(f"constant {hint!r} has element type {dt}, which a PCG cannot hold")
        return self._weight(v, hint, v)

    def _weight(self, c: Const, hint: str, key: Const):
        name = c.origin if c.origin and c.origin not in self.wnames else hint
        base, k = name, 1
        while name in self.wnames or not name:
            name = f"{base}_{k}"
            k += 1
        self.wnames.add(name)
        if self.load_weights:
            self.weights[name] = c.loader()
        attrs = {"name": name, "shape": tuple(c.shape), "dtype": np.dtype(c.dtype).name}
        if key.frozen or c.frozen or name in self.model_consts:
            attrs["trainable"] = False  # a constant of the model (a reduced fold, or computed from Constant nodes)
        key.wref = self.b.add("Weight", attrs, [], name)
        return key.wref

    def is_read(self, tensor: str) -> bool:
        """Whether a live node or a graph output reads ONNX tensor ``tensor``."""
        return tensor in self._live_inputs or tensor in self.out_names

    def add(self, op: str, attrs: dict, inputs: list, name: str):
        return self.b.add(op, attrs, inputs, name)

    # --- the walk -------------------------------------------------------------------------------
    def run(self) -> PCG:
        g = self.g
        for f in (g.sparse_initializer if hasattr(g, "sparse_initializer") else ()):
            raise InvalidModel(f"sparse initializer {f.values.name!r} is not supported")
        inits = {}
        for t in g.initializer:
            if not t.name:
                raise InvalidModel("an initializer has no name")
            inits[t.name] = t
        # graph inputs (those without an initializer are the model's real inputs)
        real_inputs = [vi for vi in g.input if vi.name not in inits]
        self._make_inputs(real_inputs)
        self.init_names = set(inits)
        # module buffers (rotary tables, causal masks) and exporter constants, when the file says which
        # initializers are parameters (torch's dynamo exporter): constants of the model, not trained
        untrained = untrained_initializers(g)
        for name, t in inits.items():
            c = self.vals[name] = initializer_const(t, self.base, self.load_weights)
            if name in untrained:
                c.frozen = True
        nodes = list(g.node)
        producers: dict[str, int] = {}
        for j, node in enumerate(nodes):
            if not node.op_type:
                raise InvalidModel(f"node {j} has no operator type")
            for o in node.output:
                if not o:
                    continue
                if o in producers or o in self.vals:
                    raise InvalidModel(f"tensor {o!r} is defined twice (node {node.name or node.op_type!r})")
                producers[o] = j
                self._producer[o] = node
        for j, node in enumerate(nodes):
            for x in node.input:
                if x and x not in producers and x not in self.vals:
                    raise MissingTensor(f"node {node.name or node.op_type + '_' + str(j)!r} ({node.op_type}) reads "
                                        f"undefined tensor {x!r} (no node, input or initializer defines it)")
        outs = [o.name for o in g.output]
        if not outs:
            raise InvalidModel("the graph has no outputs")
        for o in outs:
            if o not in producers and o not in self.vals:
                raise MissingTensor(f"graph output {o!r} is not defined by any node, input or initializer")
        order = _topo(nodes, producers)
        self.model_consts = _constant_only(nodes, order, untrained)
        self._batch_sizes = {self.sizes(v)[0] for v in self.vals.values()
                             if not isinstance(v, Const) and self.sizes(v)}
        live = self._live(nodes, producers, outs)
        self.out_names = set(outs)
        from . import fuse
        fusions = fuse.find(nodes, inits, outs) if self.fuse else {}
        deferred = {k for f in fusions.values() for k in f.nodes if k != f.final}
        pos = {j: i for i, j in enumerate(order)}
        for j in order:
            if j not in live or j in deferred:
                continue
            f = fusions.get(j)
            if f is not None:
                ctx = NodeCtx(nodes[j], j, self.opset)
                y = fuse.convert(self, f, ctx.name)
                if y is not None:
                    self.vals[nodes[j].output[0]] = y
                    self.fused[f.kind] = self.fused.get(f.kind, 0) + 1
                    continue
                for k in sorted(f.nodes, key=pos.__getitem__):  # a shape check failed: node by node
                    if k != j:
                        self._visit(nodes, k, outs, live)
            self._visit(nodes, j, outs, live)
        out_refs = []
        for o in outs:
            v = self.vals[o]
            out_refs.append(self.ref(v, o))
        self.b.set_outputs(out_refs)
        pcg = self.b.finish()
        pcg.weights = self.weights
        return pcg

    def _visit(self, nodes, j: int, outs, live) -> None:
        """Convert (or fold) ONNX node ``j`` and record its outputs' values."""
        from . import convert
        node = nodes[j]
        ctx = NodeCtx(node, j, self.opset)
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedOperator(f"unsupported operator {node.domain}::{node.op_type} "
                                      f"(node {ctx.name!r})")
        ins = [self.vals[x] if x else None for x in node.input]
        try:
            try:
                if self.old_shapes is not None:
                    ins = self._rebatch_inputs(ctx, ins)
                if ctx.op in _BROADCASTING:
                    ins = self._reduce_consts(ins)
                results = convert.convert_node(self, ctx, ins)
            except UnityError as e:
                if isinstance(e, ModelImportError):
                    raise
                raise InvalidModel(f"{ctx.what}: {e}") from None
            except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError,
                    ArithmeticError) as e:
                raise InvalidModel(f"{ctx.what}: cannot import ({type(e).__name__}: {e})") from None
            except MemoryError:
                raise InvalidModel(f"{ctx.what}: out of memory while folding a constant") from None
        except InvalidModel as e:
            if self.old_shapes is None or isinstance(e, BatchOverride):
                raise
            # the graph imports at its exported batch, so this failure is the override's
            raise BatchOverride(f"batch {self.batch}: {ctx.what} holds the exported batch {self.old_batch} "
                                f"and cannot be rewritten ({e})") from None
        for k, o in enumerate(node.output):
            if not o:
                continue
            if k >= len(results) or results[k] is None:
                if o in live_names(self, nodes, live) or o in outs:
                    raise UnsupportedOperator(f"output {k} of {node.op_type} is not supported "
                                              f"(node {ctx.name!r})")
                continue
            r = results[k]
            if isinstance(r, Const) and r.origin is None:
                r.origin = o  # a folded constant is named after the tensor it defines
            self.vals[o] = r

    # --- folded constants read by broadcasting ------------------------------------------------------
    def _reduce_consts(self, ins: list) -> list:
        """The operands of an element-wise broadcasting operator, each exporter-folded constant reduced to its
        first slice along every dim where its values are the same and an activation operand has that dim (same
        size, right-aligned): exact by broadcasting, and the same at every batch (a causal mask [B, 1, S, S]
        becomes [1, 1, S, S], so the graph holds no constant that grows with the batch).

        Only the exporter's folds are reduced: a constant (initializer or not: the dynamo exporter stores its
        folds as initializers) of rank >= 2 that holds a model input's batch size along the output's leading
        dim, aligned with an activation's, and repeats along it.  A parameter never holds the batch, so
        parameters are left as they are (a uniform placeholder weight, e.g. ConstantOfShape, would otherwise
        be cut and its gradient changed).  A reduced constant is :attr:`Const.frozen` (not trained).  Values are compared one slice at a time
        (:func:`consts.uniform_along`); a lazy constant without a slice computer is read whole only up to
        ``MAX_FOLD`` elements (else left alone)."""
        acts = [self.sizes(v) for v in ins if v is not None and not isinstance(v, Const)]
        if not acts:
            return ins
        rank = max(len(self.sizes(v)) for v in ins if v is not None)
        out = list(ins)
        for k, c in enumerate(ins):
            if not isinstance(c, Const) or c.numel <= 1 or len(c.shape) > rank:
                continue
            hit = self._reduced.get(id(c))
            if hit is not None and hit[0] is c:
                out[k] = hit[1]
                continue
            r = self._reduce_one(c, acts, rank)
            self._reduced[id(c)] = (c, r)
            out[k] = r
        return out

    def _reduce_one(self, c: Const, acts, rank: int) -> Const:
        off = rank - len(c.shape)
        dims = [j for j, s in enumerate(c.shape)
                if s > 1 and any(len(a) - rank + j + off >= 0 and a[len(a) - rank + j + off] == s for a in acts)]
        if not dims:
            return c
        if c.lazy and c.part is None:
            if c.deferred is not None or c.numel > MAX_FOLD:
                return c
        # the exporter's fold: it holds the batch along the output's leading dim, aligned with an activation's
        if not (off == 0 and rank >= 2 and 0 in dims and c.shape[0] in self._batch_sizes
                and any(len(a) == rank and a[0] == c.shape[0] for a in acts)):
            return c
        if c.lazy and c.part is None:
            c = _held(c)
        cut = []
        with np.errstate(all="ignore"):
            for j in dims:
                known = self._uniform.get((id(c), j))
                if (known is not None and known is c) or uniform_along(c, j):
                    cut.append(j)
                elif j == 0:
                    return c         # values differ along the batch: per-sample data, or a parameter
        r = first_slices(c, cut)
        r.frozen = True
        return r

    # --- batch override ----------------------------------------------------------------------------
    def _changed_dims(self, name: str, v) -> list[tuple[int, int, int]]:
        """(dim, exported size, new size) of each dim of activation ``v`` (ONNX tensor ``name``) that the
        override changed."""
        old = self.old_shapes.get(name) if name else None
        if old is None or isinstance(v, Const) or v is None:
            return []
        new = self.sizes(v)
        if len(old) != len(new):
            return []
        return [(p, o, n) for p, (o, n) in enumerate(zip(old, new)) if o != n]

    def _rebatch_inputs(self, ctx, ins: list) -> list:
        """Rewrite the constants of one node that hold the exported batch, so that the node reads what an
        export at the new batch would hold.  Exact rules, driven by the shapes of the same graph imported at
        its exported batch (``old_shapes``):

        * Reshape/Expand of an activation: the target becomes the exported output shape with the batch-carrying
          dim scaled (for Reshape, the dim whose outer product equals that of the changed input dim);
        * an operand of an aligned operator (element-wise, Concat, GatherElements) that has the exported size
          along a dim where an activation operand changed: re-broadcast, when its values do not vary along it
          (folded Expand/Tile/ConstantOfShape of the exporter); varying values are per-sample data -> error;
        * Gather/GatherND indices ``arange(exported batch)`` along a changed dim: ``arange(new batch)``.
        """
        names = list(ctx.node.input) + [""] * (len(ins) - len(ctx.node.input))
        op = ctx.op
        if op == "Gather" and ctx.node.output[0] in self.regather:
            return self._regather(ctx, list(ins))
        changed = {k: self._changed_dims(names[k], v) for k, v in enumerate(ins)}
        changed = {k: d for k, d in changed.items() if d}
        if not changed:
            return ins
        ins = list(ins)
        if op in ("Reshape", "Expand") and 0 in changed and len(ins) > 1 and isinstance(ins[1], Const):
            new_t = self._rebatch_target(ctx, changed[0])
            if new_t is not None:
                ins[1] = Const(np.asarray(new_t, dtype=np.int64))
            return ins
        if op in _ALIGNED:
            k0 = next(iter(changed))
            rank = len(self.sizes(ins[k0]))
            skip_axis = None
            if op == "Concat":
                ax = ctx.i("axis")
                skip_axis = ax % rank if -rank <= ax < rank else None
            for k, c in enumerate(ins):
                if k not in changed and c is not None and not isinstance(c, Const) and op != "Concat":
                    self._check_const_gather(names[k], c, rank, changed[k0])
                if not isinstance(c, Const) or len(c.shape) > rank:
                    continue
                off = rank - len(c.shape)
                for p, o, n in changed[k0]:
                    j = p - off
                    # a size-1 dim broadcasts in element-wise operators (ambiguous: left alone); Concat needs
                    # equal sizes off its axis, so there it is the exported batch 1
                    if j < 0 or p == skip_axis or (o == 1 and op != "Concat") or c.shape[j] != o:
                        continue
                    c = self._rebroadcast(ctx, names[k], c, j, n)
                ins[k] = c
            return ins
        if op in ("Gather", "GatherND") and 0 in changed and len(ins) > 1 and isinstance(ins[1], Const):
            axis = ctx.i("axis", 0) if op == "Gather" else ctx.i("batch_dims", 0)
            rank = len(self.sizes(ins[0]))
            axis = axis % rank if -rank <= axis < rank else axis
            idx = ins[1]
            for p, o, n in changed[0]:
                if p == axis and o == 1 and idx.numel == 1:
                    raise BatchOverride(f"batch {self.batch}: {ctx.what} takes constant index {idx.value.tolist()} "
                                        f"along the batch dim, exported as 1: arange(batch) or a fixed row cannot "
                                        f"be told apart; export the model at a batch of 2 or more")
                if p == axis and op == "Gather" and o != self.old_batch:
                    flat = self._rebatch_flat_index(ctx, idx, o, n)
                    if flat is not None:
                        ins[1] = flat
                        continue
                if p != axis or o < 2 or idx.numel != o or o not in idx.shape:
                    continue
                v = np.asarray(idx.value).reshape(-1)
                if np.array_equal(np.where(v < 0, v + o, v), np.arange(o)):
                    shape = list(idx.shape)
                    shape[shape.index(o)] = n
                    ins[1] = Const(np.arange(n, dtype=idx.dtype).reshape(shape), origin=idx.origin)
        return ins

    def _check_const_gather(self, name: str, v, rank: int, diffs) -> None:
        """An activation operand of an aligned operator that still holds the exported batch where another
        operand changed it: when it is a Gather of constant ids from a constant table (an embedding of ids the
        legacy exporter folded and expanded to the exported batch, e.g. BERT's buffered token_type_ids), its ids
        must follow the batch; :class:`RegatherNeeded` asks :func:`load` to import again with that rewrite."""
        node = self._producer.get(name)
        if node is None or node.op_type != "Gather" or name in self.regather:
            return
        if not all(isinstance(self.vals.get(x), Const) for x in node.input[:2]):
            return
        sz = self.sizes(v)
        off = rank - len(sz)
        for p, o, n in diffs:
            j = p - off
            if 0 <= j < len(sz) and o > 1 and sz[j] == o:
                raise RegatherNeeded(name, j, n)

    def _regather(self, ctx, ins: list) -> list:
        """Gather of constant ids whose output dim ``j`` must take the new batch: the ids are re-broadcast along
        the matching dim (values constant along it, as an Expand leaves them; per-sample ids are refused)."""
        j, n = self.regather[ctx.node.output[0]]
        data, idx = ins[0], ins[1]
        rank = len(self.sizes(data))
        a = ctx.i("axis", 0)
        a = a % rank if -rank <= a < rank else a
        d = j - a
        if not isinstance(idx, Const) or not 0 <= d < len(idx.shape):
            raise BatchOverride(f"batch {self.batch}: {ctx.what} gathers constant rows whose dim {j} holds the "
                                f"exported batch {self.old_batch} outside the indices; export the model at batch "
                                f"{self.batch}")
        ins[1] = self._rebroadcast(ctx, ctx.node.input[1], idx, d, n)
        return ins

    def _rebatch_flat_index(self, ctx, idx: Const, o: int, n: int) -> Const | None:
        """Constant Gather indices into a dim that flattens the batch with K other elements (size o = B*K, the
        legacy exporter's vmapped transformers masks: ``mask.flatten()[arange(B)[:, None] * K + cols]``).

        When the indices hold one row block per sample along a dim of size B -- ``idx[b] = idx[0] + b*K`` with
        ``idx[0]`` inside the first block [0, K) -- the export at batch N holds the same blocks for N samples,
        so that dim is extended to N.  Indices of another form are left as they are (fixed rows of the flat
        dim do not follow the batch).  An export at batch 1 cannot tell one sample's block from fixed rows:
        indices inside [0, K) there are a ``BatchOverride`` naming the node."""
        b = self.old_batch or 1
        if o % b or (n * b) % o or idx.numel > (1 << 22) or np.dtype(idx.dtype).kind not in "iu":
            return None
        k = o // b
        v = np.asarray(idx.value).astype(np.int64)
        v = np.where(v < 0, v + o, v)
        if b == 1:
            if v.size and 0 <= v.min() and v.max() < k and k > 1:
                raise BatchOverride(f"batch {self.batch}: {ctx.what} takes constant indices into a dim of size {o} "
                                    f"that flattens the batch, exported as 1: one sample's rows or fixed rows cannot "
                                    f"be told apart; export the model at a batch of 2 or more")
            return None
        hits = []
        for d, size in enumerate(v.shape):
            if size != b:
                continue
            first = np.take(v, [0], axis=d)
            shape = [1] * v.ndim
            shape[d] = b
            if first.min() >= 0 and first.max() < k and np.array_equal(v, first + np.arange(b).reshape(shape) * k):
                hits.append((d, first, shape))
        if len(hits) != 1:
            if len(hits) > 1:
                raise BatchOverride(f"batch {self.batch}: {ctx.what} takes constant indices {list(v.shape)} whose "
                                    f"per-sample blocks could run along dims {[h[0] for h in hits]}")
            return None
        d, first, shape = hits[0]
        nb = n // k
        shape[d] = nb
        new = first + np.arange(nb).reshape(shape) * k
        return Const(np.ascontiguousarray(new.astype(idx.dtype)), origin=idx.origin)

    def _rebatch_target(self, ctx, diffs) -> list[int] | None:
        xo = self.old_shapes[ctx.node.input[0]]
        yo = self.old_shapes.get(ctx.node.output[0])
        if yo is None:
            return None
        yn = list(yo)
        if ctx.op == "Expand":
            off = len(yo) - len(xo)
            for p, o, n in diffs:
                yn[p + off] = n
            return yn
        from math import prod
        b0 = self.old_batch or 1
        for p, o, n in diffs:
            # the dim of the output that starts at the same flat offset as the changed input dim takes the batch
            # (the exported size times n/o); among several (1s in between), the first that holds the batch
            outer = prod(xo[:p])
            cands = [i for i in range(len(yo)) if prod(yo[:i]) == outer and (yo[i] * n) % o == 0]
            if not cands:
                cands = _nested_dims(xo, yo, p, n, o)
            elif b0 > 1 and not any(yo[i] % b0 == 0 for i in cands):
                # the dim at the same offset cannot hold the batch (the sequence of a sequence-major merge
                # [S*B, E] -> [S, B, E] whose size the new batch happens to divide): the nested dim that can
                held = [i for i in _nested_dims(xo, yo, p, n, o) if yo[i] % b0 == 0]
                cands = held or cands
            if b0 > 1 and any(yo[i] % b0 == 0 for i in cands):
                cands = [i for i in cands if yo[i] % b0 == 0]
            if not cands:
                raise BatchOverride(f"batch {self.batch}: {ctx.what} moves the batch dim (size {o} at dim {p} of "
                                    f"{list(xo)}) into {list(yo)}, where the importer cannot place the new batch")
            i = cands[0]
            yn[i] = yo[i] * n // o
        return yn

    def _rebroadcast(self, ctx, name: str, c: Const, axis: int, n: int) -> Const:
        """Constant ``c`` holding the exported batch along ``axis``, as the export at batch ``n`` holds it.

        Its values along ``axis`` must be the same (a folded Expand/Tile/ConstantOfShape of the exporter) or an
        arithmetic progression (a folded ``Range(0, B)`` row index, scaled/shifted); both extend to any batch,
        anything else is per-sample data (:class:`BatchOverride`).  Checked one slice along ``axis`` at a time
        (:meth:`Const.take`: a lazy constant computes each slice from how it is made), so a causal mask
        [B, 1, S, S] needs memory of a few [1, 1, S, S] slices, never of the whole.  The result is lazy past
        the small-constant size: computed when its values are read (evaluation, a fold), not to plan."""
        key = (id(c), axis, n)
        hit = self._rebatched.get(key)
        if hit is not None:
            return hit
        dtype = np.dtype(c.dtype)
        b = c.shape[axis]
        step = None
        with np.errstate(all="ignore"):
            first = c.take(axis, 0)
            if b > 1 and dtype.kind != "b":   # booleans have no progression but the constant one
                step = c.take(axis, 1) - first
                if not np.any(step != 0):
                    step = None
            same = True
            if step is not None and b == 2 and not (np.all(first == 0) and np.all(step == 1)):
                same = False  # any two rows are a progression: with an exported batch of 2 only arange(2) counts
            for k in range(1, b if same else 1):
                want = first if step is None else (first + k * step).astype(dtype)
                got = c.take(axis, k)
                same = np.array_equal(got, want) if dtype.kind in "iub" else \
                    bool(np.allclose(got, want, rtol=1e-6, atol=0, equal_nan=True))
                if not same:
                    break
        if not same:
            raise BatchOverride(f"batch {self.batch}: {ctx.what} reads constant {name!r} {list(c.shape)} whose "
                                f"values differ along dim {axis} (per-sample data for the exported batch "
                                f"{self.old_batch}); export the model at batch {self.batch}")
        shape = tuple(n if k == axis else s for k, s in enumerate(c.shape))
        uniform = step is None        # the same along the batch (not a progression): the result repeats too
        src = c if c.lazy else None   # a lazy source: keep its recipe, not two slices of it (recomputed when read)
        if src is not None:
            first = step = None

        def rows(f, st, idx):
            """first + idx * step broadcast along ``axis`` (idx: the batch positions wanted)."""
            ramp = np.asarray(idx).reshape([len(idx) if k == axis else 1 for k in range(len(shape))])
            out = np.broadcast_to(f, [len(idx) if k == axis else s for k, s in enumerate(f.shape)]) \
                if st is None else f + ramp * st
            return np.ascontiguousarray(np.asarray(out).astype(dtype, copy=False))

        def operands(first=first, step=step):
            if src is None:
                return first, step
            f = src.take(axis, 0)
            st = None
            if b > 1 and dtype.kind != "b":
                with np.errstate(all="ignore"):
                    st = src.take(axis, 1) - f
                st = st if np.any(st != 0) else None
            return f, st

        def values():
            f, st = operands()
            return rows(f, st, range(n))

        def part(a: int, i: int) -> np.ndarray:
            f, st = operands()
            if a == axis:
                return rows(f, st, [i])
            f = np.take(f, [i], axis=a)
            return rows(f, None if st is None else np.take(st, [i], axis=a), range(n))
        # the rewritten constant grows with the batch (GPT-2's causal mask [B, 1, S, S] at a global batch of 512:
        # 537 M elements): computed only when its values are read (evaluation, a fold), not to plan
        out = lazy(values, shape, dtype, c.origin, c.deferred, part=part) if np.prod(shape) > SMALL else \
            Const(values(), origin=c.origin)
        self._rebatched[key] = out
        if uniform:
            self._uniform[(id(out), axis)] = out
        return out

    def _live(self, nodes, producers, outs) -> set[int]:
        live: set[int] = set()
        stack = [producers[o] for o in outs if o in producers]
        while stack:
            j = stack.pop()
            if j in live:
                continue
            live.add(j)
            for x in nodes[j].input:
                p = producers.get(x)
                if p is not None and p not in live:
                    stack.append(p)
        self._live_inputs = {x for j in live for x in nodes[j].input if x}
        return live

    def _make_inputs(self, inputs) -> None:
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise ModelImportError(f"batch size must be a positive integer, got {self.batch!r}")
        for vi in inputs:
            name = vi.name
            if not name:
                raise InvalidModel("a graph input has no name")
            if name in self.vals:
                raise InvalidModel(f"graph input {name!r} is declared twice")
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if tt is None:
                raise UnsupportedOperator(f"input {name!r} is not a tensor (sequences/maps are not supported)")
            dtype = np_dtype(tt.elem_type, f"input {name!r}")
            dt = dtype.name
            if dt not in PCG_DTYPES:
                raise InvalidModel(f"input {name!r} has element type {dt}, which a PCG cannot hold")
            if not tt.HasField("shape"):
                raise DynamicDimension(f"input {name!r} has no shape; the importer needs static shapes")
            dims = []
            for k, d in enumerate(tt.shape.dim):
                if k == 0 and self.batch is not None:
                    if d.HasField("dim_value") and d.dim_value > 0:
                        if self.old_batch is None:
                            self.old_batch = int(d.dim_value)
                        if d.dim_value != self.batch:
                            self.batch_changed = True
                    dims.append(int(self.batch))
                    continue
                if d.HasField("dim_value") and d.dim_value > 0:
                    if k == 0 and self.old_batch is None:
                        self.old_batch = int(d.dim_value)
                    dims.append(int(d.dim_value))
                    continue
                label = d.dim_param if d.HasField("dim_param") and d.dim_param else "?"
                if d.HasField("dim_value") and d.dim_value <= 0:
                    if d.dim_value < 0:
                        raise InvalidModel(f"input {name!r} has a negative dimension {d.dim_value} at position {k}")
                    raise DynamicDimension(f"input {name!r} has a zero-size dimension at position {k}")
                if k == 0:
                    raise DynamicDimension(f"input {name!r} has a dynamic batch dimension {label!r} at position 0; "
                                           f"pass --batch N (batch=N) to fix it")
                raise DynamicDimension(f"input {name!r} has a dynamic dimension {label!r} at position {k}; only the "
                                       "batch dimension (position 0) can be set with --batch: export the model "
                                       "with static shapes")
            self.wnames.add(name)  # weights never take an input's name (feeds are matched by name)
            self.vals[name] = self.add("Input", {"name": name, "shape": tuple(dims), "dtype": dt}, [], name)


def _nested_dims(xo, yo, p: int, n: int, o: int) -> list[int]:
    """Output dims of a Reshape ``xo -> yo`` that hold input dim ``p`` (size ``o``, becoming ``n``) exactly:
    an output dim that merges whole input dims including ``p`` (the sequence-first attention layout,
    ``[S, B, H, D] -> [S*B, H*D]``), or one of the output dims that split ``p`` alone (``[S*B, E] -> [S, B, E]``).
    Dim boundaries are compared by prefix products, so only reshapes whose groups line up qualify."""
    from itertools import accumulate
    px = [1, *accumulate(xo, lambda a, b: a * b)]
    py = [1, *accumulate(yo, lambda a, b: a * b)]
    sx = set(px[:p + 1]), set(px[p + 1:])
    out = []
    for i, size in enumerate(yo):
        if size < 2 or (size * n) % o:
            continue
        merge = py[i] in sx[0] and py[i + 1] in sx[1]
        split = px[p] <= py[i] and py[i + 1] <= px[p + 1] and any(py[a] == px[p] for a in range(i + 1)) and \
            any(py[b] == px[p + 1] for b in range(i + 1, len(py)))
        if merge or split:
            out.append(i)
    return out


def _held(c: Const) -> Const:
    """A lazy constant without a slice computer, read once (slices of it would each read it whole)."""
    h = Const(c.materialize(), origin=c.origin)
    h.frozen = c.frozen
    return h


def live_names(imp: Importer, nodes, live) -> set[str]:
    return imp._live_inputs


def _exported_shapes(model, base, imp: Importer) -> "_ExportedShapes | None":
    """With a batch override that changes a fixed exported batch: the shape of every ONNX tensor of the graph
    at its exported batch (the reference the override's rewrites are derived from); else None."""
    if imp.batch is None:
        return None
    g = model.graph
    inits = {t.name for t in g.initializer}
    fixed = [vi for vi in g.input if vi.name not in inits]
    dims0 = {vi.type.tensor_type.shape.dim[0].dim_value for vi in fixed
             if vi.type.HasField("tensor_type") and len(vi.type.tensor_type.shape.dim)}
    if not dims0 or 0 in dims0 or dims0 == {imp.batch}:
        return None  # a dynamic batch (nothing baked in to rewrite) or no change
    return _ExportedShapes(model, base)


class _ExportedShapes:
    """The shapes of a graph's ONNX tensors at its exported batch, as a read-only mapping.  ONNX's own shape
    inference (C++) answers first; a tensor it leaves without a fully static shape makes the graph be
    imported once at its exported batch (the probe, a whole second import), which then answers every
    question.  Where both know a tensor they agree (the importer follows the operators' ONNX semantics;
    ``tests/unity_pcg/test_batch_override.py`` checks it)."""

    def __init__(self, model, base):
        self.model, self.base = model, base
        self.inferred = _onnx_inferred_shapes(model)
        self.probe: dict | None = None

    def _probed(self) -> dict:
        if self.probe is None:
            probe = Importer(self.model, self.base, None, False, fuse=False)
            probe.run()
            self.probe = {name: tuple(v.shape) if isinstance(v, Const) else tuple(probe.b.shape(v).sizes)
                          for name, v in probe.vals.items()}
        return self.probe

    def get(self, name: str, default=None):
        got = self.inferred.get(name)
        return got if got is not None else self._probed().get(name, default)

    def __getitem__(self, name: str) -> tuple[int, ...]:
        got = self.get(name)
        if got is None:
            raise KeyError(name)
        return got


def _onnx_inferred_shapes(model) -> dict[str, tuple[int, ...]]:
    """{tensor: static shape} by ``onnx.shape_inference`` on a copy of the graph whose large initializers
    carry their shapes but not their bytes (a small one may be a shape an operator reads); {} where the
    inference fails."""
    import onnx
    from onnx import shape_inference
    g = model.graph
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    lg = light.graph
    lg.node.extend(g.node)
    lg.input.extend(g.input)
    lg.output.extend(g.output)
    for t in g.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or np.prod(t.dims, dtype=np.int64) > 4096:
            lg.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            lg.initializer.append(t)
    try:
        inferred = shape_inference.infer_shapes(light, data_prop=True)
    except Exception:           # (the inference is an accelerator here: the probe answers without it)
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is not None and tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = tuple(int(d.dim_value) for d in tt.shape.dim)
    for t in g.initializer:
        out[t.name] = tuple(int(d) for d in t.dims)
    return out


def load(src: Any, batch: int | None = None, load_weights: bool = True, fuse: bool = True) -> PCG:
    """Import an ONNX model as a PCG (see :func:`unity_pcg.onnx_import.load_onnx`); ``fuse=False`` keeps the
    exporter's decompositions of GELU, LayerNorm and SiLU as they are (no :mod:`.fuse` patterns)."""
    t0 = time.perf_counter()
    model, base = read_model(src)
    if len(model.functions):
        try:
            from onnx import inliner
            model = inliner.inline_local_functions(model)
        except Exception as e:
            raise InvalidModel(f"cannot inline the model's local functions ({type(e).__name__})") from None
    imp = Importer(model, base, batch, load_weights, fuse)
    old_shapes = _exported_shapes(model, base, imp)
    if old_shapes is None:
        g = imp.run()
    else:
        regather: dict[str, tuple[int, int]] = {}
        while True:   # each round learns one more embedding whose constant ids follow the batch
            imp = Importer(model, base, batch, load_weights, fuse)
            imp.old_shapes, imp.regather = old_shapes, dict(regather)
            try:
                g = imp.run()
                break
            except RegatherNeeded as r:
                if r.name in regather or len(regather) >= 64:
                    raise BatchOverride(f"batch {batch}: constant rows {r.name!r} hold the exported batch "
                                        f"{imp.old_batch} and cannot be rewritten") from None
                regather[r.name] = (r.dim, r.n)
    g.meta.update({"source": "onnx", "opset": imp.opset, "onnx_nodes": len(model.graph.node),
                   "producer": model.producer_name or "", "batch": batch, "fused": dict(imp.fused),
                   "import_seconds": time.perf_counter() - t0})
    return g
