"""`florist` command line: one subcommand per job, each registered in `COMMANDS`.

Subcommand modules are imported lazily, so `florist --help` stays fast and a command's heavy
dependencies load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> (module, help). The module defines add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "encode": ("florist.cli", "embed texts (arguments or stdin lines) and print the vectors as JSON"),
    "embed": ("florist.batch.cli", "embed a file of documents (JSONL, CSV, Parquet, text) into Parquet; resumable, locally or on Ray"),
    "engine-server": ("florist.server.cli", "serve a model over gRPC to the gateway (pre-tokenized requests, batched on the device)"),
    "generate": ("florist.engine.generation.cli", "greedy text generation with a causal LM (Qwen3ForCausalLM), optionally tensor parallel"),
    "serve": ("florist.gateway.cli", "serve a model over HTTP (OpenAI, text-embeddings-inference and Cohere-style APIs); starts the engines too"),
}


def port_number(text: str) -> int:
    """argparse type of the commands' port flags: a TCP port, 0-65535 (0: any free port). Without
    it a port past 65535 would reach the socket layer, which binds it modulo 2^16."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0: any free port)")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `florist encode`."""
    p.add_argument("texts", nargs="*", help="texts to embed; none: read one text per line from stdin")
    p.add_argument("--model", default=None, help="model directory (default: all-MiniLM-L6-v2 from its wheel)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--prompt-name", default=None, help="one of the model's prompts, e.g. query")
    p.add_argument("--dimensions", type=int, default=None, help="truncate to this many dimensions (matryoshka)")
    p.add_argument("--encoding", default="float", choices=["float", "int8", "binary", "ubinary"], help="float32 (default), int8 (models that define it), or packed bits")
    p.add_argument("--truncate", action="store_true", help="cut over-long texts instead of failing")


def run(args: argparse.Namespace) -> int:
    from florist import Engine

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        print("florist encode: no texts given (pass them as arguments or on stdin)", file=sys.stderr)
        return 2
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    vectors = engine.embed(texts, prompt_name=args.prompt_name, dimensions=args.dimensions, encoding=args.encoding, truncate=args.truncate)
    json.dump({"model": engine.info.model_name, "embeddings": vectors.tolist()}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="florist", description="Fast GPU inference for embedding, reranking and greedy LLM models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args)
    except ValueError as e:  # InputError and UnsupportedModelError: a message for a person
        print(f"florist {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
