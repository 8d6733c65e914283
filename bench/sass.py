"""The short attention kernel compiled for Hopper (sm_90) on any machine, GPU or not: registers and
spill bytes a thread, and the instructions of its key loop by opcode.

    python bench/sass.py [--geometry minilm-l6] [--block-m 128] [--block-n 64] [--warps 4 8] [--maxnreg 0 128]
    python bench/sass.py --geometry qwen3-0.6b --block-m 32 --block-n 64 --pack --lean off --warps 4 8

Triton specializes a kernel at launch on which pointers and integers are multiples of 16 (so loads
can be 16-byte vectors); a compile that skips that sees scalar 2-byte loads and far more registers
than the GPU runs. This script gives the compile the same specialization the engine's launches get
(q, k and v strided column slices of one qkv product: every pointer and stride a multiple of 16).
The Triton of this machine compiles it, which may differ from the device's: the GPU's own figure is
Nsight Compute's (`bench/ncu_step.py`). `cuobjdump` comes with Triton's NVIDIA backend.

The key loop is the body of the kernel's longest backward branch; its instructions a score are
its count over the scores one thread holds in a key tile (rows x BLOCK_N / threads, rows = BLOCK_M,
times the kv head's query heads with --pack).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GEOMETRIES = {  # name: (query heads per kv head, head_dim, dtype, causal)
    "minilm-l6": (1, 32, "fp16", False),
    "qwen3-0.6b": (2, 128, "bf16", True),
}
# the kernel's arguments before its constexprs, with Triton's signature types
ARGS = {"q_ptr": "*{t}", "k_ptr": "*{t}", "v_ptr": "*{t}", "out_ptr": "*{t}", "cu_ptr": "*i32", "num_tokens": "i32", "qk_scale": "fp32",
        "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"}
ALIGNED = [name for name in ARGS if name.endswith("_ptr") or name.startswith("stride_")]


def compile_kernel(geometry: str, block_m: int, block_n: int, warps: int, stages: int, lean: bool, maxnreg: int | None,
                   pack: bool = False, seq_last: bool = False):
    """The compiled kernel (Triton's CompiledKernel) for sm_90; `seq_last`: the grid's slots axis
    last (FLORIST_SHORT_SEQ_LAST's order)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from florist.kernels import short_attention as sa

    groups, head_dim, dtype, causal = GEOMETRIES[geometry]
    consts = dict(GROUPS=groups, HEADS=groups if pack else 1, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
                  BLOCK_N=block_n, CAUSAL=causal, IEEE=False, FMA_SCALE=lean, MASK_TAIL=lean and not causal, SEQ_LAST=seq_last, PDL=True)
    signature = {name: kind.format(t=dtype) for name, kind in ARGS.items()} | {name: "constexpr" for name in consts}
    names = list(signature)
    src = ASTSource(fn=sa._short_attention_kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED})
    options = dict(num_warps=warps, num_stages=stages, launch_pdl=True) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, flag: str) -> str:
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(tool), flag, str(cubin)], check=True, capture_output=True, text=True).stdout


def resources(kernel) -> tuple[int, int]:
    """(registers, spill stack bytes) a thread."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel, "-res-usage"))
    return int(m.group(1)), int(m.group(2))


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def key_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop: the body of the backward branch spanning the most instructions."""
    code = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(_LINE.search, sass.splitlines()) if m]
    best = (0, 0)
    for addr, op, rest in code:
        target = re.match(r"\s*(0x[0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    return [op for addr, op, _ in code if best[0] <= addr <= best[1]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="minilm-l6")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--lean", choices=("on", "off"), default="on", help="the lean key loop (launch_config's for narrow heads' batch tiles)")
    p.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps a thread (0: none)")
    p.add_argument("--pack", action="store_true", help="one program holds a kv head's query heads (launch_config's pack_groups)")
    p.add_argument("--seq-last", action="store_true", help="the grid's slots axis last (FLORIST_SHORT_SEQ_LAST's order)")
    p.add_argument("--top", type=int, default=12, help="opcodes of the key loop to list (default 12)")
    args = p.parse_args(argv)
    print(f"short attention, {args.geometry}, {args.block_m} x {args.block_n} tiles{', packed' if args.pack else ''}"
          f"{', slots last' if args.seq_last else ''}, {args.stages} stages, lean {args.lean}, sm_90")
    print(f"{'warps':>5s} {'cap':>4s} {'regs':>5s} {'spill B':>8s} {'loop instr':>10s} {'a score':>8s}   commonest in the loop")
    rows = args.block_m * (GEOMETRIES[args.geometry][0] if args.pack else 1)
    for warps in args.warps:
        for cap in args.maxnreg:
            kernel = compile_kernel(args.geometry, args.block_m, args.block_n, warps, args.stages, args.lean == "on", cap or None, args.pack,
                                    args.seq_last)
            regs, spill = resources(kernel)
            ops = key_loop(cuobjdump(kernel, "-sass"))
            per_score = len(ops) / (rows * args.block_n / (32 * warps))
            common = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(args.top))
            print(f"{warps:5d} {cap or '-':>4} {regs:5d} {spill:8d} {len(ops):10d} {per_score:8.2f}   {common}", flush=True)


if __name__ == "__main__":
    main()
