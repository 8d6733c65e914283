"""florist/kernels/wide_gemm.py: the persistent TMA product, plain and with SwiGLU fused, against
the unfused torch references.

Under Triton's interpreter on the CPU (fp16: the interpreter truncates fp32 -> bf16): rows that
are not a multiple of the tile, K not a multiple of the K block (TMA fills zeros), programs
walking several tiles, a strided x, NaN and inf. On the GPU (Hopper, bf16): the kernel against
cuBLAS + the SwiGLU kernel at the row counts the engine runs, and a Qwen3 embedder's output with
the kernel on and off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

CASES = """
import torch
import torch.nn.functional as F
from florist.kernels import wide_gemm as wg
from florist.kernels.activation import silu_and_mul_ref

g = torch.Generator().manual_seed(0)
dt = torch.float16


def close(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    nan_same = (got.isnan() == want.isnan()).all()
    finite = ~want.isnan()
    assert nan_same, (what, "NaN pattern differs")
    torch.testing.assert_close(got[finite].float(), want[finite].float(), atol=2e-3, rtol=2e-3, msg=what)


def product(x, w):  # the product as cuBLAS would hand it on: fp32 sums rounded to x's dtype
    return F.linear(x.float(), w.float()).to(x.dtype)


for m, k in ((200, 96), (64, 128), (1, 64)):
    base = torch.randn(m, k + 32, generator=g).to(dt)
    x = base[:, :k]  # strided rows (row stride k + 32)
    cfg = wg.WideConfig(64, 64, 64, 4, 2, 2)
    w = (torch.randn(192, k, generator=g) * 0.1).to(dt)
    close(wg.wide_gemm(x, w, cfg), product(x, w), ("none", m, k))
    w = (torch.randn(256, k, generator=g) * 0.1).to(dt)
    close(wg.wide_gemm(x, w, cfg, wg.SWIGLU), silu_and_mul_ref(product(x, w)), ("swiglu", m, k))

# NaN and inf in x: the rows they touch come out as the reference's (NaN / +-inf), the rest finite.
x = torch.randn(100, 64, generator=g).to(dt)
x[3, 5], x[7, 0] = float("nan"), float("inf")
w = (torch.randn(128, 64, generator=g) * 0.1).to(dt)
close(wg.wide_gemm(x, w, wg.WideConfig(64, 64, 64, 4, 2, 2)), product(x, w), "none nan/inf")
close(wg.wide_gemm(x, w, wg.WideConfig(64, 32, 64, 4, 2, 2), wg.SWIGLU), silu_and_mul_ref(product(x, w)), "swiglu nan/inf")

# A bias, and the exact GELU after it (all-MiniLM-L6-v2's up projection): rounded as cuBLAS and
# activation.gelu's pass round them; two programs a multiprocessor walk the tiles as one does.
from florist.kernels.activation import gelu_exact_ref
x = torch.randn(150, 96, generator=g).to(dt)
x[9, 4] = float("nan")
w = (torch.randn(192, 96, generator=g) * 0.3).to(dt)
b = torch.randn(192, generator=g).to(dt)
want = F.linear(x.float(), w.float(), b.float()).to(dt)
cfg = wg.WideConfig(64, 64, 64, 4, 2, 2)
close(wg.wide_gemm(x, w, cfg, wg.NONE, b), want, "bias")
close(wg.wide_gemm(x, w, cfg, wg.GELU, b), gelu_exact_ref(want), "bias gelu")
close(wg.wide_gemm(x, w, cfg, wg.GELU), gelu_exact_ref(product(x, w)), "gelu")
close(wg.wide_gemm(x, w, wg.WideConfig(64, 64, 64, 4, 2, 2, per_sm=2), wg.GELU, b), gelu_exact_ref(want), "gelu, two programs a multiprocessor")
# The epilogue in two column halves: the same bits as in one.
for epi, bias in ((wg.GELU, b), (wg.NONE, b), (wg.GELU, None)):
    whole = wg.wide_gemm(x, w, wg.WideConfig(64, 64, 64, 4, 2, 2, per_sm=2), epi, bias)
    halves = wg.wide_gemm(x, w, wg.WideConfig(64, 64, 64, 4, 2, 2, per_sm=2, epilogue_split=2), epi, bias)
    torch.testing.assert_close(halves, whole, rtol=0, atol=0, equal_nan=True, msg=f"epilogue halves, epilogue {epi}")
print("wide gemm ok")
"""


def test_wide_gemm_matches_references_interpreted():
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.tools.tensor_descriptor")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("Triton < 3.7's interpreter cannot loop from a program id (the persistent tile loop); the GPU tests run it compiled")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", CASES], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "wide gemm ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_pick_leaves_few_rows_to_cublas():
    from florist.kernels import wide_gemm as wg

    assert wg.pick(wg.MIN_ROWS - 1) is None and wg.pick(16384, wg.NONE) is None
    assert all(wg.pick(m) is not None for m in (wg.MIN_ROWS, 1024, 2048, 8192, 16384))


def test_pick_takes_short_k_products_with_gelu_or_wide_outputs():
    """all-MiniLM-L6-v2 (K = 384): the up projection with its GELU from GELU_MIN_ROWS rows, the
    qkv product from PLAIN_MIN_ROWS; its o and down products, and Qwen3's plain ones, stay with
    cuBLAS."""
    from florist.kernels import wide_gemm as wg

    m = 25600  # the 100 x 256 graph bucket
    gelu = wg.pick(m, wg.GELU, 1536, 384)
    assert gelu is not None and gelu.per_sm == 2
    assert wg.pick(m, wg.NONE, 1152, 384) is not None
    assert wg.pick(wg.GELU_MIN_ROWS - 1, wg.GELU, 1536, 384) is None and wg.pick(wg.GELU_MIN_ROWS, wg.GELU, 1536, 384) is not None
    assert wg.pick(wg.PLAIN_MIN_ROWS - 1, wg.NONE, 1152, 384) is None
    assert wg.PLAIN_MIN_ROWS == 12800 and wg.pick(12800, wg.NONE, 1152, 384) is not None  # a half of the 100 x 256 bucket
    for n, k in ((384, 384), (384, 1536), (4096, 1024), (1024, 2048), (1024, 3072)):
        assert wg.pick(m, wg.NONE, n, k) is None, (n, k)
    assert wg.pick(m, wg.GELU, 3072, 768) is None  # K = 768: not measured
    assert not wg.applies(torch.zeros(4096, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16))  # CPU


def test_layouts_the_kernel_cannot_take_are_refused_on_the_host():
    pytest.importorskip("triton.tools.tensor_descriptor")
    from florist.kernels import wide_gemm as wg

    bf16 = dict(dtype=torch.bfloat16)
    x = torch.zeros(2048, 64, **bf16)
    assert wg._supported(x, torch.zeros(6144, 64, **bf16), wg.SWIGLU)
    assert not wg._supported(x, torch.zeros(2008, 64, **bf16), wg.SWIGLU)  # I = 1004: output rows of 2,008 bytes
    assert not wg._supported(x, torch.zeros(6145, 64, **bf16))  # odd rows: output rows not 16-byte multiples
    assert not wg._supported(x, torch.zeros(64, 6144, **bf16).t(), wg.SWIGLU)  # weight not contiguous
    assert not wg._supported(torch.zeros(2048, 72, **bf16)[:, :60], torch.zeros(128, 60, **bf16))  # 120-byte rows
    assert not wg._supported(x.float(), torch.zeros(128, 64))  # fp32


@pytest.mark.gpu(capability=(9, 0))
@pytest.mark.parametrize("m", [1024, 3000, 16384])
def test_wide_gemm_gpu_against_cublas_and_the_separate_kernels(m):
    from florist.kernels import activation, wide_gemm as wg

    torch.manual_seed(m)
    dt, dev, k = torch.bfloat16, "cuda", 1024
    x = torch.randn(m, k, device=dev, dtype=dt)
    x[5, 7] = float("nan")
    w = torch.randn(6144, k, device=dev, dtype=dt) * 0.03
    got = wg.wide_gemm(x, w, wg.pick(m), wg.SWIGLU)
    want = activation.silu_and_mul(F.linear(x, w))
    assert got.isnan()[5].all() and not got.isnan()[6:].any()
    torch.testing.assert_close(got[6:].float(), want[6:].float(), atol=2e-2, rtol=2e-2)
    # Rounding, not a wrong element: nearly every value equals the unfused one.
    assert (got[6:] == want[6:]).float().mean() > 0.9
    y = wg.wide_gemm(x[6:], w, wg.WideConfig(128, 256, 64, 8, 3), wg.NONE)
    torch.testing.assert_close(y.float(), F.linear(x[6:], w).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu(capability=(9, 0))
def test_qwen3_embedder_with_and_without_the_wide_kernel(tmp_path, monkeypatch):
    """A Qwen3 embedder fed 4 x 300 tokens (1,200 rows: the kernel runs), gives
    the same embeddings with the kernel as without, and both match the fp32 CPU reference."""
    import florist
    from florist.kernels import wide_gemm as wg
    from models import make_tokenizer, vocab_size, _st_files
    from transformers import Qwen3Config, Qwen3Model

    make_tokenizer(tmp_path, "qwen")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab_size(tmp_path), hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, intermediate_size=512, max_position_embeddings=512, rms_norm_eps=1e-6)
    Qwen3Model(cfg).eval().save_pretrained(tmp_path)
    _st_files(tmp_path, "lasttoken", normalize=True, max_len=512)
    ids = [list(np.random.default_rng(i).integers(10, cfg.vocab_size - 10, 300)) for i in range(4)]
    ref = florist.Engine.from_pretrained(tmp_path, device="cpu").embed(ids)
    calls = []
    launch = wg.wide_gemm

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return launch(*args, **kwargs)

    monkeypatch.setattr(wg, "wide_gemm", counted)
    fused = florist.Engine.from_pretrained(tmp_path, device="cuda").embed(ids)
    assert calls and min(calls) >= wg.MIN_ROWS, calls  # the MLPs ran the kernel
    # A separate engine (a captured graph keeps the kernels it was captured with), kernel off.
    monkeypatch.setattr(wg, "ENABLED", False)
    calls.clear()
    plain = florist.Engine.from_pretrained(tmp_path, device="cuda").embed(ids)
    assert not calls

    def cos(a, b):
        return ((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min()

    assert cos(fused, plain) > 0.9999 and cos(fused, ref) > 0.999


@pytest.mark.gpu(capability=(9, 0))
def test_minilm_geometry_with_and_without_the_wide_kernel(tmp_path, monkeypatch):
    """A 2-layer BERT of all-MiniLM-L6-v2's geometry (hidden 384, intermediate 1536), fp16, fed 100
    x 256 tokens (25,600 rows, as one batch: no halves): its qkv and up projections run the
    kernel (the up projection with bias and GELU in the epilogue), and the embeddings match the
    same engine without it and the fp32 CPU engine."""
    import florist
    from florist.kernels import wide_gemm as wg
    from models import _st_files, make_tokenizer, vocab_size
    from transformers import BertConfig, BertModel

    monkeypatch.setenv("FLORIST_GRAPH_SPLIT_MIN_TOKENS", "0")  # halves would give the products 12,800 rows each
    make_tokenizer(tmp_path, "bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab_size(tmp_path), hidden_size=384, num_hidden_layers=2, num_attention_heads=12, intermediate_size=1536,
                     max_position_embeddings=512)
    BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(tmp_path)
    _st_files(tmp_path, "mean", True, 256, dim=384)
    ids = [list(np.random.default_rng(i).integers(10, cfg.vocab_size - 10, 256)) for i in range(100)]
    ref = florist.Engine.from_pretrained(tmp_path, device="cpu").embed(ids)
    calls = []
    launch = wg.wide_gemm

    def counted(x, weight, config, epilogue=wg.NONE, bias=None):
        calls.append((tuple(weight.shape), epilogue, bias is not None))
        return launch(x, weight, config, epilogue, bias)

    def engine():
        return florist.Engine.from_pretrained(tmp_path, device="cuda", dtype="float16", max_batch_tokens=32768)

    monkeypatch.setattr(wg, "wide_gemm", counted)
    fused = engine().embed(ids)
    assert {((1536, 384), wg.GELU, True), ((1152, 384), wg.NONE, True)} <= set(calls), set(calls)
    monkeypatch.setattr(wg, "ENABLED", False)  # a separate engine: a captured graph keeps its kernels
    calls.clear()
    plain = engine().embed(ids)
    assert not calls

    def cos(a, b):
        return ((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min()

    assert cos(fused, plain) > 0.9999 and cos(fused, ref) > 0.999


def test_only_gpus_with_tma_and_a_datacenter_shared_memory_take_the_kernel(monkeypatch):
    from types import SimpleNamespace

    from florist.kernels import wide_gemm as wg

    parts = {
        0: SimpleNamespace(major=9, shared_memory_per_block_optin=232448, multi_processor_count=132),  # H100 / H200
        1: SimpleNamespace(major=10, shared_memory_per_block_optin=232448, multi_processor_count=148),  # B200
        2: SimpleNamespace(major=12, shared_memory_per_block_optin=101376, multi_processor_count=170),  # consumer Blackwell
        3: SimpleNamespace(major=8, shared_memory_per_block_optin=166912, multi_processor_count=108),  # A100: no TMA
        4: SimpleNamespace(major=9, multi_processor_count=132),  # a torch without the attribute: by architecture
    }
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: parts[i])
    wg._device_facts.cache_clear()
    try:
        assert [wg.hopper(torch.device("cuda", i)) for i in range(5)] == [True, True, False, False, True]
    finally:
        wg._device_facts.cache_clear()  # no fake device facts left for later tests
    assert not wg.hopper(torch.device("cpu"))


@pytest.mark.gpu(capability=(9, 0))
@pytest.mark.parametrize("m", [8192, 25637])
def test_gelu_epilogue_in_two_halves_gives_the_same_bits(m):
    """all-MiniLM-L6-v2's up projection + GELU (fp16, bias, K = 384): the epilogue finished in two
    column halves gives the bits of the whole tile, and the unfused path's (cuBLAS, then the
    GELU pass) but for rounding."""
    from florist.kernels import activation, wide_gemm as wg

    torch.manual_seed(m)
    dt, dev = torch.float16, "cuda"
    x = torch.randn(m, 384, device=dev, dtype=dt)
    w = torch.randn(1536, 384, device=dev, dtype=dt) * 0.05
    b = torch.randn(1536, device=dev, dtype=dt) * 0.05
    whole = wg.wide_gemm(x, w, wg.WideConfig(128, 128, 64, 8, 2, per_sm=2), wg.GELU, b)
    halves = wg.wide_gemm(x, w, wg.WideConfig(128, 128, 64, 8, 3, per_sm=2, epilogue_split=2), wg.GELU, b)
    assert torch.equal(whole, halves)
    want = activation.gelu(F.linear(x, w, b))
    torch.testing.assert_close(whole.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert (whole == want).float().mean() > 0.9
