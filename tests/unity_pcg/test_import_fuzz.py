"""Fuzzing the ONNX importer: mutated models either import to a PCG that passes ``check()`` or raise a
``UnityError`` with a one-line message; never another exception or a hang.  A sample also goes through the
CLI (``unity-pcg import``), which must exit 0 or 2 without a traceback.

Mutations (1 to 3 per case, deterministic seed): bytes flipped or truncated in the serialized file, nodes
dropped, attributes changed (value, type, removed, unknown one added), inputs rewired, graph input shapes and
initializer shapes/values changed, operator types swapped, graph outputs changed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unity_pcg.errors import UnityError
from unity_pcg.onnx_import import load_onnx

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 20240521
CASE_SECONDS = 10
OPS = ["Relu", "Add", "Mul", "Conv", "Gemm", "MatMul", "Reshape", "Transpose", "Concat", "Softmax", "MaxPool",
       "Gather", "Slice", "Hardmax", "Loop", "Unsqueeze", "Shape", "ConstantOfShape", "Expand", "Split", "Where",
       "BatchNormalization", "LayerNormalization", "Identity", "Dropout", "Cast", "ReduceSum", "Flatten", "Sum"]


def _hand_built() -> onnx.ModelProto:
    """Shape chains, Gemm, Split, Slice, Where, Expand, Range, Cast: the exporter idioms in one small graph."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 6)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((6,)).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(3, np.int64), "three"),
             numpy_helper.from_array(np.array([-1, 3], np.int64), "shape2")]
    N = helper.make_node
    nodes = [
        N("Shape", ["x"], ["sx"], name="shape"),
        N("Gather", ["sx", "zero"], ["bdim"], axis=0, name="gather_b"),
        N("Concat", ["bdim", "shape2"], ["tgt"], axis=0, name="cat_shape"),
        N("Gemm", ["x", "W", "b"], ["g"], transB=0, alpha=1.0, name="gemm"),
        N("Split", ["g"], ["g1", "g2"], axis=1, name="split"),
        N("Slice", ["g1", "zero", "three", "one"], ["s1"], name="slice"),
        N("Sub", ["g2", "s1"], ["d"], name="sub"),
        N("Range", ["zero_s", "three", "one_s"], ["r"], name="range"),
        N("Cast", ["r"], ["rf"], to=TensorProto.FLOAT, name="cast"),
        N("Add", ["d", "rf"], ["e"], name="add"),
        N("Unsqueeze", ["e", "one"], ["u"], name="unsq"),
        N("Reshape", ["u", "tgt"], ["rs"], name="reshape"),
        N("ConstantOfShape", ["sx"], ["ones"], value=numpy_helper.from_array(np.array([1.0], np.float32)),
          name="cos"),
        N("ReduceSum", ["ones", "one"], ["rsum"], keepdims=0, name="rsum"),
        N("Softmax", ["rs"], ["y"], axis=-1, name="softmax"),
        N("Mul", ["rsum", "rsum"], ["y2"], name="mul"),
    ]
    inits += [numpy_helper.from_array(np.array(0, np.int64), "zero_s"),
              numpy_helper.from_array(np.array(1, np.int64), "one_s")]
    g = helper.make_graph(nodes, "hand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("y2", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _torch_models() -> list[onnx.ModelProto]:
    try:
        import io

        import torch
    except ImportError:
        return []
    nn = torch.nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.e = nn.Embedding(10, 8)
            self.l1, self.l2 = nn.Linear(4 * 4 * 4 + 8, 16), nn.Linear(16, 3)
            self.ln = nn.LayerNorm(16)

        def forward(self, img, ids):
            h = nn.functional.max_pool2d(torch.relu(self.bn(self.c(img))), 2)
            e = self.e(ids).sum(dim=1)
            z = torch.cat([h.flatten(1), e], dim=1)
            z = self.ln(nn.functional.gelu(self.l1(z)))
            q = z.view(z.shape[0], 4, 4)
            a = torch.softmax(q @ q.transpose(1, 2) / 2.0, dim=-1)
            return self.l2((a @ q).reshape(z.shape[0], 16)).sigmoid()

    torch.manual_seed(0)
    out = []
    mod = Small().eval()
    args = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2, 5)))
    for dyn in (None, {"img": {0: "b"}, "ids": {0: "b"}}):
        f = io.BytesIO()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(mod, args, f, dynamo=False, opset_version=17, input_names=["img", "ids"],
                              dynamic_axes=dyn, do_constant_folding=dyn is None)
        m = onnx.load_from_string(f.getvalue())
        if dyn:  # fix the batch so the unmutated model imports without an override
            for vi in m.graph.input:
                vi.type.tensor_type.shape.dim[0].dim_value = 2
        out.append(m)
    return out


