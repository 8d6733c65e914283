"""Writing a step's keys and values into the KV cache: one launch for k and v of every token.

    k, v          [T, Hkv, D]   (any token stride; each token's Hkv * D values contiguous, e.g.
                                 slices of the fused qkv output)
    k_cache_flat  [R, Hkv, D]   contiguous (the flat view of the slot cache, R = slots * max_len)
    slot_mapping  [T] int64     row of the flat cache each token goes to

One program per token copies its k row and its v row. The reference is two `index_copy_` calls;
the kernel saves one launch per layer per decode step (a decode step is ~a dozen small kernels per
layer, so launches are a visible share of it).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROW = 16384  # Hkv * D values held in registers per program


def store_kv_ref(k, v, k_cache_flat, v_cache_flat, slot_mapping) -> None:
    k_cache_flat.index_copy_(0, slot_mapping, k)
    v_cache_flat.index_copy_(0, slot_mapping, v)


def store_kv(k, v, k_cache_flat, v_cache_flat, slot_mapping) -> None:
    if _triton_applies(k, v, k_cache_flat, v_cache_flat, slot_mapping):
        store_kv_triton(k, v, k_cache_flat, v_cache_flat, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache_flat, v_cache_flat, slot_mapping)


def _row_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _triton_applies(k, v, k_cache, v_cache, slots) -> bool:
    """Host-side checks only (no device sync): safe inside CUDA graph capture."""
    if triton is None or not k.is_cuda or k.dtype not in _FLOAT_DTYPES:
        return False
    if any(t.device != k.device for t in (v, k_cache, v_cache, slots)) or k.device.index != torch.cuda.current_device():
        return False
    if not (v.dtype == k_cache.dtype == v_cache.dtype == k.dtype) or slots.dtype != torch.int64 or slots.dim() != 1:
        return False
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or k_cache.shape != v_cache.shape or slots.shape[0] != k.shape[0]:
        return False
    if not (_row_contiguous(k) and _row_contiguous(v) and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    return k.shape[1] * k.shape[2] <= _MAX_ROW


def store_kv_triton(k, v, k_cache_flat, v_cache_flat, slot_mapping) -> None:
    num_tokens, heads, head_dim = k.shape
    row = heads * head_dim
    assert _row_contiguous(k) and _row_contiguous(v), f"each token's k/v must be contiguous; strides {k.stride()}, {v.stride()}"
    assert k_cache_flat.is_contiguous() and v_cache_flat.is_contiguous() and k_cache_flat.shape[1:] == (heads, head_dim), (
        f"caches must be contiguous [rows, {heads}, {head_dim}]; got {tuple(k_cache_flat.shape)}"
    )
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    assert k.dtype == v.dtype == k_cache_flat.dtype == v_cache_flat.dtype, f"dtypes {k.dtype}, {v.dtype}, cache {k_cache_flat.dtype}"
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(row)
    _store_kv_kernel[(num_tokens,)](k, v, k_cache_flat, v_cache_flat, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=block, num_warps=4 if block >= 1024 else 1)


@_jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_token_stride, v_token_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = tl.load(slot_ptr + t)  # int64: rows * ROW may pass 2^31
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * k_token_stride + offs, mask=mask)
    v = tl.load(v_ptr + src * v_token_stride + offs, mask=mask)
    tl.store(k_cache_ptr + row * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + row * ROW + offs, v, mask=mask)
