"""bench/engine.py's smoke mode (tiny models on the CPU), so the benchmark cannot rot."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from bench_scripts import ROOT, run_bench


def test_engine_bench_smoke(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_bench("engine.py", "--smoke", "--json", str(out), timeout=300, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "FLORIST_PDL": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== summary ==" in proc.stdout
    settings = next(line for line in proc.stdout.splitlines() if line.startswith("florist settings from the environment:"))
    assert "FLORIST_PDL=off" in settings.split()  # a run says which A/B switches it ran under
    rows = json.loads(out.read_text())
    scenarios = {r["scenario"] for r in rows}
    assert {"tiny-qwen3 batch 1 x 16 tokens", "tiny-qwen3 8 x 32", "tiny-bert 8 x 32"} <= scenarios
    for r in rows:
        if r["transformers"] is not None:
            assert r["florist"] > 0 and r["speedup"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_profile_kernels_refuses_without_cuda():
    """bench/profile_kernels.py is GPU-only; without CUDA it must say so, not crash."""
    proc = run_bench("profile_kernels.py", timeout=120)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]


def test_profile_kernels_refuses_unknown_parts():
    proc = run_bench("profile_kernels.py", "--only", "minilm,bert", timeout=120)
    assert proc.returncode == 2 and "unknown parts ['bert']" in proc.stderr, proc.stderr[-2000:]


def test_profile_kernels_refuses_bad_shapes():
    proc = run_bench("profile_kernels.py", "--only", "qwen3", "--shapes", "1x512,100", timeout=120)
    assert proc.returncode == 2 and "expected BATCHxTOKENS" in proc.stderr, proc.stderr[-2000:]


def test_print_kernel_table_counts_per_step(capsys):
    """bench/report.py's kernel table (bench/profile_kernels.py, bench/engine.py --only profile)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from report import print_kernel_table

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="gemm", device_type=cuda, device_time=6.0)] * 4 + [
        SimpleNamespace(name="norm", device_type=cuda, device_time=2.0)] * 2 + [SimpleNamespace(name="host", device_type=cpu, device_time=0.0)]
    print_kernel_table(SimpleNamespace(events=lambda: events), 2, "t")
    out = capsys.readouterr().out.splitlines()
    assert "3 kernels/step, 14.0 us/step" in out[1]
    assert out[2].split()[:5] == ["2.0/step", "6.00", "us", "avg", "12.0"] and out[2].endswith("gemm")
    assert out[3].endswith("norm") and len(out) == 4


def test_attention_bench_checks_its_arguments_and_needs_cuda():
    """bench/attention.py: an unknown --shapes label is refused with the known ones; without CUDA
    the script says it needs one and exits 1."""
    bad = run_bench("attention.py", "--sweep", "--shapes", "100 x 256,1 x 7", timeout=120)
    assert bad.returncode == 2 and "unknown --shapes ['1 x 7']" in bad.stderr and "100 x 256" in bad.stderr, bad.stderr
    if not torch.cuda.is_available():
        proc = run_bench("attention.py", "--sweep", "--shapes", "100 x 256", timeout=120)
        assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr, proc.stderr


def test_bidirectional_baseline_pads_without_a_causal_mask(qwen3_dir):
    """bench/engine.py's transformers baseline for pplx-embed (a plain Qwen3 directory made
    non-causal, as the bench's twin directory is): a padded (ragged) batch gives each sequence
    what it gives alone, i.e. the padding mask does not bring causality back."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from engine import HFBaseline

    hf = HFBaseline(qwen3_dir, torch.float32, "cpu", "mean", bidirectional=True)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 100, size=n).astype(np.int32) for n in (9, 4, 13)]
    together = hf.embed(seqs)
    alone = np.concatenate([hf.embed([s]) for s in seqs])
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-5)
    causal = HFBaseline(qwen3_dir, torch.float32, "cpu", "mean", bidirectional=False).embed(seqs[:1])
    assert np.abs(causal - alone[:1]).max() > 1e-3  # the check can tell the two maskings apart


def test_breakdown_shapes_are_parsed_and_bad_ones_refused():
    """--minilm-breakdown-shapes takes BATCHxTOKENS lists; a malformed one is a usage error."""
    for bad in ("100x", "128", "0x128", "1x2x3"):
        proc = run_bench("engine.py", "--minilm-breakdown-shapes", bad, "--only", "minilm-breakdown", timeout=120)
        assert proc.returncode == 2 and "expected BATCHxTOKENS" in proc.stderr, (bad, proc.stderr[-2000:])
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import engine as bench_engine
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert bench_engine.shapes_arg("1x128,100X256") == [(1, 128), (100, 256)]


def test_critical_path_adds_up_to_each_steps_span(capsys):
    """bench/report.py's critical path (bench/profile_kernels.py): overlapping kernels (a
    dependent launch waiting inside the one before) add only what ends later, an idle stretch
    inside a step is charged to the kernel after it, and the steps split at the longest idle
    stretches, however long one inside a step is."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from report import critical_path, print_critical_path

    spans = [("norm", 8.0, 15.0), ("gemm", 0.0, 10.0), ("rope", 317.0, 320.0),  # step 1, out of order, 302 us idle before rope
             ("gemm", 2000.0, 2010.0), ("norm", 2012.0, 2014.0), ("rope", 2013.0, 2014.0)]  # step 2: rope inside norm
    totals, agg = critical_path(spans, 2)
    assert totals == [320.0, 14.0]
    assert agg["gemm"] == [2, 20.0, 0.0]
    assert agg["norm"] == [2, 5.0 + 4.0, 2.0]
    assert agg["rope"] == [2, 305.0, 302.0]
    assert sum(v[1] for v in agg.values()) == sum(totals)
    assert critical_path(spans, 3)[0] == [15.0, 3.0, 14.0]  # three steps asked for: the idle stretch is a break

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name=n, device_type=cuda, time_range=SimpleNamespace(start=a, end=b)) for n, a, b in spans]
    events.append(SimpleNamespace(name="host", device_type=cpu, time_range=SimpleNamespace(start=5.0, end=5000.0)))
    print_critical_path(SimpleNamespace(events=lambda: events), 2, "t")
    out = capsys.readouterr().out.splitlines()
    assert "2 steps, span p50 167.0 us, of which idle 152.0 us a step" in out[1]
    assert out[2].split()[:5] == ["1.0/step", "152.5", "us", "added", "151.0"] and out[2].endswith("rope")
    assert [line.split()[-1] for line in out[2:]] == ["rope", "gemm", "norm"]
