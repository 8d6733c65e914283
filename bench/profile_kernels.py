"""Device kernels per step, by name: what a forward (or a decode token) is made of on the GPU.

    python bench/profile_kernels.py                 # Qwen3-0.6B 1 x 128 / 1 x 512 / 100 x 512, MiniLM 1 x 128 / 100 x 256, decode
    python bench/profile_kernels.py --only minilm   # one part: qwen3, minilm, decode (comma list)
    python bench/profile_kernels.py --only qwen3 --shapes 1x512   # these shapes in place of a part's own

Runs the torch profiler (CUDA activity only; kernels inside CUDA-graph replays are recorded too)
over several steps after warm-up and prints, per kernel name, launches per step, average us and
us per step, with the total kernel count and kernel time per step; then the step's critical path
(`report.critical_path`): per kernel name, how much later the step ends because of it, and how
much of that the device sat idle before it started (launch boundaries). Under programmatic
dependent launch a kernel's duration includes its wait for the one before, so durations overlap
and add up to more than the step; the critical path's shares add up to the step's span.
Random-weight models of the named geometries, as bench/engine.py builds them. For batch-1
shapes it also prints the host side of a step: how long `step()` takes to return (p50 over 300
steps, no profiler running) and, from a CPU profile, the host time per step of each CUDA runtime
call (cudaGraphLaunch is the graph's launch; a step's device work overlaps it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model, shapes_arg  # noqa: E402
from report import print_critical_path, print_kernel_table  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.batch import HostBatch  # noqa: E402
from florist.engine.generation.config import GenerationConfig  # noqa: E402


PARTS = ("qwen3", "minilm", "decode")


def host_side(engine: Engine, host: HostBatch, title: str, n: int = 300) -> None:
    """Host time until step() returns, and CUDA runtime calls per step (CPU profile)."""
    launch = []
    for _ in range(n):
        t = time.perf_counter()
        lazy = engine.step(host)
        launch.append((time.perf_counter() - t) * 1e6)
        lazy.numpy()
    steps = 100
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step(host).numpy()
    print(f"-- {title}, host: step() returns after {np.percentile(launch, 50):.1f} us (p50 of {n}); CUDA runtime calls per step:")
    calls = sorted((e for e in prof.key_averages() if e.key.startswith("cuda")), key=lambda e: -e.self_cpu_time_total)
    for e in calls[:8]:
        print(f"{e.count / steps:7.1f}/step {e.self_cpu_time_total / e.count:8.2f} us avg  {e.key}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--shapes", type=shapes_arg, default=None,
                    help="BATCHxTOKENS[,...]: profile these shapes in each part chosen (default: qwen3 1x128,1x512,100x512; minilm 1x128,100x256)")
    args = ap.parse_args()
    parts = set(filter(None, args.only.split(",")))
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print("bench/profile_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="florist-profile-"))
    rng = np.random.default_rng(0)
    for geometry, dtype, name, shapes in (("qwen3-0.6b", torch.bfloat16, "qwen3", [(1, 128), (1, 512), (100, 512)]),
                                          ("minilm-l6", torch.float16, "minilm", [(1, 128), (100, 256)])):
        if name not in parts:
            continue
        shapes = args.shapes or shapes
        engine = Engine.from_pretrained(make_model(tmp / name, geometry, dtype=dtype), device="cuda", dtype=dtype)
        for n, length in shapes:
            host = HostBatch.from_sequences([rng.integers(0, engine.info.vocab_size, length).astype(np.int32) for _ in range(n)])
            steps = 20 if n == 1 else 3
            for _ in range(5):  # graphs captured, allocator warm
                engine.step(host).numpy()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    engine.step(host).numpy()
                    time.sleep(0.001)  # idle time between steps: critical_path splits them there
            print_kernel_table(prof, steps, f"{name} {n} x {length}")
            print_critical_path(prof, steps, f"{name} {n} x {length}")
            if n == 1:
                host_side(engine, host, f"{name} {n} x {length}")
        del engine
        torch.cuda.empty_cache()
    if "decode" not in parts:
        return 0
    engine = Engine.from_pretrained(make_model(tmp / "lm", "qwen3-0.6b", variant="reranker"), device="cuda", dtype=torch.bfloat16,
                                    generation=GenerationConfig(max_num_seqs=4, max_model_len=512))
    prompt = rng.integers(0, engine.info.vocab_size, 64).tolist()
    for _ in range(3):
        engine.generate([prompt], max_tokens=65, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], max_tokens=201, ignore_eos=True)
    print_kernel_table(prof, 200, "qwen3 decode, batch 1 (per token; the prefill is included once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
