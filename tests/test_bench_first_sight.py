"""bench/first_sight.py: first sights of graph buckets timed under the conditions a server adds
(GPU only: graph buckets exist only on CUDA)."""

from __future__ import annotations

import re
import sys

import pytest
from bench_scripts import ROOT, run_bench


def run(*args: str):
    return run_bench("first_sight.py", *args)


@pytest.mark.gpu
def test_every_condition_times_its_first_sights():
    out = run("--smoke", "--shapes", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for condition in ("cold (compiling)", "alone", "after capture", "batch in flight", "waiter thread", "GIL contender"):
        rows = re.findall(re.escape(condition) + r"\s+\d+ x 64\s+([0-9.]+)\s+([0-9.]+)\s+(\d+)", out.stdout)
        assert len(rows) == (10 if condition.startswith("cold") else 2), (condition, out.stdout)
        if condition.startswith("cold"):  # a fresh Triton cache: the first shape compiles the kernels
            assert int(rows[0][2]) > 0, out.stdout
    graphs = re.search(r"second engine: (\d+) graphs captured", out.stdout)
    assert graphs and int(graphs.group(1)) == 1 + 2  # the background batch and the two capture shapes


def test_batches_stay_inside_a_small_vocabulary():
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    import first_sight

    host = first_sight.batch(np.random.default_rng(0), 1000, 3, 64)  # the smoke model's vocabulary: 1000 ids
    assert host.num_seqs == 3 and int(host.input_ids.max()) < 1000 and int(host.input_ids.min()) >= 0
