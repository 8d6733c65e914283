"""Runs a kernel test's cases under Triton's interpreter in a subprocess (TRITON_INTERPRET must be
set before triton is imported, so the cases run in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(cases: str, call: str, marker: str, timeout: int = 900) -> None:
    """`cases` (source) then `call` on the CPU under the interpreter; passes when the run exits 0
    and prints `marker`. Skipped without triton, or with Triton < 3.9, whose interpreter cannot
    take a loop trip count loaded from memory (compiled kernels can)."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("Triton < 3.9's interpreter cannot take a loop trip count loaded from memory (compiled kernels can)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", cases + f"\n{call}"], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
