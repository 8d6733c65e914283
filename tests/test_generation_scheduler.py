"""The generation scheduler (plain Python) against its invariants, with a fake model."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from florist.engine.generation.scheduler import FINISHED, RUNNING, GenerationScheduler, Sequence


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, florist.engine.generation.scheduler, florist.engine.generation.detokenizer; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def check_invariants(s: GenerationScheduler) -> None:
    slots = [seq.slot for seq in s.running]
    assert len(slots) == len(set(slots)), "a slot is owned by two sequences"
    assert all(0 <= slot < s.num_slots for slot in slots)
    assert len(s.running) + s.free_slots == s.num_slots, "slots lost or duplicated"
    assert all(seq.status == RUNNING for seq in s.running)
    assert all(seq.slot is None and not seq.output for seq in s.waiting)
    for seq in s.running:
        assert seq.num_tokens <= s.max_model_len


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_keeps_every_invariant(seed):
    """Sequences arrive at random steps, with random prompts, budgets and stop ids; a fake model
    emits random tokens. Checks: FCFS admission, budgets, slots, one token per sequence per step,
    every sequence finishes exactly once with the right reason, nothing is lost."""
    rng = random.Random(seed)
    s = GenerationScheduler(num_slots=rng.randint(1, 6), max_model_len=64, max_prefill_tokens=rng.choice([8, 32, 100]))
    all_seqs: list[Sequence] = []
    admitted: list[Sequence] = []
    finished: list[Sequence] = []
    for step_no in range(400):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            if len(all_seqs) < 60:
                prompt_len = rng.randint(1, 40)
                seq = Sequence([rng.randrange(100) for _ in range(prompt_len)], rng.randint(1, 64 - prompt_len), {rng.randrange(100)} if rng.random() < 0.5 else ())
                s.add(seq)
                all_seqs.append(seq)
        if rng.random() < 0.03 and (s.waiting or s.running):  # a client goes away
            victim = rng.choice([*s.waiting, *s.running])
            assert s.abort(victim) and victim.finish_reason == "abort"
            finished.append(victim)
        waiting_before = list(s.waiting)
        running_before = list(s.running)
        step = s.schedule()
        check_invariants(s)
        if step is None:
            assert not s.has_work
            continue
        if step.kind == "prefill":
            k = len(step.seqs)
            assert step.seqs == waiting_before[:k], "admission must be first come, first served"
            assert k >= 1 and step.num_tokens == sum(len(x.prompt) for x in step.seqs)
            assert k == 1 or step.num_tokens <= s.max_prefill_tokens
            assert all(x.slot is not None for x in step.seqs)
            admitted += step.seqs
        else:
            assert step.seqs == running_before and not (waiting_before and len(running_before) < s.num_slots)
        lengths = {id(x): len(x.output) for x in step.seqs}
        tokens = [rng.randrange(100) for _ in step.seqs]
        done = s.update(step, tokens)
        for x, token in zip(step.seqs, tokens):
            assert len(x.output) == lengths[id(x)] + 1 and x.output[-1] == token
        for x in done:
            assert x.status == FINISHED and x.slot is None
            if x.finish_reason == "stop":
                assert x.output[-1] in x.stop_token_ids and not set(x.output[:-1]) & x.stop_token_ids
            else:
                assert x.finish_reason == "length" and len(x.output) == x.max_tokens
        finished += done
        check_invariants(s)
    while (step := s.schedule()) is not None:  # drain
        finished += s.update(step, [0] * len(step.seqs))
    assert sorted(x.seq_id for x in finished) == sorted(x.seq_id for x in all_seqs), "every sequence finishes exactly once"
    assert [x.seq_id for x in admitted] == sorted(x.seq_id for x in admitted), "admitted in arrival order"
    assert s.free_slots == s.num_slots


def test_prompt_over_the_prefill_budget_runs_alone():
    s = GenerationScheduler(num_slots=4, max_model_len=64, max_prefill_tokens=10)
    long, short = Sequence(list(range(30)), 4), Sequence([1, 2], 4)
    s.add(long)
    s.add(short)
    first = s.schedule()
    assert first.kind == "prefill" and first.seqs == [long]
    second = s.schedule()
    assert second.kind == "prefill" and second.seqs == [short]


def test_joining_and_leaving_between_steps():
    s = GenerationScheduler(num_slots=2, max_model_len=32, max_prefill_tokens=100)
    a, b, c = Sequence([1], 2), Sequence([2], 5), Sequence([3], 1)
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()
    assert step.kind == "prefill" and step.seqs == [a, b] and [a.slot, b.slot] == [0, 1]
    s.update(step, [7, 8])
    step = s.schedule()
    assert step.kind == "decode" and step.seqs == [a, b]  # c waits: no free slot
    assert s.update(step, [7, 8]) == [a]  # a has its 2 tokens
    step = s.schedule()
    assert step.kind == "prefill" and step.seqs == [c] and c.slot == 0  # c takes a's slot
    assert s.update(step, [9]) == [c]
    assert s.schedule().seqs == [b]


def test_bad_sequences_are_refused_with_a_reason():
    s = GenerationScheduler(num_slots=1, max_model_len=16, max_prefill_tokens=16)
    with pytest.raises(ValueError, match="max_model_len 16"):
        s.add(Sequence(list(range(10)), 7))
    with pytest.raises(ValueError, match="at least one token"):
        s.add(Sequence([], 1))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(Sequence([1], 0))
    ok = Sequence([1], 1)
    s.add(ok)
    with pytest.raises(ValueError, match="already added"):
        s.add(ok)
    with pytest.raises(ValueError, match="2 tokens for a step of 1"):
        s.update(s.schedule(), [1, 2])
