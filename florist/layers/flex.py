"""FlexAttention over a flat ragged batch: the "flex" attention backend.

One `flex_attention` call (torch.nn.attention.flex_attention) for the whole batch, under a
document mask: a token attends to the tokens of its own sequence (`seq_ids`; a graph bucket's
dummy sequence, which holds the padding, is a sequence like any other), and under a causal mask
to none after it. Query and key blocks are BLOCK = 128 tokens.

The block mask is made on the device from `cu_seqlens` and `seq_ids`, with shapes that depend on
the token count alone, so making it is capturable in a CUDA graph. A query block's keys are one
run of key blocks: from the block holding the start of its first token's sequence to the block
holding the end of its last token's sequence (causal: to the query block itself). Every key block
of that run holds a key some query of the block may see, and no other does (tests check the
table against the dense mask, block by block), so the kernel skips exactly the blocks it may.
Of those, the blocks that need no mask (the query block inside one sequence, the key block inside
the same one, and under a causal mask entirely before it) are listed apart as "full" blocks, on
which the kernel skips `mask_mod`; on the others it masks token by token.

On CUDA `flex_attention` runs compiled (`torch.compile`, which generates its Triton kernel: the
first token count compiles, the second compiles again with dynamic shapes, and every later count
reuses that). Elsewhere it runs eagerly: torch's unfused implementation, which materialises the
scores (tests only).

Measured against the other backends by `bench/attention.py` (docs/benchmarks.md, "FlexAttention");
"auto" does not pick it.
"""

from __future__ import annotations

import functools
import warnings

import torch

from florist.engine.batch import RaggedBatch

BLOCK = 128


def block_table(batch: RaggedBatch, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (kv_num_blocks [1, 1, nb], kv_indices [1, 1, nb, nb], full_kv_num_blocks, full_kv_indices),
    int32, for nb query blocks: query block i visits the key blocks kv_indices[..., i, :kv_num_blocks[i]]
    under `mask_mod`, and full_kv_indices[..., i, :full_kv_num_blocks[i]] without it (unused slots
    hold 0). A key block is full where the query block lies in one sequence, the key block too,
    both whole, and (causal) every key precedes every query."""
    t = batch.num_tokens
    nb = -(-t // BLOCK)
    seq = batch.seq_ids.long()
    cu = batch.cu_seqlens.long()
    blocks = torch.arange(nb, device=seq.device)
    first = blocks * BLOCK
    last = (first + BLOCK).clamp(max=t) - 1
    start = cu[seq[first]]  # where the sequence of each block's first token starts
    lo = start // BLOCK
    hi = (last if causal else cu[seq[last] + 1] - 1) // BLOCK
    count = hi - lo + 1
    # The full blocks: one run [flo, fhi] inside [lo, hi] (empty unless the query block is one
    # sequence's and whole); the masked ones are the rest of [lo, hi], before and after it.
    one = (seq[first] == seq[last]) & (last - first + 1 == BLOCK)
    flo = -(-start // BLOCK)
    fhi = (cu[seq[first] + 1] // BLOCK - 1).clamp(max=t // BLOCK - 1)
    if causal:
        fhi = torch.minimum(fhi, blocks - 1)
    full = torch.where(one, (fhi - flo + 1).clamp(min=0), 0)
    masked = count - full
    before = torch.where(full > 0, flo - lo, count)  # masked blocks ahead of the full run
    j = blocks[None, :]
    skip = torch.where(j < before[:, None], 0, full[:, None])  # past the full run, step over it
    indices = torch.where(j < masked[:, None], lo[:, None] + j + skip, 0)
    full_indices = torch.where(j < full[:, None], flo[:, None] + j, 0)
    shape, shape2 = (1, 1, nb), (1, 1, nb, nb)
    return (masked.to(torch.int32).view(shape), indices.to(torch.int32).view(shape2),
            full.to(torch.int32).view(shape), full_indices.to(torch.int32).view(shape2))


def block_mask(batch: RaggedBatch, causal: bool):
    from torch.nn.attention.flex_attention import BlockMask

    seq = batch.seq_ids

    def same_sequence(b, h, q_idx, kv_idx):
        return seq[q_idx] == seq[kv_idx]

    def causal_same_sequence(b, h, q_idx, kv_idx):
        return (seq[q_idx] == seq[kv_idx]) & (kv_idx <= q_idx)

    count, indices, full_count, full_indices = block_table(batch, causal)
    t = batch.num_tokens
    return BlockMask.from_kv_blocks(count, indices, full_count, full_indices, BLOCK_SIZE=BLOCK,
                                    mask_mod=causal_same_sequence if causal else same_sequence, seq_lengths=(t, t), compute_q_blocks=False)


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


class FlexAttention:
    """The backend: `(q, k, v, batch, causal, scale) -> out`, q [T, Hq, D], k/v [T, Hkv, D] ->
    [T, Hq, D]. The block mask depends on the batch alone, so it is made once per batch and
    reused by every layer (the last batch's mask is kept: a forward's layers all pass the same
    batch object; inside a CUDA graph the mask is made once in the captured forward too)."""

    def __init__(self):
        self._last: tuple[RaggedBatch, bool, object] | None = None

    def mask(self, batch: RaggedBatch, causal: bool):
        last = self._last
        if last is None or last[0] is not batch or last[1] != causal:
            last = self._last = (batch, causal, block_mask(batch, causal))
        return last[2]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch, causal: bool, scale: float) -> torch.Tensor:
        t = q.shape[0]
        if t == 0:
            return torch.empty_like(q)
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views
        kwargs = dict(block_mask=self.mask(batch, causal), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if q.is_cuda:
            out = _compiled()(qs, ks, vs, **kwargs)
        else:
            from torch.nn.attention.flex_attention import flex_attention as eager

            with warnings.catch_warnings():  # "called without torch.compile()": meant, off the GPU
                warnings.simplefilter("ignore", UserWarning)
                out = eager(qs, ks, vs, **kwargs)
        return out.squeeze(0).transpose(0, 1)
