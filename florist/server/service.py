"""The gRPC servicer (grpc.aio) and server start-up.

A request's path: decode and check the flat ids (wire.py) -> the batcher queues its sequences
and hands back the raw model rows -> the request's own options (dimensions, normalize,
encoding, raw scores) are applied with the same functions the embedded API uses
(florist.engine.output), so a server response equals `Engine.embed` / `Engine.score` output for
the same ids. Errors map to status codes once, here:

    InputError (bad ids, lengths, options, wrong task)   INVALID_ARGUMENT
    Overloaded (pending-token bound reached)             RESOURCE_EXHAUSTED
    DeadlineExpired (deadline passed while queued)       DEADLINE_EXCEEDED
    an engine failure                                    INTERNAL
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np

from florist.busy_poll import keep_turning, linger_seconds
from florist.engine.output import check_output_options, finalize_embeddings, finalize_scores
from florist.loop_thread import LoopThread
from florist.server import proto, wire
from florist.server.batcher import STOP_TIMEOUT_S, Batcher, DeadlineExpired
from florist.server.config import ServerConfig
from florist.server.generate import GenerateHandler
from florist.server.local import LocalServer, auto_path, remove_stale_sockets
from florist.server.metrics import ServerMetrics, make_metrics
from florist.server.scheduler import Overloaded, Scheduler
from florist.text import InputError

log = logging.getLogger(__name__)

# Request messages are bounded by max_pending_tokens (12 bytes per token at most: id, and per
# sequence a length and a first-segment length); responses are not bounded here.
_MESSAGE_SLACK_BYTES = 1 << 20
# sys.setswitchinterval under ServerConfig.busy_poll (see start_server).
BUSY_POLL_SWITCH_S = 0.0002


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class InferenceService:
    def __init__(self, engine, batcher: Batcher, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.batcher, self.config, self.metrics = engine, batcher, config, metrics
        self.info = engine.info
        self.serving = True
        self._info_response = self._make_info()
        self.generation = GenerateHandler(engine, metrics)  # the Generate RPC (causal LMs)

    def _make_info(self):
        i = self.info
        sha = hashlib.sha256(Path(i.tokenizer).read_bytes()).hexdigest() if Path(i.tokenizer).is_file() else ""
        return proto.InfoResponse(
            model_name=i.model_name, family=i.family, task=i.task, dimensions=i.dimensions,
            max_input_tokens=i.max_input_tokens, vocab_size=i.vocab_size, dtype=i.dtype, device=i.device,
            pooling=list(i.pooling), normalize=i.normalize,
            prompts=[proto.Prompt(name=k, text=v) for k, v in i.prompts.items()],
            default_prompt_name=i.default_prompt_name or "", score_activation=i.score_activation,
            native_int8=i.native_int8, tokenizer=i.tokenizer, tokenizer_sha256=sha,
            max_batch_tokens=self.config.max_batch_tokens, max_batch_sequences=self.config.max_batch_seqs,
            max_pending_tokens=self.config.max_pending_tokens,
        )

    # -- RPCs ----------------------------------------------------------------------------------
    async def Embed(self, request, context):
        return await self._handle("Embed", self._embed, request, context)

    async def Score(self, request, context):
        return await self._handle("Score", self._score, request, context)

    async def Generate(self, request, context):
        """Server streaming: see florist/server/generate.py."""
        async for chunk in self.generation.stream(request, context):
            yield chunk

    async def Health(self, request, context):
        entered = time.monotonic_ns() if self.config.timing_metadata else 0
        status = proto.HealthResponse.SERVING if self.serving else proto.HealthResponse.NOT_SERVING
        s = self.batcher.scheduler
        response = proto.HealthResponse(status=status, pending_sequences=s.pending_seqs, pending_tokens=s.pending_tokens, batches_in_flight=len(self.batcher.in_flight))
        if entered:
            _set_timing(context, entered)
        return response

    async def Info(self, request, context):
        return self._info_response

    def advertise_local_socket(self, path: str) -> None:
        """Info names the local socket, for clients on this host (florist/server/local.py)."""
        self._info_response.local_socket = path

    # -- implementation ------------------------------------------------------------------------
    async def _handle(self, method: str, impl, request, context):
        entered = time.monotonic_ns() if self.config.timing_metadata else 0
        started, code = time.perf_counter(), "OK"
        try:
            response = await impl(request, context)
            if entered:
                _set_timing(context, entered)
            return response
        except _Abort as e:
            code = e.code.name
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception:
            code = "UNKNOWN"
            raise
        finally:
            self.metrics.observe_request(method, code, time.perf_counter() - started)

    async def _embed(self, request, context):
        i = self.info
        try:
            self._require("embed", "Embed", "Score")
            wire.check_known_fields(request, "EmbedRequest")
            ids, lens = self._tokens(request.tokens)
            if request.dimensions < 0:
                raise InputError(f"dimensions must be >= 1 (0 means the model's full size {i.dimensions}); got {request.dimensions}")
            dimensions = request.dimensions or None
            encoding = request.encoding or "float"
            check_output_options(i.dimensions, dimensions, encoding, i.native_int8)
        except InputError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        normalize = request.normalize if request.HasField("normalize") else i.normalize
        rows = await self._run(ids, lens, None, context)
        out = finalize_embeddings(rows, dimensions=dimensions, normalize=normalize, encoding=encoding)
        response = proto.EmbedResponse(num_tokens=ids.size)
        wire.fill_matrix(response.embeddings, out)
        return response

    async def _score(self, request, context):
        try:
            self._require("score", "Score", "Embed")
            wire.check_known_fields(request, "ScoreRequest")
            ids, lens = self._tokens(request.tokens)
            first = wire.decode_first_segment_lens(request.first_segment_lens, lens)
        except InputError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        rows = await self._run(ids, lens, first, context)
        out = finalize_scores(rows, self.info.score_activation, raw=request.raw)
        response = proto.ScoreResponse(num_tokens=ids.size)
        wire.fill_matrix(response.scores, np.asarray(out, dtype=np.float32))
        return response

    def _require(self, task: str, method: str, other: str) -> None:
        if self.info.task != task:
            what = {"embed": "an embedding model", "score": "a cross-encoder or reranker"}[task]
            hint = f": call {other}" if self.info.task in ("embed", "score") else ""
            raise InputError(f"{method} needs {what}; {self.info.model_name} is served for {self.info.task}{hint}")

    def _tokens(self, tokens):
        wire.check_known_fields(tokens, "TokenBatch")
        ids, lens = wire.decode_tokens(tokens, vocab_size=self.info.vocab_size, max_seq_len=self.info.max_input_tokens)
        if ids.size > self.config.max_pending_tokens:
            raise InputError(
                f"the request has {ids.size} tokens, more than this server ever queues (max_pending_tokens = "
                f"{self.config.max_pending_tokens}); split it into smaller requests"
            )
        return ids, lens

    async def _run(self, ids, lens, first, context) -> np.ndarray:
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            return await self.batcher.run(ids, lens, first, deadline)
        except Overloaded as e:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except DeadlineExpired as e:
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from None
        except RuntimeError as e:
            raise _Abort(grpc.StatusCode.INTERNAL, str(e)) from None


TIMING_KEY = "x-florist-timing"


def _set_timing(context, entered_ns: int) -> None:
    """Trailing metadata "ENTRY EXIT": the handler's entry and exit, time.monotonic_ns()."""
    context.set_trailing_metadata(((TIMING_KEY, f"{entered_ns} {time.monotonic_ns()}"),))


