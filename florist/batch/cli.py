"""`florist embed INPUT -o OUTPUT`: embed a file of documents into Parquet, resumably (docs/batch.md)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="INPUT", help="JSONL, CSV, Parquet or plain text (one document per line)")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="output directory: parts, manifest.json, then embeddings.parquet; run the same command again to resume")
    p.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--format", default=None, choices=["jsonl", "csv", "parquet", "txt"], help="input format (default: from the file name)")
    p.add_argument("--text-field", default="text", help="field or column holding the text (default: text)")
    p.add_argument("--id-field", default=None, help="field or column holding the id (default: id when present, else the line number)")
    p.add_argument("--prompt-name", default=None, help="one of the model's prompts, e.g. document or query")
    p.add_argument("--dimensions", type=int, default=None, help="truncate to this many dimensions (matryoshka)")
    p.add_argument("--encoding", default="float", choices=["float", "int8", "binary", "ubinary"], help="float32, int8 (models that define it), or packed bits")
    p.add_argument("--truncate", action="store_true", help="cut over-long texts instead of skipping or failing on them")
    p.add_argument("--on-error", default="fail", choices=["skip", "fail"], help="a malformed record stops the job (fail, the default) or is skipped, counted and listed in skipped.jsonl")
    p.add_argument("--part-rows", type=int, default=10_000, help="records per part: the unit of resumption (default: 10000)")
    p.add_argument("--batch-tokens", type=int, default=16_384, help="tokens per device batch (default: 16384)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--no-progress-bar", action="store_true", help="log lines instead of a progress bar, even on a terminal")
    ray = p.add_argument_group("Ray (pip install 'florist[ray]')")
    ray.add_argument("--ray", action="store_true", help="run on Ray Data: one engine actor per GPU (CPU actors when there is none)")
    ray.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    ray.add_argument("--num-replicas", type=int, default=None, help="engine actors (default: one per GPU of the cluster, or 1 on CPU)")


def run(args: argparse.Namespace) -> int:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        print("florist embed: needs pyarrow: pip install 'florist[batch]'", file=sys.stderr)
        return 2
    from florist.batch.job import JobConfig, run_job

    if (args.address or args.num_replicas) and not args.ray:
        print("florist embed: --address and --num-replicas apply to --ray runs; add --ray", file=sys.stderr)
        return 2
    cfg = JobConfig(
        input=args.input, output=args.output, model=args.model, format=args.format,
        text_field=args.text_field, id_field=args.id_field or "id", id_field_given=args.id_field is not None,
        prompt_name=args.prompt_name, dimensions=args.dimensions, encoding=args.encoding, truncate=args.truncate,
        on_error=args.on_error, part_rows=args.part_rows, batch_tokens=args.batch_tokens,
        device=args.device, dtype=args.dtype, ray=args.ray, address=args.address, num_replicas=args.num_replicas,
    )
    try:
        summary = run_job(cfg, progress="log" if args.no_progress_bar else "auto", log=lambda m: print(m, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print(f"florist embed: interrupted; the finished parts in {args.output} are kept: run the same command to resume", file=sys.stderr)
        return 130
    for line in summary.lines():
        print(f"florist embed: {line}", flush=True)
    return 0
