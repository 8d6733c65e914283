"""Mean pooling over a ragged batch in one kernel: torch reference and a Triton kernel.

    hidden [T, H], cu_seqlens [B+1]  ->  out [B, H] fp32,  out[b] = sum(hidden[cu[b]:cu[b+1]]) / n_b
                                                           (n_b = max(length, 1); sqrt(n_b) for
                                                            sentence-transformers' mean_sqrt_len)

The torch path (zeros, cast, index_add, lengths, divide) is ~6 launches; at batch 1 on a small
model each costs as much as a matrix product. The kernel is one launch:

    grid (B, H / BLOCK_H, splits): program (b, h, s) sums tokens [cu[b] + s*SPAN, ...+SPAN) of
    sequence b in columns h, BLOCK_T rows a load, scaled by 1 / n_b; with one split it stores,
    with more it adds atomically into a zeroed output (splits = max_seqlen / SPAN, a host value:
    graph-safe).

The kernel's loads are latency-bound (each program's next load waits for its sum), so `pick`
reads as many rows a load as a sequence has, up to 256, in 64-column programs (more programs
a sequence, fewer rounds each): on the H200 2.4-4.8x faster than 32 rows a load in 128-column
programs (`python bench/fused_kernels.py --pooling --sweep`, docs/benchmarks.md, "Mean pooling").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from florist.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PoolConfig:
    span: int  # most tokens one program sums; longer sequences are split (atomic adds)
    block_t: int  # rows a load
    block_h: int  # columns a program
    num_warps: int

    def __post_init__(self):
        for name in ("span", "block_t", "block_h"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two; got {v}")
        if self.span < self.block_t:
            raise ValueError(f"span {self.span} must hold at least one load of {self.block_t} rows")

    @classmethod
    def parse(cls, text: str) -> "PoolConfig":
        """SPANxBLOCK_TxBLOCK_HxWARPS, e.g. 256x32x128x4."""
        try:
            return cls(*(int(v) for v in text.lower().split("x")))
        except (TypeError, ValueError) as e:
            raise ValueError(f"a pooling configuration is SPANxBLOCK_TxBLOCK_HxWARPS (e.g. 256x32x128x4); got {text!r}: {e}") from None


# The configuration before `pick` (rows of 32 a load, 128-column programs), for side-by-side runs.
BEFORE = PoolConfig(256, 32, 128, 4)
# FLORIST_POOL_CONFIG=SPANxBLOCK_TxBLOCK_HxWARPS fixes the configuration for every batch (A/B
# measurements, e.g. 256x32x128x4 for BEFORE); unset or "pick", `pick` chooses.
_FORCED = None if os.environ.get("FLORIST_POOL_CONFIG", "pick").strip().lower() in ("", "pick") else PoolConfig.parse(os.environ["FLORIST_POOL_CONFIG"])


# Programs below which a few long sequences are split in spans (the H200's multiprocessors).
_FILL_PROGRAMS = 132


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); without triton, for CPU-only installs."""
    return 1 << (max(n, 1) - 1).bit_length()


def pick(max_seqlen: int, h: int, num_seqs: int = 1 << 30) -> PoolConfig:
    """The launch configuration for `num_seqs` sequences of at most `max_seqlen` tokens of `h`
    columns: a sequence's rows in as few loads as fit (up to 256 rows a load, 64 columns a
    program); a few sequences of 257-1,024 tokens are split in 64-token spans, so that they
    still fill the device (`python bench/fused_kernels.py --pooling --sweep`: 1 x 512 tokens of
    pplx-embed 4.2 us against 5.8 in 256-token spans)."""
    if _FORCED is not None:
        return _FORCED
    n = max(16, next_power_of_2(max_seqlen))
    if 256 < n <= 1024 and num_seqs * -(-h // 64) < _FILL_PROGRAMS:
        return PoolConfig(64, 64, 64, 4)
    block_t = min(256, n)
    return PoolConfig(span=block_t, block_t=block_t, block_h=64, num_warps=4)


def segment_mean_ref(hidden: torch.Tensor, seq_ids: torch.Tensor, cu_seqlens: torch.Tensor, sqrt_len: bool = False) -> torch.Tensor:
    """Tokens whose seq_id is >= B (padding) are ignored."""
    b = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    lens = (cu[1:] - cu[:-1]).clamp(min=1).float().unsqueeze(1)
    sums = torch.zeros(b + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_ids.long().clamp(max=b), hidden.float())
    return sums[:b] / (lens.sqrt() if sqrt_len else lens)


def segment_mean(hidden: torch.Tensor, seq_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, sqrt_len: bool = False) -> torch.Tensor:
    if triton is not None and hidden.is_cuda and hidden.dtype in _DTYPES and hidden.dim() == 2 and hidden.stride(1) == 1:
        return segment_mean_triton(hidden, cu_seqlens, max_seqlen, sqrt_len)
    return segment_mean_ref(hidden, seq_ids, cu_seqlens, sqrt_len)


def segment_mean_triton(hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, sqrt_len: bool = False,
                        config: PoolConfig | None = None) -> torch.Tensor:
    """`max_seqlen` must bound every sequence's length (RaggedBatch.max_seqlen does); `config`:
    `pick`'s unless given."""
    assert hidden.dim() == 2 and hidden.stride(1) == 1 and hidden.dtype in _DTYPES, f"unsupported hidden {hidden.dtype} {tuple(hidden.shape)}"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, "cu_seqlens: int32 [B+1]"
    assert not hidden.is_cuda or hidden.device.index == torch.cuda.current_device(), (
        f"tensors are on {hidden.device} but the current CUDA device is {torch.cuda.current_device()}"
    )
    b, h = cu_seqlens.shape[0] - 1, hidden.shape[1]
    c = config or pick(max_seqlen, h, b)
    splits = max(1, triton.cdiv(max_seqlen, c.span))
    out = (torch.zeros if splits > 1 else torch.empty)((b, h), dtype=torch.float32, device=hidden.device)
    if b == 0 or h == 0:
        return out
    _segment_mean_kernel[(b, triton.cdiv(h, c.block_h), splits)](
        hidden, cu_seqlens, out, h, hidden.stride(0),
        SPAN=c.span, BLOCK_T=c.block_t, BLOCK_H=c.block_h, ATOMIC=splits > 1, SQRT_LEN=sqrt_len, num_warps=c.num_warps,
        **pdl.launch_args(hidden),
    )
    return out


@_jit
def _segment_mean_kernel(x_ptr, cu_ptr, out_ptr, H, stride_t,
                         SPAN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ATOMIC: tl.constexpr, SQRT_LEN: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    seq, hb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_start = tl.load(cu_ptr + seq)
    seq_end = tl.load(cu_ptr + seq + 1)
    start = seq_start + split * SPAN
    end = tl.minimum(seq_end, start + SPAN)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for t0 in range(0, SPAN, BLOCK_T):  # a fixed trip count; rows past the sequence are masked
        rows = start + t0 + tl.arange(0, BLOCK_T)
        mask = (rows < end)[:, None] & col_ok[None, :]
        tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    pdl.pdl_trigger(PDL)
    n = tl.maximum(seq_end - seq_start, 1).to(tl.float32)
    scale = 1.0 / tl.sqrt(n) if SQRT_LEN else 1.0 / n
    if ATOMIC:
        tl.atomic_add(out_ptr + seq * H + cols, acc * scale, mask=col_ok)
    else:
        tl.store(out_ptr + seq * H + cols, acc * scale, mask=col_ok)
