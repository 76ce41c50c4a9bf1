"""Hyper-parameters of the zoo models, as plain data (no torch import).

Every model has a ``paper`` configuration (the published architecture used in
the Unity evaluation, OSDI'22 section 6.1) and a ``tiny`` configuration with the
same graph structure but small dimensions, so a forward pass takes milliseconds.
DLRM and CANDLE-Uno also keep their earlier, smaller published configurations as
``small`` (DLRM's Criteo Kaggle model, the single-drug Uno), and DLRM has a
6-table ``paper6`` variant of its paper configuration.

The planner may read these to know tensor sizes without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities, in the
# order of the 26 categorical columns C1..C26 (as counted by the DLRM reference
# data loader for the Kaggle dataset).
CRITEO_KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)

#: Row cap applied to the DLRM embedding tables of the ``small`` (Criteo Kaggle) configuration.  The five
#: largest Kaggle tables (2.2M .. 10.1M rows) are truncated to this many rows,
#: which keeps that model at ~89M parameters (~357 MB) instead of ~540M (~2.2 GB).
DLRM_PAPER_ROW_CAP = 1_000_000


@dataclass(frozen=True)
class ResNeXtConfig:
    image: int                 # input is [batch, 3, image, image]
    stem_channels: int         # output channels of the 7x7/2 stem conv
    layers: Tuple[int, ...]    # bottleneck blocks per stage
    planes: Tuple[int, ...]    # bottleneck "planes" per stage (output = 4 * planes)
    groups: int                # cardinality of the grouped 3x3 conv
    width_per_group: int       # bottleneck width d; width = planes*d/64*groups
    num_classes: int


@dataclass(frozen=True)
class InceptionV3Config:
    image: int                 # input is [batch, 3, image, image]; >= 75
    channel_div: int           # every channel count of Inception-v3 is divided by this
    num_classes: int


@dataclass(frozen=True)
class BertConfig:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int                   # sequence length (= number of position embeddings used)
    type_vocab: int = 2        # segment embeddings (segment 0 is used for every token)
    ln_eps: float = 1e-12


@dataclass(frozen=True)
class DLRMConfig:
    dense_features: int                # number of dense (continuous) inputs
    bottom_mlp: Tuple[int, ...]        # output sizes of the bottom MLP (dot: last = emb_dim)
    emb_dim: int
    table_rows: Tuple[int, ...]        # one nn.Embedding per entry
    top_mlp: Tuple[int, ...]           # output sizes of the top MLP (last = 1)
    bag: int = 1                       # ids per table and sample, sum-pooled (1: one lookup, sparse is 2-D)
    interaction: str = "dot"           # "dot" (DLRM's Criteo config) or "cat" (FlexFlow's DLRM example)
    bias: bool = True                  # Linear layers with bias (FlexFlow's example has none)

    @property
    def num_interacting(self) -> int:  # bottom-MLP output + one vector per table
        return 1 + len(self.table_rows)

    @property
    def num_interactions(self) -> int:  # strictly-lower triangle of the dot matrix
        f = self.num_interacting
        return f * (f - 1) // 2


@dataclass(frozen=True)
class XDLConfig:
    num_features: int          # number of sparse (multi-hot) features = embedding tables
    bag: int                   # ids per feature and sample (sum-pooled)
    emb_dim: int
    rows: int                  # rows per embedding table
    mlp: Tuple[int, ...]       # output sizes of the deep MLP (last = 1, then sigmoid)


@dataclass(frozen=True)
class CandleUnoConfig:
    cell_features: int         # cell-line gene expression (RNA-seq, LINCS landmark genes)
    drug_descriptor_features: int   # Dragon7 drug descriptors
    drug_fingerprint_features: int  # ECFP drug fingerprints
    tower: Tuple[int, ...]     # dense layers of each feature tower
    dense: Tuple[int, ...]     # dense layers after the concatenation
    drugs: int = 1             # drugs per sample: one dose input and one descriptor + fingerprint tower each
    bias: bool = True          # Linear layers with bias (FlexFlow's candle_uno has none)


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-3-style decoder (pre-LayerNorm blocks, causal self-attention, GELU MLP of 4 x hidden,
    learned position embeddings, untied LM head), as the Alpa evaluation's GPT models."""
    layers: int
    hidden: int
    heads: int
    vocab: int = 51200
    seq: int = 1024
    ffn: int = 0               # 0: 4 x hidden
    ln_eps: float = 1e-5

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder (Touvron et al. 2023; Llama 3, Dubey et al. 2024): RMSNorm pre-norm blocks,
    rotary position embeddings, grouped-query causal attention (``kv_heads`` key/value heads shared by
    ``heads // kv_heads`` query heads each), SwiGLU MLP (``down(silu(gate(x)) * up(x))``), no biases,
    an untied LM head."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class MLPConfig:
    layers: int
    hidden: int


CONFIGS = {
    "resnext50": {
        "paper": ResNeXtConfig(image=224, stem_channels=64, layers=(3, 4, 6, 3),
                               planes=(64, 128, 256, 512), groups=32, width_per_group=4,
                               num_classes=1000),
        "tiny": ResNeXtConfig(image=32, stem_channels=8, layers=(1, 2, 1, 1),
                              planes=(8, 16, 32, 64), groups=4, width_per_group=16,
                              num_classes=10),
    },
    "inception_v3": {
        "paper": InceptionV3Config(image=299, channel_div=1, num_classes=1000),
        "tiny": InceptionV3Config(image=75, channel_div=8, num_classes=10),
    },
    "bert_large": {
        "paper": BertConfig(layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, seq=512),
        "tiny": BertConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=100, seq=16),
    },
    "dlrm": {
        # FlexFlow's DLRM example as the Unity evaluation ran it on Summit (examples/cpp/DLRM): 64-dim
        # embedding bags of 100 lookups over 1M-row tables, concatenated with the bottom MLP's output;
        # bottom MLP 2048-4096x5 (2048 dense inputs), top MLP 4096x4-1, no biases.  FlexFlow's dense
        # layers read their input width from the tensor, so the top MLP's nominal input "10240" of the
        # command line only scales its initializer: its real input is the concatenation, 4096 + 64 x tables.  24 tables: with 6 the model fits one
        # 16 GB GPU under SGD (benchmarks/results/zoo_memory.md), which the paper says it does not.
        "paper": DLRMConfig(dense_features=2048, bottom_mlp=(4096,) * 5, emb_dim=64,
                            table_rows=(1_000_000,) * 24, top_mlp=(4096,) * 4 + (1,), bag=100,
                            interaction="cat", bias=False),
        "paper6": DLRMConfig(dense_features=2048, bottom_mlp=(4096,) * 5, emb_dim=64,
                             table_rows=(1_000_000,) * 6, top_mlp=(4096,) * 4 + (1,), bag=100,
                             interaction="cat", bias=False),
        # the Criteo Kaggle configuration of the DLRM reference (dot interaction, one id per table)
        "small": DLRMConfig(dense_features=13, bottom_mlp=(512, 256, 64, 16), emb_dim=16,
                            table_rows=tuple(min(c, DLRM_PAPER_ROW_CAP)
                                             for c in CRITEO_KAGGLE_CARDINALITIES),
                            top_mlp=(512, 256, 1)),
        "tiny": DLRMConfig(dense_features=8, bottom_mlp=(16, 16), emb_dim=8, table_rows=(100,) * 4,
                           top_mlp=(16, 16, 1), bag=4, interaction="cat", bias=False),
    },
    "xdl": {
        "paper": XDLConfig(num_features=16, bag=4, emb_dim=64, rows=500_000,
                           mlp=(1024, 512, 256, 1)),
        "tiny": XDLConfig(num_features=16, bag=4, emb_dim=8, rows=100, mlp=(64, 32, 16, 1)),
    },
    "candle_uno": {
        # FlexFlow's candle_uno as the Unity evaluation ran it: two drugs; a tower of 8 dense layers of
        # 4192 (ReLU, no bias) on each of the five feature inputs (cell RNA-seq 942, each drug's
        # descriptors 5270 and fingerprints 2048); the two doses pass through to the concatenation;
        # 4 dense layers of 4192 and one output
        "paper": CandleUnoConfig(cell_features=942, drug_descriptor_features=5270,
                                 drug_fingerprint_features=2048, tower=(4192,) * 8, dense=(4192,) * 4,
                                 drugs=2, bias=False),
        # the single-drug Uno of the CANDLE benchmarks (3 x 1000 towers and dense layers, biases)
        "small": CandleUnoConfig(cell_features=942, drug_descriptor_features=5270,
                                 drug_fingerprint_features=2048, tower=(1000, 1000, 1000),
                                 dense=(1000, 1000, 1000)),
        "tiny": CandleUnoConfig(cell_features=24, drug_descriptor_features=40,
                                drug_fingerprint_features=32, tower=(16, 16, 16),
                                dense=(32, 32, 32), drugs=2, bias=False),
    },
    "mlp": {
        "paper": MLPConfig(layers=16, hidden=8192),
        "tiny": MLPConfig(layers=16, hidden=64),
    },
}

