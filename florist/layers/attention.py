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


def select_backend(name: str | None, device: torch.device, head_dim: int = 128) -> AttentionFn:
    """None picks "auto" on CUDA and "sdpa" elsewhere. FlashAttention needs head_dim % 8 == 0;
    other head sizes take "sdpa" (which is not capturable in graphs: `capturable` says so)."""
    if name is None:
        name = "auto" if device.type == "cuda" and head_dim % 8 == 0 else "sdpa"
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


@register_backend("varlen")
def _varlen_backend() -> AttentionFn:
    """PyTorch's FlashAttention over cu_seqlens (CUDA only); one launch for the whole batch."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    native_gqa = "enable_gqa" in params
    # NOTE: torch 2.11 spells causality `is_causal`; newer releases use `window_size=(-1, 0)`.
    causal_kw = ({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        kwargs = dict(causal_kw) if causal else {}
        if q.shape[1] != k.shape[1]:
            if native_gqa:
                kwargs["enable_gqa"] = True
            else:
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu = batch.cu_seqlens
        return varlen_attn(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale=scale, **kwargs)

    return attn


def _sdpa_one(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """All T tokens as one sequence: [T, H, D] -> [T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if groups > 1:
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).squeeze(0).transpose(0, 1)


@register_backend("auto")
def _auto_backend() -> AttentionFn:
    """CUDA default, chosen per shape: one sequence goes to SDPA (cuDNN / flash kernels, the
    fastest for long single inputs), a ragged batch to varlen. A single sequence followed by
    padding may use SDPA over all tokens only when attention is causal: real tokens then never
    see the padding that comes after them."""
    varlen = _varlen_backend()

    def attn(q, k, v, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        if batch.single_sequence and (causal or batch.num_seqs == 1):
            return _sdpa_one(q, k, v, causal, scale)
        return varlen(q, k, v, batch, causal, scale)

    return attn


class Attention(nn.Module):
    """Holds the per-layer attention geometry; the backend function is shared and fixed."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool, backend: AttentionFn):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.scale, self.backend = causal, head_dim**-0.5, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        """q: [T, Hq*D] or [T, Hq, D] -> [T, Hq*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.backend(q, k, v, batch, self.causal, self.scale).reshape(t, -1)
