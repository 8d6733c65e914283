"""Gateway settings, fixed at start-up (`florist serve` fills them from its flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    engines: tuple[str, ...]                 # host:port of each engine replica
    model: str | None = None                 # local model directory for the tokenizer; None: the engines' own
    host: str = "127.0.0.1"
    port: int = 8000                         # 0: any free port (printed at start)
    api_key: str | None = None               # None: no authentication
    payload_limit_bytes: int = 16 << 20      # larger bodies get 413
    max_inputs: int = 2048                   # inputs per request (OpenAI's limit)
    chunk_seqs: int | None = None            # sequences per chunk; None: the engine's max batch sequences
    chunk_tokens: int | None = None          # tokens per chunk; None: the engine's max batch tokens
    min_chunk_tokens: int = 2048             # a request is split over replicas only into chunks this large
    tokenization_workers: int = min(4, os.cpu_count() or 1)
    inline_tokenize_chars: int = 1024        # smaller requests are tokenized on the event loop while the pool is idle; 0: never
    request_timeout_s: float = 120.0
    health_interval_s: float = 1.0
    startup_timeout_s: float = 300.0
    retry_after_s: int = 1
    reuse_port: bool = False                 # several worker processes on one port (SO_REUSEPORT)
    local_socket: bool = True                # Embed / Score / Generate over an engine's local socket where it has one on this host
    # Trade CPU for latency: the event loop keeps turning while no request is in flight.
    busy_poll: bool = False
    # Without busy_poll, keep the loop turning this long after the last request in flight ended,
    # so a stream of requests finds it awake, then sleep (florist/busy_poll.py). None: 20 ms when
    # the engines run on GPUs, 0 (off) when on the CPU, whose cores the models need.
    busy_poll_linger_ms: float | None = None
    # The engine call of a lone request (the only one in flight) polls for its reply over the local
    # socket for up to this long (florist/server/local.py) rather than sleeping until it lands; it
    # costs CPU only while that request waits. None: 5 ms with busy_poll, else 0 (off).
    reply_spin_ms: float | None = None
    # One log line per HTTP request on the "florist.access" logger (client, request line, status,
    # response bytes, seconds). Off by default: batch-1 latency is what the gateway is tuned for.
    access_log: bool = False

    @property
    def reply_spin(self) -> float:
        """The reply poll window in ms that applies (reply_spin_ms, or its default)."""
        return self.reply_spin_ms if self.reply_spin_ms is not None else (5.0 if self.busy_poll else 0.0)
