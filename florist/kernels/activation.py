"""SwiGLU (`silu(gate) * up`): torch reference and a Triton kernel beside its wrapper.

The public function dispatches: Triton when the input is on CUDA, triton imports and the dtype is
fp16/bf16/fp32; the reference otherwise. The input is the merged gate/up projection output:

    x [T, 2I] = | gate (I) | up (I) |   ->   out [T, I] = silu(gate) * up

Rows may be strided (only the last dim must be contiguous); the output is a new contiguous tensor.

The exact (erf) GELU of BERT-family models has the same pair: `gelu_ref` (F.gelu) and `gelu`, a
Triton pass for CUDA tensors whose arithmetic (`gelu_exact`) also serves the products that apply
the GELU in their epilogue.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from florist.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

# NOTE: without triton the kernel below is a plain (never called) function; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024  # columns per program; a row of I = 3072 is three programs


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if triton is not None and x.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [T, 2*I], got {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES and x.stride(1) == 1, f"unsupported input: {x.dtype}, strides {x.stride()}"
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    # Tokens on grid axis 0: axis 1 is limited to 65535 programs, axis 0 to 2**31 - 1.
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_args(x))
    return out


@_jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in `dtype`, rounded at the steps torch takes for `silu_and_mul_ref` of a
    `dtype` tensor: gate and up rounded to dtype (a no-op for values loaded in it; for a product
    in fp32, cuBLAS' rounding of its output), silu = g / (1 + exp(-g)) in fp32 rounded to dtype,
    then the multiply. silu(-inf) is NaN as in torch (-inf / inf); a large negative g gives -0."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@_jit
def column_halves(t, ROWS: tl.constexpr, HALF: tl.constexpr):
    """t [ROWS, 2 HALF] -> (t[:, :HALF], t[:, HALF:]), in registers."""
    return tl.split(tl.permute(tl.reshape(t, (ROWS, 2, HALF)), (0, 2, 1)))


@_jit
def swiglu_tile(acc, BM: tl.constexpr, BN: tl.constexpr, dtype: tl.constexpr):
    """The SwiGLU epilogue of a product over a [2, BN, BK] weight box (BN gate rows, then the
    BN matching up rows): acc [BM, 2 BN] fp32 -> silu(gate) * up [BM, BN] in dtype."""
    gate, up = column_halves(acc, BM, BN)
    return silu_mul_rounded(gate, up, dtype)


@_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * inter + cols, silu_mul_rounded(gate, up, out_ptr.dtype.element_ty), mask=mask)


# -- exact GELU --------------------------------------------------------------------------------
# GELU(x) = x * Phi(x), Phi the standard normal CDF. The pass is bound by its arithmetic, not its
# bytes: on the H200 F.gelu over MiniLM's [25,600, 1,536] fp16 intermediate took 52.6 us against
# 40.3 for a copy of the same bytes, and a tanh-form GELU (not exact) as long as the copy
# (docs/benchmarks.md, "The exact GELU's pass"). `gelu_exact` takes Phi from erfc in
# the form erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), with P a degree-6 polynomial fitted
# (minimax on the relative error) over z in [0, 6]: relative error < 2.8e-6 there, < 3e-4 out to
# z = 12, where only bf16's tail can still see it; below |x| = 2^-7 the first term of Phi's series
# is taken instead. Over every finite fp16 input its fp16 result differs from the correctly rounded
# exact GELU in 33 of 63,488 values on the H200, by one unit in the last place, where F.gelu on
# CUDA differs in 370 (`bench/fused_kernels.py --gelu` counts them).
# The coefficients are P's times log2(e), so the exponential is one exp2.
# The reciprocal and the exp2 are the hardware's approximate instructions with subnormal results
# flushed (`rcp.approx.ftz.f32`, `ex2.approx.ftz.f32`: one MUFU instruction each), by inline PTX.
# `tl.math.fdiv` is div.full: the MUFU reciprocal plus scaling checks, eight instructions more an
# element. Triton 3.9 compiles `tl.math.exp2` to that ex2 already; on the device's Triton 3.6 the
# explicit one measured 1.4-1.8 us faster in the wide product below, about the spread. Over every
# finite fp16 and bf16 input the results are the same bits as with div.full and exp2 on the H200,
# and in the wide product's epilogue, which pays for every instruction beside the tensor cores'
# work, all-MiniLM-L6-v2's up projection + GELU took 93.9 against 102.9 us at 25,600 rows, and the
# pass alone a copy's time (docs/benchmarks.md, "The GELU's reciprocal and exp2, and its epilogue
# in halves").
# Triton's interpreter has no inline PTX, so there (CPU tests) the two are fdiv and exp2, as they
# are compiled with FLORIST_GELU_APPROX_MUFU=0 (for side-by-side measurements).
_GELU_BLOCK = 4096  # elements a program (8 warps): the fastest of 1,024-4,096 on the H200
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# FLORIST_GELU_KERNEL=0 keeps F.gelu on CUDA too (for side-by-side measurements).
GELU_KERNEL = os.environ.get("FLORIST_GELU_KERNEL", "1") != "0"


def gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """What runs off CUDA: torch's exact GELU."""
    return F.gelu(x)


