"""Attention backends on the Qwen3-0.6B head geometry (16 query / 8 kv heads, head_dim 128), bf16.

Times one layer's attention for the shapes the engine sees, for every backend that applies, so the
"auto" policy in florist/layers/attention.py is chosen from measurements:

    python bench/attention.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from florist.engine.batch import HostBatch, to_device  # noqa: E402
from florist.layers.attention import select_backend  # noqa: E402

HQ, HKV, D = 16, 8, 128


def timed(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sdpa_batched(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]

    def run(q, k, v, lens, causal):
        b, n = len(lens), lens[0]
        qs = q.view(b, n, HQ, D).transpose(1, 2)
        ks = k.view(b, n, HKV, D).transpose(1, 2)
        vs = v.view(b, n, HKV, D).transpose(1, 2)
        with sdpa_kernel([backend]):
            try:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
            except RuntimeError:
                ks, vs = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    return run


def main():
    dev = torch.device("cuda")
    varlen = select_backend("varlen", dev)
    shapes = [("1 x 128", [128]), ("1 x 512", [512]), ("1 x 4096", [4096]), ("100 x 512", [512] * 100), ("8 x 512", [512] * 8)]
    rows = []
    for causal in (True, False):
        for label, lens in shapes:
            t = sum(lens)
            q = torch.randn(t, HQ, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(t, HKV, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(t, HKV, D, device=dev, dtype=torch.bfloat16)
            batch = to_device(HostBatch.from_sequences([[0] * n for n in lens]), dev)
            flops = sum(4 * n * n * D * HQ for n in lens) / (2 if causal else 1)
            res = {"varlen": timed(lambda: varlen(q, k, v, batch, causal, D**-0.5))}
            ref = varlen(q, k, v, batch, causal, D**-0.5)
            for kind in ("flash", "cudnn", "efficient"):
                fn = sdpa_batched(kind)
                try:
                    out = fn(q, k, v, lens, causal).transpose(1, 2).reshape(t, HQ, D)
                    err = (out.float() - ref.float()).abs().max().item()
                    res[kind] = timed(lambda: fn(q, k, v, lens, causal)) if err < 2e-2 else float("nan")
                except RuntimeError as e:
                    res[kind] = float("nan")
                    print(f"{kind} {label}: {str(e)[:80]}")
            best = min((v_, k_) for k_, v_ in res.items() if v_ == v_)
            rows.append((("causal" if causal else "bidir") + " " + label, res, flops / best[0] / 1e9, best[1]))
    print(f"\n{'shape':22s} " + " ".join(f"{k:>10s}" for k in ("varlen", "flash", "cudnn", "efficient")) + "   best TFLOP/s")
    for label, res, tflops, best in rows:
        print(f"{label:22s} " + " ".join(f"{res.get(k, float('nan')):10.4f}" for k in ("varlen", "flash", "cudnn", "efficient")) + f"   {best} {tflops:.0f}")


if __name__ == "__main__":
    main()
