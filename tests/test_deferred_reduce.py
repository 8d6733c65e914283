"""Split-K reduction deferred into the next add + RMSNorm (split_k.SplitKPartials,
RowParallelLinear.forward_deferred, norms.add_rms_norm), and for few rows the product, the add
and the norm in one launch (skinny_gemm.skinny_gemm_add_rms_norm, RowParallelLinear.forward_add_norm),
from the model's side.

The kernels themselves are compared in tests/kernel_cases.py (interpreted on CPU, compiled on
CUDA). Here, on CPU, where the product never splits K:
  * forward_deferred is forward (a tensor) on CPU and at tensor-parallel size > 1, and
    forward_add_norm is norm(forward(x), residual) there;
  * stand-ins for the split-K product that always return partials (`fake_split_k`) and for the
    one-launch product + norm (`fake_fused`) drive every Qwen3 path (full model, last-token-only
    final layer, reranker, generation) through the consumers of o_proj and down_proj: deferring
    or fusing must give the same bits as reducing at once, and each product must be handed the
    norm that follows it (the next layer's input norm, or the final norm, after down_proj).
With CUDA, Qwen3 layers at the 0.6B geometry give the same bits fused, deferred and unfused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import florist
from florist.engine.batch import HostBatch, to_device
from florist.kernels import norms, skinny_gemm, split_k, wide_gemm
from florist.kernels.launch_counters import LaunchCounters
from florist.kernels.split_k import SplitKPartials
from florist.layers import linear
from florist.layers.linear import RowParallelLinear
from florist.layers.norm import RMSNorm

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


def fake_fused(monkeypatch, *, splits: int = 3, max_rows: int | None = skinny_gemm.FUSED_NORM_MAX_ROWS) -> list:
    """The one-launch product + add + RMSNorm on CPU: `fake_split_k`'s partials, then the reference
    add + RMSNorm on them, for products of <= max_rows rows (None: any); returns the list of
    (rows, norm weight) it was called with."""
    calls = []

    def fused(x, weight, bias, residual, norm_weight, eps, config=None):
        if max_rows is not None and x.shape[0] > max_rows:
            return None
        calls.append((x.shape[0], norm_weight))
        return norms.add_rms_norm_ref(_split_k_partials(x, weight, bias, splits), residual, norm_weight, eps)

    monkeypatch.setattr(skinny_gemm, "skinny_gemm_add_rms_norm", fused)
    return calls


def _rms_norm(hidden: int, dtype=torch.float32, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, EPS).to(dtype)
    norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_add_norm_is_the_norm_of_forward_on_cpu(dtype, bias):
    layer = _row_parallel(48, 24, bias=bias).to(dtype)
    g = torch.Generator().manual_seed(5)
    x, res = torch.randn(3, 48, generator=g).to(dtype), torch.randn(3, 24, generator=g).to(dtype)
    norm = _rms_norm(24, dtype)
    assert skinny_gemm.skinny_gemm_add_rms_norm(x, layer.weight, layer.bias, res, norm.weight, EPS) is None  # not CUDA
    got = layer.forward_add_norm(x, res, norm)
    for a, e in zip(got, norm(layer(x), res)):
        assert torch.equal(a, e)
    assert got[1].dtype == dtype and torch.equal(got[1], layer(x) + res)  # the residual stream: the sum in dtype


def test_forward_add_norm_at_tensor_parallel_size_above_one_all_reduces_first(monkeypatch):
    """The norm needs the all-reduced product, so at TP > 1 nothing is fused."""
    calls = fake_fused(monkeypatch, max_rows=None)
    reduced = []
    monkeypatch.setattr(linear, "all_reduce", lambda t: reduced.append(t) or t)
    layer = _row_parallel(48, 24, bias=True)
    g = torch.Generator().manual_seed(6)
    x, res, norm = torch.randn(5, 48, generator=g), torch.randn(5, 24, generator=g), _rms_norm(24)
    layer.forward_add_norm(x, res, norm)
    assert len(calls) == 1 and calls[0][1] is norm.weight and not reduced  # TP 1: one launch
    layer.tp_size = 2  # what this rank's layer looks like at TP 2 (rank 0: it adds the bias)
    got = layer.forward_add_norm(x, res, norm)
    assert len(calls) == 1 and len(reduced) == 1
    for a, e in zip(got, norm(F.linear(x, layer.weight, layer.bias), res)):
        assert torch.equal(a, e)


def test_fused_norm_counters_must_exist_before_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(AssertionError, match="before graph capture"):
        LaunchCounters("skinny_gemm_add_rms_norm").get(torch.device("cuda", 0), 1)
    counters = LaunchCounters("skinny_gemm_add_rms_norm")
    made = counters.get(torch.device("cpu"), 1)
    assert made.dtype == torch.int32 and not made.any() and counters.get(torch.device("cpu"), 1) is made


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
    torch.testing.assert_close(reduced, split_k.reduce_partials_ref(p), rtol=0, atol=0, equal_nan=True)
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


def _randomise_norms(model) -> None:
    """Distinct RMSNorm weights (checkpoints start them all at 1), so a product handed the wrong
    norm changes the result."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("fixture", ["qwen3_dir", "reranker_dir"])
