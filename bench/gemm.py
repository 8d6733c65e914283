"""Skinny matrix products: the Triton kernel (florist/kernels/skinny_gemm.py) against cuBLAS.

For each served weight shape (Qwen3-0.6B, all-MiniLM-L6-v2, the Qwen3 LM head) and row count M,
times y = x @ w.T three ways, all inside CUDA graphs:

    cublas   F.linear (+ the SwiGLU kernel for gate/up, + F.gelu for "+gelu": the unfused path)
    picked   skinny_gemm with the configuration `pick_config` chooses (what the model runs)
    best     the fastest configuration of a sweep (what `pick_config` could choose)
o and down are picked and swept with the split-K reduction deferred to the norm after them, as
the model runs them (a split-K time there excludes the reduce launch).

NOTE: one replay calls the product on `copies` distinct weights (> 200 MB in all), as 28 layers
do, so weights come from HBM and not from the 50 MB L2. Time per call = replay time / copies.
The floor is the weight bytes / 4.2 TB/s.

    python bench/gemm.py [--m 1 16 64 128 256 512] [--sweep] [--json OUT]

--wide times the many-row products instead (florist/kernels/wide_gemm.py, 512-16,384 rows: an
embedding batch's prefill): cuBLAS (+ the SwiGLU kernel, + the GELU pass) against the persistent
TMA kernel, on Qwen3-0.6B's products (bf16; SwiGLU fused for gate/up, plain for the others) and
all-MiniLM-L6-v2's (fp16, with bias; bias + GELU fused for the up projection); "picked" is
`wide_gemm.pick`'s choice where it makes one; with --sweep, the best of a list of configurations
(MiniLM's: also fewer stages and two or three programs an SM), each checked first.

    python bench/gemm.py --wide [--wide-m 512 1024 4096 16384] [--shapes minilm] [--sweep]

--tma times the Hopper form of the skinny product (operands by TMA, `skinny_gemm.tma_gemm`) on
Qwen3-0.6B's products at the row counts of the graph buckets up to 512: cuBLAS (+ the SwiGLU
kernel), what ran before it (`pick_config` without it: the pointer kernel or cuBLAS), what
`pick_config(..., tma=True)` picks now, and with --sweep the best of its configurations (what
`pick_tma`'s table was read from). o and down are timed split-K with the reduction deferred.

    python bench/gemm.py --tma [--tma-m 64 128 192 256 384 512] [--sweep]

--qkv-rope times Qwen3-0.6B's qkv product with QK-norm + rotary: the two launches the model ran
(`skinny_gemm`'s choice, then `rotary.qk_norm_rope`) against one (florist/kernels/qkv_rope.py),
its picked configuration and with --sweep the best of its configurations, at the --tma-m rows.

    python bench/gemm.py --qkv-rope [--tma-m 64 128 256 512] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from florist.kernels import activation, skinny_gemm, wide_gemm  # noqa: E402
from florist.kernels.skinny_gemm import GemmConfig  # noqa: E402
from fused_kernels import time_in_graph  # noqa: E402

PEAK_BYTES_PER_S = 4.2e12
# name, N (weight rows), K, SwiGLU fused; "+gelu" shapes fuse exact GELU
SHAPES = [
    ("qwen3 qkv", 4096, 1024, False),
    ("qwen3 o", 1024, 2048, False),
    ("qwen3 gate_up+silu", 6144, 1024, True),
    ("qwen3 down", 1024, 3072, False),
    ("qwen3 lm_head", 151936, 1024, False),
    ("minilm qkv", 1152, 384, False),
    ("minilm o", 384, 384, False),
    ("minilm up", 1536, 384, False),
    ("minilm up+gelu", 1536, 384, False),
    ("minilm down", 384, 1536, False),
]


def time_graph(fn, copies: int, replays: int = 20) -> float:
    """Median us per call of fn(i) over i = 0 .. copies-1 (one distinct weight each), captured
    in one CUDA graph (bench/fused_kernels.py's timing)."""
    index = itertools.count()
    return time_in_graph(lambda: fn(next(index) % copies), copies, replays)


def hbm_weights(n: int, k: int, max_copies: int = 16) -> list[torch.Tensor]:
    """Distinct copies of an [n, k] bf16 weight, > 200 MB in all (up to max_copies), so that a
    replay calling the product on each in turn reads its weights from HBM, not from L2."""
    copies = max(2, min(max_copies, -(-256 * 2**20 // (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]


def unfused(x: torch.Tensor, weights: list[torch.Tensor], silu: bool = False, gelu: bool = False):
    """fn(i): cuBLAS on weights[i], then the SwiGLU kernel (silu) or F.gelu (gelu): the path
    without florist's products."""
    def run(i):
        y = F.linear(x, weights[i])
        return activation.silu_and_mul(y) if silu else F.gelu(y) if gelu else y
    return run


def check_close(got, ref: torch.Tensor, what: str) -> None:
    """A product's output (split-K partials reduced) within 2 % of the fp32 reference's largest value."""
    got = (got.reduce() if hasattr(got, "reduce") else got).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"{what}: relative error {err}"


def fmt_us(v: float | None, width: int = 8, digits: int = 2) -> str:
    """A time (or any figure) right-aligned in `width`, "-" where there is none."""
    return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}s}"


def config_label(c: GemmConfig | None) -> str:
    """A product configuration in a table row: tiles, split, warps, stages ("-" for none)."""
    return "-" if c is None else f"{'tma ' if c.tma else ''}m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def sweep_best(configs, product, copies: int):
    """(us, config) of the fastest of `configs`, product(cfg) giving fn(i); (None, None) for
    none. A configuration that fails (out of shared memory and the like) is skipped."""
    best, best_cfg = None, None
    for cfg in configs:
        try:
            t = time_graph(product(cfg), copies, replays=8)
        except Exception as exc:  # not a candidate
            print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        if best is None or t < best:
            best, best_cfg = t, cfg
    return best, best_cfg


def sweep_configs(m: int, silu_mul: bool) -> list[GemmConfig]:
    out = []
    if m > 64:  # tensor-core tiles over M too: 64 or 128 rows a program, 4 or 8 warps
        for block_m, block_n, block_k, split_k, warps in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4), (4, 8)):
            if silu_mul and split_k > 1:
                continue
            out.append(GemmConfig(block_m, block_n, block_k, split_k, warps, 4 if block_k == 64 else 3))
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    stage_options = (3, 5) if block_m <= 32 else (4,)
    k_options = (64, 128, 256) if block_m <= 16 else (64, 128)
    for block_n, block_k, split_k, stages in itertools.product((16, 32, 64, 128), k_options, (1, 2, 4, 8), stage_options):
        if silu_mul and split_k > 1:
            continue
        if block_m * block_k * 2 * stages + block_n * block_k * 2 * stages * (2 if silu_mul else 1) > 200_000:
            continue  # over the SM's shared memory
        out.append(GemmConfig(block_m, block_n, block_k, split_k, 4, stages))
    return out


