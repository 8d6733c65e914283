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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
@pytest.mark.parametrize("args", [(), ("--pooling", "--sweep"), ("--decode",), ("--gelu",), ("--norms",)])
def test_kernels_without_cuda_says_so(args):
    out = run_bench("fused_kernels.py", *args)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]


def test_pooling_sweep_configurations_launch():
    """bench/fused_kernels.py --pooling --sweep: every configuration is valid, holds at least one load
    of rows a program and fits the register bound; the ones `pick` chose from are among them."""
    import sys

    from bench_scripts import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import fused_kernels as kernels

    from florist.kernels.pooling import PoolConfig

    for max_seqlen, h in ((32, 384), (256, 384), (512, 1024), (4096, 1024)):
        configs = kernels.pool_sweep(max_seqlen, h)
        assert configs and len(set(configs)) == len(configs)
        for c in configs:
            assert isinstance(c, PoolConfig) and c.block_t <= c.span <= 1024
            assert c.block_t * c.block_h <= 128 * 32 * c.num_warps
    assert PoolConfig(64, 64, 64, 4) in kernels.pool_sweep(512, 1024)
    assert PoolConfig(256, 256, 64, 4) in kernels.pool_sweep(4096, 1024)
