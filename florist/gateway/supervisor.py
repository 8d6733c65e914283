"""`florist serve` at run time: start the engines, run the gateway worker(s), stop it all.

    engines: started in parallel, each awaited until it listens (its Health then answers)
    workers == 1: the gateway runs on this process's event loop, which also watches the engines
    workers  > 1: worker processes (spawned) share the port with SO_REUSEPORT; this process only
                  supervises: a dead engine is restarted, a dead worker stops everything
    --in-process: no engine processes: the engine is loaded here and the one gateway calls its
                  server's handlers on the same event loop (serve_engine_in_process)
    stop (SIGINT / SIGTERM): gateway workers first (no new requests), then the engines
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from florist.gateway.config import GatewayConfig
from florist.gateway.processes import EngineProcess, die_with_parent, engine_env, plan_devices, terminate

log = logging.getLogger("florist.serve")
ENGINE_START_TIMEOUT_S = 1800.0  # large models load (and warm up) for minutes


def serve(config: GatewayConfig, *, workers: int, engine_args: list[str], device: str | None, replicas: int | None, tensor_parallel: int = 1) -> int:
    engines: list[EngineProcess] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # until the gateway installs its own
    try:
        if not config.engines:
            devices = plan_devices(device, replicas, tensor_parallel)
            env = engine_env(devices)
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            engines = [EngineProcess(i, engine_args, d, env) for i, d in enumerate(devices)]
            for e in engines:
                e.start()
            for e in engines:
                e.wait_ready(ENGINE_START_TIMEOUT_S)
                print(f"florist serve: engine replica {e.index} (pid {e.proc.pid}, {e.device}) on {e.address}", flush=True)
            config = dataclasses.replace(config, engines=tuple(e.address for e in engines))
        if workers == 1:
            return _serve_in_process(config, engines)
        return _serve_workers(config, workers, engines)
    except KeyboardInterrupt:
        return 0
    finally:
        terminate([e.proc for e in engines if e.proc is not None], 15.0)
        signal.signal(signal.SIGTERM, previous)


def serve_engine_in_process(config: GatewayConfig, load_engine: Callable[[], object], server_config) -> int:
    """`florist serve --in-process`: `load_engine()` (load and warm up) here, then the gateway and
    the engine's batcher on this process's one event loop, the gateway calling the service
    directly (florist/server/inprocess.py). Stops on SIGINT / SIGTERM; nothing to restart."""
    from florist.gateway.server import run_loop, serve_until_signal
    from florist.server.inprocess import ADDRESS, InProcessClient, start_in_process

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # until the gateway installs its own
    try:
        engine = load_engine()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    config = dataclasses.replace(config, engines=(ADDRESS,))

    async def main() -> None:
        server = await start_in_process(engine, server_config)
        try:
            def on_ready(running) -> None:
                running.pipeline.metrics.include(getattr(server.metrics, "registry", None))  # the engine's queue and batches on /metrics
                _announce(running.pipeline.info.model_name, config, running.port, 1)

            await serve_until_signal(config, on_ready, client_factory=lambda address: InProcessClient(server.service))
        finally:
            await server.stop(grace=None)

    try:
        run_loop(main())
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _announce(model: str, config: GatewayConfig, port: int, workers: int) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    # NOTE: tests and scripts read the URL from this line; keep "on http://HOST:PORT".
    print(f"florist serve: {model} on http://{host}:{port} ({workers} gateway worker{'s' if workers > 1 else ''}, "
          f"engines {', '.join(config.engines)})", flush=True)


def _serve_in_process(config: GatewayConfig, engines: list[EngineProcess]) -> int:
    from florist.gateway.server import run_loop, serve_until_signal

    async def watch_engines():
        while True:
            await asyncio.sleep(0.5)
            for e in engines:
                e.check()

    def on_ready(running) -> None:
        _announce(running.pipeline.info.model_name, config, running.port, 1)

    run_loop(serve_until_signal(config, on_ready, also=watch_engines if engines else None))
    return 0


def _worker_main(config: GatewayConfig, ready, index: int, parent_pid: int) -> None:
    from florist.gateway.server import run_loop, serve_until_signal

    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    try:
        run_loop(serve_until_signal(config, lambda running: ready.put(("ready", running.pipeline.info.model_name))))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        ready.put(("error", f"gateway worker {index}: {e}"))
        sys.exit(1)


def _reserve_port(host: str) -> tuple[socket.socket, int]:
    """An OS-chosen port every worker can bind with SO_REUSEPORT. The reserving socket never
    listens, so it takes no connections; it only holds the number until the workers have it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, 0))
    return s, s.getsockname()[1]


def _serve_workers(config: GatewayConfig, n: int, engines: list[EngineProcess]) -> int:
    reservation = None
    if config.port == 0:
        reservation, port = _reserve_port(config.host)
        config = dataclasses.replace(config, port=port)
    metrics_dir = tempfile.mkdtemp(prefix="florist-metrics-")
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers only
    procs = [ctx.Process(target=_worker_main, args=(config, ready, k, os.getpid()), name=f"florist-gateway-{k}") for k in range(n)]
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        waiting, model = n, ""
        while waiting:
            try:
                kind, value = ready.get(timeout=0.2)
            except queue.Empty:
                if stop.is_set():
                    return 0
                if any(not p.is_alive() for p in procs):
                    raise RuntimeError("a gateway worker exited while starting; its errors are above")
                continue
            if kind == "error":
                raise RuntimeError(value)
            waiting, model = waiting - 1, value
        if reservation is not None:
            reservation.close()
        _announce(model, config, config.port, n)
        while not stop.wait(0.5):
            for e in engines:
                e.check()
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                log.error("gateway worker %s exited with code %s; stopping", dead[0].name, dead[0].exitcode)
                return 1
        return 0
    finally:
        terminate(procs, 10.0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if reservation is not None:
            reservation.close()
