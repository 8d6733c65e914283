"""The inference server over real sockets (127.0.0.1, an OS-chosen port), against the embedded API
on the same ids: nothing lost, nothing swapped between requests, options applied per request."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from florist.engine.output import finalize_scores
from florist.server import proto
from florist.server.client import InferenceClient
from florist.server.service import BUSY_POLL_SWITCH_S, ServerConfig, ServerThread

# CPU fp32: the same sequence in different batches differs by ~1e-7 (BLAS blocking).
TOL = dict(rtol=1e-4, atol=2e-6)


async def embed_or_error(client, seqs):
    """The embeddings, or the grpc.aio.AioRpcError the call raised (for bursts gathered at once)."""
    try:
        return await client.embed(seqs)
    except grpc.aio.AioRpcError as e:
        return e


def run(coro):
    return asyncio.run(coro)


def random_request(rng, vocab: int, max_len: int, n_seqs: int | None = None) -> list[list[int]]:
    """1..64 sequences (log-uniform: mostly few), lengths 1..max_len (mostly short, some full)."""
    n = n_seqs or int(64 ** rng.random()) or 1
    lens = [max(1, min(max_len, int(max_len ** (rng.random() ** 2.5)))) for _ in range(n)]
    return [rng.integers(0, vocab, size=k).tolist() for k in lens]


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread(one_torch_thread):
    """conftest.one_torch_thread for every test here."""


@pytest.fixture(scope="module")
def embed_server(default_engine):
    with ServerThread(default_engine, ServerConfig(port=0, max_batch_tokens=2048, max_batch_seqs=64, max_pending_tokens=100_000, metrics_port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def cross_encoder(spread_cross_encoder_dir):
    """Scores that spread (conftest): rows handed to the wrong request show."""
    import florist

    return florist.Engine.from_pretrained(spread_cross_encoder_dir, device="cpu")


@pytest.fixture(scope="module")
def score_server(cross_encoder):
    with ServerThread(cross_encoder, ServerConfig(port=0, max_batch_tokens=512, max_batch_seqs=32)) as srv:
        yield srv


# -- correctness under concurrency -------------------------------------------------------------
def test_64_concurrent_clients_get_the_embedded_api_output(embed_server, default_engine):
    info = default_engine.info
    rng = np.random.default_rng(1)
    requests = [random_request(rng, info.vocab_size, info.max_input_tokens) for _ in range(64)]
    requests[0] = [rng.integers(0, info.vocab_size, size=info.max_input_tokens).tolist()]  # the longest sequence
    requests[1] = [[7]]  # the shortest
    requests[2] = random_request(rng, info.vocab_size, 8, n_seqs=64)  # the most sequences
    options = [dict(), dict(dimensions=128), dict(normalize=False), dict(dimensions=64, normalize=True)]
    opts = [options[i % len(options)] for i in range(len(requests))]
    expected = [default_engine.embed(seqs, **o) for seqs, o in zip(requests, opts)]

    async def one_client(seqs, o):
        async with InferenceClient(embed_server.address, timeout=120) as client:
            return await client.embed(seqs, **o)

    async def all_clients():
        return await asyncio.gather(*(one_client(s, o) for s, o in zip(requests, opts)))

    results = run(all_clients())
    for k, (got, want) in enumerate(zip(results, expected)):
        assert got.dtype == np.float32 and got.shape == want.shape, k
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"request {k}")


def test_packed_encodings_match_the_embedded_api(embed_server, default_engine):
    rng = np.random.default_rng(2)
    seqs = random_request(rng, default_engine.info.vocab_size, 40, n_seqs=12)

    async def go():
        async with InferenceClient(embed_server.address) as client:
            return [await client.embed(seqs, encoding=e, dimensions=d) for e, d in (("binary", None), ("ubinary", 128))]

    binary, ubinary = run(go())
    for got, encoding, dims in ((binary, "binary", None), (ubinary, "ubinary", 128)):
        want = default_engine.embed(seqs, encoding=encoding, dimensions=dims)
        assert got.dtype == want.dtype and got.shape == want.shape
        # A bit may only differ where the float value is ~0 (batching noise decides its sign).
        floats = default_engine.embed(seqs, dimensions=dims)
        g, w = (np.unpackbits(x.view(np.uint8) ^ (128 if encoding == "binary" else 0), axis=1) for x in (got, want))
        assert np.all((g == w) | (np.abs(floats) < 1e-5))


def test_64_concurrent_clients_score_like_the_embedded_api(score_server, cross_encoder):
    import models as tiny

    engine = cross_encoder
    rng = np.random.default_rng(3)
    words = tiny.WORDS
    cases = []
    for k in range(64):
        query = " ".join(rng.choice(words, size=rng.integers(1, 6)))
        docs = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(int(rng.integers(1, 17)))]
        ids, first = engine.text.encode_pairs(query, docs, truncate=True)
        cases.append(([x.tolist() for x in ids], first, k % 3 == 0))
    expected = [finalize_scores(engine.run([np.asarray(x) for x in ids], first), engine.info.score_activation, raw=raw) for ids, first, raw in cases]
    assert np.ptp(np.concatenate([e for e, (_, _, raw) in zip(expected, cases) if not raw])) > 0.1  # scores a mix-up would change
    # The embedded API agrees with that (the text path) for one case.
    np.testing.assert_allclose(engine.score("rose garden", ["red rose", "blue water"]),
                               finalize_scores(engine.run(*engine.text.encode_pairs("rose garden", ["red rose", "blue water"])), engine.info.score_activation), **TOL)

    async def one_client(ids, first, raw):
        async with InferenceClient(score_server.address, timeout=120) as client:
            return await client.score(ids, first, raw=raw)

    async def all_clients():
        return await asyncio.gather(*(one_client(*c) for c in cases))

    for k, (got, want) in enumerate(zip(run(all_clients()), expected)):
        assert got.shape == want.shape, k
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"request {k}")


# -- info, health, metrics ---------------------------------------------------------------------
def test_info_health_and_metrics(embed_server, default_engine):
    async def go():
        async with InferenceClient(embed_server.address) as client:
            return await client.info(), await client.health(), await client.embed([[101, 102]])

    info, health, _ = run(go())
    i = default_engine.info
    assert (info.model_name, info.task, info.dimensions, info.max_input_tokens, info.vocab_size) == (i.model_name, "embed", 384, i.max_input_tokens, i.vocab_size)
    assert list(info.pooling) == ["mean"] and info.normalize and len(info.tokenizer_sha256) == 64
    assert info.max_batch_tokens == 2048 and info.max_batch_sequences == 64
    assert health.status == proto.HealthResponse.SERVING
    port = embed_server.running.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("florist_queue_sequences", "florist_queue_tokens", "florist_batch_tokens_bucket", "florist_batch_sequences_bucket",
                 "florist_step_seconds_bucket", "florist_request_seconds_bucket", 'florist_requests_total{code="OK",method="Embed"}'):
        assert name in text, name


def test_timing_metadata_only_when_asked(embed_server, default_engine):
    """--timing-metadata: Embed and Health reply with the handler's entry and exit on the
    monotonic clock, inside the client's own send / receive times; off by default."""
    from florist.server import wire
    from florist.server.client import CHANNEL_OPTIONS
    from florist.server.service import TIMING_KEY

    request = proto.EmbedRequest(tokens=wire.encode_tokens([np.array([101, 7592, 102], dtype=np.int32)], proto.TokenBatch))
    with grpc.insecure_channel(embed_server.address, options=CHANNEL_OPTIONS) as channel:
        _, call = proto.method_callables(channel)["Embed"].with_call(request, timeout=60)
        assert TIMING_KEY not in dict(call.trailing_metadata() or ())
    with ServerThread(default_engine, ServerConfig(port=0, timing_metadata=True)) as srv:
        with grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as channel:
            rpc = proto.method_callables(channel)
            for method, req in (("Embed", request), ("Health", proto.HealthRequest())):
                sent = time.monotonic_ns()
                _, call = rpc[method].with_call(req, timeout=60)
                received = time.monotonic_ns()
                entered, left = map(int, dict(call.trailing_metadata())[TIMING_KEY].split())
                assert sent <= entered <= left <= received, (method, sent, entered, left, received)


