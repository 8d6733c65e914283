"""Generation on the GPU (skipped without CUDA): decode graph replay equals eager, bit for bit;
pipelined decode (inputs advanced on the device, step N+1 launched before step N is read) equals
host packing bit for bit; whole runs through the graphs agree with transformers (fp32: the same
tokens; bf16: every token is transformers' argmax up to bf16 rounding); after Generator.warm_up
the buckets it met run no first sight and replay the tokens of an engine that did not warm up
(that nothing compiles after it: tests/test_bench_generate_warm_up.py, in fresh processes).
Checks of k/v the cache holds after a step first put a sentinel where the step writes, so a
step that wrote nothing cannot pass on what an earlier run left there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.generation.batch import pack_decode, pack_prefill
from florist.engine.graph_runner import bucket_of
from florist.engine.generation.config import GenerationConfig
from florist.engine.generation.runner import ADVANCE

from test_generation import NEW_TOKENS, make_causal_lm, prompts_for, reference
from test_generation_pipeline import run_steps

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-gpu"), tie=True)


SENTINEL = 16384.0  # exact in bf16 and fp32, and far above any k/v this model computes


def _five_prefilled(lm_dir, dtype, decode_attention=None):
    """A generator (and its runner) with five prompts of different lengths prefilled, ready to decode."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype=dtype, generation=GenerationConfig(
        max_num_seqs=8, max_model_len=256, decode_attention=decode_attention))
    gen = engine.runner
    for p in prompts_for(lm_dir, (3, 17, 40, 9, 64)):
        gen.submit(p, NEW_TOKENS)
    gen.step()  # prefill all five
    return gen, gen.runner, list(gen.scheduler.running)


@pytest.mark.parametrize("dtype, backend", [("bf16", None), ("bf16", "flash"), ("fp32", None)])  # None: Triton decode (bf16), torch (fp32)
def test_decode_graph_replay_equals_eager(lm_dir, dtype, backend):
    gen, runner, seqs = _five_prefilled(lm_dir, dtype, backend)
    rows = runner.decode_rows(len(seqs))
    assert rows == 8
    packed = pack_decode([s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs], [s.slot for s in seqs], rows, runner.scratch_slot)
    real_slots = slice(0, runner.scratch_slot)  # padding rows all write the scratch slot, in any order

    def mark_written():  # the step's own k/v positions: a step that skipped the store reads (and leaves) the sentinel
        for s in seqs:
            runner.cache.data[:, :, s.slot, s.num_tokens - 1] = SENTINEL

    mark_written()
    with torch.inference_mode():
        eager = runner._decode_forward(torch.from_numpy(packed).cuda(), rows, runner.max_len).clone()
    cache_eager = runner.cache.data[:, :, real_slots].clone()
    assert not (cache_eager == SENTINEL).any()
    outs, caches = [], []
    for _ in range(3):  # first sight (eager, padded), capture, replay
        mark_written()
        outs.append(runner.decode(packed, len(seqs)).clone())
        caches.append(runner.cache.data[:, :, real_slots].clone())
    assert rows in runner.graphs.graphs
    for out, cache in zip(outs, caches):
        assert torch.equal(out[: len(seqs)], eager[: len(seqs)])
        assert torch.equal(cache, cache_eager)  # the same k/v written again