def test_qwen3_hands_each_product_the_norm_after_it(request, fixture, monkeypatch):
    """o_proj -> its layer's post_attention_layernorm; down_proj -> the next layer's
    input_layernorm, or the final norm after the last layer. Fused (every product, or only the
    decode-sized ones) equals deferred bit for bit."""
    task = "score" if fixture == "reranker_dir" else None
    engine = florist.Engine.from_pretrained(request.getfixturevalue(fixture), device="cpu", task=task)
    model = engine.runner.model.model
    _randomise_norms(model)
    layers = list(model.layers)
    next_norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
    order = [n.weight for layer, after in zip(layers, next_norms) for n in (layer.post_attention_layernorm, after)]
    for lens in ([3, 17, 1], [2], [1, 1, 1], [6]):
        for last_token_only in (True, False):
            model.last_token_only = last_token_only
            final_rows = len(lens) if last_token_only else sum(lens)
            with monkeypatch.context() as m:
                fake_split_k(m, reduce_at_once=False)
                deferred = _forward(engine, lens)
            with monkeypatch.context() as m:
                calls = fake_fused(m, max_rows=None)
                fused = _forward(engine, lens)
            assert len(calls) == len(order) and all(w is e for (_, w), e in zip(calls, order))
            assert [rows for rows, _ in calls] == [sum(lens)] * (len(order) - 2) + [final_rows] * 2
            assert torch.equal(fused, deferred), f"{fixture} {lens} last_token_only={last_token_only}"
            with monkeypatch.context() as m:  # decode-sized products fused, the others deferred
                fake_split_k(m, reduce_at_once=False)
                calls = fake_fused(m)
                mixed = _forward(engine, lens)
            limit = skinny_gemm.FUSED_NORM_MAX_ROWS
            assert len(calls) == (len(order) - 2) * (sum(lens) <= limit) + 2 * (final_rows <= limit)
            assert torch.equal(mixed, deferred), f"{fixture} {lens} last_token_only={last_token_only}"


def test_generation_with_deferred_partials(tmp_path, monkeypatch):
    from test_generation import make_causal_lm, prompts_for

    path = make_causal_lm(tmp_path / "lm", tie=True)
    engine = florist.Engine.from_pretrained(path, device="cpu")
    _randomise_norms(engine.runner.runner.model.model)  # Generator -> GenerationRunner -> Qwen3ForCausalLM
    prompts = prompts_for(path, (1, 9, 23))
    unpatched = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    with monkeypatch.context() as m:
        fake_split_k(m, reduce_at_once=True)
        at_once = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    with monkeypatch.context() as m:
        made = fake_split_k(m, reduce_at_once=False)
        deferred = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    with monkeypatch.context() as m:  # decode steps (<= 3 rows) in one launch per product
        fake_split_k(m, reduce_at_once=False)
        calls = fake_fused(m)
        fused = [r.token_ids for r in engine.generate(prompts, max_tokens=6)]
    assert made and calls and all(rows <= skinny_gemm.FUSED_NORM_MAX_ROWS for rows, _ in calls)
    assert fused == deferred == at_once == unpatched


# ---------------------------------------------------------------------------------------------
# GPU: the real fused kernels in Qwen3 layers


@pytest.mark.gpu
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
    assert torch.equal(reduced, split_k.reduce_partials_ref(p))
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


def _unfused_add_norm(self, x, residual, norm):
    return norm(self.forward(x), residual)


