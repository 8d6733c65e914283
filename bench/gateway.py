"""The gateway's own cost on the CPU: tokenization + HTTP for 512-token inputs, in requests/s.

    (a) tokenization alone, batch 1, one thread: florist's TextProcessor vs the transformers
        tokenizer called the way sentence-transformers calls it;
    (b) HTTP, batch 1, C concurrent clients (in their own process): `florist serve` (aiohttp,
        uvloop when installed) in front of a stub engine server (the real gRPC server and
        scheduler, no model: every row is a constant vector), so what is measured is JSON,
        validation, tokenization, the gRPC hop and the response, not the model;
    (c) the baseline, same load: FastAPI + uvicorn, a pydantic request model, and the
        transformers tokenizer as sentence-transformers calls it, answering the same response
        without any engine hop (skipped when fastapi / uvicorn are not installed);
    (d) with --latency (the GPU figure): what HTTP adds over gRPC, below.

--latency: one engine replica (`florist serve --replicas 1`, or with --stub the stub engine
server behind `florist serve --engines`) and, in this process, two clients of about the same
cost, each the plain blocking kind a user would write:

    direct gRPC   a blocking stub on one channel (grpc.insecure_channel), the ids packed as
                  florist.proto asks, the reply's matrix read with numpy
    HTTP          one keep-alive connection (TCP_NODELAY), each request written in one send,
                  the reply read by its Content-Length; JSON encoded and decoded per request
                  with the standard library (as a user's client would)

Batch-1 requests of 128 tokens go one after another, the paths in turn (direct gRPC with the
ids; direct to the engine server's local socket, the hop the gateway itself takes on one host,
when it serves one; POST /v1/embeddings with the text, with the same ids, and with the ids and
base64 rows as OpenAI's client asks), so a change of load or clock hits all alike; 100 warm-up
rounds are not counted. --in-process also times `engine.step()` on the same model in this
process, in a loop of its own before the others (in turn with them, its steps and the server's
would alternate between two CUDA contexts on one GPU, slowing both). The difference of the HTTP
paths' p50 from the direct path's is what the gateway adds: parsing, checks, tokenization, the
hop from the gateway and the JSON response. Every path's vector is checked to be the same
first. --gap-ms runs it all again with idle time before every request (sparse traffic).
With --serve-flags=--in-process, florist serve holds the engine itself: there is no engine server
to call directly, so the HTTP paths are compared with this process's `engine.step()` when
--in-process is given too (what the whole HTTP stack adds), and only listed otherwise.

The model is all-MiniLM-L6-v2 (below) unless --model or --geometry (a random-weight model of
bench/geometries.py) names another.
The line "gateway JSON / event loop" says whether orjson and uvloop were importable (florist
serve runs in the same Python environment); without them the gateway is slower.

The model is all-MiniLM-L6-v2's tokenizer and configuration with max_seq_length raised to 512
(its position table has 512 entries), so inputs of exactly 512 tokens are accepted.

    python bench/gateway.py                      # 10 s per measurement, 16 clients
    python bench/gateway.py --clients 4 --seconds 20 --workers 2
    python bench/gateway.py --local-socket       # the gateway reaches the stub engine over its local socket
    python bench/gateway.py --latency --model DIR --device cuda   # (d) on the GPU: what HTTP adds over gRPC, p50
    python bench/gateway.py --latency --stub     # (d) against the stub engine: the gateway's cost on a CPU
    python bench/gateway.py --latency --geometry qwen3-0.6b --in-process   # (d) layer by layer, engine to HTTP
    python bench/gateway.py --latency --geometry qwen3-0.6b --gap-ms 0,10,50   # (d) with idle time before each request
    python bench/gateway.py --latency --geometry qwen3-0.6b --in-process --serve-flags=--in-process   # (d) one process: HTTP over step()
    python bench/gateway.py --smoke              # (a)-(d) a second or a few requests each, CPU
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the baseline handler's annotations
# at run time, and they name a class local to baseline_main.
import argparse
import base64
import contextlib
import json
import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


# -- the model directory and the inputs ---------------------------------------------------------
def make_model_dir(tmp: Path, max_len: int) -> Path:
    from florist.engine.model_dir import default_model_path

    src, dst = default_model_path(), tmp / "all-MiniLM-L6-v2-512"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "sentence_bert_config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "sentence_bert_config.json").read_text())
    (dst / "sentence_bert_config.json").write_text(json.dumps(dict(cfg, max_seq_length=max_len)))
    return dst


def make_texts(model_dir: Path, n: int, tokens: int, seed: int = 0) -> list[str]:
    """n distinct texts of exactly `tokens` tokens (CLS and SEP included)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    candidates = sorted(w for w in tok.get_vocab() if w.isascii() and w.isalpha() and len(w) > 2)
    words = [w for w, e in zip(candidates, tok.encode_batch(candidates, add_special_tokens=False)) if len(e.ids) == 1]
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, size=tokens - 2)) for _ in range(n)]
    lens = {len(e.ids) for e in tok.encode_batch(texts)}
    assert lens == {tokens}, f"texts of {lens} tokens; expected {tokens}"
    return texts


