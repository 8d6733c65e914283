"""Attention over short sequences of a flat ragged batch in one Triton launch.

    q [T, Hq, D], k/v [T, Hkv, D] (Hq = GROUPS * Hkv; any token / head strides, last dim
    contiguous: views of the fused qkv output), cu_seqlens int32 [B+1]  ->  out [T, Hq, D]

    grid (cdiv(max_seqlen, BLOCK_M), B, Hq / HEADS) (or, FLORIST_SHORT_SEQ_LAST, the last two
    swapped for B <= 2): program (m, b, h) holds the query rows
    cu[b] + m*BLOCK_M .. +BLOCK_M of HEADS query heads (1, or all GROUPS heads of a kv head:
    `pack_groups`, so a key tile is read once per group) and streams the keys of sequence b (kv
    head h*HEADS // GROUPS, read in place: grouped-query heads are never copied) in BLOCK_N tiles
    with an online softmax in fp32 (exp2, log2(e) folded into the scale):

        seq b      |<------------------ n_b = cu[b+1] - cu[b] ------------------>|
        query rows | m = 0 | m = 1 | ... |                 (programs past n_b return at once)
        key tiles  | j = 0 | j = 1 | ... |  causal: the loop stops at the program's last row

The key loop's bound is a run-time value, so its loads are software-pipelined (num_stages), and
query blocks run last to first, so under a causal mask the longest programs start first.
Tiles, warps, stages and packing come from `launch_config` (measured on the H200).

At batch 1 the whole problem is ~128 x 128 scores per head: cuDNN's SDPA costs ~7 us per call
there, varlen FlashAttention ~9 us; this kernel is one small launch of ~4 us and no memset. It
began as the short-sequence kernel and kept the name, but ragged batches of longer sequences
(graph buckets, up to 4,096 tokens a sequence) run faster on it than on varlen FlashAttention
too ("auto" in florist/layers/attention.py says where it runs).

Only host values size the launch (`max_seqlen`, the shapes), so it is capturable in a CUDA graph.
`max_seqlen` must bound every sequence's length (RaggedBatch.max_seqlen and the graph buckets do).
Rows past cu_seqlens[-1] (outside every sequence) are written as zeros, as the SDPA backend does.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from florist.kernels import pdl
from florist.kernels.online_softmax import online_softmax_step, online_softmax_step_scaled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

# NOTE: without triton the kernel below is a plain (never called) function; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # one [BLOCK_M, head_dim] fp32 accumulator per program must fit in registers
# The lean key loop for narrow heads in large batches (`launch_config`'s "lean"): scores scaled in
# the exponent's multiply-add (`online_softmax_step_scaled`) and, without a causal mask, masked
# only in a sequence's last, partial key tile. FLORIST_SHORT_LEAN=0 runs the loop as elsewhere.
LEAN_ENABLED = os.environ.get("FLORIST_SHORT_LEAN", "1") != "0"


def _lean_launch_from_env() -> tuple[int, int]:
    """FLORIST_SHORT_LEAN_LAUNCH=WARPS:MAXNREG, the warps a program and the register cap a thread
    (0: none) of the lean batch tiles' launches, for A/B runs (`bench/ab.py --env
    FLORIST_SHORT_LEAN_LAUNCH=4:0,4:128,8:0 -- python bench/engine.py --only minilm --no-baseline`;
    docs/benchmarks.md, "A register cap (timed, dropped)": alone, 4:128 and 8:0 were slower).
    Default 4:0, the sweep's pick."""
    value = os.environ.get("FLORIST_SHORT_LEAN_LAUNCH", "4:0").strip()
    try:
        warps, maxnreg = (int(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(f"FLORIST_SHORT_LEAN_LAUNCH={value!r}: expected WARPS:MAXNREG, e.g. 4:128 (MAXNREG 0: no cap)") from None
    if warps not in (1, 2, 4, 8, 16) or not (maxnreg == 0 or 24 <= maxnreg <= 255):
        raise ValueError(f"FLORIST_SHORT_LEAN_LAUNCH={value!r}: WARPS must be 1, 2, 4, 8 or 16 and MAXNREG 0 or 24..255")
    return warps, maxnreg


LEAN_WARPS, LEAN_MAXNREG = _lean_launch_from_env()
# A graph bucket of one sequence holds two sequence slots (the second an empty dummy), so the grid
# (query blocks, slots, head groups) interleaves each head group's real programs with as many that
# exit at once, and the block scheduler, filling one program an SM before a second, pairs real
# programs on one SM (the causal longest with each other among them) while others hold a dummy.
# FLORIST_SHORT_SEQ_LAST=1 orders the grid (query blocks, head groups, slots) for launches of at
# most two slots: the real programs first, one an SM where they fit; the bits are the same either
# way. Off, for A/B runs: at 1 x 512 in the step it cut the kernel from 14.3 to 11.3 us a launch,
# level with cuDNN there; nothing measurable at 128-256 tokens; MiniLM's 1 x 128 step lost 0.026 ms
# (docs/benchmarks.md, "The short kernel's slots last in its grid").
SEQ_LAST_ENABLED = os.environ.get("FLORIST_SHORT_SEQ_LAST", "0") != "0"
_LOG2E = 1.4426950408889634


def short_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                        scale: float) -> torch.Tensor:
    """Explicit softmax in fp32, one sequence at a time (reads cu_seqlens on the host: the CPU path
    and the test oracle, not capturable). Rows past cu_seqlens[-1] are zeros."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        if end <= start:
            continue
        qs = q[start:end].float().transpose(0, 1)  # [Hq, n, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale
        if causal:
            n = end - start
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        out[start:end] = (F.softmax(scores, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    return (
        q.dim() == 3 and k.dim() == 3 and k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
        and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and 0 < q.shape[2] <= MAX_HEAD_DIM
        and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
        and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
        and cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.device == q.device
    )


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Host-only check (shapes, strides, dtypes, device): whether the kernel runs these inputs."""
    return triton is not None and q.is_cuda and _supported(q, k, v, cu_seqlens)


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                    causal: bool, scale: float) -> torch.Tensor:
    """The kernel where it applies (CUDA, triton, fp16/bf16/fp32, last dim contiguous), else the
    reference."""
    if applies(q, k, v, cu_seqlens):
        return short_attention_triton(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    return short_attention_ref(q, k, v, cu_seqlens, causal, scale)


def launch_config(max_seqlen: int, head_dim: int, groups: int, num_tokens: int = 0, num_seqs: int = 1) -> dict:
    """Tiles, warps, stages and head packing for a launch over `num_seqs` sequence slots (a graph
    bucket's dummy and empty slots included) of at most `max_seqlen` tokens, `num_tokens` in all
    (padding included), from `bench/attention.py --sweep` on the H200, over single sequences and
    over graph buckets as the engine captures them (docs/benchmarks.md, "Attention backends" and
    "Ragged batches and graph buckets"; us per call in a CUDA graph):

    - head_dim <= 64 (all-MiniLM-L6-v2, 32): 64-row query tiles over 128-key tiles, 3 stages,
      within 4 % of the best configuration at every single sequence swept (1 x 64 ... 1 x 1024)
      and small batches; batches of >= 4,096 tokens of sequences of >= 128 tokens take 128-row
      query tiles over 64-key tiles (100 x 256: 55.5 us against 65.6), with the lean key loop
      (`lean`: the scale in the exponent's FMA, bidirectional masks on partial tiles only; 50 x 256
      on an H100: 27.9 us against 30.6), 4 warps and no register cap (FLORIST_SHORT_LEAN_LAUNCH
      changes both, for A/B runs);
    - wider heads (Qwen3, 128), one sequence (in a graph: one and its dummy) of <= 128 tokens:
      16-row query tiles over 128-key tiles (1 x 128: 4.10 us against 5.00 for 32 x 64 tiles);
    - wider heads, anything else: 32-row tiles, 64-key tiles, 3 stages, the query heads of a kv
      head packed into one program (1 x 512: 10.92 us against 17.46; batches of short sequences
      too: 100 x 128 68.6 us against 162.7 with the one-sequence tiles);
    - ... with 32-key tiles for batches of >= 4,096 tokens of sequences of <= 256 tokens (graph
      buckets, causal / bidirectional: 100 x 128 59.5 / 71.3 us against 69.5 / 76.5, 32 x 256
      52.9 / 66.8 against 58.2 / 71.8; smaller batches lost with them, 8 x 256 17.3 / 21.4
      against 16.7 / 17.6, and at 512 tokens a sequence the two are even)."""
    fit = max(16, triton.next_power_of_2(max(max_seqlen, 1)))
    if head_dim <= 64:
        if num_tokens >= 4096 and fit >= 128:
            config = dict(blocks=(128, 64), num_warps=LEAN_WARPS, num_stages=3, pack_groups=False, lean=LEAN_ENABLED)
            return config | ({"maxnreg": LEAN_MAXNREG} if LEAN_MAXNREG else {})
        return dict(blocks=(min(64, fit), min(128, fit)), num_warps=4, num_stages=3, pack_groups=False)
    if max_seqlen <= 128 and num_seqs <= 2:
        return dict(blocks=(16, min(128, fit)), num_warps=4, num_stages=2, pack_groups=False)
    block_n = 32 if max_seqlen <= 256 and num_tokens >= 4096 else 64
    return dict(blocks=(min(32, fit), min(block_n, fit)), num_warps=4, num_stages=3, pack_groups=groups > 1)


def seq_last_default(num_seqs: int) -> bool:
    """Whether a launch over `num_seqs` slots puts them last in its grid unless told: under
    FLORIST_SHORT_SEQ_LAST, for at most two slots."""
    return SEQ_LAST_ENABLED and num_seqs <= 2


def launch_grid(query_blocks: int, num_seqs: int, head_groups: int, seq_last: bool) -> tuple[int, int, int]:
    """(query blocks, slots, head groups), or with `seq_last` (query blocks, head groups, slots)."""
    return (query_blocks, head_groups, num_seqs) if seq_last else (query_blocks, num_seqs, head_groups)


def short_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                           causal: bool, scale: float, blocks: tuple[int, int] | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, pack_groups: bool | None = None, lean: bool | None = None,
                           maxnreg: int | None = None, seq_last: bool | None = None) -> torch.Tensor:
    """The kernel; `blocks` (BLOCK_M, BLOCK_N), `num_warps`, `num_stages`, `pack_groups` and
    `maxnreg` (registers a thread, 0: no cap) override `launch_config`'s choice (for
    `bench/attention.py --sweep`; None: the choice, which caps nothing unless
    FLORIST_SHORT_LEAN_LAUNCH asks). `pack_groups`: one program holds all the query heads of a kv
    head (GROUPS x BLOCK_M rows), so each key tile is read once per group instead of once per
    query head. `seq_last`: the grid's slots axis last (None: FLORIST_SHORT_SEQ_LAST, for at most
    two slots)."""
    assert _supported(q, k, v, cu_seqlens), (
        f"unsupported input: q {q.dtype} {tuple(q.shape)} strides {q.stride()}, k {k.dtype} {tuple(k.shape)} strides "
        f"{k.stride()}, v {v.dtype} {tuple(v.shape)} strides {v.stride()}, cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
    )
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not q.is_cuda or q.device.index == torch.cuda.current_device(), (
        f"tensors are on {q.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({q.device}) first"
    )
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if num_seqs == 0 or max_seqlen <= 0:
        return out.zero_()  # no sequence: every row is outside one
    groups = num_heads // k.shape[1]
    config = launch_config(max_seqlen, head_dim, groups, num_tokens, num_seqs)
    block_m, block_n = blocks if blocks is not None else config["blocks"]
    num_warps = config["num_warps"] if num_warps is None else num_warps
    num_stages = config["num_stages"] if num_stages is None else num_stages
    pack_groups = config["pack_groups"] if pack_groups is None else pack_groups
    lean = config.get("lean", False) if lean is None else lean
    maxnreg = config.get("maxnreg", 0) if maxnreg is None else maxnreg
    heads = groups if pack_groups else 1  # query heads per program
    seq_last = seq_last_default(num_seqs) if seq_last is None else seq_last
    grid = launch_grid(triton.cdiv(max_seqlen, block_m), num_seqs, num_heads // heads, seq_last)
    _short_attention_kernel[grid](
        q, k, v, out, cu_seqlens, num_tokens, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUPS=groups, HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, IEEE=q.dtype == torch.float32,
        FMA_SCALE=lean and q.dtype != torch.float32 and scale > 0, MASK_TAIL=lean and not causal, SEQ_LAST=seq_last,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(q), **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return out


@_jit
def _short_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, num_tokens, qk_scale,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            GROUPS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                            FMA_SCALE: tl.constexpr, MASK_TAIL: tl.constexpr, SEQ_LAST: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    # Query blocks are taken last to first: under a causal mask the last ones see the most keys,
    # so the longest programs start first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    # The grid is (query blocks, slots, head groups), or with SEQ_LAST (query blocks, head groups, slots).
    SEQ_AXIS: tl.constexpr = 2 if SEQ_LAST else 1
    HEAD_AXIS: tl.constexpr = 1 if SEQ_LAST else 2
    seq, head0 = tl.program_id(SEQ_AXIS), tl.program_id(HEAD_AXIS) * HEADS
    seq_start = tl.load(cu_ptr + seq)
    seq_end = tl.load(cu_ptr + seq + 1)
    n = seq_end - seq_start
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    out_row = HEAD_DIM * HEADS * tl.num_programs(HEAD_AXIS)  # out is contiguous [T, Hq, D]

    # The last sequence's programs also zero the rows after it (tokens outside every sequence),
    # strided over the m programs; without padding the loop does not run.
    if seq == tl.num_programs(SEQ_AXIS) - 1:
        pad = seq_end + m_block * BLOCK_M
        while pad < num_tokens:
            rows = pad + tl.arange(0, BLOCK_M)
            for g in tl.static_range(HEADS):
                ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_row + (head0 + g) * HEAD_DIM + offs_d[None, :]
                tl.store(ptrs, tl.zeros((BLOCK_M, BLOCK_D), out_ptr.dtype.element_ty), mask=(rows < num_tokens)[:, None] & d_ok[None, :])
            pad += tl.num_programs(0) * BLOCK_M

    row0 = m_block * BLOCK_M
    if row0 >= n:
        return
    # A program's rows: BLOCK_M tokens x HEADS query heads, row r = token r // HEADS of head
    # head0 + r % HEADS (HEADS = 1: one head, rows are tokens).
    r = tl.arange(0, BLOCK_M * HEADS)
    offs_m = row0 + r // HEADS
    head = head0 + r % HEADS
    m_ok = offs_m < n
    tok_m = (seq_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + (tok_m * stride_qt + head * stride_qh)[:, None] + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    kv_head = head0 // GROUPS
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    # NOTE: a finite floor for the running max: a row whose keys are all masked in a tile (or
    # everywhere: query rows past n, never stored) gives exp2(-inf - floor) = 0, never NaN, so
    # the shared step runs without its -inf guard (florist/kernels/online_softmax.py).
    m_i = tl.full((BLOCK_M * HEADS,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M * HEADS,), tl.float32)
    acc = tl.zeros((BLOCK_M * HEADS, BLOCK_D), tl.float32)
    hi = tl.minimum(n, row0 + BLOCK_M) if CAUSAL else n  # keys this program's rows may see
    # A run-time bound (not a constexpr trip count with tiles skipped inside): the loop's loads
    # can then be software-pipelined (num_stages).
    for col0 in range(0, hi, BLOCK_N):
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        tok_n = (seq_start + offs_n).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]  # masked loads: other sequences' rows (NaN or not) are never read
        k = tl.load(k_base + tok_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if not FMA_SCALE:
            s = s * qk_scale  # else the scale joins the exponent's multiply-add
        if MASK_TAIL:
            # No causal mask: only a sequence's last, partial tile has keys to hide. A uniform
            # branch, so whole tiles skip the select (docs/benchmarks.md: "... and the lean key loop").
            if col0 + BLOCK_N > n:
                s = tl.where(n_ok[None, :], s, float("-inf"))
        else:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + tok_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if FMA_SCALE:
            m_i, l_i, acc = online_softmax_step_scaled(s, qk_scale, v, m_i, l_i, acc)
        else:
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE, GUARD_NEG_INF=False)
    pdl.pdl_trigger(PDL)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    ptrs = out_ptr + (tok_m * out_row + head * HEAD_DIM)[:, None] + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
