"""Graph buckets pad a batch; padding must not change real outputs (checked on the CPU by running
the padded layout eagerly; the GPU tests replay real graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.batch import HostBatch, pack, to_device, views
from florist.engine.graph_runner import bucket, seq_bucket, token_bucket


def test_buckets():
    assert [token_bucket(n) for n in (1, 64, 65, 1024, 1025, 1280, 1281)] == [64, 64, 128, 1024, 1280, 1280, 1536]
    assert [seq_bucket(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [2, 4, 4, 8, 8, 16, 128]


def test_bucket_bounds_the_longest_sequence():
    assert bucket(HostBatch.from_sequences([[1] * 100] * 3)) == (320, 4, 128, False)
    assert bucket(HostBatch.from_sequences([[1] * 256] * 100)) == (25600, 128, 256, False)
    assert bucket(HostBatch.from_sequences([[1] * 10])) == (64, 2, 64, False)
    assert bucket(HostBatch.from_sequences([[1] * 4096])) == (4096, 2, 4096, True)
    assert bucket(HostBatch.from_sequences([[1] * 1000, [1] * 2])) == (1024, 4, 1024, False)


def test_pack_layout():
    host = HostBatch.from_sequences([[5, 6, 7], [8, 9]])
    buf = pack(host, 8, 4)
    ids, pos, seq, cu = buf[:8], buf[8:16], buf[16:24], buf[24:]
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert cu.tolist() == [0, 3, 5, 8, 8]
    with pytest.raises(ValueError, match="cannot hold"):
        pack(host, 6, 2)


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "pplx_dir", "cross_encoder_dir", "reranker_dir"])
def test_padded_batch_gives_the_same_rows(request, fixture):
    path = request.getfixturevalue(fixture)
    task = "score" if "reranker" in fixture else None
    engine = florist.Engine.from_pretrained(path, device="cpu", task=task)
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    for num_seqs in (1, 3, 5):
        seqs = [rng.integers(5, vocab, size=int(rng.integers(1, 40))) for _ in range(num_seqs)]
        first = [max(1, len(s) // 2) for s in seqs] if engine.info.family == "bert" else None
        host = HostBatch.from_sequences(seqs, first)
        ref = engine.runner.forward(to_device(host, torch.device("cpu")))
        tokens, seqs, max_seqlen, exact = bucket(host)
        padded = views(torch.from_numpy(pack(host, tokens, seqs)), tokens, seqs, host.token_type_ids is not None,
                       max_seqlen=max_seqlen, seq_lens_host=(), single_sequence=num_seqs == 1, has_padding=not exact)
        out = engine.runner.forward(padded)[:num_seqs]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
