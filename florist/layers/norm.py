"""Normalisation layers. The math lives in `florist.kernels.norms` (Triton on CUDA, torch elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from florist.kernels import norms
from florist.kernels.split_k import SplitKPartials


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, in fp32; with `residual`, returns (norm(x + residual), x + residual).
    x may be a split-K product's unreduced partials (`RowParallelLinear.forward_deferred`): with a
    residual the norm kernel sums them, so the product needs no reduce kernel of its own."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None):
        if residual is None:
            return norms.rms_norm(x, self.weight, self.eps)
        return norms.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """Post-LayerNorm as BERT uses it: with `residual`, returns layer_norm(x + residual)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """layer_norm(x + residual + add); `add` is a [H] vector (a product's bias)."""
        return norms.add_layer_norm(x, residual, self.weight, self.bias, self.eps, add)