def test_busy_poll_keeps_the_loop_turning_and_stops_with_the_server(default_engine, caplog):
    """--busy-poll: a task that is always ready runs on the server's loop while it serves (so the
    loop never sleeps), answers stay the embedded API's, and stopping the server ends the task.
    While it runs the GIL switch interval is short (threads waiting for the GIL held by the turning
    loop get it soon); stopping restores it.
    On a CPU engine the server warns that the spinning loop slows the model down."""
    ids = [[101, 7592, 2088, 102], [101, 2023, 102]]
    want = default_engine.embed(ids)
    switch_interval = sys.getswitchinterval()
    srv = ServerThread(default_engine, ServerConfig(port=0, busy_poll=True)).start()
    try:
        spinner = srv.running.busy_poll
        assert spinner is not None and spinner.get_coro().__name__ == "keep_turning"
        assert sys.getswitchinterval() == pytest.approx(min(switch_interval, BUSY_POLL_SWITCH_S))  # other threads get the GIL soon
        time.sleep(0.05)
        assert not spinner.done()

        async def ask():
            async with InferenceClient(srv.address) as client:
                return await client.embed(ids)

        np.testing.assert_allclose(run(ask()), want, **TOL)
    finally:
        srv.stop()
    assert spinner.cancelled() and sys.getswitchinterval() == switch_interval
    assert any("busy poll on a cpu engine" in r.getMessage() for r in caplog.records), caplog.text
    with ServerThread(default_engine, ServerConfig(port=0)) as plain:
        assert plain.running.busy_poll is None  # a CPU engine lingers 0 ms by default
    with ServerThread(default_engine, ServerConfig(port=0, busy_poll_linger_ms=30.0)) as lingering:
        spinner = lingering.running.busy_poll
        assert spinner is not None and spinner.get_coro().cr_frame.f_locals["linger_s"] == pytest.approx(0.03)
        assert sys.getswitchinterval() == pytest.approx(min(switch_interval, BUSY_POLL_SWITCH_S))
    assert sys.getswitchinterval() == switch_interval


