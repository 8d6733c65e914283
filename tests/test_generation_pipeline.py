"""Pipelined decode (generator.py) on the CPU, fp32: the code path the GPU runs, synchronously.

Step N+1 is launched (runner kind ADVANCE: inputs advanced on the device from step N's ids)
before step N's ids are read. Every test compares against transformers' greedy tokens and the
step-by-step engine (pipelined_decode=False), and checks that the pipeline actually ran."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

import florist
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.runner import ADVANCE, DECODE, PREFILL

from test_generation import NEW_TOKENS, ROOT, make_causal_lm, prompts_for, reference


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-pipeline"), tie=True)


def make_generator(lm_dir, pipelined: bool = True, **config):
    """The engine's Generator, with every runner call's kind logged in `gen.kinds`."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu", generation=GenerationConfig(pipelined_decode=pipelined, **config))
    gen = engine.runner
    gen.kinds = []
    execute = gen.runner.execute

    def logged(kind, *args):
        gen.kinds.append(kind)
        return execute(kind, *args)

    gen.runner.execute = logged
    return gen


def run_steps(gen, events=None, max_steps=500):
    """step() until nothing is left, calling events[step number](gen) first; checks step()'s
    contract: each returned sequence got exactly one token, is returned at most once after it
    finished (the step that finished it), and nothing past max_tokens."""
    events = events or {}
    known: dict[int, int] = {}
    for step_no in range(max_steps):
        if step_no in events:
            events[step_no](gen)
        elif not gen.has_work and step_no > max(events, default=-1):
            return
        before = {id(s): (len(s.output), s.finished) for s in [*gen.scheduler.running, *gen.scheduler.waiting]}
        stepped = gen.step()
        assert len({id(s) for s in stepped}) == len(stepped)
        for s in stepped:
            n, was_finished = before.get(id(s), (known.get(id(s), 0), False))
            assert not was_finished and len(s.output) == n + 1 and len(s.output) <= s.max_tokens
            known[id(s)] = len(s.output)
    raise AssertionError("the engine did not finish")


def test_pipelined_tokens_equal_step_by_step_and_transformers(lm_dir):
    prompts = prompts_for(lm_dir)
    outputs = {}
    for pipelined in (True, False):
        gen = make_generator(lm_dir, pipelined)
        seqs = [gen.submit(p, NEW_TOKENS) for p in prompts]
        run_steps(gen)
        outputs[pipelined] = [s.output for s in seqs]
        kinds = Counter(gen.kinds)
        assert kinds[PREFILL] == 1 and kinds[DECODE] + kinds[ADVANCE] == NEW_TOKENS - 1
        if pipelined:
            assert kinds[DECODE] == 1 and gen.kinds[-1] == ADVANCE  # every decode after the first is pipelined
        else:
            assert kinds[ADVANCE] == 0
        assert not gen.has_work  # all stopped at max_tokens: no step was launched past them
    assert outputs[True] == outputs[False] == reference(lm_dir, prompts)


def test_stop_ids_mid_run_drop_the_token_computed_after_the_stop(lm_dir):
    """Stop ids taken from transformers' output stop some sequences mid-run while others go on;
    the token pipelined past a stop is dropped, and the rest continue pipelined."""
    prompts = prompts_for(lm_dir, (3, 11, 17, 29, 40), seed=4)
    expected = reference(lm_dir, prompts)
    # Two stop ids that first appear at different depths in different sequences.
    candidates = [(e.index(t), t) for e in expected for t in e[4:20] if e.index(t) >= 4]
    stops = sorted({t for _, t in sorted(candidates)[:1] + sorted(candidates)[-1:]})

    def truncated(e):
        k = next((i for i, t in enumerate(e) if t in stops), None)
        return e if k is None else e[: k + 1]

    want = [truncated(e) for e in expected]
    assert min(len(w) for w in want) < NEW_TOKENS and len({len(w) for w in want}) > 1, "sequences should stop at different steps"
    for pipelined in (True, False):
        gen = make_generator(lm_dir, pipelined)
        seqs = [gen.submit(p, NEW_TOKENS, stops) for p in prompts]
        run_steps(gen)
        assert [s.output for s in seqs] == want
        assert [s.finish_reason for s in seqs] == ["stop" if w[-1] in stops else "length" for w in want]
        assert gen.scheduler.free_slots == gen.scheduler.num_slots
        if pipelined:
            assert Counter(gen.kinds)[ADVANCE] >= NEW_TOKENS // 2


def test_max_tokens_are_never_exceeded(lm_dir):
    prompts = prompts_for(lm_dir, (5, 9, 2, 30, 14, 7), seed=5)
    budgets = [1, 2, 3, 7, 32, 16]
    expected = reference(lm_dir, prompts)
    gen = make_generator(lm_dir)
    seqs = [gen.submit(p, n) for p, n in zip(prompts, budgets)]
    run_steps(gen)
    assert [s.output for s in seqs] == [e[:n] for e, n in zip(expected, budgets)]
    assert all(s.finish_reason == "length" for s in seqs)
    assert Counter(gen.kinds)[ADVANCE] >= 20


