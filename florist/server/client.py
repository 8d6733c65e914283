"""An async client of the inference server (tests, benchmarks, the gateway).

    async with InferenceClient("127.0.0.1:50051") as client:
        vectors = await client.embed([[101, 7592, 102], [101, 2088, 102]])    # [2, D] float32
        vectors = await client.embed((ids_bytes, seq_lens))                    # already packed
        scores = await client.score(pair_ids, first_segment_lens)              # [N] float32
        async for chunk in client.generate(prompt_ids, max_tokens=32):         # a causal LM
            print(chunk.token_ids, chunk.finish_reason)

Errors are `grpc.aio.AioRpcError` with the server's status code and message. Create the client
inside the event loop that uses it (a grpc.aio channel belongs to one loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import grpc
import numpy as np

from florist.server import proto, wire

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@dataclass(frozen=True)
class GeneratedTokens:
    """One streamed chunk of a Generate call: new token ids since the previous chunk; the last
    chunk has `finish_reason` ("stop" or "length") and the request's token counts."""

    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class InferenceClient:
    def __init__(self, address: str, *, timeout: float | None = None):
        self.address, self.timeout = address, timeout
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._rpc = proto.method_callables(self.channel)

    async def embed(self, seqs, *, dimensions: int | None = None, normalize: bool | None = None, encoding: str = "float", timeout: float | None = None) -> np.ndarray:
        """`seqs`: token-id sequences, or (ids bytes of little-endian int32, seq_lens)."""
        request = proto.EmbedRequest(tokens=wire.encode_tokens(seqs, proto.TokenBatch), dimensions=dimensions or 0, encoding=encoding)
        if normalize is not None:
            request.normalize = normalize
        response = await self._rpc["Embed"](request, timeout=timeout or self.timeout)
        return wire.decode_matrix(response.embeddings)

    async def score(self, pairs, first_segment_lens: Sequence[int] | bytes, *, raw: bool = False, timeout: float | None = None) -> np.ndarray:
        """`pairs`: templated (query, document) id sequences, or (ids bytes, seq_lens);
        `first_segment_lens[i]`: how many leading tokens of pair i are the query segment."""
        first = first_segment_lens if isinstance(first_segment_lens, (bytes, bytearray)) else np.asarray(first_segment_lens, dtype=wire.INT32).tobytes()
        request = proto.ScoreRequest(tokens=wire.encode_tokens(pairs, proto.TokenBatch), first_segment_lens=bytes(first), raw=raw)
        response = await self._rpc["Score"](request, timeout=timeout or self.timeout)
        return wire.decode_matrix(response.scores)

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, timeout: float | None = None) -> AsyncIterator[GeneratedTokens]:
        """Greedy continuation of one tokenized prompt, streamed (server-streaming Generate RPC).
        Leaving the loop early cancels the call, and the server frees the sequence's slot."""
        request = proto.GenerateRequest(
            prompt_ids=np.asarray(prompt_ids, dtype=wire.INT32).tobytes(), max_tokens=max_tokens,
            stop_token_ids=np.asarray(stop_token_ids, dtype=wire.INT32).tobytes(), ignore_eos=ignore_eos,
        )
        call = self._rpc["Generate"](request, timeout=timeout or self.timeout)
        try:
            async for chunk in call:
                yield GeneratedTokens(np.frombuffer(chunk.token_ids, dtype=wire.INT32).tolist(), chunk.finish_reason or None,
                                      chunk.prompt_tokens, chunk.completion_tokens)
        finally:
            call.cancel()

    async def info(self, timeout: float | None = None):
        """The model and server limits (florist.proto InfoResponse)."""
        return await self._rpc["Info"](proto.InfoRequest(), timeout=timeout or self.timeout)

    async def health(self, timeout: float | None = None):
        """Status and load (florist.proto HealthResponse); `.status == proto.HealthResponse.SERVING`."""
        return await self._rpc["Health"](proto.HealthRequest(), timeout=timeout or self.timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
