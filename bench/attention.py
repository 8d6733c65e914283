"""Attention backends on a model's head geometry: Qwen3-0.6B (16 query / 8 kv heads, head_dim 128,
bf16; the default) or all-MiniLM-L6-v2 (12 heads, head_dim 32, fp16).

Times one layer's attention for the shapes the engine sees, for every backend that applies, so the
"auto" policy in florist/layers/attention.py is chosen from measurements (among them where the
Triton short-sequence kernel, column "triton", wins: SHORT_MAX_SEQLEN / SHORT_MAX_TOKENS there).
Each call is timed inside a CUDA graph, as the engine runs it (`--eager` times plain launches,
which for microsecond kernels mostly measures the host's launch cost):

    python bench/attention.py [--geometry minilm-l6] [--eager]

--sweep times the Triton kernel's tiles, warps, stages and head packing instead (what
`short_attention.launch_config` picks, from this sweep), at the short shapes it serves and a few
longer ones with the geometry's masking (Qwen3 causal, MiniLM bidirectional), each configuration
checked against varlen first, cuDNN and varlen timed beside them:

    python bench/attention.py --sweep [--geometry minilm-l6] [--json FILE] [--shapes "1 x 128,100 x 256"]

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
from florist.engine.batch import HostBatch, to_device  # noqa: E402
from florist.layers.attention import select_backend  # noqa: E402

# name: (query heads, kv heads, head_dim, dtype)
GEOMETRIES = {"qwen3-0.6b": (16, 8, 128, torch.bfloat16), "minilm-l6": (12, 12, 32, torch.float16)}
BACKENDS = ("varlen", "triton", "flash", "cudnn", "efficient")
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
    ap.add_argument("--shapes", default="", help="with --sweep: a comma list of the shapes to sweep (default: all), e.g. '1 x 128,100 x 256'")
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
    hq, hkv, d, dtype = GEOMETRIES[args.geometry]
    dev = torch.device("cuda")
    varlen, short = select_backend("varlen", dev), select_backend("triton", dev)
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
            candidates = {"triton": lambda q, k, v, lens, causal: short(q, k, v, batch, causal, d**-0.5)}
            candidates.update({kind: sdpa_batched(kind, hq, hkv, d) for kind in ("flash", "cudnn", "efficient")})
            for kind, fn in candidates.items():
                try:
                    out = fn(q, k, v, lens, causal)
                    out = out if kind == "triton" else out.transpose(1, 2).reshape(t, hq, d)
                    err = (out.float() - ref.float()).abs().max().item()
                    res[kind] = timed(lambda: fn(q, k, v, lens, causal), graph=not args.eager) if err < 2e-2 else float("nan")
                    if err >= 2e-2:
                        print(f"{kind} {label}: max error {err:.3g} against varlen; not timed")
                except RuntimeError as e:
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
                ("100 x 256", [256] * 100)]
# The masking the served models use: Qwen3 embedders are causal, BERT encoders bidirectional.
SWEEP_CAUSAL = {"qwen3-0.6b": True, "minilm-l6": False}


def sweep(args) -> None:
    """Every (BLOCK_M, BLOCK_N, warps, stages, pack_groups) that fits the shape, with the
    geometry's own masking, each checked against varlen first; per shape the default's time, the
    fastest configuration, and cuDNN's SDPA (one sequence) and varlen beside them. `--json PATH`
    keeps every configuration's time. (~100 configurations compile: a few minutes.)"""
    import itertools
    import json

    from florist.kernels import short_attention as sa

    hq, hkv, d, dtype = GEOMETRIES[args.geometry]
    causal = SWEEP_CAUSAL[args.geometry]
    dev = torch.device("cuda")
    varlen = select_backend("varlen", dev)
    cudnn = sdpa_batched("cudnn", hq, hkv, d)
    packs = (False, True) if hq != hkv else (False,)
    configs = list(itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3), packs))
    print(f"{args.geometry}, {str(dtype).removeprefix('torch.')}, {'causal' if causal else 'bidirectional'}, "
          f"us per call ({'eager' if args.eager else 'CUDA graph'})")
    table, lines = {}, []
    for label, lens in SWEEP_SHAPES:
        if args.shapes and label not in args.shapes:
            continue
        t, max_len = sum(lens), max(lens)
        q, k, v = qkv_views(t, hq, hkv, d, dtype, dev)
        batch = to_device(HostBatch.from_sequences([[0] * n for n in lens]), dev)
        ref = varlen(q, k, v, batch, causal, d**-0.5).float()

        def run(cfg=None):
            if cfg is None:
                return sa.short_attention_triton(q, k, v, batch.cu_seqlens, max_len, causal, d**-0.5)
            bm, bn, warps, stages, pack = cfg
            return sa.short_attention_triton(q, k, v, batch.cu_seqlens, max_len, causal, d**-0.5, (bm, bn), warps, stages, pack)

        default = timed(run, graph=not args.eager) * 1e3
        others = {"varlen": timed(lambda: varlen(q, k, v, batch, causal, d**-0.5), graph=not args.eager) * 1e3}
        if len(set(lens)) == 1:  # equal lengths: one dense call
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
    print(f"\n{'shape':18s} {'default':>9s} {'cudnn':>9s} {'varlen':>9s}   fastest (BLOCK_M, BLOCK_N, warps, stages, pack_groups) us")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"geometry": args.geometry, "causal": causal, "shapes": table}, indent=1))


def triton_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if __name__ == "__main__":
    sys.exit(main())
