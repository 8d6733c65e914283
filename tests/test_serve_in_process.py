"""`florist serve --in-process`: the engine loaded in the gateway's process, the gateway calling
the server's handlers without a transport (florist/server/inprocess.py). The client against the
handlers directly (answers, status codes, deadlines, cancellation), then a live command on the
CPU against the embedded API, and the flags it refuses."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import numpy as np
import pytest
from florist_procs import FloristProcess, serve
from test_gateway import TOL, call, error_message
from test_generation import make_causal_lm

import florist
from florist.server import proto
from florist.server.config import ServerConfig
from florist.server.inprocess import InProcessClient, start_in_process

TEXTS = ["a rose in the garden", "Tulips need sun and water.", "search engines rank documents"]


@pytest.fixture(scope="module")
def bert_engine(bert_dir):
    return florist.Engine.from_pretrained(bert_dir, device="cpu")


def _ids(engine, texts):
    return [np.asarray(x, dtype=np.int32) for x in engine.tokenize(texts)]


def run(coro_fn, engine, config=ServerConfig()):
    """coro_fn(client, server) on a fresh event loop with the engine's service started in-process."""
    async def main():
        server = await start_in_process(engine, config)
        try:
            return await coro_fn(InProcessClient(server.service), server)
        finally:
            await server.stop(grace=None)

    return asyncio.run(main())


def test_the_client_answers_as_the_embedded_api(bert_engine):
    ids = _ids(bert_engine, TEXTS)

    async def calls(client, server):
        assert server.port is None and server.local_socket is None  # no gRPC port, no socket
        info = await client.info()
        health = await client.health()
        rows = await client.embed(ids)
        small = await client.embed(ids, dimensions=8, normalize=False)
        return info, health, rows, small

    info, health, rows, small = run(calls, bert_engine)
    assert info.task == "embed" and info.dimensions == bert_engine.info.dimensions
    assert health.status == proto.HealthResponse.SERVING
    np.testing.assert_allclose(rows, bert_engine.embed(TEXTS), **TOL)
    np.testing.assert_allclose(small, bert_engine.embed(TEXTS, dimensions=8, normalize=False), **TOL)


def test_the_client_raises_the_handlers_status(bert_engine):
    vocab = bert_engine.info.vocab_size

    async def calls(client, server):
        codes = []
        for bad in ([np.array([1, vocab + 5], dtype=np.int32)],):
            try:
                await client.embed(bad)
            except grpc.aio.AioRpcError as e:
                codes.append((e.code(), e.details()))
        try:
            await client.score([np.array([1, 2, 3], dtype=np.int32)], [1])
        except grpc.aio.AioRpcError as e:
            codes.append((e.code(), e.details()))
        return codes

    (bad_id, wrong_task) = run(calls, bert_engine)
    assert bad_id[0] == grpc.StatusCode.INVALID_ARGUMENT and str(vocab) in bad_id[1]
    assert wrong_task[0] == grpc.StatusCode.INVALID_ARGUMENT and "Score needs" in wrong_task[1]


def test_a_cancelled_call_is_taken_out_of_the_queue(bert_engine):
    ids = _ids(bert_engine, TEXTS)

    async def calls(client, server):
        scheduler = server.batcher.scheduler
        cancelled, cancel = [], scheduler.cancel
        scheduler.cancel = lambda req: (cancelled.append(len(req.seq_lens)), cancel(req))[1]
        # a batch runs in a worker thread on the CPU; the second call queues behind the first and is cancelled there
        first = asyncio.ensure_future(client.embed(ids * 20))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(client.embed(ids))
        await asyncio.sleep(0)
        queued = scheduler.pending_seqs
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        cancelled_then = list(cancelled)
        return await first, cancelled_then, queued

    rows, cancelled, queued = run(calls, bert_engine, ServerConfig(max_batch_seqs=4))
    assert rows.shape[0] == 60 and queued > len(TEXTS)
    assert cancelled == [len(TEXTS)]  # the cancelled request's sequences, and only those


def test_a_passed_deadline_is_deadline_exceeded(bert_engine):
    ids = _ids(bert_engine, TEXTS)

    async def calls(client, server):
        busy = asyncio.ensure_future(client.embed(ids * 40))  # keeps the batcher busy
        await asyncio.sleep(0)
        try:
            await client.embed(ids, timeout=1e-6)
        except grpc.aio.AioRpcError as e:
            code = e.code()
        else:
            code = None
        await busy
        return code

    assert run(calls, bert_engine, ServerConfig(max_batch_seqs=4)) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_generate_streams_the_embedded_greedy_tokens(tmp_path):
    lm_dir = make_causal_lm(tmp_path / "lm", tie=True)
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu")
    prompt = np.asarray(engine.tokenize(["the rose and the tulip need"])[0], dtype=np.int32)
    want = engine.generate([prompt.tolist()], max_tokens=6, ignore_eos=True)[0]

    async def calls(client, server):
        chunks = [c async for c in client.generate(prompt, max_tokens=6, ignore_eos=True)]
        early = client.generate(prompt, max_tokens=50, ignore_eos=True)
        async for _ in early:  # leave after the first chunk: the slot must be freed
            break
        await early.aclose()
        return chunks

    chunks = run(calls, engine)
    got = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 6
    assert got == list(getattr(want, "token_ids", want))
    engine.close()


