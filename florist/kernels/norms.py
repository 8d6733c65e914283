"""RMSNorm (+ residual add) and LayerNorm (+ residual add).

Each op has a torch reference (`*_ref`: the CPU path and the test oracle) and a Triton kernel
beside the one wrapper that launches it (`*_triton`). The public functions dispatch: Triton when
the input is on CUDA, triton imports and the dtype is fp16/bf16/fp32; the reference otherwise.

The kernels normalise the last dim of a [T, H] or [T, heads, head_dim] tensor whose last dim is
contiguous. Rows are addressed through two strides, so a QK-norm input may be a view into a fused
qkv projection output without a copy:

    qkv [T, (Hq + 2*Hk) * D]    row t:  | q0 q1 .. q(Hq-1) | k0 .. k(Hk-1) | v0 .. v(Hk-1) |
    q = qkv[:, :Hq*D].view(T, Hq, D)     strides (stride_t = (Hq + 2*Hk) * D, stride_h = D, 1)
    kernel row r = t * heads + h   is read at   t * stride_t + h * stride_h

Outputs are new contiguous tensors, as the reference's are. Rounding follows the reference step by
step (sum rounded to x's dtype; normalised value rounded to x's dtype before the weight multiply),
so the kernels differ from it only by fp32 summation order and rsqrt accuracy.

Split-K reduction fused into add + RMSNorm: `add_rms_norm` also takes x as
`split_k.SplitKPartials` (o_proj's and down_proj's fp32 partial sums, not yet reduced). The
kernel then builds each x row the way `split_k._reduce_kernel` would have stored it and goes
on as before:

    x = (p[0] + p[1] + ... + p[S-1] + bias) in fp32, from 0, in that order -> x's dtype
    summed = x + residual -> x's dtype;   out = rms_norm(summed) * weight

so the result is bit-identical to reducing first and normalising after (two launches, one here).
For few rows `skinny_gemm.skinny_gemm_add_rms_norm` goes one step further and runs this row code
(`_add_rms_norm_partial_rows`) in the product's own launch, in the program that finishes last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from florist.kernels import pdl
from florist.kernels.split_k import (
    SplitKPartials,
    reduce_partial_rows,
    reduce_partials_ref,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below are the whole implementation
    triton = None

# NOTE: without triton the kernels below are plain (never called) functions; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_COLS = 32768  # a whole row is held in registers; wider rows take the reference


# ---------------------------------------------------------------------------------------------
# torch references (the CPU path and the test oracle)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if isinstance(x, SplitKPartials):
        x = reduce_partials_ref(x)
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def add_layer_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       add: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        x = x + residual
    if add is not None:  # a product's bias left out of its epilogue: rounded to x's dtype like the sum
        x = (x.float() + add.float()).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---------------------------------------------------------------------------------------------
# public ops


def rms_norm(x: torch.Tensor | SplitKPartials, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight over the last dim, in fp32."""
    if isinstance(x, SplitKPartials):  # not fused here (Qwen3 only norms partials with a residual)
        x = x.reduce()
    if _triton_applies(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first.
    x may be a split-K product's unreduced partials: the kernel reduces them on the way in."""
    if isinstance(x, SplitKPartials):
        if _triton_applies_partials(x, weight, residual):
            return add_rms_norm_triton(x, residual, weight, eps)
        x = x.reduce()  # the unfused path: reduce (its own kernel on CUDA), then the norm below
    if _triton_applies(x, weight, residual):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   add: torch.Tensor | None = None) -> torch.Tensor:
    """BERT's post-LayerNorm: layer_norm(x + residual) (or of x alone when residual is None).
    `add`, a [H] vector (the bias of a product that accumulated onto its residual in place,
    `RowParallelLinear.forward_onto`), is added to every row first, the sum rounded to x's dtype."""
    # the added vector is checked like the weight (shape, dtype, stride, device)
    if bias is not None and _triton_applies(x, weight, residual, bias) and (add is None or _triton_applies(x, add)):
        return add_layer_norm_triton(x, residual, weight, bias, eps, add)
    return add_layer_norm_ref(x, residual, weight, bias, eps, add)


