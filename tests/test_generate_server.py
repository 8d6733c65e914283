"""The Generate RPC over real sockets, gRPC (127.0.0.1) and the engine's local socket alike:
streams equal the embedded API's tokens, concurrent streams share the engine's steps, a cancelled
stream frees its slot, bad input is refused with INVALID_ARGUMENT, a deadline ends a stream."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

import florist
from florist.engine.generation.config import GenerationConfig
from florist.server import proto
from florist.server.client import InferenceClient
from florist.server.service import ServerConfig, ServerThread

from test_generation import make_causal_lm, prompts_for


@pytest.fixture(scope="module")
def lm_engine(tmp_path_factory):
    path = make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-server"), tie=True)
    return florist.Engine.from_pretrained(path, device="cpu", generation=GenerationConfig(max_num_seqs=4, max_model_len=128))


@pytest.fixture(scope="module")
def lm_server(lm_engine):
    with ServerThread(lm_engine, ServerConfig(port=0, local_socket="auto")) as srv:
        yield srv


TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "local"])


def client_for(server, transport: str) -> InferenceClient:
    return InferenceClient(server.address, local=transport == "local")


async def _raw_stream(client: InferenceClient, request):
    """Generate without the client's conversion, over whichever transport the client uses."""
    local = await client._local_channel()
    call = local.stream("Generate", request) if local is not None else client._rpc["Generate"](request)
    return [c async for c in call]


async def _collect(client, prompt, **kw):
    chunks = [c async for c in client.generate(prompt, **kw)]
    return [t for c in chunks for t in c.token_ids], chunks


@TRANSPORTS
def test_concurrent_streams_equal_the_embedded_api(lm_server, lm_engine, transport):
    prompts = prompts_for(lm_engine.model_dir.path, (1, 4, 9, 16, 25, 36), seed=5)
    budgets = [3, 20, 7, 16, 1, 12]
    expected = [r.token_ids for r in (lm_engine.generate([p], max_tokens=n)[0] for p, n in zip(prompts, budgets))]

    async def main():
        async with client_for(lm_server, transport) as client:
            results = await asyncio.gather(*(_collect(client, p, max_tokens=n) for p, n in zip(prompts, budgets)))
            assert client.transport == transport
            return results

    results = asyncio.run(main())  # 6 streams, 4 slots: some wait for a slot
    for (tokens, chunks), want, p in zip(results, expected, prompts):
        assert tokens == want
        last = chunks[-1]
        assert last.finish_reason == "length" and last.prompt_tokens == len(p) and last.completion_tokens == len(want)
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_open_streams_are_counted_for_busy_poll(lm_engine):
    """GenerateHandler.active counts the open Generate streams (the busy-poll task naps while
    any is open, as the generation thread needs the GIL every step); a server with busy poll
    still streams the embedded API's tokens, and the count returns to 0."""
    prompt = prompts_for(lm_engine.model_dir.path, (5,), seed=8)[0]
    want = lm_engine.generate([prompt], max_tokens=12)[0].token_ids
    with ServerThread(lm_engine, ServerConfig(port=0, busy_poll=True)) as srv:
        generation = srv.running.service.generation
        assert srv.running.busy_poll is not None and not srv.running.busy_poll.done()  # the poll runs

        async def whole():
            async with InferenceClient(srv.address) as client:
                return await _collect(client, prompt, max_tokens=12)

        async def first_chunk_of_a_long_one():
            async with InferenceClient(srv.address) as client:
                async for _ in client.generate(prompt, max_tokens=100, ignore_eos=True):
                    return generation.active  # 99 tokens still to come: the stream is open

        assert asyncio.run(whole())[0] == want
        assert asyncio.run(first_chunk_of_a_long_one()) == 1
        deadline = time.monotonic() + 10
        while generation.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert generation.active == 0


