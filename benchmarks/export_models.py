"""Export the import-coverage architectures to ONNX: random weights, configs built here, nothing downloaded.

Two families, each run by the Python that has its library (the package depends on neither):

* ``transformers`` (pip install transformers into .venv): small configs (2 layers, hidden 64) so that export,
  import and ``--check`` take seconds; batch 2, sequence 16.
* ``torchvision`` (a separate venv outside the repository: torchvision does not import beside .venv's torch):
  the real architectures at their real size, batch 8, 224x224 (Inception-v3: 299x299); BatchNorm running
  statistics from two random batches, zero-initialized weight matrices made random (else outputs do not depend
  on the input: see ``_calibrate_batchnorm``).

Every model is put in ``.eval()`` with a fixed seed and exported with the legacy exporter
(``torch.onnx.export(..., dynamo=False)``) and with the dynamo exporter (``dynamo=True``), each where it works.
Files go to ``benchmarks/.cache/coverage/<model>-<exporter>.onnx`` (git-ignored); ``<family>.json`` beside them
records per export the file, input names/shapes, seconds, or the exporter's error (first line).

    .venv/bin/python benchmarks/export_models.py transformers [--models bert,gpt2] [--refresh]
    /work/tv-venv/bin/python benchmarks/export_models.py torchvision [--models resnet50] [--refresh]

``--batch N`` exports at batch N instead (``<model>-<exporter>-b<N>.onnx``, manifest ``<family>-b<N>.json``):
the reference of ``import_coverage.py --batch-hash``, which compares the batch override of the default export
with these files.  The same weights (seed) and BatchNorm statistics (calibrated at batch 8 whatever N) as the
default export, so only the batch differs.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, ".cache", "coverage")
EXPORTERS = ("legacy", "dynamo")
OPSET = 18

# --- transformers: small configs --------------------------------------------------------------------------------
SEQ, TBATCH, VOCAB, HID, LAYERS, HEADS, FFN = 16, 2, 1000, 64, 2, 4, 128


def _tokens(with_types: bool = True, with_mask: bool = True):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (TBATCH, SEQ), generator=g)
    d = {"input_ids": ids}
    if with_mask:
        d["attention_mask"] = torch.ones(TBATCH, SEQ, dtype=torch.int64)
    if with_types:
        d["token_type_ids"] = torch.zeros(TBATCH, SEQ, dtype=torch.int64)
    return d


def _pixels(size: int, batch: int):
    import torch
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))}


def _hf(name: str):
    """(module, example inputs as an ordered dict) of one transformers architecture."""
    import torch
    import transformers as T

    common = dict(attn_implementation="eager")
    if name == "bert":
        m = T.BertModel(T.BertConfig(vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                     **common), add_pooling_layer=True)
        return m, _tokens()
    if name == "roberta":
        m = T.RobertaModel(T.RobertaConfig(vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=LAYERS,
                                           num_attention_heads=HEADS, intermediate_size=FFN,
                                           max_position_embeddings=64, **common))
        return m, _tokens(with_types=False)
    if name == "distilbert":
        m = T.DistilBertModel(T.DistilBertConfig(vocab_size=VOCAB, dim=HID, n_layers=LAYERS, n_heads=HEADS,
                                                 hidden_dim=FFN, max_position_embeddings=64, **common))
        return m, _tokens(with_types=False)
    if name == "albert":
        m = T.AlbertModel(T.AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=HID,
                                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                                         max_position_embeddings=64, **common))
        return m, _tokens()
    if name == "electra":
        m = T.ElectraModel(T.ElectraConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=HID,
                                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                           intermediate_size=FFN, max_position_embeddings=64, **common))
        return m, _tokens()
    if name == "gpt2":
        m = T.GPT2Model(T.GPT2Config(vocab_size=VOCAB, n_embd=HID, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                     use_cache=False, **common))
        return m, _tokens(with_types=False)  # a mask: without one, transformers traces torch.diff
    if name == "llama":
        m = T.LlamaModel(T.LlamaConfig(vocab_size=VOCAB, hidden_size=HID, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                                       max_position_embeddings=64, use_cache=False, **common))
        return m, _tokens(with_types=False)  # a mask: without one, transformers traces torch.diff
    if name == "t5_encoder":
        m = T.T5EncoderModel(T.T5Config(vocab_size=VOCAB, d_model=HID, d_kv=HID // HEADS, d_ff=FFN,
                                        num_layers=LAYERS, num_heads=HEADS, use_cache=False, **common))
        return m, _tokens(with_types=False)
    if name == "vit":
        m = T.ViTModel(T.ViTConfig(hidden_size=HID, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   intermediate_size=FFN, image_size=32, patch_size=8, **common))
        return m, _pixels(32, TBATCH)
    if name == "whisper_encoder":
        cfg = T.WhisperConfig(vocab_size=VOCAB, d_model=HID, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
                              decoder_layers=1, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                              decoder_ffn_dim=FFN, num_mel_bins=16, max_source_positions=16, max_target_positions=16,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **common)
        m = T.WhisperModel(cfg).get_encoder()
        x = torch.randn(TBATCH, 16, 32, generator=torch.Generator().manual_seed(1))
        return m, {"input_features": x}
    if name == "wav2vec2":
        cfg = T.Wav2Vec2Config(hidden_size=HID, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               intermediate_size=FFN, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                               conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                               do_stable_layer_norm=False, feat_extract_norm="group", **common)
        m = T.Wav2Vec2Model(cfg)
        x = torch.randn(TBATCH, 1600, generator=torch.Generator().manual_seed(1))
        return m, {"input_values": x}
    if name == "bloom":    # ALiBi position biases (not in the import-coverage corpus: every_plan_runs.py's extra)
        m = T.BloomModel(T.BloomConfig(vocab_size=VOCAB, hidden_size=HID, n_layer=LAYERS, n_head=HEADS,
                                       use_cache=False, **common))
        return m, _tokens(with_types=False)
    raise KeyError(name)


HF_MODELS = ["bert", "gpt2", "roberta", "t5_encoder", "vit", "distilbert", "llama", "whisper_encoder", "wav2vec2",
             "albert", "electra"]

# --- torchvision: real size, batch 8 --------------------------------------------------------------------------
TV_BATCH = 8
TV_CALIB_BATCH = 8   # BatchNorm calibration batch: fixed, so that an export at another batch has the same weights
TV_MODELS = {"resnet50": 224, "mobilenet_v3_large": 224, "efficientnet_b0": 224, "convnext_tiny": 224,
             "swin_t": 224, "vit_b_16": 224, "densenet121": 224, "inception_v3": 299, "mobilenet_v2": 224,
             "shufflenet_v2_x1_0": 224, "squeezenet1_1": 224, "regnet_y_400mf": 224, "googlenet": 224}


def _tv(name: str):
    import torch
    import torchvision
    kw = {"weights": None}
    if name in ("inception_v3", "googlenet"):
        kw.update(aux_logits=False, init_weights=True)
    m = torchvision.models.get_model(name, **kw)
    with torch.no_grad():   # zero-initialized weight matrices (ViT's head) would make every output 0: a check of nothing
        for p in m.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
    _calibrate_batchnorm(m, (TV_CALIB_BATCH, 3, TV_MODELS[name], TV_MODELS[name]))
    return m, {"x": torch.randn(TV_BATCH, 3, TV_MODELS[name], TV_MODELS[name],
                                generator=torch.Generator().manual_seed(1))}


def _calibrate_batchnorm(m, shape, batches: int = 2) -> None:
    """Running statistics of every BatchNorm from random batches (cumulative average), as training would leave
    them: with the fresh ones (mean 0, variance 1) activations of randomly initialized deep CNNs shrink layer by
    layer until the logits are the classifier's bias whatever the image (GoogLeNet, ShuffleNet), so a check
    would compare nothing but that bias."""
    import torch
    bns = [x for x in m.modules() if isinstance(x, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    g = torch.Generator().manual_seed(2)
    m.train()
    with torch.no_grad():
        for _ in range(batches):
            m(torch.randn(*shape, generator=g))
    m.eval()


class _Wrap:
    """A module whose forward takes the example inputs positionally and returns plain tensors."""

    def __new__(cls, m, names):
        import torch

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = m

            def forward(self, *xs):
                out = self.m(**dict(zip(names, xs)))
                if isinstance(out, torch.Tensor):
                    return out
                if hasattr(out, "to_tuple"):
                    out = out.to_tuple()
                return tuple(o for o in out if isinstance(o, torch.Tensor))
        return W()


def _suffix(batch: int | None) -> str:
    return f"-b{batch}" if batch else ""


def export_one(family: str, name: str, exporter: str, refresh: bool = False, batch: int | None = None) -> dict:
    """Export one model with one exporter (at its family's batch, or at ``batch``) -> its manifest record."""
    global TBATCH, TV_BATCH
    if not batch:
        return _export_one(family, name, exporter, refresh, None)
    saved = TBATCH, TV_BATCH
    TBATCH = TV_BATCH = batch
    try:
        return _export_one(family, name, exporter, refresh, batch)
    finally:
        TBATCH, TV_BATCH = saved


def _export_one(family: str, name: str, exporter: str, refresh: bool, batch: int | None) -> dict:
    import torch

    path = os.path.join(CACHE, f"{name}-{exporter}{_suffix(batch)}.onnx")
    rec = {"model": name, "family": family, "exporter": exporter, "file": os.path.relpath(path, HERE),
           **({"batch": batch} if batch else {})}
    if os.path.exists(path) and not refresh:
        rec.update(status="cached")
        return rec
    torch.manual_seed(0)
    try:
        m, ex = (_hf if family == "transformers" else _tv)(name)
    except Exception as e:   # a config this library version refuses: a row saying so
        rec.update(status="export_failed", error=f"building the model: {type(e).__name__}: {e}"[:300])
        return rec
    m.eval()
    names = list(ex)
    w = _Wrap(m, names).eval()
    args = tuple(ex[k] for k in names)
    rec["inputs"] = {k: list(v.shape) for k, v in ex.items()}
    t = time.perf_counter()
    err = None
    # under no_grad first (as users export); the legacy exporter has no symbolic for the fused attention
    # (aten::_native_multi_head_attention) that nn.MultiheadAttention takes then, so it retries with autograd on
    for grad in (False, True):
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    torch.set_grad_enabled(grad):
                warnings.simplefilter("ignore")
                if exporter == "legacy":
                    torch.onnx.export(w, args, path, input_names=names, opset_version=OPSET, dynamo=False)
                else:
                    torch.onnx.export(w, args, path, input_names=names, opset_version=OPSET, dynamo=True,
                                      external_data=False, optimize=True)
            rec.update(status="ok", export_seconds=round(time.perf_counter() - t, 2))
            if grad:
                rec["note"] = f"exported with autograd on (under no_grad: {err})"
            return rec
        except Exception as e:   # record why, go on with the next one
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            err = f"{type(e).__name__}: {msg[:300]}"
            for p in (path, path + ".data"):
                if os.path.exists(p):
                    os.remove(p)
            if exporter != "legacy" or "_native_multi_head_attention" not in msg:
                break
    rec.update(status="export_failed", error=err)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=["transformers", "torchvision"])
    ap.add_argument("--models", default="", help="comma-separated subset")
    ap.add_argument("--exporters", default=",".join(EXPORTERS))
    ap.add_argument("--refresh", action="store_true", help="export again even if the file is cached")
    ap.add_argument("--batch", type=int, default=0, metavar="N",
                    help="export at batch N (files *-bN.onnx, manifest <family>-bN.json)")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    names = HF_MODELS if a.family == "transformers" else list(TV_MODELS)
    if a.models:
        names = [n for n in a.models.split(",") if n]
    os.makedirs(CACHE, exist_ok=True)
    man_path = os.path.join(CACHE, f"{a.family}{_suffix(a.batch)}.json")
    man = {}
    if os.path.exists(man_path):
        with open(man_path) as f:
            man = json.load(f)
    for n in names:
        for e in a.exporters.split(","):
            rec = export_one(a.family, n, e, a.refresh, a.batch or None)
            if rec["status"] == "cached" and f"{n}-{e}" in man:
                continue
            if rec["status"] == "cached":
                rec["status"] = "ok"
            man[f"{n}-{e}"] = {**rec, "torch": torch.__version__}
            print(f"{n:20s} {e:7s} {rec['status']} {rec.get('export_seconds', '')} {rec.get('error', '')}",
                  flush=True)
            with open(man_path, "w") as f:
                json.dump(man, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