@pytest.mark.parametrize("lens", [(5,), (64,), (3, 17, 40, 9, 64), (200, 1, 77)])
def test_prefill_graph_replay_equals_eager(lm_dir, lens):
    """bf16: a prefill's first sight (eager, padded to its bucket), its capture and its replays
    compute the same next ids and k/v, bit for bit (padded against unpadded: tests/test_prefill_graphs.py)."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16", generation=GenerationConfig(max_num_seqs=8, max_model_len=256))
    runner = engine.runner.runner
    assert runner.prefill_graphs is not None
    packed = pack_prefill(prompts_for(lm_dir, lens, seed=len(lens)), list(range(len(lens))), runner.max_len)
    t, b = sum(lens), len(lens)
    real = slice(0, runner.scratch_slot)  # the dummy sequence writes the scratch slot
    outs, caches = [], []
    with torch.inference_mode():
        for _ in range(3):  # first sight (eager, padded), capture, replay
            runner.cache.data[:, :, real] = SENTINEL  # a run that stored no k/v leaves the sentinel
            outs.append(runner.prefill(packed, t, b)[:b].clone())
            caches.append(runner.cache.data[:, :, real].clone())
    assert bucket_of(t, b, max(lens)) in runner.prefill_graphs.graphs
    for i, n in enumerate(lens):  # each prompt's positions written, the rest of its slot untouched
        assert not (caches[0][:, :, i, :n] == SENTINEL).any() and (caches[0][:, :, i, n:] == SENTINEL).all()
    for out, cache in zip(outs[1:], caches[1:]):
        assert torch.equal(out, outs[0]) and torch.equal(cache, caches[0])
    engine.close()


def test_fp32_prefills_stay_eager(lm_dir):
    """fp32 prefill attention reads sequence lengths on the host (not capturable): no prefill graphs."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="fp32", generation=GenerationConfig(max_num_seqs=8, max_model_len=256))
    assert engine.runner.runner.prefill_graphs is None and engine.runner.runner.graphs is not None
    engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_next_advances_on_the_device_like_host_packing(lm_dir, dtype):
    """decode_next (the pipelined step: ids and positions advanced in place in the graph's static
    input) computes what eager decode computes from host-packed inputs, bit for bit, k/v included."""
    gen, runner, seqs = _five_prefilled(lm_dir, dtype)
    b, rows, scratch = len(seqs), runner.decode_rows(len(seqs)), runner.scratch_slot
    tokens, positions, slots = [s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs], [s.slot for s in seqs]
    steps = 6  # eager first sight, then capture and replays: all but the first advanced on the device
    advanced = [runner.decode(pack_decode(tokens, positions, slots, rows, scratch), b)[:b].clone()]
    for _ in range(steps - 1):
        advanced.append(runner.decode_next(b)[:b].clone())
    assert rows in runner.graphs.graphs
    cache_advanced = runner.cache.data[:, :, :scratch].clone()
    fed = tokens
    for i in range(steps):
        packed = pack_decode(fed, [p + i for p in positions], slots, rows, scratch)
        with torch.inference_mode():
            eager = runner._decode_forward(torch.from_numpy(packed).cuda(), rows, runner.max_len)
        assert torch.equal(eager[:b], advanced[i]), f"step {i}"
        fed = advanced[i].tolist()
    assert torch.equal(runner.cache.data[:, :, :scratch], cache_advanced)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_pipelined_runs_equal_step_by_step_runs(lm_dir, dtype):
    """The same batch (equal budgets: the batch never changes mid-run) pipelined and step by step,
    twice each (the second run replays captured graphs): identical tokens, bf16 included."""
    outputs = {}
    for pipelined in (True, False):
        engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype=dtype,
                                                generation=GenerationConfig(max_num_seqs=8, max_model_len=128, pipelined_decode=pipelined))
        kinds = log_kinds(engine.runner)
        for _ in range(2):
            outputs[pipelined] = [r.token_ids for r in engine.generate(prompts_for(lm_dir), max_tokens=NEW_TOKENS)]
        assert (kinds.count(ADVANCE) >= NEW_TOKENS) == pipelined
        assert engine.runner.runner.graphs.graphs
    assert outputs[True] == outputs[False]


