"""Pooling over a ragged batch, the sentence-transformers Dense module, and normalisation.

Pooled vectors of several modes are concatenated in sentence-transformers' order
(cls, max, mean, mean_sqrt_len, lasttoken), as its `Pooling` module does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from florist.config import DenseConfig, PoolingMode
from florist.engine.batch import RaggedBatch
from florist.kernels.pooling import segment_mean
from florist.layers.linear import ReplicatedLinear

POOLING_ORDER: tuple[PoolingMode, ...] = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")


def pool(hidden: torch.Tensor, batch: RaggedBatch, mode: PoolingMode) -> torch.Tensor:
    """hidden [T, H] -> [B, H] (fp32). Tokens whose seq_id is >= B (padding) are ignored."""
    b = batch.num_seqs
    if mode == "cls":  # empty trailing sequences of a padded batch start at T: clamp
        return hidden[batch.cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)].float()
    if mode == "lasttoken":
        return batch.last_rows(hidden).float()
    if mode in ("mean", "mean_sqrt_len"):  # one kernel on CUDA (kernels/pooling.py)
        return segment_mean(hidden, batch.seq_ids, batch.cu_seqlens, batch.max_seqlen, sqrt_len=mode == "mean_sqrt_len")
    if mode == "max":
        out = torch.full((b + 1, hidden.shape[1]), float("-inf"), dtype=torch.float32, device=hidden.device)
        idx = batch.seq_ids.long().unsqueeze(1).expand(-1, hidden.shape[1])
        return out.scatter_reduce_(0, idx, hidden.float(), reduce="amax", include_self=True)[:b]
    raise ValueError(f"unknown pooling mode {mode!r}")


_DENSE_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "sigmoid": torch.sigmoid, "gelu": F.gelu}


class Dense(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        if cfg.activation not in _DENSE_ACTIVATIONS:
            raise ValueError(f"Dense activation {cfg.activation!r} is not supported")
        self.linear = ReplicatedLinear(cfg.in_features, cfg.out_features, bias=cfg.bias)
        self.act = _DENSE_ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x.to(self.linear.weight.dtype)).float())


class EmbeddingHead(nn.Module):
    """hidden [T, H] -> embeddings [B, D] fp32: pool (modes concatenated), Dense..., normalise."""

    def __init__(self, modes: tuple[PoolingMode, ...], dense: tuple[DenseConfig, ...], normalize: bool):
        super().__init__()
        self.modes = tuple(m for m in POOLING_ORDER if m in modes)
        self.dense = nn.ModuleList(Dense(d) for d in dense)
        self.normalize = normalize

    def forward(self, hidden: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        pooled = [pool(hidden, batch, m) for m in self.modes]
        x = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)
        for layer in self.dense:
            x = layer(x)
        if self.normalize:
            x = F.normalize(x, p=2.0, dim=-1)
        return x
