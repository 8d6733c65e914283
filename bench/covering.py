"""Covered replays against first sights and captures, on a stream of batch shapes with a long tail.

A graph bucket's first batch runs eagerly and its second captures a graph (tens of ms each, the
batch waits); with covering (florist/engine/graph_runner.py, "Covering") a batch whose bucket has
no graph first replays a captured graph that holds it, up to `rent` times. This script sends the
same stream of batches, one after another, to fresh engines with rent 0 (no covering) and rent 8
(the default), alternating, after the warm-up a server runs, and prints per setting the batches'
wall times (launch to rows on the host) and what the graph runner did during the stream: new
buckets run eagerly ("first"), graphs captured, covered replays, and the host time of the first
sights and captures ("stalls s").

The stream: batches of k sequences, k drawn from a Zipf law (k = 1 most often, up to 16), each
sequence of U(16..512) tokens; so a few buckets come often and many come once or twice, as
under concurrent requests of mixed lengths.

    python bench/covering.py                      # Qwen3-0.6B geometry, CUDA, 400 batches, 2 rounds
    python bench/covering.py --smoke              # tiny model, few batches: the code path only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.batch import HostBatch  # noqa: E402


def stream(seed: int, n: int, vocab: int, max_seqs: int, max_len: int) -> list[HostBatch]:
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.zipf(1.6, size=n), max_seqs)
    return [HostBatch.from_sequences([rng.integers(0, vocab, size=int(rng.integers(16, max_len + 1)), dtype=np.int32)
                                      for _ in range(int(k))]) for k in sizes]


def run(engine: Engine, batches: list[HostBatch]) -> dict:
    g = engine.runner.graphs
    before = len(g.seen), len(g.graphs), g.covered_replays, g.capture_seconds + g.first_sight_seconds  # the warm-up's
    times = []
    started = time.perf_counter()
    for host in batches:
        t = time.perf_counter()
        engine.step(host).numpy()
        times.append((time.perf_counter() - t) * 1e3)
    total = time.perf_counter() - started
    ms = np.asarray(times)
    return {"total_s": total, "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "max": float(ms.max()),
            "over_10ms": int((ms > 10).sum()), "first_sights": len(g.seen) - before[0], "captures": len(g.graphs) - before[1],
            "covered": g.covered_replays - before[2], "stall_s": g.capture_seconds + g.first_sight_seconds - before[3]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model, 30 batches, 1 round")
    p.add_argument("--batches", type=int, default=None, help="batches in the stream (default 400; 30 with --smoke)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the two settings, alternating (default 2; 1 with --smoke)")
    p.add_argument("--rent", type=int, nargs="+", default=[0, 8], help="the settings compared (default 0 8)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("covering: needs CUDA (graph buckets exist only there)")
        return 1
    n = args.batches or (30 if args.smoke else 400)
    rounds = args.rounds or (1 if args.smoke else 2)
    geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / geometry, geometry, dtype=torch.bfloat16)
        for r in range(rounds):
            for rent in args.rent:
                engine = Engine.from_pretrained(path, device="cuda")
                engine.runner.graphs.rent = rent
                engine.warm_up(max_seqs=32)  # as `florist serve` does before it listens (its batches: at most 32 sequences here)
                batches = stream(1000 + r, n, engine.info.vocab_size, 16, 512)
                rows.append((r + 1, rent, run(engine, batches)))
                del engine
                torch.cuda.empty_cache()
    print(f"\n{n} batches one after another, {geometry}, k ~ Zipf(1.6) <= 16 sequences of U(16..512) tokens, {torch.cuda.get_device_name()}")
    print(f"{'round':>5}{'rent':>6}{'total s':>9}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'>10 ms':>8}{'first':>6}{'graphs':>8}{'covered':>9}{'stalls s':>10}")
    for r, rent, x in rows:
        print(f"{r:>5}{rent:>6}{x['total_s']:>9.2f}{x['p50']:>8.2f}{x['p99']:>8.2f}{x['max']:>8.1f}{x['over_10ms']:>8}{x['first_sights']:>6}"
              f"{x['captures']:>8}{x['covered']:>9}{x['stall_s']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
