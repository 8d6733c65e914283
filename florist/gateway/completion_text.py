"""The text of one completion choice, built from the engine's streamed chunks (no torch, no I/O).

    chunk.token_ids ──drop a final stop token──▶ IncrementalDetokenizer ──▶ stop strings ──▶ delta
                                                 (holds back a partial character)  (holds back a possible start)

Deltas concatenate to exactly the text the non-streaming answer has: decode(new ids without a
final stop token, skip_special_tokens=True), cut before the first stop string if one appears
(OpenAI leaves the stop string out). While the text ends in what could be the start of a stop
string, that part is held back, so a stop string split over chunks is never half sent.
"""

from __future__ import annotations

from florist.engine.generation.detokenizer import IncrementalDetokenizer
from florist.server.client import GeneratedTokens


class CompletionText:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: tuple[str, ...] = ()):
        self.detokenizer, self.stop = detokenizer, stop
        self.token_ids: list[int] = []   # every new id received, a final stop token included
        self.text = ""                   # what has been handed out so far
        self.finish_reason: str | None = None
        self._held = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, chunk: GeneratedTokens) -> str:
        """The text this chunk adds; sets `finish_reason` on the last chunk or at a stop string."""
        assert not self.finished, "a finished choice takes no more tokens"
        self.token_ids.extend(chunk.token_ids)
        ids = chunk.token_ids[:-1] if chunk.finish_reason == "stop" else chunk.token_ids  # EOS / stop id: no text
        text = self._held + self.detokenizer.push(ids)
        if chunk.finish_reason is not None:
            text += self.detokenizer.finish()
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.finish_reason, self._held, text = "stop", "", text[:cut]
        elif chunk.finish_reason is not None:
            self.finish_reason, self._held = chunk.finish_reason, ""
        else:
            keep = _possible_stop_start(text, self.stop)
            self._held, text = text[len(text) - keep:], text[: len(text) - keep]
        self.text += text
        return text


def _possible_stop_start(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a stop string begins with (0: none)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)
