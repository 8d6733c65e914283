"""Prometheus metrics of one inference server, in a registry of its own (several servers may
live in one process, e.g. in tests). Queue gauges are read at scrape time, so they cost nothing
per request. Without prometheus_client installed the server still runs, without metrics."""

from __future__ import annotations

from typing import Callable

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
except ImportError:  # pragma: no cover - e.g. a GPU image with grpcio but not prometheus_client
    CollectorRegistry = None

TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def make_metrics() -> "ServerMetrics | NoMetrics":
    return ServerMetrics() if CollectorRegistry is not None else NoMetrics()


class NoMetrics:
    """Stands in when prometheus_client is missing: every observation is dropped."""

    class _Drop:
        def observe(self, value: float) -> None:
            pass

    step_seconds = _Drop()

    def watch(self, *fns) -> None:
        pass

    def observe_batch(self, num_tokens: int, num_seqs: int) -> None:
        pass

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        pass

    def serve(self, port: int, host: str = "127.0.0.1"):
        raise RuntimeError("metrics need prometheus_client (`pip install prometheus-client`); drop --metrics-port to run without them")


class ServerMetrics:
    def __init__(self, registry=None):
        self.registry = r = registry or CollectorRegistry()
        self.queue_sequences = Gauge("florist_queue_sequences", "Sequences waiting to be batched", registry=r)
        self.queue_tokens = Gauge("florist_queue_tokens", "Tokens waiting to be batched", registry=r)
        self.batches_in_flight = Gauge("florist_batches_in_flight", "Batches launched whose results are not yet collected", registry=r)
        self.batch_tokens = Histogram("florist_batch_tokens", "Tokens per launched batch", buckets=TOKEN_BUCKETS, registry=r)
        self.batch_sequences = Histogram("florist_batch_sequences", "Sequences per launched batch", buckets=SEQ_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            "florist_step_seconds", "From launching a batch until its results are on the host (includes waiting behind the batch before it)",
            buckets=SECONDS_BUCKETS, registry=r,
        )
        self.request_seconds = Histogram("florist_request_seconds", "Request latency inside the server", ["method"], buckets=SECONDS_BUCKETS, registry=r)
        self.requests = Counter("florist_requests", "Finished requests by method and gRPC status code", ["method", "code"], registry=r)
        self._children: dict[tuple[str, str], tuple] = {}  # labels() costs a lookup and a lock

    def watch(self, queue_sequences: Callable[[], float], queue_tokens: Callable[[], float], batches_in_flight: Callable[[], float]) -> None:
        self.queue_sequences.set_function(queue_sequences)
        self.queue_tokens.set_function(queue_tokens)
        self.batches_in_flight.set_function(batches_in_flight)

    def observe_batch(self, num_tokens: int, num_seqs: int) -> None:
        self.batch_tokens.observe(num_tokens)
        self.batch_sequences.observe(num_seqs)

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        children = self._children.get((method, code))
        if children is None:
            children = self._children[method, code] = (self.request_seconds.labels(method), self.requests.labels(method, code))
        children[0].observe(seconds)
        children[1].inc()

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Expose /metrics over HTTP on `port` (0: any free port); returns the HTTP server."""
        started = start_http_server(port, addr=host, registry=self.registry)
        return started[0] if isinstance(started, tuple) else started
