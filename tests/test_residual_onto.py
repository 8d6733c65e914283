"""o and down products accumulated onto their residual (`RowParallelLinear.forward_onto`): BERT's,
with the bias added in the LayerNorm that follows (`add_layer_norm(add=...)`), and Qwen3's, with
the RMSNorm reading the sum alone (`forward_add_norm`): the same outputs as the product, the
residual add and the norm apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import florist
from florist.engine.batch import HostBatch, to_device
from florist.kernels import skinny_gemm
from florist.layers import linear
from florist.layers.linear import RowParallelLinear
from florist.layers.norm import LayerNorm, RMSNorm
from florist.models.bert import _project_add_norm


def _parts(norm, bias: bool, dtype=torch.float32, device="cpu", rows=8, hidden=48, inner=80, seed=0):
    """A product (random weights, with or without bias), the norm after it (random weights), its
    input h and a residual."""
    gen = torch.Generator().manual_seed(seed)
    proj = RowParallelLinear(inner, hidden, bias=bias)
    with torch.no_grad():
        for p in (*proj.parameters(), *norm.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    proj, norm = proj.to(device, dtype), norm.to(device, dtype)
    h = torch.randn(rows, inner, generator=gen).to(device, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    return proj, norm, h, residual


def _layer_parts(dtype=torch.float32, device="cpu", rows=8, hidden=48, inner=80):
    return _parts(LayerNorm(hidden, 1e-12), True, dtype, device, rows, hidden, inner, seed=0)


def _rms_parts(device="cpu", rows=8, hidden=64, inner=96, dtype=torch.float32):
    return _parts(RMSNorm(hidden, 1e-6), False, dtype, device, rows, hidden, inner, seed=1)


def _embeds_the_same_either_way(engine, host: HostBatch, monkeypatch) -> None:
    """The whole model eagerly, with and without the residual path: every o and down product takes
    the setting's path, and the outputs agree (cosine > 0.9999)."""
    batch = to_device(host, torch.device("cuda"))
    calls = []
    onto = RowParallelLinear.forward_onto

    def spy(self, x, residual, min_rows=None):
        out = onto(self, x, residual, min_rows)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(RowParallelLinear, "forward_onto", spy)
    outs = {}
    for enabled in (False, True):
        monkeypatch.setattr(linear, "ONTO_ENABLED", enabled)
        calls.clear()
        outs[enabled] = engine.runner.forward(batch).float()
        assert calls and all(c == enabled for c in calls), calls
    cos = F.cosine_similarity(outs[True], outs[False], dim=1).min().item()
    assert cos > 0.9999, cos


def test_layer_norm_adds_the_vector_before_normalising():
    _, norm, _, x = _layer_parts()
    add = torch.randn(x.shape[1]) * 3
    expected = F.layer_norm(x + add, (x.shape[1],), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(norm(x, add=add), expected)
    assert not torch.allclose(norm(x), expected, atol=1e-2)


def test_off_the_gpu_the_product_and_the_residual_stay_apart():
    proj, norm, h, residual = _layer_parts()
    kept = residual.clone()
    assert proj.forward_onto(h, residual) is None
    out = _project_add_norm(proj, h, residual, norm)
    torch.testing.assert_close(residual, kept)  # not written
    torch.testing.assert_close(out, F.layer_norm(F.linear(h, proj.weight, proj.bias) + kept, (kept.shape[1],),
                                                 norm.weight, norm.bias, norm.eps))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_onto_the_residual_matches_the_product_apart(dtype, monkeypatch):
    rows = linear.ONTO_MIN_ROWS + 37
    proj, norm, h, residual = _layer_parts(dtype, "cuda", rows=rows, hidden=384, inner=1536)
    monkeypatch.setattr(linear, "ONTO_ENABLED", False)
    apart = _project_add_norm(proj, h, residual.clone(), norm)
    monkeypatch.setattr(linear, "ONTO_ENABLED", True)
    onto_residual = residual.clone()
    onto = _project_add_norm(proj, h, onto_residual, norm)
    # the path ran: the residual now holds residual + h W^T (no bias)
    torch.testing.assert_close(onto_residual.float(), residual.float() + h.float() @ proj.weight.float().t(), atol=0.5, rtol=2e-2)
    ref = F.layer_norm(F.linear(h.float(), proj.weight.float(), proj.bias.float()) + residual.float(), (384,),
                       norm.weight.float(), norm.bias.float(), norm.eps)
    # both round the sum once to the working dtype: equally far from the fp32 reference
    err_onto, err_apart = (onto.float() - ref).abs().max().item(), (apart.float() - ref).abs().max().item()
    assert err_onto <= 2 * err_apart + 1e-3, (err_onto, err_apart)
    cos = F.cosine_similarity(onto.float(), apart.float(), dim=1).min().item()
    assert cos > 0.9999, cos
    # below the row bound the product keeps its bias epilogue and the residual is left alone
    small = residual[:64].clone()
    assert proj.forward_onto(h[:64], small) is None
    torch.testing.assert_close(small, residual[:64])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_a_bert_batch_embeds_the_same_onto_the_residual(bert_dir, monkeypatch):
    """A batch of > ONTO_MIN_ROWS tokens through the whole model, eagerly, with and without."""
    engine = florist.Engine.from_pretrained(bert_dir, device="cuda")
    rng = np.random.default_rng(3)
    host = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=n) for n in rng.integers(40, 64, size=110)])
    assert host.num_tokens >= linear.ONTO_MIN_ROWS
    _embeds_the_same_either_way(engine, host, monkeypatch)


