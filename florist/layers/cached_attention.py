"""Attention with a KV cache, for generation (embedding models use `Attention` and pay nothing).

The cache is slot-based and contiguous (docs/generation.md says why): per layer

    k_cache, v_cache [num_slots + 1, max_len, Hkv, D]      slot s, position p -> row s * max_len + p
                      └ the last slot is scratch for padding rows of decode graphs

Every step first writes its tokens' k/v at `batch.slot_mapping` (`kv_store` says where, for a
model whose rotary kernel writes them itself; else `forward` does), then
- prefill (whole prompts, positions from 0): causal attention over the new tokens alone, with the
  model's ragged backend (florist.layers.attention), since they are all that the slot holds;
- decode (one token per sequence): a decode backend reads the first `context_lens[b]` rows of
  slot `slots[b]`.

Decode backends form a small registry like the ragged ones, chosen once at construction:
    "torch"  SDPA over the gathered cache with a length mask: the reference, the CPU path, and
             the fallback where FlashAttention does not apply (fp32, odd head sizes)
    "flash"  FlashAttention's varlen kernel (aten._flash_attention_forward): k/v are the flat
             cache, cu_seqlens_k = slot * max_len gives each sequence's start and seqused_k its
             length, so nothing is gathered; fewer kv heads are taken natively (GQA). At batch 1
             it runs as two kernels (split-KV, then combine).
    "triton" florist's one-launch split-context kernel (florist/kernels/decode_attention.py), the
             CUDA default for fp16/bf16: ahead of "flash" at every batch (1-32) and context
             (128-4096) measured (bench/fused_kernels.py --decode, docs/benchmarks.md). For Qwen3 it
             also takes the step's raw q/k/v (`decode_with_qk_norm_rope`): QK-norm, rotary and
             the k/v store run in the attention launch, not in a rotary launch before it
             (FLORIST_DECODE_FUSED_ROPE=0 keeps them apart, for A/B runs).
All only queue device work (no host reads): decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from florist.engine.generation.batch import GenerationBatch
from florist.kernels import decode_attention
from florist.kernels.kv_cache import store_kv
from florist.kernels.rotary import KVStore
from florist.layers.attention import AttentionFn

# (q [B, Hq, D], k_cache, v_cache [S, L, Hkv, D], batch, scale) -> out [B, Hq, D]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, GenerationBatch, float], torch.Tensor]
_DECODE_BACKENDS: dict[str, Callable[[], DecodeFn]] = {}
FUSED_ROPE = os.environ.get("FLORIST_DECODE_FUSED_ROPE", "1") != "0"


def register_decode_backend(name: str):
    def wrap(factory: Callable[[], DecodeFn]):
        _DECODE_BACKENDS[name] = factory
        return factory

    return wrap


def flash_decode_available() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and any(a.name == "seqused_k" for a in op.default._schema.arguments)


def select_decode_backend(name: str | None, device: torch.device, head_dim: int, dtype: torch.dtype) -> DecodeFn:
    """None: "triton" on CUDA for fp16/bf16 where Triton imports, else "torch"."""
    if name is None:
        name = "triton" if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and decode_attention.triton is not None else "torch"
    if name not in _DECODE_BACKENDS:
        raise ValueError(f"unknown decode attention backend {name!r}; choose one of {sorted(_DECODE_BACKENDS)}")
    return _DECODE_BACKENDS[name]()


@register_decode_backend("torch")
def _torch_decode() -> DecodeFn:
    def attn(q, k_cache, v_cache, batch: GenerationBatch, scale: float) -> torch.Tensor:
        # NOTE: rows past a sequence's length hold stale k/v of an earlier sequence (or zeros);
        # the reference's length mask gives them weight exactly 0, and the cache starts zeroed so
        # 0 * stale is 0. Only the first max_context_len positions are gathered.
        n = batch.max_context_len
        return decode_attention.decode_attention_ref(q, k_cache[:, :n], v_cache[:, :n], batch.slots, batch.context_lens, scale)

    return attn


@register_decode_backend("triton")
def _triton_decode() -> DecodeFn:
    def attn(q, k_cache, v_cache, batch: GenerationBatch, scale: float) -> torch.Tensor:
        return decode_attention.decode_attention(q, k_cache, v_cache, batch.slots, batch.context_lens, scale)

    attn.fuses_qk_norm_rope = FUSED_ROPE  # CachedAttention.decode_with_qk_norm_rope may call the kernel's fused path
    return attn


@register_decode_backend("flash")
def _flash_decode() -> DecodeFn:
    if not flash_decode_available():
        raise ValueError(f"decode attention 'flash' needs aten._flash_attention_forward with seqused_k, which torch "
                         f"{torch.__version__} lacks; choose 'triton' or 'torch'")
    op = torch.ops.aten._flash_attention_forward

    def attn(q, k_cache, v_cache, batch: GenerationBatch, scale: float) -> torch.Tensor:
        slots, max_len = k_cache.shape[:2]
        flat_k = k_cache.view(slots * max_len, *k_cache.shape[2:])
        flat_v = v_cache.view(slots * max_len, *v_cache.shape[2:])
        # Not causal: a single query per sequence sees its whole context (and FlashAttention then
        # folds grouped query heads into the query length, which suits decode).
        return op(q, flat_k, flat_v, batch.cu_seqlens, batch.cache_starts, 1, max_len, 0.0, False, False,
                  scale=scale, seqused_k=batch.context_lens)[0]

    return attn


class CachedAttention(nn.Module):
    """Same constructor and call as `Attention` (Qwen3Attention builds either); the cache tensors
    are bound once by the KV cache that owns them (`bind_cache`), the per-step metadata arrives
    in the batch."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool, backend: AttentionFn, decode_backend: DecodeFn):
        super().__init__()
        if not causal:
            raise ValueError("generation needs causal attention")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.backend, self.decode_backend = head_dim**-0.5, backend, decode_backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """k_cache, v_cache: [num_slots + 1, max_len, Hkv, D] views owned by the KV cache."""
        if k_cache.shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"cache of shape {tuple(k_cache.shape)} does not hold {self.num_kv_heads} kv heads of {self.head_dim}")
        self.k_cache, self.v_cache = k_cache, v_cache

    stores_kv = True  # the rotary kernel writes each step's k and v into the cache (kv_store)

    def kv_store(self, v: torch.Tensor, batch: GenerationBatch) -> KVStore:
        """(v, flat k cache, flat v cache, rows): where this step's k/v go, for a caller that
        writes them itself (Qwen3's QK-norm + rotary kernel does, in the same launch)."""
        rows = self.k_cache.shape[0] * self.k_cache.shape[1]
        flat = (self.num_kv_heads, self.head_dim)
        return v, self.k_cache.view(rows, *flat), self.v_cache.view(rows, *flat), batch.slot_mapping

    def decode_with_qk_norm_rope(self, q, k, v, batch: GenerationBatch, q_norm, k_norm, cos_sin_cache) -> torch.Tensor | None:
        """A decode step from the raw projections q [B, Hq, D], k, v [B, Hkv, D]: QK-norm and
        rotary at each sequence's position, the k/v store and attention in one launch
        (decode_attention.decode_attention_qk_norm_rope) -> [B, Hq*D]; None where that does not
        apply (prefill, another backend, the checks of `qk_norm_rope_applies`), and the caller
        runs the rotary kernel and `forward`."""
        if not (batch.decode and getattr(self.decode_backend, "fuses_qk_norm_rope", False) and q_norm.eps == k_norm.eps):
            return None
        if not decode_attention.qk_norm_rope_applies(q, k, v, q_norm.weight, k_norm.weight, cos_sin_cache, self.k_cache, self.v_cache):
            return None
        out = decode_attention.decode_attention_qk_norm_rope(q, k, v, q_norm.weight, k_norm.weight, q_norm.eps, cos_sin_cache,
                                                             self.k_cache, self.v_cache, batch.slots, batch.context_lens, self.scale)
        return out.reshape(q.shape[0], -1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: GenerationBatch, kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq*D] or [T, Hq, D] -> [T, Hq*D]; writes this step's k/v into the cache unless
        the caller already did (`kv_stored`, through `kv_store`)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not kv_stored:
            store_kv(k, *self.kv_store(v, batch))
        if batch.decode:
            out = self.decode_backend(q, self.k_cache, self.v_cache, batch, self.scale)
        else:
            out = self.backend(q, k, v, batch, True, self.scale)
        return out.reshape(t, -1)
