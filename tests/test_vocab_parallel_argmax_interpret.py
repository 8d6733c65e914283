"""Runs interpret_vocab_parallel_argmax.py (the Triton kernels on CPU) in a fresh interpreter with
TRITON_INTERPRET=1: Triton chooses the interpreter when a kernel is decorated, so the variable
must be set before florist.kernels.vocab_parallel_argmax is first imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).parent


def test_kernels_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
           str(HERE / "interpret_vocab_parallel_argmax.py")]
    proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
