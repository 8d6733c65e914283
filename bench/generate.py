"""Greedy generation: florist against Hugging Face transformers' `generate` on the same random
weights, in one process (issue 7).

    batch 1:   decode ms per token (time for 1 + N new tokens minus time for 1, over N), target <= 0.8 ms;
               pipelined decode (the default: step N+1 launched before step N's ids are read) and
               step by step (host and device serial), to show what the overlap buys
    batch 32:  tokens/s for 32 prompts x P tokens, N new tokens each (prefill included)

Before timing, fidelity is checked by teacher forcing: transformers runs once over prompt +
florist's tokens, and each florist token must be transformers' argmax at that position (fp32), or
within a small logit margin of it (bf16, where the two stacks round differently).

    python bench/generate.py                     # Qwen3-0.6B geometry, bf16, CUDA
    python bench/generate.py --smoke             # tiny model, fp32, CPU: the code path only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from geometries import make_model  # noqa: E402
from report import print_summary, record, sync  # noqa: E402

from florist import Engine  # noqa: E402
from florist.engine.generation.config import GenerationConfig  # noqa: E402

def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (each synchronised: generation returns host tokens)."""
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


class HFGenerate:
    """What a user would otherwise run: transformers' generate, greedy, SDPA attention."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.device = device

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=self.device)  # equal lengths: no padding
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def check(self, prompt: list[int], tokens: list[int], margin: float) -> float:
        """Teacher forcing: the largest (max logit - logit of florist's token) over the positions."""
        ids = torch.tensor([prompt + tokens], device=self.device)
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=self.device)[:, None])[:, 0]
        worst = float((logits.max(1).values - chosen).max())
        assert worst <= margin, f"a florist token is {worst:.4f} below transformers' argmax logit (allowed {margin})"
        return worst


