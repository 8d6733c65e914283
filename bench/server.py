"""The inference server against calling `engine.step()` directly, same model, same run.

Throughput, embeddings/s. Direct runs the batches the server's scheduler forms (FCFS under
--max-batch-tokens) with step(), two batches in flight, host batching included.
    rounds         rounds of --requests single-sequence --tokens-token requests, each round sent
                   at once and awaited as a whole: a barrier between rounds (the device idles
                   while a round drains and the next arrives); direct runs one round's batches.
    stream, 1 seq  the same requests as a continuous stream: --requests outstanding at all times
                   (a new one sent as each finishes), --rounds x --requests of them; direct runs
                   all of them as one FCFS queue.
    stream, N seqs requests of --seqs-per-request sequences each (one Embed call), --stream-depth
                   in flight, --stream-requests of them; direct as above.
Before timing, direct runs each batch shape twice (its first sight, then its capture), and the
server gets two rounds and one stream of the single-sequence requests: with few requests (e.g.
--requests 40 --rounds 1) a first sight or capture of 33-45 ms inside a timed burst of tens of ms
otherwise moved the single-sequence rows by tens of percent.
Latency: --latency-tokens batch-1 requests one after another, p50 / p90 / p99 round trip vs a
direct step() + result copy, with two clients: a plain synchronous gRPC client (a channel and a
unary stub, as a user writes it; it costs less per call than grpc.aio) and florist's grpc.aio
InferenceClient (what the gateway uses). The client is not under test; both rows are printed,
and a Health round trip with each (it never touches the engine) shows the gRPC floor. The server
runs on uvloop when it is installed (the table's last line says), the bench's clients on asyncio.
The server runs with --timing-metadata, so each sync Embed and Health round trip is also cut in
three by its handler's entry and exit (same host, same monotonic clock): client to handler, in
the handler, handler to client. A last latency row runs the server's Batcher in this process on
its own event loop (uvloop when installed, as the server), with no gRPC: what the scheduling and
event-loop layer costs over direct step(), apart from the transport.

The same batch-1 round trip also goes over the server's local socket (florist/server/local.py,
what a gateway on the same host uses): with florist's InferenceClient (asyncio) and with a
blocking client, plus a Health call with the latter (that transport's floor); each client once
sleeping until the reply lands and once polling for it (--client-spin-ms, as
`florist serve --busy-poll`'s gateway does), which saves the client process its wake-up.

Outputs are checked before timing (cosine >= 0.999 against the embedded API). With --busy-poll
on (or both) the server runs with --busy-poll (its event loop never sleeps). The server is run
once per --spin-ms value (how long it polls a launched batch before waiting in a thread), so
the cheaper way to await results shows in the table.

    python bench/server.py                         # random-weight Qwen3-0.6B geometry, bf16, GPU
    python bench/server.py --model DIR             # a model directory
    python bench/server.py --smoke                 # tiny model on the CPU, a few requests
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from florist.server.scheduler import Request, Scheduler  # noqa: E402


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


class ServerProcess:
    """`python -m florist.server` on a free port; the port is read from its start-up line."""

    def __init__(self, model: Path, device: str, dtype: str | None, max_batch_tokens: int, spin_ms: float, busy_poll: bool = False):
        cmd = [sys.executable, "-m", "florist.server", "--model", str(model), "--port", "0", "--device", device,
               "--max-batch-tokens", str(max_batch_tokens), "--spin-ms", str(spin_ms), "--metrics-port", "0", "--timing-metadata"]
        if busy_poll:
            cmd.append("--busy-poll")
        if dtype:
            cmd += ["--dtype", dtype]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if device == "cpu":  # NOTE: two processes share the cores; more threads each only contend
            env["OMP_NUM_THREADS"] = "1"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        for line in self.proc.stdout:
            if "listening on " in line:
                self.address = line.split("listening on ")[1].split(",")[0].strip()
                self.local_socket = line.split("local socket ")[1].split(",")[0].strip() if "local socket " in line else None
                self.metrics_url = line.split("metrics on ")[1].strip() if "metrics on " in line else None
                self.event_loop = "uvloop" if ", uvloop)" in line else "asyncio"
                return
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"the server did not start:\n{self.log.read()[-4000:]}")

    def stop(self) -> None:
        from florist.gateway.processes import terminate

        terminate([self.proc], 30)


# -- direct step() ------------------------------------------------------------------------------
def fcfs_batches(seqs: list[np.ndarray], max_batch_tokens: int, max_batch_seqs: int) -> list[list[np.ndarray]]:
    """The batches the server's scheduler forms when all the sequences are queued at once."""
    s = Scheduler(max_batch_tokens, max_batch_seqs, max_pending_tokens=1 << 40)
    for k, x in enumerate(seqs):
        s.add(Request([len(x)], payload=k))
    out = []
    while (b := s.next_batch()) is not None:
        out.append([seqs[r.payload] for r, _ in b.seqs])
    return out