def gelu_exact_ref(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU computed in float64 and rounded once to x's dtype: what the kernel is
    checked against (it is closer to this than F.gelu on CUDA is, see the note above)."""
    xd = x.double()  # erfc, not 1 + erf: the left tail would cancel to 0 below x ~ -8
    return (0.5 * xd * torch.special.erfc(xd * -0.7071067811865476)).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU: the Triton pass for a contiguous fp16/bf16 CUDA tensor, else the
    reference (fp32 too: the fit's 2.8e-6 is below half a unit of fp16 or bf16, not of fp32)."""
    if GELU_KERNEL and triton is not None and x.is_cuda and x.dtype in _HALF_DTYPES and x.is_contiguous():
        return gelu_triton(x)
    return gelu_ref(x)


def gelu_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype in _HALF_DTYPES and x.is_contiguous(), f"unsupported input: {x.dtype}, strides {x.stride()}"
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _gelu_kernel[(triton.cdiv(n, _GELU_BLOCK),)](x, out, n, BLOCK=_GELU_BLOCK, num_warps=8, **pdl.launch_args(x))
    return out


# Inline PTX: NVIDIA only (not under the interpreter, nor on a ROCm build, whose tensors are "cuda" too).
_PTX = (triton is not None and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and os.environ.get("FLORIST_GELU_APPROX_MUFU", "1") != "0")
_APPROX_MUFU = tl.constexpr(_PTX) if triton is not None else _PTX


@_jit
def _rcp(x):
    """1 / x: rcp.approx.ftz.f32, or div.full (`tl.math.fdiv`) where inline PTX is off."""
    if _APPROX_MUFU:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.fdiv(1.0, x)


@_jit
def _exp2(x):
    """2 ** x: ex2.approx.ftz.f32, or `tl.math.exp2` where inline PTX is off."""
    if _APPROX_MUFU:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.exp2(x)


@_jit
def gelu_exact(x):
    """x * Phi(x) computed in fp32 for a result rounded to fp16 or bf16 (see the note above). NaN
    gives NaN, +inf gives +inf, -inf gives NaN (-inf * 0), as the erf form 0.5 * x * (1 + erf(x /
    sqrt(2))) does."""
    z = tl.abs(x) * 0.7071067811865476
    t = _rcp(1.0 + 0.5 * z)  # 1 ulp, ample for a 2.8e-6 fit
    p = -0.0976914175 * t + 0.699693444
    p = p * t - 1.58491805
    p = p * t + 1.1214471
    p = p * t + 0.184669723
    p = p * t + 1.50724747
    p = p * t - 1.83044433
    q = 0.5 * t * _exp2(p - (z * z) * 1.4426950408889634)  # 1 - Phi(|x|)
    # Near 0 the fit's error would outweigh Phi(x) - 1/2 = x / sqrt(2 pi) + O(x^3) and round ties
    # the wrong way; there that first term is exact to < 1e-7.
    return tl.where(tl.abs(x) < 0.0078125, x * (0.5 + 0.3989422804014327 * x), x * tl.where(x >= 0, 1.0 - q, q))


@_jit
def _gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, gelu_exact(x).to(out_ptr.dtype.element_ty), mask=mask)
