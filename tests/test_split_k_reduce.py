"""split_k's `_reduce_kernel` against `reduce_partials_ref`, bit for bit, under Triton's interpreter
on the CPU: rows wider than one program's 1024 columns (several column blocks, the last partial),
short rows, a bias in each dtype, NaN / inf partials. tests/kernel_cases.py covers it at <= 1024
columns, as the first launch of its split-K norm cases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = """
import sys
import torch
from florist.kernels import split_k

sys.path.insert(0, "tests")
import kernel_cases

# The interpreter truncates fp32 -> bf16; GPUs (and torch) round to nearest even: see kernel_cases.
rounds_bf16 = kernel_cases._interpreter_rounds_bf16()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if rounds_bf16 else ()):
    for splits, rows, cols, bias in ((3, 3, 2500, True), (2, 2, 2048, False), (1, 4, 7, True), (5, 1, 384, True)):
        partials = torch.randn(splits, rows, cols, generator=g) * 100
        partials[0, 0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
        partials[-1, -1, -1] = float("inf")
        b = torch.randn(cols, generator=g).to(dtype) if bias else None
        p = split_k.SplitKPartials(partials, b, dtype)
        got, want = split_k.reduce_partials_triton(p), split_k.reduce_partials_ref(p)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
        assert got.dtype == want.dtype and got.shape == want.shape and same.all(), (dtype, splits, rows, cols, bias)
print("split-k reduce ok")
"""


def test_reduce_kernel_matches_reference_bit_for_bit_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", CASES], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "split-k reduce ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
