"""Matrix products with few rows ("skinny M"): y = x @ w.T (+ bias), optionally with SwiGLU fused.

At batch 1 an embedding request is 64-512 tokens and a decode step is 1-32 rows, so every linear
layer is a weight-streaming problem: the [N, K] weight is read once and the x rows are tiny. The
floor is the weight bytes over the memory bandwidth. cuBLAS picks split-K kernels there that
reach ~1.2 TB/s on the H200 (docs/benchmarks.md). This kernel tiles only N (and optionally K),
so a grid of about one program per SM or more streams the weight:

    grid = (N / BLOCK_N, SPLIT_K, M / BLOCK_M)
    program (n, s, m):  acc[BLOCK_M, BLOCK_N] = x[m rows, K slice s] @ w[n rows, K slice s].T

    SPLIT_K = 1:  the program applies the epilogue (bias, or silu(gate) * up) and stores y;
    SPLIT_K > 1:  it stores fp32 partials [SPLIT_K, M, N]; `split_k._reduce_kernel` sums them in a fixed
                  order (deterministic, unlike atomics), adds the bias and casts.

Deferred reduction (`defer_reduce=True`): where split-K runs, the product returns its partials
unreduced as `SplitKPartials`, and the add + RMSNorm that follows o_proj and down_proj in Qwen3
sums them in its own prologue (`florist.kernels.norms.add_rms_norm`), so the product costs one
launch, not two. Same bits as reducing first: the norm kernel sums in the same order, adds the
bias and rounds to the activation dtype exactly where `_reduce_kernel` does.

Product + add + RMSNorm in one launch (`skinny_gemm_add_rms_norm`, for <= FUSED_NORM_MAX_ROWS
rows: decode): the norm runs inside the product's launch, so the norm's launch goes too. Each
program stores its fp32 partial tile, then counts itself done on its row block's counter; the
last one to finish reads every partial back and runs the norm kernel's own row code on them:

    program (n, s):  partials[s, rows, n tile] = x @ w.T over K slice s;  atomic count += 1
    last program:    counter = 0 (ready for the next launch); for each tile of rows:
                     x = (p[0] + ... + p[S-1] + bias) -> dtype;  summed = x + residual -> dtype
                     out = rms_norm(summed) * norm_weight           (norms._add_rms_norm_partial_rows)

Same bits as the two launches it replaces (the product's partials, then `norms.add_rms_norm`):
the K loop is one shared function (`_k_slice_product`), the row code is the norm kernel's, and the
launch takes the norm kernel's row tiles and warps, so a row's sum of squares is split over the
threads as it is there (so the product runs with 8 warps at N = 1024, not the 4 it was measured
with). NOTE: on the H200 the one launch took 6.19 us at one row against 3.62 + 2.17 us for the
two it replaces: not yet a gain (docs/benchmarks.md, "Generation"). The counters are one
persistent int32 buffer per device, made on the first (eager) call and left at 0 by every
launch, so CUDA graphs replay them as they are.
NOTE: launches sharing a device must not run concurrently (one stream), as they share counters.

Fused SwiGLU (`silu_mul=True`): w is MergedColumnParallelLinear's [gate (I) | up (I)] weight; a
program reads the gate rows n.. and the up rows I+n.. of the same K slice into two accumulators
and stores silu(gate) * up: [M, I]. The [M, 2I] projection is never written, and one launch
disappears per layer.

Which configuration runs for a shape is `pick_config` (measured on the H200 by
`bench/gemm.py`); shapes it does not cover return None and the caller uses cuBLAS (F.linear).
NOTE: the weight-bandwidth floor is not what limits these products: inside a CUDA graph every
kernel costs ~5 us however few bytes it reads, so the kernel wins where cuBLAS picks a poor
split (one row) and where fusing SwiGLU removes a launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from florist.kernels import norms, pdl, wide_gemm
from florist.kernels.activation import gelu as gelu_pass, gelu_exact, silu_and_mul, swiglu_tile
from florist.kernels.launch_counters import LaunchCounters
from florist.kernels.split_k import SplitKPartials, reduce_partials_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

# NOTE: without triton the kernels below are plain (never called) functions; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_DTYPES = (torch.float16, torch.bfloat16)
_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # a norm weight's or bias' dtype
# FLORIST_SKINNY_GEMM=0 sends every product to cuBLAS (for side-by-side measurements).
ENABLED = os.environ.get("FLORIST_SKINNY_GEMM", "1") != "0"
# FLORIST_TMA_GEMM=0 keeps the pointer kernel and cuBLAS where the TMA form would run (A/B runs).
TMA_ENABLED = os.environ.get("FLORIST_TMA_GEMM", "1") != "0"
# The product + add + RMSNorm launch (`skinny_gemm_add_rms_norm`) is for decode-sized products:
# its last program reduces and normalises every row alone, so it takes few rows, and whole rows
# of at most this many columns (held in that program's registers).
FUSED_NORM_MAX_ROWS = 4
# FLORIST_FUSED_NORM=0: the model never takes the one launch (product and norm launch apart), for A/B runs.
FUSED_NORM_ENABLED = os.environ.get("FLORIST_FUSED_NORM", "1") != "0"
# NOTE: 2048, not the 8192 a program's registers could hold: up to 2048 columns the launch takes
# the norm kernel's 8 warps, and the product compiled that way was checked (sm_90 PTX) to run the
# same tensor-core steps in the same order as `_gemm_kernel` at its 4, so the fused result has the
# same bits as the two launches; at 16 warps (wider rows) the product's layout differs.
FUSED_NORM_MAX_COLS = 2048


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # the Hopper form (`_tma_gemm_kernel`): operands by TMA, no bias, no GELU


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                    gelu: bool = False) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    if gelu:
        return F.gelu(y)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


def pick_config(m: int, n: int, k: int, silu_mul: bool = False, gelu: bool = False, deferred: bool = False,
                tma: bool = False) -> GemmConfig | None:
    """The configuration for a [m, k] x [n, k].T product, or None where cuBLAS is as fast.
    `tma`: the Hopper form may run (`tma_applies`); where `pick_tma` has a configuration for the
    shape, it is taken.

    Measured with `bench/gemm.py --sweep` on the H200 (docs/benchmarks.md, "Skinny matrix
    products"); every configuration below is the sweep's best (or within 0.3 us of it) for the
    shapes named. Inside a CUDA graph any product costs >= ~5 us, so these win microseconds:
      rows <= 64 and ...
      - gate/up + SwiGLU (Qwen3 6144 x 1024): 7.1 vs 7.6 us at 1 row, 6.8 vs 7.9 at 64 rows (the
        cuBLAS figure includes the separate SwiGLU kernel this one makes unnecessary);
      - narrow output, long K (Qwen3 o 1024 x 2048, down 1024 x 3072; split K 4): 5.4 vs 12.7 us
        and 6.2 vs 7.5 at 1 row (cuBLAS picks a poor kernel for M = 1), 6.4 vs 7.9 for down at 64;
      - short K (all-MiniLM-L6-v2, K = 384): 2.4-3.1 vs 2.8-3.5 us.
      - short K with GELU fused (all-MiniLM-L6-v2's 1536 x 384 up projection) up to 128 rows:
        4.0 us at 128 rows against 5.4 us for cuBLAS plus the separate GELU kernel (at 256 rows
        the kernel loses: 6.4 against 5.7 us).
      64 < rows <= 128, with the split-K reduction deferred to the norm after the product
      (`deferred`: o_proj and down_proj, RowParallelLinear.forward_deferred):
      - narrow output, long K (Qwen3 o, down): 4.6 vs 6.1 us and 5.7 vs 8.1 us at 128 rows
        (64 x 64 tiles, K split 4); reduced in its own launch it would not win.
    Qwen3's qkv (4096 x 1024) and the LM head stay with cuBLAS (it is as fast or faster), and
    above 64 rows cuBLAS' tensor-core tiles win every other shape measured (gate/up + SwiGLU:
    8.5 vs 8.3 us at 128 rows, 15.0 vs 13.8 at 512; o and down at 512 rows: 7.4 vs 6.0, 8.8 vs 8.0).
    """
    if tma and (config := pick_tma(m, n, k, silu_mul, deferred)) is not None:
        return config
    if gelu and k <= 512 and 64 < m <= 128:
        return GemmConfig(128, 16, 128, 1, 4, 4)
    if deferred and 64 < m <= 128 and k >= 2048 and n <= 2048 and not (silu_mul or gelu):
        return GemmConfig(64, 64, 128, 4, 4, 3)
    if m > 64:
        return None
    small = m <= 16
    bm = 16 if small else 64
    if silu_mul:
        return GemmConfig(bm, 32, 256, 1, 4, 3) if small else GemmConfig(bm, 32, 128, 1, 4, 4)
    if n <= 512 and k >= 1024 and not gelu:  # all-MiniLM-L6-v2's down projection
        return GemmConfig(bm, 32, 256, 4, 4, 3) if small else GemmConfig(bm, 16, 128, 4, 4, 4)
    if k >= 2048 and n <= 2048 and not gelu:
        return GemmConfig(bm, 32, 128, 4, 4, 5) if small else GemmConfig(bm, 32, 128, 4, 4, 4)
    if k <= 512:
        return GemmConfig(bm, 32, 128, 1, 4, 4) if small else GemmConfig(bm, 16, 128, 1, 4, 4)
    return None


TMA_KINDS = ("swiglu", "narrow", "wide")


@dataclass(frozen=True)
class TmaRule:
    """One rule of FLORIST_TMA_CONFIG: products of `kind` with lo..hi rows (both included) run
    `config`, or leave the Hopper form (None: the pointer kernel's table or cuBLAS)."""
    kind: str
    lo: int
    hi: int
    config: GemmConfig | None


def parse_tma_rules(text: str) -> tuple[TmaRule, ...]:
    """FLORIST_TMA_CONFIG's text: "pick" (or empty) for `pick_tma`'s own table, else rules
    separated by ";", each KIND:LO-HI=BMxBNxBK/SPLIT/WARPS/STAGES or KIND:LO-HI=off, where KIND
    is swiglu (gate/up with SwiGLU), narrow (o / down, their reduction deferred to the norm) or
    wide (qkv: N >= 2K). E.g. "narrow:257-512=128x128x64/4/8/4"."""
    text = text.strip()
    if text.lower() in ("", "pick"):
        return ()
    rules = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            head, value = part.split("=")
            kind, rows = head.split(":")
            lo, hi = (int(v) for v in rows.split("-"))
            if value.strip().lower() == "off":
                config = None
            else:
                tiles, split, warps, stages = value.split("/")
                bm, bn, bk = (int(v) for v in tiles.lower().split("x"))
                config = GemmConfig(bm, bn, bk, int(split), int(warps), int(stages), tma=True)
        except ValueError:
            raise ValueError(f"FLORIST_TMA_CONFIG rule {part!r}: expected KIND:LO-HI=BMxBNxBK/SPLIT/WARPS/STAGES or "
                             f"KIND:LO-HI=off, e.g. narrow:257-512=128x128x64/4/8/4") from None
        kind = kind.strip().lower()
        if kind not in TMA_KINDS:
            raise ValueError(f"FLORIST_TMA_CONFIG rule {part!r}: KIND must be one of {', '.join(TMA_KINDS)}")
        if not 1 <= lo <= hi:
            raise ValueError(f"FLORIST_TMA_CONFIG rule {part!r}: rows LO-HI need 1 <= LO <= HI")
        if config is not None:
            pow2 = lambda v, lo_, hi_: lo_ <= v <= hi_ and v & (v - 1) == 0  # noqa: E731
            if not (pow2(config.block_m, 16, 256) and pow2(config.block_n, 16, 256) and pow2(config.block_k, 16, 256)):
                raise ValueError(f"FLORIST_TMA_CONFIG rule {part!r}: tiles must be powers of two from 16 to 256")
            if not (config.split_k >= 1 and config.num_warps in (1, 2, 4, 8, 16) and 1 <= config.num_stages <= 8):
                raise ValueError(f"FLORIST_TMA_CONFIG rule {part!r}: SPLIT >= 1, WARPS 1/2/4/8/16, STAGES 1-8")
        rules.append(TmaRule(kind, lo, hi, config))
    return tuple(rules)


# FLORIST_TMA_CONFIG puts rules before `pick_tma`'s table (the first rule matching a product's
# kind and rows wins), so bench/ab.py can time a configuration in the engine without editing the
# table: `python bench/ab.py --env FLORIST_TMA_CONFIG=pick,narrow:257-512=128x128x64/4/8/4 --
# python bench/engine.py --only breakdown --breakdown-tokens 384,512 --no-baseline`. Read at import.
TMA_RULES = parse_tma_rules(os.environ.get("FLORIST_TMA_CONFIG", "pick"))


def tma_kind(n: int, k: int, silu_mul: bool = False, deferred: bool = False) -> str | None:
    """Which of `pick_tma`'s kinds a product is: gate/up with SwiGLU, a narrow output over a long
    K whose reduction the caller defers (o, down), a wide output (qkv), or none of them."""
    if silu_mul:
        return "swiglu"
    if deferred and k >= 2048 and n <= 2048:
        return "narrow"
    if n >= 2 * k:
        return "wide"
    return None


def pick_tma(m: int, n: int, k: int, silu_mul: bool = False, deferred: bool = False) -> GemmConfig | None:
    """The Hopper form's configuration for a shape, or None where the pointer kernel or cuBLAS is
    as fast. `bench/gemm.py --tma --sweep` on the H200 (docs/benchmarks.md, "Skinny products by TMA"),
    us per call in a CUDA graph, weights from HBM, against what ran before:
      - gate/up + SwiGLU (Qwen3 6144 x 1024): 6.1 vs 6.6 (pointer kernel) at 64 rows, 7.3 vs 8.4
        (cuBLAS + the SwiGLU kernel) at 128, 9.2 vs 10.3 at 256, 12.0 vs 12.4 at 384, 13.4 vs
        15.1 at 512 (9.6 vs 9.4 at 192: cuBLAS kept there);
      - wide output (Qwen3 qkv 4096 x 1024): 4.8 vs 5.3 (cuBLAS) at 64 rows, 5.4 vs 5.3 at 128
        (kept: a wash to 0.01 ms in the engine, where its launch is programmatic), 8.9 vs 9.3
        at 512 (cuBLAS kept at 129-448: 6.95 vs 6.84 at 256, 8.3 vs 7.6 at 384);
      - narrow output, long K, reduction deferred to the norm (Qwen3 o 1024 x 2048, down 1024 x
        3072): 4.4 vs 4.6 and 5.0 vs 5.5 (the pointer kernel, K split 4) at 128 rows; 4.9 vs 6.5
        and 6.0 vs 8.0 (cuBLAS, not split) at 192, 5.0 vs 6.8 and 6.1 vs 8.0 at 256, the norm
        after them summing 2-4 MB of fp32 partials (measured in the engine: docs/benchmarks.md);
        at 384-512 rows, K split 2, they added 0.12-0.18 ms to the engine's step against cuBLAS
        onto the residual (docs/benchmarks.md, "o and down at 257-512 rows by TMA"), and 128 x 128
        tiles split 4 added 0.17 ms at 512 (an H100: "A 512-row layer with every edge
        programmatic"), so none there.
    FLORIST_TMA_CONFIG's rules (`TMA_RULES`) come first; a configuration whose K does not split
    into whole blocks is never run (None), the rules' included."""
    kind = tma_kind(n, k, silu_mul, deferred)
    rule = next((r for r in TMA_RULES if r.kind == kind and r.lo <= m <= r.hi), None)
    config = rule.config if rule is not None else _tma_table(m, kind)
    return config if config is not None and k % (config.split_k * config.block_k) == 0 else None


def _tma_table(m: int, kind: str | None) -> GemmConfig | None:
    """`pick_tma`'s measured table, by kind and rows."""
    if not 32 < m <= 512:
        return None
    if kind == "swiglu":
        if m <= 64:
            return GemmConfig(64, 32, 128, 1, 4, 5, tma=True)
        if m <= 128:
            return GemmConfig(64, 32, 128, 1, 4, 3, tma=True)
        if m <= 192:
            return None  # 9.6 vs 9.4 us at 192 rows
        if m <= 256:
            return GemmConfig(128, 64, 64, 1, 8, 5, tma=True)
        return GemmConfig(128, 32, 64, 1, 4, 3, tma=True)
    if kind == "narrow":
        if m <= 64:
            return None
        if m <= 128:
            return GemmConfig(64, 64, 128, 4, 4, 5, tma=True)
        if m <= 192:
            return GemmConfig(64, 32, 128, 4, 4, 3, tma=True)
        if m <= 256:
            return GemmConfig(64, 64, 128, 2, 4, 5, tma=True)
        return None
    if kind == "wide" and m <= 128:
        return GemmConfig(64, 64, 128, 1, 4, 5, tma=True)
    if kind == "wide" and 448 < m:  # 8.3 vs 7.6 us at 384 rows: cuBLAS below
        return GemmConfig(128, 128, 64, 1, 4, 5, tma=True)
    return None


def tma_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, gelu: bool = False) -> bool:
    """Host-side checks only (safe in CUDA graphs): the Hopper form can run this product (a
    Hopper-class device, a Triton with host-side tensor descriptors, x and weight laid out as TMA
    needs, no bias, no GELU)."""
    return applies(x, weight) and _tma_fits(x, weight, bias, silu_mul, gelu)


def _tma_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, gelu: bool) -> bool:
    """`tma_applies` once `applies` holds."""
    return (
        TMA_ENABLED and bias is None and not gelu and wide_gemm.TensorDescriptor is not None and wide_gemm.hopper(x.device)
        and wide_gemm.tma_ok(x) and wide_gemm.tma_ok(weight) and (not silu_mul or weight.is_contiguous())
    )


