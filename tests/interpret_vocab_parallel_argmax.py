"""The vocab-parallel argmax Triton kernels under Triton's interpreter (CPU).

Not collected directly (no test_ prefix): test_vocab_parallel_argmax_interpret.py runs this file in
a fresh `python -m pytest` with TRITON_INTERPRET=1, because Triton picks the interpreter when a
kernel is decorated, i.e. at import. The interpreter runs ~100 programs a second, so every case
keeps rows x slices x ranks small.
"""

from __future__ import annotations

import os

import pytest
import torch

from florist.kernels import vocab_parallel_argmax as vpa
from vocab_parallel_cases import KINDS, make_logits, split_into_shards

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_vocab_parallel_argmax_interpret.py"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(full, tp, layout="row_major", num_slices=4):
    shards, starts, num_valids = split_into_shards(full, tp, layout)
    for shard, start, n in zip(shards, starts, num_valids):
        # The kernel's candidates are the reference's, bit for bit (NaN payload and sentinel too).
        got = vpa.local_argmax_candidates_triton(shard, start, n, num_slices)
        ref = vpa.local_argmax_candidates_ref(shard, start, n, num_slices)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"shard at {start}: {got} != {ref}"
    ids = vpa.simulated_vocab_parallel_argmax(shards, starts, num_valids, num_slices=num_slices, use_kernel=True)
    assert torch.equal(ids, torch.argmax(full, -1)), f"got {ids.tolist()}, torch.argmax {torch.argmax(full, -1).tolist()}"


@pytest.mark.parametrize("kind", KINDS)
def test_kinds_tp3_padded_vocab(kind):
    i = KINDS.index(kind)
    _check(make_logits(kind, 2, 32001, 3, DTYPES[i % 3], seed=i), 3)


@pytest.mark.parametrize("layout", ("column_major", "strided"))
@pytest.mark.parametrize("kind", ("nan", "ties_across_shards", "signed_zeros"))
def test_non_contiguous(layout, kind):
    _check(make_logits(kind, 3, 4001, 2, torch.bfloat16, seed=7), 2, layout)


@pytest.mark.parametrize("num_slices", (1, 3, 8))
def test_slices_and_131072_vocab(num_slices):
    _check(make_logits("ties_across_shards", 1, 131072, 4, torch.bfloat16, seed=num_slices), 4, num_slices=num_slices)


def test_tp8_empty_shards_and_many_rows():
    _check(make_logits("nan", 3, 32001, 8, torch.float16, seed=8), 8, num_slices=2)
    _check(make_logits("random", 2, 65, 8, torch.float32, seed=9), 8, num_slices=2)  # 6 empty shards
    _check(make_logits("all_neg_inf", 2, 65, 8, torch.float32, seed=9), 8, num_slices=2)
    _check(make_logits("int_ties", 64, 200, 2, torch.bfloat16, seed=10), 2, num_slices=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("nan", "signed_zeros", "pos_inf_ties"))
def test_dtypes(kind, dtype):
    _check(make_logits(kind, 2, 32001, 4, dtype, seed=11), 4)


def test_default_slices():
    full = make_logits("ties_across_shards", 2, 4001, 2, torch.bfloat16, seed=12)
    _check(full, 2, num_slices=vpa.default_num_slices(2))


def test_pick_kernel_alone():
    """Hand-made candidates from 3 ranks x 3 rows x K=3: NaN, signed zeros, sentinels beside -inf."""
    inf, nan, S = float("inf"), float("nan"), float(vpa.ID_LIMIT)
    cand = torch.tensor([
        [1.0, inf, -inf, 5, 9, S], [-0.0, -1.0, -inf, 2, 3, S], [-inf, -inf, -inf, 7, 8, S],  # rank 0
        [inf, nan, 2.0, 100, 140, 120], [0.0, -inf, -inf, 101, 102, S], [-inf, -inf, -inf, S, S, S],  # rank 1
        [nan, -inf, -inf, 200, 201, S], [-inf, -inf, -inf, S, S, S], [-inf, -inf, -inf, 300, S, S],  # rank 2
    ])
    # row 0: first NaN (140); row 1: -0.0 at 2 ties +0.0 at 101; row 2: all -inf, the sentinels lose
    assert vpa.pick_from_candidates_triton(cand, 3).tolist() == [140, 2, 7]
    assert vpa.pick_from_candidates_ref(cand, 3).tolist() == [140, 2, 7]
