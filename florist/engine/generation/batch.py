"""Per-step metadata of a generation step, built on the host with numpy and moved in one copy.

A step's inputs travel as one int32 buffer (the same bytes rank 0 broadcasts to the other ranks):

    prefill  | ids T | positions T | seq_ids T | cu_seqlens B+1 | slot_mapping T |
    decode   | ids B | positions B | slots B+1 |        (slots[B]: the scratch slot, see below)

    slot_mapping[t] = slot * max_len + position   (row of the flat [slots * max_len, Hkv, D] cache)

Decode buffers are padded to a batch-size bucket. Padding rows use the scratch slot (the cache's
last one, never given to a sequence) at position 0, so they write only scratch k/v, attend only to
it, and their outputs are sliced off: harmless by construction. Everything else a decode step
needs (context lengths, cache offsets) is computed from these on the device, inside the graph.

A pipelined decode step (generator.py) is not packed on the host: `advance_decode` rewrites the
previous decode step's buffer on the device, in place (each sequence's new token, one position
later; slots and padding rows unchanged), so the host never needs the ids it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from florist.engine.batch import HostBatch, RaggedBatch, pack, views


@dataclass(kw_only=True)
class GenerationBatch(RaggedBatch):
    """A RaggedBatch (the prefill attention backends read its fields) plus where k/v go.

    Prefill: whole prompts, positions from 0; attention runs over the new tokens only (they are
    all there is in the slot). Decode: one token per sequence (cu_seqlens = 0, 1, .., B) that
    attends to `context_lens` cached tokens of its slot.
    """

    slot_mapping: torch.Tensor  # int64 [T]
    decode: bool = False
    slots: torch.Tensor | None = None  # decode: int64 [B]
    context_lens: torch.Tensor | None = None  # decode: int32 [B], this token included
    cache_starts: torch.Tensor | None = None  # decode: int32 [B+1] = slot * max_len (last: scratch)
    max_context_len: int = 0  # decode: host bound on context_lens (sizes the torch path)


# -- prefill -------------------------------------------------------------------------------------
def pack_prefill(prompts: list[list[int]], slots: list[int], max_len: int) -> np.ndarray:
    host = HostBatch.from_sequences(prompts)
    slot_mapping = np.repeat(np.asarray(slots, dtype=np.int32) * max_len, host.seq_lens) + host.positions()
    return np.concatenate([pack(host), slot_mapping])


def prefill_batch(packed: torch.Tensor, num_tokens: int, num_seqs: int, seq_lens: tuple[int, ...]) -> GenerationBatch:
    """Views into the packed prefill buffer (already on the device)."""
    return _with_slots(packed, num_tokens, num_seqs, max_seqlen=max(seq_lens), seq_lens_host=seq_lens, single_sequence=num_seqs == 1,
                       uniform_seqlen=seq_lens[0] if len(set(seq_lens)) == 1 else 0)


def _with_slots(packed: torch.Tensor, num_tokens: int, num_seqs: int, **facts) -> GenerationBatch:
    """The RaggedBatch views of a packed prefill buffer (batch.views, given the host facts that
    shape attention) plus its slot mapping, the buffer's last `num_tokens` values."""
    ragged = views(packed[:-num_tokens], num_tokens, num_seqs, False, **facts)
    fields = {name: getattr(ragged, name) for name in RaggedBatch.__dataclass_fields__}
    return GenerationBatch(**fields, slot_mapping=packed[-num_tokens:].long())