def _supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype in _DTYPES and weight.dtype == x.dtype and x.dim() == 2 and weight.dim() == 2
        and x.stride(1) == 1 and weight.stride(1) == 1 and x.shape[1] == weight.shape[1] and x.shape[1] % 16 == 0
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return ENABLED and triton is not None and x.is_cuda and _supported(x, weight)


def _picked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, gelu: bool,
            defer_reduce: bool) -> GemmConfig | None:
    """`skinny_gemm`'s choice once `applies` holds: a kernel configuration, or None for F.linear."""
    tma = _tma_fits(x, weight, bias, silu_mul, gelu)
    return pick_config(x.shape[0], weight.shape[0], weight.shape[1], silu_mul, gelu, defer_reduce, tma)


def leaves_to_cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, defer_reduce: bool = False) -> bool:
    """Whether `skinny_gemm` (no activation) would hand this product to F.linear (cuBLAS)."""
    return not applies(x, weight) or _picked(x, weight, bias, False, False, defer_reduce) is None


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                gelu: bool = False, config: GemmConfig | None = None, defer_reduce: bool = False) -> torch.Tensor | SplitKPartials:
    """y = x @ weight.T (+ bias); with silu_mul, silu(y[:, :I]) * y[:, I:]; with gelu, exact
    (erf) GELU of y. The Triton kernel where it applies and `pick_config` (or `config`) chooses
    it; else F.linear, then the activation as its own op (the fused SwiGLU kernel on CUDA).
    With `defer_reduce`, a product that runs split-K returns `SplitKPartials` (the caller's next
    op sums them); every other product returns the tensor as usual."""
    if applies(x, weight):
        if config is None:
            config = _picked(x, weight, bias, silu_mul, gelu, defer_reduce)
        if config is not None and config.tma:
            return tma_gemm(x, weight, silu_mul, config, defer_reduce)
        if config is not None:
            return skinny_gemm_triton(x, weight, bias, silu_mul, config, gelu, defer_reduce)
    y = F.linear(x, weight, bias)
    if silu_mul:
        return silu_and_mul(y)
    return gelu_pass(y) if gelu else y


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, config: GemmConfig,
                       gelu: bool = False, defer_reduce: bool = False) -> torch.Tensor | SplitKPartials:
    assert _supported(x, weight), f"unsupported input: x {x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {weight.dtype} {tuple(weight.shape)}"
    assert not ((silu_mul or gelu) and config.split_k > 1), "activations are not linear in the partial sums: split_k must be 1"
    assert not (silu_mul and gelu), "one activation at a time"
    assert not silu_mul or weight.shape[0] % 2 == 0, f"a merged gate/up weight has an even number of rows, not {weight.shape[0]}"
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if m == 0 or n_out == 0:
        return torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    c = config
    k_per_split, split_k = _k_split(k, c)
    grid = (triton.cdiv(n_out, c.block_n), split_k, triton.cdiv(m, c.block_m))
    if split_k == 1:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
        _gemm_kernel[grid](
            x, weight, bias if bias is not None else out, out, m, n_out, k, x.stride(0), weight.stride(0), out.stride(0),
            0, 0, n_out if silu_mul else 0,
            K_PER_SPLIT=k_per_split, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PARTIAL=False, HAS_BIAS=bias is not None,
            SILU_MUL=silu_mul, GELU=gelu, EVEN_K=k_per_split * split_k == k, num_warps=c.num_warps, num_stages=c.num_stages,
            **pdl.launch_args(x),
        )
        return out
    partial = torch.empty((split_k, m, n_out), dtype=torch.float32, device=x.device)
    _gemm_kernel[grid](
        x, weight, x, partial, m, n_out, k, x.stride(0), weight.stride(0), n_out,  # no bias here (b_ptr unused): the reduction adds it
        partial.stride(0), 0, 0,
        K_PER_SPLIT=k_per_split, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PARTIAL=True, HAS_BIAS=False,
        SILU_MUL=False, GELU=False, EVEN_K=k_per_split * split_k == k, num_warps=c.num_warps, num_stages=c.num_stages,
        **pdl.launch_args(x),
    )
    product = SplitKPartials(partial, bias, x.dtype)
    return product if defer_reduce else reduce_partials_triton(product)


