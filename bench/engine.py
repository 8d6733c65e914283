"""florist's engine against Hugging Face transformers on the same random weights, in one process.

Scenarios (issue "GPU speed"): batch-1 latency at 128 / 512 / 4096 tokens, 100 x 512 and ragged
100 x U(32..512) throughput for the Qwen3-0.6B geometry (causal and bidirectional pplx-embed), ragged
100 x U(64..256) (a corpus cut into passages) for both, the
all-MiniLM-L6-v2 geometry in fp16, a stream of back-to-back step() calls, start-up time, and the
graph/eager crossover. Throughput is measured twice: synchronously (each batch's result read before
the next is packed, as transformers is timed) and streamed (two batches in flight, the way a corpus
is embedded; the baseline column repeats transformers' synchronous figure). Outputs are checked (cosine >= 0.999 against transformers) before timing.

    python bench/engine.py                 # everything, prints one table at the end
    python bench/engine.py --smoke         # tiny models on the CPU: the code path only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model, shapes_arg  # noqa: E402
from report import florist_env, print_kernel_table, print_summary, percentiles, record, sync, time_calls  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.batch import HostBatch  # noqa: E402

class HFBaseline:
    """What a user would otherwise run: transformers with SDPA, padded batches."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str, pooling: str, bidirectional: bool):
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        if bidirectional:
            for layer in self.model.layers:
                layer.self_attn.is_causal = False
        self.device, self.pooling, self.bidirectional = device, pooling, bidirectional

    @torch.inference_mode()
    def embed(self, seqs: list[np.ndarray]) -> np.ndarray:
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        kwargs = {"attention_mask": mask} if any(len(s) != n for s in seqs) else {}
        if kwargs and self.bidirectional:
            # transformers makes a causal mask from a padding mask whatever the layers' is_causal
            # says, so a bidirectional model gets its mask ready-made: every query row (padding
            # rows too, which stay finite) attends to its sequence's real tokens, for each layer
            # type.
            full = mask.bool()[:, None, None, :].expand(len(seqs), 1, n, n)
            kwargs = {"attention_mask": {kind: full for kind in set(self.model.config.layer_types)}}
        h = self.model(input_ids=ids, **kwargs).last_hidden_state.float()
        if self.pooling == "lasttoken":
            out = h[torch.arange(len(seqs), device=h.device), mask.sum(1) - 1]
        else:
            m = mask.unsqueeze(-1).float()
            out = (h * m).sum(1) / m.sum(1)
        return out.cpu().numpy()


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def random_seqs(rng, vocab: int, lens: list[int]) -> list[np.ndarray]:
    return [rng.integers(200, vocab, size=n).astype(np.int32) for n in lens]


def florist_embed(engine: Engine, seqs: list[np.ndarray]) -> np.ndarray:
    return engine.step(HostBatch.from_sequences(seqs)).numpy()


