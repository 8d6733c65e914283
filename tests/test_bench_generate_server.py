"""bench/generate_server.py --smoke: Generate streamed from an engine server over gRPC and over
its local socket, and from the server's handlers in process, against Engine.generate in process,
on a tiny causal LM on the CPU."""

from __future__ import annotations

import re

from bench_scripts import run_bench


def test_generate_server_bench_smoke():
    out = run_bench("generate_server.py", "--smoke", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for path, transport in (("direct", "in process"), ("grpc", "grpc"), ("local", "local"), ("inproc", "in-process")):
        row = re.search(rf"^{path}\s+{transport}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+yes$", out.stdout, re.M)
        assert row and all(float(x) > 0 for x in row.groups()), (path, out.stdout)
    assert re.search(r"local adds -?[0-9.]+ ms per token over direct", out.stdout)
    assert re.search(r"inproc adds -?[0-9.]+ ms per token over direct", out.stdout)
