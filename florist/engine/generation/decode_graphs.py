"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket, captured lazily.

    bucket(B) = the smallest of 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, ... that is >= B

    first sight of a bucket  -> run eagerly on the padded batch (warms kernels and allocators)
    second sight             -> capture a graph into the shared memory pool, then replay it
    later                    -> inputs into the static buffer (unless already there), replay

A graph's whole static state is one `CapturedGraph` (lazy_graphs.py): the packed int32 input it
reads (ids | positions | slots, see generation/batch.py) and the next-token ids it writes. Everything between
(embedding, layers, cache writes, attention over the cache, LM head, greedy pick) is captured;
padding rows use the scratch slot, so they are harmless by construction. The runner copies a
host-packed step straight into `static_input` (`static_input(rows)`), and a pipelined step
advances `static_input` in place from the next ids (batch.advance_decode) before the replay, so
neither costs a device-to-device copy. Under tensor parallelism every rank sees the same steps,
so every rank captures the same bucket at the same step and the captured collectives line up.
Captures and first sights are timed and logged, and the memory the graphs hold is summed in
`stats()`, as for the embedding graphs (florist/engine/lazy_graphs.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from florist.engine.lazy_graphs import LazyGraphs

log = logging.getLogger(__name__)
CAPTURE_LOG = "captured a decode CUDA graph for %d rows in %.1f ms (%d decode graphs, %.0f MiB)"
FIRST_SIGHT_LOG = ("ran a first-sight decode eagerly for %d rows: launched in %.1f ms "
                   "(%.1f ms of this thread's CPU; Triton kernels compiled %d, loaded from its cache %d)")

# (packed int32 inputs on the device, rows, max_context_len) -> next ids int64 [rows]
DecodeForward = Callable[[torch.Tensor, int, int], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> list[int]:
    sizes, n = [1, 2, 4, 8], 8
    while sizes[-1] < max_num_seqs:
        sizes += [n + n // 2, 2 * n]
        n *= 2
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphRunner(LazyGraphs):
    def __init__(self, forward: DecodeForward, device: torch.device, *, max_num_seqs: int, max_len: int):
        super().__init__(device, log, CAPTURE_LOG, FIRST_SIGHT_LOG)
        self.forward, self.max_len = forward, max_len
        self.buckets = decode_buckets(max_num_seqs)

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
            entry = self.capture(rows, inputs.clone(), lambda static: self.forward(static, rows, self.max_len))
        if entry is None:
            # max_context_len = max_len: the same shapes the graph will have.
            return self.first_sight(rows, lambda: self.forward(inputs, rows, self.max_len)), inputs
        if inputs is not entry.static_input:
            entry.static_input.copy_(inputs)
        entry.graph.replay()
        return entry.output, entry.static_input

    def log_fields(self, rows: int) -> tuple[int]:
        return (rows,)

    def stats(self) -> dict:
        return {"decode_graphs": sorted(self.graphs), **self.cost("decode_"), "buckets": self.buckets}
