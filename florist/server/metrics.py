"""Prometheus metrics of one inference server, in a registry of its own (several servers may
live in one process, e.g. in tests). Observations are plain counts kept on the event loop and
turned into Prometheus samples only when scraped; queue gauges are read at scrape time too.
Without prometheus_client installed the server still runs, without metrics."""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
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


class Histogram:
    """Bucket counts and a sum in plain Python numbers. observe() runs on the event loop for every
    request and batch, so it is a bisect and two additions (prometheus_client's Histogram takes a
    lock per observation: microseconds each, on every request's path). Scrapes run in the HTTP
    thread and read a copy of the counts (a list copy is atomic under the GIL)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # `le` buckets: value <= bound
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        counts, total, out = list(self.counts), 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts):
            total += n
            out.append((bound, total))
        return out


class ServerMetrics:
    """The server's metrics, exported through one collector at scrape time:

        florist_queue_sequences / _tokens, florist_batches_in_flight   gauges (read when scraped)
        florist_batch_tokens, florist_batch_sequences                  histograms, per batch
        florist_step_seconds                                           histogram, per batch
        florist_request_seconds{method}                                histogram, per request
        florist_requests_total{method,code}                            counter, per request
    """

    def __init__(self, registry=None):
        self.registry = registry or CollectorRegistry()
        self.batch_tokens, self.batch_sequences = Histogram(TOKEN_BUCKETS), Histogram(SEQ_BUCKETS)
        self.step_seconds = Histogram(SECONDS_BUCKETS)
        self.request_seconds: dict[str, Histogram] = {}
        self.requests: dict[tuple[str, str], int] = {}
        self._gauges: tuple[Callable[[], float], ...] = (lambda: 0, lambda: 0, lambda: 0)
        self.registry.register(self)

    def watch(self, queue_sequences: Callable[[], float], queue_tokens: Callable[[], float], batches_in_flight: Callable[[], float]) -> None:
        self._gauges = (queue_sequences, queue_tokens, batches_in_flight)

    def observe_batch(self, num_tokens: int, num_seqs: int) -> None:
        self.batch_tokens.observe(num_tokens)
        self.batch_sequences.observe(num_seqs)

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        hist = self.request_seconds.get(method)
        if hist is None:
            hist = self.request_seconds[method] = Histogram(SECONDS_BUCKETS)
        hist.observe(seconds)
        self.requests[method, code] = self.requests.get((method, code), 0) + 1

    def collect(self):
        """prometheus_client's collector interface (called by the registry when scraped)."""
        names = ("florist_queue_sequences", "florist_queue_tokens", "florist_batches_in_flight")
        docs = ("Sequences waiting to be batched", "Tokens waiting to be batched", "Batches launched whose results are not yet collected")
        for name, doc, fn in zip(names, docs, self._gauges):
            yield GaugeMetricFamily(name, doc, value=fn())
        for name, doc, hist in (
            ("florist_batch_tokens", "Tokens per launched batch", self.batch_tokens),
            ("florist_batch_sequences", "Sequences per launched batch", self.batch_sequences),
            ("florist_step_seconds", "From launching a batch until its results are on the host (includes waiting behind the batch before it)", self.step_seconds),
        ):
            family = HistogramMetricFamily(name, doc)
            family.add_metric([], hist.buckets(), hist.sum)
            yield family
        family = HistogramMetricFamily("florist_request_seconds", "Request latency inside the server", labels=["method"])
        for method, hist in list(self.request_seconds.items()):
            family.add_metric([method], hist.buckets(), hist.sum)
        yield family
        family = CounterMetricFamily("florist_requests", "Finished requests by method and gRPC status code", labels=["method", "code"])
        for (method, code), n in list(self.requests.items()):
            family.add_metric([method, code], n)
        yield family

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Expose /metrics over HTTP on `port` (0: any free port); returns the HTTP server."""
        started = start_http_server(port, addr=host, registry=self.registry)
        return started[0] if isinstance(started, tuple) else started
