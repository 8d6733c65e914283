"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of 64 * tp and split evenly over the tensor-parallel ranks,
so every shard is a multiple of 64 rows; real token ids form a global prefix, so padding sits only
at the tail of the last shard(s):

    global ids  0 ..................................................... vocab_size .. padded_vocab_size
                |  rank 0: [0, S)  |  rank 1: [S, 2S)  | ... |  rank tp-1: [(tp-1)*S, ..) real | pad |
    S = padded_vocab_size / tp;  rank r owns [vocab_start, vocab_start + S) = [r*S, (r+1)*S)
    num_valid(r) = clamp(vocab_size - r*S, 0, S)   (rows past it are zero padding)

Padding rows are zero, so padded logits are 0 and could beat negative real logits: whoever reads
`local_logits` must drop or mask the columns past `num_valid` (LogitsProcessor does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from florist.distributed import all_reduce, tp_rank, tp_size
from florist.layers.linear import linear

VOCAB_PAD_MULTIPLE = 64


def pad_vocab(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tp
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab(vocab_size, self.tp_size)
        self.shard_size = self.padded_vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.num_valid = max(0, min(vocab_size - self.vocab_start, self.shard_size))
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding of shape {tuple(loaded.shape)} does not match vocab {self.vocab_size} x dim {param.shape[1]}"
            )
        param.data.zero_()
        shard = loaded[self.vocab_start : self.vocab_start + self.num_valid]
        param.data[: self.num_valid].copy_(shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        # Ids owned by another rank read row 0 and are zeroed, so the all-reduce sums exactly one row.
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.num_valid)
        out = F.embedding(torch.where(mask, local, 0), self.weight).masked_fill_(~mask.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head: each rank computes logits for its own vocabulary shard (no gather here;
    `LogitsProcessor` decides whether to gather logits or only greedy candidates). With tied
    embeddings, point `weight` at the `VocabParallelEmbedding`'s: the shard layout is the same."""

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, shard_size] for global ids [vocab_start, vocab_start +
        shard_size); the columns past num_valid are padding."""
        return linear(hidden, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead is not an embedding; use LogitsProcessor(lm_head, ...) or local_logits(hidden)")
