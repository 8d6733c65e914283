"""Greedy generation through the engine server: what each transport costs per token.

One `python -m florist.server` on a causal LM, and in this process florist's InferenceClient
streaming Generate, batch 1, one request after another, every request --new-tokens long
(ignore_eos):

    grpc     InferenceClient(local=False): the server-streaming Generate RPC
    local    InferenceClient on the server's host: the same stream over the server's local
             socket (florist/server/local.py), what `florist serve`'s gateway uses
    inproc   InProcessClient: the server's handlers on this process's event loop, no transport
             (florist/server/inprocess.py), what `florist serve --in-process`'s gateway uses
    direct   Engine.generate in this process on the same weights (no server): the floor

Per path, p50 over --requests requests: time to the first streamed chunk, milliseconds per token
after it ((total - first) / tokens after the first chunk), and the whole request. Before timing,
each path's tokens are compared with direct's (greedy: the same ids are expected).

    python bench/generate_server.py              # random-weight Qwen3-0.6B geometry, bf16, GPU
    python bench/generate_server.py --model DIR  # a causal LM directory
    python bench/generate_server.py --smoke      # tiny model on the CPU, a few requests
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


async def through_server(address: str, local: bool, prompt: list[int], new_tokens: int, n: int, warmup: int) -> dict:
    from florist.server.client import InferenceClient

    return await streamed(InferenceClient(address, local=local), prompt, new_tokens, n, warmup)


async def in_process(engine, prompt: list[int], new_tokens: int, n: int, warmup: int) -> dict:
    from florist.server.inprocess import InProcessClient, start_in_process

    server = await start_in_process(engine)
    try:
        return await streamed(InProcessClient(server.service), prompt, new_tokens, n, warmup)
    finally:
        await server.stop(grace=None)


async def streamed(client, prompt: list[int], new_tokens: int, n: int, warmup: int) -> dict:
    """Timed Generate streams through `client` (closed at the end)."""
    firsts, totals, per_token, tokens = [], [], [], None
    try:
        for i in range(warmup + n):
            started, first, first_n, ids = time.perf_counter(), None, 0, []
            async for chunk in client.generate(prompt, max_tokens=new_tokens, ignore_eos=True):
                if first is None:
                    first, first_n = time.perf_counter() - started, len(chunk.token_ids)
                ids += chunk.token_ids
            total = time.perf_counter() - started
            tokens = ids
            if i >= warmup:
                firsts.append(first * 1e3)
                totals.append(total * 1e3)
                if len(ids) > first_n:
                    per_token.append((total - first) * 1e3 / (len(ids) - first_n))
        transport = client.transport
    finally:
        await client.close()
    return {"transport": transport, "first_ms": firsts, "total_ms": totals, "per_token_ms": per_token, "tokens": tokens}


def direct(engine, prompt: list[int], new_tokens: int, n: int, warmup: int) -> dict:
    """Engine.generate in this process: a request of new_tokens, and one of a single token (the
    time to the first token); ms per token from the difference."""
    def timed(k: int) -> tuple[float, list[int]]:
        started = time.perf_counter()
        out = engine.generate([prompt], max_tokens=k, ignore_eos=True)[0]
        return (time.perf_counter() - started) * 1e3, list(out.token_ids)

    for _ in range(warmup):
        timed(new_tokens)
        timed(1)
    firsts, totals, per_token, tokens = [], [], [], None
    for _ in range(n):
        first, _ = timed(1)
        total, tokens = timed(new_tokens)
        firsts.append(first)
        totals.append(total)
        per_token.append((total - first) / max(1, new_tokens - 1))
    return {"transport": "in process", "first_ms": firsts, "total_ms": totals, "per_token_ms": per_token, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="causal LM directory (default: build the random Qwen3-0.6B geometry)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few requests: the code path only")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 128; 16 with --smoke)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 64; 8 with --smoke)")
    p.add_argument("--requests", type=int, default=None, help="timed requests per path (default 30; 3 with --smoke)")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per path first (default 3)")
    args = p.parse_args(argv)

    import torch

    from florist import Engine
    from geometries import make_model
    from server import ServerProcess

    device = args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    prompt_tokens = args.prompt_tokens or (16 if args.smoke else 128)
    new_tokens = args.new_tokens or (8 if args.smoke else 64)
    n = args.requests or (3 if args.smoke else 30)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
            # NOTE: a directory name without "reranker": florist serves this Qwen3ForCausalLM as a causal LM.
            path = make_model(Path(tmp) / geometry, geometry, variant="reranker", dtype=torch.float32 if device == "cpu" else torch.bfloat16)
        engine = Engine.from_pretrained(path, device=device, dtype=args.dtype)
        if engine.info.task != "generate":
            raise SystemExit(f"{path} is served as a {engine.info.task} model; this bench needs a causal LM")
        low = min(1000, engine.info.vocab_size // 4)  # clear of special tokens
        prompt = np.random.default_rng(0).integers(low, engine.info.vocab_size, size=prompt_tokens).tolist()
        server = ServerProcess(path, device, args.dtype, max_batch_tokens=16384, spin_ms=2.0)
        try:
            rows = {"direct": direct(engine, prompt, new_tokens, n, args.warmup)}
            for name, local in (("grpc", False), ("local", True)):
                rows[name] = asyncio.run(through_server(server.address, local, prompt, new_tokens, n, args.warmup))
        finally:
            server.stop()
        rows["inproc"] = asyncio.run(in_process(engine, prompt, new_tokens, n, args.warmup))

    print(f"\ngreedy generation, batch 1, {prompt_tokens}-token prompt, {new_tokens} new tokens, {engine.info.model_name} "
          f"({engine.info.device}, {engine.info.dtype}); p50 over {n} requests per path")
    print(f"{'path':<8}{'transport':>12}{'first chunk ms':>16}{'ms / token':>12}{'request ms':>12}   tokens as direct")
    for name, r in rows.items():
        same = "yes" if r["tokens"] == rows["direct"]["tokens"] else "NO"
        print(f"{name:<8}{r['transport']:>12}{statistics.median(r['first_ms']):>16.3f}{statistics.median(r['per_token_ms']):>12.3f}"
              f"{statistics.median(r['total_ms']):>12.2f}   {same}")
    for name in ("grpc", "local", "inproc"):
        extra = statistics.median(rows[name]["per_token_ms"]) - statistics.median(rows["direct"]["per_token_ms"])
        print(f"{name} adds {extra:.3f} ms per token over direct")
    return 0 if all(r["tokens"] == rows["direct"]["tokens"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
