"""`POST /v1/completions` (greedy) against the embedded API's `Engine.generate` on a tiny random
Qwen3 causal LM (CPU, fp32): a live `florist serve --model LM` driven by OpenAI's own client,
streaming and not; the 400s for sampling options and bad input; a replica that goes away
mid-stream (in-process); and the parts without sockets (stop strings, the dispatcher's retry)."""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

import grpc
import numpy as np
import openai
import pytest
from florist_procs import serve
from test_gateway import call, error_message
from test_generation import make_causal_lm, prompts_for

import florist
from florist.engine.generation.detokenizer import IncrementalDetokenizer
from florist.gateway.balancer import Balancer
from florist.gateway.completion_text import CompletionText
from florist.gateway.config import GatewayConfig
from florist.gateway.dispatch import ChunkLimits, Dispatcher
from florist.gateway.errors import ApiError
from florist.gateway.server import GatewayThread
from florist.server import proto
from florist.server.client import GeneratedTokens
from florist.server.service import ServerConfig, ServerThread

TEXTS = ["the rose and the tulip need", "search engine", "which seed grows fast in green soil"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-gateway") / "lm", tie=True)  # served as "lm"


@pytest.fixture(scope="module")
def lm_engine(lm_dir):
    return florist.Engine.from_pretrained(lm_dir, device="cpu")  # the engine server's defaults: 32 slots of 256 tokens


@pytest.fixture(scope="module")
def served(lm_dir):
    proc, url = serve("--model", str(lm_dir), "--device", "cpu")
    try:
        yield url
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)


def _streamed(client, prompt, **kw):
    """-> events, and per choice index: (token ids, text, finish_reason)."""
    events = list(client.completions.create(model="lm", prompt=prompt, stream=True, extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw))
    choices: dict[int, tuple[list, str, str | None]] = {}
    for ev in events:
        for c in ev.choices:
            ids, text, finished = choices.get(c.index, ([], "", None))
            assert finished is None, "no event of a prompt after its finish_reason"
            choices[c.index] = (ids + c.token_ids, text + c.text, c.finish_reason)
    return events, choices


def test_streaming_with_the_openai_client_equals_engine_generate(client, lm_engine, lm_dir):
    id_prompts = prompts_for(lm_dir, (1, 7, 30), seed=11)
    pieces = []
    for prompt, budget in [(TEXTS[0], 24), (TEXTS[1], 5), (id_prompts[0], 16), (id_prompts[2], 40)]:
        want = lm_engine.generate([prompt], max_tokens=budget)[0]
        events, choices = _streamed(client, prompt, max_tokens=budget)
        assert choices == {0: (want.token_ids, want.text, "length")}
        assert len({(e.id, e.created, e.model, e.object) for e in events}) == 1 and events[0].object == "text_completion"
        pieces.append(len(events))
    # The server sends whatever tokens are ready in one chunk, so on a busy 2-core host one short
    # answer may come whole; across these four (85 tokens) the text must have come in pieces.
    assert max(pieces) > 2, f"text should arrive in pieces: events per answer {pieces}"
    # Several prompts in one request: interleaved events, one choice index per prompt, usage last.
    events, choices = _streamed(client, TEXTS, max_tokens=12, stream_options={"include_usage": True})
    want = lm_engine.generate(TEXTS, max_tokens=12)
    assert choices == {i: (w.token_ids, w.text, "length") for i, w in enumerate(want)}
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 36
    assert events[-1].usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert all(e.usage is None for e in events[:-1])