def test_fp32_pipelined_with_stops_joins_and_aborts_equal_transformers(lm_dir):
    """CUDA graphs, pipelined: sequences stop at stop ids mid-run (the token computed after the stop
    is dropped; its k/v went to the sequence's own slot, which the next prompt then takes), others
    join from a queue and one is aborted; every output is transformers' up to its end."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="fp32", generation=GenerationConfig(max_num_seqs=3, max_model_len=128))
    gen = engine.runner
    kinds = log_kinds(gen)
    prompts = prompts_for(lm_dir, (7, 1, 30, 12, 45, 3, 20), seed=3)
    expected = reference(lm_dir, prompts)
    firsts = [t for e in expected[:3] for j, t in enumerate(e) if 5 <= j < 16 and e.index(t) == j]  # first appearances
    stops = sorted({firsts[0], firsts[-1]})
    seqs = {}

    def submit(ids):
        def event(g):
            for i in ids:
                seqs[i] = g.submit(prompts[i], NEW_TOKENS, stops)
        return event

    def abort(g):
        g.abort(seqs[5])

    # step 45: sequence 5 is running (9 tokens on this schedule) with a step in flight, whose
    # token the abort must drop
    run_steps(gen, {0: submit([0, 1, 2, 3, 4]), 10: submit([5, 6]), 45: abort})
    assert seqs[5].finish_reason == "abort" and 0 < len(seqs[5].output) < NEW_TOKENS, seqs[5].output
    for i, s in seqs.items():
        k = next((j for j, t in enumerate(expected[i]) if t in stops), None)
        want = expected[i] if k is None else expected[i][: k + 1]
        if s.finish_reason == "abort":
            assert i == 5 and s.output == want[: len(s.output)]
        else:
            assert s.output == want, f"sequence {i}"
    assert kinds.count(ADVANCE) > NEW_TOKENS
    assert gen.scheduler.free_slots == 3 and not gen.has_work


def test_after_the_warm_up_covered_buckets_compile_nothing_and_replay_the_same_tokens(lm_dir, caplog):
    """Generator.warm_up gives every decode bucket and its rounds' prefill buckets their first
    sight (a bucket met twice is captured then). A run in covered buckets then captures and replays
    them with no first sight, gives the tokens of an engine that did not warm up, and the graphs'
    memory is reported. (That no Triton kernel compiles after the warm-up cannot be checked here:
    Triton reports a kernel once per process, and the cold engine below, like earlier tests,
    compiles them first. tests/test_bench_generate_warm_up.py checks it in fresh processes.)"""
    import logging

    config = GenerationConfig(max_num_seqs=8, max_model_len=256)
    prompts = prompts_for(lm_dir, (5, 17, 40), seed=4)  # prefill bucket (64 tokens, 4, 64): a warm-up round of 2 x 16 met it
    cold = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16", generation=config)
    want = [r.token_ids for r in cold.generate(prompts, max_tokens=NEW_TOKENS)]
    cold.close()
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16", generation=config)
    gen, runner = engine.runner, engine.runner.runner
    done = gen.warm_up()
    assert done["decode_rows"] == runner.graphs.buckets == [1, 2, 4, 8] and runner.graphs.seen == {1, 2, 4, 8}
    key = bucket_of(sum((5, 17, 40)), 3, 40)
    # Buckets the rounds met twice are captured already (decode bucket 1: every one-prompt round);
    # these two were met once (2 x 16 and 4 x 16 prompts): the run below captures them.
    assert key not in runner.prefill_graphs.graphs and 4 not in runner.graphs.graphs
    assert key in runner.prefill_graphs.seen and not gen.has_work
    with caplog.at_level(logging.INFO, logger="florist.engine.generation"):
        runs = [[r.token_ids for r in engine.generate(prompts, max_tokens=NEW_TOKENS)] for _ in range(2)]  # capture, then replay
    assert runs[0] == runs[1] == want
    assert key in runner.prefill_graphs.graphs and 4 in runner.graphs.graphs
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if m.startswith("ran a first-sight")], said
    assert [m for m in said if m.startswith("captured a prefill CUDA graph for 64 tokens, up to 3 prompts, longest 64, in ")], said
    assert [m for m in said if m.startswith("captured a decode CUDA graph for 4 rows in ")], said
    prefill, decode = runner.prefill_graphs.stats(), runner.graphs.stats()
    assert prefill["prefill_graph_memory_bytes"] > 0 and decode["decode_graph_memory_bytes"] > 0, (prefill, decode)
    assert prefill["prefill_first_sight_seconds"] > 0 and decode["decode_first_sight_seconds"] > 0  # the warm-up's
    engine.close()


@pytest.mark.gpu(count=2)
def test_warm_up_at_tensor_parallel_two_gpus(lm_dir):
    """The warm-up's steps go through rank 0's broadcast: both ranks meet every decode bucket in
    the same order (else the model's NCCL collectives would wait forever), so the captures that
    follow line up; fp32 tokens equal transformers'."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="fp32", tensor_parallel_size=2,
                                            generation=GenerationConfig(max_num_seqs=8, max_model_len=128))
    try:
        done = engine.runner.warm_up()
        assert done["decode_rows"] == [1, 2, 4, 8] and engine.runner.runner.graphs.seen == {1, 2, 4, 8}
        prompts = prompts_for(lm_dir, (1, 9, 33))
        for _ in range(2):  # capture, then replay
            results = engine.generate(prompts, max_tokens=NEW_TOKENS)
        assert [r.token_ids for r in results] == reference(lm_dir, prompts)
        assert 4 in engine.runner.runner.graphs.graphs
    finally:
        engine.close()


