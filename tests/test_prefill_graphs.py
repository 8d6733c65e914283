"""Prefills padded to a CUDA-graph bucket (florist/engine/generation/prefill_graphs.py): the padded
layout, and, on the CPU, that a padded prefill computes the unpadded one's next ids and k/v
(graph capture and replay themselves: tests/test_gpu_generation.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import florist
from florist.engine.batch import HostBatch, pack
from florist.engine.generation.batch import pack_prefill, pad_prefill, prefill_seq_lens
from florist.engine.generation.config import GenerationConfig
from florist.engine.graph_runner import bucket_of

from test_generation import make_causal_lm, prompts_for


@pytest.mark.parametrize("lens", [(5,), (64,), (3, 17, 40), (1, 1, 1, 1, 1, 1, 1), (100, 200, 300, 450)])
def test_padded_layout_is_the_embedding_layout_plus_scratch_slots(lens):
    rng = np.random.default_rng(sum(lens))
    prompts = [rng.integers(0, 1000, size=n).tolist() for n in lens]
    slots, max_len = list(range(3, 3 + len(lens))), 512
    packed = pack_prefill(prompts, slots, max_len)
    t, b = sum(lens), len(lens)
    tokens, seqs, _, exact = bucket_of(t, b, max(lens))
    padded = pad_prefill(packed, t, b, tokens, seqs, scratch_slot=9, max_len=max_len)
    host = HostBatch.from_sequences(prompts)
    assert np.array_equal(padded[: -tokens], pack(host, tokens, seqs))  # ids, positions, seq ids, cu_seqlens
    slot_mapping = padded[-tokens:]
    assert np.array_equal(slot_mapping[:t], packed[-t:])  # the prompts' k/v land where unpadded they would
    assert np.array_equal(slot_mapping[t:], 9 * max_len + np.arange(tokens - t))  # the dummy's in the scratch slot
    assert exact == (b == 1 and t == tokens)
    out = np.full(padded.size, -7, dtype=np.int32)
    assert pad_prefill(packed, t, b, tokens, seqs, 9, max_len, out=out) is out and np.array_equal(out, padded)


def test_a_bucket_that_cannot_hold_the_step_is_refused():
    packed = pack_prefill([[1, 2, 3], [4, 5]], [0, 1], 64)
    with pytest.raises(ValueError, match="cannot hold"):
        pad_prefill(packed, 5, 2, 64, 2, 7, 64)  # no room for the dummy sequence
    with pytest.raises(ValueError, match="cannot hold"):
        pad_prefill(packed, 5, 2, 128, 4, 7, 64)  # 123 padding tokens do not fit a 64-token scratch slot


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("qwen3-causal-lm-prefill"), tie=True)


@pytest.mark.parametrize("lens", [(5,), (64,), (3, 17, 40, 9)])
def test_a_padded_prefill_computes_the_unpadded_ones_ids_and_kv(lm_dir, lens):
    engine = florist.Engine.from_pretrained(lm_dir, device="cpu", generation=GenerationConfig(max_num_seqs=8, max_model_len=256))
    runner = engine.runner.runner
    prompts = prompts_for(lm_dir, lens, seed=len(lens))
    slots = list(range(len(lens)))
    packed = pack_prefill(prompts, slots, runner.max_len)
    t, b = sum(lens), len(lens)
    key = bucket_of(t, b, max(prefill_seq_lens(packed, t, b)))
    real = slice(0, runner.scratch_slot)
    with torch.inference_mode():
        runner.cache.data.zero_()
        unpadded = runner.prefill(packed, t, b)[:b].clone()
        cache = runner.cache.data[:, :, real].clone()
        runner.cache.data.zero_()
        padded = runner._prefill_forward(torch.from_numpy(pad_prefill(packed, t, b, key[0], key[1], runner.scratch_slot, runner.max_len)), key)
    assert padded.shape == (key[1],)
    assert torch.equal(padded[:b], unpadded)
    torch.testing.assert_close(runner.cache.data[:, :, real], cache, rtol=1e-5, atol=1e-5)
