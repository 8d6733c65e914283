"""Busy poll: keep an event loop turning while its service is idle (engine server, gateway).

Between requests an event loop sleeps in epoll and its core may go idle; waking both costs a
request latency. `keep_turning` is a task that is always ready while `idle` is set, so the loop
polls its sockets without a timeout and the next request reaches a running loop on a busy core.
While the service has work it waits: the loop and the GIL belong to that work then (threads that
tokenize, park a batch's wait, or run generation need the GIL the turning loop holds).
"""

from __future__ import annotations

import asyncio
from typing import Callable


async def keep_turning(idle: asyncio.Event, nap_s: Callable[[], float] = lambda: 0.0) -> None:
    """Turn the loop while `idle` is set; each turn sleeps `nap_s()` seconds (0: none)."""
    while True:
        await idle.wait()
        await asyncio.sleep(nap_s())
