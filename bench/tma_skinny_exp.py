"""Experiment: 65-128-row products with operands brought in by TMA, K split over programs.

Qwen3's batch-1 128-token step runs its qkv and gate/up products in cuBLAS (5.3 and 6.3 us + a
1.6 us SwiGLU kernel, against 2.0 and 3.0 us of weight bytes) and o / down in the skinny kernel
with K split 4 (pointer loads). This times one more form beside them: each program owns a
[BM, BN] output tile and a K slice, x and w tiles come in by TMA (tensor descriptors; Triton
pipelines them through shared memory with `num_stages` buffers), the accumulator is fp32 and
the kernel waits for its predecessor under programmatic dependent launch like florist's other
prefill kernels. SPLIT_K = 1 stores the output (with SwiGLU for gate/up: one [2, BN, BK] box
brings the gate and the up rows of a K block, as wide_gemm.py does); SPLIT_K > 1 stores fp32
partials [SPLIT_K, M, N] (the consumer would sum them, as the norm does for o and down).

    python bench/tma_skinny_exp.py [--m 128] [--smoke]

--smoke runs each form once under Triton's interpreter against the torch reference (CPU).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from florist.kernels import activation, pdl, skinny_gemm  # noqa: E402


@triton.jit
def _tma_skinny_kernel(x_desc, w_desc, out_ptr, M, N, K_PER, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                       SWIGLU: tl.constexpr, PDL: tl.constexpr):
    pdl.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    pid_m = tl.program_id(2)
    k_lo = s * K_PER
    if SWIGLU:
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_lo + K_PER, BK):
        x = x_desc.load([pid_m * BM, k])
        if SWIGLU:
            w = tl.reshape(w_desc.load([0, pid_n * BN, k]), (2 * BN, BK))
        else:
            w = w_desc.load([pid_n * BN, k])
        acc = tl.dot(x, w.T, acc)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SWIGLU:
        dtype = x_desc.dtype
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], (act * up).to(dtype), mask=mask)
    elif SPLIT_K == 1:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(x_desc.dtype), mask=mask)
    else:
        tl.store(out_ptr + (s * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)


def tma_skinny(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, split_k: int, warps: int, stages: int, swiglu: bool = False,
               bm: int = 128) -> torch.Tensor:
    m, k = x.shape
    assert k % (split_k * bk) == 0
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    if swiglu:
        w_desc = TensorDescriptor.from_tensor(w.view(2, n, k), [2, bn, bk])
    else:
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    if split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), split_k, triton.cdiv(m, bm))
    _tma_skinny_kernel[grid](TensorDescriptor.from_tensor(x, [bm, bk]), w_desc, out, m, n, k // split_k, BM=bm, BN=bn, BK=bk, SPLIT_K=split_k,
                             SWIGLU=swiglu, num_warps=warps, num_stages=stages, **pdl.launch_args(x))
    return out


def reference(x, w, split_k, swiglu):
    if swiglu:
        return activation.silu_and_mul(F.linear(x, w)) if x.is_cuda else _silu_mul_ref(F.linear(x.float(), w.float()).to(x.dtype))
    return F.linear(x.float(), w.float())


def _silu_mul_ref(y):
    gate, up = y.chunk(2, dim=-1)
    return (F.silu(gate.float()).to(y.dtype).float() * up.float()).to(y.dtype)


def result(out, split_k, swiglu):
    return out.float().sum(0) if split_k > 1 and not swiglu else out.float()


# name, N (weight rows), K, SwiGLU
SHAPES = [("qwen3 qkv", 4096, 1024, False), ("qwen3 gate_up+silu", 6144, 1024, True), ("qwen3 o", 1024, 2048, False),
          ("qwen3 down", 1024, 3072, False)]


def configs(n: int, k: int, swiglu: bool, m: int):
    bms = (64, 128) if m > 64 else (64,)
    for bm, bn, bk, split_k, warps, stages in itertools.product(bms, (16, 32, 64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 5)):
        if warps == 8 and bm * bn < 128 * 64:
            continue  # too little accumulator for 8 warps
        if swiglu and split_k > 1:
            continue
        if k % (split_k * bk) or k // split_k < bk * 2:
            continue
        smem = stages * (bm * bk + (2 if swiglu else 1) * bn * bk) * 2
        if smem > 200_000:
            continue
        programs = ((n // 2 if swiglu else n) // bn) * split_k * (-(-m // bm))
        if programs < 32 or programs > 1024:
            continue
        yield bm, bn, bk, split_k, warps, stages


def smoke() -> int:
    torch.manual_seed(0)
    for swiglu, split_k in ((False, 1), (False, 2), (True, 1)):
        m, n, k = 37, 64, 256
        x = torch.randn(m, k) * 0.5
        w = torch.randn(2 * n if swiglu else n, k) * 0.1
        got = result(tma_skinny(x, w, 16, 64, split_k, 4, 2, swiglu, bm=64), split_k, swiglu)
        want = reference(x, w, split_k, swiglu).float()
        err = (got - want).abs().max().item()
        print(f"smoke swiglu={swiglu} split_k={split_k}: max error {err:.2e}")
        assert err < 1e-4, err
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[128])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    if args.smoke:
        return smoke()
    from gemm import time_graph

    dtype, dev = torch.bfloat16, "cuda"
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; PDL {pdl.launch_args(torch.empty(1, device=dev))}")
    for name, n, k, swiglu in SHAPES:
        copies = max(2, min(16, -(-256 * 2**20 // (n * k * 2))))  # > 200 MB of weights: from HBM
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.05 for _ in range(copies)]
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            floor = n * k * 2 / 4.2e12 * 1e6

            def cublas(i):
                y = F.linear(x, weights[i])
                return activation.silu_and_mul(y) if swiglu else y

            t_cublas = time_graph(cublas, copies)
            deferred = name in ("qwen3 o", "qwen3 down")
            cfg = skinny_gemm.pick_config(m, n, k, silu_mul=swiglu, deferred=deferred)
            t_today = time_graph(lambda i: skinny_gemm.skinny_gemm(x, weights[i], silu_mul=swiglu, defer_reduce=deferred), copies) if cfg else t_cublas
            ref = reference(x, weights[0], 1, swiglu).float()
            results = []
            for c in configs(n, k, swiglu, m):
                bm, bn, bk, split_k, warps, stages = c
                try:
                    got = result(tma_skinny(x, weights[0], bn, bk, split_k, warps, stages, swiglu, bm=bm), split_k, swiglu)
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        print(f"  {name} {c}: relative error {err}", flush=True)
                        continue
                    t = time_graph(lambda i: tma_skinny(x, weights[i], bn, bk, split_k, warps, stages, swiglu, bm=bm), copies, replays=10)
                except Exception as exc:  # noqa: BLE001  (out of resources and the like: not a candidate)
                    print(f"  skip {c}: {type(exc).__name__}: {str(exc)[:80]}", file=sys.stderr)
                    continue
                results.append((t, c))
            results.sort()
            print(f"{name:20s} M={m:4d} floor {floor:5.2f}  cuBLAS{' + SwiGLU' if swiglu else ''} {t_cublas:6.2f}  today {t_today:6.2f}  "
                  f"({'skinny ' + str(cfg) if cfg else 'cuBLAS'})", flush=True)
            for t, c in results[: args.top]:
                print(f"    tma {t:6.2f} us  bm {c[0]} bn {c[1]} bk {c[2]} split {c[3]} warps {c[4]} stages {c[5]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
