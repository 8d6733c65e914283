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
        for inputs, want in ((small[0], default_engine.embed(small)), (large, default_engine.embed(large)), ([ids], default_engine.embed(small))):
            status, headers, body = call(gw.url, "/v1/embeddings", {"input": inputs})
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
