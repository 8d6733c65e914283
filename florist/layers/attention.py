"""Attention over a flat ragged batch, behind a small registry of backends.

A backend is one function `(q, k, v, batch, causal, scale) -> out` with q: [T, Hq, D],
k/v: [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention) and out: [T, Hq, D]. Backends are
registered with `@register_backend(name)` and imported lazily, so an optional dependency loads
only when chosen. The choice is made once, when the model is built (`select_backend`).

Every backend must be capturable in a CUDA graph when the batch's host values (`max_seqlen`,
`seq_lens_host`) are fixed, i.e. it may size work from them but never read device values back.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from florist.config import int_from_env
from florist.engine.batch import RaggedBatch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RaggedBatch, bool, float], torch.Tensor]
_BACKENDS: dict[str, Callable[[], AttentionFn]] = {}


def register_backend(name: str):
    """Register a factory that returns the attention function (imports happen inside it)."""

    def wrap(factory: Callable[[], AttentionFn]):
        _BACKENDS[name] = factory
        return factory

    return wrap


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def select_backend(name: str | None, device: torch.device, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> AttentionFn:
    """None picks "auto" on CUDA and "sdpa" elsewhere. FlashAttention needs fp16/bf16 and
    head_dim % 8 == 0; other models take "sdpa" (not capturable in graphs: `capturable` says so)."""
    if name is None:
        flash_ok = head_dim % 8 == 0 and dtype in (torch.float16, torch.bfloat16)
        name = "auto" if device.type == "cuda" and flash_ok else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    return _BACKENDS[name]()


@register_backend("sdpa")
def _sdpa_backend() -> AttentionFn:
    """One SDPA call per sequence (host loop): the portable path, and fast for a single sequence."""

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        start = 0
        # NOTE: a padded batch (graph bucket) has no host lengths; reading cu_seqlens is free on
        # the CPU, and on CUDA this backend is never used inside graphs (see "auto").
        lens = batch.seq_lens_host or batch.cu_seqlens.diff().tolist()
        for n in lens:
            sl = slice(start, start + n)
            qs, ks, vs = (t[sl].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if groups > 1:
                ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
            out[sl] = o.squeeze(0).transpose(0, 1)
            start += n
        if start < q.shape[0]:
            out[start:] = 0  # tokens outside every sequence (padding) get a defined value
        return out

    attn.capturable = False  # reads sequence lengths on the host
    return attn


def _flash_varlen_gqa():
    """torch < 2.12's `varlen_attn` has no `enable_gqa`; the FlashAttention op under it takes
    fewer kv heads natively, so call it directly instead of copying k and v per query head."""
    op = torch.ops.aten._flash_attention_forward

    def run(q, k, v, cu, max_seqlen: int, causal: bool, scale: float) -> torch.Tensor:
        return op(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale)[0]

    return run


@register_backend("varlen")
def _varlen_backend() -> AttentionFn:
    """PyTorch's FlashAttention over cu_seqlens (CUDA only); one launch for the whole batch."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    native_gqa = "enable_gqa" in params
    flash_gqa = None if native_gqa else _flash_varlen_gqa()
    # NOTE: torch 2.11 spells causality `is_causal`; newer releases use `window_size=(-1, 0)`.
    causal_kw = ({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        cu = batch.cu_seqlens
        kwargs = dict(causal_kw) if causal else {}
        if q.shape[1] != k.shape[1]:
            if flash_gqa is not None:
                return flash_gqa(q, k, v, cu, batch.max_seqlen, causal, scale)
            kwargs["enable_gqa"] = True
        return varlen_attn(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale=scale, **kwargs)

    return attn


def _sdpa_batched(q, k, v, num_seqs: int, seqlen: int, causal: bool, scale: float) -> torch.Tensor:
    """`num_seqs` sequences of equal length as one dense SDPA call (cuDNN / flash pick it up):
    [T, H, D] -> [B, H, L, D] -> [T, H, D]. Grouped-query heads are not copied."""
    qs, ks, vs = (t.view(num_seqs, seqlen, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


@register_backend("triton")
def _triton_backend() -> AttentionFn:
    """florist/kernels/short_attention.py: one Triton launch for the whole ragged batch, no
    memset; meant for short sequences (it streams each sequence's keys through one program per
    BLOCK_M query rows). On the CPU it runs the kernel's torch reference."""
    from florist.kernels import short_attention as short

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        # NOTE: on CUDA the reference would read cu_seqlens back (not capturable): refuse instead.
        if q.is_cuda and not short.applies(q, k, v, batch.cu_seqlens):
            raise ValueError(f"attention backend 'triton' cannot run q {q.dtype} {tuple(q.shape)} (it needs triton, fp16/bf16/fp32, "
                             f"head_dim <= {short.MAX_HEAD_DIM} and a contiguous last dim); choose 'auto' or 'varlen'")
        return short.short_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, scale)

    return attn


@register_backend("flex")
def _flex_backend() -> AttentionFn:
    """FlexAttention with a document mask, one call for the whole batch (florist/layers/flex.py);
    compiled on CUDA, eager (slow, materialised scores) elsewhere. Not picked by "auto"."""
    from florist.layers.flex import FlexAttention

    return FlexAttention()


# Where the Triton kernel wins, from bench/attention.py on the H200 (CUDA graphs, docs/benchmarks.md):
# - a single sequence while the score work is small: Qwen3-0.6B (16 x 128 per token) up to 128
#   tokens (4.1 us against cuDNN's 7.3) and all-MiniLM-L6-v2 (12 x 32) up to 256 (3.9 against
#   6.8). Alone the kernel also wins at Qwen3's 256 and 512 tokens (6.8 / 10.9 us against 8.9 /
#   12.5) and MiniLM's 512 / 1,024 (5.8 / 13.0 against 9.1 / 13.9), but in the engine Qwen3's
#   1 x 512 step took 1.74-1.80 ms of device time with it against 1.69-1.72 with cuDNN (one
#   machine, alternating; docs/benchmarks.md; +0.06 ms again on an H100, 2026-12-07:
#   "A 512-row layer with every edge programmatic"; with its grid's slots last, FLORIST_SHORT_SEQ_LAST,
#   level with cuDNN: "The short kernel's slots last in its grid"), so the bound stays where it
#   was measured to pay;
# - ragged batches, graph buckets among them (a bucket's batch, dummy included, is never "equal
#   lengths"), of sequences up to 4,096 tokens (`bench/attention.py --buckets`): varlen took
#   1.34-1.89x the kernel's time for MiniLM (100 x 256: 82.4 against 54.6 us) and
#   1.13-1.89x for Qwen3 causal (100 x U(32..512): 434.4 against 230.0; 2 x 4096: 504.4 against
#   424.6), with the kernel's tiles for batches (`launch_config`). Bidirectional wide heads
#   (pplx-embed) gain less, 1.01-1.58x (buckets of 32-100 sequences of 128-256 tokens: 1.01-1.04x
#   since they take 32-key tiles); longer sequences were not measured, so they stay with varlen;
# - never equal-length batches run eagerly: one dense SDPA call (cuDNN) is faster there (Qwen3
#   causal 100 x 512: 0.30 against the kernel's 0.46 ms).
# FLORIST_SHORT_RAGGED_MAX_SEQLEN moves the ragged bound (0: ragged batches never take the kernel;
# for A/B runs of bench/engine.py).
SHORT_RAGGED_MAX_SEQLEN = int_from_env("FLORIST_SHORT_RAGGED_MAX_SEQLEN", 4096)
# One sequence: tokens x max_seqlen x (query heads x head_dim), halved for causal attention (the
# scores it computes); 2^26 takes Qwen3-0.6B's causal steps up to 256 tokens and MiniLM's
# bidirectional ones up to 418 (390 in a graph bucket, whose tokens are rounded up to 64).
# FLORIST_SHORT_SINGLE_MAX_WORK moves the bound (for A/B runs of bench/engine.py).
SHORT_SINGLE_MAX_WORK = int_from_env("FLORIST_SHORT_SINGLE_MAX_WORK", 1 << 26)
# Past that bound, one causal sequence of wide heads (head_dim > 64) may take the kernel with its
# grid's slots axis last (the real programs first, one an SM) up to this much work. Off (0) by
# default for now. FLORIST_SHORT_SEQ_LAST=1 with FLORIST_SHORT_SINGLE_MAX_WORK=2^28 - 1 makes the
# same launches at Qwen3-0.6B's 320-448-token buckets (2^28 is its 512, where the kernel only drew
# level with cuDNN); with those an H100 ran those steps ahead of cuDNN in 8 of 9 rounds, the rounds' median
# differences -0.10 / -0.02 / -0.06 ms at 320 / 384 / 448 tokens ("One causal sequence past 256
# tokens, the slots last", docs/benchmarks.md). This dispatch has not yet run its GPU tests.
# Narrow heads (MiniLM lost with the slots last) and bidirectional wide heads (not measured) keep
# SHORT_SINGLE_MAX_WORK alone. FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK sets the bound (2^28 - 1
# for the run above).
SHORT_SINGLE_SLOTS_LAST_MAX_WORK = int_from_env("FLORIST_SHORT_SINGLE_SLOTS_LAST_MAX_WORK", 0)
# The final layer of a last-token model (Attention.forward_last) runs the whole attention up to
# this many tokens in the batch and keeps each sequence's last row; above, the last queries alone.
# On the H200 (docs/benchmarks.md, "The last-token layer's small kernels") the Qwen3-0.6B 1 x 128
# step was 0.016 ms faster with it in 2 of 3 interleaved rounds, the 1 x 256 step 0.032 ms slower
# in 2 of 3, both within that host's spread: hence 128. FLORIST_LAST_TOKEN_FULL_ATTENTION_TOKENS
# moves the bound (0: never), for A/B runs of bench/engine.py.
LAST_TOKEN_FULL_ATTENTION_TOKENS = int_from_env("FLORIST_LAST_TOKEN_FULL_ATTENTION_TOKENS", 128)


def auto_choice(batch: RaggedBatch, num_tokens: int, causal: bool, short_kernel: bool, width: int, head_dim: int) -> str:
    """Which kernel "auto" runs, from host values only (one graph bucket always takes one path):
    "triton" | "triton_slots_last" | "sdpa_batched" | "sdpa_single" | "varlen". `short_kernel`:
    whether the Triton kernel applies to these tensors at all (CUDA, triton importable, a
    supported layout); `width`: query heads x head_dim; `head_dim`: one head's."""
    if short_kernel:
        if batch.single_sequence:
            work = num_tokens * batch.max_seqlen * width // (2 if causal else 1)
            if work <= SHORT_SINGLE_MAX_WORK:
                return "triton"
            if causal and head_dim > 64 and work <= SHORT_SINGLE_SLOTS_LAST_MAX_WORK:
                return "triton_slots_last"
        elif not batch.uniform_seqlen and batch.max_seqlen <= SHORT_RAGGED_MAX_SEQLEN:
            return "triton"
    if batch.uniform_seqlen:
        return "sdpa_batched"
    if batch.single_sequence and (causal or not batch.has_padding):
        return "sdpa_single"
    return "varlen"


@register_backend("auto")
def _auto_backend() -> AttentionFn:
    """CUDA default, chosen per shape (`auto_choice`) from bench/attention.py's measurements (H200,
    bf16: cuDNN's SDPA runs dense batches 2-3x faster than varlen FlashAttention):
    - one short sequence with little score work (SHORT_SINGLE_MAX_WORK), or a ragged batch
      (graph buckets included) of sequences up to SHORT_RAGGED_MAX_SEQLEN tokens: the Triton
      kernel, one launch with no memset (a bucket's dummy sequence is attended like any other);
    - one causal sequence of wide heads with a little more (SHORT_SINGLE_SLOTS_LAST_MAX_WORK,
      off by default): the same kernel with its grid's slots axis last;
    - sequences all of one length (and no padding): one dense SDPA call;
    - one sequence, with no padding or with causal attention: SDPA over all tokens (causal real
      tokens never see the padding after them);
    - anything else (ragged batches of longer sequences, a padded bidirectional sequence): varlen."""
    from florist.kernels import short_attention as short

    varlen = _varlen_backend()

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        choice = auto_choice(batch, q.shape[0], causal, short.applies(q, k, v, batch.cu_seqlens), q.shape[1] * q.shape[2], q.shape[2])
        if choice == "triton":
            return short.short_attention_triton(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, scale)
        if choice == "triton_slots_last":
            return short.short_attention_triton(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, scale, seq_last=True)
        if choice == "sdpa_batched":
            return _sdpa_batched(q, k, v, batch.num_seqs, batch.uniform_seqlen, causal, scale)
        if choice == "sdpa_single":
            return _sdpa_batched(q, k, v, 1, q.shape[0], causal, scale)
        return varlen(q, k, v, batch, causal, scale)

    return attn


def last_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, scale: float) -> torch.Tensor:
    """One query per sequence, from its last token, over all of that sequence's keys:
    q [B, Hq, D], k/v [T, Hkv, D] -> [B, Hq, D]. The last token sees every key of its sequence
    whether the model is causal or not, so no mask is needed beyond the sequence's bounds.

    Used by the final layer of models whose head reads only the last token (Qwen3Model says
    when). Dense SDPA for equal lengths; FlashAttention's varlen kernel on CUDA (one query per
    sequence: cu_seqlens_q = 0, 1, ..., B); else keys gathered to [B, max_seqlen] under a length
    mask. All capturable: only `max_seqlen` / `uniform_seqlen` (host values) size the work."""
    b, gqa = q.shape[0], q.shape[1] != k.shape[1]
    if batch.uniform_seqlen:
        ks, vs = (t.view(b, batch.uniform_seqlen, t.shape[1], t.shape[2]).transpose(1, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, scale=scale, enable_gqa=gqa).squeeze(2)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and hasattr(torch.ops.aten, "_flash_attention_forward"):
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, batch.cu_seqlens, 1, batch.max_seqlen, 0.0, False, False, scale=scale)[0]
    cu = batch.cu_seqlens.long()
    offsets = torch.arange(batch.max_seqlen, device=q.device)
    index = (cu[:-1, None] + offsets[None, :]).clamp(max=k.shape[0] - 1)  # [B, L]
    mask = offsets[None, :] < (cu[1:] - cu[:-1])[:, None]
    ks, vs = k[index].transpose(1, 2), v[index].transpose(1, 2)  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
    return out.squeeze(2)


class Attention(nn.Module):
    """Holds the per-layer attention geometry; the backend function is shared and fixed."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool, backend: AttentionFn):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.scale, self.backend = causal, head_dim**-0.5, backend

    stores_kv = False  # no KV cache: nothing for the rotary kernel to write besides q and k

    def kv_store(self, v: torch.Tensor, batch: RaggedBatch) -> None:
        """Where k/v would be written for later steps: nowhere (no cache; see CachedAttention)."""
        return None

    def decode_with_qk_norm_rope(self, q, k, v, batch: RaggedBatch, q_norm, k_norm, cos_sin_cache) -> None:
        """A decode step from raw q/k/v in one launch: never here (see CachedAttention)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq*D] or [T, Hq, D] -> [T, Hq*D]. (`kv_stored`: for CachedAttention's call; no cache here.)"""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.backend(q, k, v, batch, self.causal, self.scale).reshape(t, -1)

    def forward_last(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, last: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq(*D)] of every token, k/v: [T, Hkv(*D)], `last`: [B] each sequence's last token
        -> [B, Hq*D], the attention output of those tokens. Up to LAST_TOKEN_FULL_ATTENTION_TOKENS
        tokens the backend's whole attention runs and its last rows are kept (one launch where
        the one-query path is a gather, an arange, FlashAttention and its copies); above, the last
        queries alone (`last_token_attention`)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if t <= LAST_TOKEN_FULL_ATTENTION_TOKENS:
            return self.backend(q, k, v, batch, self.causal, self.scale).reshape(t, -1)[last]
        return last_token_attention(q[last], k, v, batch, self.scale).reshape(last.shape[0], -1)
