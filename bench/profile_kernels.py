"""Device kernels per step, by name: what a forward (or a decode token) is made of on the GPU.

    python bench/profile_kernels.py            # Qwen3-0.6B 1 x 128 / 1 x 512 / 100 x 512, MiniLM 1 x 128, decode

Runs the torch profiler (CUDA activity only; kernels inside CUDA-graph replays are recorded too)
over several steps after warm-up and prints, per kernel name, launches per step, average us and
us per step, with the total kernel count and kernel time per step. Random-weight models of the
named geometries, as bench/engine.py builds them.
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.batch import HostBatch  # noqa: E402
from florist.engine.generation.config import GenerationConfig  # noqa: E402


def table(prof, steps: int, title: str, rows: int = 22) -> None:
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = agg[e.name[:70]]
            entry[0] += 1
            entry[1] += e.device_time
    kernels = sum(v[0] for v in agg.values()) / steps
    total_us = sum(v[1] for v in agg.values()) / steps
    print(f"\n== {title}: {kernels:.0f} kernels/step, {total_us:.1f} us/step of kernel time")
    for name, (count, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"{count / steps:7.1f}/step {us / count:8.2f} us avg {us / steps:9.1f} us/step  {name}")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/profile_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="florist-profile-"))
    rng = np.random.default_rng(0)
    for geometry, dtype, name, shapes in (("qwen3-0.6b", torch.bfloat16, "qwen3", [(1, 128), (1, 512), (100, 512)]),
                                          ("minilm-l6", torch.float16, "minilm", [(1, 128)])):
        engine = Engine.from_pretrained(make_model(tmp / name, geometry, dtype=dtype), device="cuda", dtype=dtype)
        for n, length in shapes:
            host = HostBatch.from_sequences([rng.integers(0, engine.info.vocab_size, length).astype(np.int32) for _ in range(n)])
            steps = 20 if n == 1 else 3
            for _ in range(5):  # graphs captured, allocator warm
                engine.step(host).numpy()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    engine.step(host).numpy()
            table(prof, steps, f"{name} {n} x {length}")
        del engine
        torch.cuda.empty_cache()
    engine = Engine.from_pretrained(make_model(tmp / "lm", "qwen3-0.6b", variant="reranker"), device="cuda", dtype=torch.bfloat16,
                                    generation=GenerationConfig(max_num_seqs=4, max_model_len=512))
    prompt = rng.integers(0, engine.info.vocab_size, 64).tolist()
    for _ in range(3):
        engine.generate([prompt], max_tokens=65, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], max_tokens=201, ignore_eos=True)
    table(prof, 200, "qwen3 decode, batch 1 (per token; the prefill is included once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