def test_stop_ends_the_generation_thread(tmp_path, monkeypatch):
    """The server's stop waits for the generation thread to finish the step it runs and end,
    instead of leaving a daemon thread to the interpreter's exit, where one ended inside torch
    aborts the process. Its own engine: a second handler stepping lm_engine's runner would race
    the module server's. A step is held until the test lets it go, so stop comes while it runs."""
    from florist.server.inprocess import InProcessClient, start_in_process

    engine = florist.Engine.from_pretrained(make_causal_lm(tmp_path / "lm", tie=True), device="cpu",
                                            generation=GenerationConfig(max_num_seqs=2, max_model_len=128))
    prompt = prompts_for(engine.model_dir.path, (5,), seed=9)[0]
    hold, held, release = threading.Event(), threading.Event(), threading.Event()
    step = engine.runner.step

    def held_step():
        if hold.is_set():
            held.set()
            release.wait(10)
        return step()

    monkeypatch.setattr(engine.runner, "step", held_step)

    async def main():
        server = await start_in_process(engine, ServerConfig())
        stream = InProcessClient(server.service).generate(prompt, max_tokens=100, ignore_eos=True)
        await anext(stream)
        hold.set()
        assert await asyncio.to_thread(held.wait, 10)  # the thread is in a step now
        thread = server.service.generation._thread
        stopping = asyncio.create_task(server.stop(grace=None))
        await asyncio.sleep(0.2)
        waited = not stopping.done()  # stop waits for the step
        release.set()
        await stopping
        alive = thread.is_alive()
        await stream.aclose()
        return waited, alive

    assert asyncio.run(main()) == (True, False)


@TRANSPORTS
def test_stop_ids_end_the_stream(lm_server, lm_engine, transport):
    prompt = prompts_for(lm_engine.model_dir.path, (6,), seed=6)[0]
    full = lm_engine.generate([prompt], max_tokens=24)[0].token_ids
    k = next(i for i in range(2, 24) if full[i] not in full[:i])

    async def main():
        async with client_for(lm_server, transport) as client:
            return await _collect(client, prompt, max_tokens=24, stop_token_ids=[full[k]])

    tokens, chunks = asyncio.run(main())
    assert tokens == full[: k + 1] and chunks[-1].finish_reason == "stop"


def record_submits(gen, monkeypatch) -> list:
    """The sequences the server submits to `gen` from now on (to read their finish reasons)."""
    seqs, submit = [], gen.submit

    def recording(*a, **kw):
        seqs.append(submit(*a, **kw))
        return seqs[-1]

    monkeypatch.setattr(gen, "submit", recording)
    return seqs


@pytest.mark.parametrize("transport, how", [("grpc", "break"), ("local", "break"), ("local", "close")])
def test_a_cancelled_stream_frees_its_slot(lm_server, lm_engine, transport, how, monkeypatch):
    """Leaving the loop cancels the call; so does closing the local client under the stream (its
    connection closes: the server cancels the connection's calls)."""
    gen = lm_engine.runner
    seqs = record_submits(gen, monkeypatch)
    prompt = prompts_for(lm_engine.model_dir.path, (5,), seed=7)[0]

    async def main():
        client = client_for(lm_server, transport)
        try:
            async for chunk in client.generate(prompt, max_tokens=100, ignore_eos=True):
                if how == "break":
                    break
                await client.close()  # the stream's next frame is the transport's error
        except grpc.aio.AioRpcError as e:
            assert how == "close" and e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), e
        else:
            assert how == "break"
        finally:
            await client.close()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while gen.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not gen.has_work and gen.scheduler.free_slots == gen.scheduler.num_slots
    assert [s.finish_reason for s in seqs] == ["abort"]