def _triton_applies(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
    """Host-side checks only (shapes, strides, dtypes): no device sync, so safe in CUDA graphs."""
    if triton is None or not x.is_cuda or x.dtype not in _FLOAT_DTYPES or x.dim() not in (2, 3) or x.stride(-1) != 1:
        return False
    if triton.next_power_of_2(x.shape[-1]) > _MAX_BLOCK_COLS:
        return False
    if any(t.device != x.device for t in (weight, residual, bias) if t is not None):
        return False
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape or residual.stride(-1) != 1):
        return False  # mixed-dtype or broadcast sums: the reference's promotion rules apply
    return all(
        p is not None and p.dtype in _FLOAT_DTYPES and p.shape == (x.shape[-1],) and p.stride(0) == 1
        for p in ((weight,) if bias is None else (weight, bias))
    )


def _triton_applies_partials(p: SplitKPartials, weight: torch.Tensor, residual: torch.Tensor) -> bool:
    """The residual stands in for x in the usual checks; the partials must be fp32 [S, T, H] on
    its device with H contiguous, and the bias (if any) is checked like LayerNorm's."""
    partials = p.partials
    return (
        _triton_applies(residual, weight, bias=p.bias) and residual.dim() == 2 and residual.dtype == p.dtype
        and partials.dtype == torch.float32 and partials.dim() == 3 and partials.shape[0] >= 1
        and partials.shape[1:] == residual.shape and partials.stride(-1) == 1 and partials.device == residual.device
    )


# ---------------------------------------------------------------------------------------------
# Triton launchers (also called directly by the tests, under the interpreter on CPU)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if isinstance(x, SplitKPartials):
        return _launch_add_rms_norm_partials(x, residual, weight, eps)
    return _launch_rms_norm(x, residual, weight, eps)


def add_layer_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          add: torch.Tensor | None = None) -> torch.Tensor:
    _check_rows(x, residual, weight)
    assert bias.shape == weight.shape and bias.stride(0) == 1, f"bias {tuple(bias.shape)} must match weight {tuple(weight.shape)}"
    assert add is None or (add.shape == weight.shape and add.stride(0) == 1), f"add {tuple(add.shape)} must match weight {tuple(weight.shape)}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    res = x if residual is None else residual
    num_rows, num_heads, n_cols = _rows(x)
    block_rows, block_cols, num_warps = _row_blocking(n_cols, layer_norm=True)
    _layer_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x, res, weight, bias, weight if add is None else add, out,
        num_rows, num_heads, *_row_strides(x), *_row_strides(res), n_cols, eps,
        HAS_RESIDUAL=residual is not None, HAS_ADD=add is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        **pdl.launch_args(x),
    )
    return out


def _launch_rms_norm(x, residual, weight, eps):
    _check_rows(x, residual, weight)
    # Output dtype follows torch's promotion of `weight * x` (bf16 x with fp32 weight -> fp32).
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, summed
    res = x if residual is None else residual
    num_rows, num_heads, n_cols = _rows(x)
    block_rows, block_cols, num_warps = _row_blocking(n_cols)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x, res, weight, out, out if summed is None else summed, weight,
        num_rows, num_heads, *_row_strides(x), *_row_strides(res), 0, n_cols, eps,
        HAS_RESIDUAL=residual is not None, SPLIT_K=0, HAS_BIAS=False, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        **pdl.launch_args(x),
    )
    return out, summed


def _launch_add_rms_norm_partials(p: SplitKPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """add_rms_norm with x = p.reduce(), in one kernel: x is never written."""
    partials, bias = p.partials, p.bias
    assert partials.dim() == 3 and partials.dtype == torch.float32 and partials.stride(-1) == 1, (
        f"partials must be fp32 [S, T, H] with H contiguous, not {partials.dtype} {tuple(partials.shape)} strides {partials.stride()}"
    )
    assert residual.dim() == 2 and partials.shape[1:] == residual.shape and residual.dtype == p.dtype, (
        f"residual {tuple(residual.shape)} {residual.dtype} must be [T, H] = {tuple(partials.shape[1:])} of the product's {p.dtype}"
    )
    assert partials.device == residual.device, f"partials on {partials.device}, residual on {residual.device}"
    assert bias is None or (bias.shape == weight.shape and bias.stride(0) == 1 and bias.dtype in _FLOAT_DTYPES), (
        f"bias {tuple(bias.shape)} {bias.dtype} must be a contiguous float [{weight.shape[0]}]"
    )
    _check_rows(residual, None, weight)
    out = torch.empty(residual.shape, dtype=torch.promote_types(p.dtype, weight.dtype), device=residual.device)
    summed = torch.empty(residual.shape, dtype=p.dtype, device=residual.device)
    if residual.numel() == 0:
        return out, summed
    num_rows, n_cols = residual.shape
    block_rows, block_cols, num_warps = _row_blocking(n_cols)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        partials, residual, weight, out, summed, bias if bias is not None else weight,
        num_rows, 1, partials.stride(1), 0, *_row_strides(residual), partials.stride(0), n_cols, eps,
        HAS_RESIDUAL=True, SPLIT_K=partials.shape[0], HAS_BIAS=bias is not None,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps, **pdl.launch_args(residual),
    )
    return out, summed


