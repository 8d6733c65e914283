"""Fused vocab-parallel argmax: greedy ids at tensor parallel size > 1 without gathering logits.

Each rank scans its logits shard once and keeps K (value, global id) candidates per row, one per
column slice; the candidates (not the logits) are all-gathered along dim 0; a small kernel picks
each row's winner. The result equals `torch.argmax` over the concatenated, unpadded vocabulary.

    local shard [B, S] (any row / column strides)       candidates [B, 2K] fp32
    cols 0 ........................ num_valid .. S      | v_0 .. v_{K-1} | id_0 .. id_{K-1} |
    | slice 0 | slice 1 | ... | slice K-1 | padding |     v_k, id_k = best of slice k
      (one program per (row, slice); padding columns and empty slices never win)

    all_gather_dim0 -> [tp*B, 2K], rank-major:  row r*B + b = rank r's candidates for row b
    pick: row b's winner over the tp*K candidates {r*B + b : r < tp} -> int64 id [B]

The order is a total order on (value, id): NaN first (all NaNs equal), then larger value, then
lower id; -0.0 == +0.0. It is computed on an int64 key, so any reduction split gives one answer:

    mag(x)   = bits(fp32 x) & 0x7FFFFFFF
    key32(x) = +mag(x) if the sign bit is clear, -mag(x) if set  (-0.0 and +0.0 both give 0),
               0x7FFFFFFF for every NaN                           (above +inf = 0x7F800000)
    packed   = key32 << 32 | (2^24 - 1 - id)          (max(packed) = the winner; ids < 2^24)
    padding  = INT64_MIN  (below -inf);  an all-padding slice writes the sentinel (-inf, 2^24)

fp32 holds every bf16 / fp16 / fp32 value and every id below 2^24 exactly, so candidates lose
nothing. NOTE: Triton's tl.max / tl.argmax on floats do not rank NaN this way; only the integer
max on `packed` is used.
"""

from __future__ import annotations

import torch

from florist.distributed import tp_size

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below are the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_LIMIT = 1 << 24  # candidate ids travel as fp32: exact below 2^24
_INT64_MIN = -(1 << 63)
_SLICE_ALIGN = 64  # slice starts stay 16-byte aligned for every dtype (vectorised loads)
_MAX_BLOCK = 4096
if triton is not None:  # globals a kernel reads must be constexpr
    _EMPTY = tl.constexpr(_INT64_MIN)


def default_num_slices(num_rows: int) -> int:
    """Programs (= candidates) per row: many at few rows so the GPU stays busy, 8 at many rows.
    Depends only on the row count, so every rank picks the same K for the all-gather."""
    k = 256 // max(num_rows, 1)
    return max(8, min(64, 1 << max(k.bit_length() - 1, 0)))  # a power of two in [8, 64]


