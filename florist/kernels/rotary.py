"""Rotary embedding ("rotate half" / NeoX layout), alone or fused with Qwen3's QK-norm.

Each op has a torch reference (`*_ref`: the CPU path and the test oracle) and a Triton kernel
beside the one wrapper that launches it (`*_triton`). The public functions dispatch: Triton when
the inputs are on CUDA, triton imports and the dtype is fp16/bf16/fp32; the reference otherwise.

Layout. q [T, Hq, D] and k [T, Hk, D] may be strided views (e.g. slices of a fused qkv output);
only the head_dim must be contiguous. The cache row of position p holds cos | sin, fp32:

    cos_sin_cache[p] = | cos(p*f_0) .. cos(p*f_{D/2-1}) | sin(p*f_0) .. sin(p*f_{D/2-1}) |
    x = | x1 (D/2) | x2 (D/2) |  ->  | x1*cos - x2*sin | x2*cos + x1*sin |

One program handles every q and k head of one token, so the cache row is read once per token.
For generation, `qk_norm_rope(..., kv_store=...)` also writes the token's rotated k and its v
into the KV cache in the same launch (one kernel per layer less than a separate store).
NOTE: positions are not bounds-checked by the kernel (the reference raises on CPU); the engine
keeps them below max_position_embeddings, the cache length.
"""

from __future__ import annotations

import torch

from florist.kernels import pdl
from florist.kernels.kv_cache import store_kv
from florist.kernels.norms import rms_norm_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below are the whole implementation
    triton = None

# NOTE: without triton the kernels below are plain (never called) functions; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_TILE = 16384  # heads x head_dim/2 elements held in registers per program
# (v [T, Hk, D], k_cache_flat, v_cache_flat [R, Hk, D] contiguous, slot_mapping [T]): where
# qk_norm_rope also writes each token's rotated k and its v (generation's KV cache)
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# torch references (the CPU path and the test oracle)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_ref(q, k, q_weight, k_weight, eps, positions, cos_sin_cache):
    return apply_rotary_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache)


# ---------------------------------------------------------------------------------------------
# public ops


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T], cos_sin_cache: [P, D] (cos | sin halves)
    -> rotated (q, k), new contiguous tensors."""
    if _triton_applies(q, k, positions, cos_sin_cache):
        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, positions, cos_sin_cache, kv_store: KVStore | None = None):
    """Qwen3's QK-norm then rotary: rms_norm over head_dim of q and k (weights [D]) followed by
    apply_rotary, in one pass over q and k. With `kv_store`, the same launch also writes the
    rotated k and the given v into a KV cache (florist.kernels.kv_cache.store_kv's layout)."""
    if _triton_applies(q, k, positions, cos_sin_cache, q_weight, k_weight) and (kv_store is None or _kv_store_applies(k, kv_store)):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, kv_store)
    q_out, k_out = qk_norm_rope_ref(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
    if kv_store is not None:
        store_kv(k_out, *kv_store)
    return q_out, k_out


def _kv_store_applies(k: torch.Tensor, kv_store: KVStore) -> bool:
    v, k_cache, v_cache, slot_mapping = kv_store
    return (
        v.shape == k.shape and v.dtype == k.dtype and v.stride(2) == 1 and k_cache.dtype == k.dtype and v_cache.dtype == k.dtype
        and k_cache.shape[1:] == k.shape[1:] and v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
        and slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64)
        and all(t.device == k.device for t in (v, k_cache, v_cache, slot_mapping))
    )