@pytest.fixture(scope="module")
def seeds() -> list[onnx.ModelProto]:
    ms = [onnx.load(os.path.join(LIGHT_DIR, f"light_{n}.onnx")) for n in ("bvlc_alexnet", "squeezenet", "zfnet512")]
    ms.append(_hand_built())
    ms += _torch_models()
    for m in ms:  # the seeds themselves import
        load_onnx(m).check()
    return ms


# --- mutations -------------------------------------------------------------------------------------

def _rand_int(rng):
    return int(rng.choice([-2, -1, 0, 1, 2, 3, 7, 64, 1 << 20, -(1 << 40), 1 << 62]))


def _names(m) -> list[str]:
    names = [i.name for i in m.graph.input] + [t.name for t in m.graph.initializer]
    for n in m.graph.node:
        names += list(n.output)
    return names


def mutate(m: onnx.ModelProto, rng: np.random.Generator) -> tuple[bytes, str]:
    m = onnx.ModelProto.FromString(m.SerializeToString())
    done = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["drop", "attr", "rewire", "shape", "init", "optype", "output", "bytes"],
                          p=[.14, .22, .14, .1, .12, .1, .06, .12])
        nodes = m.graph.node
        if kind == "drop" and len(nodes):
            j = int(rng.integers(len(nodes)))
            done.append(f"drop {nodes[j].op_type}")
            del nodes[j]
        elif kind == "attr" and len(nodes):
            cand = [n for n in nodes if len(n.attribute)] or list(nodes)
            n = cand[int(rng.integers(len(cand)))]
            how = rng.choice(["value", "type", "remove", "add"])
            if how == "add" or not len(n.attribute):
                n.attribute.append(helper.make_attribute(str(rng.choice(["axis", "perm", "bogus", "group", "to"])),
                                                         _rand_int(rng)))
            else:
                a = n.attribute[int(rng.integers(len(n.attribute)))]
                if how == "remove":
                    n.attribute.remove(a)
                elif how == "type":
                    new = helper.make_attribute(a.name, [1.5, 3, "xx", [1, 2], [0.5]][int(rng.integers(5))])
                    n.attribute.remove(a)
                    n.attribute.append(new)
                elif a.type == onnx.AttributeProto.INT:
                    a.i = _rand_int(rng)
                elif a.type == onnx.AttributeProto.INTS:
                    k = int(rng.integers(0, max(2, len(a.ints) + 2)))
                    del a.ints[:]
                    a.ints.extend(_rand_int(rng) for _ in range(k))
                elif a.type == onnx.AttributeProto.FLOAT:
                    a.f = float(rng.choice([-1.0, 0.0, 1e30, float("nan"), 0.5]))
                elif a.type == onnx.AttributeProto.STRING:
                    a.s = bytes(rng.choice([b"SAME_UPPER", b"VALID", b"tanh", b"", b"junk"]))
                elif a.type == onnx.AttributeProto.TENSOR:
                    a.t.dims[:] = [int(rng.integers(0, 4))] + list(a.t.dims[1:])
            done.append(f"attr {how} {n.op_type}")
        elif kind == "rewire" and len(nodes):
            n = nodes[int(rng.integers(len(nodes)))]
            names = _names(m) + ["", "nowhere"]
            if len(n.input):
                k = int(rng.integers(len(n.input)))
                n.input[k] = names[int(rng.integers(len(names)))]
            elif rng.random() < 0.5:
                n.input.append(names[int(rng.integers(len(names)))])
            done.append(f"rewire {n.op_type}")
        elif kind == "shape" and len(m.graph.input):
            vi = m.graph.input[int(rng.integers(len(m.graph.input)))]
            dims = vi.type.tensor_type.shape.dim
            if len(dims) and rng.random() < 0.7:
                d = dims[int(rng.integers(len(dims)))]
                if rng.random() < 0.3:
                    d.dim_param = "dyn"
                else:
                    d.dim_value = int(rng.choice([0, 1, 2, 3, 5, 17, 1000]))
            elif len(dims):
                del dims[int(rng.integers(len(dims)))]
            else:
                vi.type.tensor_type.elem_type = int(rng.choice([2, 8, 16, 7]))
            done.append("shape")
        elif kind == "init" and len(m.graph.initializer):
            t = m.graph.initializer[int(rng.integers(len(m.graph.initializer)))]
            try:
                a = numpy_helper.to_array(t)
            except Exception:  # an earlier mutation already broke it
                a = None
            how = rng.choice(["values", "dims", "dtype"])
            if how == "values" and a is not None and a.size <= 64:
                if a.dtype.kind in "iu":
                    v = rng.integers(-3, 300, a.shape).astype(a.dtype)
                else:
                    v = (rng.standard_normal(a.shape) * 10).astype(a.dtype)
                t.CopyFrom(numpy_helper.from_array(v, t.name))
            elif how == "dims" and len(t.dims):
                t.dims[int(rng.integers(len(t.dims)))] = int(rng.integers(0, 9))
            else:
                t.data_type = int(rng.choice([1, 7, 6, 9, 10, 11]))
            done.append(f"init {how}")
        elif kind == "optype" and len(nodes):
            n = nodes[int(rng.integers(len(nodes)))]
            new = str(rng.choice(OPS))
            done.append(f"optype {n.op_type}->{new}")
            n.op_type = new
        elif kind == "output":
            names = _names(m) + ["nowhere"]
            if rng.random() < 0.3 and len(m.graph.output) > 1:
                del m.graph.output[0]
            else:
                m.graph.output.append(helper.make_tensor_value_info(names[int(rng.integers(len(names)))],
                                                                    TensorProto.FLOAT, None))
            done.append("output")
        elif kind == "bytes":
            done.append("bytes")
    data = bytearray(m.SerializeToString())
    if "bytes" in done and data:
        if rng.random() < 0.25:
            data = data[: int(rng.integers(len(data)))]
        else:
            for _ in range(int(rng.integers(1, 12))):
                data[int(rng.integers(len(data)))] = int(rng.integers(256))
    return bytes(data), ", ".join(done)


