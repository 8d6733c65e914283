"""What `Engine.generate` returns per prompt."""

from __future__ import annotations

from dataclasses import dataclass

from florist.engine.generation.scheduler import Sequence


@dataclass(frozen=True)
class GenerationResult:
    """`token_ids`: the new tokens only, a final stop token (EOS or a stop id) included, as
    transformers' generate returns it; `text`: their decoded text without that stop token."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop id) or "length" (max_tokens)

    @classmethod
    def of(cls, seq: Sequence, text_processor) -> "GenerationResult":
        body = seq.output[:-1] if seq.finish_reason == "stop" else seq.output
        return cls(list(seq.prompt), list(seq.output), text_processor.decode(body), seq.finish_reason or "")
