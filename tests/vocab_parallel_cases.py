"""Logits that stress the vocab-parallel argmax, and their split into padded TP shards.

The expected answer is always `torch.argmax` over the real (unpadded) logits; padding columns are
filled with values that would win (NaN, +inf, huge) if the kernels ever let them.
"""

from __future__ import annotations

import torch

from florist.layers.embedding import pad_vocab

KINDS = ("random", "int_ties", "ties_across_shards", "all_neg_inf", "pos_inf_ties", "nan", "signed_zeros")
LAYOUTS = ("row_major", "column_major", "strided")
INF, NAN = float("inf"), float("nan")


def shard_edges(vocab: int, tp: int) -> list[int]:
    """First and last real id of every shard that has one (where cross-shard ties live)."""
    size = pad_vocab(vocab, tp) // tp
    edges = []
    for r in range(tp):
        first, last = r * size, min(vocab, (r + 1) * size) - 1
        if first <= last:
            edges += [first, last]
    return sorted(set(edges))


def make_logits(kind: str, rows: int, vocab: int, tp: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor(shard_edges(vocab, tp))

    def some_edges(n: int) -> torch.Tensor:
        return edges[torch.randperm(len(edges), generator=g)[:n]]

    def some_ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), generator=g)

    if kind == "random":
        x = torch.randn(rows, vocab, generator=g) * 3
    elif kind == "int_ties":
        x = torch.randint(-4, 4, (rows, vocab), generator=g).float()
    elif kind == "ties_across_shards":
        x = torch.randint(-8, 1, (rows, vocab), generator=g).float()
        for b in range(rows):
            x[b, torch.cat([some_edges(3), some_ids(1)])] = 5.0
    elif kind == "all_neg_inf":
        x = torch.full((rows, vocab), -INF)
    elif kind == "pos_inf_ties":
        x = torch.randn(rows, vocab, generator=g)
        x[:, some_ids(20)] = -INF
        for b in range(rows):
            x[b, torch.cat([some_edges(2), some_ids(2)])] = INF
    elif kind == "nan":
        x = torch.randn(rows, vocab, generator=g)
        x[:, some_ids(5)] = INF
        for b in range(rows):
            # several NaNs per row, at shard edges and inside; the last row's only NaN is the
            # last real id, right next to the padding
            x[b, torch.cat([some_edges(3), some_ids(2)]) if b < rows - 1 else torch.tensor([vocab - 1])] = NAN
    elif kind == "signed_zeros":
        x = -1 - torch.rand(rows, vocab, generator=g)
        for b in range(rows):
            zeros = torch.cat([some_edges(2), some_ids(2)])
            x[b, zeros] = 0.0
            x[b, zeros.min()] = -0.0 if b % 2 == 0 else 0.0  # the winner is either zero
    else:
        raise ValueError(kind)
    return x.to(dtype)


def split_into_shards(full: torch.Tensor, tp: int, layout: str = "row_major", device: str = "cpu"):
    """[rows, vocab] -> (shards, vocab_starts, num_valids) as ParallelLMHead lays them out, padding
    poisoned, each shard a view (on `device`) with the layout's strides."""
    rows, vocab = full.shape
    padded_vocab = pad_vocab(vocab, tp)
    size = padded_vocab // tp
    poison = torch.tensor([NAN, INF, 1e4], dtype=full.dtype).repeat(padded_vocab - vocab)[: padded_vocab - vocab]
    if layout == "row_major":
        padded = torch.empty(rows, padded_vocab, dtype=full.dtype, device=device)
    elif layout == "column_major":
        padded = torch.empty(padded_vocab, rows, dtype=full.dtype, device=device).t()
    elif layout == "strided":  # every other column of a wider buffer: column stride 2, odd row stride
        wide = torch.full((rows, 2 * padded_vocab + 3), 7.0, dtype=full.dtype, device=device)
        padded = wide[:, 1 : 2 * padded_vocab + 1 : 2]
    else:
        raise ValueError(layout)
    padded[:, :vocab] = full
    padded[:, vocab:] = poison.to(device)
    shards = [padded[:, r * size : (r + 1) * size] for r in range(tp)]
    starts = [r * size for r in range(tp)]
    num_valids = [max(0, min(vocab - r * size, size)) for r in range(tp)]
    return shards, starts, num_valids
