"""The inference server against calling `engine.step()` directly, same model, same run.

    (a) throughput: rounds of 100 x 512-token requests sent at once, through the server
        (`florist engine-server` in a subprocess, the async client here) vs the same sequences
        batched the same way (the server's scheduler) and run with step(), two batches in flight;
    (b) latency: 128-token batch-1 requests one after another; p50 / p90 / p99 round trip vs a
        direct step() + result copy.

Outputs are checked before timing (cosine >= 0.999 against the embedded API). The server is run
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
import signal
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

    def __init__(self, model: Path, device: str, dtype: str | None, max_batch_tokens: int, spin_ms: float):
        cmd = [sys.executable, "-m", "florist.server", "--model", str(model), "--port", "0", "--device", device,
               "--max-batch-tokens", str(max_batch_tokens), "--spin-ms", str(spin_ms)]
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
                return
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"the server did not start:\n{self.log.read()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- direct step() ------------------------------------------------------------------------------
def fcfs_batches(seqs: list[np.ndarray], max_batch_tokens: int, max_batch_seqs: int) -> list[list[np.ndarray]]:
    """The batches the server's scheduler forms when all requests are queued at once."""
    s = Scheduler(max_batch_tokens, max_batch_seqs, max_pending_tokens=1 << 40)
    for k, x in enumerate(seqs):
        s.add(Request([len(x)], payload=k))
    out = []
    while (b := s.next_batch()) is not None:
        out.append([seqs[r.payload] for r, _ in b.seqs])
    return out


def direct_throughput(engine, seqs, max_batch_tokens, max_batch_seqs, rounds: int) -> list[float]:
    from florist.engine.batch import HostBatch

    batches = fcfs_batches(seqs, max_batch_tokens, max_batch_seqs)
    rates = []
    for _ in range(rounds + 1):  # the first round warms up
        t = time.perf_counter()
        in_flight = []
        for b in batches:
            in_flight.append(engine.step(HostBatch.from_sequences(b)))
            if len(in_flight) > 1:
                in_flight.pop(0).numpy()
        for lazy in in_flight:
            lazy.numpy()
        rates.append(len(seqs) / (time.perf_counter() - t))
    return rates[1:]


def direct_latency(engine, seq: np.ndarray, n: int, warmup: int) -> list[float]:
    from florist.engine.batch import HostBatch

    out = []
    for k in range(warmup + n):
        t = time.perf_counter()
        engine.step(HostBatch.from_sequences([seq])).numpy()
        if k >= warmup:
            out.append((time.perf_counter() - t) * 1e3)
    return out


# -- through the server ---------------------------------------------------------------------------
async def through_server(address: str, engine, seqs, latency_seq, rounds: int, latency_n: int, warmup: int) -> dict:
    from florist.server.client import InferenceClient

    async with InferenceClient(address, timeout=600) as client:
        # Correctness first: the server's vectors against the embedded API's.
        got = np.concatenate(await asyncio.gather(*(client.embed([s]) for s in seqs[:8])))
        want = engine.embed([s.tolist() for s in seqs[:8]])
        cosine = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min())
        assert cosine >= 0.999, f"server output differs from the embedded API: min cosine {cosine:.6f}"
        rates = []
        for r in range(rounds + 1):
            t = time.perf_counter()
            await asyncio.gather(*(client.embed([s]) for s in seqs))
            if r:
                rates.append(len(seqs) / (time.perf_counter() - t))
        latencies = []
        for k in range(warmup + latency_n):
            t = time.perf_counter()
            await client.embed([latency_seq])
            if k >= warmup:
                latencies.append((time.perf_counter() - t) * 1e3)
    return {"cosine": cosine, "rates": rates, "latency": latencies}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: build the random Qwen3-0.6B geometry)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few requests: the code path only")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--tokens", type=int, default=512, help="tokens per throughput request")
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--latency-n", type=int, default=500)
    p.add_argument("--rounds", type=int, default=10, help="throughput rounds (after one warm-up round)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the server's own default")
    p.add_argument("--spin-ms", default="2,0", help="comma-separated server --spin-ms values to compare")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.requests, args.tokens, args.latency_tokens = min(args.requests, 8), min(args.tokens, 64), min(args.latency_tokens, 32)
        args.latency_n, args.rounds, args.spin_ms = min(args.latency_n, 10), min(args.rounds, 2), args.spin_ms.split(",")[0]

    import torch

    from florist import Engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # the server process gets one thread too: a fair comparison
    with tempfile.TemporaryDirectory(prefix="florist-bench-server-") as tmp:
        model = args.model
        if model is None:
            from geometries import make_model

            geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
            t = time.perf_counter()
            model = make_model(Path(tmp) / geometry, geometry, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
            print(f"built a random {geometry} in {time.perf_counter() - t:.1f} s", flush=True)
        engine = Engine.from_pretrained(model, device=device, dtype=args.dtype)
        info = engine.info
        # The server's default budget, so direct step() and the server run the same batches.
        args.max_batch_tokens = args.max_batch_tokens or engine.graph_max_tokens or 16384
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, info.vocab_size, size=args.tokens, dtype=np.int32) for _ in range(args.requests)]
        latency_seq = rng.integers(0, info.vocab_size, size=args.latency_tokens, dtype=np.int32)
        warmup = 3 if args.smoke else 50

        direct_rates = direct_throughput(engine, seqs, args.max_batch_tokens, 256, args.rounds)
        direct_ms = direct_latency(engine, latency_seq, args.latency_n, warmup)
        served = {}
        for spin in [float(x) for x in args.spin_ms.split(",")]:
            server = ServerProcess(model, device, args.dtype, args.max_batch_tokens, spin)
            try:
                served[spin] = asyncio.run(through_server(server.address, engine, seqs, latency_seq, args.rounds, args.latency_n, warmup))
            finally:
                server.stop()
        # Direct once more, after the servers: drift (clocks, other work) shows as a difference.
        direct_rates += direct_throughput(engine, seqs, args.max_batch_tokens, 256, args.rounds)
        direct_ms += direct_latency(engine, latency_seq, args.latency_n, warmup)

    d_rate, d_lat = statistics.median(direct_rates), percentiles(direct_ms)
    print(f"\n{info.model_name} ({info.family}, {info.device}, {info.dtype}); max_batch_tokens {args.max_batch_tokens}")
    header = f"{'scenario':<44}{'direct step()':>14}"
    for spin in served:
        header += f"{f'server spin {spin:g} ms':>22}{'ratio':>8}"
    print(header)
    row = f"{f'{args.requests} x {args.tokens} tokens, emb/s (median)':<44}{d_rate:>14.1f}"
    for res in served.values():
        rate = statistics.median(res["rates"])
        row += f"{rate:>22.1f}{rate / d_rate:>8.3f}"
    print(row)
    for q in ("p50", "p90", "p99"):
        row = f"{f'{args.latency_tokens}-token batch-1 round trip {q}, ms':<44}{d_lat[q]:>14.3f}"
        for res in served.values():
            ms = percentiles(res["latency"])[q]
            row += f"{f'{ms:.3f} ({ms - d_lat[q]:+.3f})':>22}{ms / d_lat[q]:>8.3f}"
        print(row)
    print("min cosine, server vs embedded API: " + ", ".join(f"{r['cosine']:.6f}" for r in served.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
