"""Attention backends on a model's head geometry: Qwen3-0.6B (16 query / 8 kv heads, head_dim 128,
bf16; the default) or all-MiniLM-L6-v2 (12 heads, head_dim 32, fp16).

Times one layer's attention for the shapes the engine sees, for every backend that applies, so the
"auto" policy in florist/layers/attention.py is chosen from measurements (among them where the
Triton kernel, column "triton", wins: SHORT_SINGLE_MAX_WORK / SHORT_RAGGED_MAX_SEQLEN there).
Each call is timed inside a CUDA graph, as the engine runs it (`--eager` times plain launches,
which for microsecond kernels mostly measures the host's launch cost):

    python bench/attention.py [--geometry minilm-l6] [--eager]

--sweep times the Triton kernel's tiles, warps, stages and head packing instead (what
`short_attention.launch_config` picks, from this sweep), at the short shapes it serves and a few
longer ones with the geometry's masking (Qwen3 causal, MiniLM bidirectional), each configuration
checked against varlen first, cuDNN and varlen timed beside them:

    python bench/attention.py --sweep [--geometry minilm-l6] [--masking bidirectional] [--json FILE] [--shapes "1 x 128,100 x 256"] [--lean both] [--maxnreg 0 128]

(`--lean both` times each configuration with the lean key loop and the plain one.)

--buckets times varlen against the kernel as `launch_config` picks it on batches of several
sequences laid out as the engine's CUDA graphs run them (a bucket's padding in a dummy sequence,
empty sequence slots up to the bucket's count) and on ragged batches of long sequences, with the
backend "auto" takes for each (Qwen3: causal and bidirectional, pplx-embed's masking):

    python bench/attention.py --buckets [--geometry minilm-l6] [--flex]

(`--flex` adds the "flex" backend, FlexAttention under a document mask, compiled: a column of its own.)

q, k and v are strided column slices of one qkv product's output, as the models make them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from florist.engine.batch import HostBatch, pack, to_device  # noqa: E402
from florist.engine.graph_runner import bucket, bucket_views  # noqa: E402
from florist.layers.attention import auto_choice, select_backend  # noqa: E402

# name: (query heads, kv heads, head_dim, dtype)
GEOMETRIES = {"qwen3-0.6b": (16, 8, 128, torch.bfloat16), "minilm-l6": (12, 12, 32, torch.float16)}
BACKENDS = ("varlen", "triton", "flash", "cudnn", "efficient", "flex")
CALLS_PER_GRAPH = 20


def timed(fn, iters=30, graph=True):
    """Median ms per call; with `graph`, CALLS_PER_GRAPH calls captured in one CUDA graph."""
    for _ in range(3):
        fn()  # also compiles Triton kernels before any capture
    torch.cuda.synchronize()
    calls = 1
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        run, calls = g.replay, CALLS_PER_GRAPH
        run()
    else:
        run = fn
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def qkv_views(t: int, hq: int, hkv: int, d: int, dtype, dev):
    """q [t, hq, d], k and v [t, hkv, d] as the models make them: column slices of one qkv
    product's output [t, (hq + 2 hkv) d], so rows are strided, as every backend meets them."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def graph_batch(lens: list[int], dev):
    """The batch of these sequence lengths as a CUDA graph of the engine runs it
    (florist/engine/graph_runner.py): tokens padded to the bucket, the padding in a dummy
    sequence, empty sequence slots up to the bucket's count -> (padded tokens, RaggedBatch)."""
    host = HostBatch.from_sequences([[0] * n for n in lens])
    key = bucket(host)
    packed = torch.from_numpy(pack(host, key[0], key[1], longest=key[2])).to(dev)
    return key[0], bucket_views(packed, key, with_types=False)


def graph_max_tokens(geometry: str) -> int:
    """The engine's CUDA-graph threshold for the geometry (florist/engine/runner.py:
    default_graph_max_tokens): batches up to it run as graph buckets, larger ones eagerly."""
    from florist.config import ModelConfig
    from florist.engine.runner import default_graph_max_tokens

    from geometries import GEOMETRIES as MODELS  # bench/geometries.py

    g = dict(MODELS[geometry])
    g["model_type"] = g.pop("family")
    return default_graph_max_tokens(ModelConfig.from_hf(g))


