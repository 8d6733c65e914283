"""Run a script of bench/ the way a user does, from the repository root, for the bench tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The GPU-only scripts: without CUDA each says so and exits 1 (tests/test_bench_gpu_only.py).
GPU_ONLY = ("covering.py", "first_sight.py", "generate_warm_up.py")


def run_bench(script: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`env`: variables set on top of this process's environment."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)
