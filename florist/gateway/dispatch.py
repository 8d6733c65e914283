"""Sending a request's sequences to the engine replicas and putting the answers back in order.

    ids ──split()──▶ chunk 0 ──pick()──▶ replica A ──rows──┐
                     chunk 1 ──pick()──▶ replica B ──rows──┼──▶ concatenated in chunk order
                     chunk 2 ──pick()──▶ replica A ──rows──┘

Chunks run concurrently. A chunk whose replica fails at the transport (UNAVAILABLE: refused,
reset, crashed; CANCELLED: the server went away) takes that replica out and is sent to another
one; RESOURCE_EXHAUSTED tries another replica too. Every response is checked to hold one row per
sequence sent, so a retried or misrouted chunk can never put another request's rows in place.
Engine embeddings are pure functions of the ids, so a retry cannot change an answer.

    all tried replicas overloaded           429, Retry-After
    no healthy replica left (or none tried) 503, Retry-After
    INVALID_ARGUMENT                        400 (the engine's message)
    DEADLINE_EXCEEDED / our deadline        504
    anything else (INTERNAL, ...)           500, not retried (an engine error may repeat)

Generation (`generate`) streams one prompt from one replica. Before its first chunk a replica that
is down or overloaded is replaced, as for a chunk; after it, nothing is retried (a new replica
would start the sequence again, and the client already has its first tokens): a replica that goes
away mid-stream is a 503 raised from the iterator, which the completions route reports as an
error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from florist.gateway.balancer import Balancer, Replica
from florist.gateway.chunking import parts_for, split
from florist.gateway.errors import ApiError
from florist.server.client import GeneratedTokens

log = logging.getLogger(__name__)
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ChunkLimits:
    max_seqs: int
    max_tokens: int
    min_tokens: int = 2048  # below this a request is not split over replicas


class Dispatcher:
    def __init__(self, balancer: Balancer, limits: ChunkLimits, *, timeout_s: float, retry_after_s: int = 1, metrics=None):
        self.balancer, self.limits, self.timeout_s, self.retry_after_s = balancer, limits, timeout_s, retry_after_s
        self.metrics = metrics

    async def embed(self, ids: list[np.ndarray], *, dimensions: int | None, normalize: bool | None, encoding: str) -> np.ndarray:
        async def call(client, seqs, first, timeout):
            return await client.embed(seqs, dimensions=dimensions, normalize=normalize, encoding=encoding, timeout=timeout)

        return await self._run(ids, None, call)

    async def score(self, ids: list[np.ndarray], first_segment_lens: list[int], *, raw: bool) -> np.ndarray:
        async def call(client, seqs, first, timeout):
            return await client.score(seqs, first, raw=raw, timeout=timeout)

        return await self._run(ids, first_segment_lens, call)

    async def generate(self, prompt_ids: np.ndarray, *, max_tokens: int, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> AsyncIterator[GeneratedTokens]:
        """The greedy continuation of one tokenized prompt, chunk by chunk, from one replica."""
        tried: list[Replica] = []
        overloaded = False
        deadline = time.monotonic() + self.timeout_s
        cost = len(prompt_ids) + max_tokens  # what the sequence will hold in the replica's cache
        while True:
            replica, remaining = self._next_replica(tried, overloaded, deadline, "ask for fewer tokens")
            replica.outstanding_tokens += cost
            received = 0
            stream = replica.client.generate(prompt_ids, max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, timeout=remaining)
            try:
                async for chunk in stream:
                    received += len(chunk.token_ids)
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _GONE:
                    self.balancer.mark_down(replica, f"{code.name}: {e.details()}")
                if received == 0 and code in _GONE:
                    self._retried("replica_down")
                    continue
                if received == 0 and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = True
                    self._retried("overloaded")
                    continue
                if code in _GONE:
                    log.warning("engine replica %s went away while generating (%s: %s)", replica.address, code.name, e.details())
                    raise ApiError(503, f"the engine replica went away after {received} generated tokens ({code.name}); retry the request",
                                   retry_after_s=self.retry_after_s) from None
                raise self._error(e, replica) from None
            finally:
                replica.outstanding_tokens -= cost
                await stream.aclose()  # cancels the RPC if the caller left early

    async def _run(self, ids, first, call) -> np.ndarray:
        lens = [len(x) for x in ids]
        total = sum(lens)
        parts = parts_for(total, self.balancer.healthy_count, self.limits.min_tokens)
        deadline = time.monotonic() + self.timeout_s
        if parts == 1 and total <= self.limits.max_tokens and len(ids) <= self.limits.max_seqs:
            return await self._chunk(ids, first, total, call, deadline)  # what split() would say: one chunk
        bounds = split(lens, max_seqs=self.limits.max_seqs, max_tokens=self.limits.max_tokens, min_parts=parts)
        jobs = [self._chunk(ids[a:b], first[a:b] if first is not None else None, sum(lens[a:b]), call, deadline) for a, b in bounds]
        if len(jobs) == 1:
            return await jobs[0]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        try:
            return np.concatenate(await asyncio.gather(*tasks))
        finally:  # one chunk failed (or the client left): the others are not needed any more
            for t in tasks:
                t.cancel()

    async def _chunk(self, seqs, first, num_tokens: int, call, deadline: float) -> np.ndarray:
        tried: list[Replica] = []
        overloaded = False
        while True:
            replica, remaining = self._next_replica(tried, overloaded, deadline, "send fewer inputs per request")
            replica.outstanding_tokens += num_tokens
            try:
                rows = await call(replica.client, seqs, first, remaining)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _GONE:
                    self.balancer.mark_down(replica, f"{code.name}: {e.details()}")
                    self._retried("replica_down")
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = True
                    self._retried("overloaded")
                    continue
                raise self._error(e, replica) from None
            finally:
                replica.outstanding_tokens -= num_tokens
            if rows.shape[0] != len(seqs):
                raise ApiError(502, f"an engine replica answered {rows.shape[0]} rows for {len(seqs)} sequences; the response was dropped, retry the request")
            return rows

    def _next_replica(self, tried: list[Replica], overloaded: bool, deadline: float, fewer: str) -> tuple[Replica, float]:
        """The least loaded replica not tried yet (added to `tried`) and the seconds left; raises
        the request's error when none is left or the deadline has passed."""
        replica = self.balancer.pick(exclude=tried)
        if replica is None:
            raise self._exhausted(tried, overloaded)
        tried.append(replica)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ApiError(504, f"the engines did not answer within {self.timeout_s:.0f} s; retry, or {fewer}")
        return replica, remaining

    def _retried(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.chunk_retried(reason)

    def _exhausted(self, tried: list[Replica], overloaded: bool) -> ApiError:
        if overloaded:
            return ApiError(429, f"the engines are overloaded (every replica's queue is full); retry after {self.retry_after_s} s or send fewer tokens at once", retry_after_s=self.retry_after_s)
        down = "; ".join(f"{r.address}: {r.last_error}" for r in self.balancer.replicas)
        log.warning("no healthy engine replica for a chunk (%s)", down)
        return ApiError(503, "no engine replica is available right now (they are restarting or unreachable); retry shortly", retry_after_s=self.retry_after_s)

    def _error(self, e: grpc.aio.AioRpcError, replica: Replica) -> ApiError:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ApiError(400, f"the engine refused the request: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ApiError(504, f"the engines did not answer within {self.timeout_s:.0f} s; retry, or send fewer inputs per request")
        log.error("engine replica %s failed a chunk: %s: %s", replica.address, code.name, details)
        return ApiError(500, f"the engine failed on this request ({code.name}: {details})")
