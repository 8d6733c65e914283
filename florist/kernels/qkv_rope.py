"""Qwen3's qkv product with QK-norm + rotary in its epilogue, one launch (Hopper: operands by TMA).

    x [T, H] @ w_qkv.T  ->  out [T, (Hq + 2 Hk) D] = | q heads | k heads | v heads |  (D = head_dim)

Program (h, m) owns the [BLOCK_M, D] tile of head h over tokens m * BLOCK_M..: its K loop is the
TMA skinny product's (`skinny_gemm.tma_gemm`), and before the tile is stored a q or k head is
normalised over D (QK-norm) and rotated at each token's position (`rotary.norm_rope_halves`,
the rotary kernel's own code); a v head is stored as is. q, k and v come back as views of `out`.
Two launches become one, and q and k are not read back and written again: in the batch-1 graph
the rotary kernel cost 2.5 us a layer at 128 tokens, 3.5 at 512. The epilogue, which nothing
overlaps after a short K loop, costs about as much at 64-128 rows, so `pick` takes 129-512 rows:
a 1 x 256 step 0.07-0.09 ms faster, 1 x 512 within the spread (docs/benchmarks.md, "QK-norm +
rotary in the qkv product's epilogue, again").

Rounding is the two launches': the product rounded to x's dtype (as the skinny product and cuBLAS
round it), then QK-norm and rotary on those values. The tile must hold a whole head (BLOCK_N =
D, a power of two up to 256, TMA's box limit), so there are (Hq + 2 Hk) x M / BLOCK_M programs:
128 for Qwen3-0.6B at 256 tokens.

FLORIST_QKV_ROPE=0 runs the product and the rotary kernel apart (for side-by-side measurements).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from florist.kernels import pdl, rotary, skinny_gemm, wide_gemm
from florist.kernels.activation import column_halves
from florist.kernels.skinny_gemm import GemmConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

ENABLED = os.environ.get("FLORIST_QKV_ROPE", "1") != "0"


def qkv_norm_rope_ref(x, weight, q_weight, k_weight, eps: float, positions, cos_sin_cache, num_q_heads: int, num_kv_heads: int):
    """The two launches as torch writes them: F.linear, then `rotary.qk_norm_rope_ref` -> (q, k, v)."""
    t, d = x.shape[0], cos_sin_cache.shape[1]
    q, k, v = F.linear(x, weight).split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = rotary.qk_norm_rope_ref(q.reshape(t, num_q_heads, d), k.reshape(t, num_kv_heads, d), q_weight, k_weight, eps, positions,
                                   cos_sin_cache)
    return q, k, v.reshape(t, num_kv_heads, d)


def pick(m: int, head_dim: int) -> GemmConfig | None:
    """The configuration for m rows, or None where the two launches are as fast.
    `python bench/gemm.py --qkv-rope --sweep` on the H200 (Qwen3-0.6B's heads, us per call in a
    CUDA graph, weights from HBM), the two launches against the sweep's best: 6.26 vs 7.29 at 64
    rows, 7.73 vs 7.47 at 128 (both left to the two launches), 9.09 vs 8.18 at 256, 11.28 vs
    10.42 at 512."""
    if head_dim != 128 or not 128 < m <= 512:
        return None
    if m <= 384:
        return GemmConfig(64, head_dim, 64, 1, 4, 5, tma=True)
    return GemmConfig(128, head_dim, 64, 1, 8, 5, tma=True)


def applies(x: torch.Tensor, weight: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
            cos_sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> bool:
    """Host-side checks only (safe in CUDA graphs): the TMA product runs (`skinny_gemm.tma_applies`:
    a Hopper-class device, TMA layouts), the weight holds the q, k and v heads, the QK-norm
    weights are [D] of x's dtype, positions [T] int32/int64, the cache fp32 [P, D]."""
    d = cos_sin_cache.shape[-1]
    return (
        ENABLED and skinny_gemm.tma_applies(x, weight) and weight.shape[0] == (num_q_heads + 2 * num_kv_heads) * d
        and d in (64, 128, 256) and all(w.dtype == x.dtype and w.shape == (d,) and w.stride(0) == 1 for w in (q_weight, k_weight))
        and positions.shape == (x.shape[0],) and positions.dtype in (torch.int32, torch.int64)
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
        and all(t.device == x.device for t in (q_weight, k_weight, positions, cos_sin_cache))
    )


