"""BERT encoders (all-MiniLM, bge, e5, gte-base) and BERT cross-encoders (ms-marco-MiniLM).

Post-LayerNorm transformer with absolute positions and exact-erf GELU; module names follow the
Hugging Face checkpoint so the weight map is identity except for the fused q|k|v projection.
"""

from __future__ import annotations

import torch
from torch import nn

from florist.config import ModelConfig
from florist.engine.batch import RaggedBatch
from florist.kernels.embeddings import embed_layer_norm
from florist.layers.activation import ACTIVATIONS
from florist.layers.attention import Attention, AttentionFn
from florist.layers.embedding import VocabParallelEmbedding
from florist.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from florist.layers.norm import LayerNorm
from florist.models.base import WeightMap


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        if self.word_embeddings.tp_size > 1:
            # The fused embedding kernel reads the whole word table; embedding models run on one device.
            raise ValueError("BERT models run on one device (tensor parallel size 1)")

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        # Gathers, sums and LayerNorm in one kernel on CUDA (kernels/embeddings.py).
        return embed_layer_norm(batch.input_ids, batch.positions, batch.token_type_ids, self.word_embeddings.weight,
                                self.position_embeddings.weight, self.token_type_embeddings.weight,
                                self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionFn):
        super().__init__()
        h = cfg.hidden_size
        self.qkv = QKVParallelLinear(h, cfg.head_dim, cfg.total_num_heads, cfg.total_num_kv_heads, bias=True)
        self.attn = Attention(self.qkv.num_heads, self.qkv.num_kv_heads, cfg.head_dim, causal=False, backend=backend)
        self.attn_out = RowParallelLinear(h, h, bias=True)
        self.attn_norm = LayerNorm(h, cfg.norm_eps)
        self.intermediate = ColumnParallelLinear(h, cfg.intermediate_size, bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fused_gelu = cfg.hidden_act == "gelu"
        self.output = RowParallelLinear(cfg.intermediate_size, h, bias=True)
        self.output_norm = LayerNorm(h, cfg.norm_eps)
        self.q_size = self.qkv.num_heads * cfg.head_dim

    def forward(self, x: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        q, k, v = self.qkv(x).split([self.q_size, self.q_size, self.q_size], dim=-1)
        x = _project_add_norm(self.attn_out, self.attn(q, k, v, batch), x, self.attn_norm)
        # BERT's "gelu" is the exact one: the intermediate projection can apply it in its epilogue.
        h = self.intermediate.forward_gelu(x) if self.fused_gelu else self.act(self.intermediate(x))
        return _project_add_norm(self.output, h, x, self.output_norm)


def _project_add_norm(proj: RowParallelLinear, h: torch.Tensor, residual: torch.Tensor, norm: LayerNorm) -> torch.Tensor:
    """norm(proj(h) + residual). For many rows the product accumulates onto the residual in place
    and its bias joins in the norm, which then reads one tensor, not two (the residual is the
    layer's input or its attention norm's output, read by nothing after this)."""
    summed = proj.forward_onto(h, residual)
    if summed is not None:
        return norm(summed, add=proj.bias)
    return norm(proj(h), residual=residual)


class BertModel(nn.Module):
    """Embeddings + encoder -> hidden states [T, H]."""

    def __init__(self, cfg: ModelConfig, backend: AttentionFn):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg, backend) for _ in range(cfg.num_layers))

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        x = self.embeddings(batch)
        for layer in self.layers:
            x = layer(x, batch)
        return x


class BertClassifierHead(nn.Module):
    """BertForSequenceClassification's head: tanh(pooler(CLS)) -> classifier logits [B, labels]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pooler = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.classifier = ReplicatedLinear(cfg.hidden_size, cfg.num_labels, bias=True)

    def forward(self, hidden: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        # Empty trailing sequences of a padded batch start at T: clamp keeps the index valid.
        cls = hidden[batch.cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)]
        return self.classifier(torch.tanh(self.pooler(cls))).float()


def bert_weight_map(with_classifier: bool) -> WeightMap:
    """Checkpoint name (after the `bert.` prefix is stripped) -> parameter name and shard."""
    layer = "encoder.layer.{i}."
    renames = {
        layer + "attention.self.query.": ("layers.{i}.qkv.", "q"),
        layer + "attention.self.key.": ("layers.{i}.qkv.", "k"),
        layer + "attention.self.value.": ("layers.{i}.qkv.", "v"),
        layer + "attention.output.dense.": ("layers.{i}.attn_out.", None),
        layer + "attention.output.LayerNorm.": ("layers.{i}.attn_norm.", None),
        layer + "intermediate.dense.": ("layers.{i}.intermediate.", None),
        layer + "output.dense.": ("layers.{i}.output.", None),
        layer + "output.LayerNorm.": ("layers.{i}.output_norm.", None),
        "embeddings.": ("model.embeddings.", None),
    }
    renames = {k: (("model." + v) if v.startswith("layers") else v, s) for k, (v, s) in renames.items()}
    ignore = ["embeddings.position_ids", "cls."]
    if with_classifier:
        renames.update({"pooler.dense.": ("head.pooler.", None), "classifier.": ("head.classifier.", None)})
    else:
        ignore.append("pooler.")
    return WeightMap(strip_prefixes=("bert.",), renames=renames, ignore=tuple(ignore), suffix_renames={".gamma": ".weight", ".beta": ".bias"})


def build(cfg: ModelConfig, pipeline, backend: AttentionFn, head_for_embedding: nn.Module | None):
    """-> (backbone, head, weight map) for the pipeline's task."""
    if pipeline.task == "score":
        if cfg.num_labels < 1:
            raise ValueError("a BERT scorer needs BertForSequenceClassification weights (num_labels >= 1)")
        return BertModel(cfg, backend), BertClassifierHead(cfg), bert_weight_map(with_classifier=True)
    return BertModel(cfg, backend), head_for_embedding, bert_weight_map(with_classifier=False)