def pad_prefill(packed: np.ndarray, num_tokens: int, num_seqs: int, tokens: int, seqs: int, scratch_slot: int, max_len: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """A packed prefill buffer padded to a graph bucket of `tokens` tokens and `seqs` sequences
    (into `out` when given, e.g. a pinned staging buffer): the layout of `pack(host, tokens, seqs)`
    plus the slot mapping. The padding tokens form one dummy sequence whose k/v go to the scratch
    slot (positions 0, 1, ..), as a decode step's padding rows do; the sequences after it are empty.

        ids       t0 t1 t2 u0 u1 | 0  0  0          slot_mapping  a  a+1 a+2 b b+1 | s  s+1 s+2
        seq_ids    0  0  0  1  1 | 2  2  2          (s = scratch_slot * max_len)
        cu_seqlens 0  3  5  8  8  8  8  8  8
    """
    t, b, tb, bb = num_tokens, num_seqs, tokens, seqs
    pad = tb - t
    if pad < 0 or bb < b + (pad > 0) or pad > max_len:
        raise ValueError(f"bucket ({tb} tokens, {bb} sequences) cannot hold {t} tokens in {b} sequences plus a dummy of at most {max_len}")
    size = 4 * tb + bb + 1
    buf = np.empty(size, dtype=np.int32) if out is None else out
    assert buf.shape == (size,) and buf.dtype == np.int32, f"out must be int32 [{size}], got {buf.dtype} {buf.shape}"
    filler = np.arange(pad, dtype=np.int32)
    for part in range(3):  # ids, positions, seq_ids
        buf[part * tb : part * tb + t] = packed[part * t : (part + 1) * t]
    buf[t:tb], buf[tb + t : 2 * tb], buf[2 * tb + t : 3 * tb] = 0, filler, b
    cu = buf[3 * tb : 3 * tb + bb + 1]
    cu[: b + 1] = packed[3 * t : 3 * t + b + 1]
    cu[b + 1 :] = tb
    slots = buf[3 * tb + bb + 1 :]
    slots[:t] = packed[3 * t + b + 1 :]
    slots[t:] = scratch_slot * max_len + filler
    return buf


def padded_prefill_batch(packed: torch.Tensor, tokens: int, seqs: int, max_seqlen: int, exact_single: bool) -> GenerationBatch:
    """Views into a prefill buffer padded to a graph bucket (`pad_prefill`), on the device. Only
    bucket-wide facts shape it, as in the embedding engine's graphs (graph_runner.py): no host
    sequence lengths, and `single_sequence` only where the bucket holds one sequence."""
    return _with_slots(packed, tokens, seqs, max_seqlen=max_seqlen, seq_lens_host=(), single_sequence=seqs == 2, has_padding=not exact_single)


def prefill_seq_lens(packed: np.ndarray, num_tokens: int, num_seqs: int) -> tuple[int, ...]:
    """Sequence lengths read back from a packed prefill buffer (the other ranks get only bytes)."""
    cu = packed[3 * num_tokens : 3 * num_tokens + num_seqs + 1]
    return tuple(int(x) for x in np.diff(cu))


# -- decode --------------------------------------------------------------------------------------
def pack_decode(tokens: list[int], positions: list[int], slots: list[int], num_rows: int, scratch_slot: int) -> np.ndarray:
    """| ids | positions | slots + scratch | padded to `num_rows` rows (see the module docstring)."""
    b = len(tokens)
    buf = np.zeros(3 * num_rows + 1, dtype=np.int32)
    buf[:b] = tokens
    buf[num_rows : num_rows + b] = positions
    buf[2 * num_rows : 2 * num_rows + b] = slots
    buf[2 * num_rows + b :] = scratch_slot
    return buf


def decode_batch(packed: torch.Tensor, num_rows: int, max_len: int, max_context_len: int) -> GenerationBatch:
    """Device-side decode metadata from the packed buffer; only device ops (CUDA-graph safe)."""
    ids, positions, slots = packed.split([num_rows, num_rows, num_rows + 1])
    cu_seqlens = torch.arange(num_rows + 1, dtype=torch.int32, device=packed.device)
    return GenerationBatch(
        input_ids=ids, positions=positions, seq_ids=cu_seqlens[:-1], cu_seqlens=cu_seqlens, token_type_ids=None,
        max_seqlen=1, seq_lens_host=(), decode=True,
        slot_mapping=slots[:-1].long() * max_len + positions.long(),
        slots=slots[:-1].long(), context_lens=positions + 1, cache_starts=slots * max_len, max_context_len=max_context_len,
    )


def advance_decode(packed: torch.Tensor, next_ids: torch.Tensor, num_rows: int, num_seqs: int) -> None:
    """In place on the device: the decode buffer that produced `next_ids` becomes the next step's.

        ids[:B] <- next_ids[:B]      positions[:B] += 1      slots, padding rows: unchanged

    Padding rows keep scratch slot, position 0 (adding 1 there would walk them out of the slot).
    Queued on the current stream after the step that wrote `next_ids`: no host sync.
    """
    packed[:num_seqs].copy_(next_ids[:num_seqs])
    packed[num_rows : num_rows + num_seqs].add_(1)
