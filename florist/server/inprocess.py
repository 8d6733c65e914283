"""The inference server's handlers called in-process: a gateway and an engine in one process.

    florist serve --in-process          HTTP ──▶ gateway ──InProcessClient──▶ InferenceService ──▶ engine
                                        (one process, one event loop; no socket between them)

A gateway normally reaches its engine servers over gRPC or their local socket (local.py); on one
GPU with one gateway worker that hop is a second process's Python, two socket writes and two
wake-ups per request. `InProcessClient` has `InferenceClient`'s interface (embed, score,
generate, info, health, close) and hands the same protobuf messages to the same
`InferenceService` handlers the transports call, on the same event loop, so answers, checks and
status codes are theirs: a handler's abort raises `grpc.aio.AioRpcError` with its code, as a
transport's client would, and the dispatcher's retries and error mapping apply unchanged. A
timeout becomes the handler's deadline; a caller that is cancelled cancels the handler (its
queued sequences leave the scheduler).

`start_in_process(engine, config)` starts the batcher and the service without a gRPC port;
`InProcessClient(running.service)` is their client. What the process gives up: the engine is not restarted if
it dies (it is the process), and GPU work and HTTP parsing share one interpreter (one GIL).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import AsyncIterator, Sequence

import grpc
import numpy as np

from florist.server import proto, wire
from florist.server.client import GeneratedTokens, embed_request, generate_request, score_request
from florist.server.config import ServerConfig
from florist.server.local import Aborted, HandlerContext, rpc_error

ADDRESS = "in-process"  # the replica's name in the gateway's balancer, logs and /info


class InProcessClient:
    """`InferenceClient`'s calls, answered by `service` (an `InferenceService` on this event loop)."""

    transport = "in-process"

    def __init__(self, service, timeout: float | None = None):
        self.service, self.timeout = service, timeout
        self.address = ADDRESS

    def _context(self, timeout: float | None) -> tuple[float | None, HandlerContext]:
        """(the call's timeout, the handler's context with its deadline)."""
        timeout = timeout or self.timeout
        return timeout, HandlerContext(None if timeout is None else time.monotonic() + timeout)

    async def _unary(self, method: str, request, timeout: float | None):
        _, context = self._context(timeout)
        try:
            return await getattr(self.service, method)(request, context)
        except Aborted as e:
            raise rpc_error(e.code, e.message) from None
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            raise
        except Exception as e:  # what a transport reports as UNKNOWN: an error in a handler
            raise rpc_error(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}") from e

    async def embed(self, seqs, *, dimensions: int | None = None, normalize: bool | None = None, encoding: str = "float", timeout: float | None = None) -> np.ndarray:
        """`seqs`: token-id sequences, or (ids bytes of little-endian int32, seq_lens)."""
        response = await self._unary("Embed", embed_request(seqs, dimensions, normalize, encoding), timeout)
        return wire.decode_matrix(response.embeddings)

    async def score(self, pairs, first_segment_lens: Sequence[int] | bytes, *, raw: bool = False, timeout: float | None = None) -> np.ndarray:
        response = await self._unary("Score", score_request(pairs, first_segment_lens, raw), timeout)
        return wire.decode_matrix(response.scores)

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                       timeout: float | None = None) -> AsyncIterator[GeneratedTokens]:
        """The Generate handler's stream; leaving the loop early closes it (the sequence's slot is freed)."""
        request = generate_request(prompt_ids, max_tokens, stop_token_ids, ignore_eos)
        timeout, context = self._context(timeout)
        messages = self.service.Generate(request, context)
        try:
            async with asyncio.timeout(timeout):
                async for chunk in messages:
                    yield GeneratedTokens.of(chunk)
        except Aborted as e:
            raise rpc_error(e.code, e.message) from None
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            await messages.aclose()

    async def info(self, timeout: float | None = None):
        return await self._unary("Info", proto.InfoRequest(), timeout)

    async def health(self, timeout: float | None = None):
        return await self._unary("Health", proto.HealthRequest(), timeout)

    async def close(self, grace: float | None = None) -> None:
        """Nothing to close: the service stops with its `RunningServer`."""

    async def __aenter__(self) -> "InProcessClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def start_in_process(engine, config: ServerConfig = ServerConfig()):
    """The batcher and service of `engine` on this event loop, with no gRPC port and no local
    socket (`config`'s are ignored): a `RunningServer` whose `service` an `InProcessClient` calls.
    Its own busy poll is off: the gateway's loop is this loop, and the gateway's poll turns it.

    On a GPU the batcher polls running batches from the event loop, which then holds the GIL
    between turns; the gateway's tokenizer threads share this interpreter and would wait for
    the GIL until the holder is asked to drop it, after the switch interval (5 ms by default).
    So the interval is lowered as an engine server's busy poll lowers it, and put back at stop."""
    from florist.server.service import lower_switch_interval, start_server

    config = replace(config, port=None, local_socket=None, busy_poll=False, busy_poll_linger_ms=0.0)
    running = await start_server(engine, config)
    if str(engine.info.device).startswith("cuda"):
        running.switch_interval = lower_switch_interval()  # restored at stop
    return running
