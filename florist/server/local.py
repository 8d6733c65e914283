"""The local transport: the same unary RPCs (Embed, Score, Health, Info) over a Unix socket, for a
gateway on the engine's host.

A gRPC round trip through Python's grpcio costs 0.4-1 ms on top of the work (a bare Health call
took 0.44-0.78 ms on the H200 hosts, docs/benchmarks.md), which is most of what the server adds to
a batch-1 request. This transport carries the same protobuf messages in a minimal framing over a
stream socket on the engine server's event loop, and hands them to the same handlers
(`InferenceService`), so answers, checks and status codes are the gRPC path's own:

    request   | length u32 | call id u32 | kind u32 | timeout us u32 (0: none) | EmbedRequest ... bytes |
    response  | length u32 | call id u32 | status u32 (grpc code, 0: OK) | 0 u32 | response bytes, or the error message (UTF-8) |

all little-endian. Calls are multiplexed on one connection (the call id matches a response to
its request; responses come in completion order). Kind CANCEL (no payload) cancels a call the
client gave up on, and a connection that closes cancels all of its calls: queued sequences are
removed, as for a cancelled gRPC call. A timeout becomes the handler's deadline, as gRPC's does.

The engine server advertises its socket in Info (`local_socket`); `InferenceClient` on the same
host finds it there and sends Embed / Score through it, keeping gRPC for the rest (Generate,
and the gateway's health probes). Only processes that may open the socket file (by default its
owner: a socket needs write permission) use it; any other falls back to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
import tempfile
import time

import grpc

from florist.server import proto

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IIII")
EMBED, SCORE, HEALTH, INFO, CANCEL = 1, 2, 3, 4, 5
# kind -> (the service's method, its request class, its response class)
METHODS = {EMBED: ("Embed", proto.EmbedRequest, proto.EmbedResponse), SCORE: ("Score", proto.ScoreRequest, proto.ScoreResponse),
           HEALTH: ("Health", proto.HealthRequest, proto.HealthResponse), INFO: ("Info", proto.InfoRequest, proto.InfoResponse)}
KINDS = {name: kind for kind, (name, _, _) in METHODS.items()}
STATUS = {code.value[0]: code for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]


def auto_path(port: int) -> str:
    """Where `--local-socket auto` listens: the user's runtime directory (else the temp dir),
    named after the process and its gRPC port."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"florist-engine-{os.getpid()}-{port}.sock")


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """The part of grpc.aio's ServicerContext the handlers use."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Aborted(code, details)

    def set_trailing_metadata(self, metadata) -> None:  # timing metadata: gRPC only
        pass


class LocalServer:
    """Serves `service` (an InferenceService) on a Unix socket at `path`; `close()` removes it."""

    def __init__(self, service, path: str, max_request_bytes: int):
        self.service, self.path, self.max_request_bytes = service, path, max_request_bytes
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(f"{self.path} exists and is not a socket; pick another --local-socket")
            if _answers(self.path):
                raise OSError(f"another server listens on {self.path}; pick another --local-socket")
            os.unlink(self.path)  # left by a server that did not stop cleanly
        self._server = await asyncio.start_unix_server(self._serve_connection, self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.close()  # its reader sees the end of the stream and cancels the connection's calls
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        calls: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()
        try:
            while True:
                length, call_id, kind, timeout_us = HEADER.unpack(await reader.readexactly(HEADER.size))
                if length > self.max_request_bytes:
                    # NOTE: gRPC answers an over-long message the same way; the stream cannot be trusted after it.
                    _reply(writer, call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"request of {length} bytes is over this server's limit of {self.max_request_bytes}".encode())
                    return
                payload = await reader.readexactly(length) if length else b""
                if kind == CANCEL:
                    call = calls.pop(call_id, None)
                    if call is not None:
                        call.cancel()
                    continue
                deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
                task = loop.create_task(self._call(kind, payload, deadline, call_id, writer))
                calls[call_id] = task
                task.add_done_callback(lambda _, c=call_id: calls.pop(c, None))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            for call in calls.values():
                call.cancel()
            writer.close()
            self._connections.discard(writer)

    async def _call(self, kind: int, payload: bytes, deadline: float | None, call_id: int, writer: asyncio.StreamWriter) -> None:
        method = METHODS.get(kind)
        if method is None:
            _reply(writer, call_id, grpc.StatusCode.UNIMPLEMENTED, f"unknown call kind {kind}; this server knows {sorted(METHODS)}".encode())
            return
        name, request_class, _ = method
        try:
            request = request_class.FromString(payload)
        except Exception:  # protobuf's DecodeError
            _reply(writer, call_id, grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the {name} request".encode())
            return
        try:
            response = await getattr(self.service, name)(request, _Context(deadline))
        except _Aborted as e:
            _reply(writer, call_id, e.code, e.message.encode())
        except Exception as e:  # what gRPC reports as UNKNOWN: an error in a handler
            log.exception("%s over the local socket failed", name)
            _reply(writer, call_id, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}".encode())
        else:
            _reply(writer, call_id, grpc.StatusCode.OK, response.SerializeToString())
        with contextlib.suppress(ConnectionError):
            await writer.drain()  # a client that stops reading holds its calls here, not the server's memory


def _reply(writer: asyncio.StreamWriter, call_id: int, code: grpc.StatusCode, body: bytes) -> None:
    if not writer.is_closing():
        writer.write(HEADER.pack(len(body), call_id, code.value[0], 0) + body)


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The exception grpc.aio raises, so callers handle both transports alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class LocalChannel:
    """The client end: one connection, calls multiplexed on it. `call` raises grpc.aio.AioRpcError
    as a gRPC call would: the server's status, UNAVAILABLE when the connection is lost (the
    channel then stays closed: make a new one), DEADLINE_EXCEEDED when `timeout` passes."""

    def __init__(self, path: str):
        self.path = path
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._closed: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def connect(self) -> None:
        """Raises OSError where the socket cannot be opened (absent, not permitted)."""
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader), name="florist-local-channel")

    async def call(self, method: str, request, timeout: float | None = None):
        kind = KINDS[method]
        if self._closed is not None:
            raise _error(grpc.StatusCode.UNAVAILABLE, self._closed)
        payload = request.SerializeToString()
        call_id = next(self._ids) & 0xFFFFFFFF
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        timeout_us = min(0xFFFFFFFF, max(1, int(timeout * 1e6))) if timeout is not None else 0
        self._writer.write(HEADER.pack(len(payload), call_id, kind, timeout_us) + payload)
        try:
            async with asyncio.timeout(timeout):
                await self._writer.drain()  # returns at once unless the server has stopped reading
                code, body = await future
        except TimeoutError:
            self._cancel(call_id)
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} over {self.path}: deadline of {timeout} s exceeded") from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise
        except ConnectionError as e:  # from drain(): the connection is gone
            raise _error(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}") from None
        finally:
            self._pending.pop(call_id, None)
        if code != _OK:
            raise _error(STATUS.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return METHODS[kind][2].FromString(body)

    def _cancel(self, call_id: int) -> None:
        if self._closed is None and not self._writer.is_closing():
            self._writer.write(HEADER.pack(0, call_id, CANCEL, 0))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine server closed the local socket"
        try:
            while True:
                length, call_id, code, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
                body = await reader.readexactly(length) if length else b""
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result((code, body))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                reason = f"local socket {self.path}: {e}"
        finally:
            code = grpc.StatusCode.CANCELLED if self._closed is not None else grpc.StatusCode.UNAVAILABLE  # closed here, or there
            self._closed = self._closed or reason
            for future in self._pending.values():
                if not future.done():
                    future.set_result((code.value[0], self._closed.encode()))

    async def close(self) -> None:
        if self._writer is not None and self._closed is None:
            self._closed = "the local channel is closed"
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._reader_task is not None:
            self._reader_task.cancel()


class BlockingLocalClient:
    """A synchronous client of the local socket, one call at a time (scripts, benchmarks):

        with BlockingLocalClient(path) as client:
            response = client.call("Embed", proto.EmbedRequest(...))   # an EmbedResponse

    Errors raise grpc.aio.AioRpcError with the server's status, as `LocalChannel.call` does."""

    def __init__(self, path: str, timeout: float | None = None):
        self.path, self.timeout = path, timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._ids = itertools.count(1)

    def call(self, method: str, request):
        kind, payload = KINDS[method], request.SerializeToString()
        call_id = next(self._ids) & 0xFFFFFFFF
        timeout_us = min(0xFFFFFFFF, max(1, int(self.timeout * 1e6))) if self.timeout is not None else 0
        self.sock.sendall(HEADER.pack(len(payload), call_id, kind, timeout_us) + payload)
        length, reply_id, code, _ = HEADER.unpack(self._read(HEADER.size))
        body = self._read(length)
        assert reply_id == call_id, f"reply to call {reply_id}, expected {call_id}"  # one call at a time
        if code != _OK:
            raise _error(STATUS.get(code, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        return METHODS[kind][2].FromString(body)

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise _error(grpc.StatusCode.UNAVAILABLE, f"the engine server closed the local socket {self.path}")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "BlockingLocalClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
