"""bench/vocab_parallel_argmax.py --smoke runs end to end (CPU here; CUDA graphs where present)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vocab_parallel_argmax.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[-1].splitlines()
    assert table[0].split()[:4] == ["rows", "torch", "us", "fused"], proc.stdout
    assert [line.split()[0] for line in table[1:4]] == ["1", "2", "4"], proc.stdout
