"""The batching loop's device path (launch on the event loop, poll or park the wait) on a
simulated device: a serial queue that finishes each batch some time after the one before, as a
GPU stream does. CPU engines take the worker-thread path; these tests cover the CUDA one."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from florist.server.client import InferenceClient
from florist.server.service import ServerConfig, ServerThread
from test_server import embed_or_error

POISON = 999  # a batch holding this id fails in the simulated engine


def expected_rows(seqs) -> np.ndarray:
    """What the simulated model outputs per sequence: exact in float32, unique per sequence."""
    return np.asarray([[len(s), sum(s) % 4096, s[0], s[-1]] for s in seqs], dtype=np.float32)


class SimulatedLazy:
    def __init__(self, rows: np.ndarray, ready_at: float, waits: list | None = None):
        self.rows, self.ready_at, self.waits = rows, ready_at, waits

    def ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def wait(self):
        if self.waits is not None:  # who waited: the batcher's worker thread when it parked the batch
            self.waits.append(threading.current_thread().name)
        while not self.ready():
            time.sleep(0.0002)
        return self.rows

    def numpy(self) -> np.ndarray:
        return self.wait()


class SimulatedDevice:
    """step() returns at once; a batch is ready `per_token_s` x tokens after the previous one."""

    def __init__(self, per_token_s: float = 2e-6, base_s: float = 2e-4):
        self.info = SimpleNamespace(
            model_name="simulated", family="bert", task="embed", dimensions=4, max_input_tokens=64, vocab_size=1000,
            dtype="float32", device="cuda:0", pooling=("mean",), normalize=False, prompts={}, default_prompt_name=None,
            score_activation="identity", native_int8=False, tokenizer="",
        )
        self.per_token_s, self.base_s = per_token_s, base_s
        self.busy_until = 0.0
        self.finishes: list[float] = []
        self.max_queued = 0  # most batches on the device (running or waiting) right after a launch
        self.waits: list[str] = []  # the thread of each wait() on a result (SimulatedLazy)

    def step(self, batch):
        now = time.perf_counter()
        if POISON in batch.input_ids:
            raise RuntimeError("simulated device fault")
        self.max_queued = max(self.max_queued, 1 + sum(1 for t in self.finishes if t > now))
        self.busy_until = max(now, self.busy_until) + self.base_s + self.per_token_s * batch.num_tokens
        self.finishes.append(self.busy_until)
        seqs = np.split(batch.input_ids, np.cumsum(batch.seq_lens)[:-1])
        return SimulatedLazy(expected_rows([s.tolist() for s in seqs]), self.busy_until, self.waits)


def random_requests(rng, n: int) -> list[list[list[int]]]:
    return [[rng.integers(0, 900, size=int(rng.integers(1, 65))).tolist() for _ in range(int(rng.integers(1, 17)))] for _ in range(n)]


@pytest.mark.parametrize("spin_ms", [0.0, 0.5, 1000.0], ids=["park-at-once", "spin-then-park", "poll-only"])
def test_device_path_returns_each_request_its_rows_with_two_batches_in_flight(spin_ms):
    device = SimulatedDevice()
    rng = np.random.default_rng(int(spin_ms * 10))
    requests = random_requests(rng, 120)
    with ServerThread(device, ServerConfig(port=0, max_batch_tokens=256, max_batch_seqs=16, spin_ms=spin_ms)) as srv:
        assert srv.running.batcher.launch == "inline"

        async def go():
            async with InferenceClient(srv.address, timeout=60) as client:
                return await asyncio.gather(*(client.embed(r) for r in requests))

        results = asyncio.run(go())
    for got, seqs in zip(results, requests):
        np.testing.assert_array_equal(got, expected_rows(seqs))
    assert device.max_queued == 2, "batch N+1 should be launched while batch N runs, and no more"
    parked = device.waits.count("florist-engine")  # waits the loop handed to its worker thread
    if spin_ms == 1000.0:
        assert parked == 0, "poll-only: no batch is parked"
    else:  # full batches take ~0.7 ms of simulated time, more than either window
        assert parked > 0, f"{spin_ms} ms spin: long batches are parked"


def test_a_failing_batch_fails_its_requests_only():
    device = SimulatedDevice()
    with ServerThread(device, ServerConfig(port=0, max_batch_seqs=1)) as srv:

        async def go():
            async with InferenceClient(srv.address, timeout=30) as client:
                return await asyncio.gather(*(embed_or_error(client, seqs) for seqs in ([[1, 2]], [[POISON, 3]], [[4, 5, 6]])))

        ok1, bad, ok2 = asyncio.run(go())
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INTERNAL
    assert "simulated device fault" in bad.details()
    np.testing.assert_array_equal(ok1, expected_rows([[1, 2]]))
    np.testing.assert_array_equal(ok2, expected_rows([[4, 5, 6]]))


def test_a_failing_batch_among_others_fails_only_its_own():
    """The test above sends its requests through the server, where each arrives alone; here the
    three one-sequence batches are in the batcher together (the first held in flight by the
    gate, the third queued behind the failing one), and only the failing one's request fails."""
    device = RecordingDevice()
    device.gate.clear()

    async def body(batcher):
        futures = [submit(batcher, s) for s in ([[1, 2]], [[POISON, 3]], [[4, 5, 6]])]
        await asyncio.sleep(0.05)
        assert len(device.batches) >= 2  # the first is in flight, the second has failed its launch
        device.gate.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    ok1, bad, ok2 = run_batcher(device, body, max_batch_seqs=1)
    assert isinstance(bad, RuntimeError) and "simulated device fault" in str(bad), bad
    np.testing.assert_array_equal(ok1, expected_rows([[1, 2]]))
    np.testing.assert_array_equal(ok2, expected_rows([[4, 5, 6]]))