def _triton_applies(q, k, positions, cache, q_weight=None, k_weight=None) -> bool:
    """Host-side checks only (shapes, strides, dtypes): no device sync, so safe in CUDA graphs."""
    if triton is None or not q.is_cuda or q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        return False
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        return False
    if q.stride(2) != 1 or k.stride(2) != 1 or positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        return False
    if any(t.device != q.device for t in (k, positions, cache, q_weight, k_weight) if t is not None):
        return False
    if positions.dtype not in (torch.int32, torch.int64) or cache.dtype != torch.float32:
        return False
    if cache.dim() != 2 or cache.shape[1] != q.shape[2] or cache.stride(1) != 1:
        return False
    if q_weight is not None and not all(
        w.dtype == q_weight.dtype and w.dtype in _FLOAT_DTYPES and w.shape == (q.shape[2],) and w.stride(0) == 1
        for w in (q_weight, k_weight)
    ):
        return False
    block_half = triton.next_power_of_2(q.shape[2] // 2)
    return triton.next_power_of_2(max(q.shape[1], k.shape[1])) * block_half <= _MAX_TILE


# ---------------------------------------------------------------------------------------------
# Triton launchers (also called directly by the tests, under the interpreter on CPU)


def apply_rotary_triton(q, k, positions, cos_sin_cache):
    return _launch(q, k, None, None, 0.0, positions, cos_sin_cache)


def qk_norm_rope_triton(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, kv_store: KVStore | None = None):
    return _launch(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, kv_store)


def _launch(q, k, q_weight, k_weight, eps, positions, cache, kv_store=None):
    assert q.dim() == 3 and k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], (
        f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, head_dim] with the same T and head_dim"
    )
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1, f"head_dim must be even and contiguous; strides {q.stride()}, {k.stride()}"
    assert q.dtype == k.dtype and q.dtype in _FLOAT_DTYPES, f"unsupported dtypes {q.dtype}, {k.dtype}"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), f"positions {tuple(positions.shape)} {positions.dtype}"
    assert cache.dtype == torch.float32 and cache.dim() == 2 and cache.shape[1] == head_dim and cache.stride(1) == 1, (
        f"cos_sin_cache must be fp32 [P, {head_dim}]; got {cache.dtype} {tuple(cache.shape)}"
    )
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not q.is_cuda or q.device.index == torch.cuda.current_device(), (
        f"tensors are on {q.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({q.device}) first"
    )
    norm = q_weight is not None
    out_dtype = q.dtype
    if norm:
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.dtype == k_weight.dtype and q_weight.stride(0) == k_weight.stride(0) == 1, (
            f"QK-norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} must both be [{head_dim}] of one dtype"
        )
        # The reference's rms_norm returns promote(x, weight) (`weight * x`), and rotary keeps that dtype.
        out_dtype = torch.promote_types(q.dtype, q_weight.dtype)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(head_dim // 2)
    block_q, block_k = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    num_warps = min(8, max(1, block_q * block_half // 256))
    if kv_store is not None:
        v, k_cache, v_cache, slot_mapping = kv_store
        assert out_dtype == k.dtype and _kv_store_applies(k, kv_store), (
            f"the KV cache store needs v like k {tuple(k.shape)} {k.dtype} (got {tuple(v.shape)} {v.dtype}), contiguous caches "
            f"[rows, {num_k_heads}, {head_dim}] of that dtype (got {tuple(k_cache.shape)} {k_cache.dtype}) and one slot per token"
        )
        v_strides = (v.stride(0), v.stride(1))
    else:
        v = k_cache = v_cache = slot_mapping = k_out  # unused
        v_strides = (0, 0)
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cache, q_weight if norm else cache, k_weight if norm else cache,
        v, k_cache, v_cache, slot_mapping,
        num_q_heads, num_k_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides, cache.stride(0), head_dim // 2, eps,
        NORM=norm, STORE_KV=kv_store is not None, BLOCK_Q_HEADS=block_q, BLOCK_K_HEADS=block_k, BLOCK_HALF=block_half,
        num_warps=num_warps, **pdl.launch_args(q),
    )
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# Triton kernels


@_jit
def _rope_heads(x_ptr, out_ptr, w_ptr, token, num_heads, stride_t, stride_h, cos, sin, half_dim, eps,
                NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(QK-norm and) rotary of all heads of one token: a [BLOCK_HEADS, BLOCK_HALF] tile per half,
    stored to out (contiguous [T, heads, D]); returns the two halves (fp32) and their mask."""
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < half_dim
    mask = (heads < num_heads)[:, None] & d_ok[None, :]
    src = x_ptr + token.to(tl.int64) * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half_dim, mask=mask, other=0.0)
    out1, out2 = norm_rope_halves(x1, x2, w_ptr, out_ptr, d, d_ok, half_dim, cos[None, :], sin[None, :], eps, NORM)
    _store_halves(out_ptr + token.to(tl.int64) * num_heads * (2 * half_dim), heads, d, half_dim, out1, out2, mask)
    return out1, out2, mask


@_jit
def norm_rope_halves(x1, x2, w_ptr, out_ptr, d, d_ok, half_dim, cos, sin, eps, NORM: tl.constexpr):
    """(QK-norm and) rotary of [rows, D/2] tiles x1, x2 (the two halves of each head, as loaded:
    x's dtype; a row is a head of one token) -> the rotated halves in fp32, each value already
    rounded as out_ptr's dtype stores it. cos and sin broadcast against the tiles: [1, D/2] for
    rows of one token, [rows, D/2] for rows of different tokens. Decode attention
    (decode_attention.py) and the qkv product's epilogue (qkv_rope.py) run this same code."""
    if NORM:
        # Same rounding steps as rms_norm_ref: normalised value to x's dtype, times the weight,
        # rounded to the output dtype; the rotation then runs in fp32 on those rounded values.
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * half_dim) + eps)
        w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half_dim + d, mask=d_ok, other=0.0).to(tl.float32)
        f1 = (f1 * rstd[:, None]).to(x1.dtype).to(tl.float32) * w1[None, :]
        f2 = (f2 * rstd[:, None]).to(x2.dtype).to(tl.float32) * w2[None, :]
        f1 = f1.to(out_ptr.dtype.element_ty).to(tl.float32)
        f2 = f2.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = f1 * cos - f2 * sin
    out2 = f2 * cos + f1 * sin
    return out1, out2


@_jit
def _store_halves(row_ptr, heads, d, half_dim, out1, out2, mask):
    """Stores [heads, D] at row_ptr (heads contiguous, D = 2 * half_dim) in row_ptr's dtype."""
    dst = row_ptr + heads[:, None] * (2 * half_dim) + d[None, :]
    tl.store(dst, out1.to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half_dim, out2.to(row_ptr.dtype.element_ty), mask=mask)


@_jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr,
                 v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache, half_dim, eps,
                 NORM: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    token = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < half_dim
    row = cache_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cache
    cos = tl.load(row + d, mask=d_ok, other=0.0)
    sin = tl.load(row + half_dim + d, mask=d_ok, other=0.0)
    _rope_heads(q_ptr, q_out_ptr, q_w_ptr, token, num_q_heads, stride_qt, stride_qh, cos, sin, half_dim, eps,
                NORM, BLOCK_Q_HEADS, BLOCK_HALF)
    k1, k2, k_mask = _rope_heads(k_ptr, k_out_ptr, k_w_ptr, token, num_k_heads, stride_kt, stride_kh, cos, sin, half_dim, eps,
                                 NORM, BLOCK_K_HEADS, BLOCK_HALF)
    if STORE_KV:  # this token's rotated k and its v into cache row slot_mapping[token]
        heads = tl.arange(0, BLOCK_K_HEADS)
        cache_row = tl.load(slot_ptr + token).to(tl.int64) * num_k_heads * (2 * half_dim)
        _store_halves(k_cache_ptr + cache_row, heads, d, half_dim, k1, k2, k_mask)
        src = v_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + d[None, :]
        v1 = tl.load(src, mask=k_mask, other=0.0)
        v2 = tl.load(src + half_dim, mask=k_mask, other=0.0)
        _store_halves(v_cache_ptr + cache_row, heads, d, half_dim, v1, v2, k_mask)
