"""bench/attention.py's CPU-checkable parts: the graph-bucket layout it times and the engine
threshold it reads (its timings need CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch
from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))
import attention as bench_attention  # noqa: E402  (bench/attention.py)


def test_graph_thresholds_are_the_engines():
    # Qwen3-0.6B's measured threshold, and MiniLM's (less work a token: the cap)
    assert bench_attention.graph_max_tokens("qwen3-0.6b") == 16384
    assert bench_attention.graph_max_tokens("minilm-l6") == 32768


def test_graph_batch_is_laid_out_as_the_engine_captures_it():
    tokens, batch = bench_attention.graph_batch([256] * 100, torch.device("cpu"))
    assert tokens == 25600 and batch.max_seqlen == 256
    cu = batch.cu_seqlens.tolist()
    assert len(cu) == 129  # 128 sequence slots: 100 real, the rest empty (no padding to hold)
    assert cu[100] == 25600 and cu[-1] == 25600 and not batch.uniform_seqlen
    tokens, batch = bench_attention.graph_batch([100, 7, 33], torch.device("cpu"))
    assert tokens == 192 and batch.cu_seqlens.tolist() == [0, 100, 107, 140, 192]  # the dummy holds 52 padding tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_it_says_so():
    out = run_bench("attention.py", "--buckets", timeout=120)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_sweep_grid_options_parse():
    out = run_bench("attention.py", "--sweep", "--geometry", "minilm-l6", "--block-m", "128", "256", "--block-n", "64",
                    "--warps", "8", "16", timeout=120)
    assert out.returncode == 1 and "needs a CUDA GPU" in out.stderr, out.stderr[-2000:]
    out = run_bench("attention.py", "--sweep", "--block-m", "x", timeout=120)
    assert out.returncode == 2 and "--block-m" in out.stderr


def test_sweep_configs_take_the_key_loop_choice():
    import argparse

    args = argparse.Namespace(block_m=[64, 128], block_n=[64], warps=[4], lean="pick")
    configs = bench_attention.sweep_configs(args, 12, 12)
    assert len(configs) == 2 * 3 and {c[5] for c in configs} == {None} and {c[4] for c in configs} == {False}
    assert {c[6] for c in configs} == {0}  # no register cap unless asked
    args.lean = "both"
    configs = bench_attention.sweep_configs(args, 16, 8)  # grouped heads: packed and not
    assert len(configs) == 2 * 3 * 2 * 2 and {c[5] for c in configs} == {False, True}
    args.maxnreg = [0, 128, 96]
    assert len(bench_attention.sweep_configs(args, 12, 12)) == 2 * 3 * 2 * 3
    out = run_bench("attention.py", "--sweep", "--lean", "sometimes", timeout=120)
    assert out.returncode == 2 and "--lean" in out.stderr
