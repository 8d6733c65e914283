"""From user input to token ids: prompts, templates, tokenization and truncation.

Shared by the embedded API and the gateway, so both apply exactly the same rules. Uses Hugging
Face `tokenizers` (its post-processor adds CLS/SEP or EOS); three tokenizer instances hold the
three truncation settings, because a tokenizer's settings are not thread-safe to flip per call.
"""

from __future__ import annotations

import json
import os
from typing import Literal, Sequence

import numpy as np
from tokenizers import Encoding, Tokenizer

from florist.config import ModelConfig, PipelineConfig
from florist.engine.model_dir import RERANKER_INSTRUCTION

Direction = Literal["right", "left"]
RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

# Long texts are tokenized in pieces of about PIECE_CHARS characters, cut at spaces, on the
# tokenizer's threads at once, where that gives the same ids as one call (`splits_at_spaces`).
SPLIT_CHARS = 1024
PIECE_CHARS = 640
MAX_PIECES = 16
# Normalizers that map each character on its own and keep a space a space; pre-tokenizers for
# which a space always ends a word. With only these, cutting a text at a space cannot change a
# word, so its pieces' tokens are the whole text's.
_PER_CHAR_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents"}
_SPACE_SPLIT_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}


def splits_at_spaces(tokenizer: Tokenizer) -> bool:
    """Whether cutting a text at a space (U+0020) and tokenizing the pieces without special
    tokens gives the whole text's tokens (BERT-style tokenizers: WordPiece behind a per-character
    normalizer and a whitespace / punctuation pre-tokenizer). Byte-level BPE (GPT-2, Qwen) glues
    a space to the word after it, so it is left whole."""
    # NOTE: each part's own state, not tokenizer.to_str(): that serializes the whole vocabulary
    # (~9 ms for BERT's 30k entries, far more for a 150k one) at every TextProcessor's start.
    def state(part):
        return None if part is None else json.loads(part.__getstate__())

    def all_of(node, allowed) -> bool:
        if node is None:
            return True
        if node.get("type") == "Sequence":
            return all(all_of(n, allowed) for n in node.get("normalizers", node.get("pretokenizers", [])))
        return node.get("type") in allowed

    pre_tokenizer = state(tokenizer.pre_tokenizer)
    if pre_tokenizer is None or not all_of(pre_tokenizer, _SPACE_SPLIT_PRE_TOKENIZERS):
        return False
    if not all_of(state(tokenizer.normalizer), _PER_CHAR_NORMALIZERS):
        return False
    # An added token is matched in the raw text before anything else: one with a space in it
    # could be cut in two.
    return not any(" " in t.content or t.content.isspace() for t in tokenizer.get_added_tokens_decoder().values())