def run_batches(engine, batches) -> float:
    """Seconds to run `batches` with step(), two in flight, results copied to the host."""
    from florist.engine.batch import HostBatch

    t = time.perf_counter()
    in_flight = []
    for b in batches:
        in_flight.append(engine.step(HostBatch.from_sequences(b)))
        if len(in_flight) > 1:
            in_flight.pop(0).numpy()
    for lazy in in_flight:
        lazy.numpy()
    return time.perf_counter() - t


def direct(engine, w) -> dict:
    """Direct rates of each throughput scenario and the batch-1 latency (the first run warms up)."""
    def batches(seqs):
        return fcfs_batches(seqs, w.max_batch_tokens, 256)  # 256: the server's max_batch_seqs

    rounds, single, multi = batches(w.seqs), batches(w.seqs * w.rounds), batches([x for r in w.multi for x in r])
    # Every batch shape twice before timing: its first sight runs eagerly, its second captures a graph.
    distinct = list({tuple(len(x) for x in b): b for b in rounds + single + multi}.values())
    for _ in range(2):
        run_batches(engine, distinct)
    out = {"rounds": [len(w.seqs) / run_batches(engine, rounds) for _ in range(w.rounds)],
           "single": [len(w.seqs) * w.rounds / run_batches(engine, single)],
           "multi": [w.seqs_per_request * len(w.multi) / run_batches(engine, multi)]}
    out["latency"] = direct_latency(engine, w.latency_seq, w.latency_n, w.warmup)
    out["batcher"] = batcher_latency(engine, w)
    return out


def direct_latency(engine, seq: np.ndarray, n: int, warmup: int) -> list[float]:
    from florist.engine.batch import HostBatch

    return times_ms(lambda: engine.step(HostBatch.from_sequences([seq])).numpy(), n, warmup)


def batcher_latency(engine, w) -> list[float]:
    """Batch-1 round trips through the server's Batcher in this process, no gRPC (ms)."""
    from florist.server.batcher import Batcher
    from florist.server.cli import _run_loop
    from florist.server.scheduler import Scheduler

    async def measure() -> list[float]:
        batcher = Batcher(engine, Scheduler(w.max_batch_tokens, 256, 1 << 22), spin_s=float(w.spin_ms.split(",")[0]) / 1e3)
        batcher.start()
        lens = np.asarray([len(w.latency_seq)], dtype=np.int32)
        try:
            return await atimes_ms(lambda: batcher.run(w.latency_seq, lens), w.latency_n, w.warmup)
        finally:
            await batcher.stop()

    return _run_loop(measure())


# -- through the server ---------------------------------------------------------------------------
def packed(seqs: list[np.ndarray]) -> tuple[bytes, bytes]:
    """One request's tokens already in wire form, so the client's own cost stays small."""
    return np.concatenate(seqs).tobytes(), np.asarray([len(x) for x in seqs], dtype="<i4").tobytes()


def cosine_min(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min())


async def stream(client, requests: list, depth: int) -> float:
    """Seconds to serve `requests` with `depth` of them outstanding at all times."""
    todo = iter(requests)

    async def sender():
        for request in todo:  # shared: each sender takes the next request when its last one is back
            await client.embed(request)

    t = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(depth)))
    return time.perf_counter() - t