def sdpa_batched(kind, hq, hkv, d):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]

    def run(q, k, v, lens, causal):
        b, n = len(lens), lens[0]
        qs = q.view(b, n, hq, d).transpose(1, 2)
        ks = k.view(b, n, hkv, d).transpose(1, 2)
        vs = v.view(b, n, hkv, d).transpose(1, 2)
        with sdpa_kernel([backend]):
            try:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=hq != hkv)
            except RuntimeError:
                ks, vs = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-0.6b")
    ap.add_argument("--eager", action="store_true", help="time plain launches instead of CUDA graph replays")
    ap.add_argument("--sweep", action="store_true", help="time the Triton kernel's configurations at its short shapes")
    ap.add_argument("--json", help="with --sweep: write every configuration's time to this file")
    ap.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64, 128], help="with --sweep: query tile rows to try (default 16 32 64 128)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128], help="with --sweep: key tile rows to try (default 32 64 128)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="with --sweep: warps a program to try (default 4 8)")
    ap.add_argument("--lean", choices=sorted(LEAN_CHOICES), default="pick",
                    help="with --sweep: the key loop of each configuration: as launch_config picks it for the shape (default), "
                         "the lean loop (scale in the exponent's FMA, bidirectional masks on partial tiles only), the plain one, or both")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                    help="with --sweep: register caps a thread to try (0: none, the default); fewer registers fit more programs an SM, "
                         "at the price of spills")
    ap.add_argument("--shapes", default="", help="with --sweep: a comma list of the shapes to sweep (default: all), e.g. '1 x 128,100 x 256'")
    ap.add_argument("--masking", choices=("causal", "bidirectional"),
                    help="with --sweep: the masking to sweep (default: the geometry's own, Qwen3 causal, MiniLM bidirectional; "
                         "Qwen3 bidirectional is pplx-embed's)")
    ap.add_argument("--buckets", action="store_true", help="varlen against the kernel as picked, on graph buckets and ragged batches")
    ap.add_argument("--flex", action="store_true", help="with --buckets: time the flex backend (FlexAttention, compiled) too")
    args = ap.parse_args()
    args.shapes = [label.strip() for label in args.shapes.split(",") if label.strip()]
    unknown = sorted(set(args.shapes) - {label for label, _ in SWEEP_SHAPES})
    if unknown:
        ap.error(f"unknown --shapes {unknown}; choose from {', '.join(label for label, _ in SWEEP_SHAPES)}")
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.sweep:
        return sweep(args)
    if args.buckets:
        return buckets(args)
    hq, hkv, d, dtype = GEOMETRIES[args.geometry]
    dev = torch.device("cuda")
    varlen, short, flex = select_backend("varlen", dev), select_backend("triton", dev), select_backend("flex", dev)
    # Short shapes on both sides of the "auto" bounds (256 tokens per sequence, 1024 per batch).
    shapes = [("1 x 64", [64]), ("1 x 128", [128]), ("1 x 256", [256]), ("1 x 512", [512]), ("1 x 4096", [4096]),
              ("8 x 128", [128] * 8), ("16 x 128", [128] * 16), ("ragged 4 <= 200", [200, 37, 101, 9]),
              ("100 x 128", [128] * 100), ("100 x 256", [256] * 100), ("100 x 512", [512] * 100), ("8 x 512", [512] * 8)]
    rows = []
    for causal in (True, False):
        for label, lens in shapes:
            t = sum(lens)
            q, k, v = qkv_views(t, hq, hkv, d, dtype, dev)
            batch = to_device(HostBatch.from_sequences([[0] * n for n in lens]), dev)
            flops = sum(4 * n * n * d * hq for n in lens) / (2 if causal else 1)
            res = {"varlen": timed(lambda: varlen(q, k, v, batch, causal, d**-0.5), graph=not args.eager)}
            ref = varlen(q, k, v, batch, causal, d**-0.5)
            candidates = {"triton": lambda q, k, v, lens, causal: short(q, k, v, batch, causal, d**-0.5),
                          "flex": lambda q, k, v, lens, causal: flex(q, k, v, batch, causal, d**-0.5)}
            candidates.update({kind: sdpa_batched(kind, hq, hkv, d) for kind in ("flash", "cudnn", "efficient")})
            for kind, fn in candidates.items():
                try:
                    out = fn(q, k, v, lens, causal)
                    out = out if kind in ("triton", "flex") else out.transpose(1, 2).reshape(t, hq, d)
                    err = (out.float() - ref.float()).abs().max().item()
                    res[kind] = timed(lambda: fn(q, k, v, lens, causal), graph=not args.eager) if err < 2e-2 else float("nan")
                    if err >= 2e-2:
                        print(f"{kind} {label}: max error {err:.3g} against varlen; not timed")
                except Exception as e:  # noqa: BLE001  (a backend that cannot run this shape: a result)
                    res[kind] = float("nan")
                    print(f"{kind} {label}: {str(e)[:80]}")
            best = min((v_, k_) for k_, v_ in res.items() if v_ == v_)
            rows.append((("causal" if causal else "bidir") + " " + label, res, flops / best[0] / 1e9, best[1]))
    print(f"\n{args.geometry}, {str(dtype).removeprefix('torch.')}, ms per call ({'eager' if args.eager else 'CUDA graph'})")
    print(f"{'shape':22s} " + " ".join(f"{k:>10s}" for k in BACKENDS) + "   best TFLOP/s")
    for label, res, tflops, best in rows:
        print(f"{label:22s} " + " ".join(f"{res.get(k, float('nan')):10.4f}" for k in BACKENDS) + f"   {best} {tflops:.0f}")


