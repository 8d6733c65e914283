"""Whole-model CUDA graphs over bucketed ragged batches, captured lazily.

    bucket(T, B) = (tokens rounded up: to 64 up to 1024 tokens, to 256 above;
                    sequences: the next power of two >= B + 1, one dummy sequence for padding;
                    longest sequence (padding included): the next power of two, at least 64;
                    and, for one sequence, whether it fills the token bucket exactly)

The longest-sequence bucket bounds `max_seqlen`, which sizes varlen attention's grid: without it
a 100 x 256 batch would launch a grid for 25,600-token sequences. A single sequence that fills its
bucket has no padding, so even bidirectional attention can run as one dense SDPA call.

    first sight of a bucket  -> run eagerly on the padded batch (warms kernels and allocators)
    second sight             -> capture a graph into the shared memory pool, then replay it
    later                    -> copy the packed inputs into the static buffer, replay

A graph's static state is one `CapturedGraph` (lazy_graphs.py): the packed int32 input buffer the
graph reads and the output tensor it writes. Padding is harmless by construction: padding tokens belong to a dummy
sequence (several when covering, below) whose pooled row is sliced off, and attention never mixes sequences.
Batches above `max_tokens` run eagerly (there the GPU time dwarfs launch costs), except batches
that run as halves (below), whose halves may each hold up to `max_tokens`.

Covering. A first sight (20-40 ms of eager launches for a 28-layer model) and a capture (20-100
ms) each stall the batch that meets them, and a server whose traffic changes meets new buckets
while its clients wait. So a batch whose bucket has no graph yet is first served by a captured
graph that covers it, if one does: more tokens (at most `COVER_RATIO` times its own bucket's),
enough sequence slots, and a longest-sequence bucket that holds its longest sequence; `pack`
spreads the extra padding over as many dummy sequences as that bucket allows. Such a replay costs
the device the cover's extra tokens, so it is rented a bounded number of times (`rent`, default
`RENT_SIGHTS`; 0: never) before the bucket gets its own graph (a first sight, then a capture):
a bucket that comes back often stops paying for padding, one that turns up a few times in passing
never stalls anything. Measured (docs/benchmarks.md, "Covering new buckets"): 26-52 % less time on
a long-tailed stream of batch shapes (bench/covering.py), no change beyond the spread in
bench/serve.py's scenario 4, where every bucket comes back.

Halves. A big batch of a small model leaves the device idle in its kernels' tails and between
them: all-MiniLM-L6-v2's kernels at 100 x 256 tokens are 20-100 us each, and a persistent
product's last wave or an attention grid's last programs run on a fraction of the SMs. From
`split_min_tokens` tokens (0: never) such a batch runs as two halves of its sequences, each
padded to one shared bucket, the second half's forward on a side stream beside the first's in the
same graph, so one half's tails and launches overlap the other's work. The two halves' output
rows are gathered back into the batch's order inside the graph (the row map is part of the
packed input):

    sequences  s0 .. s(k-1) | sk .. s(B-1)        split where the tokens are closest to halved
    packed     [ half A, bucket (T, S, L) | half B, same bucket | row map [2 S] ]
    graph      side stream:  forward(B) ─┐
               capture stream: forward(A) ┴─ join ─ cat(A, B)[row map] -> rows [:B] real

The key is (T, S, L, False, 2). Halves cover only halves: a captured halves graph serves a
halves batch whose two halves it covers each by the rule above (and is rented the same way).
`max_tokens` bounds a half, so a halves batch of up to twice that runs from a graph too: above
all-MiniLM-L6-v2's 32,768 tokens eager launches cost ~4-6 ms of host time a forward, about the
GPU's time there, and the halves' graph took 8-35 % less than the eager batch (100 x 512, 128 x
512, 200 x U(64..512)). Measured on the H200 (docs/benchmarks.md, "Halves on two streams"):
all-MiniLM-L6-v2 -3 to -10 % device time per batch from ~7,200 tokens and a loss below ~5,000,
the BERT-base geometry -1 to -14 %, the Qwen3-0.6B geometry +1 to +5 % (its products fill the
device): runner.py's `default_split_min_tokens` sets the threshold per family.

    bucket captured         -> replay its graph
    else, a cover captured  -> replay the cover (up to `rent` times for this bucket)
    else, seen before       -> capture, then replay
    else                    -> first sight (eager)

A capture happens while a server runs (it stalls that batch by tens of ms), so each is logged
with its time and the graph memory so far; `stats()` sums them (the cycle and its accounting:
lazy_graphs.py). A first sight is logged too, with the host time its launch
took, the thread's CPU time and the Triton kernels compiled meanwhile: on the H200 a new
sequence bucket compiles three or four kernels and holds its batch for 0.85-1.7 s, which is why
`florist serve` warms up by default (docs/benchmarks.md, "The stall's cause"; bench/first_sight.py). Capturing
without what `torch.cuda.graph` does first (synchronize, empty the device and pinned-host
caches) was tried and stalled requests for up to 1.5 s under load (docs/benchmarks.md), so
captures go through `torch.cuda.graph`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from florist.config import int_from_env
from florist.engine.batch import HostBatch, RaggedBatch, pack, packed_size, views
from florist.engine.lazy_graphs import LazyGraphs
from florist.engine.staging import InputStaging

log = logging.getLogger(__name__)
# Read back by bench/serve.py (graphs captured while a cell ran): keep "captured a CUDA graph" and "in N ms".
CAPTURE_LOG = "captured a CUDA graph for %d tokens, up to %d sequences, longest %d, in %.1f ms (%d graphs, %.0f MiB)"
# Read back the same way: keep "ran a first-sight batch eagerly" and "launched in N ms".
# The thread's CPU time beside the wall time tells work (compiling, Python) from waiting (the GIL, a device sync),
# and the Triton kernels compiled or loaded from its disk cache meanwhile (kernels/compile_watch.py) tell compiling apart.
# Read back the same way: keep "replayed a covering CUDA graph".
COVER_LOG = ("replayed a covering CUDA graph of %d tokens, up to %d sequences, longest %d, for a batch of %d tokens, up to %d "
             "sequences, longest %d (%d of %d before its own graph)")
FIRST_SIGHT_LOG = ("ran a first-sight batch eagerly for %d tokens, up to %d sequences, longest %d: launched in %.1f ms "
                   "(%.1f ms of this thread's CPU; Triton kernels compiled %d, loaded from its cache %d)")


def token_bucket(num_tokens: int) -> int:
    step = 64 if num_tokens <= 1024 else 256
    return max(step, -(-num_tokens // step) * step)


def seq_bucket(num_seqs: int) -> int:
    return 1 << num_seqs.bit_length()  # next power of two strictly above num_seqs: room for the dummy


def seqlen_bucket(num_tokens: int, max_seqlen: int, tokens: int) -> int:
    longest = max(max_seqlen, tokens - num_tokens)  # the dummy holds the padding
    return min(tokens, max(64, 1 << (longest - 1).bit_length()))


def bucket_of(num_tokens: int, num_seqs: int, max_seqlen: int) -> tuple[int, int, int, bool]:
    """(token bucket, sequence bucket, longest-sequence bucket, exact single) of a ragged batch."""
    tokens = token_bucket(num_tokens)
    exact_single = num_seqs == 1 and num_tokens == tokens
    return tokens, seq_bucket(num_seqs), seqlen_bucket(num_tokens, max_seqlen, tokens), exact_single


def bucket(host: HostBatch) -> tuple[int, int, int, bool]:
    return bucket_of(host.num_tokens, host.num_seqs, host.max_seqlen)


Key = tuple[int, int, int, bool]  # (tokens, sequences, longest, exact single): bucket_of
COVER_RATIO = 2  # a cover replays at most this many times the tokens of the batch's own bucket
# Covered replays of one bucket before it gets its own graph. With at most 2x the tokens, 8 covered
# batches cost the device at most 8 batches' time: a few ms for small batches, tens of ms for
# thousands of tokens, about what the first sight and capture they put off would have stalled.
# FLORIST_GRAPH_RENT sets it (0: no covering, every new bucket is captured on its second sight).
RENT_SIGHTS = int_from_env("FLORIST_GRAPH_RENT", 8)


def covers(cover: Key, key: Key, num_tokens: int, num_seqs: int, max_seqlen: int) -> bool:
    """Whether the graph of bucket `cover` can run a batch of bucket `key` (num_tokens in num_seqs
    sequences, the longest max_seqlen): an unpadded graph runs only its own shape; a graph of one
    real sequence (two slots) only one sequence; and the padding must fit its dummy sequences."""
    tokens, seqs, longest, exact_single = cover
    if exact_single or cover == key or not key[0] <= tokens <= COVER_RATIO * key[0] or max_seqlen > longest:
        return False
    return num_seqs + -(-(tokens - num_tokens) // longest) <= seqs and (seqs > 2 or num_seqs == 1)


def bucket_views(packed: torch.Tensor, key: Key, with_types: bool) -> RaggedBatch:
    """The batch a graph of bucket `key` runs, over its packed inputs (`pack(host, key[0], key[1],
    longest=key[2])`, on the device)."""
    # NOTE: a graph is replayed for every batch of its bucket, so only bucket-wide facts may
    # shape it: B = 1 is the only batch size in sequence bucket 2, and `exact_single` is part
    # of the key.
    tokens, seqs, max_seqlen, exact_single = key
    return views(packed, tokens, seqs, with_types, max_seqlen=max_seqlen, seq_lens_host=(),
                 single_sequence=seqs == 2, has_padding=not exact_single)


def halves(host: HostBatch) -> tuple[HostBatch, HostBatch]:
    """The batch's sequences in two runs, cut where the first holds closest to half the tokens
    (each half keeps at least one sequence)."""
    assert host.num_seqs >= 2, "two halves need two sequences"
    ends = np.cumsum(host.seq_lens[:-1], dtype=np.int64)  # tokens before sequence k, k = 1 .. B-1
    k = 1 + int(np.argmin(np.abs(2 * ends - host.num_tokens)))
    cut = int(ends[k - 1])
    types = host.token_type_ids
    first = HostBatch(host.input_ids[:cut], host.seq_lens[:k], None if types is None else types[:cut])
    second = HostBatch(host.input_ids[cut:], host.seq_lens[k:], None if types is None else types[cut:])
    return first, second


HalvesKey = tuple[int, int, int, bool, int]  # one half's bucket (tokens, sequences, longest, False), then 2


def halves_key(first: HostBatch, second: HostBatch) -> HalvesKey:
    """One bucket both halves fit, each padded by one dummy sequence: the longest-sequence bucket
    holds the padding of the half with fewer tokens too."""
    tokens = token_bucket(max(first.num_tokens, second.num_tokens))
    longest = max(seqlen_bucket(h.num_tokens, h.max_seqlen, tokens) for h in (first, second))
    return tokens, seq_bucket(max(first.num_seqs, second.num_seqs)), longest, False, 2


def halves_size(key: HalvesKey, with_types: bool) -> int:
    """int32 elements of a halves batch's packed input: two packed halves, then the row map."""
    return 2 * packed_size(key[0], key[1], with_types) + 2 * key[1]