def _check_rows(x, residual, weight):
    assert x.dim() in (2, 3), f"expected [T, H] or [T, heads, head_dim], got {tuple(x.shape)}"
    assert x.dtype in _FLOAT_DTYPES and weight.dtype in _FLOAT_DTYPES, f"unsupported dtypes {x.dtype}, {weight.dtype}"
    assert x.stride(-1) == 1, f"the normalised dim must be contiguous; strides {x.stride()}"
    # NOTE: Triton launches on the current device's current stream, wherever the tensors live.
    assert not x.is_cuda or x.device.index == torch.cuda.current_device(), (
        f"tensors are on {x.device} but the current CUDA device is {torch.cuda.current_device()}; call torch.cuda.set_device({x.device}) first"
    )
    assert weight.shape == (x.shape[-1],) and weight.stride(0) == 1, f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1, (
            f"residual {tuple(residual.shape)} {residual.dtype} strides {residual.stride()} must match x {tuple(x.shape)} {x.dtype}"
        )


def _rows(x):
    """-> (num_rows, heads per token, row length); a 2-D x is one 'head' per token."""
    num_heads = x.shape[1] if x.dim() == 3 else 1
    return x.shape[0] * num_heads, num_heads, x.shape[-1]


def _row_strides(x):
    """-> (stride between tokens, stride between heads of one token)."""
    return (x.stride(0), x.stride(1)) if x.dim() == 3 else (x.stride(0), 0)