def _k_split(k: int, config: GemmConfig) -> tuple[int, int]:
    """-> (K per split, number of splits). K slices are whole BLOCK_K blocks; a split that would
    leave a slice empty is dropped."""
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


# ---------------------------------------------------------------------------------------------
# The Hopper form: x and w tiles brought in by TMA


def tma_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, config: GemmConfig, defer_reduce: bool = False) -> torch.Tensor | SplitKPartials:
    """`skinny_gemm_triton` without bias or GELU, its operands brought in by TMA (tensor
    descriptors: Triton pipelines them through `num_stages` shared-memory buffers, no registers
    spent on addresses). Program (n, s, m) owns the [BLOCK_M, BLOCK_N] output tile n, m over the
    K slice s; with split_k > 1 it stores fp32 partials [split_k, M, N] (`SplitKPartials`, summed
    by the norm after it or by `_reduce_kernel`); with SwiGLU one [2, BLOCK_N, BLOCK_K] box brings
    the gate rows n.. and the up rows I + n.. of a K block (as `wide_gemm` does), and the output is
    rounded as cuBLAS + `silu_and_mul` round it. For skinny shapes: split_k x M x N must stay
    below 2**31 (the partials' split offset is 32-bit; `pick_tma` stops at 512 rows)."""
    c = config
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    check_tma(x, weight, c, silu_mul)
    if m == 0 or n_out == 0:
        return torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if silu_mul:
        w_desc = wide_gemm.TensorDescriptor.from_tensor(weight.view(2, n_out, k), [2, c.block_n, c.block_k])
    else:
        w_desc = wide_gemm.TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    shape = (m, n_out) if c.split_k == 1 else (c.split_k, m, n_out)
    out = torch.empty(shape, dtype=x.dtype if c.split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(n_out, c.block_n), c.split_k, triton.cdiv(m, c.block_m))
    _tma_gemm_kernel[grid](
        wide_gemm.TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]), w_desc, out, m, n_out, k // c.split_k,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PARTIAL=c.split_k > 1, SILU_MUL=silu_mul,
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_args(x),
    )
    if c.split_k == 1:
        return out
    product = SplitKPartials(out, None, x.dtype)
    return product if defer_reduce else reduce_partials_triton(product)