# name, N (weight rows), K, epilogue: Qwen3-0.6B's products (bf16, no bias) and all-MiniLM-L6-v2's
# (fp16, with bias; the up projection with the exact GELU)
WIDE_SHAPES = [("qwen3 qkv", 4096, 1024, wide_gemm.NONE), ("qwen3 o", 1024, 2048, wide_gemm.NONE),
               ("qwen3 gate_up+silu", 6144, 1024, wide_gemm.SWIGLU), ("qwen3 down", 1024, 3072, wide_gemm.NONE),
               ("minilm qkv", 1152, 384, wide_gemm.NONE), ("minilm o", 384, 384, wide_gemm.NONE),
               ("minilm up+gelu", 1536, 384, wide_gemm.GELU), ("minilm down", 384, 1536, wide_gemm.NONE)]


def wide_sweep(silu: bool, short_k: bool = False) -> list[wide_gemm.WideConfig]:
    """(BM, BN, BK, warps, stages) that fit the SM's shared memory; for SwiGLU BN is per half.
    With short_k (MiniLM's K of 384-1,536: a tile's product is a few K blocks long) also fewer
    stages and two or three programs an SM, whose epilogues then overlap the others' products."""
    w = wide_gemm.WideConfig
    if short_k:
        out = []
        for bm, bn, warps, stages, per_sm, split in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4), (1, 2, 3), (1, 2)):
            smem = stages * (bm + bn) * 64 * 2 + bm * bn * 2 // split  # operand stages + the output tile TMA stores from
            if smem * per_sm > 224 * 1024 or (bm * bn >= 128 * 256 and warps == 4) or (bm == 64 and bn == 64 and warps == 8):
                continue
            out.append(w(bm, bn, 64, warps, stages, 8, per_sm, split))
        return out
    # Two programs an SM (the short-K finding) where two fit the shared memory: SwiGLU's operand
    # tile is [BM + 2 BN, BK], its output tile [BM, BN].
    if silu:
        return [w(128, 128, 64, 8, 3), w(128, 128, 64, 8, 4), w(128, 64, 64, 4, 4), w(128, 64, 64, 8, 4), w(64, 128, 64, 4, 4),
                w(128, 64, 64, 4, 2, per_sm=2), w(128, 64, 64, 8, 2, per_sm=2), w(64, 128, 64, 4, 2, per_sm=2)]
    return [w(128, 256, 64, 8, 3), w(128, 128, 64, 8, 4), w(128, 128, 64, 4, 4), w(256, 128, 64, 8, 3), w(128, 128, 128, 8, 3),
            w(128, 128, 64, 8, 2, per_sm=2), w(128, 128, 64, 4, 2, per_sm=2), w(128, 64, 64, 4, 3, per_sm=2)]


