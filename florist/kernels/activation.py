"""SwiGLU (`silu(gate) * up`): torch reference and a Triton kernel beside its wrapper.

The public function dispatches: Triton when the input is on CUDA, triton imports and the dtype is
fp16/bf16/fp32; the reference otherwise. The input is the merged gate/up projection output:

    x [T, 2I] = | gate (I) | up (I) |   ->   out [T, I] = silu(gate) * up

Rows may be strided (only the last dim must be contiguous); the output is a new contiguous tensor.
"""

from __future__ import annotations

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
def swiglu_tile(acc, BM: tl.constexpr, BN: tl.constexpr, dtype: tl.constexpr):
    """The SwiGLU epilogue of a product over a [2, BN, BK] weight box (BN gate rows, then the
    BN matching up rows): acc [BM, 2 BN] fp32 -> silu(gate) * up [BM, BN] in dtype."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    return silu_mul_rounded(gate, up, dtype)


@_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * inter + cols, silu_mul_rounded(gate, up, out_ptr.dtype.element_ty), mask=mask)
