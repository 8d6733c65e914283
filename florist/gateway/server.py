"""Starting and stopping one gateway (one process's event loop; `florist serve` may run several).

    running = await start_gateway(config)   # engines probed, tokenizer loaded, port bound
    ... running.port ...
    await running.stop()

`run_gateway(config)` is the blocking form for a worker process (uvloop when importable, stops
on SIGINT / SIGTERM); `GatewayThread` runs one on a background thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from florist.busy_poll import keep_turning, linger_seconds
from florist.gateway.app import make_app
from florist.gateway.balancer import Balancer
from florist.gateway.config import GatewayConfig
from florist.gateway.dispatch import ChunkLimits, Dispatcher
from florist.gateway.metrics import GatewayMetrics
from florist.gateway.pipeline import Pipeline
from florist.gateway.tokenization import Tokenization, load_text_processor
from florist.gcfreeze import freeze_startup_objects
from florist.loop_thread import LoopThread
from florist.server.client import InferenceClient


# aiohttp's access log fields: client address, request line, status, response bytes, seconds taken.
ACCESS_LOG_FORMAT = '%a "%r" %s %b bytes %Tf s'


class RunningGateway:
    def __init__(self, runner: web.AppRunner, pipeline: Pipeline, port: int, busy_poll: asyncio.Task | None = None):
        self.runner, self.pipeline, self.port, self.busy_poll = runner, pipeline, port, busy_poll

    async def stop(self) -> None:
        if self.busy_poll is not None:
            self.busy_poll.cancel()
        await self.runner.cleanup()
        await self.pipeline.balancer.close()
        self.pipeline.tokenization.close()


async def start_gateway(config: GatewayConfig, client_factory: Callable[[str], InferenceClient] | None = None) -> RunningGateway:
    """`client_factory(address)`: the client of each engine replica (default: `InferenceClient`,
    gRPC or the engine's local socket; `florist serve --in-process`: florist.server.inprocess)."""
    metrics = GatewayMetrics()
    pipeline: Pipeline | None = None

    def lone_request() -> bool:  # busy poll: an engine reply is polled for only while its request is the only one
        return pipeline is not None and pipeline.in_flight <= 1

    client_factory = client_factory or functools.partial(InferenceClient, local=config.local_socket, spin_ms=config.reply_spin, spin_if=lone_request)
    balancer = Balancer(config.engines, interval_s=config.health_interval_s, on_change=metrics.replica_changed, client_factory=client_factory)
    try:
        info = await balancer.start(config.startup_timeout_s)
        processor = load_text_processor(info, config.model)
    except BaseException:
        await balancer.close()
        raise
    limits = ChunkLimits(
        max_seqs=config.chunk_seqs or info.max_batch_sequences or 256,
        # NOTE: a chunk over the engine's max_pending_tokens would be refused outright.
        max_tokens=min(config.chunk_tokens or info.max_batch_tokens or 16384, info.max_pending_tokens or 1 << 62),
        min_tokens=config.min_chunk_tokens,
    )
    dispatcher = Dispatcher(balancer, limits, timeout_s=config.request_timeout_s, retry_after_s=config.retry_after_s, metrics=metrics)
    pipeline = Pipeline(info, Tokenization(processor, config.tokenization_workers, inline_chars=config.inline_tokenize_chars), dispatcher, config, metrics)
    access = dict(access_log=logging.getLogger("florist.access"), access_log_format=ACCESS_LOG_FORMAT) if config.access_log else dict(access_log=None)
    runner = web.AppRunner(make_app(pipeline), handler_cancellation=True, **access)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None, backlog=2048)
    try:
        await site.start()
    except OSError as e:
        await RunningGateway(runner, pipeline, 0).stop()
        raise OSError(f"cannot listen on {config.host}:{config.port} ({e.strerror}); pick another --port") from None
    port = runner.addresses[0][1]
    # GatewayConfig.busy_poll: the loop turns while no request is in flight; busy_poll_linger_ms:
    # for that long after the last one (florist/busy_poll.py).
    linger_s = linger_seconds(config.busy_poll, config.busy_poll_linger_ms, info.device.startswith("cuda"))
    spinner = asyncio.get_running_loop().create_task(keep_turning(pipeline.idle, linger_s=linger_s), name="florist-gateway-busy-poll") if linger_s > 0 else None
    return RunningGateway(runner, pipeline, port, spinner)


def run_loop(main) -> None:
    """asyncio.run(main), on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def serve_until_signal(config: GatewayConfig, on_ready: Callable[[RunningGateway], None], also: Callable[[], asyncio.Future] | None = None,
                             client_factory: Callable[[str], InferenceClient] | None = None) -> None:
    """Serve until SIGINT / SIGTERM (or until `also()` finishes, e.g. a supervisor giving up)."""
    running = await start_gateway(config, client_factory)
    freeze_startup_objects()  # a worker's start-up objects stay for good: no full-GC pauses later
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    on_ready(running)
    waiters = [asyncio.ensure_future(stop.wait())] + ([asyncio.ensure_future(also())] if also else [])
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await running.stop()


class GatewayThread(LoopThread):
    """A gateway on its own event loop in a background thread.

        with GatewayThread(GatewayConfig(engines=(srv.address,), port=0)) as gw:
            ... http://127.0.0.1:{gw.port} ...
    """

    def __init__(self, config: GatewayConfig):
        super().__init__("florist-gateway")
        self.config = config

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def _start(self) -> RunningGateway:
        return await start_gateway(self.config)
