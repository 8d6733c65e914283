"""Activations, including the gated one the Qwen3 MLP uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from florist.kernels import activation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    return activation.silu_and_mul(x)


ACTIVATIONS = {
    "gelu": activation.gelu,  # BERT's "gelu" is the exact erf form (a Triton pass on CUDA)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
