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
Captures and first sights are timed and logged, and the memory the graphs hold is summed in
`stats()`, as for the embedding graphs (florist/engine/lazy_graphs.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from florist.engine.generation.batch import pad_prefill
from florist.engine.graph_runner import bucket_of, token_bucket
from florist.engine.lazy_graphs import LazyGraphs
from florist.engine.staging import InputStaging

log = logging.getLogger(__name__)
CAPTURE_LOG = "captured a prefill CUDA graph for %d tokens, up to %d prompts, longest %d, in %.1f ms (%d prefill graphs, %.0f MiB)"
FIRST_SIGHT_LOG = ("ran a first-sight prefill eagerly for %d tokens, up to %d prompts, longest %d: launched in %.1f ms "
                   "(%.1f ms of this thread's CPU; Triton kernels compiled %d, loaded from its cache %d)")

Key = tuple[int, int, int, bool]  # (tokens, sequences, longest, exact single): graph_runner.bucket_of
# (padded packed int32 inputs on the device, bucket) -> next ids int64 [sequences of the bucket]
PrefillForward = Callable[[torch.Tensor, Key], torch.Tensor]


class PrefillGraphRunner(LazyGraphs):
    def __init__(self, forward: PrefillForward, staging: InputStaging, *, max_tokens: int, max_len: int, scratch_slot: int):
        super().__init__(staging.device, log, CAPTURE_LOG, FIRST_SIGHT_LOG)
        self.forward, self.staging = forward, staging
        self.max_tokens, self.max_len, self.scratch_slot = max_tokens, max_len, scratch_slot

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
            entry = self.capture(key, self.staging.send(), lambda static: self.forward(static, key))
        if entry is None:
            return self.first_sight(key, lambda: self.forward(self.staging.send(), key))
        self.staging.send(out=entry.static_input)
        entry.graph.replay()
        return entry.output

    def log_fields(self, key: Key) -> tuple[int, int, int]:
        return key[0], key[1] - 1, key[2]  # tokens, prompts (the dummy's place left out), longest

    def stats(self) -> dict:
        return {"prefill_graphs": sorted(self.graphs), **self.cost("prefill_"), "max_tokens": self.max_tokens}
