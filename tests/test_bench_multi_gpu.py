"""bench/multi_gpu.py: the CPU smoke mode (gloo ranks, tiny models) end to end, and the NCCL argmax
check where two GPUs are visible."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import ROOT, run_bench


def run(args: list[str], tmp_path: Path) -> tuple[str, dict]:
    proc = run_bench("multi_gpu.py", *args, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((tmp_path / "multi_gpu.json").read_text())


def test_smoke_runs_every_part(tmp_path):
    out, result = run(["--smoke"], tmp_path)
    checks = result["argmax"]["2"]["checks"]
    assert {c["vocab"] for c in checks} == {4096, 1001} and {c["special"] for c in checks} == {False, True}
    assert all(c["eager_checks"] == c["row_counts"] > 0 for c in checks), checks
    paths = result["argmax"]["2"]["timings"]  # on the CPU the timed paths are checked against each other, not timed
    assert len(paths) == 14 and {p["what"] for p in paths} == {"argmax of a 4096-vocab shard", "LM head 5000 x 64 + argmax"}
    gen = result["generate"]
    assert set(gen["runs"]) == {"1", "2"}
    assert gen["runs"]["2"]["tokens"] == gen["runs"]["1"]["tokens"], "fp32 on gloo: TP 2 must pick TP 1's tokens"
    assert gen["divergences"] == [] and "4 of 4 sequences identical" in out
    assert all(r["repeat_equal"] for r in gen["runs"].values()), {tp: r["repeat_equal"] for tp, r in gen["runs"].items()}
    # decode ms/token is the difference of two medians of two timings; on a CPU shared with other tests
    # it is noise (it can fall below zero), so the smoke run only asks that it was measured
    assert all(math.isfinite(r["decode_ms_per_token"]) for r in gen["runs"].values())
    rep = result["replicas"]
    assert set(rep["runs"]) == {"1", "2"} and rep["min_cosine_vs_one_replica"] >= 0.999
    assert all(r["n"] == r["planned"] and r["items_per_s"] > 0 for r in rep["runs"].values())
    assert "replicas 2 / 1:" in out


def test_tie_heavy_heads_put_ties_infinities_and_nans_at_every_shard_edge():
    sys.path.insert(0, str(ROOT / "bench"))
    from multi_gpu import tie_heavy_hidden, tie_heavy_weight

    from florist.layers.embedding import pad_vocab

    g = torch.Generator().manual_seed(0)
    for tp in (2, 4):
        vocab = 32001
        size = pad_vocab(vocab, tp) // tp
        w = tie_heavy_weight(vocab, 8, tp, torch.float32, g, special=True)
        logits = tie_heavy_hidden(3, 8, torch.float32, g, special=True) @ w.T
        for edge in range(size, vocab, size):
            assert w[edge - 1, 1] == w[edge, 1] == 3  # the steered tie crosses the edge
            assert torch.isinf(logits[:, edge + 1]).all() and torch.isnan(logits[:, edge + 2]).all()
        assert torch.isnan(logits).any(1).all() and torch.equal(logits.argmax(1), torch.full((3,), size + 2))


@pytest.mark.gpu(count=2)
def test_argmax_over_nccl_two_gpus(tmp_path):
    out, result = run(["--only", "argmax", "--tp", "2", "--replays", "5", "--calls", "2"], tmp_path)
    checks = result["argmax"]["2"]["checks"]
    assert all(c["graph_replays"] == 5 * c["row_counts"] for c in checks), checks
    assert result["argmax"]["2"]["timings"], out
