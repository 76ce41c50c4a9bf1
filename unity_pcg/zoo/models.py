"""PyTorch implementations of the zoo models (this module imports torch).

All models are written so that they export to a small, static set of ONNX ops:
no data-dependent shapes, reshapes use constant target shapes (``-1`` for the
batch dimension), constants are registered buffers.  Only the torch-free
``unity_pcg.zoo`` package should be imported by the planner; it imports this
module lazily.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import nn

from .configs import (BertConfig, CandleUnoConfig, DLRMConfig, GPTConfig, InceptionV3Config, LlamaConfig, MLPConfig,
                      ResNeXtConfig, XDLConfig)


def _mlp(sizes: Sequence[int], in_features: int, final_relu: bool, bias: bool = True) -> nn.Sequential:
    """Linear layers of the given output sizes with ReLU between them (and after the
    last one when ``final_relu``)."""
    layers: List[nn.Module] = []
    prev = in_features
    for i, n in enumerate(sizes):
        layers.append(nn.Linear(prev, n, bias=bias))
        if final_relu or i + 1 < len(sizes):
            layers.append(nn.ReLU())
        prev = n
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- ResNeXt-50


class ResNeXtBottleneck(nn.Module):
    """1x1 reduce -> grouped 3x3 (stride here, "ResNet v1.5") -> 1x1 expand, + shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int, groups: int, width_per_group: int):
        super().__init__()
        width = int(planes * width_per_group / 64) * groups
        out_ch = planes * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride,
                                                      bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNeXt(nn.Module):
    """ResNeXt (Xie et al., CVPR'17); the paper config is ResNeXt-50 32x4d."""

    def __init__(self, cfg: ResNeXtConfig):
        super().__init__()
        c = cfg.stem_channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        stages = []
        in_ch = c
        for i, (blocks, planes) in enumerate(zip(cfg.layers, cfg.planes)):
            stage = []
            for b in range(blocks):
                stride = 2 if (i > 0 and b == 0) else 1
                stage.append(ResNeXtBottleneck(in_ch, planes, stride, cfg.groups,
                                               cfg.width_per_group))
                in_ch = planes * ResNeXtBottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, cfg.num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# ------------------------------------------------------------------------ Inception-v3


class ConvBN(nn.Module):
    """Conv (no bias) + BatchNorm(eps=1e-3) + ReLU, the unit of Inception-v3."""

    def __init__(self, in_ch: int, out_ch: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)
        self.relu = nn.ReLU()
        self.out_channels = out_ch

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def _avg3(x):
    # 3x3/1 average pool, zero padding counted (as in the reference implementation)
    return nn.functional.avg_pool2d(x, 3, stride=1, padding=1)


