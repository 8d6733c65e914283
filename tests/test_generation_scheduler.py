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
            else:  # a length finish never saw one of its stop ids
                assert x.finish_reason == "length" and len(x.output) == x.max_tokens and not set(x.output) & x.stop_token_ids
        ended = {id(x) for x in done}
        for x in step.seqs:
            if id(x) not in ended:  # still running: its last token was no stop id
                assert x.output[-1] not in x.stop_token_ids
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


def fake_token(seq: Sequence, index: int) -> int:
    """A deterministic fake model: the token a sequence gets at output index `index`."""
    return (seq.seq_id * 7919 + index * 104729) % 50


@pytest.mark.parametrize("seed", range(20))
def test_pipelined_driver_gives_the_step_by_step_outputs(seed):
    """The generator's pipelined loop over a fake device: a decode launched before the previous
    step's tokens are read (next_decode) computes its tokens from the device's view of each
    sequence (one unread token ahead). Outputs must equal step-by-step decoding: no sequence past
    a stop id or max_tokens, aborted ones frozen at the abort, every sequence finished once."""
    rng = random.Random(seed)
    s = GenerationScheduler(num_slots=rng.randint(1, 5), max_model_len=64, max_prefill_tokens=rng.choice([8, 100]))
    stop_ids = {3, 11}
    seqs: list[Sequence] = []
    frozen: dict[int, int] = {}
    in_flight = None  # (step, tokens): tokens computed at launch, as the device would
    launches = chained = 0

    def launch(step, ahead):
        # The device sees each sequence's host tokens plus `ahead` unread ones (0 or 1).
        return step, [fake_token(x, len(x.output) + ahead) for x in step.seqs]

    for step_no in range(600):
        if len(seqs) < 40 and rng.random() < 0.15:
            n = rng.randint(1, 30)
            seq = Sequence(list(range(n)), rng.randint(1, 64 - n), stop_ids if rng.random() < 0.5 else ())
            s.add(seq)
            seqs.append(seq)
        if rng.random() < 0.02 and (s.waiting or s.running):
            victim = rng.choice([*s.waiting, *s.running])
            frozen[victim.seq_id] = len(victim.output)
            s.abort(victim)
        current, in_flight = in_flight, None
        if current is None:
            step = s.schedule()
            if step is None:
                continue
            current = launch(step, 0)
            launches += 1
        following = s.next_decode(current[0])
        if following is not None:
            assert following.seqs == s.running
            # It feeds each sequence's unread token at position num_tokens: inside the slot.
            assert all(x.num_tokens + 1 <= s.max_model_len for x in following.seqs)
            in_flight = launch(following, 1)
            chained += 1
        before = {x.seq_id: len(x.output) for x in current[0].seqs}
        s.update(*current)
        for x in current[0].seqs:
            assert len(x.output) - before[x.seq_id] in (0, 1)
        check_invariants(s)
    while s.has_work or in_flight is not None:  # drain, as the generator would
        current, in_flight = in_flight, None
        if current is None:
            current = launch(s.schedule(), 0)
        following = s.next_decode(current[0])
        if following is not None:
            in_flight = launch(following, 1)
        s.update(*current)
    assert chained > launches, "most decode steps should be pipelined"
    assert s.free_slots == s.num_slots
    for seq in seqs:
        assert seq.finished
        assert seq.output == [fake_token(seq, i) for i in range(len(seq.output))]
        if seq.seq_id in frozen:
            assert seq.finish_reason == "abort" and len(seq.output) == frozen[seq.seq_id]
            continue
        first_stop = next((i for i, t in enumerate(fake_token(seq, i) for i in range(seq.max_tokens)) if t in seq.stop_token_ids), None)
        if first_stop is not None:
            assert seq.finish_reason == "stop" and len(seq.output) == first_stop + 1
        else:
            assert seq.finish_reason == "length" and len(seq.output) == seq.max_tokens


def test_next_decode_only_over_an_unchanged_running_set():
    s = GenerationScheduler(num_slots=2, max_model_len=32, max_prefill_tokens=100)
    a, b = Sequence([1], 10), Sequence([2], 2)
    s.add(a)
    s.add(b)
    prefill = s.schedule()
    assert s.next_decode(prefill) is None  # after a prefill the next decode is packed on the host
    s.update(prefill, [5, 6])
    decode = s.schedule()
    following = s.next_decode(decode)
    assert following.kind == "decode" and following.seqs == [a, b]
    s.update(decode, [5, 6])  # b has its 2 tokens: it leaves
    assert s.next_decode(following) is None  # the running set changed: flush
    s.update(following, [7, 8])  # b's token computed after it finished is dropped
    assert a.output == [5, 5, 7] and b.output == [6, 6] and b.finish_reason == "length"
    decode = s.schedule()
    assert decode.seqs == [a] and s.next_decode(decode) is not None
    c = Sequence([3], 4)
    s.add(c)  # a prefill is due (a free slot): flush
    assert s.next_decode(decode) is None
    s.update(decode, [1])
    s.update(s.schedule(), [2])  # c's prefill
    decode = s.schedule()
    s.abort(c)
    assert s.next_decode(decode) is None  # an abort changes the running set
    d, e = Sequence([4], 5), Sequence([5], 5)
    s2 = GenerationScheduler(num_slots=1, max_model_len=32, max_prefill_tokens=100)
    s2.add(d)
    s2.update(s2.schedule(), [9])
    s2.add(e)
    decode = s2.schedule()
    assert decode.seqs == [d] and s2.next_decode(decode) is not None  # e waits for a slot: no flush
    d.output += [9, 9, 9]  # 4 of 5: the step in flight gives the last token, nothing after it
    assert s2.next_decode(decode) is None