async def through_server(address: str, engine, w) -> dict:
    from florist.server.client import InferenceClient

    async with InferenceClient(address, timeout=600, local=False) as client:
        # Correctness first: the server's vectors against the embedded API's.
        got = np.concatenate(await asyncio.gather(*(client.embed([s]) for s in w.seqs[:8])))
        cosine = cosine_min(got, engine.embed([s.tolist() for s in w.seqs[:8]]))
        cosine = min(cosine, cosine_min(await client.embed(packed(w.multi[0])), engine.embed([s.tolist() for s in w.multi[0]])))
        assert cosine >= 0.999, f"server output differs from the embedded API: min cosine {cosine:.6f}"
        singles = [packed([s]) for s in w.seqs]
        rates = []
        # Two rounds and a stream warm up: the batches they form meet their first sight and their
        # capture there (the server's batches depend on arrival, so a timed one may still meet a new one).
        for r in range(w.rounds + 2):
            t = time.perf_counter()
            await asyncio.gather(*(client.embed(x) for x in singles))
            if r >= 2:
                rates.append(len(singles) / (time.perf_counter() - t))
        await stream(client, singles, len(singles))
        single = len(singles) * w.rounds / await stream(client, singles * w.rounds, len(singles))
        multi_requests = [packed(r) for r in w.multi]
        multi = w.seqs_per_request * len(multi_requests) / await stream(client, multi_requests, w.stream_depth)
        latency = await atimes_ms(lambda: client.embed([w.latency_seq]), w.latency_n, w.warmup)
        health = await atimes_ms(client.health, w.latency_n, w.warmup)
    out = {"cosine": cosine, "rounds": rates, "single": [single], "multi": [multi], "latency_aio": latency, "health_aio": health}
    async with InferenceClient(address, timeout=600) as client:  # Embed over the server's local socket
        got = await client.embed([w.latency_seq])
        assert client.transport == "local", "the server advertised no local socket this client could open"
        out["cosine"] = min(out["cosine"], cosine_min(got, engine.embed([w.latency_seq.tolist()])))
        out["latency_local"] = await atimes_ms(lambda: client.embed([w.latency_seq]), w.latency_n, w.warmup)
    async with InferenceClient(address, timeout=600, spin_ms=w.client_spin_ms) as client:  # the same, polling for the reply
        await client.embed([w.latency_seq])
        assert client.transport == "local"
        out["latency_local_poll"] = await atimes_ms(lambda: client.embed([w.latency_seq]), w.latency_n, w.warmup)
    return out


def local_sync_latency(path: str, w) -> dict:
    """Round trips over the local socket with a blocking client (local.BlockingLocalClient)."""
    from florist.server import proto, wire
    from florist.server.local import BlockingLocalClient

    request = proto.EmbedRequest(tokens=wire.encode_tokens([w.latency_seq], proto.TokenBatch))
    out = {}
    for suffix, spin_ms in (("", 0.0), ("_poll", w.client_spin_ms)):
        with BlockingLocalClient(path, timeout=600, spin_s=spin_ms / 1e3) as client:
            out["latency_local_sync" + suffix] = times_ms(lambda: wire.decode_matrix(client.call("Embed", request).embeddings), w.latency_n, w.warmup)
            out["health_local_sync" + suffix] = times_ms(lambda: client.call("Health", proto.HealthRequest()), w.latency_n, w.warmup)
    return out


def times_ms(call, n: int, warmup: int) -> list[float]:
    out = []
    for k in range(warmup + n):
        t = time.perf_counter()
        call()
        if k >= warmup:
            out.append((time.perf_counter() - t) * 1e3)
    return out


async def atimes_ms(call, n: int, warmup: int) -> list[float]:
    out = []
    for k in range(warmup + n):
        t = time.perf_counter()
        await call()
        if k >= warmup:
            out.append((time.perf_counter() - t) * 1e3)
    return out