def test_a_prompt_submitted_while_others_decode_flushes_the_pipeline(lm_dir):
    prompts = prompts_for(lm_dir, (6, 21, 13), seed=6)
    expected = reference(lm_dir, prompts)
    gen = make_generator(lm_dir)
    seqs = [gen.submit(p, NEW_TOKENS) for p in prompts[:2]]
    marks = {}

    def join(g):
        marks["join"] = len(g.kinds)
        seqs.append(g.submit(prompts[2], NEW_TOKENS))

    run_steps(gen, {8: join})
    assert [s.output for s in seqs] == expected
    before, after = gen.kinds[: marks["join"]], gen.kinds[marks["join"] :]
    assert before[-1] == ADVANCE, "the two sequences were decoding pipelined"
    # The step in flight is read without launching another, then the prompt's prefill, a decode
    # packed on the host for the three, and pipelined decodes again.
    assert after[:3] == [PREFILL, DECODE, ADVANCE]


def test_aborts_while_pipelined(lm_dir):
    """An abort between steps takes effect at once: the aborted sequence gets no token from the
    step in flight, its slot is freed, and the others continue (pipelined again)."""
    prompts = prompts_for(lm_dir, (4, 18, 33, 9), seed=7)
    expected = reference(lm_dir, prompts)
    gen = make_generator(lm_dir, max_num_seqs=3)
    seqs = [gen.submit(p, NEW_TOKENS) for p in prompts]  # the fourth waits for a slot
    frozen = {}

    def abort(i):
        def event(g):
            frozen[i] = (len(seqs[i].output), seqs[i].finished)
            g.abort(seqs[i])
        return event

    run_steps(gen, {5: abort(1), 12: abort(3), 45: abort(0)})
    assert frozen[0] == (NEW_TOKENS, True) and seqs[0].finish_reason == "length"  # aborting a finished sequence: no effect
    assert 0 < frozen[3][0] < NEW_TOKENS, "sequence 3 takes the slot sequence 1 left"
    for i in (1, 3):
        assert seqs[i].finish_reason == "abort" and seqs[i].output == expected[i][: frozen[i][0]]
    assert [seqs[i].output for i in (0, 2)] == [expected[i] for i in (0, 2)]
    assert gen.scheduler.free_slots == 3 and not gen.has_work
    assert Counter(gen.kinds)[ADVANCE] >= NEW_TOKENS - 8


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_pipelined_equals_step_by_step(lm_dir, seed):
    """3 slots; sequences arrive over time with random budgets and stop ids; some are aborted.
    Every sequence's output is transformers' tokens up to its stop, budget or abort."""
    import random

    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(9)]
    prompts = prompts_for(lm_dir, lens, seed=10 + seed)
    expected = reference(lm_dir, prompts)
    budgets = [rng.randint(1, NEW_TOKENS) for _ in prompts]
    stop_pool = sorted({t for e in expected for t in e[5:12]})
    stops = [rng.sample(stop_pool, 2) if rng.random() < 0.5 else [] for _ in prompts]
    arrive = sorted(rng.sample(range(30), len(prompts)))
    abort_at = {rng.randrange(5, 40): rng.randrange(len(prompts)) for _ in range(2)}
    for pipelined in (True, False):
        gen = make_generator(lm_dir, pipelined, max_num_seqs=3)
        seqs: dict[int, object] = {}

        def arrive_now(g, i, seqs=seqs):
            seqs[i] = g.submit(prompts[i], budgets[i], stops[i])

        def abort_now(g, i, seqs=seqs):
            if i in seqs and not seqs[i].finished:
                g.abort(seqs[i])

        events: dict[int, list] = {}
        for i, at in enumerate(arrive):
            events.setdefault(at, []).append((arrive_now, i))
        for at, i in abort_at.items():
            events.setdefault(at, []).append((abort_now, i))
        run_steps(gen, {at: (lambda g, todo=todo: [f(g, i) for f, i in todo]) for at, todo in events.items()})
        assert len(seqs) == len(prompts)
        for i, s in seqs.items():
            want = expected[i][: budgets[i]]
            k = next((j for j, t in enumerate(want) if t in stops[i]), None)
            want = want if k is None else want[: k + 1]
            if s.finish_reason == "abort":
                assert s.output == want[: len(s.output)] and len(s.output) < len(want), f"sequence {i}"
            else:
                assert s.output == want, f"sequence {i}"
        assert gen.scheduler.free_slots == 3 and not gen.has_work
        if pipelined:
            assert Counter(gen.kinds)[ADVANCE] > 0


def test_tensor_parallel_two_ranks_pipelined_with_stops_and_a_queue(lm_dir):
    """TP 2 over gloo through the CLI: 2 slots for 3 prompts and a stop id mid-run, so ranks
    follow pipelined steps, a leave (with a dropped token), a join and pipelined steps again."""
    prompts = prompts_for(lm_dir, (1, 9, 33), seed=8)
    expected = reference(lm_dir, prompts)
    stop = next(t for t in expected[1][6:20] if expected[1].index(t) >= 6)
    want = []
    for e in expected:
        k = next((i for i, t in enumerate(e) if t == stop), None)
        want.append(e if k is None else e[: k + 1])
    cmd = [sys.executable, "-m", "florist.cli", "generate", "--model", str(lm_dir), "--device", "cpu", "--max-tokens", str(NEW_TOKENS),
           "--tensor-parallel-size", "2", "--max-num-seqs", "2", "--stop-token-ids", str(stop), "--json"]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [x["token_ids"] for x in lines] == want
