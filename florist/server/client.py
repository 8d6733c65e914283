"""An async client of the inference server (tests, benchmarks, the gateway).

    async with InferenceClient("127.0.0.1:50051") as client:
        vectors = await client.embed([[101, 7592, 102], [101, 2088, 102]])    # [2, D] float32
        vectors = await client.embed((ids_bytes, seq_lens))                    # already packed
        scores = await client.score(pair_ids, first_segment_lens)              # [N] float32
        async for chunk in client.generate(prompt_ids, max_tokens=32):         # a causal LM
            print(chunk.token_ids, chunk.finish_reason)

Errors are `grpc.aio.AioRpcError` with the server's status code and message. Create the client
inside the event loop that uses it (a grpc.aio channel belongs to one loop).

On the server's host (a loopback address) Embed, Score and Generate go through the server's local socket
where it has one (florist/server/local.py: the same messages, a fraction of gRPC's overhead); the
client learns the socket from Info before its first call, and uses gRPC wherever the socket is
absent or cannot be opened. `local=False` keeps every call on gRPC. `spin_ms` > 0: a local call
that is alone in flight (and, given `spin_if`, while `spin_if()` is true) keeps the event loop
polling for its reply for up to that long instead of sleeping (`LocalChannel`'s `spin_s`), which
cuts the wake-up from a latency-bound request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import grpc
import numpy as np

from florist.server import proto, wire
from florist.server.local import LocalChannel

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@dataclass(frozen=True)
class GeneratedTokens:
    """One streamed chunk of a Generate call: new token ids since the previous chunk; the last
    chunk has `finish_reason` ("stop" or "length") and the request's token counts."""

    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, chunk) -> "GeneratedTokens":
        """From a GenerateChunk message."""
        return cls(np.frombuffer(chunk.token_ids, dtype=wire.INT32).tolist(), chunk.finish_reason or None, chunk.prompt_tokens, chunk.completion_tokens)


# The request messages, as every client builds them (InferenceClient here, InProcessClient in inprocess.py).
def embed_request(seqs, dimensions: int | None, normalize: bool | None, encoding: str):
    request = proto.EmbedRequest(tokens=wire.encode_tokens(seqs, proto.TokenBatch), dimensions=dimensions or 0, encoding=encoding)
    if normalize is not None:
        request.normalize = normalize
    return request


def score_request(pairs, first_segment_lens: Sequence[int] | bytes, raw: bool):
    first = first_segment_lens if isinstance(first_segment_lens, (bytes, bytearray)) else np.asarray(first_segment_lens, dtype=wire.INT32).tobytes()
    return proto.ScoreRequest(tokens=wire.encode_tokens(pairs, proto.TokenBatch), first_segment_lens=bytes(first), raw=raw)


def generate_request(prompt_ids: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int], ignore_eos: bool):
    return proto.GenerateRequest(prompt_ids=np.asarray(prompt_ids, dtype=wire.INT32).tobytes(), max_tokens=max_tokens,
                                 stop_token_ids=np.asarray(stop_token_ids, dtype=wire.INT32).tobytes(), ignore_eos=ignore_eos)