def test_metrics_count_like_prometheus_histograms():
    prometheus_client = pytest.importorskip("prometheus_client")
    from florist.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.watch(lambda: 3, lambda: 96, lambda: 1)
    for seconds in (0.001, 0.0015, 0.3):  # `le` buckets: 0.001 counts in le="0.001"
        m.observe_request("Embed", "OK", seconds)
    m.observe_request("Embed", "CANCELLED", 40.0)
    m.observe_batch(100, 3)
    text = prometheus_client.generate_latest(m.registry).decode()
    for line in ('florist_request_seconds_bucket{le="0.0005",method="Embed"} 0.0', 'florist_request_seconds_bucket{le="0.001",method="Embed"} 1.0',
                 'florist_request_seconds_bucket{le="0.002",method="Embed"} 2.0', 'florist_request_seconds_bucket{le="30.0",method="Embed"} 3.0',
                 'florist_request_seconds_bucket{le="+Inf",method="Embed"} 4.0', 'florist_request_seconds_count{method="Embed"} 4.0',
                 'florist_requests_total{code="OK",method="Embed"} 3.0', 'florist_requests_total{code="CANCELLED",method="Embed"} 1.0',
                 'florist_batch_tokens_bucket{le="64.0"} 0.0', 'florist_batch_tokens_bucket{le="128.0"} 1.0', "florist_batch_tokens_sum 100.0",
                 'florist_batch_sequences_bucket{le="4.0"} 1.0', "florist_queue_tokens 96.0", "florist_batches_in_flight 1.0"):
        assert line in text, line


# -- bad input ---------------------------------------------------------------------------------
def tokens(ids, lens=None) -> "proto.TokenBatch":
    lens = [len(ids)] if lens is None else lens
    return proto.TokenBatch(ids=np.asarray(ids, "<i4").tobytes(), seq_lens=np.asarray(lens, "<i4").tobytes())


def with_unknown_field(request) -> bytes:
    return request.SerializeToString() + bytes([15 << 3 | 0, 1])  # field 15 (unknown), varint 1


