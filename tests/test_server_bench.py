"""bench/server.py --smoke: the benchmark's code path (model build, server process, every
scenario, the table) on a tiny model on the CPU."""

from __future__ import annotations

import re

from bench_scripts import run_bench


def test_server_bench_smoke():
    out = run_bench("server.py", "--smoke")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for row in ("8 x 64 tokens, rounds sent at once, emb/s", "64-token requests, stream of 16, 8 in flight, emb/s",
                "8 x 64-token requests, stream of 6, 4 in flight, emb/s", "32-token batch-1 round trip p99, ms, sync gRPC client",
                "32-token batch-1 round trip p99, ms, grpc.aio client", "Health round trip p50, ms, sync gRPC client",
                "32-token batch-1 round trip p50, ms, local socket, blocking", "32-token batch-1 round trip p50, ms, local socket, asyncio",
                "Health round trip p50, ms, local socket, blocking",
                "Embed p50 split, ms: client->handler / handler / handler->client", "Health p50 split, ms: client->handler / handler / handler->client",
                "same through the Batcher in this process (no gRPC, spin 2 ms), p50 / p99, ms",
                "direct step() p50 / p99 while the server process is up (idle), ms"):
        assert row in out.stdout, (row, out.stdout[-3000:])
    cosine = re.search(r"min cosine, server vs embedded API: ([0-9.]+)", out.stdout)
    assert cosine and float(cosine.group(1)) >= 0.999
