"""Model families, registered by name and imported lazily.

A family module exposes `build(cfg, pipeline, backend, embedding_head) -> (backbone, head,
weight_map)`. Adding a family is one module and one line here.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from florist.config import ModelConfig, PipelineConfig
from florist.engine.batch import RaggedBatch
from florist.layers.attention import AttentionFn
from florist.layers.pooling import EmbeddingHead
from florist.models.base import WeightMap

FAMILIES: dict[str, str] = {"bert": "florist.models.bert", "qwen3": "florist.models.qwen3"}


class ModelBundle(nn.Module):
    """backbone (`model.*` parameters) + task head (`head.*`): batch -> [B, D] fp32 output."""

    def __init__(self, model: nn.Module, head: nn.Module, weight_map: WeightMap):
        super().__init__()
        self.model, self.head, self.weight_map = model, head, weight_map

    def forward(self, batch: RaggedBatch) -> torch.Tensor:
        hidden = self.model(batch)
        if getattr(self.model, "last_token_only", False):  # [B, H]: one row per sequence already
            batch = batch.one_token_per_seq()
        return self.head(hidden, batch)


def build_model(cfg: ModelConfig, pipeline: PipelineConfig, backend: AttentionFn) -> ModelBundle:
    family = importlib.import_module(FAMILIES[cfg.family])
    embedding_head = None
    if pipeline.task == "embed":
        # Normalisation is applied per request on the host (it may be switched off, or follow
        # matryoshka truncation), so the head stops before it.
        embedding_head = EmbeddingHead(pipeline.pooling, pipeline.dense, normalize=False)
    model, head, weight_map = family.build(cfg, pipeline, backend, embedding_head)
    return ModelBundle(model, head, weight_map)
