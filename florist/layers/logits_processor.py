"""Logits and greedy token ids from the vocabulary-parallel LM head.

    hidden [B, H] --lm_head.local_logits--> [B, S] this rank's shard (ids vocab_start + [0, S))
                  --soft-cap, scale-------> [B, S]
      compute_logits:  all_gather_dim0 -> [tp*B, S] -> [B, tp*S] (rank-major columns) -> [:, :vocab_size]
      get_top_tokens:  local candidates [B, 2K] -> all_gather_dim0 [tp*B, 2K] -> pick -> int64 [B]

Both share the same elementwise steps, so get_top_tokens(h) == compute_logits(h).argmax(-1)
exactly, ties, NaN and infinities included (see florist.kernels.vocab_parallel_argmax). No
host-device sync anywhere: both can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from florist.distributed import all_gather_dim0
from florist.kernels.vocab_parallel_argmax import local_argmax_candidates, pick_from_candidates
from florist.layers.embedding import ParallelLMHead


class LogitsProcessor(nn.Module):
    def __init__(self, lm_head: ParallelLMHead, vocab_size: int, soft_cap: float | None = None, scale: float = 1.0):
        super().__init__()
        if not 0 < vocab_size <= lm_head.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} must lie in [1, {lm_head.vocab_size}] (the LM head's vocabulary)")
        if soft_cap is not None and soft_cap <= 0:
            raise ValueError(f"soft_cap must be positive or None; got {soft_cap}")
        self.lm_head = lm_head
        self.vocab_size, self.soft_cap, self.scale = vocab_size, soft_cap, scale
        self.tp_size = lm_head.tp_size
        # Ids in [vocab_size, padded) are padding here, even if the head has rows for them.
        self.num_valid = max(0, min(vocab_size - lm_head.vocab_start, lm_head.shard_size))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's shard [B, S] with soft-cap then scale applied (padding columns included)."""
        logits = self.lm_head.local_logits(hidden)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> full-vocabulary logits [B, vocab_size] on every rank."""
        logits = self.local_logits(hidden)
        if self.tp_size > 1:
            num_rows, shard_size = logits.shape
            gathered = all_gather_dim0(logits).view(self.tp_size, num_rows, shard_size)
            logits = gathered.permute(1, 0, 2).reshape(num_rows, self.tp_size * shard_size)
        return logits[:, : self.vocab_size]

    def get_top_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> greedy ids int64 [B] (the same on every rank), without gathering logits."""
        logits = self.local_logits(hidden)
        if self.tp_size == 1 and not logits.is_cuda:
            # One shard: torch.argmax's order is the one the candidates implement, so one
            # reduction over the real columns is the whole algorithm.
            return torch.argmax(logits[:, : self.vocab_size], dim=-1)
        # Triton kernels on CUDA (at TP 1 too: at one row, torch.argmax over a 152k vocabulary
        # is one slow reduction, the candidates spread it over 64 programs), the torch
        # reference of the same algorithm elsewhere.
        candidates = local_argmax_candidates(logits, self.lm_head.vocab_start, self.num_valid)
        if self.tp_size > 1:
            candidates = all_gather_dim0(candidates)
        return pick_from_candidates(candidates, self.tp_size)
