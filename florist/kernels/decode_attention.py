"""Decode attention over the slot KV cache in one launch: one query token per sequence.

    q                [B, Hq, D]        (any token/head stride; D contiguous)
    k_cache, v_cache [S, L, Hkv, D]    contiguous slot cache (florist.layers.cached_attention)
    slots            int64 [B]         each sequence's slot
    context_lens     int32 [B]         keys to attend to (this step's token included)
    out              [B, Hq, D]

A program owns one (sequence, kv head, split): the `group = Hq / Hkv` query heads that share the
kv head (grouped-query attention reads each key once), as the rows of a tensor-core product
padded to 16, over one slice of the context. The context
is cut into slices *at run time* from the sequence's own length, so nothing depends on host
values that vary between steps (the launch is captured in decode CUDA graphs):

    active = min(NUM_SPLITS, ceil(len / MIN_SPLIT_KEYS))           programs s >= active return
    slice  = ceil(ceil(len / active) / BLOCK_N) * BLOCK_N           program s: [s*slice, (s+1)*slice)

A short context (active = 1) is one program per kv head that writes the output itself. Otherwise
each program keeps an online softmax (running max m, sum l, accumulator acc, fp32, base 2) and
stores (m, l, acc) for its slice, and the last of a (sequence, kv head)'s programs to finish (an
atomic counter, which that program resets to 0 for the next launch) merges the slices in order
0..NUM_SPLITS-1 and writes the output: no second "combine" kernel, and the merge order is fixed,
so results do not depend on which program finished last.

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,    M = max_s m_s

The torch reference (`decode_attention_ref`) gathers each sequence's keys and masks by length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from florist.kernels.launch_counters import LaunchCounters
from florist.kernels.online_softmax import online_softmax_step

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_MAX_PROGRAMS_FOR_SPLITS = 256  # split until B * Hkv * NUM_SPLITS reaches about this (~2 per SM)
_MAX_SPLITS = 16
# Keys per context slice at least: below 2 x this a sequence runs unsplit (one program per kv
# head, no merge), which is what short contexts want; long ones still spread over NUM_SPLITS.
MIN_SPLIT_KEYS = 128


def decode_attention_ref(q, k_cache, v_cache, slots, context_lens, scale: float) -> torch.Tensor:
    """SDPA over each sequence's gathered cache rows under a length mask (fp32 softmax inside)."""
    n = k_cache.shape[1]
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    mask = torch.arange(n, device=q.device) < context_lens.unsqueeze(1)  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k_cache.shape[2]
    )
    return out.squeeze(2)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Host-side checks only (safe in CUDA graphs)."""
    return (
        triton is not None and q.is_cuda and q.dtype in _FLOAT_DTYPES and q.dim() == 3 and q.stride(-1) == 1
        and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape and k_cache.shape[-1] == q.shape[-1] and q.shape[1] % k_cache.shape[2] == 0
    )


def num_splits(batch_rows: int, num_kv_heads: int) -> int:
    """Enough context slices that the launch has ~_MAX_PROGRAMS_FOR_SPLITS programs (a power of two)."""
    want = max(1, _MAX_PROGRAMS_FOR_SPLITS // max(1, batch_rows * num_kv_heads))
    return min(_MAX_SPLITS, 1 << (want.bit_length() - 1))


# One counter per (sequence, kv head); the KV cache bounds the rows of every launch.
_counters = LaunchCounters("decode attention", minimum=1024)


def decode_attention(q, k_cache, v_cache, slots, context_lens, scale: float, splits: int | None = None) -> torch.Tensor:
    if applies(q, k_cache, v_cache):
        return decode_attention_triton(q, k_cache, v_cache, slots, context_lens, scale, splits)
    return decode_attention_ref(q, k_cache, v_cache, slots, context_lens, scale)


def decode_attention_triton(q, k_cache, v_cache, slots, context_lens, scale: float, splits: int | None = None,
                            counters: torch.Tensor | None = None, min_split_keys: int = MIN_SPLIT_KEYS) -> torch.Tensor:
    b, hq, d = q.shape
    _, max_len, hkv, _ = k_cache.shape
    assert slots.shape == (b,) and context_lens.shape == (b,), f"slots {tuple(slots.shape)} / context_lens {tuple(context_lens.shape)} must be [{b}]"
    assert not q.is_cuda or q.device.index == torch.cuda.current_device(), (
        f"tensors are on {q.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({q.device}) first"
    )
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = hq // hkv
    splits = splits or num_splits(b, hkv)
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(group))  # tensor-core products need >= 16 rows
    block_n = 64 if block_d <= 128 else 32
    if splits > 1:
        part_acc = torch.empty((b, hkv, splits, block_h, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b, hkv, splits, 2, block_h), dtype=torch.float32, device=q.device)
        counters = counters if counters is not None else _counters.get(q.device, b * hkv)
    else:  # never touched (no slice merges), but typed as the kernel's merge branch expects
        part_acc = part_ml = torch.empty(1, dtype=torch.float32, device=q.device)
        counters = torch.empty(1, dtype=torch.int32, device=q.device)
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, slots, context_lens, out, part_acc, part_ml, counters,
        q.stride(0), q.stride(1), max_len, hkv, group, d, scale * _LOG2E,
        NUM_SPLITS=splits, MIN_SPLIT_KEYS=min_split_keys, BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out


@_jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, counter_ptr,
                   stride_qb, stride_qh, max_len, num_kv_heads, group, head_dim, scale_log2,
                   NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens_ptr + b)
    # Slices in use for this sequence: each takes >= MIN_SPLIT_KEYS keys, so a short context
    # runs as one program per kv head with no merge; the other programs return at once.
    active = tl.minimum(tl.cdiv(length, MIN_SPLIT_KEYS), NUM_SPLITS)
    if s < active:
        # The group's query heads are the rows of a [BLOCK_H, D] tile (padded to the 16 rows a
        # tensor-core product needs, padding rows zero and never stored).
        g = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        g_ok, d_ok = g < group, d < head_dim
        q_heads = h * group + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)

        per_split = tl.cdiv(tl.cdiv(length, active), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, length)
        row_stride = num_kv_heads * head_dim  # one position of the cache: Hkv x D values
        base = tl.load(slots_ptr + b).to(tl.int64) * max_len * row_stride + h * head_dim

        m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        # A run-time trip count (this slice's keys only) in a `for` loop, which Triton pipelines.
        # NOTE: Triton 3.6's interpreter cannot take a trip count loaded from memory (3.9's can).
        for block in range(0, tl.cdiv(end - start, BLOCK_N)):
            pos = start + block * BLOCK_N + n
            pos_ok = pos < end
            offs = base + pos.to(tl.int64)[:, None] * row_stride + d[None, :]
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
            if IEEE:  # fp32 inputs: exact fp32 products, not TF32
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            # scores in base 2: exp(x) = exp2(x * log2(e))
            scores = tl.where(pos_ok[None, :], scores * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
            # m starts at -inf (the merge reads each slice's true max), not at a floor: the step's
            # guard takes a row whose scores are all -inf so far against 0 (it then adds 0).
            m, l, acc = online_softmax_step(scores, v, m, l, acc, IEEE, GUARD_NEG_INF=True)

        out_offs = b.to(tl.int64) * num_kv_heads * group * head_dim + q_heads[:, None] * head_dim + d[None, :]
        out_mask = g_ok[:, None] & d_ok[None, :]
        if active == 1:
            tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            bh = b.to(tl.int64) * num_kv_heads + h
            tile = g[:, None] * BLOCK_D + d[None, :]
            rows_ok = g_ok[:, None] & (d < BLOCK_D)[None, :]  # the group's real rows only
            tl.store(acc_ptr + (bh * NUM_SPLITS + s) * BLOCK_H * BLOCK_D + tile, acc, mask=rows_ok)
            ml = ml_ptr + (bh * NUM_SPLITS + s) * 2 * BLOCK_H
            tl.store(ml + g, m, mask=g_ok)
            tl.store(ml + BLOCK_H + g, l, mask=g_ok)
            # Every thread's stores land before the counter moves (barrier, then a release at
            # GPU scope); the program that sees active - 1 acquires them all and merges.
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if done == active - 1:
                tl.store(counter_ptr + bh, 0)  # ready for the next launch
                # Slices 0..active-1 in this fixed order: the same bits whichever program merges.
                ml_bh = ml_ptr + bh * NUM_SPLITS * 2 * BLOCK_H
                m_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
                for i in range(0, active):  # finite for real rows: slice 0 holds the first key
                    m_max = tl.maximum(m_max, tl.load(ml_bh + i * 2 * BLOCK_H + g, mask=g_ok, other=0.0, cache_modifier=".cg"))
                total = tl.zeros((BLOCK_H,), dtype=tl.float32)
                merged = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
                for i in range(0, active):
                    w = tl.exp2(tl.load(ml_bh + i * 2 * BLOCK_H + g, mask=g_ok, other=0.0, cache_modifier=".cg") - m_max)
                    total += w * tl.load(ml_bh + i * 2 * BLOCK_H + BLOCK_H + g, mask=g_ok, other=0.0, cache_modifier=".cg")
                    part = tl.load(acc_ptr + (bh * NUM_SPLITS + i) * BLOCK_H * BLOCK_D + tile, mask=rows_ok, other=0.0, cache_modifier=".cg")
                    merged += part * w[:, None]
                tl.store(out_ptr + out_offs, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
