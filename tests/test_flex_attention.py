"""The "flex" attention backend (florist/layers/flex.py): FlexAttention under a document mask.

* Everywhere: its block table against the dense mask, block by block (exactly the key blocks
  holding a key some query of the block may see), on ragged batches and graph buckets; and the
  backend's output against the per-sequence SDPA backend (eager FlexAttention on the CPU).
* GPU: compiled, against varlen, eagerly and replayed from a CUDA graph (bf16, Qwen3's heads).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from florist.engine.batch import HostBatch, pack, to_device, views
from florist.engine.graph_runner import bucket
from florist.layers import attention, flex


def _eager_batch(lens, device="cpu"):
    return to_device(HostBatch.from_sequences([[1] * n for n in lens]), torch.device(device))


def _graph_batch(lens, device="cpu"):
    """The padded batch the graph runner builds: padding in a dummy sequence, empty slots after."""
    host = HostBatch.from_sequences([[1] * n for n in lens])
    tokens, seqs, max_seqlen, exact = bucket(host)
    return views(torch.from_numpy(pack(host, tokens, seqs)).to(device), tokens, seqs, False, max_seqlen=max_seqlen,
                 seq_lens_host=(), single_sequence=seqs == 2, has_padding=not exact)


def _dense_mask(batch, causal: bool) -> torch.Tensor:
    seq = batch.seq_ids.long()
    mask = seq[:, None] == seq[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    return mask


LAYOUTS = {
    "one": (_eager_batch, [300]),
    "ragged": (_eager_batch, [1, 7, 130, 33, 100, 256, 5]),
    "block-aligned": (_eager_batch, [128, 128, 256]),
    "bucket": (_graph_batch, [37, 100, 9]),
    "bucket-long": (_graph_batch, [500, 3, 129, 64]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_table_visits_exactly_the_blocks_the_mask_needs(layout, causal):
    make, lens = LAYOUTS[layout]
    batch = make(lens)
    t = batch.num_tokens
    count, indices, full_count, full_indices = flex.block_table(batch, causal)
    nb = -(-t // flex.BLOCK)
    assert count.shape == full_count.shape == (1, 1, nb) and indices.shape == full_indices.shape == (1, 1, nb, nb)

    def listed(num, idx):
        table = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            n = int(num[0, 0, i])
            visited = idx[0, 0, i, :n].long()
            assert len(set(visited.tolist())) == n and (n == 0 or (int(visited.min()) >= 0 and int(visited.max()) < nb))
            table[i, visited] = True
        return table

    masked, full = listed(count, indices), listed(full_count, full_indices)
    padded = torch.zeros(nb * flex.BLOCK, nb * flex.BLOCK, dtype=torch.bool)
    padded[:t, :t] = _dense_mask(batch, causal)
    blocks = padded.view(nb, flex.BLOCK, nb, flex.BLOCK)
    assert not (masked & full).any()
    assert torch.equal(masked | full, blocks.any(dim=3).any(dim=1))  # every block a query may need, no other
    assert bool(blocks.all(dim=3).all(dim=1)[full].all())  # a full block needs no mask
    if layout in ("one", "block-aligned"):  # query blocks inside one long sequence: some key blocks need no mask
        assert full.any()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("layout", ["ragged", "bucket"])
def test_flex_matches_per_sequence_sdpa(layout, causal):
    make, lens = LAYOUTS[layout]
    batch = make(lens)
    t, hq, hkv, d = batch.num_tokens, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))  # strided, as the models pass them
    out = attention.select_backend("flex", torch.device("cpu"))(q, k, v, batch, causal, 0.3)
    host = batch if batch.seq_lens_host else _with_host_lengths(batch)
    ref = attention.select_backend("sdpa", torch.device("cpu"))(q, k, v, host, causal, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _with_host_lengths(batch):
    """A bucket's batch with its sequence lengths (dummy and empty slots included) on the host,
    for the SDPA backend's per-sequence loop."""
    import dataclasses

    lens = tuple(int(n) for n in batch.cu_seqlens.diff())
    return dataclasses.replace(batch, seq_lens_host=lens)


def test_flex_is_an_attention_backend():
    assert "flex" in attention.available_backends()
    fn = attention.select_backend("flex", torch.device("cpu"))
    q = torch.randn(0, 2, 8)
    assert fn(q, q[:, :1], q[:, :1], _eager_batch([3]), True, 1.0).shape == (0, 2, 8)


def test_the_mask_is_made_once_per_batch(monkeypatch):
    """Every layer of a forward passes the same batch: one block mask serves them all; a new
    batch, or the other masking, gets its own."""
    made = []
    real = flex.block_mask
    monkeypatch.setattr(flex, "block_mask", lambda batch, causal: made.append((batch.num_tokens, causal)) or real(batch, causal))
    fn = attention.select_backend("flex", torch.device("cpu"))
    first, second = _eager_batch([5, 9]), _eager_batch([5, 9])
    q = torch.randn(14, 2, 8)
    outs = [fn(q, q, q, first, True, 0.5) for _ in range(3)]
    assert made == [(14, True)] and all(torch.equal(o, outs[0]) for o in outs)
    fn(q, q, q, second, True, 0.5)
    fn(q, q, q, second, False, 0.5)
    assert made == [(14, True), (14, True), (14, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_flex_on_cuda_matches_varlen_and_replays(causal):
    dev = torch.device("cuda")
    rng = np.random.default_rng(1)
    flex_fn, varlen = attention.select_backend("flex", dev), attention.select_backend("varlen", dev)
    layouts = [(_graph_batch, [128]), (_graph_batch, [37, 100, 9]), (_graph_batch, [int(n) for n in rng.integers(16, 300, size=20)]),
               (_eager_batch, [600, 900, 37])]  # long sequences: key blocks that need no mask
    for make, lens in layouts:
        batch = make(lens, "cuda")
        t, hq, hkv, d = batch.num_tokens, 16, 8, 128
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        ref = varlen(q, k, v, batch, causal, d**-0.5)
        out = flex_fn(q, k, v, batch, causal, d**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = flex_fn(q, k, v, batch, causal, d**-0.5)
        qkv.copy_(torch.randn_like(qkv))  # new inputs, same addresses
        graph.replay()
        torch.testing.assert_close(replayed.float(), varlen(q, k, v, batch, causal, d**-0.5).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_engine_runs_on_flex(qwen3_dir, pplx_dir, device):
    """Engine.from_pretrained(attention_backend="flex") embeds as the default backend does, causal
    and bidirectional; on CUDA also from the CUDA graphs of its buckets (a shape's third batch
    replays one)."""
    import florist

    rng = np.random.default_rng(3)
    for path in (qwen3_dir, pplx_dir):
        flexed = florist.Engine.from_pretrained(path, device=device, attention_backend="flex")
        default = florist.Engine.from_pretrained(path, device=device)
        for lens in ([9], [30, 4, 17], [200, 130]):
            seqs = [rng.integers(5, 100, size=n).astype(np.int32) for n in lens]
            want = default.step(HostBatch.from_sequences(seqs)).numpy()
            for _ in range(3):  # first sight, capture, replay
                got = flexed.step(HostBatch.from_sequences(seqs)).numpy()
                cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
                assert cos.min() >= (0.9999 if device == "cpu" else 0.999), cos
        if device == "cuda":
            assert flexed.runner.graphs.stats()["graphs"] >= 1  # flex ran inside captured graphs