SWEEP_SHAPES = [("1 x 64", [64]), ("1 x 128", [128]), ("1 x 256", [256]), ("1 x 512", [512]), ("1 x 1024", [1024]),
                ("ragged 4 <= 200", [200, 37, 101, 9]), ("ragged 8 <= 256", [256, 200, 150, 100, 64, 32, 17, 5]),
                ("100 x 256", [256] * 100), ("8 x 128 bucket", [128] * 8), ("32 x 128 bucket", [128] * 32),
                ("100 x 128 bucket", [128] * 100), ("32 x 256 bucket", [256] * 32), ("100 x 256 bucket", [256] * 100),
                ("8 x 512 bucket", [512] * 8), ("16 x 512 bucket", [512] * 16)]
# The masking the served models use: Qwen3 embedders are causal, BERT encoders bidirectional.
SWEEP_CAUSAL = {"qwen3-0.6b": True, "minilm-l6": False}


LEAN_CHOICES = {"pick": (None,), "on": (True,), "off": (False,), "both": (False, True)}


def sweep_configs(args, hq: int, hkv: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, warps, stages, pack_groups, lean, maxnreg) to time: lean None is the key
    loop `launch_config` picks for the shape (the lean loop for narrow heads' batch tiles); maxnreg
    0 leaves the registers uncapped."""
    import itertools

    packs = (False, True) if hq != hkv else (False,)
    caps = getattr(args, "maxnreg", None) or [0]
    return list(itertools.product(args.block_m, args.block_n, args.warps, (1, 2, 3), packs, LEAN_CHOICES[args.lean], caps))


def sweep(args) -> None:
    """Every (BLOCK_M, BLOCK_N, warps, stages, pack_groups, lean, maxnreg) that fits the shape, with the
    geometry's own masking, each checked against varlen first; per shape the default's time, the
    fastest configuration, and cuDNN's SDPA (one sequence) and varlen beside them. `--json PATH`
    keeps every configuration's time. (~100 configurations compile: a few minutes.)"""
    import json

    from florist.kernels import short_attention as sa

    hq, hkv, d, dtype = GEOMETRIES[args.geometry]
    causal = SWEEP_CAUSAL[args.geometry] if args.masking is None else args.masking == "causal"
    dev = torch.device("cuda")
    varlen = select_backend("varlen", dev)
    cudnn = sdpa_batched("cudnn", hq, hkv, d)
    configs = sweep_configs(args, hq, hkv)
    print(f"{args.geometry}, {str(dtype).removeprefix('torch.')}, {'causal' if causal else 'bidirectional'}, "
          f"us per call ({'eager' if args.eager else 'CUDA graph'})")
    table, lines = {}, []
    for label, lens in SWEEP_SHAPES:
        if args.shapes and label not in args.shapes:
            continue
        if label.endswith("bucket"):  # as a CUDA graph runs it: padding in a dummy sequence, empty slots
            t, batch = graph_batch(lens, dev)
            max_len = batch.max_seqlen
        else:
            t, max_len = sum(lens), max(lens)
            batch = to_device(HostBatch.from_sequences([[0] * n for n in lens]), dev)
        q, k, v = qkv_views(t, hq, hkv, d, dtype, dev)
        ref = varlen(q, k, v, batch, causal, d**-0.5).float()

        def run(cfg=None):
            if cfg is None:
                return sa.short_attention_triton(q, k, v, batch.cu_seqlens, max_len, causal, d**-0.5)
            bm, bn, warps, stages, pack, lean, cap = cfg
            return sa.short_attention_triton(q, k, v, batch.cu_seqlens, max_len, causal, d**-0.5, (bm, bn), warps, stages, pack, lean,
                                             cap)

        default = timed(run, graph=not args.eager) * 1e3
        others = {"varlen": timed(lambda: varlen(q, k, v, batch, causal, d**-0.5), graph=not args.eager) * 1e3}
        if len(set(lens)) == 1 and not label.endswith("bucket"):  # equal lengths: one dense call
            others["cudnn"] = timed(lambda: cudnn(q, k, v, lens, causal), graph=not args.eager) * 1e3
        times = {}
        for cfg in configs:
            if cfg[0] > max(16, triton_pow2(max_len)):
                continue
            try:
                err = (run(cfg).float() - ref).abs().max().item()
                if err >= 2e-2:
                    print(f"  {label} {cfg}: max error {err:.3g} against varlen; skipped")
                    continue
                times[cfg] = timed(lambda: run(cfg), iters=10, graph=not args.eager) * 1e3
            except Exception as e:  # out of resources and the like: not a candidate
                print(f"  {label} {cfg}: {type(e).__name__}")
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        table[label] = {"default": default, **others, "configs": {" ".join(map(str, c)): us for c, us in ranked}}
        top = ", ".join(f"{c} {us:.2f}" for c, us in ranked[:3])
        lines.append(f"{label:18s} {default:9.2f} {others.get('cudnn', float('nan')):9.2f} {others['varlen']:9.2f}   {top}")
        print(lines[-1], flush=True)
    print(f"\n{'shape':18s} {'default':>9s} {'cudnn':>9s} {'varlen':>9s}   fastest (BLOCK_M, BLOCK_N, warps, stages, pack_groups, lean, maxnreg) us")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"geometry": args.geometry, "causal": causal, "shapes": table}, indent=1))


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _uniform(rng, count: int, low: int, high: int) -> list[int]:
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def buckets(args) -> None:
    """varlen against the kernel as `launch_config` picks it, us per call in a CUDA graph, on
    batches of several sequences: graph buckets as the engine captures them (tokens padded to the
    bucket, the padding in a dummy sequence, empty slots up to the bucket's sequence count) and
    ragged batches of long sequences; "auto" is the backend florist/layers/attention.py takes."""
    import numpy as np

    from florist.kernels import short_attention as sa

    hq, hkv, d, dtype = GEOMETRIES[args.geometry]
    dev = torch.device("cuda")
    varlen = select_backend("varlen", dev)
    rng = np.random.default_rng(1)
    lens_list = [("8 x 128", [128] * 8), ("32 x 128", [128] * 32), ("100 x 128", [128] * 100), ("100 x U(16..128)", _uniform(rng, 100, 16, 128)),
                 ("8 x 256", [256] * 8), ("32 x 256", [256] * 32), ("100 x 256", [256] * 100), ("8 x 512", [512] * 8),
                 ("16 x 512", [512] * 16), ("100 x 512", [512] * 100), ("16 x U(32..512)", _uniform(rng, 16, 32, 512)),
                 ("100 x U(32..512)", _uniform(rng, 100, 32, 512))]
    if args.geometry == "qwen3-0.6b":  # positions past MiniLM's 512
        lens_list += [("4 x 1024", [1024] * 4), ("8 x 1024", [1024] * 8), ("4 x 2048", [2048] * 4), ("2 x 4096", [4096] * 2),
                      ("4 x U(512..4096)", _uniform(rng, 4, 512, 4096)), ("16 x U(32..2048)", _uniform(rng, 16, 32, 2048))]
    maskings = (True, False) if args.geometry == "qwen3-0.6b" else (False,)
    graph_max = graph_max_tokens(args.geometry)
    print(f"{args.geometry}, {str(dtype).removeprefix('torch.')}, us per call (CUDA graph); graph buckets up to {graph_max:,} tokens "
          "(the engine's graph threshold for this model), the batch as it is above")
    flex = select_backend("flex", dev) if args.flex else None
    print(f"{'masking':13s} {'shape':18s} {'tokens':>7s} {'seqs':>5s} {'longest':>7s} {'varlen':>8s} {'kernel':>8s} {'varlen/kernel':>13s}  auto    tiles"
          + ("            flex" if args.flex else ""))
    for causal in maskings:
        for label, lens in lens_list:
            if sum(lens) <= graph_max:
                t, batch = graph_batch(lens, dev)
            else:  # a batch the engine runs eagerly: exactly its tokens
                t, batch = sum(lens), to_device(HostBatch.from_sequences([[0] * n for n in lens]), dev)
            q, k, v = qkv_views(t, hq, hkv, d, dtype, dev)
            ref = varlen(q, k, v, batch, causal, d**-0.5).float()
            run = lambda: sa.short_attention_triton(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, d**-0.5)  # noqa: E731
            err = (run().float() - ref).abs().max().item()
            if err >= 2e-2:
                print(f"{label}: the kernel's max error against varlen is {err:.3g}; not timed")
                continue
            tv, tk = timed(lambda: varlen(q, k, v, batch, causal, d**-0.5)) * 1e3, timed(run) * 1e3
            tf = timed_flex(flex, q, k, v, batch, causal, d**-0.5, ref, label) if args.flex else float("nan")
            seqs = batch.cu_seqlens.shape[0] - 1
            cfg = sa.launch_config(batch.max_seqlen, d, hq // hkv, t, seqs)
            tiles = f"{cfg['blocks'][0]} x {cfg['blocks'][1]}{', packed' if cfg['pack_groups'] else ''}{', lean' if cfg.get('lean') else ''}"
            choice = auto_choice(batch, t, causal, True, hq * d, d)
            print(f"{'causal' if causal else 'bidirectional':13s} {label:18s} {t:7d} {seqs:5d} {batch.max_seqlen:7d} {tv:8.2f} {tk:8.2f} "
                  f"{tv / tk:12.2f}x  {choice:7s} {tiles}" + (f"  {tf:8.2f}" if args.flex else ""), flush=True)


def timed_flex(flex, q, k, v, batch, causal, scale, ref, label) -> float:
    """us per call of the flex backend in a CUDA graph, or nan (said why) where it fails or is wrong."""
    try:
        err = (flex(q, k, v, batch, causal, scale).float() - ref).abs().max().item()
        if err >= 2e-2:
            print(f"{label}: flex's max error against varlen is {err:.3g}; not timed")
            return float("nan")
        return timed(lambda: flex(q, k, v, batch, causal, scale)) * 1e3
    except Exception as e:  # noqa: BLE001  (a compile failure is a result here)
        print(f"{label}: flex failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


if __name__ == "__main__":
    sys.exit(main())
