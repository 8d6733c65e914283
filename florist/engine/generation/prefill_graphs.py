"""Prefill steps replayed from CUDA graphs, one graph per bucket, captured lazily.

An eager prefill launches every kernel of every layer from Python: for the Qwen3-0.6B geometry on
the H200, 18.2 ms to the first token at 128 prompt tokens, against 1.36 ms from a graph
(docs/benchmarks.md, "Generation"). Prefills therefore replay graphs, bucketed as the embedding
engine's are (graph_runner.bucket_of):

    bucket(T, B) = (tokens rounded up: to 64 up to 1024, to 256 above; sequences: the next power
                    of two >= B + 1; longest sequence, padding included: the next power of two,
                    at least 64; and, for one prompt, whether it fills the token bucket exactly)

    first sight of a bucket  -> run eagerly on the padded step (compiles kernels, warms allocators)
    second sight             -> capture a graph into this runner's memory pool, then replay it
    later                    -> the padded step into the static buffer, replay

The padding tokens form a dummy sequence whose k/v go to the KV cache's scratch slot
(batch.pad_prefill), as a decode step's padding rows do; the next ids of the dummy and of the empty
sequences after it are sliced off by the caller (it reads the first B). Prefills above `max_tokens`
run eagerly (there the GPU time hides the launches; florist/engine/runner.py: default_graph_max_tokens). The
pool is apart from the decode graphs': a decode graph's next ids must survive a prefill replay.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from florist.engine.generation.batch import pad_prefill
from florist.engine.graph_runner import bucket_of, token_bucket
from florist.engine.staging import InputStaging

log = logging.getLogger(__name__)

Key = tuple[int, int, int, bool]  # (tokens, sequences, longest, exact single): graph_runner.bucket_of
# (padded packed int32 inputs on the device, bucket) -> next ids int64 [sequences of the bucket]
PrefillForward = Callable[[torch.Tensor, Key], torch.Tensor]


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor  # int32, batch.pad_prefill's layout
    next_tokens: torch.Tensor  # int64 [sequences of the bucket]


class PrefillGraphRunner:
    def __init__(self, forward: PrefillForward, staging: InputStaging, *, max_tokens: int, max_len: int, scratch_slot: int):
        self.forward, self.staging = forward, staging
        self.max_tokens, self.max_len, self.scratch_slot = max_tokens, max_len, scratch_slot
        self.graphs: dict[Key, _PrefillGraph] = {}
        self.seen: set[Key] = set()
        self.pool = None
        self.capture_seconds = 0.0

    def applies(self, num_tokens: int) -> bool:
        """At most max_tokens, and the padding fits in the scratch slot."""
        return num_tokens <= self.max_tokens and token_bucket(num_tokens) - num_tokens <= self.max_len

    def run(self, packed: np.ndarray, num_tokens: int, num_seqs: int, seq_lens: tuple[int, ...]) -> torch.Tensor:
        """Next ids [sequences of the bucket] (the first num_seqs are the prompts') for a packed
        prefill step (batch.pack_prefill); launched, not waited on."""
        key = bucket_of(num_tokens, num_seqs, max(seq_lens))
        tokens, seqs = key[0], key[1]
        pad_prefill(packed, num_tokens, num_seqs, tokens, seqs, self.scratch_slot, self.max_len,
                    out=self.staging.buffer(4 * tokens + seqs + 1))
        entry = self.graphs.get(key)
        if entry is None and key in self.seen:
            entry = self._capture(key, self.staging.send())
        if entry is None:
            self.seen.add(key)
            return self.forward(self.staging.send(), key)
        self.staging.send(out=entry.static_input)
        entry.graph.replay()
        return entry.next_tokens

    def _capture(self, key: Key, static: torch.Tensor) -> _PrefillGraph:
        started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            next_tokens = self.forward(static, key)
        self.pool = graph.pool()
        entry = _PrefillGraph(graph, static, next_tokens)
        self.graphs[key] = entry
        took = time.perf_counter() - started
        self.capture_seconds += took
        log.info("captured a prefill CUDA graph for %d tokens, up to %d prompts, longest %d, in %.1f ms (%d prefill graphs)",
                 key[0], key[1] - 1, key[2], took * 1e3, len(self.graphs))
        return entry  # capturing only records work: run() replays it for this step

    def stats(self) -> dict:
        return {"prefill_graphs": sorted(self.graphs), "prefill_capture_seconds": round(self.capture_seconds, 4), "max_tokens": self.max_tokens}