def tma_sweep(m: int, n: int, k: int, silu: bool) -> list[GemmConfig]:
    """TMA configurations that fit the SM's shared memory and give 32-1,024 programs."""
    out = []
    for bm, bn, bk, split_k, warps, stages in itertools.product((64, 128) if m > 64 else (64,), (16, 32, 64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 5)):
        if (silu and split_k > 1) or (warps == 8 and bm * bn < 128 * 64) or k % (split_k * bk) or k // split_k < 2 * bk:
            continue
        if stages * (bm * bk + (2 if silu else 1) * bn * bk) * 2 > 200_000:
            continue
        programs = ((n // 2 if silu else n) // bn) * split_k * -(-m // bm)
        if 32 <= programs <= 1024:
            out.append(GemmConfig(bm, bn, bk, split_k, warps, stages, tma=True))
    return out


def tma_main(args) -> int:
    dtype, dev = torch.bfloat16, "cuda"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'shape':20s} {'M':>4s} {'floor':>6s} {'cublas':>7s} {'before':>7s} {'picked':>7s} {'best':>7s}  picked / best config (us per call)", flush=True)
    rows = []
    for name, n, k, silu in WIDE_SHAPES:
        weights = hbm_weights(n, k)
        copies = len(weights)
        defer = name in ("qwen3 o", "qwen3 down")
        for m in args.tma_m:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = skinny_gemm.skinny_gemm_ref(x.float(), weights[0].float(), None, silu)
            cublas = unfused(x, weights, silu)

            def run(cfg):
                if cfg is None:
                    return cublas
                if cfg.tma:
                    return lambda i: skinny_gemm.tma_gemm(x, weights[i], silu, cfg, defer)
                return lambda i: skinny_gemm.skinny_gemm_triton(x, weights[i], None, silu, cfg, False, defer)

            def checked(cfg):
                check_close(run(cfg)(0), ref, f"{name} M={m} {cfg}")
                return time_graph(run(cfg), copies)

            before = skinny_gemm.pick_config(m, n, k, silu, deferred=defer)
            picked = skinny_gemm.pick_config(m, n, k, silu, deferred=defer, tma=True)
            t_cublas = time_graph(cublas, copies)
            t_before = checked(before) if before is not None else t_cublas
            t_picked = checked(picked) if picked is not None else t_cublas
            best, best_cfg = sweep_best(tma_sweep(m, n, k, silu), run, copies) if args.sweep else (None, None)
            floor = n * k * 2 / PEAK_BYTES_PER_S * 1e6
            rows.append({"shape": name, "m": m, "n": n, "k": k, "floor_us": floor, "cublas_us": t_cublas, "before_us": t_before,
                         "picked_us": t_picked, "picked": picked.__dict__ if picked else None, "best_us": best,
                         "best": best_cfg.__dict__ if best_cfg else None})
            times = " ".join(fmt_us(v, 7) for v in (t_cublas, t_before, t_picked, best))
            print(f"{name:20s} {m:4d} {floor:6.2f} {times}  {config_label(picked)} / {config_label(best_cfg)}", flush=True)
        del weights
        torch.cuda.empty_cache()
    print("\nQwen3-0.6B layer (qkv + o + gate_up+silu + down), us: before / picked")
    for m in args.tma_m:
        sel = [r for r in rows if r["m"] == m]
        print(f"  M={m:4d}: {sum(r['before_us'] for r in sel):7.2f} / {sum(r['picked_us'] for r in sel):7.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def qkv_rope_sweep(m: int) -> list[GemmConfig]:
    """The fused qkv + QK-norm + rotary's configurations that fit the SM's shared memory (a tile
    is one head of 128 columns)."""
    out = []
    for bm, bk, warps, stages in itertools.product((64, 128) if m > 64 else (64,), (64, 128), (4, 8), (2, 3, 4, 5)):
        if stages * (bm + 128) * bk * 2 <= 200_000:
            out.append(GemmConfig(bm, 128, bk, 1, warps, stages, tma=True))
    return out


def qkv_rope_main(args) -> int:
    """Qwen3-0.6B's qkv product + QK-norm + rotary: as the model ran them (`skinny_gemm`'s pick, then
    the rotary kernel) against one launch (`qkv_rope`)."""
    from florist.kernels import qkv_rope, rotary
    from florist.layers.rotary import RotaryEmbedding

    dtype, dev = torch.bfloat16, "cuda"
    hq, hk, d, k = 16, 8, 128, 1024
    cache = RotaryEmbedding(d, 40960, 1e6).cos_sin_cache.to(dev)
    q_w, k_w = (torch.rand(d, device=dev, dtype=dtype) + 0.5 for _ in range(2))
    weights = hbm_weights((hq + 2 * hk) * d, k)
    copies = len(weights)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'M':>4s} {'two launches':>13s} {'picked':>8s} {'best':>8s}  picked / best config (us per call)", flush=True)
    rows = []
    for m in args.tma_m:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        pos = torch.arange(m, dtype=torch.int32, device=dev)

        def two(i):
            q, kk, v = skinny_gemm.skinny_gemm(x, weights[i]).split([hq * d, hk * d, hk * d], dim=-1)
            q, kk = rotary.qk_norm_rope(q.view(m, hq, d), kk.view(m, hk, d), q_w, k_w, 1e-6, pos, cache)
            return q, kk, v

        def run(cfg):
            return lambda i: qkv_rope.qkv_norm_rope_triton(x, weights[i], q_w, k_w, 1e-6, pos, cache, hq, hk, cfg)

        picked = qkv_rope.pick(m, d)
        want = two(0)
        if picked is not None:
            for got, ref in zip(run(picked)(0), want):
                check_close(got.reshape(m, -1), ref.reshape(m, -1).float(), f"qkv+rope M={m} {picked}")
        t_two = time_graph(two, copies)
        t_picked = time_graph(run(picked), copies) if picked is not None else None
        best, best_cfg = sweep_best(qkv_rope_sweep(m), run, copies) if args.sweep else (None, None)
        rows.append({"m": m, "two_launches_us": t_two, "picked_us": t_picked, "picked": picked.__dict__ if picked else None,
                     "best_us": best, "best": best_cfg.__dict__ if best_cfg else None})
        print(f"{m:4d} {t_two:13.2f} {fmt_us(t_picked)} {fmt_us(best)}  {config_label(picked)} / {config_label(best_cfg)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def wide_main(args) -> int:
    dtype, dev = torch.bfloat16, "cuda"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'shape':20s} {'M':>6s} {'cublas':>8s} {'picked':>8s} {'best':>8s}  TFLOP/s cublas / picked / best; best config (us per call)", flush=True)
    rows = []
    prefixes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name, n, k, epilogue in WIDE_SHAPES:
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        silu, minilm = epilogue == wide_gemm.SWIGLU, name.startswith("minilm")
        dtype = torch.float16 if minilm else torch.bfloat16
        weights = [w.to(dtype) for w in hbm_weights(n, k)]
        bias = torch.randn(n, device=dev, dtype=dtype) * 0.1 if minilm else None
        copies = len(weights)
        for m in args.wide_m:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            flops = 2 * m * n * k

            def cublas(i):  # what the model runs without the kernel: cuBLAS, then the activation's own pass
                y = F.linear(x, weights[i], bias)
                return activation.silu_and_mul(y) if silu else activation.gelu(y) if epilogue == wide_gemm.GELU else y

            def run(cfg):
                return lambda i: wide_gemm.wide_gemm(x, weights[i], cfg, epilogue, bias)

            t_cublas = time_graph(cublas, copies)
            picked = wide_gemm.pick(m, epilogue, n, k)
            t_picked = None
            if picked is not None:
                check_close(run(picked)(0), cublas(0).float(), f"{name} M={m} {picked}")
                t_picked = time_graph(run(picked), copies)
            configs = wide_sweep(silu, short_k=minilm)
            if args.sweep:
                for cfg in configs:  # every candidate checked before any is timed
                    try:
                        got = run(cfg)(0)
                    except Exception as exc:  # out of shared memory and the like: sweep_best skips it too
                        print(f"  {cfg} does not launch: {type(exc).__name__}", file=sys.stderr)
                        continue
                    check_close(got, cublas(0).float(), f"{name} M={m} {cfg}")
            best, best_cfg = sweep_best(configs, run, copies) if args.sweep else (None, None)
            rows.append({"shape": name, "m": m, "n": n, "k": k, "cublas_us": t_cublas, "picked_us": t_picked,
                         "picked": picked.__dict__ if picked else None, "best_us": best, "best": best_cfg.__dict__ if best_cfg else None})
            tf = lambda v: f"{flops / v / 1e6:4.0f}" if v else "   -"  # noqa: E731
            cfg_s = "-" if best_cfg is None else (f"m{best_cfg.block_m} n{best_cfg.block_n} k{best_cfg.block_k} w{best_cfg.num_warps} "
                                                  f"st{best_cfg.num_stages} x{best_cfg.per_sm} split{best_cfg.epilogue_split}")
            print(f"{name:20s} {m:6d} {fmt_us(t_cublas, 8, 1)} {fmt_us(t_picked, 8, 1)} {fmt_us(best, 8, 1)}  {tf(t_cublas)} / {tf(t_picked)} / {tf(best)}; {cfg_s}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64, 128, 192, 256, 512])
    ap.add_argument("--sweep", action="store_true", help="also time a sweep of configurations (slow: compiles many kernels)")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=[1, 16, 64, 128, 256], help="row counts the sweep covers")
    ap.add_argument("--shapes", default="", help="comma list of shape-name prefixes (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--wide", action="store_true", help="time the many-row products (wide_gemm) instead")
    ap.add_argument("--wide-m", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384], help="row counts for --wide")
    ap.add_argument("--tma", action="store_true", help="time the Hopper form of the skinny product (operands by TMA) instead")
    ap.add_argument("--tma-m", type=int, nargs="+", default=[64, 128, 192, 256, 384, 512], help="row counts for --tma")
    ap.add_argument("--qkv-rope", action="store_true", help="time qkv + QK-norm + rotary, two launches against one (qkv_rope), at --tma-m rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gemm.py needs CUDA: it times GPU kernels in CUDA graphs")
        return 1
    if args.qkv_rope:
        return qkv_rope_main(args)
    if args.wide:
        return wide_main(args)
    if args.tma:
        return tma_main(args)
    dtype, dev = torch.bfloat16, "cuda"
    prefixes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    rows = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    header = f"{'shape':20s} {'M':>4s} {'floor':>7s} {'cublas':>8s} {'picked':>8s} {'best':>8s}  best config / picked config (us per call)"
    print(header, flush=True)
    for name, n, k, silu in SHAPES:
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        weight_bytes = n * k * 2
        weights = hbm_weights(n, k, max_copies=64)
        copies = len(weights)
        gelu = name.endswith("+gelu")
        # o_proj and down_proj run split-K with the reduction left to the norm after them
        # (RowParallelLinear.forward_deferred): picked and swept that way.
        defer = name in ("qwen3 o", "qwen3 down")
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = skinny_gemm.skinny_gemm_ref(x.float(), weights[0].float(), None, silu, gelu)
            cublas = unfused(x, weights, silu, gelu)

            def run(cfg):
                return lambda i: skinny_gemm.skinny_gemm_triton(x, weights[i], None, silu, cfg, gelu, defer)

            t_cublas = time_graph(cublas, copies)
            picked = skinny_gemm.pick_config(m, n, k, silu, gelu, defer)
            t_picked = None
            if picked is not None:
                check_close(run(picked)(0), ref, f"{name} M={m} {picked}")
                t_picked = time_graph(run(picked), copies)
            sweep = args.sweep and m in args.sweep_m and "lm_head" not in name
            best, best_cfg = sweep_best(sweep_configs(m, silu or gelu), run, copies) if sweep else (None, None)
            floor = weight_bytes / PEAK_BYTES_PER_S * 1e6
            rows.append({"shape": name, "m": m, "n": n, "k": k, "floor_us": floor, "cublas_us": t_cublas, "picked_us": t_picked,
                         "picked": picked.__dict__ if picked else None, "best_us": best, "best": best_cfg.__dict__ if best_cfg else None})
            times = " ".join(fmt_us(v) for v in (t_cublas, t_picked, best))
            print(f"{name:20s} {m:4d} {floor:7.2f} {times}  {config_label(best_cfg)} / {config_label(picked)}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    # Whole-layer sums for Qwen3 (qkv + o + gate_up+silu + down), the number that moves latency.
    print("\nQwen3-0.6B layer (qkv + o + gate_up+silu + down), us:")
    for m in args.m:
        sel = [r for r in rows if r["m"] == m and r["shape"].startswith("qwen3") and "lm_head" not in r["shape"]]
        if len(sel) == 4:
            c = sum(r["cublas_us"] for r in sel)
            p = sum(r["picked_us"] if r["picked_us"] is not None else r["cublas_us"] for r in sel)
            b = sum(min(x for x in (r["best_us"], r["picked_us"], r["cublas_us"]) if x is not None) for r in sel)
            print(f"  M={m:4d}: cublas {c:7.2f}  picked {p:7.2f}  best {b:7.2f}  (x28 layers: {28 * c / 1e3:.3f} / {28 * p / 1e3:.3f} / {28 * b / 1e3:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
