"""bench/generate.py --smoke runs end to end on the CPU, its fidelity check included."""

from __future__ import annotations

from bench_scripts import run_bench


def test_bench_smoke():
    proc = run_bench("generate.py", "--smoke", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fidelity: 9 florist tokens are transformers' greedy choice" in proc.stdout, proc.stdout
    summary = proc.stdout.split("== summary ==")[-1]
    assert "ms/token" in summary and "tokens/s" in summary, proc.stdout
