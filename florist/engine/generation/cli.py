"""`florist generate`: greedy continuations of prompts with a causal LM.

    florist generate --model PATH --prompt "the rose" --max-tokens 32 [--tensor-parallel-size 2]
    florist generate --model PATH --prompt-ids 5,17,42 --prompt-ids 7 --max-tokens 8 --json

Prints each continuation's text (one per line), or with --json one JSON object per prompt:
{"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "length"}.
"""

from __future__ import annotations

import argparse
import json
import sys


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a causal LM directory (Qwen3ForCausalLM)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several; they run as one batch)")
    p.add_argument("--prompt-ids", action="append", type=_ids, default=[], help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt at most (default 16)")
    p.add_argument("--stop-token-ids", type=_ids, default=[], help="comma-separated ids that end a continuation (besides EOS)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="processes (GPUs) the model is sharded over (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded at once (KV-cache slots)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + new tokens per sequence at most (KV-cache slot length)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from florist import Engine
    from florist.engine.generation.config import GenerationConfig

    if args.prompt and args.prompt_ids:
        print("florist generate: give prompts as --prompt or as --prompt-ids, not both", file=sys.stderr)
        return 2
    prompts = args.prompt or args.prompt_ids
    if not prompts:
        print("florist generate: no prompt given (--prompt TEXT or --prompt-ids 1,2,3)", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len)) if v is not None}
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, task="generate",
                                    tensor_parallel_size=args.tensor_parallel_size, generation=GenerationConfig(**options))
    try:
        results = engine.generate(prompts, max_tokens=args.max_tokens, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
    finally:
        engine.close()
    for r in results:
        if args.json:
            print(json.dumps({"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason}))
        else:
            print(r.text)
    return 0
