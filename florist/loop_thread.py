"""An async service on its own event loop in a background thread (tests, benchmarks, notebooks).

Subclasses say how to start the service (`_start`, a coroutine returning the running object) and
how to stop it (`_stop`); starting waits until the service serves, and re-raises its start-up error.
"""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    def __init__(self, name: str):
        self.running = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name=name, daemon=True)

    async def _start(self):
        raise NotImplementedError

    async def _stop(self, running) -> None:
        await running.stop()

    def start(self):
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.running = await self._start()
        except BaseException as e:  # handed to the starting thread, which re-raises it
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        await self._stopping.wait()
        await self._stop(self.running)
