"""The four serving scenarios (DESIGN.md) through HTTP: `florist serve` against the baseline a user
would otherwise stand up (bench/baseline_server.py: FastAPI + uvicorn on sentence-transformers /
transformers), and against Infinity (`infinity-emb`) when --infinity says how to run it; same
model directory, same inputs, same client, same run.

    1. low-latency embedding: batch 1, one request after another, 128 / 512 / 4096 tokens, pre-tokenized
    2. low-latency scoring: 5 / 25 / 50 (query, document) pairs of 512 tokens, one request after another
    3. high-throughput embedding: batches of 100, 4 client processes at once, 512 / 1024 / 4096 tokens
    4. high-concurrency embedding: 512 tokens of text (tokenized by the server), batch 1, 1 / 2 / 4 / 8 / 16 clients

Both servers answer OpenAI's /v1/embeddings (base64 floats, as OpenAI's Python client asks) and
vLLM's /v1/score. Before timing, each server's outputs are compared with the other's on the
scenarios' own inputs: embeddings by cosine (>= 0.999), scores by absolute difference (<= 0.01).

Infinity's /embeddings takes text only, so where a scenario sends token ids (1 and 3) Infinity
gets texts of the same token counts instead, and tokenizes them itself; it is compared with
florist on those texts. In scenario 2 it gets the same pairs on its /rerank (Cohere's shape) where
the reranker is a sequence classifier (the ms-marco cross-encoder); it cannot rerank with a causal LM
(the Qwen3 reranker), and sits that out. infinity-emb 0.0.78 needs transformers < 5 and
sentence-transformers < 4, so it runs from its own environment:

    python bench/serve.py --infinity "env PYTHONPATH=/opt/infinity python3" --out r/

That Python must import infinity_emb, httptools (its server's HTTP parser) and orjson (its
responses), or the run stops at once, before anything starts. An Infinity that then fails to start or dies mid-run costs the run
nothing else: its cells say why, and florist and the baseline are timed to the end.

Latency is per request, warm-up excluded, as p50 / p90 / p99 / max ms with the number of
requests; throughput is measured over the timed requests of all clients together.

    python bench/serve.py --out results/                       # random-weight Qwen3-0.6B geometry (+ its reranker), GPU
    python bench/serve.py --geometry all-minilm-l6-v2 --out r/ # MiniLM embedder + ms-marco cross-encoder geometries
    python bench/serve.py --model /models/Qwen3-Embedding-0.6B --model /models/Qwen3-Reranker-0.6B --out r/
    python bench/serve.py --smoke --out /tmp/smoke             # tiny models on the CPU, a few requests
    python bench/serve.py --scenarios 4 --florist-only --serve-flags="--launch-ahead-ms inf"   # a florist setting alone

Writes one table to stdout and results.json plus PNG plots to --out (the plots need matplotlib);
with --json FILE also florist's figures as bench/report.py rows, which bench/ab.py compares
between settings of a FLORIST_* variable:

    python bench/ab.py --env FLORIST_GRAPH_RENT=0,8 --rounds 2 -- python bench/serve.py --scenarios 4 --florist-only
"""

# Wheels for the GPU machine (Python 3.12, no registry there): fastapi / uvicorn / pydantic are not
# installed. Fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl NAME==VERSION ...
# the baseline (all checked to resolve; ~4 MB):
#   fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
#   typing-inspection==0.4.2 annotated-doc==0.0.7 opentelemetry-api==1.45.2 anyio==4.16.0 idna==3.20
#   typing-extensions==4.16.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0
# the plots (~17 MB; pillow and numpy are there already, with torchvision):
#   matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1
#   pyparsing==3.3.2 python-dateutil==2.9.0.post0 six==1.17.0 packaging==26.2
# (besides what `florist serve` itself needs there: aiohttp, grpcio, protobuf). Without the first
# group the baseline runs behind aiohttp instead, with the same handlers, and its start-up line
# says so; without matplotlib the plots are skipped.
# Infinity, in a directory of its own (pip install --no-index --no-deps --target DIR *.whl), put
# first on PYTHONPATH by --infinity; ~21 MB; numpy, torch, scipy, scikit-learn, requests, PyYAML,
# safetensors, regex, tqdm, filelock, fsspec, packaging are used from the machine:
#   infinity-emb==0.0.78 transformers==4.57.6 sentence-transformers==3.4.1 tokenizers==0.22.2
#   huggingface-hub==0.36.2 click==8.1.8 typer==0.12.5 rich==13.9.4 markdown-it-py==4.3.0 mdurl==0.1.2
#   pygments==2.20.0 shellingham==1.5.4 posthog==7.91.1 backoff==2.2.1 distro==1.9.0
#   python-dateutil==2.9.0.post0 six==1.17.0 prometheus-fastapi-instrumentator==8.1.0
#   prometheus-client==0.26.0 httptools==0.9.0 orjson==3.13.0, and the baseline's fastapi group above

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# name -> (bench/geometries.py geometry, variant, the geometry that serves the other task)
GEOMETRIES = {
    "qwen3-0.6b": ("qwen3-0.6b", "embed", "qwen3-reranker-0.6b"),
    "pplx-embed-0.6b": ("qwen3-0.6b", "pplx", "qwen3-reranker-0.6b"),
    "qwen3-reranker-0.6b": ("qwen3-0.6b", "reranker", "qwen3-0.6b"),
    "all-minilm-l6-v2": ("minilm-l6", "embed", "ms-marco-minilm-l6"),
    "ms-marco-minilm-l6": ("minilm-l6", "cross-encoder", "all-minilm-l6-v2"),
    "tiny-qwen3": ("tiny-qwen3", "embed", "tiny-qwen3-reranker"),
    "tiny-qwen3-reranker": ("tiny-qwen3", "reranker", "tiny-qwen3"),
    "tiny-bert": ("tiny-bert", "embed", "tiny-cross-encoder"),
    "tiny-cross-encoder": ("tiny-bert", "cross-encoder", "tiny-bert"),
}
SCENARIO_TASK = {1: "embed", 2: "score", 3: "embed", 4: "embed"}
SCENARIO_NAME = {1: "low-latency embedding", 2: "low-latency scoring", 3: "high-throughput embedding", 4: "high-concurrency embedding"}
SERVERS = ("florist", "baseline", "infinity")  # in the table's order; Infinity only with --infinity


