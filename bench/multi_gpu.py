"""Several GPUs of one host: the vocab-parallel argmax over real NCCL, tensor-parallel generation
against TP 1, and `florist serve` with one engine replica per GPU against one replica.

    argmax     one process per rank (NCCL), the real ParallelLMHead + LogitsProcessor on each, tie-
               heavy integer weights (every logit an exact small integer, so the sharded result
               must equal the unsharded one bit for bit; ties at the shard edges, +inf and NaN),
               vocabularies 131072 and 32001 (padded), 1..64 rows: get_top_tokens must equal
               argmax(compute_logits) and the argmax of the unsharded product on every rank,
               eagerly and from a captured CUDA graph (--replays fresh inputs).
               Then the time per greedy selection with the real collective, inside CUDA graphs:
               the fused kernels (candidates, all-gather, pick) against the torch chain (max,
               all-gather of (value, id), argmax over ranks) and against gathering the logits
               (what compute_logits(h).argmax(-1) costs), on one rank's shard of a 131072 vocab;
               and the same three with the LM head (Qwen3-0.6B: hidden 1024, vocab 151936).
    generate   the Qwen3-0.6B geometry (random bf16 weights) at TP 1 and at each --tp: greedy
               tokens of --prompts prompts compared; where a sequence diverges, transformers (fp32,
               same weights) gives the gap between the two stacks' choices at that position, so a
               divergence can be told from rounding (a tiny gap) or from a bug (a large one);
               batch-1 decode ms per token at each TP.
    replicas   `florist serve --device cuda:0` against `--device cuda:0,...` (one engine replica per
               GPU) on the Qwen3-0.6B embedding geometry: batches of 100 x 512 tokens from 8
               concurrent clients, embeddings/s; outputs compared between the two first.

    python bench/multi_gpu.py --out OUT                  # all three, every visible GPU
    python bench/multi_gpu.py --only argmax --tp 2,4
    python bench/multi_gpu.py --smoke                    # CPU: gloo ranks, tiny models, few requests

Writes one table per part to stdout and OUT/multi_gpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from florist.distributed import all_gather_dim0, destroy_tensor_parallel, init_tensor_parallel  # noqa: E402
from florist.kernels import vocab_parallel_argmax as vpa  # noqa: E402
from florist.layers.embedding import ParallelLMHead, pad_vocab  # noqa: E402
from florist.layers.logits_processor import LogitsProcessor  # noqa: E402
import vocab_parallel_argmax as vpa_bench  # noqa: E402  (bench/vocab_parallel_argmax.py: graph capture and timing)

TIE_HIDDEN = 16  # features of the tie-heavy LM head: its logits are integers within +-2 * (3 + 15), exact in bf16
ARGMAX_ROWS = (1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 63, 64)
TIMED_ROWS = (1, 2, 4, 8, 16, 32, 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- tie-heavy LM heads (shared with tests/test_tensor_parallel_gloo.py) ------------------------------
def tie_heavy_weight(vocab: int, hidden: int, tp: int, dtype: torch.dtype, g: torch.Generator, special: bool) -> torch.Tensor:
    """[vocab, hidden], exact small integers. Feature 0 is 0 everywhere; feature 1 is -1 but 3 on
    both sides of every shard edge and at the last real id (the steered rows' tie crosses ranks);
    features 2.. are random in {-1, 0, 1}. `special`: +inf at id 3 and one past each edge, NaN
    (+inf - inf) two and five past each edge, so a NaN must win over every rank's +inf."""
    size = pad_vocab(vocab, tp) // tp
    edges = [r * size for r in range(1, tp) if r * size < vocab]
    w = torch.randint(-1, 2, (vocab, hidden), generator=g).float()
    w[:, 0] = 0
    w[:, 1] = -1
    w[[e - 1 for e in edges] + edges + [vocab - 1], 1] = 3
    if special:
        inf_ids = [3] + [e + 1 for e in edges if e + 1 < vocab]
        nan_ids = [e + k for e in edges for k in (2, 5) if e + k < vocab]
        w[inf_ids + nan_ids, 2] = float("inf")
        w[nan_ids, 3] = float("-inf")
    return w.to(dtype)


def tie_heavy_hidden(rows: int, hidden: int, dtype: torch.dtype, g: torch.Generator, special: bool) -> torch.Tensor:
    """[rows, hidden] in {1, 2}; even rows drop the steering feature, every third row keeps only it."""
    h = torch.randint(1, 3, (rows, hidden), generator=g).float()
    if not special:  # special rows keep every feature positive (0 * inf would be NaN everywhere)
        h[::2, 1] = 0
        h[::3, 2:] = 0
    return h.to(dtype)


def lm_head_for(vocab: int, hidden: int, weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> LogitsProcessor:
    head = ParallelLMHead(vocab, hidden).to(device=device, dtype=dtype)
    head.weight_loader(head.weight, weight.to(device))
    return LogitsProcessor(head, vocab)


# -- part 1: the argmax over the real collective ------------------------------------------------------
def us_per_call(fn, calls: int) -> float:
    """fn captured `calls` times in one CUDA graph, timed by replays; every rank starts each trial
    together (a barrier, then a synchronize), since the collectives pace them."""
    def together():
        torch.distributed.barrier()
        torch.cuda.synchronize()

    return vpa_bench.replay_us(vpa_bench.capture_calls(fn, calls), calls, before_trial=together)


def check_argmax(rank: int, tp: int, vocabs, rows_list, replays: int, device: torch.device) -> list[dict]:
    """Every row count, both vocabularies, plain and special weights: eager and graph replays."""
    out = []
    for vocab in vocabs:
        for special in (False, True):
            g = torch.Generator().manual_seed(vocab + special)  # the same weights and inputs on every rank
            weight = tie_heavy_weight(vocab, TIE_HIDDEN, tp, torch.bfloat16, g, special)
            proc = lm_head_for(vocab, TIE_HIDDEN, weight, device, torch.bfloat16)
            checked = replayed = 0
            for rows in rows_list:
                hidden = tie_heavy_hidden(rows, TIE_HIDDEN, torch.bfloat16, g, special).to(device)
                where = f"TP {tp} rank {rank}, vocab {vocab}, rows {rows}, special {special}"
                top, logits = proc.get_top_tokens(hidden), proc.compute_logits(hidden)
                full = F.linear(hidden.float(), weight.float().to(device))  # unsharded, exact: small integers
                torch.testing.assert_close(logits.float(), full, rtol=0, atol=0, equal_nan=True, msg=where)
                assert torch.equal(top, logits.argmax(-1)), f"{where}: {top.tolist()} vs {logits.argmax(-1).tolist()}"
                assert torch.equal(top, full.argmax(-1)), where
                assert torch.equal(all_gather_dim0(top).view(tp, rows), top.expand(tp, rows)), f"{where}: ranks disagree"
                checked += 1
                if device.type != "cuda" or replays == 0:
                    continue
                static = hidden.clone()
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    proc.get_top_tokens(static)
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph):
                    graph_top = proc.get_top_tokens(static)
                for i in range(replays):
                    fresh = tie_heavy_hidden(rows, TIE_HIDDEN, torch.bfloat16, g, special).to(device)
                    static.copy_(fresh)
                    graph.replay()
                    expected = proc.compute_logits(fresh).argmax(-1)
                    assert torch.equal(graph_top, expected), f"{where}, replay {i}: {graph_top.tolist()} vs {expected.tolist()}"
                    replayed += 1
            out.append({"tp": tp, "vocab": vocab, "special": special, "row_counts": len(rows_list), "eager_checks": checked, "graph_replays": replayed})
    return out


def check_paths(fused, chain, want: torch.Tensor, full: torch.Tensor, where: str) -> None:
    """The fused path must give torch.argmax's id (the first of tied maxima); the torch chain, whose
    per-rank max may take any of a rank's tied maxima, must give an id holding the maximum."""
    assert torch.equal(fused(), want), f"{where}: the fused argmax disagrees with the gathered one"
    got = chain()
    assert torch.equal(full.gather(1, got[:, None]), full.max(-1, keepdim=True).values), f"{where}: the torch chain misses the maximum"


def torch_chain(logits: torch.Tensor, start_id: int, tp: int) -> torch.Tensor:
    """Greedy ids the way other engines pick them: max over the shard, all-gather (value, id), argmax over ranks."""
    value, index = logits.max(dim=-1)
    pair = torch.stack([value.float(), (index + start_id).float()], dim=-1)
    by_row = all_gather_dim0(pair).view(tp, logits.shape[0], 2).permute(1, 0, 2)
    best = by_row[..., 0].argmax(dim=-1, keepdim=True)
    return by_row[..., 1].gather(-1, best).squeeze(-1).long()


def time_argmax(rank: int, tp: int, calls: int, device: torch.device, vocab: int = 131072, head: tuple[int, int] = (151936, 1024)) -> list[dict]:
    """us per greedy selection on this rank's shard, inside CUDA graphs, the collective real: the
    three paths are checked first. On the CPU (--smoke) they are only checked."""
    timed = device.type == "cuda"
    out = []
    cols = vocab // tp
    start_id = rank * cols
    for rows in TIMED_ROWS:
        g = torch.Generator().manual_seed(1000 * rows + rank)
        logits = (torch.randn(rows, cols, generator=g) * 4).to(torch.bfloat16).to(device)

        def fused():
            cand = vpa.local_argmax_candidates(logits, start_id, cols)
            return vpa.pick_from_candidates(all_gather_dim0(cand), tp)

        chain = lambda: torch_chain(logits, start_id, tp)  # noqa: E731
        gathered = lambda: all_gather_dim0(logits).view(tp, rows, cols).permute(1, 0, 2).reshape(rows, tp * cols)  # noqa: E731
        gather_logits = lambda: gathered().argmax(-1)  # noqa: E731
        check_paths(fused, chain, gather_logits(), gathered(), f"TP {tp}, rows {rows}")
        row = {"tp": tp, "rows": rows, "what": f"argmax of a {vocab}-vocab shard"}
        for name, fn in (("fused", fused), ("torch chain", chain), ("gather logits", gather_logits)):
            row[name] = us_per_call(fn, calls) if timed else None
        out.append(row)
    # The same three with the LM head in front: Qwen3-0.6B's (hidden 1024, vocab 151936).
    vocab, hidden = head
    g = torch.Generator().manual_seed(7)
    proc = lm_head_for(vocab, hidden, (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16), device, torch.bfloat16)
    for rows in TIMED_ROWS:
        h = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))).to(torch.bfloat16).to(device)

        head_chain = lambda: torch_chain(proc.local_logits(h)[:, : proc.num_valid], proc.lm_head.vocab_start, tp)  # noqa: E731
        fns = (("fused", lambda: proc.get_top_tokens(h)), ("torch chain", head_chain), ("gather logits", lambda: proc.compute_logits(h).argmax(-1)))
        full = proc.compute_logits(h)
        check_paths(fns[0][1], head_chain, full.argmax(-1), full, f"TP {tp}, rows {rows}, LM head")
        row = {"tp": tp, "rows": rows, "what": f"LM head {vocab} x {hidden} + argmax"}
        for name, fn in fns:
            row[name] = us_per_call(fn, calls) if timed else None
        out.append(row)
    return out