def test_server_runs_without_prometheus_client():
    code = f"""
import sys, asyncio
sys.modules["prometheus_client"] = None
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_server_batching import SimulatedDevice, expected_rows
from florist.server.client import InferenceClient
from florist.server.service import ServerConfig, ServerThread
import numpy as np
with ServerThread(SimulatedDevice(), ServerConfig(port=0)) as srv:
    async def go():
        async with InferenceClient(srv.address, timeout=30) as client:
            return await client.embed([[1, 2, 3]])
    np.testing.assert_array_equal(asyncio.run(go()), expected_rows([[1, 2, 3]]))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the idle fast path (a request that finds the server idle is launched by its handler, which
# on the device path also polls and collects its batch for the spin window) ---------------------
class GatedLazy(SimulatedLazy):
    def __init__(self, rows, ready_at, gate: threading.Event):
        super().__init__(rows, ready_at)
        self.gate = gate

    def ready(self) -> bool:
        return self.gate.is_set() and super().ready()


class RecordingDevice(SimulatedDevice):
    """Also records the ids of each batch it ran, and (run_batcher) who launched and collected
    it. While `gate` is clear no batch finishes, so a test decides when results come back."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[list[int]] = []
        self.by_loop: list[bool] = []  # per launched batch: launched by the batching loop
        self.collected_by_loop: list[bool] = []  # per collected batch, in order

    def step(self, batch):
        self.batches.append(batch.input_ids.tolist())
        lazy = super().step(batch)
        return GatedLazy(lazy.rows, lazy.ready_at, self.gate)


def run_batcher(device, body, *, max_batch_tokens=256, max_batch_seqs=16, launch=None, spin_s=0.002, launch_ahead_s=math.inf):
    from florist.server.batcher import Batcher
    from florist.server.scheduler import Scheduler

    async def go():
        batcher = Batcher(device, Scheduler(max_batch_tokens, max_batch_seqs, 100_000), launch=launch, spin_s=spin_s, launch_ahead_s=launch_ahead_s)
        launch_batch = batcher._launch

        def recording_launch(batch):
            device.by_loop.append(asyncio.current_task().get_name() == "florist-batcher")
            return launch_batch(batch)

        batcher._launch = recording_launch
        collect = batcher._collect

        def recording_collect(flight):
            device.collected_by_loop.append(asyncio.current_task().get_name() == "florist-batcher")
            collect(flight)

        batcher._collect = recording_collect
        batcher.start()
        try:
            return await body(batcher)
        finally:
            assert batcher.scheduler.pending_seqs == 0
            await batcher.stop()

    return asyncio.run(go())


def submit(batcher, seqs, deadline=None):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    lens = np.asarray([len(s) for s in seqs], dtype=np.int32)
    return asyncio.ensure_future(batcher.run(ids, lens, None, deadline))


@pytest.mark.parametrize("launch", ["inline", "thread"])
def test_a_lone_request_is_launched_by_its_handler_with_the_same_rows(launch):
    device = RecordingDevice()
    requests = [[[1, 2, 3]], [[4, 5], [6, 7, 8, 9]], [[10]]]

    async def body(batcher):
        alone = [await submit(batcher, r) for r in requests]  # one at a time: the server is idle each time
        together = await asyncio.gather(*(submit(batcher, r) for r in requests))  # queued: the loop batches them
        return alone, together

    alone, together = run_batcher(device, body, launch=launch, spin_s=60.0)  # poll to the end, however slow the host
    for seqs, a, b in zip(requests, alone, together):
        np.testing.assert_array_equal(a, expected_rows(seqs))
        np.testing.assert_array_equal(b, expected_rows(seqs))
    assert device.by_loop[:3] == [False, False, False], "each lone request should be launched by its handler"
    # On the device path its handler also polls and collects it; a worker thread reports to the loop.
    assert device.collected_by_loop[:3] == [launch == "thread"] * 3
    # Of the concurrent ones the first finds the server idle; the other two queue behind it.
    assert device.by_loop[3:] == [False, True] and device.batches[4] == [4, 5, 6, 7, 8, 9, 10]


