"""The flat ragged batch every forward pass runs on.

All sequences are concatenated along one token axis; there is no padding inside a sequence:

    input_ids   [T]      t0 t1 t2 | u0 u1 | v0 v1 v2 v3
    positions   [T]       0  1  2 |  0  1 |  0  1  2  3
    seq_ids     [T]       0  0  0 |  1  1 |  2  2  2  2
    cu_seqlens  [B+1]     0        3       5            9

`HostBatch` is built on the CPU with numpy (cheap, no torch ops per sequence); `to_device` packs
everything into one int32 buffer and makes one host-to-device copy, so a batch costs one transfer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HostBatch:
    """Token ids and layout on the host. `token_type_ids` is only set for BERT-style pairs."""

    input_ids: np.ndarray  # int32 [T]
    seq_lens: np.ndarray  # int32 [B]
    token_type_ids: np.ndarray | None = None  # int32 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @functools.cached_property  # read several times per step (checks, bucket); the batch is frozen
    def max_seqlen(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    @classmethod
    def from_sequences(cls, seqs: list[list[int]] | list[np.ndarray], first_segment_lens: list[int] | None = None) -> "HostBatch":
        """`first_segment_lens[i]` tokens of sequence i are segment 0, the rest segment 1."""
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
        ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
        types = None
        if first_segment_lens is not None:
            types = segment_ids(lens, np.asarray(first_segment_lens, dtype=np.int32))
        return cls(ids, lens, types)

    def positions(self) -> np.ndarray:
        starts = np.zeros(self.num_seqs, dtype=np.int32)
        np.cumsum(self.seq_lens[:-1], out=starts[1:])
        return np.arange(self.num_tokens, dtype=np.int32) - np.repeat(starts, self.seq_lens)



def segment_ids(seq_lens: np.ndarray, first_segment_lens: np.ndarray) -> np.ndarray:
    """Per-token 0/1 segment ids: the first `first_segment_lens[i]` tokens of each sequence are 0."""
    starts = np.zeros(len(seq_lens), dtype=np.int32)
    np.cumsum(seq_lens[:-1], out=starts[1:])
    offsets = np.arange(int(seq_lens.sum()), dtype=np.int32) - np.repeat(starts, seq_lens)
    return (offsets >= np.repeat(first_segment_lens, seq_lens)).astype(np.int32)


@dataclass
class RaggedBatch:
    """Device-side view of a batch; passed explicitly down through the model (no globals).

    Host values (`max_seqlen`, `seq_lens_host`, `single_sequence`) are fixed for the batch, and
    for a CUDA graph fixed for its bucket: backends may size work from them but never read device
    values back. A padded batch (graph buckets) ends with one dummy sequence holding the padding
    tokens, then empty sequences up to the sequence bucket; its `seq_lens_host` is empty.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    seq_ids: torch.Tensor  # [T] int32
    cu_seqlens: torch.Tensor  # [B+1] int32
    token_type_ids: torch.Tensor | None
    max_seqlen: int
    seq_lens_host: tuple[int, ...]
    single_sequence: bool = False  # exactly one real sequence, at the start
    has_padding: bool = False  # tokens after the real sequences (graph buckets)
    uniform_seqlen: int = 0  # > 0: every sequence has this length and there is no padding

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def last_token_index(self) -> torch.Tensor:
        """[B] int64: each sequence's last token (an empty trailing sequence of a padded batch
        points at the token before it: valid, and its row is sliced off)."""
        return self.cu_seqlens[1:].long() - 1

    def last_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each sequence's last-token row of hidden [T, ...] -> [B, ...]: hidden itself where every
        sequence is one token (a last-token model's output with `one_token_per_seq`'s batch, or
        one-token inputs), else a gather at `last_token_index`."""
        if self.uniform_seqlen == 1 and hidden.shape[0] == self.num_seqs:
            return hidden
        return hidden[self.last_token_index()]

    def one_token_per_seq(self) -> "RaggedBatch":
        """The batch as seen by a head given one row per sequence (the model already picked each
        sequence's last token): sequence b is row b alone."""
        b = self.num_seqs
        cu = torch.arange(b + 1, dtype=torch.int32, device=self.cu_seqlens.device)
        return RaggedBatch(input_ids=self.input_ids[:b], positions=self.positions[:b], seq_ids=cu[:-1], cu_seqlens=cu,
                           token_type_ids=None, max_seqlen=1, seq_lens_host=(1,) * len(self.seq_lens_host),
                           single_sequence=self.single_sequence, has_padding=False, uniform_seqlen=1)


def packed_size(num_tokens: int, num_seqs: int, with_types: bool) -> int:
    return (4 if with_types else 3) * num_tokens + num_seqs + 1


def pack(host: HostBatch, num_tokens: int | None = None, num_seqs: int | None = None, out: np.ndarray | None = None,
         longest: int | None = None) -> np.ndarray:
    """Lay a batch out as one int32 array [ids | positions | seq_ids | token_types? | cu_seqlens],
    padded to `num_tokens` tokens and `num_seqs` sequences (into `out` when given, e.g. a pinned
    staging buffer of `packed_size(...)` elements):

        ids        t0 t1 t2 u0 u1 | 0  0  0        (padding tokens: id 0)
        seq_ids     0  0  0  1  1 | 2  2  2        (the dummy sequence B = 2 owns the padding)
        cu_seqlens  0  3  5  8  8  8  8  8  8      (B real + dummy + empty ones up to num_seqs)

    With `longest` no dummy sequence is longer: the padding is spread over as many dummies as
    that takes (a graph captured for sequences of at most `longest` tokens replaying a batch of
    fewer tokens; graph_runner.py, "Covering"), e.g. longest = 2:

        seq_ids     0  0  0  1  1 | 2  2  3        cu_seqlens  0  3  5  7  8  8  8  8  8
    """
    t, b = host.num_tokens, host.num_seqs
    tb, bb = num_tokens or t, num_seqs or b
    pad = tb - t
    step = max(longest or pad, 1)
    dummies = -(-pad // step)
    if pad < 0 or bb < b + dummies:
        raise ValueError(f"bucket ({tb} tokens, {bb} sequences{f', at most {longest} tokens each' if longest else ''}) "
                         f"cannot hold {t} tokens in {b} sequences plus padding")
    with_types = host.token_type_ids is not None
    size = packed_size(tb, bb, with_types)
    if out is None:
        buf = np.empty(size, dtype=np.int32)
    else:
        assert out.shape == (size,) and out.dtype == np.int32, f"out must be int32 [{size}], got {out.dtype} {out.shape}"
        buf = out
    ids, pos, seq = buf[:tb], buf[tb : 2 * tb], buf[2 * tb : 3 * tb]
    cu = buf[-(bb + 1) :]
    cu[0] = 0
    if b == 1:  # the batch-1 hot path spares the numpy calls that cost most here (~1.5 us each)
        cu[1] = t
    else:
        np.cumsum(host.seq_lens, out=cu[1 : b + 1])
    count = _arange(max(tb, bb) + 1)
    if dummies > 1:
        cu[b + 1 : b + dummies] = t + step * count[1:dummies]  # all but the last dummy are full
    cu[b + dummies :] = tb
    ids[:t] = host.input_ids
    ids[t:] = 0
    if b == 1:  # the common batch-1 case: no repeats needed
        pos[:t] = count[:t]
        seq[:t] = 0
    else:
        pos[:t] = count[:t] - np.repeat(cu[:b], host.seq_lens)
        seq[:t] = np.repeat(count[:b], host.seq_lens)
    if dummies <= 1:  # every batch in its own bucket: one dummy, no division on the hot path
        pos[t:] = count[:pad]
        seq[t:] = b
    else:
        pos[t:] = count[:pad] % step
        seq[t:] = b + count[:pad] // step
    if with_types:
        buf[3 * tb : 3 * tb + t] = host.token_type_ids
        buf[3 * tb + t : 4 * tb] = 0
    return buf


_ARANGE = np.arange(0, dtype=np.int32)


def _arange(n: int) -> np.ndarray:
    """0, 1, ..., n-1 (int32) from one cached array: pack() runs on every batch's hot path."""
    global _ARANGE
    if _ARANGE.shape[0] < n:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int32)
        _ARANGE.setflags(write=False)
    return _ARANGE


def views(packed: torch.Tensor, num_tokens: int, num_seqs: int, with_types: bool, *, max_seqlen: int, seq_lens_host: tuple[int, ...], single_sequence: bool, uniform_seqlen: int = 0, has_padding: bool = False) -> RaggedBatch:
    """A RaggedBatch whose tensors are views into one packed buffer (see `pack`)."""
    t = num_tokens
    parts = packed.split([t, t, t] + ([t] if with_types else []) + [num_seqs + 1])
    return RaggedBatch(
        input_ids=parts[0], positions=parts[1], seq_ids=parts[2],
        token_type_ids=parts[3] if with_types else None, cu_seqlens=parts[-1],
        max_seqlen=max_seqlen, seq_lens_host=seq_lens_host, single_sequence=single_sequence, uniform_seqlen=uniform_seqlen, has_padding=has_padding,
    )


def to_device(host: HostBatch, device: torch.device, *, pin: bool = False) -> RaggedBatch:
    """The unpadded batch on `device`, moved in one transfer."""
    packed = torch.from_numpy(pack(host))
    if device.type == "cuda":
        packed = (packed.pin_memory() if pin else packed).to(device, non_blocking=pin)
    lens = tuple(int(x) for x in host.seq_lens)
    uniform = lens[0] if lens and all(n == lens[0] for n in lens) else 0
    return views(packed, host.num_tokens, host.num_seqs, host.token_type_ids is not None,
                 max_seqlen=host.max_seqlen, seq_lens_host=lens, single_sequence=host.num_seqs == 1, uniform_seqlen=uniform)
