"""The local transport: the same RPCs (Embed, Score, Health, Info, and Generate's stream) over a
Unix socket, for a gateway on the engine's host.

A gRPC round trip through Python's grpcio costs 0.4-1 ms on top of the work (a bare Health call
took 0.44-0.78 ms on the H200 hosts, docs/benchmarks.md), which is most of what the server adds to
a batch-1 request. This transport carries the same protobuf messages in a minimal framing over a
stream socket on the engine server's event loop, and hands them to the same handlers
(`InferenceService`), so answers, checks and status codes are the gRPC path's own:

    request   | length u32 | call id u32 | kind u32 | timeout us u32 (0: none) | EmbedRequest ... bytes |
    response  | length u32 | call id u32 | status u32 (grpc code, 0: OK) | flags u32 | response bytes, or the error message (UTF-8) |

all little-endian. Calls are multiplexed on one connection (the call id matches a response to
its request; responses come in completion order). A unary call gets one response (flags 0). A
stream (Generate) gets one response per message with flags MORE, then a last one without it:
status OK and no bytes when the stream ended, or the error. Kind CANCEL (no payload) cancels a call the
client gave up on, and a connection that closes cancels all of its calls: queued sequences are
removed, as for a cancelled gRPC call. A timeout becomes the handler's deadline, as gRPC's does.

The engine server advertises its socket in Info (`local_socket`); `InferenceClient` on the same
host finds it there and sends Embed, Score and Generate through it, keeping gRPC for the rest
(Info, and the gateway's health probes, which must notice a server whose gRPC side is down). Only processes that may open the socket file (by default its
owner: a socket needs write permission) use it; any other falls back to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import select
import socket
import stat
import struct
import sys
import tempfile
import time
from typing import Callable

import grpc

from florist.server import proto

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IIII")
EMBED, SCORE, HEALTH, INFO, CANCEL, GENERATE = 1, 2, 3, 4, 5, 6
MORE = 1  # response flag: a stream's message, more frames follow for this call
# kind -> (the service's method, its request class, its response class)
METHODS = {EMBED: ("Embed", proto.EmbedRequest, proto.EmbedResponse), SCORE: ("Score", proto.ScoreRequest, proto.ScoreResponse),
           HEALTH: ("Health", proto.HealthRequest, proto.HealthResponse), INFO: ("Info", proto.InfoRequest, proto.InfoResponse)}
STREAMS = {GENERATE: ("Generate", proto.GenerateRequest, proto.GenerateChunk)}  # server streaming: the method is an async generator
KINDS = {name: kind for kind, (name, _, _) in (METHODS | STREAMS).items()}
STATUS = {code.value[0]: code for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]


_AUTO_NAME = re.compile(r"florist-engine-(\d+)-\d+\.sock")


def auto_path(port: int) -> str:
    """Where `--local-socket auto` listens: the user's runtime directory (else the temp dir),
    named after the process and its gRPC port."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"florist-engine-{os.getpid()}-{port}.sock")


def remove_stale_sockets(directory: str) -> list[str]:
    """Deletes the `auto_path` sockets in `directory` whose process is gone (a server that was
    killed cannot remove its own); returns their paths."""
    removed = []
    for name in os.listdir(directory):
        m = _AUTO_NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # another user's, or already gone
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Aborted(Exception):
    """What a handler's `context.abort(code, details)` raises outside gRPC: the call's status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class HandlerContext:
    """The part of grpc.aio's ServicerContext the handlers use, for calls that do not come through
    gRPC (this socket's, and in-process ones: inprocess.py)."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata) -> None:  # timing metadata: gRPC only
        pass


class _Frames:
    """Splits a byte stream into frames: `feed(data)` -> [(header tuple, payload bytes)], keeping
    an incomplete tail for the next call. A header whose length is over `max_payload` comes
    back at once, with payload None (the caller stops reading there)."""

    def __init__(self, max_payload: int = 0xFFFFFFFF):
        self.max_payload = max_payload
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[tuple[int, int, int, int], bytes | None]]:
        buf = self._buf
        buf += data
        out, pos, n = [], 0, len(buf)
        while n - pos >= HEADER.size:
            header = HEADER.unpack_from(buf, pos)
            if header[0] > self.max_payload:
                out.append((header, None))
                break
            end = pos + HEADER.size + header[0]
            if end > n:
                break
            out.append((header, bytes(buf[pos + HEADER.size:end])))
            pos = end
        del buf[:pos]
        return out