class InceptionA(nn.Module):
    """35x35 module: 1x1 | 1x1->5x5 | 1x1->3x3->3x3 | avgpool->1x1."""

    def __init__(self, in_ch: int, pool_ch: int, c):
        super().__init__()
        self.b1 = ConvBN(in_ch, c(64), 1)
        self.b5_1 = ConvBN(in_ch, c(48), 1)
        self.b5_2 = ConvBN(c(48), c(64), 5, padding=2)
        self.b3_1 = ConvBN(in_ch, c(64), 1)
        self.b3_2 = ConvBN(c(64), c(96), 3, padding=1)
        self.b3_3 = ConvBN(c(96), c(96), 3, padding=1)
        self.bp = ConvBN(in_ch, pool_ch, 1)
        self.out_channels = c(64) + c(64) + c(96) + pool_ch

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5_2(self.b5_1(x)),
                          self.b3_3(self.b3_2(self.b3_1(x))), self.bp(_avg3(x))], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 grid reduction: 3x3/2 | 1x1->3x3->3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, c):
        super().__init__()
        self.b3 = ConvBN(in_ch, c(384), 3, stride=2)
        self.bd_1 = ConvBN(in_ch, c(64), 1)
        self.bd_2 = ConvBN(c(64), c(96), 3, padding=1)
        self.bd_3 = ConvBN(c(96), c(96), 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c(384) + c(96) + in_ch

    def forward(self, x):
        return torch.cat([self.b3(x), self.bd_3(self.bd_2(self.bd_1(x))), self.pool(x)], 1)


class InceptionC(nn.Module):
    """17x17 module with factorized 7x7 convolutions (1x7 and 7x1)."""

    def __init__(self, in_ch: int, c7: int, c):
        super().__init__()
        self.b1 = ConvBN(in_ch, c(192), 1)
        self.b7_1 = ConvBN(in_ch, c7, 1)
        self.b7_2 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.b7_3 = ConvBN(c7, c(192), (7, 1), padding=(3, 0))
        self.bd_1 = ConvBN(in_ch, c7, 1)
        self.bd_2 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.bd_3 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.bd_4 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.bd_5 = ConvBN(c7, c(192), (1, 7), padding=(0, 3))
        self.bp = ConvBN(in_ch, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x):
        b7 = self.b7_3(self.b7_2(self.b7_1(x)))
        bd = self.bd_5(self.bd_4(self.bd_3(self.bd_2(self.bd_1(x)))))
        return torch.cat([self.b1(x), b7, bd, self.bp(_avg3(x))], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 grid reduction: 1x1->3x3/2 | 1x1->1x7->7x1->3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, c):
        super().__init__()
        self.b3_1 = ConvBN(in_ch, c(192), 1)
        self.b3_2 = ConvBN(c(192), c(320), 3, stride=2)
        self.b7_1 = ConvBN(in_ch, c(192), 1)
        self.b7_2 = ConvBN(c(192), c(192), (1, 7), padding=(0, 3))
        self.b7_3 = ConvBN(c(192), c(192), (7, 1), padding=(3, 0))
        self.b7_4 = ConvBN(c(192), c(192), 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c(320) + c(192) + in_ch

    def forward(self, x):
        b3 = self.b3_2(self.b3_1(x))
        b7 = self.b7_4(self.b7_3(self.b7_2(self.b7_1(x))))
        return torch.cat([b3, b7, self.pool(x)], 1)


class InceptionE(nn.Module):
    """8x8 module with expanded filter banks: asymmetric 1x3 / 3x1 branches side by side."""

    def __init__(self, in_ch: int, c):
        super().__init__()
        self.b1 = ConvBN(in_ch, c(320), 1)
        self.b3_1 = ConvBN(in_ch, c(384), 1)
        self.b3_2a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3_2b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bd_1 = ConvBN(in_ch, c(448), 1)
        self.bd_2 = ConvBN(c(448), c(384), 3, padding=1)
        self.bd_3a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.bd_3b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bp = ConvBN(in_ch, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x):
        b3 = self.b3_1(x)
        b3 = torch.cat([self.b3_2a(b3), self.b3_2b(b3)], 1)
        bd = self.bd_2(self.bd_1(x))
        bd = torch.cat([self.bd_3a(bd), self.bd_3b(bd)], 1)
        return torch.cat([self.b1(x), b3, bd, self.bp(_avg3(x))], 1)


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al., CVPR'16) without the auxiliary classifier.

    Dropout before the classifier is omitted (identity at inference)."""

    def __init__(self, cfg: InceptionV3Config):
        super().__init__()
        div = cfg.channel_div

        def c(n: int) -> int:
            return max(1, n // div)

        self.stem = nn.Sequential(
            ConvBN(3, c(32), 3, stride=2),
            ConvBN(c(32), c(32), 3),
            ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1),
            ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: List[nn.Module] = []
        ch = c(192)
        for pool_ch in (c(32), c(64), c(64)):          # Mixed_5b, 5c, 5d
            blocks.append(InceptionA(ch, pool_ch, c))
            ch = blocks[-1].out_channels
        blocks.append(InceptionB(ch, c))               # Mixed_6a
        ch = blocks[-1].out_channels
        for c7 in (c(128), c(160), c(160), c(192)):    # Mixed_6b .. 6e
            blocks.append(InceptionC(ch, c7, c))
            ch = blocks[-1].out_channels
        blocks.append(InceptionD(ch, c))               # Mixed_7a
        ch = blocks[-1].out_channels
        for _ in range(2):                             # Mixed_7b, 7c
            blocks.append(InceptionE(ch, c))
            ch = blocks[-1].out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, cfg.num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# --------------------------------------------------------------------------- BERT-Large


class BertSelfAttention(nn.Module):
    """Multi-head self-attention written out as Linear/Reshape/Transpose/MatMul/Softmax,
    followed by the output projection, residual and LayerNorm (post-LN, as in BERT)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        h = cfg.hidden
        self.seq, self.hidden, self.heads = cfg.seq, h, cfg.heads
        self.head_dim = h // cfg.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.out = nn.Linear(h, h)
        self.ln = nn.LayerNorm(h, eps=cfg.ln_eps)

    def _split_heads(self, t):  # [B, S, H] -> [B, heads, S, head_dim]
        return t.reshape(-1, self.seq, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        q = self._split_heads(self.query(x))
        k = self._split_heads(self.key(x)).transpose(2, 3)     # [B, heads, head_dim, S]
        v = self._split_heads(self.value(x))
        probs = torch.softmax(torch.matmul(q, k) * self.scale, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(-1, self.seq, self.hidden)
        return self.ln(x + self.out(ctx))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.intermediate = nn.Linear(cfg.hidden, cfg.ffn)
        self.act = nn.GELU()
        self.output = nn.Linear(cfg.ffn, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)

    def forward(self, x):
        x = self.attention(x)
        return self.ln(x + self.output(self.act(self.intermediate(x))))


class BertLarge(nn.Module):
    """BERT encoder (Devlin et al.) + pooler (Linear + Tanh on the first token).

    Input ``input_ids`` int64 [batch, seq]; output ``pooled_output`` [batch, hidden].
    Every token uses segment 0 and positions 0..seq-1 (constant buffers), and there is
    no attention mask."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.seq, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.emb_ln = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.register_buffer("position_ids", torch.arange(cfg.seq).reshape(1, cfg.seq),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, cfg.seq, dtype=torch.long),
                             persistent=False)
        self.layers = nn.Sequential(*[BertLayer(cfg) for _ in range(cfg.layers)])
        self.pooler = nn.Linear(cfg.hidden, cfg.hidden)
        self.pooler_act = nn.Tanh()

    def forward(self, input_ids):
        x = (self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids)
             + self.token_type_embeddings(self.token_type_ids))
        x = self.layers(self.emb_ln(x))
        return self.pooler_act(self.pooler(x[:, 0]))


# --------------------------------------------------------------------------------- DLRM


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019).

    Inputs: ``dense`` float32 [batch, dense_features]; with the dot interaction ``sparse`` int64
    [batch, tables] (one id per table); with the cat interaction one int64 input per table,
    ``sparse0`` .. (as FlexFlow's example), [batch] or, with ``bag > 1``, [batch, bag] (the ids are
    looked up and sum-pooled: an embedding bag).  Bottom MLP (ReLU after every layer).  Interaction:

    * ``dot`` (the Criteo configuration): stack the bottom output with the embeddings to
      [batch, F, d], Z = T @ T^T, keep the strictly-lower triangle of Z (a constant index Gather
      on the flattened matrix), concat with the bottom output;
    * ``cat`` (FlexFlow's DLRM example, the Unity evaluation): concat the bottom output with
      the pooled embeddings.

    Top MLP (ReLU between layers) and a final Sigmoid.  Output ``click_prob`` [batch, 1]."""

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        if cfg.interaction not in ("dot", "cat"):
            raise ValueError(f"unknown DLRM interaction {cfg.interaction!r}")
        self.cfg = cfg
        self.bottom = _mlp(cfg.bottom_mlp, cfg.dense_features, final_relu=True, bias=cfg.bias)
        self.tables = nn.ModuleList(nn.Embedding(n, cfg.emb_dim) for n in cfg.table_rows)
        if cfg.interaction == "dot":
            assert cfg.bottom_mlp[-1] == cfg.emb_dim
            f = cfg.num_interacting
            rows, cols = torch.tril_indices(f, f, offset=-1, device="cpu")
            self.register_buffer("tril_index", (rows * f + cols).to(torch.long), persistent=False)
            top_in = cfg.emb_dim + cfg.num_interactions
        else:
            top_in = cfg.bottom_mlp[-1] + len(cfg.table_rows) * cfg.emb_dim
        self.top = _mlp(cfg.top_mlp, top_in, final_relu=False, bias=cfg.bias)

    def forward(self, dense, *sparse):
        x = self.bottom(dense)
        feats = []
        for i, table in enumerate(self.tables):
            e = table(sparse[i] if self.cfg.interaction == "cat" else sparse[0][:, i])
            feats.append(e.sum(dim=1) if self.cfg.bag > 1 else e)
        if self.cfg.interaction == "cat":
            return torch.sigmoid(self.top(torch.cat([x] + feats, dim=1)))
        f, d = self.cfg.num_interacting, self.cfg.emb_dim
        t = torch.cat([x] + feats, dim=1).reshape(-1, f, d)
        z = torch.matmul(t, t.transpose(1, 2)).reshape(-1, f * f)
        z = torch.index_select(z, 1, self.tril_index)
        return torch.sigmoid(self.top(torch.cat([x, z], dim=1)))


# ---------------------------------------------------------------------------------- XDL


class XDL(nn.Module):
    """XDL-style sparse ads CTR model (Jiang et al., "XDL: an industrial deep learning
    framework for high-dimensional sparse data", DLP-KDD'19), the "embedding + deep MLP"
    network XDL is built for and the Unity/FlexFlow evaluation uses.

    Input ``sparse`` int64 [batch, num_features, bag]: every feature is multi-hot with a
    fixed bag of ids, looked up in its own table (nn.Embedding) and sum-pooled over the
    bag (ReduceSum); the pooled vectors are concatenated and fed to a deep MLP with ReLU
    and a final Sigmoid.  Output ``click_prob`` [batch, 1].

    Paper config (see configs.py): 16 features x bag 4, embedding dim 64 (the sparse
    feature size of the FlexFlow XDL example), 500k rows per table (8M rows, 512M
    embedding parameters, ~2 GB fp32 -- embedding-dominated like the production model,
    whose tables are far larger still), MLP 1024-512-256-1 on the 1024-wide concat."""

    def __init__(self, cfg: XDLConfig):
        super().__init__()
        self.cfg = cfg
        self.tables = nn.ModuleList(nn.Embedding(cfg.rows, cfg.emb_dim)
                                    for _ in range(cfg.num_features))
        self.mlp = _mlp(cfg.mlp, cfg.num_features * cfg.emb_dim, final_relu=False)

    def forward(self, sparse):
        pooled = [table(sparse[:, i]).sum(dim=1) for i, table in enumerate(self.tables)]
        return torch.sigmoid(self.mlp(torch.cat(pooled, dim=1)))


# ---------------------------------------------------------------------------- CANDLE-Uno


class CandleUno(nn.Module):
    """CANDLE Uno (ECP-CANDLE pilot 1, drug response prediction).

    Every feature input has its own tower of dense layers with ReLU (the drugs' towers are not
    shared); the doses pass through; [doses, towers...] are concatenated and followed by dense
    layers with ReLU and a 1-unit linear regression head (growth).  Inputs (float32), one drug:
    ``dose`` [batch, 1], ``cell_rnaseq`` [batch, 942], ``drug_descriptors`` [batch, 5270],
    ``drug_fingerprints`` [batch, 2048]; two drugs (FlexFlow's candle_uno, the Unity evaluation):
    ``dose1``, ``dose2``, ``cell_rnaseq``, ``drug1_descriptors``, ``drug1_fingerprints``,
    ``drug2_descriptors``, ``drug2_fingerprints``."""

    def __init__(self, cfg: CandleUnoConfig):
        super().__init__()
        self.cfg = cfg
        b = cfg.bias
        self.cell_tower = _mlp(cfg.tower, cfg.cell_features, final_relu=True, bias=b)
        if cfg.drugs == 1:
            self.descriptor_tower = _mlp(cfg.tower, cfg.drug_descriptor_features, final_relu=True, bias=b)
            self.fingerprint_tower = _mlp(cfg.tower, cfg.drug_fingerprint_features, final_relu=True, bias=b)
        else:
            self.descriptor_towers = nn.ModuleList(
                _mlp(cfg.tower, cfg.drug_descriptor_features, final_relu=True, bias=b) for _ in range(cfg.drugs))
            self.fingerprint_towers = nn.ModuleList(
                _mlp(cfg.tower, cfg.drug_fingerprint_features, final_relu=True, bias=b) for _ in range(cfg.drugs))
        width = cfg.drugs + (1 + 2 * cfg.drugs) * cfg.tower[-1]
        self.dense = _mlp(cfg.dense, width, final_relu=True, bias=b)
        self.head = nn.Linear(cfg.dense[-1], 1, bias=b)

    def forward(self, *inputs):
        n = self.cfg.drugs
        if n == 1:
            dose, cell, desc, fp = inputs
            parts = [dose, self.cell_tower(cell), self.descriptor_tower(desc), self.fingerprint_tower(fp)]
        else:
            doses, cell, rest = inputs[:n], inputs[n], inputs[n + 1:]
            parts = list(doses) + [self.cell_tower(cell)]
            for i in range(n):
                parts += [self.descriptor_towers[i](rest[2 * i]), self.fingerprint_towers[i](rest[2 * i + 1])]
        return self.head(self.dense(torch.cat(parts, dim=1)))


# ---------------------------------------------------------------------------------- MLP


class DeepMLP(nn.Module):
    """``layers`` square Linear layers (hidden x hidden, with bias), ReLU between them."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.net = _mlp([cfg.hidden] * cfg.layers, cfg.hidden, final_relu=False)

    def forward(self, x):
        return self.net(x)


# ------------------------------------------------------------------------------ factory

# --------------------------------------------------------------------------------- GPT


class GPTBlock(nn.Module):
    """A pre-LayerNorm GPT block: x + Attn(LN(x)), then x + MLP(LN(x)).  The attention is written
    out (Q/K/V Linears, heads split with ``unflatten(-1, (heads, -1))`` and merged with ``flatten``,
    an additive causal mask) so its ONNX graph holds no constant that depends on the width (only
    on the batch, the sequence and the heads): :func:`unity_pcg.zoo.export_structure` traces a
    narrow twin of it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.scale = 1.0 / math.sqrt(h // cfg.heads)
        self.ln1 = nn.LayerNorm(h, eps=cfg.ln_eps)
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.out = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=cfg.ln_eps)
        self.fc = nn.Linear(h, cfg.ffn_size)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.ffn_size, h)
        self.register_buffer("mask", torch.full((cfg.seq, cfg.seq), -1e4).triu(1), persistent=False)

    def _split(self, t):  # [B, S, H] -> [B, heads, S, head_dim]
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        y = self.ln1(x)
        q, k, v = self._split(self.query(y)), self._split(self.key(y)), self._split(self.value(y))
        probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale + self.mask, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).flatten(2)
        x = x + self.out(ctx)
        return x + self.proj(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-3-style language model (Alpa's GPT benchmark models): token embedding + learned position
    embedding (a [seq, hidden] parameter added whole), ``layers`` pre-LN blocks, final LayerNorm and
    an untied LM head (Linear without bias to the vocabulary; untied so that a pipeline may put the
    embedding and the head on different stages).  Input ``input_ids`` int64 [batch, seq]; output
    ``logits`` [batch, seq, vocab]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Parameter(torch.randn(cfg.seq, cfg.hidden) * 0.02)
        self.blocks = nn.Sequential(*[GPTBlock(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe
        return self.head(self.ln_f(self.blocks(x)))


# ------------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).  Attention: Q/K/V Linears without bias, rotary
    embedding of Q and K (the cos/sin tables are buffers), each of the ``kv_heads`` K/V heads repeated for its
    ``heads // kv_heads`` query heads, an additive causal mask."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, d
        self.scale = 1.0 / math.sqrt(d)
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.gate_proj = nn.Linear(h, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(h, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, h, bias=False)

    def _rotate(self, t, cos, sin):  # t: [B, n, S, d]; rotate_half as Llama: (-x2, x1)
        half = self.head_dim // 2
        rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rot * sin

    def _repeat_kv(self, t):  # [B, kv, S, d] -> [B, heads, S, d]
        rep = self.heads // self.kv_heads
        if rep == 1:
            return t
        b, kv, s, d = t.shape
        return t[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = self.q_proj(y).reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale + mask, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        x = x + self.o_proj(ctx)
        y = self.mlp_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    """Llama-style language model: token embedding, ``layers`` blocks, final RMSNorm, untied LM head (Linear
    without bias).  Input ``input_ids`` int64 [batch, seq]; output ``logits`` [batch, seq, vocab].  The rotary
    tables ([seq, head_dim]) and the causal mask ([seq, seq]) are non-persistent buffers."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d = cfg.head_dim
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.register_buffer("mask", torch.full((cfg.seq, cfg.seq), -1e4).triu(1), persistent=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin, self.mask)
        return self.head(self.norm(x))


_CLASSES = {
    "resnext50": ResNeXt,
    "inception_v3": InceptionV3,
    "bert_large": BertLarge,
    "dlrm": DLRM,
    "xdl": XDL,
    "candle_uno": CandleUno,
    "mlp": DeepMLP,
}

_IO_NAMES = {
    "resnext50": (["image"], ["logits"]),
    "inception_v3": (["image"], ["logits"]),
    "bert_large": (["input_ids"], ["pooled_output"]),
    "dlrm": (["dense", "sparse"], ["click_prob"]),
    "xdl": (["sparse"], ["click_prob"]),
    "candle_uno": (["dose", "cell_rnaseq", "drug_descriptors", "drug_fingerprints"],
                   ["growth"]),
    "mlp": (["x"], ["y"]),
}


def io_names(name: str, cfg) -> Tuple[List[str], List[str]]:
    """The graph input and output names of model ``name`` with configuration ``cfg``."""
    if isinstance(cfg, (GPTConfig, LlamaConfig)):
        return ["input_ids"], ["logits"]
    if name == "dlrm" and cfg.interaction == "cat":
        return ["dense"] + [f"sparse{i}" for i in range(len(cfg.table_rows))], ["click_prob"]
    if name == "candle_uno" and cfg.drugs > 1:
        n = cfg.drugs
        ins = [f"dose{i + 1}" for i in range(n)] + ["cell_rnaseq"]
        for i in range(n):
            ins += [f"drug{i + 1}_descriptors", f"drug{i + 1}_fingerprints"]
        return ins, ["growth"]
    i, o = _IO_NAMES[name]
    return list(i), list(o)


def make_module(name: str, cfg, device=None) -> nn.Module:
    """Instantiate the module for ``cfg`` (default init), on ``device`` if given
    (``"meta"`` builds it without allocating weights)."""
    cls = GPT if isinstance(cfg, GPTConfig) else Llama if isinstance(cfg, LlamaConfig) else _CLASSES[name]
    if device is None:
        return cls(cfg)
    with torch.device(device):
        return cls(cfg)


def _randomize_norms(model: nn.Module) -> None:
    """Give BatchNorm / LayerNorm layers non-trivial affine parameters (and BatchNorm
    non-trivial running statistics) so that they are not the identity at inference and
    the exporter does not deduplicate their all-ones / all-zeros initializers into
    Identity nodes.  Draws from the global RNG, like the default initializers."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.weight.copy_(0.5 + torch.rand(n))
                m.bias.copy_(0.1 * torch.randn(n))
                m.running_mean.copy_(0.1 * torch.randn(n))
                m.running_var.copy_(0.5 + torch.rand(n))
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape))
            elif isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape))


def example_inputs(name: str, cfg, batch: int, seed: int = 1234) -> Tuple[torch.Tensor, ...]:
    """Deterministic example inputs (independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    if name in ("resnext50", "inception_v3"):
        return (torch.randn(batch, 3, cfg.image, cfg.image, generator=g),)
    if name == "bert_large" or isinstance(cfg, (GPTConfig, LlamaConfig)):
        return (torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g),)
    if name == "dlrm":
        dense = torch.rand(batch, cfg.dense_features, generator=g)
        shape = (batch,) if cfg.bag == 1 else (batch, cfg.bag)
        ids = [torch.randint(0, n, shape, generator=g) for n in cfg.table_rows]
        if cfg.interaction == "cat":
            return (dense,) + tuple(ids)
        return dense, torch.stack(ids, dim=1)
    if name == "xdl":
        return (torch.randint(0, cfg.rows, (batch, cfg.num_features, cfg.bag), generator=g),)
    if name == "candle_uno":
        doses = tuple(torch.rand(batch, 1, generator=g) for _ in range(cfg.drugs))
        out = doses + (torch.randn(batch, cfg.cell_features, generator=g),)
        for _ in range(cfg.drugs):
            out += (torch.randn(batch, cfg.drug_descriptor_features, generator=g),
                    torch.rand(batch, cfg.drug_fingerprint_features, generator=g).round())
        return out
    if name == "mlp":
        return (torch.randn(batch, cfg.hidden, generator=g),)
    raise KeyError(name)


def build(name: str, cfg, batch: int):
    """Module (eval mode, weights from the global RNG), example inputs and I/O names."""
    model = make_module(name, cfg)
    _randomize_norms(model)
    model.eval()
    inputs = example_inputs(name, cfg, batch)
    in_names, out_names = io_names(name, cfg)
    return model, inputs, in_names, out_names
