"""Where a first sight's time goes. The first time a graph bucket's shape comes, the engine runs
that batch eagerly (florist/engine/graph_runner.py). This script times those launches on their
own and beside what a server has going on around them.

Under `florist serve`, scenario 4 of bench/serve.py has seen first sights launch in 0.75-1.1 s on
the H200 (docs/benchmarks.md): kernels compiling for a shape class not met before, or the
launching thread waiting. Each condition below launches first sights of shapes the engine has not
seen, and prints the wall time of `step()` (the launch) and the launching thread's CPU time. Wall
time far above CPU time means the thread waited: for the GIL, or for the device.

    alone            nothing else happening
    after capture    right after a graph capture (torch.cuda.graph syncs and empties the caches)
    batch in flight  a replayed background batch launched and not yet read
    waiter thread    that batch's wait parked on a thread, as the server parks it
    GIL contender    a thread running pure Python all along

Compilation is measured apart and then kept out. Triton's cache starts empty (a fresh
TRITON_CACHE_DIR unless --keep-triton-cache), a first engine runs every shape once (the "cold"
rows: compiling), and the conditions then run on a second engine in the same process, whose
graph buckets are all new but whose kernels are compiled.

    python bench/first_sight.py               # Qwen3-0.6B geometry, CUDA
    python bench/first_sight.py --smoke       # tiny model, short sequences: the code path only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.batch import HostBatch  # noqa: E402
from florist.kernels import compile_watch  # noqa: E402

CONDITIONS = ("alone", "after capture", "batch in flight", "waiter thread", "GIL contender")


def batch(rng: np.random.Generator, vocab: int, seqs: int, length: int) -> HostBatch:
    return HostBatch.from_sequences([rng.integers(0, vocab, size=length, dtype=np.int32) for _ in range(seqs)])


def launch(engine: Engine, host: HostBatch):
    """step() timed: (wall ms, this thread's CPU ms, Triton kernels compiled) of the launch, and the result."""
    before, wall, cpu = compile_watch.counts()[0], time.perf_counter(), time.thread_time()
    lazy = engine.step(host)
    return ((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3, compile_watch.counts()[0] - before), lazy


def contender(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))  # pure Python: holds the GIL until the interpreter makes it switch


def run(engine: Engine, condition: str, host: HostBatch, background: HostBatch, capture_with: HostBatch | None) -> tuple[float, float, int]:
    if condition == "after capture":
        engine.step(capture_with).numpy()  # its first sight; the next call captures
        engine.step(capture_with).numpy()
    if condition in ("alone", "after capture"):
        timed, lazy = launch(engine, host)
        lazy.numpy()
        return timed
    if condition == "GIL contender":
        stop = threading.Event()
        thread = threading.Thread(target=contender, args=(stop,), daemon=True)
        thread.start()
        time.sleep(0.01)
        timed, lazy = launch(engine, host)
        stop.set()
        thread.join()
        lazy.numpy()
        return timed
    behind = engine.step(background)  # a replay: the device is busy while the first sight launches
    waiter = None
    if condition == "waiter thread":
        waiter = threading.Thread(target=behind.numpy, daemon=True)
        waiter.start()
    timed, lazy = launch(engine, host)
    if waiter is not None:
        waiter.join()
    behind.numpy()
    lazy.numpy()
    return timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 64-token sequences")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default 512; 64 with --smoke)")
    p.add_argument("--shapes", type=int, default=3, help="first sights per condition (default 3)")
    p.add_argument("--keep-triton-cache", action="store_true", help="use Triton's usual cache (default: a fresh one, so the cold rows compile)")
    args = p.parse_args(argv)
    if not args.keep_triton_cache:  # before any kernel compiles; Triton reads it when it compiles
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="florist-first-sight-triton-")
    if not torch.cuda.is_available():
        print("first_sight: needs CUDA (graph buckets exist only there)")
        return 1
    length = args.length or (64 if args.smoke else 512)
    geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / geometry, geometry, dtype=torch.bfloat16)
        engines = [Engine.from_pretrained(path, device="cuda") for _ in range(2)]
    cold, warm = engines
    vocab = cold.info.vocab_size
    # Sequence counts 2, 3, 4, ...: every shape its own token bucket, so each launch is a first sight.
    counts = [2 + k for k in range(len(CONDITIONS) * args.shapes)]
    hosts = {n: batch(rng, vocab, n, length) for n in counts}
    background = batch(rng, vocab, 20, max(8, length * 4 // 5))  # not among the shapes above
    captures = [batch(rng, vocab, 1, length + 64 * (k + 1)) for k in range(args.shapes)]  # single sequences, each its own bucket
    compile_watch.watch()
    rows = []
    for n in counts:  # compiles what these shapes need, for both engines (one process)
        timed, lazy = launch(cold, hosts[n])
        lazy.numpy()
        rows.append(("cold (compiling)", n, *timed))
    for engine in engines:  # the background batch replays from a graph on both
        for _ in range(3):
            engine.step(background).numpy()
    for c, condition in enumerate(CONDITIONS):
        for k in range(args.shapes):
            n = counts[c * args.shapes + k]
            rows.append((condition, n, *run(warm, condition, hosts[n], background, captures[k] if condition == "after capture" else None)))
    print(f"\nfirst sights, {geometry}, sequences of {length} tokens, {torch.cuda.get_device_name()}; ms of step() (the launch)")
    print(f"{'condition':<18}{'batch':>14}{'wall ms':>10}{'CPU ms':>10}{'compiled':>10}")
    for condition, n, wall, cpu, compiled in rows:
        print(f"{condition:<18}{f'{n} x {length}':>14}{wall:>10.1f}{cpu:>10.1f}{compiled:>10}")
    graphs = warm.runner.graphs.stats()
    print(f"second engine: {graphs['graphs']} graphs captured, first sights {graphs['first_sight_seconds'] * 1e3:.0f} ms in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
