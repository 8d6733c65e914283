"""Qwen3ForCausalLM for greedy generation: the Qwen3 backbone with KV-cached attention, a
vocabulary-parallel LM head (tied to the embedding or not) and greedy selection.

    tokens --Qwen3Model (CachedAttention)--> hidden [T, H] --rows that predict--> [B, H]
           --LogitsProcessor.get_top_tokens--> next ids int64 [B] (the same on every rank)
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from florist.config import ModelConfig
from florist.engine.generation.batch import GenerationBatch
from florist.layers.attention import AttentionFn
from florist.layers.cached_attention import CachedAttention, DecodeFn
from florist.layers.embedding import ParallelLMHead
from florist.layers.logits_processor import LogitsProcessor
from florist.models.base import WeightMap
from florist.models.qwen3 import Qwen3Model, qwen3_weight_map


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionFn, decode_backend: DecodeFn):
        super().__init__()
        self.model = Qwen3Model(cfg, backend, functools.partial(CachedAttention, decode_backend=decode_backend))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        # parameter name -> the parameter it is (filled when that one is loaded)
        self.tied: dict[str, str] = {}
        if cfg.tie_word_embeddings:
            # Same vocabulary shard layout, so the head reads the embedding's own parameter.
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tied["lm_head.weight"] = "model.embed_tokens.weight"
        self.logits_processor = LogitsProcessor(self.lm_head, cfg.vocab_size)
        self.weight_map = causal_lm_weight_map(cfg)

    def forward(self, batch: GenerationBatch) -> torch.Tensor:
        """-> greedy next token int64 [B]: after each prompt (prefill) or each token (decode)."""
        hidden = self.model(batch)
        if not batch.decode:
            hidden = hidden[batch.cu_seqlens[1:].long() - 1]  # each prompt's last token
        return self.logits_processor.get_top_tokens(hidden)


def causal_lm_weight_map(cfg: ModelConfig) -> WeightMap:
    """The embedder's map; the LM head is read from `lm_head.*`, or (tied) is the embedding and a
    stray `lm_head.weight` in the checkpoint is ignored."""
    base = qwen3_weight_map(cfg, reranker=False)  # ignores lm_head.*
    if cfg.tie_word_embeddings:
        return base
    return replace(base, renames={**base.renames, "lm_head.": ("lm_head.", None)}, ignore=())
