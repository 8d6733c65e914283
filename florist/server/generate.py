"""The Generate RPC: each request becomes a sequence of the engine's generation scheduler; one
thread runs the engine's steps and hands each step's tokens to the streams on the event loop.

    Generate(request) ──submit──▶ Generator inbox ──▶ [florist-generate thread: step(), step() ...]
          ▲                                                         │ this step's new tokens
          └── GenerateChunk ◀── asyncio.Queue ◀── call_soon_threadsafe ◀┘

A step waits for its tokens on the host (greedy decoding needs them), so the steps run on their
own thread and the event loop stays free. Tokens that queue up while a client reads slowly go out
together in one chunk. A client that goes away (or whose deadline passes) has its sequence
aborted at the next step boundary, which frees its KV-cache slot.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np

from florist.loop_thread import join_thread
from florist.server import proto, wire
from florist.text import InputError

log = logging.getLogger(__name__)


class GenerateHandler:
    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.active = 0  # Generate streams open (read on the event loop, e.g. by the busy-poll task)

    # -- the RPC -----------------------------------------------------------------------------
    async def stream(self, request, context):
        """Async generator of GenerateChunk messages for one request."""
        started, code, seq = time.perf_counter(), "OK", None
        self.active += 1
        try:
            try:
                seq, queue = self._submit(request)
            except InputError as e:
                code = grpc.StatusCode.INVALID_ARGUMENT.name
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                errors = [x for x in items if isinstance(x, BaseException)]
                if errors:
                    code = grpc.StatusCode.INTERNAL.name
                    await context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while generating: {errors[0]!r}")
                tokens = [t for t, _ in items]
                finish = items[-1][1]
                chunk = proto.GenerateChunk(token_ids=np.asarray(tokens, dtype=wire.INT32).tobytes())
                if finish:
                    chunk.finish_reason = finish
                    chunk.prompt_tokens, chunk.completion_tokens = len(seq.prompt), len(seq.output)
                yield chunk
                if finish:
                    return
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.active -= 1
            if seq is not None and not seq.finished:
                self.engine.runner.abort(seq)
                self._wake.set()
            if self.metrics is not None:
                self.metrics.observe_request("Generate", code, time.perf_counter() - started)

    def _submit(self, request):
        info = self.engine.info
        if info.task != "generate":
            raise InputError(f"Generate needs a causal LM; {info.model_name} is served for {info.task}")
        wire.check_known_fields(request, "GenerateRequest")
        ids = wire.int32_bytes(request.prompt_ids, "prompt_ids")
        if ids.size == 0:
            raise InputError("prompt_ids is empty; a prompt needs at least one token")
        bad = (ids < 0) | (ids >= info.vocab_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"prompt token {i} is {int(ids[i])}, outside the vocabulary [0, {info.vocab_size})")
        stops = wire.int32_bytes(request.stop_token_ids, "stop_token_ids").tolist()
        queue: asyncio.Queue = asyncio.Queue()
        seq = self.engine.runner.submit(ids.tolist(), request.max_tokens, stops, ignore_eos=request.ignore_eos,
                                        payload=(asyncio.get_running_loop(), queue))
        self._start()
        self._wake.set()
        return seq, queue

    # -- the stepping thread -----------------------------------------------------------------
    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="florist-generate", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        generator = self.engine.runner
        while not self._closing:
            if not generator.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                stepped = [(s, s.output[-1], s.finish_reason) for s in generator.step()]
            except Exception as e:  # fail what is running; the thread keeps serving new requests
                log.exception("a generation step failed; failing its sequences")
                stepped = [(s, e, None) for s in generator.fail_all()]
            by_loop: dict = {}
            for seq, token, finish in stepped:
                if seq.payload is not None:  # None: a sequence of the embedded API
                    loop, queue = seq.payload
                    by_loop.setdefault(loop, []).append((queue, token if isinstance(token, BaseException) else (token, finish)))
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # that loop is closed: its server is gone
                    pass

    async def close(self, timeout_s: float) -> None:
        """Stop after the step running, if any, and wait for the thread to end (join_thread)."""
        self._closing = True
        self._wake.set()
        if self._thread is not None and not await join_thread(self._thread, timeout_s):
            log.warning("the generation thread is still stepping %.0f s after stop; leaving it", timeout_s)


def _deliver(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
