"""BERT's input embeddings in one kernel: word + position + token type rows, then LayerNorm.

    out[t] = layer_norm(word[ids[t]] + pos[positions[t]] + types[type_ids[t] or 0])

The torch path is three gathers, two adds and a LayerNorm (six launches, three [T, H]
intermediates); the kernel gathers the rows of a block of tokens, sums them rounding after each
add as the reference does (`a + b` in the model's dtype), and normalises in fp32 like
`_layer_norm_kernel` in norms.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from florist.kernels import norms, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference below is the whole implementation
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def embed_layer_norm_ref(ids, positions, type_ids, word, pos, types, weight, bias, eps: float) -> torch.Tensor:
    x = F.embedding(ids, word) + F.embedding(positions, pos)
    x = x + (F.embedding(type_ids, types) if type_ids is not None else types[0])
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def embed_layer_norm(ids, positions, type_ids, word, pos, types, weight, bias, eps: float) -> torch.Tensor:
    tables = (word, pos, types, weight, bias)
    if (triton is not None and word.is_cuda and word.dtype in _DTYPES and all(t.dtype == word.dtype and t.is_contiguous() for t in tables)
            and triton.next_power_of_2(word.shape[1]) <= 4096):
        return embed_layer_norm_triton(ids, positions, type_ids, word, pos, types, weight, bias, eps)
    return embed_layer_norm_ref(ids, positions, type_ids, word, pos, types, weight, bias, eps)


def embed_layer_norm_triton(ids, positions, type_ids, word, pos, types, weight, bias, eps: float) -> torch.Tensor:
    """ids/positions/type_ids: [T] int32 or int64, in range (the engine checks ids on the host)."""
    h = word.shape[1]
    assert all(t.dim() == 2 and t.shape[1] == h and t.is_contiguous() for t in (word, pos, types)), "tables must be contiguous [rows, H]"
    assert weight.shape == (h,) and bias.shape == (h,), f"LayerNorm parameters must be [{h}]"
    assert ids.shape == positions.shape and (type_ids is None or type_ids.shape == ids.shape) and ids.dim() == 1
    assert not word.is_cuda or word.device.index == torch.cuda.current_device(), (
        f"tensors are on {word.device} but the current CUDA device is {torch.cuda.current_device()}"
    )
    num_tokens = ids.shape[0]
    out = torch.empty((num_tokens, h), dtype=word.dtype, device=word.device)
    if num_tokens == 0:
        return out
    block_rows, block_cols, num_warps = norms._row_blocking(h, layer_norm=True)
    _embed_layer_norm_kernel[(triton.cdiv(num_tokens, block_rows),)](
        ids, positions, type_ids if type_ids is not None else ids, word, pos, types, weight, bias, out, num_tokens, h, eps,
        HAS_TYPES=type_ids is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        **pdl.launch_args(word),
    )
    return out


@_jit
def _embed_layer_norm_kernel(ids_ptr, pos_ids_ptr, type_ids_ptr, word_ptr, pos_ptr, types_ptr, w_ptr, b_ptr, out_ptr, num_tokens, H, eps,
                             HAS_TYPES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pdl.pdl_trigger(PDL, ONE_PASS=True)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok, col_ok = rows < num_tokens, cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pos = tl.load(pos_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if HAS_TYPES:
        types = tl.load(type_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        types = tl.zeros((BLOCK_ROWS,), dtype=tl.int64)
    dtype = out_ptr.dtype.element_ty
    x = tl.load(word_ptr + ids[:, None] * H + cols[None, :], mask=mask, other=0.0)
    p = tl.load(pos_ptr + pos[:, None] * H + cols[None, :], mask=mask, other=0.0)
    x = (x.to(tl.float32) + p.to(tl.float32)).to(dtype)  # rounded like the reference's bf16/fp16 adds
    y = tl.load(types_ptr + types[:, None] * H + cols[None, :], mask=mask, other=0.0)
    x = (x.to(tl.float32) + y.to(tl.float32)).to(dtype).to(tl.float32)
    mean = tl.sum(x, axis=1) / H
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / H + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], (centred * rstd[:, None] * w[None, :] + b[None, :]).to(dtype), mask=mask)
