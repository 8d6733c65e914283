"""Where a batch-1 HTTP request spends its time, phase by phase.

`florist serve` runs in a child process started through this script, which first wraps the
functions on a request's path with `time.perf_counter` stamps at their entry and exit (aiohttp's
protocol, the route's JSON, the pipeline, the dispatcher, the engine client, the inference
service, the batcher's launch and collection, the response's write). A lean keep-alive client
(bench/gateway.py's) sends requests of pre-tokenized ids one after another; for each request the
stamps that fall inside its round trip are read against the moment the client began it
(perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process on the host).

    python bench/phases.py --geometry qwen3-0.6b --in-process [--requests 600] [--tokens 128]
    python bench/phases.py --geometry qwen3-0.6b --serve-flags="--busy-poll"
    python bench/phases.py --smoke     # a tiny model on the CPU, a few requests: the code path only

Prints one row per stamp: the median microseconds after the request began, and how many requests
saw it. With the engine in a process of its own (no --in-process) only the gateway's side is
stamped: the engine server's share is the gap around "engine client". The stamps cost ~1 us each
(a CUDA step's own phases, from `Engine.step` to the output copy, are a dozen of them).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import shutil
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # florist_procs: `florist serve` in a subprocess

# (module, class or None, function, label): the request's path, in the order a request meets it.
PROBES = [
    ("aiohttp.web_protocol", "RequestHandler", "data_received", "bytes in (aiohttp)"),
    ("florist.gateway.jsonio", None, "read_json", "JSON read"),
    ("florist.gateway.pipeline", "Pipeline", "embed", "pipeline"),
    ("florist.gateway.tokenization", "Tokenization", "encode", "ids checked"),
    ("florist.gateway.dispatch", "Dispatcher", "embed", "dispatcher"),
    ("florist.server.client", "InferenceClient", "embed", "engine client"),
    ("florist.server.inprocess", "InProcessClient", "embed", "engine client"),
    ("florist.server.service", "InferenceService", "Embed", "Embed handler"),
    ("florist.server.batcher", "Batcher", "run", "batcher"),
    ("florist.server.batcher", "Batcher", "_launch_next", "step() launch"),
    ("florist.server.scheduler", "Scheduler", "next_batch", "batch formed"),
    ("florist.engine.engine", "Engine", "step", "engine step"),
    ("florist.engine.graph_runner", "GraphRunner", "run", "graph path"),
    ("florist.engine.staging", "InputStaging", "send", "input copy"),
    ("torch.cuda", "CUDAGraph", "replay", "graph replay"),
    ("florist.engine.lazy", "LazyTensor", "from_device", "output copy"),
    ("florist.server.batcher", "Batcher", "_copy_out", "result copied out"),
    ("florist.server.batcher", "Batcher", "_collect", "rows handed over"),
    ("florist.gateway.jsonio", None, "response", "JSON response"),
    ("aiohttp.web_protocol", "RequestHandler", "finish_response", "response written"),
]


# -- the server side (a child process) --------------------------------------------------------------
def _stamped(fn, label: str, stamps: list):
    clock = time.perf_counter
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            stamps.append((label + " >", clock()))
            try:
                return await fn(*args, **kwargs)
            finally:
                stamps.append((label + " <", clock()))
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            stamps.append((label + " >", clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                stamps.append((label + " <", clock()))
    return wrapper


def serve_stamped(out: str, florist_args: list[str]) -> int:
    """`florist florist_args` (a `serve` command) with the probes in place; the stamps go to
    `out` at exit."""
    import importlib

    stamps: list[tuple[str, float]] = []
    for module, cls, name, label in PROBES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, name, _stamped(getattr(owner, name), label, stamps))

    def dump() -> None:
        Path(out).write_text("".join(f"{label}\t{t:.9f}\n" for label, t in stamps))

    atexit.register(dump)
    from florist.cli import main as florist_main

    return florist_main(florist_args)


# -- the client side ---------------------------------------------------------------------------------
def phases(requests: list[tuple[float, float]], stamps: list[tuple[str, float]]) -> list[tuple[str, float, int]]:
    """(label, median us after the request began, requests that saw it) for each stamp label,
    its first occurrence inside each request's round trip; sorted by the median. An exit stamp
    ("X <") counts only after its entry ("X >") in the same round trip: one that lands early in
    a request is the previous request's function returning after its client had the reply."""
    stamps = sorted(stamps, key=lambda s: s[1])
    times = np.array([t for _, t in stamps])
    seen: dict[str, list[float]] = {}
    for began, ended in requests:
        labels = set()
        for i in range(int(np.searchsorted(times, began)), int(np.searchsorted(times, ended))):
            label = stamps[i][0]
            if label.endswith(" <") and label[:-1] + ">" not in labels:
                continue
            if label not in labels:
                labels.add(label)
                seen.setdefault(label, []).append((stamps[i][1] - began) * 1e6)
    return sorted(((label, float(np.median(v)), len(v)) for label, v in seen.items()), key=lambda r: r[1])


