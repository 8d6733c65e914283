"""`florist engine-server`: serve one model over gRPC (florist/server/florist.proto).

    florist engine-server [--model PATH] [--port 50051] [--device cuda:0] [--max-batch-tokens N]
    python -m florist.server [same arguments]

Follows florist.cli's convention (a module with add_arguments(parser) and run(args) -> int);
`add_engine_server_parser` / `run_engine_server` are the same for other argparse set-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from florist.cli import port_number

HELP = "serve a model to the gateway over gRPC (pre-tokenized requests, batched on the device)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from florist.server.config import ServerConfig

    d = ServerConfig()
    p.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    p.add_argument("--port", type=port_number, default=d.port, help=f"gRPC port (default {d.port}; 0: any free port, printed at start)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--task", default=None, choices=["embed", "score"], help="override the task read from the model directory")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="attention kernels: auto (the default on CUDA: chosen per batch shape), varlen, triton, flex or sdpa (the "
                        "default elsewhere); docs/architecture.md says what each is")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes a causal LM is sharded over (default 1); on GPUs its ranks take cuda:0..N-1 of the visible ones "
                        "(choose them with CUDA_VISIBLE_DEVICES)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="token budget of one batch (default: the largest batch the engine replays from a CUDA graph, else 16384)")
    p.add_argument("--max-batch-seqs", type=int, default=d.max_batch_seqs, help=f"sequences in one batch at most (default {d.max_batch_seqs})")
    p.add_argument("--max-pending-tokens", type=int, default=d.max_pending_tokens, help=f"queued tokens beyond which requests get RESOURCE_EXHAUSTED (default {d.max_pending_tokens})")
    p.add_argument("--metrics-port", type=port_number, default=None, help="serve Prometheus /metrics on this port (default: off)")
    p.add_argument("--spin-ms", type=float, default=d.spin_ms, help=f"poll a launched batch this long before waiting in a thread (default {d.spin_ms})")
    p.add_argument("--launch-ahead-ms", type=float, default=None, metavar="MS",
                   help="while a batch runs, launch the next one MS before the running one is expected back (from the device times "
                        "of earlier batches of its size), so that requests arriving meanwhile join it rather than form a small batch "
                        "of their own (default: 0.8 on a GPU engine; inf: launch at once, as a CPU engine does)")
    p.add_argument("--busy-poll", action="store_true",
                   help="keep the event loop spinning while the server is idle instead of sleeping: lower batch-1 latency for one CPU core kept busy (GPU engines; a CPU engine needs that core)")
    p.add_argument("--busy-poll-linger-ms", type=float, default=None, metavar="MS",
                   help="without --busy-poll, keep the event loop turning this long after the server fell idle, so a stream of requests "
                        "finds it awake, then sleep (default: 20 on a GPU engine that embeds or scores, 0 on a CPU engine or a causal LM; 0: off)")
    p.add_argument("--local-socket", default="auto", metavar="PATH|auto|off",
                   help="also serve Embed / Score / Generate on this Unix socket, which clients on this host (the gateway) find through Info and "
                        "use instead of gRPC, for less latency per request (default auto: a path in $XDG_RUNTIME_DIR or the temp "
                        "directory, printed at start; off: gRPC only)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, run the batch shapes a server meets before serving (one sequence of 64 tokens up to --max-batch-tokens, "
                        "eight at each of those sizes, and 1 up to --max-batch-seqs short sequences; a causal LM: prefills of 64 tokens "
                        "up to its prefill graph threshold and a decode step of every batch size bucket), so that kernels compile then "
                        "and not while a request of a new shape waits: on the H200 such a request waited 0.7-1.7 s (default: on; about "
                        "12 s at start for an embedding model with an empty Triton cache, docs/benchmarks.md)")
    p.add_argument("--timing-metadata", action="store_true",
                   help="reply with trailing metadata x-florist-timing: the handler's entry and exit (time.monotonic_ns), for latency breakdowns")


def add_engine_server_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("engine-server", help=HELP, description=HELP)
    add_arguments(p)
    p.set_defaults(_module=__name__)
    return p


def run(args: argparse.Namespace) -> int:
    from florist import Engine
    from florist.server.config import ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {tp}")
    if tp > 1 and args.device and ":" in args.device:
        raise ValueError(f"--tensor-parallel-size {tp} places its ranks on cuda:0..{tp - 1} of the visible GPUs; pick them with "
                         f"CUDA_VISIBLE_DEVICES and --device cuda, not --device {args.device}")
    for name, value in (("--max-batch-tokens", args.max_batch_tokens), ("--max-batch-seqs", args.max_batch_seqs),
                        ("--max-pending-tokens", args.max_pending_tokens)):
        if value is not None and value < 1:  # None: not given, the default applies
            raise ValueError(f"{name} must be at least 1; got {value}")
    if not args.spin_ms >= 0:
        raise ValueError(f"--spin-ms must be 0 or more; got {args.spin_ms}")
    if args.busy_poll_linger_ms is not None and not args.busy_poll_linger_ms >= 0:
        raise ValueError(f"--busy-poll-linger-ms must be 0 or more; got {args.busy_poll_linger_ms}")
    if args.launch_ahead_ms is not None and not args.launch_ahead_ms >= 0:
        raise ValueError(f"--launch-ahead-ms must be 0 or more (inf: launch at once); got {args.launch_ahead_ms}")
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, task=args.task, attention_backend=args.attention_backend,
                                    tensor_parallel_size=tp if tp > 1 else None)
    prepare(engine, warm_up=args.warm_up, max_batch_tokens=args.max_batch_tokens, max_batch_seqs=args.max_batch_seqs)
    config = ServerConfig(
        host=args.host, port=args.port, max_batch_tokens=args.max_batch_tokens, max_batch_seqs=args.max_batch_seqs,
        max_pending_tokens=args.max_pending_tokens, metrics_port=args.metrics_port, spin_ms=args.spin_ms, launch_ahead_ms=args.launch_ahead_ms,
        timing_metadata=args.timing_metadata, busy_poll=args.busy_poll, busy_poll_linger_ms=args.busy_poll_linger_ms,
        local_socket=None if args.local_socket in ("off", "") else args.local_socket,
    )
    _run_loop(_serve(engine, config))
    return 0


run_engine_server = run


def prepare(engine, *, warm_up: bool, max_batch_tokens: int | None, max_batch_seqs: int) -> None:
    """Before serving: on a GPU, the warm-up (--warm-up, the default), so kernels compile and plan
    now rather than while a request of a new shape waits; else one small batch, so the first
    request does not pay for the device context and the allocator (a causal LM: nothing)."""
    from florist.engine.batch import HostBatch
    from florist.server.service import batch_token_budget

    log = logging.getLogger("florist.server")
    warm_up = warm_up and engine.info.device.startswith("cuda")
    if engine.info.task == "generate":
        if warm_up:
            _warm_up_generation(engine.runner, log)
        return
    if warm_up:
        budget = batch_token_budget(engine, max_batch_tokens)
        log.info("warming up: batch shapes up to %d tokens and %d sequences, so that their kernels compile now "
                 "(about 12-16 s with an empty Triton cache; --no-warm-up skips it)", budget, max_batch_seqs)
        done = engine.warm_up(budget, max_batch_seqs)
        log.info("warmed up %d batch shapes up to %d tokens and %d sequences in %.1f s",
                                                 done["shapes"], done["max_tokens"], done["max_seqs"], done["seconds"])
    else:
        engine.step(HostBatch.from_sequences([[0] * 8], [4] if engine.info.task == "score" else None)).numpy()


def _warm_up_generation(generator, log: logging.Logger) -> None:
    """Generator.warm_up, said before and after (the Generate server's own settings: GenerationConfig)."""
    config = generator.config
    log.info("warming up: a prefill of every bucket up to the prefill graph threshold (at most %d tokens) and a decode step of every "
             "batch size bucket up to %d sequences, so that their kernels compile now (--no-warm-up skips it)",
             config.max_prefill_tokens, config.max_num_seqs)
    done = generator.warm_up()
    log.info("warmed up %d prefill rounds up to %d tokens and %d prompts, decodes of %s sequences (%d steps) in %.1f s",
             done["rounds"], done["max_tokens"], done["max_seqs"], ", ".join(map(str, done["decode_rows"])), done["steps"], done["seconds"])


def _run_loop(main):
    """asyncio.run(main) (its result), on uvloop when it is installed: every request makes several trips
    through the event loop (grpc.aio's completions arrive through it), and uvloop's are cheaper
    (~30-40 us less per round trip on the CPU development machine)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def _serve(engine, config) -> None:
    from florist.gcfreeze import freeze_startup_objects
    from florist.server.service import _hostport, start_server

    running = await start_server(engine, config)
    freeze_startup_objects()  # the model, grpc and the server stay for good: no full-GC pauses later
    info = engine.info
    metrics = f", metrics on http://{_hostport(config.host, running.metrics_port)}/metrics" if running.metrics_port else ""
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]  # asyncio or uvloop
    # NOTE: scripts (bench/server.py) read the port from this line; keep "listening on HOST:PORT".
    local = f", local socket {running.local_socket}" if running.local_socket else ""
    print(f"florist engine-server: {info.model_name} ({info.task}, {info.device}, {info.dtype}, {loop_name}) listening on "
          f"{_hostport(config.host, running.port)}{local}{metrics}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(grace=5.0)
    engine.close()  # tensor-parallel workers leave with this rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="florist engine-server", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # InputError / UnsupportedModelError: a message for a person
        print(f"florist engine-server: {e}", file=sys.stderr)
        return 2
