"""Frozen, typed configuration.

`ModelConfig.from_hf` absorbs every Hugging Face quirk in one place; nothing mutates a config
after start-up. `PipelineConfig` describes what happens after the transformer (sentence-transformers
modules: pooling, Dense, Normalize, prompts) or, for scorers, how a score is read off the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

Family = Literal["bert", "qwen3"]
Task = Literal["embed", "score", "generate"]
PoolingMode = Literal["cls", "mean", "max", "lasttoken", "mean_sqrt_len"]

ARCHITECTURE_FAMILIES: dict[str, Family] = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForSequenceClassification": "bert",
    "Qwen3Model": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    "PPLXQwen3Model": "qwen3",
}
MODEL_TYPE_FAMILIES: dict[str, Family] = {
    "bert": "bert",
    "qwen3": "qwen3",
    "bidirectional_pplx_qwen3": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The model directory describes something florist cannot serve (says what and why)."""


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of the transformer, normalised from a Hugging Face `config.json`."""

    family: Family
    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    total_num_heads: int
    total_num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str
    causal: bool
    rope_theta: float = 10000.0
    type_vocab_size: int = 0
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_labels: int = 0
    position_embedding_type: str = "absolute"
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.total_num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.total_num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        architectures = hf.get("architectures") or []
        architecture = architectures[0] if architectures else ""
        family = MODEL_TYPE_FAMILIES.get(model_type) if model_type else ARCHITECTURE_FAMILIES.get(architecture)
        if family is None:
            supported = ", ".join(sorted(MODEL_TYPE_FAMILIES))
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architecture {architecture or 'unknown'!r}) is not "
                f"supported; florist serves model types: {supported}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        common = dict(
            family=family,
            model_type=model_type,
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            total_num_heads=num_heads,
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            hidden_act=str(hf.get("hidden_act", "gelu")),
            pad_token_id=hf.get("pad_token_id"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "qwen3")),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            raw=dict(hf),
        )
        if family == "bert":
            pos_type = hf.get("position_embedding_type", "absolute")
            if pos_type != "absolute":
                raise UnsupportedModelError(
                    f"BERT position_embedding_type {pos_type!r} is not supported (only 'absolute')"
                )
            if common["hidden_act"] not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
                raise UnsupportedModelError(f"BERT hidden_act {common['hidden_act']!r} is not supported")
            num_labels = 0
            if architecture == "BertForSequenceClassification":
                num_labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
            return cls(
                **common,
                total_num_kv_heads=num_heads,
                head_dim=hidden // num_heads,
                norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                causal=False,
                type_vocab_size=int(hf.get("type_vocab_size", 2)),
                num_labels=num_labels,
            )
        # Qwen3: head_dim is explicit (128 for 0.6B although hidden/heads = 64); rope_theta moved
        # into rope_parameters in newer transformers.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (only default RoPE)")
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
        return cls(
            **common,
            total_num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            causal=model_type != "bidirectional_pplx_qwen3",
            rope_theta=rope_theta,
            attention_bias=bool(hf.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class DenseConfig:
    """A sentence-transformers `Dense` module (`2_Dense/`)."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" | "tanh" | ...


@dataclass(frozen=True)
class PipelineConfig:
    """What turns hidden states into the output, read from the sentence-transformers files."""

    task: Task
    pooling: tuple[PoolingMode, ...] = ("mean",)
    dense: tuple[DenseConfig, ...] = ()
    normalize: bool = False
    max_seq_length: int = 512
    do_lower_case: bool = False
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"
    # Cross-encoder / reranker
    score_activation: Literal["identity", "sigmoid"] = "identity"
    reranker_token_ids: tuple[int, int] | None = None  # (yes, no) for the Qwen3 reranker
    # Encodings the model defines itself (pplx-embed); float is always available
    native_quantization: bool = False

    @property
    def prompt_dict(self) -> dict[str, str]:
        return dict(self.prompts)


def int_from_env(name: str, default: int) -> int:
    """A whole-number setting from the environment (the FLORIST_* switches of A/B runs); a value
    that is not one is refused with its name."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a whole number (default {default})") from None