def slice_size(num_valid: int, num_slices: int) -> int:
    per_slice = -(-num_valid // num_slices)
    return max(_SLICE_ALIGN, -(-per_slice // _SLICE_ALIGN) * _SLICE_ALIGN)


# ---------------------------------------------------------------------------------------------
# torch references (the CPU path and the test oracle): the same algorithm on int64 keys


def _pack(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    bits = values.float().view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    key = torch.where(bits < 0, -magnitude, magnitude).masked_fill_(magnitude > 0x7F800000, 0x7FFFFFFF)
    return (key.to(torch.int64) << 32).bitwise_or_(ID_LIMIT - 1 - ids.to(torch.int64))


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp32 values, int64 ids); INT64_MIN (nothing valid) becomes (-inf, ID_LIMIT)."""
    key = packed >> 32
    ids = ID_LIMIT - 1 - (packed - (key << 32))
    magnitude = key.abs()
    values = torch.where(key < 0, magnitude - (1 << 31), magnitude).to(torch.int32).view(torch.float32)
    empty = packed == _INT64_MIN
    return values.masked_fill(empty, float("-inf")), ids.masked_fill(empty, ID_LIMIT)


def local_argmax_candidates_ref(logits_shard, vocab_start: int, num_valid: int, num_slices: int) -> torch.Tensor:
    num_rows = logits_shard.shape[0]
    size = slice_size(num_valid, num_slices)
    ids = torch.arange(vocab_start, vocab_start + num_valid, device=logits_shard.device)
    packed = torch.full((num_rows, num_slices * size), _INT64_MIN, dtype=torch.int64, device=logits_shard.device)
    packed[:, :num_valid] = _pack(logits_shard[:, :num_valid], ids)
    values, ids = _unpack(packed.view(num_rows, num_slices, size).amax(dim=-1))
    return torch.cat([values, ids.float()], dim=1)


def pick_from_candidates_ref(candidates: torch.Tensor, num_ranks: int) -> torch.Tensor:
    num_slices = candidates.shape[1] // 2
    # [tp*B, 2K] rank-major -> [B, tp*K] pairs of one row side by side
    per_row = candidates.view(num_ranks, -1, 2, num_slices).permute(1, 2, 0, 3).flatten(2)
    values, ids = per_row[:, 0], per_row[:, 1]
    best = torch.where(ids < ID_LIMIT, _pack(values, ids.to(torch.int64)), _INT64_MIN).amax(dim=-1)
    return _unpack(best)[1].masked_fill_(best == _INT64_MIN, 0)  # 0 only if no rank had a valid column


# ---------------------------------------------------------------------------------------------
# public ops


def local_argmax_candidates(logits_shard: torch.Tensor, vocab_start: int, num_valid: int, *,
                            num_slices: int | None = None, use_kernel: bool | None = None) -> torch.Tensor:
    """logits_shard [B, S] (any strides; bf16/fp16/fp32) holding global ids [vocab_start,
    vocab_start + S), of which the first `num_valid` columns are real -> fp32 candidates [B, 2K].
    `use_kernel`: None = Triton on CUDA, torch elsewhere; True forces Triton (the interpreter)."""
    _check_shard(logits_shard, vocab_start, num_valid)
    num_slices = num_slices or default_num_slices(logits_shard.shape[0])
    if _use_kernel(use_kernel, logits_shard):
        return local_argmax_candidates_triton(logits_shard, vocab_start, num_valid, num_slices)
    return local_argmax_candidates_ref(logits_shard, vocab_start, num_valid, num_slices)


def pick_from_candidates(candidates: torch.Tensor, num_ranks: int | None = None, *,
                         use_kernel: bool | None = None) -> torch.Tensor:
    """candidates [tp*B, 2K] fp32, rank-major (as all_gather_dim0 leaves them) -> int64 ids [B].
    `num_ranks` defaults to the tensor-parallel size."""
    num_ranks = tp_size() if num_ranks is None else num_ranks
    _check_candidates(candidates, num_ranks)
    if _use_kernel(use_kernel, candidates):
        return pick_from_candidates_triton(candidates, num_ranks)
    return pick_from_candidates_ref(candidates, num_ranks)


def simulated_vocab_parallel_argmax(shards, vocab_starts, num_valids, *, num_slices: int | None = None,
                                    use_kernel: bool | None = None) -> torch.Tensor:
    """The distributed algorithm on one device: local step per shard, concatenation along dim 0
    (what the all-gather does), pick."""
    if not sum(num_valids):
        raise ValueError("no shard has a valid column; argmax over an empty vocabulary is undefined")
    num_slices = num_slices or default_num_slices(shards[0].shape[0])
    candidates = [local_argmax_candidates(s, start, n, num_slices=num_slices, use_kernel=use_kernel)
                  for s, start, n in zip(shards, vocab_starts, num_valids, strict=True)]
    return pick_from_candidates(torch.cat(candidates, dim=0), len(shards), use_kernel=use_kernel)


def _use_kernel(use_kernel: bool | None, t: torch.Tensor) -> bool:
    if use_kernel is None:
        return triton is not None and t.is_cuda
    if use_kernel and triton is None:
        raise RuntimeError("use_kernel=True needs triton; install it or pass use_kernel=None")
    return use_kernel


def _check_current_device(t: torch.Tensor) -> None:
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not t.is_cuda or t.device.index == torch.cuda.current_device(), (
        f"tensors are on {t.device} but the current CUDA device is {torch.cuda.current_device()}; "
        f"call torch.cuda.set_device({t.device}) first"
    )


def _check_shard(logits: torch.Tensor, vocab_start: int, num_valid: int) -> None:
    """Host-side checks only (shapes, dtypes, ints): no device sync, so safe in CUDA graphs."""
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"logits shard must be 2-D bf16/fp16/fp32; got {logits.dtype} {tuple(logits.shape)}; "
                         "upcast fp64 is not exact in fp32 candidates, cast the logits to fp32 first")
    if not 0 <= num_valid <= logits.shape[1] or vocab_start < 0:
        raise ValueError(f"num_valid {num_valid} must lie in [0, {logits.shape[1]}] and vocab_start {vocab_start} >= 0")
    if vocab_start + num_valid > ID_LIMIT:
        raise ValueError(f"token ids up to {vocab_start + num_valid - 1} do not fit the fp32 candidates "
                         f"(exact below 2^24 = {ID_LIMIT}); this vocabulary needs int64 candidate ids")


def _check_candidates(candidates: torch.Tensor, num_ranks: int) -> None:
    if candidates.dim() != 2 or candidates.dtype != torch.float32 or candidates.shape[1] % 2:
        raise ValueError(f"candidates must be fp32 [tp*B, 2K]; got {candidates.dtype} {tuple(candidates.shape)}")
    if num_ranks < 1 or candidates.shape[0] % num_ranks:
        raise ValueError(f"{candidates.shape[0]} candidate rows do not split over {num_ranks} ranks; "
                         "pass the all-gathered tensor and the tensor-parallel size")
    if not candidates.is_contiguous():
        raise ValueError("candidates must be contiguous (all_gather_dim0 / torch.cat output)")


# ---------------------------------------------------------------------------------------------
# Triton launchers (also called directly by the tests, under the interpreter on CPU)


def local_argmax_candidates_triton(logits, vocab_start: int, num_valid: int, num_slices: int) -> torch.Tensor:
    num_rows, num_cols = logits.shape
    assert logits.dtype in _FLOAT_DTYPES and vocab_start + num_valid <= ID_LIMIT, f"{logits.dtype}, ids up to {vocab_start + num_valid}"
    # Column offsets are int32 inside the kernel; row offsets are int64.
    assert max(num_cols - 1, 0) * logits.stride(1) < 2**31, f"column stride {logits.stride(1)} x {num_cols} columns overflows int32"
    _check_current_device(logits)
    out = torch.empty((num_rows, 2 * num_slices), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    size = slice_size(num_valid, num_slices)
    block = min(triton.next_power_of_2(size), _MAX_BLOCK)
    _local_candidates_kernel[(num_rows, num_slices)](
        logits, out, logits.stride(0), logits.stride(1), vocab_start, num_cols, num_valid, size,
        NUM_SLICES=num_slices, BLOCK=block, num_warps=min(8, max(1, block // 256)),
    )
    return out


def pick_from_candidates_triton(candidates: torch.Tensor, num_ranks: int) -> torch.Tensor:
    num_rows = candidates.shape[0] // num_ranks
    num_slices = candidates.shape[1] // 2
    _check_current_device(candidates)
    out = torch.empty(num_rows, dtype=torch.int64, device=candidates.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_ranks * num_slices)
    _pick_kernel[(num_rows,)](candidates, out, num_rows, num_ranks * num_slices,
                              NUM_SLICES=num_slices, BLOCK=block, num_warps=min(4, max(1, block // 128)))
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels (16777216 = ID_LIMIT: a literal, since a constexpr global on the left of an
# operator stays a constexpr under the interpreter)


@_jit
def _packed_key(x, ids):
    """fp32 values and int32 ids -> the int64 total-order key of the module docstring."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    key = tl.where(bits < 0, -magnitude, magnitude)
    key = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, key)
    return (key.to(tl.int64) << 32) | (16777215 - ids).to(tl.int64)


@_jit
def _unpacked_value(best):
    key = best >> 32
    magnitude = tl.where(key < 0, -key, key)
    bits = tl.where(key < 0, magnitude - (1 << 31), magnitude).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@_jit
def _local_candidates_kernel(logits_ptr, out_ptr, stride_row, stride_col, vocab_start, num_cols, num_valid, slice_size,
                             NUM_SLICES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    k = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    col_begin = k * slice_size
    # The load mask stops at a multiple of 16 when num_cols is one (padded shards are), so loads
    # vectorise; columns in [num_valid, num_cols) are read but masked out of the key.
    load_end = tl.minimum(col_begin + slice_size, num_cols)
    valid_end = tl.minimum(col_begin + slice_size, num_valid)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], _EMPTY, tl.int64)
    # Each lane keeps its own running best; `packed` is a total order, so max is exact.
    for start in range(col_begin, valid_end, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols * stride_col, mask=cols < load_end, other=0.0).to(tl.float32)
        packed = _packed_key(x, vocab_start + cols)
        best = tl.maximum(best, tl.where(cols < valid_end, packed, _EMPTY))
    top = tl.max(best, axis=0)
    empty = top == _EMPTY
    value = tl.where(empty, float("-inf"), _unpacked_value(top))
    gid = tl.where(empty, 16777216, 16777215 - (top - ((top >> 32) << 32)))
    out_row = out_ptr + row.to(tl.int64) * (2 * NUM_SLICES)
    tl.store(out_row + k, value)
    tl.store(out_row + NUM_SLICES + k, gid.to(tl.float32))


@_jit
def _pick_kernel(cand_ptr, out_ptr, num_rows, num_candidates, NUM_SLICES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)  # j = rank * K + slice
    in_range = j < num_candidates
    rank = j // NUM_SLICES
    offs = (rank.to(tl.int64) * num_rows + row) * (2 * NUM_SLICES) + j % NUM_SLICES
    value = tl.load(cand_ptr + offs, mask=in_range, other=float("-inf"))
    gid = tl.load(cand_ptr + offs + NUM_SLICES, mask=in_range, other=16777216).to(tl.int32)
    valid = in_range & (gid < 16777216)  # the sentinel of an empty slice never wins
    best = tl.max(tl.where(valid, _packed_key(value, gid), _EMPTY), axis=0)
    winner = 16777215 - (best - ((best >> 32) << 32))
    tl.store(out_ptr + row, tl.where(best == _EMPTY, 0, winner))
