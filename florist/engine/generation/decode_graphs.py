"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, captured lazily.

    bucket(B) = the smallest of 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, ... that is >= B

    first sight of a bucket  -> run eagerly on the padded batch (warms kernels and allocators)
    second sight             -> capture a graph into the shared memory pool, then replay it
    later                    -> inputs into the static buffer (unless already there), replay

A graph's whole static state is one `_DecodeGraph`: the packed int32 input it reads (ids |
positions | slots, see generation/batch.py) and the next-token ids it writes. Everything between
(embedding, layers, cache writes, attention over the cache, LM head, greedy pick) is captured;
padding rows use the scratch slot, so they are harmless by construction. The runner copies a
host-packed step straight into `static_input` (`static_input(rows)`), and a pipelined step
advances `static_input` in place from `next_tokens` (batch.advance_decode) before the replay, so
neither costs a device-to-device copy. Under tensor parallelism every rank sees the same steps,
so every rank captures the same bucket at the same step and the captured collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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

    def static_input(self, rows: int) -> torch.Tensor | None:
        """The captured graph's input buffer for `rows`, or None before its capture."""
        entry = self.graphs.get(rows)
        return None if entry is None else entry.static_input

    def run(self, inputs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(next ids [rows], the input buffer the step read) for packed int32 inputs already on the
        device, padded to a bucket's rows; not waited on. The buffer returned is where the next
        pipelined step is advanced in place: the graph's static input once captured."""
        if rows not in self.buckets or inputs.shape[0] != 3 * rows + 1:
            raise ValueError(f"a decode buffer of {inputs.shape[0]} values is not padded to a bucket ({self.buckets})")
        entry = self.graphs.get(rows)
        if entry is None and rows in self.seen:
            entry = self._capture(rows, inputs)
        if entry is None:
            self.seen.add(rows)
            # max_context_len = max_len: the same shapes the graph will have.
            return self.forward(inputs, rows, self.max_len), inputs
        if inputs is not entry.static_input:
            entry.static_input.copy_(inputs)
        entry.graph.replay()
        return entry.next_tokens, entry.static_input

    def _capture(self, rows: int, inputs: torch.Tensor) -> _DecodeGraph:
        static = inputs.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            next_tokens = self.forward(static, rows, self.max_len)
        self.pool = graph.pool()
        entry = _DecodeGraph(graph, static, next_tokens)
        self.graphs[rows] = entry
        return entry  # capturing only records work: run() replays it for this step

    def stats(self) -> dict:
        return {"decode_graphs": sorted(self.graphs), "buckets": self.buckets}
