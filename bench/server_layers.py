"""Where a batch-1 Embed's time goes in the engine server, layer by layer (one process, one engine).

    direct     engine.step(HostBatch).numpy(), called on the server's event loop (blocking it)
    batcher    the running server's own Batcher.run(ids, lens), awaited on its event loop: the
               scheduling and polling layer, no gRPC call involved
    handler    the server's Embed implementation (check the ids, batcher, finalize, reply message),
               awaited directly on the same loop with a stand-in call context: no transport
    gRPC       Embed from a synchronous gRPC client in a subprocess (torch-free), cut in three by
               the handler's entry and exit stamps (the server runs with timing metadata):
               client -> handler, in the handler, handler -> client; and a Health round trip

The four run in turn, in rounds, so drift on the host (clocks, other work) spreads over all of
them; each row is the p50 over every round. "gRPC, in the handler" minus "handler" is what a real
call costs the handler beyond its own code; "gRPC" minus "in the handler" is the transport.

    python bench/server_layers.py                  # random-weight Qwen3-0.6B geometry, bf16, GPU
    python bench/server_layers.py --model DIR
    python bench/server_layers.py --busy-poll      # the server's loop never sleeps (ServerConfig.busy_poll)
    python bench/server_layers.py --smoke          # tiny model on the CPU, a few calls
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


# -- the client subprocess: reads "embed N" / "health N" / "quit", answers one JSON line each ------
def client_main(address: str, tokens: int, vocab: int) -> None:
    import grpc

    from florist.server import proto, wire
    from florist.server.client import CHANNEL_OPTIONS
    from florist.server.service import TIMING_KEY

    seq = np.random.default_rng(0).integers(0, vocab, tokens, dtype=np.int32)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        rpc = proto.method_callables(channel)
        embed = proto.EmbedRequest(tokens=wire.encode_tokens([seq], proto.TokenBatch))
        for line in sys.stdin:
            what, n = line.split() if line.strip() != "quit" else ("quit", "0")
            if what == "quit":
                return
            out = []
            for _ in range(int(n)):
                sent = time.monotonic_ns()
                if what == "embed":
                    _, call = rpc["Embed"].with_call(embed, timeout=600)
                    received = time.monotonic_ns()
                    entered, left = map(int, dict(call.trailing_metadata())[TIMING_KEY].split())
                    out.append([(received - sent) / 1e6, (entered - sent) / 1e6, (left - entered) / 1e6, (received - left) / 1e6])
                else:
                    rpc["Health"](proto.HealthRequest(), timeout=600)
                    out.append([(time.monotonic_ns() - sent) / 1e6])
            print(json.dumps(out), flush=True)


class _Context:
    """What the Embed implementation reads of a gRPC call context."""

    def time_remaining(self) -> float:
        return 600.0

    def set_trailing_metadata(self, metadata) -> None:
        pass


async def measure(engine, args) -> dict[str, list[float]]:
    from florist.engine.batch import HostBatch
    from florist.server import proto, wire
    from florist.server.config import ServerConfig
    from florist.server.service import start_server

    running = await start_server(engine, ServerConfig(host="127.0.0.1", port=0, timing_metadata=True, busy_poll=args.busy_poll))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", f"127.0.0.1:{running.port}", "--tokens", str(args.tokens), "--vocab", str(engine.info.vocab_size),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)

    async def ask(what: str, n: int) -> list[list[float]]:
        client.stdin.write(f"{what} {n}\n".encode())
        await client.stdin.drain()
        return json.loads(await client.stdout.readline())

    seq = np.random.default_rng(0).integers(0, engine.info.vocab_size, args.tokens, dtype=np.int32)
    lens = np.asarray([args.tokens], dtype=np.int32)
    request = proto.EmbedRequest(tokens=wire.encode_tokens([seq], proto.TokenBatch))
    out: dict[str, list[float]] = {k: [] for k in ("direct", "batcher", "handler", "grpc", "to_handler", "in_handler", "to_client", "health")}

    async def timed(key: str, call, n: int, keep: bool) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await call()
            if keep:
                out[key].append((time.perf_counter() - t) * 1e3)

    async def direct():
        engine.step(HostBatch.from_sequences([seq])).numpy()

    try:
        for r in range(args.rounds + 1):  # round 0 warms every path up
            keep, n = r > 0, args.per_round
            await timed("direct", direct, n, keep)
            await timed("batcher", lambda: running.batcher.run(seq, lens), n, keep)
            await timed("handler", lambda: running.service._embed(request, _Context()), n, keep)
            rows = await ask("embed", n)
            health = await ask("health", n)
            if keep:
                for key, k in (("grpc", 0), ("to_handler", 1), ("in_handler", 2), ("to_client", 3)):
                    out[key] += [row[k] for row in rows]
                out["health"] += [row[0] for row in health]
        client.stdin.write(b"quit\n")
        await client.stdin.drain()
        await client.wait()
    finally:
        if client.returncode is None:
            client.kill()
        await running.stop(0.5)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: build the random Qwen3-0.6B geometry)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few calls: the code path only")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--tokens", type=int, default=128, help="tokens of the one sequence each call embeds")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every variant, after one warm-up round")
    p.add_argument("--per-round", type=int, default=50, help="calls of each variant per round")
    p.add_argument("--busy-poll", action="store_true", help="run the server with ServerConfig.busy_poll (its loop never sleeps)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        client_main(args.client, args.tokens, args.vocab)
        return 0
    if args.smoke:
        args.device, args.rounds, args.per_round, args.tokens = args.device or "cpu", 1, 3, min(args.tokens, 32)

    import torch

    from florist import Engine
    from florist.server.cli import _run_loop

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="florist-bench-layers-") as tmp:
        model = args.model
        if model is None:
            from geometries import make_model

            geometry = "tiny-qwen3" if device == "cpu" else "qwen3-0.6b"
            model = make_model(Path(tmp) / geometry, geometry, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
        engine = Engine.from_pretrained(model, device=device)
        out = _run_loop(measure(engine, args))
    loop = "uvloop" if "uvloop" in sys.modules else "asyncio"
    print(f"\n{engine.info.model_name} ({engine.info.device}, {engine.info.dtype}); {args.tokens}-token batch-1 Embed, "
          f"{args.rounds} rounds x {args.per_round} calls of each, server event loop: {loop}{', busy poll' if args.busy_poll else ''}")
    med = {k: statistics.median(v) for k, v in out.items()}
    for key, label in (("direct", "direct step() on the server's loop"), ("batcher", "the server's Batcher.run, no gRPC call"),
                       ("handler", "the Embed implementation, no transport"), ("grpc", "gRPC Embed round trip (sync client)"),
                       ("to_handler", "  client -> handler"), ("in_handler", "  in the handler"), ("to_client", "  handler -> client"),
                       ("health", "gRPC Health round trip (the transport floor)")):
        versus = f"   ({med[key] - med['direct']:+.3f} vs direct)" if key in ("batcher", "handler", "grpc", "in_handler") else ""
        print(f"{label:<48} p50 {med[key]:8.3f} ms{versus}")
    print(f"a real call costs the handler {med['in_handler'] - med['handler']:+.3f} ms beyond its own code; "
          f"transport {med['grpc'] - med['in_handler']:.3f} ms (Health {med['health']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
