"""RMSNorm (+ residual add) and LayerNorm (+ residual add): torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