class RunningServer:
    """A started server on the current event loop: `port` (None without gRPC), `stop()`, `wait_for_termination()`."""

    def __init__(self, server, service: InferenceService, batcher: Batcher, port: int | None, metrics: ServerMetrics, metrics_http=None,
                 busy_poll: asyncio.Task | None = None, local: LocalServer | None = None, switch_interval: float | None = None):
        self.server, self.service, self.batcher, self.port = server, service, batcher, port
        self.metrics, self.metrics_http, self.busy_poll, self.local = metrics, metrics_http, busy_poll, local
        self.switch_interval = switch_interval  # sys.getswitchinterval() before the server lowered it (restored at stop)

    @property
    def local_socket(self) -> str | None:
        """The Unix socket of the local transport, if the server has one."""
        return self.local.path if self.local is not None else None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_http.server_port if self.metrics_http is not None else None

    async def stop(self, grace: float | None = 1.0) -> None:
        self.service.serving = False
        if self.local is not None:
            await self.local.close()
        if self.server is not None:
            await self.server.stop(grace)
        if self.busy_poll is not None:
            self.busy_poll.cancel()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        await self.service.generation.close(STOP_TIMEOUT_S)
        await self.batcher.stop()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()

    async def wait_for_termination(self) -> None:
        if self.server is None:
            raise RuntimeError("this server has no gRPC port to wait on (ServerConfig.port=None); stop() it")
        await self.server.wait_for_termination()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def batch_token_budget(engine, max_batch_tokens: int | None) -> int:
    """A batch's token budget: the one given, else the largest batch the engine replays from a
    CUDA graph, else 16384."""
    if max_batch_tokens is not None:
        return max_batch_tokens
    return getattr(engine, "graph_max_tokens", None) or 16384


# While a batch runs on a GPU, the next one is launched this long before the running one is due
# back (florist/server/batcher.py). Scenario 4 on the H200 (docs/benchmarks.md): 0.8 ms gave the
# largest batches without leaving the device idle, against 1.5 ms and launching at once.
DEFAULT_LAUNCH_AHEAD_MS = 0.8


