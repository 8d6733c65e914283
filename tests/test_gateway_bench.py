"""bench/gateway.py --smoke: the measurement's code path (model directory, 512-token inputs, stub
engine, `florist serve`, the load process, the FastAPI baseline when installed, the table), and the
latency run (HTTP vs direct gRPC on a real engine, default model on the CPU; and on the stub engine)."""

from __future__ import annotations

import re

import pytest
from bench_scripts import run_bench


@pytest.mark.parametrize("flags,hop", [([], "gRPC"), (["--local-socket"], "its local socket")])
def test_gateway_bench_smoke(flags, hop):
    out = run_bench("gateway.py", "--smoke", *flags, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"tokenization, one thread, florist TextProcessor.encode: \d+ texts/s", out.stdout)
    row = re.search(rf"florist serve \(1 worker\) \+ stub engine over {hop}\s+([0-9.]+)", out.stdout)
    assert row and float(row.group(1)) > 0, out.stdout
    assert re.search(r"HTTP /v1/embeddings \(text\) adds -?[0-9.]+ ms p50 over direct gRPC", out.stdout), out.stdout


def test_gateway_latency_on_the_stub_engine():
    out = run_bench("gateway.py", "--latency", "--stub", "--requests", "20", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"on a stub engine \(no model\), 20 requests each", out.stdout), out.stdout
    assert re.search(r"gateway JSON / event loop: (orjson|json \(float rows by numpy\)) / (uvloop|asyncio)", out.stdout), out.stdout
    for path in ("text", "token ids"):
        assert re.search(rf"HTTP /v1/embeddings \({path}\) adds -?[0-9.]+ ms p50 over direct gRPC", out.stdout), out.stdout


def test_gateway_latency_layer_by_layer():
    """--in-process adds the engine's own step() on the same model; florist serve's engine answers
    on its local socket too, and HTTP with base64 rows gives the same vector (checked by the run)."""
    out = run_bench("gateway.py", "--latency", "--smoke", "--in-process", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for path in (r"in-process step\(\) \(ids\)", r"direct local socket \(ids\)", r"HTTP /v1/embeddings \(token ids, base64\)"):
        assert re.search(rf"{path} adds -?[0-9.]+ ms p50 over direct gRPC", out.stdout), out.stdout
    assert "direct gRPC (ids) adds" not in out.stdout, out.stdout  # the base is not compared with itself


def test_gateway_latency_with_the_engine_inside_florist_serve():
    """--serve-flags=--in-process: no engine server to call directly, so the HTTP paths are
    compared with the engine's step() in the bench's process; --stub cannot go with it."""
    out = run_bench("gateway.py", "--latency", "--smoke", "--in-process", "--serve-flags=--in-process", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "on the engine inside florist serve (--in-process)" in out.stdout, out.stdout
    for path in ("text", "token ids", "token ids, base64"):
        assert re.search(rf"HTTP /v1/embeddings \({path}\) adds -?[0-9.]+ ms p50 over in-process step\(\)", out.stdout), out.stdout
    assert "direct gRPC" not in out.stdout and "local socket" not in out.stdout, out.stdout
    bad = run_bench("gateway.py", "--latency", "--stub", "--serve-flags=--in-process", timeout=60)
    assert bad.returncode == 2 and "drop one" in bad.stderr, bad.stderr


def test_gateway_latency_after_idle_gaps():
    """--gap-ms runs the latency paths again with that much idle time before every request and
    prints one p50 / p90 column per gap; a bad list is refused."""
    out = run_bench("gateway.py", "--latency", "--smoke", "--stub", "--gap-ms", "0,3", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"p50 / p90 ms by the idle time before each request", out.stdout), out.stdout
    assert re.search(r"0 ms idle\s+3 ms idle", out.stdout), out.stdout
    assert re.search(r"HTTP /v1/embeddings \(token ids\)\s+[0-9.]+ / [0-9.]+\s+[0-9.]+ / [0-9.]+", out.stdout), out.stdout
    bad = run_bench("gateway.py", "--latency", "--gap-ms", "5,-1", timeout=60)
    assert bad.returncode == 2 and "--gap-ms takes a comma list" in bad.stderr, bad.stderr
