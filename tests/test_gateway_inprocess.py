"""The gateway in-process (GatewayThread) in front of in-process inference servers (ServerThread):
templating for the Qwen3 families, packed encodings, and the overload / no-replica answers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_gateway import TOL, call, error_message

from florist.gateway.config import GatewayConfig
from florist.gateway.server import GatewayThread
from florist.server.service import ServerConfig, ServerThread


def engine(path, **kw):
    import florist

    return florist.Engine.from_pretrained(path, device="cpu", **kw)


def gateway(srv, **kw) -> GatewayThread:
    return GatewayThread(GatewayConfig(engines=(srv.address,), port=0, health_interval_s=0.2, **kw))


def test_qwen3_embedding_prompts(qwen3_dir):
    eng = engine(qwen3_dir)
    texts = ["rose garden", "which seed grows fast"]
    with ServerThread(eng) as srv, gateway(srv) as gw:
        for extra, want in (({"input_type": "query"}, eng.embed(texts, prompt_name="query")),
                            ({"input_type": "document"}, eng.embed(texts, prompt_name="document")),
                            ({"prompt": "Instruct: find flowers\nQuery:"}, eng.embed(texts, prompt="Instruct: find flowers\nQuery:"))):
            status, _, body = call(gw.url, "/v1/embeddings", {"input": texts, **extra})
            assert status == 200, body
            np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, **TOL)
        status, _, body = call(gw.url, "/embed", {"inputs": texts, "prompt_name": "query"})
        np.testing.assert_allclose(body, eng.embed(texts, prompt_name="query"), **TOL)


def test_packed_encodings(pplx_dir):
    eng = engine(pplx_dir)
    texts = ["rose garden", "blue water", "a fast engine"]
    with ServerThread(eng) as srv, gateway(srv) as gw:
        for encoding in ("int8", "binary", "ubinary"):
            status, _, body = call(gw.url, "/v1/embeddings", {"input": texts, "encoding_format": encoding})
            assert status == 200, body
            got = np.array([d["embedding"] for d in body["data"]])
            want = eng.embed(texts, encoding=encoding)
            assert got.shape == want.shape and np.abs(got - want.astype(np.int64)).max() <= (1 if encoding == "int8" else 0)


def test_qwen3_reranker_chat_template(reranker_dir):
    eng = engine(reranker_dir, task="score")
    query, docs = "which flower needs sun", ["the rose needs sun", "search engines", "tulip seed"]
    with ServerThread(eng) as srv, gateway(srv) as gw:
        status, _, body = call(gw.url, "/v1/rerank", {"query": query, "documents": docs, "instruction": "find flowers"})
        assert status == 200, body
        want = eng.score(query, docs, instruction="find flowers")
        assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], np.sort(want)[::-1], **TOL)



@pytest.mark.parametrize("backend", ["orjson", "stdlib"])
def test_small_and_large_requests_with_either_json(default_engine, monkeypatch, backend):
    """Small inputs are tokenized on the loop, large ones on the pool; without orjson the float
    rows are written by jsonio.float_rows. The same numbers every way."""
    from florist.gateway import jsonio

    if backend == "stdlib":
        monkeypatch.setattr(jsonio, "orjson", None)
    elif jsonio.orjson is None:
        pytest.skip("orjson is not installed")
    small, large = ["a rose in the garden"], ["rose " * 60, "tulips need sun " * 50]  # 20 and 1100 characters
    ids = default_engine.tokenize(small)[0]
    with ServerThread(default_engine) as srv, gateway(srv, inline_tokenize_chars=1024) as gw:
        processor, threads = gw.running.pipeline.tokenization.processor, []
        encode = processor.encode
        monkeypatch.setattr(processor, "encode", lambda *a, **kw: threads.append(threading.current_thread().name) or encode(*a, **kw))
        for inputs, want in ((small[0], default_engine.embed(small)), (large, default_engine.embed(large)), ([ids], default_engine.embed(small))):
            threads.clear()
            status, headers, body = call(gw.url, "/v1/embeddings", {"input": inputs})
            on_pool = [t.startswith("florist-tokenize") for t in threads]
            assert on_pool == [inputs is large], threads  # 20 characters on the loop, 1,100 on the pool
            assert status == 200 and headers["Content-Type"] == "application/json", body
            assert [d["index"] for d in body["data"]] == list(range(len(want))) and set(body) == {"object", "data", "model", "usage"}
            np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, **TOL)
            status, _, body = call(gw.url, "/embed", {"inputs": inputs})
            assert status == 200
            np.testing.assert_allclose(body, want, **TOL)
        status, _, body = call(gw.url, "/v1/embeddings", {"input": [ids[:3] + [10**6]]})
        assert status == 400 and "outside the vocabulary" in error_message(body)

class GatedEngine:
    """Holds every batch until `gate` opens, so the server's queue fills."""

    def __init__(self, engine):
        self.engine, self.info, self.gate = engine, engine.info, threading.Event()

    def step(self, batch):
        assert self.gate.wait(30)
        return self.engine.step(batch)


