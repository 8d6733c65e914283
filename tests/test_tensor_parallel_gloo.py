"""Tensor parallelism for real: 2 processes on gloo (CPU), the actual layers and collectives.

Weights and hidden states are small integers, so every logit is an exact integer in bf16 and fp32
(sums stay far below 2^8) and the sharded result must equal the unsharded one bit for bit; ties are
everywhere, and some rows are steered so the winner sits at a shard edge, in rank 1 or at NaN/inf.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from florist.distributed import destroy_tensor_parallel, init_tensor_parallel
from florist.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from florist.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from florist.layers.logits_processor import LogitsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from multi_gpu import tie_heavy_hidden, tie_heavy_weight  # noqa: E402  (the NCCL run uses the same heads)

WORLD_SIZE = 2
HIDDEN = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_lm_head(vocab: int, dtype: torch.dtype, rank: int) -> None:
    g = torch.Generator().manual_seed(vocab)  # the same weights and hidden on every rank
    for special, soft_cap, scale in ((False, None, 1.0), (True, None, 1.0), (False, 2.0, 0.5), (True, 2.0, 0.5)):
        full_weight = tie_heavy_weight(vocab, HIDDEN, WORLD_SIZE, dtype, g, special)
        head = ParallelLMHead(vocab, HIDDEN).to(dtype)
        head.weight_loader(head.weight, full_weight)
        proc = LogitsProcessor(head, vocab, soft_cap=soft_cap, scale=scale)
        for rows in range(1, 9):
            hidden = tie_heavy_hidden(rows, HIDDEN, dtype, g, special)
            expected = F.linear(hidden, full_weight)
            if soft_cap is not None:
                expected = torch.tanh(expected / soft_cap) * soft_cap
            expected = expected * scale
            logits = proc.compute_logits(hidden)
            where = f"rank {rank}, vocab {vocab}, {dtype}, rows {rows}, soft_cap {soft_cap}, special {special}"
            assert logits.shape == (rows, vocab), where
            torch.testing.assert_close(logits, expected, rtol=0, atol=0, equal_nan=True, msg=where)
            top = proc.get_top_tokens(hidden)
            assert torch.equal(top, torch.argmax(logits, -1)), f"{where}: {top.tolist()} vs {torch.argmax(logits, -1).tolist()}"
            assert torch.equal(top, torch.argmax(expected, -1)), where


def _check_embedding_and_linears(rank: int) -> None:
    g = torch.Generator().manual_seed(5)
    vocab = 1001
    table = torch.randint(-3, 4, (vocab, HIDDEN), generator=g).float()
    emb = VocabParallelEmbedding(vocab, HIDDEN)
    emb.weight_loader(emb.weight, table)
    ids = torch.tensor([0, 1, 511, 512, 1000, 700, 3], dtype=torch.int32)  # 512 = rank 1's first id
    assert torch.equal(emb(ids), table[ids.long()]), f"rank {rank}: VocabParallelEmbedding"

    w_up, b_up = torch.randint(-2, 3, (12, HIDDEN), generator=g).float(), torch.randint(-2, 3, (12,), generator=g).float()
    w_down, b_down = torch.randint(-2, 3, (HIDDEN, 12), generator=g).float(), torch.randint(-2, 3, (HIDDEN,), generator=g).float()
    up, down = ColumnParallelLinear(HIDDEN, 12, bias=True), RowParallelLinear(12, HIDDEN, bias=True)
    for layer, w, b in ((up, w_up, b_up), (down, w_down, b_down)):
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    x = torch.randint(-2, 3, (5, HIDDEN), generator=g).float()
    assert torch.equal(down(up(x)), F.linear(F.linear(x, w_up, b_up), w_down, b_down)), f"rank {rank}: column -> row linear"
    # At TP > 1 nothing is deferred: the all-reduced tensor, never split-K partials.
    assert torch.equal(down.forward_deferred(up(x)), down(up(x))), f"rank {rank}: row linear, deferred"

    # Fused layers: each rank holds its own slice of every part, side by side.
    mine = lambda w: w.chunk(WORLD_SIZE, 0)[rank]  # noqa: E731
    merged = MergedColumnParallelLinear(HIDDEN, [6, 10])
    parts = [torch.randint(-2, 3, (n, HIDDEN), generator=g).float() for n in (6, 10)]
    for i, w in enumerate(parts):
        merged.weight.weight_loader(merged.weight, w, i)
    assert torch.equal(merged(x), torch.cat([F.linear(x, mine(w)) for w in parts], -1)), f"rank {rank}: merged column"
    qkv = QKVParallelLinear(HIDDEN, head_dim=2, total_num_heads=4, total_num_kv_heads=2)
    qkv_parts = {name: torch.randint(-2, 3, (n, HIDDEN), generator=g).float() for name, n in (("q", 8), ("k", 4), ("v", 4))}
    for name, w in qkv_parts.items():
        qkv.weight.weight_loader(qkv.weight, w, name)
    expected = torch.cat([F.linear(x, mine(qkv_parts[name])) for name in "qkv"], -1)
    assert torch.equal(qkv(x), expected), f"rank {rank}: qkv"


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, WORLD_SIZE, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        _check_embedding_and_linears(rank)
        for vocab in (131072, 32001):
            for dtype in (torch.float32, torch.bfloat16):
                _check_lm_head(vocab, dtype, rank)
    finally:
        destroy_tensor_parallel()


def test_two_ranks_on_gloo():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD_SIZE, join=True)
