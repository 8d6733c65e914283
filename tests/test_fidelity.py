"""Embeddings and scores against the reference implementations on the same weights (CPU, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.model_dir import default_model_path

TEXTS = [
    "hello world",
    "a",
    "Flowers need water, sun and good soil.",
    "What is the fastest search engine for embeddings?",
    "naïve café résumé — unicode: 你好, мир, 🌷🌹",
    "the rose and the tulip " * 20,
    "Short.",
    "rain",
    "Which green seeds grow fast in small gardens when the rain is slow?",
    "big red flower",
    " leading and trailing spaces   ",
    "numbers 12345 and symbols #$%&",
] + [f"document number {i}: " + "garden " * (i * 7 % 40) for i in range(24)]
LONG = ["water the garden every day " * 100, "seed " * 600]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_default_model_matches_sentence_transformers(default_engine):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(default_model_path()), device="cpu")
    ref = st.encode(TEXTS + LONG, batch_size=16)
    ours = np.concatenate([default_engine.embed(TEXTS), default_engine.embed(LONG, truncate=True)])
    assert ours.shape == ref.shape == (len(TEXTS) + 2, 384)
    assert cosine(ours, ref).min() >= 0.99999


def test_default_model_single_and_batched_agree(default_engine):
    batched = default_engine.embed(TEXTS)
    single = np.concatenate([default_engine.embed([t]) for t in TEXTS[:6]])
    assert cosine(batched[:6], single).min() >= 0.999999


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "cls+mean"])
def test_bert_embedder(tmp_path, pooling):
    from sentence_transformers import SentenceTransformer

    import models as tiny

    path = tiny.make_bert_embedder(tmp_path / pooling, pooling=pooling)
    ref = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    ours = florist.Engine.from_pretrained(path, device="cpu").embed(TEXTS, truncate=True)
    assert ours.shape == ref.shape
    assert cosine(ours, ref).min() >= 0.9999


def test_bert_prompts_match_sentence_transformers(bert_dir):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(bert_dir), device="cpu").encode(TEXTS[:8], prompt_name="query")
    ours = florist.Engine.from_pretrained(bert_dir, device="cpu").embed(TEXTS[:8], prompt_name="query", truncate=True)
    assert cosine(ours, ref).min() >= 0.9999


def test_cross_encoder(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    docs = TEXTS[:20]
    ref = CrossEncoder(str(cross_encoder_dir), device="cpu").predict([("which flower needs sun", d) for d in docs])
    ours = florist.Engine.from_pretrained(cross_encoder_dir, device="cpu").score("which flower needs sun", docs)
    # This model's scores lie within ~1e-4 of each other (tests/models.py), so 1e-4 would pass any pairing.
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


def test_qwen3_embedder_causal_last_token(qwen3_dir):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(qwen3_dir), device="cpu").encode(TEXTS, prompt_name="query")
    ours = florist.Engine.from_pretrained(qwen3_dir, device="cpu").embed(TEXTS, prompt_name="query", truncate=True)
    assert cosine(ours, ref).min() >= 0.9999


def _bidirectional_reference(path, ids: list[np.ndarray], bidirectional: bool = True) -> np.ndarray:
    """transformers' Qwen3Model with every layer's attention made non-causal, one sequence at a
    time (so the mask is padding-only, i.e. empty), mean pooled: what pplx-embed's code does."""
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(path, attn_implementation="sdpa").eval()
    for layer in model.layers:
        layer.self_attn.is_causal = not bidirectional
    with torch.no_grad():
        return np.stack([model(input_ids=torch.tensor(x[None], dtype=torch.long)).last_hidden_state[0].mean(0).numpy() for x in ids])


def test_pplx_bidirectional_mean(pplx_dir):
    engine = florist.Engine.from_pretrained(pplx_dir, device="cpu")
    ids = engine.text.encode(TEXTS, truncate=True)
    ref = _bidirectional_reference(pplx_dir, ids)
    ours = engine.embed(TEXTS, truncate=True)
    assert cosine(ours, ref).min() >= 0.9999
    # The check can fail: causal attention on the same weights gives clearly different vectors.
    causal_ref = _bidirectional_reference(pplx_dir, ids, bidirectional=False)
    assert cosine(ours, causal_ref).min() < 0.999


def test_pplx_int8_and_binary(pplx_dir):
    engine = florist.Engine.from_pretrained(pplx_dir, device="cpu")
    floats = engine.embed(TEXTS, normalize=False, truncate=True)
    q = engine.embed(TEXTS, encoding="int8", truncate=True)
    assert q.dtype == np.int8
    np.testing.assert_array_equal(q, np.clip(np.rint(np.tanh(floats) * 127), -128, 127).astype(np.int8))
    ub = engine.embed(TEXTS, encoding="ubinary", truncate=True)
    np.testing.assert_array_equal(ub, np.packbits(floats > 0, axis=1))
    b = engine.embed(TEXTS, encoding="binary", truncate=True)
    np.testing.assert_array_equal(b.astype(np.int16) + 128, ub)


def test_qwen3_reranker(reranker_dir):
    from transformers import Qwen3ForCausalLM

    engine = florist.Engine.from_pretrained(reranker_dir, device="cpu", task="score")
    docs = TEXTS[:10]
    # The input as Qwen3-Reranker's model card builds it (not the engine's own template code).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(reranker_dir / "tokenizer.json"))
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. "
              'Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    head, tail = tok.encode(prefix, add_special_tokens=False).ids, tok.encode(suffix, add_special_tokens=False).ids
    budget = engine.text.max_tokens - len(head) - len(tail)  # truncate=True cuts the body only
    ids = [head + tok.encode(f"<Instruct>: {instruction}\n<Query>: which flower needs sun\n<Document>: {d}", add_special_tokens=False).ids[:budget] + tail
           for d in docs]
    assert [x.tolist() for x in engine.text.encode_pairs("which flower needs sun", docs, truncate=True)[0]] == ids
    model = Qwen3ForCausalLM.from_pretrained(reranker_dir).eval()
    yes, no = engine.model_dir.pipeline.reranker_token_ids
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([x], dtype=torch.long)).logits[0, -1] for x in ids]
    ref = np.array([torch.sigmoid(lg[yes] - lg[no]).item() for lg in logits])
    np.testing.assert_allclose(engine.score("which flower needs sun", docs, truncate=True), ref, atol=1e-4)


def test_matryoshka_dimensions_renormalise(default_engine):
    full = default_engine.embed(TEXTS[:4])
    cut = default_engine.embed(TEXTS[:4], dimensions=64)
    ref = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, ref, atol=1e-6)
    raw = default_engine.embed(TEXTS[:4], normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
