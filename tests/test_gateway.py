"""A live `florist serve` (CPU, real sockets on 127.0.0.1, OS-chosen ports), against the embedded API.

Two gateways start once for the session, in parallel: the default model on two engine replicas
behind two gateway workers with an API key (small limits, so chunking and the limits show), and
a tiny cross-encoder for the ranking routes. Clients are the ones users have: OpenAI's Python
client, huggingface_hub's InferenceClient, and plain HTTP for the TEI / Cohere / vLLM shapes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
from florist_procs import FloristProcess

KEY = "test-key-8c1f"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOL = dict(rtol=0, atol=1e-5)
TEXTS = ["a rose in the garden", "Tulips need sun and water.", "search engines rank documents", "hello", "x " * 40]


PROCS: dict[str, FloristProcess] = {}  # the gateways' processes, for tests that read their output


@pytest.fixture(scope="session")
def gateways(cross_encoder_dir):
    procs = {
        "embed": FloristProcess("serve", "--port", "0", "--device", "cpu", "--replicas", "2", "--workers", "2", "--api-key", KEY,
                                "--payload-limit", str(1 << 20), "--max-inputs", "64", "--chunk-seqs", "8"),
        "score": FloristProcess("serve", "--port", "0", "--device", "cpu", "--model", str(cross_encoder_dir), "--access-log"),
    }
    PROCS.update(procs)
    try:
        urls = {k: p.wait_for(r"on (http://[\d.]+:\d+)").group(1) for k, p in procs.items()}
        yield urls
    finally:
        codes = {k: p.stop() for k, p in procs.items()}
    assert codes == {"embed": 0, "score": 0}, {k: procs[k].output()[-3000:] for k in procs}


@pytest.fixture(scope="session")
def cross_encoder(cross_encoder_dir):
    import florist

    return florist.Engine.from_pretrained(cross_encoder_dir, device="cpu")


def call(url: str, path: str, body=None, *, method: str | None = None, headers: dict | None = None, timeout: float = 60):
    """-> (status, headers, decoded JSON). `body`: an object (sent as JSON) or raw bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")


def error_message(body) -> str:
    """The message in any of the three error shapes (OpenAI, TEI, Cohere)."""
    if isinstance(body.get("error"), dict):
        return body["error"]["message"]
    return body.get("error") or body["message"]


# -- the clients users have -------------------------------------------------------------------
def test_openai_client_matches_the_embedded_api(gateways, default_engine):
    import openai

    client = openai.OpenAI(base_url=gateways["embed"] + "/v1", api_key=KEY, max_retries=0)
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == "all-MiniLM-L6-v2"
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), default_engine.embed(TEXTS), **TOL)
    assert floats.usage.prompt_tokens == sum(len(x) for x in default_engine.tokenize(TEXTS))

    packed = client.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2", input=TEXTS, encoding_format="base64", dimensions=128)
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data])
    np.testing.assert_allclose(got, default_engine.embed(TEXTS, dimensions=128), **TOL)

    # No encoding_format: the client asks for base64 and decodes it itself.
    plain = client.embeddings.create(model="all-MiniLM-L6-v2", input="one text", dimensions=64)
    np.testing.assert_allclose(np.array(plain.data[0].embedding), default_engine.embed(["one text"], dimensions=64)[0], **TOL)

    ids = default_engine.tokenize(TEXTS[:2])
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in by_ids.data]), default_engine.embed(TEXTS[:2]), **TOL)
    assert [m.id for m in client.models.list().data] == ["all-MiniLM-L6-v2"]


def test_openai_client_error_is_readable(gateways):
    import openai

    client = openai.OpenAI(base_url=gateways["embed"] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 300)
    assert "has 302 tokens; the model takes at most 256; pass truncate=true" in str(err.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateways["embed"] + "/v1", api_key="wrong", max_retries=0).embeddings.create(model="all-MiniLM-L6-v2", input="a")


