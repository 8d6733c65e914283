"""bench/server_layers.py --smoke: every layer's row (direct, batcher, handler, gRPC split, Health)
on a tiny model on the CPU."""

from __future__ import annotations

import re

from bench_scripts import run_bench


def test_server_layers_smoke():
    out = run_bench("server_layers.py", "--smoke")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    values = {}
    for label in ("direct step() on the server's loop", "the server's Batcher.run, no gRPC call", "the Embed implementation, no transport",
                  "gRPC Embed round trip (sync client)", "  client -> handler", "  in the handler", "  handler -> client",
                  "gRPC Health round trip (the transport floor)"):
        m = re.search(re.escape(label) + r"\s+p50\s+([0-9.]+) ms", out.stdout)
        assert m, (label, out.stdout[-3000:])
        values[label] = float(m.group(1))
    # the handler runs inside the round trip, and the round trip is its three parts call by call
    # (so the parts' medians add up to about the round trip's)
    total = values["gRPC Embed round trip (sync client)"]
    parts = values["  client -> handler"] + values["  in the handler"] + values["  handler -> client"]
    assert 0 < values["  in the handler"] < total and 0.67 * parts <= total <= 1.5 * parts