# -- the stub engine (a subprocess) -------------------------------------------------------------
class _Rows:
    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def numpy(self) -> np.ndarray:
        return self.rows

    def ready(self) -> bool:
        return True


class StubEngine:
    """What the inference server needs of an engine, with no model behind it."""

    def __init__(self, model_dir: Path):
        from florist.engine.engine import ModelInfo
        from florist.engine.model_dir import read_model_dir

        md = read_model_dir(model_dir)
        p = md.pipeline
        self.info = ModelInfo(model_name=md.name, model_path=str(md.path), family=md.config.family, task=p.task, dimensions=md.config.hidden_size,
                              max_input_tokens=p.max_seq_length, vocab_size=md.config.vocab_size, dtype="float32", device="cpu", pooling=p.pooling,
                              normalize=p.normalize, prompts=p.prompt_dict, default_prompt_name=p.default_prompt_name, score_activation="identity",
                              native_int8=False, tokenizer=str(md.tokenizer_file))
        self.row = np.linspace(-1, 1, self.info.dimensions, dtype=np.float32)

    def step(self, batch) -> _Rows:
        return _Rows(np.broadcast_to(self.row, (batch.num_seqs, self.row.size)).copy())


def stub_server_main(model_dir: str, conn, local_socket: bool = False) -> None:
    from florist.server.service import ServerConfig, ServerThread

    with ServerThread(StubEngine(Path(model_dir)), ServerConfig(port=0, local_socket="auto" if local_socket else None)) as srv:
        conn.send(srv.address)
        conn.recv()  # until told to stop


# -- the baseline (a subprocess): FastAPI + uvicorn + the sentence-transformers tokenizer --------
def baseline_main(model_dir: str, conn) -> None:
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_len = json.loads((Path(model_dir) / "sentence_bert_config.json").read_text())["max_seq_length"]
    row = np.linspace(-1, 1, 384, dtype=np.float32).tolist()

    class EmbeddingRequest(BaseModel):
        input: str | list[str]
        model: str | None = None
        encoding_format: str = "float"

    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingRequest):  # a plain def: FastAPI runs it on its thread pool
        texts = [req.input] if isinstance(req.input, str) else req.input
        # What SentenceTransformer.tokenize does (padding, longest_first truncation, tensors).
        batch = tokenizer(texts, padding=True, truncation="longest_first", return_tensors="pt", max_length=max_len)
        n = int(batch["attention_mask"].sum())
        return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": row} for i in range(len(texts))],
                "model": req.model, "usage": {"prompt_tokens": n, "total_tokens": n}}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    conn.send(f"http://127.0.0.1:{sock.getsockname()[1]}")
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


# -- the load (a subprocess) ----------------------------------------------------------------------
def load_main(url: str, bodies: list[bytes], clients: int, warmup_s: float, seconds: float, conn) -> None:
    import asyncio

    import aiohttp

    async def main():
        latencies: list[float] = []
        counting = asyncio.Event()
        errors: list[str] = []

        async def client(k: int, session):
            i = k
            while True:
                body = bodies[i % len(bodies)]
                i += clients
                t = time.perf_counter()
                async with session.post(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}) as r:
                    reply = await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status} {reply[:300]!r}")
                if counting.is_set():
                    latencies.append(time.perf_counter() - t)

        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.ensure_future(client(k, session)) for k in range(clients)]
            await asyncio.sleep(warmup_s)
            counting.set()
            await asyncio.sleep(seconds)
            counting.clear()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return latencies, errors

    latencies, errors = asyncio.run(main())
    conn.send((latencies, errors[:3], len(errors)))


