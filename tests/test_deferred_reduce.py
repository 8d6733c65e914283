"""Split-K reduction deferred into the next add + RMSNorm (skinny_gemm.SplitKPartials,
RowParallelLinear.forward_deferred, norms.add_rms_norm), from the model's side.

The kernels themselves are compared in tests/kernel_cases.py (interpreted on CPU, compiled on
CUDA). Here, on CPU, where the product never splits K:
  * forward_deferred is forward (a tensor) on CPU and at tensor-parallel size > 1;
  * a stand-in product that always returns partials (`fake_split_k`) drives every Qwen3 path
    (full model, last-token-only final layer, reranker, generation) through the consumers of
    o_proj and down_proj: deferring must give the same bits as reducing at once.
With CUDA, Qwen3 layers at the 0.6B geometry give the same bits fused and forced unfused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import florist
from florist.engine.batch import HostBatch, to_device
from florist.kernels import norms, skinny_gemm
from florist.kernels.skinny_gemm import SplitKPartials
from florist.layers import linear
from florist.layers.linear import RowParallelLinear
from florist.layers.norm import RMSNorm

CUDA = torch.cuda.is_available()
EPS = 1e-6


def _row_parallel(input_size: int, output_size: int, bias: bool, seed: int = 0) -> RowParallelLinear:
    g = torch.Generator().manual_seed(seed)
    layer = RowParallelLinear(input_size, output_size, bias=bias)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    return layer


def _split_k_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int) -> SplitKPartials:
    """The product as fp32 partial sums over `splits` slices of K, as the split-K kernel stores them."""
    slices = zip(x.float().tensor_split(splits, dim=1), weight.float().tensor_split(splits, dim=1))
    return SplitKPartials(torch.stack([xs @ ws.T for xs, ws in slices]), bias, x.dtype)


def fake_split_k(monkeypatch, *, reduce_at_once: bool, splits: int = 3) -> list[SplitKPartials]:
    """Every deferred product returns partials (reduced on the spot with `reduce_at_once`);
    returns the list of partials made."""
    real, made = skinny_gemm.skinny_gemm, []

    def product(x, weight, bias=None, silu_mul=False, gelu=False, config=None, defer_reduce=False):
        if not defer_reduce:
            return real(x, weight, bias, silu_mul, gelu, config)
        made.append(_split_k_partials(x, weight, bias, splits))
        return made[-1].reduce() if reduce_at_once else made[-1]

    monkeypatch.setattr(skinny_gemm, "skinny_gemm", product)
    return made


# ---------------------------------------------------------------------------------------------
# dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_deferred_is_forward_on_cpu(dtype):
    layer = _row_parallel(48, 24, bias=True).to(dtype)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = layer.forward_deferred(x)
    assert type(y) is torch.Tensor and torch.equal(y, layer(x))
    assert type(skinny_gemm.skinny_gemm(x, layer.weight, layer.bias, defer_reduce=True)) is torch.Tensor


def test_forward_deferred_at_tensor_parallel_size_above_one_all_reduces(monkeypatch):
    """The all-reduce needs the finished product, so at TP > 1 nothing is deferred."""
    made = fake_split_k(monkeypatch, reduce_at_once=False)
    reduced = []
    monkeypatch.setattr(linear, "all_reduce", lambda t: reduced.append(t) or t)
    layer = _row_parallel(48, 24, bias=True)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
    assert isinstance(layer.forward_deferred(x), SplitKPartials) and len(made) == 1  # TP 1: deferred
    layer.tp_size = 2  # what this rank's layer looks like at TP 2 (rank 0: it adds the bias)
    y = layer.forward_deferred(x)
    assert type(y) is torch.Tensor and len(made) == 1 and len(reduced) == 1
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_norms_take_partials_on_cpu(dtype, bias):
    """The reference path: reduce (in the reduce kernel's order and rounding), then the norm."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    p = _split_k_partials(x, w, b, splits=4)
    p.partials[1, 2, 3] = float("nan")
    res, norm_w = torch.randn(7, 40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    reduced = p.reduce()
    assert reduced.dtype == dtype and reduced[2, 3].isnan()
    torch.testing.assert_close(reduced, skinny_gemm.reduce_partials_ref(p), rtol=0, atol=0, equal_nan=True)
    expected = (p.partials[0] + p.partials[1] + p.partials[2] + p.partials[3] + (0 if b is None else b.float())).to(dtype)
    torch.testing.assert_close(reduced, expected, rtol=0, atol=0, equal_nan=True)
    norm = RMSNorm(40, EPS).to(dtype)
    norm.weight.copy_(norm_w)
    for got, want in zip(norm(p, res), norms.add_rms_norm_ref(reduced, res, norm_w, EPS)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(norm(p), norms.rms_norm_ref(reduced, norm_w, EPS), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# every Qwen3 consumer of o_proj / down_proj handles partials (CPU, a stand-in split-K product)


def _forward(engine, lens, seed=0):
    rng = np.random.default_rng(seed)
    host = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=n).astype(np.int32) for n in lens])
    with torch.inference_mode():
        return engine.runner.forward(to_device(host, torch.device("cpu")))


@pytest.mark.parametrize("fixture", ["qwen3_dir", "reranker_dir"])
def test_qwen3_deferred_partials_equal_reduced_at_once(request, fixture, monkeypatch):
    task = "score" if fixture == "reranker_dir" else None
    engine = florist.Engine.from_pretrained(request.getfixturevalue(fixture), device="cpu", task=task)
    model = engine.runner.model.model
    for lens in ([3, 17, 1], [6]):
        for last_token_only in (True, False):  # the final layer on B rows (forward_last), or all
            model.last_token_only = last_token_only
            unpatched = _forward(engine, lens)
            with monkeypatch.context() as m:
                made = fake_split_k(m, reduce_at_once=True)
                at_once = _forward(engine, lens)
            with monkeypatch.context() as m:
                deferred_made = fake_split_k(m, reduce_at_once=False)
                deferred = _forward(engine, lens)
            assert len(made) == len(deferred_made) == 2 * len(model.layers)  # o_proj and down_proj
            assert torch.equal(deferred, at_once), f"{fixture} {lens} last_token_only={last_token_only}"
            torch.testing.assert_close(deferred, unpatched, atol=1e-5, rtol=1e-5)  # partials sum to the product


def test_generation_with_deferred_partials(tmp_path, monkeypatch):
    from test_generation import make_causal_lm, prompts_for

    path = make_causal_lm(tmp_path / "lm", tie=True)
    engine = florist.Engine.from_pretrained(path, device="cpu")
    prompts = prompts_for(path, (1, 9, 23))
    unpatched = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    with monkeypatch.context() as m:
        fake_split_k(m, reduce_at_once=True)
        at_once = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    with monkeypatch.context() as m:
        made = fake_split_k(m, reduce_at_once=False)
        deferred = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    assert made and deferred == at_once == unpatched


# ---------------------------------------------------------------------------------------------
# GPU: the real fused kernels in Qwen3 layers


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_dispatch_of_partials(monkeypatch):
    """On CUDA: RMSNorm with a residual runs the fused kernel; without one, or where the fused
    kernel does not apply, the partials are reduced by the reduce kernel first."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 256, generator=g).bfloat16().cuda(), torch.randn(1000, 256, generator=g).bfloat16().cuda()
    p = _split_k_partials(x, w, torch.randn(1000, generator=g).bfloat16().cuda(), splits=4)
    res = torch.randn(9, 1000, generator=g).bfloat16().cuda()
    norm = RMSNorm(1000, EPS).to("cuda", torch.bfloat16)
    fused = []
    launch = norms._launch_add_rms_norm_partials
    monkeypatch.setattr(norms, "_launch_add_rms_norm_partials", lambda *a: fused.append(1) or launch(*a))
    reduced = p.reduce()
    assert torch.equal(reduced, skinny_gemm.reduce_partials_ref(p))
    for got, want in zip(norm(p, res), norms.add_rms_norm_triton(reduced, res, norm.weight, EPS)):
        assert torch.equal(got, want)
    assert len(fused) == 1
    assert torch.equal(norm(p), norms.rms_norm_triton(reduced, norm.weight, EPS))
    assert len(fused) == 1
    # A residual the fused kernel does not take (another dtype): reduce first, then the reference.
    got = norms.add_rms_norm(p, res.float(), norm.weight, EPS)
    assert len(fused) == 1
    for a, e in zip(got, norms.add_rms_norm_ref(reduced, res.float(), norm.weight, EPS)):
        assert torch.equal(a, e)


def _qwen3_0_6b_layers(num_layers: int, device: torch.device, dtype: torch.dtype):
    """Qwen3-0.6B's geometry (o_proj 1024 x 2048, down_proj 1024 x 3072: split K at <= 64 rows)
    with random weights."""
    from florist.config import ModelConfig
    from florist.layers.attention import select_backend
    from florist.models.qwen3 import Qwen3Model

    cfg = ModelConfig.from_hf({
        "model_type": "qwen3", "architectures": ["Qwen3Model"], "vocab_size": 1000, "hidden_size": 1024,
        "num_hidden_layers": num_layers, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    })
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3Model(cfg, select_backend(None, device, cfg.head_dim, dtype)).to(device)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        scale = 1.0 if p.dim() == 1 or "embed" in name else p.shape[1] ** -0.5
        p.copy_((torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0)).to(dtype))
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_qwen3_fused_reduce_equals_unfused_on_gpu(monkeypatch):
    device = torch.device("cuda")
    model = _qwen3_0_6b_layers(3, device, torch.bfloat16)
    fused_launches = []
    launch = norms._launch_add_rms_norm_partials
    monkeypatch.setattr(norms, "_launch_add_rms_norm_partials", lambda *a: fused_launches.append(1) or launch(*a))
    rng = np.random.default_rng(0)
    for lens in ([1], [17], [64], [5, 1, 9], [3] * 8, [100]):  # 100 rows: cuBLAS, nothing deferred
        host = HostBatch.from_sequences([rng.integers(0, 1000, size=n).astype(np.int32) for n in lens])
        batch = to_device(host, device)
        for last_token_only in (False, True):
            model.last_token_only = last_token_only
            fused_launches.clear()
            with torch.inference_mode():
                fused = model(batch)
                with monkeypatch.context() as m:
                    m.setattr(RowParallelLinear, "forward_deferred", RowParallelLinear.forward)
                    unfused = model(batch)
            # Both products of every layer with <= 64 rows fused (the final layer's rows are the
            # B last tokens with last_token_only).
            final_rows = len(lens) if last_token_only else sum(lens)
            expected = 2 * (len(model.layers) - 1) * (sum(lens) <= 64) + 2 * (final_rows <= 64)
            assert len(fused_launches) == expected, (lens, last_token_only, len(fused_launches))
            assert torch.equal(fused, unfused), f"{lens} last_token_only={last_token_only}"