@dataclass(frozen=True)
class Plan:
    """Sizes per scenario; --smoke shrinks the tokens, keeps the shapes."""

    s1_tokens: tuple[int, ...] = (128, 512, 4096)
    s2_pairs: tuple[int, ...] = (5, 25, 50)
    s2_tokens: int = 512
    s3_tokens: tuple[int, ...] = (512, 1024, 4096)
    s3_batch: int = 100
    s3_procs: int = 4
    s4_tokens: int = 512
    s4_clients: tuple[int, ...] = (1, 2, 4, 8, 16)
    s4_procs: int = 4


# NOTE: the tiny tokenizer spells the Qwen3 reranker template out nearly letter by letter (~170 tokens).
SMOKE_PLAN = Plan(s1_tokens=(16, 32, 64), s2_tokens=256, s3_tokens=(32, 64, 128), s3_batch=10, s4_tokens=32, s4_clients=(1, 2, 4))


@dataclass
class Cell:
    """One measurement: the same bodies sent to each server by procs x clients clients."""

    scenario: int
    label: str           # "512 tokens", "25 pairs", "8 clients"
    route: str
    bodies: list[bytes]
    items: int           # embeddings or pairs per request
    procs: int = 1
    clients: int = 1     # per process
    requests: int = 0    # timed requests, all clients together
    warmup: int = 0      # untimed requests per client, first
    skipped: str = ""
    results: dict = field(default_factory=dict)  # server -> measurement
    infinity_bodies: list[bytes] | None = None  # where Infinity's differ: texts of the bodies' token counts; in scenario 2, /rerank bodies
    sits_out: dict = field(default_factory=dict)  # server -> why it does not run this cell
    failed: dict = field(default_factory=dict)  # server (baseline or Infinity) -> what went wrong in this cell

    def bodies_for(self, server: str) -> list[bytes]:
        return self.infinity_bodies if server == "infinity" and self.infinity_bodies is not None else self.bodies

    def tried(self, server: str) -> bool:
        """Whether the server was measured in this cell or failed it (as against never reached)."""
        return server in self.results or server in self.failed

    def route_for(self, server: str) -> str:
        return "/v1/rerank" if server == "infinity" and self.scenario == 2 else self.route

    @property
    def key(self) -> str:
        return f"{self.scenario} {SCENARIO_NAME[self.scenario]}, {self.label}"


# -- inputs ---------------------------------------------------------------------------------------
class Texts:
    """Random texts of exact token counts, measured with the model's own tokenizer."""

    def __init__(self, model_dir: Path, seed: int):
        from tokenizers import Tokenizer

        from florist.engine.model_dir import read_model_dir
        from florist.text import TextProcessor

        md = read_model_dir(model_dir)
        self.processor = TextProcessor(str(md.tokenizer_file), md.config, md.pipeline)
        self.tok = Tokenizer.from_file(str(md.tokenizer_file))
        self.tok.no_padding()
        self.tok.no_truncation()
        candidates = sorted(w for w in self.tok.get_vocab() if w.isascii() and w.isalpha() and len(w) > 2)
        self.words = [w for w, e in zip(candidates, self.tok.encode_batch(candidates, add_special_tokens=False)) if len(e.ids) == 1]
        assert self.words, f"no single-token words in {md.tokenizer_file}"
        self.rng = np.random.default_rng(seed)

    def words_text(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words, size=n))

    def fit(self, target: int, count) -> str:
        """Random words cut so that count(text) == target tokens."""
        text = self.words_text(2 * target + 16)
        offsets = self.tok.encode(text, add_special_tokens=False).offsets
        keep = target
        if count(text[: offsets[0][1]]) > target:
            raise ValueError(f"{target} tokens are too few: a one-word input already takes {count(text[: offsets[0][1]])} (template and special tokens)")
        for _ in range(20):
            keep = max(1, min(keep, len(offsets)))
            cut = text[: offsets[keep - 1][1]]
            n = count(cut)
            if n == target:
                return cut
            keep += target - n
        raise RuntimeError(f"could not make a text of exactly {target} tokens (last try: {n})")

    def text(self, tokens: int) -> str:
        return self.fit(tokens, lambda t: len(self.tok.encode(t).ids))

    def document(self, query: str, pair_tokens: int) -> str:
        return self.fit(pair_tokens, lambda d: len(self.processor.encode_pairs(query, [d])[0][0]))


def embed_body(inputs) -> bytes:
    return json.dumps({"input": inputs, "encoding_format": "base64"}).encode()


def score_body(query: str, docs: list[str]) -> bytes:
    return json.dumps({"text_1": query, "text_2": docs}).encode()


def rerank_body(query: str, docs: list[str]) -> bytes:
    """Infinity's /rerank (Cohere's shape): the same pairs as score_body."""
    return json.dumps({"query": query, "documents": docs}).encode()