def log_kinds(gen) -> list[int]:
    kinds, execute = [], gen.runner.execute

    def logged(kind, *args):
        kinds.append(kind)
        return execute(kind, *args)

    gen.runner.execute = logged
    return kinds


def test_fp32_graphs_equal_transformers_with_continuous_batching(lm_dir):
    """Decode buckets (1, 2, 4 and 6 rows for 6 slots; this schedule meets 1, 4 and 6) captured
    and replayed while sequences join and leave: fp32 tokens equal transformers' (no TF32; the
    tiny model's smallest top-2 logit gap is ~1e-3)."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="fp32", generation=GenerationConfig(max_num_seqs=6, max_model_len=128))
    gen = engine.runner
    prompts = prompts_for(lm_dir, (7, 1, 30, 12, 45, 3, 20, 9, 2, 33), seed=1)
    budgets = [5, 32, 12, 20, 2, 32, 9, 17, 25, 8]
    seqs = [gen.submit(p, n) for p, n in zip(prompts[:6], budgets[:6])]
    for _ in range(6):
        gen.step()
    seqs += [gen.submit(p, n) for p, n in zip(prompts[6:], budgets[6:])]
    while gen.has_work:
        gen.step()
    expected = reference(lm_dir, prompts)
    assert [s.output for s in seqs] == [e[:n] for e, n in zip(expected, budgets)]
    assert len(engine.runner.runner.graphs.graphs) >= 3


def test_bf16_tokens_are_transformers_argmax(lm_dir):
    """Five prompts together (decode steps of 8 rows: the unfused layers) and one alone (one-row
    steps: the fused decode stack, florist/kernels/decode_layer.py), each run twice (the second
    replays the captured graphs)."""
    from transformers import Qwen3ForCausalLM

    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", generation=GenerationConfig(max_num_seqs=8, max_model_len=128))
    prompts = prompts_for(lm_dir)
    for _ in range(2):
        results = engine.generate(prompts, max_tokens=NEW_TOKENS)
    alone = prompts_for(lm_dir, (23,), seed=9)
    for _ in range(2):
        results_alone = engine.generate(alone, max_tokens=NEW_TOKENS)
    assert engine.runner.runner.graphs.graphs.keys() >= {1, 8}
    model = Qwen3ForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()
    for p, r in zip(prompts + alone, results + results_alone):
        with torch.no_grad():
            logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        gap = float((logits.max(1).values - chosen).max())
        print(f"prompt of {len(p)}: largest gap to transformers' argmax logit {gap:.4f}")
        assert gap <= 0.1  # CPU bf16 measures <= 0.02 on this model; logits are ~5


@pytest.mark.gpu(count=2)
def test_tensor_parallel_two_gpus_over_nccl(lm_dir):
    """Rank 0 here, rank 1 spawned; decode graphs capture the NCCL all-reduces."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="fp32", tensor_parallel_size=2,
                                            generation=GenerationConfig(max_num_seqs=8, max_model_len=128))
    kinds = log_kinds(engine.runner)
    try:
        prompts = prompts_for(lm_dir, (1, 9, 33))
        for _ in range(2):
            results = engine.generate(prompts, max_tokens=NEW_TOKENS)
        assert [r.token_ids for r in results] == reference(lm_dir, prompts)
        assert kinds.count(ADVANCE) > NEW_TOKENS  # pipelined steps: every rank advanced its own buffer
        # A stop id mid-run: ranks follow the leave (and the dropped token) in lockstep.
        expected = reference(lm_dir, prompts)
        stop = expected[1][8]
        k = [next((i for i, t in enumerate(e) if t == stop), None) for e in expected]
        results = engine.generate(prompts, max_tokens=NEW_TOKENS, stop_token_ids=[stop])
        assert [r.token_ids for r in results] == [e if j is None else e[: j + 1] for e, j in zip(expected, k)]
    finally:
        engine.close()
    assert np.all([not p.is_alive() for p in engine.runner.tp.procs])


