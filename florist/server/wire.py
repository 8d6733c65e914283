"""Ragged token ids and dense matrices on the wire: bytes <-> numpy, with the server's checks.

    TokenBatch.ids       little-endian int32, all sequences back to back
    TokenBatch.seq_lens  little-endian int32, one per sequence
    Matrix               row-major little-endian data + dtype name + shape

Every check raises InputError with a message that says which sequence is wrong and how; the
service turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import numpy as np

from florist.text import InputError

INT32 = np.dtype("<i4")
MATRIX_DTYPES = {"float32": np.dtype("<f4"), "int8": np.dtype("i1"), "uint8": np.dtype("u1")}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}  # dtype.name is slow

try:  # protobuf >= 4.24; older runtimes cannot list unknown fields and skip that check
    from google.protobuf.unknown_fields import UnknownFieldSet
except ImportError:  # pragma: no cover
    UnknownFieldSet = None


def int32_bytes(values, what: str) -> np.ndarray:
    if len(values) % 4:
        raise InputError(f"{what} has {len(values)} bytes, not a multiple of 4; it must hold little-endian int32 values")
    # A copy: writable (torch.from_numpy warns on read-only arrays) and owned by the request.
    return np.frombuffer(values, dtype=INT32).astype(np.int32)


def decode_tokens(tokens, *, vocab_size: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """TokenBatch -> (ids int32 [T], seq_lens int32 [N]), checked against the model's limits."""
    lens = int32_bytes(tokens.seq_lens, "tokens.seq_lens")
    ids = int32_bytes(tokens.ids, "tokens.ids")
    if lens.size == 0:
        raise InputError("the request has no sequences (tokens.seq_lens is empty); send at least one")
    # This runs per request: for the usual few sequences, Python's min / max / sum over a list
    # cost less than numpy's reductions; numpy takes over for many.
    if lens.size <= 64:
        values = lens.tolist()
        low, high, total = min(values), max(values), sum(values)
    else:
        low, high, total = int(lens.min()), int(lens.max()), int(lens.sum(dtype=np.int64))
    if low < 1:
        i = int(lens.argmin())
        raise InputError(f"sequence {i} has length {int(lens[i])}; every sequence needs at least one token")
    if total != ids.size:
        raise InputError(f"tokens.seq_lens add up to {total} tokens but tokens.ids holds {ids.size} (4 bytes per id); they must match")
    if high > max_seq_len:
        i = int(lens.argmax())
        raise InputError(f"sequence {i} has {int(lens[i])} tokens; the model takes at most {max_seq_len}; truncate it before sending (the gateway's truncate=true)")
    # One reduction for both bounds: seen as uint32, a negative id is larger than any vocabulary.
    if ids.view(np.uint32).max() >= vocab_size:  # ids is not empty: every sequence has a token
        pos = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        starts = np.cumsum(lens, dtype=np.int64) - lens
        seq = int(np.searchsorted(starts, pos, side="right")) - 1
        raise InputError(f"sequence {seq} has token id {int(ids[pos])} at position {pos - int(starts[seq])}, outside the vocabulary [0, {vocab_size})")
    return ids, lens


def decode_first_segment_lens(values: bytes, seq_lens: np.ndarray) -> np.ndarray:
    first = int32_bytes(values, "first_segment_lens")
    if first.size != seq_lens.size:
        raise InputError(f"first_segment_lens has {first.size} entries for {seq_lens.size} pairs; send one per pair")
    bad = (first < 0) | (first > seq_lens)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InputError(f"pair {i} has first_segment_lens {int(first[i])}, outside [0, {int(seq_lens[i])}] (its length)")
    return first


def check_known_fields(message, what: str) -> None:
    """Fields this server does not know come from a newer client; refuse rather than ignore."""
    if UnknownFieldSet is None:
        return
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        raise InputError(f"{what} has fields unknown to this server (numbers {numbers}); the client speaks a newer florist.proto: upgrade the server or drop those options")


def encode_matrix(x: np.ndarray, matrix_cls) -> object:
    return fill_matrix(matrix_cls(), x)


def fill_matrix(m, x: np.ndarray):
    """Set a Matrix message's fields in place (e.g. a response's own `embeddings` field: no
    message built apart and then copied in); returns `m`."""
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise TypeError(f"cannot send a {x.dtype} matrix; florist.proto carries {sorted(MATRIX_DTYPES)}")
    m.data = np.ascontiguousarray(x, dtype=MATRIX_DTYPES[name]).tobytes()
    m.dtype = name
    m.shape.extend(x.shape)
    return m


def decode_matrix(m) -> np.ndarray:
    if m.dtype not in MATRIX_DTYPES:
        raise ValueError(f"unknown matrix dtype {m.dtype!r}")
    return np.frombuffer(m.data, dtype=MATRIX_DTYPES[m.dtype]).astype(m.dtype, copy=False).reshape(tuple(m.shape))


def encode_tokens(seqs, tokens_cls) -> object:
    """Client side: a list of id sequences, or (ids bytes, seq_lens) already packed."""
    if isinstance(seqs, tuple) and len(seqs) == 2 and isinstance(seqs[0], (bytes, bytearray, memoryview)):
        ids, lens = seqs
        lens_bytes = lens if isinstance(lens, (bytes, bytearray)) else np.asarray(lens, dtype=INT32).tobytes()
        return tokens_cls(ids=bytes(ids), seq_lens=bytes(lens_bytes))
    arrays = [np.asarray(s, dtype=INT32) for s in seqs]
    lens = np.fromiter((a.size for a in arrays), dtype=INT32, count=len(arrays))
    ids = np.concatenate(arrays).tobytes() if arrays else b""
    return tokens_cls(ids=ids, seq_lens=lens.tobytes())