def test_huggingface_hub_feature_extraction(gateways, default_engine, monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    # conftest keeps the hub offline; this client only talks to 127.0.0.1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=gateways["embed"], api_key=KEY)
    got = client.feature_extraction(TEXTS[0])
    np.testing.assert_allclose(np.asarray(got).reshape(1, -1), default_engine.embed(TEXTS[:1]), **TOL)
    got = client.feature_extraction(TEXTS, truncate=True, dimensions=32)
    np.testing.assert_allclose(got, default_engine.embed(TEXTS, dimensions=32), **TOL)


def test_tei_embed_options_and_base64_ids(gateways, default_engine):
    url = gateways["embed"]
    status, _, body = call(url, "/embed", {"inputs": TEXTS, "normalize": False, "dimensions": 100}, headers=AUTH)
    assert status == 200
    np.testing.assert_allclose(np.array(body), default_engine.embed(TEXTS, normalize=False, dimensions=100), **TOL)
    long_text = "rose " * 300 + "garden " * 300  # left and right truncation keep different words
    left_ids = default_engine.text.encode([long_text], truncate=True, direction="left")[0].tolist()
    want_left = default_engine.embed([left_ids])[0]
    assert not np.allclose(want_left, default_engine.embed([long_text], truncate=True)[0], **TOL)
    status, _, body = call(url, "/embed", {"inputs": [long_text], "truncate": True, "truncation_direction": "Left"}, headers=AUTH)
    assert status == 200
    np.testing.assert_allclose(np.array(body)[0], want_left, **TOL)
    packed = [base64.b64encode(np.asarray(ids, "<i4").tobytes()).decode() for ids in default_engine.tokenize(TEXTS)]
    status, _, body = call(url, "/v1/embeddings", {"input": packed, "input_format": "base64", "encoding_format": "ubinary"}, headers=AUTH)
    assert status == 200
    want = default_engine.embed(TEXTS, encoding="ubinary")
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.uint8)
    assert got.shape == want.shape and (np.unpackbits(got) != np.unpackbits(want)).sum() <= 2  # signs of values at ~0 may flip


def test_many_inputs_are_split_over_replicas_and_reassembled(gateways, default_engine):
    """Up to 64 inputs in chunks of 8 over two replicas, 8 requests at once: every row in its place."""
    import aiohttp

    rng = np.random.default_rng(0)
    words = ["rose", "tulip", "seed", "soil", "water", "sun", "rain", "green", "garden", "search", "engine"]
    requests = [[" ".join(rng.choice(words, size=rng.integers(1, 24))) for _ in range(int(rng.integers(1, 65)))] for _ in range(8)]
    requests[0] = requests[0][:1]

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async def one(texts):
                async with s.post(gateways["embed"] + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}) as r:
                    assert r.status == 200, await r.text()
                    return np.array([d["embedding"] for d in (await r.json())["data"]])
            return await asyncio.gather(*(one(t) for t in requests))

    for texts, got in zip(requests, asyncio.run(go())):
        np.testing.assert_allclose(got, default_engine.embed(texts), **TOL)


# -- ranking ----------------------------------------------------------------------------------
QUERY = "which flower needs sun"
DOCS = ["the rose needs sun and water", "search engines rank text", "tulip seed in green soil", "a big blue model", "rain"]


def test_rerank_tei_and_cohere_shapes(gateways, cross_encoder):
    want = cross_encoder.score(QUERY, DOCS)
    order = list(np.argsort(-want, kind="stable"))
    status, _, tei = call(gateways["score"], "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True})
    assert status == 200 and [r["index"] for r in tei] == order
    np.testing.assert_allclose([r["score"] for r in tei], want[order], **TOL)
    assert [r["text"] for r in tei] == [DOCS[i] for i in order]

    docs = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    status, _, cohere = call(gateways["score"], "/v1/rerank", {"query": QUERY, "documents": docs, "top_n": 3, "return_documents": True})
    assert status == 200 and [r["index"] for r in cohere["results"]] == order[:3]
    np.testing.assert_allclose([r["relevance_score"] for r in cohere["results"]], want[order[:3]], **TOL)
    assert cohere["results"][0]["document"] == {"text": DOCS[order[0]]} and cohere["usage"]["total_tokens"] > 0

    status, _, raw = call(gateways["score"], "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True})
    np.testing.assert_allclose(sorted(r["score"] for r in raw), sorted(cross_encoder.score(QUERY, DOCS, raw=True)), **TOL)


def test_vllm_score(gateways, cross_encoder):
    status, _, one = call(gateways["score"], "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200 and [d["index"] for d in one["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in one["data"]], cross_encoder.score(QUERY, DOCS), **TOL)
    queries = ["rose", "search", "rose"]
    status, _, pairs = call(gateways["score"], "/v1/score", {"text_1": queries, "text_2": DOCS[:3]})
    want = [cross_encoder.score(q, [d])[0] for q, d in zip(queries, DOCS[:3])]
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], want, **TOL)