# spin_s: the first request's handler polls its batch to the end (1 s), hands it to the loop
# within the batch (5 ms), or at once (0).
@pytest.mark.parametrize("spin_s", [1.0, 0.005, 0.0], ids=["handler-polls", "handed-over", "parked"])
def test_requests_arriving_behind_a_fast_path_launch_keep_fcfs_order(spin_s):
    device = RecordingDevice(per_token_s=0, base_s=0.02)
    device.gate.clear()

    async def body(batcher):
        first = submit(batcher, [[1, 1]])
        await asyncio.sleep(0)  # first is launched (fast path) and now runs on the device
        assert len(batcher.in_flight) == 1
        later = [submit(batcher, [[k, k]]) for k in (2, 3, 4)]
        await asyncio.sleep(0.01)
        device.gate.set()
        return await asyncio.gather(first, *later)

    results = run_batcher(device, body, max_batch_seqs=2, spin_s=spin_s)
    for k, rows in enumerate(results, 1):
        np.testing.assert_array_equal(rows, expected_rows([[k, k]]))
    assert device.batches == [[1, 1], [2, 2, 3, 3], [4, 4]]
    assert device.by_loop == [False, True, True]


def test_a_lone_request_over_the_batch_budget_is_split_and_reassembled():
    device = RecordingDevice()
    seqs = [[k] * 60 for k in range(1, 11)]  # 600 tokens, budget 256: 4 + 4 + 2 sequences

    async def body(batcher):
        return await submit(batcher, seqs)

    rows = run_batcher(device, body)
    np.testing.assert_array_equal(rows, expected_rows(seqs))
    assert [len(ids) for ids in device.batches] == [240, 240, 120]
    assert device.by_loop == [False, True, True]


@pytest.mark.parametrize("spin_s", [1.0, 0.0], ids=["while-its-handler-polls", "while-the-loop-waits"])
def test_cancelling_a_fast_path_request_in_flight_leaves_the_server_serving(spin_s):
    device = RecordingDevice(per_token_s=0, base_s=0.002)
    device.gate.clear()

    async def body(batcher):
        doomed = submit(batcher, [[1, 2]])
        await asyncio.sleep(0)
        assert len(batcher.in_flight) == 1  # launched by its handler
        behind = submit(batcher, [[5, 6]])  # queued behind it; launched by the loop
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        device.gate.set()
        after = await submit(batcher, [[3, 4]])
        assert not batcher.in_flight
        return await behind, after

    behind, after = run_batcher(device, body, spin_s=spin_s)
    np.testing.assert_array_equal(behind, expected_rows([[5, 6]]))
    np.testing.assert_array_equal(after, expected_rows([[3, 4]]))


def test_an_expired_request_is_refused_by_the_fast_path_without_running():
    from florist.server.batcher import DeadlineExpired

    device = RecordingDevice()

    async def body(batcher):
        with pytest.raises(DeadlineExpired):
            await submit(batcher, [[1, 2]], deadline=time.monotonic() - 1)
        return await submit(batcher, [[3]])

    np.testing.assert_array_equal(run_batcher(device, body), expected_rows([[3]]))
    assert device.batches == [[3]]


def test_idle_is_set_only_while_nothing_is_queued_or_running():
    """Batcher.idle (what the busy-poll task spins on): set at start, cleared from a request's
    arrival until its batch is collected and the loop has found nothing else to do."""
    device = RecordingDevice(per_token_s=0, base_s=0.02)
    device.gate.clear()
    seen = []

    async def body(batcher):
        seen.append(batcher.idle.is_set())
        first = submit(batcher, [[1, 1]])
        await asyncio.sleep(0)  # launched by its handler, running on the device
        later = submit(batcher, [[2, 2]])
        await asyncio.sleep(0.005)
        seen.append(batcher.idle.is_set())
        device.gate.set()
        await asyncio.gather(first, later)
        await asyncio.wait_for(batcher.idle.wait(), 5)
        seen.append(batcher.idle.is_set() and not batcher.in_flight and not batcher.scheduler.has_pending())

    run_batcher(device, body, max_batch_seqs=1, spin_s=0.001)
    assert seen == [True, False, True]


