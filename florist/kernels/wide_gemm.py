"""Matrix products with many rows (prefill of hundreds to thousands of tokens), SwiGLU or bias +
GELU fused.

At 100 x 512 tokens an engine step is up to 16,384 rows and each product is compute-bound:
cuBLAS runs at ~660-700 TFLOP/s there. Beside the products, each elementwise op after them costs
a pass over their output: SwiGLU reads the [T, 2I] gate/up projection and writes [T, I] (6.0 ms
of 89 per 100 x 512, docs/benchmarks.md). This kernel makes silu(gate) * up in the product's
epilogue, while the tile is in registers, so neither that pass nor the [T, 2I] tensor exists.

A persistent Hopper (sm_90+) product: one program per SM walks the output tiles (GROUP row
blocks sweep the columns together, so a weight tile is reused from L2); operands come in by TMA
(tensor descriptors), the accumulator is fp32.

    w = | gate (I) | up (I) |  (MergedColumnParallelLinear's [2I, K]), viewed as [2, I, K]:
    one TMA box [2, BN, BK] brings the gate rows n.. and the up rows I+n.. of a K block, and
    they sit in shared memory as one [2 BN, BK] tile, so ONE tensor-core product per K block
    fills a [BM, 2 BN] accumulator (two accumulators and two products per block ran at ~530
    TFLOP/s against ~700 for one). The epilogue splits it into gate and up and stores
    silu(gate) * up, each step rounded as cuBLAS + `activation.silu_and_mul` round it (the
    product to the activation dtype, silu to it, then the multiply).

`EPILOGUE` NONE (plain y = x @ w.T + bias) does not beat cuBLAS on Qwen3's qkv, o or down at
512-16,384 rows (bench/gemm.py --wide --sweep), nor on all-MiniLM-L6-v2's o and down; it does on
MiniLM's qkv, alone from 25,600 rows and in the engine's step from 12,800. `EPILOGUE` GELU adds
the bias and the exact GELU (`activation.gelu_exact`) to BERT's up projection, so the GELU's pass
over [T, 4H] is gone. With
K = 384 a tile's product is six K blocks, as short as its epilogue: there the kernel runs two
programs an SM (`WideConfig.per_sm`), so one program's epilogue runs while the other's products
use the tensor cores; the GELU form finishes its tile in two column halves
(`WideConfig.epilogue_split`: fewer values live at once, which leaves room for three operand
stages each). `pick` says which shapes take which form; `linear` is the entry the model's layers
call (florist/layers/linear.py). It is launched without PDL (florist/kernels/pdl.py): waiting
under it measured no faster, for MiniLM or for Qwen3 (docs/benchmarks.md, "The wide product under
PDL, and MiniLM's qkv from 12,800 rows").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from florist.kernels.activation import column_halves, gelu_exact, swiglu_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references are the whole implementation
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: no host-side tensor descriptors, no wide kernel
    TensorDescriptor = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

NONE, SWIGLU, GELU = 0, 1, 2
_DTYPES = (torch.float16, torch.bfloat16)
# FLORIST_WIDE_GEMM=0 keeps cuBLAS and the separate kernels (for side-by-side measurements).
ENABLED = os.environ.get("FLORIST_WIDE_GEMM", "1") != "0"


@dataclass(frozen=True)
class WideConfig:
    block_m: int
    block_n: int  # output columns per tile (SwiGLU: of the output, so the accumulator is 2 x block_n wide)
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8
    per_sm: int = 1  # programs a streaming multiprocessor: 2 or more overlap one's epilogue with another's products
    epilogue_split: int = 1  # bias/GELU epilogues: finish and store the tile in 1 or 2 column halves


# Fewest rows the kernel takes: at 512 rows cuBLAS + silu_and_mul is as fast (bench/gemm.py --wide).
MIN_ROWS = 1024


def pick(m: int, epilogue: int = SWIGLU, n: int = 0, k: int = 0) -> WideConfig | None:
    """The configuration for an [m, k] x [n, k].T product (SwiGLU: [2I, k]), or None where cuBLAS
    (+ the activation's own pass) is as fast. `bench/gemm.py --wide [--sweep]` on the H200, us:

    - SwiGLU, Qwen3-0.6B's gate/up (6144 x 1024), against cuBLAS + silu_and_mul: 15.1 vs 14.8 at
      512 rows (no gain), 22.3 vs 25.1 at 1024, 39.0 vs 47.5 at 2048, 78.3 vs 91.5 at 4096, 161
      vs 188 at 8192, 322 vs 383 at 16,384 (docs/benchmarks.md, "Wide products").
    - GELU with bias, all-MiniLM-L6-v2's up projection (1536 x 384, fp16), against cuBLAS +
      activation.gelu, with two programs an SM (each one's epilogue overlapping the other's
      products): 9.7 vs 8.6 at 1,024 rows, 12.2 vs 12.4 at 2,048, 23.4 vs 19.8 at 4,096, 35.0 vs
      37.3 at 8,192, 56.7 vs 58.2 at 12,800, 102.4 vs 110.9 at 25,600, 202.0 vs 200.9 at 51,200;
      with the GELU's MUFU reciprocal and exp2, the epilogue in two halves and three stages:
      29.3 vs 34.1 at 8,192, 46.2 vs 53.9 at 12,800, 86.5 vs 102.1 at 25,600 (docs/benchmarks.md,
      "The GELU's reciprocal and exp2, and its epilogue in halves").
    - Plain, with bias: MiniLM's qkv (1152 x 384) 24.3 vs 22.5 at 12,800 rows, 45.2 vs 48.9 at
      25,600, 89.7 vs 92.3 at 51,200; its o (384 x 384) and down (384 x 1536), and Qwen3's plain
      products, no faster than cuBLAS at any row count: those stay with cuBLAS. At 12,800 rows
      (each half of MiniLM's 100 x 256 batch) the kernel still wins in the step, where cuBLAS's
      qkv product comes with a memset node before it: +1.1-1.9 % streamed in 5 of 6
      interleaved rounds ("The wide product under PDL, and MiniLM's qkv from 12,800 rows").
    (docs/benchmarks.md, "MiniLM's products in the wide kernel".)"""
    if m < MIN_ROWS:
        return None
    if epilogue == SWIGLU:
        if m < 2048:
            return WideConfig(128, 64, 64, num_warps=4, num_stages=4)
        return WideConfig(128, 128, 64, num_warps=8, num_stages=3)
    if not 0 < k <= SHORT_K:
        return None
    if epilogue == GELU and m >= GELU_MIN_ROWS:
        return WideConfig(128, 128, 64, num_warps=8, num_stages=3, per_sm=2, epilogue_split=2)
    if epilogue == NONE and n >= 2 * k and m >= PLAIN_MIN_ROWS:
        return WideConfig(128, 128, 64, num_warps=4, num_stages=4)
    return None


# Products whose K is this short (a few K blocks a tile) take the kernel with a GELU from
# GELU_MIN_ROWS rows and plain ones at least twice as wide as K from PLAIN_MIN_ROWS (measured on
# all-MiniLM-L6-v2's shapes only, K = 384; `pick`).
SHORT_K = 512
GELU_MIN_ROWS = 8192
PLAIN_MIN_ROWS = 12800


# Shared memory a program of the largest `pick` configuration needs: 3 stages of x [128, 64] and
# w [256, 64] tiles, bf16 (144 KiB), with room for Triton's own.
_SMEM_NEEDED = 160 * 1024


@functools.cache
def _device_facts(index: int) -> tuple[bool, int]:
    """(whether the kernel runs on CUDA device `index`, its SM count), read once per device."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    big = smem >= _SMEM_NEEDED if smem is not None else props.major in (9, 10)
    return props.major >= 9 and big, props.multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def hopper(device: torch.device) -> bool:
    """TMA (sm_90 or newer) and the shared memory of a datacenter part (H100/H200/B200: 227 KiB
    a program; consumer Blackwell has ~100 KiB and would fail to launch)."""
    return device.type == "cuda" and _device_facts(_index(device))[0]


def tma_ok(t: torch.Tensor) -> bool:
    """TMA's rules: last dim contiguous, other strides and the base 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and all((s * size) % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def _supported(x: torch.Tensor, weight: torch.Tensor, epilogue: int = NONE) -> bool:
    """The kernel's layout rules, host-side: fp16/bf16, [M, K] x [N, K], TMA-able x and weight,
    and an output whose rows TMA can store (a multiple of 16 bytes); SwiGLU also needs a
    contiguous [gate | up] weight with an even number of rows."""
    if triton is None or TensorDescriptor is None or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not (tma_ok(x) and tma_ok(weight)):
        return False
    n = weight.shape[0]
    if epilogue == SWIGLU:
        if n % 2 or not weight.is_contiguous():
            return False
        n //= 2
    return (n * x.element_size()) % 16 == 0


def applies(x: torch.Tensor, weight: torch.Tensor, epilogue: int = NONE) -> bool:
    """Host-side checks only (safe in CUDA graphs)."""
    return ENABLED and x.is_cuda and hopper(x.device) and _supported(x, weight, epilogue)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor | None:
    """x @ weight.T + bias (then the exact GELU) in one launch where the kernel applies and
    `pick` chooses it for this shape; None elsewhere (the caller keeps its own path)."""
    epilogue = GELU if gelu else NONE
    if x.dim() != 2 or x.shape[0] < MIN_ROWS or not applies(x, weight, epilogue) or not _bias_fits(bias, weight, x):
        return None
    config = pick(x.shape[0], epilogue, *weight.shape)
    return wide_gemm(x, weight, config, epilogue, bias) if config is not None else None


def _bias_fits(bias: torch.Tensor | None, weight: torch.Tensor, x: torch.Tensor) -> bool:
    """No bias, or a contiguous [N] one on x's device (any float dtype: the epilogue adds it in fp32)."""
    return bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1 and bias.device == x.device)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for a [gate | up] weight in one launch where the kernel
    applies (`applies`) and `pick` chooses it for x's rows; None elsewhere (the caller keeps
    skinny_gemm or cuBLAS + silu_and_mul)."""
    if not applies(x, gate_up, SWIGLU):
        return None
    config = pick(x.shape[0], SWIGLU, *gate_up.shape)
    return wide_gemm(x, gate_up, config, SWIGLU) if config is not None else None


def wide_gemm(x: torch.Tensor, weight: torch.Tensor, config: WideConfig, epilogue: int = NONE, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N]; with SWIGLU (weight = [gate | up], N = 2I, no
    bias): silu(x @ gate.T) * (x @ up.T) -> [M, I]; with GELU: gelu(x @ weight.T + bias), the
    exact GELU, each step rounded as cuBLAS + `activation.gelu` round it."""
    assert _supported(x, weight, epilogue), f"unsupported: x {x.dtype} {tuple(x.shape)} {x.stride()}, weight {weight.dtype} {tuple(weight.shape)} {weight.stride()}"
    assert _bias_fits(bias, weight, x) and (bias is None or epilogue != SWIGLU), (
        f"bias {None if bias is None else tuple(bias.shape)} must be a contiguous [{weight.shape[0]}] on {x.device}, and SwiGLU takes none"
    )
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    m, k = x.shape
    c = config
    if epilogue == SWIGLU:
        n = weight.shape[0] // 2
        w_desc = TensorDescriptor.from_tensor(weight.view(2, n, k), [2, c.block_n, c.block_k])
    else:
        n = weight.shape[0]
        w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    assert c.epilogue_split in (1, 2) and (c.epilogue_split == 1 or epilogue != SWIGLU), f"epilogue_split {c.epilogue_split} with epilogue {epilogue}"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    programs = min(tiles, c.per_sm * _num_sms(x.device))
    _wide_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]), w_desc, TensorDescriptor.from_tensor(out, [c.block_m, c.block_n // c.epilogue_split]),
        bias if bias is not None else out, m, n, k,
        BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP=c.group, EPILOGUE=epilogue, HAS_BIAS=bias is not None, NUM_PROGRAMS=programs,
        SPLIT=c.epilogue_split,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter (tests): a few programs, each walking several tiles
        return 3
    return _device_facts(_index(device))[1]


@_jit
def _finish(acc, b_ptr, col0, N, BN: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """A plain or GELU tile's epilogue: acc [BM, BN] fp32 of the columns col0.. -> dtype."""
    if HAS_BIAS:  # cuBLAS adds the bias to the fp32 accumulator and rounds once
        cols = col0 + tl.arange(0, BN)
        acc = acc + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if EPILOGUE == 2:  # then activation.gelu's pass: the rounded product in fp32, rounded again
        y = gelu_exact(y.to(tl.float32)).to(dtype)
    return y


@_jit
def _wide_gemm_kernel(x_desc, w_desc, out_desc, b_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                      EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, SPLIT: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        # Grouped order: GROUP row blocks sweep the columns together (the weight tile stays in L2).
        first_m = (tile // per_group) * GROUP
        group_m = tl.minimum(tiles_m - first_m, GROUP)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        if EPILOGUE == 1:
            acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        # TMA fills the K tail (and rows past M) with zeros; stores past M are dropped.
        for k in range(0, K, BK):
            x = x_desc.load([pid_m * BM, k])
            if EPILOGUE == 1:  # [2, BN, BK]: BN gate rows, then the BN matching up rows
                w = tl.reshape(w_desc.load([0, pid_n * BN, k]), (2 * BN, BK))
            else:
                w = w_desc.load([pid_n * BN, k])
            acc = tl.dot(x, w.T, acc)
        dtype = out_desc.dtype
        if EPILOGUE == 1:  # cuBLAS' rounding of the product, then activation.silu_and_mul's steps
            out_desc.store([pid_m * BM, pid_n * BN], swiglu_tile(acc, BM, BN, dtype))
        elif SPLIT == 1:
            out_desc.store([pid_m * BM, pid_n * BN], _finish(acc, b_ptr, pid_n * BN, N, BN, EPILOGUE, HAS_BIAS, dtype))
        else:  # two column halves, one after the other: fewer values live at once in the epilogue
            left, right = column_halves(acc, BM, BN // 2)
            out_desc.store([pid_m * BM, pid_n * BN], _finish(left, b_ptr, pid_n * BN, N, BN // 2, EPILOGUE, HAS_BIAS, dtype))
            out_desc.store([pid_m * BM, pid_n * BN + BN // 2], _finish(right, b_ptr, pid_n * BN + BN // 2, N, BN // 2, EPILOGUE, HAS_BIAS, dtype))
