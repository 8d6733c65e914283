"""The final layer computed for each sequence's last token only (Qwen3Model.last_token_only):
same rows as the full model, for ragged, equal-length and padded batches."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import florist
from florist.engine.batch import HostBatch, to_device
from florist.layers.attention import last_token_attention


def _full_attention_last_rows(q, k, v, lens, causal):
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)
        out.append(o[0, :, -1])
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("lens", [[5, 1, 9], [4, 4, 4], [7]])
@pytest.mark.parametrize("causal", [True, False])
def test_last_token_attention_is_the_last_row_of_full_attention(lens, causal):
    g = torch.Generator().manual_seed(sum(lens))
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
    host = HostBatch.from_sequences([np.zeros(n, dtype=np.int32) for n in lens])
    batch = to_device(host, torch.device("cpu"))
    want = _full_attention_last_rows(q, k, v, lens, causal)
    # As built (dense SDPA when the lengths are equal), and forced onto the gathered, masked path.
    for b in (batch, replace(batch, uniform_seqlen=0)):
        got = last_token_attention(q[b.last_token_index()], k, v, b, 16**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("full_attention_tokens", [128, 0], ids=["whole-attention-last-rows", "last-queries-alone"])
@pytest.mark.parametrize("fixture", ["qwen3_dir", "reranker_dir"])
def test_last_token_only_model_equals_the_full_model(request, fixture, full_attention_tokens, monkeypatch):
    """Both ways the final layer's attention can run for the last tokens: the whole attention and
    its last rows (few tokens), or the last queries alone (`last_token_attention`)."""
    import florist.layers.attention as attention

    monkeypatch.setattr(attention, "LAST_TOKEN_FULL_ATTENTION_TOKENS", full_attention_tokens)
    task = "score" if fixture == "reranker_dir" else None
    engine = florist.Engine.from_pretrained(request.getfixturevalue(fixture), device="cpu", task=task)
    model = engine.runner.model.model
    assert model.last_token_only, "last-token pooling and the yes/no head read only the last token"
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    for lens in ([3, 17, 1, 8], [6, 6, 6], [11]):
        host = HostBatch.from_sequences([rng.integers(5, vocab, size=n).astype(np.int32) for n in lens])
        fast = engine.runner.forward(to_device(host, torch.device("cpu")))
        model.last_token_only = False
        try:
            full = engine.runner.forward(to_device(host, torch.device("cpu")))
        finally:
            model.last_token_only = True
        torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)


def test_mean_pooling_keeps_every_token(pplx_dir):
    engine = florist.Engine.from_pretrained(pplx_dir, device="cpu")
    assert not engine.runner.model.model.last_token_only


def test_last_rows_of_one_token_sequences_are_the_rows_themselves():
    """RaggedBatch.last_rows: no gather where every sequence is one token (the head of a
    last-token model), the rows at each sequence's end otherwise, padded batches included."""
    hidden = torch.arange(12.0).reshape(6, 2)
    ones = to_device(HostBatch.from_sequences([np.zeros(1, dtype=np.int32)] * 6), torch.device("cpu"))
    assert ones.last_rows(hidden) is hidden
    ragged = to_device(HostBatch.from_sequences([np.zeros(n, dtype=np.int32) for n in (2, 1, 3)]), torch.device("cpu"))
    torch.testing.assert_close(ragged.last_rows(hidden), hidden[[1, 2, 5]])
    first_three = hidden[:3]  # a last-token model's [B, H] output
    assert ragged.one_token_per_seq().last_rows(first_three) is first_three
