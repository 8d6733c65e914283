"""The lazy first-sight / capture / replay cycle the three CUDA graph runners share
(florist/engine/lazy_graphs.py), on the CPU: CUDA's graph primitives are replaced by stand-ins that
record what was asked and reserve 2 MiB per capture, so the cycle, its logs and its memory
accounting are checked without a GPU (capture and replay themselves: tests/test_gpu.py and
tests/test_gpu_generation.py)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch

from florist.engine.batch import HostBatch
from florist.engine.graph_runner import CAPTURE_LOG, FIRST_SIGHT_LOG, GraphRunner, bucket

MIB = 2**20


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def pool(self):
        return "the pool"

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's graph primitives as stand-ins; `reserved` grows by 2 MiB per capture."""
    state = {"reserved": 100 * MIB, "pools": []}

    @contextlib.contextmanager
    def graph(g, pool=None):
        state["pools"].append(pool)
        state["reserved"] += 2 * MIB
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    return state


def messages(caplog, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def test_embedding_graphs_keep_their_log_lines_and_stats(fake_cuda, caplog):
    """The embedding runner on the shared cycle: the lines bench/serve.py reads, the same stats keys."""
    def forward(batch):
        return torch.zeros(batch.cu_seqlens.shape[0] - 1, 3)

    runner = GraphRunner(forward, torch.device("cpu"), max_tokens=1024, with_token_types=False)
    host = HostBatch.from_sequences([np.arange(1, 41, dtype=np.int32), np.arange(1, 8, dtype=np.int32)])
    with caplog.at_level(logging.INFO, logger="florist.engine.graph_runner"):
        outs = [runner.run(host) for _ in range(3)]
    assert all(o.shape == (2, 3) for o in outs)
    assert runner.graphs[bucket(host)].graph.replays == 2
    assert messages(caplog, FIRST_SIGHT_LOG.split(" for ")[0])[0].startswith(
        "ran a first-sight batch eagerly for 64 tokens, up to 3 sequences, longest 64: launched in ")
    captures = messages(caplog, CAPTURE_LOG.split(" for ")[0])
    assert len(captures) == 1 and captures[0].endswith("(1 graphs, 2 MiB)")
    stats = runner.stats()
    assert set(stats) == {"graphs", "graph_memory_bytes", "capture_seconds", "first_sight_seconds", "max_tokens"}
    assert stats["graphs"] == 1 and stats["graph_memory_bytes"] == 2 * MIB
