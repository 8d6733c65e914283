"""The batch job (`florist embed`) against calling `engine.step()` directly on the same batches.

20,000 synthetic documents of mixed length (log-uniform word counts) are written as JSONL and
embedded by the job, in-process, end to end: index pass, reading, tokenizing, device, Parquet
parts and the assembled result. Every batch the job hands to `engine.step()` is recorded; the
direct measurement replays exactly those batches through `step()`, two in flight, with nothing
else around it. The job's embeddings/s over the direct embeddings/s is the price of the job.

Both are warmed up first (CUDA graphs are captured on a bucket's second sight), then run
alternately `--rounds` times; medians are reported. The job's output is checked against
`engine.embed` on a sample (cosine >= 0.999) before anything is timed.

    python bench/batch_job.py                    # random-weight Qwen3-0.6B geometry, bf16, GPU
    python bench/batch_job.py --model DIR        # a model directory
    python bench/batch_job.py --smoke            # tiny model on the CPU: the code path only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def write_documents(path: Path, n: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """Documents of log-uniform length built from the test tokenizer's words (~1 token each)."""
    from geometries import tiny

    rng = np.random.default_rng(seed)
    words = np.array(tiny.WORDS)
    lens = np.exp(rng.uniform(np.log(min_words), np.log(max_words + 1), size=n)).astype(int)
    docs = [" ".join(rng.choice(words, size=k)) for k in lens]
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    return docs


class StepRecorder:
    """Wraps `engine.step` (instance attribute: Engine.run calls self.step) to keep every batch."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        self.batches: list = []
        engine.step = self

    def __call__(self, batch):
        self.batches.append(batch)
        return self.step(batch)


def direct(step, batches) -> float:
    """Seconds to run `batches` through step() with two in flight, results read like Engine.run."""
    t = time.perf_counter()
    in_flight = []
    for b in batches:
        in_flight.append(step(b))
        if len(in_flight) > 1:
            in_flight.pop(0).numpy()
    for lazy in in_flight:
        lazy.numpy()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: build the random Qwen3-0.6B geometry)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few hundred documents: the code path only")
    p.add_argument("--device", default=None, help="default: cuda when present (cpu with --smoke)")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--min-words", type=int, default=16)
    p.add_argument("--max-words", type=int, default=1024)
    p.add_argument("--part-rows", type=int, default=5_000, help="the job's part size (the unit of resumption)")
    p.add_argument("--batch-tokens", type=int, default=16_384)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.docs, args.max_words, args.part_rows, args.rounds = min(args.docs, 300), min(args.max_words, 48), min(args.part_rows, 64), 1

    import torch

    from florist import Engine
    from florist.batch.job import JobConfig, run_job

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="florist-bench-batch-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from geometries import make_model

            geometry = "tiny-qwen3" if args.smoke else "qwen3-0.6b"
            t = time.perf_counter()
            model = make_model(tmp / geometry, geometry, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
            print(f"built a random {geometry} in {time.perf_counter() - t:.1f} s", flush=True)
        engine = Engine.from_pretrained(model, device=device, dtype=args.dtype, max_batch_tokens=args.batch_tokens)
        docs = write_documents(tmp / "docs.jsonl", args.docs, args.min_words, args.max_words)
        recorder = StepRecorder(engine)

        def job(name: str):
            recorder.batches.clear()
            cfg = JobConfig(str(tmp / "docs.jsonl"), str(tmp / name), part_rows=args.part_rows, truncate=True)
            t = time.perf_counter()
            summary = run_job(cfg, engine=engine, progress="off", log=lambda m: None)
            return summary, time.perf_counter() - t

        summary, _ = job("warmup-1")  # first sight of each bucket: eager; second: captured
        job("warmup-2")
        batches = list(recorder.batches)
        _check(tmp / "warmup-1", engine, docs)
        direct(recorder.step, batches)
        job_s, direct_s = [], []
        for r in range(args.rounds):
            job_s.append(job(f"timed-{r}")[1])
            direct_s.append(direct(recorder.step, batches))

    n, tokens = summary.rows, summary.tokens
    job_rate, direct_rate = n / statistics.median(job_s), n / statistics.median(direct_s)
    info = engine.info
    print(f"\n{info.model_name} ({info.family}, {info.device}, {info.dtype}); {n} documents, {tokens} tokens "
          f"({tokens / n:.0f} per document, {args.min_words}-{args.max_words} words); {len(batches)} batches of <= {args.batch_tokens} tokens; "
          f"parts of {args.part_rows}")
    print(f"{'':<28}{'embeddings/s':>14}{'tokens/s':>14}{'seconds':>10}")
    print(f"{'florist embed job':<28}{job_rate:>14.1f}{job_rate * tokens / n:>14.0f}{statistics.median(job_s):>10.2f}")
    print(f"{'direct step()':<28}{direct_rate:>14.1f}{direct_rate * tokens / n:>14.0f}{statistics.median(direct_s):>10.2f}")
    print(f"{'job / step()':<28}{job_rate / direct_rate:>14.3f}")
    return 0


def _check(out: Path, engine, docs: list[str], sample: int = 64) -> None:
    import pyarrow.parquet as pq

    t = pq.read_table(out / "embeddings.parquet")
    ids = t.column("id").to_pylist()
    assert ids == list(range(len(docs))), "the job's result is not in input order"
    rows = np.linspace(0, len(docs) - 1, min(sample, len(docs))).astype(int)
    emb = t.column("embedding").combine_chunks()
    got = emb.values.to_numpy().reshape(len(emb), -1)[rows]
    want = engine.embed([docs[i] for i in rows], truncate=True)
    cosine = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min())
    assert cosine >= 0.999, f"the job's output differs from engine.embed: min cosine {cosine:.6f}"
    print(f"job output vs engine.embed on {len(rows)} documents: min cosine {cosine:.6f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
