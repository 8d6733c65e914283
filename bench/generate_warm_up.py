"""What the Generate engine's warm-up (`Generator.warm_up`, run by `florist engine-server` before it
serves) buys: requests of new batch shapes with and without it, each side in its own process from an
empty Triton cache, so every kernel it needs compiles where it is first met.

    cold   build the engine, then generate() one batch of each shape below (8 new tokens each)
    warm   build the engine, warm_up(), then the same batches

For each request: its wall time and the Triton kernels compiled meanwhile (florist/kernels/
compile_watch.py); for the warm side the warm-up's own time; for both the memory the prefill and
decode graphs hold afterwards.

    python bench/generate_warm_up.py            # Qwen3-0.6B geometry as a causal LM, bf16, CUDA
    python bench/generate_warm_up.py --smoke    # tiny model, short prompts: the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model  # noqa: E402

# (prompts, tokens per prompt): a first request, the same again, then shapes of other buckets.
SHAPES = [(1, 128), (1, 128), (1, 300), (3, 64), (8, 200), (12, 50), (20, 100), (32, 16), (5, 700)]
SMOKE_SHAPES = [(1, 20), (1, 20), (3, 9), (6, 30)]
NEW_TOKENS = 8


def side(path: Path, warm: bool, shapes: list[tuple[int, int]]) -> dict:
    """One side, in this process: the engine, the warm-up if `warm`, then the requests."""
    from florist import Engine
    from florist.engine.generation.config import GenerationConfig
    from florist.kernels import compile_watch

    engine = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, generation=GenerationConfig())
    gen, result = engine.runner, {"requests": []}
    compile_watch.watch()
    if warm:
        before, started = compile_watch.counts(), time.perf_counter()
        done = gen.warm_up()
        result["warm_up"] = {**done, "seconds": time.perf_counter() - started, "compiled": compile_watch.counts()[0] - before[0]}
    rng, vocab = np.random.default_rng(1), engine.info.vocab_size
    for n, length in shapes:
        prompts = [rng.integers(0, vocab, size=length).tolist() for _ in range(n)]
        before, started = compile_watch.counts()[0], time.perf_counter()
        engine.generate(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
        result["requests"].append({"prompts": n, "tokens": length, "ms": (time.perf_counter() - started) * 1e3,
                                   "compiled": compile_watch.counts()[0] - before})
    runner = gen.runner
    for graphs, name in ((runner.prefill_graphs, "prefill"), (runner.graphs, "decode")):
        if graphs is not None:
            result[f"{name}_graph_mib"] = graphs.stats()[f"{name}_graph_memory_bytes"] / 2**20
    engine.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompts")
    ap.add_argument("--side", choices=("cold", "warm"), help=argparse.SUPPRESS)  # one side, in a child process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/generate_warm_up.py needs CUDA: the warm-up compiles GPU kernels and captures CUDA graphs")
        return 1
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.side:
        print(json.dumps(side(Path(args.model), args.side == "warm", shapes)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-warm-up-"))
    geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
    path = make_model(tmp / geometry, geometry, variant="reranker")
    results = {}
    for name in ("cold", "warm"):
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix=f"triton-{name}-", dir=tmp)}
        cmd = [sys.executable, __file__, "--side", name, "--model", str(path)] + (["--smoke"] if args.smoke else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            print(out.stdout[-2000:] + out.stderr[-4000:])
            return out.returncode
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {geometry}, bf16, {NEW_TOKENS} new tokens per prompt, "
          "each side from an empty Triton cache")
    w = results["warm"]["warm_up"]
    print(f"warm-up: {w['seconds']:.1f} s, {w['rounds']} rounds, {w['steps']} steps, prefills up to {w['max_tokens']} tokens and "
          f"{w['max_seqs']} prompts, decode rows {w['decode_rows']}, {w['compiled']} Triton kernels compiled")
    print(f"{'request':>18s} {'cold ms':>10s} {'compiled':>9s} {'warm ms':>10s} {'compiled':>9s}")
    for cold, warm in zip(results["cold"]["requests"], results["warm"]["requests"]):
        print(f"{cold['prompts']:5d} x {cold['tokens']:4d} tokens {cold['ms']:10.1f} {cold['compiled']:9d} {warm['ms']:10.1f} {warm['compiled']:9d}")
    for name in ("cold", "warm"):
        r = results[name]
        print(f"{name}: graphs hold {r.get('prefill_graph_mib', 0):.0f} MiB (prefill), {r.get('decode_graph_mib', 0):.0f} MiB (decode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
