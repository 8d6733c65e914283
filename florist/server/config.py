"""Server settings, fixed at start-up (a light module: `florist --help` imports it, not torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (RunningServer.port says which)
    # Large enough that a batch keeps a 0.6B model's GPU busy while the next one is launched:
    # with 16384 the H200 ran 100 x 512-token requests at 0.71 of one direct step() (bench/server.py).
    max_batch_tokens: int = 32768
    max_batch_seqs: int = 256
    max_pending_tokens: int = 1 << 20
    max_in_flight: int = 2
    metrics_port: int | None = None
    launch: str | None = None  # None: "inline" on CUDA, "thread" on CPU (see batcher.py)
    spin_ms: float = 2.0  # poll a launched batch this long, then wait for it in a thread
