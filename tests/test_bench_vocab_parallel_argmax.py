"""bench/vocab_parallel_argmax.py --smoke runs end to end (CPU here; CUDA graphs where present)."""

from __future__ import annotations

from bench_scripts import run_bench


def test_bench_smoke():
    proc = run_bench("vocab_parallel_argmax.py", "--smoke", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[-1].splitlines()
    assert table[0].split()[:4] == ["rows", "torch", "us", "fused"], proc.stdout
    assert [line.split()[0] for line in table[1:4]] == ["1", "2", "4"], proc.stdout