@pytest.mark.gpu(count=2)
def test_florist_serve_at_tensor_parallel_two_gpus(lm_dir):
    """`florist serve --tensor-parallel-size 2` on two GPUs, fp32, with its default warm-up: one
    replica whose ranks meet over NCCL; completions of token-id prompts are transformers' greedy
    tokens, and stopping the server stops both ranks."""
    import openai
    from florist_procs import serve

    proc, url = serve("--model", str(lm_dir), "--dtype", "fp32", "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompts = prompts_for(lm_dir, (1, 9, 33))
        for _ in range(2):  # capture, then replay
            got = [client.completions.create(model=lm_dir.name, prompt=p, max_tokens=NEW_TOKENS, extra_body={"return_token_ids": True,
                                                                                                     "ignore_eos": True}).choices[0].token_ids
                   for p in prompts]
        assert got == reference(lm_dir, prompts)
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
    assert "warmed up" in proc.output(), proc.output()[-3000:]


def test_a_warmed_up_engine_generates_from_another_thread(lm_dir):
    """A server warms up on its main thread (first sights) and generates on its generation
    thread, whose first step of a bucket met once in the warm-up is a capture: it must not be that
    thread's first cuBLAS call (a handle made inside a capture fails and spoils the capture)."""
    import threading

    config = GenerationConfig(max_num_seqs=8, max_model_len=256)
    # One prompt of 128 tokens: a shape the warm-up prefills once (its one-prompt round), and at
    # 128 rows this model's products are cuBLAS's (skinny_gemm.pick_config stops below; its K
    # of 64 and 128 is too short for pick_tma's blocks), so the capture is where this thread
    # would first call cuBLAS.
    prompts = prompts_for(lm_dir, (128,), seed=3)
    cold = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16", generation=config)
    want = [r.token_ids for r in cold.generate(prompts, max_tokens=NEW_TOKENS)]
    cold.close()
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16", generation=config)
    engine.runner.warm_up()
    key = bucket_of(128, 1, 128)
    assert key in engine.runner.runner.prefill_graphs.seen and key not in engine.runner.runner.prefill_graphs.graphs
    got = {}
    worker = threading.Thread(target=lambda: got.update(out=[r.token_ids for r in engine.generate(prompts, max_tokens=NEW_TOKENS)]))
    worker.start()
    worker.join()
    assert got.get("out") == want, "generation on the other thread failed (its error is printed above) or differs"
    assert key in engine.runner.runner.prefill_graphs.graphs
    engine.close()


@pytest.mark.parametrize("layout", ["engine process", "in-process"])
def test_florist_serve_generates_on_one_gpu(lm_dir, layout):
    """`florist serve` with a causal LM on one GPU, bf16, its default warm-up on, the engine in a
    process of its own or in the gateway's: token-id prompts sent one at a time, twice (the second
    round meets captured graphs), get the tokens `Engine.generate` gives on the same device, and
    none fails. The generation thread's first captures come after the warm-up's first sights on
    the main thread: a capture that was that thread's first cuBLAS call failed every request."""
    import openai
    from florist_procs import serve

    # 128 tokens first: the warm-up prefilled that shape once, so its first request is a capture
    # on the generation thread, with cuBLAS products at 128 rows (see the test above)
    prompts = prompts_for(lm_dir, (128, 1, 9, 33, 100), seed=4)
    engine = florist.Engine.from_pretrained(lm_dir, device="cuda", dtype="bf16")
    want = [engine.generate(p, max_tokens=NEW_TOKENS, ignore_eos=True)[0].token_ids for p in prompts]
    engine.close()
    del engine
    torch.cuda.empty_cache()
    flags = ["--in-process"] if layout == "in-process" else []
    proc, url = serve("--model", str(lm_dir), "--device", "cuda", "--dtype", "bf16", *flags)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # first sights and captures, then replays
            got = [client.completions.create(model=lm_dir.name, prompt=p, max_tokens=NEW_TOKENS,
                                             extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
                   for p in prompts]
            assert got == want
        streamed = [e.choices[0].token_ids for e in client.completions.create(
            model=lm_dir.name, prompt=prompts[3], max_tokens=NEW_TOKENS, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}) if e.choices and e.choices[0].token_ids]
        assert [t for chunk in streamed for t in chunk] == want[3]
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
    assert "warmed up" in proc.output(), proc.output()[-3000:]
