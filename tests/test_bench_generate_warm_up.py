"""bench/generate_warm_up.py: Generate requests of new shapes with and without the warm-up, each
side from an empty Triton cache (GPU only: the warm-up compiles GPU kernels)."""

from __future__ import annotations

import re

import pytest
from bench_scripts import run_bench


def run(*args: str):
    return run_bench("generate_warm_up.py", *args, timeout=900)


@pytest.mark.gpu
def test_after_the_warm_up_no_request_compiles():
    out = run("--smoke")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"(\d+) x\s+(\d+) tokens\s+([0-9.]+)\s+(\d+)\s+([0-9.]+)\s+(\d+)", out.stdout)
    assert len(rows) == 4, out.stdout
    assert int(rows[0][3]) > 0, out.stdout  # cold: the first request compiles kernels
    assert all(int(r[5]) == 0 for r in rows), out.stdout  # warm: none does
    assert re.search(r"warm-up: [0-9.]+ s, \d+ rounds", out.stdout), out.stdout