def test_off_the_gpu_every_product_is_left_to_torch():
    proj, _, h, _ = _rms_parts(rows=600)
    assert skinny_gemm.leaves_to_cublas(h, proj.weight, defer_reduce=True)


def test_qwen3_add_rms_norm_off_the_gpu_leaves_the_residual():
    proj, norm, h, residual = _rms_parts(rows=linear.ONTO_RMS_MIN_ROWS)
    kept = residual.clone()
    normed, summed = proj.forward_add_norm(h, residual, norm)
    torch.testing.assert_close(residual, kept)
    torch.testing.assert_close(summed, F.linear(h, proj.weight) + kept)
    torch.testing.assert_close(normed, norm(summed))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("rows", [linear.ONTO_RMS_MIN_ROWS, 5000])
def test_qwen3_add_rms_norm_onto_the_residual(rows, monkeypatch):
    """Qwen3's o / down + add + RMSNorm from ONTO_RMS_MIN_ROWS rows, where cuBLAS runs the product:
    the sum lands on the residual (returned as the new residual), as close to fp32 as the
    two-tensor path."""
    proj, norm, h, residual = _rms_parts("cuda", rows=rows, hidden=1024, inner=2048, dtype=torch.bfloat16)
    monkeypatch.setattr(linear, "ONTO_ENABLED", False)
    normed_apart, summed_apart = proj.forward_add_norm(h, residual.clone(), norm)
    monkeypatch.setattr(linear, "ONTO_ENABLED", True)
    onto_residual = residual.clone()
    normed, summed = proj.forward_add_norm(h, onto_residual, norm)
    assert summed.data_ptr() == onto_residual.data_ptr()  # the path ran: the sum is the residual, in place
    ref_sum = h.float() @ proj.weight.float().t() + residual.float()
    ref = ref_sum * torch.rsqrt(ref_sum.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    for got, apart, want in ((summed, summed_apart, ref_sum), (normed, normed_apart, ref)):
        err, err_apart = (got.float() - want).abs().max().item(), (apart.float() - want).abs().max().item()
        assert err <= 1.5 * err_apart + 1e-2, (err, err_apart)
    for few in (256, linear.ONTO_RMS_MIN_ROWS - 1):  # split-K partials summed by the norm on Hopper; cuBLAS, not measured
        below = residual[:few].clone()
        proj.forward_add_norm(h[:few], below, norm)
        torch.testing.assert_close(below, residual[:few])  # the residual is left alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_a_qwen3_batch_embeds_the_same_onto_the_residual(qwen3_dir, monkeypatch):
    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    rng = np.random.default_rng(5)
    host = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=n) for n in rng.integers(40, 64, size=20)])
    assert host.num_tokens >= 512
    _embeds_the_same_either_way(engine, host, monkeypatch)


def test_the_qwen3_bound_moves_with_its_environment_variable():
    import os
    import subprocess
    import sys
    from pathlib import Path

    def bound(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "FLORIST_RESIDUAL_ONTO_RMS_MIN_ROWS": value}
        return subprocess.run([sys.executable, "-c", "from florist.layers import linear; print(linear.ONTO_RMS_MIN_ROWS)"],
                              check=False, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=120)

    proc = bound("257")
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "257", proc.stderr[-2000:]
    bad = bound("some")
    assert bad.returncode != 0 and "FLORIST_RESIDUAL_ONTO_RMS_MIN_ROWS" in bad.stderr, bad.stderr[-2000:]