# -- launching ahead: the batch behind a running one is launched shortly before that one is due
# back, so requests arriving meanwhile join it -----------------------------------------------------
def test_device_times_learn_each_size_going_down_at_once_and_up_slowly():
    from florist.server.batcher import DeviceTimes, cost_key

    times = DeviceTimes(weight=0.25)
    assert times.estimate(512, 1) is None  # never seen: no estimate (launched at once)
    times.observe(512, 1, 0.040)  # a first sight: slow
    times.observe(500, 1, 0.002)  # the same size (tokens to 256, sequences to a power of two)
    assert times.estimate(512, 1) == 0.002
    times.observe(512, 1, 0.010)  # one slow batch moves the estimate by a quarter of the way
    assert times.estimate(512, 1) == pytest.approx(0.004)
    assert times.estimate(513, 1) is None and times.estimate(512, 2) is None
    assert cost_key(512, 3) == cost_key(300, 4) != cost_key(512, 5)


@pytest.mark.parametrize("ahead_s", [0.1, math.inf], ids=["ahead", "at-once"])
def test_requests_arriving_while_a_batch_runs_join_one_batch_launched_ahead(ahead_s):
    device = RecordingDevice(per_token_s=0, base_s=0.3)

    async def body(batcher):
        await submit(batcher, [[1, 1]])  # teaches the batcher how long a batch of this size runs
        first = submit(batcher, [[2, 2]])
        await asyncio.sleep(0.02)
        second = submit(batcher, [[3, 3]])  # arrives while [2, 2] runs, with room in flight
        await asyncio.sleep(0.05)
        third = submit(batcher, [[4, 4]])
        return await asyncio.gather(first, second, third)

    results = run_batcher(device, body, launch_ahead_s=ahead_s)
    for k, rows in enumerate(results, 2):
        np.testing.assert_array_equal(rows, expected_rows([[k, k]]))
    if ahead_s == math.inf:
        assert device.batches == [[1, 1], [2, 2], [3, 3], [4, 4]]
    else:
        assert device.batches == [[1, 1], [2, 2], [3, 3, 4, 4]]
        # ... launched before [2, 2] was back, so the device never waited for it
        assert device.max_queued == 2


def test_a_queue_that_fills_a_batch_is_launched_at_once():
    device = RecordingDevice(per_token_s=0, base_s=0.3)

    async def body(batcher):
        await submit(batcher, [[1, 1]])
        first = submit(batcher, [[2, 2]])
        await asyncio.sleep(0.02)
        rest = [submit(batcher, [[k, k]]) for k in (3, 4)]  # two sequences: a full batch
        await asyncio.sleep(0.05)
        assert len(batcher.in_flight) == 2, "a full batch waits for nothing"
        return await asyncio.gather(first, *rest)

    run_batcher(device, body, max_batch_seqs=2, launch_ahead_s=0.1)
    assert device.batches == [[1, 1], [2, 2], [3, 3, 4, 4]]


def test_launch_ahead_defaults_to_gpu_engines_only():
    from florist.server.service import DEFAULT_LAUNCH_AHEAD_MS, ServerConfig, launch_ahead_s

    gpu, cpu = SimulatedDevice(), SimulatedDevice()
    cpu.info.device = "cpu"
    assert launch_ahead_s(gpu, ServerConfig()) == DEFAULT_LAUNCH_AHEAD_MS / 1e3
    assert launch_ahead_s(cpu, ServerConfig()) == math.inf
    assert launch_ahead_s(cpu, ServerConfig(launch_ahead_ms=2.0)) == 0.002
    assert launch_ahead_s(gpu, ServerConfig(launch_ahead_ms=math.inf)) == math.inf
    with pytest.raises(ValueError, match="launch_ahead_ms must be >= 0"):
        launch_ahead_s(gpu, ServerConfig(launch_ahead_ms=-1.0))


def test_stopping_the_engine_thread_waits_for_its_running_batch(caplog):
    """The worker thread is joined at stop, after the batch it runs: left to run into the
    interpreter's exit, it was ended inside torch and aborted the process (SIGABRT). A batch that
    outlasts the timeout is left running, with a warning."""
    from florist.server.batcher import _Worker

    async def main():
        worker = _Worker(asyncio.get_running_loop(), "florist-engine-test")
        results = []
        worker.submit(lambda: time.sleep(0.3) or "rows", lambda rows, err: results.append((rows, err)))
        started = time.perf_counter()
        await worker.close(10.0)
        waited = time.perf_counter() - started
        alive = worker.thread.is_alive()
        await asyncio.sleep(0)  # the batch's callback, queued on this loop before the thread ended
        slow = _Worker(asyncio.get_running_loop(), "florist-engine-slow")
        release = threading.Event()
        slow.submit(lambda: release.wait(10), lambda rows, err: None)
        await slow.close(0.05)
        slow_alive = slow.thread.is_alive()
        release.set()
        slow.thread.join(10)
        return waited, alive, results, slow_alive

    waited, alive, results, slow_alive = asyncio.run(main())
    assert not alive and waited >= 0.25, waited
    assert results == [("rows", None)]
    assert slow_alive and "still running a batch" in caplog.text
