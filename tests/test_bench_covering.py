"""bench/covering.py: covered replays against first sights and captures on a long-tailed stream
(GPU only: graph buckets exist only on CUDA)."""

from __future__ import annotations

import re
import sys

import pytest
from bench_scripts import ROOT, run_bench


def run(*args: str):
    return run_bench("covering.py", *args)


def test_the_stream_has_a_long_tail():
    sys.path.insert(0, str(ROOT / "bench"))
    import covering

    from florist.engine.graph_runner import bucket

    batches = covering.stream(7, 400, 1000, 16, 512)
    sizes = [b.num_seqs for b in batches]
    assert max(sizes) <= 16 and sizes.count(1) > 100 and len(set(sizes)) > 6
    assert all(16 <= n <= 512 for b in batches for n in b.seq_lens) and all(int(b.input_ids.max()) < 1000 for b in batches)
    counts = {}
    for b in batches:
        counts[bucket(b)] = counts.get(bucket(b), 0) + 1
    assert len(counts) > 40 and sum(1 for c in counts.values() if c == 1) > 10 and max(counts.values()) > 10  # many buckets, some once, a few often
    assert [b.seq_lens.tolist() for b in covering.stream(7, 400, 1000, 16, 512)] == [b.seq_lens.tolist() for b in batches]  # seeded


@pytest.mark.gpu
def test_both_settings_run_the_stream():
    out = run("--smoke")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^\s+1\s+(\d+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+\d+\s+(\d+)\s+(\d+)\s+(\d+)", out.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "8"], out.stdout
    assert rows[0][3] == "0" and int(rows[0][1]) > 0, out.stdout  # rent 0: first sights, never a covered replay
    assert int(rows[1][3]) > 0, out.stdout  # rent 8: some batches replay a graph that covers them