BAD_EMBED = [
    ("empty request", proto.EmbedRequest(), "no sequences"),
    ("zero-length sequence", proto.EmbedRequest(tokens=tokens([101, 102, 103], [3, 0])), "sequence 1 has length 0"),
    ("negative length", proto.EmbedRequest(tokens=tokens([101], [2, -1])), "sequence 1 has length -1"),
    ("id out of vocabulary", proto.EmbedRequest(tokens=tokens([101, 102, 5, 999999], [2, 2])), "sequence 1 has token id 999999 at position 1, outside the vocabulary [0, 30522)"),
    ("negative id", proto.EmbedRequest(tokens=tokens([-3])), "token id -3"),
    ("lengths larger than the ids", proto.EmbedRequest(tokens=tokens([101, 102], [3])), "add up to 3 tokens but tokens.ids holds 2"),
    ("lengths smaller than the ids", proto.EmbedRequest(tokens=tokens([101, 102, 103], [1, 1])), "add up to 2 tokens but tokens.ids holds 3"),
    ("ids not int32", proto.EmbedRequest(tokens=proto.TokenBatch(ids=b"\x01\x00\x00", seq_lens=np.asarray([1], "<i4").tobytes())), "tokens.ids has 3 bytes, not a multiple of 4"),
    ("over-long sequence", proto.EmbedRequest(tokens=tokens([100] * 300)), "sequence 0 has 300 tokens; the model takes at most 256"),
    ("unknown encoding", proto.EmbedRequest(tokens=tokens([101]), encoding="fp16"), "unsupported encoding 'fp16'"),
    ("int8 on a model without it", proto.EmbedRequest(tokens=tokens([101]), encoding="int8"), "defines no int8 encoding"),
    ("too many dimensions", proto.EmbedRequest(tokens=tokens([101]), dimensions=1000), "between 1 and 384"),
    ("negative dimensions", proto.EmbedRequest(tokens=tokens([101]), dimensions=-2), "dimensions must be >= 1"),
    ("binary needs multiples of 8", proto.EmbedRequest(tokens=tokens([101]), dimensions=100, encoding="binary"), "multiple of 8"),
    ("unknown option (a newer client)", with_unknown_field(proto.EmbedRequest(tokens=tokens([101]))), "unknown to this server (numbers [15])"),
    ("more tokens than the server ever queues", proto.EmbedRequest(tokens=tokens([101] * 210 * 500, [210] * 500)), "more than this server ever queues (max_pending_tokens = 100000)"),
]


def call_raw(address: str, method: str, request, response_cls, timeout: float = 30):
    """Send a request (a message or raw bytes) with a byte-level stub, so malformed ones get through."""
    with grpc.insecure_channel(address) as channel:
        rpc = channel.unary_unary(f"/florist.v1.Inference/{method}", request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(), response_deserializer=response_cls.FromString)
        return rpc(request, timeout=timeout)


@pytest.mark.parametrize("case,request_,message", BAD_EMBED, ids=[c[0] for c in BAD_EMBED])
def test_bad_embed_requests_are_invalid_argument(embed_server, case, request_, message):
    srv = embed_server
    with pytest.raises(grpc.RpcError) as err:
        call_raw(srv.address, "Embed", request_, proto.EmbedResponse)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()


BAD_SCORE = [
    ("Score on an embedding model", "embed", proto.ScoreRequest(tokens=tokens([101, 102]), first_segment_lens=np.asarray([1], "<i4").tobytes()), "Score needs a cross-encoder or reranker; all-MiniLM-L6-v2 is served for embed"),
    ("Embed on a cross-encoder", "score", proto.EmbedRequest(tokens=tokens([2, 3])), "Embed needs an embedding model"),
    ("missing first_segment_lens", "score", proto.ScoreRequest(tokens=tokens([2, 3])), "first_segment_lens has 0 entries for 1 pairs"),
    ("first segment longer than the pair", "score", proto.ScoreRequest(tokens=tokens([2, 3, 4], [1, 2]), first_segment_lens=np.asarray([1, 3], "<i4").tobytes()), "pair 1 has first_segment_lens 3, outside [0, 2]"),
    ("empty score request", "score", proto.ScoreRequest(), "no sequences"),
]


@pytest.mark.parametrize("case,server,request_,message", BAD_SCORE, ids=[c[0] for c in BAD_SCORE])
def test_bad_score_requests_are_invalid_argument(servers, case, server, request_, message):
    srv = servers[server]
    method = "Embed" if isinstance(request_, proto.EmbedRequest) else "Score"
    with pytest.raises(grpc.RpcError) as err:
        call_raw(srv.address, method, request_, proto.EmbedResponse if method == "Embed" else proto.ScoreResponse)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()


@pytest.fixture(scope="module")
def servers(embed_server, score_server):
    return {"embed": embed_server, "score": score_server}