def check_tma(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, silu_mul: bool = False) -> None:
    """The TMA products' input checks (`tma_gemm`, `qkv_rope.qkv_norm_rope_triton`)."""
    c = config
    m, k = x.shape
    n_out = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert x.dtype in _DTYPES and weight.dtype == x.dtype and x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == k, (
        f"unsupported input: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
    )
    assert wide_gemm.tma_ok(x) and wide_gemm.tma_ok(weight), "TMA needs the last dim contiguous and 16-byte aligned rows and bases"
    assert not (silu_mul and c.split_k > 1), "activations are not linear in the partial sums: split_k must be 1"
    assert not silu_mul or (weight.shape[0] % 2 == 0 and weight.is_contiguous()), "a merged gate/up weight: contiguous, an even number of rows"
    assert k % (c.split_k * c.block_k) == 0, f"K = {k} must split into {c.split_k} slices of whole {c.block_k}-blocks"
    assert c.split_k == 1 or c.split_k * m * n_out < 2**31, f"{c.split_k} x {m} x {n_out} partials: too many for the kernel's 32-bit split offset"
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )


@_jit
def tma_k_slice(x_desc, w_desc, acc, row, col, k_start, k_len, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc + x[row.., K slice] @ w[col.., K slice].T over k_start .. k_start + k_len, both tiles
    brought in by TMA (which fills rows past the tensors' ends with zeros). With SILU_MUL, w_desc
    is the [2, I, K] view of a merged gate/up weight and the w tile is [gate rows | up rows].
    Every TMA product (this module's, qkv_rope's) runs this loop."""
    for k in range(k_start, k_start + k_len, BLOCK_K):
        x = x_desc.load([row, k])
        if SILU_MUL:  # [2, BLOCK_N, BLOCK_K]: the gate rows, then the matching up rows
            w = tl.reshape(w_desc.load([0, col, k]), (2 * BLOCK_N, BLOCK_K))
        else:
            w = w_desc.load([col, k])
        acc = tl.dot(x, w.T, acc)
    return acc


@_jit
def _tma_gemm_kernel(x_desc, w_desc, out_ptr, M, N, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PARTIAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SILU_MUL:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Rows past M (and columns past N) come in as zeros; their outputs are masked on store.
    acc = tma_k_slice(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, pid_k * K_PER_SPLIT, K_PER_SPLIT, BLOCK_N, BLOCK_K, SILU_MUL)
    pdl.pdl_trigger(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + offs, acc, mask=mask)  # NOTE: split_k * M * N < 2**31
    elif SILU_MUL:  # cuBLAS' rounding of the product, then activation.silu_and_mul's steps
        tl.store(out_ptr + offs, swiglu_tile(acc, BLOCK_M, BLOCK_N, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# The split-K product with the add + RMSNorm after it, in one launch (few rows)


# One counter per row block of a fused product + add + RMSNorm launch.
_counters = LaunchCounters("skinny_gemm_add_rms_norm", minimum=64)


def _vector_fits(v: torch.Tensor, n: int, device: torch.device) -> bool:
    return v.dtype in _NORM_DTYPES and v.shape == (n,) and v.stride(0) == 1 and v.device == device


def fused_norm_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                       norm_weight: torch.Tensor) -> bool:
    """Host-side checks only (safe in CUDA graphs): the product's own conditions, 1..FUSED_NORM_MAX_ROWS
    rows, rows of <= FUSED_NORM_MAX_COLS, a residual [M, N] of x's dtype with N contiguous."""
    if not applies(x, weight):
        return False
    m, n = x.shape[0], weight.shape[0]
    return (
        FUSED_NORM_ENABLED and 1 <= m <= FUSED_NORM_MAX_ROWS and 1 <= n and triton.next_power_of_2(n) <= FUSED_NORM_MAX_COLS
        and residual.dtype == x.dtype and residual.shape == (m, n) and residual.stride(-1) == 1 and residual.device == x.device
        and _vector_fits(norm_weight, n, x.device) and (bias is None or _vector_fits(bias, n, x.device))
    )


def skinny_gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float,
                             config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """y = x @ weight.T (+ bias), then add + RMSNorm: (rms_norm(y + residual) * norm_weight, y + residual),
    in one launch where the product runs split-K on few rows (`fused_norm_applies`, and `pick_config`
    or `config` splits K); None elsewhere, and the caller runs the product and the norm apart. The
    same bits as `norms.add_rms_norm(skinny_gemm(x, weight, bias, defer_reduce=True), residual, ...)`."""
    if not fused_norm_applies(x, weight, bias, residual, norm_weight):
        return None
    config = config or pick_config(x.shape[0], weight.shape[0], weight.shape[1])
    if config is None or _k_split(x.shape[1], config)[1] < 2:
        return None  # no split-K partials for a last program to sum
    return skinny_gemm_add_rms_norm_triton(x, weight, bias, residual, norm_weight, eps, config)


def skinny_gemm_add_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                                    norm_weight: torch.Tensor, eps: float, config: GemmConfig,
                                    counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert _supported(x, weight), f"unsupported input: x {x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {weight.dtype} {tuple(weight.shape)}"
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= min(FUSED_NORM_MAX_ROWS, config.block_m), (
        f"{m} rows: the fused norm takes 1..{FUSED_NORM_MAX_ROWS} rows, in one row block of {config.block_m}"
    )
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(-1) == 1, (
        f"residual {tuple(residual.shape)} {residual.dtype} strides {residual.stride()} must be [{m}, {n}] {x.dtype} with N contiguous"
    )
    assert _vector_fits(norm_weight, n, x.device), f"norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be a contiguous float [{n}]"
    assert bias is None or _vector_fits(bias, n, x.device), f"bias {tuple(bias.shape)} {bias.dtype} must be a contiguous float [{n}]"
    assert residual.device == weight.device == x.device, f"x on {x.device}, weight on {weight.device}, residual on {residual.device}"
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    k_per_split, split_k = _k_split(k, config)
    assert split_k > 1, f"K = {k} in blocks of {config.block_k} does not split {config.split_k} ways: nothing to fuse"
    # NOTE: the norm kernel's row tile and warps, not the product's (num_warps changes how a row's
    # sum of squares is split over threads, so its rounding): the last program then normalises in
    # the same layout, and so the same order, as `_rms_norm_kernel`. A product's bits do not
    # depend on the warps: each output's K sum is the same sequence of MMA steps.
    norm_rows, norm_cols, num_warps = norms._row_blocking(n)
    assert norm_cols <= FUSED_NORM_MAX_COLS, f"rows of {n} are wider than the fused norm holds ({FUSED_NORM_MAX_COLS})"
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    out = torch.empty((m, n), dtype=torch.promote_types(x.dtype, norm_weight.dtype), device=x.device)
    summed = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), split_k, triton.cdiv(m, config.block_m))
    counters = counters if counters is not None else _counters.get(x.device, grid[2])
    _gemm_add_rms_norm_kernel[grid](
        x, weight, bias if bias is not None else norm_weight, partials, counters, residual, norm_weight, out, summed,
        m, n, k, x.stride(0), weight.stride(0), partials.stride(0), residual.stride(0), eps,
        K_PER_SPLIT=k_per_split, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, EVEN_K=k_per_split * split_k == k, NORM_ROWS=norm_rows, NORM_COLS=norm_cols,
        NORM_TILES=triton.cdiv(m, norm_rows), num_warps=num_warps, num_stages=config.num_stages,
    )
    return out, summed


