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

    @property
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

    def cu_seqlens(self) -> np.ndarray:
        cu = np.zeros(self.num_seqs + 1, dtype=np.int32)
        np.cumsum(self.seq_lens, out=cu[1:])
        return cu

    def seq_ids(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), self.seq_lens)


def segment_ids(seq_lens: np.ndarray, first_segment_lens: np.ndarray) -> np.ndarray:
    """Per-token 0/1 segment ids: the first `first_segment_lens[i]` tokens of each sequence are 0."""
    starts = np.zeros(len(seq_lens), dtype=np.int32)
    np.cumsum(seq_lens[:-1], out=starts[1:])
    offsets = np.arange(int(seq_lens.sum()), dtype=np.int32) - np.repeat(starts, seq_lens)
    return (offsets >= np.repeat(first_segment_lens, seq_lens)).astype(np.int32)


@dataclass
class RaggedBatch:
    """Device-side view of a batch; passed explicitly down through the model (no globals).

    `seq_lens_host` and `max_seqlen` are host values fixed for the batch (for a CUDA graph, fixed
    for the bucket): backends may size grids from them but never read device values back.
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32 (int64 indexes cost nothing extra; int32 keeps one buffer)
    seq_ids: torch.Tensor  # [T] int32
    cu_seqlens: torch.Tensor  # [B+1] int32
    token_type_ids: torch.Tensor | None
    max_seqlen: int
    seq_lens_host: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1


def to_device(host: HostBatch, device: torch.device, *, pin: bool = False) -> RaggedBatch:
    """One packed transfer: [ids | positions | seq_ids | token_types? | cu_seqlens]."""
    t, b = host.num_tokens, host.num_seqs
    parts = [host.input_ids, host.positions(), host.seq_ids()]
    if host.token_type_ids is not None:
        parts.append(host.token_type_ids)
    parts.append(host.cu_seqlens())
    packed = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        if pin:
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=pin)
    views = packed.split([t, t, t] + ([t] if host.token_type_ids is not None else []) + [b + 1])
    return RaggedBatch(
        input_ids=views[0],
        positions=views[1],
        seq_ids=views[2],
        token_type_ids=views[3] if host.token_type_ids is not None else None,
        cu_seqlens=views[-1],
        max_seqlen=host.max_seqlen,
        seq_lens_host=tuple(int(x) for x in host.seq_lens),
    )
