"""The batching loop: form batches with the scheduler, launch them, hand results back.

    handlers ──run()──▶ Scheduler ──next_batch()──▶ HostBatch ──engine.step()──▶ LazyTensor
       ▲                                                                             │
       └──── future ◀── rows copied per request ◀── collect (oldest first) ◀─────────┘

Up to `max_in_flight` (2) batches are launched at once: while batch N runs on the device the
loop forms and launches N+1, so the device never waits for the host between batches. N+1 is not
launched the moment there is room, though, but `launch_ahead_s` before N is due back (from the
device times of earlier batches of N's size, `DeviceTimes`), unless the queue already fills a
batch: requests arriving while N runs join N+1 rather than each forming a small batch of its own
that the next ones queue behind. The device is as busy either way; larger batches get more done
per second (on the H200 a Qwen3-0.6B batch of 9 x 512 tokens embeds ~1,000 sequences a second,
one of 1 x 512 ~570). A batch size not seen before has no estimate and is launched at once.

Results are collected oldest first and copied out of the engine's host buffer before another
batch is launched (an engine may reuse its buffers). The loop runs on the server's event loop
and never blocks it. How a batch runs and is waited for is decided once, at construction:

    launch="thread"  step() and the result copy run in a worker thread: for engines whose step()
                     computes synchronously (CPU), so the event loop stays free meanwhile.
    launch="inline"  step() is called on the event loop (on CUDA it only queues work). The loop
                     then polls the oldest batch's LazyTensor.ready() between its other work
                     (yielding with sleep(0)) for up to `spin_s` after launch, and after that
                     parks the wait on a worker thread (LazyTensor.wait() releases the GIL) that
                     wakes the loop when the result is there.

Polling hands a result over within microseconds but keeps a core busy; the thread costs a
hand-off (~30-60 us on a small host) and no CPU. Short batches, where that hand-off is a
visible part of the latency, finish within the spin window; long ones (where the batch behind
keeps the device busy, so the hand-off is hidden) are parked. spin_s=0 always parks,
spin_s=inf always polls.

The idle fast path: a request that finds the server idle (nothing queued, nothing in flight) is
launched by its own handler at once, not one event-loop turn later by the loop. With
launch="inline" that handler also polls and collects its batch during the spin window, so a
lone request's result reaches it without a hop through the loop; after the window, or if the
handler is cancelled, the loop takes the batch over. Requests arriving meanwhile queue as usual.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from florist.busy_poll import IdleFlag
from florist.engine.batch import HostBatch, segment_ids
from florist.loop_thread import join_thread
from florist.server.scheduler import Batch, Request, Scheduler

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # how long stop() waits for a batch running on the engine thread


class DeadlineExpired(Exception):
    pass


class Work:
    """A request's payload: flat ids, lengths, where each sequence starts, result rows."""

    __slots__ = ("ids", "seq_lens", "starts", "first_segment_lens", "rows", "future")

    def __init__(self, ids: np.ndarray, seq_lens: np.ndarray, first_segment_lens: np.ndarray | None, future: asyncio.Future):
        self.ids, self.seq_lens, self.first_segment_lens, self.future = ids, seq_lens, first_segment_lens, future
        self.starts: list[int] = []
        self.rows: np.ndarray | None = None