def qkv_norm_rope(x, weight, q_weight, k_weight, eps: float, positions, cos_sin_cache, num_q_heads: int, num_kv_heads: int,
                  config: GemmConfig | None = None):
    """(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) in one launch where it applies and `pick` (or
    `config`) has a configuration; None elsewhere, and the caller runs the two launches."""
    if not applies(x, weight, q_weight, k_weight, positions, cos_sin_cache, num_q_heads, num_kv_heads):
        return None
    config = config or pick(x.shape[0], cos_sin_cache.shape[1])
    if config is None or x.shape[1] % config.block_k:
        return None
    return qkv_norm_rope_triton(x, weight, q_weight, k_weight, eps, positions, cos_sin_cache, num_q_heads, num_kv_heads, config)


def qkv_norm_rope_triton(x, weight, q_weight, k_weight, eps: float, positions, cos_sin_cache, num_q_heads: int, num_kv_heads: int,
                         config: GemmConfig):
    c = config
    m, k = x.shape
    d = cos_sin_cache.shape[1]
    n = weight.shape[0]
    assert n == (num_q_heads + 2 * num_kv_heads) * d and weight.shape[1] == k and weight.dtype == x.dtype, (
        f"weight {tuple(weight.shape)} {weight.dtype} must hold {num_q_heads} q, {num_kv_heads} k and {num_kv_heads} v heads of {d} for x {x.dtype}"
    )
    assert c.block_n == d and d in (64, 128, 256), f"a tile holds one head: block_n {c.block_n} must be head_dim {d} (64, 128 or 256)"
    assert c.split_k == 1, "a tile is a whole head's: K not split"
    skinny_gemm.check_tma(x, weight, c)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0:
        _qkv_rope_kernel[(num_q_heads + 2 * num_kv_heads, triton.cdiv(m, c.block_m))](
            wide_gemm.TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]), wide_gemm.TensorDescriptor.from_tensor(weight, [d, c.block_k]),
            out, positions, cos_sin_cache, q_weight, k_weight, m, n, k, cos_sin_cache.stride(0), eps, num_q_heads, num_kv_heads,
            BLOCK_M=c.block_m, HEAD_DIM=d, BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_args(x),
        )
    q, k_, v = out.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    return q.view(m, num_q_heads, d), k_.view(m, num_kv_heads, d), v.view(m, num_kv_heads, d)


@_jit
def _qkv_rope_kernel(x_desc, w_desc, out_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr, M, N, K, stride_cache, eps, num_q_heads, num_k_heads,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    head, pid_m = tl.program_id(0), tl.program_id(1)
    # Rows past M come in as zeros; their outputs are masked on store.
    acc = skinny_gemm.tma_k_slice(x_desc, w_desc, tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32), pid_m * BLOCK_M, head * HEAD_DIM,
                                  0, K, HEAD_DIM, BLOCK_K, False)
    pdl.pdl_trigger(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = out_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HALF)
    d_ok = d < HALF
    row_ok = rows < M
    mask = row_ok[:, None] & d_ok[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * N + head * HEAD_DIM + d[None, :]
    # The product rounded to x's dtype, as the unfused product stores it; then its two halves.
    x1, x2 = column_halves(acc.to(dtype), BLOCK_M, HALF)
    if head < num_q_heads + num_k_heads:
        if head < num_q_heads:
            w_ptr = q_w_ptr
        else:
            w_ptr = k_w_ptr
        cs = cache_ptr + tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)[:, None] * stride_cache + d[None, :]
        cos = tl.load(cs, mask=mask, other=0.0)
        sin = tl.load(cs + HALF, mask=mask, other=0.0)
        out1, out2 = rotary.norm_rope_halves(x1, x2, w_ptr, out_ptr, d, d_ok, HALF, cos, sin, eps, True)
        tl.store(dst, out1.to(dtype), mask=mask)
        tl.store(dst + HALF, out2.to(dtype), mask=mask)
    else:
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)