def measure(ctx, url: str, bodies: list[bytes], args) -> dict:
    parent, child = ctx.Pipe()
    p = ctx.Process(target=load_main, args=(url, bodies, args.clients, args.warmup, args.seconds, child))
    p.start()
    latencies, errors, num_errors = parent.recv()
    p.join()
    if num_errors:
        raise RuntimeError(f"{num_errors} requests failed, e.g. {errors}")
    ms = sorted(x * 1e3 for x in latencies)
    return {"rps": len(ms) / args.seconds, "p50": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "n": len(ms)}


# -- tokenization alone ----------------------------------------------------------------------------
def tokenization_rates(model_dir: Path, texts: list[str], seconds: float) -> dict[str, float]:
    from florist.engine.model_dir import read_model_dir
    from florist.text import TextProcessor

    md = read_model_dir(model_dir)
    processor = TextProcessor(str(md.tokenizer_file), md.config, md.pipeline)
    fns = {"florist TextProcessor.encode": lambda t: processor.encode([t])}
    try:
        from transformers import AutoTokenizer
    except ImportError:
        pass
    else:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        fns["transformers tokenizer (sentence-transformers' call)"] = lambda t: hf(
            [t], padding=True, truncation="longest_first", return_tensors="np", max_length=md.pipeline.max_seq_length)
    for fn in fns.values():  # warm-up: the first calls on a tokenizer are slower
        for t in texts:
            fn(t)
    # Slices taken in turn, so a change of clock speed or load hits every tokenizer alike.
    counts, spent = dict.fromkeys(fns, 0), dict.fromkeys(fns, 0.0)
    for _ in range(10):
        for name, fn in fns.items():
            started = time.perf_counter()
            while time.perf_counter() - started < seconds / 10:
                fn(texts[counts[name] % len(texts)])
                counts[name] += 1
            spent[name] += time.perf_counter() - started
    return {name: counts[name] / spent[name] for name in fns}