class _Worker:
    """One thread that runs jobs in order and reports each result back on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str):
        self.loop = loop
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        self.jobs.put((fn, done))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, done = job
            try:
                result, error = fn(), None
            except BaseException as e:  # reported to the batch's requests, not raised here
                result, error = None, e
            try:
                self.loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop is closed: the server is shutting down
                return

    async def close(self, timeout_s: float) -> None:
        """Stop after the job running, if any, and wait for the thread to end (join_thread)."""
        self.jobs.put(None)
        if not await join_thread(self.thread, timeout_s):
            log.warning("the engine thread %s is still running a batch %.0f s after stop; leaving it", self.thread.name, timeout_s)


class _InFlight:
    __slots__ = ("batch", "lazy", "rows", "error", "done", "parked", "owned", "launched_at", "ready_at")

    def __init__(self, batch: Batch):
        self.batch, self.lazy, self.rows, self.error = batch, None, None, None
        self.done = self.parked = self.owned = False  # owned: polled by its request's handler
        self.launched_at = time.perf_counter()
        self.ready_at = 0.0  # when the loop saw its result back


def cost_key(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """Batches that take about as long on the device: tokens up to a multiple of 256, sequences
    up to a power of two (coarser than the engine's graph buckets below 1,024 tokens, where a
    batch's time hardly depends on its size, so fewer sizes go unknown)."""
    return -(-num_tokens // 256), (num_seqs - 1).bit_length()


class DeviceTimes:
    """How long batches of each size keep the device busy, learnt from the batches served: the
    time from a batch's start (its launch, or the previous batch's result, whichever is later)
    to its result, per `cost_key`. Unknown sizes have no estimate."""

    def __init__(self, weight: float = 0.25):
        self.weight = weight
        self.seconds: dict[tuple[int, int], float] = {}

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        key = cost_key(num_tokens, num_seqs)
        old = self.seconds.get(key)
        # Down at once, up slowly: a batch held by the host (an eager first sight, a capture)
        # reads long, and an estimate too long leaves the device idle while the loop holds back.
        self.seconds[key] = seconds if old is None or seconds < old else old + self.weight * (seconds - old)

    def estimate(self, num_tokens: int, num_seqs: int) -> float | None:
        return self.seconds.get(cost_key(num_tokens, num_seqs))


class Batcher:
    def __init__(self, engine, scheduler: Scheduler, metrics=None, *, max_in_flight: int = 2, launch: str | None = None, spin_s: float = 0.002,
                 launch_ahead_s: float = math.inf):
        if launch is None:
            launch = "inline" if str(engine.info.device).startswith("cuda") else "thread"
        if launch not in ("thread", "inline"):
            raise ValueError(f"launch must be 'thread' or 'inline'; got {launch!r}")
        self.engine, self.scheduler, self.metrics = engine, scheduler, metrics
        self.max_in_flight, self.launch, self.spin_s = max_in_flight, launch, spin_s
        # Launch the batch behind a running one this long before the running one should be back,
        # not at once, so that requests arriving meanwhile join it (inf: at once).
        self.launch_ahead_s = launch_ahead_s
        self.device_times = DeviceTimes()
        self._last_ready = 0.0  # when the last batch collected was back
        self._hold_timer: asyncio.TimerHandle | None = None
        self._hold_until = 0.0  # when the armed timer fires (perf_counter)
        self.with_token_types = engine.info.task == "score"
        self.in_flight: deque[_InFlight] = deque()
        self._wakeup = asyncio.Event()
        # Set while nothing is queued or running (the busy-poll task spins only then).
        self.idle = IdleFlag()
        self._worker: _Worker | None = None
        self._task: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._worker = _Worker(loop, "florist-engine")
        self._task = loop.create_task(self._loop(), name="florist-batcher")

    async def stop(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._worker is not None:
            await self._worker.close(STOP_TIMEOUT_S)

    # -- requests ------------------------------------------------------------------------------
    async def run(self, ids: np.ndarray, seq_lens: np.ndarray, first_segment_lens: np.ndarray | None = None, deadline: float | None = None) -> np.ndarray:
        """Model output rows [N, D] for the request's N sequences, in order. Raises
        scheduler.Overloaded at once when the pending bound is reached, DeadlineExpired when
        the deadline passes while it is queued."""
        future = asyncio.get_running_loop().create_future()
        work = Work(ids, seq_lens, first_segment_lens, future)
        req = Request(seq_lens.tolist(), deadline, work)
        work.starts = [0, *itertools.accumulate(req.seq_lens[:-1])]
        idle = not self.in_flight and not self.scheduler.has_pending()
        self.scheduler.add(req)
        self.idle.clear()
        if idle:
            # The fast path: nothing queued or running, so this request's batch is the next one
            # and is launched here, without waiting for the loop to wake up. NOTE: safe because
            # an idle loop is parked in `_wakeup.wait()` (it only yields while it has batches in
            # flight, or after a failure with none).
            flight = self._launch_next()
            if flight is not None and self.launch == "inline" and req.queued_seqs == 0 and not flight.done:
                await self._poll_own(flight, req)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away, or grpc enforced its deadline
            self.scheduler.cancel(req)
            raise

    async def _poll_own(self, flight: _InFlight, req: Request) -> None:
        """A lone request's handler polls its own batch for the spin window and collects it,
        so the result reaches the handler without a hand-off to the loop and back. The loop
        leaves an `owned` head alone; after the window (or if the handler is cancelled) the loop
        takes the batch over and parks the wait as usual."""
        flight.owned = True
        try:
            while not flight.lazy.ready():
                if time.perf_counter() - flight.launched_at >= self.spin_s:
                    return
                await asyncio.sleep(0)  # let other requests and grpc's work run, then look again
            if self.in_flight and self.in_flight[0] is flight:  # else the loop failed it meanwhile
                self._copy_out(flight)
                self._collect(self.in_flight.popleft())
        except asyncio.CancelledError:
            self.scheduler.cancel(req)
            raise
        finally:
            flight.owned = False
            self._wakeup.set()  # the loop: take this batch over, or look at the next one

    # -- the loop ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._iteration()
            except Exception:  # a bug here must not hang every request: fail what is in flight
                log.exception("the batching loop failed; failing the batches in flight")
                while self.in_flight:
                    for req, _ in self.in_flight.popleft().batch.seqs:
                        self.scheduler.cancel(req)
                        _fail(req.payload.future, RuntimeError("internal error in the batching loop; see the server log"))
                await asyncio.sleep(0.01)  # yield: a failure before any await must not starve the event loop

    async def _iteration(self) -> None:
        """Launch while there is room and work; collect the oldest batch if it is back; else
        wait for news (a request, a result) or, while polling, yield and look again."""
        self._wakeup.clear()
        while len(self.in_flight) < self.max_in_flight and not self._hold() and self._launch_next() is not None:
            pass
        head = self.in_flight[0] if self.in_flight else None
        if head is not None and not head.done and not head.parked and not head.owned and head.lazy is not None:
            if head.lazy.ready():
                self._copy_out(head)
            elif time.perf_counter() - head.launched_at < self.spin_s:
                await asyncio.sleep(0)  # let handlers run, then poll again
                return
            else:
                head.parked = True
                self._worker.submit(head.lazy.numpy, lambda rows, err, f=head: self._done(f, rows, err))
        if head is not None and head.done:
            self._collect(self.in_flight.popleft())
            return
        if not self.in_flight and not self.scheduler.has_pending():
            self.idle.set()
        await self._wakeup.wait()

    def _hold(self) -> bool:
        """Whether to leave the queue for now although there is room in flight: one batch runs,
        its device time is known, it is not due back within launch_ahead_s, and what is queued
        does not already fill a batch. A timer wakes the loop when it is time to launch."""
        if len(self.in_flight) != 1 or self.launch_ahead_s == math.inf:
            return False
        head = self.in_flight[0]
        if head.done or head.error is not None:
            return False
        sched = self.scheduler
        if not sched.has_pending() or sched.pending_tokens >= sched.max_batch_tokens or sched.pending_seqs >= sched.max_batch_seqs:
            return False  # nothing to hold (no timer, no wake-up), or a full batch to launch
        cost = self.device_times.estimate(head.batch.num_tokens, head.batch.num_seqs)
        if cost is None:
            return False
        until = max(head.launched_at, self._last_ready) + cost - self.launch_ahead_s
        now = time.perf_counter()
        if until <= now:
            return False
        # NOTE: asked on every turn of the loop while it polls a batch: arm a timer only when the
        # time to launch moved, not once a turn.
        if self._hold_timer is None or self._hold_until != until:
            if self._hold_timer is not None:
                self._hold_timer.cancel()
            self._hold_timer, self._hold_until = asyncio.get_running_loop().call_later(until - now, self._hold_over), until
        return True

    def _hold_over(self) -> None:
        self._hold_timer = None  # fired (a timer may fire a little early: the next hold arms another)
        self._wakeup.set()

    def _host_batch(self, batch: Batch) -> HostBatch:
        req0, _ = batch.seqs[0]
        work: Work = req0.payload
        if batch.num_seqs == len(req0.seq_lens) and batch.seqs[-1][0] is req0:  # one whole request
            types = segment_ids(work.seq_lens, work.first_segment_lens) if self.with_token_types else None
            return HostBatch(work.ids, work.seq_lens, types)
        seqs, firsts = [], []
        for req, i in batch.seqs:
            work = req.payload
            start = work.starts[i]
            seqs.append(work.ids[start : start + req.seq_lens[i]])
            if self.with_token_types:
                firsts.append(int(work.first_segment_lens[i]))
        return HostBatch.from_sequences(seqs, firsts if self.with_token_types else None)

    def _launch_next(self) -> _InFlight | None:
        """Launch the next batch from the queue, if any; None when the queue is empty."""
        batch = self.scheduler.next_batch()
        self._fail_expired()
        return self._launch(batch) if batch is not None else None

    def _launch(self, batch: Batch) -> _InFlight:
        flight = _InFlight(batch)
        self.in_flight.append(flight)
        try:
            host = self._host_batch(batch)
            if self.launch == "thread":
                flight.parked = True
                self._worker.submit(lambda: self.engine.step(host).numpy(), lambda rows, err: self._done(flight, rows, err))
            else:
                flight.lazy = self.engine.step(host)
        except Exception as e:
            self._done(flight, None, e)
        if self.metrics is not None:  # after the launch, so it overlaps the device's work
            self.metrics.observe_batch(batch.num_tokens, batch.num_seqs)
        return flight

    def _done(self, flight: _InFlight, rows, error) -> None:
        flight.rows, flight.error, flight.done = rows, error, True
        flight.ready_at = time.perf_counter()
        self._wakeup.set()

    def _copy_out(self, flight: _InFlight) -> None:
        try:
            self._done(flight, flight.lazy.numpy(), None)
        except Exception as e:
            self._done(flight, None, e)

    def _collect(self, flight: _InFlight) -> None:
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - flight.launched_at)
        batch = flight.batch
        if flight.error is None:
            # Batches run one after another: this one started at its launch or when the one
            # before it was back, whichever came later.
            self.device_times.observe(batch.num_tokens, batch.num_seqs, flight.ready_at - max(flight.launched_at, self._last_ready))
        self._last_ready = flight.ready_at
        if flight.error is not None:
            log.error("a batch of %d sequences failed in the engine: %r", batch.num_seqs, flight.error)
            for req, _ in batch.seqs:
                if req.live:
                    self.scheduler.cancel(req)
                    _fail(req.payload.future, RuntimeError(f"the engine failed on a batch of {batch.num_seqs} sequences: {flight.error!r}"))
            return
        rows = flight.rows
        # Copy runs of consecutive sequences of one request at once (a request's sequences are
        # contiguous in the queue, so a batch is a few runs, not one copy per sequence).
        k, seqs = 0, batch.seqs
        while k < len(seqs):
            req, first = seqs[k]
            end = k + 1
            while end < len(seqs) and seqs[end][0] is req:
                end += 1
            work: Work = req.payload
            if req.live:
                if end - k == len(req.seq_lens):  # the whole request is in this batch
                    work.rows = rows[k:end].copy()
                else:
                    if work.rows is None:
                        work.rows = np.empty((len(req.seq_lens), *rows.shape[1:]), dtype=rows.dtype)
                    work.rows[first : first + end - k] = rows[k:end]
            k = end
        for req in self.scheduler.complete(batch):
            if not req.payload.future.done():
                req.payload.future.set_result(req.payload.rows)

    def _fail_expired(self) -> None:
        for req in self.scheduler.take_expired():
            _fail(req.payload.future, DeadlineExpired("the request's deadline passed while it waited in the queue"))


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
