"""Engine.warm_up and Generator.warm_up: the batch shapes (and, for a causal LM, the prefill and
decode steps) an engine server runs before serving with --warm-up, so kernels compile at start-up,
not while a request of a new shape waits; and the flag."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import florist
from florist.engine.engine import warm_up_shapes
from florist.engine.generation.config import GenerationConfig


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

    from florist.server.cli import add_arguments, prepare

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).warm_up is True
    assert p.parse_args(["--no-warm-up"]).warm_up is False

    class FakeGenerator:
        config = GenerationConfig(max_num_seqs=24)

        def __init__(self, calls):
            self.calls = calls

        def warm_up(self):
            self.calls.append("generator.warm_up")
            return {"rounds": 3, "steps": 6, "max_tokens": 512, "max_seqs": 24, "decode_rows": [1, 12, 24], "seconds": 0.0}

    class Fake:
        def __init__(self, device, task="embed"):
            self.info, self.max_batch_tokens, self.calls = SimpleNamespace(device=device, task=task), 4096, []
            self.runner = FakeGenerator(self.calls)

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
        a = p.parse_args(["--max-batch-tokens", "1000", *argv])
        prepare(engine, warm_up=a.warm_up, max_batch_tokens=a.max_batch_tokens, max_batch_seqs=a.max_batch_seqs)
        assert engine.calls == expected, (device, argv)
    said = [r.getMessage() for r in caplog.records if r.name == "florist.server"]
    assert len(said) == 2 and said[0].startswith("warming up: batch shapes up to 1000 tokens and 256 sequences")
    assert said[1].startswith("warmed up 1 batch shapes")  # before and after, so a long start-up says what it is doing
    caplog.clear()
    # A causal LM: the generation warm-up on a GPU with --warm-up; nothing otherwise (not even the small batch).
    for device, argv, expected in (("cuda:0", [], ["generator.warm_up"]), ("cuda", ["--no-warm-up"], []), ("cpu", [], [])):
        lm = Fake(device, task="generate")
        a = p.parse_args(argv)
        prepare(lm, warm_up=a.warm_up, max_batch_tokens=a.max_batch_tokens, max_batch_seqs=a.max_batch_seqs)
        assert lm.calls == expected, (device, argv)
    said = [r.getMessage() for r in caplog.records if r.name == "florist.server"]
    assert len(said) == 2 and said[0].startswith("warming up: a prefill of every bucket") and "up to 24 sequences" in said[0]
    assert said[1] == "warmed up 3 prefill rounds up to 512 tokens and 24 prompts, decodes of 1, 12, 24 sequences (6 steps) in 0.0 s"


# -- generation ----------------------------------------------------------------------------------
def test_generation_rounds_meet_every_prefill_and_decode_bucket():
    from florist.engine.generation.decode_graphs import decode_buckets
    from florist.engine.generation.generator import warm_up_rounds
    from florist.engine.graph_runner import seq_bucket, token_bucket

    for max_tokens, max_prompt_len, slots in ((8192, 4094, 32), (256, 254, 8), (1000, 510, 100), (64, 62, 3), (4096, 2046, 1)):
        rounds = warm_up_rounds(max_tokens, max_prompt_len, slots)
        assert all(len(r) <= slots and max(r) <= max_prompt_len and min(r) >= 1 for r in rounds)
        assert len({tuple(r) for r in rounds}) == len(rounds)
        sizes = decode_buckets(slots)
        assert {next(b for b in sizes if b >= len(r)) for r in rounds} == set(sizes), (max_tokens, slots)  # every decode bucket
        assert {seq_bucket(len(r)) for r in rounds} >= {seq_bucket(n) for n in range(1, slots + 1) if 16 * n <= max_tokens}
        reachable = {token_bucket(t) for t in (64 << k for k in range(20)) if t <= min(max_tokens, slots * max_prompt_len)}
        assert {token_bucket(sum(r)) for r in rounds} >= reachable, (max_tokens, slots)  # every doubling of the token count
    rounds = warm_up_rounds(8192, 4094, 32)
    assert [len(r) for r in rounds if set(r) == {16}] == [1, 2, 4, 8, 16, 32, 12, 24]  # 12 and 24: decode buckets alone
    assert max(sum(r) for r in rounds) == 8192 and [r for r in rounds if len(r) == 1 and r[0] > 16][-1] == [2048]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from test_generation import make_causal_lm

    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-warm-up"), tie=True)


def test_generation_warm_up_runs_every_bucket_and_leaves_the_generator_clean(lm_dir):
    """Every round goes through the step API rank 0 broadcasts at TP > 1 (a stand-in records the
    broadcasts), every decode size and prefill round runs, and afterwards the generator is empty
    and gives transformers' tokens, pipelined, as without the warm-up."""
    from test_generation import NEW_TOKENS, prompts_for, reference
    from florist.engine.generation.generator import warm_up_rounds
    from florist.engine.generation.runner import DECODE, PREFILL

    engine = florist.Engine.from_pretrained(lm_dir, device="cpu", generation=GenerationConfig(max_num_seqs=8, max_model_len=256))
    gen = engine.runner
    prompts = prompts_for(lm_dir, (1, 5, 17, 40, 64, 3, 9, 30), seed=5)
    before = [r.token_ids for r in engine.generate(prompts, max_tokens=NEW_TOKENS)]
    executed, sent = [], []
    execute = gen.runner.execute
    gen.runner.execute = lambda kind, packed, t, b: executed.append((kind, t, b)) or execute(kind, packed, t, b)
    gen.tp = SimpleNamespace(send=lambda kind, packed, t, b: sent.append((kind, t, b)))
    done = gen.warm_up(256)
    gen.tp = None
    rounds = warm_up_rounds(256, 254, 8)
    assert sent == executed  # every step went to the other ranks too
    assert [(t, b) for kind, t, b in executed if kind == PREFILL] == [(sum(r), len(r)) for r in rounds]
    assert [b for kind, _, b in executed if kind == DECODE] == [len(r) for r in rounds]  # one decode per round, no pipelined step
    assert {b for kind, _, b in executed if kind == DECODE} == {1, 2, 4, 8}
    assert done["rounds"] == len(rounds) and done["steps"] == len(executed) == 2 * len(rounds)
    assert done["max_tokens"] == 256 and done["max_seqs"] == 8 and done["decode_rows"] == [1, 2, 4, 8] and done["seconds"] > 0
    assert not gen.has_work and gen._in_flight is None and gen.scheduler.free_slots == 8
    assert not gen.scheduler.running and not gen.scheduler.waiting
    gen.runner.execute = execute
    after = [r.token_ids for r in engine.generate(prompts, max_tokens=NEW_TOKENS)]
    assert after == before == reference(lm_dir, prompts)


