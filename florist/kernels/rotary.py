"""Rotary embedding ("rotate half" layout): torch reference."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T], cos_sin_cache: [P, D] (cos | sin halves)."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
