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

from florist.kernels import rotary
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


def decode_attention_qk_norm_rope(q, k, v, q_weight, k_weight, eps: float, cos_sin_cache, k_cache, v_cache, slots, context_lens,
                                  scale: float) -> torch.Tensor:
    """Qwen3's decode step from the raw projections: QK-norm and rotary of this step's q [B, Hq,
    D] and k [B, Hkv, D] at position context_lens - 1, the rotated k and v written into the cache
    at that position of each slot, then decode attention, in one launch where
    `qk_norm_rope_applies` (else the rotary kernel, the store and attention apart, or the
    references on CPU). Same math, step for step, as `rotary.qk_norm_rope(..., kv_store=...)`
    followed by `decode_attention`."""
    if qk_norm_rope_applies(q, k, v, q_weight, k_weight, cos_sin_cache, k_cache, v_cache):
        return decode_attention_triton(q, k_cache, v_cache, slots, context_lens, scale, rope=(k, v, q_weight, k_weight, eps, cos_sin_cache))
    return decode_attention_qk_norm_rope_ref(q, k, v, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slots, context_lens, scale)


def decode_attention_qk_norm_rope_ref(q, k, v, q_weight, k_weight, eps: float, cos_sin_cache, k_cache, v_cache, slots, context_lens,
                                      scale: float) -> torch.Tensor:
    """The composition the one launch replaces: `rotary.qk_norm_rope` with its KV store at
    position context_lens - 1 of each slot, then `decode_attention`."""
    positions = context_lens.long() - 1
    rows = k_cache.shape[0] * k_cache.shape[1]
    flat = k_cache.shape[2:]
    kv_store = (v, k_cache.view(rows, *flat), v_cache.view(rows, *flat), slots * k_cache.shape[1] + positions)
    q, _ = rotary.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin_cache, kv_store=kv_store)
    return decode_attention(q, k_cache, v_cache, slots, context_lens, scale)


def qk_norm_rope_applies(q, k, v, q_weight, k_weight, cos_sin_cache, k_cache, v_cache) -> bool:
    """Host-side checks only (safe in CUDA graphs): the one-launch path takes 16-bit q/k/v like
    the cache, norm weights of that dtype, a power-of-two head_dim and an fp32 cos|sin cache."""
    d = k.shape[-1] if k.dim() == 3 else 0
    return (
        applies(q, k_cache, v_cache) and q.dtype in (torch.float16, torch.bfloat16) and d == q.shape[-1] and d >= 32 and d & (d - 1) == 0
        and k.shape == v.shape == (q.shape[0], k_cache.shape[2], d) and k.dtype == v.dtype == q.dtype and k.stride(-1) == v.stride(-1) == 1
        and q_weight.dtype == k_weight.dtype == q.dtype and q_weight.shape == k_weight.shape == (d,) and q_weight.stride(0) == k_weight.stride(0) == 1
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == d and cos_sin_cache.stride(1) == 1
        and all(t.device == q.device for t in (k, v, q_weight, k_weight, cos_sin_cache))
    )


def decode_attention_triton(q, k_cache, v_cache, slots, context_lens, scale: float, splits: int | None = None,
                            counters: torch.Tensor | None = None, min_split_keys: int = MIN_SPLIT_KEYS,
                            rope: tuple | None = None) -> torch.Tensor:
    """`rope`: (k, v, q_weight, k_weight, eps, cos_sin_cache) for `decode_attention_qk_norm_rope`
    (q and k then are this step's raw projections, not yet normed, rotated or stored)."""
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
    if rope is None:
        rope_args = (q, q, q, q, q, 0, 0, 0, 0, 0, 0.0)  # unused
    else:
        k_new, v_new, q_weight, k_weight, eps, cos_sin_cache = rope
        rope_args = (k_new, v_new, q_weight, k_weight, cos_sin_cache, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
                     cos_sin_cache.stride(0), eps)
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, slots, context_lens, out, part_acc, part_ml, counters,
        q.stride(0), q.stride(1), max_len, hkv, group, d, scale * _LOG2E, *rope_args,
        NUM_SPLITS=splits, MIN_SPLIT_KEYS=min_split_keys, BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, ROPE=rope is not None, num_warps=4,
    )
    return out


