"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, captured lazily.

    bucket(B) = the smallest of 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, ... that is >= B

    first sight of a bucket  -> run eagerly on the padded batch (warms kernels and allocators)
    second sight             -> capture a graph into the shared memory pool, then replay it
    later                    -> copy the packed inputs into the static buffer, replay

A graph's whole static state is one `_DecodeGraph`: the packed int32 input it reads (ids |
positions | slots, see generation/batch.py) and the next-token ids it writes. Everything between
(embedding, layers, cache writes, attention over the cache, LM head, greedy pick) is captured;
padding rows use the scratch slot, so they are harmless by construction. Under tensor
parallelism every rank sees the same steps, so every rank captures the same bucket at the same
step and the captured collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# (packed int32 inputs on the device, rows, max_context_len) -> next ids int64 [rows]
DecodeForward = Callable[[torch.Tensor, int, int], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> list[int]:
    sizes, n = [1, 2, 4, 8], 8
    while sizes[-1] < max_num_seqs:
        sizes += [n + n // 2, 2 * n]
        n *= 2
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


@dataclass
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor  # int32 [3 * rows + 1]
    next_tokens: torch.Tensor  # int64 [rows]


class DecodeGraphRunner:
    def __init__(self, forward: DecodeForward, device: torch.device, *, max_num_seqs: int, max_len: int):
        self.forward, self.device, self.max_len = forward, device, max_len
        self.buckets = decode_buckets(max_num_seqs)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.seen: set[int] = set()
        self.pool = None

    def bucket(self, num_seqs: int) -> int:
        for size in self.buckets:
            if size >= num_seqs:
                return size
        raise ValueError(f"{num_seqs} sequences exceed the largest decode bucket {self.buckets[-1]}")

    def run(self, packed: np.ndarray) -> torch.Tensor:
        """Next ids [rows] on the device for a buffer packed to a bucket's rows; not waited on."""
        rows = (packed.shape[0] - 1) // 3
        if rows not in self.buckets:
            raise ValueError(f"a decode buffer of {rows} rows is not padded to a bucket ({self.buckets})")
        host = torch.from_numpy(packed).pin_memory()
        entry = self.graphs.get(rows)
        if entry is None and rows in self.seen:
            entry = self._capture(rows, host)
        if entry is None:
            self.seen.add(rows)
            # max_context_len = max_len: the same shapes the graph will have.
            return self.forward(host.to(self.device, non_blocking=True), rows, self.max_len)
        entry.static_input.copy_(host, non_blocking=True)
        entry.graph.replay()
        return entry.next_tokens

    def _capture(self, rows: int, host: torch.Tensor) -> _DecodeGraph:
        static = torch.empty(host.shape, dtype=torch.int32, device=self.device)
        static.copy_(host)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            next_tokens = self.forward(static, rows, self.max_len)
        self.pool = graph.pool()
        entry = _DecodeGraph(graph, static, next_tokens)
        self.graphs[rows] = entry
        return entry  # capturing only records work: run() replays it for this step

    def stats(self) -> dict:
        return {"decode_graphs": sorted(self.graphs), "buckets": self.buckets}