def test_non_streaming_equals_engine_generate(client, lm_engine, lm_dir):
    prompts = prompts_for(lm_dir, (3, 12, 20), seed=12)
    want = lm_engine.generate(prompts, max_tokens=20)
    r = client.completions.create(model="org/lm", prompt=prompts, max_tokens=20, extra_body={"return_token_ids": True})
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in r.choices] == [(i, w.token_ids, w.text, "length") for i, w in enumerate(want)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (35, 60, 95)
    default = client.completions.create(model="lm", prompt=TEXTS[2], temperature=0, top_p=1, n=1)
    assert default.choices[0].text == lm_engine.generate([TEXTS[2]], max_tokens=16)[0].text  # max_tokens defaults to 16
    assert [m.id for m in client.models.list()] == ["lm"]


def test_stop_token_ids_and_stop_strings(client, lm_engine):
    full = lm_engine.generate([TEXTS[0]], max_tokens=40)[0]
    k = next(i for i in range(3, 40) if full.token_ids[i] not in full.token_ids[:i])
    by_id = lm_engine.generate([TEXTS[0]], max_tokens=40, stop_token_ids=[full.token_ids[k]])[0]
    r = client.completions.create(model="lm", prompt=TEXTS[0], max_tokens=40, extra_body={"stop_token_ids": [full.token_ids[k]]})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (by_id.text, "stop", k + 1)
    _, choices = _streamed(client, TEXTS[0], max_tokens=40, extra_body={"stop_token_ids": [full.token_ids[k]]})
    assert choices[0] == (by_id.token_ids, by_id.text, "stop")

    stop = full.text[len(full.text) // 2:][:3]  # three characters from the middle of the text
    cut = full.text[: full.text.find(stop)]
    r = client.completions.create(model="lm", prompt=TEXTS[0], max_tokens=40, stop=[stop, "never appears"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    _, choices = _streamed(client, TEXTS[0], max_tokens=40, stop=stop)
    assert choices[0][1:] == (cut, "stop")
    # Without return_token_ids: a stop string at the very start leaves no text at all, and the
    # finish_reason still comes, in an event of its own.
    events = list(client.completions.create(model="lm", prompt=TEXTS[0], max_tokens=40, stop=full.text[:3], stream=True))
    assert [(c.index, c.text, c.finish_reason) for e in events for c in e.choices] == [(0, "", "stop")]


@pytest.mark.parametrize("option", [
    {"temperature": 0.7}, {"temperature": 1}, {"top_p": 0.9}, {"n": 2}, {"best_of": 3}, {"logprobs": 1}, {"logprobs": 0},
    {"presence_penalty": 0.5}, {"frequency_penalty": -1}, {"logit_bias": {"5": 10}}, {"seed": 7},
])
def test_sampling_options_are_refused(served, option):
    status, _, body = call(served, "/v1/completions", {"prompt": "rose", **option})
    name = next(iter(option))
    assert status == 400 and body["error"]["param"] == name
    assert f"only greedy decoding is supported (temperature 0); drop {name}" in error_message(body)


def test_sampling_through_the_openai_client_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="only greedy decoding is supported"):
        client.completions.create(model="lm", prompt="rose", temperature=0.8, stream=True)


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": ""}, 400, "prompt 0 is an empty string"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"prompt": [[]]}, 400, "prompt 0 must be a non-empty flat list of token ids"),
    ({"prompt": [[1, 2], "a"]}, 400, "prompt[1] is a string"),
    ({"prompt": [10**6]}, 400, "outside the vocabulary"),
    ({"prompt": [5] * 300}, 400, "prompt 0 has 300 tokens; the model takes at most 256; shorten the prompt"),
    ({"prompt": [5] * 250, "max_tokens": 16}, 400, "250 tokens and max_tokens is 16, 266 in all; this engine holds at most 256"),
    ({"prompt": [5] * 250, "max_tokens": 16, "stream": True}, 400, "this engine holds at most 256"),
    ({"prompt": "rose", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ({"prompt": "rose", "max_tokens": 2**40}, 400, "the prompt and max_tokens must fit the engine's max_model_len"),
    ({"prompt": "rose", "max_tokens": "8"}, 400, "max_tokens must be an integer or null"),
    ({"prompt": "rose", "stop": ""}, 400, "stop takes at most 4 non-empty strings"),
    ({"prompt": "rose", "stop_token_ids": [-1]}, 400, "stop_token_ids has -1, outside the vocabulary"),
    ({"prompt": "rose", "stream_options": {"include_usage": True}}, 400, "stream_options is only allowed with stream: true"),
    ({"prompt": "rose", "echo": True}, 400, "echo is not supported"),
    ({"prompt": "rose", "suffix": "end"}, 400, "suffix is not supported"),
    ({"prompt": "rose", "top_k": 5}, 400, "unknown field 'top_k'"),
    ({"prompt": "rose", "model": "gpt-3.5-turbo-instruct"}, 404, "model 'gpt-3.5-turbo-instruct' is not served here"),
    ({"input": "rose"}, 400, "unknown field 'input'"),
])
def test_bad_requests(served, body, status, message):
    got, headers, answer = call(served, "/v1/completions", body)
    assert got == status and message in error_message(answer), answer
    assert headers["Content-Type"].startswith("application/json")  # a refused stream is an HTTP error, not an event


def test_other_routes_point_to_completions(served):
    status, _, body = call(served, "/v1/embeddings", {"input": "rose"})
    assert status == 400 and "needs an embedding model; this server serves lm, a causal LM: use /v1/completions" in error_message(body)
    status, _, body = call(served, "/info")
    assert status == 200 and body["model_type"] == {"generate": {}}


def _slow_engine(lm_dir):
    """An engine whose steps take 50 ms, so a stream is still running when the test acts."""
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu")
    step = engine.runner.step

    def slow_step():
        time.sleep(0.05)
        return step()

    engine.runner.step = slow_step
    return engine


def _gateway(srv) -> GatewayThread:
    return GatewayThread(GatewayConfig(engines=(srv.address,), port=0, health_interval_s=0.2))


def test_a_tensor_parallel_replica_serves_what_one_rank_does(lm_dir, lm_engine):
    """`florist serve --tensor-parallel-size 2` on the CPU: the replica's two ranks meet over gloo,
    completions equal the one-rank engine's, and stopping the server stops both ranks."""
    proc, url = serve("--model", str(lm_dir), "--device", "cpu", "--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, budget in [(TEXTS[0], 12), (TEXTS[2], 20)]:
            want = lm_engine.generate([prompt], max_tokens=budget)[0]
            got = client.completions.create(model="lm", prompt=prompt, max_tokens=budget, extra_body={"return_token_ids": True}).choices[0]
            assert (got.token_ids, got.text) == (want.token_ids, want.text)
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]
    assert "Traceback" not in proc.output(), proc.output()[-3000:]


def test_a_replica_gone_mid_stream_ends_with_an_error_event(lm_dir):
    """After the first event the engine server stops: the client gets an error, not silence."""
    srv = ServerThread(_slow_engine(lm_dir), ServerConfig(port=0)).start()
    try:
        with _gateway(srv) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            stream = c.completions.create(model="lm", prompt=TEXTS[0], max_tokens=200, stream=True)
            first = next(iter(stream))
            assert first.choices[0].finish_reason is None
            srv.stop()
            with pytest.raises(openai.APIError, match="went away after"):
                for _ in stream:
                    pass
    finally:
        srv.stop()


def test_a_client_that_leaves_frees_its_engine_slot(lm_dir):
    engine = _slow_engine(lm_dir)
    gen = engine.runner
    with ServerThread(engine, ServerConfig(port=0)) as srv, _gateway(srv) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = c.completions.create(model="lm", prompt=[TEXTS[0], TEXTS[1]], max_tokens=200, stream=True)
        next(iter(stream))
        assert gen.scheduler.free_slots == gen.scheduler.num_slots - 2
        stream.close()  # the HTTP connection goes; the gateway cancels both RPCs
        deadline = time.monotonic() + 4  # finishing the 200 tokens would take 10 s
        while (gen.has_work or gen.scheduler.free_slots != gen.scheduler.num_slots) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not gen.has_work and gen.scheduler.free_slots == gen.scheduler.num_slots


# -- without sockets --------------------------------------------------------------------------------
def _tokenizer(lm_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(lm_dir / "tokenizer.json"))


def test_stop_strings_split_over_chunks_are_held_back(lm_dir):
    tok = _tokenizer(lm_dir)
    ids = tok.encode("the rose needs water and sun", add_special_tokens=False).ids
    full = tok.decode(ids)
    # Stop strings that span tokens: text that could begin one is held back, so the deltas never
    # hold any of it (they would add up to more than the cut text otherwise).
    for stop, want in [(("rose ne",), "the "), (("nothing", "er and s"), "the rose needs wat"), (("zz", "sun!"), full)]:
        text = CompletionText(IncrementalDetokenizer(tok), stop)
        deltas = [text.push(GeneratedTokens([t], "length" if k == len(ids) - 1 else None)) for k, t in enumerate(ids) if not text.finished]
        assert "".join(deltas) == text.text == want
        assert text.finish_reason == ("length" if want == full else "stop")
        if want == full:  # text that cannot begin a stop string is not held: "the" goes out with its token
            assert deltas[0] == tok.decode(ids[:1]) == "the"
    # A final stop token (EOS or a stop id) leaves no text.
    text = CompletionText(IncrementalDetokenizer(tok))
    assert text.push(GeneratedTokens(ids[:2])) + text.push(GeneratedTokens([ids[2], tok.token_to_id("<|endoftext|>")], "stop")) == tok.decode(ids[:3])
    assert text.token_ids == ids[:3] + [tok.token_to_id("<|endoftext|>")]
    text = CompletionText(IncrementalDetokenizer(tok))  # a stop id that is an ordinary token
    assert text.push(GeneratedTokens(ids[:2])) + text.push(GeneratedTokens([ids[2], ids[3]], "stop")) == tok.decode(ids[:3])
    assert text.token_ids == ids[:4] and text.text == tok.decode(ids[:3])


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


class _FakeLM:
    """A replica. Call k (on any replica) sends `plan[k]` chunks before its connection drops (None: all of them)."""

    plan: ClassVar[list] = []

    def __init__(self, address):
        self.address, self.channel = address, self

    async def close(self, grace=None):
        pass

    async def health(self, timeout=None):
        return proto.HealthResponse(status=proto.HealthResponse.SERVING)

    async def info(self, timeout=None):
        return proto.InfoResponse(model_name="m", task="generate", vocab_size=100, max_input_tokens=64)

    async def generate(self, prompt_ids, *, max_tokens, timeout=None, **options):
        fail_at = self.plan.pop(0) if self.plan else None
        for k in range(max_tokens):
            if fail_at == k:
                raise _RpcError(grpc.StatusCode.UNAVAILABLE)
            await asyncio.sleep(0)
            yield GeneratedTokens([k], "length" if k == max_tokens - 1 else None, len(prompt_ids), k + 1)


def _generate(plan: list, max_tokens: int = 3):
    async def go():
        _FakeLM.plan = list(plan)
        balancer = Balancer(["a", "b"], client_factory=_FakeLM, interval_s=10)
        await balancer.start(timeout_s=1)
        d = Dispatcher(balancer, ChunkLimits(max_seqs=8, max_tokens=1000), timeout_s=5)
        got = []
        try:
            async for chunk in d.generate(np.asarray([1, 2]), max_tokens=max_tokens):
                got.append(chunk.token_ids[0])
        except ApiError as e:
            got.append(e)
        healthy = [r.address for r in balancer.replicas if r.healthy]
        outstanding = [r.outstanding_tokens for r in balancer.replicas]
        await balancer.close()
        return got, healthy, outstanding

    return asyncio.run(go())


def test_a_replica_down_before_the_first_chunk_is_replaced():
    got, healthy, outstanding = _generate([0, None])
    assert got == [0, 1, 2] and len(healthy) == 1 and outstanding == [0, 0]


def test_a_replica_down_mid_stream_is_an_error_after_its_tokens():
    got, healthy, outstanding = _generate([2, None])
    assert got[:2] == [0, 1] and isinstance(got[2], ApiError) and got[2].status == 503 and "after 2 generated tokens" in got[2].message
    assert len(healthy) == 1 and outstanding == [0, 0]