# -- backpressure, cancellation, deadlines ------------------------------------------------------
def test_overload_burst_is_refused_in_part_while_health_answers(default_engine):
    rng = np.random.default_rng(4)
    # ~24k tokens arrive within tens of milliseconds; the server queues at most 2000.
    burst = [random_request(rng, default_engine.info.vocab_size, 64, n_seqs=int(rng.integers(4, 12))) for _ in range(300)]
    config = ServerConfig(port=0, max_pending_tokens=2000, max_batch_tokens=512)
    with ServerThread(default_engine, config) as srv:

        async def go():
            async with InferenceClient(srv.address, timeout=120) as client:
                done = asyncio.Event()
                health_latencies = []

                async def watch_health():
                    while not done.is_set():
                        t = time.perf_counter()
                        h = await client.health(timeout=5)
                        assert h.status == proto.HealthResponse.SERVING
                        health_latencies.append(time.perf_counter() - t)
                        await asyncio.sleep(0.02)

                watcher = asyncio.create_task(watch_health())
                results = await asyncio.gather(*(embed_or_error(client, s) for s in burst))
                done.set()
                await watcher
                after = await client.embed(burst[0])  # still serving after the burst
                return results, health_latencies, after

        results, health_latencies, after = run(go())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [(seqs, r) for seqs, r in zip(burst, results) if not isinstance(r, grpc.aio.AioRpcError)]
    assert refused and served, (len(refused), len(served))
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in e.details() for e in refused), {e.code() for e in refused}
    assert len(health_latencies) >= 3
    for seqs, got in served:
        np.testing.assert_allclose(got, default_engine.embed(seqs), **TOL)
    np.testing.assert_allclose(after, default_engine.embed(burst[0]), **TOL)


class GatedEngine:
    """Runs batches only once `gate` is open, and records the ids of every batch it ran."""

    def __init__(self, engine):
        self.engine, self.info = engine, engine.info
        self.gate, self.ran = threading.Event(), []

    def step(self, batch):
        assert self.gate.wait(30), "the test never opened the gate"
        self.ran.append(batch.input_ids.copy())
        return self.engine.step(batch)


def local_only(client):
    """The client, its Embed and Score unable to fall back to gRPC: a test of the local socket
    then cannot pass over gRPC (the client finds the socket through Info, and `transport` says
    only that it opened it)."""
    client._rpc = {k: v for k, v in client._rpc.items() if k not in ("Embed", "Score")}
    return client


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_cancelled_and_disconnected_clients_lose_their_queued_sequences(default_engine, transport, tmp_path):
    """Over gRPC, and over the local socket (florist/server/local.py: CANCEL frames, closed connections)."""
    engine = GatedEngine(default_engine)
    # One sequence per batch: the first two requests are in flight (stuck at the gate); the others queue.
    local_socket = str(tmp_path / "gated.sock") if transport == "local" else None
    with ServerThread(engine, ServerConfig(port=0, max_batch_seqs=1, local_socket=local_socket)) as srv:

        async def pending(client):
            health = await client.health()
            return health.pending_sequences, health.batches_in_flight

        async def wait_for(client, n):
            """n sequences queued behind the two batches stuck at the gate."""
            for _ in range(500):
                if await pending(client) == (n, 2):
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"(pending sequences, batches in flight) never became ({n}, 2) (now {await pending(client)})")

        async def go():
            async with InferenceClient(srv.address, timeout=60) as client:
                only = local_only if transport == "local" else (lambda c: c)
                only(client)
                first = asyncio.ensure_future(client.embed([[101, 11, 102]]))
                second = asyncio.ensure_future(client.embed([[101, 12, 102]]))
                await wait_for(client, 0)
                if transport == "grpc":  # the call object itself
                    doomed_call = client._rpc["Embed"](proto.EmbedRequest(tokens=tokens([101, 21, 102, 101, 22, 102], [3, 3])))
                else:  # the task awaiting it: a CANCEL frame
                    doomed_call = asyncio.ensure_future(client.embed([[101, 21, 102], [101, 22, 102]]))
                await wait_for(client, 2)
                other = only(InferenceClient(srv.address))
                leaving = asyncio.ensure_future(other.embed([[101, 31, 102]] * 3))
                await wait_for(client, 5)
                assert client.transport == other.transport == transport
                doomed_call.cancel()  # the client cancels...
                await wait_for(client, 3)
                await other.close()  # ...or goes away altogether
                await wait_for(client, 0)
                deadline = asyncio.ensure_future(client.embed([[101, 41, 102]], timeout=0.3))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await deadline
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await wait_for(client, 0)
                engine.gate.set()
                return await first, await second, leaving

        first, second, leaving = run(go())
    np.testing.assert_allclose(first, default_engine.embed([[101, 11, 102]]), **TOL)
    np.testing.assert_allclose(second, default_engine.embed([[101, 12, 102]]), **TOL)
    assert leaving.done() and (leaving.cancelled() or leaving.exception() is not None)
    ran = {int(t) for ids in engine.ran for t in ids}
    assert {11, 12} <= ran and not ran & {21, 22, 31, 41}, "a cancelled or expired request ran"