def cut_at_spaces(text: str, piece_chars: int = PIECE_CHARS, max_pieces: int = MAX_PIECES) -> list[str]:
    """`text` in pieces of about `piece_chars` (at most `max_pieces`), each cut just before a
    space; a stretch without spaces stays in one piece. "".join(pieces) == text."""
    n = min(max_pieces, -(-len(text) // piece_chars))
    cuts = [0]
    for k in range(1, n):
        at = text.find(" ", max(cuts[-1] + 1, k * len(text) // n))
        if at < 0:
            break
        if at > cuts[-1]:
            cuts.append(at)
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


class InputError(ValueError):
    """A request we cannot serve; the message says what is wrong and what to do."""


class TextProcessor:
    def __init__(self, tokenizer_file: str, config: ModelConfig, pipeline: PipelineConfig):
        self.config, self.pipeline = config, pipeline
        self.max_tokens = pipeline.max_seq_length
        self._plain = self._load(tokenizer_file, None)
        self._trunc = {d: self._load(tokenizer_file, d) for d in ("right", "left")}
        self.identity = tokenizer_file
        # Texts longer than this are tokenized in pieces at once (None: never; the tokenizer must
        # split at spaces, `splits_at_spaces`).
        self.split_chars: int | None = SPLIT_CHARS if splits_at_spaces(self._plain) else None
        self.piece_chars = PIECE_CHARS
        # Only calls of at most this many texts are cut: with more, the batch call already keeps
        # the tokenizer's threads busy with whole texts, and cutting costs ~25 us of merging per
        # text (64 texts of 512 tokens: 19.2 -> 24.6 ms on two cores).
        self.split_max_texts = max(1, (os.cpu_count() or 2) // 2)

    def _load(self, path: str, direction: Direction | None) -> Tokenizer:
        tok = Tokenizer.from_file(path)
        tok.no_padding()
        if direction is None:
            tok.no_truncation()
        else:
            tok.enable_truncation(self.max_tokens, direction=direction)
        return tok

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    # -- prompts -------------------------------------------------------------------------------
    def resolve_prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        if prompt_name is not None and prompt is not None:
            raise InputError("give either prompt_name or prompt, not both")
        if prompt is not None:
            return prompt
        prompts = self.pipeline.prompt_dict
        if prompt_name is None:
            prompt_name = self.pipeline.default_prompt_name
            if prompt_name is None:
                return ""
        if prompt_name not in prompts:
            known = ", ".join(sorted(prompts)) or "none"
            raise InputError(f"unknown prompt_name {prompt_name!r}; this model's prompts: {known}")
        return prompts[prompt_name]

    # -- single texts --------------------------------------------------------------------------
    def encode(self, inputs: Sequence[str] | Sequence[Sequence[int]], *, prompt: str = "", truncate: bool = False, direction: Direction = "right",
               split: bool = True) -> list[np.ndarray]:
        """Strings or token-id lists -> int32 id arrays, validated against the model's limits.
        split: long texts may be tokenized in pieces on several threads (the same ids; False
        keeps each text in one call, e.g. when other threads have the cores already)."""
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise InputError("inputs must be a list of strings or a list of token-id lists")
        if len(inputs) == 0:
            raise InputError("inputs is empty; send at least one text")
        if all(isinstance(x, str) for x in inputs):
            return self._encode_texts(list(inputs), prompt, truncate, direction, split)  # type: ignore[arg-type]
        if all(isinstance(x, (list, tuple, np.ndarray)) for x in inputs):
            return [self._check_ids(i, ids, truncate, direction) for i, ids in enumerate(inputs)]
        bad = next(i for i, x in enumerate(inputs) if not isinstance(x, str))
        raise InputError(f"input {bad} is a {type(inputs[bad]).__name__}; inputs must all be strings or all token-id lists")

    def _encode_texts(self, texts: list[str], prompt: str, truncate: bool, direction: Direction, split: bool = True) -> list[np.ndarray]:
        for i, t in enumerate(texts):
            if not t:
                raise InputError(f"input {i} is an empty string; every input needs some text")
        if prompt:
            texts = [prompt + t for t in texts]
        if self.pipeline.do_lower_case:
            texts = [t.lower() for t in texts]
        tok = self._trunc[direction] if truncate else self._plain
        # NOTE: a batch call even for one text: it releases the GIL while it works and encode()
        # does not, so the gateway's tokenizer threads would stall its event loop. The _fast
        # variant skips the character offsets, which nothing here reads: the same ids in ~20 %
        # less time (a 600-token text: 1.21 -> 0.94 ms with all-MiniLM-L6-v2's tokenizer).
        if split and self.split_chars is not None and len(texts) <= self.split_max_texts and any(len(t) > self.split_chars for t in texts):
            out = self._encode_in_pieces(tok, texts)
        else:
            out = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(texts)]
        if not truncate:
            for i, ids in enumerate(out):
                if len(ids) > self.max_tokens:
                    raise InputError(
                        f"input {i} has {len(ids)} tokens; the model takes at most {self.max_tokens}; pass truncate=true to cut it"
                    )
        return out

    def _encode_in_pieces(self, tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
        """Long texts cut at spaces, every piece of every text in one batch call (the tokenizer
        runs a batch's inputs on its threads at once), each text's pieces merged and then
        post-processed as one encoding: its truncation, then its special tokens."""
        pieces = [cut_at_spaces(t, self.piece_chars) if len(t) > self.split_chars else [t] for t in texts]
        encs = tok.encode_batch_fast([p for ps in pieces for p in ps], add_special_tokens=False)
        out, k = [], 0
        for ps in pieces:
            merged = Encoding.merge(encs[k : k + len(ps)], growing_offsets=False)
            out.append(np.asarray(tok.post_process(merged).ids, dtype=np.int32))
            k += len(ps)
        return out

    def _check_ids(self, i: int, ids, truncate: bool, direction: Direction) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise InputError(f"input {i} must be a non-empty flat list of token ids")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"input {i} has non-integer token ids")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise InputError(f"input {i} has token id {int(arr.max() if arr.max() >= self.vocab_size else arr.min())} outside the vocabulary [0, {self.vocab_size})")
        if len(arr) > self.max_tokens:
            if not truncate:
                raise InputError(f"input {i} has {len(arr)} tokens; the model takes at most {self.max_tokens}; pass truncate=true to cut it")
            arr = arr[: self.max_tokens] if direction == "right" else arr[-self.max_tokens :]
        return arr.astype(np.int32)

    # -- (query, document) pairs ---------------------------------------------------------------
    def encode_pairs(self, query: str, documents: Sequence[str], *, truncate: bool = False, instruction: str | None = None) -> tuple[list[np.ndarray], list[int]]:
        """-> token ids per pair and the length of each pair's first segment (token type 0)."""
        if not isinstance(query, str) or not query:
            raise InputError("query must be a non-empty string")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or len(documents) == 0:
            raise InputError("documents must be a non-empty list of strings")
        for i, d in enumerate(documents):
            if not isinstance(d, str) or not d:
                raise InputError(f"document {i} must be a non-empty string")
        if self.pipeline.reranker_token_ids is not None:
            return self._encode_reranker(query, documents, truncate, instruction)
        tok = self._trunc["right"] if truncate else self._plain
        encs = tok.encode_batch_fast([(query, d) for d in documents])
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encs]
        first = [int(len(e.type_ids) - sum(e.type_ids)) for e in encs]
        self._check_lengths(ids, truncate, "pair")
        return ids, first

    def _encode_reranker(self, query: str, documents: Sequence[str], truncate: bool, instruction: str | None):
        instruction = instruction or RERANKER_INSTRUCTION
        prefix = self._plain.encode(RERANKER_PREFIX, add_special_tokens=False).ids
        suffix = self._plain.encode(RERANKER_SUFFIX, add_special_tokens=False).ids
        bodies = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in documents]
        budget = self.max_tokens - len(prefix) - len(suffix)
        ids = []
        for e in self._plain.encode_batch_fast(bodies, add_special_tokens=False):
            body = e.ids[:budget] if truncate else e.ids
            ids.append(np.asarray(prefix + body + suffix, dtype=np.int32))
        self._check_lengths(ids, truncate, "pair")
        return ids, [len(x) for x in ids]

    def _check_lengths(self, ids: list[np.ndarray], truncate: bool, what: str) -> None:
        if truncate:
            return
        for i, x in enumerate(ids):
            if len(x) > self.max_tokens:
                raise InputError(f"{what} {i} has {len(x)} tokens; the model takes at most {self.max_tokens}; pass truncate=true to cut it")

    def decode(self, ids: Sequence[int]) -> str:
        return self._plain.decode(list(ids), skip_special_tokens=True)