# Alpa (OSDI'22) Appendix B, Table 6: seq 1024, vocab 51200; hidden / layers / heads; the GPU count is in
# unity_pcg.zoo.ALPA_GPUS.  ``tiny``: the same graph structure (2 layers) at widths of a few units.
_GPT_TINY = GPTConfig(layers=2, hidden=32, heads=4, vocab=64, seq=16)
for _name, _h, _l, _heads in (("gpt_350m", 1024, 24, 16), ("gpt_1_3b", 2048, 24, 32), ("gpt_2_6b", 2560, 32, 32),
                              ("gpt_6_7b", 4096, 32, 32), ("gpt_15b", 5120, 48, 32), ("gpt_39b", 8192, 48, 64)):
    CONFIGS[_name] = {"paper": GPTConfig(layers=_l, hidden=_h, heads=_heads), "tiny": _GPT_TINY}

# Llama-style decoders as the papers state them (hidden / layers / heads / KV heads / FFN / vocab / context):
# Llama 2 7B, 13B, 70B (Touvron et al. 2023, Table 1 and section 2.2: 4k context, GQA only at 70B, FFN as
# Meta's released configs: 11008, 13824, 28672, vocab 32000) and Llama 3.2 1B (Llama 3 herd, Dubey et al.
# 2024: 2048 hidden, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, rope theta 500000; here at
# Llama 2's 4k context, not Llama 3's 8k: the [seq, seq] causal mask is a buffer of the graph).  ``tiny`` and ``small``: the same structure (GQA included) at test widths.
_LLAMA_TINY = LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq=16)
_LLAMA_SMALL = LlamaConfig(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, vocab=1024, seq=128)
for _name, _cfg in (
        ("llama_1b", LlamaConfig(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=4096,
                                 rope_theta=500000.0)),
        ("llama_7b", LlamaConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq=4096)),
        ("llama_13b", LlamaConfig(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000, seq=4096)),
        ("llama_70b", LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096))):
    CONFIGS[_name] = {"paper": _cfg, "small": _LLAMA_SMALL, "tiny": _LLAMA_TINY}