def plan_cells(scenarios: list[int], plan: Plan, n: int, model: dict, seed: int = 0, for_infinity: bool = False) -> list[Cell]:
    """The cells of the scenarios this model serves, with their bodies and request counts.

    n (--requests) is the timed request count of scenario 1 per cell; scenario 4 takes 4 n (at
    16 clients n requests would be a dozen per client, over in a third of a second on a GPU, too
    few for a p99 and too short to tell the first sight of a batch shape from the rest); scenario
    2 takes n / 4; scenario 3 takes n / 8 batches at its shortest length and proportionally fewer
    at longer ones (at least one per client process), so each cell costs about the same.
    for_infinity: also Infinity's bodies where they differ (texts of the same token counts where
    the bodies hold ids; /rerank bodies for a cross-encoder).
    """
    texts = Texts(model["path"], seed)
    rng = np.random.default_rng(seed)
    max_tokens, vocab = model["max_tokens"], model["vocab_size"]
    low = min(1000, vocab // 4)  # clear of special tokens, which sit at the start of BERT vocabularies
    ids = lambda k, length: [rng.integers(low, vocab, size=length).tolist() for _ in range(k)]
    too_long = f"the model takes at most {max_tokens} tokens"
    cells = []
    for s in scenarios:
        if SCENARIO_TASK[s] != model["task"]:
            continue
        if s == 1:
            for t in plan.s1_tokens:
                cells.append(Cell(1, f"{t} tokens", "/v1/embeddings", [] if t > max_tokens else [embed_body(ids(1, t)) for _ in range(8)],
                                  items=1, requests=n, warmup=max(3, n // 10), skipped=too_long if t > max_tokens else "",
                                  infinity_bodies=[embed_body([texts.text(t)]) for _ in range(8)] if for_infinity and t <= max_tokens else None))
        elif s == 2:
            tokens = min(plan.s2_tokens, max_tokens)
            query = texts.words_text(8)
            docs = [texts.document(query, tokens) for _ in range(max(plan.s2_pairs))]
            # Infinity reranks with sequence classifiers (cross-encoders), not with a causal LM read at its yes / no logits.
            classifier = model.get("family") == "bert"
            for k in plan.s2_pairs:
                pairs = [(query, [docs[(r + j) % len(docs)] for j in range(k)]) for r in range(4)]
                cells.append(Cell(2, f"{k} pairs of {tokens} tokens", "/v1/score", [score_body(*q) for q in pairs], items=k, requests=max(5, n // 4),
                                  warmup=3, infinity_bodies=[rerank_body(*q) for q in pairs] if for_infinity and classifier else None,
                                  sits_out={} if classifier else {"infinity": "it reranks with sequence classifiers only, and this reranker is a causal LM"}))
        elif s == 3:
            for t in plan.s3_tokens:
                batches = max(plan.s3_procs, math.ceil(n / 8 * plan.s3_tokens[0] / t))
                per_client = math.ceil(batches / plan.s3_procs)
                bodies = [] if t > max_tokens else [embed_body(ids(plan.s3_batch, t)) for _ in range(2)]
                infinity_bodies = None
                if for_infinity and t <= max_tokens:
                    batch = [texts.text(t) for _ in range(plan.s3_batch)]
                    infinity_bodies = [embed_body(batch), embed_body(batch[1:] + batch[:1])]
                cells.append(Cell(3, f"{plan.s3_batch} x {t} tokens", "/v1/embeddings", bodies, items=plan.s3_batch, procs=plan.s3_procs,
                                  requests=per_client * plan.s3_procs, warmup=1, skipped=too_long if t > max_tokens else "", infinity_bodies=infinity_bodies))
        elif s == 4:
            tokens = min(plan.s4_tokens, max_tokens)
            bodies = [embed_body(texts.text(tokens)) for _ in range(16)]
            for c in plan.s4_clients:
                requests = math.ceil(4 * n / c) * c
                procs = math.gcd(c, plan.s4_procs)  # up to 4 client processes, so the clients' own CPU does not cap the rate
                cells.append(Cell(4, f"{tokens}-token text, {c} client{'s' if c > 1 else ''}", "/v1/embeddings", bodies,
                                  items=1, procs=procs, clients=c // procs, requests=requests, warmup=5))
    return cells


# -- the servers ------------------------------------------------------------------------------------
class Proc:
    """A server in a subprocess; every output line is kept, and the URL read from its start-up line."""

    def __init__(self, name: str, cmd: list[str], env: dict):
        self.name, self.lines = name, []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.url = self.banner = ""
        self.start_error = ""  # why a server the run can do without did not start (Infinity)

    def wait_url(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.lines):
                if (m := re.search(pattern, line)) and "http://" in line:
                    self.banner, self.url = line.strip(), m.group(1)
                    return self.url
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the {self.name} server did not start (exit {self.proc.poll()}):\n{''.join(self.lines)[-4000:]}")

    def stop(self) -> None:
        from florist.gateway.processes import terminate

        terminate([self.proc], 30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


INFINITY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def infinity_command(args, model_dir: Path, port: int) -> list[str]:
    """`infinity_emb v2` as its README starts it, on the same model directory, device and dtype.
    The batch size stays at its default (32), as a user who does not tune it would leave it."""
    device, _, index = args.device.partition(":")
    dtype = INFINITY_DTYPES[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]
    return [*shlex.split(args.infinity), "-m", "infinity_emb.cli", "v2", "--model-id", str(model_dir), "--engine", "torch",
            "--device", device, *(["--device-id", index] if index else []), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--url-prefix", "/v1"]


def infinity_versions(command: str) -> dict:
    """The packages Infinity runs on, as its own Python sees them; fails early when it cannot start."""
    code = ("import importlib.metadata as m, importlib.util as u, json\n"
            "assert u.find_spec('infinity_emb.cli'), 'infinity_emb.cli is not importable'\n"
            "for name, why in (('httptools', 'infinity-emb runs uvicorn with http=\"httptools\"'),\n"
            "                  ('orjson', 'infinity-emb answers with fastapi ORJSONResponse, /health included')):\n"
            " try: __import__(name)\n"
            " except ImportError as e: raise SystemExit(f'{name} is not importable ({why}): {e}')\n"
            "def v(p):\n try: return m.version(p)\n except m.PackageNotFoundError: return None\n"
            "print(json.dumps({p: v(p) for p in ('infinity-emb', 'transformers', 'sentence-transformers', 'torch', 'numpy')}))")
    out = subprocess.run([*shlex.split(command), "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise SystemExit(f"--infinity {command!r} cannot report its packages (is infinity-emb installed there?):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_servers(model: dict, args) -> dict[str, Proc]:
    """`florist serve` and the baseline on the same model directory (Infinity too with --infinity,
    for embedding models), started together."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.device == "cpu":  # NOTE: the two servers and the clients share the cores; more threads each only contend
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
    dtype = ["--dtype", args.dtype] if args.dtype else []
    florist = Proc("florist", [sys.executable, "-m", "florist.cli", "serve", "--port", "0", "--model", str(model["path"]),
                               "--device", args.device, "--workers", str(args.workers), *dtype, *(["--busy-poll"] if args.busy_poll else []),
                               *(["--gateway-busy-poll"] if args.gateway_busy_poll else []),
                               *([] if args.gateway_reply_spin_ms is None else ["--gateway-reply-spin-ms", str(args.gateway_reply_spin_ms)]), *(["--no-local-socket"] if args.no_local_socket else []),
                               *([] if args.warm_up else ["--no-warm-up"]), *shlex.split(args.serve_flags)], env)
    servers = {"florist": florist}
    if not args.florist_only:
        servers["baseline"] = Proc("baseline", [sys.executable, str(ROOT / "bench" / "baseline_server.py"), "--model", str(model["path"]),
                                                "--task", model["task"], "--device", args.device, "--port", "0", "--http", args.baseline_http, *dtype], env)
    if args.infinity and not args.florist_only and (model["task"] == "embed" or model.get("family") == "bert"):  # embedders, and cross-encoders to rerank
        # NOTE: no telemetry, no hub: the machine reaches nothing outside.
        quiet = dict(env, INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        quiet["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")  # its own packages come first through --infinity, florist's are not needed
        command = infinity_command(args, model["path"], free_port())
        servers["infinity"] = Proc("infinity", command, quiet)
    try:
        florist.wait_url(r" on (http://[\d.]+:\d+)", 1800)
        if "baseline" in servers:
            servers["baseline"].wait_url(r" on (http://[\d.]+:\d+)", 1800)
            wait_health(servers["baseline"], 300)
        if "infinity" in servers:
            try:
                servers["infinity"].wait_url(r"Uvicorn running on (http://[\d.]+:\d+)", 1800)
                wait_health(servers["infinity"], 300)
            except RuntimeError as e:  # the run goes on without it, as when it dies mid-run
                servers["infinity"].stop()
                servers["infinity"].start_error = f"did not start (exit {servers['infinity'].proc.poll()})"
                print(f"NOTE: {e}\nNOTE: infinity {servers['infinity'].start_error}: the run goes on without it", flush=True)
            servers["infinity"].banner = f"infinity: {' '.join(command[len(shlex.split(args.infinity)):])}"
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


CAPTURED = re.compile(r"captured a CUDA graph .* in ([\d.]+) ms")
FIRST_SIGHT = re.compile(r"ran a first-sight batch eagerly .*: launched in ([\d.]+) ms \(([\d.]+) ms of this thread's CPU; "
                         r"Triton kernels compiled (\d+)")


COVERED = re.compile(r"replayed a covering CUDA graph ")


def covered(lines: list[str]) -> int:
    """How many batches a florist server ran in a captured graph of a larger bucket (no stall)."""
    return sum(1 for line in lines if COVERED.search(line))


def captures(lines: list[str]) -> list[float]:
    """The capture times (ms) in a florist server's log lines (florist/engine/graph_runner.py)."""
    return [float(m.group(1)) for line in lines if (m := CAPTURED.search(line))]


def first_sights(lines: list[str]) -> tuple[list[float], list[float], list[int]]:
    """The eager first sights of a bucket in a florist server's log lines: their launch times
    (ms), the launching thread's CPU time (ms) and the Triton kernels compiled during each."""
    found = [(float(m.group(1)), float(m.group(2)), int(m.group(3))) for line in lines if (m := FIRST_SIGHT.search(line))]
    return tuple(list(column) for column in zip(*found)) if found else ([], [], [])


def wait_health(server: Proc, timeout_s: float) -> None:
    """Until the server answers /health with 2xx. 503 (still loading) and no answer are waited out
    up to timeout_s; any other error status means it is up and broken, and fails at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(server.url + "/health", timeout=5).read()
            return
        except OSError as e:  # no answer yet, or an error status (HTTPError)
            status = e.code if isinstance(e, urllib.error.HTTPError) else None
            if status not in (None, 503) or time.monotonic() > deadline or server.proc.poll() is not None:
                said = "does not answer /health" if status is None else f"answers /health with {status}"
                raise RuntimeError(f"{server.name} at {server.url} {said}:\n{''.join(server.lines)[-3000:]}") from None
        time.sleep(0.2)


# -- the client -------------------------------------------------------------------------------------
async def post(session, url: str, body: bytes, retried: list[int] | None = None) -> dict:
    """POST a JSON body; 429 / 503 are retried after the server's Retry-After (at most 60 s, 8
    tries), as OpenAI's Python client does, and counted in retried[0]."""
    for attempt in range(8):
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            payload = await r.read()
            if r.status in (429, 503) and attempt < 7:
                if retried is not None:
                    retried[0] += 1
                await asyncio.sleep(min(60.0, float(r.headers.get("Retry-After", 1))))
                continue
            if r.status != 200:
                raise RuntimeError(f"POST {url}: {r.status} {payload[:400]!r}")
        return json.loads(payload)  # a real client reads the answer: that is part of the cost
    raise AssertionError("unreachable")


def load_main(url: str, bodies: list[bytes], clients: int, per_client: int, warmup: int, deadline_s: float, barrier, conn) -> None:
    """One client process: `clients` concurrent clients, warm-up, wait for the other processes, then
    per_client timed requests each (or until deadline_s). Sends (latencies_ms, start, end, retries) back."""
    import aiohttp

    async def run():
        timeout = aiohttp.ClientTimeout(total=600)
        # NOTE: idle connections are dropped after 2 s, before uvicorn's 5 s keep-alive closes them
        # from its side: a request sent on a connection the server is closing fails (a broken pipe).
        connector = aiohttp.TCPConnector(limit=clients, keepalive_timeout=2.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async def client(k: int, count: int, out: list | None, stop_at: float) -> None:
                for i in range(count):
                    if out is not None and time.monotonic() > stop_at:
                        return
                    t = time.perf_counter()
                    await post(session, url, bodies[(k + i * clients) % len(bodies)], retried if out is not None else None)
                    if out is not None:
                        out.append((time.perf_counter() - t) * 1e3)

            await asyncio.gather(*(client(k, warmup, None, 0) for k in range(clients)))
            if barrier is not None:
                barrier.wait(timeout=900)  # every process has warmed up: the timed phase starts together
            latencies: list[float] = []
            retried = [0]
            start = time.monotonic()
            await asyncio.gather(*(client(k, per_client, latencies, start + deadline_s) for k in range(clients)))
            return latencies, start, time.monotonic(), retried[0]

    try:
        result = asyncio.run(run())
    except Exception as e:  # noqa: BLE001  (handed to the parent, which raises it)
        if barrier is not None:
            barrier.abort()  # the other processes stop waiting for this one
        result = RuntimeError(f"{type(e).__name__}: {e}")  # aiohttp's exceptions do not all pickle
    if conn is None:
        return result
    conn.send(result)


def measure(cell: Cell, url: str, deadline_s: float, server: str = "florist") -> dict:
    bodies = cell.bodies_for(server)
    per_client = cell.requests // (cell.procs * cell.clients)
    target = url + cell.route_for(server)
    if cell.procs == 1:
        parts = [load_main(target, bodies, cell.clients, per_client, cell.warmup, deadline_s, None, None)]
    else:
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(cell.procs)
        pipes, procs = [], []
        for _ in range(cell.procs):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=load_main, args=(target, bodies, cell.clients, per_client, cell.warmup, deadline_s, barrier, child))
            p.start()
            pipes.append(parent)
            procs.append(p)
        parts = []
        for pipe, p in zip(pipes, procs):
            while not pipe.poll(1.0):
                if not p.is_alive():
                    raise RuntimeError(f"a client process exited with code {p.exitcode} before sending its results")
            parts.append(pipe.recv())
        for p in procs:
            p.join()
        # A process that failed broke the barrier for the others: report its error, not theirs.
        parts.sort(key=lambda part: "BrokenBarrierError" in str(part) if isinstance(part, Exception) else True)
    for part in parts:
        if isinstance(part, Exception):
            raise part
    ms = np.concatenate([np.asarray(p[0]) for p in parts])
    wall = max(p[2] for p in parts) - min(p[1] for p in parts)
    pct = {q: float(np.percentile(ms, v)) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))}
    return {"n": int(ms.size), "planned": cell.requests, **pct, "max": float(ms.max()), "mean": float(ms.mean()), "wall_s": wall,
            "requests_per_s": ms.size / wall, "items_per_s": ms.size * cell.items / wall, "retries": sum(p[3] for p in parts)}


class ServerFailed(RuntimeError):
    pass


async def check(cells: list[Cell], urls: dict[str, str], task: str, other: str = "baseline") -> dict:
    """florist's and another server's answers to a few of the scenarios' own requests (the ones
    that server is sent), compared before any timing."""
    import aiohttp

    used = [c for c in cells if c.bodies and other not in c.sits_out]
    # (florist's body, the other's body, the other's route); scenario 4 repeats one body for every concurrency
    sends = list(dict.fromkeys((c.bodies[0] if c.scenario == 2 else c.bodies_for(other)[0], c.bodies_for(other)[0], c.route_for(other)) for c in used))
    pair = ("florist", other)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        replies = {"florist": [await post(session, urls["florist"] + cells[0].route, mine) for mine, _, _ in sends]}
        try:
            replies[other] = [await post(session, urls[other] + route, theirs) for _, theirs, route in sends]
        except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ServerFailed(f"{other} did not answer the check's requests: {type(e).__name__}: {e}") from e
    if task == "embed":
        decode = lambda r: np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in sorted(r["data"], key=lambda d: d["index"])])
        got, want = (np.concatenate([decode(r) for r in replies[s]]) for s in pair)
        cosine = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min()) if got.shape == want.shape else float("nan")
        ok = got.shape == want.shape and cosine >= 0.999
        return {"what": f"min cosine, florist vs {other}", "value": cosine, "bound": ">= 0.999", "rows": len(got), "ok": ok}
    scores = lambda r: np.array([d["score"] if "score" in d else d["relevance_score"]  # /v1/score, or Infinity's /rerank
                                 for d in sorted(r["data"] if "data" in r else r["results"], key=lambda d: d["index"])])
    got, want = (np.concatenate([scores(r) for r in replies[s]]) for s in pair)
    diff = float(np.abs(got - want).max()) if got.shape == want.shape else float("nan")
    return {"what": f"max |score difference|, florist vs {other}", "value": diff, "bound": "<= 0.01", "rows": len(got), "ok": got.shape == want.shape and diff <= 0.01}


# -- models ------------------------------------------------------------------------------------------
def describe_model(path: Path, source: str) -> dict:
    from florist.engine.model_dir import read_model_dir

    md = read_model_dir(path)
    return {"path": path, "source": source, "task": md.pipeline.task, "max_tokens": md.pipeline.max_seq_length, "vocab_size": md.config.vocab_size,
            "family": md.config.family}


def prepare_models(args, tmp: Path, tasks: set[str]) -> dict[str, dict]:
    """task -> model: the directories given with --model, else random weights of --geometry (and its pair)."""
    models = {}
    for path in args.model or []:
        m = describe_model(Path(path), str(path))
        if m["task"] not in ("embed", "score"):
            raise SystemExit(f"{path} is a {m['task']} model; this suite serves embedding and scoring models")
        models[m["task"]] = m
    if args.model:
        return {t: m for t, m in models.items() if t in tasks}
    import torch
    from geometries import make_model

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    for name in (args.geometry, GEOMETRIES[args.geometry][2]):
        geometry, variant, _ = GEOMETRIES[name]
        task = "score" if variant in ("reranker", "cross-encoder") else "embed"
        if task in tasks and task not in models:
            t = time.perf_counter()
            # NOTE: the directory name matters: florist serves a Qwen3ForCausalLM as a reranker when its name says so.
            path = make_model(tmp / name, geometry, variant=variant, dtype=dtype)
            models[task] = describe_model(path, f"random weights, geometry {name}")
            print(f"built a random {name} ({variant}) in {time.perf_counter() - t:.1f} s", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the weights were drawn on the GPU; the servers need the memory, not this process
    return models


# -- output ------------------------------------------------------------------------------------------
METRICS = {1: ("p50", "p90", "p99", "max"), 2: ("p50", "p90", "p99", "max"), 3: ("items_per_s", "p50"), 4: ("p50", "p90", "p99", "max", "requests_per_s")}
UNITS = {"items_per_s": "emb/s", "requests_per_s": "req/s"}


def metric_label(metric: str) -> tuple[str, str]:
    """(unit, the table's metric column) of a cell's metric: "p50" -> ("ms", "p50 ms")."""
    unit = UNITS.get(metric, "ms")
    return unit, f"{metric} {unit}" if unit == "ms" else unit


def ahead(florist: float, other: float, unit: str) -> float:
    """How many times florist is ahead: other / florist for latency, florist / other for rates."""
    return florist / other if unit != "ms" else other / florist


def print_table(cells: list[Cell]) -> None:
    infinity = any("infinity" in c.results or "infinity" in c.failed for c in cells)
    print("\nratio: how many times florist is ahead (baseline / florist for latency, florist / baseline for throughput)")
    print(f"{'scenario':<60}{'metric':>10}{'florist':>12}{'baseline':>12}{'ratio':>9}"
          + (f"{'infinity':>12}{'ratio':>9}" if infinity else "") + f"   n (florist / baseline{' / infinity' if infinity else ''})")
    alone = not any(c.tried("baseline") for c in cells)  # --florist-only
    for c in cells:
        if c.skipped or "florist" not in c.results or not (alone or c.tried("baseline")):
            print(f"{c.key:<60}  {'skipped: ' + c.skipped if c.skipped else 'not run (the run stopped first)'}")
            continue
        f, b, i = c.results["florist"], c.results.get("baseline"), c.results.get("infinity")
        for m in METRICS[c.scenario]:
            unit, name = metric_label(m)
            line = f"{c.key:<60}{name:>10}{f[m]:>12.2f}" + (f"{b[m]:>12.2f}{ahead(f[m], b[m], unit):>8.2f}x" if b
                                                             else f"{'failed' if 'baseline' in c.failed else '-':>12}{'':>9}")
            if infinity:
                line += f"{i[m]:>12.2f}{ahead(f[m], i[m], unit):>8.2f}x" if i else f"{'failed' if 'infinity' in c.failed else '-':>12}{'':>9}"
            print(f"{line}   {f['n']} / {b['n'] if b else '-'}" + (f" / {i['n'] if i else '-'}" if infinity else ""))
    for c in cells:
        for server, why in c.sits_out.items():
            if infinity and server == "infinity" and not c.skipped:
                print(f"NOTE: {server} sat out '{c.key}': {why}")
        for server, why in c.failed.items():
            print(f"NOTE: {server} failed in '{c.key}': {why}")
    for c in cells:
        for server, r in c.results.items():
            if r["retries"]:
                print(f"NOTE: {server} answered 429 / 503 {r['retries']} times in '{c.key}'; the client waited its Retry-After each time (included above)")
            if r["n"] < r["planned"]:
                print(f"NOTE: {server} ran {r['n']} of {r['planned']} timed requests in '{c.key}' within --cell-seconds")


def write_json(out: Path, cells: list[Cell], meta: dict) -> Path:
    rows = [{"scenario": c.scenario, "name": SCENARIO_NAME[c.scenario], "label": c.label, "items_per_request": c.items, "client_processes": c.procs,
             "clients_per_process": c.clients, "warmup_per_client": c.warmup, "skipped": c.skipped or None, **c.results,
             **({"failed": c.failed} if c.failed else {})} for c in cells]
    path = out / "results.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return path


def write_report_rows(path: Path, cells: list[Cell]) -> Path:
    """--json: every florist figure as a bench/report.py row (the baseline beside it where it ran),
    the rows bench/ab.py compares between settings."""
    rows = []
    for c in cells:
        f, b = c.results.get("florist"), c.results.get("baseline")
        if c.skipped or not f:
            continue
        for m in METRICS[c.scenario]:
            unit, name = metric_label(m)
            rows.append({"scenario": c.key, "metric": name, "florist": f[m],
                         "transformers": b[m] if b else None, "unit": unit, "speedup": ahead(f[m], b[m], unit) if b else None})
    path.write_text(json.dumps(rows, indent=1))
    return path


def cell_from_row(row: dict) -> Cell:
    """A measured cell back from a results.json row (for --replot)."""
    return Cell(scenario=row["scenario"], label=row["label"], route="", bodies=[], items=row["items_per_request"],
                procs=row["client_processes"], clients=row["clients_per_process"], skipped=row.get("skipped") or "",
                results={k: row[k] for k in SERVERS if row.get(k)}, failed=row.get("failed") or {})  # older files have no "infinity"


def minor_label(v: float) -> str:
    """A log axis' label between decades: only at 2 and 5 (20, 50, 200, ...); every minor tick's
    label overlaps its neighbours' once the axis spans a few decades."""
    return f"{v:g}" if v > 0 and f"{v:.0e}"[0] in "25" else ""


def decade_below(values) -> float | None:
    """The power of ten at or below the smallest positive value (None if there is none): where
    a log axis of bars starts, so the lowest bar keeps a visible height."""
    lowest = min((v for v in values if v is not None and v > 0), default=None)
    return None if lowest is None else 10.0 ** math.floor(math.log10(lowest))


def bar_slots(c: Cell) -> tuple[float, list[tuple[str, float]]]:
    """(bar width, [(server, offset from the group's x)]): a slot for each server that ran the cell
    or failed it, in SERVERS' order, side by side within 0.8 of an x unit."""
    servers = [server for server in SERVERS if c.tried(server)]
    width = 0.8 / len(servers)
    return width, [(server, (k - (len(servers) - 1) / 2) * width) for k, server in enumerate(servers)]


def write_plots(out: Path, cells: list[Cell]) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not importable (pip install matplotlib)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2 x 10^1, on log axes
    two_five = FuncFormatter(lambda v, _: minor_label(v))

    def log_y(ax):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(two_five)
        ax.tick_params(axis="y", which="minor", labelsize=7)

    colors = {"florist": "tab:green", "baseline": "tab:gray", "infinity": "tab:blue"}
    written = []
    done = [c for c in cells if "florist" in c.results]

    def bars(ax, x, c: Cell, value) -> None:
        """One bar per server side by side around each x; a server that failed the cell (or was
        not run in it) keeps its slot, marked so, and the others stay in the legend's order."""
        width, slots = bar_slots(c)
        for server, offset in slots:
            if server in c.results:
                ax.bar(x + offset, value(c.results[server]), width, label=server, color=colors[server])
            else:
                mark = "not run" if c.failed[server].startswith("not run") else "failed"
                for at in np.atleast_1d(x + offset):
                    ax.text(at, 0.02, mark, transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom", fontsize=7, color=colors[server])

    for s in (1, 2, 4):
        group = [c for c in done if c.scenario == s]
        if not group:
            continue
        fig, axes = plt.subplots(1, len(group), figsize=(3.2 * len(group), 3.6), sharey=True, squeeze=False)
        for ax, c in zip(axes[0], group):
            qs = ("p50", "p90", "p99", "max")
            x = np.arange(len(qs))
            bars(ax, x, c, lambda r: [r[q] for q in qs])
            ax.set_xticks(x, qs)
            log_y(ax)
            ax.set_title(c.label, fontsize=9)
        # Bars on a log axis start at its bottom: put that a decade boundary below the lowest
        # bar, or the fastest server's bars shrink to stubs (matplotlib's margin is arbitrary).
        bottom = decade_below(r.get(q) for c in group for r in c.results.values() for q in qs)
        if bottom is not None:
            axes[0][0].set_ylim(bottom=bottom)
        axes[0][0].set_ylabel("latency, ms (log)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"scenario {s}: {SCENARIO_NAME[s]}, latency percentiles")
        fig.tight_layout()
        written.append(out / f"scenario{s}_latency.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    group = [c for c in done if c.scenario == 3]
    if group:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for k, c in enumerate(group):
            bars(ax, np.array([k]), c, lambda r: [r["items_per_s"]])
        ax.set_xticks(np.arange(len(group)), [c.label for c in group])
        ax.set_ylabel("embeddings / s")
        ax.set_title(f"scenario 3: {SCENARIO_NAME[3]}, {group[0].procs} client processes")
        by_label = dict(zip(*reversed(ax.get_legend_handles_labels())))  # one entry per server, not per bar
        ax.legend(by_label.values(), by_label.keys())
        fig.tight_layout()
        written.append(out / "scenario3_throughput.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    group = [c for c in done if c.scenario == 4]
    if group:
        clients = [c.procs * c.clients for c in group]  # concurrent clients in all processes
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for server in [x for x in SERVERS if any(x in c.results for c in group)]:  # a cell it failed: a gap in its line
            def at(metric):
                return [c.results[server][metric] if server in c.results else math.nan for c in group]
            a1.plot(clients, at("requests_per_s"), "o-", label=server, color=colors[server])
            a2.plot(clients, at("p99"), "o-", label=f"{server} p99", color=colors[server])
            a2.plot(clients, at("p50"), "o--", label=f"{server} p50", color=colors[server], alpha=0.6)
        for ax, title in ((a1, "throughput, requests / s"), (a2, "latency, ms (log)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(clients, [str(c) for c in clients])
            ax.set_xlabel("concurrent clients")
            ax.set_title(title)
            ax.legend(fontsize=8)
        log_y(a2)
        fig.suptitle(f"scenario 4: {SCENARIO_NAME[4]} ({group[0].label.split(',')[0]})")
        fig.tight_layout()
        written.append(out / "scenario4_concurrency.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def environment(args) -> dict:
    versions = {}
    for name in ("florist", "torch", "transformers", "sentence_transformers", "aiohttp", "fastapi", "uvicorn", "pydantic", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    import torch
    from report import florist_env

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else None
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(), "device": args.device, "gpu": gpu,
            "dtype": args.dtype or ("bf16" if args.device != "cpu" else "fp32"), "versions": versions, "florist_env": florist_env()}


def check_servers(cells: list[Cell], urls: dict[str, str], task: str, running: list[str], meta: dict) -> list[str]:
    """florist's outputs against each other server's, before any timing. The baseline must agree
    (or the run stops); Infinity that fails its check or disagrees is left untimed, each cell
    saying why. Returns the servers to time."""
    for other in running[1:]:
        try:
            result = asyncio.run(check([c for c in cells if not c.skipped], urls, task, other))
        except ServerFailed as e:  # Infinity's errors are results; florist's or the baseline's stop the run
            if other == "baseline":
                raise
            result = {"what": f"florist vs {other}", "value": float("nan"), "bound": "", "rows": 0, "ok": False, "error": str(e)}
        meta["checks"][task if other == "baseline" else f"{task} {other}"] = result
        print(f"  check: {result['what']} over {result['rows']} rows: {result['value']:.6f} ({result['bound']})"
              + (f" FAILED: {result['error']}" if "error" in result else ""), flush=True)
        if not result["ok"] and other == "baseline":
            raise SystemExit(f"florist's {task} outputs differ from {other}'s: {result}; not timing")
        if not result["ok"]:
            for c in cells:
                c.failed[other] = "not timed: " + result.get("error", f"its outputs differ from florist's ({result['value']:.6f})")
    return [s for s in running if s == "florist" or meta["checks"][task if s == "baseline" else f"{task} {s}"]["ok"]]


def time_cell(cell: Cell, server: str, proc: Proc, cell_seconds: float, task: str) -> None:
    """One server's measurement of one cell into cell.results, with a progress line. A baseline or
    Infinity failure is a result too: it goes to cell.failed with the server's output meanwhile,
    and the run goes on; florist's stops the run."""
    t, logged = time.perf_counter(), len(proc.lines)
    if (code := proc.proc.poll()) is not None:
        cell.failed[server] = f"not run: the server had exited (code {code})"
        print(f"  {cell.key:<58} {server:<9} {cell.failed[server]}", flush=True)
        return
    try:
        r = cell.results[server] = measure(cell, proc.url, cell_seconds, server)
    except RuntimeError as e:
        if server == "florist":
            raise
        cell.failed[server] = str(e)[:500]
        time.sleep(1.0)  # its last words
        tail = "".join(proc.lines[logged:])[-3000:]
        print(f"  {cell.key:<58} {server:<9} FAILED: {cell.failed[server]}\n    its output meanwhile:\n"
              + "\n".join("    | " + line for line in tail.splitlines()), flush=True)
        return
    notes = []
    if r["retries"]:
        notes.append(f"{r['retries']} retries after 429 / 503")
    if server == "florist":  # what the engine logged meanwhile (warm-up included): captures and first sights stall their batch
        lines = proc.lines[logged:]
        r["graphs_captured"] = captures(lines)
        r["first_sights"], r["first_sights_cpu"], r["first_sights_compiled"] = first_sights(lines)
        r["covered_batches"] = covered(lines)
        if r["graphs_captured"]:
            notes.append(f"{len(r['graphs_captured'])} graphs captured ({sum(r['graphs_captured']):.0f} ms)")
        if r["first_sights"]:
            slowest = max(range(len(r["first_sights"])), key=r["first_sights"].__getitem__)
            notes.append(f"{len(r['first_sights'])} first sights (slowest launch {r['first_sights'][slowest]:.0f} ms, "
                         f"{r['first_sights_cpu'][slowest]:.0f} ms of it on the CPU, {r['first_sights_compiled'][slowest]} kernels compiled)")
        if r["covered_batches"]:
            notes.append(f"{r['covered_batches']} batches in a covering graph")
    print(f"  {cell.key:<58} {server:<9} n {r['n']:>4}  p50 {r['p50']:9.2f} ms  p99 {r['p99']:9.2f} ms  "
          f"{r['items_per_s']:9.1f} {'emb' if task == 'embed' else 'pairs'}/s  ({time.perf_counter() - t:.1f} s)"
          + "".join("  " + n for n in notes), flush=True)


# -- main --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory for results.json and the plots (default: a new temporary one)")
    p.add_argument("--json", type=Path, default=None, help="also write florist's figures here as bench/report.py rows (what bench/ab.py reads)")
    p.add_argument("--scenarios", default="1,2,3,4", help="comma-separated scenario numbers (default 1,2,3,4)")
    p.add_argument("--geometry", default=None, choices=sorted(GEOMETRIES), help="random-weight model (and its pair for the other task); default qwen3-0.6b")
    p.add_argument("--model", action="append", help="a model directory instead (repeat for an embedding and a scoring model)")
    p.add_argument("--requests", type=int, default=None, help="timed requests per cell of scenario 1 (default 200; scenario 4 takes 4x, the others scale from it)")
    p.add_argument("--cell-seconds", type=float, default=60.0, help="stop a cell's timed requests after this long (default 60; the count says how many ran)")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--workers", type=int, default=1, help="florist gateway workers (default 1; the baseline runs one uvicorn worker)")
    p.add_argument("--busy-poll", action="store_true", help="run `florist serve --busy-poll`: the engine servers' event loops never sleep while idle")
    p.add_argument("--gateway-busy-poll", action="store_true", help="run `florist serve --gateway-busy-poll`: the gateway's loop turns while idle and polls for lone replies")
    p.add_argument("--gateway-reply-spin-ms", type=float, default=None, metavar="MS", help="run `florist serve --gateway-reply-spin-ms MS`: a lone request polls for its reply")
    p.add_argument("--no-local-socket", action="store_true", help="run `florist serve --no-local-socket`: gateway to engine over gRPC only")
    p.add_argument("--serve-flags", default="", metavar="FLAGS",
                   help="more `florist serve` flags, given with '=' as they start with '--', e.g. --serve-flags=\"--launch-ahead-ms inf\"")
    p.add_argument("--florist-only", action="store_true",
                   help="time florist alone (no baseline, no Infinity, no output check): for comparing florist's own settings; "
                        "the table's other columns stay empty")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="florist serve's start-up warm-up (its default): GPU engines run the shapes they will meet before serving; "
                        "--no-warm-up passes `florist serve --no-warm-up`")
    p.add_argument("--infinity", default=None, metavar="COMMAND",
                   help="also run Infinity (infinity-emb) for the embedding scenarios: the command that starts a Python which imports "
                        "infinity_emb, e.g. \"env PYTHONPATH=/opt/infinity python3\" (infinity-emb needs transformers < 5, so usually an environment of its own)")
    p.add_argument("--baseline-http", default="auto", choices=["auto", "fastapi", "aiohttp"], help="the baseline's HTTP server (auto: FastAPI when importable)")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU, a few requests: the code path only")
    p.add_argument("--replot", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                   help="only print the table again and redraw the plots into --out from earlier results.json files (runs nothing)")
    args = p.parse_args(argv)
    if args.replot:
        out = args.out or Path(tempfile.mkdtemp(prefix="florist-bench-serve-"))
        out.mkdir(parents=True, exist_ok=True)
        cells = [cell_from_row(row) for f in args.replot for row in json.loads(f.read_text())["rows"]]
        print_table(cells)
        print("wrote " + ", ".join(str(w) for w in write_plots(out, [c for c in cells if not c.skipped])))
        return 0
    if args.florist_only and args.infinity:
        p.error("--florist-only times florist alone; drop --infinity")
    started = time.perf_counter()
    scenarios = sorted({int(s) for s in args.scenarios.split(",") if s.strip()})
    if not set(scenarios) <= set(SCENARIO_TASK):
        p.error(f"--scenarios takes numbers among 1,2,3,4; got {args.scenarios}")
    plan = SMOKE_PLAN if args.smoke else Plan()
    args.requests = args.requests or (6 if args.smoke else 200)
    args.geometry = args.geometry or ("tiny-qwen3" if args.smoke else "qwen3-0.6b")
    if args.device is None:
        import torch

        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    out = args.out or Path(tempfile.mkdtemp(prefix="florist-bench-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.infinity:
        print("infinity: not run (--infinity COMMAND says how to start a Python that imports infinity_emb)")
    else:
        meta_infinity = infinity_versions(args.infinity)
        print(f"infinity: {meta_infinity}")

    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-serve-models-"))
    meta = environment(args)
    if args.infinity:
        meta["versions"]["infinity"] = meta_infinity
    meta["models"], meta["servers"], meta["checks"] = {}, {}, {}
    all_cells: list[Cell] = []
    try:
        models = prepare_models(args, tmp, {SCENARIO_TASK[s] for s in scenarios})
        for s in scenarios:
            if SCENARIO_TASK[s] not in models:
                print(f"scenario {s} skipped: no {SCENARIO_TASK[s]} model (give one with --model DIR)")
        for task in ("embed", "score"):
            if task not in models:
                continue
            model = models[task]
            cells = plan_cells(scenarios, plan, args.requests, model, for_infinity=bool(args.infinity))
            meta["models"][task] = {k: str(v) for k, v in model.items()}
            all_cells += cells
            if all(c.skipped for c in cells):
                continue
            servers = start_servers(model, args)
            try:
                for s, server in servers.items():
                    if server.start_error:
                        for c in cells:
                            if s not in c.sits_out and not c.skipped:
                                c.failed[s] = f"not run: {s} {server.start_error}"
                running = [s for s in SERVERS if s in servers and not servers[s].start_error]
                urls = {s: servers[s].url for s in running}
                meta["servers"][task] = {s: servers[s].banner for s in running}
                print(f"{task} model {model['path'].name}:" + "".join(f"\n  {servers[s].banner}" for s in running), flush=True)
                warmed = [line.strip() for line in servers["florist"].lines if "warmed up" in line]  # florist's start-up warm-up, if it ran
                if warmed:
                    meta["servers"][task]["florist warm-up"] = warmed
                    print("  " + "\n  ".join(warmed), flush=True)
                if args.florist_only:
                    print("  check: none (--florist-only: no other server to compare with)", flush=True)
                running = check_servers(cells, urls, task, running, meta)
                for cell in cells:
                    if cell.skipped:
                        continue
                    for server in running:  # one after the other, cell by cell: drift hits them alike
                        if server not in cell.sits_out:
                            time_cell(cell, server, servers[server], args.cell_seconds, task)
                            meta["elapsed_s"] = time.perf_counter() - started
                            write_json(out, all_cells, meta)  # after every cell: a run stopped at its time limit keeps what it measured
            finally:
                for server in servers.values():
                    server.stop()
    finally:
        # Also after a failure: the table and the files show what was measured until then.
        shutil.rmtree(tmp, ignore_errors=True)
        all_cells.sort(key=lambda c: c.scenario)
        meta["elapsed_s"] = time.perf_counter() - started
        print_table(all_cells)
        written = [write_json(out, all_cells, meta), *write_plots(out, all_cells)]
        if args.json:
            written.append(write_report_rows(args.json, all_cells))
        print(f"\nwrote {', '.join(str(w) for w in written)}")
        print(f"total {meta['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
