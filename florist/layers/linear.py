"""Linear layers named after how they shard over the tensor-parallel group.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies its rank's
shard of a checkpoint tensor into place, so the weight loader never needs to know the sharding.

    ColumnParallelLinear      W[out, in] split along out: rank r owns rows [r*out/tp, (r+1)*out/tp)
    MergedColumnParallelLinear several column-parallel outputs fused into one matmul (gate|up)
    QKVParallelLinear         q|k|v fused; each rank owns whole heads of each
    RowParallelLinear         W[out, in] split along in; outputs all-reduced, bias added once;
                              `forward_deferred` may hand back split-K partials for the next norm,
                              `forward_add_norm` runs that norm too (in the product's launch
                              for few rows)
"""

from __future__ import annotations

import os

import torch
from torch import nn

from florist.config import int_from_env
from florist.distributed import all_reduce, tp_rank, tp_size
from florist.kernels import skinny_gemm, wide_gemm
from florist.kernels.split_k import SplitKPartials
from florist.layers.norm import RMSNorm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """F.linear (then exact GELU with `gelu`), except on CUDA for few rows, where the skinny-M
    kernel streams the weight faster and applies the GELU in its epilogue
    (florist/kernels/skinny_gemm.py: which shapes, and the measurements behind them), and on
    Hopper for many rows of a short K (all-MiniLM-L6-v2's qkv and up projections), where the
    persistent wide kernel adds the bias and the GELU in its epilogue (florist/kernels/wide_gemm.py)."""
    y = wide_gemm.linear(x, weight, bias, gelu)  # many rows of a short K (BERT's products)
    if y is not None:
        return y
    return skinny_gemm.skinny_gemm(x, weight, bias, gelu=gelu)


def _divide(numerator: int, denominator: int, what: str = "a layer size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
                         "pick a tensor-parallel size that divides it")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank(), tp_size(), tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and loaded.dim() > self.tp_dim and self.tp_size > 1:
            size = param.shape[self.tp_dim]
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu(linear(x)) with the exact (erf) GELU; fused where the skinny-M kernel runs."""
        return linear(x, self.weight, self.bias, gelu=True)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit a parameter of shape {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, tp_size(), "output size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs `output_sizes` stacked in one weight; shard_id indexes them."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        # Each part is split on its own (rank r owns slice r of gate AND of up), so each part, not
        # just the sum, must divide evenly.
        for size in output_sizes:
            _divide(size, tp_size(), "fused output part")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        dst = param.data.narrow(0, offset, size)
        _copy_checked(dst, loaded.chunk(self.tp_size, 0)[self.tp_rank] if self.tp_size > 1 else loaded)


    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a [gate | up] layer: [T, I] (each rank's I / tp). One fused kernel
        on CUDA for few rows (skinny_gemm) and, on Hopper, for many (wide_gemm): the [T, 2I]
        projection is never written; else matmul + SwiGLU."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"SwiGLU needs two equal parts (gate, up); this layer has {self.output_sizes}")
        wide = wide_gemm.swiglu(x, self.weight) if self.bias is None else None  # many rows: SwiGLU in the product's epilogue
        if wide is not None:
            return wide
        return skinny_gemm.skinny_gemm(x, self.weight, self.bias, silu_mul=True)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp, "the number of attention heads")
        self.num_kv_heads = _divide(total_num_kv_heads, tp, "the number of key/value heads")
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        dst = param.data.narrow(0, offset, size)
        _copy_checked(dst, loaded.chunk(self.tp_size, 0)[self.tp_rank] if self.tp_size > 1 else loaded)


# `RowParallelLinear.forward_onto` from this many rows on (below it the skinny kernels, whose
# epilogues add the bias, run these products): BERT's LayerNorm, and (ONTO_RMS_MIN_ROWS, where
# cuBLAS runs the product) Qwen3's add + RMSNorm in `forward_add_norm`. Measured from 512 rows;
# cuBLAS takes Qwen3's o and down from 257 on Hopper (below, the TMA products leave split-K
# partials to the norm), where a bound of 257 moved the step by less than the spread
# (docs/benchmarks.md, "257-511 rows"), so 512 stays. FLORIST_RESIDUAL_ONTO=0 turns it off;
# FLORIST_RESIDUAL_ONTO_RMS_MIN_ROWS moves Qwen3's bound (for A/B runs).
ONTO_MIN_ROWS = 4096
ONTO_RMS_MIN_ROWS = int_from_env("FLORIST_RESIDUAL_ONTO_RMS_MIN_ROWS", 512)
ONTO_ENABLED = os.environ.get("FLORIST_RESIDUAL_ONTO", "1") != "0"


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, tp_size(), "input size"), output_size, bias, tp_dim=1)

    def forward_onto(self, x: torch.Tensor, residual: torch.Tensor, min_rows: int | None = None) -> torch.Tensor | None:
        """residual += x @ W^T in place, in the product's epilogue (cuBLAS with beta = 1), without
        the bias: the caller adds it in the norm that reads the sum (`add_layer_norm(add=bias)`),
        which then reads one tensor instead of the product and the residual. Returns the residual,
        or None where it does not apply (tensor-parallel size > 1, not CUDA, fewer than
        `min_rows` (default ONTO_MIN_ROWS) rows, shapes or dtypes that do not line up): then call
        `forward`. The residual is overwritten, so its caller must not need it afterwards."""
        min_rows = ONTO_MIN_ROWS if min_rows is None else min_rows
        if not (ONTO_ENABLED and self.tp_size == 1 and x.is_cuda and x.dim() == 2 and x.shape[0] >= min_rows
                and residual.shape == (x.shape[0], self.weight.shape[0]) and residual.dtype == x.dtype == self.weight.dtype
                and residual.is_contiguous()):
            return None
        return residual.addmm_(x, self.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added on one rank only, so the all-reduce adds it exactly once.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y

    def forward_deferred(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """`forward`, except that where the skinny-M kernel splits K its fp32 partials come back
        unreduced (`SplitKPartials`), for the add + RMSNorm that follows to sum
        (`norms.add_rms_norm`); any other reader calls `.reduce()` for the tensor.
        NOTE: at tensor-parallel size > 1 the all-reduce needs the finished product: `forward`."""
        if self.tp_size > 1:
            return self.forward(x)
        return skinny_gemm.skinny_gemm(x, self.weight, self.bias, defer_reduce=True)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(self(x), residual) -> (normed, self(x) + residual). At tensor-parallel size 1, for
        few rows on CUDA (`skinny_gemm.fused_norm_applies`) the split-K product, the residual add
        and the norm are one launch, with the same bits as `norm(self.forward_deferred(x),
        residual)`; from ONTO_RMS_MIN_ROWS rows, where cuBLAS runs a product without bias on CUDA,
        it lands on the residual in place (`forward_onto`: the sum rounded once; the returned sum is `residual` itself);
        elsewhere the product and the norm run apart."""
        if self.tp_size == 1:
            fused = skinny_gemm.skinny_gemm_add_rms_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps)
            if fused is not None:
                return fused
            if self.bias is None and skinny_gemm.leaves_to_cublas(x, self.weight, defer_reduce=True):
                # Where cuBLAS runs the product it writes the sum over the residual (which the
                # caller hands on as the new residual) and the norm reads it alone: two [T, H]
                # passes instead of four (read product and residual, write sum and normed).
                summed = self.forward_onto(x, residual, ONTO_RMS_MIN_ROWS)
                if summed is not None:
                    return norm(summed), summed
        return norm(self.forward_deferred(x), residual)
