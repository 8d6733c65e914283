"""The one-launch decode attention kernel against its reference (SDPA over the gathered cache):
under Triton's interpreter on the CPU, compiled on CUDA (skipped without it)."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from florist.kernels.decode_attention import decode_attention, decode_attention_ref, num_splits

CASES = """
import math
import torch
from florist.kernels import decode_attention as da

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}  # 16-bit: p is rounded for the PV product


def inputs(g, batch, heads, kv_heads, head_dim, slots, max_len, dtype, device):
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :heads]  # a strided view, as sliced from a fused qkv projection
    k_cache = torch.randn(slots, max_len, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, max_len, kv_heads, head_dim, generator=g).to(dtype)
    slot_ids = torch.randperm(slots, generator=g)[:batch]
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0] = 1
    if batch > 1:
        lens[1] = max_len
    for b in range(batch):  # stale rows past each length hold NaN / inf: they must be masked out
        n = int(lens[b])
        if n < max_len:
            k_cache[slot_ids[b], n:] = float("nan")
            v_cache[slot_ids[b], n:] = float("inf")
    return [t.to(device) for t in (q, k_cache, v_cache, slot_ids, lens)]


def reference(q, k_cache, v_cache, slots, lens, scale):
    clean = [torch.nan_to_num(t.float().cpu(), nan=0.0, posinf=0.0) for t in (k_cache, v_cache)]
    return da.decode_attention_ref(q.float().cpu(), *clean, slots.cpu(), lens.cpu(), scale)