def run_geometry(name: str, path: Path, *, dtype, device, pooling, bidirectional, latency_lens, batches, args, baseline_path: Path | None = None):
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(path, device=device, dtype=dtype)
    florist_embed(engine, random_seqs(rng, engine.info.vocab_size, [16]))  # the first result ends start-up
    startup_s = time.perf_counter() - t0
    record(f"{name} start-up to first result", "seconds", startup_s, None, "s")
    hf = HFBaseline(baseline_path or path, dtype, device, pooling, bidirectional) if not args.no_baseline else None
    vocab = engine.info.vocab_size

    for n in latency_lens:
        seqs = random_seqs(rng, vocab, [n])
        ours = florist_embed(engine, seqs)
        if hf is not None:
            ref = hf.embed(seqs)
            cos = cosine_min(ours, ref)
            assert cos >= 0.999, f"{name} {n} tokens: cosine {cos} < 0.999 against transformers"
        f = percentiles(time_calls(lambda: florist_embed(engine, seqs), args.iters, args.warmup))
        b = percentiles(time_calls(lambda: hf.embed(seqs), args.baseline_iters, 3)) if hf is not None else None
        record(f"{name} batch 1 x {n} tokens", "p50", f["p50"], b and b["p50"], "ms", {"florist_pct": f, "baseline_pct": b})
        record(f"{name} batch 1 x {n} tokens", "p99", f["p99"], b and b["p99"], "ms")

    for label, lens in batches:
        seqs = random_seqs(rng, vocab, lens)
        ours = florist_embed(engine, seqs)
        if hf is not None:
            cos = cosine_min(ours, hf.embed(seqs))
            assert cos >= 0.999, f"{name} {label}: cosine {cos} < 0.999"
        f = time_calls(lambda: florist_embed(engine, seqs), max(3, args.iters // 20), 2)
        b = time_calls(lambda: hf.embed(seqs), max(2, args.baseline_iters // 10), 1) if hf is not None else None
        f_rate = len(seqs) / (statistics.median(f) / 1e3)
        b_rate = len(seqs) / (statistics.median(b) / 1e3) if b else None
        record(f"{name} {label}", "emb/s", f_rate, b_rate, "emb/s")
        record(f"{name} {label}, streamed", "emb/s", streamed_rate(engine, seqs, max(4, args.iters // 20)), b_rate, "emb/s")
    if engine.runner.graphs is not None:
        stats = engine.runner.graphs.stats()
        record(f"{name} graphs held", "MiB", stats["graph_memory_bytes"] / 2**20, None, "MiB", stats)
    return engine


def streamed_rate(engine: Engine, seqs: list[np.ndarray], n_steps: int) -> float:
    """Embeddings/s over n_steps back-to-back steps of the same batch, two in flight (how a
    corpus is embedded: the next batch is packed and launched while one runs); host packing
    included. The synchronous row above waits for each result before packing the next batch."""
    lazies = [engine.step(HostBatch.from_sequences(seqs))]
    lazies.pop().numpy()
    t = time.perf_counter()
    for _ in range(n_steps):
        lazies.append(engine.step(HostBatch.from_sequences(seqs)))
        if len(lazies) > 1:
            lazies.pop(0).numpy()
    for lz in lazies:
        lz.numpy()
    return n_steps * len(seqs) / (time.perf_counter() - t)


def step_stream(engine: Engine, name: str, n_steps: int, shape: tuple[int, int]):
    """200 back-to-back step() calls: host wall time against the sum of the steps' GPU times."""
    rng = np.random.default_rng(1)
    hosts = [HostBatch.from_sequences(random_seqs(rng, engine.info.vocab_size, [shape[1]] * shape[0])) for _ in range(8)]
    for h in hosts[:3]:
        engine.step(h).numpy()
    sync()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_steps)]
    lazies = []
    t = time.perf_counter()
    for i in range(n_steps):
        events[i][0].record()
        lazies.append(engine.step(hosts[i % len(hosts)]))
        events[i][1].record()
        if len(lazies) > 2:  # a server keeps two in flight and reads results as they land
            lazies.pop(0).numpy()
    for lz in lazies:
        lz.numpy()
    wall = (time.perf_counter() - t) * 1e3
    gpu = sum(a.elapsed_time(b) for a, b in events)
    record(f"{name} stream {n_steps} x step({shape[0]}x{shape[1]})", "wall/gpu", wall / gpu, None, "ratio", {"wall_ms": wall, "gpu_ms": gpu})


def graph_threshold(engine: Engine, name: str, sizes: list[int]):
    """Batch time replayed from a graph vs eager at growing token counts (8 sequences, or more
    where 8 would pass the model's input limit)."""
    rng = np.random.default_rng(2)
    graphs = engine.runner.graphs
    for tokens in sizes:
        seqlen = min(tokens // 8, engine.info.max_input_tokens)
        host = HostBatch.from_sequences(random_seqs(rng, engine.info.vocab_size, [seqlen] * (tokens // seqlen)))
        saved = graphs.max_tokens
        graphs.max_tokens = 1 << 30
        g = statistics.median(time_calls(lambda: engine.step(host).numpy(), 10, 3))
        graphs.max_tokens = 0
        e = statistics.median(time_calls(lambda: engine.step(host).numpy(), 10, 3))
        graphs.max_tokens = saved
        record(f"{name} graph vs eager, {tokens // seqlen} x {seqlen}", "ms", g, e, "ms")


def profile(engine: Engine, name: str, shapes: list[list[int]], iters: int = 10):
    """Device kernels per step for a few shapes (graph replays show their kernels too)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    rng = np.random.default_rng(4)
    for lens in shapes:
        host = HostBatch.from_sequences(random_seqs(rng, engine.info.vocab_size, lens))
        for _ in range(3):
            engine.step(host).numpy()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                engine.step(host).numpy()
        print_kernel_table(prof, iters, f"profile {name} {len(lens)} x {lens[0]}", rows=14)


def latency_breakdown(engine: Engine, name: str, shapes: list[tuple[int, int]], n: int = 200):
    """Where a synchronous step goes, per batch shape (sequences, tokens each): host time to pack
    the HostBatch, host time until step() returns (launch), device time between CUDA events
    recorded before and after step() (it includes whatever time the GPU waits for the launch), and
    the round trip from step() to the result read (packing apart, as in earlier runs' figures)."""
    rng = np.random.default_rng(5)
    for batch, seqlen in shapes:
        seqs = random_seqs(rng, engine.info.vocab_size, [seqlen] * batch)
        reps = n if batch * seqlen <= 4096 else max(20, n // 10)
        for _ in range(min(20, reps)):
            engine.step(HostBatch.from_sequences(seqs)).numpy()
        pack, launch, gpu, total = [], [], [], []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            host = HostBatch.from_sequences(seqs)
            tp = time.perf_counter()
            a.record()
            lazy = engine.step(host)
            b.record()
            t1 = time.perf_counter()
            lazy.numpy()
            t2 = time.perf_counter()
            b.synchronize()
            pack.append((tp - t0) * 1e3)
            launch.append((t1 - tp) * 1e3)
            total.append((t2 - tp) * 1e3)
            gpu.append(a.elapsed_time(b))
        med = statistics.median
        record(f"{name} {batch} x {seqlen} round trip", "p50 ms", med(total), None, "ms",
               {"pack_ms": med(pack), "launch_ms": med(launch), "gpu_ms": med(gpu), "exposed_host_ms": med(total) - med(gpu)})
        print(f"    pack (HostBatch) {med(pack):.3f} ms, launch (host, step() returns) {med(launch):.3f} ms, "
              f"device (events) {med(gpu):.3f} ms, round trip {med(total):.3f} ms ({reps} steps)", flush=True)


def last_token_ab(engine: Engine, name: str, n: int = 100, seqlen: int = 512, reps: int = 10):
    """100 x 512 embeddings/s with the final layer for the last tokens only (the default for
    last-token pooling) and for every token, alternating, in one run."""
    model = engine.runner.model.model
    if not getattr(model, "last_token_only", False):
        print(f"{name}: the model reads more than the last token; nothing to compare")
        return
    seqs = random_seqs(np.random.default_rng(6), engine.info.vocab_size, [seqlen] * n)
    rates = {True: [], False: []}
    for _ in range(reps):
        for flag in (True, False):
            model.last_token_only = flag
            rates[flag].append(n / (statistics.median(time_calls(lambda: florist_embed(engine, seqs), 3, 1)) / 1e3))
    model.last_token_only = True
    record(f"{name} {n} x {seqlen}, final layer last tokens only", "emb/s", statistics.median(rates[True]), statistics.median(rates[False]), "emb/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models, CPU, few iterations")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--baseline-iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--breakdown-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[128, 512],
                    help="comma list: the Qwen3 batch-1 lengths --only breakdown times (default 128,512)")
    ap.add_argument("--minilm-breakdown-shapes", type=shapes_arg, default=[(1, 128)],
                    help="comma list of BATCHxTOKENS: the shapes --only minilm-breakdown times (default 1x128)")
    ap.add_argument("--only", default="", help="comma list: qwen3,pplx,minilm,stream,threshold,profile,breakdown,minilm-breakdown,lasttoken")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    want = lambda k: not only or k in only  # noqa: E731
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-"))
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}")
    print("florist settings from the environment: " + (" ".join(f"{k}={v}" for k, v in florist_env().items()) or "none (the defaults)"))
    print(f"{'scenario':42s} {'metric':10s} {'florist':>10s} {'transformers':>10s} {'unit':6s} speedup")
    if args.smoke:
        args.iters, args.baseline_iters, args.warmup = 5, 2, 1
        qwen = make_model(tmp / "qwen", "tiny-qwen3", dtype=torch.float32)
        run_geometry("tiny-qwen3", qwen, dtype=torch.float32, device=device, pooling="lasttoken", bidirectional=False,
                     latency_lens=[16, 100], batches=[("8 x 32", [32] * 8)], args=args)
        bert = make_model(tmp / "bert", "tiny-bert", dtype=torch.float32)
        run_geometry("tiny-bert", bert, dtype=torch.float32, device=device, pooling="mean", bidirectional=False,
                     latency_lens=[16], batches=[("8 x 32", [32] * 8)], args=args)
    else:
        rng = np.random.default_rng(3)
        ragged = [int(x) for x in rng.integers(32, 513, size=100)]
        chunks = [int(x) for x in rng.integers(64, 257, size=100)]  # a corpus cut into passages of <= 256 tokens
        if want("qwen3") or want("stream") or want("threshold") or want("profile") or want("breakdown") or want("lasttoken"):
            qwen = make_model(tmp / "qwen3", "qwen3-0.6b")
        if want("qwen3"):
            engine = run_geometry("qwen3-0.6b causal", qwen, dtype=torch.bfloat16, device=device, pooling="lasttoken", bidirectional=False,
                                  latency_lens=[128, 512, 4096], batches=[("100 x 512", [512] * 100), ("100 x U(32..512)", ragged),
                                                                                    ("100 x U(64..256)", chunks)], args=args)
        elif want("profile") or want("stream") or want("threshold") or want("breakdown") or want("lasttoken"):
            engine = Engine.from_pretrained(qwen, device=device)
        else:
            engine = None
        if want("profile"):
            profile(engine, "qwen3-0.6b", [[128], [512] * 100])
        if want("breakdown"):
            latency_breakdown(engine, "qwen3-0.6b", [(1, t) for t in args.breakdown_tokens])
        if want("lasttoken"):
            last_token_ab(engine, "qwen3-0.6b")
        if want("stream"):
            step_stream(engine, "qwen3-0.6b", 200, (8, 512))
        if want("threshold"):
            graph_threshold(engine, "qwen3-0.6b", [1024, 2048, 4096, 8192, 16384])
        del engine
        if want("pplx"):
            pplx = make_model(tmp / "pplx", "qwen3-0.6b", variant="pplx")
            # transformers does not know model_type bidirectional_pplx_qwen3: its baseline reads a
            # twin directory that calls the same weights plain qwen3 (made non-causal in HFBaseline).
            pplx_hf = tmp / "pplx-hf"
            pplx_hf.mkdir()
            for f in pplx.iterdir():
                if f.is_file() and f.name != "config.json":
                    (pplx_hf / f.name).symlink_to(f)
            cfg = json.loads((pplx / "config.json").read_text())
            cfg.update(model_type="qwen3", architectures=["Qwen3Model"])
            (pplx_hf / "config.json").write_text(json.dumps(cfg))
            e = run_geometry("pplx-embed-0.6b bidirectional", pplx, dtype=torch.bfloat16, device=device, pooling="mean", bidirectional=True,
                             latency_lens=[128, 512, 4096], batches=[("100 x 512", [512] * 100), ("100 x U(64..256)", chunks)], args=args,
                             baseline_path=pplx_hf)
            del e
        if want("minilm"):
            minilm = make_model(tmp / "minilm", "minilm-l6", dtype=torch.float16)
            e = run_geometry("all-MiniLM-L6-v2 fp16", minilm, dtype=torch.float16, device=device, pooling="mean", bidirectional=False,
                             latency_lens=[128], batches=[("100 x 256", [256] * 100), ("100 x 512", [512] * 100)], args=args)
            if want("threshold"):
                graph_threshold(e, "minilm", [1024, 4096, 16384, 32768])
        if want("minilm-breakdown"):
            minilm = make_model(tmp / "minilm", "minilm-l6", dtype=torch.float16)
            latency_breakdown(Engine.from_pretrained(minilm, device=device, dtype=torch.float16), "all-MiniLM-L6-v2 fp16", args.minilm_breakdown_shapes)
    print_summary(args.json)


if __name__ == "__main__":
    main()
