"""Random-weight models of the benchmark geometries, saved like real checkpoints.

Weights are drawn on the GPU when there is one (a 0.6B model takes seconds there), cast to the
benchmark dtype and saved with `save_pretrained`; a small WordPiece tokenizer stands in, since the
benchmarks send pre-tokenized ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import models as tiny  # noqa: E402  (tests/models.py: tokenizer and sentence-transformers files)

GEOMETRIES = {
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151669, max_position_embeddings=32768),
    "minilm-l6": dict(family="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                      vocab_size=30522, max_position_embeddings=512),
    "tiny-qwen3": dict(family="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=128, vocab_size=1000, max_position_embeddings=8192),
    "tiny-bert": dict(family="bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                      vocab_size=1000, max_position_embeddings=512),
}


def make_model(path: Path, geometry: str, *, variant: str = "embed", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """variant: "embed" (Qwen3: causal last-token; BERT: mean), "pplx" (bidirectional mean),
    "reranker" (Qwen3ForCausalLM), "cross-encoder" (BertForSequenceClassification)."""
    g = dict(GEOMETRIES[geometry])
    family = g.pop("family")
    vocab = g["vocab_size"]
    path.mkdir(parents=True, exist_ok=True)
    tiny.make_tokenizer(path, "bert" if family == "bert" else "qwen")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

        cfg = Qwen3Config(**g, rms_norm_eps=1e-6, tie_word_embeddings=True)
        cls = Qwen3ForCausalLM if variant == "reranker" else Qwen3Model
    else:
        from transformers import BertConfig, BertForSequenceClassification, BertModel

        cfg = BertConfig(**g, num_labels=1)
        cls = BertForSequenceClassification if variant == "cross-encoder" else BertModel
    with torch.device(device):
        model = cls(cfg, add_pooling_layer=False) if cls.__name__ == "BertModel" else cls(cfg)
    model.to(dtype).eval().save_pretrained(path)
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["vocab_size"] = vocab
    if variant == "pplx":
        cfg_json.update(model_type="bidirectional_pplx_qwen3", architectures=["PPLXQwen3Model"])
    (path / "config.json").write_text(json.dumps(cfg_json))
    if variant == "reranker":
        # Qwen3-Reranker reads as long inputs as its positions allow; the stand-in tokenizer's
        # config would otherwise cap pairs at 512 tokens, less than a 512-token document + template.
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        tok_cfg["model_max_length"] = g["max_position_embeddings"]
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if variant in ("embed", "pplx"):
        pooling = "lasttoken" if (family == "qwen3" and variant == "embed") else "mean"
        tiny._st_files(path, pooling, normalize=variant == "embed", max_len=g["max_position_embeddings"], dim=g["hidden_size"])
    return path


def shapes_arg(value: str) -> list[tuple[int, int]]:
    """'1x128,100x256' -> [(1, 128), (100, 256)]."""
    try:
        shapes = [tuple(int(x) for x in part.lower().split("x")) for part in value.split(",") if part]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{value!r}: expected BATCHxTOKENS[,BATCHxTOKENS...], e.g. 1x128,100x256")
    return shapes
