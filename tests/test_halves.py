"""A big batch as two halves side by side (graph_runner.py, "Halves"): the cut, the shared
bucket, the packed layout with its row map, and the rows they give (on the CPU, where the halves
run one after the other; tests/test_gpu.py replays them on two streams)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.batch import HostBatch, pack, packed_size, to_device
from florist.engine.graph_runner import GraphRunner, bucket, halves, halves_forward, halves_key, halves_size, pack_halves


def _host(rng, sizes, types: bool = False) -> HostBatch:
    seqs = [rng.integers(5, 1000, size=n) for n in sizes]
    return HostBatch.from_sequences(seqs, [max(1, n // 2) for n in sizes] if types else None)


def test_halves_cut_where_the_tokens_are_closest_to_halved():
    rng = np.random.default_rng(0)
    for trial in range(200):
        sizes = [int(x) for x in rng.integers(1, 300, size=int(rng.integers(2, 40)))]
        host = _host(rng, sizes, types=trial % 2 == 1)
        first, second = halves(host)
        k = first.num_seqs
        assert 1 <= k < host.num_seqs and first.num_seqs + second.num_seqs == host.num_seqs
        assert first.seq_lens.tolist() == sizes[:k] and second.seq_lens.tolist() == sizes[k:]
        assert np.concatenate([first.input_ids, second.input_ids]).tolist() == host.input_ids.tolist()
        if host.token_type_ids is not None:
            assert np.concatenate([first.token_type_ids, second.token_type_ids]).tolist() == host.token_type_ids.tolist()
        else:
            assert first.token_type_ids is None and second.token_type_ids is None
        best = min(abs(2 * sum(sizes[:j]) - host.num_tokens) for j in range(1, len(sizes)))
        assert abs(2 * first.num_tokens - host.num_tokens) == best, (sizes, k)
    with pytest.raises(AssertionError, match="two sequences"):
        halves(_host(rng, [10]))


def test_both_halves_fit_the_shared_bucket_with_one_dummy_each():
    rng = np.random.default_rng(1)
    for trial in range(200):
        sizes = [int(x) for x in rng.integers(1, 512, size=int(rng.integers(2, 120)))]
        host = _host(rng, sizes)
        first, second = halves(host)
        tokens, seqs, longest, exact, parts = key = halves_key(first, second)
        assert (exact, parts) == (False, 2) and seqs > max(first.num_seqs, second.num_seqs)
        for half in (first, second):
            assert half.num_tokens <= tokens and half.max_seqlen <= longest and tokens - half.num_tokens <= longest
            pack(half, tokens, seqs, longest=longest)  # raises if it does not fit
        assert key == halves_key(*halves(host))  # a function of the batch alone


def test_packed_halves_hold_each_half_and_the_row_map():
    rng = np.random.default_rng(2)
    host = _host(rng, [100, 30, 70, 90, 10], types=True)
    first, second = halves(host)
    assert (first.num_seqs, second.num_seqs) == (2, 3)
    key = halves_key(first, second)
    tokens, seqs, longest = key[:3]
    buf = pack_halves(first, second, key, with_types=True)
    n = packed_size(tokens, seqs, True)
    assert buf.shape == (halves_size(key, True),) == (2 * n + 2 * seqs,)
    assert buf[:n].tolist() == pack(first, tokens, seqs, longest=longest).tolist()
    assert buf[n : 2 * n].tolist() == pack(second, tokens, seqs, longest=longest).tolist()
    assert buf[2 * n :].tolist() == [0, 1, seqs, seqs + 1, seqs + 2] + [0] * (2 * seqs - 5)


@pytest.mark.parametrize("fixture", ["bert_dir", "qwen3_dir", "cross_encoder_dir", "reranker_dir"])
def test_halves_give_the_batch_rows_in_order(request, fixture):
    path = request.getfixturevalue(fixture)
    engine = florist.Engine.from_pretrained(path, device="cpu", task="score" if "reranker" in fixture else None)
    bert = engine.info.family == "bert"
    rng = np.random.default_rng(3)
    for sizes in ([7, 40, 3], [20, 20], [1, 60, 2, 2, 33, 9]):
        seqs = [rng.integers(5, engine.info.vocab_size, size=n) for n in sizes]
        host = HostBatch.from_sequences(seqs, [max(1, n // 2) for n in sizes] if bert else None)
        ref = engine.runner.forward(to_device(host, torch.device("cpu")))
        first, second = halves(host)
        key = halves_key(first, second)
        packed = torch.from_numpy(pack_halves(first, second, key, bert))
        out = halves_forward(engine.runner.forward, key, bert, side=None)(packed)
        assert out.shape[0] == 2 * key[1]
        torch.testing.assert_close(out[: len(sizes)], ref, atol=1e-5, rtol=1e-5)


def test_the_runner_takes_halves_from_its_threshold(bert_dir):
    """GraphRunner.run's halves path (a first sight here: on the CPU nothing is captured), and
    whole batches below the threshold or of one sequence."""
    engine = florist.Engine.from_pretrained(bert_dir, device="cpu")
    forward = engine.runner.forward
    runner = GraphRunner(forward, torch.device("cpu"), max_tokens=4096, with_token_types=True, split_min_tokens=64)
    rng = np.random.default_rng(4)
    halves_seen = lambda: sum(len(k) == 5 for k in runner.seen)  # noqa: E731
    for sizes, split in (([30, 40, 50], True), ([10, 20], False), ([100], False), ([64, 1], True)):
        host = HostBatch.from_sequences([rng.integers(5, engine.info.vocab_size, size=n) for n in sizes])
        before = halves_seen()
        out = runner.run(host)
        torch.testing.assert_close(out, forward(to_device(runner._with_token_types(host), torch.device("cpu"))), atol=1e-5, rtol=1e-5)
        assert halves_seen() == before + split, sizes
    assert runner.stats()["split_min_tokens"] == 64
    # logged as the batch it runs: both halves' tokens and sequences (the dummies' slots left out)
    assert runner.log_fields((128, 4, 128, False, 2)) == (256, 6, 128) and runner.log_fields((128, 4, 128, False)) == (128, 3, 128)


def test_the_threshold_by_family_and_from_the_environment(bert_dir, qwen3_dir, monkeypatch):
    from florist.engine.model_dir import read_model_dir
    from florist.engine.runner import BERT_SPLIT_MIN_TOKENS, default_split_min_tokens

    bert, qwen = read_model_dir(bert_dir).config, read_model_dir(qwen3_dir).config
    monkeypatch.delenv("FLORIST_GRAPH_SPLIT_MIN_TOKENS", raising=False)
    assert (default_split_min_tokens(bert), default_split_min_tokens(qwen)) == (BERT_SPLIT_MIN_TOKENS, 0)
    monkeypatch.setenv("FLORIST_GRAPH_SPLIT_MIN_TOKENS", "0")
    assert default_split_min_tokens(bert) == 0
    monkeypatch.setenv("FLORIST_GRAPH_SPLIT_MIN_TOKENS", "2048")
    assert (default_split_min_tokens(bert), default_split_min_tokens(qwen)) == (2048, 2048)


def test_halves_run_from_a_graph_up_to_twice_its_token_bound(bert_dir):
    """`max_tokens` bounds a half: a halves batch of up to twice as many tokens still takes the
    graph path, unless its larger half is over the bound; other batches keep the bound."""
    engine = florist.Engine.from_pretrained(bert_dir, device="cpu")
    runner = GraphRunner(engine.runner.forward, torch.device("cpu"), max_tokens=128, with_token_types=True, split_min_tokens=64)

    def host(sizes):
        return HostBatch.from_sequences([np.full(n, 7) for n in sizes])

    assert runner.applies(host([60] * 4))  # 240 tokens: halves of 120
    assert not runner.applies(host([60] * 5))  # 300: more than twice the bound
    assert not runner.applies(host([100, 90, 50]))  # 240, but its larger half holds 140
    assert not runner.applies(host([200]))  # one sequence: no halves
    runner.split_min_tokens = 0
    assert not runner.applies(host([60] * 4)) and runner.applies(host([64, 64]))


def test_a_captured_halves_graph_covers_halves_it_holds(bert_dir):
    """Halves cover only halves, half by half by `covers`' rule; a covering layout gives the batch's
    rows (its halves padded over several dummies)."""
    from florist.engine.graph_runner import covers

    engine = florist.Engine.from_pretrained(bert_dir, device="cpu")
    runner = GraphRunner(engine.runner.forward, torch.device("cpu"), max_tokens=4096, with_token_types=True, split_min_tokens=64)
    rng = np.random.default_rng(5)

    def host(sizes):
        seqs = [rng.integers(5, engine.info.vocab_size, size=n) for n in sizes]
        return HostBatch.from_sequences(seqs, [max(1, n // 2) for n in sizes])

    big = host([60] * 6)  # halves of 3 x 60: bucket (192, 4, 64)
    assert halves_key(*halves(big)) == (192, 4, 64, False, 2)
    runner.graphs[(192, 4, 64, False, 2)] = object()  # as if captured
    runner.graphs[(512, 8, 128, False)] = object()  # a whole-batch graph never covers halves
    a = halves(host([40, 50, 30, 45]))  # halves 90 | 75 in bucket (128, 4, 64): two dummies each fit
    b = halves(host([30] * 6))  # halves 90 | 90 of three sequences: two dummies do not fit 4 slots
    c = halves(host([30, 100]))  # a sequence longer than 64
    assert runner._cover(halves_key(*a), a) == (192, 4, 64, False, 2)
    assert runner._cover(halves_key(*b), b) is None and runner._cover(halves_key(*c), c) is None
    whole = host([100, 100, 60])  # a whole batch takes a whole-batch graph only
    assert runner._cover(bucket(whole), (whole,)) == (512, 8, 128, False)
    runner.graphs[(192, 8, 64, False, 2)] = object()
    assert runner._cover(halves_key(*a), a) == (192, 4, 64, False, 2)  # fewest tokens, then sequences
    cover = runner._cover(halves_key(*b), b)
    assert cover == (192, 8, 64, False, 2)
    assert all(covers(cover[:4], halves_key(*b)[:4], h.num_tokens, h.num_seqs, h.max_seqlen) for h in b)
    packed = torch.from_numpy(pack_halves(*b, cover, True))
    out = halves_forward(engine.runner.forward, cover, True, side=None)(packed)
    whole = HostBatch(np.concatenate([b[0].input_ids, b[1].input_ids]), np.concatenate([b[0].seq_lens, b[1].seq_lens]),
                      np.concatenate([b[0].token_type_ids, b[1].token_type_ids]))
    torch.testing.assert_close(out[:6], engine.runner.forward(to_device(whole, torch.device("cpu"))), atol=1e-5, rtol=1e-5)
