"""Rotary position embedding (the "rotate half" / NeoX layout that Qwen3 uses)."""

from __future__ import annotations

import torch
from torch import nn



class RotaryEmbedding(nn.Module):
    """Holds a [max_positions, head_dim] cos|sin cache in fp32, indexed by per-token positions.

    The cache is a buffer, so it moves with the module; it is never part of the checkpoint.
    The rotation itself is fused with QK-norm (`florist.kernels.rotary.qk_norm_rope`).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()  # [P, head_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
