"""Engine.warm_up: the batch shapes an engine server runs before serving with --warm-up (so
kernels compile at start-up, not while a request of a new shape waits), and the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.engine import warm_up_shapes


def test_the_shapes_span_the_token_counts_with_one_sequence_and_eight():
    shapes = [s for s in warm_up_shapes(1000, 512, max_seqs=1) if not (len(set(s)) == 1 and s[0] == 16)]
    totals = [sum(s) for s in shapes]
    assert sorted(set(totals)) == [64, 128, 256, 512, 1000]
    singles = [s for s in shapes if len(s) == 1]
    assert [s[0] for s in singles] == [64, 128, 256, 512]  # 1,000 tokens is over the model's 512: no single sequence there
    several = [s for s in shapes if len(s) == 8]
    assert len(several) == 5 and all(len(set(s)) > 1 for s in several)  # ragged: padding and varlen paths, not one dense shape
    assert all(max(s) <= 512 for s in shapes)
    assert warm_up_shapes(64, 8192, max_seqs=1) == [[64], [4, 12, 4, 12, 4, 12, 4, 12], [16]]
    assert all(max(s) <= 100 for s in warm_up_shapes(16384, 100))  # lengths never pass the model's


def test_the_shapes_meet_every_bucket_of_sequence_counts():
    """One batch per graph bucket of sequences up to max_seqs: the final layer of a last-token
    model runs one row per sequence, and its kernels differ by that count."""
    from florist.engine.graph_runner import seq_bucket

    shapes = warm_up_shapes(16384, 8192, max_seqs=256)
    short = [s for s in shapes if set(s) == {16}]
    assert [len(s) for s in short] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {seq_bucket(len(s)) for s in shapes} >= {seq_bucket(n) for n in range(1, 257)}
    assert [len(s) for s in warm_up_shapes(16384, 8192, max_seqs=100) if set(s) == {16}][-1] == 100  # the scheduler's own limit
    assert max(len(s) for s in warm_up_shapes(256, 8192, max_seqs=256)) == 16  # never past the batch's token budget


@pytest.mark.parametrize("geometry, variant", [("tiny-qwen3", "embed"), ("tiny-bert", "cross-encoder")])
def test_warm_up_runs_every_shape_and_leaves_the_engine_as_it_was(tmp_path, geometry, variant):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from geometries import make_model

    path = make_model(tmp_path / f"{geometry}-{variant}", geometry, variant=variant, dtype=torch.float32)
    engine = florist.Engine.from_pretrained(path, device="cpu")
    inputs = ["the rose needs sun", "which seed grows fast"]
    before = engine.embed(inputs) if engine.info.task == "embed" else engine.score("which flower", inputs)
    calls = []
    step = engine.step
    engine.step = lambda batch: calls.append((batch.num_seqs, batch.num_tokens, batch.token_type_ids is not None)) or step(batch)
    done = engine.warm_up(256, max_seqs=4)
    assert done["shapes"] == len(calls) == len(warm_up_shapes(256, engine.info.max_input_tokens, 4)) and done["max_tokens"] == 256
    assert {n for n, _, _ in calls} == {1, 2, 4, 8} and max(t for _, t, _ in calls) == 256 and done["max_seqs"] == 8
    assert all(types == (engine.info.task == "score") for _, _, types in calls)  # pairs carry their segments
    engine.step = step
    after = engine.embed(inputs) if engine.info.task == "embed" else engine.score("which flower", inputs)
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_engine_server_warms_up_by_default_and_only_on_a_gpu(caplog):
    import argparse
    from types import SimpleNamespace

    from florist.server.cli import add_arguments, prepare

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).warm_up is True
    assert p.parse_args(["--no-warm-up"]).warm_up is False

    class Fake:
        def __init__(self, device, task="embed"):
            self.info, self.max_batch_tokens, self.calls = SimpleNamespace(device=device, task=task), 4096, []

        def warm_up(self, max_tokens, max_seqs):
            self.calls.append(("warm_up", max_tokens, max_seqs))
            return {"shapes": 1, "max_tokens": max_tokens, "max_seqs": max_seqs, "seconds": 0.0}

        def step(self, batch):
            self.calls.append(("step", batch.num_seqs))
            return SimpleNamespace(numpy=lambda: None)

    caplog.set_level("INFO", logger="florist.server")
    for device, argv, expected in (("cuda:0", [], [("warm_up", 1000, 256)]), ("cuda:0", ["--no-warm-up"], [("step", 1)]),
                                   ("cpu", [], [("step", 1)])):
        engine = Fake(device)
        prepare(engine, p.parse_args(["--max-batch-tokens", "1000", *argv]))
        assert engine.calls == expected, (device, argv)
    said = [r.getMessage() for r in caplog.records if r.name == "florist.server"]
    assert len(said) == 2 and said[0].startswith("warming up: batch shapes up to 1000 tokens and 256 sequences")
    assert said[1].startswith("warmed up 1 batch shapes")  # before and after, so a long start-up says what it is doing
    lm = Fake("cuda:0", task="generate")
    prepare(lm, p.parse_args([]))
    assert lm.calls == []