def check(device):
    g = torch.Generator().manual_seed(0)
    shapes = [  # batch, q heads, kv heads, head_dim, slots, max_len
        (1, 16, 8, 128, 2, 70),
        (3, 4, 4, 32, 5, 33),
        (2, 6, 2, 24, 4, 100),  # group 3 and head_dim 24: both padded to powers of two
        (5, 2, 1, 64, 6, 17),
    ]
    # NOTE: Triton's interpreter computes bf16 tensor-core products wrongly: bf16 runs compiled only.
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device == "cuda" else (torch.float32, torch.float16)
    for (batch, heads, kv_heads, head_dim, slots, max_len), dtype in [(s, d) for s in shapes for d in dtypes]:
        q, k_cache, v_cache, slot_ids, lens = inputs(g, batch, heads, kv_heads, head_dim, slots, max_len, dtype, device)
        scale = 1.0 / math.sqrt(head_dim)
        expected = reference(q, k_cache, v_cache, slot_ids, lens, scale)
        # min_split_keys below the lengths here exercises the merge (and slices that go unused)
        for splits, min_keys in ((1, 256), (2, 16), (4, 16), (4, 1), (None, 8), (None, 256)):
            counters = torch.zeros(64, dtype=torch.int32, device=device)
            out = da.decode_attention_triton(q, k_cache, v_cache, slot_ids, lens, scale, splits, counters=counters, min_split_keys=min_keys)
            assert out.shape == (batch, heads, head_dim) and out.dtype == dtype
            assert torch.isfinite(out).all(), (dtype, splits, "stale NaN/inf leaked into the output")
            torch.testing.assert_close(out.float().cpu(), expected, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{dtype} splits={splits}: {m}")
            assert not counters.any(), "every launch leaves its counters at zero"
            again = da.decode_attention_triton(q, k_cache, v_cache, slot_ids, lens, scale, splits, counters=counters, min_split_keys=min_keys)
            assert torch.equal(out, again), "the merge order is fixed: the same inputs give the same bits"
            assert not counters.any()
    # NaN inside the context reaches the output of the heads that read it, as in the reference
    q, k_cache, v_cache, slot_ids, lens = inputs(g, 2, 4, 2, 32, 3, 40, torch.float32, device)
    v_cache[slot_ids[1], 0, 1, 3] = float("nan")
    out = da.decode_attention_triton(q, k_cache, v_cache, slot_ids, lens, 0.2, 4, counters=torch.zeros(8, dtype=torch.int32, device=device),
                                     min_split_keys=8)
    nan = out.isnan().cpu()
    assert nan[1, 2:, 3].all() and nan.sum() == 2, nan.nonzero()
    print("decode attention ok")


def rope_inputs(g, batch, heads, kv_heads, head_dim, slots, max_len, dtype, device):
    # Raw (not normed, not rotated) q/k/v as views of one projection, norm weights, a cos|sin
    # cache, and caches whose rows from each sequence's current position on hold NaN / inf (the
    # fused launch must write this step's row before it reads it).
    q_raw, k_cache, v_cache, slot_ids, lens = inputs(g, batch, heads, kv_heads, head_dim, slots, max_len, dtype, "cpu")
    qkv = (torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=g) * 3).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)]
    angles = torch.rand(max_len, head_dim // 2, generator=g) * 50
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    for b in range(batch):
        k_cache[slot_ids[b], int(lens[b]) - 1 :] = float("nan")
        v_cache[slot_ids[b], int(lens[b]) - 1 :] = float("inf")
    return [t.to(device) for t in (q, k, v, *weights, cos_sin, k_cache, v_cache, slot_ids, lens)]


def check_rope(device):
    from florist.kernels import rotary

    g = torch.Generator().manual_seed(1)
    shapes = [(1, 16, 8, 128, 2, 70), (3, 6, 2, 32, 5, 100), (2, 4, 4, 64, 3, 40)]
    dtypes = (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,)
    eps = 1e-6
    for (batch, heads, kv_heads, head_dim, slots, max_len), dtype in [(s, d) for s in shapes for d in dtypes]:
        q, k, v, qw, kw, cos_sin, k_cache, v_cache, slot_ids, lens = rope_inputs(g, batch, heads, kv_heads, head_dim, slots, max_len, dtype, device)
        scale = 1.0 / math.sqrt(head_dim)
        positions = lens.long() - 1
        assert da.qk_norm_rope_applies(q, k, v, qw, kw, cos_sin, k_cache, v_cache) == (device == "cuda")
        # The reference: norm + rotary, the store, attention over the gathered cache (fp32, CPU).
        ref_k, ref_v = k_cache.float().cpu().clone(), v_cache.float().cpu().clone()
        rq, rk = rotary.qk_norm_rope_ref(q.cpu(), k.cpu(), qw.cpu(), kw.cpu(), eps, positions.cpu(), cos_sin.cpu())
        for b in range(batch):
            ref_k[slot_ids[b], positions[b]] = rk[b].float()
            ref_v[slot_ids[b], positions[b]] = v[b].float().cpu()
        expected = reference(rq, ref_k, ref_v, slot_ids, lens, scale)
        for splits, min_keys in ((1, 256), (4, 16), (16, 8), (None, 8)):
            # Two launches: the rotary kernel (which stores k/v), then decode attention.
            rows = slots * max_len
            two_k, two_v = k_cache.clone(), v_cache.clone()
            store = (v, two_k.view(rows, kv_heads, head_dim), two_v.view(rows, kv_heads, head_dim), slot_ids * max_len + positions)
            q_rot, _ = rotary.qk_norm_rope_triton(q, k, qw, kw, eps, positions, cos_sin, kv_store=store)
            counters = torch.zeros(64, dtype=torch.int32, device=device)
            two = da.decode_attention_triton(q_rot, two_k, two_v, slot_ids, lens, scale, splits, counters=counters, min_split_keys=min_keys)
            # One launch.
            one_k, one_v = k_cache.clone(), v_cache.clone()
            one = da.decode_attention_triton(q, one_k, one_v, slot_ids, lens, scale, splits, counters=counters, min_split_keys=min_keys,
                                             rope=(k, v, qw, kw, eps, cos_sin))
            assert not counters.any()
            tag = f"{dtype} {(batch, heads, kv_heads, head_dim)} splits={splits} min_keys={min_keys}"
            for got, want in ((one_k, two_k), (one_v, two_v)):  # the same rows written, the rest untouched
                torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{tag} cache: {m}")
            torch.testing.assert_close(one.cpu(), two.cpu(), rtol=0, atol=0, msg=lambda m: f"{tag} vs two launches: {m}")
            torch.testing.assert_close(one.float().cpu(), expected, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{tag} vs reference: {m}")
    print("decode attention with qk-norm + rope ok")
"""


# check: the kernel against its reference; check_rope: the one launch with QK-norm + rotary + the
# KV store against the rotary kernel (with its store) then decode attention, bit for bit (the same
# cache rows and outputs), and against the references.
CHECKS = {"check": "decode attention ok", "check_rope": "decode attention with qk-norm + rope ok"}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_decode_attention_interpreted(check):
    run_interpreted(CASES, f"{check}('cpu')", CHECKS[check], timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_decode_attention_compiled(check):
    namespace: dict = {}
    exec(CASES, namespace)
    namespace[check]("cuda")


def test_decode_attention_takes_the_reference_on_cpu():
    q = torch.randn(2, 4, 16)
    k, v = torch.randn(3, 10, 2, 16), torch.randn(3, 10, 2, 16)
    slots, lens = torch.tensor([2, 0]), torch.tensor([4, 10], dtype=torch.int32)
    torch.testing.assert_close(decode_attention(q, k, v, slots, lens, 0.25), decode_attention_ref(q, k, v, slots, lens, 0.25))


def test_num_splits_spreads_small_batches():
    assert num_splits(1, 8) == 16  # batch-1 decode of the Qwen3-0.6B geometry: 128 programs
    assert num_splits(32, 8) == 1
    assert all(num_splits(b, h) & (num_splits(b, h) - 1) == 0 for b in range(1, 70) for h in (1, 2, 8))


def test_decode_backend_choice():
    from florist.layers import cached_attention as ca

    assert ca.select_decode_backend(None, torch.device("cpu"), 128, torch.bfloat16).__qualname__.startswith("_torch_decode")
    assert ca.select_decode_backend("triton", torch.device("cpu"), 128, torch.bfloat16).__qualname__.startswith("_triton_decode")
    with pytest.raises(ValueError, match="unknown decode attention backend"):
        ca.select_decode_backend("auto", torch.device("cpu"), 128, torch.bfloat16)


def test_flash_decode_says_when_torch_lacks_it(monkeypatch):
    from florist.layers import cached_attention as ca

    monkeypatch.setattr(ca, "flash_decode_available", lambda: False)
    with pytest.raises(ValueError, match="seqused_k"):
        ca.select_decode_backend("flash", torch.device("cuda"), 128, torch.bfloat16)