def scrape(metrics_url: str | None) -> dict[str, float]:
    """The server's request and batch time totals (sum, count) from its /metrics page."""
    import urllib.request

    if metrics_url is None:
        return {}
    out = {}
    for line in urllib.request.urlopen(metrics_url, timeout=30).read().decode().splitlines():
        for key in ('florist_request_seconds_sum{method="Embed"}', 'florist_request_seconds_count{method="Embed"}',
                    "florist_step_seconds_sum", "florist_step_seconds_count"):
            if line.startswith(key + " "):
                out[key.split("{")[0]] = float(line.split()[-1])
    return out


def in_server_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean time inside the server per Embed request (handler entry to response) and per batch
    (launch to collection) between two scrapes: how much of the round trip is transport."""
    out = {}
    for name, key in (("embed_ms", "florist_request_seconds"), ("step_ms", "florist_step_seconds")):
        n = after.get(key + "_count", 0) - before.get(key + "_count", 0)
        if n > 0:
            out[name] = (after[key + "_sum"] - before[key + "_sum"]) / n * 1e3
    return out


def sync_client_latency(address: str, w, metrics_url: str | None = None) -> dict:
    """Round trips with a plain synchronous gRPC client: a channel and a unary stub."""
    import grpc

    from florist.server import proto, wire
    from florist.server.client import CHANNEL_OPTIONS

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        rpc = proto.method_callables(channel)

        def embed():
            response = rpc["Embed"](proto.EmbedRequest(tokens=wire.encode_tokens([w.latency_seq], proto.TokenBatch)), timeout=600)
            wire.decode_matrix(response.embeddings)

        for _ in range(w.warmup):
            embed()
        before = scrape(metrics_url)
        latency = times_ms(embed, w.latency_n, 0)
        inside = in_server_ms(before, scrape(metrics_url))
        request = proto.EmbedRequest(tokens=wire.encode_tokens([w.latency_seq], proto.TokenBatch))
        return {"latency_sync": latency, "inside_sync": inside,
                "health_sync": times_ms(lambda: rpc["Health"](proto.HealthRequest(), timeout=600), w.latency_n, w.warmup),
                "split_embed": split_ms(rpc["Embed"], request, w.latency_n, w.warmup),
                "split_health": split_ms(rpc["Health"], proto.HealthRequest(), w.latency_n, w.warmup)}


def split_ms(method, request, n: int, warmup: int) -> dict[str, list[float]]:
    """Round trips cut in three by the server's handler entry and exit (its trailing metadata
    x-florist-timing, on the same monotonic clock as this process): client to handler, in the
    handler, handler to client (ms each)."""
    from florist.server.service import TIMING_KEY

    out: dict[str, list[float]] = {"total": [], "to_handler": [], "in_handler": [], "to_client": []}
    for k in range(warmup + n):
        sent = time.monotonic_ns()
        _, call = method.with_call(request, timeout=600)
        received = time.monotonic_ns()
        entered, left = map(int, dict(call.trailing_metadata())[TIMING_KEY].split())
        if k >= warmup:
            for key, ns in (("total", received - sent), ("to_handler", entered - sent), ("in_handler", left - entered), ("to_client", received - left)):
                out[key].append(ns / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: build the random Qwen3-0.6B geometry)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few requests: the code path only")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--requests", type=int, default=100, help="single-sequence requests per round, and outstanding in their stream")
    p.add_argument("--tokens", type=int, default=512, help="tokens per throughput sequence")
    p.add_argument("--rounds", type=int, default=10, help="throughput rounds (after two warm-up rounds)")
    p.add_argument("--seqs-per-request", type=int, default=100, help="sequences per request in the multi-sequence stream")
    p.add_argument("--stream-requests", type=int, default=40, help="requests in the multi-sequence stream")
    p.add_argument("--stream-depth", type=int, default=4, help="multi-sequence requests outstanding at all times")
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--latency-n", type=int, default=500)
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the server's own default")
    p.add_argument("--spin-ms", default="2,0", help="comma-separated server --spin-ms values to compare")
    p.add_argument("--client-spin-ms", type=float, default=5.0, help="how long the polling local-socket clients poll for a reply before sleeping (default 5)")
    p.add_argument("--busy-poll", default="off", choices=["off", "on", "both"], help="run the server with --busy-poll (on), without (off), or each spin value both ways")
    w = p.parse_args(argv)
    if w.smoke:
        w.device = w.device or "cpu"
        w.requests, w.tokens, w.latency_tokens = min(w.requests, 8), min(w.tokens, 64), min(w.latency_tokens, 32)
        w.latency_n, w.rounds, w.spin_ms = min(w.latency_n, 10), min(w.rounds, 2), w.spin_ms.split(",")[0]
        w.seqs_per_request, w.stream_requests = min(w.seqs_per_request, 8), min(w.stream_requests, 6)

    import torch

    from florist import Engine

    device = w.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # the server process gets one thread too: a fair comparison
    with tempfile.TemporaryDirectory(prefix="florist-bench-server-") as tmp:
        model = w.model
        if model is None:
            from geometries import make_model

            geometry = "tiny-qwen3" if w.smoke else "qwen3-0.6b"
            t = time.perf_counter()
            model = make_model(Path(tmp) / geometry, geometry, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
            print(f"built a random {geometry} in {time.perf_counter() - t:.1f} s", flush=True)
        engine = Engine.from_pretrained(model, device=device, dtype=w.dtype)
        info = engine.info
        # The server's default budget, so direct step() and the server run the same batches.
        w.max_batch_tokens = w.max_batch_tokens or engine.graph_max_tokens or 16384
        rng = np.random.default_rng(0)
        w.seqs = [rng.integers(0, info.vocab_size, size=w.tokens, dtype=np.int32) for _ in range(w.requests)]
        w.multi = [[rng.integers(0, info.vocab_size, size=w.tokens, dtype=np.int32) for _ in range(w.seqs_per_request)] for _ in range(w.stream_requests)]
        w.latency_seq = rng.integers(0, info.vocab_size, size=w.latency_tokens, dtype=np.int32)
        w.warmup = 3 if w.smoke else 50

        runs = [direct(engine, w)]
        served = {}
        busy = {"off": [False], "on": [True], "both": [False, True]}[w.busy_poll]
        for spin, busy_poll in [(float(x), b) for x in w.spin_ms.split(",") for b in busy]:
            key = f"spin {spin:g} ms" + (", busy poll" if busy_poll else "")
            server = ServerProcess(model, device, w.dtype, w.max_batch_tokens, spin, busy_poll)
            try:
                # Direct step() again while the server process is up (idle): a second process on
                # the device can slow this one's steps, which would not be the server's cost.
                alongside = direct_latency(engine, w.latency_seq, w.latency_n, w.warmup)
                served[key] = asyncio.run(through_server(server.address, engine, w))
                served[key]["direct_alongside"] = alongside
                served[key]["event_loop"] = server.event_loop
                served[key].update(sync_client_latency(server.address, w, server.metrics_url))
                served[key].update(local_sync_latency(server.local_socket, w))
            finally:
                server.stop()
        # Direct once more, after the servers: drift (clocks, other work) shows as a difference.
        runs.append(direct(engine, w))
    d = {k: runs[0][k] + runs[1][k] for k in runs[0]}
    report(info, w, d, served)
    return 0


def report(info, w, d: dict, served: dict) -> None:
    print(f"\n{info.model_name} ({info.family}, {info.device}, {info.dtype}); max_batch_tokens {w.max_batch_tokens}")
    header = f"{'scenario':<66}{'direct step()':>14}"
    width = max([22] + [len(k) + 9 for k in served])
    for key in served:
        header += f"{f'server {key}':>{width}}{'ratio':>8}"
    print(header)
    n_single, n_multi = w.requests * w.rounds, w.stream_requests
    for key, label in (
        ("rounds", f"{w.requests} x {w.tokens} tokens, rounds sent at once, emb/s"),
        ("single", f"{w.tokens}-token requests, stream of {n_single}, {w.requests} in flight, emb/s"),
        ("multi", f"{w.seqs_per_request} x {w.tokens}-token requests, stream of {n_multi}, {w.stream_depth} in flight, emb/s"),
    ):
        rate = statistics.median(d[key])
        row = f"{label:<66}{rate:>14.1f}"
        for res in served.values():
            r = statistics.median(res[key])
            row += f"{r:>{width}.1f}{r / rate:>8.3f}"
        print(row)
    d_lat = percentiles(d["latency"])
    for key, client in (("latency_sync", "sync gRPC client"), ("latency_aio", "grpc.aio client"),
                        ("latency_local_sync", "local socket, blocking"), ("latency_local", "local socket, asyncio"),
                        ("latency_local_sync_poll", "local, blocking, polling"), ("latency_local_poll", "local, asyncio, polling")):
        for q in ("p50", "p90", "p99"):
            row = f"{f'{w.latency_tokens}-token batch-1 round trip {q}, ms, {client}':<66}{d_lat[q]:>14.3f}"
            for res in served.values():
                ms = percentiles(res[key])[q]
                row += f"{f'{ms:.3f} ({ms - d_lat[q]:+.3f})':>{width}}{ms / d_lat[q]:>8.3f}"
            print(row)
    b_lat, spin = percentiles(d["batcher"]), float(w.spin_ms.split(",")[0])
    label = f"same through the Batcher in this process (no gRPC, spin {spin:g} ms), p50 / p99, ms"
    row = f"{label:<66}"
    row += f"{b_lat['p50']:>8.3f} / {b_lat['p99']:.3f} ({b_lat['p50'] - d_lat['p50']:+.3f} p50)"
    print(row)
    row = f"{'direct step() p50 / p99 while the server process is up (idle), ms':<66}{'-':>14}"
    for res in served.values():
        a = percentiles(res["direct_alongside"])
        cell = f"{a['p50']:.3f} / {a['p99']:.3f}"
        row += f"{cell:>{width}}{'':>8}"
    print(row)
    for key, client in (("health_sync", "sync gRPC client"), ("health_aio", "grpc.aio client"), ("health_local_sync", "local socket, blocking"),
                        ("health_local_sync_poll", "local, blocking, polling")):
        row = f"{f'Health round trip p50, ms, {client} (the floor)':<66}{'-':>14}"
        for res in served.values():
            row += f"{percentiles(res[key])['p50']:>{width}.3f}{'':>8}"
        print(row)
    for key, what in (("split_embed", "Embed"), ("split_health", "Health")):
        row = f"{f'{what} p50 split, ms: client->handler / handler / handler->client':<66}{'-':>14}"
        for res in served.values():
            parts = [statistics.median(res[key][part]) for part in ("to_handler", "in_handler", "to_client")]
            row += f"{' / '.join(f'{v:.3f}' for v in parts):>{width}}{'':>8}"
        print(row)
    for key, label in (("embed_ms", "inside the server per Embed (mean), ms, sync client"), ("step_ms", "its batch, launch to collection (mean), ms")):
        row = f"{label:<66}{'-':>14}"
        for res in served.values():
            v = res.get("inside_sync", {}).get(key)
            row += f"{(f'{v:.3f}' if v is not None else '-'):>{width}}{'':>8}"
        print(row)
    print("min cosine, server vs embedded API: " + ", ".join(f"{r['cosine']:.6f}" for r in served.values()))
    print("server event loop: " + ", ".join(r["event_loop"] for r in served.values()) + "; bench clients: asyncio")
    # A stream keeps the server's batches full (the direct side's) only if enough sequences are
    # outstanding: two batches in flight and the next one queued.
    full = min(256, max(1, w.max_batch_tokens // w.tokens))
    for outstanding, what in ((w.requests, "single-sequence stream"), (w.stream_depth * w.seqs_per_request, "multi-sequence stream")):
        if outstanding < 3 * full:
            print(f"note: the {what} keeps {outstanding} sequences outstanding, under 3 full batches ({3 * full}); "
                  "the server's batches are smaller than direct's there")


if __name__ == "__main__":
    sys.exit(main())
