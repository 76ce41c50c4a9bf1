"""Write a Llama-style decoder's ONNX graph for planning (no trained weights needed): transformers' LlamaModel at
the given widths, exported by the dynamo exporter with its weights as external data, whose file is then made
sparse (truncated to its size: zeros, no disk blocks): ``load_onnx(path, load_weights=False)`` reads the graph
and every weight's shape only.  Used by ``benchmarks/baselines_coverage.py --llama``.

    .venv/bin/python benchmarks/llama_structure.py OUT.onnx [--hidden 4096 --heads 32 --kv-heads 8 --ffn 11008
        --layers 4 --seq 2048 --batch 32 --vocab 32000]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
import warnings


def export(path: str, hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=4, seq=2048, batch=32, vocab=32000) -> str:
    import torch
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                        use_cache=False, attn_implementation="eager")

    class W(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    torch.manual_seed(0)
    with torch.no_grad():
        m = W(T.LlamaModel(cfg)).eval()
        for p in m.parameters():            # distinct values per tensor: the exporter must not merge them
            p.uniform_(-1e-3, 1e-3)
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (ids, mask), path, input_names=["input_ids", "attention_mask"], dynamo=True,
                          external_data=True, optimize=True)
    del m
    d = os.path.dirname(os.path.abspath(path))
    for f in os.listdir(d):                  # the external data: zeros, no blocks
        fp = os.path.join(d, f)
        if f.startswith(os.path.basename(path)) and f != os.path.basename(path):
            size = os.path.getsize(fp)
            os.truncate(fp, 0)
            os.truncate(fp, size)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    for k, v in dict(hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=4, seq=2048, batch=32, vocab=32000).items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    export(a.out, a.hidden, a.heads, a.kv_heads, a.ffn, a.layers, a.seq, a.batch, a.vocab)
    print(f"{a.out}: {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