@pytest.mark.gpu
def test_qwen3_fused_reduce_equals_unfused_on_gpu(monkeypatch):
    """Three ways through o_proj/down_proj and the norm after each: as served (one launch for
    <= FUSED_NORM_MAX_ROWS rows, partials into the norm for <= 128 rows, <= 256 on Hopper), with
    the one-launch op off (partials into the norm), and reduced by the product before the norm.
    Bit for bit up to 64 rows and where nothing defers; at 65-256 rows the product that is not
    deferred is cuBLAS (`pick_config`), so there the last way is compared with a tolerance
    (down_proj's SwiGLU input is checked bit for bit in tests/kernel_cases.py)."""
    device = torch.device("cuda")
    model = _qwen3_0_6b_layers(3, device, torch.bfloat16)
    _randomise_norms(model)
    partials_launches, fused_launches = [], []
    launch = norms._launch_add_rms_norm_partials
    monkeypatch.setattr(norms, "_launch_add_rms_norm_partials", lambda *a: partials_launches.append(1) or launch(*a))
    fused_launch = skinny_gemm.skinny_gemm_add_rms_norm_triton
    monkeypatch.setattr(skinny_gemm, "skinny_gemm_add_rms_norm_triton", lambda *a, **k: fused_launches.append(1) or fused_launch(*a, **k))
    rng = np.random.default_rng(0)
    limit = skinny_gemm.FUSED_NORM_MAX_ROWS
    # Which row counts defer the reduction, as served (on Hopper the TMA form does up to 256).
    tma = skinny_gemm.TMA_ENABLED and wide_gemm.hopper(device)
    defers = lambda r: (c := skinny_gemm.pick_config(r, 1024, 2048, deferred=True, tma=tma)) is not None and c.split_k > 1  # noqa: E731
    for lens in ([1], [2], [4], [1, 1, 1], [1, 3], [17], [64], [5, 1, 9], [3] * 8, [100], [60, 68], [200], [300]):  # 300 rows: cuBLAS
        host = HostBatch.from_sequences([rng.integers(0, 1000, size=n).astype(np.int32) for n in lens])
        batch = to_device(host, device)
        for last_token_only in (False, True):
            model.last_token_only = last_token_only
            partials_launches.clear()
            fused_launches.clear()
            with torch.inference_mode():
                fused = model(batch)
                served = (len(partials_launches), len(fused_launches))
                with monkeypatch.context() as m:
                    m.setattr(skinny_gemm, "skinny_gemm_add_rms_norm", lambda *a, **k: None)
                    deferred = model(batch)
                with monkeypatch.context() as m:
                    m.setattr(RowParallelLinear, "forward_add_norm", _unfused_add_norm)
                    unfused = model(batch)
            # Both products of every layer, by their rows (the final layer's rows are the B last
            # tokens with last_token_only): <= FUSED_NORM_MAX_ROWS in one launch, then partials
            # where the product defers its reduction.
            rows = [sum(lens)] * (len(model.layers) - 1) + [len(lens) if last_token_only else sum(lens)]
            expected = (2 * sum(limit < r and defers(r) for r in rows), 2 * sum(r <= limit for r in rows))
            assert served == expected, (lens, last_token_only, served)
            assert torch.equal(fused, deferred), f"{lens} last_token_only={last_token_only}: one launch != partials into the norm"
            if not any(r > 64 and defers(r) for r in rows):
                assert torch.equal(fused, unfused), f"{lens} last_token_only={last_token_only}: != reduced before the norm"
            else:
                cos = F.cosine_similarity(fused.float(), unfused.float(), dim=-1)
                assert cos.min() > 0.999, f"{lens} last_token_only={last_token_only}: cosine {cos.min()} against cuBLAS"


def _decode_sized(m: int, n: int, k: int, dtype=torch.bfloat16, residual_dtype=None, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to("cuda", dtype)
    b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
    res = torch.randn(m, n, generator=g).to("cuda", residual_dtype or dtype)
    return x, w, b, res, torch.randn(n, generator=g).to("cuda", dtype)


@pytest.mark.gpu
def test_fused_add_norm_dispatch_on_gpu():
    for m in range(1, skinny_gemm.FUSED_NORM_MAX_ROWS + 1):
        for k in (2048, 3072):  # Qwen3-0.6B's o_proj and down_proj
            x, w, b, res, nw = _decode_sized(m, 1024, k, bias=k == 3072, seed=m)
            got = skinny_gemm.skinny_gemm_add_rms_norm(x, w, b, res, nw, EPS)
            want = norms.add_rms_norm(skinny_gemm.skinny_gemm(x, w, b, defer_reduce=True), res, nw, EPS)
            assert got is not None and all(torch.equal(a, e) for a, e in zip(got, want)), (m, k)
            layer = RowParallelLinear(k, 1024, bias=b is not None).to("cuda", torch.bfloat16)
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b)
            norm = RMSNorm(1024, EPS).to("cuda", torch.bfloat16)
            norm.weight.copy_(nw)
            assert all(torch.equal(a, e) for a, e in zip(layer.forward_add_norm(x, res, norm), got))
    wide = skinny_gemm.GemmConfig(16, 32, 128, split_k=4)
    for args, config in (
        (_decode_sized(skinny_gemm.FUSED_NORM_MAX_ROWS + 1, 1024, 2048), None),  # too many rows
        (_decode_sized(1, 1024, 2048, torch.float32), None),  # fp32: cuBLAS, no skinny product at all
        (_decode_sized(1, 1024, 2048, residual_dtype=torch.float32), None),  # residual of another dtype
        (_decode_sized(1, 1024, 384), None),  # short K: pick_config does not split it
        (_decode_sized(1, skinny_gemm.FUSED_NORM_MAX_COLS + 1, 2048), wide),  # rows too wide for one program
    ):
        assert skinny_gemm.skinny_gemm_add_rms_norm(*args, EPS, config=config) is None


@pytest.mark.gpu
def test_fused_add_norm_replays_from_a_cuda_graph():
    """Captured after one eager call (which makes the counters), replayed on fresh inputs: the
    eager bits every time, and the counters back at 0 after each replay."""
    static = _decode_sized(2, 1024, 3072, bias=True)
    eager = skinny_gemm.skinny_gemm_add_rms_norm(*static, EPS)
    assert eager is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = skinny_gemm.skinny_gemm_add_rms_norm(*static, EPS)
    for seed in (1, 2, 3):
        fresh = _decode_sized(2, 1024, 3072, bias=True, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert not skinny_gemm._counters.by_device[static[0].device].any()
        for a, e in zip(outs, skinny_gemm.skinny_gemm_add_rms_norm(*fresh, EPS)):
            assert torch.equal(a, e)
