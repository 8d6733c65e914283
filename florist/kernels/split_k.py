"""A split-K product's fp32 partial sums, and their reduction (`_reduce_kernel`).

florist/kernels/skinny_gemm.py produces them; florist/kernels/norms.py's add + RMSNorm can sum them
itself while it loads its input (one launch fewer), rounding exactly where `_reduce_kernel` does.
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
    block = 1024
    _reduce_kernel[(triton.cdiv(m * n, block),)](
        partial, bias if bias is not None else out, out, m * n, n, partial.stride(0),
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )


@_jit
def _reduce_kernel(partial_ptr, b_ptr, out_ptr, numel, N, stride_split, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same inputs give the same bits
        acc += tl.load(partial_ptr + s * stride_split + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