def lower_switch_interval() -> float:
    """Lower Python's switch interval to BUSY_POLL_SWITCH_S (if above) and return what it was, for
    `RunningServer.switch_interval`: a loop that turns without blocking holds the GIL, and a thread
    waiting for it gets it only after the interval."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, BUSY_POLL_SWITCH_S))
    return previous


def launch_ahead_s(engine, config: ServerConfig) -> float:
    """The batcher's launch-ahead time in seconds: the one given, else DEFAULT_LAUNCH_AHEAD_MS on
    a GPU engine and none (launch at once) on a CPU one, whose batches run in a worker thread."""
    if config.launch_ahead_ms is not None:
        if not config.launch_ahead_ms >= 0:
            raise ValueError(f"launch_ahead_ms must be >= 0 (inf: launch at once); got {config.launch_ahead_ms}")
        return config.launch_ahead_ms / 1e3
    return DEFAULT_LAUNCH_AHEAD_MS / 1e3 if str(engine.info.device).startswith("cuda") else math.inf


async def start_server(engine, config: ServerConfig = ServerConfig()) -> RunningServer:
    """Start serving `engine` on the running event loop."""
    if config.local_socket and config.port is None:
        raise ValueError("a local socket is advertised through the gRPC Info call: it needs a gRPC port")
    config = replace(config, max_batch_tokens=batch_token_budget(engine, config.max_batch_tokens))
    metrics = make_metrics()
    scheduler = Scheduler(config.max_batch_tokens, config.max_batch_seqs, config.max_pending_tokens)
    batcher = Batcher(engine, scheduler, metrics, max_in_flight=config.max_in_flight, launch=config.launch, spin_s=config.spin_ms / 1e3,
                      launch_ahead_s=launch_ahead_s(engine, config))
    metrics.watch(lambda: scheduler.pending_seqs, lambda: scheduler.pending_tokens, lambda: len(batcher.in_flight))
    service = InferenceService(engine, batcher, config, metrics)
    max_request = 12 * config.max_pending_tokens + _MESSAGE_SLACK_BYTES
    server, port = None, None
    if config.port is not None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_request), ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
        proto.add_servicer(server, service)
        port = server.add_insecure_port(_hostport(config.host, config.port))
        if port == 0:
            raise OSError(f"cannot listen on {_hostport(config.host, config.port)} (in use?); pick another --port")
    batcher.start()
    if server is not None:
        await server.start()
    local = None
    if config.local_socket:
        path = config.local_socket
        if path == "auto":
            path = auto_path(port)
            remove_stale_sockets(os.path.dirname(path))
        local = LocalServer(service, path, max_request)
        try:
            await local.start()
        except OSError:
            await server.stop(None)
            await batcher.stop()
            raise
        service.advertise_local_socket(local.path)
    metrics_http = metrics.serve(config.metrics_port, config.host) if config.metrics_port is not None else None
    spinner, switch_interval = None, None
    on_gpu = str(engine.info.device).startswith("cuda")
    # A causal LM's server lingers only when told to: its generation runs beside an idle batcher,
    # and the lowered switch interval below has not been measured against its decode steps.
    linger_s = linger_seconds(config.busy_poll, config.busy_poll_linger_ms, on_gpu and engine.info.task != "generate")
    if linger_s > 0:
        if not on_gpu:
            log.warning("busy poll on a %s engine: the spinning event loop takes the CPU (and the GIL) the model runs on, "
                        "so batches get slower; it is meant for GPU engines", engine.info.device)
        # The turning loop holds the GIL between turns; a thread that needs it (grpc's poller, the
        # thread a batch's wait is parked on) gets it only when the holder is asked to drop it,
        # after the switch interval (5 ms by default). With that default, busy poll stalled
        # requests under load for up to 2 s (docs/benchmarks.md).
        switch_interval = lower_switch_interval()  # restored at stop
        # Idle: nothing queued or running (spinning while batches ran slowed the intake of bursts,
        # docs/benchmarks.md). While Generate streams are open it naps 1 ms a turn: the generation
        # thread needs the GIL every step.
        generation = service.generation
        spinner = asyncio.get_running_loop().create_task(keep_turning(batcher.idle, lambda: 0.001 if generation.active else 0.0, linger_s),
                                                          name="florist-busy-poll")
    return RunningServer(server, service, batcher, port, metrics, metrics_http, spinner, local, switch_interval)


class ServerThread(LoopThread):
    """A server on its own event loop in a background thread (tests, benchmarks, notebooks).

        with ServerThread(engine, ServerConfig(port=0)) as srv:
            ... InferenceClient(srv.address) ...
    """

    def __init__(self, engine, config: ServerConfig = ServerConfig(port=0)):
        super().__init__("florist-server")
        self.engine, self.config = engine, config

    @property
    def address(self) -> str:
        return _hostport(self.config.host, self.running.port)

    async def _start(self) -> RunningServer:
        return await start_server(self.engine, self.config)

    async def _stop(self, running: RunningServer) -> None:
        await running.stop(grace=0.5)
