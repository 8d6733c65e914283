"""Server settings, fixed at start-up (a light module: `florist --help` imports it, not torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int | None = 50051  # 0: any free port (RunningServer.port says which); None: no gRPC (an in-process gateway, inprocess.py)
    # None: the largest batch the engine replays from a CUDA graph (else 16384). Larger batches
    # run eagerly, and an eager launch of a big model takes tens of ms of the event loop's CPU.
    max_batch_tokens: int | None = None
    max_batch_seqs: int = 256
    # Four concurrent 100 x 4096-token requests (1.6 M tokens) must fit: ids cost 4 bytes a token.
    max_pending_tokens: int = 1 << 22
    max_in_flight: int = 2
    metrics_port: int | None = None
    launch: str | None = None  # None: "inline" on CUDA, "thread" on CPU (see batcher.py)
    spin_ms: float = 2.0  # poll a launched batch this long, then wait for it in a thread
    # While one batch runs, launch the next this long before the running one is expected back
    # (not at once), so requests arriving meanwhile join it; inf: at once. None: 0.8 ms on a GPU
    # engine, inf on a CPU one (batcher.py).
    launch_ahead_ms: float | None = None
    # Reply to Embed / Score / Health with trailing metadata "x-florist-timing: ENTRY EXIT", the
    # handler's entry and exit on CLOCK_MONOTONIC in ns (time.monotonic_ns, which another process
    # on the same host reads on the same clock): where a round trip's time goes (bench/server.py).
    timing_metadata: bool = False
    # Keep the event loop turning (never parked in epoll) while the server is idle: a request is
    # picked up at the next turn, on a core that never went idle. Costs one CPU core at 100 %.
    busy_poll: bool = False
    # Without busy_poll, keep the loop turning this long after the server fell idle, so a stream
    # of requests finds it awake, then sleep (florist/busy_poll.py). None: 20 ms on a GPU engine
    # that embeds or scores, 0 (off) on a CPU engine, whose model needs the core, and for a
    # causal LM.
    busy_poll_linger_ms: float | None = None
    # Also serve the RPCs on this Unix socket ("auto": a path of the server's choosing), for
    # a gateway on the same host (florist/server/local.py); None: gRPC only.
    local_socket: str | None = None