def throughput(args, ctx) -> None:
    from florist_procs import serve

    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-gateway-"))
    stub = gateway = baseline = None
    try:
        model_dir = make_model_dir(tmp, args.tokens)
        texts = make_texts(model_dir, 8 if args.smoke else 64, args.tokens)
        bodies = [json.dumps({"input": t, "model": "all-MiniLM-L6-v2-512", "encoding_format": "float"}).encode() for t in texts]
        print(f"inputs: {len(texts)} distinct texts of {args.tokens} tokens, batch 1; {os.cpu_count()} CPUs")

        for name, rate in tokenization_rates(model_dir, texts, 0.5 if args.smoke else 3.0).items():
            print(f"tokenization, one thread, {name}: {rate:.0f} texts/s")

        stub_conn, child = ctx.Pipe()
        stub = ctx.Process(target=stub_server_main, args=(str(model_dir), child, args.local_socket))
        stub.start()
        engine_address = stub_conn.recv()
        gateway, url = serve("--engines", engine_address, "--model", str(model_dir), "--workers", str(args.workers))
        florist_result = measure(ctx, url, bodies, args)
        hop = "its local socket" if args.local_socket else "gRPC"
        results = {f"florist serve ({args.workers} worker{'s' if args.workers > 1 else ''}) + stub engine over {hop}": florist_result}

        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            print("baseline skipped: FastAPI + uvicorn are not installed (pip install fastapi uvicorn)")
        else:
            base_conn, child = ctx.Pipe()
            baseline = ctx.Process(target=baseline_main, args=(str(model_dir), child))
            baseline.start()
            base_url = base_conn.recv()
            _wait_http(base_url)
            results["FastAPI + uvicorn + transformers tokenizer, no engine hop"] = measure(ctx, base_url, bodies, args)

        print(f"\nHTTP POST /v1/embeddings, {args.tokens}-token inputs, batch 1, {args.clients} clients, {args.seconds:.0f} s after {args.warmup:.0f} s warm-up:")
        print(f"{'server':<70} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
        for name, r in results.items():
            print(f"{name:<70} {r['rps']:>8.1f} {r['p50']:>8.2f} {r['p99']:>8.2f}")
        if len(results) == 2:
            a, b = results.values()
            print(f"florist / baseline requests/s: {a['rps'] / b['rps']:.2f}x")
    finally:
        if gateway is not None:
            gateway.stop()
        if stub is not None:
            with contextlib.suppress(OSError):  # a stub that died already gets terminate() below
                stub_conn.send("stop")  # the stub server stops cleanly (and removes its local socket)
            stub.join(10)
        for proc in (baseline, stub):
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(10)
        shutil.rmtree(tmp, ignore_errors=True)


def text_of(processor, tokens: int) -> str:
    """A plain English text of `tokens` tokens (special tokens included), or the closest below."""
    words = ("the quick brown fox jumps over the lazy dog while search engines rank every document "
             "by how well it answers the query " * 200).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words that still fit
        mid = (lo + hi + 1) // 2
        if len(processor.encode([" ".join(words[:mid])], truncate=True)[0]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


class HttpClient:
    """A lean keep-alive HTTP/1.1 client on one socket. Each request is written in one send, as
    aiohttp's client and most others do (http.client sends the headers and the body apart, so
    the server reads every request twice); the reply is read by its Content-Length. Bodies are
    encoded and decoded with the standard library's json, as a user's client would."""

    def __init__(self, url: str):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")
        self.head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: ".encode()

    def embed(self, body: dict) -> np.ndarray:
        data = json.dumps(body).encode()
        self.sock.sendall(b"%s%d\r\n\r\n%s" % (self.head, len(data), data))
        status = int(self.reader.readline().split()[1])
        length = None
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        assert length is not None, "the gateway answered without Content-Length"
        reply = self.reader.read(length)
        assert status == 200, reply[:300]
        row = json.loads(reply)["data"][0]["embedding"]
        return np.frombuffer(base64.b64decode(row), "<f4") if isinstance(row, str) else np.asarray(row, dtype=np.float32)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class GrpcClient:
    """A user's gRPC client: a blocking stub on one channel, ids packed as florist.proto asks."""

    def __init__(self, address: str):
        import grpc

        from florist.server import proto, wire
        from florist.server.client import CHANNEL_OPTIONS

        self.proto, self.wire = proto, wire
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._embed = proto.method_callables(self.channel)["Embed"]

    def embed(self, ids) -> np.ndarray:
        request = self.proto.EmbedRequest(tokens=self.wire.encode_tokens([ids], self.proto.TokenBatch), encoding="float")
        return self.wire.decode_matrix(self._embed(request).embeddings)[0]

    def close(self) -> None:
        self.channel.close()


class LocalClient:
    """Direct to the engine server's local socket (what the gateway itself uses on one host): a
    blocking client, the ids packed as florist.proto asks."""

    def __init__(self, path: str):
        from florist.server import proto, wire
        from florist.server.local import BlockingLocalClient

        self.proto, self.wire = proto, wire
        self.client = BlockingLocalClient(path)

    def embed(self, ids) -> np.ndarray:
        request = self.proto.EmbedRequest(tokens=self.wire.encode_tokens([ids], self.proto.TokenBatch), encoding="float")
        return self.wire.decode_matrix(self.client.call("Embed", request).embeddings)[0]

    def close(self) -> None:
        self.client.close()


def local_socket_of(address: str) -> str:
    """The engine server's local socket path (Info), or "" when it serves none."""
    import grpc

    from florist.server import proto

    with grpc.insecure_channel(address) as channel:
        return proto.method_callables(channel)["Info"](proto.InfoRequest(), timeout=10).local_socket


def latency_model(args, tmp: Path) -> str | None:
    """--geometry: a random-weight model of that geometry (bench/geometries.py); else --model."""
    if not args.geometry:
        return args.model
    import torch
    from geometries import make_model

    dtype = torch.float32 if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu" else torch.bfloat16
    path = make_model(tmp / args.geometry, args.geometry, variant="embed", dtype=dtype)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(path)


def start_latency_servers(args, tmp: Path):
    """-> (florist serve process, its URL, engine address, device, model directory, stub engine).
    The stub engine is (process, pipe): it serves while the pipe is open."""
    from florist_procs import serve

    if not args.stub:
        model = latency_model(args, tmp)
        gateway, url = serve(*([] if args.serve_in_process else ["--replicas", "1"]) + (["--model", model] if model else [])
                              + (["--device", args.device] if args.device else []) + shlex.split(args.serve_flags))
        if args.serve_in_process:  # the engine inside florist serve: no replica, no gRPC address
            return gateway, url, None, "the engine inside florist serve (--in-process)", model, None
        engine = gateway.wait_for(r"engine replica 0 \(pid \d+, ([^)]*)\) on (\S+)")
        return gateway, url, engine.group(2), engine.group(1), model, None
    model_dir = str(make_model_dir(tmp, 512))
    ctx = mp.get_context("spawn")
    stub_conn, child = ctx.Pipe()
    stub = ctx.Process(target=stub_server_main, args=(model_dir, child, args.local_socket))
    stub.start()
    address = stub_conn.recv()
    gateway, url = serve("--engines", address, "--model", model_dir, *shlex.split(args.serve_flags))
    return gateway, url, address, "a stub engine (no model)", model_dir, (stub, stub_conn)


def latency(args) -> None:
    """Batch-1 requests one after another: HTTP (text, and token ids) vs a direct gRPC call to
    the same engine replica with the same ids; the difference is what the gateway adds."""
    from florist.engine.model_dir import read_model_dir
    from florist.text import TextProcessor

    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-gateway-"))
    gateway = stub = None
    try:
        gateway, url, address, device, model_dir, stub = start_latency_servers(args, tmp)
        md = read_model_dir(model_dir)
        processor = TextProcessor(str(md.tokenizer_file), md.config, md.pipeline)
        text = text_of(processor, args.latency_tokens)
        ids = processor.encode([text])[0].tolist()
        n, warmup = (10, 3) if args.smoke else (args.requests, 100)
        http_client = HttpClient(url)
        grpc_client = GrpcClient(address) if address else None  # None: the engine is inside florist serve
        paths = {"direct gRPC (ids)": lambda: grpc_client.embed(ids)} if grpc_client else {}
        alone = {}  # timed in a loop of their own, not in turn with the others (below)
        if args.in_process:  # the same model in this process: the engine alone, no server
            from florist import Engine
            from florist.engine.batch import HostBatch
            from florist.engine.output import finalize_embeddings

            engine = Engine.from_pretrained(model_dir, device=args.device)
            host_ids = np.asarray(ids, dtype=np.int32)
            alone["in-process step() (ids)"] = lambda: finalize_embeddings(engine.step(HostBatch.from_sequences([host_ids])).numpy(), dimensions=None,
                                                                                  normalize=engine.info.normalize, encoding="float")[0]
        path = local_socket_of(address) if address and (not args.stub or args.local_socket) else ""
        local_client = LocalClient(path) if path else None
        if local_client is not None:
            paths["direct local socket (ids)"] = lambda: local_client.embed(ids)
        paths |= {
            "HTTP /v1/embeddings (text)": lambda: http_client.embed({"input": text, "encoding_format": "float"}),
            "HTTP /v1/embeddings (token ids)": lambda: http_client.embed({"input": [ids], "encoding_format": "float"}),
            "HTTP /v1/embeddings (token ids, base64)": lambda: http_client.embed({"input": [ids], "encoding_format": "base64"}),
        }
        reference = next(iter(paths.values()))()
        for name, call in (paths | alone).items():  # the same vector every way
            assert np.abs(call() - reference).max() < 1e-2, name  # bf16: the in-process engine agrees to ~1e-3
        by_gap: dict[float, dict[str, list[float]]] = {}
        for g, gap in enumerate(args.gap_ms):
            by_gap[gap] = times = {name: [] for name in alone | paths}
            skip = warmup if g == 0 else min(warmup, 10)
            # The in-process engine alone first, while the server idles: in turn with the
            # server's requests, its steps and the server's would alternate between two CUDA
            # contexts on one GPU, which slowed each by ~0.3 ms on the H200 (docs/benchmarks.md).
            for group in (alone, paths):  # the paths in turn, so drift hits them alike
                for k in range(skip + n):
                    for name, call in group.items():
                        if gap:
                            time.sleep(gap / 1e3)  # idle before every request: the servers' loops and the GPU may slow down meanwhile
                        t = time.perf_counter()
                        call()
                        if k >= skip:
                            times[name].append((time.perf_counter() - t) * 1e3)
        http_client.close()
        if grpc_client is not None:
            grpc_client.close()
        if local_client is not None:
            local_client.close()
    finally:
        if gateway is not None:
            gateway.stop()
        if stub is not None:
            stub[0].terminate()
            stub[0].join(10)
        shutil.rmtree(tmp, ignore_errors=True)
    times = by_gap[args.gap_ms[0]]
    gap_note = f", each after {args.gap_ms[0]:g} ms idle" if args.gap_ms[0] else ""
    print(f"\nbatch-1 latency, {len(ids)} tokens, {md.name} ({md.config.hidden_size} dimensions) on {device}, {n} requests each, one after another{gap_note}:")
    print(f"gateway JSON / event loop: {_importable('orjson', 'json (float rows by numpy)')} / {_importable('uvloop', 'asyncio')}")
    print(f"{'path':<40} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for name, ms in times.items():
        q = np.percentile(ms, [50, 90, 99])
        print(f"{name:<40} {q[0]:>8.3f} {q[1]:>8.3f} {q[2]:>8.3f}")
    # What each path adds over the most direct one measured: the engine server's gRPC, or with
    # the engine inside florist serve, its step() in this process (--in-process).
    base_name, over = next(((name, what) for name, what in (("direct gRPC (ids)", "direct gRPC"), ("in-process step() (ids)", "in-process step()"))
                            if name in times), (None, None))
    if base_name is None:
        print("(no direct path to compare with: the engine runs inside florist serve; --in-process times its step() here)")
    else:
        base = np.percentile(times[base_name], 50)
        for name in (name for name in times if name != base_name):
            print(f"{name} adds {np.percentile(times[name], 50) - base:.3f} ms p50 over {over}")
    if len(by_gap) > 1:
        from florist.busy_poll import DEFAULT_LINGER_MS

        print(f"\np50 / p90 ms by the idle time before each request (--gap-ms; florist serve's default busy-poll linger is "
              f"{DEFAULT_LINGER_MS:g} ms on GPUs unless --serve-flags set it):")
        print(f"{'path':<40} " + " ".join(f"{f'{gap:g} ms idle':>16}" for gap in by_gap))
        for name in times:
            cells = (np.percentile(by_gap[gap][name], [50, 90]) for gap in by_gap)
            print(f"{name:<40} " + " ".join(f"{f'{a:.3f} / {b:.3f}':>16}" for a, b in cells))


def _importable(name: str, otherwise: str) -> str:
    try:
        __import__(name)
    except ImportError:
        return otherwise
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="tokens per input of the throughput run (default 512)")
    p.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients (default 16)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per server (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (default 2)")
    p.add_argument("--workers", type=int, default=1, help="florist gateway workers (default 1)")
    p.add_argument("--latency", action="store_true", help="only the latency run: HTTP vs direct gRPC on a real engine (or the stub, --stub)")
    p.add_argument("--model", default=None, help="model of the latency run (default: all-MiniLM-L6-v2)")
    p.add_argument("--device", default=None, help="device of the latency run (default: cuda when present)")
    p.add_argument("--latency-tokens", type=int, default=128, help="tokens per input of the latency run (default 128)")
    p.add_argument("--stub", action="store_true", help="latency run against the stub engine instead of a model (the gateway's own cost, on a CPU; --model unused)")
    p.add_argument("--requests", type=int, default=500, help="requests per path in the latency run (default 500)")
    p.add_argument("--local-socket", action="store_true", help="the stub engine also serves its local socket, which the gateway then uses (default: gRPC only)")
    p.add_argument("--geometry", default=None, help="latency run on a random-weight model of this geometry (bench/geometries.py, e.g. qwen3-0.6b) instead of --model")
    p.add_argument("--in-process", action="store_true", help="latency run: also time the same model's engine.step() in this process (no server)")
    p.add_argument("--serve-flags", default="", metavar="FLAGS",
                   help="latency run: more `florist serve` flags, given with '=' as they start with '--': "
                        "--serve-flags=\"--busy-poll --gateway-busy-poll\" or --serve-flags=\"--busy-poll-linger-ms 0\"")
    p.add_argument("--gap-ms", default="0", metavar="LIST",
                   help="latency run: idle milliseconds before every request, a comma list run one after another (default 0: back to back); "
                        "e.g. 0,10,50 shows what sparse traffic meets once the servers' loops and the GPU have gone idle")
    p.add_argument("--smoke", action="store_true", help="both runs, a second or a few requests each: the code path only")
    args = p.parse_args()
    try:
        gaps = [float(g) for g in args.gap_ms.split(",") if g.strip()]
    except ValueError:
        gaps = []
    if not gaps or min(gaps) < 0:
        p.error(f"--gap-ms takes a comma list of milliseconds >= 0, e.g. 0,10,50; got {args.gap_ms!r}")
    args.gap_ms = list(dict.fromkeys(gaps))  # each gap once: its rows are keyed by it
    args.serve_in_process = "--in-process" in shlex.split(args.serve_flags)
    if args.stub and args.serve_in_process:
        p.error("--stub runs the stub engine as a server of its own; --serve-flags=--in-process loads a model inside florist serve: drop one")
    if args.smoke:
        args.clients, args.seconds, args.warmup = 2, 1.0, 0.5
        args.device = args.device or "cpu"
    if not args.latency:
        throughput(args, mp.get_context("spawn"))
    if args.latency or args.smoke:
        latency(args)
    return 0


def _wait_http(url: str, timeout_s: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/docs", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