def _row_blocking(n_cols: int, layer_norm: bool = False):
    """-> (rows a program, BLOCK_COLS, warps) for rows of n_cols. Short rows (QK-norm over
    head_dim) share a program so each one moves >= ~2k elements, a warp per 256 of them. Two
    shapes measured otherwise (`bench/fused_kernels.py --norms`, docs/benchmarks.md "The norms' row
    blocking"): RMSNorms of 513-1,024 columns (Qwen3-0.6B's hidden size) take a program a row
    with 8 warps, and LayerNorms of 257-512 columns (MiniLM's 384) two rows to a one-warp program.

    Every RMSNorm of a width blocks alike, the split-K partials' and the product's fused norm
    (`skinny_gemm_add_rms_norm_triton`) included: a row's sum of squares follows the layout, so
    the three ways through a product and its norm give the same bits only this way."""
    block_cols = triton.next_power_of_2(n_cols)
    if layer_norm and 256 < block_cols <= 512:
        return 2, block_cols, 1
    if not layer_norm and block_cols == 1024:
        return 1, block_cols, 8
    block_rows = max(1, min(16, 2048 // block_cols))
    num_warps = min(16, max(1, block_rows * block_cols // 256))
    return block_rows, block_cols, num_warps


# ---------------------------------------------------------------------------------------------
# Triton kernels


@_jit
def _row_offsets(rows, num_heads, stride_t, stride_h):
    rows = rows.to(tl.int64)  # int64: T * stride_t can pass 2**31 for long batches of wide rows
    return (rows // num_heads) * stride_t + (rows % num_heads) * stride_h


@_jit
def _load_rows(x_ptr, res_ptr, rows, cols, mask, num_heads, stride_xt, stride_xh, stride_rt, stride_rh, HAS_RESIDUAL: tl.constexpr):
    """Loads a [BLOCK_ROWS, BLOCK_COLS] tile of x (+ residual), in x's dtype: the sum is rounded
    to it, as the reference's `x + residual` is. Masked elements are 0."""
    x = tl.load(x_ptr + _row_offsets(rows, num_heads, stride_xt, stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = _add_residual(x, res_ptr, rows, cols, mask, num_heads, stride_rt, stride_rh)
    return x


@_jit
def _add_residual(x, res_ptr, rows, cols, mask, num_heads, stride_rt, stride_rh):
    r = tl.load(res_ptr + _row_offsets(rows, num_heads, stride_rt, stride_rh)[:, None] + cols[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@_jit
def _rms_norm_rows(x, w_ptr, out_ptr, out_offs, cols, col_ok, mask, n_cols, eps):
    """Stores rms_norm(x) * weight for a tile of rows x (in x's dtype, masked elements 0)."""
    xf = x.to(tl.float32)
    # Masked columns were loaded as 0, so they add nothing to the sum of squares.
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    # The reference rounds the normalised value to x's dtype, then multiplies by the weight.
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _add_rms_norm_partial_rows(p_ptr, b_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, rows, cols, col_ok, mask, out_offs,
                               stride_pt, stride_split, stride_rt, n_cols, eps,
                               SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                               CACHE_MODIFIER: tl.constexpr):
    """add + RMSNorm of a tile of rows whose x is a split-K product's partials: x is reduced and
    rounded to the residual's dtype (= the product's) as `_reduce_kernel` stores it, then goes on
    as a plain x does. `_rms_norm_kernel` (SPLIT_K > 0) and skinny_gemm's fused
    `_gemm_add_rms_norm_kernel` (its last program) both call this, so their bits cannot drift apart."""
    x = reduce_partial_rows(p_ptr, b_ptr, rows, cols, col_ok, mask, stride_pt, stride_split,
                            SPLIT_K, HAS_BIAS, BLOCK_ROWS, BLOCK_COLS, CACHE_MODIFIER)
    x = _add_residual(x.to(res_ptr.dtype.element_ty), res_ptr, rows, cols, mask, 1, stride_rt, 0)
    tl.store(sum_ptr + out_offs, x, mask=mask)
    _rms_norm_rows(x, w_ptr, out_ptr, out_offs, cols, col_ok, mask, n_cols, eps)


@_jit
def _row_tile(num_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's block of rows: row and column indices, the in-bounds mask and the offsets
    into a contiguous [num_rows, n_cols] output."""
    return _row_tile_at(tl.program_id(0) * BLOCK_ROWS, num_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)


@_jit
def _row_tile_at(first_row, num_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """`_row_tile` for the rows first_row.. (skinny_gemm's fused norm walks its rows with it)."""
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    out_offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    return rows, cols, col_ok, mask, out_offs


@_jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, b_ptr,
                     num_rows, num_heads, stride_xt, stride_xh, stride_rt, stride_rh, stride_split, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr):
    """SPLIT_K = 0: x_ptr is x. SPLIT_K > 0: x_ptr is a split-K product's fp32 partials (2-D rows,
    num_heads = 1, a residual always), reduced here and rounded to the residual's dtype (= x's)."""
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    rows, cols, col_ok, mask, out_offs = _row_tile(num_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    if SPLIT_K > 0:
        _add_rms_norm_partial_rows(x_ptr, b_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, rows, cols, col_ok, mask, out_offs,
                                   stride_xt, stride_split, stride_rt, n_cols, eps, SPLIT_K, HAS_BIAS, BLOCK_ROWS, BLOCK_COLS, "")
    else:
        x = _load_rows(x_ptr, res_ptr, rows, cols, mask, num_heads, stride_xt, stride_xh, stride_rt, stride_rh, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + out_offs, x, mask=mask)
        _rms_norm_rows(x, w_ptr, out_ptr, out_offs, cols, col_ok, mask, n_cols, eps)


@_jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, add_ptr, out_ptr,
                       num_rows, num_heads, stride_xt, stride_xh, stride_rt, stride_rh, n_cols, eps,
                       HAS_RESIDUAL: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    rows, cols, col_ok, mask, out_offs = _row_tile(num_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    x = _load_rows(x_ptr, res_ptr, rows, cols, mask, num_heads, stride_xt, stride_xh, stride_rt, stride_rh, HAS_RESIDUAL)
    if HAS_ADD:  # rounded to x's dtype, as the residual's sum is
        a = tl.load(add_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + a[None, :]).to(x.dtype)  # masked columns stay 0
    x = x.to(tl.float32)
    # Two passes over registers (mean, then centred variance): as accurate as torch's Welford.
    mean = tl.sum(x, axis=1) / n_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)
