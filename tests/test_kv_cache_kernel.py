"""The KV-cache store kernel against its reference (index_copy_): under Triton's interpreter on
the CPU, compiled on CUDA (skipped without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from florist.kernels.kv_cache import store_kv, store_kv_ref

ROOT = Path(__file__).resolve().parent.parent

CASES = """
import torch
from florist.kernels.kv_cache import store_kv_ref, store_kv_triton

def check(device):
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, heads, head_dim, rows in ((1, 2, 32, 8), (5, 3, 24, 40), (9, 1, 128, 30)):
            qkv = torch.randn(tokens, 4 * heads * head_dim, generator=g).to(dtype).to(device)
            k = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(device)
            v = qkv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)  # strided, as from qkv
            slots = torch.randperm(rows - 1, generator=g)[:tokens].to(device)
            slots[tokens // 2 :] = rows - 1 if tokens > 2 else slots[tokens // 2 :]  # padding rows share the scratch row
            caches = [torch.zeros(rows, heads, head_dim, dtype=dtype, device=device) for _ in range(4)]
            store_kv_triton(k, v, caches[0], caches[1], slots)
            store_kv_ref(k, v, caches[2], caches[3], slots)
            real = slice(0, rows - 1)
            assert torch.equal(caches[0][real], caches[2][real]) and torch.equal(caches[1][real], caches[3][real]), (dtype, tokens)
            # The padding tokens race to the scratch row (one program each, never read back), so
            # it may end up mixing their rows: each value must be one of theirs at its place.
            padding = slots == rows - 1
            if padding.any():
                for cache, src in ((caches[0], k), (caches[1], v)):
                    assert (cache[rows - 1][None] == src[padding]).any(dim=0).all(), (dtype, tokens, "scratch row")
    print("store_kv ok")


def check_rope_store(device):
    # qk_norm_rope with kv_store: q, k as without it, and the cache rows as a separate store.
    from florist.kernels import rotary

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, q_heads, kv_heads, head_dim, rows in ((1, 4, 2, 32, 8), (7, 3, 3, 24, 20), (5, 16, 8, 128, 12)):
            qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
            q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
            qw, kw = (torch.randn(head_dim, generator=g).to(dtype).to(device) for _ in range(2))
            positions = torch.randint(0, 64, (tokens,), generator=g).to(device)
            half = torch.arange(head_dim // 2, dtype=torch.float64)
            freqs = torch.arange(64, dtype=torch.float64)[:, None] / (1e4 ** (2 * half / head_dim))[None, :]
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)
            slots = torch.randperm(rows, generator=g)[:tokens].to(device)
            caches = [torch.full((rows, kv_heads, head_dim), 7.0, dtype=dtype, device=device) for _ in range(4)]
            q1, k1 = rotary.qk_norm_rope_triton(q, k, qw, kw, 1e-6, positions, cos_sin, (v, caches[0], caches[1], slots))
            q2, k2 = rotary.qk_norm_rope_ref(q, k, qw, kw, 1e-6, positions, cos_sin)
            store_kv_ref(k1, v, caches[2], caches[3], slots)
            assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), (dtype, tokens, "cache rows differ from a separate store")
            tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
            torch.testing.assert_close(q1.cpu(), q2.cpu(), rtol=tol, atol=tol)
            torch.testing.assert_close(k1.cpu(), k2.cpu(), rtol=tol, atol=tol)
    print("rope store ok")
"""


def test_store_kv_kernel_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CASES + "\ncheck('cpu')\ncheck_rope_store('cpu')"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "store_kv ok" in proc.stdout and "rope store ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["check", "check_rope_store"])
def test_store_kv_kernel_compiled(case):
    namespace: dict = {}
    exec(CASES, namespace)
    namespace[case]("cuda")


def test_store_kv_takes_the_reference_on_cpu():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    a, b = torch.zeros(6, 2, 8), torch.zeros(6, 2, 8)
    slots = torch.tensor([4, 0, 2])
    store_kv(k, v, a, b, slots)
    c, d = torch.zeros(6, 2, 8), torch.zeros(6, 2, 8)
    store_kv_ref(k, v, c, d, slots)
    assert torch.equal(a, c) and torch.equal(b, d) and torch.equal(a[4], k[0])