# -- the rest of TEI, metrics ------------------------------------------------------------------
def test_tokenize_decode_info_health_metrics(gateways, default_engine):
    url = gateways["embed"]
    status, _, toks = call(url, "/tokenize", {"inputs": ["hello world"]}, headers=AUTH)
    assert status == 200 and [t["id"] for t in toks[0]] == default_engine.tokenize(["hello world"])[0]
    assert toks[0][1] == {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}
    status, _, text = call(url, "/decode", {"ids": toks[0] and [t["id"] for t in toks[0]]}, headers=AUTH)
    assert text == ["hello world"]
    status, _, info = call(url, "/info", headers=AUTH)
    assert info["model_id"] == "all-MiniLM-L6-v2" and info["max_input_length"] == 256 and info["max_client_batch_size"] == 64
    assert info["replicas"] == {"total": 2, "healthy": 2}
    assert call(url, "/health")[0] == 200  # no key needed
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=AUTH), timeout=10) as r:
        text = r.read().decode()
    for name in ('florist_gateway_requests_total{route="/v1/embeddings",status="200"}', "florist_gateway_request_seconds_bucket",
                 "florist_gateway_tokenize_seconds_bucket", 'florist_gateway_replica_healthy{'):
        assert name in text, name


# -- bad requests -------------------------------------------------------------------------------
E, S = "embed", "score"
BAD = [
    # name, gateway, method, path, body (object or raw bytes), headers, status, message
    ("no key", E, "POST", "/v1/embeddings", {"input": "a"}, {}, 401, "needs an API key: send the header 'Authorization: Bearer <key>'"),
    ("wrong key", E, "POST", "/v1/embeddings", {"input": "a"}, {"Authorization": "Bearer nope"}, 401, "the API key is wrong"),
    ("not a bearer key", E, "POST", "/embed", {"inputs": "a"}, {"Authorization": "Basic dXNlcjpwYXNz"}, 401, "the API key is wrong"),
    ("malformed JSON", E, "POST", "/v1/embeddings", b'{"input": ', AUTH, 400, "the request body is not valid JSON"),
    ("NaN is not JSON", E, "POST", "/v1/embeddings", b'{"input": "a", "dimensions": NaN}', AUTH, 400, "is not valid JSON"),
    ("empty body", E, "POST", "/v1/embeddings", b"", AUTH, 400, "the request body is empty; send a JSON object"),
    ("body is an array", E, "POST", "/v1/embeddings", ["a"], AUTH, 400, "the request body must be a JSON object with the fields input, model"),
    ("missing input", E, "POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2"}, AUTH, 400, "missing field 'input'"),
    ("input is a number", E, "POST", "/v1/embeddings", {"input": 3}, AUTH, 400, "input must be a string, a list of strings, a list of token ids or a list of token-id lists; got an integer"),
    ("input is empty", E, "POST", "/v1/embeddings", {"input": []}, AUTH, 400, "input is empty; send at least one input"),
    ("empty string", E, "POST", "/v1/embeddings", {"input": ["a", ""]}, AUTH, 400, "input 1 is an empty string"),
    ("texts and ids mixed", E, "POST", "/v1/embeddings", {"input": ["a", [101]]}, AUTH, 400, "input[1] is an array; inputs must all be strings"),
    ("too many inputs", E, "POST", "/v1/embeddings", {"input": ["a"] * 65}, AUTH, 400, "input has 65 inputs; this server takes at most 64 per request"),
    ("input too long", E, "POST", "/v1/embeddings", {"input": "word " * 300}, AUTH, 400, "input 0 has 302 tokens; the model takes at most 256; pass truncate=true to cut it"),
    ("token id outside the vocabulary", E, "POST", "/v1/embeddings", {"input": [[101, 999999, 102]]}, AUTH, 400, "token id 999999 outside the vocabulary [0, 30522)"),
    ("float token id", E, "POST", "/v1/embeddings", {"input": [[101, 2.5]]}, AUTH, 400, "input[0] must be a list of integer token ids"),
    ("bad base64 ids", E, "POST", "/v1/embeddings", {"input": ["not base64!"], "input_format": "base64"}, AUTH, 400, "input[0] is not valid base64"),
    ("base64 ids not int32", E, "POST", "/v1/embeddings", {"input": ["AQID"], "input_format": "base64"}, AUTH, 400, "decodes to 3 bytes, not a multiple of 4"),
    ("too many dimensions", E, "POST", "/v1/embeddings", {"input": "a", "dimensions": 1000}, AUTH, 400, "dimensions must be between 1 and 384 (the model's embedding size); got 1000"),
    ("dimensions is a string", E, "POST", "/v1/embeddings", {"input": "a", "dimensions": "12"}, AUTH, 400, "dimensions must be an integer or null; got a string ('12')"),
    ("unknown encoding_format", E, "POST", "/v1/embeddings", {"input": "a", "encoding_format": "fp16"}, AUTH, 400, "encoding_format must be one of 'float', 'base64'"),
    ("int8 without a native int8", E, "POST", "/v1/embeddings", {"input": "a", "encoding_format": "int8"}, AUTH, 400, "this model defines no int8 encoding"),
    ("binary needs multiples of 8", E, "POST", "/v1/embeddings", {"input": "a", "encoding_format": "binary", "dimensions": 100}, AUTH, 400, "dimensions must be a multiple of 8"),
    ("unknown model", E, "POST", "/v1/embeddings", {"input": "a", "model": "text-embedding-3-small"}, AUTH, 404, "model 'text-embedding-3-small' is not served here; this server serves 'all-MiniLM-L6-v2'"),
    ("unknown prompt_name", E, "POST", "/embed", {"inputs": "a", "prompt_name": "query"}, AUTH, 400, "unknown prompt_name 'query'; this model's prompts: none"),
    ("unknown input_type", E, "POST", "/v1/embeddings", {"input": "a", "input_type": "code"}, AUTH, 400, "unknown input_type 'code'"),
    ("misspelt option", E, "POST", "/v1/embeddings", {"input": "a", "dimension": 8}, AUTH, 400, "unknown field 'dimension'; this route takes: input, model, dimensions"),
    ("truncate is not a boolean", E, "POST", "/embed", {"inputs": "a", "truncate": "yes"}, AUTH, 400, "truncate must be a boolean; got a string"),
    ("bad truncation_direction", E, "POST", "/embed", {"inputs": "a", "truncation_direction": "middle"}, AUTH, 400, "truncation_direction must be one of 'right', 'left'"),
    ("unknown route", E, "POST", "/v2/embeddings", {"input": "a"}, AUTH, 404, "no route POST /v2/embeddings; this server has: "),
    ("wrong method", E, "GET", "/v1/embeddings", None, AUTH, 405, "/v1/embeddings does not take GET; use POST"),
    ("huge body", E, "POST", "/v1/embeddings", {"input": "a" * (1 << 20)}, AUTH, 413, "this server takes at most 1048576"),
    ("rerank on an embedding model", E, "POST", "/rerank", {"query": "a", "texts": ["b"]}, AUTH, 400, "/rerank needs a cross-encoder or reranker; this server serves all-MiniLM-L6-v2"),
    ("tokenize a number", E, "POST", "/tokenize", {"inputs": 5}, AUTH, 400, "inputs must be a string or a list of strings; got an integer"),
    ("decode ids outside the vocabulary", E, "POST", "/decode", {"ids": [101, 99999999]}, AUTH, 400, "ids[0] has token id 99999999, outside the vocabulary"),
    ("embed on a cross-encoder", S, "POST", "/v1/embeddings", {"input": "a"}, {}, 400, "/v1/embeddings needs an embedding model"),
    ("no documents", S, "POST", "/v1/rerank", {"query": "a", "documents": []}, {}, 400, "documents is empty; send at least one document"),
    ("documents of numbers", S, "POST", "/v1/rerank", {"query": "a", "documents": ["b", 7]}, {}, 400, "documents[1] is an integer; documents must be a list of strings"),
    ("top_n zero", S, "POST", "/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, {}, 400, "top_n must be at least 1"),
    ("empty query", S, "POST", "/rerank", {"query": "", "texts": ["b"]}, {}, 400, "query must be a non-empty string"),
    ("missing query", S, "POST", "/rerank", {"texts": ["b"]}, {}, 400, "missing field 'query'"),
    ("score lists of unequal length", S, "POST", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, {}, 400, "text_1 has 2 texts and text_2 3"),
    ("pair too long", S, "POST", "/rerank", {"query": "rose " * 70, "texts": ["tulip " * 70]}, {}, 400, "pair 0 has 143 tokens; the model takes at most 128; pass truncate=true"),
    ("pairs cut on the left", S, "POST", "/rerank", {"query": "a", "texts": ["b"], "truncate": True, "truncation_direction": "left"}, {}, 400, "truncated at the end of the document only"),
]