@TRANSPORTS
def test_a_deadline_ends_a_stream(lm_server, lm_engine, transport, monkeypatch):
    gen = lm_engine.runner
    seqs, step = record_submits(gen, monkeypatch), gen.step
    monkeypatch.setattr(gen, "step", lambda: (time.sleep(0.002), step())[1])  # 120 tokens take >= 0.24 s: the 50 ms deadline ends the stream first
    prompt = prompts_for(lm_engine.model_dir.path, (5,), seed=9)[0]

    async def main():
        async with client_for(lm_server, transport) as client:
            await client.info()
            async for _ in client.generate(prompt, max_tokens=120, ignore_eos=True, timeout=0.05):
                await asyncio.sleep(0.01)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while gen.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not gen.has_work and gen.scheduler.free_slots == gen.scheduler.num_slots
    assert [s.finish_reason for s in seqs] == ["abort"]


@pytest.mark.parametrize("request_kw, message", [
    (dict(prompt_ids=b"", max_tokens=4), "at least one token"),
    (dict(prompt_ids=b"\x01\x00\x00", max_tokens=4), "multiple of 4"),
    (dict(prompt_ids=(10**6).to_bytes(4, "little"), max_tokens=4), "outside the vocabulary"),
    (dict(prompt_ids=b"\x01\x00\x00\x00", max_tokens=0), "max_tokens must be"),
    (dict(prompt_ids=b"\x01\x00\x00\x00" * 100, max_tokens=100), "max_model_len"),
])
@TRANSPORTS
def test_bad_requests_are_invalid_argument(lm_server, request_kw, message, transport):
    async def main():
        async with client_for(lm_server, transport) as client:
            return await _raw_stream(client, proto.GenerateRequest(**request_kw))

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()


def test_embed_on_a_causal_lm_is_refused(lm_server):
    async def main():
        async with InferenceClient(lm_server.address) as client:
            info = await client.info()
            assert info.task == "generate"
            await client.embed([[1, 2, 3]])

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_on_an_embedding_model_is_refused(default_engine):
    async def main():
        async with InferenceClient(srv.address) as client:
            return [c async for c in client.generate([1, 2, 3], max_tokens=4)]

    with ServerThread(default_engine, ServerConfig(port=0)) as srv:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Generate needs a causal LM" in e.value.details()


def test_engine_server_tensor_parallel_size_is_checked_before_loading(tmp_path):
    """`florist engine-server --tensor-parallel-size`: an embedding model, or one GPU named for a
    group of ranks, is a clear error (exit 2), not a traceback."""
    import subprocess
    import sys

    cases = [(["--device", "cpu"], "tensor parallelism serves causal LMs"),
             (["--device", "cuda:1", "--model", str(tmp_path)], "pick them with CUDA_VISIBLE_DEVICES")]
    for extra, message in cases:
        proc = subprocess.run([sys.executable, "-m", "florist.cli", "engine-server", "--tensor-parallel-size", "2", *extra],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr[-2000:])


class _OnGpu:
    """An engine that says it runs on cuda:0 (for start_server's defaults; nothing is run)."""

    def __init__(self, engine):
        import dataclasses

        self._engine, self.info = engine, dataclasses.replace(engine.info, device="cuda:0")

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_busy_poll_linger_defaults_by_engine(lm_engine, default_engine):
    """A GPU engine that embeds lingers 20 ms by default; a causal LM's server does not (its
    decode steps run beside an idle batcher), unless told to."""
    from florist.busy_poll import DEFAULT_LINGER_MS

    with ServerThread(_OnGpu(default_engine), ServerConfig(port=0)) as srv:
        spinner = srv.running.busy_poll
        assert spinner is not None and spinner.get_coro().cr_frame.f_locals["linger_s"] == DEFAULT_LINGER_MS / 1e3
    with ServerThread(_OnGpu(lm_engine), ServerConfig(port=0)) as srv:
        assert srv.running.busy_poll is None
    with ServerThread(_OnGpu(lm_engine), ServerConfig(port=0, busy_poll_linger_ms=5.0)) as srv:
        assert srv.running.busy_poll is not None