def test_overload_is_429_with_retry_after_and_no_replica_is_503(default_engine):
    import asyncio

    import aiohttp

    gated = GatedEngine(default_engine)
    srv = ServerThread(gated, ServerConfig(port=0, max_pending_tokens=64, max_batch_seqs=1)).start()
    try:
        with gateway(srv) as gw:
            async def burst():
                async with aiohttp.ClientSession() as s:
                    async def one(k):
                        async with s.post(gw.url + "/embed", json={"inputs": [f"text number {k} " * 3]}) as r:
                            return r.status, r.headers.get("Retry-After"), await r.json()
                    tasks = [asyncio.ensure_future(one(k)) for k in range(12)]
                    await asyncio.sleep(1.0)
                    gated.gate.set()
                    return await asyncio.gather(*tasks)

            results = asyncio.run(burst())
            refused = [r for r in results if r[0] == 429]
            assert refused and all(r[0] in (200, 429) for r in results), [r[0] for r in results]
            assert all(h == "1" and "overloaded" in error_message(b) for _, h, b in refused)
            srv.stop()  # the only replica goes away
            status, headers, body = call(gw.url, "/embed", {"inputs": "a"})
            assert status == 503 and headers["Retry-After"] == "1" and "no engine replica is available" in error_message(body)
            status, _, body = call(gw.url, "/health")
            assert status == 503 and "no engine replica is healthy" in error_message(body)
    finally:
        gated.gate.set()
        srv.stop()


def test_refuses_to_start_on_a_tokenizer_other_than_the_engines(default_engine, bert_dir):
    with ServerThread(default_engine) as srv:
        with pytest.raises(ValueError, match="is not the tokenizer the engine uses"):
            with GatewayThread(GatewayConfig(engines=(srv.address,), port=0, model=str(bert_dir))):
                pass


def test_busy_poll_spins_only_while_idle_and_polls_for_lone_replies(default_engine, tmp_path):
    """GatewayConfig.busy_poll: the loop-turning task runs while no request is in flight and waits
    while one is; the engine client polls for its replies; answers stay the embedded API's; the
    task ends with the gateway."""
    texts = ["a rose in the garden", "tulips need sun"]
    want = default_engine.embed(texts)
    config = ServerConfig(port=0, local_socket=str(tmp_path / "engine.sock"))
    with ServerThread(default_engine, config) as srv:
        gw = gateway(srv, busy_poll=True, reply_spin_ms=3.0).start()
        try:
            spinner, pipeline = gw.running.busy_poll, gw.running.pipeline
            assert spinner is not None and spinner.get_coro().__name__ == "keep_turning" and not spinner.done()
            replica = pipeline.balancer.replicas[0]
            for _ in range(3):
                status, _, body = call(gw.url, "/v1/embeddings", {"input": texts})
                assert status == 200, body
                np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, **TOL)
            assert replica.client.transport == "local" and replica.client._local.spin_s == pytest.approx(0.003)
            local, polled = replica.client._local, []
            poll = local._poll

            async def counted(future):
                polled.append(future)
                return await poll(future)

            local._poll = counted  # the lone request's reply is polled for, not slept on
            assert call(gw.url, "/v1/embeddings", {"input": texts})[0] == 200 and polled
            del local._poll
            assert pipeline.in_flight == 0 and pipeline.idle.is_set()
            spin_if = replica.client._local.spin_if  # polls only for the request that is alone in the gateway
            seen = []
            for n in (1, 2, 5, 0):
                pipeline.in_flight = n  # as the middleware counts them
                seen.append(spin_if())
            assert seen == [True, False, False, True]
        finally:
            gw.stop()
        assert spinner.cancelled()
        with gateway(srv) as plain:
            assert plain.running.busy_poll is None
            assert call(plain.url, "/v1/embeddings", {"input": texts})[0] == 200
            assert plain.running.pipeline.balancer.replicas[0].client._local.spin_s == 0.0
        with gateway(srv, busy_poll_linger_ms=30.0) as lingering:  # turning for 30 ms after each request (CPU engines: 0 by default)
            spinner = lingering.running.busy_poll
            assert spinner is not None and spinner.get_coro().cr_frame.f_locals["linger_s"] == pytest.approx(0.03)
            assert call(lingering.url, "/v1/embeddings", {"input": texts})[0] == 200
        with gateway(srv, reply_spin_ms=2.0) as polling:  # the reply poll without the idle spinner
            assert polling.running.busy_poll is None
            status, _, body = call(polling.url, "/v1/embeddings", {"input": texts})
            assert status == 200, body
            np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, **TOL)
            assert polling.running.pipeline.balancer.replicas[0].client._local.spin_s == pytest.approx(0.002)


def test_requests_in_flight_clear_the_idle_flag(default_engine):
    """The middleware's count: a request held in the engine keeps `idle` clear (busy poll waits
    then, leaving the GIL to the tokenizer threads); it is set again when the answer is out,
    an error answer included."""
    gated = GatedEngine(default_engine)
    with ServerThread(gated, ServerConfig(port=0, local_socket=None)) as srv, gateway(srv) as gw:
        pipeline = gw.running.pipeline
        gated.gate.set()
        assert call(gw.url, "/v1/embeddings", {"input": "warm up"})[0] == 200  # the gateway's start-up probes are done
        gated.gate.clear()
        done = []
        worker = threading.Thread(target=lambda: done.append(call(gw.url, "/v1/embeddings", {"input": "held"})[0]))
        worker.start()
        for _ in range(200):
            if pipeline.in_flight:
                break
            threading.Event().wait(0.01)
        assert pipeline.in_flight == 1 and not pipeline.idle.is_set()
        gated.gate.set()
        worker.join(30)
        assert done == [200] and pipeline.in_flight == 0 and pipeline.idle.is_set()
        assert call(gw.url, "/v1/embeddings", {"input": "x", "model": "another-model"})[0] == 404
        assert pipeline.in_flight == 0 and pipeline.idle.is_set()