def run(path: Path, *, name: str, dtype: torch.dtype, device: str, prompt_len: int, decode_tokens: int, hf_decode_tokens: int,
        batch: int, batch_new_tokens: int, repeats: int, margin: float, baseline: bool, decode_attention: str | None = None):
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(path, device=device, dtype=dtype,
                                    generation=GenerationConfig(max_num_seqs=max(batch, 1), max_model_len=prompt_len + max(decode_tokens, batch_new_tokens) + 8,
                                                                decode_attention=decode_attention))
    vocab = engine.info.vocab_size
    warm = rng.integers(0, vocab, size=prompt_len).tolist()
    engine.generate([warm], max_tokens=4, ignore_eos=True)
    record(f"{name} start-up to first tokens", "seconds", time.perf_counter() - t0, None, "s")
    hf = HFGenerate(path, dtype, device) if baseline else None

    prompt = rng.integers(0, vocab, size=prompt_len).tolist()
    gen = lambda n, prompts=(prompt,): engine.generate(list(prompts), max_tokens=n, ignore_eos=True)  # noqa: E731
    tokens = gen(decode_tokens + 1)[0].token_ids
    if hf is not None:
        worst = hf.check(prompt, tokens, margin)
        print(f"fidelity: {len(tokens)} florist tokens are transformers' greedy choice (largest logit gap {worst:.4f})")
        if dtype == torch.float32:
            assert hf.generate([prompt], len(tokens))[0] == tokens, "fp32: florist's tokens must equal transformers' generate"

    # -- batch 1: decode ms per token ---------------------------------------------------------
    for _ in range(2):  # warm-up: every decode bucket seen twice (captured), allocators warm
        gen(decode_tokens + 1)
    t_prefill = timed(lambda: gen(1), repeats)
    t_full = timed(lambda: gen(decode_tokens + 1), repeats)
    ms_per_token = (t_full - t_prefill) / decode_tokens * 1e3
    hf_ms = None
    if hf is not None:
        hf.generate([prompt], 2)
        h1 = timed(lambda: hf.generate([prompt], 1), max(1, repeats // 2))
        hn = timed(lambda: hf.generate([prompt], hf_decode_tokens + 1), max(1, repeats // 2))
        hf_ms = (hn - h1) / hf_decode_tokens * 1e3
    record(f"{name} batch 1 decode ({prompt_len}-token prompt)", "ms/token", ms_per_token, hf_ms, "ms", {"prefill_ms": t_prefill * 1e3})
    # The time to the first token: transformers' generate of one new token beside it.
    record(f"{name} batch 1 prefill ({prompt_len} tokens + 1)", "ms", t_prefill * 1e3, h1 * 1e3 if hf is not None else None, "ms")
    runner = engine.runner.runner
    if runner.prefill_graphs is not None:  # the same prefill launched eagerly, as it ran before prefill graphs
        graphs, runner.prefill_graphs = runner.prefill_graphs, None
        gen(1)
        record(f"{name} batch 1 prefill, eager ({prompt_len} tokens + 1)", "ms", timed(lambda: gen(1), repeats) * 1e3, None, "ms")
        runner.prefill_graphs = graphs
    generator = engine.runner
    if generator.pipelined:  # the same engine, each step waiting for the previous one's ids
        generator.pipelined = False
        gen(decode_tokens + 1)
        serial_ms = (timed(lambda: gen(decode_tokens + 1), repeats) - timed(lambda: gen(1), repeats)) / decode_tokens * 1e3
        generator.pipelined = True
        record(f"{name} batch 1 decode, not pipelined", "ms/token", serial_ms, None, "ms")

    # -- batch N: tokens/s -------------------------------------------------------------------
    prompts = [rng.integers(0, vocab, size=prompt_len).tolist() for _ in range(batch)]
    engine.generate(prompts, max_tokens=batch_new_tokens, ignore_eos=True)
    t = timed(lambda: engine.generate(prompts, max_tokens=batch_new_tokens, ignore_eos=True), repeats)
    rate = batch * batch_new_tokens / t
    hf_rate = None
    if hf is not None:
        hf.generate(prompts, 2)
        hf_rate = batch * batch_new_tokens / timed(lambda: hf.generate(prompts, batch_new_tokens), 1)
    record(f"{name} batch {batch} x {prompt_len} prompt, {batch_new_tokens} new", "tokens/s", rate, hf_rate, "tokens/s")
    if runner.graphs is not None:
        print(f"decode graphs: {runner.graphs.stats()}")
    if runner.prefill_graphs is not None:
        print(f"prefill graphs: {runner.prefill_graphs.stats()}")
    engine.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, fp32, CPU, few tokens")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256, help="florist: new tokens timed at batch 1")
    ap.add_argument("--hf-decode-tokens", type=int, default=32, help="transformers: new tokens timed at batch 1")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--margin", type=float, default=0.1, help="bf16 fidelity: allowed gap to transformers' argmax logit")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--decode-attention", default=None, help="decode attention backend (triton, flash, torch); default: the engine's choice")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    tmp = Path(tempfile.mkdtemp(prefix="florist-bench-generate-"))
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}")
    print(f"{'scenario':40s} {'metric':14s} {'florist':>10s} {'transformers':>12s} {'unit':9s} speedup")
    if args.smoke:
        path = make_model(tmp / "tiny", "tiny-qwen3", variant="reranker", dtype=torch.float32)
        run(path, name="tiny-qwen3 fp32", dtype=torch.float32, device=device, prompt_len=16, decode_tokens=8, hf_decode_tokens=4,
            batch=4, batch_new_tokens=8, repeats=2, margin=1e-4, baseline=not args.no_baseline)
    else:
        path = make_model(tmp / "qwen3-0.6b", "qwen3-0.6b", variant="reranker")
        run(path, name="qwen3-0.6b bf16", dtype=torch.bfloat16, device=device, prompt_len=args.prompt_len, decode_tokens=args.decode_tokens,
            hf_decode_tokens=args.hf_decode_tokens, batch=args.batch, batch_new_tokens=args.batch_new_tokens, repeats=args.repeats,
            margin=args.margin, baseline=not args.no_baseline, decode_attention=args.decode_attention)
    print_summary(args.json)


if __name__ == "__main__":
    main()