def test_generation_warm_up_defaults_and_refuses_a_busy_generator(lm_dir):
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu", generation=GenerationConfig(max_num_seqs=4, max_model_len=128, max_prefill_tokens=300))
    gen = engine.runner
    done = gen.warm_up()  # CPU: no prefill graphs, so up to max_prefill_tokens, in 4 prompts (the slots) of at most 126 tokens
    assert 256 < done["max_tokens"] <= 300 and done["max_seqs"] == 4 and done["decode_rows"] == [1, 2, 4]
    seq = gen.submit([1, 2, 3], 4)
    with pytest.raises(RuntimeError, match="warm up before serving"):
        gen.warm_up()
    gen.step()
    assert seq.output and not seq.finished


def test_generation_warm_up_at_tensor_parallel_two_over_gloo(lm_dir):
    """TP 2 (rank 1 spawned): the warm-up's steps reach the worker (else the model's collectives
    would wait forever), and the tokens after it are transformers'."""
    import json
    import subprocess
    import sys

    from test_generation import ROOT, prompts_for, reference

    prompts = prompts_for(lm_dir, (1, 9, 33), seed=2)
    script = (
        "import json, sys, florist\n"
        "from florist.engine.generation.config import GenerationConfig\n"
        "engine = florist.Engine.from_pretrained(sys.argv[1], device='cpu', tensor_parallel_size=2,\n"
        "                                        generation=GenerationConfig(max_num_seqs=4, max_model_len=128))\n"
        "try:\n"
        "    done = engine.runner.warm_up(128)\n"
        "    results = engine.generate(json.loads(sys.argv[2]), max_tokens=16)\n"
        "finally:\n"
        "    engine.close()\n"
        "print(json.dumps({'done': done, 'token_ids': [r.token_ids for r in results]}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(lm_dir), json.dumps(prompts)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["done"]["decode_rows"] == [1, 2, 4] and out["done"]["max_tokens"] == 128
    assert out["token_ids"] == reference(lm_dir, prompts, 16)