class _Writer:
    """Writes of an asyncio.Protocol with flow control: `drain()` waits while the transport's
    buffer is over its high-water mark (the peer is not reading)."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self._resumed: asyncio.Future | None = None
        self.lost: BaseException | None = None

    def pause_writing(self) -> None:
        self._resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    def writer_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionResetError("connection lost")
        self.resume_writing()

    async def drain(self) -> None:
        if self.lost is not None:
            raise ConnectionResetError(str(self.lost))
        if self._resumed is not None:
            await asyncio.shield(self._resumed)


def _start(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task:
    """A task for `coro` that runs at once up to its first suspension where Python has eager
    tasks (3.12+): a request's handler starts in the callback that read it, one loop turn sooner."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class LocalServer:
    """Serves `service` (an InferenceService) on a Unix socket at `path`; `close()` removes it."""

    def __init__(self, service, path: str, max_request_bytes: int):
        self.service, self.path, self.max_request_bytes = service, path, max_request_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_ServerConnection] = set()

    async def start(self) -> None:
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(f"{self.path} exists and is not a socket; pick another --local-socket")
            if _answers(self.path):
                raise OSError(f"another server listens on {self.path}; pick another --local-socket")
            os.unlink(self.path)  # left by a server that did not stop cleanly
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _ServerConnection(self), self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._connections):
            connection.transport.close()  # connection_lost cancels its calls
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _call(self, kind: int, payload: bytes, deadline: float | None, call_id: int, connection: "_ServerConnection") -> None:
        method = METHODS.get(kind) or STREAMS.get(kind)
        if method is None:
            connection.reply(call_id, grpc.StatusCode.UNIMPLEMENTED, f"unknown call kind {kind}; this server knows {sorted(METHODS | STREAMS)}".encode())
            return
        name, request_class, _ = method
        try:
            request = request_class.FromString(payload)
        except Exception:  # protobuf's DecodeError
            connection.reply(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the {name} request".encode())
            return
        try:
            if kind in STREAMS:
                await self._stream(getattr(self.service, name)(request, HandlerContext(deadline)), deadline, call_id, connection)
                response = None
            else:
                response = await getattr(self.service, name)(request, HandlerContext(deadline))
        except Aborted as e:
            connection.reply(call_id, e.code, e.message.encode())
        except Exception as e:  # what gRPC reports as UNKNOWN: an error in a handler
            log.exception("%s over the local socket failed", name)
            connection.reply(call_id, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}".encode())
        else:
            connection.reply(call_id, grpc.StatusCode.OK, b"" if response is None else response.SerializeToString())
        with contextlib.suppress(ConnectionError):
            await connection.drain()  # a client that stops reading holds its calls here, not the server's memory

    @staticmethod
    async def _stream(messages, deadline: float | None, call_id: int, connection: "_ServerConnection") -> None:
        """Each message of a server-streaming handler as a MORE frame (the caller sends the last
        frame). Cancelling the call's task closes the handler's generator, as gRPC does; so does
        its deadline passing (unary handlers read theirs from the context)."""
        try:
            async with asyncio.timeout(None if deadline is None else max(0.0, deadline - time.monotonic())):
                try:
                    async for message in messages:
                        connection.reply(call_id, grpc.StatusCode.OK, message.SerializeToString(), MORE)
                        await connection.drain()  # a client that stops reading pauses its stream here
                finally:
                    await messages.aclose()
        except TimeoutError:
            raise Aborted(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None


class _ServerConnection(_Writer, asyncio.Protocol):
    """One client connection: frames in, a task per call, replies out in completion order."""

    def __init__(self, server: LocalServer):
        super().__init__()
        self.server = server
        self.frames = _Frames(server.max_request_bytes)
        self.calls: dict[int, asyncio.Task] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        for (length, call_id, kind, timeout_us), payload in self.frames.feed(data):
            if payload is None:
                # NOTE: gRPC answers an over-long message the same way; the stream cannot be trusted after it.
                self.reply(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"request of {length} bytes is over this server's limit of {self.server.max_request_bytes}".encode())
                self.transport.close()
                return
            if kind == CANCEL:
                call = self.calls.pop(call_id, None)
                if call is not None:
                    call.cancel()
                continue
            deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
            task = _start(loop, self.server._call(kind, payload, deadline, call_id, self))
            if not task.done():
                self.calls[call_id] = task
                task.add_done_callback(lambda _, c=call_id: self.calls.pop(c, None))

    def connection_lost(self, exc) -> None:  # the client went away, or the server closes
        self.writer_lost(exc)
        for call in list(self.calls.values()):
            call.cancel()
        self.server._connections.discard(self)

    def reply(self, call_id: int, code: grpc.StatusCode, body: bytes, flags: int = 0) -> None:
        if not self.transport.is_closing():
            self.transport.write(HEADER.pack(len(body), call_id, code.value[0], flags) + body)


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The exception grpc.aio raises, so callers handle both transports alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class LocalChannel(_Writer, asyncio.Protocol):
    """The client end: one connection, calls multiplexed on it. `call` raises grpc.aio.AioRpcError
    as a gRPC call would: the server's status, UNAVAILABLE when the connection is lost (the
    channel then stays closed: make a new one), DEADLINE_EXCEEDED when `timeout` passes.

    `spin_s`: a call that is the only one in flight keeps the event loop turning (sleep(0)) for
    up to this long while it waits, so the reply is read by a loop that never went to sleep, as
    `BlockingLocalClient`'s polling does; once another call is in flight it waits as usual (the
    loop has their work to do), and so it does whenever `spin_if()` says no (the gateway: while
    other HTTP requests are in flight, whose tokenizer threads need the GIL that a turning loop
    holds). 0 (the default): never."""

    def __init__(self, path: str, spin_s: float = 0.0, spin_if: Callable[[], bool] | None = None):
        super().__init__()
        self.path, self.spin_s, self.spin_if = path, spin_s, spin_if
        self.frames = _Frames()
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # call id -> its frames, (status, flags, bytes)
        self._ids = itertools.count(1)
        self._closed: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def connect(self) -> None:
        """Raises OSError where the socket cannot be opened (absent, not permitted)."""
        await asyncio.get_running_loop().create_unix_connection(lambda: self, self.path)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for (_, call_id, code, flags), body in self.frames.feed(data):
            stream = self._streams.get(call_id)
            if stream is not None:
                stream.put_nowait((code, flags, body))
                continue
            future = self._pending.get(call_id)
            if future is not None and not future.done():
                future.set_result((code, body))

    def connection_lost(self, exc) -> None:
        self.writer_lost(exc)
        code = grpc.StatusCode.CANCELLED if self._closed is not None else grpc.StatusCode.UNAVAILABLE  # closed here, or there
        if self._closed is None:
            self._closed = f"local socket {self.path}: {exc}" if exc is not None else "the engine server closed the local socket"
        for future in self._pending.values():
            if not future.done():
                future.set_result((code.value[0], self._closed.encode()))
        for stream in self._streams.values():
            stream.put_nowait((code.value[0], 0, self._closed.encode()))

    def _send(self, kind: int, request, timeout: float | None, replies: dict, receiver) -> int:
        """Write one request, its replies to go to `receiver` (a call's future, a stream's queue),
        registered in `replies` under the new call id, which is returned."""
        if self._closed is not None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, self._closed)
        payload = request.SerializeToString()
        call_id = next(self._ids) & 0xFFFFFFFF
        replies[call_id] = receiver
        timeout_us = min(0xFFFFFFFF, max(1, int(timeout * 1e6))) if timeout is not None else 0
        self.transport.write(HEADER.pack(len(payload), call_id, kind, timeout_us) + payload)
        return call_id

    async def call(self, method: str, request, timeout: float | None = None):
        kind = KINDS[method]
        future = asyncio.get_running_loop().create_future()
        call_id = self._send(kind, request, timeout, self._pending, future)
        try:
            async with asyncio.timeout(timeout):
                await self.drain()  # returns at once unless the server has stopped reading
                if self.spin_s > 0:
                    await self._poll(future)
                code, body = await future
        except TimeoutError:
            self._cancel(call_id)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} over {self.path}: deadline of {timeout} s exceeded") from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise
        except ConnectionError as e:  # from drain(): the connection is gone
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}") from None
        finally:
            self._pending.pop(call_id, None)
        if code != _OK:
            raise rpc_error(STATUS.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return METHODS[kind][2].FromString(body)

    async def stream(self, method: str, request, timeout: float | None = None):
        """A server-streaming call (Generate): an async iterator of its messages, raising
        grpc.aio.AioRpcError as `call` does. Leaving the iteration early cancels the call."""
        kind = KINDS[method]
        frames: asyncio.Queue = asyncio.Queue()
        call_id = self._send(kind, request, timeout, self._streams, frames)
        deadline = None if timeout is None else time.monotonic() + timeout
        ended = False
        try:
            try:
                await self.drain()
            except ConnectionError as e:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}") from None
            while True:
                try:
                    # NOTE: the deadline is the whole call's, as gRPC's; the server enforces it too.
                    code, flags, body = await asyncio.wait_for(frames.get(), None if deadline is None else max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} over {self.path}: deadline of {timeout} s exceeded") from None
                if flags & MORE:
                    yield STREAMS[kind][2].FromString(body)
                    continue
                ended = True
                if code != _OK:
                    raise rpc_error(STATUS.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
                return
        finally:
            self._streams.pop(call_id, None)
            if not ended:
                self._cancel(call_id)  # the caller left early (or timed out): the server stops the stream

    async def _poll(self, future: asyncio.Future) -> None:
        """Turn the loop until `future` is done, for up to spin_s, while its call is the only one
        in flight and spin_if() allows."""
        until = time.perf_counter() + self.spin_s
        while not future.done() and len(self._pending) == 1 and time.perf_counter() < until:
            if self.spin_if is not None and not self.spin_if():
                return
            await asyncio.sleep(0)

    def _cancel(self, call_id: int) -> None:
        if self._closed is None and not self.transport.is_closing():
            self.transport.write(HEADER.pack(0, call_id, CANCEL, 0))

    async def close(self) -> None:
        if self.transport is not None and self._closed is None:
            self._closed = "the local channel is closed"
            self.transport.close()


class BlockingLocalClient:
    """A synchronous client of the local socket, one call at a time (scripts, benchmarks):

        with BlockingLocalClient(path) as client:
            response = client.call("Embed", proto.EmbedRequest(...))   # an EmbedResponse

    Errors raise grpc.aio.AioRpcError with the server's status, as `LocalChannel.call` does.

    `spin_s`: after sending, poll the socket for the reply for up to this long before sleeping
    in the kernel (then until `timeout`). A process that sleeps through a 1-2 ms call pays the
    wake-up when the reply lands (polling took 0.01-0.22 ms off a batch-1 round trip on the H200
    hosts, docs/benchmarks.md); polling keeps its core awake, at the price of that core while it
    waits. 0 (the default) sleeps at once."""

    def __init__(self, path: str, timeout: float | None = None, spin_s: float = 0.0):
        self.path, self.timeout, self.spin_s = path, timeout, spin_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._ids = itertools.count(1)
        self._poller = None

    def call(self, method: str, request):
        kind, payload = KINDS[method], request.SerializeToString()
        call_id = next(self._ids) & 0xFFFFFFFF
        timeout_us = min(0xFFFFFFFF, max(1, int(self.timeout * 1e6))) if self.timeout is not None else 0
        self.sock.sendall(HEADER.pack(len(payload), call_id, kind, timeout_us) + payload)
        if self.spin_s > 0:
            self._poll(time.perf_counter() + self.spin_s)
        length, reply_id, code, _ = HEADER.unpack(self._read(HEADER.size))
        body = self._read(length)
        assert reply_id == call_id, f"reply to call {reply_id}, expected {call_id}"  # one call at a time
        if code != _OK:
            raise rpc_error(STATUS.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return METHODS[kind][2].FromString(body)

    def _poll(self, until: float) -> None:
        """Return once the reply's first bytes are readable (or the socket closed), or at `until`."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        while not self._poller.poll(0) and time.perf_counter() < until:
            pass

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the engine server closed the local socket {self.path}")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "BlockingLocalClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