def run(args) -> int:
    from florist_procs import serve
    from gateway import HttpClient, latency_model

    from florist.engine.model_dir import read_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-phases-"))
    server = None
    try:
        model = latency_model(args, tmp)
        stamps_file = tmp / "stamps.tsv"
        server, url = serve("--model", model, "--device", args.device, *(["--in-process"] if args.in_process else []), *shlex.split(args.serve_flags),
                            launcher=[sys.executable, __file__, "--serve-stamped", str(stamps_file), "--"])
        vocab = read_model_dir(model).config.vocab_size
        rng = np.random.default_rng(0)
        ids = rng.integers(min(1000, vocab // 4), vocab, size=args.tokens).tolist()
        client = HttpClient(url)
        body = {"input": [ids], "encoding_format": "base64"}
        warmup, n = (3, 10) if args.smoke else (args.warmup, args.requests)
        for _ in range(warmup):
            client.embed(body)
        requests = []
        for _ in range(n):
            began = time.perf_counter()
            client.embed(body)
            requests.append((began, time.perf_counter()))
        client.close()
        code, server = server.stop(signal.SIGINT, timeout_s=60), None
        if code != 0:
            raise SystemExit(f"florist serve exited {code}")
        stamps = [(label, float(t)) for label, t in (line.split("\t") for line in stamps_file.read_text().splitlines())]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rt = np.array([b - a for a, b in requests]) * 1e3
    where = "the engine in the gateway's process" if args.in_process else "the engine in a process of its own (its side not stamped)"
    print(f"batch-1 requests of {args.tokens} token ids (base64 rows), {n} one after another, {where}; "
          f"round trip p50 {np.percentile(rt, 50):.3f} ms, p90 {np.percentile(rt, 90):.3f} ms")
    print(f"{'stamp':<32} {'us after the request began':>27} {'requests':>9}")
    for label, us, count in phases(requests, stamps):
        print(f"{label:<32} {us:>27.1f} {count:>9}")
    print(f"{'the client has the reply':<32} {float(np.median(rt)) * 1e3:>27.1f} {n:>9}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-stamped"]:
        return serve_stamped(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", default="qwen3-0.6b", help="random-weight model of this geometry (bench/geometries.py); default qwen3-0.6b")
    p.add_argument("--model", help="a model directory instead of --geometry")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--in-process", action="store_true", help="florist serve --in-process: the engine's side is stamped too")
    p.add_argument("--serve-flags", default="", help='more florist serve flags, given with "=": --serve-flags="--busy-poll"')
    p.add_argument("--tokens", type=int, default=128, help="token ids per request (default 128)")
    p.add_argument("--requests", type=int, default=600, help="timed requests (default 600)")
    p.add_argument("--warmup", type=int, default=150, help="untimed requests first (default 150)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, a few requests: the code path only")
    args = p.parse_args(argv)
    if args.smoke:
        args.geometry, args.device, args.in_process, args.tokens = "tiny-qwen3", "cpu", True, 16
    if args.model:
        args.geometry = None  # latency_model: a model directory, not a geometry
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