@_jit
def _rope_query_and_store_kv(q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, b, h, s, q_heads, g_ok,
                             length, per_split, base, row_stride, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                             stride_cs, eps, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fused path (`decode_attention_qk_norm_rope`): this step's token is at position
    length - 1 of its slot. Returns the group's queries [BLOCK_H, D], QK-normed and rotated as
    the rotary kernel makes them (`rotary.norm_rope_halves`), and, in the program whose slice
    holds that position, first writes the token's normed, rotated k and its v into the cache row
    the loop then reads (the barrier makes the stores visible to the program's own loads)."""
    HALF: tl.constexpr = BLOCK_D // 2
    dh = tl.arange(0, HALF)
    dh_ok = dh < HALF  # head_dim == BLOCK_D on this path (a power of two)
    pos = length - 1
    cs = cos_sin_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(cs + dh)
    sin = tl.load(cs + HALF + dh)
    src = q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + dh[None, :]
    q_mask = g_ok[:, None] & dh_ok[None, :]
    q1, q2 = rotary.norm_rope_halves(tl.load(src, mask=q_mask, other=0.0), tl.load(src + HALF, mask=q_mask, other=0.0),
                              q_w_ptr, k_ptr, dh, dh_ok, HALF, cos[None, :], sin[None, :], eps, True)
    q1 = tl.where(q_mask, q1, 0.0).to(k_ptr.dtype.element_ty)
    q2 = tl.where(q_mask, q2, 0.0).to(k_ptr.dtype.element_ty)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_H, BLOCK_D))  # [q1 | q2] along D
    if s == pos // per_split:
        cols = dh[None, :]  # this kv head's one row, as a [1, D/2] tile per half
        k_src = k_new_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + cols
        k1, k2 = rotary.norm_rope_halves(tl.load(k_src), tl.load(k_src + HALF), k_w_ptr, k_ptr, dh, dh_ok, HALF, cos[None, :], sin[None, :], eps, True)
        row = base + pos.to(tl.int64) * row_stride + cols
        tl.store(k_ptr + row, k1.to(k_ptr.dtype.element_ty))
        tl.store(k_ptr + row + HALF, k2.to(k_ptr.dtype.element_ty))
        v_src = v_new_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + cols
        tl.store(v_ptr + row, tl.load(v_src))
        tl.store(v_ptr + row + HALF, tl.load(v_src + HALF))
        tl.debug_barrier()
    return q


@_jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, counter_ptr,
                   stride_qb, stride_qh, max_len, num_kv_heads, group, head_dim, scale_log2,
                   k_new_ptr, v_new_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, stride_kb, stride_kh, stride_vb, stride_vh, stride_cs, eps,
                   NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr):
    decode_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, acc_ptr,
                   ml_ptr, counter_ptr, stride_qb, stride_qh, max_len, num_kv_heads, group, head_dim, scale_log2,
                   k_new_ptr, v_new_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, stride_kb, stride_kh, stride_vb, stride_vh, stride_cs, eps,
                   NUM_SPLITS, MIN_SPLIT_KEYS, BLOCK_N, BLOCK_H, BLOCK_D, IEEE, ROPE)


@_jit
def decode_program(b, h, s, q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, counter_ptr,
                   stride_qb, stride_qh, max_len, num_kv_heads, group, head_dim, scale_log2,
                   k_new_ptr, v_new_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, stride_kb, stride_kh, stride_vb, stride_vh, stride_cs, eps,
                   NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr):
    """One program's work, (sequence b, kv head h, context slice s): `_decode_kernel` runs it per
    program id, the fused decode layer (florist/kernels/decode_layer.py) per work item."""
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
        per_split = tl.cdiv(tl.cdiv(length, active), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, length)
        row_stride = num_kv_heads * head_dim  # one position of the cache: Hkv x D values
        base = tl.load(slots_ptr + b).to(tl.int64) * max_len * row_stride + h * head_dim
        if ROPE:
            q = _rope_query_and_store_kv(q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, b, h, s, q_heads, g_ok,
                                         length, per_split, base, row_stride, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                                         stride_vh, stride_cs, eps, BLOCK_H, BLOCK_D)
        else:
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
                        mask=g_ok[:, None] & d_ok[None, :], other=0.0)

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
