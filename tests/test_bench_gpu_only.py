"""The bench scripts that measure graph buckets or GPU kernels only: without CUDA each says so."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import GPU_ONLY, run_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_without_cuda_it_says_so(script):
    out = run_bench(script, "--smoke")
    assert out.returncode == 1 and "needs CUDA" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
@pytest.mark.parametrize("args", [(), ("--tma",), ("--wide",), ("--qkv-rope",)])
def test_gemm_without_cuda_says_so(args):
    out = run_bench("gemm.py", *args)
    assert out.returncode == 1 and "needs CUDA" in out.stdout, out.stderr[-2000:]
