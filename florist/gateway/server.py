"""Starting and stopping one gateway (one process's event loop; `florist serve` may run several).

    running = await start_gateway(config)   # engines probed, tokenizer loaded, port bound
    ... running.port ...
    await running.stop()

`run_gateway(config)` is the blocking form for a worker process (uvloop when importable, stops
on SIGINT / SIGTERM); `GatewayThread` runs one on a background thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

from aiohttp import web

from florist.gateway.app import make_app
from florist.gateway.balancer import Balancer
from florist.gateway.config import GatewayConfig
from florist.gateway.dispatch import ChunkLimits, Dispatcher
from florist.gateway.metrics import GatewayMetrics
from florist.gateway.pipeline import Pipeline
from florist.gateway.tokenization import Tokenization, load_text_processor


class RunningGateway:
    def __init__(self, runner: web.AppRunner, pipeline: Pipeline, port: int):
        self.runner, self.pipeline, self.port = runner, pipeline, port

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.pipeline.balancer.close()
        self.pipeline.tokenization.close()


async def start_gateway(config: GatewayConfig) -> RunningGateway:
    metrics = GatewayMetrics()
    balancer = Balancer(config.engines, interval_s=config.health_interval_s, on_change=metrics.replica_changed)
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
    pipeline = Pipeline(info, Tokenization(processor, config.tokenization_workers), dispatcher, config, metrics)
    runner = web.AppRunner(make_app(pipeline), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port or None, backlog=2048)
    try:
        await site.start()
    except OSError as e:
        await RunningGateway(runner, pipeline, 0).stop()
        raise OSError(f"cannot listen on {config.host}:{config.port} ({e.strerror}); pick another --port") from None
    port = runner.addresses[0][1]
    return RunningGateway(runner, pipeline, port)


def run_loop(main) -> None:
    """asyncio.run(main), on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def serve_until_signal(config: GatewayConfig, on_ready: Callable[[RunningGateway], None], also: Callable[[], asyncio.Future] | None = None) -> None:
    """Serve until SIGINT / SIGTERM (or until `also()` finishes, e.g. a supervisor giving up)."""
    running = await start_gateway(config)
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


class GatewayThread:
    """A gateway on its own event loop in a background thread.

        with GatewayThread(GatewayConfig(engines=(srv.address,), port=0)) as gw:
            ... http://127.0.0.1:{gw.port} ...
    """

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.running: RunningGateway | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="florist-gateway", daemon=True)

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join()

    async def _serve(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.running = await start_gateway(self.config)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        await self._stopping.wait()
        await self.running.stop()