def argmax_rank(rank: int, tp: int, port: int, args: dict, result_path: str) -> None:
    cuda = args["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the host's cores
    init_tensor_parallel(rank, tp, init_method=f"tcp://127.0.0.1:{port}", backend="nccl" if cuda else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        t = time.perf_counter()
        checks = check_argmax(rank, tp, args["vocabs"], args["rows"], args["replays"] if cuda else 0, device)
        check_s = time.perf_counter() - t
        timings = time_argmax(rank, tp, args["calls"], device) if cuda else time_argmax(rank, tp, 0, device, 4096, (5000, 64))
        if rank == 0:
            Path(result_path).write_text(json.dumps({"checks": checks, "check_s": check_s, "timings": timings}))
    finally:
        destroy_tensor_parallel()


def run_argmax(tps: list[int], args) -> dict:
    results = {}
    for tp in tps:
        path = Path(tempfile.mkdtemp(prefix="florist-argmax-")) / "rank0.json"
        opts = {"device": args.device, "vocabs": (4096, 1001) if args.smoke else (131072, 32001),
                "rows": (1, 2, 5) if args.smoke else ARGMAX_ROWS, "replays": args.replays, "calls": args.calls}
        t = time.perf_counter()
        mp.spawn(argmax_rank, args=(tp, free_port(), opts, str(path)), nprocs=tp, join=True)
        r = json.loads(path.read_text())
        results[tp] = r
        c = r["checks"]
        print(f"argmax TP {tp}: {sum(x['eager_checks'] for x in c)} eager checks and {sum(x['graph_replays'] for x in c)} graph replays "
              f"over vocabularies {sorted({x['vocab'] for x in c})}, ties at the shard edges, +inf and NaN: all equal to the argmax of the "
              f"gathered logits and of the unsharded product ({time.perf_counter() - t:.1f} s)", flush=True)
        if r["timings"] and r["timings"][0]["fused"] is not None:
            print(f"\n  {'TP':>2} {'rows':>4} {'what':32s} {'fused us':>9} {'torch chain':>12} {'gather logits':>14} {'fused/chain':>12} {'fused/gather':>13}")
            for row in r["timings"]:
                print(f"  {row['tp']:2d} {row['rows']:4d} {row['what']:32s} {row['fused']:9.2f} {row['torch chain']:12.2f} {row['gather logits']:14.2f} "
                      f"{row['fused'] / row['torch chain']:12.3f} {row['fused'] / row['gather logits']:13.3f}")
            print(flush=True)
    return results


# -- part 2: tensor-parallel generation ---------------------------------------------------------------
def run_generate(tps: list[int], path: Path, args) -> dict:
    from florist import Engine
    from florist.engine.generation.config import GenerationConfig

    dtype = torch.float32 if args.smoke else torch.bfloat16
    rng = np.random.default_rng(0)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    lengths = [int(x) for x in rng.integers(8 if args.smoke else 16, (24 if args.smoke else 300), size=args.prompts)]
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in lengths]
    decode_prompt = rng.integers(0, vocab, size=16 if args.smoke else 128).tolist()
    new, decode = args.new_tokens, args.decode_tokens
    out = {"prompt_lengths": lengths, "new_tokens": new, "runs": {}}
    for tp in [1] + [t for t in tps if t != 1]:
        t0 = time.perf_counter()
        engine = Engine.from_pretrained(path, device=args.device, dtype=dtype, tensor_parallel_size=tp,
                                        generation=GenerationConfig(max_num_seqs=max(len(prompts), 1), max_model_len=max(lengths) + max(new, decode) + 8))
        try:
            engine.generate([decode_prompt], max_tokens=4, ignore_eos=True)
            startup = time.perf_counter() - t0
            tokens = [r.token_ids for r in engine.generate(prompts, max_tokens=new, ignore_eos=True)]
            again = [r.token_ids for r in engine.generate(prompts, max_tokens=new, ignore_eos=True)]  # graphs captured by now
            gen = lambda n: engine.generate([decode_prompt], max_tokens=n, ignore_eos=True)  # noqa: E731
            for _ in range(2):
                gen(decode + 1)
            times = {}
            for n in (1, decode + 1):
                samples = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    gen(n)
                    samples.append(time.perf_counter() - t)
                times[n] = statistics.median(samples)
            ms_per_token = (times[decode + 1] - times[1]) / decode * 1e3
            batch_t = time.perf_counter()
            engine.generate(prompts, max_tokens=new, ignore_eos=True)
            batch_rate = len(prompts) * new / (time.perf_counter() - batch_t)
        finally:
            engine.close()
        out["runs"][tp] = {"tokens": tokens, "repeat_equal": tokens == again, "startup_s": startup, "decode_ms_per_token": ms_per_token,
                           "batch_tokens_per_s": batch_rate}
        print(f"generate TP {tp}: start-up {startup:.1f} s; batch-1 decode {ms_per_token:.3f} ms/token ({len(decode_prompt)}-token prompt, "
              f"{decode} new); {len(prompts)} prompts x {new} new tokens {batch_rate:.0f} tokens/s; second run identical: {tokens == again}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    reference = out["runs"][1]["tokens"]
    gaps = divergence_gaps(path, prompts, reference, {tp: r["tokens"] for tp, r in out["runs"].items() if tp != 1}, args)
    out["divergences"] = gaps
    for tp in out["runs"]:
        if tp == 1:
            continue
        mine = [g for g in gaps if g["tp"] == tp]
        same = sum(a == b for a, b in zip(reference, out["runs"][tp]["tokens"]))
        print(f"generate TP {tp} against TP 1: {same} of {len(prompts)} sequences identical ({new} tokens each)", flush=True)
        for g in mine:
            print(f"  prompt {g['prompt']} ({g['prompt_len']} tokens) diverges at new token {g['position']}: TP 1 took {g['tp1_token']}, "
                  f"TP {tp} {g['tp_token']}; fp32 logits there: {g['tp1_logit']:.4f} vs {g['tp_logit']:.4f} (gap {g['gap']:.4f}; "
                  f"top-2 gap {g['top2_gap']:.4f}, logits' scale {g['logit_std']:.3f})", flush=True)
    return out


def divergence_gaps(path: Path, prompts, reference, others: dict, args) -> list[dict]:
    """At each first divergence, transformers (fp32) over prompt + the common prefix: how far apart
    the two choices are, against the top-2 gap and the spread of the logits there."""
    todo = [(tp, i) for tp, toks in others.items() for i, (a, b) in enumerate(zip(reference, toks)) if a != b]
    if not todo:
        return []
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(args.device).eval()
    out = []
    with torch.inference_mode():
        for tp, i in todo:
            a, b = reference[i], others[tp][i]
            k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            ids = torch.tensor([prompts[i] + a[:k]], device=args.device)
            logits = model(ids).logits[0, -1].float()
            top2 = logits.topk(2).values
            out.append({"tp": tp, "prompt": i, "prompt_len": len(prompts[i]), "position": k, "tp1_token": a[k], "tp_token": b[k],
                        "tp1_logit": float(logits[a[k]]), "tp_logit": float(logits[b[k]]), "gap": float(logits[a[k]] - logits[b[k]]),
                        "top2_gap": float(top2[0] - top2[1]), "logit_std": float(logits.std())})
    del model
    return out


# -- part 3: replicas -----------------------------------------------------------------------------------
def run_replicas(gpus: int, path: Path, args) -> dict:
    import serve as suite  # bench/serve.py: its server process wrapper, client and measurement

    devices = {1: "cpu" if args.smoke else "cuda:0"}
    if gpus > 1:
        devices[gpus] = ",".join(["cpu"] * gpus) if args.smoke else ",".join(f"cuda:{i}" for i in range(gpus))
    tokens, batch = (32, 10) if args.smoke else (512, 100)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    bodies = [suite.embed_body([rng.integers(1000 % vocab, vocab, size=tokens).tolist() for _ in range(batch)]) for _ in range(4)]
    procs, clients = 4, 2  # 8 concurrent clients
    per_client = max(2, args.replica_requests // (procs * clients))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = {"tokens": tokens, "batch": batch, "clients": procs * clients, "runs": {}}
    first = None
    for replicas, device in devices.items():
        cmd = [sys.executable, "-m", "florist.cli", "serve", "--port", "0", "--model", str(path), "--device", device,
               "--replicas", str(replicas), "--workers", str(args.workers)]
        server = suite.Proc("florist", cmd, env)
        try:
            url = server.wait_url(r" on (http://[\d.]+:\d+)", 1800)
            suite.wait_health(server, 600)
            reply = asyncio.run(_one(url, bodies[0]))
            if first is None:
                first = reply
            else:
                cos = float(((reply * first).sum(1) / (np.linalg.norm(reply, axis=1) * np.linalg.norm(first, axis=1))).min())
                out["min_cosine_vs_one_replica"] = cos
                assert cos >= 0.999, f"{replicas} replicas answer differently from one: min cosine {cos}"
            cell = suite.Cell(3, f"{batch} x {tokens} tokens, {procs * clients} clients", "/v1/embeddings", bodies, items=batch, procs=procs,
                              clients=clients, requests=per_client * procs * clients, warmup=2)
            r = suite.measure(cell, url, args.cell_seconds)
            r["banner"] = server.banner
            out["runs"][replicas] = r
            print(f"replicas {replicas} ({device}): {r['items_per_s']:.1f} emb/s, {r['n']} requests of {batch} x {tokens} tokens, "
                  f"p50 {r['p50']:.1f} ms per request", flush=True)
        finally:
            server.stop()
    if len(out["runs"]) > 1:
        ratio = out["runs"][gpus]["items_per_s"] / out["runs"][1]["items_per_s"]
        out["ratio"] = ratio
        print(f"replicas {gpus} / 1: {ratio:.2f}x (min cosine of their outputs {out['min_cosine_vs_one_replica']:.6f})", flush=True)
    return out


async def _one(url: str, body: bytes) -> np.ndarray:
    import base64

    import aiohttp

    import serve as suite

    async with aiohttp.ClientSession() as session:
        reply = await suite.post(session, url + "/v1/embeddings", body)
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in sorted(reply["data"], key=lambda d: d["index"])])


# -- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="argmax,generate,replicas", help="comma list of parts: argmax, generate, replicas (default: all)")
    p.add_argument("--tp", default=None, help="comma list of tensor-parallel sizes (default: 2 and 4 as far as the GPUs go)")
    p.add_argument("--replays", type=int, default=50, help="graph replays with fresh inputs per argmax check (default 50)")
    p.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph when timing the argmax (default 20)")
    p.add_argument("--prompts", type=int, default=16, help="generation prompts compared between TP sizes (default 16)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per compared prompt (default 64)")
    p.add_argument("--decode-tokens", type=int, default=256, help="new tokens timed at batch 1 (default 256)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--replica-requests", type=int, default=64, help="timed 100-sequence requests per replica count (default 64)")
    p.add_argument("--cell-seconds", type=float, default=60.0, help="stop a replica cell after this long")
    p.add_argument("--workers", type=int, default=4, help="gateway workers of `florist serve` (default 4)")
    p.add_argument("--out", type=Path, default=None, help="directory for multi_gpu.json")
    p.add_argument("--smoke", action="store_true", help="CPU: gloo ranks, tiny models, a few requests (the code path only)")
    args = p.parse_args(argv)
    parts = [s.strip() for s in args.only.split(",") if s.strip()]
    if not set(parts) <= {"argmax", "generate", "replicas"}:
        p.error(f"--only takes argmax, generate, replicas; got {args.only}")
    gpus = torch.cuda.device_count()
    args.device = "cpu" if args.smoke or gpus == 0 else "cuda"
    width = 2 if args.smoke else gpus
    tps = [int(t) for t in args.tp.split(",")] if args.tp else [t for t in (2, 4) if t <= width]
    if args.device == "cuda" and any(t > gpus for t in tps):
        p.error(f"--tp {args.tp} needs more GPUs than the {gpus} visible")
    if not args.smoke and gpus < 2:
        print(f"{gpus} GPU(s) visible: these runs need two or more (use --smoke for the CPU code path)")
        return 2
    if args.smoke:
        args.new_tokens, args.decode_tokens, args.repeats, args.prompts = min(args.new_tokens, 8), min(args.decode_tokens, 8), 2, min(args.prompts, 4)
        args.replica_requests, args.workers = 16, 1
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast, ever
    out = args.out or Path(tempfile.mkdtemp(prefix="florist-bench-multi-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "gpus": gpus, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None, "command": " ".join(sys.argv)}
    print(f"{meta['device']} x {gpus if args.device == 'cuda' else 0}; torch {meta['torch']}; NCCL {meta['nccl']}; tensor-parallel sizes {tps}", flush=True)
    results: dict = {"meta": meta}
    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-multi-gpu-models-"))
    started = time.perf_counter()
    try:
        from geometries import make_model

        dtype = torch.float32 if args.smoke else torch.bfloat16
        geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
        if "argmax" in parts:
            results["argmax"] = run_argmax(tps, args)
        if "generate" in parts:
            results["generate"] = run_generate(tps, make_model(tmp / "lm", geometry, variant="reranker", dtype=dtype), args)
        if "replicas" in parts:
            results["replicas"] = run_replicas(width, make_model(tmp / "embed", geometry, variant="embed", dtype=dtype), args)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        meta["elapsed_s"] = time.perf_counter() - started
        (out / "multi_gpu.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {out / 'multi_gpu.json'} ({meta['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
