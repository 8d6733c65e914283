"""Vocab-parallel argmax (torch path on CPU; Triton on CUDA when present) against torch.argmax.

The Triton kernels on CPU run under the interpreter in test_vocab_parallel_argmax_interpret.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from florist.kernels import vocab_parallel_argmax as vpa
from florist.layers.embedding import ParallelLMHead
from florist.layers.logits_processor import LogitsProcessor
from vocab_parallel_cases import KINDS, LAYOUTS, make_logits, split_into_shards

TPS = (1, 2, 3, 4, 8)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VOCABS = (131072, 32001)


def _check(full: torch.Tensor, tp: int, layout: str = "row_major", device: str = "cpu", **kw) -> None:
    shards, starts, num_valids = split_into_shards(full, tp, layout, device)
    got = vpa.simulated_vocab_parallel_argmax(shards, starts, num_valids, **kw)
    expected = torch.argmax(full, dim=-1)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(got.cpu(), expected), f"got {got.tolist()}, torch.argmax {expected.tolist()}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tp", TPS)
def test_matches_torch_argmax(tp, dtype, vocab, kind):
    _check(make_logits(kind, 5, vocab, tp, dtype, seed=tp * 1000 + vocab % 997), tp)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("tp", TPS)
def test_non_contiguous_shards(tp, layout, kind):
    _check(make_logits(kind, 3, 32001, tp, torch.bfloat16, seed=tp), tp, layout)


@pytest.mark.parametrize("rows", (1, 2, 7, 33, 64))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_rows(rows, dtype):
    full = make_logits("nan" if rows % 2 else "ties_across_shards", rows, 131072, 4, dtype, seed=rows)
    _check(full, 4)


@pytest.mark.parametrize("num_slices", (1, 3, 8, 64, 128))
@pytest.mark.parametrize("kind", ("nan", "ties_across_shards", "signed_zeros"))
def test_any_number_of_slices(num_slices, kind):
    _check(make_logits(kind, 4, 32001, 3, torch.float16, seed=num_slices), 3, num_slices=num_slices)


def test_candidates_layout():
    """[B, 2K]: values then global ids; an all-padding slice holds the sentinel (-inf, 2^24)."""
    shard = torch.tensor([[1.0, 5.0, 5.0, -0.0, 9.0, 9.0], [float("nan"), 2.0, float("nan"), 0.0, 3.0, 3.0]])
    cand = vpa.local_argmax_candidates_ref(shard, vocab_start=100, num_valid=4, num_slices=2)
    # slice_size rounds up to 64 columns, so slice 0 holds all 4 valid columns and slice 1 none
    sentinel = float(vpa.ID_LIMIT)
    assert cand[0].tolist() == [5.0, float("-inf"), 101.0, sentinel]
    assert torch.isnan(cand[1, 0]) and cand[1, 1:].tolist() == [float("-inf"), 100.0, sentinel]


def test_empty_shards_and_zero_rows():
    full = make_logits("random", 2, 65, 8, torch.float32, seed=0)  # 65 ids, shards of 64: ranks 2..7 empty
    shards, starts, num_valids = split_into_shards(full, 8)
    assert num_valids == [64, 1, 0, 0, 0, 0, 0, 0]
    _check(full, 8)
    _check(make_logits("all_neg_inf", 2, 65, 8, torch.float32, seed=0), 8)
    empty = torch.empty(0, 64)
    assert vpa.simulated_vocab_parallel_argmax([empty, empty], [0, 64], [64, 1]).shape == (0,)


def test_pick_defaults_to_the_tensor_parallel_size():
    full = make_logits("int_ties", 3, 1000, 1, torch.float32, seed=1)
    cand = vpa.local_argmax_candidates(full, 0, 1000)
    assert torch.equal(vpa.pick_from_candidates(cand), torch.argmax(full, -1))


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="2\\^24"):
        vpa.local_argmax_candidates(torch.zeros(1, 64), vocab_start=vpa.ID_LIMIT - 32, num_valid=64)
    with pytest.raises(ValueError, match="cast the logits to fp32"):
        vpa.local_argmax_candidates(torch.zeros(1, 64, dtype=torch.float64), 0, 64)
    with pytest.raises(ValueError, match="num_valid"):
        vpa.local_argmax_candidates(torch.zeros(1, 64), 0, 65)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        vpa.pick_from_candidates(torch.zeros(4, 16), 3)
    with pytest.raises(ValueError, match="empty vocabulary"):
        vpa.simulated_vocab_parallel_argmax([torch.zeros(1, 64)], [0], [0])


@pytest.mark.parametrize("vocab", (131072, 32001))
@pytest.mark.parametrize("soft_cap,scale", ((None, 1.0), (2.0, 0.5)))
def test_logits_processor_tp1(vocab, soft_cap, scale):
    g = torch.Generator().manual_seed(vocab)
    head = ParallelLMHead(vocab, 16).to(torch.bfloat16)
    # Negative logits everywhere, so the zero padding rows of the head would win if kept.
    full_weight = -torch.randint(1, 4, (vocab, 16), generator=g).to(torch.bfloat16)
    full_weight[vocab - 1] = 1  # ties between the last real id and nothing else
    head.weight_loader(head.weight, full_weight)
    proc = LogitsProcessor(head, vocab, soft_cap=soft_cap, scale=scale)
    hidden = torch.randint(0, 3, (6, 16), generator=g).to(torch.bfloat16)
    logits = proc.compute_logits(hidden)
    expected = F.linear(hidden, full_weight)
    if soft_cap is not None:
        expected = torch.tanh(expected / soft_cap) * soft_cap
    expected = expected * scale
    assert logits.shape == (6, vocab) and torch.equal(logits, expected)
    assert torch.equal(proc.get_top_tokens(hidden), torch.argmax(expected, -1))


@pytest.mark.gpu
def test_logits_processor_tp1_cuda_matches_argmax():
    """At TP 1 on CUDA get_top_tokens runs the candidate kernels: the same ids as torch.argmax."""
    g = torch.Generator().manual_seed(3)
    vocab = 151936
    head = ParallelLMHead(vocab, 64).to(torch.bfloat16).cuda()
    head.weight_loader(head.weight, torch.randn(vocab, 64, generator=g).to(torch.bfloat16).cuda())
    proc = LogitsProcessor(head, vocab)
    for rows in (1, 3, 32):
        hidden = torch.randn(rows, 64, generator=g).to(torch.bfloat16).cuda()
        hidden[0] = 0  # every logit 0: a tie across the vocabulary, the first id wins
        assert torch.equal(proc.get_top_tokens(hidden), torch.argmax(proc.compute_logits(hidden), -1))


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernels themselves, and a captured CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tp", TPS)
def test_kernels_on_gpu(tp, dtype, layout, kind):
    for vocab, rows in ((32001, 1), (32001, 7), (131072, 64 if layout == "row_major" else 3)):
        full = make_logits(kind, rows, vocab, tp, dtype, seed=rows + tp)
        shards, starts, num_valids = split_into_shards(full, tp, layout, "cuda")
        assert shards[0].stride() == split_into_shards(full, tp, layout)[0][0].stride()  # layout kept
        _check(full, tp, layout, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_slices", (1, 3, 8, 64))
def test_gpu_candidates_equal_reference_bitwise(num_slices):
    full = make_logits("nan", 9, 32001, 4, torch.bfloat16, seed=3)
    shards, starts, num_valids = split_into_shards(full, 4, "strided", "cuda")
    for shard, start, n in zip(shards, starts, num_valids):
        ref = vpa.local_argmax_candidates_ref(shard.cpu(), start, n, num_slices)
        got = vpa.local_argmax_candidates_triton(shard, start, n, num_slices).cpu()
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 8, 64))
def test_cuda_graph_replays(rows):
    tp, vocab = 4, 131072
    static = torch.empty(rows, vocab, dtype=torch.bfloat16, device="cuda")
    shards, starts, num_valids = split_into_shards(static.cpu(), tp)  # for the layout only
    size = shards[0].shape[1]
    run = lambda: vpa.simulated_vocab_parallel_argmax(  # noqa: E731
        [static[:, r * size : (r + 1) * size] for r in range(tp)], starts, num_valids)
    static.copy_(make_logits("random", rows, vocab, tp, torch.bfloat16, seed=0).cuda())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for i in range(50):
        full = make_logits(KINDS[i % len(KINDS)], rows, vocab, tp, torch.bfloat16, seed=100 + i)
        static.copy_(full.cuda())
        graph.replay()
        assert torch.equal(out.cpu(), torch.argmax(full, -1)), f"replay {i} ({KINDS[i % len(KINDS)]})"
