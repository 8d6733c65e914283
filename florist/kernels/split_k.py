"""A split-K product's fp32 partial sums, and their reduction (`_reduce_kernel`).

florist/kernels/skinny_gemm.py produces them; florist/kernels/norms.py's add + RMSNorm can sum them
itself while it loads its input (one launch fewer), rounding exactly where `_reduce_kernel` does:
both sum a tile with `reduce_partial_rows`, defined here (norms imports this module, not the
other way round).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

# NOTE: without triton the kernel below is a plain (never called) function; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)


class SplitKPartials(NamedTuple):
    """A split-K product not yet reduced: y = (sum over s of partials[s], in order s = 0..S-1, in
    fp32) + bias, cast to `dtype`. Returned by `skinny_gemm(..., defer_reduce=True)` (through
    `RowParallelLinear.forward_deferred`) and consumed by `norms.add_rms_norm`, whose kernel does
    this sum while it loads x:

        o_proj / down_proj  --partials [S, M, N] fp32-->  add_rms_norm(x=partials, residual)
                            (one launch saved: no `_reduce_kernel`, no [M, N] round trip)

    Anything else that receives one calls `.reduce()` and gets the ordinary tensor, bit for bit.
    """

    partials: torch.Tensor  # fp32 [S, M, N], last dim contiguous
    bias: torch.Tensor | None  # [N], any float dtype, or None
    dtype: torch.dtype  # the product's (activation) dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.partials.device

    def reduce(self) -> torch.Tensor:
        """The product as a [M, N] tensor of `dtype`: `_reduce_kernel` on CUDA, torch elsewhere."""
        if triton is not None and self.partials.is_cuda:
            return reduce_partials_triton(self)
        return reduce_partials_ref(self)


def reduce_partials_ref(p: SplitKPartials) -> torch.Tensor:
    """`_reduce_kernel` in torch, rounding for rounding: fp32 sum from 0 in order s = 0..S-1,
    + bias in fp32, one cast."""
    acc = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    for part in p.partials:
        acc += part
    if p.bias is not None:
        acc += p.bias.float()
    return acc.to(p.dtype)


def reduce_partials_triton(p: SplitKPartials) -> torch.Tensor:
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    launch_reduce(p.partials, p.bias, out)
    return out


def launch_reduce(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    split_k, m, n = partial.shape
    assert partial.dtype == torch.float32 and partial.is_contiguous(), f"partials must be contiguous fp32, not {partial.dtype} strides {partial.stride()}"
    assert out.shape == (m, n) and out.is_contiguous(), f"out {tuple(out.shape)} must be a contiguous [{m}, {n}]"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), f"bias {tuple(bias.shape)} must be a contiguous [{n}]"
    if out.numel() == 0:
        return
    # Program (row, column block): up to 1024 columns of one row. Not a tile of several short
    # rows: compiled for sm_90, a [2, 512] tile (N = 384) staged the bias through shared memory.
    block_cols = min(1024, triton.next_power_of_2(n))
    _reduce_kernel[(m, triton.cdiv(n, block_cols))](
        partial, bias if bias is not None else out, out, n, partial.stride(0),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK_COLS=block_cols, num_warps=4,
    )


@_jit
def reduce_partial_rows(p_ptr, b_ptr, rows, cols, col_ok, mask, stride_pt, stride_split,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                        CACHE_MODIFIER: tl.constexpr):
    """A [BLOCK_ROWS, BLOCK_COLS] tile (rows x cols, masked by `mask`; bias loads by `col_ok`) of a
    split-K product from its fp32 partials [SPLIT_K, M, N] (row stride stride_pt, N contiguous), in
    fp32 and not yet rounded: (p[0] + ... + p[S-1]) from 0, in that order, then + bias in fp32.
    `_reduce_kernel` casts it to the product's dtype; norms' add + RMSNorm on partials (and
    skinny_gemm's fused product + norm) call this same code, so their bits cannot drift apart."""
    p_ptrs = p_ptr + rows.to(tl.int64)[:, None] * stride_pt + cols[None, :]
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same inputs give the same bits
        acc += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=CACHE_MODIFIER)
        p_ptrs += stride_split
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@_jit
def _reduce_kernel(partial_ptr, b_ptr, out_ptr, N, stride_split, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < N
    mask = col_ok[None, :]
    acc = reduce_partial_rows(partial_ptr, b_ptr, rows, cols, col_ok, mask, N, stride_split, SPLIT_K, HAS_BIAS, 1, BLOCK_COLS, "")
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
