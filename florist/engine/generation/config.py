"""Generation settings, fixed at start-up (a light module: the CLI and the scheduler import it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class GenerationConfig:
    """How the generation engine is laid out; every rank of a tensor-parallel group gets the same.

    `max_num_seqs` KV-cache slots of `max_model_len` tokens each are reserved at start-up
    (docs/generation.md: why slots and not pages). A sequence needs prompt + max_tokens <=
    max_model_len; at most `max_num_seqs` sequences run at once, the rest wait for a slot.
    """

    tensor_parallel_size: int = 1
    max_num_seqs: int = 32
    max_model_len: int | None = None  # None: the model's limit, at most DEFAULT_MAX_MODEL_LEN
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step (one longer prompt runs alone)
    cuda_graphs: bool = True  # decode steps from CUDA graphs (CUDA only)
    # Launch decode step N+1 before reading step N's ids while the running set stays the same
    # (generator.py); False: every step waits for the previous one's ids on the host.
    pipelined_decode: bool = True
    # Decode attention backend (florist.layers.cached_attention: "triton", "flash", "torch");
    # None picks "triton" on CUDA for fp16/bf16, else "torch".
    decode_attention: str | None = None

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1 or self.max_prefill_tokens < 1:
            raise ValueError("tensor_parallel_size, max_num_seqs and max_prefill_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one); got {self.max_model_len}")

    def model_len(self, model_max_len: int) -> int:
        """The slot length: max_model_len, or the model's limit capped at DEFAULT_MAX_MODEL_LEN."""
        if self.max_model_len is None:
            return min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {model_max_len} positions")
        return self.max_model_len
