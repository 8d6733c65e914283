"""Qwen3's qkv product with QK-norm + rotary in one launch (florist/kernels/qkv_rope.py). The
kernel against its references is in tests/kernel_cases.py; here: when it applies, and a model
that runs it against the same model running the two launches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from florist.engine.batch import HostBatch, to_device
from florist.kernels import qkv_rope, rotary


def test_pick_takes_whole_heads_of_128_at_129_to_512_rows():
    assert all(qkv_rope.pick(m, 128) is not None and qkv_rope.pick(m, 128).block_n == 128 for m in (129, 200, 256, 385, 512))
    assert all(qkv_rope.pick(m, 128) is None for m in (1, 64, 128, 513))
    assert qkv_rope.pick(128, 64) is None and qkv_rope.pick(128, 256) is None


def test_cpu_tensors_take_the_two_launches():
    x, w = torch.randn(8, 128), torch.randn((2 + 2) * 64, 128)
    cache = torch.randn(16, 64)
    args = (x, w, torch.ones(64), torch.ones(64), 1e-6, torch.arange(8), cache, 2, 1)
    assert not qkv_rope.applies(*args[:4], *args[5:])
    assert qkv_rope.qkv_norm_rope(*args) is None


def test_reference_is_the_product_then_qk_norm_rope():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn((3 + 2) * 8, 32, generator=g)
    cache, pos = torch.randn(16, 8, generator=g), torch.tensor([0, 3, 1, 7, 2])
    q, k, v = qkv_rope.qkv_norm_rope_ref(x, w, torch.ones(8), torch.ones(8) * 2, 1e-6, pos, cache, 3, 1)
    y = F.linear(x, w)
    want_q, want_k = rotary.qk_norm_rope_ref(y[:, :24].reshape(5, 3, 8), y[:, 24:32].reshape(5, 1, 8), torch.ones(8), torch.ones(8) * 2,
                                             1e-6, pos, cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, y[:, 32:].reshape(5, 1, 8))


@pytest.mark.gpu(capability=(9, 0))
def test_qwen3_layers_give_the_two_launches_outputs(monkeypatch):
    """Qwen3-0.6B's geometry, bf16: every layer's qkv goes through the one launch at 129-512 rows
    (ragged batches too: positions restart per sequence) and the model's output matches the same
    model with it off; above 512 rows nothing changes."""
    from test_deferred_reduce import _qwen3_0_6b_layers

    device = torch.device("cuda")
    model = _qwen3_0_6b_layers(3, device, torch.bfloat16)
    model.last_token_only = False  # every layer over every token
    launches = []
    launch = qkv_rope.qkv_norm_rope_triton
    monkeypatch.setattr(qkv_rope, "qkv_norm_rope_triton", lambda *a, **k: launches.append(a[0].shape[0]) or launch(*a, **k))
    rng = np.random.default_rng(0)
    for lens in ([37], [100], [128], [200], [60, 70, 9], [512], [300, 213]):
        host = HostBatch.from_sequences([rng.integers(0, 1000, size=n).astype(np.int32) for n in lens])
        batch = to_device(host, device)
        launches.clear()
        with torch.inference_mode():
            fused = model(batch).float()
            monkeypatch.setattr(qkv_rope, "ENABLED", False)
            two = model(batch).float()
            monkeypatch.setattr(qkv_rope, "ENABLED", True)
        rows = sum(lens)
        assert launches == ([rows] * len(model.layers) if qkv_rope.pick(rows, 128) is not None else []), (lens, launches)
        cos = F.cosine_similarity(fused, two, dim=-1)
        assert cos.min() > 0.9999, f"{lens}: cosine {cos.min()}"