def pack_halves(first: HostBatch, second: HostBatch, key: HalvesKey, with_types: bool, out: np.ndarray | None = None) -> np.ndarray:
    """[half A | half B | row map]: each half packed into the key's bucket, and the map from the
    batch's rows to the rows of the two halves' outputs stacked ([S] rows each)."""
    tokens, seqs, longest = key[:3]
    n = packed_size(tokens, seqs, with_types)
    buf = np.empty(halves_size(key, with_types), dtype=np.int32) if out is None else out
    pack(first, tokens, seqs, out=buf[:n], longest=longest)
    pack(second, tokens, seqs, out=buf[n : 2 * n], longest=longest)
    rows = buf[2 * n :]
    a, b = first.num_seqs, second.num_seqs
    rows[:a] = np.arange(a, dtype=np.int32)
    rows[a : a + b] = seqs + np.arange(b, dtype=np.int32)
    rows[a + b :] = 0  # rows past the batch are sliced off
    return buf


def halves_forward(forward: Callable[[RaggedBatch], torch.Tensor], key: HalvesKey, with_types: bool,
                   side: torch.cuda.Stream | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """packed halves (device) -> the batch's rows first: half B's forward on `side` (None: after
    half A, on the current stream, e.g. on the CPU), joined before the rows are gathered."""
    half = key[:4]
    n = packed_size(key[0], key[1], with_types)

    def run(packed: torch.Tensor) -> torch.Tensor:
        first, second = bucket_views(packed[:n], half, with_types), bucket_views(packed[n : 2 * n], half, with_types)
        if side is None:
            out_b = forward(second)
            out_a = forward(first)
        else:
            # NOTE: the side stream starts after everything queued before (the input copy) and the
            # current stream goes on only once it is done, in eager launches and captures alike.
            # Its tensors are freed to its own stream's pool and first reused by its next half,
            # which again waits for the current stream: nothing it frees is read after.
            main = torch.cuda.current_stream(packed.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out_b = forward(second)
            out_a = forward(first)
            main.wait_stream(side)
        return torch.cat((out_a, out_b)).index_select(0, packed[2 * n :])

    return run


class GraphRunner(LazyGraphs):
    def __init__(self, forward: Callable[[RaggedBatch], torch.Tensor], device: torch.device, *, max_tokens: int, with_token_types: bool,
                 rent: int = RENT_SIGHTS, split_min_tokens: int = 0):
        super().__init__(device, log, CAPTURE_LOG, FIRST_SIGHT_LOG)
        self.forward, self.max_tokens = forward, max_tokens
        self.split_min_tokens = split_min_tokens  # batches of at least this many tokens run as two halves (0: never)
        self.side_stream: torch.cuda.Stream | None = None  # the second half's, made at the first halves batch
        self.with_types = with_token_types
        self.rent = rent
        self.rented: dict[Key | HalvesKey, int] = {}  # covered replays so far, per bucket without a graph of its own
        self.covered_replays = 0
        # Callers keep up to two batches in flight and may launch a third before reading the
        # first: four pinned input buffers mean refilling one never waits on a running batch.
        self.staging = InputStaging(device, ring=4)

    def applies(self, host: HostBatch) -> bool:
        """Whether a graph runs `host`: up to `max_tokens` tokens, or halves of up to that many each."""
        if host.num_tokens <= self.max_tokens:
            return True
        return self._splits(host) and host.num_tokens <= 2 * self.max_tokens and max(h.num_tokens for h in halves(host)) <= self.max_tokens

    def _splits(self, host: HostBatch) -> bool:
        return 0 < self.split_min_tokens <= host.num_tokens and host.num_seqs >= 2

    def run(self, host: HostBatch) -> torch.Tensor:
        """Device output rows [:B] of the padded batch; launched, not waited on."""
        host = self._with_token_types(host)
        parts = halves(host) if self._splits(host) else (host,)
        key = halves_key(*parts) if len(parts) == 2 else bucket(host)
        entry = self.graphs.get(key)
        if entry is None and (rented := self.rented.get(key, 0)) < self.rent and (cover := self._cover(key, parts)) is not None:
            self.rented[key] = rented + 1
            self.covered_replays += 1
            log.info(COVER_LOG, *self.log_fields(cover), *self.log_fields(key), rented + 1, self.rent)
            key, entry = cover, self.graphs[cover]
        # Packed straight into a pinned staging buffer: no allocation, one copy to the device.
        self._pack(key, parts)
        if entry is None and key in self.seen:
            entry = self.capture(key, self.staging.send(), self._forward_of(key))
        if entry is None:
            forward = self._forward_of(key)
            return self.first_sight(key, lambda: forward(self.staging.send())[: host.num_seqs])
        self.staging.send(out=entry.static_input)
        entry.graph.replay()
        return entry.output[: host.num_seqs]

    def _pack(self, key: Key | HalvesKey, parts: tuple[HostBatch, ...]) -> None:
        """The batch (or its two halves, with their row map) into the next staging buffer, laid out for `key`."""
        if len(key) == 5:
            pack_halves(*parts, key, self.with_types, out=self.staging.buffer(halves_size(key, self.with_types)))
        else:
            pack(parts[0], key[0], key[1], out=self.staging.buffer(packed_size(key[0], key[1], self.with_types)), longest=key[2])

    def _forward_of(self, key: Key | HalvesKey) -> Callable[[torch.Tensor], torch.Tensor]:
        """packed input (device) -> output rows, for a graph of `key` (captured or run as a first sight)."""
        if len(key) == 4:
            return lambda static: self.forward(self._views(static, key))
        if self.side_stream is None and self.device.type == "cuda":
            self.side_stream = torch.cuda.Stream(self.device)
        return halves_forward(self.forward, key, self.with_types, self.side_stream)

    def _cover(self, key: Key | HalvesKey, parts: tuple[HostBatch, ...]) -> Key | HalvesKey | None:
        """The captured bucket of the same kind (whole or halves) and fewest tokens (then sequences)
        that can run the batch, each of its halves by `covers` for halves; None if there is none."""
        fits = [k for k in self.graphs
                if len(k) == len(key) and all(covers(k[:4], key[:4], h.num_tokens, h.num_seqs, h.max_seqlen) for h in parts)]
        return min(fits, default=None, key=lambda k: (k[0], k[1], k[2]))

    def _with_token_types(self, host: HostBatch) -> HostBatch:
        """One graph per bucket serves single texts and pairs alike: BERT always gets token
        types (zeros for single texts), other families never."""
        if self.with_types and host.token_type_ids is None:
            return replace(host, token_type_ids=np.zeros(host.num_tokens, dtype=np.int32))
        if not self.with_types and host.token_type_ids is not None:
            return replace(host, token_type_ids=None)
        return host

    def _views(self, packed: torch.Tensor, key: Key) -> RaggedBatch:
        return bucket_views(packed, key, self.with_types)

    def log_fields(self, key: Key | HalvesKey) -> tuple[int, int, int]:
        parts = key[4] if len(key) > 4 else 1
        return parts * key[0], parts * (key[1] - 1), key[2]  # tokens, sequences (the dummies' places left out), longest

    def stats(self) -> dict:
        return {"graphs": len(self.graphs), **self.cost(), "max_tokens": self.max_tokens, "covered_replays": self.covered_replays,
                "split_min_tokens": self.split_min_tokens}
