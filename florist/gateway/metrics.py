"""Prometheus metrics of the gateway, and the `GET /metrics` route.

Several gateway workers serve one port; a scrape reaches one of them. With more than one worker
`florist serve` sets PROMETHEUS_MULTIPROC_DIR for the workers (not for the engines), every
worker writes its samples there, and whichever worker is scraped reports the sum over all of
them (prometheus_client's multiprocess mode; gauges carry a `pid` label). The engines' own
metrics (queue, batches) are served by `florist engine-server --metrics-port`, or, with
`florist serve --in-process`, by the gateway's /metrics beside its own (`include`).
Without prometheus_client installed the gateway runs without metrics and /metrics says so.
"""

from __future__ import annotations

import os

from aiohttp import web

from florist.gateway.errors import ApiError
from florist.gateway.pipeline import pipeline_of

try:
    import prometheus_client as prom
    from prometheus_client import multiprocess
except ImportError:  # pragma: no cover - the gateway runs without it
    prom = None

SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class GatewayMetrics:
    def __init__(self):
        self.enabled = prom is not None
        if not self.enabled:
            return
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        # Own registry (tests run several gateways in one process); multiprocess samples are
        # collected from the directory at scrape time instead.
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter("florist_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.request_seconds = prom.Histogram("florist_gateway_request_seconds", "HTTP request latency", ["route"], buckets=SECONDS_BUCKETS, registry=r)
        self.tokenize_seconds = prom.Histogram("florist_gateway_tokenize_seconds", "Tokenization time per request", buckets=SECONDS_BUCKETS, registry=r)
        self.request_tokens = prom.Histogram("florist_gateway_request_tokens", "Tokens per request sent to the engines", buckets=TOKEN_BUCKETS, registry=r)
        self.chunk_retries = prom.Counter("florist_gateway_chunk_retries", "Chunks sent again to another replica, by reason", ["reason"], registry=r)
        self.replica_healthy = prom.Gauge("florist_gateway_replica_healthy", "1 while an engine replica is in rotation", ["replica"], registry=r, multiprocess_mode="liveall")
        self._children: dict = {}
        self._included: list = []  # registries scraped with this one (the in-process engine server's)

    def include(self, registry) -> None:
        """Serve `registry`'s samples from /metrics too (an in-process engine server's metrics)."""
        if self.enabled and registry is not None:
            self._included.append(registry)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        if not self.enabled:
            return
        key = (route, status)
        children = self._children.get(key)
        if children is None:  # labels() costs a lock and a dict lookup per call
            children = self._children[key] = (self.requests.labels(route, str(status)), self.request_seconds.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def observe_tokens(self, num_tokens: int, tokenize_seconds: float) -> None:
        if self.enabled:
            self.request_tokens.observe(num_tokens)
            self.tokenize_seconds.observe(tokenize_seconds)

    def chunk_retried(self, reason: str) -> None:
        if self.enabled:
            self.chunk_retries.labels(reason).inc()

    def replica_changed(self, replica) -> None:
        if self.enabled:
            self.replica_healthy.labels(replica.address).set(1 if replica.healthy else 0)

    def exposition(self) -> tuple[bytes, str]:
        if self.multiprocess:
            registry = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        return b"".join(prom.generate_latest(r) for r in (registry, *self._included)), prom.CONTENT_TYPE_LATEST


async def metrics_route(request: web.Request) -> web.Response:
    metrics: GatewayMetrics = pipeline_of(request).metrics
    if not metrics.enabled:
        raise ApiError(404, "metrics are off: prometheus_client is not installed (pip install prometheus-client)")
    body, content_type = metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


ROUTES = [("GET", "/metrics", metrics_route, "tei")]