@pytest.mark.parametrize("name,gateway,method,path,body,headers,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_request(gateways, name, gateway, method, path, body, headers, status, message):
    got, resp_headers, reply = call(gateways[gateway], path, body, method=method, headers=headers)
    assert got == status, reply
    assert message in error_message(reply), error_message(reply)
    if status == 401:
        assert resp_headers["WWW-Authenticate"] == "Bearer"


def test_error_shapes_follow_the_api(gateways):
    _, _, openai_shape = call(gateways["embed"], "/v1/embeddings", {"input": 3}, headers=AUTH)
    assert set(openai_shape["error"]) == {"message", "type", "param", "code"} and openai_shape["error"]["param"] == "input"
    _, _, tei_shape = call(gateways["embed"], "/embed", {"inputs": 3}, headers=AUTH)
    assert set(tei_shape) == {"error", "error_type"} and tei_shape["error_type"] == "Validation"
    _, _, cohere_shape = call(gateways["score"], "/v1/rerank", {"query": "a", "documents": []})
    assert set(cohere_shape) == {"message"}


def test_still_serving_after_the_bad_requests(gateways, default_engine, cross_encoder):
    status, _, body = call(gateways["embed"], "/embed", {"inputs": TEXTS}, headers=AUTH)
    assert status == 200
    np.testing.assert_allclose(np.array(body), default_engine.embed(TEXTS), **TOL)
    status, _, body = call(gateways["score"], "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200


def test_the_gateway_reaches_its_engines_over_their_local_sockets(gateways, default_engine):
    """`florist serve` runs the engines on this host: each prints its local socket, and the
    gateway workers send Embed through them (florist/server/local.py) rather than gRPC."""
    status, _, body = call(gateways["embed"], "/v1/embeddings", {"input": TEXTS}, headers=AUTH)
    assert status == 200
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]]), default_engine.embed(TEXTS), **TOL)
    out = PROCS["embed"].output()
    sockets = set(re.findall(r"local socket (\S+\.sock)", out))
    assert len(sockets) == 2, out[-3000:]  # one per engine replica
    used = set(re.findall(r"Embed, Score and Generate over its local socket (\S+\.sock)", out))
    assert used and used <= sockets, out[-3000:]


def test_access_log_is_a_line_per_request_where_asked(gateways):
    """--access-log (the score gateway): client, request line, status, bytes and seconds on the
    florist.access logger; the embed gateway, started without it, logs no request."""
    status, _, body = call(gateways["score"], "/v1/score", {"text_1": "access-log-probe", "text_2": ["a"]})
    assert status == 200
    assert call(gateways["score"], "/no-such-route-for-the-log")[0] == 404
    assert call(gateways["embed"], "/embed", {"inputs": "x"}, headers=AUTH)[0] == 200
    line = r'INFO florist\.access: 127\.0\.0\.1 "{} HTTP/1\.1" {} \d+ bytes \d+\.\d+ s'
    PROCS["score"].wait_for(line.format("POST /v1/score", 200), timeout_s=10)
    PROCS["score"].wait_for(line.format("GET /no-such-route-for-the-log", 404), timeout_s=10)
    assert "florist.access" not in PROCS["embed"].output()