class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


def check_case(data: bytes, desc: str) -> str:
    """'ok' or 'error' (a UnityError); anything else fails the test with the case description."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        g = load_onnx(data)
        g.check()
        g.summary()
        return "ok"
    except UnityError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"{desc}: multi-line message {msg!r}"
        return "error"
    except _Hang:
        pytest.fail(f"import hung for more than {CASE_SECONDS} s ({desc})")
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{desc}: {type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _cases(seeds, n, seed):
    rng = np.random.default_rng(seed)
    for k in range(n):
        src = seeds[k % len(seeds)]
        data, desc = mutate(src, rng)
        yield data, f"case {k} (seed model {k % len(seeds)}): {desc}"


def _sweep(seeds, n, seed):
    stats = {"ok": 0, "error": 0}
    for data, desc in _cases(seeds, n, seed):
        stats[check_case(data, desc)] += 1
    return stats


def test_fuzz_import_500(seeds):
    stats = _sweep(seeds, 520, SEED)
    # both outcomes occur: the mutations are neither all harmless nor all fatal
    assert stats["ok"] >= 30 and stats["error"] >= 100, stats


@pytest.mark.slow
def test_fuzz_import_big_sweep(seeds):
    stats = _sweep(seeds, 5000, SEED + 1)
    assert stats["ok"] >= 300 and stats["error"] >= 1000, stats


def test_fuzz_cli_exit_codes(seeds, tmp_path):
    cases = list(_cases(seeds, 30, SEED + 2))
    paths = []
    for k, (data, desc) in enumerate(cases):
        p = tmp_path / f"case{k}.onnx"
        p.write_bytes(data)
        paths.append((str(p), desc))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(item):
        path, desc = item
        r = subprocess.run([sys.executable, "-m", "unity_pcg.cli", "import", path, "--json"], capture_output=True,
                           text=True, timeout=120, env=env, cwd=ROOT)
        return r, desc

    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(run, paths))
    codes = []
    for r, desc in results:
        assert r.returncode in (0, 2), f"{desc}: exit {r.returncode}: {r.stderr[-500:]}"
        assert "Traceback" not in r.stderr, f"{desc}: {r.stderr[-800:]}"
        if r.returncode == 2:
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("unity-pcg import: error: "), r.stderr
        codes.append(r.returncode)
    assert 0 in codes and 2 in codes, codes
