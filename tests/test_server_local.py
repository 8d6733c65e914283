"""The local transport (florist/server/local.py): Embed / Score over the engine server's Unix
socket give what gRPC and the embedded API give, with gRPC's status codes; clients find the
socket through Info and fall back to gRPC without it. (Cancellation, deadlines and closed
connections over the socket: test_server.py's cancellation test, run on both transports.)"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import grpc
import numpy as np
import pytest

from florist.engine.output import finalize_scores
from florist.server import local, proto
from florist.server.client import InferenceClient, _loopback
from florist.server.service import ServerConfig, ServerThread
from test_server import TOL, embed_or_error, local_only, random_request, run, tokens


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread(one_torch_thread):
    """conftest.one_torch_thread for every test here."""


@pytest.fixture(scope="module")
def socket_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sockets")


@pytest.fixture(scope="module")
def local_server(default_engine, socket_dir):
    config = ServerConfig(port=0, max_batch_tokens=2048, max_batch_seqs=64, max_pending_tokens=100_000, local_socket=str(socket_dir / "embed.sock"))
    with ServerThread(default_engine, config) as srv:
        yield srv


def test_64_concurrent_clients_over_the_socket_get_the_embedded_api_output(local_server, default_engine, socket_dir):
    info = default_engine.info
    rng = np.random.default_rng(11)
    requests = [random_request(rng, info.vocab_size, info.max_input_tokens) for _ in range(64)]
    requests[0] = [rng.integers(0, info.vocab_size, size=info.max_input_tokens).tolist()]
    opts = [[dict(), dict(dimensions=64), dict(normalize=False), dict(encoding="ubinary")][i % 4] for i in range(len(requests))]
    expected = [default_engine.embed(seqs, **o) for seqs, o in zip(requests, opts)]

    async def go():
        async with InferenceClient(local_server.address, timeout=120) as shared, InferenceClient(local_server.address, local=False) as grpc_only:
            local_only(shared)
            got = await asyncio.gather(*(shared.embed(s, **o) for s, o in zip(requests, opts)))  # multiplexed on one connection
            via_grpc = await grpc_only.embed(requests[3], **opts[3])
            return got, via_grpc, shared.transport, grpc_only.transport

    got, via_grpc, transport, grpc_transport = run(go())
    assert (transport, grpc_transport) == ("local", "grpc")
    assert local_server.running.local_socket == str(socket_dir / "embed.sock")
    for k, (g, want) in enumerate(zip(got, expected)):
        assert g.dtype == want.dtype and g.shape == want.shape, k
        if want.dtype == np.uint8:  # packed sign bits: a value within rounding of 0 may flip one bit
            assert (np.unpackbits(g) != np.unpackbits(want)).sum() <= 2, k
        else:
            np.testing.assert_allclose(g, want, **TOL, err_msg=str(k))
    np.testing.assert_array_equal(via_grpc, got[3])


def test_scores_over_the_socket_match_the_embedded_api(cross_encoder_dir, socket_dir):
    import florist

    engine = florist.Engine.from_pretrained(cross_encoder_dir, device="cpu")
    ids, first = engine.text.encode_pairs("rose garden", ["red rose", "blue water", "a garden of roses by the water"], truncate=True)
    pairs = [x.tolist() for x in ids]
    with ServerThread(engine, ServerConfig(port=0, local_socket=str(socket_dir / "score.sock"))) as srv:

        async def go():
            async with InferenceClient(srv.address) as client:
                local_only(client)
                return await client.score(pairs, first), await client.score(pairs, first, raw=True), client.transport

        scores, raw, transport = run(go())
    assert transport == "local"
    np.testing.assert_allclose(scores, engine.score("rose garden", ["red rose", "blue water", "a garden of roses by the water"]), **TOL)
    np.testing.assert_allclose(raw, finalize_scores(engine.run(ids, first), engine.info.score_activation, raw=True), **TOL)


def test_errors_carry_grpc_status_codes_and_messages(local_server, default_engine):
    vocab = default_engine.info.vocab_size

    async def both(seqs_or_packed):
        out = []
        for use_local in (True, False):
            async with InferenceClient(local_server.address, local=use_local) as client:
                if use_local:
                    local_only(client)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.embed(seqs_or_packed)
                out.append((err.value.code(), err.value.details(), client.transport))
        return out

    for bad in ([[1, 2], []], [[vocab + 5]], [[1] * (default_engine.info.max_input_tokens + 1)]):
        (code, message, transport), grpc_err = run(both(bad))
        assert transport == "local" and code == grpc.StatusCode.INVALID_ARGUMENT
        assert (code, message) == grpc_err[:2]


def test_overload_is_resource_exhausted_over_the_socket(default_engine, socket_dir):
    rng = np.random.default_rng(4)
    burst = [random_request(rng, default_engine.info.vocab_size, 64, n_seqs=int(rng.integers(4, 12))) for _ in range(200)]
    config = ServerConfig(port=0, max_pending_tokens=2000, max_batch_tokens=512, local_socket=str(socket_dir / "burst.sock"))
    with ServerThread(default_engine, config) as srv:

        async def go():
            async with InferenceClient(srv.address, timeout=120) as client:
                local_only(client)
                results = await asyncio.gather(*(embed_or_error(client, s) for s in burst))
                return results, client.transport

        results, transport = run(go())
    assert transport == "local"
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [(s, r) for s, r in zip(burst, results) if not isinstance(r, grpc.aio.AioRpcError)]
    assert refused and served
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in e.details() for e in refused)
    for seqs, got in served:
        np.testing.assert_allclose(got, default_engine.embed(seqs), **TOL)


def test_clients_fall_back_to_grpc_and_notice_a_stopped_server(default_engine, socket_dir):
    path = socket_dir / "gone.sock"
    seqs = [[101, 7, 8, 102]]
    want = default_engine.embed(seqs)

    async def call(address):
        async with InferenceClient(address) as client:
            return await client.embed(seqs), client.transport

    with ServerThread(default_engine, ServerConfig(port=0)) as srv:  # no local socket: gRPC
        got, transport = run(call(srv.address))
        assert transport == "grpc" and srv.running.local_socket is None
        np.testing.assert_allclose(got, want, **TOL)
    with ServerThread(default_engine, ServerConfig(port=0, local_socket=str(path))) as srv:
        os.unlink(path)  # advertised but not reachable from here (another host's or user's path): gRPC
        got, transport = run(call(srv.address))
        assert transport == "grpc"
        np.testing.assert_allclose(got, want, **TOL)
    srv = ServerThread(default_engine, ServerConfig(port=0, local_socket=str(path)))
    srv.start()
    assert path.is_socket()

    async def across_a_stop():
        async with InferenceClient(srv.address, timeout=10) as client:
            first = await client.embed(seqs)
            assert client.transport == "local"
            await asyncio.get_running_loop().run_in_executor(None, srv.stop)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.embed(seqs)
            return first, err.value.code()

    first, code = run(across_a_stop())
    np.testing.assert_allclose(first, want, **TOL)
    assert code == grpc.StatusCode.UNAVAILABLE and not path.exists()


def test_start_replaces_a_stale_socket_and_refuses_a_live_one_or_a_file(default_engine, socket_dir):
    stale = socket_dir / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a killed server leaves
    with ServerThread(default_engine, ServerConfig(port=0, local_socket=str(stale))) as srv:
        assert srv.running.local_socket == str(stale)
        with pytest.raises(OSError, match="another server listens"):
            ServerThread(default_engine, ServerConfig(port=0, local_socket=str(stale))).start()
    plain = socket_dir / "a-file"
    plain.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        ServerThread(default_engine, ServerConfig(port=0, local_socket=str(plain))).start()
    assert plain.read_text() == "not a socket"


def raw_exchange(path: str, frames: list[bytes]) -> list[tuple[int, int, bytes]]:
    """Sends frames on one connection; reads (call id, status, body) until the server closes or
    one reply per frame has come."""
    out = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"".join(frames))
        buf = b""
        while len(out) < len(frames):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            while len(buf) >= local.HEADER.size:
                length, call_id, code, _ = local.HEADER.unpack_from(buf)
                if len(buf) < local.HEADER.size + length:
                    break
                out.append((call_id, code, buf[local.HEADER.size:local.HEADER.size + length]))
                buf = buf[local.HEADER.size + length:]
    return out


def test_the_wire_format_and_its_errors(local_server, default_engine):
    path = local_server.running.local_socket
    frame = lambda kind, body, call_id: local.HEADER.pack(len(body), call_id, kind, 0) + body  # noqa: E731
    embed = proto.EmbedRequest(tokens=tokens([101, 5, 102], [3])).SerializeToString()
    replies = raw_exchange(path, [frame(local.EMBED, embed, 7), frame(99, b"", 8), frame(local.EMBED, b"\xff\xff\xff", 9),
                                  frame(local.HEALTH, b"", 10), frame(local.INFO, b"", 11)])
    by_id = {call_id: (code, body) for call_id, code, body in replies}
    assert set(by_id) == {7, 8, 9, 10, 11}
    code, body = by_id[7]
    assert code == 0
    rows = np.frombuffer(proto.EmbedResponse.FromString(body).embeddings.data, dtype="<f4")
    np.testing.assert_allclose(rows, default_engine.embed([[101, 5, 102]])[0], **TOL)
    assert by_id[8][0] == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"unknown call kind 99" in by_id[8][1]
    assert by_id[9][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"cannot parse" in by_id[9][1]
    assert proto.HealthResponse.FromString(by_id[10][1]).status == proto.HealthResponse.SERVING
    assert proto.InfoResponse.FromString(by_id[11][1]).local_socket == path
    # A frame over the server's request limit: RESOURCE_EXHAUSTED, and the connection closes.
    huge = struct.pack("<IIII", 0xFFFFFFF0, 12, local.EMBED, 0)
    (reply,) = raw_exchange(path, [huge, frame(local.HEALTH, b"", 13)])
    assert reply[:2] == (12, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]) and b"over this server's limit" in reply[2]


def test_only_loopback_addresses_look_for_a_local_socket():
    assert all(_loopback(a) for a in ("127.0.0.1:50051", "localhost:1", "[::1]:50051", "127.0.0.2:9", "unix:/tmp/x.sock"))
    assert not any(_loopback(a) for a in ("10.0.0.5:50051", "engine-0:50051", "[2001:db8::1]:50051"))


def test_auto_path_is_per_process_and_port(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert local.auto_path(50051) == str(tmp_path / f"florist-engine-{os.getpid()}-50051.sock")


def test_blocking_client_answers_and_raises_like_the_async_one(local_server, default_engine):
    with local.BlockingLocalClient(local_server.running.local_socket, timeout=30) as client:
        response = client.call("Embed", proto.EmbedRequest(tokens=tokens([101, 5, 6, 102], [4])))
        rows = np.frombuffer(response.embeddings.data, dtype="<f4").reshape(tuple(response.embeddings.shape))
        np.testing.assert_allclose(rows, default_engine.embed([[101, 5, 6, 102]]), **TOL)
        assert client.call("Health", proto.HealthRequest()).status == proto.HealthResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            client.call("Embed", proto.EmbedRequest(tokens=tokens([101, 5], [3])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.call("Info", proto.InfoRequest()).model_name == default_engine.info.model_name  # still usable


@pytest.mark.parametrize("flags,engine_flag,gateway_local", [([], None, True), (["--no-local-socket"], ["--local-socket", "off"], False)])
def test_serve_flag_turns_the_local_socket_off_on_both_ends(monkeypatch, flags, engine_flag, gateway_local):
    import argparse

    from florist.gateway import cli, supervisor

    seen = {}
    monkeypatch.setattr(supervisor, "serve", lambda config, **kw: seen.update(config=config, **kw) or 0)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--device", "cpu", *flags])) == 0
    assert seen["config"].local_socket is gateway_local
    args = seen["engine_args"]
    assert (args[args.index("--local-socket"):][:2] if "--local-socket" in args else None) == engine_flag
    assert seen["config"].busy_poll is False and "--busy-poll" not in args
    assert cli.run(p.parse_args(["--device", "cpu", "--busy-poll", *flags])) == 0  # the engines poll
    assert seen["config"].busy_poll is False and "--busy-poll" in seen["engine_args"]
    assert cli.run(p.parse_args(["--device", "cpu", "--gateway-busy-poll", *flags])) == 0  # the gateway polls
    assert seen["config"].busy_poll is True and "--busy-poll" not in seen["engine_args"]
    assert seen["config"].reply_spin == 5.0
    assert cli.run(p.parse_args(["--device", "cpu", "--gateway-reply-spin-ms", "2.5", *flags])) == 0  # the reply poll alone
    assert seen["config"].busy_poll is False and seen["config"].reply_spin == 2.5
    assert seen["config"].busy_poll_linger_ms is None and "--busy-poll-linger-ms" not in seen["engine_args"]  # each picks its default
    assert cli.run(p.parse_args(["--device", "cpu", "--busy-poll-linger-ms", "50", *flags])) == 0  # both ends linger 50 ms
    assert seen["config"].busy_poll_linger_ms == 50.0
    assert seen["engine_args"][seen["engine_args"].index("--busy-poll-linger-ms") + 1] == "50.0"
    seen.clear()
    assert cli.run(p.parse_args(["--device", "cpu", "--gateway-reply-spin-ms", "-1", *flags])) == 2 and not seen
    assert cli.run(p.parse_args(["--device", "cpu", "--busy-poll-linger-ms", "-1", *flags])) == 2 and not seen
    assert cli.run(p.parse_args(["--device", "cpu", "--launch-ahead-ms", "-1", *flags])) == 2 and not seen


def test_launch_ahead_reaches_the_engine_servers(monkeypatch, capsys):
    import argparse

    from florist.gateway import cli, supervisor
    from florist.server import cli as engine_cli

    seen = {}
    monkeypatch.setattr(supervisor, "serve", lambda config, **kw: seen.update(config=config, **kw) or 0)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--device", "cpu"])) == 0
    assert "--launch-ahead-ms" not in seen["engine_args"]  # the engine picks its default
    for value in ("2.5", "inf"):
        assert cli.run(p.parse_args(["--device", "cpu", "--launch-ahead-ms", value])) == 0
        assert seen["engine_args"][seen["engine_args"].index("--launch-ahead-ms") + 1] == str(float(value))
    assert engine_cli.main(["--device", "cpu", "--launch-ahead-ms", "-1"]) == 2
    assert "--launch-ahead-ms must be 0 or more" in capsys.readouterr().err


def test_frames_are_split_out_of_any_chunking():
    frames = [local.HEADER.pack(len(body), i, local.EMBED, 7) + body for i, body in enumerate([b"", b"abc", bytes(range(256)) * 40, b"z"])]
    stream = b"".join(frames)
    for size in (1, 3, 16, 17, 1000, len(stream)):
        parser = local._Frames()
        got = [f for k in range(0, len(stream), size) for f in parser.feed(stream[k:k + size])]
        assert [(h[1], body) for h, body in got] == [(i, f[local.HEADER.size:]) for i, f in enumerate(frames)], size
    over = local._Frames(max_payload=100)
    (header, body), = over.feed(local.HEADER.pack(101, 9, local.EMBED, 0))  # refused on its header alone
    assert header[:2] == (101, 9) and body is None


def test_auto_sockets_of_dead_processes_are_swept_at_start(default_engine, tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    names = {f"florist-engine-{dead}-5001.sock": False, f"florist-engine-{os.getpid()}-5002.sock": True, f"other-{dead}.sock": True}
    for name in names:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(tmp_path / name))  # bound, never listening: what a killed server leaves
        s.close()
    (tmp_path / f"florist-engine-{dead}-5003.sock").write_text("not a socket")  # not ours to delete
    with ServerThread(default_engine, ServerConfig(port=0, local_socket="auto")) as srv:
        path = srv.running.local_socket
        assert path == local.auto_path(srv.running.port) and path.startswith(str(tmp_path))
        left = {p.name for p in tmp_path.iterdir()}
    assert left == {n for n, keep in names.items() if keep} | {f"florist-engine-{dead}-5003.sock", os.path.basename(path)}
    assert not os.path.exists(path)  # removed at stop


class SlowPeer:
    """A stand-in server on a Unix socket: answers each call with a HealthResponse `delay_s` after
    reading it (what the polling clients wait for)."""

    def __init__(self, path: str, delay_s: float):
        import threading

        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.delay_s = delay_s
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import time

        conn, _ = self.listener.accept()
        with conn:
            frames = local._Frames()
            while data := conn.recv(65536):
                for (_, call_id, _, _), _ in frames.feed(data):
                    time.sleep(self.delay_s)
                    body = proto.HealthResponse(status=proto.HealthResponse.SERVING, pending_sequences=call_id).SerializeToString()
                    conn.sendall(local.HEADER.pack(len(body), call_id, 0, 0) + body)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("delay_s,spin_s", [(0.0, 0.5), (0.05, 0.5), (0.05, 0.005)], ids=["at-once", "within-window", "after-window"])
def test_polling_clients_return_when_the_reply_lands(tmp_path, delay_s, spin_s):
    """spin_s: the clients poll for the reply, and return as soon as it is there (well before a
    long window ends); a reply later than the window is still read, by a sleeping read."""
    import time

    for kind in ("blocking", "asyncio"):
        path = str(tmp_path / f"{kind}.sock")
        peer = SlowPeer(path, delay_s)
        try:
            if kind == "blocking":
                with local.BlockingLocalClient(path, timeout=10, spin_s=spin_s) as client:
                    t = time.perf_counter()
                    answers = [client.call("Health", proto.HealthRequest()).pending_sequences for _ in range(3)]
                    took = time.perf_counter() - t
            else:

                async def go():
                    channel = local.LocalChannel(path, spin_s=spin_s)
                    await channel.connect()
                    t = time.perf_counter()
                    got = [(await channel.call("Health", proto.HealthRequest(), timeout=10)).pending_sequences for _ in range(3)]
                    took = time.perf_counter() - t
                    await channel.close()
                    return got, took

                answers, took = run(go())
            assert answers == [1, 2, 3], kind
            assert 3 * delay_s <= took < 3 * delay_s + 0.3, (kind, took)  # not the 1.5 s of three whole windows
        finally:
            peer.close()


def test_an_asyncio_call_polls_only_while_it_is_alone(tmp_path, monkeypatch):
    """A lone call turns the loop (sleep(0)) until its reply lands; with other calls in flight a
    polling LocalChannel waits as usual (the loop has their work to do)."""
    peer = SlowPeer(str(tmp_path / "peer.sock"), 0.02)
    turns = []
    sleep = asyncio.sleep

    channel = local.LocalChannel(str(tmp_path / "peer.sock"), spin_s=1.0)

    async def counting_sleep(delay, *a, **kw):
        if delay == 0:
            turns.append(len(channel._pending))
        return await sleep(delay, *a, **kw)

    async def go():
        await channel.connect()
        monkeypatch.setattr(local.asyncio, "sleep", counting_sleep)
        started = time.perf_counter()
        alone = await channel.call("Health", proto.HealthRequest(), timeout=10)
        lone_s = time.perf_counter() - started
        assert lone_s < 0.5, lone_s  # back when the 20 ms reply lands, not after the 1 s window
        lone_turns = len(turns)
        together = await asyncio.gather(*(channel.call("Health", proto.HealthRequest(), timeout=10) for _ in range(2)))
        await channel.close()
        return alone, together, lone_turns

    try:
        alone, together, lone_turns = run(go())
    finally:
        peer.close()
    assert alone.pending_sequences == 1 and sorted(r.pending_sequences for r in together) == [2, 3]
    assert lone_turns > 20 and set(turns) == {1}  # ~20 ms of turns for the lone call, none with two in flight
    assert len(turns) - lone_turns < 5  # the pair waited without polling (the first turned at most until the second was sent)


def test_the_attention_backend_reaches_the_engine(monkeypatch, capsys, bert_dir):
    """engine-server --attention-backend: passed to Engine.from_pretrained; a name the registry
    does not hold is refused with the ones it does."""
    import florist
    from florist.server import cli as engine_cli

    seen = {}

    def fake_from_pretrained(*args, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(florist.Engine, "from_pretrained", fake_from_pretrained)
    assert engine_cli.main(["--model", str(bert_dir), "--device", "cpu", "--attention-backend", "flex"]) == 2
    assert seen["attention_backend"] == "flex"
    monkeypatch.undo()
    assert engine_cli.main(["--model", str(bert_dir), "--device", "cpu", "--attention-backend", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown attention backend 'bogus'" in err and "'flex'" in err
