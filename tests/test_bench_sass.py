"""bench/sass.py: the short attention kernel compiled for sm_90 on the CPU, its registers and key loop."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import ROOT, run_bench

sys.path.insert(0, str(ROOT / "bench"))
import sass as bench_sass  # noqa: E402  (bench/sass.py)

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FMUL R2, R2, R3 ;
        /*0020*/                   HGMMA.64x64x16.F32 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   MUFU.EX2 R4, R4 ;
        /*0040*/              @!P0 BRA 0x20 ;
        /*0050*/                   FADD R5, R5, R6 ;
        /*0060*/              @!P1 BRA 0x50 ;
        /*0070*/                   EXIT ;
"""


def test_key_loop_is_the_widest_backward_branch():
    assert bench_sass.key_loop(_SASS) == ["HGMMA.64x64x16.F32", "MUFU.EX2", "BRA"]


def _compiles_for_sm90() -> bool:
    try:
        from triton.backends.nvidia import compiler
    except ImportError:
        return False
    return (bench_sass.Path(compiler.__file__).parent / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _compiles_for_sm90(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump)")
def test_the_lean_kernel_compiles_and_its_loop_holds_the_softmax():
    kernel = bench_sass.compile_kernel("minilm-l6", 128, 64, 4, 3, True, None)
    regs, spill = bench_sass.resources(kernel)
    assert 32 <= regs <= 255 and spill >= 0
    loop = bench_sass.key_loop(bench_sass.cuobjdump(kernel, "-sass"))
    # the two tensor-core products and one exponential a score: 128 x 64 scores over 128 threads
    assert any(op.startswith("HGMMA") for op in loop) and loop.count("MUFU.EX2") >= 64
    capped = bench_sass.compile_kernel("minilm-l6", 128, 64, 4, 3, True, 96)
    assert bench_sass.resources(capped)[0] <= 96


@pytest.mark.skipif(not _compiles_for_sm90(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump)")
def test_the_script_prints_a_row_a_setting():
    out = run_bench("sass.py", "--warps", "8", "--maxnreg", "0", "--top", "3", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0] == "8"]
    assert len(rows) == 1 and int(rows[0][2]) > 0


@pytest.mark.skipif(not _compiles_for_sm90(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump)")
def test_packed_heads_count_a_score_over_the_kv_head_s_rows():
    """--pack compiles the kernel as launch_config runs one Qwen3 sequence (a kv head's two query
    heads in one program): a tile then holds 2 x 32 rows of 64 scores over 128 threads."""
    out = run_bench("sass.py", "--geometry", "qwen3-0.6b", "--block-m", "32", "--block-n", "64", "--pack", "--lean", "off",
                    "--warps", "4", "--top", "3", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "32 x 64 tiles, packed" in out.stdout
    (row,) = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0] == "4"]
    loop_instructions, per_score = int(row[4]), float(row[5])
    assert loop_instructions > 0 and per_score == pytest.approx(loop_instructions / (2 * 32 * 64 / 128), abs=0.01)


@pytest.mark.skipif(not _compiles_for_sm90(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump)")
def test_seq_last_compiles_the_other_grid_order():
    """--seq-last compiles the kernel with the slots axis last (FLORIST_SHORT_SEQ_LAST): a program
    reads its sequence from the grid's third axis, so the kernel differs, and the header says so."""
    grid_order = bench_sass.compile_kernel("minilm-l6", 64, 128, 4, 3, False, None)
    seq_last = bench_sass.compile_kernel("minilm-l6", 64, 128, 4, 3, False, None, seq_last=True)
    assert grid_order.asm["ptx"] != seq_last.asm["ptx"]
    out = run_bench("sass.py", "--block-m", "64", "--block-n", "128", "--lean", "off", "--seq-last", "--warps", "4", "--top", "3",
                    timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "64 x 128 tiles, slots last" in out.stdout