def test_florist_serve_in_process(bert_dir, bert_engine):
    proc, url = serve("--in-process", "--model", str(bert_dir), "--device", "cpu")
    try:
        assert "engines in-process" in proc.output()
        assert "engine-server" not in proc.output()  # no engine process was started
        status, _, body = call(url, "/v1/embeddings", {"input": TEXTS})
        assert status == 200, body
        np.testing.assert_allclose([d["embedding"] for d in body["data"]], bert_engine.embed(TEXTS), **TOL)
        status, _, body = call(url, "/embed", {"inputs": TEXTS, "truncate": False, "dimensions": 4})
        assert status == 200, body
        np.testing.assert_allclose(body, bert_engine.embed(TEXTS, dimensions=4), **TOL)
        status, _, body = call(url, "/v1/embeddings", {"input": [[1, bert_engine.info.vocab_size + 3]]})
        assert status == 400 and str(bert_engine.info.vocab_size) in error_message(body)
        status, _, body = call(url, "/health")
        assert status == 200
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            exposition = r.read().decode()
        assert "florist_gateway_requests_total" in exposition  # the gateway's own
        batches = re.search(r"^florist_batch_sequences_count (\S+)$", exposition, re.M)  # the engine server's, in the same process
        assert batches is not None and float(batches.group(1)) >= 2, exposition[-2000:]
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


def test_florist_serve_in_process_completions(tmp_path):
    """A causal LM in-process: /v1/completions streamed and not, as `Engine.generate` answers."""
    import openai

    lm_dir = make_causal_lm(tmp_path / "lm", tie=True)
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu")
    prompts = ["the rose and the tulip need", "search engine"]
    want = engine.generate(prompts, max_tokens=10)
    engine.close()
    proc, url = serve("--in-process", "--model", str(lm_dir), "--device", "cpu")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="lm", prompt=prompts, max_tokens=10)
        assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [w.text for w in want]
        text = "".join(e.choices[0].text for e in client.completions.create(model="lm", prompt=prompts[0], max_tokens=10, stream=True) if e.choices)
        assert text == want[0].text
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


@pytest.mark.parametrize("flags, problem", [
    (["--workers", "2"], "drop --workers"),
    (["--replicas", "2"], "drop --replicas"),
    (["--engines", "127.0.0.1:1"], "drop --engines"),
    (["--device", "cuda:0,cuda:1"], "names several"),
    (["--tensor-parallel-size", "2"], "drop --tensor-parallel-size"),
])
def test_flags_it_refuses(flags, problem):
    proc = FloristProcess("serve", "--port", "0", "--in-process", *flags)
    assert proc.proc.wait(60) == 2
    proc.stop()
    assert "--in-process" in proc.output() and problem in proc.output()


@pytest.mark.gpu
def test_on_a_gpu_concurrent_clients_get_their_own_rows(qwen3_dir):
    """The batcher launching inline on the gateway's event loop (the GPU path): 16 clients, each
    sending its next request once its reply is back, get the embedded API's rows."""
    import concurrent.futures

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    rng = np.random.default_rng(5)
    clients = [[[rng.integers(5, engine.info.vocab_size, size=int(rng.integers(8, engine.info.max_input_tokens + 1))).tolist()] for _ in range(10)] for _ in range(16)]
    want = [[engine.embed(seqs) for seqs in requests] for requests in clients]
    proc, url = serve("--in-process", "--model", str(qwen3_dir), "--device", "cuda")
    try:
        def client(requests):
            out = []
            for seqs in requests:
                status, _, body = call(url, "/v1/embeddings", {"input": seqs})
                assert status == 200, body
                out.append(np.array([d["embedding"] for d in body["data"]]))
            return out

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(client, clients))
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            assert a.shape == b.shape and cos.min() >= 0.9999


def test_a_server_without_grpc_cannot_advertise_a_socket(bert_engine):
    from florist.server.service import start_server

    async def main():
        with pytest.raises(ValueError, match="needs a gRPC port"):
            await start_server(bert_engine, ServerConfig(port=None, local_socket="auto"))
        server = await start_server(bert_engine, ServerConfig(port=None))
        try:
            with pytest.raises(RuntimeError, match="no gRPC port"):
                await server.wait_for_termination()
        finally:
            await server.stop(grace=None)

    asyncio.run(main())


@pytest.mark.gpu
def test_on_a_gpu_the_switch_interval_is_lowered_while_serving(qwen3_dir):
    import sys

    from florist.server.service import BUSY_POLL_SWITCH_S

    engine = florist.Engine.from_pretrained(qwen3_dir, device="cuda")
    before = sys.getswitchinterval()

    async def calls(client, server):
        return sys.getswitchinterval()

    assert run(calls, engine) == pytest.approx(min(before, BUSY_POLL_SWITCH_S))  # kept in whole microseconds
    assert sys.getswitchinterval() == pytest.approx(before)


def test_on_the_cpu_the_switch_interval_is_left_alone(bert_engine):
    import sys

    before = sys.getswitchinterval()

    async def calls(client, server):
        return sys.getswitchinterval()

    assert run(calls, bert_engine) == before
