"""Does pulling the next weight into L2 speed up few-row matrix products? (florist/kernels/prefetch.py)

All times inside CUDA graphs, us per product, bf16, the product florist runs
(`skinny_gemm.skinny_gemm`: the Triton kernel where `pick_config` picks it, else cuBLAS):

    products  each Qwen3-0.6B product shape on `copies` distinct weights (> 200 MB, so from HBM):
                cold       product i reads weight i (what 28 layers do today)
                hot        product i reads weight 0 every time (held in L2: the best a
                           prefetch could give)
                prefetched product i reads weight i while a side stream prefetches weight i+1
                           (joined before product i+1)
                prefetch   the prefetch alone (weight i, one after another)
    layers    28 layers of qkv -> o -> gate/up + SwiGLU -> down on distinct weights, chained (each
              product's input is the previous output), with and without a side stream that
              prefetches product j+1's weight when product j starts (gated by an event, one join
              at the end): the schedule a model would use. us per layer.

    python bench/prefetch.py [--m 1 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from florist.kernels import prefetch, skinny_gemm  # noqa: E402
from kernels import time_in_graph  # noqa: E402  (bench/kernels.py)

PEAK_BYTES_PER_S = 4.2e12
SHAPES = [("qkv", 4096, 1024, False), ("o", 1024, 2048, False), ("gate_up+silu", 6144, 1024, True), ("down", 1024, 3072, False)]
HIDDEN, LAYERS = 1024, 28


def product(x, w, silu):
    return skinny_gemm.skinny_gemm(x, w, None, silu_mul=silu)


def per_product(m: int, dev: str, dtype) -> list[dict]:
    rows = []
    side = torch.cuda.Stream()
    for name, n, k, silu in SHAPES:
        copies = max(2, min(64, -(-256 * 2**20 // (n * k * 2))))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.05 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        index = itertools.count()

        def cold():
            product(x, weights[next(index) % copies], silu)

        def hot():
            product(x, weights[0], silu)

        def prefetched():
            i = next(index) % copies
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch.prefetch_l2([weights[(i + 1) % copies]])
            product(x, weights[i], silu)
            main.wait_stream(side)

        def prefetch_only():
            prefetch.prefetch_l2([weights[next(index) % copies]])

        t = {label: time_in_graph(fn, copies, 20) for label, fn in
             (("cold", cold), ("hot", hot), ("prefetched", prefetched), ("prefetch", prefetch_only))}
        rows.append({"shape": name, "m": m, "floor_us": n * k * 2 / PEAK_BYTES_PER_S * 1e6, **t})
        del weights
        torch.cuda.empty_cache()
    return rows


class Layers:
    """LAYERS layers' four weights; forward(x) chains the products, optionally prefetching."""

    def __init__(self, dev: str, dtype):
        self.weights = [[torch.randn(n, k, device=dev, dtype=dtype) * 0.03 for _, n, k, _ in SHAPES] for _ in range(LAYERS)]
        self.side = torch.cuda.Stream()

    def forward(self, x: torch.Tensor, with_prefetch: bool) -> torch.Tensor:
        flat = [(w, silu) for layer in self.weights for w, (_, _, _, silu) in zip(layer, SHAPES)]
        main = torch.cuda.current_stream()
        if with_prefetch:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                prefetch.prefetch_l2([flat[0][0]])
        for j, (w, silu) in enumerate(flat):
            if with_prefetch and j + 1 < len(flat):
                started = torch.cuda.Event()
                started.record(main)
                self.side.wait_event(started)
                with torch.cuda.stream(self.side):
                    prefetch.prefetch_l2([flat[j + 1][0]])
            if w.shape[1] != x.shape[1]:  # qkv -> o: o reads the first 2048 columns (q's width)
                x = x[:, : w.shape[1]]
            x = product(x, w, silu)
            if isinstance(x, torch.Tensor) and x.shape[1] == HIDDEN:
                x = x * 0.5  # keep values bounded across 28 layers
        if with_prefetch:
            main.wait_stream(self.side)
        return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dtype, dev = torch.bfloat16, "cuda"
    if not prefetch.available(torch.device(dev)):
        print("prefetch_l2 needs CUDA, triton and sm_90 or newer", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    out = {"products": [], "layers": []}
    print(f"{'shape':14s} {'M':>4s} {'floor':>6s} {'cold':>7s} {'hot':>7s} {'prefetched':>10s} {'prefetch':>8s}   (us per product)")
    for m in args.m:
        for r in per_product(m, dev, dtype):
            out["products"].append(r)
            print(f"{r['shape']:14s} {m:4d} {r['floor_us']:6.2f} {r['cold']:7.2f} {r['hot']:7.2f} {r['prefetched']:10.2f} {r['prefetch']:8.2f}", flush=True)
    layers = Layers(dev, dtype)
    print(f"\n{LAYERS} chained layers (qkv, o, gate/up + SwiGLU, down), us per layer:")
    for m in args.m:
        x = torch.randn(m, HIDDEN, device=dev, dtype=dtype)
        same = torch.allclose(layers.forward(x, False).float(), layers.forward(x, True).float())
        t = {p: time_in_graph(lambda p=p: layers.forward(x, p), 1, 30) / LAYERS for p in (False, True)}
        runs = {p: statistics.median(time_in_graph(lambda p=p: layers.forward(x, p), 1, 30) / LAYERS for _ in range(3)) for p in (False, True)}
        out["layers"].append({"m": m, "plain_us": runs[False], "prefetch_us": runs[True], "first": t, "same_output": same})
        print(f"  M={m:4d}: plain {runs[False]:6.2f}  with prefetch {runs[True]:6.2f}  ratio {runs[True] / runs[False]:.3f}  (outputs equal: {same})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