@_jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 stride_split, unused, up_offset,
                 K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, GELU: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc, acc_up = _k_slice_product(x_ptr, w_ptr, rm, rn, m_ok, n_ok, pid_k * K_PER_SPLIT, K, stride_xm, stride_wn, up_offset,
                                   K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, SILU_MUL, EVEN_K)
    pdl.pdl_trigger(PDL)
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_split + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SILU_MUL:
                acc_up += tl.load(b_ptr + up_offset + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if GELU:  # rounded first, as the reference's F.gelu(F.linear(...)) sees it
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            if out_ptr.dtype.element_ty == tl.float32:  # the fit is exact to fp16 and bf16, not fp32
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            else:
                acc = gelu_exact(acc)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _k_slice_product(x_ptr, w_ptr, rm, rn, m_ok, n_ok, k_start, K, stride_xm, stride_wn, up_offset,
                     K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    """(acc, acc_up) in fp32: x[rm, K slice] @ w[rn, K slice].T over the slice k_start.. of
    K_PER_SPLIT, and with SILU_MUL the same against the up rows rn + up_offset (else acc_up is 0).
    Both product kernels run this loop, so a split's partial sums have the same bits in each."""
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns read row 0 (always valid) and are masked on store: loads stay
    # unmasked along M/N, which keeps them vectorised.
    rm_safe = tl.where(m_ok, rm, 0).to(tl.int64)
    rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)
    x_ptrs = x_ptr + rm_safe[:, None] * stride_xm + (k_start + rk)[None, :]
    w_ptrs = w_ptr + rn_safe[None, :] * stride_wn + (k_start + rk)[:, None]  # [BLOCK_K, BLOCK_N] view of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A fixed trip count (K_PER_SPLIT is a whole number of blocks); the last slice is masked at K.
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k_start + k + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        if SILU_MUL:
            if EVEN_K:
                w_up = tl.load(w_ptrs + up_offset * stride_wn)
            else:
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(x, w_up, acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@_jit
def _gemm_add_rms_norm_kernel(x_ptr, w_ptr, b_ptr, partial_ptr, counter_ptr, res_ptr, nw_ptr, out_ptr, sum_ptr,
                              M, N, K, stride_xm, stride_wn, stride_split, stride_rt, eps,
                              K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                              NORM_ROWS: tl.constexpr, NORM_COLS: tl.constexpr, NORM_TILES: tl.constexpr):
    """`_gemm_kernel`'s split-K partials, then in the row block's last program to finish: their
    sum + bias -> dtype, + residual -> dtype, RMSNorm (norms._add_rms_norm_partial_rows)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc, _ = _k_slice_product(x_ptr, w_ptr, rm, rn, m_ok, n_ok, pid_k * K_PER_SPLIT, K, stride_xm, stride_wn, 0,
                              K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, False, EVEN_K)
    tl.store(partial_ptr + pid_k * stride_split + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    # Every thread's stores land before the counter moves (barrier, then a release at GPU scope);
    # the program that sees the row block's last count acquires them all and finishes the rows.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) * SPLIT_K - 1:
        tl.store(counter_ptr + pid_m, 0)  # ready for the next launch
        first = pid_m * BLOCK_M
        last = tl.minimum(M, first + BLOCK_M)
        # The norm kernel's tiles of NORM_ROWS rows; partials read past L1 (other SMs wrote them).
        for g in tl.static_range(NORM_TILES):
            rows, cols, col_ok, mask, out_offs = norms._row_tile_at(first + g * NORM_ROWS, last, N, NORM_ROWS, NORM_COLS)
            norms._add_rms_norm_partial_rows(partial_ptr, b_ptr, res_ptr, nw_ptr, out_ptr, sum_ptr, rows, cols, col_ok, mask, out_offs,
                                             N, stride_split, stride_rt, N, eps, SPLIT_K, HAS_BIAS, NORM_ROWS, NORM_COLS, ".cg")
