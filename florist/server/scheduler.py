"""Which pending sequences run next: first come, first served under a token budget.

Plain Python with no torch (and no numpy) import, so the policy is tested without a device.

    add(r1: 3 seqs)  add(r2: 1 seq)  add(r3: 2 seqs)
    queue:  r1.0  r1.1  r1.2  r2.0  r3.0  r3.1        (arrival order, one entry per sequence)
    next_batch() takes from the head while the batch stays within max_batch_tokens and
    max_batch_seqs; it never skips ahead, so a later short sequence cannot overtake an earlier
    long one. A sequence longer than the whole budget runs alone (it must never wait forever).

A request is finished when all its sequences have come back (`complete`). `cancel` and an
expired deadline drop a request's queued sequences; results of its sequences already running are
ignored. Backpressure: `add` refuses a request that would push the queued tokens past
max_pending_tokens (the service answers RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

QUEUED, DONE, CANCELLED, EXPIRED = "queued", "done", "cancelled", "expired"


class Overloaded(Exception):
    """The pending-token bound is reached; the message says by how much."""


class Request:
    """The scheduler's view of one RPC. `payload` is the caller's (ids, options, results)."""

    __slots__ = ("seq_lens", "num_tokens", "deadline", "state", "queued_tokens", "queued_seqs", "unfinished", "payload")

    def __init__(self, seq_lens: Sequence[int], deadline: float | None = None, payload: Any = None):
        if not seq_lens or min(seq_lens) < 1:
            raise ValueError("a request needs at least one sequence, each of at least one token")
        self.seq_lens = list(seq_lens)
        self.num_tokens = sum(self.seq_lens)
        self.deadline = deadline  # on the scheduler's clock (time.monotonic by default)
        self.payload = payload
        self.state = QUEUED  # until done, cancelled or expired ("live" while QUEUED)
        self.queued_tokens = self.queued_seqs = 0  # not yet handed out in a batch
        self.unfinished = len(self.seq_lens)  # handed out or queued, result not yet back

    @property
    def live(self) -> bool:
        return self.state == QUEUED


@dataclass
class Batch:
    """Sequences to run together, in queue order: (request, index of the sequence in it)."""

    seqs: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, max_batch_tokens: int, max_batch_seqs: int, max_pending_tokens: int, clock: Callable[[], float] = time.monotonic):
        if min(max_batch_tokens, max_batch_seqs, max_pending_tokens) < 1:
            raise ValueError("max_batch_tokens, max_batch_seqs and max_pending_tokens must be >= 1")
        self.max_batch_tokens, self.max_batch_seqs = max_batch_tokens, max_batch_seqs
        self.max_pending_tokens, self.clock = max_pending_tokens, clock
        self._queue: deque[tuple[Request, int]] = deque()
        self._dead = 0  # queue entries of cancelled / expired requests, skipped when reached
        self.pending_tokens = self.pending_seqs = 0
        self._expired: list[Request] = []

    def add(self, req: Request) -> None:
        if self.pending_tokens + req.num_tokens > self.max_pending_tokens:
            raise Overloaded(
                f"the server is overloaded: {self.pending_tokens} tokens are already queued, this request adds "
                f"{req.num_tokens}, the bound is {self.max_pending_tokens}; retry later or send to another replica"
            )
        self._queue.extend((req, i) for i in range(len(req.seq_lens)))
        req.queued_tokens, req.queued_seqs = req.num_tokens, len(req.seq_lens)
        self.pending_tokens += req.num_tokens
        self.pending_seqs += len(req.seq_lens)

    def has_pending(self) -> bool:
        return self.pending_seqs > 0

    def next_batch(self) -> Batch | None:
        """Sequences from the head of the queue, first come first served, within the budget.
        Requests found past their deadline are dropped first (see `take_expired`)."""
        batch = Batch()
        now = None
        while self._queue:
            req, i = self._queue[0]
            if not req.live:
                self._queue.popleft()
                self._dead -= 1
                continue
            if req.deadline is not None:
                now = self.clock() if now is None else now
                if now >= req.deadline:
                    self._drop(req, EXPIRED)
                    self._expired.append(req)
                    continue
            n = req.seq_lens[i]
            if batch.seqs and (batch.num_tokens + n > self.max_batch_tokens or batch.num_seqs + 1 > self.max_batch_seqs):
                break
            self._queue.popleft()
            batch.seqs.append((req, i))
            batch.num_tokens += n
            req.queued_tokens -= n
            req.queued_seqs -= 1
            self.pending_tokens -= n
            self.pending_seqs -= 1
            if batch.num_tokens >= self.max_batch_tokens:  # full (or a lone over-long sequence)
                break
        return batch if batch.seqs else None

    def take_expired(self) -> list[Request]:
        """Requests dropped for their deadline since the last call; the caller fails them."""
        out, self._expired = self._expired, []
        return out

    def complete(self, batch: Batch) -> list[Request]:
        """Record that `batch`'s results are back; returns the requests now finished, in order.
        Requests cancelled or expired meanwhile are not returned."""
        finished = []
        for req, _ in batch.seqs:
            req.unfinished -= 1
            if req.unfinished == 0 and req.live:
                req.state = DONE
                finished.append(req)
        return finished

    def cancel(self, req: Request) -> None:
        """Drop a request (the client went away); its queued sequences will never run."""
        if req.live:
            self._drop(req, CANCELLED)

    def _drop(self, req: Request, state: str) -> None:
        req.state = state
        self.pending_tokens -= req.queued_tokens
        self.pending_seqs -= req.queued_seqs
        self._dead += req.queued_seqs
        req.queued_tokens = req.queued_seqs = 0
        # NOTE: dead entries are skipped lazily (cancel is O(1)); compact when they dominate, so
        # a flood of cancelled requests cannot grow the queue without bound.
        if self._dead > 64 and self._dead > len(self._queue) // 2:
            self._queue = deque(e for e in self._queue if e[0].live)
            self._dead = 0
