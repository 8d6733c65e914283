"""Graph buckets pad a batch; padding must not change real outputs (checked on the CPU by running
the padded layout eagerly; the GPU tests replay real graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.batch import HostBatch, pack, packed_size, to_device, views
from florist.engine.graph_runner import bucket, covers, seq_bucket, token_bucket


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


def test_pack_spreads_padding_over_dummies_no_longer_than_asked():
    host = HostBatch.from_sequences([[5, 6, 7], [8, 9]])
    buf = pack(host, 12, 5, longest=3)
    ids, pos, seq, cu = buf[:12], buf[12:24], buf[24:36], buf[36:]
    assert ids.tolist() == [5, 6, 7, 8, 9] + [0] * 7
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2, 0]
    assert seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert cu.tolist() == [0, 3, 5, 8, 11, 12]
    assert pack(host, 8, 4, longest=3).tolist() == pack(host, 8, 4).tolist()  # one dummy fits: as before
    with pytest.raises(ValueError, match="at most 3 tokens each"):
        pack(host, 12, 4, longest=3)  # 7 padding tokens need three dummies of <= 3


def _pack_reference(host: HostBatch, tb: int, bb: int, longest: int | None) -> list[int]:
    """pack's layout written out sequence by sequence, the padding in dummies of <= longest."""
    lens = host.seq_lens.tolist()
    pad = tb - sum(lens)
    step = max(longest or pad, 1)
    dummies = [min(step, pad - k * step) for k in range(-(-pad // step))]
    ids = host.input_ids.tolist() + [0] * pad
    pos = [p for n in lens + dummies for p in range(n)]
    seq = [b for b, n in enumerate(lens + dummies) for _ in range(n)]
    cu = np.cumsum([0] + lens + dummies).tolist()
    types = [] if host.token_type_ids is None else host.token_type_ids.tolist() + [0] * pad
    return ids + pos + seq + types + cu + [tb] * (bb + 1 - len(cu))


def test_pack_matches_a_plain_layout_on_random_batches():
    """One sequence (the batch-1 fast path), several, no padding, one dummy and many, with and
    without token types, into a reused buffer as the staging does."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        num_seqs = 1 if trial % 3 == 0 else int(rng.integers(1, 6))
        seqs = [rng.integers(1, 1000, size=int(rng.integers(1, 50))) for _ in range(num_seqs)]
        first = [int(rng.integers(1, len(x) + 1)) for x in seqs] if trial % 2 else None
        host = HostBatch.from_sequences(seqs, first)
        t = host.num_tokens
        pad = [0, int(rng.integers(1, 80))][trial % 4 != 1]
        longest = None if trial % 5 == 0 else int(rng.integers(max(1, host.max_seqlen), host.max_seqlen + 40))
        dummies = -(-pad // max(longest or pad, 1))
        bb = num_seqs + dummies + int(rng.integers(0, 3))
        out = np.full(packed_size(t + pad, bb, first is not None), -1, dtype=np.int32)
        got = pack(host, t + pad, bb, out=out, longest=longest)
        assert got is out
        assert got.tolist() == _pack_reference(host, t + pad, bb, longest), (trial, host.seq_lens.tolist(), pad, bb, longest)


def test_which_graphs_cover_a_batch():
    key = (320, 4, 128, False)  # 3 x 100 tokens
    assert covers((512, 8, 128, False), key, 300, 3, 100)  # 212 padding tokens: two dummies
    assert covers((384, 4, 128, False), key, 300, 3, 100)  # 84: one dummy, the last slot
    assert not covers((512, 4, 128, False), key, 300, 3, 100)  # two dummies, one slot left
    assert not covers((768, 16, 128, False), key, 300, 3, 100)  # more than twice the bucket's tokens
    assert not covers((512, 8, 64, False), key, 300, 3, 100)  # a sequence longer than the graph's longest
    assert not covers((256, 8, 128, False), key, 300, 3, 100)  # too few tokens
    assert not covers(key, key, 300, 3, 100)
    assert not covers((384, 2, 384, True), (320, 2, 512, False), 300, 1, 300)  # an unpadded graph runs its own shape only
    assert covers((384, 2, 512, False), (320, 2, 512, False), 300, 1, 300)  # one sequence in a one-sequence graph
    assert not covers((384, 2, 512, False), (320, 4, 256, False), 300, 2, 200)  # two in a one-sequence graph: never


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


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "pplx_dir", "cross_encoder_dir", "reranker_dir"])
def test_a_covering_layout_gives_the_same_rows(request, fixture):
    """A batch run in a larger graph bucket (graph_runner: covering), its padding over several dummies."""
    path = request.getfixturevalue(fixture)
    engine = florist.Engine.from_pretrained(path, device="cpu", task="score" if "reranker" in fixture else None)
    rng = np.random.default_rng(1)
    for num_seqs in (1, 3):
        seqs = [rng.integers(5, engine.info.vocab_size, size=int(rng.integers(20, 60))) for _ in range(num_seqs)]
        first = [max(1, len(s) // 2) for s in seqs] if engine.info.family == "bert" else None
        host = HostBatch.from_sequences(seqs, first)
        ref = engine.runner.forward(to_device(host, torch.device("cpu")))
        key = bucket(host)
        cover = (2 * key[0], 8, 64, False) if num_seqs > 1 else (key[0] + 64, 2, 128, False)
        assert covers(cover, key, host.num_tokens, num_seqs, host.max_seqlen)
        tokens, seqs_, longest, _ = cover
        padded = views(torch.from_numpy(pack(host, tokens, seqs_, longest=longest)), tokens, seqs_, host.token_type_ids is not None,
                       max_seqlen=longest, seq_lens_host=(), single_sequence=seqs_ == 2, has_padding=True)
        out = engine.runner.forward(padded)[:num_seqs]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
