"""The online-softmax tile step that florist's attention kernels share (`short_attention`'s
`_short_attention_kernel`, `decode_attention`'s `_decode_kernel`).

Per query row a program keeps a running max m, a running sum l and an unnormalised output acc, in
fp32 with scores in base 2 (log2(e) folded into the scale). One tile of keys, with its scores s
(keys a row may not see at -inf) and values v, moves them on:

    m_new = max(m, max_j s_j)
    p     = 2^(s - m_new)             this tile's weights under the new max
    alpha = 2^(m - m_new)             rescales what was summed under the old max
    l     = l * alpha + sum_j p_j
    acc   = acc * alpha + p @ v
    m     = m_new                     and after the last tile: out = acc / l

A row that has seen no visible key has m_new = -inf, and 2^(-inf - (-inf)) is NaN. A kernel keeps
that out in one of two ways:

    * a finite floor: m starts at -1e30 (short attention), so m_new is finite and a masked score
      gives 2^(-inf) = 0; call with GUARD_NEG_INF=False;
    * GUARD_NEG_INF=True: m starts at -inf (decode attention stores m for its slice merge) and an
      m_new of -inf is replaced by 0 in the exponents only (p = 2^(-inf) = 0, alpha = 2^(-inf) = 0;
      the returned m stays -inf).

A NaN score is not masked either way: its p is NaN, so its row's l, acc and output are NaN, as in
the reference.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernels that call this are never launched
    triton = None

# NOTE: without triton the helper below is a plain (never called) function; the annotations are
# strings (`from __future__ import annotations`), which triton.jit reads as constexpr markers.
_jit = triton.jit if triton is not None else (lambda fn: fn)


@_jit
def online_softmax_step(s, v, m, l, acc, IEEE: tl.constexpr, GUARD_NEG_INF: tl.constexpr):
    """One key tile: s fp32 [ROWS, KEYS] base-2 scores, v [KEYS, D] values; m, l fp32 [ROWS] and
    acc fp32 [ROWS, D] as above. Returns the new (m, l, acc). IEEE: fp32 inputs, exact fp32
    products (not TF32); otherwise p is rounded to v's dtype for the product, as flash attention
    kernels do."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if GUARD_NEG_INF:
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_exp = m_new
    p = tl.exp2(s - m_exp[:, None])
    alpha = tl.exp2(m - m_exp)
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@_jit
def online_softmax_step_scaled(s, qk_scale, v, m, l, acc):
    """`online_softmax_step` (fp16/bf16 values, a finite floor for m) on raw scores s, the base-2
    scale applied in the exponent's multiply-add: max(s * c) = max(s) * c for c > 0, so
    p = 2^(s * c - m_new) is one FFMA a score instead of a multiply and a subtraction. m and
    m_new are in the scaled domain, as before; masked scores are -inf (-inf * c - m = -inf)."""
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc
