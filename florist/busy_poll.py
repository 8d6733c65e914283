"""Busy poll: keep an event loop turning while its service is idle (engine server, gateway).

Between requests an event loop sleeps in epoll and its core may go idle; waking both costs a
request latency. `keep_turning` is a task that is always ready while `idle` is set, so the loop
polls its sockets without a timeout and the next request reaches a running loop on a busy core.
While the service has work it waits: the loop and the GIL belong to that work then (threads that
tokenize, park a batch's wait, or run generation need the GIL the turning loop holds).

With a finite `linger_s` the loop turns only that long after the service fell idle, then sleeps
until work comes and goes again: a stream of requests finds the loop awake, and a service that
stays idle gives its core back.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

# The linger of GPU deployments without --busy-poll (engine servers and gateway workers).
DEFAULT_LINGER_MS = 20.0


def linger_seconds(busy_poll: bool, linger_ms: float | None, on_gpu: bool) -> float:
    """How long a service's loop turns after it fell idle: for ever with busy_poll, else
    `linger_ms` (None: DEFAULT_LINGER_MS on a GPU, 0 on the CPU, whose cores the models need)."""
    if busy_poll:
        return math.inf
    return (linger_ms if linger_ms is not None else DEFAULT_LINGER_MS if on_gpu else 0.0) / 1e3


class IdleFlag:
    """Set while a service has nothing to do: asyncio.Event's set / clear / is_set / wait, and
    `wait_busy()` for the moment it is cleared."""

    def __init__(self) -> None:
        self._idle, self._busy = asyncio.Event(), asyncio.Event()
        self._idle.set()

    def set(self) -> None:
        self._busy.clear()
        self._idle.set()

    def clear(self) -> None:
        self._idle.clear()
        self._busy.set()

    def is_set(self) -> bool:
        return self._idle.is_set()

    async def wait(self) -> None:
        await self._idle.wait()

    async def wait_busy(self) -> None:
        await self._busy.wait()


async def keep_turning(idle: IdleFlag, nap_s: Callable[[], float] = lambda: 0.0, linger_s: float = math.inf) -> None:
    """Turn the loop while `idle` is set, for up to `linger_s` after it was set (inf: for as long
    as it is); each turn sleeps `nap_s()` seconds (0: none)."""
    while True:
        await idle.wait()
        until = time.perf_counter() + linger_s
        while idle.is_set() and time.perf_counter() < until:
            await asyncio.sleep(nap_s())
        if idle.is_set():  # lingered out: sleep until the service has work, then turn again once it is idle
            await idle.wait_busy()
