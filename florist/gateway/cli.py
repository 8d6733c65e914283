"""`florist serve`: the engine replicas and the HTTP gateway in one command.

    florist serve                                   # the default model, one replica per GPU (one on CPU)
    florist serve --model DIR --port 8000 --workers 4 --api-key KEY
    florist serve --engines 10.0.0.5:50051,10.0.0.6:50051 --model DIR   # engines started elsewhere
    florist serve --model DIR --device cuda:0 --in-process               # one process: engine inside the gateway

With --workers 1 the gateway runs inside this process; with more, each worker is a process
listening on the same port (SO_REUSEPORT: the kernel spreads connections). With --in-process the
engine is loaded in this process too and the gateway calls its server's handlers directly
(florist/server/inprocess.py). Ctrl-C / SIGTERM stops the workers first, then the engines. This module stays light: `florist --help` imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from florist.cli import port_number
from florist.gateway.config import GatewayConfig

HELP = "serve a model over HTTP: OpenAI, text-embeddings-inference and Cohere-style APIs (starts the engines too)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig(engines=())
    p.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--host", default=d.host, help=f"HTTP address to listen on (default {d.host})")
    p.add_argument("--port", type=port_number, default=d.port, help=f"HTTP port (default {d.port}; 0: any free port, printed at start)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--replicas", type=int, default=None, help="engine replicas to start (default: one per GPU, one on CPU)")
    where.add_argument("--engines", default=None, help="use running engine servers instead: host:port,host:port,...")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or a list cuda:0,cuda:2 (default: every GPU, else the CPU)")
    p.add_argument("--dtype", default=None, help="engine dtype: bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--task", default=None, choices=["embed", "score"], help="override the task read from the model directory (e.g. a Qwen3 reranker whose directory name does not say so)")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="engine attention kernels: auto, varlen, triton, flex or sdpa (engine default: auto on CUDA, sdpa elsewhere)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs each engine replica of a causal LM is sharded over (default 1); replicas default to the GPUs over this")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="token budget of one engine batch (engine default)")
    p.add_argument("--max-pending-tokens", type=int, default=None, help="tokens an engine queues before answering 429 (engine default)")
    p.add_argument("--launch-ahead-ms", type=float, default=None, metavar="MS",
                   help="engine servers launch the batch behind a running one MS before the running one is expected back, so that "
                        "requests arriving meanwhile join it (engine default: 0.8 on GPUs; inf: launch at once)")
    p.add_argument("--busy-poll", action="store_true",
                   help="engine servers keep their event loop spinning while idle: lower batch-1 latency for one CPU core per replica kept busy (GPU engines)")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per HTTP request (client, request line, status, response bytes, seconds) on the florist.access "
                        "logger, to stderr (default: off, as it adds Python work to every request)")
    p.add_argument("--gateway-busy-poll", action="store_true",
                   help="gateway workers keep their event loop turning while no request is in flight, and a lone request polls for its "
                        "engine's reply over the local socket rather than sleeping (batch-1 latency, for a CPU core per worker)")
    p.add_argument("--busy-poll-linger-ms", type=float, default=None, metavar="MS",
                   help="without the busy polls, engine servers and gateway workers keep their event loops turning this long after "
                        "their last request, so a stream of requests finds them awake, then sleep (default: 20 with GPU engines, "
                        "0 on the CPU and for a causal LM's engine servers; 0: off)")
    p.add_argument("--gateway-reply-spin-ms", type=float, default=None, metavar="MS",
                   help="a request alone in a gateway worker polls for its engine's reply over the local socket for up to MS "
                        "rather than sleeping until it lands; CPU is spent only while that request waits (default: 5 with "
                        "--gateway-busy-poll, else 0: off)")
    p.add_argument("--no-local-socket", action="store_true",
                   help="gateway and engines talk gRPC only (by default an engine on this host also serves Embed / Score / Generate on a "
                        "Unix socket, which the gateway uses: less latency per request)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU engines run the batch shapes they will meet before serving (a causal LM: its prefill and decode buckets), "
                        "so kernels compile at start-up rather than while a request of a new shape waits (engine-server --warm-up; "
                        "default: on; --no-warm-up starts faster)")
    p.add_argument("--in-process", action="store_true",
                   help="load the engine inside the gateway's process (one replica on one device, one worker): requests reach it "
                        "without a hop through an engine server's socket, for the lowest batch-1 latency; the engine is not "
                        "restarted if it fails, and HTTP work and batching share one interpreter")
    p.add_argument("--workers", type=int, default=1, help="gateway processes (default 1)")
    p.add_argument("--api-key", default=os.environ.get("FLORIST_API_KEY"), help="require 'Authorization: Bearer KEY' (default: $FLORIST_API_KEY; none: no key)")
    p.add_argument("--payload-limit", type=int, default=d.payload_limit_bytes, help=f"largest request body in bytes (default {d.payload_limit_bytes})")
    p.add_argument("--max-inputs", type=int, default=d.max_inputs, help=f"inputs per request at most (default {d.max_inputs})")
    p.add_argument("--chunk-seqs", type=int, default=None, help="sequences per chunk sent to a replica (default: the engine's batch size)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="tokens per chunk sent to a replica (default: the engine's batch tokens)")
    p.add_argument("--tokenization-workers", type=int, default=None,
                   help=f"tokenizer threads per gateway worker (default: the CPUs over --workers, at least 1 and at most 4; here {tokenization_threads(1)} with one worker)")


def tokenization_threads(workers: int) -> int:
    """Tokenizer threads per gateway worker: the workers share the CPUs (more threads than cores only contend)."""
    return max(1, min(4, (os.cpu_count() or 1) // workers))


def run(args: argparse.Namespace) -> int:
    from florist.gateway.supervisor import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--workers", args.workers), ("--replicas", args.replicas), ("--max-inputs", args.max_inputs), ("--payload-limit", args.payload_limit),
                        ("--tensor-parallel-size", args.tensor_parallel_size), ("--tokenization-workers", args.tokenization_workers),
                        ("--max-batch-tokens", args.max_batch_tokens), ("--max-pending-tokens", args.max_pending_tokens),
                        ("--chunk-seqs", args.chunk_seqs), ("--chunk-tokens", args.chunk_tokens)):
        if value is not None and value < 1:  # None: not given, the default applies
            print(f"florist serve: {name} must be at least 1; got {value}", file=sys.stderr)
            return 2
    for name, value in (("--gateway-reply-spin-ms", args.gateway_reply_spin_ms), ("--busy-poll-linger-ms", args.busy_poll_linger_ms),
                        ("--launch-ahead-ms", args.launch_ahead_ms)):
        if value is not None and not value >= 0:
            print(f"florist serve: {name} must be 0 or more", file=sys.stderr)
            return 2
    if args.in_process:
        problem = in_process_problem(args)
        if problem:
            print(f"florist serve: --in-process {problem}", file=sys.stderr)
            return 2
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip()) if args.engines else ()
    unaddressed = [e for e in engines if ":" not in e]  # gRPC would read "host" as host:443 and wait for it
    if unaddressed:
        print(f"florist serve: --engines takes host:port addresses (or gRPC targets such as unix:PATH); got {', '.join(unaddressed)}", file=sys.stderr)
        return 2
    # --in-process: one event loop serves HTTP and the engine, so either busy poll turns it.
    busy_poll = args.gateway_busy_poll or (args.in_process and args.busy_poll)
    config = GatewayConfig(
        engines=engines, model=args.model, host=args.host, port=args.port, api_key=args.api_key or None,
        payload_limit_bytes=args.payload_limit, max_inputs=args.max_inputs, chunk_seqs=args.chunk_seqs, chunk_tokens=args.chunk_tokens,
        tokenization_workers=args.tokenization_workers or tokenization_threads(args.workers), reuse_port=args.workers > 1,
        local_socket=not args.no_local_socket, busy_poll=busy_poll, reply_spin_ms=args.gateway_reply_spin_ms,
        busy_poll_linger_ms=args.busy_poll_linger_ms, access_log=args.access_log,
    )
    passed = (("--model", args.model), ("--dtype", args.dtype), ("--task", args.task), ("--attention-backend", args.attention_backend), ("--max-batch-tokens", args.max_batch_tokens), ("--max-pending-tokens", args.max_pending_tokens),
              ("--tensor-parallel-size", args.tensor_parallel_size if args.tensor_parallel_size > 1 else None), ("--busy-poll-linger-ms", args.busy_poll_linger_ms),
              ("--launch-ahead-ms", args.launch_ahead_ms))
    engine_args = [a for flag, value in passed if value is not None for a in (flag, str(value))] + (["--busy-poll"] if args.busy_poll else [])
    engine_args += ["--local-socket", "off"] if args.no_local_socket else []
    engine_args += [] if args.warm_up else ["--no-warm-up"]
    try:
        if args.in_process:
            return _serve_in_process(config, args)
        return serve(config, workers=args.workers, engine_args=engine_args, device=args.device, replicas=args.replicas,
                     tensor_parallel=args.tensor_parallel_size)
    except (ConnectionError, OSError, RuntimeError) as e:
        print(f"florist serve: {e}", file=sys.stderr)
        return 1


def in_process_problem(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run --in-process (None: they can)."""
    if args.engines:
        return "loads the engine itself; drop --engines"
    if args.workers != 1:
        return "runs one gateway worker (the engine's process); drop --workers"
    if (args.replicas or 1) != 1:
        return "runs one engine replica; drop --replicas"
    if args.tensor_parallel_size != 1:
        return "runs one engine on one device; drop --tensor-parallel-size"
    if args.device and "," in args.device:
        return f"runs one engine on one device; --device {args.device} names several"
    return None


def _serve_in_process(config: GatewayConfig, args: argparse.Namespace) -> int:
    from florist.gateway.supervisor import serve_engine_in_process
    from florist.server.config import ServerConfig

    server_config = ServerConfig(max_batch_tokens=args.max_batch_tokens, launch_ahead_ms=args.launch_ahead_ms,
                                 **({"max_pending_tokens": args.max_pending_tokens} if args.max_pending_tokens is not None else {}))

    def load_engine():
        from florist import Engine
        from florist.server.cli import prepare

        engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, task=args.task, attention_backend=args.attention_backend)
        prepare(engine, warm_up=args.warm_up, max_batch_tokens=args.max_batch_tokens, max_batch_seqs=server_config.max_batch_seqs)
        return engine

    return serve_engine_in_process(config, load_engine, server_config)
