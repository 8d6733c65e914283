"""An async service on its own event loop in a background thread (tests, benchmarks, notebooks).

Subclasses say how to start the service (`_start`, a coroutine returning the running object) and
how to stop it (`_stop`); starting waits until the service serves, and re-raises its start-up error.

`join_thread` waits from an event loop for a worker thread to end: servers join theirs at stop.
"""

from __future__ import annotations

import asyncio
import threading
import time


async def join_thread(thread: threading.Thread, timeout_s: float) -> bool:
    """Wait for `thread` to end without blocking the event loop; False if it still runs after
    `timeout_s`. A daemon thread still running when the interpreter finalizes is ended where it
    next takes the GIL; a server's worker ended so inside torch (freeing its last batch's tensor
    as its frame is cleared) aborted the whole process at exit ("terminate called without an
    active exception", SIGABRT). Joined at stop, it ends while the interpreter is whole."""
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.002)
    return True


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
