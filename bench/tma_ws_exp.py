"""Diagnostic: the TMA skinny product's K loop with Triton's warp specialization
(`tl.range(..., warp_specialize=True)`: a producer warp group issuing the TMA loads, consumers the
wgmma) against the same loop without it, at Qwen3-0.6B's products and batch-1 row counts.

    python bench/tma_ws_exp.py [--m 128 512] [--shapes qkv,o,gate_up,down]

us per call in a CUDA graph, weights from HBM (bench/gemm.py's timing); each variant is checked
against the fp32 reference first. The kernel here is `skinny_gemm._tma_gemm_kernel`'s loop and
stores without SwiGLU and PDL; "florist" is `skinny_gemm.tma_gemm` at its picked configuration.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemm import check_close, hbm_weights, time_graph  # noqa: E402

from florist.kernels import skinny_gemm, wide_gemm  # noqa: E402
from florist.kernels.skinny_gemm import GemmConfig  # noqa: E402


@triton.jit
def _kernel(x_desc, w_desc, out_ptr, M, N, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PARTIAL: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_k * K_PER_SPLIT
    for k in tl.range(k0, k0 + K_PER_SPLIT, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
        x = x_desc.load([pid_m * BLOCK_M, k])
        w = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(x, w.T, acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + offs, acc, mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def product(x: torch.Tensor, w: torch.Tensor, c: GemmConfig, ws: bool) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n) if c.split_k == 1 else (c.split_k, m, n), dtype=x.dtype if c.split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(n, c.block_n), c.split_k, triton.cdiv(m, c.block_m))
    _kernel[grid](wide_gemm.TensorDescriptor.from_tensor(x, [c.block_m, c.block_k]), wide_gemm.TensorDescriptor.from_tensor(w, [c.block_n, c.block_k]),
                  out, m, n, k // c.split_k, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PARTIAL=c.split_k > 1,
                  STAGES=c.num_stages, WS=ws, num_warps=c.num_warps)
    return out  # split K: the fp32 partials, left to the norm after it as in the model


def summed(out: torch.Tensor) -> torch.Tensor:
    return out.sum(0) if out.dim() == 3 else out


SHAPES = {"qkv": (4096, 1024, 1), "o": (1024, 2048, 4), "gate_up": (6144, 1024, 1), "down": (1024, 3072, 4)}  # N, K, split (gate_up: no SwiGLU)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"a comma-separated subset of {','.join(SHAPES)}")
    args = ap.parse_args()
    names = [name for name in args.shapes.split(",") if name]
    if unknown := sorted(set(names) - set(SHAPES)):
        ap.error(f"unknown shapes {unknown}; known: {','.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("tma_ws_exp: needs CUDA (a Hopper GPU: TMA descriptors and warp specialization)")
        return 1
    started = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    print(f"{'shape':22s} {'M':>4s} {'florist':>8s} {'loop':>8s} {'ws':>8s}  config (us per call)", flush=True)
    for name in names:
        n, k, split = SHAPES[name]
        weights = hbm_weights(n, k)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ weights[0].float().T
            picked = skinny_gemm.pick_tma(m, n, k, deferred=split > 1)
            t_florist = None
            if picked is not None:
                t_florist = time_graph(lambda i: skinny_gemm.tma_gemm(x, weights[i], False, picked, split > 1), len(weights))
            bases = [picked] if picked is not None else []
            bases += [GemmConfig(64 if m <= 128 else 128, bn, 128 if m <= 128 else 64, split, w, 4, tma=True) for bn, w in ((64, 4), (128, 8))]
            for c in bases:
                if k % (c.split_k * c.block_k):
                    continue
                row = []
                for ws in (False, True):
                    try:
                        check_close(summed(product(x, weights[0], c, ws)), ref, f"{name} M={m} {c} ws={ws}")
                        row.append(f"{time_graph(lambda i: product(x, weights[i], c, ws), len(weights)):8.2f}")
                    except Exception as e:  # noqa: BLE001  (a variant that does not compile or fit)
                        row.append(f"{'fail':>8s}")
                        print(f"  {name} M={m} ws={ws} {c}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
                label = f"m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}" + (" (picked)" if c is picked else "")
                florist = f"{t_florist:8.2f}" if (c is picked and t_florist is not None) else f"{'':8s}"
                print(f"{name:22s} {m:4d} {florist} {row[0]} {row[1]}  {label}  ({time.perf_counter() - started:.0f} s in)", flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
