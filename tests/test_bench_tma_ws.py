"""bench/tma_ws_exp.py's kernel (the TMA skinny product's loop, with and without Triton's warp
specialization) against the fp32 product on the CPU, under Triton's interpreter: odd row counts,
a K split, both settings. (fp16: the interpreter's descriptor loads garble bf16.)"""

import pytest
import torch
from bench_scripts import run_bench
from interpreted import ROOT, run_interpreted

CASES = f'''
import sys
import torch
sys.path.insert(0, {str(ROOT / "bench")!r})
import tma_ws_exp
from florist.kernels.skinny_gemm import GemmConfig

torch.manual_seed(0)
for m, n, k, split in ((100, 192, 256, 1), (37, 64, 512, 2), (1, 128, 128, 1)):
    x, w = torch.randn(m, k, dtype=torch.float16), torch.randn(n, k, dtype=torch.float16)
    ref = x.float() @ w.float().T
    for ws in (False, True):
        out = tma_ws_exp.summed(tma_ws_exp.product(x, w, GemmConfig(64, 64, 64, split, 4, 3, tma=True), ws)).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert out.shape == ref.shape and err < 2e-3, (m, n, k, split, ws, err)
'''


def test_tma_ws_exp_kernel_matches_the_product_under_the_interpreter():
    run_interpreted(CASES, "print('tma ws cases ok')", "tma ws cases ok", timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_it_says_so():
    out = run_bench("tma_ws_exp.py", "--shapes", "qkv", "--m", "128")
    assert out.returncode == 1 and "needs CUDA" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