class InferenceClient:
    def __init__(self, address: str, *, timeout: float | None = None, local: bool = True, spin_ms: float = 0.0,
                 spin_if: Callable[[], bool] | None = None):
        self.address, self.timeout, self.spin_ms, self.spin_if = address, timeout, spin_ms, spin_if
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._rpc = proto.method_callables(self.channel)
        self._want_local = local and _loopback(address)
        self._local: LocalChannel | None = None
        self._finding: asyncio.Future | None = None  # the look-up of the local socket, once

    @property
    def transport(self) -> str:
        """"local" once Embed / Score / Generate go through the server's local socket, else "grpc"."""
        return "local" if self._local is not None and not self._local.closed else "grpc"

    async def _unary(self, method: str, request, timeout: float | None):
        local = await self._local_channel()
        if local is not None:
            return await local.call(method, request, timeout)
        return await self._rpc[method](request, timeout=timeout)

    async def _local_channel(self) -> LocalChannel | None:
        """The server's local socket once found (looked up once, again after it closed), or None: gRPC."""
        if not self._want_local:
            return None
        if self._local is not None and self._local.closed:  # the server went away: look again next time
            self._local, self._finding = None, None
        if self._finding is None:
            self._finding = asyncio.ensure_future(self._find_local())
        await asyncio.shield(self._finding)
        return self._local

    async def _find_local(self) -> None:
        try:
            path = (await self._rpc["Info"](proto.InfoRequest(), timeout=self.timeout or 10.0)).local_socket
        except Exception:  # not answering (or shutting down): the call itself will say so; ask again next time
            self._finding = None
            return
        if not path:
            return  # gRPC only
        channel = LocalChannel(path, spin_s=self.spin_ms / 1e3, spin_if=self.spin_if)
        try:
            await channel.connect()
        except OSError as e:  # another host's path, another user's socket: gRPC
            log.info("engine server %s: its local socket %s cannot be opened here (%s); using gRPC", self.address, path, e)
            return
        self._local = channel
        log.info("engine server %s: Embed, Score and Generate over its local socket %s", self.address, path)

    async def embed(self, seqs, *, dimensions: int | None = None, normalize: bool | None = None, encoding: str = "float", timeout: float | None = None) -> np.ndarray:
        """`seqs`: token-id sequences, or (ids bytes of little-endian int32, seq_lens)."""
        response = await self._unary("Embed", embed_request(seqs, dimensions, normalize, encoding), timeout or self.timeout)
        return wire.decode_matrix(response.embeddings)

    async def score(self, pairs, first_segment_lens: Sequence[int] | bytes, *, raw: bool = False, timeout: float | None = None) -> np.ndarray:
        """`pairs`: templated (query, document) id sequences, or (ids bytes, seq_lens);
        `first_segment_lens[i]`: how many leading tokens of pair i are the query segment."""
        response = await self._unary("Score", score_request(pairs, first_segment_lens, raw), timeout or self.timeout)
        return wire.decode_matrix(response.scores)

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, timeout: float | None = None) -> AsyncIterator[GeneratedTokens]:
        """Greedy continuation of one tokenized prompt, streamed (server-streaming Generate RPC).
        Leaving the loop early cancels the call, and the server frees the sequence's slot."""
        request = generate_request(prompt_ids, max_tokens, stop_token_ids, ignore_eos)
        local = await self._local_channel()
        if local is not None:
            call = local.stream("Generate", request, timeout or self.timeout)
        else:
            call = self._rpc["Generate"](request, timeout=timeout or self.timeout)
        try:
            async for chunk in call:
                yield GeneratedTokens.of(chunk)
        finally:
            if local is not None:
                await call.aclose()  # cancels the call unless it ended
            else:
                call.cancel()

    async def info(self, timeout: float | None = None):
        """The model and server limits (florist.proto InfoResponse)."""
        return await self._rpc["Info"](proto.InfoRequest(), timeout=timeout or self.timeout)

    async def health(self, timeout: float | None = None):
        """Status and load (florist.proto HealthResponse); `.status == proto.HealthResponse.SERVING`."""
        return await self._rpc["Health"](proto.HealthRequest(), timeout=timeout or self.timeout)

    async def close(self, grace: float | None = None) -> None:
        """Closes the channels; gRPC calls in flight get `grace` seconds (None: cancelled now),
        local ones are cut at once."""
        if self._local is not None:
            await self._local.close()
        await self.channel.close(grace)

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _loopback(address: str) -> bool:
    """Whether a "host:port" gRPC address is this host's loopback (where a local socket can be)."""
    if address.startswith("unix"):  # unix:PATH, unix-abstract:NAME
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
