"""The cycle every lazily captured CUDA graph runner shares, and what it costs.

    graph = self.graphs.get(key)                      captured: copy inputs in, graph.replay()
    key in self.seen                                  second sight: self.capture(key, static, forward)
    otherwise                                         first sight: self.first_sight(key, launch)

The runners (graph_runner.py for embeddings; generation/prefill_graphs.py and decode_graphs.py)
subclass `LazyGraphs` and keep what is theirs: the key (a bucket), the static input's layout and
the forward. This holds the rest: the seen-set, the captured graphs, their one memory pool, and
the accounting. A capture stalls the step that makes it (tens of ms) and a first sight may wait
for Triton to compile (on the H200 a new bucket compiled three or four kernels and held its step
for 0.85-1.7 s: docs/benchmarks.md, "The stall's cause"), so both are timed and logged, a first
sight with the Triton kernels compiled meanwhile (kernels/compile_watch.py). `graph_memory_bytes`
sums the device memory reserved while capturing (reported, not a budget).

A capture must not be a thread's first call into the libraries that keep per-thread state:
cuBLAS and cuBLASLt (and cuDNN) make a thread's handle on its first call, and making one inside a
capture fails (CUBLAS_STATUS_NOT_INITIALIZED) and spoils the capture. Buckets first seen on one
thread (a server's warm-up, on its main thread) are captured on another (the engine server's
generation thread), so every capture first calls `prepare_thread`, which makes this thread's
handles with a few tiny eager operations the first time (no model work: under tensor
parallelism the ranks' threads must launch the same collectives, whatever their history).

Other threads keep working while one captures: a server's worker thread waits on a parked
batch's event (`LazyTensor.wait()`, server/batcher.py) and may begin that wait after the capture
began. torch's default capture mode ("global") forbids such calls in every thread of the process
and spoils the capture when one happens (measured on the H200: a thread querying an event during
a capture failed it, tests/test_gpu.py). Captures here use "thread_local": only the capturing
thread is held to capture-safe calls; the others' event waits and queries touch other streams'
work, not the captured stream's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, TypeVar

import torch

from florist.kernels import compile_watch

T = TypeVar("T")
_THREAD = threading.local()  # .devices: the devices this thread's library handles were made for


def prepare_thread(device: torch.device) -> None:
    """Make the calling thread's cuBLAS, cuBLASLt and cuDNN handles on `device` now, outside any
    capture (once per thread and device; nothing on other devices)."""
    if device.type != "cuda":
        return
    done = _THREAD.__dict__.setdefault("devices", set())
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in done:
        return
    with torch.cuda.device(index):
        a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, a)  # cuBLAS
        torch.addmm(a[0], a, a)  # a bias epilogue: cuBLASLt
        if torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled:
            torch.nn.functional.conv2d(torch.ones(1, 1, 4, 4, device="cuda"), torch.ones(1, 1, 2, 2, device="cuda"))  # cuDNN
    done.add(index)


@dataclass
class CapturedGraph:
    """A graph's whole static state: the input buffer it reads and the output it writes."""

    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    output: torch.Tensor


class LazyGraphs:
    """A subclass passes its module's logger and two log formats: `capture_log` takes the key's
    fields (`log_fields(key)`, which it defines), then ms, graphs and MiB; `first_sight_log` the
    key's fields, then launch ms, this thread's CPU ms, Triton kernels compiled and loaded."""

    def __init__(self, device: torch.device, log: logging.Logger, capture_log: str, first_sight_log: str):
        self.device, self.log, self.capture_log, self.first_sight_log = device, log, capture_log, first_sight_log
        self.graphs: dict[Hashable, CapturedGraph] = {}
        self.seen: set[Hashable] = set()
        self.pool = None  # one memory pool for all of this runner's graphs
        self.capture_stream = None  # a side stream on this runner's device, made at the first capture
        self.graph_memory_bytes = 0  # device memory reserved while capturing (reported, not a budget)
        self.capture_seconds = 0.0  # host time spent capturing, all graphs
        self.first_sight_seconds = 0.0  # host time spent launching first sights eagerly, all buckets
        compile_watch.watch()

    def log_fields(self, key) -> tuple:
        raise NotImplementedError

    def first_sight(self, key, launch: Callable[[], T]) -> T:
        """Run a bucket's first step eagerly (`launch`), timed and logged; its second sight captures."""
        self.seen.add(key)
        started, cpu, (compiled, loaded) = time.perf_counter(), time.thread_time(), compile_watch.counts()
        out = launch()
        took = time.perf_counter() - started
        self.first_sight_seconds += took
        now_compiled, now_loaded = compile_watch.counts()  # NOTE: process-wide: another engine's compiles would count too
        self.log.info(self.first_sight_log, *self.log_fields(key), took * 1e3, (time.thread_time() - cpu) * 1e3,
                      now_compiled - compiled, now_loaded - loaded)
        return out

    def capture(self, key, static_input: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]) -> CapturedGraph:
        """Record `forward(static_input)` into this runner's pool. Capturing only records work:
        the caller replays the graph for the step that asked for it."""
        started = time.perf_counter()
        prepare_thread(self.device)  # this thread's library handles, not inside the capture (module docstring)
        torch.cuda.empty_cache()  # capture empties the cache anyway; measure from the same point
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # NOTE: a stream of this runner's own device. Without one, torch.cuda.graph captures on
        # one process-wide stream made on whichever device was current at the process's first
        # capture: an engine on cuda:1 after a capture on cuda:0 then records an empty graph (its
        # work runs outside it) and every replay returns a stale output.
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(self.device)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):  # module docstring
            output = forward(static_input)
        self.pool = graph.pool()
        self.graph_memory_bytes += torch.cuda.memory_reserved(self.device) - before
        entry = self.graphs[key] = CapturedGraph(graph, static_input, output)
        took = time.perf_counter() - started
        self.capture_seconds += took
        self.log.info(self.capture_log, *self.log_fields(key), took * 1e3, len(self.graphs), self.graph_memory_bytes / 2**20)
        return entry

    def cost(self, prefix: str = "") -> dict:
        """The accounting, for a runner's stats(): graph memory and host seconds."""
        return {f"{prefix}graph_memory_bytes": self.graph_memory_bytes, f"{prefix}capture_seconds": round(self.capture_seconds, 4),
                f"{prefix}first_sight_seconds": round(self.first_sight_seconds, 4)}
