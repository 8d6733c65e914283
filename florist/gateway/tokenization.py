"""Tokenization off the event loop, and the TextProcessor the engines expect.

The gateway tokenizes with exactly the rules of the embedded API (florist.text.TextProcessor:
prompts, Qwen3 instructions and the reranker chat template, truncation, limits). Calls run on a
small thread pool: Hugging Face `tokenizers` releases the GIL while it encodes, so one
request's tokenization overlaps HTTP parsing and response writing for the others.

A long text that finds the pool idle is tokenized in pieces cut at spaces, all at once on the
tokenizer's own threads, where the tokenizer allows it (`florist.text.splits_at_spaces`: the same
ids); under load each text is one call, the pool's threads already sharing the cores.

A small call runs on the event loop instead, when the pool is idle: the hand-off to a pool
thread and back wakes two threads (~0.1 ms, more on a large idle machine), as much as
tokenizing a few hundred characters costs. "Small" is at most `inline_chars` characters (token
ids count 16 a sequence: they are only checked); under load the pool is busy, and every call
goes to it, so the loop keeps serving while the pool's threads tokenize in parallel.

The tokenizer must be the one the engines were loaded with: `load_text_processor` reads the
model directory (configs and tokenizer.json only, never weights) from --model or from the path
the engine reports in Info, and refuses a tokenizer whose sha256 differs from the engine's.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from florist.engine.generation.detokenizer import IncrementalDetokenizer
from florist.engine.model_dir import read_model_dir
from florist.gateway.errors import ApiError
from florist.text import InputError, TextProcessor


def load_text_processor(info, model: str | None) -> TextProcessor:
    """`info`: the engines' InfoResponse. `model`: a local copy of the model directory, or None
    to read the directory the engine reports (the same machine, or a shared file system)."""
    path = Path(model) if model else Path(info.tokenizer).parent
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"the engine serves {info.model_name} with the tokenizer {info.tokenizer}, which is not on this machine; "
            "pass --model DIR with a copy of the model directory"
        )
    md = read_model_dir(path, info.task)
    digest = hashlib.sha256(md.tokenizer_file.read_bytes()).hexdigest()
    if info.tokenizer_sha256 and digest != info.tokenizer_sha256:
        raise ValueError(f"{md.tokenizer_file} is not the tokenizer the engine uses (sha256 {digest[:12]}... vs {info.tokenizer_sha256[:12]}...); pass the engine's model directory as --model")
    if md.pipeline.max_seq_length != info.max_input_tokens:
        raise ValueError(f"{path} takes {md.pipeline.max_seq_length} tokens per input but the engine takes {info.max_input_tokens}; pass the engine's model directory as --model")
    return TextProcessor(str(md.tokenizer_file), md.config, md.pipeline)


IDS_CHARS = 16  # what checking one token-id sequence costs, in characters tokenized


def cost_chars(inputs, prompt: str = "") -> int:
    """Characters `TextProcessor.encode(inputs, prompt=prompt)` tokenizes (the inline rule's measure)."""
    return sum(len(x) + len(prompt) if isinstance(x, str) else IDS_CHARS for x in inputs)


class Tokenization:
    def __init__(self, processor: TextProcessor, workers: int, *, inline_chars: int = 0):
        self.processor = processor
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="florist-tokenize")
        self.inline_chars = inline_chars
        self.on_pool = 0  # calls on the pool now
        # /tokenize reports offsets; a tokenizer of its own, so the processor's stay untouched.
        self._detailed = Tokenizer.from_file(processor.identity)
        self._detailed.no_truncation()
        self._detailed.no_padding()

    async def run(self, fn, *args, chars: int | None = None, **kwargs):
        """fn(*args, **kwargs) on the pool, or right here if it tokenizes at most `inline_chars`
        characters (`chars`; None: not small) and the pool is idle; InputError becomes a 400."""
        try:
            if chars is not None and chars <= self.inline_chars and self.on_pool == 0:
                return fn(*args, **kwargs)
            self.on_pool += 1
            try:
                return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))
            finally:
                self.on_pool -= 1
        except InputError as e:
            raise ApiError(400, str(e)) from None

    async def encode(self, inputs, *, prompt: str, truncate: bool, direction: str):
        # A long text alone in this worker is tokenized in pieces on the tokenizer's own threads
        # (florist.text, same ids); under load the pool's threads have the cores already.
        return await self.run(self.processor.encode, inputs, prompt=prompt, truncate=truncate, direction=direction, split=self.on_pool == 0,
                              chars=cost_chars(inputs, prompt))

    async def detailed(self, texts: list[str], *, add_special_tokens: bool):
        """Per text: [(id, token text, special, start, stop)] with character offsets."""
        return await self.run(self._detailed_sync, texts, add_special_tokens)

    def _detailed_sync(self, texts: list[str], add_special_tokens: bool):
        out = []
        for text, enc in zip(texts, self._detailed.encode_batch(texts, add_special_tokens=add_special_tokens)):
            out.append([
                (i, tok if special else text[a:b], bool(special), a, b)
                for i, tok, special, (a, b) in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets)
            ])
        return out

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return self._detailed.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> IncrementalDetokenizer:
        """Text deltas of one generated stream; the same text `decode(ids, skip_special_tokens=True)` gives."""
        return IncrementalDetokenizer(self._detailed)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
