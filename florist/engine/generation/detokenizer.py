"""Incremental detokenization for streamed generation (no torch): token ids in, text deltas out.

Decoding tokens one at a time is wrong for byte-level BPE (a character may span tokens) and for
WordPiece (whether a space goes before a token depends on it). Instead decode a short window:

    ids      ... | prefix (already emitted) | new tokens |
                 ^ prefix_offset            ^ read_offset
    delta = decode(prefix + new)[len(decode(prefix)):]

and hold the delta back while it ends in U+FFFD (an incomplete UTF-8 sequence). The deltas
concatenate to decode(all ids) for the tokenizers florist serves; `finish()` flushes the rest.
"""

from __future__ import annotations

from typing import Iterable


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        """`tokenizer`: a Hugging Face `tokenizers.Tokenizer` (the one the prompt was made with)."""
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; returns the text they complete (possibly empty)."""
        self.ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def finish(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""
